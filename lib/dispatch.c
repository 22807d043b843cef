/* SPDX-License-Identifier: MIT */
/* dispatch.c -- stage 3: gather each scheduled row's token, out[row] = x[peer_rank[row],
 * peer_route[row] / k]. */
#include <string.h>

#include "internal.h"

/* peer_rank and peer_route are data (the schedule writes them on the device), so a row whose
 * values point outside x is treated like a row without a route rather than trusted: it is
 * zeroed under zero_fill and otherwise left alone. */
int moeI_dispatch_cpu(moe_ctx *ctx, const moe_dispatch_args *a) {
  const int64_t W = a->x->shape[0], T = a->x->shape[1], H = a->x->shape[2], C = a->out->shape[0];
  const int64_t routes = moeI_dispatch_routes(T, a->k);
  const size_t row_bytes = (size_t)H * sizeof(uint16_t);
  const int32_t *rank = a->peer_rank->data, *route = a->peer_route->data;
  const uint16_t *x = a->x->data;
  uint16_t *out = a->out->data;
  for (int64_t r = 0; r < C; r++) {
    const int64_t p = rank[r], q = route[r];
    if (p >= 0 && p < W && q >= 0 && q < routes)
      memcpy(out + r * H, x + (p * T + q / a->k) * H, row_bytes);
    else if (a->zero_fill)
      memset(out + r * H, 0, row_bytes); /* all-zero bits are bf16 +0 */
  }
  return moeI_ok(ctx);
}

int moe_dispatch(moe_ctx *ctx, const moe_dispatch_args *a) {
  static const char *stage = "dispatch";
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch: args is NULL");
  int rc;
  /* the inputs first, so that an out of the wrong size is named as such: C is the schedule's
   * (peer_rank's length), H is x's */
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_BF16, 3, NULL))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "peer_rank", a->peer_rank, MOE_I32, 1, NULL))) return rc;
  const int64_t C = a->peer_rank->shape[0], H = a->x->shape[2];
  const int64_t row_shape[] = {C}, out_shape[] = {C, H};
  if ((rc = moeI_check_tensor(ctx, stage, "peer_route", a->peer_route, MOE_I32, 1, row_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_BF16, 2, out_shape))) return rc;
  if (a->k < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch: k must be >= 1, got %d", a->k);
  const moe_tensor *ts[] = {a->out, a->x, a->peer_rank, a->peer_route};
  static const char *const names[] = {"out", "x", "peer_rank", "peer_route"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", a->x->device, ts, names, 4))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 4))) return rc;
  return MOE_IN_RANGE(stage, moeI_on_cpu(a->out) ? moeI_dispatch_cpu(ctx, a) : moeI_dispatch_cuda(ctx, a));
}
