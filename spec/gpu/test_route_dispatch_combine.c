/* SPDX-License-Identifier: MIT */
/* test_route_dispatch_combine.c -- route, dispatch, combine, logits, sigmoid_gate, randn, fill,
 * graphs and events on the GPU against the CPU reference, through the public API only.
 *
 * Integer outputs must equal the CPU's bit for bit.  The float outputs of these stages are
 * designed to equal the CPU's bit for bit too (same operations in the same order); the checks
 * print the max relative error and the number of differing elements, and require equality
 * except for sigmoid_gate, whose sigmoid is a different (few-ulp) exp from the CPU's expf (the
 * logits on their exact path).
 * bench/dispatch_combine_bench.c times dispatch and combine at the Kimi K2 rank-of-EP8 shape.  One
 * PASS/FAIL line per check; exits 77 without a GPU, 1 on any failure. */
#include <math.h>
#include <string.h>

#include "dispatch_test.h"

static moe_tensor *cpu_randn(moe_dtype dt, int ndim, const int64_t *shape, uint64_t seed, float std) {
  moe_tensor *t = tnew(dt, CPU, ndim, shape);
  TRY(moe_tensor_randn(ctx, t, seed, std));
  return t;
}

/* ---- randn and fill ---- */

static void test_randn_fill(void) {
  const int64_t n = 100003;
  for (int bf = 0; bf <= 1; bf++) {
    moe_dtype dt = bf ? MOE_BF16 : MOE_F32;
    moe_tensor *c = tnew(dt, CPU, 1, &n), *g = tnew(dt, GPU, 1, &n);
    TRY(moe_tensor_randn(ctx, c, 12345, 0.37f));
    TRY(moe_tensor_randn(ctx, g, 12345, 0.37f));
    char name[64];
    snprintf(name, sizeof name, "randn %s seed 12345 std 0.37", moe_dtype_name(dt));
    expect(name, g, c, 1, 0);
    moe_tensor_free(c), moe_tensor_free(g);
  }
  const struct { moe_dtype dt; double v; } fills[] = {
      {MOE_F32, 1.5}, {MOE_F32, NAN}, {MOE_F32, -1e-40}, {MOE_BF16, -2.2}, {MOE_BF16, NAN}, {MOE_I32, -7}};
  for (size_t i = 0; i < sizeof fills / sizeof fills[0]; i++) {
    const int64_t m = 1000 + (int64_t)i;
    moe_tensor *c = tnew(fills[i].dt, CPU, 1, &m), *g = tnew(fills[i].dt, GPU, 1, &m);
    TRY(moe_tensor_fill(ctx, c, fills[i].v));
    TRY(moe_tensor_fill(ctx, g, fills[i].v));
    char name[64];
    snprintf(name, sizeof name, "fill %s %g", moe_dtype_name(fills[i].dt), fills[i].v);
    expect(name, g, c, 1, 0);
    moe_tensor_free(c), moe_tensor_free(g);
  }
}

/* ---- route ---- */

typedef struct {
  const char *name;
  int n, e, k, scoring, groups, topk_groups, bias;
  float scale;
} route_case;

/* Logits with the awkward rows: NaN (rows 3 and 9), all equal (1), coarse ties (2), -inf
 * entries (4), signed zeros (5), +inf (6: rejected by softmax and sqrtsoftplus). */
static moe_tensor *route_logits(int n, int e, uint64_t seed) {
  moe_tensor *l = cpu_randn(MOE_F32, 2, SHAPE(n, e), seed, 1.5f);
  float *p = moe_tensor_data(l);
  for (int r = 0; r < n && r < 10; r++) {
    float *row = p + (size_t)r * e;
    switch (r) {
    case 1: for (int i = 0; i < e; i++) row[i] = 0.5f; break;
    case 2: for (int i = 0; i < e; i++) row[i] = roundf(row[i] * 2) / 2; break;
    case 3: row[e / 2] = NAN; break;
    case 4: for (int i = 0; i < e; i += 3) row[i] = -INFINITY; break;
    case 5: for (int i = 0; i < e; i++) row[i] = (i & 1) ? -0.0f : 0.0f; break;
    case 6: row[e - 1] = INFINITY; break;
    case 9: row[e - 1] = NAN; break;
    default: break;
    }
  }
  /* more coarse rows further down, where the warp and block paths differ in position */
  for (int r = 10; r < n; r += 7) {
    float *row = p + (size_t)r * e;
    for (int i = 0; i < e; i++) row[i] = roundf(row[i] * 4) / 4;
  }
  return l;
}

static void test_route(void) {
  const route_case cases[] = {
      {"softmax E=20 K=3", 67, 20, 3, MOE_SCORE_SOFTMAX, 1, 1, 0, 1.0f},
      {"softmax E=128 K=8 (Qwen3)", 301, 128, 8, MOE_SCORE_SOFTMAX, 1, 1, 0, 1.0f},
      {"softmax E=512 K=10 (Qwen3.5)", 130, 512, 10, MOE_SCORE_SOFTMAX, 1, 1, 0, 1.0f},
      {"softmax E=2048 K=16 (block per row)", 40, 2048, 16, MOE_SCORE_SOFTMAX, 1, 1, 0, 1.0f},
      {"sigmoid E=384 K=8 bias (Kimi K2)", 203, 384, 8, MOE_SCORE_SIGMOID, 1, 1, 1, 2.827f},
      {"sigmoid E=256 K=8 8 groups keep 4 (DeepSeek-V3)", 203, 256, 8, MOE_SCORE_SIGMOID, 8, 4, 1, 2.5f},
      {"sigmoid E=96 K=5 6 groups of 16 keep 3", 90, 96, 5, MOE_SCORE_SIGMOID, 6, 3, 1, 1.0f},
      {"sigmoid E=120 K=6 5 groups of 24 keep 2", 90, 120, 6, MOE_SCORE_SIGMOID, 5, 2, 1, 1.0f},
      {"sigmoid E=64 K=4 64 groups of 1 keep 16", 50, 64, 4, MOE_SCORE_SIGMOID, 64, 16, 0, 1.0f},
      {"sigmoid E=1024 K=8 16 groups of 64 keep 4 (block per row)", 30, 1024, 8, MOE_SCORE_SIGMOID, 16, 4, 1, 1.5f},
      {"sigmoid E=48 K=4 4 groups keep 4", 50, 48, 4, MOE_SCORE_SIGMOID, 4, 4, 1, 1.0f},
      {"sqrtsoftplus E=384 K=6 bias (DeepSeek-V4)", 203, 384, 6, MOE_SCORE_SQRTSOFTPLUS, 1, 1, 1, 2.5f},
      {"sqrtsoftplus E=4096 K=16 bias (block per row)", 20, 4096, 16, MOE_SCORE_SQRTSOFTPLUS, 1, 1, 1, 1.0f},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const route_case *rc = &cases[c];
    moe_tensor *lc = route_logits(rc->n, rc->e, 100 + c), *bc = NULL;
    if (rc->bias) {
      const int64_t e = rc->e;
      bc = cpu_randn(MOE_F32, 1, &e, 200 + c, 0.1f);
      float *b = moe_tensor_data(bc);
      for (int i = 0; i < rc->e; i++) b[i] = roundf(b[i] * 16) / 16; /* ties of s + b in the coarse rows */
    }
    moe_tensor *lg = copy_to(lc, GPU), *bg = bc ? copy_to(bc, GPU) : NULL;
    moe_tensor *ic = NEW(MOE_I32, CPU, rc->n, rc->k), *wc = NEW(MOE_F32, CPU, rc->n, rc->k), *sc = NEW(MOE_I32, CPU, 2);
    moe_tensor *ig = NEW(MOE_I32, GPU, rc->n, rc->k), *wg = NEW(MOE_F32, GPU, rc->n, rc->k), *sg = NEW(MOE_I32, GPU, 2);
    TRY(moe_tensor_fill(ctx, ig, 12345));
    TRY(moe_tensor_fill(ctx, wg, NAN));
    TRY(moe_tensor_fill(ctx, sg, 777));
    moe_route_args a = {.ids = ic, .weights = wc, .stats = sc, .logits = lc, .bias = bc, .k = rc->k,
                        .scoring = rc->scoring, .groups = rc->groups, .topk_groups = rc->topk_groups,
                        .scale = rc->scale};
    TRY(moe_route(ctx, &a));
    a.ids = ig, a.weights = wg, a.stats = sg, a.logits = lg, a.bias = bg;
    TRY(moe_route(ctx, &a));
    char name[160];
    const int32_t *st = moe_tensor_data(sc);
    snprintf(name, sizeof name, "route %s ids (%d rows rejected, first %d)", rc->name, st[0], st[1]);
    expect(name, ig, ic, 1, 0);
    snprintf(name, sizeof name, "route %s weights", rc->name);
    expect(name, wg, wc, 1, 0);
    snprintf(name, sizeof name, "route %s stats", rc->name);
    expect(name, sg, sc, 1, 0);
    moe_tensor *all[] = {lc, bc, lg, bg, ic, wc, sc, ig, wg, sg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  }

  /* no stats tensor, and an empty batch */
  moe_tensor *lc = route_logits(12, 64, 7), *lg = copy_to(lc, GPU);
  moe_tensor *ic = NEW(MOE_I32, CPU, 12, 4), *wc = NEW(MOE_F32, CPU, 12, 4);
  moe_tensor *ig = NEW(MOE_I32, GPU, 12, 4), *wg = NEW(MOE_F32, GPU, 12, 4);
  moe_route_args a = {.ids = ic, .weights = wc, .logits = lc, .k = 4, .scoring = MOE_SCORE_SOFTMAX, .groups = 1,
                      .topk_groups = 1, .scale = 1.0f};
  TRY(moe_route(ctx, &a));
  a.ids = ig, a.weights = wg, a.logits = lg;
  TRY(moe_route(ctx, &a));
  expect("route without stats ids", ig, ic, 1, 0);
  moe_tensor *l0 = NEW(MOE_F32, GPU, 0, 64), *i0 = NEW(MOE_I32, GPU, 0, 4), *w0 = NEW(MOE_F32, GPU, 0, 4),
             *s0 = NEW(MOE_I32, GPU, 2);
  TRY(moe_tensor_fill(ctx, s0, 5));
  a = (moe_route_args){.ids = i0, .weights = w0, .stats = s0, .logits = l0, .k = 4, .scoring = MOE_SCORE_SOFTMAX,
                       .groups = 1, .topk_groups = 1, .scale = 1.0f};
  TRY(moe_route(ctx, &a));
  int32_t st[2];
  TRY(moe_tensor_read(ctx, s0, st, sizeof st));
  check(st[0] == 0 && st[1] == -1, "route of 0 rows: stats {%d, %d}, want {0, -1}", st[0], st[1]);
  moe_tensor *all[] = {lc, lg, ic, wc, ig, wg, l0, i0, w0, s0};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
}

/* ---- logits and the gate ---- */

/* The exact path, the CPU's sums bit for bit (spec/logits_spec.lua checks the tensor-core path
 * against its bound). */
static void test_logits(void) {
  TRY(moe_ctx_config(ctx, "logits", "exact"));
  const struct { int n, e, h; } cases[] = {{77, 100, 520}, {33, 64, 203}, {300, 384, 1024}, {5, 3, 8}, {100, 384, 7168}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const int n = cases[c].n, e = cases[c].e, h = cases[c].h;
    moe_tensor *xc = cpu_randn(MOE_BF16, 2, SHAPE(n, h), 300 + c, 1.0f);
    moe_tensor *wc = cpu_randn(MOE_BF16, 2, SHAPE(e, h), 400 + c, 1.0f / sqrtf((float)h));
    moe_tensor *xg = copy_to(xc, GPU), *wg = copy_to(wc, GPU);
    moe_tensor *oc = NEW(MOE_F32, CPU, n, e), *og = NEW(MOE_F32, GPU, n, e);
    TRY(moe_logits(ctx, oc, xc, wc));
    TRY(moe_logits(ctx, og, xg, wg));
    char name[96];
    snprintf(name, sizeof name, "logits N=%d E=%d H=%d", n, e, h);
    expect(name, og, oc, 1, 0);

    /* the routing on the GPU's logits is the routing on the CPU's */
    if (e >= 8) {
      moe_tensor *ic = NEW(MOE_I32, CPU, n, 8), *wtc = NEW(MOE_F32, CPU, n, 8);
      moe_tensor *ig = NEW(MOE_I32, GPU, n, 8), *wtg = NEW(MOE_F32, GPU, n, 8);
      moe_route_args a = {.ids = ic, .weights = wtc, .logits = oc, .k = 8, .scoring = MOE_SCORE_SIGMOID, .groups = 1,
                          .topk_groups = 1, .scale = 1.0f};
      TRY(moe_route(ctx, &a));
      a.ids = ig, a.weights = wtg, a.logits = og;
      TRY(moe_route(ctx, &a));
      snprintf(name, sizeof name, "route on GPU logits N=%d E=%d H=%d ids", n, e, h);
      expect(name, ig, ic, 1, 0);
      moe_tensor_free(ic), moe_tensor_free(wtc), moe_tensor_free(ig), moe_tensor_free(wtg);
    }

    /* the gate: the same dot product, then sigmoid */
    moe_tensor *gwc = cpu_randn(MOE_BF16, 1, SHAPE(h), 500 + c, 1.0f / sqrtf((float)h));
    moe_tensor *gwg = copy_to(gwc, GPU), *gc = NEW(MOE_F32, CPU, n), *gg = NEW(MOE_F32, GPU, n);
    TRY(moe_sigmoid_gate(ctx, gc, xc, gwc));
    TRY(moe_sigmoid_gate(ctx, gg, xg, gwg));
    snprintf(name, sizeof name, "sigmoid_gate T=%d H=%d (within 1e-6: exp differs from expf by ulps)", n, h);
    expect(name, gg, gc, 0, 1e-6);
    moe_tensor *all[] = {xc, wc, xg, wg, oc, og, gwc, gwg, gc, gg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  }
  TRY(moe_ctx_config(ctx, "logits", "tensor"));
}

/* ---- dispatch ---- */

static void test_dispatch(void) {
  const int W = 4, T = 50, K = 4, E = 32;
  moe_tensor *ids = random_ids(W, T, K, E, 11, 1);
  const int64_t C = (int64_t)T * K + 64; /* room for padding, and unused rows at the end */
  sched_t s = schedule(ids, E, 1, 4, C);
  /* a few hand-made rows out of range: treated as rows without a route */
  int32_t *pr = moe_tensor_data(s.peer_rank), *pt = moe_tensor_data(s.peer_route);
  pr[C - 1] = W, pt[C - 1] = 0;
  pr[C - 2] = 0, pt[C - 2] = T * K;
  pr[C - 3] = 2, pt[C - 3] = -5;
  pr[C - 4] = 3, pt[C - 4] = T * K - 1; /* the last route of rank 3: valid */
  moe_tensor *prg = copy_to(s.peer_rank, GPU), *ptg = copy_to(s.peer_route, GPU);
  const int hs[] = {264, 130, 37, 7168};
  for (size_t hi = 0; hi < sizeof hs / sizeof hs[0]; hi++) {
    const int H = hs[hi];
    moe_tensor *xc = cpu_randn(MOE_BF16, 3, SHAPE(W, T, H), 600 + hi, 1.0f), *xg = copy_to(xc, GPU);
    for (int zf = 0; zf <= 1; zf++) {
      moe_tensor *xsc = NEW(MOE_BF16, CPU, C, H), *xsg = NEW(MOE_BF16, GPU, C, H);
      /* poison: untouched rows keep it */
      TRY(moe_tensor_fill(ctx, xsc, -3.0));
      TRY(moe_tensor_fill(ctx, xsg, -3.0));
      moe_dispatch_args a = {.out = xsc, .x = xc, .peer_rank = s.peer_rank, .peer_route = s.peer_route, .k = K,
                             .zero_fill = zf};
      TRY(moe_dispatch(ctx, &a));
      a.out = xsg, a.x = xg, a.peer_rank = prg, a.peer_route = ptg;
      TRY(moe_dispatch(ctx, &a));
      char name[96];
      snprintf(name, sizeof name, "dispatch H=%d%s (C=%lld rows)", H, zf ? " zero_fill" : "", (long long)C);
      expect(name, xsg, xsc, 1, 0);
      moe_tensor_free(xsc), moe_tensor_free(xsg);
    }
    /* a view of xs at an odd element offset: the 2-byte path */
    moe_tensor *basec = NEW(MOE_BF16, CPU, C * H + 1), *baseg = NEW(MOE_BF16, GPU, C * H + 1), *vc, *vg;
    TRY(moe_tensor_fill(ctx, basec, 1.0));
    TRY(moe_tensor_fill(ctx, baseg, 1.0));
    TRY(moe_tensor_view(ctx, basec, 1, 2, SHAPE(C, H), &vc));
    TRY(moe_tensor_view(ctx, baseg, 1, 2, SHAPE(C, H), &vg));
    moe_dispatch_args a = {.out = vc, .x = xc, .peer_rank = s.peer_rank, .peer_route = s.peer_route, .k = K};
    TRY(moe_dispatch(ctx, &a));
    a.out = vg, a.x = xg, a.peer_rank = prg, a.peer_route = ptg;
    TRY(moe_dispatch(ctx, &a));
    char name[96];
    snprintf(name, sizeof name, "dispatch H=%d into a view at an odd offset", H);
    expect(name, baseg, basec, 1, 0);
    moe_tensor_free(vc), moe_tensor_free(vg), moe_tensor_free(basec), moe_tensor_free(baseg);
    moe_tensor_free(xc), moe_tensor_free(xg);
  }
  moe_tensor_free(prg), moe_tensor_free(ptg), moe_tensor_free(ids);
  sched_free(&s);
}

/* ---- combine ---- */

/* W <= 4; hs: the row widths to try */
static void test_combine_case(int T, int K, int E, const int *hs, int nh) {
  enum { W = 4 };
  moe_tensor *ids = random_ids(W, T, K, E, 21 + T + K, 1);
  const int64_t C = (int64_t)T * K * 2;
  sched_t s[W];
  moe_tensor *rr_c[W], *rr_g[W];
  for (int o = 0; o < W; o++) {
    s[o] = schedule(ids, E, o, o == 2 ? 8 : 1, o == 3 ? 40 : C); /* owner 3 drops routes: capacity 40 */
    rr_c[o] = s[o].route_row;
    rr_g[o] = copy_to(s[o].route_row, GPU);
  }
  for (int hi = 0; hi < nh; hi++) {
    const int H = hs[hi];
    moe_tensor *ys_c[W], *ys_g[W];
    for (int o = 0; o < W; o++) {
      ys_c[o] = cpu_randn(MOE_BF16, 2, SHAPE(s[o].C, H), 700 + 10 * hi + o, 1.0f);
      ys_g[o] = copy_to(ys_c[o], GPU);
    }
    for (int p = 0; p < W; p += 3) {
      const int32_t *all_ids = moe_tensor_data(ids);
      moe_tensor *idc = NEW(MOE_I32, CPU, T, K);
      memcpy(moe_tensor_data(idc), all_ids + (size_t)p * T * K, sizeof(int32_t) * T * K);
      moe_tensor *idg = copy_to(idc, GPU);
      moe_tensor *wc = cpu_randn(MOE_F32, 2, SHAPE(T, K), 800 + p, 0.3f), *wg = copy_to(wc, GPU);
      moe_tensor *shc = cpu_randn(MOE_BF16, 2, SHAPE(T, H), 900 + p, 1.0f), *shg = copy_to(shc, GPU);
      moe_tensor *gc = cpu_randn(MOE_F32, 1, SHAPE(T), 950 + p, 0.5f), *gg = copy_to(gc, GPU);
      for (int variant = 0; variant < 3; variant++) {
        /* 0: bf16 out, shared and gate; 1: f32 out, shared without gate; 2: bf16 out, no shared */
        const moe_dtype odt = variant == 1 ? MOE_F32 : MOE_BF16;
        moe_tensor *oc = NEW(odt, CPU, T, H), *og = NEW(odt, GPU, T, H);
        TRY(moe_tensor_fill(ctx, og, NAN));
        moe_combine_args a = {.out = oc, .weights = wc, .ids = idc, .ys = (const moe_tensor *const *)ys_c,
                              .route_row = (const moe_tensor *const *)rr_c, .world = W, .experts = E, .rank = p, .shared = variant < 2 ? shc : NULL,
                              .shared_gate = variant == 0 ? gc : NULL};
        TRY(moe_combine(ctx, &a));
        a.out = og, a.weights = wg, a.ids = idg, a.ys = (const moe_tensor *const *)ys_g,
        a.route_row = (const moe_tensor *const *)rr_g, a.shared = variant < 2 ? shg : NULL,
        a.shared_gate = variant == 0 ? gg : NULL;
        TRY(moe_combine(ctx, &a));
        char name[128];
        snprintf(name, sizeof name, "combine T=%d K=%d H=%d rank %d %s out%s", T, K, H, p, moe_dtype_name(odt),
                 variant == 0 ? ", gated shared" : variant == 1 ? ", shared" : "");
        expect(name, og, oc, 1, 0);
        moe_tensor_free(oc), moe_tensor_free(og);
      }
      moe_tensor *all[] = {idc, idg, wc, wg, shc, shg, gc, gg};
      for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
    }
    for (int o = 0; o < W; o++) moe_tensor_free(ys_c[o]), moe_tensor_free(ys_g[o]);
  }
  for (int o = 0; o < W; o++) moe_tensor_free(rr_g[o]), sched_free(&s[o]);
  moe_tensor_free(ids);
}

static void test_combine(void) {
  const int hs[] = {256, 7168, 44, 9};
  test_combine_case(45, 6, 24, hs, 4);
  /* more tokens than blocks on the GPU (blocks take several), more routes than one look-up
   * group (64), rows wider than one pass of a block (15,360 elements, or 3,840 unaligned) */
  const int wide[] = {16, 20000, 4001};
  test_combine_case(700, 3, 24, wide, 3);
  const int narrow[] = {64, 7};
  test_combine_case(600, 70, 140, narrow, 2);
  /* no routes at all (K = 0): out is the shared expert, or 0, as on the CPU */
  test_combine_case(33, 0, 24, narrow, 2);
}

/* ---- graphs and events ---- */

static void test_graph_events(void) {
  const int W = 2, T = 64, K = 4, E = 16, H = 512;
  const int64_t C = (int64_t)W * T * K;
  moe_tensor *xg = NEW(MOE_BF16, GPU, W, T, H), *xsg = NEW(MOE_BF16, GPU, C, H);
  moe_tensor *prg = NEW(MOE_I32, GPU, C), *ptg = NEW(MOE_I32, GPU, C);
  moe_tensor *xc = NEW(MOE_BF16, CPU, W, T, H), *xsc = NEW(MOE_BF16, CPU, C, H);

  TRY(moe_graph_begin(ctx, GPU));
  moe_dispatch_args a = {.out = xsg, .x = xg, .peer_rank = prg, .peer_route = ptg, .k = K, .zero_fill = 1};
  int rc_d = moe_dispatch(ctx, &a);
  /* a host copy inside the capture is refused, without breaking the capture */
  int rc_copy = moe_tensor_copy(ctx, xg, xc);
  char copy_msg[256];
  snprintf(copy_msg, sizeof copy_msg, "%s", moe_errmsg(ctx));
  moe_graph *graph = NULL;
  int rc_end = moe_graph_end(ctx, &graph);
  check(rc_d == MOE_OK && rc_end == MOE_OK, "graph: dispatch captured (%s)", rc_end ? moe_errmsg(ctx) : "ok");
  check(rc_copy != MOE_OK && strstr(copy_msg, "copy: not allowed during graph capture") != NULL,
        "graph: a host copy during capture is refused: \"%s\"", copy_msg);
  if (!graph) return;

  for (int round = 0; round < 3; round++) {
    /* new inputs between replays, written outside the capture */
    moe_tensor *ids = random_ids(W, T, K, E, 31 + round, round == 1);
    sched_t s = schedule(ids, E, round % W, round + 1, C);
    TRY(moe_tensor_randn(ctx, xc, 1000 + round, 1.0f));
    TRY(moe_tensor_copy(ctx, xg, xc));
    TRY(moe_tensor_copy(ctx, prg, s.peer_rank));
    TRY(moe_tensor_copy(ctx, ptg, s.peer_route));
    TRY(moe_tensor_fill(ctx, xsg, 9.0));
    TRY(moe_graph_replay(ctx, graph));
    TRY(moe_ctx_synchronize(ctx, GPU));
    moe_dispatch_args ac = {.out = xsc, .x = xc, .peer_rank = s.peer_rank, .peer_route = s.peer_route, .k = K,
                            .zero_fill = 1};
    TRY(moe_dispatch(ctx, &ac));
    char name[64];
    snprintf(name, sizeof name, "graph replay %d of a dispatch on new inputs", round + 1);
    expect(name, xsg, xsc, 1, 0);
    sched_free(&s);
    moe_tensor_free(ids);
  }

  moe_event *e0, *e1;
  TRY(moe_event_new(ctx, GPU, &e0));
  TRY(moe_event_new(ctx, GPU, &e1));
  TRY(moe_event_record(ctx, e0));
  for (int i = 0; i < 10; i++) TRY(moe_graph_replay(ctx, graph));
  TRY(moe_event_record(ctx, e1));
  float ms = -1;
  TRY(moe_event_elapsed(ctx, e0, e1, &ms));
  check(ms >= 0 && isfinite(ms), "events: 10 replays took %.4f ms", ms);
  moe_event_free(e0), moe_event_free(e1);
  moe_graph_free(graph);
  moe_tensor *all[] = {xg, xsg, prg, ptg, xc, xsc};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
}

int main(void) {
  open_gpu_ctx();
  test_randn_fill();
  test_route();
  test_logits();
  test_dispatch();
  test_combine();
  test_graph_events();
  moe_ctx_close(ctx);
  printf("%s: %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
