/* SPDX-License-Identifier: MIT */
// mma.cuh -- the PTX of the Ampere-style tensor-core GEMMs (kernels/experts/mma.cu and
// kernels/logits.cu): 16-byte cp.async into shared memory, ldmatrix, bf16 mma.sync.m16n8k16 with
// f32 accumulators, and the XOR swizzle of their 128-byte tile rows (64 bf16 of k).
#pragma once

#include <stdint.h>

namespace {

// 16 bytes from global to shared; src_bytes = 0 fills zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a . b over one m16 x n8 x k16 tile.
__device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk ch of tile row r, rows of 128 bytes (64 bf16 of k): chunks
// XOR-swizzled by r & 7 so that both the cp.async writes and the ldmatrix reads of 8 rows hit 8
// distinct bank groups.
constexpr int MMA_ROW_BYTES = 128;
// The accumulators of a warp's 4 x 4 mma tiles, zeroed.
__device__ __forceinline__ void zero_acc(float (&acc)[4][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int q = 0; q < 4; q++) acc[mi][j][q] = 0.f;
}

__device__ __forceinline__ int swz(int r, int ch) { return r * MMA_ROW_BYTES + ((ch ^ (r & 7)) << 4); }

} // namespace
