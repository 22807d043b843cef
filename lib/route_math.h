/* SPDX-License-Identifier: MIT */
/* route_math.h -- the scoring functions of the route stage, shared by the CPU reference
 * (lib/route.c) and the CUDA kernel, so that both compute the same bits.
 *
 * Why not expf/log1pf: the route stage's integer outputs (the selected expert ids) must be
 * equal on every backend, and the selection compares sigmoid(l) + bias, where a one-ulp
 * difference between glibc's expf and CUDA's expf flips near-ties.  These functions use only
 * IEEE-754 operations that both sides round the same way (+, -, *, /, sqrt, floor, exact
 * exponent scaling), so they give the same float everywhere provided that the compiler
 * fuses nothing: C with -ffp-contract=off, nvcc with -fmad=false and the default
 * -prec-div=true -prec-sqrt=true -ftz=false (both set by CMakeLists.txt).
 *
 * Accuracy: the Cephes single-precision polynomials, within 3 ulp of the true value
 * over the range used; that is far inside every tolerance, and being the same everywhere is
 * what matters here.
 */
#ifndef MOELAB_ROUTE_MATH_H
#define MOELAB_ROUTE_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOE_RMATH static __host__ __device__ inline
#else
#define MOE_RMATH static inline
#endif

/* 2^n for -126 <= n <= 127, exactly, from the exponent bits. */
MOE_RMATH float moeI_rm_pow2(int n) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)(n + 127) << 23;
  return v.f;
}

/* e^x. */
MOE_RMATH float moeI_rm_exp(float x) {
  if (x != x) return x;
  if (x > 88.72283935546875f) return INFINITY; /* above ln(FLT_MAX) */
  if (x < -103.972084045410156f) return 0.0f;  /* below ln(smallest subnormal / 2) */
  /* x = n ln2 + r, |r| <= ln2 / 2, with ln2 split so that n * C1 is exact (Cody-Waite) */
  float n = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
             1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  int e = (int)n;
  /* scale in two steps where 2^e is not a normal float: the first step is exact, so the
     result is rounded once, also when it is subnormal */
  if (e > 127) return y * moeI_rm_pow2(127) * moeI_rm_pow2(e - 127);
  if (e < -126) return y * moeI_rm_pow2(e + 64) * moeI_rm_pow2(-64);
  return y * moeI_rm_pow2(e);
}

/* ln x for a finite x >= FLT_MIN (normal, positive): all the route stage needs. */
MOE_RMATH float moeI_rm_log(float x) {
  union { uint32_t u; float f; } v;
  v.f = x;
  int e = (int)((v.u >> 23) & 0xffu) - 126; /* x = m 2^e with m in [0.5, 1) */
  v.u = (v.u & 0x807fffffu) | (126u << 23);
  float m = v.f;
  if (m < 0.707106781186547524f) { /* keep m - 1 in [sqrt(1/2) - 1, sqrt(2) - 1) */
    e -= 1;
    m = m + m - 1.0f;
  } else {
    m = m - 1.0f;
  }
  float z = m * m;
  float y = ((((((((7.0376836292e-2f * m - 1.1514610310e-1f) * m + 1.1676998740e-1f) * m - 1.2420140846e-1f) * m +
                 1.4249322787e-1f) * m - 1.6668057665e-1f) * m + 2.0000714765e-1f) * m - 2.4999993993e-1f) * m +
            3.3333331174e-1f) * m * z;
  float fe = (float)e;
  y = y + -2.12194440e-4f * fe;
  y = y + -0.5f * z;
  return m + y + 0.693359375f * fe;
}

/* ln(1 + x) for 0 <= x < FLT_MAX.  Goldberg's correction keeps the relative accuracy for small
 * x, where 1 + x alone would lose the low bits of x. */
MOE_RMATH float moeI_rm_log1p(float x) {
  float u = 1.0f + x;
  if (u == 1.0f) return x;
  return moeI_rm_log(u) * (x / (u - 1.0f));
}

/* sigma(l) = 1 / (1 + e^-l): 0 at -inf, 1 at +inf. */
MOE_RMATH float moeI_rm_sigmoid(float l) { return 1.0f / (1.0f + moeI_rm_exp(-l)); }

/* sqrt(softplus(l)), softplus stable: l itself past 20, where log1p(e^l) = l in float. */
MOE_RMATH float moeI_rm_sqrtsoftplus(float l) {
  float sp = l > 20.0f ? l : moeI_rm_log1p(moeI_rm_exp(l));
  return sqrtf(sp);
}

#undef MOE_RMATH
#endif
