-- SPDX-License-Identifier: MIT
-- The router's logits and their GPU paths: the context's option "logits" (tensor, the default,
-- or exact), moe.explain("logits"), the layer's option router; on a GPU, the tensor-core path
-- against the CPU's sums within its bound, batch invariance, odd sizes, NaN rows, the exact
-- path bit for bit, and the routing of the GPU's logits against the CPU route stage's.
-- spec/c/test_logits_choice.c checks the choice itself for every device and problem.
local S = require "spec.support"
local core = moe.core

describe("logits option [#cpu]", function()
  after_each(function() core.config("logits", "tensor") end)

  it("is tensor unless set, in every build; auto and '' name the default", function()
    assert.are.equal("tensor", core.config("logits"))
    assert.are.equal("tensor", moe.config().logits)
    assert.are.equal("exact", moe.config({ logits = "exact" }).logits)
    assert.are.equal("exact", core.config("logits"))
    core.config("logits", "auto")
    assert.are.equal("tensor", core.config("logits"))
    core.config("logits", "exact")
    core.config("logits", "")
    assert.are.equal("tensor", core.config("logits"))
  end)

  -- one row per bad value: how it is given, the message expected
  local BAD = {
    { function() core.config("logits", "fast") end, 'config: logits must be auto or one of tensor, exact, got "fast"' },
    { function() core.config("logits", "TENSOR") end, 'got "TENSOR"' },
    { function() moe.config { logits = "mma" } end, "option 'logits' must be auto or one of tensor, exact, got \"mma\"" },
    { function() moe.config { logits = "" } end, "option 'logits' must be 'tensor', 'exact' or 'auto', got \"\"" },
    { function() moe.config { logits = 1 } end, "option 'logits' must be a string, got 1" },
    { function() moe.config { logit = "exact" } end, "unknown option 'logit'" },
    { function() core.config("logit", "exact") end,
      'no option "logit" (schedule_kernel, experts_kernel, experts_fp8_kernel, logits)' },
  }
  for i, row in ipairs(BAD) do
    it("refuses bad value " .. i .. ": " .. row[2], function()
      local ok, err = pcall(row[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[2], 1, true), tostring(err))
      assert.are.equal("tensor", core.config("logits")) -- nothing was set
    end)
  end

  it("a refused moe.config sets none of its options", function()
    assert.is_false(pcall(moe.config, { experts_kernel = "auto", logits = "fastest" }))
    moe.config { logits = "exact" }
    assert.is_false(pcall(moe.config, { logits = "tensor", experts_kernel = "fastest" }))
    assert.are.equal("exact", moe.config().logits) -- tensor, set first, went back
  end)

  it("explain on the CPU: the reference backend, whatever the option", function()
    local x, w = moe.zeros({ 3, 64 }, { dtype = "bf16" }), moe.zeros({ 8, 64 }, { dtype = "bf16" })
    local c = moe.explain("logits", { x = x, w = w })
    assert.are.equal("cpu", c.kernel)
    assert.are.equal("cpu", c.candidates[1].name)
    moe.config { logits = "exact" }
    assert.are.equal("cpu", moe.explain("logits", { x = x, w = w, out = moe.zeros({ 3, 8 }) }).kernel)
  end)

  -- one row per bad explain call: its options, the message expected
  local x, w = moe.zeros({ 3, 64 }, { dtype = "bf16" }), moe.zeros({ 8, 64 }, { dtype = "bf16" })
  local BAD_EXPLAIN = {
    { { w = w }, "option 'x' is required" },
    { { x = x }, "option 'w' is required" },
    { { x = x, w = w, k = 1 }, "unknown option 'k'" },
    { { x = moe.zeros({ 3, 64 }), w = w }, "logits: x must be bf16" },
    { { x = x, w = moe.zeros({ 8, 32 }, { dtype = "bf16" }) }, "logits: w must be" },
    { { x = x, w = w, out = moe.zeros({ 3, 9 }) }, "logits: out must be f32 [3, 8]" },
  }
  for i, row in ipairs(BAD_EXPLAIN) do
    it("explain refuses bad call " .. i .. ": " .. row[2], function()
      local ok, err = pcall(moe.explain, "logits", row[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[2], 1, true), tostring(err))
    end)
  end

  it("the layer's option router: tensor or exact, shown by plan()", function()
    local o = { model = "qwen3_235b", world = 2, tokens = 4, hidden = 32, ffn = 16, experts = 8, k = 2, device = "cpu" }
    assert.are.equal("tensor", moe.layer(o).router)
    o.router = "exact"
    local layer = moe.layer(o)
    assert.are.equal("exact", layer.router)
    assert.are.equal("cpu", layer:plan()[1].router.kernel)
    assert.is_nil(layer:plan()[2].router) -- one shard: its router is rank 0's entry
    o.router = "fast"
    local ok, err = pcall(moe.layer, o)
    assert.is_false(ok)
    assert.truthy(err:find("option 'router' must be one of", 1, true), err)
  end)
end)

-- |t|, elementwise, of a bf16 tensor on the CPU (exact: bf16 has a sign bit).
local function abs_of(t)
  local flat = t:to("cpu"):flat()
  for i, v in ipairs(flat) do flat[i] = math.abs(v) end
  return S.tensor(flat, "bf16", t.shape)
end

-- The CPU's logits of x and w, and the bound on |tensor - cpu| per element: both are f32 sums of
-- the same exact bf16 products in two orders, each within H ulps of its terms' magnitude
-- (round-to-nearest, or truncation in the tensor cores: 2^-23 per addition, at most H of them),
-- so |tensor - cpu| <= H * 2^-23 * sum_i |x_i| |w_i|, which the CPU computes from |x| and |w|.
local function cpu_logits_and_bound(x, w)
  local N, H, E = x.shape[1], x.shape[2], w.shape[1]
  local xc, wc = x:to("cpu"), w:to("cpu")
  local ref, mag = moe.zeros({ N, E }), moe.zeros({ N, E })
  core.logits(ref, xc, wc)
  core.logits(mag, abs_of(xc), abs_of(wc))
  local bound = mag:flat()
  for i, m in ipairs(bound) do bound[i] = H * 2 ^ -23 * m end
  return ref:flat(), bound
end

local function gpu_logits(x, w)
  local out = moe.full({ x.shape[1], w.shape[1] }, 0 / 0, { device = x.device }) -- poison: every element written
  core.logits(out, x, w)
  return out
end

-- The first element out of bound, as a message, or nil.
local function out_of_bound(got, ref, bound)
  for i = 1, #ref do
    local d = math.abs(got[i] - ref[i])
    if not (d <= bound[i]) then
      return string.format("element %d: tensor %.9g, cpu %.9g, |diff| %.3g > bound %.3g", i - 1, got[i], ref[i], d,
        bound[i])
    end
  end
end

describe("logits on a GPU [#gpu]", function()
  if skip_without("cuda:0") then return end
  local dev = "cuda:0"
  after_each(function() core.config("logits", "tensor") end)

  local function inputs(N, E, H, seed)
    return moe.randn({ N, H }, { dtype = "bf16", seed = seed, device = dev }),
      moe.randn({ E, H }, { dtype = "bf16", seed = seed + 1, std = 1 / math.sqrt(H), device = dev })
  end

  -- tokens, experts, H: odd N around the 128-row tiles, E around the expert tiles (on Hopper 64
  -- wide but for 384: 96, and 512: 128), H from one stage of 64 to Kimi K2's 7168, and an H of 8s
  -- that leaves a partial stage
  local CASES = { { 1, 8, 64 }, { 7, 64, 128 }, { 129, 384, 1024 }, { 129, 385, 520 }, { 7, 384, 7168 },
    { 130, 8, 64 }, { 257, 129, 192 }, { 131, 256, 200 }, { 9, 512, 64 } }

  for _, c in ipairs(CASES) do
    local N, E, H = c[1], c[2], c[3]
    it(string.format("tensor path: N = %d, E = %d, H = %d within H 2^-23 sum |x||w| of the CPU's", N, E, H), function()
      local x, w = inputs(N, E, H, N + E + H)
      assert.are.equal("tensor", moe.explain("logits", { x = x, w = w }).kernel)
      local ref, bound = cpu_logits_and_bound(x, w)
      local got = gpu_logits(x, w):flat()
      local why = out_of_bound(got, ref, bound)
      assert.is_nil(why, why)
      -- and the exact path: the CPU's bits
      core.config("logits", "exact")
      assert.tensor_equal(gpu_logits(x, w), ref)
    end)
  end

  -- The long batch has more CTAs (47 token tiles x 4 expert tiles) than a Hopper GPU has SMs, so
  -- it runs on the ring of three stages, and a row alone on the deeper one.
  it("a row's logits are the same bits alone, in a short batch and in a long one", function()
    local N, E, H = 6000, 384, 512
    local x, w = inputs(N, E, H, 5)
    local all = gpu_logits(x, w):flat()
    for _, r in ipairs { 0, 1, 127, 128, 255, 299, 5999 } do
      local alone = gpu_logits(x:view(r * H, { 1, H }), w):flat()
      local first_seven = r + 7 <= N and gpu_logits(x:view(r * H, { 7, H }), w):flat() or nil
      for e = 1, E do
        assert.are.equal(all[r * E + e], alone[e], string.format("row %d expert %d alone", r, e - 1))
        if first_seven then assert.are.equal(all[r * E + e], first_seven[e]) end
      end
    end
  end)

  it("NaN in a token's x makes that row NaN and leaves the others' bits", function()
    local N, E, H = 9, 64, 128
    local x, w = inputs(N, E, H, 9)
    local before = gpu_logits(x, w):flat()
    local flat = x:to("cpu"):flat()
    flat[3 * H + 17] = 0 / 0 -- token 3
    local out = gpu_logits(S.tensor(flat, "bf16", { N, H }, dev), w):flat()
    for n = 0, N - 1 do
      for e = 1, E do
        local i = n * E + e
        if n == 3 then assert.is_true(out[i] ~= out[i], "row 3 is NaN")
        else assert.are.equal(before[i], out[i]) end
      end
    end
  end)

  it("explain: exact where asked, or where the tensor path cannot take the problem", function()
    local x, w = inputs(4, 8, 64, 1)
    core.config("logits", "exact")
    local c = moe.explain("logits", { x = x, w = w })
    assert.are.equal("exact", c.kernel)
    assert.truthy(c.candidates[1].verdict:find('logits is "exact"', 1, true), tostring(c))
    core.config("logits", "tensor")
    local x2, w2 = inputs(4, 8, 100, 1)
    c = moe.explain("logits", { x = x2, w = w2 })
    assert.are.equal("exact", c.kernel)
    assert.truthy(c.candidates[1].verdict:find("H = 100 is not a multiple of 8", 1, true), tostring(c))
    -- and there the logits are the CPU's bit for bit
    local ref = cpu_logits_and_bound(x2, w2)
    assert.tensor_equal(gpu_logits(x2, w2), ref)
  end)

  it("the route stage on the GPU's logits gives the CPU route stage's ids and weights", function()
    local N, E, H = 257, 384, 1024
    local x, w = inputs(N, E, H, 21)
    local logits = gpu_logits(x, w)
    local bias = moe.randn({ E }, { seed = 22, std = 0.01, device = dev })
    local o = { k = 8, scoring = "sigmoid", scale = 2.827 }
    local function route(l, b)
      return moe.route { logits = l, bias = b, k = o.k, scoring = o.scoring, scale = o.scale }
    end
    local ig, wg = route(logits, bias)
    local ic, wc = route(logits:to("cpu"), bias:to("cpu"))
    assert.tensor_equal(ig, ic)
    assert.tensor_equal(wg, wc)
  end)

  it("a layer's check compares its routing with the CPU's on its logits, for either path", function()
    for _, path in ipairs { "tensor", "exact" } do
      local layer = moe.layer { model = "kimi_k2", world = 2, tokens = 16, hidden = 128, ffn = 64, experts = 64, k = 4,
        groups = 1, topk_groups = 1, device = dev, router = path }
      local x = moe.randn({ 2, 16, 128 }, { dtype = "bf16", seed = 4, device = dev })
      layer:forward(x)
      local m = layer:check(x, { raise = false })
      assert.is_nil(m.routing, m.routing)
      assert.is_true(m.pass)
      assert.are.equal(path, layer:plan()[1].router.kernel)
    end
  end)
end)
