-- moe.layer{..., world = moe.world{...}}: one MoE layer over a real world of W GPUs.  Each rank
-- this process holds has its router, experts and buffers on its own GPU, made from the same
-- seeds as the simulated layer's rank (so the two compute the same bits); tokens cross GPUs in
-- the direct exchange (world:exchange: windows read over NVLink).  forward takes one x [T, H]
-- per local rank and returns one out [T, H] per local rank (a list, or the tensor itself when
-- this process holds one rank), each a view of the layer's own buffer, which the next pass
-- overwrites.  Every buffer is allocated when the layer is made.
local args = require "moelab.args"

-- shared: helpers of lua/moelab/layer.lua (schedule_stats, dense_reference, skip_invalid, check_begin).
return function(moe, shared)
  local core = moe.core
  local WorldLayer = { __name = "moelab.WorldLayer" }
  WorldLayer.__index = WorldLayer

  -- r: moe.layer's resolved options (lua/moelab/layer.lua), with r.real the moe.World.
  local function new(r)
    local group = r.real
    if r.device_given then
      args.fail("layer", "a layer over a moe.world puts each rank on its own GPU: drop option 'device'", 3)
    end
    local self = setmetatable(r, WorldLayer)
    self.group, self.real, self.device_given = group, nil, nil
    self.times = {}
    local W, T, E, EL, K, H, F, Fs = self.world, self.tokens, self.experts, self.local_experts, self.k, self.hidden,
      self.ffn, self.shared_ffn
    local C, cfg = self.capacity, self.cfg
    self.ranks, self.devices, self.nlocal = group.ranks, group.devices, group.local_count
    self.device = self.devices[1]

    -- Every rank must build the same layer: a mismatch fails on every rank, naming the field.
    local cfgs = {}
    for i = 1, self.nlocal do
      cfgs[i] = { tokens = T, k = K, experts = E, hidden = H, capacity = C, pad = self.pad, layout = self.layout,
        expert_capacity = self.expert_capacity }
    end
    group:check_config(self.nlocal == 1 and cfgs[1] or cfgs)
    -- and the model itself, which check_config (the exchange's sizes) does not see: ranks built
    -- with another seed or FFN width would compute a different layer without a word
    local fields, values = {}, {}
    local function field(name, v) fields[#fields + 1], values[#values + 1] = name, v end
    local function index(list, v) for j, s in ipairs(list) do if s == v then return j end end return 0 end
    field("ffn", F)
    field("shared_ffn", Fs)
    field("shared_gate", cfg.shared_gate and 1 or 0)
    field("scoring", index({ "softmax", "sigmoid", "sqrtsoftplus" }, cfg.scoring))
    field("groups", cfg.groups)
    field("topk_groups", cfg.topk_groups)
    field("scale", (string.unpack("<i4", string.pack("<f", cfg.scale))))
    field("seed (low 31 bits)", self.seed & 0x7fffffff)
    field("seed (high bits)", (self.seed >> 31) & 0x7fffffff)
    field("overflow", index({ "error", "drop" }, self.overflow))
    field("invalid", index({ "error", "skip" }, self.invalid))
    field("nan", index({ "error", "mask" }, self.nan))
    local mine, all = {}, {}
    for i = 1, self.nlocal do
      mine[i] = core.from_table({ values }, "i32", self.devices[i])
      all[i] = core.new("i32", { W, 1, #values }, self.devices[i])
    end
    group:allgather_ids(mine, all)
    group:bind(1) -- the read back goes on the stream of the all-gather
    local got = all[1]:flat()
    group:unbind()
    for r = 1, W - 1 do
      for j, name in ipairs(fields) do
        if got[r * #fields + j] ~= got[j] then
          args.fail("layer", string.format("ranks 0 and %d build different layers: '%s' is %d on rank 0, %d on rank %d "
            .. "(every rank must give moe.layer the same options)", r, name, got[j], got[r * #fields + j], r), 3)
        end
      end
    end

    local sd = self.seed * 1000
    local function randn(shape, s, std, dev) return core.new("bf16", shape, dev):randn(sd + s, std) end
    local L = { w_router = {}, bias = {}, w_gate_up = {}, w_down = {}, shared_gate_up = {}, shared_down = {},
      shared_gate_w = {}, logits = {}, ids = {}, weights = {}, route_stats = {}, all_ids = {}, schedules = {}, xs = {},
      out = {}, shared_y = {}, shared_offsets = {}, gate = {}, verdict = {}, verdicts = {} }
    for k, v in pairs(L) do self[k] = v end
    for i = 1, self.nlocal do
      local dev, rank = self.devices[i], self.ranks[i]
      -- the simulated layer's seeds: rank r's experts are its (r+1)-th
      self.w_router[i] = randn({ E, H }, 1, 1 / math.sqrt(H), dev)
      if cfg.scoring ~= "softmax" then self.bias[i] = core.new("f32", { E }, dev):randn(sd + 2, 0.005) end
      self.w_gate_up[i] = randn({ EL, 2 * F, H }, 10 + 2 * (rank + 1), 1 / math.sqrt(H), dev)
      self.w_down[i] = randn({ EL, H, F }, 11 + 2 * (rank + 1), 1 / math.sqrt(F), dev)
      if Fs > 0 then
        self.shared_gate_up[i] = randn({ 1, 2 * Fs, H }, 3, 1 / math.sqrt(H), dev)
        self.shared_down[i] = randn({ 1, H, Fs }, 4, 1 / math.sqrt(Fs), dev)
        if cfg.shared_gate then self.shared_gate_w[i] = randn({ H }, 5, 1 / math.sqrt(H), dev) end
        self.shared_y[i] = core.new("bf16", { T, H }, dev)
        self.shared_offsets[i] = core.from_table({ 0, T }, "i32", dev)
        if cfg.shared_gate then self.gate[i] = core.new("f32", { T }, dev) end
      end
      self.logits[i] = core.new("f32", { T, E }, dev)
      self.ids[i] = core.new("i32", { T, K }, dev)
      self.weights[i] = core.new("f32", { T, K }, dev)
      self.route_stats[i] = core.new("i32", { 2 }, dev)
      -- {NaN rows, schedule failed} of this rank, then every rank's: see run
      self.verdict[i] = core.new("i32", { 1, 2 }, dev)
      self.verdicts[i] = core.new("i32", { W, 1, 2 }, dev)
      self.all_ids[i] = core.new("i32", { W, T, K }, dev)
      self.schedules[i] = moe.schedule_plan({ ids = self.all_ids[i], experts = E, rank = rank, pad = self.pad,
        capacity = C, expert_capacity = self.expert_capacity, layout = self.layout, overflow = self.overflow,
        invalid = self.invalid }, "layer", 3)
      self.xs[i] = core.new("bf16", { C, H }, dev)
      self.out[i] = core.new("bf16", { T, H }, dev)
    end
    -- The exchange's windows: experts write their output straight into ys; tokens written into
    -- layer.inputs (its x windows) are not copied again by dispatch.
    self.exchange = group:exchange { tokens = T, k = K, hidden = H, capacity = C }
    self.inputs = self.exchange.x
    return self
  end

  local function each(self, fn)
    for i = 1, self.nlocal do
      self.group:bind(i)
      fn(i)
    end
  end

  -- Device events around a stage on every local rank; the stage lasts until its slowest rank.
  local function timed(self, name, fn)
    if not self.timing then return fn() end
    self.events = self.events or {}
    local ev = self.events[name]
    if not ev then
      ev = {}
      for i = 1, self.nlocal do ev[i] = { core.event_new(self.devices[i]), core.event_new(self.devices[i]) } end
      self.events[name] = ev
    end
    each(self, function(i) ev[i][1]:record() end)
    fn()
    each(self, function(i) ev[i][2]:record() end)
    self.times[name] = ev
  end

  function WorldLayer:stage_times()
    local t = {}
    for name, ev in pairs(self.times) do
      local worst = 0
      for i = 1, #ev do worst = math.max(worst, ev[i][2]:elapsed_since(ev[i][1])) end
      t[name] = worst
    end
    return t
  end

  local function per_rank(self, fname, name, v, dtype, shape)
    local list = v
    if args.is_tensor(v) then
      if self.nlocal ~= 1 then
        args.fail(fname, string.format("'%s' needs one tensor per local rank (%d), got one", name, self.nlocal), 3)
      end
      list = { v }
    end
    if type(list) ~= "table" or #list ~= self.nlocal then
      args.fail(fname, string.format("'%s' must be a list of %d tensors (one per local rank), got %s", name,
        self.nlocal, args.describe(v)), 3)
    end
    for i, t in ipairs(list) do
      args.tensor(fname, string.format("%s[%d]", name, i), t, dtype, shape, 3)
      if t.device ~= self.devices[i] then
        args.fail(fname, string.format("%s[%d] is on %s but local rank %d (rank %d) is on %s", name, i, t.device, i,
          self.ranks[i], self.devices[i]), 3)
      end
    end
    return list
  end

  local function run(self, x, o)
    local T, H, K = self.tokens, self.hidden, self.k
    local eager = o.check ~= false
    self.times, self.timing = {}, eager
    self.routed = o.ids == nil -- the router ran: route_stats are this pass's
    timed(self, "route", function()
      each(self, function(i)
        if o.ids then
          self.ids[i]:copy(o.ids[i])
          self.weights[i]:copy(o.weights[i])
          return
        end
        local logits = o.logits and o.logits[i] or self.logits[i]
        if not o.logits then core.logits(logits, x[i], self.w_router[i]) end
        core.route { ids = self.ids[i], weights = self.weights[i], stats = self.route_stats[i], logits = logits,
          bias = self.bias[i], k = K, scoring = self.cfg.scoring, groups = self.cfg.groups,
          topk_groups = self.cfg.topk_groups, scale = self.cfg.scale }
      end)
    end)
    -- The data conditions (NaN logits, a schedule's overflow or invalid ids) are decided by all
    -- ranks together, after the schedule: a rank that raised alone would leave the others waiting
    -- in the next collective until the world's timeout.  Errors carry no position here: forward
    -- gives its caller's.
    local own = {} -- this process's messages, by local rank
    local nan = {}
    if eager and not o.ids and self.nan == "error" then
      for i = 1, self.nlocal do
        self.group:bind(i)
        local st = self.route_stats[i]:flat()
        nan[i] = st[1]
        if st[1] > 0 then
          own[i] = string.format("layer: route: router logits contain NaN or cannot be scored (+inf, all -inf) in %d "
            .. "rows of rank %d, the first is token %d", st[1], self.ranks[i], st[2])
        end
      end
    end
    timed(self, "schedule", function()
      self.group:allgather_ids(self.ids, self.all_ids)
      each(self, function(i) self.schedules[i]:run() end)
    end)
    if eager then
      local failed = {}
      each(self, function(i)
        local ok, err = pcall(self.schedules[i].check, self.schedules[i])
        if not ok then
          failed[i] = 1
          own[i] = own[i] or "layer: " .. tostring(err)
        end
        self.verdict[i]:copy(core.from_table({ { nan[i] or 0, failed[i] or 0 } }, "i32", "cpu"))
      end)
      self.group:allgather_ids(self.verdict, self.verdicts)
      for i = 1, self.nlocal do if own[i] then error(own[i], 0) end end
      self.group:bind(1)
      local v = self.verdicts[1]:flat()
      for r = 0, self.world - 1 do
        if v[2 * r + 1] > 0 or v[2 * r + 2] > 0 then
          error(string.format("layer: rank %d stopped this forward (%s); its own error says why", r,
            v[2 * r + 1] > 0 and "router logits with NaN or unscorable rows" or "its schedule: capacity overflow or "
            .. "invalid ids"), 0)
        end
      end
    end
    local ex = self.exchange
    timed(self, "dispatch", function()
      local calls = {}
      for i = 1, self.nlocal do calls[i] = { x = x[i], schedule = self.schedules[i], out = self.xs[i] } end
      ex:dispatch(calls)
    end)
    timed(self, "experts", function()
      each(self, function(i)
        core.experts { ys = ex.ys[i], xs = self.xs[i], expert_offsets = self.schedules[i].expert_offsets,
          w_gate_up = self.w_gate_up[i], w_down = self.w_down[i] }
      end)
    end)
    if self.shared_ffn > 0 then
      timed(self, "shared", function()
        each(self, function(i)
          core.experts { ys = self.shared_y[i], xs = x[i], expert_offsets = self.shared_offsets[i],
            w_gate_up = self.shared_gate_up[i], w_down = self.shared_down[i] }
          if self.gate[i] then core.sigmoid_gate(self.gate[i], x[i], self.shared_gate_w[i]) end
        end)
      end)
    end
    timed(self, "combine", function()
      local calls = {}
      for i = 1, self.nlocal do
        calls[i] = { schedule = self.schedules[i], y = ex.ys[i], weights = self.weights[i], ids = self.ids[i],
          out = self.out[i], shared = self.shared_y[i], shared_gate = self.gate[i] }
      end
      ex:combine(calls)
    end)
    self.forwarded = true -- its buffers now hold a pass (capture puts the flag back: nothing ran)
    -- views of the layer's buffers: closing them leaves the layer whole
    local out = {}
    for i = 1, self.nlocal do out[i] = self.out[i]:view(0, self.out[i].shape) end
    return self.nlocal == 1 and out[1] or out
  end

  -- forward(x [, {logits=, ids=, weights=, check=}]): x, logits, ids and weights one per local
  -- rank (lists, or the tensors themselves with one local rank).  Leaves the module's context
  -- unbound, as it found it.
  function WorldLayer:forward(x, o)
    o = args.options("forward", o or {}, { logits = "any", ids = "any", weights = "any", check = "boolean" })
    if (o.ids == nil) ~= (o.weights == nil) then args.fail("forward", "give 'ids' and 'weights' together") end
    if o.ids and o.logits then args.fail("forward", "give either 'logits' or 'ids' and 'weights', not both") end
    local T, H, K, E = self.tokens, self.hidden, self.k, self.experts
    x = per_rank(self, "forward", "x", x, "bf16", { T, H })
    local oo = { check = o.check }
    if o.ids then
      oo.ids = per_rank(self, "forward", "ids", o.ids, "i32", { T, K })
      oo.weights = per_rank(self, "forward", "weights", o.weights, "f32", { T, K })
    end
    if o.logits then oo.logits = per_rank(self, "forward", "logits", o.logits, "f32", { T, E }) end
    self.forwarded = false -- until this pass completes the buffers hold part of it
    local ok, res = pcall(run, self, x, oo)
    local unbound, uerr = pcall(self.group.unbind, self.group) -- after a failure too, without hiding it
    if not ok then error(res, 2) end -- at the caller's line (run's own errors carry no position)
    if not unbound then error(uerr, 2) end
    return res
  end

  -- fn(i) with the module's context bound to local rank i's stream, for each local rank in turn
  -- until fn returns a value; leaves the context unbound, after an error too (as forward does).
  local function on_each_rank(self, fn)
    local ok, res = pcall(function()
      for i = 1, self.nlocal do
        self.group:bind(i)
        local v = fn(i)
        if v ~= nil then return v end
      end
    end)
    local unbound, uerr = pcall(self.group.unbind, self.group)
    if not ok then error(res, 0) end
    if not unbound then error(uerr, 0) end
    return res
  end

  -- What the last forward did on the local ranks: rows, padding, loads, drops (DESIGN.md).
  -- unscored: rows the router could not score (NaN, +inf, all -inf) on the local ranks.
  function WorldLayer:stats()
    local st = shared.schedule_stats(self.schedules, self.local_experts, self.ranks)
    st.unscored = 0
    if self.routed then
      on_each_rank(self, function(i) st.unscored = st.unscored + self.route_stats[i]:flat()[1] end)
    end
    return st
  end

  -- What the layer's policies do not allow in its last pass on the local ranks (NaN logits under
  -- nan = 'error', a schedule's overflow or invalid ids), as an eager forward raises it -> the
  -- message, or nil.
  local function policy_error(self)
    return on_each_rank(self, function(i)
      local st = self.routed and self.nan == "error" and self.route_stats[i]:flat() or { 0 }
      if st[1] > 0 then
        return string.format("layer: route: router logits contained NaN or could not be scored (+inf, all -inf) in "
          .. "%d rows of rank %d (those tokens were routed nowhere)", st[1], self.ranks[i])
      end
      local s = self.schedules[i]
      local ok, err = pcall(s.check, s)
      if not ok then return "layer: " .. tostring(err) end
    end)
  end

  -- Every rank's expert weights on the CPU, for the reference: the local ranks' copied from
  -- their GPUs, the others' drawn on the CPU from the same seeds (moe.randn gives the same values
  -- on every device).
  local function cpu_weights(self)
    if self.cpu then return self.cpu end
    local F, H, EL, Fs = self.ffn, self.hidden, self.local_experts, self.shared_ffn
    local sd = self.seed * 1000
    local c = { w_gate_up = {}, w_down = {} }
    local here = {}
    for i, r in ipairs(self.ranks) do here[r] = i end
    for r = 0, self.world - 1 do
      local i = here[r]
      if i then
        c.w_gate_up[r + 1], c.w_down[r + 1] = self.w_gate_up[i]:to("cpu"), self.w_down[i]:to("cpu")
      else
        c.w_gate_up[r + 1] = core.new("bf16", { EL, 2 * F, H }, "cpu"):randn(sd + 10 + 2 * (r + 1), 1 / math.sqrt(H))
        c.w_down[r + 1] = core.new("bf16", { EL, H, F }, "cpu"):randn(sd + 11 + 2 * (r + 1), 1 / math.sqrt(F))
      end
    end
    if Fs > 0 then
      c.shared_gate_up, c.shared_down = self.shared_gate_up[1]:to("cpu"), self.shared_down[1]:to("cpu")
      c.shared_gate_w = self.shared_gate_w[1] and self.shared_gate_w[1]:to("cpu")
    end
    self.cpu = c
    return c
  end

  -- The sampled rows of every local rank, on the CPU: n evenly spaced tokens of each (all T
  -- when n is T), stacked rank after rank.
  local function sample_rows(self, list, n, width, dtype)
    local T = self.tokens
    local g = core.new(dtype, { n * self.nlocal, width }, "cpu")
    for i = 1, self.nlocal do
      local c = list[i]:to("cpu")
      for j = 0, n - 1 do g:select((i - 1) * n + j + 1):copy(c:select((j * T) // n + 1)) end
    end
    return g
  end

  -- reference(x [, {routing = "own"|"forward", sample = n}]) -> f32 on the CPU: the dense
  -- reference of DESIGN.md for the local ranks' tokens, one [n, H] per local rank (a list, or
  -- the tensor itself with one local rank; n = T unless sample is given: n evenly spaced tokens).
  -- routing "own" (the default) routes x on the CPU with the layer's router; "forward" takes
  -- the routing the last forward chose.
  function WorldLayer:reference(x, o)
    o = args.options("reference", o or {}, { routing = { "own", "forward" }, sample = "integer" })
    if o.routing == "forward" and not self.forwarded then
      args.fail("reference", "routing = 'forward' before any forward completed: there is no routing to take")
    end
    local T, H, K = self.tokens, self.hidden, self.k
    x = per_rank(self, "reference", "x", x, "bf16", { T, H })
    local n = o.sample and math.min(o.sample, T) or T
    args.range("reference", "sample", n, 1)
    local c = cpu_weights(self)
    local xc = sample_rows(self, x, n, H, "bf16")
    local ids, w
    if o.routing == "forward" then
      ids, w = sample_rows(self, self.ids, n, K, "i32"), sample_rows(self, self.weights, n, K, "f32")
      ids = shared.skip_invalid(ids, self.experts) -- as the forward did (it raises otherwise)
    else
      c.w_router = c.w_router or self.w_router[1]:to("cpu")
      c.bias = c.bias or (self.bias[1] and self.bias[1]:to("cpu"))
    end
    local ref = shared.dense_reference(self, c, xc, ids, w)
    if self.nlocal == 1 then return ref end
    local out = {}
    for i = 1, self.nlocal do out[i] = ref:view((i - 1) * n * H, { n, H }) end
    return out
  end

  -- check(x [, {sample = n, rtol =, l2 =, raise =}]): the last forward's output of every local
  -- rank against the dense f32 reference on the CPU, with the routing the forward chose; with
  -- sample, n evenly spaced tokens of each local rank.  Raises when out of tolerance unless
  -- raise = false, which returns the metrics and .pass.  The reference leaves out invalid ids
  -- (skipped by the forward) but counts every valid route: which routes another process's
  -- capacity dropped is not known here, so a forward that dropped routes (layer:stats().dropped)
  -- differs from it by those routes.
  function WorldLayer:check(x, o)
    o = shared.check_begin(self, o, policy_error)
    local T, H = self.tokens, self.hidden
    x = per_rank(self, "check", "x", x, "bf16", { T, H })
    local n = o.sample and math.min(o.sample, T) or T
    args.range("check", "sample", n, 1)
    local ref = self:reference(x, { routing = "forward", sample = n })
    if self.nlocal > 1 then
      local all = core.new("f32", { n * self.nlocal, H }, "cpu")
      for i = 1, self.nlocal do all:view((i - 1) * n * H, { n, H }):copy(ref[i]) end
      ref = all
    end
    local got = sample_rows(self, self.out, n, H, "bf16")
    return moe.check.verdict(got, ref, o, "layer")
  end

  -- capture([x]) -> a graph of the forward pass of this process's one rank over x (default:
  -- layer.inputs, its exchange window).  A process that holds several ranks cannot capture
  -- them as one graph (each rank's work is on its own GPU's stream).
  local Graph = { __name = "moelab.WorldLayerGraph" }
  Graph.__index = Graph

  function WorldLayer:capture(x)
    if self.nlocal ~= 1 then
      error(string.format("layer:capture: this process holds %d ranks; a graph captures one GPU's stream, so "
        .. "capture with one rank per process (moe.world{rank=, size=, ...})", self.nlocal), 2)
    end
    x = per_rank(self, "capture", "x", x or self.inputs, "bf16", { self.tokens, self.hidden })
    self.group:bind(1)
    -- a capture runs nothing: the buffers hold what they held before it, until a replay
    local forwarded, routed = self.forwarded, self.routed
    local ok, graph = pcall(moe.graph, function() run(self, x, { check = false }) end, { device = self.device })
    self.forwarded, self.routed = forwarded, routed
    self.group:unbind()
    if not ok then args.raise(graph) end
    return setmetatable({ graph = graph, layer = self }, Graph)
  end

  function Graph:replay()
    self.graph:replay()
    self.layer.forwarded, self.layer.routed = true, true -- the captured pass routes for itself
    -- a view of the output buffer, made again only if the caller closed it (replay allocates nothing)
    if not self.out or self.out.closed then self.out = self.layer.out[1]:view(0, self.layer.out[1].shape) end
    return self.out
  end

  function Graph:check()
    local why = policy_error(self.layer)
    if why then error(why, 2) end
    return self
  end

  function WorldLayer:__tostring()
    local c = self.cfg
    local here = {}
    for i = 1, self.nlocal do here[i] = string.format("rank %d on %s", self.ranks[i], self.devices[i]) end
    return table.concat({
      string.format("moelab.Layer(%s over a world of %d GPUs; here: %s; %d tokens per rank)", c.name, self.world,
        table.concat(here, ", "), self.tokens),
      string.format("  route     %s, E = %d, top-%d, scale %g", c.scoring, self.experts, self.k, c.scale),
      string.format("  schedule  %s, pad %d, capacity %d rows per rank, overflow %s", self.layout, self.pad,
        self.capacity, self.overflow),
      string.format("  experts   %d per rank, SwiGLU H = %d, F = %d", self.local_experts, self.hidden, self.ffn),
      "  exchange  direct: windows read over NVLink, top-k combined in order",
    }, "\n")
  end

  return new
end
