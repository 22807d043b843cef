/* SPDX-License-Identifier: MIT */
/* experts_bench.c -- the experts stage timed at the Kimi K2 rank-of-EP8 shape and at its decode.
 *
 *   build/bench/experts_bench [--kernel NAME|auto] [--passes N] [--rows N]
 *
 * Kimi K2, one rank of EP8: 48 local experts, 57,344 rows (T = 7168 tokens x 8 routes) spread
 * evenly (1,195 rows for the first 32 experts, 1,194 for the others; --rows N gives each N), H =
 * 7168, F = 2048.  Decode: the same experts with 8 rows each (384 rows, e.g. 48 tokens a rank x
 * top-8), whose floor is reading the 4.2 GB of weights once.  --kernel sets the context's
 * experts_kernel option (mma, sm90x1, sm90x2, sm90w, or auto, the default: the library's choice,
 * named by moe_experts_explain).  Before a shape is timed, 18 of its rows (first, middle and last
 * experts; first rows, both sides of the 128-row tile boundary, last rows) are checked against
 * the CPU reference: one PASS/FAIL line.  Then two warm-up runs and the timed ones back to back
 * (10 at the Kimi shape, 20 at decode; --passes N: N, each printed in time order, since the H200
 * lowers its clocks under its power cap after a few tens of ms of this load: docs/perf/experts.md),
 * an event between each, nothing but the stage on the clock.  One line a shape:
 *   TIME experts [sm90w] Kimi K2 rank of EP8 (EL 48, 57344 rows, H 7168, F 2048): median 7.559 ms
 *     (min 6.576, max 7.636) = 668.2 TFLOP/s (dense bf16 on this H200: 680-790; target 660)
 *   TIME experts [sm90x2] decode, Kimi K2 experts x 8 rows (EL 48, 384 rows, H 7168, F 2048): median
 *     1.099 ms (min ..., max ...) = 3847 GB/s of weights read (4.23 GB per run; HBM ~4300 GB/s, target 3800)
 * (each on one line), the kernel in brackets being the one that ran.  Exit status: 0; 1 when a
 * check fails or a call is refused; 2 on bad arguments; 77 without a GPU. */
#include <stdlib.h>
#include <string.h>

#include "experts_test.h"

static const char *kernel_option = "auto";
static int passes; /* 0: the default of each shape */

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* EL experts of sizes[e] rows, H, F: checked, then iters runs timed.  decode: the weight bytes read
 * per second (every expert's weights are read once a run); else TFLOP/s. */
static void time_shape(const char *label, int EL, const int *sizes, int64_t H, int64_t F, int iters, int decode) {
  if (passes > 0) iters = passes;
  experts_problem p;
  experts_problem_new(&p, EL, sizes, H, F);
  const int64_t C = p.C;
  char report[2048], kernel[64] = "";
  if (moe_experts_explain(ctx, &p.args, report, sizeof report) != MOE_OK) {
    printf("FAIL experts [%s] [%s]: %s\n", label, kernel_option, moe_errmsg(ctx));
    exit(1);
  }
  sscanf(report, "%63[^\n]", kernel);
  TRY(moe_tensor_fill(ctx, p.ys, NAN));
  if (moe_experts(ctx, &p.args) != MOE_OK) {
    printf("FAIL experts [%s] [%s]: %s\n", label, kernel, moe_errmsg(ctx));
    exit(1);
  }
  if (!experts_problem_check(&p, label, kernel)) exit(1);

  moe_event **ev = malloc((size_t)(iters + 1) * sizeof *ev);
  float *ms = malloc((size_t)iters * sizeof *ms);
  if (!ev || !ms) {
    printf("FAIL out of host memory\n");
    exit(1);
  }
  for (int i = 0; i <= iters; i++) TRY(moe_event_new(ctx, GPU, &ev[i]));
  /* no host synchronisation between the runs, so nothing but the stage is on the clock */
  for (int i = 0; i < 2; i++) TRY(moe_experts(ctx, &p.args));
  TRY(moe_event_record(ctx, ev[0]));
  for (int i = 0; i < iters; i++) {
    TRY(moe_experts(ctx, &p.args));
    TRY(moe_event_record(ctx, ev[i + 1]));
  }
  for (int i = 0; i < iters; i++) TRY(moe_event_elapsed(ctx, ev[i], ev[i + 1], &ms[i]));
  if (passes > 0) {
    printf("passes [%s] ms:", kernel);
    for (int i = 0; i < iters; i++) printf(" %.3f", ms[i]);
    printf("\n");
  }
  qsort(ms, (size_t)iters, sizeof *ms, cmp_float);
  const double med = iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
  if (decode) {
    const double bytes = (double)EL * 3 * F * H * 2;
    printf("TIME experts [%s] %s (EL %d, %lld rows, H %lld, F %lld): median %.3f ms (min %.3f, max %.3f) = %.0f GB/s "
           "of weights read (%.2f GB per run; HBM ~4300 GB/s, target 3800)\n",
           kernel, label, EL, (long long)C, (long long)H, (long long)F, med, ms[0], ms[iters - 1],
           bytes / (med * 1e-3) / 1e9, bytes / 1e9);
  } else {
    const double flops = (double)C * (2.0 * 2 * F * H + 2.0 * H * F);
    printf("TIME experts [%s] %s (EL %d, %lld rows, H %lld, F %lld): median %.3f ms (min %.3f, max %.3f) = %.1f "
           "TFLOP/s (dense bf16 on this H200: 680-790; target 660)\n",
           kernel, label, EL, (long long)C, (long long)H, (long long)F, med, ms[0], ms[iters - 1],
           flops / (med * 1e-3) / 1e12);
  }
  fflush(stdout);
  for (int i = 0; i <= iters; i++) moe_event_free(ev[i]);
  free(ev), free(ms);
  experts_problem_free(&p);
}

static int positive(const char *s) {
  char *end;
  const long v = strtol(s, &end, 10);
  return *s && !*end && v > 0 && v <= 1000000 ? (int)v : 0;
}

int main(int argc, char **argv) {
  int rows = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--kernel") && i + 1 < argc) kernel_option = argv[++i];
    else if (!strcmp(argv[i], "--passes") && i + 1 < argc && (passes = positive(argv[i + 1]))) i++;
    else if (!strcmp(argv[i], "--rows") && i + 1 < argc && (rows = positive(argv[i + 1]))) i++;
    else {
      fprintf(stderr, "usage: %s [--kernel NAME|auto] [--passes N] [--rows N]\n", argv[0]);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  open_gpu_ctx();
  if (moe_ctx_config(ctx, "experts_kernel", kernel_option) != MOE_OK) {
    fprintf(stderr, "experts_bench: --kernel %s: %s\n", kernel_option, moe_errmsg(ctx));
    moe_ctx_close(ctx);
    return 2;
  }
  enum { EL = 48, ROWS = 57344 };
  int sizes[EL];
  for (int e = 0; e < EL; e++) sizes[e] = rows > 0 ? rows : ROWS / EL + (e < ROWS % EL);
  time_shape("Kimi K2 rank of EP8", EL, sizes, 7168, 2048, 10, 0);
  for (int e = 0; e < EL; e++) sizes[e] = 8;
  time_shape("decode, Kimi K2 experts x 8 rows", EL, sizes, 7168, 2048, 20, 1);
  moe_ctx_close(ctx);
  return 0;
}
