-- SPDX-License-Identifier: MIT
-- Small helpers shared by the suites (plain Lua, no busted): rounding to the tensor dtypes as
-- the library defines them, seeded random draws, tensors from flat tables.  Not a suite itself
-- (no _spec in the name); the suites `require "support"`.
local compat = require "moelab.compat"

local support = {}

-- x rounded to the nearest f32 (round to nearest even: the C cast of a double).
support.f32 = compat.f32
local f32_bits, from_f32_bits = compat.f32_bits, compat.from_f32_bits

-- x rounded to bf16 the way the library does it: to f32 first, then to the nearest bf16, ties to
-- even; NaN stays NaN.  Written from the definition of round-to-nearest-even on the bits (as
-- arithmetic on the 32-bit word: LuaJIT's bit operations are signed).
function support.bf16(x)
  if x ~= x then return x end
  local u = f32_bits(x)
  local hi, low = math.floor(u / 0x10000), u % 0x10000
  if hi % 0x8000 >= 0x7f80 then return from_f32_bits(u) end -- inf stays inf (exponent all ones)
  if low > 0x8000 or (low == 0x8000 and hi % 2 == 1) then hi = hi + 1 end
  return from_f32_bits(hi * 0x10000 % 0x100000000)
end

-- An integer in [a, b] from math.random (seeded by the caller).
function support.int(a, b) return math.random(a, b) end
function support.pick(list) return list[math.random(1, #list)] end
function support.chance(p) return math.random() < p end

-- A flat table of n copies of v.
function support.filled(n, v)
  local t = {}
  for i = 1, n do t[i] = v end
  return t
end

-- The interpreter that runs the suite (busted starts again under the one .busted names), for
-- the programs a suite starts: plain `lua` may be another version.
support.lua = (function()
  local i = 0
  while arg and arg[i - 1] do i = i - 1 end
  return arg and i < 0 and arg[i] or "lua5.4"
end)()

-- Runs `lua <script> <flags>` from the repository root as a user would, against this checkout's
-- front-end and build (MOE_BUILD_DIR), with env (variables put before the command, after the
-- paths, which they may override: "A=1 B=2"), lua the interpreter (default the suite's) -> its
-- output (stdout and stderr) and exit status.
function support.run_lua(script, flags, env, lua)
  local cmd = string.format("LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;' %s %s %s %s 2>&1; "
    .. "echo \"status=$?\"", os.getenv("MOE_BUILD_DIR") or "build", env or "", lua or support.lua, script, flags or "")
  local f = assert(io.popen(cmd))
  local out = f:read("a")
  f:close()
  local status = tonumber(out:match("status=(%d+)%s*$"))
  return out:gsub("status=%d+%s*$", ""), status
end

-- A well-formedness check of XML (the scenarios' SVG pictures), strict where they could go wrong:
-- one root element, every tag closed in order, attributes quoted and not repeated, no '<' or
-- bare '&' in text or values, only the five predefined entities and character references.
-- -> the root {tag =, attrs = {...}, children = {...}, text =}; raises "xml: <what> at byte N".
function support.parse_xml(text)
  local pos, root, stack = 1, nil, {}
  local function fail(what) error(string.format("xml: %s at byte %d", what, pos), 2) end
  local function check_chars(s, where)
    if s:find("<", 1, true) then fail("'<' in " .. where) end
    local i = s:find("&", 1, true)
    while i do
      local ref = s:match("^&([#%w]+);", i)
      if not (ref == "amp" or ref == "lt" or ref == "gt" or ref == "quot" or ref == "apos"
          or ref and (ref:match("^#%d+$") or ref:match("^#x%x+$"))) then
        fail("a bare '&' or an unknown entity in " .. where)
      end
      i = s:find("&", i + 1, true)
    end
  end
  if text:sub(1, 5) == "<?xml" then
    local stop = text:find("?>", 1, true)
    if not stop then fail("an unterminated XML declaration") end
    pos = stop + 2
  end
  while pos <= #text do
    local lt = text:find("<", pos, true)
    local chunk = text:sub(pos, (lt or #text + 1) - 1)
    if #stack == 0 and chunk:find("%S") then fail("text outside the root element") end
    check_chars(chunk, "text")
    if #stack > 0 then stack[#stack].text = stack[#stack].text .. chunk end
    if not lt then break end
    pos = lt
    if text:sub(pos, pos + 3) == "<!--" then
      local stop = text:find("-->", pos, true)
      if not stop then fail("an unterminated comment") end
      pos = stop + 3
    elseif text:sub(pos, pos + 1) == "</" then
      local name, stop = text:match("^</([%w_:%-%.]+)%s*>()", pos)
      if not name then fail("a malformed end tag") end
      local open = table.remove(stack)
      if not open or open.tag ~= name then
        fail("</" .. name .. "> closes " .. (open and ("<" .. open.tag .. ">") or "nothing"))
      end
      pos = stop
    else
      local name, rest = text:match("^<([%a_][%w_:%-%.]*)()", pos)
      if not name then fail("a malformed start tag") end
      if #stack == 0 and root then fail("a second root element") end
      local node = { tag = name, attrs = {}, children = {}, text = "" }
      pos = rest
      while true do
        local ws, after = text:match("^(%s*)()", pos)
        pos = after
        local c = text:sub(pos, pos)
        if c == ">" or text:sub(pos, pos + 1) == "/>" then break end
        if ws == "" then fail("attributes not separated by space") end
        local key, q, after_eq = text:match("^([%a_][%w_:%-%.]*)%s*=%s*(['\"])()", pos)
        if not key then fail("a malformed attribute") end
        local close = text:find(q, after_eq, true)
        if not close then fail("an unterminated attribute value") end
        local value = text:sub(after_eq, close - 1)
        check_chars(value, "attribute " .. key)
        if node.attrs[key] ~= nil then fail("attribute " .. key .. " repeated") end
        node.attrs[key] = value
        pos = close + 1
      end
      local parent = stack[#stack]
      if parent then parent.children[#parent.children + 1] = node else root = node end
      if text:sub(pos, pos + 1) == "/>" then pos = pos + 2
      else
        pos = pos + 1
        stack[#stack + 1] = node
      end
    end
  end
  if #stack > 0 then fail("<" .. stack[#stack].tag .. "> is never closed") end
  if not root then fail("no root element") end
  return root
end

-- Every element of an XML tree (support.parse_xml) whose tag is tag and, where given, whose
-- class attribute is class.
function support.xml_find(node, tag, class, out)
  out = out or {}
  if node.tag == tag and (class == nil or node.attrs.class == class) then out[#out + 1] = node end
  for _, c in ipairs(node.children) do support.xml_find(c, tag, class, out) end
  return out
end

-- A tensor of dtype and shape on dev from a flat Lua table.
function support.tensor(flat, dtype, shape, dev)
  return moe.tensor(flat, { dtype = dtype, shape = shape, device = dev or "cpu" })
end

-- Closes t at once, as a <close> variable leaving its scope would (t:close(), which LuaJIT has
-- too: its getmetatable gives no cdata's metatable).
function support.close(t) t:close() end

-- fn() run with every way the front-end makes a tensor (moe.core.new, from_table) raising
-- instead -> pcall's results.  A refusal must come before the first allocation; and a broken
-- one fails at its first tensor rather than allocate the tens of GB it was asked for.
function support.without_allocating(fn)
  local core = moe.core
  local new, from_table = core.new, core.from_table
  local function refuse() error("a tensor was allocated", 0) end
  core.new, core.from_table = refuse, refuse
  local ok, a = pcall(fn)
  core.new, core.from_table = new, from_table
  return ok, a
end

-- The flat contents of t read from any device.
function support.flat(t) return t:flat() end

-- "a=1 b=2" of the listed fields of t, for test names.
function support.describe(t, fields)
  local s = {}
  for _, f in ipairs(fields) do s[#s + 1] = f .. "=" .. tostring(t[f]) end
  return table.concat(s, " ")
end

-- Asserts |got[i] - ref[i]| <= rtol * |ref[i]| + atol for every i (flat tables), with the first
-- offender in the message.
function support.assert_near(got, ref, rtol, atol, what)
  assert(#got == #ref, string.format("%s: %d values, expected %d", what or "values", #got, #ref))
  for i = 1, #ref do
    local g, r = got[i], ref[i]
    if not (math.abs(g - r) <= rtol * math.abs(r) + atol) then
      error(string.format("%s: at %d got %.9g, expected %.9g (|diff| %.3g > %.3g)", what or "values", i, g, r,
        math.abs(g - r), rtol * math.abs(r) + atol), 2)
    end
  end
  return true
end

-- Runs a shell command, its stderr joined to its stdout: true when it exits 0, and the output.
-- The status is read from the output, not from close(), which LuaJIT does not report.  The
-- command runs without LD_PRELOAD: the sanitizer suite preloads ASan's runtime (.ci/run), whose
-- leak check would abort the tools that leak at exit (mktemp, cmake, cc); support.preloaded
-- gives it back to the programs that need it.
function support.shell(cmd)
  local p = assert(io.popen("unset LD_PRELOAD; { " .. cmd .. "\n} 2>&1; echo \"exit=$?\""))
  local out = p:read("a")
  p:close()
  local text, code = out:match("^(.-)exit=(%d+)\n?$")
  return code == "0", text or out
end

-- cmd, with the LD_PRELOAD this process was started with (a program that loads an instrumented
-- libmoelab.so needs the sanitizers' runtimes first).
function support.preloaded(cmd)
  local preload = os.getenv("LD_PRELOAD")
  if not preload or preload == "" then return cmd end
  return "LD_PRELOAD=" .. support.shell_quote(preload) .. " " .. cmd
end

-- A new directory under the system's temporary one (mktemp -d) -> its path.
function support.tempdir()
  local ok, out = support.shell("mktemp -d")
  assert(ok, out)
  return (out:gsub("%s+$", ""))
end

-- Removes the tree at path (support.tempdir's); nothing where path is nil (a setup that failed
-- before making it).
function support.remove_tree(path)
  if path then support.shell("rm -rf " .. support.shell_quote(path)) end
end

-- The files git tracks in the checkout, as `git ls-files` names them; none outside a checkout.
function support.tracked_files()
  local p = assert(io.popen("git ls-files 2>/dev/null"))
  local files = {}
  for name in p:lines() do files[#files + 1] = name end
  p:close()
  return files
end

-- The whole text of the file at path; raises where it cannot be read.
function support.read_file(path)
  local f = assert(io.open(path, "r"))
  local text = f:read("a")
  f:close()
  return text
end

-- s quoted for the shell.
function support.shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- Every tensor reachable from a layer through tables (not through the CPU reference's copies, made
-- later), owners only: a view lies inside the memory of a larger tensor it overlaps.  -> the sum
-- of their bytes by device.
function support.allocated(layer)
  local seen, tensors = {}, {}
  local function walk(v)
    if seen[v] then return end
    seen[v] = true
    if moe.core.is_tensor(v) then
      tensors[#tensors + 1] = v
    elseif type(v) == "table" then
      for k, x in pairs(v) do
        if k ~= "cpu" then walk(x) end
      end
    end
  end
  walk(layer)
  table.sort(tensors, function(a, b) return a:nbytes() > b:nbytes() end)
  local owners, bytes = {}, {}
  for _, t in ipairs(tensors) do
    local inside = false
    for _, o in ipairs(owners) do inside = inside or t:overlaps(o) end
    if not inside then
      owners[#owners + 1] = t
      bytes[t.device] = (bytes[t.device] or 0) + t:nbytes()
    end
  end
  return bytes
end

return support
