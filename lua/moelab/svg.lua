-- SPDX-License-Identifier: MIT
-- Plain SVG pictures for the scenarios' --svg FILE, with no dependency: a document that collects
-- elements, and the few charts the reports draw -- horizontal bars (grouped by series, with marks
-- such as a stage's ceiling), a histogram, stacked bars.  Each chart is a <g> whose class names
-- what it is ("bars", "histogram", "stacked"), each bar a <rect> of class "bar" (a histogram's
-- "bin", a stacked bar's part "part"), each mark a <line> of class "mark", so that a reader or a
-- test can find them.  Every value appears as text beside its bar, and as the bar's tooltip.
-- Written for Lua 5.4 and LuaJIT alike.
local svg = {}

local FONT = 12
local CHAR_W = 7 -- the width of a character at FONT px, roughly: room for labels
local PALETTE = { "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1" }
svg.PALETTE = PALETTE

---@param s any
---@return string
function svg.escape(s)
  return (tostring(s):gsub("[&<>\"']", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;",
    ["'"] = "&apos;" }))
end

-- A number for an attribute: two decimals at most, no trailing zeros.
local function num(v)
  local s = string.format("%.2f", v):gsub("0+$", ""):gsub("%.$", "")
  return s == "-0" and "0" or s
end

-- A value for a label: four significant digits, plain below 10^6.
function svg.value(v)
  if v == nil then return "n/a" end
  local a = math.abs(v)
  if a ~= 0 and (a >= 1e6 or a < 1e-3) then return string.format("%.3g", v) end
  if a >= 1e3 then return string.format("%.0f", v) end
  return string.format("%.4g", v)
end

---@class moe.SvgDoc
---@field width number
---@field height number
local Doc = {}
Doc.__index = Doc

---@param width number
---@param height number
---@return moe.SvgDoc
function svg.new(width, height)
  return setmetatable({ width = width, height = height, parts = {}, depth = 0 }, Doc)
end

-- Attributes in a fixed order (sorted names), values escaped; numbers rounded.
local function attributes(attrs)
  local names, out = {}, {}
  for k in pairs(attrs or {}) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local v = attrs[k]
    out[#out + 1] = string.format(' %s="%s"', k, svg.escape(type(v) == "number" and num(v) or v))
  end
  return table.concat(out)
end

-- An element: <tag attrs/>, or <tag attrs>text</tag>; a tooltip (title) as its child.
function Doc:add(tag, attrs, text, title)
  local pad = string.rep("  ", self.depth + 1)
  if text == nil and title == nil then
    self.parts[#self.parts + 1] = string.format("%s<%s%s/>", pad, tag, attributes(attrs))
  else
    self.parts[#self.parts + 1] = string.format("%s<%s%s>%s%s</%s>", pad, tag, attributes(attrs),
      title and ("<title>" .. svg.escape(title) .. "</title>") or "", text and svg.escape(text) or "", tag)
  end
  return self
end

function Doc:open(tag, attrs)
  self.parts[#self.parts + 1] = string.format("%s<%s%s>", string.rep("  ", self.depth + 1), tag, attributes(attrs))
  self.depth = self.depth + 1
  self.stack = self.stack or {}
  self.stack[#self.stack + 1] = tag
  return self
end

function Doc:close()
  local tag = table.remove(self.stack)
  self.depth = self.depth - 1
  self.parts[#self.parts + 1] = string.format("%s</%s>", string.rep("  ", self.depth + 1), tag)
  return self
end

function Doc:text(x, y, text, attrs)
  local a = { x = x, y = y, ["font-size"] = FONT }
  for k, v in pairs(attrs or {}) do a[k] = v end
  return self:add("text", a, text)
end

---@return string
function Doc:render()
  assert(self.depth == 0, "svg: an element left open")
  return table.concat {
    '<?xml version="1.0" encoding="UTF-8"?>\n',
    string.format('<svg xmlns="http://www.w3.org/2000/svg" width="%s" height="%s" viewBox="0 0 %s %s" '
      .. 'font-family="sans-serif">\n', num(self.width), num(self.height), num(self.width), num(self.height)),
    string.format('  <rect width="%s" height="%s" fill="white"/>\n', num(self.width), num(self.height)),
    table.concat(self.parts, "\n"), "\n</svg>\n",
  }
end

-- The largest of the values (nil skipped) and of extra, at least tiny: a scale's end.
local function top(values, extra)
  local m = 0
  for _, v in pairs(values) do if type(v) == "number" and v == v and v > m then m = v end end
  if extra and extra > m then m = extra end
  return m > 0 and m or 1
end

local function label_width(rows, field)
  local n = 0
  for _, r in ipairs(rows) do n = math.max(n, #tostring(r[field] or "")) end
  return math.min(n, 40) * CHAR_W + 10
end

-- A legend of series names in one line at (x, y); -> its height.
function svg.legend(doc, x, y, names, colors)
  local cx = x
  for i, name in ipairs(names) do
    doc:add("rect", { class = "legend", x = cx, y = y - 10, width = 12, height = 12, fill = colors[i] })
    doc:text(cx + 16, y, name)
    cx = cx + 28 + #name * CHAR_W
  end
  return 18
end

-- Horizontal bars, a row each, grouped by series: o = {x, y, width, title, unit, series = {names},
-- rows = {{label =, values = {v per series, nil: none}, marks = {{value =, label =}}}}, mark_name}.
-- -> the height it took.
function svg.bars(doc, o)
  local series, rows = o.series or { "" }, o.rows
  local lw = label_width(rows, "label")
  local bar_h, gap = 14, 8
  local row_h = bar_h * #series + gap
  local plot_x, plot_w = o.x + lw, o.width - lw - 90
  local all = {}
  for _, r in ipairs(rows) do
    for i = 1, #series do all[#all + 1] = r.values[i] end
    for _, m in ipairs(r.marks or {}) do all[#all + 1] = m.value end
  end
  local scale = plot_w / top(all)
  local y = o.y
  doc:open("g", { class = "bars" })
  doc:text(o.x, y + FONT, o.title, { ["font-weight"] = "bold" })
  y = y + FONT + 8
  if #series > 1 or o.mark_name then
    local names, colors = {}, {}
    for i, s in ipairs(series) do names[i], colors[i] = s, PALETTE[i] end
    if o.mark_name then names[#names + 1], colors[#colors + 1] = o.mark_name, "#000000" end
    y = y + svg.legend(doc, o.x, y + FONT, names, colors) + 4
  end
  for _, r in ipairs(rows) do
    doc:text(o.x, y + row_h / 2, r.label, { class = "label" })
    for i, name in ipairs(series) do
      local v = r.values[i]
      local by = y + (i - 1) * bar_h
      local tip = string.format("%s%s: %s %s", r.label, name ~= "" and (" (" .. name .. ")") or "", svg.value(v),
        o.unit or "")
      if v then
        doc:add("rect", { class = "bar", ["data-series"] = name, ["data-value"] = v, x = plot_x, y = by,
          width = math.max(v * scale, 0.5), height = bar_h - 2, fill = PALETTE[i] }, nil, tip)
      end
      doc:text(plot_x + (v and v * scale or 0) + 4, by + bar_h - 4, svg.value(v), { ["font-size"] = FONT - 2 })
    end
    for _, m in ipairs(r.marks or {}) do
      local mx = plot_x + m.value * scale
      doc:add("line", { class = "mark", ["data-value"] = m.value, x1 = mx, x2 = mx, y1 = y - 2,
        y2 = y + bar_h * #series, stroke = "#000000", ["stroke-width"] = 2 }, nil,
        string.format("%s: %s %s", m.label or "mark", svg.value(m.value), o.unit or ""))
    end
    y = y + row_h
  end
  doc:text(plot_x, y + FONT, string.format("0 .. %s %s", svg.value(top(all)), o.unit or ""),
    { ["font-size"] = FONT - 2, fill = "#555555" })
  doc:close()
  return y + FONT + 6 - o.y
end

-- A histogram of values in o.bins equal bins over [0, o.max or max(values)]: o = {x, y, width,
-- height, title, values, bins, attrs (of its <g>)} -> the height it took.
function svg.histogram(doc, o)
  local values, bins = o.values, o.bins or 10
  local hi = o.max or top(values)
  local counts = {}
  for b = 1, bins do counts[b] = 0 end
  for _, v in ipairs(values) do
    local b = math.min(math.floor(v / hi * bins) + 1, bins)
    counts[b] = counts[b] + 1
  end
  local g = { class = "histogram" }
  for k, v in pairs(o.attrs or {}) do g[k] = v end
  doc:open("g", g)
  doc:text(o.x, o.y + FONT, o.title, { ["font-size"] = FONT - 1 })
  local ph = o.height - FONT - 22
  local py = o.y + FONT + 4
  local bw = o.width / bins
  local cmax = top(counts)
  for b = 1, bins do
    local h = counts[b] / cmax * ph
    local lo, up = (b - 1) * hi / bins, b * hi / bins
    doc:add("rect", { class = "bin", ["data-count"] = counts[b], x = o.x + (b - 1) * bw, y = py + ph - h,
      width = math.max(bw - 1, 0.5), height = h, fill = PALETTE[1] }, nil,
      string.format("%d experts with %s..%s routes", counts[b], svg.value(lo), svg.value(up)))
  end
  doc:add("line", { x1 = o.x, x2 = o.x + o.width, y1 = py + ph, y2 = py + ph, stroke = "#555555" })
  doc:text(o.x, py + ph + FONT, "0", { ["font-size"] = FONT - 3, fill = "#555555" })
  doc:text(o.x + o.width, py + ph + FONT, svg.value(hi), { ["font-size"] = FONT - 3, fill = "#555555",
    ["text-anchor"] = "end" })
  doc:close()
  return o.height
end

-- Stacked horizontal bars: o = {x, y, width, title, unit, series = {names}, rows = {{label =,
-- parts = {v per series}, note =}}} -> the height it took.
function svg.stacked(doc, o)
  local rows, series = o.rows, o.series
  local lw = label_width(rows, "label")
  local plot_x, plot_w = o.x + lw, o.width - lw - 150
  local totals = {}
  for i, r in ipairs(rows) do
    totals[i] = 0
    for _, v in ipairs(r.parts) do totals[i] = totals[i] + v end
  end
  local scale = plot_w / top(totals)
  local y = o.y
  doc:open("g", { class = "stacked" })
  doc:text(o.x, y + FONT, o.title, { ["font-weight"] = "bold" })
  y = y + FONT + 8
  local colors = {}
  for i = 1, #series do colors[i] = PALETTE[i] end
  y = y + svg.legend(doc, o.x, y + FONT, series, colors) + 4
  for i, r in ipairs(rows) do
    doc:text(o.x, y + 12, r.label, { class = "label" })
    local x = plot_x
    for j, v in ipairs(r.parts) do
      doc:add("rect", { class = "part", ["data-series"] = series[j], ["data-value"] = v, x = x, y = y,
        width = math.max(v * scale, 0), height = 14, fill = PALETTE[j] }, nil,
        string.format("%s, %s: %s %s", r.label, series[j], svg.value(v), o.unit or ""))
      x = x + v * scale
    end
    doc:text(plot_x + totals[i] * scale + 4, y + 11, r.note or svg.value(totals[i]), { ["font-size"] = FONT - 2 })
    y = y + 20
  end
  doc:close()
  return y + 6 - o.y
end

-- Diverging bars of relative changes (scenarios/compare.lua): o = {title, changes = {{path =, a =,
-- b =, pct =}}, better = fn(path) -> +1 larger is better, -1 smaller is, 0 neither} -> the SVG text.
function svg.changes(o)
  local rows = o.changes
  local lw = math.min(label_width(rows, "path"), 60 * CHAR_W)
  local width, row_h = math.max(lw + 520, 700), 18
  local doc = svg.new(width, 60 + math.max(#rows, 1) * row_h + 30)
  doc:text(10, 22, o.title, { ["font-weight"] = "bold" })
  local mid, half = 10 + lw + 200, 190
  local mag = 0
  for _, c in ipairs(rows) do
    if c.pct == c.pct and math.abs(c.pct) < math.huge then mag = math.max(mag, math.abs(c.pct)) end
  end
  mag = mag > 0 and mag or 1
  doc:open("g", { class = "changes" })
  doc:add("line", { x1 = mid, x2 = mid, y1 = 40, y2 = 50 + #rows * row_h, stroke = "#555555" })
  for i, c in ipairs(rows) do
    local y = 40 + (i - 1) * row_h
    local pct = math.max(-mag, math.min(mag, c.pct))
    local w = math.abs(pct) / mag * half
    local dir = (o.better and o.better(c.path) or 0) * (c.b - c.a)
    local fill = dir > 0 and PALETTE[3] or dir < 0 and PALETTE[4] or PALETTE[1]
    doc:text(10, y + 12, c.path, { class = "label", ["font-size"] = FONT - 1 })
    doc:add("rect", { class = "bar", ["data-value"] = c.pct, x = pct < 0 and mid - w or mid, y = y + 2,
      width = math.max(w, 0.5), height = row_h - 5, fill = fill }, nil,
      string.format("%s: %s -> %s (%+.1f%%)", c.path, svg.value(c.a), svg.value(c.b), c.pct))
    doc:text(mid + half + 10, y + 12, string.format("%+.1f%%", c.pct), { ["font-size"] = FONT - 1 })
  end
  if #rows == 0 then doc:text(10, 56, "nothing moved") end
  doc:close()
  return doc:render()
end

return svg
