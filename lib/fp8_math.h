/* SPDX-License-Identifier: MIT */
/* fp8_math.h -- OCP FP8 E4M3 (e4m3fn) conversions and the block-scale rules of moe_quantize,
 * shared by the CPU backend (lib/) and the CUDA kernels (kernels/), so that both give the same
 * bits.  Only exact operations and one IEEE division are used; the build turns off contraction
 * on both sides (CMakeLists.txt), so nothing here is fused differently on one of them.
 *
 * e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals m/8 x 2^-6; largest finite
 * 448 (0x7E); no infinities; S.1111.111 is the NaN. */
#ifndef MOELAB_FP8_MATH_H
#define MOELAB_FP8_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_fp8.h>
#define MOE_FP8 static __host__ __device__ inline
#else
#define MOE_FP8 static inline
#endif

enum { MOE_FP8_BLOCK = 128 };   /* elements a scale covers along each blocked dimension */
#define MOE_FP8_MAX 448.0f
#define MOE_FP8_TOKEN_FLOOR 1e-4f /* an activation block's amax is at least this */

MOE_FP8 uint32_t moeI_f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

/* x rounded to e4m3: nearest, ties to even; magnitudes from 448 up (and infinities) saturate to
 * 448; NaN gives 0x7F.  On GPUs that have it (sm_89 on), the hardware's conversion, which rounds
 * and saturates the same way (spec/fp8_spec.lua checks the bits against the CPU's). */
MOE_FP8 uint8_t moeI_f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return x != x ? (uint8_t)0x7F : (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
#else
  const uint32_t u = moeI_f32_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;             /* NaN */
  if (a >= 0x43E00000u) return sign | 0x7E;     /* |x| >= 448 */
  if (a < 0x3C800000u) {                        /* |x| < 2^-6: subnormal steps of 2^-9 */
    /* |x| x 2^9 < 8 is exact; round it to an integer, ties to even, by hand */
    float v;
    const uint32_t av = a;
    memcpy(&v, &av, sizeof v);
    v *= 512.0f;
    uint32_t m = (uint32_t)v;                   /* truncation, 0..7 */
    const float rem = v - (float)m;             /* exact */
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
    return sign | (uint8_t)m;                   /* m = 8 is 2^-6, the smallest normal */
  }
  uint32_t e = (a >> 23) - 127 + 7;             /* 1..15 */
  uint32_t m = (a >> 20) & 7u;
  const uint32_t rest = a & 0xFFFFFu, half = 0x80000u;
  if (rest > half || (rest == half && (m & 1u))) {
    if (++m == 8) m = 0, e++;                   /* cannot pass 448: |x| < 448 rounds to 448 at most */
  }
  return sign | (uint8_t)(e << 3) | (uint8_t)m;
#endif
}

/* The exact f32 value of an e4m3 byte. */
MOE_FP8 float moeI_e4m3_to_f32(uint8_t q) {
  const uint32_t e = (q >> 3) & 15u, m = q & 7u;
  uint32_t u;
  if (e == 15 && m == 7) u = 0x7FC00000u;       /* NaN */
  else if (e == 0) {                            /* m/8 x 2^-6 = m x 2^-9 */
    float v = (float)m * (1.0f / 512.0f);
    u = moeI_f32_bits(v);
  } else u = ((e - 7 + 127) << 23) | (m << 20);
  u |= (uint32_t)(q & 0x80) << 24;
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

/* A block's scale from its amax (the largest |x|, NaN ignored): weights amax / 448 (0 for a block of
 * zeros), activations max(amax, 1e-4) / 448. */
MOE_FP8 float moeI_fp8_weight_scale(float amax) { return amax / MOE_FP8_MAX; }
MOE_FP8 float moeI_fp8_token_scale(float amax) {
  return (amax > MOE_FP8_TOKEN_FLOOR ? amax : MOE_FP8_TOKEN_FLOOR) / MOE_FP8_MAX;
}
/* |x| into a running amax; NaN leaves it as it was */
MOE_FP8 float moeI_fp8_amax(float amax, float x) {
  const float a = fabsf(x);
  return a > amax ? a : amax;
}
/* q of x in a block of scale s; a zero scale (a weight block whose amax is 0) gives 0, but NaN,
 * which amax ignores, still gives 0x7F: the block's NaN survives its zeros */
MOE_FP8 uint8_t moeI_fp8_quantize(float x, float s) {
  return s == 0.0f && x == x ? (uint8_t)0 : moeI_f32_to_e4m3(x / s);
}
/* moeI_fp8_quantize(x, s) without a division, for a token block's scale s and r = 1 / s: x / s
 * as q = x r and one correction by the remainder x - s q (exact in an FMA but where x is
 * subnormal: those quotients lie far below e4m3's least step and give 0 either way).  The same
 * byte as moeI_fp8_quantize wherever x is a bf16 value and s the token scale of a block of bf16
 * values that holds x (|x| <= 448 s): spec/c/test_fp8_quotient.c checks every such pair.  An
 * infinite amax makes r 0, and q = x r is already x / s.  The FP8 experts' epilogue quantizes h
 * with it, where sixteen IEEE divisions a lane cost about 4% of the pass. */
MOE_FP8 uint8_t moeI_fp8_quantize_token(float x, float s, float r) {
  float q = x * r;
  if (r != 0.0f) {
    const float e = fmaf(-s, q, x);
    if (e != 0.0f) q = fmaf(e, r, q); /* e = 0: q is exact already (and -0 stays -0) */
  }
  return moeI_f32_to_e4m3(q);
}

#endif
