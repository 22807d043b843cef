-- SPDX-License-Identifier: MIT
-- The experts stage's kernel choice as the binding shows it: the context's experts_kernel option
-- (moe.core.config) and moe.core.experts_explain, which names the kernel a call would run and
-- why.  CPU only: the GPU side of the choice is checked by spec/gpu/test_experts_gpu.c.

-- The tensors of a small experts call on the CPU: EL experts of `rows` rows each.
local function experts_args(EL, rows, H, F)
  local C = EL * rows
  local offsets = {}
  for e = 0, EL do offsets[e + 1] = e * rows end
  return {
    out = moe.full({ C, H }, 0, { dtype = "bf16" }),
    x = moe.full({ C, H }, 0.5, { dtype = "bf16" }),
    offsets = moe.tensor(offsets, { dtype = "i32", shape = { EL + 1 } }),
    w_gate_up = moe.full({ EL, 2 * F, H }, 0.25, { dtype = "bf16" }),
    w_down = moe.full({ EL, H, F }, 0.25, { dtype = "bf16" }),
  }
end

-- Does this build have the CUDA kernels?  (A build without CUDA takes no kernel name.)
local function cuda_build()
  local ok = pcall(moe.core.config, "experts_kernel", "mma")
  moe.core.config("experts_kernel", "auto")
  return ok
end

describe("experts kernel choice [#cpu]", function()
  after_each(function() moe.core.config("experts_kernel", "auto") end)

  it("the experts_kernel option is auto unless set", function()
    assert.are.equal("auto", moe.core.config("experts_kernel"))
  end)

  it("an unknown kernel name is refused, with the valid names", function()
    local ok, err = pcall(moe.core.config, "experts_kernel", "sm90")
    assert.is_false(ok)
    err = tostring(err)
    if cuda_build() then
      assert.truthy(err:find("sm90w, sm90x2, sm90x1, mma", 1, true), err)
    else
      assert.truthy(err:find("no GPU kernels", 1, true), err)
    end
    assert.are.equal("auto", moe.core.config("experts_kernel"))
  end)

  it("a listed name is kept, and auto restores the automatic choice", function()
    if not cuda_build() then return end
    for _, name in ipairs { "sm90w", "sm90x2", "sm90x1", "mma" } do
      assert.are.equal(name, moe.core.config("experts_kernel", name))
    end
    assert.are.equal("auto", moe.core.config("experts_kernel", "auto"))
  end)

  it("explain of CPU tensors names the CPU backend", function()
    local report = moe.core.experts_explain(experts_args(2, 3, 8, 4))
    assert.are.equal("cpu", report:match("^[^\n]*"))
    assert.truthy(report:find("cpu: runs", 1, true), report)
  end)

  it("explain checks its arguments as the call does", function()
    local a = experts_args(2, 3, 8, 4)
    a.w_down = nil
    local ok, err = pcall(moe.core.experts_explain, a)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("w_down", 1, true), tostring(err))
    assert.has_error(function() moe.core.experts_explain(7) end)
  end)
end)
