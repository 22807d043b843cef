// experts_sm90.cu -- stage 4 on Hopper (sm_90a): the grouped SwiGLU MLP on the copy engine
// (TMA) and the warpgroup tensor-core instructions (wgmma).
//
// Same contract and the same three launches as experts.cu, which stays the fallback and the
// cross-check (MOE_EXPERTS_KERNEL=mma):
//
//   map      one block turns expert_offsets (read on the device) into, per expert, its rows
//            [lo, hi) -- the clamped running maximum moeI_experts_cpu reads -- and the prefixes of its
//            pairs of row tiles and of its row tiles left over (the work list, below), or of
//            its weights-as-M units (WT, below).
//   gate_up  h [C, F] = bf16(silu(xs . W_gate^T) * (xs . W_up^T)).  A tile's B operand is 128
//            gate rows f0.. and the 128 up rows F + f0.., so the gate and the up accumulator of
//            an output element sit in the same thread and SwiGLU is applied in the epilogue.
//   down     ys [C, H] = h . W_down^T, 256 output columns per tile.
//
// The GEMM kernel (one per pass) is persistent and warp-specialised, 384 threads:
//   warpgroup 0     the producer: one thread walks the work list and issues TMA bulk tensor
//                   copies (128B swizzle) into a 4-stage ring of shared memory, each stage
//                   completing on its "full" mbarrier by transaction bytes.  It keeps 40
//                   registers (setmaxnreg.dec).
//   warpgroups 1-2  the consumers, 64 rows of the 128-row tile each: wgmma.mma_async
//                   m64n256k16 bf16 -> f32 with A and B read from shared memory through
//                   descriptors, 128 accumulators per thread (setmaxnreg.inc to 232).  A warp
//                   hands a stage back by arriving on its "empty" mbarrier once its wgmma
//                   group that read it has retired.  The epilogue goes through a swizzled
//                   shared-memory tile to 16-byte stores predicated on the expert's rows.
// Tile 128 x 256 x 64 (M x N x K), 48 KiB a stage: 4 stages + 32 KiB of staging = 225 KiB.
//
// CM = 2 (MOE_EXPERTS_KERNEL=sm90x2) launches clusters of two CTAs.  On a pair of row tiles
// 2p and 2p+1 of an expert (same column tile) each CTA loads one half of the shared B tile and
// multicasts it to both, so the L2 -> SM traffic per tile falls from 48 to 32 KiB a stage.
// A stage is then written by both CTAs' copies, so each CTA's consumers hand it back to both
// producers (remote mbarrier arrivals), and the CTAs of the pair walk the same work list in
// lock step.  When an expert's row tiles are odd in number, the last one runs "solo": the two
// CTAs on that row tile and two column tiles, each loading its own B and half of the shared A
// rows (multicast to both: tma_a_half, boxes of 64 rows), still in lock step, so that neither
// idles through a tile its partner has and it has not (as a pair, such a tile cost a whole
// pair's time).  CM = 2 is the default wherever the row tiles run; CM = 1 (one CTA a tile)
// stays as a variant to measure against (PERF.md).
//
// The weights-as-M tiles (WT, MOE_EXPERTS_KERNEL=sm90w; the default where the experts average two
// row tiles or more): the same frame, clusters of two and B multicast, with the operands' roles
// swapped.  A consumer warpgroup's 128 weight rows of the B tile (gate_up: 64 gate rows and the
// 64 up rows of the same outputs) are wgmma's M, in two accumulators, and the CTA's tokens its
// N, which can be any multiple of 8 up to NV_MAX = 200: so an expert of r rows is cut into u =
// ceil(r / 400) units of two CTAs x nv = ceil(r / 2u) rows (rounded up to 8), and pays for about
// its rows instead of whole 128-row tiles (Kimi K2's 1,195 rows: 6 x 200 = 1,200 row slots, where
// the row tiles take 1,280 and run the last pair, 171 rows, at a whole pair's time).  wgmma
// m64nNk16 for each N (wgmma_tr.cuh), the tokens loaded in boxes of 128, 32 and 8 rows, the
// epilogue through stmatrix .trans, each warp on its own outputs, 32 tokens at a time, which go
// out as bulk tensor stores that overlap the next unit's MMAs (w_epilogue).  A stage
// of 200 tokens and 256 weight rows is 57 KiB, so the ring has 3 stages, and a consumer hands a
// slot back once its own group that read it has retired (the other warpgroup's group keeps the
// tensor cores busy meanwhile), which leaves the producer two slots ahead as the row tiles' 4
// stages do.  A second instantiation of the kernel (WT = true), so that neither path's code is
// compiled into the other's.
//
// Work list (the function decode): per expert, in order, its pairs x column tiles, then its row
// tile left over (CM = 1: all of them) x groups of CM column tiles.  Inside each, GROUP_TILES row
// tiles are a band and inside a band the row tile varies fastest, so the CTAs in flight together
// share the band's A rows and a few B column tiles in L2.  The grid is static (sized from C
// alone, persistent, one CTA per SM), so a captured CUDA graph stays right for any offsets
// written later; units past the real count are never visited.  Rows: a tile never mixes
// experts; A rows past the expert's end (the next expert's rows, rows past C: TMA fills those
// with zeros) are loaded but never stored, and a row of the output depends on its own A row
// alone.  A consumer warpgroup whose 64 rows hold none of the expert's skips its tensor-core
// work (an expert's last, short tile), and so do both where a solo unit has one column tile
// fewer than CM (NT odd).
//
// The wave gate: the CTAs in flight together share their operands in L2 only while they are
// near the same k block; left alone they drift apart over a pass's ~58 waves (gate_up at Kimi
// K2) and read 2.1-2.6x the compulsory bytes from DRAM (PERF.md).  So a producer starts its
// wave-th unit once all but WAVE_SLACK of the grid's CTAs have issued every copy of their wave
// before (a counter in the scratch, zeroed by the map kernel, one per pass).  Only where the
// experts average two row tiles or more: with fewer, as in decode, hardly two CTAs read the
// same weights and the gate only costs (1.7% at 48 experts x 8 rows).  The gate times the
// copies; what is computed does not depend on it.  It assumes the persistent grid is resident
// at once; should it not be (another kernel holding SMs), a wait gives up after WAVE_WAIT_NS
// and that CTA stops waiting for the rest of the pass, so it can cost time but never hang.
//
// Requirements (else MOE_ERR_UNSUPPORTED, before any side effect, and experts.cu falls back):
// compute capability 9.0, H and F multiples of 64 (whole K blocks; F > 0), every tensor
// 16-byte aligned, EL * 2F and EL * H below 2^31.  Column tiles may run past F (gate_up, F %
// 128 == 64) or past H (down, H % 256 != 0): those B rows belong to the up half, the next
// expert or nothing (zero fill), and the columns they feed are not stored.
//
// The tensor maps (CUtensorMap) are encoded on the host through the driver's
// cuTensorMapEncodeTiled, fetched with cudaGetDriverEntryPointByVersion so that nothing links
// libcuda, and passed by value as __grid_constant__ parameters.
#include <cuda.h> // CUtensorMap and the encode function's types only; no libcuda symbol is used
#include <atomic>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.cuh"
#include "../sm90/wgmma.cuh"

namespace {

constexpr int BM = 128;                 // rows per tile (two consumer warpgroups of 64)
constexpr int BN = 256;                 // B rows per tile: gate_up 128 gate + 128 up; down 256 outputs
constexpr int BK = 64;                  // k per stage: one 128-byte swizzle row
constexpr int STAGES = 4;
constexpr int THREADS = 384;            // producer warpgroup + 2 consumer warpgroups
[[maybe_unused]] constexpr int GROUP_TILES = 16; // row tiles per raster band
constexpr int A_BYTES = BM * BK * 2;    // 16 KiB
constexpr int B_HALF = BN / 2 * BK * 2; // 16 KiB: one TMA box of 128 rows
constexpr int STAGE_BYTES = A_BYTES + 2 * B_HALF;
constexpr int STG_BYTES = 64 * 256;     // a consumer's staging tile: 64 rows x 128 bf16 columns
constexpr int SMEM_USED = STAGES * STAGE_BYTES + 2 * STG_BYTES + 2 * STAGES * 8;
constexpr int SMEM_BYTES = SMEM_USED + 1024; // slack to align the ring to the 1024-byte swizzle atom
constexpr int MAP_THREADS = 1024;
// The weights-as-M kernel (WT): a CTA's tile is 256 weight rows (B, as above) x up to NV_MAX
// tokens (A), the tokens as wgmma's N.  Its A slot holds NV_MAX rows; its staging 32 tokens at a
// time.  NV_MAX and the stages can be set at build time to measure against (-DMOE_W_NV_MAX=176
// -DMOE_W_STAGES=4 is the previous configuration: PERF.md).
#ifndef MOE_W_NV_MAX
#define MOE_W_NV_MAX 200
#endif
#ifndef MOE_W_STAGES
#define MOE_W_STAGES 3
#endif
constexpr int NV_MAX = MOE_W_NV_MAX;
constexpr int STAGES_W = MOE_W_STAGES;
constexpr int A_W_BYTES = NV_MAX * BK * 2;             // 25 KiB
constexpr int STAGE_W_BYTES = A_W_BYTES + 2 * B_HALF;  // 57 KiB
// A consumer's staging: per warp STG_SLOTS slots of 32 tokens x 16 bf16 outputs, which the
// bulk tensor stores read while the warp goes on (MOE_W_TMA_STORE=0: one slot, plain stores).
#ifndef MOE_W_TMA_STORE
#define MOE_W_TMA_STORE 1
#endif
constexpr int STG_SLOTS = MOE_W_TMA_STORE ? 4 : 1;
constexpr int STG_W_BYTES = 4 * STG_SLOTS * 32 * 32;
constexpr int SMEM_W_BYTES = STAGES_W * STAGE_W_BYTES + 2 * STG_W_BYTES + 2 * STAGES_W * 8 + 1024;
static_assert(NV_MAX % 8 == 0 && NV_MAX >= 8 && NV_MAX <= 200 && STAGES_W >= 3,
              "a CTA's N is a multiple of 8 up to the widest wgmma the WT switch has; 3 stages or more");
[[maybe_unused]] constexpr int WAVE_SLACK = 16;             // CTAs a wave may start without
[[maybe_unused]] constexpr unsigned WAVE_WAIT_NS = 200000; // a tile takes ~30-80 us at Kimi K2
[[maybe_unused]] constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232; // 128 * (40 + 2 * 232) <= 64 Ki registers

enum { GATE_UP = 0, DOWN = 1 };

static_assert(STAGE_BYTES % 1024 == 0 && A_BYTES % 1024 == 0 && B_HALF % 1024 == 0,
              "every TMA destination and wgmma operand starts on a 1024-byte swizzle atom");
static_assert(SMEM_BYTES <= 232448 && SMEM_W_BYTES <= 232448, "fits the 227 KiB a Hopper block may opt in to");
static_assert(STAGE_W_BYTES % 1024 == 0 && A_W_BYTES % 1024 == 0, "the WT ring on 1024-byte swizzle atoms too");
template <bool WT> constexpr int smem_bytes() { return WT ? SMEM_W_BYTES : SMEM_BYTES; }

// ---- the work list, shared by the map kernel (its prefix) and the GEMM (its decoding) ----

__device__ __forceinline__ int clamp_row(int v, int C) { return v < 0 ? 0 : v > C ? C : v; }

template <bool MAX> __device__ __forceinline__ int op2(int a, int b) { return MAX ? max(a, b) : a + b; }

// Inclusive scan of v over the 1024 threads; *total gets the reduction.  ws holds 32 ints.
template <bool MAX> __device__ int block_scan(int v, int *ws, int *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = op2<MAX>(v, t);
  }
  if (lane == 31) ws[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = ws[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = op2<MAX>(w, t);
    }
    ws[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op2<MAX>(v, ws[warp - 1]);
  *total = ws[31];
  __syncthreads(); // ws is reused by the next scan
  return v;
}

// meta = pairs [EL + 1], solos [EL + 1] (exclusive prefixes of each expert's pairs of row tiles
// and of its row tiles left over, see decode), lo [EL], hi [EL], the wave gate's two counters
// (gate_up, down), zeroed here, and wunits [EL + 1].  With wt set (the weights-as-M kernel, CM
// = 2), no pairs and no solos: an expert's rows are wunits units of at most 2 NV_MAX (decode_w).
__global__ void __launch_bounds__(MAP_THREADS) sm90_map_kernel(int *meta, const int *offsets, int EL, int C, int cm,
                                                                int wt) {
  __shared__ int ws[32];
  int *pairs = meta, *solos = pairs + EL + 1, *lo = solos + EL + 1, *hi = lo + EL, *waves = hi + EL;
  int *wunits = waves + 2;
  int carry_m = 0, carry_p = 0, carry_s = 0, carry_w = 0;
  for (int base = 0; base < EL; base += MAP_THREADS) {
    const int e = base + (int)threadIdx.x;
    const int own = e < EL ? clamp_row(offsets[e], C) : 0;
    const int next = e < EL ? clamp_row(offsets[e + 1], C) : 0;
    int tot;
    const int m = max(carry_m, block_scan<true>(own, ws, &tot)); // m_e, running maximum through e
    carry_m = max(carry_m, tot);
    const int end = max(m, next);                                // m_{e+1}
    const int tiles = (end - m + BM - 1) / BM;
    const int np = e < EL && !wt && cm == 2 ? tiles / 2 : 0, ns = e < EL && !wt ? tiles - 2 * np : 0;
    const int nw = e < EL && wt ? (end - m + 2 * NV_MAX - 1) / (2 * NV_MAX) : 0;
    const int first_p = carry_p + block_scan<false>(np, ws, &tot) - np;
    carry_p += tot;
    const int first_s = carry_s + block_scan<false>(ns, ws, &tot) - ns;
    carry_s += tot;
    const int first_w = carry_w + block_scan<false>(nw, ws, &tot) - nw;
    carry_w += tot;
    if (e < EL) pairs[e] = first_p, solos[e] = first_s, lo[e] = m, hi[e] = end, wunits[e] = first_w;
  }
  if (threadIdx.x == 0) pairs[EL] = carry_p, solos[EL] = carry_s, waves[0] = 0, waves[1] = 0, wunits[EL] = carry_w;
}

struct Work {
  int e;    // expert
  int row0; // this CTA's first row
  int rows; // rows of the expert in [row0, row0 + BM), 1..BM
  int n;    // column tile (NT when a solo unit's second CTA has none: it computes nothing)
  int solo; // the CTAs of the cluster share no operand (see decode)
};

// Inside a band of at most GB items (row tiles or pairs) x nc column tiles, the item varies
// fastest, so that the CTAs in flight together share the band's A rows and a few B column tiles.
__device__ __forceinline__ void raster(int local, int items, int nc, int GB, int *item, int *col) {
  const int band = local / (GB * nc), first = band * GB, nb = min(GB, items - first);
  const int l = local - band * GB * nc;
  *item = first + l % nb, *col = l / nb;
}

// Unit v of a pass with NT column tiles -> this CTA's tile.  An expert's units are first its
// pairs of row tiles (CM = 2: one unit per pair and column tile; the CTAs take one row tile each
// and share B), then the row tiles left over -- the last one when they are odd in number, all of
// them when CM = 1 -- as "solo" units of CM column tiles of one row tile, each CTA on its own
// column tile, sharing nothing.  So no CTA of a pair waits out its partner's tile without rows
// of its own.  Every role of every CTA of a cluster decodes the same v the same way, so they
// agree without talking.
template <int CM>
__device__ __forceinline__ Work decode(int v, const int *__restrict__ meta, int EL, int NT, int rank) {
  const int *pairs = meta, *solos = pairs + EL + 1, *lo = solos + EL + 1, *hi = lo + EL;
  const int NS = (NT + CM - 1) / CM; // solo units per row tile
  int a = 0, b = EL - 1;
  while (a < b) { // the last expert whose first unit is <= v; it is not empty as v < units
    const int mid = (a + b + 1) >> 1;
    if (__ldg(pairs + mid) * NT + __ldg(solos + mid) * NS <= v) a = mid;
    else b = mid - 1;
  }
  const int p0 = __ldg(pairs + a), np = __ldg(pairs + a + 1) - p0, s0 = __ldg(solos + a);
  int local = v - p0 * NT - s0 * NS, item, col;
  Work w;
  w.e = a;
  w.solo = local >= np * NT;
  if (!w.solo) {
    raster(local, np, NT, GROUP_TILES / 2, &item, &col);
    w.row0 = __ldg(lo + a) + (2 * item + rank) * BM;
    w.n = col;
  } else {
    raster(local - np * NT, __ldg(solos + a + 1) - s0, NS, GROUP_TILES, &item, &col);
    w.row0 = __ldg(lo + a) + (CM * np + item) * BM;
    w.n = min(col * CM + rank, NT);
  }
  w.rows = min(__ldg(hi + a) - w.row0, BM);
  return w;
}

// Unit v of the weights-as-M kernel -> this CTA's tile.  An expert of r rows has u = ceil(r / (2
// NV_MAX)) units per column tile, each of 2 nv rows (nv = ceil(r / 2u) rounded up to 8), the
// first nv to the cluster's first CTA, the rest to the second (fewer, or none, in the expert's
// last unit).  The two share the column tile's 256 weight rows (each loads one half and
// multicasts it); the tokens are wgmma's N, so a CTA's time follows its own rows rounded up to 8,
// not to a whole tile.  Inside an expert, bands of W_BAND units (~2,000 rows, as the row tiles'
// bands) x the column tiles, the unit varying fastest: the units in flight together read the same
// weights, and a band's token rows stay in L2 while its column tiles go by (one band for all of
// a large expert's units read the tokens again from DRAM for every column tile: PERF.md).
constexpr int W_BAND = 6;
__device__ __forceinline__ Work decode_w(int v, const int *__restrict__ meta, int EL, int NT, int rank) {
  const int *lo = meta + 2 * EL + 2, *hi = lo + EL, *wunits = hi + EL + 2;
  int a = 0, b = EL - 1;
  while (a < b) { // the last expert whose first unit is <= v; it is not empty as v < units
    const int mid = (a + b + 1) >> 1;
    if (__ldg(wunits + mid) * NT <= v) a = mid;
    else b = mid - 1;
  }
  const int u = __ldg(wunits + a + 1) - __ldg(wunits + a), local = v - __ldg(wunits + a) * NT;
  const int l0 = __ldg(lo + a), r = __ldg(hi + a) - l0;
  const int nv = ((r + 2 * u - 1) / (2 * u) + 7) & ~7;
  int j, n;
  raster(local, u, NT, W_BAND, &j, &n);
  Work w;
  w.e = a;
  w.n = n;
  w.solo = 0;
  w.row0 = l0 + (2 * j + rank) * nv;
  w.rows = min(nv, l0 + r - w.row0); // <= 0: this CTA only shares its half of the weights
  return w;
}

// ---- PTX wrappers (sm_90a) ----

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90A 1

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n\t.reg .pred p;\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
               "selp.u32 %0, 1, 0, p;\n\t}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// Waits until the phase of parity `parity` has completed (the phase before the current one
// counts as completed, which is how the producer's first pass through the ring goes through).
// A wait that lasts MOE_SM90_WATCHDOG_NS (a whole pass takes milliseconds) can only be a broken
// protocol: the kernel traps, so the launch fails with an error instead of hanging the stream.
#ifndef MOE_SM90_WATCHDOG_NS
#define MOE_SM90_WATCHDOG_NS 20000000000ull // 20 s; 0 turns the watchdog off
#endif
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = MOE_SM90_WATCHDOG_NS ? global_ns() : 0;
  while (!mbar_try_wait(bar, parity))
    if (MOE_SM90_WATCHDOG_NS && global_ns() - t0 > MOE_SM90_WATCHDOG_NS) __trap();
}
// The wave gate's wait (see the header): true once *count >= need, false after WAVE_WAIT_NS.
__device__ __forceinline__ bool wave_wait(const int *count, int need) {
  const volatile int *c = count;
  if (*c >= need) return true;
  const uint64_t t0 = global_ns();
  while (*c < need)
    if (global_ns() - t0 > WAVE_WAIT_NS) return false;
  return true;
}
__device__ __forceinline__ void mbar_arrive_local(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier at the same shared-memory offset in CTA `cta` of the cluster.  The
// default semantics (release at CTA scope), not .release.cluster: that one compiles to a full
// fence before every arrival (ncu: most of the cluster kernel's stalls), and nothing here needs
// it -- the arrival only says the slot's wgmma reads have retired, which wgmma.wait_group saw.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile("{\n\t.reg .b32 ra;\n\t"
               "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "mbarrier.arrive.shared::cluster.b64 _, [ra];\n\t}\n" ::"r"(bar),
               "r"(cta)
               : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void prefetch_tmap(const CUtensorMap *m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
}
// Box {BK elements of k, 128 rows} at (k, row) of the 2D map into shared memory at dst.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *m, int k, int row, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(m)), "r"(k), "r"(row), "r"(bar)
               : "memory");
}
// The same box into dst of every CTA in mask; each CTA's barrier at offset bar gets the bytes.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap *m, int k, int row, uint32_t bar,
                                                   uint16_t mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(m)), "r"(k), "r"(row), "r"(bar), "h"(mask)
               : "memory");
}
// The box {16 columns, 32 rows} at (col, row) of the 2D map from shared memory at src (32-byte
// swizzle), in this thread's current bulk async-group.
__device__ __forceinline__ void tma_store(const CUtensorMap *m, int col, int row, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(m)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups still read their shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// This thread's shared-memory writes, seen by the async proxy (the bulk stores) after it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout that TMA
// SWIZZLE_128B writes: rows of 128 bytes (64 bf16 of k), 16-byte chunk c of row r stored at
// chunk c ^ (r & 7), groups of 8 rows 1024 bytes apart (the stride byte offset).  The leading
// byte offset is unused for a swizzled K-major operand (one k16 slice lies inside the 128-byte
// row); 1 by convention.  Base offset 0: every operand starts on a 1024-byte boundary.  The k16
// slice j of a stage starts 32 j bytes further: + 2 j in the address field (units of 16 bytes).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4)  // bits 0-13: start address >> 4
         | (uint64_t)1 << 16                  // bits 16-29: leading byte offset >> 4 (unused)
         | (uint64_t)(1024 >> 4) << 32        // bits 32-45: stride byte offset >> 4
         | (uint64_t)1 << 62;                 // bits 62-63: swizzle mode 1 = 128B
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous wgmma
// and its wait: each register is "rewritten" here, in program order with the asm around it.
template <int ACC> __device__ __forceinline__ void fence_acc(float (&d)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; i++) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (the lower column) in the low half
  return *reinterpret_cast<uint32_t *>(&v);
}

// silu(g) * u.  The fast exponential and division differ from moeI_experts_cpu's expf and '/' by a
// few ulp of f32, far under the bf16 rounding that follows; e^-g = inf gives -0 as there.
__device__ __forceinline__ float swiglu(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

// Four 8 x 8 bf16 matrices to shared memory, transposed: lane l's register j holds row l / 4,
// columns 2 (l % 4) and + 1 of matrix j, which land in memory row 2 (l % 4) (+ 1) of that matrix at
// column l / 4; lanes 8 j .. 8 j + 7 give the addresses of matrix j's memory rows.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// Two of them: lanes 0 .. 15 give the addresses.
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

// Accumulator layout of wgmma m64nNk16 (f32): warp q of the warpgroup owns rows 16q..16q+15;
// register i of lane l holds row 16q + l/4 + 8 ((i/2) % 2), column 8 (i/4) + 2 (l%4) + (i%2).
// The consumer's 64 x 128 staging tile (256-byte rows) keeps 16-byte chunk c of row r at chunk
// c ^ (r & 7): the 4-byte writes of a warp (8 rows x 4 lanes) and the 16-byte reads of each
// quarter warp (8 chunks of one row) both touch 32 distinct banks.
template <int MODE>
__device__ __forceinline__ void epilogue(float (&d)[128], uint32_t stg, uint16_t *__restrict__ out, int N, int row0,
                                         int rows, int col0, int bar_id, int t) {
  const int lane = t & 31;
  const int sw = lane >> 2; // (row & 7) of both rows this thread writes
  const uint32_t wbase = stg + (uint32_t)(((t >> 5) * 16 + (lane >> 2)) * 256 + (lane & 3) * 4);
  constexpr int PASSES = MODE == GATE_UP ? 1 : 2; // 128 output columns per pass
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    named_bar_sync(bar_id, 128); // the staging tile's previous readers are done
#pragma unroll
    for (int j = 0; j < 16; j++) {
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        float v0, v1;
        if (MODE == GATE_UP) { // gate column c in register i, its up column 128 + c in i + 64
          const int i = j * 4 + hh * 2;
          v0 = swiglu(d[i], d[i + 64]);
          v1 = swiglu(d[i + 1], d[i + 65]);
        } else {
          const int i = (p * 16 + j) * 4 + hh * 2;
          v0 = d[i];
          v1 = d[i + 1];
        }
        st_shared_b32(wbase + (uint32_t)(hh * 8 * 256 + ((j ^ sw) << 4)), pack_bf16(v0, v1));
      }
    }
    named_bar_sync(bar_id, 128);
#pragma unroll
    for (int q = 0; q < 8; q++) {
      const int idx = t + 128 * q, r = idx >> 4, ch = idx & 15;
      const uint4 v = ld_shared_v4(stg + (uint32_t)(r * 256 + ((ch ^ (r & 7)) << 4)));
      const int col = col0 + p * 128 + ch * 8;
      if (r < rows && col < N) *reinterpret_cast<uint4 *>(out + (long long)(row0 + r) * N + col) = v;
    }
  }
}

// The weights-as-M tile's epilogue.  d holds two accumulators of NV / 2 registers, D[weight row
// m][token n] each (m64nNV: register i of lane l of warp q holds m = 16 q + l / 4 + 8 ((i / 2) %
// 2), n = 8 (i / 4) + 2 (l % 4) + (i % 2)); gate_up: d[i] the gate, d[NV / 2 + i] the up of the
// same output; down: the warpgroup's first 64 outputs, then the next 64 (two passes).  Each warp
// writes only its own 16 outputs, through its own slots of staging, so no barrier but the warp's
// own is needed: each 8 x 8 block is one stmatrix fragment, stored transposed (a token per
// 32-byte row, its two 16-byte halves swapped every 4 rows: the bulk copy's 32-byte swizzle, and
// no two of a fragment's rows meet in a bank), 32 tokens a slot.  A slot of 32 tokens goes out as
// one bulk tensor store (tmo: box {16, 32}) that lane 0 issues and the warp does not wait for, so
// the stores overlap the next unit's MMAs; the slot is written again STG_SLOTS slots later, once
// that store has read it.  An expert's last, shorter slot goes out in 16-byte stores, as a box
// would write rows that are not this CTA's.  sc counts the warp's slots across units.
template <int MODE, int NV>
__device__ __forceinline__ void w_epilogue(float (&d)[NV], uint32_t stg, const CUtensorMap *tmo,
                                           uint16_t *__restrict__ out, int N, int row0, int rows, int col0, int t,
                                           uint32_t &sc) {
  constexpr int H2 = NV / 2;
  const int lane = t & 31, q = t >> 5;
  const int mat = lane >> 3, ri = lane & 7; // the matrix and memory row this lane addresses
  const uint32_t wst0 = stg + (uint32_t)(q * STG_SLOTS * 1024);
  constexpr int PASSES = MODE == GATE_UP ? 1 : 2;
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
#pragma unroll
    for (int c0 = 0; c0 < NV; c0 += 32) {
      if (c0 >= rows) break; // uniform: rows is the warpgroup's
      const uint32_t wst = wst0 + (sc % STG_SLOTS) * 1024u;
      sc++;
      if (MOE_W_TMA_STORE && lane == 0) bulk_wait_read<STG_SLOTS - 1>(); // the slot's last store has read it
      __syncwarp(); // ... and the warp's own last reads of it are done
#pragma unroll
      for (int jn = c0 / 8; jn < (c0 + 32 < NV ? c0 + 32 : NV) / 8; jn += 2) { // token blocks jn (and jn + 1)
        uint32_t r[4];
#pragma unroll
        for (int j = 0; j < 4; j++) { // matrix j: m-half j & 1 of token block jn + j / 2
          const int i = 4 * (jn + (j >> 1)) + 2 * (j & 1);
          if (i >= H2) {
            r[j] = 0;
            continue;
          }
          float v0, v1;
          if (MODE == GATE_UP) {
            v0 = swiglu(d[i], d[H2 + i]);
            v1 = swiglu(d[i + 1], d[H2 + i + 1]);
          } else {
            v0 = d[H2 * p + i];
            v1 = d[H2 * p + i + 1];
          }
          r[j] = pack_bf16(v0, v1);
        }
        const int n = 8 * (jn + (mat >> 1)) + ri - c0, h = mat & 1;
        const uint32_t addr = wst + (uint32_t)(n * 32 + ((h ^ ((n >> 2) & 1)) << 4));
        if (8 * (jn + 1) < NV) stmatrix_x4_trans(addr, r[0], r[1], r[2], r[3]);
        else stmatrix_x2_trans(addr, r[0], r[1]); // the last block of 8 tokens alone
      }
      const int here = min(32, rows - c0);
      const int col = col0 + p * 64 + 16 * q;
      if (MOE_W_TMA_STORE && here == 32) {
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
          if (col < N) tma_store(tmo, col, row0 + c0, wst);
          bulk_commit();
        }
      } else {
        __syncwarp();
        for (int idx = lane; idx < here * 2; idx += 32) {
          const int n = idx >> 1, h = idx & 1;
          const uint4 v = ld_shared_v4(wst + (uint32_t)(n * 32 + ((h ^ ((n >> 2) & 1)) << 4)));
          if (col < N) *reinterpret_cast<uint4 *>(out + (long long)(row0 + c0 + n) * N + col + 8 * h) = v;
        }
        if (MOE_W_TMA_STORE && lane == 0) bulk_commit(); // an empty group: one group a slot
      }
    }
  }
}
#endif // sm_90a

#if defined(MOE_SM90A)
// A warp hands slot s back to the producer of every CTA of the cluster once its wgmma group that
// read the slot has retired.
template <int CM> __device__ __forceinline__ void release_slot(uint32_t empty, int lane) {
  if (lane == 0) {
    if (CM == 1) mbar_arrive_local(empty);
    else
      for (int c = 0; c < CM; c++) mbar_arrive_cluster(empty, (uint32_t)c);
  }
}

// One weights-as-M tile of a consumer warpgroup: its 128 weight rows of the stage's B (gate_up: 64
// gate rows and the 64 up rows of the same outputs; down: 128 outputs) as wgmma's M, in two
// accumulators, times the CTA's NV token rows (its rows rounded up to 8) of A as N.
template <int MODE, int NV>
__device__ __forceinline__ void w_tile(int &s, uint32_t &ph, uint32_t ring, uint32_t bars, uint32_t stg, int cw, int t,
                                       int KT, const CUtensorMap *tmo, uint16_t *__restrict__ out, int N, int row0,
                                       int rows, int col0, uint32_t &sc) {
  constexpr int H2 = NV / 2;
  float d[NV];
#pragma unroll
  for (int i = 0; i < NV; i++) d[i] = 0.f;
  const int lane = t & 31;
  const uint32_t wb = ring + A_W_BYTES;
  const uint32_t m0 = MODE == GATE_UP ? 64 * cw : 128 * cw, m1 = MODE == GATE_UP ? 128 + 64 * cw : 128 * cw + 64;
  const uint64_t dw0 = smem_desc(wb + m0 * BK * 2), dw1 = smem_desc(wb + m1 * BK * 2), dx = smem_desc(ring);
  int prev = 0;
  for (int kb = 0; kb < KT; kb++) {
    mbar_wait(bars + 8u * (uint32_t)s, ph);
    const uint64_t off = (uint64_t)(s * (STAGE_W_BYTES >> 4));
    wgmma_fence();
    fence_acc(d);
#pragma unroll
    for (int k = 0; k < BK / 16; k++) {
      wgmma_n<NV, 0>(d, dw0 + off + 2 * k, dx + off + 2 * k, kb > 0 || k > 0);
      wgmma_n<NV, H2>(d, dw1 + off + 2 * k, dx + off + 2 * k, kb > 0 || k > 0);
    }
    wgmma_commit();
    // With four stages, the group of the previous k block retired: its slot is free.  With three,
    // this k block's own (the other warpgroup's group keeps the tensor cores busy meanwhile), so
    // that the producer still has two slots to fill ahead.
    wgmma_wait<(STAGES_W > 3)>();
    fence_acc(d);
    if (STAGES_W > 3 && kb > 0) release_slot<2>(bars + 8u * (uint32_t)(STAGES_W + prev), lane);
    if (STAGES_W <= 3) release_slot<2>(bars + 8u * (uint32_t)(STAGES_W + s), lane);
    prev = s;
    if (++s == STAGES_W) s = 0, ph ^= 1u;
  }
  wgmma_wait<0>();
  fence_acc(d);
  if (STAGES_W > 3) release_slot<2>(bars + 8u * (uint32_t)(STAGES_W + prev), lane);
  w_epilogue<MODE, NV>(d, stg, tmo, out, N, row0, rows, col0, t, sc);
}
#endif

// ---- the GEMM ----
//
// out [C, N] for the tiles of the work list:
//   tma_a   A [C, K]: xs (gate_up, K = H) or h (down, K = F), box {64, 128}
//   tma_a_half  the same in boxes {64, 64}: a solo unit's halves, one from each CTA (CM = 2);
//           WT: in boxes {64, 32}
//   tma_a8  WT: the same in boxes {64, 8} (a CTA's rows in boxes of 128, 32 and 8 rows)
//   tma_b   W as [b_rows, K]: w_gate_up [EL * 2F, H] or w_down [EL * H, F], box {64, 128}
//   tma_out WT: out [C, N] in boxes {16, 32}, 32-byte swizzle (w_epilogue's bulk stores)
//   N       output columns: F (h) or H (ys); F: the up rows' offset inside an expert (gate_up)
//   waves   this pass's wave gate counter (units whose copies are all issued, summed over the
//           CTAs), or null: no gate
// WT = false: the row tiles of the work list (decode); WT = true (CM = 2): weights-as-M tiles
// (decode_w).  Two instantiations, so that neither path's code is compiled into the other
// (PERF.md: in one kernel, a transposed path slowed the row tiles' by 1.5-2%).
template <int MODE, int CM, bool WT>
__global__ void __launch_bounds__(THREADS, 1)
    sm90_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_a_half,
                     const __grid_constant__ CUtensorMap tma_a8, const __grid_constant__ CUtensorMap tma_b,
                     const __grid_constant__ CUtensorMap tma_out, uint16_t *__restrict__ out,
                     const int *__restrict__ meta, int EL, int NT, int KT, int N, int F, int b_rows, int *waves) {
#if defined(MOE_SM90A)
  static_assert(!WT || CM == 2, "a weights-as-M unit is split between the two CTAs of a cluster");
  constexpr int STAGE = WT ? STAGE_W_BYTES : STAGE_BYTES, A_SLOT = WT ? A_W_BYTES : A_BYTES;
  constexpr int STG = WT ? STG_W_BYTES : STG_BYTES, NST = WT ? STAGES_W : STAGES;
  extern __shared__ unsigned char smem_raw[];
  // The same offsets in every CTA (no static shared memory), which multicast relies on.
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t staging = ring + NST * STAGE;
  const uint32_t bars = staging + 2 * STG; // full[NST], then empty[NST]
  auto full_bar = [&](int s) { return bars + 8u * (uint32_t)s; };
  auto empty_bar = [&](int s) { return bars + 8u * (uint32_t)(NST + s); };

  // warp-uniform by construction (a shuffle from lane 0), which ptxas needs to see to keep the
  // wgmma of the consumer branch asynchronous
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
  const int rank = CM > 1 ? (int)cluster_ctarank() : 0;
  const int cid = CM > 1 ? (int)cluster_id_x() : (int)blockIdx.x;
  const int ncl = CM > 1 ? (int)cluster_count_x() : (int)gridDim.x;

  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; s++) {
      mbar_init(full_bar(s), 1);           // the local producer's arrive.expect_tx (+ the bytes)
      mbar_init(empty_bar(s), 8 * CM);     // one arrival per consumer warp of every CTA of the cluster
    }
    fence_mbarrier_init();
  }
  // The barriers are initialised before any thread (of either CTA) uses them.
  if (CM > 1) {
    __syncwarp(); // barrier.cluster.*.aligned: the warp converged again after thread 0's branch
    cluster_sync();
  } else {
    __syncthreads();
  }

  const int units = WT ? __ldg(meta + 5 * EL + 4) * NT // weights-as-M units
                        : __ldg(meta + EL) * NT + __ldg(meta + 2 * EL + 1) * ((NT + CM - 1) / CM); // pairs, solos

  if (wg == 0) {
    setmaxnreg_dec<PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      prefetch_tmap(&tma_a);
      if (CM > 1) prefetch_tmap(&tma_a_half);
      if (WT) prefetch_tmap(&tma_a8);
      prefetch_tmap(&tma_b);
      int s = 0;
      uint32_t ph = 0;
      const int slack = min(WAVE_SLACK, ncl * CM);
      bool gate = waves != nullptr; // false once a wait timed out (it still counts its units)
      int wave = 0;
      for (int v = cid; v < units; v += ncl, wave++) {
        if (gate && wave > 0) gate = wave_wait(waves, wave * ncl * CM - slack);
        const Work w = WT ? decode_w(v, meta, EL, NT, rank) : decode<CM>(v, meta, EL, NT, rank);
        int b0, b1;
        if (MODE == GATE_UP) b0 = w.e * 2 * F + w.n * (BN / 2), b1 = b0 + F; // gate rows, up rows
        else b0 = w.e * N + w.n * BN, b1 = b0 + BN / 2;
        // past the last weight row (down, H % 256 != 0): any in-range box; its columns are not stored
        b0 = min(b0, b_rows - 1), b1 = min(b1, b_rows - 1);
        for (int kb = 0; kb < KT; kb++) {
          mbar_wait(empty_bar(s), ph ^ 1u); // every consumer warp of the cluster is done with slot s
          const uint32_t sa = ring + (uint32_t)(s * STAGE), sb = sa + A_SLOT;
          if (WT) { // the rows the consumers read, rounded up to 8, in boxes of 128, 32 and 8
            const int n8 = w.rows > 0 ? (w.rows + 7) & ~7 : 0;
            mbar_expect_tx(full_bar(s), (uint32_t)(n8 * BK * 2 + 2 * B_HALF));
            int r = 0;
            for (; r + 128 <= n8; r += 128)
              tma_load(sa + (uint32_t)(r * BK * 2), &tma_a, kb * BK, w.row0 + r, full_bar(s));
            for (; r + 32 <= n8; r += 32)
              tma_load(sa + (uint32_t)(r * BK * 2), &tma_a_half, kb * BK, w.row0 + r, full_bar(s));
            for (; r < n8; r += 8) tma_load(sa + (uint32_t)(r * BK * 2), &tma_a8, kb * BK, w.row0 + r, full_bar(s));
          } else {
            mbar_expect_tx(full_bar(s), STAGE_BYTES);
            if (CM > 1 && w.solo) // both CTAs on this row tile: each loads half its rows for both
              tma_load_multicast(sa + (uint32_t)(rank * A_BYTES / 2), &tma_a_half, kb * BK, w.row0 + rank * (BM / 2),
                                 full_bar(s), (uint16_t)((1u << CM) - 1u));
            else
              tma_load(sa, &tma_a, kb * BK, w.row0, full_bar(s));
          }
          if (!WT && (CM == 1 || w.solo)) {
            tma_load(sb, &tma_b, kb * BK, b0, full_bar(s));
            tma_load(sb + B_HALF, &tma_b, kb * BK, b1, full_bar(s));
          } else {
            tma_load_multicast(sb + (uint32_t)(rank * B_HALF), &tma_b, kb * BK, rank ? b1 : b0, full_bar(s),
                               (uint16_t)((1u << CM) - 1u));
          }
          if (++s == NST) s = 0, ph ^= 1u;
        }
        if (waves) atomicAdd(waves, 1);
      }
    }
  } else {
    setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1, t = (int)threadIdx.x & 127, lane = t & 31;
    const uint32_t stg = staging + (uint32_t)(cw * STG);
    const uint64_t da0 = smem_desc(ring + (uint32_t)(cw * 64 * BK * 2)); // this warpgroup's 64 rows of A
    const uint64_t db0 = smem_desc(ring + A_BYTES);
    auto release = [&](int s) { release_slot<CM>(empty_bar(s), lane); };
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.f;
    int s = 0;
    uint32_t sc = 0; // WT: the warp's staging slots so far (w_epilogue)
    uint32_t ph = 0;
    for (int v = cid; v < units; v += ncl) {
      if constexpr (WT) {
        const Work w = decode_w(v, meta, EL, NT, rank);
        // uniform over the warpgroup, as wgmma requires
        const int nv = __shfl_sync(0xffffffffu, w.rows > 0 ? (w.rows + 7) & ~7 : 0, 0);
        const int col0 = MODE == GATE_UP ? w.n * (BN / 2) + 64 * cw : w.n * BN + 128 * cw;
        switch (nv) {
#define MOE_W_TILE(n) \
  case n: w_tile<MODE, n>(s, ph, ring, bars, stg, cw, t, KT, &tma_out, out, N, w.row0, w.rows, col0, sc); break;
          MOE_W_TILE(8) MOE_W_TILE(16) MOE_W_TILE(24) MOE_W_TILE(32) MOE_W_TILE(40) MOE_W_TILE(48)
          MOE_W_TILE(56) MOE_W_TILE(64) MOE_W_TILE(72) MOE_W_TILE(80) MOE_W_TILE(88) MOE_W_TILE(96)
          MOE_W_TILE(104) MOE_W_TILE(112) MOE_W_TILE(120) MOE_W_TILE(128) MOE_W_TILE(136) MOE_W_TILE(144)
          MOE_W_TILE(152) MOE_W_TILE(160) MOE_W_TILE(168) MOE_W_TILE(176)
#if MOE_W_NV_MAX > 176
          MOE_W_TILE(184) MOE_W_TILE(192) MOE_W_TILE(200)
#endif
#undef MOE_W_TILE
        default: // no rows: keep the ring in step (as below)
          for (int kb = 0; kb < KT; kb++) {
            mbar_wait(full_bar(s), ph);
            release(s);
            if (++s == NST) s = 0, ph ^= 1u;
          }
        }
        continue;
      }
      const Work w = decode<CM>(v, meta, EL, NT, rank);
      const int my_rows = w.rows - cw * 64; // rows of the expert among this warpgroup's 64
      // uniform over the warpgroup, as wgmma requires
      const bool active = __shfl_sync(0xffffffffu, my_rows, 0) > 0 && w.n < NT;
      if (active) {
        int prev = 0;
        for (int kb = 0; kb < KT; kb++) {
          mbar_wait(full_bar(s), ph);
          const uint64_t off = (uint64_t)(s * (STAGE_BYTES >> 4));
          wgmma_fence();
          fence_acc(d);
#pragma unroll
          for (int k = 0; k < BK / 16; k++) // D[64 x 256] (+)= A[64 x 16] . B[256 x 16]^T
            wgmma_n<BN, 0>(d, da0 + off + 2 * k, db0 + off + 2 * k, kb > 0 || k > 0);
          wgmma_commit();
          wgmma_wait<1>(); // the group of the previous k block has retired: its slot is free
          fence_acc(d);
          if (kb > 0) release(prev);
          prev = s;
          if (++s == NST) s = 0, ph ^= 1u;
        }
        wgmma_wait<0>();
        fence_acc(d);
        release(prev);
        epilogue<MODE>(d, stg, out, N, w.row0 + cw * 64, my_rows, w.n * (MODE == GATE_UP ? BN / 2 : BN), 1 + cw, t);
      } else {
        // No rows here: keep the ring in step (wait for each stage, which also keeps this
        // warpgroup from arriving twice in one phase) and hand every stage straight back.
        for (int kb = 0; kb < KT; kb++) {
          mbar_wait(full_bar(s), ph);
          release(s);
          if (++s == NST) s = 0, ph ^= 1u;
        }
      }
    }
  }
  // WT: every bulk store of a consumer warp is complete before its CTA leaves.  Here, after the
  // roles' branches: at the end of the consumers' branch ptxas ran out of registers for the
  // accumulators (6.7 KB of spills and serialised wgmma, CUDA 13.0).
  if (WT && MOE_W_TMA_STORE && wg > 0 && (threadIdx.x & 31) == 0) bulk_wait_all();
  // No CTA leaves while its peer may still arrive on its barriers.
  if (CM > 1) {
    __syncwarp();
    cluster_sync();
  }
#else
  // Built without sm_90a (the host pass cannot tell sm_90 from sm_90a): a stub the host
  // recognises by its 16 bytes of static shared memory (sm90a_built) and never launches.
  __shared__ volatile unsigned char stub_marker[16];
  stub_marker[threadIdx.x & 15] = 1;
  __trap();
#endif
}

// ---- host side ----

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

encode_tiled_fn encode_tiled() {
  static const encode_tiled_fn fn = []() -> encode_tiled_fn {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = NULL;
    (void)cudaGetLastError();
    return reinterpret_cast<encode_tiled_fn>(p);
  }();
  return fn;
}

// A row-major bf16 [rows, k] matrix as a 2D tensor map with a {box_k, box_rows} box, 128B
// swizzle (a WT output map: {16, 32}, 32B).  (The smaller boxes of run() describe the same
// tensors as maps that succeeded with 128 rows.)
bool encode_2d(CUtensorMap *m, const void *base, long long rows, long long k, int box_rows = BM, int box_k = BK,
               CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  encode_tiled_fn fn = encode_tiled();
  if (!fn) return false;
  const cuuint64_t dim[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  const cuuint64_t stride[1] = {(cuuint64_t)k * 2};
  const cuuint32_t box[2] = {(cuuint32_t)box_k, (cuuint32_t)box_rows};
  const cuuint32_t estride[2] = {1, 1};
  return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dim, stride, box, estride,
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

// Was the kernel built for sm_90a?  The stub that stands in for it otherwise has static shared
// memory and the real kernel has none; an image for another architecture fails the query.
bool sm90a_built() {
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, sm90_gemm_kernel<GATE_UP, 1, false>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return fa.sharedSizeBytes == 0;
}

// Clusters (CM > 1) or CTAs (CM = 1) that fit on the device at once: the persistent grid.
// Cached per device and kernel; 0 when none fit.
template <int MODE, int CM, bool WT> int resident_groups(int dev) {
  static std::atomic<int> cache[64];
  if (dev >= 0 && dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c - 1;
  }
  auto kernel = sm90_gemm_kernel<MODE, CM, WT>;
  constexpr int smem = smem_bytes<WT>();
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (CM == 1) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    n = sms * per_sm;
  } else {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CM, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(CM * 64, 1, 1);
    cfg.blockDim = dim3(THREADS, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
  }
  if (dev >= 0 && dev < 64) cache[dev].store(n + 1, std::memory_order_relaxed);
  return n;
}

template <int MODE, int CM, bool WT>
cudaError_t launch_gemm(cudaStream_t stream, int groups, const CUtensorMap &ta, const CUtensorMap &ta_half,
                        const CUtensorMap &ta8, const CUtensorMap &tb, const CUtensorMap &tout, uint16_t *out,
                        const int *meta, int EL, int NT, int KT, int N, int F, int b_rows, int *waves) {
  auto kernel = sm90_gemm_kernel<MODE, CM, WT>;
  constexpr int smem = smem_bytes<WT>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CM, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3((unsigned)(groups * CM), 1, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = CM > 1 ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, kernel, ta, ta_half, ta8, tb, tout, out, meta, EL, NT, KT, N, F, b_rows, waves);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

int unsupported(moe_ctx *ctx, const char *why) {
  return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "experts (sm90): %s", why);
}

// WT (CM = 2 only): the weights-as-M kernel (decode_w); else the row tiles (decode).
template <int CM, bool WT>
int run(moe_ctx *ctx, const moe_experts_args *a, int dev, const CUtensorMap &t_xs, const CUtensorMap &t_wgu,
        const CUtensorMap &t_wdn) {
  static const char *stage = "experts";
  const long long C = a->xs->shape[0], H = a->xs->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  // units per column tile, whatever the offsets: row tiles, or WT units (at most ceil(rows / (2
  // NV_MAX)) an expert, and none on an empty one)
  const long long tmax = WT ? C / (2 * NV_MAX) + (EL < C ? EL : C) : (C + BM - 1) / BM + (EL < C ? EL : C);
  const int nt_gu = (int)((F + BN / 2 - 1) / (BN / 2)), nt_dn = (int)((H + BN - 1) / BN);
  // grids: all that fit at once, no more than the most units a pass can have
  const int fit_gu = resident_groups<GATE_UP, CM, WT>(dev), fit_dn = resident_groups<DOWN, CM, WT>(dev);
  if (fit_gu <= 0 || fit_dn <= 0) return unsupported(ctx, "no CTA of the kernel fits on the device");
  const int g_gu = (int)(tmax * nt_gu < fit_gu ? tmax * nt_gu : fit_gu);
  const int g_dn = (int)(tmax * nt_dn < fit_dn ? tmax * nt_dn : fit_dn);

  cudaStream_t stream;
  int rc = moeI_cuda_ctx_stream(ctx, dev, &stream);
  if (rc) return rc;

  // scratch: meta = pairs [EL + 1], solos [EL + 1], lo [EL], hi [EL], waves [2], wunits [EL + 1] ints,
  // then h [C, F] bf16
  const size_t meta_bytes = ((size_t)(5 * EL + 5) * sizeof(int) + 255) & ~(size_t)255;
  const size_t h_bytes = (size_t)C * (size_t)F * 2;
  void *scratch = NULL;
  cudaError_t err = cudaMallocAsync(&scratch, meta_bytes + h_bytes, stream);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "experts: cannot allocate %zu bytes of device scratch on cuda:%d",
                      meta_bytes + h_bytes, dev);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, "%s: cudaMallocAsync(scratch, %zu bytes) failed at %s:%d: %s: %s", stage,
                      meta_bytes + h_bytes, __FILE__, __LINE__, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  int *meta = (int *)scratch;
  // the wave gate (see the header): where CTAs share operands, and its counts fit an int
  const bool gate = C >= 2 * BM * EL && tmax * (nt_gu > nt_dn ? nt_gu : nt_dn) * CM < INT_MAX;
  uint16_t *h = (uint16_t *)((char *)scratch + meta_bytes);
  uint16_t *ys = (uint16_t *)a->ys->data;

  const char *what = "map launch";
  // A in boxes of half a tile's rows, for a solo unit's multicast: pairs only (CM = 1 is passed
  // the full maps, which it never reads as halves); WT: in boxes of 32 and of 8 rows
  // the outputs h and ys in the WT epilogue's boxes (the row tiles are passed h's map, unread)
  CUtensorMap t_h, t_h_half, t_xs_half = t_xs, t_h8, t_xs8 = t_xs, t_h_out, t_ys_out;
  bool maps = encode_2d(&t_h, h, C, F);
  t_h_half = t_h8 = t_h_out = t_ys_out = t_h;
  const int half = WT ? 32 : BM / 2;
  if (maps && CM > 1) maps = encode_2d(&t_h_half, h, C, F, half) && encode_2d(&t_xs_half, a->xs->data, C, H, half);
  if (maps && WT) maps = encode_2d(&t_h8, h, C, F, 8) && encode_2d(&t_xs8, a->xs->data, C, H, 8);
  if (maps && WT)
    maps = encode_2d(&t_h_out, h, C, F, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B) &&
           encode_2d(&t_ys_out, ys, C, H, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B);
  if (!maps) {
    what = "cuTensorMapEncodeTiled(h, or the smaller boxes)";
    err = cudaErrorInvalidValue;
  } else {
    sm90_map_kernel<<<1, MAP_THREADS, 0, stream>>>(meta, (const int *)a->expert_offsets->data, (int)EL, (int)C, CM,
                                                   WT);
    err = cudaGetLastError();
  }
  int *waves = gate ? meta + 4 * EL + 2 : nullptr;
  if (err == cudaSuccess) {
    what = "gate_up launch";
    err = launch_gemm<GATE_UP, CM, WT>(stream, g_gu, t_xs, t_xs_half, t_xs8, t_wgu, t_h_out, h, meta, (int)EL, nt_gu,
                                       (int)(H / BK), (int)F, (int)F, (int)(EL * 2 * F), waves);
  }
  if (err == cudaSuccess) {
    what = "down launch";
    err = launch_gemm<DOWN, CM, WT>(stream, g_dn, t_h, t_h_half, t_h8, t_wdn, t_ys_out, ys, meta, (int)EL, nt_dn,
                                    (int)(F / BK), (int)H, (int)F, (int)(EL * H), waves ? waves + 1 : nullptr);
  }
  // Given back after the launches on the same stream, so the kernels are done with it first;
  // on a failed launch it is given back all the same.
  cudaError_t ferr = cudaFreeAsync(scratch, stream);
  if (err == cudaSuccess && ferr != cudaSuccess) what = "cudaFreeAsync(scratch)", err = ferr;
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, "%s: %s failed at %s:%d: %s: %s", stage, what, __FILE__, __LINE__,
                      cudaGetErrorName(err), cudaGetErrorString(err));
  }
  return moeI_ok(ctx);
}

} // namespace

// Tried first by moeI_experts_cuda on a compute capability 9.0 device.  Everything that can make it
// unsuitable is checked before anything is allocated or launched, so MOE_ERR_UNSUPPORTED leaves
// no trace but the context's message.
extern "C" int moeI_experts_sm90_cuda(moe_ctx *ctx, const moe_experts_args *a) {
  const long long C = a->xs->shape[0], H = a->xs->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int dev = a->xs->device.index;
  char why[256];

  int major = 0, minor = 0, optin = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return unsupported(ctx, "cannot read the device's compute capability");
  }
  if (major != 9 || minor != 0) {
    snprintf(why, sizeof why, "needs compute capability 9.0, cuda:%d has %d.%d", dev, major, minor);
    return unsupported(ctx, why);
  }
  if (optin < SMEM_BYTES) {
    snprintf(why, sizeof why, "needs %d bytes of shared memory per block, cuda:%d offers %d", SMEM_BYTES, dev, optin);
    return unsupported(ctx, why);
  }
  if (!sm90a_built()) return unsupported(ctx, "the library was not built for sm_90a");
  if (H <= 0 || F <= 0 || H % BK || F % BK) {
    snprintf(why, sizeof why, "needs H and F positive multiples of %d, got H = %lld, F = %lld", BK, H, F);
    return unsupported(ctx, why);
  }
  if (!aligned16(a->xs->data) || !aligned16(a->ys->data) || !aligned16(a->w_gate_up->data) ||
      !aligned16(a->w_down->data))
    return unsupported(ctx, "needs xs, ys, w_gate_up and w_down 16-byte aligned");
  const long long lim = 1ll << 30;
  if (C >= lim || EL >= lim || EL * 2 * F > INT_MAX || EL * H > INT_MAX) {
    snprintf(why, sizeof why, "needs C < 2^30 and EL * 2F, EL * H < 2^31, got C = %lld, EL = %lld, H = %lld, F = %lld",
             C, EL, H, F);
    return unsupported(ctx, why);
  }
  if (C == 0 || EL == 0) { // nothing to write; still leave the context on the right device
    cudaStream_t stream;
    int rc = moeI_cuda_ctx_stream(ctx, dev, &stream);
    return rc ? rc : moeI_ok(ctx);
  }
  const long long tmax = (C + BM - 1) / BM + (EL < C ? EL : C);
  const long long nt = (F + BN / 2 - 1) / (BN / 2) > (H + BN - 1) / BN ? (F + BN / 2 - 1) / (BN / 2) : (H + BN - 1) / BN;
  if (tmax * nt > INT_MAX) {
    snprintf(why, sizeof why, "C = %lld, H = %lld, F = %lld give more than 2^31 tiles", C, H, F);
    return unsupported(ctx, why);
  }
  if (!encode_tiled()) return unsupported(ctx, "the driver offers no cuTensorMapEncodeTiled");
  CUtensorMap t_xs, t_wgu, t_wdn;
  if (!encode_2d(&t_xs, a->xs->data, C, H) || !encode_2d(&t_wgu, a->w_gate_up->data, EL * 2 * F, H) ||
      !encode_2d(&t_wdn, a->w_down->data, EL * H, F))
    return unsupported(ctx, "cuTensorMapEncodeTiled refused a tensor");

  // Clusters of two at every size: the pair halves the B traffic from L2 (647 vs 603 TFLOP/s at
  // the Kimi K2 shape on the H200), and with 129-255 rows an expert one CTA a tile read the
  // weights twice from DRAM (48 experts of 160 or 192 rows: 2.13-2.15 ms against 1.45); at 1-48
  // rows the pair is 0.4-6% ahead, at 96-128 1-2% behind (PERF.md).  Where the experts average two
  // row tiles or more, the weights-as-M tiles (PERF.md: Kimi K2 under the power cap 674-698
  // TFLOP/s against 628-642 for the row tiles in the same calls; over experts.lua's 72
  // configurations, both forced in one call, ahead on average in every preset, Qwen3.5-397B's F =
  // 1024 included: 611.6 against 604.4; at exactly 256 rows an expert, two full row tiles, the row
  // tiles are 5% ahead); else the row tiles, as in decode (8 rows an expert: 1.000 ms against
  // 1.055).
  // MOE_EXPERTS_KERNEL=sm90x1, sm90x2 or sm90w forces one; otherwise a device that cannot place
  // a cluster of two gets one CTA a tile.
  const char *sel = getenv("MOE_EXPERTS_KERNEL");
  if (sel && strcmp(sel, "sm90x1") == 0) return run<1, false>(ctx, a, dev, t_xs, t_wgu, t_wdn);
  const bool forced = sel && (strcmp(sel, "sm90x2") == 0 || strcmp(sel, "sm90w") == 0);
  const bool wt = forced ? strcmp(sel, "sm90w") == 0 : C >= 2 * BM * EL;
  const int rc = wt ? run<2, true>(ctx, a, dev, t_xs, t_wgu, t_wdn) : run<2, false>(ctx, a, dev, t_xs, t_wgu, t_wdn);
  if (rc != MOE_ERR_UNSUPPORTED || forced) return rc;
  return run<1, false>(ctx, a, dev, t_xs, t_wgu, t_wdn);
}
