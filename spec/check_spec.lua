-- moe.check: what counts as close, on plain values (the layer and stage specs rely on it).
describe("moe.check.close", function()
  local inf = math.huge

  it("passes within the tolerances and fails past them, naming the first mismatch", function()
    moe.check.close({ 1, 2, 3 }, { 1, 2, 3.01 })
    local ok, err = pcall(moe.check.close, { 1, 2, 3.5 }, { 1, 2, 3 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("at [2]: got 3.5, expected 3", 1, true), err)
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
  end)
end)
