/* SPDX-License-Identifier: MIT */
// common.cuh -- what every CUDA launcher shares: error recording, the context's stream, bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "internal.h"

// Records "<stage>: <call> failed at file:line: cudaErrorName: text" in ctx and returns
// MOE_ERR_CUDA from the enclosing function.  The runtime keeps a failed call's error as the
// thread's "last error" until cudaGetLastError reads it; reading it here keeps a handled
// failure (an allocation that did not fit, say) from being reported again by the next
// MOE_CUDA_LAUNCHED of an unrelated, successful launch.
#define MOE_CUDA_TRY(ctx, stage, call)                                                            \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      (void)cudaGetLastError();                                                                   \
      return moeI_seterr((ctx), MOE_ERR_CUDA, "%s: %s failed at %s:%d: %s: %s", (stage), #call,     \
                        __FILE__, __LINE__, cudaGetErrorName(err_), cudaGetErrorString(err_));    \
    }                                                                                             \
  } while (0)

// After a launch: the launch error (bad configuration, no kernel image for this GPU).
#define MOE_CUDA_LAUNCHED(ctx, stage) MOE_CUDA_TRY(ctx, stage, cudaGetLastError())

// The stream the context's stages run on, created on first use (non-blocking, so that a
// graph can be captured from it); sets the device of the calling thread.
int moeI_cuda_ctx_stream(moe_ctx *ctx, int device, cudaStream_t *out);

// The device's multiprocessors, queried once a device and then cached (the grids of the
// persistent and grid-stride launches are sized by it on every call).
int moeI_cuda_sm_count(moe_ctx *ctx, int device, int *out);
// The same count where the device launches cooperative kernels (whose blocks the scheduler's grid
// barrier needs resident at once), 0 where it does not; cached alike.
int moeI_cuda_coop_sms(moe_ctx *ctx, int device, int *out);

// value() computed once a device (0-63) and kept, as value + 1 so that 0 is kept too; a negative
// value (a query that failed) is returned and asked again the next time.
template <class F> int once_per_device(std::atomic<int> (&cache)[64], int device, F value) {
  const bool cached = device >= 0 && device < 64;
  if (cached) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c - 1;
  }
  const int v = value();
  if (cached && v >= 0) cache[device].store(v + 1, std::memory_order_relaxed);
  return v;
}

// Raises kernel's dynamic shared-memory limit to the device's opt-in maximum, once a device
// (raised: the kernel's flags, as once_per_device keeps them).
int moeI_cuda_raise_smem(moe_ctx *ctx, const char *stage, const void *kernel, std::atomic<int> (&raised)[64],
                         int device);

static inline int cdiv(long long a, long long b) { return (int)((a + b - 1) / b); }
