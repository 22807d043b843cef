-- SPDX-License-Identifier: MIT
-- moe.layer{precision = "fp8"} (docs/design.md, "FP8 experts and layer"): its check against the
-- FP8 reference on every device, its forward against the stages composed by hand (bit for bit),
-- its refusals, and on a GPU the graph of it replayed with routing that changes.
local S = require "support"

local function fp8_layer(dev, o)
  local opts = { model = "kimi_k2", world = 2, tokens = 12, hidden = 256, ffn = 128, experts = 8, device = dev,
    precision = "fp8", seed = 3 }
  for k, v in pairs(o or {}) do opts[k] = v end
  return moe.layer(opts)
end

local function randn_x(layer, seed)
  return moe.randn({ layer.world, layer.tokens, layer.hidden }, { dtype = "bf16", seed = seed, device = layer.device })
end

for _, dev in ipairs(ALL_DEVICES) do
  describe("layer precision = 'fp8' [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    it("passes its check against the FP8 reference, with and without a shared expert", function()
      for _, shared in ipairs { true, false } do
        local layer = fp8_layer(dev, { shared = shared })
        local x = randn_x(layer, 11)
        layer:forward(x)
        local m = layer:check(x, { raise = false })
        assert.is_true(m.pass, string.format("shared %s: rel_max %.3g (rtol %g), rel_l2 %.3g (l2 %g)", tostring(shared),
          m.rel_max, m.rtol, m.rel_l2, m.l2))
        assert.are.equal(5e-2, m.rtol)
        assert.are.equal(2e-2, m.l2)
        -- and it is an FP8 result: the bf16 layer of the same weights is further from that reference
        assert.is_true(m.rel_l2 > 1e-3, "rel_l2 " .. m.rel_l2 .. " is too small for FP8")
      end
    end)

    it("gives what its stages give composed by hand, bit for bit", function()
      local layer = fp8_layer(dev, { shared_gate = true, model = "qwen3_5_397b", shared_ffn = 128, experts = 16 })
      local x = randn_x(layer, 12)
      local out = layer:forward(x)
      local W, T, H, K = layer.world, layer.tokens, layer.hidden, layer.k
      local rows = x:view(0, { W * T, H })
      local core = moe.core
      local function new(dtype, shape) return core.new(dtype, shape, dev) end
      local xq, xs = new("e4m3", { W, T, H }), new("f32", { W, T, H / 128 })
      core.quantize { q = xq:view(0, { W * T, H }), scale = xs:view(0, { W * T, H / 128 }), x = rows, kind = "token" }
      local ys, scheds = {}, {}
      for r = 1, W do
        local s = moe.schedule { ids = layer.ids, experts = layer.experts, rank = r - 1, capacity = layer.capacity }
        scheds[r] = s
        local C = layer.capacity
        local q, qs = new("e4m3", { C, H }), new("f32", { H / 128, C })
        core.dispatch_fp8 { out = q, out_scale = qs, x = xq, x_scale = xs, peer_rank = s.peer_rank,
          peer_route = s.peer_route, k = K, zero_fill = true }
        ys[r] = moe.experts { x = q, x_scale = qs, offsets = s.expert_offsets, w_gate_up = layer.w_gate_up[r],
          w_gate_up_scale = layer.w_gate_up_scale[r], w_down = layer.w_down[r], w_down_scale = layer.w_down_scale[r] }
      end
      local sq, ss = new("e4m3", { W * T, H }), new("f32", { H / 128, W * T })
      core.quantize { q = sq, scale = ss, x = rows, kind = "token_t" }
      local shared = moe.experts { x = sq, x_scale = ss, offsets = moe.tensor({ 0, W * T }, { dtype = "i32",
        device = dev }), w_gate_up = layer.shared_gate_up, w_gate_up_scale = layer.shared_gate_up_scale,
        w_down = layer.shared_down, w_down_scale = layer.shared_down_scale }
      local gate = moe.zeros({ W * T }, { device = dev })
      moe.core.sigmoid_gate(gate, rows, layer.shared_gate_w)
      for p = 1, W do
        local want = moe.combine { schedules = scheds, ys = ys, weights = layer.weights:select(p), rank = p - 1,
          shared = shared:view((p - 1) * T * H, { T, H }), shared_gate = gate:view((p - 1) * T, { T }) }
        assert.tensor_equal(out:select(p):to("cpu"), want:to("cpu"))
      end
    end)

    describe("refuses", function()
      local ROWS = {
        { { precision = "fp16" }, "option 'precision' must be one of 'bf16', 'fp8'" },
        { { hidden = 200 }, "precision = 'fp8' needs hidden a multiple of 128 %(the FP8 block%), got 200" },
        { { ffn = 192 }, "precision = 'fp8' needs ffn a multiple of 128 %(the FP8 block%), got 192" },
        { { shared_ffn = 64, shared = true }, "needs shared_ffn a multiple of 128 %(the FP8 block%), got 64" },
      }
      for _, row in ipairs(ROWS) do
        local k, v = next(row[1])
        it(k .. " = " .. tostring(v), function()
          local ok, err = pcall(fp8_layer, dev, row[1])
          assert.is_false(ok)
          assert.matches(row[2], tostring(err))
        end)
      end
    end)

    it("counts its FP8 buffers in its memory: e4m3 weights and their scales", function()
      local o = { model = "kimi_k2", world = 2, tokens = 12, hidden = 256, ffn = 128, experts = 8, device = dev,
        shared_ffn = 128 }
      local bf16 = moe.layer_memory(o)
      o.precision = "fp8"
      local fp8 = moe.layer_memory(o)
      -- 2 ranks x 4 experts x 3 x 128 x 256 values and the shared expert's 3 x 128 x 256, one byte
      -- each instead of two, plus an f32 scale per 128 x 128
      local values = 2 * 4 * 3 * 128 * 256 + 3 * 128 * 256
      assert.are.equal(bf16.weights - values + values / (128 * 128) * 4, fp8.weights)
      -- buffers: each rank's xs e4m3 instead of bf16 with its scales [H/128, C]; the tokens
      -- quantized for dispatch, and again for the shared expert, each with its scales
      local W, N, H, HB, C = 2, 2 * 12, 256, 2, fp8_layer(dev, o).capacity
      assert.are.equal(bf16.buffers + W * (HB * C * 4 - C * H) + 2 * (N * H + N * HB * 4), fp8.buffers)
    end)
  end)
end

describe("layer precision = 'fp8' graphs [#gpu]", function()
  if skip_without("cuda:0") then return end

  it("replays with routing that changes between replays, equal to eager forwards bit for bit", function()
    local layer = fp8_layer("cuda:0", { tokens = 64 })
    local g = layer:capture()
    local eager = fp8_layer("cuda:0", { tokens = 64 })
    local last
    for i = 1, 20 do
      local x = randn_x(layer, 100 + i)
      layer.input:copy(x)
      local replayed = g:replay():to("cpu")
      g:check()
      assert.tensor_equal(replayed, eager:forward(x):to("cpu"))
      local ids = layer.ids:to("cpu"):flat()
      if last then assert.are_not.same(last, ids) end
      last = ids
    end
    assert.is_true(layer:check(layer.input, { raise = false }).pass)
  end)
end)
