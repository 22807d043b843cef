-- SPDX-License-Identifier: MIT
-- Calls of the stages: moe.route, moe.schedule and moe.schedule_plan with a Schedule's methods,
-- moe.dispatch, moe.experts, moe.combine and moe.explain.  Each starts from a valid call on a
-- small random problem, then maybe breaks it; whatever returns is checked against the plain-Lua
-- stages of spec/fuzz/oracle.lua, computed from the arguments the call was actually given.
local moe = require "moelab"
local O = require "fuzz.oracle"
local mutate = require "fuzz.mutate"
local T = require "fuzz.tensors"

local G = {}
local plain = T.plain

-- Whether every tensor named in the options is open and real (the oracle can read them), and
-- the first `needed` of them present.
local function readable(o, names, needed)
  if not plain(o) then return false end
  for i, n in ipairs(names) do
    local v = rawget(o, n)
    if (v ~= nil or i <= (needed or 0)) and (not mutate.is_tensor(v) or v.closed) then return false end
  end
  return true
end

-- After a call that returned: the shadow of each given output taken again (its contents were
-- checked by the caller); a new output added to the pool.
local function outputs_written(F, list)
  for _, t in ipairs(list) do
    local e = F.pool:entry_of(t)
    if e then
      if not e.closed then F.pool:write(e, t:flat()) end
      e.buf.last = "the last call"
    elseif mutate.is_tensor(t) and not t.closed then
      F.pool:add(t)
    end
  end
end

-- ---------------------------------------------------------------- 1. route

local SCORINGS = { "softmax", "sigmoid", "sqrtsoftplus" }

local function logit(F)
  local r = F.rng:int(1, 60)
  if r == 1 then return 0 / 0 end
  if r == 2 then return math.huge end
  if r == 3 then return -math.huge end
  if r == 4 then return F.rng:pick { 1e30, -1e30, 3e38 } end
  return F.rng:int(-16, 16) / 4
end

local function divisors(n)
  local d = {}
  for g = 2, n do if n % g == 0 then d[#d + 1] = g end end
  return d
end

local ROUTE_SPEC = {
  logits = { kind = "tensor", dtype = "f32" }, k = { kind = "int" }, scoring = { kind = "str", choices = SCORINGS },
  bias = { kind = "tensor", dtype = "f32" }, groups = { kind = "int" }, topk_groups = { kind = "int" },
  scale = { kind = "num" }, nan = { kind = "str", choices = { "error", "mask" } },
  ids = { kind = "tensor", dtype = "i32" }, weights = { kind = "tensor", dtype = "f32" },
}

function G.route(F)
  local N, E = F.rng:chance(0.1) and 0 or F.rng:int(1, 6), F.rng:int(1, 12)
  local o = { scoring = F.rng:chance(0.8) and F.rng:pick(SCORINGS) or nil }
  local scoring = o.scoring or "softmax"
  local K = F.rng:int(1, math.min(E, 6))
  if scoring == "sigmoid" and F.rng:chance(0.4) and #divisors(E) > 0 then
    o.groups = F.rng:pick(divisors(E))
    o.topk_groups = F.rng:int(1, o.groups)
    K = F.rng:int(1, o.topk_groups * (E / o.groups))
  end
  o.k = K
  local lg = {}
  for i = 1, N * E do lg[i] = logit(F) end
  o.logits = F:fresh("f32", { N, E }, lg)
  if scoring ~= "softmax" then
    if F.rng:chance(0.5) then
      local b = {}
      for i = 1, E do b[i] = F.rng:int(-8, 8) / 64 end
      o.bias = F:fresh("f32", { E }, b)
    end
    o.scale = F.rng:chance(0.5) and F.rng:pick { 1, 2.5, 2.827, 0.5 } or nil
  end
  o.nan = F.rng:chance(0.5) and F.rng:pick { "error", "mask" } or nil
  if F.rng:chance(0.2) then
    local iv = F:values(N * K)
    for i = 1, #iv do iv[i] = math.floor(iv[i]) end
    o.ids = F:fresh("i32", { N, K }, iv)
    o.weights = F:fresh("f32", { N, K }, F:values(N * K))
  end
  local bad
  local r = F.rng:int(1, 14)
  if r <= 4 then
    local _
    o, _, bad = mutate.options(F, o, ROUTE_SPEC, { "logits", "k" })
  elseif r == 5 then
    o.logits = F.rng:pick { F:fresh("f32", { N }, F:values(N)), moe.zeros({ N, 0 }), moe.zeros({ N, E }, { dtype = "bf16" }) }
    bad = "logits not f32 [N, E] with E >= 1"
  elseif r == 6 then
    o.k = F.rng:pick { 0, E + 1, -1 }
    bad = "k outside [1, E]"
  end
  local c = F:call { name = "moe.route", args = { o }, n = 1, bad = bad }
  c.check = function(res)
    local ids, weights, info = res[2], res[3], res[4]
    if not readable(o, { "logits", "bias", "ids", "weights" }, 1) then
      outputs_written(F, { ids, weights })
      return nil
    end
    local n, e, k = o.logits.shape[1], o.logits.shape[2], o.k
    local problem = T.holds(ids, "i32", { n, k }, nil, "ids") or T.holds(weights, "f32", { n, k }, nil, "weights")
    if problem then return problem end
    if (o.ids and not rawequal(ids, o.ids)) or (o.weights and not rawequal(weights, o.weights)) then
      return "the ids or weights returned are not the tensors given"
    end
    local o2 = { scoring = o.scoring, bias = o.bias and o.bias:flat(), groups = o.groups, topk_groups = o.topk_groups,
      scale = o.scale }
    local lflat = o.logits:flat()
    problem = O.route(lflat, n, e, k, o2, ids:flat(), weights:flat())
    if problem then return problem end
    local rejected = 0
    local gotids = ids:flat()
    for row = 0, n - 1 do if k > 0 and gotids[row * k + 1] == -1 then rejected = rejected + 1 end end
    if type(info) ~= "table" or info.nan_rows ~= rejected then
      return string.format("info.nan_rows is %s, but %d rows were routed nowhere", tostring(info and info.nan_rows),
        rejected)
    end
    if rejected > 0 and o.nan ~= "mask" then
      return string.format("returned with %d rows that could not be scored under nan = %s", rejected,
        tostring(o.nan or "error (the default)"))
    end
    outputs_written(F, { ids, weights })
  end
  -- the rows that could not be scored are found after the stage has written the outputs; so is
  -- option nan read, which the caller's own __index may answer with an error
  c.on_error = function(msg)
    if msg == mutate.TRAP or (type(msg) == "string" and msg:find("route: logits contain NaN", 1, true)) then
      local ok, ids, weights = pcall(function() return o.ids, o.weights end) -- options behind __index too
      if not ok and type(o) == "table" then ids, weights = rawget(o, "ids"), rawget(o, "weights") end
      outputs_written(F, { ids, weights })
    end
  end
  return c
end

-- ---------------------------------------------------------------- 2. schedule

local LAYOUTS = { "roundrobin", "peer_major" }

-- A small routing: ids i32 [W, T, K] over E = W EL experts, as a fresh tensor; and its sizes.
local function routing(F, opts)
  opts = opts or {}
  local W = opts.W or F.rng:pick { 1, 1, 2, 2, 3, 4 }
  local EL = opts.EL or F.rng:int(1, 4)
  local E = W * EL
  local K = opts.K or F.rng:int(1, math.min(E, 4))
  local Tn = opts.T or (F.rng:chance(0.08) and 0 or F.rng:int(1, 5))
  local vals = {}
  local skew = F.rng:chance(0.3) and F.rng:int(0, E - 1) -- most routes to one expert
  for i = 1, W * Tn * K do
    local r = F.rng:int(1, 40)
    if r == 1 and not opts.valid then vals[i] = F.rng:pick { E, -2, 2147483647, -2147483648 }
    elseif r <= 4 then vals[i] = -1
    elseif skew and r <= 20 then vals[i] = skew
    else vals[i] = F.rng:int(0, E - 1) end
  end
  local ids = F:fresh("i32", { W, Tn, K }, vals)
  return { W = W, EL = EL, E = E, K = K, T = Tn, ids = ids }
end

-- The capacity moe.schedule resolves for options o (rows), as docs/lua-api.md defines it.
local function capacity_of(o, W, Tn, K, EL, pad, default)
  local cap = o.capacity
  if cap == nil then cap = default end
  if cap == "worst" then
    local rows = W * Tn * K + EL * (pad - 1)
    if o.expert_capacity then rows = math.min(rows, EL * math.ceil(o.expert_capacity / pad) * pad) end
    return rows
  end
  if cap == "twice_mean" then return 2 * Tn * K + EL * pad end
  return cap
end

local SCHEDULE_SPEC = {
  ids = { kind = "tensor", dtype = "i32" }, experts = { kind = "int" }, rank = { kind = "int" },
  pad = { kind = "int", ok = function(v) return v >= 1 and v <= 2 ^ 31 - 1 end }, capacity = { kind = "any" },
  expert_capacity = { kind = "int", ok = function(v) return v >= 0 and v <= 2 ^ 31 - 1 end },
  layout = { kind = "str", choices = LAYOUTS }, overflow = { kind = "str", choices = { "error", "drop" } },
  invalid = { kind = "str", choices = { "error", "skip" } },
}

-- Valid options of a schedule of routing p.
local function schedule_options(F, p, rank)
  local o = { ids = p.ids, experts = p.E, rank = rank or (F.rng:chance(0.8) and F.rng:int(0, p.W - 1) or nil),
    pad = F.rng:chance(0.6) and F.rng:pick { 1, 2, 4, 8 } or nil,
    expert_capacity = F.rng:chance(0.2) and F.rng:int(0, 4) or nil,
    layout = F.rng:chance(0.7) and F.rng:pick(LAYOUTS) or nil,
    overflow = F.rng:chance(0.5) and F.rng:pick { "error", "drop" } or nil,
    invalid = F.rng:chance(0.5) and F.rng:pick { "error", "skip" } or nil }
  -- rows as a number a third of the time, often fewer than the routes need (an overflow)
  local r = F.rng:int(1, 6)
  if r == 1 then o.capacity = F.rng:pick { "worst", "twice_mean" }
  elseif r <= 3 then o.capacity = F.rng:int(0, F.rng:chance(0.5) and p.T * p.K or p.W * p.T * p.K + 4) end
  return o
end

local SCHEDULE_OUTPUTS = { "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets", "route_row" }

-- The outputs of schedule s (as its tensors hold them) against the oracle on its ids as they are.
local function schedule_problem(s)
  local ids = s.ids
  local W, TK = ids.shape[1], ids.shape[2] * ids.shape[3]
  local want = O.schedule(ids:flat(), W, TK, s.experts, s.rank, s.pad, s.capacity, s.expert_capacity, s.layout)
  for _, name in ipairs(SCHEDULE_OUTPUTS) do
    local got = s[name]:flat()
    local i = O.first_difference(got, want[name])
    if i then
      return string.format("schedule %s[%d] is %s, expected %s (%s layout, pad %d, capacity %d)", name, i,
        tostring(got[i]), tostring(want[name][i]), s.layout, s.pad, s.capacity)
    end
  end
  local st = s.stats_tensor:flat()
  local i = O.first_difference(st, want.stats)
  if i then return string.format("schedule stats[%d] is %s, expected %s", i, tostring(st[i]), tostring(want.stats[i])) end
  return nil, want.stats
end

-- Registers schedule s in the sequence: its tensors join the pool as volatile (run rewrites them).
local function keep_schedule(F, s)
  F.pool:name(s, "s")
  for _, name in ipairs(SCHEDULE_OUTPUTS) do F.pool:add(s[name], nil, nil, true) end
  F.pool:add(s.stats_tensor, nil, nil, true)
  F.schedules[#F.schedules + 1] = s
end

function G.schedule(F)
  local p = routing(F)
  local o = schedule_options(F, p)
  local plan = F.rng:chance(0.25)
  local bad
  local r = F.rng:int(1, 14)
  if r <= 5 then
    local _
    o, _, bad = mutate.options(F, o, SCHEDULE_SPEC, { "ids", "experts" })
  elseif r == 6 then
    o.experts = F.rng:pick { p.E + 1, 0, -p.W }
    bad = (o.experts < 1 or o.experts % p.W ~= 0) and "experts not a positive multiple of the world" or nil
  elseif r == 7 then
    o.rank = F.rng:pick { p.W, -1 }
    bad = "rank outside the world"
  elseif r == 8 then
    o.capacity = F.rng:pick { "most", -1, 2 ^ 31, 1.5, {} }
    bad = "capacity neither rows nor a policy"
  end
  local name = plan and "moe.schedule_plan" or "moe.schedule"
  local c = F:call { name = name, args = { o }, n = 1, bad = bad,
    names = plan and { "schedule_plan" } or { "schedule" } }
  c.check = function(res)
    local s = res[2]
    if getmetatable(s) ~= moe.Schedule then return name .. " returned " .. tostring(s) .. ", not a moelab.Schedule" end
    keep_schedule(F, s)
    if not readable(o, { "ids" }, 1) then return nil end
    local ids = o.ids
    local W, Tn, K = ids.shape[1], ids.shape[2], ids.shape[3]
    local pad = o.pad or 1
    local want_cap = capacity_of(o, W, Tn, K, o.experts / W, pad, "worst")
    if s.capacity ~= want_cap or s.pad ~= pad or s.world ~= W or s.tokens ~= Tn or s.k ~= K or s.rank ~= (o.rank or 0)
      or s.experts ~= o.experts or s.layout ~= (o.layout or "roundrobin") then
      return string.format("the schedule's sizes differ from its options: capacity %s (expected %s), pad %s, rank %s",
        tostring(s.capacity), tostring(want_cap), tostring(s.pad), tostring(s.rank))
    end
    if plan then return nil end
    local problem, st = schedule_problem(s)
    if problem then return problem end
    if st[4] > 0 and (o.invalid or "error") == "error" then return "returned with invalid ids under invalid = 'error'" end
    if st[1] > s.capacity and (o.overflow or "error") == "error" then
      return "returned with a capacity overflow under overflow = 'error'"
    end
  end
  return c
end

-- A schedule of the sequence (a new valid one when there is none, or now and then).
local function some_schedule(F)
  if #F.schedules == 0 or F.rng:chance(0.2) then
    local p = routing(F, { valid = true })
    local o = schedule_options(F, p)
    o.overflow, o.invalid = "drop", "skip"
    keep_schedule(F, moe.schedule(o))
  end
  return F.rng:pick(F.schedules)
end

-- Writes values no schedule makes into one of s's tensors named in fields (the caller owns
-- them: a stage must treat their contents as data, never trust them as indices).
local function poke(F, s, fields)
  local field = F.rng:pick(fields)
  local t = s[field]
  if t.closed or t:numel() == 0 then return "" end
  local v = t:flat()
  for _ = 1, F.rng:int(1, 3) do
    v[F.rng:int(1, #v)] = F.rng:pick { -1, -7, s.capacity, s.capacity + 3, s.world, s.tokens * s.k, 2147483647,
      -2147483648 }
  end
  t:copy(moe.tensor(v, { dtype = "i32", shape = t.shape }))
  return string.format("  -- %s.%s holds values no schedule makes", F.pool.names[s] or "s", field)
end

local SCHEDULE_METHODS = { "run", "check", "read_stats", "explain", "__tostring" }

-- A method of a schedule of the sequence; the wrong style now and then.
function G.schedule_method(F)
  local s = some_schedule(F)
  local m = F.rng:pick(SCHEDULE_METHODS)
  local sname = F.pool.names[s]
  if m == "__tostring" then
    return { name = "tostring(schedule)", text = "tostring(" .. sname .. ")", names = { "tostring" },
      fn = function() return tostring(s) end,
      check = function(res) if type(res[2]) ~= "string" then return "tostring gave " .. type(res[2]) end end }
  end
  local dot = F.rng:chance(0.12)
  local c = F:method { obj = s, method = m, dot = dot, names = { m, "schedule" }, name = "schedule:" .. m }
  local closed
  for _, f in ipairs { "ids", "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets", "route_row",
    "stats_tensor" } do
    if s[f].closed then closed = f end
  end
  if dot then c.bad = "a method called with '.'" end
  if closed and (m == "run" or m == "explain" or (closed == "stats_tensor" and m ~= "explain")) then
    c.bad = c.bad or ("the schedule's " .. closed .. " tensor is closed")
  end
  local stats_before = not s.stats_tensor.closed and s.stats_tensor:flat()
  if m == "check" and stats_before and not dot and not closed then
    local raises = (stats_before[4] > 0 and s.invalid == "error") or (stats_before[1] > s.capacity and s.overflow == "error")
    if raises then c.bad = "check of a schedule whose stats break its policy" end
  end
  c.check = function(res)
    if m == "run" then
      local problem = schedule_problem(s)
      return problem
    elseif m == "read_stats" then
      local st = res[2]
      local want = s.stats_tensor:flat()
      if type(st) ~= "table" or st.rows_needed ~= want[1] or st.rows_used ~= want[2] or st.dropped ~= want[3]
        or st.invalid ~= want[4] or st.first_invalid ~= want[5] then
        return "read_stats() differs from the stats tensor"
      end
    elseif m == "explain" then
      if type(res[2]) ~= "table" or type(res[2].kernel) ~= "string" then return "explain() gave no kernel" end
    elseif m == "check" then
      if not rawequal(res[2], s) then return "check() did not return the schedule" end
    end
  end
  return c
end

-- ---------------------------------------------------------------- 3. dispatch

local DISPATCH_SPEC = { x = { kind = "tensor", dtype = "bf16" }, schedule = { kind = "table" }, k = { kind = "int" },
  zero_fill = { kind = "bool" }, out = { kind = "tensor", dtype = "bf16" } }

function G.dispatch(F)
  local s = some_schedule(F)
  local H = F.rng:int(1, 6)
  local o = { schedule = s, k = F.rng:chance(0.3) and s.k or nil, zero_fill = F.rng:chance(0.5) and F.rng:chance(0.5) or nil }
  o.x = F:fresh("bf16", { s.world, s.tokens, H }, F:values(s.world * s.tokens * H))
  if F.rng:chance(0.3) then o.out = F:fresh("bf16", { s.capacity, H }, F:values(s.capacity * H)) end
  local bad
  local r = F.rng:int(1, 14)
  if r <= 4 then
    local _
    o, _, bad = mutate.options(F, o, DISPATCH_SPEC, { "x", "schedule" })
  elseif r == 5 then
    o.x = F:fresh("bf16", { s.world, s.tokens + 1, H }, F:values(s.world * (s.tokens + 1) * H))
    bad = "x of another number of tokens"
  elseif r == 6 then
    o.k = s.k + 1
    bad = "k other than the schedule's"
  elseif r == 7 then
    o.out = o.x
    bad = o.x.shape[1] * o.x.shape[2] ~= s.capacity and "an out of the wrong shape" or "out is x"
  elseif r == 8 then
    o.schedule = F.rng:pick { {}, setmetatable({}, moe.Schedule), { world = s.world, tokens = s.tokens } }
    bad = "not a schedule"
  end
  local poked = F.rng:chance(0.15) and poke(F, s, { "peer_rank", "peer_route" }) or ""
  local c = F:call { name = "moe.dispatch", args = { o }, n = 1, bad = bad }
  c.text = c.text .. poked
  local before = plain(o) and mutate.is_tensor(rawget(o, "out")) and not o.out.closed and o.out:flat()
  c.check = function(res)
    local out = res[2]
    if not readable(o, { "x", "out" }, 1) or getmetatable(o.schedule) ~= moe.Schedule then
      outputs_written(F, { out })
      return nil
    end
    local x, sch = o.x, o.schedule
    local Hx = x.shape[3]
    local problem = T.holds(out, "bf16", { sch.capacity, Hx }, nil, "dispatch's out")
    if problem then return problem end
    local prior = before
    if not prior then
      prior = {}
      for i = 1, sch.capacity * Hx do prior[i] = 0 end
    end
    local want = O.dispatch(prior, x:flat(), x.shape[1], x.shape[2], Hx, sch.k, sch.peer_rank:flat(),
      sch.peer_route:flat(), o.zero_fill)
    local got = out:flat()
    local i = O.first_difference(got, want)
    if i then return string.format("dispatch's out[%d] is %s, expected %s", i, tostring(got[i]), tostring(want[i])) end
    outputs_written(F, { out })
  end
  return c
end

-- ---------------------------------------------------------------- 4. experts

local EXPERTS_SPEC = { x = { kind = "tensor", dtype = "bf16" }, offsets = { kind = "tensor", dtype = "i32" },
  w_gate_up = { kind = "tensor", dtype = "bf16" }, w_down = { kind = "tensor", dtype = "bf16" },
  out = { kind = "tensor", dtype = "bf16" } }

-- Valid options of moe.experts: from a schedule's rows, or rows with offsets of any values.
local function experts_options(F)
  local C, EL, offsets
  if F.rng:chance(0.5) then
    local s = some_schedule(F)
    C, EL, offsets = s.capacity, s.local_experts, s.expert_offsets
  else
    C, EL = F.rng:int(0, 12), F.rng:int(1, 4)
    local off = {}
    for i = 1, EL + 1 do off[i] = F.rng:chance(0.2) and F.rng:pick { -3, C + 5, 2147483647 } or F.rng:int(0, C) end
    if F.rng:chance(0.6) then table.sort(off) end
    offsets = F:fresh("i32", { EL + 1 }, off)
  end
  local H, Fw = F.rng:int(1, 8), F.rng:int(1, 6)
  local o = { x = F:fresh("bf16", { C, H }, F:values(C * H, 2)), offsets = offsets,
    w_gate_up = moe.randn({ EL, 2 * Fw, H }, { seed = F.rng:int(1, 99), std = 0.5, dtype = "bf16" }),
    w_down = moe.randn({ EL, H, Fw }, { seed = F.rng:int(1, 99), std = 0.5, dtype = "bf16" }) }
  F.pool:add(o.w_gate_up)
  F.pool:add(o.w_down)
  local r = F.rng:int(1, 5)
  if r == 1 then o.out = o.x
  elseif r == 2 then o.out = F:fresh("bf16", { C, H }, F:values(C * H)) end
  return o
end

function G.experts(F)
  local o = experts_options(F)
  local bad
  local r = F.rng:int(1, 14)
  if r <= 4 then
    local _
    o, _, bad = mutate.options(F, o, EXPERTS_SPEC, { "x", "offsets", "w_gate_up", "w_down" })
  elseif r == 5 then
    local s = o.w_down.shape
    o.w_down = moe.zeros({ s[1], s[2], s[3] + 1 }, { dtype = "bf16" })
    bad = "w_down of another F"
  elseif r == 6 then
    local s = o.w_gate_up.shape
    o.w_gate_up = moe.zeros({ s[1], s[2] + 1, s[3] }, { dtype = "bf16" })
    bad = "w_gate_up with an odd 2F"
  elseif r == 7 then
    o.offsets = moe.zeros({ o.w_down.shape[1] + 2 }, { dtype = "i32" })
    bad = "offsets of another EL"
  elseif r == 8 and o.x:numel() > 0 then
    o.out = o.x:view(0, { o.x:numel() })
    bad = "an out of the wrong shape"
  end
  local c = F:call { name = "moe.experts", args = { o }, n = 1, bad = bad }
  local ok_args = readable(o, { "x", "offsets", "w_gate_up", "w_down", "out" }, 4)
  local before_x = ok_args and o.x:flat()
  local before_out = ok_args and o.out and o.out:flat()
  c.check = function(res)
    local out = res[2]
    if not ok_args then
      outputs_written(F, { out })
      return nil
    end
    local C, H = o.x.shape[1], o.x.shape[2]
    local EL, Fw = o.w_gate_up.shape[1], o.w_gate_up.shape[2] / 2
    local problem = T.holds(out, "bf16", { C, H }, nil, "experts' out")
    if problem then return problem end
    local prior = before_out
    if not prior then
      prior = {}
      for i = 1, C * H do prior[i] = 0 end
    end
    local want, written = O.experts(prior, before_x, C, H, EL, Fw, o.offsets:flat(), o.w_gate_up:flat(), o.w_down:flat())
    local got = out:flat()
    local gw, ww = {}, {}
    for row = 0, C - 1 do
      for h = 1, H do
        local i = row * H + h
        if written[row] then
          gw[#gw + 1], ww[#ww + 1] = got[i], want[i]
        elseif got[i] ~= prior[i] and not (got[i] ~= got[i] and prior[i] ~= prior[i]) then
          return string.format("experts wrote row %d, which no expert owns (offsets %s)", row,
            table.concat(o.offsets:flat(), ", "))
        end
      end
    end
    problem = O.near(gw, ww, 2e-2, 1e-6, "experts' rows")
    if problem then return problem end
    outputs_written(F, { out })
  end
  return c
end

-- ---------------------------------------------------------------- 5. combine

local COMBINE_SPEC = { schedule = { kind = "table" }, schedules = { kind = "table" }, y = { kind = "tensor", dtype = "bf16" },
  ys = { kind = "table" }, weights = { kind = "tensor", dtype = "f32" }, rank = { kind = "int" },
  out = { kind = "tensor" }, shared = { kind = "tensor", dtype = "bf16" }, shared_gate = { kind = "tensor", dtype = "f32" },
  dtype = { kind = "str", choices = { "bf16", "f32" } } }

function G.combine(F)
  local p = routing(F, { valid = F.rng:chance(0.7) })
  local base = schedule_options(F, p, 0)
  base.overflow, base.invalid = "drop", "skip"
  local schedules = {}
  for r = 0, p.W - 1 do
    base.rank = r
    schedules[r + 1] = moe.schedule(base)
    keep_schedule(F, schedules[r + 1])
  end
  local poked = F.rng:chance(0.15) and poke(F, F.rng:pick(schedules), { "route_row" }) or ""
  local H = F.rng:int(1, 6)
  local ys = {}
  for r = 1, p.W do ys[r] = F:fresh("bf16", { schedules[r].capacity, H }, F:values(schedules[r].capacity * H)) end
  local rank = F.rng:int(0, p.W - 1)
  local wv = F:values(p.T * p.K, 1)
  if F.rng:chance(0.05) and #wv > 0 then wv[1] = 0 / 0 end
  local o = { weights = F:fresh("f32", { p.T, p.K }, wv), rank = F.rng:chance(0.8) and rank or nil }
  rank = o.rank or 0
  if p.W == 1 and F.rng:chance(0.5) then o.schedule, o.y = schedules[1], ys[1]
  else o.schedules, o.ys = schedules, ys end
  if F.rng:chance(0.3) then
    o.shared = F:fresh("bf16", { p.T, H }, F:values(p.T * H))
    if F.rng:chance(0.5) then o.shared_gate = F:fresh("f32", { p.T }, F:values(p.T, 1)) end
  end
  local dtype = F.rng:pick { "bf16", "f32" }
  if F.rng:chance(0.3) then o.dtype = dtype end
  if F.rng:chance(0.3) then o.out = F:fresh(dtype, { p.T, H }, F:values(p.T * H)) end
  local bad
  local r = F.rng:int(1, 16)
  if r <= 4 then
    local _
    o, _, bad = mutate.options(F, o, COMBINE_SPEC, { "weights" })
  elseif r == 5 and p.W > 1 then
    o.schedules = { schedules[2], schedules[1] }
    for i = 3, p.W do o.schedules[i] = schedules[i] end
    bad = "schedules out of rank order"
  elseif r == 6 and o.schedules then
    o.schedules = {}
    for i = 1, p.W - 1 do o.schedules[i] = schedules[i] end
    bad = "one schedule too few"
  elseif r == 7 and o.ys then
    o.ys = { moe.zeros({ schedules[1].capacity + 1, H }, { dtype = "bf16" }) }
    for i = 2, p.W do o.ys[i] = ys[i] end
    bad = "ys of another capacity"
  elseif r == 8 then
    o.rank = p.W
    bad = "rank outside the world"
  elseif r == 9 then
    o.schedule, o.schedules = schedules[1], schedules
    bad = "both schedule and schedules"
  end
  local c = F:call { name = "moe.combine", args = { o }, n = 1, bad = bad }
  c.text = c.text .. poked
  local ok_args = readable(o, { "weights", "y", "out", "shared", "shared_gate" }, 1)
  c.check = function(res)
    local out = res[2]
    if not ok_args or not (plain(o.ys or {}) and plain(o.schedules or {})) then
      outputs_written(F, { out })
      return nil
    end
    local sch = o.schedules or { o.schedule }
    local yl = o.ys or { o.y }
    local s1 = sch[1]
    local Tn, K, W = s1.tokens, s1.k, s1.world
    local Hy = yl[1].shape[2]
    local dt = (o.out and o.out.dtype) or o.dtype or "bf16"
    local problem = T.holds(out, dt, { Tn, Hy }, nil, "combine's out")
    if problem then return problem end
    local yflat, yrows, rrows = {}, {}, {}
    for i = 1, W do
      yflat[i], yrows[i], rrows[i] = yl[i]:flat(), yl[i].shape[1], sch[i].route_row:flat()
    end
    local want = O.combine(Tn, K, Hy, W, s1.experts, o.rank or 0, o.weights:flat(), s1.ids:select((o.rank or 0) + 1):flat(),
      yflat, yrows, rrows, o.shared and o.shared:flat(), o.shared_gate and o.shared_gate:flat())
    if dt == "bf16" then for i = 1, #want do want[i] = O.bf16(want[i]) end end
    problem = O.near(out:flat(), want, dt == "bf16" and 1e-2 or 1e-5, 1e-6, "combine's out")
    if problem then return problem end
    outputs_written(F, { out })
  end
  return c
end

-- ---------------------------------------------------------------- which kernel

function G.explain(F)
  local stage = F.rng:pick { "schedule", "experts", "route", 1, nil }
  local o, bad
  if stage == "schedule" then
    local p = routing(F)
    o = schedule_options(F, p)
    if F.rng:chance(0.4) then
      local _
      o, _, bad = mutate.options(F, o, SCHEDULE_SPEC, { "ids", "experts" })
    end
  elseif stage == "experts" then
    o = experts_options(F)
    if F.rng:chance(0.4) then
      local _
      o, _, bad = mutate.options(F, o, EXPERTS_SPEC, { "x", "offsets", "w_gate_up", "w_down" })
    end
  else
    o, bad = {}, "no such stage"
  end
  local c = F:call { name = "moe.explain", args = { stage, o }, n = 2, bad = bad,
    names = { "explain", stage == "schedule" and "schedule_plan" or "experts" } }
  c.check = function(res)
    local ch = res[2]
    if type(ch) ~= "table" or type(ch.kernel) ~= "string" or type(ch.candidates) ~= "table" then
      return "explain gave no kernel and candidates"
    end
    if type(tostring(ch)) ~= "string" then return "explain's report does not print" end
  end
  return c
end

return G
