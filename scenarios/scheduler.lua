-- SPDX-License-Identifier: MIT
-- The routed-token scheduler, side by side with the legacy algorithm (one block per (local
-- expert, source rank) pair scanning that rank's routes twice), on the shapes of the MoK table.
--
--   lua scenarios/scheduler.lua [--device D] [--pad B] [--layout L] [--capacity C] [--calls N] [--reps R]
--                               [--kernel NAME] [--json FILE] [--svg FILE] [--progress auto|on|off]
--
-- Each row: the ids of W ranks x T tokens routed by the model's router on router-like logits
-- (std 1.5); rank 0's schedule, run by the kernel --kernel names (the context's schedule_kernel
-- option; "auto", the library's choice, by default), so that every kernel can be timed on the
-- same shapes.  On a GPU each timing is N schedule calls captured in one CUDA graph and replayed,
-- timed with device events; the median over R replays, divided by N; the schedule is first
-- checked equal to the CPU's, bit for bit.  The legacy column comes from build/bench/schedule_legacy
-- (or $MOE_BUILD_DIR/bench/schedule_legacy) on the same W, T, E, K, pad and capacity, timed the
-- same way: its own ids (softmax top-K of randn logits), checked there against moe_schedule bit
-- for bit; n/a where the program or a GPU is absent, or with --layout peer_major.  --svg draws
-- both columns per shape; --progress writes a line per shape on stderr (auto: where it is a
-- terminal).  Exits 1 on a
-- mismatch; 2 on a bad flag or a configuration the library refuses (a --capacity one shape
-- overflows, say: the number applies to every shape).
local cli = require "moelab.cli"
local moe = cli.require "moelab"
local json = require "moelab.json"
local compat = require "moelab.compat"
local runinfo = require "moelab.runinfo"
local progress = require "moelab.progress"
local svg = require "moelab.svg"

local opts = cli.parse(arg, {
  { "device", "string", moe.default_device(), "cpu or cuda:N" },
  { "pad", "integer", 1, "pad each expert's rows to a multiple of this" },
  { "layout", "string", "roundrobin", "roundrobin or peer_major (the legacy baseline is roundrobin only)" },
  { "capacity", "string", "worst", "rows: 'worst' (every route on this rank, schedule's default), 'layer' "
    .. "(moe.layer's default, 2 T K + EL pad) or a number" },
  { "calls", "integer", 200, "schedule calls per timed graph" },
  { "reps", "integer", 9, "timed replays; the median is reported" },
  { "kernel", "string", "auto", "the GPU kernel: auto (the library's choice) or a name of the schedule_kernel option" },
  { "json", "string", nil, "also write the table as JSON to this file" },
  { "svg", "string", nil, "also draw the table as an SVG picture in this file" },
  { "progress", "string", "auto", "a line per shape on stderr: auto (where it is a terminal), on or off" },
}, "lua scenarios/scheduler.lua: the routed-token scheduler against the legacy baseline")
for _, f in ipairs { "calls", "reps", "pad" } do
  if opts[f] < 1 then cli.fail(string.format("--%s must be >= 1, got %d", f, opts[f])) end
end
if opts.layout ~= "roundrobin" and opts.layout ~= "peer_major" then
  cli.fail(string.format("--layout must be roundrobin or peer_major, got '%s'", opts.layout))
end
local json_file, svg_file = cli.output("json", opts.json), cli.output("svg", opts.svg)
cli.guard("--kernel", moe.core.config, "schedule_kernel", opts.kernel)

local dev = opts.device
local function capacity_of(c)
  if opts.capacity == "worst" then return nil end
  if opts.capacity == "layer" then return "twice_mean" end -- moe.layer's default
  local n = compat.tointeger(tonumber(opts.capacity))
  if not n or n < 0 then cli.fail("--capacity must be worst, layer or a number of rows >= 0, got " .. opts.capacity) end
  return n
end
local gpu = dev ~= "cpu"
local M = moe.models
local cases = {
  { label = "Kimi K2", model = M.kimi_k2, W = 8, T = 7168 },
  { label = "GLM-5", model = M.glm5, W = 8, T = 7168 },
  { label = "Qwen3.5-397B-A17B", model = M.qwen3_5_397b, W = 8, T = 7168 },
  { label = "DeepSeek-V4-Pro", model = M.deepseek_v4_pro, W = 8, T = 7168 },
}
for _, W in ipairs { 4, 8, 16, 32, 64 } do
  cases[#cases + 1] = { label = "E 384, top-8", model = M.kimi_k2, W = W, T = 512 }
end

local function route_ids(c, seed)
  local m = c.model
  local N = c.W * c.T
  local logits = moe.randn({ N, m.experts }, { seed = seed, std = 1.5, device = dev })
  local bias = m.scoring ~= "softmax" and moe.randn({ m.experts }, { seed = seed + 1, std = 0.005, device = dev }) or nil
  local ids = moe.route { logits = logits, k = m.k, scoring = m.scoring, bias = bias, groups = m.groups,
    topk_groups = m.topk_groups, scale = m.scale }
  return ids:view(0, { c.W, c.T, m.k })
end

-- The legacy baseline, a bench program (bench/schedule_legacy.cu) outside the library.
local build_dir = os.getenv("MOE_BUILD_DIR") or "build"
local legacy_path = build_dir .. "/bench/schedule_legacy"
local have_legacy = io.open(legacy_path, "r")
if have_legacy then have_legacy:close() end
local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- µs a call of the legacy scheduler on c's shape, or nil and what went wrong (a mismatch against
-- moe_schedule, found by the program, included).
local function run_legacy(c, capacity)
  local cmd = string.format("%s %d %d %d %d --capacity %d --pad %d --calls %d --reps %d --device %s 2>&1",
    shell_quote(legacy_path), c.W, c.T, c.model.experts, c.model.k, capacity, opts.pad, opts.calls, opts.reps,
    dev:match("%d+$") or "0")
  local out, code = compat.run(cmd)
  local us = tonumber(out:match("legacy_us ([%d.]+)"))
  if code == 0 and us then return us end
  return nil, string.format("legacy (exit %s: %s)", tostring(code), (out:match("[^\n]+") or "no output"))
end

local function median(l)
  table.sort(l)
  local n = #l
  return n % 2 == 1 and l[(n + 1) / 2] or (l[n / 2] + l[n / 2 + 1]) / 2 -- whole indices in each branch
end

-- Median µs per call of fn, over reps replays of a graph holding `calls` calls of it.
local function time_calls(fn)
  if not gpu then
    local r = moe.bench(fn, { warmup = 1, iters = math.min(opts.reps, 5), device = dev })
    return r.median_ms * 1e3
  end
  local g = moe.graph(function() for _ = 1, opts.calls do fn() end end, { device = dev })
  g:replay()
  local times = {}
  local start, stop = moe.event(dev), moe.event(dev)
  for i = 1, opts.reps do
    start:record()
    g:replay()
    stop:record()
    times[i] = stop:elapsed_since(start) * 1e3 / opts.calls
  end
  return median(times)
end

local rows = {}
local ok = true
local steps = cli.guard("--progress", progress.new, #cases, { mode = opts.progress })
for i, c in ipairs(cases) do
  local m = c.model
  local shape = string.format("%s, EP%d, T %d", c.label, c.W, c.T)
  local ids = cli.guard(shape, route_ids, c, 1000 + i)
  local plan = { ids = ids, experts = m.experts, rank = 0, pad = opts.pad, layout = opts.layout, capacity = capacity_of(c) }
  local s = cli.guard(shape, moe.schedule, plan)
  local row = { label = c.label, W = c.W, T = c.T, E = m.experts, K = m.k, routes = c.W * c.T * m.k }
  -- bit-for-bit checks: the CPU is the oracle
  if gpu then
    local ref = moe.schedule { ids = ids:to("cpu"), experts = m.experts, rank = 0, pad = opts.pad, layout = opts.layout,
      capacity = plan.capacity }
    for _, f in ipairs { "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets", "route_row" } do
      local same = pcall(moe.check.equal, s[f], ref[f], f)
      if not same then ok, row.mismatch = false, f end
    end
  end
  row.ours_us = time_calls(function() s:run() end)
  if gpu and opts.layout == "roundrobin" and have_legacy then
    local us, err = run_legacy(c, s.capacity)
    if err then ok, row.mismatch = false, err end
    row.legacy_us = us
  end
  row.rows_used = s:read_stats().rows_used
  row.capacity = s.capacity
  rows[#rows + 1] = row
  steps:step(string.format("%s: %.2f µs", shape, row.ours_us))
end

local function p(...) io.write(string.format(...), "\n") end
p("moelab %s: routed-token scheduler on %s (kernel %s), rank 0's schedule, pad %d, %s, capacity %s", moe.version,
  dev, opts.kernel, opts.pad, opts.layout, opts.capacity == "worst" and "worst case (every route on this rank)"
  or opts.capacity == "layer" and "the layer's default (2 T K + EL pad)" or opts.capacity)
p("%s", gpu and string.format("µs per call: median of %d replays of a graph of %d calls", opts.reps, opts.calls)
  or "µs per call: median wall clock on the CPU (the legacy baseline is a GPU kernel: n/a)")
if gpu and not have_legacy then
  p("legacy µs: n/a (%s not found; it is built with CUDA: cmake --build %s)", legacy_path, build_dir)
end
p("")
p("%-20s %4s %6s %5s %3s %9s %9s %10s %10s %8s", "model", "EP", "T", "E", "K", "rows", "capacity", "legacy µs", "ours µs",
  "speedup")
for _, r in ipairs(rows) do
  p("%-20s %4d %6d %5d %3d %9d %9d %10s %10.2f %8s%s", r.label, r.W, r.T, r.E, r.K, r.rows_used, r.capacity,
    r.legacy_us and string.format("%.2f", r.legacy_us) or "n/a", r.ours_us,
    r.legacy_us and string.format("%.1fx", r.legacy_us / r.ours_us) or "", r.mismatch and ("  MISMATCH " .. r.mismatch) or "")
end
if json_file then
  json_file:write(json.encode { run = runinfo.collect { device = dev }, device = dev, kernel = opts.kernel,
    pad = opts.pad, layout = opts.layout,
    capacity = compat.tointeger(tonumber(opts.capacity)) or opts.capacity, pass = ok, rows = rows }, "\n")
  json_file:close()
end
if svg_file then
  local bars = {}
  for i, r in ipairs(rows) do
    bars[i] = { label = string.format("%s, EP%d, T %d", r.label, r.W, r.T), values = { r.ours_us, r.legacy_us } }
  end
  local doc = svg.new(900, 0)
  doc:text(20, 28, string.format("moelab %s: the routed-token scheduler on %s, rank 0's schedule, pad %d, %s",
    moe.version, dev, opts.pad, opts.layout), { ["font-weight"] = "bold", ["font-size"] = 15 })
  doc.height = 48 + svg.bars(doc, { x = 20, y = 44, width = 860, rows = bars, unit = "µs", series = { "ours",
    "legacy" }, title = gpu and string.format("µs per call (median of %d replays of %d calls); no legacy bar: n/a",
    opts.reps, opts.calls) or "µs per call, wall clock on the CPU (the legacy baseline is a GPU kernel: n/a)" })
  svg_file:write(doc:render()):close()
end
os.exit(ok and 0 or 1)
