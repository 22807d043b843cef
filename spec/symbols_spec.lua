-- SPDX-License-Identifier: MIT
-- The library's surface is its header: the shared library exports exactly the MOE_API functions
-- of lib/moelab.h, and the Lua module its entry point alone.  An internal name that leaks would
-- be called in place of a host program's function of the same name, or clash in a static link.
local build = os.getenv("MOE_BUILD_DIR") or "build"

-- The dynamic symbols a shared object defines, as a set (nm prints "address type name").
local function exported(path)
  local p = assert(io.popen("nm -D --defined-only '" .. path .. "' 2>&1"))
  local out = p:read("a")
  local ok = p:close()
  assert.is_true(ok == true, "nm -D " .. path .. " failed:\n" .. out)
  local set = {}
  for name in out:gmatch("%S+ %a ([%w_@.]+)") do set[name] = true end
  return set
end

-- The functions moelab.h declares with the export marker: "MOE_API <type> name(".
local function declared()
  local set = {}
  local text = assert(io.open("lib/moelab.h")):read("a")
  for decl in text:gmatch("\nMOE_API ([^(;]+)%(") do set[decl:match("([%w_]+)%s*$")] = true end
  return set
end

-- Names in a that are not in b, sorted, for a readable message.
local function missing(a, b)
  local list = {}
  for name in pairs(a) do if not b[name] then list[#list + 1] = name end end
  table.sort(list)
  return list
end

describe("exported symbols [#cpu]", function()
  local header = declared()

  it("the header declares the API (moe_ctx_open, moe_schedule, ...)", function()
    assert.is_true(header.moe_ctx_open and header.moe_schedule and header.moe_errmsg or false)
  end)

  it("libmoelab.so exports exactly the MOE_API functions of moelab.h", function()
    local lib = exported(build .. "/libmoelab.so")
    local extra, absent = missing(lib, header), missing(header, lib)
    assert.are.same({}, extra, "exported but not in moelab.h: " .. table.concat(extra, " "))
    assert.are.same({}, absent, "declared in moelab.h but not exported: " .. table.concat(absent, " "))
    for name in pairs(lib) do assert.truthy(name:match("^moe_"), name .. " is exported without the moe_ prefix") end
  end)

  it("the Lua module exports luaopen_moelab_core alone", function()
    assert.are.same({ luaopen_moelab_core = true }, exported(build .. "/moelab/core.so"))
  end)
end)
