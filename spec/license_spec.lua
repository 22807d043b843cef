-- SPDX-License-Identifier: MIT
-- The license travels with every file: LICENSE at the root, and an SPDX line at the top of each
-- tracked source file (the first line, or the second after a shebang), in the comment syntax of
-- its language, so that a file copied out of the tree still says under what terms.

-- The SPDX line a tracked file must carry, by the file's name; nil for files that carry none
-- (documents, data, configuration).
local C_LINE = "/* SPDX-License-Identifier: MIT */"
local LUA_LINE = "-- SPDX-License-Identifier: MIT"
local HASH_LINE = "# SPDX-License-Identifier: MIT"
local RULES = {
  { "%.c$", C_LINE }, { "%.h$", C_LINE }, { "%.cu$", C_LINE }, { "%.cuh$", C_LINE },
  { "%.map$", C_LINE }, -- linker version scripts
  { "%.lua$", LUA_LINE }, { "%.rockspec$", LUA_LINE }, { "^%.busted$", LUA_LINE },
  { "%.sh$", HASH_LINE }, { "%.py$", HASH_LINE }, { "%.cmake$", HASH_LINE }, { "%.cmake%.in$", HASH_LINE },
  { "%.pc%.in$", HASH_LINE }, { "^CMakeLists%.txt$", HASH_LINE }, { "^%.ci/run$", HASH_LINE },
}

local function expected_line(path)
  local name = path:match("[^/]+$")
  for _, rule in ipairs(RULES) do
    if name:find(rule[1]) or path:find(rule[1]) then return rule[2] end
  end
  return nil
end

-- The line of the file where the SPDX line belongs, and its number.
local function spdx_slot(path)
  local fh = io.open(path, "rb")
  if not fh then return nil end
  local first, second = fh:read("l"), fh:read("l")
  fh:close()
  if first and first:sub(1, 2) == "#!" then return second, 2 end
  return first, 1
end

local function tracked()
  local p = assert(io.popen("git ls-files 2>/dev/null"))
  local files = {}
  for name in p:lines() do files[#files + 1] = name end
  p:close()
  return files
end

describe("license [#cpu]", function()
  it("LICENSE is the MIT license of the moelab authors", function()
    local fh = assert(io.open("LICENSE", "rb"), "LICENSE is missing")
    local text = fh:read("a")
    fh:close()
    assert.truthy(text:find("^MIT License\n"), "LICENSE does not start with 'MIT License'")
    assert.truthy(text:find("Copyright (c) 2026 The moelab authors", 1, true), "LICENSE lacks the copyright line")
    assert.truthy(text:find("Permission is hereby granted, free of charge", 1, true), "LICENSE lacks the grant")
  end)

  local files = tracked()
  if #files == 0 then
    pending("not a git checkout: the tracked files cannot be listed")
    return
  end

  it("the rules know the source files' kinds (C, CUDA, Lua, shell, CMake)", function()
    for _, case in ipairs({
      { "lib/core.c", C_LINE }, { "kernels/common.cuh", C_LINE }, { "lib/moelab.map", C_LINE },
      { "spec/helper.lua", LUA_LINE }, { "moelab-0.1.0-1.rockspec", LUA_LINE }, { ".busted", LUA_LINE },
      { "CMakeLists.txt", HASH_LINE }, { "bench/CMakeLists.txt", HASH_LINE }, { "cmake/x.cmake", HASH_LINE },
      { ".ci/run", HASH_LINE }, { "scenarios/launch.sh", HASH_LINE }, { "examples/x.py", HASH_LINE },
      { "README.md", nil }, { "LICENSE", nil }, { ".gitignore", nil },
    }) do
      assert.are.equal(case[2], expected_line(case[1]), case[1])
    end
  end)

  it("every tracked source file carries its SPDX line first (after a shebang)", function()
    local bad, checked = {}, 0
    for _, path in ipairs(files) do
      local want = expected_line(path)
      if want then
        local got, n = spdx_slot(path)
        -- a file deleted in the work tree but still tracked reads nil: nothing to check
        if got ~= nil then
          checked = checked + 1
          if got ~= want then bad[#bad + 1] = string.format("%s:%d: %q, expected %q", path, n, got, want) end
        end
      end
    end
    assert.is_true(checked > 50, "only " .. checked .. " source files found")
    assert.are.same({}, bad)
  end)
end)
