-- SPDX-License-Identifier: MIT
-- The fuzzer's second computation: each stage of docs/design.md written again in plain Lua, on
-- flat 1-based tables, from the contract rather than from lib/.  Integer outputs are predicted
-- exactly; float outputs within a tolerance (Lua computes in double where the library rounds to
-- f32 and bf16).  Every function returns nil when the result is right, else a sentence saying
-- where it is not.
local O = {}

-- x rounded to `bits` significant bits, ties to even, on the grid of exponent emin below it,
-- an overflow past the largest finite value to infinity (IEEE round to nearest).
local function round_bits(x, bits, emin)
  if x ~= x or x == 0 or x == math.huge or x == -math.huge then return x end
  local a = math.abs(x)
  local e = math.floor(math.log(a, 2))
  if 2 ^ e > a then e = e - 1 elseif 2 ^ (e + 1) <= a then e = e + 1 end
  local q = 2 ^ (math.max(e, emin) - bits + 1)
  local r = a / q
  local f = math.floor(r)
  local d = r - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then f = f + 1 end
  local v = f * q
  if v >= 2 ^ 128 then v = math.huge end
  return x < 0 and -v or v
end

-- x as an f32 holds it (the C cast of a double).
function O.f32(x) return round_bits(x, 24, -126) end

-- x as the library stores it in bf16: to f32 first, then to the nearest bf16, ties to even.
function O.bf16(x) return round_bits(round_bits(x, 24, -126), 8, -126) end

-- x as a tensor of dtype holds it (an i32 value is taken as it is: the caller checked it).
function O.stored(dtype, x)
  if dtype == "f32" then return O.f32(x) end
  if dtype == "bf16" then return O.bf16(x) end
  return x
end

local function isnan(x) return x ~= x end

-- |got - ref| <= rtol max|ref| + atol everywhere (NaN only against NaN, an infinity only against
-- the same one), over n values from 1-based offsets og and orf.
function O.near(got, ref, rtol, atol, what)
  local max_ref = 0
  for i = 1, #ref do
    local r = ref[i]
    if r == r and r ~= math.huge and r ~= -math.huge then max_ref = math.max(max_ref, math.abs(r)) end
  end
  if #got ~= #ref then return string.format("%s: %d values, expected %d", what, #got, #ref) end
  local allowed = rtol * max_ref + atol
  for i = 1, #ref do
    local g, r = got[i], ref[i]
    local bad
    if isnan(r) or isnan(g) then bad = not (isnan(r) and isnan(g))
    elseif r == math.huge or r == -math.huge or g == math.huge or g == -math.huge then bad = g ~= r
    else bad = math.abs(g - r) > allowed end
    if bad then
      return string.format("%s: element %d is %.9g, expected %.9g (allowed +-%.3g)", what, i, g, r, allowed)
    end
  end
end

-- The first index where two flat tables differ (NaN equals NaN), or nil.
function O.first_difference(a, b)
  if #a ~= #b then return math.min(#a, #b) + 1 end
  for i = 1, #a do
    if a[i] ~= b[i] and not (isnan(a[i]) and isnan(b[i])) then return i end
  end
end

-- ---------------------------------------------------------------- 1. route

local function sigmoid(l) return 1 / (1 + math.exp(-l)) end
local function sqrtsoftplus(l) return math.sqrt(l > 20 and l or math.log(1 + math.exp(l))) end

-- "higher key first, then lower id"
local function before(ka, ia, kb, ib) return ka > kb or (ka == kb and ia < ib) end

-- The k best of keys[1..n] among the eligible (nil: all), as 0-based ids in order.
local function top_k(keys, n, k, eligible)
  local out, prev = {}, nil
  for j = 1, k do
    local best
    for i = 1, n do
      if (not eligible or eligible[i]) and (not prev or before(keys[prev], prev, keys[i], i))
        and (not best or before(keys[i], i, keys[best], best)) then
        best = i
      end
    end
    out[j], prev = best, best
  end
  for j = 1, k do out[j] = out[j] and out[j] - 1 end
  return out
end

-- Checks ids and weights (flat [N, K]) of moe.route on logits (flat [N, E]) with o's options
-- (scoring, bias flat [E] or nil, groups, topk_groups, scale) -> nil or the problem.
function O.route(logits, N, E, K, o, ids, weights)
  local scoring, bias = o.scoring or "softmax", o.bias
  local groups, scale = o.groups or 1, o.scale or 1
  local topk_groups = o.topk_groups or groups
  local per = E / groups
  for r = 0, N - 1 do
    local l, rejected = {}, false
    for i = 1, E do
      l[i] = logits[r * E + i]
      if isnan(l[i]) then rejected = true end
    end
    local s, keys = {}, {}
    if not rejected then
      if scoring == "softmax" then
        local m = -math.huge
        for i = 1, E do m = math.max(m, l[i]) end
        if m == math.huge or m == -math.huge then rejected = true end
        for i = 1, E do keys[i] = l[i] end
        if not rejected then for i = 1, E do s[i] = math.exp(l[i] - m) end end
      else
        for i = 1, E do
          if scoring == "sqrtsoftplus" and l[i] == math.huge then rejected = true end
          s[i] = scoring == "sigmoid" and sigmoid(l[i]) or sqrtsoftplus(l[i])
          keys[i] = bias and s[i] + bias[i] or s[i]
          if isnan(keys[i]) then rejected = true end
        end
      end
    end
    local got_ids, got_w = {}, {}
    for j = 1, K do got_ids[j], got_w[j] = ids[r * K + j], weights[r * K + j] end
    local where = string.format("route row %d", r)
    if rejected then
      for j = 1, K do
        if got_ids[j] ~= -1 or got_w[j] ~= 0 then
          return string.format("%s cannot be scored: expected ids -1 and weights 0, got id %s weight %s in slot %d",
            where, tostring(got_ids[j]), tostring(got_w[j]), j)
        end
      end
    else
      local problem = O.route_choice(keys, E, K, scoring, groups, topk_groups, per, got_ids, where)
      if problem then return problem end
      -- the weights of the experts chosen
      local want, sum = {}, 0
      for j = 1, K do
        want[j] = s[got_ids[j] + 1]
        sum = sum + want[j]
      end
      local total = scoring == "softmax" and 1 or scale
      for j = 1, K do want[j] = sum > 0 and want[j] / sum * total or 0 end
      problem = O.near(got_w, want, 1e-5, 1e-6 * total, where .. " weights")
      if problem then return problem end
    end
  end
end

-- The chosen ids of one row against the keys: exactly the strict order where the keys are
-- exact (softmax selects on the logits themselves); within a tolerance where they are computed
-- (a sigmoid in double is not the library's in float), groups included.
function O.route_choice(keys, E, K, scoring, groups, topk_groups, per, got, where)
  if scoring == "softmax" then
    local want = top_k(keys, E, K)
    for j = 1, K do
      if got[j] ~= want[j] then
        return string.format("%s: slot %d holds expert %s, expected %d", where, j, tostring(got[j]), want[j])
      end
    end
    return nil
  end
  -- a above b by more than f32 arithmetic could have turned around (the keys are O(1) but
  -- reach 1e15 where a softplus of 1e30 is taken)
  local function above(a, b) return a - b > 1e-5 * (1 + math.abs(a) + math.abs(b)) end
  local kept -- groups surely kept; maybe: within the tolerance of the last kept
  local maybe = {}
  if groups > 1 then
    local gscore = {}
    for g = 1, groups do
      local a, b = -math.huge, -math.huge
      for i = (g - 1) * per + 1, g * per do
        if keys[i] > a then a, b = keys[i], a elseif keys[i] > b then b = keys[i] end
      end
      gscore[g] = per == 1 and a or a + b
    end
    local order = top_k(gscore, groups, groups)
    local last = gscore[order[topk_groups] + 1]
    kept = {}
    for g = 1, groups do
      kept[g] = above(gscore[g], last)
      maybe[g] = not above(last, gscore[g])
    end
  end
  local chosen, lowest = {}, math.huge
  for j = 1, K do
    local id = got[j]
    if type(id) ~= "number" or id < 0 or id >= E or chosen[id] then
      return string.format("%s: slot %d holds %s, not a new expert in [0, %d)", where, j, tostring(id), E)
    end
    chosen[id] = true
    local g = math.floor(id / per) + 1
    if groups > 1 and not maybe[g] then
      return string.format("%s: slot %d holds expert %d of group %d, which is not among the best %d groups", where,
        j, id, g - 1, topk_groups)
    end
    if j > 1 and above(keys[id + 1], keys[got[j - 1] + 1]) then
      return string.format("%s: slot %d (expert %d, key %.9g) ranks above slot %d (key %.9g)", where, j, id,
        keys[id + 1], j - 1, keys[got[j - 1] + 1])
    end
    lowest = math.min(lowest, keys[id + 1])
  end
  for i = 1, E do
    local g = math.floor((i - 1) / per) + 1
    if not chosen[i - 1] and (groups == 1 or kept[g]) and above(keys[i], lowest) then
      return string.format("%s: expert %d (key %.9g) was passed over for one with key %.9g", where, i - 1, keys[i],
        lowest)
    end
  end
end

-- ---------------------------------------------------------------- 2. schedule

-- The expected outputs of a schedule of ids (flat [W, T K]) for this rank, by the formulas of
-- docs/design.md: { peer_rank, peer_route, counts, tokens_per_expert, expert_offsets,
-- route_row, stats }, each a flat table.
function O.schedule(ids, W, TK, E, rank, pad, C, ecap, layout)
  local EL = E / W
  local lo = rank * EL
  local c = {}
  for e = 0, EL - 1 do
    c[e] = {}
    for p = 0, W - 1 do c[e][p] = 0 end
  end
  local invalid, first_invalid, locals = 0, -1, 0
  for p = 0, W - 1 do
    for i = 0, TK - 1 do
      local id = ids[p * TK + i + 1]
      if id ~= -1 then
        if id < 0 or id >= E then
          if invalid == 0 then first_invalid = p * TK + i end
          invalid = invalid + 1
        elseif id >= lo and id < lo + EL then
          c[id - lo][p] = c[id - lo][p] + 1
          locals = locals + 1
        end
      end
    end
  end
  -- a route's ordinal j in its (expert, source) group: roundrobin counts in the order of its
  -- 1,024 logical threads (thread t owns t, t + 1024, ...), peer_major in route order
  local threads = layout == "peer_major" and 1 or 1024
  local seen, ord = {}, {}
  for p = 0, W - 1 do
    for th = 0, math.min(threads, TK) - 1 do
      for i = th, TK - 1, threads do
        local id = ids[p * TK + i + 1]
        if id >= lo and id < lo + EL then
          local key = (id - lo) * W + p
          ord[p * TK + i] = seen[key] or 0
          seen[key] = (seen[key] or 0) + 1
        end
      end
    end
  end
  local base, n_e = { [0] = 0 }, {}
  for e = 0, EL - 1 do
    local n = 0
    for p = 0, W - 1 do n = n + c[e][p] end
    if ecap and n > ecap then n = ecap end
    n_e[e] = n
    base[e + 1] = base[e] + math.ceil(n / pad) * pad
  end
  local out = { peer_rank = {}, peer_route = {}, counts = {}, tokens_per_expert = {}, expert_offsets = {},
    route_row = {}, stats = {} }
  for r = 1, C do out.peer_rank[r], out.peer_route[r] = -1, -1 end
  for i = 1, W * TK do out.route_row[i] = -1 end
  for e = 0, EL - 1 do out.counts[e + 1] = 0 end
  local placed = 0
  for p = 0, W - 1 do
    for i = 0, TK - 1 do
      local id = ids[p * TK + i + 1]
      if id >= lo and id < lo + EL then
        local e, j = id - lo, ord[p * TK + i]
        local pos = 0
        if layout == "peer_major" then
          for q = 0, p - 1 do pos = pos + c[e][q] end
          pos = pos + j
        else
          for q = 0, W - 1 do
            pos = pos + math.min(c[e][q], j)
            if q < p and c[e][q] > j then pos = pos + 1 end
          end
        end
        if pos < math.min(n_e[e], C - base[e]) then
          local row = base[e] + pos
          out.peer_rank[row + 1], out.peer_route[row + 1] = p, i
          out.route_row[p * TK + i + 1] = row
          out.counts[e + 1] = out.counts[e + 1] + 1
          placed = placed + 1
        end
      end
    end
  end
  for e = 0, EL do out.expert_offsets[e + 1] = math.min(base[e], C) end
  for e = 1, EL do out.tokens_per_expert[e] = out.expert_offsets[e + 1] - out.expert_offsets[e] end
  out.stats = { math.min(base[EL], 2147483647), out.expert_offsets[EL + 1], locals - placed, invalid, first_invalid }
  return out
end

-- ---------------------------------------------------------------- 3. dispatch

-- out (flat [C, H], its contents before the call) after dispatch of x (flat [W, T, H]).
function O.dispatch(before_out, x, W, T, H, K, peer_rank, peer_route, zero_fill)
  local out = {}
  for i = 1, #before_out do out[i] = before_out[i] end
  for r = 0, #peer_rank - 1 do
    local p, q = peer_rank[r + 1], peer_route[r + 1]
    if p >= 0 and p < W and q >= 0 and q < T * K then
      local src = (p * T + math.floor(q / K)) * H
      for h = 1, H do out[r * H + h] = x[src + h] end
    elseif zero_fill then
      for h = 1, H do out[r * H + h] = 0 end
    end
  end
  return out
end

-- ---------------------------------------------------------------- 4. experts

-- out (flat [C, H], its contents before the call) after the experts over x (flat [C, H]):
-- rows [m_e, m_e+1) of expert e, m the running maximum of the offsets clamped to [0, C]; and
-- the set of rows written.
function O.experts(before_out, x, C, H, EL, F, offsets, wgu, wd)
  local out, written = {}, {}
  for i = 1, #before_out do out[i] = before_out[i] end
  local function clamp(v) return math.max(0, math.min(C, v)) end
  local lo = clamp(offsets[1])
  for e = 0, EL - 1 do
    local hi = math.max(lo, clamp(offsets[e + 2]))
    for row = lo, hi - 1 do
      written[row] = true
      local hvec = {}
      for f = 0, F - 1 do
        local g, u = 0, 0
        for h = 1, H do
          local xv = x[row * H + h]
          g = g + wgu[((e * 2 * F) + f) * H + h] * xv
          u = u + wgu[((e * 2 * F) + F + f) * H + h] * xv
        end
        hvec[f + 1] = O.bf16(g / (1 + math.exp(-g)) * u)
      end
      for h = 0, H - 1 do
        local y = 0
        for f = 1, F do y = y + wd[(e * H + h) * F + f] * hvec[f] end
        out[row * H + h + 1] = y
      end
    end
    lo = hi
  end
  return out, written
end

-- ---------------------------------------------------------------- 5. combine

-- out (flat [T, H]) of one rank's tokens: weights and ids flat [T, K], ys[o] flat [C_o, H] with
-- rows C_o, route_rows[o] flat [W, T K]; shared flat [T, H] or nil, gate flat [T] or nil.
function O.combine(T, K, H, W, E, rank, weights, ids, ys, ys_rows, route_rows, shared, gate)
  local EL = E / W
  local out = {}
  for t = 0, T - 1 do
    local acc = {}
    for h = 1, H do acc[h] = 0 end
    for k = 0, K - 1 do
      local id = ids[t * K + k + 1]
      if id >= 0 and id < E then
        local o = math.floor(id / EL)
        local row = route_rows[o + 1][rank * T * K + t * K + k + 1]
        if row >= 0 and row < ys_rows[o + 1] then
          local w = weights[t * K + k + 1]
          for h = 1, H do acc[h] = acc[h] + w * ys[o + 1][row * H + h] end
        end
      end
    end
    if shared then
      local g = gate and gate[t + 1] or 1
      for h = 1, H do acc[h] = acc[h] + g * shared[t * H + h] end
    end
    for h = 1, H do out[t * H + h] = acc[h] end
  end
  return out
end

return O
