/* SPDX-License-Identifier: MIT */
// bitmap.cu -- the scheduler for everything up to 4,096 routes a block and 128 experts a
// rank (decode, 512 tokens at any EP size, Kimi K2's 7,168 tokens at EP8), bit for bit the result of
// moeI_schedule_cpu: one cooperative grid, every block's routes in registers, their ordinals ranked with
// per-expert bitmaps, one exchange of counts between blocks.
//
// Why a kernel besides grid.cu's.  At 512 tokens a call of the grid kernel is a chain of ten or
// more block-wide steps (lists of the local routes, block scans, ballot chains, scans over warps),
// each a few hundred cycles of latency, and its code runs once per launch.  This one keeps the
// chain and the code short:
//
// Each source rank is cut into bpr units of NP positions (a power of two) in the order of j --
// "roundrobin": nlt logical threads of Rp slots, position (logical thread, slot); "peer_major": a
// run of NP routes -- one unit a block.  Then:
//   1. every thread loads its positions' ids (coalesced: lanes along logical threads); a local
//      route sets bit `position` in its expert's row of a bitmap in shared memory (atomicOr: the
//      result does not depend on the order); the others get route_row -1 at once;
//   2. one pass over the bitmap words: popc, an exclusive scan along each expert's row (shuffles
//      inside a warp, rows aligned to lane groups), so that a route's ordinal in its unit is the
//      prefix of its word plus the bits below it in the word -- two shared loads, whatever the
//      routing; each row's total is the unit's count of that expert, stored in the scratch
//      (hist[unit][e]) and added into this call's totals c[e][p] (atomics that only sum);
//   3. the grid barrier (grid_barrier.cuh's protocol, the word shared with the grid
//      kernel, so the parity and the totals' buffers alternate the same way whichever kernel
//      runs); while thread 0 waits, the others form their routes' ordinals and list the routes;
//   4. one round of loads: c[e][q] into shared memory (n_e summed as it arrives), the counts of the
//      units before this one of the same source rank (the ordinal's offset), and, for block 0, all
//      units' invalid ids;
//   5. the segments in every warp (a lane holds up to four experts' offsets in registers: no
//      barrier after them); each listed route's row -- roundrobin base + sum_q min(c[e][q], j) +
//      #{q < p : c[e][q] > j}, summed by up to 32 lanes a route, peer_major base + sum_{q<p}
//      c[e][q] + j -- stored with peer_rank and peer_route; padding rows of the experts e = b mod
//      G and a share of the unused rows [rows used, C) get -1 from block b; warp 0 of block 0
//      writes counts, tokens_per_expert, expert_offsets and stats.
// Four block-wide barriers and one grid barrier after griddepcontrol.wait.  No atomics decide an
// order, the host never waits, and nothing is cleared that the call does not clear itself (the
// totals' other buffer, as the grid kernel does).  Launched as a programmatic dependent, as the
// grid kernel is; the shared memory is cleared before griddepcontrol.wait, so that it overlaps the
// previous kernel's tail.
#include <limits.h>
#include <stdint.h>
#include <stdio.h>

#include <atomic>

#include "grid_barrier.cuh"
#include "schedule.cuh"

#define STAGE "schedule"

namespace {

constexpr int kThreads = 512;
constexpr int kMaxSlots = 8;         // positions a thread: NP <= 4096
constexpr int kMaxWords = 8192;      // bitmap words: el * NP / 32
constexpr int kMaxBlocks = 128;      // G = W * bpr, all resident
constexpr int kMaxPer = 4;           // experts a lane in the segments: el <= 128
constexpr int kMaxWpt = 8;           // bitmap words a thread in the scan
constexpr int kBatch = 4;            // loads in flight a thread after the barrier

// Offsets (ints) of the shared arrays; the host sizes the launch with the same function.
struct Smem {
  int misc, bm, pre, c, raw, pfx, cpre, la, li, total;
};
__host__ __device__ inline Smem smem_layout(int words, int el, int wp, int np) {
  Smem L;
  L.misc = 0;                     // [0] invalid ids, [1] first invalid, [2] parity, [3] local routes,
                                  // [4] all invalid, [5] their first
  L.bm = 8;                       // [el][nwp] bitmaps of the unit's local routes, by position
  L.pre = L.bm + words;           // [el][nwp] set bits in the row before each word
  L.c = (L.pre + words + 3) & ~3; // [el][wp] c[e][q], zeros past W (int4 reads)
  L.raw = L.c + el * wp;          // n_e before expert_capacity
  L.pfx = L.raw + el;             // routes of e in this source rank's units before this one
  L.cpre = L.pfx + el;            // peer_major: sum_{q<p} c[e][q]
  L.la = L.cpre + el;             // the unit's local routes, in no order: e << 12 | ordinal in the unit
  L.li = L.la + np;               // and their route index
  L.total = L.li + np;
  return L;
}

struct Params : ScheduleCall {
  int trace;        // record the phases' times (moeI_schedule_set_trace): a measuring aid
  unsigned *bar;    // scratch: the grid barrier (grid_barrier.cuh), bit 31 the call's parity
  int32_t *tot;     // scratch: c[e][q] totals, [2][MOE_SCHED_TOT_STRIDE] by the parity, [el][wp] each
  int32_t *hist;    // scratch: [G][hs]: a unit's count of each expert, then its invalid ids and the first
  int lghs;         // log2 hs, hs >= el + 2
  int lgbpr;        // log2 of the units a source rank
  int np;           // positions a unit (a power of two)
  int lgnlt, lgrp;  // roundrobin: log2 of the logical threads a unit and of the slots a logical thread
  int ltmask;       // roundrobin: logical threads a unit less one; peer_major all ones
  int mstride;      // roundrobin: 1024 (route = slot 1024 + logical thread); peer_major 0
  int nc;           // roundrobin: logical threads that hold routes, min(tk, 1024); peer_major INT_MAX
  int lgnwp;        // log2 of the bitmap words an expert (np / 32, at least 1)
  int wpt, lglpr;   // words a thread in the scan, log2 of the threads an expert's row
  int passes;       // ceil(el << lglpr / kThreads)
  int lgwp;         // log2 wp: W rounded up to a power of two, at least 4 (the row stride of c[e][q])
  int lgper;        // log2 of the experts a lane in the segments
  int lgtpr;        // log2 of the threads that place a route (roundrobin: an int4 of c[e][q] each)
  float inv_pad;    // 1 / pad: quotients without a division
  Smem L;
};

// The last traced call, per block: clock64 at the phase points (entry, loaded, scanned, past the
// barrier, totals, placed, end), then %globaltimer at entry and end.  Read by
// moeI_schedule_bitmap_trace (bench/schedule_trace.c).
constexpr int kTracePoints = 7;
__device__ long long trace_buf[kMaxBlocks][kTracePoints + 2];
int trace_grid;
__device__ __forceinline__ void trace_point(const Params &P, int i) {
  trace_record<true>(trace_buf, P.trace, i);
}

// Route index (inside its source rank) of load index y of this unit, and its position in the order
// of j; -1 where the position holds no route.  One formula for both layouts, without a branch:
// roundrobin i = (y >> lgnlt) 1024 + lt, lt = s nlt + (y & (nlt - 1)), position (lt - s nlt) Rp +
// (y >> lgnlt); peer_major i = s NP + y, position y (lgnlt 31, mstride 0, nc unbounded).
__device__ __forceinline__ int route_of(const Params &P, int lt0, int y, int *bit) {
  const int m = y >> P.lgnlt, ltl = y & P.ltmask, lt = lt0 + ltl, i = m * P.mstride + lt;
  *bit = ltl << P.lgrp | m;
  return lt < P.nc && i < P.tk ? i : -1;
}

// The segments as one warp sees them, every warp alike (no barrier after them): lane l holds
// experts [l per, l per + per), per = 2^lgper <= kMaxPer; off = min(base, C), lim = routes that
// get a row; rows needed and used.  32-bit: the host bounds the padded total below 2^31.
struct WarpSegments {
  int off[kMaxPer], lim[kMaxPer], need, used;
};
__device__ __forceinline__ WarpSegments warp_segments(const Params &P, const int *raw) {
  const int lane = threadIdx.x & 31, per = 1 << P.lgper;
  WarpSegments S;
  int n[kMaxPer], sz[kMaxPer], sum = 0;
#pragma unroll
  for (int k = 0; k < kMaxPer; k++) {
    const int e = lane * per + k;
    n[k] = sz[k] = 0;
    if (k >= per) continue; // the same for every lane
    n[k] = e < P.el ? segment_routes(raw[e], P.expert_capacity) : 0;
    sz[k] = (int)padded_size(n[k], P.pad, P.inv_pad);
    sum += sz[k];
  }
  const int incl = warp_inclusive_scan(sum);
  int base = incl - sum;
  S.need = __shfl_sync(MOE_FULL_MASK, incl, 31);
  S.used = min(S.need, P.capacity);
#pragma unroll
  for (int k = 0; k < kMaxPer; k++) {
    S.off[k] = min(base, P.capacity);
    S.lim[k] = segment_kept(n[k], base, P.capacity);
    base += sz[k];
  }
  return S;
}
// Expert e's off and lim from the lane that holds them (every lane of the warp calls it).
__device__ __forceinline__ void segment_of(const WarpSegments &S, int lgper, int e, int *off, int *lim) {
  const int src = e >> lgper, k = e & ((1 << lgper) - 1);
  *off = __shfl_sync(MOE_FULL_MASK, S.off[0], src);
  *lim = __shfl_sync(MOE_FULL_MASK, S.lim[0], src);
#pragma unroll
  for (int kk = 1; kk < kMaxPer; kk++) {
    if (kk >> lgper) break; // the same for every lane
    const int o = __shfl_sync(MOE_FULL_MASK, S.off[kk], src), l = __shfl_sync(MOE_FULL_MASK, S.lim[kk], src);
    if (k == kk) *off = o, *lim = l;
  }
}

// kS: positions a thread (1, 2, 4 or 8), so that the loops over them unroll to what the unit has:
// code size is time here -- each launch runs its code once, and an early version unrolled to 8
// everywhere (8,700 instructions) spent a third of its stall samples on instruction fetch
// (docs/perf/schedule.md)
template <int kS>
__global__ void __launch_bounds__(kThreads, 1) schedule_bitmap_kernel(const Params P) {
  extern __shared__ int4 smem4[];
  int *sm = (int *)smem4;
  const Smem &L = P.L;
  int *misc = sm + L.misc, *bm = sm + L.bm, *pre = sm + L.pre, *c = sm + L.c, *raw = sm + L.raw, *pfx = sm + L.pfx;
  int *cpre = sm + L.cpre;
  const int t = threadIdx.x, lane = t & 31, b = blockIdx.x, G = gridDim.x;
  const int el = P.el, tk = P.tk, W = P.world;
  const int p = b >> P.lgbpr, s = b & ((1 << P.lgbpr) - 1);

  // before the previous kernel ends: clear what this call accumulates in shared memory
  for (int x = t; x < L.pre; x += kThreads) sm[x] = x == 1 || x == 5 ? INT_MAX : 0; // misc (two minima), bitmaps
  for (int x = L.c + t; x < L.la; x += kThreads) sm[x] = 0;                          // c, raw, pfx, cpre
  __syncthreads();
  pdl_wait();
  trace_point(P, 0);

  // 1. this thread's positions: ids, bitmaps, route_row -1 for the routes that are not ours
  if (t == 0) misc[2] = (int)(*(volatile unsigned *)P.bar >> 31); // the call's parity (grid_barrier)
  const int32_t *ids = P.ids + (size_t)p * tk;
  int32_t *rrow = P.route_row + (size_t)p * tk;
  int v[kS], idx[kS], bit[kS];
  const int lt0 = P.roundrobin ? s << P.lgnlt : s * P.np; // the unit's first logical thread, or route
#pragma unroll
  for (int q = 0; q < kS; q++) {
    const int y = q * kThreads + t;
    idx[q] = y < P.np ? route_of(P, lt0, y, &bit[q]) : -1;
    v[q] = idx[q] >= 0 ? __ldg(ids + idx[q]) : -1;
  }
  unsigned loc = 0;
  int ninv = 0, first = INT_MAX;
#pragma unroll
  for (int q = 0; q < kS; q++) { // predicated, not branched: each branch costs a convergence point
    const unsigned e = (unsigned)v[q] - (unsigned)P.lo;
    const bool has = idx[q] >= 0, mine = has && e < (unsigned)el;
    const bool bad = has && !mine && v[q] != -1 && (unsigned)v[q] >= (unsigned)P.experts;
    loc |= (unsigned)mine << q;
    if (mine) atomicOr((unsigned *)bm + ((int)e << P.lgnwp) + (bit[q] >> 5), 1u << (bit[q] & 31));
    if (has && !mine) rrow[idx[q]] = -1;
    ninv += bad;
    first = bad ? min(first, p * tk + idx[q]) : first;
    v[q] = (int)e;
  }
  if (ninv) atomicAdd(&misc[0], ninv), atomicMin(&misc[1], first);
  __syncthreads();
  trace_point(P, 1);

  // 2. the rows' prefixes and totals; the unit's counts out
  const int parity = misc[2];
  int32_t *hist = P.hist + ((size_t)b << P.lghs);
  {
    const int lpr = 1 << P.lglpr;
#pragma unroll 1
    for (int r = 0; r < P.passes; r++) {
      const int g = r * kThreads + t, e = g >> P.lglpr, seg = g & (lpr - 1);
      const bool ok = e < el;
      const int w0 = (e << P.lgnwp) + seg * P.wpt;
      int pc[kMaxWpt], sum = 0;
#pragma unroll
      for (int k = 0; k < kMaxWpt; k++) {
        pc[k] = ok && k < P.wpt ? __popc((unsigned)bm[w0 + k]) : 0;
        sum += pc[k];
      }
      int incl = sum;
#pragma unroll 1
      for (int o = 1; o < lpr; o <<= 1) { // within the row's lanes
        const int u = __shfl_up_sync(MOE_FULL_MASK, incl, o, lpr);
        if (seg >= o) incl += u;
      }
      if (ok) {
        int run = incl - sum;
#pragma unroll
        for (int k = 0; k < kMaxWpt; k++)
          if (k < P.wpt) pre[w0 + k] = run, run += pc[k];
        if (seg == lpr - 1) {
          __stcg(hist + e, incl);
          if (incl) atomicAdd(P.tot + parity * MOE_SCHED_TOT_STRIDE + (e << P.lgwp) + p, incl);
        }
      }
    }
  }
  if (t == 0) __stcg(hist + el, misc[0]), __stcg(hist + el + 1, misc[1]);
  __syncthreads();
  trace_point(P, 2);

  // 3. the grid barrier; meanwhile each local route's ordinal inside its unit, and the route into
  // the list the placing threads take from (in no order: an entry carries all it needs)
  if (t == 0) grid_arrive_wait(P.bar);
  int *la = sm + L.la, *li = sm + L.li;
#pragma unroll
  for (int q = 0; q < kS; q++) {
    if (loc >> q & 1) {
      const int w = (v[q] << P.lgnwp) + (bit[q] >> 5);
      const int jl = pre[w] + __popc((unsigned)bm[w] & ((1u << (bit[q] & 31)) - 1));
      const int k = atomicAdd(&misc[3], 1);
      la[k] = v[q] << 12 | jl;
      li[k] = idx[q];
    }
  }
  __syncthreads();
  trace_point(P, 3);
  pdl_launch_dependents();

  // 4. one round of loads -- c[e][q] (n_e and peer_major's sum_{q<p} c[e][q] summed as they
  // arrive), the counts of this rank's earlier units, for block 0 every unit's invalid ids -- then
  // shared atomics (sums, so their order is immaterial)
  {
    const int32_t *tot = P.tot + parity * MOE_SCHED_TOT_STRIDE;
    const int32_t *before = P.hist + ((size_t)(p << P.lgbpr) << P.lghs);
    const int nt = el << P.lgwp, npre = s << P.lghs, n = nt + npre + (b == 0 ? 2 * G : 0);
#pragma unroll 1
    for (int x0 = t; x0 < n; x0 += kThreads * kBatch) {
      int val[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; u++) { // the loads first
        const int x = x0 + u * kThreads, y = x - nt - npre;
        const int32_t *from = x < nt          ? tot + x
                              : x < nt + npre ? before + (x - nt)
                                              : P.hist + ((y >> 1) << P.lghs) + el + (y & 1); // unit y / 2's invalid ids
        val[u] = x < n ? __ldcg(from) : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; u++) {
        const int x = x0 + u * kThreads, y = x - nt - npre;
        if (x < nt) {
          const int e = x >> P.lgwp, q = x & ((1 << P.lgwp) - 1);
          c[x] = val[u];
          if (val[u]) atomicAdd(&raw[e], val[u]);
          if (val[u] && q < p) atomicAdd(&cpre[e], val[u]);
        } else if (x < nt + npre) {
          const int e = (x - nt) & ((1 << P.lghs) - 1);
          if (e < el && val[u]) atomicAdd(&pfx[e], val[u]);
        } else if (x < n) {
          if (!(y & 1)) atomicAdd(&misc[4], val[u]);
          else atomicMin(&misc[5], val[u]);
        }
      }
    }
    // the next call's totals (this call's stay until the call after next clears them)
    int4 *next = (int4 *)(P.tot + (parity ^ 1) * MOE_SCHED_TOT_STRIDE);
    for (int x = b * kThreads + t; x < MOE_SCHED_TOT_STRIDE / 4; x += G * kThreads) next[x] = make_int4(0, 0, 0, 0);
  }
  __syncthreads();
  trace_point(P, 4);

  // 5. the segments, in every warp; then place: tpr threads a route (lanes over the source ranks,
  // an int4 of c[e][q] each), as many routes at a time as the block has threads
  const WarpSegments S = warp_segments(P, raw);
  {
    const int nl = misc[3], lgtpr = P.roundrobin ? P.lgtpr : 0, tpr = 1 << lgtpr, sub = t & (tpr - 1);
#pragma unroll 1
    for (int r0 = 0; r0 < nl; r0 += kThreads >> lgtpr) {
      const int r = r0 + (t >> lgtpr);
      const bool mine = r < nl;
      const int x = mine ? la[r] : 0, e = x >> 12, j = pfx[e] + (x & 4095);
      int pos = 0;
      if (P.roundrobin) {
        const int4 *c4 = (const int4 *)(c + (e << P.lgwp));
#pragma unroll 1
        for (int q4 = sub; q4 < (W + 3) >> 2; q4 += tpr) { // zeros past W count nothing
          const int4 cq = c4[q4];
          const int q0 = 4 * q4;
          pos += min(cq.x, j) + (q0 < p && cq.x > j) + min(cq.y, j) + (q0 + 1 < p && cq.y > j);
          pos += min(cq.z, j) + (q0 + 2 < p && cq.z > j) + min(cq.w, j) + (q0 + 3 < p && cq.w > j);
        }
#pragma unroll 1
        for (int o = 1; o < tpr; o <<= 1) pos += __shfl_xor_sync(MOE_FULL_MASK, pos, o);
      } else {
        pos = cpre[e] + j;
      }
      int off, lim;
      segment_of(S, P.lgper, e, &off, &lim);
      if (mine && sub == 0) {
        const int i = li[r];
        rrow[i] = place_route(P, p, i, pos, off, lim);
      }
    }
  }
  // -1 into the padding rows of the experts e = b mod G (none where pad is 1): the lanes that hold
  // them, each warp a sixteenth of the rows
  if (P.pad > 1) {
    const int per = 1 << P.lgper, nxt = __shfl_down_sync(MOE_FULL_MASK, S.off[0], 1), warp = t >> 5;
#pragma unroll
    for (int k = 0; k < kMaxPer; k++) {
      const int e = lane * per + k;
      if (k >= per || e >= el || e % G != b) continue;
      const int hi = e + 1 == el ? S.used : k + 1 < per ? S.off[k + 1 < kMaxPer ? k + 1 : k] : nxt;
#pragma unroll 1
      for (int r = S.off[k] + S.lim[k] + warp; r < hi; r += kThreads / 32) P.peer_rank[r] = P.peer_route[r] = -1;
    }
  }
  {
    const int share = (P.capacity - S.used + G - 1) / G;
    const int lo = min(P.capacity, S.used + b * share), hi = min(P.capacity, lo + share);
    fill_unused(P.peer_rank, lo, hi, t, kThreads);
    fill_unused(P.peer_route, lo, hi, t, kThreads);
  }
  trace_point(P, 5);
  if (b == 0 && t < 32) { // counts, tokens_per_expert, expert_offsets, stats: warp 0 holds them all
    const int per = 1 << P.lgper;
    int dropped = 0, next_off = __shfl_down_sync(MOE_FULL_MASK, S.off[0], 1);
#pragma unroll
    for (int k = 0; k < kMaxPer; k++) {
      const int e = lane * per + k;
      if (k >= per || e >= el) continue;
      const int hi = k + 1 < per ? S.off[k + 1 < kMaxPer ? k + 1 : k] : lane < 31 ? next_off : S.used;
      P.offsets[e] = S.off[k];
      P.counts[e] = S.lim[k];
      P.tpe[e] = (e + 1 < el ? hi : S.used) - S.off[k];
      dropped += raw[e] - S.lim[k];
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) dropped += __shfl_xor_sync(MOE_FULL_MASK, dropped, o);
    if (lane == 0) {
      const int inv = misc[4];
      P.offsets[el] = S.used;
      P.stats[MOE_STAT_ROWS_NEEDED] = S.need;
      P.stats[MOE_STAT_ROWS_USED] = S.used;
      P.stats[MOE_STAT_DROPPED] = dropped;
      P.stats[MOE_STAT_INVALID] = inv;
      P.stats[MOE_STAT_FIRST_INVALID] = inv ? misc[5] : -1;
    }
  }
  trace_point(P, 6);
}

// ---- host ----

std::atomic<int> raised[4][64]; // an instance's dynamic shared memory limit raised (past 48 KiB), a device

} // namespace

namespace {

// A call's geometry: units, positions, the bitmap's shape.  why names the limit the problem passes
// (NULL when it fits, as far as the problem alone tells; the device's SM count is checked apart).
struct Plan {
  long long W, tk, el, nc, rp, bpr, np, nwp, wp, hs;
  bool rr;
  const char *why;
};
Plan plan_of(const moe_schedule_args *a) {
  Plan q;
  q.W = a->ids->shape[0], q.tk = a->ids->shape[1] * a->ids->shape[2];
  q.el = a->experts / q.W;
  const long long W = q.W, tk = q.tk, el = q.el;
  // units: about `target` in all, at most 4,096 positions each.  Measured at 512 tokens
  // (docs/perf/schedule.md): fewer blocks make the exchange cheaper, more make each block's chain
  // shorter; 8 W blocks up to EP8, 128 above.
  const long long target = W <= 8 ? 8 * W : kMaxBlocks;
  q.rr = a->layout == MOE_LAYOUT_ROUNDROBIN;
  q.nc = tk < MOE_SCHED_THREADS ? tk : MOE_SCHED_THREADS;
  q.rp = q.rr ? pow2_ceil((tk + MOE_SCHED_THREADS - 1) / MOE_SCHED_THREADS) : 1;
  const long long per_rank = q.rr ? pow2_ceil(q.nc) * q.rp : pow2_ceil(tk); // positions
  long long bpr = 1;
  while (W * bpr * 2 <= target && bpr * 2 <= per_rank / q.rp) bpr *= 2;
  while (per_rank / bpr > (long long)kThreads * kMaxSlots && W * bpr * 2 <= kMaxBlocks) bpr *= 2;
  q.bpr = bpr;
  q.np = per_rank / bpr, q.nwp = q.np >= 32 ? q.np / 32 : 1;
  q.wp = W < 4 ? 4 : pow2_ceil(W), q.hs = pow2_ceil(el + 2);
  const char *why = NULL;
  if (tk == 0) why = "a rank without routes";
  else if (el > 32 * kMaxPer) why = "more than 128 experts a rank";
  else if (W * bpr > kMaxBlocks) why = "more than 128 units";
  else if (q.np > (long long)kThreads * kMaxSlots) why = "more than 4,096 positions a unit";
  else if (el * q.wp > MOE_SCHED_TOT_STRIDE) why = "more than 4,096 (expert, source rank) totals";
  else if (el * q.nwp > kMaxWords) why = "more than 8,192 bitmap words";
  else if (a->capacity > INT_MAX - 65536) why = "a capacity within 2^16 of 2^31"; // 32-bit rows
  else if (W * tk + el * (long long)(a->pad - 1) > INT_MAX - 65536) why = "more than 2^31 - 65536 rows or routes";
  q.why = why;
  return q;
}

} // namespace

// Every block resident at once (the grid barrier), one an SM: the problem's limits, then the device's.
int moeI_schedule_bitmap_fits(moe_ctx *ctx, const moe_schedule_args *a, Fit *fit, char *why, size_t n) {
  const Plan q = plan_of(a);
  *fit = CANNOT;
  if (q.why) {
    snprintf(why, n, "%s", q.why);
    return MOE_OK;
  }
  int nsm, rc = moeI_cuda_coop_sms(ctx, a->ids->device.index, &nsm);
  if (rc) return rc;
  const long long g = q.W * q.bpr;
  if (g > nsm) {
    snprintf(why, n, "cuda:%d cannot hold %lld cooperative blocks", a->ids->device.index, g);
    return MOE_OK;
  }
  *fit = TAKES;
  return MOE_OK;
}

int moeI_schedule_bitmap_run(moe_ctx *ctx, const moe_schedule_args *a) {
  const int device = a->ids->device.index;
  const Plan q = plan_of(a);
  const long long W = q.W, el = q.el, bpr = q.bpr, np = q.np, nwp = q.nwp, wp = q.wp, hs = q.hs, rp = q.rp;
  const bool rr = q.rr;

  Params P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  P.trace = ctx->schedule_trace;
  P.lghs = log2_exact(hs);
  P.lgbpr = log2_exact(bpr);
  P.np = (int)np;
  const int slots = (int)((np + kThreads - 1) / kThreads), lgs = log2_exact(slots);
  void (*kernel)(const Params) = lgs == 0   ? schedule_bitmap_kernel<1>
                                 : lgs == 1 ? schedule_bitmap_kernel<2>
                                 : lgs == 2 ? schedule_bitmap_kernel<4>
                                            : schedule_bitmap_kernel<8>;
  P.nc = rr ? (int)q.nc : INT_MAX;
  P.lgrp = log2_exact(rp);
  P.lgnlt = rr ? log2_exact(np / rp) : 31;
  P.ltmask = rr ? (int)(np / rp) - 1 : -1;
  P.mstride = rr ? MOE_SCHED_THREADS : 0;
  P.lgnwp = log2_exact(nwp);
  // words a thread: one pass over the bitmap where 8 words a thread allow it (lanes of a row <= 32)
  long long wpt = nwp > 32 ? nwp / 32 : 1;
  while (wpt < kMaxWpt && wpt < nwp && el * (nwp / wpt) > kThreads) wpt *= 2;
  P.wpt = (int)wpt;
  P.lglpr = log2_exact(nwp / P.wpt);
  P.passes = (int)(((el << P.lglpr) + kThreads - 1) / kThreads);
  P.lgwp = log2_exact(wp);
  P.lgper = log2_exact(pow2_ceil((el + 31) / 32));
  P.lgtpr = log2_exact(pow2_ceil((W + 3) / 4));
  if (P.lgtpr > 5) P.lgtpr = 5;
  P.inv_pad = 1.0f / (float)P.pad;
  P.L = smem_layout((int)(el * nwp), P.el, (int)wp, (int)np);
  const size_t smem = sizeof(int) * (size_t)P.L.total;
  const int g = (int)(W * bpr);

  cudaStream_t st;
  int rc = moeI_cuda_ctx_stream(ctx, device, &st);
  if (rc) return rc;
  if (smem > 48 * 1024 && (rc = moeI_cuda_raise_smem(ctx, STAGE, (const void *)kernel, raised[lgs], device))) return rc;

  // scratch: the header (barrier, totals), then hist [G][hs]
  const size_t nbytes = MOE_SCRATCH_HEADER + sizeof(int32_t) * (size_t)g * hs;
  void *scratch;
  int owned;
  if ((rc = moeI_cuda_scratch_get(ctx, device, st, nbytes, &scratch, &owned))) return rc;
  P.bar = (unsigned *)scratch;
  P.tot = (int32_t *)scratch + MOE_SCHED_TOT_OFFSET;
  P.hist = (int32_t *)((char *)scratch + MOE_SCRATCH_HEADER);

  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[2], coop = {};
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  schedule_launch_config(&cfg, attr, (unsigned)g, kThreads, smem, st, coop);
  trace_grid = g;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, P);
  rc = moeI_cuda_scratch_done(ctx, st, scratch, owned); // whether or not the launch went (in a capture, a free node)
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, STAGE ": cudaLaunchKernelEx(schedule_bitmap_kernel) failed at %s:%d: %s: %s",
                      __FILE__, __LINE__, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  if (rc) return rc;
  return moeI_ok(ctx);
}

// The phase times of the last bitmap call made with the context's trace switch on: trace_buf's rows (copy_trace).
extern "C" int moeI_schedule_bitmap_trace(long long *out, int max_blocks) {
  return copy_trace(out, trace_buf, trace_grid, max_blocks);
}
