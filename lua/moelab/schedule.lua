-- SPDX-License-Identifier: MIT
-- Stage 2, schedule: every route of the all-gathered ids placed in a row of its expert's rank.
local core = require "moelab.core"
local args = require "moelab.args"
local compat = require "moelab.compat"
local explain = require "moelab.explain"
local memory = require "moelab.memory"

local schedule = {}

local Schedule = { __name = "moelab.Schedule" }
Schedule.__index = Schedule
schedule.Schedule = Schedule

local LAYOUTS = { "roundrobin", "peer_major" }
local STAT_NAMES = { "rows_needed", "rows_used", "dropped", "invalid", "first_invalid" }

-- The rows of a rank's schedule when no number is given, by policy name -> rows, and the error
-- when those rows cannot be an i32 capacity (what: "the default capacity" or the policy named).
local CAPACITY_POLICIES = {
  -- every route of the world on this rank (at most expert_capacity per expert), padded: the
  -- largest need there can be, so the schedule never overflows.  moe.schedule's default.
  worst = function(W, T, K, EL, pad, expert_capacity)
    local rows = W * T * K + EL * (pad - 1)
    if expert_capacity then rows = math.min(rows, EL * math.floor((expert_capacity + pad - 1) / pad) * pad) end
    return rows, function(what) return what .. " exceeds 2^31 - 2 rows; pass capacity" end
  end,
  -- twice a rank's mean routes plus one pad per expert: memory that grows with T K rather than
  -- W T K; skewed routing needs more (an overflow raises unless overflow = "drop").  moe.layer's
  -- default.
  twice_mean = function(_, T, K, EL, pad)
    local rows = 2 * T * K + EL * pad
    return rows, function(what)
      return string.format("%s (2 tokens k + experts per rank x pad = %d rows) exceeds 2^31 - 2; pass capacity", what,
        rows)
    end
  end,
}
schedule.CAPACITY_POLICIES = { "worst", "twice_mean" }

-- The one home of pad's and capacity's defaults, for a schedule of W ranks of T tokens, top-K,
-- EL experts per rank: o.pad (default 1) and o.capacity, rows or a policy's name (default:
-- default_policy) -> pad, capacity.  Errors name fname's options.
function schedule.rows(fname, o, W, T, K, EL, default_policy)
  local pad = o.pad or 1
  args.range(fname, "pad", pad, 1, 0x7fffffff) -- rows are i32: so no sum below can wrap
  local capacity, policy = o.capacity, o.capacity == nil and default_policy or nil
  if type(capacity) == "string" then
    policy = CAPACITY_POLICIES[capacity] and capacity or args.fail(fname, string.format("option 'capacity' must be a "
      .. "number of rows or one of 'worst', 'twice_mean', got %s", args.describe(capacity)))
  elseif capacity ~= nil and not compat.tointeger(capacity) then
    args.fail(fname, string.format("option 'capacity' must be an integer or one of 'worst', 'twice_mean', got %s",
      args.describe(capacity)))
  end
  -- at most 2^31 - 2: rows_needed saturates at 2^31 - 1, so a capacity of 2^31 - 1 could not tell
  -- a need of exactly that from an overflow
  if not policy then args.range(fname, "capacity", capacity, 0, 0x7ffffffe) end
  args.range(fname, "expert_capacity", o.expert_capacity, 0, 0x7fffffff)
  if not policy then return pad, compat.tointeger(capacity) end
  local rows, too_large = CAPACITY_POLICIES[policy](W, T, K, EL, pad, o.expert_capacity)
  if rows > 0x7ffffffe then
    args.fail(fname, too_large(o.capacity == nil and "the default capacity" or string.format("capacity '%s'", policy)))
  end
  return pad, rows
end

-- What a schedule of W ranks of T tokens, top-K, EL experts a rank and capacity C allocates
-- (moelab.memory's buffers).
function schedule.buffers(W, T, K, EL, C)
  local rows = "capacity (" .. C .. " rows)"
  return {
    memory.buffer("peer_rank", "i32", { C }, rows),
    memory.buffer("peer_route", "i32", { C }, rows),
    memory.buffer("counts", "i32", { EL }, "experts per rank"),
    memory.buffer("tokens_per_expert", "i32", { EL }, "experts per rank"),
    memory.buffer("expert_offsets", "i32", { EL + 1 }, "experts per rank + 1"),
    memory.buffer("route_row", "i32", { W, T * K }, "world x tokens x k"),
    memory.buffer("stats_tensor", "i32", { 5 }, "the schedule's stats"),
  }
end

-- The overflow policy covers every route a capacity drops, expert_capacity's too: one that drops
-- all of them cannot be what overflow = "error" asks for.
local function check_expert_capacity(fname, o)
  if o.expert_capacity == 0 and (o.overflow or "error") == "error" then
    args.fail(fname, "option 'expert_capacity' is 0, which drops every route, and option 'overflow' is 'error', "
      .. "which forbids dropping one: pass overflow = 'drop' to drop them, or expert_capacity >= 1")
  end
end
schedule.check_expert_capacity = check_expert_capacity

-- Allocates a schedule's buffers without running it (the layer reruns it in place); fname: the
-- function a caller inside the front-end raises as; sized: the caller has sized the buffers
-- against the device's memory already (a layer, within its memory_limit).
function schedule.plan(o, fname, sized)
  fname = fname or "schedule_plan"
  args.options(fname, o, {
    ids = "tensor", experts = "integer", rank = "integer", pad = "integer", capacity = "any",
    expert_capacity = "integer", layout = LAYOUTS, overflow = { "error", "drop" }, invalid = { "error", "skip" },
  }, { "ids", "experts" })
  local ids = args.tensor(fname, "ids", o.ids, "i32", { false, false, false })
  local W, T, K = ids.shape[1], ids.shape[2], ids.shape[3]
  local E = o.experts
  args.range(fname, "experts", E, 1, 0x7fffffff) -- ids are i32
  if W < 1 then args.fail(fname, "option 'ids' has no ranks (its first dimension is 0)") end
  if E % W ~= 0 then
    args.fail(fname, string.format("option 'experts' (%d) must be a multiple of the world size %d (ids is %s)",
      E, W, args.shape_str(ids.shape)))
  end
  local rank = o.rank or 0
  args.range(fname, "rank", rank, 0, W - 1)
  local EL = math.floor(E / W)
  local pad, C = schedule.rows(fname, o, W, T, K, EL, "worst")
  check_expert_capacity(fname, o)
  local dev = ids.device
  local s = setmetatable({
    ids = ids, world = W, tokens = T, k = K, experts = E, local_experts = EL, rank = rank, pad = pad,
    capacity = C, expert_capacity = o.expert_capacity, layout = o.layout or "roundrobin",
    overflow = o.overflow or "error", invalid = o.invalid or "error", device = dev,
  }, Schedule)
  local list = schedule.buffers(W, T, K, EL, C)
  return sized and memory.alloc(list, dev, s) or memory.new(fname, list, dev, s)
end

-- The C stage's arguments for this plan.
local function stage_args(self)
  return { peer_rank = self.peer_rank, peer_route = self.peer_route, counts = self.counts,
    tokens_per_expert = self.tokens_per_expert, expert_offsets = self.expert_offsets, route_row = self.route_row,
    stats = self.stats_tensor, ids = self.ids, experts = self.experts, rank = self.rank, pad = self.pad,
    capacity = self.capacity, expert_capacity = self.expert_capacity, layout = self.layout }
end

-- Runs the scheduler into the plan's buffers; reads nothing back (capturable).
function Schedule:run()
  core.schedule(stage_args(self))
  self.stats = nil
  return self
end

-- Which kernel run() issues for this plan and why (explain.parse's table); runs nothing.
function Schedule:explain()
  return explain.parse(core.schedule_explain(stage_args(self)))
end

-- Reads the stats back: {rows_needed, rows_used, dropped, invalid, first_invalid}.
function Schedule:read_stats()
  local t = self.stats_tensor
  if not args.is_tensor(t) or not t.closed and (t.dtype ~= "i32" or #t.shape ~= 1 or t.shape[1] ~= #STAT_NAMES) then
    args.raise(string.format("schedule: its stats tensor (stats_tensor) must be an i32 [%d] tensor, got %s: the "
      .. "field was replaced", #STAT_NAMES, args.describe(t)))
  end
  if self.stats_tensor.closed then
    args.raise("schedule: its stats tensor (stats_tensor) is closed: nothing to read")
  end
  local st, out = self.stats_tensor:flat(), {}
  for i, name in ipairs(STAT_NAMES) do out[name] = st[i] end
  self.stats = out
  return out
end

-- Raises on the conditions the schedule's policies do not allow.  It reads
-- the stats the last run left on the device every time: a graph's replay runs the schedule
-- without this table knowing.
function Schedule:check()
  local st = self:read_stats()
  -- stats a run cannot have left (the caller wrote over the tensor): nothing in them to trust
  local n = self.world * self.tokens * self.k
  local function foreign(what)
    args.raise(string.format("schedule: its stats (stats_tensor) are not a run's: %s; run the schedule again", what))
  end
  for _, name in ipairs(STAT_NAMES) do
    if st[name] < 0 and not (name == "first_invalid" and st[name] == -1) then
      foreign(string.format("%s = %d is negative", name, st[name]))
    end
  end
  if st.invalid > n then foreign(string.format("invalid = %d is more than the %d ids", st.invalid, n)) end
  if st.invalid > 0 and (st.first_invalid < 0 or st.first_invalid >= n) then
    foreign(string.format("first_invalid = %d is not an index of the %d ids", st.first_invalid, n))
  end
  if st.dropped > 0 and st.rows_needed <= self.capacity and not self.expert_capacity then
    foreign(string.format("dropped = %d within capacity, and there is no expert_capacity to drop them", st.dropped))
  end
  if st.invalid > 0 and self.invalid == "error" then
    local f = st.first_invalid
    local per_rank = self.tokens * self.k
    local w, rest = math.floor(f / per_rank), f % per_rank
    -- the id itself, unless the caller closed the ids since the run
    local id = self.ids.closed and "" or string.format(" %d", self.ids:get(f + 1))
    args.raise(string.format("schedule: invalid expert id%s at rank %d, token %d, slot %d (expected -1 or 0..%d); "
      .. "%d invalid id%s in all; pass invalid = 'skip' to drop them", id, w, math.floor(rest / self.k),
      rest % self.k, self.experts - 1, st.invalid, st.invalid == 1 and "" or "s"))
  end
  if st.rows_needed > self.capacity and self.overflow == "error" then
    args.raise(string.format("schedule: capacity overflow on rank %d: the routes need %d rows, capacity is %d "
      .. "(%d routes lost their row%s); raise capacity or pass overflow = 'drop'", self.rank, st.rows_needed,
      self.capacity, st.dropped, self.expert_capacity and ", those past expert_capacity included" or ""))
  end
  if st.dropped > 0 and self.overflow == "error" then -- within capacity: expert_capacity dropped them
    args.raise(string.format("schedule: expert capacity overflow on rank %d: %d route%s past expert_capacity = %d "
      .. "lost their row; raise expert_capacity or pass overflow = 'drop'", self.rank, st.dropped,
      st.dropped == 1 and "" or "s", self.expert_capacity))
  end
  return self
end

function Schedule:__tostring()
  local st = self.stats
  return string.format("moelab.Schedule(rank %d of %d, %d local experts, pad %d, %s, capacity %d%s)",
    self.rank, self.world, self.local_experts, self.pad, self.layout, self.capacity,
    st and string.format(", rows %d used, %d dropped, %d invalid", st.rows_used, st.dropped, st.invalid) or "")
end

function schedule.schedule(o)
  local s = schedule.plan(o, "schedule")
  s:run()
  s:check()
  return s
end

args.methods(Schedule, "s")

local SCHEDULE_TENSORS = { "ids", "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets",
  "route_row", "stats_tensor" }
schedule.TENSORS = SCHEDULE_TENSORS
function schedule.check_schedule(fname, name, s)
  if getmetatable(s) ~= Schedule then
    args.fail(fname, string.format("option '%s' must be a moelab.Schedule (from moe.schedule), got %s",
      name, args.describe(s)))
  end
  for _, f in ipairs(SCHEDULE_TENSORS) do -- the stages read them: a closed one would be named as the schedule
    if not args.is_tensor(s[f]) then
      args.fail(fname, string.format("option '%s' must be a moelab.Schedule from moe.schedule or moe.schedule_plan, "
        .. "got a table with its metatable whose %s is %s", name, f, args.describe(s[f])))
    end
    if s[f].closed then
      args.fail(fname, string.format("option '%s': the schedule's %s tensor is closed", name, f))
    end
  end
  return s
end

return schedule
