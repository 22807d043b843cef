/* SPDX-License-Identifier: MIT */
/*
 * module.c -- the Lua module moelab.core: a thin binding of lib/moelab.h.
 *
 * The pure-Lua front-end (lua/moelab/init.lua) validates options, allocates outputs and
 * composes layers; this module only moves values between Lua and the C API.  It includes the
 * public header alone.  Its parts share lcore.h; this one holds the helpers they all use and
 * opens the module.
 *
 * One moe_ctx per Lua state, owned by a "moelab.Context" userdata that every function holds
 * as its first upvalue: no C globals.  Tensors are "moelab.Tensor" userdata holding a
 * moe_tensor pointer.  A view's user value is the handle that owns its memory, so that the
 * memory outlives every view however the collector orders the finalizers.
 *
 * Errors: a failing moe_* call raises its context message as is (it names the stage).  Lua
 * arguments are all extracted before the library is called, and C-side scratch memory is Lua
 * userdata, so an error can longjmp out of any frame here without leaking.
 */
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "lcore.h"

/* ---- helpers ---- */

moe_ctx *lc_getctx(lua_State *L) {
  Context *c = (Context *)lua_touserdata(L, lua_upvalueindex(1));
  if (!c || !c->ctx) luaL_error(L, "moelab.core: the context is closed");
  return c->ctx;
}

/* Whether a frame runs a file of the Lua front-end: a "moelab" directory right above the file. */
static int frontend_frame(const lua_Debug *ar) {
  const char *s = ar->source, *slash = s && s[0] == '@' ? strrchr(s, '/') : NULL;
  if (!slash || slash - s < 7 || strncmp(slash - 6, "moelab", 6) != 0) return 0;
  return slash - s == 7 || slash[-7] == '/';
}

/* Pushes "file:line: " of the code that called into moelab: the first frame outside the binding
 * and the front-end, so that an error names the user's line, not the library's.  Where a C
 * function (a pcall) stands between, nothing: whoever catches the error places it. */
static void push_caller_where(lua_State *L) {
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar) && lua_getinfo(L, "Sl", &ar); level++) {
    if (frontend_frame(&ar)) continue;
    if (ar.currentline > 0) {
      lua_pushfstring(L, "%s:%d: ", ar.short_src, ar.currentline);
      return;
    }
    break;
  }
  lua_pushliteral(L, "");
}

/* raise(msg): msg raised where the binding raises its own errors (push_caller_where); the
 * front-end's args.raise, so that one rule places every error. */
static int l_raise(lua_State *L) {
  luaL_checkstring(L, 1);
  push_caller_where(L);
  lua_pushvalue(L, 1);
  lua_concat(L, 2);
  return lua_error(L);
}

int lc_fail(lua_State *L, moe_ctx *ctx, int rc) {
  const char *msg = moe_errmsg(ctx);
  push_caller_where(L);
  lua_pushstring(L, (msg && *msg) ? msg : moe_errstr(rc));
  lua_concat(L, 2);
  return lua_error(L);
}

/* A stage's failure: its argument errors (MOE_ERR_ARG, "<stage>: <what is wrong>") read as the
 * front-end's own, "bad argument #1 to 'fname' (<what is wrong>)" at the caller's line, since the
 * stage's fields are the options the user wrote; any other failure as lc_fail. */
int lc_stage_fail(lua_State *L, moe_ctx *ctx, int rc, const char *fname, const char *stage) {
  const char *msg = moe_errmsg(ctx);
  const size_t n = strlen(stage);
  if (rc != MOE_ERR_ARG || !msg || strncmp(msg, stage, n) != 0 || strncmp(msg + n, ": ", 2) != 0)
    return lc_fail(L, ctx, rc);
  return lc_arg_error(L, fname, 1, "%s", msg + n + 2);
}

/* As lc_stage_fail, for any code, the stage's words after what (the argument they are about). */
int lc_stage_fail_as(lua_State *L, moe_ctx *ctx, int rc, const char *fname, const char *stage, const char *what) {
  const char *msg = moe_errmsg(ctx);
  const size_t n = strlen(stage);
  if (!msg || strncmp(msg, stage, n) != 0 || strncmp(msg + n, ": ", 2) != 0) return lc_fail(L, ctx, rc);
  return lc_arg_error(L, fname, 1, "%s%s", what, msg + n + 2);
}

/* "bad argument #arg to 'fname' (...)" under a fixed name: the user-facing names of the
 * front-end, which survive the front-end's tail calls (luaL_argerror would then print '?' or
 * 'moelab.core.x'). */
int lc_arg_error(lua_State *L, const char *fname, int arg, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const char *msg = lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  push_caller_where(L);
  lua_pushfstring(L, "bad argument #%d to '%s' (%s)", arg, fname, msg);
  lua_concat(L, 2);
  return lua_error(L);
}

/* The userdata of type tname at index 1, the self of method `method` of a `var` ("t"): called
 * with '.' where ':' was meant, the first argument is something else, and the message says so. */
void *lc_check_self(lua_State *L, const char *tname, const char *var, const char *method) {
  void *p = luaL_testudata(L, 1, tname);
  if (!p)
    lc_arg_error(L, method, 1, "expected a %s as self, got %s: call it as %s:%s(...), with a colon", tname,
                 lua_isnone(L, 1) ? "no value" : lc_got_value(L, 1), var, method);
  return p;
}

/* The type of a value as luaL_typeerror names it (__name for userdata that have one). */
const char *lc_type_name(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (luaL_getmetafield(L, idx, "__name") == LUA_TSTRING) return lua_tostring(L, -1);
  if (lua_type(L, idx) == LUA_TLIGHTUSERDATA) return "light userdata";
  return luaL_typename(L, idx);
}

/* A number as its value, anything else as its type: "1.5", "string". */
const char *lc_got_value(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_type(L, idx) != LUA_TNUMBER) return lc_type_name(L, idx);
  if (lua_isinteger(L, idx)) return lua_pushfstring(L, "%I", (LUAI_UACINT)lua_tointeger(L, idx));
  return lua_pushfstring(L, "%f", (LUAI_UACNUMBER)lua_tonumber(L, idx));
}

/* "is a string", "is nil", and for a number "is 1.5" or "is a number". */
const char *lc_is_what(lua_State *L, int idx, int value) {
  idx = lua_absindex(L, idx);
  switch (lua_type(L, idx)) {
  case LUA_TNIL: return "is nil";
  case LUA_TNUMBER: return value ? lua_pushfstring(L, "is %s", lc_got_value(L, idx)) : "is a number";
  default: return lua_pushfstring(L, "is a %s", lc_type_name(L, idx));
  }
}

moe_device lc_check_device(lua_State *L, int idx) {
  moe_device d = {MOE_CPU, 0};
  if (lua_type(L, idx) != LUA_TSTRING)
    luaL_argerror(L, idx, lua_pushfstring(L, "expected 'cpu' or 'cuda:N', got %s", lc_type_name(L, idx)));
  const char *s = lua_tostring(L, idx);
  if (strcmp(s, "cpu") == 0) return d;
  d.kind = MOE_CUDA;
  if (strcmp(s, "cuda") == 0) return d;
  if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9') {
    long n = 0;
    const char *p = s + 5;
    while (*p >= '0' && *p <= '9' && n <= 1000000) n = n * 10 + (*p++ - '0');
    if (*p == '\0' && n <= 1000000) {
      d.index = (int)n;
      return d;
    }
  }
  luaL_argerror(L, idx, lua_pushfstring(L, "expected 'cpu' or 'cuda:N', got '%s'", s));
  return d;
}

moe_device lc_opt_device(lua_State *L, int idx) {
  if (lua_isnoneornil(L, idx)) {
    moe_device cpu = {MOE_CPU, 0};
    return cpu;
  }
  return lc_check_device(L, idx);
}

void lc_push_device(lua_State *L, moe_device d) {
  if (d.kind == MOE_CPU) lua_pushliteral(L, "cpu");
  else lua_pushfstring(L, "cuda:%d", d.index);
}

moe_dtype lc_check_dtype(lua_State *L, int idx) {
  static const char *const names[] = {"f32", "bf16", "i32", "e4m3", NULL};
  static const moe_dtype dtypes[] = {MOE_F32, MOE_BF16, MOE_I32, MOE_E4M3};
  return dtypes[luaL_checkoption(L, idx, NULL, names)];
}

/* An address another library handed out: a light userdata, or an integer >= 0 (what ctypes,
 * LuaJIT's FFI and to_dlpack give).  what names it in the error. */
void *lc_check_address(lua_State *L, int idx, const char *fname, const char *what) {
  if (lua_type(L, idx) == LUA_TLIGHTUSERDATA) return lua_touserdata(L, idx);
  int isint = 0;
  lua_Integer v = lua_type(L, idx) == LUA_TNUMBER ? lua_tointegerx(L, idx, &isint) : 0;
  if (!isint || v < 0)
    lc_arg_error(L, fname, 1, "%s must be an integer >= 0 or a light userdata, got %s", what, lc_got_value(L, idx));
  return (void *)(uintptr_t)v;
}

/* A shape: a table of 0..MOE_MAX_DIMS non-negative integers. */
int lc_check_shape(lua_State *L, int idx, int64_t shape[MOE_MAX_DIMS]) {
  idx = lua_absindex(L, idx);
  if (lua_type(L, idx) != LUA_TTABLE)
    luaL_argerror(L, idx, lua_pushfstring(L, "expected a shape (a table of integers), got %s", lc_type_name(L, idx)));
  lua_Integer n = (lua_Integer)lua_rawlen(L, idx);
  if (n > MOE_MAX_DIMS)
    luaL_argerror(L, idx, lua_pushfstring(L, "shape has %I dimensions, at most %d", (LUAI_UACINT)n, MOE_MAX_DIMS));
  for (int i = 0; i < (int)n; i++) {
    lua_rawgeti(L, idx, i + 1);
    int isint = 0;
    lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
    if (!isint || v < 0)
      luaL_argerror(L, idx,
                    lua_pushfstring(L, "shape[%d] %s, expected a non-negative integer", i + 1, lc_is_what(L, -1, 1)));
    shape[i] = (int64_t)v;
    lua_pop(L, 1);
  }
  return (int)n;
}

/* ---- the module ---- */

static int ctx_gc(lua_State *L) {
  Context *c = (Context *)luaL_testudata(L, 1, CONTEXT);
  if (c && c->ctx) {
    moe_ctx_close(c->ctx);
    c->ctx = NULL;
  }
  return 0;
}

/* Sets funcs into the module table at mod, each with the context's handle at ctxi as its upvalue. */
void lc_add_funcs(lua_State *L, const luaL_Reg *funcs, int ctxi, int mod) {
  lua_pushvalue(L, mod);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, funcs, 1);
  lua_pop(L, 1);
}

/* A metatable whose __index is a table of methods sharing the context upvalue at ctxi; its
 * metamethods share it too where meta_ctx is set (a finalizer that needs the context). */
void lc_new_class(lua_State *L, const char *tname, const luaL_Reg *meta, int meta_ctx, const luaL_Reg *methods,
                  int ctxi) {
  luaL_newmetatable(L, tname);
  if (meta_ctx) lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, meta, meta_ctx ? 1 : 0);
  lua_newtable(L);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, methods, 1);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
}

static const luaL_Reg module_funcs[] = {
  {"raise", l_raise},
  {NULL, NULL}
};

MOE_API int luaopen_moelab_core(lua_State *L) {
  if (moe_libversion_number() != MOE_VERSION_NUMBER)
    return luaL_error(L, "moelab.core: built for moelab %s (%d) but linked with moelab %s (%d)", MOE_VERSION,
                      MOE_VERSION_NUMBER, moe_libversion(), moe_libversion_number());

  /* the context's handle first, closed, so that a failed open leaves nothing behind */
  Context *c = (Context *)lua_newuserdatauv(L, sizeof *c, 0);
  c->ctx = NULL;
  luaL_newmetatable(L, CONTEXT);
  lua_pushcfunction(L, ctx_gc);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  int rc = moe_ctx_open(&c->ctx);
  /* a context that failed to open may still hold the reason (MOE_THREADS); its handle closes it */
  if (rc) return luaL_error(L, "moelab.core: cannot open a context: %s", c->ctx ? moe_errmsg(c->ctx) : moe_errstr(rc));
  int ctxi = lua_gettop(L);

  lua_newtable(L);
  int mod = lua_gettop(L);
  lc_add_funcs(L, module_funcs, ctxi, mod);
  lua_pushstring(L, moe_libversion());
  lua_setfield(L, mod, "version");
  lua_pushinteger(L, moe_libversion_number());
  lua_setfield(L, mod, "version_number");
  /* each part (re)sets its metatables' fields even when they exist, so a reloaded module uses its own ctx */
  lc_open_tensor(L, ctxi, mod);
  lc_open_tensorlib(L, ctxi, mod);
  lc_open_stage(L, ctxi, mod);
  lc_open_event_graph(L, ctxi, mod);
  lc_open_world(L, ctxi, mod);
  lc_open_exchange(L, ctxi, mod);
  lc_open_safetensors(L, ctxi, mod);
  return 1;
}
