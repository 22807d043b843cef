-- SPDX-License-Identifier: MIT
-- The route stage (docs/design.md, "The stages", 1) against a direct Lua
-- transcription of each scoring function in double precision: ids exactly, weights within 1e-5
-- relative.  Random rows keep a clear gap (1e-5) between the keys whose order decides the
-- result, so that f32 rounding cannot reorder them; exact ties are built on purpose.
local S = require "support"

local RTOL, ATOL = 1e-5, 1e-7
local GAP = 1e-5

-- ---------------------------------------------------------------- the formulas, transcribed

local function sigmoid(l) return 1 / (1 + math.exp(-l)) end
local function softplus(l) return l > 30 and l or math.log(1 + math.exp(l)) end
local function sqrtsoftplus(l) return math.sqrt(softplus(l)) end

-- ids sorted by key, higher first, ties toward the lower id
local function ranked(ids, key)
  table.sort(ids, function(a, b)
    if key[a] ~= key[b] then return key[a] > key[b] end
    return a < b
  end)
  return ids
end

-- One row: l[0..E-1] (and b[0..E-1] or nil) -> ids[1..K], weights[1..K], and the ordered keys
-- that decided the selection (for the gap check of random rows).
local function route_row(l, E, o)
  local K, scoring, b = o.k, o.scoring or "softmax", o.bias
  local groups, topk_groups, scale = o.groups or 1, o.topk_groups or o.groups or 1, o.scale or 1.0
  local all = {}
  for i = 0, E - 1 do all[#all + 1] = i end
  if scoring == "softmax" then
    -- p = softmax(l); S = top-k(p); w = p_S / sum p_S
    local m = -math.huge
    for i = 0, E - 1 do m = math.max(m, l[i]) end
    local p, sum = {}, 0
    for i = 0, E - 1 do p[i] = math.exp(l[i] - m); sum = sum + p[i] end
    for i = 0, E - 1 do p[i] = p[i] / sum end
    local sel = ranked(all, p)
    local ids, w, psum = {}, {}, 0
    for j = 1, K do ids[j] = sel[j]; psum = psum + p[sel[j]] end
    for j = 1, K do w[j] = p[ids[j]] / psum end
    return ids, w, { list = sel, key = p, n = K }
  end
  -- s = sigma(l) or sqrt(softplus(l)); selection on s + b; w_i = scale * s_i / sum_S s_j
  local s, key = {}, {}
  for i = 0, E - 1 do
    s[i] = scoring == "sigmoid" and sigmoid(l[i]) or sqrtsoftplus(l[i])
    key[i] = s[i] + (b and b[i] or 0)
  end
  local candidates, gdecide = all, nil
  if groups > 1 then
    -- a group's score is the sum of its top-2 keys; keep the topk_groups best groups
    local per = math.floor(E / groups)
    local gscore, glist = {}, {}
    for g = 0, groups - 1 do
      local members = {}
      for i = g * per, (g + 1) * per - 1 do members[#members + 1] = i end
      ranked(members, key)
      gscore[g] = key[members[1]] + (per > 1 and key[members[2]] or 0)
      glist[#glist + 1] = g
    end
    ranked(glist, gscore)
    candidates = {}
    for j = 1, topk_groups do
      local g = glist[j]
      for i = g * per, (g + 1) * per - 1 do candidates[#candidates + 1] = i end
    end
    gdecide = { list = glist, key = gscore, n = topk_groups }
  end
  local sel = ranked(candidates, key)
  local ids, w, sum = {}, {}, 0
  for j = 1, K do ids[j] = sel[j]; sum = sum + s[sel[j]] end
  for j = 1, K do w[j] = scale * s[ids[j]] / sum end
  return ids, w, { list = sel, key = key, n = K }, gdecide
end

-- Whether the first n + 1 entries of a ranked list are clearly apart (or exactly tied on purpose:
-- `same(a, b)` says the two items are built identical).
local function clear(d, same)
  if not d then return true end
  for j = 1, math.min(d.n, #d.list - 1) do
    local a, b = d.list[j], d.list[j + 1]
    local gap = math.abs(d.key[a] - d.key[b])
    if gap < GAP and not (gap == 0 and same(a, b)) then return false end
  end
  return true
end

-- ---------------------------------------------------------------- cases

-- A random row of E logits on a grid (so that equal values, hence exact ties, occur) and a bias
-- (continuous), redrawn until the keys that decide it are clearly apart.
local function random_rows(N, E, o)
  local rows, biasv = {}, nil
  if o.bias then
    biasv = {}
    for i = 0, E - 1 do biasv[i] = S.f32((math.random() - 0.5) * 0.2) end
  end
  for r = 1, N do
    for _ = 1, 1000 do
      local l = {}
      for i = 0, E - 1 do l[i] = S.f32(S.int(-200, 200) / 50) end
      local oo = setmetatable({ bias = biasv }, { __index = o })
      local _, _, d, gd = route_row(l, E, oo)
      local function same(a, b) return l[a] == l[b] and (not biasv or biasv[a] == biasv[b]) end
      if clear(d, same) and clear(gd, function() return false end) then rows[r] = l; break end
    end
    assert(rows[r], "could not draw a row without near-ties")
  end
  return rows, biasv
end

local function flat_rows(rows, E)
  local t = {}
  for _, l in ipairs(rows) do
    for i = 0, E - 1 do t[#t + 1] = l[i] end
  end
  return t
end

-- Runs moe.route on dev and compares with the formulas.
local function check_route(rows, E, o, dev, biasv)
  local N = #rows
  local logits = S.tensor(flat_rows(rows, E), "f32", { N, E }, dev)
  local bias
  if biasv then
    local bt = {}
    for i = 0, E - 1 do bt[i + 1] = biasv[i] end
    bias = S.tensor(bt, "f32", { E }, dev)
  end
  local ids, weights, st = moe.route { logits = logits, k = o.k, scoring = o.scoring, bias = bias, groups = o.groups,
    topk_groups = o.topk_groups, scale = o.scale }
  assert.are.same({ N, o.k }, ids.shape)
  assert.are.same({ N, o.k }, weights.shape)
  assert.are.equal(0, st.nan_rows)
  local want_ids, want_w = {}, {}
  for _, l in ipairs(rows) do
    local oo = setmetatable({ bias = biasv }, { __index = o })
    local i, w = route_row(l, E, oo)
    for j = 1, o.k do
      want_ids[#want_ids + 1] = i[j]
      want_w[#want_w + 1] = w[j]
    end
  end
  assert.tensor_equal(ids, want_ids, "ids")
  S.assert_near(weights:flat(), want_w, RTOL, ATOL, "weights")
  return ids, weights
end

local CONFIGS = {
  { scoring = "softmax", E = 8, k = 2 },
  { scoring = "softmax", E = 16, k = 1 },
  { scoring = "softmax", E = 60, k = 6 },
  { scoring = "softmax", E = 128, k = 8 },
  { scoring = "softmax", E = 512, k = 10 },
  { scoring = "sigmoid", E = 8, k = 3 },
  { scoring = "sigmoid", E = 64, k = 8, scale = 2.5 },
  { scoring = "sigmoid", E = 64, k = 6, bias = true, scale = 2.827 },
  { scoring = "sigmoid", E = 384, k = 8, bias = true, scale = 2.827 },
  { scoring = "sigmoid", E = 64, k = 8, bias = true, groups = 8, topk_groups = 4, scale = 2.5 },
  { scoring = "sigmoid", E = 256, k = 8, bias = true, groups = 8, topk_groups = 4, scale = 2.5 },
  { scoring = "sigmoid", E = 32, k = 3, bias = true, groups = 4, topk_groups = 1 },
  { scoring = "sigmoid", E = 32, k = 5, bias = true, groups = 4, topk_groups = 2 },
  { scoring = "sigmoid", E = 16, k = 4, bias = true, groups = 16, topk_groups = 5 }, -- one expert per group
  { scoring = "sigmoid", E = 24, k = 2, groups = 3, topk_groups = 3 },                -- every group kept
  { scoring = "sqrtsoftplus", E = 16, k = 4 },
  { scoring = "sqrtsoftplus", E = 64, k = 6, bias = true, scale = 2.5 },
  { scoring = "sqrtsoftplus", E = 384, k = 6, bias = true, scale = 2.5 },
}

local function config_name(c)
  return string.format("%s E=%d K=%d%s%s%s", c.scoring, c.E, c.k, c.bias and " bias" or "",
    c.groups and string.format(" groups=%d keep %d", c.groups, c.topk_groups) or "",
    c.scale and (" scale=" .. c.scale) or "")
end

-- A logits tensor from explicit rows (tables indexed from 1).
local function logits_of(rows, dev)
  local flat = {}
  for _, r in ipairs(rows) do for _, v in ipairs(r) do flat[#flat + 1] = v end end
  return S.tensor(flat, "f32", { #rows, #rows[1] }, dev)
end

-- ---------------------------------------------------------------- suites

for _, dev in ipairs(ALL_DEVICES) do
  describe("route [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    describe("against the formulas", function()
      for n, c in ipairs(CONFIGS) do
        it(config_name(c), function()
          math.randomseed(1000 + n)
          local N = c.E >= 256 and 24 or 64
          local rows, biasv = random_rows(N, c.E, c)
          check_route(rows, c.E, c, dev, biasv)
        end)
      end
    end)

    describe("weights", function()
      it("softmax weights of a row sum to 1", function()
        math.randomseed(5)
        local rows = random_rows(32, 32, { scoring = "softmax", k = 4 })
        local _, w = check_route(rows, 32, { scoring = "softmax", k = 4 }, dev)
        local f = w:flat()
        for r = 0, 31 do
          local sum = f[r * 4 + 1] + f[r * 4 + 2] + f[r * 4 + 3] + f[r * 4 + 4]
          assert.is_true(math.abs(sum - 1) < 1e-6, "row " .. r .. " sums to " .. sum)
        end
      end)
      it("sigmoid weights of a row sum to the scale", function()
        math.randomseed(6)
        local o = { scoring = "sigmoid", k = 4, bias = true, scale = 2.5 }
        local rows, biasv = random_rows(32, 32, o)
        local _, w = check_route(rows, 32, o, dev, biasv)
        local f = w:flat()
        for r = 0, 31 do
          local sum = f[r * 4 + 1] + f[r * 4 + 2] + f[r * 4 + 3] + f[r * 4 + 4]
          assert.is_true(math.abs(sum - 2.5) < 1e-5, "row " .. r .. " sums to " .. sum)
        end
      end)
      it("the bias selects but does not weigh", function()
        -- expert 3 has the smallest logit but a large bias: it is selected, with its own small s
        local l = logits_of({ { 1, 0.5, 0.25, -2 } }, dev)
        local bias = S.tensor({ 0, 0, 0, 1 }, "f32", { 4 }, dev)
        local ids, w = moe.route { logits = l, k = 2, scoring = "sigmoid", bias = bias }
        assert.tensor_equal(ids, { 3, 0 })
        local s3, s0 = sigmoid(-2), sigmoid(1)
        S.assert_near(w:flat(), { s3 / (s3 + s0), s0 / (s3 + s0) }, RTOL, ATOL, "weights")
      end)
      it("writes into given ids and weights", function()
        local ids = S.tensor({ 9, 9, 9, 9 }, "i32", { 2, 2 }, dev)
        local weights = moe.zeros({ 2, 2 }, { device = dev })
        local l = logits_of({ { 0, 3, 1, 2 }, { 5, 1, 4, 0 } }, dev)
        local a, b = moe.route { logits = l, k = 2, ids = ids, weights = weights }
        assert.tensor_equal(ids, { 1, 3, 0, 2 })
        assert.are.equal(ids, a)
        assert.are.equal(weights, b)
        local e1 = math.exp(-1)
        S.assert_near(weights:flat(), { 1 / (1 + e1), e1 / (1 + e1), 1 / (1 + e1), e1 / (1 + e1) }, RTOL, ATOL, "w")
      end)
    end)

    describe("ties break toward the lower expert id", function()
      it("softmax: equal logits", function()
        local l = logits_of({
          { 0, 0, 0, 0, 0, 0 },
          { 1, 3, 3, 2, 3, 0 },
          { 2, 1, 2, 1, 2, 1 },
          { -1, 5, -1, -1, -1, 5 },
        }, dev)
        local ids, w = moe.route { logits = l, k = 3 }
        assert.tensor_equal(ids, { 0, 1, 2, 1, 2, 4, 0, 2, 4, 1, 5, 0 })
        local t = 1 / (2 + math.exp(-6))
        S.assert_near(w:flat(), { 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, t, t,
          math.exp(-6) * t }, RTOL, ATOL, "weights")
      end)
      it("sigmoid: equal keys s + b, built from equal logits and biases", function()
        local l = logits_of({ { 0.5, 1, 0.5, 1, 0.5, 2 }, { 0, 0, 0, 0, 0, 0 } }, dev)
        local bias = S.tensor({ 0.25, 0, 0.25, 0, 0.25, -2 }, "f32", { 6 }, dev)
        local ids = moe.route { logits = l, k = 4, scoring = "sigmoid", bias = bias }
        -- row 1: keys 0.872(0,2,4) tie above 0.731(1,3) above 0.881-2; row 2: 0.75 (0,2,4), 0.5 (1,3)
        assert.tensor_equal(ids, { 0, 2, 4, 1, 0, 2, 4, 1 })
      end)
      it("sqrtsoftplus: equal logits", function()
        local l = logits_of({ { 2, 2, 3, 2, 3 } }, dev)
        local ids = moe.route { logits = l, k = 4, scoring = "sqrtsoftplus" }
        assert.tensor_equal(ids, { 2, 4, 0, 1 })
      end)
      it("groups: equal group scores keep the lower group", function()
        -- four groups of two.  Row 1: group 2 is best, groups 1 and 3 tie for second: group 1
        -- is kept, so the third pick is expert 5 (keeping group 3 would have given 7).  Row 2: groups 1
        -- and 3 tie for first and only one is kept.
        local l = logits_of({ { 0, 0, 1, 2, 2, 2, 1, 2 } }, dev)
        local ids = moe.route { logits = l, k = 3, scoring = "sigmoid", groups = 4, topk_groups = 2 }
        assert.tensor_equal(ids, { 3, 4, 5 })
        local l2 = logits_of({ { 0, 0, 1, 2, 1.5, 1, 1, 2 } }, dev)
        local ids2 = moe.route { logits = l2, k = 2, scoring = "sigmoid", groups = 4, topk_groups = 1 }
        assert.tensor_equal(ids2, { 3, 2 })
      end)
      it("groups: a group's score is the sum of its top two, not its top one", function()
        -- group 0 holds the single best expert, group 1 the best pair
        local l = logits_of({ { 3, -3, 1, 1 } }, dev)
        local ids = moe.route { logits = l, k = 2, scoring = "sigmoid", groups = 2, topk_groups = 1 }
        assert.tensor_equal(ids, { 2, 3 })
      end)
    end)

    describe("NaN logits", function()
      local rows = {}
      for r = 1, 6 do rows[r] = { r, 0, -r, 2 * r, 0.5 } end
      rows[4][3] = 0 / 0
      rows[6][1] = 0 / 0
      it("raise an error naming the first row", function()
        local ok, err = pcall(moe.route, { logits = logits_of(rows, dev), k = 2 })
        assert.is_false(ok)
        assert.truthy(string.find(err, "NaN or cannot be scored in 2 rows", 1, true), err)
        assert.truthy(string.find(err, "the first is row 3", 1, true), err)
      end)
      it("raise for every scoring", function()
        for _, sc in ipairs { "sigmoid", "sqrtsoftplus" } do
          local ok, err = pcall(moe.route, { logits = logits_of(rows, dev), k = 2, scoring = sc })
          assert.is_false(ok)
          assert.truthy(string.find(err, "row 3", 1, true), err)
        end
      end)
      it("with nan = 'mask' route their rows nowhere (ids -1, weights 0)", function()
        local ids, w, st = moe.route { logits = logits_of(rows, dev), k = 2, nan = "mask" }
        assert.are.equal(2, st.nan_rows)
        local want_ids, want_w = {}, {}
        for r = 1, 6 do
          if r == 4 or r == 6 then
            for _ = 1, 2 do want_ids[#want_ids + 1] = -1; want_w[#want_w + 1] = 0 end
          else
            local l = {}
            for i = 1, 5 do l[i - 1] = rows[r][i] end
            local i, ww = route_row(l, 5, { k = 2 })
            for j = 1, 2 do want_ids[#want_ids + 1] = i[j]; want_w[#want_w + 1] = ww[j] end
          end
        end
        assert.tensor_equal(ids, want_ids)
        S.assert_near(w:flat(), want_w, RTOL, ATOL, "weights")
      end)
    end)

    if dev ~= "cpu" then
      it("equals the CPU route: ids bit for bit, weights within 1e-6", function()
        for n, c in ipairs(CONFIGS) do
          local N, E = 256, c.E
          local l = moe.randn({ N, E }, { seed = 77 + n, std = 2 })
          local bias = c.bias and moe.randn({ E }, { seed = 177 + n, std = 0.1 }) or nil
          local function run(d)
            return moe.route { logits = l:to(d), k = c.k, scoring = c.scoring, bias = bias and bias:to(d),
              groups = c.groups, topk_groups = c.topk_groups, scale = c.scale }
          end
          local ia, wa = run("cpu")
          local ib, wb = run(dev)
          assert.tensor_equal(ib, ia, config_name(c) .. " ids")
          S.assert_near(wb:flat(), wa:flat(), 1e-6, 1e-7, config_name(c) .. " weights")
        end
      end)
    end
  end)
end
