-- SPDX-License-Identifier: MIT
-- The rest of the surface: moe.config, moe.bench, moe.check, moe.event and moe.graph, moe.world
-- and the World methods (on the CPU every world must be refused), moe.devices.
local moe = require "moelab"
local mutate = require "fuzz.mutate"
local T = require "fuzz.tensors"

local G = {}
local plain = T.plain

-- ---------------------------------------------------------------- moe.config

local KERNELS = { schedule_kernel = { "auto", "bitmap", "grid" }, experts_kernel = { "auto", "mma", "sm90w", "sm90x1",
  "sm90x2" } }

function G.config(F)
  local o
  local bad
  local r = F.rng:int(1, 8)
  if r == 1 then o = nil
  elseif r <= 4 then
    o = {}
    for name, list in pairs(KERNELS) do if F.rng:chance(0.5) then o[name] = F.rng:pick(list) end end
  elseif r <= 6 then
    o = { [F.rng:pick { "schedule_kernel", "experts_kernel" }] = F.rng:pick { "fastest", "", "AUTO", "mma " } }
    bad = "no such kernel"
  else
    local _
    o, _, bad = mutate.options(F, { experts_kernel = "auto" }, { schedule_kernel = { kind = "str", choices = { "auto" } },
      experts_kernel = { kind = "str", choices = { "auto" } } })
    if bad == nil and plain(o) then
      for _, v in pairs(o) do if v ~= "auto" then bad = "no such kernel" end end
    end
  end
  local before = moe.config()
  local c = F:call { name = "moe.config", args = { o }, n = 1, bad = bad }
  c.check = function(res)
    local now = res[2]
    if type(now) ~= "table" then return "config() gave " .. type(now) end
    for name in pairs(KERNELS) do
      local want = (plain(o) and o[name]) or before[name]
      if now[name] ~= want then
        return string.format("config's %s is %s, expected %s", name, tostring(now[name]), tostring(want))
      end
    end
  end
  c.after_error = function()
    local now = moe.config()
    for name in pairs(KERNELS) do
      if now[name] ~= before[name] then return "a refused config changed " .. name .. " (all or nothing)" end
    end
  end
  return c
end

-- ---------------------------------------------------------------- moe.bench

function G.bench(F)
  local count = 0
  local fn = function() count = count + 1 end
  local o = { warmup = F.rng:chance(0.7) and F.rng:int(0, 2) or nil, iters = F.rng:chance(0.7) and F.rng:int(1, 3) or nil,
    device = "cpu" }
  local bad
  local r = F.rng:int(1, 10)
  if r <= 3 then
    local _
    -- no large count is valid here: bench would run it
    local count_edges = { 0, -1, 1.5, 0 / 0, math.huge, -2 ^ 31, 2 ^ 63 }
    o, _, bad = mutate.options(F, o, { warmup = { kind = "int", edges = count_edges, ok = function(v) return v >= 0 end },
      iters = { kind = "int", edges = count_edges, ok = function(v) return v >= 1 end }, device = { kind = "device" } })
    if plain(o) and o.device == nil then o.device = "cpu" end -- the default device could be a GPU
  elseif r == 4 then
    fn = F.rng:pick { nil, 3, "f", {}, setmetatable({}, { __call = function() end }) }
    bad = "not a function"
  elseif r == 5 then
    fn = mutate.trap
  elseif r == 6 then
    o.device = F.rng:pick { F.absent_device, "gpu" }
    bad = "not a device here"
  end
  local c = F:call { name = "moe.bench", args = { fn, o }, n = 2, bad = bad }
  -- a refusal comes before the function runs
  c.effect = true
  c.after_error = function()
    if count > 0 then return string.format("bench ran the function %d times, then refused", count) end
  end
  c.check = function(res)
    local b = res[2]
    if type(b) ~= "table" or type(b.median_ms) ~= "number" or not (b.min_ms <= b.median_ms and b.median_ms <= b.max_ms) then
      return "bench's result is not ordered times"
    end
    if plain(o) then
      local want = (o.warmup or 3) + (o.iters or 10)
      if count ~= want or b.iters ~= (o.iters or 10) then
        return string.format("bench ran the function %d times, expected %d", count, want)
      end
    end
  end
  return c
end

-- ---------------------------------------------------------------- moe.check

local function flat_or_tensor(F, e)
  if F.rng:chance(0.3) then return F.pool:shadow(e), true end
  return e.t, false
end

function G.check(F)
  local open = F.pool:open(function(e) return e.numel <= 64 end)
  if #open == 0 then return T.maker(F) end
  local a = F.rng:pick(open)
  local b = F.rng:chance(0.4) and a or F.rng:pick(open)
  local fname = F.rng:pick { "equal", "close", "metrics" }
  local x, xflat = flat_or_tensor(F, a)
  local y, yflat = flat_or_tensor(F, b)
  local args, n = { x, y }, 2
  local bad
  local r = F.rng:int(1, 8)
  if r == 1 then
    args[F.rng:int(1, 2)] = F.rng:pick { nil, 1, "t", { 1, "x" }, F:closed_tensor() }
    bad = "not a tensor or a flat table of numbers"
  elseif r == 2 and fname == "close" then
    local _
    args[3], _, bad = mutate.options(F, { rtol = 0.5 }, { rtol = { kind = "num", ok = function(v) return v >= 0 end },
      atol = { kind = "num", ok = function(v) return v >= 0 end }, l2 = { kind = "num", ok = function(v) return v >= 0 end },
      what = { kind = "string" } })
    n = 3
  end
  local c = F:call { name = "moe.check." .. fname, args = args, n = n, bad = bad, names = { "check", fname, "check." .. fname } }
  -- equal: raises exactly when the values (or, for two tensors, the shapes) differ
  if fname == "equal" and not bad then
    local va, vb = F.pool:shadow(a), F.pool:shadow(b)
    local same = #va == #vb
    for i = 1, math.min(#va, #vb) do
      if va[i] ~= vb[i] and not (va[i] ~= va[i] and vb[i] ~= vb[i]) then same = false end
    end
    if not xflat and not yflat and not T.shape_equal(a.shape, b.shape) then same = false end
    c.verdict = function(res)
      if res[1] then return not same and "check.equal passed on different values" or nil end
      if same then return "check.equal raised on equal values: " .. tostring(res[2]) end
      local body = tostring(res[2])
      if not (body:find("differ", 1, true)) then return "check.equal's verdict does not say what differs: " .. body end
    end
  elseif fname ~= "equal" and not bad then
    -- a verdict, not a misuse: "not close" is the answer of close
    c.verdict = function(res)
      if res[1] then
        if fname == "metrics" and type(res[2]) ~= "table" then return "metrics gave " .. type(res[2]) end
        return nil
      end
      local body = tostring(res[2])
      if body:find("not close", 1, true) or body:find("differ", 1, true) or body:find("elements", 1, true) then return nil end
      return "check." .. fname .. " raised what is not a verdict: " .. body
    end
  end
  return c
end

-- ---------------------------------------------------------------- events and graphs

function G.event(F)
  local r = F.rng:int(1, 8)
  if r <= 2 then
    local dev = F.rng:pick { "cpu", "cpu", nil, F.absent_device, 7, "gpu" }
    local bad = dev ~= nil and dev ~= "cpu" and "not a device here" or nil
    local c = F:call { name = "moe.event", args = { dev }, n = 1, bad = bad }
    c.check = function(res)
      F.pool:name(res[2], "e")
      F.events[#F.events + 1] = { e = res[2] }
    end
    return c
  end
  if #F.events == 0 or r == 3 then
    local fn = F.rng:pick { function() end, nil, 5 }
    -- the default device only where it is the CPU: a GPU would capture
    local o = (F.rng:chance(0.5) or moe.default_device() ~= "cpu") and { device = "cpu" } or nil
    return F:call { name = "moe.graph", args = { fn, o }, n = 2, bad = "a graph on the CPU" }
  end
  local ev = F.rng:pick(F.events)
  if F.rng:chance(0.5) then
    local c = F:method { obj = ev.e, method = "record", name = "event:record", dot = F.rng:chance(0.1), names = { "record", "event" } }
    if c.dot then c.bad = "a method called with '.'" end
    c.check = function() ev.recorded = true end
    return c
  end
  local other = F.rng:chance(0.8) and F.rng:pick(F.events) or { e = F.rng:pick { 1, {}, F:any_tensor() }, fake = true }
  local c = F:method { obj = ev.e, method = "elapsed_since", args = { other.e }, n = 1, name = "event:elapsed_since",
    names = { "elapsed_since", "event" } }
  if not other.recorded or not ev.recorded then c.bad = "an event never recorded" end
  if other.fake then c.bad = "not an event" end
  c.check = function(res)
    if type(res[2]) ~= "number" or res[2] ~= res[2] then return "elapsed_since gave " .. tostring(res[2]) end
  end
  return c
end

-- ---------------------------------------------------------------- worlds

local HEX = string.rep("0123456789abcdef", 16)

-- moe.world on a machine without a GPU: every call must be refused, and none may wait long (an id
-- file is never one that a rank other than 0 would wait for).  moe.world_unique_id is left out:
-- where NCCL is built in, each id starts a bootstrap thread that listens until the process ends.
function G.world(F)
  if moe.default_device() ~= "cpu" then return T.maker(F) end -- a GPU would open a world: not here
  local o = F.rng:pick {
    { rank = 0, size = 1, device = 0, id = HEX },
    { devices = { 0 } },
    { devices = { 0, 1 } },
    { rank = 0, size = 2, device = 0, id_file = "/nonexistent/nccl.id" },
    { rank = 1, size = 2, device = 0, id_file = "/nonexistent/nccl.id", id_wait = 0 },
  }
  local _
  if F.rng:chance(0.6) then
    o, _ = mutate.options(F, o, { rank = { kind = "int" }, size = { kind = "int" }, device = { kind = "int" },
      id = { kind = "str", choices = { HEX } }, devices = { kind = "table" }, id_wait = { kind = "num" } })
  end
  -- never a wait for a file: one of rank 0 (which writes it) or with no wait
  if type(o) == "table" then
    if rawget(o, "id_file") ~= nil and rawget(o, "rank") ~= 0 then rawset(o, "id_wait", 0) end
    rawset(o, "from_env", nil)
  end
  local c = F:call { name = "moe.world", args = { o }, n = 1, bad = "a world without a GPU" }
  return c
end

-- A World's methods called on what is not a world: the wrong call style, or another table.
function G.world_method(F)
  local m = F.rng:pick { "allgather_ids", "check_config", "dispatch", "combine", "exchange", "bind", "close" }
  local self_ = F.rng:pick { {}, F:any_tensor(), 3 }
  local c = F:call { name = "moe.World." .. m, args = { self_, {} }, n = 2, bad = "a World method on what is not a world",
    names = { m, "world" } }
  return c
end

-- ---------------------------------------------------------------- the module's other functions

function G.module(F)
  local r = F.rng:int(1, 3)
  if r == 1 then
    return F:call { name = "moe.devices", check = function(res)
      if type(res[2]) ~= "table" or res[2][1] ~= "cpu" then return "devices() does not list the CPU first" end
    end }
  end
  if r == 2 then
    return F:call { name = "moe.default_device", check = function(res)
      if res[2] ~= moe.devices()[2] and res[2] ~= "cpu" then return "default_device() is " .. tostring(res[2]) end
    end }
  end
  return { name = "moe.version", text = "moe.version", fn = function() return moe.version end, check = function(res)
    if type(res[2]) ~= "string" or not res[2]:match("^%d+%.%d+") then return "moe.version is " .. tostring(res[2]) end
  end }
end

return G
