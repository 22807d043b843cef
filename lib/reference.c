/* SPDX-License-Identifier: MIT */
/* reference.c -- the dense reference of a whole MoE layer on the CPU, f32 throughout:
 * out[n] = sum_k w[n,k] * expert_{id[n,k]}(x[n]) + g[n] * shared(x[n]).
 *
 * It knows nothing of ranks' schedules, capacities or layouts, which is what lets it judge
 * them.  It is computed expert by expert (each expert's weights are converted to f32 once per
 * chunk of tokens) into one f32 output per route, and only then summed per token in the fixed
 * order of combine: +0, then k ascending, then the shared expert. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mlp.h"

/* Per-route expert outputs of one chunk are held at once; this bounds them (floats). */
#define REF_CHUNK_FLOATS ((int64_t)1 << 22)

static int reference_cpu(moe_ctx *ctx, const moe_reference_args *a) {
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

  size_t nfloat = (size_t)(3 * F * H + 3 * Fs * H + H + NC * H * (K + 2) + MLP_ROWS * (F > Fs ? F : Fs));
  float *buf = malloc((nfloat ? nfloat : 1) * sizeof *buf);
  int64_t *cnt = malloc((size_t)(E + 1 + NC * K) * sizeof *cnt);
  if (!buf || !cnt) {
    free(buf), free(cnt);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "reference: out of host memory (%zu bytes of scratch)", nfloat * sizeof *buf);
  }
  float *wf = buf, *sf = wf + 3 * F * H, *gw = sf + 3 * Fs * H, *xf = gw + H, *yb = xf + NC * H;
  float *sb = yb + NC * K * H, *hb = sb + NC * H;
  int64_t *list = cnt + E + 1;

  if (a->shared_gate_up) {
    moeI_mlp_bf16_to_f32(sf, a->shared_gate_up->data, 2 * Fs * H);
    moeI_mlp_bf16_to_f32(sf + 2 * Fs * H, a->shared_down->data, H * Fs);
  }
  if (a->shared_gate_w) moeI_mlp_bf16_to_f32(gw, a->shared_gate_w->data, H);

  for (int64_t n0 = 0; n0 < N; n0 += NC) {
    const int64_t nc = N - n0 < NC ? N - n0 : NC;
    moeI_mlp_bf16_to_f32(xf, x + n0 * H, nc * H);

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
      const moe_tensor *gu = a->w_gate_up[e / EL], *dn = a->w_down[e / EL];
      moeI_mlp_bf16_to_f32(wf, (const uint16_t *)gu->data + (e % EL) * 2 * F * H, 2 * F * H);
      moeI_mlp_bf16_to_f32(wf + 2 * F * H, (const uint16_t *)dn->data + (e % EL) * H * F, H * F);
      for (int64_t j = lo; j < hi; j += MLP_ROWS) {
        const int nr = hi - j < MLP_ROWS ? (int)(hi - j) : MLP_ROWS;
        const float *xr[MLP_ROWS];
        float *yr[MLP_ROWS];
        for (int r = 0; r < nr; r++) xr[r] = xf + (list[j + r] / K) * H, yr[r] = yb + list[j + r] * H;
        moeI_mlp_swiglu(yr, xr, nr, wf, wf + 2 * F * H, H, F, 0, hb);
      }
    }
    if (a->shared_gate_up)
      for (int64_t n = 0; n < nc; n += MLP_ROWS) {
        const int nr = nc - n < MLP_ROWS ? (int)(nc - n) : MLP_ROWS;
        const float *xr[MLP_ROWS];
        float *yr[MLP_ROWS];
        for (int r = 0; r < nr; r++) xr[r] = xf + (n + r) * H, yr[r] = sb + (n + r) * H;
        moeI_mlp_swiglu(yr, xr, nr, sf, sf + 2 * Fs * H, H, Fs, 0, hb);
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

int moe_reference(moe_ctx *ctx, const moe_reference_args *a) {
  static const char *stage = "reference";
  char what[32], got[160];
  int rc;
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "reference: args is NULL");
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_BF16, 2, NULL))) return rc;
  const int64_t N = a->x->shape[0], H = a->x->shape[1];
  const int64_t ids_shape[] = {N, -1}, nh_shape[] = {N, H}, h_shape[] = {H};
  if ((rc = moeI_check_tensor(ctx, stage, "ids", a->ids, MOE_I32, 2, ids_shape))) return rc;
  const int64_t K = a->ids->shape[1], nk_shape[] = {N, K};
  if ((rc = moeI_check_tensor(ctx, stage, "weights", a->weights, MOE_F32, 2, nk_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_F32, 2, nh_shape))) return rc;
  if (a->world < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "reference: world must be >= 1, got %d", a->world);
  if (a->experts < 1 || a->experts % a->world)
    return moeI_seterr(ctx, MOE_ERR_ARG, "reference: experts must be a positive multiple of world (%d), got %d",
                      a->world, a->experts);
  if (!a->w_gate_up || !a->w_down)
    return moeI_seterr(ctx, MOE_ERR_ARG, "reference: w_gate_up and w_down must be arrays of world (%d) tensors, got NULL",
                      a->world);
  const int64_t EL = a->experts / a->world;
  const int64_t gu0_shape[] = {EL, -1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "w_gate_up[0]", a->w_gate_up[0], MOE_BF16, 3, gu0_shape))) return rc;
  const int64_t F2 = a->w_gate_up[0]->shape[1];
  if (F2 % 2)
    return moeI_seterr(ctx, MOE_ERR_ARG, "reference: w_gate_up[0] must be bf16 [%lld, 2F, %lld] (F gate rows, then F up rows), got %s",
                      (long long)EL, (long long)H, moeI_tensor_describe(a->w_gate_up[0], got, sizeof got));
  const int64_t gu_shape[] = {EL, F2, H}, dn_shape[] = {EL, H, F2 / 2};
  for (int r = 0; r < a->world; r++) {
    snprintf(what, sizeof what, "w_gate_up[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_gate_up[r], MOE_BF16, 3, gu_shape))) return rc;
    snprintf(what, sizeof what, "w_down[%d]", r);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->w_down[r], MOE_BF16, 3, dn_shape))) return rc;
  }
  if (!a->shared_gate_up != !a->shared_down)
    return moeI_seterr(ctx, MOE_ERR_ARG, "reference: shared_gate_up and shared_down must be given together");
  if (a->shared_gate_up) {
    const int64_t sgu_shape[] = {1, -1, H};
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate_up", a->shared_gate_up, MOE_BF16, 3, sgu_shape))) return rc;
    const int64_t Fs2 = a->shared_gate_up->shape[1], sdn_shape[] = {1, H, Fs2 / 2};
    if (Fs2 % 2)
      return moeI_seterr(ctx, MOE_ERR_ARG, "reference: shared_gate_up must be bf16 [1, 2Fs, %lld], got %s", (long long)H,
                        moeI_tensor_describe(a->shared_gate_up, got, sizeof got));
    if ((rc = moeI_check_tensor(ctx, stage, "shared_down", a->shared_down, MOE_BF16, 3, sdn_shape))) return rc;
  }
  if (a->shared_gate_w) {
    if (!a->shared_gate_up) return moeI_seterr(ctx, MOE_ERR_ARG, "reference: shared_gate_w is given without a shared expert");
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate_w", a->shared_gate_w, MOE_BF16, 1, h_shape))) return rc;
  }
  const moe_device dev = a->x->device;
  const moe_tensor *ts[] = {a->out, a->x, a->ids, a->weights, a->shared_gate_up, a->shared_down, a->shared_gate_w};
  static const char *const names[] = {"out", "x", "ids", "weights", "shared_gate_up", "shared_down", "shared_gate_w"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", dev, ts, names, 7)) ||
      (rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_gate_up, a->world, "w_gate_up")) ||
      (rc = moeI_check_same_device_list(ctx, stage, "x", dev, a->w_down, a->world, "w_down")))
    return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 7))) return rc;
  if ((rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_gate_up, a->world, "w_gate_up")) ||
      (rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->w_down, a->world, "w_down")))
    return rc;
  if (dev.kind != MOE_CPU)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "reference: runs on the cpu only, got x %s",
                      moeI_tensor_describe(a->x, got, sizeof got));

  /* An id that is neither an expert nor the mask is a bug upstream that the reference must
   * not silently paper over (the stages skip and count such routes instead). */
  const int32_t *ids = a->ids->data;
  for (int64_t i = 0; i < N * K; i++)
    if (ids[i] != -1 && (ids[i] < 0 || ids[i] >= a->experts))
      return moeI_seterr(ctx, MOE_ERR_ARG, "reference: ids[%lld, %lld] is %d, not an expert in [0, %d) nor -1 (masked)",
                        (long long)(i / K), (long long)(i % K), ids[i], a->experts);
  return MOE_IN_RANGE(stage, reference_cpu(ctx, a));
}
