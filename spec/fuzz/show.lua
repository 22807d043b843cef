-- SPDX-License-Identifier: MIT
-- Values written back as Lua source for the fuzzer's call log, so that a failing sequence reads
-- as the script that would replay it: objects of the sequence by their names (t3, s1, layer2),
-- tables as constructors, NaN and infinities as expressions.
local show

local function number(v)
  if v ~= v then return "0/0" end
  if v == math.huge then return "math.huge" end
  if v == -math.huge then return "-math.huge" end
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%.0f", v) end
  return string.format("%.17g", v)
end

local function key(k, names)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return k end
  return "[" .. show(k, names, 3) .. "]"
end

local function constructor(t, names, depth)
  if depth > 3 then return "{...}" end
  local parts, n = {}, #t
  for i = 1, math.min(n, 24) do parts[#parts + 1] = show(rawget(t, i), names, depth + 1) end
  if n > 24 then parts[#parts + 1] = string.format("--[[ %d more ]]", n - 24) end
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do parts[#parts + 1] = key(k, names) .. " = " .. show(rawget(t, k), names, depth + 1) end
  return "{ " .. table.concat(parts, ", ") .. " }"
end

-- v as source; names maps the sequence's objects to their names.
function show(v, names, depth)
  depth = depth or 1
  if names and names[v] then return names[v] end
  local ty = type(v)
  if ty == "number" then return number(v) end
  if ty == "string" then return #v > 60 and string.format("%q --[[ %d bytes ]]", v:sub(1, 40), #v) or string.format("%q", v) end
  if ty == "table" then
    local mt = getmetatable(v)
    local body = constructor(v, names, depth)
    if mt == nil then return body end
    -- a class of the module by its name (the metatable of a Schedule, a World, ...)
    local class = type(mt) == "table" and type(rawget(mt, "__name")) == "string" and rawget(mt, "__index") == mt
    return "setmetatable(" .. body .. ", " .. (class and ("--[[ " .. mt.__name .. " ]] {...}")
      or type(mt) == "table" and constructor(mt, names, depth + 1) or show(mt)) .. ")"
  end
  if ty == "function" then return "function() end" end
  return tostring(v)
end

-- A list of values as an argument list: "a, b, c" (n: how many, holes included).
local function arglist(list, n, names)
  local parts = {}
  for i = 1, n or #list do parts[i] = show(list[i], names) end
  return table.concat(parts, ", ")
end

return { value = show, args = arglist }
