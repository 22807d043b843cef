/* SPDX-License-Identifier: MIT */
// sm90.cuh -- the Hopper kernels of stage 4 (sm_90a): the grouped SwiGLU MLP on the copy engine
// (TMA) and the warpgroup tensor-core instructions (wgmma).  This file: the frame's sizes, the map
// kernel that builds the work list, and what both tilings share; sm90_rows.cuh and sm90_wt.cuh
// hold the two tilings, sm90_gemm.cuh the kernel, sm90.cu the host side.
//
// Same contract and the same three launches as the mma kernel (mma.cu), the cross-check:
//
//   map      one block turns expert_offsets (read on the device) into, per expert, its rows
//            [lo, hi) -- the clamped running maximum moeI_experts_cpu reads -- and the prefixes of
//            its pairs of row tiles and of its row tiles left over (sm90_rows.cuh), or of its
//            weights-as-M units (sm90_wt.cuh).
//   gate_up  h [C, F] = bf16(silu(xs . W_gate^T) * (xs . W_up^T)).  A tile's B operand is 128
//            gate rows f0.. and the 128 up rows F + f0.., so the gate and the up accumulator of
//            an output element sit in the same thread and SwiGLU is applied in the epilogue.
//   down     ys [C, H] = h . W_down^T, 256 output columns per tile.
//
// The GEMM kernel (one per pass) is persistent and warp-specialised, 384 threads:
//   warpgroup 0     the producer: one thread walks the work list and issues TMA bulk tensor
//                   copies (128B swizzle) into a ring of shared memory, each stage completing on
//                   its "full" mbarrier by transaction bytes.  It keeps 40 registers
//                   (setmaxnreg.dec).
//   warpgroups 1-2  the consumers: wgmma.mma_async bf16 -> f32 with both operands read from
//                   shared memory through descriptors, up to 128 accumulators per thread
//                   (setmaxnreg.inc to 232).  A warp hands a stage back by arriving on its
//                   "empty" mbarrier once its wgmma group that read it has retired.
// Two tilings, each its own instantiation of the kernel so that neither path's code is compiled
// into the other's: the row tiles (WT = false, sm90_rows.cuh; sm90x2 in clusters of two, sm90x1
// one CTA a tile) and the weights-as-M tiles (WT = true, sm90_wt.cuh; sm90w).
//
// The grid is static (sized from C alone, persistent, one CTA per SM), so a captured CUDA graph
// stays right for any offsets written later; units past the real count are never visited.
// Rows: a tile never mixes experts; A rows past the expert's end (the next expert's rows, rows
// past C: TMA fills those with zeros) are loaded but never stored, and a row of the output
// depends on its own A row alone.
//
// The wave gate: the CTAs in flight together share their operands in L2 only while they are
// near the same k block; left alone they drift apart over a pass's many waves and read the
// operands from DRAM several times over (docs/perf/experts.md).  So a producer starts its
// wave-th unit once all but WAVE_SLACK of the grid's CTAs have issued every copy of their wave
// before (a counter in the scratch, zeroed by the map kernel, one per pass).  Only where the
// experts average two row tiles or more: with fewer, as in decode, hardly two CTAs read the
// same weights and the gate only costs.  The gate times the copies; what is computed does not
// depend on it.  It assumes the persistent grid is resident at once; should it not be (another
// kernel holding SMs), a wait gives up after WAVE_WAIT_NS and that CTA stops waiting for the
// rest of the pass, so it can cost time but never hang.
//
// Requirements (else the selector's CANNOT, checked before any side effect): compute capability
// 9.0, H and F multiples of 64 (whole K blocks; F > 0), every tensor 16-byte aligned, EL * 2F
// and EL * H below 2^31.  Column tiles may run past F (gate_up, F % 128 == 64) or past H (down,
// H % 256 != 0): those B rows belong to the up half, the next expert or nothing (zero fill), and
// the columns they feed are not stored.
#pragma once

#include <cuda.h> // CUtensorMap only; no libcuda symbol is used
#include <stdint.h>

#include "../sm90/ptx.cuh"
#include "../sm90/wgmma.cuh"
#include "experts.cuh"

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
// time.
constexpr int NV_MAX = 200;
constexpr int STAGES_W = 3;
constexpr int A_W_BYTES = NV_MAX * BK * 2;             // 25 KiB
constexpr int STAGE_W_BYTES = A_W_BYTES + 2 * B_HALF;  // 57 KiB
// A consumer's staging: per warp STG_SLOTS slots of 32 tokens x 16 bf16 outputs, which the
// bulk tensor stores read while the warp goes on.
constexpr int STG_SLOTS = 4;
constexpr int STG_W_BYTES = 4 * STG_SLOTS * 32 * 32;
constexpr int SMEM_W_BYTES = STAGES_W * STAGE_W_BYTES + 2 * STG_W_BYTES + 2 * STAGES_W * 8 + 1024;
[[maybe_unused]] constexpr int WAVE_SLACK = 16;          // CTAs a wave may start without
[[maybe_unused]] constexpr unsigned WAVE_WAIT_NS = 200000;  // several times a unit's time at Kimi K2's shape
[[maybe_unused]] constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232; // 128 * (40 + 2 * 232) <= 64 Ki registers

static_assert(STAGE_BYTES % 1024 == 0 && A_BYTES % 1024 == 0 && B_HALF % 1024 == 0,
              "every TMA destination and wgmma operand starts on a 1024-byte swizzle atom");
static_assert(SMEM_BYTES <= 232448 && SMEM_W_BYTES <= 232448, "fits the 227 KiB a Hopper block may opt in to");
static_assert(STAGE_W_BYTES % 1024 == 0 && A_W_BYTES % 1024 == 0, "the WT ring on 1024-byte swizzle atoms too");
template <bool WT> constexpr int smem_bytes() { return WT ? SMEM_W_BYTES : SMEM_BYTES; }

// ---- the work list, built by the map kernel (its prefixes) and decoded by the GEMM ----

// meta = pairs [EL + 1], solos [EL + 1] (exclusive prefixes of each expert's pairs of row tiles
// and of its row tiles left over, see decode), lo [EL], hi [EL], the wave gate's two counters
// (gate_up, down), zeroed here, and wunits [EL + 1].  With unit_rows > 0 (a weights-as-M kernel,
// CM = 2: 2 NV_MAX, or the FP8 kernel's 2 NVM), no pairs and no solos: an expert's rows are
// wunits units of at most unit_rows (decode_w).  With pair_rows > 0 too (the FP8 narrow tiles,
// decode_narrow), an expert of at most pair_rows rows is one unit and any other twice its units.
__global__ void __launch_bounds__(MAP_THREADS) sm90_map_kernel(int *meta, const int *offsets, int EL, int C, int cm,
                                                                int unit_rows, int pair_rows = 0) {
  const bool wt = unit_rows > 0;
  __shared__ int ws[32];
  int *pairs = meta, *solos = pairs + EL + 1, *lo = solos + EL + 1, *hi = lo + EL, *waves = hi + EL;
  int *wunits = waves + 2;
  int carry_m = 0, carry_p = 0, carry_s = 0, carry_w = 0;
  // Launched as a programmatic dependent (fp8.cu), the GEMM after it may start its prologue now
  // (it waits for this kernel before it reads meta), and this kernel waits for the one before it
  // before it reads offsets or writes meta (which the previous call's GEMMs may still read).
  pdl_launch_dependents();
  pdl_wait();
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
    int nw = e < EL && wt ? (end - m + unit_rows - 1) / unit_rows : 0;
    if (pair_rows > 0 && end - m > pair_rows) nw *= 2;
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
  int solo; // each CTA loads weights of its own (decode: an odd last row tile; decode_narrow: two column tiles)
};

// Inside a band of at most GB items (row tiles or pairs) x nc column tiles, the item varies
// fastest, so that the CTAs in flight together share the band's A rows and a few B column tiles.
__device__ __forceinline__ void raster(int local, int items, int nc, int GB, int *item, int *col) {
  const int band = local / (GB * nc), first = band * GB, nb = min(GB, items - first);
  const int l = local - band * GB * nc;
  *item = first + l % nb, *col = l / nb;
}

#if defined(MOE_SM90A)
// The wave gate's wait (see the header): true once *count >= need, false after WAVE_WAIT_NS.
__device__ __forceinline__ bool wave_wait(const int *count, int need) {
  const volatile int *c = count;
  if (*c >= need) return true;
  const uint64_t t0 = global_ns();
  while (*c < need)
    if (global_ns() - t0 > WAVE_WAIT_NS) return false;
  return true;
}

// A warp hands slot s back to the producer of every CTA of the cluster once its wgmma group that
// read the slot has retired.
template <int CM> __device__ __forceinline__ void release_slot(uint32_t empty, int lane) {
  if (lane == 0) {
    if (CM == 1) mbar_arrive_local(empty);
    else
      for (int c = 0; c < CM; c++) mbar_arrive_cluster(empty, (uint32_t)c);
  }
}

// A consumer warpgroup without rows in a unit keeps the ring in step: it waits for each of the
// unit's KT stages (which also keeps it from arriving twice in one phase) and hands each straight
// back.  bars: the ring's full[NST], then its empty[NST] mbarriers.
template <int CM, int NST>
__device__ __forceinline__ void skip_stages(int &s, uint32_t &ph, uint32_t bars, int KT, int lane) {
  for (int kb = 0; kb < KT; kb++) {
    mbar_wait(bars + 8u * (uint32_t)s, ph);
    release_slot<CM>(bars + 8u * (uint32_t)(NST + s), lane);
    if (++s == NST) s = 0, ph ^= 1u;
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (the lower column) in the low half
  return *reinterpret_cast<uint32_t *>(&v);
}

// silu(g) * u.  The fast exponential and division differ from moeI_experts_cpu's expf and '/' by a
// few ulp of f32, far under the bf16 rounding that follows; e^-g = inf gives -0 as there.
__device__ __forceinline__ float swiglu(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }
#endif // MOE_SM90A

} // namespace
