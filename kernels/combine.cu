/* SPDX-License-Identifier: MIT */
// combine.cu -- stage 5 on the GPU: out[t] = sum_k w[t,k] * ys_owner[route_row_owner[rank, t*K+k]]
// (+ g[t] * shared[t]).
//
// As many blocks as fit on the GPU at once, each taking every gridDim.x-th token of the source
// rank; each summing thread owns a slice of H in registers (f32, 8 elements per 16-byte load of
// bf16).  The operations and their order are moeI_combine_cpu's: acc starts at +0, then
// acc = acc + w * y for k ascending (a separately rounded multiply and add: __fmul_rn /
// __fadd_rn, which no compiler flag fuses), then acc + g * shared, then one rounding to bf16 with
// the CPU's own f32_to_bf16.  So the GPU gives the CPU's bits, with no atomics and the same
// result on every run.
//
// The owners' ys and route_row pointers travel as a kernel parameter (a __grid_constant__
// struct, indexed in place), so the launch needs no device table and a graph captures it.
#include <stdint.h>
#include <string.h>

#include "common.cuh"

namespace {

constexpr int MAX_WORLD = MOE_CUDA_COMBINE_MAX_WORLD; // 3 KB of pointers: inside the 4 KB of parameters
constexpr int KC = 64;         // routes whose sources are looked up at a time

struct Owners {
  const uint16_t *ys[MAX_WORLD];
  const int32_t *route_row[MAX_WORLD];
  int64_t rows[MAX_WORLD]; // C_o
};

struct Args {
  void *out;
  const float *w;
  const int32_t *ids;
  const uint16_t *shared;
  const float *gate;
  int64_t T, K, H, E, EL;
  int rank;
};

// VEC elements per piece (8: one 16-byte load, 1: one bf16), NV pieces per thread and pass.
template <int VEC>
struct Piece;
template <>
struct Piece<8> {
  uint4 v;
  __device__ __forceinline__ void load(const uint16_t *p) { v = __ldg((const uint4 *)p); }
  // element e: the low half of word e / 2 comes first in memory (little endian)
  __device__ __forceinline__ float at(int e) const {
    const uint32_t w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  }
};
template <>
struct Piece<1> {
  uint16_t v;
  __device__ __forceinline__ void load(const uint16_t *p) { v = __ldg(p); }
  __device__ __forceinline__ float at(int) const { return bf16_to_f32(v); }
};

// acc += w * y, element by element: one rounded multiply, one rounded add, as on the CPU.
template <int VEC, int NV>
__device__ __forceinline__ void accumulate(float (&acc)[NV][VEC], const Piece<VEC> (&y)[NV], float w,
                                           const int64_t (&hh)[NV], int64_t H) {
#pragma unroll
  for (int u = 0; u < NV; u++)
    if (hh[u] < H)
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w, y[u].at(e)));
}

// The block's work is a sequence of steps (token, pass over H, group of KC routes), tokens
// blockIdx.x, blockIdx.x + gridDim.x, ...  Its last warp looks up the sources of the next step
// (two dependent loads: the id, then the owner's route_row) into the other half of src/wk while
// the other warps sum the current one, so that latency is off the critical path: with one token
// per block, it was paid once per token before any row could be loaded.
template <int VEC, int NV, bool F32_OUT>
__global__ void __launch_bounds__(512)
combine_kernel(const __grid_constant__ Owners own, const Args a) {
  __shared__ const uint16_t *src[2][KC];
  __shared__ float wk[2][KC];
  const int64_t H = a.H, K = a.K, TK = a.T * K, G = gridDim.x;
  const int nacc = (int)blockDim.x - 32; // summing threads; the last warp looks up
  const bool looker = (int)threadIdx.x >= nacc;
  const int lane = (int)threadIdx.x & 31;
  const int64_t step = (int64_t)nacc * NV * VEC; // elements per pass
  // K = 0 still has one (empty) group a token, whose last step stores the shared expert or 0
  const int64_t passes = (H + step - 1) / step, groups = K > 0 ? (K + KC - 1) / KC : 1;
  const int64_t per_token = passes * groups;
  const int64_t n = (a.T - blockIdx.x + G - 1) / G * per_token;

  // the sources of step i's routes into half b: NULL where moeI_combine_cpu skips the route
  auto look_up = [&](int64_t i, int b) {
    const int64_t t = blockIdx.x + i / per_token * G, k0 = i % groups * KC;
    const int kn = (int)(K - k0 < KC ? K - k0 : KC);
    for (int j = lane; j < kn; j += 32) {
      const int64_t k = k0 + j;
      const int64_t id = a.ids[t * K + k];
      const float w = a.w[t * K + k]; // beside the id, not after the route_row it does not need
      const uint16_t *p = nullptr;
      if (id >= 0 && id < a.E) {
        const int64_t o = id / a.EL;
        const int64_t row = own.route_row[o][a.rank * TK + t * K + k];
        if (row >= 0 && row < own.rows[o]) p = own.ys[o] + row * H;
      }
      src[b][j] = p;
      wk[b][j] = p ? w : 0.0f;
    }
  };

  if (looker && n > 0) look_up(0, 0);
  __syncthreads();
  float acc[NV][VEC];
  for (int64_t i = 0; i < n; i++) {
    const int b = (int)(i & 1);
    if (looker) {
      if (i + 1 < n) look_up(i + 1, b ^ 1);
    } else {
      const int64_t t = blockIdx.x + i / per_token * G, r = i % per_token;
      const int64_t gi = r % groups, k0 = gi * KC, h0 = r / groups * step;
      const int kn = (int)(K - k0 < KC ? K - k0 : KC);
      int64_t hh[NV];
#pragma unroll
      for (int u = 0; u < NV; u++) hh[u] = h0 + ((int64_t)u * nacc + threadIdx.x) * VEC;
      if (gi == 0)
#pragma unroll
        for (int u = 0; u < NV; u++)
#pragma unroll
          for (int e = 0; e < VEC; e++) acc[u][e] = 0.0f;
      // two routes at a time, so that both routes' loads are in flight before the first add;
      // the adds stay in k order (a NULL source is the same for the whole block)
      for (int j = 0; j < kn; j += 2) {
        const uint16_t *p0 = src[b][j], *p1 = j + 1 < kn ? src[b][j + 1] : nullptr;
        Piece<VEC> y0[NV], y1[NV];
#pragma unroll
        for (int u = 0; u < NV; u++) {
          if (p0 && hh[u] < H) y0[u].load(p0 + hh[u]);
          if (p1 && hh[u] < H) y1[u].load(p1 + hh[u]);
        }
        if (p0) accumulate<VEC, NV>(acc, y0, wk[b][j], hh, H);
        if (p1) accumulate<VEC, NV>(acc, y1, wk[b][j + 1], hh, H);
      }
      if (gi == groups - 1) { // the token's last group of this pass: shared expert, then out
        if (a.shared) {
          const float g = a.gate ? a.gate[t] : 1.0f; // the CPU multiplies by 1 too: exact
          const uint16_t *p = a.shared + t * H;
          Piece<VEC> y[NV];
#pragma unroll
          for (int u = 0; u < NV; u++)
            if (hh[u] < H) y[u].load(p + hh[u]);
          accumulate<VEC, NV>(acc, y, g, hh, H);
        }
#pragma unroll
        for (int u = 0; u < NV; u++) {
          if (hh[u] >= H) continue;
          if constexpr (F32_OUT && VEC == 8) {
            float4 *o = (float4 *)((float *)a.out + t * H + hh[u]);
            o[0] = make_float4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]);
            o[1] = make_float4(acc[u][4], acc[u][5], acc[u][6], acc[u][7]);
          } else if constexpr (F32_OUT) {
            ((float *)a.out)[t * H + hh[u]] = acc[u][0];
          } else if constexpr (VEC == 8) {
            uint32_t w[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
              w[e] = (uint32_t)f32_to_bf16(acc[u][2 * e]) | ((uint32_t)f32_to_bf16(acc[u][2 * e + 1]) << 16);
            *(uint4 *)((uint16_t *)a.out + t * H + hh[u]) = make_uint4(w[0], w[1], w[2], w[3]);
          } else {
            ((uint16_t *)a.out)[t * H + hh[u]] = f32_to_bf16(acc[u][0]);
          }
        }
      }
    }
    __syncthreads(); // half b is looked up again at step i + 1
  }
}

template <int VEC, int NV, bool F32_OUT>
int launch_one(moe_ctx *ctx, cudaStream_t s, const Owners &own, const Args &a, int threads) {
  int dev = 0, nsm = 0, per_sm = 0;
  MOE_CUDA_TRY(ctx, "combine", cudaGetDevice(&dev));
  if (int rc = moeI_cuda_sm_count(ctx, dev, &nsm)) return rc;
  MOE_CUDA_TRY(ctx, "combine", cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, combine_kernel<VEC, NV, F32_OUT>, threads, 0));
  if (per_sm < 1) per_sm = 1;
  const int64_t resident = (int64_t)nsm * per_sm;
  const unsigned grid = (unsigned)(a.T < resident ? a.T : resident);
  combine_kernel<VEC, NV, F32_OUT><<<grid, (unsigned)threads, 0, s>>>(own, a);
  MOE_CUDA_LAUNCHED(ctx, "combine");
  return moeI_ok(ctx);
}

template <int VEC, int NV>
int launch(moe_ctx *ctx, cudaStream_t s, const Owners &own, const Args &a, int f32_out) {
  const int64_t units = (a.H + VEC - 1) / VEC;
  int64_t threads = (units + NV - 1) / NV;
  threads = (threads + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 480 ? 480 : threads;
  threads += 32; // the look-up warp
  if (a.T > INT32_MAX) return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "combine: %lld tokens are too many for cuda", (long long)a.T);
  return f32_out ? launch_one<VEC, NV, true>(ctx, s, own, a, (int)threads)
                 : launch_one<VEC, NV, false>(ctx, s, own, a, (int)threads);
}

} // namespace

int moeI_combine_cuda(moe_ctx *ctx, const moe_combine_args *a) {
  const int W = a->world;
  if (W > MAX_WORLD)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "combine: world must be at most %d on cuda, got %d", MAX_WORLD, W);
  Args g;
  g.out = a->out->data;
  g.w = (const float *)a->weights->data;
  g.ids = (const int32_t *)a->ids->data;
  g.shared = a->shared ? (const uint16_t *)a->shared->data : nullptr;
  g.gate = a->shared_gate ? (const float *)a->shared_gate->data : nullptr;
  g.T = a->weights->shape[0];
  g.K = a->weights->shape[1];
  g.H = a->out->shape[1];
  g.E = a->experts;
  g.EL = a->experts / W;
  g.rank = a->rank;
  if (!g.T || !g.H) return moeI_ok(ctx);

  Owners own;
  memset(&own, 0, sizeof own);
  // 16-byte pieces when every row of every tensor starts on a 16-byte boundary
  int vec = g.H % 8 == 0 && (uintptr_t)g.out % 16 == 0 && (!g.shared || (uintptr_t)g.shared % 16 == 0);
  for (int o = 0; o < W; o++) {
    own.ys[o] = (const uint16_t *)a->ys[o]->data;
    own.route_row[o] = (const int32_t *)a->route_row[o]->data;
    own.rows[o] = a->ys[o]->shape[0];
    vec = vec && (uintptr_t)own.ys[o] % 16 == 0;
  }

  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, a->out->device.index, &s);
  if (rc) return rc;
  const int f32_out = a->out->dtype == MOE_F32;
  return vec ? launch<8, 4>(ctx, s, own, g, f32_out) : launch<1, 8>(ctx, s, own, g, f32_out);
}
