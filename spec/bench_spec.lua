-- SPDX-License-Identifier: MIT
-- moe.bench, the timing helper of the scenarios and of users' scripts.
local unpack_ = require("moelab.compat").unpack
describe("moe.bench [#cpu]", function()
  it("runs warmup then iters calls and summarises the iters times", function()
    local calls = 0
    local r = moe.bench(function() calls = calls + 1 end, { warmup = 2, iters = 7, device = "cpu" })
    assert.are.equal(9, calls)
    assert.are.equal(7, r.iters)
    assert.are.equal(7, #r.times_ms)
    local sorted, sum = { unpack_(r.times_ms) }, 0
    table.sort(sorted)
    for _, t in ipairs(sorted) do sum = sum + t end
    assert.are.equal(sorted[4], r.median_ms)
    assert.are.equal(sorted[1], r.min_ms)
    assert.are.equal(sorted[7], r.max_ms)
    assert.near(sum / 7, r.mean_ms, 1e-12)
  end)

  it("the median of an even count is the mean of the middle two", function()
    local r = moe.bench(function() end, { warmup = 0, iters = 4, device = "cpu" })
    local sorted = { unpack_(r.times_ms) }
    table.sort(sorted)
    assert.are.equal((sorted[2] + sorted[3]) / 2, r.median_ms)
  end)

  it("takes more iterations than a Lua call can return values (table.unpack's limit, ~10^6)", function()
    local r = moe.bench(function() end, { warmup = 0, iters = 1100000, device = "cpu" })
    assert.are.equal(1100000, #r.times_ms)
    assert.is_true(r.min_ms <= r.median_ms and r.median_ms <= r.max_ms)
  end)

  it("refuses what it cannot time, naming it", function()
    local ok, err = pcall(moe.bench, 42)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("expected a function to time, got 42", 1, true), tostring(err))
    ok, err = pcall(moe.bench, function() end, { iters = 0 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("option 'iters' must be >= 1, got 0", 1, true), tostring(err))
    ok, err = pcall(moe.bench, function() end, { iter = 3 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("unknown option 'iter'", 1, true), tostring(err))
  end)
end)
