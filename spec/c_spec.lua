-- SPDX-License-Identifier: MIT
-- The C test programs (spec/c/*.c, built into <build>/tests/), one `it` per program, so that one
-- runner counts everything.  MOE_BUILD_DIR names the build directory (default: build).  The GPU
-- test programs (<build>/gpu_tests/) are run by gpu_programs_spec.lua.
local build = os.getenv("MOE_BUILD_DIR") or "build"

local function programs(dir)
  local list = {}
  local p = io.popen("ls -1 '" .. dir .. "' 2>/dev/null")
  if p then
    for name in p:lines() do list[#list + 1] = name end
    p:close()
  end
  table.sort(list)
  return list
end

-- The exit status (128 + n after signal n) and the output, stderr into stdout.
local function run(path)
  local output, status = require("moelab.compat").run("'" .. path .. "' 2>&1")
  return status, output
end

describe("C test programs [#cpu]", function()
  local dir = build .. "/tests"
  local list = programs(dir)
  it("were built into " .. dir, function()
    assert.is_true(#list > 0, "no test programs in " .. dir .. " (build first: cmake --build " .. build .. ")")
  end)
  for _, name in ipairs(list) do
    it(name, function()
      local status, output = run(dir .. "/" .. name)
      -- the programs may print a line per case: keep the lines that say what failed, and the end
      local failed = {}
      for line in output:gmatch("[^\n]+") do
        if line:find("FAIL") or line:find("failed") or line:find("error") then failed[#failed + 1] = line end
      end
      local report = table.concat(failed, "\n", 1, math.min(#failed, 20))
      if #output > 2000 then output = "...\n" .. output:sub(-2000) end
      assert.is_true(status == 0, string.format("%s/%s exited with %s%s\n%s\n-- end of its output:\n%s", dir, name,
        tostring(status), status and status > 128 and string.format(" (signal %d)", status - 128) or "", report, output))
    end)
  end
end)
