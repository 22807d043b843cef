-- SPDX-License-Identifier: MIT
-- The experts stage (gate_up + SwiGLU + down) of one rank of EP8 for every model preset, under
-- four routing distributions and three pads, beside cuBLAS in the same run: a dense GEMM pair of
-- the same FLOPs and a per-expert loop of GEMMs.
--
--   lua scenarios/experts.lua [--device D] [--models a,b] [--dists a,b] [--pads 1,128,256]
--                             [--iters N] [--tokens T] [--hidden H] [--ffn F] [--seed S] [--json FILE]
--                             [--svg FILE] [--progress auto|on|off] [--precision bf16|fp8]
--
-- For each (model, distribution): the ids of all 8 ranks x T tokens (T = 7168 on a GPU), rank 0's
-- schedule at each pad with capacity = the rows it needs, xs = randn [rows, H], the preset's
-- local weights (E/8 experts, randn with std 1/sqrt(H) and 1/sqrt(F), made once per preset).
-- Each configuration runs once and the first and last rows of the most and the least loaded
-- expert are copied out before it is timed with moe.bench (device events, 3 warm-ups, the
-- median); they are compared with the CPU reference, one CPU call per (model, distribution).  TFLOP/s counts rows used (padding included) x 6·H·F; "useful"
-- counts the routes only.  The cuBLAS numbers come from build/bench/cublas_baseline (or
-- $MOE_BUILD_DIR/bench/cublas_baseline), run once per preset; n/a where it or a GPU is absent.
-- On the CPU the presets keep their E and top-k but run at a tiny H, F and T, and the times are
-- wall clock: only the GPU's are meaningful.  --svg draws each preset's TFLOP/s beside cuBLAS's;
-- --progress writes a line per configuration with the time left on stderr (auto: where it is a
-- terminal).  --precision fp8 runs the FP8 experts (moe.experts on e4m3 xs and weights,
-- block-scaled: moe_experts_fp8) and checks them against the CPU's FP8 experts; H and F must
-- then be multiples of 128 (on the CPU, F defaults to 128), and the cuBLAS column is cuBLASLt's
-- block-scaled FP8 dense pair (cublas_baseline --precision fp8).  Exits 1 when a check fails, 2 on
-- a bad flag or a configuration the library refuses.
local cli = require "moelab.cli"
local moe = cli.require "moelab"
local json = require "moelab.json"
local compat = require "moelab.compat"
local runinfo = require "moelab.runinfo"
local progress = require "moelab.progress"
local svg = require "moelab.svg"

local MODEL_KEYS = { "kimi_k2", "deepseek_v3", "deepseek_v4_pro", "glm5", "qwen3_235b", "qwen3_5_397b" }
local DISTS = { "uniform", "zipf", "hotspot", "router" }
local W = 8
local ZIPF_S = 1.0     -- P(popularity rank r) ∝ r^-s
local HOT_SHARE = 0.8  -- hotspot: this share of routes goes to E/8 experts
local ROUTER_STD = 1.5

local opts = cli.parse(arg, {
  { "device", "string", moe.default_device(), "cpu or cuda:N" },
  { "models", "list", nil, "presets, comma separated (default all: " .. table.concat(MODEL_KEYS, ",") .. ")" },
  { "dists", "list", nil, "routing distributions (default all: " .. table.concat(DISTS, ",") .. ")" },
  { "pads", "list", nil, "pads (default 1,128,256)" },
  { "iters", "integer", nil, "timed runs per configuration, the median is reported (default 10; 1 on the CPU)" },
  { "tokens", "integer", nil, "tokens per rank (default 7168; 32 on the CPU)" },
  { "hidden", "integer", nil, "override every preset's H (default the preset's; 128 on the CPU)" },
  { "ffn", "integer", nil, "override every preset's F (default the preset's; on the CPU 64, or 128 with --precision fp8)" },
  { "seed", "integer", 1, "seed of the ids, inputs and weights" },
  { "json", "string", nil, "also write the table as JSON to this file" },
  { "svg", "string", nil, "also draw the table as an SVG picture in this file" },
  { "progress", "string", "auto", "a line per configuration on stderr: auto (where it is a terminal), on or off" },
  { "precision", "string", "bf16", "bf16, or fp8 (block-scaled e4m3 xs and weights)" },
}, "lua scenarios/experts.lua: the experts stage per preset x routing distribution x pad, beside cuBLAS")

local function usage_error(msg)
  io.stderr:write("scenarios/experts.lua: ", msg, "\n")
  os.exit(2)
end

local function pick(list, allowed, what)
  if not list then return allowed end
  local ok = {}
  for _, a in ipairs(allowed) do ok[a] = true end
  for _, v in ipairs(list) do
    if not ok[v] then
      usage_error(string.format("unknown %s '%s' (expected some of %s)", what, v, table.concat(allowed, ",")))
    end
  end
  return list
end

local dev = opts.device
if dev ~= "cpu" and not dev:match("^cuda:%d+$") then
  usage_error("--device must be cpu or cuda:N, got '" .. dev .. "'")
end
local gpu = dev ~= "cpu"
local present = {}
for _, d in ipairs(moe.devices()) do present[d] = true end
if not present[dev] then
  usage_error(string.format("--device %s: not on this machine (%s)", dev, table.concat(moe.devices(), ", ")))
end
local model_keys = pick(opts.models, MODEL_KEYS, "model")
local dists = pick(opts.dists, DISTS, "distribution")
local pads = {}
for i, p in ipairs(opts.pads or { "1", "128", "256" }) do
  pads[i] = compat.tointeger(tonumber(p))
  if not pads[i] or pads[i] < 1 then usage_error("--pads needs integers >= 1, got '" .. p .. "'") end
end
local fp8 = opts.precision == "fp8"
if not fp8 and opts.precision ~= "bf16" then usage_error("--precision must be bf16 or fp8, got '" .. opts.precision .. "'") end
for _, f in ipairs { "hidden", "ffn" } do
  if fp8 and opts[f] and opts[f] % 128 ~= 0 then
    usage_error(string.format("--precision fp8 needs --%s a multiple of 128 (the FP8 block), got %d", f, opts[f]))
  end
end
local T = opts.tokens or (gpu and 7168 or 32)
local iters = opts.iters or (gpu and 10 or 1)
local warmup = gpu and 3 or 0
if T < 1 or iters < 1 then usage_error("--tokens and --iters must be >= 1") end
for _, f in ipairs { "hidden", "ffn" } do
  if opts[f] and opts[f] < 1 then usage_error(string.format("--%s must be >= 1, got %d", f, opts[f])) end
end
local json_file, svg_file = cli.output("json", opts.json), cli.output("svg", opts.svg)
local steps = cli.guard("--progress", progress.new, #model_keys * #dists * #pads, { mode = opts.progress })

local function p(...) io.write(string.format(...), "\n") io.flush() end

-- ---------------------------------------------------------------- routing distributions

-- Popularity rank r (0-based) -> expert id, round robin over the ranks (a balanced placement):
-- rank 0 owns popularity ranks 0, W, 2W, ..., so every rank holds its share of hot and cold.
local function placed(r, E)
  return (r % W) * math.floor(E / W) + math.floor(r / W)
end

-- ids i32 [W, T, K] on dev: each token's K distinct experts drawn from the distribution with
-- Lua's seeded generator (xoshiro256**), or the softmax router on randn logits.
local function make_ids(dist, E, K, seed)
  local N = W * T
  if dist == "router" then
    local logits = moe.randn({ N, E }, { seed = seed, std = ROUTER_STD, device = dev })
    local ids = moe.route { logits = logits, k = K, scoring = "softmax" }
    logits:close()
    return ids:view(0, { W, T, K })
  end
  math.randomseed(seed)
  local random = math.random
  local draw
  if dist == "uniform" then
    draw = function() return random(0, E - 1) end
  elseif dist == "zipf" then
    local cdf, sum = {}, 0.0
    for r = 1, E do
      sum = sum + r ^ -ZIPF_S
      cdf[r] = sum
    end
    draw = function()
      local u = random() * sum
      local lo, hi = 1, E
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if cdf[mid] < u then lo = mid + 1 else hi = mid end
      end
      return placed(lo - 1, E)
    end
  end
  local nhot = math.max(math.floor(E / 8), 1)
  local ids, taken, n = {}, {}, 0
  for t = 1, N do
    local hot_taken = 0
    for slot = 1, K do
      local e
      if dist == "hotspot" then
        -- the side first, then distinct experts within it, so that rejections keep the share
        local hot = random() < HOT_SHARE
        if hot and hot_taken == nhot then hot = false end
        if not hot and slot - 1 - hot_taken == E - nhot then hot = true end
        if hot then hot_taken = hot_taken + 1 end
        repeat
          e = placed(hot and random(0, nhot - 1) or random(nhot, E - 1), E)
        until taken[e] ~= t
      else
        repeat e = draw() until taken[e] ~= t
      end
      taken[e] = t
      n = n + 1
      ids[n] = e
    end
  end
  return moe.tensor(ids, { dtype = "i32", device = dev, shape = { W, T, K } })
end

-- ---------------------------------------------------------------- checks against the CPU

-- A small CPU problem per (model, distribution): the first and the last row of the segments of
-- (at most) two experts at every pad, their xs rows and the device's output rows copied to the
-- host as each pad runs, and the two experts' weights.  One CPU call covers all pads: most of
-- its time goes to converting an expert's weights, whatever the number of rows.
local Check = {}
Check.__index = Check

function Check.new(experts, scheds, w, H, F)
  local wgu, wd = w.w_gate_up, w.w_down
  local c = setmetatable({ experts = experts, H = H, plan = {}, offs = { 0 }, fp8 = w.w_gate_up_scale ~= nil }, Check)
  for slot, e in ipairs(experts) do
    for i, sc in ipairs(scheds) do
      local lo, hi = sc.off[e + 1], sc.off[e + 2] - 1
      c.plan[#c.plan + 1] = { pad = i, row = lo }
      if hi > lo then c.plan[#c.plan + 1] = { pad = i, row = hi } end
    end
    c.offs[slot + 1] = #c.plan
  end
  local n, ne = #c.plan, #experts
  if n == 0 then return c end
  local wtype = c.fp8 and "e4m3" or "bf16"
  c.xs = moe.zeros({ n, H }, { dtype = wtype })
  c.got = moe.zeros({ n, H }, { dtype = "bf16" })
  c.w = { w_gate_up = moe.zeros({ ne, 2 * F, H }, { dtype = wtype }), w_down = moe.zeros({ ne, H, F }, { dtype = wtype }) }
  if c.fp8 then
    c.xs_scale = moe.zeros({ H / 128, n })
    c.w.w_gate_up_scale = moe.zeros({ ne, 2 * F / 128, H / 128 })
    c.w.w_down_scale = moe.zeros({ ne, H / 128, F / 128 })
  end
  for name, dst in pairs(c.w) do
    for i, e in ipairs(experts) do
      local d, src = dst:select(i), w[name]:select(e + 1)
      d:copy(src)
      d:close()
      src:close()
    end
  end
  return c
end

-- Copies pad i's rows of xs and ys (right after the run that wrote ys, before any timing).
-- FP8: and the rows' scales, a column each of xs_scale [H/128, C].
function Check:take(i, xs, ys, xs_scale)
  local H, n = self.H, #self.plan
  for j, pl in ipairs(self.plan) do
    if pl.pad == i then
      local dx, sx = self.xs:view((j - 1) * H, { 1, H }), xs:view(pl.row * H, { 1, H })
      local dy, sy = self.got:view((j - 1) * H, { 1, H }), ys:view(pl.row * H, { 1, H })
      dx:copy(sx)
      dy:copy(sy)
      for _, t in ipairs { dx, sx, dy, sy } do t:close() end
      for kb = 0, (xs_scale and H / 128 or 0) - 1 do
        local d, src = self.xs_scale:view(kb * n + j - 1, { 1 }), xs_scale:view(kb * xs.shape[1] + pl.row, { 1 })
        d:copy(src)
        d:close()
        src:close()
      end
    end
  end
end

-- Runs the CPU reference; returns per pad index {rows, rel_max, rel_l2, nans, pass} (nil where
-- that pad had no row to check).
function Check:finish()
  local out = {}
  if #self.plan == 0 then return out end
  local ref = moe.experts { x = self.xs, x_scale = self.xs_scale, offsets = moe.tensor(self.offs, { dtype = "i32" }),
    w_gate_up = self.w.w_gate_up, w_down = self.w.w_down, w_gate_up_scale = self.w.w_gate_up_scale,
    w_down_scale = self.w.w_down_scale }
  local gf, rf, H = self.got:flat(), ref:flat(), self.H
  local by_pad = {}
  for j, pl in ipairs(self.plan) do
    local b = by_pad[pl.pad] or { got = {}, ref = {}, rows = 0 }
    by_pad[pl.pad] = b
    b.rows = b.rows + 1
    for k = (j - 1) * H + 1, j * H do
      b.got[#b.got + 1] = gf[k]
      b.ref[#b.ref + 1] = rf[k]
    end
  end
  for i, b in pairs(by_pad) do
    local m = moe.check.metrics(b.got, b.ref)
    out[i] = { rows = b.rows, experts = self.experts, rel_max = m.rel_max, rel_l2 = m.rel_l2, nans = m.nans,
      pass = (pcall(moe.check.close, b.got, b.ref)) }
  end
  for _, t in pairs(self.w) do t:close() end
  for _, k in ipairs { "xs", "got", "xs_scale" } do if self[k] then self[k]:close() end end
  ref:close()
  return out
end

-- ---------------------------------------------------------------- one preset

local function index_of(list, v)
  for i, x in ipairs(list) do if x == v then return i end end
end

-- Runs every (distribution, pad) of one preset; returns its shape, its rows and the baseline's
-- cases.  Seeds follow a preset's and a distribution's place in the full lists, so that a run
-- of a subset (--models, --dists) draws the same ids, inputs and weights as the full run.
local function run_model(key)
  local mi = index_of(MODEL_KEYS, key)
  local m = moe.models[key]
  local E, K = m.experts, m.k
  local EL = math.floor(E / W)
  local H = opts.hidden or (gpu and m.hidden or 128)
  local F = opts.ffn or (gpu and m.ffn or (fp8 and 128 or 64))
  local wseed = opts.seed * 7919 + mi * 101
  local wgu = moe.randn({ EL, 2 * F, H },
    { dtype = "bf16", std = 1 / math.sqrt(H), seed = wseed, device = dev })
  local wd = moe.randn({ EL, H, F }, { dtype = "bf16", std = 1 / math.sqrt(F), seed = wseed + 1, device = dev })
  -- FP8: the weights quantized per 128 x 128 block, the bf16 copies dropped
  local w = { w_gate_up = wgu, w_down = wd }
  if fp8 then
    w.w_gate_up, w.w_gate_up_scale = moe.quantize(wgu, { kind = "block" })
    w.w_down, w.w_down_scale = moe.quantize(wd, { kind = "block" })
    wgu:close()
    wd:close()
  end
  local shape = { key = key, name = m.name, E = E, EL = EL, K = K, H = H, F = F,
    reduced = H ~= m.hidden or F ~= m.ffn or T ~= 7168 }
  local rows, cases = {}, {}
  for _, dist in ipairs(dists) do
    local di = index_of(DISTS, dist)
    local ids = make_ids(dist, E, K, opts.seed * 1000003 + mi * 1009 + di * 17)
    -- rank 0's schedule at each pad: first with the worst-case capacity, to learn the rows it
    -- needs, then with exactly that capacity
    local scheds, cmax = {}, 1
    for i, pad in ipairs(pads) do
      local first = moe.schedule { ids = ids, experts = E, rank = 0, pad = pad }
      local need = math.max(first:read_stats().rows_needed, 1)
      local s = moe.schedule { ids = ids, experts = E, rank = 0, pad = pad, capacity = need }
      scheds[i] = { s = s, st = s:read_stats(), counts = s.counts:flat(), padded = s.tokens_per_expert:flat(),
        off = s.expert_offsets:flat() }
      cmax = math.max(cmax, need)
    end
    -- the experts checked: the most loaded one and the least loaded non-empty one (loads do
    -- not depend on the pad)
    local counts = scheds[1].counts
    local routes, maxl, hi_e, lo_e = 0, 0, nil, nil
    for e = 0, EL - 1 do
      local c = counts[e + 1]
      routes = routes + c
      if c > maxl then maxl, hi_e = c, e end
      if c > 0 and (not lo_e or c < counts[lo_e + 1]) then lo_e = e end
    end
    local check_experts = { hi_e, lo_e ~= hi_e and lo_e or nil }
    local check = Check.new(check_experts, scheds, w, H, F)

    local xs = moe.randn({ cmax, H }, { dtype = "bf16", seed = wseed + 2 + di, device = dev })
    local ys = moe.zeros({ cmax, H }, { dtype = "bf16", device = dev })
    local dist_rows = {}
    for i, pad in ipairs(pads) do
      local sc = scheds[i]
      local C = sc.st.rows_used
      local row = { model = m.name, key = key, dist = dist, pad = pad, E = E, EL = EL, K = K, H = H, F = F, T = T,
        rows = C, routes = routes, max_load = maxl, mean_load = routes / EL, dropped = sc.st.dropped }
      if C > 0 then
        local xv, yv = xs:view(0, { C, H }), ys:view(0, { C, H })
        local xv_scale
        if fp8 then -- the rows quantized per token, scales transposed (what the FP8 experts read)
          local q, sc_t = moe.quantize(xv, { kind = "token_t" })
          xv:close()
          xv, xv_scale = q, sc_t
        end
        local offsets = sc.s.expert_offsets
        local function run()
          moe.experts { x = xv, x_scale = xv_scale, offsets = offsets, w_gate_up = w.w_gate_up, w_down = w.w_down,
            w_gate_up_scale = w.w_gate_up_scale, w_down_scale = w.w_down_scale, out = yv }
        end
        run() -- the output to check, taken before any timing
        check:take(i, xv, yv, xv_scale)
        local r = moe.bench(run, { warmup = warmup, iters = iters, device = dev })
        row.ms = r.median_ms
        row.min_ms = r.min_ms
        row.tflops = C * 6.0 * H * F / (r.median_ms * 1e9)
        row.useful_tflops = routes * 6.0 * H * F / (r.median_ms * 1e9)
        xv:close()
        yv:close()
        if xv_scale then xv_scale:close() end
      end
      dist_rows[i] = row
      rows[#rows + 1] = row
      steps:step(string.format("%s %s pad %d: %s ms", m.name, dist, pad,
        row.ms and string.format("%.3f", row.ms) or "-"))
      cases[#cases + 1] = sc.padded
    end
    for i, ck in pairs(check:finish()) do dist_rows[i].check = ck end
    xs:close()
    ys:close()
    scheds = nil
    collectgarbage()
  end
  for _, t in pairs(w) do if not t.closed then t:close() end end
  return shape, rows, cases
end

-- ---------------------------------------------------------------- the cuBLAS baselines

local build_dir = os.getenv("MOE_BUILD_DIR") or "build"
local baseline_path = build_dir .. "/bench/cublas_baseline"
local baseline_note
do
  local f = io.open(baseline_path, "r")
  if f then f:close() end
  if not gpu then
    baseline_note = "cuBLAS baselines: n/a on the CPU"
  elseif not f then
    baseline_note = string.format("cuBLAS baselines: n/a (%s not found; it is built with CUDA: cmake --build %s)",
      baseline_path, build_dir)
  end
end

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- Runs the baseline on one preset's cases (each a list of padded per-expert row counts, the
-- work our kernel did) and fills the rows' cuBLAS columns.  Returns an error line or nil.  With
-- --precision fp8 the baseline is cuBLASLt's block-scaled FP8 dense pair (its dense column; no
-- per-expert loop).
local function run_baseline(shape, rows, cases)
  local tmp = os.tmpname()
  local f = assert(io.open(tmp, "w"))
  for _, c in ipairs(cases) do f:write(table.concat(c, " "), "\n") end
  f:close()
  local cmd = string.format("%s %d %d --device %s --warmup 3 --iters %d --precision %s --file %s 2>&1",
    shell_quote(baseline_path), shape.H, shape.F, dev:match("%d+$"), iters, opts.precision, shell_quote(tmp))
  local pipe = io.popen(cmd, "r")
  local results, notes, errs = {}, {}, {}
  for line in pipe:lines() do
    if line:match("^case=") then
      local kv = {}
      for k, v in line:gmatch("([%w_]+)=(%S+)") do kv[k] = v end
      local i = compat.tointeger(tonumber(kv.case))
      if i and rows[i] then
        local kind = kv.kind == "dense_fp8" and "dense" or kv.kind
        rows[i][kind .. "_ms"] = tonumber(kv.ms)
        rows[i][kind .. "_tflops"] = tonumber(kv.tflops)
      end
      results[#results + 1] = line
    elseif line:match("^#") then
      notes[#notes + 1] = line
    elseif line ~= "" then
      errs[#errs + 1] = line
    end
  end
  local ok, how, code = pipe:close()
  os.remove(tmp)
  if not ok then
    return string.format("cublas_baseline %s %s: %s", how, tostring(code), errs[1] or "(no output)"), notes
  end
  return nil, notes
end

-- ---------------------------------------------------------------- the report

local function fmt(v, f) return v and string.format(f, v) or "n/a" end
local function rate(v) return v and string.format(v >= 10 and "%.1f" or "%.3g", v) or "n/a" end

p("moelab %s: the experts stage (gate_up + SwiGLU + down), rank 0 of EP%d, %d tokens per rank, on %s", moe.version,
  W, T, dev)
if fp8 then
  p("  fp8   e4m3 xs (1 x 128 scales) and weights (128 x 128 scales), f32 accumulation, bf16 out; checked against the")
  p("        CPU's FP8 experts")
end
p("  ids   every rank's ids drawn per distribution (seed %d); rank 0's schedule (roundrobin), capacity = rows needed",
  opts.seed)
p("        uniform: K distinct experts, uniform; zipf: P(popularity rank r) ∝ r^-%g, K distinct;", ZIPF_S)
p("        hotspot: %d%% of routes to E/8 experts; router: softmax top-K of randn logits, std %g", HOT_SHARE * 100,
  ROUTER_STD)
p("        (zipf, hotspot: experts placed by popularity round robin over the ranks; rank 0 owns the 1st, 9th, 17th, ...)")
p("  time  %s", gpu and string.format("median of %d runs, device events, after %d warm-ups", iters, warmup)
  or string.format("wall clock on the CPU at a tiny shape, median of %d: only meaningful on a GPU", iters))
p("  rate  TFLOP/s = rows used (padding included) x 6·H·F / time; useful = routes x 6·H·F / time;")
p(fp8 and "        the ceiling is the cuBLAS column: cuBLASLt's FP8 dense pair, ~1,100-1,300 on an H200"
  or "        dense bf16 ceiling ~790 on an H200")
p("  check the first and last rows of the most and least loaded experts against the CPU reference (rtol 2e-2, L2 1e-2)")
if baseline_note then p("  %s", baseline_note) end
p("")
p("%-18s %-8s %4s %7s %16s %9s %8s %7s %8s %8s  %s", "model", "dist", "pad", "rows", "max/mean load", "ours ms",
  "TFLOP/s", "useful", "cuBLAS", "cuBLAS", "check")
p("%-18s %-8s %4s %7s %16s %9s %8s %7s %8s %8s", "", "", "", "", "", "", "", "", "dense", "/expert")

local all_rows, shapes, failed, baseline_errors, baseline_notes = {}, {}, false, {}, {}
for _, key in ipairs(model_keys) do
  -- a failed check is a result (status 1 below); an error here is a configuration the library
  -- refuses or a run that cannot be made (status 2)
  local shape, rows, cases = cli.guard(moe.models[key].name, run_model, key)
  collectgarbage()
  shapes[#shapes + 1] = shape
  if not baseline_note then
    local err, notes = run_baseline(shape, rows, cases)
    if err then baseline_errors[#baseline_errors + 1] = shape.name .. ": " .. err end
    for _, n in ipairs(notes) do baseline_notes[#baseline_notes + 1] = n end
  end
  for _, r in ipairs(rows) do
    local ck = r.check
    local status = not ck and "-" or ck.pass and string.format("ok %.1e", ck.rel_max)
      or string.format("FAIL %.1e/%.1e", ck.rel_max, ck.rel_l2)
    if ck and not ck.pass then failed = true end
    p("%-18s %-8s %4d %7d %16s %9s %8s %7s %8s %8s  %s", r.model, r.dist, r.pad, r.rows,
      string.format("%d / %.1f", r.max_load, r.mean_load), fmt(r.ms, "%.3f"), rate(r.tflops),
      rate(r.useful_tflops), rate(r.dense_tflops), rate(r.per_expert_tflops), status)
    all_rows[#all_rows + 1] = r
  end
end

p("")
for _, s in ipairs(shapes) do
  p("  %-18s E = %d (%d on rank 0), top-%d, H = %d, F = %d%s", s.name, s.E, s.EL, s.K, s.H, s.F,
    s.reduced and string.format(" (real H = %d, F = %d, T = 7168)", moe.models[s.key].hidden, moe.models[s.key].ffn)
    or "")
end
if not baseline_note then
  p("  cuBLAS: dense = one gate_up GEMM [rows x H] x [H x 2F] and one down GEMM [rows x F] x [F x H] over all rows;")
  if fp8 then
    p("          cuBLASLt, e4m3 in with the same block scales (rows rounded up to 16), f32 accumulate, bf16 out;")
    p("          SwiGLU and h's quantization omitted; no /expert loop; TFLOP/s over the same rows x 6·H·F as ours")
  else
    p("          /expert = the same pair per expert with its padded row count and its own weights, back to back;")
    p("          bf16 in, f32 accumulate, bf16 out; SwiGLU omitted; TFLOP/s over the same rows x 6·H·F as ours")
  end
end
for _, e in ipairs(baseline_errors) do p("  cuBLAS baseline failed, %s", e) end
if failed then p("  a check FAILED: see the check column") end

if json_file then
  json_file:write(json.encode { run = runinfo.collect { device = dev }, device = dev, world = W, tokens = T,
    iters = iters, warmup = warmup, seed = opts.seed, precision = opts.precision,
    zipf_s = ZIPF_S, hot_share = HOT_SHARE, router_std = ROUTER_STD, models = shapes, rows = all_rows,
    baseline = { path = baseline_path, note = baseline_note, notes = baseline_notes, errors = baseline_errors } }, "\n")
  json_file:close()
end
if svg_file then
  local doc = svg.new(960, 0)
  doc:text(20, 28, string.format("moelab %s: the experts stage, rank 0 of EP%d, %d tokens per rank, on %s", moe.version,
    W, T, dev), { ["font-weight"] = "bold", ["font-size"] = 15 })
  doc:text(20, 48, gpu and "TFLOP/s = rows used x 6·H·F / median time; cuBLAS over the same rows"
    or "TFLOP/s from wall clock at a tiny shape on the CPU (only the GPU's are meaningful); cuBLAS n/a")
  local y = 64
  for _, sh in ipairs(shapes) do
    local bars = {}
    for _, r in ipairs(all_rows) do
      if r.key == sh.key then
        bars[#bars + 1] = { label = string.format("%s, pad %d", r.dist, r.pad),
          values = { r.tflops, r.dense_tflops, r.per_expert_tflops },
          marks = gpu and not fp8 and { { value = 790, label = "dense bf16 ceiling of an H200" } } or nil }
      end
    end
    y = y + svg.bars(doc, { x = 20, y = y, width = 920, rows = bars, unit = "TFLOP/s",
      series = { "ours", "cuBLAS dense", "cuBLAS per expert" }, mark_name = gpu and not fp8 and "H200 bf16 ceiling" or nil,
      title = string.format("%s: E = %d (%d on rank 0), top-%d, H = %d, F = %d", sh.name, sh.E, sh.EL, sh.K, sh.H,
        sh.F) }) + 12
  end
  doc.height = y
  svg_file:write(doc:render()):close()
end
os.exit(failed and 1 or 0)
