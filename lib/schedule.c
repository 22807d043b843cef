/* SPDX-License-Identifier: MIT */
/* schedule.c -- stage 2, schedule: every rank's ids i32 [W, T, K] -> this rank's
 * expert-major row layout (docs/design.md, "The stages", 2).
 *
 * Under capacity the outputs stay consistent with each other and with the rows written:
 *   expert_offsets[e] = min(base[e], C) for e = 0..EL, so expert_offsets[EL] = rows used;
 *   tokens_per_expert[e] = expert_offsets[e+1] - expert_offsets[e], the padded size after
 *     that clamp (equal to roundup(n_e, pad) whenever nothing was cut by C);
 *   counts[e] = routes of e that got a row (<= tokens_per_expert[e]);
 *   stats: ROWS_NEEDED = the sum of the unclamped padded sizes (saturated at INT32_MAX),
 *     ROWS_USED = expert_offsets[EL], DROPPED = valid routes to this rank's experts that got
 *     no row (expert_capacity or C), INVALID and FIRST_INVALID over every rank's ids.
 * peer_rank, peer_route and route_row are -1 wherever no route was placed.
 */
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

#define STAGE "schedule"

/* The argument checks of moe_schedule, shared with moe_schedule_explain. */
static int schedule_check(moe_ctx *ctx, const moe_schedule_args *a) {
  if (!a) return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": arguments are NULL");
  int rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "ids", a->ids, MOE_I32, 3, NULL))) return rc;
  const int64_t w = a->ids->shape[0], tk = a->ids->shape[1] * a->ids->shape[2];
  if (w < 1) {
    char b[160];
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": ids must hold at least one rank, got %s",
                      moeI_tensor_describe(a->ids, b, sizeof b));
  }
  /* route indices, flat indices and rows are i32 */
  if (a->ids->numel > INT32_MAX) {
    char b[160];
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": ids %s has more than 2^31 - 1 routes",
                      moeI_tensor_describe(a->ids, b, sizeof b));
  }
  if (a->experts < 1) return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": experts must be >= 1, got %d", a->experts);
  if (a->experts % w)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": experts (%d) must be a multiple of the world size (%lld)",
                      a->experts, (long long)w);
  if (a->rank < 0 || a->rank >= w)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": rank must be between 0 and %lld (world size %lld), got %d",
                      (long long)w - 1, (long long)w, a->rank);
  if (a->pad < 1) return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": pad must be >= 1, got %d", a->pad);
  if (a->capacity < 0) return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": capacity must be >= 0, got %d", a->capacity);
  if (a->layout != MOE_LAYOUT_ROUNDROBIN && a->layout != MOE_LAYOUT_PEER_MAJOR)
    return moeI_seterr(ctx, MOE_ERR_ARG, STAGE ": layout must be roundrobin (%d) or peer_major (%d), got %d",
                      MOE_LAYOUT_ROUNDROBIN, MOE_LAYOUT_PEER_MAJOR, a->layout);

  const int64_t c = a->capacity, el = a->experts / w, el1 = el + 1, nstats = MOE_SCHED_STATS;
  const int64_t rr_shape[2] = {w, tk};
  if ((rc = moeI_check_tensor(ctx, STAGE, "peer_rank", a->peer_rank, MOE_I32, 1, &c))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "peer_route", a->peer_route, MOE_I32, 1, &c))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "counts", a->counts, MOE_I32, 1, &el))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "tokens_per_expert", a->tokens_per_expert, MOE_I32, 1, &el))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "expert_offsets", a->expert_offsets, MOE_I32, 1, &el1))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "route_row", a->route_row, MOE_I32, 2, rr_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, STAGE, "stats", a->stats, MOE_I32, 1, &nstats))) return rc;

  const moe_tensor *all[] = {a->peer_rank, a->peer_route,     a->counts, a->tokens_per_expert,
                             a->expert_offsets, a->route_row, a->stats,  a->ids};
  static const char *const names[] = {"peer_rank",      "peer_route", "counts", "tokens_per_expert",
                                      "expert_offsets", "route_row",  "stats",  "ids"};
  if ((rc = moeI_check_same_device(ctx, STAGE, "ids", a->ids->device, all, names, 8))) return rc;
  return moeI_check_no_overlap(ctx, STAGE, all, names, 7, 8);
}

int moe_schedule(moe_ctx *ctx, const moe_schedule_args *a) {
  int rc = schedule_check(ctx, a);
  if (rc) return rc;
  return MOE_IN_RANGE(STAGE, moeI_on_cpu(a->ids) ? moeI_schedule_cpu(ctx, a) : moeI_schedule_cuda(ctx, a));
}

int moe_schedule_explain(moe_ctx *ctx, const moe_schedule_args *a, char *report, size_t n) {
  int rc = schedule_check(ctx, a);
  if (rc) return rc;
  if ((rc = moeI_check_report(ctx, "schedule", report, n))) return rc;
  if (moeI_on_cpu(a->ids)) return moeI_explain_cpu(ctx, report, n);
  return moeI_schedule_explain_cuda(ctx, a, report, n);
}

/* ---- the CPU reference ----
 *
 * O(W T K + EL W) time and memory, in four passes:
 *  1. count c[e][p] (routes from rank p to local expert e) and the invalid ids;
 *  2. bucket the local routes by (e, p), each bucket in the order of its ordinal j: for
 *     "roundrobin" that is the order of the logical threads (thread th visits th, th + 1024,
 *     ...), for "peer_major" ascending route index -- the same walk with a single thread;
 *  3. size the segments: n_e, padded, base;
 *  4. walk each segment in its layout's order, so that a route's position is a running count:
 *     "peer_major" is the buckets of e one after another (sorted by (p, i)); "roundrobin"
 *     takes ordinal j = 0, 1, ... from every peer whose bucket still has one (sorted by (j, p)),
 *     which is exactly row = base[e] + sum_q min(c[e][q], j) + #{q < p : c[e][q] > j}.
 *     Positions fill 0 .. sum_p c[e][p] - 1, so stopping at min(n_e, C - base[e]) keeps exactly
 *     the routes that expert_capacity and C allow, with their rows dense from base[e].
 */
struct scratch {
  int32_t *cnt;    /* c[e][p], e-major: bucket g = e W + p */
  int32_t *start;  /* bucket g holds bucket[start[g] .. start[g + 1]) */
  int32_t *cursor; /* next free slot of each bucket while filling */
  int32_t *bucket; /* flat route indices p T K + i of the local routes, bucketed */
  int64_t *base;   /* segment starts, unclamped; base[EL] = rows needed */
  int32_t *active; /* the peers a "roundrobin" round still draws from */
};

static void schedule_fill(const moe_schedule_args *a, const struct scratch *s) {
  const int32_t *ids = a->ids->data;
  const int w = (int)a->ids->shape[0];
  const int32_t tk = (int32_t)(a->ids->shape[1] * a->ids->shape[2]);
  const int e_all = a->experts, el = e_all / w, lo = a->rank * el;
  const int64_t cap = a->capacity, pad = a->pad;
  int32_t *cnt = s->cnt, *start = s->start, *cursor = s->cursor, *bucket = s->bucket, *active = s->active;
  int64_t *base = s->base;

  /* 1. counts */
  int32_t invalid = 0, first_invalid = -1, local = 0;
  for (int p = 0; p < w; p++) {
    const int32_t *row = ids + (size_t)p * tk;
    for (int32_t i = 0; i < tk; i++) {
      const int32_t id = row[i];
      if (id == -1) continue;
      if (id < 0 || id >= e_all) {
        if (invalid++ == 0) first_invalid = p * tk + i;
        continue;
      }
      if (id - lo >= 0 && id - lo < el) {
        cnt[(size_t)(id - lo) * w + p]++;
        local++;
      }
    }
  }

  /* 2. buckets */
  const size_t groups = (size_t)el * (size_t)w;
  start[0] = 0;
  for (size_t g = 0; g < groups; g++) {
    start[g + 1] = start[g] + cnt[g];
    cursor[g] = start[g];
  }
  const int32_t threads = a->layout == MOE_LAYOUT_ROUNDROBIN ? MOE_SCHED_THREADS : 1;
  for (int p = 0; p < w; p++) {
    const int32_t *row = ids + (size_t)p * tk;
    for (int32_t th = 0; th < threads && th < tk; th++)
      for (int64_t i = th; i < tk; i += threads) { /* 64-bit: i + threads may pass 2^31 */
        const int32_t id = row[i];
        if (id >= lo && id < lo + el) bucket[cursor[(size_t)(id - lo) * w + p]++] = (int32_t)(p * tk + i);
      }
  }

  /* 3. segment sizes */
  base[0] = 0;
  for (int e = 0; e < el; e++) {
    int64_t n = 0;
    for (int p = 0; p < w; p++) n += cnt[(size_t)e * w + p];
    if (a->expert_capacity >= 0 && n > a->expert_capacity) n = a->expert_capacity;
    base[e + 1] = base[e] + (n + pad - 1) / pad * pad;
  }

  /* 4. rows */
  int32_t *peer_rank = a->peer_rank->data, *peer_route = a->peer_route->data;
  int32_t *counts = a->counts->data, *route_row = a->route_row->data;
  for (int64_t r = 0; r < cap; r++) peer_rank[r] = peer_route[r] = -1;
  for (int64_t r = 0; r < (int64_t)w * tk; r++) route_row[r] = -1;
  int32_t placed = 0;
  for (int e = 0; e < el; e++) {
    const int32_t *ce = cnt + (size_t)e * w, *se = start + (size_t)e * w;
    int64_t limit = 0; /* positions kept: min(n_e, C - base[e]), n_e capped by expert_capacity */
    for (int p = 0; p < w; p++) limit += ce[p];
    if (a->expert_capacity >= 0 && limit > a->expert_capacity) limit = a->expert_capacity;
    if (limit > cap - base[e]) limit = cap - base[e] > 0 ? cap - base[e] : 0;
    int32_t pos = 0;
    if (a->layout == MOE_LAYOUT_PEER_MAJOR) {
      for (; pos < limit; pos++) {
        const int32_t g = bucket[se[0] + pos];
        const int32_t row = (int32_t)base[e] + pos;
        peer_rank[row] = g / tk;
        peer_route[row] = g % tk;
        route_row[g] = row;
      }
    } else {
      int na = 0;
      for (int p = 0; p < w; p++)
        if (ce[p] > 0) active[na++] = p;
      for (int32_t j = 0; pos < limit; j++) {
        int keep = 0;
        for (int x = 0; x < na && pos < limit; x++, pos++) {
          const int p = active[x];
          const int32_t g = bucket[se[p] + j];
          const int32_t row = (int32_t)base[e] + pos;
          peer_rank[row] = p;
          peer_route[row] = g % tk;
          route_row[g] = row;
          if (ce[p] > j + 1) active[keep++] = p; /* p still has an ordinal j + 1 */
        }
        na = keep;
      }
    }
    counts[e] = pos;
    placed += pos;
  }

  int32_t *offsets = a->expert_offsets->data, *tpe = a->tokens_per_expert->data, *stats = a->stats->data;
  for (int e = 0; e <= el; e++) offsets[e] = (int32_t)(base[e] < cap ? base[e] : cap);
  for (int e = 0; e < el; e++) tpe[e] = offsets[e + 1] - offsets[e];
  stats[MOE_STAT_ROWS_NEEDED] = (int32_t)(base[el] < INT32_MAX ? base[el] : INT32_MAX);
  stats[MOE_STAT_ROWS_USED] = offsets[el];
  stats[MOE_STAT_DROPPED] = local - placed;
  stats[MOE_STAT_INVALID] = invalid;
  stats[MOE_STAT_FIRST_INVALID] = first_invalid;
}

int moeI_schedule_cpu(moe_ctx *ctx, const moe_schedule_args *a) {
  const size_t w = (size_t)a->ids->shape[0], routes = (size_t)a->ids->numel;
  const size_t el = (size_t)a->experts / w, groups = el * w;
  struct scratch s;
  /* every size at least 1: malloc(0) may return NULL, which would read as a failure */
  s.cnt = calloc(groups, sizeof *s.cnt);
  s.start = malloc((groups + 1) * sizeof *s.start);
  s.cursor = malloc(groups * sizeof *s.cursor);
  s.bucket = malloc((routes ? routes : 1) * sizeof *s.bucket); /* no more local routes than routes */
  s.base = malloc((el + 1) * sizeof *s.base);
  s.active = malloc(w * sizeof *s.active);
  int rc;
  if (s.cnt && s.start && s.cursor && s.bucket && s.base && s.active) {
    schedule_fill(a, &s);
    rc = moeI_ok(ctx);
  } else {
    rc = moeI_seterr(ctx, MOE_ERR_NOMEM, STAGE ": out of host memory for %zu routes and %zu local experts", routes, el);
  }
  free(s.cnt), free(s.start), free(s.cursor), free(s.bucket), free(s.base), free(s.active);
  return rc;
}

void moeI_schedule_set_trace(moe_ctx *ctx, int on) { ctx->schedule_trace = on != 0; }
