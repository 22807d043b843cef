-- SPDX-License-Identifier: MIT
-- moelab from a host project's build: the build (MOE_BUILD_DIR, default build) installed into a
-- temporary prefix, then spec/package/consumer.c built against that prefix through
-- find_package(moelab) and through pkg-config, with the shared and with the static library, and
-- each also with a function named like one of moelab's internal ones, which the host must keep
-- while moelab keeps its own.  One install and one CMake project serve the whole file.
local build = os.getenv("MOE_BUILD_DIR") or "build"
local support = require "support"

local q, sh = support.shell_quote, support.shell

-- The pattern of the line a consumer prints when all held, with the suffix of a clash build.
local function expected_line(clash)
  return "consumer: moelab " .. moe.version .. ", experts over own buffers equal moelab's tensors: 40 values, %d+ "
    .. "written" .. (clash and "; own moeI_experts_cpu kept" or "") .. "\n$"
end

describe("the installed package [#cpu]", function()
  local tmp, prefix, libdir, pcdir

  lazy_setup(function()
    local ok, out = sh("mktemp -d")
    assert(ok, out)
    tmp = out:gsub("%s+$", "")
    prefix = tmp .. "/prefix"
    ok, out = sh("cmake --install " .. q(build) .. " --prefix " .. q(prefix))
    assert(ok, "cmake --install " .. build .. " failed:\n" .. out)
    ok, out = sh("find " .. q(prefix) .. " -name moelab.pc")
    pcdir = out:match("^(%S+)/moelab%.pc\n")
    libdir = pcdir and pcdir:match("^(.*)/pkgconfig$")
  end)

  lazy_teardown(function()
    if tmp then sh("rm -rf " .. q(tmp)) end
  end)

  -- Runs program (a path), with the installed libraries first on the loader's path: a shared
  -- build must load the installed libmoelab.so.0 and a static one none at all.
  local function check_program(program, shared, clash)
    local env = "LD_LIBRARY_PATH=" .. q(libdir) .. " "
    local ok, deps = sh(env .. "ldd " .. q(program))
    assert(ok, "ldd " .. program .. ":\n" .. deps)
    local loaded = deps:match("libmoelab%.so%.0 => (%S+)")
    if shared then
      assert.are.equal(libdir .. "/libmoelab.so.0", loaded, "the library loaded:\n" .. deps)
    else
      assert.is_nil(deps:find("libmoelab", 1, true), "a static build loads libmoelab:\n" .. deps)
    end
    local out
    ok, out = sh(env .. support.preloaded(q(program)))
    assert(ok, program .. " failed:\n" .. out)
    assert.truthy(out:find("^" .. expected_line(clash)), program .. " printed:\n" .. out)
  end

  it("installs moelab.h, both libraries, the CMake package and moelab.pc", function()
    assert.truthy(libdir, "no moelab.pc under " .. prefix)
    for _, path in ipairs({ prefix .. "/include/moelab.h", libdir .. "/libmoelab.so.0", libdir .. "/libmoelab.so",
      libdir .. "/libmoelab.a", libdir .. "/cmake/moelab/moelabConfig.cmake",
      libdir .. "/cmake/moelab/moelabConfigVersion.cmake" }) do
      assert.is_true(sh("test -e " .. q(path)), path .. " is not installed")
    end
  end)

  it("the static library defines moe_* functions alone; its internal names are local", function()
    local ok, out = sh("nm " .. q(libdir .. "/libmoelab.a"))
    assert(ok, out)
    local global, internal = {}, nil
    for kind, name in out:gmatch("%x* ?(%a) ([%w_.$@]+)\n") do
      local is_global = (kind:match("%u") or kind == "u") and kind ~= "U" -- u: GNU unique
      if is_global and not name:match("^moe_") then global[#global + 1] = name end
      if name == "moeI_experts_cpu" then internal = kind end
    end
    assert.are.same({}, global)
    -- consumer.c's clash needs moelab to have a function of that name
    assert.are.equal("t", internal, "moeI_experts_cpu is not a local function of libmoelab.a")
  end)

  -- spec/package/host: a C-only project that adds this tree with add_subdirectory, where no Lua
  -- headers are found (CMAKE_IGNORE_PATH hides them), CPU-only.  Its build is listed, not run:
  -- the package above links the same targets.
  describe("as a subproject", function()
    local function configure(dir, extra)
      return sh("cmake -S spec/package/host -B " .. q(dir) .. " -G Ninja -DCMAKE_BUILD_TYPE=Release"
        .. " -DMOELAB_SOURCE_DIR=\"$(pwd)\" -DMOE_WITH_CUDA=OFF"
        .. " -DCMAKE_IGNORE_PATH=/usr/include/lua5.4 " .. (extra or ""))
    end

    it("builds the C library alone for a program linking moelab::moelab_static", function()
      local dir = tmp .. "/host"
      local ok, out = configure(dir)
      assert(ok, "configuring the host failed:\n" .. out)
      ok, out = sh("ninja -C " .. q(dir) .. " -t commands") -- what the build would run
      assert(ok, out)
      assert.truthy(out:find("-o consumer ", 1, true), out)
      assert.truthy(out:find(" moelab/libmoelab.a ", 1, true), out)
      for _, absent in ipairs({ "core.so", "tests/", "libmoelab_internal.a" }) do
        assert.falsy(out:find(absent, 1, true), absent .. " would be built for a host:\n" .. out)
      end
    end)

    it("asks for the Lua headers only with MOE_BUILD_LUA=ON", function()
      local ok, out = configure(tmp .. "/host_lua", "-DMOE_BUILD_LUA=ON")
      assert.is_false(ok, "configured without Lua headers:\n" .. out)
      assert.truthy(out:find("Lua 5.4 headers not found", 1, true), out)
    end)
  end)

  describe("through find_package(moelab)", function()
    local dir, configured, log

    -- one configure and one build (that goes on past a failed link) for the four programs
    lazy_setup(function()
      dir = tmp .. "/cmake"
      configured, log = sh("cmake -S spec/package -B " .. q(dir) .. " -G Ninja -DCMAKE_BUILD_TYPE=Release"
        .. " -DCMAKE_PREFIX_PATH=" .. q(prefix))
      if configured then log = select(2, sh("cmake --build " .. q(dir) .. " -- -k 0")) end
    end)

    for _, kind in ipairs({ "shared", "static" }) do
      for _, program in ipairs({ "consumer", "clash" }) do
        it(string.format("%s_%s: moelab::moelab%s", program, kind, kind == "static" and "_static" or ""), function()
          local exe = dir .. "/" .. program .. "_" .. kind
          assert(configured, "the consumer project did not configure:\n" .. log)
          assert(sh("test -x " .. q(exe)), exe .. " was not built:\n" .. log)
          check_program(exe, kind == "shared", program == "clash")
        end)
      end
    end
  end)

  describe("through pkg-config", function()
    -- the linker takes libmoelab.a where -Wl,-Bstatic comes first (cmake/moelab.pc.in)
    local LINK = {
      shared = "$(pkg-config --cflags --libs moelab)",
      static = "$(pkg-config --cflags moelab) -Wl,-Bstatic $(pkg-config --static --libs moelab)",
    }
    for _, kind in ipairs({ "shared", "static" }) do
      for _, program in ipairs({ "consumer", "clash" }) do
        it(string.format("%s, %s: %s", program, kind, LINK[kind]), function()
          local exe = tmp .. "/pc_" .. program .. "_" .. kind
          local ok, out = sh("export PKG_CONFIG_PATH=" .. q(pcdir) .. "; cc spec/package/consumer.c -o " .. q(exe)
            .. (program == "clash" and " -DMOE_CONSUMER_CLASH " or " ") .. LINK[kind])
          assert(ok, "the link failed:\n" .. out)
          check_program(exe, kind == "shared", program == "clash")
        end)
      end
    end
  end)
end)
