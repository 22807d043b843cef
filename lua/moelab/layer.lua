-- SPDX-License-Identifier: MIT
-- moe.layer{...}: one MoE layer over a world of W expert-parallel ranks, composed from the
-- stateless stages.  Every buffer is allocated when the layer is made, for a static capacity, so
-- a forward pass allocates nothing and (on a GPU) can be captured as a CUDA graph.
--
-- One pipeline -- route, agree on NaN, schedule, agree on the check, dispatch, experts, shared
-- expert, combine -- over stage objects planned once (moelab.stages: Router and SharedExpert per
-- shard, Experts per held rank; moelab.schedule: a Schedule per held rank), and over a world that
-- says only where a rank's buffers live and how tokens cross (dispatch and combine are its
-- methods: they are what differs between worlds):
--
--   world = W (a number, default 1): a simulated world, its W ranks side by side on one device
--     (option device).  Rank r's tokens are x[r], its experts [r*EL, (r+1)*EL).  forward(x) takes
--     x bf16 [W, T, H] and returns out [W, T, H].
--   world = moe.world{...}: a real world over NCCL, each rank this process holds on its own GPU,
--     tokens crossing in the direct exchange (world:exchange: windows read over NVLink; the FP8
--     layer's dispatch crosses in the all-gather one, world:dispatch_fp8).  forward
--     takes one x [T, H] per local rank -- layer.inputs, the exchange's windows, are not copied
--     again -- and returns one out [T, H] per local rank (a list, or the tensor itself when this
--     process holds one rank).
--
-- The buffers are kept per shard, the tokens one device routes (simulated: one shard of all W*T
-- tokens; real: one per local rank), and per held rank, a rank whose experts run here (simulated:
-- all W; real: the local ranks).  Outputs are views of the layer's own buffers, which the next
-- pass overwrites; closing a view leaves the layer whole.
local core = require "moelab.core"
local args = require "moelab.args"
local check = require "moelab.check"
local checkpoint = require "moelab.checkpoint"
local compat = require "moelab.compat"
local explain = require "moelab.explain"
local memory = require "moelab.memory"
local models = require "moelab.models"
local moe_device = require "moelab.device"
local route = require "moelab.route"
local schedule = require "moelab.schedule"
local stages = require "moelab.stages"
local world = require "moelab.world"

local Layer = { __name = "moelab.Layer" }
Layer.__index = Layer

-- The FP8 layer's check against moe_reference_fp8 (docs/design.md, "FP8 tolerance" derives them).
local FP8_RTOL, FP8_L2 = 5e-2, 2e-2

local SPEC = {
  model = "any", world = "any", tokens = "integer", hidden = "integer", ffn = "integer",
  experts = "integer", k = "integer", shared_ffn = "integer", shared_gate = "boolean", shared = "boolean",
  scoring = { "softmax", "sigmoid", "sqrtsoftplus" }, groups = "integer", topk_groups = "integer",
  scale = "number", pad = "integer", layout = { "roundrobin", "peer_major" }, capacity = "any",
  expert_capacity = "integer", overflow = { "error", "drop" }, invalid = { "error", "skip" },
  nan = { "error", "mask" }, router = { "tensor", "exact" }, device = "device", seed = "integer", checkpoint = "string", layer = "integer",
  memory_limit = "number", precision = { "bf16", "fp8" },
}
local MODEL_FIELDS = { "name", "experts", "k", "hidden", "ffn", "shared_ffn", "shared_gate", "scoring", "groups",
  "topk_groups", "scale" }
local MODEL_FIELD = {}
for _, f in ipairs(MODEL_FIELDS) do MODEL_FIELD[f] = true end

local function model_names()
  local names = {}
  for name in pairs(models) do names[#names + 1] = name end
  table.sort(names)
  return table.concat(names, ", ")
end

-- The options of moe.layer checked and resolved against the model: what both kinds of layer
-- (a simulated world on one device, a real one) are made of.
local function resolve(o)
  args.options("layer", o, SPEC, { "model", "tokens" })
  local real = getmetatable(o.world) == world.World and o.world or nil
  -- 2.0 counts, as for every integer option
  local world_n = not real and type(o.world) == "number" and compat.tointeger(o.world) or nil
  if o.world ~= nil and not real and not world_n then
    args.fail("layer", "option 'world' must be an integer (a simulated world of that many ranks) or a moe.world, got "
      .. args.describe(o.world))
  end
  if real and (real.handle == nil or compat.math_type(real.size) ~= "integer" or type(real.ranks) ~= "table"
      or type(real.devices) ~= "table") then -- the metatable alone: no world was made
    args.fail("layer", "option 'world' must be a moe.world made by moe.world{...}, got a table with its metatable "
      .. "but not its fields (handle, size, ranks, devices)")
  end
  local m = o.model
  if type(m) == "string" then
    if not models[m] then
      args.fail("layer", string.format("unknown model '%s'; expected one of: %s", m, model_names()))
    end
    m = models[m]
  elseif type(m) ~= "table" then
    args.fail("layer", "option 'model' must be a preset from moe.models or its name, got " .. args.describe(m))
  end
  args.plain("layer", "option 'model'", m)
  for key in pairs(m) do -- a misspelt field would be silently absent
    if not MODEL_FIELD[key] then
      args.fail("layer", string.format("the model has a field %s, not one of: %s", args.describe(key),
        table.concat(MODEL_FIELDS, ", ")))
    end
  end
  local cfg = {}
  for _, f in ipairs(MODEL_FIELDS) do cfg[f] = m[f] end
  for _, f in ipairs(MODEL_FIELDS) do if o[f] ~= nil then cfg[f] = o[f] end end
  -- an overridden router takes none of the model's settings that follow from the one replaced:
  -- its groups' count of kept groups, the groups of another scoring, softmax's missing scale
  if o.groups ~= nil and o.topk_groups == nil then cfg.topk_groups = nil end
  if o.scoring ~= nil and o.scoring ~= "sigmoid" and o.groups == nil then
    cfg.groups = nil
    if o.topk_groups == nil then cfg.topk_groups = nil end
  end
  if o.scoring == "softmax" and o.scale == nil then cfg.scale = nil end
  -- a model table's fields as strictly as the options of the same names
  local kinds = { name = "string" }
  for _, f in ipairs(MODEL_FIELDS) do kinds[f] = kinds[f] or SPEC[f] end
  args.options("layer", cfg, kinds)
  cfg.name, cfg.scoring = cfg.name or "custom", cfg.scoring or "softmax"
  cfg.groups, cfg.topk_groups = cfg.groups or 1, cfg.topk_groups or cfg.groups or 1
  cfg.scale, cfg.shared_ffn = cfg.scale or 1.0, cfg.shared_ffn or 0
  args.range("layer", "shared_ffn", cfg.shared_ffn, 0, nil) -- before shared = false sets it aside
  if o.shared == false then cfg.shared_ffn = 0 end
  if o.shared == true and cfg.shared_ffn == 0 then cfg.shared_ffn = cfg.ffn end
  if cfg.shared_ffn == 0 then
    if o.shared_gate then -- asked for, not a preset's setting that went with its shared expert
      args.fail("layer", "option 'shared_gate' gates the shared expert, and this layer has none (shared_ffn = 0 or "
        .. "shared = false)")
    end
    cfg.shared_gate = false
  end
  for _, f in ipairs { "experts", "k", "hidden", "ffn" } do
    if compat.math_type(cfg[f]) ~= "integer" then
      args.fail("layer", string.format("the model has no integer '%s' (got %s)", f, args.describe(cfg[f])))
    end
  end
  local W, T = real and real.size or world_n or 1, o.tokens
  args.range("layer", "world", W, 1, nil)
  args.range("layer", "tokens", T, 1, 0x7fffffff)
  args.range("layer", "hidden", cfg.hidden, 1, nil)
  args.range("layer", "ffn", cfg.ffn, 1, nil)
  args.range("layer", "experts", cfg.experts, 1, 0x7fffffff)
  args.range("layer", "k", cfg.k, 1, cfg.experts)
  -- the router's options, checked now rather than at the first forward
  args.options("layer", { scoring = cfg.scoring }, { scoring = SPEC.scoring })
  local ok, err = pcall(route.options, "layer", cfg.experts, cfg) -- its errors without a position
  if not ok then
    local name = tostring(err):match("option '([%w_]+)'")
    if name and o[name] == nil and m[name] ~= nil then -- a setting of the model's that the options did not give
      err = tostring(err):gsub("%)$", string.format("; the value is the model's (%s): an option of that name "
        .. "overrides it)", cfg.name), 1)
    end
    args.raise(err)
  end
  if cfg.experts % W ~= 0 then
    args.fail("layer", string.format("the %d experts cannot be split over a world of %d ranks (%d %% %d ~= 0)",
      cfg.experts, W, cfg.experts, W))
  end
  local E, K, H, F, Fs = cfg.experts, cfg.k, cfg.hidden, cfg.ffn, cfg.shared_ffn
  local EL = math.floor(E / W)
  local precision = o.precision or "bf16"
  if precision == "fp8" then
    for _, d in ipairs { { "hidden", H }, { "ffn", F }, { "shared_ffn", Fs } } do
      if d[2] % 128 ~= 0 then
        args.fail("layer", string.format("precision = 'fp8' needs %s a multiple of 128 (the FP8 block), got %d", d[1],
          d[2]))
      end
    end
  end
  local pad, capacity = schedule.rows("layer", o, W, T, K, EL, "twice_mean")
  schedule.check_expert_capacity("layer", o)
  args.range("layer", "memory_limit", o.memory_limit, 0)
  if real and o.device ~= nil then
    args.fail("layer", "a layer over a moe.world puts each rank on its own GPU: drop option 'device'")
  end
  local device = not real and (o.device or moe_device.default_device()) or nil
  args.available("layer", device)
  if device == "cuda" then device = "cuda:0" end -- as its tensors will name it
  local weights = checkpoint.for_layer(o, { experts = E, hidden = H, ffn = F, shared_ffn = Fs, local_experts = EL,
    shared_gate = cfg.shared_gate, bias = cfg.scoring ~= "softmax" })
  return {
    cfg = cfg, world = W, tokens = T, experts = E, local_experts = EL, k = K, hidden = H, ffn = F,
    shared_ffn = Fs, pad = pad, layout = o.layout or "roundrobin", capacity = capacity,
    expert_capacity = o.expert_capacity, overflow = o.overflow or "error", invalid = o.invalid or "error",
    nan = o.nan or "error", router = o.router or "tensor", device = device, seed = o.seed or 0, checkpoint = weights, memory_limit = o.memory_limit,
    precision = precision, fp8 = precision == "fp8",
  }, real
end

-- The layer's weights by name: dtype, shape and the seed rule's offset and std of each (std scaled
-- so that activations stay O(1)), as a moelab.memory buffer with those fields; rank: the 0-based
-- rank whose experts.  A checkpoint's tensors have the same dtypes and shapes.
local function weight(self, name, rank)
  local E, H, F, Fs, EL = self.experts, self.hidden, self.ffn, self.shared_ffn, self.local_experts
  local dtype, shape, offset, std, from = "bf16", nil, nil, nil, nil
  if name == "w_router" then shape, offset, std, from = { E, H }, 1, 1 / math.sqrt(H), "experts x hidden"
  elseif name == "bias" then dtype, shape, offset, std, from = "f32", { E }, 2, 0.005, "experts"
  elseif name == "shared_gate_up" then
    shape, offset, std, from = { 1, 2 * Fs, H }, 3, 1 / math.sqrt(H), "2 shared_ffn x hidden"
  elseif name == "shared_down" then shape, offset, std, from = { 1, H, Fs }, 4, 1 / math.sqrt(Fs), "hidden x shared_ffn"
  elseif name == "shared_gate_w" then shape, offset, std, from = { H }, 5, 1 / math.sqrt(H), "hidden"
  elseif name == "w_gate_up" then
    shape, offset, std, from = { EL, 2 * F, H }, 12 + 2 * rank, 1 / math.sqrt(H), "experts per rank x 2 ffn x hidden"
  elseif name == "w_down" then
    shape, offset, std, from = { EL, H, F }, 13 + 2 * rank, 1 / math.sqrt(F), "experts per rank x hidden x ffn"
  end
  local b = memory.buffer(name, dtype, shape, from)
  b.offset, b.std = offset, std
  return b
end

-- The one place the layer's weights come from: the checkpoint's tensors where it has one
-- (moelab.checkpoint), else the seed rule.  moe.randn draws the same values on every device, so
-- each device, and the CPU reference, draws the same weights.
local function init_weight(self, name, dev, rank)
  if self.checkpoint then return self.checkpoint:weight(name, dev, rank) end
  local w = weight(self, name, rank)
  return core.new(w.dtype, w.shape, dev):randn(self.seed * 1000 + w.offset, w.std)
end

-- An expert weight as the layer holds it: the bf16 buffer b itself, or for an FP8 layer its e4m3
-- values and their block scales (moe_quantize's MOE_QUANT_BLOCK: one f32 per 128 x 128), appended
-- to list.
local function expert_weight(self, list, b)
  if not self.fp8 then
    list[#list + 1] = b
    return list
  end
  local s = b.shape
  list[#list + 1] = memory.buffer(b.name, "e4m3", s, b.from .. " (e4m3)")
  list[#list + 1] = memory.buffer(b.name .. "_scale", "f32", { s[1], math.ceil(s[2] / 128), math.ceil(s[3] / 128) },
    "its block scales: one per 128 x 128")
  return list
end

-- The weights each shard holds (the router's, the shared expert's), and each held rank (its experts').
local function shard_weights(self)
  local list = { weight(self, "w_router") }
  if self.cfg.scoring ~= "softmax" then list[#list + 1] = weight(self, "bias") end
  if self.shared_ffn > 0 then
    expert_weight(self, list, weight(self, "shared_gate_up"))
    expert_weight(self, list, weight(self, "shared_down"))
    if self.cfg.shared_gate then list[#list + 1] = weight(self, "shared_gate_w") end
  end
  return list
end

local function held_weights(self, rank)
  return expert_weight(self, expert_weight(self, {}, weight(self, "w_gate_up", rank)), weight(self, "w_down", rank))
end

-- An expert weight on dev as the layer holds it: the bf16 tensor, or (FP8) its e4m3 values and
-- scales, quantized from it; a checkpoint's F8_E4M3 tensors are taken as they are (moelab.checkpoint).
local function init_expert_weight(self, name, dev, rank)
  if self.fp8 and self.checkpoint then return self.checkpoint:fp8_weight(name, dev, rank) end
  local w = init_weight(self, name, dev, rank)
  if not self.fp8 then return w end
  local q, scale = core.new("e4m3", w.shape, dev), core.new("f32", { w.shape[1], math.ceil(w.shape[2] / 128),
    math.ceil(w.shape[3] / 128) }, dev)
  core.quantize { q = q, scale = scale, x = w, kind = "block" }
  w:close()
  return q, scale
end

-- list with the buffers of more appended.
local function append(list, more)
  for _, b in ipairs(more) do list[#list + 1] = b end
  return list
end

-- lead's sizes followed by the others: {W, T} or {T} then K, H, ...
local function dims(lead, ...)
  local s = { compat.unpack(lead) }
  for _, d in ipairs { ... } do s[#s + 1] = d end
  return s
end

local as_rows = stages.as_rows

-- The buffers the layer itself makes for a shard (its output; the count of given routing weights
-- that are not finite) and for a held rank (the tokens its experts read).
local function own_shard_buffers(self, sh)
  local list = {
    memory.buffer("out", "bf16", dims(sh.lead, self.hidden), "the output: tokens x hidden"),
    memory.buffer("weight_stats", "i32", { 2 }, "the count of given routing weights that are not finite"),
  }
  if self.fp8 then -- the tokens quantized per token on their source rank, before dispatch
    list[3] = memory.buffer("xq", "e4m3", dims(sh.lead, self.hidden), "the FP8 tokens: tokens x hidden")
    list[4] = memory.buffer("xq_scale", "f32", dims(sh.lead, self.hidden / 128), "their scales: tokens x hidden / 128")
  end
  return list
end

local function own_held_buffers(self)
  if self.fp8 then
    return { memory.buffer("xs", "e4m3", { self.capacity, self.hidden }, "the experts' FP8 input: capacity x hidden"),
      memory.buffer("xs_scale", "f32", { self.hidden / 128, self.capacity }, "its scales: hidden / 128 x capacity") }
  end
  return { memory.buffer("xs", "bf16", { self.capacity, self.hidden }, "the experts' input: capacity x hidden") }
end

-- " of rank r" for a shard of one rank's tokens; nothing for the simulated world's shard of all.
local function rank_label(sh)
  return sh.rank and string.format(" of rank %d", sh.rank) or ""
end

-- forward{trace = true}: before each rank's share of a stage, an event on the device where held
-- rank j's work runs (shard j's; the simulated world's one shard), so that trace() can split the
-- stage into one span per rank.  A stage that one call makes for every rank (the router and the
-- shared expert of a simulated world) has no marks: its span is every rank's.
local function mark(self, j, rank)
  local tr = self.tracing
  if not tr then return end
  local i = self.shards[j] and j or 1
  local dev = self.shards[i].device
  local list = tr[tr.stage]
  local k = #list + 1
  self.trace_pool = self.trace_pool or {}
  local pool = self.trace_pool[tr.stage] or {}
  self.trace_pool[tr.stage] = pool
  if not pool[k] or pool[k].device ~= dev then pool[k] = { device = dev, event = core.event_new(dev) } end
  pool[k].event:record()
  list[k] = { shard = i, rank = rank, event = pool[k].event }
end

-- ---------------------------------------------------------------- worlds

-- A simulated world: W ranks side by side on one device, in this process.  Nothing to agree on
-- with other processes, and every rank's buffers at hand.
local Simulated = { lists = false, collective = false, sees_every_rank = true,
  REFERENCE_OPTIONS = { logits = "tensor", ids = "tensor", weights = "tensor", routing = { "own", "forward" },
    tokens = "table" } }
Simulated.__index = Simulated

-- Where the shards and held ranks of a layer (resolve's table) are, before anything is made.
function Simulated.layout(layer)
  local W, T, dev = layer.world, layer.tokens, layer.device
  local shards, held = { { device = dev, rows = W * T, lead = { W, T } } }, {}
  for r = 0, W - 1 do held[r + 1] = { device = dev, rank = r } end
  return shards, held
end

function Simulated.new(layer)
  local shards, held = Simulated.layout(layer)
  return setmetatable({ shards = shards, held = held }, Simulated)
end

-- What the world adds to a shard's buffers (nothing), and to a held rank's (where its experts write).
function Simulated.shard_buffers() return {} end
function Simulated.held_buffers(layer)
  return { memory.buffer("ys", "bf16", { layer.capacity, layer.hidden }, "the experts' output: capacity x hidden") }
end

function Simulated:bind() end
function Simulated:release() end
function Simulated:alloc_shard() end
function Simulated:schedule_ids() return self.shards[1].ids end
function Simulated:gather_ids() end
function Simulated:record_verdict() end

-- Each rank's experts write their own buffer; combine reads every rank's.  Each source rank's
-- combine arguments are made here once (views of the layer's own buffers), so that a pass makes
-- no tensor handles for them.
function Simulated:connect(layer)
  self.ys, self.route_rows = {}, {}
  for j, h in ipairs(self.held) do
    memory.alloc(Simulated.held_buffers(layer), h.device, h)
    self.ys[j], self.route_rows[j] = h.ys, h.schedule.route_row
  end
  local sh, W, T, H = self.shards[1], layer.world, layer.tokens, layer.hidden
  self.combines = {}
  for p = 1, W do
    self.combines[p] = { out = sh.out:select(p), weights = sh.weights:select(p), ids = sh.ids:select(p), ys = self.ys,
      route_row = self.route_rows, world = W, experts = layer.experts, rank = p - 1,
      shared = sh.shared_y and sh.shared_y:view((p - 1) * T * H, { T, H }),
      shared_gate = sh.gate and sh.gate:view((p - 1) * T, { T }) }
  end
end

-- x: the layer's input, as forward takes it (x bf16 [W, T, H] on the layer's device) -> {x}.
function Simulated:inputs(layer, fname, name, v, dtype, shape)
  args.tensor(fname, name, v, dtype, shape)
  if name == "x" and v.device ~= layer.device then
    args.fail(fname, string.format("x is on %s but the layer is on %s", v.device, layer.device))
  end
  return { v }
end

-- Nothing waits on another process: the first rank's error is raised at once.
function Simulated:agree(own)
  for j = 1, #self.held do if own[j] then args.raise(own[j]) end end
end

function Simulated:dispatch(layer, x)
  local sh = self.shards[1]
  if layer.fp8 then -- each token quantized once, on its source rank, whichever ranks it goes to
    core.quantize { q = as_rows(sh.xq), scale = as_rows(sh.xq_scale), x = as_rows(x[1]), kind = "token" }
  end
  for j, h in ipairs(self.held) do
    mark(layer, j, h.rank)
    local s = h.schedule
    if layer.fp8 then
      core.dispatch_fp8 { out = h.xs, out_scale = h.xs_scale, x = sh.xq, x_scale = sh.xq_scale, peer_rank = s.peer_rank,
        peer_route = s.peer_route, k = layer.k, zero_fill = false }
    else
      core.dispatch { out = h.xs, x = x[1], peer_rank = s.peer_rank, peer_route = s.peer_route, k = layer.k,
        zero_fill = false }
    end
  end
end

function Simulated:combine(layer)
  for p, a in ipairs(self.combines) do
    mark(layer, 1, p - 1)
    core.combine(a)
  end
end

function Simulated:capture_input(layer)
  layer.input = layer.input or core.new("bf16", { layer.world, layer.tokens, layer.hidden }, layer.device)
  return layer.input
end

function Simulated:can_capture(layer)
  if layer.device == "cpu" then
    args.raise("layer:capture: CUDA graphs need a layer on a cuda device (this one is on cpu)")
  end
end

function Simulated:describe(layer)
  return string.format("moelab.Layer(%s on %s: world %d, %d tokens per rank)", layer.cfg.name, layer.device,
    layer.world, layer.tokens), "  combine   top-k in order, f32 accumulation, bf16 out"
end

-- A real world (moe.world): each rank this process holds on its own GPU, the others in other
-- processes.  What a rank decides alone would leave the others waiting in the next collective, so
-- the build and every verdict are agreed by all ranks.
local Real = { lists = true, collective = true, sees_every_rank = false,
  REFERENCE_OPTIONS = { routing = { "own", "forward" }, sample = "integer" } }
Real.__index = Real

-- Every rank must build the same layer: a mismatch fails on every rank, naming the field.
local function agree_on_build(layer, group, why)
  local cfg, n = layer.cfg, group.local_count
  local cfgs = {}
  for i = 1, n do
    cfgs[i] = { tokens = layer.tokens, k = layer.k, experts = layer.experts, hidden = layer.hidden,
      capacity = layer.capacity, pad = layer.pad, layout = layer.layout, expert_capacity = layer.expert_capacity }
  end
  group:check_config(n == 1 and cfgs[1] or cfgs)
  -- and the model itself, which check_config (the exchange's sizes) does not see: ranks built
  -- with another seed or FFN width would compute a different layer without a word
  local fields, values = {}, {}
  local function field(name, v) fields[#fields + 1], values[#values + 1] = name, v end
  local function index(list, v) for j, s in ipairs(list) do if s == v then return j end end return 0 end
  field("ffn", layer.ffn)
  field("shared_ffn", layer.shared_ffn)
  field("shared_gate", cfg.shared_gate and 1 or 0)
  field("scoring", index({ "softmax", "sigmoid", "sqrtsoftplus" }, cfg.scoring))
  field("groups", cfg.groups)
  field("topk_groups", cfg.topk_groups)
  field("scale", compat.f32_bits(cfg.scale)) -- an i32 all the same: scale > 0 leaves the sign bit clear
  -- bits 0..30 and 31..61 of the seed's two's complement, by arithmetic (LuaJIT's bit ops are 32-bit)
  field("seed (low 31 bits)", layer.seed % 0x80000000)
  field("seed (high bits)", math.floor(layer.seed / 0x80000000) % 0x80000000)
  field("overflow", index({ "error", "drop" }, layer.overflow))
  field("invalid", index({ "error", "skip" }, layer.invalid))
  field("nan", index({ "error", "mask" }, layer.nan))
  field("checkpoint layer (-1: none)", layer.checkpoint and layer.checkpoint.layer or -1)
  field("memory", why and 0 or 1) -- not compared: a rank that cannot hold the layer stops them all
  local mine, all = {}, {}
  for i = 1, n do
    mine[i] = core.from_table({ values }, "i32", group.devices[i])
    all[i] = core.new("i32", { layer.world, 1, #values }, group.devices[i])
  end
  group:allgather_ids(mine, all)
  group:bind(1) -- the read back goes on the stream of the all-gather
  local got = all[1]:flat()
  group:unbind()
  if why then args.fail("layer", why) end
  for r = 0, layer.world - 1 do
    if got[(r + 1) * #fields] == 0 then
      args.fail("layer", string.format("rank %d cannot hold this layer in its GPU's memory (its own error says how "
        .. "much it needs)", r))
    end
  end
  for r = 1, layer.world - 1 do
    for j, name in ipairs(fields) do
      if name == "memory" then break end
      if got[r * #fields + j] ~= got[j] then
        args.fail("layer", string.format("ranks 0 and %d build different layers: '%s' is %d on rank 0, %d on rank %d "
          .. "(every rank must give moe.layer the same options)", r, name, got[j], got[r * #fields + j], r))
      end
    end
  end
end

function Real.layout(layer, group)
  local shards, held = {}, {}
  for i, dev in ipairs(group.devices) do
    shards[i] = { device = dev, rank = group.ranks[i], rows = layer.tokens, lead = { layer.tokens } }
    held[i] = { device = dev, rank = group.ranks[i] }
  end
  return shards, held
end

-- why: this process's refusal for want of memory, or nil; every rank learns every rank's verdict.
function Real.new(layer, group, why)
  agree_on_build(layer, group, why)
  local shards, held = Real.layout(layer, group)
  return setmetatable({ group = group, ranks = group.ranks, devices = group.devices, shards = shards, held = held },
    Real)
end

-- A shard's verdicts and the all-gathered ids; a held rank's exchange windows (NCCL symmetric
-- memory that world:exchange makes, sized here as lib/world.c lays it out, pages aside).
function Real.shard_buffers(layer)
  local W, T, K = layer.world, layer.tokens, layer.k
  return {
    memory.buffer("verdict", "i32", { 1, 2 }, "this rank's verdict"),
    memory.buffer("verdicts", "i32", { W, 1, 2 }, "every rank's verdict"),
    memory.buffer("all_ids", "i32", { W, T, K }, "world x tokens x k"),
  }
end
-- The FP8 layer's dispatch gathers every rank's e4m3 tokens and scales (world:dispatch_fp8): the
-- windows hold bf16 rows, so its tokens cross in the all-gather exchange.
local function fp8_exchange_buffers(layer)
  if not layer.fp8 then return {} end
  local W, T, H = layer.world, layer.tokens, layer.hidden
  return { memory.buffer("xq_all", "e4m3", { W, T, H }, "every rank's FP8 tokens: world x tokens x hidden"),
    memory.buffer("xq_scale_all", "f32", { W, T, H / 128 }, "their scales: world x tokens x hidden / 128") }
end
function Real.held_buffers(layer)
  local W, T, K, H = layer.world, layer.tokens, layer.k, layer.hidden
  local list = fp8_exchange_buffers(layer)
  table.insert(list, 1, memory.buffer("window x", "bf16", { T, H }, "the exchange's tokens: tokens x hidden"))
  table.insert(list, 2, memory.buffer("window ys", "bf16", { layer.capacity, H },
    "the exchange's expert outputs: capacity x hidden"))
  table.insert(list, 3, memory.buffer("window route_row", "i32", { W, T * K },
    "the exchange's route rows: world x tokens x k"))
  return list
end

function Real:bind(i) self.group:bind(i) end
function Real:release() self.group:unbind() end

-- {NaN rows, schedule failed} of this rank, then every rank's; and every rank's ids, scheduled here
function Real:alloc_shard(layer, sh)
  memory.alloc(Real.shard_buffers(layer), sh.device, sh)
end

function Real:schedule_ids(j) return self.shards[j].all_ids end

function Real:gather_ids()
  local ids, all = {}, {}
  for i, sh in ipairs(self.shards) do ids[i], all[i] = sh.ids, sh.all_ids end
  self.group:allgather_ids(ids, all)
end

-- The exchange's windows: experts write their output straight into ys; tokens written into
-- layer.inputs (its x windows) are not copied again by dispatch.
function Real:connect(layer)
  self.exchange = self.group:exchange { tokens = layer.tokens, k = layer.k, hidden = layer.hidden,
    capacity = layer.capacity }
  for j, h in ipairs(self.held) do
    h.ys = self.exchange.ys[j]
    memory.alloc(fp8_exchange_buffers(layer), h.device, h)
  end
  layer.exchange, layer.inputs, layer.group = self.exchange, self.exchange.x, self.group
end

-- One value per local rank: a list, or the tensor itself when this process holds one rank.
function Real:inputs(_, fname, name, v, dtype, shape)
  local n, list = #self.shards, v
  if args.is_tensor(v) then
    if n ~= 1 then args.fail(fname, string.format("'%s' needs one tensor per local rank (%d), got one", name, n)) end
    list = { v }
  end
  if type(list) ~= "table" or #list ~= n then
    args.fail(fname, string.format("'%s' must be a list of %d tensors (one per local rank), got %s", name, n,
      args.describe(v)))
  end
  for i, t in ipairs(list) do
    args.tensor(fname, string.format("%s[%d]", name, i), t, dtype, shape)
    if t.device ~= self.devices[i] then
      args.fail(fname, string.format("%s[%d] is on %s but local rank %d (rank %d) is on %s", name, i, t.device, i,
        self.ranks[i], self.devices[i]))
    end
  end
  return list
end

function Real:record_verdict(j, nan, failed)
  self.shards[j].verdict:copy(core.from_table({ { nan, failed } }, "i32", "cpu"))
end

-- The words of a forward's refusal of given routing weights that are not finite (st: the
-- shard's weight_stats, {count, first flat index}).
local function weights_error(self, sh, st)
  local K, T = self.k, self.tokens
  local route = math.floor(st[2] / K) -- a token of the shard, over its ranks
  return string.format("layer: forward: option 'weights' holds %d value%s that %s NaN or infinite, the first at rank "
    .. "%d, token %d, slot %d: routing weights given to a layer must be finite (nan = 'mask' masks rows the router "
    .. "cannot score, not given weights)", st[1], st[1] == 1 and "" or "s", st[1] == 1 and "is" or "are",
    sh.rank or math.floor(route / T), route % T, st[2] % K)
end

-- Every rank's verdict gathered: this process's own errors first, else the first rank that stopped.
function Real:agree(own)
  local verdicts, all = {}, {}
  for i, sh in ipairs(self.shards) do verdicts[i], all[i] = sh.verdict, sh.verdicts end
  self.group:allgather_ids(verdicts, all)
  for i = 1, #self.shards do if own[i] then args.raise(own[i]) end end
  self.group:bind(1)
  local v = self.shards[1].verdicts:flat()
  for r = 0, #v / 2 - 1 do
    if v[2 * r + 1] > 0 or v[2 * r + 2] > 0 then
      args.raise(string.format("layer: rank %d stopped this forward (%s); its own error says why", r,
        v[2 * r + 1] > 0 and "its routing: router logits with NaN or unscorable rows, or given weights not finite"
        or "its schedule: capacity overflow or invalid ids"))
    end
  end
end

function Real:dispatch(layer, x)
  local calls = {}
  if layer.fp8 then -- each rank quantizes its own tokens, on its stream, before they cross
    for i, h in ipairs(self.held) do
      local sh = self.shards[i]
      self.group:bind(i)
      core.quantize { q = sh.xq, scale = sh.xq_scale, x = x[i], kind = "token" }
      calls[i] = { x = sh.xq, x_scale = sh.xq_scale, schedule = h.schedule, out = h.xs, out_scale = h.xs_scale,
        x_all = h.xq_all, x_scale_all = h.xq_scale_all }
    end
    self.group:dispatch_fp8(calls)
    return
  end
  for i, h in ipairs(self.held) do calls[i] = { x = x[i], schedule = h.schedule, out = h.xs } end
  self.exchange:dispatch(calls)
end

function Real:combine()
  local calls = {}
  for i, h in ipairs(self.held) do
    local sh = self.shards[i]
    calls[i] = { schedule = h.schedule, y = h.ys, weights = sh.weights, ids = sh.ids, out = sh.out,
      shared = sh.shared_y, shared_gate = sh.gate }
  end
  self.exchange:combine(calls)
end

function Real:capture_input(layer) return layer.inputs end

-- A graph captures one GPU's stream: one rank per process.
function Real:can_capture()
  if #self.shards ~= 1 then
    args.raise(string.format("layer:capture: this process holds %d ranks; a graph captures one GPU's stream, so "
      .. "capture with one rank per process (moe.world{rank=, size=, ...})", #self.shards))
  end
end

function Real:describe(layer)
  local here = {}
  for i, sh in ipairs(self.shards) do here[i] = string.format("rank %d on %s", sh.rank, sh.device) end
  return string.format("moelab.Layer(%s over a world of %d GPUs; here: %s; %d tokens per rank)", layer.cfg.name,
    layer.world, table.concat(here, ", "), layer.tokens), layer.fp8
    and "  exchange  dispatch: all-gather of the e4m3 tokens and their scales; combine: direct, top-k in order"
    or "  exchange  direct: windows read over NVLink, top-k combined in order"
end

-- How tokens cross, for layer:plan(): the direct exchange, but for the FP8 layer's dispatch.
function Real:exchange_choice(layer)
  if layer.fp8 then
    return explain.parse("allgather\ndirect: its windows hold bf16 rows, none e4m3\nallgather: every rank's e4m3 "
      .. "tokens and their scales to every rank (world:dispatch_fp8); combine stays direct")
  end
  return explain.parse("direct\ndirect: windows read over NVLink, for dispatch and combine")
end
function Simulated.exchange_choice() end

-- ---------------------------------------------------------------- the layer

-- A buffer of every shard, in shard order.
local function shard_list(self, name)
  local list = {}
  for i, sh in ipairs(self.shards) do list[i] = sh[name] end
  return list
end

-- The buffers of a shard and of a held rank, under the names the layer shows them by: one
-- tensor each in a simulated world (its one shard), a list of one per local rank in a real one.
local SHARD_FIELDS = { "w_router", "bias", "shared_gate_up", "shared_down", "shared_gate_w", "logits", "ids",
  "weights", "route_stats", "out", "shared_y", "shared_offsets", "gate", "all_ids", "verdict", "verdicts",
  "shared_gate_up_scale", "shared_down_scale", "xq", "xq_scale" }
local HELD_FIELDS = { w_gate_up = "w_gate_up", w_down = "w_down", schedules = "schedule", xs = "xs", ys = "ys",
  route_rows = "route_row", w_gate_up_scale = "w_gate_up_scale", w_down_scale = "w_down_scale", xs_scale = "xs_scale" }
-- A shard's names for its stages' buffers (the worlds and the reference read them by these names).
local ROUTER_FIELDS = { logits = "logits", ids = "ids", weights = "weights", route_stats = "stats_tensor" }
local SHARED_EXPERT_FIELDS = { shared_gate_up = "w_gate_up", shared_down = "w_down", shared_gate_w = "gate_w",
  shared_gate_up_scale = "w_gate_up_scale", shared_down_scale = "w_down_scale",
  shared_y = "ys", shared_offsets = "offsets", gate = "gate" }

-- The buffers a caller can reach through the layer's fields must all be open: one closed would
-- fail inside a stage under the stage's name for it, or in this file.  Closing the view forward
-- returns is harmless; closing layer.out is not.
local function usable(self, fname)
  local function open(t, path)
    if t ~= nil and t.closed then
      args.raise(string.format("layer:%s: the layer's buffer %s is closed; a layer's buffers must stay open while "
        .. "it is used (closing a view of one, as forward returns, is harmless): make a new layer", fname, path))
    end
  end
  local lists = self.space.lists
  local function path(name, i)
    return (lists or i > 1) and string.format("layer.%s[%d]", name, i) or "layer." .. name
  end
  for _, name in ipairs(SHARD_FIELDS) do
    for i, sh in ipairs(self.shards) do open(sh[name], path(name, i)) end
  end
  for name, key in pairs(HELD_FIELDS) do
    for j, h in ipairs(self.held) do
      if key == "schedule" then
        for _, f in ipairs(schedule.TENSORS) do
          if f ~= "ids" then open(h.schedule[f], string.format("layer.schedules[%d].%s", j, f)) end
        end
      else
        open(h[key], string.format("layer.%s[%d]", name, j))
      end
    end
  end
  if not lists then open(self.input, "layer.input") end
end

local function fields_of(sh, stage, names)
  for name, key in pairs(names) do sh[name] = stage[key] end
end

-- ---------------------------------------------------------------- memory

-- Everything a layer (resolve's table) over the world class World will allocate, without
-- allocating: {[device] = {weights =, buffers =}} in bytes, and the devices in order.  The lists
-- are the ones Layer.new allocates from (the stages' buffers(), the layer's own, the world's), so
-- the estimate cannot drift from the allocation.
local function sizes(self, World, group)
  local shards, held = World.layout(self, group)
  local W, T, K, EL, C = self.world, self.tokens, self.k, self.local_experts, self.capacity
  local per, order = {}, {}
  local function add(dev, part, list)
    if not per[dev] then per[dev], order[#order + 1] = { weights = 0, buffers = 0 }, dev end
    per[dev][part] = per[dev][part] + memory.bytes("layer", list)
  end
  for _, sh in ipairs(shards) do
    add(sh.device, "weights", shard_weights(self))
    local list = stages.Router.buffers { lead = sh.lead, experts = self.experts, k = K }
    if self.shared_ffn > 0 then
      append(list, stages.SharedExpert.buffers { rows = sh.rows, hidden = self.hidden, gated = self.cfg.shared_gate,
        fp8 = self.fp8 })
    end
    add(sh.device, "buffers", append(append(list, own_shard_buffers(self, sh)), World.shard_buffers(self)))
  end
  for _, h in ipairs(held) do
    add(h.device, "weights", held_weights(self, h.rank))
    add(h.device, "buffers", append(append(schedule.buffers(W, T, K, EL, C), own_held_buffers(self)),
      World.held_buffers(self)))
  end
  return per, order
end

-- Why a device cannot hold its part d ({weights =, buffers =}) of the layer, what to change.
local function refusal(self, dev, d, words)
  local advice
  if d.buffers > d.weights then
    advice = "pass fewer tokens or a smaller capacity"
  elseif dev == "cpu" then
    advice = "pass smaller hidden and ffn (the scenarios' CPU sizes: hidden = 256, ffn = 128), or run it on a GPU"
  else
    advice = "pass smaller hidden and ffn, or spread the experts over more GPUs (world = moe.world{...})"
  end
  return string.format("the layer %s: its weights take %s (hidden = %d, ffn = %d, %d experts%s), its buffers %s "
    .. "(world = %d, tokens = %d, capacity = %d rows); %s, or state another budget with memory_limit = bytes", words,
    memory.size(d.weights), self.hidden, self.ffn, self.experts,
    self.shared_ffn > 0 and string.format(", shared_ffn = %d", self.shared_ffn) or "", memory.size(d.buffers),
    self.world, self.tokens, self.capacity, advice)
end

-- The layer's memory, {host =, device = (the most on one GPU), weights =, buffers =,
-- reference_host = (what the CPU reference adds on the host: every rank's weights, for a layer on
-- GPUs)} in bytes, and the refusal where a device cannot hold its part (within memory_limit, or
-- what it has free now), else nil.
local function size_up(self, World, group)
  local per, order = sizes(self, World, group)
  local m, why = { host = 0, device = 0, weights = 0, buffers = 0, reference_host = 0 }, nil
  for _, dev in ipairs(order) do
    local d = per[dev]
    local need = d.weights + d.buffers
    if dev == "cpu" then m.host = m.host + need else m.device = math.max(m.device, need) end
    m.weights, m.buffers = m.weights + d.weights, m.buffers + d.buffers
    local fits, words = memory.fits(need, dev, self.memory_limit)
    if not fits and not why then why = refusal(self, dev, d, words) end
  end
  if self.device ~= "cpu" then
    m.reference_host = memory.bytes("layer", shard_weights(self))
      + self.world * memory.bytes("layer", held_weights(self, 0))
  end
  return m, why
end

-- moe.layer_memory{...}: moe.layer's options -> the layer's memory (size_up), nothing allocated.
function Layer.memory_of(o)
  local r, group = resolve(o)
  if r.checkpoint then r.checkpoint:release() end -- its shapes are the layer's: nothing to read
  return (size_up(r, group and Real or Simulated, group))
end

function Layer.new(o)
  local r, group = resolve(o)
  local self = setmetatable(r, Layer)
  self.times = {}
  local why
  self.memory, why = size_up(self, group and Real or Simulated, group)
  if why and not group then args.fail("layer", why) end
  local space = group and Real.new(self, group, why) or Simulated.new(self)
  self.space, self.shards, self.held = space, space.shards, space.held
  if group then self.device = group.devices[1] end
  local E, K, H, C, cfg = self.experts, self.k, self.hidden, self.capacity, self.cfg
  for _, sh in ipairs(self.shards) do
    sh.w_router = init_weight(self, "w_router", sh.device)
    if cfg.scoring ~= "softmax" then sh.bias = init_weight(self, "bias", sh.device) end
  end
  for _, h in ipairs(self.held) do
    h.w_gate_up, h.w_gate_up_scale = init_expert_weight(self, "w_gate_up", h.device, h.rank)
    h.w_down, h.w_down_scale = init_expert_weight(self, "w_down", h.device, h.rank)
  end
  for _, sh in ipairs(self.shards) do
    local dev = sh.device
    if self.shared_ffn > 0 then
      local gu, gu_scale = init_expert_weight(self, "shared_gate_up", dev)
      local dn, dn_scale = init_expert_weight(self, "shared_down", dev)
      sh.shared = stages.SharedExpert.plan { device = dev, rows = sh.rows, hidden = H, w_gate_up = gu,
        w_gate_up_scale = gu_scale, w_down = dn, w_down_scale = dn_scale,
        gate_w = cfg.shared_gate and init_weight(self, "shared_gate_w", dev) or nil }
      fields_of(sh, sh.shared, SHARED_EXPERT_FIELDS)
    end
    sh.router = stages.Router.plan { device = dev, lead = sh.lead, tokens = self.tokens, rank = sh.rank,
      experts = E, k = K, w_router = sh.w_router, bias = sh.bias, cfg = cfg, nan = self.nan, router = self.router }
    fields_of(sh, sh.router, ROUTER_FIELDS)
    space:alloc_shard(self, sh)
  end
  for j, h in ipairs(self.held) do
    h.schedule = schedule.plan({ ids = space:schedule_ids(j), experts = E, rank = h.rank, pad = self.pad,
      capacity = C, expert_capacity = self.expert_capacity, layout = self.layout, overflow = self.overflow,
      invalid = self.invalid }, "layer", true)
    memory.alloc(own_held_buffers(self), h.device, h)
  end
  for _, sh in ipairs(self.shards) do memory.alloc(own_shard_buffers(self, sh), sh.device, sh) end
  space:connect(self) -- where the experts write: h.ys
  for _, h in ipairs(self.held) do
    h.experts = stages.Experts.plan { xs = h.xs, xs_scale = h.xs_scale, offsets = h.schedule.expert_offsets,
      w_gate_up = h.w_gate_up, w_gate_up_scale = h.w_gate_up_scale, w_down = h.w_down, w_down_scale = h.w_down_scale,
      ys = h.ys }
  end
  for _, name in ipairs(SHARD_FIELDS) do
    local list = shard_list(self, name)
    self[name] = space.lists and list or list[1]
  end
  for name, key in pairs(HELD_FIELDS) do
    self[name] = {}
    for j, h in ipairs(self.held) do self[name][j] = h[key] end
  end
  if self.checkpoint then self.checkpoint:release() end -- its files, until a reference reads other ranks'
  return self
end

-- fn() with the module's context bound wherever fn binds it, left unbound after, an error too.
local function on_ranks(self, fn)
  local ok, res = pcall(fn)
  local released, rerr = pcall(self.space.release, self.space)
  if not ok then args.raise(tostring(res)) end
  if not released then args.raise(tostring(rerr)) end
  return res
end

-- fn(...) inside an NVTX range named name (moelab.h: moe_range_push), closed on an error too -> its
-- first result.
local function in_range(name, fn, ...)
  core.range_push(name)
  local ok, res = pcall(fn, ...)
  core.range_pop()
  if not ok then error(res, 0) end
  return res
end

-- Device events (a monotonic clock on the CPU) around a stage on every shard's device, read back
-- only when asked (stage_times), so a forward never waits for the device.  Nothing is timed while
-- a graph is being captured.
local function time_stage(self, name, fn)
  if not self.timing then return fn() end
  local tr = self.tracing
  if tr then tr.stage, tr[name], tr.order[#tr.order + 1] = name, {}, name end
  self.events = self.events or {}
  local ev = self.events[name]
  if not ev then
    ev = {}
    for i, sh in ipairs(self.shards) do ev[i] = { core.event_new(sh.device), core.event_new(sh.device) } end
    self.events[name] = ev
  end
  for i = 1, #ev do
    self.space:bind(i)
    ev[i][1]:record()
  end
  fn()
  for i = 1, #ev do
    self.space:bind(i)
    ev[i][2]:record()
  end
  self.times[name] = ev
end

-- A stage of the pipeline: inside its NVTX range, timed.
local function timed(self, name, fn) in_range(name, time_stage, self, name, fn) end

-- Which kernel each stage with variants runs and why, per held rank (nothing runs):
-- { { rank =, schedule = <choice>, experts = <choice>, router = <choice>, shared = <choice> (with a
-- shared expert) }, ... }, each choice printing as its report (moelab.explain).  The router (its
-- logits' path) and the shared expert run on each shard, on
-- the tokens forward is given: plan(x) asks about those; without x, about tokens laid out as the
-- layer's own buffers are (a view of x at an odd offset can change the Hopper kernels' verdict).
function Layer:plan(x)
  usable(self, "plan")
  if x ~= nil then x = self.space:inputs(self, "plan", "x", x, "bf16", self.shards[1].out.shape) end
  return on_ranks(self, function()
    local ranks = {}
    for j, h in ipairs(self.held) do
      self.space:bind(j)
      ranks[j] = { rank = h.rank, schedule = h.schedule:explain(), experts = h.experts:explain(),
        exchange = self.space:exchange_choice(self) }
    end
    for i, sh in ipairs(self.shards) do
      if ranks[i] then
        self.space:bind(i)
        ranks[i].router = sh.router:explain(x and as_rows(x[i]))
        if sh.shared then ranks[i].shared = sh.shared:explain(x and as_rows(x[i])) end
      end
    end
    return ranks
  end)
end

-- Milliseconds per stage of the last eager forward, on its slowest device (waits for them).
function Layer:stage_times()
  local t = {}
  for name, ev in pairs(self.times) do
    local worst = 0
    for i = 1, #ev do worst = math.max(worst, ev[i][2]:elapsed_since(ev[i][1])) end
    t[name] = worst
  end
  return t
end

-- The last forward's stages as spans of time, one per stage and rank, from device events (the
-- host's clock on the CPU), in ms since that forward began on the rank's device:
-- { { stage =, rank =, start_ms =, dur_ms =, device =, all_ranks = (one call made it for every rank) }, ... }
-- in the order the stages ran, ranks ascending.  That forward must have been given trace = true.
function Layer:trace()
  local tr = self.traced
  if not tr then
    args.fail("trace", "the last forward was not traced: run layer:forward(x, { trace = true }) first")
  end
  local spans, times = {}, self.times
  local origin = times[tr.order[1]]
  local function add(stage, shard, rank, start, stop, all)
    spans[#spans + 1] = { stage = stage, rank = rank, start_ms = start:elapsed_since(origin[shard][1]),
      dur_ms = stop:elapsed_since(start), device = self.shards[shard].device, all_ranks = all }
  end
  for _, name in ipairs(tr.order) do
    local ev, marks = times[name], tr[name]
    local first = #spans + 1
    if #marks == 0 then
      for i, sh in ipairs(self.shards) do
        if sh.rank then add(name, i, sh.rank, ev[i][1], ev[i][2], false)
        else for r = 0, self.world - 1 do add(name, i, r, ev[i][1], ev[i][2], true) end end
      end
    end
    for k, m in ipairs(marks) do
      local stop = ev[m.shard][2] -- a rank's share ends where the next one on its device begins
      for k2 = k + 1, #marks do
        if marks[k2].shard == m.shard then
          stop = marks[k2].event
          break
        end
      end
      add(name, m.shard, m.rank, m.event, stop, false)
    end
    local stage = {}
    for k = first, #spans do stage[#stage + 1] = spans[k] end
    table.sort(stage, function(a, b) return a.rank < b.rank end)
    for k, sp in ipairs(stage) do spans[first + k - 1] = sp end
  end
  return spans
end

-- One forward pass over x (one tensor per shard) and o = {logits=, ids=, weights=} (one per
-- shard, or nil), check = false: no read back.  Its errors carry no position: the caller's is
-- given by forward.
local function run(self, x, o)
  local space = self.space
  local eager = o.check ~= false
  self.times, self.timing = {}, eager
  self.tracing, self.traced = eager and o.trace and { order = {} } or nil, nil
  self.routing_given = o.ids ~= nil or o.logits ~= nil -- check's reference then takes this routing
  self.routed = o.ids == nil -- the router ran: route_stats are this pass's
  timed(self, "route", function()
    for i, sh in ipairs(self.shards) do
      space:bind(i)
      if o.ids then
        sh.ids:copy(o.ids[i])
        sh.weights:copy(o.weights[i])
        core.nonfinite(sh.weight_stats, sh.weights) -- on the device: read back below only when eager
      elseif o.logits then
        sh.router:run(nil, o.logits[i])
      else
        sh.router:run(as_rows(x[i]))
      end
    end
  end)
  -- What the layer's policies do not allow (NaN logits, a schedule's overflow or invalid ids) is
  -- decided by all ranks together in a real world, after the schedule.
  -- Given routing weights must be finite whatever nan says: there is no row of the router's to mask.
  local own, nan = {}, {} -- this process's messages and NaN rows (or weights), by shard
  if eager and (not self.routed or self.nan == "error") then
    for i, sh in ipairs(self.shards) do
      space:bind(i)
      if self.routed then
        local ok, err = pcall(sh.router.check, sh.router)
        if not sh.router.stats then error(err, 0) end -- the read back itself failed: not a verdict, raised as is
        nan[i] = sh.router.stats.unscored
        if not ok then own[i] = "layer: " .. tostring(err) end
      else
        local st = sh.weight_stats:flat()
        nan[i] = st[1]
        if st[1] > 0 then own[i] = weights_error(self, sh, st) end
      end
    end
    if not space.collective then space:agree(own) end
  end
  timed(self, "schedule", function()
    space:gather_ids()
    for j, h in ipairs(self.held) do
      space:bind(j)
      mark(self, j, h.rank)
      h.schedule:run()
    end
  end)
  if eager then
    for j, h in ipairs(self.held) do
      space:bind(j)
      local ok, err = pcall(h.schedule.check, h.schedule)
      if not ok then own[j] = own[j] or "layer: " .. tostring(err) end
      space:record_verdict(j, nan[j] or 0, ok and 0 or 1)
    end
    space:agree(own)
  end
  timed(self, "dispatch", function() space:dispatch(self, x) end)
  timed(self, "experts", function()
    for j, h in ipairs(self.held) do
      space:bind(j)
      mark(self, j, h.rank)
      h.experts:run()
    end
  end)
  if self.shared_ffn > 0 then
    timed(self, "shared", function()
      for i, sh in ipairs(self.shards) do
        space:bind(i)
        sh.shared:run(as_rows(x[i]))
      end
    end)
  end
  timed(self, "combine", function() space:combine(self) end)
  self.traced, self.tracing = self.tracing, nil
  self.forwarded = true -- its buffers now hold a pass (capture puts the flag back: nothing ran)
  local out = {}
  for i, sh in ipairs(self.shards) do out[i] = sh.out:view(0, sh.out.shape) end
  return #out == 1 and out[1] or out
end

-- forward(x [, {logits=} or {ids=, weights=}, check=, trace=]): x, logits, ids and weights as the
-- world takes them (see the top of this file); simulated: logits f32 [W*T, E], ids i32 and weights
-- f32 [W, T, K]; real: [T, E] and [T, K] per local rank.  check = false reads nothing back (a
-- capture's pass): check() then raises what the pass broke.  trace = true records the spans that
-- trace() returns.  Leaves the module's context unbound.
function Layer:forward(x, o)
  local space = self.space
  usable(self, "forward")
  local kind = space.lists and "any" or "tensor"
  o = args.options("forward", o or {}, { logits = kind, ids = kind, weights = kind, check = "boolean",
    trace = "boolean" })
  if o.trace and o.check == false then
    args.fail("forward", "trace = true times the pass, and check = false passes are not timed: give one of them")
  end
  if (o.ids == nil) ~= (o.weights == nil) then args.fail("forward", "give 'ids' and 'weights' together") end
  if o.ids and o.logits then args.fail("forward", "give either 'logits' or 'ids' and 'weights', not both") end
  local sh = self.shards[1]
  local given = { check = o.check, trace = o.trace }
  x = space:inputs(self, "forward", "x", x, "bf16", sh.out.shape)
  if o.ids then
    given.ids = space:inputs(self, "forward", "ids", o.ids, "i32", sh.ids.shape)
    given.weights = space:inputs(self, "forward", "weights", o.weights, "f32", sh.weights.shape)
  end
  if o.logits then given.logits = space:inputs(self, "forward", "logits", o.logits, "f32", sh.logits.shape) end
  self.forwarded = false -- until this pass completes the buffers hold part of it
  local ok, res = pcall(in_range, "layer", on_ranks, self, function() return run(self, x, given) end)
  if not ok then args.raise(tostring(res)) end
  return res
end

-- The CPU copy of t (t itself on the CPU), or nil.
local function host(t) return t and (t.device == "cpu" and t or t:to("cpu")) end

-- Every rank's weights on the CPU, for the reference, made once: the held ranks' copied, the
-- others' drawn on the CPU (init_weight); the router's only once a reference routes.
local function cpu_weights(self, routes)
  local c = self.cpu
  if not c then
    c = { w_gate_up = {}, w_down = {}, w_gate_up_scale = {}, w_down_scale = {} }
    local held = {}
    for _, h in ipairs(self.held) do held[h.rank] = h end
    for r = 0, self.world - 1 do
      local h = held[r]
      for _, name in ipairs { "w_gate_up", "w_down" } do
        if h then c[name][r + 1], c[name .. "_scale"][r + 1] = host(h[name]), host(h[name .. "_scale"])
        else c[name][r + 1], c[name .. "_scale"][r + 1] = init_expert_weight(self, name, "cpu", r) end
      end
    end
    local sh = self.shards[1]
    c.shared_gate_up, c.shared_down, c.shared_gate_w = host(sh.shared_gate_up), host(sh.shared_down),
      host(sh.shared_gate_w)
    c.shared_gate_up_scale, c.shared_down_scale = host(sh.shared_gate_up_scale), host(sh.shared_down_scale)
    self.cpu = c
  end
  if routes and not c.w_router then c.w_router, c.bias = host(self.shards[1].w_router), host(self.shards[1].bias) end
  return c
end

-- The rows tokens (0-based indices over the local tokens, shard after shard; nil: all) of bufs
-- (one tensor per shard, seen as rows of width) -> a CPU tensor [#tokens, width].
local function gather(self, bufs, tokens, width)
  local N, dtype = self.shards[1].rows, bufs[1].dtype
  if not tokens then
    if #bufs == 1 then return host(bufs[1]):view(0, { N, width }) end
    local g = core.new(dtype, { N * #bufs, width }, "cpu")
    for i, b in ipairs(bufs) do g:view((i - 1) * N * width, { N, width }):copy(b) end
    return g
  end
  local g = core.new(dtype, { #tokens, width }, "cpu")
  for k, t in ipairs(tokens) do g:select(k):copy(bufs[math.floor(t / N) + 1]:view(t % N * width, { width })) end
  return g
end

-- n evenly spaced tokens of each rank whose tokens are local, as gather takes them.
local function sample_tokens(self, n)
  local T, tokens = self.tokens, {}
  for r = 0, self.shards[1].rows * #self.shards / T - 1 do
    for i = 0, n - 1 do tokens[#tokens + 1] = r * T + math.floor(i * T / n) end
  end
  return tokens
end

-- ids (i32 on the CPU) with every id outside [0, E) but the mask -1 made -1: what a forward
-- with invalid = "skip" routed; the tensor itself when there is none.
local function skip_invalid(ids, E)
  local flat, any = ids:flat(), false
  for i, e in ipairs(flat) do
    if e ~= -1 and (e < 0 or e >= E) then flat[i], any = -1, true end
  end
  return any and core.from_table(flat, "i32", "cpu"):view(0, ids.shape) or ids
end

-- The layer's route stage on the CPU over logits f32 [N, E] -> ids, weights, {unscored, first}.
local function cpu_route(self, logits, bias)
  local N, K, cfg = logits.shape[1], self.k, self.cfg
  local ids, weights = core.new("i32", { N, K }, "cpu"), core.new("f32", { N, K }, "cpu")
  local stats = core.new("i32", { 2 }, "cpu")
  core.route { ids = ids, weights = weights, stats = stats, logits = logits, bias = bias, k = K,
    scoring = cfg.scoring, groups = cfg.groups, topk_groups = cfg.topk_groups, scale = cfg.scale }
  return ids, weights, stats:flat()
end

-- The router's contract on a GPU: the ids and weights the last forward chose for the local
-- tokens (nil: all) are, bit for bit, the CPU route stage's on the same logits -- the GPU's own,
-- which its tensor-core path makes differ from the CPU's sums in the last bits.  -> the
-- difference as a message, or nil.  Nothing to compare where the forward was given its routing
-- or its logits, or ran on the CPU.
local function routing_error(self, tokens)
  if self.device == "cpu" or not self.routed or self.routing_given then return nil end
  local K, E = self.k, self.experts
  local ids, weights = cpu_route(self, gather(self, shard_list(self, "logits"), tokens, E),
    cpu_weights(self, true).bias)
  local ok, err = pcall(check.equal, gather(self, shard_list(self, "ids"), tokens, K), ids, "the router's ids")
  if ok then
    ok, err = pcall(check.equal, gather(self, shard_list(self, "weights"), tokens, K), weights,
      "the router's weights")
  end
  if ok then return nil end
  return "layer: check: the GPU's routing differs from the CPU route stage's on the GPU's logits: " .. tostring(err)
end

-- The dense f32 reference on the CPU of the local tokens (nil: all), independent of any
-- schedule -> [#tokens, H].  how: {ids=, weights=} (one per shard: this routing), {forward = true}
-- (the last forward's, its invalid ids skipped as that forward did), {logits=} (route these), or
-- {} (the router on the CPU).
local function dense(self, x, tokens, how)
  local K, E = self.k, self.experts
  local ids, weights, logits
  if how.forward then
    ids, weights = gather(self, shard_list(self, "ids"), tokens, K), gather(self, shard_list(self, "weights"), tokens, K)
    ids = skip_invalid(ids, E) -- as the forward did (it raises otherwise)
  elseif how.ids then
    ids, weights = gather(self, how.ids, tokens, K), gather(self, how.weights, tokens, K)
  elseif how.logits then
    logits = gather(self, how.logits, tokens, E)
  end
  local c = cpu_weights(self, ids == nil)
  local xr = gather(self, x, tokens, self.hidden)
  local N = xr.shape[1]
  if not ids then
    if not logits then
      logits = core.new("f32", { N, E }, "cpu")
      core.logits(logits, xr, c.w_router)
    end
    local st
    ids, weights, st = cpu_route(self, logits, c.bias)
    if st[1] > 0 and self.nan == "error" then -- the layer's policy, as forward applies it
      args.raise(string.format("layer: reference: router logits contain NaN or cannot be scored (+inf, all -inf) "
        .. "in %d of its %d rows; the layer has nan = 'error'", st[1], N))
    end
  end
  local out = core.new("f32", { N, self.hidden }, "cpu")
  local a = { out = out, x = xr, ids = ids, weights = weights, w_gate_up = c.w_gate_up, w_down = c.w_down,
    world = self.world, experts = E, shared_gate_up = c.shared_gate_up, shared_down = c.shared_down,
    shared_gate_w = c.shared_gate_w }
  if self.fp8 then
    a.w_gate_up_scale, a.w_down_scale = c.w_gate_up_scale, c.w_down_scale
    a.shared_gate_up_scale, a.shared_down_scale = c.shared_gate_up_scale, c.shared_down_scale
    core.reference_fp8(a)
  else
    core.reference(a)
  end
  return out
end

-- reference(x [, opts]) -> f32 on the CPU: the dense reference of the layer, independent of any
-- schedule.  routing = "forward" takes the routing the last forward chose; by default (or "own")
-- the reference routes x itself, on the CPU.
--   simulated: also logits= (route these) or ids= and weights= (this routing), as forward takes
--     them; tokens = {flat 0-based indices} computes only those tokens -> [#tokens, H]; else
--     [W, T, H].
--   real: sample = n, n evenly spaced tokens of each local rank; -> [n, H] (n = T without sample)
--     per local rank: a list, or the tensor itself with one local rank.
function Layer:reference(x, o)
  local space = self.space
  usable(self, "reference")
  o = args.options("reference", o or {}, space.REFERENCE_OPTIONS)
  if (o.ids == nil) ~= (o.weights == nil) then args.fail("reference", "give 'ids' and 'weights' together") end
  if (o.ids and 1 or 0) + (o.logits and 1 or 0) + (o.routing and 1 or 0) > 1 then
    args.fail("reference", "give at most one routing: 'logits', 'ids' and 'weights', or 'routing'")
  end
  local sh = self.shards[1]
  x = space:inputs(self, "reference", "x", x, "bf16", sh.out.shape)
  local how = { forward = o.routing == "forward" }
  if o.ids then -- as forward takes them
    how.ids = space:inputs(self, "reference", "ids", o.ids, "i32", sh.ids.shape)
    how.weights = space:inputs(self, "reference", "weights", o.weights, "f32", sh.weights.shape)
  end
  if o.logits then how.logits = space:inputs(self, "reference", "logits", o.logits, "f32", sh.logits.shape) end
  if how.forward and not self.forwarded then
    args.fail("reference", "routing = 'forward' before any forward completed: there is no routing to take")
  end
  local T, H, local_tokens = self.tokens, self.hidden, sh.rows * #self.shards
  local tokens, n = o.tokens, nil
  for i, tok in ipairs(tokens or {}) do
    if compat.math_type(tok) ~= "integer" or tok < 0 or tok >= local_tokens then
      args.fail("reference", string.format("tokens[%d] must be a token index in [0, %d), got %s", i, local_tokens,
        args.describe(tok)))
    end
  end
  if o.sample then
    n = math.min(o.sample, T)
    args.range("reference", "sample", n, 1)
    tokens = n < T and sample_tokens(self, n) or nil
  end
  local out = dense(self, x, tokens, how)
  if not space.lists then return tokens and out or out:view(0, sh.out.shape) end
  if #self.shards == 1 then return out end
  local per, rows = {}, (n or T)
  for i = 1, #self.shards do per[i] = out:view((i - 1) * rows * H, { rows, H }) end
  return per
end

-- The last forward's ids as its experts saw them: -1 where a route reached no expert (masked,
-- an invalid id skipped, dropped by a capacity: route_row -1 on the expert's owner), or nil when
-- every valid route reached one (the schedules' stats say so).  Only where every rank's
-- schedule is at hand (a simulated world): another process's drops are not known here.
local function applied_ids(self)
  if not self.space.sees_every_rank then return nil end
  local dropped, invalid = 0, 0
  for _, h in ipairs(self.held) do
    local st = h.schedule:read_stats()
    dropped, invalid = dropped + st.dropped, st.invalid -- every rank sees all ids: one invalid count
  end
  if dropped == 0 and invalid == 0 then return nil end
  local EL, E, sh = self.local_experts, self.experts, self.shards[1]
  local flat = sh.ids:to("cpu"):flat()
  local rows = {}
  for r, h in ipairs(self.held) do rows[r] = h.schedule.route_row:flat() end
  for i, e in ipairs(flat) do -- i - 1 = p T K + route: the same index in route_row [W, T K]
    if e ~= -1 and (e < 0 or e >= E or rows[math.floor(e / EL) + 1][i] < 0) then flat[i] = -1 end
  end
  return core.from_table(flat, "i32", "cpu"):view(0, sh.ids.shape)
end

-- What the layer's policies do not allow in its last pass, as forward raises it in eager use:
-- router logits with NaN or unscorable rows (nan = 'error'), a schedule's capacity overflow or
-- invalid ids.  -> the message, or nil.  For a pass that did not check (forward{check = false},
-- a replay) this is the check.
local function policy_error(self)
  return on_ranks(self, function()
    for i = 1, math.max(#self.shards, #self.held) do -- shard i and held rank i share a device
      self.space:bind(i)
      local sh, h = self.shards[i], self.held[i]
      local given = sh and not self.routed and sh.weight_stats:flat()
      if given and given[1] > 0 then return weights_error(self, sh, given) end
      local unscored = sh and self.routed and self.nan == "error" and sh.router:read_stats().unscored or 0
      if unscored > 0 then
        return string.format("layer: route: router logits contained NaN or could not be scored (+inf, all -inf) in "
          .. "%d rows%s (those tokens were routed nowhere)", unscored, rank_label(sh))
      end
      local ok, err = pcall(h.schedule.check, h.schedule)
      if not ok then return "layer: " .. tostring(err) end
    end
  end)
end

-- check(x [, {sample = n, rtol =, l2 =, raise =}]): the last forward's output against the dense
-- reference, with the routing that forward applied (given logits or ids, or the router's; routes
-- that reached no expert -- masked, invalid and skipped, dropped by a capacity -- left out; in a
-- real world, whose other processes' drops are not known here, only the invalid ids: a forward
-- that dropped routes differs from it by those).  Raises when out of tolerance, unless raise =
-- false, which returns the metrics and .pass.  With sample, n evenly spaced tokens of each rank:
-- the way to check a layer too large for a full CPU reference.  On the CPU, a whole check of a
-- forward that routed for itself takes the reference's own routing, so the router is checked
-- too; on a GPU, the routing of a forward that routed x is checked against the CPU route stage
-- run on the GPU's own logits, ids and weights bit for bit (with raise = false a difference
-- makes .pass false and .routing says what differs).  First, whatever raise says, it raises what
-- the layer's policies do not allow in that pass (policy_error), as an eager forward would have:
-- a forward{check = false} leaves that to check, or to stats() to read.
function Layer:check(x, o)
  usable(self, "check")
  o = args.options("check", o or {}, { sample = "integer", rtol = "number", l2 = "number", raise = "boolean" })
  if not self.forwarded then
    args.fail("check", "no forward has completed (a capture runs nothing before its first replay): check "
      .. "compares the last pass's output")
  end
  local why = policy_error(self)
  if why then args.raise(why) end
  local sh = self.shards[1]
  x = self.space:inputs(self, "check", "x", x, "bf16", sh.out.shape)
  local T = self.tokens
  local n = o.sample and math.min(o.sample, T) or T
  args.range("check", "sample", n, 1)
  local tokens = n < T and sample_tokens(self, n) or nil
  local ids = applied_ids(self)
  local how = ids and { ids = { ids }, weights = { sh.weights } }
    or { forward = tokens ~= nil or self.device ~= "cpu" or self.routing_given }
  local routing = routing_error(self, tokens)
  if routing and o.raise ~= false then args.raise(routing) end
  local ref = dense(self, x, tokens, how)
  local got = gather(self, shard_list(self, "out"), tokens, self.hidden)
  if not tokens and #self.shards == 1 then got, ref = sh.out, ref:view(0, sh.out.shape) end
  if self.fp8 then -- the FP8 layer's tolerance (docs/design.md, "FP8 tolerance")
    o = { rtol = o.rtol or FP8_RTOL, l2 = o.l2 or FP8_L2, raise = o.raise }
  end
  local verdict = check.verdict(got, ref, o, "layer")
  if routing then verdict.pass, verdict.routing = false, routing end -- raise = false: the metrics
  return verdict
end

-- What the last forward did: rows, padding, loads, drops, per held rank and over them.
-- unscored: rows the router could not score (NaN, +inf, all -inf) on the local tokens;
-- nonfinite_weights: given routing weights that were NaN or infinite (a forward with ids=, weights=).
function Layer:stats()
  usable(self, "stats")
  local EL = self.local_experts
  local st = { ranks = {}, loads = {}, rows_used = 0, rows_needed = 0, dropped = 0, invalid = 0, routes = 0 }
  for j, h in ipairs(self.held) do
    local ss = h.schedule:read_stats()
    local counts = h.schedule.counts:flat()
    local routes = 0
    for e = 1, EL do
      st.loads[#st.loads + 1] = counts[e]
      routes = routes + counts[e]
    end
    st.ranks[j] = { rank = h.rank, rows_used = ss.rows_used, rows_needed = ss.rows_needed, dropped = ss.dropped,
      routes = routes }
    st.rows_used = st.rows_used + ss.rows_used
    st.rows_needed = st.rows_needed + ss.rows_needed
    st.dropped = st.dropped + ss.dropped
    st.routes = st.routes + routes
    st.invalid = ss.invalid -- every rank sees all ids: the same count
  end
  local max_load, sum = 0, 0
  for _, n in ipairs(st.loads) do
    max_load = math.max(max_load, n)
    sum = sum + n
  end
  st.max_load, st.mean_load = max_load, #st.loads > 0 and sum / #st.loads or 0
  st.padding = st.rows_used - st.routes
  st.padding_waste = st.rows_used > 0 and st.padding / st.rows_used or 0
  st.unscored, st.nonfinite_weights = 0, 0
  on_ranks(self, function()
    for i, sh in ipairs(self.shards) do
      self.space:bind(i)
      if self.routed then st.unscored = st.unscored + sh.router:read_stats().unscored
      else st.nonfinite_weights = st.nonfinite_weights + sh.weight_stats:flat()[1] end
    end
  end)
  return st
end

-- capture([x]) -> a graph of the whole forward pass over x (default: simulated, the layer's own
-- buffer layer.input, made on the first capture; real, layer.inputs), which the caller fills.
-- graph:replay() reruns it on the current contents of x, routing included, and returns a view
-- of the output buffer; graph:check() reads the stats the last replay left on the device and
-- raises on what the layer's policies do not allow (a captured pass cannot raise by itself).
local Graph = { __name = "moelab.LayerGraph" }
Graph.__index = Graph

function Layer:capture(x)
  local space = self.space
  usable(self, "capture")
  space:can_capture(self)
  x = space:inputs(self, "capture", "x", x or space:capture_input(self), "bf16", self.shards[1].out.shape)
  -- a capture runs nothing: the buffers hold what they held before it, until a replay
  local forwarded, routing_given, routed = self.forwarded, self.routing_given, self.routed
  space:bind(1)
  local ok, graph = pcall(moe_device.graph, function() in_range("layer", run, self, x, { check = false }) end,
    { device = self.device })
  self.forwarded, self.routing_given, self.routed = forwarded, routing_given, routed
  space:release()
  if not ok then args.raise(graph) end
  return setmetatable({ graph = graph, layer = self, x = x[1] }, Graph)
end

function Graph:replay()
  usable(self.layer, "replay")
  self.graph:replay()
  local layer = self.layer
  layer.forwarded, layer.routing_given, layer.routed = true, false, true -- it routes for itself
  -- a view of the output buffer, made again only if the caller closed it (replay allocates nothing)
  local out = layer.shards[1].out
  if not self.out or self.out.closed then self.out = out:view(0, out.shape) end
  return self.out
end

function Graph:check()
  local why = policy_error(self.layer)
  if why then args.raise(why) end
  return self
end

function Layer:__tostring()
  local c = self.cfg
  local header, path = self.space:describe(self)
  local lines = {
    header,
    string.format("  route     %s, E = %d, top-%d%s, scale %g", c.scoring, self.experts, self.k,
      c.groups > 1 and string.format(", %d groups keep %d", c.groups, c.topk_groups) or "", c.scale),
    string.format("  schedule  %s, pad %d, capacity %d rows per rank%s, overflow %s", self.layout, self.pad,
      self.capacity, self.expert_capacity and (", expert capacity " .. self.expert_capacity) or "", self.overflow),
    string.format("  experts   %d per rank, SwiGLU H = %d, F = %d%s", self.local_experts, self.hidden, self.ffn,
      self.fp8 and ", FP8 (e4m3, 128-blocks)" or ""),
  }
  if self.shared_ffn > 0 then
    lines[#lines + 1] = string.format("  shared    SwiGLU F = %d%s", self.shared_ffn,
      c.shared_gate and ", sigmoid-gated" or "")
  end
  lines[#lines + 1] = path
  return table.concat(lines, "\n")
end

args.methods(Layer, "layer", { "new", "memory_of" })
args.methods(Graph, "g")

return Layer
