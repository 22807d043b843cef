-- SPDX-License-Identifier: MIT
-- moe.world: argument errors (no GPU needed), the configuration comparison (no GPU needed),
-- and a world of one rank through NCCL on cuda:0 against the plain stages (#gpu).  Worlds of
-- several GPUs are exercised by spec/gpu/test_world_gpu.c where 2+ GPUs are visible.
local S = require "support"

local HEX = string.rep("0123456789abcdef", 16) -- a well-formed id (256 digits), not a live one
local build = os.getenv("MOE_BUILD_DIR") or "build"
local NOT_AN_ID = os.tmpname() -- a file that holds text, but no id (removed at the end)
do
  local f = assert(io.open(NOT_AN_ID, "w"))
  f:write("not an id\n")
  f:close()
end

-- Runs `code` in a fresh lua with exactly the MOE_* variables of env set; returns ok, output.
local function run_with_env(env, code)
  local vars = { "MOE_RANK", "MOE_WORLD_SIZE", "MOE_DEVICE", "MOE_NCCL_ID", "MOE_NCCL_ID_FILE" }
  local cmd = { "env" }
  for _, v in ipairs(vars) do cmd[#cmd + 1] = "-u " .. v end
  for k, v in pairs(env) do cmd[#cmd + 1] = string.format("%s='%s'", k, v) end
  cmd[#cmd + 1] = string.format("LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./%s/?.so;;'", build)
  cmd[#cmd + 1] = string.format("%s -e '%s' 2>&1; echo \"exit=$?\"", S.lua, code)
  local p = io.popen(table.concat(cmd, " "))
  local out = p:read("a")
  p:close()
  return tonumber(out:match("exit=(%d+)%s*$")) == 0, out
end

local ROWS = {
  { "no options", function() moe.world {} end, "give option 'devices'" },
  { "unknown option", function() moe.world { device = 0, ranks = 2 } end, "unknown option 'ranks'" },
  { "devices not a table", function() moe.world { devices = 0 } end, "option 'devices' must be a table, got 0" },
  { "devices empty", function() moe.world { devices = {} } end, "option 'devices' must list at least one GPU index" },
  { "devices negative", function() moe.world { devices = { 0, -1 } } end,
    "devices[2] must be a GPU index (an integer >= 0), got -1" },
  { "devices not integers", function() moe.world { devices = { "cuda:0" } } end,
    "devices[1] must be a GPU index (an integer >= 0), got \"cuda:0\"" },
  { "devices repeated", function() moe.world { devices = { 0, 1, 0 } } end, "devices[3] repeats GPU 0 (devices[1])" },
  { "devices with rank", function() moe.world { devices = { 0 }, rank = 0 } end,
    "option 'devices' (every rank in this process) cannot be combined with option 'rank'" },
  { "size 0", function() moe.world { rank = 0, size = 0, device = 0, id = HEX } end, "option 'size' must be >= 1, got 0" },
  { "rank too large", function() moe.world { rank = 4, size = 4, device = 0, id = HEX } end,
    "option 'rank' must be between 0 and 3 (size 4), got 4" },
  { "rank negative", function() moe.world { rank = -1, size = 2, device = 0, id = HEX } end,
    "option 'rank' must be between 0 and 1 (size 2), got -1" },
  { "device missing", function() moe.world { rank = 0, size = 2, id = HEX } end,
    "option 'device' is required with a multi-process world" },
  { "device negative", function() moe.world { rank = 0, size = 2, device = -3, id = HEX } end,
    "option 'device' must be a GPU index >= 0, got -3" },
  { "no id", function() moe.world { rank = 0, size = 2, device = 0 } end, "give exactly one of option 'id'" },
  { "id and id_file", function() moe.world { rank = 0, size = 2, device = 0, id = HEX, id_file = "x" } end,
    "give exactly one of option 'id'" },
  { "id too short", function() moe.world { rank = 0, size = 2, device = 0, id = "abc" } end,
    "option 'id' must be 256 hex digits (an NCCL unique id from moe.world_unique_id()), got 3 characters" },
  { "id not hex", function() moe.world { rank = 0, size = 2, device = 0, id = "g" .. HEX:sub(2) } end,
    "option 'id' has \"g\" at position 1, expected a hex digit" },
  { "id a number", function() moe.world { rank = 0, size = 2, device = 0, id = 12 } end,
    "option 'id' must be a string, got 12" },
  { "a negative id_wait", function()
    moe.world { rank = 1, size = 2, device = 0, id_file = "/nonexistent/nccl.id", id_wait = -1 }
  end, "option 'id_wait' must be a finite number >= 0, got -1" },
  { "id file rank 0 cannot write", function() moe.world { rank = 0, size = 2, device = 0, id_file = "/nonexistent/nccl.id" } end,
    { "option 'id_file': rank 0 makes the id but cannot write \"/nonexistent/nccl.id\"", "No such file" } },
  -- a rank other than 0 waits for rank 0's file; here none comes
  { "id file that never appears", function()
      moe.world { rank = 1, size = 2, device = 0, id_file = "/nonexistent/nccl.id", id_wait = 0.2 }
    end, { "option 'id_file': no id appeared at \"/nonexistent/nccl.id\" within 0.2 s" } },
  { "id file without an id", function() moe.world { rank = 0, size = 2, device = 0, id_file = NOT_AN_ID } end,
    "does not hold an id: its text must be 256 hex digits" },
  -- a world over the caller's communicator (no NCCL call is reached: the address is never used)
  { "comm with devices", function() moe.world { comm = 8, devices = { 0 } } end,
    "option 'comm' (the caller's NCCL communicator) cannot be combined with option 'devices'" },
  { "comm with rank", function() moe.world { comm = 8, device = 0, rank = 0 } end,
    "option 'comm' (the caller's NCCL communicator) cannot be combined with option 'rank'" },
  { "comm without device", function() moe.world { comm = 8 } end, "option 'device' is required with option 'comm'" },
  { "comm as text", function() moe.world { comm = "0x8", device = 0 } end,
    "option 'comm' must be an integer >= 0 or a light userdata, got \"0x8\"" },
  { "comm NULL", function() moe.world { comm = 0, device = 0 } end, "option 'comm' is a NULL address" },
  { "comm on a negative device", function() moe.world { comm = 8, device = -1 } end,
    "option 'device' must be a GPU index >= 0, got -1" },
}

describe("moe.world argument errors [#cpu]", function()
  teardown(function() os.remove(NOT_AN_ID) end)

  -- rank 1 waits for the file rank 0 writes: here one appears after 0.3 s (written by a shell in
  -- the background, holding no id, so that nothing connects anywhere) and is read then
  it("a rank other than 0 waits for the id file and reads it when it appears", function()
    local path = os.tmpname()
    os.remove(path) -- a path where no file is yet
    -- without LD_PRELOAD: under the sanitizer run the shell's own leaks would be reported
    assert(os.execute(string.format(
      "env -u LD_PRELOAD sh -c '(sleep 0.3; echo not-an-id > %s.tmp && mv %s.tmp %s) &'", path, path, path)))
    local t0 = moe.core.now()
    local ok, err = pcall(moe.world, { rank = 1, size = 2, device = 0, id_file = path, id_wait = 10 })
    local waited = moe.core.now() - t0
    os.remove(path)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("does not hold an id", 1, true), tostring(err))
    assert.is_true(waited >= 0.25 and waited < 5, string.format("waited %.2f s", waited))
  end)

  for _, row in ipairs(ROWS) do
    it(row[1], function()
      local ok, err = pcall(row[2])
      assert.is_false(ok, "no error raised")
      err = tostring(err)
      for _, frag in ipairs(type(row[3]) == "table" and row[3] or { row[3] }) do
        assert.truthy(err:find(frag, 1, true), string.format("expected %q in the message:\n%s", frag, err))
      end
      assert.truthy(err:find("bad argument #1 to 'world'", 1, true), err)
      assert.truthy(err:find("world_spec%.lua:%d+:"), "the error should point at the caller:\n" .. err)
    end)
  end
end)

describe("moe.world from the environment [#cpu]", function()
  local ENV_ROWS = {
    { "nothing set", {}, "the environment variable MOE_RANK is not set" },
    { "size missing", { MOE_RANK = "0" }, "the environment variable MOE_WORLD_SIZE is not set" },
    { "device missing", { MOE_RANK = "0", MOE_WORLD_SIZE = "2" }, "the environment variable MOE_DEVICE is not set" },
    { "rank not a number", { MOE_RANK = "one", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0" },
      "the environment variable MOE_RANK must be an integer, got \"one\"" },
    { "no id", { MOE_RANK = "0", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0" },
      "neither MOE_NCCL_ID nor MOE_NCCL_ID_FILE is set" },
    { "both ids", { MOE_RANK = "0", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0", MOE_NCCL_ID = HEX, MOE_NCCL_ID_FILE = "f" },
      "both MOE_NCCL_ID and MOE_NCCL_ID_FILE are set" },
    { "bad id", { MOE_RANK = "0", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0", MOE_NCCL_ID = "xyz" },
      "MOE_NCCL_ID must be 256 hex digits" },
    { "rank out of range", { MOE_RANK = "2", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0", MOE_NCCL_ID = HEX },
      "option 'rank' must be between 0 and 1 (size 2), got 2" },
    { "id file rank 0 cannot write", { MOE_RANK = "0", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0",
      MOE_NCCL_ID_FILE = "/nonexistent/id" }, "option 'id_file': rank 0 makes the id but cannot write \"/nonexistent/id\"" },
  }
  for _, row in ipairs(ENV_ROWS) do
    it(row[1], function()
      local ok, out = run_with_env(row[2], 'require("moelab").world{from_env = true}')
      assert.is_false(ok, "no error raised:\n" .. out)
      assert.truthy(out:find(row[3], 1, true), string.format("expected %q in:\n%s", row[3], out))
    end)
  end
  it("an explicit option wins over the environment", function()
    local ok, out = run_with_env({ MOE_RANK = "0", MOE_WORLD_SIZE = "2", MOE_DEVICE = "0", MOE_NCCL_ID = HEX },
      'require("moelab").world{from_env = true, rank = 5}')
    assert.is_false(ok)
    assert.truthy(out:find("got 5", 1, true), out)
  end)
end)

describe("scenarios/launch.sh, the one-host launcher [#cpu]", function()
  local function run(args)
    -- without LD_PRELOAD: under the sanitizer run, bash itself would be reported for leaks
    local f = assert(io.popen("env -u LD_PRELOAD scenarios/launch.sh " .. args .. " 2>&1; echo \"status=$?\""))
    local out = f:read("a")
    f:close()
    return out
  end
  for _, row in ipairs { { "no arguments", "" }, { "no command", "2" }, { "a world size that is no number", "x lua" },
    { "a world size of 0", "0 lua" } } do
    it("refuses " .. row[1] .. " with its usage and status 2", function()
      local out = run(row[2])
      assert.matches("usage: scenarios/launch.sh W command", out, 1, true)
      assert.matches("status=2", out, 1, true)
    end)
  end
  it("stops the other ranks when one fails, and exits with its status", function()
    local t0 = os.time()
    local out = run("2 bash -c 'if [ $MOE_RANK = 1 ]; then exit 3; fi; sleep 20; echo rank $MOE_RANK finished'")
    assert.truthy(out:find("status=3", 1, true), out)
    assert.is_nil(out:find("finished", 1, true), out)
    assert.is_true(os.time() - t0 < 10, "the launcher waited for the rank it should have stopped")
  end)
  it("gives every rank its environment and exits 0 when all succeed", function()
    local out = run("3 bash -c 'echo rank $MOE_RANK of $MOE_WORLD_SIZE on $MOE_DEVICE'")
    for r = 0, 2 do assert.truthy(out:find(string.format("[%d] rank %d of 3 on %d", r, r, r), 1, true), out) end
    assert.truthy(out:find("status=0", 1, true), out)
  end)
end)

describe("scenarios/kimi.lua --devices, its flag errors [#cpu]", function()
  -- the scenario as a user runs it, against this checkout's front-end and module (the
  -- sanitizer run's preload stays: that module is instrumented)
  local function run(flags)
    local out, status = S.run_lua("scenarios/kimi.lua", flags)
    return out .. "status=" .. tostring(status)
  end
  for _, row in ipairs {
    { "--devices 0,x", "--devices: 'x' is not a GPU index" },
    { "--devices ,", "--devices: list at least one GPU" },
    { "--devices 0,1 --world 4", "--world 4 but --devices lists 2 GPUs" },
    { "--devices 0 --device cuda:3", "--device and --devices: give one" },
    -- what the library refuses is a configuration error too (status 2), not a failed check (1)
    { "--layout bogus", "moe.layer: bad argument #1 to 'layer' (option 'layout' must be one of" },
    { "--world 5", "the 384 experts cannot be split over a world of 5 ranks" },
    { "--device cpu --tokens 4 --capacity 1", "the first forward: layer: schedule: capacity overflow on rank 0" },
    { "--tokens 4 --json --hidden 8", "flag --json needs a value" },
  } do
    it(row[1] .. " exits 2 saying so", function()
      local out = run(row[1])
      assert.truthy(out:find(row[2], 1, true), out)
      assert.truthy(out:find("status=2", 1, true), out)
    end)
  end
end)

describe("world configurations [#cpu]", function()
  local base = { world = 2, tokens = 32, k = 8, experts = 16, hidden = 64, capacity = 512, pad = 1, layout = "roundrobin" }
  local function with(t)
    local c = {}
    for k, v in pairs(base) do c[k] = v end
    for k, v in pairs(t) do c[k] = v end
    return c
  end
  it("equal configurations pass on every rank", function()
    for r = 0, 1 do moe.core.world_compare_configs(r, { base, with {} }) end
  end)
  it("a difference is reported on every rank, naming the field and the ranks", function()
    for r = 0, 2 do
      local ok, err = pcall(moe.core.world_compare_configs, r, { base, with {}, with { tokens = 16 } })
      assert.is_false(ok)
      assert.truthy(err:find("world: rank " .. r .. ": the ranks' configurations differ: tokens is 32 on rank 0 but 16 on rank 2",
        1, true), err)
      assert.truthy(err:find("(1 of 3 ranks differ from rank 0)", 1, true), err)
    end
  end)
  it("every field counts, each named when it alone differs", function()
    local changed = { version = 1, world = 4, tokens = 16, k = 4, experts = 32, hidden = 128, capacity = 1024, pad = 128,
      layout = "peer_major", expert_capacity = 64 }
    for field, v in pairs(changed) do
      local ok, err = pcall(moe.core.world_compare_configs, 1, { base, with { [field] = v } })
      assert.is_false(ok, field)
      assert.truthy(err:find("configurations differ: " .. field .. " is ", 1, true), err)
    end
  end)
  it("a misspelt field is an error, not a default", function()
    local ok, err = pcall(moe.core.world_compare_configs, 0, { base, with { tokns = 5 } })
    assert.is_false(ok)
    assert.truthy(err:find("entry 2: unknown field 'tokns'; expected capacity, expert_capacity, experts, hidden, k, "
      .. "layout, pad, tokens, version or world", 1, true), err)
  end)
  it("layout, capacity and the library version count", function()
    local ok, err = pcall(moe.core.world_compare_configs, 0, { base, with { layout = "peer_major" } })
    assert.is_false(ok)
    assert.truthy(err:find("layout is 0 on rank 0 but 1 on rank 1", 1, true), err)
    ok, err = pcall(moe.core.world_compare_configs, 1, { base, with { capacity = 1024, version = 1 } })
    assert.is_false(ok)
    assert.truthy(err:find("version is " .. moe.core.version_number .. " on rank 0 but 1 on rank 1", 1, true), err)
  end)
end)

describe("moe.world without a GPU [#cpu]", function()
  if HAVE_GPU then
    pending("a GPU is present: the one-rank world runs in the #gpu block below")
    return
  end
  it("well-formed options fail with what is missing, not a crash", function()
    for _, o in ipairs { { rank = 0, size = 1, device = 0, id = HEX }, { comm = 8, device = 0 } } do
      local ok, err = pcall(moe.world, o)
      assert.is_false(ok)
      assert.truthy(err:find("without CUDA", 1, true) or err:find("without NCCL", 1, true)
        or err:find("no usable GPU", 1, true), err)
    end
  end)
end)

describe("moe.world of one rank through NCCL on cuda:0 [#gpu]", function()
  if skip_without("cuda:0") then return end
  local dev = "cuda:0"
  local T, K, E, H = 37, 4, 8, 72
  local world

  local function ids_on(d)
    math.randomseed(11)
    local flat = {}
    for i = 1, T * K do flat[i] = S.chance(0.1) and -1 or S.int(0, E - 1) end
    return S.tensor(flat, "i32", { T, K }, d)
  end
  -- new routing into ids (some -1) between a graph's replays
  local function reroute(ids, seed)
    math.randomseed(seed)
    local flat = {}
    for i = 1, T * K do flat[i] = S.int(-1, E - 1) end
    ids:copy(S.tensor(flat, "i32", { T, K }))
  end

  before_each(function()
    world = world or moe.world { devices = { 0 } }
    world:bind()
  end)
  teardown(function()
    if world then world:close() end
  end)

  it("has one rank on cuda:0", function()
    assert.are.equal(1, world.size)
    assert.are.same({ 0 }, world.ranks)
    assert.are.same({ dev }, world.devices)
  end)

  it("allgather_ids gives the input back as [1, T, K]", function()
    local ids = ids_on(dev)
    local all = world:allgather_ids(ids)
    assert.are.same({ 1, T, K }, all.shape)
    assert.tensor_equal(all:view(0, { T, K }), ids)
  end)

  it("the configuration check passes", function()
    world:check_config { tokens = T, k = K, experts = E, hidden = H, capacity = 256, pad = 4, layout = "peer_major" }
  end)

  for _, shared in ipairs { false, true } do
    it("dispatch and combine equal the plain stages bit for bit" .. (shared and " (shared expert)" or ""), function()
      local ids = ids_on(dev)
      local all = world:allgather_ids(ids)
      local s = moe.schedule { ids = all, experts = E, rank = 0, pad = 4, capacity = 256 }
      local x = moe.randn({ T, H }, { dtype = "bf16", seed = 3, device = dev })
      local xs, x_all = world:dispatch { x = x, schedule = s, zero_fill = true }
      local ref_xs = moe.dispatch { x = x:view(0, { 1, T, H }), schedule = s, zero_fill = true }
      assert.tensor_equal(x_all:view(0, { T, H }), x)
      assert.tensor_equal(xs, ref_xs)

      local ys = moe.randn({ s.capacity, H }, { dtype = "bf16", seed = 4, device = dev })
      local w = moe.randn({ T, K }, { seed = 5, device = dev })
      local sh = shared and moe.randn({ T, H }, { dtype = "bf16", seed = 6, device = dev }) or nil
      local g = shared and moe.randn({ T }, { seed = 7, device = dev }) or nil
      local got = world:combine { schedule = s, y = ys, weights = w, shared = sh, shared_gate = g }
      local ref = moe.combine { schedule = s, y = ys, weights = w, shared = sh, shared_gate = g }
      assert.tensor_equal(got, ref)
      local got32 = world:combine { schedule = s, y = ys, weights = w, dtype = "f32" }
      local ref32 = moe.combine { schedule = s, y = ys, weights = w, dtype = "f32" }
      assert.tensor_equal(got32, ref32)
    end)
  end

  it("dispatch refuses an x_all that shares memory with out, and takes x in its own slot of x_all", function()
    local s = moe.schedule { ids = world:allgather_ids(ids_on(dev)), experts = E, rank = 0, pad = 4, capacity = 256 }
    local x = moe.randn({ T, H }, { dtype = "bf16", seed = 21, device = dev })
    local both = moe.zeros({ T * H + 256 * H }, { dtype = "bf16", device = dev })
    local ok, err = pcall(world.dispatch, world, { x = x, schedule = s, x_all = both:view(0, { 1, T, H }),
      out = both:view(T * H - H, { 256, H }) })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("x_all and out share memory", 1, true), tostring(err))
    local base = moe.zeros({ T * H + H }, { dtype = "bf16", device = dev })
    ok, err = pcall(world.dispatch, world, { x = base:view(H, { T, H }), schedule = s, x_all = base:view(0, { 1, T, H }) })
    assert.is_false(ok) -- one row off its slot: overwritten while it is sent
    assert.truthy(tostring(err):find("x_all and x share memory", 1, true), tostring(err))
    local x_all = moe.zeros({ 1, T, H }, { dtype = "bf16", device = dev })
    x_all:select(1):copy(x)
    local xs = world:dispatch { x = x_all:view(0, { T, H }), schedule = s, x_all = x_all, zero_fill = true }
    assert.tensor_equal(xs, moe.dispatch { x = x:view(0, { 1, T, H }), schedule = s, zero_fill = true })
  end)

  it("the exchange captures as a CUDA graph and replays on new routing", function()
    local ids = ids_on(dev)
    local all = moe.zeros({ 1, T, K }, { dtype = "i32", device = dev })
    local s = moe.schedule_plan { ids = all, experts = E, rank = 0, pad = 2, capacity = 256 }
    local x = moe.randn({ T, H }, { dtype = "bf16", seed = 8, device = dev })
    local xs = moe.zeros({ 256, H }, { dtype = "bf16", device = dev })
    local x_all = moe.zeros({ 1, T, H }, { dtype = "bf16", device = dev })
    local w = moe.randn({ T, K }, { seed = 9, device = dev })
    local out = moe.zeros({ T, H }, { dtype = "bf16", device = dev })
    local function step()
      world:allgather_ids(ids, all)
      s:run()
      world:dispatch { x = x, schedule = s, out = xs, x_all = x_all, zero_fill = true }
      world:combine { schedule = s, y = xs, weights = w, out = out }
    end
    step() -- eager first: NCCL connects on its first use
    local graph = moe.graph(step, { device = dev })
    for seed = 20, 22 do
      reroute(ids, seed)
      graph:replay()
      local ref_s = moe.schedule { ids = ids:view(0, { 1, T, K }), experts = E, rank = 0, pad = 2, capacity = 256 }
      local ref_xs = moe.dispatch { x = x:view(0, { 1, T, H }), schedule = ref_s, zero_fill = true }
      assert.tensor_equal(s.route_row, ref_s.route_row)
      assert.tensor_equal(xs, ref_xs)
      assert.tensor_equal(out, moe.combine { schedule = ref_s, y = ref_xs, weights = w })
    end
  end)

  -- FP8 tokens: e4m3 rows quantized per token, with their scales [T, H/128]
  local function fp8_tokens(seed, H8)
    local x = moe.randn({ T, H8 }, { dtype = "bf16", seed = seed, device = dev })
    local q, qs = moe.core.new("e4m3", { T, H8 }, dev), moe.core.new("f32", { T, H8 / 128 }, dev)
    moe.core.quantize { q = q, scale = qs, x = x, kind = "token" }
    return q, qs
  end

  it("dispatch_fp8 equals dispatch_fp8 of the gathered tokens bit for bit, eagerly and in a graph", function()
    local H8 = 256
    local ids = ids_on(dev)
    local all = moe.zeros({ 1, T, K }, { dtype = "i32", device = dev })
    world:allgather_ids(ids, all)
    local s = moe.schedule_plan { ids = all, experts = E, rank = 0, pad = 4, capacity = 256 }
    s:run()
    local q, qs = fp8_tokens(30, H8)
    local xs, xs_scale, x_all, x_scale_all = world:dispatch_fp8 { x = q, x_scale = qs, schedule = s, zero_fill = true }
    assert.tensor_equal(x_all:view(0, { T, H8 }), q)
    assert.tensor_equal(x_scale_all:view(0, { T, H8 / 128 }), qs)
    local function reference(ref_s)
      local out, out_scale = moe.core.new("e4m3", { 256, H8 }, dev), moe.core.new("f32", { H8 / 128, 256 }, dev)
      moe.core.dispatch_fp8 { out = out, out_scale = out_scale, x = q:view(0, { 1, T, H8 }),
        x_scale = qs:view(0, { 1, T, H8 / 128 }), peer_rank = ref_s.peer_rank, peer_route = ref_s.peer_route, k = K,
        zero_fill = true }
      return out, out_scale
    end
    local ref, ref_scale = reference(s)
    assert.tensor_equal(xs, ref)
    assert.tensor_equal(xs_scale, ref_scale)
    -- in place: the tokens and scales in this rank's own slots of the gathered tensors
    x_all:view(0, { T, H8 }):copy(q)
    x_scale_all:view(0, { T, H8 / 128 }):copy(qs)
    local again = world:dispatch_fp8 { x = x_all:view(0, { T, H8 }), x_scale = x_scale_all:view(0, { T, H8 / 128 }),
      x_all = x_all, x_scale_all = x_scale_all, schedule = s, zero_fill = true }
    assert.tensor_equal(again, ref)
    local graph = moe.graph(function()
      world:allgather_ids(ids, all)
      s:run()
      world:dispatch_fp8 { x = q, x_scale = qs, schedule = s, out = xs, out_scale = xs_scale, x_all = x_all,
        x_scale_all = x_scale_all, zero_fill = true }
    end, { device = dev })
    for seed = 31, 33 do
      reroute(ids, seed)
      graph:replay()
      local ref_s = moe.schedule { ids = ids:view(0, { 1, T, K }), experts = E, rank = 0, pad = 4, capacity = 256 }
      local want, want_scale = reference(ref_s)
      assert.tensor_equal(xs, want)
      assert.tensor_equal(xs_scale, want_scale)
    end
  end)

  it("dispatch_fp8 refuses bad arguments, naming them", function()
    local s = moe.schedule { ids = world:allgather_ids(ids_on(dev)), experts = E, rank = 0, pad = 4, capacity = 256 }
    local q, qs = fp8_tokens(34, 256)
    local bf = moe.randn({ T, 256 }, { dtype = "bf16", seed = 35, device = dev })
    local out = moe.core.new("e4m3", { 256, 256 }, dev)
    local ROWS = {
      { { x = bf, x_scale = qs }, "option 'x' must be e4m3" },
      { { x = q }, "option 'x_scale'" },
      { { x = q, x_scale = qs:to("cpu") }, "x_scale must be on cuda:0" },
      { { x = q, x_scale = moe.zeros({ T, 3 }, { device = dev }) }, "x_scale" },
      { { x = q:view(0, { T, 128 }), x_scale = qs }, "x_scale" },
      { { x = q, x_scale = qs, out = out, x_all = out:view(0, { 1, T, 256 }) }, "out and x_all share memory" },
      { { x = q, x_scale = qs, out_scale = moe.zeros({ 256, 2 }, { device = dev }) }, "out_scale must be f32 %[2, 256%]" },
    }
    for i, row in ipairs(ROWS) do
      row[1].schedule = s
      local ok, err = pcall(world.dispatch_fp8, world, row[1])
      assert.is_false(ok, "row " .. i)
      assert.matches(row[2], tostring(err), nil, false, "row " .. i)
    end
  end)

  for _, in_window in ipairs { false, true } do
    it("the direct exchange equals the plain stages bit for bit" .. (in_window and " (x and ys in its windows)" or ""),
      function()
        local C = 256
        local ex = world:exchange { tokens = T, k = K, hidden = H, capacity = C }
        assert.are.equal(1, #ex.x)
        assert.are.same({ T, H }, ex.x[1].shape)
        assert.are.same({ C, H }, ex.ys[1].shape)
        local ids = ids_on(dev)
        local s = moe.schedule { ids = world:allgather_ids(ids), experts = E, rank = 0, pad = 4, capacity = C }
        local x = moe.randn({ T, H }, { dtype = "bf16", seed = 13, device = dev })
        local ys = moe.randn({ C, H }, { dtype = "bf16", seed = 14, device = dev })
        if in_window then
          ex.x[1]:copy(x)
          ex.ys[1]:copy(ys)
          x, ys = ex.x[1], ex.ys[1]
        end
        local w = moe.randn({ T, K }, { seed = 15, device = dev })
        local xs = ex:dispatch { x = x, schedule = s, zero_fill = true }
        assert.tensor_equal(xs, moe.dispatch { x = x:view(0, { 1, T, H }), schedule = s, zero_fill = true })
        local got = ex:combine { schedule = s, y = ys, weights = w }
        assert.tensor_equal(got, moe.combine { schedule = s, y = ys, weights = w })
      end)
  end

  it("the direct exchange refuses sizes other than its own, naming both", function()
    local ex = world:exchange { tokens = T, k = K, hidden = H, capacity = 128 }
    local s = moe.schedule { ids = world:allgather_ids(ids_on(dev)), experts = E, rank = 0, capacity = 256 }
    local x = moe.randn({ T, H }, { dtype = "bf16", seed = 16, device = dev })
    local ok, err = pcall(ex.dispatch, ex, { x = x, schedule = s })
    assert.is_false(ok)
    assert.matches("capacity 256 differ from the exchange's %(37, 4, 72, 128%)", err)
    ok, err = pcall(world.exchange, world, { tokens = T, k = K, hidden = H })
    assert.is_false(ok)
    assert.matches("option 'capacity' is required", err)
  end)

  it("the direct exchange captures as a CUDA graph and replays on new routing", function()
    local C = 256
    local ex = world:exchange { tokens = T, k = K, hidden = H, capacity = C }
    local ids = ids_on(dev)
    local all = moe.zeros({ 1, T, K }, { dtype = "i32", device = dev })
    local s = moe.schedule_plan { ids = all, experts = E, rank = 0, pad = 2, capacity = C }
    local x = ex.x[1]
    x:copy(moe.randn({ T, H }, { dtype = "bf16", seed = 17, device = dev }))
    local xs = moe.zeros({ C, H }, { dtype = "bf16", device = dev })
    local w = moe.randn({ T, K }, { seed = 18, device = dev })
    local out = moe.zeros({ T, H }, { dtype = "bf16", device = dev })
    local function step()
      world:allgather_ids(ids, all)
      s:run()
      ex:dispatch { x = x, schedule = s, out = xs, zero_fill = true }
      ex.ys[1]:copy(xs)
      ex:combine { schedule = s, y = ex.ys[1], weights = w, out = out }
    end
    step()
    local graph = moe.graph(step, { device = dev })
    for seed = 30, 32 do
      reroute(ids, seed)
      graph:replay()
      local ref_s = moe.schedule { ids = ids:view(0, { 1, T, K }), experts = E, rank = 0, pad = 2, capacity = C }
      local ref_xs = moe.dispatch { x = x:view(0, { 1, T, H }), schedule = ref_s, zero_fill = true }
      assert.tensor_equal(xs, ref_xs)
      assert.tensor_equal(out, moe.combine { schedule = ref_s, y = ref_xs, weights = w })
    end
  end)

  it("a graph of the direct exchange keeps the exchange, and its windows, as long as the graph", function()
    local C = 256
    local all = moe.zeros({ 1, T, K }, { dtype = "i32", device = dev })
    local s = moe.schedule_plan { ids = all, experts = E, rank = 0, pad = 2, capacity = C }
    local ids = ids_on(dev)
    local x = moe.randn({ T, H }, { dtype = "bf16", seed = 19, device = dev }) -- not a window: copied in
    local xs = moe.zeros({ C, H }, { dtype = "bf16", device = dev })
    local held = setmetatable({}, { __mode = "v" }) -- sees the exchange without keeping it
    local graph
    do
      local ex = world:exchange { tokens = T, k = K, hidden = H, capacity = C }
      held[1] = ex.handle
      local function step()
        world:allgather_ids(ids, all)
        s:run()
        ex:dispatch { x = x, schedule = s, out = xs, zero_fill = true }
      end
      step()
      graph = moe.graph(step, { device = dev })
    end
    for _ = 1, 3 do collectgarbage() end
    assert.is_not_nil(held[1], "the exchange was collected while a graph of its dispatch lives")
    -- an exchange opened now must get other windows than the captured one's
    local other = world:exchange { tokens = T, k = K, hidden = H, capacity = C }
    other.x[1]:copy(moe.zeros({ T, H }, { dtype = "bf16", device = dev }))
    reroute(ids, 40)
    graph:replay()
    local ref_s = moe.schedule { ids = ids:view(0, { 1, T, K }), experts = E, rank = 0, pad = 2, capacity = C }
    assert.tensor_equal(xs, moe.dispatch { x = x:view(0, { 1, T, H }), schedule = ref_s, zero_fill = true })
    assert.tensor_equal(other.x[1], moe.zeros({ T, H }, { dtype = "bf16", device = dev }))
    graph = nil
    for _ = 1, 3 do collectgarbage() end -- the graph's finaliser, then what it held
    assert.is_nil(held[1], "the exchange outlived its graph")
  end)

  it("one rank of a multi-process launch (ncclCommInitRank, size 1)", function()
    local id = moe.world_unique_id()
    assert.are.equal(256, #id)
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(id, "\n")
    f:close()
    local w1 = moe.world { rank = 0, size = 1, device = 0, id_file = path }
    local kept = io.open(path, "r")
    assert.is_not_nil(kept, "a file rank 0 did not make is left alone")
    kept:close()
    os.remove(path)
    w1:bind()
    local ids = ids_on(dev)
    assert.tensor_equal(w1:allgather_ids(ids):view(0, { T, K }), ids)
    w1:close()
  end)

  it("refuses a MOE_WORLD_TIMEOUT it cannot read, naming it, rather than wait 600 s", function()
    local build = os.getenv("MOE_BUILD_DIR") or "build"
    for _, v in ipairs { "abc", "0", "-5", "inf", "10s" } do
      local cmd = string.format("MOE_WORLD_TIMEOUT='%s' LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' "
        .. "LUA_CPATH='./%s/?.so;;' lua -e 'require(\"moelab\").world { devices = { 0 } }' 2>&1; echo \"status=$?\"",
        v, build)
      local f = assert(io.popen(cmd))
      local out = f:read("a")
      f:close()
      assert.truthy(out:find(string.format('MOE_WORLD_TIMEOUT must be a finite number of seconds > 0, got "%s"', v), 1,
        true), out)
      assert.falsy(out:find("status=0", 1, true), out)
    end
  end)

  it("rank 0 removes the id file it made once the world is open, or has failed to open", function()
    for _, device in ipairs { 0, 4096 } do -- no GPU 4096: the init fails after the file is written
      local path = os.tmpname()
      os.remove(path)
      local ok, w = pcall(moe.world, { rank = 0, size = 1, device = device, id_file = path })
      assert.are.equal(device == 0, ok, tostring(w))
      local left = io.open(path, "r")
      if left then left:close() end
      os.remove(path)
      assert.is_nil(left, "the id file is still there")
      if ok then w:close() end
    end
  end)
end)

-- Several GPUs in this process: the direct exchange against the simulated world on cuda:0.
describe("moe.world of every visible GPU, the direct exchange [#gpu]", function()
  if skip_without("cuda:0") then return end
  local n = moe.core.device_count("cuda")
  if n < 2 then
    pending(string.format("%d GPU visible: the exchange between GPUs needs two or more", n))
    return
  end
  it(string.format("equals the simulated world bit for bit, W = %d", n), function()
    local W, T, K, E, H, C = n, 29, 4, 4 * n, 40, 300
    local devices = {}
    for r = 1, W do devices[r] = r - 1 end
    local world = moe.world { devices = devices }
    local ex = world:exchange { tokens = T, k = K, hidden = H, capacity = C }
    math.randomseed(41)
    local flat = {}
    for i = 1, W * T * K do flat[i] = S.chance(0.1) and -1 or S.int(0, E - 1) end
    local all_cpu = S.tensor(flat, "i32", { W, T, K })
    local x_all = moe.randn({ W, T, H }, { dtype = "bf16", seed = 42, device = "cuda:0" })
    local ids, xs_in, ws, ys_sim, scheds = {}, {}, {}, {}, {}
    for r = 1, W do
      local d = devices[r] and ("cuda:" .. devices[r])
      ids[r] = all_cpu:select(r):to(d)
      ex.x[r]:copy(x_all:select(r))
      ws[r] = moe.randn({ T, K }, { seed = 50 + r, device = d })
    end
    local alls = world:allgather_ids(ids)
    for r = 1, W do
      scheds[r] = moe.schedule { ids = alls[r], experts = E, rank = r - 1, capacity = C }
      ys_sim[r] = moe.randn({ C, H }, { dtype = "bf16", seed = 60 + r, device = "cuda:0" })
      ex.ys[r]:copy(ys_sim[r])
      xs_in[r] = { x = ex.x[r], schedule = scheds[r], zero_fill = true }
    end
    local xs = ex:dispatch(xs_in)
    local cargs = {}
    for r = 1, W do cargs[r] = { schedule = scheds[r], y = ex.ys[r], weights = ws[r] } end
    local outs = ex:combine(cargs)
    local sim_all = all_cpu:to("cuda:0")
    local sim = {}
    for r = 1, W do sim[r] = moe.schedule { ids = sim_all, experts = E, rank = r - 1, capacity = C } end
    for r = 1, W do
      assert.tensor_equal(scheds[r].route_row, sim[r].route_row)
      assert.tensor_equal(xs[r], moe.dispatch { x = x_all, schedule = sim[r], zero_fill = true })
      local ref = moe.combine { schedules = sim, ys = ys_sim, weights = ws[r]:to("cuda:0"), rank = r - 1 }
      assert.tensor_equal(outs[r], ref)
    end
    world:close()
  end)
end)

-- moe.layer over a real world of every visible GPU against the simulated layer on cuda:0 with the
-- same seed: the same routing and schedules bit for bit, outputs within the layer's tolerance
-- (the expert GEMMs see different row counts per launch), both against the dense reference.
describe("moe.layer over a real world [#gpu]", function()
  if skip_without("cuda:0") then return end
  local n = moe.core.device_count("cuda")
  it(string.format("equals the simulated layer, W = %d%s", n, n == 1 and " (one GPU: a world of one rank)" or ""),
    function()
      local devices = {}
      for r = 1, n do devices[r] = r - 1 end
      local world = moe.world { devices = devices }
      local W, T = n, 24
      local opts = { model = "kimi_k2", tokens = T, hidden = 128, ffn = 64, experts = 8 * W, k = 4, seed = 3 }
      opts.world = world
      local real = moe.layer(opts)
      opts.world, opts.device = W, "cuda:0"
      local sim = moe.layer(opts)
      local x = moe.randn({ W, T, 128 }, { dtype = "bf16", seed = 77, device = "cuda:0" })
      for r = 1, W do real.inputs[r]:copy(x:select(r)) end
      local outs = real:forward(n == 1 and real.inputs[1] or real.inputs)
      if n == 1 then outs = { outs } end
      local ref = sim:forward(x)
      for r = 1, W do
        assert.tensor_equal(real.ids[r], sim.ids:select(r))
        assert.tensor_equal(real.schedules[r].route_row, sim.schedules[r].route_row)
        assert.close(outs[r]:to("cpu"), ref:select(r):to("cpu"))
      end
      assert.is_true(real:check(real.inputs, { raise = false }).pass)
      -- the dense reference with the CPU's own routing of each rank's tokens
      local refs = real:reference(n == 1 and real.inputs[1] or real.inputs)
      if n == 1 then refs = { refs } end
      for r = 1, W do assert.close(outs[r]:to("cpu"), refs[r]) end
      local part = real:reference(real.inputs, { sample = 5, routing = "forward" })
      assert.are.same({ 5, 128 }, (n == 1 and part or part[1]).shape)
      local st = real:stats()
      assert.are.equal(W * T * 4, st.routes + st.dropped)
      local ok, err = pcall(real.forward, real, x)
      assert.is_false(ok)
      assert.matches("x", err)

      -- given routing: the simulated layer's ids and weights of each rank give its outputs again
      -- (the first outputs copied out: a forward reuses the layer's own buffers)
      local first = {}
      for r = 1, W do first[r] = outs[r]:to("cpu") end
      for r = 1, W do -- so that the forward below must write them again
        real.out[r]:copy(moe.zeros({ T, 128 }, { dtype = "bf16", device = real.out[r].device }))
      end
      local ids, ws = {}, {}
      for r = 1, W do
        ids[r] = sim.ids:select(r):to("cuda:" .. (r - 1))
        ws[r] = sim.weights:select(r):to("cuda:" .. (r - 1))
      end
      local again = real:forward(n == 1 and real.inputs[1] or real.inputs,
        { ids = n == 1 and ids[1] or ids, weights = n == 1 and ws[1] or ws })
      if n == 1 then again = { again } end
      for r = 1, W do assert.tensor_equal(again[r]:to("cpu"), first[r]) end
      assert.matches("over a world of " .. W .. " GPUs", tostring(real))
      world:close()
    end)

  it(string.format("precision = 'fp8' equals the simulated FP8 layer bit for bit, W = %d", n), function()
    if n < 2 then
      pending("one GPU: the FP8 layer across ranks needs two (the one-rank capture below still runs)")
      return
    end
    local devices = {}
    for r = 1, n do devices[r] = r - 1 end
    local world = moe.world { devices = devices }
    local W, T, H = n, 24, 256
    local opts = { model = "kimi_k2", tokens = T, hidden = H, ffn = 128, shared_ffn = 128, experts = 8 * W, k = 4,
      seed = 3, precision = "fp8" }
    opts.world = world
    local real = moe.layer(opts)
    opts.world, opts.device = W, "cuda:0"
    local sim = moe.layer(opts)
    local x = moe.randn({ W, T, H }, { dtype = "bf16", seed = 81, device = "cuda:0" })
    for r = 1, W do real.inputs[r]:copy(x:select(r)) end
    local outs = real:forward(real.inputs)
    local ref = sim:forward(x)
    for r = 1, W do
      assert.tensor_equal(real.xs[r]:to("cpu"), sim.xs[r]:to("cpu"))
      assert.tensor_equal(real.xs_scale[r]:to("cpu"), sim.xs_scale[r]:to("cpu"))
      assert.tensor_equal(outs[r]:to("cpu"), ref:select(r):to("cpu"))
    end
    assert.is_true(real:check(real.inputs, { raise = false }).pass)
    assert.are.equal("allgather", real:plan()[1].exchange.kernel)
    world:close()
  end)

  it("precision = 'fp8' over a world of one rank captures as a graph and replays what the simulated layer gives",
    function()
      local world = moe.world { devices = { 0 } }
      local opts = { model = "kimi_k2", tokens = 24, hidden = 256, ffn = 128, experts = 8, k = 4, seed = 7,
        precision = "fp8", world = world }
      local layer = moe.layer(opts)
      opts.world, opts.device = 1, "cuda:0"
      local sim = moe.layer(opts)
      local g = layer:capture()
      for seed = 82, 84 do
        local x = moe.randn({ 24, 256 }, { dtype = "bf16", seed = seed, device = "cuda:0" })
        layer.inputs[1]:copy(x)
        g:replay()
        g:check()
        local want = sim:forward(x:view(0, { 1, 24, 256 }))
        assert.tensor_equal(layer.out[1]:to("cpu"), want:select(1):to("cpu"))
      end
      assert.is_true(layer:check(layer.inputs[1], { raise = false }).pass)
      g = nil
      collectgarbage()
      world:close()
    end)

  it("a capture of one rank's pass is not a forward: check waits for the first replay", function()
    local world = moe.world { devices = { 0 } }
    local layer = moe.layer { model = "kimi_k2", tokens = 24, hidden = 128, ffn = 64, experts = 8, k = 4, seed = 5,
      world = world }
    local g = layer:capture()
    layer.inputs[1]:copy(moe.randn({ 24, 128 }, { dtype = "bf16", seed = 78, device = "cuda:0" }))
    local ok, err = pcall(layer.check, layer, layer.inputs[1])
    assert.is_false(ok)
    assert.truthy(tostring(err):find("no forward has completed", 1, true), tostring(err))
    g:replay()
    g:check()
    assert.is_true(layer:check(layer.inputs[1], { raise = false }).pass)
    g = nil
    collectgarbage()
    world:close()
  end)

  it("check leaves out the invalid ids a forward skipped, and refuses after a forward that raised", function()
    local world = moe.world { devices = { 0 } }
    local T, K, E = 24, 4, 8
    local layer = moe.layer { model = "kimi_k2", tokens = T, hidden = 128, ffn = 64, experts = E, k = K, seed = 6,
      world = world, invalid = "skip" }
    layer.inputs[1]:copy(moe.randn({ T, 128 }, { dtype = "bf16", seed = 79, device = "cuda:0" }))
    math.randomseed(12)
    local flat = {}
    for i = 1, T * K do
      flat[i] = S.chance(0.1) and E + S.int(0, 3) or S.chance(0.1) and -S.int(2, 5) or S.int(-1, E - 1)
    end
    layer:forward(layer.inputs[1], { ids = S.tensor(flat, "i32", { T, K }, "cuda:0"),
      weights = moe.randn({ T, K }, { seed = 13, device = "cuda:0" }) })
    assert.is_true(layer:stats().invalid > 0)
    assert.is_true(layer:check(layer.inputs[1], { raise = false }).pass)
    local nan = moe.full({ T, E }, 0 / 0, { device = "cuda:0" })
    assert.is_false(pcall(layer.forward, layer, layer.inputs[1], { logits = nan }))
    local ok, err = pcall(layer.check, layer, layer.inputs[1])
    assert.is_false(ok)
    assert.truthy(tostring(err):find("no forward has completed", 1, true), tostring(err))
    world:close()
  end)

  it("after a forward that did not check, stats() counts NaN rows and check raises what forward would have",
    function()
      local world = moe.world { devices = { 0 } }
      local T, E = 24, 8
      local layer = moe.layer { model = "kimi_k2", tokens = T, hidden = 128, ffn = 64, experts = E, k = 4, seed = 6,
        world = world }
      local x = moe.randn({ T, 128 }, { dtype = "bf16", seed = 80, device = "cuda:0" })
      local flat = moe.randn({ T, E }, { seed = 14 }):flat()
      flat[3 * E + 2], flat[9 * E + 5] = 0 / 0, 0 / 0 -- rows 3 and 9
      layer:forward(x, { logits = S.tensor(flat, "f32", { T, E }, "cuda:0"), check = false })
      assert.are.equal(2, layer:stats().unscored)
      for _, raise in ipairs { true, false } do
        local ok, err = pcall(layer.check, layer, x, { raise = raise })
        assert.is_false(ok)
        assert.truthy(tostring(err):find("in 2 rows of rank 0", 1, true), tostring(err))
      end
      layer:forward(x)
      assert.are.equal(0, layer:stats().unscored)
      assert.is_true(layer:check(x, { raise = false }).pass)
      world:close()
    end)
end)
