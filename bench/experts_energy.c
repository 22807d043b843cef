/* SPDX-License-Identifier: MIT */
/* experts_energy.c -- the energy of one pass of the experts stage, from the GPU's own counter.
 *
 *   build/bench/experts_energy [--passes N] [--warmup N] [--rows N] [--data normal|uniform]
 *
 * Under a power cap a pass's time is its energy divided by the cap, so energy is what a change
 * must lower (docs/perf/experts.md).  The Kimi K2 rank-of-EP8 shape: 48 experts (1,195 rows for
 * the first 32, 1,194 for the others, 57,344 in all; --rows N gives each expert N), H = 7168,
 * F = 2048, random bf16 inputs (--data normal, the default: moe_tensor_randn, xs of sd 1 and the
 * weights of sd ~1/sqrt(H) and ~1/sqrt(F); --data uniform: every value uniform in [-1, 1), as cublas_baseline
 * --data uniform draws them, a pool of 2^24 values repeated), the kernel the library chooses
 * (MOE_EXPERTS_KERNEL, read when the context opens, forces one).  After --warmup passes (default
 * 5), --passes back-to-back passes (default 500, ~4 s) run between two readings of NVML's
 * total-energy counter, each after the stream has drained.  Prints one line:
 *   passes=500 s=4.102 ms=8.204 watts=695.1 joules=5.702 tflops=615.7 limit_watts=700
 * (joules and ms per pass; watts the mean over the timed passes; the counter is read from
 * libnvidia-ml.so.1, the driver's, loaded at run time so that nothing links against it).  The
 * results are not checked: experts_bench checks the same kernels on the same shape. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moelab.h"

static moe_ctx *ctx;

static void die(const char *msg, const char *what) {
  fprintf(stderr, "experts_energy: %s%s%s\n", msg, what ? ": " : "", what ? what : "");
  exit(1);
}
#define TRY(call)                                                                                                     \
  do {                                                                                                                \
    if ((call) != MOE_OK) die(#call, moe_errmsg(ctx));                                                               \
  } while (0)

static long parse_long(const char *s, const char *what, long lo, long hi) {
  char *end;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) die(what, s);
  return v;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The three NVML calls used, declared as the driver's library exports them (NVML's C API). */
typedef struct nvml_device *nvml_device;
static int (*nvml_init)(void);
static int (*nvml_handle)(unsigned index, nvml_device *out);
static int (*nvml_energy)(nvml_device dev, unsigned long long *millijoules);
static int (*nvml_limit)(nvml_device dev, unsigned *milliwatts);

static void nvml_open(void) {
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) die("cannot load the driver's NVML (libnvidia-ml.so.1)", dlerror());
  *(void **)&nvml_init = dlsym(lib, "nvmlInit_v2");
  *(void **)&nvml_handle = dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  *(void **)&nvml_energy = dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
  *(void **)&nvml_limit = dlsym(lib, "nvmlDeviceGetEnforcedPowerLimit");
  if (!nvml_init || !nvml_handle || !nvml_energy || !nvml_limit) die("NVML lacks a function this program needs", NULL);
  if (nvml_init() != 0) die("nvmlInit failed", NULL);
}

static unsigned long long energy_now(nvml_device dev) {
  unsigned long long mj = 0;
  if (nvml_energy(dev, &mj) != 0)
    die("this GPU does not report its total energy (nvmlDeviceGetTotalEnergyConsumption)", NULL);
  return mj;
}

/* Every bf16 value of t uniform in [-1, 1): a host pool of 2^24 values (xorshift64) repeated. */
static void fill_uniform(moe_tensor *t) {
  const size_t n = (size_t)moe_tensor_numel(t), pool_n = (size_t)1 << 24;
  uint16_t *host = malloc(n * sizeof *host);
  if (!host) die("out of host memory", NULL);
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < n; i++) {
    if (i >= pool_n) {
      host[i] = host[i - pool_n];
      continue;
    }
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    host[i] = moe_f32_to_bf16((float)((double)(s >> 40) / (double)(1ull << 24) * 2.0 - 1.0));
  }
  TRY(moe_tensor_write(ctx, t, host, n * sizeof *host));
  free(host);
}

int main(int argc, char **argv) {
  long passes = 500, warmup = 5, rows = 0;
  int uniform = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (i + 1 >= argc) die("an option needs a value (--passes N, --warmup N, --rows N, --data D)", a);
    const char *v = argv[++i];
    if (!strcmp(a, "--passes")) passes = parse_long(v, "--passes needs an integer >= 1", 1, 1000000);
    else if (!strcmp(a, "--warmup")) warmup = parse_long(v, "--warmup needs an integer >= 0", 0, 1000000);
    else if (!strcmp(a, "--rows")) rows = parse_long(v, "--rows needs an integer >= 1", 1, 100000);
    else if (!strcmp(a, "--data") && (!strcmp(v, "normal") || !strcmp(v, "uniform"))) uniform = !strcmp(v, "uniform");
    else die("unknown option (usage: experts_energy [--passes N] [--warmup N] [--rows N] [--data normal|uniform])", a);
  }
  if (moe_ctx_open(&ctx) != MOE_OK) die("cannot open a context", NULL);
  int ngpu = 0;
  if (moe_device_count(ctx, MOE_CUDA, &ngpu) != MOE_OK || ngpu == 0) die("no GPU", NULL);
  nvml_open();
  nvml_device dev;
  if (nvml_handle(0, &dev) != 0) die("NVML has no device 0", NULL);

  enum { EL = 48, H = 7168, F = 2048 };
  const moe_device gpu = {MOE_CUDA, 0};
  int32_t off[EL + 1];
  off[0] = 0;
  for (int e = 0; e < EL; e++) off[e + 1] = off[e] + (int32_t)(rows ? rows : e < 32 ? 1195 : 1194);
  const int64_t C = off[EL];
  moe_tensor *xs, *ys, *wgu, *wd, *offsets;
  TRY(moe_tensor_new(ctx, MOE_BF16, 2, (const int64_t[]){C, H}, gpu, &xs));
  TRY(moe_tensor_new(ctx, MOE_BF16, 2, (const int64_t[]){C, H}, gpu, &ys));
  TRY(moe_tensor_new(ctx, MOE_BF16, 3, (const int64_t[]){EL, 2 * F, H}, gpu, &wgu));
  TRY(moe_tensor_new(ctx, MOE_BF16, 3, (const int64_t[]){EL, H, F}, gpu, &wd));
  TRY(moe_tensor_new(ctx, MOE_I32, 1, (const int64_t[]){EL + 1}, gpu, &offsets));
  if (uniform) {
    fill_uniform(xs);
    fill_uniform(wgu);
    fill_uniform(wd);
  } else {
    TRY(moe_tensor_randn(ctx, xs, 1, 1.0f));
    TRY(moe_tensor_randn(ctx, wgu, 2, 0.0118f)); /* ~1/sqrt(H), as experts_bench */
    TRY(moe_tensor_randn(ctx, wd, 3, 0.0221f));  /* ~1/sqrt(F) */
  }
  TRY(moe_tensor_write(ctx, offsets, off, sizeof off));
  const moe_experts_args a = {.out = ys, .x = xs, .offsets = offsets, .w_gate_up = wgu, .w_down = wd};

  for (long i = 0; i < warmup; i++) TRY(moe_experts(ctx, &a));
  TRY(moe_ctx_synchronize(ctx, gpu));
  const unsigned long long e0 = energy_now(dev);
  const double t0 = seconds();
  for (long i = 0; i < passes; i++) TRY(moe_experts(ctx, &a));
  TRY(moe_ctx_synchronize(ctx, gpu));
  const double t1 = seconds();
  const unsigned long long e1 = energy_now(dev);
  unsigned limit = 0;
  if (nvml_limit(dev, &limit) != 0) limit = 0;

  const double s = t1 - t0, joules = (double)(e1 - e0) / 1e3;
  printf("passes=%ld s=%.3f ms=%.3f watts=%.1f joules=%.3f tflops=%.1f limit_watts=%u\n", passes, s, 1e3 * s / passes,
         joules / s, joules / passes, (double)C * 6.0 * H * F * passes / s / 1e12, limit / 1000);
  moe_tensor *ts[] = {xs, ys, wgu, wd, offsets};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) moe_tensor_free(ts[i]);
  moe_ctx_close(ctx);
  return 0;
}
