-- SPDX-License-Identifier: MIT
-- moe.world{...}: this process's part of a world of expert-parallel ranks on real GPUs, with
-- NCCL between them (moelab.core's World).  Two ways to make one:
--
--   moe.world { devices = { 0, 1, 2, 3 } }                 -- every rank in this process
--   moe.world { rank = r, size = W, device = d, id = hex }  -- one rank of a multi-process launch
--   moe.world { rank = r, size = W, device = d, id_file = path }
--   moe.world { from_env = true }  -- MOE_RANK, MOE_WORLD_SIZE, MOE_DEVICE, MOE_NCCL_ID or MOE_NCCL_ID_FILE
--   moe.world { comm = address, device = d }  -- one rank over the caller's ncclComm_t (moelab.h:
--                                              -- moe_world_open_comm; never destroyed here)
--
-- The id is an NCCL unique id as 256 hex digits, given to every process.  The process that
-- makes it must stay up until every rank has joined (NCCL's bootstrap listens in it): with
-- id_file, rank 0 makes the id and writes the file when there is none (and removes it once the
-- world is open, or has failed), and the other ranks wait for it (option id_wait or
-- MOE_NCCL_ID_WAIT seconds, default 120).  The exchange methods (allgather_ids, dispatch,
-- dispatch_fp8, combine, exchange) take one value per local rank: a list, or the value itself
-- when the process holds one rank.
local core = require "moelab.core"
local args = require "moelab.args"
local interop = require "moelab.interop"
local compat = require "moelab.compat"

local ENV = { rank = "MOE_RANK", size = "MOE_WORLD_SIZE", device = "MOE_DEVICE", id = "MOE_NCCL_ID",
  id_file = "MOE_NCCL_ID_FILE" }
local ID_DIGITS = 256

local world = {}
local World = { __name = "moelab.WorldFrontEnd" }
World.__index = World

-- An argument error of moe.world (at the caller's line, as every front-end error).
local function bad(fmt, ...) args.fail("world", string.format(fmt, ...)) end

local function hex_problem(s)
  if #s ~= ID_DIGITS then
    return string.format("must be %d hex digits (an NCCL unique id from moe.world_unique_id()), got %d character%s",
      ID_DIGITS, #s, #s == 1 and "" or "s")
  end
  local at = s:find("[^%x]")
  if at then return string.format("has %q at position %d, expected a hex digit", s:sub(at, at), at) end
end

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

local function read_id_file(path)
  local f, err = io.open(path, "r")
  if not f then bad("option 'id_file': cannot read %q: %s", path, err) end
  local text = f:read("a") or ""
  f:close()
  local id = trim(text)
  local problem = hex_problem(id)
  if problem then bad("option 'id_file' (%q) does not hold an id: its text %s", path, problem) end
  return id
end

-- The id of an id file: rank 0 makes it and writes the file (by a rename, so that no rank reads
-- half of it) when there is none; any other rank waits for the file.  -> the id, and whether
-- this process made the file (then it removes it once the world is open or has failed: the id
-- lives only as long as this process, and a file left behind would hand a dead id to a rerun).
local function id_from_file(path, rank, wait)
  local f = io.open(path, "r")
  if f then
    f:close()
    return read_id_file(path), false
  end
  if rank == 0 then
    local tmp = string.format("%s.tmp%d", path, math.random(0x40000000))
    local out, err = io.open(tmp, "w")
    if not out then bad("option 'id_file': rank 0 makes the id but cannot write %q: %s", path, err) end
    local ok, id = pcall(core.world_unique_id)
    if not ok then
      out:close()
      os.remove(tmp)
      args.raise(id)
    end
    out:write(id, "\n")
    out:close()
    local renamed, rerr = os.rename(tmp, path)
    if not renamed then
      os.remove(tmp)
      bad("option 'id_file': rank 0 cannot put the id at %q: %s", path, rerr)
    end
    return id, true
  end
  if wait == nil then
    local env = os.getenv("MOE_NCCL_ID_WAIT")
    wait = env and env ~= "" and tonumber(env) or 120
    if env and env ~= "" and not tonumber(env) then
      bad("the environment variable MOE_NCCL_ID_WAIT must be a number of seconds, got %q", env)
    end
  end
  if not (wait >= 0 and wait < math.huge) then bad("option 'id_wait' must be a finite number >= 0, got %s", wait) end
  local t0 = core.now()
  repeat
    core.sleep(0.05)
    f = io.open(path, "r")
  until f or core.now() - t0 > wait
  if not f then
    bad("option 'id_file': no id appeared at %q within %g s (rank 0 writes it; MOE_NCCL_ID_WAIT sets the wait)",
      path, wait)
  end
  f:close()
  return read_id_file(path), false
end

-- Fills the rank options missing from o from the environment.
local function from_env(o)
  for _, key in ipairs { "rank", "size", "device" } do
    if o[key] == nil then
      local name, v = ENV[key], os.getenv(ENV[key])
      if v == nil or v == "" then
        bad("from_env: the environment variable %s is not set (or pass option '%s')", name, key)
      end
      local n = compat.tointeger(tonumber(trim(v)))
      if not n then bad("from_env: the environment variable %s must be an integer, got %q", name, v) end
      o[key] = n
    end
  end
  if o.id == nil and o.id_file == nil then
    local id, file = os.getenv(ENV.id), os.getenv(ENV.id_file)
    if id and id ~= "" and file and file ~= "" then
      bad("from_env: both MOE_NCCL_ID and MOE_NCCL_ID_FILE are set; set one")
    elseif id and id ~= "" then
      local problem = hex_problem(trim(id))
      if problem then bad("from_env: the environment variable MOE_NCCL_ID %s", problem) end
      o.id = trim(id)
    elseif file and file ~= "" then
      o.id_file = file
    else
      bad("from_env: neither MOE_NCCL_ID nor MOE_NCCL_ID_FILE is set (or pass option 'id' or 'id_file')")
    end
  end
end

-- A world over the caller's communicator: nothing else may say how to make one.
local function open_comm(o)
  for _, k in ipairs { "devices", "rank", "size", "id", "id_file", "id_wait", "from_env" } do
    if o[k] ~= nil and not (k == "from_env" and o[k] == false) then
      bad("option 'comm' (the caller's NCCL communicator) cannot be combined with option '%s'", k)
    end
  end
  interop.check_address("world", "option 'comm'", o.comm)
  if o.comm == 0 or o.comm == nil then bad("option 'comm' is a NULL address") end -- LuaJIT: a NULL pointer == nil
  if o.device == nil then bad("option 'device' is required with option 'comm' (the communicator's GPU, an integer)") end
  if o.device < 0 then bad("option 'device' must be a GPU index >= 0, got %d", o.device) end
  return core.world_open_comm(o.comm, o.device)
end

local function open(o)
  args.options("world", o, { devices = "table", rank = "integer", size = "integer", device = "integer",
    id = "string", id_file = "string", id_wait = "number", from_env = "boolean", comm = "any" })
  local copy = {}
  for k, v in pairs(o) do copy[k] = v end
  o = copy
  if type(o.comm) ~= "nil" then return open_comm(o) end -- a NULL pointer cdata == nil, yet was given
  if o.devices ~= nil then
    for _, k in ipairs { "rank", "size", "device", "id", "id_file", "id_wait", "from_env" } do
      if o[k] ~= nil and not (k == "from_env" and o[k] == false) then -- from_env = false asks for nothing
        bad("option 'devices' (every rank in this process) cannot be combined with option '%s' (one rank of a "
          .. "multi-process launch)", k)
      end
    end
    local n = #o.devices
    if n == 0 then bad("option 'devices' must list at least one GPU index, got an empty table") end
    local seen = {}
    for k in pairs(o.devices) do
      if compat.math_type(k) ~= "integer" or k < 1 or k > n then
        bad("option 'devices' must be a list of GPU indices, got a key %s", args.describe(k))
      end
    end
    for i, d in ipairs(o.devices) do
      if compat.math_type(d) ~= "integer" or d < 0 then
        bad("devices[%d] must be a GPU index (an integer >= 0), got %s", i, args.describe(d))
      end
      if seen[d] then bad("devices[%d] repeats GPU %d (devices[%d]); one rank per GPU", i, d, seen[d]) end
      seen[d] = i
    end
    return core.world_open_local(o.devices)
  end
  if o.from_env then from_env(o) end
  if o.rank == nil and o.size == nil then
    bad("give option 'devices' (every rank in this process), or 'rank', 'size', 'device' and 'id' or 'id_file' "
      .. "(one rank of a multi-process launch), or from_env = true, or 'comm' and 'device' (a rank over your own "
      .. "NCCL communicator)")
  end
  for _, k in ipairs { "rank", "size", "device" } do
    if o[k] == nil then bad("option '%s' is required with a multi-process world (an integer)", k) end
  end
  if o.size < 1 then bad("option 'size' must be >= 1, got %d", o.size) end
  if o.rank < 0 or o.rank >= o.size then
    bad("option 'rank' must be between 0 and %d (size %d), got %d", o.size - 1, o.size, o.rank)
  end
  if o.device < 0 then bad("option 'device' must be a GPU index >= 0, got %d", o.device) end
  if (o.id == nil) == (o.id_file == nil) then
    bad("give exactly one of option 'id' (the NCCL unique id as hex) and option 'id_file' (a file holding it)")
  end
  local id, made = o.id, false
  if id then
    local problem = hex_problem(id)
    if problem then bad("option 'id' %s", problem) end
  else
    id, made = id_from_file(o.id_file, o.rank, o.id_wait)
  end
  -- the init is collective: once it returns every rank has joined, and so read the file
  local ok, h = pcall(core.world_open_rank, o.rank, o.size, o.device, id)
  if made then os.remove(o.id_file) end
  if not ok then args.raise(h) end
  return h
end

local function new_world(o)
  local h = open(o)
  local self = setmetatable({ handle = h, size = h:size(), ranks = h:ranks(), devices = h:devices() }, World)
  self.local_count = #self.ranks
  self.rank = self.ranks[1] -- the first (with one rank per process: the) rank of this process
  self.device = self.devices[1]
  self.scratch = {}
  return self
end

-- One value per local rank: v itself when this process holds one rank and v is not a list.
local function per_rank(self, fname, name, v, is_one)
  if is_one(v) then
    if self.local_count ~= 1 then
      args.fail(fname, string.format("option '%s' needs one value per local rank (%d), got one", name,
        self.local_count))
    end
    return { v }, true
  end
  if type(v) ~= "table" or #v ~= self.local_count then
    args.fail(fname, string.format("option '%s' must be a list of %d (one per local rank), got %s", name,
      self.local_count, args.describe(v)))
  end
  return v, false
end
local function is_tensor(v) return args.is_tensor(v) end


function World:__tostring() return tostring(self.handle) end
function World:close() self.handle:close() end
World.__close = World.close
-- Points the module's context at local rank i's stream (1-based, default 1): the stages
-- then run in order with the exchanges, and a capture takes both.
function World:bind(i)
  self.handle:bind(i or 1)
  return self
end
function World:unbind()
  self.handle:unbind()
  return self
end

-- ids i32 [T, K] per local rank -> all ids i32 [W, T, K] per local rank.
function World:allgather_ids(ids, out)
  local list, one = per_rank(self, "allgather_ids", "ids", ids, is_tensor)
  local outs = {}
  if out ~= nil and not is_tensor(out) and type(out) ~= "table" then
    args.fail("allgather_ids", "out must be a tensor or a list of one per local rank, got " .. args.describe(out))
  end
  if is_tensor(out) and #list ~= 1 then
    args.fail("allgather_ids", string.format("out must be a list of %d tensors (one per local rank)", #list))
  end
  for i, t in ipairs(list) do
    args.tensor("allgather_ids", "ids", t, "i32", { false, false })
    local want = { self.size, t.shape[1], t.shape[2] }
    local o = out
    if o ~= nil and not is_tensor(o) then o = o[i] end -- a list of outputs, or the one tensor
    outs[i] = o and args.tensor("allgather_ids", string.format("out[%d]", i), o, "i32", want)
      or core.new("i32", want, t.device)
  end
  self.handle:allgather_ids(outs, list)
  return one and outs[1] or outs
end

-- cfg = {tokens=, k=, experts=, hidden=, capacity=, pad=, layout=, expert_capacity=}: the same
-- on every rank or every rank fails with the ranks and the field that differ.
function World:check_config(cfg)
  local list = per_rank(self, "check_config", "cfg", cfg, function(v) return type(v) == "table" and v.tokens ~= nil end)
  local full = {}
  for i, c in ipairs(list) do
    full[i] = {}
    for k, v in pairs(c) do full[i][k] = v end
    full[i].world = full[i].world or self.size
    full[i].version = full[i].version or core.version_number
  end
  self.handle:check_config(full)
  return self
end

-- a table of one rank's arguments (rather than a list of them): any of the stage's own keys
local function is_args(v)
  return type(v) == "table" and (v.x ~= nil or v.schedule ~= nil or v.y ~= nil or v.weights ~= nil)
end

-- The calls of dispatch per local rank and the tensors made for them ({out =, x_all =, ...}, a
-- list each); the all-gather exchange (direct = false) also takes x_all, every rank's tokens; the
-- FP8 one (fp8 = true) e4m3 tokens, their scales x_scale and the gathered scales x_scale_all.
local function dispatch_calls(self, o, direct, fp8)
  local fname, dtype = fp8 and "dispatch_fp8" or "dispatch", fp8 and "e4m3" or "bf16"
  local list, one = per_rank(self, fname, "arguments", o, is_args)
  local calls, made = {}, { out = {}, x_all = {}, out_scale = {}, x_scale_all = {} }
  for i, a in ipairs(list) do
    args.options(fname, a, { x = "tensor", schedule = "table", out = "tensor", x_all = not direct and "tensor" or nil,
      x_scale = fp8 and "tensor" or nil, out_scale = fp8 and "tensor" or nil, x_scale_all = fp8 and "tensor" or nil,
      zero_fill = "boolean" }, fp8 and { "x", "x_scale", "schedule" } or { "x", "schedule" })
    local s = a.schedule
    local x = args.tensor(fname, "x", a.x, dtype, { s.tokens, false })
    local H, dev = x.shape[2], x.device
    local c = { out = a.out or core.new(dtype, { s.capacity, H }, dev), x = x, peer_rank = s.peer_rank,
      peer_route = s.peer_route, route_row = s.route_row, k = s.k, zero_fill = a.zero_fill or false }
    if not direct then c.x_all = a.x_all or core.new(dtype, { self.size, s.tokens, H }, dev) end
    if fp8 then
      if H % 128 ~= 0 then
        args.fail(fname, string.format("x's hidden size must be a multiple of 128 (the FP8 block), got %d", H))
      end
      local nb = math.floor(H / 128)
      c.x_scale = args.tensor(fname, "x_scale", a.x_scale, "f32", { s.tokens, nb })
      c.out_scale = a.out_scale or core.new("f32", { nb, s.capacity }, dev)
      c.x_scale_all = a.x_scale_all or core.new("f32", { self.size, s.tokens, nb }, dev)
    end
    calls[i] = c
    for k, v in pairs(made) do v[i] = c[k] end
  end
  return calls, made, one
end

-- {x = bf16 [T, H], schedule = this rank's moe.Schedule (of the all-gathered ids), out=, x_all=,
-- zero_fill=} per local rank -> out bf16 [C, H] (and x_all, every rank's tokens).
function World:dispatch(o)
  local calls, made, one = dispatch_calls(self, o, false)
  self.handle:dispatch(calls)
  if one then return made.out[1], made.x_all[1] end
  return made.out, made.x_all
end

-- {x = e4m3 [T, H], x_scale = f32 [T, H/128] (moe.quantize kind "token"), schedule =, out=,
-- out_scale=, x_all=, x_scale_all=, zero_fill=} per local rank -> out e4m3 [C, H], out_scale f32
-- [H/128, C] (and x_all, x_scale_all: every rank's tokens and scales), as moe.dispatch of FP8
-- tokens over a simulated world gives them.  The all-gather exchange: the direct one has no FP8 form.
function World:dispatch_fp8(o)
  local calls, made, one = dispatch_calls(self, o, false, true)
  self.handle:dispatch_fp8(calls)
  if one then return made.out[1], made.out_scale[1], made.x_all[1], made.x_scale_all[1] end
  return made.out, made.out_scale, made.x_all, made.x_scale_all
end

-- The scratch of combine ([W, T*K, H] rows and [W, T*K] marks, twice), kept per shape and device.
local function combine_scratch(self, TK, H, dev)
  local key = string.format("%d:%d:%s", TK, H, dev)
  local b = self.scratch[key]
  if not b then
    local W = self.size
    b = { send_rows = core.new("bf16", { W, TK, H }, dev), recv_rows = core.new("bf16", { W, TK, H }, dev),
      send_index = core.new("i32", { W, TK }, dev), recv_index = core.new("i32", { W, TK }, dev) }
    self.scratch[key] = b
  end
  return b
end

local function combine_calls(self, o, direct)
  local list, one = per_rank(self, "combine", "arguments", o, is_args)
  local calls, outs = {}, {}
  for i, a in ipairs(list) do
    args.options("combine", a, { schedule = "table", y = "tensor", weights = "tensor", ids = "tensor", out = "tensor",
      dtype = { "bf16", "f32" }, shared = "tensor", shared_gate = "tensor" }, { "schedule", "y", "weights" })
    local s = a.schedule
    local y = args.tensor("combine", "y", a.y, "bf16", { s.capacity, false })
    local T, K, H = s.tokens, s.k, y.shape[2]
    args.tensor("combine", "weights", a.weights, "f32", { T, K })
    local ids = a.ids or s.ids:select(s.rank + 1)
    args.same_dtype("combine", a.out, a.dtype)
    outs[i] = a.out or core.new(a.dtype or "bf16", { T, H }, y.device)
    calls[i] = { out = outs[i], weights = a.weights, ids = ids, ys = y, route_row = s.route_row,
      experts = s.experts, shared = a.shared, shared_gate = a.shared_gate }
    if not direct then
      local b = combine_scratch(self, T * K, H, y.device)
      calls[i].send_rows, calls[i].recv_rows = b.send_rows, b.recv_rows
      calls[i].send_index, calls[i].recv_index = b.send_index, b.recv_index
    end
  end
  return calls, outs, one
end

-- {schedule = this rank's schedule, y = its experts' output bf16 [C, H], weights = f32 [T, K],
-- ids = i32 [T, K] (default: the schedule's, this rank's), out=, dtype=, shared=, shared_gate=}
-- per local rank -> out [T, H]: the same bits as moe.combine over a simulated world.
function World:combine(o)
  local calls, outs, one = combine_calls(self, o, false)
  self.handle:combine(calls)
  return one and outs[1] or outs
end

-- world:exchange{tokens=, k=, hidden=, capacity=} -> the direct exchange (README): every rank's
-- tokens and expert outputs in windows the peers read over NVLink.  Collective: every rank
-- makes it with the same sizes.  ex.x[i] and ex.ys[i] are local rank i's windows (bf16 [T, H],
-- [C, H]): tokens written into ex.x and expert outputs into ex.ys are not copied again.
-- ex:dispatch and ex:combine take World:dispatch's and World:combine's arguments (no x_all).
-- The windows are freed with the exchange, once nothing refers to it or to them (a graph that
-- captured its dispatch or combine refers to it).
local Exchange = { __name = "moelab.Exchange" }
Exchange.__index = Exchange

function World:exchange(o)
  args.options("exchange", o, { tokens = "integer", k = "integer", hidden = "integer", capacity = "integer" },
    { "tokens", "k", "hidden", "capacity" })
  local h, x, ys = self.handle:exchange(o.tokens, o.k, o.hidden, o.capacity)
  return setmetatable({ handle = h, world = self, x = x, ys = ys, tokens = o.tokens, k = o.k, hidden = o.hidden,
    capacity = o.capacity }, Exchange)
end

function Exchange:dispatch(o)
  local calls, made, one = dispatch_calls(self.world, o, true)
  self.handle:dispatch(calls)
  return one and made.out[1] or made.out
end

function Exchange:combine(o)
  local calls, outs, one = combine_calls(self.world, o, true)
  self.handle:combine(calls)
  return one and outs[1] or outs
end

function Exchange:__tostring()
  return string.format("moelab.Exchange(%d tokens, top-%d, hidden %d, capacity %d; %s)", self.tokens, self.k,
    self.hidden, self.capacity, tostring(self.world))
end

args.methods(World, "world")
args.methods(Exchange, "ex")

world.new, world.World, world.Exchange, world.unique_id = new_world, World, Exchange, core.world_unique_id
return world
