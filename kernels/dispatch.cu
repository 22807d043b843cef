/* SPDX-License-Identifier: MIT */
// dispatch.cu -- stage 3 on the GPU: out[row] = x[peer_rank[row], peer_route[row] / k].
//
// A gather of whole rows: the only work is moving bytes, so the kernel is built for copy
// bandwidth.  Each block takes a run of RB consecutive rows of xs and looks their sources up
// once (into shared memory); its threads then walk the run's RB * H bytes in 16-byte pieces,
// several pieces in flight per thread (all loads of a pass are issued before its stores), and
// consecutive threads take consecutive pieces, so every warp reads and writes whole 512-byte
// stretches.  Narrower pieces (4, 2 or 1 bytes) serve rows that are not 16-byte multiples or
// tensors (views) that are not 16-byte aligned.  The grid covers all C rows: nothing depends on
// how many rows the schedule used, so no host synchronisation and a graph can capture it.
// moe_dispatch_fp8 runs the same kernel over rows of H e4m3 bytes (H a multiple of 128: 16-byte
// pieces wherever the tensors are aligned), whose last blocks gather the rows' scales into their
// transposed layout meanwhile (a launch of its own cost ~5 us a rank at decode).
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

// moe_dispatch_fp8's scales: out [nb, C] from x [W * T, nb]; nb 0 for the bf16 dispatch (none).
struct Scales {
  float *out;
  const float *x;
  int64_t nb;
};

// The scales of rows [r0, r0 + SCALE_ROWS): their sources looked up once; in chunks of SCALE_COLS
// scale blocks, each row's run of floats (contiguous in x) read into shared memory and written
// transposed, each block's rows as one 128-byte run.  (A thread an output read one float every
// nb from a different token: a sector for 4 bytes.)
constexpr int SCALE_ROWS = 32, SCALE_COLS = 64;
__device__ __forceinline__ void gather_scales(const Scales &sc, int64_t r0, const int32_t *__restrict__ peer_rank,
                                              const int32_t *__restrict__ peer_route, int64_t C, int64_t W,
                                              int64_t T, int64_t routes, int k, int zero_fill) {
  __shared__ int64_t src[SCALE_ROWS];
  __shared__ float tile[SCALE_ROWS][SCALE_COLS + 1]; // + 1: the transposed reads fall in distinct banks
  const int64_t nb = sc.nb;
  if (threadIdx.x < SCALE_ROWS)
    src[threadIdx.x] = r0 + threadIdx.x < C ? source_of(peer_rank, peer_route, r0 + threadIdx.x, W, T, routes, k) : -1;
  __syncthreads();
  for (int64_t b0 = 0; b0 < nb; b0 += SCALE_COLS) {
    const int cols = (int)(nb - b0 < SCALE_COLS ? nb - b0 : SCALE_COLS);
    for (int i = threadIdx.x; i < SCALE_ROWS * cols; i += THREADS) {
      const int j = i / cols, c = i - j * cols;
      tile[j][c] = src[j] >= 0 ? __ldg(sc.x + src[j] * nb + b0 + c) : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < SCALE_ROWS * cols; i += THREADS) {
      const int c = i / SCALE_ROWS, j = i - c * SCALE_ROWS;
      if (r0 + j < C && (src[j] >= 0 || zero_fill)) sc.out[(b0 + c) * C + r0 + j] = tile[j][c];
    }
    __syncthreads();
  }
}

// V: the piece (uint4, uint32_t, uint16_t or uint8_t); pieces: a row in pieces.  The blocks past
// the rows' (rb rows each) gather the FP8 scales, SCALE_ROWS rows each, beside the rows.
template <typename V>
__global__ void __launch_bounds__(THREADS)
dispatch_kernel(V *__restrict__ xs, const V *__restrict__ x, const int32_t *__restrict__ peer_rank,
                const int32_t *__restrict__ peer_route, int64_t C, int64_t W, int64_t T, int64_t routes, int k,
                uint32_t pieces, int rb, int zero_fill, const Scales sc) {
  const int64_t row_blocks = (C + rb - 1) / rb;
  if ((int64_t)blockIdx.x >= row_blocks) {
    gather_scales(sc, ((int64_t)blockIdx.x - row_blocks) * SCALE_ROWS, peer_rank, peer_route, C, W, T, routes, k,
                  zero_fill);
    return;
  }
  // The block's rows that are written (with a source, or all under zero_fill), packed: src[i] is
  // the source of row r0 + row[i].  A layer's capacity rows are often half empty, and a block
  // that walked its empty rows' pieces cost as much issue as one that copies them.
  __shared__ int64_t src[MAX_RB];
  __shared__ int row[MAX_RB];
  __shared__ int n_put;
  const int64_t r0 = (int64_t)blockIdx.x * rb;
  const int nr = (int)(C - r0 < rb ? C - r0 : rb);
  if (threadIdx.x < 32) {
    const int lane = (int)threadIdx.x;
    int n = 0;
    for (int j0 = 0; j0 < nr; j0 += 32) {
      const int j = j0 + lane;
      const int64_t s = j < nr ? source_of(peer_rank, peer_route, r0 + j, W, T, routes, k) : -1;
      const bool put = j < nr && (s >= 0 || zero_fill);
      const unsigned m = __ballot_sync(0xffffffffu, put);
      if (put) {
        const int at = n + __popc(m & ((1u << lane) - 1u));
        src[at] = s, row[at] = j;
      }
      n += __popc(m);
    }
    if (lane == 0) n_put = n;
  }
  __syncthreads();

  const uint32_t total = (uint32_t)n_put * pieces;
  V *__restrict__ out = xs + r0 * pieces;
  for (uint32_t base = threadIdx.x; base < total; base += THREADS * UNROLL) {
    V v[UNROLL];
    uint32_t at[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const uint32_t f = base + u * THREADS;
      at[u] = UINT32_MAX;
      v[u] = V{}; // all-zero bits are +0 in bf16 and e4m3 (zero_fill's rows)
      if (f < total) {
        const uint32_t i = f / pieces, c = f - i * pieces;
        const int64_t s = src[i];
        if (s >= 0) v[u] = __ldg(x + s * pieces + c);
        at[u] = (uint32_t)row[i] * pieces + c;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
      if (at[u] != UINT32_MAX) out[at[u]] = v[u];
  }
}

// The rows of both dispatches: row_bytes bytes each (bf16 or e4m3 elements), in pieces of V.
struct Rows {
  void *out;
  const void *x;
  const int32_t *peer_rank, *peer_route;
  int64_t C, W, T, row_bytes;
  int k, zero_fill;
  Scales sc;
};

template <typename V>
int launch(moe_ctx *ctx, cudaStream_t s, const char *stage, const Rows &g) {
  const int64_t pieces = g.row_bytes / (int64_t)sizeof(V);
  if (pieces * MAX_RB >= ((int64_t)1 << 31))
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: rows of %lld bytes are too long for cuda", stage,
                       (long long)g.row_bytes);
  // enough rows per block for several passes of THREADS * UNROLL pieces
  int64_t rb = (4 * THREADS * UNROLL + pieces - 1) / pieces;
  rb = rb < 1 ? 1 : rb > MAX_RB ? MAX_RB : rb;
  const int64_t blocks = (g.C + rb - 1) / rb + (g.sc.nb ? (g.C + SCALE_ROWS - 1) / SCALE_ROWS : 0);
  if (blocks > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: %lld rows are too many for cuda", stage, (long long)g.C);
  dispatch_kernel<V><<<(unsigned)blocks, THREADS, 0, s>>>((V *)g.out, (const V *)g.x, g.peer_rank, g.peer_route, g.C,
                                                          g.W, g.T, moeI_dispatch_routes(g.T, g.k), g.k,
                                                          (uint32_t)pieces, (int)rb, g.zero_fill != 0, g.sc);
  MOE_CUDA_LAUNCHED(ctx, stage);
  return moeI_ok(ctx);
}

// The widest piece that the row length and both base addresses allow.
int launch_rows(moe_ctx *ctx, cudaStream_t s, const char *stage, const Rows &g) {
  const uintptr_t px = (uintptr_t)g.x, pxs = (uintptr_t)g.out;
  const int64_t row = g.row_bytes;
  if (row % 16 == 0 && px % 16 == 0 && pxs % 16 == 0) return launch<uint4>(ctx, s, stage, g);
  if (row % 4 == 0 && px % 4 == 0 && pxs % 4 == 0) return launch<uint32_t>(ctx, s, stage, g);
  if (row % 2 == 0 && px % 2 == 0 && pxs % 2 == 0) return launch<uint16_t>(ctx, s, stage, g);
  return launch<uint8_t>(ctx, s, stage, g);
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
  const Rows g = {a->out->data, a->x->data, (const int32_t *)a->peer_rank->data, (const int32_t *)a->peer_route->data,
                  C, a->x->shape[0], a->x->shape[1], H * 2, a->k, a->zero_fill, {}};
  return launch_rows(ctx, s, "dispatch", g);
}

// moe_dispatch_fp8 has checked that no output overlaps an input, and that H is a multiple of 128.
int moeI_dispatch_fp8_cuda(moe_ctx *ctx, const moe_dispatch_fp8_args *a) {
  const int64_t W = a->x->shape[0], T = a->x->shape[1], H = a->x->shape[2], C = a->out->shape[0];
  if (!C || !H) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, a->out->device.index, &s);
  if (rc) return rc;
  const int32_t *peer_rank = (const int32_t *)a->peer_rank->data, *peer_route = (const int32_t *)a->peer_route->data;
  const Scales sc = {(float *)a->out_scale->data, (const float *)a->x_scale->data, H / 128};
  const Rows g = {a->out->data, a->x->data, peer_rank, peer_route, C, W, T, H, a->k, a->zero_fill, sc};
  return launch_rows(ctx, s, "dispatch_fp8", g);
}
