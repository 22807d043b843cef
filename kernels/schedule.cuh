// schedule.cuh -- device helpers shared by the scheduler's kernels (schedule.cu, schedule_cluster.cu)
// and their predecessor kept as a baseline (schedule_legacy.cu): warp ranking, block-wide scans and
// reductions, and the segment arithmetic of DESIGN.md section 2 that all must compute alike.
#pragma once

#include <stdint.h>

#include "common.cuh"

#define MOE_FULL_MASK 0xffffffffu

// The scheduler's part of the scratch header (internal.h, MOE_SCRATCH_HEADER) that the grid
// kernels share: the barrier word at its start, then two buffers of c[e][q] totals (ints), one
// per call parity.  Every call of either grid kernel adds into its parity's buffer and zeroes the
// other one whole, so the two can follow each other in any order.
#define MOE_SCHED_TOT_OFFSET 64
#define MOE_SCHED_TOT_STRIDE 4096

// What every scheduler kernel takes from a call (each kernel's parameters extend it): the tensors,
// the sizes, this rank's first expert lo, and the options.
struct ScheduleCall {
  const int32_t *ids;
  int32_t *peer_rank, *peer_route, *counts, *tpe, *offsets, *route_row, *stats;
  int tk, world, experts, el, lo, pad, capacity, expert_capacity, roundrobin;
};
static inline ScheduleCall schedule_call(const moe_schedule_args *a) {
  ScheduleCall c;
  c.ids = (const int32_t *)a->ids->data;
  c.peer_rank = (int32_t *)a->peer_rank->data;
  c.peer_route = (int32_t *)a->peer_route->data;
  c.counts = (int32_t *)a->counts->data;
  c.tpe = (int32_t *)a->tokens_per_expert->data;
  c.offsets = (int32_t *)a->expert_offsets->data;
  c.route_row = (int32_t *)a->route_row->data;
  c.stats = (int32_t *)a->stats->data;
  c.tk = (int)(a->ids->shape[1] * a->ids->shape[2]);
  c.world = (int)a->ids->shape[0];
  c.experts = a->experts;
  c.el = a->experts / c.world;
  c.lo = a->rank * c.el;
  c.pad = a->pad;
  c.capacity = a->capacity;
  c.expert_capacity = a->expert_capacity;
  c.roundrobin = a->layout == MOE_LAYOUT_ROUNDROBIN;
  return c;
}

// The launch of a scheduler kernel: `grid` blocks of `threads` on st, as a programmatic dependent
// of the kernel before it (the kernels wait for it with griddepcontrol.wait, so the launch latency
// overlaps its tail), with one more attribute, `first` (cooperative, or the cluster's shape).
// cfg points into attr.
static inline void schedule_launch_config(cudaLaunchConfig_t *cfg, cudaLaunchAttribute attr[2], unsigned grid,
                                          unsigned threads, size_t smem, cudaStream_t st, cudaLaunchAttribute first) {
  *cfg = {};
  cfg->gridDim = dim3(grid);
  cfg->blockDim = dim3(threads);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = st;
  attr[0] = first;
  attr[1] = {};
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 2;
}

// The ranking of both kernels (schedule.cu, schedule_cluster.cu): the lanes below this one, and the
// lanes whose key equals this lane's among the lanes in act, keys < 2^nbits, by log2(keys) ballots
// (cheaper than __match_any_sync on sm_90: PERF.md).
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
__device__ __forceinline__ unsigned match_peers(unsigned key, unsigned act, int nbits) {
  unsigned peers = act;
  for (int b = 0; b < nbits; b++) {
    const bool one = (key >> b) & 1u;
    const unsigned set = __ballot_sync(MOE_FULL_MASK, one);
    peers &= one ? set : ~set;
  }
  return peers;
}

// Block-wide collectives: every thread of the block calls them (blockDim.x a multiple of 32);
// sh is __shared__ room for 32 values, reusable right after the call returns.
template <typename T> __device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T t = __shfl_up_sync(MOE_FULL_MASK, v, o);
    if (lane >= o) v += t;
  }
  return v;
}

// Exclusive prefix of v over the threads in order; *total gets the sum over the block.
template <typename T> __device__ T block_exclusive_scan(T v, T *total, T *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const T inc = warp_inclusive_scan(v);
  __syncthreads(); // sh may still be read by a previous call
  if (lane == 31) sh[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const T s = warp_inclusive_scan(lane < nwarps ? sh[lane] : T(0));
    sh[lane] = s;
  }
  __syncthreads();
  *total = sh[nwarps - 1];
  return (warp ? sh[warp - 1] : T(0)) + inc - v;
}

template <typename T> __device__ T block_sum(T v, T *sh) {
  T total;
  block_exclusive_scan(v, &total, sh);
  return total;
}

__device__ __forceinline__ int block_min(int v, int *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) v = min(v, __shfl_xor_sync(MOE_FULL_MASK, v, o));
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  int m = sh[0];
  for (int w = 1; w < nwarps; w++) m = min(m, sh[w]);
  return m;
}

// An expert's segment (DESIGN.md 2): n_e = sum_p c[e][p], capped by expert_capacity when that is
// set (>= 0); its padded size is roundup(n_e, pad), 0 when empty.
__device__ __forceinline__ int segment_routes(int raw, int expert_capacity) {
  return expert_capacity >= 0 && raw > expert_capacity ? expert_capacity : raw;
}
__device__ __forceinline__ long long segment_padded(int n, int pad) { // a 32-bit division: (n - 1) / pad + 1 tiles
  return n > 0 ? ((long long)((unsigned)(n - 1) / (unsigned)pad) + 1) * pad : 0;
}
// Routes of a segment starting at base that get a row under capacity C: rows >= C are never used.
__device__ __forceinline__ int segment_kept(int n, long long base, int capacity) {
  const long long room = (long long)capacity - base;
  return room <= 0 ? 0 : (int)(room < n ? room : n);
}

// Roundrobin position inside expert e's segment of the route with ordinal j from source rank p:
// sum_q min(c[e][q], j) + #{q < p : c[e][q] > j}, with c[e][q] = c[q * stride] in shared memory,
// or in global memory written by an earlier kernel or another block (read through L2: kGlobal).
template <bool kGlobal>
__device__ __forceinline__ int roundrobin_position(const int32_t *c, int world, int p, int j, size_t stride = 1) {
  int pos = 0;
  for (int q = 0; q < world; q++) {
    const int cq = kGlobal ? __ldcg(c + q * stride) : c[q * stride];
    pos += min(cq, j) + (q < p && cq > j);
  }
  return pos;
}

// The same over c[e][0..world) in shared memory as int4 (world a multiple of 4, 16-byte aligned).
__device__ __forceinline__ int roundrobin_position4(const int4 *c4, int world4, int p, int j) {
  int pos = 0;
  for (int q4 = 0; q4 < world4; q4++) {
    const int4 c = c4[q4];
    const int q = 4 * q4;
    pos += min(c.x, j) + (q < p && c.x > j);
    pos += min(c.y, j) + (q + 1 < p && c.y > j);
    pos += min(c.z, j) + (q + 2 < p && c.z > j);
    pos += min(c.w, j) + (q + 3 < p && c.w > j);
  }
  return pos;
}

// Route i of peer p at position pos of its expert's rows [off, off + lim): its row, whose
// peer_rank and peer_route it writes, or -1 past lim (dropped: over the capacity).  The bitmap
// and legacy kernels' place step; the replicated kernel keeps its own lines, as through this
// helper the compiler reloads a parameter in its place loop (PTX compared).
__device__ __forceinline__ int place_route(const ScheduleCall &P, int p, int i, int pos, int off, int lim) {
  if (pos >= lim) return -1;
  const int row = off + pos;
  P.peer_rank[row] = p;
  P.peer_route[row] = i;
  return row;
}

// Thread 0 of block b records phase point i in row b of a kernel's trace buffer (rows of POINTS
// clock64 readings, then %globaltimer at the first and the last point), when tracing is on.
// FITS: the launcher never makes more blocks than the buffer has rows, so no block checks (the
// bitmap and one-cluster kernels, whose code size is their time: PERF.md).
template <bool FITS, int ROWS, int COLS>
__device__ __forceinline__ void trace_record(long long (&buf)[ROWS][COLS], int on, int i) {
  constexpr int POINTS = COLS - 2;
  if (!on || threadIdx.x || (!FITS && blockIdx.x >= ROWS)) return;
  buf[blockIdx.x][i] = clock64();
  if (i == 0 || i == POINTS - 1) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    buf[blockIdx.x][POINTS + (i != 0)] = t;
  }
}

// Host: the least power of two >= x, and the log2 of a power of two.
static inline long long pow2_ceil(long long x) {
  long long p = 1;
  while (p < x) p <<= 1;
  return p;
}
static inline int log2_exact(long long x) {
  int l = 0;
  while ((1LL << l) < x) l++;
  return l;
}

// The last traced call's rows of a kernel's trace buffer (each kernel's own __device__ array of
// [blocks][phase points + 2 timers], MOE_SCHEDULE_TRACE set) for the scheduler's GPU test
// (--trace): copies min(grid, max_blocks, the buffer's rows) rows and returns their number, or -1.
template <typename Rows> static inline int copy_trace(long long *out, const Rows &buf, int grid, int max_blocks) {
  const int rows = (int)(sizeof(Rows) / sizeof(buf[0]));
  int n = grid < max_blocks ? grid : max_blocks;
  if (n > rows) n = rows;
  if (cudaDeviceSynchronize() != cudaSuccess) return -1;
  if (cudaMemcpyFromSymbol(out, buf, sizeof(buf[0]) * (size_t)n) != cudaSuccess) return -1;
  return n;
}

// ---- the small-problem kernels' helpers (schedule_cluster.cu, schedule_replicated.cu) ----

// n / d for 0 <= n < 2^24 and d >= 1, from inv = 1.0f / d: the float quotient, corrected by one.
__device__ __forceinline__ int div_by(int n, int d, float inv) {
  int q = __float2int_rz((float)n * inv);
  q -= q * d > n;
  q += (q + 1) * d <= n;
  return q;
}

// segment_padded for n < 2^24 with 1 / pad precomputed: roundup(n, pad), 0 when empty.
__device__ __forceinline__ long long padded_size(int n, int pad, float inv_pad) {
  if (n <= 0) return 0;
  long long q = __float2int_rz((float)(n - 1) * inv_pad); // (n - 1) / pad, give or take one
  q -= q * pad > n - 1;
  q += (q + 1) * pad <= n - 1;
  return (q + 1) * pad;
}

// -1 into a[lo, hi) by threads `th` of `nth`: 16-byte stores where aligned.
__device__ inline void fill_unused(int32_t *a, int lo, int hi, int th, int nth) {
  if (lo >= hi) return;
  int head = (int)((16 - ((uintptr_t)(a + lo) & 15)) & 15) / 4;
  if (head > hi - lo) head = hi - lo;
  if (th < head) a[lo + th] = -1;
  const int b0 = lo + head, n4 = (hi - b0) / 4;
  int4 *a4 = (int4 *)(a + b0);
  for (int x = th; x < n4; x += nth) a4[x] = make_int4(-1, -1, -1, -1);
  const int tail = b0 + 4 * n4;
  if (th < hi - tail) a[tail + th] = -1;
}

// The segments of el experts by one warp (every lane calls it): from raw[e] (n_e before
// expert_capacity), off[e] = min(base[e], C), lim[e] = routes of e that get a row, off[el] = rows
// used.  Lane l takes the run of experts segment_run(el, 0, 1) gives it.  What every lane gets
// back: the rows needed (before the clamp), and the local and kept routes of all el experts.
// (A version split over a group of warps met at a named barrier; compute-sanitizer's racecheck
// reported hazards across the block-wide barrier that followed it, PERF.md.)
struct Segments {
  long long need;
  int local, placed;
};
// Lane l of warp gw in a group of ng takes experts [e0, e1): a run of ceil(el / (32 ng)).
__device__ __forceinline__ void segment_run(int el, int gw, int ng, int *e0, int *e1) {
  const int per = (el + 32 * ng - 1) / (32 * ng);
  *e0 = min(el, (gw * 32 + (int)(threadIdx.x & 31)) * per);
  *e1 = min(el, *e0 + per);
}
__device__ inline Segments group_segments(const int *raw, int el, int pad, float inv_pad, int expert_capacity,
                                          int capacity, int *off, int *lim) {
  const int lane = threadIdx.x & 31;
  int e0, e1;
  segment_run(el, 0, 1, &e0, &e1);
  long long sum = 0;
#pragma unroll 1 // code size: each launch runs this once (PERF.md, instruction-cache misses)
  for (int e = e0; e < e1; e++) sum += padded_size(segment_routes(raw[e], expert_capacity), pad, inv_pad);
  const long long incl = warp_inclusive_scan(sum);
  long long base = incl - sum;
  const long long all = __shfl_sync(MOE_FULL_MASK, incl, 31);
  Segments S = {all, 0, 0};
#pragma unroll 1
  for (int e = e0; e < e1; e++) {
    const int ne = segment_routes(raw[e], expert_capacity), kept = segment_kept(ne, base, capacity);
    lim[e] = kept;
    off[e] = (int)(base < capacity ? base : capacity);
    base += padded_size(ne, pad, inv_pad);
    S.local += raw[e], S.placed += kept;
  }
  if (lane == 0) off[el] = (int)(all < capacity ? all : capacity);
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    S.local += __shfl_xor_sync(MOE_FULL_MASK, S.local, o);
    S.placed += __shfl_xor_sync(MOE_FULL_MASK, S.placed, o);
  }
  return S;
}

// A warp ranks its run of a list of routes, list[wbase, wbase + 32 S) cut at n, in order: ord[idx]
// = how many earlier entries of the run share the entry's key, and crow[key] (the warp's own row,
// zero at the start) ends as the run's count of each key.  key_of(list entry) < 2^nbits.
template <typename KeyOf>
__device__ __forceinline__ void warp_rank_run(const int *list, int n, int wbase, int S, int nbits, int *crow, int *ord,
                                              KeyOf key_of) {
  const int lane = threadIdx.x & 31;
  for (int s = 0; s < S; s++) {
    const int idx = wbase + s * 32 + lane;
    const bool ok = idx < n;
    const unsigned act = __ballot_sync(MOE_FULL_MASK, ok);
    if (!act) break;
    const int key = ok ? key_of(list[idx]) : 0;
    const unsigned peers = match_peers((unsigned)key, act, nbits);
    const int before = ok ? crow[key] : 0, rank = __popc(peers & lanemask_lt());
    __syncwarp();
    if (ok && rank == 0) crow[key] = before + __popc(peers);
    if (ok) ord[idx] = before + rank;
    __syncwarp();
  }
}
