/* SPDX-License-Identifier: MIT */
// grid.cu -- stage 2 on the GPU: every rank's ids i32 [W, T, K] -> this rank's expert-major
// row layout, bit for bit the result of moeI_schedule_cpu (lib/schedule.c) for both layouts.
//
// The problem.  A route's row depends on its ordinal j inside its (local expert e, source rank p)
// group, which counts earlier routes in an order the layout fixes ("roundrobin": logical thread
// th = i mod 1024 first, then i; "peer_major": i), and on the totals c[e][q] of every source rank.
// The routes of one source rank are read as a grid: route i = m * stride + c, "column" c and
// "row" m, where roundrobin has 1024 columns (the logical threads) and stride 1024, peer_major a
// single column.  In both, the order of j is column-major (column by column, rows ascending).  A
// chunk is a run of that order -- a power-of-two group of columns for roundrobin, a run of rows
// for peer_major -- and each source rank is cut into S chunks: W * S units, about one per SM.
//
// The stage's table (select.cu) tries the bitmap kernel first (bitmap.cu: up to 4,096 routes a
// block and 128 experts a rank, which covers decode, 512 tokens and Kimi K2's shape).  This kernel
// takes everything else: one cooperative kernel, one block per unit, in two phases around a grid
// barrier:
//
//   1. The block loads its chunk into shared memory in column-major order (rows padded to an odd
//      length, so the transposing store and the ordered reads are free of bank conflicts),
//      counting invalid ids on the way, and ranks it: each warp takes a contiguous run of the
//      order, lists the slots of its routes to this rank's experts (in order; the others need no
//      rank), then 32 of those a step groups equal experts with log2(EL) ballots and keeps a
//      running count per expert in its own shared-memory row; an exclusive scan over the warps'
//      rows orders the warps, and its last row is the chunk's histogram, written to scratch and
//      added (atomically: a sum does not depend on the order) into the totals c[e][p].  No
//      atomics decide any order.
//   2. After the barrier every block reads what it needs -- the totals c[e][q] (EL * W values),
//      the histograms of the chunks before its own -- and forms the rest itself, so nothing is
//      serialised through one block: n_e, padded sizes and base by a block scan, the routes kept
//      under capacity.  Then j = prefix + earlier warps + rank in
//      the warp; roundrobin's position is sum_q min(c[e][q], j) + #{q < p : c[e][q] > j},
//      peer_major's sum_{q<p} c[e][q] + j; a route whose position is under the kept count goes to
//      row offset + position (peer_rank, peer_route written there), and route_row is written for
//      the whole chunk in memory order (coalesced; -1 for routes elsewhere, masked, invalid or
//      dropped).  Each block writes -1 into the padding rows of the experts it owns (e mod the
//      grid) and, striding with all blocks, into the unused rows [rows used, C); block 0 writes
//      counts, tokens_per_expert, expert_offsets and stats.
//
// So every output element is written exactly once, rows >= C never, nothing is cleared first, the
// host never waits, and a call is one launch.  Kimi K2 rank of EP8 (W 8, T 7168, K 8, E 384):
// 128 blocks of 3,584 routes (64 logical threads x 56); ids read once (1.8 MB), route_row written
// once (1.8 MB), peer_rank and peer_route once each (C rows), scratch ~30 KB.  So the time is
// latency, not bandwidth: docs/perf/schedule.md has it per phase, as measured by
// bench/schedule_trace.c (moeI_schedule_set_trace), and the histogram reads, the scattered
// peer_rank/peer_route stores and the cooperative launch are where it goes.
//
// Where a block cannot keep its unit in shared memory across the barrier -- more units than
// blocks that fit on the GPU at once (W in the hundreds), a chunk larger than the tile (placed in
// pieces, a running count per expert carried in scratch), more local experts than a ranking
// window (1,024, fewer when W is large) -- phase 1 only counts (a shared-memory histogram per
// window of experts) and phase 2 loads and ranks again.  That costs time, never correctness.
//
// Scratch (barrier, totals, per-block invalid counts, histograms) is the context's
// (moeI_cuda_scratch_get): kept across calls, so a call allocates nothing; inside a graph capture
// without a large enough block it is a stream-ordered allocation that becomes the graph's own.
// The barrier's arrival count flips its bit 31 in every call and keeps its low bits at zero, so
// that the next call (or a replay) finds it ready without a reset.  The totals alternate
// between two buffers by that bit, the call's parity: a call adds into its own (zero when it
// starts) and zeroes the other, the next call's, after the barrier.
//
// The launch is cooperative (the barrier needs every block resident) and a programmatic
// dependent of the kernel before it (griddepcontrol.wait first of all), so that its launch
// overlaps the end of that kernel.
#include <limits.h>
#include <stdint.h>

#include <atomic>

#include "grid_barrier.cuh"
#include "schedule.cuh"

#define STAGE "schedule"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;                // loads in flight per thread
constexpr int kTile = 8192;               // routes of one piece in shared memory (even)
constexpr int kRankWindow = 1024;         // local experts ranked in one pass
constexpr int kHistWindow = 6144;         // local experts counted in one pass (non-resident phase 1); with
                                          // kTile and kRankWindow the largest layout is 57,468 ints (of 58,112)
constexpr int kStageC = MOE_SCHED_TOT_STRIDE; // c[e][q] values of a window staged in shared memory
constexpr int kMaxScratchHist = 1 << 18;  // S * E bound: every block reads S * E histogram values
constexpr int kParitySlot = 96;       // shared int holding the call's parity, after the reductions'
constexpr int kRed = kParitySlot + 4; // shared ints: block reductions (32 long long, 32 int), the parity
// c[e][q] totals in the scratch header, two buffers of kStageC (see the kernel's phase 1)
constexpr int kTotOffset = MOE_SCHED_TOT_OFFSET; // ints: after the barrier
static_assert(MOE_SCRATCH_HEADER >= (int)sizeof(int32_t) * (kTotOffset + 2 * kStageC), "scratch header too small");

struct Params : ScheduleCall {
  int trace; // record the phases' times (moeI_schedule_set_trace): a measuring aid
  unsigned *bar;             // scratch: the grid barrier's arrival count (bit 31: the call's parity)
  int32_t *tot;              // scratch: c[e][q] totals [2][kStageC], by the call's parity
  int32_t *inv, *hist, *acc; // scratch: [G][2], [units][EL], [units][EL] (only with pieces)
  // route i = m * stride + c; nc columns, nr rows
  int nc, nr, stride;
  // chunk s covers 2^lgcw columns from s * cstep and rw rows from s * rstep
  int chunks, lgcw, rw, cstep, rstep;
  // pieces of a chunk: 2^lgpw columns of pr rows; slot (column, row) -> column * prp + row
  int lgpw, pr, prp, ncp, nrp;
  unsigned long long magic; // ceil(2^32 / prp): slot / prp without a division
  int units;                // W * S
  int rwin, hwin, stage_c;  // ranking window, counting window, c staged in shared memory
};

// Offsets (in ints) of the shared-memory arrays; the host sizes the launch with the same function.
struct Smem {
  int tile, srow, cl, cnt, run, lim, raw, cpre, off, cst, hist, total;
};
__host__ __device__ inline Smem smem_layout(int ts, int rwin, int world, int stage_c, int hwin) {
  Smem L;
  L.tile = kRed;
  L.srow = L.tile + ts;
  L.cl = L.srow + ts;                        // per warp's run: the slots of its window's routes, in order
  L.cnt = L.cl + ts;                         // [kWarps + 1][wsz | 1]: per-warp counts -> offsets; totals
  L.run = L.cnt + (kWarps + 1) * (rwin | 1); // j of the first route of the piece, per expert
  L.lim = L.run + rwin;                // routes kept
  L.raw = L.lim + rwin;                // n_e before expert_capacity
  L.cpre = L.raw + rwin;               // peer_major: sum_{q<p} c[e][q]
  L.off = L.cpre + rwin;               // min(base, C), one past the window too
  L.cst = (L.off + rwin + 1 + 3) & ~3; // c[e][q] of the window, 16-byte aligned rows when W % 4 == 0
  L.hist = L.cst + (stage_c ? rwin * world : 0);
  L.total = L.hist + hwin + 4; // slack: compute-sanitizer saw the compiler read c[] in 12-byte pieces
  return L;
}

__device__ __forceinline__ int window_bits(int wsz) { return wsz > 1 ? 32 - __clz(wsz - 1) : 0; }

// The last traced call, per block: clock64 at the phase points, then %globaltimer at entry and
// at the end.  Read by moeI_schedule_grid_trace (bench/schedule_trace.c).
constexpr int kTraceBlocks = 1024, kTracePoints = 8;
__device__ long long trace_buf[kTraceBlocks][kTracePoints + 2];
int trace_grid;

__device__ __forceinline__ void trace_point(const Params &P, int i) {
  trace_record<false>(trace_buf, P.trace, i);
}

struct Unit {
  int p, s, ca, ma;
};
__device__ __forceinline__ Unit unit_of(const Params &P, int u) {
  Unit U;
  U.p = u / P.chunks;
  U.s = u - U.p * P.chunks;
  U.ca = U.s * P.cstep;
  U.ma = U.s * P.rstep;
  return U;
}

// The piece's ids into tile (column-major, -1 in the gaps), srow to -1; counts invalid ids when
// asked.  Lanes run along columns, which is memory order.
__device__ void load_piece(const Params &P, const Unit &U, int pa, int qa, int32_t *tile, int32_t *srow,
                           int *ninv, int *first) {
  const int pw = 1 << P.lgpw, ts = pw * P.prp, row_end = U.ma + P.rw;
  const int32_t *ids = P.ids + (size_t)U.p * P.tk;
  for (int x0 = 0; x0 < ts; x0 += kThreads * kUnroll) {
    int v[kUnroll], slot[kUnroll], at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int x = x0 + u * kThreads + threadIdx.x;
      const int mm = x >> P.lgpw, cc = x & (pw - 1);
      const int c = pa + cc, m = qa + mm;
      at[u] = m * P.stride + c;
      const bool ok = x < ts && mm < P.pr && m < row_end && c < P.nc && m < P.nr && at[u] < P.tk;
      slot[u] = x < ts ? cc * P.prp + mm : -1;
      v[u] = ok ? __ldg(ids + at[u]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      if (slot[u] >= 0) {
        tile[slot[u]] = v[u];
        srow[slot[u]] = -1;
        if (ninv && v[u] != -1 && (v[u] < 0 || v[u] >= P.experts)) {
          ++*ninv;
          *first = min(*first, U.p * P.tk + at[u]);
        }
      }
  }
}

// Rank the tile's routes to the experts [w0, w0 + wsz) within each warp's run of the order:
// first the run's slots of such routes are listed, in order, at the start of the warp's part of cl
// (most routes belong to other ranks: ranking and placing then take a step per 32 routes of the
// window, not per 32 slots); then srow[slot] = rank in the warp, mine = the warp's counts.  Then
// (all threads) the exclusive scan over the warps, totals in row kWarps.  Returns the length of
// the warp's list; ends with the block synchronised.
__device__ int rank_window(const Params &P, int ts, int w0, int wsz, const int32_t *tile, int32_t *srow,
                           int32_t *cl, int32_t *cnt) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = (((ts + kWarps - 1) / kWarps) + 31) & ~31;
  const int seg0 = min(warp * q, ts), seg1 = min(seg0 + q, ts);
  const int nbits = window_bits(wsz);
  const unsigned lo = (unsigned)(P.lo + w0);
  const int cs = wsz | 1; // row stride: odd, so that the scan's column reads are free of bank conflicts
  int32_t *mine = cnt + warp * cs;
  for (int e = lane; e < wsz; e += 32) mine[e] = 0;
  int n = 0;
  for (int b = seg0; b < seg1; b += 32) {
    const int sl = b + lane;
    const bool loc = sl < seg1 && (unsigned)tile[sl] - lo < (unsigned)wsz;
    const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
    if (loc) cl[seg0 + n + __popc(act & lanemask_lt())] = sl;
    n += __popc(act);
  }
  __syncwarp();
  for (int i = 0; i < n; i += 32) {
    const bool loc = i + lane < n;
    const int sl = loc ? cl[seg0 + i + lane] : 0;
    const unsigned e = loc ? (unsigned)tile[sl] - lo : 0u;
    const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
    const unsigned peers = match_peers(e, act, nbits);
    int before = 0;
    if (loc) {
      before = mine[e];
      srow[sl] = before + __popc(peers & lanemask_lt());
    }
    __syncwarp();
    if (loc && lane == 31 - __clz(peers)) mine[e] = before + __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // The exclusive scan of each expert's count over the warps: a warp takes four experts at a
  // time, a half-warp per expert and a lane per warp's count, two 16-wide scans interleaved.
  // Rows are an odd stride apart, so neither half conflicts on a bank, nor the halves with each
  // other.
  static_assert(kWarps == 16, "a half-warp scans the warps' counts of one expert");
  const int w = lane & 15;
  for (int e0 = warp; e0 < wsz; e0 += 4 * kWarps) {
    int t[2], v[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const int e = e0 + (2 * u + (lane >> 4)) * kWarps;
      t[u] = v[u] = e < wsz ? cnt[w * cs + e] : 0;
    }
#pragma unroll
    for (int o = 1; o < 16; o <<= 1)
#pragma unroll
      for (int u = 0; u < 2; u++) {
        const int x = __shfl_up_sync(MOE_FULL_MASK, v[u], o, 16);
        if (w >= o) v[u] += x;
      }
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const int e = e0 + (2 * u + (lane >> 4)) * kWarps;
      if (e < wsz) {
        cnt[w * cs + e] = v[u] - t[u];
        if (w == kWarps - 1) cnt[kWarps * cs + e] = v[u];
      }
    }
  }
  __syncthreads();
  return n;
}

// Phase 1 where the unit cannot stay resident: its histogram, a window of experts at a time,
// straight from global memory (the order does not matter for a count).
__device__ void count_unit(const Params &P, int u, int32_t *h, int *ninv, int *first) {
  const Unit U = unit_of(P, u);
  const int lane = threadIdx.x & 31, cw = 1 << P.lgcw, nel = cw * P.rw;
  const int32_t *ids = P.ids + (size_t)U.p * P.tk;
  for (int w0 = 0; w0 < P.el; w0 += P.hwin) {
    const int wsz = min(P.hwin, P.el - w0), nbits = window_bits(wsz);
    const unsigned lo = (unsigned)(P.lo + w0);
    for (int e = threadIdx.x; e < wsz; e += kThreads) h[e] = 0;
    __syncthreads();
    for (int x0 = 0; x0 < nel; x0 += kThreads * kUnroll) {
      int v[kUnroll], at[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; k++) {
        const int x = x0 + k * kThreads + threadIdx.x;
        const int c = U.ca + (x & (cw - 1)), m = U.ma + (x >> P.lgcw);
        at[k] = m * P.stride + c;
        v[k] = x < nel && c < P.nc && m < P.nr && at[k] < P.tk ? __ldg(ids + at[k]) : -1;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; k++) {
        if (w0 == 0 && v[k] != -1 && (v[k] < 0 || v[k] >= P.experts)) {
          ++*ninv;
          *first = min(*first, U.p * P.tk + at[k]);
        }
        const unsigned e = (unsigned)v[k] - lo;
        const bool loc = e < (unsigned)wsz;
        const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
        if (act) { // warp-aggregated: only the sum matters here
          const unsigned peers = match_peers(e, act, nbits);
          if (loc && lane == 31 - __clz(peers)) atomicAdd(&h[e], __popc(peers));
        }
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < wsz; e += kThreads) P.hist[(size_t)u * P.el + w0 + e] = h[e];
    __syncthreads();
  }
}

// kResident: one unit per block, in one piece and one ranking window, so that phase 1 ranks for
// phase 2 (a separate instance, so that the common case runs compact code)
template <bool kResident>
__global__ void __launch_bounds__(kThreads, 1) schedule_kernel(const Params P) {
  extern __shared__ __align__(16) int32_t sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = P.world, EL = P.el, S = P.chunks, blk = blockIdx.x, G = gridDim.x;
  const int pw = 1 << P.lgpw, ts = pw * P.prp, npieces = P.ncp * P.nrp;
  const Smem L = smem_layout(ts, P.rwin, W, P.stage_c, kResident ? 0 : P.hwin);
  long long *shl = (long long *)sm;
  int *shi = sm + 64;
  int32_t *tile = sm + L.tile, *srow = sm + L.srow, *cl = sm + L.cl, *cnt = sm + L.cnt, *run = sm + L.run;
  int32_t *lim = sm + L.lim;
  int32_t *raw = sm + L.raw, *cpre = sm + L.cpre, *off = sm + L.off, *cst = sm + L.cst;
  const int q = (((ts + kWarps - 1) / kWarps) + 31) & ~31;
  const int seg0 = min(warp * q, ts), seg1 = min(seg0 + q, ts);

  // launched as a programmatic dependent of the previous kernel in the stream: its outputs (our
  // ids) and this call's scratch are ours only from here
  pdl_wait();
  trace_point(P, 0);
  // ---- phase 1: the histogram of every unit ----
  unsigned &parity_sh = *(unsigned *)(sm + kParitySlot); // dynamic, like the rest: the opt-in size is all of it
  if (tid == 0) parity_sh = *(volatile unsigned *)P.bar >> 31; // the call's parity (grid_barrier)
  int ninv = 0, first = INT_MAX;
  int nloc = 0; // length of this warp's list of the window's routes (rank_window)
  if (kResident) {
    const Unit U = unit_of(P, blk);
    load_piece(P, U, U.ca, U.ma, tile, srow, &ninv, &first);
    __syncthreads();
    trace_point(P, 1);
    nloc = rank_window(P, ts, 0, EL, tile, srow, cl, cnt);
    // the histogram, for the chunks after this one; and added into the totals c[e][p] of this
    // call's buffer (by the call's parity; sums, so the order of the additions is immaterial)
    int32_t *tot = P.tot + parity_sh * kStageC;
    for (int e = tid; e < EL; e += kThreads) {
      const int h = cnt[kWarps * (EL | 1) + e];
      P.hist[(size_t)blk * EL + e] = h;
      if (P.stage_c && h) atomicAdd(tot + e * W + U.p, h);
      raw[e] = cpre[e] = run[e] = 0; // for phase 2's shared atomics
    }
  } else {
    for (int u = blk; u < P.units; u += G) count_unit(P, u, sm + L.hist, &ninv, &first);
  }
  if (__syncthreads_or(ninv)) { // invalid ids are rare: one barrier when there are none
    ninv = block_sum(ninv, shi);
    first = block_min(first, shi);
  }
  if (tid == 0) {
    P.inv[2 * (size_t)blk] = ninv;
    P.inv[2 * (size_t)blk + 1] = first;
  }
  trace_point(P, 2);
  const unsigned parity = parity_sh;
  grid_barrier(P.bar);
  trace_point(P, 3);
  pdl_launch_dependents();
  // the other buffer of totals is the next call's: zero it (this call's stays as it is until the
  // call after next zeroes it; the previous call, its last reader, has ended)
  for (int x = blk * kThreads + tid; x < kStageC; x += G * kThreads) P.tot[(parity ^ 1) * kStageC + x] = 0;

  // ---- phase 2: place ----
  long long needed = 0;
  int dropped = 0;
  for (int u = blk; u < P.units; u += G) {
    const Unit U = unit_of(P, u);
    const bool first_unit = u == blk;
    for (int k = 0; k < npieces; k++) {
      const int cp = k / P.nrp, rp = k - cp * P.nrp;
      const int pa = U.ca + cp * pw, qa = U.ma + rp * P.pr;
      if (!kResident) {
        load_piece(P, U, pa, qa, tile, srow, NULL, NULL);
        __syncthreads();
      }
      long long carry = 0; // padded rows of the experts before the window
      for (int w0 = 0; w0 < EL; w0 += P.rwin) {
        const int wsz = min(P.rwin, EL - w0);
        const unsigned lo = (unsigned)(P.lo + w0);
        if (!kResident) nloc = rank_window(P, ts, w0, wsz, tile, srow, cl, cnt);

        // the window's totals from every unit's histogram hist[q * S + s][e]: c[e][q], n_e,
        // peer_major's prefix sum_{q<p} c[e][q], and the ordinal of this chunk's first route
        // (or the running count carried from the previous piece)
        if (P.stage_c && kResident) {
          // one round of loads: c[e][q] from the totals, n_e and peer_major's sum_{q<p} c[e][q]
          // added up as they arrive; the ordinal of this chunk's first route from the histograms
          // of the chunks before it, of the same source rank (contiguous rows)
          const int32_t *tot = P.tot + parity * kStageC, *before = P.hist + (size_t)U.p * S * EL;
          const int nc = EL * W, nr = U.s * EL;
          for (int x0 = 0; x0 < nc || x0 < nr; x0 += kThreads) {
            const int x = x0 + tid;
            const int c = x < nc ? __ldcg(tot + x) : 0;
            const int r = x < nr ? __ldcg(before + x) : 0;
            if (x < nc) cst[x] = c;
            if (c) {
              const int e = x / W;
              atomicAdd(&raw[e], c);
              if (!P.roundrobin && x - e * W < U.p) atomicAdd(&cpre[e], c);
            }
            if (r) atomicAdd(&run[x % EL], r);
          }
        }
        if (P.stage_c && !kResident) {
          // a warp reads a unit's histogram row, lanes on consecutive experts (coalesced), kUnroll
          // rows in flight; the sums go into c[e][q] in shared memory.  Costly (S * E values and
          // a division each: docs/perf/schedule.md), but only where units do not all fit at once.
          for (int x = tid; x < wsz * W; x += kThreads) cst[x] = 0;
          for (int e = tid; e < wsz; e += kThreads) run[e] = 0;
          __syncthreads();
          for (int e = lane; e - lane < wsz; e += 32)
            for (int u0 = warp; u0 < P.units; u0 += kWarps * kUnroll) {
              int v[kUnroll];
#pragma unroll
              for (int i = 0; i < kUnroll; i++) {
                const int uu = u0 + i * kWarps;
                v[i] = e < wsz && uu < P.units ? __ldcg(P.hist + (size_t)uu * EL + w0 + e) : 0;
              }
#pragma unroll
              for (int i = 0; i < kUnroll; i++) {
                if (!v[i]) continue;
                const int uu = u0 + i * kWarps, qq = uu / S, ss = uu - qq * S;
                atomicAdd(&cst[e * W + qq], v[i]);
                if (qq == U.p && ss < U.s) atomicAdd(&run[e], v[i]);
              }
            }
          __syncthreads();
          for (int e = warp; e < wsz; e += kWarps) { // a warp per expert sums over the source ranks
            int all = 0, before = 0;
            for (int qq = lane; qq < W; qq += 32) {
              const int c = cst[e * W + qq];
              all += c;
              before += qq < U.p ? c : 0;
            }
#pragma unroll
            for (int o = 16; o; o >>= 1) {
              all += __shfl_xor_sync(MOE_FULL_MASK, all, o);
              before += __shfl_xor_sync(MOE_FULL_MASK, before, o);
            }
            if (lane == 0) {
              raw[e] = all;
              cpre[e] = before;
              if (k) run[e] = __ldcg(P.acc + (size_t)u * EL + w0 + e);
            }
          }
        }
        if (!P.stage_c) { // S == 1: c[e][q] is read where it is needed, hist[q][e]
          for (int e = tid; e < wsz; e += kThreads) raw[e] = cpre[e] = 0;
          __syncthreads();
          for (int pe = tid; pe < wsz * W; pe += kThreads) {
            const int e = pe / W, qq = pe - e * W;
            const int a = __ldcg(P.hist + (size_t)qq * EL + w0 + e);
            atomicAdd(&raw[e], a);
            if (!P.roundrobin && qq < U.p) atomicAdd(&cpre[e], a);
            if (qq == U.p) run[e] = k == 0 ? 0 : __ldcg(P.acc + (size_t)u * EL + w0 + e);
          }
        }
        __syncthreads();
        if (first_unit && k == 0 && w0 == 0) trace_point(P, 4);
        // segments: base by a block scan over the window, carried across windows
        for (int e0 = 0; e0 < wsz; e0 += kThreads) {
          const int e = e0 + tid;
          const int rawe = e < wsz ? raw[e] : 0;
          const int n = segment_routes(rawe, P.expert_capacity);
          const long long padded = e < wsz ? segment_padded(n, P.pad) : 0;
          long long total;
          const long long base = carry + block_exclusive_scan(padded, &total, shl);
          carry += total;
          if (e < wsz) {
            const long long cap = P.capacity;
            const int kept = segment_kept(n, base, P.capacity);
            off[e] = (int)(base < cap ? base : cap);
            lim[e] = kept;
            if (blk == 0 && first_unit && k == 0) {
              const int end = (int)(base + padded < cap ? base + padded : cap);
              P.counts[w0 + e] = kept;
              P.offsets[w0 + e] = off[e];
              P.tpe[w0 + e] = end - off[e];
              dropped += rawe - kept;
            }
          }
        }
        if (tid == 0) off[wsz] = (int)(carry < (long long)P.capacity ? carry : (long long)P.capacity);
        __syncthreads();
        if (first_unit && k == 0 && w0 == 0) trace_point(P, 5);

        // padding rows of the experts this block owns
        if (first_unit && k == 0)
          for (int e = (blk - w0 % G + G) % G; e < wsz; e += G)
            for (long long r = off[e] + lim[e] + tid; r < off[e + 1]; r += kThreads) { // C may be near 2^31
              P.peer_rank[r] = -1;
              P.peer_route[r] = -1;
            }

        // unused rows [rows used, C), striding with every block, as soon as the last window's scan
        // has the total: these stores then drain while the place loop runs (after it, they added
        // ~0.25 us at Kimi's worst-case capacity; 16-byte stores were slower at T 512:
        // docs/perf/schedule.md)
        if (first_unit && k == 0 && w0 + wsz == EL) {
          const long long used = carry < (long long)P.capacity ? carry : (long long)P.capacity;
          for (long long r = used + (long long)blk * kThreads + tid; r < P.capacity; r += (long long)G * kThreads) {
            P.peer_rank[r] = -1;
            P.peer_route[r] = -1;
          }
        }

        // place
        for (int i = lane; i < nloc; i += 32) {
          const int sl = cl[seg0 + i];
          const unsigned e = (unsigned)tile[sl] - lo;
          const int j = run[e] + cnt[warp * (wsz | 1) + e] + srow[sl];
          int pos;
          if (!P.roundrobin) pos = cpre[e] + j;
          else if (!P.stage_c) pos = roundrobin_position<true>(P.hist + w0 + e, W, U.p, j, (size_t)EL); // S == 1
          else if (W % 4 == 0) pos = roundrobin_position4((const int4 *)(cst + e * W), W / 4, U.p, j);
          else pos = roundrobin_position<false>(cst + e * W, W, U.p, j);
          int row = -1;
          if (pos < lim[e]) {
            row = off[e] + pos;
            const int cc = (int)(((unsigned long long)sl * P.magic) >> 32), mm = sl - cc * P.prp;
            P.peer_rank[row] = U.p;
            P.peer_route[row] = (qa + mm) * P.stride + pa + cc;
          }
          srow[sl] = row;
        }
        __syncthreads();
        if (npieces > 1) { // the running ordinals, for the next piece
          for (int e = tid; e < wsz; e += kThreads)
            __stcg(P.acc + (size_t)u * EL + w0 + e, run[e] + cnt[kWarps * (wsz | 1) + e]);
          __syncthreads();
        }
      }
      if (first_unit && k == 0) needed = carry;

      if (first_unit && k == 0) trace_point(P, 6);
      // route_row of the piece, in memory order: where a column group fits the block, a thread
      // keeps its column and steps down the rows (no index arithmetic per element but one product)
      int32_t *rrow = P.route_row + (size_t)U.p * P.tk;
      const int row_end = U.ma + P.rw;
      if (pw <= kThreads) {
        const int cc = tid & (pw - 1), c = pa + cc, dm = kThreads >> P.lgpw;
        const int mlim = min(min(row_end, P.nr) - qa, P.pr); // rows of the piece inside the grid
        if (c < P.nc)
          for (int mm = tid >> P.lgpw; mm < mlim; mm += dm) {
            const int at = (qa + mm) * P.stride + c;
            if (at < P.tk) rrow[at] = srow[cc * P.prp + mm];
          }
      } else {
        for (int x = tid; x < pw * P.pr; x += kThreads) {
          const int mm = x >> P.lgpw, cc = x & (pw - 1);
          const int c = pa + cc, m = qa + mm;
          if (m < row_end && c < P.nc && m < P.nr && m * P.stride + c < P.tk) rrow[m * P.stride + c] = srow[cc * P.prp + mm];
        }
      }
      __syncthreads();
    }
  }

  trace_point(P, 7);
  if (blk == 0) { // offsets[EL] and the stats
    dropped = block_sum(dropped, shi);
    int n = 0, f = INT_MAX;
    for (int b = tid; b < G; b += kThreads) {
      n += __ldcg(P.inv + 2 * (size_t)b);
      f = min(f, __ldcg(P.inv + 2 * (size_t)b + 1));
    }
    n = block_sum(n, shi);
    f = block_min(f, shi);
    if (tid == 0) {
      const long long cap = P.capacity;
      P.offsets[EL] = (int)(needed < cap ? needed : cap);
      P.stats[MOE_STAT_ROWS_NEEDED] = (int)(needed < INT_MAX ? needed : INT_MAX);
      P.stats[MOE_STAT_ROWS_USED] = (int)(needed < cap ? needed : cap);
      P.stats[MOE_STAT_DROPPED] = dropped;
      P.stats[MOE_STAT_INVALID] = n;
      P.stats[MOE_STAT_FIRST_INVALID] = n ? f : -1;
    }
  }
}

// ---- host ----

// Per device: blocks of schedule_kernel per SM for a few shared-memory sizes.
constexpr int kDevices = 64, kOccSlots = 8;
std::atomic<int> smem_raised[2][64];
std::atomic<long long> occ_cache[kDevices][kOccSlots]; // (smem << 17) | (resident << 16) | blocks per SM
std::atomic<int> occ_next[kDevices];

int device_limits(moe_ctx *ctx, int device, bool resident, size_t smem, int *nsm, int *per_sm) {
  void (*kernel)(const Params) = resident ? schedule_kernel<true> : schedule_kernel<false>;
  const long long key = (long long)smem << 1 | resident;
  const bool cached = device >= 0 && device < kDevices;
  if (int rc = moeI_cuda_coop_sms(ctx, device, nsm)) return rc;
  if (*nsm == 0)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, STAGE ": cuda:%d cannot launch cooperative kernels", device);
  if (smem > 48 * 1024)
    if (int rc = moeI_cuda_raise_smem(ctx, STAGE, (const void *)kernel, smem_raised[resident], device)) return rc;
  if (cached)
    for (int i = 0; i < kOccSlots; i++) {
      const long long v = occ_cache[device][i].load(std::memory_order_relaxed);
      if (v && (v >> 16) == key) {
        *per_sm = (int)(v & 0xffff);
        return MOE_OK;
      }
    }
  MOE_CUDA_TRY(ctx, STAGE, cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, kThreads, smem));
  if (cached && *per_sm > 0)
    occ_cache[device][occ_next[device].fetch_add(1) % kOccSlots].store(key << 16 | *per_sm);
  return MOE_OK;
}

} // namespace

// Any problem within the stage's 32-bit bounds (select.cu checks them before any kernel is asked).
int moeI_schedule_grid_fits(moe_ctx *ctx, const moe_schedule_args *a, Fit *fit, char *why, size_t n) {
  (void)ctx, (void)a, (void)why, (void)n;
  *fit = TAKES;
  return MOE_OK;
}

int moeI_schedule_grid_run(moe_ctx *ctx, const moe_schedule_args *a) {
  const int device = a->ids->device.index;
  int rc;
  cudaStream_t st;
  if ((rc = moeI_cuda_ctx_stream(ctx, device, &st))) return rc;
  int nsm, per_sm;
  if ((rc = device_limits(ctx, device, true, 0, &nsm, &per_sm))) return rc;

  Params P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  P.trace = ctx->schedule_trace;
  const int W = P.world, tk = P.tk;

  // windows: c[e][q] of a ranking window fits kStageC unless W alone is larger
  P.rwin = P.el < kRankWindow ? P.el : kRankWindow;
  if (W <= kStageC && P.rwin > kStageC / W) P.rwin = kStageC / W;
  if (W > kStageC) P.rwin = 1;
  P.stage_c = W <= kStageC;
  P.hwin = P.el < kHistWindow ? P.el : kHistWindow;

  // chunks: about one unit per SM over all source ranks; fewer when E is large (every block reads
  // S * E histogram values), one when c[e][q] is not staged (it is then read as hist[q][0][e])
  int per_rank = cdiv(nsm, W);
  const int by_experts = kMaxScratchHist / a->experts;
  if (per_rank > by_experts) per_rank = by_experts > 1 ? by_experts : 1;
  if (!P.stage_c) per_rank = 1;
  int cw, rw;
  if (P.roundrobin) {
    P.nc = tk < MOE_SCHED_THREADS ? tk : MOE_SCHED_THREADS;
    P.nr = cdiv(tk, MOE_SCHED_THREADS);
    P.stride = MOE_SCHED_THREADS;
    if (P.nc == 0) {
      cw = 1;
      P.chunks = 1;
    } else {
      cw = (int)pow2_ceil(cdiv(P.nc, per_rank));
      const int coalesced = P.nc < 32 ? (int)pow2_ceil(P.nc) : 32;
      if (cw < coalesced) cw = coalesced;
      P.chunks = cdiv(P.nc, cw);
    }
    rw = P.nr;
    P.cstep = cw;
    P.rstep = 0;
  } else {
    P.nc = 1;
    P.nr = tk;
    P.stride = 1;
    cw = 1;
    if (tk == 0) {
      rw = 0;
      P.chunks = 1;
    } else {
      rw = (cdiv(tk, per_rank) + 31) & ~31;
      P.chunks = cdiv(tk, rw);
    }
    P.cstep = 0;
    P.rstep = rw;
  }
  P.lgcw = log2_exact(cw);
  P.rw = rw;
  const long long units = (long long)W * P.chunks;
  // the last chunk's row_end (its first row + rw, in 32 bits) may pass tk by up to rw
  if (units > INT_MAX / kThreads || (long long)P.chunks * rw > INT_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, STAGE ": %lld units of %d rows of work are too many for cuda", units,
                      rw);
  P.units = (int)units;

  // pieces: the whole chunk, groups of whole columns, or runs of rows of one column
  int pw, pr;
  const int rwp = rw | 1;
  if ((long long)cw * rwp <= kTile) {
    pw = cw, pr = rw, P.ncp = 1, P.nrp = 1;
  } else if (rwp <= kTile) {
    pw = 1;
    while (pw * 2 * rwp <= kTile) pw *= 2;
    pr = rw, P.ncp = cw / pw, P.nrp = 1;
  } else {
    pw = 1, pr = kTile - 1, P.ncp = cw, P.nrp = cdiv(rw, pr);
  }
  P.lgpw = log2_exact(pw);
  P.pr = pr;
  P.prp = pr | 1;
  P.magic = ((1ull << 32) + (unsigned long long)P.prp - 1) / (unsigned long long)P.prp;
  const int npieces = P.ncp * P.nrp, ts = pw * P.prp;

  // resident when every unit has its own block, in one piece and one window; else phase 1 counts
  // and phase 2 ranks again, over as many blocks as fit at once
  size_t smem = sizeof(int32_t) * smem_layout(ts, P.rwin, W, P.stage_c, 0).total;
  if ((rc = device_limits(ctx, device, true, smem, &nsm, &per_sm))) return rc;
  const bool resident = npieces == 1 && P.el <= P.rwin && units <= (long long)nsm * per_sm;
  if (!resident) {
    smem = sizeof(int32_t) * smem_layout(ts, P.rwin, W, P.stage_c, P.hwin).total;
    if ((rc = device_limits(ctx, device, false, smem, &nsm, &per_sm))) return rc;
  }
  if (per_sm < 1)
    return moeI_seterr(ctx, MOE_ERR_INTERNAL, STAGE ": no block of %d threads with %zu bytes of shared memory fits an SM",
                      kThreads, smem);
  const int grid = (int)(units < (long long)nsm * per_sm ? units : (long long)nsm * per_sm);

  // scratch: header (barrier), inv [G][2], hist [units][EL], acc [units][EL] with pieces
  const size_t hist_n = (size_t)units * P.el;
  const size_t nbytes = MOE_SCRATCH_HEADER + sizeof(int32_t) * (2 * (size_t)grid + hist_n * (npieces > 1 ? 2 : 1));
  void *scratch;
  int owned;
  if ((rc = moeI_cuda_scratch_get(ctx, device, st, nbytes, &scratch, &owned))) return rc;
  P.bar = (unsigned *)scratch;
  P.tot = (int32_t *)scratch + kTotOffset;
  P.inv = (int32_t *)((char *)scratch + MOE_SCRATCH_HEADER);
  P.hist = P.inv + 2 * (size_t)grid;
  P.acc = npieces > 1 ? P.hist + hist_n : NULL;

  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[2], coop = {};
  coop.id = cudaLaunchAttributeCooperative; // all blocks resident at once: the grid barrier
  coop.val.cooperative = 1;
  schedule_launch_config(&cfg, attr, (unsigned)grid, kThreads, smem, st, coop);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, resident ? schedule_kernel<true> : schedule_kernel<false>, P);
  trace_grid = grid;
  // the scratch goes back whether or not the launch went (in a capture, as a free node)
  rc = moeI_cuda_scratch_done(ctx, st, scratch, owned);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, STAGE ": cudaLaunchKernelEx(schedule_kernel) failed at %s:%d: %s: %s", __FILE__,
                      __LINE__, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  if (rc) return rc;
  return moeI_ok(ctx);
}

// The phase times of the last grid call made with the context's trace switch on: trace_buf's rows (copy_trace).
extern "C" int moeI_schedule_grid_trace(long long *out, int max_blocks) {
  return copy_trace(out, trace_buf, trace_grid, max_blocks);
}
