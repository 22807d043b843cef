/* SPDX-License-Identifier: MIT */
/* test_stages.c -- hand-checked cases for dispatch, experts, combine and the dense reference on
 * the CPU, through the public API only, plus each stage's argument errors, and the data checks
 * (moe_nonfinite) and memory query (moe_device_memory) a caller sizes and checks its data by.
 * Exits non-zero on the first failed check's run; prints the number of checks passed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "moelab.h"

static moe_ctx *ctx;

#define OK(call) CHECK((call) == MOE_OK, "%s", moe_errmsg(ctx))

/* ---- tensors: every one made here is freed at the end, so LeakSanitizer stays quiet ---- */

static moe_tensor *pool[256];
static int npool;

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

/* A CPU tensor holding vals (floats for f32 and bf16, int32_t for i32), or zeros if NULL. */
static moe_tensor *mk(moe_dtype dt, int ndim, const int64_t *shape, const void *vals) {
  moe_tensor *t;
  if (moe_tensor_new(ctx, dt, ndim, shape, (moe_device){MOE_CPU, 0}, &t) != MOE_OK || npool == 256) {
    fprintf(stderr, "test_stages: cannot make a tensor: %s\n", moe_errmsg(ctx));
    exit(2);
  }
  pool[npool++] = t;
  int64_t n = moe_tensor_numel(t);
  if (vals && dt == MOE_BF16) {
    uint16_t *p = moe_tensor_data(t);
    for (int64_t i = 0; i < n; i++) p[i] = moe_f32_to_bf16(((const float *)vals)[i]);
  } else if (vals) {
    memcpy(moe_tensor_data(t), vals, moe_tensor_nbytes(t));
  }
  return t;
}
/* A view of base from element offset, kept in the pool like the tensors. */
static moe_tensor *view_of(moe_tensor *base, int64_t offset, int ndim, const int64_t *shape) {
  moe_tensor *t;
  if (moe_tensor_view(ctx, base, offset, ndim, shape, &t) != MOE_OK || npool == 256) {
    fprintf(stderr, "test_stages: cannot make a view: %s\n", moe_errmsg(ctx));
    exit(2);
  }
  pool[npool++] = t;
  return t;
}
#define VIEW(base, offset, ...) view_of(base, offset, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__))
#define BF16(vals, ...) mk(MOE_BF16, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), vals)
#define F32(vals, ...) mk(MOE_F32, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), vals)
#define I32(vals, ...) mk(MOE_I32, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), vals)

/* Element i of an f32 or bf16 tensor as a float. */
static float at(moe_tensor *t, int64_t i) {
  if (moe_tensor_dtype(t) == MOE_BF16) return moe_bf16_to_f32(((const uint16_t *)moe_tensor_data(t))[i]);
  return ((const float *)moe_tensor_data(t))[i];
}

/* got holds exactly want[0..n) */
static void check_values(const char *what, moe_tensor *got, int64_t offset, const float *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    CHECK(at(got, offset + i) == want[i], "%s[%lld] = %g, want %g", what, (long long)(offset + i),
          (double)at(got, offset + i), (double)want[i]);
}

static void check_close(const char *what, float got, double want, double tol) {
  CHECK(fabs(got - want) <= tol * (1 + fabs(want)), "%s = %.9g, want %.9g", what, (double)got, want);
}

/* The call fails with MOE_ERR_ARG and a message that starts with "<stage>: " and contains frag. */
static void check_arg_error(int rc, const char *stage, const char *frag, int line) {
  const char *msg = moe_errmsg(ctx);
  size_t n = strlen(stage);
  checks++;
  if (rc != MOE_ERR_ARG || strncmp(msg, stage, n) != 0 || msg[n] != ':' || !strstr(msg, frag)) {
    failures++;
    fprintf(stderr, "%s:%d: want MOE_ERR_ARG and \"%s: ...%s...\", got %d and \"%s\"\n", __FILE__, line, stage, frag, rc,
            msg);
  }
}
#define ARG_ERROR(call, stage, frag) check_arg_error((call), stage, frag, __LINE__)

/* ---- dispatch ---- */

static void test_dispatch(void) {
  enum { W = 2, T = 3, H = 4, K = 2, C = 8 };
  float xv[W * T * H], poison[C * H];
  for (int w = 0; w < W; w++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < H; h++) xv[(w * T + t) * H + h] = 100 * w + t; /* payload names rank and token */
  for (int i = 0; i < C * H; i++) poison[i] = -9;
  /* rows: x[1, 5/2], x[0, 3/2], padding, x[1, 2/2], rank past W, route = T*K, negative route,
   * route on a row without a rank */
  const int32_t rank[C] = {1, 0, -1, 1, 5, 0, 0, -1}, route[C] = {5, 3, -1, 2, 0, 6, -3, 4};
  const float want[C] = {102, 1, -9, 101, -9, -9, -9, -9};
  moe_tensor *x = BF16(xv, W, T, H), *pr = I32(rank, C), *pt = I32(route, C);

  for (int zero_fill = 0; zero_fill <= 1; zero_fill++) {
    moe_tensor *xs = BF16(poison, C, H);
    moe_dispatch_args a = {.out = xs, .x = x, .peer_rank = pr, .peer_route = pt, .k = K, .zero_fill = zero_fill};
    OK(moe_dispatch(ctx, &a));
    for (int r = 0; r < C; r++) {
      float row[H];
      for (int h = 0; h < H; h++) row[h] = zero_fill && want[r] == -9 ? 0 : want[r];
      check_values(zero_fill ? "dispatch xs (zero_fill)" : "dispatch xs", xs, r * H, row, H);
    }
  }

  moe_tensor *xs = BF16(NULL, C, H), *xs_f32 = F32(NULL, C, H), *x_f32 = F32(NULL, 2, 3);
  moe_dispatch_args a = {.out = xs, .x = x_f32, .peer_rank = pr, .peer_route = pt, .k = K};
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "x must be bf16 [_, _, _], got f32 [2, 3] on cpu");
  a.x = BF16(NULL, W, T, H + 1);
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "out must be bf16 [8, 5], got bf16 [8, 4] on cpu");
  a.x = x, a.out = xs_f32;
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "out must be bf16 [8, 4], got f32 [8, 4] on cpu");
  a.out = xs, a.peer_rank = I32(NULL, C - 1);
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "peer_route must be i32 [7], got i32 [8] on cpu");
  a.peer_rank = pr, a.peer_route = F32(NULL, C);
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "peer_route must be i32 [8]");
  a.peer_route = pt, a.k = 0;
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "k must be >= 1");
  ARG_ERROR(moe_dispatch(ctx, NULL), "dispatch", "NULL");
  /* an output overlapping an input would be overwritten while still read */
  moe_tensor *both = BF16(NULL, C * H + W * T * H);
  a.k = K, a.out = VIEW(both, W * T * H - 1, C, H), a.x = VIEW(both, 0, W, T, H);
  ARG_ERROR(moe_dispatch(ctx, &a), "dispatch", "out and x share memory");
  a.out = VIEW(both, W * T * H, C, H); /* adjacent, not overlapping */
  OK(moe_dispatch(ctx, &a));
  moe_tensor *view, *big = BF16(NULL, 4);
  ARG_ERROR(moe_tensor_view(ctx, big, 0, 2, SHAPE((int64_t)1 << 62, 4), &view), "view", "more than 2^40 elements");
  /* an empty tensor's other dimensions are bounded too: stages multiply them (T * K of ids [0, T, K]) */
  ARG_ERROR(moe_tensor_view(ctx, big, 0, 3, SHAPE(0, (int64_t)1 << 40, 2), &view), "view", "more than 2^40 elements");
  moe_tensor *empty = NULL;
  ARG_ERROR(moe_tensor_new(ctx, MOE_I32, 3, SHAPE(0, (int64_t)1 << 40, (int64_t)1 << 40), (moe_device){MOE_CPU, 0}, &empty),
            "tensor", "more than 2^40 elements");
  CHECK(empty == NULL, "a refused tensor is NULL");
  moe_tensor *edge = I32(NULL, 0, (int64_t)1 << 20, (int64_t)1 << 20); /* 2^40 exactly: allowed */
  CHECK(moe_tensor_numel(edge) == 0, "[0, 2^20, 2^20] has no elements");
}

/* ---- experts ---- */

static void test_experts(void) {
  enum { C = 4, H = 2, F = 1, EL = 3 };
  /* expert 0: gate [1, 0], up [0, 1], down [1, -2]; expert 1: never used; expert 2: gate
   * [0.5, 0.5], up [1, -1], down [0.25, 4] */
  const float wgu[EL * 2 * F * H] = {1, 0, 0, 1, /**/ 7, 7, 7, 7, /**/ 0.5f, 0.5f, 1, -1};
  const float wdn[EL * H * F] = {1, -2, /**/ 7, 7, /**/ 0.25f, 4};
  const float xv[C * H] = {2, 3, -1, 0.5f, 4, 2, 1, 1};
  const int32_t offv[EL + 1] = {0, 2, 2, 3};
  /* row 0, expert 0: g = 2, u = 3, h = silu(2) * 3 = 5.28478 -> bf16 5.28125; y = [5.28125, -10.5625]
   * row 1, expert 0: g = -1, u = 0.5, h = -0.134471 -> bf16 -0.134765625; y = [-0.134765625, 0.26953125]
   * row 2, expert 2: g = 3, u = 2, h = 5.715445 -> bf16 5.71875; y = [1.4296875, 22.875]
   * row 3 is past the last offset: untouched */
  const float want[C * H] = {5.28125f, -10.5625f, -0.134765625f, 0.26953125f, 1.4296875f, 22.875f, -9, -9};
  const float poison[C * H] = {-9, -9, -9, -9, -9, -9, -9, -9};
  moe_tensor *xs = BF16(xv, C, H), *ys = BF16(poison, C, H), *off = I32(offv, EL + 1);
  moe_tensor *gu = BF16(wgu, EL, 2 * F, H), *dn = BF16(wdn, EL, H, F);
  moe_experts_args a = {.out = ys, .x = xs, .offsets = off, .w_gate_up = gu, .w_down = dn};
  OK(moe_experts(ctx, &a));
  check_values("experts ys", ys, 0, want, C * H);

  /* The same call over buffers this program owns, wrapped: the same bits, and the caller's
   * memory is written in place (moelab neither copies nor frees it). */
  uint16_t own_x[C * H], own_y[C * H];
  OK(moe_tensor_read(ctx, xs, own_x, sizeof own_x));
  for (int i = 0; i < C * H; i++) own_y[i] = moe_f32_to_bf16(-9);
  moe_tensor *wx, *wy;
  const moe_device cpu = {MOE_CPU, 0};
  OK(moe_tensor_wrap(ctx, own_x, MOE_BF16, 2, SHAPE(C, H), cpu, &wx));
  OK(moe_tensor_wrap(ctx, own_y, MOE_BF16, 2, SHAPE(C, H), cpu, &wy));
  pool[npool++] = wx, pool[npool++] = wy;
  CHECK(moe_tensor_data(wy) == (void *)own_y, "a wrapped tensor's data is the caller's pointer");
  moe_experts_args w = {.out = wy, .x = wx, .offsets = off, .w_gate_up = gu, .w_down = dn};
  OK(moe_experts(ctx, &w));
  for (int i = 0; i < C * H; i++) CHECK(moe_bf16_to_f32(own_y[i]) == want[i], "wrapped ys[%d] = %g", i, moe_bf16_to_f32(own_y[i]));
  moe_tensor *refused = wx;
  ARG_ERROR(moe_tensor_wrap(ctx, (char *)own_x + 1, MOE_BF16, 2, SHAPE(C, H), cpu, &refused), "wrap", "not aligned");
  CHECK(refused == NULL, "a refused wrap is NULL");
  ARG_ERROR(moe_tensor_wrap(ctx, NULL, MOE_F32, 1, SHAPE(3), cpu, &refused), "wrap", "data is NULL for 3 elements");
  ARG_ERROR(moe_tensor_wrap(ctx, own_x, MOE_BF16, 5, SHAPE(1, 1, 1, 1, 1), cpu, &refused), "wrap", "5 dimensions");
  OK(moe_tensor_wrap(ctx, NULL, MOE_F32, 2, SHAPE(0, 3), cpu, &refused)); /* empty: nothing to point at */
  pool[npool++] = refused;

  /* In place: each row block is read before it is written. */
  moe_tensor *inplace = BF16(xv, C, H);
  moe_experts_args b = {.out = inplace, .x = inplace, .offsets = off, .w_gate_up = gu, .w_down = dn};
  OK(moe_experts(ctx, &b));
  const float want_inplace[C * H] = {5.28125f, -10.5625f, -0.134765625f, 0.26953125f, 1.4296875f, 22.875f, 1, 1};
  check_values("experts in place", inplace, 0, want_inplace, C * H);

  /* Offsets are data: decreasing, negative and past-C ones must neither crash nor stray.
   * Expert e owns [m_e, m_e+1), m the running maximum of offsets clamped to [0, C]. */
  const int32_t badv[EL + 1] = {-5, 3, 1, 99};
  moe_tensor *ys2 = BF16(poison, C, H);
  a.out = ys2, a.offsets = I32(badv, EL + 1);
  OK(moe_experts(ctx, &a));
  check_values("experts bad offsets rows 0-1", ys2, 0, want, 4); /* rows 0, 1 by expert 0 */
  /* row 3 = [1, 1] by expert 2: g = 1, u = 0, h = 0, y = 0 */
  const float zero2[2] = {0, 0};
  check_values("experts bad offsets row 3", ys2, 3 * H, zero2, 2);

  /* Odd sizes that exercise the 4-row blocks and the dot products' tails: a row's result
   * must not depend on the rows it was grouped with, and must match a plain computation. */
  enum { C2 = 11, H2 = 19, F2 = 13, EL2 = 2 };
  moe_tensor *xs3 = BF16(NULL, C2, H2), *gu3 = BF16(NULL, EL2, 2 * F2, H2), *dn3 = BF16(NULL, EL2, H2, F2);
  OK(moe_tensor_randn(ctx, xs3, 1, 1.0f));
  OK(moe_tensor_randn(ctx, gu3, 2, 0.3f));
  OK(moe_tensor_randn(ctx, dn3, 3, 0.3f));
  const int32_t blockv[EL2 + 1] = {0, 9, C2};
  moe_tensor *yblock = BF16(NULL, C2, H2), *yrow = BF16(NULL, C2, H2);
  moe_tensor *single = I32(NULL, EL2 + 1);
  moe_experts_args c = {.out = yblock, .x = xs3, .offsets = I32(blockv, EL2 + 1), .w_gate_up = gu3, .w_down = dn3};
  OK(moe_experts(ctx, &c));
  for (int r = 0; r < C2; r++) {
    const int e = r < 9 ? 0 : 1;
    int32_t one[EL2 + 1] = {r, r, r}; /* row r alone, in expert e */
    for (int j = e + 1; j <= EL2; j++) one[j] = r + 1;
    OK(moe_tensor_write(ctx, single, one, sizeof one));
    c.out = yrow, c.offsets = single;
    OK(moe_experts(ctx, &c));
    int same = !memcmp((const uint16_t *)moe_tensor_data(yrow) + r * H2, (const uint16_t *)moe_tensor_data(yblock) + r * H2,
                       H2 * sizeof(uint16_t));
    CHECK(same, "experts row %d alone differs from the same row in a block", r);
    for (int i = 0; i < H2; i++) {
      double y = 0;
      for (int j = 0; j < F2; j++) {
        double g = 0, u = 0;
        for (int k = 0; k < H2; k++) {
          g += (double)at(gu3, (e * 2 * F2 + j) * H2 + k) * at(xs3, r * H2 + k);
          u += (double)at(gu3, (e * 2 * F2 + F2 + j) * H2 + k) * at(xs3, r * H2 + k);
        }
        y += (double)at(dn3, (e * H2 + i) * F2 + j) * moe_bf16_to_f32(moe_f32_to_bf16((float)(g / (1 + exp(-g)) * u)));
      }
      /* bf16 output: half an ulp is 2^-9 relative, plus the f32 sums' rounding */
      CHECK(fabs(at(yblock, r * H2 + i) - y) <= 4e-3 * fabs(y) + 1e-6, "experts [%d, %d] = %g, plain %g", r, i,
            (double)at(yblock, r * H2 + i), y);
    }
  }

  moe_experts_args e = {.out = ys, .x = xs, .offsets = off, .w_gate_up = gu, .w_down = dn};
  e.x = F32(NULL, C, H);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "x must be bf16 [_, _], got f32 [4, 2] on cpu");
  e.x = xs, e.out = BF16(NULL, C + 1, H);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "out must be bf16 [4, 2]");
  e.out = ys, e.w_gate_up = BF16(NULL, EL, 3, H);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "w_gate_up must be bf16 [EL, 2F, 2]");
  e.w_gate_up = BF16(NULL, EL, 2, H + 1);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "w_gate_up must be bf16 [_, _, 2]");
  e.w_gate_up = gu, e.w_down = BF16(NULL, EL, H, 2);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "w_down must be bf16 [3, 2, 1]");
  e.w_down = dn, e.offsets = I32(NULL, EL);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "offsets must be i32 [4]");
  e.offsets = off, e.out = VIEW(gu, 0, C, H);
  ARG_ERROR(moe_experts(ctx, &e), "experts", "out and w_gate_up share memory");
  e.out = VIEW(xs, H, C - 1, H), e.x = VIEW(xs, 0, C - 1, H); /* shifted by a row: not in place */
  ARG_ERROR(moe_experts(ctx, &e), "experts", "out and x share memory");
  e.out = ys, e.x = xs, e.offsets = NULL;
  ARG_ERROR(moe_experts(ctx, &e), "experts", "got nothing");
  ARG_ERROR(moe_experts(ctx, NULL), "experts", "NULL");
}

/* ---- logits and the sigmoid gate ---- */

static void test_logits_gate(void) {
  const float xv[3 * 2] = {1, 2, -1, 0.5f, 0, 3}, wv[2 * 2] = {1, 1, 2, -1};
  moe_tensor *x = BF16(xv, 3, 2), *w = BF16(wv, 2, 2), *out = F32(NULL, 3, 2);
  OK(moe_logits(ctx, out, x, w));
  const float want[3 * 2] = {3, 0, -0.5f, -2.5f, 3, -3};
  check_values("logits", out, 0, want, 6);
  moe_tensor *g = F32(NULL, 3), *gw = BF16(wv, 2);
  OK(moe_sigmoid_gate(ctx, g, x, gw));
  for (int t = 0; t < 3; t++) check_close("sigmoid_gate", at(g, t), 1 / (1 + exp(-(double)want[t * 2])), 1e-6);
  ARG_ERROR(moe_logits(ctx, F32(NULL, 3, 3), x, w), "logits", "out must be f32 [3, 2]");
  ARG_ERROR(moe_logits(ctx, out, F32(NULL, 3, 2), w), "logits", "x must be bf16");
  ARG_ERROR(moe_sigmoid_gate(ctx, g, x, BF16(NULL, 3)), "sigmoid_gate", "w must be bf16 [2]");
  ARG_ERROR(moe_sigmoid_gate(ctx, BF16(NULL, 3), x, gw), "sigmoid_gate", "g must be f32 [3]");
}

/* ---- combine ---- */

static void test_combine(void) {
  enum { W = 2, E = 4, T = 3, K = 2, H = 2, P = 1 /* source rank */ };
  /* owner 0 holds experts 0, 1; owner 1 holds 2, 3 */
  const float y0v[3 * H] = {1, 1, 2, 2, 4, 8}, y1v[2 * H] = {10, 20, 100, -200};
  const int32_t idv[T * K] = {3, 0, /**/ 2, -1, /**/ 9, 1};
  const float wv[T * K] = {0.5f, 0.25f, /**/ 2, 3, /**/ 7, 0.5f};
  /* route_row[o][p, t*K + k]: rank 0's half is poison that must never be read */
  const int32_t rr0[W * T * K] = {99, 99, 99, 99, 99, 99, /**/ 0, 2, 0, 0, 1, 0};
  const int32_t rr1[W * T * K] = {99, 99, 99, 99, 99, 99, /**/ 1, 1, 7, 1, 1, 1};
  /* token 0: 0.5 * ys1[1] + 0.25 * ys0[2] = [51, -98]
   * token 1: id 2's row 7 is past owner 1's 2 rows, k = 1 is masked: nothing
   * token 2: id 9 >= E is skipped; 0.5 * ys0[0] = [0.5, 0.5] */
  const float want[T * H] = {51, -98, 0, 0, 0.5f, 0.5f};
  const float shv[T * H] = {1, 2, 3, 4, 5, 6}, gv[T] = {2, 0.5f, -1};
  const float want_shared[T * H] = {53, -94, 1.5f, 2, -4.5f, -5.5f};

  const moe_tensor *ys[W] = {BF16(y0v, 3, H), BF16(y1v, 2, H)};
  const moe_tensor *rr[W] = {I32(rr0, W, T * K), I32(rr1, W, T * K)};
  moe_tensor *ids = I32(idv, T, K), *w = F32(wv, T, K), *shared = BF16(shv, T, H), *gate = F32(gv, T);
  moe_tensor *out32 = F32(NULL, T, H), *out16 = BF16(NULL, T, H);
  moe_combine_args a = {.out = out32, .weights = w, .ids = ids, .ys = ys, .route_row = rr, .world = W, .experts = E, .rank = P};
  OK(moe_combine(ctx, &a));
  check_values("combine f32", out32, 0, want, T * H);
  a.out = out16, a.shared = shared;
  OK(moe_combine(ctx, &a));
  const float want_ungated[T * H] = {52, -96, 3, 4, 5.5f, 6.5f};
  check_values("combine bf16 + shared", out16, 0, want_ungated, T * H);
  a.shared_gate = gate;
  OK(moe_combine(ctx, &a));
  check_values("combine bf16 + gated shared", out16, 0, want_shared, T * H);

  moe_combine_args e = a;
  e.weights = I32(NULL, T, K);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "weights must be f32 [3, 2], got i32 [3, 2] on cpu");
  e = a, e.ids = I32(NULL, T, K + 1);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "weights must be f32 [3, 3], got f32 [3, 2] on cpu");
  e = a, e.out = I32(NULL, T, H);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "out must be bf16 or f32 [3, 2], got i32");
  e = a, e.experts = 5;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "experts must be a positive multiple of world (2), got 5");
  e = a, e.rank = 2;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "rank must be in [0, 2), got 2");
  const moe_tensor *bad_rr[W] = {rr[0], I32(NULL, W, T)};
  e = a, e.route_row = bad_rr;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "route_row of rank 1 must be i32 [2, 6]");
  const moe_tensor *bad_ys[W] = {ys[0], BF16(NULL, 2, H + 1)};
  e = a, e.ys = bad_ys;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "ys of rank 1 must be bf16 [_, 2]");
  e = a, e.shared = NULL;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "shared_gate is given without shared");
  e = a, e.shared_gate = F32(NULL, T + 1);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "shared_gate must be f32 [3]");
  e = a, e.ys = NULL;
  ARG_ERROR(moe_combine(ctx, &e), "combine", "ys and route_row");
  moe_tensor *ys_big[W] = {BF16(y0v, 3, H), BF16(NULL, 4, H)};
  e = a, e.ys = (const moe_tensor *const *)ys_big, e.out = VIEW(ys_big[1], 0, T, H);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "out and ys of rank 1 share memory");
  e = a, e.out = VIEW(shared, 0, T, H);
  ARG_ERROR(moe_combine(ctx, &e), "combine", "out and shared share memory");
}

/* ---- reference ---- */

static double silu(double g) { return g / (1 + exp(-g)); }

static void test_reference(void) {
  enum { N = 2, H = 2, K = 2, W = 2, E = 2, F = 1 };
  /* expert 0 (rank 0): gate [1, 0], up [0, 1], down [1, -2]
   * expert 1 (rank 1): gate [0.5, 0.5], up [1, -1], down [0.25, 4]
   * shared: gate [0, 1], up [1, 1], down [1, 0.5]; shared gate w = [0.5, -0.5] */
  const float gu0[2 * H] = {1, 0, 0, 1}, dn0[H] = {1, -2}, gu1[2 * H] = {0.5f, 0.5f, 1, -1}, dn1[H] = {0.25f, 4};
  const float sgu[2 * H] = {0, 1, 1, 1}, sdn[H] = {1, 0.5f}, sgw[H] = {0.5f, -0.5f};
  const float xv[N * H] = {2, 3, 2, 3};
  const int32_t idv[N * K] = {1, 0, /**/ -1, 0};
  const float wv[N * K] = {0.25f, 0.5f, /**/ 1000, 0.5f}; /* a masked route's weight counts for nothing */
  const moe_tensor *gu[W] = {BF16(gu0, 1, 2 * F, H), BF16(gu1, 1, 2 * F, H)};
  const moe_tensor *dn[W] = {BF16(dn0, 1, H, F), BF16(dn1, 1, H, F)};
  moe_tensor *out = F32(NULL, N, H), *ids = I32(idv, N, K);
  moe_reference_args a = {.out = out, .x = BF16(xv, N, H), .ids = ids, .weights = F32(wv, N, K), .w_gate_up = gu,
                          .w_down = dn, .world = W, .experts = E, .shared_gate_up = BF16(sgu, 1, 2, H),
                          .shared_down = BF16(sdn, 1, H, 1), .shared_gate_w = BF16(sgw, H)};
  OK(moe_reference(ctx, &a));
  /* x = [2, 3]: expert 0: h = silu(2) * 3, y = [h, -2h]; expert 1: h = silu(2.5) * -1,
   * y = [0.25h, 4h]; shared: h = silu(3) * 5, y = [h, 0.5h], g = sigmoid(1 - 1.5) */
  const double h0 = silu(2) * 3, h1 = -silu(2.5), hs = silu(3) * 5, g = 1 / (1 + exp(0.5));
  const double want[N * H] = {0.25 * (0.25 * h1) + 0.5 * h0 + g * hs, 0.25 * (4 * h1) + 0.5 * (-2 * h0) + g * 0.5 * hs,
                              0.5 * h0 + g * hs, 0.5 * (-2 * h0) + g * 0.5 * hs};
  for (int i = 0; i < N * H; i++) check_close("reference", at(out, i), want[i], 1e-6);

  /* without the gate, g = 1; without a shared expert, nothing */
  a.shared_gate_w = NULL;
  OK(moe_reference(ctx, &a));
  check_close("reference ungated", at(out, 1), 0.25 * (4 * h1) + 0.5 * (-2 * h0) + 0.5 * hs, 1e-6);
  a.shared_gate_up = a.shared_down = NULL;
  OK(moe_reference(ctx, &a));
  check_close("reference unshared", at(out, 2), 0.5 * h0, 1e-6);

  moe_reference_args e = a;
  const int32_t badv[N * K] = {1, 0, 0, 2};
  e.ids = I32(badv, N, K);
  ARG_ERROR(moe_reference(ctx, &e), "reference", "ids[1, 1] is 2");
  e = a, e.x = F32(xv, N, H);
  ARG_ERROR(moe_reference(ctx, &e), "reference", "x must be bf16 [_, _], got f32 [2, 2] on cpu");
  e = a, e.out = BF16(NULL, N, H);
  ARG_ERROR(moe_reference(ctx, &e), "reference", "out must be f32 [2, 2]");
  const moe_tensor *bad_dn[W] = {dn[0], BF16(NULL, 1, H, 2)};
  e = a, e.w_down = bad_dn;
  ARG_ERROR(moe_reference(ctx, &e), "reference", "w_down[1] must be bf16 [1, 2, 1]");
  e = a, e.experts = 3;
  ARG_ERROR(moe_reference(ctx, &e), "reference", "experts must be a positive multiple of world");
  e = a, e.shared_down = BF16(sdn, 1, H, 1);
  ARG_ERROR(moe_reference(ctx, &e), "reference", "given together");
  e = a, e.shared_gate_w = BF16(sgw, H);
  ARG_ERROR(moe_reference(ctx, &e), "reference", "shared_gate_w is given without a shared expert");
}

/* ---- dispatch -> experts -> combine against the reference, on a hand-made schedule ---- */

static void test_layer(void) {
  enum { W = 2, E = 4, EL = E / W, T = 5, K = 2, H = 16, F = 8, C = 16 };
  moe_tensor *x = BF16(NULL, W, T, H);
  OK(moe_tensor_randn(ctx, x, 11, 1.0f));
  int32_t idv[W * T * K];
  float wv[W * T * K];
  for (int i = 0; i < W * T * K; i++) idv[i] = (i * 7 + i / 3) % E, wv[i] = 0.25f + 0.125f * (i % 5);
  idv[3] = -1; /* one masked route */
  moe_tensor *gu[W], *dn[W], *ys[W], *rr[W];
  for (int o = 0; o < W; o++) {
    gu[o] = BF16(NULL, EL, 2 * F, H), dn[o] = BF16(NULL, EL, H, F);
    OK(moe_tensor_randn(ctx, gu[o], 20 + o, 0.25f));
    OK(moe_tensor_randn(ctx, dn[o], 30 + o, 0.25f));
    /* the schedule by hand: peer-major rows per local expert, tight */
    int32_t prank[C], proute[C], offv[EL + 1], rrv[W * T * K];
    int n = 0;
    for (int i = 0; i < C; i++) prank[i] = proute[i] = -1;
    for (int i = 0; i < W * T * K; i++) rrv[i] = -1;
    for (int e = 0; e < EL; e++) {
      offv[e] = n;
      for (int i = 0; i < W * T * K; i++)
        if (idv[i] == o * EL + e) prank[n] = i / (T * K), proute[n] = i % (T * K), rrv[i] = n++;
    }
    offv[EL] = n;
    moe_tensor *xs = BF16(NULL, C, H);
    ys[o] = BF16(NULL, C, H), rr[o] = I32(rrv, W, T * K);
    moe_dispatch_args d = {.out = xs, .x = x, .peer_rank = I32(prank, C), .peer_route = I32(proute, C), .k = K,
                           .zero_fill = 1};
    OK(moe_dispatch(ctx, &d));
    moe_experts_args ex = {.out = ys[o], .x = xs, .offsets = I32(offv, EL + 1), .w_gate_up = gu[o], .w_down = dn[o]};
    OK(moe_experts(ctx, &ex));
  }
  for (int p = 0; p < W; p++) {
    moe_tensor *out = F32(NULL, T, H), *ref = F32(NULL, T, H);
    moe_tensor *ids = I32(idv + p * T * K, T, K), *w = F32(wv + p * T * K, T, K);
    moe_combine_args c = {.out = out, .weights = w, .ids = ids, .ys = (const moe_tensor *const *)ys,
                          .route_row = (const moe_tensor *const *)rr, .world = W, .experts = E, .rank = p};
    OK(moe_combine(ctx, &c));
    moe_tensor *xp;
    OK(moe_tensor_view(ctx, x, (int64_t)p * T * H, 2, SHAPE(T, H), &xp));
    moe_reference_args r = {.out = ref, .x = xp, .ids = ids, .weights = w, .w_gate_up = (const moe_tensor *const *)gu,
                            .w_down = (const moe_tensor *const *)dn, .world = W, .experts = E};
    OK(moe_reference(ctx, &r));
    if (p == 0) { /* an out overlapping the weights would be written while they are read */
      moe_tensor *both = F32(NULL, T * K + T * H);
      moe_reference_args bad = r;
      bad.weights = VIEW(both, 0, T, K), bad.out = VIEW(both, T * K - 1, T, H);
      ARG_ERROR(moe_reference(ctx, &bad), "reference", "out and weights share memory");
    }
    moe_tensor_free(xp);
    double maxerr = 0, maxref = 0;
    for (int i = 0; i < T * H; i++) {
      maxerr = fmax(maxerr, fabs(at(out, i) - at(ref, i)));
      maxref = fmax(maxref, fabs(at(ref, i)));
    }
    CHECK(maxref > 0 && maxerr <= 2e-2 * maxref, "rank %d: layer vs reference max err %g, max |ref| %g", p, maxerr, maxref);
  }
}

/* What the header promises of the context and of the calls that need no tensor data. */
static void test_api(void) {
  /* the message is the last call's: a success clears it */
  ARG_ERROR(moe_tensor_fill(ctx, NULL, 0), "fill", "NULL");
  int n = 0;
  OK(moe_device_count(ctx, MOE_CUDA, &n));
  CHECK(moe_errmsg(ctx)[0] == '\0', "a success leaves the message empty, got \"%s\"", moe_errmsg(ctx));
  /* without a GPU, synchronizing on one is UNSUPPORTED, as every other call on it */
  const int rc = moe_ctx_synchronize(ctx, (moe_device){MOE_CUDA, 0});
  CHECK(n > 0 ? rc == MOE_OK : rc == MOE_ERR_UNSUPPORTED, "synchronize on cuda:0 with %d GPUs: %d (%s)", n, rc,
        moe_errmsg(ctx));
  /* softmax does not use scale: a zero-initialised field is fine */
  moe_tensor *lg = F32(((const float[]){1, 3, 2, 0, 0, 5}), 2, 3), *ids = I32(NULL, 2, 1), *w = F32(NULL, 2, 1);
  moe_tensor *st = I32(NULL, 2);
  moe_route_args ra = {.ids = ids, .weights = w, .stats = st, .logits = lg, .k = 1, .scoring = MOE_SCORE_SOFTMAX,
                       .groups = 1, .topk_groups = 1};
  OK(moe_route(ctx, &ra));
  CHECK(((const int32_t *)moe_tensor_data(ids))[0] == 1 && ((const int32_t *)moe_tensor_data(ids))[1] == 2,
        "softmax top-1 with scale 0: ids %d %d, want 1 2", ((const int32_t *)moe_tensor_data(ids))[0],
        ((const int32_t *)moe_tensor_data(ids))[1]);
  ra.scoring = MOE_SCORE_SIGMOID;
  ARG_ERROR(moe_route(ctx, &ra), "route", "scale must be finite and > 0");
  /* a CPU event never recorded has no time to give, as a GPU one */
  moe_event *e0 = NULL, *e1 = NULL;
  float ms = -1;
  OK(moe_event_new(ctx, (moe_device){MOE_CPU, 0}, &e0));
  OK(moe_event_new(ctx, (moe_device){MOE_CPU, 0}, &e1));
  ARG_ERROR(moe_event_elapsed(ctx, e0, e1, &ms), "event", "start was never recorded");
  OK(moe_event_record(ctx, e0));
  ARG_ERROR(moe_event_elapsed(ctx, e0, e1, &ms), "event", "stop was never recorded");
  OK(moe_event_record(ctx, e1));
  OK(moe_event_elapsed(ctx, e0, e1, &ms));
  CHECK(ms >= 0, "elapsed %g ms", ms);
  moe_event_free(e0);
  moe_event_free(e1);
}

/* ---- empty tensors with huge other dimensions (up to 2^40 each): nothing to compute, so each
 * stage returns at once -- no product of those dimensions overflowing (the sanitizer run of the
 * suite traps on signed overflow), no scratch sized by them, no loop over them ---- */

static void test_empty_extremes(void) {
  const int64_t big = (int64_t)1 << 40;
  /* dispatch: T * k past 2^63; the one row's route points at no token of an empty x: zeroed */
  moe_tensor *xs = BF16(((const float[]){7}), 1, 1);
  moe_dispatch_args d = {.out = xs, .x = BF16(NULL, 0, big, 1), .peer_rank = I32(((const int32_t[]){0}), 1),
                         .peer_route = I32(((const int32_t[]){5}), 1), .k = INT32_MAX, .zero_fill = 1};
  OK(moe_dispatch(ctx, &d));
  check_values("dispatch from an empty x of 2^40 tokens", xs, 0, (const float[]){0}, 1);
  /* reference: no token, K = H = 2^40 */
  const moe_tensor *gu[1] = {BF16(NULL, 1, 0, big)}, *dn[1] = {BF16(NULL, 1, big, 0)};
  moe_reference_args r = {.out = F32(NULL, 0, big), .x = BF16(NULL, 0, big), .ids = I32(NULL, 0, big),
                          .weights = F32(NULL, 0, big), .w_gate_up = gu, .w_down = dn, .world = 1, .experts = 1};
  OK(moe_reference(ctx, &r));
  /* combine: 2^40 tokens of no route and no column */
  const moe_tensor *ys[1] = {BF16(NULL, 1, 0)}, *rr[1] = {I32(NULL, 1, 0)};
  moe_combine_args c = {.out = F32(NULL, big, 0), .weights = F32(NULL, big, 0), .ids = I32(NULL, big, 0), .ys = ys,
                        .route_row = rr, .world = 1, .experts = 1, .rank = 0};
  OK(moe_combine(ctx, &c));
  /* experts: H = 0 and F = 2^37 -- f32 scratch for one expert's weights would be 2^39 floats */
  moe_experts_args e = {.out = BF16(NULL, 1, 0), .x = BF16(NULL, 1, 0), .offsets = I32(((const int32_t[]){0, 1}), 2),
                        .w_gate_up = BF16(NULL, 1, (int64_t)1 << 38, 0), .w_down = BF16(NULL, 1, 0, (int64_t)1 << 37)};
  OK(moe_experts(ctx, &e));
  /* experts: no expert, F = 2^39 */
  moe_experts_args e0 = {.out = BF16(NULL, 1, 1), .x = BF16(NULL, 1, 1), .offsets = I32(((const int32_t[]){0}), 1),
                         .w_gate_up = BF16(NULL, 0, big, 1), .w_down = BF16(NULL, 0, 1, big / 2)};
  OK(moe_experts(ctx, &e0));
  /* logits: no token and no expert of 2^40 columns; 2^40 tokens of no column and no expert */
  OK(moe_logits(ctx, F32(NULL, 0, 0), BF16(NULL, 0, big), BF16(NULL, 0, big)));
  OK(moe_logits(ctx, F32(NULL, big, 0), BF16(NULL, big, 0), BF16(NULL, 0, 0)));
  /* route: no row of 2^31 - 1 experts; the stats still say nothing was rejected */
  moe_tensor *st = I32(((const int32_t[]){9, 9}), 2);
  moe_route_args ra = {.ids = I32(NULL, 0, 1), .weights = F32(NULL, 0, 1), .stats = st, .logits = F32(NULL, 0, INT32_MAX),
                       .k = 1, .scoring = MOE_SCORE_SOFTMAX, .groups = 1, .topk_groups = 1};
  OK(moe_route(ctx, &ra));
  CHECK(((const int32_t *)moe_tensor_data(st))[0] == 0 && ((const int32_t *)moe_tensor_data(st))[1] == -1,
        "route stats of no row: %d %d, want 0 -1", ((const int32_t *)moe_tensor_data(st))[0],
        ((const int32_t *)moe_tensor_data(st))[1]);
}

/* ---- data checks and sizes: moe_nonfinite, moe_device_memory, randn's std ---- */

static void check_nonfinite(const char *what, moe_tensor *t, int32_t count, int32_t first) {
  moe_tensor *st = I32(((const int32_t[]){7, 7}), 2);
  OK(moe_nonfinite(ctx, st, t));
  const int32_t *got = moe_tensor_data(st);
  CHECK(got[0] == count && got[1] == first, "nonfinite of %s: {%d, %d}, want {%d, %d}", what, got[0], got[1], count,
        first);
}

static void test_data_checks(void) {
  const float nan = NAN, inf = INFINITY;
  /* the largest finite values, subnormals and -0 are finite; NaN and either infinity are not */
  const float vals[] = {1, 3.4028235e38f, -3.4028235e38f, 1e-45f, -0.0f, inf, 2, nan, -inf};
  check_nonfinite("f32", F32(vals, 9), 3, 5);
  check_nonfinite("f32, finite", F32(vals, 5), 0, -1);
  check_nonfinite("bf16 (3.4e38 rounds to +inf there)", BF16(vals, 3, 3), 5, 1);
  check_nonfinite("an empty tensor", F32(NULL, 0, 4), 0, -1);
  check_nonfinite("the last element alone", F32(((const float[]){0, 0, 0, nan}), 4), 1, 3);
  ARG_ERROR(moe_nonfinite(ctx, I32(NULL, 2), I32(NULL, 3)), "nonfinite", "t must be an f32, bf16 or e4m3 tensor, got i32 [3]");
  ARG_ERROR(moe_nonfinite(ctx, I32(NULL, 3), F32(NULL, 3)), "nonfinite", "stats must be i32 [2], got i32 [3]");
  moe_tensor *buf = F32(NULL, 4);
  ARG_ERROR(moe_nonfinite(ctx, VIEW(buf, 0, 2), buf), "nonfinite", "stats must be i32 [2], got f32 [2]");
  moe_tensor *ibuf = I32(NULL, 4);
  moe_tensor *tail = NULL;
  OK(moe_tensor_wrap(ctx, moe_tensor_data(ibuf), MOE_F32, 1, SHAPE(3), (moe_device){MOE_CPU, 0}, &tail));
  ARG_ERROR(moe_nonfinite(ctx, VIEW(ibuf, 2, 2), tail), "nonfinite", "stats and t share memory");
  moe_tensor_free(tail);

  size_t free_bytes = 0, total_bytes = 0;
  OK(moe_device_memory(ctx, (moe_device){MOE_CPU, 0}, &free_bytes, &total_bytes));
  CHECK(total_bytes > 0 && free_bytes > 0 && free_bytes <= total_bytes, "host memory: %zu free of %zu", free_bytes,
        total_bytes);
  ARG_ERROR(moe_device_memory(ctx, (moe_device){MOE_CPU, 0}, NULL, &total_bytes), "device_memory", "must not be NULL");
  int n = 0;
  OK(moe_device_count(ctx, MOE_CUDA, &n));
  if (n == 0) {
    const int rc = moe_device_memory(ctx, (moe_device){MOE_CUDA, 0}, &free_bytes, &total_bytes);
    CHECK(rc == MOE_ERR_UNSUPPORTED && strstr(moe_errmsg(ctx), "device_memory: cuda:0 is not available"),
          "device_memory of cuda:0 without a GPU: %d \"%s\"", rc, moe_errmsg(ctx));
  }

  moe_tensor *r = F32(NULL, 4);
  ARG_ERROR(moe_tensor_randn(ctx, r, 1, -1.0f), "randn", "std must be finite and >= 0, got -1");
  ARG_ERROR(moe_tensor_randn(ctx, r, 1, inf), "randn", "std must be finite and >= 0, got inf");
  OK(moe_tensor_randn(ctx, r, 1, 0.0f));
  check_values("randn with std 0", r, 0, (const float[]){0, 0, 0, 0}, 4);
}

int main(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) return 2;
  test_data_checks();
  test_api();
  test_dispatch();
  test_experts();
  test_logits_gate();
  test_combine();
  test_reference();
  test_layer();
  test_empty_extremes();
  for (int i = 0; i < npool; i++) moe_tensor_free(pool[i]);
  moe_ctx_close(ctx);
  if (failures) {
    fprintf(stderr, "test_stages: %d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("test_stages: %d checks passed\n", checks);
  return 0;
}
