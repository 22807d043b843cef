-- SPDX-License-Identifier: MIT
-- moelab.svg, the scenarios' pictures: every document it renders is well-formed XML (checked by
-- spec/support.lua's parse_xml, itself checked here on malformed text), and its charts hold the
-- elements a reader looks for: a bar per value, a mark per ceiling, a bin per histogram step.
local S = require "support"
local svg = require "moelab.svg"

describe("the XML check of the specs [#cpu]", function()
  it("reads a small document", function()
    local root = S.parse_xml('<?xml version="1.0"?>\n<a x="1" y=\'&lt;2&gt;\'><b/>t &amp; &#38; &#x26;<c>d</c></a>\n')
    assert.are.same({ "a", "1", "&lt;2&gt;", 2 }, { root.tag, root.attrs.x, root.attrs.y, #root.children })
    assert.are.equal(1, #S.xml_find(root, "c"))
  end)

  for _, row in ipairs {
    { "an unclosed element", "<a><b></a>", "</a> closes <b>" },
    { "an element never closed", "<a><b/>", "<a> is never closed" },
    { "two roots", "<a/><b/>", "a second root element" },
    { "text outside the root", "<a/>x", "text outside the root element" },
    { "an unquoted attribute", "<a x=1/>", "a malformed attribute" },
    { "a repeated attribute", '<a x="1" x="2"/>', "attribute x repeated" },
    { "a bare ampersand", "<a>fish & chips</a>", "a bare '&' or an unknown entity in text" },
    { "an unknown entity", "<a>&nbsp;</a>", "a bare '&' or an unknown entity in text" },
    { "a '<' in a value", '<a x="<"/>', "'<' in attribute x" },
    { "nothing", "", "no root element" },
  } do
    it("refuses " .. row[1], function()
      local ok, err = pcall(S.parse_xml, row[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(row[3], 1, true), tostring(err))
    end)
  end
end)

describe("moelab.svg [#cpu]", function()
  it("escapes text and attribute values", function()
    assert.are.equal("a &lt;b&gt; &amp; &quot;c&quot; &apos;d&apos;", svg.escape([[a <b> & "c" 'd']]))
    local doc = svg.new(100, 50)
    doc:text(1, 2, "R&D <fast>", { class = 'x"y' })
    local root = S.parse_xml(doc:render())
    assert.are.equal("svg", root.tag)
    local t = S.xml_find(root, "text")[1]
    assert.are.same({ "R&amp;D &lt;fast&gt;", "x&quot;y" }, { t.text, t.attrs.class })
  end)

  it("draws a bar per value, none for a value that is missing, and a mark per ceiling", function()
    local doc = svg.new(600, 300)
    svg.bars(doc, { x = 0, y = 0, width = 600, title = "t", unit = "ms", series = { "ours", "theirs" },
      rows = { { label = "a", values = { 2, 4 }, marks = { { value = 1, label = "ceiling" } } },
        { label = "b", values = { 3, nil } } } })
    local root = S.parse_xml(doc:render())
    local bars = S.xml_find(root, "rect", "bar")
    assert.are.equal(3, #bars)
    assert.are.same({ "2", "4", "3" }, { bars[1].attrs["data-value"], bars[2].attrs["data-value"],
      bars[3].attrs["data-value"] })
    -- lengths in proportion to the values, on one scale
    assert.is_true(math.abs(tonumber(bars[2].attrs.width) - 2 * tonumber(bars[1].attrs.width)) < 0.02)
    assert.are.equal(1, #S.xml_find(root, "line", "mark"))
    assert.are.equal(1, #S.xml_find(root, "g", "bars"))
    assert.truthy(doc:render():find(">n/a<", 1, true)) -- the missing value says so
  end)

  it("bins a histogram: counts per equal step, the largest value in the last bin", function()
    local doc = svg.new(300, 200)
    svg.histogram(doc, { x = 0, y = 0, width = 200, height = 120, title = "h", bins = 4, values = { 0, 1, 2, 2, 5, 8 },
      attrs = { ["data-rank"] = 3 } })
    local root = S.parse_xml(doc:render())
    local g = S.xml_find(root, "g", "histogram")
    assert.are.equal(1, #g)
    assert.are.equal("3", g[1].attrs["data-rank"])
    local counts = {}
    for i, b in ipairs(S.xml_find(root, "rect", "bin")) do counts[i] = tonumber(b.attrs["data-count"]) end
    assert.are.same({ 2, 2, 1, 1 }, counts) -- [0, 2): 0, 1; [2, 4): 2, 2; [4, 6): 5; [6, 8]: 8
  end)

  it("stacks parts, each its own rect", function()
    local doc = svg.new(600, 200)
    svg.stacked(doc, { x = 0, y = 0, width = 600, title = "s", series = { "routes", "padding" },
      rows = { { label = "rank 0", parts = { 10, 2 } }, { label = "rank 1", parts = { 0, 0 } } } })
    local parts = S.xml_find(S.parse_xml(doc:render()), "rect", "part")
    assert.are.equal(4, #parts)
    assert.are.same({ "routes", "padding" }, { parts[1].attrs["data-series"], parts[2].attrs["data-series"] })
  end)

  it("renders a diverging bar per change, and says so when nothing moved", function()
    local root = S.parse_xml(svg.changes { title = "x", changes = {
      { path = "a_ms", a = 1, b = 2, pct = 100 }, { path = "b_ms", a = 2, b = 1, pct = -50 } },
      better = function() return -1 end })
    local bars = S.xml_find(root, "rect", "bar")
    assert.are.equal(2, #bars)
    assert.are.same({ "#e15759", "#59a14f" }, { bars[1].attrs.fill, bars[2].attrs.fill }) -- worse, better
    assert.truthy(svg.changes { title = "x", changes = {} }:find("nothing moved", 1, true))
  end)
end)
