-- moe.layer{...}: one MoE layer over a world of W expert-parallel ranks, composed from the
-- stateless stages.  Every buffer is allocated here, once, for a static capacity, so a forward
-- pass allocates nothing and (on a GPU) can be captured as a CUDA graph.  On one device the W
-- ranks live side by side: rank r's tokens are x[r], its experts are [r*EL, (r+1)*EL).
local args = require "moelab.args"

return function(moe)
  local core = moe.core
  local Layer = { __name = "moelab.Layer" }
  Layer.__index = Layer

  local SPEC = {
    model = "any", world = "any", tokens = "integer", hidden = "integer", ffn = "integer",
    experts = "integer", k = "integer", shared_ffn = "integer", shared_gate = "boolean", shared = "boolean",
    scoring = { "softmax", "sigmoid", "sqrtsoftplus" }, groups = "integer", topk_groups = "integer",
    scale = "number", pad = "integer", layout = { "roundrobin", "peer_major" }, capacity = "integer",
    expert_capacity = "integer", overflow = { "error", "drop" }, invalid = { "error", "skip" },
    nan = { "error", "mask" }, device = "device", seed = "integer",
  }
  local MODEL_FIELDS = { "name", "experts", "k", "hidden", "ffn", "shared_ffn", "shared_gate", "scoring", "groups",
    "topk_groups", "scale" }
  local MODEL_FIELD = {}
  for _, f in ipairs(MODEL_FIELDS) do MODEL_FIELD[f] = true end

  local function model_names()
    local names = {}
    for name in pairs(moe.models) do names[#names + 1] = name end
    table.sort(names)
    return table.concat(names, ", ")
  end

  -- The options of moe.layer checked and resolved against the model: what both kinds of layer
  -- (a simulated world on one device, a real one) are made of.
  local function resolve(o)
    args.options("layer", o, SPEC, { "model", "tokens" }, 3)
    local real = moe.World and getmetatable(o.world) == moe.World and o.world or nil
    -- 2.0 counts, as for every integer option
    local world_n = not real and type(o.world) == "number" and math.tointeger(o.world) or nil
    if o.world ~= nil and not real and not world_n then
      args.fail("layer", "option 'world' must be an integer (a simulated world of that many ranks) or a moe.world, got "
        .. args.describe(o.world), 3)
    end
    local m = o.model
    if type(m) == "string" then
      if not moe.models[m] then
        args.fail("layer", string.format("unknown model '%s'; expected one of: %s", m, model_names()), 3)
      end
      m = moe.models[m]
    elseif type(m) ~= "table" then
      args.fail("layer", "option 'model' must be a preset from moe.models or its name, got " .. args.describe(m), 3)
    end
    for key in pairs(m) do -- a misspelt field would be silently absent
      if not MODEL_FIELD[key] then
        args.fail("layer", string.format("the model has a field %s, not one of: %s", args.describe(key),
          table.concat(MODEL_FIELDS, ", ")), 3)
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
    args.options("layer", cfg, kinds, nil, 3)
    cfg.name, cfg.scoring = cfg.name or "custom", cfg.scoring or "softmax"
    cfg.groups, cfg.topk_groups = cfg.groups or 1, cfg.topk_groups or cfg.groups or 1
    cfg.scale, cfg.shared_ffn = cfg.scale or 1.0, cfg.shared_ffn or 0
    if o.shared == false then cfg.shared_ffn = 0 end
    if o.shared == true and cfg.shared_ffn == 0 then cfg.shared_ffn = cfg.ffn end
    if cfg.shared_ffn == 0 then
      if o.shared_gate then -- asked for, not a preset's setting that went with its shared expert
        args.fail("layer", "option 'shared_gate' gates the shared expert, and this layer has none (shared_ffn = 0 or "
          .. "shared = false)", 3)
      end
      cfg.shared_gate = false
    end
    for _, f in ipairs { "experts", "k", "hidden", "ffn" } do
      if math.type(cfg[f]) ~= "integer" then
        args.fail("layer", string.format("the model has no integer '%s' (got %s)", f, args.describe(cfg[f])), 3)
      end
    end
    local W, T = real and real.size or world_n or 1, o.tokens
    args.range("layer", "world", W, 1, nil, 3)
    args.range("layer", "tokens", T, 1, 0x7fffffff, 3)
    args.range("layer", "hidden", cfg.hidden, 1, nil, 3)
    args.range("layer", "ffn", cfg.ffn, 1, nil, 3)
    args.range("layer", "shared_ffn", cfg.shared_ffn, 0, nil, 3)
    args.range("layer", "experts", cfg.experts, 1, 0x7fffffff, 3)
    args.range("layer", "k", cfg.k, 1, cfg.experts, 3)
    -- the router's options, checked now rather than at the first forward
    args.options("layer", { scoring = cfg.scoring }, { scoring = SPEC.scoring }, nil, 3)
    local ok, err = pcall(moe.routing_options, "layer", cfg.experts, cfg, 1) -- its errors without a position
    if not ok then
      local name = tostring(err):match("option '([%w_]+)'")
      if name and o[name] == nil and m[name] ~= nil then -- a setting of the model's that the options did not give
        err = tostring(err):gsub("%)$", string.format("; the value is the model's (%s): an option of that name "
          .. "overrides it)", cfg.name), 1)
      end
      args.raise(err)
    end
    args.range("layer", "pad", o.pad, 1, 0x7fffffff, 3) -- rows are i32: so the capacity's sum cannot wrap
    if cfg.experts % W ~= 0 then
      args.fail("layer", string.format("the %d experts cannot be split over a world of %d ranks (%d %% %d ~= 0)",
        cfg.experts, W, cfg.experts, W), 3)
    end
    local E, K, H, F, Fs = cfg.experts, cfg.k, cfg.hidden, cfg.ffn, cfg.shared_ffn
    local EL, pad = E // W, o.pad or 1
    local device = o.device or moe.default_device()
    if device == "cuda" then device = "cuda:0" end -- as its tensors will name it
    local seed = o.seed or 0
    -- Default capacity: twice the mean rows of a rank plus one pad per expert; skewed routing
    -- needs more (the layer raises on overflow unless overflow = "drop").
    local capacity = o.capacity or (2 * T * K + EL * pad)
    if o.capacity == nil and capacity > 0x7ffffffe then
      args.fail("layer", string.format("the default capacity (2 tokens k + experts per rank x pad = %d rows) "
        .. "exceeds 2^31 - 2; pass capacity", capacity), 3)
    end
    args.range("layer", "capacity", capacity, 0, 0x7ffffffe, 3) -- as moe.schedule's (see there)
    return {
      cfg = cfg, world = W, tokens = T, experts = E, local_experts = EL, k = K, hidden = H, ffn = F,
      shared_ffn = Fs, pad = pad, layout = o.layout or "roundrobin", capacity = capacity,
      expert_capacity = o.expert_capacity, overflow = o.overflow or "error", invalid = o.invalid or "error",
      nan = o.nan or "error", device = device, seed = seed, real = real, device_given = o.device ~= nil,
    }
  end
  local world_layer -- set below, once the helpers it shares are defined

  local function new_layer(o)
    local r = resolve(o)
    if r.real then
      local wl = world_layer(r) -- not a tail call: its errors count this frame to reach the caller
      return wl
    end
    local cfg, W, T, E, EL, K, H, F, Fs, pad, device, seed, capacity = r.cfg, r.world, r.tokens, r.experts,
      r.local_experts, r.k, r.hidden, r.ffn, r.shared_ffn, r.pad, r.device, r.seed, r.capacity

    local self = setmetatable({
      cfg = cfg, world = W, tokens = T, experts = E, local_experts = EL, k = K, hidden = H, ffn = F,
      shared_ffn = Fs, pad = pad, layout = o.layout or "roundrobin", capacity = capacity,
      expert_capacity = o.expert_capacity, overflow = o.overflow or "error", invalid = o.invalid or "error",
      nan = o.nan or "error", device = device, seed = seed, times = {},
    }, Layer)

    -- Weights, drawn from the seed: the same on every device.  Scaled so that activations stay O(1).
    local sd = seed * 1000
    local function randn(shape, s, std) return core.new("bf16", shape, device):randn(sd + s, std) end
    self.w_router = randn({ E, H }, 1, 1 / math.sqrt(H))
    if cfg.scoring ~= "softmax" then
      self.bias = core.new("f32", { E }, device):randn(sd + 2, 0.005)
    end
    self.w_gate_up, self.w_down = {}, {}
    for r = 1, W do
      self.w_gate_up[r] = randn({ EL, 2 * F, H }, 10 + 2 * r, 1 / math.sqrt(H))
      self.w_down[r] = randn({ EL, H, F }, 11 + 2 * r, 1 / math.sqrt(F))
    end
    if Fs > 0 then
      self.shared_gate_up = randn({ 1, 2 * Fs, H }, 3, 1 / math.sqrt(H))
      self.shared_down = randn({ 1, H, Fs }, 4, 1 / math.sqrt(Fs))
      if cfg.shared_gate then self.shared_gate_w = randn({ H }, 5, 1 / math.sqrt(H)) end
    end

    -- Buffers.
    self.logits = core.new("f32", { W * T, E }, device)
    self.ids = core.new("i32", { W, T, K }, device)
    self.weights = core.new("f32", { W, T, K }, device)
    self.route_stats = core.new("i32", { 2 }, device)
    self.out = core.new("bf16", { W, T, H }, device)
    self.schedules, self.xs, self.ys, self.route_rows = {}, {}, {}, {}
    for r = 1, W do
      local s = moe.schedule_plan({ ids = self.ids, experts = E, rank = r - 1, pad = pad, capacity = capacity,
        expert_capacity = o.expert_capacity, layout = self.layout, overflow = self.overflow,
        invalid = self.invalid }, "layer", 2)
      self.schedules[r] = s
      self.route_rows[r] = s.route_row
      self.xs[r] = core.new("bf16", { capacity, H }, device)
      self.ys[r] = core.new("bf16", { capacity, H }, device)
    end
    if Fs > 0 then
      self.shared_y = core.new("bf16", { W * T, H }, device)
      self.shared_offsets = core.from_table({ 0, W * T }, "i32", device)
      if cfg.shared_gate then self.gate = core.new("f32", { W * T }, device) end
    end
    return self
  end

  local function check_x(self, fname, x)
    args.tensor(fname, "x", x, "bf16", { self.world, self.tokens, self.hidden }, 3)
    if x.device ~= self.device then
      args.fail(fname, string.format("x is on %s but the layer is on %s", x.device, self.device), 3)
    end
  end

  -- Stage timing: a monotonic clock on the CPU; on a GPU a pair of device events around each
  -- stage, read back only when asked (Layer:stage_times), so a forward pass never waits for the
  -- device.  Nothing is timed while a graph is being captured.
  local function timed(self, name, fn)
    if not self.timing then return fn() end
    if self.device == "cpu" then
      local t0 = core.now()
      fn()
      self.times[name] = (core.now() - t0) * 1e3
      return
    end
    self.events = self.events or {}
    local ev = self.events[name]
    if not ev then
      ev = { core.event_new(self.device), core.event_new(self.device) }
      self.events[name] = ev
    end
    ev[1]:record()
    fn()
    ev[2]:record()
    self.times[name] = ev
  end

  -- Milliseconds per stage of the last eager forward (waits for the device on a GPU).
  function Layer:stage_times()
    local t = {}
    for name, v in pairs(self.times) do
      t[name] = type(v) == "table" and v[2]:elapsed_since(v[1]) or v
    end
    return t
  end

  -- The routing step: router logits (or given ones), or given ids and weights.
  local function route(self, x, o)
    local W, T, K = self.world, self.tokens, self.k
    if o.ids then
      self.ids:copy(o.ids)
      self.weights:copy(o.weights)
      return
    end
    local logits = o.logits or self.logits
    if not o.logits then
      core.logits(logits, x:view(0, { W * T, self.hidden }), self.w_router)
    end
    core.route { ids = self.ids:view(0, { W * T, K }), weights = self.weights:view(0, { W * T, K }),
      stats = self.route_stats, logits = logits, bias = self.bias, k = K, scoring = self.cfg.scoring,
      groups = self.cfg.groups, topk_groups = self.cfg.topk_groups, scale = self.cfg.scale }
  end

  -- forward(x [, {logits=} or {ids=, weights=}]) -> out bf16 [W, T, H]: a view of the layer's own
  -- buffer (layer.out), which the next pass overwrites; closing the view leaves the layer whole.
  function Layer:forward(x, o)
    o = args.options("forward", o or {}, { logits = "tensor", ids = "tensor", weights = "tensor", check = "boolean" })
    if (o.ids == nil) ~= (o.weights == nil) then args.fail("forward", "give 'ids' and 'weights' together") end
    if o.ids and o.logits then args.fail("forward", "give either 'logits' or 'ids' and 'weights', not both") end
    check_x(self, "forward", x)
    local W, T, H = self.world, self.tokens, self.hidden
    if o.ids then
      args.tensor("forward", "ids", o.ids, "i32", { W, T, self.k })
      args.tensor("forward", "weights", o.weights, "f32", { W, T, self.k })
    end
    if o.logits then args.tensor("forward", "logits", o.logits, "f32", { W * T, self.experts }) end
    local eager = o.check ~= false
    -- until this pass completes the buffers hold part of it: check and the forward's routing wait
    self.forwarded = false
    self.routing_given = o.ids ~= nil or o.logits ~= nil -- check's reference then takes this routing
    self.routed = o.ids == nil -- the router ran: route_stats are this pass's
    self.times, self.timing = {}, eager
    timed(self, "route", function() route(self, x, o) end)
    if eager and not o.ids and self.nan == "error" then
      local st = self.route_stats:flat()
      if st[1] > 0 then
        error(string.format("layer: route: router logits contain NaN or cannot be scored (+inf, all -inf) in %d rows, "
          .. "the first is token %d of rank %d",
          st[1], st[2] % T, st[2] // T), 2)
      end
    end
    timed(self, "schedule", function()
      for r = 1, W do self.schedules[r]:run() end
    end)
    if eager then
      for r = 1, W do
        local ok, err = pcall(self.schedules[r].check, self.schedules[r])
        if not ok then error("layer: " .. tostring(err), 2) end
      end
    end
    timed(self, "dispatch", function()
      for r = 1, W do
        local s = self.schedules[r]
        core.dispatch { xs = self.xs[r], x = x, peer_rank = s.peer_rank, peer_route = s.peer_route, k = self.k,
          zero_fill = false }
      end
    end)
    timed(self, "experts", function()
      for r = 1, W do
        core.experts { ys = self.ys[r], xs = self.xs[r], expert_offsets = self.schedules[r].expert_offsets,
          w_gate_up = self.w_gate_up[r], w_down = self.w_down[r] }
      end
    end)
    if self.shared_ffn > 0 then
      timed(self, "shared", function()
        local xf = x:view(0, { W * T, H })
        core.experts { ys = self.shared_y, xs = xf, expert_offsets = self.shared_offsets,
          w_gate_up = self.shared_gate_up, w_down = self.shared_down }
        if self.gate then core.sigmoid_gate(self.gate, xf, self.shared_gate_w) end
      end)
    end
    timed(self, "combine", function()
      for p = 1, W do
        core.combine { out = self.out:select(p), weights = self.weights:select(p), ids = self.ids:select(p),
          ys = self.ys, route_row = self.route_rows, world = W, experts = self.experts, rank = p - 1,
          shared = self.shared_y and self.shared_y:view((p - 1) * T * H, { T, H }),
          shared_gate = self.gate and self.gate:view((p - 1) * T, { T }) }
      end
    end)
    self.forwarded = true -- its buffers now hold a pass (capture puts the flag back: nothing ran)
    return self.out:view(0, self.out.shape)
  end

  -- CPU copies of the weights, made once, for the reference.
  local function cpu_weights(self)
    if self.cpu then return self.cpu end
    local function host(t) return t and (t.device == "cpu" and t or t:to("cpu")) end
    local c = { w_gate_up = {}, w_down = {} }
    for r = 1, self.world do
      c.w_gate_up[r], c.w_down[r] = host(self.w_gate_up[r]), host(self.w_down[r])
    end
    c.w_router, c.bias = host(self.w_router), host(self.bias)
    c.shared_gate_up, c.shared_down, c.shared_gate_w = host(self.shared_gate_up), host(self.shared_down),
      host(self.shared_gate_w)
    self.cpu = c
    return c
  end

  -- Rows tokens (0-based flat indices over the W*T tokens) of a [W, T, ...] tensor, gathered
  -- into a CPU tensor [#tokens, ...] one row copy at a time.
  local function gather_rows(t, tokens, width, dtype)
    local g = core.new(dtype or t.dtype, { #tokens, width }, "cpu")
    for i, tok in ipairs(tokens) do g:select(i):copy(t:view(tok * width, { width })) end
    return g
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

  -- The dense reference of DESIGN.md for the rows x (bf16 or f32 [N, H] on the CPU) with the
  -- weights c on the CPU: routed by ids and weights when given, else by the router on logits
  -- (computed from x when nil).  Shared with the layer over a real world.  -> f32 [N, H].
  local function dense_reference(self, c, x, ids, weights, logits)
    local N, K, E = x.shape[1], self.k, self.experts
    if not ids then
      if not logits then
        logits = core.new("f32", { N, E }, "cpu")
        core.logits(logits, x, c.w_router)
      end
      ids, weights = core.new("i32", { N, K }, "cpu"), core.new("f32", { N, K }, "cpu")
      local stats = core.new("i32", { 2 }, "cpu")
      core.route { ids = ids, weights = weights, stats = stats, logits = logits, bias = c.bias, k = K,
        scoring = self.cfg.scoring, groups = self.cfg.groups, topk_groups = self.cfg.topk_groups, scale = self.cfg.scale }
      local st = stats:flat()
      if st[1] > 0 and self.nan == "error" then -- the layer's policy, as forward applies it
        args.raise(string.format("layer: reference: router logits contain NaN or cannot be scored (+inf, all -inf) "
          .. "in %d of its %d rows; the layer has nan = 'error'", st[1], N))
      end
    end
    local out = core.new("f32", { N, self.hidden }, "cpu")
    core.reference { out = out, x = x, ids = ids, weights = weights, w_gate_up = c.w_gate_up, w_down = c.w_down,
      world = self.world, experts = E, shared_gate_up = c.shared_gate_up, shared_down = c.shared_down,
      shared_gate_w = c.shared_gate_w }
    return out
  end

  -- reference(x [, opts]) -> f32 on the CPU: the dense reference of DESIGN.md, independent of any
  -- schedule.  opts: logits= (route these), or ids= and weights= (this routing), or
  -- routing = "forward" (the routing the last forward chose, read back from the layer); by
  -- default the reference routes x itself, on the CPU.  tokens = {flat 0-based indices} computes
  -- only those tokens and returns [#tokens, H]; otherwise [W, T, H].
  function Layer:reference(x, o)
    o = args.options("reference", o or {}, { logits = "tensor", ids = "tensor", weights = "tensor",
      routing = { "own", "forward" }, tokens = "table" })
    check_x(self, "reference", x)
    if (o.ids == nil) ~= (o.weights == nil) then args.fail("reference", "give 'ids' and 'weights' together") end
    if (o.ids and 1 or 0) + (o.logits and 1 or 0) + (o.routing and 1 or 0) > 1 then
      args.fail("reference", "give at most one routing: 'logits', 'ids' and 'weights', or 'routing'")
    end
    local W, T, K, H, E = self.world, self.tokens, self.k, self.hidden, self.experts
    if o.ids then -- as forward takes them
      args.tensor("reference", "ids", o.ids, "i32", { W, T, K })
      args.tensor("reference", "weights", o.weights, "f32", { W, T, K })
    end
    if o.logits then args.tensor("reference", "logits", o.logits, "f32", { W * T, E }) end
    if o.routing == "forward" and not self.forwarded then
      args.fail("reference", "routing = 'forward' before any forward completed: there is no routing to take")
    end
    local c = cpu_weights(self)
    local all = {}
    if o.tokens then
      for i, tok in ipairs(o.tokens) do
        if math.type(tok) ~= "integer" or tok < 0 or tok >= W * T then
          args.fail("reference", string.format("tokens[%d] must be a token index in [0, %d), got %s", i, W * T,
            args.describe(tok)))
        end
      end
    else
      for i = 1, W * T do all[i] = i - 1 end
    end
    local tokens = o.tokens or all
    local N = #tokens
    local whole = o.tokens == nil
    local xf = whole and (x.device == "cpu" and x or x:to("cpu")):view(0, { W * T, H }) or gather_rows(x, tokens, H)
    local ids, weights, logits
    if o.ids or o.routing == "forward" then
      local src_ids, src_w = o.ids or self.ids, o.weights or self.weights
      if whole then
        ids, weights = src_ids:to("cpu"):view(0, { N, K }), src_w:to("cpu"):view(0, { N, K })
      else
        ids, weights = gather_rows(src_ids, tokens, K), gather_rows(src_w, tokens, K)
      end
      if not o.ids then ids = skip_invalid(ids, E) end -- as the forward did (it raises otherwise)
    elseif o.logits then
      logits = whole and o.logits:to("cpu") or gather_rows(o.logits, tokens, E)
    end
    local out = dense_reference(self, c, xf, ids, weights, logits)
    return whole and out:view(0, { W, T, H }) or out
  end

  -- The last forward's ids as its experts saw them: -1 where a route reached no expert (masked,
  -- an invalid id skipped, dropped by a capacity: route_row -1 on the expert's owner), or nil when
  -- every valid route reached one (the schedules' stats say so).
  local function applied_ids(self)
    local dropped, invalid = 0, 0
    for _, s in ipairs(self.schedules) do
      local st = s:read_stats()
      dropped, invalid = dropped + st.dropped, st.invalid -- every rank sees all ids: one invalid count
    end
    if dropped == 0 and invalid == 0 then return nil end
    local W, EL, E = self.world, self.local_experts, self.experts
    local ids = self.ids:to("cpu")
    local flat = ids:flat()
    local rows = {}
    for r = 1, W do rows[r] = self.route_rows[r]:flat() end
    for i, e in ipairs(flat) do -- i - 1 = p T K + route: the same index in route_row [W, T K]
      if e ~= -1 and (e < 0 or e >= E or rows[e // EL + 1][i] < 0) then flat[i] = -1 end
    end
    return core.from_table(flat, "i32", "cpu"):view(0, { W, self.tokens, self.k })
  end

  -- The start of both layers' check(x, o) (errors at check's caller): its options, a forward
  -- whose output to compare, and what that pass broke of the layer's policies (policy_error(self)
  -- -> a message or nil), raised whatever raise says.  -> the options.
  local function check_begin(self, o, policy_error)
    o = args.options("check", o or {}, { sample = "integer", rtol = "number", l2 = "number", raise = "boolean" }, nil, 3)
    if not self.forwarded then
      args.fail("check", "no forward has completed (a capture runs nothing before its first replay): check "
        .. "compares the last pass's output", 3)
    end
    local why = policy_error(self)
    if why then error(why, 3) end
    return o
  end

  -- What the layer's policies do not allow in its last pass, as forward raises it in eager use:
  -- router logits with NaN or unscorable rows (nan = 'error'), a schedule's capacity overflow or
  -- invalid ids.  -> the message, or nil.  For a pass that did not check (forward{check = false},
  -- a replay) this is the check.
  local function policy_error(self)
    if self.routed and self.nan == "error" then
      local st = self.route_stats:flat()
      if st[1] > 0 then
        return string.format("layer: route: router logits contained NaN or could not be scored (+inf, all -inf) in %d "
          .. "rows (those tokens were routed nowhere)", st[1])
      end
    end
    for r = 1, self.world do
      local s = self.schedules[r]
      local ok, err = pcall(s.check, s)
      if not ok then return "layer: " .. tostring(err) end
    end
  end

  -- check(x [, {sample = n, rtol =, l2 =, raise =}]): the last forward's output against the dense
  -- reference, with the routing that forward applied (given logits or ids, or the router's; routes
  -- that reached no expert -- masked, invalid and skipped, dropped by a capacity -- left out).
  -- Raises when out of tolerance, unless raise = false, which returns the metrics and .pass.  With
  -- sample, n evenly spaced tokens of each rank: the way to check a layer too large for a full CPU
  -- reference.  On the CPU, a whole check of a forward that routed for itself takes the
  -- reference's own routing, so the router is checked too.  First, whatever raise says, it raises
  -- what the layer's policies do not allow in that pass (policy_error), as an eager forward would
  -- have: a forward{check = false} leaves that to check, or to stats() to read.
  function Layer:check(x, o)
    o = check_begin(self, o, policy_error)
    local W, T, H = self.world, self.tokens, self.hidden
    -- the forward's routing (the router's, given, or with the routes no expert took masked); on the
    -- CPU a forward that routed for itself is checked against the reference's own routing, which
    -- checks the router too
    local ids = applied_ids(self)
    local routing = ids and { ids = ids, weights = self.weights }
      or { routing = (self.device == "cpu" and not self.routing_given) and "own" or "forward" }
    local got, ref
    if o.sample and o.sample < T then
      args.range("check", "sample", o.sample, 1)
      local tokens = {}
      for r = 0, W - 1 do
        for i = 0, o.sample - 1 do tokens[#tokens + 1] = r * T + (i * T) // o.sample end
      end
      routing.tokens, routing.routing = tokens, not ids and "forward" or nil
      ref = self:reference(x, routing)
      got = gather_rows(self.out, tokens, H)
    else
      ref = self:reference(x, routing)
      got = self.out
    end
    return moe.check.verdict(got, ref, o, "layer")
  end

  -- What the last forward did: rows, padding, loads, drops, per rank and over the ranks, from
  -- the schedules given (ranks[i]: schedules[i]'s global rank, recorded when given).
  local function schedule_stats(schedules, EL, ranks)
    local st = { ranks = {}, loads = {}, rows_used = 0, rows_needed = 0, dropped = 0, invalid = 0, routes = 0 }
    for i, s in ipairs(schedules) do
      local ss = s:read_stats()
      local counts = s.counts:flat()
      local routes = 0
      for e = 1, EL do
        st.loads[#st.loads + 1] = counts[e]
        routes = routes + counts[e]
      end
      st.ranks[i] = { rank = ranks and ranks[i], rows_used = ss.rows_used, rows_needed = ss.rows_needed,
        dropped = ss.dropped, routes = routes }
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
    return st
  end

  function Layer:stats()
    local st = schedule_stats(self.schedules, self.local_experts)
    st.unscored = self.routed and self.route_stats:flat()[1] or 0 -- rows the router could not score
    return st
  end

  -- capture([x]) -> a graph of the whole forward pass over the input buffer x (default: the
  -- layer's own buffer layer.input, which the caller fills).  graph:replay() reruns it on the
  -- current contents of x, routing included, and returns a view of the output buffer;
  -- graph:check() reads the stats the last replay left on the device and raises on what the
  -- layer's policies do not allow (a captured pass cannot raise by itself).
  local Graph = { __name = "moelab.LayerGraph" }
  Graph.__index = Graph

  function Layer:capture(x)
    if self.device == "cpu" then
      error("layer:capture: CUDA graphs need a layer on a cuda device (this one is on cpu)", 2)
    end
    if x == nil then
      self.input = self.input or core.new("bf16", { self.world, self.tokens, self.hidden }, self.device)
      x = self.input
    end
    check_x(self, "capture", x)
    -- a capture runs nothing: the buffers hold what they held before it, until a replay
    local forwarded, routing_given, routed = self.forwarded, self.routing_given, self.routed
    local ok, graph = pcall(moe.graph, function() self:forward(x, { check = false }) end, { device = self.device })
    self.forwarded, self.routing_given, self.routed = forwarded, routing_given, routed
    if not ok then args.raise(graph) end
    return setmetatable({ graph = graph, layer = self, x = x }, Graph)
  end

  function Graph:replay()
    self.graph:replay()
    self.layer.forwarded, self.layer.routing_given, self.layer.routed = true, false, true -- it routes for itself
    -- a view of the output buffer, made again only if the caller closed it (replay allocates nothing)
    if not self.out or self.out.closed then self.out = self.layer.out:view(0, self.layer.out.shape) end
    return self.out
  end

  function Graph:check()
    local why = policy_error(self.layer)
    if why then error(why, 2) end
    return self
  end

  function Layer:__tostring()
    local c = self.cfg
    local lines = {
      string.format("moelab.Layer(%s on %s: world %d, %d tokens per rank)", c.name, self.device, self.world, self.tokens),
      string.format("  route     %s, E = %d, top-%d%s, scale %g", c.scoring, self.experts, self.k,
        c.groups > 1 and string.format(", %d groups keep %d", c.groups, c.topk_groups) or "", c.scale),
      string.format("  schedule  %s, pad %d, capacity %d rows per rank%s, overflow %s", self.layout, self.pad,
        self.capacity, self.expert_capacity and (", expert capacity " .. self.expert_capacity) or "", self.overflow),
      string.format("  experts   %d per rank, SwiGLU H = %d, F = %d", self.local_experts, self.hidden, self.ffn),
    }
    if self.shared_ffn > 0 then
      lines[#lines + 1] = string.format("  shared    SwiGLU F = %d%s", self.shared_ffn,
        c.shared_gate and ", sigmoid-gated" or "")
    end
    lines[#lines + 1] = "  combine   top-k in order, f32 accumulation, bf16 out"
    return table.concat(lines, "\n")
  end

  -- The layer over a real world (lua/moelab/world_layer.lua), with what the two share.
  world_layer = require("moelab.world_layer")(moe, { schedule_stats = schedule_stats, dense_reference = dense_reference,
    skip_invalid = skip_invalid, check_begin = check_begin })
  return new_layer
end
