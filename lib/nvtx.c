/* SPDX-License-Identifier: MIT */
/* nvtx.c -- NVTX ranges: every stage's work inside a range named after it, in the domain "moelab",
 * so that Nsight Systems' timeline and Nsight Compute's --nvtx-include see the pipeline.
 *
 * NVTX 3 is header-only (the CUDA toolkit's nvtx3/nvToolsExt.h): until a tool is attached
 * (NVTX_INJECTION64_PATH, or the tool's launcher) each call costs a test of a function pointer.
 * A build that did not find the header compiles the ranges out (MOE_HAVE_NVTX unset) and
 * moe_range_push and moe_range_pop only keep their count. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>

#include "internal.h"

#ifdef MOE_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>

static nvtxDomainHandle_t domain;
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;

static void domain_create(void) { domain = nvtxDomainCreateA("moelab"); }

void moeI_range_push(const char *name) {
  pthread_once(&domain_once, domain_create);
  nvtxEventAttributes_t a = {0};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(domain, &a);
}

int moeI_range_pop(int rc) {
  pthread_once(&domain_once, domain_create);
  nvtxDomainRangePop(domain);
  return rc;
}
#else
void moeI_range_push(const char *name) { (void)name; }
int moeI_range_pop(int rc) { return rc; }
#endif

/* The ranges this thread opened through moe_range_push and has not closed: a pop with none open
 * would close a range of the caller's own, or of another library sharing the domain's stack. */
static _Thread_local int open_ranges;

int moe_range_push(moe_ctx *ctx, const char *name) {
  if (!name) return moeI_seterr(ctx, MOE_ERR_ARG, "range_push: name is NULL");
  moeI_range_push(name);
  open_ranges++;
  return moeI_ok(ctx);
}

int moe_range_pop(moe_ctx *ctx) {
  if (open_ranges == 0)
    return moeI_seterr(ctx, MOE_ERR_ARG, "range_pop: no range that moe_range_push opened is open on this thread");
  open_ranges--;
  return moeI_range_pop(moeI_ok(ctx));
}
