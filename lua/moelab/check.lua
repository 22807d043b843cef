-- SPDX-License-Identifier: MIT
-- Result checks that raise with a useful diff: the error, the tolerance, the first mismatches.
local args = require "moelab.args"

local check = {}

-- The values of v (a tensor, or a flat table of numbers) and its shape; errors are placed at the
-- caller's line (args.raise), however deep in this file they are found.
local function flat(v, what)
  if args.is_tensor(v) then
    if v.closed then args.raise(string.format("check: %s is a closed moelab.Tensor", what)) end
    return v:flat(), v.shape
  end
  if type(v) == "table" then
    for i = 1, #v do
      if type(v[i]) ~= "number" then
        args.raise(string.format("check: %s[%d] must be a number (a flat table of numbers), got %s", what, i,
          args.describe(v[i])))
      end
    end
    return v, { #v }
  end
  args.raise(string.format("check: %s must be a moelab.Tensor or a flat table of numbers, got %s", what, args.describe(v)))
end

local function index_str(i, shape)
  -- 1-based flat index -> "[a, b, c]" (0-based per dimension, as the C side counts)
  local idx, rest = {}, i - 1
  for d = #shape, 1, -1 do
    local n = shape[d]
    if n == 0 then break end
    idx[d] = rest % n
    rest = math.floor(rest / n)
  end
  local s = {}
  for d = 1, #shape do s[d] = tostring(idx[d] or 0) end
  return "[" .. table.concat(s, ", ") .. "]"
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- Error metrics of got against ref: max |got - ref|, max |ref|, their ratio, relative L2, NaNs,
-- and infinities that differ.  An infinity must be matched exactly (the same sign on both sides)
-- and stays out of the magnitudes: one in ref would make any error relatively small.
local function infinite(v) return v == math.huge or v == -math.huge end
function check.metrics(got, ref)
  local g, gs = flat(got, "got")
  local r, rs = flat(ref, "ref")
  if args.is_tensor(got) and args.is_tensor(ref) and not same_shape(gs, rs) then
    args.raise(string.format("check: shapes differ: got %s, ref %s", args.shape_str(gs), args.shape_str(rs)))
  end
  if #g ~= #r then
    args.raise(string.format("check: got has %d elements %s, ref has %d %s", #g, args.shape_str(gs), #r,
      args.shape_str(rs)))
  end
  local max_abs, max_ref, sq_diff, sq_ref, nans, infs, worst = 0, 0, 0, 0, 0, 0, nil
  for i = 1, #g do
    local a, b = g[i], r[i]
    if a ~= a or b ~= b then
      nans = nans + 1
      worst = worst or i
    elseif infinite(a) or infinite(b) then
      if a ~= b then infs, worst = infs + 1, worst or i end
    else
      local d = math.abs(a - b)
      if d > max_abs then max_abs, worst = d, (nans == 0 and infs == 0 and i or worst) end
      if math.abs(b) > max_ref then max_ref = math.abs(b) end
      sq_diff = sq_diff + d * d
      sq_ref = sq_ref + b * b
    end
  end
  return {
    n = #g, max_abs = max_abs, max_ref = max_ref, nans = nans, infs = infs,
    rel_max = max_ref > 0 and max_abs / max_ref or max_abs,
    rel_l2 = sq_ref > 0 and math.sqrt(sq_diff / sq_ref) or math.sqrt(sq_diff),
    worst = worst, shape = gs,
  }
end

-- Raises unless max|got-ref| <= atol + rtol * max|ref| and relative L2 <= l2 (no NaN anywhere).
-- Defaults are the bf16 tolerances of docs/design.md ("Backends"): rtol = 2e-2, l2 = 1e-2, atol = 0.
function check.close(got, ref, opts)
  opts = args.options("check.close", opts or {}, { rtol = "number", atol = "number", l2 = "number", what = "string" })
  for _, t in ipairs { "rtol", "atol", "l2" } do args.range("check.close", t, opts[t], 0) end
  local rtol, atol, l2 = opts.rtol or 2e-2, opts.atol or 0, opts.l2 or 1e-2
  local m = check.metrics(got, ref)
  local ok = m.nans == 0 and m.infs == 0 and m.max_abs <= atol + rtol * m.max_ref and m.rel_l2 <= l2
  if not ok then
    local g, r = flat(got, "got"), flat(ref, "ref")
    local lines = {}
    local shown = 0
    for i = 1, #g do
      local a, b = g[i], r[i]
      local bad = a ~= a or b ~= b or (a ~= b and (infinite(a) or infinite(b)))
      if bad or math.abs(a - b) > atol + rtol * m.max_ref then
        lines[#lines + 1] = string.format("  at %s: got %.6g, expected %.6g", index_str(i, m.shape), a, b)
        shown = shown + 1
        if shown == 5 then break end
      end
    end
    local unmatched = m.infs > 0 and string.format(", %d infinities unmatched", m.infs) or ""
    args.raise(string.format("%snot close: max |got - ref| = %.4g (%.4g of max |ref| = %.4g; allowed %.4g + %.4g), "
      .. "relative L2 = %.4g (allowed %.4g), %d NaN%s\n%s", opts.what and (opts.what .. ": ") or "", m.max_abs,
      m.rel_max, m.max_ref, atol, rtol, m.rel_l2, l2, m.nans, unmatched, table.concat(lines, "\n")))
  end
  return m
end

-- A layer's check: with raise = false the metrics with the tolerances and .pass, else
-- check.close (which raises with a diff).
function check.verdict(got, ref, o, what)
  args.range("check", "rtol", o.rtol, 0)
  args.range("check", "l2", o.l2, 0)
  if o.raise == false then
    local m = check.metrics(got, ref)
    local rtol, l2 = o.rtol or 2e-2, o.l2 or 1e-2
    -- check.close's rule (atol 0): max |got - ref| <= rtol max |ref|, so an all-zero ref needs an all-zero got
    m.rtol, m.l2 = rtol, l2
    m.pass = m.nans == 0 and m.infs == 0 and m.max_abs <= rtol * m.max_ref and m.rel_l2 <= l2
    return m
  end
  return check.close(got, ref, { rtol = o.rtol, l2 = o.l2, what = what })
end

-- Raises unless a and b hold exactly the same values (and shapes, for tensors).
function check.equal(a, b, what)
  local x, xs = flat(a, "a")
  local y, ys = flat(b, "b")
  local prefix = what and (what .. ": ") or ""
  if args.is_tensor(a) and args.is_tensor(b) and not same_shape(xs, ys) then
    args.raise(string.format("%sshapes differ: %s vs %s", prefix, args.shape_str(xs), args.shape_str(ys)))
  end
  if #x ~= #y then args.raise(string.format("%slengths differ: %d vs %d", prefix, #x, #y)) end
  local bad, lines = 0, {}
  for i = 1, #x do
    if x[i] ~= y[i] and not (x[i] ~= x[i] and y[i] ~= y[i]) then
      bad = bad + 1
      if bad <= 5 then lines[#lines + 1] = string.format("  at %s: %s vs %s", index_str(i, xs), tostring(x[i]), tostring(y[i])) end
    end
  end
  if bad > 0 then
    args.raise(string.format("%s%d of %d elements differ\n%s", prefix, bad, #x, table.concat(lines, "\n")))
  end
  return true
end

return check
