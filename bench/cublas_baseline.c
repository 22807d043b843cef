/* SPDX-License-Identifier: MIT */
/* cublas_baseline.c -- the cuBLAS reference points of scenarios/experts.lua.
 *
 *   cublas_baseline H F [--device N] [--warmup N] [--iters N] [--data normal|uniform]
 *                   [--precision bf16|fp8] (--file PATH | N_0 N_1 ... N_{EL-1})
 *
 * A case is a list of expert row counts (on the command line, or one case per line of PATH:
 * counts separated by blanks or commas, '#' starts a comment).  For each case it times, with
 * CUDA events after warm-up, the median of --iters runs of
 *   dense:      the case's rows as one matrix: gate_up [rows x H] x [H x 2F], then
 *               down [rows x F] x [F x H] (one GEMM each, the same FLOPs as the experts stage);
 *   per_expert: the same two GEMMs for each expert with its own row count and its own weights,
 *               launched back to back on one stream (empty experts launch nothing).
 * bf16 inputs, f32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F), bf16 outputs.
 * --precision fp8: the dense pair only (its rows rounded up to 16, which cuBLASLt needs), in
 * cuBLASLt on e4m3 operands with the FP8 experts' block scales (weights one f32 a 128 x 128
 * block, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F; rows one f32 a 1 x 128 block,
 * VEC128_32F), f32 accumulation, bf16 out; down reads an e4m3 [rows, F]
 * of its own (the quantization of h is omitted with SwiGLU).  The e4m3 values are normal draws
 * quantized with the scale their amax would give, so their bits are the FP8 stage's.  SwiGLU is
 * omitted: down reads the gate half of the gate_up output in place (leading dimension 2F), so
 * the traffic and the FLOPs are those of the stage without its elementwise epilogue.
 * Inputs are random bf16, by default as the experts stage's scenarios and tests draw them
 * (--data normal: x of sd 1, w_gate_up of sd 1/sqrt(H), w_down of sd 1/sqrt(F), each value the
 * centred sum of four uniforms); --data uniform: every value uniform in [-1, 1).  Under the
 * card's power cap the tensor cores' energy, which depends on the operands' bits, sets the time,
 * so the draw is the stage's (how much it moves each: docs/perf/experts.md).  The results are
 * not checked.
 *
 * Output, one line per case and kind, key=value separated by blanks (a leading '#' marks a note):
 *   case=1 kind=dense experts=48 rows=57344 gemms=2 ms=8.123 tflops=621.6 min_ms=8.001 max_ms=8.250
 * TFLOP/s counts rows x 6 x H x F.  Errors go to stderr with exit status 1. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_math.h"

#define CUDA_OK(call)                                                                                       \
  do {                                                                                                      \
    cudaError_t e_ = (call);                                                                                \
    if (e_ != cudaSuccess) {                                                                                \
      fprintf(stderr, "error: %s failed at %s:%d: %s: %s\n", #call, __FILE__, __LINE__, cudaGetErrorName(e_), \
              cudaGetErrorString(e_));                                                                      \
      exit(1);                                                                                              \
    }                                                                                                       \
  } while (0)

#define CUBLAS_OK(call)                                                                                     \
  do {                                                                                                      \
    cublasStatus_t s_ = (call);                                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                      \
      fprintf(stderr, "error: %s failed at %s:%d: %s: %s\n", #call, __FILE__, __LINE__, cublasGetStatusName(s_), \
              cublasGetStatusString(s_));                                                                   \
      exit(1);                                                                                              \
    }                                                                                                       \
  } while (0)

static void die(const char *msg, const char *what) {
  fprintf(stderr, "error: %s%s%s\n", msg, what ? ": " : "", what ? what : "");
  fprintf(stderr, "usage: cublas_baseline H F [--device N] [--warmup N] [--iters N] [--data normal|uniform] "
                  "[--precision bf16|fp8] (--file PATH | N_0 N_1 ...)\n");
  exit(1);
}

static long parse_long(const char *s, const char *what, long lo, long hi) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) die(what, s);
  return v;
}

typedef struct {
  int n;        /* experts */
  int64_t *rows;
  int64_t total;
} Case;

typedef struct {
  Case *v;
  int n, cap;
} Cases;

static void add_case(Cases *cs, const int64_t *rows, int n) {
  if (cs->n == cs->cap) {
    cs->cap = cs->cap ? 2 * cs->cap : 16;
    cs->v = realloc(cs->v, (size_t)cs->cap * sizeof *cs->v);
    if (!cs->v) die("out of host memory", NULL);
  }
  Case *c = &cs->v[cs->n++];
  c->n = n;
  c->rows = malloc((size_t)(n ? n : 1) * sizeof *c->rows);
  if (!c->rows) die("out of host memory", NULL);
  c->total = 0;
  for (int i = 0; i < n; i++) c->total += (c->rows[i] = rows[i]);
}

static void read_cases(Cases *cs, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) die("cannot open the case file", path);
  char line[1 << 16];
  int64_t rows[1 << 13];
  while (fgets(line, sizeof line, f)) {
    if (!strchr(line, '\n') && !feof(f)) die("a line of the case file is longer than 64 KiB", path);
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    int n = 0;
    for (char *tok = strtok(line, " \t\r\n,"); tok; tok = strtok(NULL, " \t\r\n,")) {
      if (n == (int)(sizeof rows / sizeof rows[0])) die("more than 8192 experts in one case", path);
      rows[n++] = parse_long(tok, "row counts must be integers in [0, 2^31)", 0, 0x7fffffffL);
    }
    if (n) add_case(cs, rows, n);
  }
  fclose(f);
}

/* Y [M x N] = X [M x K] . W^T with W [N x K], all row-major: in cuBLAS's column-major terms
 * Y^T = op_T(W^T) . X^T, the "TN" product. */
static void gemm(cublasHandle_t h, int64_t M, int64_t N, int64_t K, const void *W, int64_t ldw, const void *X,
                 int64_t ldx, void *Y, int64_t ldy) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, W, CUDA_R_16BF, (int)ldw, X,
                         CUDA_R_16BF, (int)ldx, &zero, Y, CUDA_R_16BF, (int)ldy, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

/* The FP8 GEMM of the same shape: Y [M x N] bf16 = X [M x K] . W^T, e4m3 operands with the
 * block scales (sw: W's [N/128, K/128], sx: X's per row and 128 of k), through cuBLASLt's "TN". */
typedef struct {
  cublasLtHandle_t lt;
  void *ws;
  size_t ws_bytes;
  cudaStream_t stream;
} Lt;

#define LT_OK(call)                                                                                         \
  do {                                                                                                      \
    cublasStatus_t s_ = (call);                                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                      \
      fprintf(stderr, "error: %s failed at %s:%d: status %d\n", #call, __FILE__, __LINE__, (int)s_);        \
      exit(1);                                                                                              \
    }                                                                                                       \
  } while (0)

typedef struct {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  const void *W, *X;
  void *Y;
} Fp8Gemm;

/* Made once a case, so that no heuristic query is on the clock. */
static void fp8_plan(const Lt *lt, Fp8Gemm *g, int64_t M, int64_t N, int64_t K, const void *W, const float *sw,
                     const void *X, const float *sx, void *Y) {
  LT_OK(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtMatmulMatrixScale_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                    mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw));
  LT_OK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx));
  LT_OK(cublasLtMatrixLayoutCreate(&g->la, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)N, K));
  LT_OK(cublasLtMatrixLayoutCreate(&g->lb, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)M, K));
  LT_OK(cublasLtMatrixLayoutCreate(&g->ld, CUDA_R_16BF, (uint64_t)N, (uint64_t)M, N));
  cublasLtMatmulPreference_t pref;
  LT_OK(cublasLtMatmulPreferenceCreate(&pref));
  LT_OK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt->ws_bytes,
                                             sizeof lt->ws_bytes));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  LT_OK(cublasLtMatmulAlgoGetHeuristic(lt->lt, g->op, g->la, g->lb, g->ld, g->ld, pref, 1, &heur, &found));
  if (!found) die("cuBLASLt offers no FP8 block-scaled algorithm for this shape", NULL);
  cublasLtMatmulPreferenceDestroy(pref);
  g->algo = heur.algo, g->W = W, g->X = X, g->Y = Y;
}

static void fp8_run(const Lt *lt, const Fp8Gemm *g) {
  const float one = 1.0f, zero = 0.0f;
  LT_OK(cublasLtMatmul(lt->lt, g->op, &one, g->W, g->la, g->X, g->lb, &zero, g->Y, g->ld, g->Y, g->ld, &g->algo,
                       lt->ws, lt->ws_bytes, lt->stream));
}

static void fp8_free(Fp8Gemm *g) {
  cublasLtMatrixLayoutDestroy(g->la), cublasLtMatrixLayoutDestroy(g->lb), cublasLtMatrixLayoutDestroy(g->ld);
  cublasLtMatmulDescDestroy(g->op);
}

/* Fills n bf16 values at dst by copying the random pool over it. */
static void fill(void *dst, size_t n, const void *pool, size_t pool_n) {
  char *d = dst;
  for (size_t done = 0; done < n;) {
    size_t m = n - done < pool_n ? n - done : pool_n;
    CUDA_OK(cudaMemcpy(d + done * 2, pool, m * 2, cudaMemcpyDeviceToDevice));
    done += m;
  }
}

/* n random bf16 values on the device: uniform in [-1, 1), or (normal) sd * the centred sum of
 * four uniforms in [0, 1) scaled to unit variance.  xorshift64 from seed. */
static uint16_t *make_pool(size_t n, int normal, double sd, uint64_t seed) {
  uint16_t *host = malloc(n * sizeof *host);
  if (!host) die("out of host memory", NULL);
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) {
    double u = 0;
    for (int j = 0; j < (normal ? 4 : 1); j++) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      u += (double)(s >> 40) / (double)(1ull << 24);
    }
    float v = (float)(normal ? (u - 2.0) * sqrt(3.0) * sd : u * 2.0 - 1.0);
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    host[i] = (uint16_t)(b >> 16);
  }
  uint16_t *pool;
  CUDA_OK(cudaMalloc((void **)&pool, n * sizeof *pool));
  CUDA_OK(cudaMemcpy(pool, host, n * sizeof *pool, cudaMemcpyHostToDevice));
  free(host);
  return pool;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

typedef struct {
  cublasHandle_t h;
  int64_t H, F;
  uint16_t *x, *hbuf, *y, **wgu, **wdn;
} Bufs;

/* dense: all rows through expert 0's weights; else each expert through its own. */
static void run_case(const Bufs *b, const Case *c, int dense) {
  const int64_t H = b->H, F = b->F;
  if (dense) {
    if (!c->total) return;
    gemm(b->h, c->total, 2 * F, H, b->wgu[0], H, b->x, H, b->hbuf, 2 * F);
    gemm(b->h, c->total, H, F, b->wdn[0], F, b->hbuf, 2 * F, b->y, H);
    return;
  }
  int64_t row = 0;
  for (int e = 0; e < c->n; e++) {
    int64_t m = c->rows[e];
    if (!m) continue;
    gemm(b->h, m, 2 * F, H, b->wgu[e], H, b->x + row * H, H, b->hbuf + row * 2 * F, 2 * F);
    gemm(b->h, m, H, F, b->wdn[e], F, b->hbuf + row * 2 * F, 2 * F, b->y + row * H, H);
    row += m;
  }
}

/* The median of n timings (sorted in place). */
static double median(float *ms, int n) {
  qsort(ms, (size_t)n, sizeof *ms, cmp_float);
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

/* n e4m3 values on the device: sd-scaled normal (or uniform) draws quantized with the scale of
 * their expected amax, as moe_quantize would scale them. */
static uint8_t *make_pool8(size_t n, int normal, uint64_t seed) {
  uint8_t *host = malloc(n);
  if (!host) die("out of host memory", NULL);
  uint64_t s = seed;
  const float scale = moeI_fp8_weight_scale(normal ? 3.5f : 1.0f);
  for (size_t i = 0; i < n; i++) {
    double u = 0;
    for (int j = 0; j < (normal ? 4 : 1); j++) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      u += (double)(s >> 40) / (double)(1ull << 24);
    }
    host[i] = moeI_fp8_quantize((float)(normal ? (u - 2.0) * sqrt(3.0) : u * 2.0 - 1.0), scale);
  }
  uint8_t *pool;
  CUDA_OK(cudaMalloc((void **)&pool, n));
  CUDA_OK(cudaMemcpy(pool, host, n, cudaMemcpyHostToDevice));
  free(host);
  return pool;
}

static void *dev_fill8(size_t n, const uint8_t *pool, size_t pool_n) {
  char *d;
  CUDA_OK(cudaMalloc((void **)&d, n ? n : 1));
  for (size_t done = 0; done < n; done += pool_n)
    CUDA_OK(cudaMemcpy(d + done, pool, n - done < pool_n ? n - done : pool_n, cudaMemcpyDeviceToDevice));
  return d;
}

static float *dev_scales(size_t n, float v) {
  float *host = malloc(n * sizeof *host), *d;
  if (!host) die("out of host memory", NULL);
  for (size_t i = 0; i < n; i++) host[i] = v;
  CUDA_OK(cudaMalloc((void **)&d, n * sizeof *d));
  CUDA_OK(cudaMemcpy(d, host, n * sizeof *d, cudaMemcpyHostToDevice));
  free(host);
  return d;
}

/* cuBLASLt's block-scaled FP8 GEMMs take the rows in multiples of 16 (other counts: no algorithm),
 * so a case's rows are rounded up to 16 for them: at most 15 rows of work more than ours. */
static int64_t fp8_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

/* --precision fp8: the dense pair of every case in cuBLASLt FP8, one line a case. */
static void time_fp8(const Cases *cs, int64_t H, int64_t F, int64_t max_rows, int normal, int warmup, int iters,
                     cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, float *ms) {
  const size_t pool_n = (size_t)1 << 24, rows = (size_t)(fp8_rows(max_rows) ? fp8_rows(max_rows) : 16);
  uint8_t *pool = make_pool8(pool_n, normal, 0x243f6a8885a308d3ull);
  void *x8 = dev_fill8(rows * (size_t)H, pool, pool_n), *h8 = dev_fill8(rows * (size_t)F, pool, pool_n);
  void *wgu8 = dev_fill8((size_t)(2 * F) * (size_t)H, pool, pool_n), *wdn8 = dev_fill8((size_t)H * (size_t)F, pool, pool_n);
  const size_t kb = (size_t)((H > F ? H : F) + 127) / 128;
  float *sx = dev_scales(rows * kb, 1.0f / 64), *sw = dev_scales(kb * kb * 2, 1.0f / 512);
  uint16_t *hbuf, *y;
  CUDA_OK(cudaMalloc((void **)&hbuf, rows * (size_t)(2 * F) * 2));
  CUDA_OK(cudaMalloc((void **)&y, rows * (size_t)H * 2));
  Lt lt = {.ws_bytes = (size_t)64 << 20, .stream = stream};
  LT_OK(cublasLtCreate(&lt.lt));
  CUDA_OK(cudaMalloc(&lt.ws, lt.ws_bytes));
  for (int ci = 0; ci < cs->n; ci++) {
    const Case *c = &cs->v[ci];
    if (!c->total) continue;
    Fp8Gemm gu, dn;
    fp8_plan(&lt, &gu, fp8_rows(c->total), 2 * F, H, wgu8, sw, x8, sx, hbuf);
    fp8_plan(&lt, &dn, fp8_rows(c->total), H, F, wdn8, sw, h8, sx, y);
    for (int i = 0; i < warmup + iters; i++) {
      CUDA_OK(cudaEventRecord(start, stream));
      fp8_run(&lt, &gu);
      fp8_run(&lt, &dn);
      CUDA_OK(cudaEventRecord(stop, stream));
      CUDA_OK(cudaEventSynchronize(stop));
      if (i >= warmup) CUDA_OK(cudaEventElapsedTime(&ms[i - warmup], start, stop));
    }
    CUDA_OK(cudaGetLastError());
    const double med = median(ms, iters), flop = (double)c->total * 6.0 * (double)H * (double)F;
    printf("case=%d kind=dense_fp8 experts=%d rows=%lld gemms=2 ms=%.4f tflops=%.2f min_ms=%.4f max_ms=%.4f\n", ci + 1,
           c->n, (long long)c->total, med, flop / (med * 1e9), ms[0], ms[iters - 1]);
    fflush(stdout);
    fp8_free(&gu), fp8_free(&dn);
  }
  cublasLtDestroy(lt.lt);
  cudaFree(lt.ws), cudaFree(pool), cudaFree(x8), cudaFree(h8), cudaFree(wgu8), cudaFree(wdn8), cudaFree(sx);
  cudaFree(sw), cudaFree(hbuf), cudaFree(y);
}

int main(int argc, char **argv) {
  int64_t H = 0, F = 0;
  int device = 0, warmup = 3, iters = 10, npos = 0, normal = 1, fp8 = 0;
  const char *file = NULL;
  Cases cs = {0};
  int64_t *cmd = calloc((size_t)argc, sizeof *cmd);
  if (!cmd) die("out of host memory", NULL);
  int ncmd = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf("usage: cublas_baseline H F [--device N] [--warmup N] [--iters N] [--data normal|uniform] "
             "[--precision bf16|fp8] (--file PATH | N_0 N_1 ...)\n");
      return 0;
    }
    if (!strncmp(a, "--", 2)) {
      if (i + 1 >= argc) die("flag needs a value", a);
      const char *v = argv[++i];
      if (!strcmp(a, "--device")) device = (int)parse_long(v, "--device needs a device number", 0, 1024);
      else if (!strcmp(a, "--warmup")) warmup = (int)parse_long(v, "--warmup needs an integer >= 0", 0, 100000);
      else if (!strcmp(a, "--iters")) iters = (int)parse_long(v, "--iters needs an integer >= 1", 1, 100000);
      else if (!strcmp(a, "--file")) file = v;
      else if (!strcmp(a, "--precision")) {
        if (strcmp(v, "bf16") && strcmp(v, "fp8")) die("--precision is bf16 or fp8", v);
        fp8 = !strcmp(v, "fp8");
      } else if (!strcmp(a, "--data")) {
        if (strcmp(v, "normal") && strcmp(v, "uniform")) die("--data is normal or uniform", v);
        normal = !strcmp(v, "normal");
      }
      else die("unknown flag", a);
    } else if (npos == 0) {
      H = parse_long(a, "H must be an integer in [1, 2^20]", 1, 1L << 20), npos++;
    } else if (npos == 1) {
      F = parse_long(a, "F must be an integer in [1, 2^20]", 1, 1L << 20), npos++;
    } else {
      cmd[ncmd++] = parse_long(a, "row counts must be integers in [0, 2^31)", 0, 0x7fffffffL);
    }
  }
  if (npos < 2) die("H and F are required", NULL);
  if (file && ncmd) die("give either --file or row counts, not both", NULL);
  if (file) read_cases(&cs, file);
  else if (ncmd) add_case(&cs, cmd, ncmd);
  if (!cs.n) die("no case: give row counts or a --file with one case per line", NULL);

  int64_t max_rows = 0;
  int max_experts = 1;
  for (int i = 0; i < cs.n; i++) {
    if (cs.v[i].total > max_rows) max_rows = cs.v[i].total;
    if (cs.v[i].n > max_experts) max_experts = cs.v[i].n;
  }
  if (max_rows > 0x7fffffffL) die("a case has more than 2^31 rows", NULL);

  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  if (device >= ndev) {
    fprintf(stderr, "error: --device %d, but %d CUDA device%s\n", device, ndev, ndev == 1 ? "" : "s");
    return 1;
  }
  CUDA_OK(cudaSetDevice(device));
  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  if (fp8) {
    cudaStream_t st;
    cudaEvent_t e0, e1;
    float *t = malloc((size_t)iters * sizeof *t);
    if (!t) die("out of host memory", NULL);
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    printf("# cublas_baseline: H=%lld F=%lld on device %d (%s); cuBLASLt e4m3 in, block scales 128x128 (weights) "
           "and 1x128 (rows), f32 accumulate, bf16 out; gate_up then down, SwiGLU and the quantization of h omitted; "
           "%s data; median of %d after %d warm-up\n",
           (long long)H, (long long)F, device, prop.name, normal ? "normal" : "uniform", iters, warmup);
    time_fp8(&cs, H, F, max_rows, normal, warmup, iters, st, e0, e1, t);
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaStreamDestroy(st);
    free(t), free(cmd);
    for (int i = 0; i < cs.n; i++) free(cs.v[i].rows);
    free(cs.v);
    return 0;
  }

  /* pools of random bf16 values, copied over every buffer: filling gigabytes of weights from
   * the host would take longer than the timing */
  const size_t pool_n = (size_t)1 << 24;
  uint16_t *pool_x = make_pool(pool_n, normal, 1.0, 0x9e3779b97f4a7c15ull);
  uint16_t *pool_gu = make_pool(pool_n, normal, 1.0 / sqrt((double)H), 0x243f6a8885a308d3ull);
  uint16_t *pool_dn = make_pool(pool_n, normal, 1.0 / sqrt((double)F), 0x13198a2e03707344ull);

  Bufs b = {.H = H, .F = F};
  size_t rows = (size_t)(max_rows ? max_rows : 1);
  CUDA_OK(cudaMalloc((void **)&b.x, rows * (size_t)H * 2));
  CUDA_OK(cudaMalloc((void **)&b.hbuf, rows * (size_t)(2 * F) * 2));
  CUDA_OK(cudaMalloc((void **)&b.y, rows * (size_t)H * 2));
  fill(b.x, rows * (size_t)H, pool_x, pool_n);
  b.wgu = calloc((size_t)max_experts, sizeof *b.wgu);
  b.wdn = calloc((size_t)max_experts, sizeof *b.wdn);
  if (!b.wgu || !b.wdn) die("out of host memory", NULL);
  for (int e = 0; e < max_experts; e++) {
    CUDA_OK(cudaMalloc((void **)&b.wgu[e], (size_t)(2 * F) * (size_t)H * 2));
    CUDA_OK(cudaMalloc((void **)&b.wdn[e], (size_t)H * (size_t)F * 2));
    fill(b.wgu[e], (size_t)(2 * F) * (size_t)H, pool_gu, pool_n);
    fill(b.wdn[e], (size_t)H * (size_t)F, pool_dn, pool_n);
  }
  CUBLAS_OK(cublasCreate(&b.h));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUBLAS_OK(cublasSetStream(b.h, stream));
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  float *ms = malloc((size_t)iters * sizeof *ms);
  if (!ms) die("out of host memory", NULL);

  printf("# cublas_baseline: H=%lld F=%lld on device %d (%s); cublasGemmEx bf16 in, f32 accumulate "
         "(CUBLAS_COMPUTE_32F), bf16 out; gate_up then down, SwiGLU omitted; %s data; median of %d after %d "
         "warm-up\n",
         (long long)H, (long long)F, device, prop.name, normal ? "normal" : "uniform", iters, warmup);
  for (int ci = 0; ci < cs.n; ci++) {
    const Case *c = &cs.v[ci];
    int nonempty = 0;
    for (int e = 0; e < c->n; e++) nonempty += c->rows[e] > 0;
    for (int dense = 1; dense >= 0; dense--) {
      for (int i = 0; i < warmup; i++) run_case(&b, c, dense);
      for (int i = 0; i < iters; i++) {
        CUDA_OK(cudaEventRecord(start, stream));
        run_case(&b, c, dense);
        CUDA_OK(cudaEventRecord(stop, stream));
        CUDA_OK(cudaEventSynchronize(stop));
        CUDA_OK(cudaEventElapsedTime(&ms[i], start, stop));
      }
      CUDA_OK(cudaGetLastError());
      double med = median(ms, iters);
      double flop = (double)c->total * 6.0 * (double)H * (double)F;
      printf("case=%d kind=%s experts=%d rows=%lld gemms=%d ms=%.4f tflops=%.2f min_ms=%.4f max_ms=%.4f\n", ci + 1,
             dense ? "dense" : "per_expert", c->n, (long long)c->total, dense ? (c->total ? 2 : 0) : 2 * nonempty,
             med, med > 0 ? flop / (med * 1e9) : 0.0, ms[0], ms[iters - 1]);
      fflush(stdout);
    }
  }

  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(b.h);
  cudaStreamDestroy(stream);
  for (int e = 0; e < max_experts; e++) cudaFree(b.wgu[e]), cudaFree(b.wdn[e]);
  cudaFree(b.x), cudaFree(b.hbuf), cudaFree(b.y), cudaFree(pool_x), cudaFree(pool_gu), cudaFree(pool_dn);
  free(b.wgu), free(b.wdn), free(ms), free(cmd);
  for (int i = 0; i < cs.n; i++) free(cs.v[i].rows);
  free(cs.v);
  return 0;
}
