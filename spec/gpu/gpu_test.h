/* SPDX-License-Identifier: MIT */
/* gpu_test.h -- what the GPU programs (spec/gpu's tests, bench/'s programs that check a stage
 * before timing it) share: the context, one PASS/FAIL line per check, API calls that must
 * succeed, and tensors made by shape.  Each program includes it once; its definitions are
 * static, so the ones a program does not use cost nothing. */
#pragma once

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "moelab.h"

static moe_ctx *ctx;
static int failures;
static const moe_device CPU = {MOE_CPU, 0};
#if defined(__GNUC__)
__attribute__((unused))
#endif
static const moe_device GPU = {MOE_CUDA, 0};

/* An API call that must succeed on context c; anything else ends the run (the state is unknown
 * after it). */
#define TRY_ON(c, call)                                                                                                \
  do {                                                                                                                 \
    if ((call) != MOE_OK) {                                                                                            \
      printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, moe_errmsg(c));                                       \
      exit(1);                                                                                                         \
    }                                                                                                                  \
  } while (0)
#define TRY(call) TRY_ON(ctx, call)

/* NEW(dtype, device, d0, d1, ...): a new tensor of that shape on the program's context. */
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define NEW(dt, dev, ...) tnew(dt, dev, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__))

#if defined(__GNUC__)
static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3), unused));
#endif
/* One line "PASS ..." or "FAIL ..."; a failure is counted, the run goes on. */
static void check(int ok, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%s ", ok ? "PASS" : "FAIL");
  vprintf(fmt, ap);
  putchar('\n');
  va_end(ap);
  fflush(stdout);
  failures += !ok;
}

static inline moe_tensor *tnew_on(moe_ctx *c, moe_dtype dt, moe_device dev, int ndim, const int64_t *shape) {
  moe_tensor *t;
  TRY_ON(c, moe_tensor_new(c, dt, ndim, shape, dev, &t));
  return t;
}
static inline moe_tensor *tnew(moe_dtype dt, moe_device dev, int ndim, const int64_t *shape) {
  return tnew_on(ctx, dt, dev, ndim, shape);
}

/* Opens the program's context; without a GPU, says so and exits 77 (skipped). */
static inline void open_gpu_ctx(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) {
    printf("FAIL cannot open a context\n");
    exit(1);
  }
  int n = 0;
  if (moe_device_count(ctx, MOE_CUDA, &n) != MOE_OK || n == 0) {
    printf("SKIP: no GPU\n");
    moe_ctx_close(ctx);
    exit(77);
  }
}
