/* SPDX-License-Identifier: MIT */
/* experts_fp8_bench.c -- the FP8 experts kernel (kernels/experts/fp8.cu) checked against a plain C
 * computation of the format (docs/design.md, "FP8"), then timed.
 *
 *   build/bench/experts_fp8_bench [PASSES [CASE]]
 *
 * Cases: 0 adversarial (6 experts of 0, 1, 300, 7, 0, 129 rows, 3 capacity rows past the last, H
 * 256, F 128, a weight block of zeros), 1 one expert of 1,000 rows, 2 every row to the last of 3
 * experts, 3 Kimi K2's rank of EP8 (48 experts x 1,195 / 1,194 rows, H 7168, F 2048), 4-6 its decode
 * (48 x 8, 24 and 64 rows; 24 is about a rank's average at 128 tokens a rank), 7-9 the same shape
 * with 32, 128 and 96 rows an expert (around where fp8.cu's choice moves from the narrow tiles to
 * sm90t_fp8); all by default.
 * Tokens are normal draws, every 7th row scaled by 100, quantized per token (cases 3-9:
 * TOKEN_POOL distinct rows, copied to the rest); weights normal / sqrt(K),
 * quantized per 128 x 128 (three distinct experts, copied to the rest: the time does not depend on
 * which values, only on their kind).  Rows checked: all of cases 0-2, six of every 7th expert in
 * 3-9 (their references on the CPU's threads), against this file's own model of the format (block
 * sums of exact e4m3 products in f32, SwiGLU, h rounded to bf16 and quantized per token); PASS when
 * no element is off by more than 6% of its row's largest |ref| (the e4m3 rounding of h flips where
 * the GPU's and the CPU's f32 sums differ: docs/design.md, "FP8 tolerance"), with the RMS error
 * printed, and a hash of the whole output (FNV-1a over its bytes, so that two builds meant to agree
 * bit for bit can be compared).  Rows past the experts must keep their poison.  Cases 3-9 are then
 * timed: 2 warm-ups and PASSES (30) back-to-back calls, device events, the median.  Calls the
 * kernel's entry (moeI_experts_fp8_cuda) directly, linked with the library's objects.  Exit status
 * 1 when a check fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_math.h"
#include "internal.h"
#include "moelab.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float randn(void) {
  double u = 0;
  for (int j = 0; j < 4; j++) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    u += (double)(rng >> 40) / (double)(1ull << 24);
  }
  return (float)((u - 2.0) * sqrt(3.0));
}
static float bf16r(float x) { return moe_bf16_to_f32(moe_f32_to_bf16(x)); }

/* w [R, K] f32 -> q, s [R/128, K/128] (block) */
static void quant_block(const float *w, int R, int K, uint8_t *q, float *s) {
  for (int br = 0; br < R / 128; br++)
    for (int bk = 0; bk < K / 128; bk++) {
      float amax = 0;
      for (int r = 0; r < 128; r++)
        for (int k = 0; k < 128; k++) amax = moeI_fp8_amax(amax, w[(size_t)(br * 128 + r) * K + bk * 128 + k]);
      float sc = moeI_fp8_weight_scale(amax);
      s[br * (K / 128) + bk] = sc;
      for (int r = 0; r < 128; r++)
        for (int k = 0; k < 128; k++) {
          size_t i = (size_t)(br * 128 + r) * K + bk * 128 + k;
          q[i] = moeI_fp8_quantize(w[i], sc);
        }
    }
}
/* one row x [K] -> q [K], s[K/128] */
static void quant_row(const float *x, int K, uint8_t *q, float *s) {
  for (int b = 0; b < K / 128; b++) {
    float amax = 0;
    for (int k = 0; k < 128; k++) amax = moeI_fp8_amax(amax, x[b * 128 + k]);
    s[b] = moeI_fp8_token_scale(amax);
    for (int k = 0; k < 128; k++) q[b * 128 + k] = moeI_fp8_quantize(x[b * 128 + k], s[b]);
  }
}

/* y[n] = sum_kb (sum_k qa qw) * (sa * sw) for one weight row */
static float dot8(const uint8_t *qa, const float *sa, const uint8_t *qw, const float *sw, int K) {
  float acc = 0;
  for (int b = 0; b < K / 128; b++) {
    float s = 0;
    for (int k = 0; k < 128; k++) s += moeI_e4m3_to_f32(qa[b * 128 + k]) * moeI_e4m3_to_f32(qw[b * 128 + k]);
    acc += s * (sa[b] * sw[b]);
  }
  return acc;
}

typedef struct {
  int EL, H, F, C;
  int *sizes;
  uint8_t *xq, *wgu, *wdn;
  float *xs_t, *sgu, *sdn; /* xs_t [H/128, C] */
} problem;

/* expert e's output row for xs row c */
static void ref_row(const problem *p, int e, int c, float *y) {
  const int H = p->H, F = p->F, KH = H / 128, KF = F / 128;
  float *sa = malloc(sizeof(float) * KH), *h = malloc(sizeof(float) * F), *hs = malloc(sizeof(float) * KF);
  uint8_t *hq = malloc(F);
  for (int b = 0; b < KH; b++) sa[b] = p->xs_t[(size_t)b * p->C + c];
  const uint8_t *xr = p->xq + (size_t)c * H;
  const uint8_t *wg = p->wgu + (size_t)e * 2 * F * H;
  const float *sg = p->sgu + (size_t)e * (2 * F / 128) * KH;
  float *swr = malloc(sizeof(float) * (KH > KF ? KH : KF));
  for (int f = 0; f < F; f++) {
    for (int b = 0; b < KH; b++) swr[b] = sg[(f / 128) * KH + b];
    float g = dot8(xr, sa, wg + (size_t)f * H, swr, H);
    for (int b = 0; b < KH; b++) swr[b] = sg[((F + f) / 128) * KH + b];
    float u = dot8(xr, sa, wg + (size_t)(F + f) * H, swr, H);
    h[f] = bf16r(g / (1.0f + expf(-g)) * u);
  }
  quant_row(h, F, hq, hs);
  const uint8_t *wd = p->wdn + (size_t)e * H * F;
  const float *sd = p->sdn + (size_t)e * (H / 128) * KF;
  for (int o = 0; o < H; o++) {
    for (int b = 0; b < KF; b++) swr[b] = sd[(o / 128) * KF + b];
    y[o] = dot8(hq, hs, wd + (size_t)o * F, swr, F);
  }
  free(sa), free(h), free(hs), free(hq), free(swr);
}

static moe_tensor *dev_tensor(moe_ctx *ctx, moe_dtype dt, int nd, int64_t a, int64_t b, int64_t c, const void *host,
                              size_t bytes) {
  int64_t shape[3] = {a, b, c};
  moe_tensor *t;
  moe_device d = {MOE_CUDA, 0};
  if (moe_tensor_new(ctx, dt, nd, shape, d, &t)) {
    fprintf(stderr, "new: %s\n", moe_errmsg(ctx));
    exit(1);
  }
  if (host && moe_tensor_write(ctx, t, host, bytes)) {
    fprintf(stderr, "write: %s\n", moe_errmsg(ctx));
    exit(1);
  }
  return t;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

enum { TOKEN_POOL = 256 }; /* distinct token rows where not every row is checked */

/* the reference rows of the checked (e, c) pairs, refs [n][H], on the CPU's threads */
typedef struct {
  const problem *p;
  const int *e, *c;
  float *refs;
} ref_job;
static void ref_rows(void *arg, int64_t begin, int64_t end) {
  const ref_job *j = arg;
  for (int64_t i = begin; i < end; i++) ref_row(j->p, j->e[i], j->c[i], j->refs + (size_t)i * j->p->H);
}

/* replicate: one expert's weights drawn, the others copies (the timing does not depend on values) */
static int run(const char *label, int EL, const int *sizes, int H, int F, int extra, int passes, int full) {
  problem p = {.EL = EL, .H = H, .F = F, .sizes = (int *)sizes};
  int C = extra;
  for (int e = 0; e < EL; e++) C += sizes[e];
  p.C = C;
  const int KH = H / 128, KF = F / 128;
  size_t ngu = (size_t)2 * F * H, ndn = (size_t)H * F;
  float *w = malloc(sizeof(float) * (ngu > ndn ? ngu : ndn));
  p.wgu = malloc(ngu * EL), p.wdn = malloc(ndn * EL);
  p.sgu = malloc(sizeof(float) * (2 * F / 128) * KH * EL), p.sdn = malloc(sizeof(float) * KH * KF * EL);
  int distinct = EL < 3 ? EL : 3;
  for (int e = 0; e < EL; e++) {
    if (e < distinct) {
      for (size_t i = 0; i < ngu; i++) w[i] = randn() / sqrtf((float)H);
      if (e == 1) for (int r = 0; r < 128; r++) for (int k = 0; k < 128; k++) w[(size_t)r * H + k] = 0; /* a zero block */
      quant_block(w, 2 * F, H, p.wgu + ngu * e, p.sgu + (size_t)(2 * F / 128) * KH * e);
      for (size_t i = 0; i < ndn; i++) w[i] = randn() / sqrtf((float)F);
      quant_block(w, H, F, p.wdn + ndn * e, p.sdn + (size_t)KH * KF * e);
    } else {
      int s = e % distinct;
      memcpy(p.wgu + ngu * e, p.wgu + ngu * s, ngu);
      memcpy(p.wdn + ndn * e, p.wdn + ndn * s, ndn);
      memcpy(p.sgu + (size_t)(2 * F / 128) * KH * e, p.sgu + (size_t)(2 * F / 128) * KH * s, sizeof(float) * (2 * F / 128) * KH);
      memcpy(p.sdn + (size_t)KH * KF * e, p.sdn + (size_t)KH * KF * s, sizeof(float) * KH * KF);
    }
  }
  p.xq = malloc((size_t)C * H);
  p.xs_t = malloc(sizeof(float) * KH * (size_t)C);
  float *xr = malloc(sizeof(float) * H), *sr = malloc(sizeof(float) * KH);
  const int drawn = full || C < TOKEN_POOL ? C : TOKEN_POOL;
  for (int c = 0; c < C; c++) {
    if (c < drawn) {
      for (int k = 0; k < H; k++) xr[k] = randn() * (c % 7 == 3 ? 100.f : 1.f);
      quant_row(xr, H, p.xq + (size_t)c * H, sr);
    } else {
      const int from = c % drawn;
      memcpy(p.xq + (size_t)c * H, p.xq + (size_t)from * H, H);
      for (int b = 0; b < KH; b++) sr[b] = p.xs_t[(size_t)b * C + from];
    }
    for (int b = 0; b < KH; b++) p.xs_t[(size_t)b * C + c] = sr[b];
  }
  int *off = malloc(sizeof(int) * (EL + 1));
  off[0] = 0;
  for (int e = 0; e < EL; e++) off[e + 1] = off[e] + sizes[e];

  moe_ctx *ctx;
  moe_ctx_open(&ctx);
  moe_tensor *tx = dev_tensor(ctx, MOE_E4M3, 2, C, H, 0, p.xq, (size_t)C * H);
  moe_tensor *ts = dev_tensor(ctx, MOE_F32, 2, KH, C, 0, p.xs_t, sizeof(float) * KH * (size_t)C);
  moe_tensor *to = dev_tensor(ctx, MOE_I32, 1, EL + 1, 0, 0, off, sizeof(int) * (EL + 1));
  moe_tensor *tg = dev_tensor(ctx, MOE_E4M3, 3, EL, 2 * F, H, p.wgu, ngu * EL);
  moe_tensor *tgs = dev_tensor(ctx, MOE_F32, 3, EL, 2 * F / 128, KH, p.sgu, sizeof(float) * (2 * F / 128) * KH * EL);
  moe_tensor *td = dev_tensor(ctx, MOE_E4M3, 3, EL, H, F, p.wdn, ndn * EL);
  moe_tensor *tds = dev_tensor(ctx, MOE_F32, 3, EL, KH, KF, p.sdn, sizeof(float) * KH * KF * EL);
  moe_tensor *ty = dev_tensor(ctx, MOE_BF16, 2, C, H, 0, NULL, 0);
  moe_tensor_fill(ctx, ty, 12345.0);
  moe_experts_fp8_args a = {ty, tx, ts, to, tg, tgs, td, tds};
  if (moeI_experts_fp8_cuda(ctx, &a) || moe_ctx_synchronize(ctx, (moe_device){MOE_CUDA, 0})) {
    printf("FAIL %s: %s\n", label, moe_errmsg(ctx));
    return 1;
  }
  uint16_t *y = malloc((size_t)C * H * 2);
  moe_tensor_read(ctx, ty, y, (size_t)C * H * 2);
  const size_t most = (size_t)C + 6 * (size_t)EL; /* every row (full), or six an expert */
  int *pe = malloc(sizeof(int) * most), *pc = malloc(sizeof(int) * most), *pr = malloc(sizeof(int) * most);
  int picked = 0;
  for (int e = 0; e < EL; e++) {
    int n = sizes[e];
    int picks[6] = {0, 1, n / 2, n - 2, n - 1, 127};
    for (int i = 0; i < (full ? n : 6); i++) {
      int r = full ? i : picks[i];
      if (r < 0 || r >= n) continue;
      if (!full && e % 7 != 0 && e != EL - 1) continue;
      pe[picked] = e, pr[picked] = r, pc[picked] = off[e] + r, picked++;
    }
  }
  float *refs = malloc(sizeof(float) * H * (size_t)(picked ? picked : 1));
  ref_job job = {&p, pe, pc, refs};
  moeI_parallel_for(picked, 1, ref_rows, &job);
  double worst = 0, se = 0, sq = 0;
  int bad = 0;
  for (int i = 0; i < picked; i++) {
    const int e = pe[i], r = pr[i], c = pc[i];
    const float *ref = refs + (size_t)i * H;
    float mx = 0;
    for (int o = 0; o < H; o++) mx = fmaxf(mx, fabsf(ref[o]));
    for (int o = 0; o < H; o++) {
      float g = moe_bf16_to_f32(y[(size_t)c * H + o]);
      double err = fabs(g - ref[o]) / (mx > 0 ? mx : 1);
      se += (double)(g - ref[o]) * (g - ref[o]) / ((double)mx * mx + 1e-30), sq += (double)ref[o] * ref[o] / ((double)mx * mx + 1e-30);
      if (!(err <= 0.06)) {
        if (bad < 5) printf("  mismatch e %d row %d col %d: gpu %g ref %g (row max %g)\n", e, r, o, g, ref[o], mx);
        bad++;
      }
      if (err > worst || err != err) worst = err;
    }
  }
  int untouched = 1;
  for (int c = off[EL]; c < C; c++)
    for (int o = 0; o < H; o++) untouched &= y[(size_t)c * H + o] == moe_f32_to_bf16(12345.0f);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < (size_t)C * H; i++) {
    hash = (hash ^ (y[i] & 0xFFu)) * 0x100000001b3ull;
    hash = (hash ^ (y[i] >> 8)) * 0x100000001b3ull;
  }
  printf("%s %s: %d rows checked, worst |gpu - ref| / row max = %.3g, %d beyond 0.06, rms err / rms ref = %.3g; tail rows untouched: %s; out fnv1a %016llx\n",
         bad || !untouched ? "FAIL" : "PASS", label, picked, worst, bad, sqrt(se / (sq + 1e-30)), untouched ? "yes" : "NO",
         (unsigned long long)hash);
  if (passes > 0) {
    moe_event *ev[2];
    moe_device d = {MOE_CUDA, 0};
    moe_event_new(ctx, d, &ev[0]), moe_event_new(ctx, d, &ev[1]);
    float *ms = malloc(sizeof(float) * passes);
    for (int i = 0; i < 2; i++) moeI_experts_fp8_cuda(ctx, &a);
    for (int i = 0; i < passes; i++) {
      moe_event_record(ctx, ev[0]);
      moeI_experts_fp8_cuda(ctx, &a);
      moe_event_record(ctx, ev[1]);
      moe_event_elapsed(ctx, ev[0], ev[1], &ms[i]);
    }
    qsort(ms, passes, sizeof *ms, cmp_float);
    double rows = off[EL], med = ms[passes / 2];
    printf("TIME %s: median %.3f ms (min %.3f max %.3f) = %.1f TFLOP/s, %.0f GB/s of weights\n", label, med, ms[0],
           ms[passes - 1], rows * 6.0 * H * F / (med * 1e9), (double)EL * 3 * H * F / (med * 1e6));
  }
  return bad || !untouched;
}

/* Case *which (counted in order) runs unless another one was asked for. */
static int wanted(int only, int *which) { return only < 0 || only == (*which)++; }

int main(int argc, char **argv) {
  int passes = argc > 1 ? atoi(argv[1]) : 30;
  const int only = argc > 2 ? atoi(argv[2]) : -1;
  int rc = 0, which = 0;
  int s1[] = {0, 1, 300, 7, 0, 129};
  rc |= wanted(only, &which) && run("adversarial EL 6 H 256 F 128 (+3 tail rows)", 6, s1, 256, 128, 3, 0, 1);
  int s2[] = {1000};
  rc |= wanted(only, &which) && run("one expert 1000 rows H 384 F 256", 1, s2, 384, 256, 1, 0, 1);
  int s3[] = {0, 0, 513};
  rc |= wanted(only, &which) && run("all rows to the last expert, H 1024 F 384", 3, s3, 1024, 384, 0, 0, 1);
  int kimi[48], dec[48], dec24[48], dec64[48], dec32[48], mid128[48], mid96[48];
  for (int e = 0; e < 48; e++)
    kimi[e] = e < 32 ? 1195 : 1194, dec[e] = 8, dec24[e] = 24, dec64[e] = 64, dec32[e] = 32, mid128[e] = 128,
    mid96[e] = 96;
  rc |= wanted(only, &which) && run("Kimi K2 rank of EP8 (EL 48, 57344 rows, H 7168, F 2048)", 48, kimi, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("decode 48 x 8 rows", 48, dec, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("decode 48 x 24 rows", 48, dec24, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("decode 48 x 64 rows", 48, dec64, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("48 x 32 rows", 48, dec32, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("48 x 128 rows", 48, mid128, 7168, 2048, 0, passes, 0);
  rc |= wanted(only, &which) && run("48 x 96 rows", 48, mid96, 7168, 2048, 0, passes, 0);
  return rc;
}
