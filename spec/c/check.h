/* check.h -- the counting check of the C test programs (spec/c): CHECK(cond, fmt, ...) counts a
 * check and, when cond is false, a failure, printing file:line, the condition and the message. */
#ifndef MOELAB_SPEC_CHECK_H
#define MOELAB_SPEC_CHECK_H

#include <stdio.h>

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

#endif
