// schedule.cu -- stage 2 on the GPU: every rank's ids i32 [W, T, K] -> this rank's expert-major
// row layout, bit for bit the result of schedule_cpu (lib/schedule.c) for both layouts.
//
// The problem.  A route's row depends on its ordinal j inside its (local expert e, source rank p)
// group, which counts earlier routes in an order the layout fixes ("roundrobin": logical thread
// th = i mod 1024 first, then i; "peer_major": i), and on the totals c[e][q] of every source rank.
// Both kernels read the routes of one source rank as a grid: route i = m * stride + c, "column"
// c and "row" m, where roundrobin has 1024 columns (the logical threads) and stride 1024, and
// peer_major a single column (stride 1).  In both, the order of j is column-major (column by
// column, rows ascending inside a column).  A chunk is a run of that order -- a power-of-two group
// of columns for roundrobin, a run of rows for peer_major -- and each source rank is cut into S
// chunks, one block of each kernel per (source rank, chunk), about one block per SM in all.
//
//   count (grid W*S): histogram of the chunk's routes per local expert in shared memory (warp-
//     aggregated atomics: only the sum matters), written to scratch hist[p][s][e]; invalid ids
//     counted, with the least flat index.  The last block to finish (a ticket in scratch that it
//     resets to 0) turns hist into an exclusive prefix over chunks in place, forms the totals
//     c[e][q], and writes everything that depends on counts alone: n_e, padded sizes, base by a
//     block scan, counts (routes kept), tokens_per_expert, expert_offsets (clamped to C), stats.
//   place (grid W*S, launched with programmatic dependent launch, so it starts while count runs):
//     before waiting on count, it loads the chunk into shared memory in column-major order (rows
//     padded to an odd length, so both the transposing store and the ordered reads are free of
//     bank conflicts) and ranks it: each warp takes a contiguous run of the order, 32 routes a step,
//     groups equal experts of a step with log2(EL) ballots, and keeps a running count per expert
//     in its own shared-memory row; an exclusive scan over the warps' rows then orders the warps.
//     No atomics decide any order.  After the wait, j = prefix of earlier chunks + earlier warps
//     + rank in the warp; roundrobin's position is sum_q min(c[e][q], j) + #{q < p : c[e][q] > j}
//     (c of the expert staged in shared memory), peer_major's is sum_{q<p} c[e][q] + j.  A route
//     with position < counts[e] goes to row expert_offsets[e] + position: peer_rank and peer_route
//     written there, its row kept in shared memory, and route_row is then written for the whole
//     chunk in memory order (coalesced; -1 for routes elsewhere, masked, invalid or dropped).
//     The block also writes -1 into the padding rows of the experts it owns (e = block mod the
//     grid) and, striding with all blocks, into the unused rows [rows used, C).
//
// So every output element is written exactly once, rows >= C never, nothing is cleared first,
// the host never waits, and the work is two launches.  Kimi K2 rank of EP8 (W 8, T 7168, K 8,
// E 384): 128 blocks of 3,584 routes (64 logical threads x 56); ids read once by each kernel
// (1.8 MB, the second time from L2), route_row written once (1.8 MB), peer_rank/peer_route
// ~0.5 MB, scratch ~30 KB: about 4 MB of DRAM traffic, so the time is the two launches and a few
// L2 round trips (count: ids, ticket, the last block's prefix; place: its staging), ~5-8 us.
//
// Scratch (ticket, per-block invalid counts, hist, c) is the context's (cuda_scratch_get): kept
// across calls, so a call allocates nothing; inside a graph capture without a large enough block
// it is a stream-ordered allocation that becomes the graph's own.
//
// Limits, none of them on the values: a chunk larger than the shared-memory tile is placed in
// pieces (a running count per expert carries over, kept in scratch); more local experts than a
// window (1,024 for ranking, 12,288 for counting) are handled a window at a time; c[e][q] is read
// from global memory when a window's worth does not fit in shared memory.  These only cost time.
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include <atomic>

#include "schedule.cuh"

#define STAGE "schedule"

namespace {

constexpr int kThreads = 512;             // both kernels
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;                // loads in flight per thread
constexpr int kTile = 8192;               // routes of one piece in shared memory (even)
constexpr int kRankWindow = 1024;         // local experts ranked in one pass
constexpr int kHistWindow = 12288;        // local experts counted in one pass (48 KB)
constexpr int kStageC = 4096;             // c[e][q] values staged in shared memory per window
constexpr int kMaxScratchHist = 1 << 18;  // S * E bound, so that the prefix stays small
constexpr int kMaxPlaceSmem =
    (2 * kTile + (kWarps + 5) * kRankWindow + 1 + kStageC) * (int)sizeof(int32_t);

struct Params {
  const int32_t *ids;
  int32_t *peer_rank, *peer_route, *counts, *tpe, *offsets, *route_row, *stats;
  int32_t *ticket, *inv, *hist, *ctot; // scratch: [1], [W*S][2], [W*S][EL], [EL][W]
  int tk, world, experts, el, lo;
  int pad, capacity, expert_capacity;
  int roundrobin;
  // route i = m * stride + c; nc columns, nr rows
  int nc, nr, stride;
  // chunk s covers 2^lgcw columns from s * cstep and rw rows from s * rstep
  int chunks, lgcw, rw, cstep, rstep;
  // pieces of a chunk: 2^lgpw columns of pr rows, slots (column, row) -> column * prp + row
  int lgpw, pr, prp, ncp, nrp;
  unsigned long long magic; // ceil(2^32 / prp): slot / prp without a division
  int hwin, rwin, stage_c;
  int group; // lanes per expert when summing over source ranks: pow2_ceil(min(W, 32))
};

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Lanes of the warp whose key equals this lane's, among the lanes in act; keys < 2^nbits.
__device__ __forceinline__ unsigned match_peers(unsigned key, unsigned act, int nbits) {
  unsigned peers = act;
  for (int b = 0; b < nbits; b++) {
    const bool one = (key >> b) & 1u;
    const unsigned set = __ballot_sync(MOE_FULL_MASK, one);
    peers &= one ? set : ~set;
  }
  return peers;
}

__device__ __forceinline__ int window_bits(int wsz) { return wsz > 1 ? 32 - __clz(wsz - 1) : 0; }

// ---- the last block of the count kernel: prefix over chunks, totals, segments, stats ----
// raw is the block's shared memory (room for hwin experts): n_e before expert_capacity is summed
// there when EL fits, so that the scan below needs no further round trip to L2.
__device__ void finish_counts(const Params &P, int32_t *raw) {
  __shared__ long long shl[32];
  __shared__ int shi[32];
  const int tid = threadIdx.x, W = P.world, S = P.chunks, EL = P.el;
  const bool in_smem = EL <= P.hwin;

  // the invalid ids of every block, loaded now and summed later, to overlap the round trips
  int ninv = 0, first = INT_MAX;
  for (int b = tid; b < W * S; b += kThreads) {
    ninv += __ldcg(P.inv + 2 * (size_t)b);
    first = min(first, __ldcg(P.inv + 2 * (size_t)b + 1));
  }
  if (in_smem) {
    for (int e = tid; e < EL; e += kThreads) raw[e] = 0;
    __syncthreads();
  }

  // hist[q][s][e] -> exclusive prefix over s, in place; c[e][q] = the total.  Loads of 8 chunks
  // are issued before any store, so this is a round trip per 8 chunks, not per chunk.
  for (int pe = tid; pe < W * EL; pe += kThreads) {
    const int q = pe / EL, e = pe - q * EL;
    int32_t *h = P.hist + (size_t)q * S * EL + e;
    int acc = 0;
    for (int s0 = 0; s0 < S; s0 += 8) {
      int v[8];
#pragma unroll
      for (int u = 0; u < 8; u++) v[u] = s0 + u < S ? __ldcg(h + (size_t)(s0 + u) * EL) : 0;
#pragma unroll
      for (int u = 0; u < 8; u++)
        if (s0 + u < S) {
          __stcg(h + (size_t)(s0 + u) * EL, acc);
          acc += v[u];
        }
    }
    __stcg(P.ctot + (size_t)e * W + q, acc);
    if (in_smem) atomicAdd(&raw[e], acc);
  }
  ninv = block_sum(ninv, shi); // its barriers also publish ctot and raw to the whole block
  first = block_min(first, shi);

  int32_t *counts = P.counts;
  if (!in_smem) { // n_e parked in counts until the scan below replaces it
    sum_over_ranks(P.ctot, W, W, EL, P.group, [counts](int e, int v) { __stcg(counts + e, v); });
    __syncthreads();
  }

  long long carry = 0;
  int dropped = 0;
  for (int e0 = 0; e0 < EL; e0 += kThreads) {
    const int e = e0 + tid;
    const int rawe = e >= EL ? 0 : in_smem ? raw[e] : __ldcg(counts + e);
    const int n = segment_routes(rawe, P.expert_capacity);
    const long long padded = e < EL ? segment_padded(n, P.pad) : 0;
    long long total;
    const long long base = carry + block_exclusive_scan(padded, &total, shl);
    carry += total;
    if (e < EL) {
      const long long cap = P.capacity;
      const int kept = segment_kept(n, base, P.capacity);
      const int off = (int)(base < cap ? base : cap);
      const int end = (int)(base + padded < cap ? base + padded : cap);
      P.counts[e] = kept;
      P.offsets[e] = off;
      P.tpe[e] = end - off;
      dropped += rawe - kept;
    }
  }
  dropped = block_sum(dropped, shi);
  if (tid == 0) {
    const long long cap = P.capacity;
    P.offsets[EL] = (int)(carry < cap ? carry : cap);
    P.stats[MOE_STAT_ROWS_NEEDED] = (int)(carry < INT_MAX ? carry : INT_MAX);
    P.stats[MOE_STAT_ROWS_USED] = (int)(carry < cap ? carry : cap);
    P.stats[MOE_STAT_DROPPED] = dropped;
    P.stats[MOE_STAT_INVALID] = ninv;
    P.stats[MOE_STAT_FIRST_INVALID] = ninv ? first : -1;
    *P.ticket = 0; // the next call starts from zero again
  }
}

__global__ void __launch_bounds__(kThreads, 2) schedule_count(const Params P) {
  griddep_launch_dependents(); // let the place kernel's blocks load and rank meanwhile
  extern __shared__ int32_t hist[];
  __shared__ int shi[32];
  __shared__ int last;
  const int tid = threadIdx.x, lane = tid & 31;
  const int blk = blockIdx.x, p = blk / P.chunks, s = blk - p * P.chunks;
  const int cw = 1 << P.lgcw, ca = s * P.cstep, ma = s * P.rstep;
  const int nel = cw * P.rw;
  const int32_t *ids = P.ids + (size_t)p * P.tk;

  int ninv = 0, first = INT_MAX;
  for (int w0 = 0; w0 < P.el; w0 += P.hwin) {
    const int wsz = min(P.hwin, P.el - w0), nbits = window_bits(wsz);
    const unsigned lo = (unsigned)(P.lo + w0);
    for (int e = tid; e < wsz; e += kThreads) hist[e] = 0;
    __syncthreads();
    for (int x0 = 0; x0 < nel; x0 += kThreads * kUnroll) {
      int v[kUnroll], at[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int x = x0 + u * kThreads + tid;
        const int c = ca + (x & (cw - 1)), m = ma + (x >> P.lgcw);
        const bool ok = x < nel && c < P.nc && m < P.nr && m * P.stride + c < P.tk;
        at[u] = m * P.stride + c;
        v[u] = ok ? __ldg(ids + at[u]) : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        if (w0 == 0 && v[u] != -1 && (v[u] < 0 || v[u] >= P.experts)) {
          ninv++;
          first = min(first, p * P.tk + at[u]);
        }
        const unsigned e = (unsigned)v[u] - lo;
        const bool loc = e < (unsigned)wsz;
        const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
        if (act) {
          const unsigned peers = match_peers(e, act, nbits);
          if (loc && lane == 31 - __clz(peers)) atomicAdd(&hist[e], __popc(peers));
        }
      }
    }
    __syncthreads();
    int32_t *out = P.hist + (size_t)blk * P.el + w0;
    for (int e = tid; e < wsz; e += kThreads) out[e] = hist[e];
    __syncthreads();
  }
  ninv = block_sum(ninv, shi);
  first = block_min(first, shi);
  if (tid == 0) {
    P.inv[2 * (size_t)blk] = ninv;
    P.inv[2 * (size_t)blk + 1] = first;
    __threadfence(); // this block's hist and inv before its ticket
    last = atomicAdd(P.ticket, 1) == (int)gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (last) finish_counts(P, hist);
}

// ---- place ----

__global__ void __launch_bounds__(kThreads, 2) schedule_place(const Params P) {
  extern __shared__ int32_t sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = P.world, EL = P.el, blk = blockIdx.x, nblk = gridDim.x;
  const int p = blk / P.chunks, s = blk - p * P.chunks;
  const int ca = s * P.cstep, ma = s * P.rstep;
  const int pw = 1 << P.lgpw, ts = pw * P.prp;
  int32_t *tile = sm;                          // ids of the piece, column-major, -1 in the gaps
  int32_t *srow = tile + ts;                   // rank in the warp, then row (or -1)
  int32_t *cnt = srow + ts;                    // [kWarps + 1][wsz]: per-warp counts -> offsets; totals
  int32_t *run = cnt + (kWarps + 1) * P.rwin;  // j of the first route of the piece, per expert
  int32_t *lim = run + P.rwin;                 // counts: positions kept
  int32_t *cpre = lim + P.rwin;                // peer_major: sum_{q<p} c[e][q]
  int32_t *off = cpre + P.rwin;                // expert_offsets, one past the window too
  int32_t *cst = off + P.rwin + 1;             // roundrobin: c[e][q] of the window, when staged
  const int q = (((ts + kWarps - 1) / kWarps) + 31) & ~31;
  const int seg0 = min(warp * q, ts), seg1 = min(seg0 + q, ts);
  const int32_t *ids = P.ids + (size_t)p * P.tk;
  int32_t *rrow = P.route_row + (size_t)p * P.tk;
  const int npieces = P.ncp * P.nrp;
  const int row_end = ma + P.rw; // rows of this chunk (peer_major chunks are row runs)
  bool waited = false;

  for (int k = 0; k < npieces; k++) {
    const int cp = k / P.nrp, rp = k - cp * P.nrp;
    const int pa = ca + cp * pw, qa = ma + rp * P.pr;

    // load: lanes along columns (memory order), slots column-major with odd row pitch
    for (int x0 = 0; x0 < ts; x0 += kThreads * kUnroll) {
      int v[kUnroll], slot[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int x = x0 + u * kThreads + tid;
        const int mm = x >> P.lgpw, cc = x & (pw - 1);
        const int c = pa + cc, m = qa + mm;
        const bool ok = x < ts && mm < P.pr && m < row_end && c < P.nc && m < P.nr && m * P.stride + c < P.tk;
        slot[u] = x < ts ? cc * P.prp + mm : -1;
        v[u] = ok ? __ldg(ids + m * P.stride + c) : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; u++)
        if (slot[u] >= 0) {
          tile[slot[u]] = v[u];
          srow[slot[u]] = -1;
        }
    }
    __syncthreads();

    for (int w0 = 0; w0 < EL; w0 += P.rwin) {
      const int wsz = min(P.rwin, EL - w0), nbits = window_bits(wsz);
      const unsigned lo = (unsigned)(P.lo + w0);
      int32_t *mine = cnt + warp * wsz;

      // rank: each warp over its run of the order, 32 routes a step
      for (int e = lane; e < wsz; e += 32) mine[e] = 0;
      __syncwarp();
      for (int b = seg0; b < seg1; b += 32) {
        const int sl = b + lane;
        const unsigned e = (unsigned)(sl < seg1 ? tile[sl] : -1) - lo;
        const bool loc = e < (unsigned)wsz;
        const unsigned act = __ballot_sync(MOE_FULL_MASK, loc);
        if (!act) continue;
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
      // order the warps: exclusive scan over the warps' counts, totals in row kWarps
      for (int e = tid; e < wsz; e += kThreads) {
        int acc = 0;
        for (int w = 0; w < kWarps; w++) {
          const int t = cnt[w * wsz + e];
          cnt[w * wsz + e] = acc;
          acc += t;
        }
        cnt[kWarps * wsz + e] = acc;
      }

      int used = 0;
      if (!waited) { // count has finished: prefixes, totals, offsets, counts are in memory
        griddep_wait();
        used = __ldcg(P.offsets + EL);
      }

      // stage the window
      for (int e = tid; e <= wsz; e += kThreads) {
        off[e] = __ldcg(P.offsets + w0 + e);
        if (e == wsz) break;
        run[e] = __ldcg(P.hist + (size_t)blk * EL + w0 + e);
        lim[e] = __ldcg(P.counts + w0 + e);
      }
      if (!P.roundrobin)
        sum_over_ranks(P.ctot + (size_t)w0 * W, W, p, wsz, P.group, [cpre](int e, int v) { cpre[e] = v; });
      const int32_t *cw = P.ctot + (size_t)w0 * W;
      if (P.stage_c) {
        for (int x = tid; x < wsz * W; x += kThreads) cst[x] = __ldcg(cw + x);
        cw = cst;
      }
      __syncthreads();

      if (!waited) { // unused rows [rows used, C): every block, striding
        waited = true;
        for (long long r = used + (long long)blk * kThreads + tid; r < P.capacity; r += (long long)nblk * kThreads) {
          P.peer_rank[r] = -1;
          P.peer_route[r] = -1;
        }
      }
      // padding rows of the experts this block owns, on the first piece only
      if (k == 0)
        for (int e = (blk - w0 % nblk + nblk) % nblk; e < wsz; e += nblk) {
          for (int r = off[e] + lim[e] + tid; r < off[e + 1]; r += kThreads) {
            P.peer_rank[r] = -1;
            P.peer_route[r] = -1;
          }
        }

      // place
      for (int sl = seg0 + lane; sl < seg1; sl += 32) {
        const unsigned e = (unsigned)tile[sl] - lo;
        if (e >= (unsigned)wsz) continue;
        const int j = run[e] + cnt[warp * wsz + e] + srow[sl];
        const int pos = !P.roundrobin ? cpre[e] + j
                        : P.stage_c   ? roundrobin_position<false>(cw + (size_t)e * W, W, p, j)
                                      : roundrobin_position<true>(cw + (size_t)e * W, W, p, j);
        int row = -1;
        if (pos < lim[e]) {
          row = off[e] + pos;
          const int cc = (int)(((unsigned long long)sl * P.magic) >> 32), mm = sl - cc * P.prp;
          P.peer_rank[row] = p;
          P.peer_route[row] = (qa + mm) * P.stride + pa + cc;
        }
        srow[sl] = row;
      }
      __syncthreads();
      if (k + 1 < npieces) { // carry the running ordinals to the next piece
        for (int e = tid; e < wsz; e += kThreads)
          __stcg(P.hist + (size_t)blk * EL + w0 + e, run[e] + cnt[kWarps * wsz + e]);
        __syncthreads();
      }
    }

    // route_row of the piece, in memory order
    for (int x = tid; x < pw * P.pr; x += kThreads) {
      const int mm = x >> P.lgpw, cc = x & (pw - 1);
      const int c = pa + cc, m = qa + mm;
      if (m < row_end && c < P.nc && m < P.nr && m * P.stride + c < P.tk) rrow[m * P.stride + c] = srow[cc * P.prp + mm];
    }
    __syncthreads();
  }
}

// ---- host ----

int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}
int log2_exact(int x) {
  int l = 0;
  while ((1 << l) < x) l++;
  return l;
}

std::atomic<int> sm_count_cache[64];
std::atomic<bool> place_smem_raised[64];

int sm_count(moe_ctx *ctx, int device, int *out) {
  if (device >= 0 && device < 64 && (*out = sm_count_cache[device].load(std::memory_order_relaxed)) > 0) return MOE_OK;
  MOE_CUDA_TRY(ctx, STAGE, cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) sm_count_cache[device].store(*out, std::memory_order_relaxed);
  return MOE_OK;
}

// A retired scratch block: graphs captured before it was replaced may still use it.
struct old_block {
  void *p;
  int device;
  old_block *next;
};

} // namespace

extern "C" int cuda_scratch_get(moe_ctx *ctx, int device, void *stream, size_t nbytes, void **out, int *owned) {
  *out = NULL;
  *owned = 0;
  if (nbytes < MOE_SCRATCH_HEADER) nbytes = MOE_SCRATCH_HEADER;
  const cudaStream_t st = (cudaStream_t)stream;
  if (ctx->scratch && ctx->scratch_device == device && ctx->scratch_stream == stream && ctx->scratch_bytes >= nbytes) {
    *out = ctx->scratch;
    return MOE_OK;
  }
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  MOE_CUDA_TRY(ctx, "scratch", cudaStreamIsCapturing(st, &cs));
  if (ctx->capturing || cs != cudaStreamCaptureStatusNone) {
    // cudaMalloc is not allowed here; a stream-ordered allocation becomes the graph's own memory
    void *p = NULL;
    const cudaError_t err = cudaMallocAsync(&p, nbytes, st);
    if (err != cudaSuccess)
      return moe_seterr(ctx, err == cudaErrorMemoryAllocation ? MOE_ERR_NOMEM : MOE_ERR_CUDA,
                        "scratch: cudaMallocAsync of %zu bytes failed: %s: %s", nbytes, cudaGetErrorName(err),
                        cudaGetErrorString(err));
    MOE_CUDA_TRY(ctx, "scratch", cudaMemsetAsync(p, 0, MOE_SCRATCH_HEADER, st));
    *out = p;
    *owned = 1;
    return MOE_OK;
  }
  // Replace the block without freeing it: work queued on it (on another stream, or in graphs
  // captured earlier) may still run.  Sizes grow geometrically so that replacements stay few.
  size_t size = ctx->scratch_bytes * 2;
  if (size < nbytes) size = nbytes;
  if (size < ((size_t)1 << 20)) size = (size_t)1 << 20;
  old_block *ob = NULL;
  if (ctx->scratch) {
    ob = (old_block *)malloc(sizeof *ob);
    if (!ob) return moe_seterr(ctx, MOE_ERR_NOMEM, "scratch: out of host memory");
  }
  void *p = NULL;
  const cudaError_t err = cudaMalloc(&p, size);
  if (err != cudaSuccess) {
    free(ob);
    (void)cudaGetLastError();
    return moe_seterr(ctx, err == cudaErrorMemoryAllocation ? MOE_ERR_NOMEM : MOE_ERR_CUDA,
                      "scratch: cudaMalloc of %zu bytes failed: %s: %s", size, cudaGetErrorName(err),
                      cudaGetErrorString(err));
  }
  if (ob) {
    ob->p = ctx->scratch;
    ob->device = ctx->scratch_device;
    ob->next = (old_block *)ctx->scratch_old;
    ctx->scratch_old = ob;
  }
  ctx->scratch = p;
  ctx->scratch_bytes = size;
  ctx->scratch_device = device;
  ctx->scratch_stream = stream;
  MOE_CUDA_TRY(ctx, "scratch", cudaMemsetAsync(p, 0, MOE_SCRATCH_HEADER, st));
  *out = p;
  return MOE_OK;
}

extern "C" int cuda_scratch_done(moe_ctx *ctx, void *stream, void *p, int owned) {
  if (owned) MOE_CUDA_TRY(ctx, "scratch", cudaFreeAsync(p, (cudaStream_t)stream));
  return MOE_OK;
}

extern "C" void cuda_scratch_release(moe_ctx *ctx) {
  if (ctx->scratch) cuda_free(ctx->scratch_device, ctx->scratch);
  for (old_block *ob = (old_block *)ctx->scratch_old; ob;) {
    old_block *next = ob->next;
    cuda_free(ob->device, ob->p);
    free(ob);
    ob = next;
  }
  ctx->scratch = NULL;
  ctx->scratch_old = NULL;
  ctx->scratch_bytes = 0;
}

extern "C" int schedule_cuda(moe_ctx *ctx, const moe_schedule_args *a) {
  const int device = a->ids->device.index;
  cudaStream_t st;
  int rc = cuda_ctx_stream(ctx, device, &st);
  if (rc) return rc;
  int nsm;
  if ((rc = sm_count(ctx, device, &nsm))) return rc;

  Params P = {};
  const int W = (int)a->ids->shape[0];
  const int tk = (int)(a->ids->shape[1] * a->ids->shape[2]);
  P.ids = (const int32_t *)a->ids->data;
  P.peer_rank = (int32_t *)a->peer_rank->data;
  P.peer_route = (int32_t *)a->peer_route->data;
  P.counts = (int32_t *)a->counts->data;
  P.tpe = (int32_t *)a->tokens_per_expert->data;
  P.offsets = (int32_t *)a->expert_offsets->data;
  P.route_row = (int32_t *)a->route_row->data;
  P.stats = (int32_t *)a->stats->data;
  P.tk = tk;
  P.world = W;
  P.experts = a->experts;
  P.el = a->experts / W;
  P.lo = a->rank * P.el;
  P.pad = a->pad;
  P.capacity = a->capacity;
  P.expert_capacity = a->expert_capacity;
  P.roundrobin = a->layout == MOE_LAYOUT_ROUNDROBIN;

  // chunks: about one block per SM over all source ranks, fewer when E is large (the prefix
  // over chunks costs S * E)
  int per_rank = cdiv(nsm, W);
  const int by_experts = kMaxScratchHist / a->experts;
  if (per_rank > by_experts) per_rank = by_experts > 1 ? by_experts : 1;
  int cw, rw;
  if (P.roundrobin) {
    P.nc = tk < MOE_SCHED_THREADS ? tk : MOE_SCHED_THREADS;
    P.nr = cdiv(tk, MOE_SCHED_THREADS);
    P.stride = MOE_SCHED_THREADS;
    if (P.nc == 0) {
      cw = 1;
      P.chunks = 1;
    } else {
      cw = pow2_ceil(cdiv(P.nc, per_rank));
      const int coalesced = pow2_ceil(P.nc) < 32 ? pow2_ceil(P.nc) : 32;
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

  // pieces: whole chunk, groups of whole columns, or runs of rows of one column
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
  P.hwin = P.el < kHistWindow ? P.el : kHistWindow;
  P.rwin = P.el < kRankWindow ? P.el : kRankWindow;
  P.stage_c = P.roundrobin && (long long)P.rwin * W <= kStageC;
  P.group = pow2_ceil(W < 32 ? W : 32);

  // scratch: header (ticket), inv [W*S][2], hist [W*S][EL], c [EL][W]
  const size_t blocks = (size_t)W * P.chunks;
  const size_t nbytes = MOE_SCRATCH_HEADER + sizeof(int32_t) * (2 * blocks + blocks * P.el + (size_t)a->experts);
  if (blocks > INT_MAX) return moe_seterr(ctx, MOE_ERR_ARG, STAGE ": %zu blocks is too many", blocks);
  void *scratch;
  int owned;
  if ((rc = cuda_scratch_get(ctx, device, st, nbytes, &scratch, &owned))) return rc;
  P.ticket = (int32_t *)scratch;
  P.inv = (int32_t *)((char *)scratch + MOE_SCRATCH_HEADER);
  P.hist = P.inv + 2 * blocks;
  P.ctot = P.hist + blocks * P.el;

  const size_t place_smem =
      sizeof(int32_t) * ((size_t)2 * pw * P.prp + (size_t)(kWarps + 5) * P.rwin + 1 + (P.stage_c ? (size_t)P.rwin * W : 0));
  if (place_smem > 48 * 1024 && !(device >= 0 && device < 64 && place_smem_raised[device].load())) {
    MOE_CUDA_TRY(ctx, STAGE, cudaFuncSetAttribute(schedule_place, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxPlaceSmem));
    if (device >= 0 && device < 64) place_smem_raised[device].store(true);
  }

  schedule_count<<<(unsigned)blocks, kThreads, sizeof(int32_t) * P.hwin, st>>>(P);
  MOE_CUDA_LAUNCHED(ctx, STAGE);

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = place_smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOE_CUDA_TRY(ctx, STAGE, cudaLaunchKernelEx(&cfg, schedule_place, P));

  if ((rc = cuda_scratch_done(ctx, st, scratch, owned))) return rc;
  return moe_ok(ctx);
}
