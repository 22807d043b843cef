/* SPDX-License-Identifier: MIT */
/* test_world_gpu.c -- moe_world through NCCL, through the public API only.
 *
 * On one GPU: a world of one rank (ncclCommInitAll over {0}, and ncclCommInitRank of a world of
 * size 1 with a fresh unique id): all-gather of ids, the configuration check, and the exchange
 * dispatch and combine against the plain stages, bit for bit; then the same captured in a CUDA
 * graph.  With 2, 4, 8 GPUs: a world of that many ranks in this process against the simulated
 * world of as many ranks on cuda:0, bit for bit, and a configuration mismatch reported.
 * Worlds over communicators this program makes itself (moe_world_open_comm, where the build
 * gives it nccl.h: MOE_TEST_NCCL): one rank through the one-rank checks, and 1, 2, 4, 8 ranks,
 * one thread each, against a world of moe_world_open_local on the same inputs, bit for bit; each
 * communicator still works after its world is closed.
 * One PASS/FAIL line per check; exits 77 without a GPU or without NCCL, 1 on any failure. */
#include <string.h>

#include <cuda_runtime.h>
#ifdef MOE_TEST_NCCL
#include <nccl.h>
#include <pthread.h>
#endif

#include "gpu_test.h"

static moe_device gpu(int i) {
  moe_device d = {MOE_CUDA, i};
  return d;
}

#define T1(c, dt, dev, a) tnew_on(c, dt, dev, 1, (const int64_t[]){a})
#define T2(c, dt, dev, a, b) tnew_on(c, dt, dev, 2, (const int64_t[]){a, b})
#define T3(c, dt, dev, a, b, d) tnew_on(c, dt, dev, 3, (const int64_t[]){a, b, d})

/* Byte-equal contents (any devices). */
static int same(moe_ctx *c, const moe_tensor *a, const moe_tensor *b) {
  size_t n = moe_tensor_nbytes(a);
  if (n != moe_tensor_nbytes(b)) return 0;
  char *x = malloc(n ? n : 1), *y = malloc(n ? n : 1);
  if (!x || !y) exit(1);
  TRY_ON(c, moe_tensor_read(c, a, x, n));
  TRY_ON(c, moe_tensor_read(c, b, y, n));
  int eq = memcmp(x, y, n) == 0;
  free(x);
  free(y);
  return eq;
}

/* ids i32 [n, K] in [-1, E), about one in ten masked, on dev. */
static moe_tensor *random_ids(moe_ctx *c, moe_device dev, int n, int K, int E, unsigned seed) {
  int32_t *v = malloc((size_t)n * K * sizeof *v);
  if (!v) exit(1);
  srand(seed);
  for (int i = 0; i < n * K; i++) v[i] = rand() % 10 == 0 ? -1 : rand() % E;
  moe_tensor *t = T2(c, MOE_I32, dev, n, K);
  TRY_ON(c, moe_tensor_write(c, t, v, (size_t)n * K * sizeof *v));
  free(v);
  return t;
}

typedef struct Sched {
  moe_tensor *peer_rank, *peer_route, *counts, *tpe, *offsets, *route_row, *stats;
} Sched;

static Sched schedule(moe_ctx *c, moe_device dev, const moe_tensor *all_ids, int W, int T, int K, int E, int rank,
                      int pad, int C) {
  Sched s;
  int EL = E / W;
  s.peer_rank = T1(c, MOE_I32, dev, C);
  s.peer_route = T1(c, MOE_I32, dev, C);
  s.counts = T1(c, MOE_I32, dev, EL);
  s.tpe = T1(c, MOE_I32, dev, EL);
  s.offsets = T1(c, MOE_I32, dev, EL + 1);
  s.route_row = T2(c, MOE_I32, dev, W, (int64_t)T * K);
  s.stats = T1(c, MOE_I32, dev, MOE_SCHED_STATS);
  moe_schedule_args a = {s.peer_rank, s.peer_route, s.counts, s.tpe, s.offsets, s.route_row, s.stats,
                         all_ids, E, rank, pad, C, -1, MOE_LAYOUT_ROUNDROBIN};
  TRY_ON(c, moe_schedule(c, &a));
  return s;
}

static void sched_free(Sched *s) {
  moe_tensor_free(s->peer_rank), moe_tensor_free(s->peer_route), moe_tensor_free(s->counts);
  moe_tensor_free(s->tpe), moe_tensor_free(s->offsets), moe_tensor_free(s->route_row), moe_tensor_free(s->stats);
}

/* ---- one rank ---- */

/* The direct exchange of a world of one rank against the plain stages: x and ys given from
 * outside the windows and written into them, a graph replayed on new routing, bad sizes. */
static void direct_one_rank(moe_world *w, const char *how, moe_device d, Sched *s, moe_tensor *all, moe_tensor *ids,
                            moe_tensor *x, moe_tensor *ys, moe_tensor *wts, moe_schedule_args sa, int64_t T, int64_t K,
                            int64_t H, int64_t C) {
  const int E = sa.experts;
  moe_world_exchange *ex = NULL;
  int rc = moe_world_exchange_open(ctx, w, T, (int)K, H, C, &ex);
  check(rc == MOE_OK, "%s: direct exchange opens (%s)", how, rc ? moe_errmsg(ctx) : "ok");
  if (rc) return;
  moe_tensor *wx = NULL, *wys = NULL;
  TRY(moe_world_exchange_views(ctx, ex, 0, &wx, &wys));
  moe_tensor *x3 = T3(ctx, MOE_BF16, d, 1, T, H), *xs = T2(ctx, MOE_BF16, d, C, H), *xs_ref = T2(ctx, MOE_BF16, d, C, H);
  moe_tensor *out = T2(ctx, MOE_BF16, d, T, H), *ref = T2(ctx, MOE_BF16, d, T, H);
  moe_dispatch_args pa = {xs_ref, x3, s->peer_rank, s->peer_route, (int)K, 1};
  const moe_tensor *yl[] = {ys}, *rl[] = {s->route_row};
  moe_combine_args pc = {ref, wts, ids, yl, rl, 1, E, 0, NULL, NULL};
  moe_world_dispatch_args da = {xs, NULL, x, s->peer_rank, s->peer_route, (int)K, 1, s->route_row};
  moe_world_combine_args ca = {out, wts, ids, ys, s->route_row, NULL, NULL, NULL, NULL, E, NULL, NULL};
  for (int in_window = 0; in_window < 2; in_window++) {
    const char *where = in_window ? "x and ys in the windows" : "x and ys copied in";
    if (in_window) {
      TRY(moe_tensor_copy(ctx, wx, x));
      TRY(moe_tensor_copy(ctx, wys, ys));
      da.x = wx, ca.ys = wys;
    }
    TRY(moe_tensor_fill(ctx, xs, 7.0f));
    TRY(moe_tensor_fill(ctx, out, 7.0f));
    TRY(moe_tensor_copy(ctx, x3, x));
    TRY(moe_dispatch(ctx, &pa));
    TRY(moe_combine(ctx, &pc));
    TRY(moe_world_exchange_dispatch(ctx, ex, &da));
    TRY(moe_world_exchange_combine(ctx, ex, &ca));
    check(same(ctx, xs, xs_ref), "%s: direct dispatch equals dispatch bit for bit (%s)", how, where);
    check(same(ctx, out, ref), "%s: direct combine equals combine bit for bit (%s)", how, where);
  }
  da.x = x, ca.ys = ys;

  /* peer data that is no schedule's (rows pointing anywhere, repeats, out of range) with the
   * real route_row: the direct dispatch still gives what dispatch gives */
  {
    int32_t *pr = malloc(sizeof(int32_t) * (size_t)C), *pq = malloc(sizeof(int32_t) * (size_t)C);
    if (!pr || !pq) exit(1);
    srand(77);
    for (int64_t r = 0; r < C; r++) {
      pr[r] = rand() % 8 == 0 ? -1 + rand() % 3 * 2 /* -1 or 1: out of range */ : 0;
      pq[r] = rand() % 2 ? (int32_t)(r % (T * K)) : (int32_t)(rand() % (T * K + 6)) - 3;
    }
    moe_tensor *sp = T1(ctx, MOE_I32, d, C), *sq = T1(ctx, MOE_I32, d, C);
    TRY(moe_tensor_write(ctx, sp, pr, sizeof(int32_t) * (size_t)C));
    TRY(moe_tensor_write(ctx, sq, pq, sizeof(int32_t) * (size_t)C));
    moe_dispatch_args pb = pa;
    moe_world_dispatch_args db = da;
    pb.peer_rank = db.peer_rank = sp, pb.peer_route = db.peer_route = sq;
    TRY(moe_tensor_copy(ctx, x3, x));
    TRY(moe_tensor_fill(ctx, xs, 7.0f));
    TRY(moe_dispatch(ctx, &pb));
    TRY(moe_world_exchange_dispatch(ctx, ex, &db));
    check(same(ctx, xs, xs_ref), "%s: direct dispatch of peer data that is no schedule's equals dispatch", how);
    moe_tensor_free(sp), moe_tensor_free(sq);
    free(pr), free(pq);
  }

  /* captured with the schedule, replayed on new routing and tokens */
  moe_graph *g = NULL;
  TRY(moe_graph_begin(ctx, d));
  int r1 = moe_world_allgather_ids(ctx, w, &all, (const moe_tensor *const *)&ids);
  int r2 = moe_schedule(ctx, &sa);
  int r3 = moe_world_exchange_dispatch(ctx, ex, &da);
  int r4 = moe_world_exchange_combine(ctx, ex, &ca);
  int r5 = moe_graph_end(ctx, &g);
  check(!(r1 || r2 || r3 || r4 || r5), "%s: the direct exchange captures as a graph (%s)", how,
        r1 || r2 || r3 || r4 || r5 ? moe_errmsg(ctx) : "ok");
  for (int round = 0; g && round < 3; round++) {
    moe_tensor *ids2 = random_ids(ctx, CPU, (int)T, (int)K, E, 40 + round);
    TRY(moe_tensor_copy(ctx, ids, ids2));
    TRY(moe_tensor_randn(ctx, x, 50 + round, 1.0f));
    TRY(moe_tensor_randn(ctx, ys, 60 + round, 1.0f));
    TRY(moe_tensor_fill(ctx, xs, 7.0f));
    TRY(moe_tensor_fill(ctx, out, 7.0f));
    TRY(moe_graph_replay(ctx, g));
    TRY(moe_ctx_synchronize(ctx, d));
    TRY(moe_tensor_copy(ctx, x3, x));
    TRY(moe_dispatch(ctx, &pa));
    TRY(moe_combine(ctx, &pc));
    check(same(ctx, xs, xs_ref) && same(ctx, out, ref),
          "%s: direct replay %d on new routing equals dispatch and combine bit for bit", how, round);
    moe_tensor_free(ids2);
  }
  if (g) moe_graph_free(g);

  /* sizes that are not the exchange's, and its own buffers as outputs */
  moe_tensor *small = T2(ctx, MOE_BF16, d, C - 1, H);
  moe_world_combine_args bad = ca;
  bad.ys = small;
  rc = moe_world_exchange_combine(ctx, ex, &bad);
  check(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "differ from the exchange's"),
        "%s: a capacity other than the exchange's is refused: %s", how, moe_errmsg(ctx));
  moe_world_dispatch_args bd = da;
  bd.out = wys;
  rc = moe_world_exchange_dispatch(ctx, ex, &bd);
  check(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "out may not lie in the exchange's window"),
        "%s: out in the window is refused: %s", how, moe_errmsg(ctx));
  /* and an out that starts inside the window, a row past the start of its ys */
  moe_tensor *inside = NULL;
  TRY(moe_tensor_view(ctx, wys, H, 2, (const int64_t[]){moe_tensor_dim(ca.out, 0), H}, &inside));
  moe_world_combine_args bo = ca;
  bo.out = inside;
  rc = moe_world_exchange_combine(ctx, ex, &bo);
  check(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "out may not lie in the exchange's window"),
        "%s: an out inside the window is refused: %s", how, moe_errmsg(ctx));
  moe_tensor_free(inside);
  moe_tensor *ts[] = {x3, xs, xs_ref, out, ref, small, wx, wys};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
  moe_world_exchange_close(ex);
}

static void one_rank(moe_world *w, const char *how) {
  const int T = 45, K = 6, E = 12, H = 136, C = 512, pad = 8;
  const moe_device d = gpu(moe_world_local_device(w, 0));
  TRY(moe_world_bind(ctx, w, 0));
  check(moe_world_size(w) == 1 && moe_world_local_count(w) == 1 && moe_world_local_rank(w, 0) == 0,
        "%s: one rank, rank 0", how);

  moe_world_config cfg = {MOE_VERSION_NUMBER, 1, T, K, E, H, C, pad, MOE_LAYOUT_ROUNDROBIN, -1};
  int rc = moe_world_check_config(ctx, w, &cfg);
  check(rc == MOE_OK, "%s: check_config passes (%s)", how, rc ? moe_errmsg(ctx) : "ok");

  moe_tensor *ids = random_ids(ctx, d, T, K, E, 1), *all = T3(ctx, MOE_I32, d, 1, T, K);
  TRY(moe_world_allgather_ids(ctx, w, &all, (const moe_tensor *const *)&ids));
  check(same(ctx, all, ids), "%s: allgather_ids of one rank gives the ids back", how);

  Sched s = schedule(ctx, d, all, 1, T, K, E, 0, pad, C);
  moe_tensor *x = T2(ctx, MOE_BF16, d, T, H), *x_all = T3(ctx, MOE_BF16, d, 1, T, H);
  TRY(moe_tensor_randn(ctx, x, 7, 1.0f));
  moe_tensor *xs = T2(ctx, MOE_BF16, d, C, H), *xs_ref = T2(ctx, MOE_BF16, d, C, H);
  moe_world_dispatch_args da = {xs, x_all, x, s.peer_rank, s.peer_route, K, 1, s.route_row};
  TRY(moe_world_dispatch(ctx, w, &da));
  moe_dispatch_args pa = {xs_ref, x_all, s.peer_rank, s.peer_route, K, 1};
  TRY(moe_dispatch(ctx, &pa));
  check(same(ctx, x_all, x), "%s: dispatch gathers x", how);
  check(same(ctx, xs, xs_ref), "%s: world dispatch equals dispatch bit for bit", how);

  moe_tensor *ys = T2(ctx, MOE_BF16, d, C, H), *wts = T2(ctx, MOE_F32, d, T, K);
  TRY(moe_tensor_randn(ctx, ys, 8, 1.0f));
  TRY(moe_tensor_randn(ctx, wts, 9, 1.0f));
  moe_tensor *sr = T3(ctx, MOE_BF16, d, 1, (int64_t)T * K, H), *rr = T3(ctx, MOE_BF16, d, 1, (int64_t)T * K, H);
  moe_tensor *si = T2(ctx, MOE_I32, d, 1, (int64_t)T * K), *ri = T2(ctx, MOE_I32, d, 1, (int64_t)T * K);
  moe_tensor *out = T2(ctx, MOE_BF16, d, T, H), *ref = T2(ctx, MOE_BF16, d, T, H);
  moe_world_combine_args ca = {out, wts, ids, ys, s.route_row, sr, rr, si, ri, E, NULL, NULL};
  TRY(moe_world_combine(ctx, w, &ca));
  const moe_tensor *yl[] = {ys}, *rl[] = {s.route_row};
  moe_combine_args pc = {ref, wts, ids, yl, rl, 1, E, 0, NULL, NULL};
  TRY(moe_combine(ctx, &pc));
  check(same(ctx, out, ref), "%s: world combine equals combine bit for bit", how);

  /* the same exchange in a graph, replayed on other tokens and routing */
  moe_schedule_args sa = {s.peer_rank, s.peer_route, s.counts, s.tpe, s.offsets, s.route_row, s.stats,
                          all, E, 0, pad, C, -1, MOE_LAYOUT_ROUNDROBIN};
  moe_graph *g = NULL;
  TRY(moe_graph_begin(ctx, d));
  int r1 = moe_world_allgather_ids(ctx, w, &all, (const moe_tensor *const *)&ids);
  int r2 = moe_schedule(ctx, &sa);
  int r3 = moe_world_dispatch(ctx, w, &da);
  int r4 = moe_world_combine(ctx, w, &ca);
  int r5 = moe_graph_end(ctx, &g);
  check(!(r1 || r2 || r3 || r4 || r5), "%s: the exchange captures as a graph (%s)", how,
        r1 || r2 || r3 || r4 || r5 ? moe_errmsg(ctx) : "ok");
  if (r1 || r2 || r3 || r4 || r5) {
    /* which steps capture: each alone in a graph of its own (a fill first, as a control) */
    { /* control: a fill captured by a context of its own (its own stream) in this process */
      moe_ctx *c2 = NULL;
      moe_graph *gs = NULL;
      TRY(moe_ctx_open(&c2));
      int rc2 = moe_graph_begin(c2, d);
      if (!rc2) rc2 = moe_tensor_fill(c2, out, 0.0f);
      const int re2 = moe_graph_end(c2, &gs);
      printf("%s %s: capture of a fill by another context: %s\n", rc2 || re2 ? "NOTE" : "PASS", how,
             rc2 || re2 ? moe_errmsg(c2) : "ok");
      if (gs) moe_graph_free(gs);
      moe_ctx_close(c2);
    }
    for (int step = 0; step < 5; step++) {
      static const char *names[] = {"a fill", "allgather_ids", "schedule", "dispatch", "combine"};
      moe_graph *gs = NULL;
      TRY(moe_graph_begin(ctx, d));
      const int rs = step == 0   ? moe_tensor_fill(ctx, out, 0.0f)
                     : step == 1 ? moe_world_allgather_ids(ctx, w, &all, (const moe_tensor *const *)&ids)
                     : step == 2 ? moe_schedule(ctx, &sa)
                     : step == 3 ? moe_world_dispatch(ctx, w, &da)
                                 : moe_world_combine(ctx, w, &ca);
      char msg[512];
      snprintf(msg, sizeof msg, "%s", rs ? moe_errmsg(ctx) : "");
      const int re = moe_graph_end(ctx, &gs);
      printf("%s %s: capture of %s alone: %s%s\n", rs || re ? "NOTE" : "PASS", how, names[step],
             rs ? msg : re ? moe_errmsg(ctx) : "ok", rs ? " (the call)" : re ? " (graph end)" : "");
      if (gs) moe_graph_free(gs);
    }
  }
  if (g) {
    moe_tensor *ids2 = random_ids(ctx, CPU, T, K, E, 2);
    TRY(moe_tensor_copy(ctx, ids, ids2));
    TRY(moe_tensor_randn(ctx, x, 17, 1.0f));
    TRY(moe_graph_replay(ctx, g));
    TRY(moe_ctx_synchronize(ctx, d));
    Sched s2 = schedule(ctx, d, all, 1, T, K, E, 0, pad, C);
    check(same(ctx, s2.route_row, s.route_row), "%s: replay: schedule of the new routing", how);
    check(same(ctx, x_all, x), "%s: replay: dispatch gathers the new x", how);
    TRY(moe_dispatch(ctx, &pa));
    check(same(ctx, xs, xs_ref), "%s: replay: dispatch equals dispatch bit for bit", how);
    TRY(moe_combine(ctx, &pc));
    check(same(ctx, out, ref), "%s: replay: combine equals combine bit for bit", how);
    sched_free(&s2);
    moe_tensor_free(ids2);
    moe_graph_free(g);
  }
  direct_one_rank(w, how, d, &s, all, ids, x, ys, wts, sa, T, K, H, C);
  sched_free(&s);
  moe_tensor *ts[] = {ids, all, x, x_all, xs, xs_ref, ys, wts, sr, rr, si, ri, out, ref};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
  TRY(moe_world_unbind(ctx, w));
}

/* ---- W ranks in this process (cuda:0 .. W-1) against the simulated world on cuda:0 ---- */

enum { MAXW = 8 };

/* The hard case's routing of rank r: the last rank has no tokens (all ids -1); the others send
 * nothing to rank 0's experts and 90% of their routes to rank 1's, whose rows overflow a small
 * capacity while the other ranks' do not. */
static moe_tensor *hard_ids(moe_ctx *c, moe_device dev, int r, int W, int T, int K, int E, unsigned seed) {
  const int EL = E / W;
  int32_t *v = malloc((size_t)T * K * sizeof *v);
  if (!v) exit(1);
  srand(seed);
  for (int i = 0; i < T * K; i++) {
    if (r == W - 1) v[i] = -1;
    else if (W == 2 || rand() % 10 != 0) v[i] = EL + rand() % EL;
    else v[i] = 2 * EL + rand() % (E - 2 * EL);
  }
  moe_tensor *t = T2(c, MOE_I32, dev, T, K);
  TRY_ON(c, moe_tensor_write(c, t, v, (size_t)T * K * sizeof *v));
  free(v);
  return t;
}

static int32_t dropped(moe_ctx *c, const moe_tensor *stats) {
  int32_t st[MOE_SCHED_STATS];
  TRY_ON(c, moe_tensor_read(c, stats, st, sizeof st));
  return st[2];
}

static void ranks(int W, int hard) {
  const int T = 33, K = 4, E = 8, H = 64, C = hard ? 40 : 400, pad = hard ? 1 : 4;
  const char *tag = hard ? " hard" : "";
  int devs[MAXW] = {0};
  for (int r = 0; r < W; r++) devs[r] = r;
  moe_world *w = NULL;
  TRY(moe_world_open_local(ctx, W, devs, &w));
  moe_ctx *rc_[MAXW];
  for (int r = 0; r < W; r++) {
    TRY(moe_ctx_open(&rc_[r]));
    TRY_ON(rc_[r], moe_world_bind(rc_[r], w, r));
  }

  moe_world_config cfgs[MAXW];
  for (int r = 0; r < W; r++) cfgs[r] = (moe_world_config){MOE_VERSION_NUMBER, W, T, K, E, H, C, pad, 0, -1};
  int rc = moe_world_check_config(ctx, w, cfgs);
  check(rc == MOE_OK, "W=%d%s: equal configurations pass (%s)", W, tag, rc ? moe_errmsg(ctx) : "ok");
  cfgs[W - 1].tokens = T + 1;
  rc = moe_world_check_config(ctx, w, cfgs);
  char want[96];
  snprintf(want, sizeof want, "tokens is 33 on rank 0 but 34 on rank %d", W - 1);
  check(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), want), "W=%d%s: a mismatch is reported: %s", W, tag, moe_errmsg(ctx));

  /* each rank's ids, tokens, expert outputs and weights; the simulated world's copies on cuda:0 */
  moe_tensor *ids[MAXW], *all[MAXW], *x[MAXW], *x_all[MAXW], *xs[MAXW], *ys[MAXW], *wts[MAXW], *out[MAXW];
  moe_tensor *sr[MAXW], *rr[MAXW], *si[MAXW], *ri[MAXW];
  Sched s[MAXW];
  moe_tensor *sim_ids = T3(ctx, MOE_I32, gpu(0), W, T, K), *sim_x = T3(ctx, MOE_BF16, gpu(0), W, T, H);
  for (int r = 0; r < W; r++) {
    moe_ctx *c = rc_[r];
    ids[r] = hard ? hard_ids(c, gpu(r), r, W, T, K, E, 10 + r) : random_ids(c, gpu(r), T, K, E, 10 + r);
    all[r] = T3(c, MOE_I32, gpu(r), W, T, K);
    x[r] = T2(c, MOE_BF16, gpu(r), T, H);
    TRY_ON(c, moe_tensor_randn(c, x[r], 100 + r, 1.0f));
    x_all[r] = T3(c, MOE_BF16, gpu(r), W, T, H);
    xs[r] = T2(c, MOE_BF16, gpu(r), C, H);
    ys[r] = T2(c, MOE_BF16, gpu(r), C, H);
    TRY_ON(c, moe_tensor_randn(c, ys[r], 200 + r, 1.0f));
    wts[r] = T2(c, MOE_F32, gpu(r), T, K);
    TRY_ON(c, moe_tensor_randn(c, wts[r], 300 + r, 1.0f));
    out[r] = T2(c, MOE_BF16, gpu(r), T, H);
    sr[r] = T3(c, MOE_BF16, gpu(r), W, (int64_t)T * K, H), rr[r] = T3(c, MOE_BF16, gpu(r), W, (int64_t)T * K, H);
    si[r] = T2(c, MOE_I32, gpu(r), W, (int64_t)T * K), ri[r] = T2(c, MOE_I32, gpu(r), W, (int64_t)T * K);
    TRY_ON(c, moe_ctx_synchronize(c, gpu(r))); /* the copies below run on ctx's stream */
    moe_tensor *v;
    TRY(moe_tensor_view(ctx, sim_ids, (int64_t)r * T * K, 2, (const int64_t[]){T, K}, &v));
    TRY(moe_tensor_copy(ctx, v, ids[r]));
    moe_tensor_free(v);
    TRY(moe_tensor_view(ctx, sim_x, (int64_t)r * T * H, 2, (const int64_t[]){T, H}, &v));
    TRY(moe_tensor_copy(ctx, v, x[r]));
    moe_tensor_free(v);
  }
  TRY(moe_world_allgather_ids(ctx, w, all, (const moe_tensor *const *)ids));
  for (int r = 0; r < W; r++) check(same(ctx, all[r], sim_ids), "W=%d%s: rank %d: allgather_ids gives every rank's ids", W, tag, r);
  for (int r = 0; r < W; r++) s[r] = schedule(rc_[r], gpu(r), all[r], W, T, K, E, r, pad, C);
  for (int r = 0; r < W; r++) TRY_ON(rc_[r], moe_ctx_synchronize(rc_[r], gpu(r)));
  if (hard) {
    const int32_t d0 = dropped(ctx, s[0].stats), d1 = dropped(ctx, s[1].stats);
    int32_t dl = 0;
    for (int r = 2; r < W; r++) dl += dropped(ctx, s[r].stats);
    check(d0 == 0 && d1 > 0 && dl == 0,
          "W=%d hard: rank 0's experts get nothing, rank 1 overflows (%d routes dropped), the others do not (%d, %d)", W,
          d1, d0, dl);
  }
  moe_world_dispatch_args da[MAXW];
  moe_world_combine_args ca[MAXW];
  for (int r = 0; r < W; r++) {
    moe_world_dispatch_args d = {xs[r], x_all[r], x[r], s[r].peer_rank, s[r].peer_route, K, 1, s[r].route_row};
    moe_world_combine_args c = {out[r], wts[r], ids[r], ys[r], s[r].route_row, sr[r], rr[r], si[r], ri[r], E, NULL, NULL};
    da[r] = d, ca[r] = c;
  }
  TRY(moe_world_dispatch(ctx, w, da));
  TRY(moe_world_combine(ctx, w, ca));

  /* the direct exchange: the same bits as the all-gather one (checked against the simulated
   * world below), twice in a row (the barriers' second round) */
  moe_world_exchange *ex = NULL;
  rc = moe_world_exchange_open(ctx, w, T, K, H, C, &ex);
  check(rc == MOE_OK, "W=%d%s: direct exchange opens (%s)", W, tag, rc ? moe_errmsg(ctx) : "ok");
  for (int round = 0; ex && round < 2; round++) {
    moe_world_dispatch_args dd[MAXW];
    moe_world_combine_args dc[MAXW];
    moe_tensor *dxs[MAXW], *dout[MAXW];
    for (int r = 0; r < W; r++) {
      dxs[r] = T2(rc_[r], MOE_BF16, gpu(r), C, H), dout[r] = T2(rc_[r], MOE_BF16, gpu(r), T, H);
      TRY_ON(rc_[r], moe_tensor_fill(rc_[r], dxs[r], 7.0f));
      TRY_ON(rc_[r], moe_tensor_fill(rc_[r], dout[r], 7.0f));
      dd[r] = da[r], dc[r] = ca[r];
      dd[r].out = dxs[r], dd[r].x_all = NULL, dc[r].out = dout[r];
    }
    TRY(moe_world_exchange_dispatch(ctx, ex, dd));
    TRY(moe_world_exchange_combine(ctx, ex, dc));
    for (int r = 0; r < W; r++) {
      TRY_ON(rc_[r], moe_ctx_synchronize(rc_[r], gpu(r)));
      check(same(ctx, dxs[r], xs[r]), "W=%d%s: round %d: rank %d: direct dispatch equals the all-gather one", W, tag, round, r);
      check(same(ctx, dout[r], out[r]), "W=%d%s: round %d: rank %d: direct combine equals the all-gather one", W, tag, round, r);
      moe_tensor_free(dxs[r]), moe_tensor_free(dout[r]);
    }
  }
  moe_world_exchange_close(ex);

  /* the simulated world on cuda:0 */
  const moe_tensor *sim_ys[MAXW], *sim_rr[MAXW];
  Sched ss[MAXW];
  for (int r = 0; r < W; r++) {
    ss[r] = schedule(ctx, gpu(0), sim_ids, W, T, K, E, r, pad, C);
    check(same(ctx, ss[r].route_row, s[r].route_row) && same(ctx, ss[r].peer_rank, s[r].peer_rank) &&
              same(ctx, ss[r].peer_route, s[r].peer_route),
          "W=%d%s: rank %d: schedule equals the simulated world's", W, tag, r);
    moe_tensor *ref_xs = T2(ctx, MOE_BF16, gpu(0), C, H);
    moe_dispatch_args d = {ref_xs, sim_x, ss[r].peer_rank, ss[r].peer_route, K, 1};
    TRY(moe_dispatch(ctx, &d));
    check(same(ctx, ref_xs, xs[r]), "W=%d%s: rank %d: dispatch equals the simulated world's bit for bit", W, tag, r);
    moe_tensor_free(ref_xs);
    moe_tensor *y0 = T2(ctx, MOE_BF16, gpu(0), C, H);
    TRY(moe_tensor_copy(ctx, y0, ys[r]));
    sim_ys[r] = y0;
    sim_rr[r] = ss[r].route_row;
  }
  for (int p = 0; p < W; p++) {
    moe_tensor *ref = T2(ctx, MOE_BF16, gpu(0), T, H), *w0 = T2(ctx, MOE_F32, gpu(0), T, K), *i0;
    TRY(moe_tensor_copy(ctx, w0, wts[p]));
    TRY(moe_tensor_view(ctx, sim_ids, (int64_t)p * T * K, 2, (const int64_t[]){T, K}, &i0));
    moe_combine_args c = {ref, w0, i0, sim_ys, sim_rr, W, E, p, NULL, NULL};
    TRY(moe_combine(ctx, &c));
    check(same(ctx, ref, out[p]), "W=%d%s: rank %d: combine equals the simulated world's bit for bit", W, tag, p);
    moe_tensor_free(ref), moe_tensor_free(w0), moe_tensor_free(i0);
  }
  for (int r = 0; r < W; r++) {
    moe_tensor_free((moe_tensor *)sim_ys[r]);
    sched_free(&ss[r]);
    sched_free(&s[r]);
    moe_tensor *ts[] = {ids[r], all[r], x[r], x_all[r], xs[r], ys[r], wts[r], out[r], sr[r], rr[r], si[r], ri[r]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
    TRY_ON(rc_[r], moe_world_unbind(rc_[r], w));
    moe_ctx_close(rc_[r]);
  }
  moe_tensor_free(sim_ids), moe_tensor_free(sim_x);
  moe_world_close(w);
}

/* A context that serves two streams in turn (as one serving several ranks does) keeps one
 * scratch block for each: the device memory it holds stays flat over many alternations (the
 * single block it used to keep was replaced, and doubled, at every switch). */
static void alternating_streams(void) {
  const int W = 2, T = 700, K = 8, E = 64, C = W * T * K;
  moe_ctx *c = NULL;
  TRY(moe_ctx_open(&c));
  cudaStream_t s[2];
  for (int i = 0; i < 2; i++)
    if (cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking) != cudaSuccess) exit(1);
  moe_tensor *all = random_ids(c, gpu(0), W * T, K, E, 5), *all3;
  TRY_ON(c, moe_tensor_view(c, all, 0, 3, (const int64_t[]){W, T, K}, &all3));
  Sched sc = schedule(c, gpu(0), all3, W, T, K, E, 0, 1, C);
  size_t free0 = 0, free1 = 0, total = 0;
  moe_schedule_args sa = {sc.peer_rank, sc.peer_route, sc.counts, sc.tpe, sc.offsets, sc.route_row, sc.stats,
                          all3, E, 0, 1, C, -1, MOE_LAYOUT_ROUNDROBIN};
  for (int round = 0; round < 64; round++) {
    TRY_ON(c, moe_ctx_set_stream(c, s[round % 2]));
    TRY_ON(c, moe_schedule(c, &sa));
    TRY_ON(c, moe_ctx_synchronize(c, gpu(0)));
    if (round == 1 && cudaMemGetInfo(&free0, &total) != cudaSuccess) exit(1);
  }
  if (cudaMemGetInfo(&free1, &total) != cudaSuccess) exit(1);
  const double grew = ((double)free0 - (double)free1) / (1 << 20);
  check(grew < 16, "a context alternating two streams 64 times holds %.1f MiB more than after the first two", grew);
  sched_free(&sc);
  moe_tensor_free(all3), moe_tensor_free(all);
  TRY_ON(c, moe_ctx_set_stream(c, NULL));
  moe_ctx_close(c);
  for (int i = 0; i < 2; i++) cudaStreamDestroy(s[i]);
}

#ifdef MOE_TEST_NCCL
/* ---- worlds over the caller's communicators ---- */

/* One all-reduce of (rank + 1) on comm, from the calling thread: the communicator still works. */
static int comm_sums(ncclComm_t comm, int device, int rank, int W) {
  if (cudaSetDevice(device) != cudaSuccess) return 0;
  int *buf = NULL, got = -1, one = rank + 1;
  cudaStream_t s;
  if (cudaMalloc((void **)&buf, sizeof(int)) != cudaSuccess || cudaStreamCreate(&s) != cudaSuccess) return 0;
  int ok = cudaMemcpy(buf, &one, sizeof one, cudaMemcpyHostToDevice) == cudaSuccess &&
           ncclAllReduce(buf, buf, 1, ncclInt32, ncclSum, comm, s) == ncclSuccess && cudaStreamSynchronize(s) == cudaSuccess &&
           cudaMemcpy(&got, buf, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(buf);
  cudaStreamDestroy(s);
  return ok && got == W * (W + 1) / 2;
}

/* One rank's part: its inputs (made by the main thread), its communicator, what it got. */
typedef struct CommRank {
  int r, W, T, K, E, H, C, pad;
  ncclComm_t comm;
  moe_tensor *ids, *x, *ys, *wts;                /* inputs, on cuda:r */
  moe_tensor *all, *xs, *out, *dxs, *dout;       /* results, on cuda:r */
  int size, rank, count, device, direct_rc, sums; /* what the world said, and the checks' verdicts */
  char direct_msg[256];
} CommRank;

static void *comm_rank_main(void *arg) {
  CommRank *a = arg;
  const moe_device d = gpu(a->r);
  moe_ctx *c = NULL;
  TRY_ON(c, moe_ctx_open(&c));
  moe_world *w = NULL;
  TRY_ON(c, moe_world_open_comm(c, a->comm, a->r, &w));
  a->size = moe_world_size(w), a->rank = moe_world_local_rank(w, 0), a->count = moe_world_local_count(w);
  a->device = moe_world_local_device(w, 0);
  TRY_ON(c, moe_world_bind(c, w, 0));
  const int64_t TK = (int64_t)a->T * a->K;
  a->all = tnew_on(c, MOE_I32, d, 3, SHAPE(a->W, a->T, a->K));
  TRY_ON(c, moe_world_allgather_ids(c, w, &a->all, (const moe_tensor *const *)&a->ids));
  Sched s = schedule(c, d, a->all, a->W, a->T, a->K, a->E, a->r, a->pad, a->C);
  moe_tensor *x_all = tnew_on(c, MOE_BF16, d, 3, SHAPE(a->W, a->T, a->H));
  moe_tensor *sr = tnew_on(c, MOE_BF16, d, 3, SHAPE(a->W, TK, a->H)), *rr = tnew_on(c, MOE_BF16, d, 3, SHAPE(a->W, TK, a->H));
  moe_tensor *si = tnew_on(c, MOE_I32, d, 2, SHAPE(a->W, TK)), *ri = tnew_on(c, MOE_I32, d, 2, SHAPE(a->W, TK));
  a->xs = tnew_on(c, MOE_BF16, d, 2, SHAPE(a->C, a->H)), a->out = tnew_on(c, MOE_BF16, d, 2, SHAPE(a->T, a->H));
  moe_world_dispatch_args da = {a->xs, x_all, a->x, s.peer_rank, s.peer_route, a->K, 1, s.route_row};
  moe_world_combine_args ca = {a->out, a->wts, a->ids, a->ys, s.route_row, sr, rr, si, ri, a->E, NULL, NULL};
  TRY_ON(c, moe_world_dispatch(c, w, &da));
  TRY_ON(c, moe_world_combine(c, w, &ca));
  /* the direct exchange over the same communicator */
  moe_world_exchange *ex = NULL;
  a->direct_rc = moe_world_exchange_open(c, w, a->T, a->K, a->H, a->C, &ex);
  snprintf(a->direct_msg, sizeof a->direct_msg, "%s", a->direct_rc ? moe_errmsg(c) : "ok");
  if (ex) {
    a->dxs = tnew_on(c, MOE_BF16, d, 2, SHAPE(a->C, a->H)), a->dout = tnew_on(c, MOE_BF16, d, 2, SHAPE(a->T, a->H));
    moe_world_dispatch_args dd = da;
    moe_world_combine_args dc = ca;
    dd.out = a->dxs, dd.x_all = NULL, dc.out = a->dout;
    TRY_ON(c, moe_world_exchange_dispatch(c, ex, &dd));
    TRY_ON(c, moe_world_exchange_combine(c, ex, &dc));
    moe_world_exchange_close(ex);
  }
  TRY_ON(c, moe_ctx_synchronize(c, d));
  TRY_ON(c, moe_world_unbind(c, w));
  moe_world_close(w);
  a->sums = comm_sums(a->comm, a->r, a->r, a->W); /* moelab left the communicator as it was */
  sched_free(&s);
  moe_tensor *ts[] = {x_all, sr, rr, si, ri};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
  moe_ctx_close(c);
  return NULL;
}

/* W ranks, one thread each, each a world over one of the W communicators ncclCommInitAll made,
 * against a world of moe_world_open_local on the same inputs. */
static void caller_comms(int W) {
  const int T = 29, K = 4, E = 8 * W, H = 72, C = 4 * 29 * 4, pad = 2;
  int devs[MAXW] = {0};
  CommRank a[MAXW];
  memset(a, 0, sizeof a);
  for (int r = 0; r < W; r++) {
    devs[r] = r;
    CommRank *p = &a[r];
    p->r = r, p->W = W, p->T = T, p->K = K, p->E = E, p->H = H, p->C = C, p->pad = pad;
    p->ids = random_ids(ctx, gpu(r), T, K, E, 500 + r);
    p->x = T2(ctx, MOE_BF16, gpu(r), T, H), p->ys = T2(ctx, MOE_BF16, gpu(r), C, H), p->wts = T2(ctx, MOE_F32, gpu(r), T, K);
    TRY(moe_tensor_randn(ctx, p->x, 600 + r, 1.0f));
    TRY(moe_tensor_randn(ctx, p->ys, 700 + r, 1.0f));
    TRY(moe_tensor_randn(ctx, p->wts, 800 + r, 1.0f));
    TRY(moe_ctx_synchronize(ctx, gpu(r)));
  }

  /* the reference: the same steps on a world of moe_world_open_local */
  moe_world *lw = NULL;
  TRY(moe_world_open_local(ctx, W, devs, &lw));
  moe_tensor *all[MAXW], *xs[MAXW], *out[MAXW], *x_all[MAXW], *sr[MAXW], *rr[MAXW], *si[MAXW], *ri[MAXW];
  Sched s[MAXW];
  moe_world_dispatch_args da[MAXW];
  moe_world_combine_args ca[MAXW];
  const int64_t TK = (int64_t)T * K;
  for (int r = 0; r < W; r++) all[r] = T3(ctx, MOE_I32, gpu(r), W, T, K);
  const moe_tensor *ids[MAXW];
  for (int r = 0; r < W; r++) ids[r] = a[r].ids;
  TRY(moe_world_allgather_ids(ctx, lw, all, ids));
  for (int r = 0; r < W; r++) {
    TRY(moe_world_bind(ctx, lw, r));
    s[r] = schedule(ctx, gpu(r), all[r], W, T, K, E, r, pad, C);
    x_all[r] = T3(ctx, MOE_BF16, gpu(r), W, T, H), xs[r] = T2(ctx, MOE_BF16, gpu(r), C, H);
    out[r] = T2(ctx, MOE_BF16, gpu(r), T, H);
    sr[r] = T3(ctx, MOE_BF16, gpu(r), W, TK, H), rr[r] = T3(ctx, MOE_BF16, gpu(r), W, TK, H);
    si[r] = T2(ctx, MOE_I32, gpu(r), W, TK), ri[r] = T2(ctx, MOE_I32, gpu(r), W, TK);
    moe_world_dispatch_args dd = {xs[r], x_all[r], a[r].x, s[r].peer_rank, s[r].peer_route, K, 1, s[r].route_row};
    moe_world_combine_args cc = {out[r], a[r].wts, a[r].ids, a[r].ys, s[r].route_row, sr[r], rr[r], si[r], ri[r], E, NULL, NULL};
    da[r] = dd, ca[r] = cc;
  }
  TRY(moe_world_unbind(ctx, lw));
  TRY(moe_world_dispatch(ctx, lw, da));
  TRY(moe_world_combine(ctx, lw, ca));
  moe_world_close(lw);

  ncclComm_t comms[MAXW];
  if (ncclCommInitAll(comms, W, devs) != ncclSuccess) {
    check(0, "W=%d caller's communicators: ncclCommInitAll failed", W);
    return;
  }
  pthread_t th[MAXW];
  for (int r = 0; r < W; r++) {
    a[r].comm = comms[r];
    if (pthread_create(&th[r], NULL, comm_rank_main, &a[r])) exit(1);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    const CommRank *p = &a[r];
    check(p->size == W && p->rank == r && p->count == 1 && p->device == r,
          "W=%d caller's communicators: rank %d: the world says size %d, rank %d, %d local, cuda:%d", W, r, p->size,
          p->rank, p->count, p->device);
    check(same(ctx, p->all, all[r]), "W=%d caller's communicators: rank %d: allgather_ids equals open_local's", W, r);
    check(same(ctx, p->xs, xs[r]), "W=%d caller's communicators: rank %d: dispatch equals open_local's bit for bit", W, r);
    check(same(ctx, p->out, out[r]), "W=%d caller's communicators: rank %d: combine equals open_local's bit for bit", W, r);
    check(p->direct_rc == MOE_OK, "W=%d caller's communicators: rank %d: the direct exchange opens (%s)", W, r,
          p->direct_msg);
    if (p->dxs)
      check(same(ctx, p->dxs, xs[r]) && same(ctx, p->dout, out[r]),
            "W=%d caller's communicators: rank %d: the direct exchange equals open_local's all-gather one", W, r);
    check(p->sums, "W=%d caller's communicators: rank %d: the communicator still all-reduces after the world closed", W, r);
  }
  for (int r = 0; r < W; r++) {
    check(ncclCommDestroy(comms[r]) == ncclSuccess, "W=%d caller's communicators: rank %d: the caller destroys it", W, r);
    sched_free(&s[r]);
    moe_tensor *ts[] = {a[r].ids, a[r].x, a[r].ys, a[r].wts, a[r].all, a[r].xs, a[r].out, a[r].dxs, a[r].dout,
                        all[r], xs[r], out[r], x_all[r], sr[r], rr[r], si[r], ri[r]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
  }
}

/* One rank over a communicator of one: every one-rank check, then the refusals. */
static void caller_comm_one(int n) {
  ncclComm_t comm = NULL;
  const int dev0[1] = {0};
  if (ncclCommInitAll(&comm, 1, dev0) != ncclSuccess) {
    check(0, "W=1 caller's communicator: ncclCommInitAll failed");
    return;
  }
  moe_world *w = NULL;
  TRY(moe_world_open_comm(ctx, comm, 0, &w));
  one_rank(w, "W=1 caller's communicator");
  moe_world_close(w);
  check(comm_sums(comm, 0, 0, 1), "W=1 caller's communicator: it still all-reduces after the world closed");
  int rc = moe_world_open_comm(ctx, comm, n, &w);
  check(rc == MOE_ERR_ARG && w == NULL && strstr(moe_errmsg(ctx), "does not exist"),
        "a device that does not exist is refused: %s", moe_errmsg(ctx));
  if (n >= 2) {
    rc = moe_world_open_comm(ctx, comm, 1, &w);
    check(rc == MOE_ERR_ARG && w == NULL && strstr(moe_errmsg(ctx), "the communicator's GPU is cuda:0, but device is 1"),
          "a device other than the communicator's is refused: %s", moe_errmsg(ctx));
  }
  check(ncclCommDestroy(comm) == ncclSuccess, "W=1 caller's communicator: the caller destroys it");
}
#endif

int main(void) {
  TRY(moe_ctx_open(&ctx));
  int n = 0;
  TRY(moe_device_count(ctx, MOE_CUDA, &n));
  if (n == 0) {
    printf("SKIP no GPU\n");
    return 77;
  }
  alternating_streams();
  moe_world *w = NULL;
  int rc = moe_world_open_local(ctx, 1, (const int[]){0}, &w);
  if (rc == MOE_ERR_UNSUPPORTED) {
    printf("SKIP %s\n", moe_errmsg(ctx));
    return 77;
  }
  TRY(rc);
  one_rank(w, "W=1 local");
  moe_world_close(w);

  char hex[MOE_WORLD_ID_HEX + 1];
  TRY(moe_world_unique_id(ctx, hex, sizeof hex));
  check(strlen(hex) == MOE_WORLD_ID_HEX, "unique id: %d hex digits", MOE_WORLD_ID_HEX);
  w = NULL;
  TRY(moe_world_open_rank(ctx, 0, 1, 0, hex, &w));
  one_rank(w, "W=1 rank");
  moe_world_close(w);

  rc = moe_world_open_rank(ctx, 0, 1, 0, "12zz", &w);
  check(rc == MOE_ERR_ARG && w == NULL, "a malformed id is refused: %s", moe_errmsg(ctx));

  for (int W = 2; W <= MAXW; W *= 2)
    if (n >= W) ranks(W, 0), ranks(W, 1);
    else printf("SKIP W=%d: %d GPU%s visible\n", W, n, n == 1 ? "" : "s");

#ifdef MOE_TEST_NCCL
  caller_comm_one(n);
  for (int W = 1; W <= MAXW; W *= 2)
    if (n >= W) caller_comms(W);
#else
  printf("SKIP worlds over the caller's communicators: built without nccl.h for the tests\n");
#endif

  moe_ctx_close(ctx);
  printf("%s: %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
