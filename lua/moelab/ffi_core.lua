-- SPDX-License-Identifier: MIT
-- moelab.core for LuaJIT: the binding of lib/moelab.h through the FFI, with the interface and
-- the error wording of the Lua 5.4 C module (lua/core/*.c), so that the front-end runs on it
-- unchanged.  init.lua installs it as moelab.core when the interpreter is LuaJIT.
--
-- Where it finds what it binds:
--   the header (its declarations between MOE_CDEF_BEGIN and MOE_CDEF_END go to ffi.cdef, read
--     when the module loads, so that they can never drift from the library's): MOELAB_HEADER;
--     else lib/moelab.h of the source tree this file is in; else include/moelab.h of the
--     prefix this file is installed under (<prefix>/share/lua/5.1/moelab/); else
--     /usr/local/include and /usr/include.
--   the library: MOELAB_LIB (a path); else ./<MOE_BUILD_DIR, default build>/libmoelab.so; else
--     the system's libmoelab.so (ffi.load "moelab", the dynamic loader's search).
-- The header's version must be the library's.
--
-- Tensors are cdata of a handle struct (ffi.metatype): the library's moe_tensor, whether the
-- handle was closed, and for an owner the count of its live views and of the graphs that replay
-- on its memory (the pins of a capture, as in lua/core/lcore.h).  A view's owner is kept alive
-- by the table `owners` until the view is closed or collected, and moe.wrap's keep by the table
-- `keeps` until the memory it wraps is freed.  Events, graphs, worlds, exchanges and safetensors
-- files are tables holding a cdata whose finalizer frees the C object.
-- A new part of the C module needs its twin here: spec/luajit_spec.lua runs the suite's probe
-- (spec/bindings_probe.lua) through both.
--
-- Errors are raised as the C module raises them: a library failure with its context's
-- message, a stage's argument error as "bad argument #1 to '<stage>' (...)", both at the first
-- line outside the front-end (a file in a "moelab" directory), none where a C function (a
-- pcall) stands between; the checks of plain arguments as Lua's own library words them, at the
-- line of the direct caller.
local ffi = require "ffi"

local registry = debug.getregistry()
if registry["moelab.ffi_core"] then return registry["moelab.ffi_core"] end -- one binding per Lua state

local getenv = os.getenv

local function readable(path)
  local f = path and io.open(path, "r")
  if f then f:close() end
  return f ~= nil and f ~= false
end

-- ---------------------------------------------------------------- the header and the library

local here = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."

local function find_header()
  local candidates = { getenv("MOELAB_HEADER"), here .. "/../../lib/moelab.h", here .. "/../../../../include/moelab.h",
    "/usr/local/include/moelab.h", "/usr/include/moelab.h" }
  for i = 1, #candidates do -- not ipairs: an unset MOELAB_HEADER is a hole
    local path = candidates[i]
    if path and path ~= "" and readable(path) then return path end
  end
  error("moelab.core (LuaJIT): cannot find moelab.h; set MOELAB_HEADER to its path", 0)
end

local header_path = find_header()
local header
do
  local f = assert(io.open(header_path, "r"))
  header = f:read("*a")
  f:close()
end
local cdef = header:match("/%* MOE_CDEF_BEGIN %*/(.*)/%* MOE_CDEF_END %*/")
if not cdef then
  error(string.format("moelab.core (LuaJIT): %s has no MOE_CDEF_BEGIN ... MOE_CDEF_END block", header_path), 0)
end
local function define(name)
  return tonumber(header:match("#define " .. name .. " (%d+)"))
end
local HEADER_VERSION = define("MOE_VERSION_MAJOR") * 10000 + define("MOE_VERSION_MINOR") * 100
  + define("MOE_VERSION_PATCH")

-- A state that declared the API already (the README's two lines) keeps its declarations.
if not pcall(ffi.typeof, "moe_world_exchange") then ffi.cdef((cdef:gsub("MOE_API ", ""))) end
ffi.cdef [[
typedef struct moelab_tensor_handle {
  moe_tensor *h_t;       /* first: from_dlpack and wrap have the library write it in place */
  double h_owner;        /* 0 for an owner; for a view, the key of its owner in `owners` */
  double h_keep;         /* 0, or an owner's key in `keeps` (the keep of moe.wrap) */
  int32_t h_closed, h_views, h_pins;
  int32_t h_dtype, h_ndim, h_kind, h_index; /* never change: cached for the properties */
  double h_dims[4];
} moelab_tensor_handle;
typedef struct moelab_timespec { long sec, nsec; } moelab_timespec;
int clock_gettime(int clock, moelab_timespec *ts);
int nanosleep(const moelab_timespec *req, moelab_timespec *rem);
]]

local function find_library()
  local path = getenv("MOELAB_LIB")
  if path and path ~= "" then return path end
  local build = getenv("MOE_BUILD_DIR")
  path = "./" .. (build and build ~= "" and build or "build") .. "/libmoelab.so"
  if readable(path) then return path end
  return "moelab"
end

local lib_path = find_library()
local ok_load, lib = pcall(ffi.load, lib_path)
if not ok_load then
  error(string.format("moelab.core (LuaJIT): cannot load libmoelab (%s): %s; set MOELAB_LIB to its path", lib_path,
    tostring(lib)), 0)
end
if lib.moe_libversion_number() ~= HEADER_VERSION then
  error(string.format("moelab.core (LuaJIT): the header %s is moelab %d but the library %s is moelab %s (%d)",
    header_path, HEADER_VERSION, lib_path, ffi.string(lib.moe_libversion()), lib.moe_libversion_number()), 0)
end

local C = ffi.C
local cast, istype, new, string_ = ffi.cast, ffi.istype, ffi.new, ffi.string
local floor, format = math.floor, string.format

local M = {}
M.version = ffi.string(lib.moe_libversion())
M.version_number = lib.moe_libversion_number()

-- ---------------------------------------------------------------- the context

local ctx_open = false
local ctx
do
  local cell = new("moe_ctx *[1]")
  local rc = lib.moe_ctx_open(cell)
  if rc ~= 0 then
    -- a context that failed to open may still hold the reason (MOE_THREADS); it is closed here
    local failed = cell[0]
    local msg = failed ~= nil and string_(lib.moe_errmsg(failed)) or string_(lib.moe_errstr(rc))
    lib.moe_ctx_close(failed)
    error("moelab.core: cannot open a context: " .. msg, 0)
  end
  -- a world's finalizer unbinds the context, unless the context went first (at exit, in any order)
  ctx = ffi.gc(cell[0], function(c)
    ctx_open = false
    lib.moe_ctx_close(c)
  end)
  ctx_open = true
end

-- ---------------------------------------------------------------- errors

-- Whether a source is a file of the front-end: a "moelab" directory right above the file.
local function frontend(source)
  return source:sub(1, 1) == "@" and (source:find("/moelab/[^/]*$") ~= nil or source:find("^@moelab/[^/]*$") ~= nil)
end

-- "file:line: " of the code that called into moelab, skipping the binding and the front-end;
-- "" where a C function stands between (whoever catches the error places it).
local function caller_where()
  local level = 2
  while true do
    local info = debug.getinfo(level, "Sl")
    if not info then return "" end
    if not frontend(info.source) then
      return info.currentline > 0 and format("%s:%d: ", info.short_src, info.currentline) or ""
    end
    level = level + 1
  end
end

local this_source = debug.getinfo(1, "S").source

-- "file:line: " of the first frame outside this file: the direct caller of the binding, where
-- Lua's own library places its argument errors.
local function direct_where()
  local level = 2
  while true do
    local info = debug.getinfo(level, "Sl")
    if not info then return "" end
    if info.source ~= this_source then
      return info.currentline > 0 and format("%s:%d: ", info.short_src, info.currentline) or ""
    end
    level = level + 1
  end
end

local function raise(msg) error(caller_where() .. msg, 0) end
M.raise = function(msg)
  if type(msg) ~= "string" and type(msg) ~= "number" then
    error(direct_where() .. format("bad argument #1 to 'raise' (string expected, got %s)", type(msg)), 0)
  end
  raise(tostring(msg))
end

local function errmsg(rc)
  local msg = lib.moe_errmsg(ctx)
  msg = msg ~= nil and string_(msg) or ""
  return msg ~= "" and msg or string_(lib.moe_errstr(rc))
end

local function fail(rc) raise(errmsg(rc)) end

-- "bad argument #arg to 'fname' (...)" under the front-end's name, at the user's line.
local function arg_error(fname, arg, fmt, ...)
  raise(format("bad argument #%d to '%s' (%s)", arg, fname, format(fmt, ...)))
end

-- A stage's argument failure ("<stage>: <what>") as the front-end's own argument error.
local function stage_fail(rc, fname, stage)
  local msg = errmsg(rc)
  if rc ~= 1 or msg:sub(1, #stage + 2) ~= stage .. ": " then return fail(rc) end
  arg_error(fname, 1, "%s", msg:sub(#stage + 3))
end

-- As stage_fail, for any code, the stage's words after what (the argument they are about).
local function stage_fail_as(rc, fname, stage, what)
  local msg = errmsg(rc)
  if msg:sub(1, #stage + 2) ~= stage .. ": " then return fail(rc) end
  arg_error(fname, 1, "%s%s", what, msg:sub(#stage + 3))
end

-- Whether the binding's function that was called from outside this file was called as a method
-- (t:f(...), not t.f(t, ...)): how luaL_argerror tells whether to count self.
local function called_as_method()
  local level, namewhat = 3, nil
  while true do
    local info = debug.getinfo(level, "Sn")
    if not info or info.source ~= this_source then return namewhat == "method" end
    namewhat = info.namewhat
    level = level + 1
  end
end

-- Lua's own argument error (luaL_argerror): self is not counted in the arguments of a method
-- called with a colon.
local function argerror(fname, arg, msg, method)
  if method and called_as_method() then
    arg = arg - 1
    if arg == 0 then error(direct_where() .. format("calling '%s' on bad self (%s)", fname, msg), 0) end
  end
  error(direct_where() .. format("bad argument #%d to '%s' (%s)", arg, fname, msg), 0)
end

-- ---------------------------------------------------------------- values of Lua

local Handle -- the tensor handle's ctype (below)

local function type_name(v)
  if istype(Handle, v) then return "moelab.Tensor" end
  local mt = getmetatable(v)
  if type(mt) == "table" and type(rawget(mt, "__name")) == "string" then return rawget(mt, "__name") end
  return type(v)
end

local function is_integer(v)
  return type(v) == "number" and v == floor(v) and v >= -2 ^ 63 and v < 2 ^ 63
end

-- A number as its value, anything else as its type: "1.5", "string".
local function got_value(v)
  if type(v) ~= "number" then return type_name(v) end
  if is_integer(v) then return format("%d", v) end
  return format("%.14g", v)
end

-- "is a string", "is nil", and for a number "is 1.5" or "is a number".
local function is_what(v, value)
  if v == nil then return "is nil" end
  if type(v) == "number" then return value and "is " .. got_value(v) or "is a number" end
  return "is a " .. type_name(v)
end

local function typeerror(fname, arg, want, v, method)
  argerror(fname, arg, format("%s expected, got %s", want, v == nil and "no value" or type_name(v)), method)
end

local function check_integer(fname, arg, v, method)
  if type(v) ~= "number" then typeerror(fname, arg, "number", v, method) end
  if not is_integer(v) then argerror(fname, arg, "number has no integer representation", method) end
  return v
end

local function check_number(fname, arg, v, method)
  if type(v) ~= "number" then typeerror(fname, arg, "number", v, method) end
  return v
end

local function check_string(fname, arg, v, method)
  if type(v) == "number" then return tostring(v) end
  if type(v) ~= "string" then typeerror(fname, arg, "string", v, method) end
  return v
end

local function check_option(fname, arg, v, names, method)
  v = check_string(fname, arg, v, method)
  for i = 1, #names do if names[i] == v then return i end end
  argerror(fname, arg, format("invalid option '%s'", v), method)
end

-- Devices: "cpu", "cuda", "cuda:N" -> cached moe_device values.
local devices = {}
local CUDA_NAMES = {}
local function device_name(kind, index)
  if kind == 0 then return "cpu" end
  local s = CUDA_NAMES[index]
  if not s then
    s = "cuda:" .. index
    CUDA_NAMES[index] = s
  end
  return s
end

local function check_device(fname, arg, v, method)
  if type(v) ~= "string" then
    argerror(fname, arg, format("expected 'cpu' or 'cuda:N', got %s", type_name(v)), method)
  end
  local d = devices[v]
  if d then return d end
  local kind, index
  if v == "cpu" then kind, index = 0, 0
  elseif v == "cuda" then kind, index = 1, 0
  else
    local digits = v:match("^cuda:(%d+)$")
    local n = digits and tonumber(digits)
    if not n or n > 1000000 then argerror(fname, arg, format("expected 'cpu' or 'cuda:N', got '%s'", v), method) end
    kind, index = 1, n
  end
  d = new("moe_device", kind, index)
  devices[v] = d
  return d
end

local DTYPES = { "f32", "bf16", "i32", "e4m3" } -- moe_dtype + 1
local DTYPE_SIZE = { 4, 2, 4, 1 }

-- A shape: a table of 0..4 non-negative integers, into the shared array shape_buf.
local shape_buf = new("int64_t[4]")
local function check_shape(fname, arg, shape, method)
  if type(shape) ~= "table" then
    argerror(fname, arg, format("expected a shape (a table of integers), got %s", type_name(shape)), method)
  end
  local n = #shape
  if n > 4 then argerror(fname, arg, format("shape has %d dimensions, at most 4", n), method) end
  for i = 1, n do
    local v = rawget(shape, i)
    if not is_integer(v) or v < 0 then
      argerror(fname, arg, format("shape[%d] %s, expected a non-negative integer", i, is_what(v, true)), method)
    end
    shape_buf[i - 1] = v
  end
  return n
end

-- An address another library handed out -> void *: an integer >= 0 (a number, or an int64_t or
-- uint64_t cdata), a light userdata, or a pointer or an array (the cdata LuaJIT's FFI gives).
-- what names it in the error.
local void_ptr, int64_ct, uint64_ct = ffi.typeof("void *"), ffi.typeof("int64_t"), ffi.typeof("uint64_t")
local function check_address(fname, what, v)
  local kind = type(v)
  if kind == "number" then
    if is_integer(v) and v >= 0 then return cast(void_ptr, v) end
  elseif kind == "userdata" then
    if debug.getfenv(v) == nil then return cast(void_ptr, v) end -- a full userdata always has an environment
  elseif kind == "cdata" and not istype(Handle, v) then
    if istype(int64_ct, v) or istype(uint64_ct, v) then
      if v >= 0 then return cast(void_ptr, v) end
    elseif tostring(ffi.typeof(v)):find("[%*%]]>$") then -- "ctype<float *>", "ctype<float [4]>"
      return cast(void_ptr, v)
    end
  end
  arg_error(fname, 1, "%s must be an integer >= 0 or a light userdata, got %s", what,
    (kind == "cdata" and not istype(Handle, v)) and tostring(v) or got_value(v))
end

-- ---------------------------------------------------------------- tensor handles

-- A handle, being cdata, holds Lua values by a key into a table: a view's owner (`owners`, so
-- that the owner's memory outlives the view) and what an owner's memory needs kept alive
-- (`keeps`: moe.wrap's keep).  A key goes back to its free list when its entry goes, so that keys
-- stay few and small (the table's array part); entries are set false, never nil, for its length.
local owners, free_owner_keys = {}, {}
local keeps, free_keep_keys = {}, {}

local function key_put(slots, free, v)
  local n = #free
  local key = free[n]
  if key then free[n] = nil else key = #slots + 1 end
  slots[key] = v
  return key
end

local function key_drop(slots, free, key)
  slots[key] = false
  free[#free + 1] = key
end

local pins = nil -- the capture under way's pinned owners (and exchanges), as a set

local function owner_of(u)
  local key = u.h_owner
  if key ~= 0 then return owners[key] end
  return u
end

-- Pins the owner of u into the capture under way, if any.
local function pin(u)
  if pins then
    local o = owner_of(u)
    if not pins[o] then
      pins[o] = true
      o.h_pins = o.h_pins + 1
    end
  end
end

-- The owner's memory goes with its last handle, owner or view, and its keep with it.
local function release_owner(o)
  if o.h_closed ~= 0 and o.h_views == 0 and o.h_pins == 0 then
    if o.h_t ~= nil then
      lib.moe_tensor_free(o.h_t)
      o.h_t = nil
    end
    if o.h_keep ~= 0 then
      key_drop(keeps, free_keep_keys, o.h_keep)
      o.h_keep = 0
    end
  end
end

-- __gc, __close and close(): frees once, never raises.
local function t_release(u)
  if not istype(Handle, u) or u.h_closed ~= 0 then return end
  u.h_closed = 1
  local key = u.h_owner
  if key ~= 0 then
    local o = owners[key]
    key_drop(owners, free_owner_keys, key)
    lib.moe_tensor_free(u.h_t)
    u.h_t = nil
    if o then
      o.h_views = o.h_views - 1
      release_owner(o)
    end
  else
    release_owner(u)
  end
end

local function unpin_all(set)
  for o in pairs(set) do
    if istype(Handle, o) then
      o.h_pins = o.h_pins - 1
      release_owner(o)
    end
  end
end

-- Caches the tensor's dtype, shape and device in its handle: they never change.
local function fill_meta(u)
  local t = u.h_t
  u.h_dtype = lib.moe_tensor_dtype(t)
  local nd = lib.moe_tensor_ndim(t)
  u.h_ndim = nd
  for i = 0, nd - 1 do u.h_dims[i] = tonumber(lib.moe_tensor_dim(t, i)) end
  local d = lib.moe_tensor_device(t)
  u.h_kind, u.h_index = d.kind, d.index
  return u
end

local tensor_out = new("moe_tensor *[1]")

-- An owner's handle made before its tensor (pinned into a capture under way), and its field h_t as
-- the out parameter of the call that makes the tensor (out_of): what the library hands over is
-- the handle's the moment the call returns, with nothing between that could raise (a DLPack
-- tensor the library took is its to release, never the caller's too).
local function new_owner()
  local u = Handle()
  pin(u)
  return u
end
local tensor_ref = ffi.typeof("moe_tensor **")
local function out_of(u) return cast(tensor_ref, u) end -- h_t is the handle's first field

-- A handle for the tensor the last call put in tensor_out (pinned into a capture under way when
-- it owns its memory).
local function adopt(owner)
  local t = tensor_out[0] -- before the allocation, which may run a finaliser
  local u = Handle()
  u.h_t = t
  fill_meta(u)
  if owner then pin(u) end
  return u
end

local function is_open(u) return u.h_closed == 0 and u.h_t ~= nil end

-- The open tensor v (pinned into a capture under way), or nil.
local function test_tensor(v)
  if istype(Handle, v) and v.h_closed == 0 and v.h_t ~= nil then
    pin(v)
    return v
  end
  return nil
end

local function check_tensor(fname, arg, v, method)
  local u = test_tensor(v)
  if u then return u end
  if not istype(Handle, v) then typeerror(fname, arg, "moelab.Tensor", v, method) end
  argerror(fname, arg, "moelab.Tensor is closed", method)
end

-- The self of a method `fname` of a `var` ("t") is not a tname: called with '.' where ':' was
-- meant, the first argument is something else, and the message says so.
local function self_error(fname, v, tname, var)
  arg_error(fname, 1, "expected a %s as self, got %s: call it as %s:%s(...), with a colon", tname,
    v == nil and "no value" or got_value(v), var, fname)
end

-- The open tensor a method is called on.
local function self_tensor(fname, u)
  if not istype(Handle, u) then self_error(fname, u, "moelab.Tensor", "t") end
  return check_tensor(fname, 1, u, true)
end

-- Lua code that ran while the arguments were taken (an __index of an argument table, a
-- finalizer) may have closed one already taken: checked just before the library is called.
local function still_open(fname, u)
  if u and not is_open(u) then
    arg_error(fname, 1, "a moelab.Tensor of the arguments was closed while they were being read")
  end
end

local function shape_table(u)
  local s = {}
  for i = 1, u.h_ndim do s[i] = u.h_dims[i - 1] end
  return s
end

-- ---------------------------------------------------------------- tensor methods

local methods = {}
M.Tensor = methods -- the front-end may add methods written in Lua

local PROPERTIES = { shape = true, dtype = true, device = true, ndim = true, closed = true }

local function t_index(u, k)
  local m = methods[k]
  if m ~= nil then return m end
  -- t[i] is not an element: a tensor may live on a GPU, and a read per element would hide a copy
  -- each.  Saying so beats the nil that would fail later, far from here.
  if type(k) ~= "string" then
    error(format("moelab.Tensor has no elements by index (t[%s]): t:get(i) reads element i (1-based, flat), "
      .. "t:select(i) is a view of row i, t:flat() and t:totable() read it all", got_value(k)), 2)
  end
  if not PROPERTIES[k] then return nil end
  if k == "closed" then return u.h_closed ~= 0 or u.h_t == nil end -- readable after closing: it is how a caller asks
  if u.h_closed ~= 0 or u.h_t == nil then error(format("attempt to read '%s' of a closed moelab.Tensor", k), 2) end
  if k == "shape" then return shape_table(u) end
  if k == "dtype" then return DTYPES[u.h_dtype + 1] end
  if k == "device" then return device_name(u.h_kind, u.h_index) end
  return u.h_ndim
end

local function t_tostring(u)
  if u.h_closed ~= 0 or u.h_t == nil then return "moelab.Tensor(closed)" end
  local dims = {}
  for i = 1, u.h_ndim do dims[i] = format("%d", u.h_dims[i - 1]) end
  return format("moelab.Tensor(%s [%s] on %s)", DTYPES[u.h_dtype + 1], table.concat(dims, ", "),
    device_name(u.h_kind, u.h_index))
end

-- Nothing is set on a tensor: its fields are its shape, dtype and device, its values the device's.
-- (The handle's own fields, h_*, are the struct's: the FFI sets them without asking.)
local function t_newindex(_, k)
  if type(k) ~= "string" then
    error(format("moelab.Tensor cannot be assigned by index (t[%s] = ...): t:copy(u) and t:fill(v) write it",
      got_value(k)), 2)
  end
  error(format("moelab.Tensor has no field to set ('%s'): its shape, dtype and device are fixed; t:copy(u), "
    .. "t:fill(v) and t:randn(seed, std) write its values", k), 2)
end

Handle = ffi.metatype("moelab_tensor_handle", { __index = t_index, __newindex = t_newindex, __tostring = t_tostring,
  __gc = t_release, __close = t_release, __name = "moelab.Tensor" })

local function numel(u)
  local n = 1
  for i = 0, u.h_ndim - 1 do n = n * u.h_dims[i] end
  return n
end

local ELEMENT = { "float[?]", "uint16_t[?]", "int32_t[?]", "uint8_t[?]" }
local ELEMENT_PTR = { ffi.typeof("float *"), ffi.typeof("uint16_t *"), ffi.typeof("int32_t *"), ffi.typeof("uint8_t *") }
local bf16_to_f32, e4m3_to_f32 = lib.moe_bf16_to_f32, lib.moe_e4m3_to_f32

-- The whole tensor read into a host buffer of its dtype (a copy: a finalizer run while the
-- tables are built may close the tensor) -> the buffer, numel, dtype.
local function read_all(fname, u)
  self_tensor(fname, u)
  local n, dtype = numel(u), u.h_dtype
  local buf = new(ELEMENT[dtype + 1], n > 0 and n or 1)
  u = check_tensor(fname, 1, u, true) -- again: the allocation may have run a finalizer
  local rc = lib.moe_tensor_read(ctx, u.h_t, buf, n * DTYPE_SIZE[dtype + 1])
  if rc ~= 0 then fail(rc) end
  return buf, n, dtype
end

local function element(buf, dtype, i)
  if dtype == 1 then return bf16_to_f32(buf[i]) end
  if dtype == 3 then return e4m3_to_f32(buf[i]) end
  return tonumber(buf[i])
end

local function build_table(buf, dtype, dims, ndim, level, pos)
  local n = dims[level]
  local t = {}
  if level + 1 == ndim then
    for i = 1, n do t[i] = element(buf, dtype, pos + i - 1) end
    return t, pos + n
  end
  for i = 1, n do t[i], pos = build_table(buf, dtype, dims, ndim, level + 1, pos) end
  return t, pos
end

function methods.totable(u)
  local dims = {}
  if istype(Handle, u) and is_open(u) then for i = 0, u.h_ndim - 1 do dims[i] = u.h_dims[i] end end
  local buf, n, dtype = read_all("totable", u)
  local ndim = u.h_ndim
  -- the nested tables of an empty tensor hold nothing, but there can be 2^40 of them ([2^20, 2^20, 0])
  local tables, level = 1, 1
  for i = 0, ndim - 2 do
    level = level * dims[i]
    tables = tables + level
  end
  if n == 0 and tables > 2 ^ 24 then
    error(format("totable: the tensor has no elements, but its shape would make %d nested tables", tables), 2)
  end
  if ndim == 0 then return element(buf, dtype, 0) end
  return (build_table(buf, dtype, dims, ndim, 0, 0))
end

function methods.flat(u)
  local buf, n, dtype = read_all("flat", u)
  local t = {}
  for i = 1, n do t[i] = element(buf, dtype, i - 1) end
  return t
end

local one = new("union { float f; uint16_t h; int32_t i; uint8_t q; }")
local view_out = new("moe_tensor *[1]")

function methods.get(u, i)
  u = self_tensor("get", u)
  check_integer("get", 2, i, true)
  local n = numel(u)
  if i < 1 or i > n then argerror("get", 2, format("index %d out of range [1, %d]", i, n), true) end
  local dtype = u.h_dtype
  if u.h_kind == 0 then
    return element(cast(ELEMENT_PTR[dtype + 1], lib.moe_tensor_data(u.h_t)), dtype, i - 1)
  end
  -- one element through a temporary view; nothing here can raise until it is freed
  local rc = lib.moe_tensor_view(ctx, u.h_t, i - 1, 0, nil, view_out)
  if rc == 0 then rc = lib.moe_tensor_read(ctx, view_out[0], one, DTYPE_SIZE[dtype + 1]) end
  lib.moe_tensor_free(view_out[0])
  view_out[0] = nil
  if rc ~= 0 then fail(rc) end
  if dtype == 0 then return tonumber(one.f) end
  if dtype == 1 then return bf16_to_f32(one.h) end
  if dtype == 3 then return e4m3_to_f32(one.q) end
  return tonumber(one.i)
end

function methods.to(u, dev)
  u = self_tensor("to", u)
  local d = check_device("to", 2, dev, true)
  local nd = u.h_ndim
  for i = 0, nd - 1 do shape_buf[i] = u.h_dims[i] end
  local rc = lib.moe_tensor_new(ctx, u.h_dtype, nd, shape_buf, d, tensor_out)
  -- an absent device, named as t:to's argument rather than by the tensor made for it
  if rc == 1 or rc == 4 then stage_fail_as(rc, "to", "tensor", "device ") end
  if rc ~= 0 then fail(rc) end
  local v = adopt(true)
  rc = lib.moe_tensor_copy(ctx, v.h_t, u.h_t)
  if rc ~= 0 then fail(rc) end
  return v
end

function methods.copy(u, src)
  u = self_tensor("copy", u)
  src = check_tensor("copy", 2, src, true)
  still_open("copy", u) -- pinning src into a capture may have run a finalizer
  local rc = lib.moe_tensor_copy(ctx, u.h_t, src.h_t)
  if rc ~= 0 then stage_fail(rc, "copy", "tensor_copy") end
  return u
end

function methods.fill(u, v)
  u = self_tensor("fill", u)
  check_number("fill", 2, v, true)
  local rc = lib.moe_tensor_fill(ctx, u.h_t, v)
  if rc ~= 0 then stage_fail(rc, "fill", "fill") end
  return u
end

function methods.randn(u, seed, std)
  u = self_tensor("randn", u)
  check_integer("randn", 2, seed, true)
  if std == nil then std = 1.0 else check_number("randn", 3, std, true) end
  local rc = lib.moe_tensor_randn(ctx, u.h_t, seed, std)
  if rc ~= 0 then fail(rc) end
  return u
end

-- A view of u over [offset, offset + prod(shape_buf[0..nd))).
local function push_view(u, offset, nd)
  local v = Handle()
  u = check_tensor("view", 1, u, true) -- again after the allocation, whose collection step may have run a finalizer
  local o = owner_of(u)
  v.h_owner = key_put(owners, free_owner_keys, o)
  o.h_views = o.h_views + 1 -- counted with the link, so that releasing v undoes exactly this
  local rc = lib.moe_tensor_view(ctx, u.h_t, offset, nd, shape_buf, tensor_out)
  if rc ~= 0 then
    t_release(v)
    fail(rc)
  end
  v.h_t = tensor_out[0]
  -- a view has its base's dtype and device, and the shape asked for
  v.h_dtype, v.h_kind, v.h_index, v.h_ndim = u.h_dtype, u.h_kind, u.h_index, nd
  for i = 0, nd - 1 do v.h_dims[i] = tonumber(shape_buf[i]) end
  return v
end

function methods.view(u, offset, shape)
  self_tensor("view", u)
  check_integer("view", 2, offset, true)
  local nd = check_shape("view", 3, shape, true)
  return push_view(u, offset, nd)
end

function methods.select(u, i)
  u = self_tensor("select", u)
  check_integer("select", 2, i, true)
  local nd = u.h_ndim
  if nd == 0 then argerror("select", 1, "cannot select from a 0-dimensional tensor", true) end
  local n = u.h_dims[0]
  if i < 1 or i > n then argerror("select", 2, format("index %d out of range [1, %d]", i, n), true) end
  local inner = 1
  for d = 1, nd - 1 do
    shape_buf[d - 1] = u.h_dims[d]
    inner = inner * u.h_dims[d]
  end
  return push_view(u, (i - 1) * inner, nd - 1)
end

function methods.numel(u) return numel(self_tensor("numel", u)) end

function methods.nbytes(u)
  u = self_tensor("nbytes", u)
  return numel(u) * DTYPE_SIZE[u.h_dtype + 1]
end

function methods.address(u) return lib.moe_tensor_data(self_tensor("address", u).h_t) end

-- u:overlaps(v): whether the two share a byte (same device, intersecting address ranges).
function methods.overlaps(u, v)
  u = self_tensor("overlaps", u)
  v = check_tensor("overlaps", 2, v, true)
  if u.h_kind ~= v.h_kind or (u.h_kind ~= 0 and u.h_index ~= v.h_index) then return false end
  local pa = tonumber(cast("uintptr_t", lib.moe_tensor_data(u.h_t)))
  local pb = tonumber(cast("uintptr_t", lib.moe_tensor_data(v.h_t)))
  local na, nb = numel(u) * DTYPE_SIZE[u.h_dtype + 1], numel(v) * DTYPE_SIZE[v.h_dtype + 1]
  return na > 0 and nb > 0 and pa < pb + nb and pb < pa + na
end

methods.close = t_release -- what a <close> variable does on Lua 5.4

-- ---------------------------------------------------------------- tensors, devices, options

local count_out = new("int[1]")
local KINDS = { "cpu", "cuda" }

function M.device_count(kind)
  local k = check_option("device_count", 1, kind, KINDS) == 1 and 0 or 1
  local rc = lib.moe_device_count(ctx, k, count_out)
  if rc ~= 0 then fail(rc) end
  return count_out[0]
end

-- device_info(device) -> moe_device_info's report, "key: value" lines.
local info_report = new("char[1024]")
function M.device_info(dev)
  local d = check_device("device_info", 1, dev)
  local rc = lib.moe_device_info(ctx, d, info_report, 1024)
  if rc ~= 0 then fail(rc) end
  return string_(info_report)
end

-- device_memory(device) -> free, total: bytes the device can still hold, and has.
local free_out, total_out = new("size_t[1]"), new("size_t[1]")
function M.device_memory(dev)
  local rc = lib.moe_device_memory(ctx, check_device("device_memory", 1, dev), free_out, total_out)
  if rc ~= 0 then fail(rc) end
  return tonumber(free_out[0]), tonumber(total_out[0])
end

-- config(option) -> value; config(option, value) sets it (moe_ctx_config).
function M.config(option, value)
  option = check_string("config", 1, option)
  if value ~= nil then
    local rc = lib.moe_ctx_config(ctx, option, check_string("config", 2, value))
    if rc ~= 0 then fail(rc) end
  end
  local v = lib.moe_ctx_config_value(ctx, option)
  if v == nil then argerror("config", 1, format("no option '%s'", option)) end
  return string_(v)
end

function M.new(dtype, shape, dev)
  local dt = check_option("new", 1, dtype, DTYPES) - 1
  local nd = check_shape("new", 2, shape)
  local d = dev == nil and check_device("new", 3, "cpu") or check_device("new", 3, dev)
  local rc = lib.moe_tensor_new(ctx, dt, nd, shape_buf, d, tensor_out)
  if rc ~= 0 then fail(rc) end
  local u = adopt(true)
  -- host memory comes zeroed; device memory is zeroed here
  if d.kind ~= 0 then
    rc = lib.moe_tensor_fill(ctx, u.h_t, 0)
    if rc ~= 0 then fail(rc) end
  end
  return u
end

-- from_table: a checking pass (buf nil) and a filling pass over the same walk, so that a ragged
-- table never sizes an allocation.
local function data_error(fmt, ...) arg_error("tensor", 1, fmt, ...) end

local function path_string(path, depth)
  local s = {}
  for i = 1, depth do s[i] = format("[%d]", path[i]) end
  return table.concat(s)
end

local function element_name(path, depth)
  if depth == 0 then return "value" end
  return "element " .. path_string(path, depth)
end

local f32_to_bf16, f32_to_e4m3 = lib.moe_f32_to_bf16, lib.moe_f32_to_e4m3

local function put_number(f, v, depth)
  if type(v) ~= "number" then data_error("%s %s, expected a number", element_name(f.path, depth), is_what(v, false)) end
  local pos = f.pos
  if f.dtype == 2 then
    if not is_integer(v) then
      data_error("%s %s, expected an integer for dtype i32", element_name(f.path, depth), is_what(v, true))
    end
    if v < -2 ^ 31 or v > 2 ^ 31 - 1 then
      data_error("%s is %d, outside the range of i32", element_name(f.path, depth), v)
    end
    if f.buf then f.buf[pos] = v end
  elseif f.buf then
    -- rounded to f32 first (the C cast of the call), as moe_tensor_fill rounds
    f.buf[pos] = f.dtype == 0 and v or f.dtype == 3 and f32_to_e4m3(v) or f32_to_bf16(v)
  end
  f.pos = pos + 1
end

local function walk(f, t, level)
  local n = #t
  if n ~= f.shape[level + 1] then
    data_error("ragged nested table at %s: expected %d elements, got %d", path_string(f.path, level),
      f.shape[level + 1], n)
  end
  local path = f.path
  if level + 1 < f.ndim then
    for i = 1, n do
      path[level + 1] = i
      local v = rawget(t, i)
      if type(v) ~= "table" then
        data_error("%s %s, expected a table", element_name(path, level + 1), is_what(v, false))
      end
      walk(f, v, level + 1)
    end
  else
    for i = 1, n do
      path[level + 1] = i
      put_number(f, rawget(t, i), level + 1)
    end
  end
end

function M.from_table(data, dtype, dev, shape)
  local dt = check_option("from_table", 2, dtype, DTYPES) - 1
  local d = dev == nil and check_device("from_table", 3, "cpu") or check_device("from_table", 3, dev)
  local f = { dtype = dt, path = {}, pos = 0, ndim = 0, shape = {} }
  local dims, nd, n = {}, 0, 1
  if shape ~= nil then
    nd = check_shape("from_table", 4, shape)
    for i = 1, nd do
      local s = shape[i]
      if s > 0 and n > 2 ^ 40 / s then argerror("from_table", 4, "shape has more than 2^40 elements") end
      n = n * s
      dims[i] = s
    end
    if type(data) ~= "table" then data_error("expected a flat table of numbers, got %s", type_name(data)) end
    if #data ~= n then data_error("expected %d numbers for the shape given, got %d", n, #data) end
    f.ndim, f.shape = 1, { n }
  elseif type(data) == "table" then
    -- the shape from the first element of every level; walk() checks the rest against it
    local t = data
    while type(t) == "table" do
      if nd == 4 then data_error("nested deeper than %d levels", 4) end
      local len = #t
      nd = nd + 1
      dims[nd] = len
      if len == 0 then break end
      t = rawget(t, 1)
    end
    for i = 1, nd do
      if dims[i] > 0 and n > 2 ^ 40 / dims[i] then data_error("more than 2^40 elements") end
      n = n * dims[i]
    end
    f.ndim, f.shape = nd, dims
  elseif type(data) ~= "number" then
    data_error("expected a number or a nested table of numbers, got %s", type_name(data))
  end
  if f.ndim > 0 then
    walk(f, data, 0) -- checks only: f.buf is nil
    f.buf, f.pos = new(ELEMENT[dt + 1], n > 0 and n or 1), 0
    walk(f, data, 0)
  else
    f.buf = new(ELEMENT[dt + 1], 1)
    put_number(f, data, 0)
  end
  for i = 1, nd do shape_buf[i - 1] = dims[i] end
  local rc = lib.moe_tensor_new(ctx, dt, nd, shape_buf, d, tensor_out)
  if rc ~= 0 then fail(rc) end
  local u = adopt(true)
  rc = lib.moe_tensor_write(ctx, u.h_t, f.buf, n * DTYPE_SIZE[dt + 1])
  if rc ~= 0 then fail(rc) end
  return u
end

function M.is_tensor(v) return istype(Handle, v) end

function M.synchronize(dev)
  local rc = lib.moe_ctx_synchronize(ctx, check_device("synchronize", 1, dev))
  if rc ~= 0 then fail(rc) end
end

-- ---------------------------------------------------------------- memory another library owns

-- wrap(address, dtype, shape, device, keep): a tensor over the caller's memory; keep (any value)
-- lives as long as the tensor's memory is in use (views and graphs included).
function M.wrap(address, dtype, shape, dev, keep)
  local data = check_address("wrap", "option 'address'", address)
  local dt = check_option("wrap", 2, dtype, DTYPES) - 1
  local nd = check_shape("wrap", 3, shape)
  local d = check_device("wrap", 4, dev == nil and "cpu" or dev)
  local u = new_owner()
  if keep ~= nil then u.h_keep = key_put(keeps, free_keep_keys, keep) end
  local rc = lib.moe_tensor_wrap(ctx, data, dt, nd, shape_buf, d, out_of(u))
  if rc ~= 0 then stage_fail(rc, "wrap", "wrap") end
  return fill_meta(u)
end

-- from_dlpack(address, versioned): a tensor that owns the DLManagedTensor (or, versioned, the
-- DLManagedTensorVersioned) at address; on an error the caller still owns it.  The structures
-- pass as opaque pointers (the header declares them so): the library alone reads them.
function M.from_dlpack(address, versioned)
  local managed = check_address("from_dlpack", "the managed tensor's address", address)
  local u = new_owner()
  local rc
  if versioned then rc = lib.moe_tensor_from_dlpack_versioned(ctx, managed, out_of(u))
  else rc = lib.moe_tensor_from_dlpack(ctx, managed, out_of(u)) end
  if rc ~= 0 then stage_fail(rc, "from_dlpack", "from_dlpack") end
  return fill_meta(u)
end

-- to_dlpack(t, versioned) -> the address of a new DLManagedTensor (DLManagedTensorVersioned) over
-- t's memory, as an integer: its consumer calls its deleter.
local managed_out = new("struct DLManagedTensor *[1]")
local versioned_out = new("struct DLManagedTensorVersioned *[1]")
function M.to_dlpack(t, versioned)
  t = check_tensor("to_dlpack", 1, t)
  local rc, out
  if versioned then
    out = versioned_out
    rc = lib.moe_tensor_to_dlpack_versioned(ctx, t.h_t, out)
  else
    out = managed_out
    rc = lib.moe_tensor_to_dlpack(ctx, t.h_t, out)
  end
  if rc ~= 0 then fail(rc) end
  return tonumber(cast("uintptr_t", out[0]))
end

-- ---------------------------------------------------------------- stage arguments

local REQUIRED, OPTIONAL = false, true

local function args_open(o, fname)
  if type(o) ~= "table" then arg_error(fname, 1, "table expected, got %s", type_name(o)) end
  return o
end

local function tensor_at(fname, v, field)
  local u = test_tensor(v)
  if u then return u end
  if not istype(Handle, v) then
    arg_error(fname, 1, "field '%s': expected moelab.Tensor, got %s", field, type_name(v))
  end
  arg_error(fname, 1, "field '%s': moelab.Tensor is closed", field)
end

local function tensor_field(o, fname, field, optional)
  local v = o[field]
  if v == nil and optional then return nil end
  return tensor_at(fname, v, field)
end

local function int_field(o, fname, field, optional, dflt)
  local v = o[field]
  if v == nil and optional then return dflt end
  if not is_integer(v) then arg_error(fname, 1, "field '%s': expected an integer, got %s", field, got_value(v)) end
  if v < -2 ^ 31 or v > 2 ^ 31 - 1 then
    arg_error(fname, 1, "field '%s': %d is outside the range of a C int", field, v)
  end
  return v
end

local function number_field(o, fname, field, dflt)
  local v = o[field]
  if v == nil then return dflt end
  if type(v) ~= "number" then arg_error(fname, 1, "field '%s': expected a number, got %s", field, type_name(v)) end
  return v
end

local function bool_field(o, fname, field)
  local v = o[field]
  if v == nil then return false end
  if type(v) ~= "boolean" then arg_error(fname, 1, "field '%s': expected a boolean, got %s", field, got_value(v)) end
  return v
end

-- The 0-based index of the field's string in names (nil: 0); expected spells the choices.
local function option_field(o, fname, field, names, expected)
  local v = o[field]
  if v == nil then return 0 end
  if type(v) == "string" then
    for i = 1, #names do if names[i] == v then return i - 1 end end
    arg_error(fname, 1, "field '%s': expected %s, got '%s'", field, expected, v)
  end
  arg_error(fname, 1, "field '%s': expected %s, got %s", field, expected, type_name(v))
end

-- A table of exactly `world` tensors -> a C array, and the handles (kept for still_open).
local function tensors_field(o, fname, field, world)
  local t = o[field]
  if type(t) ~= "table" then
    arg_error(fname, 1, "field '%s': expected a table of %d moelab.Tensor (one per rank), got %s", field, world,
      type_name(t))
  end
  local n = #t
  if n ~= world then arg_error(fname, 1, "field '%s': expected %d tensors (world), got %d", field, world, n) end
  local arr, handles = new("const moe_tensor *[?]", world), {}
  for i = 1, world do
    local v = rawget(t, i)
    local u = test_tensor(v) or tensor_at(fname, v, format("%s[%d]", field, i))
    arr[i - 1], handles[i] = u.h_t, u
  end
  return arr, handles
end

local function world_field(o, fname)
  local w = int_field(o, fname, "world", REQUIRED, 0)
  if w < 1 then arg_error(fname, 1, "field 'world': expected a positive integer, got %d", w) end
  return w
end

local function all_open(fname, handles)
  for i = 1, #handles do still_open(fname, handles[i]) end
end

-- tensor_field of each field, in order -> the tensors (nil: an OPTIONAL one left out).  Values
-- returned rather than a table: a stage call allocates nothing it need not.
local function tensor_fields(o, fname, optional, field, ...)
  if field == nil then return end
  local u = tensor_field(o, fname, field, optional)
  return u, tensor_fields(o, fname, optional, ...)
end

-- still_open of each argument, in order (nil: an optional tensor left out).
local function each_open(fname, ...)
  for i = 1, select("#", ...) do still_open(fname, (select(i, ...))) end
end

local function ptr(u) return u and u.h_t or nil end

-- ---------------------------------------------------------------- stages

local SCORINGS = { "softmax", "sigmoid", "sqrtsoftplus" }
local LAYOUTS = { "roundrobin", "peer_major" }

local route_args = ffi.typeof("moe_route_args")
function M.route(o)
  args_open(o, "route")
  local ids, weights = tensor_fields(o, "route", REQUIRED, "ids", "weights")
  local stats = tensor_field(o, "route", "stats", OPTIONAL)
  local logits = tensor_field(o, "route", "logits", REQUIRED)
  local bias = tensor_field(o, "route", "bias", OPTIONAL)
  local k = int_field(o, "route", "k", REQUIRED, 0)
  local scoring = option_field(o, "route", "scoring", SCORINGS, "'softmax', 'sigmoid' or 'sqrtsoftplus'")
  local groups = int_field(o, "route", "groups", OPTIONAL, 1)
  local topk_groups = int_field(o, "route", "topk_groups", OPTIONAL, groups)
  local scale = number_field(o, "route", "scale", 1.0)
  each_open("route", ids, weights, stats, logits, bias)
  local a = route_args(ids.h_t, weights.h_t, ptr(stats), logits.h_t, ptr(bias), k, scoring, groups, topk_groups, scale)
  local rc = lib.moe_route(ctx, a)
  if rc ~= 0 then stage_fail(rc, "route", "route") end
end

-- schedule{...} runs the stage; schedule_explain{...} takes the same fields and returns
-- moe_schedule_explain's report (which kernel the call would run, and why) without running it.
local schedule_args = ffi.typeof("moe_schedule_args")
local SCHEDULE_TENSORS = { "peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets", "route_row",
  "stats", "ids" }
local explain_report = new("char[2048]")
-- An explain call's end: its report, or the stage's error.
local function explained(rc, fname, stage)
  if rc ~= 0 then stage_fail(rc, fname, stage) end
  return string_(explain_report)
end

local function schedule_call(o, name, explain)
  args_open(o, name)
  local h = {}
  for i = 1, #SCHEDULE_TENSORS do h[i] = tensor_field(o, name, SCHEDULE_TENSORS[i], REQUIRED) end
  local experts = int_field(o, name, "experts", REQUIRED, 0)
  local rank = int_field(o, name, "rank", REQUIRED, 0)
  local pad = int_field(o, name, "pad", OPTIONAL, 1)
  local capacity = int_field(o, name, "capacity", REQUIRED, 0)
  local expert_capacity = int_field(o, name, "expert_capacity", OPTIONAL, -1)
  local layout = option_field(o, name, "layout", LAYOUTS, "'roundrobin' or 'peer_major'")
  all_open(name, h)
  local a = schedule_args(h[1].h_t, h[2].h_t, h[3].h_t, h[4].h_t, h[5].h_t, h[6].h_t, h[7].h_t, h[8].h_t, experts, rank,
    pad, capacity, expert_capacity, layout)
  if explain then
    return explained(lib.moe_schedule_explain(ctx, a, explain_report, 1024), name, "schedule")
  end
  local rc = lib.moe_schedule(ctx, a)
  if rc ~= 0 then stage_fail(rc, name, "schedule") end
end

function M.schedule(o) schedule_call(o, "schedule", false) end
function M.schedule_explain(o) return schedule_call(o, "explain", true) end

local dispatch_args = ffi.typeof("moe_dispatch_args")
function M.dispatch(o)
  args_open(o, "dispatch")
  local out, x, peer_rank, peer_route = tensor_fields(o, "dispatch", REQUIRED, "out", "x", "peer_rank", "peer_route")
  local k = int_field(o, "dispatch", "k", REQUIRED, 0)
  local zero_fill = bool_field(o, "dispatch", "zero_fill")
  each_open("dispatch", out, x, peer_rank, peer_route)
  local a = dispatch_args(out.h_t, x.h_t, peer_rank.h_t, peer_route.h_t, k, zero_fill and 1 or 0)
  local rc = lib.moe_dispatch(ctx, a)
  if rc ~= 0 then stage_fail(rc, "dispatch", "dispatch") end
end

local dispatch_fp8_args = ffi.typeof("moe_dispatch_fp8_args")
function M.dispatch_fp8(o)
  local f = "dispatch_fp8"
  args_open(o, f)
  local out, out_scale, x, x_scale, peer_rank, peer_route = tensor_fields(o, f, REQUIRED, "out", "out_scale", "x",
    "x_scale", "peer_rank", "peer_route")
  local k = int_field(o, f, "k", REQUIRED, 0)
  local zero_fill = bool_field(o, f, "zero_fill")
  each_open(f, out, out_scale, x, x_scale, peer_rank, peer_route)
  local a = dispatch_fp8_args(out.h_t, out_scale.h_t, x.h_t, x_scale.h_t, peer_rank.h_t, peer_route.h_t, k,
    zero_fill and 1 or 0)
  local rc = lib.moe_dispatch_fp8(ctx, a)
  if rc ~= 0 then stage_fail(rc, f, f) end
end

-- quantize{q =, scale =, x =, kind =} and dequantize{x =, q =, scale =, kind =} (moe_quant_kind's order).
local QUANT_KINDS = { "block", "token", "token_t" }
local function quant_call(o, name, quantize)
  args_open(o, name)
  local q, scale, x = tensor_fields(o, name, REQUIRED, "q", "scale", "x")
  local expected = "'block', 'token' or 'token_t'"
  if o.kind == nil then arg_error(name, 1, "field 'kind': expected %s, got nil", expected) end
  local kind = option_field(o, name, "kind", QUANT_KINDS, expected)
  each_open(name, q, scale, x)
  local rc
  if quantize then rc = lib.moe_quantize(ctx, q.h_t, scale.h_t, x.h_t, kind)
  else rc = lib.moe_dequantize(ctx, x.h_t, q.h_t, scale.h_t, kind) end
  if rc ~= 0 then stage_fail(rc, name, name) end
end
function M.quantize(o) quant_call(o, "quantize", true) end
function M.dequantize(o) quant_call(o, "dequantize", false) end

-- The table of experts{...} and experts_explain{...}.
local experts_args = ffi.typeof("moe_experts_args")
local function experts_fields(o, name)
  args_open(o, name)
  local out, x, offsets, w_gate_up, w_down = tensor_fields(o, name, REQUIRED, "out", "x", "offsets", "w_gate_up",
    "w_down")
  each_open(name, out, x, offsets, w_gate_up, w_down)
  return experts_args(out.h_t, x.h_t, offsets.h_t, w_gate_up.h_t, w_down.h_t)
end

function M.experts(o)
  local rc = lib.moe_experts(ctx, experts_fields(o, "experts"))
  if rc ~= 0 then stage_fail(rc, "experts", "experts") end
end

-- experts_explain{...} -> the report of moe_experts_explain: which kernel would run, and why.
function M.experts_explain(o)
  return explained(lib.moe_experts_explain(ctx, experts_fields(o, "explain"), explain_report, 2048), "explain",
    "experts")
end

-- The table of experts_fp8{...} and experts_fp8_explain{...}.
local experts_fp8_args = ffi.typeof("moe_experts_fp8_args")
local function experts_fp8_fields(o, name)
  args_open(o, name)
  local out, x, x_scale, offsets, w_gate_up, w_gate_up_scale, w_down, w_down_scale = tensor_fields(o, name, REQUIRED,
    "out", "x", "x_scale", "offsets", "w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale")
  each_open(name, out, x, x_scale, offsets, w_gate_up, w_gate_up_scale, w_down, w_down_scale)
  return experts_fp8_args(out.h_t, x.h_t, x_scale.h_t, offsets.h_t, w_gate_up.h_t, w_gate_up_scale.h_t, w_down.h_t,
    w_down_scale.h_t)
end

function M.experts_fp8(o)
  local rc = lib.moe_experts_fp8(ctx, experts_fp8_fields(o, "experts_fp8"))
  if rc ~= 0 then stage_fail(rc, "experts_fp8", "experts_fp8") end
end

-- experts_fp8_explain{...} -> the report of moe_experts_fp8_explain.
function M.experts_fp8_explain(o)
  return explained(lib.moe_experts_fp8_explain(ctx, experts_fp8_fields(o, "explain"), explain_report, 2048),
    "explain", "experts_fp8")
end

-- logits(out, x, w), sigmoid_gate(g, x, w) and nonfinite(stats, t): n tensors (2 or 3), as the C
-- module takes them.
local function tensor_args(fname, n, a, b, c)
  a, b = check_tensor(fname, 1, a), check_tensor(fname, 2, b)
  if n == 3 then c = check_tensor(fname, 3, c) end
  still_open(fname, a) -- pinning one into a capture may have run a finalizer
  still_open(fname, b)
  still_open(fname, c)
  return a, b, c
end

function M.logits(out, x, w)
  out, x, w = tensor_args("logits", 3, out, x, w)
  local rc = lib.moe_logits(ctx, out.h_t, x.h_t, w.h_t)
  if rc ~= 0 then fail(rc) end
end

-- logits_explain(out, x, w) -> the report of moe_logits_explain: which path would run, and why.
function M.logits_explain(out, x, w)
  out, x, w = tensor_args("logits_explain", 3, out, x, w)
  local rc = lib.moe_logits_explain(ctx, out.h_t, x.h_t, w.h_t, explain_report, 2048)
  if rc ~= 0 then fail(rc) end
  return string_(explain_report)
end

function M.sigmoid_gate(g, x, w)
  g, x, w = tensor_args("sigmoid_gate", 3, g, x, w)
  local rc = lib.moe_sigmoid_gate(ctx, g.h_t, x.h_t, w.h_t)
  if rc ~= 0 then fail(rc) end
end

-- nonfinite(stats, t): stats i32 [2] = {NaN or infinite elements of t, the first or -1}.
function M.nonfinite(stats, t)
  stats, t = tensor_args("nonfinite", 2, stats, t)
  local rc = lib.moe_nonfinite(ctx, stats.h_t, t.h_t)
  if rc ~= 0 then fail(rc) end
end

local combine_args = ffi.typeof("moe_combine_args")
function M.combine(o)
  args_open(o, "combine")
  local out, weights, ids = tensor_fields(o, "combine", REQUIRED, "out", "weights", "ids")
  local world = world_field(o, "combine")
  local ys, ys_h = tensors_field(o, "combine", "ys", world)
  local rows, rows_h = tensors_field(o, "combine", "route_row", world)
  local experts = int_field(o, "combine", "experts", REQUIRED, 0)
  local rank = int_field(o, "combine", "rank", REQUIRED, 0)
  local shared, shared_gate = tensor_fields(o, "combine", OPTIONAL, "shared", "shared_gate")
  each_open("combine", out, weights, ids)
  all_open("combine", ys_h)
  all_open("combine", rows_h)
  each_open("combine", shared, shared_gate)
  local a = combine_args(out.h_t, weights.h_t, ids.h_t, ys, rows, world, experts, rank, ptr(shared), ptr(shared_gate))
  local rc = lib.moe_combine(ctx, a)
  if rc ~= 0 then stage_fail(rc, "combine", "combine") end
end

local reference_args = ffi.typeof("moe_reference_args")
function M.reference(o)
  args_open(o, "reference")
  local out, x, ids, weights = tensor_fields(o, "reference", REQUIRED, "out", "x", "ids", "weights")
  local world = world_field(o, "reference")
  local wgu, wgu_h = tensors_field(o, "reference", "w_gate_up", world)
  local wd, wd_h = tensors_field(o, "reference", "w_down", world)
  local experts = int_field(o, "reference", "experts", REQUIRED, 0)
  local sgu, sd, sgw = tensor_fields(o, "reference", OPTIONAL, "shared_gate_up", "shared_down", "shared_gate_w")
  each_open("reference", out, x, ids, weights)
  all_open("reference", wgu_h)
  all_open("reference", wd_h)
  each_open("reference", sgu, sd, sgw)
  local a = reference_args(out.h_t, x.h_t, ids.h_t, weights.h_t, wgu, wd, world, experts, ptr(sgu), ptr(sd), ptr(sgw))
  local rc = lib.moe_reference(ctx, a)
  if rc ~= 0 then stage_fail(rc, "reference", "reference") end
end

local reference_fp8_args = ffi.typeof("moe_reference_fp8_args")
function M.reference_fp8(o)
  local name = "reference_fp8"
  args_open(o, name)
  local out, x, ids, weights = tensor_fields(o, name, REQUIRED, "out", "x", "ids", "weights")
  local world = world_field(o, name)
  local wgu, wgu_h = tensors_field(o, name, "w_gate_up", world)
  local wgus, wgus_h = tensors_field(o, name, "w_gate_up_scale", world)
  local wd, wd_h = tensors_field(o, name, "w_down", world)
  local wds, wds_h = tensors_field(o, name, "w_down_scale", world)
  local experts = int_field(o, name, "experts", REQUIRED, 0)
  local sgu, sgus, sd, sds, sgw = tensor_fields(o, name, OPTIONAL, "shared_gate_up", "shared_gate_up_scale",
    "shared_down", "shared_down_scale", "shared_gate_w")
  each_open(name, out, x, ids, weights)
  all_open(name, wgu_h)
  all_open(name, wgus_h)
  all_open(name, wd_h)
  all_open(name, wds_h)
  each_open(name, sgu, sgus, sd, sds, sgw)
  local a = reference_fp8_args(out.h_t, x.h_t, ids.h_t, weights.h_t, wgu, wgus, wd, wds, world, experts, ptr(sgu),
    ptr(sgus), ptr(sd), ptr(sds), ptr(sgw))
  local rc = lib.moe_reference_fp8(ctx, a)
  if rc ~= 0 then stage_fail(rc, name, name) end
end

-- ---------------------------------------------------------------- timing, events, graphs

local ts, rem = new("moelab_timespec"), new("moelab_timespec")
local CLOCK_MONOTONIC = 1

function M.now()
  C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.sec) + tonumber(ts.nsec) * 1e-9
end

-- sleep(seconds): the thread sleeps (a rank waiting for the id file rank 0 writes)
function M.sleep(sec)
  check_number("sleep", 1, sec)
  if not (sec == sec and sec <= 1e9) then argerror("sleep", 1, "seconds must be a number up to 1e9") end
  if sec > 0 then
    ts.sec = floor(sec)
    ts.nsec = floor((sec - floor(sec)) * 1e9)
    while C.nanosleep(ts, rem) ~= 0 and ffi.errno() == 4 do -- EINTR: sleep what is left
      ts.sec, ts.nsec = rem.sec, rem.nsec
    end
  end
end

-- range_push(name), range_pop(): an NVTX range of the host's own around calls (moelab.h).
function M.range_push(name)
  local rc = lib.moe_range_push(ctx, check_string("range_push", 1, name))
  if rc ~= 0 then fail(rc) end
end

function M.range_pop()
  local rc = lib.moe_range_pop(ctx)
  if rc ~= 0 then fail(rc) end
end

-- An event, a graph, a world or an exchange: a table whose field `cell` (a one-pointer cdata)
-- holds the C object, freed by the cell's finalizer; nil there once freed.
local function class(name)
  local c = { __name = name, methods = {} }
  c.__index = c.methods
  return c
end

-- The __tostring of a class whose objects hold their C object in cell: its name, "(closed)" after.
local function cell_tostring(self)
  local name = getmetatable(self).__name
  return self.cell[0] ~= nil and name or name .. "(closed)"
end

local function object(cls, ctype, free)
  local cell = ffi.gc(new(ctype), function(p)
    if p[0] ~= nil then
      free(p[0])
      p[0] = nil
    end
  end)
  return setmetatable({ cell = cell }, cls)
end

local function close_object(self)
  local cell = rawget(self, "cell")
  if cell then ffi.gc(cell, nil) end
  return cell
end

-- The open object v of class cls; var names the self of an event's or a graph's method, whose
-- call with '.' says so (self_error).
local function check_object(fname, arg, v, cls, method, var)
  if getmetatable(v) ~= cls then
    if var then self_error(fname, v, cls.__name, var) end
    typeerror(fname, arg, cls.__name, v, method)
  end
  local p = v.cell[0]
  if p == nil then argerror(fname, arg, cls.__name .. " is closed", method) end
  return p
end

-- The method fname of cls (kind names its object in errors) that runs the C function cfunc on the
-- object's C object -> the object itself.
local function chained_method(fname, cls, kind, cfunc)
  return function(o)
    local rc = lib[cfunc](ctx, check_object(fname, 1, o, cls, true, kind))
    if rc ~= 0 then fail(rc) end
    return o
  end
end

local Event = class("moelab.Event")
function M.event_new(dev)
  local d = check_device("event_new", 1, dev)
  local e = object(Event, "moe_event *[1]", lib.moe_event_free)
  local rc = lib.moe_event_new(ctx, d, e.cell)
  if rc ~= 0 then fail(rc) end
  return e
end

Event.__tostring = cell_tostring
function Event:__close()
  local cell = close_object(self)
  if cell and cell[0] ~= nil then
    lib.moe_event_free(cell[0])
    cell[0] = nil
  end
end

Event.methods.record = chained_method("record", Event, "event", "moe_event_record")

local ms_out = new("float[1]")
-- stop:elapsed_since(start) -> milliseconds; waits for stop
function Event.methods.elapsed_since(stop, start)
  local ps = check_object("elapsed_since", 1, stop, Event, true, "event")
  local pa = check_object("elapsed_since", 2, start, Event, true)
  local rc = lib.moe_event_elapsed(ctx, pa, ps, ms_out)
  if rc ~= 0 then fail(rc) end
  return tonumber(ms_out[0])
end

local Graph = class("moelab.Graph")
function M.graph_begin(dev)
  local rc = lib.moe_graph_begin(ctx, check_device("graph_begin", 1, dev))
  if rc ~= 0 then fail(rc) end
  pins = {}
end

-- graph_end([keep]) -> Graph; keep (any value) is held by the graph as long as it lives, and so
-- are the capture's pins, undone with it.
function M.graph_end(keep)
  local set = pins or {}
  pins = nil
  -- the graph first, then its pins, undone with its cell
  local cell = ffi.gc(new("moe_graph *[1]"), function(p)
    if p[0] ~= nil then
      lib.moe_graph_free(p[0])
      p[0] = nil
    end
    unpin_all(set)
  end)
  local g = setmetatable({ cell = cell, keep = keep }, Graph)
  local rc = lib.moe_graph_end(ctx, g.cell)
  if rc ~= 0 then fail(rc) end
  return g
end

Graph.__tostring = cell_tostring
Graph.methods.replay = chained_method("replay", Graph, "graph", "moe_graph_replay")

-- ---------------------------------------------------------------- worlds

local World = class("moelab.World")
local Exchange = class("moelab.Exchange")

local function world_ptr(fname, w, method) return check_object(fname, 1, w, World, method) end

local function world_release(p)
  if ctx_open then lib.moe_world_unbind(ctx, p) end -- the context must not keep a stream about to go
  lib.moe_world_close(p)
end

local function new_world()
  return object(World, "moe_world *[1]", world_release)
end

function World.methods.close(w)
  if getmetatable(w) ~= World then return end
  local cell = close_object(w)
  if cell and cell[0] ~= nil then
    world_release(cell[0])
    cell[0] = nil
  end
end
World.__close = World.methods.close

function World:__tostring()
  local p = self.cell[0]
  if p == nil then return "moelab.World(closed)" end
  local size = lib.moe_world_size(p)
  local parts = { format("moelab.World(%d rank%s; here:", size, size == 1 and "" or "s") }
  for i = 0, lib.moe_world_local_count(p) - 1 do
    parts[#parts + 1] = format("%s rank %d on cuda:%d", i > 0 and "," or "", lib.moe_world_local_rank(p, i),
      lib.moe_world_local_device(p, i))
  end
  return table.concat(parts) .. ")"
end

local id_buf = new("char[257]")
function M.world_unique_id()
  local rc = lib.moe_world_unique_id(ctx, id_buf, 257)
  if rc ~= 0 then fail(rc) end
  return string_(id_buf)
end

function M.world_open_local(list)
  if type(list) ~= "table" then typeerror("world_open_local", 1, "table", list) end
  local n = #list
  if n < 1 then arg_error("world", 1, "option 'devices' must list at least one GPU") end
  local devs = new("int[?]", n)
  for i = 1, n do
    local v = tonumber(list[i]) -- as lua_tointegerx, which takes a numeric string
    if not is_integer(v) or v < 0 or v > 2 ^ 31 - 1 then
      arg_error("world", 1, "devices[%d] must be a GPU index >= 0, got %s", i, got_value(list[i]))
    end
    devs[i - 1] = v
  end
  local w = new_world()
  local rc = lib.moe_world_open_local(ctx, n, devs, w.cell)
  if rc ~= 0 then fail(rc) end
  return w
end

function M.world_open_rank(rank, size, device, hex)
  check_integer("world_open_rank", 1, rank)
  check_integer("world_open_rank", 2, size)
  check_integer("world_open_rank", 3, device)
  hex = check_string("world_open_rank", 4, hex)
  for _, v in ipairs { rank, size, device } do
    if v < -2 ^ 31 or v > 2 ^ 31 - 1 then arg_error("world", 1, "rank, size and device must fit a C int") end
  end
  local w = new_world()
  local rc = lib.moe_world_open_rank(ctx, rank, size, device, hex, w.cell)
  if rc ~= 0 then fail(rc) end
  return w
end

-- world_open_comm(comm, device) -> World, over the caller's ncclComm_t at address comm
function M.world_open_comm(comm, device)
  local p = check_address("world", "option 'comm'", comm)
  check_integer("world_open_comm", 2, device)
  if device < -2 ^ 31 or device > 2 ^ 31 - 1 then arg_error("world", 1, "device must fit a C int") end
  local w = new_world()
  local rc = lib.moe_world_open_comm(ctx, p, device, w.cell)
  if rc ~= 0 then fail(rc) end
  return w
end

function World.methods.size(w) return lib.moe_world_size(world_ptr("size", w, true)) end

-- ranks() -> {global rank, ...}; devices() -> {"cuda:N", ...}, both in local order
function World.methods.ranks(w)
  local p = world_ptr("ranks", w, true)
  local t = {}
  for i = 0, lib.moe_world_local_count(p) - 1 do t[i + 1] = lib.moe_world_local_rank(p, i) end
  return t
end

function World.methods.devices(w)
  local p = world_ptr("devices", w, true)
  local t = {}
  for i = 0, lib.moe_world_local_count(p) - 1 do t[i + 1] = device_name(1, lib.moe_world_local_device(p, i)) end
  return t
end

-- bind(i): the module's context runs on local rank i's stream (1-based); unbind() undoes it
function World.methods.bind(w, i)
  local p = world_ptr("bind", w, true)
  if i == nil then i = 1 else check_integer("bind", 2, i, true) end
  local n = lib.moe_world_local_count(p)
  if i < 1 or i > n then arg_error("bind", 1, "local rank must be in [1, %d], got %d", n, i) end
  local rc = lib.moe_world_bind(ctx, p, i - 1)
  if rc ~= 0 then fail(rc) end
  return w
end

function World.methods.unbind(w)
  local rc = lib.moe_world_unbind(ctx, world_ptr("unbind", w, true))
  if rc ~= 0 then fail(rc) end
  return w
end

-- allgather(outs, ins) and allgather_ids(all_ids, ids): tables of one tensor per local rank
local function gather_call(fname, w, outs, ins, ids)
  local p = world_ptr(fname, w, true)
  local n = lib.moe_world_local_count(p)
  local lists = { outs, ins }
  for a = 1, 2 do
    if type(lists[a]) ~= "table" or #lists[a] ~= n then
      arg_error(fname, a, "expected a table of %d moelab.Tensor (one per local rank), got %s", n, type_name(lists[a]))
    end
  end
  local o, i = new("moe_tensor *[?]", n), new("const moe_tensor *[?]", n)
  local arrays = { o, i }
  for e = 1, n do
    for a = 1, 2 do
      local u = test_tensor(rawget(lists[a], e))
      if not u then
        arg_error(fname, a, "entry %d: expected an open moelab.Tensor, got %s", e, type_name(rawget(lists[a], e)))
      end
      arrays[a][e - 1] = u.h_t
    end
  end
  local rc = ids and lib.moe_world_allgather_ids(ctx, p, o, i) or lib.moe_world_allgather(ctx, p, o, i)
  if rc ~= 0 then fail(rc) end
end

function World.methods.allgather(w, outs, ins) gather_call("allgather", w, outs, ins, false) end
function World.methods.allgather_ids(w, outs, ins) gather_call("allgather_ids", w, outs, ins, true) end

-- The table t has exactly n entries, each a table.
local function entries(fname, t, n, what)
  if type(t) ~= "table" then
    arg_error(fname, 1, "expected a table of %d %s (one per local rank), got %s", n, what, type_name(t))
  end
  if #t ~= n then arg_error(fname, 1, "expected %d %s (one per local rank), got %d", n, what, #t) end
  for i = 1, n do
    local v = rawget(t, i)
    if type(v) ~= "table" then arg_error(fname, 1, "entry %d: expected a table, got %s", i, type_name(v)) end
  end
end

local function w_int(fname, t, entry, field, optional, dflt)
  local v = t[field]
  if v == nil and optional then return dflt end
  if not is_integer(v) or v < -2 ^ 31 or v > 2 ^ 31 - 1 then
    if entry > 0 then
      arg_error(fname, 1, "entry %d, field '%s': expected an integer, got %s", entry, field, got_value(v))
    end
    arg_error(fname, 1, "field '%s': expected an integer, got %s", field, got_value(v))
  end
  return v
end

local function w_tensor(fname, t, entry, field, optional)
  local v = t[field]
  if v == nil and optional then return nil end
  local u = test_tensor(v)
  if not u then
    arg_error(fname, 1, "entry %d, field '%s': expected an open moelab.Tensor, got %s", entry, field, type_name(v))
  end
  return u
end

local CONFIG_FIELDS = { capacity = true, expert_capacity = true, experts = true, hidden = true, k = true, layout = true,
  pad = true, tokens = true, version = true, world = true }

local function config_from(fname, t, entry, c)
  for k in pairs(t) do -- a misspelt field is an error, not a default
    if not (type(k) == "string" and CONFIG_FIELDS[k]) then
      local what = type(k) == "string" and format("'%s'", k) or format("(a %s key)", type_name(k))
      arg_error(fname, 1, "entry %d: unknown field %s; expected capacity, expert_capacity, experts, hidden, k, layout, "
        .. "pad, tokens, version or world", entry, what)
    end
  end
  c.version = w_int(fname, t, entry, "version", true, HEADER_VERSION)
  c.world = w_int(fname, t, entry, "world", false, 0)
  c.tokens = w_int(fname, t, entry, "tokens", false, 0)
  c.k = w_int(fname, t, entry, "k", false, 0)
  c.experts = w_int(fname, t, entry, "experts", false, 0)
  c.hidden = w_int(fname, t, entry, "hidden", false, 0)
  c.capacity = w_int(fname, t, entry, "capacity", false, 0)
  c.pad = w_int(fname, t, entry, "pad", true, 1)
  c.expert_capacity = w_int(fname, t, entry, "expert_capacity", true, -1)
  c.layout = 0
  local layout = t.layout
  if type(layout) == "string" then
    local found
    for i = 1, #LAYOUTS do if LAYOUTS[i] == layout then found = i - 1 end end
    if not found then
      arg_error(fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got '%s'", entry, layout)
    end
    c.layout = found
  elseif layout ~= nil then
    arg_error(fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got %s", entry,
      type_name(layout))
  end
end

-- check_config({cfg, ...}): one configuration table per local rank
function World.methods.check_config(w, cfgs)
  local p = world_ptr("check_config", w, true)
  local n = lib.moe_world_local_count(p)
  entries("check_config", cfgs, n, "configurations")
  local all = new("moe_world_config[?]", n)
  for i = 1, n do config_from("check_config", rawget(cfgs, i), i, all[i - 1]) end
  local rc = lib.moe_world_check_config(ctx, p, all)
  if rc ~= 0 then fail(rc) end
end

-- world_compare_configs(rank, {cfg, ...}): the comparison alone (no GPU), rank 0-based
function M.world_compare_configs(rank, cfgs)
  check_integer("world_compare_configs", 1, rank)
  if type(cfgs) ~= "table" then typeerror("world_compare_configs", 2, "table", cfgs) end
  local n = #cfgs
  entries("compare_configs", cfgs, n, "configurations")
  local all = new("moe_world_config[?]", n > 0 and n or 1)
  for i = 1, n do config_from("compare_configs", rawget(cfgs, i), i, all[i - 1]) end
  if rank < 0 or rank > 2 ^ 31 - 1 then rank = -1 end
  local rc = lib.moe_world_compare_configs(ctx, rank, n, all)
  if rc ~= 0 then fail(rc) end
end

-- The tensor fields of a world's dispatch and combine, in the order they are read; only: the
-- field of the direct exchange alone (true) or of the all-gather one alone (false); optional: one
-- that may be left out.
local DISPATCH_TENSORS = { { "out" }, { "x_all", only = false }, { "x" }, { "peer_rank" }, { "peer_route" },
  { "route_row", only = true } }
local DISPATCH_FP8_TENSORS = { { "out" }, { "out_scale" }, { "x_all" }, { "x_scale_all" }, { "x" }, { "x_scale" },
  { "peer_rank" }, { "peer_route" } }
local COMBINE_TENSORS = { { "out" }, { "weights" }, { "ids" }, { "ys" }, { "route_row" },
  { "send_rows", only = false }, { "recv_rows", only = false }, { "send_index", only = false },
  { "recv_index", only = false }, { "shared", optional = true }, { "shared_gate", optional = true } }

-- The C array (ctype) of fname's arguments for n local ranks, and every handle taken: each rank's
-- tensor fields (of the direct exchange or not), then rest(t, i, c) sets its other fields.
local function world_args(fname, ctype, fields, list, n, direct, rest)
  entries(fname, list, n, "argument tables")
  local a, handles = new(ctype, n), {}
  for i = 1, n do
    local t, c = rawget(list, i), a[i - 1]
    for _, f in ipairs(fields) do
      if f.only == nil or f.only == direct then
        local u = w_tensor(fname, t, i, f[1], f.optional)
        if u then handles[#handles + 1] = u end
        c[f[1]] = ptr(u)
      end
    end
    rest(t, i, c)
  end
  return a, handles
end

-- The dispatch arguments of n local ranks; the all-gather exchange needs x_all, the direct one
-- route_row.  -> the C array and every handle taken.
local function world_dispatch_args(list, n, direct)
  return world_args("dispatch", "moe_world_dispatch_args[?]", DISPATCH_TENSORS, list, n, direct, function(t, i, c)
    c.k = w_int("dispatch", t, i, "k", false, 0)
    c.zero_fill = t.zero_fill and 1 or 0
  end)
end

local function world_dispatch_fp8_args(list, n)
  return world_args("dispatch_fp8", "moe_world_dispatch_fp8_args[?]", DISPATCH_FP8_TENSORS, list, n, false,
    function(t, i, c)
      c.k = w_int("dispatch_fp8", t, i, "k", false, 0)
      c.zero_fill = t.zero_fill and 1 or 0
    end)
end

local function world_combine_args(list, n, direct)
  return world_args("combine", "moe_world_combine_args[?]", COMBINE_TENSORS, list, n, direct, function(t, i, c)
    c.experts = w_int("combine", t, i, "experts", false, 0)
  end)
end

-- A stage of the world (or exchange) p over its n local ranks: list's argument tables made into C
-- by args (world_dispatch_args or world_combine_args), every tensor taken still open, then
-- stage(ctx, p, the C array).
local function world_stage(fname, p, n, list, direct, args, stage)
  local a, handles = args(list, n, direct)
  all_open(fname, handles)
  local rc = stage(ctx, p, a)
  if rc ~= 0 then fail(rc) end
end

-- dispatch({{out=, x_all=, x=, peer_rank=, peer_route=, k=, zero_fill=}, ...})
function World.methods.dispatch(w, list)
  local p = world_ptr("dispatch", w, true)
  world_stage("dispatch", p, lib.moe_world_local_count(p), list, false, world_dispatch_args, lib.moe_world_dispatch)
end

-- dispatch_fp8({{out=, out_scale=, x_all=, x_scale_all=, x=, x_scale=, peer_rank=, peer_route=, k=,
-- zero_fill=}, ...})
function World.methods.dispatch_fp8(w, list)
  local p = world_ptr("dispatch_fp8", w, true)
  world_stage("dispatch_fp8", p, lib.moe_world_local_count(p), list, false, world_dispatch_fp8_args,
    lib.moe_world_dispatch_fp8)
end

-- combine({{out=, weights=, ids=, ys=, route_row=, send_rows=, recv_rows=, send_index=,
-- recv_index=, experts=, shared=, shared_gate=}, ...})
function World.methods.combine(w, list)
  local p = world_ptr("combine", w, true)
  world_stage("combine", p, lib.moe_world_local_count(p), list, false, world_combine_args, lib.moe_world_combine)
end

-- The windows' tensor handles -> their exchange: the exchange outlives every handle of its memory
-- (and every view of those, which keep their owner).
local window_owner = setmetatable({}, { __mode = "k" })

-- world:exchange(tokens, k, hidden, capacity) -> Exchange, {x per local rank}, {ys per local rank}
function World.methods.exchange(w, T, K, H, Cap)
  local p = world_ptr("exchange", w, true)
  for i, v in ipairs { T, K, H, Cap } do check_integer("exchange", i + 1, v, true) end
  if K < 1 or K > 2 ^ 31 - 1 then arg_error("exchange", 2, "k must be in [1, %d], got %d", 2 ^ 31 - 1, K) end
  local ex = object(Exchange, "moe_world_exchange *[1]", lib.moe_world_exchange_close)
  ex.world = w
  local rc = lib.moe_world_exchange_open(ctx, p, T, K, H, Cap, ex.cell)
  if rc ~= 0 then fail(rc) end
  local n = lib.moe_world_local_count(p)
  local xs, yss = {}, {}
  local views = new("moe_tensor *[2]")
  for i = 0, n - 1 do
    rc = lib.moe_world_exchange_views(ctx, ex.cell[0], i, views, views + 1)
    if rc ~= 0 then fail(rc) end
    for j = 0, 1 do
      tensor_out[0] = views[j]
      local u = adopt(true)
      window_owner[u] = ex
      if j == 0 then xs[i + 1] = u else yss[i + 1] = u end
    end
  end
  return ex, xs, yss
end

-- The exchange's C object, its world open.
local function check_exchange(fname, ex)
  local p = check_object(fname, 1, ex, Exchange, true)
  local wp = ex.world.cell[0]
  if wp == nil then error(direct_where() .. "moelab.Exchange: its world is closed", 0) end
  return p, lib.moe_world_local_count(wp)
end

function Exchange.methods.dispatch(ex, list)
  local p, n = check_exchange("dispatch", ex)
  if pins then pins[ex] = true end -- a graph of this call writes into the windows, whatever x and out are
  world_stage("dispatch", p, n, list, true, world_dispatch_args, lib.moe_world_exchange_dispatch)
end

function Exchange.methods.combine(ex, list)
  local p, n = check_exchange("combine", ex)
  if pins then pins[ex] = true end -- a graph of this call reads the peers' windows, whatever y is
  world_stage("combine", p, n, list, true, world_combine_args, lib.moe_world_exchange_combine)
end

-- ---------------------------------------------------------------- safetensors files

-- safetensors(path) opens one (lib/safetensors.c); f:names(), f:info(name), f:read(name, dst [,
-- scale]), f:path() and f:close().
local SafeTensors = class("moelab.SafeTensors")
local st_info = new("moe_safetensors_info")

function M.safetensors(path)
  path = check_string("safetensors", 1, path)
  local f = object(SafeTensors, "moe_safetensors *[1]", lib.moe_safetensors_close)
  local rc = lib.moe_safetensors_open(ctx, path, f.cell)
  if rc ~= 0 then fail(rc) end
  return f
end

local function check_file(fname, f) return check_object(fname, 1, f, SafeTensors, true) end

function SafeTensors:__tostring()
  local p = self.cell[0]
  if p == nil then return "moelab.SafeTensors(closed)" end
  return format("moelab.SafeTensors('%s', %d tensors)", string_(lib.moe_safetensors_path(p)),
    lib.moe_safetensors_count(p))
end

-- close(): closes once, never raises (as its collection does).
function SafeTensors.methods.close(f)
  if getmetatable(f) ~= SafeTensors then return end
  local cell = close_object(f)
  if cell and cell[0] ~= nil then
    lib.moe_safetensors_close(cell[0])
    cell[0] = nil
  end
end
SafeTensors.__close = SafeTensors.methods.close

function SafeTensors.methods.path(f) return string_(lib.moe_safetensors_path(check_file("path", f))) end

-- names() -> the tensors' names, sorted.
function SafeTensors.methods.names(f)
  local p = check_file("names", f)
  local t = {}
  for i = 0, lib.moe_safetensors_count(p) - 1 do
    local rc = lib.moe_safetensors_tensor(ctx, p, i, st_info)
    if rc ~= 0 then fail(rc) end
    t[i + 1] = string_(st_info.name)
  end
  return t
end

-- info(name) -> {dtype =, shape = {...}, offset =, nbytes =}, or nil when the file has no such tensor.
function SafeTensors.methods.info(f, name)
  local p = check_file("info", f)
  local i = lib.moe_safetensors_find(p, check_string("info", 2, name, true))
  if i < 0 then return nil end
  local rc = lib.moe_safetensors_tensor(ctx, p, i, st_info)
  if rc ~= 0 then fail(rc) end
  local shape = {}
  for d = 1, st_info.ndim do shape[d] = tonumber(st_info.shape[d - 1]) end
  return { dtype = string_(st_info.dtype), shape = shape, offset = tonumber(st_info.offset),
    nbytes = tonumber(st_info.nbytes) }
end

-- read(name, dst [, scale]) -> dst, tensor name read into it (moe_safetensors_read).
function SafeTensors.methods.read(f, name, dst, scale)
  local p = check_file("read", f)
  name = check_string("read", 2, name, true)
  dst = check_tensor("read", 3, dst, true)
  if scale ~= nil then scale = check_tensor("read", 4, scale, true) end
  local rc = lib.moe_safetensors_read(ctx, p, name, scale and scale.h_t or nil, dst.h_t)
  if rc ~= 0 then fail(rc) end
  return dst
end

registry["moelab.ffi_core"] = M
return M
