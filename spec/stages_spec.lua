-- SPDX-License-Identifier: MIT
-- Dispatch, experts and combine (docs/design.md, "The stages", 3-5) with
-- payloads that say where they came from: a row of x holds its rank and token, a row of ys its
-- source rank, token, slot, owner and row, all small integers (exact in bf16), and the weights
-- are powers of two, so that every expected value below is exact.
local S = require "support"
local compat = require "moelab.compat"

local POISON = 7.5 -- written into outputs first; never a payload value (payloads are integers)

-- x[w][t][h] = (w*T + t + 1) * (-1)^h * 2^((h // 2) % 4): rank and token in every column, each
-- column scaled differently so that a shifted column shows.
local function payload_x(W, T, H)
  local flat = {}
  for w = 0, W - 1 do
    for t = 0, T - 1 do
      for h = 0, H - 1 do
        flat[#flat + 1] = (w * T + t + 1) * (h % 2 == 0 and 1 or -1) * 2 ^ (math.floor(h / 2) % 4)
      end
    end
  end
  return flat
end

local function random_ids(W, T, K, E, p_masked, seed)
  math.randomseed(seed)
  local ids = {}
  for i = 1, W * T * K do ids[i] = S.chance(p_masked) and -1 or S.int(0, E - 1) end
  return ids
end

-- ---------------------------------------------------------------- dispatch

local function check_dispatch(dev, c)
  local W, T, K, E, H = c.W, c.T, c.K, c.E, c.H
  local xflat = payload_x(W, T, H)
  local x = S.tensor(xflat, "bf16", { W, T, H }, dev)
  local ids = S.tensor(c.ids, "i32", { W, T, K }, dev)
  for rank = 0, W - 1 do
    for _, layout in ipairs { "roundrobin", "peer_major" } do
      local s = moe.schedule { ids = ids, experts = E, rank = rank, pad = c.pad, layout = layout,
        capacity = c.capacity, overflow = "drop" }
      local C = s.capacity
      for _, zero_fill in ipairs { false, true } do
        local out = moe.full({ C, H }, POISON, { dtype = "bf16", device = dev })
        local got = moe.dispatch { x = x, schedule = s, k = K, out = out, zero_fill = zero_fill }
        assert.are.equal(out, got)
        -- expected: each row that has a route holds its token; the others are untouched (or 0)
        local pr, pq = s.peer_rank:flat(), s.peer_route:flat()
        local want = {}
        local used = 0
        for row = 0, C - 1 do
          for h = 0, H - 1 do
            local v
            if pr[row + 1] >= 0 then
              local w, t = pr[row + 1], math.floor(pq[row + 1] / K)
              v = xflat[(w * T + t) * H + h + 1]
            else
              v = zero_fill and 0 or POISON
            end
            want[#want + 1] = v
          end
          if pr[row + 1] >= 0 then used = used + 1 end
        end
        assert.tensor_equal(out, want, string.format("rank %d %s zero_fill=%s", rank, layout, tostring(zero_fill)))
        -- and from the routes' side: every route that got a row finds its own token there
        local rr, xs = s.route_row:flat(), out:flat()
        local placed = 0
        for p = 0, W - 1 do
          for i = 0, T * K - 1 do
            local row = rr[p * T * K + i + 1]
            if row >= 0 then
              placed = placed + 1
              assert.are.equal(p * T + math.floor(i / K) + 1, xs[row * H + 1])
            end
          end
        end
        assert.are.equal(used, placed)
      end
    end
  end
end

-- ---------------------------------------------------------------- experts

local function silu(g) return g / (1 + math.exp(-g)) end

-- ys[row] for the rows of each expert, from the formula: y = W_down . bf16(silu(W_g x) * (W_u x)).
-- Rows outside every expert keep `keep` (the poisoned output).
local function experts_formula(xs, off, wgu, wd, C, H, F, EL, keep)
  local out = { compat.unpack(keep) }
  for e = 0, EL - 1 do
    for row = off[e + 1], off[e + 2] - 1 do
      local hv = {}
      for j = 0, F - 1 do
        local g, u = 0, 0
        for i = 0, H - 1 do
          local x = xs[row * H + i + 1]
          g = g + wgu[(e * 2 * F + j) * H + i + 1] * x
          u = u + wgu[(e * 2 * F + F + j) * H + i + 1] * x
        end
        hv[j] = S.bf16(silu(g) * u)
      end
      for i = 0, H - 1 do
        local y = 0
        for j = 0, F - 1 do y = y + wd[(e * H + i) * F + j + 1] * hv[j] end
        out[row * H + i + 1] = S.bf16(y)
      end
    end
  end
  return out
end

local function check_experts(dev, c)
  local C, H, F, EL = c.C, c.H, c.F, #c.offsets - 1
  local xs = moe.randn({ C, H }, { seed = c.seed, dtype = "bf16", device = dev })
  -- the capacity tail (rows past the last offset) NaN: no computed row may see it
  if c.nan_tail then xs:view(c.offsets[EL + 1] * H, { C - c.offsets[EL + 1], H }):fill(0 / 0) end
  local wgu = moe.randn({ EL, 2 * F, H }, { seed = c.seed + 1, std = 0.5, dtype = "bf16", device = dev })
  local wd = moe.randn({ EL, H, F }, { seed = c.seed + 2, std = 0.5, dtype = "bf16", device = dev })
  local off = S.tensor(c.offsets, "i32", { EL + 1 }, dev)
  local out = moe.full({ C, H }, POISON, { dtype = "bf16", device = dev })
  local got = moe.experts { x = xs, offsets = off, w_gate_up = wgu, w_down = wd, out = out }
  assert.are.equal(out, got)
  local want = experts_formula(xs:flat(), c.offsets, wgu:flat(), wd:flat(), C, H, F, EL, S.filled(C * H, POISON))
  local g = out:flat()
  -- rows past the last offset are untouched, bit for bit
  local last = c.offsets[EL + 1]
  local tail_got, tail_want = {}, {}
  for i = last * H + 1, C * H do tail_got[#tail_got + 1], tail_want[#tail_want + 1] = g[i], want[i] end
  assert.tensor_equal(tail_got, tail_want, "rows past the last offset")
  -- the computed rows within bf16 rounding of the formula (h rounded in double here, in f32 there)
  if last > 0 then
    local rows_got, rows_want = {}, {}
    for i = 1, last * H do rows_got[i], rows_want[i] = g[i], want[i] end
    assert.close(rows_got, rows_want, { rtol = 1e-2, l2 = 4e-3 })
  end
  return out
end

-- ---------------------------------------------------------------- combine

-- Builds a world of W ranks with real schedules (tight capacity: some routes dropped), expert
-- outputs ys holding payloads, and the expected out of each source rank.
local function combine_world(dev, c)
  local W, T, K, E, H = c.W, c.T, c.K, c.E, 5
  local ids = S.tensor(c.ids, "i32", { W, T, K }, dev)
  local schedules, ys, yflat = {}, {}, {}
  local dropped = 0
  for o = 0, W - 1 do
    local s = moe.schedule { ids = ids, experts = E, rank = o, pad = 2, capacity = c.capacity, overflow = "drop",
      invalid = "skip" }
    schedules[o + 1] = s
    dropped = dropped + s:read_stats().dropped
    local pr, pq = s.peer_rank:flat(), s.peer_route:flat()
    local f = {}
    for row = 0, s.capacity - 1 do
      local p, i = pr[row + 1], pq[row + 1]
      -- payload: source rank and token, slot, owner, row; padding rows hold 1000 (never read)
      local vals = p >= 0 and { p * T + math.floor(i / K) + 1, i % K + 1, o + 1, row % 64 + 1, -(p + 1) } or
        { 1000, 1000, 1000, 1000, 1000 }
      for h = 1, H do f[#f + 1] = vals[h] end
    end
    yflat[o + 1] = f
    ys[o + 1] = S.tensor(f, "bf16", { s.capacity, H }, dev)
  end
  -- weights: powers of two with signs, per source rank [T, K]
  local weights, wflat = {}, {}
  for p = 0, W - 1 do
    local f = {}
    for t = 0, T - 1 do
      for k = 0, K - 1 do f[#f + 1] = ((t + k + p) % 3 == 0 and -1 or 1) * 2 ^ -(k + (t % 2)) end
    end
    wflat[p + 1] = f
    weights[p + 1] = S.tensor(f, "f32", { T, K }, dev)
  end
  -- shared expert output and gate of each source rank
  local shared, sflat, gate, gflat = {}, {}, {}, {}
  for p = 0, W - 1 do
    local f, g = {}, {}
    for t = 0, T - 1 do
      for h = 0, H - 1 do f[#f + 1] = (t + 1) * (h + 1) - 2 * p end
      g[t + 1] = 2 ^ -(t % 3)
    end
    sflat[p + 1], gflat[p + 1] = f, g
    shared[p + 1] = S.tensor(f, "bf16", { T, H }, dev)
    gate[p + 1] = S.tensor(g, "f32", { T }, dev)
  end
  -- expected out[p, t] = sum_k w[p,t,k] * ys_owner[route_row_owner[p, t K + k]] (+ g * shared)
  local EL = math.floor(E / W)
  local function expected(p, with_shared, with_gate)
    local want = {}
    for t = 0, T - 1 do
      for h = 0, H - 1 do
        local acc = 0
        for k = 0, K - 1 do
          local id = c.ids[(p * T + t) * K + k + 1]
          if id >= 0 and id < E then
            local o = math.floor(id / EL)
            local row = schedules[o + 1].route_row:get(p * T * K + t * K + k + 1)
            if row >= 0 then acc = acc + wflat[p + 1][t * K + k + 1] * yflat[o + 1][row * H + h + 1] end
          end
        end
        if with_shared then
          acc = acc + (with_gate and gflat[p + 1][t + 1] or 1) * sflat[p + 1][t * H + h + 1]
        end
        want[#want + 1] = acc
      end
    end
    return want
  end
  return { schedules = schedules, ys = ys, weights = weights, shared = shared, gate = gate, expected = expected,
    dropped = dropped, T = T, H = H }
end

local function bf16_all(t)
  local r = {}
  for i, v in ipairs(t) do r[i] = S.bf16(v) end
  return r
end

-- ---------------------------------------------------------------- suites

for _, dev in ipairs(ALL_DEVICES) do
  describe("dispatch [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    it("gathers each row's token; rows without a route are untouched, or zeroed with zero_fill", function()
      check_dispatch(dev, { W = 3, T = 7, K = 3, E = 6, H = 8, pad = 4, ids = random_ids(3, 7, 3, 6, 0.2, 1) })
    end)
    it("with pad 1 and spare capacity", function()
      local ids = random_ids(4, 9, 2, 8, 0.1, 2)
      check_dispatch(dev, { W = 4, T = 9, K = 2, E = 8, H = 6, pad = 1, capacity = 40, ids = ids })
    end)
    it("with dropped routes (tight capacity)", function()
      check_dispatch(dev, { W = 2, T = 12, K = 4, E = 4, H = 16, pad = 8, capacity = 20,
        ids = random_ids(2, 12, 4, 4, 0, 3) })
    end)
    it("when every route goes to one expert", function()
      local ids = S.filled(4 * 5 * 2, 3)
      check_dispatch(dev, { W = 4, T = 5, K = 2, E = 8, H = 4, pad = 128, ids = ids })
    end)
    it("when every id is masked", function()
      check_dispatch(dev, { W = 2, T = 3, K = 2, E = 2, H = 4, pad = 2, ids = S.filled(12, -1) })
    end)
    it("allocates [C, H] when no out is given", function()
      local x = S.tensor(payload_x(2, 3, 4), "bf16", { 2, 3, 4 }, dev)
      local s = moe.schedule { ids = S.tensor({ 0, 1, 1, 1, 0, 0 }, "i32", { 2, 3, 1 }, dev), experts = 2, rank = 1 }
      local xs = moe.dispatch { x = x, schedule = s }
      assert.are.same({ s.capacity, 4 }, xs.shape)
      assert.are.equal("bf16", xs.dtype)
      -- expert 1 (rank 1's only) gets rank 0's tokens 1 and 2, and rank 1's token 0, interleaved by (j, p)
      assert.tensor_equal(xs:view(0, { 3, 4 }), { 2, -2, 4, -4, 4, -4, 8, -8, 3, -3, 6, -6 })
    end)
    if dev ~= "cpu" then
      it("equals the CPU dispatch bit for bit", function()
        local ids = random_ids(4, 33, 4, 16, 0.1, 9)
        local function run(d)
          local s = moe.schedule { ids = S.tensor(ids, "i32", { 4, 33, 4 }, d), experts = 16, rank = 2, pad = 8 }
          return moe.dispatch { x = moe.randn({ 4, 33, 64 }, { seed = 4, dtype = "bf16", device = d }), schedule = s,
            zero_fill = true }
        end
        assert.tensor_equal(run(dev):to("cpu"), run("cpu"))
      end)
    end
  end)

  describe("experts [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    it("runs each expert's SwiGLU over its rows, with an empty expert; rows past the last offset untouched",
      function()
        check_experts(dev, { C = 20, H = 12, F = 6, offsets = { 0, 3, 3, 11, 13 }, seed = 10 })
      end)
    it("with H and F multiples of 8 and every row used", function()
      check_experts(dev, { C = 17, H = 16, F = 8, offsets = { 0, 9, 17 }, seed = 20 })
    end)
    it("with the first and last experts empty", function()
      check_experts(dev, { C = 12, H = 9, F = 5, offsets = { 0, 0, 5, 10, 10 }, seed = 30 })
    end)
    it("with every expert empty: nothing written", function()
      check_experts(dev, { C = 8, H = 8, F = 4, offsets = { 0, 0, 0, 0 }, seed = 40 })
    end)
    it("with one expert over many rows (blocks of rows and a remainder)", function()
      check_experts(dev, { C = 40, H = 24, F = 12, offsets = { 0, 37 }, seed = 50 })
    end)
    it("with the capacity tail NaN: the valid rows stay finite and right, the tail untouched", function()
      check_experts(dev, { C = 20, H = 12, F = 6, offsets = { 0, 3, 3, 11, 13 }, seed = 60, nan_tail = true })
      check_experts(dev, { C = 40, H = 64, F = 64, offsets = { 0, 5, 30 }, seed = 70, nan_tail = true })
    end)
    it("lets a NaN in an expert's weights through to that expert's rows alone (IEEE arithmetic, deliberately)",
      function()
        local C, H, F = 6, 8, 4
        local xs = moe.randn({ C, H }, { seed = 1, dtype = "bf16", device = dev })
        local wgu = moe.randn({ 2, 2 * F, H }, { seed = 2, std = 0.3, dtype = "bf16", device = dev })
        local wd = moe.randn({ 2, H, F }, { seed = 3, std = 0.3, dtype = "bf16", device = dev })
        wd:view(H * F, { H, F }):fill(0 / 0) -- expert 1's down projection
        local ys = moe.experts { x = xs, offsets = S.tensor({ 0, 3, 6 }, "i32", { 3 }, dev), w_gate_up = wgu, w_down = wd }
        local flat = ys:to("cpu"):flat()
        for i, v in ipairs(flat) do
          local row = math.floor((i - 1) / H)
          if row < 3 then assert.is_true(v == v, "row " .. row .. " of expert 0 is NaN")
          else assert.is_true(v ~= v, "row " .. row .. " of expert 1 is not NaN") end
        end
      end)
    it("is exact on inputs whose products are exact", function()
      -- x = 1 everywhere, gate rows 0 (silu(0) = 0) except one: h is silu(g) * u in closed form
      local C, H, F = 3, 8, 2
      local xs = moe.full({ C, H }, 1, { dtype = "bf16", device = dev })
      local wgu = S.tensor({
        0, 0, 0, 0, 0, 0, 0, 0, -- gate 0: g = 0, so h0 = 0
        1, 0, 0, 0, 0, 0, 0, 0, -- gate 1: g = 1
        1, 1, 1, 1, 1, 1, 1, 1, -- up 0: u = 8
        1, 1, 0, 0, 0, 0, 0, 0, -- up 1: u = 2
      }, "bf16", { 1, 4, H }, dev)
      local wd = moe.full({ 1, H, F }, 1, { dtype = "bf16", device = dev })
      local off = S.tensor({ 0, 2 }, "i32", { 2 }, dev)
      local out = moe.full({ C, H }, POISON, { dtype = "bf16", device = dev })
      moe.experts { x = xs, offsets = off, w_gate_up = wgu, w_down = wd, out = out }
      local h1 = S.bf16(silu(1) * 2)
      local want = {}
      for i = 1, 2 * H do want[i] = S.bf16(h1) end
      for i = 2 * H + 1, 3 * H do want[i] = POISON end
      assert.tensor_equal(out, want)
    end)
    if dev ~= "cpu" then
      it("is close to the CPU experts", function()
        local C, H, F, EL = 300, 64, 32, 3
        local off = { 0, 100, 100, 290 }
        local function run(d)
          local xs = moe.randn({ C, H }, { seed = 1, dtype = "bf16", device = d })
          local wgu = moe.randn({ EL, 2 * F, H }, { seed = 2, std = 0.125, dtype = "bf16", device = d })
          local wd = moe.randn({ EL, H, F }, { seed = 3, std = 0.2, dtype = "bf16", device = d })
          local out = moe.full({ C, H }, POISON, { dtype = "bf16", device = d })
          return moe.experts { x = xs, offsets = S.tensor(off, "i32", { EL + 1 }, d), w_gate_up = wgu, w_down = wd,
            out = out }
        end
        local a, b = run("cpu"):flat(), run(dev):to("cpu"):flat()
        local ta, tb = {}, {}
        for i = 290 * H + 1, C * H do ta[#ta + 1], tb[#tb + 1] = a[i], b[i] end
        assert.tensor_equal(tb, ta, "rows past the last offset")
        assert.close(b, a)
      end)
    end
  end)

  describe("combine [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end
    local ids = random_ids(3, 6, 3, 6, 0.15, 4)
    ids[5] = 6    -- an invalid id (skipped by the schedule): adds nothing
    ids[11] = -3  -- another
    local world = combine_world(dev, { W = 3, T = 6, K = 3, E = 6, ids = ids, capacity = 10 })

    it("refuses weights that are not finite, its out untouched", function()
      local w = world.weights[1]:to("cpu"):flat()
      w[4] = 0 / 0
      local out = moe.full({ 6, world.ys[1].shape[2] }, 7, { dtype = "bf16", device = dev })
      local ok, err = pcall(moe.combine, { schedules = world.schedules, ys = world.ys, out = out,
        weights = S.tensor(w, "f32", { 6, 3 }, dev) })
      assert.is_false(ok)
      assert.truthy(tostring(err):find("option 'weights' holds 1 value that is NaN or infinite, the first at token 1, "
        .. "slot 0", 1, true), tostring(err))
      assert.tensor_equal(out, S.filled(6 * world.ys[1].shape[2], 7))
    end)
    it("has dropped and masked routes to ignore (the case is meaningful)", function()
      assert.is_true(world.dropped > 0, "no route was dropped")
      local masked = 0
      for _, id in ipairs(ids) do if id == -1 then masked = masked + 1 end end
      assert.is_true(masked > 0, "no route was masked")
    end)
    it("sums the weighted rows of each token's routes in f32, dropped and masked routes adding nothing", function()
      for p = 0, 2 do
        local out = moe.combine { schedules = world.schedules, ys = world.ys, weights = world.weights[p + 1], rank = p,
          dtype = "f32" }
        assert.are.equal("f32", out.dtype)
        assert.tensor_equal(out, world.expected(p, false), "rank " .. p)
      end
    end)
    it("rounds once to bf16 by default", function()
      for p = 0, 2 do
        local out = moe.combine { schedules = world.schedules, ys = world.ys, weights = world.weights[p + 1], rank = p }
        assert.are.equal("bf16", out.dtype)
        assert.tensor_equal(out, bf16_all(world.expected(p, false)), "rank " .. p)
      end
    end)
    it("adds the shared expert", function()
      for p = 0, 2 do
        local out = moe.combine { schedules = world.schedules, ys = world.ys, weights = world.weights[p + 1], rank = p,
          shared = world.shared[p + 1], dtype = "f32" }
        assert.tensor_equal(out, world.expected(p, true, false), "rank " .. p)
      end
    end)
    it("adds the shared expert times shared_gate", function()
      for p = 0, 2 do
        local out = moe.full({ world.T, world.H }, POISON, { device = dev })
        local got = moe.combine { schedules = world.schedules, ys = world.ys, weights = world.weights[p + 1], rank = p,
          shared = world.shared[p + 1], shared_gate = world.gate[p + 1], out = out }
        assert.are.equal(out, got)
        assert.tensor_equal(out, world.expected(p, true, true), "rank " .. p)
      end
    end)
    it("gives only the shared expert to a token whose routes are all masked", function()
      local W, T, K, E = 2, 2, 2, 4
      local idt = S.tensor({ -1, -1, 0, 3, 1, 2, -1, -1 }, "i32", { W, T, K }, dev)
      local sch, ys = {}, {}
      for o = 0, 1 do
        sch[o + 1] = moe.schedule { ids = idt, experts = E, rank = o }
        ys[o + 1] = moe.full({ sch[o + 1].capacity, 3 }, 2, { dtype = "bf16", device = dev })
      end
      local w = S.tensor({ 1, 1, 0.5, 0.25 }, "f32", { T, K }, dev)
      local sh = moe.full({ T, 3 }, 3, { dtype = "bf16", device = dev })
      local out = moe.combine { schedules = sch, ys = ys, weights = w, rank = 0, shared = sh, dtype = "f32" }
      assert.tensor_equal(out, { 3, 3, 3, 3 + 1.5, 3 + 1.5, 3 + 1.5 })
    end)
    it("takes a world of one rank as schedule= and y=", function()
      local idt = S.tensor({ 1, 0, 1, 1 }, "i32", { 1, 2, 2 }, dev)
      local s = moe.schedule { ids = idt, experts = 2, rank = 0 }
      -- row of route i holds (i + 1, 10 (i + 1)); padding rows hold 0
      local route, payload = s.peer_route:flat(), {}
      for row = 1, s.capacity do
        payload[#payload + 1] = route[row] + 1
        payload[#payload + 1] = 10 * (route[row] + 1)
      end
      local y = S.tensor(payload, "bf16", { s.capacity, 2 }, dev)
      local out = moe.combine { schedule = s, y = y, weights = S.tensor({ 1, 2, 4, 8 }, "f32", { 2, 2 }, dev),
        dtype = "f32" }
      -- token 0: 1 * (route 0 -> 1) + 2 * (route 1 -> 2); token 1: 4 * 3 + 8 * 4
      assert.tensor_equal(out, { 1 + 4, 10 + 40, 12 + 32, 120 + 320 })
    end)
    it("takes schedules made from a copy of the same ids, as from the tensor itself", function()
      local s = world.schedules
      local copy = moe.schedule { ids = s[2].ids:to(dev), experts = 6, rank = 1, pad = 2, capacity = 10,
        overflow = "drop", invalid = "skip" }
      local a = moe.combine { schedules = s, ys = world.ys, weights = world.weights[1], rank = 0 }
      local b = moe.combine { schedules = { s[1], copy, s[3] }, ys = world.ys, weights = world.weights[1], rank = 0 }
      assert.tensor_equal(b, a)
    end)
    if dev ~= "cpu" then
      it("equals the CPU combine bit for bit", function()
        local cw = combine_world("cpu", { W = 3, T = 6, K = 3, E = 6, ids = ids, capacity = 10 })
        for p = 0, 2 do
          local a = moe.combine { schedules = cw.schedules, ys = cw.ys, weights = cw.weights[p + 1], rank = p,
            shared = cw.shared[p + 1], shared_gate = cw.gate[p + 1] }
          local b = moe.combine { schedules = world.schedules, ys = world.ys, weights = world.weights[p + 1], rank = p,
            shared = world.shared[p + 1], shared_gate = world.gate[p + 1] }
          assert.tensor_equal(b:to("cpu"), a)
        end
      end)
    end
  end)
end
