-- SPDX-License-Identifier: MIT
-- Stage 1, route: router logits -> top-k expert ids and weights.
local core = require "moelab.core"
local args = require "moelab.args"

local route = {}

local SCORING = { "softmax", "sigmoid", "sqrtsoftplus" }

-- The routing options k, scoring, groups, topk_groups, scale of o checked against E experts,
-- for fname (route, or a layer when it is built); returns scoring, groups, topk_groups, scale
-- with their defaults.
function route.options(fname, E, o)
  local scoring = o.scoring or "softmax"
  local groups = o.groups or 1
  args.range(fname, "k", o.k, 1, E)
  args.range(fname, "groups", groups, 1, E)
  if E % groups ~= 0 then
    args.fail(fname, string.format("option 'groups' (%d) must divide the number of experts (%d)", groups, E))
  end
  if groups > 1 and scoring ~= "sigmoid" then
    args.fail(fname, string.format("option 'groups' (%d) needs scoring = 'sigmoid', got '%s'", groups, scoring))
  end
  local topk_groups = o.topk_groups or groups
  args.range(fname, "topk_groups", topk_groups, 1, groups)
  if o.k > topk_groups * (E / groups) then -- groups divides E
    args.fail(fname, string.format("option 'k' (%d) exceeds the %d experts in the %d kept groups",
      o.k, topk_groups * math.floor(E / groups), topk_groups))
  end
  local scale = o.scale or 1.0
  -- applied as an f32: it must stay finite and nonzero there (FLT_MIN .. FLT_MAX)
  if not (scale >= 0x1p-126 and scale <= 0x1.fffffep127) then
    args.fail(fname, "option 'scale' must be a finite number > 0 that an f32 holds (2^-126 .. 3.4e38), got "
      .. args.describe(scale))
  end
  if scale ~= 1 and scoring == "softmax" then -- the kernels ignore it there: say so rather than drop it
    args.fail(fname, string.format("option 'scale' (%s) needs scoring = 'sigmoid' or 'sqrtsoftplus': softmax's "
      .. "weights are renormalised to sum 1", args.describe(scale)))
  end
  return scoring, groups, topk_groups, scale
end

function route.route(o)
  args.options("route", o, {
    logits = "tensor", k = "integer", scoring = SCORING, bias = "tensor", groups = "integer",
    topk_groups = "integer", scale = "number", nan = { "error", "mask" }, ids = "tensor", weights = "tensor",
  }, { "logits", "k" })
  local logits = args.tensor("route", "logits", o.logits, "f32", { false, false })
  local N, E = logits.shape[1], logits.shape[2]
  if E == 0 then -- else k's range below would read "between 1 and 0"
    args.fail("route", "option 'logits' has no experts to route to (its second dimension is 0), got "
      .. tostring(logits))
  end
  local scoring, groups, topk_groups, scale = route.options("route", E, o)
  if o.bias ~= nil and scoring == "softmax" then
    args.fail("route", "option 'bias' needs scoring = 'sigmoid' or 'sqrtsoftplus'")
  end
  -- bias, ids and weights (dtype, shape, device, overlap) are the C stage's to check: its fields
  -- are these options
  local dev = logits.device
  local ids = o.ids or core.new("i32", { N, o.k }, dev)
  local weights = o.weights or core.new("f32", { N, o.k }, dev)
  local stats = core.new("i32", { 2 }, dev)
  core.route { ids = ids, weights = weights, stats = stats, logits = logits, bias = o.bias, k = o.k,
    scoring = scoring, groups = groups, topk_groups = topk_groups, scale = scale }
  local st = stats:flat()
  if st[1] > 0 and o.nan ~= "mask" then
    args.raise(string.format("route: logits contain NaN or cannot be scored in %d row%s (a NaN, a +inf, a softmax row of "
      .. "-inf, a NaN score with the bias), the first is row %d (0-based) of %d; pass nan = 'mask' to route such rows "
      .. "nowhere", st[1], st[1] == 1 and "" or "s", st[2], N))
  end
  return ids, weights, { nan_rows = st[1] }
end

return route
