-- SPDX-License-Identifier: MIT
-- One rank of a multi-process world, checked against the simulated world: run it as W processes,
-- one per GPU, with scenarios/launch.sh (or any launcher that sets MOE_RANK, MOE_WORLD_SIZE,
-- MOE_DEVICE and MOE_NCCL_ID or MOE_NCCL_ID_FILE for each):
--
--   scenarios/launch.sh 4 lua scenarios/world_ranks.lua [--tokens N] [--hidden H] [--ffn F] [--model M]
--                                                       [--experts E] [--seed S]
--
-- Each rank builds the layer over the real world (its own experts on its own GPU, tokens exchanged
-- over NVLink), runs it eagerly, then captures its forward pass as a CUDA graph (one rank per
-- process: the capture takes this rank's part, exchange included) and replays it on new tokens.
-- It also builds the simulated layer of all W ranks on its own GPU from the same seed and checks:
-- its routing and schedule equal the simulated rank's bit for bit, its output is within the
-- layer's tolerance of the simulated one and of the dense reference, and the replay equals an
-- eager forward of the same tokens bit for bit; NaN logits on one rank stop every rank's forward
-- at once; a layer built with another seed on one rank is refused on every rank.  Prints one
-- line per check; exits 1 on a failure, 2 on a bad flag or a world that cannot be made.
local cli = require "moelab.cli"
local moe = cli.require "moelab"

local opts = cli.parse(arg, {
  { "model", "string", "kimi_k2", "a preset of moe.models" },
  { "tokens", "integer", 64, "tokens per rank" },
  { "hidden", "integer", 512, "hidden size H" },
  { "ffn", "integer", 256, "expert FFN width F" },
  { "experts", "integer", nil, "experts E (default: the model's)" },
  { "seed", "integer", 5, "seed of the weights and tokens" },
}, "lua scenarios/world_ranks.lua: one rank of a multi-process world, checked against the simulated world")

-- run by a launcher (scenarios/launch.sh W lua scenarios/world_ranks.lua), which sets MOE_RANK & co.
local world = cli.guard("moe.world (start it with scenarios/launch.sh W lua scenarios/world_ranks.lua)", moe.world,
  { from_env = true })
local W, rank, dev = world.size, world.rank, world.device
local T, H = opts.tokens, opts.hidden
local failures = 0
local function check(ok, fmt, ...)
  if not ok then failures = failures + 1 end
  io.write(string.format("%s rank %d of %d (%s): " .. fmt .. "\n", ok and "PASS" or "FAIL", rank, W, dev, ...))
  io.flush()
end

local spec = { model = opts.model, tokens = T, hidden = H, ffn = opts.ffn, experts = opts.experts, seed = opts.seed }
spec.world = world
local layer = cli.guard("moe.layer", moe.layer, spec)
spec.world, spec.device = W, dev
local sim = moe.layer(spec)

local x_all = moe.randn({ W, T, H }, { dtype = "bf16", seed = opts.seed * 7919 + 1, device = dev })
layer.inputs[1]:copy(x_all:select(rank + 1))
local out = layer:forward(layer.inputs[1])
local ref = sim:forward(x_all)
check(pcall(moe.check.equal, layer.ids[1], sim.ids:select(rank + 1)), "routing equals the simulated rank's")
check(pcall(moe.check.equal, layer.schedules[1].route_row, sim.schedules[rank + 1].route_row) and
  pcall(moe.check.equal, layer.schedules[1].peer_route, sim.schedules[rank + 1].peer_route),
  "schedule equals the simulated rank's bit for bit")
local m = moe.check.metrics(out:to("cpu"), ref:select(rank + 1):to("cpu"))
check(m.nans == 0 and m.rel_max <= 2e-2 and m.rel_l2 <= 1e-2, "output vs the simulated world: max rel %.2e, L2 %.2e",
  m.rel_max, m.rel_l2)
local r = layer:check(layer.inputs[1], { sample = 8, raise = false })
check(r.pass, "output vs the dense reference (8 tokens): max rel %.2e, L2 %.2e", r.rel_max, r.rel_l2)

-- The graph of this rank's pass, replayed on new tokens; an eager forward of the same tokens
-- must give the same bits.
local graph = layer:capture()
local x2 = moe.randn({ W, T, H }, { dtype = "bf16", seed = opts.seed * 7919 + 2, device = dev })
layer.inputs[1]:copy(x2:select(rank + 1))
local replayed = graph:replay():to("cpu")
graph:check()
local eager = layer:forward(layer.inputs[1]):to("cpu")
check(pcall(moe.check.equal, replayed, eager), "a graph replay on new tokens equals the eager forward bit for bit")

-- NaN logits on the last rank only: every rank raises at once (the last one naming the NaN, the
-- others naming that rank), none waits for a rank that left the forward; the world goes on.
local E = layer.experts
local logits = moe.randn({ T, E }, { seed = 77 + rank, device = dev })
if rank == W - 1 then logits:view(3 * E, { 1 }):fill(0 / 0) end
local t0 = moe.core.now()
local ok, err = pcall(layer.forward, layer, layer.inputs[1], { logits = logits })
local secs = moe.core.now() - t0
err = tostring(err)
local want = rank == W - 1 and "NaN or cannot be scored" or string.format("rank %d stopped this forward", W - 1)
check(not ok and err:find(want, 1, true) ~= nil and secs < 5,
  "NaN logits on rank %d alone stop every rank within %.2f s: %s", W - 1, secs, err)
local again = layer:forward(layer.inputs[1]):to("cpu")
check(pcall(moe.check.equal, again, eager), "the next forward runs as before")

-- A layer built with another seed on one rank: every rank refuses it, naming the field (a world
-- of one rank has no other rank to differ from).
if W > 1 then
  local other = {}
  for k, v in pairs(spec) do other[k] = v end
  other.world, other.device, other.seed = world, nil, rank == W - 1 and opts.seed + 1 or opts.seed
  local built, berr = pcall(moe.layer, other)
  check(not built and tostring(berr):find("'seed (low 31 bits)' is", 1, true) ~= nil,
    "a layer whose seed differs on rank %d is refused on every rank: %s", W - 1, tostring(berr))
else
  io.write(string.format("SKIP rank 0 of 1 (%s): a layer whose seed differs on another rank (there is none)\n", dev))
end

world:close()
io.write(string.format("rank %d: %d check%s failed\n", rank, failures, failures == 1 and "" or "s"))
os.exit(failures == 0 and 0 or 1)
