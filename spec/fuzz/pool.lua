-- SPDX-License-Identifier: MIT
-- What the fuzzer knows of the objects a sequence made: each tensor handle with its place in a
-- buffer (views share their base's buffer), and the buffer's contents as the calls so far must
-- have left them (the shadow).  A call that fails must leave every shadow true; one that
-- succeeds changes only what it writes.  Buffers the library rewrites on its own (a schedule's
-- outputs, a layer's output) are volatile: their shadow is taken again when read.
local Pool = {}
Pool.__index = Pool

function Pool.new()
  return setmetatable({ entries = {}, names = setmetatable({}, { __mode = "k" }), counters = {} }, Pool)
end

-- A fresh name with prefix for obj, which the call log then shows by it.
function Pool:name(obj, prefix)
  if self.names[obj] then return self.names[obj] end
  self.counters[prefix] = (self.counters[prefix] or 0) + 1
  local name = prefix .. self.counters[prefix]
  self.names[obj] = name
  return name
end

local function numel(shape)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return n
end
Pool.numel = numel

-- Adds tensor t (open, on the CPU) with its contents read back: a buffer of its own, or, with
-- parent and offset, a window of the parent's buffer.  volatile: the library may rewrite it.
function Pool:add(t, parent, offset, volatile)
  local e = { t = t, shape = t.shape, dtype = t.dtype, numel = t:numel() }
  if parent then
    e.buf, e.off, e.owner = parent.buf, parent.off + offset, parent.owner
  else
    e.buf, e.off = { vals = t:flat(), volatile = volatile }, 0
  end
  e.name = self:name(t, "t")
  self.entries[#self.entries + 1] = e
  return e
end

function Pool:entry_of(t)
  for _, e in ipairs(self.entries) do if rawequal(e.t, t) then return e end end
end

-- The open entries (filter(e) true, when given).
function Pool:open(filter)
  local out = {}
  for _, e in ipairs(self.entries) do
    if not e.closed and (not filter or filter(e)) then out[#out + 1] = e end
  end
  return out
end

-- The shadow of e's window (a volatile one read again first).
function Pool:shadow(e)
  if (e.buf.volatile or not e.buf.vals) and not e.closed then self:resync(e) end
  local out = {}
  for i = 1, e.numel do out[i] = e.buf.vals[e.off + i] end
  return out
end

-- Sets the shadow of e's window to vals (flat).
function Pool:write(e, vals)
  for i = 1, e.numel do e.buf.vals[e.off + i] = vals[i] end
end

-- Takes the shadow of e's buffer again from e (after a write the fuzzer does not model).
function Pool:resync(e)
  if e.closed then
    e.buf.vals = nil -- unknown until an open handle reads it
    return
  end
  if not e.buf.vals then e.buf.vals = {} end
  self:write(e, e.t:flat())
end

-- Whether e's contents equal its shadow: nil, or a sentence saying where not.
function Pool:verify(e)
  if e.closed or e.buf.volatile then return nil end
  if not e.buf.vals then
    self:resync(e)
    return nil
  end
  local got = e.t:flat()
  for i = 1, e.numel do
    local g, want = got[i], e.buf.vals[e.off + i]
    if g ~= want and not (g ~= g and want ~= want) then
      return string.format("%s (%s) holds %s at element %d, but the calls so far left %s there (last written by: %s)",
        e.name, tostring(e.t), tostring(g), i, tostring(want), e.buf.last or "its creation")
    end
  end
end

-- Marks what e belongs to (a layer whose known answer a write or a close spoils) as touched.
function Pool.touch(e)
  if e.owner then e.owner.damaged = true end
end

-- Whether two entries' windows share a byte (what t:overlaps must say).
function Pool.overlaps(a, b)
  if a.buf ~= b.buf or a.numel == 0 or b.numel == 0 then return false end
  return a.off < b.off + b.numel and b.off < a.off + a.numel
end

return Pool
