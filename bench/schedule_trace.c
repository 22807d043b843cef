/* SPDX-License-Identifier: MIT */
/* schedule_trace.c -- the schedule timed at the Kimi K2 shapes (E 384, K 8), each call with where
 * its time goes: the scheduler kernel's phases.
 *
 *   build/bench/schedule_trace [--shape W,T] [--kernel NAME]
 *
 * The shapes: EP8 with T 7168 (target <= 12 us a call), then T 512 at W 4, 8, 16, 32 and 64
 * (target <= 6 us); --shape W,T: that one alone (target 12 us above T 512, else 6), for a profiler
 * (bench/device.sh's profile step).  Ids by top-8 of 384 at random from a fixed seed, rank 0,
 * capacity a little over the rows needed.  Each kernel is first checked against the CPU's schedule,
 * every output bit for bit (one PASS/FAIL line a shape), then timed: the median of 9 replays of a
 * CUDA graph of 200 calls, as scenarios/scheduler.lua times it.  One line a shape,
 *   time: schedule, Kimi K2 rank of EP8 (W 8, T 7168, K 8, E 384, 458752 routes): X us per call
 *     (target <= 12 us; grid kernel X, bitmap kernel X)
 * the library's choice, then each kernel forced (the bitmap kernel "does not take it" past 128
 * experts a rank); then, for each kernel that took it, two traced calls (after the timing, then once
 * more), each line the median over blocks of every phase's clock64 cycles (grid kernel: load,
 * rank, barrier, histogram reads, scan, place, route_row + clears; bitmap kernel: load, scan,
 * barrier, totals, segments + place + fill, stats) and the span by %globaltimer, first entry to last
 * end:
 *   trace EP8 T 7168, grid kernel: N blocks, X us per call; load N ... cycles (medians); span X us
 * --kernel NAME (grid, bitmap or auto) runs that kernel alone, so a profiler sees only its
 * launches: "time: schedule [NAME], ...: X us per call (target <= N us)", then its traces.  The
 * phase clocks are recorded through moeI_schedule_set_trace (lib/internal.h): this program links
 * the static library.  Exit status: 0; 1 when a result differs from the CPU's or no context opens; 2 on bad
 * arguments or a failed call; 77 without a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "schedule_test.h"

#include "internal.h"

static const char *kernel_opt; /* --kernel; NULL: the library's choice and each kernel forced */

static int cmp_float(const void *x, const void *y) {
  const float a = *(const float *)x, b = *(const float *)y;
  return (a > b) - (a < b);
}

/* Median us per call: 9 replays of a CUDA graph of 200 calls (as scenarios/scheduler.lua times
 * schedule: no host launch in the timed span), after a warm-up. */
static float time_calls(int (*fn)(moe_ctx *, const moe_schedule_args *), const moe_schedule_args *a) {
  moe_event *start, *stop;
  moe_graph *graph = NULL;
  if (moe_event_new(ctx, GPU, &start) || moe_event_new(ctx, GPU, &stop)) die("event_new");
  for (int i = 0; i < 20; i++)
    if (fn(ctx, a)) die("warm-up");
  if (moe_graph_begin(ctx, GPU)) die("graph_begin");
  for (int i = 0; i < 200; i++)
    if (fn(ctx, a)) die("captured call");
  if (moe_graph_end(ctx, &graph) || moe_graph_replay(ctx, graph)) die("graph");
  float us[9];
  for (int r = 0; r < 9; r++) {
    if (moe_event_record(ctx, start)) die("event_record");
    if (moe_graph_replay(ctx, graph)) die("graph_replay");
    if (moe_event_record(ctx, stop)) die("event_record");
    float ms;
    if (moe_event_elapsed(ctx, start, stop, &ms)) die("event_elapsed");
    us[r] = ms * 1000.0f / 200;
  }
  qsort(us, 9, sizeof *us, cmp_float);
  moe_graph_free(graph);
  moe_event_free(start);
  moe_event_free(stop);
  return us[4];
}

static int cmp_ll(const void *a, const void *b) {
  const long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

/* Where the last traced call's time went (the phases: see the top), beside the time a call in a
 * graph of 200 calls. */
enum { K_GRID, K_BITMAP };
static void print_trace(const char *label, float per_call_us, int kernel) {
  enum { MAXB = 1024 };
  static long long buf[MAXB * 10], col[MAXB];
  const int n = kernel == K_GRID ? moeI_schedule_grid_trace(buf, MAXB) : moeI_schedule_bitmap_trace(buf, MAXB);
  if (n <= 0) die("schedule trace");
  const int phases = kernel == K_BITMAP ? 6 : 7;
  const int width = phases + 3; /* clocks, then two timers */
  static const char *const names[2][7] = {{"load", "rank", "barrier", "hist", "scan", "place", "rows+clears"},
                                          {"load", "scan", "barrier", "totals", "segments+place+fill", "stats"}};
  static const char *const kinds[] = {"grid", "bitmap"};
  printf("trace %s, %s kernel: %d blocks, %.2f us per call;", label, kinds[kernel], n, per_call_us);
  for (int ph = 0; ph < phases; ph++) {
    for (int b = 0; b < n; b++) col[b] = buf[b * width + ph + 1] - buf[b * width + ph];
    qsort(col, (size_t)n, sizeof *col, cmp_ll);
    printf(" %s %lld", names[kernel][ph], col[n / 2]);
  }
  long long first = buf[width - 2], last = buf[width - 1];
  for (int b = 0; b < n; b++) {
    first = buf[b * width + width - 2] < first ? buf[b * width + width - 2] : first;
    last = buf[b * width + width - 1] > last ? buf[b * width + width - 1] : last;
  }
  printf(" cycles (medians); span %.2f us\n", (last - first) / 1000.0);
}


/* The kernel a call runs: the first line of moe_schedule_explain, as K_GRID or K_BITMAP. */
static int kernel_of(const moe_schedule_args *a) {
  char report[1024];
  if (moe_schedule_explain(ctx, a, report, sizeof report)) die("schedule_explain");
  return strncmp(report, "bitmap\n", 7) == 0 ? K_BITMAP : K_GRID;
}

/* The kernels this run times, each checked against the CPU's outputs; returns nonzero when the
 * bitmap kernel does not take the problem. */
static int check_kernels(const spec *s, moe_tensor *ids, outputs *gpu, int capacity, const char *name) {
  const int64_t shape[3] = {s->w, s->t, s->k};
  moe_tensor *ids_cpu;
  if (moe_tensor_new(ctx, MOE_I32, 3, shape, CPU, &ids_cpu) || moe_tensor_copy(ctx, ids_cpu, ids)) die("ids");
  outputs cpu;
  outputs_new(&cpu, s, capacity, CPU);
  moe_schedule_args a;
  args_for(&a, &cpu, ids_cpu, s, capacity);
  if (moe_schedule(ctx, &a)) die("cpu schedule");
  args_for(&a, gpu, ids, s, capacity);
  static const char *const all[] = {NULL, "grid", "bitmap"};
  const char *const *kernels = kernel_opt ? &kernel_opt : all;
  const int n = kernel_opt ? 1 : 3;
  int ok = 1, bitmap_cannot = 0;
  for (int k = 0; k < n; k++) {
    if (!kernel_opt) use_kernel(kernels[k]);
    outputs_fill(gpu);
    const int rc = moe_schedule(ctx, &a);
    if (rc == MOE_ERR_UNSUPPORTED && kernels[k] && !strcmp(kernels[k], "bitmap")) {
      bitmap_cannot = 1;
      continue;
    }
    if (rc) die("schedule");
    char who[64];
    snprintf(who, sizeof who, "schedule (%s)", kernels[k] ? kernels[k] : "the library's choice");
    ok &= same(who, gpu, &cpu, name);
  }
  if (!kernel_opt) use_kernel(NULL);
  outputs_free(&cpu);
  moe_tensor_free(ids_cpu);
  if (!ok) exit(1);
  printf("PASS %s: every kernel timed gives the CPU's outputs, bit for bit\n", name);
  return bitmap_cannot;
}

static void traces(const moe_schedule_args *a, int w, int t, float per_call, int k) {
  for (int again = 0; again < 2; again++) { /* after other calls, then once more */
    if (moe_schedule(ctx, a)) die("traced call");
    char label[64];
    snprintf(label, sizeof label, "EP%d T %d%s", w, t, again ? " again" : "");
    print_trace(label, per_call, k);
  }
}

static void timing(int w, int t, float target_us) {
  spec s = base(w, t, 8, 384, "kimi-k2");
  rng = s.seed;
  int32_t *host_ids = make_ids(&s);
  const int capacity = capacity_for(&s, rows_needed(&s, host_ids));
  const int64_t shape[3] = {s.w, s.t, s.k};
  moe_tensor *ids;
  if (moe_tensor_new(ctx, MOE_I32, 3, shape, GPU, &ids)) die("tensor_new");
  if (moe_tensor_write(ctx, ids, host_ids, (size_t)s.w * s.t * s.k * sizeof *host_ids)) die("ids");
  outputs gpu;
  outputs_new(&gpu, &s, capacity, GPU);
  char name[400];
  describe(name, sizeof name, &s, capacity);
  const int bitmap_cannot = check_kernels(&s, ids, &gpu, capacity, name);
  moe_schedule_args a;
  args_for(&a, &gpu, ids, &s, capacity);
  if (kernel_opt && bitmap_cannot) {
    printf("time: schedule [%s], Kimi K2 rank of EP%d (W %d, T %d, K 8, E 384, %d routes): does not take it\n",
           kernel_opt, w, w, t, s.w * s.t * s.k);
  } else if (kernel_opt) {
    const float us = time_calls(moe_schedule, &a);
    printf("time: schedule [%s], Kimi K2 rank of EP%d (W %d, T %d, K 8, E 384, %d routes): %.2f us per call "
           "(target <= %.0f us)\n",
           kernel_opt, w, w, t, s.w * s.t * s.k, us, target_us);
    traces(&a, w, t, us, kernel_of(&a));
  } else {
    const float ours = time_calls(moe_schedule, &a);
    use_kernel("grid");
    const float grid = time_calls(moe_schedule, &a);
    use_kernel("bitmap");
    const float bitmap = bitmap_cannot ? -1 : time_calls(moe_schedule, &a);
    use_kernel(NULL);
    char bm[48];
    if (bitmap >= 0) snprintf(bm, sizeof bm, "%.2f", bitmap);
    else snprintf(bm, sizeof bm, "does not take it");
    printf("time: schedule, Kimi K2 rank of EP%d (W %d, T %d, K 8, E 384, %d routes): %.2f us per call "
           "(target <= %.0f us; grid kernel %.2f, bitmap kernel %s)\n",
           w, w, t, s.w * s.t * s.k, ours, target_us, grid, bm);
    for (int k = K_GRID; k <= K_BITMAP; k++) {
      const float per_call = k == K_GRID ? grid : bitmap;
      if (per_call < 0) continue;
      use_kernel(k == K_GRID ? "grid" : "bitmap");
      traces(&a, w, t, per_call, k);
      use_kernel(NULL);
    }
  }
  outputs_free(&gpu);
  moe_tensor_free(ids);
  free(host_ids);
}

int main(int argc, char **argv) {
  int shape_w = 0, shape_t = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--shape") && i + 1 < argc && sscanf(argv[i + 1], "%d,%d", &shape_w, &shape_t) == 2 &&
        shape_w > 0 && shape_t > 0 && 384 % shape_w == 0)
      i++;
    else if (!strcmp(argv[i], "--kernel") && i + 1 < argc) kernel_opt = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--shape W,T] [--kernel NAME]\n", argv[0]);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  open_gpu_ctx();
  if (kernel_opt && moe_ctx_config(ctx, "schedule_kernel", kernel_opt)) {
    fprintf(stderr, "schedule_trace: --kernel %s: %s\n", kernel_opt, moe_errmsg(ctx));
    moe_ctx_close(ctx);
    return 2;
  }
  moeI_schedule_set_trace(ctx, 1);
  if (shape_w > 0) {
    timing(shape_w, shape_t, shape_t > 512 ? 12 : 6);
  } else {
    timing(8, 7168, 12);
    const int ws[] = {4, 8, 16, 32, 64};
    for (int i = 0; i < 5; i++) timing(ws[i], 512, 6);
  }
  moe_ctx_close(ctx);
  return 0;
}
