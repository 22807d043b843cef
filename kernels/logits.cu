/* SPDX-License-Identifier: MIT */
// logits.cu -- router logits out f32 [N, E] = x bf16 [N, H] . w bf16 [E, H]^T, and the Qwen3.5
// shared-expert gate g f32 [T] = sigmoid(x . w), on the GPU.
//
// Both give moeI_logits_cpu's / moeI_sigmoid_gate_cpu's dot products bit for bit, because the route
// stage selects experts on them: a logit one ulp away from the CPU's could flip a near tie, and
// the layer's forward (GPU) and reference (CPU) would then route a token differently.  mlp.h
// fixes one summation order: element i goes into partial sum i % 8, in ascending i, and the
// eight partial sums are added as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).  Here each
// partial sum is a chain of fused multiply-adds: the product of two bf16 values has at most 16
// significant bits, so it is exact in f32 and fma(w, x, s) = s + w * x rounded once, which is
// what the CPU's separate multiply and add compute.  (The one exception is a product below
// 2^-126 whose subnormal would lose bits: |w x| < 1.2e-38, far from router data.)
//
// logits: a SIMT tile kernel without tensor cores (their accumulation order is not IEEE's).
// A block computes a 32 x 64 tile of out with 8 warps, warp j owning partial sum j: it
// accumulates elements i = j (mod 8) for the whole tile, 8 x 8 outputs per thread.  The
// warps' partial tiles are then added pairwise through shared memory in the order above.
#include <stdint.h>

#include "common.cuh"
#include "route_math.h"

namespace {

constexpr int BM = 32, BN = 64, BK = 64; // tokens, experts, elements of H per stage
constexpr int APAD = BM + 4, BPAD = BN + 4;

// bf16 pair -> floats, exact
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Eight consecutive bf16 of row `row` (of `rows`), elements c .. c + 7 of H, as raw words; zero
// past the ends.  VEC: the row and the base are 16-byte aligned and H % 8 == 0.
template <bool VEC>
__device__ __forceinline__ uint4 load8(const uint16_t *__restrict__ p, int64_t row, int64_t rows, int64_t c,
                                       int64_t H) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (row >= rows || c >= H) return v;
  const uint16_t *q = p + row * H + c;
  if constexpr (VEC) {
    v = __ldg((const uint4 *)q);
  } else {
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; e++) h[e] = c + e < H ? (uint32_t)__ldg(q + e) : 0u;
    v = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
  }
  return v;
}

struct alignas(16) LogitsSmem { // 16: the tiles are read as float4
  union {
    struct {
      float a[8][8][APAD]; // [partial sum j][step][token]: element BK*c + 8*step + j
      float b[8][8][BPAD]; // [j][step][expert]
    } tile;
    float red[4][64][32]; // partial tiles handed between warps: [slot][value][lane]
  };
};

template <bool VEC>
__global__ void __launch_bounds__(256, 2)
logits_kernel(float *__restrict__ out, const uint16_t *__restrict__ x, const uint16_t *__restrict__ w, int64_t N,
              int64_t E, int64_t H) {
  __shared__ LogitsSmem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t n0 = (int64_t)blockIdx.y * BM, e0 = (int64_t)blockIdx.x * BN;

  // loaders: x tile 32 rows x 8 pieces (one per thread), w tile 64 rows x 8 pieces (two)
  const int am = tid >> 3, aq = tid & 7;
  const int bn0 = tid >> 3, bq = tid & 7, bn1 = bn0 + 32;
  // compute: lane = 8 * ly + lx; rows {4ly .. 4ly+3, 16+4ly ..}, cols {4lx .. 4lx+3, 32+4lx ..}
  // (the split keeps a warp's 16-byte shared loads on distinct banks)
  const int ly = lane >> 3, lx = lane & 7;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

  uint4 ra = load8<VEC>(x, n0 + am, N, aq * 8, H);
  uint4 rb0 = load8<VEC>(w, e0 + bn0, E, bq * 8, H);
  uint4 rb1 = load8<VEC>(w, e0 + bn1, E, bq * 8, H);
  for (int64_t c0 = 0; c0 < H; c0 += BK) {
    __syncthreads(); // the previous stage is consumed
    {
      const uint32_t wa[4] = {ra.x, ra.y, ra.z, ra.w}, w0[4] = {rb0.x, rb0.y, rb0.z, rb0.w},
                     w1[4] = {rb1.x, rb1.y, rb1.z, rb1.w};
#pragma unroll
      for (int h = 0; h < 4; h++) {
        sm.tile.a[2 * h][aq][am] = lo_f(wa[h]);
        sm.tile.a[2 * h + 1][aq][am] = hi_f(wa[h]);
        sm.tile.b[2 * h][bq][bn0] = lo_f(w0[h]);
        sm.tile.b[2 * h + 1][bq][bn0] = hi_f(w0[h]);
        sm.tile.b[2 * h][bq][bn1] = lo_f(w1[h]);
        sm.tile.b[2 * h + 1][bq][bn1] = hi_f(w1[h]);
      }
    }
    __syncthreads();
    if (c0 + BK < H) { // the next stage's loads fly while this one is computed
      ra = load8<VEC>(x, n0 + am, N, c0 + BK + aq * 8, H);
      rb0 = load8<VEC>(w, e0 + bn0, E, c0 + BK + bq * 8, H);
      rb1 = load8<VEC>(w, e0 + bn1, E, c0 + BK + bq * 8, H);
    }
#pragma unroll
    for (int st = 0; st < 8; st++) {
      const float4 a0 = *(const float4 *)&sm.tile.a[warp][st][4 * ly];
      const float4 a1 = *(const float4 *)&sm.tile.a[warp][st][16 + 4 * ly];
      const float4 b0 = *(const float4 *)&sm.tile.b[warp][st][4 * lx];
      const float4 b1 = *(const float4 *)&sm.tile.b[warp][st][32 + 4 * lx];
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = __fmaf_rn(bv[j], av[i], acc[i][j]);
    }
  }

  // ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): odd warps hand over, then warps 2 and 6,
  // then warp 4; float addition commutes exactly, so acc + handed equals the CPU's s_a + s_b
  for (int level = 1; level < 8; level <<= 1) {
    __syncthreads();
    if ((warp & (2 * level - 1)) == level) {
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) sm.red[warp / (2 * level)][8 * i + j][lane] = acc[i][j];
    }
    __syncthreads();
    if ((warp & (2 * level - 1)) == 0) {
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = __fadd_rn(acc[i][j], sm.red[warp / (2 * level)][8 * i + j][lane]);
    }
  }
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int64_t n = n0 + (i < 4 ? 4 * ly + i : 16 + 4 * ly + i - 4);
    if (n >= N) continue;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int64_t e = e0 + (j < 4 ? 4 * lx + j : 32 + 4 * lx + j - 4);
      if (e < E) out[n * E + e] = acc[i][j];
    }
  }
}

// The gate: 32 tokens per block, thread (token, j) keeps partial sum j of its token; the
// eight partial sums of a token sit in eight consecutive lanes, and the xor butterfly over
// them adds exactly ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
constexpr int GT = 32, GK = 256; // tokens per block, elements per stage

struct alignas(16) GateSmem {
  uint32_t x[GT][GK / 2 + 4]; // bf16 pairs, written as uint4; the pad keeps column reads on distinct banks
  float w[GK];
};

template <bool VEC>
__global__ void __launch_bounds__(256)
gate_kernel(float *__restrict__ g, const uint16_t *__restrict__ x, const uint16_t *__restrict__ w, int64_t T,
            int64_t H) {
  __shared__ GateSmem sm;
  uint32_t(&xs)[GT][GK / 2 + 4] = sm.x;
  float(&ws)[GK] = sm.w;
  const int tid = threadIdx.x;
  const int tok = tid >> 3, j = tid & 7;
  const int64_t t0 = (int64_t)blockIdx.x * GT;
  float s = 0.0f;
  for (int64_t c0 = 0; c0 < H; c0 += GK) {
    // x: 32 rows x 32 pieces of 8 elements, four pieces per thread; w: 32 pieces
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int f = tid + 256 * u, row = f >> 5, q = f & 31;
      r[u] = load8<VEC>(x, t0 + row, T, c0 + 8 * q, H);
    }
    uint4 rw = make_uint4(0, 0, 0, 0);
    if (tid < GK / 8) rw = load8<VEC>(w, 0, 1, c0 + 8 * tid, H);
    __syncthreads(); // the previous stage is consumed
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int f = tid + 256 * u, row = f >> 5, q = f & 31;
      *(uint4 *)&xs[row][4 * q] = r[u];
    }
    if (tid < GK / 8) {
      const uint32_t h[4] = {rw.x, rw.y, rw.z, rw.w};
#pragma unroll
      for (int e = 0; e < 4; e++) ws[8 * tid + 2 * e] = lo_f(h[e]), ws[8 * tid + 2 * e + 1] = hi_f(h[e]);
    }
    __syncthreads();
#pragma unroll 8
    for (int st = 0; st < GK / 8; st++) {
      const int i = 8 * st + j;
      const uint32_t pair = xs[tok][i >> 1];
      s = __fmaf_rn(ws[i], (i & 1) ? hi_f(pair) : lo_f(pair), s);
    }
  }
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 4));
  if (j == 0 && t0 + tok < T) g[t0 + tok] = moeI_rm_sigmoid(s);
}

bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

} // namespace

int moeI_logits_cuda(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  const int64_t N = x->shape[0], H = x->shape[1], E = w->shape[0];
  if (!N || !E) return moeI_ok(ctx);
  const int64_t gx = (E + BN - 1) / BN;
  if (gx > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "logits: [%lld, %lld] is too large for cuda", (long long)N, (long long)E);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  if (rc) return rc;
  // y is limited to 65535 blocks: long inputs go in slices of rows
  for (int64_t r0 = 0; r0 < N; r0 += (int64_t)65535 * BM) {
    const int64_t n = N - r0 < (int64_t)65535 * BM ? N - r0 : (int64_t)65535 * BM;
    const dim3 grid((unsigned)gx, (unsigned)((n + BM - 1) / BM));
    const uint16_t *xp = (const uint16_t *)x->data + r0 * H;
    float *op = (float *)out->data + r0 * E;
    if (H % 8 == 0 && aligned16(xp) && aligned16(w->data))
      logits_kernel<true><<<grid, 256, 0, s>>>(op, xp, (const uint16_t *)w->data, n, E, H);
    else
      logits_kernel<false><<<grid, 256, 0, s>>>(op, xp, (const uint16_t *)w->data, n, E, H);
    MOE_CUDA_LAUNCHED(ctx, "logits");
  }
  return moeI_ok(ctx);
}

int moeI_sigmoid_gate_cuda(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  const int64_t T = x->shape[0], H = x->shape[1];
  if (!T) return moeI_ok(ctx);
  const int64_t blocks = (T + GT - 1) / GT;
  if (blocks > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "sigmoid_gate: %lld tokens are too many for cuda", (long long)T);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  if (rc) return rc;
  if (H % 8 == 0 && aligned16(x->data) && aligned16(w->data))
    gate_kernel<true><<<(unsigned)blocks, 256, 0, s>>>((float *)g->data, (const uint16_t *)x->data,
                                                       (const uint16_t *)w->data, T, H);
  else
    gate_kernel<false><<<(unsigned)blocks, 256, 0, s>>>((float *)g->data, (const uint16_t *)x->data,
                                                        (const uint16_t *)w->data, T, H);
  MOE_CUDA_LAUNCHED(ctx, "sigmoid_gate");
  return moeI_ok(ctx);
}
