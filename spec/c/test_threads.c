/* SPDX-License-Identifier: MIT */
/* test_threads.c -- the CPU backend's threaded loops (lib/parallel.c) give the same bits whatever
 * the thread count: the experts stage and the dense reference at a size where they split their
 * work (H = 1024, F = 2048), run with MOE_THREADS = 1, 3 and 4, compared byte for byte; and
 * moeI_parallel_for covers every index once, for uneven splits; and a MOE_THREADS that cannot be
 * read is refused when a context opens.  Exits non-zero on a failure. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

static moe_ctx *ctx;

static moe_tensor *tensor(moe_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2) {
  return cpu_tensor(ctx, dt, ndim, d0, d1, d2);
}

static void threads(const char *n) { setenv("MOE_THREADS", n, 1); }

/* moeI_parallel_for: every index of [0, n) exactly once */
static int *seen;
static void mark(void *arg, int64_t b, int64_t e) {
  (void)arg;
  for (int64_t i = b; i < e; i++) __atomic_fetch_add(&seen[i], 1, __ATOMIC_RELAXED);
}
static void test_cover(void) {
  const int64_t ns[] = {1, 7, 100, 1001};
  const char *ts[] = {"1", "3", "4", "16"};
  for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
    for (size_t b = 0; b < sizeof ts / sizeof *ts; b++) {
      threads(ts[b]);
      seen = calloc((size_t)ns[a], sizeof *seen);
      moeI_parallel_for(ns[a], 1, mark, NULL);
      int ok = 1;
      for (int64_t i = 0; i < ns[a]; i++) ok &= seen[i] == 1;
      CHECK(ok, "parallel_for n=%lld threads=%s: an index not covered exactly once", (long long)ns[a], ts[b]);
      free(seen);
    }
  threads("1");
  CHECK(moeI_cpu_threads() == 1, "MOE_THREADS=1 gives %d threads", moeI_cpu_threads());
  threads("4");
  CHECK(moeI_cpu_threads() == 4, "MOE_THREADS=4 gives %d threads", moeI_cpu_threads());
  threads("256");
  CHECK(moeI_cpu_threads() == 256, "MOE_THREADS=256 gives %d threads", moeI_cpu_threads());
}

/* A MOE_THREADS that is not an integer from 1 to 256 is refused by moe_ctx_open, with a message
 * that names the value, and the context it hands back closes; a threaded stage that meets one
 * set later falls back to the online CPUs, as where it is unset or empty. */
static void test_env(void) {
  const char *bad[] = {"abc", "0", "-3", "257", "100000", "1.5", "4x", " 4", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    threads(bad[i]);
    CHECK(moeI_env_threads() == -1, "MOE_THREADS=\"%s\" reads as %d, expected -1 (refused)", bad[i],
          moeI_env_threads());
    moe_ctx *c = NULL;
    const int rc = moe_ctx_open(&c);
    CHECK(rc == MOE_ERR_ARG && c != NULL, "MOE_THREADS=\"%s\": open returned %d", bad[i], rc);
    if (c) {
      char want[64];
      snprintf(want, sizeof want, "got \"%s\"", bad[i]);
      CHECK(strstr(moe_errmsg(c), "MOE_THREADS must be an integer from 1 to 256") && strstr(moe_errmsg(c), want),
            "MOE_THREADS=\"%s\": the message is \"%s\"", bad[i], moe_errmsg(c));
      moe_ctx_close(c);
    }
    const int n = moeI_cpu_threads();
    CHECK(n >= 1 && n <= 64, "MOE_THREADS=\"%s\" set after opening: %d threads, expected the online CPUs", bad[i], n);
  }
  threads("");
  CHECK(moeI_env_threads() == 0, "an empty MOE_THREADS reads as %d, expected 0 (unset)", moeI_env_threads());
  moe_ctx *c = NULL;
  CHECK(moe_ctx_open(&c) == MOE_OK, "an empty MOE_THREADS: open failed: %s", c ? moe_errmsg(c) : "no context");
  moe_ctx_close(c);
}

enum { H = 1024, F = 2048, EL = 3, C = 14, K = 2 };

static void test_experts_and_reference(void) {
  moe_tensor *xs = tensor(MOE_BF16, 2, C, H, 0), *wgu = tensor(MOE_BF16, 3, EL, 2 * F, H), *wd = tensor(MOE_BF16, 3, EL, H, F);
  moe_tensor *off = tensor(MOE_I32, 1, EL + 1, 0, 0);
  if (moe_tensor_randn(ctx, xs, 1, 1.0f) || moe_tensor_randn(ctx, wgu, 2, 0.03f) || moe_tensor_randn(ctx, wd, 3, 0.03f)) {
    fprintf(stderr, "randn: %s\n", moe_errmsg(ctx));
    exit(2);
  }
  const int32_t offsets[EL + 1] = {0, 5, 5, 14}; /* rows 5, 0, 9: blocks of 4 and a tail */
  memcpy(moe_tensor_data(off), offsets, sizeof offsets);

  /* the reference over the same tokens: two routes each, one masked */
  moe_tensor *ids = tensor(MOE_I32, 2, C, K, 0), *w = tensor(MOE_F32, 2, C, K, 0);
  int32_t *id = moe_tensor_data(ids);
  float *wt = moe_tensor_data(w);
  for (int n = 0; n < C; n++) {
    id[n * K] = n % EL, id[n * K + 1] = n % 5 == 0 ? -1 : (n + 1) % EL;
    wt[n * K] = 0.75f, wt[n * K + 1] = 0.25f;
  }
  const moe_tensor *gus[] = {wgu}, *dns[] = {wd};

  const char *counts[] = {"1", "3", "4"};
  uint16_t *ys_first = NULL;
  float *ref_first = NULL;
  for (int i = 0; i < 3; i++) {
    threads(counts[i]);
    moe_tensor *ys = tensor(MOE_BF16, 2, C, H, 0), *ref = tensor(MOE_F32, 2, C, H, 0);
    moe_experts_args ea = {ys, xs, off, wgu, wd};
    CHECK(moe_experts(ctx, &ea) == MOE_OK, "experts with %s threads: %s", counts[i], moe_errmsg(ctx));
    moe_reference_args ra = {ref, xs, ids, w, gus, dns, 1, EL, NULL, NULL, NULL};
    CHECK(moe_reference(ctx, &ra) == MOE_OK, "reference with %s threads: %s", counts[i], moe_errmsg(ctx));
    if (i == 0) {
      ys_first = malloc(moe_tensor_nbytes(ys));
      ref_first = malloc(moe_tensor_nbytes(ref));
      memcpy(ys_first, moe_tensor_data(ys), moe_tensor_nbytes(ys));
      memcpy(ref_first, moe_tensor_data(ref), moe_tensor_nbytes(ref));
      int nonzero = 0;
      for (int64_t j = 0; j < (int64_t)C * H; j++) nonzero += ref_first[j] != 0.0f;
      CHECK(nonzero > C * H / 2, "the reference is mostly nonzero (%d of %d)", nonzero, C * H);
    } else {
      CHECK(!memcmp(ys_first, moe_tensor_data(ys), moe_tensor_nbytes(ys)), "experts: %s threads differ from 1", counts[i]);
      CHECK(!memcmp(ref_first, moe_tensor_data(ref), moe_tensor_nbytes(ref)), "reference: %s threads differ from 1",
            counts[i]);
    }
    moe_tensor_free(ys);
    moe_tensor_free(ref);
  }
  free(ys_first);
  free(ref_first);
  moe_tensor *ts[] = {xs, wgu, wd, off, ids, w};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) moe_tensor_free(ts[i]);
}

int main(void) {
  if (moe_ctx_open(&ctx)) return 2;
  test_cover();
  test_env();
  test_experts_and_reference();
  moe_ctx_close(ctx);
  printf("%s: test_threads, %d checks, %d failures\n", failures ? "FAIL" : "PASS", checks, failures);
  return failures ? 1 : 0;
}
