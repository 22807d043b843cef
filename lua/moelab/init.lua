-- SPDX-License-Identifier: MIT
-- moelab: Mixture-of-Experts layer kernels, driven from Lua.
--
-- This file is the user-facing surface over the stateless C stages of moelab.core: it checks
-- options (a typo is an error, never ignored), allocates outputs, runs a stage where its tensors
-- live, and turns the conditions a stage records in its stats (NaN logits, invalid ids,
-- capacity overflow) into errors unless the caller asked for them to be tolerated.

-- The interpreter first: the front-end runs on Lua 5.4 (through the C module moelab.core) and on
-- LuaJIT 2.1; anywhere else it stops here with one sentence, before it reaches code this
-- interpreter cannot run or a C module built for another Lua.  This block, and the file up to it,
-- stays in the syntax of Lua 5.1, which every other interpreter parses.
do
  local jit = rawget(_G, "jit")
  local luajit = type(jit) == "table" and type(jit.version) == "string" and jit.version or nil
  if not (_VERSION == "Lua 5.4" or luajit and luajit:find("^LuaJIT 2%.1")) then
    error(string.format("moelab runs on Lua 5.4 or LuaJIT 2.1, and this is %s: run it with lua5.4 (or luajit)",
      luajit or _VERSION), 0)
  end
end

if rawget(_G, "jit") then package.loaded["moelab.core"] = require "moelab.ffi_core" end -- LuaJIT: the FFI binding
local core = require "moelab.core"
local args = require "moelab.args"
local compat = require "moelab.compat"
local device = require "moelab.device"
local route = require "moelab.route"
local schedule = require "moelab.schedule"
local memory = require "moelab.memory"

local moe = {}
moe.version = core.version
moe.core = core

local DTYPES = { "f32", "bf16", "i32", "e4m3" }

moe.devices, moe.default_device = device.devices, device.default_device
moe.device_info = require("moelab.runinfo").device_info
moe.range_push, moe.range_pop = core.range_push, core.range_pop
moe.graph, moe.event = device.graph, device.event
moe.routing_options, moe.route = route.options, route.route
moe.Schedule, moe.schedule_plan, moe.schedule = schedule.Schedule, schedule.plan, schedule.schedule
local check_schedule = schedule.check_schedule

-- ---------------------------------------------------------------- tensors

local function check_shape(fname, shape)
  if type(shape) ~= "table" then
    args.fail(fname, "shape must be a table of sizes, got " .. args.describe(shape))
  end
  local nd = compat.len(shape) -- not ipairs, nor #: either can stop at a hole ({2, nil, 3})
  if nd > 4 then args.fail(fname, "at most 4 dimensions, got " .. nd) end
  for i = 1, nd do
    local d = shape[i]
    if type(d) ~= "number" or not compat.tointeger(d) or d < 0 then -- 2.0 counts, as for every integer option
      args.fail(fname, string.format("shape[%d] must be a non-negative integer, got %s", i, args.describe(d)))
    end
  end
  local n = 1 -- the dimensions other than 0 multiplied, as the library bounds them
  for i = 1, #shape do
    local d = shape[i]
    if d > 0 then n = d <= 2 ^ 40 / n and n * d or math.huge end -- a float quotient: no wrap
    if n > 2 ^ 40 then
      args.fail(fname, string.format("shape %s has more than 2^40 elements (the dimensions other than 0 multiplied)",
        args.shape_str(shape)))
    end
  end
  return shape
end

function moe.tensor(data, opts)
  opts = args.options("tensor", opts or {}, { dtype = DTYPES, device = "device", shape = "table" })
  if opts.shape then check_shape("tensor", opts.shape) end
  return core.from_table(data, opts.dtype or "f32", opts.device or "cpu", opts.shape)
end

function moe.zeros(shape, opts)
  check_shape("zeros", shape)
  opts = args.options("zeros", opts or {}, { dtype = DTYPES, device = "device" })
  args.available("zeros", opts.device)
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu")
end

function moe.full(shape, value, opts)
  check_shape("full", shape)
  if type(value) ~= "number" then args.fail("full", "value must be a number, got " .. args.describe(value)) end
  opts = args.options("full", opts or {}, { dtype = DTYPES, device = "device" })
  if opts.dtype == "i32" and (value ~= math.floor(value) or value < -2147483648 or value > 2147483647) then
    args.fail("full", "value must be an i32 value, an integer from -2147483648 to 2147483647, got "
      .. args.describe(value))
  end
  args.available("full", opts.device)
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu"):fill(value)
end

-- Same seed, same values on every device (see moe_tensor_randn in moelab.h).
function moe.randn(shape, opts)
  check_shape("randn", shape)
  opts = args.options("randn", opts or {}, { dtype = { "f32", "bf16" }, device = "device", seed = "integer", std = "number" })
  args.available("randn", opts.device)
  return core.new(opts.dtype or "f32", shape, opts.device or "cpu"):randn(opts.seed or 0, opts.std or 1.0)
end

-- Block-scaled e4m3 tensors (moelab.fp8).
local fp8 = require "moelab.fp8"
moe.quantize, moe.dequantize = fp8.quantize, fp8.dequantize

-- Tensors over memory another library owns: a raw address, or DLPack (moelab.interop).
local interop = require "moelab.interop"
function moe.wrap(o) return interop.wrap(o, check_shape) end
moe.from_dlpack = interop.from_dlpack

-- ---------------------------------------------------------------- 3. dispatch, 4. experts, 5. combine
--
-- Each front-end checks what only it can see (its options, x against the schedule, the schedules
-- against each other) and what it needs to allocate out (moelab.memory: sized before it is made);
-- every tensor's dtype, shape, device and overlap the C stage checks, whose fields are these
-- options, and its errors name them.

-- out, made by moelab.memory for fname from its shape and what sized it.
local function output(fname, dtype, shape, device, from)
  return memory.new(fname, { memory.buffer("out", dtype, shape, from) }, device).out
end

function moe.dispatch(o)
  args.options("dispatch", o, { x = "tensor", schedule = "table", k = "integer", zero_fill = "boolean", out = "tensor",
    x_scale = "tensor", out_scale = "tensor" }, { "x", "schedule" })
  local s = check_schedule("dispatch", "schedule", o.schedule)
  local x = args.tensor("dispatch", "x", o.x, nil, { false, false, false })
  if x.dtype ~= "bf16" and x.dtype ~= "e4m3" then
    args.fail("dispatch", "option 'x' must be bf16 or e4m3 [_, _, _], got " .. tostring(x))
  end
  if x.shape[1] ~= s.world or x.shape[2] ~= s.tokens then
    args.fail("dispatch", string.format("option 'x' is %s but the schedule was made for %d ranks of %d tokens",
      args.shape_str(x.shape), s.world, s.tokens))
  end
  if o.k and o.k ~= s.k then
    args.fail("dispatch", string.format("option 'k' (%d) differs from the schedule's top-k (%d)", o.k, s.k))
  end
  -- the schedule's device is x's: the stage would name the schedule's peer_rank, not an option
  args.same_device("dispatch", { x = x, schedule = s.peer_rank }, { "x", "schedule" })
  if x.dtype == "e4m3" then return fp8.dispatch(o, s, x) end
  for _, k in ipairs { "x_scale", "out_scale" } do
    if o[k] then args.fail("dispatch", string.format("option '%s' goes with an e4m3 x; x is bf16", k)) end
  end
  local out = o.out or output("dispatch", "bf16", { s.capacity, x.shape[3] }, x.device,
    "the schedule's capacity x the hidden size of x")
  core.dispatch { out = out, x = x, peer_rank = s.peer_rank, peer_route = s.peer_route, k = s.k,
    zero_fill = o.zero_fill or false }
  return out
end

-- moe.experts's options -> the C stage's arguments (out, or x itself where only the choice of
-- kernel is asked: explain runs nothing) and the stage: experts, or experts_fp8 where x is e4m3
-- (block-scaled, with its scales and the weights').
local FP8_SCALES = { "x_scale", "w_gate_up_scale", "w_down_scale" }
local function experts_args(o, explaining)
  args.options("experts", o, { x = "tensor", offsets = "tensor", w_gate_up = "tensor", w_down = "tensor", out = "tensor",
    x_scale = "tensor", w_gate_up_scale = "tensor", w_down_scale = "tensor" }, { "x", "offsets", "w_gate_up", "w_down" })
  local is_fp8 = args.is_tensor(o.x) and o.x.dtype == "e4m3"
  local x = args.tensor("experts", "x", o.x, not is_fp8 and "bf16" or nil, { false, false })
  for _, name in ipairs(FP8_SCALES) do
    if is_fp8 and o[name] == nil then
      args.fail("experts", string.format("option '%s' is required where x is e4m3 (FP8 experts)", name))
    elseif not is_fp8 and o[name] ~= nil then
      args.fail("experts", string.format("option '%s' is for an e4m3 x (FP8 experts), got x %s", name, tostring(x)))
    end
  end
  if is_fp8 and explaining and o.out == nil then -- out cannot be x there (e4m3 in, bf16 out)
    args.fail("explain", "explaining the FP8 experts (e4m3 x) needs out = (bf16 [C, H]), as the call checks it")
  end
  local out = o.out or explaining and x or output("experts", "bf16", x.shape, x.device, "the shape of x")
  return { out = out, x = x, offsets = o.offsets, w_gate_up = o.w_gate_up, w_down = o.w_down, x_scale = o.x_scale,
    w_gate_up_scale = o.w_gate_up_scale, w_down_scale = o.w_down_scale }, is_fp8
end

function moe.experts(o)
  local a, is_fp8 = experts_args(o)
  if is_fp8 then core.experts_fp8(a) else core.experts(a) end
  return a.out
end

-- Routing weights must be finite: one NaN weight makes its token's whole row NaN, where a router
-- would have rejected the row.  Counted on the device (moe_nonfinite), two integers read back;
-- not inside a graph capture, which cannot read back (the weights pass through as they are).
-- Weights that are not an open f32 tensor are left to the stage, whose message names them.
local function nonfinite_weights(w)
  if device.capturing() or not args.is_tensor(w) or w.closed or w.dtype ~= "f32" then return end
  local st = core.new("i32", { 2 }, w.device)
  core.nonfinite(st, w)
  local v = st:flat()
  if v[1] > 0 then
    local K = w.shape[#w.shape] or 1
    args.fail("combine", string.format("option 'weights' holds %d value%s that %s NaN or infinite, the first at token "
      .. "%d, slot %d: routing weights must be finite", v[1], v[1] == 1 and "" or "s", v[1] == 1 and "is" or "are",
      math.floor(v[2] / math.max(K, 1)), v[2] % math.max(K, 1)))
  end
end

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
  local s1 = check_schedule("combine", "schedules[1]", schedules[1])
  local W = s1.world
  if #schedules ~= W then
    args.fail("combine", string.format("a world of %d ranks needs %d schedules, got %d", W, W, #schedules))
  end
  if #ys ~= W then args.fail("combine", string.format("a world of %d ranks needs %d expert outputs (ys), got %d", W, W, #ys)) end
  local route_rows, H = {}, nil
  for i = 1, W do
    local s = check_schedule("combine", "schedules[" .. i .. "]", schedules[i])
    if s.rank ~= i - 1 or s.world ~= W or s.tokens ~= s1.tokens or s.k ~= s1.k or s.experts ~= s1.experts then
      args.fail("combine", string.format("schedules[%d] must be rank %d's schedule of the same ids (%d ranks, %d tokens, "
        .. "top-%d, %d experts), got rank %d of %d ranks, %d tokens, top-%d, %d experts", i, i - 1, W, s1.tokens,
        s1.k, s1.experts, s.rank, s.world, s.tokens, s.k, s.experts))
    end
    -- the same ids, not just the same sizes: combine reads schedules[1]'s ids with every route_row
    -- (the same tensor, or a copy: then its contents are compared, which reads both back)
    args.tensor("combine", "schedules[" .. i .. "].ids", s.ids, "i32", nil)
    local copy = i > 1 and (s.ids:address() ~= s1.ids:address() or s.ids.device ~= s1.ids.device)
    if copy and device.capturing() then -- contents read now would say nothing of a replay's (and cannot be read)
      args.fail("combine", string.format("schedules[%d] was made from another ids tensor than schedules[1]: inside a "
        .. "graph capture every rank's schedule must come from the same tensor of all-gathered ids", i))
    end
    if copy and not pcall(moe.check.equal, s.ids, s1.ids) then
      args.fail("combine", string.format("schedules[%d] was made from other ids than schedules[1] (every rank's "
        .. "schedule must come from the same all-gathered ids)", i))
    end
    -- a rank's ys holds its schedule's rows (the stage checks dtype, H and device); H sizes out
    local y = args.tensor("combine", "ys[" .. i .. "]", ys[i], nil, { s.capacity, false })
    H = H or y.shape[2]
    route_rows[i] = s.route_row
  end
  local rank = o.rank or 0
  args.range("combine", "rank", rank, 0, W - 1)
  args.same_dtype("combine", o.out, o.dtype)
  nonfinite_weights(o.weights)
  local out = o.out or output("combine", o.dtype or "bf16", { s1.tokens, H }, s1.device,
    "the schedule's tokens x the hidden size of ys")
  core.combine { out = out, weights = o.weights, ids = s1.ids:select(rank + 1), ys = ys, route_row = route_rows,
    world = W, experts = s1.experts, rank = rank, shared = o.shared, shared_gate = o.shared_gate }
  return out
end

-- ---------------------------------------------------------------- the rest

moe.check = require "moelab.check"
moe.bench = require "moelab.bench"
moe.models = require "moelab.models"
local world = require "moelab.world"
moe.world, moe.World, moe.Exchange, moe.world_unique_id = world.new, world.World, world.Exchange, world.unique_id
moe.Layer = require "moelab.layer"
moe.layer = moe.Layer.new
moe.layer_memory = moe.Layer.memory_of
local checkpoint = require "moelab.checkpoint"
moe.checkpoint, moe.safetensors = checkpoint.open, checkpoint.safetensors

-- ---------------------------------------------------------------- which kernel runs, and why

local explain = require "moelab.explain"
moe.config = explain.config

-- explain("schedule", options of moe.schedule), explain("experts", options of moe.experts) or
-- explain("logits", {x =, w = [, out =]}): the kernel the stage would run on them and every
-- candidate's verdict; nothing runs.
function moe.explain(stage, o)
  if stage == "schedule" then return moe.schedule_plan(o):explain() end
  if stage == "experts" then
    local a, is_fp8 = experts_args(o, true)
    return explain.parse(is_fp8 and core.experts_fp8_explain(a) or core.experts_explain(a))
  end
  if stage == "logits" then
    o = args.options("explain", o, { x = "tensor", w = "tensor", out = "tensor" }, { "x", "w" })
    local out = o.out or output("explain", "f32", { o.x.shape[1], o.w.shape[1] }, o.x.device, "x and w")
    return explain.parse(core.logits_explain(out, o.x, o.w))
  end
  args.fail("explain", string.format("stage must be \"schedule\", \"experts\" or \"logits\", got %s",
    args.describe(stage)))
end

return moe