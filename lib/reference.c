/* SPDX-License-Identifier: MIT */
/* reference.c -- the dense reference of a whole MoE layer on the CPU, f32 throughout:
 * out[n] = sum_k w[n,k] * expert_{id[n,k]}(x[n]) + g[n] * shared(x[n]).
 *
 * It knows nothing of ranks' schedules, capacities or layouts, which is what lets it judge
 * them.  It is computed expert by expert (each expert's weights are converted to f32 once per
 * chunk of tokens) into one f32 output per route, and only then summed per token in the fixed
 * order of combine: +0, then k ascending, then the shared expert.
 *
 * The FP8 reference is the same computation with each weight dequantized to f32 and each expert
 * input (token and hidden activation) quantized and dequantized on the way in. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mlp.h"

/* Per-route expert outputs of one chunk are held at once; this bounds them (floats). */
#define REF_CHUNK_FLOATS ((int64_t)1 << 22)

/* The fields moe_reference and moe_reference_fp8 share; the scales are NULL in the bf16 layer. */
typedef struct {
  const char *stage;
  moe_dtype wtype;                         /* the weights' dtype: MOE_BF16 or MOE_E4M3 */
  moe_tensor *out;
  const moe_tensor *x, *ids, *weights;
  const moe_tensor *const *w_gate_up, *const *w_gate_up_scale, *const *w_down, *const *w_down_scale;
  int world, experts;
  const moe_tensor *shared_gate_up, *shared_gate_up_scale, *shared_down, *shared_down_scale, *shared_gate_w;
} ref_layer;

/* dst [R, K] = matrix e of w [.., R, K] in f32: bf16 converted, or e4m3 times its block's scale
 * (scale [.., R/128, K/128]). */
static void load_weights(float *dst, const moe_tensor *w, const moe_tensor *scale, int64_t e) {
  const int64_t R = w->shape[1], K = w->shape[2];
  if (!scale) {
    moeI_mlp_bf16_to_f32(dst, (const uint16_t *)w->data + e * R * K, R * K);
    return;
  }
  const int64_t KB = K / MOE_FP8_BLOCK;
  const float *s = (const float *)scale->data + e * (R / MOE_FP8_BLOCK) * KB;
  moeI_mlp_e4m3_to_f32(dst, (const uint8_t *)w->data + e * R * K, R * K);
  for (int64_t r = 0; r < R; r++)
    for (int64_t k = 0; k < K; k++) dst[r * K + k] *= s[(r / MOE_FP8_BLOCK) * KB + k / MOE_FP8_BLOCK];
}

static int reference_cpu(moe_ctx *ctx, const ref_layer *a) {
  const int64_t N = a->x->shape[0], H = a->x->shape[1], K = a->ids->shape[1];
  const int64_t E = a->experts, EL = E / a->world, F = a->w_gate_up[0]->shape[1] / 2;
  const int64_t Fs = a->shared_gate_up ? a->shared_gate_up->shape[1] / 2 : 0;
  if (N == 0) return moeI_ok(ctx); /* no token (K and H may then be up to 2^40 each) */
  const int64_t KH = K * H > 0 ? K * H : 1;
  const int64_t NC = N < REF_CHUNK_FLOATS / KH ? N : (REF_CHUNK_FLOATS / KH > 0 ? REF_CHUNK_FLOATS / KH : 1);
  const int32_t *ids = a->ids->data;
  const float *wts = a->weights->data;
  const uint16_t *x = a->x->data;
  float *out = a->out->data;

  /* the FP8 layer's experts see each token quantized and dequantized (xq), its gate the token (xf) */
  const int fp8 = a->wtype == MOE_E4M3, h_mode = fp8 ? MLP_H_FP8 : MLP_H_F32;
  size_t nfloat = (size_t)(3 * F * H + 3 * Fs * H + H + NC * H * (K + 2 + fp8) + MLP_ROWS * (F > Fs ? F : Fs));
  float *buf = malloc((nfloat ? nfloat : 1) * sizeof *buf);
  int64_t *cnt = malloc((size_t)(E + 1 + NC * K) * sizeof *cnt);
  if (!buf || !cnt) {
    free(buf), free(cnt);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory (%zu bytes of scratch)", a->stage, nfloat * sizeof *buf);
  }
  float *wf = buf, *sf = wf + 3 * F * H, *gw = sf + 3 * Fs * H, *xf = gw + H, *yb = xf + NC * H;
  float *sb = yb + NC * K * H, *hb = sb + NC * H, *xq = fp8 ? hb + MLP_ROWS * (F > Fs ? F : Fs) : xf;
  int64_t *list = cnt + E + 1;

  if (a->shared_gate_up) {
    load_weights(sf, a->shared_gate_up, a->shared_gate_up_scale, 0);
    load_weights(sf + 2 * Fs * H, a->shared_down, a->shared_down_scale, 0);
  }
  if (a->shared_gate_w) moeI_mlp_bf16_to_f32(gw, a->shared_gate_w->data, H);

  for (int64_t n0 = 0; n0 < N; n0 += NC) {
    const int64_t nc = N - n0 < NC ? N - n0 : NC;
    moeI_mlp_bf16_to_f32(xf, x + n0 * H, nc * H);
    if (fp8) {
      memcpy(xq, xf, (size_t)(nc * H) * sizeof *xq);
      moeI_mlp_fp8_token_qdq(xq, nc * H);
    }

    /* bucket the chunk's routes by expert (counting sort, stable in route order) */
    memset(cnt, 0, (size_t)(E + 1) * sizeof *cnt);
    for (int64_t i = 0; i < nc * K; i++)
      if (ids[n0 * K + i] >= 0) cnt[ids[n0 * K + i] + 1]++;
    for (int64_t e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    for (int64_t i = 0; i < nc * K; i++)
      if (ids[n0 * K + i] >= 0) list[cnt[ids[n0 * K + i]]++] = i;
    /* cnt[e] is now the end of expert e's bucket, which starts at cnt[e - 1] (0 for e = 0) */
    for (int64_t e = 0, lo = 0; e < E; lo = cnt[e], e++) {
      const int64_t hi = cnt[e];
      if (hi == lo) continue;
      const int64_t r = e / EL;
      load_weights(wf, a->w_gate_up[r], fp8 ? a->w_gate_up_scale[r] : NULL, e % EL);
      load_weights(wf + 2 * F * H, a->w_down[r], fp8 ? a->w_down_scale[r] : NULL, e % EL);
      for (int64_t j = lo; j < hi; j += MLP_ROWS) {
        const int nr = hi - j < MLP_ROWS ? (int)(hi - j) : MLP_ROWS;
        const float *xr[MLP_ROWS];
        float *yr[MLP_ROWS];
        for (int r = 0; r < nr; r++) xr[r] = xq + (list[j + r] / K) * H, yr[r] = yb + list[j + r] * H;
        moeI_mlp_swiglu(yr, xr, nr, wf, wf + 2 * F * H, H, F, h_mode, hb);
      }
    }
    if (a->shared_gate_up)
      for (int64_t n = 0; n < nc; n += MLP_ROWS) {
        const int nr = nc - n < MLP_ROWS ? (int)(nc - n) : MLP_ROWS;
        const float *xr[MLP_ROWS];
        float *yr[MLP_ROWS];
        for (int r = 0; r < nr; r++) xr[r] = xq + (n + r) * H, yr[r] = sb + (n + r) * H;
        moeI_mlp_swiglu(yr, xr, nr, sf, sf + 2 * Fs * H, H, Fs, h_mode, hb);
      }

    for (int64_t n = 0; n < nc; n++) {
      float *o = out + (n0 + n) * H;
      for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
      for (int64_t k = 0; k < K; k++) {
        if (ids[(n0 + n) * K + k] < 0) continue;
        const float w = wts[(n0 + n) * K + k], *y = yb + (n * K + k) * H;
        for (int64_t h = 0; h < H; h++) o[h] += w * y[h];
      }
      if (a->shared_gate_up) {
        /* the same dot product and sigmoid as moe_sigmoid_gate, so g matches it bit for bit */
        const float g = a->shared_gate_w ? mlp_sigmoid(moeI_mlp_dot(gw, xf + n * H, H)) : 1.0f, *s = sb + n * H;
        for (int64_t h = 0; h < H; h++) o[h] += g * s[h];
      }
    }
  }
  free(buf);
  free(cnt);
  return moeI_ok(ctx);
}

/* The checks of both references; the scales' only where the weights are e4m3. */
static int reference_check(moe_ctx *ctx, const ref_layer *a) {
  const char *stage = a->stage, *wt = moe_dtype_name(a->wtype);
  const int fp8 = a->wtype == MOE_E4M3;
  char what[40], got[160];
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_BF16, 2, NULL))) return rc;
  const int64_t N = a->x->shape[0], H = a->x->shape[1];
  if (fp8 && H % MOE_FP8_BLOCK)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: x's H (%lld) must be a multiple of %d (the FP8 block), got %s", stage,
                      (long long)H, MOE_FP8_BLOCK, moeI_tensor_describe(a->x, got, sizeof got));
  const int64_t ids_shape[] = {N, -1}, nh_shape[] = {N, H}, h_shape[] = {H};
  if ((rc = moeI_check_tensor(ctx, stage, "ids", a->ids, MOE_I32, 2, ids_shape))) return rc;
  const int64_t K = a->ids->shape[1], nk_shape[] = {N, K};
  if ((rc = moeI_check_tensor(ctx, stage, "weights", a->weights, MOE_F32, 2, nk_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_F32, 2, nh_shape))) return rc;
  if (a->world < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: world must be >= 1, got %d", stage, a->world);
  if (a->experts < 1 || a->experts % a->world)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: experts must be a positive multiple of world (%d), got %d", stage,
                      a->world, a->experts);
  if (!a->w_gate_up || !a->w_down || (fp8 && (!a->w_gate_up_scale || !a->w_down_scale)))
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s must be arrays of world (%d) tensors, got NULL", stage,
                      fp8 ? "w_gate_up, w_gate_up_scale, w_down and w_down_scale" : "w_gate_up and w_down", a->world);
  const int64_t EL = a->experts / a->world, HB = H / MOE_FP8_BLOCK;
  const int64_t gu0_shape[] = {EL, -1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "w_gate_up[0]", a->w_gate_up[0], a->wtype, 3, gu0_shape))) return rc;
  const int64_t F2 = a->w_gate_up[0]->shape[1];
  if (F2 % (fp8 ? 2 * MOE_FP8_BLOCK : 2))
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: w_gate_up[0] must be %s [%lld, 2F, %lld] (F gate rows, then F up rows)%s, got %s",
                      stage, wt, (long long)EL, (long long)H, fp8 ? " with F a multiple of 128 (the FP8 block)" : "",
                      moeI_tensor_describe(a->w_gate_up[0], got, sizeof got));
  const int64_t FB = F2 / 2 / MOE_FP8_BLOCK;
  const int64_t gu_shape[] = {EL, F2, H}, dn_shape[] = {EL, H, F2 / 2};
  const int64_t gus_shape[] = {EL, 2 * FB, HB}, dns_shape[] = {EL, HB, FB};
  for (int r = 0; r < a->world; r++) {
    snprintf(what, sizeof what, "w_gate_up[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_gate_up[r], a->wtype, 3, gu_shape))) return rc;
    snprintf(what, sizeof what, "w_down[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_down[r], a->wtype, 3, dn_shape))) return rc;
    if (!fp8) continue;
    snprintf(what, sizeof what, "w_gate_up_scale[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_gate_up_scale[r], MOE_F32, 3, gus_shape))) return rc;
    snprintf(what, sizeof what, "w_down_scale[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_down_scale[r], MOE_F32, 3, dns_shape))) return rc;
  }
  if (!a->shared_gate_up != !a->shared_down)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: shared_gate_up and shared_down must be given together", stage);
  if (a->shared_gate_up) {
    const int64_t sgu_shape[] = {1, -1, H};
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate_up", a->shared_gate_up, a->wtype, 3, sgu_shape))) return rc;
    const int64_t Fs2 = a->shared_gate_up->shape[1], sdn_shape[] = {1, H, Fs2 / 2};
    if (Fs2 % (fp8 ? 2 * MOE_FP8_BLOCK : 2))
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: shared_gate_up must be %s [1, 2Fs, %lld]%s, got %s", stage, wt, (long long)H,
                        fp8 ? " with Fs a multiple of 128 (the FP8 block)" : "",
                        moeI_tensor_describe(a->shared_gate_up, got, sizeof got));
    if ((rc = moeI_check_tensor(ctx, stage, "shared_down", a->shared_down, a->wtype, 3, sdn_shape))) return rc;
    const int64_t FsB = Fs2 / 2 / MOE_FP8_BLOCK, sgus_shape[] = {1, 2 * FsB, HB}, sdns_shape[] = {1, HB, FsB};
    if (fp8 && ((rc = moeI_check_tensor(ctx, stage, "shared_gate_up_scale", a->shared_gate_up_scale, MOE_F32, 3, sgus_shape)) ||
                (rc = moeI_check_tensor(ctx, stage, "shared_down_scale", a->shared_down_scale, MOE_F32, 3, sdns_shape))))
      return rc;
  }
  if (a->shared_gate_w) {
    if (!a->shared_gate_up) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: shared_gate_w is given without a shared expert", stage);
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate_w", a->shared_gate_w, MOE_BF16, 1, h_shape))) return rc;
  }
  const moe_device dev = a->x->device;
  const moe_tensor *ts[] = {a->out, a->x, a->ids, a->weights, a->shared_gate_up, a->shared_down, a->shared_gate_w,
                            a->shared_gate_up_scale, a->shared_down_scale};
  static const char *const names[] = {"out", "x", "ids", "weights", "shared_gate_up", "shared_down", "shared_gate_w",
                                      "shared_gate_up_scale", "shared_down_scale"};
  const int nts = fp8 && a->shared_gate_up ? 9 : 7;
  if ((rc = moeI_check_same_device(ctx, stage, "x", dev, ts, names, nts)) ||
      (rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_gate_up, a->world, "w_gate_up")) ||
      (rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_down, a->world, "w_down")))
    return rc;
  if (fp8 && ((rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_gate_up_scale, a->world, "w_gate_up_scale")) ||
              (rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_down_scale, a->world, "w_down_scale"))))
    return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, nts))) return rc;
  if ((rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_gate_up, a->world, "w_gate_up")) ||
      (rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_down, a->world, "w_down")))
    return rc;
  if (fp8 && ((rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_gate_up_scale, a->world, "w_gate_up_scale")) ||
              (rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_down_scale, a->world, "w_down_scale"))))
    return rc;
  if (dev.kind != MOE_CPU)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: runs on the cpu only, got x %s", stage,
                      moeI_tensor_describe(a->x, got, sizeof got));

  /* An id that is neither an expert nor the mask is a bug upstream that the reference must
   * not silently paper over (the stages skip and count such routes instead). */
  const int32_t *ids = a->ids->data;
  for (int64_t i = 0; i < N * K; i++)
    if (ids[i] != -1 && (ids[i] < 0 || ids[i] >= a->experts))
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: ids[%lld, %lld] is %d, not an expert in [0, %d) nor -1 (masked)", stage,
                        (long long)(i / K), (long long)(i % K), ids[i], a->experts);
  return MOE_OK;
}

static int reference_run(moe_ctx *ctx, const ref_layer *l) {
  int rc = reference_check(ctx, l);
  return rc ? rc : MOE_IN_RANGE(l->stage, reference_cpu(ctx, l));
}

int moe_reference(moe_ctx *ctx, const moe_reference_args *a) {
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "reference: args is NULL");
  const ref_layer l = {"reference", MOE_BF16, a->out, a->x, a->ids, a->weights, a->w_gate_up, NULL, a->w_down, NULL,
                       a->world, a->experts, a->shared_gate_up, NULL, a->shared_down, NULL, a->shared_gate_w};
  return reference_run(ctx, &l);
}

int moe_reference_fp8(moe_ctx *ctx, const moe_reference_fp8_args *a) {
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "reference_fp8: args is NULL");
  const ref_layer l = {"reference_fp8", MOE_E4M3, a->out, a->x, a->ids, a->weights, a->w_gate_up, a->w_gate_up_scale,
                       a->w_down, a->w_down_scale, a->world, a->experts, a->shared_gate_up, a->shared_gate_up_scale,
                       a->shared_down, a->shared_down_scale, a->shared_gate_w};
  return reference_run(ctx, &l);
}
