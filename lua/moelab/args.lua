-- SPDX-License-Identifier: MIT
-- Argument checking for the front-end: every misuse raises an error that names the function,
-- the option, the value and what was expected, in the "bad argument #1 to 'f' (...)" form that
-- Lua's own library uses, pointed at the caller's line.
local core = require "moelab.core"
local compat = require "moelab.compat"

local args = {}

local function describe(v)
  if core.is_tensor(v) then return tostring(v) end
  if type(v) == "string" then return string.format("%q", v) end
  if compat.math_type(v) == "float" then -- 2.0 as "2.0", so that "must be an integer, got 2.0" reads right
    return (v == math.floor(v) and math.abs(v) < 2^53) and string.format("%.1f", v) or string.format("%.17g", v)
  end
  if compat.math_type(v) == "integer" then return compat.int_str(v) end -- every digit, on LuaJIT too
  return tostring(v)
end
args.describe = describe

-- Raises msg at the first frame outside the front-end (a file in a "moelab" directory): the
-- user's line, however deep in the front-end the failure was found; without a position where a
-- C function (a pcall) stands between, whose catcher adds one.  The binding's own rule (C), the
-- one way the front-end raises.
args.raise = core.raise

-- An argument error of the front-end function fname, as Lua's own library words them.
function args.fail(fname, msg)
  core.raise(string.format("bad argument #1 to '%s' (%s)", fname, msg))
end

local is_tensor = core.is_tensor
args.is_tensor = is_tensor

-- kinds: "tensor", "integer", "number", "string", "boolean", "table", "function", "any",
-- or a list of allowed strings {"a", "b"}.
local function matches(kind, v)
  if type(kind) == "table" then
    for _, s in ipairs(kind) do if v == s then return true end end
    return false
  end
  if kind == "any" then return true end
  if kind == "tensor" then return is_tensor(v) end
  if kind == "integer" then return compat.math_type(v) == "integer" or (compat.math_type(v) == "float" and v == math.floor(v) and v == v and math.abs(v) < 2^53) end
  if kind == "number" then return type(v) == "number" end
  if kind == "device" then return args.is_device(v) end
  return type(v) == kind
end

-- "cpu", "cuda" or "cuda:N" with N as the binding reads it (at most 1,000,000)
function args.is_device(v)
  if v == "cpu" or v == "cuda" then return true end
  local n = type(v) == "string" and v:match("^cuda:(%d+)$")
  return type(n) == "string" and tonumber(n) <= 1000000
end

-- An option naming a device (nil: the default, "cpu") that this build and machine lack, refused
-- as the option it is rather than by the tensor the function would then allocate.
function args.available(fname, dev)
  if dev == nil or dev == "cpu" then return end
  local n = core.device_count("cuda")
  local i = dev == "cuda" and 0 or tonumber(dev:match("^cuda:(%d+)$"))
  if n == 0 then
    args.fail(fname, string.format("option 'device' is %s, which is not available (no usable GPU in this build or "
      .. "on this machine)", describe(dev)))
  elseif i >= n then
    args.fail(fname, string.format("option 'device' is %s, which does not exist (%d GPU%s visible)", describe(dev), n,
      n == 1 and "" or "s"))
  end
end

local function expected(kind)
  if type(kind) == "table" then
    local q = {}
    for i, s in ipairs(kind) do q[i] = string.format("'%s'", s) end
    return "one of " .. table.concat(q, ", ")
  end
  if kind == "tensor" then return "a moelab.Tensor" end
  if kind == "device" then return "a device, 'cpu' or 'cuda:N'" end
  return (kind == "integer" and "an " or "a ") .. kind
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = tostring(k) end
  table.sort(ks)
  return ks
end

-- Options 'dtype' and 'out' together must agree: the output's own dtype is what a stage writes.
function args.same_dtype(fname, out, dtype)
  if out and is_tensor(out) and out.closed then
    args.fail(fname, "option 'out' is a closed moelab.Tensor")
  end
  if out and dtype and out.dtype ~= dtype then
    args.fail(fname, string.format("option 'dtype' is '%s' but option 'out' is %s", dtype, out.dtype))
  end
end

-- A table read by its own keys (options, a model) must have no metatable: keys it handed out
-- through __index, or hid from pairs through __pairs, would escape the check of their names.
function args.plain(fname, what, t)
  if getmetatable(t) ~= nil then
    args.fail(fname, string.format("expected %s as a plain table, got one with a metatable (keys that come "
      .. "through __index or hide from pairs would not be checked): copy them into a plain table", what))
  end
  return t
end

-- Checks an options table against spec = {name = kind, ...}; required = {name, ...}.
-- Unknown keys are errors: a typo must not be silently ignored.  Returns opts.
function args.options(fname, opts, spec, required)
  if type(opts) ~= "table" or is_tensor(opts) then
    args.fail(fname, "expected a table of options, got " .. (is_tensor(opts) and "a moelab.Tensor" or type(opts)))
  end
  args.plain(fname, "the options", opts)
  for k, v in pairs(opts) do
    local kind = spec[k]
    if kind == nil then
      args.fail(fname, string.format("unknown option '%s'; expected one of: %s", tostring(k),
        table.concat(sorted_keys(spec), ", ")))
    end
    if not matches(kind, v) then
      args.fail(fname, string.format("option '%s' must be %s, got %s", k, expected(kind), describe(v)))
    end
  end
  for _, k in ipairs(required or {}) do
    if opts[k] == nil then
      -- an "any" option is checked by its function, which says what it takes
      args.fail(fname, spec[k] == "any" and string.format("option '%s' is required", k)
        or string.format("option '%s' is required (%s)", k, expected(spec[k])))
    end
  end
  for k, v in pairs(opts) do
    if spec[k] == "integer" and compat.math_type(v) == "float" then opts[k] = compat.tointeger(v) end
  end
  return opts
end

-- A range check for an integer or number option that is present.
function args.range(fname, name, v, lo, hi)
  if v == nil then return end
  if v ~= v or (lo and v < lo) or (hi and v > hi) then -- NaN passes no comparison: refused too
    local want
    if lo and hi then want = string.format("between %s and %s", lo, hi)
    elseif lo then want = string.format(">= %s", lo)
    else want = string.format("<= %s", hi) end
    args.fail(fname, string.format("option '%s' must be %s, got %s", name, want, describe(v)))
  end
end

-- shape string "[2, 3]"
function args.shape_str(shape)
  local s = {}
  for i, d in ipairs(shape) do s[i] = compat.tointeger(d) and compat.int_str(d) or tostring(d) end -- 2^40 as 1099511627776, not 1.0995...e+12
  return "[" .. table.concat(s, ", ") .. "]"
end

-- Checks a tensor's dtype and shape (a nil in want_shape matches any size).
function args.tensor(fname, name, t, dtype, want_shape)
  if not is_tensor(t) then
    args.fail(fname, string.format("option '%s' must be a moelab.Tensor, got %s", name, describe(t)))
  end
  if t.closed then args.fail(fname, string.format("option '%s' is a closed moelab.Tensor", name)) end
  local ok = (dtype == nil or t.dtype == dtype)
  local shape = t.shape
  if want_shape then
    if #shape ~= #want_shape then ok = false end
    for i = 1, #want_shape do
      if want_shape[i] ~= nil and want_shape[i] ~= false and shape[i] ~= want_shape[i] then ok = false end
    end
  end
  if not ok then
    local w = {}
    for i = 1, want_shape and #want_shape or 0 do
      w[i] = (want_shape[i] == nil or want_shape[i] == false) and "_" or tostring(want_shape[i])
    end
    args.fail(fname, string.format("option '%s' must be %s%s, got %s", name, dtype or "a tensor",
      want_shape and (" [" .. table.concat(w, ", ") .. "]") or "", tostring(t)))
  end
  return t
end

-- All tensors named in names (fields of opts; nil ones skipped) live on one device; returns it.
function args.same_device(fname, opts, names)
  local dev, first
  for _, name in ipairs(names) do
    local t = opts[name]
    if is_tensor(t) then
      if t.closed then args.fail(fname, string.format("option '%s' is a closed moelab.Tensor", name)) end
      if dev == nil then dev, first = t.device, name
      elseif t.device ~= dev then
        args.fail(fname, string.format("option '%s' is on %s but '%s' is on %s; all tensors must be on one device",
          name, t.device, first, dev))
      end
    end
  end
  return dev
end

-- Every method of class (a metatable that is its own __index: each function field but the
-- metamethods, "__...", and the constructors named in except) checks its self, so that
-- class.method(x), where class:method(x) was meant, says so at the caller's line rather than
-- fail inside the front-end on a nil.  var names an instance in the message ("layer").
function args.methods(class, var, except)
  local skip, found = {}, {}
  for _, name in ipairs(except or {}) do skip[name] = true end
  for name, fn in pairs(class) do
    if type(fn) == "function" and name:sub(1, 2) ~= "__" and not skip[name] then found[name] = fn end
  end
  for name, fn in pairs(found) do
    class[name] = function(self, ...)
      if getmetatable(self) ~= class then
        local mt = type(self) == "table" and getmetatable(self)
        local got = type(self) == "table" and (type(mt) == "table" and mt.__name or "a table") or describe(self)
        args.fail(name, string.format("expected a %s as self, got %s: call it as %s:%s(...), with a colon",
          class.__name, got, var, name))
      end
      return fn(self, ...)
    end
  end
  return class
end

args.core = core
return args
