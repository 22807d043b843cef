-- SPDX-License-Identifier: MIT
-- The FP8 dense reference (lib/moelab.h, moe_reference_fp8) against the Lua model of
-- spec/fp8_model.lua bit for bit, and its argument errors.
local S = require "support"
local F8 = require "fp8_model"

local BLOCK = F8.BLOCK

-- Case c = {N, H, F, K, experts, world, Fs (0: no shared expert), seed} -> the model's inputs
-- (flat tables) and the tensors of core.reference_fp8.
local function inputs(c)
  math.randomseed(c.seed)
  local N, H, F, K, E, Wr = c.N, c.H, c.F, c.K, c.experts, c.world
  local EL, HB, FB = E / Wr, H / BLOCK, F / BLOCK
  local o = { x = {}, ids = {}, weights = {}, experts = E, world = Wr, w_gate_up = {}, w_gate_up_scale = {},
    w_down = {}, w_down_scale = {} }
  for i = 1, N * H do o.x[i] = S.bf16((math.random() - 0.5) * 4) end
  for i = 1, N * K do
    o.ids[i] = S.chance(0.2) and -1 or S.int(0, E - 1)
    o.weights[i] = S.f32(math.random())
  end
  for r = 1, Wr do
    o.w_gate_up[r] = F8.random_codes(EL * 2 * F * H)
    o.w_gate_up_scale[r] = F8.random_scales(EL * 2 * FB * HB, 2 ^ -9)
    o.w_down[r] = F8.random_codes(EL * H * F)
    o.w_down_scale[r] = F8.random_scales(EL * HB * FB, 2 ^ -9)
  end
  local t = { x = S.tensor(o.x, "bf16", { N, H }), ids = S.tensor(o.ids, "i32", { N, K }),
    weights = S.tensor(o.weights, "f32", { N, K }), out = S.tensor(S.filled(N * H, 0), "f32", { N, H }),
    world = Wr, experts = E, w_gate_up = {}, w_gate_up_scale = {}, w_down = {}, w_down_scale = {} }
  for r = 1, Wr do
    t.w_gate_up[r] = F8.tensor(o.w_gate_up[r], { EL, 2 * F, H })
    t.w_gate_up_scale[r] = S.tensor(o.w_gate_up_scale[r], "f32", { EL, 2 * FB, HB })
    t.w_down[r] = F8.tensor(o.w_down[r], { EL, H, F })
    t.w_down_scale[r] = S.tensor(o.w_down_scale[r], "f32", { EL, HB, FB })
  end
  if c.Fs > 0 then
    local FsB = c.Fs / BLOCK
    o.shared_gate_up, o.shared_gate_up_scale = F8.random_codes(2 * c.Fs * H), F8.random_scales(2 * FsB * HB, 2 ^ -9)
    o.shared_down, o.shared_down_scale = F8.random_codes(H * c.Fs), F8.random_scales(HB * FsB, 2 ^ -9)
    t.shared_gate_up = F8.tensor(o.shared_gate_up, { 1, 2 * c.Fs, H })
    t.shared_gate_up_scale = S.tensor(o.shared_gate_up_scale, "f32", { 1, 2 * FsB, HB })
    t.shared_down = F8.tensor(o.shared_down, { 1, H, c.Fs })
    t.shared_down_scale = S.tensor(o.shared_down_scale, "f32", { 1, HB, FsB })
  end
  return o, t
end

describe("reference_fp8 [#cpu]", function()
  local CASES = {
    { what = "one rank, three experts, masked routes", N = 3, H = 128, F = 128, K = 2, experts = 3, world = 1, Fs = 0,
      seed = 11 },
    { what = "two ranks, H 256, a shared expert", N = 2, H = 256, F = 128, K = 2, experts = 4, world = 2, Fs = 128,
      seed = 12 },
    { what = "no token", N = 0, H = 128, F = 128, K = 1, experts = 2, world = 1, Fs = 0, seed = 13 },
  }
  for _, c in ipairs(CASES) do
    it("equals the Lua model bit for bit: " .. c.what, function()
      local o, t = inputs(c)
      moe.core.reference_fp8(t)
      assert.tensor_equal(t.out:flat(), F8.reference(o, c.N, c.H, c.F, c.K, c.Fs))
    end)
  end

  describe("refuses", function()
    local c = CASES[1]
    local ROWS = {
      { "bf16 weights", function(t) t.w_gate_up[1] = S.tensor(S.filled(3 * 256 * 128, 0), "bf16", { 3, 256, 128 }) end,
        "w_gate_up%[0%] must be e4m3 %[3, _, 128%], got bf16 %[3, 256, 128%]" },
      { "F not a multiple of 128", function(t) t.w_gate_up[1] = F8.tensor(S.filled(3 * 64 * 128, 0), { 3, 64, 128 }) end,
        "w_gate_up%[0%] must be e4m3 %[3, 2F, 128%] %(F gate rows, then F up rows%) with F a multiple of 128" },
      { "H not a multiple of 128", function(t) t.x = S.tensor(S.filled(3 * 100, 0), "bf16", { 3, 100 }) end,
        "x's H %(100%) must be a multiple of 128 %(the FP8 block%)" },
      { "a scale of the wrong shape", function(t) t.w_down_scale[1] = S.tensor({ 1, 1, 1 }, "f32", { 3, 1, 1, 1 }) end,
        "w_down_scale%[0%] must be f32 %[3, 1, 1%], got f32 %[3, 1, 1, 1%]" },
      { "a shared expert without its scale", function(t)
          t.shared_gate_up = F8.tensor(S.filled(256 * 128, 0), { 1, 256, 128 })
          t.shared_down = F8.tensor(S.filled(128 * 128, 0), { 1, 128, 128 }) end,
        "shared_gate_up_scale must be f32 %[1, 2, 1%], got nothing" },
      { "an id past the experts", function(t) t.ids = S.tensor({ 0, 3, 1, 1, 2, 2 }, "i32", { 3, 2 }) end,
        "ids%[0, 1%] is 3, not an expert in %[0, 3%) nor %-1" },
    }
    for _, row in ipairs(ROWS) do
      it(row[1], function()
        local _, t = inputs(c)
        row[2](t)
        local ok, err = pcall(moe.core.reference_fp8, t)
        assert.is_false(ok)
        assert.matches("reference_fp8", tostring(err))
        assert.matches(row[3], tostring(err))
      end)
    end
  end)
end)
