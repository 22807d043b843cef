-- SPDX-License-Identifier: MIT
-- The fuzzer's random source: the Park-Miller "minimal standard" generator (x <- 48271 x mod
-- 2^31 - 1).  Its products stay below 2^47, exact in a double as in a 64-bit integer, so one seed
-- gives one sequence under Lua 5.4 and LuaJIT alike, and it leaves math.random, which other
-- suites seed, alone.
local Rng = {}
Rng.__index = Rng

local M = 2147483647

function Rng.new(seed)
  local s = (seed * 7919 + 12345) % M
  if s == 0 then s = 1 end
  local self = setmetatable({ s = s }, Rng)
  for _ = 1, 4 do self:next() end -- nearby seeds start far apart
  return self
end

-- An integer in [1, 2^31 - 2].
function Rng:next()
  self.s = self.s * 48271 % M
  return self.s
end

-- An integer in [a, b].
function Rng:int(a, b)
  return a + self:next() % (b - a + 1)
end

-- A number in [0, 1).
function Rng:float() return (self:next() - 1) / (M - 1) end

function Rng:chance(p) return self:float() < p end

function Rng:pick(list) return list[self:int(1, #list)] end

return Rng
