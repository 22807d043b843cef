-- SPDX-License-Identifier: MIT
-- Loaded once by busted before the suites (see .busted): the module, the devices to run each
-- suite on, and luassert assertions that print a useful diff.
local say = require "say"
local assert = require "luassert"

local moe = require "moelab"
_G.moe = moe

-- Every suite runs once per device: the CPU always; CUDA when a GPU is usable here.  GPU suites
-- are tagged #gpu and, without a GPU, report themselves as skipped rather than vanish.
_G.DEVICES = moe.devices()
_G.HAVE_GPU = #DEVICES > 1
_G.ALL_DEVICES = { "cpu", "cuda:0" }
function _G.device_tag(dev) return dev == "cpu" and "#cpu" or "#gpu" end
-- Use inside a describe for a device: returns true (and marks the block skipped) when dev is absent.
function _G.skip_without(dev)
  if dev == "cpu" or HAVE_GPU then return false end
  -- busted's `pending` lives in the suites' environment, not in this file's: take it from busted
  require("busted").pending("no GPU on this machine: " .. dev .. " suites skipped")
  return true
end

-- A failed check's own message (the diff) replaces luassert's rendering of the arguments.
local function report(arguments, err)
  for i = 1, arguments.n or #arguments do arguments[i] = nil end
  arguments[1], arguments.n, arguments.nofmt = tostring(err), 1, { true }
  return false
end

-- assert.tensor_equal(a, b): exact equality of values and shapes (tensors or flat tables).
local function tensor_equal(_, arguments)
  local ok, err = pcall(moe.check.equal, arguments[1], arguments[2], arguments[3])
  return ok or report(arguments, err)
end
say:set("assertion.tensor_equal.positive", "Expected equal values:\n%s")
say:set("assertion.tensor_equal.negative", "Expected different values, got equal ones")
assert:register("assertion", "tensor_equal", tensor_equal, "assertion.tensor_equal.positive",
  "assertion.tensor_equal.negative")

-- assert.close(got, ref, {rtol=, atol=, l2=}): the tolerances of docs/design.md by default.
local function close(_, arguments)
  local ok, err = pcall(moe.check.close, arguments[1], arguments[2], arguments[3])
  return ok or report(arguments, err)
end
say:set("assertion.close.positive", "Expected close values:\n%s")
say:set("assertion.close.negative", "Expected values not close, got close ones")
assert:register("assertion", "close", close, "assertion.close.positive", "assertion.close.negative")

return true
