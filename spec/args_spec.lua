-- SPDX-License-Identifier: MIT
-- Argument errors, as a table (lua-cjson's tests): one row per bad input, the fragments its
-- message must contain beside it (plain text: the argument, the value, what was expected).
-- Every error must also point at the caller's line (this file), not at the front-end's own or
-- the C binding's.
local S = require "support"

local L = moe.zeros({ 4, 8 })                                   -- logits
local I = S.tensor({ 0, 1, 2, 3, 1, 2, 3, 0, 2, 0, 1, 3 }, "i32", { 2, 3, 2 }) -- ids, W = 2, T = 3, K = 2
local BAD = S.tensor({ 0, 1, 2, 3, 1, 2, 3, 0, 2, 0, 1, 7 }, "i32", { 2, 3, 2 }) -- 7 at rank 1, token 2, slot 1
local NAN = S.tensor({ 0, 0, 0, 0, 1, 2, 3, 4, 0 / 0, 1, 1, 1, 5, 5, 5, 5 }, "f32", { 4, 4 })
local s0 = moe.schedule { ids = I, experts = 4, rank = 0 }
local s1 = moe.schedule { ids = I, experts = 4, rank = 1 }
local X = moe.zeros({ 2, 3, 4 }, { dtype = "bf16" })
local function bf16(shape) return moe.zeros(shape, { dtype = "bf16" }) end
local function i32(shape) return moe.zeros(shape, { dtype = "i32" }) end
local XS, OFF, WGU, WD = bf16 { 6, 8 }, S.tensor({ 0, 2, 6 }, "i32", { 3 }), bf16 { 2, 8, 8 }, bf16 { 2, 8, 4 }
local YS = { bf16 { s0.capacity, 4 }, bf16 { s1.capacity, 4 } }
local W3 = moe.zeros({ 3, 2 })
local function experts(o)
  local a = { x = XS, offsets = OFF, w_gate_up = WGU, w_down = WD }
  for k, v in pairs(o) do a[k] = v end
  for k, v in pairs(a) do if v == false then a[k] = nil end end
  return moe.experts(a)
end
local function combine(o)
  local a = { schedules = { s0, s1 }, ys = YS, weights = W3 }
  for k, v in pairs(o) do a[k] = v end
  for k, v in pairs(a) do if v == false then a[k] = nil end end
  return moe.combine(a)
end
local tiny = { name = "tiny", experts = 4, k = 2, hidden = 16, ffn = 8, scoring = "softmax" }
local LAYER = moe.layer { model = tiny, world = 2, tokens = 2, device = "cpu" }
local LX = moe.zeros({ 2, 2, 16 }, { dtype = "bf16" })
-- routing for a tiny layer of 2 ranks of 2 tokens, top-2: every id valid, weight 0.5 but at
-- flat index bad (0-based), which gets v
local function routing(bad, v)
  local w = S.filled(8, 0.5)
  if bad then w[bad + 1] = v end
  return S.tensor({ 0, 1, 2, 3, 1, 2, 3, 0 }, "i32", { 2, 2, 2 }), S.tensor(w, "f32", { 2, 2, 2 })
end

local ROWS = {
  -- tensors
  { "tensor: unknown option", function() moe.tensor({ 1 }, { dtyp = "f32" }) end, "unknown option 'dtyp'" },
  { "tensor: unknown dtype", function() moe.tensor({ 1 }, { dtype = "f16" }) end,
    "option 'dtype' must be one of 'f32', 'bf16', 'i32', 'e4m3', got \"f16\"" },
  { "tensor: options not a table", function() moe.tensor({ 1 }, "f32") end, "expected a table of options, got string" },
  { "tensor: a fraction for i32", function() moe.tensor({ 1, 1.5 }, { dtype = "i32" }) end,
    { "element [2] is 1.5", "i32" } },
  { "tensor: i32 out of range", function() moe.tensor({ 2 ^ 31 }, { dtype = "i32" }) end, { "2147483648", "i32" } },
  { "tensor: a string element", function() moe.tensor({ 1, "a" }) end, { "element [2]", "string" } },
  { "tensor: ragged", function() moe.tensor({ { 1, 2 }, { 3 } }) end, { "ragged", "[2]" } },
  { "tensor: nested deeper than 4", function() moe.tensor({ { { { { 1 } } } } }) end, "4" },
  { "tensor: shape and data disagree", function() moe.tensor({ 1, 2, 3 }, { shape = { 2, 2 } }) end, { "4", "3" } },
  { "zeros: shape not a table", function() moe.zeros(3) end, "shape must be a table of sizes, got 3" },
  { "tensor: a shape past 2^40 elements, empty or not", function() moe.tensor({}, { shape = { 2 ^ 40, 2 ^ 40, 0 } }) end,
    "'tensor' (shape [1099511627776, 1099511627776, 0] has more than 2^40 elements" },
  { "zeros: a shape past 2^40 elements", function() moe.zeros({ 2 ^ 21, 2 ^ 20 }) end,
    "'zeros' (shape [2097152, 1048576] has more than 2^40 elements" },
  { "zeros: a shape whose product wraps 64 bits", function() moe.zeros({ 2 ^ 24, 2 ^ 40 }) end,
    "'zeros' (shape [16777216, 1099511627776] has more than 2^40 elements" },
  { "schedule_plan: an unknown option, named as schedule_plan", function()
    moe.schedule_plan { ids = moe.zeros({ 1, 2, 2 }, { dtype = "i32" }), experts = 4, pads = 2 }
  end, "bad argument #1 to 'schedule_plan' (unknown option 'pads'" },
  { "zeros: negative size", function() moe.zeros({ 2, -1 }) end, "shape[2] must be a non-negative integer, got -1" },
  { "zeros: fractional size", function() moe.zeros({ 2, 1.5 }) end, "shape[2] must be a non-negative integer, got 1.5" },
  { "zeros: a hole in the shape", function() moe.zeros({ 2, nil, 3 }) end,
    "bad argument #1 to 'zeros' (shape[2] must be a non-negative integer, got nil)" },
  { "zeros: 5 dimensions", function() moe.zeros({ 1, 1, 1, 1, 1 }) end, "at most 4 dimensions, got 5" },
  { "zeros: device not a string", function() moe.zeros({ 2 }, { device = 0 }) end,
    "option 'device' must be a device, 'cpu' or 'cuda:N', got 0" },
  { "tensor: a device index past what the binding reads", function() moe.tensor({ 1 }, { device = "cuda:99999999" }) end,
    "option 'device' must be a device, 'cpu' or 'cuda:N', got \"cuda:99999999\"" },
  { "event: bad device string", function() moe.event("gpu") end,
    "bad argument #1 to 'event' (expected a device, 'cpu' or 'cuda:N', got \"gpu\")" },
  { "zeros: bad device string", function() moe.zeros({ 2 }, { device = "gpu" }) end,
    "option 'device' must be a device, 'cpu' or 'cuda:N', got \"gpu\"" },
  { "zeros: malformed cuda device", function() moe.zeros({ 2 }, { device = "cuda:x" }) end,
    "option 'device' must be a device, 'cpu' or 'cuda:N', got \"cuda:x\"" },
  { "zeros: absent GPU", function() moe.zeros({ 2 }, { device = "cuda:99" }) end, "cuda:99" },
  { "to: bad device string", function() L:to("tpu") end, { "'tpu'", "expected 'cpu' or 'cuda:N'" } },
  { "randn: i32", function() moe.randn({ 2 }, { dtype = "i32" }) end,
    "option 'dtype' must be one of 'f32', 'bf16', got \"i32\"" },
  { "randn: fractional seed", function() moe.randn({ 2 }, { seed = 1.5 }) end, "option 'seed' must be an integer, got 1.5" },
  { "randn: unknown option", function() moe.randn({ 2 }, { sed = 1 }) end, "unknown option 'sed'" },
  { "full: value not a number", function() moe.full({ 2 }, "x") end, "value must be a number, got \"x\"" },
  { "view: a shape whose product overflows", function() L:view(0, { 2 ^ 62, 4 }) end,
    { "view: more than 2^40 elements", "f32 [4, 8]" } },
  { "a closed tensor as an option", function()
    local x
    do
      local t = bf16 { 2, 3, 4 }
      x = t
      t:close()
    end
    moe.dispatch { x = x, schedule = s0 }
  end, "option 'x' is a closed moelab.Tensor" },

  -- route
  { "route: unknown option", function() moe.route { logits = L, k = 2, topk = 2 } end, "unknown option 'topk'" },
  { "route: options not a table", function() moe.route(L) end, "expected a table of options, got a moelab.Tensor" },
  { "route: logits missing", function() moe.route { k = 2 } end, "option 'logits' is required" },
  { "route: logits not a tensor", function() moe.route { logits = { 1, 2 }, k = 2 } end,
    "option 'logits' must be a moelab.Tensor, got table" },
  { "route: logits bf16", function() moe.route { logits = bf16 { 4, 8 }, k = 2 } end,
    "option 'logits' must be f32 [_, _], got moelab.Tensor(bf16 [4, 8] on cpu)" },
  { "route: logits 3-D", function() moe.route { logits = moe.zeros({ 4, 8, 1 }), k = 2 } end,
    "option 'logits' must be f32 [_, _], got moelab.Tensor(f32 [4, 8, 1] on cpu)" },
  { "route: K > E", function() moe.route { logits = L, k = 9 } end, "option 'k' must be between 1 and 8, got 9" },
  { "route: K = 0", function() moe.route { logits = L, k = 0 } end, "option 'k' must be between 1 and 8, got 0" },
  { "route: k a string", function() moe.route { logits = L, k = "2" } end, "option 'k' must be an integer, got \"2\"" },
  { "route: k fractional", function() moe.route { logits = L, k = 1.5 } end, "option 'k' must be an integer, got 1.5" },
  { "route: unknown scoring", function() moe.route { logits = L, k = 2, scoring = "relu" } end,
    "option 'scoring' must be one of 'softmax', 'sigmoid', 'sqrtsoftplus', got \"relu\"" },
  { "route: groups not dividing E", function() moe.route { logits = L, k = 2, scoring = "sigmoid", groups = 3 } end,
    "option 'groups' (3) must divide the number of experts (8)" },
  { "route: groups with softmax", function() moe.route { logits = L, k = 2, groups = 2 } end,
    "option 'groups' (2) needs scoring = 'sigmoid', got 'softmax'" },
  { "route: topk_groups > groups", function()
    moe.route { logits = L, k = 2, scoring = "sigmoid", groups = 4, topk_groups = 5 }
  end, "option 'topk_groups' must be between 1 and 4, got 5" },
  { "route: K larger than the kept groups", function()
    moe.route { logits = L, k = 5, scoring = "sigmoid", groups = 4, topk_groups = 2 }
  end, "option 'k' (5) exceeds the 4 experts in the 2 kept groups" },
  { "route: bias with softmax", function() moe.route { logits = L, k = 2, bias = moe.zeros({ 8 }) } end,
    "option 'bias' needs scoring = 'sigmoid' or 'sqrtsoftplus'" },
  { "route: bias of the wrong size", function()
    moe.route { logits = L, k = 2, scoring = "sigmoid", bias = moe.zeros({ 7 }) }
  end, "bias must be f32 [8], got f32 [7] on cpu" },
  { "route: negative scale", function() moe.route { logits = L, k = 2, scoring = "sigmoid", scale = -1 } end,
    "option 'scale' must be a finite number > 0 that an f32 holds (2^-126 .. 3.4e38), got -1" },
  { "route: NaN scale", function() moe.route { logits = L, k = 2, scoring = "sigmoid", scale = 0 / 0 } end,
    { "option 'scale' must be a finite number > 0 that an f32 holds", "nan" } },
  { "route: a scale past the f32 range", function() moe.route { logits = L, k = 2, scoring = "sigmoid", scale = 1e300 } end,
    "option 'scale' must be a finite number > 0 that an f32 holds (2^-126 .. 3.4e38), got 1.0000000000000001e+300" },
  { "route: NaN logits", function() moe.route { logits = NAN, k = 2 } end,
    "logits contain NaN or cannot be scored in 1 row (a NaN, a +inf, a softmax row of -inf, a NaN score with the bias), "
      .. "the first is row 2 (0-based) of 4" },
  { "route: a +inf logit under softmax", function()
    moe.route { logits = moe.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 }, { 1, 1 / 0, 3, 4, 5, 6, 7, 8 } }), k = 2 }
  end, "cannot be scored in 1 row (a NaN, a +inf, a softmax row of -inf, a NaN score with the bias), the first is row 1" },
  { "route: unknown nan policy", function() moe.route { logits = L, k = 2, nan = "ignore" } end,
    "option 'nan' must be one of 'error', 'mask', got \"ignore\"" },
  { "route: ids of the wrong shape", function() moe.route { logits = L, k = 2, ids = i32 { 4, 3 } } end,
    "ids must be i32 [4, 2], got i32 [4, 3] on cpu" },
  { "route: weights of the wrong dtype", function() moe.route { logits = L, k = 2, weights = bf16 { 4, 2 } } end,
    "weights must be f32 [4, 2], got bf16 [4, 2] on cpu" },

  -- schedule
  { "schedule: unknown option", function() moe.schedule { ids = I, experts = 4, capacty = 8 } end,
    "unknown option 'capacty'" },
  { "schedule: ids missing", function() moe.schedule { experts = 4 } end, "option 'ids' is required" },
  { "schedule: experts missing", function() moe.schedule { ids = I } end, "option 'experts' is required" },
  { "schedule: ids f32", function() moe.schedule { ids = moe.zeros({ 2, 3, 2 }), experts = 4 } end,
    "option 'ids' must be i32 [_, _, _], got moelab.Tensor(f32 [2, 3, 2] on cpu)" },
  { "schedule: ids 2-D", function() moe.schedule { ids = i32 { 6, 2 }, experts = 4 } end,
    "option 'ids' must be i32 [_, _, _], got moelab.Tensor(i32 [6, 2] on cpu)" },
  { "schedule: no ranks", function() moe.schedule { ids = i32 { 0, 3, 2 }, experts = 4 } end,
    "option 'ids' has no ranks" },
  { "schedule: E not divisible by W", function() moe.schedule { ids = I, experts = 5 } end,
    "option 'experts' (5) must be a multiple of the world size 2" },
  { "schedule: E = 0", function() moe.schedule { ids = I, experts = 0 } end, "option 'experts' must be between 1 and 2147483647, got 0" },
  { "schedule: rank = W", function() moe.schedule { ids = I, experts = 4, rank = 2 } end,
    "option 'rank' must be between 0 and 1, got 2" },
  { "schedule: rank < 0", function() moe.schedule { ids = I, experts = 4, rank = -1 } end,
    "option 'rank' must be between 0 and 1, got -1" },
  { "schedule: pad 0", function() moe.schedule { ids = I, experts = 4, pad = 0 } end,
    "option 'pad' must be between 1 and 2147483647, got 0" },
  { "schedule: pad past i32", function() moe.schedule { ids = I, experts = 4, pad = math.floor(2 ^ 62) } end,
    "option 'pad' must be between 1 and 2147483647, got 4611686018427387904" },
  { "schedule: negative capacity", function() moe.schedule { ids = I, experts = 4, capacity = -1 } end,
    { "option 'capacity' must be between 0 and 2147483646", "got -1" } },
  { "schedule: negative expert_capacity", function() moe.schedule { ids = I, experts = 4, expert_capacity = -2 } end,
    { "option 'expert_capacity' must be between 0 and 2147483647", "got -2" } },
  { "schedule: capacity past i32", function() moe.schedule { ids = I, experts = 4, capacity = 2 ^ 31 } end,
    { "option 'capacity' must be between 0 and 2147483646", "got 2147483648" } },
  { "schedule: capacity 2^31 - 1, where a need past it could not be told", function()
    moe.schedule { ids = I, experts = 4, capacity = 0x7fffffff }
  end, { "option 'capacity' must be between 0 and 2147483646", "got 2147483647" } },
  { "schedule: unknown layout", function() moe.schedule { ids = I, experts = 4, layout = "rr" } end,
    "option 'layout' must be one of 'roundrobin', 'peer_major', got \"rr\"" },
  { "schedule: unknown overflow policy", function() moe.schedule { ids = I, experts = 4, overflow = "ignore" } end,
    "option 'overflow' must be one of 'error', 'drop', got \"ignore\"" },
  { "schedule: unknown invalid policy", function() moe.schedule { ids = I, experts = 4, invalid = "mask" } end,
    "option 'invalid' must be one of 'error', 'skip', got \"mask\"" },
  { "schedule: an id out of range names the id, rank, token and slot", function()
    moe.schedule { ids = BAD, experts = 4 }
  end, "invalid expert id 7 at rank 1, token 2, slot 1 (expected -1 or 0..3)" },
  { "schedule: an id out of range, from another rank's schedule", function()
    moe.schedule { ids = BAD, experts = 4, rank = 0, invalid = "error" }
  end, "invalid expert id 7 at rank 1, token 2, slot 1" },
  { "schedule: capacity overflow", function() moe.schedule { ids = I, experts = 4, capacity = 2 } end,
    "capacity overflow on rank 0: the routes need 6 rows, capacity is 2 (4 routes lost their row)" },
  { "schedule: capacity overflow with an expert capacity, whose drops the count includes", function()
    moe.schedule { ids = I, experts = 4, capacity = 1, expert_capacity = 1 }
  end, "routes lost their row, those past expert_capacity included)" },

  -- dispatch
  { "dispatch: a schedule with a closed tensor, named", function()
    local s = moe.schedule { ids = I, experts = 4 }
    s.peer_rank:close()
    moe.dispatch { x = X, schedule = s }
  end, "option 'schedule': the schedule's peer_rank tensor is closed" },
  { "dispatch: unknown option", function() moe.dispatch { x = X, schedule = s0, zero_fil = true } end,
    "unknown option 'zero_fil'" },
  { "dispatch: schedule missing", function() moe.dispatch { x = X } end, "option 'schedule' is required" },
  { "dispatch: x f32", function() moe.dispatch { x = moe.zeros({ 2, 3, 4 }), schedule = s0 } end,
    "option 'x' must be bf16 or e4m3 [_, _, _], got moelab.Tensor(f32 [2, 3, 4] on cpu)" },
  { "dispatch: x of another world size", function() moe.dispatch { x = bf16 { 3, 3, 4 }, schedule = s0 } end,
    "option 'x' is [3, 3, 4] but the schedule was made for 2 ranks of 3 tokens" },
  { "dispatch: x of another token count", function() moe.dispatch { x = bf16 { 2, 4, 4 }, schedule = s0 } end,
    "option 'x' is [2, 4, 4] but the schedule was made for 2 ranks of 3 tokens" },
  { "dispatch: schedule not a Schedule", function() moe.dispatch { x = X, schedule = {} } end,
    "option 'schedule' must be a moelab.Schedule (from moe.schedule), got table" },
  { "dispatch: k differs from the schedule's", function() moe.dispatch { x = X, schedule = s0, k = 3 } end,
    "option 'k' (3) differs from the schedule's top-k (2)" },
  { "dispatch: out of the wrong shape", function() moe.dispatch { x = X, schedule = s0, out = bf16 { 5, 4 } } end,
    string.format("bad argument #1 to 'dispatch' (out must be bf16 [%d, 4], got bf16 [5, 4] on cpu)", s0.capacity) },

  { "dispatch: out overlapping x", function()
    local buf = bf16 { 2 * 3 * 4 + s0.capacity * 4 }
    moe.dispatch { x = buf:view(0, { 2, 3, 4 }), schedule = s0, out = buf:view(4, { s0.capacity, 4 }) }
  end, "bad argument #1 to 'dispatch' (out and x share memory; outputs must not overlap other arguments)" },

  -- experts
  { "experts: unknown option", function() experts { bias = L } end, "unknown option 'bias'" },
  { "experts: w_down missing", function() experts { w_down = false } end, "option 'w_down' is required" },
  { "experts: x f32", function() experts { x = moe.zeros({ 6, 8 }) } end,
    "option 'x' must be bf16 [_, _], got moelab.Tensor(f32 [6, 8] on cpu)" },
  { "experts: odd gate_up rows", function() experts { w_gate_up = bf16 { 2, 7, 8 } } end,
    "w_gate_up must be bf16 [EL, 2F, 8] (F gate rows, then F up rows), got bf16 [2, 7, 8] on cpu" },
  { "experts: gate_up of another H", function() experts { w_gate_up = bf16 { 2, 8, 5 } } end,
    "bad argument #1 to 'experts' (w_gate_up must be bf16 [_, _, 8], got bf16 [2, 8, 5] on cpu)" },
  { "experts: w_down transposed", function() experts { w_down = bf16 { 2, 4, 8 } } end,
    "w_down must be bf16 [2, 8, 4], got bf16 [2, 4, 8] on cpu" },
  { "experts: offsets too short", function() experts { offsets = i32 { 2 } } end,
    "offsets must be i32 [3], got i32 [2] on cpu" },
  { "experts: offsets f32", function() experts { offsets = moe.zeros({ 3 }) } end,
    "offsets must be i32 [3], got f32 [3] on cpu" },
  { "experts: out of the wrong shape", function() experts { out = bf16 { 6, 4 } } end,
    "bad argument #1 to 'experts' (out must be bf16 [6, 8], got bf16 [6, 4] on cpu)" },

  { "experts: out overlapping w_down", function() experts { out = WD:view(0, { 6, 8 }) } end,
    "out and w_down share memory" },
  { "experts: out overlapping x, shifted by a row", function()
    local buf = bf16 { 7, 8 }
    experts { x = buf:view(0, { 6, 8 }), out = buf:view(8, { 6, 8 }) }
  end, "bad argument #1 to 'experts' (out and x share memory" },

  -- combine
  { "combine: unknown option", function() combine { weight = W3 } end, "unknown option 'weight'" },
  { "combine: weights missing", function() combine { weights = false } end, "option 'weights' is required" },
  { "combine: schedule and schedules", function() combine { schedule = s0 } end, "give exactly one of 'schedule'" },
  { "combine: neither y nor ys", function() combine { ys = false } end, "give exactly one of 'y'" },
  { "combine: too few schedules", function() combine { schedules = { s0 } } end,
    "a world of 2 ranks needs 2 schedules, got 1" },
  { "combine: too few ys", function() combine { ys = { YS[1] } } end,
    "a world of 2 ranks needs 2 expert outputs (ys), got 1" },
  { "combine: schedules out of order", function() combine { schedules = { s1, s0 } } end,
    "schedules[1] must be rank 0's schedule" },
  { "combine: a schedule that is not one", function() combine { schedules = { s0, {} } } end,
    "option 'schedules[2]' must be a moelab.Schedule (from moe.schedule), got table" },
  { "combine: weights of the wrong shape", function() combine { weights = moe.zeros({ 3, 3 }) } end,
    "bad argument #1 to 'combine' (weights must be f32 [3, 2], got f32 [3, 3] on cpu)" },
  { "combine: rank = W", function() combine { rank = 2 } end, "option 'rank' must be between 0 and 1, got 2" },
  { "combine: ys of another H", function() combine { ys = { YS[1], bf16 { s1.capacity, 5 } } } end,
    string.format("ys of rank 1 must be bf16 [_, 4], got bf16 [%d, 5] on cpu", s1.capacity) },
  { "combine: ys of another capacity", function() combine { ys = { bf16 { s0.capacity + 1, 4 }, YS[2] } } end,
    string.format("option 'ys[1]' must be a tensor [%d, _], got moelab.Tensor(bf16 [%d, 4] on cpu)", s0.capacity,
      s0.capacity + 1) },
  { "combine: shared of the wrong shape", function() combine { shared = bf16 { 3, 5 } } end,
    "bad argument #1 to 'combine' (shared must be bf16 [3, 4], got bf16 [3, 5] on cpu)" },
  { "combine: shared_gate of the wrong shape", function() combine { shared = bf16 { 3, 4 }, shared_gate = moe.zeros({ 2 }) } end,
    "shared_gate must be f32 [3], got f32 [2] on cpu" },
  { "combine: unknown dtype", function() combine { dtype = "i32" } end,
    "option 'dtype' must be one of 'bf16', 'f32', got \"i32\"" },
  { "combine: a closed out", function()
    local out = moe.zeros({ 3, 4 })
    out:close()
    combine { out = out }
  end, "option 'out' is a closed moelab.Tensor" },
  { "route: a closed ids buffer", function()
    local ids = i32 { 4, 2 }
    ids:close()
    moe.route { logits = L, k = 2, ids = ids, weights = moe.zeros({ 4, 2 }) }
  end, "field 'ids': moelab.Tensor is closed" },
  { "combine: schedules of other ids", function()
    local s1b = moe.schedule { ids = moe.zeros({ 2, 3, 2 }, { dtype = "i32" }), experts = 4, rank = 1 }
    combine { schedules = { s0, s1b }, ys = { YS[1], bf16 { s1b.capacity, 4 } } }
  end, "schedules[2] was made from other ids than schedules[1]" },
  { "combine: dtype and out disagree", function() combine { dtype = "f32", out = bf16 { 3, 4 } } end,
    "option 'dtype' is 'f32' but option 'out' is bf16" },

  { "combine: out overlapping a ys", function() combine { out = YS[2]:view(0, { 3, 4 }) } end,
    "out and ys of rank 1 share memory" },
  { "combine: out overlapping weights", function() combine { out = W3:view(0, { 3, 2 }), ys = { bf16 { s0.capacity, 2 },
    bf16 { s1.capacity, 2 } }, dtype = "f32" } end, "out and weights share memory" },
  { "route: weights overlapping logits", function() moe.route { logits = L, k = 2, weights = L:view(0, { 4, 2 }) } end,
    "weights and logits share memory; outputs must not overlap other arguments" },

  -- layer
  { "layer: unknown model name", function() moe.layer { model = "kimi", tokens = 4 } end,
    { "unknown model 'kimi'; expected one of: ", "kimi_k2", "qwen3_5_397b" } },
  { "layer: model neither a name nor a preset", function() moe.layer { model = 42, tokens = 4 } end,
    "option 'model' must be a preset from moe.models or its name, got 42" },
  { "layer: unknown option", function() moe.layer { model = "kimi_k2", tokns = 4 } end, "unknown option 'tokns'" },
  { "layer: no model", function() moe.layer { tokens = 4 } end, "(option 'model' is required)" },
  { "layer: the model's router setting that the options make wrong, said to be the model's", function()
    moe.layer { model = "deepseek_v3", tokens = 4, hidden = 16, ffn = 8, experts = 12, k = 2 }
  end, "option 'groups' (8) must divide the number of experts (12); the value is the model's (DeepSeek-V3)" },
  { "layer: a shared gate without a shared expert", function()
    moe.layer { model = "kimi_k2", tokens = 4, hidden = 16, ffn = 8, experts = 8, k = 2, shared = false,
      shared_gate = true }
  end, "option 'shared_gate' gates the shared expert, and this layer has none" },
  { "layer: a model field of the wrong type", function()
    moe.layer { model = { experts = 4, k = 2, hidden = 16, ffn = 8, scale = "x" }, tokens = 4 }
  end, "option 'scale' must be a number, got \"x\"" },
  { "layer: a misspelt model field", function()
    moe.layer { model = { experts = 4, k = 2, hidden = 16, ffn = 8, sharedffn = 16 }, tokens = 4 }
  end, "the model has a field \"sharedffn\", not one of: name, experts, k" },
  { "layer: a softmax model given a scale", function()
    moe.layer { model = "qwen3_235b", tokens = 4, hidden = 16, ffn = 8, scale = 2.5 }
  end, "option 'scale' (2.5) needs scoring = 'sigmoid' or 'sqrtsoftplus'" },
  { "route: a scale with softmax", function() moe.route { logits = L, k = 2, scale = 2 } end,
    "option 'scale' (2) needs scoring = 'sigmoid' or 'sqrtsoftplus': softmax's weights are renormalised to sum 1" },
  { "layer: a model's groups not an integer", function()
    moe.layer { model = { experts = 4, k = 2, hidden = 16, ffn = 8, groups = 1.5 }, tokens = 4 }
  end, "option 'groups' must be an integer, got 1.5" },
  { "layer: the default capacity past i32", function() moe.layer { model = "kimi_k2", tokens = 0x7fffffff } end,
    "the default capacity (2 tokens k + experts per rank x pad = 34359738736 rows) exceeds 2^31 - 2; pass capacity" },
  { "layer: tokens missing", function() moe.layer { model = "kimi_k2" } end, "option 'tokens' is required" },
  { "layer: E not divisible by W", function() moe.layer { model = "kimi_k2", tokens = 4, world = 5 } end,
    "the 384 experts cannot be split over a world of 5 ranks" },
  { "layer: pad 0", function() moe.layer { model = tiny, tokens = 4, pad = 0 } end,
    "option 'pad' must be between 1 and 2147483647, got 0" },
  { "layer: pad past i32", function() moe.layer { model = tiny, tokens = 4, pad = math.floor(2 ^ 62) } end,
    "option 'pad' must be between 1 and 2147483647, got 4611686018427387904" },
  { "layer: K > E", function() moe.layer { model = tiny, tokens = 4, k = 5 } end, "option 'k' must be between 1 and 4, got 5" },
  { "layer: negative capacity", function() moe.layer { model = tiny, tokens = 4, capacity = -1 } end,
    { "option 'capacity' must be between 0 and 2147483646", "got -1" } },
  { "layer: groups that do not divide the experts", function()
    moe.layer { model = tiny, tokens = 2, scoring = "sigmoid", groups = 3 }
  end, "bad argument #1 to 'layer' (option 'groups' (3) must divide the number of experts (4))" },
  { "layer: topk_groups above groups", function()
    moe.layer { model = tiny, tokens = 2, scoring = "sigmoid", groups = 2, topk_groups = 3 }
  end, "option 'topk_groups' must be between 1 and 2, got 3" },
  { "layer: negative scale", function() moe.layer { model = tiny, tokens = 2, scale = -1 } end,
    "option 'scale' must be a finite number > 0 that an f32 holds (2^-126 .. 3.4e38), got -1" },
  { "layer: a model with an unknown scoring", function()
    moe.layer { model = { experts = 4, k = 2, hidden = 16, ffn = 8, scoring = "relu" }, tokens = 2 }
  end, "option 'scoring' must be one of 'softmax', 'sigmoid', 'sqrtsoftplus', got \"relu\"" },
  { "layer: unknown layout", function() moe.layer { model = tiny, tokens = 4, layout = "zigzag" } end,
    "option 'layout' must be one of 'roundrobin', 'peer_major', got \"zigzag\"" },
  { "layer: zero tokens", function() moe.layer { model = tiny, tokens = 0 } end, "option 'tokens' must be between 1 and 2147483647, got 0" },
  { "layer: bad device string", function() moe.layer { model = tiny, tokens = 2, device = "tpu" } end,
    "option 'device' must be a device, 'cpu' or 'cuda:N', got \"tpu\"" },
  { "forward: x of the wrong shape", function() LAYER:forward(moe.zeros({ 2, 3, 16 }, { dtype = "bf16" })) end,
    "option 'x' must be bf16 [2, 2, 16], got moelab.Tensor(bf16 [2, 3, 16] on cpu)" },
  { "forward: unknown option", function() LAYER:forward(LX, { logit = moe.zeros({ 4, 4 }) }) end, "unknown option 'logit'" },
  { "forward: ids without weights", function() LAYER:forward(LX, { ids = i32 { 2, 2, 2 } }) end,
    "give 'ids' and 'weights' together" },
  { "forward: logits and ids", function()
    LAYER:forward(LX, { logits = moe.zeros({ 4, 4 }), ids = i32 { 2, 2, 2 }, weights = moe.zeros({ 2, 2, 2 }) })
  end, "give either 'logits' or 'ids' and 'weights', not both" },
  { "forward: logits of the wrong shape", function() LAYER:forward(LX, { logits = moe.zeros({ 4, 5 }) }) end,
    "option 'logits' must be f32 [4, 4], got moelab.Tensor(f32 [4, 5] on cpu)" },
  { "core.sleep: an infinite wait", function() moe.core.sleep(math.huge) end, "seconds must be a number up to 1e9" },
  { "check.close: unknown option", function() moe.check.close(L, L, { rtl = 1 }) end, "unknown option 'rtl'" },
  { "check.close: a NaN tolerance", function() moe.check.close(L, L, { rtol = 0 / 0 }) end,
    "option 'rtol' must be >= 0, got " },
  { "check.close: a negative tolerance", function() moe.check.close(L, L, { atol = -1 }) end,
    "option 'atol' must be >= 0, got -1" },
  { "check.close: shapes differ", function() moe.check.close(moe.zeros({ 2, 3 }), moe.zeros({ 3, 2 })) end,
    "shapes differ: got [2, 3], ref [3, 2]" },
  { "reference: ids without weights", function() LAYER:reference(LX, { ids = i32 { 2, 2, 2 } }) end,
    "give 'ids' and 'weights' together" },
  { "check: NaN logits a forward without checks let through", function()
    local layer = moe.layer { model = tiny, tokens = 2 }
    local x = moe.full({ 1, 2, 16 }, 0 / 0, { dtype = "bf16" })
    layer:forward(x, { check = false })
    layer:check(x)
  end, "layer: route: router logits contained NaN or could not be scored (+inf, all -inf) in 2 rows" },
  { "reference: NaN logits met by the reference's own routing", function()
    local layer = moe.layer { model = tiny, tokens = 2 }
    layer:reference(moe.full({ 1, 2, 16 }, 0 / 0, { dtype = "bf16" }))
  end, "layer: reference: router logits contain NaN" },
  { "reference: logits and routing", function()
    LAYER:reference(LX, { logits = moe.zeros({ 4, 4 }), routing = "forward" })
  end, "give at most one routing" },

  -- options read by their own keys: a metatable could hand out or hide keys the check never sees
  { "zeros: options whose keys come through __index", function()
    moe.zeros({ 2 }, setmetatable({}, { __index = { dtype = "i32" } }))
  end, "bad argument #1 to 'zeros' (expected the options as a plain table, got one with a metatable" },
  { "layer: a required option through __index", function()
    moe.layer(setmetatable({ model = tiny }, { __index = { tokens = 2 } }))
  end, "bad argument #1 to 'layer' (expected the options as a plain table" },
  { "schedule: options with a metatable of no __index", function()
    moe.schedule(setmetatable({ ids = I, experts = 4 }, {}))
  end, "bad argument #1 to 'schedule' (expected the options as a plain table" },
  { "layer: a model whose fields come through __index", function()
    moe.layer { model = setmetatable({ name = "proxy" }, { __index = tiny }), tokens = 2 }
  end, "bad argument #1 to 'layer' (expected option 'model' as a plain table" },

  -- a method called with '.' where ':' was meant
  { "forward called with '.'", function() LAYER.forward(LX) end,
    "bad argument #1 to 'forward' (expected a moelab.Layer as self, got moelab.Tensor(bf16 [2, 2, 16] on cpu): "
      .. "call it as layer:forward(...), with a colon)" },
  { "check called with '.' and nothing", function() LAYER.check() end,
    "bad argument #1 to 'check' (expected a moelab.Layer as self, got nil: call it as layer:check(...)" },
  { "a schedule's read_stats called with '.'", function() s0.read_stats() end,
    "bad argument #1 to 'read_stats' (expected a moelab.Schedule as self, got nil: call it as s:read_stats(...)" },
  { "a tensor's fill called with '.'", function() LX.fill(0) end,
    "bad argument #1 to 'fill' (expected a moelab.Tensor as self, got 0: call it as t:fill(...), with a colon)" },
  { "an event's record called with '.'", function() moe.event("cpu").record() end,
    "bad argument #1 to 'record' (expected a moelab.Event as self, got no value: call it as event:record(...)" },

  -- a tensor is not a table of its elements
  { "a tensor indexed by a number", function() return LX[1] end,
    "moelab.Tensor has no elements by index (t[1]): t:get(i) reads element i (1-based, flat), t:select(i)" },
  { "a tensor indexed by a boolean", function() return LX[true] end, "moelab.Tensor has no elements by index (t[boolean])" },
  { "an element assigned", function() LX[1] = 0 end, "moelab.Tensor cannot be assigned by index (t[1] = ...)" },
  { "a field assigned", function() LX.shape = { 4 } end,
    "moelab.Tensor has no field to set ('shape'): its shape, dtype and device are fixed" },

  -- values that mean nothing
  { "randn: a negative std", function() moe.randn({ 2 }, { std = -1 }) end, "randn: std must be finite and >= 0, got -1" },
  { "randn: an infinite std, in place", function() moe.zeros({ 2 }):randn(1, 1 / 0) end,
    "randn: std must be finite and >= 0, got inf" },
  { "route: logits of no experts", function() moe.route { logits = moe.zeros({ 4, 0 }), k = 1 } end,
    "option 'logits' has no experts to route to (its second dimension is 0), got moelab.Tensor(f32 [4, 0] on cpu)" },
  { "bench: a device that cannot be timed", function() moe.bench(function() end, { device = "cuda:999" }) end,
    "bad argument #1 to 'bench' (option 'device' (cuda:999) cannot be timed: event: cuda:999" },
  { "forward: the layer's output closed", function()
    local layer = moe.layer { model = tiny, tokens = 2 }
    S.close(layer.out)
    layer:forward(moe.zeros({ 1, 2, 16 }, { dtype = "bf16" }))
  end, "layer:forward: the layer's buffer layer.out is closed; a layer's buffers must stay open while it is used" },
  { "check: a schedule's buffer of the layer closed", function()
    local layer = moe.layer { model = tiny, tokens = 2 }
    S.close(layer.schedules[1].route_row)
    layer:check(moe.zeros({ 1, 2, 16 }, { dtype = "bf16" }))
  end, "layer:check: the layer's buffer layer.schedules[1].route_row is closed" },

  -- dropped routes under overflow = "error", whichever capacity dropped them
  { "schedule: expert_capacity 0 under overflow = 'error'", function()
    moe.schedule { ids = I, experts = 4, expert_capacity = 0 }
  end, "option 'expert_capacity' is 0, which drops every route, and option 'overflow' is 'error', which forbids "
    .. "dropping one: pass overflow = 'drop' to drop them, or expert_capacity >= 1" },
  { "layer: expert_capacity 0 under overflow = 'error'", function()
    moe.layer { model = tiny, tokens = 2, expert_capacity = 0 }
  end, "bad argument #1 to 'layer' (option 'expert_capacity' is 0, which drops every route" },
  { "schedule: routes past expert_capacity, within capacity", function()
    moe.schedule { ids = I, experts = 4, expert_capacity = 1 }
  end, "schedule: expert capacity overflow on rank 0: 4 routes past expert_capacity = 1 lost their row; raise "
    .. "expert_capacity or pass overflow = 'drop'" },
  { "check: routes past expert_capacity that a forward without checks let through", function()
    local layer = moe.layer { model = tiny, world = 2, tokens = 2, expert_capacity = 1 }
    local ids, w = routing()
    layer:forward(LX, { ids = ids, weights = w, check = false })
    layer:check(LX)
  end, "layer: schedule: expert capacity overflow on rank 0: 2 routes past expert_capacity = 1" },

  -- given routing weights must be finite
  { "forward: a NaN among the given weights", function()
    local layer = moe.layer { model = tiny, world = 2, tokens = 2 }
    local ids, w = routing(5, 0 / 0)
    layer:forward(LX, { ids = ids, weights = w })
  end, "layer: forward: option 'weights' holds 1 value that is NaN or infinite, the first at rank 1, token 0, slot 1: "
    .. "routing weights given to a layer must be finite" },
  { "forward: an infinite given weight, whatever nan says", function()
    local layer = moe.layer { model = tiny, world = 2, tokens = 2, nan = "mask" }
    local ids, w = routing(2, -1 / 0)
    layer:forward(LX, { ids = ids, weights = w })
  end, "option 'weights' holds 1 value that is NaN or infinite, the first at rank 0, token 1, slot 0" },
  { "check: NaN weights a forward without checks let through", function()
    local layer = moe.layer { model = tiny, world = 2, tokens = 2 }
    local ids, w = routing(7, 0 / 0)
    layer:forward(LX, { ids = ids, weights = w, check = false })
    layer:check(LX)
  end, "layer: forward: option 'weights' holds 1 value that is NaN or infinite, the first at rank 1, token 1, slot 1" },
  { "combine: a NaN weight", function() combine { weights = S.tensor({ 1, 1, 0 / 0, 1, 1, 1 }, "f32", { 3, 2 }) } end,
    "bad argument #1 to 'combine' (option 'weights' holds 1 value that is NaN or infinite, the first at token 1, slot 0: "
      .. "routing weights must be finite)" },
  { "combine: infinite weights", function() combine { weights = S.tensor({ 1, 1, 1, 1, 1 / 0, -1 / 0 }, "f32", { 3, 2 }) } end,
    "option 'weights' holds 2 values that are NaN or infinite, the first at token 2, slot 0" },

  -- sizes: the buffer and the options that size it, before anything is allocated
  { "dispatch: an output past 2^40 elements", function()
    local s = moe.schedule { ids = moe.zeros({ 1, 1, 1 }, { dtype = "i32" }), experts = 1, capacity = 2 ^ 21 }
    moe.dispatch { x = bf16 { 1, 1, 2 ^ 20 }, schedule = s }
  end, "bad argument #1 to 'dispatch' (out would be bf16 [2097152, 1048576], more than 2^40 elements (the schedule's "
    .. "capacity x the hidden size of x))" },
  { "layer: experts' weights past 2^40 elements", function()
    moe.layer { model = tiny, tokens = 2, hidden = 2 ^ 21, ffn = 2 ^ 20 }
  end, "bad argument #1 to 'layer' (w_gate_up would be bf16 [4, 2097152, 2097152], more than 2^40 elements (experts "
    .. "per rank x 2 ffn x hidden))" },
  { "layer: the real Kimi K2 on the CPU, past the budget", function()
    local _, err = S.without_allocating(function()
      moe.layer { model = "kimi_k2", tokens = 32, device = "cpu", memory_limit = 1e9 }
    end)
    error(err, 0)
  end, "bad argument #1 to 'layer' (the layer needs 33.9 GB of host memory, 1.0 GB allowed (memory_limit): its weights "
    .. "take 33.9 GB (hidden = 7168, ffn = 2048, 384 experts, shared_ffn = 2048), its buffers 26.7 MB (world = 1, "
    .. "tokens = 32, capacity = 896 rows); pass smaller hidden and ffn (the scenarios' CPU sizes: hidden = 256, ffn = "
    .. "128), or run it on a GPU, or state another budget with memory_limit = bytes)" },
  { "layer: buffers past the budget", function()
    moe.layer { model = tiny, tokens = 2 ^ 20, device = "cpu", memory_limit = 1e6 }
  end, { "the layer needs ", "of host memory, 1.0 MB allowed (memory_limit)", "pass fewer tokens or a smaller capacity" } },
  { "layer: a negative memory_limit", function() moe.layer { model = tiny, tokens = 2, memory_limit = -1 } end,
    "option 'memory_limit' must be >= 0, got -1" },
  { "layer: a NaN memory_limit", function() moe.layer { model = tiny, tokens = 2, memory_limit = 0 / 0 } end,
    "option 'memory_limit' must be >= 0, got " },
  { "full: a value past i32, named exactly", function() moe.full({ 2 }, 2 ^ 31, { dtype = "i32" }) end,
    { "bad argument #1 to 'full' (value must be an i32 value, an integer from -2147483648 to 2147483647, got ",
      "2147483648" } },
  { "fill: a value past i32, named exactly", function() i32({ 2 }):fill(2 ^ 31 + 1) end,
    "bad argument #1 to 'fill' (2147483649 is not an i32 value)" },
  { "copy: a source of another size, named as copy", function() i32({ 3 }):copy(i32({ 30 })) end,
    "bad argument #1 to 'copy' (cannot copy i32 [30] on cpu into i32 [3] on cpu)" },
  { "to: a device this machine lacks", function() moe.zeros({ 2 }):to("cuda:999") end,
    "bad argument #1 to 'to' (device cuda:999 " },
  { "zeros: a device this machine lacks", function() moe.zeros({ 2 }, { device = "cuda:999" }) end,
    "bad argument #1 to 'zeros' (option 'device' is \"cuda:999\", which " },
  { "full: a device this machine lacks", function() moe.full({ 2 }, 1, { device = "cuda:999" }) end,
    "bad argument #1 to 'full' (option 'device' is \"cuda:999\", which " },
  { "randn: a device this machine lacks", function() moe.randn({ 2 }, { device = "cuda:999" }) end,
    "bad argument #1 to 'randn' (option 'device' is \"cuda:999\", which " },
  { "layer: a device this machine lacks", function() moe.layer { model = tiny, tokens = 2, device = "cuda:999" } end,
    "bad argument #1 to 'layer' (option 'device' is \"cuda:999\", which " },
  { "config: an empty kernel name", function() moe.config { experts_kernel = "" } end,
    "bad argument #1 to 'config' (option 'experts_kernel' must be a kernel name or 'auto', got \"\")" },
  { "layer: a negative shared_ffn beside shared = false", function()
    moe.layer { model = tiny, tokens = 2, shared = false, shared_ffn = -1 }
  end, "bad argument #1 to 'layer' (option 'shared_ffn' must be >= 0, got -1)" },
  { "dispatch: a schedule that was never planned", function()
    moe.dispatch { x = X, schedule = setmetatable({}, moe.Schedule), k = 2 }
  end, "bad argument #1 to 'dispatch' (option 'schedule' must be a moelab.Schedule from moe.schedule or "
    .. "moe.schedule_plan, got a table with its metatable whose ids is nil)" },
  { "layer: a world that was never made", function()
    moe.layer { model = tiny, tokens = 2, world = setmetatable({}, moe.World) }
  end, "bad argument #1 to 'layer' (option 'world' must be a moe.world made by moe.world{...}, got a table with its "
    .. "metatable but not its fields (handle, size, ranks, devices))" },
  { "check: stats whose first invalid id is past the ids", function()
    local s = moe.schedule { ids = I, experts = 4 }
    s.stats_tensor:copy(S.tensor({ 0, 0, 0, 1, 99 }, "i32", { 5 }))
    s:check()
  end, "schedule: its stats (stats_tensor) are not a run's: first_invalid = 99 is not an index of the 12 ids" },
  { "check: stats that drop routes within capacity, no expert_capacity", function()
    local s = moe.schedule { ids = I, experts = 4 }
    s.stats_tensor:copy(S.tensor({ 0, 0, 1, 0, -1 }, "i32", { 5 }))
    s:check()
  end, "schedule: its stats (stats_tensor) are not a run's: dropped = 1 within capacity, and there is no "
    .. "expert_capacity to drop them" },
  { "check: a stats tensor replaced by another", function()
    local s = moe.schedule { ids = I, experts = 4 }
    s.stats_tensor = moe.zeros({ 2 })
    s:check()
  end, "schedule: its stats tensor (stats_tensor) must be an i32 [5] tensor, got " },
  { "explain: the experts' argument errors named as explain", function()
    moe.explain("experts", { x = XS, offsets = OFF, w_gate_up = WGU, w_down = bf16 { 2, 8, 5 } })
  end, "bad argument #1 to 'explain' (w_down must be bf16 [2, 8, 4], got bf16 [2, 8, 5] on cpu)" },
  { "layer_memory: the options of moe.layer, checked alike", function() moe.layer_memory { model = tiny, tokns = 2 } end,
    "bad argument #1 to 'layer' (unknown option 'tokns'" },
}

describe("argument errors", function()
  for _, row in ipairs(ROWS) do
    it(row[1], function()
      local ok, err = pcall(row[2])
      assert.is_false(ok, "no error raised")
      err = tostring(err)
      local frags = type(row[3]) == "table" and row[3] or { row[3] }
      for _, frag in ipairs(frags) do
        assert.truthy(err:find(frag, 1, true), string.format("expected %q in the message:\n%s", frag, err))
      end
      assert.truthy(err:find("^[^\n]-args_spec%.lua:%d+: "),
        "the error should point at the caller (args_spec.lua), got:\n" .. err)
      assert.falsy(err:find("^[^\n]-%.lua:%d+: [^\n]-%.lua:%d+: "), "a doubled position:\n" .. err)
    end)
  end
end)

-- moe.bench refuses its device before the function has run once.
describe("bench's device [#cpu]", function()
  it("is refused before fn runs", function()
    local runs = 0
    assert.is_false(pcall(moe.bench, function() runs = runs + 1 end, { device = "cuda:999" }))
    assert.are.equal(0, runs)
  end)
end)

-- MOE_THREADS as a user sets it, in a process of its own (the context reads it when it opens):
-- {value, a fragment of the refusal, or nil where the module loads}.
local ENV_ROWS = {
  { "abc", 'MOE_THREADS must be an integer from 1 to 256 (the CPU backend\'s threads), got "abc"' },
  { "0", 'got "0"; unset it for the online CPUs' },
  { "-3", 'got "-3"' },
  { "100000", 'got "100000"' },
  { "257", 'got "257"' },
  { "2.5", 'got "2.5"' },
  { "1", nil },
  { "256", nil },
  { "", nil },
}

describe("MOE_THREADS [#cpu]", function()
  local build = os.getenv("MOE_BUILD_DIR") or "build"
  for _, row in ipairs(ENV_ROWS) do
    it(string.format("MOE_THREADS=%q %s", row[1], row[2] and "is refused, naming it" or "is taken"), function()
      local cmd = string.format("MOE_THREADS='%s' LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' "
        .. "lua -e 'require \"moelab\"; print(\"loaded\")' 2>&1; echo \"status=$?\"", row[1], build)
      local f = assert(io.popen(cmd))
      local out = f:read("a")
      f:close()
      if row[2] then
        assert.truthy(out:find("moelab.core: cannot open a context: ", 1, true), out)
        assert.truthy(out:find(row[2], 1, true), out)
        assert.falsy(out:find("status=0", 1, true), out)
      else
        assert.truthy(out:find("loaded\nstatus=0", 1, true), out)
      end
    end)
  end
end)

for _, dev in ipairs(ALL_DEVICES) do
  if dev ~= "cpu" then
    describe("argument errors across devices [" .. device_tag(dev) .. "]", function()
      if skip_without(dev) then return end
      it("route: bias on another device", function()
        local ok, err = pcall(moe.route, { logits = L:to(dev), k = 2, scoring = "sigmoid", bias = moe.zeros({ 8 }) })
        assert.is_false(ok)
        assert.truthy(err:find("bias must be on " .. dev .. ", where logits is, got f32 [8] on cpu", 1, true), err)
      end)
      it("dispatch: x on another device than the schedule", function()
        local ok, err = pcall(moe.dispatch, { x = X:to(dev), schedule = s0 })
        assert.is_false(ok)
        assert.truthy(err:find(dev, 1, true) and err:find("cpu", 1, true), err)
      end)
    end)
  end
end
