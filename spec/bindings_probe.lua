-- SPDX-License-Identifier: MIT
-- Run by spec/luajit_spec.lua under Lua 5.4 (the C module) and under LuaJIT (moelab.ffi_core):
-- the same calls print the same lines through either binding -- every value of a layer's pass,
-- the tensors' properties, tensors over memory from elsewhere, the names of the module's functions
-- and of a tensor's methods, and the message (with its position) of each misuse below.
local moe = require "moelab"
local compat = require "moelab.compat"
local core = moe.core

-- Numbers as the bits of their f32 (every value here is one), so that a NaN's sign or the
-- printing of a tie cannot differ between the interpreters' formatters.
local function bits(v) return string.format("%08x", compat.f32_bits(v)) end
local function values(t)
  local s = {}
  for i, v in ipairs(t:flat()) do s[i] = bits(v) end
  return table.concat(s, " ")
end

-- a layer with every stage, its output, stats and check
local layer = moe.layer { model = "qwen3_5_397b", world = 4, tokens = 3, hidden = 32, ffn = 16, seed = 3, pad = 2 }
local x = moe.randn({ 4, 3, 32 }, { dtype = "bf16", seed = 2 })
local out = layer:forward(x)
print("out", tostring(out), values(out))
print("ids", values(layer.ids))
local st = layer:stats()
print("stats", st.rows_used, st.rows_needed, st.padding, st.max_load, bits(st.mean_load))
local m = layer:check(x, { raise = false })
print("check", m.pass, string.format("%.17g %.17g", m.rel_max, m.rel_l2))
print("reference", values(layer:reference(x, { tokens = { 0, 7 } })))

-- the FP8 layer: its output and its check against the FP8 reference
local layer8 = moe.layer { model = "kimi_k2", world = 2, tokens = 3, hidden = 128, ffn = 128, experts = 8, seed = 3,
  precision = "fp8" }
local x8 = moe.randn({ 2, 3, 128 }, { dtype = "bf16", seed = 4 })
print("fp8 out", values(layer8:forward(x8)))
local m8 = layer8:check(x8, { raise = false })
print("fp8 check", m8.pass, string.format("%.17g %.17g", m8.rel_max, m8.rel_l2))

-- tensors: every dtype in and out, views, properties
local t = moe.tensor({ { 1.5, -2 }, { 3, 2 ^ 24 + 1 } }, { dtype = "f32" })
print("f32", values(t), bits(t:get(4)), t.ndim, t:numel(), t:nbytes(), t.dtype, t.device)
print("bf16", values(moe.tensor({ 1 / 3, 0 / 0, -1 / 0, 65280 }, { dtype = "bf16" })))
print("i32", values(moe.tensor({ 2 ^ 31 - 1, -2 ^ 31, 0 }, { dtype = "i32" })))
local v = t:select(2)
print("view", tostring(v), values(v), v:overlaps(t), t:view(1, { 2 }):overlaps(v), moe.zeros({ 2 }):overlaps(t))
t:close()
print("closed", t.closed, tostring(t), bits(v:get(2)))
print("nested", #moe.zeros({ 2, 0, 3 }):totable()[1], type(moe.full({}, 7):totable()))

-- memory another library owns: a wrap of v's memory, and a DLPack round trip of the wrap
local w = moe.wrap { address = v:address(), dtype = "f32", shape = { 2 }, keep = v }
local d = moe.from_dlpack(w:to_dlpack { versioned = true }, { versioned = true })
print("interop", tostring(w), values(w), tostring(d), values(d), d:overlaps(v))

-- the interface: every function of the module and every method of a tensor
local function names(tbl)
  local s = {}
  for k in pairs(tbl) do s[#s + 1] = k end
  table.sort(s)
  return table.concat(s, " ")
end
print("core", names(core))
print("methods", names(core.Tensor))

-- misuse: the message of each, position included
local CASES = {
  function() moe.zeros({ 2, -1 }) end,
  function() moe.tensor({ { 1, 2 }, { 3 } }) end,
  function() moe.tensor({ 1.5 }, { dtype = "i32" }) end,
  function() moe.tensor({ 2 ^ 31 }, { dtype = "i32" }) end,
  function() moe.tensor({ 1, "a" }) end,
  function() moe.tensor({ { 1 }, 2 }) end,
  function() moe.tensor("x") end,
  function() return t.shape end,
  function() v:get(0) end,
  function() v:get(1.5) end,
  function() v:view(0, { 3 }) end,
  function() v:select(3) end,
  function() v:copy(moe.zeros({ 3 })) end,
  function() moe.zeros({ 2 }, { dtype = "f16" }) end,
  function() core.new("f16", { 2 }) end,
  function() core.new("f32", { 2 }, "tpu") end,
  function() core.route { ids = 1 } end,
  function() core.route(7) end,
  function() core.dispatch { out = v, x = v, peer_rank = v, peer_route = v, k = 2.5 } end,
  function() core.dispatch { out = v, x = v, peer_rank = v, peer_route = v, k = 1, zero_fill = 1 } end,
  function() core.schedule { } end,
  function() core.combine { out = v, weights = v, ids = v, world = 2, ys = { v } } end,
  function() core.experts { out = v, x = v, offsets = v, w_gate_up = v, w_down = v } end,
  function() core.experts { out = v, x = t, offsets = v, w_gate_up = v, w_down = v } end,
  function() core.experts_fp8 { out = v, x = v, x_scale = v, offsets = v, w_gate_up = v, w_gate_up_scale = v, w_down = v,
    w_down_scale = v } end,
  function() core.experts_fp8 { out = v, x = v } end,
  function() core.reference_fp8 { out = v, x = v, ids = v, weights = v, world = 1, w_gate_up = { v },
    w_gate_up_scale = { v }, w_down = { v }, w_down_scale = {}, experts = 1 } end,
  function() core.reference_fp8 { out = v, x = v, ids = v, weights = v, world = 1, w_gate_up = { v },
    w_gate_up_scale = { v }, w_down = { v }, w_down_scale = { v }, experts = 1 } end,
  function() core.logits(v, v, 1) end,
  function() core.config("nonesuch") end,
  function() core.config("experts_kernel", "nonesuch") end,
  function() core.device_count("tpu") end,
  function() core.world_compare_configs(0, { { tokens = 1 } }) end,
  function() core.world_compare_configs(0, { { tokns = 1 } }) end,
  function() core.world_open_local({}) end,
  function() moe.route { logits = moe.zeros({ 2, 4 }), k = 5 } end,
  function() moe.schedule { ids = moe.zeros({ 2, 2, 2 }, { dtype = "i32" }), experts = 3 } end,
  function() moe.experts { x = moe.zeros({ 2, 8 }, { dtype = "bf16" }), offsets = moe.zeros({ 2 }, { dtype = "i32" }),
    w_gate_up = moe.zeros({ 1, 8, 8 }, { dtype = "bf16" }), w_down = moe.zeros({ 1, 8, 3 }, { dtype = "bf16" }) } end,
  function() layer:forward(moe.zeros({ 4, 3, 32 })) end,
  function() moe.layer { model = "kimi_k2", tokens = 2, world = 5 } end,
  function() moe.check.close(moe.zeros({ 2 }), moe.full({ 2 }, 1)) end,
  function() core.raise("raised") end,
  function() core.safetensors("/nonexistent.safetensors") end,
  function() core.safetensors("lib/moelab.h") end,
  function() core.safetensors({}) end,
  function() return v[1] end,
  function() v[true] = 0 end,
  function() v.shape = { 4 } end,
  function() v.fill(0) end,
  function() v.numel() end,
  function() v.get(v, 1.5) end,
  function() moe.event("cpu").record() end,
  function() moe.event("cpu"):elapsed_since(5) end,
  function() moe.randn({ 2 }, { std = -1 }) end,
  function() core.device_memory("tpu") end,
  function() core.device_memory("cuda:999") end,
  function() core.nonfinite(v) end,
  function() core.nonfinite(v, v) end,
  function() core.wrap(-1, "f32", { 1 }) end,
  function() core.wrap(0, "f16", { 1 }) end,
  function() core.wrap(0, "f32", { 3 }) end,
  function() core.wrap(2, "f32", { 1 }) end,
  function() moe.wrap { address = true, dtype = "f32", shape = { 1 } } end,
  function() core.from_dlpack("x") end,
  function() core.from_dlpack(0, true) end,
  function() core.to_dlpack(5) end,
  function() v:to_dlpack { copy = true } end,
  function() core.world_open_comm(0, 0) end,
  function() core.world_open_comm(8, 2 ^ 40) end,
  function() moe.world { comm = 0, device = 0 } end,
}
for i, case in ipairs(CASES) do print("error " .. i, select(2, pcall(case))) end
