-- SPDX-License-Identifier: MIT
-- moe.wrap, moe.from_dlpack and t:to_dlpack: tensors over memory another library owns, and
-- moelab's handed out, without a copy.  Round trips, what keeps the memory alive, stages on
-- wrapped and imported tensors, and every refusal as a row.  The DLPack refusals are made by
-- poking the fields of an export through a wrap of its structure, laid out as DLPack lays it out
-- on a 64-bit little-endian machine (every field at a multiple of 4 bytes: words below).
local S = require "support"

-- The words (i32) of the DLPack structure at address a; word i is bytes 4 (i - 1) .. 4 i - 1.
local function words(a, n) return moe.wrap { address = a, dtype = "i32", shape = { n } } end
local function poke(w, i, v) w:view(i - 1, { 1 }):fill(v) end
-- A 64-bit field at words i, i + 1 (low word first), as a number.
local function peek64(w, i)
  local lo, hi = w:get(i), w:get(i + 1)
  if lo < 0 then lo = lo + 2 ^ 32 end
  return hi * 2 ^ 32 + lo
end
local function poke64(w, i, v)
  local hi = math.floor(v / 2 ^ 32)
  local lo = v - hi * 2 ^ 32
  if lo >= 2 ^ 31 then lo = lo - 2 ^ 32 end
  poke(w, i, lo)
  poke(w, i + 1, hi)
end

-- Where the DLTensor's fields are, in words from its start: DLManagedTensor begins with it,
-- DLManagedTensorVersioned has it after version, manager_ctx, deleter and flags (8 words).
local FIELD = { data = 0, device_type = 2, ndim = 4, dtype = 5, shape = 6, strides = 8, byte_offset = 10 }
local LAYOUT = {
  [false] = { words = 16, tensor = 1 },
  [true] = { words = 20, tensor = 9, major = 1, flags = 7 },
}
local function dtype_word(code, bits, lanes) return code + bits * 256 + lanes * 65536 end

-- The message of f's error, which must be an argument error of fname at a line of this file.
local function arg_error(fname, f)
  local ok, err = pcall(f)
  assert.is_false(ok, "no error raised")
  err = tostring(err)
  assert.truthy(err:find("bad argument #1 to '" .. fname .. "'", 1, true), err)
  assert.truthy(err:find("interop_spec%.lua:%d+:"), "the error should point at the caller:\n" .. err)
  return err
end

for _, dev in ipairs(ALL_DEVICES) do
  describe("interop [" .. device_tag(dev) .. "]", function()
    if skip_without(dev) then return end

    describe("round trips", function()
      it("to_dlpack then from_dlpack is the same memory, shape, dtype and device, either structure", function()
        for _, dt in ipairs { "f32", "bf16", "i32" } do
          for _, versioned in ipairs { false, true } do
            local t = moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = dt, device = dev })
            local u = moe.from_dlpack(t:to_dlpack { versioned = versioned }, { versioned = versioned })
            assert.are.same({ 2, 3 }, u.shape)
            assert.are.equal(dt, u.dtype)
            assert.are.equal(dev, u.device)
            assert.are.equal(t:address(), u:address())
            u:fill(7) -- written through: one memory
            assert.tensor_equal(t:flat(), S.filled(6, 7))
          end
        end
      end)
      it("every shape of 0 to 4 dimensions, empty ones included", function()
        for _, shape in ipairs { {}, { 5 }, { 2, 3 }, { 2, 1, 3 }, { 2, 1, 3, 2 }, { 0 }, { 3, 0, 2 } } do
          local t = moe.randn(shape, { seed = 3, device = dev })
          local u = moe.from_dlpack(t:to_dlpack())
          assert.are.same(shape, u.shape)
          assert.tensor_equal(u:flat(), t:flat())
        end
      end)
      it("a wrap of a tensor's address reads and writes that tensor's memory", function()
        local t = moe.tensor({ 1, 2, 3, 4, 5, 6 }, { dtype = "bf16", device = dev })
        local w = moe.wrap { address = t:address(), dtype = "bf16", shape = { 3, 2 }, device = dev, keep = t }
        assert.are.same({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, w:totable())
        w:select(2):fill(-1)
        assert.tensor_equal(t:flat(), { 1, 2, -1, -1, 5, 6 })
      end)
      it("an empty wrap may have address 0", function()
        local w = moe.wrap { address = 0, dtype = "f32", shape = { 0, 4 }, device = dev }
        assert.are.same({ 0, 4 }, w.shape)
        assert.are.equal(0, w:numel())
      end)
      it("honours byte_offset: a poked export starts one element in", function()
        for _, versioned in ipairs { false, true } do
          local t = moe.tensor({ 1, 2, 3, 4 }, { device = dev })
          local a = t:to_dlpack { versioned = versioned }
          local L = LAYOUT[versioned]
          local w = words(a, L.words)
          poke64(w, L.tensor + FIELD.byte_offset, 4)
          poke64(words(peek64(w, L.tensor + FIELD.shape), 2), 1, 3) -- shape {3}
          local u = moe.from_dlpack(a, { versioned = versioned })
          assert.are.same({ 3 }, u.shape)
          assert.tensor_equal(u:flat(), { 2, 3, 4 })
          u:fill(0)
          assert.tensor_equal(t:flat(), { 1, 0, 0, 0 })
        end
      end)
    end)

    describe("lifetimes", function()
      it("an export keeps the memory after its tensor is collected", function()
        local t = moe.tensor({ 1.5, 2.5, 3.5, 4.5 }, { device = dev })
        local a = t:to_dlpack()
        t = nil
        collectgarbage()
        collectgarbage()
        assert.tensor_equal(moe.from_dlpack(a):flat(), { 1.5, 2.5, 3.5, 4.5 })
      end)
      it("an export of a view keeps its base's memory", function()
        local t = moe.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, { dtype = "i32", device = dev })
        local a = t:select(2):to_dlpack { versioned = true }
        t = nil
        collectgarbage()
        collectgarbage()
        assert.tensor_equal(moe.from_dlpack(a, { versioned = true }):flat(), { 3, 4 })
      end)
      it("keep lives as long as the wrap and its views", function()
        local t = moe.tensor({ 1, 2, 3, 4 }, { device = dev })
        local weak = setmetatable({ t }, { __mode = "v" })
        local w = moe.wrap { address = t:address(), dtype = "f32", shape = { 2, 2 }, device = dev, keep = t }
        local v = w:select(2)
        t, w = nil, nil
        collectgarbage()
        collectgarbage()
        assert.is_not_nil(weak[1], "keep was collected while a view of the wrap lives")
        assert.tensor_equal(v:flat(), { 3, 4 })
        v = nil
        -- a cycle each for the view's finaliser, the wrap's, then keep: under LuaJIT the binding holds
        -- keep in a table until the wrap's finaliser has run (a cdata holds no Lua value)
        for _ = 1, 3 do collectgarbage() end
        assert.is_nil(weak[1], "keep outlived the wrap and its views")
      end)
    end)

    describe("stages", function()
      it("experts over wrapped and imported tensors gives the bits it gives over moelab's own", function()
        local C, H, F, EL = 7, 8, 4, 2
        local x = moe.randn({ C, H }, { dtype = "bf16", seed = 1, device = dev })
        local wgu = moe.randn({ EL, 2 * F, H }, { dtype = "bf16", seed = 2, std = 0.5, device = dev })
        local wd = moe.randn({ EL, H, F }, { dtype = "bf16", seed = 3, std = 0.5, device = dev })
        local off = moe.tensor({ 0, 3, C }, { dtype = "i32", device = dev })
        local want = moe.experts { x = x, offsets = off, w_gate_up = wgu, w_down = wd }
        local function wrapped(t)
          return moe.wrap { address = t:address(), dtype = t.dtype, shape = t.shape, device = t.device, keep = t }
        end
        local function imported(t) return moe.from_dlpack(t:to_dlpack { versioned = true }, { versioned = true }) end
        for _, through in ipairs { wrapped, imported } do
          local out = moe.zeros({ C, H }, { dtype = "bf16", device = dev })
          moe.experts { x = through(x), offsets = through(off), w_gate_up = through(wgu), w_down = through(wd),
            out = through(out) }
          assert.tensor_equal(out, want) -- written into out's own memory
        end
      end)
      it("combine into a wrapped output", function()
        local s = moe.schedule { ids = moe.tensor({ { { 0, 1 }, { 1, -1 } } }, { dtype = "i32", device = dev }), experts = 2,
          rank = 0 }
        local y = moe.randn({ s.capacity, 4 }, { dtype = "bf16", seed = 5, device = dev })
        local weights = moe.tensor({ { 0.5, 0.25 }, { 1, 0 } }, { device = dev })
        local want = moe.combine { schedule = s, y = y, weights = weights, dtype = "f32" }
        local buf = moe.zeros({ 2, 4 }, { device = dev })
        local out = moe.wrap { address = buf:address(), dtype = "f32", shape = { 2, 4 }, device = dev, keep = buf }
        moe.combine { schedule = s, y = y, weights = weights, out = out }
        assert.tensor_equal(buf, want)
      end)
    end)

    describe("refused DLPack fields", function()
      -- each row: a field of a fresh f32 [2, 3] export, poked; what the refusal says.  After the
      -- refusal the export is still the caller's: put back, it imports (and is released) as any.
      local ROWS = {
        { "dtype f64", "dtype", dtype_word(2, 64, 1), "dtype code 2, bits 64, lanes 1 is none of moelab's" },
        { "dtype u32", "dtype", dtype_word(1, 32, 1), "dtype code 1, bits 32, lanes 1" },
        { "dtype f32 of 2 lanes", "dtype", dtype_word(2, 32, 2), "dtype code 2, bits 32, lanes 2" },
        { "ROCm memory", "device_type", 10, "device type 10 (kDLROCM) is not taken" },
        { "CUDA managed memory", "device_type", 13, "device type 13 (kDLCUDAManaged) is not taken" },
        { "5 dimensions", "ndim", 5, "ndim is 5, moelab takes 0 to 4 dimensions" },
        { "a negative dimension", "shape", { 2, -3 }, "dimension 2 is -3, expected >= 0" },
        { "transposed strides", "strides", { 1, 2 },
          "strides [1, 2] are not the compact row-major ones of shape [2, 3] ([3, 1])" },
        { "broadcast strides", "strides", { 0, 1 }, "strides [0, 1] are not the compact" },
        { "a misaligned byte_offset", "byte_offset", 2, "byte_offset 2 is not aligned to its dtype f32 (4 bytes)" },
        { "data NULL", "data", 0, "data is NULL for 6 elements" },
        { "major version 2", "major", 2, "DLPack version 2.0, moelab reads major version 1", true },
        { "read-only", "flags", 1, "the tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY)", true },
      }
      for _, row in ipairs(ROWS) do
        for _, versioned in ipairs(row[5] and { true } or { false, true }) do
          it(row[1] .. (versioned and " (versioned)" or " (legacy)"), function()
            local t = moe.tensor({ 1, 2, 3, 4, 5, 6 }, { shape = { 2, 3 }, device = dev })
            local a = t:to_dlpack { versioned = versioned }
            local L = LAYOUT[versioned]
            local w = words(a, L.words)
            local field, value = row[2], row[3]
            local undo
            if field == "shape" or field == "strides" then -- the arrays the structure points to
              local arr = words(peek64(w, L.tensor + FIELD[field]), 4)
              local old = { peek64(arr, 1), peek64(arr, 3) }
              poke64(arr, 1, value[1])
              poke64(arr, 3, value[2])
              undo = function() poke64(arr, 1, old[1]); poke64(arr, 3, old[2]) end
            else
              local at = L[field] or L.tensor + FIELD[field]
              local wide = field == "data" or field == "byte_offset" or field == "flags"
              local old = wide and peek64(w, at) or w:get(at)
              if wide then poke64(w, at, value) else poke(w, at, value) end
              undo = function() if wide then poke64(w, at, old) else poke(w, at, old) end end
            end
            local err = arg_error("from_dlpack", function() moe.from_dlpack(a, { versioned = versioned }) end)
            assert.truthy(err:find(row[4], 1, true), string.format("expected %q in:\n%s", row[4], err))
            undo()
            assert.tensor_equal(moe.from_dlpack(a, { versioned = versioned }):flat(), { 1, 2, 3, 4, 5, 6 })
          end)
        end
      end
    end)
  end)
end

describe("interop argument errors [#cpu]", function()
  local t = moe.zeros({ 4 })
  local closed = moe.zeros({ 2 })
  closed:close()
  local ROWS = {
    { "wrap", "no options", function() moe.wrap() end, "expected a table of options, got nil" },
    { "wrap", "an unknown option", function() moe.wrap { address = 0, dtype = "f32", shape = { 0 }, size = 4 } end,
      "unknown option 'size'" },
    { "wrap", "no address", function() moe.wrap { dtype = "f32", shape = { 1 } } end,
      "option 'address' is required" },
    { "wrap", "no dtype", function() moe.wrap { address = 0, shape = { 1 } } end,
      "option 'dtype' is required (one of 'f32', 'bf16', 'i32', 'e4m3')" },
    { "wrap", "no shape", function() moe.wrap { address = 0, dtype = "f32" } end,
      "option 'shape' is required (a table)" },
    { "wrap", "an address as text", function() moe.wrap { address = "0x10", dtype = "f32", shape = { 1 } } end,
      "option 'address' must be an integer >= 0 or a light userdata, got \"0x10\"" },
    { "wrap", "a negative address", function() moe.wrap { address = -8, dtype = "f32", shape = { 1 } } end,
      "option 'address' must be an integer >= 0 or a light userdata, got -8" },
    { "wrap", "a fractional address", function() moe.wrap { address = 8.5, dtype = "f32", shape = { 1 } } end,
      "got 8.5" },
    { "wrap", "a tensor as the address", function() moe.wrap { address = t, dtype = "f32", shape = { 1 } } end,
      "got moelab.Tensor(f32 [4] on cpu)" },
    { "wrap", "a table as the address", function() moe.wrap { address = {}, dtype = "f32", shape = { 1 } } end,
      "option 'address' must be an integer >= 0 or a light userdata, got table" },
    { "wrap", "dtype f16", function() moe.wrap { address = 0, dtype = "f16", shape = { 0 } } end,
      "option 'dtype' must be one of 'f32', 'bf16', 'i32', 'e4m3', got \"f16\"" },
    { "wrap", "a shape that is no table", function() moe.wrap { address = 0, dtype = "f32", shape = 4 } end,
      "option 'shape' must be a table, got 4" },
    { "wrap", "5 dimensions", function() moe.wrap { address = 0, dtype = "f32", shape = { 1, 1, 1, 1, 0 } } end,
      "at most 4 dimensions, got 5" },
    { "wrap", "a negative dimension", function() moe.wrap { address = 0, dtype = "f32", shape = { 2, -1 } } end,
      "shape[2] must be a non-negative integer, got -1" },
    { "wrap", "a device that is none", function() moe.wrap { address = 0, dtype = "f32", shape = { 0 }, device = "gpu" } end,
      "option 'device' must be a device, 'cpu' or 'cuda:N', got \"gpu\"" },
    { "wrap", "address 0 with elements", function() moe.wrap { address = 0, dtype = "f32", shape = { 3 } } end,
      "data is NULL for 3 elements" },
    { "wrap", "an address off the dtype's alignment", function() moe.wrap { address = 2, dtype = "f32", shape = { 1 } } end,
      "is not aligned to its dtype f32 (4 bytes)" },
    { "wrap", "an i32 address off by 2", function() moe.wrap { address = 4098, dtype = "i32", shape = { 1 } } end,
      "is not aligned to its dtype i32 (4 bytes)" },
    { "from_dlpack", "no address", function() moe.from_dlpack() end,
      "the managed tensor's address must be an integer >= 0 or a light userdata, got nil" },
    { "from_dlpack", "an address as text", function() moe.from_dlpack("x") end, "got \"x\"" },
    { "from_dlpack", "address 0", function() moe.from_dlpack(0) end, "the managed tensor is NULL" },
    { "from_dlpack", "address 0, versioned", function() moe.from_dlpack(0, { versioned = true }) end,
      "the managed tensor is NULL" },
    { "from_dlpack", "an unknown option", function() moe.from_dlpack(8, { copy = true }) end,
      "unknown option 'copy'; expected one of: versioned" },
    { "from_dlpack", "versioned not a boolean", function() moe.from_dlpack(8, { versioned = 1 }) end,
      "option 'versioned' must be a boolean, got 1" },
    { "to_dlpack", "an unknown option", function() t:to_dlpack { copy = true } end, "unknown option 'copy'" },
    { "to_dlpack", "versioned not a boolean", function() t:to_dlpack { versioned = "yes" } end,
      "option 'versioned' must be a boolean, got \"yes\"" },
    { "to_dlpack", "called on no tensor", function() t.to_dlpack(5) end, "expected a moelab.Tensor" },
    { "to_dlpack", "a closed tensor", function() closed:to_dlpack() end, "the moelab.Tensor is closed" },
  }
  for _, row in ipairs(ROWS) do
    it(row[1] .. ": " .. row[2], function()
      local err = arg_error(row[1], row[3])
      assert.truthy(err:find(row[4], 1, true), string.format("expected %q in:\n%s", row[4], err))
    end)
  end
  it("wrap on a GPU this machine does not have says so", function()
    if HAVE_GPU then
      pending("a GPU is present")
      return
    end
    local ok, err = pcall(function() moe.wrap { address = 256, dtype = "f32", shape = { 1 }, device = "cuda:0" } end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("wrap: cuda:0 is not available", 1, true), tostring(err))
  end)
end)
