// schedule_replicated.cu -- the scheduler for the smallest problems (decode; 512 tokens at EP4),
// bit for bit the result of moeI_schedule_cpu: every block counts all ranks' ids itself, so no
// block ever waits for another -- no grid barrier, no cluster, no scratch, nothing carried between
// calls.
//
// Why a third kernel.  The other two exchange counts between blocks (the grid kernel through L2
// and a grid barrier, the cluster kernel through distributed shared memory), and an exchange
// costs ~1.9 us of a call however it is done (PERF.md, "The floor under a call").  What a block
// needs from the others is c[e][q] -- routes from each source rank q to each local expert e --
// and the routes of its own source rank ahead of its share; both are counts of the ids, and where
// all ranks' ids are at most 64 KB (16,384 routes) a block counts them in about the time the
// exchange would take, and the call has no other wait in it.
//
// Blocks of 512 threads, one route a thread, in the order of j: block b takes source rank
// p = b / bpr and, of its routes, the b mod bpr-th run of 512 in that order -- "roundrobin": 512 / R
// logical threads (R = slots a logical thread, a power of two), thread t being slot t mod R of
// logical thread c0 + t / R, route (t mod R) 1024 + c0 + t / R; "peer_major": routes [s 512, s 512
// + 512).  Then:
//   1. load this thread's route; count all W T K ids (16-byte loads, kUnroll in flight a thread)
//      into c[q][e] in shared memory -- the routes of this block's own source rank ahead of its
//      share into a row of their own, c[W][e] -- and the invalid ids, with the first one's flat
//      index (a group of four is looked at only when its minimum or maximum is out of range);
//   2. rank: a warp groups its threads' equal local experts with log2(EL) ballots (a thread's rank
//      among the earlier lanes, and the warp's count of each expert in its own row); then the last
//      ceil(EL / 32) warps fold row W into row p and form n_e, and after a block-wide barrier the
//      last warp forms the segments (off, lim);
//   3. place: j = c[W][e] + the counts of earlier warps + the rank in the warp; roundrobin position
//      sum_q min(c[e][q], j) + #{q < p : c[e][q] > j}, peer_major sum_{q<p} c[e][q] + j; under the
//      kept count the route gets row off[e] + position (peer_rank and peer_route stored there),
//      past it route_row -1.  Padding rows of the experts e = b mod G and a share of the unused
//      rows [rows used, C) get -1 from block b; block 0 writes counts, tokens_per_expert,
//      expert_offsets and stats.
// Four block-wide barriers in all.  Every block reads all W T K ids, so the time grows with them:
// moeI_schedule_replicated_cuda takes the problem by default only where that measured faster than
// exchanging counts (PERF.md), and where the bitmap kernel, asked first, declines it (more than
// 128 experts a rank).  No atomics decide an order (shared atomics only count), and the host never
// waits.  Launched as a programmatic dependent, like the other two.
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "schedule.cuh"

#define STAGE "schedule"

namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kMaxSlots = 16;          // R: routes a logical thread (tk <= 16,384)
constexpr int kMaxExperts = 1024;      // EL
constexpr int kMaxCounters = 16384;    // (W + 1) (EL | 1): c[q][e] in shared memory
constexpr long long kMaxIds = 1 << 20; // W T K: every block reads them all (and f / tk in floats)
constexpr long long kAutoIds = 16384;  // by default up to this many (PERF.md)
constexpr int kUnroll = 8;             // 16-byte loads in flight a thread while counting

// Offsets (ints) of the shared arrays; the host sizes the launch with the same function.
struct Smem {
  int misc, c, raw, off, lim, cnt, total;
};
__host__ __device__ inline Smem smem_layout(int world, int el) {
  Smem L;
  const int cs = el | 1;            // odd row stride: a warp's counting atomics spread over the banks
  L.misc = 0;                       // [0] invalid ids, [1] first invalid, [4..6) rows needed (64-bit)
  L.c = 64;                         // c[q][e], [world + 1][cs]
  L.raw = L.c + (world + 1) * cs;   // n_e before expert_capacity
  L.off = L.raw + el;               // min(base[e], C), e = 0..el
  L.lim = L.off + el + 1;           // routes of e that get a row
  L.cnt = L.lim + el;               // [kWarps][cs]: per warp and expert, its threads' local routes
  L.total = L.cnt + kWarps * cs;
  return L;
}

struct Params : ScheduleCall {
  int trace;   // record the phases' times (MOE_SCHEDULE_TRACE set): a measuring aid
  int bpr;     // blocks a source rank
  int lgr;     // log2 R (roundrobin)
  int nc;      // logical threads a source rank that hold routes (roundrobin)
  int nbits;   // bits of an expert index: ceil(log2(el))
  int vec;     // ids 16-byte aligned and tk % 4 == 0: the count reads int4, each within one rank
  unsigned long long magic_tk; // ceil(2^40 / tk): f / tk = f magic_tk >> 40 for f < 2^20
  float inv_pad;
  Smem L;
};

// The last traced call, per block: clock64 at the phase points (entry, counted, ranked and
// segmented, placed, end), then %globaltimer at entry and end.  Read by moeI_schedule_replicated_trace
// (the scheduler's GPU test, --trace).
constexpr int kTraceBlocks = 1024, kTracePoints = 5;
__device__ long long trace_buf[kTraceBlocks][kTracePoints + 2];
int trace_grid;
__device__ __forceinline__ void trace_point(const Params &P, int i) {
  trace_record<false>(trace_buf, P.trace, i);
}

// One id v into the count: a local route adds one to row[e] (its source rank's row of c, or row W).
__device__ __forceinline__ void count_id(int v, int *row, unsigned lo, unsigned el) {
  const unsigned e = (unsigned)v - lo;
  if (e < el) atomicAdd(row + e, 1);
}
// Invalid ids (not -1, not in [0, E)) among n ids at flat index f: counted, with the first one's
// index.  Rare: the caller tests a group's minimum and maximum first.
__device__ __forceinline__ void count_invalid(const int *v, int n, int f, int experts, int &ninv, int &first) {
  for (int k = 0; k < n; k++)
    if (v[k] < -1 || v[k] >= experts) ninv++, first = min(first, f + k);
}

__global__ void __launch_bounds__(kThreads, 1) schedule_replicated_kernel(const Params P) {
  extern __shared__ int4 smem4[];
  int *sm = (int *)smem4;
  const Smem &L = P.L;
  int *misc = sm + L.misc, *c = sm + L.c, *raw = sm + L.raw, *off = sm + L.off, *lim = sm + L.lim, *cnt = sm + L.cnt;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, b = blockIdx.x, G = gridDim.x;
  const int el = P.el, tk = P.tk, W = P.world, cs = el | 1;
  const int p = b / P.bpr, s = b - p * P.bpr;

  asm volatile("griddepcontrol.wait;" ::: "memory");
  trace_point(P, 0);

  // 1. this thread's route, then every id counted
  int i, before; // the route; the share's first logical thread (roundrobin) or route (peer_major)
  bool has;
  if (P.roundrobin) {
    const int per = kThreads >> P.lgr, col = s * per + (t >> P.lgr);
    i = (t & ((1 << P.lgr) - 1)) * 1024 + col;
    has = col < P.nc && i < tk;
    before = s * per;
  } else {
    i = s * kThreads + t;
    has = i < tk;
    before = s * kThreads;
  }
  const int v = has ? __ldg(P.ids + (size_t)p * tk + i) : -1;
  // the first round of the count's loads in flight before the counters are cleared
  const int nall = W * tk, n4 = P.vec ? nall >> 2 : 0;
  const int4 *ids4 = (const int4 *)P.ids;
  int4 batch[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; u++) {
    const int x = t + u * kThreads;
    batch[u] = x < n4 ? __ldg(ids4 + x) : make_int4(-1, -1, -1, -1);
  }
  asm volatile("griddepcontrol.launch_dependents;");
  for (int x = t; x < (W + 1) * cs; x += kThreads) c[x] = 0;
  for (int x = t; x < kWarps * cs; x += kThreads) cnt[x] = 0;
  if (t == 0) misc[0] = 0, misc[1] = INT_MAX;
  __syncthreads();
  const unsigned lo = (unsigned)P.lo, uel = (unsigned)el;
  int ninv = 0, first = INT_MAX;
  // a route at flat index f is of this block's source rank and ahead of its share when d = f - p tk
  // has (unsigned)d < dlim and (d & dmask) < before
  const int ptk = p * tk, dlim = P.roundrobin ? tk : before, dmask = P.roundrobin ? 1023 : -1;
  if (P.vec) { // an int4 lies in one source rank, and (4 | before) on one side of the share's start
    for (int x0 = t; x0 < n4; x0 += kThreads * kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int f = 4 * (x0 + u * kThreads), q = (int)(((unsigned long long)f * P.magic_tk) >> 40), d = f - ptk;
        const bool ahead = (unsigned)d < (unsigned)dlim && (d & dmask) < before;
        int *row = c + (ahead ? W : q) * cs;
        const int4 z = batch[u];
        count_id(z.x, row, lo, uel);
        count_id(z.y, row, lo, uel);
        count_id(z.z, row, lo, uel);
        count_id(z.w, row, lo, uel);
        if (__vimin3_s32(z.x, z.y, min(z.z, z.w)) < -1 || __vimax3_s32(z.x, z.y, max(z.z, z.w)) >= P.experts) {
          const int zz[4] = {z.x, z.y, z.z, z.w};
          count_invalid(zz, 4, f, P.experts, ninv, first);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; u++) { // the next round
        const int x = x0 + (kUnroll + u) * kThreads;
        batch[u] = x < n4 ? __ldg(ids4 + x) : make_int4(-1, -1, -1, -1);
      }
    }
  } else {
    for (int f0 = t; f0 < nall; f0 += kThreads * kUnroll) {
      int z[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; u++) z[u] = f0 + u * kThreads < nall ? __ldg(P.ids + f0 + u * kThreads) : -1;
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int f = f0 + u * kThreads, q = (int)(((unsigned long long)f * P.magic_tk) >> 40), d = f - ptk;
        const bool ahead = (unsigned)d < (unsigned)dlim && (d & dmask) < before;
        count_id(z[u], c + (ahead ? W : q) * cs, lo, uel);
        if (z[u] < -1 || z[u] >= P.experts) count_invalid(z + u, 1, f, P.experts, ninv, first);
      }
    }
  }
  const unsigned e = (unsigned)v - lo;
  const bool loc = has && e < uel;
  if (has && !loc) P.route_row[(size_t)p * tk + i] = -1; // another rank's, masked or invalid
  if (b == 0 && __any_sync(MOE_FULL_MASK, ninv)) {
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      ninv += __shfl_xor_sync(MOE_FULL_MASK, ninv, o);
      first = min(first, __shfl_xor_sync(MOE_FULL_MASK, first, o));
    }
    if (lane == 0) atomicAdd(&misc[0], ninv), atomicMin(&misc[1], first);
  }
  __syncthreads();
  trace_point(P, 1);

  // 2. rank within the warp; then the last ng warps fold row W into row p and form n_e, and after
  // a block-wide barrier the last warp forms the segments
  const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
  int rank = 0;
  if (act) {
    const unsigned peers = match_peers(loc ? e : 0u, act, P.nbits);
    rank = __popc(peers & lanemask_lt());
    if (loc && rank == 0) cnt[warp * cs + e] = __popc(peers);
  }
  const int ng = min(kWarps, (el + 31) >> 5), gw = warp - (kWarps - ng);
  if (gw >= 0) {
    int x0, x1;
    segment_run(el, gw, ng, &x0, &x1);
    for (int x = x0; x < x1; x++) { // n_e over rows 0 .. W, four sums at a time
      int r0 = 0, r1 = 0, r2 = 0, r3 = 0, q = 0;
      for (; q + 3 <= W; q += 4)
        r0 += c[q * cs + x], r1 += c[(q + 1) * cs + x], r2 += c[(q + 2) * cs + x], r3 += c[(q + 3) * cs + x];
      for (; q <= W; q++) r0 += c[q * cs + x];
      raw[x] = r0 + r1 + r2 + r3;
      c[p * cs + x] += c[W * cs + x];
    }
  }
  __syncthreads();
  if (warp == kWarps - 1) {
    const Segments seg = group_segments(raw, el, P.pad, P.inv_pad, P.expert_capacity, P.capacity, off, lim);
    if (lane == 0) *(long long *)(misc + 4) = seg.need;
  }
  __syncthreads();
  trace_point(P, 2);

  // 3. place
  if (loc) {
    int j = c[W * cs + e] + rank;
    for (int w = 0; w < warp; w++) j += cnt[w * cs + e];
    int pos;
    if (P.roundrobin) {
      pos = roundrobin_position<false>(c + e, W, p, j, (size_t)cs);
    } else {
      pos = j;
      for (int q = 0; q < p; q++) pos += c[q * cs + e];
    }
    int row = -1;
    if (pos < lim[e]) {
      row = off[e] + pos;
      P.peer_rank[row] = p;
      P.peer_route[row] = i;
    }
    P.route_row[(size_t)p * tk + i] = row;
  }
  const int used = off[el];
  for (int x = b; x < el; x += G) // padding rows of the experts x = b mod G
    for (int row = off[x] + lim[x] + t; row < off[x + 1]; row += kThreads) P.peer_rank[row] = P.peer_route[row] = -1;
  { // this block's share of the unused rows
    const int share = (P.capacity - used + G - 1) / G;
    const int lo_row = used + b * share, hi_row = min(P.capacity, lo_row + share);
    fill_unused(P.peer_rank, lo_row, hi_row, t, kThreads);
    fill_unused(P.peer_route, lo_row, hi_row, t, kThreads);
  }
  trace_point(P, 3);
  if (b == 0) {
    for (int x = t; x <= el; x += kThreads) {
      P.offsets[x] = off[x];
      if (x < el) P.counts[x] = lim[x], P.tpe[x] = off[x + 1] - off[x];
    }
    if (warp == 0) { // the stats; dropped = sum_e n_e - kept by the warp alone
      int dropped = 0;
      for (int x = lane; x < el; x += 32) dropped += raw[x] - lim[x];
#pragma unroll
      for (int o = 16; o; o >>= 1) dropped += __shfl_xor_sync(MOE_FULL_MASK, dropped, o);
      if (lane == 0) {
        const long long need = *(const long long *)(misc + 4);
        const int inv = misc[0];
        P.stats[MOE_STAT_ROWS_NEEDED] = (int)(need < INT_MAX ? need : INT_MAX);
        P.stats[MOE_STAT_ROWS_USED] = used;
        P.stats[MOE_STAT_DROPPED] = dropped;
        P.stats[MOE_STAT_INVALID] = inv;
        P.stats[MOE_STAT_FIRST_INVALID] = inv ? misc[1] : -1;
      }
    }
  }
  trace_point(P, 4);
}

// ---- host ----

constexpr int kDevices = 64;
std::atomic<int> sm_optin[kDevices]; // opt-in shared memory per block, bytes + 1
std::atomic<bool> raised[kDevices];  // the kernel's dynamic shared memory limit raised

} // namespace

// Runs the schedule with every block counting all ids when the problem is small enough (and the
// choice, automatic or MOE_SCHEDULE_KERNEL, is this kernel): *ran = 1 and the call's status.
// Otherwise *ran = 0 and MOE_OK, and another kernel takes the call; with
// MOE_SCHEDULE_KERNEL=replicated that is an error.
extern "C" int moeI_schedule_replicated_cuda(moe_ctx *ctx, const moe_schedule_args *a, int *ran) {
  *ran = 0;
  const char *sel = getenv("MOE_SCHEDULE_KERNEL");
  const bool forced = sel && !strcmp(sel, "replicated");
  if (sel && !forced) return MOE_OK; // moeI_schedule_cluster_cuda checks the name
  const int device = a->ids->device.index;
  const long long W = a->ids->shape[0], tk = a->ids->shape[1] * a->ids->shape[2];
  const long long el = a->experts / W;
  const char *why = NULL;
  if (tk == 0) why = "a rank without routes";
  else if (tk > 1024LL * kMaxSlots) why = "more than 16,384 routes a rank";
  else if (W * tk > kMaxIds) why = "more than 2^20 routes in all";
  else if (el > kMaxExperts) why = "more than 1,024 experts a rank";
  else if ((W + 1) * (el | 1) > kMaxCounters) why = "more than 16,384 (source rank, expert) counters";
  else if (a->capacity > INT_MAX - 65536) why = "a capacity within 2^16 of 2^31"; // 32-bit rows
  if (why) {
    if (forced)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                        STAGE ": MOE_SCHEDULE_KERNEL=replicated, but the replicated kernel does not take %s", why);
    return MOE_OK;
  }
  if (!forced && W * tk > kAutoIds) return MOE_OK;

  Params P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  static const int trace = getenv("MOE_SCHEDULE_TRACE") != NULL;
  P.trace = trace;
  while ((1024 << P.lgr) < P.tk) P.lgr++;
  P.nc = P.tk < 1024 ? P.tk : 1024;
  P.bpr = P.roundrobin ? cdiv(P.nc, kThreads >> P.lgr) : cdiv(P.tk, kThreads);
  P.nbits = 0;
  while ((1 << P.nbits) < P.el) P.nbits++;
  P.vec = ((uintptr_t)P.ids & 15) == 0 && P.tk % 4 == 0;
  P.magic_tk = ((1ULL << 40) + (unsigned long long)P.tk - 1) / (unsigned long long)P.tk;
  P.inv_pad = 1.0f / (float)P.pad;
  P.L = smem_layout(P.world, P.el);
  const size_t smem = sizeof(int) * (size_t)P.L.total;
  const int g = P.world * P.bpr;

  cudaStream_t st;
  int rc = moeI_cuda_ctx_stream(ctx, device, &st);
  if (rc) return rc;
  const bool cached = device >= 0 && device < kDevices;
  int optin = cached ? sm_optin[device].load(std::memory_order_relaxed) - 1 : -1;
  if (optin < 0) {
    MOE_CUDA_TRY(ctx, STAGE, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (cached) sm_optin[device].store(optin + 1, std::memory_order_relaxed);
  }
  if (smem > (size_t)optin) {
    if (forced)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                        STAGE ": MOE_SCHEDULE_KERNEL=replicated, but %zu bytes of shared memory do not fit a block", smem);
    return MOE_OK;
  }
  if (!(cached && raised[device].load())) {
    MOE_CUDA_TRY(ctx, STAGE,
                 cudaFuncSetAttribute(schedule_replicated_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    if (cached) raised[device].store(true);
  }
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[2], none = {};
  none.id = cudaLaunchAttributeIgnore;
  schedule_launch_config(&cfg, attr, (unsigned)g, kThreads, smem, st, none);
  *ran = 1;
  trace_grid = g;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, schedule_replicated_kernel, P);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, STAGE ": cudaLaunchKernelEx(schedule_replicated_kernel) failed at %s:%d: %s: %s",
                      __FILE__, __LINE__, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  return moeI_ok(ctx);
}

// The phase times of the last replicated call made with MOE_SCHEDULE_TRACE set: trace_buf's rows
// (copy_trace).
extern "C" int moeI_schedule_replicated_trace(long long *out, int max_blocks) {
  return copy_trace(out, trace_buf, trace_grid, max_blocks);
}
