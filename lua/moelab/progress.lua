-- SPDX-License-Identifier: MIT
-- Progress of a long sweep on stderr (experts.lua's configurations, scheduler.lua's shapes): a
-- line per step with what was done, the time it took, the time so far and the time left at the
-- pace so far.  Where stderr is not a terminal (a log, a pipe, a test) it stays silent unless
-- asked: the report on stdout is the same either way.  Written for Lua 5.4 and LuaJIT alike.
local core = require "moelab.core"
local args = require "moelab.args"

local progress = {}

progress.MODES = { "auto", "on", "off" }

-- Whether the process's stderr is a terminal: `test -t 2` in a shell that inherits it (Lua
-- itself cannot ask).  os.execute says so as true (5.4) or 0 (5.1, LuaJIT).
function progress.stderr_is_terminal()
  local r = os.execute("test -t 2")
  return r == true or r == 0
end

-- "42 s", "3:07", "1:02:05"
local function clock(seconds)
  local s = math.floor(seconds + 0.5)
  if s < 60 then return string.format("%d s", s) end
  if s < 3600 then return string.format("%d:%02d", math.floor(s / 60), s % 60) end
  return string.format("%d:%02d:%02d", math.floor(s / 3600), math.floor(s / 60) % 60, s % 60)
end
progress.clock = clock

---@class moe.Progress
---@field total integer steps in all
---@field done integer steps done
---@field enabled boolean whether lines are written
local Progress = {}
Progress.__index = Progress

-- A sweep of total steps.  o.mode: "auto" (lines where stderr is a terminal, the default), "on",
-- "off"; o.out, where lines go (io.stderr); o.now, the clock in seconds (core.now).
---@param total integer
---@param o? { mode?: "auto"|"on"|"off", out?: file*, now?: fun(): number }
---@return moe.Progress
function progress.new(total, o)
  o = args.options("progress", o or {}, { mode = progress.MODES, out = "any", now = "function" })
  if type(total) ~= "number" or total ~= math.floor(total) or total < 0 then
    args.fail("progress", "total must be a count of steps (an integer >= 0), got " .. args.describe(total))
  end
  local mode = o.mode or "auto"
  local enabled = mode == "on" or (mode == "auto" and progress.stderr_is_terminal())
  local now = o.now or core.now
  return setmetatable({ total = total, done = 0, enabled = enabled, out = o.out or io.stderr, now = now,
    start = now(), last = nil }, Progress)
end

-- One step done, named by label -> the line written (nil when silent).
---@param label string
---@return string?
function Progress:step(label)
  local t = self.now()
  self.done = self.done + 1
  local took = t - (self.last or self.start)
  self.last = t
  if not self.enabled then return nil end
  local elapsed = t - self.start
  local left = self.total - self.done
  local line = string.format("[%d/%d] %s (%s; %s elapsed, %s)", self.done, self.total, label,
    took < 10 and string.format("%.2f s", took) or clock(took), clock(elapsed),
    left > 0 and ("ETA " .. clock(elapsed / self.done * left)) or "done")
  self.out:write(line, "\n")
  self.out:flush()
  return line
end

return progress
