/* SPDX-License-Identifier: MIT */
/*
 * stage.c -- the stages (route, schedule, dispatch, dispatch_fp8, experts, experts_fp8, logits,
 * sigmoid_gate, nonfinite, combine, reference, reference_fp8), quantize and dequantize, and the
 * explain calls of schedule, experts, experts_fp8 and logits.
 *
 * Stage arguments: one table of named fields at index 1.  Every value fetched stays on the stack
 * until the call returns, so nothing the C call sees can be collected under it; that none was
 * closed while they were read, lc_args_still_open checks.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lcore.h"

/* ---- stage arguments ---- */

typedef struct Args {
  lua_State *L;
  const char *fname;
} Args;

static Args args_open(lua_State *L, const char *fname) {
  Args a = {L, fname};
  if (lua_type(L, 1) != LUA_TTABLE) lc_arg_error(L, fname, 1, "table expected, got %s", lc_type_name(L, 1));
  lua_settop(L, 1);
  luaL_checkstack(L, 40, "too many arguments");
  return a;
}

static const moe_tensor *tensor_at(Args *a, int idx, const char *field) {
  lua_State *L = a->L;
  Tensor *u = lc_test_tensor(L, idx);
  if (!u && !luaL_testudata(L, idx, TENSOR))
    lc_arg_error(L, a->fname, 1, "field '%s': expected moelab.Tensor, got %s", field, lc_type_name(L, idx));
  if (!u) lc_arg_error(L, a->fname, 1, "field '%s': moelab.Tensor is closed", field);
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
  if (!isint) lc_arg_error(L, a->fname, 1, "field '%s': expected an integer, got %s", field, lc_got_value(L, -1));
  if (v < INT32_MIN || v > INT32_MAX)
    lc_arg_error(L, a->fname, 1, "field '%s': %I is outside the range of a C int", field, (LUAI_UACINT)v);
  return (int)v;
}

static double number_field(Args *a, const char *field, double dflt) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL) return dflt;
  if (ty != LUA_TNUMBER)
    lc_arg_error(L, a->fname, 1, "field '%s': expected a number, got %s", field, lc_type_name(L, -1));
  return (double)lua_tonumber(L, -1);
}

static int bool_field(Args *a, const char *field) {
  lua_State *L = a->L;
  int ty = lua_getfield(L, 1, field);
  if (ty == LUA_TNIL) return 0;
  if (ty != LUA_TBOOLEAN)
    lc_arg_error(L, a->fname, 1, "field '%s': expected a boolean, got %s", field, lc_got_value(L, -1));
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
    lc_arg_error(L, a->fname, 1, "field '%s': expected %s, got '%s'", field, expected, s);
  }
  return lc_arg_error(L, a->fname, 1, "field '%s': expected %s, got %s", field, expected, lc_type_name(L, -1));
}

/* A table of exactly `world` tensors, as a C array in a scratch userdata. */
static const moe_tensor *const *tensors_field(Args *a, const char *field, int world) {
  lua_State *L = a->L;
  if (lua_getfield(L, 1, field) != LUA_TTABLE)
    lc_arg_error(L, a->fname, 1, "field '%s': expected a table of %d moelab.Tensor (one per rank), got %s", field,
                 world, lc_type_name(L, -1));
  int tbl = lua_gettop(L);
  lua_Integer n = (lua_Integer)lua_rawlen(L, tbl);
  if (n != world)
    lc_arg_error(L, a->fname, 1, "field '%s': expected %d tensors (world), got %I", field, world, (LUAI_UACINT)n);
  luaL_checkstack(L, world + 8, "too many tensors"); /* + the scratch and pin()'s four */
  const moe_tensor **ts = (const moe_tensor **)lua_newuserdatauv(L, (size_t)world * sizeof *ts, 0);
  for (int i = 0; i < world; i++) {
    lua_rawgeti(L, tbl, i + 1);
    Tensor *u = lc_test_tensor(L, -1);
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
  if (w < 1) lc_arg_error(a->L, a->fname, 1, "field 'world': expected a positive integer, got %d", w);
  return w;
}

/* A tensor field of a stage's argument struct: its name, where it lies, whether it may be nil.
 * The member may be const or not: the pointer is copied in. */
typedef struct {
  const char *name;
  size_t at;
  int optional;
} TensorField;
#define REQ(type, member) {#member, offsetof(type, member), REQUIRED}
#define OPT(type, member) {#member, offsetof(type, member), OPTIONAL}

static void tensor_fields(Args *a, void *args, const TensorField *f, size_t n) {
  for (size_t j = 0; j < n; j++) {
    moe_tensor *t = tensor_field(a, f[j].name, f[j].optional);
    memcpy((char *)args + f[j].at, &t, sizeof t);
  }
}
#define TENSOR_FIELDS(a, args, table) tensor_fields(a, args, table, sizeof table / sizeof table[0])

/* ---- stages ---- */

static int l_route(lua_State *L) {
  static const char *const scorings[] = {"softmax", "sigmoid", "sqrtsoftplus", NULL};
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "route");
#define T moe_route_args
  static const TensorField tensors[] = {REQ(T, ids), REQ(T, weights), OPT(T, stats), REQ(T, logits), OPT(T, bias)};
#undef T
  moe_route_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.k = int_field(&A, "k", REQUIRED, 0);
  a.scoring = option_field(&A, "scoring", scorings, "'softmax', 'sigmoid' or 'sqrtsoftplus'");
  a.groups = int_field(&A, "groups", OPTIONAL, 1);
  a.topk_groups = int_field(&A, "topk_groups", OPTIONAL, a.groups);
  a.scale = (float)number_field(&A, "scale", 1.0);
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_route(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "route", "route");
  return 0;
}

/* An explain call's end: its report on the stack, or the stage's error. */
static int explained(lua_State *L, moe_ctx *ctx, int rc, const char *report, const char *fname, const char *stage) {
  if (rc) return lc_stage_fail(L, ctx, rc, fname, stage);
  lua_pushstring(L, report);
  return 1;
}

/* core.schedule{...} runs the stage; core.schedule_explain{...} takes the same fields and returns
 * moe_schedule_explain's report (which kernel the call would run, and why) without running it. */
static int schedule_call(lua_State *L, const char *name, int explain) {
  static const char *const layouts[] = {"roundrobin", "peer_major", NULL};
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, name);
#define T moe_schedule_args
  static const TensorField tensors[] = {REQ(T, peer_rank),         REQ(T, peer_route),     REQ(T, counts),
                                        REQ(T, tokens_per_expert), REQ(T, expert_offsets), REQ(T, route_row),
                                        REQ(T, stats),             REQ(T, ids)};
#undef T
  moe_schedule_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  a.rank = int_field(&A, "rank", REQUIRED, 0);
  a.pad = int_field(&A, "pad", OPTIONAL, 1);
  a.capacity = int_field(&A, "capacity", REQUIRED, 0);
  a.expert_capacity = int_field(&A, "expert_capacity", OPTIONAL, -1);
  a.layout = option_field(&A, "layout", layouts, "'roundrobin' or 'peer_major'") == 0 ? MOE_LAYOUT_ROUNDROBIN
                                                                                     : MOE_LAYOUT_PEER_MAJOR;
  lc_args_still_open(L, A.fname, 2);
  if (explain) {
    char report[1024];
    return explained(L, ctx, moe_schedule_explain(ctx, &a, report, sizeof report), report, name, "schedule");
  }
  int rc = moe_schedule(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, name, "schedule");
  return 0;
}

static int l_schedule(lua_State *L) { return schedule_call(L, "schedule", 0); }
static int l_schedule_explain(lua_State *L) { return schedule_call(L, "explain", 1); }

static int l_dispatch(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "dispatch");
#define T moe_dispatch_args
  static const TensorField tensors[] = {REQ(T, out), REQ(T, x), REQ(T, peer_rank), REQ(T, peer_route)};
#undef T
  moe_dispatch_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.k = int_field(&A, "k", REQUIRED, 0);
  a.zero_fill = bool_field(&A, "zero_fill");
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_dispatch(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "dispatch", "dispatch");
  return 0;
}

static int l_dispatch_fp8(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "dispatch_fp8");
#define T moe_dispatch_fp8_args
  static const TensorField tensors[] = {REQ(T, out),     REQ(T, out_scale), REQ(T, x),
                                        REQ(T, x_scale), REQ(T, peer_rank), REQ(T, peer_route)};
#undef T
  moe_dispatch_fp8_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.k = int_field(&A, "k", REQUIRED, 0);
  a.zero_fill = bool_field(&A, "zero_fill");
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_dispatch_fp8(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "dispatch_fp8", "dispatch_fp8");
  return 0;
}

/* core.quantize{q =, scale =, x =, kind =} and core.dequantize{x =, q =, scale =, kind =}; kind is
 * "block", "token" or "token_t" (moe_quant_kind's order). */
static int quant_call(lua_State *L, const char *name, int quantize) {
  static const char *const kinds[] = {"block", "token", "token_t", NULL};
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, name);
  moe_tensor *q = tensor_field(&A, "q", REQUIRED), *scale = tensor_field(&A, "scale", REQUIRED);
  moe_tensor *x = tensor_field(&A, "x", REQUIRED);
  if (lua_getfield(L, 1, "kind") == LUA_TNIL) lc_arg_error(L, name, 1, "field 'kind': expected 'block', 'token' or "
                                                           "'token_t', got nil");
  int kind = option_field(&A, "kind", kinds, "'block', 'token' or 'token_t'");
  lc_args_still_open(L, A.fname, 2);
  int rc = quantize ? moe_quantize(ctx, q, scale, x, kind) : moe_dequantize(ctx, x, q, scale, kind);
  if (rc) return lc_stage_fail(L, ctx, rc, name, name);
  return 0;
}

static int l_quantize(lua_State *L) { return quant_call(L, "quantize", 1); }
static int l_dequantize(lua_State *L) { return quant_call(L, "dequantize", 0); }

/* The table of core.experts{...} and core.experts_explain{...}. */
static moe_experts_args experts_fields(lua_State *L, const char *name) {
  Args A = args_open(L, name);
#define T moe_experts_args
  static const TensorField tensors[] = {REQ(T, out), REQ(T, x), REQ(T, offsets), REQ(T, w_gate_up), REQ(T, w_down)};
#undef T
  moe_experts_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  lc_args_still_open(L, A.fname, 2);
  return a;
}

static int l_experts(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_experts_args a = experts_fields(L, "experts");
  int rc = moe_experts(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "experts", "experts");
  return 0;
}

/* core.experts_explain{...} -> the report of moe_experts_explain: which kernel would run, and why. */
static int l_experts_explain(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_experts_args a = experts_fields(L, "explain");
  char report[2048];
  return explained(L, ctx, moe_experts_explain(ctx, &a, report, sizeof report), report, "explain", "experts");
}

/* The table of core.experts_fp8{...} and core.experts_fp8_explain{...}. */
static moe_experts_fp8_args experts_fp8_fields(lua_State *L, const char *name) {
  Args A = args_open(L, name);
#define T moe_experts_fp8_args
  static const TensorField tensors[] = {REQ(T, out),     REQ(T, x),         REQ(T, x_scale),
                                        REQ(T, offsets), REQ(T, w_gate_up), REQ(T, w_gate_up_scale),
                                        REQ(T, w_down),  REQ(T, w_down_scale)};
#undef T
  moe_experts_fp8_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  lc_args_still_open(L, A.fname, 2);
  return a;
}

static int l_experts_fp8(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_experts_fp8_args a = experts_fp8_fields(L, "experts_fp8");
  int rc = moe_experts_fp8(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "experts_fp8", "experts_fp8");
  return 0;
}

/* core.experts_fp8_explain{...} -> the report of moe_experts_fp8_explain. */
static int l_experts_fp8_explain(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_experts_fp8_args a = experts_fp8_fields(L, "explain");
  char report[2048];
  return explained(L, ctx, moe_experts_fp8_explain(ctx, &a, report, sizeof report), report, "explain",
                   "experts_fp8");
}

static int l_logits(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *out = lc_check_tensor(L, 1), *x = lc_check_tensor(L, 2), *w = lc_check_tensor(L, 3);
  lc_args_still_open(L, "logits", 1); /* pinning one into a capture may have run a finalizer */
  int rc = moe_logits(ctx, out, x, w);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* core.logits_explain(out, x, w) -> the report of moe_logits_explain: which path would run, and why. */
static int l_logits_explain(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *out = lc_check_tensor(L, 1), *x = lc_check_tensor(L, 2), *w = lc_check_tensor(L, 3);
  char report[512];
  int rc = moe_logits_explain(ctx, out, x, w, report, sizeof report);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushstring(L, report);
  return 1;
}

static int l_sigmoid_gate(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *g = lc_check_tensor(L, 1), *x = lc_check_tensor(L, 2), *w = lc_check_tensor(L, 3);
  lc_args_still_open(L, "sigmoid_gate", 1); /* as in l_logits */
  int rc = moe_sigmoid_gate(ctx, g, x, w);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

/* core.nonfinite(stats, t): stats i32 [2] = {NaN or infinite elements of t, the first or -1}. */
static int l_nonfinite(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_tensor *stats = lc_check_tensor(L, 1), *t = lc_check_tensor(L, 2);
  lc_args_still_open(L, "nonfinite", 1); /* as in l_logits */
  int rc = moe_nonfinite(ctx, stats, t);
  if (rc) return lc_fail(L, ctx, rc);
  return 0;
}

static int l_combine(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "combine");
#define T moe_combine_args
  static const TensorField tensors[] = {REQ(T, out), REQ(T, weights), REQ(T, ids)};
  static const TensorField shared[] = {OPT(T, shared), OPT(T, shared_gate)};
#undef T
  moe_combine_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.world = world_field(&A);
  a.ys = tensors_field(&A, "ys", a.world);
  a.route_row = tensors_field(&A, "route_row", a.world);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  a.rank = int_field(&A, "rank", REQUIRED, 0);
  TENSOR_FIELDS(&A, &a, shared);
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_combine(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "combine", "combine");
  return 0;
}

static int l_reference(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "reference");
#define T moe_reference_args
  static const TensorField tensors[] = {REQ(T, out), REQ(T, x), REQ(T, ids), REQ(T, weights)};
  static const TensorField shared[] = {OPT(T, shared_gate_up), OPT(T, shared_down), OPT(T, shared_gate_w)};
#undef T
  moe_reference_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.world = world_field(&A);
  a.w_gate_up = tensors_field(&A, "w_gate_up", a.world);
  a.w_down = tensors_field(&A, "w_down", a.world);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  TENSOR_FIELDS(&A, &a, shared);
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_reference(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "reference", "reference");
  return 0;
}

static int l_reference_fp8(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  Args A = args_open(L, "reference_fp8");
#define T moe_reference_fp8_args
  static const TensorField tensors[] = {REQ(T, out), REQ(T, x), REQ(T, ids), REQ(T, weights)};
  static const TensorField shared[] = {OPT(T, shared_gate_up), OPT(T, shared_gate_up_scale), OPT(T, shared_down),
                                       OPT(T, shared_down_scale), OPT(T, shared_gate_w)};
#undef T
  moe_reference_fp8_args a;
  memset(&a, 0, sizeof a);
  TENSOR_FIELDS(&A, &a, tensors);
  a.world = world_field(&A);
  a.w_gate_up = tensors_field(&A, "w_gate_up", a.world);
  a.w_gate_up_scale = tensors_field(&A, "w_gate_up_scale", a.world);
  a.w_down = tensors_field(&A, "w_down", a.world);
  a.w_down_scale = tensors_field(&A, "w_down_scale", a.world);
  a.experts = int_field(&A, "experts", REQUIRED, 0);
  TENSOR_FIELDS(&A, &a, shared);
  lc_args_still_open(L, A.fname, 2);
  int rc = moe_reference_fp8(ctx, &a);
  if (rc) return lc_stage_fail(L, ctx, rc, "reference_fp8", "reference_fp8");
  return 0;
}

static const luaL_Reg stage_funcs[] = {
  {"route", l_route},
  {"schedule", l_schedule},
  {"schedule_explain", l_schedule_explain},
  {"dispatch", l_dispatch},
  {"dispatch_fp8", l_dispatch_fp8},
  {"quantize", l_quantize},
  {"dequantize", l_dequantize},
  {"experts", l_experts},
  {"experts_explain", l_experts_explain},
  {"experts_fp8", l_experts_fp8},
  {"experts_fp8_explain", l_experts_fp8_explain},
  {"logits", l_logits},
  {"logits_explain", l_logits_explain},
  {"sigmoid_gate", l_sigmoid_gate},
  {"nonfinite", l_nonfinite},
  {"combine", l_combine},
  {"reference", l_reference},
  {"reference_fp8", l_reference_fp8},
  {NULL, NULL}
};

void lc_open_stage(lua_State *L, int ctxi, int mod) { lc_add_funcs(L, stage_funcs, ctxi, mod); }
