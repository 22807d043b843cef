/* SPDX-License-Identifier: MIT */
/*
 * tensorlib.c -- the module's functions of tensors and devices: new, from_table, is_tensor,
 * device_count, device_info, device_memory, synchronize, the context's options (config), and
 * tensors over memory another library owns (wrap, from_dlpack, to_dlpack).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "lcore.h"

static int l_device_count(lua_State *L) {
  static const char *const kinds[] = {"cpu", "cuda", NULL};
  moe_ctx *ctx = lc_getctx(L);
  int kind = luaL_checkoption(L, 1, NULL, kinds) == 0 ? MOE_CPU : MOE_CUDA;
  int n = 0;
  int rc = moe_device_count(ctx, kind, &n);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushinteger(L, n);
  return 1;
}

/* core.device_info(device) -> moe_device_info's report, "key: value" lines */
static int l_device_info(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_device dev = lc_check_device(L, 1);
  char report[1024];
  int rc = moe_device_info(ctx, dev, report, sizeof report);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushstring(L, report);
  return 1;
}

/* core.device_memory(device) -> free, total: bytes the device can still hold, and has. */
static int l_device_memory(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_device dev = lc_check_device(L, 1);
  size_t bytes[2] = {0, 0}; /* free, total */
  int rc = moe_device_memory(ctx, dev, &bytes[0], &bytes[1]);
  if (rc) return lc_fail(L, ctx, rc);
  for (int i = 0; i < 2; i++) /* a Lua integer holds any real size; the clamp only keeps the cast defined */
    lua_pushinteger(L, (lua_Integer)(bytes[i] < (size_t)LUA_MAXINTEGER ? bytes[i] : (size_t)LUA_MAXINTEGER));
  return 2;
}

/* core.config(option) -> value; core.config(option, value) sets it (moe_ctx_config). */
static int l_config(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  const char *option = luaL_checkstring(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    int rc = moe_ctx_config(ctx, option, luaL_checkstring(L, 2));
    if (rc) return lc_fail(L, ctx, rc);
  }
  const char *value = moe_ctx_config_value(ctx, option);
  if (!value) return luaL_argerror(L, 1, lua_pushfstring(L, "no option '%s'", option));
  lua_pushstring(L, value);
  return 1;
}

static int l_new(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_dtype dtype = lc_check_dtype(L, 1);
  int64_t shape[MOE_MAX_DIMS];
  int nd = lc_check_shape(L, 2, shape);
  moe_device dev = lc_opt_device(L, 3);
  Tensor *u = lc_new_handle(L, 1);
  int rc = moe_tensor_new(ctx, dtype, nd, shape, dev, &u->t);
  /* host memory comes zeroed; device memory is zeroed here */
  if (!rc && dev.kind != MOE_CPU) rc = moe_tensor_fill(ctx, u->t, 0.0);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

/* from_table: a checking pass (buf == NULL) and a filling pass over the same walk, so that a
 * ragged table never sizes an allocation. */
typedef struct Fill {
  lua_State *L;
  moe_dtype dtype;
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  lua_Integer path[MOE_MAX_DIMS];
  void *buf;
  int64_t pos;
} Fill;

#define DATA_ERROR(L, ...) lc_arg_error((L), "tensor", 1, __VA_ARGS__)

/* "[2][3]" */
static const char *path_string(Fill *f, int depth, char *s, size_t n) {
  size_t len = 0;
  s[0] = '\0';
  for (int i = 0; i < depth && len < n; i++) {
    int w = snprintf(s + len, n - len, "[%lld]", (long long)f->path[i]);
    if (w < 0) break;
    len += (size_t)w;
  }
  return s;
}

/* "element [2][3]", or "value" for a scalar */
static const char *element_name(Fill *f, int depth) {
  char p[128];
  if (depth == 0) return "value";
  return lua_pushfstring(f->L, "element %s", path_string(f, depth, p, sizeof p));
}

static void put_number(Fill *f, int idx, int depth) {
  lua_State *L = f->L;
  if (lua_type(L, idx) != LUA_TNUMBER)
    DATA_ERROR(L, "%s %s, expected a number", element_name(f, depth), lc_is_what(L, idx, 0));
  if (f->dtype == MOE_I32) {
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, idx, &isint);
    if (!isint)
      DATA_ERROR(L, "%s %s, expected an integer for dtype i32", element_name(f, depth), lc_is_what(L, idx, 1));
    if (v < INT32_MIN || v > INT32_MAX)
      DATA_ERROR(L, "%s is %I, outside the range of i32", element_name(f, depth), (LUAI_UACINT)v);
    if (f->buf) ((int32_t *)f->buf)[f->pos] = (int32_t)v;
  } else if (f->buf) {
    /* rounded to f32 first, as moe_tensor_fill rounds */
    float x = (float)lua_tonumber(L, idx);
    if (f->dtype == MOE_F32) ((float *)f->buf)[f->pos] = x;
    else if (f->dtype == MOE_E4M3) ((uint8_t *)f->buf)[f->pos] = moe_f32_to_e4m3(x);
    else ((uint16_t *)f->buf)[f->pos] = moe_f32_to_bf16(x);
  }
  f->pos++;
}

static void walk(Fill *f, int idx, int level) {
  lua_State *L = f->L;
  char p[128];
  if (level >= f->ndim || level >= MOE_MAX_DIMS) return; /* never: level < ndim <= MOE_MAX_DIMS */
  lua_Integer n = (lua_Integer)lua_rawlen(L, idx);
  if (n != f->shape[level])
    DATA_ERROR(L, "ragged nested table at %s: expected %I elements, got %I", path_string(f, level, p, sizeof p),
               (LUAI_UACINT)f->shape[level], (LUAI_UACINT)n);
  luaL_checkstack(L, 4, NULL);
  for (lua_Integer i = 1; i <= n; i++) {
    f->path[level] = i;
    lua_rawgeti(L, idx, i);
    int top = lua_gettop(L);
    if (level + 1 < f->ndim) {
      if (lua_type(L, top) != LUA_TTABLE)
        DATA_ERROR(L, "%s %s, expected a table", element_name(f, level + 1), lc_is_what(L, top, 0));
      walk(f, top, level + 1);
    } else {
      put_number(f, top, level + 1);
    }
    lua_pop(L, 1);
  }
}

static int l_from_table(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Fill f;
  memset(&f, 0, sizeof f);
  f.L = L;
  f.dtype = lc_check_dtype(L, 2);
  moe_device dev = lc_opt_device(L, 3);
  int64_t shape[MOE_MAX_DIMS] = {0};
  int nd = 0;
  int64_t numel = 1;
  int given = !lua_isnoneornil(L, 4);
  if (given) {
    nd = lc_check_shape(L, 4, shape);
    for (int i = 0; i < nd; i++) {
      if (shape[i] > 0 && numel > ((int64_t)1 << 40) / shape[i])
        luaL_argerror(L, 4, "shape has more than 2^40 elements");
      numel *= shape[i];
    }
    if (lua_type(L, 1) != LUA_TTABLE)
      DATA_ERROR(L, "expected a flat table of numbers, got %s", lc_type_name(L, 1));
    lua_Integer n = (lua_Integer)lua_rawlen(L, 1);
    if (n != numel)
      DATA_ERROR(L, "expected %I numbers for the shape given, got %I", (LUAI_UACINT)numel, (LUAI_UACINT)n);
    f.ndim = 1;
    f.shape[0] = numel;
  } else if (lua_type(L, 1) == LUA_TTABLE) {
    /* the shape from the first element of every level; walk() checks the rest against it */
    lua_pushvalue(L, 1);
    while (lua_type(L, -1) == LUA_TTABLE) {
      if (nd == MOE_MAX_DIMS) DATA_ERROR(L, "nested deeper than %d levels", MOE_MAX_DIMS);
      int64_t n = (int64_t)lua_rawlen(L, -1);
      shape[nd++] = n;
      if (n == 0) break;
      lua_rawgeti(L, -1, 1);
      lua_remove(L, -2);
    }
    lua_pop(L, 1);
    for (int i = 0; i < nd; i++) {
      if (shape[i] > 0 && numel > ((int64_t)1 << 40) / shape[i]) DATA_ERROR(L, "more than 2^40 elements");
      numel *= shape[i];
    }
    f.ndim = nd;
    memcpy(f.shape, shape, sizeof shape);
  } else if (lua_type(L, 1) != LUA_TNUMBER) {
    DATA_ERROR(L, "expected a number or a nested table of numbers, got %s", lc_type_name(L, 1));
  }

  size_t nbytes = (size_t)numel * moe_dtype_size(f.dtype);
  if (f.ndim > 0) {
    walk(&f, 1, 0); /* checks only: f.buf is NULL */
    f.buf = lua_newuserdatauv(L, nbytes ? nbytes : 1, 0);
    f.pos = 0;
    walk(&f, 1, 0);
  } else {
    f.buf = lua_newuserdatauv(L, nbytes, 0);
    put_number(&f, 1, 0);
  }
  int bufidx = lua_gettop(L);

  Tensor *u = lc_new_handle(L, 1);
  int rc = moe_tensor_new(ctx, f.dtype, nd, shape, dev, &u->t);
  if (!rc) rc = moe_tensor_write(ctx, u->t, lua_touserdata(L, bufidx), nbytes);
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

static int l_is_tensor(lua_State *L) {
  lua_pushboolean(L, luaL_testudata(L, 1, TENSOR) != NULL);
  return 1;
}

static int l_synchronize(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_device dev = lc_check_device(L, 1);
  int rc = moe_ctx_synchronize(ctx, dev);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* core.wrap(address, dtype, shape, device, keep): a tensor over the caller's memory; keep (any
 * value) lives as long as the tensor's memory is in use (views and graphs included). */
static int l_wrap(lua_State *L) {
  lua_settop(L, 5);
  moe_ctx *ctx = lc_getctx(L);
  void *data = lc_check_address(L, 1, "wrap", "option 'address'");
  moe_dtype dtype = lc_check_dtype(L, 2);
  int64_t shape[MOE_MAX_DIMS];
  int nd = lc_check_shape(L, 3, shape);
  moe_device dev = lc_opt_device(L, 4);
  Tensor *u = lc_new_handle(L, 1);
  lua_pushvalue(L, 5);
  lua_setiuservalue(L, -2, 2);
  int rc = moe_tensor_wrap(ctx, data, dtype, nd, shape, dev, &u->t);
  if (rc) return lc_stage_fail(L, ctx, rc, "wrap", "wrap");
  return 1;
}

/* core.from_dlpack(address, versioned): a tensor that owns the DLManagedTensor (or, versioned,
 * the DLManagedTensorVersioned) at address; on an error the caller still owns it.  Nothing can
 * raise between the library's taking it and the return, so the handle always gets it. */
static int l_from_dlpack(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  void *managed = lc_check_address(L, 1, "from_dlpack", "the managed tensor's address");
  int versioned = lua_toboolean(L, 2);
  Tensor *u = lc_new_handle(L, 1);
  int rc = versioned ? moe_tensor_from_dlpack_versioned(ctx, managed, &u->t)
                     : moe_tensor_from_dlpack(ctx, managed, &u->t);
  if (rc) return lc_stage_fail(L, ctx, rc, "from_dlpack", "from_dlpack");
  return 1;
}

/* core.to_dlpack(t, versioned) -> the address of a new DLManagedTensor (DLManagedTensorVersioned)
 * over t's memory, as an integer: its consumer calls its deleter. */
static int l_to_dlpack(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *t = lc_check_tensor(L, 1);
  int versioned = lua_toboolean(L, 2);
  struct DLManagedTensor *m = NULL;
  struct DLManagedTensorVersioned *v = NULL;
  int rc = versioned ? moe_tensor_to_dlpack_versioned(ctx, t, &v) : moe_tensor_to_dlpack(ctx, t, &m);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushinteger(L, (lua_Integer)(uintptr_t)(versioned ? (void *)v : (void *)m));
  return 1;
}

static const luaL_Reg tensorlib_funcs[] = {
  {"device_count", l_device_count},
  {"device_info", l_device_info},
  {"device_memory", l_device_memory},
  {"config", l_config},
  {"new", l_new},
  {"from_table", l_from_table},
  {"is_tensor", l_is_tensor},
  {"synchronize", l_synchronize},
  {"wrap", l_wrap},
  {"from_dlpack", l_from_dlpack},
  {"to_dlpack", l_to_dlpack},
  {NULL, NULL}
};

void lc_open_tensorlib(lua_State *L, int ctxi, int mod) { lc_add_funcs(L, tensorlib_funcs, ctxi, mod); }
