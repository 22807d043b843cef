/* SPDX-License-Identifier: MIT */
/* schedule_test.h -- what test_schedule_gpu and bench/schedule_trace.c share: routings drawn from
 * a seed (top-k, skewed, lopsided, to one expert; masked and invalid ids), capacities relative to
 * the rows they need, outputs on the GPU as views into larger buffers prefilled with a sentinel
 * (so an element left unwritten or a write past an output's end shows), and their comparison with
 * the CPU's, bit for bit. */
#pragma once

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_test.h"

#define SENTINEL 0x3c3c3c3c /* never a row, route, count or stat of these cases */
#define GUARD 97            /* elements of sentinel after every GPU output */

static void die(const char *what) {
  fprintf(stderr, "setup: %s: %s\n", what, moe_errmsg(ctx));
  exit(2);
}

/* ---- random numbers (splitmix64) ---- */
static uint64_t rng;
static uint64_t next(void) {
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int below(int n) { return n <= 1 ? 0 : (int)(next() % (uint64_t)n); }
static int chance(double p) { return (double)(next() >> 11) * (1.0 / 9007199254740992.0) < p; }

/* The context's schedule_kernel option: NULL for the library's choice, "grid" or "bitmap" to force one. */
static void use_kernel(const char *k) {
  if (moe_ctx_config(ctx, "schedule_kernel", k ? k : "auto")) die("schedule_kernel option");
}

/* ---- a case ---- */
enum { UNIFORM, TOPK, SKEW, ONE_LOCAL, ONE_REMOTE, LOPSIDED, NMODES };
static const char *const mode_names[] = {"uniform", "topk", "skew", "one-local", "one-remote", "lopsided"};
enum { CAP_AMPLE, CAP_EXACT, CAP_SHORT, CAP_ZERO, CAP_RANDOM, NCAPS };
static const char *const cap_names[] = {"ample", "exact", "short", "zero", "random"};

typedef struct {
  int w, t, k, experts, rank, pad, expert_capacity, layout;
  int unaligned;       /* the GPU ids a view one element into a larger tensor (not 16-byte aligned) */
  int mode, cap;       /* ids distribution, capacity relative to the rows needed */
  double masked, invalid;
  uint64_t seed;
  const char *label;
} spec;

static int32_t *make_ids(const spec *s) {
  const size_t n = (size_t)s->w * s->t * s->k;
  int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
  if (!ids) exit(2);
  const int E = s->experts, el = E / s->w;
  const int hot = below(E), target = s->mode == ONE_LOCAL ? s->rank * el + below(el)
                                   : s->w > 1             ? ((s->rank + 1) % s->w) * el + below(el)
                                                          : -1;
  for (int p = 0; p < s->w; p++)
    for (int t = 0; t < s->t; t++) {
      int32_t *row = ids + ((size_t)p * s->t + t) * s->k;
      for (int k = 0; k < s->k; k++) {
        int id;
        switch (s->mode) {
        case TOPK: /* distinct experts per token, as top-k gives */
          for (;;) {
            id = below(E);
            int dup = 0;
            for (int j = 0; j < k; j++) dup |= row[j] == id;
            if (!dup || k >= E) break;
          }
          break;
        case SKEW: id = chance(0.6) ? (hot + below(3)) % E : below(E); break;
        case ONE_LOCAL: id = target; break;
        case ONE_REMOTE: id = target >= 0 ? target : below(E); break;
        case LOPSIDED: /* source p favours the experts of one rank, and sends more the higher p is */
          id = chance(0.7) ? ((p * 3) % s->w) * el + below(el) : below(E);
          if (!chance((p + 1.0) / s->w)) id = -1;
          break;
        default: id = below(E);
        }
        if (s->masked > 0 && chance(s->masked)) id = -1;
        if (s->invalid > 0 && chance(s->invalid)) {
          static const int bad[] = {-2, -100, INT_MIN, INT_MAX};
          const int r = below(6);
          id = r < 4 ? bad[r] : r == 4 ? E : E + 1 + below(1000);
        }
        row[k] = id;
      }
    }
  return ids;
}

/* Padded rows the local routes need (what stats[ROWS_NEEDED] reports, before the clamp). */
static long long rows_needed(const spec *s, const int32_t *ids) {
  const int el = s->experts / s->w, lo = s->rank * el;
  long long *n = calloc((size_t)el, sizeof *n), total = 0;
  if (!n) exit(2);
  const size_t all = (size_t)s->w * s->t * s->k;
  for (size_t i = 0; i < all; i++)
    if (ids[i] >= lo && ids[i] < lo + el) n[ids[i] - lo]++;
  for (int e = 0; e < el; e++) {
    long long c = n[e];
    if (s->expert_capacity >= 0 && c > s->expert_capacity) c = s->expert_capacity;
    total += (c + s->pad - 1) / s->pad * s->pad;
  }
  free(n);
  return total;
}

static int capacity_for(const spec *s, long long need) {
  long long c;
  switch (s->cap) {
  case CAP_EXACT: c = need; break;
  case CAP_SHORT: c = need - 1 - need / 4; break;
  case CAP_ZERO: c = 0; break;
  case CAP_RANDOM: c = need > 0 ? (long long)(next() % (uint64_t)(need + need / 2 + 1)) : below(5); break;
  default: c = need + below(2 * s->pad + 3);
  }
  if (c < 0) c = 0;
  if (c > INT_MAX - GUARD) c = INT_MAX - GUARD;
  return (int)c;
}

/* ---- tensors ---- */
enum { O_PEER_RANK, O_PEER_ROUTE, O_COUNTS, O_TPE, O_OFFSETS, O_ROUTE_ROW, O_STATS, NOUT };
static const char *const out_names[] = {"peer_rank", "peer_route", "counts", "tokens_per_expert",
                                        "expert_offsets", "route_row", "stats"};

typedef struct {
  moe_tensor *base[NOUT], *view[NOUT];
  int64_t n[NOUT];
  int on_gpu;
} outputs;

static moe_tensor *new_i32(int64_t n, moe_device dev) {
  moe_tensor *t;
  if (moe_tensor_new(ctx, MOE_I32, 1, &n, dev, &t)) die("tensor_new");
  return t;
}

static void outputs_new(outputs *o, const spec *s, int capacity, moe_device dev) {
  const int el = s->experts / s->w;
  o->n[O_PEER_RANK] = o->n[O_PEER_ROUTE] = capacity;
  o->n[O_COUNTS] = o->n[O_TPE] = el;
  o->n[O_OFFSETS] = el + 1;
  o->n[O_ROUTE_ROW] = (int64_t)s->w * s->t * s->k;
  o->n[O_STATS] = MOE_SCHED_STATS;
  o->on_gpu = dev.kind == MOE_CUDA;
  for (int i = 0; i < NOUT; i++) {
    const int64_t extra = o->on_gpu ? GUARD : 0;
    o->base[i] = new_i32(o->n[i] + extra, dev);
    int64_t shape[2] = {o->n[i], 0};
    int ndim = 1;
    if (i == O_ROUTE_ROW) shape[0] = s->w, shape[1] = (int64_t)s->t * s->k, ndim = 2;
    if (moe_tensor_view(ctx, o->base[i], 0, ndim, shape, &o->view[i])) die("tensor_view");
  }
}

static void outputs_fill(outputs *o) {
  for (int i = 0; i < NOUT; i++)
    if (moe_tensor_fill(ctx, o->base[i], SENTINEL)) die("tensor_fill");
}

static void outputs_free(outputs *o) {
  for (int i = 0; i < NOUT; i++) moe_tensor_free(o->view[i]), moe_tensor_free(o->base[i]);
}

static void args_for(moe_schedule_args *a, const outputs *o, moe_tensor *ids, const spec *s, int capacity) {
  memset(a, 0, sizeof *a);
  a->peer_rank = o->view[O_PEER_RANK];
  a->peer_route = o->view[O_PEER_ROUTE];
  a->counts = o->view[O_COUNTS];
  a->tokens_per_expert = o->view[O_TPE];
  a->expert_offsets = o->view[O_OFFSETS];
  a->route_row = o->view[O_ROUTE_ROW];
  a->stats = o->view[O_STATS];
  a->ids = ids;
  a->experts = s->experts;
  a->rank = s->rank;
  a->pad = s->pad;
  a->capacity = capacity;
  a->expert_capacity = s->expert_capacity;
  a->layout = s->layout;
}

/* Compares the GPU outputs (and their guards) with the CPU's; prints the first differences. */
static int same(const char *who, const outputs *gpu, const outputs *cpu, const char *name) {
  int ok = 1;
  for (int i = 0; i < NOUT; i++) {
    const int64_t n = gpu->n[i], total = n + GUARD;
    int32_t *got = malloc((size_t)total * sizeof *got);
    if (!got) exit(2);
    if (moe_tensor_read(ctx, gpu->base[i], got, (size_t)total * sizeof *got)) die("tensor_read");
    const int32_t *want = moe_tensor_data(cpu->view[i]);
    int shown = 0;
    for (int64_t j = 0; j < total && shown < 4; j++) {
      const int32_t w = j < n ? want[j] : SENTINEL;
      if (got[j] != w) {
        if (ok) printf("FAIL %s [%s]\n", name, who);
        ok = 0;
        shown++;
        printf("     %s[%lld] = %d, expected %d%s\n", out_names[i], (long long)j, got[j], w,
               j >= n ? " (past the end)" : got[j] == SENTINEL ? " (never written)" : "");
      }
    }
    free(got);
  }
  return ok;
}

static void describe(char *buf, size_t len, const spec *s, int capacity) {
  snprintf(buf, len, "%s W=%d T=%d K=%d E=%d rank=%d pad=%d C=%d ec=%d %s %s cap=%s masked=%.2g invalid=%.2g seed=%llu",
           s->label ? s->label : "random", s->w, s->t, s->k, s->experts, s->rank, s->pad, capacity,
           s->expert_capacity, s->layout == MOE_LAYOUT_ROUNDROBIN ? "roundrobin" : "peer_major",
           mode_names[s->mode], cap_names[s->cap], s->masked, s->invalid, (unsigned long long)s->seed);
}

static uint64_t seed_counter = 1;
static spec base(int w, int t, int k, int e, const char *label) {
  spec s;
  memset(&s, 0, sizeof s);
  s.w = w, s.t = t, s.k = k, s.experts = e, s.pad = 1, s.expert_capacity = -1;
  s.layout = MOE_LAYOUT_ROUNDROBIN, s.mode = TOPK, s.cap = CAP_AMPLE;
  s.seed = 0x5eed0000ull + 7919 * seed_counter++;
  s.label = label;
  return s;
}
