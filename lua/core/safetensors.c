/* SPDX-License-Identifier: MIT */
/*
 * safetensors.c -- moelab.SafeTensors: a safetensors file open for reading (lib/safetensors.c).
 * core.safetensors(path) opens it; f:names(), f:info(name), f:read(name, dst [, scale]),
 * f:path() and f:close(), which __gc and __close also do.
 */
#include <stdint.h>

#include "lcore.h"

typedef struct File {
  moe_safetensors *f; /* NULL once closed */
} File;

static moe_safetensors *check_file(lua_State *L, int idx) {
  File *u = (File *)luaL_checkudata(L, idx, SAFETENSORS);
  if (!u->f) luaL_argerror(L, idx, "moelab.SafeTensors is closed");
  return u->f;
}

/* A closed handle first, then the file: if opening fails, the collector finds nothing to close. */
static int l_safetensors(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  const char *path = luaL_checkstring(L, 1);
  File *u = (File *)lua_newuserdatauv(L, sizeof *u, 0);
  u->f = NULL;
  luaL_setmetatable(L, SAFETENSORS);
  int rc = moe_safetensors_open(ctx, path, &u->f);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

/* __gc, __close and close(): closes once, never raises. */
static int f_release(lua_State *L) {
  File *u = (File *)luaL_testudata(L, 1, SAFETENSORS);
  if (u && u->f) {
    moe_safetensors_close(u->f);
    u->f = NULL;
  }
  return 0;
}

static int f_tostring(lua_State *L) {
  File *u = (File *)luaL_checkudata(L, 1, SAFETENSORS);
  if (!u->f) lua_pushliteral(L, "moelab.SafeTensors(closed)");
  else lua_pushfstring(L, "moelab.SafeTensors('%s', %d tensors)", moe_safetensors_path(u->f),
                       moe_safetensors_count(u->f));
  return 1;
}

static int f_path(lua_State *L) {
  lua_pushstring(L, moe_safetensors_path(check_file(L, 1)));
  return 1;
}

/* names() -> the tensors' names, sorted. */
static int f_names(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_safetensors *f = check_file(L, 1);
  const int n = moe_safetensors_count(f);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    moe_safetensors_info in;
    int rc = moe_safetensors_tensor(ctx, f, i, &in);
    if (rc) return lc_fail(L, ctx, rc);
    lua_pushstring(L, in.name);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* info(name) -> {dtype =, shape = {...}, offset =, nbytes =}, or nil when the file has no such tensor. */
static int f_info(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_safetensors *f = check_file(L, 1);
  const int i = moe_safetensors_find(f, luaL_checkstring(L, 2));
  if (i < 0) {
    lua_pushnil(L);
    return 1;
  }
  moe_safetensors_info in;
  int rc = moe_safetensors_tensor(ctx, f, i, &in);
  if (rc) return lc_fail(L, ctx, rc);
  lua_createtable(L, 0, 4);
  lua_pushstring(L, in.dtype);
  lua_setfield(L, -2, "dtype");
  lua_createtable(L, in.ndim, 0);
  for (int d = 0; d < in.ndim; d++) {
    lua_pushinteger(L, (lua_Integer)in.shape[d]);
    lua_rawseti(L, -2, d + 1);
  }
  lua_setfield(L, -2, "shape");
  lua_pushinteger(L, (lua_Integer)in.offset);
  lua_setfield(L, -2, "offset");
  lua_pushinteger(L, (lua_Integer)in.nbytes);
  lua_setfield(L, -2, "nbytes");
  return 1;
}

/* read(name, dst [, scale]) -> dst, tensor name read into it (moe_safetensors_read). */
static int f_read(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_safetensors *f = check_file(L, 1);
  const char *name = luaL_checkstring(L, 2);
  moe_tensor *dst = lc_check_tensor(L, 3);
  const moe_tensor *scale = lua_isnoneornil(L, 4) ? NULL : lc_check_tensor(L, 4);
  int rc = moe_safetensors_read(ctx, f, name, scale, dst);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 3);
  return 1;
}

static const luaL_Reg meta[] = {
  {"__gc", f_release},
  {"__close", f_release},
  {"__tostring", f_tostring},
  {NULL, NULL}
};

static const luaL_Reg methods[] = {
  {"names", f_names},
  {"info", f_info},
  {"read", f_read},
  {"path", f_path},
  {"close", f_release},
  {NULL, NULL}
};

static const luaL_Reg funcs[] = {
  {"safetensors", l_safetensors},
  {NULL, NULL}
};

void lc_open_safetensors(lua_State *L, int ctxi, int mod) {
  lc_new_class(L, SAFETENSORS, meta, 0, methods, ctxi);
  lc_add_funcs(L, funcs, ctxi, mod);
}
