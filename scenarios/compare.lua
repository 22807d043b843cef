-- SPDX-License-Identifier: MIT
-- What changed between two JSON reports of the scenarios (kimi.lua, scheduler.lua, experts.lua
-- --json): where each was measured first (their "run" metadata, and a warning where the device,
-- the moelab version or the scenario differ), then every number that moved by more than the
-- threshold, every other value that changed, and what only one of them has.
--
--   lua5.4 scenarios/compare.lua A.json B.json [--threshold PCT] [--svg FILE]
--
-- Rows of a table (scheduler's and experts' rows, kimi's ranks) are matched by what names them
-- (model, distribution, pad, shape), not by their place, so that a sweep of other presets still
-- compares row by row.  Times (_ms, _us) are better lower, rates (TFLOP/s) higher.  Exits 2 on a
-- bad flag or a file that is not a report; 0 otherwise, whatever changed.
local cli = require "moelab.cli"
local moe = cli.require "moelab"
local json = require "moelab.json"
local svg = require "moelab.svg"

local opts, files = cli.parse(arg, {
  { "threshold", "number", 1, "smallest change of a number shown, in percent" },
  { "svg", "string", nil, "also draw the changes as an SVG picture in this file" },
}, "lua5.4 scenarios/compare.lua: what changed between two reports", "A.json B.json, the reports")
if #files ~= 2 then
  cli.fail(string.format("compare.lua takes two reports (A.json B.json), got %d argument%s", #files,
    #files == 1 and "" or "s"))
end
if opts.threshold < 0 then cli.fail(string.format("--threshold must be >= 0, got %g", opts.threshold)) end
local svg_file = cli.output("svg", opts.svg)

local function load(path)
  local f, err = io.open(path, "r")
  if not f then cli.fail("cannot read " .. err) end
  local text = f:read("*a")
  f:close()
  local report = cli.guard(path, json.decode, text)
  if type(report) ~= "table" then cli.fail(path .. ": not a report (a JSON object)") end
  return report
end
local A, B = load(files[1]), load(files[2])

-- The fields that name a row of a table, in the order they are shown.
local ID_FIELDS = { "label", "model", "dist", "pad", "rank", "W", "T" }

-- A row's name from its naming fields, or nil when it has none.
local function row_name(v)
  if type(v) ~= "table" then return nil end
  local parts = {}
  for _, f in ipairs(ID_FIELDS) do
    if v[f] ~= nil and type(v[f]) ~= "table" then
      parts[#parts + 1] = (#parts > 0 and f .. " " or "") .. tostring(v[f])
    end
  end
  return #parts > 0 and table.concat(parts, ", ") or nil
end

-- Every leaf of a report under a path ("stage_ms.experts", "rows[Kimi K2, dist zipf, pad 128].ms"),
-- the run metadata left out (it is shown on its own).
local function flatten(v, path, out)
  if type(v) ~= "table" or v == json.null then
    out[path] = v
    return out
  end
  local n = 0
  for _ in pairs(v) do n = n + 1 end
  if n > 0 and #v == n then -- an array: its rows by name, a name that repeats by place as well
    local seen = {}
    for i = 1, n do
      local name = row_name(v[i]) or tostring(i)
      if seen[name] then name = name .. " #" .. i end
      seen[name] = true
      flatten(v[i], path .. "[" .. name .. "]", out)
    end
  else
    for k, x in pairs(v) do
      if not (path == "" and k == "run") then flatten(x, path .. (path == "" and "" or ".") .. tostring(k), out) end
    end
  end
  return out
end

local fa, fb = flatten(A, "", {}), flatten(B, "", {})

-- ---------------------------------------------------------------- where each was measured

local function script_of(run) return run and run.command and run.command:match("(%S+%.lua)") end
local function describe(run)
  if type(run) ~= "table" then return "no run metadata (a report written before moelab recorded it)" end
  local d = type(run.device) == "table" and run.device or {}
  local dev = (d.device or "?") .. " " .. tostring(d.name or "?")
  if d.kind == "cuda" then
    dev = string.format("%s, SM %s MHz, driver %s, CUDA %s", dev, tostring(d.sm_clock_mhz), tostring(d.driver),
      tostring(d.runtime))
  end
  return string.format("moelab %s%s, %s%s, %s\n             %s", tostring(run.moelab),
    run.commit and (" @ " .. run.commit:sub(1, 10) .. (run.dirty and " (modified)" or "")) or "", dev,
    run.nccl and (", NCCL " .. run.nccl) or "", tostring(run.date), tostring(run.command))
end

local function p(...) io.write(string.format(...), "\n") end
p("moelab %s: %s -> %s", moe.version, files[1], files[2])
p("  a          %s", describe(A.run))
p("  b          %s", describe(B.run))
local ra, rb = type(A.run) == "table" and A.run or {}, type(B.run) == "table" and B.run or {}
local da, db = type(ra.device) == "table" and ra.device or {}, type(rb.device) == "table" and rb.device or {}
if script_of(ra) ~= script_of(rb) then
  p("  warning    different scenarios (%s, %s): few numbers will match", tostring(script_of(ra)),
    tostring(script_of(rb)))
end
if da.name ~= db.name or da.sm_clock_mhz ~= db.sm_clock_mhz then
  p("  warning    different devices (%s, %s): the times are not comparable", tostring(da.name), tostring(db.name))
end
if ra.moelab ~= rb.moelab then
  p("  note       different moelab versions (%s, %s)", tostring(ra.moelab), tostring(rb.moelab))
end

-- ---------------------------------------------------------------- what changed

-- +1 where larger is better, -1 where smaller is, 0 where neither: by the innermost part of the
-- path that says ("stage_ms.experts" is a time, "rows[...].tflops" a rate).
local function better(path)
  local verdict = 0
  for part in path:gmatch("[%w_]+") do
    if part == "ms" or part == "us" or part:match("_ms$") or part:match("_us$") then verdict = -1
    elseif part:match("tflops") then verdict = 1 end
  end
  return verdict
end

local paths = {}
for k in pairs(fa) do paths[#paths + 1] = k end
for k in pairs(fb) do if fa[k] == nil then paths[#paths + 1] = k end end
table.sort(paths)

local moved, changed, only_a, only_b, same = {}, {}, {}, {}, 0
for _, k in ipairs(paths) do
  local a, b = fa[k], fb[k]
  if b == nil then only_a[#only_a + 1] = k
  elseif a == nil then only_b[#only_b + 1] = k
  elseif type(a) == "number" and type(b) == "number" then
    local pct = a ~= 0 and (b - a) / math.abs(a) * 100 or (b == 0 and 0 or math.huge)
    if math.abs(pct) >= opts.threshold and a ~= b then moved[#moved + 1] = { path = k, a = a, b = b, pct = pct }
    else same = same + 1 end
  elseif a ~= b then changed[#changed + 1] = { path = k, a = a, b = b }
  else same = same + 1 end
end

local function num(v) return string.format(math.abs(v) >= 1e4 and "%.6g" or "%.4g", v) end
p("")
p("  numbers that moved by %g%% or more: %d (%d values unchanged or within it)", opts.threshold, #moved, same)
for _, m in ipairs(moved) do
  local dir = better(m.path) * (m.b - m.a)
  p("    %-56s %12s -> %-12s %+8.1f%%%s", m.path, num(m.a), num(m.b), m.pct,
    dir > 0 and "  better" or dir < 0 and "  worse" or "")
end
if #changed > 0 then
  p("  other values that changed: %d", #changed)
  for _, c in ipairs(changed) do p("    %-56s %s -> %s", c.path, tostring(c.a), tostring(c.b)) end
end
if #only_a > 0 then p("  only in a: %s", table.concat(only_a, ", ")) end
if #only_b > 0 then p("  only in b: %s", table.concat(only_b, ", ")) end

if svg_file then
  svg_file:write(svg.changes {
    title = string.format("%s -> %s: numbers that moved by %g%% or more", files[1], files[2], opts.threshold),
    changes = moved, better = better,
  })
  svg_file:close()
end
