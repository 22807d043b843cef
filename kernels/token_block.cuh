/* SPDX-License-Identifier: MIT */
// token_block.cuh -- a warp quantizing one 1 x 128 token block, four consecutive values a lane:
// moe_quantize's token kinds where the blocks are whole (quantize.cu) and the FP8 experts' h
// (experts/fp8.cuh).  The same amax (a maximum, in any order), scale and q as the CPU's.
#pragma once

#include <stdint.h>

#include "fp8_math.h"

namespace {

// Four bf16 (the first in the low half of raw.x) as f32.
__device__ __forceinline__ void bf16x4(uint2 raw, float (&v)[4]) {
  v[0] = __uint_as_float(raw.x << 16), v[1] = __uint_as_float(raw.x & 0xFFFF0000u);
  v[2] = __uint_as_float(raw.y << 16), v[3] = __uint_as_float(raw.y & 0xFFFF0000u);
}

// The block's scale (its amax over the warp, NaN ignored), and this lane's four q into *packed,
// the first in the low byte.  Every lane of the warp calls it.
__device__ __forceinline__ float token_block4(const float (&v)[4], uint32_t *packed) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; i++) amax = moeI_fp8_amax(amax, v[i]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = moeI_fp8_token_scale(amax);
  uint32_t q = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) q |= (uint32_t)moeI_fp8_quantize(v[i], s) << (8 * i);
  *packed = q;
  return s;
}

} // namespace
