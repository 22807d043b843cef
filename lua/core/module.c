/*
 * moelab_core.c -- the Lua module moelab.core: a thin binding of lib/moelab.h.
 *
 * The pure-Lua front-end (lua/moelab/init.lua) validates options, allocates outputs and
 * composes layers; this module only moves values between Lua and the C API.  It includes the
 * public header alone.
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
#define _POSIX_C_SOURCE 200809L /* clock_gettime for core.now */
#include <stdarg.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <time.h>

#include "lua.h"
#include "lauxlib.h"

#include "moelab.h"

#define TENSOR "moelab.Tensor"
#define CONTEXT "moelab.Context"
#define EVENT "moelab.Event"
#define GRAPH "moelab.Graph"

typedef struct Context {
  moe_ctx *ctx; /* NULL once closed */
} Context;

/* A tensor handle.  `closed` is the Lua side (released by __gc or __close: unusable); `t` is
 * the C side.  An owner closed while views of it live keeps its moe_tensor until the last
 * view goes, so `local b <close> = ...` cannot pull the memory from under a view. */
typedef struct Tensor {
  moe_tensor *t; /* NULL until created, and after it is freed */
  int closed;
  int views; /* live views of this owner */
  int pins;  /* graphs that replay on this owner's memory (see PINS) */
} Tensor;

/* An event or a graph: the C object alone (NULL until created and once freed). */
typedef struct Handle {
  void *p;
} Handle;

/* ---- helpers ---- */

static moe_ctx *getctx(lua_State *L) {
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

static int fail(lua_State *L, moe_ctx *ctx, int rc) {
  const char *msg = moe_errmsg(ctx);
  push_caller_where(L);
  lua_pushstring(L, (msg && *msg) ? msg : moe_errstr(rc));
  lua_concat(L, 2);
  return lua_error(L);
}

/* "bad argument #arg to 'fname' (...)" under a fixed name: the user-facing names of the
 * front-end, which survive the front-end's tail calls (luaL_argerror would then print '?' or
 * 'moelab.core.x'). */
static int arg_error(lua_State *L, const char *fname, int arg, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const char *msg = lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  push_caller_where(L);
  lua_pushfstring(L, "bad argument #%d to '%s' (%s)", arg, fname, msg);
  lua_concat(L, 2);
  return lua_error(L);
}

/* The type of a value as luaL_typeerror names it (__name for userdata that have one). */
static const char *type_name(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (luaL_getmetafield(L, idx, "__name") == LUA_TSTRING) return lua_tostring(L, -1);
  if (lua_type(L, idx) == LUA_TLIGHTUSERDATA) return "light userdata";
  return luaL_typename(L, idx);
}

/* A number as its value, anything else as its type: "1.5", "string". */
static const char *got_value(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_type(L, idx) != LUA_TNUMBER) return type_name(L, idx);
  if (lua_isinteger(L, idx)) return lua_pushfstring(L, "%I", (LUAI_UACINT)lua_tointeger(L, idx));
  return lua_pushfstring(L, "%f", (LUAI_UACNUMBER)lua_tonumber(L, idx));
}

/* "is a string", "is nil", and for a number "is 1.5" or "is a number". */
static const char *is_what(lua_State *L, int idx, int value) {
  idx = lua_absindex(L, idx);
  switch (lua_type(L, idx)) {
  case LUA_TNIL: return "is nil";
  case LUA_TNUMBER: return value ? lua_pushfstring(L, "is %s", got_value(L, idx)) : "is a number";
  default: return lua_pushfstring(L, "is a %s", type_name(L, idx));
  }
}

static moe_device check_device(lua_State *L, int idx) {
  moe_device d = {MOE_CPU, 0};
  if (lua_type(L, idx) != LUA_TSTRING)
    luaL_argerror(L, idx, lua_pushfstring(L, "expected 'cpu' or 'cuda:N', got %s", type_name(L, idx)));
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

static moe_device opt_device(lua_State *L, int idx) {
  if (lua_isnoneornil(L, idx)) {
    moe_device cpu = {MOE_CPU, 0};
    return cpu;
  }
  return check_device(L, idx);
}

static void push_device(lua_State *L, moe_device d) {
  if (d.kind == MOE_CPU) lua_pushliteral(L, "cpu");
  else lua_pushfstring(L, "cuda:%d", d.index);
}

static moe_dtype check_dtype(lua_State *L, int idx) {
  static const char *const names[] = {"f32", "bf16", "i32", NULL};
  static const moe_dtype dtypes[] = {MOE_F32, MOE_BF16, MOE_I32};
  return dtypes[luaL_checkoption(L, idx, NULL, names)];
}

/* A shape: a table of 0..MOE_MAX_DIMS non-negative integers. */
static int check_shape(lua_State *L, int idx, int64_t shape[MOE_MAX_DIMS]) {
  idx = lua_absindex(L, idx);
  if (lua_type(L, idx) != LUA_TTABLE)
    luaL_argerror(L, idx, lua_pushfstring(L, "expected a shape (a table of integers), got %s", type_name(L, idx)));
  lua_Integer n = (lua_Integer)lua_rawlen(L, idx);
  if (n > MOE_MAX_DIMS)
    luaL_argerror(L, idx, lua_pushfstring(L, "shape has %I dimensions, at most %d", (LUAI_UACINT)n, MOE_MAX_DIMS));
  for (int i = 0; i < (int)n; i++) {
    lua_rawgeti(L, idx, i + 1);
    int isint = 0;
    lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
    if (!isint || v < 0)
      luaL_argerror(L, idx, lua_pushfstring(L, "shape[%d] %s, expected a non-negative integer", i + 1, is_what(L, -1, 1)));
    shape[i] = (int64_t)v;
    lua_pop(L, 1);
  }
  return (int)n;
}

/* ---- tensor handles ---- */

/* A graph replays on raw device pointers, so the memory of every tensor a capture touches must
 * outlive the graph, whatever its handles do.  While a capture is under way the registry holds
 * PINS, a set of owner handles: every owner made during it, and the owner of every tensor a
 * function is handed.  Each is pinned once (pins + 1); graph_end gives the set to the graph,
 * whose release unpins them.  Closing a pinned tensor makes its handle unusable at once; its
 * memory goes when the last graph on it does.  An exchange a captured call used is held in the
 * same set (pin_object): its windows are written and read whatever tensors the call was given. */
static const char *const PINS = "moelab.pins";

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
static void pin_object(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_getfield(L, LUA_REGISTRYINDEX, PINS) == LUA_TTABLE) {
    lua_pushvalue(L, idx);
    lua_pushboolean(L, 1);
    lua_rawset(L, -3);
  }
  lua_pop(L, 1);
}

/* Undoes the pins of a set that graph_end handed to a graph (the table at idx); its other
 * objects (pin_object) are merely let go with the set. */
static void unpin_all(lua_State *L, int idx) {
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
 * checked). */
static Tensor *new_handle(lua_State *L, int owner) {
  Tensor *u = (Tensor *)lua_newuserdatauv(L, sizeof *u, 1);
  u->t = NULL;
  u->closed = 0;
  u->views = 0;
  u->pins = 0;
  luaL_setmetatable(L, TENSOR);
  if (owner) pin(L, -1);
  return u;
}

/* The open tensor at idx (pinned into a capture under way), or NULL. */
static Tensor *open_tensor(lua_State *L, int idx) {
  Tensor *u = (Tensor *)luaL_testudata(L, idx, TENSOR);
  if (!u || u->closed || !u->t) return NULL;
  pin(L, idx);
  return u;
}

static Tensor *check_handle(lua_State *L, int idx) {
  Tensor *u = open_tensor(L, idx);
  if (!u) {
    luaL_checkudata(L, idx, TENSOR);
    luaL_argerror(L, idx, "moelab.Tensor is closed");
  }
  return u;
}

static moe_tensor *check_tensor(lua_State *L, int idx) { return check_handle(L, idx)->t; }

/* Taking the arguments may have run Lua code (an __index metamethod of an argument table; a
 * finalizer at an allocation, pinning into a capture included), which could have closed a tensor
 * already taken.  Called after the last argument is taken and the last allocation made, just
 * before the library is called: every tensor handle from stack index `from` on (where the
 * arguments are, or the fields' values are left) must still be open. */
static void args_still_open(lua_State *L, const char *fname, int from) {
  for (int i = from, top = lua_gettop(L); i <= top; i++) {
    const Tensor *u = (const Tensor *)luaL_testudata(L, i, TENSOR);
    if (u && (u->closed || !u->t))
      arg_error(L, fname, 1, "a moelab.Tensor of the arguments was closed while they were being read");
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
  moe_ctx *ctx = getctx(L);
  check_tensor(L, bi);
  Tensor *u = new_handle(L, 0);
  /* again after the allocation, whose collection step may have run a finalizer that closed it */
  moe_tensor *base = check_tensor(L, bi);
  Tensor *o = push_owner(L, bi);
  lua_setiuservalue(L, -2, 1);
  o->views++; /* counted with the link, so that releasing u undoes exactly this */
  int rc = moe_tensor_view(ctx, base, offset, ndim, shape, &u->t);
  if (rc) return fail(L, ctx, rc);
  return 1;
}

static void push_element(lua_State *L, moe_dtype dtype, const void *buf, int64_t i) {
  switch (dtype) {
  case MOE_F32: lua_pushnumber(L, (lua_Number)((const float *)buf)[i]); break;
  case MOE_BF16: lua_pushnumber(L, (lua_Number)moe_bf16_to_f32(((const uint16_t *)buf)[i])); break;
  case MOE_I32: lua_pushinteger(L, (lua_Integer)((const int32_t *)buf)[i]); break;
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
  size_t nbytes = moe_tensor_nbytes(check_tensor(L, idx));
  void *buf = lua_newuserdatauv(L, nbytes ? nbytes : 1, 0);
  moe_tensor *t = check_tensor(L, idx); /* again: the allocation may have run a finalizer */
  l->ndim = moe_tensor_ndim(t);
  for (int i = 0; i < l->ndim; i++) l->shape[i] = moe_tensor_dim(t, i);
  l->numel = moe_tensor_numel(t);
  l->dtype = moe_tensor_dtype(t);
  int rc = moe_tensor_read(ctx, t, buf, nbytes);
  if (rc) fail(L, ctx, rc);
  return buf;
}

static int t_index(lua_State *L) {
  Tensor *u = (Tensor *)luaL_checkudata(L, 1, TENSOR);
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL || lua_type(L, 2) != LUA_TSTRING) return 1;
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
  case 3: push_device(L, moe_tensor_device(t)); break;
  default: lua_pushinteger(L, moe_tensor_ndim(t)); break;
  }
  return 1;
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
  push_device(L, moe_tensor_device(t));
  luaL_addvalue(&b);
  luaL_addchar(&b, ')');
  luaL_pushresult(&b);
  return 1;
}

/* ---- tensor methods ---- */

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
  moe_ctx *ctx = getctx(L);
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
  moe_ctx *ctx = getctx(L);
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
  moe_ctx *ctx = getctx(L);
  moe_tensor *t = check_tensor(L, 1);
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
  union { float f; uint16_t h; int32_t i; } one;
  moe_tensor *v = NULL;
  int rc = moe_tensor_view(ctx, t, (int64_t)(i - 1), 0, NULL, &v);
  if (!rc) rc = moe_tensor_read(ctx, v, &one, moe_dtype_size(dtype));
  moe_tensor_free(v);
  if (rc) return fail(L, ctx, rc);
  push_element(L, dtype, &one, 0);
  return 1;
}

static int t_to(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *src = check_tensor(L, 1);
  moe_device dev = check_device(L, 2);
  int nd = moe_tensor_ndim(src);
  int64_t shape[MOE_MAX_DIMS];
  for (int i = 0; i < nd; i++) shape[i] = moe_tensor_dim(src, i);
  Tensor *u = new_handle(L, 1);
  src = check_tensor(L, 1); /* again: the allocation may have run a finalizer that closed it */
  int rc = moe_tensor_new(ctx, moe_tensor_dtype(src), nd, shape, dev, &u->t);
  if (!rc) rc = moe_tensor_copy(ctx, u->t, src);
  if (rc) return fail(L, ctx, rc);
  return 1;
}

static int t_copy(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *dst = check_tensor(L, 1), *src = check_tensor(L, 2);
  args_still_open(L, "copy", 1); /* pinning src into a capture may have run a finalizer */
  int rc = moe_tensor_copy(ctx, dst, src);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int t_fill(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *t = check_tensor(L, 1);
  lua_Number v = luaL_checknumber(L, 2);
  int rc = moe_tensor_fill(ctx, t, (double)v);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int t_randn(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *t = check_tensor(L, 1);
  uint64_t seed = (uint64_t)luaL_checkinteger(L, 2);
  float std = (float)luaL_optnumber(L, 3, 1.0);
  int rc = moe_tensor_randn(ctx, t, seed, std);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int t_view(lua_State *L) {
  check_tensor(L, 1);
  lua_Integer offset = luaL_checkinteger(L, 2);
  int64_t shape[MOE_MAX_DIMS];
  int nd = check_shape(L, 3, shape);
  return push_view(L, 1, (int64_t)offset, nd, shape);
}

static int t_select(lua_State *L) {
  moe_tensor *t = check_tensor(L, 1);
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
  lua_pushinteger(L, (lua_Integer)moe_tensor_numel(check_tensor(L, 1)));
  return 1;
}

static int t_nbytes(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)moe_tensor_nbytes(check_tensor(L, 1)));
  return 1;
}

static int t_address(lua_State *L) {
  lua_pushlightuserdata(L, moe_tensor_data(check_tensor(L, 1)));
  return 1;
}

/* t:overlaps(u): whether the two share a byte (same device, intersecting address ranges). */
static int t_overlaps(lua_State *L) {
  moe_tensor *a = check_tensor(L, 1), *b = check_tensor(L, 2);
  const moe_device da = moe_tensor_device(a), db = moe_tensor_device(b);
  const uintptr_t pa = (uintptr_t)moe_tensor_data(a), pb = (uintptr_t)moe_tensor_data(b);
  const size_t na = moe_tensor_nbytes(a), nb = moe_tensor_nbytes(b);
  lua_pushboolean(L, da.kind == db.kind && (da.kind == MOE_CPU || da.index == db.index) && na && nb &&
                         pa < pb + nb && pb < pa + na);
  return 1;
}

/* ---- module functions: tensors ---- */

static int l_device_count(lua_State *L) {
  static const char *const kinds[] = {"cpu", "cuda", NULL};
  moe_ctx *ctx = getctx(L);
  int kind = luaL_checkoption(L, 1, NULL, kinds) == 0 ? MOE_CPU : MOE_CUDA;
  int n = 0;
  int rc = moe_device_count(ctx, kind, &n);
  if (rc) return fail(L, ctx, rc);
  lua_pushinteger(L, n);
  return 1;
}

/* core.config(option) -> value; core.config(option, value) sets it (moe_ctx_config). */
static int l_config(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  const char *option = luaL_checkstring(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    int rc = moe_ctx_config(ctx, option, luaL_checkstring(L, 2));
    if (rc) return fail(L, ctx, rc);
  }
  const char *value = moe_ctx_config_value(ctx, option);
  if (!value) return luaL_argerror(L, 1, lua_pushfstring(L, "no option '%s'", option));
  lua_pushstring(L, value);
  return 1;
}

static int l_new(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_dtype dtype = check_dtype(L, 1);
  int64_t shape[MOE_MAX_DIMS];
  int nd = check_shape(L, 2, shape);
  moe_device dev = opt_device(L, 3);
  Tensor *u = new_handle(L, 1);
  int rc = moe_tensor_new(ctx, dtype, nd, shape, dev, &u->t);
  /* host memory comes zeroed; device memory is zeroed here */
  if (!rc && dev.kind != MOE_CPU) rc = moe_tensor_fill(ctx, u->t, 0.0);
  if (rc) return fail(L, ctx, rc);
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

#define DATA_ERROR(L, ...) arg_error((L), "tensor", 1, __VA_ARGS__)

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
    DATA_ERROR(L, "%s %s, expected a number", element_name(f, depth), is_what(L, idx, 0));
  if (f->dtype == MOE_I32) {
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, idx, &isint);
    if (!isint)
      DATA_ERROR(L, "%s %s, expected an integer for dtype i32", element_name(f, depth), is_what(L, idx, 1));
    if (v < INT32_MIN || v > INT32_MAX)
      DATA_ERROR(L, "%s is %I, outside the range of i32", element_name(f, depth), (LUAI_UACINT)v);
    if (f->buf) ((int32_t *)f->buf)[f->pos] = (int32_t)v;
  } else if (f->buf) {
    /* rounded to f32 first, as moe_tensor_fill rounds */
    float x = (float)lua_tonumber(L, idx);
    if (f->dtype == MOE_F32) ((float *)f->buf)[f->pos] = x;
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
        DATA_ERROR(L, "%s %s, expected a table", element_name(f, level + 1), is_what(L, top, 0));
      walk(f, top, level + 1);
    } else {
      put_number(f, top, level + 1);
    }
    lua_pop(L, 1);
  }
}

static int l_from_table(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  Fill f;
  memset(&f, 0, sizeof f);
  f.L = L;
  f.dtype = check_dtype(L, 2);
  moe_device dev = opt_device(L, 3);
  int64_t shape[MOE_MAX_DIMS] = {0};
  int nd = 0;
  int64_t numel = 1;
  int given = !lua_isnoneornil(L, 4);
  if (given) {
    nd = check_shape(L, 4, shape);
    for (int i = 0; i < nd; i++) {
      if (shape[i] > 0 && numel > ((int64_t)1 << 40) / shape[i])
        luaL_argerror(L, 4, "shape has more than 2^40 elements");
      numel *= shape[i];
    }
    if (lua_type(L, 1) != LUA_TTABLE)
      DATA_ERROR(L, "expected a flat table of numbers, got %s", type_name(L, 1));
    lua_Integer n = (lua_Integer)lua_rawlen(L, 1);
    if (n != numel) DATA_ERROR(L, "expected %I numbers for the shape given, got %I", (LUAI_UACINT)numel, (LUAI_UACINT)n);
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
    DATA_ERROR(L, "expected a number or a nested table of numbers, got %s", type_name(L, 1));
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

  Tensor *u = new_handle(L, 1);
  int rc = moe_tensor_new(ctx, f.dtype, nd, shape, dev, &u->t);
  if (!rc) rc = moe_tensor_write(ctx, u->t, lua_touserdata(L, bufidx), nbytes);
  if (rc) return fail(L, ctx, rc);
  return 1;
}

static int l_is_tensor(lua_State *L) {
  lua_pushboolean(L, luaL_testudata(L, 1, TENSOR) != NULL);
  return 1;
}

static int l_synchronize(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_device dev = check_device(L, 1);
  int rc = moe_ctx_synchronize(ctx, dev);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* ---- stage arguments: one table of named fields at index 1 ----
 * Every value fetched stays on the stack until the call returns, so nothing the C call sees
 * can be collected under it; that none was closed while they were read, args_still_open checks. */

typedef struct Args {
  lua_State *L;
  const char *fname;
} Args;

enum { REQUIRED = 0, OPTIONAL = 1 };

static Args args_open(lua_State *L, const char *fname) {
  Args a = {L, fname};
  if (lua_type(L, 1) != LUA_TTABLE) arg_error(L, fname, 1, "table expected, got %s", type_name(L, 1));
  lua_settop(L, 1);
  luaL_checkstack(L, 40, "too many arguments");
  return a;
}

static const moe_tensor *tensor_at(Args *a, int idx, const char *field) {
  lua_State *L = a->L;
  Tensor *u = open_tensor(L, idx);
  if (!u && !luaL_testudata(L, idx, TENSOR))
    arg_error(L, a->fname, 1, "field '%s': expected moelab.Tensor, got %s", field, type_name(L, idx));
  if (!u) arg_error(L, a->fname, 1, "field '%s': moelab.Tensor is closed", field);
  return u->t;
}

static moe_tensor *tensor_field(Args *a, const char *field, int optional) {
  if (lua_getfield(a->L, 1, field) == LUA_TNIL && optional) return NULL;
  return (moe_tensor *)tensor_at(a, lua_gettop(a->L), field);
}

static int int_field(Args *a, const char *field, int optional, int dflt) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL && optional) return dflt;
  int isint = 0;
  lua_Integer v = ty == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
  if (!isint) arg_error(L, a->fname, 1, "field '%s': expected an integer, got %s", field, got_value(L, -1));
  if (v < INT32_MIN || v > INT32_MAX)
    arg_error(L, a->fname, 1, "field '%s': %I is outside the range of a C int", field, (LUAI_UACINT)v);
  return (int)v;
}

static double number_field(Args *a, const char *field, double dflt) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL) return dflt;
  if (ty != LUA_TNUMBER) arg_error(L, a->fname, 1, "field '%s': expected a number, got %s", field, type_name(L, -1));
  return (double)lua_tonumber(L, -1);
}

static int bool_field(Args *a, const char *field) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL) return 0;
  if (ty != LUA_TBOOLEAN) arg_error(L, a->fname, 1, "field '%s': expected a boolean, got %s", field, got_value(L, -1));
  return lua_toboolean(L, -1);
}

/* The index of the field's string in names (nil: 0); `expected` spells the choices. */
static int option_field(Args *a, const char *field, const char *const names[], const char *expected) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL) return 0;
  if (ty == LUA_TSTRING) {
    const char *s = lua_tostring(L, -1);
    for (int i = 0; names[i]; i++)
      if (strcmp(names[i], s) == 0) return i;
    arg_error(L, a->fname, 1, "field '%s': expected %s, got '%s'", field, expected, s);
  }
  return arg_error(L, a->fname, 1, "field '%s': expected %s, got %s", field, expected, type_name(L, -1));
}

/* A table of exactly `world` tensors, as a C array in a scratch userdata. */
static const moe_tensor *const *tensors_field(Args *a, const char *field, int world) {
  lua_State *L = a->L;
  if (lua_getfield(L, 1, field) != LUA_TTABLE)
    arg_error(L, a->fname, 1, "field '%s': expected a table of %d moelab.Tensor (one per rank), got %s", field, world,
              type_name(L, -1));
  int tbl = lua_gettop(L);
  lua_Integer n = (lua_Integer)lua_rawlen(L, tbl);
  if (n != world)
    arg_error(L, a->fname, 1, "field '%s': expected %d tensors (world), got %I", field, world, (LUAI_UACINT)n);
  luaL_checkstack(L, world + 8, "too many tensors"); /* + the scratch and pin()'s four */
  const moe_tensor **ts = (const moe_tensor **)lua_newuserdatauv(L, (size_t)world * sizeof *ts, 0);
  for (int i = 0; i < world; i++) {
    lua_rawgeti(L, tbl, i + 1);
    Tensor *u = open_tensor(L, -1);
    if (!u) {
      const char *name = lua_pushfstring(L, "%s[%d]", field, i + 1);
      tensor_at(a, -2, name); /* raises */
    }
    ts[i] = u->t;
  }
  return ts;
}

static int world_field(Args *a) {
  int w = int_field(a, "world", REQUIRED, 0);
  if (w < 1) arg_error(a->L, a->fname, 1, "field 'world': expected a positive integer, got %d", w);
  return w;
}

/* ---- stages ---- */

static int l_route(lua_State *L) {
  static const char *const scorings[] = {"softmax", "sigmoid", "sqrtsoftplus", NULL};
  moe_ctx *ctx = getctx(L);
  Args A = args_open(L, "route");
  moe_route_args a;
  memset(&a, 0, sizeof a);
  a.ids = tensor_field(&A, "ids", REQUIRED);
  a.weights = tensor_field(&A, "weights", REQUIRED);
  a.stats = tensor_field(&A, "stats", OPTIONAL);
  a.logits = tensor_field(&A, "logits", REQUIRED);
  a.bias = tensor_field(&A, "bias", OPTIONAL);
  a.k = int_field(&A, "k", REQUIRED, 0);
  a.scoring = option_field(&A, "scoring", scorings, "'softmax', 'sigmoid' or 'sqrtsoftplus'");
  a.groups = int_field(&A, "groups", OPTIONAL, 1);
  a.topk_groups = int_field(&A, "topk_groups", OPTIONAL, a.groups);
  a.scale = (float)number_field(&A, "scale", 1.0);
  args_still_open(L, A.fname, 2);
  int rc = moe_route(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* core.schedule{...} runs the stage; core.schedule_explain{...} takes the same fields and returns
 * moe_schedule_explain's report (which kernel the call would run, and why) without running it. */
static int schedule_call(lua_State *L, const char *name, int explain) {
  static const char *const layouts[] = {"roundrobin", "peer_major", NULL};
  moe_ctx *ctx = getctx(L);
  Args A = args_open(L, name);
  moe_schedule_args a;
  memset(&a, 0, sizeof a);
  a.peer_rank = tensor_field(&A, "peer_rank", REQUIRED);
  a.peer_route = tensor_field(&A, "peer_route", REQUIRED);
  a.counts = tensor_field(&A, "counts", REQUIRED);
  a.tokens_per_expert = tensor_field(&A, "tokens_per_expert", REQUIRED);
  a.expert_offsets = tensor_field(&A, "expert_offsets", REQUIRED);
  a.route_row = tensor_field(&A, "route_row", REQUIRED);
  a.stats = tensor_field(&A, "stats", REQUIRED);
  a.ids = tensor_field(&A, "ids", REQUIRED);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  a.rank = int_field(&A, "rank", REQUIRED, 0);
  a.pad = int_field(&A, "pad", OPTIONAL, 1);
  a.capacity = int_field(&A, "capacity", REQUIRED, 0);
  a.expert_capacity = int_field(&A, "expert_capacity", OPTIONAL, -1);
  a.layout = option_field(&A, "layout", layouts, "'roundrobin' or 'peer_major'") == 0 ? MOE_LAYOUT_ROUNDROBIN
                                                                                     : MOE_LAYOUT_PEER_MAJOR;
  args_still_open(L, A.fname, 2);
  if (explain) {
    char report[1024];
    int rc = moe_schedule_explain(ctx, &a, report, sizeof report);
    if (rc) return fail(L, ctx, rc);
    lua_pushstring(L, report);
    return 1;
  }
  int rc = moe_schedule(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

static int l_schedule(lua_State *L) { return schedule_call(L, "schedule", 0); }
static int l_schedule_explain(lua_State *L) { return schedule_call(L, "schedule_explain", 1); }

static int l_dispatch(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  Args A = args_open(L, "dispatch");
  moe_dispatch_args a;
  memset(&a, 0, sizeof a);
  a.xs = tensor_field(&A, "xs", REQUIRED);
  a.x = tensor_field(&A, "x", REQUIRED);
  a.peer_rank = tensor_field(&A, "peer_rank", REQUIRED);
  a.peer_route = tensor_field(&A, "peer_route", REQUIRED);
  a.k = int_field(&A, "k", REQUIRED, 0);
  a.zero_fill = bool_field(&A, "zero_fill");
  args_still_open(L, A.fname, 2);
  int rc = moe_dispatch(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* The table of core.experts{...} and core.experts_explain{...}. */
static moe_experts_args experts_fields(lua_State *L, const char *name) {
  Args A = args_open(L, name);
  moe_experts_args a;
  memset(&a, 0, sizeof a);
  a.ys = tensor_field(&A, "ys", REQUIRED);
  a.xs = tensor_field(&A, "xs", REQUIRED);
  a.expert_offsets = tensor_field(&A, "expert_offsets", REQUIRED);
  a.w_gate_up = tensor_field(&A, "w_gate_up", REQUIRED);
  a.w_down = tensor_field(&A, "w_down", REQUIRED);
  args_still_open(L, A.fname, 2);
  return a;
}

static int l_experts(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_experts_args a = experts_fields(L, "experts");
  int rc = moe_experts(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* core.experts_explain{...} -> the report of moe_experts_explain: which kernel would run, and why. */
static int l_experts_explain(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_experts_args a = experts_fields(L, "experts_explain");
  char report[2048];
  int rc = moe_experts_explain(ctx, &a, report, sizeof report);
  if (rc) return fail(L, ctx, rc);
  lua_pushstring(L, report);
  return 1;
}

static int l_logits(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *out = check_tensor(L, 1), *x = check_tensor(L, 2), *w = check_tensor(L, 3);
  args_still_open(L, "logits", 1); /* pinning one into a capture may have run a finalizer */
  int rc = moe_logits(ctx, out, x, w);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

static int l_sigmoid_gate(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_tensor *g = check_tensor(L, 1), *x = check_tensor(L, 2), *w = check_tensor(L, 3);
  args_still_open(L, "sigmoid_gate", 1); /* as in l_logits */
  int rc = moe_sigmoid_gate(ctx, g, x, w);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

static int l_combine(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  Args A = args_open(L, "combine");
  moe_combine_args a;
  memset(&a, 0, sizeof a);
  a.out = tensor_field(&A, "out", REQUIRED);
  a.weights = tensor_field(&A, "weights", REQUIRED);
  a.ids = tensor_field(&A, "ids", REQUIRED);
  a.world = world_field(&A);
  a.ys = tensors_field(&A, "ys", a.world);
  a.route_row = tensors_field(&A, "route_row", a.world);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  a.rank = int_field(&A, "rank", REQUIRED, 0);
  a.shared = tensor_field(&A, "shared", OPTIONAL);
  a.shared_gate = tensor_field(&A, "shared_gate", OPTIONAL);
  args_still_open(L, A.fname, 2);
  int rc = moe_combine(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

static int l_reference(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  Args A = args_open(L, "reference");
  moe_reference_args a;
  memset(&a, 0, sizeof a);
  a.out = tensor_field(&A, "out", REQUIRED);
  a.x = tensor_field(&A, "x", REQUIRED);
  a.ids = tensor_field(&A, "ids", REQUIRED);
  a.weights = tensor_field(&A, "weights", REQUIRED);
  a.world = world_field(&A);
  a.w_gate_up = tensors_field(&A, "w_gate_up", a.world);
  a.w_down = tensors_field(&A, "w_down", a.world);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  a.shared_gate_up = tensor_field(&A, "shared_gate_up", OPTIONAL);
  a.shared_down = tensor_field(&A, "shared_down", OPTIONAL);
  a.shared_gate_w = tensor_field(&A, "shared_gate_w", OPTIONAL);
  args_still_open(L, A.fname, 2);
  int rc = moe_reference(ctx, &a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* ---- timing events and CUDA graphs ---- */

static int l_now(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
  return 1;
}

/* core.sleep(seconds): the thread sleeps (a rank waiting for the id file rank 0 writes) */
static int l_sleep(lua_State *L) {
  lua_Number sec = luaL_checknumber(L, 1);
  luaL_argcheck(L, sec == sec && sec <= 1e9, 1, "seconds must be a number up to 1e9"); /* fits a time_t */
  if (sec > 0) {
    struct timespec ts;
    ts.tv_sec = (time_t)sec;
    ts.tv_nsec = (long)((sec - (lua_Number)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  return 0;
}

static Handle *new_object(lua_State *L, const char *tname) {
  Handle *h = (Handle *)lua_newuserdatauv(L, sizeof *h, 1);
  h->p = NULL;
  luaL_setmetatable(L, tname);
  return h;
}

static void *check_object(lua_State *L, int idx, const char *tname) {
  Handle *h = (Handle *)luaL_checkudata(L, idx, tname);
  if (!h->p) luaL_argerror(L, idx, lua_pushfstring(L, "%s is closed", tname));
  return h->p;
}

static int l_event_new(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_device dev = check_device(L, 1);
  Handle *h = new_object(L, EVENT);
  moe_event *e = NULL;
  int rc = moe_event_new(ctx, dev, &e);
  h->p = e;
  if (rc) return fail(L, ctx, rc);
  return 1;
}

static int e_release(lua_State *L) {
  Handle *h = (Handle *)luaL_testudata(L, 1, EVENT);
  if (h && h->p) {
    moe_event_free((moe_event *)h->p);
    h->p = NULL;
  }
  return 0;
}

static int e_tostring(lua_State *L) {
  Handle *h = (Handle *)luaL_checkudata(L, 1, EVENT);
  lua_pushstring(L, h->p ? "moelab.Event" : "moelab.Event(closed)");
  return 1;
}

static int e_record(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_event *e = (moe_event *)check_object(L, 1, EVENT);
  int rc = moe_event_record(ctx, e);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

/* stop:elapsed_since(start) -> milliseconds; waits for stop */
static int e_elapsed_since(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_event *stop = (moe_event *)check_object(L, 1, EVENT);
  moe_event *start = (moe_event *)check_object(L, 2, EVENT);
  float ms = 0;
  int rc = moe_event_elapsed(ctx, start, stop, &ms);
  if (rc) return fail(L, ctx, rc);
  lua_pushnumber(L, (lua_Number)ms);
  return 1;
}

static int l_graph_begin(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_device dev = check_device(L, 1);
  int rc = moe_graph_begin(ctx, dev);
  if (rc) return fail(L, ctx, rc);
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, PINS);
  return 0;
}

/* graph_end([keep]) -> Graph; keep (any value, say a table of the captured tensors) is held
 * by the graph as long as it lives, and so are the capture's pins (PINS), undone with it. */
static int l_graph_end(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  lua_settop(L, 1);
  /* what can fail for want of memory first, so that the pins never sit in a table nobody undoes */
  Handle *h = new_object(L, GRAPH);
  lua_createtable(L, 2, 0); /* {keep, the pinned owners} */
  lua_pushvalue(L, 1);
  lua_rawseti(L, 3, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, PINS);
  lua_rawseti(L, 3, 2);
  lua_setiuservalue(L, 2, 1);
  lua_pushnil(L);
  lua_setfield(L, LUA_REGISTRYINDEX, PINS);
  moe_graph *g = NULL;
  int rc = moe_graph_end(ctx, &g);
  h->p = g;
  if (rc) return fail(L, ctx, rc);
  return 1;
}

/* __gc and __close: the graph first, then its pins (once: the set is dropped after). */
static int g_release(lua_State *L) {
  Handle *h = (Handle *)luaL_testudata(L, 1, GRAPH);
  if (!h) return 0;
  if (h->p) {
    moe_graph_free((moe_graph *)h->p);
    h->p = NULL;
  }
  if (lua_getiuservalue(L, 1, 1) == LUA_TTABLE) {
    if (lua_rawgeti(L, -1, 2) == LUA_TTABLE) unpin_all(L, -1);
    lua_pop(L, 1);
    lua_pushnil(L);
    lua_rawseti(L, -2, 2);
  }
  lua_pop(L, 1);
  return 0;
}

static int g_tostring(lua_State *L) {
  Handle *h = (Handle *)luaL_checkudata(L, 1, GRAPH);
  lua_pushstring(L, h->p ? "moelab.Graph" : "moelab.Graph(closed)");
  return 1;
}

static int g_replay(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_graph *g = (moe_graph *)check_object(L, 1, GRAPH);
  int rc = moe_graph_replay(ctx, g);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

/* ---- expert parallelism across GPUs: moelab.World ----
 * A "moelab.World" userdata holds a moe_world.  Functions of each local rank take a table with
 * one entry per local rank (in moe_world_local_rank order); field errors name the entry. */

#define WORLD "moelab.World"

typedef struct World {
  moe_world *w; /* NULL once closed */
} World;

static moe_world *check_world(lua_State *L, int idx) {
  World *u = (World *)luaL_checkudata(L, idx, WORLD);
  if (!u->w) luaL_argerror(L, idx, "moelab.World is closed");
  return u->w;
}

/* The field of the table at tbl as a tensor (left on the stack); entry is 1-based, 0 = none. */
static moe_tensor *w_tensor(lua_State *L, const char *fname, int tbl, int entry, const char *field, int optional) {
  int ty = lua_getfield(L, tbl, field);
  if (ty == LUA_TNIL && optional) return NULL;
  Tensor *u = open_tensor(L, -1);
  if (!u) {
    if (entry) arg_error(L, fname, 1, "entry %d, field '%s': expected an open moelab.Tensor, got %s", entry, field,
                         type_name(L, -1));
    arg_error(L, fname, 1, "field '%s': expected an open moelab.Tensor, got %s", field, type_name(L, -1));
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
    if (entry) arg_error(L, fname, 1, "entry %d, field '%s': expected an integer, got %s", entry, field, got_value(L, -1));
    arg_error(L, fname, 1, "field '%s': expected an integer, got %s", field, got_value(L, -1));
  }
  lua_pop(L, 1);
  return (int)v;
}

/* The table at idx has exactly n entries, each a table; returns n. */
static void w_entries(lua_State *L, const char *fname, int idx, int n, const char *what) {
  if (lua_type(L, idx) != LUA_TTABLE)
    arg_error(L, fname, 1, "expected a table of %d %s (one per local rank), got %s", n, what, type_name(L, idx));
  lua_Integer got = (lua_Integer)lua_rawlen(L, idx);
  if (got != n) arg_error(L, fname, 1, "expected %d %s (one per local rank), got %I", n, what, (LUAI_UACINT)got);
  for (int i = 1; i <= n; i++) {
    if (lua_rawgeti(L, idx, i) != LUA_TTABLE)
      arg_error(L, fname, 1, "entry %d: expected a table, got %s", i, type_name(L, -1));
    lua_pop(L, 1);
  }
}

static void *scratch(lua_State *L, size_t n) { return lua_newuserdatauv(L, n ? n : 1, 0); }

/* core.world_unique_id() -> hex */
static int l_world_unique_id(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  char hex[MOE_WORLD_ID_HEX + 1];
  int rc = moe_world_unique_id(ctx, hex, sizeof hex);
  if (rc) return fail(L, ctx, rc);
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
  moe_ctx *ctx = getctx(L);
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n < 1) return arg_error(L, "world", 1, "option 'devices' must list at least one GPU");
  int *devs = (int *)scratch(L, (size_t)n * sizeof *devs);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    if (!isint || v < 0 || v > INT32_MAX)
      return arg_error(L, "world", 1, "devices[%d] must be a GPU index >= 0, got %s", i + 1, got_value(L, -1));
    devs[i] = (int)v;
    lua_pop(L, 1);
  }
  World *u = new_world(L);
  int rc = moe_world_open_local(ctx, n, devs, &u->w);
  if (rc) return fail(L, ctx, rc);
  return 1;
}

/* core.world_open_rank(rank, size, device, hex) -> World */
static int l_world_open_rank(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  lua_Integer rank = luaL_checkinteger(L, 1), size = luaL_checkinteger(L, 2), dev = luaL_checkinteger(L, 3);
  const char *hex = luaL_checkstring(L, 4);
  if (rank < INT32_MIN || rank > INT32_MAX || size < INT32_MIN || size > INT32_MAX || dev < INT32_MIN || dev > INT32_MAX)
    return arg_error(L, "world", 1, "rank, size and device must fit a C int");
  World *u = new_world(L);
  int rc = moe_world_open_rank(ctx, (int)rank, (int)size, (int)dev, hex, &u->w);
  if (rc) return fail(L, ctx, rc);
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
    lua_pushfstring(L, "%s rank %d on cuda:%d", i ? "," : "", moe_world_local_rank(u->w, i), moe_world_local_device(u->w, i));
    luaL_addvalue(&b);
  }
  luaL_addstring(&b, ")");
  luaL_pushresult(&b);
  return 1;
}

static int w_size(lua_State *L) {
  lua_pushinteger(L, moe_world_size(check_world(L, 1)));
  return 1;
}

/* ranks() -> {global rank, ...}; devices() -> {"cuda:N", ...}, both in local order */
static int w_ranks(lua_State *L) {
  moe_world *w = check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushinteger(L, moe_world_local_rank(w, i));
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int w_devices(lua_State *L) {
  moe_world *w = check_world(L, 1);
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
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  lua_Integer i = luaL_optinteger(L, 2, 1);
  if (i < 1 || i > moe_world_local_count(w))
    return arg_error(L, "bind", 1, "local rank must be in [1, %d], got %I", moe_world_local_count(w), (LUAI_UACINT)i);
  int rc = moe_world_bind(ctx, w, (int)i - 1);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static int w_unbind(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  int rc = moe_world_unbind(ctx, w);
  if (rc) return fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

/* allgather(outs, ins) and allgather_ids(all_ids, ids): tables of one tensor per local rank */
static int gather_call(lua_State *L, const char *fname, int ids) {
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  int n = moe_world_local_count(w);
  lua_settop(L, 3);
  luaL_checkstack(L, 2 * n + 8, "too many ranks");
  for (int a = 2; a <= 3; a++) {
    if (lua_type(L, a) != LUA_TTABLE || (int)lua_rawlen(L, a) != n)
      return arg_error(L, fname, a - 1, "expected a table of %d moelab.Tensor (one per local rank), got %s", n,
                       type_name(L, a));
  }
  moe_tensor **out = (moe_tensor **)scratch(L, (size_t)n * sizeof *out);
  const moe_tensor **in = (const moe_tensor **)scratch(L, (size_t)n * sizeof *in);
  for (int i = 0; i < n; i++) {
    for (int a = 2; a <= 3; a++) {
      lua_rawgeti(L, a, i + 1);
      Tensor *u = open_tensor(L, -1);
      if (!u)
        return arg_error(L, fname, a - 1, "entry %d: expected an open moelab.Tensor, got %s", i + 1, type_name(L, -1));
      if (a == 2) out[i] = u->t;
      else in[i] = u->t;
      lua_pop(L, 1);
    }
  }
  int rc = ids ? moe_world_allgather_ids(ctx, w, out, in) : moe_world_allgather(ctx, w, out, in);
  if (rc) return fail(L, ctx, rc);
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
      const char *what = k ? lua_pushfstring(L, "'%s'", k) : lua_pushfstring(L, "(a %s key)", type_name(L, -1));
      arg_error(L, fname, 1,
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
    if (found < 0) arg_error(L, fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got '%s'", entry, s);
    c->layout = found;
  } else if (!lua_isnil(L, -1)) {
    arg_error(L, fname, 1, "entry %d, field 'layout': expected 'roundrobin' or 'peer_major', got %s", entry, type_name(L, -1));
  }
  lua_pop(L, 1);
}

/* check_config({cfg, ...}): one configuration table per local rank */
static int w_check_config(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
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
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* core.world_compare_configs(rank, {cfg, ...}): the comparison alone (no GPU), rank 0-based */
static int l_world_compare_configs(lua_State *L) {
  moe_ctx *ctx = getctx(L);
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
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* The dispatch arguments of n local ranks from the table at index 2 (left on the stack); the
 * all-gather exchange needs x_all, the direct one route_row. */
static moe_world_dispatch_args *dispatch_args(lua_State *L, int n, int direct) {
  w_entries(L, "dispatch", 2, n, "argument tables");
  luaL_checkstack(L, 9 * n + 8, "too many ranks");
  moe_world_dispatch_args *a = (moe_world_dispatch_args *)scratch(L, (size_t)n * sizeof *a);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    int t = lua_gettop(L);
    memset(&a[i], 0, sizeof a[i]);
    a[i].xs = w_tensor(L, "dispatch", t, i + 1, "xs", REQUIRED);
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

/* dispatch({{xs=, x_all=, x=, peer_rank=, peer_route=, k=, zero_fill=}, ...}) */
static int w_dispatch(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  lua_settop(L, 2);
  moe_world_dispatch_args *a = dispatch_args(L, moe_world_local_count(w), 0);
  args_still_open(L, "dispatch", 3);
  int rc = moe_world_dispatch(ctx, w, a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* The combine arguments of n local ranks from the table at index 2 (left on the stack); the
 * direct exchange needs no send and receive scratch. */
static moe_world_combine_args *combine_args(lua_State *L, int n, int direct) {
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
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  lua_settop(L, 2);
  moe_world_combine_args *a = combine_args(L, moe_world_local_count(w), 0);
  args_still_open(L, "combine", 3);
  int rc = moe_world_combine(ctx, w, a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

/* ---- the direct exchange: moelab.Exchange ----
 * Its user value is the World (kept alive, and checked open before each call).  Its windows'
 * x and ys are plain tensor handles whose memory is the exchange's: a weak-keyed table in the
 * registry maps each of them to the exchange, so the exchange outlives every handle of its
 * memory (and every view of those, which keep their owner), and a graph that captured one of
 * its calls holds it too (pin_object).  The windows go with the exchange at collection; the
 * world's own close waits for them (moe_world_close). */

#define EXCHANGE "moelab.Exchange"

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
static int w_exchange(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  moe_world *w = check_world(L, 1);
  lua_Integer T = luaL_checkinteger(L, 2), K = luaL_checkinteger(L, 3), H = luaL_checkinteger(L, 4),
              C = luaL_checkinteger(L, 5);
  if (K < 1 || K > INT32_MAX) return arg_error(L, "exchange", 2, "k must be in [1, %d], got %I", INT32_MAX, (LUAI_UACINT)K);
  Exchange *u = (Exchange *)lua_newuserdatauv(L, sizeof *u, 1);
  u->ex = NULL;
  luaL_setmetatable(L, EXCHANGE);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  int xi = lua_gettop(L);
  int rc = moe_world_exchange_open(ctx, w, (int64_t)T, (int)K, (int64_t)H, (int64_t)C, &u->ex);
  if (rc) return fail(L, ctx, rc);
  int n = moe_world_local_count(w);
  lua_getfield(L, LUA_REGISTRYINDEX, window_owner_key);
  int owners = lua_gettop(L);
  lua_createtable(L, n, 0);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    moe_tensor *views[2] = {NULL, NULL};
    rc = moe_world_exchange_views(ctx, u->ex, i, &views[0], &views[1]);
    if (rc) return fail(L, ctx, rc);
    for (int j = 0; j < 2; j++) {
      Tensor *t = new_handle(L, 1);
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
  moe_ctx *ctx = getctx(L);
  int n;
  moe_world_exchange *ex = check_exchange(L, 1, &n);
  pin_object(L, 1); /* a graph of this call writes into the windows, whatever x and xs are */
  lua_settop(L, 2);
  moe_world_dispatch_args *a = dispatch_args(L, n, 1);
  args_still_open(L, "dispatch", 3);
  int rc = moe_world_exchange_dispatch(ctx, ex, a);
  if (rc) return fail(L, ctx, rc);
  return 0;
}

static int x_combine(lua_State *L) {
  moe_ctx *ctx = getctx(L);
  int n;
  moe_world_exchange *ex = check_exchange(L, 1, &n);
  pin_object(L, 1); /* a graph of this call reads the peers' windows, whatever y is */
  lua_settop(L, 2);
  moe_world_combine_args *a = combine_args(L, n, 1);
  args_still_open(L, "combine", 3);
  int rc = moe_world_exchange_combine(ctx, ex, a);
  if (rc) return fail(L, ctx, rc);
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
  {"combine", w_combine},
  {"exchange", w_exchange},
  {NULL, NULL}
};

static const luaL_Reg world_funcs[] = {
  {"world_unique_id", l_world_unique_id},
  {"world_open_local", l_world_open_local},
  {"world_open_rank", l_world_open_rank},
  {"world_compare_configs", l_world_compare_configs},
  {NULL, NULL}
};

/* The World class (its finalizer needs the context too: it unbinds it) and its functions, into
 * the module table at mod. */
static void open_world(lua_State *L, int ctxi, int mod) {
  luaL_newmetatable(L, WORLD);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, world_meta, 1);
  lua_newtable(L);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, world_methods, 1);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  luaL_newmetatable(L, EXCHANGE);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, exchange_meta, 1);
  lua_newtable(L);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, exchange_methods, 1);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  lua_newtable(L); /* window tensor handle -> its exchange, weak keys (an ephemeron table) */
  lua_newtable(L);
  lua_pushliteral(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, window_owner_key);
  lua_pushvalue(L, mod);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, world_funcs, 1);
  lua_pop(L, 1);
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

static const luaL_Reg tensor_meta[] = {
  {"__gc", t_release},
  {"__close", t_release},
  {"__tostring", t_tostring},
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
  {NULL, NULL}
};

static const luaL_Reg event_meta[] = {
  {"__gc", e_release},
  {"__close", e_release},
  {"__tostring", e_tostring},
  {NULL, NULL}
};

static const luaL_Reg event_methods[] = {
  {"record", e_record},
  {"elapsed_since", e_elapsed_since},
  {NULL, NULL}
};

static const luaL_Reg graph_meta[] = {
  {"__gc", g_release},
  {"__close", g_release},
  {"__tostring", g_tostring},
  {NULL, NULL}
};

static const luaL_Reg graph_methods[] = {
  {"replay", g_replay},
  {NULL, NULL}
};

static const luaL_Reg module_funcs[] = {
  {"device_count", l_device_count},
  {"config", l_config},
  {"new", l_new},
  {"from_table", l_from_table},
  {"is_tensor", l_is_tensor},
  {"synchronize", l_synchronize},
  {"route", l_route},
  {"schedule", l_schedule},
  {"schedule_explain", l_schedule_explain},
  {"dispatch", l_dispatch},
  {"experts", l_experts},
  {"experts_explain", l_experts_explain},
  {"logits", l_logits},
  {"sigmoid_gate", l_sigmoid_gate},
  {"combine", l_combine},
  {"reference", l_reference},
  {"now", l_now},
  {"raise", l_raise},
  {"sleep", l_sleep},
  {"event_new", l_event_new},
  {"graph_begin", l_graph_begin},
  {"graph_end", l_graph_end},
  {NULL, NULL}
};

/* A metatable whose __index is a table of methods sharing the context upvalue at ctxi. */
static void new_class(lua_State *L, const char *tname, const luaL_Reg *meta, const luaL_Reg *methods, int ctxi) {
  luaL_newmetatable(L, tname);
  luaL_setfuncs(L, meta, 0);
  lua_newtable(L);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, methods, 1);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
}

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
  if (rc) return luaL_error(L, "moelab.core: cannot open a context: %s", moe_errstr(rc));
  int ctxi = lua_gettop(L);

  /* fields are (re)set even when the metatable exists, so a reloaded module uses its own ctx */
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

  new_class(L, EVENT, event_meta, event_methods, ctxi);
  new_class(L, GRAPH, graph_meta, graph_methods, ctxi);

  luaL_newlibtable(L, module_funcs);
  lua_pushvalue(L, ctxi);
  luaL_setfuncs(L, module_funcs, 1);
  lua_pushstring(L, moe_libversion());
  lua_setfield(L, -2, "version");
  lua_pushinteger(L, moe_libversion_number());
  lua_setfield(L, -2, "version_number");
  lua_pushvalue(L, methods); /* the front-end may add methods written in Lua */
  lua_setfield(L, -2, "Tensor");
  open_world(L, ctxi, lua_gettop(L));
  return 1;
}
