/* SPDX-License-Identifier: MIT */
/* consumer.c -- a program of a host project, built against an installed moelab through
 * find_package and through pkg-config, with the shared and with the static library
 * (spec/package_spec.lua).  It runs the experts stage on the CPU over buffers it owns
 * (moe_tensor_wrap) and over tensors moelab allocates, and requires the same bits from both and
 * rows the stage did write.  Built with MOE_CONSUMER_CLASH it also defines a function named like
 * one of moelab's internal ones, as a host unaware of them may: each side must keep its own.
 * Prints one line and exits 0 when all holds, 1 otherwise. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moelab.h"

enum { C = 5, H = 8, F = 4, EL = 2 };

#ifdef MOE_CONSUMER_CLASH
/* The name of moelab's CPU experts stage (lib/experts.c).  Were moelab's own calls bound here,
 * its rows would stay unwritten and the count below would grow. */
static int clash_calls;
int moeI_experts_cpu(void);
int moeI_experts_cpu(void) { return ++clash_calls; }
#endif

static moe_ctx *ctx;

#define TRY(call)                                                                                  \
  do {                                                                                             \
    if ((call) != MOE_OK) {                                                                        \
      printf("consumer: %s failed: %s\n", #call, moe_errmsg(ctx));                                 \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

/* The program's own memory: inputs, weights, offsets and the output of the wrapped run. */
static uint16_t x[C * H], w_gate_up[EL * 2 * F * H], w_down[EL * H * F], own_out[C * H], lib_out[C * H];
static int32_t offsets[EL + 1] = {0, 3, C}; /* expert 0: rows 0..2, expert 1: rows 3..4 */

/* bf16 values in [-1, 1) from a fixed linear congruential sequence. */
static void fill(uint16_t *v, int n, uint32_t seed) {
  for (int i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = moe_f32_to_bf16((float)(seed >> 8) / 8388608.0f - 1.0f);
  }
}

/* The experts stage into out over four input tensors, which the call frees. */
static void experts(moe_tensor *out, moe_tensor *xt, moe_tensor *off, moe_tensor *gu, moe_tensor *dn) {
  moe_experts_args a = {.out = out, .x = xt, .offsets = off, .w_gate_up = gu, .w_down = dn};
  TRY(moe_experts(ctx, &a));
  moe_tensor_free(xt), moe_tensor_free(off), moe_tensor_free(gu), moe_tensor_free(dn);
}

/* A tensor moelab allocates, holding a copy of host. */
static moe_tensor *copied(moe_dtype dt, int ndim, const int64_t *shape, const void *host, size_t nbytes) {
  moe_tensor *t = NULL;
  TRY(moe_tensor_new(ctx, dt, ndim, shape, (moe_device){MOE_CPU, 0}, &t));
  if (host) TRY(moe_tensor_write(ctx, t, host, nbytes));
  return t;
}

/* A tensor over the program's own memory. */
static moe_tensor *wrapped(moe_dtype dt, int ndim, const int64_t *shape, void *host) {
  moe_tensor *t = NULL;
  TRY(moe_tensor_wrap(ctx, host, dt, ndim, shape, (moe_device){MOE_CPU, 0}, &t));
  return t;
}

int main(void) {
  const int64_t s_x[] = {C, H}, s_off[] = {EL + 1}, s_gu[] = {EL, 2 * F, H}, s_dn[] = {EL, H, F};
  if (moe_libversion_number() != MOE_VERSION_NUMBER) {
    printf("consumer: library %s under header %s\n", moe_libversion(), MOE_VERSION);
    return 1;
  }
  fill(x, C * H, 1), fill(w_gate_up, EL * 2 * F * H, 2), fill(w_down, EL * H * F, 3);
  TRY(moe_ctx_open(&ctx));

  moe_tensor *lib = copied(MOE_BF16, 2, s_x, NULL, 0);
  experts(lib, copied(MOE_BF16, 2, s_x, x, sizeof x), copied(MOE_I32, 1, s_off, offsets, sizeof offsets),
          copied(MOE_BF16, 3, s_gu, w_gate_up, sizeof w_gate_up), copied(MOE_BF16, 3, s_dn, w_down, sizeof w_down));
  TRY(moe_tensor_read(ctx, lib, lib_out, sizeof lib_out));
  moe_tensor_free(lib);

  moe_tensor *own = wrapped(MOE_BF16, 2, s_x, own_out);
  experts(own, wrapped(MOE_BF16, 2, s_x, x), wrapped(MOE_I32, 1, s_off, offsets),
          wrapped(MOE_BF16, 3, s_gu, w_gate_up), wrapped(MOE_BF16, 3, s_dn, w_down));
  moe_tensor_free(own);
  moe_ctx_close(ctx);

  int written = 0;
  for (int i = 0; i < C * H; i++) written += own_out[i] != 0;
  if (memcmp(own_out, lib_out, sizeof own_out) != 0 || written < C * H / 2) {
    printf("consumer: experts over the program's buffers differ from moelab's tensors, or wrote %d of %d values\n",
           written, C * H);
    return 1;
  }
  const char *kept = "";
#ifdef MOE_CONSUMER_CLASH
  if (moeI_experts_cpu() != 1) {
    printf("consumer: moelab called the program's moeI_experts_cpu %d times\n", clash_calls - 1);
    return 1;
  }
  kept = "; own moeI_experts_cpu kept";
#endif
  printf("consumer: moelab %s, experts over own buffers equal moelab's tensors: %d values, %d written%s\n",
         moe_libversion(), C * H, written, kept);
  return 0;
}
