/* SPDX-License-Identifier: MIT */
// fp8.cu -- the host side of the FP8 experts (fp8.cuh): which tiling runs (the candidates, as
// select.cu's for bf16; the context's experts_fp8_kernel option forces one), what each needs of
// the GPU and the tensors, the tensor maps, and the launches of a pass: map (sm90.cuh's: the row
// tiles' pairs and solos, or units of 2 NVM rows, which the narrow tiles count in pairs of column
// tiles), gate_up, down, each a programmatic dependent of the kernel before it (which it waits for
// before reading anything), so that its launch and prologue overlap that kernel's last CTAs.  The
// weights-as-M and tokens-as-M tiles' gate_up writes h quantized (e4m3 and its transposed scales)
// from its epilogue; the row tiles' writes h in bf16 and a launch of its own quantizes it.  NVM,
// the kernel's template argument: 0 the row tiles, else the width of decode_w's units; TM the
// tokens-as-M tiles on NV8_MAX's units and stages (fp8.cuh).
#include <atomic>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>

#include "../select.cuh"
#include "../sm90/tensor_map.cuh"
#include "fp8.cuh"

namespace {

// sm90w_fp8_n32 takes the problems whose experts average at most NARROW_ROWS rows: there the
// weights stream through about once and its deeper ring, each CTA on weights of its own where an
// expert has at most 32 rows, pays; past it, it would read an expert's weights once for every 64
// rows.  Against sm90t_fp8 (docs/perf/experts.md) it is faster at 24, 32 and 64 rows an expert
// and slower at 96 and 128.
constexpr int NARROW_ROWS = 2 * NV8_NARROW;

// e4m3 [rows, k] in the GEMM's boxes {128 bytes, box_rows}, 128-byte swizzle.
bool encode_e4m3(CUtensorMap *m, const void *base, long long rows, long long k, int box_rows) {
  return encode_2d(m, base, rows, k, box_rows, BK8, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}
// A's scales [kb, c4] f32 in boxes of S8_COUNT tokens of one k block.
bool encode_scales(CUtensorMap *m, const void *base, long long kb, long long c4) {
  return encode_2d(m, base, kb, c4, 1, S8_COUNT, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}
// The boxes of A's rows the kernel reads: 128 rows, and the row tiles' solo halves of 64 or the
// weights-as-M tiles' boxes of 32.
template <int NVM> bool encode_rows(CUtensorMap m[2], const void *base, long long rows, long long k) {
  return encode_e4m3(&m[0], base, rows, k, 128) && encode_e4m3(&m[1], base, rows, k, NVM == 0 ? BM / 2 : 32);
}

// Clusters of two that fit at once (the persistent grid), cached per device, pass and tiling; 0: none.
template <int MODE, int NVM, bool TM> int resident_clusters(int dev) {
  static std::atomic<int> cache[64];
  const int n = once_per_device(cache, dev, [] {
    auto kernel = sm90_e4m3_kernel<MODE, NVM, TM>;
    constexpr int smem = smem8_bytes<NVM, TM>();
    int clusters = 0;
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = launch_config(attr, 2, 2 * 64, THREADS, smem, 0);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1;
    }
    return clusters;
  });
  return n < 0 ? 0 : n;
}

// One GEMM pass: the operand maps, out and its map, the weights' scales.
struct Pass {
  CUtensorMap a[2], b, sx, out_map;
  void *out;
  float *out_scale; // the weights-as-M tiles' gate_up: h's scales (out is its e4m3)
  const float *wscale;
  int NT, KT, N, b_rows, C4;
  int *waves;
};

template <int MODE, int NVM, bool TM>
cudaError_t launch(cudaStream_t stream, int clusters, const Pass &p, const int *meta, int EL, int F) {
  auto kernel = sm90_e4m3_kernel<MODE, NVM, TM>;
  constexpr int smem = smem8_bytes<NVM, TM>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(attr, 2, (unsigned)(2 * clusters), THREADS, smem, stream, true);
  err = cudaLaunchKernelEx(&cfg, kernel, p.a[0], p.a[1], p.b, p.sx, p.out_map, p.out, p.out_scale, p.C4, p.wscale,
                           meta, EL, p.NT, p.KT, p.N, F, p.b_rows, p.waves);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

// What keeps a tiling from the problem: CANNOT and why, or TAKES.  The caller has checked the
// dtypes, shapes and devices, H and F multiples of 128, and that C and EL are not 0.
template <int NVM, bool TM = false> int fits(moe_ctx *ctx, const moe_experts_fp8_args *a, Fit *fit, char *why, size_t n) {
  (void)ctx;
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int dev = a->x->device.index;
  constexpr int smem = smem8_bytes<NVM, TM>();
  int major = 0, minor = 0, optin = 0;
  *fit = CANNOT;
  why[0] = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, n, "cannot read cuda:%d's compute capability", dev);
  } else if (major != 9 || minor != 0) {
    snprintf(why, n, "needs compute capability 9.0 (Hopper), cuda:%d has %d.%d", dev, major, minor);
  } else if (optin < smem) {
    snprintf(why, n, "needs %d bytes of shared memory per block, cuda:%d offers %d", smem, dev, optin);
  } else if (!sm90a_built((const void *)sm90_e4m3_kernel<GATE_UP, NV8_MAX, false>)) {
    snprintf(why, n, "the library was not built for sm_90a");
  } else if (!aligned16(a->x->data) || !aligned16(a->out->data) || !aligned16(a->w_gate_up->data) ||
             !aligned16(a->w_down->data) || !aligned16(a->x_scale->data)) {
    snprintf(why, n, "needs x, x_scale, out, w_gate_up and w_down 16-byte aligned");
  } else if (C >= (1ll << 30) || EL * 2 * F > INT_MAX || EL * H > INT_MAX) {
    snprintf(why, n, "needs C < 2^30 and EL * 2F, EL * H < 2^31, got C = %lld, EL = %lld, H = %lld, F = %lld", C, EL, H,
             F);
  } else if (!encode_tiled()) {
    snprintf(why, n, "the driver offers no cuTensorMapEncodeTiled");
  } else if (resident_clusters<GATE_UP, NVM, TM>(dev) <= 0 || resident_clusters<DOWN, NVM, TM>(dev) <= 0) {
    snprintf(why, n, "no cluster of two CTAs of the kernel fits on cuda:%d", dev);
  } else if (NVM == NV8_NARROW && C > NARROW_ROWS * EL) {
    *fit = DECLINES;
    snprintf(why, n, "the experts average more than %d rows (C %lld, EL %lld): sm90t_fp8 is faster", NARROW_ROWS, C,
             EL);
  } else {
    *fit = TAKES;
  }
  return MOE_OK;
}

template <int NVM, bool TM = false> int run(moe_ctx *ctx, const moe_experts_fp8_args *a) {
  constexpr bool ROWS = NVM == 0;
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int dev = a->x->device.index;
  cudaStream_t stream;
  int rc = moeI_cuda_ctx_stream(ctx, dev, &stream), sms = 0; // sms: the row tiles' quantize launch
  if (rc || (ROWS && (rc = moeI_cuda_sm_count(ctx, dev, &sms)))) return rc;
  // scratch: meta (sm90_map_kernel's), h bf16 [C, F] (ROWS), h's e4m3 [C, F] and scales [F/128,
  // C4], and x's scales again where C is not a multiple of 4 (a tensor map's rows are 16-byte
  // multiples)
  const long long C4 = (C + 3) & ~3ll;
  auto up = [](size_t b) { return (b + 255) & ~(size_t)255; };
  const size_t meta_bytes = up((size_t)(5 * EL + 5) * sizeof(int)), h_bytes = ROWS ? up((size_t)(C * F * 2)) : 0;
  const size_t hq_bytes = up((size_t)(C * F)), hs_bytes = up((size_t)(F / 128 * C4 * 4));
  const size_t xs_bytes = C4 != C ? up((size_t)(H / 128 * C4 * 4)) : 0;
  void *scratch = NULL;
  if ((rc = experts_scratch(ctx, stream, dev, meta_bytes + h_bytes + hq_bytes + hs_bytes + xs_bytes, &scratch)))
    return rc;
  char *p = (char *)scratch;
  int *meta = (int *)p;
  uint16_t *h = (uint16_t *)(p + meta_bytes);
  uint8_t *hq = (uint8_t *)(p + meta_bytes + h_bytes);
  float *hs = (float *)(p + meta_bytes + h_bytes + hq_bytes);
  float *xs = C4 != C ? (float *)(p + meta_bytes + h_bytes + hq_bytes + hs_bytes) : (float *)a->x_scale->data;

  // units per column tile (NARROW: pair of them) whatever the offsets: row tiles (ROWS), or units
  // of at most 2 NVM rows, and one more an expert
  long long tmax = EL < C ? EL : C;
  constexpr bool NARROW = narrow_units<NVM>();
  if constexpr (ROWS) tmax += (C + BM - 1) / BM;
  else tmax += C / (2 * NVM);
  if constexpr (NARROW) tmax *= 2; // decode_narrow counts a larger expert's units twice
  // outputs a column tile: ROWS 64 (gate_up) and 128 (down), else 128 and 256
  const int out_gu = ROWS ? BN8 / 2 : BN / 2, out_dn = ROWS ? BN8 : BN, b_box = ROWS ? BN8 / 2 : 128;
  const bool gate = C >= 2 * BM * EL;
  Pass gu = {}, dn = {};
  gu.NT = (int)((F + out_gu - 1) / out_gu), gu.KT = (int)(H / 128), gu.N = (int)F, gu.b_rows = (int)(EL * 2 * F);
  dn.NT = (int)((H + out_dn - 1) / out_dn), dn.KT = (int)(F / 128), dn.N = (int)H, dn.b_rows = (int)(EL * H);
  gu.out = ROWS ? (void *)h : (void *)hq, dn.out = a->out->data;
  gu.out_scale = ROWS ? nullptr : hs, gu.C4 = (int)C4;
  gu.wscale = (const float *)a->w_gate_up_scale->data, dn.wscale = (const float *)a->w_down_scale->data;
  gu.waves = gate ? meta + 4 * EL + 2 : nullptr, dn.waves = gate ? meta + 4 * EL + 3 : nullptr;
  const int fit_gu = resident_clusters<GATE_UP, NVM, TM>(dev), fit_dn = resident_clusters<DOWN, NVM, TM>(dev);
  const long long ct_gu = unit_columns<NVM>(gu.NT), ct_dn = unit_columns<NVM>(dn.NT);
  const int g_gu = (int)(tmax * ct_gu < fit_gu ? tmax * ct_gu : fit_gu);
  const int g_dn = (int)(tmax * ct_dn < fit_dn ? tmax * ct_dn : fit_dn);

  const char *what = "cuTensorMapEncodeTiled";
  cudaError_t err = cudaSuccess;
  const bool maps =
      encode_rows<NVM>(gu.a, a->x->data, C, H) && encode_e4m3(&gu.b, a->w_gate_up->data, EL * 2 * F, H, b_box) &&
      encode_scales(&gu.sx, xs, H / 128, C4) &&
      (!ROWS || encode_2d(&gu.out_map, h, C, F, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B)) &&
      encode_rows<NVM>(dn.a, hq, C, F) && encode_e4m3(&dn.b, a->w_down->data, EL * H, F, b_box) &&
      encode_scales(&dn.sx, hs, F / 128, C4) &&
      (TM ? encode_2d(&dn.out_map, dn.out, C, H, 64, 64, CU_TENSOR_MAP_SWIZZLE_128B)
          : encode_2d(&dn.out_map, dn.out, C, H, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B));
  if (!maps) err = cudaErrorInvalidValue;
  if (err == cudaSuccess && C4 != C) {
    what = "cudaMemcpy2DAsync(x_scale)";
    err = cudaMemcpy2DAsync(xs, (size_t)C4 * 4, a->x_scale->data, (size_t)C * 4, (size_t)C * 4, (size_t)(H / 128),
                            cudaMemcpyDeviceToDevice, stream);
  }
  if (err == cudaSuccess) {
    what = "map launch";
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = launch_config(attr, 1, 1, MAP_THREADS, 0, stream, true);
    err = cudaLaunchKernelEx(&cfg, sm90_map_kernel, meta, (const int *)a->offsets->data, (int)EL, (int)C, 2,
                             2 * NVM, NARROW ? NVM : 0);
    if (err == cudaSuccess) err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    what = "gate_up launch";
    err = launch<GATE_UP, NVM, TM>(stream, g_gu, gu, meta, (int)EL, (int)F);
  }
  if (ROWS && err == cudaSuccess) {
    what = "quantize launch";
    quantize_rows_kernel<<<4 * sms, 256, 0, stream>>>(h, hq, hs, meta, (int)EL, (int)C4, (int)F);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    what = "down launch";
    err = launch<DOWN, NVM, TM>(stream, g_dn, dn, meta, (int)EL, (int)F);
  }
  return experts_finish(ctx, stream, scratch, err, what);
}

// The tilings in the order "auto" tries them (fp8.cuh; docs/perf/experts.md).
const Candidate<moe_experts_fp8_args> fp8_kernels[] = {
    {"sm90w_fp8_n32", fits<NV8_NARROW>, run<NV8_NARROW>},
    {"sm90t_fp8", fits<NV8_MAX, true>, run<NV8_MAX, true>},
    {"sm90w_fp8", fits<NV8_MAX>, run<NV8_MAX>},
    {"sm90x2_fp8", fits<0>, run<0>},
};

// C or EL 0: no row of out to write.  Else the current device set to x's: the candidates'
// occupancy queries read it.
int prologue(moe_ctx *ctx, const moe_experts_fp8_args *a, bool *empty) {
  *empty = a->x->shape[0] == 0 || a->w_gate_up->shape[0] == 0;
  if (*empty) return MOE_OK;
  cudaStream_t stream;
  return moeI_cuda_ctx_stream(ctx, a->x->device.index, &stream);
}

} // namespace

const char *moeI_experts_fp8_kernels(void) { return candidate_names(fp8_kernels); }

int moeI_experts_fp8_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a) {
  bool empty;
  const int rc = prologue(ctx, a, &empty);
  if (rc) return rc;
  if (empty) return moeI_ok(ctx);
  return select_run(ctx, "experts_fp8", MOEI_CFG_EXPERTS_FP8_KERNEL, fp8_kernels, a);
}

int moeI_experts_fp8_explain_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a, char *report, size_t n) {
  bool empty;
  const int rc = prologue(ctx, a, &empty);
  if (rc) return rc;
  if (empty) {
    snprintf(report, n, "none\nnone: nothing runs (C or EL is 0: no row of out to write)\n");
    return moeI_ok(ctx);
  }
  return select_explain(ctx, "experts_fp8", MOEI_CFG_EXPERTS_FP8_KERNEL, fp8_kernels, a, report, n);
}
