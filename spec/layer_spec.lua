-- SPDX-License-Identifier: MIT
-- The layer (stages composed over a simulated world of W ranks) against the dense reference of
-- docs/design.md, for every model preset at small H and F (real E and K), both layouts, pads 1 and
-- 128, with the bf16 tolerances of docs/design.md (moe.check.close defaults).
local S = require "support"

local H, F = 32, 16 -- hidden and expert FFN width of the small layers

local function preset_names()
  local names = {}
  for name in pairs(moe.models) do names[#names + 1] = name end
  table.sort(names)
  return names
end

local function small_layer(model, dev, o)
  local m = type(model) == "string" and moe.models[model] or model
  local opts = { model = model, world = 8, tokens = 4, hidden = H, ffn = F,
    shared_ffn = (m.shared_ffn or 0) > 0 and F or nil, device = dev, seed = 1 }
  for k, v in pairs(o or {}) do opts[k] = v end
  return moe.layer(opts)
end

local function input(layer, seed)
  return moe.randn({ layer.world, layer.tokens, layer.hidden }, { seed = seed or 2, dtype = "bf16",
    device = layer.device })
end

-- The dense reference of x.  On a GPU the router's logits (a GEMM) may differ from the CPU's in
-- the last bits, which may flip a near-tie: there the reference takes the routing the forward
-- chose (the route stage itself is held to the CPU's ids in route_spec.lua).
local function reference(layer, x)
  return layer:reference(x, layer.device ~= "cpu" and { routing = "forward" } or nil)
end

-- The routing of the last forward with every route that got no row (dropped) masked to -1:
-- what the layer's output must equal.  Returns ids i32 [W, T, K] on the CPU and the count.
local function surviving_ids(layer)
  local W, T, K, EL = layer.world, layer.tokens, layer.k, layer.local_experts
  local ids = layer.ids:flat()
  local rows = {}
  for r = 1, W do rows[r] = layer.schedules[r].route_row:flat() end
  local dropped = 0
  for i = 1, W * T * K do
    local id = ids[i]
    if id >= 0 and rows[math.floor(id / EL) + 1][i] < 0 then
      ids[i] = -1
      dropped = dropped + 1
    end
  end
  return S.tensor(ids, "i32", { W, T, K }), dropped
end

-- logits f32 [W*T, E] that route every token to the experts listed (the first gets the most)
local function logits_to(layer, experts)
  local N, E = layer.world * layer.tokens, layer.experts
  local flat = {}
  for n = 0, N - 1 do
    for e = 0, E - 1 do flat[n * E + e + 1] = -4 + (n + e) % 3 * 0.01 end
    for j, e in ipairs(experts) do flat[n * E + e + 1] = 8 - 0.5 * j end
  end
  return S.tensor(flat, "f32", { N, E }, layer.device)
end

for _, dev in ipairs(ALL_DEVICES) do
  describe("layer [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    describe("every preset against the dense reference", function()
      for _, name in ipairs(preset_names()) do
        it(name .. ", both layouts, pads 1 and 128", function()
          local first
          for _, layout in ipairs { "roundrobin", "peer_major" } do
            for _, pad in ipairs { 1, 128 } do
              local layer = small_layer(name, dev, { layout = layout, pad = pad })
              assert.are.equal(moe.models[name].experts, layer.experts)
              assert.are.equal(moe.models[name].k, layer.k)
              local x = input(layer)
              local out = layer:forward(x)
              assert.close(out, reference(layer, x))
              local st = layer:stats()
              assert.are.equal(8 * 4 * layer.k, st.routes)
              assert.are.equal(0, st.dropped)
              if pad == 128 then assert.are.equal(0, st.rows_used % 128) end
              -- a row's result does not depend on the rows it is grouped with (lib/mlp.h), and
              -- combine's order is fixed: the layouts and pads agree bit for bit on the CPU
              if dev == "cpu" then
                first = first or out:to("cpu")
                assert.tensor_equal(out, first, string.format("%s pad %d vs roundrobin pad 1", layout, pad))
              end
            end
          end
        end)
      end
    end)

    it("check and reference need a forward first, and take only what forward takes", function()
      local layer = small_layer("kimi_k2", dev)
      local x = input(layer)
      local W, T, K, E = layer.world, layer.tokens, layer.k, layer.experts
      assert.has_error(function() layer:check(x) end,
        "bad argument #1 to 'check' (no forward has completed (a capture runs nothing before its first replay): "
          .. "check compares the last pass's output)")
      assert.has_error(function() layer:reference(x, { routing = "forward" }) end,
        "bad argument #1 to 'reference' (routing = 'forward' before any forward completed: there is no routing to take)")
      local ok, err = pcall(layer.reference, layer, x, { logits = moe.zeros({ W * T, E - 1 }) })
      assert.is_false(ok)
      assert.truthy(err:find("option 'logits' must be f32 [" .. W * T .. ", " .. E .. "]", 1, true), err)
      ok, err = pcall(layer.reference, layer, x, { ids = moe.zeros({ 3 }, { dtype = "i32" }), weights = moe.zeros({ 3 }) })
      assert.is_false(ok)
      assert.truthy(err:find("option 'ids' must be i32 [" .. W .. ", " .. T .. ", " .. K .. "]", 1, true), err)
      ok, err = pcall(layer.reference, layer, x, { logits = moe.full({ W * T, E }, 0 / 0) })
      assert.is_false(ok)
      assert.truthy(err:find("reference: router logits contain NaN", 1, true), err)
      layer:forward(x)
      layer:check(x)
    end)

    it("an overridden router drops the preset settings that follow from the one replaced", function()
      local o = { world = 2, tokens = 4, hidden = 16, ffn = 8, device = dev }
      local function layer(t)
        for k, v in pairs(o) do t[k] = v end
        return moe.layer(t)
      end
      local l = layer { model = "deepseek_v3", groups = 1 } -- the preset keeps 4 of 8 groups
      assert.are.equal(1, l.cfg.topk_groups)
      l = layer { model = "deepseek_v3", groups = 4 }
      assert.are.equal(4, l.cfg.topk_groups)
      l = layer { model = "deepseek_v3", scoring = "softmax" } -- groups and scale are sigmoid's
      assert.are.same({ 1, 1, 1.0 }, { l.cfg.groups, l.cfg.topk_groups, l.cfg.scale })
      l = layer { model = "deepseek_v3", scoring = "sqrtsoftplus" }
      assert.are.same({ 1, 1, 2.5 }, { l.cfg.groups, l.cfg.topk_groups, l.cfg.scale })
      -- a kept-group count given with them is the caller's, and checked
      local ok, err = pcall(layer, { model = "glm5", scoring = "sqrtsoftplus", topk_groups = 4 })
      assert.is_false(ok)
      assert.truthy(tostring(err):find("option 'topk_groups' must be between 1 and 1, got 4", 1, true), tostring(err))
      local x = moe.randn({ 2, 4, 16 }, { dtype = "bf16", seed = 4, device = dev })
      l:forward(x)
      l:check(x)
    end)

    it("a model table without scoring routes by softmax, without a bias", function()
      local layer = small_layer({ experts = 16, k = 2, hidden = H, ffn = F }, dev)
      assert.are.equal("softmax", layer.cfg.scoring)
      assert.is_nil(layer.bias)
      local x = input(layer)
      assert.close(layer:forward(x), reference(layer, x))
    end)

    it("is the same on every run", function()
      local layer = small_layer("deepseek_v3", dev)
      local x = input(layer)
      local a = layer:forward(x):to("cpu")
      local b = layer:forward(x):to("cpu")
      assert.tensor_equal(b, a)
    end)

    describe("skewed routing", function()
      it("with given logits sending every token to the same experts (rank 0's)", function()
        local layer = small_layer("kimi_k2", dev, { capacity = 8 * 4 * 8 })
        local x = input(layer)
        local logits = logits_to(layer, { 0, 1, 2, 3, 4, 5, 6, 7 })
        local out = layer:forward(x, { logits = logits })
        assert.close(out, layer:reference(x, { logits = logits }))
        local st = layer:stats()
        assert.are.equal(8 * 4 * 8, st.ranks[1].routes)
        for r = 2, 8 do assert.are.equal(0, st.ranks[r].routes) end
      end)
      it("with top-1 and every token on one expert", function()
        local model = { name = "one", experts = 16, k = 1, hidden = H, ffn = F, scoring = "softmax" }
        for _, layout in ipairs { "roundrobin", "peer_major" } do
          local layer = small_layer(model, dev, { world = 4, tokens = 300, pad = 8, layout = layout,
            capacity = 1200 })
          local x = input(layer)
          local logits = logits_to(layer, { 13 })
          local out = layer:forward(x, { logits = logits })
          assert.close(out, layer:reference(x, { logits = logits }))
          local st = layer:stats()
          assert.are.equal(1200, st.loads[14])
          assert.are.equal(1200, st.max_load)
        end
      end)
      it("with given ids and weights, masked routes included", function()
        local layer = small_layer("qwen3_235b", dev)
        local x = input(layer)
        local ids, w = {}, {}
        for i = 0, 8 * 4 * 8 - 1 do
          ids[i + 1] = (i % 5 == 0) and -1 or (i * 37) % 128
          w[i + 1] = 0.125 + (i % 3) * 0.0625
        end
        local it_, wt = S.tensor(ids, "i32", { 8, 4, 8 }, dev), S.tensor(w, "f32", { 8, 4, 8 }, dev)
        local out = layer:forward(x, { ids = it_, weights = wt })
        assert.close(out, layer:reference(x, { ids = it_, weights = wt }))
      end)
    end)

    describe("the shared expert", function()
      it("on and off, each against its reference, and it matters", function()
        local on = small_layer("kimi_k2", dev)
        local off = small_layer("kimi_k2", dev, { shared = false })
        assert.are.equal(F, on.shared_ffn)
        assert.are.equal(0, off.shared_ffn)
        local x = input(on)
        local a = on:forward(x):to("cpu")
        assert.close(a, reference(on, x))
        local b = off:forward(x):to("cpu")
        assert.close(b, reference(off, x))
        assert.is_false(pcall(moe.check.close, a, b), "the shared expert changed nothing")
      end)
      it("added to a model without one (shared = true)", function()
        local layer = small_layer("qwen3_235b", dev, { shared = true })
        assert.are.equal(F, layer.shared_ffn)
        local x = input(layer)
        assert.close(layer:forward(x), reference(layer, x))
      end)
      it("sigmoid-gated (qwen3_5_397b), and the gate matters", function()
        local gated = small_layer("qwen3_5_397b", dev)
        local plain = small_layer("qwen3_5_397b", dev, { shared_gate = false })
        assert.is_truthy(gated.gate)
        assert.is_falsy(plain.gate)
        local x = input(gated)
        local a = gated:forward(x):to("cpu")
        assert.close(a, reference(gated, x))
        local b = plain:forward(x):to("cpu")
        assert.close(b, reference(plain, x))
        assert.is_false(pcall(moe.check.close, a, b), "the gate changed nothing")
      end)
    end)

    describe("capacity", function()
      it("expert_capacity drops routes, and the rest match the reference without them", function()
        local layer = small_layer("glm5", dev, { expert_capacity = 1, overflow = "drop" })
        local x = input(layer)
        local logits = logits_to(layer, { 0, 1, 2, 3, 40, 41, 42, 43 })
        local out = layer:forward(x, { logits = logits })
        local ids, dropped = surviving_ids(layer)
        assert.are.equal(layer:stats().dropped, dropped)
        assert.are.equal(8 * 4 * 8 - 8, dropped) -- one route per expert survives
        assert.close(out, layer:reference(x, { ids = ids, weights = layer.weights }))
        layer:check(x) -- against the routes that reached an expert, whole and sampled
        layer:check(x, { sample = 2 })
      end)
      it("overflow raises by default", function()
        local layer = small_layer("kimi_k2", dev, { capacity = 10 })
        local x = input(layer)
        local ok, err = pcall(layer.forward, layer, x)
        assert.is_false(ok)
        assert.truthy(tostring(err):find("capacity overflow on rank %d+: the routes need %d+ rows, capacity is 10"), err)
      end)
      it("overflow = 'drop' drops, and the rest match the reference without the dropped routes", function()
        for _, layout in ipairs { "roundrobin", "peer_major" } do
          local layer = small_layer("kimi_k2", dev, { capacity = 40, overflow = "drop", layout = layout, pad = 8 })
          local x = input(layer)
          local out = layer:forward(x, { logits = logits_to(layer, { 0, 1, 2, 3, 4, 5, 6, 7 }) })
          local st = layer:stats()
          assert.is_true(st.dropped > 0)
          local ids, dropped = surviving_ids(layer)
          assert.are.equal(st.dropped, dropped)
          assert.are.equal(8 * 4 * 8 - 40, dropped)
          assert.close(out, layer:reference(x, { ids = ids, weights = layer.weights }))
          layer:check(x)
          layer:check(x, { sample = 3 })
        end
      end)
      it("invalid = 'skip' skips, and check compares the routes that reached an expert", function()
        local layer = small_layer("kimi_k2", dev, { invalid = "skip" })
        local x = input(layer)
        local W, T, K, E = layer.world, layer.tokens, layer.k, layer.experts
        math.randomseed(7)
        local flat = {}
        for i = 1, W * T * K do -- invalid ids past E and below -1, the mask -1, valid ids
          flat[i] = S.chance(0.1) and E + S.int(0, 5) or S.chance(0.1) and -S.int(2, 9) or S.int(-1, E - 1)
        end
        local w = moe.randn({ W, T, K }, { seed = 8, device = dev })
        layer:forward(x, { ids = S.tensor(flat, "i32", { W, T, K }, dev), weights = w })
        assert.is_true(layer:stats().invalid > 0)
        layer:check(x)
        layer:check(x, { sample = 2 })
        layer:reference(x, { routing = "forward" }) -- the forward's routing, its invalid ids left out
      end)
      it("a forward that raised is no pass to check", function()
        local layer = small_layer("kimi_k2", dev)
        local x = input(layer)
        layer:forward(x)
        local W, T, K = layer.world, layer.tokens, layer.k
        local bad = moe.full({ W, T, K }, layer.experts + 1, { dtype = "i32", device = dev })
        assert.is_false(pcall(layer.forward, layer, x, { ids = bad, weights = moe.full({ W, T, K }, 0.5, { device = dev }) }))
        local ok, err = pcall(layer.check, layer, x)
        assert.is_false(ok)
        assert.truthy(tostring(err):find("no forward has completed", 1, true), tostring(err))
        layer:forward(x)
        layer:check(x)
      end)
    end)

    describe("data conditions", function()
      -- a valid routing with one weight made v, at rank 2, token 1, slot 3
      local function routing(layer, v)
        local W, T, K, E = layer.world, layer.tokens, layer.k, layer.experts
        local ids, w = {}, S.filled(W * T * K, 0.25)
        for i = 1, W * T * K do ids[i] = (i * 7) % E end
        w[(2 * T + 1) * K + 3 + 1] = v
        return S.tensor(ids, "i32", { W, T, K }, dev), S.tensor(w, "f32", { W, T, K }, dev)
      end
      for _, v in ipairs { 0 / 0, 1 / 0, -1 / 0 } do
        it("a given weight of " .. tostring(v) .. " is refused, the output left as the last pass wrote it", function()
          local layer = small_layer("kimi_k2", dev)
          local x = input(layer)
          local before = layer:forward(x):to("cpu")
          local ids, w = routing(layer, v)
          local ok, err = pcall(layer.forward, layer, x, { ids = ids, weights = w })
          assert.is_false(ok)
          assert.truthy(tostring(err):find("option 'weights' holds 1 value that is NaN or infinite, the first at rank 2, "
            .. "token 1, slot 3", 1, true), tostring(err))
          assert.tensor_equal(layer.out, before)
          assert.are.equal(1, layer:stats().nonfinite_weights)
        end)
      end
      it("a forward without checks counts them, and check raises them", function()
        local layer = small_layer("kimi_k2", dev)
        local x = input(layer)
        local ids, w = routing(layer, 0 / 0)
        layer:forward(x, { ids = ids, weights = w, check = false })
        assert.are.equal(1, layer:stats().nonfinite_weights)
        local ok, err = pcall(layer.check, layer, x)
        assert.is_false(ok)
        assert.truthy(tostring(err):find("option 'weights' holds 1 value", 1, true), tostring(err))
        ids, w = routing(layer, 0.5) -- finite again: nothing to count, nothing to raise
        layer:forward(x, { ids = ids, weights = w })
        assert.are.equal(0, layer:stats().nonfinite_weights)
        layer:check(x)
      end)
      it("a NaN among the tokens, with the routing given, reaches that token's output alone; check refuses it",
        function()
          local layer = small_layer("kimi_k2", dev)
          local ids, w = routing(layer, 0.5)
          local x = input(layer)
          x:view(layer.hidden + 5, { 1 }):fill(0 / 0) -- rank 0, token 1, one element
          local out = layer:forward(x, { ids = ids, weights = w }):to("cpu"):flat()
          for i, v in ipairs(out) do
            local token = math.floor((i - 1) / layer.hidden) -- over the ranks
            if token ~= 1 then assert.is_true(v == v, "token " .. token .. " is NaN") end
          end
          local nans = 0
          for i = layer.hidden + 1, 2 * layer.hidden do if out[i] ~= out[i] then nans = nans + 1 end end
          assert.are.equal(layer.hidden, nans)
          local ok, err = pcall(layer.check, layer, x)
          assert.is_false(ok)
          assert.truthy(tostring(err):find("NaN", 1, true), tostring(err))
        end)
      it("routes past expert_capacity raise under overflow = 'error', as any capacity's", function()
        local layer = small_layer("glm5", dev, { expert_capacity = 1 })
        local x = input(layer)
        local ok, err = pcall(layer.forward, layer, x, { logits = logits_to(layer, { 0, 1, 2, 3, 40, 41, 42, 43 }) })
        assert.is_false(ok)
        assert.truthy(tostring(err):find("expert capacity overflow on rank 0: 124 routes past expert_capacity = 1", 1,
          true), tostring(err))
      end)
    end)

    it("check takes the routing the forward was given (logits, or ids and weights)", function()
      local layer = small_layer("kimi_k2", dev)
      local x = input(layer)
      layer:forward(x, { logits = moe.randn({ layer.world * layer.tokens, layer.experts }, { seed = 3, device = dev }) })
      layer:check(x)
      layer:check(x, { sample = layer.tokens })
      layer:check(x, { sample = 2 })
      local other = small_layer("kimi_k2", dev, { seed = 9 }) -- another router: other ids
      other:forward(x)
      layer:forward(x, { ids = other.ids, weights = other.weights })
      layer:check(x)
      layer:forward(x) -- the router's own routing again: on the CPU checked against its own
      layer:check(x)
    end)

    if dev ~= "cpu" then
      it("is close to the CPU layer given the same routing", function()
        for _, name in ipairs { "kimi_k2", "qwen3_5_397b" } do
          local cpu = small_layer(name, "cpu", { pad = 128 })
          local gpu = small_layer(name, dev, { pad = 128 })
          local x = input(cpu)
          cpu:forward(x)
          local a = cpu.out:to("cpu")
          local ids, w = cpu.ids:to(dev), cpu.weights:to(dev)
          local b = gpu:forward(x:to(dev), { ids = ids, weights = w }):to("cpu")
          assert.close(b, a)
        end
      end)
    end

    it("NaN router logits raise, naming the token and rank", function()
      local layer = small_layer("qwen3_235b", dev)
      local x = input(layer)
      local flat = moe.zeros({ 8 * 4, 128 }):flat()
      flat[(4 * 5 + 2) * 128 + 7] = 0 / 0 -- token 2 of rank 5
      local ok, err = pcall(layer.forward, layer, x, { logits = S.tensor(flat, "f32", { 32, 128 }, dev) })
      assert.is_false(ok)
      assert.truthy(tostring(err):find("the first is token 2 of rank 5", 1, true), err)
    end)

    it("after a forward that did not check, stats() counts NaN rows and check raises what forward would have",
      function()
        local layer = small_layer("qwen3_235b", dev)
        local x = input(layer)
        local flat = moe.zeros({ 8 * 4, 128 }):flat()
        flat[(4 * 5 + 2) * 128 + 7], flat[7 * 128 + 1] = 0 / 0, 0 / 0 -- two rows
        layer:forward(x, { logits = S.tensor(flat, "f32", { 32, 128 }, dev), check = false })
        assert.are.equal(2, layer:stats().unscored)
        for _, raise in ipairs { true, false } do -- whatever raise says
          local ok, err = pcall(layer.check, layer, x, { raise = raise })
          assert.is_false(ok)
          assert.truthy(tostring(err):find("NaN or could not be scored (+inf, all -inf) in 2 rows", 1, true), err)
        end
        layer:forward(x) -- the router's own logits: nothing unscored, and check passes
        assert.are.equal(0, layer:stats().unscored)
        assert.is_true(layer:check(x, { raise = false }).pass)
        -- routing given as ids: the router did not run, so its last count is not this pass's
        local ids, weights = layer.ids:to(dev), layer.weights:to(dev)
        layer:forward(x, { logits = S.tensor(flat, "f32", { 32, 128 }, dev), check = false })
        layer:forward(x, { ids = ids, weights = weights })
        assert.are.equal(0, layer:stats().unscored)
        assert.is_true(layer:check(x, { raise = false }).pass)
      end)

    it("stage_times gives ms per stage of an eager forward, nothing for one with check = false", function()
      local layer = small_layer("qwen3_235b", dev)
      local x = input(layer)
      layer:forward(x)
      local t = layer:stage_times()
      for _, stage in ipairs { "route", "schedule", "dispatch", "experts", "combine" } do
        assert.is_true(type(t[stage]) == "number" and t[stage] >= 0, stage .. ": " .. tostring(t[stage]))
      end
      layer:forward(x, { check = false })
      assert.are.same({}, layer:stage_times())
    end)

    it("closing what forward returns leaves the layer whole", function()
      local layer = small_layer("kimi_k2", dev)
      local x = input(layer)
      do
        local out = layer:forward(x)
        assert.are.equal(layer.world, out.shape[1])
        out:close()
      end
      local again = layer:forward(x)
      assert.is_true(layer:check(x, { raise = false }).pass)
      assert.tensor_equal(again:to("cpu"), layer.out:to("cpu"))
    end)

    it("check raises a capacity overflow that a forward without checks let through", function()
      local layer = moe.layer { model = "qwen3_235b", world = 2, tokens = 8, hidden = 32, ffn = 16, experts = 8, k = 2,
        capacity = 4, device = dev }
      local x = moe.randn({ 2, 8, 32 }, { dtype = "bf16", seed = 9, device = dev })
      assert.is_false(pcall(layer.forward, layer, x))
      layer:forward(x, { check = false })
      assert.is_true(layer:stats().dropped > 0)
      local ok, err = pcall(layer.check, layer, x, { raise = false })
      assert.is_false(ok)
      assert.truthy(tostring(err):find("capacity", 1, true), err)
    end)
  end)
end

describe("the layer module [#cpu]", function()
  local tiny = { name = "tiny", experts = 4, k = 2, hidden = 16, ffn = 8 }

  it("is a class that init.lua re-exports, the one every world's layer is made of", function()
    local Layer = require "moelab.layer"
    assert.are.equal("table", type(Layer))
    assert.are.equal(moe.Layer, Layer)
    assert.are.equal(Layer.new, moe.layer)
    assert.are.equal(Layer, getmetatable(moe.layer { model = tiny, world = 2, tokens = 2, device = "cpu" }))
  end)

  it("takes its capacity as rows or as a named policy, twice the mean by default", function()
    local W, T, K, pad = 2, 3, 2, 4
    local function capacity(c)
      return moe.layer({ model = tiny, world = W, tokens = T, pad = pad, capacity = c, device = "cpu" }).capacity
    end
    local EL = math.floor(tiny.experts / W)
    assert.are.equal(2 * T * K + EL * pad, capacity(nil))
    assert.are.equal(2 * T * K + EL * pad, capacity("twice_mean"))
    assert.are.equal(W * T * K + EL * (pad - 1), capacity("worst"))
    assert.are.equal(17, capacity(17))
    assert.are.equal(17, capacity(17.0))
    for _, bad in ipairs { "most", 1.5, true } do
      local ok, err = pcall(capacity, bad)
      assert.is_false(ok)
      assert.truthy(tostring(err):find("option 'capacity' must be", 1, true), tostring(err))
      assert.truthy(tostring(err):find("layer_spec%.lua:%d+:"), tostring(err))
    end
    -- the same policies name a schedule's rows, worst case by default
    local ids = moe.zeros({ W, T, K }, { dtype = "i32" })
    local s = moe.schedule { ids = ids, experts = tiny.experts, pad = pad }
    assert.are.equal(W * T * K + EL * (pad - 1), s.capacity)
    s = moe.schedule { ids = ids, experts = tiny.experts, pad = pad, capacity = "twice_mean" }
    assert.are.equal(2 * T * K + EL * pad, s.capacity)
  end)

  it("draws its weights from the seed and the rank alone, not the tokens", function()
    local a = moe.layer { model = tiny, world = 2, tokens = 2, device = "cpu", seed = 7 }
    local b = moe.layer { model = tiny, world = 2, tokens = 5, device = "cpu", seed = 7 }
    assert.tensor_equal(a.w_router, b.w_router)
    for r = 1, 2 do
      assert.tensor_equal(a.w_gate_up[r], b.w_gate_up[r])
      assert.tensor_equal(a.w_down[r], b.w_down[r])
    end
  end)
end)
