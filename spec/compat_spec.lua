-- SPDX-License-Identifier: MIT
-- moelab.compat: each name behaves as its Lua 5.4 original on the values the front-end gives it,
-- on whichever interpreter runs the suite.
local compat = require "moelab.compat"

describe("moelab.compat [#cpu]", function()
  it("math_type and tointeger: integral numbers are integers, the rest floats, a non-number neither", function()
    local rows = { { 3, "integer", 3 }, { -7, "integer", -7 }, { 2.5, "float", nil }, { 1 / 0, "float", nil },
      { 0 / 0, "float", nil }, { "3", nil, nil }, { {}, nil, nil } }
    for _, row in ipairs(rows) do
      assert.are.equal(row[2], compat.math_type(row[1]), tostring(row[1]))
      if type(row[1]) == "number" then assert.are.equal(row[3], compat.tointeger(row[1]), tostring(row[1])) end
    end
    assert.are.equal(2 ^ 31, compat.tointeger(2 ^ 31)) -- a float with an integer value counts (5.4's 2.0 rule)
    assert.are.equal("9007199254740992", compat.int_str(2 ^ 53))
    assert.are.equal("-2147483648", compat.int_str(-2 ^ 31))
  end)

  it("len sees a hole however the list was made", function()
    local grown = { 2 }
    grown[3] = 3
    local rows = { { {}, 0 }, { { 2, 3 }, 2 }, { { 2, nil, 3 }, 3 }, { grown, 3 }, { { 1, x = 1, [2.5] = 1 }, 1 },
      { { [10] = 1 }, 10 }, { { [1 / 0] = 1 }, 0 } }
    for i, row in ipairs(rows) do assert.are.equal(row[2], compat.len(row[1]), "row " .. i) end
  end)

  it("pack and unpack keep nils and the count", function()
    local p = compat.pack(1, nil, 3, nil)
    assert.are.equal(4, p.n)
    assert.are.same({ 1, nil, 3, nil }, { compat.unpack(p, 1, p.n) })
  end)

  it("f32 bits: rounding to nearest even, signed zero, infinities, NaN", function()
    assert.are.equal(0x3f800000, compat.f32_bits(1))
    assert.are.equal(0x80000000, compat.f32_bits(-0.0))
    assert.are.equal(0x7f800000, compat.f32_bits(1 / 0))
    assert.are.equal(0x3f800000, compat.f32_bits(1 + 2 ^ -24)) -- a tie: to even
    assert.are.equal(0x3f800001, compat.f32_bits(1 + 2 ^ -24 + 2 ^ -40))
    assert.are.equal(1 / 0, compat.from_f32_bits(0x7f800000))
    local nan = compat.from_f32_bits(0x7fc00000)
    assert.is_true(nan ~= nan)
    assert.are.equal(0.100000001490116119384765625, compat.f32(0.1))
  end)

  it("run gives a command's output and exit status", function()
    local rows = { { "echo hi", "hi\n", 0 }, { "printf 'a\\nb'; exit 3", "a\nb", 3 }, { "printf 12; exit 4", "12", 4 },
      { "(sh -c 'kill -9 $$') 2>/dev/null", "", 137 } } -- (the shell's "Killed" kept off the terminal)
    for _, row in ipairs(rows) do
      local out, status = compat.run(row[1])
      assert.are.equal(row[2], out, row[1])
      assert.are.equal(row[3], status, row[1])
    end
  end)

  -- UTF-8 as 5.4's utf8.len (strict) accepts it
  local UTF8 = {
    { "", true }, { "plain", true }, { "\0", true }, { "\195\169t\195\169", true }, { "\226\130\172", true },
    { "\240\159\152\128", true }, { "\244\143\191\191", true }, { "\239\191\191", true },
    { "\192\128", false }, { "\193\191", false }, { "\224\128\128", false }, { "\224\159\191", false },
    { "\237\160\128", false }, { "\237\191\191", false }, { "\240\143\191\191", false }, { "\244\144\128\128", false },
    { "\245\128\128\128", false }, { "\255", false }, { "\128", false }, { "\195", false }, { "a\226\130", false },
    { "\195\169\169", false }, { "\248\136\128\128\128", false },
  }

  it("utf8_valid: well-formed sequences, and the overlong, surrogate, too large and cut ones refused", function()
    for _, row in ipairs(UTF8) do
      assert.are.equal(row[2], compat.utf8_valid(row[1]), string.format("%q", row[1]))
    end
  end)

  it("utf8_valid agrees with Lua 5.4's utf8.len on random byte strings", function()
    if not rawget(_G, "utf8") then
      pending("LuaJIT has no utf8 library to compare with: the fixed cases above run on both")
      return
    end
    for _, row in ipairs(UTF8) do assert.are.equal(utf8.len(row[1]) ~= nil, row[2], string.format("%q", row[1])) end
    math.randomseed(11)
    local pools = { { 0, 255 }, { 0x80, 0xBF }, { 0xC0, 0xF7 } }
    for _ = 1, 20000 do
      local bytes = {}
      for i = 1, math.random(1, 6) do
        local pool = pools[math.random(1, 3)]
        bytes[i] = string.char(math.random(pool[1], pool[2]))
      end
      local s = table.concat(bytes)
      assert.are.equal(utf8.len(s) ~= nil, compat.utf8_valid(s), string.format("%q", s))
    end
  end)
end)
