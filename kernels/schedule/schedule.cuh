/* SPDX-License-Identifier: MIT */
// schedule.cuh -- device helpers shared by the scheduler's kernels (bitmap.cu, grid.cu) and by the
// legacy baseline of bench/schedule_legacy.cu: warp ranking, block-wide scans and reductions, and
// the segment arithmetic of docs/design.md ("The stages", 2) that all must compute alike, so that
// each is bit for bit the CPU reference.
#pragma once

#include <stdint.h>

#include "../common.cuh"
#include "../select.cuh"
#include "../sm90/ptx.cuh"

#define MOE_FULL_MASK 0xffffffffu

// The scheduler's part of the scratch header (internal.h, MOE_SCRATCH_HEADER) that both kernels
// share: the barrier word at its start, then two buffers of c[e][q] totals (ints), one per call
// parity.  Every call of either kernel adds into its parity's buffer and zeroes the other one
// whole, so the two can follow each other in any order.
#define MOE_SCHED_TOT_OFFSET 64
#define MOE_SCHED_TOT_STRIDE 4096
static_assert(MOE_SCRATCH_HEADER >= (int)sizeof(int32_t) * (MOE_SCHED_TOT_OFFSET + 2 * MOE_SCHED_TOT_STRIDE),
              "scratch header too small for the barrier and the totals");

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
// overlaps its tail), with one more attribute, `first` (cooperative).
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

// The grid kernel's ranking: the lanes below this one, and the lanes whose key equals this lane's
// among the lanes in act, keys < 2^nbits, by log2(keys) ballots (cheaper than __match_any_sync on
// sm_90: docs/perf/schedule.md).
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

// An expert's segment (docs/design.md, stage 2): n_e = sum_p c[e][p], capped by expert_capacity when that is
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
// peer_rank and peer_route it writes, or -1 past lim (dropped: over the capacity).  The place step
// of the bitmap kernel and of the legacy baseline.
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
// bitmap kernel, whose code size is its time: docs/perf/schedule.md).
template <bool FITS, int ROWS, int COLS>
__device__ __forceinline__ void trace_record(long long (&buf)[ROWS][COLS], int on, int i) {
  constexpr int POINTS = COLS - 2;
  if (!on || threadIdx.x || (!FITS && blockIdx.x >= ROWS)) return;
  buf[blockIdx.x][i] = clock64();
  if (i == 0 || i == POINTS - 1) {
    buf[blockIdx.x][POINTS + (i != 0)] = (long long)global_ns();
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
// [blocks][phase points + 2 timers], written while the context's trace switch is on:
// moeI_schedule_set_trace) for bench/schedule_trace.c: copies min(grid, max_blocks,
// the buffer's rows) rows and returns their number, or -1.
template <typename Rows> static inline int copy_trace(long long *out, const Rows &buf, int grid, int max_blocks) {
  const int rows = (int)(sizeof(Rows) / sizeof(buf[0]));
  int n = grid < max_blocks ? grid : max_blocks;
  if (n > rows) n = rows;
  if (cudaDeviceSynchronize() != cudaSuccess) return -1;
  if (cudaMemcpyFromSymbol(out, buf, sizeof(buf[0]) * (size_t)n) != cudaSuccess) return -1;
  return n;
}

// ---- the bitmap kernel's helpers ----

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

// ---- the kernels as candidates of the stage's table (select.cu, select.cuh) ----
// fits: whether the kernel can take the problem, and why not; run: the launch, nothing decided.
// run may assume that fits said TAKES or that the caller forced the kernel past a DECLINES.
int moeI_schedule_bitmap_fits(moe_ctx *ctx, const moe_schedule_args *a, Fit *fit, char *why, size_t n);
int moeI_schedule_bitmap_run(moe_ctx *ctx, const moe_schedule_args *a);
int moeI_schedule_grid_fits(moe_ctx *ctx, const moe_schedule_args *a, Fit *fit, char *why, size_t n);
int moeI_schedule_grid_run(moe_ctx *ctx, const moe_schedule_args *a);
