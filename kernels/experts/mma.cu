/* SPDX-License-Identifier: MIT */
// mma.cu -- the portable kernel of stage 4 (the "mma" candidate of select.cu): the SwiGLU MLP of
// every local expert over its rows, on any GPU and any sizes.
//
// Three launches on the context's stream, all sized from the capacity C alone so that a CUDA
// graph captured once stays right whatever offsets the schedule writes later:
//
//   tile_map   one block turns expert_offsets (read on the device) into a list of row tiles,
//              each inside one expert: {expert, first row, end of the expert's rows}.  An
//              expert of n rows gets ceil(n / 128) tiles, so a tile never mixes experts and
//              never computes rows of a neighbour; the list has at most ceil(C/128) + min(EL, C)
//              entries, and the GEMM grids cover that bound (blocks past the real count exit).
//   gate_up    h [C, F] = bf16(silu(xs . W_gate^T) * (xs . W_up^T)): a block's B tile holds
//              64 gate rows f0.. and the 64 up rows F+f0.., so both accumulators of an output
//              element live in the same thread and SwiGLU is applied in the epilogue.
//   down       ys [C, H] = h . W_down^T.
//
// The GEMM is the Ampere-style "simple but right" one: 128x128x64 block tiles, 8 warps of
// 64x32, bf16 mma.sync.m16n8k16 with f32 accumulators, operands staged by cp.async three stages
// deep in XOR-swizzled shared memory read with ldmatrix, the output tile staged in shared
// memory and written with 16-byte stores.  Where the Hopper kernels (sm90.cuh) can run, they run
// instead; this one runs everywhere else and is their cross-check.
//
// Rows: an expert's rows are those of experts.cuh.  Rows outside every segment are neither read
// nor written, so ys may be xs itself (the down pass reads only h).
//
// Sizes: any H and F.  When H and F are multiples of 8 and every tensor is 16-byte aligned
// (always true of whole tensors), operands move as 16-byte cp.async; otherwise (odd sizes, a
// view at an odd offset) the same kernels load element by element: slower, same bits.
// The intermediate h lives in scratch taken with cudaMallocAsync on the stream and given back
// with cudaFreeAsync after the last launch (both are captured as graph memory nodes).
#include <limits.h>
#include <stdint.h>

#include "../mma.cuh"
#include "experts.cuh"

namespace {

constexpr int BM = 128;               // rows per tile
constexpr int BN = 128;               // B rows per tile: down: 128 outputs; gate_up: 64 gate + 64 up
constexpr int BK = 64;                // k per stage: 128 bytes per smem row, 8 chunks of 16 bytes
constexpr int STAGES = 3;
constexpr int THREADS = 256;          // 8 warps: 2 along rows x 4 along B rows, 64x32 each
constexpr int GROUP_M = 8;            // row tiles per raster group (L2 reuse of W and xs)
constexpr int MAP_THREADS = 1024;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES; // 96 KiB: two blocks per SM
constexpr int LOADS = BM * BK / 8 / THREADS;     // 16-byte chunks per thread per operand

static_assert(BM == BN && LOADS * THREADS * 8 == BM * BK, "loader covers the tiles");
static_assert(BK * 2 == MMA_ROW_BYTES, "a stage row is one swizzled row of mma.cuh");

template <int MODE> struct Shape {
  static constexpr int OUT_N = MODE == GATE_UP ? BN / 2 : BN; // output columns per tile
  static constexpr int OUT_LD = OUT_N + 8;                    // staging row, padded off the banks
};
static_assert(BM * Shape<DOWN>::OUT_LD * 2 <= SMEM_BYTES, "output staging fits");

// ---- the tile map ----

// map[t] = {expert, first row, end of the expert's rows, 0} for t < tiles, {-1, 0, 0, 0} after.
// start/lo/hi are scratch of EL + 1, EL, EL ints.
__global__ void __launch_bounds__(MAP_THREADS) tile_map_kernel(int4 *map, int *start, int *lo, int *hi,
                                                                const int *offsets, int EL, int C, int tmax) {
  __shared__ int s[32];
  int carry_m = 0, carry_t = 0;
  for (int base = 0; base < EL; base += MAP_THREADS) {
    const int e = base + (int)threadIdx.x;
    const int own = e < EL ? clamp_row(offsets[e], C) : 0;
    const int next = e < EL ? clamp_row(offsets[e + 1], C) : 0;
    int tot;
    const int m = max(carry_m, block_scan<true>(own, s, &tot)); // m_e: running maximum through e
    carry_m = max(carry_m, tot);
    const int end = max(m, next);                                // m_{e+1}
    const int tiles = e < EL ? (end - m + BM - 1) / BM : 0;
    const int first = carry_t + block_scan<false>(tiles, s, &tot) - tiles;
    carry_t += tot;
    if (e < EL) start[e] = first, lo[e] = m, hi[e] = end;
  }
  if (threadIdx.x == 0) start[EL] = carry_t;
  __syncthreads(); // start/lo/hi written by other threads of this block are visible after this
  const int total = carry_t;
  for (int t = (int)threadIdx.x; t < tmax; t += MAP_THREADS) {
    int4 v = make_int4(-1, 0, 0, 0);
    if (t < total) {
      // the last expert whose first tile is <= t; it is not empty since start[e + 1] > t
      int a = 0, b = EL - 1;
      while (a < b) {
        int mid = (a + b + 1) >> 1;
        if (start[mid] <= t) a = mid;
        else b = mid - 1;
      }
      v = make_int4(a, lo[a] + (t - start[a]) * BM, hi[a], 0);
    }
    map[t] = v;
  }
}

// ---- the grouped GEMM ----
//
// out[row, n] for rows of one map tile and n in one column tile, K-contiguous operands:
//   A   [C, K]     rows of the tile (xs for gate_up, h for down)
//   W   [EL, *, K] the tile's expert: gate_up reads rows n and F + n, down reads row n
//   out [C, N]     N = F (h) for gate_up, H (ys) for down
template <int MODE, bool VEC>
__global__ void __launch_bounds__(THREADS, VEC ? 2 : 1)
    experts_gemm_kernel(uint16_t *out, const uint16_t *A, const uint16_t *W, const int4 *map, int tmax, int ntn,
                        int K, int N, long long w_expert) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int OUT_N = Shape<MODE>::OUT_N, OUT_LD = Shape<MODE>::OUT_LD;

  // Raster: groups of GROUP_M row tiles; inside a group the row tile varies fastest, so the
  // blocks resident together read the same W column tile of their expert and the same few A
  // row tiles, from L2 rather than from memory.
  const int bid = (int)blockIdx.x;
  const int group = bid / (GROUP_M * ntn), first = group * GROUP_M;
  const int gm = min(tmax - first, GROUP_M), local = bid - group * GROUP_M * ntn;
  const int tm = first + local % gm, tn = local / gm;

  const int4 tile = map[tm];
  if (tile.x < 0) return; // past the last tile: the whole block leaves together
  const int row0 = tile.y, rows = min(tile.z - row0, BM);
  const uint16_t *Wexp = W + (long long)tile.x * w_expert;
  const int n0 = tn * OUT_N;

  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / 4, wn = warp % 4;

  // Loader: thread tid moves chunk (tid & 7) of tile rows tid/8 + 32i, i < LOADS, of A and B.
  // Row i's source is base + i * step (+ the up half's offset for gate_up's B rows 64..127);
  // recomputed per stage rather than kept as LOADS pointers, which the registers cannot spare.
  const int lch = tid & 7, lrow = tid >> 3;
  const long long step = 32ll * K;
  const uint16_t *a_base = A + (long long)(row0 + lrow) * K;
  const uint16_t *b_base = Wexp + (long long)(n0 + lrow) * K;
  unsigned a_ok = 0, b_ok = 0;
#pragma unroll
  for (int i = 0; i < LOADS; i++) {
    const int r = lrow + 32 * i;
    a_ok |= (unsigned)(r < rows) << i;
    b_ok |= (unsigned)(n0 + (MODE == GATE_UP ? r & (BN / 2 - 1) : r) < N) << i;
  }
  // B row i: gate_up: i = 0, 1 gate rows n0 + lrow + 32i, i = 2, 3 the same rows of the up half
  auto b_row_off = [&](int i) -> long long {
    return MODE == GATE_UP ? (i & 1) * step + (i >> 1) * (long long)N * K : i * step;
  };
  const uint32_t sbase = smem_u32(smem);
  const int st_off = swz(lrow, lch); // (32i rows further keep the same swizzle)

  auto load_stage = [&](int slot, int kt) {
    const int k = kt * BK + lch * 8;
    const uint32_t sa = sbase + slot * STAGE_BYTES + st_off, sb = sa + A_BYTES;
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
      const bool aok = (a_ok >> i) & 1, bok = (b_ok >> i) & 1;
      const uint16_t *pa = a_base + i * step + k, *pb = b_base + b_row_off(i) + k;
      if (VEC) { // K % 8 == 0: a chunk is all in or all out
        const bool kin = k < K;
        cp_async16(sa + i * 32 * (BK * 2), aok && kin ? pa : A, aok && kin ? 16 : 0);
        cp_async16(sb + i * 32 * (BK * 2), bok && kin ? pb : W, bok && kin ? 16 : 0);
      } else {
        uint32_t va[4], vb[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int k0 = k + 2 * j;
          uint32_t lo = aok && k0 < K ? pa[2 * j] : 0u, hi = aok && k0 + 1 < K ? pa[2 * j + 1] : 0u;
          va[j] = lo | hi << 16;
          lo = bok && k0 < K ? pb[2 * j] : 0u, hi = bok && k0 + 1 < K ? pb[2 * j + 1] : 0u;
          vb[j] = lo | hi << 16;
        }
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sa + i * 32 * (BK * 2)), "r"(va[0]),
                     "r"(va[1]), "r"(va[2]), "r"(va[3]) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sb + i * 32 * (BK * 2)), "r"(vb[0]),
                     "r"(vb[1]), "r"(vb[2]), "r"(vb[3]) : "memory");
      }
    }
  };

  // ldmatrix addressing.  A (m16 x k16 of mma tile mi): lane l gives row l & 15, chunk l >> 4.
  // B (two n8 x k16 tiles of pair p): lane l gives row 8 (l >> 4) + (l & 7), chunk (l >> 3) & 1.
  // Tile rows are multiples of 8 apart, so the swizzle term is lane & 7 throughout.
  // B rows of pair p: gate_up: p = 0 the gate rows wn*16.., p = 1 the up rows 64 + wn*16..;
  // down: rows wn*32 + 16p...
  constexpr int B_PAIR = MODE == GATE_UP ? BN / 2 : 16;
  const int a_row = wm * 64 + (lane & 15);
  const int b_row = (MODE == GATE_UP ? wn * 16 : wn * 32) + ((lane >> 4) << 3) + (lane & 7);

  float acc[4][4][4];
  zero_acc(acc);

  const int KT = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < KT; kt++) {
    cp_async_wait<STAGES - 2>(); // this thread's copies of stage kt have landed
    __syncthreads();             // everyone's have, and everyone is done with stage kt - 1
    const int nk = kt + STAGES - 1;
    if (nk < KT) load_stage(nk % STAGES, nk);
    cp_async_commit();

    const uint32_t sa = sbase + (kt % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) {
      uint32_t af[4][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) ldsm_x4(af[mi], sa + swz(a_row + mi * 16, 2 * ks + (lane >> 4)));
#pragma unroll
      for (int p = 0; p < 2; p++) ldsm_x4(bfr[p], sb + swz(b_row + p * B_PAIR, 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++)
          mma_bf16(acc[mi][j], af[mi], bfr[j >> 1][(j & 1) * 2], bfr[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads(); // the pipeline's shared memory becomes the output staging tile

  // Accumulator (mi, j), element q: row wm*64 + 16mi + (lane >> 2) + 8(q >> 1), B row of pair
  // j >> 1, column 8(j & 1) + 2(lane & 3) + (q & 1) inside it.
  __nv_bfloat16 *so = reinterpret_cast<__nv_bfloat16 *>(smem);
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int r = wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (MODE == GATE_UP) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int c = wn * 16 + j * 8 + (lane & 3) * 2;
          float h[2];
#pragma unroll
          for (int q = 0; q < 2; q++) {
            const float g = acc[mi][j][half * 2 + q], u = acc[mi][j + 2][half * 2 + q];
            h[q] = g / (1.0f + expf(-g)) * u; // silu(g) * u, as mlp_silu
          }
          *reinterpret_cast<__nv_bfloat162 *>(so + r * OUT_LD + c) = __floats2bfloat162_rn(h[0], h[1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int c = wn * 32 + j * 8 + (lane & 3) * 2;
          *reinterpret_cast<__nv_bfloat162 *>(so + r * OUT_LD + c) =
              __floats2bfloat162_rn(acc[mi][j][half * 2], acc[mi][j][half * 2 + 1]);
        }
      }
    }
  __syncthreads();

  constexpr int CPR = OUT_N / 8; // 16-byte chunks per output row
  const uint16_t *so16 = reinterpret_cast<const uint16_t *>(smem);
#pragma unroll
  for (int c = tid; c < BM * CPR; c += THREADS) {
    const int r = c / CPR, col = n0 + (c % CPR) * 8;
    if (r >= rows) continue;
    uint16_t *dst = out + (long long)(row0 + r) * N + col;
    const uint16_t *src = so16 + r * OUT_LD + (c % CPR) * 8;
    if (VEC) { // N % 8 == 0
      if (col < N) *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++)
        if (col + j < N) dst[j] = src[j];
    }
  }
}

template <int MODE, bool VEC>
cudaError_t launch_gemm(cudaStream_t stream, uint16_t *out, const uint16_t *A, const uint16_t *W, const int4 *map,
                        int tmax, int ntn, int K, int N, long long w_expert) {
  auto kernel = experts_gemm_kernel<MODE, VEC>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  kernel<<<(unsigned)((long long)tmax * ntn), THREADS, SMEM_BYTES, stream>>>(out, A, W, map, tmax, ntn, K, N, w_expert);
  return cudaGetLastError();
}

// The tiles of a call: tmax row tiles at most (each expert's last one partial), and the column
// tiles of each pass; a launch has at most 2^31 blocks.
struct MmaTiles {
  long long tmax, ntn_gu, ntn_dn;
  explicit MmaTiles(const moe_experts_args *a) {
    const long long C = a->x->shape[0], H = a->x->shape[1];
    const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
    tmax = (C + BM - 1) / BM + (EL < C ? EL : C);
    ntn_gu = (F + BN / 2 - 1) / (BN / 2), ntn_dn = (H + BN - 1) / BN;
  }
  bool fits() const { return tmax * (ntn_gu > ntn_dn ? ntn_gu : ntn_dn) <= INT_MAX; }
};

} // namespace

int moeI_experts_mma_fits(moe_ctx *, const moe_experts_args *a, Fit *fit, char *why, size_t n) {
  *fit = MmaTiles(a).fits() ? TAKES : CANNOT;
  if (*fit == CANNOT)
    snprintf(why, n, "C = %lld, H = %lld, F = %lld need more than 2^31 blocks", (long long)a->x->shape[0],
             (long long)a->x->shape[1], (long long)a->w_gate_up->shape[1] / 2);
  return MOE_OK;
}

int moeI_experts_mma_run(moe_ctx *ctx, const moe_experts_args *a) {
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  cudaStream_t stream;
  int rc = moeI_cuda_ctx_stream(ctx, a->x->device.index, &stream);
  if (rc) return rc;

  const MmaTiles tiles(a); // mma's fits has checked that they fit a launch
  const long long tmax = tiles.tmax, ntn_gu = tiles.ntn_gu, ntn_dn = tiles.ntn_dn;

  // scratch: map [tmax] int4, start [EL + 1], lo [EL], hi [EL] ints, then h [C, F] bf16
  const size_t map_bytes = ((size_t)tmax * sizeof(int4) + (size_t)(3 * EL + 1) * sizeof(int) + 255) & ~(size_t)255;
  const size_t h_bytes = (size_t)C * (size_t)F * 2;
  void *scratch = NULL;
  if ((rc = experts_scratch(ctx, stream, a->x->device.index, map_bytes + h_bytes, &scratch))) return rc;
  int4 *map = (int4 *)scratch;
  int *start = (int *)(map + tmax), *lo = start + EL + 1, *hi = lo + EL;
  uint16_t *h = (uint16_t *)((char *)scratch + map_bytes);

  const uint16_t *xs = (const uint16_t *)a->x->data, *wgu = (const uint16_t *)a->w_gate_up->data;
  const uint16_t *wdn = (const uint16_t *)a->w_down->data;
  uint16_t *ys = (uint16_t *)a->out->data;
  const bool vec = H % 8 == 0 && F % 8 == 0 && aligned16(xs) && aligned16(ys) && aligned16(wgu) && aligned16(wdn);

  const char *what = "tile_map_kernel launch";
  tile_map_kernel<<<1, MAP_THREADS, 0, stream>>>(map, start, lo, hi, (const int *)a->offsets->data, (int)EL,
                                                 (int)C, (int)tmax);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && F > 0) {
    what = "gate_up launch";
    err = vec ? launch_gemm<GATE_UP, true>(stream, h, xs, wgu, map, (int)tmax, (int)ntn_gu, (int)H, (int)F, 2 * F * H)
              : launch_gemm<GATE_UP, false>(stream, h, xs, wgu, map, (int)tmax, (int)ntn_gu, (int)H, (int)F, 2 * F * H);
  }
  // F = 0 leaves h empty: the down pass sums nothing and writes zeros, as moeI_experts_cpu does.
  if (err == cudaSuccess) {
    what = "down launch";
    err = vec ? launch_gemm<DOWN, true>(stream, ys, h, wdn, map, (int)tmax, (int)ntn_dn, (int)F, (int)H, H * F)
              : launch_gemm<DOWN, false>(stream, ys, h, wdn, map, (int)tmax, (int)ntn_dn, (int)F, (int)H, H * F);
  }
  return experts_finish(ctx, stream, scratch, err, what);
}
