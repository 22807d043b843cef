-- SPDX-License-Identifier: MIT
-- Every file the project cites exists in it: a path under one of the repository's folders
-- (lib/..., kernels/..., docs/...) or a Markdown file named anywhere, in any tracked file.  A
-- reader who follows a comment or a document must find what it names.
local TOP = { "lib", "kernels", "lua", "scenarios", "spec", "bench", "docs" }

local function tracked()
  local p = assert(io.popen("git ls-files 2>/dev/null"))
  local files = {}
  for name in p:lines() do files[#files + 1] = name end
  p:close()
  return files
end

describe("citations [#cpu]", function()
  local files = tracked()
  if #files == 0 then
    pending("not a git checkout: the tracked files cannot be listed")
    return
  end
  local exists, base = {}, {}
  for _, f in ipairs(files) do
    exists[f] = true
    base[f:match("[^/]+$")] = true
    local dir = f:match("^(.*)/[^/]+$")
    while dir do
      exists[dir] = true
      dir = dir:match("^(.*)/[^/]+$")
    end
  end

  -- The names a file cites that the tree does not hold.
  local function missing_in(path)
    local fh = io.open(path, "rb")
    if not fh then return {} end
    local text = fh:read("a")
    fh:close()
    local out, dir = {}, path:match("^(.*)/[^/]+$")
    for _, top in ipairs(TOP) do
      for cited in text:gmatch("%f[%w_./-]" .. top .. "/[%w_./-]*[%w_]") do
        local rel = dir and (dir .. "/" .. cited):gsub("[^/]+/%.%./", "") -- a relative link in docs/
        -- (lib/lua/5.4 is an install folder, not a file of ours)
        if not exists[cited] and not exists[rel] and not cited:find("/lua/5%.4") then out[#out + 1] = cited end
      end
    end
    for cited in text:gmatch("[%w_./-]*%.md%f[^%w_]") do
      local name = cited:match("[^/]+$")
      if name ~= ".md" and not base[name] then out[#out + 1] = cited end
    end
    return out
  end

  it("lists the tracked files", function() assert.is_true(#files > 50) end)
  it("every cited path and Markdown file exists", function()
    local bad = {}
    for _, f in ipairs(files) do
      for _, c in ipairs(missing_in(f)) do bad[#bad + 1] = f .. ": " .. c end
    end
    assert.are.same({}, bad)
  end)
end)
