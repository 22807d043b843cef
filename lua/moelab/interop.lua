-- SPDX-License-Identifier: MIT
-- Tensors over memory that another library owns, without a copy: a raw address (moe.wrap) or a
-- DLPack managed tensor (moe.from_dlpack), and moelab's tensors handed out through DLPack
-- (t:to_dlpack()).  Who frees what, and when, is in docs/design.md ("Memory from elsewhere").
local core = require "moelab.core"
local args = require "moelab.args"

local interop = {}

local DTYPES = { "f32", "bf16", "i32", "e4m3" }

-- An address as other libraries give it: an integer >= 0 (ctypes, LuaJIT's FFI, to_dlpack), a
-- light userdata (t:address()), or under LuaJIT a cdata (t:address() there, a pointer); the
-- binding tells a light userdata from a full one, and a pointer or an integer from other cdata.
function interop.is_address(v)
  if type(v) == "number" then return v >= 0 and v == math.floor(v) and v < 2 ^ 63 end
  return (type(v) == "userdata" or type(v) == "cdata") and not args.is_tensor(v)
end

function interop.check_address(fname, what, v)
  if not interop.is_address(v) then
    args.fail(fname, string.format("%s must be an integer >= 0 or a light userdata, got %s", what, args.describe(v)))
  end
end

-- moe.wrap{ address =, dtype =, shape =, device = "cpu", keep = } (check_shape: moe.tensor's).
-- The memory stays the caller's: keep is held as long as moelab may touch it.
function interop.wrap(o, check_shape)
  args.options("wrap", o, { address = "any", dtype = DTYPES, shape = "table", device = "device", keep = "any" },
    { "address", "dtype", "shape" })
  interop.check_address("wrap", "option 'address'", o.address)
  check_shape("wrap", o.shape)
  return core.wrap(o.address, o.dtype, o.shape, o.device or "cpu", o.keep)
end

-- moe.from_dlpack(address, { versioned = false }): the tensor takes the DLManagedTensor (or,
-- versioned, the DLManagedTensorVersioned) at address and calls its deleter when it is done;
-- when it raises, the caller still owns it.
function interop.from_dlpack(address, o)
  o = args.options("from_dlpack", o or {}, { versioned = "boolean" })
  interop.check_address("from_dlpack", "the managed tensor's address", address)
  return core.from_dlpack(address, o.versioned or false)
end

-- t:to_dlpack{ versioned = false } -> the address (an integer) of a new DLManagedTensor over t's
-- memory, which it keeps alive until its consumer calls its deleter (the consumer's duty).
function core.Tensor.to_dlpack(t, o)
  if not args.is_tensor(t) then
    args.fail("to_dlpack", "expected a moelab.Tensor (call it as t:to_dlpack()), got " .. args.describe(t))
  end
  if t.closed then args.fail("to_dlpack", "the moelab.Tensor is closed") end
  o = args.options("to_dlpack", o or {}, { versioned = "boolean" })
  return core.to_dlpack(t, o.versioned or false)
end

return interop
