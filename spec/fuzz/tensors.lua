-- SPDX-License-Identifier: MIT
-- Calls on tensors: moe.tensor, zeros, full, randn, every method of a moelab.Tensor, and
-- closing and dropping them.  Results are judged against the pool's shadows.
local moe = require "moelab"
local O = require "fuzz.oracle"
local Pool = require "fuzz.pool"
local mutate = require "fuzz.mutate"
local close = require("fuzz.driver").close

local G = {}

local DTYPES = { "f32", "bf16", "i32" }
-- values every dtype holds exactly, then the ones only floats hold, then some each rounds
local EXACT = { 0, 1, -1, 2, -2, 3, 7, -8, 100 }
local FLOATS = { 0.5, -0.25, 1.5, 6.5, -3.75, 1e-3, 0.1, 1 / 3, 3e-39, 1e-45, 3.4e38, 7e38, 65280, 1.0078125,
  0 / 0, math.huge, -math.huge, -0.0 }
local INTS = { 2 ^ 31 - 1, -2 ^ 31, 123456789, -65536 }

-- A value for a tensor of dtype (one it holds after rounding, for floats).
function G.value(F, dtype)
  if F.rng:chance(0.6) then return F.rng:pick(EXACT) end
  if dtype == "i32" then return F.rng:pick(INTS) end
  return F.rng:pick(FLOATS)
end

-- A shape of up to 4 small dimensions (0 among them now and then).
function G.shape(F, max_dims)
  local s = {}
  for i = 1, F.rng:int(0, max_dims or 3) do s[i] = F.rng:chance(0.1) and 0 or F.rng:int(1, 4) end
  return s
end

local function plain(t)
  return type(t) == "table" and getmetatable(t) == nil
end
G.plain = plain

local function shape_equal(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
G.shape_equal = shape_equal

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end

-- Checks that t is an open CPU tensor of dtype and shape holding vals (flat, exact; NaN equals NaN).
function G.holds(t, dtype, shape, vals, what)
  if not mutate.is_tensor(t) then return string.format("%s is %s, not a moelab.Tensor", what, tostring(t)) end
  if t.closed then return what .. " came back closed" end
  if t.dtype ~= dtype then return string.format("%s has dtype %s, expected %s", what, t.dtype, dtype) end
  if not shape_equal(t.shape, shape) then
    return string.format("%s has shape %s, expected %s", what, shape_str(t.shape), shape_str(shape))
  end
  if t.device ~= "cpu" then return string.format("%s is on %s, expected cpu", what, t.device) end
  if vals then
    local got = t:flat()
    local i = O.first_difference(got, vals)
    if i then
      return string.format("%s holds %s at element %d, expected %s", what, tostring(got[i]), i, tostring(vals[i]))
    end
  end
end

-- ---------------------------------------------------------------- moe.tensor

-- data of shape as nested tables (or flat, as moe.tensor takes it with option shape).
local function nest(flat, shape, level, pos)
  if #shape == 0 then return flat[1] end
  local t = {}
  for i = 1, shape[level] do
    if level == #shape then
      pos[1] = pos[1] + 1
      t[i] = flat[pos[1]]
    else
      t[i] = nest(flat, shape, level + 1, pos)
    end
  end
  return t
end

function G.from_table(F)
  local dtype = F.rng:pick(DTYPES)
  local shape = G.shape(F)
  local flat = {}
  for i = 1, Pool.numel(shape) do flat[i] = G.value(F, dtype) end
  local nested = #shape > 0 and Pool.numel(shape) > 0 and F.rng:chance(0.6) -- nested tables cannot show a 0
  local data = nested and nest(flat, shape, 1, { 0 }) or flat
  if #shape == 0 then data = F.rng:chance(0.5) and flat[1] or flat end
  local opts = { dtype = F.rng:chance(0.8) and dtype or nil, device = F.rng:chance(0.2) and "cpu" or nil,
    shape = not nested and (#shape ~= 1 or F.rng:chance(0.5)) and shape or nil }
  if opts.dtype == nil then dtype = "f32" end
  local bad, proxy
  local r = F.rng:int(1, 20)
  if r <= 5 then
    local spec = { dtype = { kind = "str", choices = DTYPES }, device = { kind = "device" }, shape = { kind = "table" } }
    local what
    opts, what, bad = mutate.options(F, opts, spec)
    proxy = what:find("__index") ~= nil
    if bad == nil and plain(opts) and opts.shape ~= nil then proxy = true end -- a shape changed: no longer known
  elseif r <= 9 and #flat > 0 then
    local i = F.rng:int(1, #flat)
    local wrong = F.rng:pick { "x", true, function() end, dtype == "i32" and 2.5 or "1", dtype == "i32" and 2 ^ 31 or false,
      dtype == "i32" and 0 / 0 or "nan" }
    flat[i] = wrong
    data = nested and nest(flat, shape, 1, { 0 }) or flat
    bad = "element " .. i .. " is not a value of " .. dtype
  elseif r == 10 and nested and #shape >= 2 and shape[1] >= 2 then
    local inner = data[F.rng:int(1, shape[1])]
    inner[#inner] = nil
    bad = "a ragged nested table"
  elseif r == 11 and opts.shape then
    flat[#flat + 1] = 1
    bad = "more values than the shape holds"
  elseif r == 12 then
    data = setmetatable({}, { __index = function(_, i) return flat[i] end })
    proxy = true
  elseif r == 13 then
    data = { { { { { 1 } } } } }
    bad = "five levels of nesting"
  end
  local c = F:call { name = "moe.tensor", args = { data, opts }, n = 2, bad = bad }
  c.check = function(res)
    local t = res[2]
    if proxy or not plain(opts) then
      if not mutate.is_tensor(t) then return "moe.tensor returned " .. tostring(t) end
      F.pool:add(t)
      return nil
    end
    local dt = opts.dtype or "f32" -- as the call was given it (a mutation may have dropped it)
    local want = {}
    for i = 1, #flat do want[i] = O.stored(dt, flat[i]) end
    local want_shape = type(data) == "number" and {} or opts.shape or (nested and shape) or { #flat }
    local problem = G.holds(t, dt, want_shape, want, "the tensor")
    if not problem then F.pool:add(t) end
    return problem
  end
  return c
end

-- ---------------------------------------------------------------- zeros, full, randn

-- f32 draws of std 1, scaled by std as the library scales them (both factors as f32), then
-- rounded to dtype: what moe.randn must hold.
local function scaled_draws(shape, seed, std, dtype)
  local unit = moe.randn(shape, { seed = seed, std = 1, dtype = "f32" }):flat()
  local s = O.f32(std)
  local out = {}
  for i, u in ipairs(unit) do out[i] = O.stored(dtype, O.f32(u * s)) end
  return out
end

function G.maker(F)
  local which = F.rng:pick { "zeros", "full", "randn" }
  local dtypes = which == "randn" and { "f32", "bf16" } or DTYPES
  local dtype = F.rng:pick(dtypes)
  local shape = G.shape(F, 4)
  local opts = { dtype = F.rng:chance(0.7) and dtype or nil }
  local spec = { dtype = { kind = "str", choices = dtypes }, device = { kind = "device" } }
  if which == "randn" then
    opts.seed = F.rng:chance(0.8) and F.rng:int(-5, 50) or nil
    opts.std = F.rng:chance(0.7) and F.rng:pick { 1, 0.5, 2, 0.01, 3, 0 } or nil
    spec.seed = { kind = "int" }
    spec.std = { kind = "num", ok = function(v) return v >= 0 and v < math.huge end }
  end
  local value = which == "full" and G.value(F, opts.dtype or "f32") or nil
  local bad
  local r = F.rng:int(1, 10)
  if r <= 3 then
    local _
    opts, _, bad = mutate.options(F, opts, spec)
  elseif r <= 5 then
    local why
    shape, why = mutate.shape(F, shape)
    bad = why
  elseif r == 6 and which == "full" then
    value = F.rng:pick { "1", {}, true, nil, F:any_tensor() }
    bad = "a value that is not a number"
  elseif r == 7 and which == "full" and (opts.dtype == "i32") then
    value = F.rng:pick { 2.5, 2 ^ 31, 0 / 0, -math.huge }
    bad = "a value i32 does not hold"
  end
  local args = which == "full" and { shape, value, opts } or { shape, opts }
  local c = F:call { name = "moe." .. which, args = args, n = #args == 3 and 3 or 2, bad = bad }
  c.check = function(res)
    local t = res[2]
    if not plain(opts) then
      if not mutate.is_tensor(t) then return "moe." .. which .. " returned " .. tostring(t) end
      F.pool:add(t)
      return nil
    end
    local dt = opts.dtype or "f32"
    local want
    if which == "randn" then
      want = scaled_draws(shape, opts.seed or 0, opts.std or 1, dt)
    else
      want = {}
      for i = 1, Pool.numel(shape) do want[i] = which == "zeros" and 0 or O.stored(dt, value) end
    end
    local problem = G.holds(t, dt, shape, want, "the tensor")
    if not problem then F.pool:add(t) end
    return problem
  end
  return c
end

-- ---------------------------------------------------------------- methods

-- The window of e as nested tables (what totable must give).
local function nested_of(F, e)
  local flat = F.pool:shadow(e)
  if #e.shape == 0 then return flat[1] end
  return nest(flat, e.shape, 1, { 0 })
end

local function deep_equal(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b or (a ~= a and b ~= b) end
  if #a ~= #b then return false end
  for i = 1, #a do if not deep_equal(a[i], b[i]) then return false end end
  return true
end

-- An entry of the pool to call a method on: mostly open ones, now and then a closed one.
local function target(F)
  if #F.pool.entries == 0 or F.rng:chance(0.1) then F:any_tensor() end
  if F.rng:chance(0.05) then F:closed_tensor() end
  return F.rng:pick(F.pool.entries)
end

-- Each method: args(F, e) -> args, n, bad; then(F, e, res, args) -> problem, after a success.
local METHODS = {}

METHODS.flat = { args = function() return {}, 0 end, check = function(F, e, res)
  local i = O.first_difference(res[2], F.pool:shadow(e))
  if i then return string.format("flat()[%d] is %s, expected %s", i, tostring(res[2][i]), tostring(F.pool:shadow(e)[i])) end
end }

METHODS.totable = { args = function() return {}, 0 end, check = function(F, e, res)
  if not deep_equal(res[2], nested_of(F, e)) then return "totable() differs from the tensor's contents" end
end }

METHODS.get = {
  args = function(F, e)
    local i = e.numel > 0 and F.rng:int(1, e.numel) or 1
    local r = F.rng:int(1, 6)
    if r == 1 then return { e.numel + 1 }, 1, "an index past the end" end
    if r == 2 then return { F.rng:pick { 0, -1, -2 ^ 63 } }, 1, "an index below 1" end
    if r == 3 then return { F.rng:pick { 1.5, "x", nil, {}, 0 / 0 } }, 1, "an index that is not an integer" end
    return { i }, 1, e.numel == 0 and "an index into an empty tensor" or nil
  end,
  check = function(F, e, res, args)
    local want = F.pool:shadow(e)[args[1]]
    if res[2] ~= want and not (want ~= want and res[2] ~= res[2]) then
      return string.format("get(%d) is %s, expected %s", args[1], tostring(res[2]), tostring(want))
    end
  end,
}

local function field(name)
  return { field = name, args = function() return {}, 0 end, check = function(F, e, res)
    local v = res[2]
    local want = name == "shape" and e.shape or name == "dtype" and e.dtype or name == "device" and "cpu"
      or name == "ndim" and #e.shape or name == "closed" and false
    if not deep_equal(v, want) then return string.format("t.%s is %s, expected %s", name, tostring(v), tostring(want)) end
  end }
end
METHODS.shape, METHODS.dtype, METHODS.device, METHODS.ndim, METHODS.closed =
  field("shape"), field("dtype"), field("device"), field("ndim"), field("closed")

METHODS.numel = { args = function() return {}, 0 end, check = function(_, e, res)
  if res[2] ~= e.numel then return "numel() is " .. tostring(res[2]) .. ", expected " .. e.numel end
end }

METHODS.nbytes = { args = function() return {}, 0 end, check = function(_, e, res)
  local want = e.numel * (e.dtype == "bf16" and 2 or 4)
  if res[2] ~= want then return "nbytes() is " .. tostring(res[2]) .. ", expected " .. want end
end }

METHODS.fill = {
  writes = true,
  args = function(F, e)
    local r = F.rng:int(1, 6)
    if r == 1 then return { F.rng:pick { "x", {}, true, nil } }, 1, "a value that is not a number" end
    if r == 2 and e.dtype == "i32" then return { F.rng:pick { 0.5, 2 ^ 31, -2 ^ 31 - 1, 0 / 0 } }, 1, "not an i32 value" end
    return { G.value(F, e.dtype) }, 1, nil
  end,
  check = function(F, e, res, args)
    local want = {}
    for i = 1, e.numel do want[i] = O.stored(e.dtype, args[1]) end
    local problem = G.holds(res[2], e.dtype, e.shape, want, "the filled tensor")
    F.pool:write(e, want)
    return problem
  end,
}

-- an entry of the pool other than e (or e itself), open or not
local function other(F, e)
  if F.rng:chance(0.15) then return e end
  return F.rng:pick(F.pool.entries)
end

METHODS.copy = {
  writes = true,
  args = function(F, e)
    local same = F.pool:open(function(u) return u.dtype == e.dtype and u.numel == e.numel end)
    if #same > 0 and F.rng:chance(0.7) then return { F.rng:pick(same).t }, 1, nil end
    local u = other(F, e)
    local bad = (u.closed and "a closed source") or (u.dtype ~= e.dtype and "a source of another dtype")
      or (u.numel ~= e.numel and "a source of another size") or nil
    if F.rng:chance(0.2) then return { F.rng:pick { 1, "t", {}, nil } }, 1, "a source that is not a tensor" end
    return { u.t }, 1, bad
  end,
  before = function(F, _, args)
    local u = F.pool:entry_of(args[1])
    return u and not u.closed and F.pool:shadow(u) -- the source as it was (the copy may overlap it)
  end,
  check = function(F, e, res, _, src)
    if not src then return nil end
    local problem = G.holds(res[2], e.dtype, e.shape, src, "the copy")
    F.pool:write(e, src)
    return problem
  end,
}

METHODS.randn = {
  writes = true,
  args = function(F, e)
    local seed, std = F.rng:int(0, 99), F.rng:pick { 1, 0.5, 2, 0.125 }
    local r = F.rng:int(1, 6)
    if e.dtype == "i32" then return { seed, std }, 2, "randn into an i32 tensor" end
    if r == 1 then return { F.rng:pick { 1.5, "x", nil }, std }, 2, "a seed that is not an integer" end
    if r == 2 then return { seed, F.rng:pick { 0 / 0, math.huge, 1e39, "x", {} } }, 2, "a std that is not finite" end
    if r == 3 then return { seed }, 1, nil end
    return { seed, std }, 2, nil
  end,
  check = function(F, e, res, args)
    local want = scaled_draws({ e.numel }, args[1], args[2] or 1, e.dtype)
    local problem = G.holds(res[2], e.dtype, e.shape, want, "the drawn tensor")
    F.pool:write(e, want)
    return problem
  end,
}

METHODS.view = {
  args = function(F, e)
    local n = e.numel
    local off = F.rng:int(0, n)
    local len = F.rng:int(0, n - off)
    local shape = { len }
    if len > 1 and len % 2 == 0 and F.rng:chance(0.5) then shape = { 2, len / 2 } end
    local r = F.rng:int(1, 8)
    if r == 1 then return { off, { n - off + 1 } }, 2, "a view past the end" end
    if r == 2 then return { F.rng:pick { -1, n + 1, 2 ^ 62 }, { 0 } }, 2, "an offset outside the tensor" end
    if r == 3 then
      local s, why = mutate.shape(F, shape)
      return { off, s }, 2, why and why or (Pool.numel(s) > n - off and "more elements than the tensor has") or nil
    end
    if r == 4 then return { F.rng:pick { 0.5, "x", nil }, shape }, 2, "an offset that is not an integer" end
    return { off, shape }, 2, nil
  end,
  check = function(F, e, res, args)
    local v = res[2]
    local s = args[2]
    local problem = G.holds(v, e.dtype, s, nil, "the view")
    if problem then return problem end
    local ve = F.pool:add(v, e, args[1])
    local want = F.pool:shadow(ve)
    local i = O.first_difference(v:flat(), want)
    if i then return string.format("the view holds %s at element %d, expected %s", tostring(v:flat()[i]), i, tostring(want[i])) end
  end,
}

METHODS.select = {
  args = function(F, e)
    local d1 = e.shape[1]
    if not d1 then return { 1 }, 1, "select on a 0-dimensional tensor" end
    local r = F.rng:int(1, 6)
    if r == 1 then return { d1 + 1 }, 1, "an index past the first dimension" end
    if r == 2 then return { 0 }, 1, "an index below 1" end
    if r == 3 then return { F.rng:pick { 1.5, "x", nil } }, 1, "an index that is not an integer" end
    if d1 == 0 then return { 1 }, 1, "select on an empty first dimension" end
    return { F.rng:int(1, d1) }, 1, nil
  end,
  check = function(F, e, res, args)
    local s = {}
    for i = 2, #e.shape do s[#s + 1] = e.shape[i] end
    local problem = G.holds(res[2], e.dtype, s, nil, "the selected row")
    if problem then return problem end
    local ve = F.pool:add(res[2], e, (args[1] - 1) * Pool.numel(s))
    local i = O.first_difference(res[2]:flat(), F.pool:shadow(ve))
    if i then return string.format("the selected row differs at element %d", i) end
  end,
}

METHODS.to = {
  args = function(F)
    if F.rng:chance(0.7) then return { "cpu" }, 1, nil end
    return { F.rng:pick { F.absent_device, "gpu", 0, nil } }, 1, "not a device here"
  end,
  check = function(F, e, res)
    local problem = G.holds(res[2], e.dtype, e.shape, F.pool:shadow(e), "the copy made by to()")
    if not problem then F.pool:add(res[2]) end
    return problem
  end,
}

METHODS.overlaps = {
  args = function(F, e)
    local u = other(F, e)
    if F.rng:chance(0.15) then return { F.rng:pick { 1, {}, nil } }, 1, "not a tensor" end
    return { u.t }, 1, u.closed and "a closed tensor" or nil
  end,
  check = function(F, e, res, args)
    local u = F.pool:entry_of(args[1])
    local want = Pool.overlaps(e, u)
    if res[2] ~= want then return string.format("overlaps is %s, expected %s", tostring(res[2]), tostring(want)) end
  end,
}

local METHOD_NAMES = {}
for name in pairs(METHODS) do METHOD_NAMES[#METHOD_NAMES + 1] = name end
table.sort(METHOD_NAMES)

function G.method(F)
  local e = target(F)
  local name = F.rng:pick(METHOD_NAMES)
  local m = METHODS[name]
  local args, n, bad = m.args(F, e)
  if e.closed and not (m.field == "closed") then bad = bad or "a closed tensor" end
  local c
  if m.field then
    c = F:expr({ name = e.name .. "." .. name, text = e.name .. "." .. name, names = { name } }, e.t,
      "return obj." .. name)
    if e.closed and name == "closed" then
      c.check = function(res) if res[2] ~= true then return "t.closed is not true on a closed tensor" end end
      return c
    end
  else
    local dot = F.rng:chance(0.1)
    c = F:method { obj = e.t, method = name, args = args, n = n, dot = dot, names = { name } }
    if dot then bad = "a method called with '.'" end
  end
  c.bad = bad
  local src = m.before and m.before(F, e, args)
  c.check = function(res) return m.check(F, e, res, args, src) end
  if m.writes then
    c.name = "tensor:" .. name
    Pool.touch(e)
  end
  return c
end

-- t[1], t.dtype = ...: what a tensor is not
function G.misuse(F)
  local e = target(F)
  if F.rng:chance(0.5) then
    return F:expr({ name = "tensor[i]", text = e.name .. "[1]", bad = "indexing a tensor by a number",
      names = { "moelab.Tensor" } }, e.t, "return obj[1]")
  end
  return F:expr({ name = "tensor.field=", text = e.name .. '.dtype = "bf16"', bad = "assigning to a tensor's field",
    names = { "moelab.Tensor" } }, e.t, 'obj.dtype = "bf16"')
end

-- closing a handle (t:close(), as a <close> variable leaving its scope does), dropping one, collecting
function G.close(F)
  local open = F.pool:open()
  if #open == 0 then return G.method(F) end
  local e = F.rng:pick(open)
  Pool.touch(e)
  if F.rng:chance(0.7) then
    return { name = "close", text = e.name .. ":close()",
      fn = function() close(e.t) end, check = function() e.closed = true end }
  end
  return { name = "collect", text = string.format("%s = nil; collectgarbage()", e.name), fn = function()
    for i, x in ipairs(F.pool.entries) do
      if x == e then table.remove(F.pool.entries, i) break end
    end
    e.t = nil
    collectgarbage()
  end }
end

return G
