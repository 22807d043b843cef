-- SPDX-License-Identifier: MIT
-- moelab.json, the scenarios' --json encoder: what it writes must be JSON whatever the report holds.
describe("moelab.json [#cpu]", function()
  local json = require "moelab.json"

  it("writes arrays, objects with sorted keys, full-precision numbers, and null for NaN and infinities", function()
    assert.are.equal('[1,2,3]', json.encode { 1, 2, 3 })
    assert.are.equal('{"a":1,"b":[true,false],"c":"x"}', json.encode { c = "x", a = 1, b = { true, false } })
    assert.are.equal('0.10000000000000001', json.encode(0.1))
    assert.are.equal('[null,null,null,7]', json.encode { 0 / 0, math.huge, -math.huge, 7 })
    assert.are.equal('{"1":"a","3":"b"}', json.encode { [1] = "a", [3] = "b" }) -- a hole: not an array
  end)

  it("escapes quotes, backslashes and control characters", function()
    assert.are.equal([["a\"b\\c\nd\te\u0001"]], json.encode('a"b\\c\nd\te\1'))
  end)

  it("keeps UTF-8 as it is and escapes the bytes of a string that is not UTF-8", function()
    assert.are.equal('"\u{e9}t\u{e9}"', json.encode("\u{e9}t\u{e9}"))
    local out = json.encode("bad \255\254 bytes")
    assert.are.equal([["bad \u00ff\u00fe bytes"]], out)
    assert.is_true(require("moelab.compat").utf8_valid(out), "the output is not UTF-8")
  end)

  it("refuses keys JSON cannot hold or that collide, naming them", function()
    local ok, err = pcall(json.encode, { [true] = 1 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a key of type boolean", 1, true), tostring(err))
    ok, err = pcall(json.encode, { [1] = "a", ["1"] = "b", x = 0 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('keys "1" and 1 collide', 1, true), tostring(err))
  end)
end)
