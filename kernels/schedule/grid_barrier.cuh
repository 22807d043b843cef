/* SPDX-License-Identifier: MIT */
// grid_barrier.cuh -- the scheduler's grid barrier (bitmap.cu, grid.cu), shared with the bench of
// its floor (bench/launch_floor.cu) so that the bench measures this code, not a copy.
#pragma once

// All blocks of the (cooperative, so co-resident) grid.  bar counts arrivals: block 0 adds
// 2^31 - (G - 1), every other block 1, so that the last arrival, whichever it is, flips bit 31 and
// leaves the low bits as they were (zero).  Nothing is reset, any G works, and bit 31 before the
// barrier is the call's parity (read at the start by thread 0: it cannot flip before this block
// arrives).  One atomic per block, released after the block's writes (bar.sync orders the other
// threads' writes before it), and thread 0 polls with acquiring loads.
__device__ __forceinline__ void grid_barrier(unsigned *bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned inc = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    unsigned old, now;
    asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(inc) : "memory");
    do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
    while (((now ^ old) & 0x80000000u) == 0);
  }
  __syncthreads();
}

// The same protocol from thread 0 alone, for a block whose other threads have work to do while
// it waits (the caller synchronises the block before and after).  The arrival acquires as well as
// releases, so the last block to arrive -- the one whose addition flips bit 31 -- needs no poll.
__device__ __forceinline__ void grid_arrive_wait(unsigned *bar) {
  const unsigned inc = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
  unsigned old, now;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(inc) : "memory");
  now = old + inc;
  while (((now ^ old) & 0x80000000u) == 0)
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
}
