/* SPDX-License-Identifier: MIT */
/* combine.c -- stage 5: each token of the source rank gathers its routes' expert outputs from
 * their owners, weighted, in ascending k, plus the shared expert. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The accumulation order is the contract that makes combine deterministic on every backend:
 * acc starts at +0, then acc += w[t,k] * ys (one f32 multiply, one f32 add) for k ascending,
 * then acc += g[t] * shared[t], and out is rounded once.  Routes whose id, owner row or row
 * index do not name a row are skipped: they are masked, dropped or invalid, and were counted
 * by the schedule. */
int moeI_combine_cpu(moe_ctx *ctx, const moe_combine_args *a) {
  const int64_t T = a->weights->shape[0], K = a->weights->shape[1], H = a->out->shape[1];
  const int64_t W = a->world, E = a->experts, EL = E / W, TK = T * K;
  const float *w = a->weights->data, *gate = a->shared_gate ? a->shared_gate->data : NULL;
  const int32_t *ids = a->ids->data;
  const uint16_t *shared = a->shared ? a->shared->data : NULL;
  if (T == 0 || H == 0) return moeI_ok(ctx); /* nothing to write (T may be up to 2^40 when H is 0) */
  float *acc = malloc((size_t)H * sizeof *acc);
  if (!acc) return moeI_seterr(ctx, MOE_ERR_NOMEM, "combine: out of host memory");
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
      const int64_t id = ids[t * K + k];
      if (id < 0 || id >= E) continue;
      const int64_t o = id / EL;
      const int64_t row = ((const int32_t *)a->route_row[o]->data)[a->rank * TK + t * K + k];
      if (row < 0 || row >= a->ys[o]->shape[0]) continue;
      const float wk = w[t * K + k];
      const uint16_t *y = (const uint16_t *)a->ys[o]->data + row * H;
      for (int64_t h = 0; h < H; h++) acc[h] += wk * bf16_to_f32(y[h]);
    }
    if (shared) {
      const float g = gate ? gate[t] : 1.0f;
      const uint16_t *s = shared + t * H;
      for (int64_t h = 0; h < H; h++) acc[h] += g * bf16_to_f32(s[h]);
    }
    if (a->out->dtype == MOE_F32) {
      memcpy((float *)a->out->data + t * H, acc, (size_t)H * sizeof *acc);
    } else {
      uint16_t *o = (uint16_t *)a->out->data + t * H;
      for (int64_t h = 0; h < H; h++) o[h] = f32_to_bf16(acc[h]);
    }
  }
  free(acc);
  return moeI_ok(ctx);
}

int moe_combine(moe_ctx *ctx, const moe_combine_args *a) {
  static const char *stage = "combine";
  char what[32], got[160];
  int rc;
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "combine: args is NULL");
  /* ids (the schedule's) first, so that weights of the wrong shape is named as such */
  if ((rc = moeI_check_tensor(ctx, stage, "ids", a->ids, MOE_I32, 2, NULL))) return rc;
  const int64_t T = a->ids->shape[0], K = a->ids->shape[1];
  const int64_t tk_shape[] = {T, K};
  if ((rc = moeI_check_tensor(ctx, stage, "weights", a->weights, MOE_F32, 2, tk_shape))) return rc;
  if (a->world < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "combine: world must be >= 1, got %d", a->world);
  if (a->experts < 1 || a->experts % a->world)
    return moeI_seterr(ctx, MOE_ERR_ARG, "combine: experts must be a positive multiple of world (%d), got %d", a->world,
                      a->experts);
  if (a->rank < 0 || a->rank >= a->world)
    return moeI_seterr(ctx, MOE_ERR_ARG, "combine: rank must be in [0, %d), got %d", a->world, a->rank);
  if (!a->ys || !a->route_row)
    return moeI_seterr(ctx, MOE_ERR_ARG, "combine: ys and route_row must be arrays of world (%d) tensors, got NULL",
                      a->world);
  if ((rc = moeI_check_tensor(ctx, stage, "ys of rank 0", a->ys[0], MOE_BF16, 2, NULL))) return rc;
  const int64_t H = a->ys[0]->shape[1];
  const int64_t ys_shape[] = {-1, H}, rr_shape[] = {a->world, T * K}, th_shape[] = {T, H}, t_shape[] = {T};
  const moe_device dev = a->weights->device;
  for (int o = 0; o < a->world; o++) {
    snprintf(what, sizeof what, "ys of rank %d", o);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->ys[o], MOE_BF16, 2, ys_shape))) return rc;
    snprintf(what, sizeof what, "route_row of rank %d", o);
    if ((rc = moeI_check_tensor(ctx, stage, what, a->route_row[o], MOE_I32, 2, rr_shape))) return rc;
  }
  if ((rc = moeI_check_same_device_list(ctx, stage, "weights", dev, a->ys, a->world, "ys")) ||
      (rc = moeI_check_same_device_list(ctx, stage, "weights", dev, a->route_row, a->world, "route_row")))
    return rc;
  if (!a->out || (a->out->dtype != MOE_BF16 && a->out->dtype != MOE_F32) || a->out->ndim != 2 ||
      a->out->shape[0] != T || a->out->shape[1] != H)
    return moeI_seterr(ctx, MOE_ERR_ARG, "combine: out must be bf16 or f32 [%lld, %lld], got %s", (long long)T,
                      (long long)H, moeI_tensor_describe(a->out, got, sizeof got));
  if (a->shared && (rc = moeI_check_tensor(ctx, stage, "shared", a->shared, MOE_BF16, 2, th_shape))) return rc;
  if (a->shared_gate) {
    /* a gate without the expert it gates is a composition mistake, not a no-op */
    if (!a->shared) return moeI_seterr(ctx, MOE_ERR_ARG, "combine: shared_gate is given without shared");
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate", a->shared_gate, MOE_F32, 1, t_shape))) return rc;
  }
  const moe_tensor *ts[] = {a->out, a->weights, a->ids, a->shared, a->shared_gate};
  static const char *const names[] = {"out", "weights", "ids", "shared", "shared_gate"};
  if ((rc = moeI_check_same_device(ctx, stage, "weights", dev, ts, names, 5))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 5))) return rc;
  if ((rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->ys, a->world, "ys")) ||
      (rc = moeI_check_no_overlap_list(ctx, stage, a->out, "out", a->route_row, a->world, "route_row")))
    return rc;
  return MOE_IN_RANGE(stage, dev.kind == MOE_CPU ? moeI_combine_cpu(ctx, a) : moeI_combine_cuda(ctx, a));
}
