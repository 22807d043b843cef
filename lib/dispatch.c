/* SPDX-License-Identifier: MIT */
/* dispatch.c -- stage 3: gather each scheduled row's token, out[row] = x[peer_rank[row],
 * peer_route[row] / k]; moe_dispatch_fp8 gathers e4m3 rows and their scales the same way. */
#include <string.h>

#include "fp8_math.h"
#include "internal.h"

/* peer_rank and peer_route are data (the schedule writes them on the device), so a row whose
 * values point outside x is treated like a row without a route rather than trusted: it is
 * zeroed under zero_fill and otherwise left alone.  Row r's source token p * T + q / k, or -1. */
static int64_t source_of(const moe_tensor *peer_rank, const moe_tensor *peer_route, int64_t r, int64_t W, int64_t T,
                         int k) {
  const int64_t p = ((const int32_t *)peer_rank->data)[r], q = ((const int32_t *)peer_route->data)[r];
  return p >= 0 && p < W && q >= 0 && q < moeI_dispatch_routes(T, k) ? p * T + q / k : -1;
}

/* rows of row_bytes bytes, x [W, T, .] into out [C, .]; all-zero bits are +0 in bf16 and e4m3 */
static void gather_rows(void *out, const void *x, size_t row_bytes, const moe_tensor *peer_rank,
                        const moe_tensor *peer_route, int64_t W, int64_t T, int k, int zero_fill) {
  const int64_t C = peer_rank->shape[0];
  for (int64_t r = 0; r < C; r++) {
    const int64_t s = source_of(peer_rank, peer_route, r, W, T, k);
    if (s >= 0) memcpy((char *)out + r * row_bytes, (const char *)x + s * row_bytes, row_bytes);
    else if (zero_fill) memset((char *)out + r * row_bytes, 0, row_bytes);
  }
}

int moeI_dispatch_cpu(moe_ctx *ctx, const moe_dispatch_args *a) {
  gather_rows(a->out->data, a->x->data, (size_t)a->x->shape[2] * sizeof(uint16_t), a->peer_rank, a->peer_route,
              a->x->shape[0], a->x->shape[1], a->k, a->zero_fill);
  return moeI_ok(ctx);
}

/* What both dispatches check of x (xdtype [W, T, H]), the schedule's peer_rank and peer_route,
 * and k; *C and *H from them.  The inputs first, so that an out of the wrong size is named as
 * such: C is the schedule's (peer_rank's length), H is x's. */
static int check_gather(moe_ctx *ctx, const char *stage, const moe_tensor *x, moe_dtype xdtype,
                        const moe_tensor *peer_rank, const moe_tensor *peer_route, int k, int64_t *C, int64_t *H) {
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", x, xdtype, 3, NULL))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "peer_rank", peer_rank, MOE_I32, 1, NULL))) return rc;
  *C = peer_rank->shape[0], *H = x->shape[2];
  if ((rc = moeI_check_tensor(ctx, stage, "peer_route", peer_route, MOE_I32, 1, C))) return rc;
  if (k < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: k must be >= 1, got %d", stage, k);
  return MOE_OK;
}

int moe_dispatch(moe_ctx *ctx, const moe_dispatch_args *a) {
  static const char *stage = "dispatch";
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch: args is NULL");
  int rc;
  int64_t C, H;
  if ((rc = check_gather(ctx, stage, a->x, MOE_BF16, a->peer_rank, a->peer_route, a->k, &C, &H))) return rc;
  const int64_t out_shape[] = {C, H};
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_BF16, 2, out_shape))) return rc;
  const moe_tensor *ts[] = {a->out, a->x, a->peer_rank, a->peer_route};
  static const char *const names[] = {"out", "x", "peer_rank", "peer_route"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", a->x->device, ts, names, 4))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 4))) return rc;
  return MOE_IN_RANGE(stage, moeI_on_cpu(a->out) ? moeI_dispatch_cpu(ctx, a) : moeI_dispatch_cuda(ctx, a));
}

/* The scales go out transposed, [H/128, C]: a scatter with stride C, one row's H/128 at a time. */
static int dispatch_fp8_cpu(moe_ctx *ctx, const moe_dispatch_fp8_args *a) {
  const int64_t W = a->x->shape[0], T = a->x->shape[1], H = a->x->shape[2], C = a->out->shape[0];
  const int64_t nb = H / MOE_FP8_BLOCK;
  gather_rows(a->out->data, a->x->data, (size_t)H, a->peer_rank, a->peer_route, W, T, a->k, a->zero_fill);
  const float *xs = a->x_scale->data;
  float *os = a->out_scale->data;
  for (int64_t r = 0; r < C; r++) {
    const int64_t s = source_of(a->peer_rank, a->peer_route, r, W, T, a->k);
    if (s < 0 && !a->zero_fill) continue;
    for (int64_t b = 0; b < nb; b++) os[b * C + r] = s >= 0 ? xs[s * nb + b] : 0.0f;
  }
  return moeI_ok(ctx);
}

int moe_dispatch_fp8(moe_ctx *ctx, const moe_dispatch_fp8_args *a) {
  static const char *stage = "dispatch_fp8";
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch_fp8: args is NULL");
  int rc;
  int64_t C, H;
  if ((rc = check_gather(ctx, stage, a->x, MOE_E4M3, a->peer_rank, a->peer_route, a->k, &C, &H))) return rc;
  if (H % MOE_FP8_BLOCK)
    return moeI_seterr(ctx, MOE_ERR_ARG, "dispatch_fp8: the hidden size H (x's last dimension) must be a multiple of "
                       "%d, got %lld", MOE_FP8_BLOCK, (long long)H);
  const int64_t W = a->x->shape[0], T = a->x->shape[1], nb = H / MOE_FP8_BLOCK;
  const int64_t xs_shape[] = {W, T, nb}, out_shape[] = {C, H}, os_shape[] = {nb, C};
  if ((rc = moeI_check_tensor(ctx, stage, "x_scale", a->x_scale, MOE_F32, 3, xs_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_E4M3, 2, out_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "out_scale", a->out_scale, MOE_F32, 2, os_shape))) return rc;
  const moe_tensor *ts[] = {a->out, a->out_scale, a->x, a->x_scale, a->peer_rank, a->peer_route};
  static const char *const names[] = {"out", "out_scale", "x", "x_scale", "peer_rank", "peer_route"};
  if ((rc = moeI_check_same_device(ctx, stage, "x", a->x->device, ts, names, 6))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 2, 6))) return rc;
  return MOE_IN_RANGE(stage, moeI_on_cpu(a->out) ? dispatch_fp8_cpu(ctx, a) : moeI_dispatch_fp8_cuda(ctx, a));
}
