/* SPDX-License-Identifier: MIT */
// sm90_gemm.cuh -- the Hopper GEMM kernel: the frame of sm90.cuh (barriers, the producer's copies,
// the consumers' walk of the work list) around the row tiles (sm90_rows.cuh) and the
// weights-as-M tiles (sm90_wt.cuh).
#pragma once

#include "sm90_rows.cuh"
#include "sm90_wt.cuh"

namespace {

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
// (docs/perf/experts.md: in one kernel, the transposed path slowed the row tiles).
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
#define W_TILE_CASE(n) \
  case n: w_tile<MODE, n>(s, ph, ring, bars, stg, cw, t, KT, &tma_out, out, N, w.row0, w.rows, col0, sc); break;
          W_TILE_CASE(8) W_TILE_CASE(16) W_TILE_CASE(24) W_TILE_CASE(32) W_TILE_CASE(40) W_TILE_CASE(48)
          W_TILE_CASE(56) W_TILE_CASE(64) W_TILE_CASE(72) W_TILE_CASE(80) W_TILE_CASE(88) W_TILE_CASE(96)
          W_TILE_CASE(104) W_TILE_CASE(112) W_TILE_CASE(120) W_TILE_CASE(128) W_TILE_CASE(136) W_TILE_CASE(144)
          W_TILE_CASE(152) W_TILE_CASE(160) W_TILE_CASE(168) W_TILE_CASE(176) W_TILE_CASE(184) W_TILE_CASE(192)
          W_TILE_CASE(200)
#undef W_TILE_CASE
        default: // no rows
          skip_stages<CM, NST>(s, ph, bars, KT, lane);
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
          // D[64 x 256] (+)= A[64 x 64] . B[256 x 64]^T; the previous k block's slot is then free
          wgmma_slot_wait_prev<BN, BK / 16>(d, da0, db0, off, kb == 0);
          if (kb > 0) release(prev);
          prev = s;
          if (++s == NST) s = 0, ph ^= 1u;
        }
        wgmma_wait<0>();
        fence_acc(d);
        release(prev);
        epilogue<MODE>(d, stg, out, N, w.row0 + cw * 64, my_rows, w.n * (MODE == GATE_UP ? BN / 2 : BN), 1 + cw, t);
      } else {
        skip_stages<CM, NST>(s, ph, bars, KT, lane);
      }
    }
  }
  // WT: every bulk store of a consumer warp is complete before its CTA leaves.  Here, after the
  // roles' branches: at the end of the consumers' branch ptxas runs out of registers for the
  // accumulators (spills and serialised wgmma: docs/perf/experts.md).
  if (WT && wg > 0 && (threadIdx.x & 31) == 0) bulk_wait_all();
  // No CTA leaves while its peer may still arrive on its barriers.
  if (CM > 1) {
    __syncwarp();
    cluster_sync();
  }
#else
  MOE_SM90A_STUB();
#endif
}

} // namespace
