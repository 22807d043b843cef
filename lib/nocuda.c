/* SPDX-License-Identifier: MIT */
/* nocuda.c -- the CUDA entry points of a build without the CUDA toolkit: no GPU is usable,
 * and any attempt to run on one says so instead of failing obscurely. */
#include "internal.h"

#define NO_CUDA(stage) moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: this moelab was built without CUDA", stage)

int moeI_cuda_device_count(int *count) {
  *count = 0;
  return MOE_OK;
}
int moeI_cuda_device_info(moe_ctx *ctx, int device, char *report, size_t n) {
  (void)device, (void)report, (void)n;
  return NO_CUDA("device_info");
}
void moeI_cuda_ctx_release(moe_ctx *ctx) { (void)ctx; }
int moeI_cuda_graph_begin(moe_ctx *ctx, int device) {
  (void)device;
  return NO_CUDA("graph");
}
int moeI_cuda_graph_end(moe_ctx *ctx, moe_graph **out) {
  (void)out;
  return NO_CUDA("graph");
}
int moeI_cuda_graph_replay(moe_ctx *ctx, moe_graph *graph) {
  (void)graph;
  return NO_CUDA("graph");
}
void moeI_cuda_graph_free(moe_graph *graph) { (void)graph; }
int moeI_cuda_event_new(moe_ctx *ctx, int device, void **event) {
  (void)device, (void)event;
  return NO_CUDA("event");
}
int moeI_cuda_event_record(moe_ctx *ctx, void *event) {
  (void)event;
  return NO_CUDA("event");
}
int moeI_cuda_event_elapsed(moe_ctx *ctx, void *start, void *stop, float *ms) {
  (void)start, (void)stop, (void)ms;
  return NO_CUDA("event");
}
void moeI_cuda_event_free(void *event) { (void)event; }
int moeI_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **out) {
  (void)device, (void)nbytes, (void)out;
  return NO_CUDA("tensor");
}
void moeI_cuda_free(int device, void *p) { (void)device, (void)p; }
int moeI_cuda_memcpy(moe_ctx *ctx, moe_device dst_dev, void *dst, moe_device src_dev, const void *src, size_t nbytes) {
  (void)dst_dev, (void)dst, (void)src_dev, (void)src, (void)nbytes;
  return NO_CUDA("copy");
}
int moeI_cuda_synchronize(moe_ctx *ctx, int device) {
  (void)device;
  return NO_CUDA("synchronize");
}
int moeI_cuda_fill(moe_ctx *ctx, moe_tensor *t, double value) {
  (void)t, (void)value;
  return NO_CUDA("fill");
}
int moeI_cuda_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std) {
  (void)t, (void)seed, (void)std;
  return NO_CUDA("randn");
}
int moeI_cuda_memory(moe_ctx *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
  (void)device, (void)free_bytes, (void)total_bytes;
  return NO_CUDA("device_memory");
}
int moeI_nonfinite_cuda(moe_ctx *ctx, moe_tensor *stats, const moe_tensor *t) {
  (void)stats, (void)t;
  return NO_CUDA("nonfinite");
}
int moeI_route_cuda(moe_ctx *ctx, const moe_route_args *a) { (void)a; return NO_CUDA("route"); }
int moeI_schedule_cuda(moe_ctx *ctx, const moe_schedule_args *a) { (void)a; return NO_CUDA("schedule"); }
void moeI_cuda_scratch_release(moe_ctx *ctx) { (void)ctx; }
int moeI_dispatch_cuda(moe_ctx *ctx, const moe_dispatch_args *a) { (void)a; return NO_CUDA("dispatch"); }
int moeI_experts_cuda(moe_ctx *ctx, const moe_experts_args *a) { (void)a; return NO_CUDA("experts"); }
int moeI_experts_fp8_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a) { (void)a; return NO_CUDA("experts_fp8"); }
int moeI_quantize_cuda(moe_ctx *ctx, moe_tensor *q, moe_tensor *scale, const moe_tensor *x, const moeI_qlayout *l) {
  (void)q, (void)scale, (void)x, (void)l;
  return NO_CUDA("quantize");
}
int moeI_dequantize_cuda(moe_ctx *ctx, moe_tensor *x, const moe_tensor *q, const moe_tensor *scale,
                         const moeI_qlayout *l) {
  (void)x, (void)q, (void)scale, (void)l;
  return NO_CUDA("dequantize");
}
int moeI_dispatch_fp8_cuda(moe_ctx *ctx, const moe_dispatch_fp8_args *a) { (void)a; return NO_CUDA("dispatch_fp8"); }
int moeI_logits_cuda(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  (void)out, (void)x, (void)w;
  return NO_CUDA("logits");
}
int moeI_logits_explain_cuda(moe_ctx *ctx, const moe_tensor *x, const moe_tensor *w, char *report, size_t n) {
  (void)x, (void)w, (void)report, (void)n;
  return NO_CUDA("logits");
}
int moeI_sigmoid_gate_cuda(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  (void)g, (void)x, (void)w;
  return NO_CUDA("sigmoid_gate");
}
int moeI_combine_cuda(moe_ctx *ctx, const moe_combine_args *a) { (void)a; return NO_CUDA("combine"); }

const char *moeI_schedule_kernels(void) { return ""; }
const char *moeI_experts_kernels(void) { return ""; }
const char *moeI_experts_fp8_kernels(void) { return ""; }
int moeI_schedule_explain_cuda(moe_ctx *ctx, const moe_schedule_args *a, char *report, size_t n) {
  (void)a, (void)report, (void)n;
  return NO_CUDA("schedule");
}
int moeI_experts_explain_cuda(moe_ctx *ctx, const moe_experts_args *a, char *report, size_t n) {
  (void)a, (void)report, (void)n;
  return NO_CUDA("experts");
}
int moeI_experts_fp8_explain_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a, char *report, size_t n) {
  (void)a, (void)report, (void)n;
  return NO_CUDA("experts_fp8");
}
