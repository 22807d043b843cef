// schedule_cluster.cu -- the scheduler for small problems (decode: a few thousand routes a rank),
// bit for bit the result of moeI_schedule_cpu, in one thread-block cluster: no grid barrier, no
// global scratch, nothing carried between calls.
//
// Why a second kernel.  The grid kernel (schedule.cu) spreads every source rank over ~128 blocks
// and exchanges histograms between all of them; at 512 tokens that exchange alone (REDs, the grid
// barrier, reading totals and earlier chunks' counts back through L2) is ~2 us of a ~8.4 us call
// (PERF.md, "The floor under a call").  Here a block owns whole source ranks, so a route's
// ordinal j inside its (expert, source rank) group never leaves the block, and the only thing
// exchanged is c[e][q] -- E integers in all -- through distributed shared memory after one
// cluster barrier.
//
// One cluster of G <= 16 blocks of 1024 threads; block b owns source ranks [b rpb, b rpb + rpb).
// Thread t walks, for each of them, the slots a logical thread t of the layout owns in order:
// "roundrobin" slots t, t + 1024, ... (so thread order is the order of j), "peer_major" the run
// [t R, t R + R) (R = slots a thread per rank).  Then:
//   1. load the ids; a route to another rank, masked or invalid gets route_row -1 at once, and the
//      invalid ones are counted (with the first one's flat index);
//   2. compact the local routes into a list in thread order (one block scan of the per-thread
//      counts): at EP8 seven routes in eight drop out here;
//   3. rank the list: each warp takes a contiguous run, groups equal keys (source rank, expert)
//      with log2(keys) ballots, keeps a running count per key in its own shared row; the rows,
//      scanned over the warps, give every route its j and the block its c[e][p];
//   4. cluster barrier; every block reads all c[e][q] from their owners' shared memory and forms
//      n_e, the padded sizes and the bases (warp 0 scans them; every block the same, redundantly);
//   5. place: roundrobin row base + sum_q min(c[e][q], j) + #{q < p : c[e][q] > j}, peer_major
//      base + sum_{q<p} c[e][q] + j; under the kept count the route gets its row, past it
//      route_row -1.  The rows used are cut into G shares; a route's (p, i) goes into the shared
//      memory of the block that owns its row (prefilled with -1, which the padding rows keep), and
//      after a second cluster barrier -- also the last access to another block's shared memory --
//      each block writes its share of peer_rank and peer_route in order: scattered global stores
//      from a few SMs were what the placement cost before (PERF.md).  Where a share does not fit
//      (a large pad or capacity), routes are stored in place and block b fills the padding rows of
//      experts e = b mod G.  Each block fills its share of the unused rows [rows used, C); block 0
//      writes counts, tokens_per_expert, expert_offsets and stats.
// No atomics decide an order (shared atomics only sum the invalid ids, and the list is ordered by a
// scan); the host never waits.  Launched as a programmatic dependent, like the grid kernel.
//
// Where it applies (moeI_schedule_cluster_cuda decides, the grid kernel takes the rest): at most 16
// slots a thread (tk <= 16,384; W <= 16 * 16 / R), at most 512 (source rank, expert) keys a block,
// E <= 4,096 (c[e][q] of all ranks in every block's shared memory), C < 2^31 - 2^16 (its row
// arithmetic is 32-bit), and the device can place a cluster of G blocks.  By default (where the
// bitmap kernel, asked first, declines: more than 128 experts a rank) it runs where it measured
// ahead of the grid kernel: at most 8 ids a thread and at most 512 local routes a block under
// uniform routing, tk rpb / W (512 tokens of top-8: EP8, EP16, EP32; not EP4, whose four blocks
// each rank 1,024 local routes, nor EP64, whose sixteen each load 64 KB of ids; 128 and 256
// tokens at every EP size from 4 to 64).
// MOE_SCHEDULE_KERNEL=grid or =cluster forces one of the two (a measuring aid, and how the GPU
// test runs both on every case).
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "schedule.cuh"

#define STAGE "schedule"

namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kMaxSlots = 16;       // ids a thread holds in registers
constexpr int kMaxKeys = 512;       // (source rank, local expert) pairs a block ranks
constexpr int kMaxExperts = 4096;   // E: every block stages c[e][q] of all ranks
constexpr int kMaxCluster = 16;     // non-portable; where a device cannot place G blocks, the grid kernel runs
constexpr int kAutoSlots = 8;       // the default up to this many slots a thread
constexpr int kAutoLocal = 512;     // and this many local routes a block, were the routing uniform
constexpr int kMaxStage = 16384;    // rows a block writes out of its shared memory

// Offsets (ints) of the shared arrays; the host sizes the launch with the same function.
struct Smem {
  int misc, list, ord, cnt, kp, ctot, call, wp, raw, off, lim, stage, total;
};
constexpr int up4(int x) { return (x + 3) & ~3; } // 16-byte aligned arrays (filled with int4 stores)
__host__ __device__ inline Smem smem_layout(int slots, int keys, int el, int world, int stage) {
  Smem L;
  L.misc = 0;                   // [0] invalid ids, [1] first invalid, [2] list length, [3] rows of a
                                // block's stage share, [4] unused rows a block fills, [8..40) warp totals
  L.list = 64;                  // the local routes in order: e << 18 | source rank in block << 14 | i
  L.ord = L.list + slots;       // each list entry's ordinal among its key in its warp
  L.kp = keys | 1;              // odd row stride: the scan over warps reads a column conflict-free
  L.cnt = up4(L.ord + slots);   // [kWarps][kp]: per warp and key, counts -> offsets over the warps
  L.ctot = L.cnt + kWarps * L.kp; // c[e][p] of this block's ranks, by key = rank in block * el + e
  L.wp = world | 1;
  L.call = L.ctot + keys;       // c[e][q] of all ranks, [el][wp]
  L.raw = L.call + el * L.wp;   // n_e before expert_capacity
  L.off = L.raw + el;           // min(base[e], C), e = 0..el
  L.lim = L.off + el + 1;       // routes of e that get a row
  L.stage = up4(L.lim + el);    // this block's share of the rows: source rank << 14 | route, or -1
  L.total = L.stage + stage;
  return L;
}

struct Params : ScheduleCall {
  int trace; // record the phases' times (MOE_SCHEDULE_TRACE set): a measuring aid
  int rpb;   // source ranks a block
  int keys;  // rpb * el
  int nbits; // bits of a key: ceil(log2(keys))
  int stage; // ints of each block's share of the rows staged in shared memory (0: none)
  float inv_el, inv_rpb, inv_pad; // 1 / el, 1 / rpb, 1 / pad: quotients without a division
  Smem L;               // the shared-memory layout, computed once on the host
};

// The last traced call, per block: clock64 at the phase points (entry, ids loaded, ranked, past
// the cluster barrier, c[e][q] gathered, segments, placed, end), then %globaltimer at entry and
// end.  Read by moeI_schedule_cluster_trace (the scheduler's GPU test, --trace).
constexpr int kTracePoints = 8;
__device__ long long trace_buf[kMaxCluster][kTracePoints + 2];
int trace_grid;
__device__ __forceinline__ void trace_point(const Params &P, int i) {
  trace_record<true>(trace_buf, P.trace, i);
}

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// The int at the same shared-memory offset as p in block `cta` of the cluster: read or written.
__device__ __forceinline__ int ld_cluster(const int *p, unsigned cta) {
  int v;
  asm volatile("{\n\t.reg .b32 ra;\n\t"
               "mapa.shared::cluster.u32 ra, %1, %2;\n\t"
               "ld.shared::cluster.u32 %0, [ra];\n\t}"
               : "=r"(v)
               : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(cta)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_cluster(int *p, unsigned cta, int v) {
  asm volatile("{\n\t.reg .b32 ra;\n\t"
               "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "st.shared::cluster.u32 [ra], %2;\n\t}" ::"r"((unsigned)__cvta_generic_to_shared(p)),
               "r"(cta), "r"(v)
               : "memory");
}

// kR: slots a thread per source rank (a power of two, >= tk / 1024); kS: slots a thread in all,
// kR times the block's source ranks rounded up to a power of two (the loops over them unrolled:
// instructions are what a block of 1024 threads runs short of)
template <int kR, int kS>
__global__ void __launch_bounds__(kThreads, 1) schedule_cluster_kernel(const Params P) {
  extern __shared__ int4 smem4[];
  int *sm = (int *)smem4;
  const Smem &L = P.L;
  int *misc = sm + L.misc, *list = sm + L.list, *ord = sm + L.ord, *cnt = sm + L.cnt, *ctot = sm + L.ctot;
  int *call = sm + L.call, *raw = sm + L.raw, *off = sm + L.off, *lim = sm + L.lim, *stage = sm + L.stage;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, b = blockIdx.x, G = gridDim.x;
  const int p0 = b * P.rpb, nr = min(P.rpb, P.world - p0), el = P.el, tk = P.tk;

  asm volatile("griddepcontrol.wait;" ::: "memory");
  trace_point(P, 0);

  // 1. ids (every slot in flight at once)
  int v[kS];
  unsigned here = 0;
#pragma unroll
  for (int s = 0; s < kS; s++) {
    const int pl = s / kR, r = s % kR;
    const int i = P.roundrobin ? r * kThreads + t : t * kR + r;
    v[s] = -1;
    if (pl < nr && i < tk) {
      here |= 1u << s;
      v[s] = __ldg(P.ids + (size_t)(p0 + pl) * tk + i);
    }
  }
  asm volatile("griddepcontrol.launch_dependents;");
  for (int k = t; k < kWarps * L.kp / 4 + 1; k += kThreads) ((int4 *)cnt)[k] = make_int4(0, 0, 0, 0);
  for (int k = t; k < P.stage / 4 + 1; k += kThreads) ((int4 *)stage)[k] = make_int4(-1, -1, -1, -1);
  if (t == 0) misc[0] = 0, misc[1] = INT_MAX;

  unsigned loc = 0;
  int ninv = 0, first = INT_MAX;
#pragma unroll
  for (int s = 0; s < kS; s++) {
    if (!(here >> s & 1)) continue;
    const int pl = s / kR, r = s % kR;
    const int i = P.roundrobin ? r * kThreads + t : t * kR + r;
    if ((unsigned)v[s] - (unsigned)P.lo < (unsigned)el) {
      loc |= 1u << s;
    } else { // another rank's, masked or invalid: no row
      const int flat = (p0 + pl) * tk + i;
      P.route_row[flat] = -1;
      if (v[s] != -1 && (unsigned)v[s] >= (unsigned)P.experts) ninv++, first = min(first, flat);
    }
  }

  trace_point(P, 1);

  // 2. the list of local routes, in thread order
  const int nloc = __popc(loc), inc = warp_inclusive_scan(nloc);
  if (lane == 31) misc[8 + warp] = inc;
  __syncthreads();
  if (__any_sync(MOE_FULL_MASK, ninv)) {
    int n = ninv, f = first;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      n += __shfl_xor_sync(MOE_FULL_MASK, n, o);
      f = min(f, __shfl_xor_sync(MOE_FULL_MASK, f, o));
    }
    if (lane == 0) atomicAdd(&misc[0], n), atomicMin(&misc[1], f);
  }
  if (warp == 0) {
    const int x = misc[8 + lane], y = warp_inclusive_scan(x);
    __syncwarp();
    misc[8 + lane] = y - x;
    if (lane == 31) misc[2] = y;
  }
  __syncthreads();
  {
    int at = misc[8 + warp] + inc - nloc;
#pragma unroll
    for (int s = 0; s < kS; s++)
      if (loc >> s & 1) {
        const int pl = s / kR, r = s % kR;
        const int i = P.roundrobin ? r * kThreads + t : t * kR + r;
        list[at++] = (v[s] - P.lo) << 18 | pl << 14 | i;
      }
  }
  __syncthreads();

  // 3. rank: warp w takes list[w 32 S, (w + 1) 32 S), S = ceil(n / 1024) a lane
  const int n = misc[2], S = (n + kThreads - 1) / kThreads, wbase = warp * 32 * S;
  int *crow = cnt + warp * L.kp;
  warp_rank_run(list, n, wbase, S, P.nbits, crow, ord, [&](int x) { return (x >> 14 & 15) * el + (x >> 18); });
  __syncthreads();
  for (int k = warp; k < P.keys; k += kWarps) { // over the warps, in order: offsets, and c[e][p]
    const int x = cnt[lane * L.kp + k], y = warp_inclusive_scan(x);
    cnt[lane * L.kp + k] = y - x;
    if (lane == 31) ctot[k] = y;
  }

  // 4. exchange c[e][q] (every block reads all of it from the owners' shared memory); n_e
  trace_point(P, 2);
  cluster_arrive();
  cluster_wait();
  trace_point(P, 3);
  for (int x = t; x < P.experts; x += kThreads) {
    const int q = div_by(x, el, P.inv_el), e = x - q * el, bq = div_by(q, P.rpb, P.inv_rpb);
    call[e * L.wp + q] = ld_cluster(ctot + (q - bq * P.rpb) * el + e, (unsigned)bq);
  }
  int inv_all = 0, first_all = INT_MAX;
  if (b == 0 && warp == 0) {
    for (int q = lane; q < G; q += 32) {
      inv_all += ld_cluster(misc + 0, (unsigned)q);
      first_all = min(first_all, ld_cluster(misc + 1, (unsigned)q));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      inv_all += __shfl_xor_sync(MOE_FULL_MASK, inv_all, o);
      first_all = min(first_all, __shfl_xor_sync(MOE_FULL_MASK, first_all, o));
    }
  }
  __syncthreads();
  trace_point(P, 4);
  for (int e = t; e < el; e += kThreads) { // n_e, one expert a thread
    const int *c = call + e * L.wp;
    int r = 0;
    for (int q = 0; q < P.world; q++) r += c[q];
    raw[e] = r;
  }
  __syncthreads();
  // the segments by warp 0 alone (no block-wide scan)
  Segments seg = {0, 0, 0};
  if (warp == 0) {
    seg = group_segments(raw, el, P.pad, P.inv_pad, P.expert_capacity, P.capacity, off, lim);
    if (lane == 0) {
      const int used = off[el];
      misc[3] = (used + G - 1) / G;                 // rows a block writes out of its stage
      misc[4] = (P.capacity - used + G - 1) / G;    // unused rows a block fills
    }
  }
  __syncthreads();
  trace_point(P, 5);

  // 5. place.  Where this block's share of the rows fits the stage, a route's (p, i) goes to the
  // shared memory of the block that owns its row (rows [o rc, o rc + rc) to block o), which then
  // writes its rows in order; otherwise the route's thread stores them in place.
  const int used = off[el], rc = misc[3];
  const bool staged = rc <= P.stage;
  const float inv_rc = 1.0f / (float)rc;
  for (int s = 0; s < S; s++) {
    const int idx = wbase + s * 32 + lane;
    if (idx >= n) break;
    const int x = list[idx], e = x >> 18, pl = x >> 14 & 15, i = x & 0x3fff, p = p0 + pl;
    const int j = crow[pl * el + e] + ord[idx];
    const int *c = call + e * L.wp;
    int pos;
    if (P.roundrobin) {
      pos = roundrobin_position<false>(c, P.world, p, j);
    } else {
      pos = j;
      for (int q = 0; q < p; q++) pos += c[q];
    }
    int row = -1;
    if (pos < lim[e]) {
      row = off[e] + pos;
      if (staged) {
        const int o = div_by(row, rc, inv_rc);
        st_cluster(stage + row - o * rc, (unsigned)o, p << 14 | i);
      } else {
        P.peer_rank[row] = p;
        P.peer_route[row] = i;
      }
    }
    P.route_row[p * tk + i] = row;
  }
  if (!staged)
    for (int e = b; e < el; e += G) // padding rows of this block's experts
      for (int row = off[e] + lim[e] + t; row < off[e + 1]; row += kThreads) P.peer_rank[row] = P.peer_route[row] = -1;
  { // this block's share of the unused rows
    const int share = misc[4];
    const int lo = used + b * share, hi = min(P.capacity, lo + share);
    fill_unused(P.peer_rank, lo, hi, t, kThreads);
    fill_unused(P.peer_route, lo, hi, t, kThreads);
  }
  trace_point(P, 6);
  cluster_arrive(); // the stages are complete, and no block reads another's shared memory after this
  cluster_wait();
  if (staged)
    for (int r = t, r0 = b * rc; r < rc && r0 + r < used; r += kThreads) {
      const int x = stage[r];
      P.peer_rank[r0 + r] = x < 0 ? -1 : x >> 14;
      P.peer_route[r0 + r] = x < 0 ? -1 : x & 0x3fff;
    }
  if (b == 0) {
    for (int e = t; e <= el; e += kThreads) {
      P.offsets[e] = off[e];
      if (e < el) P.counts[e] = lim[e], P.tpe[e] = off[e + 1] - off[e];
    }
    if (t == 0) {
      P.stats[MOE_STAT_ROWS_NEEDED] = (int)(seg.need < INT_MAX ? seg.need : INT_MAX);
      P.stats[MOE_STAT_ROWS_USED] = off[el];
      P.stats[MOE_STAT_DROPPED] = seg.local - seg.placed;
      P.stats[MOE_STAT_INVALID] = inv_all;
      P.stats[MOE_STAT_FIRST_INVALID] = inv_all ? first_all : -1;
    }
  }
  trace_point(P, 7);
}

// ---- host ----

constexpr int kDevices = 64;
std::atomic<int> sm_optin[kDevices];              // opt-in shared memory per block, bytes + 1
std::atomic<signed char> fits[kDevices][kMaxCluster + 1]; // a cluster of G blocks fits: 1 yes, -1 no
std::atomic<bool> raised[kDevices][5][5];

typedef void (*kernel_fn)(const Params);
template <int kR> kernel_fn kernel_for_slots(int lgs) {
  switch (lgs) {
  case 0: return schedule_cluster_kernel<kR, kR>;
  case 1: return schedule_cluster_kernel<kR, (kR * 2 > kMaxSlots ? kMaxSlots : kR * 2)>;
  case 2: return schedule_cluster_kernel<kR, (kR * 4 > kMaxSlots ? kMaxSlots : kR * 4)>;
  case 3: return schedule_cluster_kernel<kR, (kR * 8 > kMaxSlots ? kMaxSlots : kR * 8)>;
  default: return schedule_cluster_kernel<kR, kMaxSlots>;
  }
}
// lgr: log2 of the slots a rank, lgs: log2 of the source ranks a block (rounded up)
kernel_fn kernel_for(int lgr, int lgs) {
  switch (lgr) {
  case 0: return kernel_for_slots<1>(lgs);
  case 1: return kernel_for_slots<2>(lgs);
  case 2: return kernel_for_slots<4>(lgs);
  case 3: return kernel_for_slots<8>(lgs);
  default: return kernel_for_slots<16>(lgs);
  }
}

// Whether a cluster of g blocks (1024 threads, smem bytes each) can be placed on the device.
int cluster_fits(moe_ctx *ctx, int device, kernel_fn kernel, int g, size_t smem, bool *ok) {
  const bool cached = device >= 0 && device < kDevices;
  const signed char c = cached ? fits[device][g].load(std::memory_order_relaxed) : 0;
  if (c) {
    *ok = c > 0;
    return MOE_OK;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)g, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3((unsigned)g);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  *ok = n > 0;
  if (cached) fits[device][g].store(n > 0 ? 1 : -1, std::memory_order_relaxed);
  return MOE_OK;
}

} // namespace

// Runs the schedule as one cluster when the problem fits it (and the choice, automatic or
// MOE_SCHEDULE_KERNEL, is this kernel): *ran = 1 and the call's status.  Otherwise *ran = 0 and
// MOE_OK, and the grid kernel takes the call; with MOE_SCHEDULE_KERNEL=cluster that is an error.
extern "C" int moeI_schedule_cluster_cuda(moe_ctx *ctx, const moe_schedule_args *a, int *ran) {
  *ran = 0;
  const char *sel = getenv("MOE_SCHEDULE_KERNEL");
  const bool forced = sel && !strcmp(sel, "cluster");
  if (sel && !forced && strcmp(sel, "grid") && strcmp(sel, "replicated") && strcmp(sel, "bitmap"))
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      STAGE ": MOE_SCHEDULE_KERNEL must be grid, cluster, replicated or bitmap, got \"%s\"", sel);
  if (sel && !forced) return MOE_OK;

  const int device = a->ids->device.index;
  const long long W = a->ids->shape[0], tk = a->ids->shape[1] * a->ids->shape[2];
  const long long E = a->experts, el = E / W;
  int lgr = 0;
  while (lgr < 4 && (1024LL << lgr) < tk) lgr++;
  const int R = 1 << lgr;
  const long long rpb = (W + kMaxCluster - 1) / kMaxCluster;
  const char *why = NULL;
  if (tk > 1024LL * kMaxSlots) why = "more than 16,384 routes a rank";
  else if (rpb * R > kMaxSlots) why = "more than 16 routes a thread";
  else if (rpb * el > kMaxKeys) why = "more than 512 (source rank, expert) pairs a block";
  else if (E > kMaxExperts) why = "more than 4,096 experts";
  // rows, shares and padding loops in 32 bits, a step past C included (the grid kernel: 64-bit)
  else if (a->capacity > INT_MAX - 65536) why = "a capacity within 2^16 of 2^31";
  if (why) {
    if (forced)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                        STAGE ": MOE_SCHEDULE_KERNEL=cluster, but the cluster kernel does not take %s", why);
    return MOE_OK;
  }
  const int g = (int)((W + rpb - 1) / rpb);
  // measured (PERF.md): ahead of the grid kernel while a thread holds few ids and a block ranks
  // few local routes (tk rpb / W of them under uniform routing)
  if (!forced && (rpb * R > kAutoSlots || tk * rpb > (long long)kAutoLocal * W)) return MOE_OK;

  Params P = {};
  static_cast<ScheduleCall &>(P) = schedule_call(a);
  static const int trace = getenv("MOE_SCHEDULE_TRACE") != NULL;
  P.trace = trace;
  P.rpb = (int)rpb;
  P.keys = (int)(rpb * el);
  P.nbits = 0;
  while ((1 << P.nbits) < P.keys) P.nbits++;

  // the stage: a block's share of the rows a call can use, min(C, W T K + EL (pad - 1)) / G, if small
  const long long rows_bound = W * tk + el * (a->pad - 1LL);
  const long long rows_max = a->capacity < rows_bound ? a->capacity : rows_bound;
  P.stage = cdiv(rows_max, g) <= kMaxStage ? cdiv(rows_max, g) : 0;
  int lgs = 0;
  while ((1 << lgs) < P.rpb) lgs++;
  const kernel_fn kernel = kernel_for(lgr, lgs);
  P.inv_el = 1.0f / (float)P.el;
  P.inv_rpb = 1.0f / (float)P.rpb;
  P.inv_pad = 1.0f / (float)P.pad;
  P.L = smem_layout(kThreads * R * P.rpb, P.keys, P.el, P.world, P.stage);
  const size_t smem = sizeof(int) * (size_t)P.L.total + 16; // + the last int4 of the fills
  // the context's stream, and the device current: the attributes and the occupancy query below act
  // on the calling thread's current device
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
                        STAGE ": MOE_SCHEDULE_KERNEL=cluster, but %zu bytes of shared memory do not fit a block", smem);
    return MOE_OK;
  }
  if (!(cached && raised[device][lgr][lgs].load())) {
    MOE_CUDA_TRY(ctx, STAGE, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    MOE_CUDA_TRY(ctx, STAGE, cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    if (cached) raised[device][lgr][lgs].store(true);
  }
  bool ok;
  rc = cluster_fits(ctx, device, kernel, g, (size_t)optin, &ok);
  if (rc) return rc;
  if (!ok) {
    if (forced)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                        STAGE ": MOE_SCHEDULE_KERNEL=cluster, but cuda:%d cannot place a cluster of %d blocks", device, g);
    return MOE_OK;
  }
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[2], cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension; // the whole grid is one cluster
  cluster.val.clusterDim.x = (unsigned)g, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
  schedule_launch_config(&cfg, attr, (unsigned)g, kThreads, smem, st, cluster);
  *ran = 1;
  trace_grid = g;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, P);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, STAGE ": cudaLaunchKernelEx(schedule_cluster_kernel) failed at %s:%d: %s: %s",
                      __FILE__, __LINE__, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  return moeI_ok(ctx);
}

// The phase times of the last cluster call made with MOE_SCHEDULE_TRACE set: trace_buf's rows (copy_trace).
extern "C" int moeI_schedule_cluster_trace(long long *out, int max_blocks) {
  return copy_trace(out, trace_buf, trace_grid, max_blocks);
}
