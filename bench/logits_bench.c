/* SPDX-License-Identifier: MIT */
/* logits_bench.c -- the router's logits at the Kimi K2 rank shape beside cuBLAS, in one run.
 *
 *   build/bench/logits_bench [--tokens N] [--hidden H] [--experts E] [--iters N]
 *
 * out f32 [N, E] = x bf16 [N, H] . w bf16 [E, H]^T, by default N = 7168 tokens a rank, H = 7168,
 * E = 384 (Kimi K2): 2 N H E = 39.5 GFLOP, 103 MB of x read once.  Timed, with CUDA events on the
 * context's stream after two warm-up runs, the median of --iters (default 20) runs of each of:
 *   tensor  moe_logits, option logits = "tensor" (the path moe_logits_explain names in brackets)
 *   exact   moe_logits, option logits = "exact" (f32 FMAs, the CPU's bits)
 *   cublas  cublasGemmEx, bf16 in, f32 out, CUBLAS_COMPUTE_32F: the anchor of the same shape
 * Before timing, the tensor path is checked against the exact one: max |tensor - exact| <= 1e-3
 * max |exact| (their bound per element is H 2^-23 sum |x||w|: spec/logits_spec.lua), one
 * PASS/FAIL line.  Then one line per path:
 *   TIME logits [tensor] N 7168 H 7168 E 384: median 0.140 ms (min ..., max ...) = 282.3 TFLOP/s
 * Exit status: 0; 1 when the check fails or a call is refused; 2 on bad arguments; 77 without a GPU. */
#include <cublas_v2.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_test.h"

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

typedef struct {
  moe_tensor *out, *x, *w;
  cublasHandle_t blas;
} problem;

/* One run of path: 0 tensor, 1 exact, 2 cuBLAS. */
static void run(const problem *p, int path) {
  if (path < 2) {
    TRY(moe_ctx_config(ctx, "logits", path == 0 ? "tensor" : "exact"));
    TRY(moe_logits(ctx, p->out, p->x, p->w));
    return;
  }
  /* column-major: out^T [E, N] = (w as [H, E])^T . (x as [H, N]) */
  const int N = (int)moe_tensor_dim(p->x, 0), H = (int)moe_tensor_dim(p->x, 1), E = (int)moe_tensor_dim(p->w, 0);
  const float one = 1.0f, zero = 0.0f;
  cublasStatus_t st = cublasGemmEx(p->blas, CUBLAS_OP_T, CUBLAS_OP_N, E, N, H, &one, moe_tensor_data(p->w),
                                   CUDA_R_16BF, H, moe_tensor_data(p->x), CUDA_R_16BF, H, &zero,
                                   moe_tensor_data(p->out), CUDA_R_32F, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    printf("FAIL cublasGemmEx: %s\n", cublasGetStatusString(st));
    exit(1);
  }
}

int main(int argc, char **argv) {
  long long N = 7168, H = 7168, E = 384, iters = 20;
  for (int i = 1; i < argc; i++) {
    long long *v = !strcmp(argv[i], "--tokens") ? &N : !strcmp(argv[i], "--hidden") ? &H
                 : !strcmp(argv[i], "--experts") ? &E : !strcmp(argv[i], "--iters") ? &iters : NULL;
    if (!v || i + 1 == argc || (*v = atoll(argv[++i])) < 1) {
      fprintf(stderr, "usage: logits_bench [--tokens N] [--hidden H] [--experts E] [--iters N] (each >= 1)\n");
      return 2;
    }
  }
  open_gpu_ctx();
  problem p = {NEW(MOE_F32, GPU, N, E), NEW(MOE_BF16, GPU, N, H), NEW(MOE_BF16, GPU, E, H), NULL};
  TRY(moe_tensor_randn(ctx, p.x, 1, 1.0f));
  TRY(moe_tensor_randn(ctx, p.w, 2, 1.0f / sqrtf((float)H)));
  run(&p, 1); /* makes the context's stream */
  cudaStream_t stream = (cudaStream_t)moe_ctx_stream(ctx);
  if (cublasCreate(&p.blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(p.blas, stream) != CUBLAS_STATUS_SUCCESS) {
    printf("FAIL cublasCreate\n");
    return 1;
  }

  /* the check: tensor against exact */
  moe_tensor *exact = NEW(MOE_F32, CPU, N, E), *tensor = NEW(MOE_F32, CPU, N, E);
  TRY(moe_tensor_copy(ctx, exact, p.out));
  run(&p, 0);
  TRY(moe_tensor_copy(ctx, tensor, p.out));
  const float *a = moe_tensor_data(tensor), *b = moe_tensor_data(exact);
  double max_diff = 0, max_ref = 0;
  for (long long i = 0; i < N * E; i++) {
    const double d = fabs((double)a[i] - b[i]);
    max_diff = d > max_diff || d != d ? d : max_diff;
    max_ref = fabs(b[i]) > max_ref ? fabs(b[i]) : max_ref;
  }
  const int ok = max_diff <= 1e-3 * max_ref;
  printf("%s logits tensor vs exact: max |diff| %.3g, max |exact| %.3g (tol 1e-3 of it)\n", ok ? "PASS" : "FAIL",
         max_diff, max_ref);
  char report[512];
  TRY(moe_ctx_config(ctx, "logits", "tensor"));
  TRY(moe_logits_explain(ctx, p.out, p.x, p.w, report, sizeof report));
  char chosen[32];
  snprintf(chosen, sizeof chosen, "%.*s", (int)strcspn(report, "\n"), report);

  static const char *const names[] = {"tensor", "exact", "cublas"};
  cudaEvent_t *ev = xmalloc((size_t)(iters + 1) * sizeof *ev);
  float *ms = xmalloc((size_t)iters * sizeof *ms);
  for (long long i = 0; i <= iters; i++) cudaEventCreate(&ev[i]);
  for (int path = 0; path < 3; path++) {
    run(&p, path), run(&p, path);
    cudaEventRecord(ev[0], stream);
    for (long long i = 0; i < iters; i++) {
      run(&p, path);
      cudaEventRecord(ev[i + 1], stream);
    }
    if (cudaEventSynchronize(ev[iters]) != cudaSuccess) {
      printf("FAIL %s: %s\n", names[path], cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    for (long long i = 0; i < iters; i++) cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]);
    qsort(ms, (size_t)iters, sizeof *ms, cmp_float);
    const float med = ms[iters / 2];
    printf("TIME logits [%s] N %lld H %lld E %lld: median %.3f ms (min %.3f, max %.3f) = %.1f TFLOP/s\n",
           path == 0 ? chosen : names[path], N, H, E, med, ms[0], ms[iters - 1], 2.0 * N * H * E / (med * 1e9));
  }
  TRY(moe_ctx_config(ctx, "logits", "tensor"));
  for (long long i = 0; i <= iters; i++) cudaEventDestroy(ev[i]);
  free(ev), free(ms);
  cublasDestroy(p.blas);
  moe_tensor *all[] = {p.out, p.x, p.w, exact, tensor};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  moe_ctx_close(ctx);
  return ok ? 0 : 1;
}
