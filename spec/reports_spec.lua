-- SPDX-License-Identifier: MIT
-- What the scenarios write besides their report on the CPU: kimi.lua's picture (--svg), trace
-- (--trace) and JSON (--json) of one run, the sweeps' pictures, and scenarios/compare.lua over
-- two reports.  The files are read back as a user's tools would: the SVG as XML, the trace and
-- the reports as JSON.
local S = require "support"
local json = require "moelab.json"

local STAGES = { "route", "schedule", "dispatch", "experts", "shared", "combine" }
local W, EL = 8, 48 -- kimi.lua's world, and Kimi K2's experts per rank there

local function read(path)
  local f = assert(io.open(path, "r"))
  local text = f:read("a")
  f:close()
  return text
end

local function write(path, text)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

-- kimi.lua run once with all three outputs -> {svg =, trace =, json = (texts), out =, status =}.
local kimi
local function run_kimi()
  if kimi then return kimi end
  local base = os.tmpname()
  local out, status = S.run_lua("scenarios/kimi.lua", string.format("--tokens 8 --svg %s.svg --trace %s.trace "
    .. "--json %s.json", base, base, base))
  kimi = { out = out, status = status }
  for _, ext in ipairs { "svg", "trace", "json" } do
    local f = io.open(base .. "." .. ext, "r")
    kimi[ext] = f and f:read("a")
    if f then f:close() end
    os.remove(base .. "." .. ext)
  end
  os.remove(base)
  return kimi
end

describe("kimi.lua --svg --trace --json on the CPU [#cpu]", function()
  it("runs and passes its check", function()
    local k = run_kimi()
    assert.are.equal(0, k.status, k.out)
  end)

  it("draws a valid SVG: a bar per stage with its ceiling, a histogram per rank, padding per rank", function()
    local k = run_kimi()
    local root = S.parse_xml(assert(k.svg, k.out))
    assert.are.equal("svg", root.tag)
    local report = json.decode(k.json)
    local bars = S.xml_find(S.xml_find(root, "g", "bars")[1], "rect", "bar")
    assert.are.equal(#STAGES, #bars)
    for i, b in ipairs(bars) do
      local ms = report.stage_ms[STAGES[i]]
      assert.is_true(math.abs(tonumber(b.attrs["data-value"]) - ms) <= 0.005 + 1e-9, STAGES[i])
    end
    assert.are.equal(#STAGES - 1, #S.xml_find(root, "line", "mark")) -- every stage but the schedule has a ceiling
    local hists = S.xml_find(root, "g", "histogram")
    assert.are.equal(W, #hists)
    for r, h in ipairs(hists) do
      assert.are.equal(tostring(r - 1), h.attrs["data-rank"])
      local experts = 0
      for _, bin in ipairs(S.xml_find(h, "rect", "bin")) do experts = experts + tonumber(bin.attrs["data-count"]) end
      assert.are.equal(EL, experts) -- every expert of the rank in one bin
    end
    local parts = S.xml_find(root, "rect", "part")
    assert.are.equal(2 * W, #parts) -- routes and padding of each rank
    for r = 1, W do
      local rank = report.real.ranks[r]
      assert.are.same({ tostring(rank.routes), tostring(rank.padding) },
        { parts[2 * r - 1].attrs["data-value"], parts[2 * r].attrs["data-value"] })
    end
  end)

  it("writes a Chrome trace with one event per stage per rank", function()
    local k = run_kimi()
    local doc = json.decode(assert(k.trace, k.out))
    local seen, lane = {}, {}
    local n = 0
    for _, e in ipairs(doc.traceEvents) do
      if e.ph == "X" then
        n = n + 1
        local key = e.pid .. "/" .. e.name
        assert.is_nil(seen[key], "two events for " .. key)
        seen[key] = true
        lane[e.name] = lane[e.name] or e.tid
        assert.are.equal(lane[e.name], e.tid, e.name) -- a stage keeps its lane on every rank
        assert.is_true(e.ts >= 0 and e.dur >= 0, key)
      end
    end
    assert.are.equal(#STAGES * W, n)
    for r = 0, W - 1 do
      for _, stage in ipairs(STAGES) do assert.is_true(seen[r .. "/" .. stage], r .. "/" .. stage) end
    end
    assert.are.equal(moe.version, doc.otherData.moelab)
  end)

  it("puts the run's metadata in the JSON report", function()
    local k = run_kimi()
    local run = json.decode(assert(k.json, k.out)).run
    assert.are.equal(moe.version, run.moelab)
    assert.truthy(run.date:match("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$"), run.date)
    assert.truthy(run.command:find("scenarios/kimi.lua --tokens 8 --svg ", 1, true), run.command)
    assert.are.same({ "cpu", "cpu" }, { run.device.kind, run.device.device })
    assert.are.equal(moe.device_info("cpu").name, run.device.name)
    assert.are.equal("string", type(run.lua))
    if run.commit then assert.truthy(run.commit:match("^%x+$") and #run.commit == 40, run.commit) end
  end)
end)

describe("the sweeps' pictures [#cpu]", function()
  it("experts.lua --svg: a chart per preset, a bar per configuration where cuBLAS is n/a", function()
    local file = os.tmpname()
    local out, status = S.run_lua("scenarios/experts.lua", "--models kimi_k2,glm5 --dists uniform --pads 1,128 "
      .. "--tokens 4 --svg " .. file)
    assert.are.equal(0, status, out)
    local root = S.parse_xml(read(file))
    os.remove(file)
    local charts = S.xml_find(root, "g", "bars")
    assert.are.equal(2, #charts)
    for _, c in ipairs(charts) do
      local bars = S.xml_find(c, "rect", "bar")
      assert.are.equal(2, #bars) -- ours at each pad; no cuBLAS bars on the CPU
      for _, b in ipairs(bars) do assert.are.equal("ours", b.attrs["data-series"]) end
    end
  end)

  it("scheduler.lua --svg: a bar per shape", function()
    local file = os.tmpname()
    local out, status = S.run_lua("scenarios/scheduler.lua", "--device cpu --reps 1 --svg " .. file)
    assert.are.equal(0, status, out)
    local root = S.parse_xml(read(file))
    os.remove(file)
    local bars = S.xml_find(root, "rect", "bar")
    assert.are.equal(9, #bars) -- the table's nine shapes; the legacy column is a GPU's
    assert.truthy(S.xml_find(root, "text")[1].text:find("scheduler on cpu", 1, true))
  end)
end)

describe("scenarios/compare.lua [#cpu]", function()
  local function report() return json.decode(assert(run_kimi().json, run_kimi().out)) end

  -- compare.lua on two reports (tables, written to files) -> output, status
  local function compare(a, b, flags)
    local fa, fb = os.tmpname(), os.tmpname()
    write(fa, json.encode(a))
    write(fb, json.encode(b))
    local out, status = S.run_lua("scenarios/compare.lua", fa .. " " .. fb .. " " .. (flags or ""))
    os.remove(fa)
    os.remove(fb)
    return out, status
  end

  it("finds nothing moved between a report and itself", function()
    local r = report()
    local out, status = compare(r, r)
    assert.are.equal(0, status, out)
    assert.truthy(out:find("numbers that moved by 1% or more: 0 ", 1, true), out)
    assert.falsy(out:find("warning", 1, true), out)
  end)

  it("names what moved and how, what changed, and warns of another device", function()
    local a, b = report(), report()
    b.stage_ms.experts = a.stage_ms.experts * 2
    b.real.ranks[3].padding = a.real.ranks[3].padding + 10
    b.pass = false
    b.run.device.name = "another CPU"
    local svg_file = os.tmpname()
    local out, status = compare(a, b, "--svg " .. svg_file)
    assert.are.equal(0, status, out)
    assert.truthy(out:find("numbers that moved by 1% or more: 2 ", 1, true), out)
    assert.truthy(out:find("\n    stage_ms.experts%s+[%d.e+-]+ %-> [%d.e+-]+%s+%+100.0%%  worse\n"), out)
    assert.truthy(out:find("real.ranks[3].padding", 1, true), out)
    assert.truthy(out:find("\n    pass%s+true %-> false\n"), out)
    assert.truthy(out:find("warning    different devices (" .. a.run.device.name .. ", another CPU)", 1, true), out)
    local root = S.parse_xml(read(svg_file))
    os.remove(svg_file)
    assert.are.equal(2, #S.xml_find(root, "rect", "bar"))
  end)

  it("matches rows by what names them, not by their place", function()
    local a = { rows = { { model = "A", pad = 1, ms = 1 }, { model = "B", pad = 1, ms = 2 } } }
    local b = { rows = { { model = "B", pad = 1, ms = 2 }, { model = "A", pad = 1, ms = 1 },
      { model = "C", pad = 1, ms = 3 } } }
    local out, status = compare(a, b, "--threshold 0")
    assert.are.equal(0, status, out)
    assert.truthy(out:find("numbers that moved by 0% or more: 0 ", 1, true), out)
    assert.truthy(out:find("only in b: rows[C, pad 1].model, rows[C, pad 1].ms, rows[C, pad 1].pad", 1, true), out)
    assert.truthy(out:find("no run metadata", 1, true), out)
  end)

  for _, row in ipairs {
    { "one report", function() return S.run_lua("scenarios/compare.lua", "a.json") end,
      "compare.lua takes two reports (A.json B.json), got 1 argument" },
    { "a file that is not there",
      function() return S.run_lua("scenarios/compare.lua", "/nonexistent/a.json b.json") end,
      "cannot read /nonexistent/a.json" },
    { "a file that is not JSON", function()
      local f = os.tmpname()
      write(f, "{ not json")
      local out, status = S.run_lua("scenarios/compare.lua", f .. " " .. f)
      os.remove(f)
      return out, status
    end, "json: expected a key (a string) at byte 3" },
    { "a negative threshold", function() return compare({}, {}, "--threshold -1") end,
      "--threshold must be >= 0, got -1" },
  } do
    it("exits 2 on " .. row[1], function()
      local out, status = row[2]()
      assert.are.equal(2, status, out)
      assert.truthy(out:find(row[3], 1, true), out)
    end)
  end
end)
