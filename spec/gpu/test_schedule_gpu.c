/* SPDX-License-Identifier: MIT */
/* test_schedule_gpu.c -- the CUDA schedule against the CPU reference, every output bit for bit,
 * on random and adversarial routings of the shapes that matter (docs/design.md, "The stages", 2),
 * for both layouts, each through the library's choice of kernel and through each kernel forced
 * (the context's schedule_kernel option: grid, and bitmap where it takes the problem); what
 * moe_schedule_explain reports must name the kernel that ran.  Outputs on the GPU are views into
 * larger buffers prefilled with a sentinel, so an element left unwritten or a write past an
 * output's end (past capacity, say) shows as a mismatch.  A few cases run from a captured CUDA
 * graph, replayed on changed routings.  The kernels are timed by bench/schedule_trace.c, the
 * legacy baseline by bench/schedule_legacy.cu.
 *
 *   test_schedule_gpu [--quick] [--max-routes N] [--only LABEL]
 *     --quick: skip the cases over 200,000 routes; --max-routes: skip those over N;
 *     --only: run only the cases whose label (kimi-k2, 512-tokens, graph, random, ...) is LABEL
 *
 * Exit status: 0 all passed, 1 a failure, 77 no GPU (skipped), 2 a setup error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "schedule_test.h"

static int passed, failed;
static long long max_routes = -1;
static const char *only;

static void run_case(const spec *s) {
  const long long routes = (long long)s->w * s->t * s->k;
  if (max_routes >= 0 && routes > max_routes) return;
  if (only && strcmp(only, s->label ? s->label : "random")) return;
  rng = s->seed;
  int32_t *host_ids = make_ids(s);
  const int capacity = capacity_for(s, rows_needed(s, host_ids));
  char name[400];
  describe(name, sizeof name, s, capacity);

  const int64_t shape[3] = {s->w, s->t, s->k}, padded = routes + 1;
  moe_tensor *ids_cpu, *ids_gpu, *ids_base = NULL;
  if (moe_tensor_new(ctx, MOE_I32, 3, shape, CPU, &ids_cpu)) die("tensor_new");
  if (s->unaligned ? moe_tensor_new(ctx, MOE_I32, 1, &padded, GPU, &ids_base) ||
                         moe_tensor_view(ctx, ids_base, 1, 3, shape, &ids_gpu)
                   : moe_tensor_new(ctx, MOE_I32, 3, shape, GPU, &ids_gpu))
    die("tensor_new");
  if (moe_tensor_write(ctx, ids_cpu, host_ids, (size_t)routes * sizeof *host_ids) ||
      moe_tensor_copy(ctx, ids_gpu, ids_cpu))
    die("ids");
  outputs cpu, gpu;
  outputs_new(&cpu, s, capacity, CPU);
  outputs_new(&gpu, s, capacity, GPU);
  moe_schedule_args a;
  args_for(&a, &cpu, ids_cpu, s, capacity);
  if (moe_schedule(ctx, &a)) die("cpu schedule");

  int ok = 1;
  args_for(&a, &gpu, ids_gpu, s, capacity);
  /* the library's choice, then each kernel forced: the bitmap one refuses problems it cannot take,
   * and the explain report says so for that very problem (the walk that picks is the one that
   * reports) */
  char report[1024];
  if (moe_schedule_explain(ctx, &a, report, sizeof report)) {
    printf("FAIL %s [explain]: %s\n", name, moe_errmsg(ctx));
    ok = 0;
    report[0] = '\0';
  }
  const int bitmap_cannot = strstr(report, "bitmap: cannot") != NULL;
  for (int k = 0; k < 3; k++) {
    static const char *const kernels[] = {NULL, "grid", "bitmap"};
    static const char *const whos[] = {"schedule", "schedule (grid)", "schedule (bitmap)"};
    use_kernel(kernels[k]);
    outputs_fill(&gpu);
    const int rc = moe_schedule(ctx, &a);
    if (k == 2 && (rc == MOE_ERR_UNSUPPORTED) != bitmap_cannot) {
      printf("FAIL %s [bitmap forced]: status %d, but explain said:\n%s", name, rc, report);
      ok = 0;
      continue;
    }
    if (rc == MOE_ERR_UNSUPPORTED && k == 2) continue;
    if (rc) {
      printf("FAIL %s [%s]: %s\n", name, whos[k], moe_errmsg(ctx));
      ok = 0;
    } else {
      ok &= same(whos[k], &gpu, &cpu, name);
    }
  }
  use_kernel(NULL);
  if (ok) printf("PASS %s\n", name);
  ok ? passed++ : failed++;
  outputs_free(&cpu);
  outputs_free(&gpu);
  moe_tensor_free(ids_cpu);
  moe_tensor_free(ids_gpu);
  moe_tensor_free(ids_base);
  free(host_ids);
}

/* A schedule captured in a graph (on a fresh context, whose scratch the capture must allocate,
 * and on one that has scheduled before), replayed on three routings written between replays. */
static void run_graph_case(const spec *s0, int fresh) {
  if (only && strcmp(only, s0->label)) return;
  spec s = *s0;
  moe_ctx *outer = ctx;
  /* a fresh context runs the kernel the outer one forces */
  if (fresh && (moe_ctx_open(&ctx) ||
                moe_ctx_config(ctx, "schedule_kernel", moe_ctx_config_value(outer, "schedule_kernel"))))
    exit(2);
  rng = s.seed;
  int32_t *host_ids = make_ids(&s);
  const int capacity = capacity_for(&s, rows_needed(&s, host_ids)) + 4 * s.pad; /* room for other routings */
  const long long routes = (long long)s.w * s.t * s.k;
  const int64_t shape[3] = {s.w, s.t, s.k};
  moe_tensor *ids_cpu, *ids_gpu;
  if (moe_tensor_new(ctx, MOE_I32, 3, shape, CPU, &ids_cpu) || moe_tensor_new(ctx, MOE_I32, 3, shape, GPU, &ids_gpu))
    die("tensor_new");
  outputs cpu, gpu;
  outputs_new(&cpu, &s, capacity, CPU);
  outputs_new(&gpu, &s, capacity, GPU);
  moe_schedule_args a;
  moe_graph *graph = NULL;
  char name[400];
  describe(name, sizeof name, &s, capacity);
  int ok = 1;
  args_for(&a, &gpu, ids_gpu, &s, capacity);
  if (moe_graph_begin(ctx, GPU) || moe_schedule(ctx, &a) || moe_graph_end(ctx, &graph)) {
    printf("FAIL graph %s [capture]: %s\n", name, moe_errmsg(ctx));
    ok = 0;
  }
  for (int r = 0; ok && r < 3; r++) {
    if (r) {
      free(host_ids);
      s.seed = s0->seed + 1000 * r;
      s.mode = (s0->mode + r) % NMODES;
      rng = s.seed;
      host_ids = make_ids(&s);
    }
    if (moe_tensor_write(ctx, ids_cpu, host_ids, (size_t)routes * sizeof *host_ids) ||
        moe_tensor_copy(ctx, ids_gpu, ids_cpu))
      die("ids");
    args_for(&a, &cpu, ids_cpu, &s, capacity);
    if (moe_schedule(ctx, &a)) die("cpu schedule");
    outputs_fill(&gpu);
    if (moe_graph_replay(ctx, graph)) {
      printf("FAIL graph %s [replay %d]: %s\n", name, r, moe_errmsg(ctx));
      ok = 0;
      break;
    }
    char who[32];
    snprintf(who, sizeof who, "graph replay %d", r);
    ok &= same(who, &gpu, &cpu, name);
  }
  if (ok)
    printf("PASS graph%s (%s kernel) %s\n", fresh ? " (fresh context)" : "",
           moe_ctx_config_value(ctx, "schedule_kernel"), name);
  ok ? passed++ : failed++;
  moe_graph_free(graph);
  outputs_free(&cpu);
  outputs_free(&gpu);
  moe_tensor_free(ids_cpu);
  moe_tensor_free(ids_gpu);
  free(host_ids);
  if (fresh) {
    moe_ctx_close(ctx);
    ctx = outer;
  }
}

/* ---- the cases ---- */
static void model_cases(void) {
  static const struct { const char *name; int e, k; } models[] = {
      {"kimi-k2", 384, 8}, {"glm-5", 256, 8}, {"qwen3.5", 512, 10}, {"deepseek-v4-pro", 384, 6}};
  for (int m = 0; m < 4; m++)
    for (int layout = 0; layout < 2; layout++)
      for (int v = 0; v < 3; v++) {
        spec s = base(8, 7168, models[m].k, models[m].e, models[m].name);
        s.layout = layout;
        s.rank = v == 0 ? 0 : v == 1 ? 5 : 7;
        s.pad = v == 0 ? 1 : v == 1 ? 128 : 256;
        s.cap = v == 2 ? CAP_SHORT : CAP_AMPLE;
        s.mode = v == 2 ? SKEW : TOPK;
        run_case(&s);
      }
  /* Kimi K2 with capacity exactly met, exceeded, zero, and expert_capacity */
  for (int layout = 0; layout < 2; layout++)
    for (int v = 0; v < 4; v++) {
      spec s = base(8, 7168, 8, 384, "kimi-k2");
      s.layout = layout, s.rank = 3, s.pad = 128;
      s.cap = v == 0 ? CAP_EXACT : v == 1 ? CAP_SHORT : v == 2 ? CAP_ZERO : CAP_AMPLE;
      if (v == 3) s.expert_capacity = 1000;
      s.masked = 0.02;
      run_case(&s);
    }
}

static void decode_cases(void) { /* 512 tokens, E = 384, K = 8, W = 4 .. 64 */
  static const int worlds[] = {4, 8, 16, 32, 64};
  static const int pads[] = {1, 128, 256};
  for (int wi = 0; wi < 5; wi++)
    for (int layout = 0; layout < 2; layout++)
      for (int pi = 0; pi < 3; pi++)
        for (int r = 0; r < 2; r++) {
          spec s = base(worlds[wi], 512, 8, 384, "512-tokens");
          s.layout = layout, s.pad = pads[pi];
          s.rank = r ? worlds[wi] - 1 : 0;
          s.cap = r ? CAP_EXACT : CAP_AMPLE;
          run_case(&s);
        }
}

static void token_cases(void) {
  static const int tokens[] = {512, 1024, 2048, 7168};
  static const struct { int w, e, k; } shapes[] = {{8, 256, 8}, {4, 64, 6}, {16, 512, 10}};
  for (int ti = 0; ti < 4; ti++)
    for (int si = 0; si < 3; si++)
      for (int layout = 0; layout < 2; layout++)
        for (int v = 0; v < 2; v++) {
          spec s = base(shapes[si].w, tokens[ti], shapes[si].k, shapes[si].e, "tokens");
          s.layout = layout, s.rank = below(shapes[si].w);
          s.pad = v ? 128 : 1;
          s.cap = v ? CAP_SHORT : CAP_AMPLE;
          s.mode = v ? SKEW : TOPK;
          run_case(&s);
        }
}

static void minimum_cases(void) {
  static const int worlds[] = {1, 2, 8, 64};
  static const int tokens[] = {0, 1, 5, 127, 128, 129, 1023, 1024, 1025};
  for (int wi = 0; wi < 4; wi++)
    for (int ti = 0; ti < 9; ti++)
      for (int layout = 0; layout < 2; layout++) {
        spec s = base(worlds[wi], tokens[ti], 1, worlds[wi], "minimum"); /* E = W, K = 1 */
        s.layout = layout, s.rank = worlds[wi] - 1, s.mode = UNIFORM;
        s.pad = ti % 3 == 0 ? 1 : ti % 3 == 1 ? 2 : 7;
        s.cap = (CAP_AMPLE + ti) % NCAPS;
        run_case(&s);
      }
}

static void capacity_cases(void) {
  for (int c = 0; c < NCAPS; c++)
    for (int ec = 0; ec < 5; ec++)
      for (int layout = 0; layout < 2; layout++)
        for (int v = 0; v < 2; v++) {
          spec s = base(v ? 8 : 4, v ? 1500 : 700, 8, v ? 128 : 96, "capacity");
          s.layout = layout, s.cap = c, s.rank = 1;
          s.expert_capacity = ec == 0 ? -1 : ec == 1 ? 0 : ec == 2 ? 1 : ec == 3 ? 37 : 100000;
          s.pad = v ? 128 : 3;
          s.mode = ec % 2 ? SKEW : LOPSIDED;
          run_case(&s);
        }
}

static void id_cases(void) { /* masked and invalid ids */
  static const double masked[] = {0, 0.1, 0.9, 1.0};
  static const double invalid[] = {0, 0.001, 0.05, 1.0};
  for (int mi = 0; mi < 4; mi++)
    for (int ii = 0; ii < 4; ii++)
      for (int layout = 0; layout < 2; layout++)
        for (int v = 0; v < 2; v++) {
          spec s = base(8, v ? 2048 : 300, v ? 8 : 3, 256, "ids");
          s.layout = layout, s.rank = 2 + v, s.masked = masked[mi], s.invalid = invalid[ii];
          s.pad = v ? 64 : 1;
          s.mode = v ? UNIFORM : SKEW;
          run_case(&s);
        }
}

static void one_expert_cases(void) { /* every route to one expert */
  static const int worlds[] = {1, 4, 8, 64};
  for (int wi = 0; wi < 4; wi++)
    for (int layout = 0; layout < 2; layout++)
      for (int remote = 0; remote < 2; remote++)
        for (int v = 0; v < 3; v++) {
          spec s = base(worlds[wi], v == 2 ? 7168 : v ? 1024 : 100, 8, 384, "one-expert");
          s.layout = layout, s.rank = worlds[wi] > 1 ? 1 : 0, s.mode = remote ? ONE_REMOTE : ONE_LOCAL;
          s.pad = v == 1 ? 256 : 1;
          s.cap = v == 1 ? CAP_SHORT : CAP_AMPLE;
          run_case(&s);
        }
}

static void large_expert_cases(void) { /* E = 4096 and beyond: windows, global c[e][q] */
  static const struct { int w, t, k, e; } shapes[] = {
      {1, 300, 8, 4096}, {1, 5000, 8, 4096}, {4, 2048, 8, 4096}, {8, 2048, 8, 4096}, {64, 64, 8, 4096},
      {4096, 4, 2, 4096}, {1, 3000, 8, 16384}, {8192, 2, 2, 8192}, {2, 40000, 8, 4096}};
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
    for (int layout = 0; layout < 2; layout++)
      for (int v = 0; v < 2; v++) {
        spec s = base(shapes[i].w, shapes[i].t, shapes[i].k, shapes[i].e, "large-E");
        s.layout = layout, s.rank = shapes[i].w - 1;
        s.pad = v ? 256 : 1;
        s.mode = v ? SKEW : TOPK;
        s.cap = v ? CAP_RANDOM : CAP_AMPLE;
        run_case(&s);
      }
}

static void long_rank_cases(void) { /* chunks larger than one shared-memory piece */
  static const struct { int w, t, k, e; } shapes[] = {{1, 40000, 8, 64}, {2, 150000, 8, 16}, {1, 1048576, 8, 8}};
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
    for (int layout = 0; layout < 2; layout++) {
      spec s = base(shapes[i].w, shapes[i].t, shapes[i].k, shapes[i].e, "long-rank");
      s.layout = layout, s.mode = i == 1 ? SKEW : UNIFORM, s.pad = 128, s.masked = 0.01;
      run_case(&s);
    }
}

/* Four variants of each shape, both layouts: top-k routing with ample capacity; every route to one
 * local expert at capacity exactly met; skewed routing with pad 128, capacity short and invalid ids;
 * lopsided routing with zero capacity and expert_capacity = ecap.  Ids unaligned in two of the four,
 * 5% masked; pad 1 + i mod pad_cycle otherwise, rank (rank_step i + v) mod W. */
typedef struct {
  int w, t, k, e;
} case_shape;
static void ground_cases(const char *label, const case_shape *shapes, int n, int rank_step, int pad_cycle, int ecap) {
  for (int i = 0; i < n; i++)
    for (int layout = 0; layout < 2; layout++)
      for (int v = 0; v < 4; v++) {
        spec s = base(shapes[i].w, shapes[i].t, shapes[i].k, shapes[i].e, label);
        s.layout = layout;
        s.rank = (rank_step * i + v) % s.w;
        s.unaligned = v & 1;
        s.mode = v == 0 ? TOPK : v == 1 ? ONE_LOCAL : v == 2 ? SKEW : LOPSIDED;
        if (s.mode == TOPK && s.k > s.experts) s.mode = UNIFORM;
        s.cap = v == 0 ? CAP_AMPLE : v == 1 ? CAP_EXACT : v == 2 ? CAP_SHORT : CAP_ZERO;
        s.pad = v == 2 ? 128 : 1 + i % pad_cycle;
        if (v == 3) s.expert_capacity = ecap;
        s.masked = 0.05, s.invalid = v == 2 ? 0.02 : 0;
        run_case(&s);
      }
}

/* The bitmap kernel's ground (one grid of units of up to 4,096 positions, up to 128 experts a
 * rank, where the library picks it): each unit size (1, 2, 4 and 8 positions a thread), worlds
 * that are not powers of two (the totals' rows padded), 100 and 128 ranks (up to 32 lanes a
 * route's position), 128 experts a rank, logical threads with a partial last slot (K = 6, T K not
 * a multiple of 1024), one route a rank; every route to one local expert (all positions listed),
 * capacity met, exceeded and zero, expert_capacity, a large pad, invalid and masked ids. */
static void bitmap_cases(void) {
  static const case_shape shapes[] = {{6, 512, 8, 384}, {12, 256, 8, 384}, {100, 16, 8, 400},  {128, 8, 4, 128},
                                 {8, 512, 6, 384}, {4, 1023, 3, 512}, {2, 2048, 8, 256},  {8, 4096, 8, 256},
                                 {16, 1, 1, 16},   {64, 512, 8, 384}};
  ground_cases("bitmap", shapes, (int)(sizeof shapes / sizeof *shapes), 3, 3, 3);
}

static void random_cases(int n) {
  static const int pads[] = {1, 1, 2, 3, 4, 7, 8, 16, 64, 128, 256};
  for (int c = 0; c < n; c++) {
    rng = 0xfeedull * (c + 1);
    spec s = base(1, 1, 1, 1, NULL);
    const int r = below(10);
    s.w = r < 3 ? 1 + below(4) : r < 8 ? 1 + below(16) : 1 << below(7);
    const int el = below(4) ? 1 + below(80) : 1 + below(300);
    s.experts = s.w * el;
    if (s.experts > 8192) s.experts = s.w * (8192 / s.w);
    s.t = below(5) ? below(700) : below(4000);
    s.k = 1 + below(10);
    s.rank = below(s.w);
    s.pad = below(8) ? pads[below(11)] : 1 + below(300);
    s.expert_capacity = below(3) ? -1 : below(2 * (s.t * s.k / (s.experts ? s.experts : 1) + 2));
    s.layout = below(2);
    s.mode = below(NMODES);
    if (s.mode == TOPK && s.k > s.experts) s.mode = UNIFORM;
    s.cap = below(NCAPS);
    s.masked = below(3) ? 0 : below(2) ? 0.05 : 0.5;
    s.invalid = below(4) ? 0 : below(2) ? 0.01 : 0.2;
    s.seed = next();
    run_case(&s);
  }
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) max_routes = max_routes < 0 ? 200000 : max_routes;
    else if (!strcmp(argv[i], "--max-routes") && i + 1 < argc) max_routes = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--quick] [--max-routes N] [--only LABEL]\n", argv[0]);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  open_gpu_ctx();

  model_cases();      /* 32 */
  decode_cases();     /* 60 */
  token_cases();      /* 48 */
  minimum_cases();    /* 72 */
  capacity_cases();   /* 100 */
  id_cases();         /* 64 */
  one_expert_cases(); /* 48 */
  large_expert_cases(); /* 36 */
  long_rank_cases();  /* 6 */
  bitmap_cases();     /* 80 */
  for (int kernel = 0; kernel < 2; kernel++) /* each kernel forced */
    for (int fresh = 1; fresh >= 0; fresh--)
      for (int layout = 0; layout < 2; layout++) {
        static const char *const kernels[] = {"grid", "bitmap"};
        spec s = base(8, 1024, 8, 384, "graph");
        s.layout = layout, s.rank = 6, s.pad = 128;
        use_kernel(kernels[kernel]);
        run_graph_case(&s, fresh); /* 12 */
        use_kernel(NULL);
      }
  random_cases(540);
  if (!only || !strcmp(only, "kernel-name")) {
    /* a kernel that does not exist is refused, with the table's names; explain names the choice */
    const int rc = moe_ctx_config(ctx, "schedule_kernel", "fast");
    if (rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "bitmap, grid")) {
      printf("PASS schedule_kernel fast refused: %s\n", moe_errmsg(ctx));
      passed++;
    } else {
      printf("FAIL schedule_kernel fast: status %d, %s\n", rc, moe_errmsg(ctx));
      failed++;
    }
    static const struct { int w, t, k, e; const char *want; } shapes[] = {
        {8, 16, 8, 384, "bitmap\nbitmap: runs\ngrid: takes it, but an earlier kernel runs\n"},
        {1, 512, 8, 384, "grid\nbitmap: cannot: more than 128 experts a rank\ngrid: runs\n"}};
    for (int i = 0; i < 2; i++) {
      spec s = base(shapes[i].w, shapes[i].t, shapes[i].k, shapes[i].e, "kernel-name");
      rng = s.seed;
      int32_t *host_ids = make_ids(&s);
      const int64_t shape[3] = {s.w, s.t, s.k};
      moe_tensor *ids;
      if (moe_tensor_new(ctx, MOE_I32, 3, shape, GPU, &ids) ||
          moe_tensor_write(ctx, ids, host_ids, (size_t)s.w * s.t * s.k * sizeof *host_ids))
        die("ids");
      const int capacity = s.w * s.t * s.k;
      outputs gpu;
      outputs_new(&gpu, &s, capacity, GPU);
      moe_schedule_args a;
      args_for(&a, &gpu, ids, &s, capacity);
      char report[1024] = "";
      const int erc = moe_schedule_explain(ctx, &a, report, sizeof report);
      if (erc == MOE_OK && !strcmp(report, shapes[i].want)) {
        printf("PASS explain W=%d T=%d E=%d: %s", s.w, s.t, s.experts, report);
        passed++;
      } else {
        printf("FAIL explain W=%d T=%d E=%d: status %d (%s), report:\n%swanted:\n%s", s.w, s.t, s.experts, erc,
               moe_errmsg(ctx), report, shapes[i].want);
        failed++;
      }
      outputs_free(&gpu);
      moe_tensor_free(ids);
      free(host_ids);
    }
  }

  printf("%d passed, %d failed\n", passed, failed);
  moe_ctx_close(ctx);
  return failed ? 1 : 0;
}
