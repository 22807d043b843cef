/* SPDX-License-Identifier: MIT */
// ptx.cuh -- the GPU primitives the kernels use, one inline-asm wrapper each.  For any kernel:
// the global timer and programmatic dependent launch; the stub a Hopper kernel becomes without
// sm_90a, and the host's test for it.  For the Hopper (sm_90a) kernels alone,
// defined only in that device pass (code that uses them tests MOE_SM90A): mbarriers, the tensor
// memory accelerator (TMA) and bulk copies, clusters, setmaxnreg, fences, shared-memory matrix
// descriptors and the wgmma group controls (the wgmma instructions themselves: wgmma.cuh),
// stmatrix.
#pragma once

#include <cuda.h> // CUtensorMap only; no libcuda symbol is used
#include <stdint.h>

#include "../common.cuh"

namespace {
// The global nanosecond timer (traces, watchdogs).
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// Programmatic dependent launch (compute capability 9.0): a kernel launched with the attribute
// starts while the previous one in the stream ends, and waits here before it reads that one's
// results; launch_dependents lets the next kernel start its own prologue.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// Was the Hopper kernel compiled for sm_90a?  Built without it (the host pass cannot tell sm_90
// from sm_90a), its body is MOE_SM90A_STUB, which the host recognises by the stub's 16 bytes of
// static shared memory and never launches; the real kernels have none.  An image for another
// architecture fails the query.
inline bool sm90a_built(const void *kernel) {
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return fa.sharedSizeBytes == 0;
}
} // namespace
#define MOE_SM90A_STUB()                                                                          \
  do {                                                                                            \
    __shared__ volatile unsigned char stub_marker[16];                                            \
    stub_marker[threadIdx.x & 15] = 1;                                                            \
    __trap();                                                                                     \
  } while (0)

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90A 1

namespace {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n\t.reg .pred p;\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
               "selp.u32 %0, 1, 0, p;\n\t}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  return done != 0;
}
// Waits until the phase of parity `parity` has completed (the phase before the current one
// counts as completed, which is how the producer's first pass through the ring goes through).
// A wait that lasts MOE_SM90_WATCHDOG_NS (a whole pass takes milliseconds) can only be a broken
// protocol: the kernel traps, so the launch fails with an error instead of hanging the stream.
#ifndef MOE_SM90_WATCHDOG_NS
#define MOE_SM90_WATCHDOG_NS 20000000000ull // 20 s; 0 turns the watchdog off
#endif
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = MOE_SM90_WATCHDOG_NS ? global_ns() : 0;
  while (!mbar_try_wait(bar, parity))
    if (MOE_SM90_WATCHDOG_NS && global_ns() - t0 > MOE_SM90_WATCHDOG_NS) __trap();
}
__device__ __forceinline__ void mbar_arrive_local(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier at the same shared-memory offset in CTA `cta` of the cluster.  The
// default semantics (release at CTA scope), not .release.cluster: that one compiles to a full
// fence before every arrival (ncu: most of the cluster kernel's stalls), and nothing here needs
// it -- the arrival only says the slot's wgmma reads have retired, which wgmma.wait_group saw.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile("{\n\t.reg .b32 ra;\n\t"
               "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "mbarrier.arrive.shared::cluster.b64 _, [ra];\n\t}\n" ::"r"(bar),
               "r"(cta)
               : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void prefetch_tmap(const CUtensorMap *m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
}
// The map's box at (k, row) of the 2D map into shared memory at dst; the barrier at bar gets the
// bytes.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *m, int k, int row, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(m)), "r"(k), "r"(row), "r"(bar)
               : "memory");
}
// The same box into dst of every CTA in mask; each CTA's barrier at offset bar gets the bytes.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap *m, int k, int row, uint32_t bar,
                                                   uint16_t mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(m)), "r"(k), "r"(row), "r"(bar), "h"(mask)
               : "memory");
}
// The map's box at (col, row) of the 2D map from shared memory at src, in this thread's current
// bulk async-group.
__device__ __forceinline__ void tma_store(const CUtensorMap *m, int col, int row, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(m)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups still read their shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// This thread's shared-memory writes, seen by the async proxy (the bulk stores) after it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout that TMA
// SWIZZLE_128B writes: rows of 128 bytes (64 bf16 of k), 16-byte chunk c of row r stored at
// chunk c ^ (r & 7), groups of 8 rows 1024 bytes apart (the stride byte offset).  The leading
// byte offset is unused for a swizzled K-major operand (one k16 slice lies inside the 128-byte
// row); 1 by convention.  Base offset 0: every operand starts on a 1024-byte boundary.  The k16
// slice j of a stage starts 32 j bytes further: + 2 j in the address field (units of 16 bytes).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4)  // bits 0-13: start address >> 4
         | (uint64_t)1 << 16                  // bits 16-29: leading byte offset >> 4 (unused)
         | (uint64_t)(1024 >> 4) << 32        // bits 32-45: stride byte offset >> 4
         | (uint64_t)1 << 62;                 // bits 62-63: swizzle mode 1 = 128B
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous wgmma
// and its wait: each register is "rewritten" here, in program order with the asm around it.
template <int ACC> __device__ __forceinline__ void fence_acc(float (&d)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Four 8 x 8 bf16 matrices to shared memory, transposed: lane l's register j holds row l / 4,
// columns 2 (l % 4) and + 1 of matrix j, which land in memory row 2 (l % 4) (+ 1) of that matrix at
// column l / 4; lanes 8 j .. 8 j + 7 give the addresses of matrix j's memory rows.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// Two of them: lanes 0 .. 15 give the addresses.
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

} // namespace
#endif // sm_90a
