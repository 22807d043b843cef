/* SPDX-License-Identifier: MIT */
/* exchange_bench.c -- the expert-parallel exchange across real GPUs, in GB/s per GPU, beside
 * NCCL's own all-to-all of the same bytes in the same run.
 *
 *   build/bench/exchange_bench [--ranks 2,4,8] [--tokens 7168] [--hidden 7168] [--k 8] [--experts 384]
 *                        [--iters 20]
 *
 * For each world size W (default: 2, 4, 8 where that many GPUs are visible): W ranks in this
 * process, each with T tokens of H bf16 and uniform random top-K routing over E experts
 * (rank r owns experts [r*E/W, (r+1)*E/W)).  Timed, each as the median of --iters calls after
 * warm-up, from events on every rank's stream (a call lasts until its slowest rank is done):
 *   - direct dispatch and combine (moe_world_exchange_*: peers' windows read over NVLink);
 *   - the all-gather exchange (moe_world_dispatch / moe_world_combine), for reference;
 *   - NCCL send/recv between every pair of ranks, each rank sending (and receiving) the mean
 *     of the direct dispatch's bytes per rank, split evenly over its peers; then the same with
 *     the direct combine's bytes.
 * The bytes of an exchange are the rows that must cross between GPUs: for dispatch, each
 * (source rank, token) with a route on another rank, once per owner rank (DeepEP's count); for
 * combine, each route to another rank.  GB/s per GPU = mean bytes per rank / time.  Before
 * timing, the direct exchange's outputs are compared with the all-gather one's, bit for bit. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "moelab.h"

enum { MAXW = 8 };

static moe_ctx *ctx;

/* A failed call ends the run, naming the call, where it is and why. */
static void die(const char *file, int line, const char *call, const char *why) {
  fprintf(stderr, "exchange_bench: %s:%d: %s: %s\n", file, line, call, why);
  exit(1);
}
#define TRY(call)                                                                                                     \
  do {                                                                                                                \
    if ((call) != MOE_OK) die(__FILE__, __LINE__, #call, moe_errmsg(ctx));                                          \
  } while (0)
#define CU(call)                                                                                                      \
  do {                                                                                                                \
    cudaError_t e_ = (call);                                                                                          \
    if (e_ != cudaSuccess) die(__FILE__, __LINE__, #call, cudaGetErrorString(e_));                                   \
  } while (0)
#define NC(call)                                                                                                      \
  do {                                                                                                                \
    ncclResult_t r_ = (call);                                                                                         \
    if (r_ != ncclSuccess) die(__FILE__, __LINE__, #call, ncclGetErrorString(r_));                                    \
  } while (0)

static moe_tensor *tnew(moe_dtype dt, int dev, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  moe_device d = {MOE_CUDA, dev};
  TRY(moe_tensor_new(ctx, dt, ndim, shape, d, &t));
  return t;
}
#define T2(dt, dev, a, b) tnew(dt, dev, 2, (const int64_t[]){a, b})
#define T3(dt, dev, a, b, c) tnew(dt, dev, 3, (const int64_t[]){a, b, c})

static int same(const moe_tensor *a, const moe_tensor *b) {
  size_t n = moe_tensor_nbytes(a);
  char *x = malloc(n), *y = malloc(n);
  if (!x || !y) exit(1);
  TRY(moe_tensor_read(ctx, a, x, n));
  TRY(moe_tensor_read(ctx, b, y, n));
  int eq = n == moe_tensor_nbytes(b) && memcmp(x, y, n) == 0;
  free(x), free(y);
  return eq;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Events around `iters` calls of fn on every rank's stream; the median over calls of the
 * slowest rank's time, in ms. */
typedef void (*step_fn)(void *);
static float time_calls(moe_world *w, int W, step_fn fn, void *arg, int iters) {
  cudaEvent_t ev[MAXW][2];
  float *ms = malloc(sizeof(float) * (size_t)iters);
  if (!ms) exit(1);
  for (int r = 0; r < W; r++) {
    CU(cudaSetDevice(r));
    CU(cudaEventCreate(&ev[r][0]));
    CU(cudaEventCreate(&ev[r][1]));
  }
  for (int i = 0; i < 3; i++) fn(arg); /* warm-up */
  for (int i = 0; i < iters; i++) {
    for (int r = 0; r < W; r++) {
      CU(cudaSetDevice(r));
      CU(cudaStreamSynchronize((cudaStream_t)moe_world_stream(w, r)));
    }
    for (int r = 0; r < W; r++) {
      CU(cudaSetDevice(r));
      CU(cudaEventRecord(ev[r][0], (cudaStream_t)moe_world_stream(w, r)));
    }
    fn(arg);
    float worst = 0;
    for (int r = 0; r < W; r++) {
      CU(cudaSetDevice(r));
      CU(cudaEventRecord(ev[r][1], (cudaStream_t)moe_world_stream(w, r)));
    }
    for (int r = 0; r < W; r++) {
      CU(cudaSetDevice(r));
      CU(cudaEventSynchronize(ev[r][1]));
      float t = 0;
      CU(cudaEventElapsedTime(&t, ev[r][0], ev[r][1]));
      worst = t > worst ? t : worst;
    }
    ms[i] = worst;
  }
  qsort(ms, (size_t)iters, sizeof *ms, cmp_float);
  float med = ms[iters / 2];
  for (int r = 0; r < W; r++) {
    CU(cudaSetDevice(r));
    CU(cudaEventDestroy(ev[r][0]));
    CU(cudaEventDestroy(ev[r][1]));
  }
  free(ms);
  return med;
}

typedef struct Run {
  moe_world *w;
  moe_world_exchange *ex;
  moe_world_dispatch_args da[MAXW], dd[MAXW];
  moe_world_combine_args ca[MAXW], dc[MAXW];
  ncclComm_t comms[MAXW];
  void *sbuf[MAXW], *rbuf[MAXW];
  size_t peer_bytes;
  int W;
} Run;

static void direct_dispatch(void *p) { Run *r = p; TRY(moe_world_exchange_dispatch(ctx, r->ex, r->dd)); }
static void direct_combine(void *p) { Run *r = p; TRY(moe_world_exchange_combine(ctx, r->ex, r->dc)); }
static void gather_dispatch(void *p) { Run *r = p; TRY(moe_world_dispatch(ctx, r->w, r->da)); }
static void gather_combine(void *p) { Run *r = p; TRY(moe_world_combine(ctx, r->w, r->ca)); }
static void nccl_a2a(void *p) {
  Run *r = p;
  NC(ncclGroupStart());
  for (int i = 0; i < r->W; i++)
    for (int j = 0; j < r->W; j++) {
      if (j == i) continue;
      cudaStream_t s = (cudaStream_t)moe_world_stream(r->w, i);
      NC(ncclSend((char *)r->sbuf[i] + (size_t)j * r->peer_bytes, r->peer_bytes, ncclUint8, j, r->comms[i], s));
      NC(ncclRecv((char *)r->rbuf[i] + (size_t)j * r->peer_bytes, r->peer_bytes, ncclUint8, j, r->comms[i], s));
    }
  NC(ncclGroupEnd());
}

static void bench(int W, int T, int H, int K, int E, int iters) {
  const int EL = E / W;
  const int64_t TK = (int64_t)T * K, C = 2 * TK; /* uniform routing: about TK rows per owner */
  Run run;
  memset(&run, 0, sizeof run);
  run.W = W;
  int devs[MAXW];
  for (int r = 0; r < W; r++) devs[r] = r;
  TRY(moe_world_open_local(ctx, W, devs, &run.w));
  moe_world *w = run.w;
  TRY(moe_world_exchange_open(ctx, w, T, K, H, C, &run.ex));

  /* routing: K distinct experts per token, uniform; the bytes each exchange must move */
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)W * (size_t)TK);
  if (!ids) exit(1);
  srand(1234);
  for (int64_t i = 0; i < (int64_t)W * T; i++)
    for (int k = 0; k < K; k++) {
      int e, dup;
      do {
        e = rand() % E;
        dup = 0;
        for (int j = 0; j < k; j++) dup |= ids[i * K + j] == e;
      } while (dup);
      ids[i * K + k] = e;
    }
  double dispatch_rows = 0, combine_rows = 0; /* over all ranks */
  for (int64_t i = 0; i < (int64_t)W * T; i++) {
    const int src = (int)(i / T);
    int seen[MAXW] = {0};
    for (int k = 0; k < K; k++) {
      const int o = ids[i * K + k] / EL;
      if (o == src) continue;
      combine_rows += 1;
      if (!seen[o]) seen[o] = 1, dispatch_rows += 1;
    }
  }
  const double row = (double)H * 2, disp_bytes = dispatch_rows * row / W, comb_bytes = combine_rows * row / W;

  moe_tensor *id[MAXW], *all[MAXW], *x_all[MAXW], *xs[MAXW], *dxs[MAXW], *wts[MAXW], *out[MAXW], *dout[MAXW];
  moe_tensor *sr[MAXW], *rr[MAXW], *si[MAXW], *ri[MAXW], *wx[MAXW], *wys[MAXW];
  moe_tensor *pr[MAXW], *pq[MAXW], *cnt[MAXW], *tpe[MAXW], *off[MAXW], *rrow[MAXW], *st[MAXW];
  for (int r = 0; r < W; r++) {
    TRY(moe_world_exchange_views(ctx, run.ex, r, &wx[r], &wys[r]));
    id[r] = T2(MOE_I32, r, T, K);
    TRY(moe_tensor_write(ctx, id[r], ids + (size_t)r * TK, sizeof(int32_t) * (size_t)TK));
    all[r] = T3(MOE_I32, r, W, T, K);
    TRY(moe_tensor_randn(ctx, wx[r], 100 + r, 1.0f));
    TRY(moe_tensor_randn(ctx, wys[r], 200 + r, 1.0f));
    x_all[r] = T3(MOE_BF16, r, W, T, H);
    xs[r] = T2(MOE_BF16, r, C, H), dxs[r] = T2(MOE_BF16, r, C, H);
    wts[r] = T2(MOE_F32, r, T, K);
    TRY(moe_tensor_randn(ctx, wts[r], 300 + r, 1.0f));
    out[r] = T2(MOE_BF16, r, T, H), dout[r] = T2(MOE_BF16, r, T, H);
    sr[r] = T3(MOE_BF16, r, W, TK, H), rr[r] = T3(MOE_BF16, r, W, TK, H);
    si[r] = T2(MOE_I32, r, W, TK), ri[r] = T2(MOE_I32, r, W, TK);
    pr[r] = tnew(MOE_I32, r, 1, (const int64_t[]){C}), pq[r] = tnew(MOE_I32, r, 1, (const int64_t[]){C});
    cnt[r] = tnew(MOE_I32, r, 1, (const int64_t[]){EL}), tpe[r] = tnew(MOE_I32, r, 1, (const int64_t[]){EL});
    off[r] = tnew(MOE_I32, r, 1, (const int64_t[]){EL + 1});
    rrow[r] = T2(MOE_I32, r, W, TK);
    st[r] = tnew(MOE_I32, r, 1, (const int64_t[]){MOE_SCHED_STATS});
  }
  free(ids);
  TRY(moe_world_allgather_ids(ctx, w, all, (const moe_tensor *const *)id));
  for (int r = 0; r < W; r++) {
    moe_ctx *c = NULL;
    TRY(moe_ctx_open(&c));
    TRY(moe_world_bind(c, w, r));
    moe_schedule_args sa = {pr[r], pq[r], cnt[r], tpe[r], off[r], rrow[r], st[r], all[r], E, r, 1, C, -1,
                            MOE_LAYOUT_ROUNDROBIN};
    if (moe_schedule(c, &sa) != MOE_OK) {
      fprintf(stderr, "exchange_bench: schedule: %s\n", moe_errmsg(c));
      exit(1);
    }
    TRY(moe_world_unbind(c, w));
    moe_ctx_close(c);
    moe_world_dispatch_args d = {xs[r], x_all[r], wx[r], pr[r], pq[r], K, 0, rrow[r]};
    moe_world_combine_args cb = {out[r], wts[r], id[r], wys[r], rrow[r], sr[r], rr[r], si[r], ri[r], E, NULL, NULL};
    run.da[r] = d, run.ca[r] = cb;
    run.dd[r] = d, run.dc[r] = cb;
    run.dd[r].out = dxs[r], run.dd[r].x_all = NULL, run.dc[r].out = dout[r];
  }

  /* The context bound to rank 0's stream: the exchanges then never wait on the host (an unbound
   * one would wait for every call to finish), so the events time the device alone. */
  TRY(moe_world_bind(ctx, w, 0));

  /* the two exchanges agree, bit for bit */
  gather_dispatch(&run), gather_combine(&run), direct_dispatch(&run), direct_combine(&run);
  int ok = 1;
  TRY(moe_world_unbind(ctx, w)); /* waits; the reads below are on every rank's GPU */
  for (int r = 0; r < W; r++) ok &= same(xs[r], dxs[r]) && same(out[r], dout[r]);
  TRY(moe_world_bind(ctx, w, 0));

  /* NCCL's own all-to-all of the direct dispatch's bytes per rank */
  NC(ncclCommInitAll(run.comms, W, devs));
  run.peer_bytes = ((size_t)(disp_bytes / (W - 1)) + 15) / 16 * 16;
  for (int r = 0; r < W; r++) {
    CU(cudaSetDevice(r));
    CU(cudaMalloc(&run.sbuf[r], run.peer_bytes * (size_t)W));
    CU(cudaMalloc(&run.rbuf[r], run.peer_bytes * (size_t)W));
    CU(cudaMemset(run.sbuf[r], 0, run.peer_bytes * (size_t)W));
  }

  const float t_dd = time_calls(w, W, direct_dispatch, &run, iters);
  const float t_dc = time_calls(w, W, direct_combine, &run, iters);
  const float t_gd = time_calls(w, W, gather_dispatch, &run, iters);
  const float t_gc = time_calls(w, W, gather_combine, &run, iters);
  const float t_nc = time_calls(w, W, nccl_a2a, &run, iters);
  const double a2a_bytes = (double)run.peer_bytes * (W - 1);
  /* and of the combine's bytes (the buffers hold them: comb_bytes >= disp_bytes) */
  const size_t disp_peer = run.peer_bytes;
  run.peer_bytes = ((size_t)(comb_bytes / (W - 1)) + 15) / 16 * 16;
  for (int r = 0; r < W; r++) {
    CU(cudaSetDevice(r));
    CU(cudaFree(run.sbuf[r]));
    CU(cudaFree(run.rbuf[r]));
    CU(cudaMalloc(&run.sbuf[r], run.peer_bytes * (size_t)W));
    CU(cudaMalloc(&run.rbuf[r], run.peer_bytes * (size_t)W));
    CU(cudaMemset(run.sbuf[r], 0, run.peer_bytes * (size_t)W));
  }
  const float t_nc2 = time_calls(w, W, nccl_a2a, &run, iters);
  const double a2a_bytes2 = (double)run.peer_bytes * (W - 1);
  run.peer_bytes = disp_peer;
  const double g_dd = disp_bytes / t_dd / 1e6, g_dc = comb_bytes / t_dc / 1e6, g_nc = a2a_bytes / t_nc / 1e6,
               g_nc2 = a2a_bytes2 / t_nc2 / 1e6;
  printf("| %d | %s | %.0f | %.3f | %.0f | %.3f / %.0f | %.0f%% | %.3f | %.0f | %.3f | %.0f | %.3f / %.0f | %.0f%% | %.3f |\n",
         W, ok ? "yes" : "NO", disp_bytes / 1e6, t_dd, g_dd, t_nc, g_nc, 100 * g_dd / g_nc, t_gd, comb_bytes / 1e6,
         t_dc, g_dc, t_nc2, g_nc2, 100 * g_dc / g_nc2, t_gc);
  fflush(stdout);

  TRY(moe_world_unbind(ctx, w));
  for (int r = 0; r < W; r++) {
    CU(cudaSetDevice(r));
    CU(cudaFree(run.sbuf[r]));
    CU(cudaFree(run.rbuf[r]));
    NC(ncclCommDestroy(run.comms[r]));
    moe_tensor *ts[] = {id[r], all[r], x_all[r], xs[r], dxs[r], wts[r], out[r], dout[r], sr[r], rr[r], si[r], ri[r],
                        wx[r], wys[r], pr[r], pq[r], cnt[r], tpe[r], off[r], rrow[r], st[r]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
  }
  moe_world_exchange_close(run.ex);
  moe_world_close(w);
  if (!ok) {
    fprintf(stderr, "exchange_bench: W=%d: the direct exchange differs from the all-gather one\n", W);
    exit(1);
  }
}

static int parse_int(const char *flag, const char *v) {
  char *end = NULL;
  long n = v ? strtol(v, &end, 10) : 0;
  if (!v || *end || n < 1 || n > (1L << 30)) {
    fprintf(stderr, "exchange_bench: %s needs a positive integer, got %s\n", flag, v ? v : "nothing");
    exit(2);
  }
  return (int)n;
}

int main(int argc, char **argv) {
  int T = 7168, H = 7168, K = 8, E = 384, iters = 20;
  int sizes[8] = {2, 4, 8}, nsizes = 3;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--tokens")) T = parse_int(a, v), i++;
    else if (!strcmp(a, "--hidden")) H = parse_int(a, v), i++;
    else if (!strcmp(a, "--k")) K = parse_int(a, v), i++;
    else if (!strcmp(a, "--experts")) E = parse_int(a, v), i++;
    else if (!strcmp(a, "--iters")) iters = parse_int(a, v), i++;
    else if (!strcmp(a, "--ranks") && v) {
      nsizes = 0;
      for (const char *p = v; *p && nsizes < 8;) {
        char *end = NULL;
        long n = strtol(p, &end, 10);
        if (end == p || n < 2 || n > MAXW) {
          fprintf(stderr, "exchange_bench: --ranks takes world sizes from 2 to %d separated by commas, got %s\n", MAXW, v);
          return 2;
        }
        sizes[nsizes++] = (int)n;
        p = *end == ',' ? end + 1 : end;
      }
      i++;
    } else {
      fprintf(stderr, "usage: exchange_bench [--ranks 2,4,8] [--tokens T] [--hidden H] [--k K] [--experts E] [--iters N]\n");
      return 2;
    }
  }
  TRY(moe_ctx_open(&ctx));
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  printf("exchange_bench: %d GPU%s; T = %d tokens per rank, H = %d, top-%d of E = %d uniform; median of %d calls\n\n", n,
         n == 1 ? "" : "s", T, H, K, E, iters);
  printf("| W | direct == all-gather | dispatch MB per rank | direct ms | GB/s per GPU | NCCL ms / GB/s | of NCCL "
         "| all-gather ms | combine MB per rank | direct ms | GB/s per GPU | NCCL ms / GB/s | of NCCL | all-gather ms |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  int ran = 0;
  for (int i = 0; i < nsizes; i++) {
    const int W = sizes[i];
    if (W > n) {
      printf("| %d | skipped: %d GPU%s visible |\n", W, n, n == 1 ? "" : "s");
      continue;
    }
    if (E % W) {
      printf("| %d | skipped: %d experts do not split over %d ranks |\n", W, E, W);
      continue;
    }
    bench(W, T, H, K, E, iters);
    ran++;
  }
  moe_ctx_close(ctx);
  return ran ? 0 : 77;
}
