// combine.cu -- stage 5 on the GPU: out[t] = sum_k w[t,k] * ys_owner[route_row_owner[rank, t*K+k]]
// (+ g[t] * shared[t]).
//
// One block per token of the source rank; each thread owns a slice of H in registers (f32, 8
// elements per 16-byte load of bf16).  The operations and their order are combine_cpu's: acc
// starts at +0, then acc = acc + w * y for k ascending (a separately rounded multiply and add:
// __fmul_rn / __fadd_rn, which no compiler flag fuses), then acc + g * shared, then one
// rounding to bf16 with the CPU's own f32_to_bf16.  So the GPU gives the CPU's bits, with no
// atomics and the same result on every run.
//
// The owners' ys and route_row pointers travel as a kernel parameter (a __grid_constant__
// struct, indexed in place), so the launch needs no device table and a graph captures it.
#include <stdint.h>
#include <string.h>

#include "common.cuh"

namespace {

constexpr int MAX_WORLD = 128; // 3 KB of pointers: well inside the 4 KB kernel parameter space
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

template <int VEC, int NV, bool F32_OUT>
__global__ void __launch_bounds__(512)
combine_kernel(const __grid_constant__ Owners own, const Args a) {
  __shared__ const uint16_t *src[KC];
  __shared__ float wk[KC];
  const int64_t t = blockIdx.x, H = a.H, K = a.K;
  const int64_t TK = a.T * K;
  const int64_t step = (int64_t)blockDim.x * NV * VEC; // elements per pass

  for (int64_t h0 = 0; h0 < H; h0 += step) {
    float acc[NV][VEC];
#pragma unroll
    for (int u = 0; u < NV; u++)
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[u][e] = 0.0f;
    int64_t hh[NV];
#pragma unroll
    for (int u = 0; u < NV; u++) hh[u] = h0 + ((int64_t)u * blockDim.x + threadIdx.x) * VEC;

    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int kn = (int)(K - k0 < KC ? K - k0 : KC);
      // the sources of routes k0 .. k0 + kn - 1: one thread each, NULL where combine_cpu skips
      if ((int)threadIdx.x < kn) {
        const int64_t k = k0 + threadIdx.x;
        const int64_t id = a.ids[t * K + k];
        const uint16_t *p = nullptr;
        if (id >= 0 && id < a.E) {
          const int64_t o = id / a.EL;
          const int64_t row = own.route_row[o][a.rank * TK + t * K + k];
          if (row >= 0 && row < own.rows[o]) p = own.ys[o] + row * H;
        }
        src[threadIdx.x] = p;
        wk[threadIdx.x] = p ? a.w[t * K + k] : 0.0f;
      }
      __syncthreads();
      // two routes at a time, so that both routes' loads are in flight before the first add;
      // the adds stay in k order (a NULL source is the same for the whole block)
      for (int j = 0; j < kn; j += 2) {
        const uint16_t *p0 = src[j], *p1 = j + 1 < kn ? src[j + 1] : nullptr;
        Piece<VEC> y0[NV], y1[NV];
#pragma unroll
        for (int u = 0; u < NV; u++) {
          if (p0 && hh[u] < H) y0[u].load(p0 + hh[u]);
          if (p1 && hh[u] < H) y1[u].load(p1 + hh[u]);
        }
        if (p0) accumulate<VEC, NV>(acc, y0, wk[j], hh, H);
        if (p1) accumulate<VEC, NV>(acc, y1, wk[j + 1], hh, H);
      }
      __syncthreads(); // src and wk are rewritten by the next group of routes
    }

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
        uint32_t b[4];
#pragma unroll
        for (int e = 0; e < 4; e++)
          b[e] = (uint32_t)f32_to_bf16(acc[u][2 * e]) | ((uint32_t)f32_to_bf16(acc[u][2 * e + 1]) << 16);
        *(uint4 *)((uint16_t *)a.out + t * H + hh[u]) = make_uint4(b[0], b[1], b[2], b[3]);
      } else {
        ((uint16_t *)a.out)[t * H + hh[u]] = f32_to_bf16(acc[u][0]);
      }
    }
  }
}

template <int VEC, int NV>
int launch(moe_ctx *ctx, cudaStream_t s, const Owners &own, const Args &a, int f32_out) {
  const int64_t units = (a.H + VEC - 1) / VEC;
  int64_t threads = (units + NV - 1) / NV;
  threads = (threads + 31) / 32 * 32;
  threads = threads < 64 ? 64 : threads > 512 ? 512 : threads; // >= KC: one thread per route lookup
  if (a.T > INT32_MAX) return moe_seterr(ctx, MOE_ERR_UNSUPPORTED, "combine: %lld tokens are too many for cuda", (long long)a.T);
  if (f32_out) combine_kernel<VEC, NV, true><<<(unsigned)a.T, (unsigned)threads, 0, s>>>(own, a);
  else combine_kernel<VEC, NV, false><<<(unsigned)a.T, (unsigned)threads, 0, s>>>(own, a);
  MOE_CUDA_LAUNCHED(ctx, "combine");
  return moe_ok(ctx);
}

} // namespace

int combine_cuda(moe_ctx *ctx, const moe_combine_args *a) {
  const int W = a->world;
  if (W > MAX_WORLD)
    return moe_seterr(ctx, MOE_ERR_UNSUPPORTED, "combine: world must be at most %d on cuda, got %d", MAX_WORLD, W);
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
  if (!g.T || !g.H) return moe_ok(ctx);

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
  int rc = cuda_ctx_stream(ctx, a->out->device.index, &s);
  if (rc) return rc;
  const int f32_out = a->out->dtype == MOE_F32;
  return vec ? launch<8, 4>(ctx, s, own, g, f32_out) : launch<1, 8>(ctx, s, own, g, f32_out);
}
