-- SPDX-License-Identifier: MIT
-- Checkpoints: the safetensors reader (moe.safetensors, lua/core/safetensors.c) and layers loaded
-- from synthetic Hugging Face checkpoints written by spec/safetensors_writer.lua (one
-- model.safetensors, or an index and shards; BF16, or F8_E4M3 with block scales), each value held
-- against the writer's own decode of its bits; the FP8 layer's weights taken from F8_E4M3 as they
-- are; then every error a checkpoint can raise, a row each.
local W = require "safetensors_writer"

-- The values of t (any device) equal want exactly, element by element, a zero's sign too (so an
-- e4m3 tensor's values equal the codes they decode: its bytes).
local function assert_values(t, want, what)
  local got = t:to("cpu"):flat()
  assert.are.equal(#want, #got, what .. ": element count")
  for i = 1, #want do
    if (got[i] ~= want[i] or 1 / got[i] ~= 1 / want[i]) and not (got[i] ~= got[i] and want[i] ~= want[i]) then
      error(string.format("%s: element %d is %.9g, the file's value is %.9g", what, i, got[i], want[i]), 2)
    end
  end
end

-- A small checkpoint in a fresh directory: 8 experts, H 32, F 16, a shared expert of 16, MoE
-- layers 1 and 2 (o overrides any of it) -> dir, tensors by name.
local function small(o)
  local spec = { experts = 8, hidden = 32, ffn = 16, shared_ffn = 16, layers = { 1, 2 } }
  for k, v in pairs(o or {}) do spec[k] = v end
  local dir = W.tempdir()
  return dir, W.checkpoint(dir, spec)
end

-- The lists of lists, one after the other, in one list.
local function concat(lists)
  local out = {}
  for _, list in ipairs(lists) do
    for _, v in ipairs(list) do out[#out + 1] = v end
  end
  return out
end

describe("safetensors reader [#cpu]", function()
  local dir, ts
  setup(function() dir, ts = small { shards = 1 } end)
  teardown(function() W.remove(dir) end)

  it("reads every tensor of the file back bit for bit (BF16 into bf16, F32 into f32)", function()
    local f = moe.safetensors(dir .. "/model.safetensors")
    local names = f:names()
    local n = 0
    for name, t in pairs(ts) do
      n = n + 1
      local info = f:info(name)
      assert.are.same(t.shape, info.shape)
      assert.are.equal(t.dtype, info.dtype)
      assert.are.equal(#t.data, info.nbytes)
      local dst = moe.zeros(t.shape, { dtype = t.dtype == "F32" and "f32" or "bf16" })
      assert.are.equal(dst, f:read(name, dst))
      assert_values(dst, t.values, name)
    end
    assert.are.equal(n, #names)
    for i = 2, #names do assert.is_true(names[i - 1] < names[i], "names in order") end
    assert.is_nil(f:info("model.layers.9.mlp.gate.weight"))
    assert.truthy(tostring(f):find("moelab.SafeTensors('" .. dir .. "/model.safetensors', " .. n .. " tensors)", 1,
      true))
    f:close()
    f:close() -- closing twice does nothing
    assert.are.equal("moelab.SafeTensors(closed)", tostring(f))
    local ok, err = pcall(f.names, f)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("moelab.SafeTensors is closed", 1, true), tostring(err))
  end)

  it("reads BF16 into f32 exactly and F32 into bf16 to nearest even", function()
    local f = moe.safetensors(dir .. "/model.safetensors")
    local router, bias = "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"
    assert_values(f:read(router, moe.zeros(ts[router].shape)), ts[router].values, router)
    local want = {}
    for i, v in ipairs(ts[bias].values) do want[i] = W.bf16(v) end
    assert_values(f:read(bias, moe.zeros(ts[bias].shape, { dtype = "bf16" })), want, bias)
  end)

  it("refuses what does not fit, naming the file, the tensor and both shapes", function()
    local f = moe.safetensors(dir .. "/model.safetensors")
    local path = dir .. "/model.safetensors"
    local rows = {
      { "model.layers.1.mlp.gate.weight", moe.zeros({ 32, 8 }, { dtype = "bf16" }), nil,
        "tensor 'model.layers.1.mlp.gate.weight' is BF16 [8, 32], the destination is bf16 [32, 8] on cpu" },
      { "model.layers.1.mlp.gate.weight", moe.zeros({ 8, 32 }, { dtype = "i32" }), nil, "not into i32 [8, 32]" },
      { "model.layers.7.mlp.gate.weight", moe.zeros({ 8, 32 }), nil,
        "'" .. path .. "' has no tensor 'model.layers.7.mlp.gate.weight'" },
      { "model.layers.1.mlp.gate.weight", moe.zeros({ 8, 32 }), moe.zeros({ 1, 1 }),
        "a block scale goes with a 2-D F8_E4M3 tensor" },
    }
    for _, row in ipairs(rows) do
      local ok, err = pcall(f.read, f, row[1], row[2], row[3])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[4], 1, true), tostring(err))
    end
    assert.has_error(function() moe.safetensors(42) end,
      "bad argument #1 to 'safetensors' (path must be a string, got 42)")
  end)

  it("the writer's own rounding (its decode of FP8) rounds as the library does, ties to even", function()
    -- f32 values halfway between two bf16 values, either parity, either sign; and a subnormal
    local xs = { 1 + 2 ^ -8, 1 + 3 * 2 ^ -8, -(1 + 2 ^ -8), 3 + 2 ^ -7, 2 ^ -130 + 2 ^ -140, 1 + 2 ^ -9 }
    local mine = {}
    for i, x in ipairs(xs) do mine[i] = W.bf16(x) end
    assert_values(moe.tensor(xs, { dtype = "bf16" }), mine, "bf16 rounding")
    assert.are.same({ 1, 1 + 2 ^ -6, -1 }, { mine[1], mine[2], mine[3] })
    assert.are.equal(W.f32(1 + 2 ^ -24), 1)
    assert.are.equal(W.f32(1 + 3 * 2 ^ -24), 1 + 2 ^ -22)
  end)

  it("decodes F8_E4M3 with its block scale to exactly bf16(q x scale), zero blocks and partial blocks included",
    function()
      local fdir = W.tempdir()
      finally(function() W.remove(fdir) end)
      -- F 132 and H 136: 128 x 128 blocks, the last ones partial in both dimensions
      local fts = W.checkpoint(fdir, { experts = 2, hidden = 136, ffn = 132, layers = { 1 }, fp8 = true, shards = 2 })
      local ck = moe.checkpoint(fdir)
      local zero_block, zero_scale
      for _, e in ipairs { 0, 1 } do
        for _, proj in ipairs { "gate", "up", "down" } do
          local name = string.format("model.layers.1.mlp.experts.%d.%s_proj.weight", e, proj)
          local t = ck:tensor(name)
          assert.are.equal("bf16", t.dtype)
          assert.are.same(fts[name].shape, t.shape)
          assert_values(t, fts[name].values, name)
          -- the writer's own decode, from the codes and scales (independent of its values)
          local q, s = fts[name].q, fts[name .. "_scale_inv"].values
          local C = fts[name].shape[2]
          local v = t:flat()
          for i = 1, #q, 997 do
            local r, c = math.floor((i - 1) / C), (i - 1) % C
            local scale = s[math.floor(r / 128) * math.ceil(C / 128) + math.floor(c / 128) + 1]
            assert.are.equal(W.bf16(W.f32(W.e4m3_value(q[i]) * scale)), v[i], name .. " element " .. i)
          end
          -- block (0, 0) of expert 0's gate holds zero codes; expert 1's up has a zero scale there
          local function zeros(r0, r1, c0, c1)
            local all = true
            for r = r0, r1 do for c = c0, c1 do all = all and v[r * C + c + 1] == 0 end end
            return all
          end
          if e == 0 and proj == "gate" then zero_block = zeros(0, 127, 0, 127) and not zeros(0, 127, 128, C - 1) end
          if e == 1 and proj == "up" then
            zero_scale = s[1] == 0 and zeros(0, 127, 0, 127) and not zeros(128, 131, 0, 127)
          end
        end
      end
      assert.are.same({ true, true }, { zero_block, zero_scale }, "the zero block and the zero scale, written and read")
      -- a weight and its scale in different files: the index says where each is
      local f1, f2 = ck:locate("model.layers.1.mlp.experts.0.gate_proj.weight"),
        ck:locate("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv")
      assert.are_not.equal(f1:path(), f2:path())
      ck:close()
    end)

  it("a checkpoint lists its MoE layers and their sizes", function()
    local ck = moe.checkpoint(dir)
    assert.are.same({ 1, 2 }, ck:layers())
    assert.are.same({ experts = 8, hidden = 32, ffn = 16, shared_ffn = 16, bias = true, dtype = "BF16" }, ck:sizes(2))
    local ok, err = pcall(ck.sizes, ck, 0)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("has no MoE layer 0 (no tensor 'model.layers.0.mlp.gate.weight'); its MoE "
      .. "layers: 1-2", 1, true), tostring(err))
    -- the file itself names the same checkpoint
    assert.are.same(ck:sizes(1), moe.checkpoint(dir .. "/model.safetensors"):sizes(1))
  end)
end)

-- The checkpoint's tensors that make each expert weight of rank r of MoE layer n (EL experts a
-- rank; rank nil: the shared expert's), in the order the layer stacks them: w_gate_up (gate rows
-- then up rows of each local expert), w_down.
local function weight_names(n, r, EL)
  local p = string.format("model.layers.%d.mlp.", n)
  if not r then
    return { w_gate_up = { p .. "shared_experts.gate_proj.weight", p .. "shared_experts.up_proj.weight" },
      w_down = { p .. "shared_experts.down_proj.weight" } }
  end
  local gu, down = {}, {}
  for j = 0, EL - 1 do
    local e = r * EL + j
    gu[#gu + 1] = string.format("%sexperts.%d.gate_proj.weight", p, e)
    gu[#gu + 1] = string.format("%sexperts.%d.up_proj.weight", p, e)
    down[#down + 1] = string.format("%sexperts.%d.down_proj.weight", p, e)
  end
  return { w_gate_up = gu, w_down = down }
end

-- The writer's field of each tensor of names, one list after the other.
local function field_of(ts, names, field)
  local lists = {}
  for i, name in ipairs(names) do lists[i] = ts[name][field] end
  return concat(lists)
end

-- The expected weights of rank r of a layer over W ranks, from the writer's values: w_gate_up
-- [EL, 2F, H], w_down [EL, H, F].
local function rank_weights(ts, n, r, EL, F, H)
  local names = weight_names(n, r, EL)
  return moe.tensor(field_of(ts, names.w_gate_up, "values"), { dtype = "bf16", shape = { EL, 2 * F, H } }),
    moe.tensor(field_of(ts, names.w_down, "values"), { dtype = "bf16", shape = { EL, H, F } })
end

-- What the FP8 layer holds of the tensors names, stacked along their rows: an F8_E4M3 tensor's
-- codes (decoded by the writer) and its weight_scale_inv as written; any other's bf16 values
-- through moe.quantize's 128 x 128 blocks.  -> the values of q, of its scales (flat).
local function fp8_expected(ts, names)
  local qs, scales = {}, {}
  for i, name in ipairs(names) do
    local t = ts[name]
    if t.dtype == "F8_E4M3" then
      qs[i] = {}
      for k, code in ipairs(t.q) do qs[i][k] = W.e4m3_value(code) end
      scales[i] = ts[name .. "_scale_inv"].values
    else
      local q, sc = moe.quantize(moe.tensor(t.values, { dtype = "bf16", shape = t.shape }), { kind = "block" })
      qs[i], scales[i] = q:flat(), sc:flat()
    end
  end
  return concat(qs), concat(scales)
end

local CASES = {
  { what = "BF16, one model.safetensors", ck = { shards = 1 }, H = 32, F = 16, E = 8, world = 4, k = 2, Fs = 16 },
  { what = "F8_E4M3 with block scales, an index and 3 shards", ck = { shards = 3, fp8 = true, experts = 4,
    hidden = 136, ffn = 132, shared_ffn = 132 }, H = 136, F = 132, E = 4, world = 2, k = 2, Fs = 132 },
}

for _, dev in ipairs(ALL_DEVICES) do
  describe("a layer from a checkpoint [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    for _, case in ipairs(CASES) do
      it(case.what .. ": its weights are the file's, and its output the dense reference of them", function()
        local dir, ts = small(case.ck)
        finally(function() W.remove(dir) end)
        local H, F, E, Wn, Fs = case.H, case.F, case.E, case.world, case.Fs
        local layer = moe.layer { model = "kimi_k2", checkpoint = dir, layer = 2, world = Wn, tokens = 6, hidden = H,
          ffn = F, experts = E, k = case.k, shared_ffn = Fs, device = dev }
        local EL = E / Wn
        local p = "model.layers.2.mlp."
        assert_values(layer.w_router, ts[p .. "gate.weight"].values, "router")
        assert_values(layer.bias, ts[p .. "gate.e_score_correction_bias"].values, "bias")
        local gus, downs = {}, {}
        for r = 0, Wn - 1 do
          gus[r + 1], downs[r + 1] = rank_weights(ts, 2, r, EL, F, H)
          assert_values(layer.w_gate_up[r + 1], gus[r + 1]:flat(), "w_gate_up of rank " .. r)
          assert_values(layer.w_down[r + 1], downs[r + 1]:flat(), "w_down of rank " .. r)
        end
        local sgu = moe.tensor(concat { ts[p .. "shared_experts.gate_proj.weight"].values,
          ts[p .. "shared_experts.up_proj.weight"].values }, { dtype = "bf16", shape = { 1, 2 * Fs, H } })
        local sdown = moe.tensor(ts[p .. "shared_experts.down_proj.weight"].values,
          { dtype = "bf16", shape = { 1, H, Fs } })
        assert_values(layer.shared_gate_up, sgu:flat(), "shared_gate_up")
        assert_values(layer.shared_down, sdown:flat(), "shared_down")

        local x = moe.randn({ Wn, 6, H }, { dtype = "bf16", seed = 5, device = dev })
        local out = layer:forward(x)
        layer:check(x)
        -- the dense reference of the writer's weights, with the routing the forward chose
        local N = Wn * 6
        local ref = moe.zeros({ N, H })
        moe.core.reference { out = ref, x = x:to("cpu"):view(0, { N, H }),
          ids = layer.ids:to("cpu"):view(0, { N, case.k }), weights = layer.weights:to("cpu"):view(0, { N, case.k }),
          w_gate_up = gus, w_down = downs, world = Wn, experts = E, shared_gate_up = sgu, shared_down = sdown }
        assert.close(out, ref:view(0, { Wn, 6, H }))
      end)
    end

    it("takes the model by name or as a table, and a softmax model reads no bias", function()
      local dir = small { bias = false, shared_ffn = 0 }
      finally(function() W.remove(dir) end)
      local o = { checkpoint = dir, layer = 1, world = 2, tokens = 4, hidden = 32, ffn = 16, experts = 8, device = dev }
      o.model = "qwen3_235b"
      local a = moe.layer(o)
      o.model = moe.models.qwen3_235b
      local b = moe.layer(o)
      assert.is_nil(a.bias)
      local x = moe.randn({ 2, 4, 32 }, { dtype = "bf16", seed = 6, device = dev })
      assert.tensor_equal(a:forward(x), b:forward(x))
      a:check(x)
    end)
  end)
end

-- Experts 4, H 256, F 128, a shared expert of 128, MoE layer 2, over 2 ranks: every scale tensor
-- of more than one block, the layer's w_gate_up_scale [2, 2, 2] (a gate row, an up row each).
local FP8 = { experts = 4, hidden = 256, ffn = 128, shared_ffn = 128, layers = { 2 }, shards = 2 }

-- An FP8 layer of FP8's sizes on dev, with the checkpoint in dir (nil: the seed rule's weights).
local function fp8_layer(dir, dev)
  return moe.layer { model = "kimi_k2", checkpoint = dir, layer = dir and 2, world = 2, tokens = 8, hidden = 256,
    ffn = 128, experts = 4, k = 2, shared_ffn = 128, device = dev, precision = "fp8", seed = 4 }
end

for _, dev in ipairs(ALL_DEVICES) do
  describe("an FP8 layer from a checkpoint [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    it("takes F8_E4M3 experts' bytes and scales as they are and quantizes the BF16 ones beside them; its check "
      .. "passes and its forward is that of a layer given the same bytes", function()
      -- FP8 but for one expert's down and the shared expert's up: a checkpoint mixed per tensor
      local o = { fp8 = function(name)
        return not name:find("experts.3.down_proj", 1, true) and not name:find("shared_experts.up_proj", 1, true)
      end }
      for k, v in pairs(FP8) do o[k] = v end
      local dir, ts = small(o)
      finally(function() W.remove(dir) end)
      assert.are.equal("BF16", ts["model.layers.2.mlp.experts.3.down_proj.weight"].dtype)
      assert.are.equal("F8_E4M3", ts["model.layers.2.mlp.experts.3.up_proj.weight"].dtype)
      local layer = fp8_layer(dir, dev)
      local seeded = fp8_layer(nil, dev)
      local p = "model.layers.2.mlp."
      -- each weight: the tensors it stacks, the layer's e4m3 and scales, the seeded layer's, its name
      local held = {}
      for r = 0, 1 do
        local names = weight_names(2, r, 2)
        for _, w in ipairs { "w_gate_up", "w_down" } do
          held[#held + 1] = { names[w], layer[w][r + 1], layer[w .. "_scale"][r + 1], seeded[w][r + 1],
            seeded[w .. "_scale"][r + 1], w .. " of rank " .. r }
        end
      end
      local shared = weight_names(2)
      for _, w in ipairs { "gate_up", "down" } do
        local n = "shared_" .. w
        held[#held + 1] = { shared["w_" .. w], layer[n], layer[n .. "_scale"], seeded[n], seeded[n .. "_scale"], n }
      end
      for _, h in ipairs(held) do
        local want_q, want_scale = fp8_expected(ts, h[1])
        assert_values(h[2], want_q, h[6])
        assert_values(h[3], want_scale, h[6] .. "'s scales")
        -- the seeded layer given the same bytes, written as values (which e4m3 holds exactly)
        h[4]:copy(moe.tensor(want_q, { dtype = "e4m3", shape = h[2].shape, device = dev }))
        h[5]:copy(moe.tensor(want_scale, { shape = h[3].shape, device = dev }))
      end
      seeded.w_router:copy(moe.tensor(ts[p .. "gate.weight"].values, { dtype = "bf16", shape = { 4, 256 },
        device = dev }))
      seeded.bias:copy(moe.tensor(ts[p .. "gate.e_score_correction_bias"].values, { device = dev }))
      local x = moe.randn({ 2, 8, 256 }, { dtype = "bf16", seed = 9, device = dev })
      local out = layer:forward(x):to("cpu")
      local m = layer:check(x, { raise = false })
      assert.is_true(m.pass, string.format("rel_max %.3g, rel_l2 %.3g", m.rel_max, m.rel_l2))
      assert.tensor_equal(out, seeded:forward(x):to("cpu"))
      assert.is_true(seeded:check(x, { raise = false }).pass)
    end)

    it("quantizes a BF16 checkpoint's experts as moe.quantize does the whole weight, bit for bit", function()
      local dir, ts = small(FP8)
      finally(function() W.remove(dir) end)
      local layer = fp8_layer(dir, dev)
      for r = 0, 1 do
        local gu, down = rank_weights(ts, 2, r, 2, 128, 256)
        for _, w in ipairs { { gu, "w_gate_up" }, { down, "w_down" } } do
          local q, sc = moe.quantize(w[1], { kind = "block" })
          assert_values(layer[w[2]][r + 1], q:flat(), w[2] .. " of rank " .. r)
          assert_values(layer[w[2] .. "_scale"][r + 1], sc:flat(), w[2] .. "_scale of rank " .. r)
        end
      end
      local x = moe.randn({ 2, 8, 256 }, { dtype = "bf16", seed = 10, device = dev })
      layer:forward(x)
      layer:check(x)
    end)
  end)
end

describe("checkpoint errors [#cpu]", function()
  local base = { model = "kimi_k2", layer = 1, world = 2, tokens = 4, hidden = 32, ffn = 16, experts = 8, k = 2,
    shared_ffn = 16, device = "cpu" }
  local p = "model.layers.1.mlp."
  -- Each row: what, the writer's options and edits over a small checkpoint's (ck), a function of
  -- the directory that edits it after it is written (post), the layer's options over base (opts;
  -- checkpoint = the directory unless given, false: left out), and the message's words (%s: the
  -- directory).
  local rows = {
    { "no such directory", opts = { checkpoint = "/tmp/moelab-ckpt.absent" },
      err = "checkpoint '/tmp/moelab-ckpt.absent' holds neither model.safetensors.index.json nor model.safetensors" },
    { "an index naming a file that is not there", ck = { shards = 2 },
      post = function(dir) os.remove(dir .. "/model-00002-of-00002.safetensors") end,
      err = "cannot open '%s/model-00002-of-00002.safetensors': No such file or directory" },
    { "an index that is not JSON", ck = { shards = 2 },
      post = function(dir)
        local f = io.open(dir .. "/model.safetensors.index.json", "wb")
        f:write('{"weight_map": {"a": "b",}}')
        f:close()
      end,
      err = "checkpoint index '%s/model.safetensors.index.json' is not valid JSON at byte 25: expected a string key" },
    { "an index mapping a tensor to a path", ck = { shards = 2 },
      post = function(dir)
        local f = io.open(dir .. "/model.safetensors.index.json", "wb")
        f:write('{"weight_map": {"' .. p .. 'gate.weight": "../elsewhere.safetensors"}}')
        f:close()
      end,
      err = "maps '" .. p .. "gate.weight' to \"../elsewhere.safetensors\", not the name of a file beside it" },
    { "a file whose header is not JSON", ck = { shards = 1 },
      post = function(dir) W.write(dir .. "/model.safetensors", {}, { header = '{"a": {"dtype": "BF16",}}' }) end,
      err = "'%s/model.safetensors': malformed header at byte 31: expected a string, got '}'" },
    { "data offsets past the end of the file", ck = { shards = 1 },
      post = function(dir)
        local path = dir .. "/model.safetensors"
        local f = io.open(path, "rb")
        local text = f:read("*a")
        f:close()
        f = io.open(path, "wb")
        f:write(text:sub(1, #text - 3))
        f:close()
      end,
      err = "run past the end of the data" },
    { "a missing expert", ck = { change = function(t) t[p .. "experts.3.up_proj.weight"].name = "renamed" end },
      err = "checkpoint '%s' has no tensor '" .. p .. "experts.3.up_proj.weight'" },
    { "an index mapping a tensor to a file without it", ck = { shards = 2 },
      post = function(dir)
        local f = io.open(dir .. "/model.safetensors.index.json", "rb")
        local text = f:read("*a")
        f:close()
        f = io.open(dir .. "/model.safetensors.index.json", "wb")
        f:write((text:gsub('("' .. p:gsub("%.", "%%.") .. 'gate%.weight": "model%-0000)(%d)', function(a, d)
          return a .. (d == "1" and "2" or "1")
        end)))
        f:close()
      end,
      err = "maps '" .. p .. "gate.weight' to model-0000" },
    { "a layer's FFN width the experts do not have", opts = { ffn = 8, shared_ffn = 8 },
      err = "checkpoint's " .. p .. "experts.0.gate_proj.weight is [16, 32], the layer's ffn = 8 and hidden = 32 want "
        .. "[8, 32]" },
    { "a hidden size the router does not have", opts = { hidden = 64 },
      err = "checkpoint's " .. p .. "gate.weight is [8, 32], the layer's experts = 8 and hidden = 64 want [8, 64]" },
    { "another number of experts", opts = { experts = 16 },
      err = "checkpoint's " .. p .. "gate.weight is [8, 32], the layer's experts = 16 and hidden = 32 want [16, 32]" },
    { "a shared expert of another width", opts = { shared_ffn = 32 },
      err = "checkpoint's " .. p .. "shared_experts.gate_proj.weight is [16, 32], the layer's shared_ffn = 32 and "
        .. "hidden = 32 want [32, 32]" },
    { "a weight of a dtype moelab does not read",
      ck = { change = function(t) t[p .. "experts.2.down_proj.weight"].dtype = "I16" end },
      err = "checkpoint's " .. p .. "experts.2.down_proj.weight is I16; moelab reads BF16, F16, F32 and F8_E4M3" },
    { "an FP8 weight without its scale",
      ck = { fp8 = true, change = function(t) t[p .. "experts.1.gate_proj.weight_scale_inv"].name = "renamed" end },
      err = "checkpoint's " .. p .. "experts.1.gate_proj.weight is F8_E4M3 without its block scale '" .. p
        .. "experts.1.gate_proj.weight_scale_inv'" },
    { "an FP8 scale of the wrong shape",
      ck = { fp8 = true, change = function(t)
        local s = t[p .. "experts.0.down_proj.weight_scale_inv"]
        s.shape, s.data = { 2, 1 }, s.data .. s.data
      end },
      err = "checkpoint's " .. p .. "experts.0.down_proj.weight_scale_inv is F32 [2, 1], its weight [32, 16] in "
        .. "128x128 blocks wants F32 [1, 1]" },
    { "an FP8 scale in BF16",
      ck = { fp8 = true, change = function(t)
        local s = t[p .. "experts.0.up_proj.weight_scale_inv"]
        s.dtype, s.data = "BF16", s.data:sub(3, 4)
      end },
      err = "checkpoint's " .. p .. "experts.0.up_proj.weight_scale_inv is BF16 [1, 1], its weight [16, 32] in "
        .. "128x128 blocks wants F32 [1, 1]" },
    { "the FP8 layer: an FP8 weight without its scale", ck = { fp8 = true, experts = 2, hidden = 128, ffn = 128,
      shared_ffn = 128, change = function(t) t[p .. "shared_experts.down_proj.weight_scale_inv"].name = "renamed" end },
      opts = { precision = "fp8", experts = 2, hidden = 128, ffn = 128, shared_ffn = 128 },
      err = "checkpoint's " .. p .. "shared_experts.down_proj.weight is F8_E4M3 without its block scale '" .. p
        .. "shared_experts.down_proj.weight_scale_inv'" },
    { "the FP8 layer: an FP8 scale of the wrong shape", ck = { fp8 = true, experts = 2, hidden = 256, ffn = 128,
      shared_ffn = 128, change = function(t)
        local s = t[p .. "experts.1.up_proj.weight_scale_inv"]
        s.shape = { 2, 1 }
      end },
      opts = { precision = "fp8", experts = 2, hidden = 256, ffn = 128, shared_ffn = 128 },
      err = "checkpoint's " .. p .. "experts.1.up_proj.weight_scale_inv is F32 [2, 1], its weight [128, 256] in "
        .. "128x128 blocks wants F32 [1, 2]" },
    { "the FP8 layer: a hidden size not a multiple of 128, whatever the checkpoint", ck = { fp8 = true },
      opts = { precision = "fp8" }, err = "precision = 'fp8' needs hidden a multiple of 128 (the FP8 block), got 32" },
    { "an index nested past the parser's depth", ck = { shards = 2 },
      post = function(dir)
        local f = io.open(dir .. "/model.safetensors.index.json", "wb")
        f:write('{"weight_map": {}, "x": ' .. string.rep("[", 70) .. string.rep("]", 70) .. "}")
        f:close()
      end,
      err = "is not valid JSON at byte 87: values nested more than 64 deep" },
    { "a sigmoid router without its bias", ck = { bias = false },
      err = "has no tensor '" .. p .. "gate.e_score_correction_bias'" },
    { "a shared expert the checkpoint does not have", ck = { shared_ffn = 0 },
      err = "has no tensor '" .. p .. "shared_experts.gate_proj.weight'" },
    { "a MoE layer that is not there", opts = { layer = 5 },
      err = "checkpoint '%s' has no MoE layer 5 (no tensor 'model.layers.5.mlp.gate.weight'); its MoE layers: 1-2" },
    { "a dense layer", opts = { layer = 0 }, err = "has no MoE layer 0" },
    { "a layer index below 0", opts = { layer = -1 }, err = "option 'layer' must be >= 0, got -1" },
    { "a checkpoint without a layer", opts = { layer = false },
      err = "option 'checkpoint' needs option 'layer' (N of the checkpoint's model.layers.N)" },
    { "a layer without a checkpoint", opts = { checkpoint = false },
      err = "option 'layer' picks a layer of a checkpoint: give option 'checkpoint' too" },
    { "a checkpoint that is not a path", opts = { checkpoint = 7 },
      err = "option 'checkpoint' must be a string, got 7" },
    { "Qwen's gated shared expert", opts = { model = "qwen3_5_397b" },
      err = "the shared expert's sigmoid gate (Qwen's shared_expert_gate) cannot be read from a checkpoint: give "
        .. "shared = false" },
  }
  for _, row in ipairs(rows) do
    it(row[1], function()
      local dir = W.tempdir()
      local spec = { experts = 8, hidden = 32, ffn = 16, shared_ffn = 16, layers = { 1, 2 } }
      for k, v in pairs(row.ck or {}) do spec[k] = v end
      W.checkpoint(dir, spec)
      if row.post then row.post(dir) end
      local o = { checkpoint = dir }
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(row.opts or {}) do
        if v == false then o[k] = nil else o[k] = v end
      end
      local ok, err = pcall(function()
        local layer = moe.layer(o) -- not a tail call: the error names this line
        return layer
      end)
      W.remove(dir)
      assert.is_false(ok, "the layer was made")
      local want = row.err:gsub("%%s", (dir:gsub("%%", "%%%%")))
      assert.truthy(tostring(err):find(want, 1, true), tostring(err))
      assert.truthy(tostring(err):find("checkpoint_spec.lua:%d+:"), "the caller's line: " .. tostring(err))
    end)
  end
end)

describe("scenarios/kimi.lua --checkpoint [#cpu]", function()
  local build = os.getenv("MOE_BUILD_DIR") or "build"
  local dir, fp8_dir
  setup(function()
    dir, fp8_dir = W.tempdir(), W.tempdir()
    W.checkpoint(dir, { experts = 16, hidden = 32, ffn = 16, shared_ffn = 16, layers = { 3 }, shards = 2 })
    W.checkpoint(fp8_dir, { experts = 8, hidden = 128, ffn = 128, shared_ffn = 128, layers = { 3 }, shards = 2,
      fp8 = true })
  end)
  teardown(function()
    W.remove(dir)
    W.remove(fp8_dir)
  end)
  local function run(flags)
    local cmd = string.format("LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' "
      .. "lua scenarios/kimi.lua --device cpu --tokens 8 %s 2>&1; echo \"status=$?\"", build, flags)
    local f = assert(io.popen(cmd))
    local out = f:read("*a")
    f:close()
    return out
  end

  it("runs the checkpoint's layer, its sizes taken from the checkpoint, and checks it", function()
    local out = run("--checkpoint " .. dir .. " --layer 3")
    assert.truthy(out:find("weights   layer 3 of checkpoint " .. dir, 1, true), out)
    assert.truthy(out:find("E = 16 experts (2 per rank)", 1, true), out)
    assert.truthy(out:find("H = 32, F = 16, 8 tokens per rank", 1, true), out)
    assert.truthy(out:find("relative L2 = [%d.e+-]+ %(tol 1e%-02%), 0 NaN: PASS"), out)
    assert.truthy(out:find("status=0", 1, true), out)
  end)

  it("--precision fp8 runs an FP8 checkpoint's layer on its own bytes and checks it; a checkpoint of a hidden size "
    .. "not a multiple of 128 exits 2", function()
    local out = run("--precision fp8 --checkpoint " .. fp8_dir .. " --layer 3")
    assert.truthy(out:find("weights   layer 3 of checkpoint " .. fp8_dir .. " (F8_E4M3)", 1, true), out)
    assert.truthy(out:find("H = 128, F = 128, 8 tokens per rank", 1, true), out)
    assert.truthy(out:find("precision FP8", 1, true), out)
    assert.truthy(out:find("relative L2 = [%d.e+-]+ %(tol 2e%-02%), 0 NaN: PASS"), out)
    assert.truthy(out:find("status=0", 1, true), out)
    out = run("--precision fp8 --checkpoint " .. dir .. " --layer 3")
    assert.truthy(out:find("precision = 'fp8' needs hidden a multiple of 128 (the FP8 block), got 32", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
  end)

  it("a flag the checkpoint disagrees with, or no --layer, exits 2 with the reason", function()
    local out = run("--checkpoint " .. dir .. " --layer 3 --hidden 64")
    assert.truthy(out:find("--hidden 64 but layer 3 of the checkpoint has H = 32", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
    out = run("--checkpoint " .. dir)
    assert.truthy(out:find("--checkpoint needs --layer N", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
    out = run("--checkpoint " .. dir .. " --layer 4")
    assert.truthy(out:find("has no MoE layer 4", 1, true), out)
    assert.truthy(out:find("status=2", 1, true), out)
    assert.falsy(out:find("stack traceback", 1, true), out)
  end)
end)
