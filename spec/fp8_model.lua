-- SPDX-License-Identifier: MIT
-- The FP8 experts and their inputs in plain Lua, for the suites (not a suite itself): e4m3
-- tensors from byte codes, the block-scale rules of lib/moelab.h, and a slow model of
-- moe_experts_fp8 written from its contract.  In exact mode every f32 operation is rounded to
-- f32 and each 128-block's sum is taken in the order lib/mlp.h fixes (element i into partial
-- sum i % 8, then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))), so the model gives the CPU
-- backend's bits; otherwise it sums in double and also returns, per output element, what the
-- tolerance of docs/design.md ("FP8 experts") is made of.
local S = require "support"
local W = require "safetensors_writer"

local M = {}
local f32, bf16, floor, abs = S.f32, S.bf16, math.floor, math.abs
local BLOCK, FP8_MAX, TOKEN_FLOOR = 128, 448, S.f32(1e-4)

M.BLOCK = BLOCK
M.value = W.e4m3_value -- code -> its exact value

-- x rounded to e4m3 (nearest, ties to even; saturating at 448; NaN stays NaN), from the format's
-- definition: 3 fraction bits, normal exponents down to -6, steps of 2^-9 below 2^-6.
function M.round(x)
  if x ~= x then return x end
  local sign, a = x < 0 and -1 or 1, abs(x)
  if a >= FP8_MAX then return sign * FP8_MAX end
  local step = 2 ^ -9
  while a >= step * 16 do step = step * 2 end -- a in [8 step, 16 step): 3 fraction bits
  local r = a / step
  local n = floor(r)
  if r - n > 0.5 or (r - n == 0.5 and n % 2 == 1) then n = n + 1 end
  return sign * n * step
end

-- The code of an e4m3 value (exact values only).
local CODE = {}
for q = 0, 255 do
  local v = W.e4m3_value(q)
  if v == v and CODE[v] == nil then CODE[v] = q end
end
CODE[0] = 0
function M.code(v) return v ~= v and 0x7F or assert(CODE[v], "not an e4m3 value") end

-- A tensor of e4m3 codes (a flat table of bytes) of the given shape: their bytes packed little
-- end first into an i32 tensor, viewed as e4m3 through moe.wrap (which keeps the i32 alive).
function M.tensor(codes, shape, dev)
  local words = {}
  for w = 1, math.max(1, math.ceil(#codes / 4)) do
    local u = 0
    for b = 3, 0, -1 do u = u * 256 + (codes[(w - 1) * 4 + b + 1] or 0) end
    words[w] = u >= 2 ^ 31 and u - 2 ^ 32 or u
  end
  local backing = S.tensor(words, "i32", { #words }, dev)
  return moe.wrap { address = backing:address(), dtype = "e4m3", shape = shape, device = dev or "cpu",
    keep = backing }
end

-- Random codes, never NaN: n of them, each magnitude code in [0, 0x7E].
function M.random_codes(n, max_code)
  local t = {}
  for i = 1, n do
    local c = math.random(0, max_code or 0x7E)
    t[i] = S.chance(0.5) and c + 128 or c
  end
  return t
end

-- n codes of a weight or activation block as moe_quantize makes them from normal values: std 100
-- puts the largest of a few hundred near 448, where a block's amax lands, and nothing is NaN.
function M.normal_codes(n)
  local t = {}
  for i = 1, n do
    local z = math.sqrt(-2 * math.log(1 - math.random())) * math.cos(2 * math.pi * math.random())
    t[i] = M.code(M.round(100 * z))
  end
  return t
end

-- Random positive scales (f32), n of them, around `around`.
function M.random_scales(n, around)
  local t = {}
  for i = 1, n do t[i] = f32(around * 2 ^ (math.random() * 2 - 1)) end
  return t
end

-- A token block's scale and values as MOE_QUANT_TOKEN makes them from v[i0 + 1 .. i0 + 128].
local function token_block(v, i0)
  local amax = 0
  for i = 1, BLOCK do
    local a = abs(v[i0 + i])
    if a > amax then amax = a end -- NaN compares false: ignored
  end
  local s = f32((amax > TOKEN_FLOOR and amax or TOKEN_FLOOR) / FP8_MAX)
  local q = {}
  for i = 1, BLOCK do q[i] = M.round(f32(v[i0 + i] / s)) end
  return s, q
end
M.token_block = token_block

-- The dot product of w[wo + 1 .. wo + n] and x[xo + 1 .. xo + n] (n = 128 by default).
local function block_dot(w, wo, x, xo, exact, n)
  n = n or BLOCK
  if not exact then
    local s = 0
    for i = 1, n do s = s + w[wo + i] * x[xo + i] end
    return s
  end
  local p = { 0, 0, 0, 0, 0, 0, 0, 0 }
  for i = 0, n - 1 do
    local l = i % 8 + 1
    p[l] = f32(p[l] + f32(w[wo + i + 1] * x[xo + i + 1])) -- exact already for two e4m3 values
  end
  return f32(f32(f32(p[1] + p[2]) + f32(p[3] + p[4])) + f32(f32(p[5] + p[6]) + f32(p[7] + p[8])))
end

-- acc[j] = sum_kb dot(w[j, kb], x[kb]) * (xs[kb] * ws[j / 128][kb]) for j < R; in double mode also
-- sum_abs[j] (the same with |products|) and max_abs[j] (the largest single |w x scale| term).
local function product(w, wo, ws, wso, x, xs, R, K, exact)
  local KB, acc, sum_abs, max_abs = K / BLOCK, {}, {}, {}
  for j = 0, R - 1 do
    local a, sa, ma = 0, 0, 0
    for kb = 0, KB - 1 do
      local scale = f32(xs[kb + 1] * ws[wso + floor(j / BLOCK) * KB + kb + 1])
      local d = block_dot(w, wo + j * K + kb * BLOCK, x, kb * BLOCK, exact)
      if exact then
        a = f32(a + f32(d * scale))
      else
        a = a + d * scale
        for i = 1, BLOCK do
          local t = abs(w[wo + j * K + kb * BLOCK + i] * x[kb * BLOCK + i]) * scale
          sa = sa + t
          if t > ma then ma = t end
        end
      end
    end
    acc[j + 1], sum_abs[j + 1], max_abs[j + 1] = a, sa, ma
  end
  return acc, sum_abs, max_abs
end

local function values(codes)
  local v = {}
  for i = 1, #codes do v[i] = W.e4m3_value(codes[i]) end
  return v
end

-- moe_experts_fp8 of o = {x, x_scale, offsets, w_gate_up, w_gate_up_scale, w_down, w_down_scale}
-- (flat tables: codes for the e4m3 ones, in the layouts of lib/moelab.h), C, H, F, EL and out
-- (the flat table of out's values before the call: rows outside the experts keep them) ->
-- out's values, and in double mode sum_abs and max_abs of the down projection per element.
function M.experts(o, C, H, F, EL, out, exact)
  local HB, FB = H / BLOCK, F / BLOCK
  local wgu, wd = values(o.w_gate_up), values(o.w_down)
  local res, sum_abs, max_abs = {}, {}, {}
  for i = 1, C * H do res[i] = out[i] end
  local function clamp(v) return v < 0 and 0 or v > C and C or v end
  local lo = clamp(o.offsets[1])
  for e = 0, EL - 1 do
    local hi = math.max(lo, clamp(o.offsets[e + 2]))
    for r = lo, hi - 1 do
      local x, xs = {}, {}
      for k = 1, H do x[k] = W.e4m3_value(o.x[r * H + k]) end
      for kb = 0, HB - 1 do xs[kb + 1] = o.x_scale[kb * C + r + 1] end
      local gu = product(wgu, e * 2 * F * H, o.w_gate_up_scale, e * 2 * FB * HB, x, xs, 2 * F, H, exact)
      local h = {}
      for j = 1, F do
        local g, u = f32(gu[j]), f32(gu[F + j])
        h[j] = bf16(f32(f32(g / f32(1 + f32(math.exp(-g)))) * u))
      end
      local hq, hs = {}, {}
      for fb = 0, FB - 1 do
        local s, q = token_block(h, fb * BLOCK)
        hs[fb + 1] = s
        for i = 1, BLOCK do hq[fb * BLOCK + i] = q[i] end
      end
      local y, sa, ma = product(wd, e * H * F, o.w_down_scale, e * HB * FB, hq, hs, H, F, exact)
      for i = 1, H do
        res[r * H + i] = bf16(f32(y[i]))
        sum_abs[r * H + i], max_abs[r * H + i] = sa[i], ma[i]
      end
    end
    lo = hi
  end
  return res, sum_abs, max_abs
end

-- The f32 weights of expert e (codes w [.., R, K], scales ws [.., R/128, K/128]) as the FP8
-- reference dequantizes them.
local function dequantized(w, ws, e, R, K)
  local v, KB = {}, K / BLOCK
  for r = 0, R - 1 do
    for k = 1, K do
      local s = ws[e * (R / BLOCK) * KB + floor(r / BLOCK) * KB + floor((k - 1) / BLOCK) + 1]
      v[r * K + k] = f32(W.e4m3_value(w[e * R * K + r * K + k]) * s)
    end
  end
  return v
end

-- v quantized per 128 (MOE_QUANT_TOKEN) and dequantized, every operation in f32.
local function token_qdq(v)
  local out = {}
  for b = 0, #v / BLOCK - 1 do
    local s, q = token_block(v, b * BLOCK)
    for i = 1, BLOCK do out[b * BLOCK + i] = f32(q[i] * s) end
  end
  return out
end

-- The f32 SwiGLU MLP of the FP8 reference on one input row x (already dequantized): h in f32,
-- quantized and dequantized, and mlp.h's order in every dot product.
local function reference_mlp(x, wgu, wd, H, F)
  local h = {}
  for j = 0, F - 1 do
    local g = block_dot(wgu, j * H, x, 0, true, H)
    local u = block_dot(wgu, (F + j) * H, x, 0, true, H)
    h[j + 1] = f32(f32(g / f32(1 + f32(math.exp(-g)))) * u)
  end
  local hq, y = token_qdq(h), {}
  for i = 0, H - 1 do y[i + 1] = block_dot(wd, i * F, hq, 0, true, F) end
  return y
end

-- moe_reference_fp8 of o = {x (bf16 values [N, H]), ids, weights ([N, K]), experts, world,
-- w_gate_up, w_gate_up_scale, w_down, w_down_scale (one flat table per rank), shared_gate_up,
-- shared_gate_up_scale, shared_down, shared_down_scale (flat, or nil)} without a shared gate,
-- every f32 operation rounded as the CPU rounds it -> out's values [N, H].
function M.reference(o, N, H, F, K, Fs)
  local EL = o.experts / o.world
  local experts, shared = {}, nil
  local function expert(e)
    if not experts[e] then
      local r, l = floor(e / EL) + 1, e % EL
      experts[e] = { dequantized(o.w_gate_up[r], o.w_gate_up_scale[r], l, 2 * F, H),
        dequantized(o.w_down[r], o.w_down_scale[r], l, H, F) }
    end
    return experts[e]
  end
  if o.shared_gate_up then
    shared = { dequantized(o.shared_gate_up, o.shared_gate_up_scale, 0, 2 * Fs, H),
      dequantized(o.shared_down, o.shared_down_scale, 0, H, Fs) }
  end
  local out = {}
  for n = 0, N - 1 do
    local x = {}
    for i = 1, H do x[i] = o.x[n * H + i] end
    local xq = token_qdq(x)
    local acc = {}
    for i = 1, H do acc[i] = 0 end
    for k = 1, K do
      local id = o.ids[n * K + k]
      if id >= 0 then
        local w = expert(id)
        local y = reference_mlp(xq, w[1], w[2], H, F)
        for i = 1, H do acc[i] = f32(acc[i] + f32(o.weights[n * K + k] * y[i])) end
      end
    end
    if shared then
      local y = reference_mlp(xq, shared[1], shared[2], H, Fs)
      for i = 1, H do acc[i] = f32(acc[i] + y[i]) end -- g = 1: 1 * y is y
    end
    for i = 1, H do out[n * H + i] = acc[i] end
  end
  return out
end

return M
