-- SPDX-License-Identifier: MIT
-- Calls on layers: moe.layer with random options (every size small, whatever else changes) and
-- each layer method.  A layer made by the sequence is run at once on an input kept aside; its
-- output then is the layer's known answer, which a later forward of that input must give again
-- bit for bit (determinism, and nothing in between corrupted it), and layer:check (the dense
-- reference of docs/design.md) must pass on every forward the fuzzer can vouch for.
local moe = require "moelab"
local mutate = require "fuzz.mutate"
local T = require "fuzz.tensors"

local G = {}
local plain = T.plain

-- The fuzzer's own tolerance against the dense reference: looser than design.md's, since its
-- layers are tiny (a hidden size of 1 leaves one value per token, where the bf16 roundings of
-- the pipeline do not average out, and terms of O(1) may cancel to 1e-3), with an absolute floor
-- far below the O(0.1 .. 1) of a wrong row or route (inputs N(0, 1), weights scaled to keep
-- activations O(1)).
local RTOL, L2, ATOL = 5e-2, 5e-2, 2e-3

-- Nil when metrics m of layer:check are within the fuzzer's tolerance, else the problem.
local function off(m, what)
  if type(m) ~= "table" then return what .. ": check gave " .. type(m) end
  if m.nans == 0 and m.infs == 0 and (m.max_abs <= ATOL or (m.max_abs <= RTOL * m.max_ref and m.rel_l2 <= L2)) then
    return nil
  end
  return string.format("%s: max |got - ref| %.4g of max |ref| %.4g, relative L2 %.4g, %d NaN", what, m.max_abs,
    m.max_ref, m.rel_l2, m.nans)
end

local PRESETS = {}
for name in pairs(moe.models) do PRESETS[#PRESETS + 1] = name end
table.sort(PRESETS)

local SCORINGS = { "softmax", "sigmoid", "sqrtsoftplus" }

-- sizes: small or refused (see EDGES in spec/fuzz/mutate.lua)
local SIZE_EDGES = { 0, -1, 1, 2.0, 2 ^ 41, 2 ^ 53, -2 ^ 31 }
local function size(ok) return { kind = "int", edges = SIZE_EDGES, ok = ok } end

local LAYER_SPEC = {
  model = { kind = "any" }, world = { kind = "any" }, tokens = size(function(v) return v >= 1 end),
  hidden = size(function(v) return v >= 1 end), ffn = size(function(v) return v >= 1 end),
  experts = size(), k = size(), shared_ffn = size(function(v) return v >= 0 end), shared_gate = { kind = "bool" },
  shared = { kind = "bool" }, scoring = { kind = "str", choices = SCORINGS }, groups = size(), topk_groups = size(),
  scale = { kind = "num" }, pad = size(function(v) return v >= 1 end), layout = { kind = "str", choices = { "roundrobin", "peer_major" } },
  capacity = { kind = "any" }, expert_capacity = size(function(v) return v >= 0 end),
  overflow = { kind = "str", choices = { "error", "drop" } }, invalid = { kind = "str", choices = { "error", "skip" } },
  nan = { kind = "str", choices = { "error", "mask" } }, device = { kind = "device" }, seed = { kind = "int" },
}

-- Valid options of a small layer: a preset at small H and F, or a model of the fuzzer's own.
local function layer_options(F)
  local W = F.rng:pick { 1, 1, 2, 4 }
  local o = { tokens = F.rng:int(1, 4), hidden = F.rng:int(1, 12), ffn = F.rng:int(1, 6),
    seed = F.rng:chance(0.5) and F.rng:int(0, 9) or nil, world = F.rng:chance(0.8) and W or nil }
  if F.rng:chance(0.5) then
    o.model = F.rng:pick(PRESETS)
    local m = moe.models[o.model]
    if m.shared_ffn > 0 then
      if F.rng:chance(0.5) then o.shared_ffn = F.rng:int(1, 6) else o.shared = false end
    end
  else
    local EL = F.rng:int(1, 4)
    local m = { experts = W * EL, k = F.rng:int(1, math.min(W * EL, 4)), hidden = 8, ffn = 4,
      scoring = F.rng:chance(0.7) and F.rng:pick(SCORINGS) or nil }
    if m.scoring ~= nil and m.scoring ~= "softmax" then m.scale = F.rng:pick { 1, 2.5 } end
    if F.rng:chance(0.3) then m.shared_ffn, m.shared_gate = F.rng:int(1, 4), F.rng:chance(0.5) end
    o.model = m
  end
  o.pad = F.rng:chance(0.4) and F.rng:pick { 1, 2, 8, 128 } or nil
  o.layout = F.rng:chance(0.3) and F.rng:pick { "roundrobin", "peer_major" } or nil
  local r = F.rng:int(1, 6)
  if r == 1 then o.capacity = F.rng:pick { "worst", "twice_mean" } elseif r == 2 then o.capacity = F.rng:int(0, 64) end
  if F.rng:chance(0.4) then o.overflow = F.rng:pick { "error", "drop" } end
  -- an expert_capacity of 0 drops every route: only where drops are allowed
  if F.rng:chance(0.15) then o.expert_capacity = F.rng:int(o.overflow == "drop" and 0 or 1, 3) end
  if F.rng:chance(0.2) then o.invalid = F.rng:pick { "error", "skip" } end
  if F.rng:chance(0.2) then o.nan = F.rng:pick { "error", "mask" } end
  -- on the CPU, whatever the default device: the fuzzer's tensors are all there
  if F.rng:chance(0.2) or moe.default_device() ~= "cpu" then o.device = "cpu" end
  return o
end

-- An input of layer l: bf16 [W, T, H] drawn from seed.
local function input(l, seed)
  return moe.randn({ l.world, l.tokens, l.hidden }, { seed = seed, dtype = "bf16" })
end

-- A layer the fuzzer made: its known answer taken now (the output of a forward of an input kept
-- aside), which a later forward of that input must give again; nil and the problem when the
-- layer fails its own reference.
local function keep_layer(F, l)
  local entry = { layer = l, name = F.pool:name(l, "layer") }
  -- below these sizes the bf16 roundings of the pipeline, cancelling over a few terms, stray
  -- past any tolerance from the f32 reference; smaller layers are held to their known answer
  -- alone (the stages' own oracles cover small sizes)
  entry.checkable = l.hidden >= 8 and l.ffn >= 4 and (l.shared_ffn == 0 or l.shared_ffn >= 4)
    and l.world * l.tokens * l.hidden >= 32
  entry.x0 = input(l, F.rng:int(1, 999))
  local ok, out = pcall(l.forward, l, entry.x0)
  if ok then
    entry.out0 = out:flat()
    if entry.checkable then
      local problem = off(l:check(entry.x0, { raise = false }), "the new layer's first forward against its reference")
      if problem then return nil, problem end
    end
    entry.last_x = entry.x0:flat()
  else
    entry.err0 = tostring(out) -- the input overflows this layer's capacity: a later forward must raise too
    entry.last_x = nil
  end
  -- what the sequence may touch: the output, and the router's buffers; touching them spoils the
  -- known answer (owner)
  for _, f in ipairs { "out", "ids", "weights", "logits" } do
    local e = F.pool:add(l[f], nil, nil, true)
    e.owner = entry
    entry[f .. "_entry"] = e
  end
  F.layers[#F.layers + 1] = entry
  return entry
end

function G.layer(F)
  local o = layer_options(F)
  local bad
  local r = F.rng:int(1, 12)
  if r <= 5 then
    local _
    o, _, bad = mutate.options(F, o, LAYER_SPEC, { "model", "tokens" })
  elseif r == 6 then
    o.model = F.rng:pick { "kimi", "", 3, {}, { experts = 8, k = 2, hidden = 8, ffn = 4, expert = 1 } }
    bad = "no such model"
  elseif r == 7 then
    o.world = F.rng:pick { 0, -2, 3.5, "8", {}, setmetatable({}, moe.World) }
    bad = "not a world"
  elseif r == 8 then
    o.k = 1000
    bad = "k larger than the experts"
  elseif r == 9 then
    o.world = 3
    local m = type(o.model) == "string" and moe.models[o.model] or o.model
    if (o.experts or m.experts) % 3 ~= 0 then bad = "experts not a multiple of the world" end
  end
  local c = F:call { name = "moe.layer", args = { o }, n = 1, bad = bad }
  c.check = function(res)
    local l = res[2]
    if getmetatable(l) ~= moe.Layer then return "moe.layer returned " .. tostring(l) .. ", not a moelab.Layer" end
    local _, problem = keep_layer(F, l)
    return problem
  end
  return c
end

-- A layer of the sequence (a new valid one when there is none, or now and then).
local function some_layer(F)
  if #F.layers == 0 or F.rng:chance(0.1) then
    local l = moe.layer(layer_options(F))
    local entry, problem = keep_layer(F, l)
    if not entry then error(problem, 0) end
  end
  return F.rng:pick(F.layers)
end

-- An input for layer entry le: its known one, another valid one, or a wrong one (bad).
local function some_input(F, le)
  local l = le.layer
  local r = F.rng:int(1, 10)
  if r <= 4 then return le.x0, "x0" end
  if r <= 7 then
    local x = input(l, F.rng:int(1, 999))
    F.pool:add(x)
    return x
  end
  if r == 8 then return moe.zeros({ l.world, l.tokens, l.hidden }), nil, "an f32 input" end
  if r == 9 then return moe.zeros({ l.world, l.tokens + 1, l.hidden }, { dtype = "bf16" }), nil, "an input of another shape" end
  return F:closed_tensor(), nil, "a closed input"
end

local FORWARD_SPEC = { logits = { kind = "tensor", dtype = "f32" }, ids = { kind = "tensor", dtype = "i32" },
  weights = { kind = "tensor", dtype = "f32" }, check = { kind = "bool" } }

-- A routing given to forward: logits f32 [W T, E], or ids and weights [W, T, K].
local function given_routing(F, l)
  local W, Tn, K, E = l.world, l.tokens, l.k, l.experts
  if F.rng:chance(0.5) then
    local v = F:values(W * Tn * E)
    if F.rng:chance(0.1) then v[1] = 0 / 0 end
    return { logits = F:fresh("f32", { W * Tn, E }, v) }
  end
  local ids = {}
  for i = 1, W * Tn * K do ids[i] = F.rng:chance(0.05) and F.rng:pick { -1, E, -7 } or F.rng:int(0, E - 1) end
  return { ids = F:fresh("i32", { W, Tn, K }, ids), weights = F:fresh("f32", { W, Tn, K }, F:values(W * Tn * K, 1)) }
end

local function forward_call(F, le)
  local l = le.layer
  local x, known, xbad = some_input(F, le)
  local o = F.rng:chance(0.3) and given_routing(F, l) or {}
  if F.rng:chance(0.2) then o.check = F.rng:chance(0.5) end
  local bad = xbad
  if F.rng:chance(0.25) then
    local _, why
    o, _, why = mutate.options(F, o, FORWARD_SPEC)
    bad = bad or why
  end
  if plain(o) and ((o.ids == nil) ~= (o.weights == nil) or (o.ids and o.logits)) then bad = bad or "an incomplete routing" end
  local dot = F.rng:chance(0.08)
  local c = F:method { obj = l, method = "forward", args = { x, o }, n = 2, dot = dot, name = "layer:forward",
    names = { "forward", "layer" } }
  c.bad = dot and "a method called with '.'" or bad
  local given = plain(o) and (o.ids or o.logits)
  c.check = function(res)
    local out = res[2]
    -- a view of the layer's output buffer, the whole of it
    if not F.pool:entry_of(out) and mutate.is_tensor(out) then F.pool:add(out, le.out_entry, 0) end
    le.last_x, le.unchecked = x:flat(), o.check == false
    if le.damaged then return nil end
    if known and not given and plain(o) and not le.err0 then
      local got = out:flat()
      for i = 1, #le.out0 do
        if got[i] ~= le.out0[i] and not (got[i] ~= got[i] and le.out0[i] ~= le.out0[i]) then
          return string.format("a forward of the layer's first input differs from its first output at element %d: "
            .. "%s, then %s", i, tostring(le.out0[i]), tostring(got[i]))
        end
      end
    end
    if known and le.err0 and not given and o.check ~= false then
      return "a forward raised on this input once, then returned: " .. le.err0
    end
    if o.check == false or not le.checkable then return nil end -- data conditions left to check, which raises them
    return off(l:check(x, { raise = false }), "the forward against its reference")
  end
  c.on_error = function()
    if not l.forwarded then le.last_x = nil end -- the buffers hold part of a pass: check must refuse
  end
  return c
end

local function check_call(F, le)
  local l = le.layer
  local x, _, xbad = some_input(F, le)
  local o = { raise = F.rng:chance(0.5) and F.rng:chance(0.5) or nil, sample = F.rng:chance(0.2) and F.rng:int(1, 4) or nil }
  local bad = xbad
  if F.rng:chance(0.2) then
    local _, why
    o, _, why = mutate.options(F, o, { sample = { kind = "int", ok = function(v) return v >= 1 end },
      rtol = { kind = "num", ok = function(v) return v >= 0 end }, l2 = { kind = "num", ok = function(v) return v >= 0 end },
      raise = { kind = "bool" } })
    bad = bad or why
  end
  local c = F:method { obj = l, method = "check", args = { x, o }, n = 2, name = "layer:check", names = { "check", "layer" } }
  c.bad = bad
  local same = le.last_x and not bad and mutate.is_tensor(x) and not x.closed and T.shape_equal(x.shape, { l.world, l.tokens, l.hidden })
  if same then
    local now = x:flat()
    for i = 1, #now do if now[i] ~= le.last_x[i] then same = false break end end
  end
  if not le.last_x then c.bad = c.bad or "check before a forward completed" end
  -- the last forward's input, a forward that read its stats back, the default tolerances: it passes
  local must_pass = same and le.checkable and not le.damaged and not le.unchecked and plain(o) and not o.rtol
    and not o.l2
  -- out of the default tolerances is the verdict of check on so small a layer, but not of the
  -- fuzzer's: then metrics within its own must be why
  local function why_not(msg)
    if not must_pass then return nil end
    local problem = off(l:check(x, { raise = false, sample = o.sample }), "check of the last forward's input")
    if problem then return problem .. (msg and (": " .. tostring(msg)) or "") end
    if msg and not tostring(msg):find("not close", 1, true) then
      return "check of the last forward's input raised: " .. tostring(msg)
    end
  end
  c.check = function(res)
    if o.raise == false and type(res[2]) ~= "table" then return "check gave " .. type(res[2]) end
    if o.raise == false and not res[2].pass then return why_not() end
  end
  c.after_error = why_not
  return c
end

local function reference_call(F, le)
  local l = le.layer
  local x, _, xbad = some_input(F, le)
  local o = {}
  local N = l.world * l.tokens
  local r = F.rng:int(1, 6)
  if r == 1 then o.tokens = { 0, N - 1 }
  elseif r == 2 then
    o.routing = F.rng:pick { "own", "forward" }
    if o.routing == "forward" and not l.forwarded then xbad = xbad or "routing = 'forward' before a forward" end
  elseif r == 3 then
    o = given_routing(F, l)
  elseif r == 4 then
    o.tokens = { F.rng:pick { N, -1, 0.5, "0" } }
    xbad = xbad or "a token outside the layer"
  end
  local c = F:method { obj = l, method = "reference", args = { x, o }, n = 2, name = "layer:reference",
    names = { "reference", "layer" } }
  c.bad = xbad
  c.check = function(res)
    local ref = res[2]
    local rows = o.tokens and #o.tokens or nil
    local want = rows and { rows, l.hidden } or { l.world, l.tokens, l.hidden }
    local problem = T.holds(ref, "f32", want, nil, "the reference")
    if problem then return problem end
    -- the same again, whole: the rows asked for are rows of it
    local whole = l:reference(x, (o.routing or o.logits or o.ids) and o or nil)
    if rows then
      local part, all = ref:flat(), whole:flat()
      for k, tok in ipairs(o.tokens) do
        for h = 1, l.hidden do
          local a, b = part[(k - 1) * l.hidden + h], all[tok * l.hidden + h]
          if a ~= b and not (a ~= a and b ~= b) then
            return string.format("reference row %d (token %d) differs from the whole reference", k, tok)
          end
        end
      end
    end
  end
  return c
end

local PLAIN_METHODS = { "plan", "stats", "stage_times", "capture", "__tostring" }

function G.layer_method(F)
  local le = some_layer(F)
  local r = F.rng:int(1, 10)
  if r <= 4 then return forward_call(F, le) end
  if r <= 6 then return check_call(F, le) end
  if r == 7 then return reference_call(F, le) end
  local l = le.layer
  local m = F.rng:pick(PLAIN_METHODS)
  if m == "__tostring" then
    return { name = "tostring(layer)", text = "tostring(" .. le.name .. ")", names = { "tostring" },
      fn = function() return tostring(l) end,
      check = function(res) if type(res[2]) ~= "string" then return "tostring gave " .. type(res[2]) end end }
  end
  local dot = F.rng:chance(0.15)
  local args, n = {}, 0
  if m == "plan" and F.rng:chance(0.5) then args, n = { some_input(F, le) }, 1 end
  local c = F:method { obj = l, method = m, args = args, n = n, dot = dot, name = "layer:" .. m,
    names = { m, "layer", "layer:" .. m } }
  if dot then c.bad = "a method called with '.'" end
  if m == "capture" then c.bad = "a capture on the CPU" end
  c.check = function(res)
    local v = res[2]
    if type(v) ~= "table" then return m .. "() gave " .. type(v) end
    if m == "stats" and not le.damaged then
      if type(v.routes) ~= "number" or v.routes > l.world * l.tokens * l.k or v.dropped < 0 then
        return "stats() out of range: routes " .. tostring(v.routes)
      end
    end
    if m == "plan" then
      for _, rk in ipairs(v) do
        if type(rk.schedule) ~= "table" or type(rk.experts) ~= "table" then return "plan() lacks a stage's choice" end
      end
    end
  end
  return c
end

return G
