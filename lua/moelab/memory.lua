-- SPDX-License-Identifier: MIT
-- Sizes before allocation.  A front-end function that makes buffers from its options declares
-- them first, as a list of {name =, dtype =, shape =, from =} (from: which options size it, in
-- the caller's words); the list is checked -- no buffer past moe_tensor_new's 2^40 elements,
-- the total within what the device can hold now -- before one byte is allocated, and the error
-- names the options rather than leaving "tensor: out of memory" halfway through, or the kernel's
-- OOM killer.  Then the same list is what gets allocated, so the estimate is the allocation.
local core = require "moelab.core"
local args = require "moelab.args"

local memory = {}

local BYTES = { f32 = 4, bf16 = 2, i32 = 4, e4m3 = 1 }
local MAX_ELEMENTS = 2 ^ 40 -- moe_tensor_new's bound on the dimensions other than 0 multiplied
-- Below this a request is not worth a look at /proc: the allocation itself says when it fails.
local ASK_ABOVE = 256 * 2 ^ 20

function memory.buffer(name, dtype, shape, from)
  return { name = name, dtype = dtype, shape = shape, from = from }
end

-- "33.8 GB", "26.7 MB": decimal units, one decimal.
function memory.size(bytes)
  if bytes < 1e9 then return string.format("%.1f MB", bytes / 1e6) end
  return string.format("%.1f GB", bytes / 1e9)
end

-- The bytes of the buffers of list, in floats (exact to 2^53, no wrap).  Raises as fname, naming
-- the buffer and what sized it, where one passes 2^40 elements.
function memory.bytes(fname, list)
  local total = 0
  for _, b in ipairs(list) do
    local span, n = 1, 1
    for _, d in ipairs(b.shape) do
      if d > 0 then span = span * d end
      n = n * d
    end
    if span > MAX_ELEMENTS then
      args.fail(fname, string.format("%s would be %s %s, more than 2^40 elements (%s)", b.name, b.dtype,
        args.shape_str(b.shape), b.from))
    end
    total = total + n * BYTES[b.dtype]
  end
  return total
end

-- The bytes free on device (a device string: the host for "cpu"), and what says so.
function memory.free(device)
  local free = core.device_memory(device)
  return free, device == "cpu" and "available (MemAvailable)" or "free on " .. device
end

-- Whether need bytes fit on device within limit (a number: the caller's budget in place of what
-- is free; nil: what is free) -> true, or false and the words for the refusal:
-- "needs 33.9 GB of host memory, 23.1 GB available (MemAvailable)".
function memory.fits(need, device, limit)
  if limit == nil and need < ASK_ABOVE then return true end
  local have, source
  if limit ~= nil then
    have, source = limit, "allowed (memory_limit)"
  else
    have, source = memory.free(device)
  end
  if need <= have then return true end
  return false, string.format("needs %s of %s, %s %s", memory.size(need),
    device == "cpu" and "host memory" or "memory on " .. device, memory.size(have), source)
end

-- The buffers of list allocated on device, into t (default: a new table) by name.
function memory.alloc(list, device, t)
  t = t or {}
  for _, b in ipairs(list) do t[b.name] = core.new(b.dtype, b.shape, device) end
  return t
end

-- The buffers of list checked as above (fname names the caller in errors) and allocated: the
-- way a front-end function makes its outputs.
function memory.new(fname, list, device, t)
  local ok, why = memory.fits(memory.bytes(fname, list), device)
  if not ok then
    local names = {}
    for i, b in ipairs(list) do names[i] = string.format("%s %s %s", b.name, b.dtype, args.shape_str(b.shape)) end
    args.fail(fname, string.format("its outputs (%s) %s", table.concat(names, ", "), why))
  end
  return memory.alloc(list, device, t)
end

return memory
