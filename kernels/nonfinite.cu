/* SPDX-License-Identifier: MIT */
// nonfinite.cu -- moe_nonfinite on a GPU (lib/nonfinite.c checks the arguments and holds the
// CPU loop): one block counts the NaN and infinite elements and finds the first, writing the
// stats on the device, so the call can be captured.  What it counts is routing weights, a few
// elements a token: one block is plenty, and a block reduction leaves no atomic to order.
#include "common.cuh"

enum { NONFINITE_THREADS = 1024 };

// BYTES: the element's size (4 f32, 2 bf16, 1 e4m3, whose only non-finite value is its NaN).
template <int BYTES>
__global__ void nonfinite_kernel(int32_t *__restrict__ stats, const void *__restrict__ p, int64_t n) {
  __shared__ int32_t counts[NONFINITE_THREADS], firsts[NONFINITE_THREADS];
  int32_t count = 0, first = INT32_MAX;
  for (int64_t i = threadIdx.x; i < n; i += NONFINITE_THREADS) {
    const int bad = BYTES == 1   ? (((const uint8_t *)p)[i] & 0x7fu) == 0x7fu
                    : BYTES == 2 ? (((const uint16_t *)p)[i] & 0x7f80u) == 0x7f80u
                                 : (((const uint32_t *)p)[i] & 0x7f800000u) == 0x7f800000u;
    if (!bad) continue;
    if (first == INT32_MAX) first = (int32_t)i; // a thread's indices ascend
    count++;
  }
  counts[threadIdx.x] = count;
  firsts[threadIdx.x] = first;
  __syncthreads();
  for (int half = NONFINITE_THREADS / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      counts[threadIdx.x] += counts[threadIdx.x + half];
      firsts[threadIdx.x] = min(firsts[threadIdx.x], firsts[threadIdx.x + half]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    stats[0] = counts[0];
    stats[1] = firsts[0] == INT32_MAX ? -1 : firsts[0];
  }
}

int moeI_nonfinite_cuda(moe_ctx *ctx, moe_tensor *stats, const moe_tensor *t) {
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, t->device.index, &s);
  if (rc) return rc;
  if (t->dtype == MOE_E4M3)
    nonfinite_kernel<1><<<1, NONFINITE_THREADS, 0, s>>>((int32_t *)stats->data, t->data, t->numel);
  else if (t->dtype == MOE_BF16)
    nonfinite_kernel<2><<<1, NONFINITE_THREADS, 0, s>>>((int32_t *)stats->data, t->data, t->numel);
  else
    nonfinite_kernel<4><<<1, NONFINITE_THREADS, 0, s>>>((int32_t *)stats->data, t->data, t->numel);
  MOE_CUDA_LAUNCHED(ctx, "nonfinite");
  return moeI_ok(ctx);
}
