/* SPDX-License-Identifier: MIT */
// experts.cuh -- what the experts stage's kernels share: the entry points select.cu's table
// calls, the rows an expert owns (the map kernels' scans), and the stage's device scratch.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "../common.cuh"
#include "../select.cuh"

// The candidates of select.cu.  A run function is called only on a problem its kernel takes
// (fits said TAKES or DECLINES) with C, H and EL nonzero and the context's stream on the device.
int moeI_experts_mma_fits(moe_ctx *ctx, const moe_experts_args *a, Fit *fit, char *why, size_t n);
int moeI_experts_mma_run(moe_ctx *ctx, const moe_experts_args *a);
enum Sm90Variant { SM90W, SM90X2, SM90X1 }; // weights as M; row tiles in clusters of two; one CTA a tile
int moeI_experts_sm90_fits(moe_ctx *ctx, const moe_experts_args *a, Sm90Variant v, Fit *fit, char *why, size_t n);
int moeI_experts_sm90_run(moe_ctx *ctx, const moe_experts_args *a, Sm90Variant v);

namespace {

enum { GATE_UP = 0, DOWN = 1 }; // the two passes: h = swiglu(xs . W_gate_up^T), ys = h . W_down^T

// A generic pointer into shared memory as the 32-bit shared-space address PTX takes.
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// ---- the rows an expert owns ----
//
// Expert e owns [m_e, m_{e+1}) with m the running maximum of the offsets clamped to [0, C], exactly
// as moeI_experts_cpu reads them, so bad offsets neither stray out of bounds nor write a row twice.

__device__ __forceinline__ int clamp_row(int v, int C) { return v < 0 ? 0 : v > C ? C : v; }

template <bool MAX> __device__ __forceinline__ int op2(int a, int b) { return MAX ? max(a, b) : a + b; }

// Inclusive scan of v over a block of 1024 threads; *total gets the reduction.  ws holds 32 ints.
template <bool MAX> __device__ int block_scan(int v, int *ws, int *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = op2<MAX>(v, t);
  }
  if (lane == 31) ws[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = ws[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = op2<MAX>(w, t);
    }
    ws[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op2<MAX>(v, ws[warp - 1]);
  *total = ws[31];
  __syncthreads(); // ws is reused by the next scan
  return v;
}

// ---- host side ----

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

// The launch of `blocks` CTAs of `threads` with `smem` bytes of dynamic shared memory each, in
// clusters of cm (1: no cluster), and with pdl a programmatic dependent of the kernel before it on
// the stream (it starts while that one ends and waits for it with griddepcontrol.wait); attr is
// the storage of its attributes.
cudaLaunchConfig_t launch_config(cudaLaunchAttribute (&attr)[2], int cm, unsigned blocks, int threads, int smem,
                                 cudaStream_t stream, bool pdl = false) {
  cudaLaunchConfig_t cfg = {};
  unsigned n = 0;
  if (cm > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = (unsigned)cm, attr[n].val.clusterDim.y = 1, attr[n].val.clusterDim.z = 1;
    n++;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    n++;
  }
  cfg.gridDim = dim3(blocks, 1, 1);
  cfg.blockDim = dim3((unsigned)threads, 1, 1);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cfg;
}

// The stage's device scratch: taken with cudaMallocAsync on the stream and given back with
// cudaFreeAsync after the last launch (both captured as graph memory nodes), so that a captured
// graph owns its own.
int experts_scratch(moe_ctx *ctx, cudaStream_t stream, int dev, size_t bytes, void **out) {
  cudaError_t err = cudaMallocAsync(out, bytes, stream);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError(); // not sticky: leave no stale error for the next launch check
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "experts: cannot allocate %zu bytes of device scratch on cuda:%d", bytes,
                       dev);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_CUDA, "experts: cudaMallocAsync(scratch, %zu bytes) failed: %s: %s", bytes,
                       cudaGetErrorName(err), cudaGetErrorString(err));
  }
  return MOE_OK;
}

// After the launches (err: the first that failed, `what` it was): gives the scratch back -- after
// the kernels on the same stream, so they are done with it first; on a failed launch all the same
// -- and reports.
int experts_finish(moe_ctx *ctx, cudaStream_t stream, void *scratch, cudaError_t err, const char *what) {
  cudaError_t ferr = cudaFreeAsync(scratch, stream);
  if (err == cudaSuccess && ferr != cudaSuccess) what = "cudaFreeAsync(scratch)", err = ferr;
  if (err != cudaSuccess) {
    (void)cudaGetLastError(); // reported here, not again by the next stage's launch check
    return moeI_seterr(ctx, MOE_ERR_CUDA, "experts: %s failed: %s: %s", what, cudaGetErrorName(err),
                       cudaGetErrorString(err));
  }
  return moeI_ok(ctx);
}

} // namespace
