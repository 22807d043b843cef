/* SPDX-License-Identifier: MIT */
/* dispatch_combine_bench.c -- dispatch and combine timed at the Kimi K2 rank-of-EP8 shape.
 *
 *   build/bench/dispatch_combine_bench
 *
 * Eight ranks of 7,168 tokens, each routed to 8 of 384 experts at random, H = 7168; rank 0's
 * schedule on the CPU (capacity: every route plus 1,024 rows).  Dispatch gathers rank 0's rows
 * from all ranks' tokens; combine sums rank 0's tokens' 8 routes from the eight owners' expert
 * outputs.  Each is first run once on the GPU and on the CPU and must match bit for bit (one
 * PASS/FAIL line each), then timed with device events around each run: three warm-up runs, the
 * median of 21.  One line each:
 *   bench dispatch Kimi K2 rank 0 of EP8: 57344 rows x 7168, X ms, Y TB/s (read + write; H200 ~4.8 peak)
 *   bench combine Kimi K2 rank 0 of EP8: 7168 tokens x 8 routes x 7168, X ms, Y TB/s (read + write)
 * Exit status: 0; 1 when a result differs from the CPU's or a call fails; 77 without a GPU. */
#include <stdlib.h>
#include <string.h>

#include "dispatch_test.h"

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* The median over iters runs (at most 64) after a warm-up, timed with device events. */
static float time_ms(void (*fn)(void *), void *arg, int iters) {
  moe_event *e0, *e1;
  float ms[64];
  if (iters > 64) iters = 64;
  TRY(moe_event_new(ctx, GPU, &e0));
  TRY(moe_event_new(ctx, GPU, &e1));
  for (int i = 0; i < 3; i++) fn(arg);
  for (int i = 0; i < iters; i++) {
    TRY(moe_event_record(ctx, e0));
    fn(arg);
    TRY(moe_event_record(ctx, e1));
    TRY(moe_event_elapsed(ctx, e0, e1, &ms[i]));
  }
  moe_event_free(e0), moe_event_free(e1);
  qsort(ms, (size_t)iters, sizeof ms[0], cmp_float);
  return iters % 2 ? ms[iters / 2] : (ms[iters / 2 - 1] + ms[iters / 2]) / 2;
}

static void run_dispatch(void *a) { TRY(moe_dispatch(ctx, a)); }
static void run_combine(void *a) { TRY(moe_combine(ctx, a)); }

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  open_gpu_ctx();
  enum { W = 8, T = 7168, K = 8, E = 384, H = 7168 };
  moe_tensor *ids = random_ids(W, T, K, E, 41, 0);
  const int64_t C = (int64_t)T * K + 1024;
  sched_t s[W];
  moe_tensor *rr_g[W], *ys_g[W], *ys_c[W];
  for (int o = 0; o < W; o++) {
    s[o] = schedule(ids, E, o, 1, C);
    rr_g[o] = copy_to(s[o].route_row, GPU);
    ys_g[o] = NEW(MOE_BF16, GPU, C, H);
    TRY(moe_tensor_randn(ctx, ys_g[o], 60 + o, 1.0f));
    ys_c[o] = copy_to(ys_g[o], CPU);
  }
  const int32_t used = ((const int32_t *)moe_tensor_data(s[0].stats))[MOE_STAT_ROWS_USED];

  /* dispatch: outputs poisoned alike, so rows it must not write are compared too */
  moe_tensor *xg = NEW(MOE_BF16, GPU, W, T, H), *xsg = NEW(MOE_BF16, GPU, C, H), *xsc = NEW(MOE_BF16, CPU, C, H);
  TRY(moe_tensor_randn(ctx, xg, 70, 1.0f));
  moe_tensor *xc = copy_to(xg, CPU), *prg = copy_to(s[0].peer_rank, GPU), *ptg = copy_to(s[0].peer_route, GPU);
  TRY(moe_tensor_fill(ctx, xsg, -3.0));
  TRY(moe_tensor_fill(ctx, xsc, -3.0));
  moe_dispatch_args dc = {.out = xsc, .x = xc, .peer_rank = s[0].peer_rank, .peer_route = s[0].peer_route, .k = K};
  moe_dispatch_args da = {.out = xsg, .x = xg, .peer_rank = prg, .peer_route = ptg, .k = K};
  TRY(moe_dispatch(ctx, &dc));
  TRY(moe_dispatch(ctx, &da));
  expect("dispatch Kimi K2 rank 0 of EP8 vs CPU", xsg, xsc, 1, 0);

  moe_tensor *idc = NEW(MOE_I32, CPU, T, K);
  memcpy(moe_tensor_data(idc), moe_tensor_data(ids), sizeof(int32_t) * T * K);
  moe_tensor *idg = copy_to(idc, GPU), *wg = NEW(MOE_F32, GPU, T, K), *og = NEW(MOE_BF16, GPU, T, H);
  TRY(moe_tensor_randn(ctx, wg, 80, 0.1f));
  moe_tensor *wc = copy_to(wg, CPU), *oc = NEW(MOE_BF16, CPU, T, H);
  moe_tensor *rr_c[W];
  for (int o = 0; o < W; o++) rr_c[o] = s[o].route_row;
  moe_combine_args cc = {.out = oc, .weights = wc, .ids = idc, .ys = (const moe_tensor *const *)ys_c,
                         .route_row = (const moe_tensor *const *)rr_c, .world = W, .experts = E, .rank = 0};
  moe_combine_args ca = {.out = og, .weights = wg, .ids = idg, .ys = (const moe_tensor *const *)ys_g,
                         .route_row = (const moe_tensor *const *)rr_g, .world = W, .experts = E, .rank = 0};
  TRY(moe_combine(ctx, &cc));
  TRY(moe_combine(ctx, &ca));
  expect("combine Kimi K2 rank 0 of EP8 vs CPU", og, oc, 1, 0);
  moe_tensor *cpu[] = {xc, xsc, wc, oc};
  for (size_t i = 0; i < sizeof cpu / sizeof *cpu; i++) moe_tensor_free(cpu[i]);
  for (int o = 0; o < W; o++) moe_tensor_free(ys_c[o]);
  if (failures) {
    moe_ctx_close(ctx);
    return 1;
  }

  float ms = time_ms(run_dispatch, &da, 21);
  double bytes = 2.0 * used * H * 2;
  printf("bench dispatch Kimi K2 rank 0 of EP8: %d rows x %d, %.3f ms, %.2f TB/s (read + write; H200 ~4.8 peak)\n",
         used, H, ms, bytes / ms * 1e-9);
  ms = time_ms(run_combine, &ca, 21);
  bytes = ((double)T * K + T) * H * 2;
  printf("bench combine Kimi K2 rank 0 of EP8: %d tokens x %d routes x %d, %.3f ms, %.2f TB/s (read + write)\n", T, K,
         H, ms, bytes / ms * 1e-9);

  moe_tensor *all[] = {ids, xg, xsg, prg, ptg, idc, idg, wg, og};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  for (int o = 0; o < W; o++) moe_tensor_free(rr_g[o]), moe_tensor_free(ys_g[o]), sched_free(&s[o]);
  moe_ctx_close(ctx);
  return 0;
}
