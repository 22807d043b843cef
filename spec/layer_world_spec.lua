-- SPDX-License-Identifier: MIT
-- moe.layer over a real world, its Lua path run on the CPU: a moe.World whose NCCL handle is a
-- stand-in (every rank in this process, the exchange done with the plain stages), against the
-- simulated layer of the same options bit for bit, bf16 and FP8.  The world itself is exercised
-- on GPUs by world_spec.lua's #gpu cases.
local S = require "support"

-- A stand-in for the binding's World handle of W ranks, all on the CPU.
local function stand_in(W)
  local h = { calls = {} }
  function h:size() return W end
  function h:ranks() local r = {} for i = 1, W do r[i] = i - 1 end return r end
  function h:devices() local d = {} for i = 1, W do d[i] = "cpu" end return d end
  function h:bind(i) self.calls[#self.calls + 1] = "bind " .. i end
  function h:unbind() self.calls[#self.calls + 1] = "unbind" end
  function h:check_config() end
  function h:allgather_ids(outs, list)
    for _, out in ipairs(outs) do
      for r, t in ipairs(list) do out:select(r):copy(t) end
    end
  end
  -- the all-gather exchange of FP8 tokens, as lib/world.c composes it: every rank's rows and
  -- scales gathered, then each rank's dispatch of them
  function h:dispatch_fp8(calls)
    self.calls[#self.calls + 1] = "dispatch_fp8"
    for _, c in ipairs(calls) do
      for r, src in ipairs(calls) do
        c.x_all:select(r):copy(src.x)
        c.x_scale_all:select(r):copy(src.x_scale)
      end
      moe.core.dispatch_fp8 { out = c.out, out_scale = c.out_scale, x = c.x_all, x_scale = c.x_scale_all,
        peer_rank = c.peer_rank, peer_route = c.peer_route, k = c.k, zero_fill = c.zero_fill }
    end
  end
  function h:exchange(T, _, H, C)
    local ex, x, ys = {}, {}, {}
    for r = 1, W do
      x[r] = moe.zeros({ T, H }, { dtype = "bf16" })
      ys[r] = moe.zeros({ C, H }, { dtype = "bf16" })
    end
    function ex:dispatch(calls)
      local x_all = moe.zeros({ W, T, H }, { dtype = "bf16" })
      for r, c in ipairs(calls) do x_all:select(r):copy(c.x) end
      for _, c in ipairs(calls) do
        moe.core.dispatch { out = c.out, x = x_all, peer_rank = c.peer_rank, peer_route = c.peer_route, k = c.k,
          zero_fill = c.zero_fill }
      end
    end
    function ex:combine(calls)
      local all_ys, rows = {}, {}
      for r, c in ipairs(calls) do all_ys[r], rows[r] = c.ys, c.route_row end
      for r, c in ipairs(calls) do
        moe.core.combine { out = c.out, weights = c.weights, ids = c.ids, ys = all_ys, route_row = rows, world = W,
          experts = c.experts, rank = r - 1, shared = c.shared, shared_gate = c.shared_gate }
      end
    end
    return ex, x, ys
  end
  local world = setmetatable({ handle = h, size = W, ranks = h:ranks(), devices = h:devices(), local_count = W,
    rank = 0, device = "cpu", scratch = {} }, moe.World)
  return world, h
end

describe("moe.layer over a real world, with a stand-in for NCCL [#cpu]", function()
  for _, model in ipairs { "kimi_k2", "deepseek_v3" } do
    it(model .. ": the simulated layer's bits, its routing and its checks", function()
      local W, T, H = 2, 6, 32
      local opts = { model = model, tokens = T, hidden = H, ffn = 16, shared_ffn = 16, experts = 8, k = 2, seed = 3 }
      local world, h = stand_in(W)
      opts.world = world
      local real = moe.layer(opts)
      opts.world, opts.device = W, "cpu"
      local sim = moe.layer(opts)
      assert.are.equal(moe.Layer, getmetatable(real))
      local x = moe.randn({ W, T, H }, { dtype = "bf16", seed = 77 })
      for r = 1, W do real.inputs[r]:copy(x:select(r)) end
      local outs = real:forward(real.inputs)
      assert.are.equal("unbind", h.calls[#h.calls]) -- forward leaves the context unbound
      local ref = sim:forward(x)
      for r = 1, W do
        assert.tensor_equal(real.ids[r], sim.ids:select(r))
        assert.tensor_equal(real.schedules[r].route_row, sim.schedules[r].route_row)
        assert.tensor_equal(outs[r], ref:select(r))
      end
      assert.is_true(real:check(real.inputs, { raise = false }).pass)
      assert.is_true(real:check(real.inputs, { sample = 3, raise = false }).pass)
      local refs = real:reference(real.inputs)
      local whole = sim:reference(x)
      for r = 1, W do assert.tensor_equal(refs[r], whole:select(r)) end
      local part = real:reference(real.inputs, { sample = 3, routing = "forward" })
      assert.are.same({ 3, H }, part[2].shape)
      local st, sst = real:stats(), sim:stats()
      assert.are.same({ sst.routes, sst.rows_used, sst.dropped, sst.unscored }, { st.routes, st.rows_used, st.dropped,
        st.unscored })
      local times = real:stage_times()
      for _, stage in ipairs { "route", "schedule", "dispatch", "experts", "shared", "combine" } do
        assert.is_number(times[stage], stage)
      end
      assert.matches("over a world of 2 GPUs", tostring(real))
      -- given routing: the simulated layer's ids and weights of each rank give its outputs again
      local again = real:forward(real.inputs, { ids = { sim.ids:select(1), sim.ids:select(2) },
        weights = { sim.weights:select(1), sim.weights:select(2) } })
      for r = 1, W do assert.tensor_equal(again[r], ref:select(r)) end
    end)
  end

  for _, shared in ipairs { true, false } do
    it("precision = 'fp8'" .. (shared and " (shared expert)" or "") .. ": the simulated FP8 layer's bits, its check "
      .. "and its plan", function()
      local W, T, H = 2, 6, 128
      local opts = { model = "kimi_k2", tokens = T, hidden = H, ffn = 128, shared_ffn = 128, shared = shared,
        experts = 8, k = 2, seed = 3, precision = "fp8" }
      local world, h = stand_in(W)
      opts.world = world
      local real = moe.layer(opts)
      opts.world, opts.device = W, "cpu"
      local sim = moe.layer(opts)
      local x = moe.randn({ W, T, H }, { dtype = "bf16", seed = 78 })
      for r = 1, W do real.inputs[r]:copy(x:select(r)) end
      local outs = real:forward(real.inputs)
      local ref = sim:forward(x)
      local crossed = 0
      for _, call in ipairs(h.calls) do if call == "dispatch_fp8" then crossed = crossed + 1 end end
      assert.are.equal(1, crossed) -- the tokens crossed as e4m3 rows, once
      for r = 1, W do
        assert.tensor_equal(real.xq[r], sim.xq:select(r))
        assert.tensor_equal(real.xs[r], sim.xs[r])
        assert.tensor_equal(real.xs_scale[r], sim.xs_scale[r])
        assert.tensor_equal(outs[r], ref:select(r))
      end
      local m = real:check(real.inputs, { raise = false })
      assert.is_true(m.pass, string.format("rel_max %.3g, rel_l2 %.3g", m.rel_max, m.rel_l2))
      assert.are.equal(5e-2, m.rtol) -- the FP8 layer's tolerance, not the bf16 one
      assert.is_true(real:check(real.inputs, { sample = 3, raise = false }).pass)
      -- its memory is what it allocates, the gathered FP8 tokens and scales counted; the stand-in
      -- makes no route_row windows, which lib/world.c lays out beside x and ys
      local stated, got = real.memory, S.allocated(real)
      assert.are.equal(W * W * T * 2 * 4, stated.host - got.cpu)
      local plan = real:plan()
      assert.are.equal("allgather", plan[1].exchange.kernel)
      assert.is_nil(sim:plan()[1].exchange)
      assert.matches("all%-gather of the e4m3 tokens", tostring(real))
    end)
  end

  it("a bf16 layer's plan names the direct exchange", function()
    local layer = moe.layer { model = "kimi_k2", tokens = 4, hidden = 16, ffn = 8, experts = 4, k = 2,
      world = stand_in(2) }
    assert.are.equal("direct", layer:plan()[2].exchange.kernel)
  end)

  it("stops a forward on every rank when one has NaN logits, and names that rank", function()
    local world = stand_in(2)
    local layer = moe.layer { model = "kimi_k2", tokens = 4, hidden = 16, ffn = 8, experts = 4, k = 2, world = world }
    local flat = moe.randn({ 4, 4 }, { seed = 14 }):flat()
    flat[2 * 4 + 1] = 0 / 0
    local logits = { moe.randn({ 4, 4 }, { seed = 15 }), S.tensor(flat, "f32", { 4, 4 }) }
    local ok, err = pcall(function() layer:forward(layer.inputs, { logits = logits }) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("in 1 rows of rank 1, the first is token 2", 1, true), tostring(err))
    assert.truthy(tostring(err):find("^[^\n]-layer_world_spec%.lua:%d+: "), tostring(err))
    layer:forward(layer.inputs, { logits = logits, check = false })
    ok, err = pcall(layer.check, layer, layer.inputs)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("in 1 rows of rank 1 (those tokens were routed nowhere)", 1, true), tostring(err))
    ok, err = pcall(layer.forward, layer, layer.inputs[1])
    assert.is_false(ok)
    assert.truthy(tostring(err):find("'x' needs one tensor per local rank (2), got one", 1, true), tostring(err))
    ok, err = pcall(layer.capture, layer)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("this process holds 2 ranks", 1, true), tostring(err))
  end)
end)
