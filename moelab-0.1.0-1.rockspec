-- SPDX-License-Identifier: MIT
-- LuaRocks: `luarocks --lua-version 5.4 make` in the repository root builds moelab with CMake and
-- installs the module moelab.core and the front-end (lua/moelab) into the rock tree; the C
-- library's own files (libmoelab, moelab.h, the package files) stay out of the rock.  The build
-- has the CUDA kernels when nvcc is found, as `cmake` alone does.
rockspec_format = "3.0"
package = "moelab"
version = "0.1.0-1"
-- No archive is published: the rock is made from a checkout of the repository.
source = {
  url = "git+file://.",
}
description = {
  summary = "Mixture-of-Experts layer kernels for Hopper, with an exact CPU reference, driven from Lua",
  detailed = [[
Routing, a routed-token scheduler, dispatch, grouped expert compute and combine, as an embeddable
C library with CUDA kernels for Hopper and a CPU backend that defines every result exactly; the
Lua front-end composes them into an MoE layer, checks it against a dense reference and times it.
]],
  license = "MIT",
}
dependencies = {
  "lua >= 5.4, < 5.5",
}
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "Release",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    LUA_INCLUDE_DIR = "$(LUA_INCDIR)",
    MOE_LUA_CDIR = "$(LIBDIR)",
    MOE_LUA_LDIR = "$(LUADIR)",
    MOE_BUILD_TESTS = "OFF",
    MOE_BENCH = "OFF",
    MOE_INSTALL_LIBRARY = "OFF",
  },
}
