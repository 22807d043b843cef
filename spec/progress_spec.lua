-- SPDX-License-Identifier: MIT
-- moelab.progress, the line per step of the long sweeps: what a line says, when lines are written
-- (on, off, auto: where stderr is a terminal), and the scenarios' --progress flag.
local S = require "support"
local progress = require "moelab.progress"

-- A sink that keeps what is written, and a clock that reads the times given, one per call.
local function sink()
  local s = { text = "" }
  function s:write(...) for _, v in ipairs { ... } do self.text = self.text .. v end return self end
  function s:flush() return self end
  return s
end
local function clock(times)
  local i = 0
  return function()
    i = i + 1
    return times[i]
  end
end

describe("moelab.progress [#cpu]", function()
  it("writes a line per step: what, how long it took, the time so far and the time left at that pace", function()
    local out = sink()
    local p = progress.new(4, { mode = "on", out = out, now = clock { 100, 102, 106, 109.5, 169.5 } })
    assert.are.equal("[1/4] a (2.00 s; 2 s elapsed, ETA 6 s)", p:step("a"))
    assert.are.equal("[2/4] b (4.00 s; 6 s elapsed, ETA 6 s)", p:step("b"))
    assert.are.equal("[3/4] c (3.50 s; 10 s elapsed, ETA 3 s)", p:step("c"))
    assert.are.equal("[4/4] d (1:00; 1:10 elapsed, done)", p:step("d"))
    assert.are.equal(4, select(2, out.text:gsub("\n", "")))
  end)

  it("writes hours and minutes as a clock", function()
    assert.are.same({ "0 s", "59 s", "1:01", "59:59", "1:02:05" },
      { progress.clock(0.2), progress.clock(59), progress.clock(61), progress.clock(3599), progress.clock(3725) })
  end)

  it("stays silent when off, and in auto mode where stderr is not a terminal", function()
    local real = progress.stderr_is_terminal
    for _, case in ipairs { { "off", true, false }, { "auto", false, false }, { "auto", true, true } } do
      progress.stderr_is_terminal = function() return case[2] end
      local out = sink()
      local p = progress.new(2, { mode = case[1], out = out, now = clock { 0, 1, 2 } })
      local line = p:step("x")
      assert.are.equal(case[3], line ~= nil, case[1])
      assert.are.equal(case[3], out.text ~= "", case[1])
      assert.are.equal(1, p.done)
    end
    progress.stderr_is_terminal = real
  end)

  it("tells a terminal from a pipe", function()
    -- this suite's stderr is whatever busted was given; a pipe is never a terminal
    local out, status = S.run_lua("-e 'require(\"moelab\") print(require(\"moelab.progress\").stderr_is_terminal())'",
      "2>/dev/null | cat")
    assert.are.equal(0, status, out)
    assert.are.equal("false\n", out:gsub("^%s+", ""))
  end)

  for _, row in ipairs {
    { "an unknown mode", function() progress.new(1, { mode = "sometimes" }) end,
      "option 'mode' must be one of 'auto', 'on', 'off', got \"sometimes\"" },
    { "a negative total", function() progress.new(-1) end, "total must be a count of steps (an integer >= 0), got -1" },
    { "a fractional total", function() progress.new(2.5) end, "got 2.5" },
    { "a total that is not a number", function() progress.new("3") end, "got \"3\"" },
    { "an unknown option", function() progress.new(1, { every = 2 }) end, "unknown option 'every'" },
  } do
    it("refuses " .. row[1], function()
      local ok, err = pcall(row[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end
end)

describe("--progress of the sweeps [#cpu]", function()
  local FLAGS = "--models kimi_k2 --dists uniform,zipf --pads 1 --tokens 4"

  -- stderr alone (stdout dropped) of experts.lua with flags, into a pipe -> text, status
  local function stderr_of(flags)
    local cmd = string.format("(LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' %s "
      .. "scenarios/experts.lua %s %s >/dev/null) 2>&1; echo \"status=$?\"", os.getenv("MOE_BUILD_DIR") or "build",
      S.lua, FLAGS, flags)
    local f = assert(io.popen(cmd))
    local out = f:read("a")
    f:close()
    return out:gsub("status=%d+\n$", ""), tonumber(out:match("status=(%d+)\n$"))
  end

  it("on: a line per configuration on stderr, the last one done", function()
    local err, status = stderr_of("--progress on")
    assert.are.equal(0, status, err)
    assert.truthy(err:find("^%[1/2%] Kimi K2 uniform pad 1: [%d.]+ ms %([%d.]+ s; %d+ s elapsed, ETA %d+ s%)\n"), err)
    assert.truthy(err:find("\n%[2/2%] Kimi K2 zipf pad 1: [%d.]+ ms %([%d.]+ s; %d+ s elapsed, done%)\n$"), err)
  end)

  it("auto into a pipe, and off: nothing on stderr", function()
    for _, flag in ipairs { "", "--progress auto", "--progress off" } do
      local err, status = stderr_of(flag)
      assert.are.equal(0, status, err)
      assert.are.equal("", err, flag)
    end
  end)

  it("auto on a terminal: the lines", function()
    local p = io.popen("command -v script 2>/dev/null")
    local found = p:read("a")
    p:close()
    if found == "" then return pending("no script(1) here to give the scenario a terminal") end
    -- script(1) runs the scenario on a pseudo-terminal: stderr is a terminal there
    local inner = string.format("LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' %s "
      .. "scenarios/experts.lua %s >/dev/null", os.getenv("MOE_BUILD_DIR") or "build", S.lua, FLAGS)
    local f = assert(io.popen("script -qec \"" .. inner .. "\" /dev/null 2>&1"))
    local out = f:read("a")
    f:close()
    assert.truthy(out:find("[2/2] Kimi K2 zipf pad 1", 1, true), out)
  end)

  it("a mode it does not know exits 2, naming the flag", function()
    for _, script in ipairs { "scenarios/experts.lua " .. FLAGS, "scenarios/scheduler.lua" } do
      local out, status = S.run_lua(script, "--progress always")
      assert.are.equal(2, status, out)
      assert.truthy(out:find("--progress: bad argument #1 to 'progress' (option 'mode' must be one of 'auto', 'on', "
        .. "'off', got \"always\")", 1, true), out)
    end
  end)
end)
