-- SPDX-License-Identifier: MIT
-- The exit statuses of scenarios/experts.lua as a user runs it: 0 when its checks pass, 2 on a
-- configuration the library refuses (not 1, which is a failed check).  (kimi.lua's are in
-- world_spec.lua.)
local S = require "support"

describe("scenarios/experts.lua, its exit status [#cpu]", function()
  local function run(flags, env)
    local out, status = S.run_lua("scenarios/experts.lua", flags, env)
    return out .. "status=" .. tostring(status)
  end

  it("a small run whose checks pass exits 0", function()
    local out = run("--models kimi_k2 --dists uniform --pads 1 --tokens 8")
    assert.truthy(out:find("status=0", 1, true), out)
  end)

  it("a pad the schedule refuses exits 2, naming the preset and the library's message", function()
    local out = run("--models kimi_k2 --dists uniform --pads 100000000 --tokens 8")
    assert.truthy(out:find("Kimi K2: ", 1, true), out)
    assert.truthy(out:find("the default capacity exceeds 2^31 - 2 rows", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
    assert.falsy(out:find("stack traceback", 1, true), out)
  end)

  it("--precision fp8 runs the FP8 experts, checks them against the CPU's and exits 0; fp16 exits 2", function()
    local out = run("--models kimi_k2 --dists uniform --pads 1 --tokens 8 --precision fp8")
    assert.truthy(out:find("fp8   e4m3 xs", 1, true), out)
    assert.truthy(out:find("status=0", 1, true), out)
    assert.truthy(run("--models kimi_k2 --tokens 8 --precision fp16"):find("status=2", 1, true))
    assert.truthy(run("--models kimi_k2 --tokens 8 --precision fp8 --ffn 64"):find("a multiple of 128", 1, true))
  end)

  it("kimi.lua --precision fp8 passes the FP8 layer's check on the CPU, saying so in its JSON", function()
    local file = os.tmpname()
    local out, status = S.run_lua("scenarios/kimi.lua", "--device cpu --tokens 8 --precision fp8 --json " .. file)
    local report = require("moelab.json").decode(S.read_file(file))
    os.remove(file)
    assert.are.equal(0, status, out)
    assert.are.equal("fp8", report.precision)
    assert.is_true(report.check.pass)
    assert.are.equal(5e-2, report.check.rtol)
    assert.are.equal(2e-2, report.check.l2)
  end)

  it("kimi.lua --anchor times the bf16 layer beside the FP8 one and reports their ratio; without fp8 it exits 2",
    function()
      local file = os.tmpname()
      local out, status = S.run_lua("scenarios/kimi.lua", "--device cpu --tokens 8 --precision fp8 --anchor --json "
        .. file)
      local report = require("moelab.json").decode(S.read_file(file))
      os.remove(file)
      assert.are.equal(0, status, out)
      local a = report.anchor
      assert.is_true(a.fp8_ms_per_rank > 0 and a.bf16_ms_per_rank > 0, out)
      assert.near(a.fp8_ms_per_rank / a.bf16_ms_per_rank, a.ratio, 1e-9)
      assert.truthy(out:find(string.format("FP8 / bf16 = %.3f", a.ratio), 1, true), out)
      out, status = S.run_lua("scenarios/kimi.lua", "--device cpu --tokens 8 --anchor")
      assert.are.equal(2, status, out)
      assert.truthy(out:find("give --precision fp8 too", 1, true), out)
    end)

  it("MOE_TRACEBACK=1 adds the traceback to that message, =0 does not", function()
    local flags = "--models kimi_k2 --dists uniform --pads 100000000 --tokens 8"
    assert.truthy(run(flags, "MOE_TRACEBACK=1"):find("stack traceback", 1, true))
    local out = run(flags, "MOE_TRACEBACK=0")
    assert.falsy(out:find("stack traceback", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
  end)
end)

-- scenarios/report.lua, the README's results table: a row a measurement, with its command, and
-- exit status 1 when a measurement cannot be made.
describe("scenarios/report.lua [#cpu]", function()
  local function run(env, flags)
    local out, status = S.run_lua("scenarios/report.lua", "--cpu " .. (flags or ""), env)
    return out .. "status=" .. tostring(status)
  end

  it("measures the CPU layer and writes its row; --only keeps it, --keep saves its command's output", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir))
    local out = run("", "--only 'Kimi K2 layer' --keep " .. dir)
    assert.truthy(out:find("| what | result | command | machine |", 1, true), out)
    assert.truthy(out:find("\n| Kimi K2 layer, 8 ranks simulated %(H, F, tokens reduced%) | [%d.]+ ms a pass; check PASS "
      .. "%(max err / max ref [%d.e+-]+, relative L2 [%d.e+-]+%) | `lua scenarios/kimi.lua %-%-device cpu` |"), out)
    assert.truthy(out:find("status=0", 1, true), out)
    local f = assert(io.open(dir .. "/1.log"))
    local kept = f:read("a")
    f:close()
    os.execute("rm -r " .. dir)
    assert.truthy(kept:find("^%$ [^\n]*kimi%.lua %-%-device cpu\n"), kept)
    assert.truthy(kept:find("check [^\n]*: PASS"), kept)
  end)

  it("--keep into a folder that is not there stops with status 2 before any command runs", function()
    local dir = os.tmpname()
    os.remove(dir)
    local out = run("LUA_INIT='if arg[0]:find(\"kimi\") then os.exit(3) end'", "--keep " .. dir .. "/missing")
    assert.truthy(out:find("--keep: cannot write in '" .. dir .. "/missing' (it must be a folder that exists)", 1, true), out)
    assert.truthy(out:find("status=2$"), out)
    assert.falsy(out:find("| what |", 1, true), out)
  end)

  it("--only without a matching row runs nothing and writes the table's head alone", function()
    local out = run("LUA_INIT='if arg[0]:find(\"kimi\") then os.exit(3) end'", "--only 'no such row'")
    assert.are.equal("| what | result | command | machine |\n|---|---|---|---|\nstatus=0", out)
  end)

  it("a measurement that fails shows in its row and in the exit status", function()
    -- the scenario the report runs stops before it starts (LUA_INIT runs in every interpreter)
    local out = run("LUA_INIT='if arg[0]:find(\"kimi\") then os.exit(3) end'")
    assert.truthy(out:find("| not measured: ", 1, true), out)
    assert.truthy(out:find("status=1", 1, true), out)
  end)
end)
