-- SPDX-License-Identifier: MIT
-- moe.device_info and the run metadata every JSON report carries (lua/moelab/runinfo.lua): what
-- makes two reports comparable, or says why they are not.
local S = require "support"
local runinfo = require "moelab.runinfo"

local function shell(command)
  local p = assert(io.popen(command .. " 2>/dev/null"))
  local out = p:read("a")
  p:close()
  return out
end

describe("moe.device_info [#cpu]", function()
  it("describes the CPU: its model and the backend's threads", function()
    local info = moe.device_info("cpu")
    assert.are.equal("cpu", info.kind)
    assert.are.equal("string", type(info.name))
    assert.is_true(#info.name > 0)
    local model = shell("grep -m1 '^model name' /proc/cpuinfo"):match(":%s*(.-)%s*$")
    if model then assert.are.equal(model, info.name) end
    assert.are.equal("number", type(info.threads))
    assert.is_true(info.threads >= 1)
  end)

  it("counts the threads MOE_THREADS sets", function()
    local out, status = S.run_lua("-e 'print(require(\"moelab\").device_info(\"cpu\").threads)'", "", "MOE_THREADS=3")
    assert.are.equal(0, status, out)
    assert.are.equal("3\n", out)
  end)

  for _, row in ipairs {
    { "no device", nil, "bad argument #1 to 'device_info' (device must be \"cpu\" or \"cuda:N\", got nil)" },
    { "a number", 0, "bad argument #1 to 'device_info' (device must be \"cpu\" or \"cuda:N\", got 0)" },
    { "an unknown name", "gpu", "expected 'cpu' or 'cuda:N', got 'gpu'" },
    { "a malformed index", "cuda:x", "expected 'cpu' or 'cuda:N', got 'cuda:x'" },
    { "a GPU that is not there", "cuda:999", "device_info: " },
  } do
    it("refuses " .. row[1], function()
      local ok, err = pcall(moe.device_info, row[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end
end)

describe("moe.device_info on a GPU [#gpu]", function()
  if skip_without("cuda:0") then return end
  it("names the GPU, its clock and the CUDA versions", function()
    local info = moe.device_info("cuda:0")
    assert.are.equal("cuda", info.kind)
    assert.is_true(#info.name > 0)
    assert.is_true(info.sm_clock_mhz > 0 and info.sm_count > 0 and info.memory_mib > 0)
    assert.truthy(info.compute_capability:match("^%d+%.%d$"), info.compute_capability)
    assert.truthy(info.driver:match("^%d+%.%d+$"), info.driver)
    assert.truthy(info.runtime:match("^%d+%.%d+$"), info.runtime)
  end)
end)

describe("run metadata [#cpu]", function()
  it("has moelab's version, the commit, the interpreter, the date in UTC and the command line", function()
    local r = runinfo.collect { device = "cpu" }
    assert.are.equal(moe.version, r.moelab)
    local jit = rawget(_G, "jit")
    assert.are.equal(jit and jit.version or _VERSION, r.lua)
    assert.truthy(r.date:match("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$"), r.date)
    assert.are.equal(os.date("!%Y-%m-%d"), r.date:sub(1, 10))
    local head = shell("git rev-parse HEAD"):match("%x+")
    if head then
      assert.are.equal(head, r.commit)
      assert.are.equal("boolean", type(r.dirty))
    end
    assert.truthy(r.command:find("busted", 1, true), r.command) -- the suite's own command line
    assert.are.same(moe.device_info("cpu").name, r.device.name)
    assert.are.equal("cpu", r.device.device)
    assert.is_nil(r.nccl)
  end)

  it("quotes the command line's words as a shell takes them back", function()
    local code = "require(\"moelab\") print(require(\"moelab.runinfo\").command())"
    local out, status = S.run_lua("-e '" .. code .. "'", "")
    assert.are.equal(0, status, out)
    assert.truthy(out:find(S.lua .. " -e '" .. code .. "'", 1, true), out)
  end)

  it("has no commit where the sources are not a git checkout", function()
    local dir = os.tmpname()
    os.remove(dir)
    local copied = os.execute("mkdir -p " .. dir .. " && cp -r lua " .. dir .. "/")
    assert.is_true(copied == true or copied == 0)
    local code = "require(\"moelab\") local r = require(\"moelab.runinfo\").collect { device = \"cpu\" } "
      .. "print(r.commit, r.dirty, r.moelab)"
    -- MOELAB_HEADER: LuaJIT's binding reads the header beside the sources, which the copy lacks
    local env = string.format("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' GIT_CEILING_DIRECTORIES=%s "
      .. "MOELAB_HEADER=lib/moelab.h", dir, dir, dir)
    local out, status = S.run_lua("-e '" .. code .. "'", "", env)
    os.execute("rm -rf " .. dir)
    assert.are.equal(0, status, out)
    assert.are.equal("nil\tnil\t" .. moe.version .. "\n", out)
  end)

  it("is in every scenario's JSON report", function()
    local json = require "moelab.json"
    local file = os.tmpname()
    local out, status = S.run_lua("scenarios/experts.lua",
      "--models kimi_k2 --dists uniform --pads 1 --tokens 4 --json " .. file)
    assert.are.equal(0, status, out)
    local report = json.decode(assert(io.open(file)):read("a"))
    os.remove(file)
    assert.are.equal(moe.version, report.run.moelab)
    assert.truthy(report.run.command:find("scenarios/experts.lua --models kimi_k2", 1, true), report.run.command)
    assert.are.equal("cpu", report.run.device.kind)
  end)
end)
