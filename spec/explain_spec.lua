-- SPDX-License-Identifier: MIT
-- Kernel choice through the context: the schedule_kernel option (moe_ctx_config) and
-- core.schedule_explain, which reports the choice without running anything.  Runs on a CPU: a
-- build with CUDA but no GPU still validates the option against the kernels it was built with.
local core = moe.core

-- The fields of core.schedule for a plan's buffers.
local function fields(s)
  return { peer_rank = s.peer_rank, peer_route = s.peer_route, counts = s.counts,
    tokens_per_expert = s.tokens_per_expert, expert_offsets = s.expert_offsets, route_row = s.route_row,
    stats = s.stats_tensor, ids = s.ids, experts = s.experts, rank = s.rank, pad = s.pad, capacity = s.capacity,
    expert_capacity = s.expert_capacity, layout = s.layout }
end

local function cpu_plan()
  local ids = core.from_table({ 0, 1, 2, 3, 1, 2, 3, 0, -1, 2, 0, 1 }, "i32", "cpu", { 2, 3, 2 })
  return moe.schedule_plan { ids = ids, experts = 4 }
end

describe("schedule_kernel option and core.schedule_explain [#cpu]", function()
  after_each(function() core.config("schedule_kernel", "auto") end)

  it("the option is auto unless set", function()
    assert.are.equal("auto", core.config("schedule_kernel"))
  end)

  it("an unknown kernel name is refused with the names this build has", function()
    local ok, err = pcall(core.config, "schedule_kernel", "fast")
    assert.is_false(ok)
    err = tostring(err)
    if err:find("this build has no GPU kernels", 1, true) then return end -- a build without CUDA: only auto
    assert.truthy(err:find("schedule_kernel must be auto or one of bitmap, grid, got \"fast\"", 1, true), err)
    assert.are.equal("auto", core.config("schedule_kernel"))
  end)

  it("a CPU schedule's explain names the CPU backend, whatever the option", function()
    local s = cpu_plan()
    local report = core.schedule_explain(fields(s))
    assert.are.equal("cpu\n", report:match("^[^\n]*\n"), report)
    assert.truthy(report:find("cpu: runs", 1, true), report)
    if not pcall(core.config, "schedule_kernel", "grid") then return end -- no GPU kernels in this build
    assert.are.equal(report, core.schedule_explain(fields(s)))
  end)

  it("explain checks its arguments as schedule does, and runs nothing", function()
    local s = cpu_plan()
    s.stats_tensor:fill(-5)
    core.schedule_explain(fields(s))
    assert.are.same({ -5, -5, -5, -5, -5 }, s.stats_tensor:flat())
    local f = fields(s)
    f.rank = 2
    local ok, err = pcall(core.schedule_explain, f)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("rank must be between 0 and 1", 1, true), tostring(err))
  end)
end)
