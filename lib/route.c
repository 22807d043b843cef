/* SPDX-License-Identifier: MIT */
/* route.c -- stage 1, route: logits f32 [N, E] -> ids i32 [N, K], weights f32 [N, K].
 *
 * The CPU reference defines the result; the CUDA kernel must give the same ids bit for bit.
 * To make that possible the selection never depends on a float reduction or on a libm:
 *
 *   softmax       selects on the logits themselves.  Softmax is strictly increasing, so the
 *                 top-k of l is the exact top-k of p; p rounded to float can tie where l does
 *                 not, and would depend on the order of the sum.  Then, in float:
 *                 m = max l; e_i = exp(l_i - m); sum = e_0 + e_1 + ... (ascending i);
 *                 p_i = e_i / sum; w_j = p_S(j) / (p_S(0) + ... + p_S(K-1)).
 *   sigmoid       s_i = sigmoid(l_i); key_i = s_i + b_i (s_i without a bias).  With groups > 1,
 *                 a group's score is its largest key plus its second largest (one expert: its
 *                 key); the topk_groups best groups are kept and the experts are selected
 *                 among them.  w_j = (s_S(j) / (s_S(0) + ... + s_S(K-1))) * scale.
 *   sqrtsoftplus  s_i = sqrt(softplus(l_i)), otherwise as sigmoid without groups.
 *
 * All of it in float, exp/log1p from route_math.h (shared with the kernel).  Every ordering
 * is the strict one "higher key first, then lower id", for experts and for groups alike, and
 * the K output slots come in that order.  When the selected s sum to 0 (every selected sigmoid
 * underflowed) the weights are 0, not 0/0.
 *
 * A row is rejected -- ids -1, weights 0, counted in stats -- when a logit is NaN, and also
 * where the formulas above would produce a NaN: a NaN key or group score (a NaN bias, or
 * infinite biases of opposite signs), a +inf logit under softmax (inf - inf) or sqrtsoftplus
 * (inf / inf in the weights), or a softmax row whose logits are all -inf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "route_math.h"

#define STAGE "route"

static const char *scoring_name(int s) {
  switch (s) {
  case MOE_SCORE_SOFTMAX: return "softmax";
  case MOE_SCORE_SIGMOID: return "sigmoid";
  case MOE_SCORE_SQRTSOFTPLUS: return "sqrtsoftplus";
  default: return "?";
  }
}

int moe_route(moe_ctx *ctx, const moe_route_args *a) {
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": arguments are NULL");
  int rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "logits", a->logits, MOE_F32, 2, NULL))) return rc;
  const int64_t n = a->logits->shape[0], e = a->logits->shape[1];
  if (n > INT32_MAX || e > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": logits [%lld, %lld] is too large for i32 ids", (long long)n,
                      (long long)e);
  if (a->scoring < MOE_SCORE_SOFTMAX || a->scoring > MOE_SCORE_SQRTSOFTPLUS)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      STAGE ": scoring must be softmax (%d), sigmoid (%d) or sqrtsoftplus (%d), got %d",
                      MOE_SCORE_SOFTMAX, MOE_SCORE_SIGMOID, MOE_SCORE_SQRTSOFTPLUS, a->scoring);
  if (a->k < 1 || a->k > e)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": k must be between 1 and the number of experts (%lld), got %d",
                      (long long)e, a->k);
  const int64_t out_shape[2] = {n, a->k}, two = 2;
  if ((rc = moeI_check_tensor(ctx, STAGE, "ids", a->ids, MOE_I32, 2, out_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "weights", a->weights, MOE_F32, 2, out_shape))) return rc;
  if (a->stats && (rc = moeI_check_tensor(ctx, STAGE, "stats", a->stats, MOE_I32, 1, &two))) return rc;
  if (a->bias) {
    if (a->scoring == MOE_SCORE_SOFTMAX)
      return moeI_seterr(ctx, MOE_ERR_ARG,
                        STAGE ": bias must be absent with softmax scoring (it is for sigmoid and sqrtsoftplus)");
    if ((rc = moeI_check_tensor(ctx, STAGE, "bias", a->bias, MOE_F32, 1, &e))) return rc;
  }
  if (a->groups < 1 || e % a->groups)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": groups must be >= 1 and divide the number of experts (%lld), got %d",
                      (long long)e, a->groups);
  if (a->groups > 1 && a->scoring != MOE_SCORE_SIGMOID)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": groups must be 1 with %s scoring (groups are for sigmoid), got %d",
                      scoring_name(a->scoring), a->groups);
  if (a->topk_groups < 1 || a->topk_groups > a->groups)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": topk_groups must be between 1 and groups (%d), got %d", a->groups,
                      a->topk_groups);
  const int64_t group_size = e / a->groups;
  if (a->k > a->topk_groups * group_size)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      STAGE ": k (%d) must be at most topk_groups (%d) times the experts per group (%lld)", a->k,
                      a->topk_groups, (long long)group_size);
  if (a->scoring != MOE_SCORE_SOFTMAX && (!isfinite(a->scale) || !(a->scale > 0.0f))) /* softmax ignores it */
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": scale must be finite and > 0, got %g", (double)a->scale);

  const moe_device dev = a->logits->device;
  const moe_tensor *all[] = {a->ids, a->weights, a->stats, a->logits, a->bias};
  static const char *const names[] = {"ids", "weights", "stats", "logits", "bias"};
  if ((rc = moeI_check_same_device(ctx, STAGE, "logits", dev, all, names, 5))) return rc;
  /* an output sharing memory with another argument would be overwritten while still read */
  if ((rc = moeI_check_no_overlap(ctx, STAGE, all, names, 3, 5))) return rc;

  return MOE_IN_RANGE(STAGE, moeI_on_cpu(a->logits) ? moeI_route_cpu(ctx, a) : moeI_route_cuda(ctx, a));
}

/* ---- the CPU reference ---- */

/* The strict order of the whole stage: higher key first, ties toward the lower index. */
static int before(float ka, int ia, float kb, int ib) { return ka > kb || (ka == kb && ia < ib); }

/* The k first of key[0..n) in that order, into out[0..k).  With kept, only items i whose
 * kept[i / per] is set take part.  O(n k): each round takes the best item that comes after
 * the previous round's pick, so nothing has to be marked.  The keys hold no NaN and enough
 * items take part (the caller checked both). */
static void top_k(const float *key, int n, int k, const unsigned char *kept, int per, int *out) {
  int prev = -1;
  for (int j = 0; j < k; j++) {
    int best = -1;
    for (int i = 0; i < n; i++) {
      if (kept && !kept[i / per]) continue;
      if (prev >= 0 && !before(key[prev], prev, key[i], i)) continue;
      if (best < 0 || before(key[i], i, key[best], best)) best = i;
    }
    out[j] = best;
    prev = best;
  }
}

/* One softmax row; returns 0 if the row is rejected. */
static int softmax_row(const float *l, int e, int k, int *ids, float *w, float *ex) {
  float m = l[0];
  for (int i = 0; i < e; i++) {
    if (isnan(l[i])) return 0;
    if (l[i] > m) m = l[i];
  }
  if (isinf(m)) return 0; /* +inf: inf - inf; -inf: every logit is -inf */
  top_k(l, e, k, NULL, 1, ids);
  float sum = 0.0f;
  for (int i = 0; i < e; i++) {
    ex[i] = moeI_rm_exp(l[i] - m);
    sum += ex[i];
  }
  /* sum >= 1 (the maximum contributes e^0), and the top-1 is selected, so psum > 0 */
  float psum = 0.0f;
  for (int j = 0; j < k; j++) {
    w[j] = ex[ids[j]] / sum;
    psum += w[j];
  }
  for (int j = 0; j < k; j++) w[j] = w[j] / psum;
  return 1;
}

/* One sigmoid or sqrtsoftplus row; returns 0 if the row is rejected. */
static int biased_row(const moe_route_args *a, const float *l, const float *bias, int e, int *ids, float *w,
                      float *s, float *key, float *gscore, unsigned char *kept) {
  const int k = a->k, groups = a->groups, per = e / groups;
  for (int i = 0; i < e; i++) {
    if (isnan(l[i])) return 0;
    if (a->scoring == MOE_SCORE_SIGMOID) {
      s[i] = moeI_rm_sigmoid(l[i]);
    } else {
      if (l[i] == INFINITY) return 0;
      s[i] = moeI_rm_sqrtsoftplus(l[i]);
    }
    key[i] = bias ? s[i] + bias[i] : s[i];
    if (isnan(key[i])) return 0;
  }
  if (groups > 1) {
    for (int g = 0; g < groups; g++) {
      const float *kg = key + (size_t)g * per;
      float top1 = kg[0], top2 = -INFINITY;
      for (int i = 1; i < per; i++) {
        if (kg[i] > top1) {
          top2 = top1;
          top1 = kg[i];
        } else if (kg[i] > top2) {
          top2 = kg[i];
        }
      }
      gscore[g] = per == 1 ? top1 : top1 + top2;
      if (isnan(gscore[g])) return 0;
    }
    /* the kept groups, by the same strict order, listed in ids first (it has room for groups) */
    top_k(gscore, groups, a->topk_groups, NULL, 1, ids);
    for (int g = 0; g < groups; g++) kept[g] = 0;
    for (int j = 0; j < a->topk_groups; j++) kept[ids[j]] = 1;
    top_k(key, e, k, kept, per, ids);
  } else {
    top_k(key, e, k, NULL, 1, ids);
  }
  float sum = 0.0f;
  for (int j = 0; j < k; j++) sum += s[ids[j]];
  for (int j = 0; j < k; j++) w[j] = sum > 0.0f ? (s[ids[j]] / sum) * a->scale : 0.0f;
  return 1;
}

int moeI_route_cpu(moe_ctx *ctx, const moe_route_args *a) {
  const int n = (int)a->logits->shape[0], e = (int)a->logits->shape[1], k = a->k;
  const float *logits = a->logits->data;
  const float *bias = a->bias ? a->bias->data : NULL;
  int32_t *ids = a->ids->data;
  float *weights = a->weights->data;

  if (n == 0) { /* no row: no scratch (e may be up to 2^31 - 1 here) */
    if (a->stats) {
      int32_t *st = a->stats->data;
      st[0] = 0;
      st[1] = -1;
    }
    return moeI_ok(ctx);
  }
  /* scratch: s and key per expert, group scores, kept groups, the chosen experts or groups */
  float *s = malloc(sizeof(float) * (size_t)e * 2 + sizeof(float) * (size_t)a->groups);
  unsigned char *kept = malloc((size_t)a->groups);
  int *sel = malloc(sizeof(int) * (size_t)(k > a->groups ? k : a->groups));
  if (!s || !kept || !sel) {
    free(s), free(kept), free(sel);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, STAGE ": out of host memory for %d experts", e);
  }
  float *key = s + e, *gscore = s + 2 * (size_t)e;

  int rejected = 0, first = -1;
  for (int r = 0; r < n; r++) {
    const float *l = logits + (size_t)r * e;
    float *w = weights + (size_t)r * k;
    int ok = a->scoring == MOE_SCORE_SOFTMAX ? softmax_row(l, e, k, sel, w, s)
                                             : biased_row(a, l, bias, e, sel, w, s, key, gscore, kept);
    for (int j = 0; j < k; j++) {
      ids[(size_t)r * k + j] = ok ? sel[j] : -1;
      if (!ok) w[j] = 0.0f;
    }
    if (!ok && rejected++ == 0) first = r;
  }
  if (a->stats) {
    int32_t *st = a->stats->data;
    st[0] = rejected;
    st[1] = first;
  }
  free(s), free(kept), free(sel);
  return moeI_ok(ctx);
}
