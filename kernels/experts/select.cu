/* SPDX-License-Identifier: MIT */
// select.cu -- which kernel runs stage 4 (experts) on a GPU: the candidates in the order they are
// tried (kernels/select.cuh walks them).  "auto" runs the first that takes the problem:
//
//   sm90w   the weights-as-M tiles (sm90_wt.cuh): compute capability 9.0 and the Hopper kernels'
//           requirements (sm90.cuh); declines where the experts average fewer than two row tiles
//           (C < 2 BM EL), where the row tiles are faster (docs/perf/experts.md)
//   sm90x2  the row tiles in clusters of two (sm90_rows.cuh): the same requirements, and a
//           cluster of two must be placeable
//   sm90x1  the row tiles one CTA a tile
//   mma     the portable kernel (mma.cu): any GPU, up to 2^31 blocks a launch
//
// Where the weights-as-M tiles cannot be placed, the next candidate that can runs (in practice
// every Hopper part places both tiles, or neither).  A name forced through the context's
// experts_kernel option runs that kernel unless it cannot.
#include "experts.cuh"

namespace {

int sm90w_fits(moe_ctx *ctx, const moe_experts_args *a, Fit *fit, char *why, size_t n) {
  return moeI_experts_sm90_fits(ctx, a, SM90W, fit, why, n);
}
int sm90x2_fits(moe_ctx *ctx, const moe_experts_args *a, Fit *fit, char *why, size_t n) {
  return moeI_experts_sm90_fits(ctx, a, SM90X2, fit, why, n);
}
int sm90x1_fits(moe_ctx *ctx, const moe_experts_args *a, Fit *fit, char *why, size_t n) {
  return moeI_experts_sm90_fits(ctx, a, SM90X1, fit, why, n);
}
int sm90w_run(moe_ctx *ctx, const moe_experts_args *a) { return moeI_experts_sm90_run(ctx, a, SM90W); }
int sm90x2_run(moe_ctx *ctx, const moe_experts_args *a) { return moeI_experts_sm90_run(ctx, a, SM90X2); }
int sm90x1_run(moe_ctx *ctx, const moe_experts_args *a) { return moeI_experts_sm90_run(ctx, a, SM90X1); }

const Candidate<moe_experts_args> kernels[] = {
    {"sm90w", sm90w_fits, sm90w_run},
    {"sm90x2", sm90x2_fits, sm90x2_run},
    {"sm90x1", sm90x1_fits, sm90x1_run},
    {"mma", moeI_experts_mma_fits, moeI_experts_mma_run},
};

// What every kernel requires, and the context's stream on the tensors' device (the candidates'
// occupancy queries read the current device).
int prologue(moe_ctx *ctx, const moe_experts_args *a) {
  const long long C = a->x->shape[0], H = a->x->shape[1];
  const long long EL = a->w_gate_up->shape[0], F = a->w_gate_up->shape[1] / 2;
  // Rows, columns and tile indices are ints on the device; one tile row past C must fit too.
  const long long lim = 1ll << 30;
  if (C >= lim || H >= lim || F >= lim || EL >= lim)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                       "experts: the CUDA kernels take C, H, F and EL below 2^30, got C = %lld, H = %lld, F = %lld, "
                       "EL = %lld",
                       C, H, F, EL);
  cudaStream_t stream;
  return moeI_cuda_ctx_stream(ctx, a->x->device.index, &stream);
}

} // namespace

const char *moeI_experts_kernels(void) { return candidate_names(kernels); }

static bool empty(const moe_experts_args *a) {
  return a->x->shape[0] == 0 || a->x->shape[1] == 0 || a->w_gate_up->shape[0] == 0; // no row of out to write
}

int moeI_experts_cuda(moe_ctx *ctx, const moe_experts_args *a) {
  int rc = prologue(ctx, a);
  if (rc) return rc;
  if (empty(a)) return moeI_ok(ctx);
  return select_run(ctx, "experts", MOEI_CFG_EXPERTS_KERNEL, kernels, a);
}

int moeI_experts_explain_cuda(moe_ctx *ctx, const moe_experts_args *a, char *report, size_t n) {
  int rc = prologue(ctx, a);
  if (rc) return rc;
  if (empty(a)) {
    snprintf(report, n, "none\nnone: nothing runs (C, H or EL is 0: no row of out to write)\n");
    return moeI_ok(ctx);
  }
  return select_explain(ctx, "experts", MOEI_CFG_EXPERTS_KERNEL, kernels, a, report, n);
}
