-- SPDX-License-Identifier: MIT
-- examples/torch_dlpack.py where there is no torch: its ctypes structures laid out as the C
-- compiler lays out moelab.h's and moelab_dlpack.h's (a C program made from the script's own
-- list prints sizeof and offsetof), and its --selftest (DLPack and capsule round trips and an
-- experts call on the CPU) against this build's library.  Skipped without python3 or cc.
local build = os.getenv("MOE_BUILD_DIR") or "build"

local function run(cmd)
  local p = assert(io.popen(cmd .. " 2>&1; echo \"status=$?\""))
  local out = p:read("a")
  p:close()
  local status = tonumber(out:match("status=(%d+)%s*$"))
  return status, (out:gsub("status=%d+%s*$", ""))
end

local function have(program) return run("command -v " .. program .. " >/dev/null") == 0 end

describe("examples/torch_dlpack.py without torch [#cpu]", function()
  if not have("python3") or not have("cc") then
    pending("python3 or cc is missing")
    return
  end
  -- the sanitizer run's preloaded runtime stays (its library is instrumented); Python's own
  -- allocations at exit are no leaks of ours
  local python = "ASAN_OPTIONS=detect_leaks=0 python3 examples/torch_dlpack.py"

  it("lays out every ctypes structure as the C compiler does", function()
    local status, listing = run(python .. " --layout")
    assert.are.equal(0, status, listing)
    local c = { "#include <stddef.h>", "#include <stdio.h>", '#include "moelab.h"', '#include "moelab_dlpack.h"',
      "int main(void) {" }
    local n = 0
    for line in listing:gmatch("[^\n]+") do
      local struct, field = line:match("^([%w_]+)%.([%w_]+) %d+$")
      if struct then
        c[#c + 1] = string.format('  printf("%s.%s %%zu\\n", offsetof(%s, %s));', struct, field, struct, field)
      else
        struct = assert(line:match("^([%w_]+) %d+$"), "unexpected line: " .. line)
        c[#c + 1] = string.format('  printf("%s %%zu\\n", sizeof(%s));', struct, struct)
      end
      n = n + 1
    end
    c[#c + 1] = "  return 0;\n}\n"
    assert.is_true(n > 50, "too few lines:\n" .. listing)
    local src, exe = os.tmpname() .. ".c", os.tmpname()
    local f = assert(io.open(src, "w"))
    f:write(table.concat(c, "\n"))
    f:close()
    local cs, cout = run(string.format("env -u LD_PRELOAD cc -std=c11 -Ilib -o %s %s", exe, src))
    assert.are.equal(0, cs, cout)
    local rs, want = run("env -u LD_PRELOAD " .. exe)
    os.remove(src)
    os.remove(exe)
    assert.are.equal(0, rs, want)
    assert.are.equal(want, listing)
  end)

  it("--selftest passes against " .. build .. "/libmoelab.so", function()
    local status, out = run(python .. " --selftest --lib " .. build .. "/libmoelab.so")
    assert.are.equal(0, status, out)
    assert.truthy(out:find("selftest: PASS", 1, true), out)
  end)

  it("says what is missing and exits 2 where it cannot run", function()
    local status, out = run(python .. " --lib /nonexistent/libmoelab.so")
    assert.are.equal(2, status, out)
    assert.truthy(out:find("cannot load /nonexistent/libmoelab.so (--lib or MOELAB_LIB)", 1, true), out)
    status, out = run(python .. " --world 0")
    assert.are.equal(2, status, out)
    assert.truthy(out:find("--world must be >= 1", 1, true), out)
  end)
end)
