/* SPDX-License-Identifier: MIT */
/* test_schedule.c -- the CPU schedule against layouts worked out by hand from docs/design.md
 * section 2, and its argument errors.  Exits non-zero on the first failed case. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "moelab.h"

static moe_ctx *ctx;

static moe_tensor *i32(int ndim, int64_t d0, int64_t d1, int64_t d2) { return cpu_tensor(ctx, MOE_I32, ndim, d0, d1, d2); }

static void expect(const char *what, const moe_tensor *t, const int32_t *want, int64_t n) {
  const int32_t *got = moe_tensor_data((moe_tensor *)t);
  CHECK(moe_tensor_numel(t) == n, "%s: %lld elements, expected %lld", what, (long long)moe_tensor_numel(t),
        (long long)n);
  for (int64_t i = 0; i < n && i < moe_tensor_numel(t); i++)
    if (got[i] != want[i]) {
      CHECK(0, "%s[%lld] = %d, expected %d", what, (long long)i, got[i], want[i]);
      return;
    }
  checks++;
}

/* The outputs of one call, allocated to the shapes the arguments ask for. */
typedef struct {
  moe_schedule_args a;
  moe_tensor *ids;
} sched;

static sched make(const int32_t *ids, int w, int t, int k, int experts, int rank, int pad, int capacity,
                  int expert_capacity, int layout) {
  sched s;
  memset(&s, 0, sizeof s);
  s.ids = i32(3, w, t, k);
  moe_tensor_write(ctx, s.ids, ids, sizeof(int32_t) * (size_t)w * t * k);
  int el = experts / w;
  s.a.ids = s.ids;
  s.a.peer_rank = i32(1, capacity, 0, 0);
  s.a.peer_route = i32(1, capacity, 0, 0);
  s.a.counts = i32(1, el, 0, 0);
  s.a.tokens_per_expert = i32(1, el, 0, 0);
  s.a.expert_offsets = i32(1, el + 1, 0, 0);
  s.a.route_row = i32(2, w, (int64_t)t * k, 0);
  s.a.stats = i32(1, MOE_SCHED_STATS, 0, 0);
  s.a.experts = experts;
  s.a.rank = rank;
  s.a.pad = pad;
  s.a.capacity = capacity;
  s.a.expert_capacity = expert_capacity;
  s.a.layout = layout;
  return s;
}

static void release(sched *s) {
  moe_tensor_free(s->ids);
  moe_tensor_free(s->a.peer_rank);
  moe_tensor_free(s->a.peer_route);
  moe_tensor_free(s->a.counts);
  moe_tensor_free(s->a.tokens_per_expert);
  moe_tensor_free(s->a.expert_offsets);
  moe_tensor_free(s->a.route_row);
  moe_tensor_free(s->a.stats);
}

typedef struct {
  const int32_t *peer_rank, *peer_route, *counts, *tokens_per_expert, *expert_offsets, *route_row, *stats;
} want;

static void run(const char *name, const int32_t *ids, int w, int t, int k, int experts, int rank, int pad,
                int capacity, int expert_capacity, int layout, want x) {
  sched s = make(ids, w, t, k, experts, rank, pad, capacity, expert_capacity, layout);
  int rc = moe_schedule(ctx, &s.a);
  CHECK(rc == MOE_OK, "%s: rc %d: %s", name, rc, moe_errmsg(ctx));
  if (rc == MOE_OK) {
    char what[96];
    int el = experts / w;
#define EXPECT(field, n)                                   \
  snprintf(what, sizeof what, "%s: " #field, name);        \
  expect(what, s.a.field, x.field, n)
    EXPECT(peer_rank, capacity);
    EXPECT(peer_route, capacity);
    EXPECT(counts, el);
    EXPECT(tokens_per_expert, el);
    EXPECT(expert_offsets, el + 1);
    EXPECT(route_row, (int64_t)w * t * k);
    EXPECT(stats, MOE_SCHED_STATS);
#undef EXPECT
  }
  release(&s);
}

/* ---- case A: W = 2, T = 3, K = 2, E = 4, so EL = 2; rank 0 owns experts 0, 1 and rank 1
 * owns 2, 3.  Route index i = t K + k; flat index = w 6 + i.
 *
 *   rank 0:  i: 0  1  2  3  4  5        rank 1:  i: 0  1  2  3  4  5
 *           id: 0  1  1  3  0 -1                id: 1  0  7  1  2  1
 *
 * -1 is masked; 7 >= E is invalid, at flat index 6 + 2 = 8, whichever rank schedules.
 * For rank 0:  c[0][0] = 2 (i 0, 4)   c[0][1] = 1 (i 1)            n_0 = 3
 *              c[1][0] = 2 (i 1, 2)   c[1][1] = 3 (i 0, 3, 5)      n_1 = 5
 * 8 local routes.  T K = 6 < 1024, so every route is its own logical thread and the ordinal j
 * of a route is its rank among its (e, p) group by ascending i. */
static const int32_t ids_a[12] = {0, 1, 1, 3, 0, -1, /* rank 1 */ 1, 0, 7, 1, 2, 1};

static void case_a(void) {
  /* roundrobin, pad 1, C 16: base = [0, 3], segments sorted by (j, p):
   *   e0: j0: (p0 i0) (p1 i1); j1: (p0 i4)                    -> rows 0, 1, 2
   *   e1: j0: (p0 i1) (p1 i0); j1: (p0 i2) (p1 i3); j2: (p1 i5) -> rows 3 .. 7
   * e.g. (p1 i3): j = 1, base 3 + min(2,1) + min(3,1) + #{q < 1 : c[1][q] > 1} = 3 + 2 + 1 = 6. */
  {
    const int32_t pr[16] = {0, 1, 0, 0, 1, 0, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t pt[16] = {0, 1, 4, 1, 0, 2, 3, 5, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t counts[2] = {3, 5}, tpe[2] = {3, 5}, offs[3] = {0, 3, 8};
    const int32_t rr[12] = {0, 3, 5, -1, 2, -1, /* rank 1 */ 4, 1, -1, 6, -1, 7};
    const int32_t st[5] = {8, 8, 0, 1, 8};
    run("A roundrobin pad 1", ids_a, 2, 3, 2, 4, 0, 1, 16, -1, MOE_LAYOUT_ROUNDROBIN,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* peer_major, pad 1, C 16: segments sorted by (p, i):
   *   e0: (p0 i0) (p0 i4) (p1 i1)                  -> rows 0, 1, 2
   *   e1: (p0 i1) (p0 i2) (p1 i0) (p1 i3) (p1 i5)  -> rows 3 .. 7 */
  {
    const int32_t pr[16] = {0, 0, 1, 0, 0, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t pt[16] = {0, 4, 1, 1, 2, 0, 3, 5, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t counts[2] = {3, 5}, tpe[2] = {3, 5}, offs[3] = {0, 3, 8};
    const int32_t rr[12] = {0, 3, 4, -1, 1, -1, /* rank 1 */ 5, 2, -1, 6, -1, 7};
    const int32_t st[5] = {8, 8, 0, 1, 8};
    run("A peer_major pad 1", ids_a, 2, 3, 2, 4, 0, 1, 16, -1, MOE_LAYOUT_PEER_MAJOR,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* roundrobin, pad 4, C 16: padded = [4, 8], base = [0, 4], 12 rows needed.  e0 as before
   * in rows 0..2, row 3 padding; e1's five routes in rows 4..8, rows 9..11 padding. */
  {
    const int32_t pr[16] = {0, 1, 0, -1, 0, 1, 0, 1, 1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t pt[16] = {0, 1, 4, -1, 1, 0, 2, 3, 5, -1, -1, -1, -1, -1, -1, -1};
    const int32_t counts[2] = {3, 5}, tpe[2] = {4, 8}, offs[3] = {0, 4, 12};
    const int32_t rr[12] = {0, 4, 6, -1, 2, -1, /* rank 1 */ 5, 1, -1, 7, -1, 8};
    const int32_t st[5] = {12, 12, 0, 1, 8};
    run("A roundrobin pad 4", ids_a, 2, 3, 2, 4, 0, 4, 16, -1, MOE_LAYOUT_ROUNDROBIN,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* the same with capacity C = 6 < 12: offsets = min([0, 4, 12], 6) = [0, 4, 6], sizes [4, 2].
   * e0 keeps rows 0..2; e1 keeps rows 4, 5 = (p0 i1), (p1 i0) and drops the routes that would
   * have had rows 6, 7, 8: (p0 i2), (p1 i3), (p1 i5).  3 dropped; rows needed stay 12. */
  {
    const int32_t pr[6] = {0, 1, 0, -1, 0, 1};
    const int32_t pt[6] = {0, 1, 4, -1, 1, 0};
    const int32_t counts[2] = {3, 2}, tpe[2] = {4, 2}, offs[3] = {0, 4, 6};
    const int32_t rr[12] = {0, 4, -1, -1, 2, -1, /* rank 1 */ 5, 1, -1, -1, -1, -1};
    const int32_t st[5] = {12, 6, 3, 1, 8};
    run("A roundrobin pad 4 capacity 6", ids_a, 2, 3, 2, 4, 0, 4, 6, -1, MOE_LAYOUT_ROUNDROBIN,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* C = 0: nothing placed, all 8 local routes dropped, offsets all 0. */
  {
    const int32_t counts[2] = {0, 0}, tpe[2] = {0, 0}, offs[3] = {0, 0, 0};
    const int32_t rr[12] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t st[5] = {12, 0, 8, 1, 8};
    run("A capacity 0", ids_a, 2, 3, 2, 4, 0, 4, 0, -1, MOE_LAYOUT_ROUNDROBIN,
        (want){NULL, NULL, counts, tpe, offs, rr, st});
  }
  /* expert_capacity 2, roundrobin, pad 1, C 16: n = [min(3,2), min(5,2)] = [2, 2], base [0, 2].
   * Positions as in the first case; those >= 2 are dropped: e0 keeps (p0 i0) (p1 i1) and drops
   * (p0 i4); e1 keeps (p0 i1) (p1 i0) in rows 2, 3 and drops 3.  4 dropped. */
  {
    const int32_t pr[16] = {0, 1, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t pt[16] = {0, 1, 1, 0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t counts[2] = {2, 2}, tpe[2] = {2, 2}, offs[3] = {0, 2, 4};
    const int32_t rr[12] = {0, 2, -1, -1, -1, -1, /* rank 1 */ 3, 1, -1, -1, -1, -1};
    const int32_t st[5] = {4, 4, 4, 1, 8};
    run("A roundrobin expert_capacity 2", ids_a, 2, 3, 2, 4, 0, 1, 16, 2, MOE_LAYOUT_ROUNDROBIN,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* expert_capacity 2, peer_major, pad 4, C 16: padded [4, 4], base [0, 4].  Rank 0's routes
   * come first in each segment: e0 keeps (p0 i0) (p0 i4), drops (p1 i1); e1 keeps (p0 i1)
   * (p0 i2) in rows 4, 5 and drops rank 1's three.  None of rank 1's routes gets a row. */
  {
    const int32_t pr[16] = {0, 0, -1, -1, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t pt[16] = {0, 4, -1, -1, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int32_t counts[2] = {2, 2}, tpe[2] = {4, 4}, offs[3] = {0, 4, 8};
    const int32_t rr[12] = {0, 4, 5, -1, 1, -1, /* rank 1 */ -1, -1, -1, -1, -1, -1};
    const int32_t st[5] = {8, 8, 4, 1, 8};
    run("A peer_major pad 4 expert_capacity 2", ids_a, 2, 3, 2, 4, 0, 4, 16, 2, MOE_LAYOUT_PEER_MAJOR,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  /* rank 1, roundrobin, pad 1, C 4: local experts 0, 1 are global 2, 3.  c[0][1] = 1 (rank 1
   * i4 -> 2), c[1][0] = 1 (rank 0 i3 -> 3); the invalid id of rank 1 is still counted by rank 1,
   * and by rank 0 above: invalid ids are counted over all ranks. */
  {
    const int32_t pr[4] = {1, 0, -1, -1};
    const int32_t pt[4] = {4, 3, -1, -1};
    const int32_t counts[2] = {1, 1}, tpe[2] = {1, 1}, offs[3] = {0, 1, 2};
    const int32_t rr[12] = {-1, -1, -1, 1, -1, -1, /* rank 1 */ -1, -1, -1, -1, 0, -1};
    const int32_t st[5] = {2, 2, 0, 1, 8};
    run("A rank 1", ids_a, 2, 3, 2, 4, 1, 1, 4, -1, MOE_LAYOUT_ROUNDROBIN, (want){pr, pt, counts, tpe, offs, rr, st});
  }
}

/* ---- case B: the logical threads.  W = 2, T = 1030, K = 1, E = 2 (EL = 1), rank 0.
 * T K = 1030 > 1024, so thread th owns th and th + 1024 (for th < 6).
 *   rank 0: i 1, 3, 1024, 1025 -> expert 0; i 1029 -> 2 (invalid, flat 1029)
 *   rank 1: i 2, 1026 -> expert 0; i 5 -> 1 (rank 1's); i 7 -> -2 (invalid, flat 1037)
 * Everything else is -1.
 * Rank 0's ordinals by thread: th0 visits 1024 (j0); th1 visits 1 (j1) then 1025 (j2); th3
 * visits 3 (j3).  Rank 1: th2 visits 2 (j0) then 1026 (j1).  c[0] = [4, 2].
 * roundrobin rows (sorted by (j, p)): j0: (p0 1024) (p1 2); j1: (p0 1) (p1 1026); j2: (p0 1025);
 * j3: (p0 3) -> rows 0..5.  Check (p0 3): j3: min(4,3) + min(2,3) + 0 = 5.
 * peer_major rows (sorted by (p, i)): (p0 1) (p0 3) (p0 1024) (p0 1025) (p1 2) (p1 1026). */
static void case_b(void) {
  enum { T = 1030 };
  int32_t *ids = malloc(sizeof(int32_t) * 2 * T), *rr = malloc(sizeof(int32_t) * 2 * T);
  for (int i = 0; i < 2 * T; i++) ids[i] = -1;
  ids[1] = ids[3] = ids[1024] = ids[1025] = 0;
  ids[1029] = 2;
  ids[T + 2] = ids[T + 1026] = 0;
  ids[T + 5] = 1;
  ids[T + 7] = -2;
  const int32_t counts[1] = {6}, tpe[1] = {6}, offs[2] = {0, 6};
  const int32_t st[5] = {6, 6, 0, 2, 1029};
  {
    const int32_t pr[8] = {0, 1, 0, 1, 0, 0, -1, -1};
    const int32_t pt[8] = {1024, 2, 1, 1026, 1025, 3, -1, -1};
    for (int i = 0; i < 2 * T; i++) rr[i] = -1;
    rr[1024] = 0, rr[T + 2] = 1, rr[1] = 2, rr[T + 1026] = 3, rr[1025] = 4, rr[3] = 5;
    run("B roundrobin threads", ids, 2, T, 1, 2, 0, 1, 8, -1, MOE_LAYOUT_ROUNDROBIN,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  {
    const int32_t pr[8] = {0, 0, 0, 0, 1, 1, -1, -1};
    const int32_t pt[8] = {1, 3, 1024, 1025, 2, 1026, -1, -1};
    for (int i = 0; i < 2 * T; i++) rr[i] = -1;
    rr[1] = 0, rr[3] = 1, rr[1024] = 2, rr[1025] = 3, rr[T + 2] = 4, rr[T + 1026] = 5;
    run("B peer_major", ids, 2, T, 1, 2, 0, 1, 8, -1, MOE_LAYOUT_PEER_MAJOR,
        (want){pr, pt, counts, tpe, offs, rr, st});
  }
  free(ids);
  free(rr);
}

/* ---- argument errors: MOE_ERR_ARG and a message that starts with the stage and names the
 * argument. */
static void bad(const char *name, sched *s, const char *needle) {
  int rc = moe_schedule(ctx, &s->a);
  const char *msg = moe_errmsg(ctx);
  CHECK(rc == MOE_ERR_ARG, "%s: rc %d, expected MOE_ERR_ARG", name, rc);
  CHECK(strncmp(msg, "schedule: ", 10) == 0 && strstr(msg, needle), "%s: message \"%s\" lacks \"%s\"", name, msg,
        needle);
}

static void case_errors(void) {
  sched s = make(ids_a, 2, 3, 2, 4, 0, 1, 16, -1, MOE_LAYOUT_ROUNDROBIN);
  CHECK(moe_schedule(ctx, &s.a) == MOE_OK, "valid arguments refused: %s", moe_errmsg(ctx));

  s.a.experts = 3;
  bad("experts not a multiple", &s, "experts (3) must be a multiple of the world size (2)");
  s.a.experts = 0;
  bad("experts 0", &s, "experts must be >= 1, got 0");
  s.a.experts = 4;
  s.a.rank = 2;
  bad("rank too large", &s, "rank must be between 0 and 1");
  s.a.rank = -1;
  bad("rank negative", &s, "got -1");
  s.a.rank = 0;
  s.a.pad = 0;
  bad("pad 0", &s, "pad must be >= 1, got 0");
  s.a.pad = 1;
  s.a.capacity = -1;
  bad("capacity negative", &s, "capacity must be >= 0, got -1");
  s.a.capacity = 16;
  s.a.layout = 7;
  bad("layout", &s, "layout must be roundrobin (0) or peer_major (1), got 7");
  s.a.layout = MOE_LAYOUT_ROUNDROBIN;

  moe_tensor *keep = s.a.counts;
  s.a.counts = i32(1, 3, 0, 0);
  bad("counts shape", &s, "counts must be i32 [2], got i32 [3] on cpu");
  moe_tensor_free(s.a.counts);
  s.a.counts = keep;

  keep = s.a.route_row;
  s.a.route_row = i32(2, 2, 5, 0);
  bad("route_row shape", &s, "route_row must be i32 [2, 6]");
  moe_tensor_free(s.a.route_row);
  s.a.route_row = keep;

  keep = s.a.peer_rank;
  s.a.peer_rank = i32(1, 15, 0, 0);
  bad("peer_rank shape", &s, "peer_rank must be i32 [16]");
  moe_tensor_free(s.a.peer_rank);
  s.a.peer_rank = keep;

  keep = s.a.tokens_per_expert;
  s.a.tokens_per_expert = s.a.counts;
  bad("outputs alias", &s, "share memory");
  s.a.tokens_per_expert = keep;

  moe_tensor *flat = i32(2, 2, 6, 0);
  s.a.ids = flat;
  bad("ids 2-D", &s, "ids must be i32 [_, _, _]");
  moe_tensor_free(flat);
  s.a.ids = s.ids;

  keep = s.a.stats;
  s.a.stats = NULL;
  bad("stats missing", &s, "stats must be i32 [5], got nothing");
  s.a.stats = keep;

  CHECK(moe_schedule(ctx, NULL) == MOE_ERR_ARG, "NULL arguments accepted");
  CHECK(moe_schedule(ctx, &s.a) == MOE_OK && moe_errmsg(ctx)[0] == '\0', "valid arguments refused after errors: %s",
        moe_errmsg(ctx));
  release(&s);
}

int main(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) return 2;
  case_a();
  case_b();
  case_errors();
  moe_ctx_close(ctx);
  if (failures) {
    fprintf(stderr, "test_schedule: %d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("test_schedule: %d checks passed\n", checks);
  return 0;
}
