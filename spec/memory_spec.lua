-- SPDX-License-Identifier: MIT
-- Sizes before allocation: a layer states its memory (moe.layer_memory, layer.memory) without
-- allocating, the statement equals what it then allocates, and a layer that cannot fit is refused
-- before anything is made.
local S = require "support"

local allocated = S.allocated

local CONFIGS = {
  { name = "softmax, no shared expert", model = { name = "tiny", experts = 4, k = 2, hidden = 16, ffn = 8 },
    tokens = 3 },
  { name = "sigmoid with a bias and a shared expert, 4 ranks, pad 8", model = "kimi_k2", world = 4, tokens = 5,
    hidden = 32, ffn = 16, pad = 8 },
  { name = "a gated shared expert, a given capacity", model = "qwen3_5_397b", world = 2, tokens = 4, hidden = 16,
    ffn = 8, capacity = 100 },
  { name = "one token, one rank, expert_capacity", model = "glm5", tokens = 1, hidden = 8, ffn = 8,
    expert_capacity = 1, overflow = "drop" },
}

for _, dev in ipairs(ALL_DEVICES) do
  describe("a layer's memory [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    for _, c in ipairs(CONFIGS) do
      it("is what it allocates: " .. c.name, function()
        local o = { device = dev }
        for k, v in pairs(c) do if k ~= "name" then o[k] = v end end
        local stated = moe.layer_memory(o)
        local layer = moe.layer(o)
        local got = allocated(layer)
        assert.are.same(stated, layer.memory)
        assert.are.equal(got[dev], dev == "cpu" and stated.host or stated.device)
        assert.are.equal(0, dev == "cpu" and stated.device or stated.host)
        assert.are.equal(stated.weights + stated.buffers, got[dev])
        -- the CPU reference reads a CPU layer's weights in place; a GPU layer's it copies, all of them
        assert.are.equal(dev == "cpu" and 0 or stated.weights, stated.reference_host)
      end)
    end

    it("fits a budget of exactly what it needs, not one byte less", function()
      local o = { model = "kimi_k2", world = 2, tokens = 4, hidden = 32, ffn = 16, device = dev }
      local need = moe.layer_memory(o)
      o.memory_limit = dev == "cpu" and need.host or need.device
      assert.truthy(moe.layer(o))
      o.memory_limit = o.memory_limit - 1
      local ok, err = pcall(moe.layer, o)
      assert.is_false(ok)
      assert.truthy(tostring(err):find("allowed (memory_limit)", 1, true), tostring(err))
    end)
  end)
end

describe("a layer's memory, before allocation [#cpu]", function()
  -- Kimi K2 at its real size: 384 experts of 2 x 2048 x 7168 and 7168 x 2048 bf16 weights, the
  -- router's 384 x 7168 and its bias, a shared expert of the same widths.
  local H, F, E = 7168, 2048, 384
  local WEIGHTS = E * 3 * F * H * 2 + E * H * 2 + E * 4 + 3 * F * H * 2

  it("states the real Kimi K2's weights on the CPU without allocating them", function()
    local ok, m = S.without_allocating(function() return moe.layer_memory { model = "kimi_k2", tokens = 32, device = "cpu" } end)
    assert(ok, m)
    assert.are.equal(WEIGHTS, m.weights)
    assert.is_true(m.host > WEIGHTS and m.host == m.weights + m.buffers)
  end)

  it("refuses the real Kimi K2 past the budget at once, naming what to change", function()
    local ok, err = S.without_allocating(function()
      moe.layer { model = "kimi_k2", tokens = 32, device = "cpu", memory_limit = 16e9 }
    end)
    assert.is_false(ok)
    for _, frag in ipairs { "needs 33.9 GB of host memory, 16.0 GB allowed (memory_limit)", "hidden = 7168, ffn = 2048",
      "384 experts", "pass smaller hidden and ffn", "or run it on a GPU" } do
      assert.truthy(tostring(err):find(frag, 1, true), tostring(err))
    end
  end)

  it("refuses it by what the host has available, where that is less", function()
    local free = moe.core.device_memory("cpu")
    if free >= WEIGHTS then
      pending(string.format("this host has %.1f GB available: it could hold the layer", free / 1e9))
      return
    end
    local ok, err = S.without_allocating(function() moe.layer { model = "kimi_k2", tokens = 32, device = "cpu" } end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("available (MemAvailable)", 1, true), tostring(err))
  end)

  it("asks the host what it has: free within total", function()
    local free, total = moe.core.device_memory("cpu")
    assert.is_true(free > 0 and total > 0 and free <= total, free .. " of " .. total)
  end)

  if not HAVE_GPU then
    it("says a GPU's memory cannot be asked without one", function()
      local ok, err = pcall(moe.core.device_memory, "cuda:0")
      assert.is_false(ok)
      assert.truthy(tostring(err):find("device_memory: cuda:0 is not available", 1, true), tostring(err))
    end)
  end
end)
