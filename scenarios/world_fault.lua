-- SPDX-License-Identifier: MIT
-- A rank that goes away mid-run: the others must fail with an error that names the rank and the
-- step within MOE_WORLD_TIMEOUT, not wait forever.  Run as two or more processes:
--
--   MOE_WORLD_TIMEOUT=5 scenarios/launch.sh 2 lua scenarios/world_fault.lua
--
-- Every rank joins and all-gathers once; then the last rank exits without a word, and each of
-- the others checks: its next all-gather raises (NCCL's report of the lost peer, or the timeout)
-- within the timeout and a margin, a call after that says the world was aborted, and close
-- returns.  Prints one line per check; exits 1 on a failure, 2 on a bad flag, a world that
-- cannot be made, or a world of one rank (no other rank to leave).
local cli = require "moelab.cli"
local moe = cli.require "moelab"

cli.parse(arg, {}, "MOE_WORLD_TIMEOUT=5 scenarios/launch.sh 2 lua scenarios/world_fault.lua: the last rank leaves "
  .. "mid-run, the others must fail within the timeout")
local world = cli.guard("moe.world (start it with scenarios/launch.sh W lua scenarios/world_fault.lua, W >= 2)",
  moe.world, { from_env = true })
local rank, W = world.rank, world.size
if W < 2 then cli.fail("world_fault.lua needs a world of two ranks or more: the last one leaves, the others check") end
local timeout = tonumber(os.getenv("MOE_WORLD_TIMEOUT") or "") or 600
local ids = moe.zeros({ 16, 2 }, { dtype = "i32", device = world.device })
world:allgather_ids(ids) -- every rank is connected
if rank == W - 1 then
  io.write(string.format("rank %d: leaving without a word\n", rank))
  io.flush()
  os.exit(0)
end

local failures = 0
local function check(ok, fmt, ...)
  if not ok then failures = failures + 1 end
  io.write(string.format("%s rank %d: " .. fmt .. "\n", ok and "PASS" or "FAIL", rank, ...))
  io.flush()
end

local t0 = moe.core.now()
local ok, err = pcall(world.allgather_ids, world, ids)
local dt = moe.core.now() - t0
check(not ok and tostring(err):find("rank " .. rank, 1, true) ~= nil,
  "the all-gather without rank %d raises, naming this rank: %s", W - 1, tostring(err))
check(dt < timeout + 10, "it raised after %.1f s (timeout %g s)", dt, timeout)
local ok2, err2 = pcall(world.allgather_ids, world, ids)
check(not ok2 and tostring(err2):find("aborted", 1, true) ~= nil, "a later call says the world was aborted: %s",
  tostring(err2))
local t1 = moe.core.now()
world:close()
check(moe.core.now() - t1 < 30, "close returns (%.1f s)", moe.core.now() - t1)
os.exit(failures == 0 and 0 or 1)
