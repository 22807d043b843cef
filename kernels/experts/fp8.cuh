/* SPDX-License-Identifier: MIT */
// fp8.cuh -- the FP8 experts GEMM on Hopper (moe_experts_fp8) on block-scaled e4m3 operands, in
// four tilings, each its own instantiation of one kernel (NVM: 0 for the row tiles, else the
// width of decode_w's units; TM: the tokens-as-M tiles):
//
//   sm90x2_fp8  the row tiles (ROWS): sm90_rows.cuh's work list (decode: pairs of 128-row tiles
//               sharing the weights by multicast, an odd last tile solo with the rows' halves
//               multicast) with the tokens as wgmma's M (64 a consumer warpgroup) and 128 weight
//               rows as its N (gate_up: 64 gate and the 64 up rows of the same outputs; down: 128
//               outputs), m64n128k32.  A k block's group is issued into one of two fresh
//               accumulators before the other's, the block before, is waited for and promoted, so
//               that a promotion does not leave the warpgroup without a group on the tensor
//               cores.  6 stages of 33 KiB.  Slower than sm90t_fp8 and sm90w_fp8 wherever
//               measured (docs/perf/experts.md), so fp8.cu runs it only when forced.
//   sm90t_fp8   the tokens-as-M tiles (TM): sm90w_fp8's units (packed: 128 rows a CTA but an
//               expert's last ones) and stages, a consumer warpgroup's 64 of the CTA's tokens as
//               wgmma's M and each 128-row weight half as its N (m64n128k32), so a thread's
//               promotion takes two token scales; gate_up's epilogue quantizes h (t8_epilogue_q8),
//               down's sends its tile out by bulk tensor stores (t8_epilogue_down).  The default
//               where the experts average more than 64 rows.
//   sm90w_fp8   the weights-as-M tiles (!ROWS): sm90_wt.cuh's frame (clusters of two sharing 256
//               weight rows by multicast, the tokens as wgmma's N, decode_w's units, w_epilogue's
//               bulk stores for down), up to 128 tokens a CTA; 3 stages of 49 KiB.  gate_up's
//               epilogue writes h quantized for down (w_epilogue_q8); the row tiles write it in
//               bf16 and fp8.cu quantizes it in a launch of its own.  Only when forced.
//   sm90w_fp8_n32  the same frame, up to 32 tokens a CTA; 5 stages of 37 KiB; an expert of at
//               most 32 rows a cluster's two CTAs take as two column tiles, each loading its own
//               256 weight rows, a larger one as sm90w_fp8 does (decode_narrow).  Where the
//               experts have few rows (decode) the weights stream through once, and what bounds
//               their rate is the bytes in flight: the stages a CTA fills ahead, all its own.
//
// A stage is one k block of 128: 128 e4m3 bytes a row, the same 128-byte swizzle rows as bf16's
// 64 columns, so the descriptors, boxes and k32 slices (32 bytes) are bf16's byte for byte.  A
// stage also brings the CTA's tokens' scales of that k block (x_scale is [K/128, C]: one box of
// S8_COUNT floats from the first token rounded down to 4, since a box starts on 16 bytes).  A
// weight scale is one float a k block for 128 weight rows, read from global memory (L1).
//
// Promotion: the tensor cores' f32 sums over a whole K would drift from the block-scaled sum the
// format defines, so each k block's products go into a fresh accumulator (scale_d = 0 on its
// first k32 slice), which is then added into the running one times x_scale * w_scale.
//
// sm90w_fp8's fresh accumulator holds one 64-row slice (NV / 2 registers) and the running ones
// both (NV): the gate and the up slice (or down's two output slices) take turns, each waited for
// and promoted while the other consumer warpgroup's MMAs keep the tensor cores busy.  NV8_MAX =
// 128 tokens keeps 192 accumulator registers and 32 token scales a thread under the consumers'
// 232.  sm90x2_fp8 holds 64 running and 2 x 64 fresh accumulators and two token scales a thread;
// sm90t_fp8 128 running, 64 fresh and two token scales.
#pragma once

#include "../token_block.cuh"
#include "sm90_rows.cuh"
#include "sm90_wt.cuh"

namespace {

constexpr int NV8_MAX = 128;                             // tokens a CTA (wgmma N), the wider tiling
constexpr int NV8_NARROW = 32;                           // the narrower one (decode)
constexpr int BK8 = 128;                                 // k a stage: one scale block, 128 bytes a row
constexpr int S8_COUNT = NV8_MAX + 4;                    // a box of scales: from the CTA's first token rounded
                                                         // down to 4 (a box starts on 16 bytes)
constexpr int S8_BYTES = 1024;                           // their slot
// The weights-as-M tiles of at most NVM tokens a CTA: a stage holds NVM token rows, so the narrow
// tiling's ring is deeper (5 stages of 37 KiB against 3 of 49), more weight bytes in flight where
// they stream through once (decode).
template <int NVM> constexpr int stage8_bytes() { return NVM * BK8 + 2 * B_HALF + S8_BYTES; }
template <int NVM> constexpr int stages8() { return NVM == NV8_MAX ? 3 : 5; }
// The narrow tiling's units (decode_narrow): an expert of at most NVM rows a pair of column tiles,
// each CTA loading its own weights; the wider tiling's all decode_w's (one column tile, the rows
// split, the weights multicast).
template <int NVM> constexpr bool narrow_units() { return NVM == NV8_NARROW; }
// What the map kernel's units multiply for NT column tiles: the narrow tiling's pairs of them.
template <int NVM> __host__ __device__ constexpr int unit_columns(int NT) {
  return narrow_units<NVM>() ? (NT + 1) / 2 : NT;
}
// gate_up's epilogue quantizing h (w_epilogue_q8): the 8 consumer warps' amaxes of the NVM
// tokens, in two buffers (a unit's, the next unit's)
template <int NVM> constexpr int amax8_bytes() { return 2 * 8 * NVM * 4; }
template <int NVM> constexpr int smem_w8_bytes() {
  return stages8<NVM>() * stage8_bytes<NVM>() + 2 * STG_W_BYTES + 2 * stages8<NVM>() * 8 + amax8_bytes<NVM>() + 1024;
}
// The tokens-as-M tiles: a consumer warpgroup's staging holds its whole down tile (64 tokens x
// 256 outputs in bf16) for the bulk stores (t8_epilogue_down); no amax exchange.
constexpr int STG_T8_BYTES = 64 * 256 * 2;
constexpr int SMEM_T8_BYTES =
    stages8<NV8_MAX>() * stage8_bytes<NV8_MAX>() + 2 * STG_T8_BYTES + 2 * stages8<NV8_MAX>() * 8 + 1024;
static_assert(B_HALF == 128 * BK8, "a weight half is 128 rows of 128 e4m3, as of 64 bf16");
static_assert(stage8_bytes<NV8_MAX>() % 1024 == 0 && stage8_bytes<NV8_NARROW>() % 1024 == 0 &&
                  NV8_NARROW * BK8 % 1024 == 0, "operands on 1024-byte swizzle atoms");
static_assert(smem_w8_bytes<NV8_MAX>() <= 232448 && smem_w8_bytes<NV8_NARROW>() <= 232448 && SMEM_T8_BYTES <= 232448,
              "fits the 227 KiB a Hopper block may opt in to");
static_assert(S8_COUNT * 4 <= S8_BYTES && S8_COUNT * 4 % 16 == 0, "a stage's token scales fit their slot");
// The row tiles (ROWS): BM tokens x BN8 weight rows a CTA, the weights in halves of BN8 / 2 rows
// (a pair's CTAs load one each and multicast it), a consumer's staging 64 rows x 64 bf16.
constexpr int BN8 = 128;
constexpr int B8_HALF = BN8 / 2 * BK8;                                // 8 KiB
constexpr int STAGE_R8_BYTES = BM * BK8 + BN8 * BK8 + S8_BYTES;       // 33 KiB
constexpr int STAGES_R8 = 6;
constexpr int STG_R8_BYTES = 64 * 128;
constexpr int SMEM_R8_BYTES = STAGES_R8 * STAGE_R8_BYTES + 2 * STG_R8_BYTES + 2 * STAGES_R8 * 8 + 1024;
static_assert(BM * BK8 % 1024 == 0 && STAGE_R8_BYTES % 1024 == 0 && B8_HALF % 1024 == 0,
              "the row tiles' operands on 1024-byte swizzle atoms");
static_assert(SMEM_R8_BYTES <= 232448, "the row tiles' ring fits too");
// NVM: the weights-as-M tiles' width, or 0 for the row tiles; TM the tokens-as-M tiles (the
// kernel's template arguments).
template <int NVM, bool TM> constexpr int smem8_bytes() {
  return TM ? SMEM_T8_BYTES : NVM ? smem_w8_bytes<NVM>() : SMEM_R8_BYTES;
}

#if defined(MOE_SM90A)

// Register i of a thread's slice (m64nNV) holds token n = 8 (i / 4) + 2 (lane % 4) + (i % 2): i and
// i + 1 are two neighbouring tokens, i + 2 and i + 3 the same two in the row 8 further.  The
// thread's tokens' x_scales, xs[2 j + b] for token 8 j + 2 (lane % 4) + b, are read once a k block
// for both slices (scales: the CTA's first token's, in the stage).
template <int NV> __device__ __forceinline__ void token_scales(float (&xs)[NV / 4], uint32_t scales, int lane) {
#pragma unroll
  for (int j = 0; j < NV / 8; j++) {
    const uint32_t at = scales + (uint32_t)(4 * (8 * j + 2 * (lane & 3)));
    xs[2 * j] = ld_shared_f32(at), xs[2 * j + 1] = ld_shared_f32(at + 4);
  }
}
// d[OFF + i] += acc[i] * (x_scale of i's token * sw).
template <int NV, int OFF>
__device__ __forceinline__ void promote(float (&d)[NV], const float (&acc)[NV / 2], const float (&xs)[NV / 4],
                                        float sw) {
#pragma unroll
  for (int j = 0; j < NV / 8; j++) {
    const float s0 = xs[2 * j] * sw, s1 = xs[2 * j + 1] * sw;
    d[OFF + 4 * j + 0] = __fmaf_rn(acc[4 * j + 0], s0, d[OFF + 4 * j + 0]);
    d[OFF + 4 * j + 1] = __fmaf_rn(acc[4 * j + 1], s1, d[OFF + 4 * j + 1]);
    d[OFF + 4 * j + 2] = __fmaf_rn(acc[4 * j + 2], s0, d[OFF + 4 * j + 2]);
    d[OFF + 4 * j + 3] = __fmaf_rn(acc[4 * j + 3], s1, d[OFF + 4 * j + 3]);
  }
}

// One k block's 64-row slice into acc: four k32 slices, the first overwriting.
template <int NV>
__device__ __forceinline__ void slice_mma(float (&acc)[NV / 2], uint64_t dw, uint64_t dx) {
  wgmma_fence();
  fence_acc(acc);
#pragma unroll
  for (int k = 0; k < BK8 / 32; k++) wgmma_e4m3_n<NV, 0>(acc, dw + 2 * k, dx + 2 * k, k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(acc);
}

// gate_up's epilogue writing h quantized for down, as quantize_rows_kernel would from the bf16 h
// (the same amax, scale and q, so down's input is the same bit for bit).  A token block of 128
// outputs is the CTA's column tile, both consumer warpgroups' 64, so the eight warps meet: each
// stages its 16 outputs of a slot's 32 tokens in bf16 (w_stage: h rounded to bf16 before it is
// quantized, as the CPU's), a lane a token takes their amax into amax[warp][token], one named
// barrier (ids 1 and 2 are the row tiles'), then a lane reads its token's eight amaxes, quantizes
// its 16 (moeI_fp8_quantize_token: the division's byte, one division a token) and stores them (16
// bytes of hq [C, F]); the first warp stores the scales (hs [F / 128, C4]).  amax is the unit's
// buffer of two: the next unit writes the other, and it cannot come round to this one before
// every warp has passed the next unit's barrier, after its reads here.  The staging is all the
// warp's own (its STG_SLOTS slots hold 128 tokens; no bulk store uses it).
template <int NV>
__device__ __forceinline__ void w_epilogue_q8(const float (&d)[NV], uint32_t stg, uint32_t amax,
                                              uint8_t *__restrict__ hq, float *__restrict__ hs, int C4, int F,
                                              int row0, int rows, int col0, int cw, int t) {
  static_assert(NV <= 32 * STG_SLOTS, "a unit's tokens fit the warp's slots");
  const int lane = t & 31, q = t >> 5, warp = 4 * cw + q;
  const uint32_t wst0 = stg + (uint32_t)(q * STG_SLOTS * 1024);
  // the lane's token's 16 values (8 h .. 8 h + 7 in half h) from slot wst
  auto token16 = [&](uint32_t wst, float (&v)[16]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const uint4 r = ld_shared_v4(w_slot_at(wst, lane, h));
      float lo[4], hi[4];
      bf16x4(make_uint2(r.x, r.y), lo), bf16x4(make_uint2(r.z, r.w), hi);
#pragma unroll
      for (int i = 0; i < 4; i++) v[8 * h + i] = lo[i], v[8 * h + 4 + i] = hi[i];
    }
  };
#pragma unroll
  for (int c0 = 0; c0 < NV; c0 += 32) {
    if (c0 >= rows) break; // uniform: rows is the CTA's
    const uint32_t wst = wst0 + (uint32_t)(c0 / 32 * 1024);
    __syncwarp(); // the warp's reads of the slot, the last unit's, are done
    w_stage<GATE_UP, NV>(d, wst, c0, 0, lane);
    __syncwarp();
    if (c0 + lane < rows) {
      float v[16], m = 0.f;
      token16(wst, v);
#pragma unroll
      for (int i = 0; i < 16; i++) m = moeI_fp8_amax(m, v[i]);
      st_shared_b32(amax + 4u * (uint32_t)(warp * NV + c0 + lane), __float_as_uint(m));
    }
  }
  named_bar_sync(3, 256);
#pragma unroll 1 // (unrolled, ptxas spills in gate_up's main loop)
  for (int c0 = 0; c0 < NV; c0 += 32) {
    if (c0 >= rows) break;
    if (c0 + lane < rows) {
      float v[16], m = 0.f;
#pragma unroll
      for (int w = 0; w < 8; w++) m = fmaxf(m, ld_shared_f32(amax + 4u * (uint32_t)(w * NV + c0 + lane)));
      const float s = moeI_fp8_token_scale(m), r = 1.0f / s;
      token16(wst0 + (uint32_t)(c0 / 32 * 1024), v);
      uint32_t b[4] = {0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < 16; i++) b[i / 4] |= (uint32_t)moeI_fp8_quantize_token(v[i], s, r) << (8 * (i % 4));
      const long long row = row0 + c0 + lane;
      *reinterpret_cast<uint4 *>(hq + row * F + col0 + 16 * q) = make_uint4(b[0], b[1], b[2], b[3]);
      if (warp == 0) hs[(long long)(col0 / 128) * C4 + row] = s;
    }
  }
}

// A consumer warpgroup's tile: its 128 weight rows (gate_up: 64 gate and the 64 up rows of the
// same outputs; down: 128 outputs) x the CTA's NV tokens, over KT k blocks; ws0 and ws1 the two
// slices' weight scales (one a k block).  gate_up's h goes out quantized (w_epilogue_q8: hq, hs
// and C4, amax the exchange's two buffers, sc counting the units); down's out in bf16.
template <int MODE, int NV, int NVM>
__device__ __forceinline__ void w8_tile(int &s, uint32_t &ph, uint32_t ring, uint32_t bars, uint32_t stg, int cw,
                                        int t, int KT, const CUtensorMap *tmo, void *__restrict__ out, int N,
                                        int row0, int rows, int col0, uint32_t &sc, const float *__restrict__ ws0,
                                        const float *__restrict__ ws1, float *__restrict__ hs, int C4,
                                        uint32_t amax) {
  const uint32_t first_scale = 4u * (uint32_t)(row0 & 3); // where the box of scales has row0's (producer)
  constexpr int H2 = NV / 2;
  float d[NV];
#pragma unroll
  for (int i = 0; i < NV; i++) d[i] = 0.f;
  float acc[H2], xs[NV / 4];
  const int lane = t & 31;
  constexpr int STAGE = stage8_bytes<NVM>(), NST = stages8<NVM>();
  const uint32_t wb = ring + NVM * BK8;
  const uint32_t m0 = MODE == GATE_UP ? 64 * cw : 128 * cw, m1 = MODE == GATE_UP ? 128 + 64 * cw : 128 * cw + 64;
  const uint64_t dw0 = smem_desc(wb + m0 * BK8), dw1 = smem_desc(wb + m1 * BK8), dx = smem_desc(ring);
  for (int kb = 0; kb < KT; kb++) {
    const float sw0 = __ldg(ws0 + kb), sw1 = __ldg(ws1 + kb);
    mbar_wait(bars + 8u * (uint32_t)s, ph);
    const uint64_t off = (uint64_t)(s * (STAGE >> 4));
    const uint32_t scales = ring + (uint32_t)(s * STAGE + NVM * BK8 + 2 * B_HALF) + first_scale;
    slice_mma<NV>(acc, dw0 + off, dx + off);
    token_scales<NV>(xs, scales, lane);
    promote<NV, 0>(d, acc, xs, sw0);
    slice_mma<NV>(acc, dw1 + off, dx + off);
    promote<NV, H2>(d, acc, xs, sw1);
    __syncwarp(); // the warp's reads of the slot's scales are done
    release_slot<2>(bars + 8u * (uint32_t)(NST + s), lane);
    if (++s == NST) s = 0, ph ^= 1u;
  }
  if constexpr (MODE == GATE_UP)
    w_epilogue_q8<NV>(d, stg, amax + (sc++ & 1u) * (uint32_t)(amax8_bytes<NVM>() / 2), (uint8_t *)out, hs, C4, N,
                      row0, rows, col0, cw, t);
  else w_epilogue<MODE, NV>(d, stg, tmo, (uint16_t *)out, N, row0, rows, col0, t, sc);
}

// ---- the row tiles (ROWS) ----

__device__ __forceinline__ void next_slot(int &s, uint32_t &ph) {
  if (++s == STAGES_R8) s = 0, ph ^= 1u;
}

// Once slot s is full, its k block's products into acc, fresh (the first k32 slice overwrites):
// the warpgroup's 64 tokens (da) x the tile's 128 weight rows (db), one committed group.
__device__ __forceinline__ void r8_issue(float (&acc)[64], uint32_t bars, int s, uint32_t ph, uint64_t da,
                                         uint64_t db) {
  mbar_wait(bars + 8u * (uint32_t)s, ph);
  const uint64_t off = (uint64_t)(s * (STAGE_R8_BYTES >> 4));
  wgmma_fence();
  fence_acc(acc);
#pragma unroll
  for (int k = 0; k < BK8 / 32; k++) wgmma_e4m3_n<BN8, 0>(acc, da + off + 2 * k, db + off + 2 * k, k > 0);
  wgmma_commit();
}

// d[DOFF + i] += acc[AOFF + i] x its token's scale, for i < COUNT, in the tokens-as-M layout
// (m64nN: register i holds the thread's token a where i / 2 is even, a + 8 where it is odd): sa
// for a, sb for a + 8 (the row tiles' and sm90t_fp8's promotion).
template <int DOFF, int AOFF, int COUNT, int ND, int NA>
__device__ __forceinline__ void promote_rows(float (&d)[ND], const float (&acc)[NA], float sa, float sb) {
  static_assert(AOFF % 4 == 0 && DOFF + COUNT <= ND && AOFF + COUNT <= NA, "whole register quads in range");
#pragma unroll
  for (int i = 0; i < COUNT; i++) d[DOFF + i] = __fmaf_rn(acc[AOFF + i], (i >> 1) & 1 ? sb : sa, d[DOFF + i]);
}

// acc's group has retired: d += acc x its scales, then slot s goes back to both CTAs' producers.
// Register i holds the thread's token a (i / 2 even) or a + 8 (odd), from slot s's box of scales
// at `first` and 32 bytes on; and weight column 8 (i / 4) + ..: below 64 (i < 32) the gate
// rows' block, scale lo; the rest hi (down: both the same block).
__device__ __forceinline__ void r8_promote(float (&d)[64], float (&acc)[64], uint32_t ring, uint32_t bars, int s,
                                           uint32_t first, float lo, float hi, int lane) {
  fence_acc(acc);
  const uint32_t box = ring + (uint32_t)(s * STAGE_R8_BYTES + BM * BK8 + BN8 * BK8) + first;
  const float xa = ld_shared_f32(box), xb = ld_shared_f32(box + 32);
  promote_rows<0, 0, 32>(d, acc, xa * lo, xb * lo);
  promote_rows<32, 32, 32>(d, acc, xa * hi, xb * hi);
  __syncwarp(); // the warp's reads of the slot's scales are done
  release_slot<2>(bars + 8u * (uint32_t)(STAGES_R8 + s), lane);
}

// A consumer warpgroup's row tile: its 64 tokens (from row0, my_rows of them the expert's) x the
// tile's 128 weight rows over KT k blocks; ws_lo, ws_hi the weight scales of the two 64-row
// halves (a k block's float each).  A KT odd runs its first block alone; the rest in pairs, each
// block issued before the one before it is promoted, all in straight-line code (a wgmma issued
// under a condition makes ptxas serialize them all).
template <int MODE>
__device__ __forceinline__ void r8_tile(int &s, uint32_t &ph, uint32_t ring, uint32_t bars, uint32_t stg, int cw,
                                        int t, int KT, uint16_t *__restrict__ out, int N, int row0, int my_rows,
                                        int col0, uint32_t first, const float *__restrict__ ws_lo,
                                        const float *__restrict__ ws_hi) {
  const int lane = t & 31;
  const uint64_t da = smem_desc(ring + (uint32_t)(cw * 64 * BK8)), db = smem_desc(ring + (uint32_t)(BM * BK8));
  float d[64], acc0[64], acc1[64];
#pragma unroll
  for (int i = 0; i < 64; i++) d[i] = 0.f;
  int kb = 0;
  if (KT & 1) {
    const float lo = __ldg(ws_lo), hi = __ldg(ws_hi);
    r8_issue(acc0, bars, s, ph, da, db);
    wgmma_wait<0>();
    r8_promote(d, acc0, ring, bars, s, first, lo, hi, lane);
    next_slot(s, ph);
    kb = 1;
  }
  if (kb < KT) {
    int s0 = s, s1;
    float lo1, hi1;
    r8_issue(acc0, bars, s, ph, da, db);
    next_slot(s, ph);
    for (;; kb += 2) {
      const float lo0 = __ldg(ws_lo + kb), hi0 = __ldg(ws_hi + kb);
      lo1 = __ldg(ws_lo + kb + 1), hi1 = __ldg(ws_hi + kb + 1);
      s1 = s;
      r8_issue(acc1, bars, s, ph, da, db);
      next_slot(s, ph);
      wgmma_wait<1>();
      r8_promote(d, acc0, ring, bars, s0, first, lo0, hi0, lane);
      if (kb + 2 == KT) break;
      s0 = s;
      r8_issue(acc0, bars, s, ph, da, db);
      next_slot(s, ph);
      wgmma_wait<1>();
      r8_promote(d, acc1, ring, bars, s1, first, lo1, hi1, lane);
    }
    wgmma_wait<0>();
    r8_promote(d, acc1, ring, bars, s1, first, lo1, hi1, lane);
  }
  epilogue<MODE, 64>(d, stg, out, N, row0, my_rows, col0, 1 + cw, t);
}

// ---- the tokens-as-M tiles (TM) ----
//
// decode_w's units (packed) and sm90w_fp8's stages (NV8_MAX token rows, 256 weight rows in two
// halves), the roles swapped: a consumer warpgroup's 64 of the CTA's token rows are wgmma's M and
// each weight half its N (m64n128k32), the gate and the up slice in turn (down: the first 128
// outputs, then the next), each a fresh accumulator of 64 registers promoted into the running
// 128.  A thread's accumulators hold two tokens (m64n128: register i of lane l of warp q is token
// 16 q + l / 4 + 8 ((i / 2) % 2), weight row 8 (i / 4) + 2 (l % 4) + (i % 2)), so a promotion
// scales by two token scales times the slice's weight scale: 2 shared loads a k block, where the
// weights-as-M tiles' thread holds 32 tokens.

// gate_up's epilogue writing h quantized for down: h = SwiGLU(gate, up) rounded to bf16 (as the
// CPU's), a token's 128 outputs one scale block, held by the four lanes of a quad (32 each), so
// its amax is two shuffles away.  The e4m3 bytes go through the warpgroup's staging (64 rows of
// 128 bytes, 16-byte chunk c of row r at c ^ (r & 7): a warp's 2-byte writes, 8 rows x 4 lanes,
// meet no bank twice) to 16-byte stores of hq [C, F]; the quad's first lane stores its two
// tokens' scales (hs [F / 128, C4]).
__device__ __forceinline__ void t8_epilogue_q8(float (&d)[128], uint32_t stg, uint8_t *__restrict__ hq,
                                               float *__restrict__ hs, int C4, int F, int row0, int rows, int col0,
                                               int bar_id, int t) {
  const int lane = t & 31, ra = 16 * (t >> 5) + (lane >> 2); // the thread's tokens: ra, ra + 8
  float ma = 0.f, mb = 0.f;
#pragma unroll
  for (int i = 0; i < 64; i++) {
    const float h = __bfloat162float(__float2bfloat16_rn(swiglu(d[i], d[64 + i])));
    d[i] = h;
    if ((i >> 1) & 1) mb = moeI_fp8_amax(mb, h);
    else ma = moeI_fp8_amax(ma, h);
  }
#pragma unroll
  for (int o = 1; o < 4; o *= 2) {
    ma = fmaxf(ma, __shfl_xor_sync(0xffffffffu, ma, o));
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  }
  const float sa = moeI_fp8_token_scale(ma), sb = moeI_fp8_token_scale(mb), qa = 1.0f / sa, qb = 1.0f / sb;
  named_bar_sync(bar_id, 128); // the staging's previous readers are done
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const bool second = (i >> 1) & 1;
    const int r = ra + (second ? 8 : 0), j = i >> 2; // weight rows 8 j + 2 (l % 4) + 0, 1
    const float s = second ? sb : sa, q = second ? qb : qa;
    const uint16_t v = (uint16_t)(moeI_fp8_quantize_token(d[i], s, q) | moeI_fp8_quantize_token(d[i + 1], s, q) << 8);
    st_shared_b16(stg + (uint32_t)(r * 128 + (((j >> 1) ^ (r & 7)) << 4) + 8 * (j & 1) + 2 * (lane & 3)), v);
  }
  named_bar_sync(bar_id, 128);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int idx = t + 128 * k, r = idx >> 3, ch = idx & 7;
    const uint4 v = ld_shared_v4(stg + (uint32_t)(r * 128 + ((ch ^ (r & 7)) << 4)));
    if (r < rows) *reinterpret_cast<uint4 *>(hq + (long long)(row0 + r) * F + col0 + 16 * ch) = v;
  }
  if ((lane & 3) == 0) {
    float *scales = hs + (long long)(col0 / 128) * C4 + row0; // this block's scales of the rows
    if (ra < rows) scales[ra] = sa;
    if (ra + 8 < rows) scales[ra + 8] = sb;
  }
}

// down's epilogue: the warpgroup's 64 tokens x 256 outputs (col0 on) in bf16 into its staging as
// four boxes of 64 x 64 (128-byte rows, 16-byte chunk c of row r at c ^ (r & 7): TMA's 128-byte
// swizzle; a warp's 4-byte writes, 8 rows x 4 lanes, meet no bank twice).  A whole 64 rows go out
// as bulk tensor stores from the warpgroup's first thread, which drain while the next unit's MMAs
// run (the warpgroups' own stores cost ~3% of a pass at Kimi K2, docs/perf/experts.md); the next
// epilogue waits for their reads of the staging.  A part (an expert's last rows, the
// rows after them the next expert's) goes out by plain 16-byte stores.
__device__ __forceinline__ void t8_epilogue_down(const float (&d)[128], uint32_t stg, const CUtensorMap *tmo,
                                                 uint16_t *__restrict__ out, int N, int row0, int rows, int col0,
                                                 int bar_id, int t) {
  const int lane = t & 31, ra = 16 * (t >> 5) + (lane >> 2), sw = lane >> 2; // rows ra, ra + 8; ra & 7
  if (t == 0) bulk_wait_read<0>(); // the last unit's bulk stores have read the staging
  named_bar_sync(bar_id, 128);     // ... and so have the warpgroup's plain ones
#pragma unroll
  for (int j = 0; j < 32; j++) { // registers 4 j .. 4 j + 3: outputs 8 j + 2 (lane % 4) + 0, 1
    const uint32_t at = stg + (uint32_t)((j >> 3) * 8192 + ra * 128 + (((j & 7) ^ sw) << 4) + 4 * (lane & 3));
    st_shared_b32(at, pack_bf16(d[4 * j], d[4 * j + 1]));
    st_shared_b32(at + 8 * 128, pack_bf16(d[4 * j + 2], d[4 * j + 3]));
  }
  if (rows >= 64) {
    fence_proxy_async(); // the writes, seen by the bulk stores
    named_bar_sync(bar_id, 128);
    if (t == 0) {
      for (int b = 0; b < 4; b++)
        if (col0 + 64 * b < N) tma_store(tmo, col0 + 64 * b, row0, stg + (uint32_t)(b * 8192));
      bulk_commit();
    }
  } else {
    named_bar_sync(bar_id, 128);
#pragma unroll
    for (int k = 0; k < 16; k++) { // a warp one row's 32 chunks
      const int r = (t >> 5) + 4 * k, j = lane, col = col0 + 8 * j;
      const uint4 v = ld_shared_v4(stg + (uint32_t)((j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4)));
      if (r < rows && col < N) *reinterpret_cast<uint4 *>(out + (long long)(row0 + r) * N + col) = v;
    }
  }
}

// A consumer warpgroup's tokens-as-M tile: its 64 token rows (from row0, my_rows of them the
// expert's) x the 256 weight rows over KT k blocks; ws0, ws1 the two slices' weight scales (a k
// block's float each), first this thread's first token's scale in a stage's box (its second is 8
// tokens on).  gate_up's h goes out quantized (t8_epilogue_q8), down's in bf16 (t8_epilogue_down,
// through tmo).
template <int MODE>
__device__ __forceinline__ void t8_tile(int &s, uint32_t &ph, uint32_t ring, uint32_t bars, uint32_t stg, int cw,
                                        int t, int KT, const CUtensorMap *tmo, void *__restrict__ out,
                                        float *__restrict__ hs, int C4, int N, int row0, int my_rows, int col0,
                                        uint32_t first,
                                        const float *__restrict__ ws0, const float *__restrict__ ws1) {
  constexpr int STAGE = stage8_bytes<NV8_MAX>(), NST = stages8<NV8_MAX>();
  const int lane = t & 31;
  const uint32_t wb = ring + NV8_MAX * BK8;
  const uint64_t da = smem_desc(ring + (uint32_t)(cw * 64 * BK8)), db0 = smem_desc(wb), db1 = smem_desc(wb + B_HALF);
  float d[128], acc[64];
#pragma unroll
  for (int i = 0; i < 128; i++) d[i] = 0.f;
  for (int kb = 0; kb < KT; kb++) {
    const float sw0 = __ldg(ws0 + kb), sw1 = __ldg(ws1 + kb);
    mbar_wait(bars + 8u * (uint32_t)s, ph);
    const uint64_t off = (uint64_t)(s * (STAGE >> 4));
    const uint32_t box = ring + (uint32_t)(s * STAGE + NV8_MAX * BK8 + 2 * B_HALF) + first;
    const float xa = ld_shared_f32(box), xb = ld_shared_f32(box + 32);
    slice_mma<128>(acc, da + off, db0 + off);
    promote_rows<0, 0, 64>(d, acc, xa * sw0, xb * sw0);
    slice_mma<128>(acc, da + off, db1 + off);
    promote_rows<64, 0, 64>(d, acc, xa * sw1, xb * sw1);
    __syncwarp(); // the warp's reads of the slot's scales are done
    release_slot<2>(bars + 8u * (uint32_t)(NST + s), lane);
    if (++s == NST) s = 0, ph ^= 1u;
  }
  if constexpr (MODE == GATE_UP)
    t8_epilogue_q8(d, stg, (uint8_t *)out, hs, C4, N, row0, my_rows, col0, 1 + cw, t);
  else t8_epilogue_down(d, stg, tmo, (uint16_t *)out, N, row0, my_rows, col0, 1 + cw, t);
}

#endif // MOE_SM90A

// out [C, N] for the units of the work list (ROWS: decode<2>'s; else decode_w<NVM>'s, packed for
// TM): bf16, but for the weights-as-M and tokens-as-M tiles' gate_up, whose out is h's e4m3 [C, F]
// and out_scale its scales [F / 128, C4] (w_epilogue_q8, t8_epilogue_q8):
//   tma_a     A [C, K] e4m3 (x, or the quantized h) in boxes {128, 128 rows}
//   tma_a32   the same in boxes of 64 rows (ROWS: a solo unit's halves) or 32 rows
//   tma_b     W [b_rows, K] e4m3: w_gate_up [EL * 2F, H] or w_down [EL * H, F], box {128, BN8 / 2
//             rows} (ROWS) or {128, 128}
//   tma_sx    A's scales [K / 128, C4] f32 (C4: C rounded up to 4), box {S8_COUNT, 1}
//   tma_out   down's out in w_epilogue's boxes {16, 32} (!ROWS, !TM), t8_epilogue_down's {64, 64} (TM)
//   wscale    W's scales [EL, b_rows / EL / 128, K / 128]
//   N         output columns (F for gate_up, H for down); F the up rows' offset inside an expert
template <int MODE, int NVM, bool TM>
__global__ void __launch_bounds__(THREADS, 1)
    sm90_e4m3_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_a32,
                     const __grid_constant__ CUtensorMap tma_b,
                     const __grid_constant__ CUtensorMap tma_sx, const __grid_constant__ CUtensorMap tma_out,
                     void *__restrict__ out, float *__restrict__ out_scale, int C4, const float *__restrict__ wscale,
                     const int *__restrict__ meta, int EL, int NT, int KT, int N, int F, int b_rows, int *waves) {
#if defined(MOE_SM90A)
  constexpr bool ROWS = NVM == 0;
  static_assert(ROWS || NVM == NV8_MAX || NVM == NV8_NARROW, "a tiling whose ring stages8 sizes");
  static_assert(!TM || NVM == NV8_MAX, "the tokens-as-M tiles run on sm90w_fp8's stages");
  constexpr int NST = ROWS ? STAGES_R8 : stages8<NVM>(), STAGE = ROWS ? STAGE_R8_BYTES : stage8_bytes<NVM>();
  constexpr int STG = ROWS ? STG_R8_BYTES : TM ? STG_T8_BYTES : STG_W_BYTES, B_SLOT = ROWS ? BN8 * BK8 : 2 * B_HALF;
  constexpr int A_SLOT = ROWS ? BM * BK8 : NVM * BK8;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t staging = ring + NST * STAGE;
  const uint32_t bars = staging + 2 * STG; // full[NST], then empty[NST]
  const uint32_t amax = bars + 16u * NST;   // the weights-as-M tiles: w_epilogue_q8's exchange
  auto full_bar = [&](int s) { return bars + 8u * (uint32_t)s; };
  auto empty_bar = [&](int s) { return bars + 8u * (uint32_t)(NST + s); };

  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
  const int rank = (int)cluster_ctarank(), cid = (int)cluster_id_x(), ncl = (int)cluster_count_x();
  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; s++) {
      mbar_init(full_bar(s), 1);
      mbar_init(empty_bar(s), 8 * 2); // every consumer warp of both CTAs
    }
    fence_mbarrier_init();
  }
  __syncwarp();
  cluster_sync();

  constexpr bool NARROW = narrow_units<NVM>();
  auto work = [&](int v) {
    if constexpr (ROWS) return decode<2>(v, meta, EL, NT, rank);
    else if constexpr (NARROW) return decode_narrow<NVM>(v, meta, EL, NT, rank);
    else return decode_w<NVM, TM>(v, meta, EL, NT, rank);
  };
  if (threadIdx.x == 0) {
    prefetch_tmap(&tma_a);
    prefetch_tmap(&tma_a32);
    prefetch_tmap(&tma_b);
    prefetch_tmap(&tma_sx);
  }
  // Launched as a programmatic dependent (fp8.cu), the CTA gets here while the kernel before ends:
  // meta, the tokens and their scales, and out (which that kernel may still read) only past this
  // wait.  The next kernel may launch now; it waits for this one before it reads what it writes.
  pdl_wait();
  pdl_launch_dependents();
  __syncwarp(); // (setmaxnreg is .aligned)
  const int units = ROWS ? __ldg(meta + EL) * NT + __ldg(meta + 2 * EL + 1) * ((NT + 1) / 2) // pairs, solos
                         : __ldg(meta + 5 * EL + 4) * unit_columns<NVM>(NT);
  if (wg == 0) {
    setmaxnreg_dec<PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t ph = 0;
      const int slack = min(WAVE_SLACK, ncl * 2);
      bool gate = waves != nullptr;
      int wave = 0;
      for (int v = cid; v < units; v += ncl, wave++) {
        if (gate && wave > 0) gate = wave_wait(waves, wave * ncl * 2 - slack);
        const Work w = work(v);
        // the B rows of the two halves: gate_up its gate rows and the up rows of the same outputs
        constexpr int OUTS = MODE == GATE_UP ? (ROWS ? BN8 / 2 : BN / 2) : (ROWS ? BN8 : BN); // outputs a tile
        int b0, b1;
        if (MODE == GATE_UP) b0 = w.e * 2 * F + w.n * OUTS, b1 = b0 + F;
        else b0 = w.e * N + w.n * OUTS, b1 = b0 + OUTS / 2;
        b0 = min(b0, b_rows - 1), b1 = min(b1, b_rows - 1);
        const int n8 = w.rows > 0 ? (w.rows + 7) & ~7 : 0;
        for (int kb = 0; kb < KT; kb++) {
          mbar_wait(empty_bar(s), ph ^ 1u);
          const uint32_t sa = ring + (uint32_t)(s * STAGE), sb = sa + A_SLOT, ss = sb + B_SLOT;
          if constexpr (ROWS) {
            mbar_expect_tx(full_bar(s), (uint32_t)(A_SLOT + BN8 * BK8 + S8_COUNT * 4));
            if (w.solo) { // both CTAs on this row tile: each loads half its rows for both, and its own weights
              tma_load_multicast(sa + (uint32_t)(rank * A_SLOT / 2), &tma_a32, kb * BK8, w.row0 + rank * (BM / 2),
                                 full_bar(s), 3);
              tma_load(sb, &tma_b, kb * BK8, b0, full_bar(s));
              tma_load(sb + B8_HALF, &tma_b, kb * BK8, b1, full_bar(s));
            } else {
              tma_load(sa, &tma_a, kb * BK8, w.row0, full_bar(s));
              tma_load_multicast(sb + (uint32_t)(rank * B8_HALF), &tma_b, kb * BK8, rank ? b1 : b0, full_bar(s), 3);
            }
            tma_load(ss, &tma_sx, w.row0 & ~3, kb, full_bar(s)); // a box starts on 16 bytes
          } else {
            // The tokens in as few loads as waste at most 31 rows: one box of 128 above 96, else
            // boxes of 32.  The rows past n8 land in the slot unread.  (120 rows as one load instead
            // of 3 x 32 + 3 x 8: 4% faster at Kimi K2, docs/perf/experts.md.)
            const int boxed = NVM == NV8_MAX && n8 > 96 ? 128 : (n8 + 31) & ~31;
            const bool b_live = w.n < NT; // decode_narrow's units past an odd NT load no weights
            mbar_expect_tx(full_bar(s), (uint32_t)(boxed * BK8 + (b_live ? 2 * B_HALF : 0) + (n8 ? S8_COUNT * 4 : 0)));
            if (boxed == 128) tma_load(sa, &tma_a, kb * BK8, w.row0, full_bar(s));
            else
              for (int r = 0; r < boxed; r += 32)
                tma_load(sa + (uint32_t)(r * BK8), &tma_a32, kb * BK8, w.row0 + r, full_bar(s));
            if (n8) tma_load(ss, &tma_sx, w.row0 & ~3, kb, full_bar(s)); // a box starts on 16 bytes
            if (b_live && w.solo) { // both halves, its own
              tma_load(sb, &tma_b, kb * BK8, b0, full_bar(s));
              tma_load(sb + B_HALF, &tma_b, kb * BK8, b1, full_bar(s));
            } else if (b_live) {
              tma_load_multicast(sb + (uint32_t)(rank * B_HALF), &tma_b, kb * BK8, rank ? b1 : b0, full_bar(s), 3);
            }
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
    int s = 0;
    uint32_t sc = 0, ph = 0;
    const int nblk = b_rows / EL / 128; // weight-scale rows an expert
    for (int v = cid; v < units; v += ncl) {
      const Work w = work(v);
      if constexpr (ROWS || TM) { // the tokens as wgmma's M: a warpgroup's 64 of the CTA's rows
        const int my_rows = w.rows - cw * 64; // rows of the expert among this warpgroup's 64
        // uniform over the warpgroup, as wgmma requires
        if (__shfl_sync(0xffffffffu, my_rows, 0) > 0 && w.n < NT) {
          const float *ws = wscale + (long long)w.e * nblk * KT;
          // this thread's first token's scale in a stage's box (its second is 8 tokens on)
          const uint32_t first = 4u * (uint32_t)((w.row0 & 3) + cw * 64 + 16 * (t >> 5) + (lane >> 2));
          if constexpr (ROWS) {
            // the halves' weight-scale rows: gate_up the gate and the up block of the 64 outputs; down one block
            const int r0 = MODE == GATE_UP ? w.n / 2 : w.n, r1 = MODE == GATE_UP ? F / 128 + w.n / 2 : r0;
            r8_tile<MODE>(s, ph, ring, bars, stg, cw, t, KT, (uint16_t *)out, N, w.row0 + cw * 64, my_rows,
                          w.n * (MODE == GATE_UP ? BN8 / 2 : BN8), first, ws + r0 * KT, ws + r1 * KT);
          } else {
            // the slices' weight-scale rows: gate_up the gate and the up block of the column tile's
            // 128 outputs; down its two blocks of 128 (the second past H when H % 256 != 0: any
            // row, those are not stored)
            const int r0 = MODE == GATE_UP ? w.n : 2 * w.n, r1 = MODE == GATE_UP ? F / 128 + w.n : min(r0 + 1, nblk - 1);
            t8_tile<MODE>(s, ph, ring, bars, stg, cw, t, KT, &tma_out, out, out_scale, C4, N, w.row0 + cw * 64, my_rows,
                          w.n * (MODE == GATE_UP ? BN / 2 : BN), first, ws + r0 * KT, ws + r1 * KT);
          }
        } else {
          skip_stages<2, NST>(s, ph, bars, KT, lane);
        }
      } else {
        const int nv = __shfl_sync(0xffffffffu, w.rows > 0 ? (w.rows + 7) & ~7 : 0, 0);
        const int col0 = MODE == GATE_UP ? w.n * (BN / 2) + 64 * cw : w.n * BN + 128 * cw;
        // the slices' weight-scale rows: gate_up the gate block and the up block of the column tile;
        // down the warpgroup's 128 outputs (past H when H % 256 != 0: any row, those are not stored)
        const int r0 = MODE == GATE_UP ? w.n : min(2 * w.n + cw, nblk - 1);
        const int r1 = MODE == GATE_UP ? F / 128 + w.n : r0;
        const float *ws0 = wscale + ((long long)w.e * nblk + r0) * KT, *ws1 = wscale + ((long long)w.e * nblk + r1) * KT;
        switch (nv) {
#define W8_TILE_CASE(n)                                                                                          \
  case n:                                                                                                        \
    if constexpr (n <= NVM)                                                                                      \
      w8_tile<MODE, n, NVM>(s, ph, ring, bars, stg, cw, t, KT, &tma_out, out, N, w.row0, w.rows, col0, sc,      \
                            ws0, ws1, out_scale, C4, amax);                                                      \
    else /* wider than the tiling (no decoder makes one): keep the ring in step */                               \
      skip_stages<2, NST>(s, ph, bars, KT, lane);                                                                \
    break;
          W8_TILE_CASE(8) W8_TILE_CASE(16) W8_TILE_CASE(24) W8_TILE_CASE(32) W8_TILE_CASE(40) W8_TILE_CASE(48)
          W8_TILE_CASE(56) W8_TILE_CASE(64) W8_TILE_CASE(72) W8_TILE_CASE(80) W8_TILE_CASE(88) W8_TILE_CASE(96)
          W8_TILE_CASE(104) W8_TILE_CASE(112) W8_TILE_CASE(120) W8_TILE_CASE(128)
#undef W8_TILE_CASE
        default: // no rows
          skip_stages<2, NST>(s, ph, bars, KT, lane);
        }
      }
    }
  }
  if (!ROWS && wg > 0 && (threadIdx.x & 31) == 0) bulk_wait_all();
  __syncwarp();
  cluster_sync();
#else
  MOE_SM90A_STUB();
#endif
}

// h [C, F] bf16 -> q e4m3 [C, F] and its scales [F / 128, C4], as MOE_QUANT_TOKEN_T: one warp a
// block of 128 (four values a lane), blocks of a column of blocks in consecutive warps so that
// the scales' stores of a warp group coalesce.
__global__ void __launch_bounds__(256) quantize_rows_kernel(const uint16_t *__restrict__ h, uint8_t *__restrict__ q,
                                                            float *__restrict__ scale, const int *__restrict__ meta,
                                                            int EL, int C4, int F) {
  // the rows the experts wrote: lo[0] .. hi[EL - 1] (sm90_map_kernel's meta)
  const int first = __ldg(meta + 2 * EL + 2), rows = __ldg(meta + 4 * EL + 1) - first;
  const int lane = threadIdx.x & 31, nb = F / 128;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < (long long)rows * nb;
       b += nw) {
    const int row = first + (int)(b % rows), kb = (int)(b / rows);
    float v[4];
    bf16x4(*reinterpret_cast<const uint2 *>(h + (long long)row * F + kb * 128 + 4 * lane), v);
    uint32_t packed;
    const float s = token_block4(v, &packed);
    *reinterpret_cast<uint32_t *>(q + (long long)row * F + kb * 128 + 4 * lane) = packed;
    if (lane == 0) scale[(long long)kb * C4 + row] = s;
  }
}

} // namespace
