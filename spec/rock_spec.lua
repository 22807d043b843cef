-- SPDX-License-Identifier: MIT
-- The rockspec: `luarocks make` of moelab-0.1.0-1.rockspec, from a copy of this tree into a
-- temporary rock tree, then lua5.4 with that tree's paths alone requires moelab and runs a stage.
-- The copy's rockspec gains MOE_WITH_CUDA=OFF, so that the rock builds in seconds where nvcc is
-- found too; everything else is the rockspec as it stands.
local support = require "support"

local q, sh = support.shell_quote, support.shell
local ROCKSPEC = "moelab-0.1.0-1.rockspec"

describe("the LuaRocks rock [#cpu]", function()
  if not sh("git ls-files --error-unmatch " .. ROCKSPEC .. " >/dev/null") then
    pending("not a git checkout with " .. ROCKSPEC .. ": the tree to build cannot be listed")
    return
  end
  local tmp, tree, made, log

  lazy_setup(function()
    local ok, out = sh("mktemp -d")
    assert(ok, out)
    tmp = out:gsub("%s+$", "")
    tree = tmp .. "/tree"
    local src = tmp .. "/src"
    ok, out = sh("mkdir " .. q(src) .. " && git ls-files -z | tar --null -T - -cf - | tar -xf - -C " .. q(src))
    assert(ok, "copying the tracked files failed:\n" .. out)
    local fh = assert(io.open(src .. "/" .. ROCKSPEC, "rb"))
    local text, n = fh:read("a"):gsub("\n  variables = {\n", "\n  variables = {\n    MOE_WITH_CUDA = \"OFF\",\n", 1)
    fh:close()
    assert(n == 1, ROCKSPEC .. " has no build.variables table")
    fh = assert(io.open(src .. "/" .. ROCKSPEC, "wb"))
    fh:write(text)
    fh:close()
    made, log = sh("cd " .. q(src) .. " && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) luarocks --lua-version=5.4 make"
      .. " --tree=" .. q(tree) .. " " .. ROCKSPEC)
  end)

  lazy_teardown(function()
    if tmp then sh("rm -rf " .. q(tmp)) end
  end)

  it("luarocks make installs the module and the front-end, and not the C library's files", function()
    assert(made, "luarocks make failed:\n" .. log)
    for _, path in ipairs({ "lib/lua/5.4/moelab/core.so", "share/lua/5.4/moelab/init.lua",
      "share/lua/5.4/moelab/layer.lua" }) do
      assert.is_true(sh("test -f " .. q(tree .. "/" .. path)), path .. " is not in the rock tree")
    end
    local _, found = sh("find " .. q(tree) .. " -name 'libmoelab*' -o -name moelab.h -o -name moelab.pc")
    assert.are.equal("", found)
  end)

  it("lua5.4 with the rock tree's paths alone requires moelab from it and routes a token", function()
    assert(made, "luarocks make failed:\n" .. log)
    local script = [[
      local moe = require "moelab"
      local logits = moe.tensor({ { 0.1, 2.0, -1.0, 0.5 } }, { dtype = "f32" })
      local ids = moe.route { logits = logits, k = 2, scoring = "softmax" }
      print(moe.version, table.concat(ids:flat(), ","))
      print(package.searchpath("moelab", package.path))
      print(package.searchpath("moelab.core", package.cpath))
    ]]
    local lua = tree .. "/share/lua/5.4/"
    local ok, out = sh("cd " .. q(tmp) .. " && LUA_PATH=" .. q(lua .. "?.lua;" .. lua .. "?/init.lua")
      .. " LUA_CPATH=" .. q(tree .. "/lib/lua/5.4/?.so") .. " lua5.4 -e " .. q(script))
    assert(ok, out)
    assert.are.equal(moe.version .. "\t1,3\n" .. lua .. "moelab/init.lua\n" .. tree .. "/lib/lua/5.4/moelab/core.so\n",
      out)
  end)
end)
