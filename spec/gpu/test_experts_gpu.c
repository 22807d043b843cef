/* SPDX-License-Identifier: MIT */
/* test_experts_gpu.c -- the experts stage on the GPU against moeI_experts_cpu, through the public API
 * only: fresh random inputs, ys poisoned with NaN so that rows the stage must not write are seen
 * to stay untouched, odd sizes, bad offsets, in place, a captured graph replayed on new offsets,
 * two contexts running the stage at the same time, and the shapes bench/experts_bench.c times at
 * fewer experts (sampled rows against the CPU).
 *
 * Every check runs once per kernel, forced through the context's experts_kernel option
 * (moe_ctx_config): "mma" (the mma.sync kernel), "sm90x1" (TMA + wgmma, one CTA per tile),
 * "sm90x2" (the same in clusters of two with multicast), "sm90w" (the weights-as-M tiles: weight
 * rows as wgmma's M, tokens as its N) and the automatic choice ("auto").  Shapes the Hopper
 * kernels do not take (H or F not a multiple of 64, F = 0, misaligned views) must be refused with
 * MOE_ERR_UNSUPPORTED and leave ys untouched; off a compute capability 9.0 device their runs are
 * reported skipped.  moe_experts_explain must name the kernel that runs.
 * Prints one PASS/FAIL line per check; exits 77 without a GPU, 1 on any failure.  The program's own
 * variable, read once when it starts: MOE_EXPERTS_CHECK=<kernel> runs the checks through that
 * kernel alone (compute-sanitizer runs one kernel a run: bench/device.sh's memcheck step).
 * --quick leaves out the shapes bench/experts_bench.c times (racecheck runs the mma kernel so). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "experts_test.h"

/* A CPU copy of a tensor anywhere. */
static moe_tensor *to_cpu(const moe_tensor *t) {
  int64_t shape[4];
  for (int i = 0; i < moe_tensor_ndim(t); i++) shape[i] = moe_tensor_dim(t, i);
  moe_tensor *c = tnew(moe_tensor_dtype(t), CPU, moe_tensor_ndim(t), shape);
  TRY(moe_tensor_copy(ctx, c, t));
  return c;
}

static uint16_t *read_bf16(const moe_tensor *t) {
  uint16_t *p = malloc(moe_tensor_nbytes(t) + 2);
  if (!p) {
    printf("FAIL out of host memory\n");
    exit(1);
  }
  TRY(moe_tensor_read(ctx, t, p, moe_tensor_nbytes(t)));
  return p;
}

/* The kernels every check runs through (the experts_kernel option; NULL = the automatic choice). */
typedef struct {
  const char *name, *option;
  int hopper; /* takes only the shapes sm90_supported accepts, on compute capability 9.0 */
} kernel;
static const kernel KERNELS[] = {
    {"mma", "mma", 0}, {"sm90x1", "sm90x1", 1}, {"sm90x2", "sm90x2", 1}, {"sm90w", "sm90w", 1}, {"auto", NULL, 0}};
enum { NKERNELS = sizeof KERNELS / sizeof *KERNELS };
static int no_hopper; /* set once the Hopper kernel said the device is not compute capability 9.0 */

/* MOE_EXPERTS_CHECK (see the top), read once in main: compute-sanitizer through every kernel in
 * one run would take too long. */
static const char *only_check;

static int checked(const kernel *k) { return !only_check || strcmp(only_check, k->name) == 0; }

/* Forces k (NULL: back to the automatic choice) on context c. */
static void use_kernel_on(moe_ctx *c, const kernel *k) {
  TRY_ON(c, moe_ctx_config(c, "experts_kernel", k && k->option ? k->option : "auto"));
}
static void use_kernel(const kernel *k) { use_kernel_on(ctx, k); }

/* What the Hopper kernels require of the shapes (kernels/experts/sm90.cuh; the device aside). */
static int sm90_supported(int64_t H, int64_t F, int misaligned) {
  return H > 0 && F > 0 && H % 64 == 0 && F % 64 == 0 && !misaligned;
}

/* A Hopper kernel refused to run: on another GPU that is expected (reported once, then its runs
 * are skipped); on a Hopper GPU, for a shape it takes, it is a failure.  Returns nonzero to skip. */
static int hopper_refused(const kernel *k, const char *what, int rc) {
  if (!k->hopper || rc != MOE_ERR_UNSUPPORTED) return 0;
  if (strstr(moe_errmsg(ctx), "needs compute capability 9.0")) {
    if (!no_hopper) printf("SKIP experts [%s]: %s\n", k->name, moe_errmsg(ctx));
    no_hopper = 1;
    return 1;
  }
  printf("FAIL experts [%s] [%s]: refused a shape it should take: %s\n", what, k->name, moe_errmsg(ctx));
  failures++;
  return 1;
}

/* The rows [lo, hi) moeI_experts_cpu writes: offsets clamped to [0, C], running maximum. */
static void written_rows(const int32_t *off, int EL, int64_t C, int64_t *lo, int64_t *hi) {
  int64_t m = off[0] < 0 ? 0 : off[0] > C ? C : off[0];
  *lo = m;
  for (int e = 1; e <= EL; e++) {
    int64_t v = off[e] < 0 ? 0 : off[e] > C ? C : off[e];
    if (v > m) m = v;
  }
  *hi = m;
}

typedef struct {
  const char *name;
  int64_t C, H, F;
  int EL;
  const int32_t *offsets; /* EL + 1 */
  int inplace;            /* ys is xs */
  int misalign;           /* xs and ys are views at odd element offsets: the element-load path */
  int nan_tail;           /* xs's rows past the last offset (the capacity tail) are NaN */
} ecase;

static void run_case(const ecase *c, uint64_t seed) {
  const int64_t C = c->C, H = c->H, F = c->F, EL = c->EL;
  moe_tensor *xbase = NULL, *ybase = NULL, *xs, *ys;
  if (c->misalign) {
    xbase = NEW(MOE_BF16, GPU, C * H + 8), ybase = NEW(MOE_BF16, GPU, C * H + 8);
    xs = view(xbase, 3, 2, SHAPE(C, H)), ys = view(ybase, 5, 2, SHAPE(C, H));
    moe_tensor *x = NEW(MOE_BF16, GPU, C, H);
    TRY(moe_tensor_randn(ctx, x, seed, 1.0f));
    TRY(moe_tensor_copy(ctx, xs, x));
    moe_tensor_free(x);
  } else {
    xs = NEW(MOE_BF16, GPU, C, H);
    TRY(moe_tensor_randn(ctx, xs, seed, 1.0f));
    ys = c->inplace ? xs : NEW(MOE_BF16, GPU, C, H);
  }
  const int64_t last = c->offsets[EL] < 0 ? 0 : c->offsets[EL] > C ? C : c->offsets[EL];
  if (c->nan_tail && last < C) { /* the kernels load whole boxes of rows, some past an expert's end */
    moe_tensor *tail = view(xs, last * H, 2, SHAPE(C - last, H));
    TRY(moe_tensor_fill(ctx, tail, NAN));
    moe_tensor_free(tail);
  }
  moe_tensor *wgu = NEW(MOE_BF16, GPU, EL, 2 * F, H), *wd = NEW(MOE_BF16, GPU, EL, H, F);
  moe_tensor *off = NEW(MOE_I32, GPU, EL + 1);
  TRY(moe_tensor_randn(ctx, wgu, seed + 1, (float)(1 / sqrt((double)(H ? H : 1)))));
  TRY(moe_tensor_randn(ctx, wd, seed + 2, (float)(1 / sqrt((double)(F ? F : 1)))));
  TRY(moe_tensor_write(ctx, off, c->offsets, (size_t)(EL + 1) * sizeof(int32_t)));

  /* the reference, once: xs0_c keeps the inputs (in place, the GPU's xs is restored from it
   * before each kernel and the CPU runs in place on a copy) */
  moe_tensor *xs0_c = to_cpu(xs), *wgu_c = to_cpu(wgu), *wd_c = to_cpu(wd), *off_c = to_cpu(off);
  moe_tensor *xs_c = c->inplace ? to_cpu(xs) : xs0_c;
  moe_tensor *ref_c = c->inplace ? xs_c : NEW(MOE_BF16, CPU, C, H);
  if (!c->inplace) TRY(moe_tensor_fill(ctx, ref_c, NAN));
  moe_experts_args r = {.out = ref_c, .x = xs_c, .offsets = off_c, .w_gate_up = wgu_c, .w_down = wd_c};
  TRY(moe_experts(ctx, &r));
  int64_t lo, hi;
  written_rows(c->offsets, c->EL, C, &lo, &hi);
  const int sm90_ok = sm90_supported(H, F, c->misalign);

  moe_experts_args g = {.out = ys, .x = xs, .offsets = off, .w_gate_up = wgu, .w_down = wd};
  for (int ki = 0; ki < NKERNELS; ki++) {
    const kernel *k = &KERNELS[ki];
    if ((k->hopper && no_hopper) || !checked(k)) continue;
    char name[256];
    snprintf(name, sizeof name, "%s] [%s", c->name, k->name);
    if (c->inplace) TRY(moe_tensor_copy(ctx, xs, xs0_c));
    else TRY(moe_tensor_fill(ctx, ys, NAN));
    use_kernel(k);
    int rc = moe_experts(ctx, &g);
    if (k->hopper && !sm90_ok) { /* refused, and nothing written */
      TRY(moe_ctx_synchronize(ctx, GPU));
      uint16_t *got = read_bf16(ys);
      const uint16_t *want = c->inplace ? moe_tensor_data(xs0_c) : NULL;
      int64_t touched = 0;
      for (int64_t i = 0; i < C * H; i++)
        touched += want ? got[i] != want[i] : !isnan(moe_bf16_to_f32(got[i]));
      check(rc == MOE_ERR_UNSUPPORTED && !touched,
            "experts [%s]: a shape it does not take is refused with MOE_ERR_UNSUPPORTED (rc %d: %s), ys untouched "
            "(%lld elements changed)",
            name, rc, rc ? moe_errmsg(ctx) : "", (long long)touched);
      free(got);
      continue;
    }
    if (hopper_refused(k, c->name, rc)) continue;
    if (rc != MOE_OK) {
      check(0, "experts [%s]: %s", name, moe_errmsg(ctx));
      continue;
    }
    TRY(moe_ctx_synchronize(ctx, GPU));
    uint16_t *got = read_bf16(ys);
    compare(name, got, moe_tensor_data(ref_c), C, H, lo, hi);
    if (!c->inplace) { /* bitwise reproducible run to run */
      TRY(moe_tensor_fill(ctx, ys, NAN));
      TRY(moe_experts(ctx, &g));
      TRY(moe_ctx_synchronize(ctx, GPU));
      uint16_t *again = read_bf16(ys);
      check(!memcmp(got, again, moe_tensor_nbytes(ys)), "experts [%s]: a second run gives the same bits", name);
      free(again);
    }
    free(got);
  }
  use_kernel(NULL);
  if (c->inplace) moe_tensor_free(xs_c);
  else moe_tensor_free(ref_c), moe_tensor_free(ys);
  moe_tensor_free(xs0_c), moe_tensor_free(wgu_c), moe_tensor_free(wd_c), moe_tensor_free(off_c);
  moe_tensor_free(xs), moe_tensor_free(wgu), moe_tensor_free(wd), moe_tensor_free(off);
  moe_tensor_free(xbase), moe_tensor_free(ybase);
}

static void test_cases(void) {
  enum { EL4 = 4 };
  int32_t o1[EL4 + 1], o2[EL4 + 1], o3[EL4 + 1], o4[EL4 + 1], o5[EL4 + 1], o6[3 + 1];
  offsets_of(o1, (const int[]){0, 2, 13, 1}, EL4, 1);
  offsets_of(o2, (const int[]){0, 0, 300, 0}, EL4, 1);
  offsets_of(o3, (const int[]){0, 0, 0, 0}, EL4, 1);
  offsets_of(o4, (const int[]){129, 1, 127, 255}, EL4, 1);
  offsets_of(o5, (const int[]){5, 0, 130, 77}, EL4, 128);
  offsets_of(o6, (const int[]){3, 70, 1}, 3, 1);
  /* decreasing, negative and past-C offsets: clamped running maximum, as moeI_experts_cpu */
  static const int32_t bad[EL4 + 1] = {-5, 40, 10, 90, 1000};
  static const int32_t late[EL4 + 1] = {7, 7, 30, 20, 45}; /* rows before the first offset untouched too */
  int32_t o_big[2 + 1];
  offsets_of(o_big, (const int[]){200, 312}, 2, 1);
  /* many experts, more than one pass of the tile map's 1024 threads, most of them tiny or empty */
  enum { ELM = 1500 };
  static int32_t many[ELM + 1];
  int msizes[ELM];
  for (int e = 0; e < ELM; e++) msizes[e] = (int)((e * 2654435761u >> 7) % 5) == 0 ? 9 : (int)(e * 40503u % 3);
  msizes[700] = 260;
  offsets_of(many, msizes, ELM, 1);
  int32_t o_zero[2 + 1];
  offsets_of(o_zero, (const int[]){3, 5}, 2, 1);
  /* one expert of 17 row tiles (more than a raster band of 16, an odd count for the cluster pairs) */
  int32_t o_huge[EL4 + 1];
  offsets_of(o_huge, (const int[]){0, 2100, 0, 5}, EL4, 1);
  /* the weights-as-M tiles' widest N: 400 rows are one unit of 2 x 200, 383 of 192 + 191, 361 of
   * 184 + 177, 1195 three units of 200 with 195 in the last CTA */
  int32_t o_wide[EL4 + 1];
  offsets_of(o_wide, (const int[]){400, 383, 361, 1195}, EL4, 1);

  const ecase cases[] = {
      {"sizes [0, 2, 13, 1], H 256, F 128", 32, 256, 128, EL4, o1, 0, 0, 0},
      {"one expert holds all rows, 2 tiles + 44", 320, 256, 128, EL4, o2, 0, 0, 0},
      {"all experts empty", 64, 256, 128, EL4, o3, 0, 0, 0},
      {"odd tails: H 264, F 136, sizes [129, 1, 127, 255]", 600, 264, 136, EL4, o4, 0, 0, 0},
      {"pad 128: sizes [5, 0, 130, 77]", 640, 256, 128, EL4, o5, 0, 0, 0},
      {"H 100, F 36 (element loads)", 80, 100, 36, 3, o6, 0, 0, 0},
      {"misaligned views (element loads)", 32, 256, 128, EL4, o1, 0, 1, 0},
      {"bad offsets [-5, 40, 10, 90, 1000]", 64, 256, 128, EL4, bad, 0, 0, 0},
      {"offsets [7, 7, 30, 20, 45]", 64, 128, 64, EL4, late, 0, 0, 0},
      {"in place (ys is xs), rows past the last offset keep xs", 40, 256, 128, EL4, o1, 1, 0, 0},
      {"in place, offsets past C clamped", 320, 256, 128, EL4, o4, 1, 0, 0},
      {"1500 experts", many[ELM] + 17, 64, 32, ELM, many, 0, 0, 0},
      {"F 0: rows are zeros", 16, 64, 0, 2, o_zero, 0, 0, 0},
      {"H 7168, F 2048, 512 rows", 520, 7168, 2048, 2, o_big, 0, 0, 0},
      /* column tiles past F (gate_up: F % 128 = 64) and past H (down: H % 256 = 64), experts of
       * one row tile (solo units of the cluster pair; at H 256, F 128 above, with one column tile
       * per pass, the second CTA of each has none), tiles starting mid-way */
      {"tails: H 320, F 192, sizes [129, 1, 127, 255]", 600, 320, 192, EL4, o4, 0, 0, 0},
      {"one expert of 2100 rows, H 256, F 128", 2200, 256, 128, EL4, o_huge, 0, 0, 0},
      {"1500 experts, H 64, F 64", many[ELM] + 17, 64, 64, ELM, many, 0, 0, 0},
      {"in place, H 320, F 192", 600, 320, 192, EL4, o4, 1, 0, 0},
      {"sizes [400, 383, 361, 1195], H 256, F 128", 2339, 256, 128, EL4, o_wide, 0, 0, 0},
      {"sizes [400, 383, 361, 1195] + 61 rows of NaN, H 320, F 192", 2400, 320, 192, EL4, o_wide, 0, 0, 1},
      /* the capacity tail NaN: the valid rows stay finite and right, the tail's ys rows unwritten */
      {"capacity tail of NaN, sizes [0, 2, 13, 1] + 40 rows, H 256, F 128", 56, 256, 128, EL4, o1, 0, 0, 1},
      {"capacity tail of NaN, sizes [200, 312] + 60 rows, H 7168, F 2048", 572, 7168, 2048, 2, o_big, 0, 0, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(&cases[i], 1000 + 17 * i);
}

/* A graph captured on offsets for sizes [2, 0, 3, 2], replayed on [0, 4, 1, 6] without recapture. */
static void test_graph(void) {
  enum { C = 16, H = 256, F = 128, EL = 4 };
  moe_tensor *xs = NEW(MOE_BF16, GPU, C, H), *ys = NEW(MOE_BF16, GPU, C, H);
  moe_tensor *wgu = NEW(MOE_BF16, GPU, EL, 2 * F, H), *wd = NEW(MOE_BF16, GPU, EL, H, F), *off = NEW(MOE_I32, GPU, EL + 1);
  TRY(moe_tensor_randn(ctx, xs, 7, 1.0f));
  TRY(moe_tensor_randn(ctx, wgu, 8, 0.0625f));
  TRY(moe_tensor_randn(ctx, wd, 9, 0.088f));
  moe_tensor *xs_c = to_cpu(xs), *wgu_c = to_cpu(wgu), *wd_c = to_cpu(wd), *off_c = NEW(MOE_I32, CPU, EL + 1);
  moe_tensor *ys_c = NEW(MOE_BF16, CPU, C, H);
  const int sizes[2][EL] = {{2, 0, 3, 2}, {0, 4, 1, 6}};
  moe_experts_args g = {.out = ys, .x = xs, .offsets = off, .w_gate_up = wgu, .w_down = wd};
  moe_experts_args r = {.out = ys_c, .x = xs_c, .offsets = off_c, .w_gate_up = wgu_c, .w_down = wd_c};
  for (int ki = 0; ki < NKERNELS; ki++) {
    const kernel *k = &KERNELS[ki];
    if ((k->hopper && no_hopper) || !checked(k)) continue;
    use_kernel(k); /* read when the stage is captured: the graph keeps that kernel */
    moe_graph *graph = NULL;
    for (int pass = 0; pass < 2; pass++) {
      int32_t o[EL + 1];
      offsets_of(o, sizes[pass], EL, 1);
      TRY(moe_tensor_write(ctx, off, o, sizeof o));
      TRY(moe_tensor_write(ctx, off_c, o, sizeof o));
      TRY(moe_tensor_fill(ctx, ys, NAN));
      TRY(moe_tensor_fill(ctx, ys_c, NAN));
      TRY(moe_ctx_synchronize(ctx, GPU));
      if (pass == 0) {
        TRY(moe_graph_begin(ctx, GPU));
        TRY(moe_experts(ctx, &g));
        TRY(moe_graph_end(ctx, &graph));
      }
      TRY(moe_graph_replay(ctx, graph));
      TRY(moe_ctx_synchronize(ctx, GPU));
      uint16_t *got = read_bf16(ys);
      TRY(moe_experts(ctx, &r));
      char name[128];
      snprintf(name, sizeof name, "%s] [%s", pass ? "graph replayed on sizes [0, 4, 1, 6]" : "graph captured on sizes [2, 0, 3, 2]",
               k->name);
      compare(name, got, moe_tensor_data(ys_c), C, H, 0, o[EL]);
      free(got);
    }
    moe_graph_free(graph);
  }
  use_kernel(NULL);
  moe_tensor *ts[] = {xs, ys, wgu, wd, off, xs_c, wgu_c, wd_c, off_c, ys_c};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) moe_tensor_free(ts[i]);
}

/* Two contexts (two streams) run the stage at the same time on one GPU, ROUNDS times: one's
 * persistent grid waits for SMs the other holds, so it is only partly resident for a while, which
 * the Hopper kernel's wave gate must come through (it waits for the CTAs of its own grid, with a
 * time limit).  Each side is checked against the CPU in the first round, then must give the same
 * bits in every later one; each call has its own counters, so neither may disturb the other. */
static void test_concurrent(void) {
  enum { EL = 4, H = 256, F = 2048, C = 2048, ROUNDS = 4 };
  const int sizes[2][EL] = {{512, 500, 530, 506}, {600, 388, 700, 360}}; /* two row tiles or more: gated */
  moe_ctx *other;
  if (moe_ctx_open(&other) != MOE_OK) {
    printf("FAIL cannot open a second context\n");
    exit(1);
  }
  moe_ctx *cs[2] = {ctx, other};
  moe_tensor *xs[2], *ys[2], *wgu[2], *wd[2], *off[2], *ref[2], *cpu[2][4];
  moe_experts_args g[2];
  int64_t lo[2], hi[2];
  for (int side = 0; side < 2; side++) {
    int32_t o[EL + 1];
    offsets_of(o, sizes[side], EL, 1);
    xs[side] = NEW(MOE_BF16, GPU, C, H), ys[side] = NEW(MOE_BF16, GPU, C, H);
    wgu[side] = NEW(MOE_BF16, GPU, EL, 2 * F, H), wd[side] = NEW(MOE_BF16, GPU, EL, H, F);
    off[side] = NEW(MOE_I32, GPU, EL + 1);
    TRY(moe_tensor_randn(ctx, xs[side], 31 + side, 1.0f));
    TRY(moe_tensor_randn(ctx, wgu[side], 33 + side, 0.0625f));
    TRY(moe_tensor_randn(ctx, wd[side], 35 + side, 0.022f));
    TRY(moe_tensor_write(ctx, off[side], o, sizeof o));
    cpu[side][0] = to_cpu(xs[side]), cpu[side][1] = to_cpu(wgu[side]), cpu[side][2] = to_cpu(wd[side]);
    cpu[side][3] = to_cpu(off[side]);
    ref[side] = NEW(MOE_BF16, CPU, C, H);
    TRY(moe_tensor_fill(ctx, ref[side], NAN));
    moe_experts_args r = {.out = ref[side], .x = cpu[side][0], .offsets = cpu[side][3],
                          .w_gate_up = cpu[side][1], .w_down = cpu[side][2]};
    TRY(moe_experts(ctx, &r));
    written_rows(o, EL, C, &lo[side], &hi[side]);
    g[side] = (moe_experts_args){.out = ys[side], .x = xs[side], .offsets = off[side], .w_gate_up = wgu[side],
                                 .w_down = wd[side]};
  }
  for (int ki = 0; ki < NKERNELS; ki++) {
    const kernel *k = &KERNELS[ki];
    if ((k->hopper && no_hopper) || !checked(k)) continue;
    use_kernel(k);
    use_kernel_on(other, k);
    uint16_t *first[2] = {NULL, NULL};
    int same[2] = {1, 1}, failed = 0;
    for (int round = 0; round < ROUNDS && !failed; round++) {
      for (int side = 0; side < 2; side++) TRY(moe_tensor_fill(ctx, ys[side], NAN));
      TRY(moe_ctx_synchronize(ctx, GPU));
      for (int side = 0; side < 2 && !failed; side++) { /* both issued before either is waited for */
        const int rc = moe_experts(cs[side], &g[side]);
        if (rc != MOE_OK) {
          if (side > 0 || !hopper_refused(k, "two contexts at once", rc)) /* it reads ctx's message */
            check(0, "experts [two contexts at once] [%s]: %s", k->name, moe_errmsg(cs[side]));
          failed = 1;
        }
      }
      TRY_ON(other, moe_ctx_synchronize(other, GPU));
      TRY(moe_ctx_synchronize(ctx, GPU));
      for (int side = 0; side < 2 && !failed; side++) {
        uint16_t *got = read_bf16(ys[side]);
        if (round == 0) {
          char name[128];
          snprintf(name, sizeof name, "two contexts at once, side %d] [%s", side, k->name);
          compare(name, got, moe_tensor_data(ref[side]), C, H, lo[side], hi[side]);
          first[side] = got;
        } else {
          same[side] &= !memcmp(got, first[side], (size_t)C * H * 2);
          free(got);
        }
      }
    }
    for (int side = 0; side < 2 && !failed; side++)
      check(same[side], "experts [two contexts at once, side %d] [%s]: %d rounds give the same bits", side, k->name,
            ROUNDS);
    free(first[0]), free(first[1]);
  }
  use_kernel(NULL);
  for (int side = 0; side < 2; side++) {
    moe_tensor_free(xs[side]), moe_tensor_free(ys[side]), moe_tensor_free(wgu[side]), moe_tensor_free(wd[side]);
    moe_tensor_free(off[side]), moe_tensor_free(ref[side]);
    for (int i = 0; i < 4; i++) moe_tensor_free(cpu[side][i]);
  }
  moe_ctx_close(other);
}

/* moe_experts_explain names the kernel the same call runs: the forced one, or the automatic choice
 * (on compute capability 9.0: sm90w where the experts average 256 rows or more, sm90x2 below, mma
 * where the Hopper kernels cannot take the shape; elsewhere mma), and fails where the call fails. */
static void test_explain(void) {
  static const struct {
    const char *name;
    int64_t H, F;
    int rows;
    const char *hopper_auto;
  } shapes[] = {
      {"2 experts of 300 rows, H 256, F 128", 256, 128, 300, "sm90w"},
      {"2 experts of 8 rows, H 256, F 128", 256, 128, 8, "sm90x2"},
      {"2 experts of 8 rows, H 100, F 36", 100, 36, 8, "mma"},
  };
  enum { EL = 2 };
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
    const int64_t C = 2 * shapes[i].rows, H = shapes[i].H, F = shapes[i].F;
    const int32_t o[EL + 1] = {0, shapes[i].rows, 2 * shapes[i].rows};
    moe_tensor *xs = NEW(MOE_BF16, GPU, C, H), *ys = NEW(MOE_BF16, GPU, C, H);
    moe_tensor *wgu = NEW(MOE_BF16, GPU, EL, 2 * F, H), *wd = NEW(MOE_BF16, GPU, EL, H, F);
    moe_tensor *off = NEW(MOE_I32, GPU, EL + 1);
    TRY(moe_tensor_fill(ctx, xs, 0.5f));
    TRY(moe_tensor_fill(ctx, wgu, 0.01f));
    TRY(moe_tensor_fill(ctx, wd, 0.01f));
    TRY(moe_tensor_write(ctx, off, o, sizeof o));
    moe_experts_args g = {.out = ys, .x = xs, .offsets = off, .w_gate_up = wgu, .w_down = wd};
    for (int ki = 0; ki < NKERNELS; ki++) {
      const kernel *k = &KERNELS[ki];
      if ((k->hopper && no_hopper) || !checked(k)) continue;
      use_kernel(k);
      char report[2048], first[64] = "";
      const int erc = moe_experts_explain(ctx, &g, report, sizeof report);
      char emsg[512];
      snprintf(emsg, sizeof emsg, "%s", erc ? moe_errmsg(ctx) : "");
      const int rc = moe_experts(ctx, &g);
      TRY(moe_ctx_synchronize(ctx, GPU));
      if (erc || rc) {
        check(erc == rc, "experts explain [%s] [%s]: fails as the call does (explain rc %d: %s; call rc %d: %s)",
              shapes[i].name, k->name, erc, emsg, rc, rc ? moe_errmsg(ctx) : "");
        continue;
      }
      sscanf(report, "%63[^\n]", first);
      const int hopper = !strstr(report, "needs compute capability 9.0");
      const char *want = k->option ? k->option : hopper ? shapes[i].hopper_auto : "mma";
      check(strcmp(first, want) == 0, "experts explain [%s] [%s]: names %s (expected %s); report:\n%s", shapes[i].name,
            k->name, first, want, report);
    }
    use_kernel(NULL);
    moe_tensor *ts[] = {xs, ys, wgu, wd, off};
    for (size_t j = 0; j < sizeof ts / sizeof *ts; j++) moe_tensor_free(ts[j]);
  }
}

/* The shapes bench/experts_bench.c times, at fewer experts (the CPU reference of sampled rows,
 * through every kernel): Kimi K2's H and F with experts of its 1,194-1,195 rows (several units of
 * the weights-as-M tiles, ten row tiles), and its decode of 8 rows an expert (one row tile, the
 * weights read once). */
static void test_timed_shapes(void) {
  static const struct {
    const char *label;
    int sizes[8];
  } shapes[] = {
      {"Kimi K2 rows and width, 4 experts", {1195, 1195, 1194, 1194}},
      {"decode, Kimi K2 width, 8 experts x 8 rows", {8, 8, 8, 8, 8, 8, 8, 8}},
  };
  for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
    int EL = 0;
    while (EL < 8 && shapes[s].sizes[EL]) EL++;
    experts_problem p;
    experts_problem_new(&p, EL, shapes[s].sizes, 7168, 2048);
    for (int ki = 0; ki < NKERNELS; ki++) {
      const kernel *k = &KERNELS[ki];
      if ((k->hopper && no_hopper) || !checked(k)) continue;
      use_kernel(k);
      TRY(moe_tensor_fill(ctx, p.ys, NAN));
      const int rc = moe_experts(ctx, &p.args);
      if (hopper_refused(k, shapes[s].label, rc)) continue;
      if (rc != MOE_OK) check(0, "experts [%s] [%s]: %s", shapes[s].label, k->name, moe_errmsg(ctx));
      else experts_problem_check(&p, shapes[s].label, k->name);
    }
    use_kernel(NULL);
    experts_problem_free(&p);
  }
}

int main(int argc, char **argv) {
  only_check = getenv("MOE_EXPERTS_CHECK");
  /* --quick: without the Kimi-width shapes, whose sampled rows take the mma kernel past five
   * minutes under racecheck; the smaller cases run the same code paths (K loops of many steps,
   * row and column tails) */
  const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
  if (argc > 1 && !quick) {
    fprintf(stderr, "usage: test_experts_gpu [--quick]\n");
    return 2;
  }
  open_gpu_ctx();
  test_cases();
  test_graph();
  test_concurrent();
  test_explain();
  if (!quick) test_timed_shapes();
  moe_ctx_close(ctx);
  printf("%s: test_experts_gpu, %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
