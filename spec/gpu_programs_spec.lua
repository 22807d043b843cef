-- SPDX-License-Identifier: MIT
-- The GPU test programs of spec/gpu (built into build/gpu_tests when CUDA is found): each
-- compares stages on the GPU with the CPU reference through the C API and exits non-zero on
-- any mismatch.  Without a GPU they are reported skipped.
local build = os.getenv("MOE_BUILD_DIR") or "build"

local function programs()
  local list = {}
  local p = io.popen("ls " .. build .. "/gpu_tests 2>/dev/null")
  for name in p:lines() do list[#list + 1] = name end
  p:close()
  table.sort(list)
  return list
end

describe("GPU test programs [#gpu]", function()
  if not HAVE_GPU then
    pending("no GPU on this machine: spec/gpu programs skipped")
    return
  end
  local list = programs()
  it("were built", function()
    assert.is_true(#list > 0, "no programs in " .. build .. "/gpu_tests (built without CUDA?)")
  end)
  for _, name in ipairs(list) do
    it(name, function()
      local out = io.popen(build .. "/gpu_tests/" .. name .. " 2>&1; echo \"exit=$?\"")
      local text = out:read("a")
      out:close()
      local code = tonumber(text:match("exit=(%d+)%s*$"))
      -- 77: the program cannot run here (a build without what it needs): skipped, with its reason
      if code == 77 then pending(name .. ": " .. (text:match("SKIP ([^\n]*)") or "skipped")) return end
      assert(code == 0, name .. " exited " .. tostring(code) .. ":\n" .. text:sub(-3000))
    end)
  end
end)
