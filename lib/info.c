/* SPDX-License-Identifier: MIT */
/* info.c -- what a device is, for the reports that must say where they were measured
 * (moe_device_info): the CPU's model and threads, or a GPU's name, clock, and the versions of the
 * driver, the CUDA runtime and NCCL (kernels/runtime.cu and kernels/world.cu answer for the GPU). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>

#include "world.h"

/* The "model name" of /proc/cpuinfo's first processor into buf, or "unknown". */
static void cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    const char *colon = strchr(line, ':');
    if (strncmp(line, "model name", 10) != 0 || !colon) continue;
    const char *v = colon + 1;
    while (*v == ' ' || *v == '\t') v++;
    size_t len = strcspn(v, "\n");
    if (len > 0) snprintf(buf, n, "%.*s", (int)len, v);
    break;
  }
  fclose(f);
}

int moe_device_info(moe_ctx *ctx, moe_device device, char *report, size_t n) {
  int rc = moeI_check_report(ctx, "device_info", report, n);
  if (rc) return rc;
  report[0] = '\0';
  if (device.kind == MOE_CPU) {
    char model[256];
    cpu_model(model, sizeof model);
    snprintf(report, n, "kind: cpu\nname: %s\nthreads: %d\n", model, moeI_cpu_threads());
    return moeI_ok(ctx);
  }
  if (device.kind != MOE_CUDA)
    return moeI_seterr(ctx, MOE_ERR_ARG, "device_info: unknown device kind %d", device.kind);
  rc = moeI_cuda_device_info(ctx, device.index, report, n);
  if (rc) return rc;
  char nccl[32];
  size_t used = strlen(report);
  if (moeI_nccl_version(nccl, sizeof nccl) == MOE_OK && used < n) snprintf(report + used, n - used, "nccl: %s\n", nccl);
  return moeI_ok(ctx);
}
