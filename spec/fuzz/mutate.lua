-- SPDX-License-Identifier: MIT
-- Wrong arguments: a catalogue of values by the kind they are not, and the mutations the
-- fuzzer applies to a valid call's options.  Each mutation says whether the call must now be
-- refused (bad = why) or may go either way (bad = nil: then whatever it returns is checked).
--
-- Kinds of option: "int", "num", "bool", "str" (one of the strings in choices), "string" (any), "table",
-- "fn", "device", "tensor" (dtype = the one it must have, if any), "any" (checked by
-- the function itself).  An option may carry ok = function(v, opts) -> whether v is a valid
-- value; then the edge values it refuses make the call bad.
local moe = require "moelab"
local compat = require "moelab.compat"

local M = {}

local unpack = table.unpack or unpack -- luacheck: ignore (LuaJIT)
M.unpack = unpack

-- An error the fuzzer raises from inside a callback or a metamethod: it must come back as is.
M.TRAP = "fuzz trap: raised by the caller's own code"
local function trap() error(M.TRAP, 0) end
M.trap = trap

-- A table that passes for a tensor by its metatable's name, and nothing else.
local function fake_tensor()
  return setmetatable({ shape = { 2 }, dtype = "f32", device = "cpu", closed = false },
    { __name = "moelab.Tensor" })
end

-- A table whose every read raises the fuzzer's own error.
local function trapping_table() return setmetatable({}, { __index = trap }) end

-- Values of every type, by name; F supplies the tensors (a closed one, one of each dtype).
local function catalogue(F)
  return {
    { "nil", nil }, { "true", true }, { "false", false }, { "0", 0 }, { "-1", -1 }, { "1.5", 1.5 },
    { "NaN", 0 / 0 }, { "inf", math.huge }, { "-inf", -math.huge }, { "huge", 2 ^ 63 },
    { "empty string", "" }, { "string", "x" }, { "numeric string", "2" }, { "table", {} }, { "list", { 1, 2 } },
    { "function", function() return 1 end }, { "fake tensor", fake_tensor() }, { "trap table", trapping_table() },
    { "f32 tensor", F:any_tensor("f32") }, { "bf16 tensor", F:any_tensor("bf16") },
    { "i32 tensor", F:any_tensor("i32") }, { "closed tensor", F:closed_tensor() },
  }
end

local function is_int(v) return type(v) == "number" and v == math.floor(v) and v == v and math.abs(v) < 2 ^ 63 end
M.is_int = is_int

-- A tensor of either binding (userdata of the C module, cdata of the FFI one under LuaJIT).
local function is_real_tensor(v) return moe.core.is_tensor(v) end
M.is_tensor = is_real_tensor

-- Whether v is of the option's kind (its type, not its range).
function M.fits(opt, v)
  local k = opt.kind
  if v == nil then return true end
  if k == "any" then return true end
  -- an integer as the interpreter has one (LuaJIT: any whole number below 2^63), or a float
  -- that is a whole number an integer holds exactly (2.0)
  if k == "int" then
    return compat.math_type(v) == "integer" or (is_int(v) and math.abs(v) < 2 ^ 53)
  end
  if k == "num" then return type(v) == "number" end
  if k == "bool" then return type(v) == "boolean" end
  if k == "fn" then return type(v) == "function" end
  if k == "table" then return type(v) == "table" end
  if k == "str" then
    for _, c in ipairs(opt.choices) do if v == c then return true end end
    return false
  end
  if k == "device" or k == "string" then return type(v) == "string" end
  if k == "tensor" then
    return is_real_tensor(v) and not v.closed and (opt.dtype == nil or v.dtype == opt.dtype)
  end
  return true
end

-- Edge values of the option's own kind: the boundaries where checks tend to be wrong.  No
-- integer edge is a size the library could allocate and then fill (2^24 .. 2^31 - 1 rows would
-- be legal and take gigabytes): each is small, or refused as an i32 or by the 2^40 elements of a
-- tensor.
local EDGES = {
  int = { 0, -1, 1, 2, 3, 7, 2 ^ 31, -2 ^ 31, -2 ^ 31 - 1, 2 ^ 41, 2 ^ 53, -2 ^ 53, 2.0 },
  num = { 0, -0.0, -1, 1, 0.5, 1e-300, 1e-45, 3.5e38, 1e300, math.huge, -math.huge, 0 / 0 },
  str = { "", "nope", " ", "auto", "ERROR" },
  device = { "gpu", "CPU", "cuda:-1", "cuda:1000001", "cuda:0x1", "cpu ", "cuda:" },
}

-- The option's name with a typo, or a key of another type.
local function unknown_key(F, name)
  return F.rng:pick { name .. "s", name:upper(), "_" .. name, name:sub(1, -2), 1, true, "" }
end

-- A shallow copy of a table (its metatable dropped).
function M.copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

-- One wrong value for an option: (value, name, bad) where bad says why the call must fail.
function M.wrong_value(F, opt, opts)
  local r = F.rng:int(1, 10)
  local edges = opt.edges or EDGES[opt.kind]
  if r <= 5 or not edges then
    local all = catalogue(F)
    for _ = 1, 8 do
      local c = F.rng:pick(all)
      if c[1] ~= "nil" and not M.fits(opt, c[2]) then
        return c[2], c[1], "option of the wrong kind (" .. c[1] .. ")"
      end
    end
    return nil
  end
  local v
  if opt.kind == "device" then
    v = F.rng:chance(0.3) and F.absent_device or F.rng:pick(edges)
    return v, nil, "not a device here"
  end
  v = F.rng:pick(edges)
  if opt.kind == "str" and opt.choices and F.rng:chance(0.3) then
    v = opt.choices[1]:upper() .. " "
  end
  local bad
  if not M.fits(opt, v) then bad = "option of the wrong kind"
  elseif opt.ok and not opt.ok(v, opts) then bad = "option out of its range" end
  return v, nil, bad
end

-- Mutates options o (a copy is returned) of spec = { name = opt, ... } with required names
-- -> o', what was done (text), bad (why it must fail, or nil).
function M.options(F, o, spec, required)
  local names = {}
  for name in pairs(spec) do names[#names + 1] = name end
  table.sort(names)
  local c = M.copy(o)
  local r = F.rng:int(1, 20)
  if r <= 2 and required and #required > 0 then
    local name = F.rng:pick(required)
    c[name] = nil
    return c, "without " .. name, "required option '" .. name .. "' missing"
  elseif r <= 4 then
    local name = F.rng:pick(names)
    c[unknown_key(F, name)] = o[name] == nil and 1 or o[name]
    return c, "an unknown key", "unknown option"
  elseif r <= 12 then
    local name = F.rng:pick(names)
    local v, _, bad = M.wrong_value(F, spec[name], c)
    c[name] = v
    if v == nil and required then
      for _, req in ipairs(required) do if req == name then bad = "required option '" .. name .. "' missing" end end
    end
    return c, "option " .. name, bad
  elseif r <= 13 then
    -- the options arrive through a metatable: pairs() sees none of them, so no name is checked
    return setmetatable({}, { __index = c }), "options behind __index", "options with a metatable"
  elseif r <= 14 then
    local name = F.rng:pick(names)
    c[name] = nil
    return setmetatable(c, { __index = trap }), "options whose __index raises", "options with a metatable"
  elseif r <= 16 then
    local v = F.rng:pick { 1, "opts", true, F:any_tensor(), function() end }
    return v, "options not a table", "options not a table"
  else
    return c, "nothing changed", nil
  end
end

-- A shape that is wrong (bad set) or at an edge (bad nil).
function M.shape(F, shape)
  local r = F.rng:int(1, 12)
  local s = M.copy(shape)
  if r == 1 then return { 1, 2, 3, 4, 5 }, "more than 4 dimensions" end
  if r == 2 then s[#s + 1] = -1; return s, "a negative size" end
  if r == 3 then s[#s + 1] = 1.5; return s, "a fractional size" end
  if r == 4 then s[#s + 1] = "2"; return s, "a size that is a string" end
  if r == 5 then return { 2 ^ 21, 2 ^ 20 }, "more than 2^40 elements" end
  if r == 6 then return { 0, 2 ^ 41 }, "more than 2^40 elements past a zero" end
  if r == 7 then
    s = { 2, nil, 3 }
    return s, #s ~= 1 and "a hole" or nil -- the border of a table with a hole is either side of it
  end
  if r == 8 then return F.rng:pick { 4, "2x2", true, F:any_tensor() }, "not a table" end
  if r == 9 then return { 0 / 0 }, "a NaN size" end
  if r == 10 then return { math.huge }, "an infinite size" end
  if r == 11 then return {}, nil end
  return { 0, 3 }, nil
end

return M
