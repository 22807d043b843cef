/* nocuda.c -- the CUDA entry points of a build without the CUDA toolkit: no GPU is usable,
 * and any attempt to run on one says so instead of failing obscurely. */
#include "internal.h"

#define NO_CUDA(stage) moe_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: this moelab was built without CUDA", stage)

int cuda_device_count(int *count) {
  *count = 0;
  return MOE_OK;
}
void cuda_ctx_release(moe_ctx *ctx) { (void)ctx; }
int cuda_graph_begin(moe_ctx *ctx, int device) {
  (void)device;
  return NO_CUDA("graph");
}
int cuda_graph_end(moe_ctx *ctx, moe_graph **out) {
  (void)out;
  return NO_CUDA("graph");
}
int cuda_graph_replay(moe_ctx *ctx, moe_graph *graph) {
  (void)graph;
  return NO_CUDA("graph");
}
void cuda_graph_free(moe_graph *graph) { (void)graph; }
int cuda_event_new(moe_ctx *ctx, int device, void **event) {
  (void)device, (void)event;
  return NO_CUDA("event");
}
int cuda_event_record(moe_ctx *ctx, void *event) {
  (void)event;
  return NO_CUDA("event");
}
int cuda_event_elapsed(moe_ctx *ctx, void *start, void *stop, float *ms) {
  (void)start, (void)stop, (void)ms;
  return NO_CUDA("event");
}
void cuda_event_free(void *event) { (void)event; }
int cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **out) {
  (void)device, (void)nbytes, (void)out;
  return NO_CUDA("tensor");
}
void cuda_free(int device, void *p) { (void)device, (void)p; }
int cuda_memcpy(moe_ctx *ctx, moe_device dst_dev, void *dst, moe_device src_dev, const void *src, size_t nbytes) {
  (void)dst_dev, (void)dst, (void)src_dev, (void)src, (void)nbytes;
  return NO_CUDA("copy");
}
int cuda_synchronize(moe_ctx *ctx, int device) {
  (void)device;
  return NO_CUDA("synchronize");
}
int cuda_fill(moe_ctx *ctx, moe_tensor *t, double value) {
  (void)t, (void)value;
  return NO_CUDA("fill");
}
int cuda_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std) {
  (void)t, (void)seed, (void)std;
  return NO_CUDA("randn");
}
int route_cuda(moe_ctx *ctx, const moe_route_args *a) { (void)a; return NO_CUDA("route"); }
int schedule_cuda(moe_ctx *ctx, const moe_schedule_args *a) { (void)a; return NO_CUDA("schedule"); }
int schedule_legacy_cuda(moe_ctx *ctx, const moe_schedule_args *a) { (void)a; return NO_CUDA("schedule_legacy"); }
void cuda_scratch_release(moe_ctx *ctx) { (void)ctx; }
int dispatch_cuda(moe_ctx *ctx, const moe_dispatch_args *a) { (void)a; return NO_CUDA("dispatch"); }
int experts_cuda(moe_ctx *ctx, const moe_experts_args *a) { (void)a; return NO_CUDA("experts"); }
int logits_cuda(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w) {
  (void)out, (void)x, (void)w;
  return NO_CUDA("logits");
}
int sigmoid_gate_cuda(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w) {
  (void)g, (void)x, (void)w;
  return NO_CUDA("sigmoid_gate");
}
int combine_cuda(moe_ctx *ctx, const moe_combine_args *a) { (void)a; return NO_CUDA("combine"); }

/* moe_world (lib/world.c): no NCCL without CUDA. */
#include "world.h"
int nccl_available(moe_ctx *ctx) { return NO_CUDA("world"); }
int nccl_unique_id(moe_ctx *ctx, unsigned char id[MOE_WORLD_ID_BYTES]) {
  (void)id;
  return NO_CUDA("world: unique_id");
}
int nccl_world_open(moe_ctx *ctx, moe_world *w, const unsigned char *id) {
  (void)w, (void)id;
  return NO_CUDA("world");
}
void nccl_world_release(moe_world *w) { (void)w; }
int nccl_bind(moe_ctx *ctx, moe_world *w, int i) {
  (void)w, (void)i;
  return NO_CUDA("world: bind");
}
int nccl_unbind(moe_ctx *ctx, moe_world *w) {
  (void)w;
  return moe_ok(ctx);
}
int nccl_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in) {
  (void)w, (void)out, (void)in;
  return NO_CUDA("world: allgather");
}
int nccl_gather_configs(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs, moe_world_config *all) {
  (void)w, (void)cfgs, (void)all;
  return NO_CUDA("world: check_config");
}
int nccl_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *a) {
  (void)w, (void)a;
  return NO_CUDA("world: dispatch");
}
int nccl_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *a) {
  (void)w, (void)a;
  return NO_CUDA("world: combine");
}
int nccl_exchange_open(moe_ctx *ctx, moe_world_exchange *ex) {
  (void)ex;
  return NO_CUDA("world: exchange");
}
void nccl_exchange_release(moe_world_exchange *ex) { (void)ex; }
int nccl_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *a) {
  (void)ex, (void)a;
  return NO_CUDA("world: exchange dispatch");
}
int nccl_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *a) {
  (void)ex, (void)a;
  return NO_CUDA("world: exchange combine");
}
