/* SPDX-License-Identifier: MIT */
// sm90_wt.cuh -- the weights-as-M tiles of the Hopper kernel (WT = true; sm90w): the frame of
// sm90.cuh, clusters of two and B multicast, with the operands' roles swapped.  A consumer
// warpgroup's 128 weight rows of the B tile (gate_up: 64 gate rows and the 64 up rows of the same
// outputs) are wgmma's M, in two accumulators, and the CTA's tokens its N, which can be any
// multiple of 8 up to NV_MAX = 200: so an expert of r rows is cut into u = ceil(r / 400) units of
// two CTAs x nv = ceil(r / 2u) rows (rounded up to 8), and pays for about its rows instead of
// whole 128-row tiles (Kimi K2's 1,195 rows: 6 x 200 = 1,200 row slots, where the row tiles take
// 1,280 and run the last pair, 171 rows, at a whole pair's time).  wgmma m64nNk16 for each N
// (sm90/wgmma.cuh), the tokens loaded in boxes of 128, 32 and 8 rows, the epilogue through
// stmatrix .trans, each warp on its own outputs, 32 tokens at a time, which go out as bulk tensor
// stores that overlap the next unit's MMAs (w_epilogue).  A stage of 200 tokens and 256 weight
// rows is 57 KiB, so the ring has 3 stages, and a consumer hands a slot back once its own group
// that read it has retired (the other warpgroup's group keeps the tensor cores busy meanwhile),
// which leaves the producer two slots ahead as the row tiles' 4 stages do.
#pragma once

#include "sm90.cuh"

namespace {

// The expert that unit v belongs to, expert e's first unit being wunits[e] x per (the map kernel's
// row units times the column tiles, or pairs of them, each makes); not empty as v < units.
__device__ __forceinline__ int unit_expert(int v, const int *__restrict__ wunits, int EL, int per) {
  int a = 0, b = EL - 1;
  while (a < b) { // the last expert whose first unit is <= v
    const int mid = (a + b + 1) >> 1;
    if (__ldg(wunits + mid) * per <= v) a = mid;
    else b = mid - 1;
  }
  return a;
}

// Unit v of the weights-as-M kernel -> this CTA's tile.  An expert of r rows has u = ceil(r / (2
// NV_MAX)) units per column tile, each of 2 nv rows (nv = ceil(r / 2u) rounded up to 8), the
// first nv to the cluster's first CTA, the rest to the second (fewer, or none, in the expert's
// last unit).  The two share the column tile's 256 weight rows (each loads one half and
// multicasts it); the tokens are wgmma's N, so a CTA's time follows its own rows rounded up to 8,
// not to a whole tile.  Inside an expert, bands of W_BAND units (~2,000 rows, as the row tiles'
// bands) x the column tiles, the unit varying fastest: the units in flight together read the same
// weights, and a band's token rows stay in L2 while its column tiles go by (with one band for
// all of a large expert's units, the tokens would come from DRAM again for every column tile).
constexpr int W_BAND = 6;

// PACKED (the FP8 tokens-as-M tiles, whose two consumer warpgroups take 64 rows each whatever a
// CTA's rows): every CTA of an expert's units takes NVM rows, but the last ones, which take what
// is left (possibly none), so that an expert of r rows fills ceil(r / 64) warpgroups' rows, where
// rows split evenly (nv rounded up to 8) would fill 2 u of them each time nv exceeds 64.
template <int NVM = NV_MAX, bool PACKED = false>
__device__ __forceinline__ Work decode_w(int v, const int *__restrict__ meta, int EL, int NT, int rank) {
  const int *lo = meta + 2 * EL + 2, *hi = lo + EL, *wunits = hi + EL + 2;
  const int a = unit_expert(v, wunits, EL, NT);
  const int u = __ldg(wunits + a + 1) - __ldg(wunits + a), local = v - __ldg(wunits + a) * NT;
  const int l0 = __ldg(lo + a), r = __ldg(hi + a) - l0;
  // <= NVM: u = ceil(r / (2 NVM)) (the map kernel)
  const int nv = PACKED ? NVM : ((r + 2 * u - 1) / (2 * u) + 7) & ~7;
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

// Unit v of the FP8 narrow tiles (for decode), where the weights stream through once and what
// bounds their rate is the weight bytes a CTA has in flight.  An expert of r <= NVM rows is one
// unit a pair of column tiles: the cluster's two CTAs take all r rows and the column tiles 2 p and
// 2 p + 1 (past an odd NT the second has none: rows 0), each loading its own 256 weight rows
// (solo: no multicast), so all its bytes in flight are its own.  A larger expert is decode_w's u =
// ceil(r / 2 NVM) units a column tile (the rows split, the weights multicast), counted as 2 u a pair
// of column tiles (the map kernel's wunits with pair_rows NVM), a last column NT past an odd NT
// empty for both CTAs.  Split into units of NVM rows instead, such an expert's weights would go to
// the SMs once a unit.
template <int NVM>
__device__ __forceinline__ Work decode_narrow(int v, const int *__restrict__ meta, int EL, int NT, int rank) {
  const int *lo = meta + 2 * EL + 2, *hi = lo + EL, *wunits = hi + EL + 2;
  const int NP = (NT + 1) / 2;
  const int a = unit_expert(v, wunits, EL, NP);
  const int nw = __ldg(wunits + a + 1) - __ldg(wunits + a), local = v - __ldg(wunits + a) * NP;
  const int l0 = __ldg(lo + a), r = __ldg(hi + a) - l0;
  Work w;
  w.e = a;
  if (r <= NVM) {
    w.n = 2 * local + rank;
    w.solo = 1;
    w.row0 = l0;
    w.rows = r;
  } else {
    const int u = nw / 2, nv = ((r + 2 * u - 1) / (2 * u) + 7) & ~7;
    int j;
    raster(local, u, 2 * NP, W_BAND, &j, &w.n);
    w.solo = 0;
    w.row0 = l0 + (2 * j + rank) * nv;
    w.rows = min(nv, l0 + r - w.row0);
  }
  if (w.n >= NT) w.rows = 0;
  return w;
}

#if defined(MOE_SM90A)

// Where token n's half h (the warp's outputs 8 h .. 8 h + 7) lies in a staging slot: a token a
// 32-byte row, its two halves swapped every 4 rows (the bulk copy's 32-byte swizzle).
__device__ __forceinline__ uint32_t w_slot_at(uint32_t wst, int n, int h) {
  return wst + (uint32_t)(n * 32 + ((h ^ ((n >> 2) & 1)) << 4));
}

// The warp's 16 outputs of tokens c0 .. c0 + 31 into slot wst as bf16, an 8 x 8 block a stmatrix
// .trans fragment: gate_up SwiGLU(gate, up), down pass p's sums.
template <int MODE, int NV>
__device__ __forceinline__ void w_stage(const float (&d)[NV], uint32_t wst, int c0, int p, int lane) {
  constexpr int H2 = NV / 2;
  const int mat = lane >> 3, ri = lane & 7; // the matrix and memory row this lane addresses
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
    const uint32_t addr = w_slot_at(wst, 8 * (jn + (mat >> 1)) + ri - c0, mat & 1);
    if (8 * (jn + 1) < NV) stmatrix_x4_trans(addr, r[0], r[1], r[2], r[3]);
    else stmatrix_x2_trans(addr, r[0], r[1]); // the last block of 8 tokens alone
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
  const int lane = t & 31, q = t >> 5;
  const uint32_t wst0 = stg + (uint32_t)(q * STG_SLOTS * 1024);
  constexpr int PASSES = MODE == GATE_UP ? 1 : 2;
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
#pragma unroll
    for (int c0 = 0; c0 < NV; c0 += 32) {
      if (c0 >= rows) break; // uniform: rows is the warpgroup's
      const uint32_t wst = wst0 + (sc % STG_SLOTS) * 1024u;
      sc++;
      if (lane == 0) bulk_wait_read<STG_SLOTS - 1>(); // the slot's last store has read it
      __syncwarp(); // ... and the warp's own last reads of it are done
      w_stage<MODE, NV>(d, wst, c0, p, lane);
      const int here = min(32, rows - c0);
      const int col = col0 + p * 64 + 16 * q;
      if (here == 32) {
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
          const uint4 v = ld_shared_v4(w_slot_at(wst, n, h));
          if (col < N) *reinterpret_cast<uint4 *>(out + (long long)(row0 + c0 + n) * N + col + 8 * h) = v;
        }
        if (lane == 0) bulk_commit(); // an empty group: one group a slot
      }
    }
  }
}

// A consumer warpgroup's tile: its 128 weight rows (gate_up: 64 gate rows and the 64 up rows of
// the same outputs; down: 128 outputs) as wgmma's M, in two accumulators, times the CTA's NV
// token rows (its rows rounded up to 8) of A as N.
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
    // This k block's own group retired, so its slot is free: with three stages, waiting for the
    // previous block's group only would leave the producer one slot to fill ahead, not two (the
    // other warpgroup's group keeps the tensor cores busy meanwhile).
    wgmma_wait<0>();
    fence_acc(d);
    release_slot<2>(bars + 8u * (uint32_t)(STAGES_W + s), lane);
    if (++s == STAGES_W) s = 0, ph ^= 1u;
  }
  wgmma_wait<0>();
  fence_acc(d);
  w_epilogue<MODE, NV>(d, stg, tmo, out, N, row0, rows, col0, t, sc);
}
#endif // MOE_SM90A

} // namespace
