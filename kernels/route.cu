/* SPDX-License-Identifier: MIT */
// route.cu -- stage 1 on the GPU: logits f32 [N, E] -> ids i32 [N, K], weights f32 [N, K].
//
// The same function as moeI_route_cpu (lib/route.c), bit for bit, ids and weights alike:
//   - the scores come from route_math.h, the same source the CPU compiles, and the build turns
//     off FMA contraction (-fmad=false), so s, keys and exps have the CPU's bits;
//   - selection is by the strict order "higher key first, then lower id" (a total order once
//     NaN rows are rejected), so the parallel argmax finds the CPU's experts whatever the
//     reduction tree;
//   - every float sum that feeds a weight is added in the CPU's order: the softmax
//     denominator over all E exps in ascending expert id (one lane adds them, the others hand
//     theirs over by shuffles), the K selected values in slot order.
//
// Layout: a row is handled by TPR = 32 * NW threads; element i of the row lives in register
// slot v = i / TPR of thread i % TPR (coalesced loads).  NW = 1 (E <= 512): one warp per row,
// four rows per block, no shared memory but for the block path's scratch.  NW = 8 (E <= 4096):
// one block per row, the row-wide reductions go through shared memory.
#include <limits.h>
#include <math.h>

#include "common.cuh"
#include "route_math.h"

namespace {

constexpr unsigned FULL = 0xffffffffu;
constexpr int WARP_ROWS = 4; // rows per block on the one-warp-per-row path

// The strict order of the whole stage (route.c's before()).
__device__ __forceinline__ bool before(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Row-wide reductions over the TPR threads of a row.  With NW > 1 they use the block's shared
// scratch and __syncthreads, so every thread of the block must reach them.
template <int NW>
struct Row {
  float *shf;  // [2 * NW]
  int *shi;    // [NW]

  __device__ __forceinline__ bool any(bool p) const {
    if (NW == 1) return __any_sync(FULL, p);
    return __syncthreads_or(p) != 0;
  }

  __device__ __forceinline__ float max(float x) const {
#pragma unroll
    for (int off = 16; off; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    if (NW > 1) {
      const int w = threadIdx.x >> 5;
      if ((threadIdx.x & 31) == 0) shf[w] = x;
      __syncthreads();
      x = shf[0];
#pragma unroll
      for (int u = 1; u < NW; u++) x = fmaxf(x, shf[u]);
      __syncthreads();
    }
    return x;
  }

  // The best (key, id) under before(); every thread of the row gets it.
  __device__ __forceinline__ void best(float &k, int &i) const {
#pragma unroll
    for (int off = 16; off; off >>= 1) {
      float ok = __shfl_xor_sync(FULL, k, off);
      int oi = __shfl_xor_sync(FULL, i, off);
      if (before(ok, oi, k, i)) k = ok, i = oi;
    }
    if (NW > 1) {
      const int w = threadIdx.x >> 5;
      if ((threadIdx.x & 31) == 0) shf[w] = k, shi[w] = i;
      __syncthreads();
      k = shf[0], i = shi[0];
#pragma unroll
      for (int u = 1; u < NW; u++)
        if (before(shf[u], shi[u], k, i)) k = shf[u], i = shi[u];
      __syncthreads();
    }
  }

  // The two largest values (a multiset: a repeated maximum counts twice) of the row's
  // (t1 >= t2) pairs.  Only the values matter: which zero comes out of fmaxf is irrelevant,
  // group scores are only compared and checked for NaN.
  __device__ __forceinline__ static void merge2(float &t1, float &t2, float o1, float o2) {
    float lo = fminf(t1, o1);
    t1 = fmaxf(t1, o1);
    t2 = fmaxf(lo, fmaxf(t2, o2));
  }
  __device__ __forceinline__ void top2(float &t1, float &t2) const {
#pragma unroll
    for (int off = 16; off; off >>= 1) merge2(t1, t2, __shfl_xor_sync(FULL, t1, off), __shfl_xor_sync(FULL, t2, off));
    if (NW > 1) {
      const int w = threadIdx.x >> 5;
      if ((threadIdx.x & 31) == 0) shf[2 * w] = t1, shf[2 * w + 1] = t2;
      __syncthreads();
      t1 = shf[0], t2 = shf[1];
#pragma unroll
      for (int u = 1; u < NW; u++) merge2(t1, t2, shf[2 * u], shf[2 * u + 1]);
      __syncthreads();
    }
  }
};

// The first `rounds` items of the row in the strict order, where item v of this thread is
// (key[v], id[v]) and takes part when bit v of `live` is set.  Returns the last one taken;
// with `pick`, thread j < rounds of warp 0 also gets the j-th (its key and id).  Every round
// takes the best item after the previous round's pick (route.c's top_k), so nothing is
// marked.  Items may repeat (a group's score on each of its experts): equal pairs are one item.
template <int NW, int VPT>
__device__ __forceinline__ void top_rounds(const Row<NW> &row, const float (&key)[VPT], const int (&id)[VPT],
                                           unsigned live, int rounds, int tid, float &last_k, int &last_i,
                                           float *pick_k, int *pick_i) {
  float pk = INFINITY; // (+inf, -1) comes before everything: the first round takes all
  int pi = -1;
  for (int j = 0; j < rounds; j++) {
    float bk = -INFINITY;
    int bi = INT_MAX; // (-inf, INT_MAX) comes after every real item
#pragma unroll
    for (int v = 0; v < VPT; v++)
      if (((live >> v) & 1u) && before(pk, pi, key[v], id[v]) && before(key[v], id[v], bk, bi)) bk = key[v], bi = id[v];
    row.best(bk, bi);
    if (pick_k && tid == j) *pick_k = bk, *pick_i = bi;
    pk = bk, pi = bi;
  }
  last_k = pk, last_i = pi;
}

template <int NW, int VPT>
__global__ void __launch_bounds__(NW == 1 ? 32 * WARP_ROWS : 32 * NW)
route_kernel(int32_t *__restrict__ ids, float *__restrict__ weights, int32_t *__restrict__ stats,
             const float *__restrict__ logits, const float *__restrict__ bias, int N, int E, int K, int scoring,
             int groups, int topk_groups, float scale) {
  constexpr int TPR = 32 * NW;
  __shared__ float shf[2 * NW];
  __shared__ int shi[NW];
  __shared__ float shx[NW > 1 ? TPR * VPT : 1]; // the block path's exps, for the ordered sum
  const Row<NW> row{shf, shi};

  const int tid = NW == 1 ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
  const int64_t r = NW == 1 ? (int64_t)blockIdx.x * WARP_ROWS + (threadIdx.x >> 5) : (int64_t)blockIdx.x;
  if (r >= N) return; // a whole warp (NW = 1 only: the block path launches exactly N blocks)
  const float *l = logits + r * E;

  // keys, and the rejections the CPU makes while computing them
  float key[VPT];
  int id[VPT];
  unsigned live = 0;
  bool bad = false;
  float m = -INFINITY; // softmax: the largest logit
#pragma unroll
  for (int v = 0; v < VPT; v++) {
    const int i = v * TPR + tid;
    id[v] = i;
    key[v] = -INFINITY;
    if (i < E) {
      live |= 1u << v;
      const float x = l[i];
      bad |= isnan(x);
      if (scoring == MOE_SCORE_SOFTMAX) {
        key[v] = x;
        if (x > m) m = x;
      } else {
        float s;
        if (scoring == MOE_SCORE_SIGMOID) {
          s = moeI_rm_sigmoid(x);
        } else {
          bad |= x == INFINITY;
          s = moeI_rm_sqrtsoftplus(x);
        }
        const float k = bias ? s + bias[i] : s;
        bad |= isnan(k);
        key[v] = k;
      }
    }
  }
  bad = row.any(bad);
  if (!bad && scoring == MOE_SCORE_SOFTMAX) {
    m = row.max(m);
    bad = isinf(m); // +inf: inf - inf; -inf: every logit is -inf
  }

  // groups (sigmoid): each expert carries its group's score, the sum of the group's two
  // largest keys (its one key when a group has one expert)
  unsigned kept = live;
  if (!bad && groups > 1) {
    const int per = E / groups;
    float gs[VPT];
    int gid[VPT];
#pragma unroll
    for (int v = 0; v < VPT; v++) gid[v] = id[v] / per;
    if (per <= 32 && 32 % per == 0) {
      // a group is an aligned run of `per` lanes within one slot: a segmented butterfly
#pragma unroll
      for (int v = 0; v < VPT; v++) {
        float t1 = key[v], t2 = -INFINITY;
        for (int off = 1; off < per; off <<= 1)
          Row<NW>::merge2(t1, t2, __shfl_xor_sync(FULL, t1, off), __shfl_xor_sync(FULL, t2, off));
        gs[v] = per == 1 ? t1 : t1 + t2;
      }
    } else {
      // any other size: one row-wide reduction per group
#pragma unroll
      for (int v = 0; v < VPT; v++) gs[v] = 0.0f;
      for (int g = 0; g < groups; g++) {
        float t1 = -INFINITY, t2 = -INFINITY;
#pragma unroll
        for (int v = 0; v < VPT; v++)
          if (((live >> v) & 1u) && gid[v] == g) Row<NW>::merge2(t1, t2, key[v], -INFINITY);
        row.top2(t1, t2);
        const float score = t1 + t2; // per >= 2 here
#pragma unroll
        for (int v = 0; v < VPT; v++)
          if (gid[v] == g) gs[v] = score;
      }
    }
    bool nan = false;
#pragma unroll
    for (int v = 0; v < VPT; v++) nan |= ((live >> v) & 1u) && isnan(gs[v]);
    bad = row.any(nan);
    if (!bad && topk_groups < groups) {
      // the kept groups are those not after the topk_groups-th best
      float lk;
      int lg;
      top_rounds<NW, VPT>(row, gs, gid, live, topk_groups, tid, lk, lg, nullptr, nullptr);
      kept = 0;
#pragma unroll
      for (int v = 0; v < VPT; v++)
        if (((live >> v) & 1u) && !before(lk, lg, gs[v], gid[v])) kept |= 1u << v;
    }
  }

  int32_t *ids_r = ids + r * K;
  float *w_r = weights + r * K;
  if (bad) {
    if (tid < K) ids_r[tid] = -1, w_r[tid] = 0.0f;
    if (tid == 0 && stats) {
      atomicAdd(&stats[0], 1);
      atomicMin(&stats[1], (int)r);
    }
    return;
  }

  // the K experts; thread j < K of warp 0 holds slot j
  float sel_k = 0.0f, lk;
  int sel_i = -1, li;
  top_rounds<NW, VPT>(row, key, id, kept, K, tid, lk, li, &sel_k, &sel_i);

  float w = 0.0f;
  if (scoring == MOE_SCORE_SOFTMAX) {
    // sum = e_0 + e_1 + ... + e_{E-1}, left to right, as the CPU adds them
    float sum = 0.0f;
    if constexpr (NW == 1) {
#pragma unroll
      for (int v = 0; v < VPT; v++) {
        const float ex = ((live >> v) & 1u) ? moeI_rm_exp(key[v] - m) : 0.0f;
        const int base = v * TPR;
        if (base < E) {
#pragma unroll 8
          for (int ln = 0; ln < 32; ln++) {
            const float x = __shfl_sync(FULL, ex, ln);
            if (base + ln < E) sum += x;
          }
        }
      }
    } else {
#pragma unroll
      for (int v = 0; v < VPT; v++)
        if ((live >> v) & 1u) shx[id[v]] = moeI_rm_exp(key[v] - m);
      __syncthreads();
      if (threadIdx.x >= 32) return; // warp 0 finishes the row
      for (int base = 0; base < E; base += 32) {
        const float ex = base + tid < E ? shx[base + tid] : 0.0f;
#pragma unroll 8
        for (int ln = 0; ln < 32; ln++) {
          const float x = __shfl_sync(FULL, ex, ln);
          if (base + ln < E) sum += x;
        }
      }
    }
    // p_j = e_j / sum; w_j = p_j / (p_0 + ... + p_{K-1})
    const float p = tid < K ? moeI_rm_exp(sel_k - m) / sum : 0.0f;
    float psum = 0.0f;
    for (int j = 0; j < K; j++) psum += __shfl_sync(FULL, p, j);
    w = p / psum;
  } else {
    if (NW > 1 && threadIdx.x >= 32) return;
    // s of the selected experts, recomputed from their logits (the key may hold a bias)
    float s = 0.0f;
    if (tid < K) s = scoring == MOE_SCORE_SIGMOID ? moeI_rm_sigmoid(l[sel_i]) : moeI_rm_sqrtsoftplus(l[sel_i]);
    float sum = 0.0f;
    for (int j = 0; j < K; j++) sum += __shfl_sync(FULL, s, j);
    w = sum > 0.0f ? (s / sum) * scale : 0.0f;
  }
  if (tid < K) ids_r[tid] = sel_i, w_r[tid] = w;
}

__global__ void stats_begin(int32_t *stats) {
  stats[0] = 0;
  stats[1] = INT_MAX; // lowered by atomicMin to the first rejected row
}

__global__ void stats_end(int32_t *stats) {
  if (stats[1] == INT_MAX) stats[1] = -1;
}

template <int NW, int VPT>
void launch(cudaStream_t s, const moe_route_args *a, int N, int E) {
  const int threads = NW == 1 ? 32 * WARP_ROWS : 32 * NW;
  const int blocks = NW == 1 ? cdiv(N, WARP_ROWS) : N;
  route_kernel<NW, VPT><<<blocks, threads, 0, s>>>(
      (int32_t *)a->ids->data, (float *)a->weights->data, a->stats ? (int32_t *)a->stats->data : nullptr,
      (const float *)a->logits->data, a->bias ? (const float *)a->bias->data : nullptr, N, E, a->k, a->scoring,
      a->groups, a->topk_groups, a->scale);
}

} // namespace

int moeI_route_cuda(moe_ctx *ctx, const moe_route_args *a) {
  const int N = (int)a->logits->shape[0], E = (int)a->logits->shape[1];
  if (E > 4096)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "route: at most 4096 experts on cuda, got %d (the cpu takes any)", E);
  if (a->k > 32)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "route: k must be at most 32 on cuda, got %d (the cpu takes any)", a->k);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, a->logits->device.index, &s);
  if (rc) return rc;
  if (a->stats) {
    stats_begin<<<1, 1, 0, s>>>((int32_t *)a->stats->data);
    MOE_CUDA_LAUNCHED(ctx, "route");
  }
  if (N > 0) {
    if (E <= 32) launch<1, 1>(s, a, N, E);
    else if (E <= 64) launch<1, 2>(s, a, N, E);
    else if (E <= 128) launch<1, 4>(s, a, N, E);
    else if (E <= 256) launch<1, 8>(s, a, N, E);
    else if (E <= 384) launch<1, 12>(s, a, N, E);
    else if (E <= 512) launch<1, 16>(s, a, N, E);
    else if (E <= 1024) launch<8, 4>(s, a, N, E);
    else if (E <= 2048) launch<8, 8>(s, a, N, E);
    else launch<8, 16>(s, a, N, E);
    MOE_CUDA_LAUNCHED(ctx, "route");
  }
  if (a->stats) {
    stats_end<<<1, 1, 0, s>>>((int32_t *)a->stats->data);
    MOE_CUDA_LAUNCHED(ctx, "route");
  }
  return moeI_ok(ctx);
}
