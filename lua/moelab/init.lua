-- moelab: Mixture-of-Experts layer kernels, driven from Lua.
--
-- This file is the user-facing surface over the stateless C stages of moelab.core: it checks
-- options (a typo is an error, never ignored), allocates outputs, runs a stage where its tensors
-- live, and turns the conditions a stage records in its stats (NaN logits, invalid ids,
-- capacity overflow) into errors unless the caller asked for them to be tolerated.
local core = require "moelab.core"
local args = require "moelab.args"

local moe = {}
moe.version = core.version
moe.core = core

local DTYPES = { "f32", "bf16", "i32" }

-- ---------------------------------------------------------------- devices

function moe.devices()
  local list = { "cpu" }
  for i = 0, core.device_count("cuda") - 1 do list[#list + 1] = "cuda:" .. i end
  return list
end

function moe.default_device()
  return core.device_count("cuda") > 0 and "cuda:0" or "cpu"
end

-- ---------------------------------------------------------------- tensors

local function check_shape(fname, shape, level)
  if type(shape) ~= "table" then
    args.fail(fname, "shape must be a table of sizes, got " .. args.describe(shape), level + 1)
  end
  if #shape > 4 then args.fail(fname, "at most 4 dimensions, got " .. #shape, level + 1) end
  for i = 1, #shape do -- not ipairs: it would stop at a hole ({2, nil, 3})
    local d = shape[i]
    if type(d) ~= "number" or not math.tointeger(d) or d < 0 then -- 2.0 counts, as for every integer option
      args.fail(fname, string.format("shape[%d] must be a non-negative integer, got %s", i, args.describe(d)), level + 1)
    end
  end
  local n = 1 -- the dimensions other than 0 multiplied, as the library bounds them
  for i = 1, #shape do
    local d = shape[i]
    if d > 0 then n = d <= 2 ^ 40 / n and n * d or math.huge end -- a float quotient: no wrap
    if n > 2 ^ 40 then
      args.fail(fname, string.format("shape %s has more than 2^40 elements (the dimensions other than 0 multiplied)",
        args.shape_str(shape)), level + 1)
    end
  end
  return shape
end

function moe.tensor(data, opts)
  opts = args.options("tensor", opts or {}, { dtype = DTYPES, device = "device", shape = "table" })
  if opts.shape then check_shape("tensor", opts.shape, 2) end
  return core.from_table(data, opts.dtype or "f32", opts.device or "cpu", opts.shape)
end

function moe.zeros(shape, opts)
  check_shape("zeros", shape, 2)
  opts = args.options("zeros", opts or {}, { dtype = DTYPES, device = "device" })
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu")
end

function moe.full(shape, value, opts)
  check_shape("full", shape, 2)
  if type(value) ~= "number" then args.fail("full", "value must be a number, got " .. args.describe(value)) end
  opts = args.options("full", opts or {}, { dtype = DTYPES, device = "device" })
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu"):fill(value)
end

-- Same seed, same values on every device (see moe_tensor_randn in moelab.h).
function moe.randn(shape, opts)
  check_shape("randn", shape, 2)
  opts = args.options("randn", opts or {}, { dtype = { "f32", "bf16" }, device = "device", seed = "integer", std = "number" })
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu"):randn(opts.seed or 0, opts.std or 1.0)
end

local capturing = false -- moe.graph's fn is running: stages are recorded, nothing can be read back

-- ---------------------------------------------------------------- 1. route

local SCORING = { "softmax", "sigmoid", "sqrtsoftplus" }

-- The routing options k, scoring, groups, topk_groups, scale of o checked against E experts,
-- for fname (route, or a layer when it is built); returns scoring, groups, topk_groups, scale
-- with their defaults.
function moe.routing_options(fname, E, o, level)
  level = (level or 2) + 1
  local scoring = o.scoring or "softmax"
  local groups = o.groups or 1
  args.range(fname, "k", o.k, 1, E, level)
  args.range(fname, "groups", groups, 1, E, level)
  if E % groups ~= 0 then
    args.fail(fname, string.format("option 'groups' (%d) must divide the number of experts (%d)", groups, E), level)
  end
  if groups > 1 and scoring ~= "sigmoid" then
    args.fail(fname, string.format("option 'groups' (%d) needs scoring = 'sigmoid', got '%s'", groups, scoring), level)
  end
  local topk_groups = o.topk_groups or groups
  args.range(fname, "topk_groups", topk_groups, 1, groups, level)
  if o.k > topk_groups * (E // groups) then
    args.fail(fname, string.format("option 'k' (%d) exceeds the %d experts in the %d kept groups",
      o.k, topk_groups * (E // groups), topk_groups), level)
  end
  local scale = o.scale or 1.0
  -- applied as an f32: it must stay finite and nonzero there (FLT_MIN .. FLT_MAX)
  if not (scale >= 0x1p-126 and scale <= 0x1.fffffep127) then
    args.fail(fname, "option 'scale' must be a finite number > 0 that an f32 holds (2^-126 .. 3.4e38), got "
      .. args.describe(scale), level)
  end
  if scale ~= 1 and scoring == "softmax" then -- the kernels ignore it there: say so rather than drop it
    args.fail(fname, string.format("option 'scale' (%s) needs scoring = 'sigmoid' or 'sqrtsoftplus': softmax's "
      .. "weights are renormalised to sum 1", args.describe(scale)), level)
  end
  return scoring, groups, topk_groups, scale
end

function moe.route(o)
  args.options("route", o, {
    logits = "tensor", k = "integer", scoring = SCORING, bias = "tensor", groups = "integer",
    topk_groups = "integer", scale = "number", nan = { "error", "mask" }, ids = "tensor", weights = "tensor",
  }, { "logits", "k" })
  local logits = args.tensor("route", "logits", o.logits, "f32", { false, false })
  local N, E = logits.shape[1], logits.shape[2]
  local scoring, groups, topk_groups, scale = moe.routing_options("route", E, o)
  if o.bias ~= nil then
    if scoring == "softmax" then args.fail("route", "option 'bias' needs scoring = 'sigmoid' or 'sqrtsoftplus'") end
    args.tensor("route", "bias", o.bias, "f32", { E })
  end
  local dev = args.same_device("route", o, { "logits", "bias", "ids", "weights" })
  args.disjoint("route", o, { "ids", "weights" }, { "logits", "bias" })
  local ids = o.ids and args.tensor("route", "ids", o.ids, "i32", { N, o.k }) or core.new("i32", { N, o.k }, dev)
  local weights = o.weights and args.tensor("route", "weights", o.weights, "f32", { N, o.k })
    or core.new("f32", { N, o.k }, dev)
  local stats = core.new("i32", { 2 }, dev)
  core.route { ids = ids, weights = weights, stats = stats, logits = logits, bias = o.bias, k = o.k,
    scoring = scoring, groups = groups, topk_groups = topk_groups, scale = scale }
  local st = stats:flat()
  if st[1] > 0 and o.nan ~= "mask" then
    error(string.format("route: logits contain NaN or cannot be scored in %d row%s (a NaN, a +inf, a softmax row of "
      .. "-inf, a NaN score with the bias), the first is row %d (0-based) of %d; pass nan = 'mask' to route such rows "
      .. "nowhere", st[1], st[1] == 1 and "" or "s", st[2], N), 2)
  end
  return ids, weights, { nan_rows = st[1] }
end

-- ---------------------------------------------------------------- 2. schedule

local Schedule = { __name = "moelab.Schedule" }
Schedule.__index = Schedule
moe.Schedule = Schedule

local LAYOUTS = { "roundrobin", "peer_major" }
local STAT_NAMES = { "rows_needed", "rows_used", "dropped", "invalid", "first_invalid" }

-- The largest number of rows the routes of ids could ever need on one rank.
local function worst_case_rows(W, T, K, EL, pad, expert_capacity)
  local n = W * T * K
  local rows = n + EL * (pad - 1)
  if expert_capacity then
    rows = math.min(rows, EL * ((expert_capacity + pad - 1) // pad) * pad)
  end
  return rows
end

-- Allocates a schedule's buffers without running it (the layer reruns it in place).  fname and
-- level: the function a caller inside the module raises as, and the level of its own caller.
function moe.schedule_plan(o, fname, level)
  fname, level = fname or "schedule_plan", (level or 1) + 1
  args.options(fname, o, {
    ids = "tensor", experts = "integer", rank = "integer", pad = "integer", capacity = "integer",
    expert_capacity = "integer", layout = LAYOUTS, overflow = { "error", "drop" }, invalid = { "error", "skip" },
  }, { "ids", "experts" }, level)
  local ids = args.tensor(fname, "ids", o.ids, "i32", { false, false, false }, level)
  local W, T, K = ids.shape[1], ids.shape[2], ids.shape[3]
  local E = o.experts
  args.range(fname, "experts", E, 1, 0x7fffffff, level) -- ids are i32
  if W < 1 then args.fail(fname, "option 'ids' has no ranks (its first dimension is 0)", level) end
  if E % W ~= 0 then
    args.fail(fname, string.format("option 'experts' (%d) must be a multiple of the world size %d (ids is %s)",
      E, W, args.shape_str(ids.shape)), level)
  end
  local rank, pad = o.rank or 0, o.pad or 1
  args.range(fname, "rank", rank, 0, W - 1, level)
  args.range(fname, "pad", pad, 1, 0x7fffffff, level) -- rows are i32: so no sum below can wrap
  -- at most 2^31 - 2: rows_needed saturates at 2^31 - 1, so a capacity of 2^31 - 1 could not tell
  -- a need of exactly that from an overflow
  args.range(fname, "capacity", o.capacity, 0, 0x7ffffffe, level)
  args.range(fname, "expert_capacity", o.expert_capacity, 0, 0x7fffffff, level)
  local EL = E // W
  local C = o.capacity or worst_case_rows(W, T, K, EL, pad, o.expert_capacity)
  if C > 0x7ffffffe then args.fail(fname, "the default capacity exceeds 2^31 - 2 rows; pass capacity", level) end
  local dev = ids.device
  local s = setmetatable({
    ids = ids, world = W, tokens = T, k = K, experts = E, local_experts = EL, rank = rank, pad = pad,
    capacity = C, expert_capacity = o.expert_capacity, layout = o.layout or "roundrobin",
    overflow = o.overflow or "error", invalid = o.invalid or "error", device = dev,
    peer_rank = core.new("i32", { C }, dev),
    peer_route = core.new("i32", { C }, dev),
    counts = core.new("i32", { EL }, dev),
    tokens_per_expert = core.new("i32", { EL }, dev),
    expert_offsets = core.new("i32", { EL + 1 }, dev),
    route_row = core.new("i32", { W, T * K }, dev),
    stats_tensor = core.new("i32", { 5 }, dev),
  }, Schedule)
  return s
end

-- Runs the scheduler into the plan's buffers; reads nothing back (capturable).
function Schedule:run()
  core.schedule { peer_rank = self.peer_rank, peer_route = self.peer_route, counts = self.counts,
    tokens_per_expert = self.tokens_per_expert, expert_offsets = self.expert_offsets, route_row = self.route_row,
    stats = self.stats_tensor, ids = self.ids, experts = self.experts, rank = self.rank, pad = self.pad,
    capacity = self.capacity, expert_capacity = self.expert_capacity, layout = self.layout }
  self.stats = nil
  return self
end

-- Reads the stats back: {rows_needed, rows_used, dropped, invalid, first_invalid}.
function Schedule:read_stats()
  if self.stats_tensor.closed then
    args.raise("schedule: its stats tensor (stats_tensor) is closed: nothing to read")
  end
  local st, out = self.stats_tensor:flat(), {}
  for i, name in ipairs(STAT_NAMES) do out[name] = st[i] end
  self.stats = out
  return out
end

-- Raises on the conditions the schedule's policies do not allow (level: for error()).  It reads
-- the stats the last run left on the device every time: a graph's replay runs the schedule
-- without this table knowing.
function Schedule:check(level)
  level = (level or 1) + 1
  local st = self:read_stats()
  if st.invalid > 0 and self.invalid == "error" then
    local f = st.first_invalid
    local per_rank = self.tokens * self.k
    local w, rest = f // per_rank, f % per_rank
    -- the id itself, unless the caller closed the ids since the run
    local id = self.ids.closed and "" or string.format(" %d", self.ids:get(f + 1))
    error(string.format("schedule: invalid expert id%s at rank %d, token %d, slot %d (expected -1 or 0..%d); "
      .. "%d invalid id%s in all; pass invalid = 'skip' to drop them", id, w, rest // self.k,
      rest % self.k, self.experts - 1, st.invalid, st.invalid == 1 and "" or "s"), level)
  end
  if st.rows_needed > self.capacity and self.overflow == "error" then
    error(string.format("schedule: capacity overflow on rank %d: the routes need %d rows, capacity is %d "
      .. "(%d routes lost their row%s); raise capacity or pass overflow = 'drop'", self.rank, st.rows_needed,
      self.capacity, st.dropped, self.expert_capacity and ", those past expert_capacity included" or ""), level)
  end
  return self
end

function Schedule:__tostring()
  local st = self.stats
  return string.format("moelab.Schedule(rank %d of %d, %d local experts, pad %d, %s, capacity %d%s)",
    self.rank, self.world, self.local_experts, self.pad, self.layout, self.capacity,
    st and string.format(", rows %d used, %d dropped, %d invalid", st.rows_used, st.dropped, st.invalid) or "")
end

function moe.schedule(o)
  local s = moe.schedule_plan(o, "schedule", 2)
  s:run()
  s:check(2)
  return s
end

local SCHEDULE_TENSORS = { "ids", "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets",
  "route_row", "stats_tensor" }
local function check_schedule(fname, name, s, level)
  if getmetatable(s) ~= Schedule then
    args.fail(fname, string.format("option '%s' must be a moelab.Schedule (from moe.schedule), got %s",
      name, args.describe(s)), level + 1)
  end
  for _, f in ipairs(SCHEDULE_TENSORS) do -- the stages read them: a closed one would be named as the schedule
    if s[f].closed then
      args.fail(fname, string.format("option '%s': the schedule's %s tensor is closed", name, f), level + 1)
    end
  end
  return s
end

-- ---------------------------------------------------------------- 3. dispatch

function moe.dispatch(o)
  args.options("dispatch", o, { x = "tensor", schedule = "table", k = "integer", zero_fill = "boolean", out = "tensor" },
    { "x", "schedule" })
  local s = check_schedule("dispatch", "schedule", o.schedule, 2)
  local x = args.tensor("dispatch", "x", o.x, "bf16", { false, false, false })
  if x.shape[1] ~= s.world or x.shape[2] ~= s.tokens then
    args.fail("dispatch", string.format("option 'x' is %s but the schedule was made for %d ranks of %d tokens",
      args.shape_str(x.shape), s.world, s.tokens))
  end
  if o.k and o.k ~= s.k then
    args.fail("dispatch", string.format("option 'k' (%d) differs from the schedule's top-k (%d)", o.k, s.k))
  end
  local H = x.shape[3]
  local out = o.out and args.tensor("dispatch", "out", o.out, "bf16", { s.capacity, H })
    or core.new("bf16", { s.capacity, H }, x.device)
  args.same_device("dispatch", { x = x, out = out, schedule = s.peer_rank }, { "x", "out", "schedule" })
  args.disjoint("dispatch", { x = x, out = out }, { "out" }, { "x" })
  core.dispatch { xs = out, x = x, peer_rank = s.peer_rank, peer_route = s.peer_route, k = s.k,
    zero_fill = o.zero_fill or false }
  return out
end

-- ---------------------------------------------------------------- 4. experts

function moe.experts(o)
  args.options("experts", o, { x = "tensor", offsets = "tensor", w_gate_up = "tensor", w_down = "tensor", out = "tensor" },
    { "x", "offsets", "w_gate_up", "w_down" })
  local x = args.tensor("experts", "x", o.x, "bf16", { false, false })
  local C, H = x.shape[1], x.shape[2]
  local wgu = args.tensor("experts", "w_gate_up", o.w_gate_up, "bf16", { false, false, H })
  local EL, F2 = wgu.shape[1], wgu.shape[2]
  if F2 % 2 ~= 0 then
    args.fail("experts", string.format("option 'w_gate_up' must have an even number of rows (gate, then up), got %s",
      tostring(wgu)))
  end
  args.tensor("experts", "w_down", o.w_down, "bf16", { EL, H, F2 // 2 })
  args.tensor("experts", "offsets", o.offsets, "i32", { EL + 1 })
  local out = o.out and args.tensor("experts", "out", o.out, "bf16", { C, H }) or core.new("bf16", { C, H }, x.device)
  args.same_device("experts", { x = x, offsets = o.offsets, w_gate_up = wgu, w_down = o.w_down, out = out },
    { "x", "offsets", "w_gate_up", "w_down", "out" })
  -- out may be x itself (in place: every row block of x is read before it is written), else disjoint
  local in_place = o.out ~= nil and out:address() == x:address()
  args.disjoint("experts", o, { "out" }, in_place and { "offsets", "w_gate_up", "w_down" }
    or { "x", "offsets", "w_gate_up", "w_down" })
  core.experts { ys = out, xs = x, expert_offsets = o.offsets, w_gate_up = wgu, w_down = o.w_down }
  return out
end

-- ---------------------------------------------------------------- 5. combine

function moe.combine(o)
  args.options("combine", o, {
    schedule = "table", schedules = "table", y = "tensor", ys = "table", weights = "tensor", rank = "integer",
    out = "tensor", shared = "tensor", shared_gate = "tensor", dtype = { "bf16", "f32" },
  }, { "weights" })
  if (o.schedule == nil) == (o.schedules == nil) then
    args.fail("combine", "give exactly one of 'schedule' (a world of one rank) and 'schedules' (one per rank)")
  end
  if (o.y == nil) == (o.ys == nil) then
    args.fail("combine", "give exactly one of 'y' (a world of one rank) and 'ys' (one per rank)")
  end
  local schedules = o.schedules or { o.schedule }
  local ys = o.ys or { o.y }
  local s1 = check_schedule("combine", "schedules[1]", schedules[1], 2)
  local W = s1.world
  if #schedules ~= W then
    args.fail("combine", string.format("a world of %d ranks needs %d schedules, got %d", W, W, #schedules))
  end
  if #ys ~= W then args.fail("combine", string.format("a world of %d ranks needs %d expert outputs (ys), got %d", W, W, #ys)) end
  local route_rows, H = {}, nil
  for i = 1, W do
    local s = check_schedule("combine", "schedules[" .. i .. "]", schedules[i], 2)
    if s.rank ~= i - 1 or s.world ~= W or s.tokens ~= s1.tokens or s.k ~= s1.k or s.experts ~= s1.experts then
      args.fail("combine", string.format("schedules[%d] must be rank %d's schedule of the same ids (%d ranks, %d tokens, "
        .. "top-%d, %d experts), got rank %d of %d ranks, %d tokens, top-%d, %d experts", i, i - 1, W, s1.tokens,
        s1.k, s1.experts, s.rank, s.world, s.tokens, s.k, s.experts))
    end
    -- the same ids, not just the same sizes: combine reads schedules[1]'s ids with every route_row
    -- (the same tensor, or a copy: then its contents are compared, which reads both back)
    args.tensor("combine", "schedules[" .. i .. "].ids", s.ids, "i32", nil)
    local copy = i > 1 and (s.ids:address() ~= s1.ids:address() or s.ids.device ~= s1.ids.device)
    if copy and capturing then -- contents read now would say nothing of a replay's (and cannot be read)
      args.fail("combine", string.format("schedules[%d] was made from another ids tensor than schedules[1]: inside a "
        .. "graph capture every rank's schedule must come from the same tensor of all-gathered ids", i))
    end
    if copy and not pcall(moe.check.equal, s.ids, s1.ids) then
      args.fail("combine", string.format("schedules[%d] was made from other ids than schedules[1] (every rank's "
        .. "schedule must come from the same all-gathered ids)", i))
    end
    local y = args.tensor("combine", "ys[" .. i .. "]", ys[i], "bf16", { s.capacity, H or false })
    H = H or y.shape[2]
    route_rows[i] = s.route_row
  end
  local T, K = s1.tokens, s1.k
  local rank = o.rank or 0
  args.range("combine", "rank", rank, 0, W - 1)
  args.tensor("combine", "weights", o.weights, "f32", { T, K })
  if o.shared then args.tensor("combine", "shared", o.shared, "bf16", { T, H }) end
  if o.shared_gate then args.tensor("combine", "shared_gate", o.shared_gate, "f32", { T }) end
  local dev = s1.device
  local out = o.out and args.tensor("combine", "out", o.out, nil, { T, H }) or core.new(o.dtype or "bf16", { T, H }, dev)
  if out.dtype == "i32" then
    args.fail("combine", string.format("option 'out' must be bf16 or f32 [%d, %d], got %s", T, H, tostring(out)))
  end
  args.same_dtype("combine", o.out, o.dtype)
  args.same_device("combine", { ids = s1.ids, weights = o.weights, out = out, shared = o.shared,
    shared_gate = o.shared_gate, y = ys[1] }, { "ids", "weights", "out", "shared", "shared_gate", "y" })
  args.disjoint("combine", { out = out, weights = o.weights, y = o.y, ys = o.ys, shared = o.shared,
    shared_gate = o.shared_gate }, { "out" }, { "weights", "y", "ys", "shared", "shared_gate" })
  core.combine { out = out, weights = o.weights, ids = s1.ids:select(rank + 1), ys = ys, route_row = route_rows,
    world = W, experts = s1.experts, rank = rank, shared = o.shared, shared_gate = o.shared_gate }
  return out
end

-- ---------------------------------------------------------------- graphs and device timing

-- Captures the stages fn issues on a GPU into a CUDA graph; graph:replay() reruns them on
-- whatever their tensors hold then.  Nothing inside fn may read results back to the host.
function moe.graph(fn, opts)
  if type(fn) ~= "function" then args.fail("graph", "expected a function to capture, got " .. args.describe(fn)) end
  opts = args.options("graph", opts or {}, { device = "device" })
  local dev = opts.device or moe.default_device()
  if dev == "cpu" then args.fail("graph", "CUDA graphs need a cuda device, got 'cpu'") end
  -- No garbage collection while capturing: a collected graph or event would be destroyed
  -- mid-capture, a call that invalidates the capture under way.
  local was_running = collectgarbage("isrunning")
  collectgarbage("stop")
  local begun, berr = pcall(core.graph_begin, dev)
  if not begun then
    if was_running then collectgarbage("restart") end
    args.raise(berr)
  end
  capturing = true
  local ok, err = pcall(fn)
  capturing = false
  local ended, graph = pcall(core.graph_end) -- always end the capture, even after a failure
  if was_running then collectgarbage("restart") end
  if not ok then args.raise("graph: capture failed: " .. tostring(err)) end
  if not ended then args.raise(graph) end
  return graph
end

-- A timing event: device events on a GPU, a monotonic clock on the CPU.
-- e:record(); stop:elapsed_since(start) -> milliseconds.
function moe.event(device)
  if device ~= nil and not args.is_device(device) then
    args.fail("event", "expected a device, 'cpu' or 'cuda:N', got " .. args.describe(device))
  end
  return core.event_new(device or moe.default_device())
end

-- ---------------------------------------------------------------- the rest

moe.check = require "moelab.check"
moe.bench = require "moelab.bench"
moe.models = require "moelab.models"
moe.layer = require("moelab.layer")(moe)
moe.world = require("moelab.world")(moe)

return moe
