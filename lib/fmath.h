/* fmath.h -- exp and log1p in float, written out with IEEE basic operations only, for the CPU
 * and the GPU alike.  The routers select experts on sigmoid(l) + b and sqrt(softplus(l)) + b;
 * the libraries' expf differ in the last bit between glibc and CUDA, which would let a near tie
 * pick different experts on different backends.  +, -, *, / and sqrt are correctly rounded on
 * both, so with contraction off (-ffp-contract=off, nvcc -fmad=false) these give the same bits
 * everywhere.  Accuracy: about 2 ulp, ample for routing scores. */
#ifndef MOELAB_FMATH_H
#define MOELAB_FMATH_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD static inline
#endif

MOE_HD float moe_bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
MOE_HD uint32_t moe_f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* Round to nearest integer, ties away from zero, by adding and subtracting 2^23 (exact for |x| < 2^22). */
MOE_HD float moe_round_small(float x) {
  const float big = 8388608.0f;
  float a = x < 0 ? -x : x;
  float r = (a + big) - big;
  return x < 0 ? -r : r;
}

/* e^x.  x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), e^r by a degree-7 Taylor
 * polynomial in Horner form, 2^n put into the exponent bits in two steps so that results down
 * to the subnormal range stay right. */
MOE_HD float moe_expf(float x) {
  if (x != x) return x;
  if (x > 88.72283f) return moe_bits_to_f32(0x7f800000u);
  if (x < -103.97208f) return 0.0f;
  const float ln2_hi = 0.693145752f;     /* 0x3f317200: few bits, so n * ln2_hi is exact */
  const float ln2_lo = 1.42860677e-06f;  /* ln2 - ln2_hi */
  const float inv_ln2 = 1.44269502f;
  float n = moe_round_small(x * inv_ln2);
  float r = (x - n * ln2_hi) - n * ln2_lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int ni = (int)n;
  /* 2^ni as two factors 2^a * 2^b, each a normal float, for ni in [-150, 128] */
  int a = ni / 2, b = ni - a;
  float sa = moe_bits_to_f32((uint32_t)(a + 127) << 23);
  float sb = moe_bits_to_f32((uint32_t)(b + 127) << 23);
  return (p * sa) * sb;
}

/* log(1 + y) for y >= 0 (all that softplus needs).  u = 1 + y rounded; log u from its exponent
 * and an atanh series of its mantissa in [sqrt(1/2), sqrt(2)); the rounding error of 1 + y is
 * put back as (y - (u - 1)) / u. */
MOE_HD float moe_log1pf(float y) {
  if (y != y) return y;
  if (y > 1e30f) y = 1e30f;
  float u = 1.0f + y;
  float c = (y - (u - 1.0f)) / u;
  uint32_t bits = moe_f32_to_bits(u);
  int e = (int)((bits >> 23) & 0xff) - 127;
  float m = moe_bits_to_f32((bits & 0x007fffffu) | 0x3f800000u); /* [1, 2) */
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  float f = m - 1.0f;
  float s = f / (2.0f + f);
  float s2 = s * s;
  float t = 1.0f / 11.0f;
  t = t * s2 + 1.0f / 9.0f;
  t = t * s2 + 1.0f / 7.0f;
  t = t * s2 + 1.0f / 5.0f;
  t = t * s2 + 1.0f / 3.0f;
  t = t * s2 + 1.0f;
  float logm = 2.0f * s * t;
  const float ln2_hi = 0.693145752f, ln2_lo = 1.42860677e-06f;
  float fe = (float)e;
  return (fe * ln2_hi + (logm + (fe * ln2_lo + c)));
}

MOE_HD float moe_sigmoidf(float x) { return 1.0f / (1.0f + moe_expf(-x)); }

/* softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|) */
MOE_HD float moe_softplusf(float x) {
  float a = x < 0 ? -x : x;
  float m = x > 0 ? x : 0.0f;
  return m + moe_log1pf(moe_expf(-a));
}

#endif
