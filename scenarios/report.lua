-- SPDX-License-Identifier: MIT
-- The README's results table, regenerated: runs the scenarios and measuring programs that
-- produce each number, on this machine, and prints one markdown row per measurement.
--
--   lua scenarios/report.lua [--cpu] [--devices 0,1,...] [--only WORDS] [--out FILE] [--keep DIR]
--
-- Without a GPU (or with --cpu) it reports the CPU rows; with one, the single-GPU rows (a few
-- minutes on an H200); --devices adds the layer over real GPUs; --only keeps the rows whose
-- description contains one of the comma-separated words (e.g. FP8,router), running only their
-- commands; --keep writes each command's whole output to DIR/N.log (N in the order they ran).  The experts sweep over presets,
-- routings and pads has its own report: lua scenarios/experts.lua.  A measurement whose command
-- fails or prints no number shows the failure in its row; the table is still written, and the
-- exit status is 1.
local cli = require "moelab.cli"
local moe = cli.require "moelab"
local compat = require "moelab.compat"

local opts = cli.parse(arg, {
  { "cpu", "flag", false, "the CPU rows only, even where a GPU is usable" },
  { "devices", "string", nil, "also run the Kimi K2 layer over these GPUs, one rank each" },
  { "only", "list", nil, "only the rows whose description contains one of these words" },
  { "out", "string", nil, "write the table to this file as well" },
  { "keep", "string", nil, "write each command's output to this folder (1.log, 2.log, ...)" },
}, "lua scenarios/report.lua: the results table, measured now")
local out_file = cli.output("out", opts.out)
-- --keep's folder is written after each command: a missing one is said now, before any has run
if opts.keep then
  local probe = opts.keep .. "/.report-probe"
  local f, err = io.open(probe, "w")
  if not f then
    cli.fail(string.format("--keep: cannot write in '%s' (it must be a folder that exists): %s", opts.keep, err))
  end
  f:close()
  os.remove(probe)
end
local build = os.getenv("MOE_BUILD_DIR") or "build"
local gpu = not opts.cpu and moe.default_device() ~= "cpu"
local lua = arg[-1] or "lua"

-- Runs a shell command; returns its output (stdout and stderr) and whether it exited 0.
local function run(command)
  local text, status = compat.run(command .. " 2>&1")
  return text, status == 0
end

-- One pattern's captures from text, formatted; nil when it is absent.
local function grab(text, pattern, fmt)
  local caps = { text:match(pattern) }
  if #caps == 0 then return nil end
  return string.format(fmt, compat.unpack(caps))
end

local rows, ok = {}, true
-- A row: what is measured, the command, and how to read the result from its output.  Several rows
-- may share one command: it runs once.
local outputs, kept = {}, 0 -- command -> { text, exited 0 }; the outputs kept so far
local function wanted(what)
  if not opts.only then return true end
  for _, word in ipairs(opts.only) do
    if what:find(word, 1, true) then return true end
  end
  return false
end
local function row(what, command, read, machine)
  if not wanted(what) then return end
  if not outputs[command] then
    outputs[command] = { run(command) }
    if opts.keep then
      kept = kept + 1
      local f = assert(io.open(string.format("%s/%d.log", opts.keep, kept), "w"))
      f:write("$ ", command, "\n", outputs[command][1])
      f:close()
    end
  end
  local text, done = compat.unpack(outputs[command])
  local result = done and read(text) or nil
  if not result then
    ok = false
    local last = text:gsub("%s+$", ""):match("([^\n]*)$") or ""
    result = "not measured: " .. last:sub(1, 80)
  end
  local function literal(str) return (str:gsub("%p", "%%%0")) end
  local shown = command:gsub("^" .. literal(lua) .. " ", "lua "):gsub(literal(build) .. "/", "build/")
  rows[#rows + 1] = { what, result, "`" .. shown .. "`", machine }
end

local gpu_name = gpu and (run("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null"):match("[^\n]+")
  or "a GPU") or nil
local here = gpu and ("one " .. gpu_name:gsub("^NVIDIA ", "")) or "this machine, CPU only"

-- The layer: stage times, graph time, the check.
local function layer_result(text)
  local eager, graph = text:match("\n  total%s+([%d.]+)"), text:match("\n  graph%s+([%d.]+)")
  local check = text:match("check [^\n]-: (%u+)\n")
  if not eager or not check then return nil end
  local err, l2 = text:match("check [^\n]-= ([%d.e+-]+) %(tol[^\n]-= ([%d.e+-]+) %(tol")
  if err then check = string.format("%s (max err / max ref %s, relative L2 %s)", check, err, l2) end
  local experts = grab(text, "\n  experts%s+([%d.]+)%s+([%d.]+) TFLOP/s", "; experts %s ms = %s TFLOP/s") or ""
  local anchor = grab(text, "\n  anchor%s+FP8 ([%d.]+) ms a rank, bf16 ([%d.]+) ms a rank[^\n]-= ([%d.]+)",
    "; a rank FP8 %s ms beside bf16 %s ms in the same call (%s)") or ""
  local graphed = graph and (", " .. graph .. " ms as one CUDA graph") or ""
  return string.format("%s ms a pass%s%s; check %s%s", eager, graphed, experts, check, anchor)
end

row("Kimi K2 layer, 8 ranks simulated" .. (gpu and " on one GPU (8 x 7,168 tokens)" or " (H, F, tokens reduced)"),
  lua .. " scenarios/kimi.lua" .. (gpu and "" or " --device cpu"), layer_result, here)
if gpu then
  row("Kimi K2 layer, decode (8 x 128 tokens)", lua .. " scenarios/kimi.lua --tokens 128", layer_result, here)
  local function sched(label)
    return function(text)
      local pat = "\n" .. label:gsub("%p", "%%%0") .. "[^\n]-([%d.]+)%s+([%d.]+)%s+[%d.]+x"
      local legacy, ours = text:match(pat)
      return ours and string.format("%s µs a call (legacy baseline %s)", ours, legacy)
    end
  end
  local s = lua .. " scenarios/scheduler.lua"
  row("schedule, Kimi K2 rank of EP8 (T 7,168), worst-case capacity", s, sched("Kimi K2"), here)
  row("schedule, the same at the layer's capacity", s .. " --capacity layer", sched("Kimi K2"), here)
  row("schedule, E 384 top-8, 512 tokens, EP8", s, function(text)
    local ours = text:match("\nE 384, top%-8%s+8%s+512[^\n]-([%d.]+)%s+[%d.]+x")
    return ours and (ours .. " µs a call")
  end, here)
  local rdc = build .. "/bench/dispatch_combine_bench"
  row("dispatch gather, Kimi K2 rank 0 of EP8", rdc, function(text)
    return grab(text, "bench dispatch[^\n]-([%d.]+) ms, ([%d.]+) TB/s", "%s ms, %s TB/s (bytes read + written)")
  end, here)
  row("combine, 7,168 tokens x 8 routes x 7168", rdc, function(text)
    return grab(text, "bench combine[^\n]-([%d.]+) ms, ([%d.]+) TB/s", "%s ms, %s TB/s")
  end, here)
  -- 30 passes back to back: the card's power cap lowers its clocks after the first few
  local ex = build .. "/bench/experts_bench --passes 30"
  row("experts (gate_up + SwiGLU + down), Kimi K2 rank of EP8, 57,344 rows", ex, function(text)
    return grab(text, "TIME experts %[([%w]+)%] Kimi K2 rank of EP8[^\n]-median ([%d.]+) ms[^\n]-= ([%d.]+) TFLOP/s",
      "kernel %s: %s ms = %s TFLOP/s (median of 30 back-to-back passes)")
  end, here)
  row("experts, decode: 48 experts x 8 rows", ex, function(text)
    return grab(text, "TIME experts %[([%w]+)%] decode[^\n]-median ([%d.]+) ms[^\n]-= (%d+) GB/s",
      "kernel %s: %s ms = %s GB/s of weights read")
  end, here)
  row("Kimi K2 FP8 layer, 8 ranks simulated on one GPU (8 x 7,168 tokens)",
    lua .. " scenarios/kimi.lua --precision fp8 --anchor", layer_result, here)
  row("Kimi K2 FP8 layer, decode (8 x 128 tokens)", lua .. " scenarios/kimi.lua --precision fp8 --tokens 128 --anchor",
    layer_result, here)
  row("FP8 experts, Kimi K2 rank 0 of EP8 (uniform routing), beside cuBLASLt's FP8 dense pair of the same rows",
    lua .. " scenarios/experts.lua --precision fp8 --models kimi_k2 --dists uniform --pads 1", function(text)
      local ms, ours, dense = text:match("\nKimi K2%s+uniform%s+1%s+%d+%s+[%d.]+ / [%d.]+%s+([%d.]+)%s+([%d.]+)%s+"
        .. "[%d.]+%s+([%d.]+)")
      return ms and string.format("%s ms = %s TFLOP/s; cuBLASLt %s TFLOP/s (ours %.2fx)", ms, ours, dense,
        tonumber(ours) / tonumber(dense))
    end, here)
  row("router logits, Kimi K2 rank (7,168 tokens, H 7168, E 384)", build .. "/bench/logits_bench", function(text)
    local t, tt = text:match("TIME logits %[tensor%][^\n]-median ([%d.]+) ms[^\n]-= ([%d.]+) TFLOP/s")
    local c = text:match("TIME logits %[cublas%][^\n]-median ([%d.]+) ms")
    return t and string.format("tensor cores %s ms = %s TFLOP/s (cuBLAS's GEMM %s ms)", t, tt, c or "n/a")
  end, here)
end
if opts.devices then
  local n = select(2, opts.devices:gsub(",", "")) + 1
  row(string.format("Kimi K2 layer over %d GPUs, one rank each", n),
    lua .. " scenarios/kimi.lua --devices " .. opts.devices, layer_result, string.format("%d GPUs", n))
end

local lines = { "| what | result | command | machine |", "|---|---|---|---|" }
for _, r in ipairs(rows) do lines[#lines + 1] = "| " .. table.concat(r, " | ") .. " |" end
local text = table.concat(lines, "\n") .. "\n"
io.write(text)
if out_file then
  out_file:write(text)
  out_file:close()
end
os.exit(ok and 0 or 1)
