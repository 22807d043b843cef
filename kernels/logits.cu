/* SPDX-License-Identifier: MIT */
// logits.cu -- router logits out f32 [N, E] = x bf16 [N, H] . w bf16 [E, H]^T, and the Qwen3.5
// shared-expert gate g f32 [T] = sigmoid(x . w), on the GPU.
//
// Two paths for the logits, chosen by the context's option "logits" (moeI_logits_tensor):
//
// tensor (the default): bf16 tensor-core products with f32 accumulators.  On Hopper built for
// sm_90a, wgmma (logits_wgmma_kernel: TMA into a ring of three stages, two consumer warpgroups of
// 64 tokens x 64, 96 or 128 experts, two CTAs an SM; seven stages where the CTAs are no more than
// the SMs); elsewhere mma.sync.m16n8k16, the GEMM of kernels/experts/mma.cu (128 x 128 x 64
// block tiles, 8 warps of 64 x 32, cp.async three stages deep, ldmatrix from XOR-swizzled shared
// memory) with f32 stores.  Each output is one thread's accumulator, fed the k16 steps of H in
// ascending order and nothing else: no split of H across blocks or warps, so its order of
// summation depends neither on N nor on the grid (nor on the ring's depth) nor on the other rows
// of the batch, and a row's logits are the same bits alone or batched.  They are not
// the CPU's bits: the tensor cores sum 16 products at a time in an order (and with a rounding)
// of their own.  Zero-filled rows past N or E and chunks past H add exact zeros.
//
// exact: gives moeI_logits_cpu's / moeI_sigmoid_gate_cpu's dot products bit for bit, because
// the route stage selects experts on them: a logit one ulp away from the CPU's could flip a near
// tie, and the layer's forward (GPU) and reference (CPU) would then route a token differently.
// mlp.h fixes one summation order: element i goes into partial sum i % 8, in ascending i, and the
// eight partial sums are added as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).  Here each
// partial sum is a chain of fused multiply-adds: the product of two bf16 values has at most 16
// significant bits, so it is exact in f32 and fma(w, x, s) = s + w * x rounded once, which is
// what the CPU's separate multiply and add compute.  (The one exception is a product below
// 2^-126 whose subnormal would lose bits: |w x| < 1.2e-38, far from router data.)
//
// The exact kernel is a SIMT tile kernel without tensor cores.
// A block computes a 32 x 64 tile of out with 8 warps, warp j owning partial sum j: it
// accumulates elements i = j (mod 8) for the whole tile, 8 x 8 outputs per thread.  The
// warps' partial tiles are then added pairwise through shared memory in the order above.
#include <atomic>
#include <stdint.h>

#include "common.cuh"
#include "mma.cuh"
#include "route_math.h"
#include "sm90/ptx.cuh"
#include "sm90/tensor_map.cuh"
#include "sm90/wgmma.cuh"

namespace {

constexpr int BM = 32, BN = 64, BK = 64; // tokens, experts, elements of H per stage
constexpr int APAD = BM + 4, BPAD = BN + 4;

// bf16 pair -> floats, exact
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Eight consecutive bf16 of row `row` (of `rows`), elements c .. c + 7 of H, as raw words; zero
// past the ends.  VEC: the row and the base are 16-byte aligned and H % 8 == 0.
template <bool VEC>
__device__ __forceinline__ uint4 load8(const uint16_t *__restrict__ p, int64_t row, int64_t rows, int64_t c,
                                       int64_t H) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (row >= rows || c >= H) return v;
  const uint16_t *q = p + row * H + c;
  if constexpr (VEC) {
    v = __ldg((const uint4 *)q);
  } else {
    uint32_t h[8];
#pragma unroll
    for (int e = 0; e < 8; e++) h[e] = c + e < H ? (uint32_t)__ldg(q + e) : 0u;
    v = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
  }
  return v;
}

struct alignas(16) LogitsSmem { // 16: the tiles are read as float4
  union {
    struct {
      float a[8][8][APAD]; // [partial sum j][step][token]: element BK*c + 8*step + j
      float b[8][8][BPAD]; // [j][step][expert]
    } tile;
    float red[4][64][32]; // partial tiles handed between warps: [slot][value][lane]
  };
};

template <bool VEC>
__global__ void __launch_bounds__(256, 2)
logits_kernel(float *__restrict__ out, const uint16_t *__restrict__ x, const uint16_t *__restrict__ w, int64_t N,
              int64_t E, int64_t H) {
  __shared__ LogitsSmem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t n0 = (int64_t)blockIdx.y * BM, e0 = (int64_t)blockIdx.x * BN;

  // loaders: x tile 32 rows x 8 pieces (one per thread), w tile 64 rows x 8 pieces (two)
  const int am = tid >> 3, aq = tid & 7;
  const int bn0 = tid >> 3, bq = tid & 7, bn1 = bn0 + 32;
  // compute: lane = 8 * ly + lx; rows {4ly .. 4ly+3, 16+4ly ..}, cols {4lx .. 4lx+3, 32+4lx ..}
  // (the split keeps a warp's 16-byte shared loads on distinct banks)
  const int ly = lane >> 3, lx = lane & 7;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

  uint4 ra = load8<VEC>(x, n0 + am, N, aq * 8, H);
  uint4 rb0 = load8<VEC>(w, e0 + bn0, E, bq * 8, H);
  uint4 rb1 = load8<VEC>(w, e0 + bn1, E, bq * 8, H);
  for (int64_t c0 = 0; c0 < H; c0 += BK) {
    __syncthreads(); // the previous stage is consumed
    {
      const uint32_t wa[4] = {ra.x, ra.y, ra.z, ra.w}, w0[4] = {rb0.x, rb0.y, rb0.z, rb0.w},
                     w1[4] = {rb1.x, rb1.y, rb1.z, rb1.w};
#pragma unroll
      for (int h = 0; h < 4; h++) {
        sm.tile.a[2 * h][aq][am] = lo_f(wa[h]);
        sm.tile.a[2 * h + 1][aq][am] = hi_f(wa[h]);
        sm.tile.b[2 * h][bq][bn0] = lo_f(w0[h]);
        sm.tile.b[2 * h + 1][bq][bn0] = hi_f(w0[h]);
        sm.tile.b[2 * h][bq][bn1] = lo_f(w1[h]);
        sm.tile.b[2 * h + 1][bq][bn1] = hi_f(w1[h]);
      }
    }
    __syncthreads();
    if (c0 + BK < H) { // the next stage's loads fly while this one is computed
      ra = load8<VEC>(x, n0 + am, N, c0 + BK + aq * 8, H);
      rb0 = load8<VEC>(w, e0 + bn0, E, c0 + BK + bq * 8, H);
      rb1 = load8<VEC>(w, e0 + bn1, E, c0 + BK + bq * 8, H);
    }
#pragma unroll
    for (int st = 0; st < 8; st++) {
      const float4 a0 = *(const float4 *)&sm.tile.a[warp][st][4 * ly];
      const float4 a1 = *(const float4 *)&sm.tile.a[warp][st][16 + 4 * ly];
      const float4 b0 = *(const float4 *)&sm.tile.b[warp][st][4 * lx];
      const float4 b1 = *(const float4 *)&sm.tile.b[warp][st][32 + 4 * lx];
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = __fmaf_rn(bv[j], av[i], acc[i][j]);
    }
  }

  // ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): odd warps hand over, then warps 2 and 6,
  // then warp 4; float addition commutes exactly, so acc + handed equals the CPU's s_a + s_b
  for (int level = 1; level < 8; level <<= 1) {
    __syncthreads();
    if ((warp & (2 * level - 1)) == level) {
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) sm.red[warp / (2 * level)][8 * i + j][lane] = acc[i][j];
    }
    __syncthreads();
    if ((warp & (2 * level - 1)) == 0) {
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = __fadd_rn(acc[i][j], sm.red[warp / (2 * level)][8 * i + j][lane]);
    }
  }
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int64_t n = n0 + (i < 4 ? 4 * ly + i : 16 + 4 * ly + i - 4);
    if (n >= N) continue;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int64_t e = e0 + (j < 4 ? 4 * lx + j : 32 + 4 * lx + j - 4);
      if (e < E) out[n * E + e] = acc[i][j];
    }
  }
}

// The gate: 32 tokens per block, thread (token, j) keeps partial sum j of its token; the
// eight partial sums of a token sit in eight consecutive lanes, and the xor butterfly over
// them adds exactly ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
constexpr int GT = 32, GK = 256; // tokens per block, elements per stage

struct alignas(16) GateSmem {
  uint32_t x[GT][GK / 2 + 4]; // bf16 pairs, written as uint4; the pad keeps column reads on distinct banks
  float w[GK];
};

template <bool VEC>
__global__ void __launch_bounds__(256)
gate_kernel(float *__restrict__ g, const uint16_t *__restrict__ x, const uint16_t *__restrict__ w, int64_t T,
            int64_t H) {
  __shared__ GateSmem sm;
  uint32_t(&xs)[GT][GK / 2 + 4] = sm.x;
  float(&ws)[GK] = sm.w;
  const int tid = threadIdx.x;
  const int tok = tid >> 3, j = tid & 7;
  const int64_t t0 = (int64_t)blockIdx.x * GT;
  float s = 0.0f;
  for (int64_t c0 = 0; c0 < H; c0 += GK) {
    // x: 32 rows x 32 pieces of 8 elements, four pieces per thread; w: 32 pieces
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int f = tid + 256 * u, row = f >> 5, q = f & 31;
      r[u] = load8<VEC>(x, t0 + row, T, c0 + 8 * q, H);
    }
    uint4 rw = make_uint4(0, 0, 0, 0);
    if (tid < GK / 8) rw = load8<VEC>(w, 0, 1, c0 + 8 * tid, H);
    __syncthreads(); // the previous stage is consumed
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int f = tid + 256 * u, row = f >> 5, q = f & 31;
      *(uint4 *)&xs[row][4 * q] = r[u];
    }
    if (tid < GK / 8) {
      const uint32_t h[4] = {rw.x, rw.y, rw.z, rw.w};
#pragma unroll
      for (int e = 0; e < 4; e++) ws[8 * tid + 2 * e] = lo_f(h[e]), ws[8 * tid + 2 * e + 1] = hi_f(h[e]);
    }
    __syncthreads();
#pragma unroll 8
    for (int st = 0; st < GK / 8; st++) {
      const int i = 8 * st + j;
      const uint32_t pair = xs[tok][i >> 1];
      s = __fmaf_rn(ws[i], (i & 1) ? hi_f(pair) : lo_f(pair), s);
    }
  }
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 4));
  if (j == 0 && t0 + tok < T) g[t0 + tok] = moeI_rm_sigmoid(s);
}

// ---- the tensor-core path ----

// out[n, e] = v0 and out[n, e + 1] = v1 of row `row` (out + n E), those below E; pairs: E is
// even and out 8-byte aligned, so the two store as one.
__device__ __forceinline__ void store_pair(float *row, int64_t e, int64_t E, float v0, float v1, bool pairs) {
  if (pairs && e + 1 < E) {
    *reinterpret_cast<float2 *>(row + e) = make_float2(v0, v1);
  } else {
    if (e < E) row[e] = v0;
    if (e + 1 < E) row[e + 1] = v1;
  }
}

namespace tc {
constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3; // tokens, experts, elements of H per stage
constexpr int THREADS = 256;                           // 8 warps: 2 along tokens x 4 along experts
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES; // 96 KiB: two blocks per SM
constexpr int LOADS = BM * BK / 8 / THREADS;     // 16-byte chunks per thread per operand
static_assert(BM == BN && LOADS * THREADS * 8 == BM * BK, "the loader covers both tiles");
static_assert(BK * 2 == MMA_ROW_BYTES, "a stage row is one swizzled row of mma.cuh");
} // namespace tc

// out [N, E] for the block's 128 tokens and 128 experts.  H % 8 == 0, x and w 16-byte aligned
// (moeI_logits_tensor); pairs: E is even and out 8-byte aligned, so two columns store as one.
__global__ void __launch_bounds__(tc::THREADS, 2)
logits_tc_kernel(float *__restrict__ out, const uint16_t *__restrict__ x, const uint16_t *__restrict__ w,
                 int64_t N, int64_t E, int64_t H, bool pairs) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  // blockIdx.x, the expert tile, varies fastest: the blocks of one token tile run together and
  // read its x from memory once (w, 5.5 MB for Kimi K2, stays in L2)
  const int64_t n0 = (int64_t)blockIdx.y * tc::BM, e0 = (int64_t)blockIdx.x * tc::BN;

  // Loader: thread tid moves chunk (tid & 7) of tile rows tid/8 + 32i, i < tc::LOADS, of x and w;
  // rows past N or E are zero-filled (src_bytes 0 reads nothing, from an address that is valid).
  const int lch = tid & 7, lrow = tid >> 3;
  const int64_t step = 32 * H;
  const uint16_t *a_base = x + (n0 + lrow) * H + 8 * lch;
  const uint16_t *b_base = w + (e0 + lrow) * H + 8 * lch;
  unsigned a_ok = 0, b_ok = 0;
#pragma unroll
  for (int i = 0; i < tc::LOADS; i++) {
    a_ok |= (unsigned)(n0 + lrow + 32 * i < N) << i;
    b_ok |= (unsigned)(e0 + lrow + 32 * i < E) << i;
  }
  const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
  const int st_off = swz(lrow, lch); // rows 32i further keep the same swizzle

  auto load_stage = [&](int slot, int64_t kt) {
    const int64_t k = kt * tc::BK;
    const bool kin = k + 8 * lch < H; // H % 8 == 0: a chunk is all in or all out
    const uint32_t sa = sbase + (uint32_t)(slot * tc::STAGE_BYTES + st_off), sb = sa + tc::A_BYTES;
#pragma unroll
    for (int i = 0; i < tc::LOADS; i++) {
      const bool aok = kin && ((a_ok >> i) & 1), bok = kin && ((b_ok >> i) & 1);
      cp_async16(sa + i * 32 * MMA_ROW_BYTES, aok ? a_base + i * step + k : x, aok ? 16 : 0);
      cp_async16(sb + i * 32 * MMA_ROW_BYTES, bok ? b_base + i * step + k : w, bok ? 16 : 0);
    }
  };

  // ldmatrix addressing.  A (m16 x k16 of mma tile mi): lane l gives row l & 15, chunk l >> 4.
  // B (two n8 x k16 tiles of pair p): lane l gives row 8 (l >> 4) + (l & 7), chunk (l >> 3) & 1.
  // Tile rows are multiples of 8 apart, so the swizzle term is lane & 7 throughout.
  const int a_row = wm * 64 + (lane & 15);
  const int b_row = wn * 32 + ((lane >> 4) << 3) + (lane & 7);

  float acc[4][4][4];
  zero_acc(acc);

  const int64_t KT = (H + tc::BK - 1) / tc::BK;
#pragma unroll
  for (int s = 0; s < tc::STAGES - 1; s++) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < KT; kt++) {
    cp_async_wait<tc::STAGES - 2>(); // this thread's copies of stage kt have landed
    __syncthreads();             // everyone's have, and everyone is done with stage kt - 1
    const int64_t nk = kt + tc::STAGES - 1;
    if (nk < KT) load_stage((int)(nk % tc::STAGES), nk);
    cp_async_commit();

    const uint32_t sa = sbase + (uint32_t)((kt % tc::STAGES) * tc::STAGE_BYTES), sb = sa + tc::A_BYTES;
#pragma unroll
    for (int ks = 0; ks < tc::BK / 16; ks++) {
      uint32_t af[4][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) ldsm_x4(af[mi], sa + swz(a_row + mi * 16, 2 * ks + (lane >> 4)));
#pragma unroll
      for (int p = 0; p < 2; p++) ldsm_x4(bfr[p], sb + swz(b_row + p * 16, 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++)
          mma_bf16(acc[mi][j], af[mi], bfr[j >> 1][(j & 1) * 2], bfr[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>(); // no copy outlives the block (the last groups are empty)

  // Accumulator (mi, j), element q: token wm*64 + 16mi + (lane >> 2) + 8(q >> 1), expert
  // wn*32 + 8j + 2(lane & 3) + (q & 1).
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int64_t n = n0 + wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (n >= N) continue;
      float *row = out + n * E;
#pragma unroll
      for (int j = 0; j < 4; j++)
        store_pair(row, e0 + wn * 32 + j * 8 + (lane & 3) * 2, E, acc[mi][j][2 * half], acc[mi][j][2 * half + 1],
                   pairs);
    }
}

// ---- the tensor-core path on Hopper (sm_90a): wgmma ----

namespace hw {
constexpr int BM = 128, BK = 64; // tokens a CTA (a warpgroup's m64 each), elements of H a stage
// Stages in the ring: 3, two CTAs an SM; where the grid has no more CTAs than the GPU has SMs
// (decode: 32 at 8 x 128 tokens), 7, so that a CTA, alone on its SM, keeps more of x and w in
// flight (it streams all of H, and its rate is the bytes in flight over the latency).
constexpr int STAGES = 3, DEEP_STAGES = 7;
constexpr int THREADS = 288; // two consumer warpgroups, then the producer warp
constexpr int A_BYTES = BM * BK * 2;
template <int BN> constexpr int stage_bytes() { return A_BYTES + BN * BK * 2; }
// the ring from a 1024-byte boundary (the 128-byte swizzle's), then full[NST], empty[NST]
template <int BN, int NST> constexpr int smem_bytes() { return 1024 + NST * stage_bytes<BN>() + 2 * NST * 8; }
static_assert(2 * (smem_bytes<128, STAGES>() + 1024) <= 228 * 1024, "two CTAs an SM");
static_assert(smem_bytes<128, DEEP_STAGES>() <= 232448, "the deep ring fits the 227 KiB a block may opt in to");
} // namespace hw

// out [N, E] for the CTA's 128 tokens and BN experts: the producer warp's TMA copies of x's
// {64, 128} and w's {64, BN} boxes of each k block (128-byte swizzle; rows past N or E and
// columns past H read as zeros) into a ring of NST stages; each consumer warpgroup
// D[64 x BN] (+)= A[64 x 16] . B[BN x 16]^T, the four k16 steps of a stage in one group, one group
// in flight while the next stage is waited for.  An output is one register of one thread, fed
// the k16 steps of H in ascending order, as in logits_tc_kernel: the bits of a row do not depend
// on N, the grid or the ring's depth.  x and w 16-byte aligned with H % 8 == 0 (the tensor maps'
// strides).
template <int BN, int NST>
__global__ void __launch_bounds__(hw::THREADS, NST == hw::STAGES ? 2 : 1)
logits_wgmma_kernel(const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_w,
                    float *__restrict__ out, int N, int E, int KT, int tiles_e, bool pairs) {
#if defined(MOE_SM90A)
  constexpr int STAGE = hw::stage_bytes<BN>();
  extern __shared__ unsigned char smem_raw[];
  const uint32_t ring = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = ring + NST * STAGE;
  auto full_bar = [&](int s) { return bars + 8u * (uint32_t)s; };
  auto empty_bar = [&](int s) { return bars + 8u * (uint32_t)(NST + s); };
  // the expert tile varies fastest: the CTAs of a token tile run together and read its x from
  // memory once (w, 5.5 MB for Kimi K2, stays in L2)
  const int n0 = (int)(blockIdx.x / (unsigned)tiles_e) * hw::BM, e0 = (int)(blockIdx.x % (unsigned)tiles_e) * BN;
  // warp-uniform by construction, which ptxas needs to see to keep the wgmma asynchronous
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);

  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; s++) {
      mbar_init(full_bar(s), 1);  // the producer's arrive.expect_tx (+ the bytes)
      mbar_init(empty_bar(s), 8); // one arrival per consumer warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (wg == 2) { // the producer warp
    if (threadIdx.x == 2 * 128) {
      prefetch_tmap(&tma_x);
      prefetch_tmap(&tma_w);
      int s = 0;
      uint32_t ph = 0;
      for (int kt = 0; kt < KT; kt++) {
        mbar_wait(empty_bar(s), ph ^ 1u); // the consumers are done with slot s
        const uint32_t sa = ring + (uint32_t)(s * STAGE);
        mbar_expect_tx(full_bar(s), (uint32_t)STAGE);
        tma_load(sa, &tma_x, kt * hw::BK, n0, full_bar(s));
        tma_load(sa + hw::A_BYTES, &tma_w, kt * hw::BK, e0, full_bar(s));
        if (++s == NST) s = 0, ph ^= 1u;
      }
    }
    return;
  }

  const int t = (int)threadIdx.x & 127, lane = t & 31;
  const uint64_t da0 = smem_desc(ring + (uint32_t)(wg * 64 * hw::BK * 2)); // this warpgroup's 64 tokens
  const uint64_t db0 = smem_desc(ring + hw::A_BYTES);
  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; i++) d[i] = 0.f; // H = 0: the sums are zeros
  int s = 0, prev = 0;
  uint32_t ph = 0;
  for (int kt = 0; kt < KT; kt++) {
    mbar_wait(full_bar(s), ph);
    const uint64_t off = (uint64_t)(s * (STAGE >> 4));
    wgmma_slot_wait_prev<BN, hw::BK / 16>(d, da0, db0, off, kt == 0); // the previous stage's slot is free
    if (kt > 0 && lane == 0) mbar_arrive_local(empty_bar(prev));
    prev = s;
    if (++s == NST) s = 0, ph ^= 1u;
  }
  wgmma_wait<0>();
  fence_acc(d);

  // d[4 j + q]: token 64 wg + 16 warp + lane / 4 + 8 (q / 2), expert 8 j + 2 (lane % 4) + q % 2
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const int64_t n = (int64_t)n0 + 64 * wg + 16 * (t >> 5) + (lane >> 2) + 8 * half;
    if (n >= N) continue;
    float *row = out + n * E;
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
      store_pair(row, (int64_t)e0 + 8 * j + 2 * (lane & 3), E, d[4 * j + 2 * half], d[4 * j + 2 * half + 1], pairs);
  }
#else
  MOE_SM90A_STUB();
#endif
}

bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }


// The compute capability of the device (minor: may be null).
int device_cc(moe_ctx *ctx, int device, int *major, int *minor) {
  MOE_CUDA_TRY(ctx, "logits", cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device));
  if (minor) MOE_CUDA_TRY(ctx, "logits", cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device));
  return MOE_OK;
}

// Does the tensor path run as logits_wgmma_kernel: a 9.0 device, the library built for sm_90a,
// and coordinates that fit the tensor maps' 32-bit ones (else logits_tc_kernel).
bool wgmma_takes(int major, int minor, int64_t N, int64_t E, int64_t H) {
  static const bool built = sm90a_built((const void *)logits_wgmma_kernel<96, hw::STAGES>);
  const int64_t lim = INT32_MAX - 256;
  return major == 9 && minor == 0 && built && N < lim && E < lim &&
         H < lim && (N + hw::BM - 1) / hw::BM * ((E + 63) / 64) < lim;
}

template <int BN, int NST>
int launch_ring(moe_ctx *ctx, int dev, cudaStream_t s, float *out, const CUtensorMap &tma_x, const CUtensorMap &tma_w,
                int64_t blocks, int64_t N, int64_t E, int64_t H, int64_t tiles_e, bool pairs) {
  constexpr int smem = hw::smem_bytes<BN, NST>();
  static std::atomic<int> raised[64]; // the shared-memory limit raised on device dev (once each)
  cudaError_t raise_smem_limit = cudaSuccess;
  once_per_device(raised, dev, [&] {
    raise_smem_limit =
        cudaFuncSetAttribute(logits_wgmma_kernel<BN, NST>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return raise_smem_limit == cudaSuccess ? 0 : -1;
  });
  MOE_CUDA_TRY(ctx, "logits", raise_smem_limit);
  logits_wgmma_kernel<BN, NST><<<(unsigned)blocks, hw::THREADS, smem, s>>>(tma_x, tma_w, out, (int)N, (int)E,
                                                                              (int)((H + hw::BK - 1) / hw::BK),
                                                                              (int)tiles_e, pairs);
  MOE_CUDA_LAUNCHED(ctx, "logits");
  return moeI_ok(ctx);
}

template <int BN>
int launch_wgmma(moe_ctx *ctx, int dev, cudaStream_t s, float *out, const void *x, const void *w, int64_t N,
                 int64_t E, int64_t H, bool pairs) {
  CUtensorMap tma_x, tma_w;
  if (!encode_2d(&tma_x, x, N, H, hw::BM, hw::BK, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode_2d(&tma_w, w, E, H, BN, hw::BK, CU_TENSOR_MAP_SWIZZLE_128B))
    return moeI_seterr(ctx, MOE_ERR_CUDA, "logits: the driver refused the tensor maps of x [%lld, %lld] and w [%lld, %lld]",
                       (long long)N, (long long)H, (long long)E, (long long)H);
  const int64_t tiles_e = (E + BN - 1) / BN, blocks = (N + hw::BM - 1) / hw::BM * tiles_e;
  int sms = 0;
  if (int rc = moeI_cuda_sm_count(ctx, dev, &sms)) return rc;
  if (blocks <= sms)
    return launch_ring<BN, hw::DEEP_STAGES>(ctx, dev, s, out, tma_x, tma_w, blocks, N, E, H, tiles_e, pairs);
  return launch_ring<BN, hw::STAGES>(ctx, dev, s, out, tma_x, tma_w, blocks, N, E, H, tiles_e, pairs);
}

} // namespace

int moeI_logits_explain_cuda(moe_ctx *ctx, const moe_tensor *x, const moe_tensor *w, char *report, size_t n) {
  int major = 0, rc = device_cc(ctx, x->device.index, &major, NULL);
  if (rc) return rc;
  moeI_logits_tensor(ctx, x, w, major, report, n);
  return moeI_ok(ctx);
}

int moeI_logits_cuda(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  const int64_t N = x->shape[0], H = x->shape[1], E = w->shape[0];
  if (!N || !E) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  int major = 0, minor = 0;
  if (rc || (rc = device_cc(ctx, x->device.index, &major, &minor))) return rc;
  const bool tensor = moeI_logits_tensor(ctx, x, w, major, NULL, 0);
  const bool pairs = E % 2 == 0 && (uintptr_t)out->data % 8 == 0;
  const int dev = x->device.index;
  if (tensor && wgmma_takes(major, minor, N, E, H))
    switch (moeI_logits_wgmma_tile(E)) {
    case 64: return launch_wgmma<64>(ctx, dev, s, (float *)out->data, x->data, w->data, N, E, H, pairs);
    case 96: return launch_wgmma<96>(ctx, dev, s, (float *)out->data, x->data, w->data, N, E, H, pairs);
    default: return launch_wgmma<128>(ctx, dev, s, (float *)out->data, x->data, w->data, N, E, H, pairs);
    }
  const int64_t bm = tensor ? tc::BM : BM, bn = tensor ? tc::BN : BN;
  const int64_t gx = (E + bn - 1) / bn;
  if (gx > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "logits: [%lld, %lld] is too large for cuda", (long long)N, (long long)E);
  if (tensor)
    MOE_CUDA_TRY(ctx, "logits",
                 cudaFuncSetAttribute(logits_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tc::SMEM_BYTES));
  // y is limited to 65535 blocks: long inputs go in slices of rows
  for (int64_t r0 = 0; r0 < N; r0 += 65535 * bm) {
    const int64_t n = N - r0 < 65535 * bm ? N - r0 : 65535 * bm;
    const dim3 grid((unsigned)gx, (unsigned)((n + bm - 1) / bm));
    const uint16_t *xp = (const uint16_t *)x->data + r0 * H;
    float *op = (float *)out->data + r0 * E;
    if (tensor)
      logits_tc_kernel<<<grid, tc::THREADS, tc::SMEM_BYTES, s>>>(op, xp, (const uint16_t *)w->data, n, E, H, pairs);
    else if (H % 8 == 0 && aligned16(xp) && aligned16(w->data))
      logits_kernel<true><<<grid, 256, 0, s>>>(op, xp, (const uint16_t *)w->data, n, E, H);
    else
      logits_kernel<false><<<grid, 256, 0, s>>>(op, xp, (const uint16_t *)w->data, n, E, H);
    MOE_CUDA_LAUNCHED(ctx, "logits");
  }
  return moeI_ok(ctx);
}

int moeI_sigmoid_gate_cuda(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  const int64_t T = x->shape[0], H = x->shape[1];
  if (!T) return moeI_ok(ctx);
  const int64_t blocks = (T + GT - 1) / GT;
  if (blocks > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "sigmoid_gate: %lld tokens are too many for cuda", (long long)T);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, x->device.index, &s);
  if (rc) return rc;
  if (H % 8 == 0 && aligned16(x->data) && aligned16(w->data))
    gate_kernel<true><<<(unsigned)blocks, 256, 0, s>>>((float *)g->data, (const uint16_t *)x->data,
                                                       (const uint16_t *)w->data, T, H);
  else
    gate_kernel<false><<<(unsigned)blocks, 256, 0, s>>>((float *)g->data, (const uint16_t *)x->data,
                                                        (const uint16_t *)w->data, T, H);
  MOE_CUDA_LAUNCHED(ctx, "sigmoid_gate");
  return moeI_ok(ctx);
}
