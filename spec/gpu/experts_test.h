/* SPDX-License-Identifier: MIT */
/* experts_test.h -- what test_experts_gpu and bench/experts_bench.c share: views, the comparison
 * with the CPU reference within bf16's tolerance, and a problem of the experts stage whose sampled
 * rows are checked against moeI_experts_cpu (the shapes too large for the CPU to run whole). */
#pragma once

#include <math.h>
#include <string.h>

#include "gpu_test.h"

static moe_tensor *view(moe_tensor *base, int64_t offset, int ndim, const int64_t *shape) {
  moe_tensor *t;
  TRY(moe_tensor_view(ctx, base, offset, ndim, shape, &t));
  return t;
}

/* got vs ref over [C, H]: rows in [lo, hi) finite and within the bf16 tolerance, every other row
 * untouched (NaN where ref is NaN, else the same bits). */
static void compare(const char *name, const uint16_t *got, const uint16_t *ref, int64_t C, int64_t H, int64_t lo,
                    int64_t hi) {
  double maxd = 0, maxr = 0, sd = 0, sr = 0;
  int64_t nonfinite = 0, strayed = 0, first_bad = -1;
  for (int64_t r = 0; r < C; r++)
    for (int64_t i = 0; i < H; i++) {
      const int64_t k = r * H + i;
      const float g = moe_bf16_to_f32(got[k]), f = moe_bf16_to_f32(ref[k]);
      if (r < lo || r >= hi) {
        if (isnan(f) ? !isnan(g) : got[k] != ref[k]) strayed++, first_bad = first_bad < 0 ? r : first_bad;
        continue;
      }
      if (!isfinite(g)) {
        nonfinite++, first_bad = first_bad < 0 ? r : first_bad;
        continue;
      }
      const double d = fabs((double)g - f);
      maxd = fmax(maxd, d), maxr = fmax(maxr, fabs(f));
      sd += d * d, sr += (double)f * f;
    }
  const double rel_max = maxr > 0 ? maxd / maxr : maxd, rel_l2 = sr > 0 ? sqrt(sd / sr) : sqrt(sd);
  const int ok = !nonfinite && !strayed && rel_max <= 2e-2 && rel_l2 <= 1e-2;
  char where[64] = "";
  if (first_bad >= 0) snprintf(where, sizeof where, ", first bad row %lld", (long long)first_bad);
  check(ok, "experts [%s]: rows [%lld, %lld) of %lld, max|d|/max|ref| = %.3e, rel L2 = %.3e, non-finite %lld, "
            "stray writes %lld%s",
        name, (long long)lo, (long long)hi, (long long)C, rel_max, rel_l2, (long long)nonfinite, (long long)strayed,
        where);
}

static void offsets_of(int32_t *off, const int *sizes, int EL, int pad) {
  off[0] = 0;
  for (int e = 0; e < EL; e++) off[e + 1] = off[e] + (sizes[e] + pad - 1) / pad * pad;
}


/* EL experts of sizes[e] rows (C = their sum), H, F, random inputs on the GPU; the CPU reference
 * of SPOT_R rows of SPOT_E experts (first, middle, last): first rows, both sides of the 128-row
 * tile boundary when there is one, last rows.  The rows of ys the stage writes are whole, so
 * sampled rows that match say that the tiles holding them were computed right. */
enum { SPOT_E = 3, SPOT_R = 6 };
typedef struct {
  int EL;
  int64_t C, H, F;
  int32_t *offsets; /* EL + 1 */
  moe_tensor *xs, *ys, *wgu, *wd, *off;
  moe_experts_args args; /* the stage on the GPU */
  int ex[SPOT_E];
  int64_t rows[SPOT_E][SPOT_R];
  moe_tensor *xs_c, *ref_c, *got_c, *off_c, *wgu_c, *wd_c;
} experts_problem;

static void experts_problem_new(experts_problem *p, int EL, const int *sizes, int64_t H, int64_t F) {
  memset(p, 0, sizeof *p);
  p->EL = EL, p->H = H, p->F = F;
  p->offsets = malloc((size_t)(EL + 1) * sizeof *p->offsets);
  if (!p->offsets) {
    printf("FAIL out of host memory\n");
    exit(1);
  }
  offsets_of(p->offsets, sizes, EL, 1);
  const int64_t C = p->C = p->offsets[EL];
  p->xs = NEW(MOE_BF16, GPU, C, H), p->ys = NEW(MOE_BF16, GPU, C, H);
  p->wgu = NEW(MOE_BF16, GPU, EL, 2 * F, H), p->wd = NEW(MOE_BF16, GPU, EL, H, F), p->off = NEW(MOE_I32, GPU, EL + 1);
  TRY(moe_tensor_randn(ctx, p->xs, 11, 1.0f));
  TRY(moe_tensor_randn(ctx, p->wgu, 12, (float)(1 / sqrt((double)H))));
  TRY(moe_tensor_randn(ctx, p->wd, 13, (float)(1 / sqrt((double)F))));
  TRY(moe_tensor_write(ctx, p->off, p->offsets, (size_t)(EL + 1) * sizeof *p->offsets));
  p->args = (moe_experts_args){.out = p->ys, .x = p->xs, .offsets = p->off, .w_gate_up = p->wgu,
                               .w_down = p->wd};

  const int ex[SPOT_E] = {0, EL / 2, EL - 1};
  for (int i = 0; i < SPOT_E; i++) {
    const int n = sizes[ex[i]];
    const int64_t local[SPOT_R] = {0, 1, n > 129 ? 127 : 2, n > 129 ? 128 : 3, n - 2, n - 1};
    p->ex[i] = ex[i];
    for (int j = 0; j < SPOT_R; j++)
      p->rows[i][j] = p->offsets[ex[i]] + (local[j] < 0 ? 0 : local[j] >= n ? n - 1 : local[j]);
  }
  const int64_t R = SPOT_E * SPOT_R;
  p->xs_c = NEW(MOE_BF16, CPU, R, H), p->ref_c = NEW(MOE_BF16, CPU, R, H);
  p->got_c = NEW(MOE_BF16, CPU, R, H), p->off_c = NEW(MOE_I32, CPU, SPOT_E + 1);
  p->wgu_c = NEW(MOE_BF16, CPU, SPOT_E, 2 * F, H), p->wd_c = NEW(MOE_BF16, CPU, SPOT_E, H, F);
  int32_t oc[SPOT_E + 1];
  for (int i = 0; i < SPOT_E; i++) {
    for (int j = 0; j < SPOT_R; j++) {
      moe_tensor *src = view(p->xs, p->rows[i][j] * H, 1, SHAPE(H));
      moe_tensor *d = view(p->xs_c, (int64_t)(i * SPOT_R + j) * H, 1, SHAPE(H));
      TRY(moe_tensor_copy(ctx, d, src));
      moe_tensor_free(src), moe_tensor_free(d);
    }
    const int e = ex[i];
    moe_tensor *wsrc = view(p->wgu, (int64_t)e * 2 * F * H, 3, SHAPE(1, 2 * F, H));
    moe_tensor *wdst = view(p->wgu_c, (int64_t)i * 2 * F * H, 3, SHAPE(1, 2 * F, H));
    moe_tensor *dsrc = view(p->wd, (int64_t)e * H * F, 3, SHAPE(1, H, F));
    moe_tensor *ddst = view(p->wd_c, (int64_t)i * H * F, 3, SHAPE(1, H, F));
    TRY(moe_tensor_copy(ctx, wdst, wsrc));
    TRY(moe_tensor_copy(ctx, ddst, dsrc));
    moe_tensor_free(wsrc), moe_tensor_free(wdst), moe_tensor_free(dsrc), moe_tensor_free(ddst);
    oc[i] = i * SPOT_R;
  }
  oc[SPOT_E] = SPOT_E * SPOT_R;
  TRY(moe_tensor_write(ctx, p->off_c, oc, sizeof oc));
  moe_experts_args r = {.out = p->ref_c, .x = p->xs_c, .offsets = p->off_c, .w_gate_up = p->wgu_c,
                        .w_down = p->wd_c};
  TRY(moe_experts(ctx, &r));
}

/* The sampled rows of ys (after a run of the stage through kernel, on the context's stream) against
 * the CPU: one PASS/FAIL line; returns nonzero when they match. */
static int experts_problem_check(experts_problem *p, const char *label, const char *kernel) {
  const int before = failures;
  TRY(moe_ctx_synchronize(ctx, GPU));
  const int64_t H = p->H;
  for (int i = 0; i < SPOT_E; i++)
    for (int j = 0; j < SPOT_R; j++) {
      moe_tensor *src = view(p->ys, p->rows[i][j] * H, 1, SHAPE(H));
      moe_tensor *d = view(p->got_c, (int64_t)(i * SPOT_R + j) * H, 1, SHAPE(H));
      TRY(moe_tensor_copy(ctx, d, src));
      moe_tensor_free(src), moe_tensor_free(d);
    }
  char name[256];
  snprintf(name, sizeof name, "%s, %d rows of experts %d, %d, %d vs CPU] [%s", label, SPOT_E * SPOT_R, p->ex[0],
           p->ex[1], p->ex[2], kernel);
  compare(name, moe_tensor_data(p->got_c), moe_tensor_data(p->ref_c), SPOT_E * SPOT_R, H, 0, SPOT_E * SPOT_R);
  return failures == before;
}

static void experts_problem_free(experts_problem *p) {
  moe_tensor *ts[] = {p->xs, p->ys, p->wgu, p->wd, p->off, p->xs_c, p->ref_c, p->got_c, p->off_c, p->wgu_c, p->wd_c};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) moe_tensor_free(ts[i]);
  free(p->offsets);
}
