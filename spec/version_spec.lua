-- SPDX-License-Identifier: MIT
-- The interpreter guard at the top of lua/moelab/init.lua: moelab runs on Lua 5.4 and LuaJIT 2.1;
-- anywhere else `require "moelab"` fails with one sentence naming them, and a scenario exits 2
-- (a configuration, not a failed check) with that sentence.  Other interpreters are faked under
-- Lua 5.4 (_VERSION and jit set before the file runs; under LuaJIT, whose jit is real, a fake
-- would prove nothing), and the real ones run where Debian's lua5.1, lua5.2 or lua5.3 is
-- installed.
local S = require "support"

local SENTENCE = "moelab runs on Lua 5.4 or LuaJIT 2.1, and this is "
local SCENARIOS = { "kimi", "scheduler", "experts", "report", "world_ranks", "world_fault", "compare" }

-- lua5.4 -e <pre> <script> <flags>: the script run after pre has set the interpreter's identity.
local function run_as(pre, script, flags)
  return S.run_lua(string.format("-e '%s' %s", pre, script), flags, nil, "lua5.4")
end

describe("the interpreter guard [#cpu]", function()
  local FAKES = {
    { "Lua 5.1", '_VERSION = "Lua 5.1"', "Lua 5.1" },
    { "Lua 5.3", '_VERSION = "Lua 5.3"', "Lua 5.3" },
    { "Lua 5.5", '_VERSION = "Lua 5.5"', "Lua 5.5" },
    { "LuaJIT 2.0", '_VERSION = "Lua 5.1" jit = { version = "LuaJIT 2.0.5" }', "LuaJIT 2.0.5" },
    { "a jit table that is not LuaJIT's", '_VERSION = "Lua 5.1" jit = { version = 2.1 }', "Lua 5.1" },
  }
  for _, row in ipairs(FAKES) do
    local name, pre, shown = row[1], row[2], row[3]
    it("refuses " .. name .. " in one sentence, naming it", function()
      local out, status = run_as(pre .. ' require "moelab"', "", "")
      assert.are_not.equal(0, status, out)
      assert.truthy(out:find(SENTENCE .. shown .. ": run it with lua5.4 (or luajit)", 1, true), out)
      assert.falsy(out:find("moelab.core", 1, true), out) -- stopped before the C module
    end)
  end

  it("lets Lua 5.4 through, and LuaJIT 2.1 where it is installed", function()
    local out, status = run_as('print(require("moelab").version)', "", "")
    assert.are.equal(0, status, out)
    assert.truthy(out:find(moe.version, 1, true), out)
    local p = io.popen("command -v luajit 2>/dev/null")
    local luajit = p:read("a")
    p:close()
    if luajit == "" then return end
    out, status = S.run_lua("-e 'print(require(\"moelab\").version)'", "", nil, "luajit")
    assert.are.equal(0, status, out)
    assert.truthy(out:find(moe.version, 1, true), out)
  end)

  for _, name in ipairs(SCENARIOS) do
    it("scenarios/" .. name .. ".lua exits 2 with the sentence under another Lua", function()
      local out, status = run_as('_VERSION = "Lua 5.2"', "scenarios/" .. name .. ".lua", "")
      assert.are.equal(2, status, out)
      assert.are.equal(SENTENCE .. "Lua 5.2: run it with lua5.4 (or luajit)\n", out)
    end)
  end
end)

-- The real interpreters, where installed: every scenario must parse in their syntax to reach the
-- guard at all (a syntax error would exit 1, the status of a failed check).
for _, lua in ipairs { "lua5.1", "lua5.2", "lua5.3" } do
  describe("under " .. lua .. " [#cpu]", function()
    local p = io.popen("command -v " .. lua .. " 2>/dev/null")
    local path = p:read("a")
    p:close()
    if path == "" then
      pending(lua .. " is not installed here (apt-get install " .. lua .. ")")
      return
    end
    local version = "Lua " .. lua:match("%d%.%d")

    it("require \"moelab\" fails with the sentence", function()
      local out, status = S.run_lua("-e 'require \"moelab\"'", "", nil, lua)
      assert.are_not.equal(0, status, out)
      assert.truthy(out:find(SENTENCE .. version, 1, true), out)
    end)

    for _, name in ipairs(SCENARIOS) do
      it("scenarios/" .. name .. ".lua exits 2 with the sentence", function()
        local out, status = S.run_lua("scenarios/" .. name .. ".lua", "", nil, lua)
        assert.are.equal(2, status, out)
        assert.are.equal(SENTENCE .. version .. ": run it with lua5.4 (or luajit)\n", out)
      end)
    end
  end)
end
