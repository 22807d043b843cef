-- SPDX-License-Identifier: MIT
-- NVTX ranges, proven by a tool rather than by eye: the NVTX 3 headers load the library that
-- NVTX_INJECTION64_PATH names, and spec/nvtx/record.c (built into <build>/nvtx/record.so where
-- the NVTX header was found) writes every range pushed and popped to a file.  Each case runs its
-- code in a fresh interpreter (NVTX looks for a tool once per process), then rebuilds the tree of
-- ranges from that file: one "layer" per forward, one range per stage of the layer inside it, the
-- library's own range of every C call inside those.
local S = require "support"

local build = os.getenv("MOE_BUILD_DIR") or "build"
local TOOL = build .. "/nvtx/record.so"

-- The ranges that `code` (Lua, after `local moe = require "moelab"`) pushes -> the tree's roots,
-- each {name =, domain =, children = {...}}, and the run's output; fails on a pop without a push
-- or a range left open.
local function ranges_of(code)
  local script, record = os.tmpname(), os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write('local moe = require "moelab"\n', code, "\n")
  f:close()
  local cwd = assert(io.popen("pwd")):read("l")
  local out, status = S.run_lua(script, "", string.format("NVTX_INJECTION64_PATH='%s/%s' MOE_NVTX_RECORD='%s'", cwd,
    TOOL, record))
  os.remove(script)
  local lines = {}
  local r = io.open(record, "r")
  if r then
    for line in r:lines() do lines[#lines + 1] = line end
    r:close()
  end
  os.remove(record)
  assert.are.equal(0, status, out)
  local roots, stack = {}, {}
  for i, line in ipairs(lines) do
    local what, domain, name = line:match("^(%a+)\t([^\t]*)\t?(.*)$")
    if what == "push" then
      local node = { name = name, domain = domain, children = {} }
      local parent = stack[#stack]
      table.insert(parent and parent.children or roots, node)
      stack[#stack + 1] = node
    else
      assert.are.equal("pop", what, "line " .. i .. ": " .. line)
      assert.is_true(#stack > 0, "line " .. i .. ": a pop with no range open")
      assert.are.equal(stack[#stack].domain, domain, "line " .. i .. ": popped in another domain")
      stack[#stack] = nil
    end
  end
  assert.are.equal(0, #stack, "ranges left open: " .. (stack[1] and stack[1].name or ""))
  return roots, out
end

local function names(nodes)
  local list = {}
  for i, n in ipairs(nodes) do list[i] = n.name end
  return list
end

-- n copies of name
local function times(n, name)
  local list = {}
  for i = 1, n do list[i] = name end
  return list
end

-- Every node of the tree, depth first.
local function each(nodes, fn)
  for _, n in ipairs(nodes) do
    fn(n)
    each(n.children, fn)
  end
end

describe("NVTX ranges [#cpu]", function()
  local tool = io.open(TOOL, "r")
  if not tool then
    pending("no " .. TOOL .. ": the NVTX header (nvtx3/nvToolsExt.h) was not found when " .. build
      .. " was configured, so the ranges are compiled out")
    return
  end
  tool:close()

  local LAYER = [[
local W = %d
local layer = moe.layer { model = moe.models.qwen3_5_397b, world = W, tokens = 5, hidden = 32, ffn = 16,
  shared_ffn = 16, shared_gate = %s }
local x = moe.randn({ W, 5, 32 }, { dtype = "bf16", seed = 1 })
for _ = 1, %d do layer:forward(x) end
]]

  it("a layer forward: one range per stage inside \"layer\", the library's calls inside each", function()
    local W = 4
    local roots = ranges_of(LAYER:format(W, "true", 1))
    assert.are.same({ "layer" }, names(roots))
    local layer = roots[1]
    assert.are.same({ "route", "schedule", "dispatch", "experts", "shared", "combine" }, names(layer.children))
    local expect = {
      route = { "logits", "route" }, -- one router call over the simulated world's tokens
      schedule = times(W, "schedule"), dispatch = times(W, "dispatch"), experts = times(W, "experts"),
      shared = { "experts", "sigmoid_gate" }, combine = times(W, "combine"),
    }
    for _, stage in ipairs(layer.children) do
      assert.are.same(expect[stage.name], names(stage.children), stage.name)
      for _, call in ipairs(stage.children) do assert.are.same({}, call.children, stage.name .. "/" .. call.name) end
    end
    each(roots, function(n) assert.are.equal("moelab", n.domain, n.name) end)
  end)

  it("one \"layer\" per forward; no shared range without a shared expert", function()
    local roots = ranges_of(LAYER:format(1, "false", 2):gsub("shared_ffn = 16", "shared = false"))
    assert.are.same({ "layer", "layer" }, names(roots))
    for _, layer in ipairs(roots) do
      assert.are.same({ "route", "schedule", "dispatch", "experts", "combine" }, names(layer.children))
    end
  end)

  it("a forward that raises closes its ranges (NaN logits under nan = 'error')", function()
    local roots, out = ranges_of([[
local layer = moe.layer { model = moe.models.kimi_k2, world = 2, tokens = 4, hidden = 32, ffn = 16 }
local logits = moe.zeros({ 8, 384 }):fill(0 / 0)
print(pcall(layer.forward, layer, moe.randn({ 2, 4, 32 }, { dtype = "bf16" }), { logits = logits }))
]])
    assert.truthy(out:find("false", 1, true) and out:find("NaN", 1, true), out)
    assert.are.same({ "layer" }, names(roots))
    assert.are.same({ "route" }, names(roots[1].children)) -- stopped after routing
  end)

  it("a stage called alone (as a C host calls the library) has its own range", function()
    local roots = ranges_of([[
local ids = moe.route { logits = moe.randn({ 6, 16 }, { seed = 2 }), k = 2 }
local s = moe.schedule { ids = ids:view(0, { 2, 3, 2 }), experts = 16, rank = 1 }
moe.experts { x = moe.randn({ s.capacity, 8 }, { dtype = "bf16" }), offsets = s.expert_offsets,
  w_gate_up = moe.randn({ 8, 8, 8 }, { dtype = "bf16" }), w_down = moe.randn({ 8, 8, 4 }, { dtype = "bf16" }) }
]])
    assert.are.same({ "route", "schedule", "experts" }, names(roots))
  end)

  it("ranges of the host's own nest around the library's", function()
    local roots = ranges_of([[
moe.range_push("outer")
moe.range_push("inner")
moe.route { logits = moe.randn({ 2, 4 }), k = 1 }
moe.range_pop()
moe.range_pop()
]])
    assert.are.same({ "outer" }, names(roots))
    assert.are.same({ "inner" }, names(roots[1].children))
    assert.are.same({ "route" }, names(roots[1].children[1].children))
  end)
end)

describe("moe.range_push and moe.range_pop, their errors [#cpu]", function()
  for _, row in ipairs {
    { "a pop with no range open", function() moe.range_pop() end,
      "range_pop: no range that moe_range_push opened is open on this thread" },
    { "a name that is not a string", function() moe.range_push({}) end, "string expected, got table" },
    { "no name", function() moe.range_push() end, "string expected, got no value" },
  } do
    it(row[1], function()
      local ok, err = pcall(row[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end

  it("a pop closes the one push open, then refuses again", function()
    moe.range_push("x")
    moe.range_pop()
    assert.is_false(pcall(moe.range_pop))
  end)
end)
