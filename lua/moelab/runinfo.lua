-- SPDX-License-Identifier: MIT
-- Where and how a report was measured, so that two reports can be compared safely: moelab's
-- version and the commit of the sources that ran, the devices (name, SM clock, driver and CUDA
-- versions, NCCL for a world), the interpreter, the date and the command line.  Every scenario's
-- JSON report carries it under "run"; scenarios/compare.lua reads it first.
local core = require "moelab.core"
local args = require "moelab.args"

local runinfo = {}

-- What a device is (moe_device_info): "key: value" lines into a table, counts as numbers and
-- versions as text ("12.10" is not 12.1).
---@param device string "cpu" or "cuda:N"
---@return moe.DeviceInfo
function runinfo.device_info(device)
  if type(device) ~= "string" then
    args.fail("device_info", "device must be \"cpu\" or \"cuda:N\", got " .. args.describe(device))
  end
  local info = {}
  for key, value in core.device_info(device):gmatch("([%w_]+): ([^\n]*)\n") do
    info[key] = value:match("^%d+$") and tonumber(value) or value
  end
  return info
end

-- The output of a shell command's first line, or nil when it fails or prints nothing.
local function first_line(command)
  local p = io.popen(command .. " 2>/dev/null")
  if not p then return nil end
  local line = p:read("*l")
  p:close()
  return line ~= "" and line or nil
end

local function shell_quote(s)
  if s:match("^[%w%-_./=:,+@]+$") then return s end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- The commit of the checkout moelab's Lua files were loaded from (nil where they are installed,
-- or git is absent), and whether tracked files differ from it.
local function source_commit()
  local file = package.searchpath and package.searchpath("moelab", package.path)
  local dir = file and file:match("^(.*)/[^/]*$") or "."
  local git = "git -C " .. shell_quote(dir)
  local commit = first_line(git .. " rev-parse HEAD")
  if not commit then return nil, nil end
  return commit, first_line(git .. " status --porcelain --untracked-files=no") ~= nil
end

-- The command line of this run, as a shell would take it again: the interpreter, the script and
-- its arguments (the global `arg` of the standalone interpreters).
function runinfo.command()
  local a = rawget(_G, "arg")
  if type(a) ~= "table" then return nil end
  local first = 0
  while a[first - 1] do first = first - 1 end
  local words = {}
  for i = first, #a do words[#words + 1] = shell_quote(tostring(a[i])) end
  return table.concat(words, " ")
end

---@class moe.RunInfo
---@field moelab string moelab's version
---@field commit? string the commit of the sources that ran (nil where not a git checkout)
---@field dirty? boolean tracked files differ from that commit
---@field lua string the interpreter (_VERSION, or LuaJIT's version)
---@field date string UTC, ISO 8601
---@field command? string the command line
---@field device moe.DeviceInfo the device the run used (a world's first)
---@field devices? moe.DeviceInfo[] every GPU of a world
---@field nccl? string NCCL's version, for a world

-- The metadata of a run on o.device, or over the GPUs o.devices (a world: NCCL's version too).
---@param o { device: string, devices?: string[] }
---@return moe.RunInfo
function runinfo.collect(o)
  local jit = rawget(_G, "jit")
  local commit, dirty = source_commit()
  local r = {
    moelab = core.version, commit = commit, dirty = dirty,
    lua = type(jit) == "table" and jit.version or _VERSION,
    date = os.date("!%Y-%m-%dT%H:%M:%SZ"),
    command = runinfo.command(),
    device = runinfo.device_info(o.device),
  }
  r.device.device = o.device
  if o.devices then
    r.devices = {}
    for i, d in ipairs(o.devices) do
      r.devices[i] = runinfo.device_info(d)
      r.devices[i].device = d
    end
    r.nccl = r.devices[1] and r.devices[1].nccl
  end
  return r
end

return runinfo
