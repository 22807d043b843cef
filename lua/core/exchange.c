/* SPDX-License-Identifier: MIT */
/*
 * exchange.c -- the direct exchange: moelab.Exchange, made by world:exchange(...).
 *
 * Its user value is the World (kept alive, and checked open before each call).  Its windows'
 * x and ys are plain tensor handles whose memory is the exchange's: a weak-keyed table in the
 * registry maps each of them to the exchange, so the exchange outlives every handle of its
 * memory (and every view of those, which keep their owner), and a graph that captured one of
 * its calls holds it too (lc_pin_object).  The windows go with the exchange at collection; the
 * world's own close waits for them (moe_world_close).
 */
#include <stdint.h>

#include "lcore.h"

typedef struct Exchange {
  moe_world_exchange *ex;
} Exchange;

static const char *const window_owner_key = "moelab.window_owner";

/* The exchange at idx, its world open; *local gets the world's local rank count. */
static moe_world_exchange *check_exchange(lua_State *L, int idx, int *local) {
  Exchange *u = (Exchange *)luaL_checkudata(L, idx, EXCHANGE);
  lua_getiuservalue(L, idx, 1);
  World *wu = (World *)luaL_testudata(L, -1, WORLD);
  if (!wu || !wu->w) luaL_error(L, "moelab.Exchange: its world is closed");
  *local = moe_world_local_count(wu->w);
  lua_pop(L, 1);
  return u->ex;
}

static int x_release(lua_State *L) {
  Exchange *u = (Exchange *)luaL_testudata(L, 1, EXCHANGE);
  if (!u || !u->ex) return 0;
  moe_world_exchange_close(u->ex);
  u->ex = NULL;
  return 0;
}

/* world:exchange(tokens, k, hidden, capacity) -> Exchange, {x per local rank}, {ys per local rank} */
int lc_world_exchange(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  lua_Integer T = luaL_checkinteger(L, 2), K = luaL_checkinteger(L, 3), H = luaL_checkinteger(L, 4),
              C = luaL_checkinteger(L, 5);
  if (K < 1 || K > INT32_MAX)
    return lc_arg_error(L, "exchange", 2, "k must be in [1, %d], got %I", INT32_MAX, (LUAI_UACINT)K);
  Exchange *u = (Exchange *)lua_newuserdatauv(L, sizeof *u, 1);
  u->ex = NULL;
  luaL_setmetatable(L, EXCHANGE);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  int xi = lua_gettop(L);
  int rc = moe_world_exchange_open(ctx, w, (int64_t)T, (int)K, (int64_t)H, (int64_t)C, &u->ex);
  if (rc) return lc_fail(L, ctx, rc);
  int n = moe_world_local_count(w);
  lua_getfield(L, LUA_REGISTRYINDEX, window_owner_key);
  int owners = lua_gettop(L);
  lua_createtable(L, n, 0);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    moe_tensor *views[2] = {NULL, NULL};
    rc = moe_world_exchange_views(ctx, u->ex, i, &views[0], &views[1]);
    if (rc) return lc_fail(L, ctx, rc);
    for (int j = 0; j < 2; j++) {
      Tensor *t = lc_new_handle(L, 1);
      t->t = views[j];
      lua_pushvalue(L, -1);
      lua_pushvalue(L, xi);
      lua_rawset(L, owners); /* owners[handle] = exchange */
      lua_rawseti(L, owners + 1 + j, i + 1);
    }
  }
  lua_remove(L, owners);
  return 3;
}

static int x_dispatch(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  int n;
  moe_world_exchange *ex = check_exchange(L, 1, &n);
  lc_pin_object(L, 1); /* a graph of this call writes into the windows, whatever x and out are */
  lua_settop(L, 2);
  moe_world_dispatch_args *a = lc_world_dispatch_args(L, n, 1);
  lc_args_still_open(L, "dispatch", 3);
  int rc = moe_world_exchange_dispatch(ctx, ex, a);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

static int x_combine(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  int n;
  moe_world_exchange *ex = check_exchange(L, 1, &n);
  lc_pin_object(L, 1); /* a graph of this call reads the peers' windows, whatever y is */
  lua_settop(L, 2);
  moe_world_combine_args *a = lc_world_combine_args(L, n, 1);
  lc_args_still_open(L, "combine", 3);
  int rc = moe_world_exchange_combine(ctx, ex, a);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

static const luaL_Reg exchange_meta[] = {
  {"__gc", x_release},
  {NULL, NULL}
};

static const luaL_Reg exchange_methods[] = {
  {"dispatch", x_dispatch},
  {"combine", x_combine},
  {NULL, NULL}
};

void lc_open_exchange(lua_State *L, int ctxi, int mod) {
  (void)mod; /* made by world:exchange, no module function */
  lc_new_class(L, EXCHANGE, exchange_meta, 1, exchange_methods, ctxi);
  lua_newtable(L); /* window tensor handle -> its exchange, weak keys (an ephemeron table) */
  lua_newtable(L);
  lua_pushliteral(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, window_owner_key);
}
