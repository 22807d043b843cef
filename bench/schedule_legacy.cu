/* SPDX-License-Identifier: MIT */
// schedule_legacy.cu -- the scheduler moelab started from (the MoK seed's algorithm), as a bench
// program: the baseline that scenarios/scheduler.lua's "legacy µs" column times, and a second,
// independent implementation of the "roundrobin" layout whose result must equal moe_schedule's.
//
// One block of 1024 threads per (local expert e, source rank p), CUDA thread th being logical
// thread th.  legacy_count: each block counts the routes of rank p to e (c[e][p], into scratch).
// legacy_place: each block sums the padded sizes of the experts before e for its base, then
// scans rank p's routes twice: once to count its thread's routes to e, a block scan turning those
// counts into each thread's first ordinal j, and once more to place them in order.  Every block
// reads all of its rank's ids twice, E * W * T * K reads in all: why the library does not use it.
//
//   schedule_legacy W T E K [--capacity C] [--pad B] [--calls N] [--reps R] [--seed S] [--device D]
//
// The ids: every rank's T tokens routed by softmax top-K of randn logits (std 1.5, seed S), rank 0's
// schedule, capacity C (default: every route on this rank, W T K + E/W (B - 1), as schedule's).
// Both schedulers run once into outputs prefilled with different values and are compared bit for
// bit; then each is timed as N calls captured in one CUDA graph, the median of R replays.  Prints
// one line per scheduler, "legacy_us X" and "schedule_us Y" (µs a call).  Exit status: 0, 1 on a
// mismatch, 2 on bad arguments or a failed call, 77 without a GPU.
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "schedule.cuh"

namespace {

constexpr int kThreads = MOE_SCHED_THREADS;
constexpr int kStageC = 4096; // c[e][q] of the block's expert in shared memory up to this world size

struct LegacyParams : ScheduleCall {
  int32_t *c, *inv; // scratch: c [EL][W], inv [W][2]
};

__global__ void __launch_bounds__(kThreads) legacy_count(const LegacyParams P) {
  __shared__ int sh[32];
  const int e = blockIdx.x / P.world, p = blockIdx.x - e * P.world;
  const int32_t *ids = P.ids + (size_t)p * P.tk;
  const int want = P.lo + e;
  int n = 0, ninv = 0, first = INT_MAX;
  for (int i = threadIdx.x; i < P.tk; i += kThreads) {
    const int v = __ldg(ids + i);
    n += v == want;
    if (e == 0 && v != -1 && (v < 0 || v >= P.experts)) {
      ninv++;
      first = min(first, p * P.tk + i);
    }
  }
  n = block_sum(n, sh);
  if (e == 0) {
    ninv = block_sum(ninv, sh);
    first = block_min(first, sh);
  }
  if (threadIdx.x == 0) {
    P.c[(size_t)e * P.world + p] = n;
    if (e == 0) {
      P.inv[2 * p] = ninv;
      P.inv[2 * p + 1] = first;
    }
  }
}

__global__ void __launch_bounds__(kThreads) legacy_place(const LegacyParams P) {
  extern __shared__ int32_t cs[];
  __shared__ long long shl[32];
  __shared__ int shi[32];
  const int tid = threadIdx.x, W = P.world, EL = P.el;
  const int e = blockIdx.x / W, p = blockIdx.x - e * W;
  const unsigned lo = (unsigned)P.lo;

  // base: the padded sizes of the experts before e
  long long part = 0;
  for (int f = tid; f < e; f += kThreads) {
    int raw = 0;
    for (int q = 0; q < W; q++) raw += __ldcg(P.c + (size_t)f * W + q);
    part += segment_padded(segment_routes(raw, P.expert_capacity), P.pad);
  }
  const long long base = block_sum(part, shl);
  const int32_t *ce = P.c + (size_t)e * W;
  const bool staged = W <= kStageC;
  int mine = 0;
  for (int q = tid; q < W; q += kThreads) {
    const int v = __ldcg(ce + q);
    if (staged) cs[q] = v;
    mine += v;
  }
  const int raw = block_sum(mine, shi); // its barriers also publish cs
  const int n = segment_routes(raw, P.expert_capacity);
  const long long padded = segment_padded(n, P.pad);
  const int kept = segment_kept(n, base, P.capacity);
  const long long cap = P.capacity;
  const int off = (int)(base < cap ? base : cap);
  const int end = (int)(base + padded < cap ? base + padded : cap);

  // pass 1: this logical thread's routes to e; a block scan gives its first ordinal
  const int32_t *ids = P.ids + (size_t)p * P.tk;
  int32_t *rrow = P.route_row + (size_t)p * P.tk;
  int hits = 0;
  for (int i = tid; i < P.tk; i += kThreads) hits += (unsigned)__ldg(ids + i) - lo == (unsigned)e;
  int total;
  int j = block_exclusive_scan(hits, &total, shi);
  // pass 2: place them in order
  for (int i = tid; i < P.tk; i += kThreads)
    if ((unsigned)__ldg(ids + i) - lo == (unsigned)e) {
      const int pos = staged ? roundrobin_position<false>(cs, W, p, j) : roundrobin_position<true>(ce, W, p, j);
      rrow[i] = place_route(P, p, i, pos, off, kept);
      j++;
    }
  // routes of rank p that are not this rank's (masked and invalid ones included)
  if (e == 0)
    for (int i = tid; i < P.tk; i += kThreads)
      if ((unsigned)__ldg(ids + i) - lo >= (unsigned)EL) rrow[i] = -1;

  if (p != 0) return;
  for (int r = off + kept + tid; r < end; r += kThreads) {
    P.peer_rank[r] = -1;
    P.peer_route[r] = -1;
  }
  if (tid == 0) {
    P.counts[e] = kept;
    P.offsets[e] = off;
    P.tpe[e] = end - off;
  }
  if (e != EL - 1) return;

  // the last expert's block: unused rows and the stats
  const long long all = base + padded;
  const int used = (int)(all < cap ? all : cap);
  for (int r = used + tid; r < P.capacity; r += kThreads) {
    P.peer_rank[r] = -1;
    P.peer_route[r] = -1;
  }
  long long carry = 0;
  int dropped = 0;
  for (int f0 = 0; f0 < EL; f0 += kThreads) {
    const int f = f0 + tid;
    int rawf = 0;
    if (f < EL)
      for (int q = 0; q < W; q++) rawf += __ldcg(P.c + (size_t)f * W + q);
    const int nf = segment_routes(rawf, P.expert_capacity);
    const long long pf = f < EL ? segment_padded(nf, P.pad) : 0;
    long long sum;
    const long long bf = carry + block_exclusive_scan(pf, &sum, shl);
    carry += sum;
    if (f < EL) dropped += rawf - segment_kept(nf, bf, P.capacity);
  }
  dropped = block_sum(dropped, shi);
  int ninv = 0, first = INT_MAX;
  for (int q = tid; q < W; q += kThreads) {
    ninv += __ldcg(P.inv + 2 * q);
    first = min(first, __ldcg(P.inv + 2 * q + 1));
  }
  ninv = block_sum(ninv, shi);
  first = block_min(first, shi);
  if (tid == 0) {
    P.offsets[EL] = used;
    P.stats[MOE_STAT_ROWS_NEEDED] = (int)(all < INT_MAX ? all : INT_MAX);
    P.stats[MOE_STAT_ROWS_USED] = used;
    P.stats[MOE_STAT_DROPPED] = dropped;
    P.stats[MOE_STAT_INVALID] = ninv;
    P.stats[MOE_STAT_FIRST_INVALID] = ninv ? first : -1;
  }
}

// The two launches on st, scratch c [E] then inv [2 W] (c[e][q] and the invalid counts: written
// by legacy_count before legacy_place reads them, so nothing needs clearing between calls).
int legacy_launch(const moe_schedule_args *a, cudaStream_t st, int32_t *scratch) {
  LegacyParams P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  const int W = P.world;
  P.c = scratch;
  P.inv = P.c + a->experts;
  const unsigned blocks = (unsigned)a->experts; // one per (local expert, source rank)
  legacy_count<<<blocks, kThreads, 0, st>>>(P);
  // 4 ints of slack: the compiler reads cs in vector pieces that may run past W (memcheck saw it)
  legacy_place<<<blocks, kThreads, W <= kStageC ? sizeof(int32_t) * (W + 4) : 0, st>>>(P);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

} // namespace

static moe_ctx *ctx;
static moe_device GPU = {MOE_CUDA, 0};
static int32_t *scratch;

static void die(const char *what) {
  fprintf(stderr, "schedule_legacy: %s: %s\n", what, moe_errmsg(ctx));
  exit(2);
}

static moe_tensor *new_i32(int ndim, const int64_t *shape) {
  moe_tensor *t;
  if (moe_tensor_new(ctx, MOE_I32, ndim, shape, GPU, &t)) die("tensor_new");
  return t;
}

// The seven outputs of a schedule, on the GPU.
struct Outputs {
  moe_tensor *t[7];
};
static const char *const kNames[7] = {"peer_rank", "peer_route", "counts", "tokens_per_expert", "expert_offsets",
                                      "route_row", "stats"};
static Outputs outputs_new(int64_t W, int64_t TK, int64_t EL, int64_t C) {
  const int64_t c[1] = {C}, el[1] = {EL}, el1[1] = {EL + 1}, rr[2] = {W, TK}, st[1] = {MOE_SCHED_STATS};
  Outputs o = {{new_i32(1, c), new_i32(1, c), new_i32(1, el), new_i32(1, el), new_i32(1, el1), new_i32(2, rr),
                new_i32(1, st)}};
  return o;
}
static moe_schedule_args args_of(const Outputs &o, const moe_tensor *ids, int E, int pad, int C) {
  moe_schedule_args a;
  memset(&a, 0, sizeof a);
  a.peer_rank = o.t[0], a.peer_route = o.t[1], a.counts = o.t[2], a.tokens_per_expert = o.t[3];
  a.expert_offsets = o.t[4], a.route_row = o.t[5], a.stats = o.t[6];
  a.ids = ids, a.experts = E, a.rank = 0, a.pad = pad, a.capacity = C, a.expert_capacity = -1;
  a.layout = MOE_LAYOUT_ROUNDROBIN;
  return a;
}

static int run_legacy(const moe_schedule_args *a) {
  return legacy_launch(a, (cudaStream_t)moe_ctx_stream(ctx), scratch);
}
static int run_schedule(const moe_schedule_args *a) { return moe_schedule(ctx, a); }

// Median µs a call: reps replays of a graph of `calls` calls, after a warm-up replay.
static float time_calls(int (*fn)(const moe_schedule_args *), const moe_schedule_args *a, int calls, int reps) {
  moe_graph *graph = NULL;
  moe_event *start, *stop;
  if (moe_event_new(ctx, GPU, &start) || moe_event_new(ctx, GPU, &stop)) die("event_new");
  if (moe_graph_begin(ctx, GPU)) die("graph_begin");
  for (int i = 0; i < calls; i++)
    if (fn(a)) die("captured call");
  if (moe_graph_end(ctx, &graph) || moe_graph_replay(ctx, graph)) die("graph");
  std::vector<float> us;
  for (int r = 0; r < reps; r++) {
    float ms;
    if (moe_event_record(ctx, start) || moe_graph_replay(ctx, graph) || moe_event_record(ctx, stop) ||
        moe_event_elapsed(ctx, start, stop, &ms))
      die("timed replay");
    us.push_back(ms * 1000.0f / (float)calls);
  }
  std::sort(us.begin(), us.end());
  moe_graph_free(graph);
  moe_event_free(start);
  moe_event_free(stop);
  return us[us.size() / 2];
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s W T E K [--capacity C] [--pad B] [--calls N] [--reps R] [--seed S] [--device D]\n",
            argv[0]);
    return 2;
  }
  const long long W = atoll(argv[1]), T = atoll(argv[2]), E = atoll(argv[3]), K = atoll(argv[4]);
  long long C = -1, pad = 1, calls = 200, reps = 9, seed = 1;
  for (int i = 5; i + 1 < argc; i += 2) {
    const long long v = atoll(argv[i + 1]);
    if (!strcmp(argv[i], "--capacity")) C = v;
    else if (!strcmp(argv[i], "--pad")) pad = v;
    else if (!strcmp(argv[i], "--calls")) calls = v;
    else if (!strcmp(argv[i], "--reps")) reps = v;
    else if (!strcmp(argv[i], "--seed")) seed = v;
    else if (!strcmp(argv[i], "--device")) GPU.index = (int)v;
    else {
      fprintf(stderr, "schedule_legacy: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if ((argc - 5) % 2 || W < 1 || T < 1 || K < 1 || E < K || E % W || pad < 1 || calls < 1 || reps < 1 ||
      W * T * K > INT_MAX - 65536) {
    fprintf(stderr, "schedule_legacy: need W, T, K >= 1, E >= K a multiple of W, pad, calls, reps >= 1, "
                    "W T K < 2^31\n");
    return 2;
  }
  const long long EL = E / W;
  if (C < 0) C = W * T * K + EL * (pad - 1);
  if (C > INT_MAX - 1) {
    fprintf(stderr, "schedule_legacy: capacity %lld does not fit i32\n", C);
    return 2;
  }
  if (moe_ctx_open(&ctx)) return 2;
  int gpus = 0;
  if (moe_device_count(ctx, MOE_CUDA, &gpus) || gpus <= GPU.index) {
    printf("SKIP: no GPU cuda:%d\n", GPU.index);
    return 77;
  }

  // ids: softmax top-K of randn logits, every rank's T tokens
  const int64_t ls[2] = {W * T, E}, is[2] = {W * T, K}, ids3[3] = {W, T, K};
  moe_tensor *logits, *weights, *ids2, *ids;
  if (moe_tensor_new(ctx, MOE_F32, 2, ls, GPU, &logits) || moe_tensor_new(ctx, MOE_F32, 2, is, GPU, &weights) ||
      moe_tensor_new(ctx, MOE_I32, 2, is, GPU, &ids2) || moe_tensor_randn(ctx, logits, (uint64_t)seed, 1.5f))
    die("logits");
  moe_route_args r;
  memset(&r, 0, sizeof r);
  r.ids = ids2, r.weights = weights, r.logits = logits, r.k = (int)K, r.scoring = MOE_SCORE_SOFTMAX;
  r.groups = 1, r.topk_groups = 1, r.scale = 1.0f;
  if (moe_route(ctx, &r) || moe_tensor_view(ctx, ids2, 0, 3, ids3, &ids)) die("route");
  if (cudaMalloc(&scratch, sizeof(int32_t) * (size_t)(E + 2 * W)) != cudaSuccess) die("cudaMalloc");

  Outputs lo = outputs_new(W, T * K, EL, C), so = outputs_new(W, T * K, EL, C);
  const moe_schedule_args la = args_of(lo, ids, (int)E, (int)pad, (int)C);
  const moe_schedule_args sa = args_of(so, ids, (int)E, (int)pad, (int)C);
  for (int i = 0; i < 7; i++)
    if (moe_tensor_fill(ctx, lo.t[i], -7) || moe_tensor_fill(ctx, so.t[i], -9)) die("fill");
  if (run_legacy(&la) || run_schedule(&sa) || moe_ctx_synchronize(ctx, GPU)) die("first calls");
  int same = 1;
  for (int i = 0; i < 7; i++) {
    const size_t n = (size_t)moe_tensor_numel(lo.t[i]);
    std::vector<int32_t> x(n), y(n);
    if (moe_tensor_read(ctx, lo.t[i], x.data(), n * 4) || moe_tensor_read(ctx, so.t[i], y.data(), n * 4)) die("read");
    for (size_t j = 0; j < n; j++)
      if (x[j] != y[j]) {
        printf("MISMATCH %s[%zu]: legacy %d, moe_schedule %d\n", kNames[i], j, x[j], y[j]);
        same = 0;
        break;
      }
  }
  if (!same) return 1;
  printf("W %lld T %lld E %lld K %lld capacity %lld pad %lld: legacy equals moe_schedule (%s kernel), bit for bit\n",
         W, T, E, K, C, pad, moe_ctx_config_value(ctx, "schedule_kernel"));
  printf("legacy_us %.2f\n", time_calls(run_legacy, &la, (int)calls, (int)reps));
  printf("schedule_us %.2f\n", time_calls(run_schedule, &sa, (int)calls, (int)reps));
  cudaFree(scratch);
  moe_ctx_close(ctx);
  return 0;
}
