// schedule_legacy.cu -- the scheduler moelab started from (the MoK seed's algorithm), kept as
// the benchmark baseline of kernels/schedule.cu and as a second, independent implementation of
// the "roundrobin" layout: its results must equal moeI_schedule_cpu bit for bit as well.
//
// One block of 1024 threads per (local expert e, source rank p), CUDA thread th being logical
// thread th.  legacy_count: each block counts the routes of rank p to e (c[e][p], into scratch).
// legacy_place: each block sums the padded sizes of the experts before e for its base, then
// scans rank p's routes twice: once to count its thread's routes to e, a block scan turning those
// counts into each thread's first ordinal j, and once more to place them in order.  Every block
// reads all of its rank's ids twice, E * W * T * K reads in all: that is why it was replaced.
#include <limits.h>
#include <stdint.h>

#include "schedule.cuh"

#define STAGE "schedule_legacy"

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

} // namespace

extern "C" int moeI_schedule_legacy_cuda(moe_ctx *ctx, const moe_schedule_args *a) {
  if (a->layout != MOE_LAYOUT_ROUNDROBIN)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": only the roundrobin layout (%d) is implemented, got %d",
                      MOE_LAYOUT_ROUNDROBIN, a->layout);
  const int device = a->ids->device.index;
  cudaStream_t st;
  int rc = moeI_cuda_ctx_stream(ctx, device, &st);
  if (rc) return rc;

  LegacyParams P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  const int W = P.world;

  void *scratch;
  int owned;
  const size_t nbytes = MOE_SCRATCH_HEADER + sizeof(int32_t) * ((size_t)a->experts + 2 * (size_t)W);
  if ((rc = moeI_cuda_scratch_get(ctx, device, st, nbytes, &scratch, &owned))) return rc;
  P.c = (int32_t *)((char *)scratch + MOE_SCRATCH_HEADER); // the header belongs to schedule.cu's ticket
  P.inv = P.c + a->experts;

  const unsigned blocks = (unsigned)a->experts; // one per (local expert, source rank)
  legacy_count<<<blocks, kThreads, 0, st>>>(P);
  MOE_CUDA_LAUNCHED(ctx, STAGE);
  // 4 ints of slack: the compiler reads cs in vector pieces that may run past W (memcheck saw it)
  legacy_place<<<blocks, kThreads, W <= kStageC ? sizeof(int32_t) * (W + 4) : 0, st>>>(P);
  MOE_CUDA_LAUNCHED(ctx, STAGE);
  if ((rc = moeI_cuda_scratch_done(ctx, st, scratch, owned))) return rc;
  return moeI_ok(ctx);
}
