-- SPDX-License-Identifier: MIT
-- A small JSON encoder for reports (scenarios' --json FILE): tables with only positive integer
-- keys 1..n become arrays (an empty table too), other tables objects with sorted keys (strings or
-- numbers; two that print alike, 1 and "1", are an error); numbers keep full precision, NaN and
-- the infinities become null; a string that is not UTF-8 has its bytes past 0x7f escaped as the
-- code points of the same value (as Latin-1), so that the output is always valid JSON.
-- And its decoder, for the tools that read reports back (scenarios/compare.lua): RFC 8259 JSON,
-- null as nil in an object and as json.null in an array (so that the elements keep their places).
-- Written for Lua 5.4 and LuaJIT alike.
local args = require "moelab.args"
local compat = require "moelab.compat"

local json = {}

-- The value an array's null decodes to.
json.null = setmetatable({}, { __tostring = function() return "null" end })

local floor = math.floor

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t', ['\r'] = '\\r' }

local function encode(v, out)
  local t = type(v)
  if t == "nil" or v == json.null then out[#out + 1] = "null"
  elseif t == "boolean" then out[#out + 1] = tostring(v)
  elseif t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then out[#out + 1] = "null"
    elseif compat.math_type(v) == "integer" then out[#out + 1] = compat.int_str(v)
    else out[#out + 1] = string.format("%.17g", v) end
  elseif t == "string" then
    local pattern = compat.utf8_valid(v) and '[%c"\\]' or '[%c"\\\128-\255]'
    out[#out + 1] = '"' .. v:gsub(pattern, function(c)
      return ESCAPES[c] or string.format("\\u%04x", c:byte())
    end) .. '"'
  elseif t == "table" then
    local n = #v
    local is_array = true
    for k in pairs(v) do
      if compat.math_type(k) ~= "integer" or k < 1 or k > n then is_array = false break end
    end
    if is_array then
      out[#out + 1] = "["
      for i = 1, n do
        if i > 1 then out[#out + 1] = "," end
        encode(v[i], out)
      end
      out[#out + 1] = "]"
    else
      local keys, seen = {}, {}
      for k in pairs(v) do
        local kt = type(k)
        if kt ~= "string" and kt ~= "number" then args.raise("json: a key of type " .. kt .. " (keys are strings or numbers)") end
        local s = tostring(k)
        if seen[s] then args.raise(string.format("json: keys %q and %s collide", s, s)) end
        seen[s] = true
        keys[#keys + 1] = s
      end
      table.sort(keys)
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = "," end
        encode(k, out)
        out[#out + 1] = ":"
        local val = v[k]
        if val == nil then val = v[tonumber(k)] end
        encode(val, out)
      end
      out[#out + 1] = "}"
    end
  else
    args.raise("json: cannot encode a " .. t)
  end
end

function json.encode(v)
  local out = {}
  encode(v, out)
  return table.concat(out)
end

-- ---------------------------------------------------------------- decoding

local MAX_DEPTH = 500 -- deeper nesting is refused rather than overflowing the C stack

-- The UTF-8 bytes of code point c.
local function utf8_char(c)
  if c < 0x80 then return string.char(c) end
  if c < 0x800 then return string.char(0xc0 + floor(c / 64), 0x80 + c % 64) end
  if c < 0x10000 then return string.char(0xe0 + floor(c / 4096), 0x80 + floor(c / 64) % 64, 0x80 + c % 64) end
  return string.char(0xf0 + floor(c / 262144), 0x80 + floor(c / 4096) % 64, 0x80 + floor(c / 64) % 64, 0x80 + c % 64)
end

local UNESCAPE = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

local function decoder(text)
  local pos = 1

  local function fail(what)
    args.raise(string.format("json: %s at byte %d", what, pos))
  end

  local function skip()
    pos = text:find("[^ \t\r\n]", pos) or #text + 1
  end

  local function literal(word, value)
    if text:sub(pos, pos + #word - 1) ~= word then fail("unexpected " .. string.format("%q", text:sub(pos, pos))) end
    pos = pos + #word
    return value
  end

  local function hex4()
    local h = text:match("^%x%x%x%x", pos)
    if not h then fail("a \\u escape needs four hex digits") end
    pos = pos + 4
    return tonumber(h, 16)
  end

  local function str()
    pos = pos + 1 -- the opening quote
    local parts = {}
    while true do
      local stop = text:find('["\\%c]', pos)
      if not stop then fail("an unterminated string") end
      parts[#parts + 1] = text:sub(pos, stop - 1)
      pos = stop
      local c = text:sub(pos, pos)
      if c == '"' then
        pos = pos + 1
        local s = table.concat(parts)
        if not compat.utf8_valid(s) then fail("a string that is not UTF-8") end
        return s
      elseif c == "\\" then
        local e = text:sub(pos + 1, pos + 1)
        pos = pos + 2
        if e == "u" then
          local u = hex4()
          if u >= 0xd800 and u <= 0xdbff and text:sub(pos, pos + 1) == "\\u" then -- a surrogate pair
            pos = pos + 2
            local lo = hex4()
            if lo < 0xdc00 or lo > 0xdfff then fail("a high surrogate without its low half") end
            u = 0x10000 + (u - 0xd800) * 1024 + (lo - 0xdc00)
          elseif u >= 0xd800 and u <= 0xdfff then
            fail("a lone surrogate")
          end
          parts[#parts + 1] = utf8_char(u)
        elseif UNESCAPE[e] then
          parts[#parts + 1] = UNESCAPE[e]
        else
          pos = pos - 1
          fail("an unknown escape \\" .. e)
        end
      else
        fail("a control character in a string")
      end
    end
  end

  local function number()
    local int = text:match("^-?%d+", pos)
    if not int or int:match("^-?0%d") then fail("a malformed number") end
    local s = int
    local frac = text:match("^%.%d+", pos + #s)
    if text:sub(pos + #s, pos + #s) == "." and not frac then fail("a malformed number") end
    s = s .. (frac or "")
    local exp = text:match("^[eE][-+]?%d+", pos + #s)
    if text:find("^[eE]", pos + #s) and not exp then fail("a malformed number") end
    s = s .. (exp or "")
    pos = pos + #s
    return tonumber(s)
  end

  local value

  local function array(depth)
    pos = pos + 1
    local list = {}
    skip()
    if text:sub(pos, pos) == "]" then
      pos = pos + 1
      return list
    end
    while true do
      local v = value(depth)
      list[#list + 1] = v == nil and json.null or v
      skip()
      local c = text:sub(pos, pos)
      pos = pos + 1
      if c == "]" then return list end
      if c ~= "," then
        pos = pos - 1
        fail("expected ',' or ']'")
      end
    end
  end

  local function object(depth)
    pos = pos + 1
    local obj = {}
    skip()
    if text:sub(pos, pos) == "}" then
      pos = pos + 1
      return obj
    end
    while true do
      skip()
      if text:sub(pos, pos) ~= '"' then fail("expected a key (a string)") end
      local key = str()
      skip()
      if text:sub(pos, pos) ~= ":" then fail("expected ':'") end
      pos = pos + 1
      obj[key] = value(depth)
      skip()
      local c = text:sub(pos, pos)
      pos = pos + 1
      if c == "}" then return obj end
      if c ~= "," then
        pos = pos - 1
        fail("expected ',' or '}'")
      end
    end
  end

  value = function(depth)
    if depth > MAX_DEPTH then fail("nesting deeper than " .. MAX_DEPTH) end
    skip()
    local c = text:sub(pos, pos)
    if c == "{" then return object(depth + 1) end
    if c == "[" then return array(depth + 1) end
    if c == '"' then return str() end
    if c == "t" then return literal("true", true) end
    if c == "f" then return literal("false", false) end
    if c == "n" then return literal("null", nil) end
    if c == "-" or c:match("%d") then return number() end
    if c == "" then fail("unexpected end of text") end
    fail("unexpected " .. string.format("%q", c))
  end

  return function()
    local v = value(0)
    skip()
    if pos <= #text then fail("text after the value") end
    return v
  end
end

-- text -> the value it holds; raises "json: <what is wrong> at byte N".
function json.decode(text)
  if type(text) ~= "string" then args.fail("json.decode", "expected a string, got " .. args.describe(text)) end
  return decoder(text)()
end

return json
