-- SPDX-License-Identifier: MIT
-- A small JSON encoder for reports (scenarios' --json FILE): tables with only positive integer
-- keys 1..n become arrays (an empty table too), other tables objects with sorted keys (strings or
-- numbers; two that print alike, 1 and "1", are an error); numbers keep full precision, NaN and
-- the infinities become null; a string that is not UTF-8 has its bytes past 0x7f escaped as the
-- code points of the same value (as Latin-1), so that the output is always valid JSON.
local args = require "moelab.args"
local compat = require "moelab.compat"

local json = {}

local function encode(v, out)
  local t = type(v)
  if t == "nil" then out[#out + 1] = "null"
  elseif t == "boolean" then out[#out + 1] = tostring(v)
  elseif t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then out[#out + 1] = "null"
    elseif compat.math_type(v) == "integer" then out[#out + 1] = compat.int_str(v)
    else out[#out + 1] = string.format("%.17g", v) end
  elseif t == "string" then
    local pattern = compat.utf8_valid(v) and '[%c"\\]' or '[%c"\\\128-\255]'
    out[#out + 1] = '"' .. v:gsub(pattern, function(c)
      local map = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t', ['\r'] = '\\r' }
      return map[c] or string.format("\\u%04x", c:byte())
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

return json
