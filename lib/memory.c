/* SPDX-License-Identifier: MIT */
/* memory.c -- what a device can still hold: moe_device_memory, so that a caller can size a
 * configuration against it before allocating anything (the Lua layer refuses one that cannot
 * fit rather than meet the kernel's OOM killer halfway through its weights). */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* The first number of the file at path (a /proc or cgroup file), or -1: absent, unreadable, or
 * not a number ("max", cgroup's "no limit"). */
static long long read_number(const char *path, const char *key) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  char line[256];
  long long v = -1;
  while (fgets(line, sizeof line, f)) {
    const size_t n = key ? strlen(key) : 0;
    if (key && strncmp(line, key, n) != 0) continue;
    if (sscanf(line + n, "%lld", &v) != 1) v = -1;
    break;
  }
  fclose(f);
  return v;
}

/* Host memory: total from sysconf; free is what the kernel says can be had without swapping
 * (MemAvailable: free, plus caches it can drop), less where this process's cgroup (v2) allows
 * less, since that limit is the one whose OOM killer ends the process. */
static void host_memory(size_t *free_bytes, size_t *total_bytes) {
  const long page = sysconf(_SC_PAGESIZE), pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
  const unsigned long long total = page > 0 && pages > 0 ? (unsigned long long)page * (unsigned long long)pages : 0;
  long long kb = read_number("/proc/meminfo", "MemAvailable:");
  unsigned long long have = kb >= 0 ? (unsigned long long)kb * 1024
                          : page > 0 && avail > 0 ? (unsigned long long)page * (unsigned long long)avail : total;
  const long long limit = read_number("/sys/fs/cgroup/memory.max", NULL);
  const long long used = read_number("/sys/fs/cgroup/memory.current", NULL);
  if (limit >= 0 && used >= 0) {
    const unsigned long long room = limit > used ? (unsigned long long)(limit - used) : 0;
    if (room < have) have = room;
  }
  *free_bytes = (size_t)(have < (unsigned long long)SIZE_MAX ? have : SIZE_MAX);
  *total_bytes = (size_t)(total < (unsigned long long)SIZE_MAX ? total : SIZE_MAX);
}

int moe_device_memory(moe_ctx *ctx, moe_device device, size_t *free_bytes, size_t *total_bytes) {
  if (!free_bytes || !total_bytes)
    return moeI_seterr(ctx, MOE_ERR_ARG, "device_memory: free_bytes and total_bytes must not be NULL");
  *free_bytes = *total_bytes = 0;
  int rc = moeI_check_device(ctx, "device_memory", device);
  if (rc) return rc;
  if (device.kind == MOE_CPU) {
    host_memory(free_bytes, total_bytes);
    return moeI_ok(ctx);
  }
  return moeI_cuda_memory(ctx, device.index, free_bytes, total_bytes);
}
