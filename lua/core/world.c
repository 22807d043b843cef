/* SPDX-License-Identifier: MIT */
/*
 * world.c -- expert parallelism across GPUs: moelab.World.
 *
 * A "moelab.World" userdata holds a moe_world.  Functions of each local rank take a table with
 * one entry per local rank (in moe_world_local_rank order); field errors name the entry.
 */
#include <stdint.h>
#include <string.h>

#include "lcore.h"

moe_world *lc_check_world(lua_State *L, int idx) {
  World *u = (World *)luaL_checkudata(L, idx, WORLD);
  if (!u->w) luaL_argerror(L, idx, "moelab.World is closed");
  return u->w;
}

/* The field of the table at tbl as a tensor (left on the stack); entry is 1-based, 0 = none. */
static moe_tensor *w_tensor(lua_State *L, const char *fname, int tbl, int entry, const char *field, int optional) {
  int ty = lua_getfield(L, tbl, field);
  if (ty == LUA_TNIL && optional) return NULL;
  Tensor *u = lc_test_tensor(L, -1);
  if (!u) {
    if (entry)
      lc_arg_error(L, fname, 1, "entry %d, field '%s': expected an open moelab.Tensor, got %s", entry, field,
                   lc_type_name(L, -1));
    lc_arg_error(L, fname, 1, "field '%s': expected an open moelab.Tensor, got %s", field, lc_type_name(L, -1));
  }
  return u->t;
}

static int w_int(lua_State *L, const char *fname, int tbl, int entry, const char *field, int optional, int dflt) {
  int ty = lua_getfield(L, tbl, field);
  if (ty == LUA_TNIL && optional) {
    lua_pop(L, 1);
    return dflt;
  }
  int isint = 0;
  lua_Integer v = ty == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
  if (!isint || v < INT32_MIN || v > INT32_MAX) {
    if (entry)
      lc_arg_error(L, fname, 1, "entry %d, field '%s': expected an integer, got %s", entry, field, lc_got_value(L, -1));
    lc_arg_error(L, fname, 1, "field '%s': expected an integer, got %s", field, lc_got_value(L, -1));
  }
  lua_pop(L, 1);
  return (int)v;
}

/* The table at idx has exactly n entries, each a table; returns n. */
static void w_entries(lua_State *L, const char *fname, int idx, int n, const char *what) {
  if (lua_type(L, idx) != LUA_TTABLE)
    lc_arg_error(L, fname, 1, "expected a table of %d %s (one per local rank), got %s", n, what, lc_type_name(L, idx));
  lua_Integer got = (lua_Integer)lua_rawlen(L, idx);
  if (got != n) lc_arg_error(L, fname, 1, "expected %d %s (one per local rank), got %I", n, what, (LUAI_UACINT)got);
  for (int i = 1; i <= n; i++) {
    if (lua_rawgeti(L, idx, i) != LUA_TTABLE)
      lc_arg_error(L, fname, 1, "entry %d: expected a table, got %s", i, lc_type_name(L, -1));
    lua_pop(L, 1);
  }
}

static void *scratch(lua_State *L, size_t n) { return lua_newuserdatauv(L, n ? n : 1, 0); }

/* core.world_unique_id() -> hex */
static int l_world_unique_id(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  char hex[MOE_WORLD_ID_HEX + 1];
  int rc = moe_world_unique_id(ctx, hex, sizeof hex);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushstring(L, hex);
  return 1;
}

static World *new_world(lua_State *L) {
  World *u = (World *)lua_newuserdatauv(L, sizeof *u, 0);
  u->w = NULL;
  luaL_setmetatable(L, WORLD);
  return u;
}

/* core.world_open_local({device, ...}) -> World */
static int l_world_open_local(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n < 1) return lc_arg_error(L, "world", 1, "option 'devices' must list at least one GPU");
  int *devs = (int *)scratch(L, (size_t)n * sizeof *devs);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    if (!isint || v < 0 || v > INT32_MAX)
      return lc_arg_error(L, "world", 1, "devices[%d] must be a GPU index >= 0, got %s", i + 1, lc_got_value(L, -1));
    devs[i] = (int)v;
    lua_pop(L, 1);
  }
  World *u = new_world(L);
  int rc = moe_world_open_local(ctx, n, devs, &u->w);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

/* core.world_open_rank(rank, size, device, hex) -> World */
static int l_world_open_rank(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  lua_Integer rank = luaL_checkinteger(L, 1), size = luaL_checkinteger(L, 2), dev = luaL_checkinteger(L, 3);
  const char *hex = luaL_checkstring(L, 4);
  if (rank < INT32_MIN || rank > INT32_MAX || size < INT32_MIN || size > INT32_MAX || dev < INT32_MIN ||
      dev > INT32_MAX)
    return lc_arg_error(L, "world", 1, "rank, size and device must fit a C int");
  World *u = new_world(L);
  int rc = moe_world_open_rank(ctx, (int)rank, (int)size, (int)dev, hex, &u->w);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

/* core.world_open_comm(comm, device) -> World, over the caller's ncclComm_t at address comm */
static int l_world_open_comm(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  void *comm = lc_check_address(L, 1, "world", "option 'comm'");
  lua_Integer dev = luaL_checkinteger(L, 2);
  if (dev < INT32_MIN || dev > INT32_MAX) return lc_arg_error(L, "world", 1, "device must fit a C int");
  World *u = new_world(L);
  int rc = moe_world_open_comm(ctx, comm, (int)dev, &u->w);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

static int w_release(lua_State *L) {
  World *u = (World *)luaL_testudata(L, 1, WORLD);
  if (!u || !u->w) return 0;
  Context *c = (Context *)lua_touserdata(L, lua_upvalueindex(1));
  if (c && c->ctx) (void)moe_world_unbind(c->ctx, u->w); /* the context must not keep a stream about to go */
  moe_world_close(u->w);
  u->w = NULL;
  return 0;
}

static int w_tostring(lua_State *L) {
  World *u = (World *)luaL_checkudata(L, 1, WORLD);
  if (!u->w) {
    lua_pushliteral(L, "moelab.World(closed)");
    return 1;
  }
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  lua_pushfstring(L, "moelab.World(%d rank%s; here:", moe_world_size(u->w), moe_world_size(u->w) == 1 ? "" : "s");
  luaL_addvalue(&b);
  for (int i = 0; i < moe_world_local_count(u->w); i++) {
    lua_pushfstring(L, "%s rank %d on cuda:%d", i ? "," : "", moe_world_local_rank(u->w, i),
                    moe_world_local_device(u->w, i));
    luaL_addvalue(&b);
  }
  luaL_addstring(&b, ")");
  luaL_pushresult(&b);
  return 1;
}

static int w_size(lua_State *L) {
  lua_pushinteger(L, moe_world_size(lc_check_world(L, 1)));
  return 1;
}

/* ranks() -> {global rank, ...}; devices() -> {"cuda:N", ...}, both in local order */
static int w_ranks(lua_State *L) {
  moe_world *w = lc_check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushinteger(L, moe_world_local_rank(w, i));
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int w_devices(lua_State *L) {
  moe_world *w = lc_check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushfstring(L, "cuda:%d", moe_world_local_device(w, i));
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* bind(i): the module's context runs on local rank i's stream (1-based); unbind() undoes it */
static int w_bind(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  lua_Integer i = luaL_optinteger(L, 2, 1);
  if (i < 1 || i > moe_world_local_count(w))
    return lc_arg_error(L, "bind", 1, "local rank must be in [1, %d], got %I", moe_world_local_count(w),
                        (LUAI_UACINT)i);
  int rc = moe_world_bind(ctx, w, (int)i - 1);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int w_unbind(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  int rc = moe_world_unbind(ctx, w);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

/* allgather(outs, ins) and allgather_ids(all_ids, ids): tables of one tensor per local rank */
static int gather_call(lua_State *L, const char *fname, int ids) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_settop(L, 3);
  luaL_checkstack(L, 2 * n + 8, "too many ranks");
  for (int a = 2; a <= 3; a++) {
    if (lua_type(L, a) != LUA_TTABLE || (int)lua_rawlen(L, a) != n)
      return lc_arg_error(L, fname, a - 1, "expected a table of %d moelab.Tensor (one per local rank), got %s", n,
                          lc_type_name(L, a));
  }
  moe_tensor **out = (moe_tensor **)scratch(L, (size_t)n * sizeof *out);
  const moe_tensor **in = (const moe_tensor **)scratch(L, (size_t)n * sizeof *in);
  for (int i = 0; i < n; i++) {
    for (int a = 2; a <= 3; a++) {
      lua_rawgeti(L, a, i + 1);
      Tensor *u = lc_test_tensor(L, -1);
      if (!u)
        return lc_arg_error(L, fname, a - 1, "entry %d: expected an open moelab.Tensor, got %s", i + 1,
                            lc_type_name(L, -1));
      if (a == 2) out[i] = u->t;
      else in[i] = u->t;
      lua_pop(L, 1);
    }
  }
  int rc = ids ? moe_world_allgather_ids(ctx, w, out, in) : moe_world_allgather(ctx, w, out, in);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

static int w_allgather(lua_State *L) { return gather_call(L, "allgather", 0); }
static int w_allgather_ids(lua_State *L) { return gather_call(L, "allgather_ids", 1); }

static void config_from(lua_State *L, const char *fname, int tbl, int entry, moe_world_config *c) {
  static const char *const layouts[] = {"roundrobin", "peer_major", NULL};
  static const char *const fields[] = {"capacity", "expert_capacity", "experts", "hidden", "k", "layout",
                                       "pad", "tokens", "version", "world", NULL};
  lua_pushnil(L); /* a misspelt field is an error, not a default */
  while (lua_next(L, tbl)) {
    lua_pop(L, 1);
    const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    int known = 0;
    for (int i = 0; k && fields[i]; i++) known |= strcmp(k, fields[i]) == 0;
    if (!known) {
      const char *what = k ? lua_pushfstring(L, "'%s'", k) : lua_pushfstring(L, "(a %s key)", lc_type_name(L, -1));
      lc_arg_error(L, fname, 1,
                   "entry %d: unknown field %s; expected capacity, expert_capacity, experts, hidden, k, layout, pad, "
                   "tokens, version or world",
                   entry, what);
    }
  }
  c->version = w_int(L, fname, tbl, entry, "version", 1, MOE_VERSION_NUMBER);
  c->world = w_int(L, fname, tbl, entry, "world", 0, 0);
  c->tokens = w_int(L, fname, tbl, entry, "tokens", 0, 0);
  c->k = w_int(L, fname, tbl, entry, "k", 0, 0);
  c->experts = w_int(L, fname, tbl, entry, "experts", 0, 0);
  c->hidden = w_int(L, fname, tbl, entry, "hidden", 0, 0);
  c->capacity = w_int(L, fname, tbl, entry, "capacity", 0, 0);
  c->pad = w_int(L, fname, tbl, entry, "pad", 1, 1);
  c->expert_capacity = w_int(L, fname, tbl, entry, "expert_capacity", 1, -1);
  c->layout = 0;
  if (lua_getfield(L, tbl, "layout") == LUA_TSTRING) {
    const char *s = lua_tostring(L, -1);
    int found = -1;
    for (int i = 0; layouts[i]; i++)
      if (strcmp(s, layouts[i]) == 0) found = i;
    if (found < 0)
      lc_arg_error(L, fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got '%s'", entry, s);
    c->layout = found;
  } else if (!lua_isnil(L, -1)) {
    lc_arg_error(L, fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got %s", entry,
                 lc_type_name(L, -1));
  }
  lua_pop(L, 1);
}

/* check_config({cfg, ...}): one configuration table per local rank */
static int w_check_config(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_settop(L, 2);
  w_entries(L, "check_config", 2, n, "configurations");
  moe_world_config *cfgs = (moe_world_config *)scratch(L, (size_t)n * sizeof *cfgs);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    config_from(L, "check_config", lua_gettop(L), i + 1, &cfgs[i]);
    lua_pop(L, 1);
  }
  int rc = moe_world_check_config(ctx, w, cfgs);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* core.world_compare_configs(rank, {cfg, ...}): the comparison alone (no GPU), rank 0-based */
static int l_world_compare_configs(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  lua_Integer rank = luaL_checkinteger(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  int n = (int)lua_rawlen(L, 2);
  w_entries(L, "compare_configs", 2, n, "configurations");
  moe_world_config *all = (moe_world_config *)scratch(L, (size_t)(n ? n : 1) * sizeof *all);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    config_from(L, "compare_configs", lua_gettop(L), i + 1, &all[i]);
    lua_pop(L, 1);
  }
  if (rank < 0 || rank > INT32_MAX) rank = -1;
  int rc = moe_world_compare_configs(ctx, (int)rank, n, all);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* The dispatch arguments of n local ranks from the table at index 2 (left on the stack); the
 * all-gather exchange needs x_all, the direct one route_row. */
moe_world_dispatch_args *lc_world_dispatch_args(lua_State *L, int n, int direct) {
  w_entries(L, "dispatch", 2, n, "argument tables");
  luaL_checkstack(L, 9 * n + 8, "too many ranks");
  moe_world_dispatch_args *a = (moe_world_dispatch_args *)scratch(L, (size_t)n * sizeof *a);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    int t = lua_gettop(L);
    memset(&a[i], 0, sizeof a[i]);
    a[i].out = w_tensor(L, "dispatch", t, i + 1, "out", REQUIRED);
    if (!direct) a[i].x_all = w_tensor(L, "dispatch", t, i + 1, "x_all", REQUIRED);
    a[i].x = w_tensor(L, "dispatch", t, i + 1, "x", REQUIRED);
    a[i].peer_rank = w_tensor(L, "dispatch", t, i + 1, "peer_rank", REQUIRED);
    a[i].peer_route = w_tensor(L, "dispatch", t, i + 1, "peer_route", REQUIRED);
    if (direct) a[i].route_row = w_tensor(L, "dispatch", t, i + 1, "route_row", REQUIRED);
    a[i].k = w_int(L, "dispatch", t, i + 1, "k", 0, 0);
    lua_getfield(L, t, "zero_fill");
    a[i].zero_fill = lua_toboolean(L, -1);
  }
  return a;
}

/* dispatch({{out=, x_all=, x=, peer_rank=, peer_route=, k=, zero_fill=}, ...}) */
static int w_dispatch(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  lua_settop(L, 2);
  moe_world_dispatch_args *a = lc_world_dispatch_args(L, moe_world_local_count(w), 0);
  lc_args_still_open(L, "dispatch", 3);
  int rc = moe_world_dispatch(ctx, w, a);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* dispatch_fp8({{out=, out_scale=, x_all=, x_scale_all=, x=, x_scale=, peer_rank=, peer_route=, k=,
 * zero_fill=}, ...}) */
static int w_dispatch_fp8(lua_State *L) {
  static const char *const fields[] = {"out", "out_scale", "x_all", "x_scale_all", "x", "x_scale", "peer_rank",
                                       "peer_route"};
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_settop(L, 2);
  w_entries(L, "dispatch_fp8", 2, n, "argument tables");
  luaL_checkstack(L, 11 * n + 8, "too many ranks");
  moe_world_dispatch_fp8_args *a = (moe_world_dispatch_fp8_args *)scratch(L, (size_t)n * sizeof *a);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    int t = lua_gettop(L);
    moe_tensor *ts[8];
    for (int j = 0; j < 8; j++) ts[j] = w_tensor(L, "dispatch_fp8", t, i + 1, fields[j], REQUIRED);
    memset(&a[i], 0, sizeof a[i]);
    a[i].out = ts[0], a[i].out_scale = ts[1], a[i].x_all = ts[2], a[i].x_scale_all = ts[3];
    a[i].x = ts[4], a[i].x_scale = ts[5], a[i].peer_rank = ts[6], a[i].peer_route = ts[7];
    a[i].k = w_int(L, "dispatch_fp8", t, i + 1, "k", 0, 0);
    lua_getfield(L, t, "zero_fill");
    a[i].zero_fill = lua_toboolean(L, -1);
  }
  lc_args_still_open(L, "dispatch_fp8", 3);
  int rc = moe_world_dispatch_fp8(ctx, w, a);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* The combine arguments of n local ranks from the table at index 2 (left on the stack); the
 * direct exchange needs no send and receive scratch. */
moe_world_combine_args *lc_world_combine_args(lua_State *L, int n, int direct) {
  w_entries(L, "combine", 2, n, "argument tables");
  luaL_checkstack(L, 14 * n + 8, "too many ranks");
  moe_world_combine_args *a = (moe_world_combine_args *)scratch(L, (size_t)n * sizeof *a);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    int t = lua_gettop(L);
    memset(&a[i], 0, sizeof a[i]);
    a[i].out = w_tensor(L, "combine", t, i + 1, "out", REQUIRED);
    a[i].weights = w_tensor(L, "combine", t, i + 1, "weights", REQUIRED);
    a[i].ids = w_tensor(L, "combine", t, i + 1, "ids", REQUIRED);
    a[i].ys = w_tensor(L, "combine", t, i + 1, "ys", REQUIRED);
    a[i].route_row = w_tensor(L, "combine", t, i + 1, "route_row", REQUIRED);
    if (!direct) {
      a[i].send_rows = w_tensor(L, "combine", t, i + 1, "send_rows", REQUIRED);
      a[i].recv_rows = w_tensor(L, "combine", t, i + 1, "recv_rows", REQUIRED);
      a[i].send_index = w_tensor(L, "combine", t, i + 1, "send_index", REQUIRED);
      a[i].recv_index = w_tensor(L, "combine", t, i + 1, "recv_index", REQUIRED);
    }
    a[i].shared = w_tensor(L, "combine", t, i + 1, "shared", OPTIONAL);
    a[i].shared_gate = w_tensor(L, "combine", t, i + 1, "shared_gate", OPTIONAL);
    a[i].experts = w_int(L, "combine", t, i + 1, "experts", 0, 0);
  }
  return a;
}

/* combine({{out=, weights=, ids=, ys=, route_row=, send_rows=, recv_rows=, send_index=,
 * recv_index=, experts=, shared=, shared_gate=}, ...}) */
static int w_combine(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_world *w = lc_check_world(L, 1);
  lua_settop(L, 2);
  moe_world_combine_args *a = lc_world_combine_args(L, moe_world_local_count(w), 0);
  lc_args_still_open(L, "combine", 3);
  int rc = moe_world_combine(ctx, w, a);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

static const luaL_Reg world_meta[] = {
  {"__gc", w_release},
  {"__close", w_release},
  {"__tostring", w_tostring},
  {NULL, NULL}
};

static const luaL_Reg world_methods[] = {
  {"close", w_release},
  {"size", w_size},
  {"ranks", w_ranks},
  {"devices", w_devices},
  {"bind", w_bind},
  {"unbind", w_unbind},
  {"allgather", w_allgather},
  {"allgather_ids", w_allgather_ids},
  {"check_config", w_check_config},
  {"dispatch", w_dispatch},
  {"dispatch_fp8", w_dispatch_fp8},
  {"combine", w_combine},
  {"exchange", lc_world_exchange},
  {NULL, NULL}
};

static const luaL_Reg world_funcs[] = {
  {"world_unique_id", l_world_unique_id},
  {"world_open_local", l_world_open_local},
  {"world_open_rank", l_world_open_rank},
  {"world_open_comm", l_world_open_comm},
  {"world_compare_configs", l_world_compare_configs},
  {NULL, NULL}
};

/* The World class (its finalizer needs the context too: it unbinds it) and its functions. */
void lc_open_world(lua_State *L, int ctxi, int mod) {
  lc_new_class(L, WORLD, world_meta, 1, world_methods, ctxi);
  lc_add_funcs(L, world_funcs, ctxi, mod);
}
