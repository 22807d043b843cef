-- SPDX-License-Identifier: MIT
-- Which kernel runs, asked from Lua: moe.config (the context's kernel options), moe.explain and
-- layer:plan, which report the choice each stage makes and why, running nothing.
local function cpu_layer(o)
  local opts = { model = "kimi_k2", world = 2, tokens = 4, hidden = 32, ffn = 16, shared_ffn = 16, device = "cpu" }
  for k, v in pairs(o or {}) do opts[k] = v end
  return moe.layer(opts)
end

-- every option's value until one is set
local DEFAULTS = { schedule_kernel = "auto", experts_kernel = "auto", experts_fp8_kernel = "auto", logits = "tensor" }

describe("moe.config, moe.explain and layer:plan [#cpu]", function()
  after_each(function() moe.config(DEFAULTS) end)

  it("the options are auto until set", function()
    assert.are.same(DEFAULTS, moe.config())
  end)

  it("a bad option or kernel name is an error at the caller's line that lists the choices", function()
    local kernels = { experts_kernel = "sm90w, sm90x2, sm90x1, mma",
      experts_fp8_kernel = "sm90w_fp8_n32, sm90t_fp8, sm90w_fp8, sm90x2_fp8" }
    for option, list in pairs(kernels) do
      local line = debug.getinfo(1, "l").currentline + 1
      local ok, err = pcall(function() moe.config { [option] = "fastest" } end)
      assert.is_false(ok)
      err = tostring(err)
      if not err:find("no GPU kernels", 1, true) then -- a build with the CUDA kernels
        assert.truthy(err:find("option '" .. option .. "' must be auto or one of " .. list .. ", got \"fastest\"", 1,
          true), err)
      end
      assert.truthy(err:find("plan_spec.lua:" .. line, 1, true), err)
    end
    assert.has_error(function() moe.config { expert_kernel = "mma" } end)
    assert.are.same(DEFAULTS, moe.config())
  end)

  it("explain reports the CPU backend for CPU tensors and refuses other stages", function()
    local ids = moe.tensor({ 0, 1, 2, 3, 1, 2, 3, 0 }, { dtype = "i32", shape = { 2, 2, 2 } })
    local choice = moe.explain("schedule", { ids = ids, experts = 4, rank = 1 })
    assert.are.equal("cpu", choice.kernel)
    assert.are.same({ { name = "cpu", verdict = "runs (the tensors are on the CPU: the reference backend)" } },
      choice.candidates)
    assert.are.equal("cpu\n  cpu: runs (the tensors are on the CPU: the reference backend)", tostring(choice))
    local x = moe.zeros({ 8, 16 }, { dtype = "bf16" })
    local e = moe.explain("experts", { x = x, offsets = moe.tensor({ 0, 3, 8 }, { dtype = "i32" }),
      w_gate_up = moe.zeros({ 2, 8, 16 }, { dtype = "bf16" }), w_down = moe.zeros({ 2, 16, 4 }, { dtype = "bf16" }) })
    assert.are.equal("cpu", e.kernel)
    assert.has_error(function() moe.explain("route", {}) end,
      "bad argument #1 to 'explain' (stage must be \"schedule\", \"experts\" or \"logits\", got \"route\")")
    assert.has_error(function() moe.explain("experts", { x = x }) end)
  end)

  it("layer:plan has a schedule and an experts choice for every rank, the shared expert's once", function()
    local plan = cpu_layer():plan()
    assert.are.equal(2, #plan)
    for r, p in ipairs(plan) do
      assert.are.equal(r - 1, p.rank)
      assert.are.equal("cpu", p.schedule.kernel)
      assert.are.equal("cpu", p.experts.kernel)
    end
    assert.are.equal("cpu", plan[1].shared.kernel)
    assert.is_nil(plan[2].shared)
    assert.is_nil(cpu_layer({ shared = false }):plan()[1].shared)
    local layer = cpu_layer()
    assert.are.equal("cpu", layer:plan(moe.zeros({ 2, 4, 32 }, { dtype = "bf16" }))[1].shared.kernel)
    assert.has_error(function() layer:plan(moe.zeros({ 2, 4, 16 }, { dtype = "bf16" })) end)
  end)

  it("config is all or nothing, and moe.event takes the default device", function()
    assert.has_error(function() moe.config { schedule_kernel = "auto", experts_kernel = "fastest" } end)
    assert.are.same(DEFAULTS, moe.config())
    local ok = pcall(moe.config, { schedule_kernel = "grid", experts_kernel = "fastest" })
    assert.is_false(ok)
    assert.are.equal("auto", moe.config().schedule_kernel) -- grid, set first, went back
    local e0, e1 = moe.event(), moe.event()
    e0:record()
    e1:record()
    assert.is_true(e1:elapsed_since(e0) >= 0)
  end)
end)

describe("layer:plan on a GPU [#gpu]", function()
  if skip_without("cuda:0") then return end
  after_each(function() moe.config { schedule_kernel = "auto", experts_kernel = "auto" } end)

  it("names the kernels the library picks, follows a forced one, and the forward still checks", function()
    -- H and F multiples of 64, as the Hopper kernels take them; 48 experts a rank, which the
    -- bitmap scheduler takes (two ranks would hold 192: past its 128)
    local layer = cpu_layer { device = "cuda:0", world = 8, tokens = 64, hidden = 128, ffn = 64, shared_ffn = 64 }
    assert.truthy(cpu_layer({ device = "cuda:0" }):plan()[1].schedule.candidates[1].verdict
      :find("^cannot: more than 128 experts a rank"))
    local p = layer:plan()[1]
    assert.are.equal("bitmap", p.schedule.kernel)
    assert.are.equal("sm90x2", p.experts.kernel) -- experts of a few rows: the row tiles
    assert.are.equal("sm90w", p.experts.candidates[1].name)
    assert.truthy(p.experts.candidates[1].verdict:find("^declines"), tostring(p.experts))
    moe.config { experts_kernel = "mma", schedule_kernel = "grid" }
    p = layer:plan()[1]
    assert.are.equal("mma", p.experts.kernel)
    assert.are.equal("grid", p.schedule.kernel)
    local x = moe.randn({ 8, 64, 128 }, { dtype = "bf16", seed = 3, device = "cuda:0" })
    layer:forward(x)
    layer:check(x)
  end)
end)
