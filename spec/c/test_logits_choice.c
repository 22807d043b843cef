/* SPDX-License-Identifier: MIT */
/* test_logits_choice.c -- which path moe_logits takes on a GPU (moeI_logits_tensor), for every
 * option, compute capability and problem, without a GPU: the choice reads only the context's
 * option, H and where x and w start.  One row per case: the path and a phrase of the report. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "internal.h"

int main(void) {
  moe_ctx *ctx = NULL;
  if (moe_ctx_open(&ctx) != MOE_OK) return 1;
  moe_tensor *x64 = cpu_tensor(ctx, MOE_BF16, 2, 4, 64, 0), *w64 = cpu_tensor(ctx, MOE_BF16, 2, 8, 64, 0);
  moe_tensor *x100 = cpu_tensor(ctx, MOE_BF16, 2, 4, 100, 0), *w100 = cpu_tensor(ctx, MOE_BF16, 2, 8, 100, 0);
  moe_tensor *base = cpu_tensor(ctx, MOE_BF16, 1, 4 * 64 + 1, 0, 0), *x_odd = NULL;
  const int64_t shape[2] = {4, 64};
  if (moe_tensor_view(ctx, base, 1, 2, shape, &x_odd)) return 1; /* 2 bytes past an aligned start */
  const struct {
    const char *option;
    int cc;
    const moe_tensor *x, *w;
    int tensor;
    const char *phrase;
  } rows[] = {
      {"tensor", 9, x64, w64, 1, "tensor\ntensor: runs"},
      {"tensor", 8, x64, w64, 1, "exact: not needed"},
      {"auto", 9, x64, w64, 1, "bf16 tensor-core products"},
      {"exact", 9, x64, w64, 0, "exact\ntensor: not chosen (the context's option logits is \"exact\")"},
      {"tensor", 7, x64, w64, 0, "compute capability 7.x has no bf16 tensor cores"},
      {"tensor", 9, x100, w100, 0, "H = 100 is not a multiple of 8"},
      {"tensor", 9, x_odd, w64, 0, "x is not 16-byte aligned"},
      {"tensor", 9, x64, x_odd, 0, "w is not 16-byte aligned"},
      {"tensor", 9, x100, w100, 0, "exact: runs (f32 fused multiply-adds"},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    CHECK(moe_ctx_config(ctx, "logits", rows[i].option) == MOE_OK, "row %zu: %s", i, moe_errmsg(ctx));
    char report[512];
    int got = moeI_logits_tensor(ctx, rows[i].x, rows[i].w, rows[i].cc, report, sizeof report);
    CHECK(got == rows[i].tensor, "row %zu (%s, cc %d): tensor %d, want %d", i, rows[i].option, rows[i].cc, got,
          rows[i].tensor);
    CHECK(strstr(report, rows[i].phrase) != NULL, "row %zu: report\n%s\nlacks \"%s\"", i, report, rows[i].phrase);
    CHECK(moeI_logits_tensor(ctx, rows[i].x, rows[i].w, rows[i].cc, NULL, 0) == got, "row %zu without a report", i);
  }
  /* the Hopper kernel's expert tile: fewest columns past E, then four tiles across */
  const struct {
    int64_t E;
    int tile;
  } tiles[] = {{1, 64}, {8, 64}, {64, 64}, {96, 96}, {128, 64}, {129, 64}, {160, 64}, {192, 64},
               {256, 64}, {384, 96}, {385, 64}, {512, 128}, {640, 128}, {1024, 128}};
  for (size_t i = 0; i < sizeof tiles / sizeof tiles[0]; i++)
    CHECK(moeI_logits_wgmma_tile(tiles[i].E) == tiles[i].tile, "E %lld: tile %d, want %d", (long long)tiles[i].E,
          moeI_logits_wgmma_tile(tiles[i].E), tiles[i].tile);
  /* the option as read back, and what it refuses */
  CHECK(moe_ctx_config(ctx, "logits", "auto") == MOE_OK && strcmp(moe_ctx_config_value(ctx, "logits"), "tensor") == 0,
        "auto reads back as tensor");
  CHECK(moe_ctx_config(ctx, "logits", "fast") == MOE_ERR_ARG, "fast refused");
  CHECK(strstr(moe_errmsg(ctx), "config: logits must be auto or one of tensor, exact, got \"fast\"") != NULL, "%s",
        moe_errmsg(ctx));
  /* on the CPU the option does not matter: the logits are the CPU's and explain says so */
  moe_tensor *out = cpu_tensor(ctx, MOE_F32, 2, 4, 8, 0);
  char report[256];
  CHECK(moe_logits_explain(ctx, out, x64, w64, report, sizeof report) == MOE_OK && strncmp(report, "cpu\n", 4) == 0,
        "cpu explain: %s", moe_errmsg(ctx));
  CHECK(moe_logits_explain(ctx, out, x64, w64, report, 0) == MOE_ERR_ARG, "a report of 0 bytes is refused");
  CHECK(strstr(moe_errmsg(ctx), "logits: report must hold at least one byte") != NULL, "%s", moe_errmsg(ctx));
  /* the same check (moeI_check_report) behind every call that writes a report names its caller */
  CHECK(moe_device_info(ctx, (moe_device){MOE_CPU, 0}, report, 0) == MOE_ERR_ARG, "device_info: 0 bytes refused");
  CHECK(strstr(moe_errmsg(ctx), "device_info: report must hold at least one byte") != NULL, "%s", moe_errmsg(ctx));
  moe_tensor *all[] = {x64, w64, x100, w100, x_odd, base, out};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  moe_ctx_close(ctx);
  printf("%d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
