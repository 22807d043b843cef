-- SPDX-License-Identifier: MIT
-- Block-scaled e4m3 tensors from Lua: moe.quantize, moe.dequantize, and moe.dispatch of an e4m3 x
-- with its scales.  The C stages check every tensor (moe_quantize, moe_dispatch_fp8 in moelab.h);
-- this file checks what it needs to size the outputs it makes, and names the options.
local core = require "moelab.core"
local args = require "moelab.args"
local memory = require "moelab.memory"

local fp8 = {}

local KINDS = { "block", "token", "token_t" }
local BLOCK = 128

local function blocks(n) return math.floor((n + BLOCK - 1) / BLOCK) end

-- The shape of the scales of a tensor of shape under kind; fname's error where shape has a rank
-- the kind does not take (what names the tensor).
local function scale_shape(fname, what, t, kind)
  local shape, nd = t.shape, #t.shape
  if kind == "block" then
    if nd < 2 then
      args.fail(fname, string.format("%s must have 2 to 4 dimensions [..., R, K] for kind 'block', got %s", what,
        tostring(t)))
    end
    local s = {}
    for i = 1, nd - 2 do s[i] = shape[i] end
    s[nd - 1], s[nd] = blocks(shape[nd - 1]), blocks(shape[nd])
    return s
  end
  if nd ~= 2 then
    args.fail(fname, string.format("%s must have 2 dimensions [N, K] for kind '%s', got %s", what, kind, tostring(t)))
  end
  if kind == "token" then return { shape[1], blocks(shape[2]) } end
  return { blocks(shape[2]), shape[1] }
end

local function check_tensor(fname, what, t)
  if not args.is_tensor(t) then
    args.fail(fname, string.format("%s must be a moelab.Tensor, got %s", what, args.describe(t)))
  end
  if t.closed then args.fail(fname, string.format("%s is a closed moelab.Tensor", what)) end
  return t
end

-- quantize(x, {kind =, q =, scale =}) -> q, scale
function fp8.quantize(x, o)
  o = args.options("quantize", o or {}, { kind = KINDS, q = "tensor", scale = "tensor" }, { "kind" })
  check_tensor("quantize", "x", x)
  local want = {}
  if not o.q then want[#want + 1] = memory.buffer("q", "e4m3", x.shape, "the shape of x") end
  if not o.scale then
    want[#want + 1] = memory.buffer("scale", "f32", scale_shape("quantize", "x", x, o.kind), "the blocks of x")
  end
  local made = memory.new("quantize", want, x.device)
  local q, scale = o.q or made.q, o.scale or made.scale
  core.quantize { q = q, scale = scale, x = x, kind = o.kind }
  return q, scale
end

-- dequantize(q, scale, {kind =, dtype =, out =}) -> x
function fp8.dequantize(q, scale, o)
  o = args.options("dequantize", o or {}, { kind = KINDS, dtype = { "bf16", "f32" }, out = "tensor" }, { "kind" })
  check_tensor("dequantize", "q", q)
  args.same_dtype("dequantize", o.out, o.dtype)
  -- out is the C stage's x: checked here, so that an error names it as the caller does
  if o.out and o.out.dtype ~= "f32" and o.out.dtype ~= "bf16" then
    args.fail("dequantize", "option 'out' must be f32 or bf16, got " .. tostring(o.out))
  end
  if o.out then args.tensor("dequantize", "out", o.out, o.out.dtype, q.shape) end
  if o.out then args.same_device("dequantize", { out = o.out, q = q }, { "out", "q" }) end
  local out = o.out or memory.new("dequantize", { memory.buffer("out", o.dtype or "f32", q.shape, "the shape of q") },
    q.device).out
  core.dequantize { x = out, q = q, scale = scale, kind = o.kind }
  return out
end

-- moe.dispatch of an e4m3 x (o: its options, s: the checked schedule) -> out, out_scale
function fp8.dispatch(o, s, x)
  if o.x_scale == nil then
    args.fail("dispatch", "option 'x_scale' is required with an e4m3 x (f32 [W, T, H/128], as quantize's kind "
      .. "'token' makes per rank)")
  end
  local H = x.shape[3]
  if H % BLOCK ~= 0 then
    args.fail("dispatch", string.format("option 'x' is %s: an e4m3 x's hidden size must be a multiple of %d",
      tostring(x), BLOCK))
  end
  local want = {}
  if not o.out then
    want[#want + 1] = memory.buffer("out", "e4m3", { s.capacity, H }, "the schedule's capacity x the hidden size of x")
  end
  if not o.out_scale then
    want[#want + 1] = memory.buffer("out_scale", "f32", { H / BLOCK, s.capacity },
      "the hidden size of x in blocks of 128 x the schedule's capacity")
  end
  local made = memory.new("dispatch", want, x.device)
  local out, out_scale = o.out or made.out, o.out_scale or made.out_scale
  core.dispatch_fp8 { out = out, out_scale = out_scale, x = x, x_scale = o.x_scale, peer_rank = s.peer_rank,
    peer_route = s.peer_route, k = s.k, zero_fill = o.zero_fill or false }
  return out, out_scale
end

return fp8
