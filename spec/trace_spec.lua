-- SPDX-License-Identifier: MIT
-- layer:trace(), the stages of a traced forward as spans per rank, and moelab.trace, those spans
-- as a Chrome trace (what kimi.lua --trace writes and ui.perfetto.dev opens).
local json = require "moelab.json"
local trace = require "moelab.trace"

local STAGES = { "route", "schedule", "dispatch", "experts", "shared", "combine" }
local EPS = 1e-6 -- ms: event readings are floats

-- A traced forward of a simulated world of W ranks (shared: with a shared expert) -> its spans.
local function traced(W, shared)
  local layer = moe.layer { model = moe.models.kimi_k2, world = W, tokens = 6, hidden = 32, ffn = 16,
    shared_ffn = shared and 16 or 0 }
  layer:forward(moe.randn({ W, 6, 32 }, { dtype = "bf16", seed = 3 }), { trace = true })
  return layer:trace(), layer
end

describe("layer:trace() [#cpu]", function()
  it("has one span per stage and rank, in the order the stages ran, ranks ascending", function()
    local W = 4
    local spans = traced(W, true)
    assert.are.equal(#STAGES * W, #spans)
    for k, s in ipairs(spans) do
      local stage, rank = STAGES[math.floor((k - 1) / W) + 1], (k - 1) % W
      assert.are.same({ stage, rank, "cpu" }, { s.stage, s.rank, s.device })
      assert.is_true(s.start_ms >= 0 and s.dur_ms >= 0, s.stage)
    end
  end)

  it("one call for every rank (route, shared) spans the same time on each; the others follow each other",
    function()
    local W = 3
    local spans = traced(W, true)
    local by = {}
    for _, s in ipairs(spans) do
      by[s.stage] = by[s.stage] or {}
      by[s.stage][s.rank + 1] = s
    end
    for _, stage in ipairs { "route", "shared" } do
      for r = 2, W do
        assert.are.same({ by[stage][1].start_ms, by[stage][1].dur_ms, true },
          { by[stage][r].start_ms, by[stage][r].dur_ms, by[stage][r].all_ranks })
      end
    end
    for _, stage in ipairs { "schedule", "dispatch", "experts", "combine" } do
      for r = 1, W do
        assert.is_false(by[stage][r].all_ranks)
        if r > 1 then -- rank r - 1's share ends where rank r's begins: the simulated ranks take turns
          local prev = by[stage][r - 1]
          assert.is_true(math.abs(prev.start_ms + prev.dur_ms - by[stage][r].start_ms) < EPS, stage)
        end
      end
    end
    -- and the stages follow each other: each begins after the last one ended
    local last_end = 0
    for _, stage in ipairs(STAGES) do
      local first, final = by[stage][1], by[stage][W]
      assert.is_true(first.start_ms >= last_end - EPS, stage)
      last_end = final.start_ms + final.dur_ms
    end
  end)

  it("the ranks' shares add up to no more than the stage's time", function()
    local spans, layer = traced(4, false)
    local t, sum = layer:stage_times(), {}
    for _, s in ipairs(spans) do
      if not s.all_ranks then sum[s.stage] = (sum[s.stage] or 0) + s.dur_ms end
    end
    for stage, ms in pairs(sum) do assert.is_true(ms <= t[stage] + EPS, stage) end
    assert.is_nil(sum.shared) -- no shared expert, no span
  end)

  for _, row in ipairs {
    { "before any forward", function(l) l:trace() end, "the last forward was not traced" },
    { "after a forward that was not traced", function(l, x)
      l:forward(x, { trace = true })
      l:forward(x)
      l:trace()
    end, "the last forward was not traced" },
    { "trace with check = false", function(l, x) l:forward(x, { trace = true, check = false }) end,
      "trace = true times the pass, and check = false passes are not timed" },
    { "trace not a boolean", function(l, x) l:forward(x, { trace = 1 }) end,
      "option 'trace' must be a boolean, got 1" },
  } do
    it("refuses " .. row[1], function()
      local layer = moe.layer { model = moe.models.kimi_k2, world = 2, tokens = 4, hidden = 32, ffn = 16 }
      local ok, err = pcall(row[2], layer, moe.randn({ 2, 4, 32 }, { dtype = "bf16" }))
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end
end)

describe("moelab.trace.chrome [#cpu]", function()
  it("writes a process per rank, a lane per stage and a complete event per span, in microseconds", function()
    local W = 2
    local spans = traced(W, true)
    local doc = json.decode(trace.chrome(spans, { metadata = { moelab = moe.version } }))
    assert.are.equal("ms", doc.displayTimeUnit)
    assert.are.same({ moelab = moe.version }, doc.otherData)
    local complete, names, lanes = {}, {}, {}
    for _, e in ipairs(doc.traceEvents) do
      if e.ph == "X" then complete[#complete + 1] = e
      elseif e.ph == "M" and e.name == "process_name" then names[e.pid] = e.args.name
      elseif e.ph == "M" and e.name == "thread_name" then lanes[e.pid .. "/" .. e.tid] = e.args.name end
    end
    assert.are.equal(#spans, #complete)
    for k, e in ipairs(complete) do
      local s = spans[k]
      assert.are.same({ s.stage, s.rank, "stage" }, { e.name, e.pid, e.cat })
      assert.are.equal(s.stage, lanes[e.pid .. "/" .. e.tid]) -- the lane is named after its stage
      assert.is_true(math.abs(e.ts - s.start_ms * 1e3) < 1e-3 and math.abs(e.dur - s.dur_ms * 1e3) < 1e-3)
    end
    for r = 0, W - 1 do assert.are.equal("rank " .. r .. " on cpu", names[r]) end
  end)

  it("writes a valid trace of nothing", function()
    assert.are.same({ traceEvents = {}, displayTimeUnit = "ms" }, json.decode(trace.chrome({})))
  end)
end)
