/* test_schedule_gpu.c -- the CUDA schedule against the CPU reference, every output bit for bit,
 * on random and adversarial routings of the shapes that matter (docs/design.md, "The stages", 2),
 * for both layouts, each through the library's choice of kernel and through each kernel forced
 * (the context's schedule_kernel option: grid, and bitmap where it takes the problem); what
 * moe_schedule_explain reports must name the kernel that ran.  Outputs on the GPU are views into
 * larger buffers prefilled with a sentinel, so an element left unwritten or a write past an
 * output's end (past capacity, say) shows as a mismatch.  A few cases run from a captured CUDA
 * graph, replayed on changed routings.  Then the kernels are timed (the legacy baseline is timed
 * by bench/schedule_legacy.cu, scenarios/scheduler.lua's "legacy µs").
 *
 *   test_schedule_gpu [--quick] [--max-routes N] [--only LABEL] [--trace] [--shape W,T]
 *     --quick: skip the cases over 200,000 routes, and the timing; --max-routes: skip those over N;
 *     --only: run only the cases whose label (kimi-k2, 512-tokens, graph, random, ...) is LABEL
 *     --trace: no cases; the timings, each with where one call's time goes (the kernel's phases)
 *     --shape W,T: with --trace, only that shape (E 384, K 8): for a profiler (bench/device.sh)
 *
 * Exit status: 0 all passed, 1 a failure, 77 no GPU (skipped), 2 a setup error. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h" /* moeI_schedule_set_trace and the trace readers: this program links the static library */

static moe_ctx *ctx;
static const moe_device CPU = {MOE_CPU, 0}, GPU = {MOE_CUDA, 0};
static int passed, failed, quick, trace, shape_w, shape_t;
static long long max_routes = -1;
static const char *only;

#define SENTINEL 0x3c3c3c3c /* never a row, route, count or stat of these cases */
#define GUARD 97            /* elements of sentinel after every GPU output */

static void die(const char *what) {
  fprintf(stderr, "setup: %s: %s\n", what, moe_errmsg(ctx));
  exit(2);
}

/* ---- random numbers (splitmix64) ---- */
static uint64_t rng;
static uint64_t next(void) {
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int below(int n) { return n <= 1 ? 0 : (int)(next() % (uint64_t)n); }
static int chance(double p) { return (double)(next() >> 11) * (1.0 / 9007199254740992.0) < p; }

/* The context's schedule_kernel option: NULL for the library's choice, "grid" or "bitmap" to force one. */
static void use_kernel(const char *k) {
  if (moe_ctx_config(ctx, "schedule_kernel", k ? k : "auto")) die("schedule_kernel option");
}

/* ---- a case ---- */
enum { UNIFORM, TOPK, SKEW, ONE_LOCAL, ONE_REMOTE, LOPSIDED, NMODES };
static const char *const mode_names[] = {"uniform", "topk", "skew", "one-local", "one-remote", "lopsided"};
enum { CAP_AMPLE, CAP_EXACT, CAP_SHORT, CAP_ZERO, CAP_RANDOM, NCAPS };
static const char *const cap_names[] = {"ample", "exact", "short", "zero", "random"};

typedef struct {
  int w, t, k, experts, rank, pad, expert_capacity, layout;
  int unaligned;       /* the GPU ids a view one element into a larger tensor (not 16-byte aligned) */
  int mode, cap;       /* ids distribution, capacity relative to the rows needed */
  double masked, invalid;
  uint64_t seed;
  const char *label;
} spec;

static int32_t *make_ids(const spec *s) {
  const size_t n = (size_t)s->w * s->t * s->k;
  int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
  if (!ids) exit(2);
  const int E = s->experts, el = E / s->w;
  const int hot = below(E), target = s->mode == ONE_LOCAL ? s->rank * el + below(el)
                                   : s->w > 1             ? ((s->rank + 1) % s->w) * el + below(el)
                                                          : -1;
  for (int p = 0; p < s->w; p++)
    for (int t = 0; t < s->t; t++) {
      int32_t *row = ids + ((size_t)p * s->t + t) * s->k;
      for (int k = 0; k < s->k; k++) {
        int id;
        switch (s->mode) {
        case TOPK: /* distinct experts per token, as top-k gives */
          for (;;) {
            id = below(E);
            int dup = 0;
            for (int j = 0; j < k; j++) dup |= row[j] == id;
            if (!dup || k >= E) break;
          }
          break;
        case SKEW: id = chance(0.6) ? (hot + below(3)) % E : below(E); break;
        case ONE_LOCAL: id = target; break;
        case ONE_REMOTE: id = target >= 0 ? target : below(E); break;
        case LOPSIDED: /* source p favours the experts of one rank, and sends more the higher p is */
          id = chance(0.7) ? ((p * 3) % s->w) * el + below(el) : below(E);
          if (!chance((p + 1.0) / s->w)) id = -1;
          break;
        default: id = below(E);
        }
        if (s->masked > 0 && chance(s->masked)) id = -1;
        if (s->invalid > 0 && chance(s->invalid)) {
          static const int bad[] = {-2, -100, INT_MIN, INT_MAX};
          const int r = below(6);
          id = r < 4 ? bad[r] : r == 4 ? E : E + 1 + below(1000);
        }
        row[k] = id;
      }
    }
  return ids;
}

/* Padded rows the local routes need (what stats[ROWS_NEEDED] reports, before the clamp). */
static long long rows_needed(const spec *s, const int32_t *ids) {
  const int el = s->experts / s->w, lo = s->rank * el;
  long long *n = calloc((size_t)el, sizeof *n), total = 0;
  if (!n) exit(2);
  const size_t all = (size_t)s->w * s->t * s->k;
  for (size_t i = 0; i < all; i++)
    if (ids[i] >= lo && ids[i] < lo + el) n[ids[i] - lo]++;
  for (int e = 0; e < el; e++) {
    long long c = n[e];
    if (s->expert_capacity >= 0 && c > s->expert_capacity) c = s->expert_capacity;
    total += (c + s->pad - 1) / s->pad * s->pad;
  }
  free(n);
  return total;
}

static int capacity_for(const spec *s, long long need) {
  long long c;
  switch (s->cap) {
  case CAP_EXACT: c = need; break;
  case CAP_SHORT: c = need - 1 - need / 4; break;
  case CAP_ZERO: c = 0; break;
  case CAP_RANDOM: c = need > 0 ? (long long)(next() % (uint64_t)(need + need / 2 + 1)) : below(5); break;
  default: c = need + below(2 * s->pad + 3);
  }
  if (c < 0) c = 0;
  if (c > INT_MAX - GUARD) c = INT_MAX - GUARD;
  return (int)c;
}

/* ---- tensors ---- */
enum { O_PEER_RANK, O_PEER_ROUTE, O_COUNTS, O_TPE, O_OFFSETS, O_ROUTE_ROW, O_STATS, NOUT };
static const char *const out_names[] = {"peer_rank", "peer_route", "counts", "tokens_per_expert",
                                        "expert_offsets", "route_row", "stats"};

typedef struct {
  moe_tensor *base[NOUT], *view[NOUT];
  int64_t n[NOUT];
  int on_gpu;
} outputs;

static moe_tensor *new_i32(int64_t n, moe_device dev) {
  moe_tensor *t;
  if (moe_tensor_new(ctx, MOE_I32, 1, &n, dev, &t)) die("tensor_new");
  return t;
}

static void outputs_new(outputs *o, const spec *s, int capacity, moe_device dev) {
  const int el = s->experts / s->w;
  o->n[O_PEER_RANK] = o->n[O_PEER_ROUTE] = capacity;
  o->n[O_COUNTS] = o->n[O_TPE] = el;
  o->n[O_OFFSETS] = el + 1;
  o->n[O_ROUTE_ROW] = (int64_t)s->w * s->t * s->k;
  o->n[O_STATS] = MOE_SCHED_STATS;
  o->on_gpu = dev.kind == MOE_CUDA;
  for (int i = 0; i < NOUT; i++) {
    const int64_t extra = o->on_gpu ? GUARD : 0;
    o->base[i] = new_i32(o->n[i] + extra, dev);
    int64_t shape[2] = {o->n[i], 0};
    int ndim = 1;
    if (i == O_ROUTE_ROW) shape[0] = s->w, shape[1] = (int64_t)s->t * s->k, ndim = 2;
    if (moe_tensor_view(ctx, o->base[i], 0, ndim, shape, &o->view[i])) die("tensor_view");
  }
}

static void outputs_fill(outputs *o) {
  for (int i = 0; i < NOUT; i++)
    if (moe_tensor_fill(ctx, o->base[i], SENTINEL)) die("tensor_fill");
}

static void outputs_free(outputs *o) {
  for (int i = 0; i < NOUT; i++) moe_tensor_free(o->view[i]), moe_tensor_free(o->base[i]);
}

static void args_for(moe_schedule_args *a, const outputs *o, moe_tensor *ids, const spec *s, int capacity) {
  memset(a, 0, sizeof *a);
  a->peer_rank = o->view[O_PEER_RANK];
  a->peer_route = o->view[O_PEER_ROUTE];
  a->counts = o->view[O_COUNTS];
  a->tokens_per_expert = o->view[O_TPE];
  a->expert_offsets = o->view[O_OFFSETS];
  a->route_row = o->view[O_ROUTE_ROW];
  a->stats = o->view[O_STATS];
  a->ids = ids;
  a->experts = s->experts;
  a->rank = s->rank;
  a->pad = s->pad;
  a->capacity = capacity;
  a->expert_capacity = s->expert_capacity;
  a->layout = s->layout;
}

/* Compares the GPU outputs (and their guards) with the CPU's; prints the first differences. */
static int same(const char *who, const outputs *gpu, const outputs *cpu, const char *name) {
  int ok = 1;
  for (int i = 0; i < NOUT; i++) {
    const int64_t n = gpu->n[i], total = n + GUARD;
    int32_t *got = malloc((size_t)total * sizeof *got);
    if (!got) exit(2);
    if (moe_tensor_read(ctx, gpu->base[i], got, (size_t)total * sizeof *got)) die("tensor_read");
    const int32_t *want = moe_tensor_data(cpu->view[i]);
    int shown = 0;
    for (int64_t j = 0; j < total && shown < 4; j++) {
      const int32_t w = j < n ? want[j] : SENTINEL;
      if (got[j] != w) {
        if (ok) printf("FAIL %s [%s]\n", name, who);
        ok = 0;
        shown++;
        printf("     %s[%lld] = %d, expected %d%s\n", out_names[i], (long long)j, got[j], w,
               j >= n ? " (past the end)" : got[j] == SENTINEL ? " (never written)" : "");
      }
    }
    free(got);
  }
  return ok;
}

static void describe(char *buf, size_t len, const spec *s, int capacity) {
  snprintf(buf, len, "%s W=%d T=%d K=%d E=%d rank=%d pad=%d C=%d ec=%d %s %s cap=%s masked=%.2g invalid=%.2g seed=%llu",
           s->label ? s->label : "random", s->w, s->t, s->k, s->experts, s->rank, s->pad, capacity,
           s->expert_capacity, s->layout == MOE_LAYOUT_ROUNDROBIN ? "roundrobin" : "peer_major",
           mode_names[s->mode], cap_names[s->cap], s->masked, s->invalid, (unsigned long long)s->seed);
}

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
static uint64_t seed_counter = 1;
static spec base(int w, int t, int k, int e, const char *label) {
  spec s;
  memset(&s, 0, sizeof s);
  s.w = w, s.t = t, s.k = k, s.experts = e, s.pad = 1, s.expert_capacity = -1;
  s.layout = MOE_LAYOUT_ROUNDROBIN, s.mode = TOPK, s.cap = CAP_AMPLE;
  s.seed = 0x5eed0000ull + 7919 * seed_counter++;
  s.label = label;
  return s;
}

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

/* ---- timing ---- */
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

/* --trace: where one call's time goes.  Per phase, the median over blocks of its clock64 cycles
 * (grid kernel: load, rank, barrier, histogram reads, scan, place, route_row + clears; bitmap
 * kernel: load, scan, barrier, totals, segments + place + fill, stats); the span by %globaltimer
 * (first entry to last end); beside the per-call time in a graph of 200 calls. */
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
  moe_schedule_args a;
  args_for(&a, &gpu, ids, &s, capacity);
  const float ours = time_calls(moe_schedule, &a);
  use_kernel("grid");
  const float grid = time_calls(moe_schedule, &a);
  use_kernel("bitmap");
  const float bitmap = moe_schedule(ctx, &a) == MOE_OK ? time_calls(moe_schedule, &a) : -1; /* -1: it cannot */
  use_kernel(NULL);
  char bm[48];
  if (bitmap >= 0) snprintf(bm, sizeof bm, "%.2f", bitmap);
  else snprintf(bm, sizeof bm, "does not take it");
  printf("time: schedule, Kimi K2 rank of EP%d (W %d, T %d, K 8, E 384, %d routes): %.2f us per call "
         "(target <= %.0f us; grid kernel %.2f, bitmap kernel %s)\n",
         w, w, t, s.w * s.t * s.k, ours, target_us, grid, bm);
  if (trace)
    for (int k = K_GRID; k <= K_BITMAP; k++) {
      const float per_call = k == K_GRID ? grid : bitmap;
      if (per_call < 0) continue;
      use_kernel(k == K_GRID ? "grid" : "bitmap");
      for (int again = 0; again < 2; again++) { /* after other calls, then once more */
        if (moe_schedule(ctx, &a)) die("traced call");
        char label[64];
        snprintf(label, sizeof label, "EP%d T %d%s", w, t, again ? " again" : "");
        print_trace(label, per_call, k);
      }
      use_kernel(NULL);
    }
  outputs_free(&gpu);
  moe_tensor_free(ids);
  free(host_ids);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = 1, max_routes = max_routes < 0 ? 200000 : max_routes;
    else if (!strcmp(argv[i], "--max-routes") && i + 1 < argc) max_routes = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--trace")) trace = 1;
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc && sscanf(argv[i + 1], "%d,%d", &shape_w, &shape_t) == 2) i++;
    else {
      fprintf(stderr, "usage: %s [--quick] [--max-routes N] [--only LABEL] [--trace] [--shape W,T]\n", argv[0]);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (moe_ctx_open(&ctx)) return 2;
  int gpus = 0;
  if (moe_device_count(ctx, MOE_CUDA, &gpus) || gpus == 0) {
    printf("SKIP: no GPU\n");
    moe_ctx_close(ctx);
    return 77;
  }

  if (trace) { /* timing only, with the phases of one call of each shape */
    moeI_schedule_set_trace(ctx, 1);
    if (shape_w > 0 && shape_t > 0) {
      timing(shape_w, shape_t, shape_t > 512 ? 12 : 6);
      moe_ctx_close(ctx);
      return 0;
    }
    timing(8, 7168, 12);
    const int ws[] = {4, 8, 16, 32, 64};
    for (int i = 0; i < 5; i++) timing(ws[i], 512, 6);
    moe_ctx_close(ctx);
    return 0;
  }
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
  if (!quick && !only && !failed) {
    timing(8, 7168, 12);
    timing(8, 512, 6);
  }
  moe_ctx_close(ctx);
  return failed ? 1 : 0;
}
