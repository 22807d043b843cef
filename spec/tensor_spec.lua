-- SPDX-License-Identifier: MIT
-- Tensors: values in and out of every dtype, bf16 rounding, shapes, views, randn, copies.
local S = require "support"
local compat = require "moelab.compat"

for _, dev in ipairs(ALL_DEVICES) do
  describe("tensor [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end
    local function T(data, dtype, shape) return moe.tensor(data, { dtype = dtype, device = dev, shape = shape }) end

    describe("round trips", function()
      it("f32 holds f32 values exactly and rounds doubles to the nearest f32", function()
        local vals = { 0, 1, -2.5, 3.25e-5, 1e30, -1e-30, 2 ^ 24 + 1, 0.1, 1 / 3, math.huge, -math.huge }
        local t = T(vals, "f32")
        assert.are.same({ #vals }, t.shape)
        assert.are.equal("f32", t.dtype)
        assert.are.equal(dev, t.device)
        local want = {}
        for i, v in ipairs(vals) do want[i] = S.f32(v) end
        assert.tensor_equal(t, want)
        assert.are.equal(2 ^ 24, t:get(7)) -- 2^24 + 1 is not an f32
      end)
      it("bf16 holds bf16 values exactly", function()
        local vals = { 0, 1, -1, 0.5, 3, 255, 256, -1.5, 2 ^ -10, 1.0078125, 65280, math.huge }
        assert.tensor_equal(T(vals, "bf16"), vals)
      end)
      it("i32 holds every i32", function()
        local vals = { 0, 1, -1, 123456789, 2 ^ 31 - 1, -2 ^ 31 }
        local want = {}
        for i, v in ipairs(vals) do want[i] = compat.tointeger(v) end
        local got = T(vals, "i32"):flat()
        assert.tensor_equal(got, want)
        for _, v in ipairs(got) do assert.are.equal("integer", compat.math_type(v)) end
      end)
      it("NaN survives f32 and bf16", function()
        for _, dt in ipairs { "f32", "bf16" } do
          local v = T({ 0 / 0, 1 }, dt):flat()
          assert.is_true(v[1] ~= v[1], dt)
          assert.are.equal(1, v[2])
        end
      end)
      it("nested tables come back nested, with their shape", function()
        local data = { { { { 1, 2 } }, { { 3, 4 } }, { { 5, 6 } } }, { { { 7, 8 } }, { { 9, 10 } }, { { 11, 12 } } } }
        for _, dt in ipairs { "f32", "bf16", "i32" } do
          local t = T(data, dt)
          assert.are.same({ 2, 3, 1, 2 }, t.shape)
          assert.are.same(data, t:totable())
          assert.tensor_equal(t, { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 })
        end
      end)
      it("shape = {...} reads a flat table", function()
        local t = T({ 1, 2, 3, 4, 5, 6 }, "i32", { 3, 2 })
        assert.are.same({ 3, 2 }, t.shape)
        assert.are.same({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, t:totable())
      end)
      it("every shape from 1-D to 4-D, including empty dimensions", function()
        for _, shape in ipairs { { 5 }, { 2, 3 }, { 2, 3, 4 }, { 2, 1, 3, 2 }, { 0 }, { 3, 0 }, { 2, 0, 4, 1 } } do
          local z = moe.zeros(shape, { device = dev, dtype = "i32" })
          assert.are.same(shape, z.shape)
          local n = 1
          for _, d in ipairs(shape) do n = n * d end
          assert.tensor_equal(z:flat(), S.filled(n, 0))
        end
      end)
      it("moe.full fills with the value rounded to the dtype", function()
        assert.tensor_equal(moe.full({ 2, 2 }, 0.1, { device = dev }), S.filled(4, S.f32(0.1)))
        assert.tensor_equal(moe.full({ 3 }, 1 + 3 * 2 ^ -8, { dtype = "bf16", device = dev }), S.filled(3, 1 + 2 ^ -6))
        assert.tensor_equal(moe.full({ 3 }, -7, { dtype = "i32", device = dev }), { -7, -7, -7 })
      end)
    end)

    describe("bf16 rounds to nearest, ties to even", function()
      it("at the worked examples", function()
        local cases = {
          { 1 + 2 ^ -8, 1 },                       -- a tie, down to the even 1
          { 1 + 3 * 2 ^ -8, 1 + 2 ^ -6 },          -- a tie, up to the even 1 + 2^-6
          { 1 + 2 ^ -8 + 2 ^ -20, 1 + 2 ^ -7 },    -- above the tie: up
          { 1 + 2 ^ -8 - 2 ^ -20, 1 },             -- below the tie: down
          { -(1 + 3 * 2 ^ -8), -(1 + 2 ^ -6) },    -- symmetric
          { 255.5, 256 },                          -- tie between 255 and 256: to 256 (even)
          { 254.5, 254 },                          -- tie between 254 and 255: to 254 (even)
          { 3.4028234663852886e38, math.huge },    -- the largest f32 rounds past the largest bf16
          { 2 ^ -133, 2 ^ -133 },                  -- subnormal, exact
        }
        local xs, want = {}, {}
        for i, c in ipairs(cases) do xs[i], want[i] = c[1], c[2] end
        assert.tensor_equal(T(xs, "bf16"), want)
      end)
      it("as the definition on the bits says, for 20,000 random values", function()
        math.randomseed(42)
        local xs, want = {}, {}
        for i = 1, 20000 do
          local x = (math.random() - 0.5) * 2 ^ S.int(-30, 30)
          if i % 7 == 0 then x = S.int(-70000, 70000) + S.pick { 0, 0.5, 0.25, 0.125 } end
          xs[i], want[i] = x, S.bf16(x)
        end
        assert.tensor_equal(T(xs, "bf16"), want)
      end)
    end)

    describe("views and select", function()
      local function base()
        local v = {}
        for i = 1, 24 do v[i] = i end
        return T(v, "f32", { 2, 3, 4 })
      end
      it("view reads the elements [offset, offset + n)", function()
        local b = base()
        local v = b:view(4, { 2, 4 })
        assert.are.same({ 2, 4 }, v.shape)
        assert.tensor_equal(v, { 5, 6, 7, 8, 9, 10, 11, 12 })
      end)
      it("a view shares its base's memory", function()
        local b = base()
        b:view(4, { 2, 4 }):fill(0)
        local want = {}
        for i = 1, 24 do want[i] = (i >= 5 and i <= 12) and 0 or i end
        assert.tensor_equal(b, want)
      end)
      it("select(i) is the i-th slice of the first dimension", function()
        local b = base()
        local s = b:select(2)
        assert.are.same({ 3, 4 }, s.shape)
        assert.tensor_equal(s, { 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24 })
        assert.tensor_equal(s:select(3), { 21, 22, 23, 24 })
        s:select(1):fill(-1)
        assert.are.same({ -1, -1, -1, -1 }, b:select(2):select(1):flat())
        assert.are.equal(1, b:get(1))
      end)
      it("a view outlives the name of its base", function()
        local v = base():view(20, { 4 })
        collectgarbage()
        collectgarbage()
        assert.tensor_equal(v, { 21, 22, 23, 24 })
      end)
      it("close() makes a handle unusable at once, twice is harmless, and a view keeps its closed base's memory",
        function()
          local b = base()
          local v, w = b:view(0, { 4 }), b:select(2)
          b:close()
          b:close()
          assert.is_true(b.closed)
          assert.are.equal("moelab.Tensor(closed)", tostring(b))
          assert.has_error(function() b:flat() end)
          collectgarbage()
          local others = {} -- memory freed too early would be handed out again here, and overwritten
          for i = 1, 8 do others[i] = T(S.filled(24, -7), "f32", { 2, 3, 4 }) end
          assert.tensor_equal(v, { 1, 2, 3, 4 })
          v:close()
          assert.is_true(v.closed)
          assert.tensor_equal(w:select(1), { 13, 14, 15, 16 }) -- the last view, and a view of it
          w:close()
          assert.has_error(function() w:flat() end)
        end)
      it("views and selects out of range raise", function()
        local b = base()
        assert.has_error(function() b:view(20, { 5 }) end)
        assert.has_error(function() b:view(-1, { 2 }) end)
        -- an offset whose end would pass 2^63 - 1: a clean error, no signed overflow on the way (LuaJIT's
        -- largest integer is 1023 below it: the end fits there)
        local max = compat.int_str(compat.maxinteger)
        local ok, err = pcall(b.view, b, compat.maxinteger, { 1 })
        assert.is_false(ok)
        local want = compat.luajit and "view: elements [" .. max .. ", " or "view: elements from " .. max .. " on lie outside"
        assert.truthy(tostring(err):find(want, 1, true), err)
        assert.has_error(function() b:select(3) end)
        assert.has_error(function() b:select(0) end)
      end)
      it("get(i) reads the i-th element (1-based, flat)", function()
        local b = base()
        assert.are.equal(1, b:get(1))
        assert.are.equal(24, b:get(24))
        assert.has_error(function() b:get(25) end)
      end)
    end)

    describe("copies", function()
      it(":to('cpu') is an independent copy", function()
        local t = T({ 1, 2, 3 }, "f32")
        local c = t:to("cpu")
        assert.are.equal("cpu", c.device)
        assert.tensor_equal(c, { 1, 2, 3 })
        c:fill(5)
        assert.tensor_equal(t, { 1, 2, 3 })
        t:fill(7)
        assert.tensor_equal(c, { 5, 5, 5 })
      end)
      it(":to(device) round-trips every dtype", function()
        for _, dt in ipairs { "f32", "bf16", "i32" } do
          local t = T({ { 1, -2 }, { 3, 4 } }, dt)
          local back = t:to(dev):to("cpu")
          assert.are.same({ 2, 2 }, back.shape)
          assert.are.equal(dt, back.dtype)
          assert.tensor_equal(back, { 1, -2, 3, 4 })
        end
      end)
      it(":copy(src) copies values of the same dtype and size", function()
        local a = T({ 1, 2, 3, 4 }, "i32", { 2, 2 })
        local b = moe.zeros({ 4 }, { dtype = "i32", device = dev })
        b:copy(a)
        assert.tensor_equal(b, { 1, 2, 3, 4 })
        assert.has_error(function() b:copy(T({ 1, 2, 3, 4 }, "f32")) end)
        assert.has_error(function() b:copy(T({ 1, 2, 3 }, "i32")) end)
      end)
      it(":copy between overlapping views of one tensor moves the values as memmove does", function()
        -- large enough that a GPU copy is split over many blocks, whose order nothing fixes
        local n, d = 2 ^ 22, 7
        for _, after in ipairs { true, false } do -- the destination after the source, then before it
          local base = moe.randn({ n }, { seed = 5, device = dev })
          local want = base:to("cpu") -- the CPU's copy is memmove
          local function views(t) return t:view(after and 0 or d, { n - d }), t:view(after and d or 0, { n - d }) end
          local src, dst = views(base)
          dst:copy(src)
          local wsrc, wdst = views(want)
          wdst:copy(wsrc)
          assert.tensor_equal(base:to("cpu"), want)
        end
      end)
    end)

    describe("moe.randn", function()
      it("gives the same values for the same seed", function()
        local a = moe.randn({ 1000 }, { seed = 7, device = dev })
        local b = moe.randn({ 1000 }, { seed = 7, device = dev })
        assert.tensor_equal(a, b)
        assert.tensor_equal(moe.randn({ 10, 100 }, { seed = 7, device = dev }), a:flat())
      end)
      it("gives different values for different seeds", function()
        local a = moe.randn({ 1000 }, { seed = 7, device = dev }):flat()
        local b = moe.randn({ 1000 }, { seed = 8, device = dev }):flat()
        local same = 0
        for i = 1, 1000 do if a[i] == b[i] then same = same + 1 end end
        assert.is_true(same < 10, same .. " of 1000 values equal")
      end)
      it("has mean 0 and standard deviation 1 over 10^5 values", function()
        local v = moe.randn({ 100000 }, { seed = 3, device = dev }):flat()
        local sum, sq = 0, 0
        for i = 1, #v do sum = sum + v[i] end
        local mean = sum / #v
        for i = 1, #v do sq = sq + (v[i] - mean) ^ 2 end
        local sd = math.sqrt(sq / (#v - 1))
        assert.is_true(math.abs(mean) < 0.01, "mean " .. mean)
        assert.is_true(math.abs(sd - 1) < 0.01, "std " .. sd)
        -- bell-shaped (an Irwin-Hall sum of four uniforms, see moelab.h): about two thirds within
        -- one standard deviation (a normal has 68.3%, Irwin-Hall(4) 66.9%), none past 2 sqrt(3)
        local within, max = 0, 0
        for i = 1, #v do
          if math.abs(v[i]) < 1 then within = within + 1 end
          max = math.max(max, math.abs(v[i]))
        end
        assert.is_true(within / #v > 0.65 and within / #v < 0.70, "fraction within 1: " .. within / #v)
        assert.is_true(max > 2.5 and max <= 2 * math.sqrt(3) + 1e-6, "max |x| " .. max)
      end)
      it("scales by std, and bf16 is the f32 draw rounded", function()
        local unit = moe.randn({ 500 }, { seed = 11, device = dev }):flat()
        local three = moe.randn({ 500 }, { seed = 11, std = 3, device = dev }):flat()
        local half = moe.randn({ 500 }, { seed = 11, std = 0.5, dtype = "bf16", device = dev }):flat()
        for i = 1, 500 do
          assert.are.equal(S.f32(unit[i] * 3), three[i])
          assert.are.equal(S.bf16(unit[i] * 0.5), half[i])
        end
      end)
      if dev ~= "cpu" then
        it("gives the same values as on the CPU", function()
          for _, dt in ipairs { "f32", "bf16" } do
            local g = moe.randn({ 3, 333 }, { seed = 5, std = 0.7, dtype = dt, device = dev })
            local c = moe.randn({ 3, 333 }, { seed = 5, std = 0.7, dtype = dt })
            assert.tensor_equal(g:to("cpu"), c)
          end
        end)
      end
    end)

    it("tostring shows dtype, shape and device", function()
      local s = tostring(moe.zeros({ 2, 3 }, { dtype = "bf16", device = dev }))
      assert.truthy(s:find("bf16", 1, true), s)
      assert.truthy(s:find("[2, 3]", 1, true), s)
      assert.truthy(s:find(dev, 1, true), s)
      assert.truthy(s:find("moelab.Tensor", 1, true), s)
    end)
  end)
end

describe("totable of an empty tensor [#cpu]", function()
  it("gives its nested empty tables, and refuses a shape that would make billions of them", function()
    local t = moe.core.new("f32", { 2, 3, 0 }):totable()
    assert.are.equal(2, #t)
    assert.are.equal(3, #t[2])
    assert.are.equal(0, #t[2][3])
    local ok, err = pcall(function() return moe.core.new("f32", { 2 ^ 20, 2 ^ 20, 0 }):totable() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("has no elements, but its shape would make 1099512676353 nested tables", 1, true),
      tostring(err))
  end)
end)

-- Lua code that runs in the middle of a binding call -- an __index metamethod of an argument
-- table, a finalizer at an allocation -- may close a tensor the call has already taken: the call
-- must see it (an error, or the tensor treated as closed), never use freed memory (the sanitizer
-- run of the suite would report it).
describe("tensors closed while a call is under way [#cpu]", function()
  local core = moe.core

  it("a stage whose argument table closes a tensor it gave earlier raises, naming it", function()
    local ids = core.new("i32", { 4, 2 })
    local fields = { ids = ids, weights = core.new("f32", { 4, 2 }), logits = core.new("f32", { 4, 8 }), k = 2 }
    local args = setmetatable({}, { __index = function(_, k)
      if k == "logits" then ids:close() end -- after route has taken ids
      return fields[k]
    end })
    local ok, err = pcall(core.route, args)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a moelab.Tensor of the arguments was closed while they were being read", 1, true),
      tostring(err))
  end)

  -- An object whose finalizer runs fn: a table's __gc on Lua 5.4, a cdata's on LuaJIT (whose
  -- tables have none).
  local function finalized_by(fn)
    if compat.luajit then return require("ffi").gc(require("ffi").new("char[1]"), fn) end
    return setmetatable({}, { __gc = fn })
  end

  it("a finalizer that closes the tensor during a method's allocation is seen by the method", function()
    -- incremental, a step at every allocation, whatever mode the suite left the collector in
    local mode = compat.luajit and collectgarbage("setpause", 0) or collectgarbage("incremental", 0, 1000)
    local shape = { 4 }
    for _, method in ipairs { "view", "flat", "totable", "to", "shape" } do
      for _ = 1, 3 do
        collectgarbage("collect") -- a small heap, so that the next cycle, and its finalizer, come soon
        local t = core.new("f32", { 64 })
        finalized_by(function() t:close() end)
        local n = 0
        while not t.closed and n < 1000000 do
          n = n + 1
          if method == "view" then pcall(t.view, t, 0, shape)
          elseif method == "to" then pcall(t.to, t, "cpu")
          elseif method == "shape" then pcall(function() return t.shape end)
          else pcall(t[method], t) end
        end
        assert.is_true(t.closed, method)
        assert.is_false(pcall(t.view, t, 0, shape))
      end
    end
    if compat.luajit then collectgarbage("setpause", mode)
    else
      collectgarbage("incremental", 200, 100)
      if mode == "generational" then collectgarbage("generational") end
    end
  end)
end)
