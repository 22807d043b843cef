/* SPDX-License-Identifier: MIT */
/* dispatch_test.h -- what test_route_dispatch_combine and bench/dispatch_combine_bench.c share:
 * tensors copied, the bit-for-bit comparison with the CPU reference, random routings
 * and their schedules on the CPU. */
#pragma once

#include <math.h>
#include <string.h>

#include "gpu_test.h"

/* A tensor like t (dtype, shape) on dev, holding t's values. */
static moe_tensor *copy_to(const moe_tensor *t, moe_device dev) {
  int64_t shape[4];
  for (int i = 0; i < moe_tensor_ndim(t); i++) shape[i] = moe_tensor_dim(t, i);
  moe_tensor *c = tnew(moe_tensor_dtype(t), dev, moe_tensor_ndim(t), shape);
  TRY(moe_tensor_copy(ctx, c, t));
  return c;
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    printf("FAIL out of host memory\n");
    exit(1);
  }
  return p;
}

static float value_at(const moe_tensor *t, const void *data, int64_t i) {
  if (moe_tensor_dtype(t) == MOE_BF16) return moe_bf16_to_f32(((const uint16_t *)data)[i]);
  if (moe_tensor_dtype(t) == MOE_I32) return (float)((const int32_t *)data)[i];
  return ((const float *)data)[i];
}

/* The comparison of a GPU tensor with its CPU reference. */
typedef struct {
  int64_t differ;  /* elements whose bits differ */
  int64_t first;   /* the first of them, or -1 */
  double rel_max;  /* max |got - ref| / max |ref| over finite values */
  int64_t nan_mismatch; /* NaN in one and not the other */
} cmp_t;

static cmp_t compare(const moe_tensor *gpu, const moe_tensor *ref) {
  cmp_t c = {0, -1, 0.0, 0};
  const size_t nb = moe_tensor_nbytes(ref), es = moe_dtype_size(moe_tensor_dtype(ref));
  unsigned char *got = xmalloc(nb);
  TRY(moe_tensor_read(ctx, gpu, got, nb));
  const unsigned char *want = moe_tensor_data((moe_tensor *)ref);
  const int64_t n = moe_tensor_numel(ref);
  double maxref = 0.0, maxdiff = 0.0;
  for (int64_t i = 0; i < n; i++) {
    if (memcmp(got + i * es, want + i * es, es)) {
      if (c.first < 0) c.first = i;
      c.differ++;
    }
    if (moe_tensor_dtype(ref) == MOE_I32) continue;
    double g = value_at(ref, got, i), w = value_at(ref, want, i);
    if (isnan(g) != isnan(w)) c.nan_mismatch++;
    if (isfinite(w)) maxref = fmax(maxref, fabs(w));
    if (isfinite(g) && isfinite(w)) maxdiff = fmax(maxdiff, fabs(g - w));
  }
  c.rel_max = maxref > 0 ? maxdiff / maxref : maxdiff;
  free(got);
  return c;
}

/* Prints a PASS/FAIL line; exact: every element's bits must match, else rel_max <= tol. */
static void expect(const char *name, const moe_tensor *gpu, const moe_tensor *ref, int exact, double tol) {
  cmp_t c = compare(gpu, ref);
  int ok = c.nan_mismatch == 0 && (exact ? c.differ == 0 : c.rel_max <= tol);
  if (c.first >= 0) {
    const size_t es = moe_dtype_size(moe_tensor_dtype(ref));
    unsigned char g[4] = {0};
    /* read back the first differing element for the message */
    unsigned char *all = xmalloc(moe_tensor_nbytes(ref));
    TRY(moe_tensor_read(ctx, gpu, all, moe_tensor_nbytes(ref)));
    memcpy(g, all + c.first * es, es);
    free(all);
    check(ok, "%s: %lld of %lld elements differ in their bits (first [%lld]: got %.9g, want %.9g), max rel err %.3e%s",
          name, (long long)c.differ, (long long)moe_tensor_numel(ref), (long long)c.first,
          (double)value_at(ref, g, 0), (double)value_at(ref, moe_tensor_data((moe_tensor *)ref), c.first), c.rel_max,
          c.nan_mismatch ? ", NaN where the CPU has none or the reverse" : "");
  } else {
    check(ok, "%s: all %lld elements bit for bit, max rel err %.3e", name, (long long)moe_tensor_numel(ref), c.rel_max);
  }
}

/* Random ids i32 [W, T, K] in [0, E), a few masked (-1) and a few invalid. */
static moe_tensor *random_ids(int W, int T, int K, int E, unsigned seed, int holes) {
  moe_tensor *ids = NEW(MOE_I32, CPU, W, T, K);
  int32_t *p = moe_tensor_data(ids);
  srand(seed);
  for (int64_t i = 0; i < (int64_t)W * T * K; i++) p[i] = rand() % E;
  /* distinct experts per token are not required by the stages */
  if (holes)
    for (int64_t i = 5; i < (int64_t)W * T * K; i += 37) p[i] = (i % 3 == 0) ? E + 3 : -1;
  return ids;
}

typedef struct {
  moe_tensor *peer_rank, *peer_route, *counts, *tpe, *offsets, *route_row, *stats;
  int64_t C;
} sched_t;

static sched_t schedule(const moe_tensor *ids, int E, int rank, int pad, int64_t C) {
  const int64_t W = moe_tensor_dim(ids, 0), TK = moe_tensor_dim(ids, 1) * moe_tensor_dim(ids, 2), EL = E / W;
  sched_t s = {NEW(MOE_I32, CPU, C), NEW(MOE_I32, CPU, C), NEW(MOE_I32, CPU, EL), NEW(MOE_I32, CPU, EL),
               NEW(MOE_I32, CPU, EL + 1), NEW(MOE_I32, CPU, W, TK), NEW(MOE_I32, CPU, MOE_SCHED_STATS), C};
  moe_schedule_args a = {.peer_rank = s.peer_rank, .peer_route = s.peer_route, .counts = s.counts,
                         .tokens_per_expert = s.tpe, .expert_offsets = s.offsets, .route_row = s.route_row,
                         .stats = s.stats, .ids = ids, .experts = E, .rank = rank, .pad = pad, .capacity = (int)C,
                         .expert_capacity = -1, .layout = MOE_LAYOUT_ROUNDROBIN};
  TRY(moe_schedule(ctx, &a));
  return s;
}

static void sched_free(sched_t *s) {
  moe_tensor *all[] = {s->peer_rank, s->peer_route, s->counts, s->tpe, s->offsets, s->route_row, s->stats};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
}
