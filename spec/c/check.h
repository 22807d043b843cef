/* SPDX-License-Identifier: MIT */
/* check.h -- what the C test programs (spec/c) share: CHECK(cond, fmt, ...) counts a check and,
 * when cond is false, a failure, printing file:line, the condition and the message; and
 * cpu_tensor, a new CPU tensor of up to three dimensions or the end of the run. */
#ifndef MOELAB_SPEC_CHECK_H
#define MOELAB_SPEC_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "moelab.h"

static int checks, failures;

#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    checks++;                                                                                      \
    if (!(cond)) {                                                                                 \
      failures++;                                                                                  \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);                    \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fputc('\n', stderr);                                                                         \
    }                                                                                              \
  } while (0)

#if defined(__GNUC__)
__attribute__((unused))
#endif
static moe_tensor *cpu_tensor(moe_ctx *ctx, moe_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2) {
  const int64_t shape[3] = {d0, d1, d2};
  const moe_device cpu = {MOE_CPU, 0};
  moe_tensor *t = NULL;
  if (moe_tensor_new(ctx, dt, ndim, shape, cpu, &t)) {
    fprintf(stderr, "tensor_new: %s\n", moe_errmsg(ctx));
    exit(2);
  }
  return t;
}

#endif
