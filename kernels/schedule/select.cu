/* SPDX-License-Identifier: MIT */
// select.cu -- which kernel runs a schedule on the GPU: the stage's one table (select.cuh walks it).
//
// bitmap first, wherever it fits: at or ahead of every other kernel there; grid for the rest (more
// than 128 experts a rank, more than 4,096 positions a unit, ...).  The numbers behind the order,
// and the kernels measured and dropped, are in docs/perf/schedule.md.
#include <limits.h>

#include "schedule.cuh"

#define STAGE "schedule"

namespace {

const Candidate<moe_schedule_args> kTable[] = {
    {"bitmap", moeI_schedule_bitmap_fits, moeI_schedule_bitmap_run},
    {"grid", moeI_schedule_grid_fits, moeI_schedule_grid_run},
};

// Every kernel indexes routes, rows of a chunk and experts in 32 bits, with loop steps of up to a
// few thousand past the end: sizes within 2^16 of 2^31 (legal on the CPU) are refused for all.
int cuda_bounds(moe_ctx *ctx, const moe_schedule_args *a) {
  const long long tk_all = a->ids->shape[1] * a->ids->shape[2], el_all = a->experts / a->ids->shape[0];
  if (tk_all > INT_MAX - 65536 || el_all > INT_MAX - 65536)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                       STAGE ": %lld routes a rank and %lld experts a rank; cuda takes at most 2^31 - 65536 of each",
                       tk_all, el_all);
  return MOE_OK;
}

} // namespace

extern "C" int moeI_schedule_cuda(moe_ctx *ctx, const moe_schedule_args *a) {
  const int rc = cuda_bounds(ctx, a);
  return rc ? rc : select_run(ctx, STAGE, MOEI_CFG_SCHEDULE_KERNEL, kTable, a);
}

extern "C" int moeI_schedule_explain_cuda(moe_ctx *ctx, const moe_schedule_args *a, char *report, size_t n) {
  const int rc = cuda_bounds(ctx, a);
  return rc ? rc : select_explain(ctx, STAGE, MOEI_CFG_SCHEDULE_KERNEL, kTable, a, report, n);
}

extern "C" const char *moeI_schedule_kernels(void) { return candidate_names(kTable); }
