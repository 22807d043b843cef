/* SPDX-License-Identifier: MIT */
// quantize.cu -- moe_quantize and moe_dequantize on the GPU (lib/quantize.c checks the arguments,
// describes the blocks in a moeI_qlayout and holds the CPU loops).
//
// Quantize: a group of threads per scale block (a warp for the 1 x 128 blocks of the token
// kinds, a whole block of 256 threads for the 128 x 128 weight blocks) reduces the block's amax,
// then quantizes it.  A maximum is exact and does not depend on the order it is taken in, and
// the scale and each q come from fp8_math.h (built without contraction, as the CPU is), so the
// bits are the CPU's.  Consecutive threads take consecutive elements of a row: coalesced loads
// and stores.  Where the token kinds' blocks are whole and aligned (K a multiple of 128), a lane
// takes four consecutive values in one load and writes their q in one store (quantize_whole_kernel,
// the FP8 layer's tokens).  The e4m3 conversion is the hardware's on GPUs that have it
// (fp8_math.h).  Nothing is allocated or synchronised: the launches can be captured in
// a graph.
#include <stdint.h>

#include "common.cuh"
#include "fp8_math.h"
#include "token_block.cuh"

namespace {

constexpr int THREADS = 256;

template <int BF16>
__device__ __forceinline__ float load(const void *__restrict__ p, int64_t i) {
  return BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

// G threads per scale block (32 or THREADS), THREADS / G blocks per CTA.
template <int G, int BF16>
__global__ void __launch_bounds__(THREADS)
quantize_kernel(uint8_t *__restrict__ q, float *__restrict__ scale, const void *__restrict__ x, moeI_qlayout l,
                int64_t nblocks) {
  __shared__ float warp_amax[THREADS / 32];
  const int t = threadIdx.x % G;
  const int64_t n = (int64_t)blockIdx.x * (THREADS / G) + threadIdx.x / G;
  const bool live = n < nblocks; // a whole group is live or not: G divides the CTA
  int64_t b = 0, i = 0, j = 0, r0 = 0, rows = 0, c0 = 0, cols = 0;
  if (live) {
    j = n % l.nbk, i = (n / l.nbk) % l.nbr, b = n / (l.nbk * l.nbr);
    r0 = i * l.br, rows = min(l.br, l.R - r0);
    c0 = j * MOE_FP8_BLOCK, cols = min((int64_t)MOE_FP8_BLOCK, l.K - c0);
  }
  const int64_t base = b * l.R * l.K + r0 * l.K + c0;
  const int64_t elems = rows * MOE_FP8_BLOCK;
  float amax = 0.0f;
  for (int64_t e = t; e < elems; e += G) {
    const int64_t r = e / MOE_FP8_BLOCK, c = e % MOE_FP8_BLOCK;
    if (c < cols) amax = moeI_fp8_amax(amax, load<BF16>(x, base + r * l.K + c));
  }
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (G > 32) {
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = warp_amax[0];
    for (int w = 1; w < G / 32; w++) amax = fmaxf(amax, warp_amax[w]);
  }
  if (!live) return;
  const float s = l.token ? moeI_fp8_token_scale(amax) : moeI_fp8_weight_scale(amax);
  if (t == 0) scale[moeI_qlayout_scale_at(&l, b, i, j)] = s;
  for (int64_t e = t; e < elems; e += G) {
    const int64_t r = e / MOE_FP8_BLOCK, c = e % MOE_FP8_BLOCK;
    if (c < cols) q[base + r * l.K + c] = moeI_fp8_quantize(load<BF16>(x, base + r * l.K + c), s);
  }
}

// The token kinds' blocks when K is a multiple of 128: block n is elements 128 n .. 128 n + 127,
// a warp a block (token_block4); lane l holds 4 l .. 4 l + 3 (x 8-byte aligned for bf16, 16 for
// f32; q 4-byte aligned).  A warp takes WHOLE_U consecutive blocks at a time, all their loads
// issued before the first reduction, so that it has four blocks' bytes in flight, not one.
constexpr int WHOLE_U = 4;
template <int BF16>
__global__ void __launch_bounds__(THREADS)
quantize_whole_kernel(uint8_t *__restrict__ q, float *__restrict__ scale, const void *__restrict__ x, moeI_qlayout l,
                      int64_t nblocks) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * (THREADS / 32);
  for (int64_t n0 = ((int64_t)blockIdx.x * (THREADS / 32) + threadIdx.x / 32) * WHOLE_U; n0 < nblocks;
       n0 += warps * WHOLE_U) {
    const int here = nblocks - n0 < WHOLE_U ? (int)(nblocks - n0) : WHOLE_U; // uniform over the warp
    float v[WHOLE_U][4];
#pragma unroll
    for (int u = 0; u < WHOLE_U; u++) {
      if (u >= here) break;
      const int64_t at = (n0 + u) * MOE_FP8_BLOCK + 4 * lane;
      if (BF16) {
        bf16x4(*reinterpret_cast<const uint2 *>((const uint16_t *)x + at), v[u]);
      } else {
        const float4 f = *reinterpret_cast<const float4 *>((const float *)x + at);
        v[u][0] = f.x, v[u][1] = f.y, v[u][2] = f.z, v[u][3] = f.w;
      }
    }
    float mine = 0.0f; // lane u writes block u's scale
#pragma unroll
    for (int u = 0; u < WHOLE_U; u++) {
      if (u >= here) break;
      uint32_t packed;
      const float s = token_block4(v[u], &packed);
      *reinterpret_cast<uint32_t *>(q + (n0 + u) * MOE_FP8_BLOCK + 4 * lane) = packed;
      if (lane == u) mine = s;
    }
    if (lane < here) {
      const int64_t n = n0 + lane, row = n / l.nbk, j = n - row * l.nbk;
      scale[moeI_qlayout_scale_at(&l, row / l.nbr, row % l.nbr, j)] = mine;
    }
  }
}

template <int BF16>
__global__ void __launch_bounds__(THREADS)
dequantize_kernel(void *__restrict__ x, const uint8_t *__restrict__ q, const float *__restrict__ scale,
                  moeI_qlayout l, int64_t numel) {
  for (int64_t at = (int64_t)blockIdx.x * THREADS + threadIdx.x; at < numel; at += (int64_t)gridDim.x * THREADS) {
    const int64_t row = at / l.K, c = at - row * l.K, b = row / l.R, r = row - b * l.R;
    const float v = moeI_e4m3_to_f32(q[at]) * scale[moeI_qlayout_scale_at(&l, b, r / l.br, c / MOE_FP8_BLOCK)];
    if (BF16) ((uint16_t *)x)[at] = f32_to_bf16(v);
    else ((float *)x)[at] = v;
  }
}

template <int G>
int launch_quantize(moe_ctx *ctx, cudaStream_t s, moe_tensor *q, moe_tensor *scale, const moe_tensor *x,
                    const moeI_qlayout &l, int64_t nblocks) {
  const int64_t ctas = (nblocks + THREADS / G - 1) / (THREADS / G);
  if (ctas > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "quantize: %lld blocks are too many for cuda", (long long)nblocks);
  if (x->dtype == MOE_BF16)
    quantize_kernel<G, 1><<<(unsigned)ctas, THREADS, 0, s>>>((uint8_t *)q->data, (float *)scale->data, x->data, l,
                                                              nblocks);
  else
    quantize_kernel<G, 0><<<(unsigned)ctas, THREADS, 0, s>>>((uint8_t *)q->data, (float *)scale->data, x->data, l,
                                                              nblocks);
  MOE_CUDA_LAUNCHED(ctx, "quantize");
  return moeI_ok(ctx);
}

} // namespace

int moeI_quantize_cuda(moe_ctx *ctx, moe_tensor *q, moe_tensor *scale, const moe_tensor *x, const moeI_qlayout *l) {
  const int64_t nblocks = l->B * l->nbr * l->nbk;
  if (!nblocks) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  if (rc) return rc;
  if (l->br == 1 && l->K % MOE_FP8_BLOCK == 0 && (uintptr_t)q->data % 4 == 0 &&
      (uintptr_t)x->data % (x->dtype == MOE_BF16 ? 8 : 16) == 0) {
    int sms = 0;
    if ((rc = moeI_cuda_sm_count(ctx, x->device.index, &sms))) return rc;
    const int64_t want = (nblocks + THREADS / 32 * WHOLE_U - 1) / (THREADS / 32 * WHOLE_U);
    const unsigned ctas = (unsigned)(want < 8 * sms ? want : 8 * sms);
    if (x->dtype == MOE_BF16)
      quantize_whole_kernel<1><<<ctas, THREADS, 0, s>>>((uint8_t *)q->data, (float *)scale->data, x->data, *l, nblocks);
    else
      quantize_whole_kernel<0><<<ctas, THREADS, 0, s>>>((uint8_t *)q->data, (float *)scale->data, x->data, *l, nblocks);
    MOE_CUDA_LAUNCHED(ctx, "quantize");
    return moeI_ok(ctx);
  }
  return l->br == 1 ? launch_quantize<32>(ctx, s, q, scale, x, *l, nblocks)
                    : launch_quantize<THREADS>(ctx, s, q, scale, x, *l, nblocks);
}

int moeI_dequantize_cuda(moe_ctx *ctx, moe_tensor *x, const moe_tensor *q, const moe_tensor *scale,
                         const moeI_qlayout *l) {
  const int64_t numel = x->numel;
  if (!numel) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  if (rc) return rc;
  const int64_t want = (numel + THREADS - 1) / THREADS;
  const unsigned ctas = (unsigned)(want < 65536 * 4 ? want : 65536 * 4);
  if (x->dtype == MOE_BF16)
    dequantize_kernel<1><<<ctas, THREADS, 0, s>>>(x->data, (const uint8_t *)q->data, (const float *)scale->data, *l,
                                                  numel);
  else
    dequantize_kernel<0><<<ctas, THREADS, 0, s>>>(x->data, (const uint8_t *)q->data, (const float *)scale->data, *l,
                                                  numel);
  MOE_CUDA_LAUNCHED(ctx, "dequantize");
  return moeI_ok(ctx);
}
