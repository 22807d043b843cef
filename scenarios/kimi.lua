-- SPDX-License-Identifier: MIT
-- One Kimi K2 MoE layer over 8 expert-parallel ranks, checked against the dense reference and timed.
--
--   lua scenarios/kimi.lua [--tokens N] [--hidden H] [--ffn F] [--world W] [--layout L] [--pad B]
--                          [--device D] [--devices 0,1,...] [--capacity C] [--seed S] [--sample N]
--                          [--json FILE] [--trace FILE] [--svg FILE] [--checkpoint DIR --layer N]
--                          [--router tensor|exact] [--precision bf16|fp8] [--anchor]
--
-- By default the W ranks are simulated side by side on one device.  With --devices they are real:
-- one rank per listed GPU, in this process (moe.world), tokens exchanged over NVLink.
--
-- On the CPU the run keeps Kimi K2's real E = 384, K = 8 and W = 8 but shrinks H, F and the
-- token count so that it takes seconds; it then schedules the real shape (7,168 tokens on each
-- of the 8 ranks) and reports rows, padding waste and expert-load imbalance there.
-- With --checkpoint the layer's weights are MoE layer N of a Hugging Face checkpoint (DeepSeek-V3 /
-- Kimi K2 names), and E, H, F and the shared expert's width are the checkpoint's.
-- --trace writes one more forward's stages per rank as a Chrome trace (ui.perfetto.dev), --svg a
-- picture: the stage times against their ceilings, each rank's expert load and padding.
-- --precision fp8 runs the FP8 layer (moe.layer{precision = "fp8"}), checked against the FP8
-- reference at its tolerance (docs/design.md, "FP8 tolerance"), simulated or over --devices.  --anchor
-- then builds the bf16 layer of the same shapes, seed and tokens in the same process and prints
-- both passes' times a rank and their ratio (on a GPU each pass as one CUDA graph, on the CPU a
-- forward's wall clock).
-- Exits 1 when the layer does not match the reference (or, on a GPU, the router's ids or weights
-- differ from the CPU route stage's on the GPU's logits); 2 on a bad flag or a configuration the
-- library refuses.
local cli = require "moelab.cli"
local moe = cli.require "moelab"
local json = require "moelab.json"
local compat = require "moelab.compat"
local runinfo = require "moelab.runinfo"
local svg = require "moelab.svg"
local trace = require "moelab.trace"

local model = moe.models.kimi_k2
local opts = cli.parse(arg, {
  { "tokens", "integer", nil, "tokens per rank (default 7168 on a GPU, 32 on the CPU)" },
  { "hidden", "integer", nil, string.format("hidden size H (default %d on a GPU, 256 on the CPU)", model.hidden) },
  { "ffn", "integer", nil, string.format("expert FFN width F, and the shared expert's (default %d on a GPU, 128 on the "
    .. "CPU)", model.ffn) },
  { "world", "integer", nil, "expert-parallel ranks W (default 8, or one per --devices)" },
  { "layout", "string", "roundrobin", "row layout: roundrobin or peer_major" },
  { "pad", "integer", 1, "pad each expert's rows to a multiple of this" },
  { "device", "string", nil, "cpu or cuda:N (default " .. moe.default_device() .. ")" },
  { "devices", "string", nil, "a real world: one rank per GPU listed, e.g. 0,1,2,3" },
  { "capacity", "integer", nil, "rows per rank (default: twice the mean plus one pad per expert)" },
  { "seed", "integer", 1, "seed of the weights and inputs" },
  { "sample", "integer", 4, "on a GPU: tokens of each rank checked against the CPU reference" },
  { "json", "string", nil, "also write the report as JSON to this file" },
  { "checkpoint", "string", nil, "the weights of a Hugging Face checkpoint (a directory or a .safetensors file)" },
  { "layer", "integer", nil, "the MoE layer N of --checkpoint (model.layers.N)" },
  { "trace", "string", nil, "also write a forward's stages per rank as a Chrome trace (ui.perfetto.dev) to this file" },
  { "svg", "string", nil, "also draw the report as an SVG picture in this file" },
  { "router", "string", "tensor", "the router logits' GPU path: tensor (tensor cores) or exact (the CPU's sums)" },
  { "precision", "string", "bf16", "the experts' precision: bf16, or fp8 (block-scaled e4m3 weights and tokens)" },
  { "anchor", "flag", nil, "with --precision fp8: also time the bf16 layer of the same shapes, and print the ratio" },
}, "lua scenarios/kimi.lua: one Kimi K2 MoE layer, expert parallel, checked and timed")
local json_file = cli.output("json", opts.json)
local trace_file, svg_file = cli.output("trace", opts.trace), cli.output("svg", opts.svg)
if opts.precision ~= "bf16" and opts.precision ~= "fp8" then
  cli.fail(string.format("--precision must be bf16 or fp8, got '%s'", opts.precision))
end
if opts.anchor and opts.precision ~= "fp8" then cli.fail("--anchor compares the FP8 layer with the bf16 one: give "
  .. "--precision fp8 too") end
if opts.sample < 1 then cli.fail(string.format("--sample must be >= 1, got %d", opts.sample)) end
local device_given = opts.device
-- A checkpoint's layer has its own sizes: a flag may repeat them, not change them.
local ckpt
if opts.layer and not opts.checkpoint then cli.fail("--layer picks a layer of --checkpoint: give --checkpoint too") end
if opts.checkpoint then
  if not opts.layer then cli.fail("--checkpoint needs --layer N (the MoE layer model.layers.N to run)") end
  ckpt = cli.guard("--checkpoint", function() return moe.checkpoint(opts.checkpoint):sizes(opts.layer) end)
  for _, f in ipairs { { "hidden", "H" }, { "ffn", "F" } } do
    if opts[f[1]] and opts[f[1]] ~= ckpt[f[1]] then
      cli.fail(string.format("--%s %d but layer %d of the checkpoint has %s = %d", f[1], opts[f[1]], opts.layer, f[2],
        ckpt[f[1]]))
    end
    opts[f[1]] = ckpt[f[1]]
  end
end
opts.device = opts.device or moe.default_device()
local small = opts.device == "cpu" and not opts.devices -- the sizes follow the device asked for
opts.tokens = opts.tokens or (small and 32 or 7168)
opts.hidden = opts.hidden or (small and 256 or model.hidden)
opts.ffn = opts.ffn or (small and 128 or model.ffn)

-- A real world when --devices lists GPUs: one rank on each, all in this process.
local group
if opts.devices then
  local list = {}
  for d in opts.devices:gmatch("[^,]+") do
    local v = compat.tointeger(tonumber(d))
    if not v or v < 0 then cli.fail(string.format("--devices: '%s' is not a GPU index", d)) end
    list[#list + 1] = v
  end
  if #list == 0 then cli.fail("--devices: list at least one GPU, e.g. 0,1,2,3") end
  if opts.world and opts.world ~= #list then
    cli.fail(string.format("--world %d but --devices lists %d GPUs: one rank per GPU", opts.world, #list))
  end
  if device_given and device_given ~= "cuda:" .. list[1] then
    cli.fail("--device and --devices: give one (a real world puts each rank on its own GPU)")
  end
  group = cli.guard("moe.world", moe.world, { devices = list })
  opts.device = group.devices[1]
  small = false
end
local W, T, H, F = opts.world or (group and group.size) or 8, opts.tokens, opts.hidden, opts.ffn
local reduced = not ckpt and (H ~= model.hidden or F ~= model.ffn or T ~= 7168)

local function new_layer(precision)
  return cli.guard("moe.layer", moe.layer, { model = model, world = group or W, tokens = T, hidden = H, ffn = F,
    shared_ffn = ckpt and ckpt.shared_ffn or F, pad = opts.pad, layout = opts.layout, capacity = opts.capacity,
    device = not group and opts.device or nil, seed = opts.seed, experts = ckpt and ckpt.experts,
    checkpoint = opts.checkpoint, layer = opts.layer, router = opts.router, precision = precision })
end
local layer = new_layer(opts.precision)
local E = layer.experts
local x = moe.randn({ W, T, H }, { dtype = "bf16", device = opts.device, seed = opts.seed * 7919 + 1 })
-- In a real world each rank's tokens go into its exchange window (layer.inputs): the same values
-- as the simulated world's x[r].
if group then
  for i, r in ipairs(group.ranks) do layer.inputs[i]:copy(x:select(r + 1)) end
  x = layer.inputs
end

-- One forward to warm up and to check (what it refuses, a capacity too small say, is the
-- configuration's: status 2); then timed forwards.
local out = cli.guard("the first forward", layer.forward, layer, x)
local stats = layer:stats()
-- On the CPU every token is checked against a reference that routes x itself; on a GPU, a
-- sample of tokens of each rank against the routing the GPU chose, and that routing, for every
-- token, against the CPU route stage run on the GPU's own logits, ids and weights bit for bit
-- (the logits themselves are the CPU's only with --router exact).
local t0 = moe.core.now()
local sample = not small and opts.sample or nil
local metrics = layer:check(x, { sample = sample, raise = false })
local ref_ms = (moe.core.now() - t0) * 1e3
local rtol, l2tol = metrics.rtol, metrics.l2
local pass = metrics.pass
local route_exact
if not small then
  -- the ids and weights of rows [N, K] against the CPU route stage's on logits and bias
  local function cpu_route_equal(ids, weights, logits, bias)
    local ci, cw = moe.route { logits = logits:to("cpu"), k = model.k, scoring = model.scoring, bias = bias:to("cpu"),
      scale = model.scale, groups = model.groups, topk_groups = model.topk_groups }
    local shape = { logits.shape[1], model.k }
    return pcall(moe.check.equal, ids:to("cpu"):view(0, shape), ci)
      and pcall(moe.check.equal, weights:to("cpu"):view(0, shape), cw)
  end
  if group then
    route_exact = true
    for i = 1, group.local_count do
      route_exact = route_exact and cpu_route_equal(layer.ids[i], layer.weights[i], layer.logits[i], layer.bias[i])
    end
  else
    route_exact = cpu_route_equal(layer.ids, layer.weights, layer.logits, layer.bias)
  end
  pass = pass and route_exact
end

local stages = { "route", "schedule", "dispatch", "experts", "shared", "combine" }
local times = {}
local iters = small and 3 or 20
for _ = 1, iters do
  layer:forward(x)
  local t = layer:stage_times()
  for _, s in ipairs(stages) do
    if t[s] then
      times[s] = times[s] or {}
      table.insert(times[s], t[s])
    end
  end
end
-- One more forward, traced: each stage's span on each rank.
local spans
if trace_file then
  layer:forward(x, { trace = true })
  spans = layer:trace()
end

local function median(list)
  local l = { compat.unpack(list) }
  table.sort(l)
  local n = #l
  return n % 2 == 1 and l[(n + 1) / 2] or (l[n / 2] + l[n / 2 + 1]) / 2 -- whole indices in each branch
end

-- The whole pass as one CUDA graph, replayed on the same input (routing recomputed each time).
local function graph_time(l)
  local g = l:capture(x)
  g:replay()
  g:check()
  return moe.bench(function() g:replay() end, { warmup = 2, iters = iters, device = opts.device }).median_ms
end
local graph_ms
if not small and not (group and group.local_count > 1) then graph_ms = graph_time(layer) end

-- --anchor: the bf16 layer of the same shapes, seed and tokens, its pass timed as the FP8 one's
-- (a graph on a GPU; on the CPU, where nothing is captured, both passes by a forward's wall clock).
local anchor
if opts.anchor then
  local function pass_ms(l)
    if graph_ms then return graph_time(l) end
    return moe.bench(function() l:forward(x) end, { warmup = 1, iters = iters, device = opts.device }).median_ms
  end
  local bf16 = new_layer("bf16")
  cli.guard("the bf16 anchor's first forward", bf16.forward, bf16, x)
  anchor = { fp8_ms = graph_ms or pass_ms(layer), bf16_ms = pass_ms(bf16),
    how = graph_ms and "one CUDA graph" or "a forward, wall clock" }
  anchor.ratio = anchor.fp8_ms / anchor.bf16_ms
end

-- Work per stage, for rates beside the ceilings measured on an H200 (docs/perf/README.md): copy
-- ~4.3 TB/s (bytes read + written), dense bf16 ~790 TFLOP/s, dense block-scaled FP8 ~1,300 (the
-- FP8 layer's experts and shared expert).  The FP8 layer's dispatch stage quantizes every token
-- (bf16 read, e4m3 and a scale per 128 written) and moves e4m3 rows and their scales.  The route
-- stage is mostly the router's logits GEMM: on tensor cores by default (beside it the dense bf16
-- ceiling), or with --router exact in f32 fused multiply-adds, whose sums equal the CPU's bit for
-- bit (beside it the H200's f32 peak, 132 SMs x 128 lanes x 2 x 1.98 GHz ~67 TFLOP/s, from the
-- chip's figures, not measured).
-- In a real world a stage's time is its slowest GPU's and the rates are per GPU.
local rows, nr = stats.rows_used, group and group.local_count or W
local per = group and nr or 1
local BF16, COPY = "(ceiling ~790)", "(ceiling ~4.3)"
local fp8 = opts.precision == "fp8"
local GEMM, gemm_peak = fp8 and "(ceiling ~1300)" or BF16, fp8 and 1300 or 790
local row_bytes = fp8 and H * (1 + 4 / 128) or H * 2.0 -- a dispatched row: e4m3 and its scales, or bf16
local quantize_bytes = fp8 and nr * T * (H * 2.0 + row_bytes) or 0
-- peak: the ceiling in TFLOP/s or TB/s, so that the work over it is the stage's floor in time
local work = {
  route = opts.router == "exact" and { flop = nr * T * 2.0 * H * E / per, ceiling = "(f32 FMA, peak ~67)", peak = 67 }
    or { flop = nr * T * 2.0 * H * E / per, ceiling = BF16, peak = 790 },
  experts = { flop = rows * 6.0 * H * F / per, ceiling = GEMM, peak = gemm_peak },
  shared = { flop = nr * T * 6.0 * H * layer.shared_ffn / per, ceiling = GEMM, peak = gemm_peak },
  dispatch = { bytes = (rows * row_bytes * 2 + quantize_bytes) / per, ceiling = COPY, peak = 4.3 },
  combine = { bytes = (stats.routes + nr * T * 2) * H * 2.0 / per, ceiling = COPY, peak = 4.3 },
}

-- The real shape, scheduled: 7,168 tokens on each of 8 ranks, router-like logits.
local real = { W = 8, T = 7168, E = model.experts, K = model.k }
do
  local N = real.W * real.T
  local logits = moe.randn({ N, real.E }, { seed = opts.seed * 31 + 5, std = 1.5, device = opts.device })
  local bias = moe.randn({ real.E }, { seed = opts.seed * 31 + 6, std = 0.005, device = opts.device })
  local ids = moe.route { logits = logits, k = real.K, scoring = model.scoring, bias = bias, scale = model.scale }
  -- device time of the router alone, on preallocated outputs
  local w = moe.zeros({ N, real.K }, { device = opts.device })
  local st = moe.zeros({ 2 }, { dtype = "i32", device = opts.device })
  real.route_ms = moe.bench(function()
    moe.core.route { ids = ids, weights = w, stats = st, logits = logits, bias = bias, k = real.K,
      scoring = model.scoring, scale = model.scale }
  end, { warmup = small and 0 or 2, iters = small and 1 or 10, device = opts.device }).median_ms
  ids = ids:view(0, { real.W, real.T, real.K })
  real.ranks, real.loads = {}, {}
  local sched_ms = 0
  for r = 0, real.W - 1 do
    local s = moe.schedule { ids = ids, experts = real.E, rank = r, pad = opts.pad, layout = opts.layout }
    sched_ms = sched_ms + moe.bench(function() s:run() end,
      { warmup = small and 0 or 2, iters = small and 1 or 10, device = opts.device }).median_ms
    local st = s:read_stats()
    local counts = s.counts:flat()
    local routes, maxl = 0, 0
    for e = 1, #counts do
      routes = routes + counts[e]
      maxl = math.max(maxl, counts[e])
      real.loads[#real.loads + 1] = counts[e]
    end
    real.ranks[r + 1] = { routes = routes, rows = st.rows_used, padding = st.rows_used - routes, max_load = maxl,
      dropped = st.dropped }
  end
  real.schedule_ms = sched_ms / real.W
  local maxl, sum = 0, 0
  for _, n in ipairs(real.loads) do
    maxl = math.max(maxl, n)
    sum = sum + n
  end
  real.max_load, real.mean_load = maxl, sum / #real.loads
end

-- The report.
local function p(...) io.write(string.format(...), "\n") end
if group then
  p("moelab %s: %s MoE layer, %d expert-parallel ranks on %d GPUs (%s), direct exchange over NVLink", moe.version,
    model.name, W, group.size, table.concat(group.devices, ", "))
else
  p("moelab %s: %s MoE layer, %d expert-parallel ranks, simulated on %s", moe.version, model.name, W, opts.device)
end
p("  model     E = %d experts (%d per rank), top-%d, %s + bias, scale %g, %s", E, layer.local_experts, model.k,
  model.scoring, model.scale, layer.shared_ffn > 0 and "1 shared expert" or "no shared expert")
if ckpt then p("  weights   layer %d of checkpoint %s (%s)", opts.layer, opts.checkpoint, ckpt.dtype) end
p("  shape     H = %d, F = %d, %d tokens per rank%s", H, F, T,
  reduced and string.format("  (real: H = %d, F = %d, T = 7168; reduced so the %s run takes seconds)", model.hidden,
    model.ffn, opts.device) or "")
p("  schedule  %s, pad %d, capacity %d rows per rank", layer.layout, layer.pad, layer.capacity)
if opts.precision == "fp8" then
  p("  precision FP8: e4m3 expert weights (128 x 128 scales), tokens quantized per token (1 x 128); checked against "
    .. "the FP8 reference")
end
p("")
p("  stage       median ms of %d%s%s", iters, small and " (wall clock)" or " (device events)",
  group and ", the slowest GPU's; rates per GPU" or "")
local total = 0
for _, s in ipairs(stages) do
  if times[s] then
    local m = median(times[s])
    total = total + m
    local w, rate = work[s], ""
    if w and w.flop and not small then rate = string.format("  %7.1f TFLOP/s %s", w.flop / m / 1e9, w.ceiling)
    elseif w and w.bytes and not small then rate = string.format("  %7.2f TB/s %s", w.bytes / m / 1e9, w.ceiling) end
    p("  %-10s %10.3f%s", s, m, rate)
  end
end
p("  %-10s %10.3f", "total", total)
if graph_ms then p("  %-10s %10.3f   (the whole pass as one CUDA graph, replayed)", "graph", graph_ms) end
if group and not graph_ms then
  p("  %-10s %10s   (not captured: %d ranks in one process; a graph captures one rank per process)", "graph", "-",
    group.local_count)
end
p("  %-10s %10.3f   (dense f32 reference on the CPU, once, %s)", "reference", ref_ms,
  sample and string.format("%d tokens per rank", sample) or "every token")
if anchor then
  p("  anchor      FP8 %.3f ms a rank, bf16 %.3f ms a rank (each pass as %s, same call): FP8 / bf16 = %.3f",
    anchor.fp8_ms / nr, anchor.bf16_ms / nr, anchor.how, anchor.ratio)
end
p("")
local rmin, rmax = math.huge, 0
for _, r in ipairs(stats.ranks) do
  rmin, rmax = math.min(rmin, r.rows_used), math.max(rmax, r.rows_used)
end
p("  rows          %d used over all ranks (per rank %d..%d of capacity %d), %d needed", stats.rows_used, rmin, rmax,
  layer.capacity, stats.rows_needed)
p("  padding       %d rows, %.1f%% of rows used", stats.padding, 100 * stats.padding_waste)
p("  expert load   max %d, mean %.2f routes (max/mean %.2f)", stats.max_load, stats.mean_load,
  stats.mean_load > 0 and stats.max_load / stats.mean_load or 0)
p("  dropped %d, invalid %d routes", stats.dropped, stats.invalid)
p("  check         max |out - ref| / max |ref| = %.3e (tol %.0e), relative L2 = %.3e (tol %.0e), %d NaN: %s",
  metrics.rel_max, rtol, metrics.rel_l2, l2tol, metrics.nans, metrics.pass and "PASS" or "FAIL")
if route_exact ~= nil then
  p("  route         GPU ids and weights equal the CPU router's on the same logits (%s logits): %s", opts.router,
    route_exact and "PASS" or "FAIL")
end
p("")
p("  real shape: %d ranks x %d tokens, E = %d, top-%d, pad %d, %s (router-like logits, std 1.5)", real.W, real.T,
  real.E, real.K, opts.pad, opts.layout)
p("  route %.3f ms for all %d tokens; schedule %.3f ms per rank (%s)", real.route_ms, real.W * real.T,
  real.schedule_ms, opts.device)
p("  rank   routes     rows  padding  max load  dropped")
for r, v in ipairs(real.ranks) do
  p("  %4d %8d %8d %8d %9d %8d", r - 1, v.routes, v.rows, v.padding, v.max_load, v.dropped)
end
p("  expert load over the world: max %d, mean %.1f (max/mean %.2f)", real.max_load, real.mean_load,
  real.max_load / real.mean_load)

local run = (json_file or trace_file) and runinfo.collect { device = opts.device, devices = group and group.devices }
if json_file then
  json_file:write(json.encode {
    run = run,
    model = model.name, checkpoint = opts.checkpoint, layer = opts.layer, device = opts.device,
    devices = group and group.devices or nil, world = W, tokens = T,
    hidden = H, ffn = F, pad = layer.pad, precision = opts.precision,
    layout = layer.layout, capacity = layer.capacity,
    stage_ms = (function()
      local m = {}
      for _, s in ipairs(stages) do if times[s] then m[s] = median(times[s]) end end
      return m
    end)(), total_ms = total, graph_ms = graph_ms,
    stats = { rows_used = stats.rows_used, rows_needed = stats.rows_needed, padding = stats.padding,
      padding_waste = stats.padding_waste,
      max_load = stats.max_load, mean_load = stats.mean_load, dropped = stats.dropped, invalid = stats.invalid },
    check = { rel_max = metrics.rel_max, rel_l2 = metrics.rel_l2, nans = metrics.nans, rtol = rtol, l2 = l2tol,
      pass = metrics.pass, sampled_tokens = sample },
    route_ids_equal_cpu = route_exact, pass = pass, reference_ms = ref_ms,
    anchor = anchor and { fp8_ms_per_rank = anchor.fp8_ms / nr, bf16_ms_per_rank = anchor.bf16_ms / nr,
      ratio = anchor.ratio, timed_as = anchor.how } or nil,
    real = { world = real.W, tokens = real.T, experts = real.E, k = real.K, ranks = real.ranks,
      max_load = real.max_load, mean_load = real.mean_load, route_ms = real.route_ms, schedule_ms = real.schedule_ms },
  }, "\n")
  json_file:close()
end
if trace_file then trace_file:write(trace.chrome(spans, { metadata = run })):close() end

-- The picture: stage times against their floors at the ceilings, then the real shape's expert
-- load (a histogram per rank, one scale for all) and padding per rank.
if svg_file then
  local doc = svg.new(960, 0)
  doc:text(20, 28, string.format("moelab %s: %s MoE layer, %d expert-parallel ranks%s", moe.version, model.name, W,
    group and string.format(" on %d GPUs", group.size) or " simulated on " .. opts.device), { ["font-weight"] = "bold",
    ["font-size"] = 15 })
  doc:text(20, 48, string.format("H = %d, F = %d, %d tokens per rank, %s, pad %d; check %s", H, F, T, layer.layout,
    layer.pad, metrics.pass and "PASS" or "FAIL"))
  local y, rows = 64, {}
  for _, st in ipairs(stages) do
    if times[st] then
      local w = work[st]
      local floor_ms = w and (w.flop or w.bytes) / w.peak / 1e9
      rows[#rows + 1] = { label = st, values = { median(times[st]) },
        marks = floor_ms and { { value = floor_ms, label = "the time at the H200 ceiling" } } or nil }
    end
  end
  y = y + svg.bars(doc, { x = 20, y = y, width = 920, rows = rows, unit = "ms", series = { "median time" },
    mark_name = "time at the H200 ceiling",
    title = string.format("stage times, median ms of %d %s", iters, small and "(wall clock)" or "(device events)") })
    + 16
  local EL = math.floor(real.E / real.W)
  doc:text(20, y + 12, string.format("expert load at the real shape (%d ranks x %d tokens, top-%d): experts per "
    .. "number of routes, each rank's %d experts", real.W, real.T, real.K, EL), { ["font-weight"] = "bold" })
  y = y + 22
  for r = 0, real.W - 1 do
    local loads = {}
    for e = 1, EL do loads[e] = real.loads[r * EL + e] end
    local v = real.ranks[r + 1]
    svg.histogram(doc, { x = 20 + (r % 4) * 235, y = y + math.floor(r / 4) * 130, width = 210, height = 120,
      values = loads, bins = 12, max = real.max_load, attrs = { ["data-rank"] = r },
      title = string.format("rank %d: max %d, mean %.1f", r, v.max_load, v.routes / EL) })
  end
  y = y + math.ceil(real.W / 4) * 130 + 10
  local pad_rows = {}
  for r, v in ipairs(real.ranks) do
    pad_rows[r] = { label = "rank " .. (r - 1), parts = { v.routes, v.padding },
      note = string.format("%d rows, %.1f%% padding", v.rows, v.rows > 0 and 100 * v.padding / v.rows or 0) }
  end
  y = y + svg.stacked(doc, { x = 20, y = y, width = 920, rows = pad_rows, unit = "rows",
    series = { "routes", "padding" },
    title = string.format("rows per rank at the real shape, pad %d (%s)", opts.pad, opts.layout) })
  doc.height = y + 10
  svg_file:write(doc:render()):close()
end

os.exit(pass and 0 or 1)
