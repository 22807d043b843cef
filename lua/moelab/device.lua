-- SPDX-License-Identifier: MIT
-- Where stages run: the devices, CUDA graphs of a sequence of stages, timing events.
local core = require "moelab.core"
local args = require "moelab.args"

local device = {}

function device.devices()
  local list = { "cpu" }
  for i = 0, core.device_count("cuda") - 1 do list[#list + 1] = "cuda:" .. i end
  return list
end

function device.default_device()
  return core.device_count("cuda") > 0 and "cuda:0" or "cpu"
end

local capturing = false -- device.graph's fn is running: stages are recorded, nothing can be read back

-- Whether a graph capture is under way (a stage must not read back then).
function device.capturing() return capturing end

-- Captures the stages fn issues on a GPU into a CUDA graph; graph:replay() reruns them on
-- whatever their tensors hold then.  Nothing inside fn may read results back to the host.
function device.graph(fn, opts)
  if type(fn) ~= "function" then args.fail("graph", "expected a function to capture, got " .. args.describe(fn)) end
  opts = args.options("graph", opts or {}, { device = "device" })
  local dev = opts.device or device.default_device()
  if dev == "cpu" then args.fail("graph", "CUDA graphs need a cuda device, got 'cpu'") end
  -- No garbage collection while capturing: a collected graph or event would be destroyed
  -- mid-capture, a call that invalidates the capture under way.
  local was_running = collectgarbage("isrunning")
  collectgarbage("stop")
  local begun, berr = pcall(core.graph_begin, dev)
  if not begun then
    if was_running then collectgarbage("restart") end
    args.raise(berr)
  end
  capturing = true
  local ok, err = pcall(fn)
  capturing = false
  local ended, graph = pcall(core.graph_end) -- always end the capture, even after a failure
  if was_running then collectgarbage("restart") end
  if not ok then args.raise("graph: capture failed: " .. tostring(err)) end
  if not ended then args.raise(graph) end
  return graph
end

-- A timing event: device events on a GPU, a monotonic clock on the CPU.
-- e:record(); stop:elapsed_since(start) -> milliseconds.
function device.event(dev)
  if dev ~= nil and not args.is_device(dev) then
    args.fail("event", "expected a device, 'cpu' or 'cuda:N', got " .. args.describe(dev))
  end
  return core.event_new(dev or device.default_device())
end

return device
