-- SPDX-License-Identifier: MIT
-- moe.check: what counts as close, on plain values (the layer and stage specs rely on it).
describe("moe.check.close", function()
  local inf = math.huge

  it("passes within the tolerances and fails past them, naming the first mismatch", function()
    moe.check.close({ 1, 2, 3 }, { 1, 2, 3.01 })
    local ok, err = pcall(moe.check.close, { 1, 2, 3.5 }, { 1, 2, 3 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("at [2]: got 3.5, expected 3", 1, true), err)
  end)

  it("refuses what is not a tensor or a flat table of numbers, at the caller's line", function()
    local closed
    do
      local t = moe.zeros({ 2 })
      closed = t
      t:close()
    end
    local cases = {
      { function() moe.check.close({ "a" }, { 1 }) end, "check: got[1] must be a number (a flat table of numbers), got \"a\"" },
      { function() moe.check.close({ { 1 } }, { { 1 } }) end, "check: got[1] must be a number" },
      { function() moe.check.metrics({ 1 }, { true }) end, "check: ref[1] must be a number" },
      { function() moe.check.close(nil, { 1 }) end, "check: got must be a moelab.Tensor or a flat table of numbers, got nil" },
      { function() moe.check.equal(closed, { 0, 0 }) end, "check: a is a closed moelab.Tensor" },
      { function() moe.check.metrics(closed, { 0, 0 }) end, "check: got is a closed moelab.Tensor" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[2], 1, true), tostring(err))
      assert.truthy(tostring(err):find("^[^\n]-check_spec%.lua:%d+: "), "not placed at the caller: " .. tostring(err))
    end
  end)

  it("a NaN on either side fails", function()
    assert.is_false(pcall(moe.check.close, { 1, 0 / 0 }, { 1, 2 }))
    assert.is_false(pcall(moe.check.close, { 1, 2 }, { 1, 0 / 0 }))
  end)

  it("equal infinities match, and an infinity in ref does not make every error small", function()
    local m = moe.check.close({ inf, -inf, 1 }, { inf, -inf, 1 })
    assert.are.equal(0, m.infs)
    assert.are.equal(0, m.max_abs)
    local ok, err = pcall(moe.check.close, { inf, 1 }, { 1, 1 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("1 infinities unmatched", 1, true), err)
    assert.is_false(pcall(moe.check.close, { -inf, 1 }, { inf, 1 }))
    ok, err = pcall(moe.check.close, { inf, 5 }, { inf, 1 })
    assert.is_false(ok, "an infinity in ref hid an error of 4 in 1")
    assert.truthy(tostring(err):find("at [1]: got 5, expected 1", 1, true), err)
  end)

  it("verdict reports .pass the same way", function()
    assert.is_true(moe.check.verdict({ inf, 1 }, { inf, 1 }, { raise = false }).pass)
    assert.is_false(moe.check.verdict({ inf, 1 }, { 1, 1 }, { raise = false }).pass)
    -- against an all-zero reference any error is too large, as check.close has it
    assert.is_false(pcall(moe.check.close, { 1e-3 }, { 0 }))
    assert.is_false(moe.check.verdict({ 1e-3 }, { 0 }, { raise = false }).pass)
    assert.is_true(moe.check.verdict({ 0 }, { 0 }, { raise = false }).pass)
  end)
end)
