/* SPDX-License-Identifier: MIT */
// sm90_rows.cuh -- the row tiles of the Hopper kernel (WT = false; sm90x2, sm90x1): a CTA's tile
// is 128 rows of A (two consumer warpgroups of 64) x 256 rows of B, wgmma m64n256k16, 128
// accumulators a thread; 128 x 256 x 64 (M x N x K), 48 KiB a stage: 4 stages + 32 KiB of
// staging = 225 KiB.  The epilogue goes through a swizzled shared-memory tile to 16-byte stores
// predicated on the expert's rows.
//
// CM = 2 (sm90x2) launches clusters of two CTAs.  On a pair of row tiles 2p and 2p+1 of an
// expert (same column tile) each CTA loads one half of the shared B tile and multicasts it to
// both, so the L2 -> SM traffic per tile falls from 48 to 32 KiB a stage.  A stage is then
// written by both CTAs' copies, so each CTA's consumers hand it back to both producers (remote
// mbarrier arrivals), and the CTAs of the pair walk the same work list in lock step.  When an
// expert's row tiles are odd in number, the last one runs "solo": the two CTAs on that row tile
// and two column tiles, each loading its own B and half of the shared A rows (multicast to both:
// tma_a_half, boxes of 64 rows), still in lock step, so that neither idles through a tile its
// partner has and it has not (as a pair, such a tile would cost a whole pair's time).  CM = 1
// (sm90x1, one CTA a tile) runs where a cluster of two cannot be placed.
//
// Work list (decode): per expert, in order, its pairs x column tiles, then its row tile left over
// (CM = 1: all of them) x groups of CM column tiles.  Inside each, GROUP_TILES row tiles are a
// band and inside a band the row tile varies fastest, so the CTAs in flight together share the
// band's A rows and a few B column tiles in L2.  A consumer warpgroup whose 64 rows hold none of
// the expert's skips its tensor-core work (an expert's last, short tile), and so do both where a
// solo unit has one column tile fewer than CM (NT odd).
#pragma once

#include "sm90.cuh"

namespace {

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

#if defined(MOE_SM90A)
// A consumer warpgroup's 64 rows x 2 ACC columns of accumulators (m64n(2 ACC): bf16's n256, ACC =
// 128; the FP8 row tiles' n128, ACC = 64): register i of lane l holds row 16q + l/4 + 8 ((i/2) %
// 2), column 8 (i/4) + 2 (l%4) + (i%2).  gate_up: gate column c and its up column ACC + c, ACC
// outputs; down: 2 ACC outputs in two passes.  A pass goes through the consumer's 64 x ACC staging
// tile (2 ACC-byte rows), which keeps 16-byte chunk c of row r at chunk c ^ (r & 7): the 4-byte
// writes of a warp (8 rows x 4 lanes) and the 16-byte reads of each quarter warp (8 chunks of one
// row) both touch 32 distinct banks.
template <int MODE, int ACC>
__device__ __forceinline__ void epilogue(float (&d)[ACC], uint32_t stg, uint16_t *__restrict__ out, int N, int row0,
                                         int rows, int col0, int bar_id, int t) {
  constexpr int CH = ACC / 8, ROW = 16 * CH; // 16-byte chunks a staging row, its bytes
  const int lane = t & 31;
  const int sw = lane >> 2; // (row & 7) of both rows this thread writes
  const uint32_t wbase = stg + (uint32_t)(((t >> 5) * 16 + (lane >> 2)) * ROW + (lane & 3) * 4);
  constexpr int PASSES = MODE == GATE_UP ? 1 : 2; // ACC output columns per pass
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    named_bar_sync(bar_id, 128); // the staging tile's previous readers are done
#pragma unroll
    for (int j = 0; j < CH; j++) {
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        float v0, v1;
        if (MODE == GATE_UP) { // gate column c in register i, its up column ACC + c in i + ACC / 2
          const int i = j * 4 + hh * 2;
          v0 = swiglu(d[i], d[i + ACC / 2]);
          v1 = swiglu(d[i + 1], d[i + ACC / 2 + 1]);
        } else {
          const int i = (p * CH + j) * 4 + hh * 2;
          v0 = d[i];
          v1 = d[i + 1];
        }
        st_shared_b32(wbase + (uint32_t)(hh * 8 * ROW + ((j ^ sw) << 4)), pack_bf16(v0, v1));
      }
    }
    named_bar_sync(bar_id, 128);
#pragma unroll
    for (int q = 0; q < CH / 2; q++) {
      const int idx = t + 128 * q, r = idx / CH, ch = idx % CH;
      const uint4 v = ld_shared_v4(stg + (uint32_t)(r * ROW + ((ch ^ (r & 7)) << 4)));
      const int col = col0 + p * ACC + ch * 8;
      if (r < rows && col < N) *reinterpret_cast<uint4 *>(out + (long long)(row0 + r) * N + col) = v;
    }
  }
}
#endif // MOE_SM90A

} // namespace
