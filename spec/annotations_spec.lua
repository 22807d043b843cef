-- SPDX-License-Identifier: MIT
-- library/moelab.lua, the LuaLS definitions of the Lua API, held to what runs and to what is
-- documented: every name of the module, of its classes and of the binding's tensors is declared
-- there and nothing else is; every declared function documents each of its parameters; and the
-- moe.* names of docs/lua-api.md are exactly the declared ones.
local DEFS = "library/moelab.lua"

local function read(path)
  local f = assert(io.open(path, "r"))
  local text = f:read("a")
  f:close()
  return text
end

-- The definitions file -> classes[name] = {functions = {name = {params, doc}}, fields = {name = true}},
-- by the local table each class is declared on ("---@class X" then "local T = {}").
local function definitions(text)
  local classes, of_var, doc, class = {}, {}, {}, nil
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    local name = line:match("^%-%-%-@class ([%w_.]+)")
    if name then
      class = { functions = {}, fields = {} }
      classes[name] = class
    end
    local field = line:match("^%-%-%-@field ([%w_]+)")
    if field and class then class.fields[field] = true end
    local var = line:match("^local ([%w_]+) = {}")
    if var and class then of_var[var] = class end
    local owner, fname, params = line:match("^function ([%w_]+)[.:]([%w_]+)%(([^)]*)%)")
    if owner then
      local list = {}
      for p in params:gmatch("[%w_]+") do list[#list + 1] = p end
      assert(of_var[owner], DEFS .. ": " .. owner .. " is no class's table")
      of_var[owner].functions[fname] = { params = list, doc = table.concat(doc, "\n") }
    end
    if line:match("^%-%-%-") then doc[#doc + 1] = line else doc = {} end
    if line == "" then class = nil end
  end
  return classes
end

local function keys(t, filter)
  local out = {}
  for k, v in pairs(t) do if not filter or filter(k, v) then out[#out + 1] = k end end
  table.sort(out)
  return out
end

local function methods(t) return keys(t, function(k, v) return type(v) == "function" and not k:match("^__") end) end

-- The names of a luaL_Reg array of the binding's C source.
local function registered(path, array)
  local body = read(path):match("luaL_Reg " .. array .. "%[%] = {(.-){NULL")
  assert(body, path .. " has no " .. array)
  local out = {}
  for name in body:gmatch('{"([%w_]+)"') do out[#out + 1] = name end
  table.sort(out)
  return out
end

describe("the LuaLS definitions (" .. DEFS .. ") [#cpu]", function()
  local classes = definitions(read(DEFS))

  it("parse as Lua", function()
    assert.truthy(loadfile(DEFS))
  end)

  it("document every parameter of every function, and no parameter that is not there", function()
    local bad = {}
    for cname, c in pairs(classes) do
      for fname, f in pairs(c.functions) do
        local documented = {}
        for p in f.doc:gmatch("%-%-%-@param ([%w_]+)") do documented[p] = true end
        for _, p in ipairs(f.params) do
          if not documented[p] then bad[#bad + 1] = cname .. "." .. fname .. ": no @param " .. p end
          documented[p] = nil
        end
        for p in pairs(documented) do
          bad[#bad + 1] = cname .. "." .. fname .. ": @param " .. p .. " is not a parameter"
        end
      end
    end
    table.sort(bad)
    assert.are.same({}, bad)
  end)

  it("declare every name of the module, and only those", function()
    local m = classes.moelab
    local declared = keys(m.functions)
    for f in pairs(m.fields) do declared[#declared + 1] = f end
    table.sort(declared)
    assert.are.same(keys(moe), declared)
    for name in pairs(m.functions) do assert.are.equal("function", type(moe[name]), name) end
  end)

  it("declare the methods of the module's classes as they run", function()
    for _, pair in ipairs {
      { "moe.Layer", moe.Layer }, { "moe.Schedule", moe.Schedule }, { "moe.World", moe.World },
      { "moe.Exchange", moe.Exchange }, { "moe.Check", moe.check },
      { "moe.Checkpoint", require("moelab.checkpoint").Checkpoint }, { "moe.Tensor", moe.core.Tensor },
    } do
      assert.are.same(methods(pair[2]), keys(classes[pair[1]].functions), pair[1])
    end
    assert.are.same(keys(moe.models), keys(classes["moe.Models"].fields))
    local ev = moe.event("cpu")
    assert.are.same(methods(getmetatable(ev).__index), keys(classes["moe.Event"].functions))
  end)

  it("declare the binding's graph and safetensors reader methods, and the layer graph's", function()
    assert.are.same(registered("lua/core/event_graph.c", "graph_methods"), keys(classes["moe.Graph"].functions))
    assert.are.same(registered("lua/core/safetensors.c", "methods"), keys(classes["moe.SafeTensors"].functions))
    local layer_graph = {}
    for name in read("lua/moelab/layer.lua"):gmatch("\nfunction Graph:([%w_]+)%(") do
      layer_graph[#layer_graph + 1] = name
    end
    table.sort(layer_graph)
    assert.are.same(layer_graph, keys(classes["moe.LayerGraph"].functions))
    local t = moe.zeros({ 2, 3 })
    for name in pairs(classes["moe.Tensor"].functions) do assert.are.equal("function", type(t[name]), name) end
    for field in pairs(classes["moe.Tensor"].fields) do assert.is_not_nil(t[field], field) end
  end)

  it("match docs/lua-api.md's moe.* names, both ways", function()
    local docs, documented = read("docs/lua-api.md"), {}
    for name in docs:gmatch("moe%.([%a_][%w_]*)") do documented[name] = true end
    local m, declared = classes.moelab, {}
    for f in pairs(m.functions) do declared[f] = true end
    for f in pairs(m.fields) do declared[f] = true end
    assert.are.same(keys(declared), keys(documented))
  end)

  it("match docs/lua-api.md's layer methods, both ways", function()
    local docs, documented = read("docs/lua-api.md"), {}
    for name in docs:gmatch("layer:([%a_][%w_]*)%(") do documented[name] = true end
    local declared = {}
    for f in pairs(classes["moe.Layer"].functions) do -- the constructors are moe.layer and moe.layer_memory
      if f ~= "new" and f ~= "memory_of" then declared[f] = true end
    end
    assert.are.same(keys(declared), keys(documented))
  end)
end)
