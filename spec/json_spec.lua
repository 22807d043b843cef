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

describe("moelab.json.decode [#cpu]", function()
  local json = require "moelab.json"

  it("reads back what encode writes", function()
    local v = { a = 1, b = { true, false, "x" }, c = { d = 0.1, e = -2.5e-7, f = {} }, g = "q\"\\\n\t\1é" }
    assert.are.same(v, json.decode(json.encode(v)))
    assert.are.equal(9007199254740993, json.decode("9007199254740993")) -- an integer past 2^53, exact in 5.4
  end)

  it("reads JSON's own forms: escapes, surrogate pairs, exponents, whitespace, nulls", function()
    assert.are.equal("A/é😀", json.decode([["\u0041\/\u00e9\ud83d\ude00"]]))
    assert.are.equal(1.5e3, json.decode(" 1.5E+3 "))
    assert.are.equal(-0.25, json.decode("-0.25"))
    assert.are.same({ a = 1 }, json.decode('{"a": 1, "b": null}')) -- null: absent in an object
    local list = json.decode("[1, null, 3]")
    assert.are.equal(3, #list)
    assert.are.equal(json.null, list[2]) -- null keeps its place in an array
    assert.are.equal("[1,null,3]", json.encode(list))
    assert.are.same({}, json.decode("[]"))
    assert.are.same({}, json.decode(" {} "))
  end)

  for _, row in ipairs {
    { "empty text", "", "unexpected end of text at byte 1" },
    { "text after the value", "1 2", "text after the value at byte 3" },
    { "a trailing comma", "[1,]", "unexpected \"]\" at byte 4" },
    { "a key that is not a string", "{1: 2}", "expected a key (a string) at byte 2" },
    { "a missing colon", '{"a" 1}', "expected ':' at byte 6" },
    { "an unterminated string", '"abc', "an unterminated string at byte 2" },
    { "a raw newline in a string", '"a\nb"', "a control character in a string at byte 3" },
    { "an unknown escape", [["\x"]], "an unknown escape \\x at byte 3" },
    { "a short \\u escape", [["\u12"]], "a \\u escape needs four hex digits at byte 4" },
    { "a lone surrogate", [["\udc00"]], "a lone surrogate" },
    { "bytes that are not UTF-8", '"\255"', "a string that is not UTF-8" },
    { "a leading zero", "012", "a malformed number at byte 1" },
    { "a bare fraction point", "1.", "a malformed number at byte 1" },
    { "an exponent without digits", "1e", "a malformed number at byte 1" },
    { "NaN", "NaN", "unexpected \"N\" at byte 1" },
    { "a misspelt literal", "nul", "unexpected \"n\" at byte 1" },
    { "nesting too deep", string.rep("[", 600) .. string.rep("]", 600), "nesting deeper than 500" },
    { "not a string", 42, "bad argument #1 to 'json.decode' (expected a string, got 42)" },
  } do
    it("refuses " .. row[1], function()
      local ok, err = pcall(json.decode, row[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end
end)
