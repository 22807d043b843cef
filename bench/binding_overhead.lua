-- SPDX-License-Identifier: MIT
-- The cost of crossing into the library from Lua, per call, on the CPU at sizes where the work
-- itself is nearly nothing: what a binding adds.  From the repository root, with ./build:
--
--   lua5.4 bench/binding_overhead.lua     (the C module, build/moelab/core.so)
--   luajit bench/binding_overhead.lua     (moelab.ffi_core over build/libmoelab.so)
--
-- Each row times batches of calls with the monotonic clock and prints the median (and the
-- minimum) over the batches of the time per call, in microseconds.  MOE_THREADS=1 keeps the CPU
-- backend from waking threads for work this small.
local build = os.getenv("MOE_BUILD_DIR") or "build"
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
package.cpath = "./" .. build .. "/?.so;" .. package.cpath

local moe = require "moelab"
local core = moe.core

local BATCHES, CALLS = 31, 2000

-- median and minimum microseconds per call of fn over the batches, after one batch of warm-up
local function measure(fn)
  for _ = 1, CALLS do fn() end
  local per = {}
  for b = 1, BATCHES do
    local t0 = os.clock()
    for _ = 1, CALLS do fn() end
    per[b] = (os.clock() - t0) / CALLS * 1e6
  end
  table.sort(per)
  return per[(BATCHES + 1) / 2], per[1]
end

local bf16 = { dtype = "bf16" }
-- experts: one expert, one row, H = F = 8
local x = moe.randn({ 1, 8 }, { dtype = "bf16", seed = 1 })
local y = moe.zeros({ 1, 8 }, bf16)
local offsets = moe.tensor({ 0, 1 }, { dtype = "i32" })
local wgu = moe.randn({ 1, 16, 8 }, { dtype = "bf16", seed = 2 })
local wd = moe.randn({ 1, 8, 8 }, { dtype = "bf16", seed = 3 })
-- dispatch: one token of one rank, top-1, to one expert
local xt = moe.randn({ 1, 1, 8 }, { dtype = "bf16", seed = 4 })
local s = moe.schedule { ids = moe.tensor({ { { 0 } } }, { dtype = "i32" }), experts = 1 }
local xs = moe.zeros({ s.capacity, 8 }, bf16)
-- a layer: one rank, one token, 4 experts top-2, H = F = 8, a shared expert
local layer = moe.layer { model = { experts = 4, k = 2, hidden = 8, ffn = 8, shared_ffn = 8 }, tokens = 1,
  device = "cpu" }
local lx = moe.randn({ 1, 1, 8 }, { dtype = "bf16", seed = 5 })

local ROWS = {
  { "core.device_count (a call that does nothing)", function() core.device_count("cpu") end },
  { "core.experts{} (1 row, H = F = 8)", function()
    core.experts { out = y, x = x, offsets = offsets, w_gate_up = wgu, w_down = wd }
  end },
  { "moe.experts{} with out (options checked)", function()
    moe.experts { x = x, offsets = offsets, w_gate_up = wgu, w_down = wd, out = y }
  end },
  { "core.dispatch{} (1 token)", function()
    core.dispatch { out = xs, x = xt, peer_rank = s.peer_rank, peer_route = s.peer_route, k = 1 }
  end },
  { "moe.dispatch{} with out", function() moe.dispatch { x = xt, schedule = s, out = xs } end },
  { "t.shape (a property)", function() return x.shape end },
  { "t:view(0, {8}) (a new handle)", function() return x:view(0, { 8 }) end },
  { "layer:forward (1 token, E = 4, top-2, H = F = 8)", function() layer:forward(lx) end },
  { "layer:forward{check = false}", function() layer:forward(lx, { check = false }) end },
}

print(string.format("moelab %s, %s through %s; µs per call, median (min) of %d batches of %d calls",
  moe.version, rawget(_G, "jit") and jit.version or _VERSION,
  rawget(_G, "jit") and "moelab.ffi_core (FFI)" or "moelab.core (C module)", BATCHES, CALLS))
for _, row in ipairs(ROWS) do
  local median, min = measure(row[2])
  print(string.format("  %-50s %9.3f  (%.3f)", row[1], median, min))
end
