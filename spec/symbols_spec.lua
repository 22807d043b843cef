-- SPDX-License-Identifier: MIT
-- The library's surface is its header: the shared library exports exactly the MOE_API functions
-- of lib/moelab.h, and the Lua module its entry point alone.  An internal name that leaks would
-- be called in place of a host program's function of the same name, or clash in a static link.
local build = os.getenv("MOE_BUILD_DIR") or "build"

-- The dynamic symbols a shared object defines, as a map from name to its default symbol version
-- ("Base" for none).  objdump -T prints "address flags section size version name", the version
-- in parentheses where it is not the default (an older one kept for old callers, docs/abi.md);
-- a version node's own entry (section *ABS*, named like its version) is not a symbol.
local function exported(path)
  local p = assert(io.popen("objdump -T '" .. path .. "' 2>&1"))
  local out = p:read("a")
  local ok = p:close()
  assert.is_true(ok == true, "objdump -T " .. path .. " failed:\n" .. out)
  local map = {}
  for line in out:gmatch("[^\n]+") do
    local section, version, name = line:match("^%x+%s.-%s(%S+)%s+%x+%s+(%S+)%s+([%w_.]+)$")
    if section and section ~= "*UND*" and not (section == "*ABS*" and version == name) then
      if version:sub(1, 1) ~= "(" or not map[name] then map[name] = version end
    end
  end
  return map
end

-- The set of the keys of map.
local function names(map)
  local set = {}
  for name in pairs(map) do set[name] = true end
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
    local lib = names(exported(build .. "/libmoelab.so"))
    local extra, absent = missing(lib, header), missing(header, lib)
    assert.are.same({}, extra, "exported but not in moelab.h: " .. table.concat(extra, " "))
    assert.are.same({}, absent, "declared in moelab.h but not exported: " .. table.concat(absent, " "))
    for name in pairs(lib) do assert.truthy(name:match("^moe_"), name .. " is exported without the moe_ prefix") end
  end)

  it("the Lua module exports luaopen_moelab_core alone", function()
    assert.are.same({ luaopen_moelab_core = true }, names(exported(build .. "/moelab/core.so")))
  end)
end)

-- The ABI's markers (docs/abi.md): the soname names the major version, and every export carries
-- a symbol version node of lib/moelab.map, MOELAB_<major>.<minor> of the release that brought it.
describe("ABI of libmoelab.so [#cpu]", function()
  local header = assert(io.open("lib/moelab.h")):read("a")
  local major = tonumber(header:match("#define MOE_VERSION_MAJOR (%d+)"))
  local minor = tonumber(header:match("#define MOE_VERSION_MINOR (%d+)"))
  local lib = build .. "/libmoelab.so"

  -- The nodes of the version script, in order.
  local nodes = {}
  local map = assert(io.open("lib/moelab.map")):read("a")
  for node in map:gmatch("([%w_.]+)%s*{") do nodes[#nodes + 1] = node end

  local function objdump_p()
    local p = assert(io.popen("objdump -p '" .. lib .. "' 2>&1"))
    local out = p:read("a")
    p:close()
    return out
  end

  it("CMakeLists.txt, moelab.h and the rockspec give one version", function()
    local patch = header:match("#define MOE_VERSION_PATCH (%d+)")
    local version = major .. "." .. minor .. "." .. patch
    assert.are.equal(version, header:match('#define MOE_VERSION "([^"]*)"'), "MOE_VERSION")
    local cmake = assert(io.open("CMakeLists.txt")):read("a")
    assert.are.equal(version, cmake:match("project%(moelab VERSION (%S+)"), "CMakeLists.txt's project()")
    local p = assert(io.popen("ls moelab-*.rockspec"))
    local rockspecs = p:read("a")
    p:close()
    assert.are.equal("moelab-" .. version .. "-1.rockspec\n", rockspecs)
    local rockspec = assert(io.open("moelab-" .. version .. "-1.rockspec")):read("a")
    assert.truthy(rockspec:find('\nversion = "' .. version .. '%-1"\n'), "the rockspec's version field")
  end)

  it("the soname is libmoelab.so.<major> (libmoelab.so.0 for 0.x)", function()
    assert.are.equal(0, major)
    assert.are.equal("libmoelab.so." .. major, objdump_p():match("SONAME%s+(%S+)"))
  end)

  it("lib/moelab.map names its nodes MOELAB_<major>.<minor>, none past this version", function()
    assert.is_true(#nodes > 0, "lib/moelab.map has no named version node")
    for _, node in ipairs(nodes) do
      local a, b = node:match("^MOELAB_(%d+)%.(%d+)$")
      assert.truthy(a, node .. " is not named MOELAB_<major>.<minor>")
      assert.are.equal(major, tonumber(a), node .. ": another major version than moelab.h's")
      assert.is_true(tonumber(b) <= minor, node .. " is past moelab.h's version " .. major .. "." .. minor)
    end
    local defined = (objdump_p():match("Version definitions:\n(.-)\n\n") or "") .. "\n"
    for _, node in ipairs(nodes) do
      assert.truthy(defined:find(" " .. node .. "\n", 1, true), lib .. " does not define " .. node)
    end
  end)

  it("every exported function carries one of the map's nodes as its default version", function()
    local known, bad, n = {}, {}, 0
    for _, node in ipairs(nodes) do known[node] = true end
    for name, version in pairs(exported(lib)) do
      n = n + 1
      if not known[version] then bad[#bad + 1] = name .. " " .. version end
    end
    table.sort(bad)
    assert.is_true(n > 50, "only " .. n .. " exports")
    assert.are.same({}, bad)
  end)
end)
