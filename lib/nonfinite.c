/* SPDX-License-Identifier: MIT */
/* nonfinite.c -- moe_nonfinite: how many elements of a float tensor are NaN or infinite, and
 * the first of them, counted where the tensor lives.  Data a caller hands a stage (routing
 * weights) has no router to reject its NaN rows; this is the count the front-end raises on, on
 * the device, so that a pass reads back two integers rather than the data. */
#include <string.h>

#include "internal.h"

#define STAGE "nonfinite"

/* On the bits, so that no compiler's notion of NaN comparisons can change the verdict: the
 * exponent all ones is an infinity or a NaN, in f32 and bf16 alike; e4m3 has no infinities, and
 * S.1111.111 is its NaN. */
static int nonfinite_at(const moe_tensor *t, int64_t i) {
  if (t->dtype == MOE_E4M3) return (((const uint8_t *)t->data)[i] & 0x7fu) == 0x7fu;
  if (t->dtype == MOE_BF16) return (((const uint16_t *)t->data)[i] & 0x7f80u) == 0x7f80u;
  uint32_t u;
  memcpy(&u, (const float *)t->data + i, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

int moe_nonfinite(moe_ctx *ctx, moe_tensor *stats, const moe_tensor *t) {
  int rc;
  const int64_t two = 2;
  if ((rc = moeI_check_tensor(ctx, STAGE, "stats", stats, MOE_I32, 1, &two))) return rc;
  if (!t || t->dtype == MOE_I32) {
    char got[160];
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": t must be an f32, bf16 or e4m3 tensor, got %s",
                       moeI_tensor_describe(t, got, sizeof got));
  }
  if (t->numel > INT32_MAX) /* the first index is an i32 */
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": t has %lld elements, at most 2^31 - 1", (long long)t->numel);
  const moe_tensor *all[] = {stats, t};
  static const char *const names[] = {"stats", "t"};
  if ((rc = moeI_check_same_device(ctx, STAGE, "t", t->device, all, names, 2))) return rc;
  if ((rc = moeI_check_no_overlap(ctx, STAGE, all, names, 1, 2))) return rc;
  if (!moeI_on_cpu(t)) return moeI_nonfinite_cuda(ctx, stats, t);
  int32_t count = 0, first = -1;
  for (int64_t i = 0; i < t->numel; i++) {
    if (!nonfinite_at(t, i)) continue;
    if (first < 0) first = (int32_t)i;
    count++;
  }
  int32_t *out = stats->data;
  out[0] = count;
  out[1] = first;
  return moeI_ok(ctx);
}
