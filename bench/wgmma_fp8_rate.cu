/* SPDX-License-Identifier: MIT */
// wgmma_fp8_rate.cu -- how fast the tensor cores take e4m3 wgmma m64nNk32 (kernels/sm90/wgmma.cuh)
// in the issue, wait and promote patterns of the FP8 experts kernel (kernels/experts/fp8.cuh),
// with nothing else running: no loads, the operands fixed in shared memory, one CTA an SM.  A
// bench program, not part of the library (docs/perf/experts.md, "Where the time goes").
//
//   chain      a warpgroup's slice: four k32 wgmma into a fresh accumulator, commit, wait for
//              them, then (promote) add it into the running sums times a scale; two slices in
//              turn, as sm90w_fp8's gate and up slices
//   ping-pong  the same, a warpgroup issuing only once the other's group is done (named barriers)
//
// Prints MAC / clock / SM (the SM's clock from clock64, so a lower clock under the power cap does
// not count against a pattern) beside Hopper's dense e4m3 rate, 4,096.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace {

constexpr int ITERS = 4000, SMEM = 48 * 1024 + 1024, PEAK = 4096;
enum Pattern { CHAIN, PINGPONG };

#if defined(MOE_SM90A)
// as fp8.cuh's slice_mma
template <int N> __device__ __forceinline__ void slice(float (&acc)[N / 2], uint64_t da, uint64_t db) {
  wgmma_fence();
  fence_acc(acc);
#pragma unroll
  for (int k = 0; k < 4; k++) wgmma_e4m3_n<N, 0>(acc, da + 2 * k, db + 2 * k, k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(acc);
}
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
template <int N, int OFF>
__device__ __forceinline__ void promote(float (&d)[N], const float (&acc)[N / 2], float s) {
#pragma unroll
  for (int i = 0; i < N / 2; i++) d[OFF + i] = __fmaf_rn(acc[i], s, d[OFF + i]);
}
#endif

template <int N, Pattern P, bool PROMOTE>
__global__ void __launch_bounds__(256, 1) rate_kernel(float *out, long long *cycles) {
#if defined(MOE_SM90A)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw), base = (raw + 1023u) & ~1023u;
  uint32_t *words = reinterpret_cast<uint32_t *>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < 48 * 1024 / 4; i += blockDim.x) words[i] = (i & 7) == 0 ? 0x38383838u : 0u;
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  // each warpgroup its own 64 x 128 A (two 64-row slices 8 KiB apart), one B of N rows for both
  const uint64_t da = smem_desc(base + (uint32_t)wg * 8192u), db = smem_desc(base + 16384u);
  float d[N], acc[N / 2];
#pragma unroll
  for (int i = 0; i < N; i++) d[i] = 0.f;
  const float s = 1.0f + (float)threadIdx.x * 1e-3f;
  const long long t0 = clock64();
  if (P == PINGPONG && wg == 1) bar_arrive(3); // warpgroup 0 first
  for (int it = 0; it < 2 * ITERS; it++) {
    if (P == PINGPONG) named_bar_sync(3 + wg, 256);
    slice<N>(acc, da + (uint64_t)((it & 1) * 64), db); // + 1 KiB: the other slice's rows
    if (P == PINGPONG) bar_arrive(4 - wg);
    if (PROMOTE || it >= 2 * ITERS - 2) {
      if (it & 1) promote<N, N / 2>(d, acc, s);
      else promote<N, 0>(d, acc, s);
    }
  }
  if (P == PINGPONG && wg == 0) named_bar_sync(3, 256); // the last hand-over
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < N; i++) sum += d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum; // keeps every product live
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
#else
  (void)out, (void)cycles;
  __trap();
#endif
}

template <int N, Pattern P, bool PROMOTE> bool run(const char *name, int warpgroups, int sms) {
  float *out = nullptr;
  long long *cycles = nullptr;
  auto kernel = rate_kernel<N, P, PROMOTE>;
  if (cudaMalloc(&out, (size_t)sms * 256 * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&cycles, (size_t)sms * sizeof(long long)) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM) != cudaSuccess)
    return false;
  double mean = 0;
  for (int rep = 0; rep < 2; rep++) { // the first a warm-up
    kernel<<<sms, 128 * warpgroups, SMEM>>>(out, cycles);
    if (cudaDeviceSynchronize() != cudaSuccess) return false;
  }
  long long *c = new long long[sms];
  cudaMemcpy(c, cycles, (size_t)sms * sizeof(long long), cudaMemcpyDeviceToHost);
  for (int i = 0; i < sms; i++) mean += (double)c[i] / sms;
  delete[] c;
  const double macs = (double)warpgroups * 2 * ITERS * 4 * 64.0 * N * 32; // an SM's
  printf("%-22s %-9s N %3d  %d warpgroup%s  %6.0f MAC/clock/SM  %3.0f%%\n", name, PROMOTE ? "promote" : "-", N,
         warpgroups, warpgroups > 1 ? "s" : " ", macs / mean, 100 * macs / mean / PEAK);
  cudaFree(out), cudaFree(cycles);
  return true;
}

} // namespace

int main() {
  int dev = 0, major = 0, minor = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (major != 9 || minor != 0) {
    fprintf(stderr, "wgmma_fp8_rate: needs a Hopper GPU (compute capability 9.0), cuda:%d is %d.%d\n", dev, major,
            minor);
    return 1;
  }
  printf("pattern                promotion  N    warpgroups   rate (of %d)\n", PEAK);
  const bool ok = run<120, CHAIN, false>("chain", 1, sms) && run<120, CHAIN, false>("chain", 2, sms) &&
                  run<120, CHAIN, true>("chain", 1, sms) && run<120, CHAIN, true>("chain", 2, sms) &&
                  run<120, PINGPONG, false>("ping-pong", 2, sms) && run<120, PINGPONG, true>("ping-pong", 2, sms) &&
                  run<96, CHAIN, true>("chain", 2, sms) && run<128, CHAIN, false>("chain", 2, sms);
  if (!ok) {
    fprintf(stderr, "wgmma_fp8_rate: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  return 0;
}
