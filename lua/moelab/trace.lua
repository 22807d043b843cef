-- SPDX-License-Identifier: MIT
-- A layer's stage spans (layer:trace()) as a Chrome trace (the JSON trace event format that
-- ui.perfetto.dev and chrome://tracing open): a process per rank (pid = rank), a thread per stage
-- (tid = its lane, in the order the stages ran), and one complete event ("ph": "X", ts and dur
-- in microseconds) per stage and rank.  Written for Lua 5.4 and LuaJIT alike.
local json = require "moelab.json"

local trace = {}

-- The events of spans: metadata naming each process ("rank r on cpu") and each stage's lane, then
-- the spans; o.metadata goes under "otherData" (the run's, moelab.runinfo).
---@param spans moe.Span[]
---@param o? { metadata?: table }
---@return string
function trace.chrome(spans, o)
  o = o or {}
  local events, lanes, order, ranks = {}, {}, {}, {}
  for _, s in ipairs(spans) do
    if not lanes[s.stage] then
      order[#order + 1] = s.stage
      lanes[s.stage] = #order
    end
    if not ranks[s.rank] then ranks[s.rank] = s.device end
  end
  local rank_list = {}
  for r in pairs(ranks) do rank_list[#rank_list + 1] = r end
  table.sort(rank_list)
  for _, r in ipairs(rank_list) do
    events[#events + 1] = { name = "process_name", ph = "M", pid = r, tid = 0,
      args = { name = string.format("rank %d on %s", r, ranks[r]) } }
    events[#events + 1] = { name = "process_sort_index", ph = "M", pid = r, tid = 0, args = { sort_index = r } }
    for lane, stage in ipairs(order) do
      events[#events + 1] = { name = "thread_name", ph = "M", pid = r, tid = lane, args = { name = stage } }
      events[#events + 1] = { name = "thread_sort_index", ph = "M", pid = r, tid = lane, args = { sort_index = lane } }
    end
  end
  for _, s in ipairs(spans) do
    events[#events + 1] = { name = s.stage, cat = "stage", ph = "X", pid = s.rank, tid = lanes[s.stage],
      ts = s.start_ms * 1e3, dur = s.dur_ms * 1e3,
      args = { device = s.device, ms = s.dur_ms, all_ranks = s.all_ranks or nil } }
  end
  return json.encode { traceEvents = events, displayTimeUnit = "ms", otherData = o.metadata }
end

return trace
