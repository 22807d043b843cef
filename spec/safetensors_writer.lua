-- SPDX-License-Identifier: MIT
-- Writes safetensors files and Hugging Face checkpoint directories for the suites, from the
-- format's definition alone (an 8-byte little-endian header length, the JSON header, the data).
-- Values are drawn as bit patterns and decoded here by arithmetic, so that what the reader
-- returns is held against a decode that shares nothing with it.  Not a suite (no _spec in the
-- name): the suites `require "safetensors_writer"`.
local W = {}

local floor = math.floor

-- ---------------------------------------------------------------- bytes

-- The n little-endian bytes of the integer u (0 <= u < 2^53).
function W.le(u, n)
  local b = {}
  for i = 1, n do
    b[i] = string.char(u % 256)
    u = floor(u / 256)
  end
  return table.concat(b)
end

-- The bytes of a list of unsigned integers, size bytes each.
function W.bytes(list, size)
  local out = {}
  for i, u in ipairs(list) do out[i] = W.le(u, size) end
  return table.concat(out)
end

-- ---------------------------------------------------------------- values of bit patterns

-- The value of a binary float's bits: sign, then ebits of exponent (bias 2^(ebits-1) - 1), then
-- mbits of mantissa, IEEE style (the largest exponent is infinity or NaN).
local function ieee(bits, ebits, mbits)
  local m_one, e_all = 2 ^ mbits, 2 ^ ebits - 1
  local sign = bits >= 2 ^ (ebits + mbits) and -1 or 1
  local rest = bits % 2 ^ (ebits + mbits)
  local e, m = floor(rest / m_one), rest % m_one
  local bias = 2 ^ (ebits - 1) - 1
  if e == e_all then return m == 0 and sign * math.huge or 0 / 0 end
  if e == 0 then return sign * (m / m_one) * 2 ^ (1 - bias) end -- a float 0 keeps the sign
  return sign * (1 + m / m_one) * 2 ^ (e - bias)
end
function W.bf16_value(bits) return ieee(bits, 8, 7) end
function W.f32_value(bits) return ieee(bits, 8, 23) end

-- OCP FP8 E4M3 (e4m3fn): bias 7, no infinities, S.1111.111 the only NaN.
function W.e4m3_value(q)
  local sign = q >= 128 and -1 or 1
  local e, m = floor(q % 128 / 8), q % 8
  if e == 15 and m == 7 then return 0 / 0 end
  if e == 0 then return sign * (m / 8) * 2 ^ -6 end -- a float 0 keeps the sign
  return sign * (1 + m / 8) * 2 ^ (e - 7)
end

-- x rounded to p significant bits, to nearest even, with exponents from emin (below it the
-- spacing of emin: subnormals) to emax (past it infinity).
local function round_bits(x, p, emin, emax)
  if x ~= x or x == 0 or x == math.huge or x == -math.huge then return x end
  local sign, a = x < 0 and -1 or 1, math.abs(x)
  local e = floor(math.log(a, 2))
  if 2 ^ e > a then e = e - 1 elseif 2 ^ (e + 1) <= a then e = e + 1 end
  if e < emin then e = emin end
  local ulp = 2 ^ (e - p + 1)
  local q = a / ulp
  local r = floor(q)
  if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1) then r = r + 1 end
  local v = r * ulp
  if v >= 2 ^ (emax + 1) then return sign * math.huge end
  return sign * v
end
function W.f32(x) return round_bits(x, 24, -126, 127) end
function W.bf16(x) return round_bits(x, 8, -126, 127) end

-- ---------------------------------------------------------------- a file

-- write(path, tensors [, o]): tensors is a list of {name =, dtype =, shape =, data = bytes} in
-- the order of their data.  o.header replaces the JSON header (its text as given), o.metadata
-- adds "__metadata__", o.cut drops that many bytes from the end of the file.
function W.header(tensors, o)
  local entries, offset = {}, 0
  if o and o.metadata then entries[1] = '"__metadata__":{"format":"pt"}' end
  for _, t in ipairs(tensors) do
    local dims = {}
    for i, d in ipairs(t.shape) do dims[i] = string.format("%d", d) end
    entries[#entries + 1] = string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', t.name, t.dtype,
      table.concat(dims, ","), offset, offset + #t.data)
    offset = offset + #t.data
  end
  return "{" .. table.concat(entries, ",") .. "}"
end

function W.write(path, tensors, o)
  o = o or {}
  local header = o.header or W.header(tensors, o)
  header = header .. string.rep(" ", (8 - #header % 8) % 8) -- as writers align the data
  local data = {}
  for i, t in ipairs(tensors) do data[i] = t.data end
  local text = W.le(#header, 8) .. header .. table.concat(data)
  if o.cut then text = text:sub(1, #text - o.cut) end
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

-- A fresh empty directory under /tmp.
function W.tempdir()
  local p = assert(io.popen("mktemp -d /tmp/moelab-ckpt.XXXXXX"))
  local dir = p:read("*l")
  p:close()
  assert(dir and dir ~= "", "mktemp -d failed")
  return dir
end

function W.remove(dir)
  assert(dir:match("^/tmp/moelab%-ckpt%.") ~= nil, "not a directory of W.tempdir: " .. dir)
  os.execute("rm -rf '" .. dir .. "'")
end

-- ---------------------------------------------------------------- random values

-- bf16 bits of a value of magnitude in [2^lo, 2^(hi+1)), either sign.
local function bf16_bits(lo, hi)
  return math.random(0, 1) * 32768 + (127 + math.random(lo, hi)) * 128 + math.random(0, 127)
end
local function f32_bits(lo, hi)
  return math.random(0, 1) * 2 ^ 31 + (127 + math.random(lo, hi)) * 2 ^ 23 + math.random(0, 2 ^ 23 - 1)
end

-- A tensor of n random bf16 (f32 with dtype "F32") values: {dtype, shape, data, values}.
local function float_tensor(dtype, shape, lo, hi)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  local bits, values = {}, {}
  local draw, value = bf16_bits, W.bf16_value
  if dtype == "F32" then draw, value = f32_bits, W.f32_value end
  for i = 1, n do
    bits[i] = draw(lo, hi)
    values[i] = value(bits[i])
  end
  return { dtype = dtype, shape = shape, data = W.bytes(bits, dtype == "F32" and 4 or 2), values = values }
end

-- The e4m3 codes a reader could get wrong, which every F8_E4M3 weight ends with (outside its zero
-- block): +-448 (the largest), negative zero, the smallest and largest subnormals of either sign,
-- the smallest normal.
W.E4M3_EDGES = { 0x7e, 0xfe, 0x80, 0x01, 0x07, 0x81, 0x87, 0x08 }

-- An F8_E4M3 weight [R, C] and its scale [ceil(R/128), ceil(C/128)]: random codes (no NaN) and
-- scales, where zero_block (a 1-based block {i, j}) holds codes 0 only and zero_scale is a block
-- whose scale is 0.  values: q x scale as an f32 product rounded to bf16, decoded independently.
local function fp8_tensor(shape, zero_block, zero_scale)
  local R, C = shape[1], shape[2]
  local SR, SC = math.ceil(R / 128), math.ceil(C / 128)
  local sbits, scales = {}, {}
  for i = 1, SR * SC do
    sbits[i] = f32_bits(-14, -11) % 2 ^ 31 -- positive, as real scales are
    scales[i] = W.f32_value(sbits[i])
  end
  if zero_scale then
    sbits[(zero_scale[1] - 1) * SC + zero_scale[2]], scales[(zero_scale[1] - 1) * SC + zero_scale[2]] = 0, 0
  end
  local q, values = {}, {}
  for r = 0, R - 1 do
    for c = 0, C - 1 do
      local i = r * C + c + 1
      local bi, bj = floor(r / 128), floor(c / 128)
      local code = math.random(0, 253)
      if code >= 127 then code = code + 1 end -- 0x7f and 0xff are NaN
      local edge = W.E4M3_EDGES[i - R * C + #W.E4M3_EDGES]
      if edge then code = edge end
      if zero_block and zero_block[1] == bi + 1 and zero_block[2] == bj + 1 then code = math.random(0, 1) * 128 end
      q[i] = code
      values[i] = W.bf16(W.f32(W.e4m3_value(code) * scales[bi * SC + bj + 1]))
    end
  end
  return { dtype = "F8_E4M3", shape = shape, data = W.bytes(q, 1), values = values, q = q },
    { dtype = "F32", shape = { SR, SC }, data = W.bytes(sbits, 4), values = scales }
end

-- ---------------------------------------------------------------- a checkpoint

-- checkpoint(dir, o) -> tensors: writes MoE layers in the names of DeepSeek-V3 and Kimi K2.
--   o.experts, o.hidden, o.ffn, o.shared_ffn (0: none); o.layers, the MoE layers (a dense layer 0
--   is written beside them); o.bias (default true): the router's e_score_correction_bias;
--   o.fp8: the experts' weights F8_E4M3 with their scales (the first expert's gate with a block
--   of zero codes, the second's up with a zero scale), or a function of a weight's name that says
--   whether that one is (the others BF16); o.shards: 1 writes model.safetensors,
--   more an index and that many files (each scale in the file after its weight's); o.seed;
--   o.change(tensors): edits the tensors before they are written (by name: {dtype, shape, data}).
-- Returns the tensors by name: {dtype, shape, data, values (decoded; FP8: dequantized)}.
function W.checkpoint(dir, o)
  math.randomseed(o.seed or 1)
  local E, H, F, Fs = o.experts, o.hidden, o.ffn, o.shared_ffn or 0
  local list, by = {}, {}
  local function add(name, t)
    t.name = name
    list[#list + 1] = t
    by[name] = t
  end
  local function weight(name, shape, i)
    local fp8 = o.fp8
    if type(fp8) == "function" then fp8 = fp8(name) end
    if not fp8 then return add(name, float_tensor("BF16", shape, -8, -3)) end
    local w, s = fp8_tensor(shape, i == 1 and { 1, 1 } or nil, i == 2 and { 1, 1 } or nil)
    add(name, w)
    add(name .. "_scale_inv", s)
  end
  add("model.embed_tokens.weight", float_tensor("BF16", { 4, H }, -4, -2))
  add("model.layers.0.mlp.gate_proj.weight", float_tensor("BF16", { 2, H }, -4, -2))
  for _, n in ipairs(o.layers) do
    local p = string.format("model.layers.%d.mlp.", n)
    add(p .. "gate.weight", float_tensor("BF16", { E, H }, -6, -2))
    if o.bias ~= false then add(p .. "gate.e_score_correction_bias", float_tensor("F32", { E }, -10, -7)) end
    for e = 0, E - 1 do
      weight(string.format("%sexperts.%d.gate_proj.weight", p, e), { F, H }, e == 0 and 1 or nil)
      weight(string.format("%sexperts.%d.up_proj.weight", p, e), { F, H }, e == 1 and 2 or nil)
      weight(string.format("%sexperts.%d.down_proj.weight", p, e), { H, F })
    end
    if Fs > 0 then
      weight(p .. "shared_experts.gate_proj.weight", { Fs, H })
      weight(p .. "shared_experts.up_proj.weight", { Fs, H })
      weight(p .. "shared_experts.down_proj.weight", { H, Fs })
    end
  end
  if o.change then o.change(by) end
  local shards = o.shards or 1
  if shards == 1 then
    W.write(dir .. "/model.safetensors", list, { metadata = true })
    return by
  end
  local files, map = {}, {}
  for i = 1, shards do files[i] = {} end
  local at = 0
  for _, t in ipairs(list) do
    if not t.name:match("_scale_inv$") then at = at % shards + 1 end
    local s = t.name:match("_scale_inv$") and at % shards + 1 or at
    local file = files[s]
    file[#file + 1] = t
    map[#map + 1] = string.format('"%s": "model-%05d-of-%05d.safetensors"', t.name, s, shards)
  end
  for i = 1, shards do
    W.write(string.format("%s/model-%05d-of-%05d.safetensors", dir, i, shards), files[i], { metadata = true })
  end
  local f = assert(io.open(dir .. "/model.safetensors.index.json", "wb"))
  f:write('{\n  "metadata": {"total_size": 0},\n  "weight_map": {\n    ', table.concat(map, ",\n    "), "\n  }\n}\n")
  f:close()
  return by
end

return W
