/* SPDX-License-Identifier: MIT */
/*
 * tensor.c -- moelab.Tensor: the handles (their lifetime, views, and the pins that keep a
 * captured graph's memory alive: see PINS in lcore.h) and the methods.
 */
#include <stdint.h>
#include <string.h>

#include "lcore.h"

/* ---- tensor handles ---- */

static void release_owner(Tensor *o);
static Tensor *push_owner(lua_State *L, int idx);

/* Pins the owner of the tensor at idx into the capture under way, if any. */
static void pin(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_getfield(L, LUA_REGISTRYINDEX, PINS) == LUA_TTABLE) {
    Tensor *o = push_owner(L, idx); /* pins, owner */
    if (lua_rawget(L, -2) == LUA_TNIL) {
      push_owner(L, idx);
      lua_pushboolean(L, 1);
      lua_rawset(L, -4);
      o->pins++;
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* Keeps the object at idx (not a tensor: an exchange, whose windows a captured call uses
 * through no tensor the graph was handed) alive as long as the capture under way's graph. */
void lc_pin_object(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_getfield(L, LUA_REGISTRYINDEX, PINS) == LUA_TTABLE) {
    lua_pushvalue(L, idx);
    lua_pushboolean(L, 1);
    lua_rawset(L, -3);
  }
  lua_pop(L, 1);
}

/* Undoes the pins of a set that graph_end handed to a graph (the table at idx); its other
 * objects (lc_pin_object) are merely let go with the set. */
void lc_unpin_all(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    lua_pop(L, 1);
    Tensor *o = (Tensor *)luaL_testudata(L, -1, TENSOR);
    if (!o) continue;
    o->pins--;
    release_owner(o);
  }
}

/* A closed handle first, then the tensor: if creating it fails, the handle is consistent.  An
 * owner made during a capture is pinned at once (a view's owner was, when the view's base was
 * checked).  User values: 1, a view's owner; 2, what an owner's memory needs kept alive (the
 * keep of moe.wrap). */
Tensor *lc_new_handle(lua_State *L, int owner) {
  Tensor *u = (Tensor *)lua_newuserdatauv(L, sizeof *u, 2);
  u->t = NULL;
  u->closed = 0;
  u->views = 0;
  u->pins = 0;
  luaL_setmetatable(L, TENSOR);
  if (owner) pin(L, -1);
  return u;
}

/* The open tensor at idx (pinned into a capture under way), or NULL. */
Tensor *lc_test_tensor(lua_State *L, int idx) {
  Tensor *u = (Tensor *)luaL_testudata(L, idx, TENSOR);
  if (!u || u->closed || !u->t) return NULL;
  pin(L, idx);
  return u;
}

static Tensor *check_handle(lua_State *L, int idx) {
  Tensor *u = lc_test_tensor(L, idx);
  if (!u) {
    luaL_checkudata(L, idx, TENSOR);
    luaL_argerror(L, idx, "moelab.Tensor is closed");
  }
  return u;
}

moe_tensor *lc_check_tensor(lua_State *L, int idx) { return check_handle(L, idx)->t; }

/* Taking the arguments may have run Lua code (an __index metamethod of an argument table; a
 * finalizer at an allocation, pinning into a capture included), which could have closed a tensor
 * already taken.  Called after the last argument is taken and the last allocation made, just
 * before the library is called: every tensor handle from stack index `from` on (where the
 * arguments are, or the fields' values are left) must still be open. */
void lc_args_still_open(lua_State *L, const char *fname, int from) {
  for (int i = from, top = lua_gettop(L); i <= top; i++) {
    const Tensor *u = (const Tensor *)luaL_testudata(L, i, TENSOR);
    if (u && (u->closed || !u->t))
      lc_arg_error(L, fname, 1, "a moelab.Tensor of the arguments was closed while they were being read");
  }
}

/* The owner's memory goes with its last handle, owner or view. */
static void release_owner(Tensor *o) {
  if (o->closed && o->views == 0 && o->pins == 0) {
    moe_tensor_free(o->t);
    o->t = NULL;
  }
}

/* __gc and __close: frees once, never raises.  A view's owner is reachable from the view's
 * user value while the view is being finalized, so its block is still there to update. */
static int t_release(lua_State *L) {
  Tensor *u = (Tensor *)luaL_testudata(L, 1, TENSOR);
  if (!u || u->closed) return 0;
  u->closed = 1;
  if (lua_getiuservalue(L, 1, 1) == LUA_TUSERDATA) {
    Tensor *o = (Tensor *)lua_touserdata(L, -1);
    moe_tensor_free(u->t);
    u->t = NULL;
    o->views--;
    release_owner(o);
  } else {
    release_owner(u);
  }
  lua_pop(L, 1);
  return 0;
}

/* Pushes the handle that owns the memory of the tensor at idx: its user value for a view
 * (always an owner, never a view), else itself. */
static Tensor *push_owner(lua_State *L, int idx) {
  if (lua_getiuservalue(L, idx, 1) != LUA_TUSERDATA) {
    lua_pop(L, 1);
    lua_pushvalue(L, idx);
  }
  return (Tensor *)lua_touserdata(L, -1);
}

/* Pushes a view of the tensor at index bi. */
static int push_view(lua_State *L, int bi, int64_t offset, int ndim, const int64_t *shape) {
  moe_ctx *ctx = lc_getctx(L);
  lc_check_tensor(L, bi);
  Tensor *u = lc_new_handle(L, 0);
  /* again after the allocation, whose collection step may have run a finalizer that closed it */
  moe_tensor *base = lc_check_tensor(L, bi);
  Tensor *o = push_owner(L, bi);
  lua_setiuservalue(L, -2, 1);
  o->views++; /* counted with the link, so that releasing u undoes exactly this */
  int rc = moe_tensor_view(ctx, base, offset, ndim, shape, &u->t);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

static void push_element(lua_State *L, moe_dtype dtype, const void *buf, int64_t i) {
  switch (dtype) {
  case MOE_F32: lua_pushnumber(L, (lua_Number)((const float *)buf)[i]); break;
  case MOE_BF16: lua_pushnumber(L, (lua_Number)moe_bf16_to_f32(((const uint16_t *)buf)[i])); break;
  case MOE_I32: lua_pushinteger(L, (lua_Integer)((const int32_t *)buf)[i]); break;
  case MOE_E4M3: lua_pushnumber(L, (lua_Number)moe_e4m3_to_f32(((const uint8_t *)buf)[i])); break;
  }
}

/* What a table built from a tensor needs of it, taken before the tables are allocated (a
 * collection step there may run a finalizer that closes the tensor). */
typedef struct Layout {
  int ndim;
  int64_t shape[MOE_MAX_DIMS], numel;
  moe_dtype dtype;
} Layout;

/* Reads the whole tensor at idx into a scratch userdata left on the stack; *l gets its layout. */
static void *read_all(lua_State *L, moe_ctx *ctx, int idx, Layout *l) {
  size_t nbytes = moe_tensor_nbytes(lc_check_tensor(L, idx));
  void *buf = lua_newuserdatauv(L, nbytes ? nbytes : 1, 0);
  moe_tensor *t = lc_check_tensor(L, idx); /* again: the allocation may have run a finalizer */
  l->ndim = moe_tensor_ndim(t);
  for (int i = 0; i < l->ndim; i++) l->shape[i] = moe_tensor_dim(t, i);
  l->numel = moe_tensor_numel(t);
  l->dtype = moe_tensor_dtype(t);
  int rc = moe_tensor_read(ctx, t, buf, nbytes);
  if (rc) lc_fail(L, ctx, rc);
  return buf;
}

/* t[i] is not an element: a tensor may live on a GPU, and a read per element would hide a copy
 * each.  Saying so beats the nil that would fail later, far from here. */
static int no_elements(lua_State *L) {
  return luaL_error(L, "moelab.Tensor has no elements by index (t[%s]): t:get(i) reads element i (1-based, flat), "
                    "t:select(i) is a view of row i, t:flat() and t:totable() read it all", lc_got_value(L, 2));
}

static int t_index(lua_State *L) {
  Tensor *u = (Tensor *)luaL_checkudata(L, 1, TENSOR);
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL) return 1;
  if (lua_type(L, 2) != LUA_TSTRING) return no_elements(L);
  const char *k = lua_tostring(L, 2);
  int which = strcmp(k, "shape") == 0 ? 1 : strcmp(k, "dtype") == 0 ? 2 : strcmp(k, "device") == 0 ? 3
            : strcmp(k, "ndim") == 0 ? 4 : strcmp(k, "closed") == 0 ? 5 : 0;
  if (!which) return 1; /* nil */
  if (which == 5) { /* readable after closing: it is how a caller asks */
    lua_pushboolean(L, u->closed || !u->t);
    return 1;
  }
  if (u->closed || !u->t) return luaL_error(L, "attempt to read '%s' of a closed moelab.Tensor", k);
  moe_tensor *t = u->t;
  switch (which) {
  case 1: {
    int64_t shape[MOE_MAX_DIMS]; /* read before the table is allocated (see Layout) */
    int nd = moe_tensor_ndim(t);
    for (int i = 0; i < nd; i++) shape[i] = moe_tensor_dim(t, i);
    lua_createtable(L, nd, 0);
    for (int i = 0; i < nd; i++) {
      lua_pushinteger(L, (lua_Integer)shape[i]);
      lua_rawseti(L, -2, i + 1);
    }
    break;
  }
  case 2: lua_pushstring(L, moe_dtype_name(moe_tensor_dtype(t))); break;
  case 3: lc_push_device(L, moe_tensor_device(t)); break;
  default: lua_pushinteger(L, moe_tensor_ndim(t)); break;
  }
  return 1;
}

/* Nothing is set on a tensor: its fields are its shape, dtype and device, its values the device's. */
static int t_newindex(lua_State *L) {
  if (lua_type(L, 2) != LUA_TSTRING)
    return luaL_error(L, "moelab.Tensor cannot be assigned by index (t[%s] = ...): t:copy(u) and t:fill(v) write it",
                      lc_got_value(L, 2));
  return luaL_error(L, "moelab.Tensor has no field to set ('%s'): its shape, dtype and device are fixed; t:copy(u), "
                    "t:fill(v) and t:randn(seed, std) write its values", lua_tostring(L, 2));
}

static int t_tostring(lua_State *L) {
  Tensor *u = (Tensor *)luaL_checkudata(L, 1, TENSOR);
  if (u->closed || !u->t) {
    lua_pushliteral(L, "moelab.Tensor(closed)");
    return 1;
  }
  moe_tensor *t = u->t;
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, "moelab.Tensor(");
  luaL_addstring(&b, moe_dtype_name(moe_tensor_dtype(t)));
  luaL_addstring(&b, " [");
  for (int i = 0; i < moe_tensor_ndim(t); i++) {
    lua_pushfstring(L, i ? ", %I" : "%I", (LUAI_UACINT)moe_tensor_dim(t, i));
    luaL_addvalue(&b);
  }
  luaL_addstring(&b, "] on ");
  lc_push_device(L, moe_tensor_device(t));
  luaL_addvalue(&b);
  luaL_addchar(&b, ')');
  luaL_pushresult(&b);
  return 1;
}

/* ---- tensor methods ---- */

/* The open tensor a method is called on (see lc_check_self). */
static moe_tensor *self_tensor(lua_State *L, const char *method) {
  lc_check_self(L, TENSOR, "t", method);
  return lc_check_tensor(L, 1);
}

static void build_table(lua_State *L, const Layout *l, const void *buf, int level, int64_t *pos) {
  if (level >= l->ndim || level >= MOE_MAX_DIMS) return; /* never: the recursion stops at the last dimension */
  int64_t n = l->shape[level];
  int last = level + 1 == l->ndim;
  luaL_checkstack(L, 3, NULL);
  lua_createtable(L, n < INT32_MAX ? (int)n : INT32_MAX, 0);
  for (int64_t i = 0; i < n; i++) {
    if (last) push_element(L, l->dtype, buf, (*pos)++);
    else build_table(L, l, buf, level + 1, pos);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
}

static int t_totable(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  self_tensor(L, "totable");
  Layout l;
  const void *buf = read_all(L, ctx, 1, &l);
  /* the nested tables of an empty tensor hold nothing, but there can be 2^40 of them ([2^20, 2^20, 0]) */
  double tables = 1, level = 1;
  for (int i = 0; i + 1 < l.ndim; i++) tables += level *= (double)l.shape[i];
  if (l.numel == 0 && tables > (double)(1 << 24))
    return luaL_error(L, "totable: the tensor has no elements, but its shape would make %I nested tables",
                      (LUAI_UACINT)tables);
  int64_t pos = 0;
  if (l.ndim == 0) push_element(L, l.dtype, buf, 0);
  else build_table(L, &l, buf, 0, &pos);
  return 1;
}

static int t_flat(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  self_tensor(L, "flat");
  Layout l;
  const void *buf = read_all(L, ctx, 1, &l);
  lua_createtable(L, l.numel < INT32_MAX ? (int)l.numel : INT32_MAX, 0);
  for (int64_t i = 0; i < l.numel; i++) {
    push_element(L, l.dtype, buf, i);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

static int t_get(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *t = self_tensor(L, "get");
  lua_Integer i = luaL_checkinteger(L, 2);
  int64_t n = moe_tensor_numel(t);
  if (i < 1 || i > n)
    luaL_argerror(L, 2, lua_pushfstring(L, "index %I out of range [1, %I]", (LUAI_UACINT)i, (LUAI_UACINT)n));
  moe_dtype dtype = moe_tensor_dtype(t);
  if (moe_tensor_device(t).kind == MOE_CPU) {
    push_element(L, dtype, moe_tensor_data(t), i - 1);
    return 1;
  }
  /* one element through a temporary view; nothing here can raise until it is freed */
  union { float f; uint16_t h; int32_t i; uint8_t q; } one;
  moe_tensor *v = NULL;
  int rc = moe_tensor_view(ctx, t, (int64_t)(i - 1), 0, NULL, &v);
  if (!rc) rc = moe_tensor_read(ctx, v, &one, moe_dtype_size(dtype));
  moe_tensor_free(v);
  if (rc) return lc_fail(L, ctx, rc);
  push_element(L, dtype, &one, 0);
  return 1;
}

static int t_to(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *src = self_tensor(L, "to");
  moe_device dev = lc_check_device(L, 2);
  int nd = moe_tensor_ndim(src);
  int64_t shape[MOE_MAX_DIMS];
  for (int i = 0; i < nd; i++) shape[i] = moe_tensor_dim(src, i);
  Tensor *u = lc_new_handle(L, 1);
  src = lc_check_tensor(L, 1); /* again: the allocation may have run a finalizer that closed it */
  int rc = moe_tensor_new(ctx, moe_tensor_dtype(src), nd, shape, dev, &u->t);
  /* an absent device, named as t:to's argument rather than by the tensor made for it */
  if (rc == MOE_ERR_UNSUPPORTED || rc == MOE_ERR_ARG) return lc_stage_fail_as(L, ctx, rc, "to", "tensor", "device ");
  if (!rc) rc = moe_tensor_copy(ctx, u->t, src);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

static int t_copy(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *dst = self_tensor(L, "copy"), *src = lc_check_tensor(L, 2);
  lc_args_still_open(L, "copy", 1); /* pinning src into a capture may have run a finalizer */
  int rc = moe_tensor_copy(ctx, dst, src);
  if (rc) return lc_stage_fail(L, ctx, rc, "copy", "tensor_copy");
  lua_settop(L, 1);
  return 1;
}

static int t_fill(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *t = self_tensor(L, "fill");
  lua_Number v = luaL_checknumber(L, 2);
  int rc = moe_tensor_fill(ctx, t, (double)v);
  if (rc) return lc_stage_fail(L, ctx, rc, "fill", "fill");
  lua_settop(L, 1);
  return 1;
}

static int t_randn(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *t = self_tensor(L, "randn");
  uint64_t seed = (uint64_t)luaL_checkinteger(L, 2);
  float std = (float)luaL_optnumber(L, 3, 1.0);
  int rc = moe_tensor_randn(ctx, t, seed, std);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int t_view(lua_State *L) {
  self_tensor(L, "view");
  lua_Integer offset = luaL_checkinteger(L, 2);
  int64_t shape[MOE_MAX_DIMS];
  int nd = lc_check_shape(L, 3, shape);
  return push_view(L, 1, (int64_t)offset, nd, shape);
}

static int t_select(lua_State *L) {
  moe_tensor *t = self_tensor(L, "select");
  lua_Integer i = luaL_checkinteger(L, 2);
  int nd = moe_tensor_ndim(t);
  if (nd == 0) luaL_argerror(L, 1, "cannot select from a 0-dimensional tensor");
  int64_t n = moe_tensor_dim(t, 0);
  if (i < 1 || i > n)
    luaL_argerror(L, 2, lua_pushfstring(L, "index %I out of range [1, %I]", (LUAI_UACINT)i, (LUAI_UACINT)n));
  int64_t shape[MOE_MAX_DIMS], inner = 1;
  for (int d = 1; d < nd; d++) inner *= (shape[d - 1] = moe_tensor_dim(t, d));
  return push_view(L, 1, (int64_t)(i - 1) * inner, nd - 1, shape);
}

static int t_numel(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)moe_tensor_numel(self_tensor(L, "numel")));
  return 1;
}

static int t_nbytes(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)moe_tensor_nbytes(self_tensor(L, "nbytes")));
  return 1;
}

static int t_address(lua_State *L) {
  lua_pushlightuserdata(L, moe_tensor_data(self_tensor(L, "address")));
  return 1;
}

/* t:overlaps(u): whether the two share a byte (same device, intersecting address ranges). */
static int t_overlaps(lua_State *L) {
  moe_tensor *a = self_tensor(L, "overlaps"), *b = lc_check_tensor(L, 2);
  const moe_device da = moe_tensor_device(a), db = moe_tensor_device(b);
  const uintptr_t pa = (uintptr_t)moe_tensor_data(a), pb = (uintptr_t)moe_tensor_data(b);
  const size_t na = moe_tensor_nbytes(a), nb = moe_tensor_nbytes(b);
  lua_pushboolean(L, da.kind == db.kind && (da.kind == MOE_CPU || da.index == db.index) && na && nb &&
                         pa < pb + nb && pb < pa + na);
  return 1;
}

static const luaL_Reg tensor_meta[] = {
  {"__gc", t_release},
  {"__close", t_release},
  {"__tostring", t_tostring},
  {"__newindex", t_newindex},
  {NULL, NULL}
};

static const luaL_Reg tensor_methods[] = {
  {"totable", t_totable},
  {"flat", t_flat},
  {"get", t_get},
  {"to", t_to},
  {"copy", t_copy},
  {"fill", t_fill},
  {"randn", t_randn},
  {"view", t_view},
  {"select", t_select},
  {"numel", t_numel},
  {"nbytes", t_nbytes},
  {"address", t_address},
  {"overlaps", t_overlaps},
  {"close", t_release}, /* what a <close> variable does, for LuaJIT, which has none */
  {NULL, NULL}
};

void lc_open_tensor(lua_State *L, int ctxi, int mod) {
  luaL_newmetatable(L, TENSOR);
  int mt = lua_gettop(L);
  luaL_setfuncs(L, tensor_meta, 0);
  lua_createtable(L, 0, sizeof tensor_methods / sizeof tensor_methods[0]);
  int methods = lua_gettop(L);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, tensor_methods, 1);
  lua_pushvalue(L, methods);
  lua_pushcclosure(L, t_index, 1);
  lua_setfield(L, mt, "__index");
  lua_setfield(L, mod, "Tensor"); /* the methods: the front-end may add methods written in Lua */
  lua_pop(L, 1);
}
