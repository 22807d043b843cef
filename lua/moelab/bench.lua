-- SPDX-License-Identifier: MIT
-- moe.bench(fn, {warmup=, iters=, device=}): runs fn warmup times, then times iters runs one by
-- one and returns {median_ms, min_ms, max_ms, mean_ms, iters, times_ms}.  Each run is timed
-- with a pair of events: device events on a GPU (the device's time, not the launch's), a
-- monotonic wall clock on the CPU.  device defaults to the default device (cuda:0 where there is a
-- GPU): the CPU's clock around asynchronous launches would time the launches, not the work.
local core = require "moelab.core"
local args = require "moelab.args"

local function bench(fn, opts)
  if type(fn) ~= "function" then args.fail("bench", "expected a function to time, got " .. args.describe(fn)) end
  opts = args.options("bench", opts or {}, { warmup = "integer", iters = "integer", device = "device" })
  local warmup, iters = opts.warmup or 3, opts.iters or 10
  args.range("bench", "warmup", warmup, 0)
  args.range("bench", "iters", iters, 1)
  local device = opts.device or (core.device_count("cuda") > 0 and "cuda:0" or "cpu")
  -- the events first: a device that cannot time refuses before fn has run once
  local ok, start = pcall(core.event_new, device)
  if not ok then
    args.fail("bench", string.format("option 'device' (%s) cannot be timed: %s", device,
      (tostring(start):gsub("^[^\n]-:%d+: ", ""))))
  end
  local stop = core.event_new(device)
  for _ = 1, warmup do fn() end
  local times = {}
  for i = 1, iters do
    start:record()
    fn()
    stop:record()
    times[i] = stop:elapsed_since(start)
  end
  local sorted = {} -- copied one by one: table.unpack's results are capped near 10^6
  for i = 1, #times do sorted[i] = times[i] end
  table.sort(sorted)
  local sum = 0
  for _, t in ipairs(times) do sum = sum + t end
  local mid = math.floor(#sorted / 2)
  local median = #sorted % 2 == 1 and sorted[mid + 1] or (sorted[mid] + sorted[mid + 1]) / 2
  return { median_ms = median, min_ms = sorted[1], max_ms = sorted[#sorted], mean_ms = sum / iters,
    iters = iters, times_ms = times }
end

return bench
