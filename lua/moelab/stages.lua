-- SPDX-License-Identifier: MIT
-- The layer's stages that hold buffers and state of their own, each shaped like schedule.Schedule:
-- plan{...} allocates and owns the stage's outputs once, so that a forward allocates nothing;
-- run(...) issues the stage on the bound stream and reads nothing back (capturable); check()
-- reads the stage's device statistics and raises by its policy; explain() says which kernel run()
-- would issue where the stage has several; buffers(o) lists what plan(o) allocates (moelab.memory),
-- so that a layer can size itself before making anything.  The weights are given, never made
-- here: the layer's seed rule makes them.
local core = require "moelab.core"
local args = require "moelab.args"
local compat = require "moelab.compat"
local explain = require "moelab.explain"
local memory = require "moelab.memory"

local stages = {}

-- t as rows [N, width]: a shard's [W, T, width] seen as W*T rows.
function stages.as_rows(t)
  if #t.shape == 2 then return t end
  local s = t.shape
  return t:view(0, { s[1] * s[2], s[3] })
end

-- ---------------------------------------------------------------- router

-- Stage 1, route: the router's logits of a shard's tokens and their top-k experts.
local Router = { __name = "moelab.Router" }
Router.__index = Router
stages.Router = Router

-- o: device; lead, the tokens' shape ({W, T} or {T}); tokens, T per rank; rank, the rank whose
-- tokens (nil: every rank's, W of them); experts E, k K; w_router [E, H], bias [E] or nil; cfg
-- (scoring, groups, topk_groups, scale); nan, the policy on rows it cannot score; router, the
-- logits' GPU path ("tensor" or "exact", the context's option "logits" while they run).
function Router.buffers(o)
  local lead, E, K = o.lead, o.experts, o.k
  local N = lead[1] * (lead[2] or 1)
  local shape = { compat.unpack(lead) }
  shape[#shape + 1] = K
  local rows = #lead == 2 and "world x tokens" or "tokens"
  return {
    memory.buffer("logits", "f32", { N, E }, "the router's logits: " .. rows .. " x experts"),
    memory.buffer("ids", "i32", shape, "the routing: " .. rows .. " x k"),
    memory.buffer("weights", "f32", shape, "the routing: " .. rows .. " x k"),
    memory.buffer("stats_tensor", "i32", { 2 }, "the router's stats"),
  }
end

function Router.plan(o)
  local dev, lead = o.device, o.lead
  local self = setmetatable({ device = dev, rows = lead[1] * (lead[2] or 1), tokens = o.tokens, rank = o.rank,
    experts = o.experts, k = o.k, w_router = o.w_router, bias = o.bias, cfg = o.cfg, nan = o.nan,
    router = o.router or "tensor" }, Router)
  memory.alloc(Router.buffers(o), dev, self)
  self.ids_rows, self.weights_rows = stages.as_rows(self.ids), stages.as_rows(self.weights)
  return self
end

-- fn(...) with the context's option "logits" set to path, put back after (the option is the
-- context's, which every stage of this Lua state shares).
local function with_logits_path(path, fn, ...)
  local before = core.config("logits")
  if before == path then return fn(...) end
  core.config("logits", path)
  local ok, res = pcall(fn, ...)
  pcall(core.config, "logits", before) -- a value MOE_LOGITS gave that the option refuses stays refused
  if not ok then error(res, 0) end
  return res
end

-- Routes x_rows [N, H] (or the given logits [N, E], the router's own not computed) into ids and
-- weights.
function Router:run(x_rows, logits)
  if not logits then
    logits = self.logits
    with_logits_path(self.router, core.logits, logits, x_rows, self.w_router)
  end
  local cfg = self.cfg
  core.route { ids = self.ids_rows, weights = self.weights_rows, stats = self.stats_tensor, logits = logits,
    bias = self.bias, k = self.k, scoring = cfg.scoring, groups = cfg.groups, topk_groups = cfg.topk_groups,
    scale = cfg.scale }
  self.stats = nil
  return self
end

-- The path run(x_rows) would take for the logits (moe_logits_explain); without x_rows, for tokens
-- in a whole tensor of their own (aligned, as the layer's buffers are).
function Router:explain(x_rows)
  local out = self.logits
  if not x_rows then
    x_rows = core.new("bf16", { 1, self.w_router.shape[2] }, self.device)
    out = out:view(0, { 1, self.experts })
  end
  return explain.parse(with_logits_path(self.router, core.logits_explain, out, x_rows, self.w_router))
end

-- Reads the stats back: {unscored = rows it could not score (NaN, +inf, all -inf), first_unscored
-- = the first of them, a row over the shard's tokens}.
function Router:read_stats()
  local st = self.stats_tensor:flat()
  self.stats = { unscored = st[1], first_unscored = st[2] }
  return self.stats
end

-- Raises on rows it could not score where the policy (nan = "error") does not allow them; under
-- nan = "mask" it reads nothing, those rows routed nowhere.
function Router:check()
  if self.nan ~= "error" then return self end
  local st, T = self:read_stats(), self.tokens
  if st.unscored > 0 then
    -- the rank named once: the shard's, or the first row's among every rank's tokens
    local rank = string.format(" of rank %d", self.rank or math.floor(st.first_unscored / T))
    args.raise(string.format("route: router logits contain NaN or cannot be scored (+inf, all -inf) in %d rows%s, "
      .. "the first is token %d%s", st.unscored, self.rank and rank or "", st.first_unscored % T,
      self.rank and "" or rank))
  end
  return self
end

-- ---------------------------------------------------------------- experts

-- The C stage's arguments: the experts of offsets' segments over x into out; w is the weights'
-- table (w_gate_up, w_down, and for FP8 their scales), x_scale the FP8 tokens' scales or nil.
local function experts_args(out, x, offsets, w, x_scale)
  return { out = out, x = x, offsets = offsets, w_gate_up = w.w_gate_up, w_down = w.w_down, x_scale = x_scale,
    w_gate_up_scale = w.w_gate_up_scale, w_down_scale = w.w_down_scale }
end

-- The experts stage of a plan: FP8 where the weights are e4m3 (core.experts_fp8), else bf16.
local function run_experts(a)
  if a.x_scale then core.experts_fp8(a) else core.experts(a) end
end

local function explain_experts(a)
  return explain.parse(a.x_scale and core.experts_fp8_explain(a) or core.experts_explain(a))
end

-- Stage 4, experts: a rank's experts over the rows its schedule placed in xs.
local Experts = { __name = "moelab.Experts" }
Experts.__index = Experts
stages.Experts = Experts

-- o: xs [C, H], offsets (the schedule's expert_offsets [EL + 1]), w_gate_up [EL, 2F, H], w_down
-- [EL, H, F], ys [C, H]; ys is given, not made, where the world says where experts write (a real
-- world's exchange windows).  FP8: xs and the weights e4m3, with xs_scale [H/128, C],
-- w_gate_up_scale and w_down_scale (moe_experts_fp8's).
function Experts.plan(o)
  return setmetatable({ xs = o.xs, xs_scale = o.xs_scale, offsets = o.offsets, ys = o.ys,
    w = { w_gate_up = o.w_gate_up, w_down = o.w_down, w_gate_up_scale = o.w_gate_up_scale,
      w_down_scale = o.w_down_scale } }, Experts)
end

function Experts:run()
  run_experts(experts_args(self.ys, self.xs, self.offsets, self.w, self.xs_scale))
  return self
end

function Experts:explain()
  return explain_experts(experts_args(self.ys, self.xs, self.offsets, self.w, self.xs_scale))
end

-- ---------------------------------------------------------------- shared expert

-- The shared expert: one expert over every token of a shard, and its sigmoid gate when it has one.
local SharedExpert = { __name = "moelab.SharedExpert" }
SharedExpert.__index = SharedExpert
stages.SharedExpert = SharedExpert

-- o: device, rows N, hidden H; w_gate_up [1, 2Fs, H], w_down [1, H, Fs], gate_w [H] or nil (no gate);
-- FP8: the weights e4m3 with w_gate_up_scale and w_down_scale, the tokens quantized here (fp8).
-- buffers(o) reads o.gated for gate_w's presence and o.fp8 for the quantized tokens'.
function SharedExpert.buffers(o)
  local list = {
    memory.buffer("ys", "bf16", { o.rows, o.hidden }, "the shared expert's output: the shard's tokens x hidden"),
    memory.buffer("offsets", "i32", { 2 }, "the shared expert's one segment"),
  }
  if o.gated then list[#list + 1] = memory.buffer("gate", "f32", { o.rows }, "the shared expert's gate: the shard's tokens") end
  if o.fp8 then
    list[#list + 1] = memory.buffer("xq", "e4m3", { o.rows, o.hidden }, "the shared expert's FP8 tokens: tokens x hidden")
    list[#list + 1] = memory.buffer("xq_scale", "f32", { o.hidden / 128, o.rows },
      "their scales: hidden / 128 x tokens")
  end
  return list
end

function SharedExpert.plan(o)
  local dev, N = o.device, o.rows
  local self = setmetatable({ device = dev, rows = N, gate_w = o.gate_w, w = { w_gate_up = o.w_gate_up,
    w_down = o.w_down, w_gate_up_scale = o.w_gate_up_scale, w_down_scale = o.w_down_scale } }, SharedExpert)
  self.w_gate_up, self.w_down, self.w_gate_up_scale, self.w_down_scale = o.w_gate_up, o.w_down, o.w_gate_up_scale,
    o.w_down_scale
  memory.alloc(SharedExpert.buffers { rows = N, hidden = o.hidden, gated = o.gate_w ~= nil,
    fp8 = o.w_gate_up_scale ~= nil }, dev, self)
  self.offsets:copy(core.from_table({ 0, N }, "i32", "cpu"))
  return self
end

-- The expert's arguments over x_rows [N, H] (FP8: over its quantized copy, which run fills).
function SharedExpert:args(x_rows)
  if self.xq then return experts_args(self.ys, self.xq, self.offsets, self.w, self.xq_scale) end
  return experts_args(self.ys, x_rows, self.offsets, self.w)
end

-- The expert, then the gate, over x_rows [N, H]; FP8 quantizes the rows first, per token, the
-- scales transposed as the FP8 experts read them.
function SharedExpert:run(x_rows)
  if self.xq then core.quantize { q = self.xq, scale = self.xq_scale, x = x_rows, kind = "token_t" } end
  run_experts(self:args(x_rows))
  if self.gate then core.sigmoid_gate(self.gate, x_rows, self.gate_w) end
  return self
end

-- The experts kernel run(x_rows) would issue; without x_rows, for tokens laid out as its own ys
-- (the kernels' verdict can depend on where the rows start).
function SharedExpert:explain(x_rows)
  return explain_experts(self:args(x_rows or self.ys))
end

return stages
