/* SPDX-License-Identifier: MIT */
// dispatch.cu -- stage 3 on the GPU: out[row] = x[peer_rank[row], peer_route[row] / k].
//
// A gather of whole rows: the only work is moving bytes, so the kernel is built for copy
// bandwidth.  Each block takes a run of RB consecutive rows of xs and looks their sources up
// once (into shared memory); its threads then walk the run's RB * H bytes in 16-byte pieces,
// several pieces in flight per thread (all loads of a pass are issued before its stores), and
// consecutive threads take consecutive pieces, so every warp reads and writes whole 512-byte
// stretches.  Narrower pieces (4 or 2 bytes) serve rows that are not 16-byte multiples or
// tensors (views) that are not 16-byte aligned.  The grid covers all C rows: nothing depends on
// how many rows the schedule used, so no host synchronisation and a graph can capture it.
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int UNROLL = 4;  // pieces in flight per thread
constexpr int MAX_RB = 64; // rows per block at most

// Row r's source as a token index p * T + q / k, or -1 where moeI_dispatch_cpu sees no route:
// peer values are data written on the device, so anything outside x is an empty row.
__device__ __forceinline__ int64_t source_of(const int32_t *__restrict__ peer_rank,
                                             const int32_t *__restrict__ peer_route, int64_t r, int64_t W, int64_t T,
                                             int64_t routes, int k) {
  const int64_t p = peer_rank[r], q = peer_route[r];
  return (p >= 0 && p < W && q >= 0 && q < routes) ? p * T + q / k : -1;
}

// V: the piece (uint4, uint32_t or uint16_t); pieces: H in pieces.
template <typename V>
__global__ void __launch_bounds__(THREADS)
dispatch_kernel(V *__restrict__ xs, const V *__restrict__ x, const int32_t *__restrict__ peer_rank,
                const int32_t *__restrict__ peer_route, int64_t C, int64_t W, int64_t T, int64_t routes, int k,
                uint32_t pieces, int rb, int zero_fill) {
  __shared__ int64_t src[MAX_RB];
  const int64_t r0 = (int64_t)blockIdx.x * rb;
  const int nr = (int)(C - r0 < rb ? C - r0 : rb);
  for (int j = threadIdx.x; j < nr; j += THREADS) src[j] = source_of(peer_rank, peer_route, r0 + j, W, T, routes, k);
  __syncthreads();

  const uint32_t total = (uint32_t)nr * pieces;
  V *__restrict__ out = xs + r0 * pieces;
  for (uint32_t base = threadIdx.x; base < total; base += THREADS * UNROLL) {
    V v[UNROLL];
    uint32_t at[UNROLL];
    bool put[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const uint32_t f = base + u * THREADS;
      put[u] = false;
      at[u] = f;
      v[u] = V{};
      if (f < total) {
        const uint32_t j = f / pieces, c = f - j * pieces;
        const int64_t s = src[j];
        if (s >= 0) v[u] = __ldg(x + s * pieces + c);
        put[u] = s >= 0 || zero_fill; // all-zero bits are bf16 +0
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
      if (put[u]) out[at[u]] = v[u];
  }
}

template <typename V>
int launch(moe_ctx *ctx, cudaStream_t s, const moe_dispatch_args *a) {
  const int64_t W = a->x->shape[0], T = a->x->shape[1], H = a->x->shape[2], C = a->out->shape[0];
  const int64_t pieces = H * 2 / (int64_t)sizeof(V);
  if (pieces * MAX_RB >= ((int64_t)1 << 31))
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "dispatch: rows of %lld elements are too long for cuda", (long long)H);
  // enough rows per block for several passes of THREADS * UNROLL pieces
  int64_t rb = (4 * THREADS * UNROLL + pieces - 1) / pieces;
  rb = rb < 1 ? 1 : rb > MAX_RB ? MAX_RB : rb;
  const int64_t blocks = (C + rb - 1) / rb;
  if (blocks > INT32_MAX) return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "dispatch: %lld rows are too many for cuda", (long long)C);
  dispatch_kernel<V><<<(unsigned)blocks, THREADS, 0, s>>>(
      (V *)a->out->data, (const V *)a->x->data, (const int32_t *)a->peer_rank->data,
      (const int32_t *)a->peer_route->data, C, W, T, moeI_dispatch_routes(T, a->k), a->k, (uint32_t)pieces, (int)rb,
      a->zero_fill != 0);
  MOE_CUDA_LAUNCHED(ctx, "dispatch");
  return moeI_ok(ctx);
}

} // namespace

int moeI_dispatch_cuda(moe_ctx *ctx, const moe_dispatch_args *a) {
  const int64_t H = a->x->shape[2], C = a->out->shape[0];
  const uintptr_t px = (uintptr_t)a->x->data, pxs = (uintptr_t)a->out->data;
  const size_t xbytes = moe_tensor_nbytes(a->x), xsbytes = moe_tensor_nbytes(a->out);
  // The CPU copies row after row (memmove), so out over x has an order there; on the GPU the
  // rows are copied at once and such a call would race.
  if (xbytes && xsbytes && px < pxs + xsbytes && pxs < px + xbytes)
    return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch: out and x share memory, which cuda does not allow");
  if (!C || !H) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, a->out->device.index, &s);
  if (rc) return rc;
  const size_t row = (size_t)H * 2;
  if (row % 16 == 0 && px % 16 == 0 && pxs % 16 == 0) return launch<uint4>(ctx, s, a);
  if (row % 4 == 0 && px % 4 == 0 && pxs % 4 == 0) return launch<uint32_t>(ctx, s, a);
  return launch<uint16_t>(ctx, s, a);
}
