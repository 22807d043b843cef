/* SPDX-License-Identifier: MIT */
/* test_fp8_quotient.c -- moeI_fp8_quantize_token (lib/fp8_math.h) gives moeI_fp8_quantize's byte
 * on its whole domain: every bf16 amax A (every positive finite bf16, and infinity) with its token
 * scale s and r = 1 / s, and every bf16 x in [0, A] (about 0.43 x 10^9 pairs, over the CPU's
 * threads); -0, and -x for every 64th amax (every step is symmetric in the sign, -0 aside).  The
 * GPU computes the same products, FMAs and division, IEEE-rounded as here. */
#include <stdint.h>

#include "check.h"
#include "fp8_math.h"
#include "internal.h"

static float bf16_value(uint32_t bits) { return moe_bf16_to_f32((uint16_t)bits); }

enum { TOP = 0x7F80 }; /* +infinity; 0x7F7F the largest finite bf16 */

typedef struct {
  int64_t pairs, wrong;
  uint32_t first_a, first_x; /* the first pair that differs, where wrong > 0 */
} tally;

static tally tallies[TOP + 1];

/* amaxes [begin, end) (their bits), each against every x of at most its magnitude */
static void check_amaxes(void *arg, int64_t begin, int64_t end) {
  (void)arg;
  for (int64_t a = begin; a < end; a++) {
    const float amax = bf16_value((uint32_t)a), s = moeI_fp8_token_scale(amax), r = 1.0f / s;
    /* an amax under the floor has the floor's scale: only the largest such needs its x's */
    if (a + 1 <= TOP && bf16_value((uint32_t)a + 1) <= MOE_FP8_TOKEN_FLOOR) continue;
    tally *t = &tallies[a];
    for (uint32_t xb = 0; xb <= (uint32_t)a; xb++)
      for (int neg = 0; neg < (xb == 0 || a % 64 == 0 ? 2 : 1); neg++) {
        const float x = bf16_value(xb | (neg ? 0x8000u : 0u));
        t->pairs++;
        if (moeI_fp8_quantize(x, s) != moeI_fp8_quantize_token(x, s, r) && t->wrong++ == 0)
          t->first_a = (uint32_t)a, t->first_x = xb | (neg ? 0x8000u : 0u);
      }
  }
}

int main(void) {
  moeI_parallel_for(TOP, 64, check_amaxes, NULL); /* the finite amaxes, bits 0 .. 0x7F7F */
  check_amaxes(NULL, TOP, TOP + 1);                 /* and infinity */
  int64_t pairs = 0, wrong = 0;
  for (int a = 0; a <= TOP; a++) {
    pairs += tallies[a].pairs, wrong += tallies[a].wrong;
    if (tallies[a].wrong && failures < 10)
      CHECK(0, "amax %g (bf16 0x%04x), x %g (0x%04x): the bytes differ (%lld pairs of this amax)",
            (double)bf16_value(tallies[a].first_a), tallies[a].first_a, (double)bf16_value(tallies[a].first_x),
            tallies[a].first_x, (long long)tallies[a].wrong);
  }
  CHECK(pairs > 400000000, "only %lld pairs checked", (long long)pairs);
  printf("%lld pairs, %lld differ; %d checks, %d failed\n", (long long)pairs, (long long)wrong, checks, failures);
  return failures != 0;
}
