/* SPDX-License-Identifier: MIT */
/* experts.c -- stage 4, the SwiGLU MLP of each local expert over its rows, with the f32 dot
 * products it shares with the dense reference (mlp.h); also the router logits and the
 * shared-expert sigmoid gate, which are the same kind of product. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mlp.h"

/* GCC and Clang vector extensions turn the eight partial sums into two SIMD registers per row;
 * plain -O2 does not vectorise these loops on its own (it may not reassociate the float sums,
 * and its cheap cost model refuses the rest).  Lane l of a register holds exactly what the
 * portable loop keeps in s[l], and every lane is one multiply then one add, so both paths give
 * the same bits.  Define MOE_PORTABLE_C to build the portable loops. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MOE_PORTABLE_C)
#define MLP_VECTOR 1
typedef float v4f __attribute__((vector_size(16)));
static inline v4f load4(const float *p) {
  v4f v;
  memcpy(&v, p, sizeof v); /* unaligned load */
  return v;
}
#else
#define MLP_VECTOR 0
#endif

/* Eight at a time through integer bits: the compiler vectorises this block (it does not
 * vectorise the plain per-element loop at -O2), which makes it about 2.5x faster; weight
 * conversion is most of the time when experts have only a few rows. */
static void bf16_to_f32_range(float *dst, const uint16_t *src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint32_t u[8];
    for (int l = 0; l < 8; l++) u[l] = (uint32_t)src[i + l] << 16;
    memcpy(dst + i, u, sizeof u);
  }
  for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* Large conversions (an expert's weights: 44 M values at Kimi K2's size) in pieces of whole
 * blocks of 8 on several threads. */
typedef struct {
  float *dst;
  const uint16_t *src;
  int64_t n;
} convert_job;

static void convert_blocks(void *p, int64_t b0, int64_t b1) {
  const convert_job *J = p;
  const int64_t end = 8 * b1 < J->n ? 8 * b1 : J->n;
  bf16_to_f32_range(J->dst + 8 * b0, J->src + 8 * b0, end - 8 * b0);
}

void moeI_mlp_bf16_to_f32(float *dst, const uint16_t *src, int64_t n) {
  convert_job J = {dst, src, n};
  moeI_parallel_for((n + 7) / 8, (int64_t)1 << 19, convert_blocks, &J); /* >= 4 M values a thread */
}

/* The one order in which the eight partial sums are combined (see mlp.h). */
static inline float sum8(const float s[8]) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

float moeI_mlp_dot(const float *w, const float *x, int64_t n) {
  float s[8] = {0};
  int64_t i = 0;
#if MLP_VECTOR
  v4f a = {0}, b = {0};
  for (; i + 8 <= n; i += 8) {
    a += load4(w + i) * load4(x + i);
    b += load4(w + i + 4) * load4(x + i + 4);
  }
  memcpy(s, &a, sizeof a);
  memcpy(s + 4, &b, sizeof b);
#else
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) s[l] += w[i + l] * x[i + l];
#endif
  for (int l = 0; i < n; i++, l++) s[l] += w[i] * x[i];
  return sum8(s);
}

void moeI_mlp_dot4(float out[MLP_ROWS], const float *w, const float *const x[MLP_ROWS], int64_t n) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  float s0[8] = {0}, s1[8] = {0}, s2[8] = {0}, s3[8] = {0};
  int64_t i = 0;
#if MLP_VECTOR
  /* each weight load serves four rows: eight accumulators, two weight registers */
  v4f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
  for (; i + 8 <= n; i += 8) {
    v4f wa = load4(w + i), wb = load4(w + i + 4);
    a0 += wa * load4(x0 + i);
    a1 += wa * load4(x1 + i);
    a2 += wa * load4(x2 + i);
    a3 += wa * load4(x3 + i);
    b0 += wb * load4(x0 + i + 4);
    b1 += wb * load4(x1 + i + 4);
    b2 += wb * load4(x2 + i + 4);
    b3 += wb * load4(x3 + i + 4);
  }
  memcpy(s0, &a0, sizeof a0), memcpy(s0 + 4, &b0, sizeof b0);
  memcpy(s1, &a1, sizeof a1), memcpy(s1 + 4, &b1, sizeof b1);
  memcpy(s2, &a2, sizeof a2), memcpy(s2 + 4, &b2, sizeof b2);
  memcpy(s3, &a3, sizeof a3), memcpy(s3 + 4, &b3, sizeof b3);
#else
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) {
      float wl = w[i + l];
      s0[l] += wl * x0[i + l];
      s1[l] += wl * x1[i + l];
      s2[l] += wl * x2[i + l];
      s3[l] += wl * x3[i + l];
    }
#endif
  for (int l = 0; i < n; i++, l++) {
    s0[l] += w[i] * x0[i];
    s1[l] += w[i] * x1[i];
    s2[l] += w[i] * x2[i];
    s3[l] += w[i] * x3[i];
  }
  out[0] = sum8(s0), out[1] = sum8(s1), out[2] = sum8(s2), out[3] = sum8(s3);
}

void moeI_mlp_dot_rows(float *out, const float *w, const float *const x[MLP_ROWS], int nrows, int64_t n) {
  if (nrows == MLP_ROWS) {
    moeI_mlp_dot4(out, w, x, n);
    return;
  }
  for (int r = 0; r < nrows; r++) out[r] = moeI_mlp_dot(w, x[r], n);
}

/* The two products of moeI_mlp_swiglu, over ranges of output rows (moeI_parallel_for): each h and y
 * element is one dot product, whichever thread computes it. */
typedef struct {
  float *const *y;
  const float *const *x;
  const float *hr[MLP_ROWS];
  int nrows, h_mode;
  const float *w_gate_up, *w_down;
  int64_t H, F;
  float *h;
} swiglu_job;

static void swiglu_hidden(void *p, int64_t j0, int64_t j1) {
  const swiglu_job *J = p;
  for (int64_t j = j0; j < j1; j++) {
    float g[MLP_ROWS], u[MLP_ROWS];
    moeI_mlp_dot_rows(g, J->w_gate_up + j * J->H, J->x, J->nrows, J->H);
    moeI_mlp_dot_rows(u, J->w_gate_up + (J->F + j) * J->H, J->x, J->nrows, J->H);
    for (int r = 0; r < J->nrows; r++) {
      float v = mlp_silu(g[r]) * u[r];
      J->h[r * J->F + j] = J->h_mode == MLP_H_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
  }
}

static void swiglu_out(void *p, int64_t i0, int64_t i1) {
  const swiglu_job *J = p;
  for (int64_t i = i0; i < i1; i++) {
    float o[MLP_ROWS];
    moeI_mlp_dot_rows(o, J->w_down + i * J->F, J->hr, J->nrows, J->F);
    for (int r = 0; r < J->nrows; r++) J->y[r][i] = o[r];
  }
}

float moeI_mlp_fp8_token_block(float q[MOE_FP8_BLOCK], const float *v) {
  float amax = 0.0f;
  for (int i = 0; i < MOE_FP8_BLOCK; i++) amax = moeI_fp8_amax(amax, v[i]);
  const float s = moeI_fp8_token_scale(amax);
  for (int i = 0; i < MOE_FP8_BLOCK; i++) q[i] = moeI_e4m3_to_f32(moeI_fp8_quantize(v[i], s));
  return s;
}

void moeI_mlp_fp8_token_qdq(float *v, int64_t n) {
  for (int64_t b = 0; b < n; b += MOE_FP8_BLOCK) {
    float q[MOE_FP8_BLOCK];
    const float s = moeI_mlp_fp8_token_block(q, v + b);
    for (int i = 0; i < MOE_FP8_BLOCK; i++) v[b + i] = q[i] * s;
  }
}

/* A thread is worth starting for ~1 M multiply-adds (moeI_parallel_for's grain, in rows). */
static int64_t rows_per_thread(int64_t macs_per_row) { return ((int64_t)1 << 20) / (macs_per_row > 0 ? macs_per_row : 1) + 1; }

void moeI_mlp_swiglu(float *const y[MLP_ROWS], const float *const x[MLP_ROWS], int nrows, const float *w_gate_up,
                const float *w_down, int64_t H, int64_t F, int h_mode, float *h) {
  swiglu_job J = {y, x, {0}, nrows, h_mode, w_gate_up, w_down, H, F, h};
  for (int r = 0; r < MLP_ROWS; r++) J.hr[r] = h + r * F;
  moeI_parallel_for(F, rows_per_thread(2 * H * nrows), swiglu_hidden, &J);
  if (h_mode == MLP_H_FP8) moeI_mlp_fp8_token_qdq(h, nrows * F);
  moeI_parallel_for(H, rows_per_thread(F * nrows), swiglu_out, &J);
}

/* ---- experts ---- */

int moeI_experts_cpu(moe_ctx *ctx, const moe_experts_args *a) {
  const int64_t C = a->x->shape[0], H = a->x->shape[1];
  const int64_t EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  const int32_t *off = a->offsets->data;
  const uint16_t *xs = a->x->data, *wgu = a->w_gate_up->data, *wd = a->w_down->data;
  uint16_t *ys = a->out->data;

  if (C == 0 || H == 0 || EL == 0) return moeI_ok(ctx); /* no row to write (F may then be up to 2^39) */
  /* f32 copies of one expert's weights, converted once per expert, and one row block */
  size_t nfloat = (size_t)(3 * F * H + MLP_ROWS * (2 * H + F));
  float *wf = malloc((nfloat ? nfloat : 1) * sizeof *wf);
  if (!wf) return moeI_seterr(ctx, MOE_ERR_NOMEM, "experts: out of host memory (%zu bytes of scratch)", nfloat * sizeof *wf);
  float *wguf = wf, *wdf = wguf + 2 * F * H, *xb = wdf + H * F, *yb = xb + MLP_ROWS * H, *hb = yb + MLP_ROWS * H;
  const float *xr[MLP_ROWS];
  float *yr[MLP_ROWS];
  for (int r = 0; r < MLP_ROWS; r++) xr[r] = xb + r * H, yr[r] = yb + r * H;

  int64_t lo = moeI_clamp_offset(off[0], C);
  for (int64_t e = 0; e < EL; e++) {
    const int64_t hi = moeI_expert_end(off, e, C, lo);
    if (hi > lo) {
      moeI_mlp_bf16_to_f32(wguf, wgu + e * 2 * F * H, 2 * F * H);
      moeI_mlp_bf16_to_f32(wdf, wd + e * H * F, H * F);
      for (int64_t row = lo; row < hi; row += MLP_ROWS) {
        int n = hi - row < MLP_ROWS ? (int)(hi - row) : MLP_ROWS;
        /* the block is read whole before any of it is written, so ys may be xs itself */
        moeI_mlp_bf16_to_f32(xb, xs + row * H, n * H);
        moeI_mlp_swiglu(yr, xr, n, wguf, wdf, H, F, MLP_H_BF16, hb);
        for (int64_t i = 0; i < n * H; i++) ys[row * H + i] = f32_to_bf16(yb[i]);
      }
    }
    lo = hi;
  }
  free(wf);
  return moeI_ok(ctx);
}

static int experts_check(moe_ctx *ctx, const moe_experts_args *a) {
  static const char *stage = "experts";
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "experts: args is NULL");
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_BF16, 2, NULL))) return rc;
  const int64_t C = a->x->shape[0], H = a->x->shape[1];
  const int64_t out_shape[] = {C, H};
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_BF16, 2, out_shape))) return rc;
  const int64_t gu_shape[] = {-1, -1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "w_gate_up", a->w_gate_up, MOE_BF16, 3, gu_shape))) return rc;
  const int64_t EL = a->w_gate_up->shape[0], F2 = a->w_gate_up->shape[1];
  if (F2 % 2) {
    char got[160];
    return moeI_seterr(ctx, MOE_ERR_ARG, "experts: w_gate_up must be bf16 [EL, 2F, %lld] (F gate rows, then F up rows), got %s",
                      (long long)H, moeI_tensor_describe(a->w_gate_up, got, sizeof got));
  }
  const int64_t down_shape[] = {EL, H, F2 / 2};
  if ((rc = moeI_check_tensor(ctx, stage, "w_down", a->w_down, MOE_BF16, 3, down_shape))) return rc;
  const int64_t off_shape[] = {EL + 1};
  if ((rc = moeI_check_tensor(ctx, stage, "offsets", a->offsets, MOE_I32, 1, off_shape))) return rc;
  const moe_tensor *ts[] = {a->out, a->x, a->offsets, a->w_gate_up, a->w_down};
  static const char *const names[] = {"out", "x", "offsets", "w_gate_up", "w_down"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", a->x->device, ts, names, 5))) return rc;
  /* out may be x itself (in place: every backend reads a row block of x before it writes that
   * block of out), but no other overlap */
  const int in_place = a->out->data == a->x->data; /* same shape: checked above; then x stands for out */
  return moeI_check_no_overlap(ctx, stage, ts + in_place, names + in_place, 1, 5 - in_place);
}

int moe_experts(moe_ctx *ctx, const moe_experts_args *a) {
  int rc = experts_check(ctx, a);
  if (rc) return rc;
  return MOE_IN_RANGE("experts", moeI_on_cpu(a->x) ? moeI_experts_cpu(ctx, a) : moeI_experts_cuda(ctx, a));
}

int moe_experts_explain(moe_ctx *ctx, const moe_experts_args *a, char *report, size_t n) {
  int rc = experts_check(ctx, a);
  if (rc) return rc;
  if ((rc = moeI_check_report(ctx, "experts", report, n))) return rc;
  if (moeI_on_cpu(a->x)) return moeI_explain_cpu(ctx, report, n);
  return moeI_experts_explain_cuda(ctx, a, report, n);
}

/* ---- router logits ---- */

int moeI_logits_cpu(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  const int64_t N = x->shape[0], H = x->shape[1], E = w->shape[0];
  if (N == 0 || E == 0) return moeI_ok(ctx); /* out is empty (the others may then be up to 2^40) */
  size_t nfloat = (size_t)(E * H + MLP_ROWS * H);
  float *wf = malloc((nfloat ? nfloat : 1) * sizeof *wf);
  if (!wf) return moeI_seterr(ctx, MOE_ERR_NOMEM, "logits: out of host memory (%zu bytes of scratch)", nfloat * sizeof *wf);
  float *xb = wf + E * H, *o = out->data;
  const uint16_t *xh = x->data;
  const float *xr[MLP_ROWS];
  for (int r = 0; r < MLP_ROWS; r++) xr[r] = xb + r * H;
  moeI_mlp_bf16_to_f32(wf, w->data, E * H);
  for (int64_t n0 = 0; n0 < N; n0 += MLP_ROWS) {
    int nr = N - n0 < MLP_ROWS ? (int)(N - n0) : MLP_ROWS;
    moeI_mlp_bf16_to_f32(xb, xh + n0 * H, nr * H);
    for (int64_t e = 0; e < E; e++) {
      float v[MLP_ROWS];
      moeI_mlp_dot_rows(v, wf + e * H, xr, nr, H);
      for (int r = 0; r < nr; r++) o[(n0 + r) * E + e] = v[r];
    }
  }
  free(wf);
  return moeI_ok(ctx);
}

const char *moeI_logits_paths(void) { return "tensor, exact"; }

int moeI_logits_tensor(const moe_ctx *ctx, const moe_tensor *x, const moe_tensor *w, int cc_major, char *report,
                       size_t n) {
  const int64_t H = x->shape[1];
  const char *option = moeI_config(ctx, MOEI_CFG_LOGITS);
  char why[160];
  /* the 16-byte copies of the tensor-core kernel: whole rows of 8 elements, aligned */
  if (strcmp(option, "exact") == 0)
    snprintf(why, sizeof why, "not chosen (the context's option logits is \"exact\")");
  else if (cc_major < 8)
    snprintf(why, sizeof why, "cannot take it: compute capability %d.x has no bf16 tensor cores (8.0 or later)",
             cc_major);
  else if (H % 8 != 0)
    snprintf(why, sizeof why, "cannot take it: H = %lld is not a multiple of 8", (long long)H);
  else if ((uintptr_t)x->data % 16 != 0 || (uintptr_t)w->data % 16 != 0)
    snprintf(why, sizeof why, "cannot take it: %s is not 16-byte aligned (a view at an odd offset)",
             (uintptr_t)x->data % 16 != 0 ? "x" : "w");
  else
    why[0] = '\0';
  const int tensor = why[0] == '\0';
  if (report && n > 0) {
    if (tensor)
      snprintf(report, n,
               "tensor\ntensor: runs (bf16 tensor-core products, f32 accumulation in a fixed order)\n"
               "exact: not needed\n");
    else
      snprintf(report, n, "exact\ntensor: %s\nexact: runs (f32 fused multiply-adds, the CPU's sums bit for bit)\n",
               why);
  }
  return tensor;
}

int moeI_logits_wgmma_tile(int64_t E) {
  static const int tiles[] = {64, 96, 128};
  int best = 0;
  int64_t best_waste = 0, best_off = 0;
  for (size_t i = 0; i < sizeof tiles / sizeof tiles[0]; i++) {
    const int64_t bn = tiles[i], waste = (E + bn - 1) / bn * bn - E, off = llabs((long long)(4 * bn - E));
    if (!best || waste < best_waste || (waste == best_waste && off < best_off))
      best = (int)bn, best_waste = waste, best_off = off;
  }
  return best;
}

/* The checks of moe_logits and moe_logits_explain; on a GPU also the context's option, which a
 * context may hold unchecked (a bad MOE_LOGITS is kept so that here it fails with the list). */
static int logits_check(moe_ctx *ctx, const moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  static const char *stage = "logits";
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", x, MOE_BF16, 2, NULL))) return rc;
  const int64_t N = x->shape[0], H = x->shape[1];
  const int64_t w_shape[] = {-1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "w", w, MOE_BF16, 2, w_shape))) return rc;
  const int64_t out_shape[] = {N, w->shape[0]};
  if ((rc = moeI_check_tensor(ctx, stage, "out", out, MOE_F32, 2, out_shape))) return rc;
  const moe_tensor *ts[] = {out, x, w};
  static const char *const names[] = {"out", "x", "w"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", x->device, ts, names, 3))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 3))) return rc;
  const char *option = moeI_config(ctx, MOEI_CFG_LOGITS);
  if (!moeI_on_cpu(x) && strcmp(option, "tensor") != 0 && strcmp(option, "exact") != 0)
    return moeI_seterr(ctx, MOE_ERR_ARG, "logits: the context's option logits must be tensor or exact, got \"%s\"",
                       option);
  return MOE_OK;
}

int moe_logits(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  int rc = logits_check(ctx, out, x, w);
  if (rc) return rc;
  return MOE_IN_RANGE("logits", moeI_on_cpu(x) ? moeI_logits_cpu(ctx, out, x, w) : moeI_logits_cuda(ctx, out, x, w));
}

int moe_logits_explain(moe_ctx *ctx, const moe_tensor *out, const moe_tensor *x, const moe_tensor *w, char *report,
                       size_t n) {
  int rc = logits_check(ctx, out, x, w);
  if (rc) return rc;
  if ((rc = moeI_check_report(ctx, "logits", report, n))) return rc;
  if (moeI_on_cpu(x)) return moeI_explain_cpu(ctx, report, n);
  return moeI_logits_explain_cuda(ctx, x, w, report, n);
}

/* ---- shared-expert gate ---- */

int moeI_sigmoid_gate_cpu(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  const int64_t T = x->shape[0], H = x->shape[1];
  size_t nfloat = (size_t)((1 + MLP_ROWS) * H);
  float *wf = malloc((nfloat ? nfloat : 1) * sizeof *wf);
  if (!wf) return moeI_seterr(ctx, MOE_ERR_NOMEM, "sigmoid_gate: out of host memory (%zu bytes of scratch)", nfloat * sizeof *wf);
  float *xb = wf + H, *o = g->data;
  const uint16_t *xh = x->data;
  const float *xr[MLP_ROWS];
  for (int r = 0; r < MLP_ROWS; r++) xr[r] = xb + r * H;
  moeI_mlp_bf16_to_f32(wf, w->data, H);
  for (int64_t t0 = 0; t0 < T; t0 += MLP_ROWS) {
    int nr = T - t0 < MLP_ROWS ? (int)(T - t0) : MLP_ROWS;
    float v[MLP_ROWS];
    moeI_mlp_bf16_to_f32(xb, xh + t0 * H, nr * H);
    moeI_mlp_dot_rows(v, wf, xr, nr, H);
    for (int r = 0; r < nr; r++) o[t0 + r] = mlp_sigmoid(v[r]);
  }
  free(wf);
  return moeI_ok(ctx);
}

int moe_sigmoid_gate(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  static const char *stage = "sigmoid_gate";
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", x, MOE_BF16, 2, NULL))) return rc;
  const int64_t w_shape[] = {x->shape[1]}, g_shape[] = {x->shape[0]};
  if ((rc = moeI_check_tensor(ctx, stage, "w", w, MOE_BF16, 1, w_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "g", g, MOE_F32, 1, g_shape))) return rc;
  const moe_tensor *ts[] = {g, x, w};
  static const char *const names[] = {"g", "x", "w"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", x->device, ts, names, 3))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 3))) return rc;
  return MOE_IN_RANGE(stage, moeI_on_cpu(x) ? moeI_sigmoid_gate_cpu(ctx, g, x, w)
                                           : moeI_sigmoid_gate_cuda(ctx, g, x, w));
}
