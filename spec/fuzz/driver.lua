-- SPDX-License-Identifier: MIT
-- The fuzzer's loop: one sequence of random calls per seed over the public Lua API, each judged
-- by the invariants of docs/developing.md ("The fuzzer"):
--   * a call either raises an error whose message is a sentence that starts with the public name
--     of what was called (or "bad argument #n to '<name>'"), with no location inside moelab,
--     or returns, and then its result is what the second computation (spec/fuzz/oracle.lua, the
--     shadows of spec/fuzz/pool.lua) says it must be;
--   * a call the fuzzer knows to be a misuse (an unknown option, a value of the wrong kind, a
--     closed tensor, ...) raises;
--   * no call changes what it was not asked to write: after each call some tensors of the
--     sequence are compared with their shadows, and all of them at the end.
-- A crash or a sanitizer report ends the process: MOE_FUZZ_VERBOSE=1 prints each call before it
-- runs, so the last line names it.
local Rng = require "fuzz.rng"
local Pool = require "fuzz.pool"
local show = require "fuzz.show"
local mutate = require "fuzz.mutate"

local D = {}

local moe = require "moelab"
local unpack = mutate.unpack
local function pack(...) return { n = select("#", ...), ... } end

-- ---------------------------------------------------------------- the state of one sequence

local F = {}
F.__index = F

local function new_state(seed, log_io)
  local self = setmetatable({ seed = seed, rng = Rng.new(seed), pool = Pool.new(), log = {}, log_io = log_io,
    schedules = {}, layers = {}, events = {} }, F)
  -- a device that names a GPU this machine does not have
  self.absent_device = "cuda:" .. moe.core.device_count("cuda")
  return self
end

-- An open tensor of the sequence (of dtype, if given), made when there is none.
function F:any_tensor(dtype)
  local open = self.pool:open(function(e) return (not dtype or e.dtype == dtype) and not e.buf.volatile end)
  if #open > 0 and self.rng:chance(0.8) then return self.rng:pick(open).t end
  local t = moe.zeros({ self.rng:int(0, 3) }, { dtype = dtype or self.rng:pick { "f32", "bf16", "i32" } })
  self.pool:add(t)
  return t
end

-- A closed tensor (a handle its owner closed).
function F:closed_tensor()
  local closed = {}
  for _, e in ipairs(self.pool.entries) do if e.closed then closed[#closed + 1] = e end end
  if #closed > 0 and self.rng:chance(0.7) then return self.rng:pick(closed).t end
  local t = moe.zeros({ 2 })
  local e = self.pool:add(t)
  D.close(e.t)
  e.closed = true
  return t
end

-- A new tensor of dtype and shape holding vals (flat), part of the sequence: the set-up of a
-- call, which must not fail.
function F:fresh(dtype, shape, vals)
  local t = moe.tensor(vals, { dtype = dtype, shape = shape })
  self.pool:add(t)
  return t
end

-- n random values every dtype holds exactly (quarters in [-lo, lo]), as a flat table.
function F:values(n, lo)
  local v = {}
  lo = lo or 4
  for i = 1, n do v[i] = self.rng:int(-4 * lo, 4 * lo) / 4 end
  return v
end

-- The source of a call: target(args...) with the sequence's objects by name.
function F:text(target, args, n)
  return target .. "(" .. show.args(args, n, self.pool.names) .. ")"
end

-- Calls are compiled from their source, so that Lua's own names in errors ("bad argument #1 to
-- 'get'", "method 'fill'") are those a script gets; their chunk is named CHUNK.
local CHUNK = "fuzzcall"
-- never a tail call: Lua would then not know the name the call was made by
local PRELUDE = "local moe, unpack = ...\nlocal function pk(...) return { n = select('#', ...), ... } end\n"
local compiled = {}
local function compile(code)
  local f = compiled[code]
  if not f then
    f = assert(load(PRELUDE .. code, "=" .. CHUNK))(moe, unpack)
    compiled[code] = f
  end
  return f
end

local function params(n)
  local p = {}
  for i = 1, n do p[i] = "a" .. i end
  return table.concat(p, ", ")
end

-- A call of a function of the module by its path from moe (c.name, "moe.zeros"): args (a
-- list), n (how many, nils included); the rest of c (bad, check, on_error, names) is kept.
function F:call(c)
  local args, n = c.args or {}, c.n or #(c.args or {})
  c.text = c.text or self:text(c.name, args, n)
  local f = compile(string.format("return function(%s) local r = pk(%s(%s)) return unpack(r, 1, r.n) end",
    params(n), c.name, params(n)))
  c.fn = function() return f(unpack(args, 1, n)) end
  return c
end

-- A method call obj:method(args...), or obj.method(args...) when c.dot (the wrong style, where
-- obj is not passed).
function F:method(c)
  local obj, args, n = c.obj, c.args or {}, c.n or #(c.args or {})
  local oname = self.pool.names[obj] or show.value(obj, self.pool.names)
  c.name = c.name or (oname .. ":" .. c.method)
  if c.dot then c.name = c.name:gsub(":", ".", 1) end -- the allow-list tells the wrong style by its dot
  c.text = string.format("%s%s%s(%s)", oname, c.dot and "." or ":", c.method, show.args(args, n, self.pool.names))
  local f = compile(string.format("return function(obj%s%s) local r = pk(obj%s%s(%s)) return unpack(r, 1, r.n) end",
    n > 0 and ", " or "", params(n), c.dot and "." or ":", c.method, params(n)))
  c.fn = function() return f(obj, unpack(args, 1, n)) end
  return c
end

-- An expression over obj (a field read, an assignment): code uses the name obj.
function F:expr(c, obj, code)
  local f = compile("return function(obj) " .. code .. " end")
  c.fn = function() return f(obj) end
  return c
end

function F:say(line)
  self.log[#self.log + 1] = line
  if self.log_io then
    self.log_io:write(line, "\n")
    self.log_io:flush()
  end
end

-- ---------------------------------------------------------------- judging one call

-- Closes a tensor, as t:close() or a <close> variable leaving its scope does.
function D.close(t) t:close() end

-- A position at the caller's line: the fuzzer's own files (where the calls are written).
local OWN_POSITION = "^" .. CHUNK .. ":%d+: "

-- The message without the caller's position, and whether it had one.
local function body_of(msg)
  local body = msg:gsub(OWN_POSITION, "", 1)
  return body, body ~= msg
end

-- What is wrong with an error message raised by a call named by names (the public names it may
-- start with), or nil.
function D.message_problem(msg, names)
  if type(msg) ~= "string" then return "raised a " .. type(msg) .. " instead of a message" end
  if msg == mutate.TRAP then return nil end -- the caller's own error, passed through as it was
  if msg:find(mutate.TRAP, 1, true) then return "the caller's own error came back changed" end
  local body, at_caller = body_of(msg)
  if body:find("%.lua:%d+") or body:find("lua/core/") or body:find("%.c:%d+") or body:find("moelab/[%w_]+%.lua") then
    return "an internal location in the message"
  end
  if at_caller and body:find("^attempt to ") then return nil end -- Lua's own, about the caller's expression
  local name = body:match("^bad argument #%d+ to '([^']*)'") or body:match("^calling '([^']*)' on bad self")
    or body:match("^([%w_.]+):") or body:match("^([%w_.]+) ")
  if not name then return "does not start with a public name or 'bad argument'" end
  for _, ok in ipairs(names) do if name == ok then
    if #body < 16 then return "too short to say what was wrong" end
    return nil
  end end
  return string.format("names '%s', not the function called (%s)", name, table.concat(names, " or "))
end

-- The public names a call's errors may start with: given, or the last name in its text.
local function names_of(c)
  if c.names then return c.names end
  return { c.name:match("([%w_]+)$") }
end

-- Whether the allow-list forgives this problem of call c: kind "message" (an unclear error),
-- "accepted" (a misuse let through) or "effect" (a refused call that changed something).
local function allowed(allow, kind, c, body)
  for _, a in ipairs(allow or {}) do
    if a.kind == kind and c.name:find(a.call) and (kind ~= "message" and c.text:find(a.text or "", 1, true)
      or kind == "message" and body:find(a.message)) then
      a.hits = (a.hits or 0) + 1
      a.example = a.example or (kind == "message" and (c.text .. "\n      -> " .. body) or c.text)
      return true
    end
  end
  return false
end

-- A call that takes longer than this (seconds) is a problem: every call of the fuzzer is small.
local SLOW = 5

-- Runs call c; returns nil, or the problem found.
function F:judge(c, allow)
  local t0 = moe.core.now()
  local res = pack(pcall(c.fn))
  local took = moe.core.now() - t0
  if took > SLOW then return string.format("the call took %.1f s; every call of the fuzzer is small", took) end
  self.stats = self.stats or {}
  local st = self.stats[c.kind or c.name] or { calls = 0, ok = 0, errors = 0 }
  self.stats[c.kind or c.name] = st
  st.calls = st.calls + 1
  if c.verdict then -- a call whose raising is its answer (moe.check)
    if res[1] then st.ok = st.ok + 1 else st.errors = st.errors + 1 end
    if not res[1] and res[2] == mutate.TRAP then return nil end
    return c.verdict(res)
  end
  if res[1] then
    st.ok = st.ok + 1
    if c.bad then
      if allowed(allow, "accepted", c, "") then return nil end -- a known gap: what it returned means nothing
      return "returned instead of refusing a misuse: " .. c.bad
    end
    if c.check then
      local ok, problem = pcall(c.check, res)
      if not ok then return "reading the result back raised: " .. tostring(problem) end
      return problem
    end
    return nil
  end
  st.errors = st.errors + 1
  local msg = res[2]
  if c.on_error then c.on_error(msg) end
  local problem = D.message_problem(msg, names_of(c))
  if problem and not allowed(allow, "message", c, body_of(tostring(msg))) then
    return problem .. ":\n      " .. tostring(msg)
  end
  if c.after_error then
    problem = c.after_error(msg)
    if problem and c.effect and allowed(allow, "effect", c, "") then return nil end
    return problem
  end
end

-- Compares k random tensors of the sequence (all, when k is nil) with their shadows.
function F:sentinels(k)
  local entries = self.pool.entries
  if #entries == 0 then return nil end
  local list = entries
  if k then
    list = {}
    for i = 1, k do list[i] = self.rng:pick(entries) end
  end
  for _, e in ipairs(list) do
    local problem = self.pool:verify(e)
    if problem then return "a tensor changed that no call wrote: " .. problem end
  end
end

-- ---------------------------------------------------------------- the canary

-- A valid call with a known answer, made again through every sequence: a forward of a small
-- Kimi K2 layer over two ranks (route, schedule, dispatch, experts, shared expert, combine) on a
-- fixed input, held to the dense reference once, then bit for bit to its first output.  Its
-- tensors are the fuzzer's alone: a change means memory that no call may touch was written, or
-- state the module keeps (its kernel options, its context) went wrong.
local canary
local function canary_problem()
  if not canary then
    local l = moe.layer { model = "kimi_k2", world = 2, tokens = 4, hidden = 16, ffn = 8, shared_ffn = 8, seed = 3,
      device = "cpu" }
    local x = moe.randn({ 2, 4, 16 }, { seed = 5, dtype = "bf16" })
    local out = l:forward(x):flat()
    local m = l:check(x, { raise = false })
    if not m.pass then
      return string.format("the canary layer fails its reference (max |got - ref| %.4g of %.4g)", m.max_abs, m.max_ref)
    end
    canary = { layer = l, x = x, out = out }
  end
  local ok, out = pcall(canary.layer.forward, canary.layer, canary.x)
  if not ok then return "the canary layer's forward raised: " .. tostring(out) end
  local got = out:flat()
  for i = 1, #canary.out do
    if got[i] ~= canary.out[i] then
      return string.format("the canary layer's output changed at element %d: %s, first %s", i, tostring(got[i]),
        tostring(canary.out[i]))
    end
  end
end

-- ---------------------------------------------------------------- a sequence

-- Calls between two runs of the canary.
local CANARY_EVERY = 16

-- Picks a generator by weight.
local function pick(rng, gens, total)
  local x = rng:float() * total
  for _, g in ipairs(gens) do
    x = x - g.weight
    if x < 0 then return g end
  end
  return gens[#gens]
end

-- Runs one sequence of `calls` calls from seed; gens: { {name=, weight=, gen=function(F) -> call}, ... }.
-- -> { failure = nil or { seed, index, problem, log }, stats = {name -> {calls, ok, errors}} }
function D.sequence(seed, calls, gens, allow, log_io)
  local state = new_state(seed, log_io)
  local total = 0
  for _, g in ipairs(gens) do total = total + g.weight end
  local failure
  for i = 1, calls do
    local g = pick(state.rng, gens, total)
    local made, c = pcall(g.gen, state)
    local problem
    if not made then
      problem = "building a valid call raised (the library refused what the contract allows, or the fuzzer is wrong): "
        .. tostring(c)
      state:say(string.format("[%d] (making a %s call)", i, g.name))
    else
      c.kind = c.kind or g.name
      state:say(string.format("[%d] %s%s", i, c.text, c.bad and ("  -- must fail: " .. c.bad) or ""))
      problem = state:judge(c, allow)
    end
    problem = problem or state:sentinels(2)
    if not problem and i % CANARY_EVERY == 0 then problem = canary_problem() end
    if problem then
      failure = { seed = seed, index = i, problem = problem }
      break
    end
  end
  if not failure then
    local problem = state:sentinels(nil) or canary_problem()
    if problem then failure = { seed = seed, index = calls, problem = "at the end: " .. problem } end
  end
  moe.config { schedule_kernel = "auto", experts_kernel = "auto" } -- the kernel options as the suites expect them
  if failure then failure.log = state.log end
  local stats = state.stats or {}
  state.pool, state.layers, state.schedules = nil, nil, nil
  collectgarbage()
  return { failure = failure, stats = stats }
end

-- The report of a failure: the seed, how to replay it, the problem and the calls before it.
function D.report(f, calls, shown)
  local lines = {
    string.format("fuzz: seed %d failed at call %d of %d: %s", f.seed, f.index, calls, f.problem),
    "the call: " .. (f.log[#f.log] or "?"),
    string.format("replay: MOE_FUZZ_SEED=%d MOE_FUZZ_CALLS=%d MOE_FUZZ_VERBOSE=1 busted spec/fuzz_spec.lua", f.seed,
      f.index),
    "the calls of the sequence (the last is the failing one):",
  }
  local from = math.max(1, #f.log - (shown or 40) + 1)
  if from > 1 then lines[#lines + 1] = string.format("  ... %d earlier calls", from - 1) end
  for i = from, #f.log do lines[#lines + 1] = "  " .. f.log[i] end
  return table.concat(lines, "\n")
end

return D
