-- SPDX-License-Identifier: MIT
-- Command-line flags for scenarios: `--name value` or `--name=value`, typed by a spec, with
-- --help.  An unknown flag or a bad value prints the usage and exits with status 2; a
-- configuration the library refuses (cli.guard) prints its message and exits 2 as well, so that
-- status 1 stays a failed check.  In the syntax and library of Lua 5.1 (LuaJIT's too): a scenario
-- loads this before moelab, so that an interpreter moelab refuses ends in status 2 as well.
-- (moelab.compat is required where it is used, once moelab has loaded: it needs what Lua 5.1 and
-- 5.2 lack.)
local cli = {}

-- spec: list of {name, kind ("integer"|"number"|"string"|"list"|"flag"), default, help};
-- positional: what the arguments that are not flags are (shown in the usage), or nil where there
-- are none -> the options, and the list of those arguments.
function cli.parse(argv, spec, title, positional)
  local by_name, opts, rest = {}, {}, {}
  for _, f in ipairs(spec) do
    by_name[f[1]] = f
    opts[f[1]] = f[3]
  end
  local function usage(msg)
    local out = msg and io.stderr or io.stdout
    if msg then out:write(msg, "\n\n") end
    out:write(title, "\n\n", positional and ("arguments: " .. positional .. "\n") or "", "flags:\n")
    for _, f in ipairs(spec) do
      out:write(string.format("  --%-12s %s%s\n", f[1] .. (f[2] == "flag" and "" or " X"), f[4],
        f[3] ~= nil and f[2] ~= "flag" and string.format(" (default %s)", tostring(f[3])) or ""))
    end
    os.exit(msg and 2 or 0)
  end
  local i = 1
  while i <= #argv do
    local a = argv[i]
    local name, value = a:match("^%-%-([%w_%-]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w_%-]+)$") end
    if not name and not positional then usage("unexpected argument '" .. a .. "'") end
    if name == "help" then usage() end
    local f = by_name[name]
    if name and not f then usage("unknown flag --" .. name) end
    if not name then
      rest[#rest + 1] = a
    elseif f[2] == "flag" then
      opts[name] = true
    else
      if value == nil then
        i = i + 1
        value = argv[i]
        -- the next flag is not a value (a value that starts with -- is given as --name=value)
        if value == nil or value:match("^%-%-") then usage("flag --" .. name .. " needs a value") end
      end
      if f[2] == "integer" then
        local v = require("moelab.compat").tointeger(tonumber(value))
        if not v then usage(string.format("flag --%s needs an integer, got '%s'", name, value)) end
        opts[name] = v
      elseif f[2] == "number" then
        local v = tonumber(value)
        if not v then usage(string.format("flag --%s needs a number, got '%s'", name, value)) end
        opts[name] = v
      elseif f[2] == "list" then
        local l = {}
        for item in value:gmatch("[^,]+") do l[#l + 1] = item end
        if #l == 0 then usage(string.format("flag --%s needs a comma-separated list, got '%s'", name, value)) end
        opts[name] = l
      else
        opts[name] = value
      end
    end
    i = i + 1
  end
  return opts, rest
end

-- A combination of flags that parse cannot judge on its own: the message, status 2.
function cli.fail(msg)
  io.stderr:write(msg, "\n")
  os.exit(2)
end

-- fn(...) for a scenario: an error it raises (a configuration the library refuses, a run that
-- cannot be made) is printed without a traceback, after `what`, and exits with status 2.
-- MOE_TRACEBACK=1 adds the traceback (0 or empty does not).
function cli.guard(what, fn, ...)
  local tb = os.getenv("MOE_TRACEBACK")
  tb = tb ~= nil and tb ~= "" and tb ~= "0"
  local compat = require "moelab.compat"
  local res = compat.pack(xpcall(fn, function(e) return tb and debug.traceback(tostring(e), 2) or tostring(e) end, ...))
  if not res[1] then cli.fail(string.format("%s: %s", what, tostring(res[2]))) end
  return compat.unpack(res, 2, res.n)
end

-- require(name) for a scenario: a module that cannot load here (moelab on an interpreter it does
-- not run on, a C module not built) is a configuration, not a failed check: its message, status 2.
function cli.require(name)
  local ok, mod = pcall(require, name)
  if not ok then cli.fail(tostring(mod)) end
  return mod
end

-- The report file of an output flag (--json): checked writable now (a bad path is a usage error
-- before the run, not a traceback after it) without truncating it, and written whole by close, so
-- that a run that fails leaves an earlier report as it was.  nil when the flag is absent.
local Output = {}
Output.__index = Output
function Output:write(...)
  for _, v in ipairs { ... } do self.parts[#self.parts + 1] = tostring(v) end
  return self
end
function Output:close()
  local f, err = io.open(self.path, "w")
  if not f then cli.fail(string.format("--%s: cannot write '%s': %s", self.flag, self.path, err)) end
  f:write(table.concat(self.parts))
  f:close()
end

function cli.output(flag, path)
  if path == nil then return nil end
  local existed = io.open(path, "r")
  if existed then existed:close() end
  local f, err = io.open(path, "a")
  if not f then cli.fail(string.format("--%s: cannot write '%s': %s", flag, path, err)) end
  f:close()
  if not existed then os.remove(path) end -- nothing there until there is a report
  return setmetatable({ flag = flag, path = path, parts = {} }, Output)
end

return cli
