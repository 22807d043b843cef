-- SPDX-License-Identifier: MIT
-- Hugging Face checkpoints of MoE models, read into a layer's tensors.  A checkpoint is a
-- directory holding model.safetensors.index.json (its weight_map names the file of each tensor)
-- or a single model.safetensors, or that one file itself; its MoE layers carry the names of
-- DeepSeek-V3 and Kimi K2 (docs/design.md, "Checkpoints"), which this file maps onto moelab's
-- tensors: a rank's experts side by side, gate rows then up rows.  FP8 weights (F8_E4M3 with a
-- weight_scale_inv beside each) are dequantized to bf16 as they are read, but for the FP8 layer's
-- experts, which take their bytes and scales as they are (Loader:fp8_weight).
--
-- moe.checkpoint(path) opens one for reading tensors by name; moe.layer { checkpoint =, layer = }
-- loads a layer's weights through checkpoint.for_layer, which checks every tensor's name, dtype
-- and shape against the layer before anything is allocated.
local core = require "moelab.core"
local args = require "moelab.args"
local json = require "moelab.json"

local checkpoint = {}

local INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
local READABLE = { BF16 = "bf16", F16 = "bf16", F32 = "f32", F8_E4M3 = "bf16" } -- and the dtype each is read into
local BLOCK = 128 -- the side of an FP8 weight's blocks, each with one scale

-- ---------------------------------------------------------------- a checkpoint

-- safetensors(path) -> the reader of one file (moelab.SafeTensors; lua/core/safetensors.c).
function checkpoint.safetensors(path)
  if type(path) ~= "string" then args.fail("safetensors", "path must be a string, got " .. args.describe(path)) end
  return core.safetensors(path)
end

local Checkpoint = { __name = "moelab.Checkpoint" }
Checkpoint.__index = Checkpoint
checkpoint.Checkpoint = Checkpoint

local function readable(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- The weight_map of the index file at path: tensor name -> file name.
local function read_index(path, fname)
  local f, err = io.open(path, "rb")
  if not f then args.fail(fname, string.format("cannot read checkpoint index '%s': %s", path, err)) end
  local text = f:read("*a") or ""
  f:close()
  -- an index nests two objects deep: a tighter bound than json's refuses a hostile file early
  local index = json.decode_with(text, 64, function(what, at)
    args.fail(fname, string.format("checkpoint index '%s' is not valid JSON at byte %d: %s", path, at - 1, what))
  end)
  local map = type(index) == "table" and index.weight_map
  if type(map) ~= "table" then
    args.fail(fname, string.format("checkpoint index '%s' has no object \"weight_map\"", path))
  end
  for name, file in pairs(map) do
    if type(file) ~= "string" or not file:match("^[^/]+$") or file == "." or file == ".." then
      args.fail(fname, string.format("checkpoint index '%s' maps '%s' to %s, not the name of a file beside it", path,
        name, args.describe(file)))
    end
  end
  return map
end

-- open(path [, fname]) -> a Checkpoint: a directory (index or single file) or one .safetensors
-- file.  fname names the function in errors.
function checkpoint.open(path, fname)
  fname = fname or "checkpoint"
  if type(path) ~= "string" or path == "" then
    args.fail(fname, "the checkpoint must be a directory or a .safetensors file (a path), got " .. args.describe(path))
  end
  local self = setmetatable({ path = path, fname = fname, files = {} }, Checkpoint)
  if path:match("%.safetensors$") then self.single = path
  elseif readable(path .. "/" .. INDEX) then self.dir, self.map = path, read_index(path .. "/" .. INDEX, fname)
  elseif readable(path .. "/" .. SINGLE) then self.single = path .. "/" .. SINGLE
  else
    args.fail(fname, string.format("checkpoint '%s' holds neither %s nor %s", path, INDEX, SINGLE))
  end
  if self.single then self:file(self.single) end -- a file that cannot be read fails now
  return self
end

-- The open reader of the file at path (opened once, until close).
function Checkpoint:file(path)
  local f = self.files[path]
  if not f then
    f = core.safetensors(path)
    self.files[path] = f
  end
  return f
end

-- Closes the files; a later read opens them again.
function Checkpoint:close()
  for _, f in pairs(self.files) do f:close() end
  self.files = {}
end

-- The reader holding tensor name and its info {dtype, shape, offset, nbytes}; nothing when the
-- checkpoint has no such tensor.
function Checkpoint:locate(name)
  if not self.map then
    local f = self:file(self.single)
    local info = f:info(name)
    if info then return f, info end
    return nil
  end
  local file = self.map[name]
  if not file then return nil end
  local f = self:file(self.dir .. "/" .. file)
  local info = f:info(name)
  if not info then
    args.fail(self.fname, string.format("checkpoint index '%s/%s' maps '%s' to %s, which has no such tensor", self.dir,
      INDEX, name, file))
  end
  return f, info
end

-- Every tensor name, sorted.
function Checkpoint:names()
  if not self.map then return self:file(self.single):names() end
  local list = {}
  for name in pairs(self.map) do list[#list + 1] = name end
  table.sort(list)
  return list
end

-- The MoE layers, sorted: the N of every model.layers.N.mlp.gate.weight (a router).
function Checkpoint:layers()
  local list = {}
  for _, name in ipairs(self:names()) do
    local n = name:match("^model%.layers%.(%d+)%.mlp%.gate%.weight$")
    if n then list[#list + 1] = tonumber(n) end
  end
  table.sort(list)
  return list
end

-- "1-3, 7": a sorted list of integers in runs.
local function runs(list)
  local out, i = {}, 1
  while i <= #list do
    local j = i
    while j < #list and list[j + 1] == list[j] + 1 do j = j + 1 end
    out[#out + 1] = j > i and string.format("%d-%d", list[i], list[j]) or string.format("%d", list[i])
    i = j + 1
  end
  return table.concat(out, ", ")
end

-- The names of MoE layer n's tensors, DeepSeek-V3 and Kimi K2's.
local function layer_names(n)
  local p = string.format("model.layers.%d.mlp.", n)
  return {
    router = p .. "gate.weight",
    bias = p .. "gate.e_score_correction_bias",
    expert = function(e, proj) return string.format("%sexperts.%d.%s_proj.weight", p, e, proj) end,
    shared = function(proj) return string.format("%sshared_experts.%s_proj.weight", p, proj) end,
  }
end

-- Raises that layer n is not a MoE layer of the checkpoint, listing those that are.
function Checkpoint:no_layer(n, router)
  local have = self:layers()
  args.fail(self.fname, string.format("checkpoint '%s' has no MoE layer %d (no tensor '%s'); %s", self.path, n, router,
    #have > 0 and "its MoE layers: " .. runs(have) or "it holds no MoE layer (no model.layers.N.mlp.gate.weight)"))
end

-- sizes(n) -> {experts, hidden, ffn, shared_ffn (0: none), bias (whether it has the router's
-- e_score_correction_bias), dtype (the experts')} of MoE layer n, from its tensors' shapes.
function Checkpoint:sizes(n)
  if type(n) ~= "number" or n ~= math.floor(n) or n < 0 then
    args.fail(self.fname, "the layer must be an index N >= 0 of model.layers.N, got " .. args.describe(n))
  end
  local names = layer_names(n)
  local _, router = self:locate(names.router)
  if not router then self:no_layer(n, names.router) end
  local _, gate = self:locate(names.expert(0, "gate"))
  if not gate then
    args.fail(self.fname, string.format("checkpoint '%s' has no tensor '%s'", self.path, names.expert(0, "gate")))
  end
  local _, shared = self:locate(names.shared("gate"))
  local matrices = { { names.router, router }, { names.expert(0, "gate"), gate }, { names.shared("gate"), shared } }
  for _, t in ipairs(matrices) do
    if t[2] and #t[2].shape ~= 2 then
      args.fail(self.fname, string.format("checkpoint's %s is %s, not a matrix", t[1], args.shape_str(t[2].shape)))
    end
  end
  return { experts = router.shape[1], hidden = router.shape[2], ffn = gate.shape[1],
    shared_ffn = shared and shared.shape[1] or 0, bias = self:locate(names.bias) ~= nil, dtype = gate.dtype }
end

-- A tensor's info, checked: it exists, its dtype is readable, its shape is dims' (each named by
-- the layer's option it must equal: { {"ffn", F}, {"hidden", H} }; nil: any shape) and an
-- F8_E4M3 weight has its block scale.
-- -> the reader, the info, and the scale's reader and name (F8) or nil.
function Checkpoint:checked(name, dims)
  local f, info = self:locate(name)
  if not info then args.fail(self.fname, string.format("checkpoint '%s' has no tensor '%s'", self.path, name)) end
  if not READABLE[info.dtype] then
    args.fail(self.fname, string.format("checkpoint's %s is %s; moelab reads BF16, F16, F32 and F8_E4M3", name,
      info.dtype))
  end
  local want, same = {}, not dims or #info.shape == #dims
  for i, d in ipairs(dims or {}) do
    want[i] = d[2]
    same = same and info.shape[i] == d[2]
  end
  if not same then
    local opts = {}
    for i, d in ipairs(dims) do
      local seen = false
      for j = 1, i - 1 do seen = seen or dims[j][1] == d[1] end
      if not seen then opts[#opts + 1] = string.format("%s = %d", d[1], d[2]) end
    end
    args.fail(self.fname, string.format("checkpoint's %s is %s, the layer's %s want %s", name,
      args.shape_str(info.shape), table.concat(opts, " and "), args.shape_str(want)))
  end
  if info.dtype ~= "F8_E4M3" then return f, info end
  local scale_name = name .. "_scale_inv"
  local sf, sinfo = self:locate(scale_name)
  if not sinfo then
    args.fail(self.fname, string.format("checkpoint's %s is F8_E4M3 without its block scale '%s'", name, scale_name))
  end
  if #info.shape ~= 2 then
    args.fail(self.fname, string.format("checkpoint's %s is F8_E4M3 %s: moelab reads block scales of matrices only",
      name, args.shape_str(info.shape)))
  end
  local blocks = { math.ceil(info.shape[1] / BLOCK), math.ceil(info.shape[2] / BLOCK) }
  if #sinfo.shape ~= 2 or sinfo.shape[1] ~= blocks[1] or sinfo.shape[2] ~= blocks[2] or sinfo.dtype ~= "F32" then
    args.fail(self.fname, string.format("checkpoint's %s is %s %s, its weight %s in %dx%d blocks wants F32 %s",
      scale_name, sinfo.dtype, args.shape_str(sinfo.shape), args.shape_str(info.shape), BLOCK, BLOCK,
      args.shape_str(blocks)))
  end
  return f, info, sf, scale_name, sinfo
end

-- Tensor name (checked as Checkpoint:checked takes dims) into dst, dequantized where it is FP8.
function Checkpoint:read_into(name, dims, dst)
  local f, _, sf, scale_name, sinfo = self:checked(name, dims)
  local scale
  if sf then scale = sf:read(scale_name, core.new("f32", sinfo.shape, "cpu")) end
  return f:read(name, dst, scale)
end

-- tensor(name [, {dtype =, device =}]) -> the whole tensor, FP8 dequantized (bf16 by default; F32
-- tensors f32), on device (default cpu).
function Checkpoint:tensor(name, o)
  o = args.options(self.fname, o or {}, { dtype = { "bf16", "f32" }, device = "device" })
  local _, info = self:checked(name)
  return self:read_into(name, nil, core.new(o.dtype or READABLE[info.dtype], info.shape, o.device or "cpu"))
end

-- ---------------------------------------------------------------- a layer's weights

-- The weights of moe.layer from a checkpoint: made by the layer's init_weight, one tensor at a
-- time, on the device it asks for.
local Loader = { __name = "moelab.CheckpointLayer" }
Loader.__index = Loader

-- The shapes of layer n's tensors, each dimension named by the layer's option it must equal:
-- {name, dims} for every tensor the layer reads (the router's bias only where want.bias).
local function expected(names, want)
  local E, H, F, Fs = want.experts, want.hidden, want.ffn, want.shared_ffn
  local e, h, f, fs = { "experts", E }, { "hidden", H }, { "ffn", F }, { "shared_ffn", Fs }
  local list = { { names.router, { e, h } } }
  if want.bias then list[#list + 1] = { names.bias, { e } } end
  for x = 0, E - 1 do
    list[#list + 1] = { names.expert(x, "gate"), { f, h } }
    list[#list + 1] = { names.expert(x, "up"), { f, h } }
    list[#list + 1] = { names.expert(x, "down"), { h, f } }
  end
  if Fs > 0 then
    list[#list + 1] = { names.shared("gate"), { fs, h } }
    list[#list + 1] = { names.shared("up"), { fs, h } }
    list[#list + 1] = { names.shared("down"), { h, fs } }
  end
  return list
end

-- for_layer(o, want) -> the weights of layer o.layer of checkpoint o.checkpoint (moe.layer's
-- options), every tensor checked against want = {experts, hidden, ffn, shared_ffn, shared_gate,
-- bias, local_experts}; nil where neither option is given.
function checkpoint.for_layer(o, want)
  if o.checkpoint == nil then
    if o.layer ~= nil then
      args.fail("layer", "option 'layer' picks a layer of a checkpoint: give option 'checkpoint' too")
    end
    return nil
  end
  if o.layer == nil then
    args.fail("layer", "option 'checkpoint' needs option 'layer' (N of the checkpoint's model.layers.N)")
  end
  args.range("layer", "layer", o.layer, 0, nil)
  if want.shared_gate then
    args.fail("layer", "the shared expert's sigmoid gate (Qwen's shared_expert_gate) cannot be read from a checkpoint: "
      .. "give shared = false")
  end
  local ck = checkpoint.open(o.checkpoint, "layer")
  local names = layer_names(o.layer)
  if not ck:locate(names.router) then ck:no_layer(o.layer, names.router) end
  local dims = {}
  for _, t in ipairs(expected(names, want)) do
    ck:checked(t[1], t[2])
    dims[t[1]] = t[2]
  end
  return setmetatable({ ck = ck, layer = o.layer, names = names, dims = dims, want = want }, Loader)
end

-- An expert weight of rank (0-based) as the checkpoint's tensors make it: its shape [n, R, C] and
-- the tensors stacked along its rows, each {name, its first row of the n R}: per local expert F
-- gate rows, then F up rows.  nil for a weight that is not an expert's.
local function expert_pieces(self, name, rank)
  local w, names = self.want, self.names
  local H, F, Fs, EL = w.hidden, w.ffn, w.shared_ffn, w.local_experts
  local list = {}
  if name == "w_gate_up" then
    for j = 0, EL - 1 do
      list[#list + 1] = { names.expert(rank * EL + j, "gate"), j * 2 * F }
      list[#list + 1] = { names.expert(rank * EL + j, "up"), (j * 2 + 1) * F }
    end
    return { EL, 2 * F, H }, list
  elseif name == "w_down" then
    for j = 0, EL - 1 do list[#list + 1] = { names.expert(rank * EL + j, "down"), j * H } end
    return { EL, H, F }, list
  elseif name == "shared_gate_up" then
    return { 1, 2 * Fs, H }, { { names.shared("gate"), 0 }, { names.shared("up"), Fs } }
  elseif name == "shared_down" then
    return { 1, H, Fs }, { { names.shared("down"), 0 } }
  end
end

-- The layer's weight name (layer.lua's init_weight names), of 0-based rank (experts), on dev, in
-- bf16 (FP8 tensors dequantized).
function Loader:weight(name, dev, rank)
  local w, names, ck = self.want, self.names, self.ck
  local function read(tname, dst) return ck:read_into(tname, self.dims[tname], dst) end
  if name == "w_router" then return read(names.router, core.new("bf16", { w.experts, w.hidden }, dev)) end
  if name == "bias" then return read(names.bias, core.new("f32", { w.experts }, dev)) end
  local shape, pieces = expert_pieces(self, name, rank)
  if not shape then args.raise(string.format("layer: a checkpoint has no weight '%s'", name)) end
  local t, C = core.new("bf16", shape, dev), shape[3]
  for _, p in ipairs(pieces) do read(p[1], t:view(p[2] * C, { self.dims[p[1]][1][2], C })) end
  return t
end

-- Expert weight name of rank on dev as the FP8 layer holds it -> e4m3 [n, R, C] and its block
-- scales f32 [n, R/128, C/128] (R and C multiples of 128: the FP8 layer's rule).  An F8_E4M3
-- tensor's bytes and its weight_scale_inv are taken as they are, which keeps the checkpoint's own
-- quantization; any other dtype is read in bf16 and quantized (moe_quantize's blocks never
-- straddle two tensors, so this equals quantizing the whole weight).
function Loader:fp8_weight(name, dev, rank)
  local shape, pieces = expert_pieces(self, name, rank)
  local C, CB = shape[3], shape[3] / BLOCK
  local q, scale = core.new("e4m3", shape, dev), core.new("f32", { shape[1], shape[2] / BLOCK, CB }, dev)
  local x -- the bf16 staging of a tensor that is not FP8, made once
  for _, p in ipairs(pieces) do
    local f, info, sf, scale_name = self.ck:checked(p[1], self.dims[p[1]])
    local R = info.shape[1]
    local qv, sv = q:view(p[2] * C, { R, C }), scale:view(p[2] / BLOCK * CB, { R / BLOCK, CB })
    if sf then
      f:read(p[1], qv)
      sf:read(scale_name, sv)
    else
      x = x or core.new("bf16", { R, C }, dev)
      f:read(p[1], x)
      core.quantize { q = qv, scale = sv, x = x, kind = "block" }
    end
  end
  if x then x:close() end
  return q, scale
end

-- Closes the checkpoint's files (a later weight opens them again).
function Loader:release() self.ck:close() end

return checkpoint
