-- SPDX-License-Identifier: MIT
-- What Lua 5.4 and LuaJIT 2.1 spell differently, written in the subset both parse, so that one
-- set of front-end files runs on both.  Each name behaves as its Lua 5.4 original does on the
-- values the front-end gives it.
--
-- Numbers: LuaJIT has doubles only.  A double with an integer value (below 2^63 in magnitude)
-- counts as an integer there, which is the rule the front-end already applies to 5.4's floats
-- ("2.0 counts, as for every integer option"); only what 5.4 alone can tell apart -- the float
-- 2.0 printed as "2.0" -- reads differently.
local compat = {}

-- Whether the interpreter is LuaJIT (its `jit` library is loaded at startup).
compat.luajit = rawget(_G, "jit") ~= nil

compat.unpack = table.unpack or unpack

-- table.pack: the values and their count n.
function compat.pack(...) return { n = select("#", ...), ... } end

local floor = math.floor

-- math.type: "integer", "float", or nil for a value that is not a number.
compat.math_type = math.type or function(v)
  if type(v) ~= "number" then return nil end
  if v == floor(v) and v >= -2 ^ 63 and v < 2 ^ 63 then return "integer" end
  return "float"
end

-- math.tointeger of a number: the integer it equals, or nil.
compat.tointeger = math.tointeger or function(v)
  if compat.math_type(v) == "integer" then return v end
  return nil
end

-- The largest integer a number holds: 2^63 - 1 on 5.4, the largest double below 2^63 on LuaJIT.
compat.maxinteger = math.maxinteger or 2 ^ 63 - 1024

-- The length of a list, holes included: #t, or the largest positive integer key past it (the
-- border # finds in a list with holes differs between the interpreters, and with how the list
-- was built).
function compat.len(t)
  local n = #t
  for k in pairs(t) do
    if type(k) == "number" and k > n and k == floor(k) and k < math.huge then n = k end
  end
  return n
end

-- An integer as digits: tostring prints doubles of 15 digits and more with an exponent on LuaJIT.
function compat.int_str(v) return string.format("%d", v) end

-- The bits of x rounded to an f32 (round to nearest even, as a C cast), as an integer in
-- [0, 2^32), and back.
if string.pack then
  function compat.f32_bits(x) return (string.unpack("<I4", string.pack("<f", x))) end
  function compat.from_f32_bits(u) return (string.unpack("<f", string.pack("<I4", u))) end
else
  local ffi = require "ffi"
  local cell = ffi.new("union { float f; uint32_t u; }")
  function compat.f32_bits(x)
    cell.f = x
    return tonumber(cell.u)
  end
  function compat.from_f32_bits(u)
    cell.u = u
    return tonumber(cell.f)
  end
end

-- x rounded to the nearest f32.
function compat.f32(x) return compat.from_f32_bits(compat.f32_bits(x)) end

-- Runs a shell command line; returns what it wrote on stdout and its exit status as the shell
-- gives it ($?: 128 + n after signal n).  LuaJIT's pipe close does not report the status.
function compat.run(command)
  -- a subshell, so that an exit in command ends it alone; the status after a newline of its own,
  -- so that output ending in digits stays apart from it
  local p = assert(io.popen("(" .. command .. "\n); printf '\\n%d' \"$?\""))
  local text = p:read("*a")
  p:close()
  local out, status = text:match("^(.*)\n(%d+)$")
  return out or text, tonumber(status)
end

-- Whether s is UTF-8 as Lua 5.4's utf8.len accepts it (strict: no overlong forms, no
-- surrogates, nothing past U+10FFFF).  Plain Lua on both, so that both read a string alike.
function compat.utf8_valid(s)
  local i, n, byte = 1, #s, string.byte
  while i <= n do
    local c = byte(s, i)
    local len, lo, hi = 1, 0x80, 0xBF -- the bounds of the second byte, which rule out the bad forms
    if c < 0x80 then len = 0
    elseif c >= 0xC2 and c <= 0xDF then len = 1
    elseif c == 0xE0 then len, lo = 2, 0xA0
    elseif c >= 0xE1 and c <= 0xEC or c == 0xEE or c == 0xEF then len = 2
    elseif c == 0xED then len, hi = 2, 0x9F
    elseif c == 0xF0 then len, lo = 3, 0x90
    elseif c >= 0xF1 and c <= 0xF3 then len = 3
    elseif c == 0xF4 then len, hi = 3, 0x8F
    else return false end
    for j = 1, len do
      local d = byte(s, i + j)
      if not d or d < (j == 1 and lo or 0x80) or d > (j == 1 and hi or 0xBF) then return false end
    end
    i = i + len + 1
  end
  return true
end

return compat
