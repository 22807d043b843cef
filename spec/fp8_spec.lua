-- SPDX-License-Identifier: MIT
-- FP8: the e4m3 dtype, moe.quantize / moe.dequantize and moe.dispatch of e4m3 rows, each against
-- an implementation written here from the definitions (OCP e4m3fn; the scale rules of
-- docs/design.md, "FP8"), and the GPU against the CPU bit for bit.
local S = require "support"
local W = require "safetensors_writer"

local f32, bf16 = S.f32, S.bf16

-- ---------------------------------------------------------------- e4m3 written out

-- The value of a byte: sign, exponent (bias 7), mantissa; S.1111.111 is NaN.
local function decode(b)
  local neg = b >= 128
  local e, m = math.floor((b % 128) / 8), b % 8
  local v
  if e == 15 and m == 7 then return 0 / 0 end
  if e == 0 then v = m * 2 ^ -9 else v = (1 + m / 8) * 2 ^ (e - 7) end
  if neg then return -v end
  return v
end

-- The byte of x by search: the nearest of the 127 finite magnitudes, a tie to the even code;
-- 448 and up saturate; NaN is 0x7F; the sign is kept, -0 included.
local function encode(x)
  if x ~= x then return 0x7F end
  local sign = (x < 0 or 1 / x < 0) and 128 or 0
  local a = math.abs(x)
  if a >= 448 then return sign + 0x7E end
  local best, dist = 0, math.huge
  for c = 0, 0x7E do
    local d = math.abs(decode(c) - a)
    if d < dist or (d == dist and c % 2 == 0) then best, dist = c, d end
  end
  return sign + best
end

-- The bytes of an e4m3 tensor (any device), read through an i32 view of a padded copy.
local function bytes_of(t)
  local n = t:numel()
  local pad = moe.zeros({ math.ceil(n / 4) * 4 }, { dtype = "e4m3", device = t.device })
  if n > 0 then pad:view(0, { n }):copy(t:view(0, { n })) end
  local words = moe.wrap { address = pad:address(), dtype = "i32", shape = { math.ceil(n / 4) }, device = t.device,
    keep = pad }:to("cpu"):flat()
  local out = {}
  for i, w in ipairs(words) do
    if w < 0 then w = w + 2 ^ 32 end
    for k = 0, 3 do
      if #out < n then out[#out + 1] = math.floor(w / 256 ^ k) % 256 end
    end
  end
  return out
end

-- An e4m3 tensor [#list] holding the bytes of list.
local function e4m3_of(list, dev)
  local n = #list
  local t = moe.zeros({ math.ceil(n / 4) * 4 }, { dtype = "e4m3", device = dev or "cpu" })
  local words = {}
  for i = 1, #t.shape > 0 and t.shape[1] / 4 or 0 do
    local w = 0
    for k = 0, 3 do w = w + (list[(i - 1) * 4 + k + 1] or 0) * 256 ^ k end
    if w >= 2 ^ 31 then w = w - 2 ^ 32 end
    words[i] = w
  end
  moe.wrap { address = t:address(), dtype = "i32", shape = { #words }, device = t.device, keep = t }
    :copy(moe.tensor(words, { dtype = "i32" }))
  return t:view(0, { n })
end

local function same_bytes(got, want, what)
  assert.are.equal(#want, #got, what .. ": length")
  for i = 1, #want do
    if got[i] ~= want[i] then
      error(string.format("%s: byte %d is 0x%02X, expected 0x%02X", what, i, got[i], want[i]), 2)
    end
  end
end

-- One spec a row {what, call, words}: the call raises with those words, at the caller's line.
local function refusals(rows)
  for _, row in ipairs(rows) do
    it("refuses " .. row[1], function()
      local ok, err = pcall(row[2])
      assert.is_false(ok, "no error")
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
      assert.truthy(tostring(err):find("fp8_spec.lua:%d+:"), "the caller's line: " .. tostring(err))
    end)
  end
end

local function same_values(got, want, what)
  assert.are.equal(#want, #got, what .. ": length")
  for i = 1, #want do
    local g, w = got[i], want[i]
    local same = (g ~= g and w ~= w) or (g == w and (g ~= 0 or 1 / g == 1 / w))
    if not same then error(string.format("%s: element %d is %.9g, expected %.9g", what, i, g, w), 2) end
  end
end

describe("the e4m3 dtype [#cpu]", function()
  it("decodes all 256 bytes exactly (NaN at 0x7F and 0xFF, -0 at 0x80)", function()
    local all, want = {}, {}
    for b = 0, 255 do all[b + 1], want[b + 1] = b, decode(b) end
    local t = e4m3_of(all)
    same_bytes(bytes_of(t), all, "bytes")
    same_values(t:flat(), want, "decode")
    assert.are.equal(448, t:get(0x7E + 1))
    assert.are.equal(2 ^ -9, t:get(2))
  end)

  it("encodes as the search does: ties to even at every exponent, subnormals, saturation, NaN, -0", function()
    local xs = { 0, -0.0, 1, -1, 448, -448, 464, 480, 500, 1e30, 1 / 0, -1 / 0, 0 / 0, 2 ^ -9, 2 ^ -10, 3 * 2 ^ -10,
      2 ^ -11, 2 ^ -6, 2 ^ -7 * 1.5, 7.5 * 2 ^ -9, 2 ^ -20, -2 ^ -20, 447, 432, 440, 1e-45 }
    for e = -6, 8 do -- ties between neighbours, either parity; and just above and below each tie
      for m = 0, 7 do
        local lo = (1 + m / 8) * 2 ^ e
        local tie = lo + 2 ^ (e - 4)
        xs[#xs + 1] = tie
        xs[#xs + 1] = -tie
        xs[#xs + 1] = f32(tie * (1 + 2 ^ -20))
        xs[#xs + 1] = f32(tie * (1 - 2 ^ -20))
      end
    end
    math.randomseed(11)
    for _ = 1, 300 do xs[#xs + 1] = f32((math.random() - 0.5) * 2 ^ math.random(-14, 10)) end
    local want = {}
    for i, x in ipairs(xs) do want[i] = encode(f32(x)) end
    local t = moe.tensor(xs, { dtype = "e4m3" })
    same_bytes(bytes_of(t), want, "moe.tensor")
    for i, x in ipairs(xs) do
      assert.are.equal(want[i], bytes_of(moe.full({ 1 }, x, { dtype = "e4m3" }))[1], "fill " .. tostring(x))
    end
    -- the encoder itself: 464 is the tie between 448 and 480 (not a code), 0.5 x 2^-9 a tie to 0
    assert.are.same({ 0x7E, 0x7E, 0x00, 0x02, 0x80, 0x7F }, { encode(464), encode(447), encode(2 ^ -10),
      encode(3 * 2 ^ -10), encode(-0.0), encode(0 / 0) })
  end)

  it("randn is refused; fill, copy, views, to and nonfinite take it", function()
    local t = moe.zeros({ 4 }, { dtype = "e4m3" })
    local ok, err = pcall(t.randn, t, 1)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("randn: dtype must be f32 or bf16, got e4m3", 1, true), tostring(err))
    ok, err = pcall(moe.randn, { 2 }, { dtype = "e4m3" })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("option 'dtype' must be one of 'f32', 'bf16'", 1, true), tostring(err))
    t:fill(0.3)
    assert.are.same({ 0.3125, 0.3125, 0.3125, 0.3125 }, t:flat())
    assert.are.equal(1, t:nbytes() / t:numel())
    local u = moe.tensor({ 1, 0 / 0, -2, 0 / 0 }, { dtype = "e4m3" })
    local st = moe.zeros({ 2 }, { dtype = "i32" })
    moe.core.nonfinite(st, u)
    assert.are.same({ 2, 1 }, st:flat())
    t:copy(u)
    same_bytes(bytes_of(t:select(3)), { 0xC0 }, "copy, select")
    assert.are.equal("moelab.Tensor(e4m3 [4] on cpu)", tostring(t))
  end)

  it("goes through DLPack as kDLFloat8_e4m3fn and back", function()
    local t = moe.tensor({ 1, -0.5, 448, 2 ^ -9 }, { dtype = "e4m3" })
    local u = moe.from_dlpack(t:to_dlpack())
    assert.are.equal("e4m3", u.dtype)
    same_bytes(bytes_of(u), bytes_of(t), "round trip")
  end)

  it("reads F8_E4M3 from safetensors into e4m3 byte for byte; refuses a scale or another dtype there", function()
    local dir = W.tempdir()
    finally(function() W.remove(dir) end)
    local ts = W.checkpoint(dir, { experts = 1, hidden = 136, ffn = 132, layers = { 1 }, fp8 = true })
    local f = moe.safetensors(dir .. "/model.safetensors")
    local name = "model.layers.1.mlp.experts.0.down_proj.weight"
    local q = f:read(name, moe.zeros(ts[name].shape, { dtype = "e4m3" }))
    same_bytes(bytes_of(q), ts[name].q, name)
    local rows = {
      { name, moe.zeros(ts[name].shape, { dtype = "e4m3" }), moe.zeros({ 2, 2 }), "is read into e4m3 as it is, without a scale" },
      { "model.layers.1.mlp.gate.weight", moe.zeros({ 1, 136 }, { dtype = "e4m3" }), nil,
        "which reads into bf16 or f32; only F8_E4M3 reads into e4m3, got e4m3 [1, 136] on cpu" },
    }
    for _, row in ipairs(rows) do
      local ok, err = pcall(f.read, f, row[1], row[2], row[3])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[4], 1, true), tostring(err))
    end
  end)
end)

-- ---------------------------------------------------------------- quantize, written out

local KINDS = { "block", "token", "token_t" }

-- q bytes and scales of x (values of an f32/bf16 tensor of shape) as moe_quantize's contract says.
local function quantize_ref(xv, shape, kind)
  local nd = #shape
  local R, K = shape[nd - 1], shape[nd]
  local B = 1
  for d = 1, nd - 2 do B = B * shape[d] end
  local br = kind == "block" and 128 or 1
  local nbr, nbk = math.ceil(R / br), math.ceil(K / 128)
  local q, scale = {}, {}
  for b = 0, B - 1 do
    for i = 0, nbr - 1 do
      for j = 0, nbk - 1 do
        local amax = 0
        for r = i * br, math.min(R, (i + 1) * br) - 1 do
          for c = j * 128, math.min(K, (j + 1) * 128) - 1 do
            local v = xv[b * R * K + r * K + c + 1]
            if v == v and math.abs(v) > amax then amax = math.abs(v) end
          end
        end
        local s = kind == "block" and f32(amax / 448) or f32(math.max(amax, f32(1e-4)) / 448)
        local at = kind == "token_t" and j * nbr + i or b * nbr * nbk + i * nbk + j
        scale[at + 1] = s
        for r = i * br, math.min(R, (i + 1) * br) - 1 do
          for c = j * 128, math.min(K, (j + 1) * 128) - 1 do
            local n = b * R * K + r * K + c + 1
            q[n] = (s == 0 and xv[n] == xv[n]) and 0 or encode(f32(xv[n] / s)) -- NaN / 0 is NaN: 0x7F
          end
        end
      end
    end
  end
  return q, scale
end

-- The cases: {what, shape, kinds, values (a function of the flat index), dtype}
local function cases()
  math.randomseed(5)
  local function randoms(spread)
    local v = {}
    return function(i)
      v[i] = v[i] or (math.random() - 0.5) * 2 ^ math.random(-spread, spread)
      return v[i]
    end
  end
  return {
    { "random data", { 3, 200 }, KINDS, randoms(8) },
    { "random data, bf16, ragged 129 x 130", { 129, 130 }, KINDS, randoms(6), "bf16" },
    { "a batch of 3 and of 2 x 2", { 3, 5, 140 }, { "block" }, randoms(4) },
    { "4 dimensions", { 2, 2, 3, 129 }, { "block" }, randoms(4) },
    { "a block of zeros", { 2, 256 }, KINDS, function(i) return i <= 128 and 0 or i / 7 end },
    { "a block of zeros and one NaN (scale 0, the NaN kept)", { 2, 256 }, KINDS,
      function(i) return (i - 1) % 256 >= 128 and i / 7 or i == 60 and 0 / 0 or 0 end },
    { "one element", { 1, 1 }, KINDS, function() return -3.3 end },
    { "NaN inside a block", { 2, 130 }, KINDS, function(i) return (i == 5 or i == 200) and 0 / 0 or i - 100 end },
    { "a huge value", { 1, 256 }, KINDS, function(i) return i == 3 and 3e38 or -i end },
    { "tiny values (the token floor)", { 2, 128 }, KINDS, function(i) return i * 1e-9 end },
    -- whole 128-column blocks: the GPU's token kinds take four values a lane
    { "whole blocks, bf16, NaN in one", { 5, 384 }, KINDS,
      function(i) return i == 700 and 0 / 0 or (i % 37 - 18) * 2 ^ (i % 9 - 4) end, "bf16" },
    { "whole blocks, f32, one row", { 1, 512 }, KINDS, randoms(10) },
  }
end

local function input(c, dev)
  local shape, fn, dtype = c[2], c[4], c[5] or "f32"
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  local flat = {}
  for i = 1, n do flat[i] = fn(i) end
  return moe.tensor(flat, { dtype = dtype, shape = shape, device = dev })
end

describe("quantize and dequantize [#cpu]", function()
  for _, c in ipairs(cases()) do
    for _, kind in ipairs(c[3]) do
      it(c[1] .. ", kind " .. kind .. ": q and scale as written out, and back within half a step", function()
        local x = input(c, "cpu")
        local xv = x:flat()
        local q, scale = moe.quantize(x, { kind = kind })
        local want_q, want_s = quantize_ref(xv, x.shape, kind)
        same_values(scale:flat(), want_s, "scale")
        same_bytes(bytes_of(q), want_q, "q")
        -- dequantize: e4m3(q) x scale as an f32 product, rounded to the output
        local qv, sv = q:flat(), scale:flat()
        local nd = #x.shape
        local R, K = x.shape[nd - 1], x.shape[nd]
        local br = kind == "block" and 128 or 1
        local nbr, nbk = math.ceil(R / br), math.ceil(K / 128)
        for _, dtype in ipairs { "f32", "bf16" } do
          local got = moe.dequantize(q, scale, { kind = kind, dtype = dtype })
          assert.are.equal(dtype, got.dtype)
          local want = {}
          for n = 1, #qv do
            local b, r, col = math.floor((n - 1) / (R * K)), math.floor((n - 1) / K) % R, (n - 1) % K
            local i, j = math.floor(r / br), math.floor(col / 128)
            local s = sv[(kind == "token_t" and j * nbr + i or b * nbr * nbk + i * nbk + j) + 1]
            local v = f32(qv[n] * s)
            want[n] = dtype == "f32" and v or bf16(v)
          end
          same_values(got:flat(), want, "dequantize " .. dtype)
        end
        -- the round trip: within half an e4m3 step of the block (relative 2^-4, or 2^-10 x 448 s below 2^-6 x 448 s)
        local back = moe.dequantize(q, scale, { kind = kind }):flat()
        for n = 1, #xv do
          local v = xv[n]
          if v == v then
            local s = sv[1]
            local b, r, col = math.floor((n - 1) / (R * K)), math.floor((n - 1) / K) % R, (n - 1) % K
            local i, j = math.floor(r / br), math.floor(col / 128)
            s = sv[(kind == "token_t" and j * nbr + i or b * nbr * nbk + i * nbk + j) + 1]
            local bound = math.max(math.abs(v) * 2 ^ -4, s * 2 ^ -10) * 1.0001 + 1e-30
            assert(math.abs(back[n] - v) <= bound, string.format("element %d: %.9g back as %.9g", n, v, back[n]))
          else
            assert(back[n] ~= back[n], "NaN comes back NaN")
          end
        end
      end)
    end
  end

  it("an infinity makes its block's scale infinite: the block dequantizes to NaN, its neighbours do not", function()
    local row = {}
    for i = 1, 256 do row[i] = i % 2 == 0 and i or -i end
    row[3] = -1 / 0 -- in the first 128 columns
    for _, kind in ipairs { "block", "token" } do
      local q, scale = moe.quantize(moe.tensor({ row }), { kind = kind })
      local s, b = scale:flat(), bytes_of(q)
      assert.are.same({ math.huge, f32(256 / 448) }, s, kind)
      assert.are.equal(0x7F, b[3], kind .. ": -inf / inf is NaN") -- the one NaN code
      assert.are.same({ 0x80, 0x00 }, { b[1], b[2] }, kind .. ": finite / inf is -0 or +0")
      local back = moe.dequantize(q, scale, { kind = kind }):flat()
      for i = 1, 256 do
        if i <= 128 then assert(back[i] ~= back[i], kind .. ": element " .. i .. " NaN (0 x inf)")
        else assert(back[i] == back[i], kind .. ": element " .. i .. " finite") end
      end
    end
  end)

  it("writes into q and scale given, and into out given", function()
    local x = moe.tensor({ { 448, -224, 112 } }) -- scale 1: every value is a code
    local q, s = moe.zeros({ 1, 3 }, { dtype = "e4m3" }), moe.zeros({ 1, 1 })
    local q2, s2 = moe.quantize(x, { kind = "token", q = q, scale = s })
    assert.are.equal(q, q2)
    assert.are.equal(s, s2)
    local out = moe.zeros({ 1, 3 }, { dtype = "bf16" })
    assert.are.equal(out, moe.dequantize(q, s, { kind = "token", out = out }))
    assert.are.same({ { 448, -224, 112 } }, out:totable())
    assert.are.same({ { 1 } }, s:totable())
  end)

  -- argument errors: {what, function, pattern}
  local x = moe.zeros({ 2, 130 })
  local q = moe.zeros({ 2, 130 }, { dtype = "e4m3" })
  local st = moe.zeros({ 2, 2 })
  local rows = {
    { "quantize: no kind", function() moe.quantize(x, {}) end, "option 'kind' is required" },
    { "quantize: an unknown kind", function() moe.quantize(x, { kind = "row" }) end, "option 'kind' must be one of" },
    { "quantize: x not a tensor", function() moe.quantize(42, { kind = "token" }) end, "x must be a moelab.Tensor, got 42" },
    { "quantize: x i32", function() moe.quantize(moe.zeros({ 2, 3 }, { dtype = "i32" }), { kind = "token" }) end,
      "x must be f32 or bf16 of 2 dimensions [N, K] (kind token), got i32 [2, 3] on cpu" },
    { "quantize: x 1-D for block", function() moe.quantize(moe.zeros({ 5 }), { kind = "block" }) end,
      "x must have 2 to 4 dimensions [..., R, K] for kind 'block', got moelab.Tensor(f32 [5] on cpu)" },
    { "quantize: x 3-D for token", function() moe.quantize(moe.zeros({ 2, 2, 2 }), { kind = "token" }) end,
      "x must have 2 dimensions [N, K] for kind 'token'" },
    { "quantize: q of another shape", function() moe.quantize(x, { kind = "token", q = moe.zeros({ 2, 129 },
      { dtype = "e4m3" }) }) end, "q must be e4m3 [2, 130], got e4m3 [2, 129] on cpu" },
    { "quantize: q bf16", function() moe.quantize(x, { kind = "token", q = moe.zeros({ 2, 130 }, { dtype = "bf16" }) }) end,
      "q must be e4m3 [2, 130], got bf16 [2, 130] on cpu" },
    { "quantize: scale untransposed for token_t", function() moe.quantize(x, { kind = "token_t",
      scale = moe.zeros({ 1, 2 }) }) end,
      "scale must be f32 [2, 2] for q e4m3 [2, 130] on cpu (kind token_t: one per 128 columns and row, transposed), got f32 [1, 2]" },
    { "quantize: scale bf16", function() moe.quantize(x, { kind = "token", scale = moe.zeros({ 2, 2 }, { dtype = "bf16" }) }) end,
      "scale must be f32 [2, 2] for q e4m3 [2, 130] on cpu (kind token: one per row and 128 columns), got bf16 [2, 2]" },
    { "quantize: q over x", function() moe.quantize(x, { kind = "token", q = moe.wrap { address = x:address(),
      dtype = "e4m3", shape = { 2, 130 }, keep = x } }) end, "share" },
    { "dequantize: no kind", function() moe.dequantize(q, st, {}) end, "option 'kind' is required" },
    { "dequantize: dtype i32", function() moe.dequantize(q, st, { kind = "token", dtype = "i32" }) end,
      "option 'dtype' must be one of 'bf16', 'f32'" },
    { "dequantize: q f32", function() moe.dequantize(x, st, { kind = "token" }) end, "q must be e4m3 [2, 130], got f32" },
    { "dequantize: scale missing", function() moe.dequantize(q, nil, { kind = "token" }) end,
      "field 'scale': expected moelab.Tensor, got nil" },
    { "dequantize: out i32", function() moe.dequantize(q, st, { kind = "token", out = moe.zeros({ 2, 130 },
      { dtype = "i32" }) }) end, "option 'out' must be f32 or bf16, got moelab.Tensor(i32 [2, 130] on cpu)" },
    { "dequantize: out of another shape", function() moe.dequantize(q, st, { kind = "token", out = moe.zeros({ 130, 2 }) }) end,
      "option 'out' must be f32 [2, 130], got moelab.Tensor(f32 [130, 2] on cpu)" },
    { "dequantize: dtype against out", function() moe.dequantize(q, st, { kind = "token", dtype = "bf16",
      out = moe.zeros({ 2, 130 }) }) end, "option 'dtype' is 'bf16' but option 'out' is f32" },
    { "core.quantize: kind missing", function() moe.core.quantize { q = q, scale = st, x = x } end,
      "field 'kind': expected 'block', 'token' or 'token_t', got nil" },
    { "core.quantize: kind a number", function() moe.core.quantize { q = q, scale = st, x = x, kind = 1 } end,
      "field 'kind': expected 'block', 'token' or 'token_t', got number" },
  }
  refusals(rows)
end)

-- ---------------------------------------------------------------- dispatch of e4m3 rows

-- W ranks of T tokens, H wide, quantized per token: x bf16, q e4m3 [W, T, H], scale [W, T, H/128]
local function fp8_input(Wn, T, H, dev, seed)
  local x = moe.randn({ Wn * T, H }, { seed = seed, dtype = "bf16", device = dev })
  local q, s = moe.quantize(x, { kind = "token" })
  return q:view(0, { Wn, T, H }), s:view(0, { Wn, T, H / 128 })
end

local function random_ids(n, E, p_masked, seed)
  math.randomseed(seed)
  local ids = {}
  for i = 1, n do ids[i] = S.chance(p_masked) and -1 or S.int(0, E - 1) end
  return ids
end

describe("dispatch of e4m3 rows [#cpu]", function()
  for _, zero_fill in ipairs { false, true } do
    it("gathers rows and scales as written out, zero_fill " .. tostring(zero_fill), function()
      local Wn, T, K, E, H = 3, 5, 2, 6, 256
      local q, s = fp8_input(Wn, T, H, "cpu", 3)
      local sch = moe.schedule { ids = moe.tensor(random_ids(Wn * T * K, E, 0.2, 4), { dtype = "i32", shape = { Wn, T, K } }),
        experts = E, rank = 1, pad = 4 }
      local C = sch.capacity
      local out = moe.full({ C, H }, 3, { dtype = "e4m3" })
      local out_scale = moe.full({ H / 128, C }, -1)
      local o1, o2 = moe.dispatch { x = q, x_scale = s, schedule = sch, zero_fill = zero_fill, out = out,
        out_scale = out_scale }
      assert.are.equal(out, o1)
      assert.are.equal(out_scale, o2)
      local qb, sv = bytes_of(q), s:flat()
      local rank, route = sch.peer_rank:flat(), sch.peer_route:flat()
      local want_b, want_s, routed = {}, {}, 0
      for r = 0, C - 1 do
        local src = rank[r + 1] >= 0 and rank[r + 1] * T + math.floor(route[r + 1] / K) or -1
        if src >= 0 then routed = routed + 1 end
        for c = 0, H - 1 do
          want_b[r * H + c + 1] = src >= 0 and qb[src * H + c + 1] or zero_fill and 0 or 0x44 -- 3.0
        end
        for b = 0, H / 128 - 1 do
          want_s[b * C + r + 1] = src >= 0 and sv[src * (H / 128) + b + 1] or zero_fill and 0 or -1
        end
      end
      assert.is_true(routed > 0 and routed < C, "rows with and without a route")
      same_bytes(bytes_of(out), want_b, "out")
      same_values(out_scale:flat(), want_s, "out_scale")
    end)
  end

  it("equals moe.dispatch of the dequantized rows, masked ids and all (allocating out and out_scale)", function()
    local Wn, T, K, E, H = 2, 9, 3, 4, 384
    local q, s = fp8_input(Wn, T, H, "cpu", 8)
    local ids = random_ids(Wn * T * K, E, 0.3, 9)
    local sch = moe.schedule { ids = moe.tensor(ids, { dtype = "i32", shape = { Wn, T, K } }), experts = E, rank = 0 }
    local out, out_scale = moe.dispatch { x = q, x_scale = s, schedule = sch, zero_fill = true }
    assert.are.same({ sch.capacity, H }, out.shape)
    assert.are.same({ H / 128, sch.capacity }, out_scale.shape)
    local xd = moe.dequantize(q:view(0, { Wn * T, H }), s:view(0, { Wn * T, H / 128 }), { kind = "token", dtype = "bf16" })
    local want = moe.dispatch { x = xd:view(0, { Wn, T, H }), schedule = sch, zero_fill = true }
    assert.tensor_equal(moe.dequantize(out, out_scale, { kind = "token_t", dtype = "bf16" }), want)
  end)

  local Wn, T, H = 2, 3, 128
  local q, s = fp8_input(Wn, T, H, "cpu", 1)
  local sch = moe.schedule { ids = moe.tensor({ 0, 1, 1, 1, 0, 0 }, { dtype = "i32", shape = { 2, 3, 1 } }), experts = 2,
    rank = 1 }
  local C = sch.capacity
  local rows = {
    { "no x_scale", function() moe.dispatch { x = q, schedule = sch } end, "option 'x_scale' is required with an e4m3 x" },
    { "x_scale with bf16 x", function() moe.dispatch { x = moe.zeros({ 2, 3, 128 }, { dtype = "bf16" }), x_scale = s,
      schedule = sch } end, "option 'x_scale' goes with an e4m3 x; x is bf16" },
    { "out_scale with bf16 x", function() moe.dispatch { x = moe.zeros({ 2, 3, 128 }, { dtype = "bf16" }),
      out_scale = moe.zeros({ 1, C }), schedule = sch } end, "option 'out_scale' goes with an e4m3 x; x is bf16" },
    { "x_scale of another shape", function() moe.dispatch { x = q, x_scale = moe.zeros({ 2, 3, 2 }), schedule = sch } end,
      "x_scale must be f32 [2, 3, 1], got f32 [2, 3, 2] on cpu" },
    { "x_scale bf16", function() moe.dispatch { x = q, x_scale = moe.zeros({ 2, 3, 1 }, { dtype = "bf16" }), schedule = sch } end,
      "x_scale must be f32 [2, 3, 1], got bf16" },
    { "H not a multiple of 128", function() moe.dispatch { x = moe.zeros({ 2, 3, 64 }, { dtype = "e4m3" }),
      x_scale = moe.zeros({ 2, 3, 1 }), schedule = sch } end, "an e4m3 x's hidden size must be a multiple of 128" },
    { "out bf16", function() moe.dispatch { x = q, x_scale = s, schedule = sch, out = moe.zeros({ C, 128 }, { dtype = "bf16" }) } end,
      "out must be e4m3 [" .. C .. ", 128], got bf16" },
    { "out_scale untransposed", function() moe.dispatch { x = q, x_scale = s, schedule = sch,
      out_scale = moe.zeros({ C, 1 }) } end, "out_scale must be f32 [1, " .. C .. "], got f32 [" .. C .. ", 1]" },
    { "core: H 64", function() moe.core.dispatch_fp8 { out = moe.zeros({ C, 64 }, { dtype = "e4m3" }),
      out_scale = moe.zeros({ 0, C }), x = moe.zeros({ 2, 3, 64 }, { dtype = "e4m3" }), x_scale = moe.zeros({ 2, 3, 0 }),
      peer_rank = sch.peer_rank, peer_route = sch.peer_route, k = 1 } end,
      "the hidden size H (x's last dimension) must be a multiple of 128, got 64" },
    { "core: k 0", function() moe.core.dispatch_fp8 { out = moe.zeros({ C, 128 }, { dtype = "e4m3" }),
      out_scale = moe.zeros({ 1, C }), x = q, x_scale = s, peer_rank = sch.peer_rank, peer_route = sch.peer_route,
      k = 0 } end, "k must be >= 1, got 0" },
    { "core: out_scale missing", function() moe.core.dispatch_fp8 { out = moe.zeros({ C, 128 }, { dtype = "e4m3" }),
      x = q, x_scale = s, peer_rank = sch.peer_rank, peer_route = sch.peer_route, k = 1 } end,
      "field 'out_scale': expected moelab.Tensor, got nil" },
  }
  refusals(rows)
end)

-- ---------------------------------------------------------------- the GPU against the CPU

describe("FP8 on the GPU equals the CPU bit for bit [#gpu]", function()
  if skip_without("cuda:0") then return end
  local dev = "cuda:0"

  for _, c in ipairs(cases()) do
    for _, kind in ipairs(c[3]) do
      it("quantize and dequantize: " .. c[1] .. ", kind " .. kind, function()
        local qc, sc = moe.quantize(input(c, "cpu"), { kind = kind })
        local qg, sg = moe.quantize(input(c, dev), { kind = kind })
        same_bytes(bytes_of(qg), bytes_of(qc), "q")
        same_values(sg:to("cpu"):flat(), sc:flat(), "scale")
        for _, dtype in ipairs { "f32", "bf16" } do
          same_values(moe.dequantize(qg, sg, { kind = kind, dtype = dtype }):to("cpu"):flat(),
            moe.dequantize(qc, sc, { kind = kind, dtype = dtype }):flat(), "dequantize " .. dtype)
        end
      end)
    end
  end

  for _, kind in ipairs(KINDS) do
    for _, K in ipairs { 7168 + 64, 7168 } do
      it("quantize of a large random tensor, K " .. K .. ", kind " .. kind, function()
        local x = moe.randn({ 1000, K }, { seed = 2, std = 3, dtype = "bf16" })
        local qc, sc = moe.quantize(x, { kind = kind })
        local qg, sg = moe.quantize(x:to(dev), { kind = kind })
        assert.tensor_equal(sg:to("cpu"), sc)
        -- the bytes through their values (the tensor is too large for bytes_of's tables to be quick)
        assert.tensor_equal(qg:to("cpu"), qc)
      end)
    end
  end

  -- H 8960: 70 scale blocks a row, more than the GPU kernel's chunk of 64
  for _, zero_fill in ipairs { false, true } do for _, H in ipairs { 512, 8960 } do
    it("dispatch_fp8, H " .. H .. ", zero_fill " .. tostring(zero_fill), function()
      local Wn, T, K, E = 4, 33, 4, 16
      local ids = random_ids(Wn * T * K, E, 0.1, 12)
      local function run(d)
        local q, s = fp8_input(Wn, T, H, d, 6)
        local sch = moe.schedule { ids = moe.tensor(ids, { dtype = "i32", shape = { Wn, T, K }, device = d }), experts = E,
          rank = 2, pad = 8 }
        local out = moe.full({ sch.capacity, H }, 3, { dtype = "e4m3", device = d })
        local out_scale = moe.full({ H / 128, sch.capacity }, -1, { device = d })
        return moe.dispatch { x = q, x_scale = s, schedule = sch, zero_fill = zero_fill, out = out, out_scale = out_scale }
      end
      local og, sg = run(dev)
      local oc, sc = run("cpu")
      if H == 512 then same_bytes(bytes_of(og), bytes_of(oc), "out")
      else assert.tensor_equal(og:to("cpu"), oc) end -- through the values: too large for bytes_of to be quick
      same_values(sg:to("cpu"):flat(), sc:flat(), "out_scale")
    end)
  end end
end)
