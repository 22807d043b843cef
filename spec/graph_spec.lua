-- SPDX-License-Identifier: MIT
-- CUDA graphs and CUDA failures, GPU only: a captured layer replayed 1,000 times on fresh inputs
-- (so fresh routing each time) equals the eager forward bit for bit; stats reach graph:check();
-- a CUDA failure is a Lua error naming the stage and the CUDA error, and the process goes on;
-- a tensor made inside a capture, or used by one and closed, keeps its memory as long as its graph.
describe("graphs [#gpu]", function()
  if skip_without("cuda:0") then return end
  local dev = "cuda:0"

  local function small_layer(o)
    local opts = { model = "kimi_k2", world = 4, tokens = 16, hidden = 64, ffn = 32, shared_ffn = 32, device = dev,
      seed = 3, capacity = 4 * 16 * 8 }
    for k, v in pairs(o or {}) do opts[k] = v end
    return moe.layer(opts)
  end

  it("1,000 replays with changing routing equal eager runs bit for bit", function()
    local layer = small_layer()
    local g = layer:capture()
    local x = layer.input
    local changed = 0
    local last_ids
    for i = 1, 1000 do
      x:randn(1000 + i, 1.0)
      local replayed = g:replay():to("cpu")
      local ids = layer.ids:to("cpu")
      g:check()
      local eager = layer:forward(x):to("cpu")
      assert.tensor_equal(replayed, eager)
      assert.tensor_equal(ids, layer.ids:to("cpu"))
      if last_ids and not pcall(moe.check.equal, ids, last_ids) then changed = changed + 1 end
      last_ids = ids
    end
    assert.is_true(changed > 990, "the routing changed in only " .. changed .. " of 999 replays")
  end)

  it("a replay matches the dense reference", function()
    local layer = small_layer { model = "qwen3_5_397b", pad = 128, capacity = 4 * 16 * 10 + 128 * 128 }
    local g = layer:capture()
    layer.input:randn(7, 1.0)
    g:replay()
    g:check()
    assert.close(layer.out, layer:reference(layer.input, { routing = "forward" }))
  end)

  it("replay returns the same view of the output each time, a new one if the caller closed it", function()
    local layer = small_layer()
    local g = layer:capture()
    layer.input:randn(8, 1.0)
    local a = g:replay()
    assert.are.equal(a, g:replay())
    a:close()
    local b = g:replay()
    assert.are_not.equal(a, b)
    assert.is_false(b.closed)
    g:check()
    assert.tensor_equal(b:to("cpu"), layer.out:to("cpu"))
    assert.is_true(layer:check(layer.input, { raise = false }).pass)
  end)

  it("capacity overflow inside a graph is reported by graph:check, not hidden", function()
    local layer = small_layer { capacity = 8 }
    local g = layer:capture()
    layer.input:randn(9, 1.0)
    g:replay()
    local ok, err = pcall(g.check, g)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("capacity overflow", 1, true), tostring(err))
  end)

  it("NaN logits inside a graph are reported by graph:check", function()
    local layer = small_layer()
    local g = layer:capture()
    layer.input:fill(0 / 0)
    g:replay()
    local ok, err = pcall(g.check, g)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("NaN", 1, true), tostring(err))
  end)

  it("a capture is not a forward: check and the forward's routing wait for the first replay", function()
    local layer = small_layer()
    local g = layer:capture()
    layer.input:randn(11, 1.0)
    local ok, err = pcall(layer.check, layer, layer.input)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("no forward has completed", 1, true), tostring(err))
    ok, err = pcall(layer.reference, layer, layer.input, { routing = "forward" })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("before any forward completed", 1, true), tostring(err))
    g:replay()
    layer:check(layer.input)
  end)

  it("a layer made on device 'cuda' is on cuda:0 and captures", function()
    local layer = small_layer { device = "cuda" }
    assert.equal("cuda:0", layer.device)
    local g = layer:capture() -- makes layer.input, the buffer it replays on
    layer.input:randn(5, 1.0)
    g:replay()
    g:check()
    assert.tensor_equal(layer.out:to("cpu"), layer:forward(layer.input):to("cpu"))
  end)

  it("capture refuses a CPU layer with a clear error", function()
    local layer = small_layer { device = "cpu" }
    assert.has_error(function() layer:capture() end,
      "layer:capture: CUDA graphs need a layer on a cuda device (this one is on cpu)")
  end)

  it("a CUDA allocation failure is a Lua error naming the stage and the CUDA error", function()
    local ok, err = pcall(moe.zeros, { 2 ^ 19, 2 ^ 19 }, { device = dev })
    assert.is_false(ok)
    err = tostring(err)
    assert.truthy(err:find("tensor", 1, true) and err:find("cudaErrorMemoryAllocation", 1, true), err)
    -- and the device still works
    assert.tensor_equal(moe.full({ 3 }, 2, { device = dev }):to("cpu"), moe.full({ 3 }, 2))
  end)

  it("a tensor made inside a capture and dropped lives as long as the graph", function()
    local ids = moe.tensor({ { { 1 }, { 0 }, { 1 } } }, { dtype = "i32", device = dev })
    local s = moe.schedule { ids = ids, experts = 2 }
    local x = moe.full({ 1, 3, 8 }, 3, { dtype = "bf16", device = dev })
    local held = setmetatable({}, { __mode = "v" }) -- sees the tensor without keeping it
    local g = moe.graph(function() held[1] = moe.dispatch { x = x, schedule = s } end, { device = dev })
    collectgarbage()
    collectgarbage()
    assert.is_not_nil(held[1], "the dispatch output was collected while its graph lives")
    -- fresh tensors of its size get other memory: a replay writes its rows, not theirs
    local others = {}
    for i = 1, 4 do others[i] = moe.zeros({ s.capacity, 8 }, { dtype = "bf16", device = dev }) end
    g:replay()
    for i = 1, 4 do assert.tensor_equal(others[i]:to("cpu"), moe.zeros({ s.capacity, 8 }, { dtype = "bf16" })) end
    assert.tensor_equal(held[1]:to("cpu"), moe.full({ s.capacity, 8 }, 3, { dtype = "bf16" }))
    g = nil
    for _ = 1, 3 do collectgarbage() end -- the graph's finaliser, then what it held
    assert.is_nil(held[1], "the graph's tensors outlived it")
  end)

  it("a tensor a graph uses keeps its memory when its caller closes it, until the graph goes", function()
    local ids = moe.tensor({ { { 1 }, { 0 }, { 1 } } }, { dtype = "i32", device = dev })
    local s = moe.schedule { ids = ids, experts = 2 }
    local g, probe, gone
    do
      local x = moe.full({ 1, 3, 8 }, 3, { dtype = "bf16", device = dev })
      local out = moe.zeros({ s.capacity, 8 }, { dtype = "bf16", device = dev })
      g = moe.graph(function() moe.dispatch { x = x, schedule = s, out = out } end, { device = dev })
      probe = out:view(0, { 1, 8 }) -- a view made after the capture, of a pinned owner
      gone = { x, out }
      x:close()
      out:close()
    end
    assert.is_true(gone[1].closed and gone[2].closed)
    assert.has_error(function() return gone[1]:to("cpu") end)
    -- tensors of the same sizes made now must get other memory than the closed ones
    local others = {}
    for _ = 1, 4 do
      others[#others + 1] = moe.full({ 1, 3, 8 }, 7, { dtype = "bf16", device = dev })
      others[#others + 1] = moe.zeros({ s.capacity, 8 }, { dtype = "bf16", device = dev })
    end
    g:replay()
    assert.tensor_equal(probe:to("cpu"), moe.full({ 1, 8 }, 3, { dtype = "bf16" }))
    for i = 2, #others, 2 do
      assert.tensor_equal(others[i]:to("cpu"), moe.zeros({ s.capacity, 8 }, { dtype = "bf16" }))
    end
    -- once the graph is gone the memory is the view's alone
    g = nil
    for _ = 1, 3 do collectgarbage() end
    assert.tensor_equal(probe:to("cpu"), moe.full({ 1, 8 }, 3, { dtype = "bf16" }))
  end)

  it("inside a capture, combine takes schedules of one ids tensor and refuses copies, saying why", function()
    local ids = moe.tensor({ { { 1 }, { 0 }, { 1 } }, { { 0 }, { 0 }, { 1 } } }, { dtype = "i32", device = dev })
    local copy = moe.zeros({ 2, 3, 1 }, { dtype = "i32", device = dev })
    copy:copy(ids)
    local s0 = moe.schedule { ids = ids, experts = 2, rank = 0 }
    local s1 = moe.schedule { ids = copy, experts = 2, rank = 1 }
    local ys = { moe.full({ s0.capacity, 8 }, 1, { dtype = "bf16", device = dev }),
      moe.full({ s1.capacity, 8 }, 2, { dtype = "bf16", device = dev }) }
    local w = moe.full({ 3, 1 }, 1, { device = dev })
    local eager = moe.combine { schedules = { s0, s1 }, ys = ys, weights = w } -- eager: the copy is compared
    local ok, err = pcall(moe.graph, function() moe.combine { schedules = { s0, s1 }, ys = ys, weights = w } end,
      { device = dev })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("inside a graph capture every rank's schedule must come from the same tensor", 1,
      true), tostring(err))
    local same = moe.schedule { ids = ids, experts = 2, rank = 1 }
    local out = moe.zeros({ 3, 8 }, { dtype = "bf16", device = dev })
    local g = moe.graph(function() moe.combine { schedules = { s0, same }, ys = ys, weights = w, out = out } end,
      { device = dev })
    g:replay()
    assert.tensor_equal(out:to("cpu"), eager:to("cpu"))
  end)

  it("a device copy during capture is refused", function()
    local t = moe.zeros({ 4 }, { device = dev })
    local ok, err = pcall(moe.graph, function() t:flat() end, { device = dev })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("not allowed during graph capture", 1, true), tostring(err))
    -- the failed capture left the stream usable
    assert.tensor_equal(t:fill(5):to("cpu"), moe.full({ 4 }, 5))
  end)
end)
