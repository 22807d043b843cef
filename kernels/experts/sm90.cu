/* SPDX-License-Identifier: MIT */
// sm90.cu -- the host side of the Hopper kernels (sm90.cuh): which variants can take a problem
// (moeI_experts_sm90_fits, for select.cu's table), the tensor maps, the persistent grids and the
// launches.
#include <atomic>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>

#include "../sm90/tensor_map.cuh"
#include "sm90_gemm.cuh"

namespace {

// A row-major bf16 [rows, k] matrix in the GEMM's boxes: {BK, box_rows}, 128-byte swizzle.
bool encode_ab(CUtensorMap *m, const void *base, long long rows, long long k, int box_rows = BM) {
  return encode_2d(m, base, rows, k, box_rows, BK, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Clusters (CM > 1) or CTAs (CM = 1) that fit on the device at once: the persistent grid.
// Cached per device and kernel; 0 when none fit.
template <int MODE, int CM, bool WT> int resident_groups(int dev) {
  static std::atomic<int> cache[64];
  const int n = once_per_device(cache, dev, [dev] {
    auto kernel = sm90_gemm_kernel<MODE, CM, WT>;
    constexpr int smem = smem_bytes<WT>();
    auto failed = [] { (void)cudaGetLastError(); return -1; };
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return failed();
    if (CM == 1) {
      int sms = 0, per_sm = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, smem) != cudaSuccess)
        return failed();
      return sms * per_sm;
    }
    int clusters = 0;
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = launch_config(attr, CM, CM * 64, THREADS, smem, 0);
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) return failed();
    return clusters;
  });
  return n < 0 ? 0 : n;
}

template <int MODE, int CM, bool WT>
cudaError_t launch_gemm(cudaStream_t stream, int groups, const CUtensorMap &ta, const CUtensorMap &ta_half,
                        const CUtensorMap &ta8, const CUtensorMap &tb, const CUtensorMap &tout, uint16_t *out,
                        const int *meta, int EL, int NT, int KT, int N, int F, int b_rows, int *waves) {
  auto kernel = sm90_gemm_kernel<MODE, CM, WT>;
  constexpr int smem = smem_bytes<WT>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(attr, CM, (unsigned)(groups * CM), THREADS, smem, stream);
  err = cudaLaunchKernelEx(&cfg, kernel, ta, ta_half, ta8, tb, tout, out, meta, EL, NT, KT, N, F, b_rows, waves);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

// WT (CM = 2 only): the weights-as-M kernel (decode_w); else the row tiles (decode).
template <int CM, bool WT> int run(moe_ctx *ctx, const moe_experts_args *a) {
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int dev = a->x->device.index;
  CUtensorMap t_xs, t_wgu, t_wdn; // as moeI_experts_sm90_fits encoded them, so these succeed too
  if (!encode_ab(&t_xs, a->x->data, C, H) || !encode_ab(&t_wgu, a->w_gate_up->data, EL * 2 * F, H) ||
      !encode_ab(&t_wdn, a->w_down->data, EL * H, F))
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "experts (sm90): cuTensorMapEncodeTiled refused a tensor");
  // units per column tile, whatever the offsets: row tiles, or WT units (at most ceil(rows / (2
  // NV_MAX)) an expert, and none on an empty one)
  const long long tmax = WT ? C / (2 * NV_MAX) + (EL < C ? EL : C) : (C + BM - 1) / BM + (EL < C ? EL : C);
  const int nt_gu = (int)((F + BN / 2 - 1) / (BN / 2)), nt_dn = (int)((H + BN - 1) / BN);
  // grids: all that fit at once (fits saw that some do), no more than the most units a pass can have
  const int fit_gu = resident_groups<GATE_UP, CM, WT>(dev), fit_dn = resident_groups<DOWN, CM, WT>(dev);
  const int g_gu = (int)(tmax * nt_gu < fit_gu ? tmax * nt_gu : fit_gu);
  const int g_dn = (int)(tmax * nt_dn < fit_dn ? tmax * nt_dn : fit_dn);

  cudaStream_t stream;
  int rc = moeI_cuda_ctx_stream(ctx, dev, &stream);
  if (rc) return rc;

  // scratch: meta = pairs [EL + 1], solos [EL + 1], lo [EL], hi [EL], waves [2], wunits [EL + 1] ints,
  // then h [C, F] bf16
  const size_t meta_bytes = ((size_t)(5 * EL + 5) * sizeof(int) + 255) & ~(size_t)255;
  const size_t h_bytes = (size_t)C * (size_t)F * 2;
  void *scratch = NULL;
  if ((rc = experts_scratch(ctx, stream, dev, meta_bytes + h_bytes, &scratch))) return rc;
  int *meta = (int *)scratch;
  // the wave gate (see sm90.cuh): where CTAs share operands, and its counts fit an int
  const bool gate = C >= 2 * BM * EL && tmax * (nt_gu > nt_dn ? nt_gu : nt_dn) * CM < INT_MAX;
  uint16_t *h = (uint16_t *)((char *)scratch + meta_bytes);
  uint16_t *ys = (uint16_t *)a->out->data;

  const char *what = "map launch";
  cudaError_t err = cudaSuccess;
  // A in boxes of half a tile's rows, for a solo unit's multicast: pairs only (CM = 1 is passed
  // the full maps, which it never reads as halves); WT: in boxes of 32 and of 8 rows; the outputs
  // h and ys in the WT epilogue's boxes {16, 32}, 32-byte swizzle (the row tiles are passed h's
  // map, unread).  The smaller boxes describe the same tensors as maps that succeeded with 128 rows.
  CUtensorMap t_h, t_h_half, t_xs_half = t_xs, t_h8, t_xs8 = t_xs, t_h_out, t_ys_out;
  bool maps = encode_ab(&t_h, h, C, F);
  t_h_half = t_h8 = t_h_out = t_ys_out = t_h;
  const int half = WT ? 32 : BM / 2;
  if (maps && CM > 1) maps = encode_ab(&t_h_half, h, C, F, half) && encode_ab(&t_xs_half, a->x->data, C, H, half);
  if (maps && WT) maps = encode_ab(&t_h8, h, C, F, 8) && encode_ab(&t_xs8, a->x->data, C, H, 8);
  if (maps && WT)
    maps = encode_2d(&t_h_out, h, C, F, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B) &&
           encode_2d(&t_ys_out, ys, C, H, 32, 16, CU_TENSOR_MAP_SWIZZLE_32B);
  if (!maps) {
    what = "cuTensorMapEncodeTiled(h, or the smaller boxes)";
    err = cudaErrorInvalidValue;
  } else {
    sm90_map_kernel<<<1, MAP_THREADS, 0, stream>>>(meta, (const int *)a->offsets->data, (int)EL, (int)C, CM,
                                                   WT ? 2 * NV_MAX : 0);
    err = cudaGetLastError();
  }
  int *waves = gate ? meta + 4 * EL + 2 : nullptr;
  if (err == cudaSuccess) {
    what = "gate_up launch";
    err = launch_gemm<GATE_UP, CM, WT>(stream, g_gu, t_xs, t_xs_half, t_xs8, t_wgu, t_h_out, h, meta, (int)EL, nt_gu,
                                       (int)(H / BK), (int)F, (int)F, (int)(EL * 2 * F), waves);
  }
  if (err == cudaSuccess) {
    what = "down launch";
    err = launch_gemm<DOWN, CM, WT>(stream, g_dn, t_h, t_h_half, t_h8, t_wdn, t_ys_out, ys, meta, (int)EL, nt_dn,
                                    (int)(F / BK), (int)H, (int)F, (int)(EL * H), waves ? waves + 1 : nullptr);
  }
  return experts_finish(ctx, stream, scratch, err, what);
}

template <int CM, bool WT> bool placeable(int dev) {
  return resident_groups<GATE_UP, CM, WT>(dev) > 0 && resident_groups<DOWN, CM, WT>(dev) > 0;
}

} // namespace

// Everything that can keep a variant from running is checked here, before anything is allocated
// or launched, so that a variant that CANNOT leaves no trace and the next candidate runs instead.
int moeI_experts_sm90_fits(moe_ctx *ctx, const moe_experts_args *a, Sm90Variant v, Fit *fit, char *why, size_t n) {
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int dev = a->x->device.index;
  *fit = CANNOT;

  int major = 0, minor = 0, optin = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, n, "cannot read the device's compute capability");
    return MOE_OK;
  }
  if (major != 9 || minor != 0) {
    snprintf(why, n, "needs compute capability 9.0, cuda:%d has %d.%d", dev, major, minor);
    return MOE_OK;
  }
  if (optin < SMEM_BYTES) {
    snprintf(why, n, "needs %d bytes of shared memory per block, cuda:%d offers %d", SMEM_BYTES, dev, optin);
    return MOE_OK;
  }
  if (!sm90a_built((const void *)sm90_gemm_kernel<GATE_UP, 1, false>)) {
    snprintf(why, n, "the library was not built for sm_90a");
    return MOE_OK;
  }
  if (H <= 0 || F <= 0 || H % BK || F % BK) {
    snprintf(why, n, "needs H and F positive multiples of %d, got H = %lld, F = %lld", BK, H, F);
    return MOE_OK;
  }
  if (!aligned16(a->x->data) || !aligned16(a->out->data) || !aligned16(a->w_gate_up->data) ||
      !aligned16(a->w_down->data)) {
    snprintf(why, n, "needs x, out, w_gate_up and w_down 16-byte aligned");
    return MOE_OK;
  }
  const long long lim = 1ll << 30;
  if (C >= lim || EL >= lim || EL * 2 * F > INT_MAX || EL * H > INT_MAX) {
    snprintf(why, n, "needs C < 2^30 and EL * 2F, EL * H < 2^31, got C = %lld, EL = %lld, H = %lld, F = %lld", C, EL,
             H, F);
    return MOE_OK;
  }
  if (C > 0 && EL > 0) { // else nothing is launched
    const long long tmax = (C + BM - 1) / BM + (EL < C ? EL : C);
    const long long nt_gu = (F + BN / 2 - 1) / (BN / 2), nt_dn = (H + BN - 1) / BN;
    if (tmax * (nt_gu > nt_dn ? nt_gu : nt_dn) > INT_MAX) {
      snprintf(why, n, "C = %lld, H = %lld, F = %lld give more than 2^31 tiles", C, H, F);
      return MOE_OK;
    }
    if (!encode_tiled()) {
      snprintf(why, n, "the driver offers no cuTensorMapEncodeTiled");
      return MOE_OK;
    }
    CUtensorMap t;
    if (!encode_ab(&t, a->x->data, C, H) || !encode_ab(&t, a->w_gate_up->data, EL * 2 * F, H) ||
        !encode_ab(&t, a->w_down->data, EL * H, F)) {
      snprintf(why, n, "cuTensorMapEncodeTiled refused a tensor");
      return MOE_OK;
    }
  }
  const bool fits = v == SM90W ? placeable<2, true>(dev) : v == SM90X2 ? placeable<2, false>(dev)
                                                                        : placeable<1, false>(dev);
  if (!fits) {
    snprintf(why, n, v == SM90X1 ? "no CTA of the kernel fits on cuda:%d" : "no cluster of two CTAs fits on cuda:%d",
             dev);
    return MOE_OK;
  }
  // The weights-as-M tiles where the experts average two row tiles or more; below that the row
  // tiles, as in decode (docs/perf/experts.md).
  if (v == SM90W && C < 2 * BM * EL) {
    snprintf(why, n, "the experts average fewer than %d rows (C = %lld, EL = %lld): the row tiles are faster", 2 * BM,
             C, EL);
    *fit = DECLINES;
    return MOE_OK;
  }
  *fit = TAKES;
  return MOE_OK;
}

int moeI_experts_sm90_run(moe_ctx *ctx, const moe_experts_args *a, Sm90Variant v) {
  return v == SM90W ? run<2, true>(ctx, a) : v == SM90X2 ? run<2, false>(ctx, a) : run<1, false>(ctx, a);
}
