-- SPDX-License-Identifier: MIT
-- The one front-end on both interpreters: LuaJIT 2.1 through moelab.ffi_core and Lua 5.4 through
-- the C module give the same values and the same errors, and the scenarios run under LuaJIT.
-- Each case starts both interpreters itself, so it means the same under either run of the suite.
local compat = require "moelab.compat"

local build = os.getenv("MOE_BUILD_DIR") or "build"

local function installed(cmd) return select(2, compat.run("command -v " .. cmd .. " >/dev/null")) == 0 end

-- interpreter + arguments, with the front-end of ./lua and the build's C module -> output, status
local function run(interpreter, rest, env)
  return compat.run(string.format("%s LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' %s %s 2>&1",
    env or "", build, interpreter, rest))
end

describe("the front-end under LuaJIT and Lua 5.4 [#cpu]", function()
  if not (installed("luajit") and installed("lua5.4")) then
    pending("luajit or lua5.4 not installed (apt-get install luajit lua5.4): the comparison is skipped")
    return
  end
  if (os.getenv("LD_PRELOAD") or ""):find("asan", 1, true) then
    -- LeakSanitizer does not scan LuaJIT's own heap, so it would call every object a cdata holds leaked
    pending("the sanitizer run: LuaJIT under AddressSanitizer is not checked (the plain suite compares the bindings)")
    return
  end

  it("require picks the FFI binding under LuaJIT and the C module under Lua 5.4", function()
    local code = [[-e 'local moe = require "moelab"; print(moe.core == package.loaded["moelab.ffi_core"], moe.version)']]
    local jit_out, jit_status = run("luajit", code)
    local lua_out, lua_status = run("lua5.4", code)
    assert.are.equal(0, jit_status, jit_out)
    assert.are.equal(0, lua_status, lua_out)
    assert.are.equal("true\t0.1.0\n", jit_out)
    assert.are.equal("false\t0.1.0\n", lua_out)
  end)

  it("both bindings print the same values and the same misuse messages (spec/bindings_probe.lua)", function()
    local jit_out, jit_status = run("luajit", "spec/bindings_probe.lua")
    local lua_out, lua_status = run("lua5.4", "spec/bindings_probe.lua")
    assert.are.equal(0, lua_status, lua_out)
    assert.are.equal(0, jit_status, jit_out)
    local a, b = {}, {}
    for line in lua_out:gmatch("[^\n]+") do a[#a + 1] = line end
    for line in jit_out:gmatch("[^\n]+") do b[#b + 1] = line end
    assert.is_true(#a > 40, "the probe printed too little:\n" .. lua_out)
    for i = 1, math.max(#a, #b) do
      assert.are.equal(a[i], b[i], string.format("line %d differs (Lua 5.4 first, LuaJIT second)", i))
    end
  end)

  it("luajit scenarios/kimi.lua passes its check on the CPU", function()
    local out, status = run("luajit", "scenarios/kimi.lua --device cpu")
    assert.are.equal(0, status, out)
    assert.truthy(out:find("check [^\n]* 0 NaN: PASS"), out)
  end)

  it("a context that MOE_THREADS refuses says why, in the same words under either", function()
    local said = {}
    for i, interpreter in ipairs { "lua5.4", "luajit" } do
      local out, status = run(interpreter, [[-e 'require "moelab"']], "MOE_THREADS=abc")
      assert.are_not.equal(0, status, out)
      said[i] = out:match("moelab%.core: cannot open a context: [^\n]*")
      assert.truthy(said[i], out)
    end
    assert.truthy(said[1]:find("MOE_THREADS must be an integer from 1 to 256", 1, true), said[1])
    assert.are.equal(said[1], said[2])
  end)

  it("the FFI binding names what it cannot find and how to point at it", function()
    local code = [[-e 'require "moelab"']]
    local out, status = run("luajit", code, "MOELAB_LIB=/nonexistent/libmoelab.so")
    assert.are_not.equal(0, status)
    assert.truthy(out:find("cannot load libmoelab (/nonexistent/libmoelab.so)", 1, true), out)
    assert.truthy(out:find("set MOELAB_LIB to its path", 1, true), out)
    out, status = run("luajit", code, "MOELAB_HEADER=lua/moelab/compat.lua")
    assert.are_not.equal(0, status)
    assert.truthy(out:find("lua/moelab/compat.lua has no MOE_CDEF_BEGIN ... MOE_CDEF_END block", 1, true), out)
  end)
end)
