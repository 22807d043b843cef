/* SPDX-License-Identifier: MIT */
/* quantize.c -- moe_quantize and moe_dequantize: block-scaled e4m3 tensors (the scale rules and
 * the rounding are fp8_math.h's, which kernels/quantize.cu shares, so both give the same bits).
 * Every kind is one walk over blocks of a tensor seen as [B, R, K] (moeI_qlayout): a block is
 * br x 128 elements, and its scale lives at b * nbr * nbk + i * srow + j * scol. */
#include <stdio.h>
#include <string.h>

#include "fp8_math.h"
#include "internal.h"

static const char *kind_name(int kind) {
  return kind == MOE_QUANT_BLOCK ? "block" : kind == MOE_QUANT_TOKEN ? "token" : "token_t";
}

/* "f32 [2, 3]"-like text of an expected shape */
static void shape_text(char *s, size_t n, moe_dtype dtype, int ndim, const int64_t *shape) {
  size_t len = (size_t)snprintf(s, n, "%s [", moe_dtype_name(dtype));
  for (int i = 0; i < ndim && len < n; i++)
    len += (size_t)snprintf(s + len, n - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (len < n) snprintf(s + len, n - len, "]");
}

/* The checks of quantize and dequantize alike: v (quantize's input, dequantize's output) f32 or bf16 of
 * the kind's rank, q e4m3 of v's shape, scale f32 of the kind's scale shape, one device, and no
 * output over an input.  On success *l describes the blocks. */
static int check_args(moe_ctx *ctx, const char *stage, const moe_tensor *v, const moe_tensor *q,
                      const moe_tensor *scale, int kind, int v_is_out, moeI_qlayout *l) {
  char want[160], got[160];
  if (kind != MOE_QUANT_BLOCK && kind != MOE_QUANT_TOKEN && kind != MOE_QUANT_TOKEN_T)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: kind must be MOE_QUANT_BLOCK (%d), MOE_QUANT_TOKEN (%d) or "
                       "MOE_QUANT_TOKEN_T (%d), got %d", stage, MOE_QUANT_BLOCK, MOE_QUANT_TOKEN, MOE_QUANT_TOKEN_T, kind);
  const int block = kind == MOE_QUANT_BLOCK;
  if (!v || (v->dtype != MOE_F32 && v->dtype != MOE_BF16) || (block ? v->ndim < 2 : v->ndim != 2))
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: x must be f32 or bf16 of %s (kind %s), got %s", stage,
                       block ? "2 to 4 dimensions [..., R, K]" : "2 dimensions [N, K]", kind_name(kind),
                       moeI_tensor_describe(v, got, sizeof got));
  int rc = moeI_check_tensor(ctx, stage, "q", q, MOE_E4M3, v->ndim, v->shape);
  if (rc) return rc;
  const int nd = v->ndim;
  const int64_t R = v->shape[nd - 2], K = v->shape[nd - 1];
  int64_t B = 1;
  for (int d = 0; d < nd - 2; d++) B *= v->shape[d];
  const int64_t br = block ? MOE_FP8_BLOCK : 1;
  const int64_t nbr = (R + br - 1) / br, nbk = (K + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
  int64_t sshape[MOE_MAX_DIMS];
  for (int d = 0; d < nd - 2; d++) sshape[d] = v->shape[d];
  sshape[nd - 2] = kind == MOE_QUANT_TOKEN_T ? nbk : nbr;
  sshape[nd - 1] = kind == MOE_QUANT_TOKEN_T ? nbr : nbk;
  if (moeI_check_tensor(ctx, stage, "scale", scale, MOE_F32, nd, sshape)) {
    char qtext[160];
    shape_text(want, sizeof want, MOE_F32, nd, sshape);
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: scale must be %s for q %s (kind %s: %s), got %s", stage, want,
                       moeI_tensor_describe(q, qtext, sizeof qtext), kind_name(kind),
                       block ? "one per 128 x 128 block" : kind == MOE_QUANT_TOKEN ? "one per row and 128 columns"
                                                                           : "one per 128 columns and row, transposed",
                       moeI_tensor_describe(scale, got, sizeof got));
  }
  const moe_tensor *ts[] = {q, scale, v};
  const char *const names[] = {"q", "scale", "x"};
  if ((rc = moeI_check_same_device(ctx, stage, "q", q->device, ts, names, 3))) return rc;
  /* the outputs first: q and scale, or the dequantized v */
  if (v_is_out) {
    const moe_tensor *outs[] = {v, q, scale};
    const char *const onames[] = {"x", "q", "scale"};
    if ((rc = moeI_check_no_overlap(ctx, stage, outs, onames, 1, 3))) return rc;
  } else if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 2, 3))) {
    return rc;
  }
  *l = (moeI_qlayout){B, R, K, br, nbr, nbk, kind == MOE_QUANT_TOKEN_T ? 1 : nbk, kind == MOE_QUANT_TOKEN_T ? nbr : 1,
                      !block};
  return MOE_OK;
}

typedef struct job {
  const moeI_qlayout *l;
  const void *x;
  void *out;
  uint8_t *q;
  float *scale;
  const uint8_t *qin;
  const float *sin;
  int bf16;
} job;

static float load(const void *p, int bf16, int64_t i) {
  return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* blocks [begin, end) in the order (b, i, j) */
static void quantize_blocks(void *arg, int64_t begin, int64_t end) {
  const job *J = arg;
  const moeI_qlayout *l = J->l;
  for (int64_t n = begin; n < end; n++) {
    const int64_t j = n % l->nbk, i = (n / l->nbk) % l->nbr, b = n / (l->nbk * l->nbr);
    const int64_t r0 = i * l->br, r1 = r0 + l->br < l->R ? r0 + l->br : l->R;
    const int64_t c0 = j * MOE_FP8_BLOCK, c1 = c0 + MOE_FP8_BLOCK < l->K ? c0 + MOE_FP8_BLOCK : l->K;
    const int64_t base = b * l->R * l->K;
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; r++)
      for (int64_t c = c0; c < c1; c++) amax = moeI_fp8_amax(amax, load(J->x, J->bf16, base + r * l->K + c));
    const float s = l->token ? moeI_fp8_token_scale(amax) : moeI_fp8_weight_scale(amax);
    J->scale[moeI_qlayout_scale_at(l, b, i, j)] = s;
    for (int64_t r = r0; r < r1; r++)
      for (int64_t c = c0; c < c1; c++) {
        const int64_t at = base + r * l->K + c;
        J->q[at] = moeI_fp8_quantize(load(J->x, J->bf16, at), s);
      }
  }
}

/* rows [begin, end) of the [B * R, K] view */
static void dequantize_rows(void *arg, int64_t begin, int64_t end) {
  const job *J = arg;
  const moeI_qlayout *l = J->l;
  for (int64_t n = begin; n < end; n++) {
    const int64_t b = n / l->R, r = n % l->R, i = r / l->br;
    for (int64_t c = 0; c < l->K; c++) {
      const float v = moeI_e4m3_to_f32(J->qin[n * l->K + c]) * J->sin[moeI_qlayout_scale_at(l, b, i, c / MOE_FP8_BLOCK)];
      if (J->bf16) ((uint16_t *)J->out)[n * l->K + c] = f32_to_bf16(v);
      else ((float *)J->out)[n * l->K + c] = v;
    }
  }
}

int moe_quantize(moe_ctx *ctx, moe_tensor *q, moe_tensor *scale, const moe_tensor *x, int kind) {
  static const char *stage = "quantize";
  moeI_qlayout l;
  int rc = check_args(ctx, stage, x, q, scale, kind, 0, &l);
  if (rc) return rc;
  if (!moeI_on_cpu(x)) return MOE_IN_RANGE(stage, moeI_quantize_cuda(ctx, q, scale, x, &l));
  job J = {&l, x->data, NULL, q->data, scale->data, NULL, NULL, x->dtype == MOE_BF16};
  const int64_t blocks = l.B * l.nbr * l.nbk, per_block = l.br * MOE_FP8_BLOCK;
  moeI_range_push(stage);
  moeI_parallel_for(blocks, ((int64_t)1 << 18) / per_block + 1, quantize_blocks, &J);
  return moeI_range_pop(moeI_ok(ctx));
}

int moe_dequantize(moe_ctx *ctx, moe_tensor *x, const moe_tensor *q, const moe_tensor *scale, int kind) {
  static const char *stage = "dequantize";
  moeI_qlayout l;
  int rc = check_args(ctx, stage, x, q, scale, kind, 1, &l);
  if (rc) return rc;
  if (!moeI_on_cpu(x)) return MOE_IN_RANGE(stage, moeI_dequantize_cuda(ctx, x, q, scale, &l));
  job J = {&l, NULL, x->data, NULL, NULL, q->data, scale->data, x->dtype == MOE_BF16};
  moeI_range_push(stage);
  moeI_parallel_for(l.B * l.R, ((int64_t)1 << 18) / (l.K + 1) + 1, dequantize_rows, &J);
  return moeI_range_pop(moeI_ok(ctx));
}
