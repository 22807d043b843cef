/* SPDX-License-Identifier: MIT */
/* parallel.c -- fork-join over index ranges for the CPU backend's heavy loops (the expert MLP of
 * experts.c and reference.c): threads started for the call and joined before it returns, so
 * nothing outlives it (no pool to stop when the Lua module is unloaded).  A call of ~1 M
 * multiply-adds per thread or more pays for the ~50 us a thread costs to start. */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

enum { MAX_THREADS = MOEI_MAX_THREADS };

int moeI_env_threads(void) {
  const char *s = getenv("MOE_THREADS");
  if (!s || !*s) return 0;
  if (*s < '0' || *s > '9') return -1; /* strtol would take " 4" and "+4" */
  char *end;
  errno = 0;
  const long v = strtol(s, &end, 10);
  return *end == '\0' && errno == 0 && v >= 1 && v <= MAX_THREADS ? (int)v : -1;
}

int moeI_cpu_threads(void) {
  /* a value moe_ctx_open refused can only be met here if it was set after the context opened:
   * the online CPUs then, since a stage cannot fail for it halfway */
  const int v = moeI_env_threads();
  if (v > 0) return v;
  /* asked once: glibc reads /sys for it, too slow for every call of the small-shape paths */
  static atomic_int online;
  int c = atomic_load_explicit(&online, memory_order_relaxed);
  if (c == 0) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    c = n < 1 ? 1 : n > 64 ? 64 : (int)n;
    atomic_store_explicit(&online, c, memory_order_relaxed);
  }
  return c;
}

typedef struct {
  void (*fn)(void *arg, int64_t begin, int64_t end);
  void *arg;
  int64_t begin, end;
} piece;

static void *run_piece(void *p) {
  const piece *q = p;
  q->fn(q->arg, q->begin, q->end);
  return NULL;
}

void moeI_parallel_for(int64_t n, int64_t grain, void (*fn)(void *arg, int64_t begin, int64_t end), void *arg) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t t = n / grain; /* work for that many threads at most: too little for two, and no thread is asked for */
  if (t >= 2 && t > moeI_cpu_threads()) t = moeI_cpu_threads();
  if (t <= 1) {
    fn(arg, 0, n);
    return;
  }
  piece pieces[MAX_THREADS];
  pthread_t th[MAX_THREADS];
  int started[MAX_THREADS];
  for (int64_t i = 0; i < t; i++) pieces[i] = (piece){fn, arg, n * i / t, n * (i + 1) / t};
  for (int64_t i = 1; i < t; i++) started[i] = pthread_create(&th[i], NULL, run_piece, &pieces[i]) == 0;
  run_piece(&pieces[0]);
  for (int64_t i = 1; i < t; i++) {
    if (started[i]) pthread_join(th[i], NULL);
    else run_piece(&pieces[i]); /* could not start a thread: the caller does that piece too */
  }
}
