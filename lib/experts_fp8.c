/* SPDX-License-Identifier: MIT */
/* experts_fp8.c -- stage 4', the SwiGLU MLP of each local expert on block-scaled e4m3 operands:
 * the argument checks and the CPU backend, which is also the oracle of the GPU kernel.
 *
 * Each k block of 128 is one dot product of e4m3 values held as exact f32 (every product of two
 * of them is exact in f32), summed in mlp.h's fixed order; the block's sum then joins the row's
 * f32 accumulator times x_scale * w_scale, blocks in ascending k.  So a row's result depends on
 * nothing but its own inputs: not on the thread count, nor on the rows batched with it. */
#include <stdlib.h>

#include "internal.h"
#include "mlp.h"

/* ---- e4m3 -> f32 through a table of the 256 values, on several threads for whole experts ---- */

typedef struct {
  float *dst;
  const uint8_t *src;
  const float *table;
} e4m3_job;

static void e4m3_convert(void *p, int64_t i0, int64_t i1) {
  const e4m3_job *J = p;
  for (int64_t i = i0; i < i1; i++) J->dst[i] = J->table[J->src[i]];
}

void moeI_mlp_e4m3_to_f32(float *dst, const uint8_t *src, int64_t n) {
  float table[256];
  for (int q = 0; q < 256; q++) table[q] = moeI_e4m3_to_f32((uint8_t)q);
  e4m3_job J = {dst, src, table};
  moeI_parallel_for(n, (int64_t)1 << 22, e4m3_convert, &J);
}

/* ---- one block-scaled product: acc[r][j] = sum_kb dot(w[j, kb], x[r, kb]) * (xs[r][kb] * ws[j/128][kb]) ---- */

typedef struct {
  const float *w;                /* [R, K], the e4m3 values */
  const float *ws;               /* [R/128, K/128] */
  const float *x[MLP_ROWS];      /* rows' e4m3 values [K] */
  const float *xs;               /* [nrows, K/128] */
  int nrows;
  int64_t K, R;
  float *acc;                    /* [nrows, R] */
} fp8_product_job;

static void fp8_product_rows(void *p, int64_t j0, int64_t j1) {
  const fp8_product_job *J = p;
  const int64_t KB = J->K / MOE_FP8_BLOCK;
  for (int64_t j = j0; j < j1; j++) {
    const float *ws = J->ws + (j / MOE_FP8_BLOCK) * KB, *w = J->w + j * J->K;
    float acc[MLP_ROWS] = {0};
    for (int64_t kb = 0; kb < KB; kb++) {
      const float *xb[MLP_ROWS];
      float s[MLP_ROWS];
      for (int r = 0; r < J->nrows; r++) xb[r] = J->x[r] + kb * MOE_FP8_BLOCK;
      moeI_mlp_dot_rows(s, w + kb * MOE_FP8_BLOCK, xb, J->nrows, MOE_FP8_BLOCK);
      for (int r = 0; r < J->nrows; r++) acc[r] += s[r] * (J->xs[r * KB + kb] * ws[kb]);
    }
    for (int r = 0; r < J->nrows; r++) J->acc[r * J->R + j] = acc[r];
  }
}

static void fp8_product(float *acc, const float *w, const float *ws, const float *const x[MLP_ROWS], const float *xs,
                        int nrows, int64_t R, int64_t K) {
  fp8_product_job J = {w, ws, {0}, xs, nrows, K, R, acc};
  for (int r = 0; r < nrows; r++) J.x[r] = x[r];
  /* a thread is worth starting for ~1 M multiply-adds */
  moeI_parallel_for(R, ((int64_t)1 << 20) / (K * nrows > 0 ? K * nrows : 1) + 1, fp8_product_rows, &J);
}

int moeI_experts_fp8_cpu(moe_ctx *ctx, const moe_experts_fp8_args *a) {
  const int64_t C = a->x->shape[0], H = a->x->shape[1];
  const int64_t EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int64_t HB = H / MOE_FP8_BLOCK, FB = F / MOE_FP8_BLOCK;
  const int32_t *off = a->offsets->data;
  const uint8_t *xq = a->x->data, *wgu = a->w_gate_up->data, *wd = a->w_down->data;
  const float *xsc = a->x_scale->data, *gus = a->w_gate_up_scale->data, *dns = a->w_down_scale->data;
  uint16_t *ys = a->out->data;

  if (C == 0 || H == 0 || EL == 0) return moeI_ok(ctx); /* no row to write */
  /* one expert's weights as f32, then per row block: x, its scales, gate/up, h and its scales, y */
  const size_t nfloat = (size_t)(3 * F * H + MLP_ROWS * (H + HB + 2 * F + F + FB + H));
  float *buf = malloc(nfloat * sizeof *buf);
  if (!buf) return moeI_seterr(ctx, MOE_ERR_NOMEM, "experts_fp8: out of host memory (%zu bytes of scratch)", nfloat * sizeof *buf);
  float *wguf = buf, *wdf = wguf + 2 * F * H, *xb = wdf + H * F, *xs = xb + MLP_ROWS * H, *gu = xs + MLP_ROWS * HB;
  float *hq = gu + MLP_ROWS * 2 * F, *hs = hq + MLP_ROWS * F, *yb = hs + MLP_ROWS * FB;
  const float *xr[MLP_ROWS], *hr[MLP_ROWS];
  for (int r = 0; r < MLP_ROWS; r++) xr[r] = xb + r * H, hr[r] = hq + r * F;

  int64_t lo = moeI_clamp_offset(off[0], C);
  for (int64_t e = 0; e < EL; e++) {
    const int64_t hi = moeI_expert_end(off, e, C, lo);
    if (hi > lo) {
      moeI_mlp_e4m3_to_f32(wguf, wgu + e * 2 * F * H, 2 * F * H);
      moeI_mlp_e4m3_to_f32(wdf, wd + e * H * F, H * F);
      const float *gus_e = gus + e * 2 * FB * HB, *dns_e = dns + e * HB * FB;
      for (int64_t row = lo; row < hi; row += MLP_ROWS) {
        const int n = hi - row < MLP_ROWS ? (int)(hi - row) : MLP_ROWS;
        moeI_mlp_e4m3_to_f32(xb, xq + row * H, n * H);
        for (int r = 0; r < n; r++)
          for (int64_t kb = 0; kb < HB; kb++) xs[r * HB + kb] = xsc[kb * C + row + r];
        fp8_product(gu, wguf, gus_e, xr, xs, n, 2 * F, H);
        for (int r = 0; r < n; r++) {
          const float *g = gu + r * 2 * F, *u = g + F;
          float h[MOE_FP8_BLOCK];
          for (int64_t fb = 0; fb < FB; fb++) {
            for (int i = 0; i < MOE_FP8_BLOCK; i++) {
              const int64_t j = fb * MOE_FP8_BLOCK + i;
              h[i] = bf16_to_f32(f32_to_bf16(mlp_silu(g[j]) * u[j]));
            }
            hs[r * FB + fb] = moeI_mlp_fp8_token_block(hq + r * F + fb * MOE_FP8_BLOCK, h);
          }
        }
        fp8_product(yb, wdf, dns_e, hr, hs, n, H, F);
        for (int64_t i = 0; i < n * H; i++) ys[row * H + i] = f32_to_bf16(yb[i]);
      }
    }
    lo = hi;
  }
  free(buf);
  return moeI_ok(ctx);
}

/* "experts_fp8: <what>'s <dim> (<n>) must be a multiple of 128 (the FP8 block), got <t>" */
static int block_error(moe_ctx *ctx, const char *what, const char *dim, int64_t n, const moe_tensor *t) {
  char got[160];
  return moeI_seterr(ctx, MOE_ERR_ARG, "experts_fp8: %s's %s (%lld) must be a multiple of %d (the FP8 block), got %s", what, dim,
                    (long long)n, MOE_FP8_BLOCK, moeI_tensor_describe(t, got, sizeof got));
}

static int experts_fp8_check(moe_ctx *ctx, const moe_experts_fp8_args *a) {
  static const char *stage = "experts_fp8";
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "experts_fp8: args is NULL");
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_E4M3, 2, NULL))) return rc;
  const int64_t C = a->x->shape[0], H = a->x->shape[1];
  if (H % MOE_FP8_BLOCK) return block_error(ctx, "x", "H", H, a->x);
  const int64_t HB = H / MOE_FP8_BLOCK;
  const int64_t xs_shape[] = {HB, C}, out_shape[] = {C, H};
  if ((rc = moeI_check_tensor(ctx, stage, "x_scale", a->x_scale, MOE_F32, 2, xs_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_BF16, 2, out_shape))) return rc;
  const int64_t gu_shape[] = {-1, -1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "w_gate_up", a->w_gate_up, MOE_E4M3, 3, gu_shape))) return rc;
  const int64_t EL = a->w_gate_up->shape[0], F2 = a->w_gate_up->shape[1];
  if (F2 % (2 * MOE_FP8_BLOCK)) {
    char got[160];
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      "experts_fp8: w_gate_up must be e4m3 [EL, 2F, %lld] (F gate rows, then F up rows) with F a multiple "
                      "of %d (the FP8 block), got %s",
                      (long long)H, MOE_FP8_BLOCK, moeI_tensor_describe(a->w_gate_up, got, sizeof got));
  }
  const int64_t F = F2 / 2, FB = F / MOE_FP8_BLOCK;
  const int64_t gus_shape[] = {EL, 2 * FB, HB}, dn_shape[] = {EL, H, F}, dns_shape[] = {EL, HB, FB};
  if ((rc = moeI_check_tensor(ctx, stage, "w_gate_up_scale", a->w_gate_up_scale, MOE_F32, 3, gus_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "w_down", a->w_down, MOE_E4M3, 3, dn_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "w_down_scale", a->w_down_scale, MOE_F32, 3, dns_shape))) return rc;
  const int64_t off_shape[] = {EL + 1};
  if ((rc = moeI_check_tensor(ctx, stage, "offsets", a->offsets, MOE_I32, 1, off_shape))) return rc;
  const moe_tensor *ts[] = {a->out, a->x, a->x_scale, a->offsets, a->w_gate_up, a->w_gate_up_scale, a->w_down, a->w_down_scale};
  static const char *const names[] = {"out", "x", "x_scale", "offsets", "w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", a->x->device, ts, names, 8))) return rc;
  /* out (bf16) cannot be x (e4m3) in place: it may overlap no input */
  return moeI_check_no_overlap(ctx, stage, ts, names, 1, 8);
}

int moe_experts_fp8(moe_ctx *ctx, const moe_experts_fp8_args *a) {
  int rc = experts_fp8_check(ctx, a);
  if (rc) return rc;
  return MOE_IN_RANGE("experts_fp8", moeI_on_cpu(a->x) ? moeI_experts_fp8_cpu(ctx, a) : moeI_experts_fp8_cuda(ctx, a));
}

int moe_experts_fp8_explain(moe_ctx *ctx, const moe_experts_fp8_args *a, char *report, size_t n) {
  int rc = experts_fp8_check(ctx, a);
  if (rc) return rc;
  if ((rc = moeI_check_report(ctx, "experts_fp8", report, n))) return rc;
  if (moeI_on_cpu(a->x)) return moeI_explain_cpu(ctx, report, n);
  return moeI_experts_fp8_explain_cuda(ctx, a, report, n);
}
