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
//   pair       both slices issued into two fresh accumulators, then each waited for and promoted:
//              the gate's promotion under the up slice's MMAs
//   rows       one slice's running sums (tokens as M: the row tiles, sm90x2_fp8), a fresh
//              accumulator issued, waited for and promoted in turn (DeepGEMM's pattern)
//   rows x4    the same in groups of four k blocks in two accumulators, each block issued before
//              the one before it is promoted, none in flight when the loop turns (a group in
//              flight across a loop's back edge makes ptxas serialise the wgmma, C7514)
//
// Prints MAC / clock / SM (the SM's clock from clock64, so a lower clock under the power cap does
// not count against a pattern) beside Hopper's dense e4m3 rate, 4,096.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "experts/fp8.cuh" // slice_mma, the kernel's own slice

namespace {

constexpr int ITERS = 4000, SMEM = 48 * 1024 + 1024, PEAK = 4096;
enum Pattern { CHAIN, PINGPONG, PAIR, ROWS, ROWS4 };

#if defined(MOE_SM90A)
// a slice's k block of 128 into acc, fresh: four k32 wgmma, one committed group
template <int N> __device__ __forceinline__ void issue(float (&acc)[N / 2], uint64_t da, uint64_t db) {
  wgmma_fence();
  fence_acc(acc);
#pragma unroll
  for (int k = 0; k < 4; k++) wgmma_e4m3_n<N, 0>(acc, da + 2 * k, db + 2 * k, k > 0);
  wgmma_commit();
}
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
template <int OFF, int D, int A> __device__ __forceinline__ void promote(float (&d)[D], float (&acc)[A], float s) {
  fence_acc(acc);
#pragma unroll
  for (int i = 0; i < A; i++) d[OFF + i] = __fmaf_rn(acc[i], s, d[OFF + i]);
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
  constexpr int D = P == ROWS || P == ROWS4 ? N / 2 : N; // the running sums: one slice or two
  const uint64_t da1 = da + 64;                          // + 1 KiB: the other slice's rows
  float d[D], acc[N / 2], acc1[N / 2];
#pragma unroll
  for (int i = 0; i < D; i++) d[i] = 0.f;
  const float s = 1.0f + (float)threadIdx.x * 1e-3f;
  const long long t0 = clock64();
  // every pattern issues 2 ITERS groups of 4 wgmma a warpgroup
  if constexpr (P == CHAIN || P == PINGPONG) {
    if (P == PINGPONG && wg == 1) bar_arrive(3); // warpgroup 0 first
    for (int it = 0; it < 2 * ITERS; it++) {
      if (P == PINGPONG) named_bar_sync(3 + wg, 256);
      slice_mma<N>(acc, (it & 1) ? da1 : da, db);
      if (P == PINGPONG) bar_arrive(4 - wg);
      if (PROMOTE || it >= 2 * ITERS - 2) {
        if (it & 1) promote<N / 2>(d, acc, s);
        else promote<0>(d, acc, s);
      }
    }
    if (P == PINGPONG && wg == 0) named_bar_sync(3, 256); // the last hand-over
  } else if constexpr (P == PAIR) {
    for (int it = 0; it < ITERS; it++) {
      issue<N>(acc, da, db);
      issue<N>(acc1, da1, db);
      wgmma_wait<1>();
      if (PROMOTE || it == ITERS - 1) promote<0>(d, acc, s);
      wgmma_wait<0>();
      if (PROMOTE || it == ITERS - 1) promote<N / 2>(d, acc1, s);
    }
  } else if constexpr (P == ROWS) {
    for (int it = 0; it < 2 * ITERS; it++) {
      slice_mma<N>(acc, (it & 1) ? da1 : da, db);
      if (PROMOTE || it == 2 * ITERS - 1) promote<0>(d, acc, s);
    }
  } else {
    for (int it = 0; it < ITERS / 2; it++) {
      issue<N>(acc, da, db);
      issue<N>(acc1, da1, db);
      wgmma_wait<1>();
      if (PROMOTE) promote<0>(d, acc, s);
      issue<N>(acc, da, db);
      wgmma_wait<1>();
      if (PROMOTE) promote<0>(d, acc1, s);
      issue<N>(acc1, da1, db);
      wgmma_wait<1>();
      promote<0>(d, acc, s);
      wgmma_wait<0>();
      promote<0>(d, acc1, s);
    }
  }
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < D; i++) sum += d[i];
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
                  run<96, CHAIN, true>("chain", 2, sms) && run<128, CHAIN, false>("chain", 2, sms) &&
                  run<96, PAIR, true>("pair", 2, sms) && run<120, PAIR, true>("pair", 2, sms) &&
                  run<128, ROWS, true>("rows", 1, sms) && run<128, ROWS, true>("rows", 2, sms) &&
                  run<128, ROWS4, true>("rows x4", 1, sms) && run<128, ROWS4, true>("rows x4", 2, sms);
  if (!ok) {
    fprintf(stderr, "wgmma_fp8_rate: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  return 0;
}
