-- SPDX-License-Identifier: MIT
-- Which kernel a stage runs and why: the C library's report (moe_<stage>_explain) as a table,
-- and the context's options (moe_ctx_config): its kernels, and the router logits' path.
local core = require "moelab.core"
local args = require "moelab.args"

local explain = {}

-- "<kernel>\n<name>: <verdict>\n..." -> { kernel = "<kernel>", candidates = { {name=, verdict=}, ... } },
-- printing as the report itself.
local Choice = { __name = "moelab.Choice" }
Choice.__index = Choice
function Choice:__tostring()
  local lines = { self.kernel }
  for _, c in ipairs(self.candidates) do lines[#lines + 1] = string.format("  %s: %s", c.name, c.verdict) end
  return table.concat(lines, "\n")
end

function explain.parse(report)
  local kernel, rest = report:match("^([^\n]*)\n(.*)$")
  local choice = setmetatable({ kernel = kernel or report, candidates = {} }, Choice)
  for name, verdict in (rest or ""):gmatch("([^:\n]+): ([^\n]*)") do
    choice.candidates[#choice.candidates + 1] = { name = name, verdict = verdict }
  end
  return choice
end

local OPTIONS = { "schedule_kernel", "experts_kernel", "experts_fp8_kernel", "logits" }
local OPTION_TYPES = {} -- each a string
for _, name in ipairs(OPTIONS) do OPTION_TYPES[name] = "string" end

-- config() -> { schedule_kernel = "auto", experts_kernel = "auto", experts_fp8_kernel = "auto",
-- logits = "tensor" };
-- config{ experts_kernel = "mma", logits = "exact" } sets the named options (their values are
-- checked by the library) and returns them all.
function explain.config(o)
  if o ~= nil then
    args.options("config", o, OPTION_TYPES)
    for _, name in ipairs(OPTIONS) do -- "" is no value's name, nor "auto"
      if o[name] == "" then
        args.fail("config", string.format("option '%s' must be %s or 'auto', got \"\"", name,
          name == "logits" and "'tensor', 'exact'" or "a kernel name"))
      end
    end
    local before = {}
    for _, name in ipairs(OPTIONS) do before[name] = core.config(name) end
    for _, name in ipairs(OPTIONS) do
      if o[name] ~= nil then
        local ok, err = pcall(core.config, name, o[name])
        if not ok then -- all or nothing: the options set before this one go back
          for _, back in ipairs(OPTIONS) do core.config(back, before[back]) end
          local why = tostring(err):gsub("^config: " .. name .. " ", "")
          args.fail("config", string.format("option '%s' %s", name, why))
        end
      end
    end
  end
  local now = {}
  for _, name in ipairs(OPTIONS) do now[name] = core.config(name) end
  return now
end

return explain
