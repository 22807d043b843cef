/* SPDX-License-Identifier: MIT */
// runtime.cu -- the CUDA side of the core: devices, the context's stream, memory, copies,
// fill and randn, graphs and events.  lib/nocuda.c stands in for this file in a build
// without CUDA.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include "common.cuh"
#include "fp8_math.h"

static void capture_started(void);
static void capture_ended(void);

// ---- devices and the context's stream ----

int moeI_cuda_device_count(int *count) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // no driver, no device, a driver older than the runtime: all mean "no usable GPU" here
    (void)cudaGetLastError();
    n = 0;
  }
  *count = n;
  return MOE_OK;
}

// A device attribute, asked of the runtime once a device.
static int cached_attribute(moe_ctx *ctx, std::atomic<int> (&cache)[64], cudaDeviceAttr attr, int device, int *out) {
  cudaError_t attribute_query = cudaSuccess;
  *out = once_per_device(cache, device, [&] {
    int v = 0;
    attribute_query = cudaDeviceGetAttribute(&v, attr, device);
    return attribute_query == cudaSuccess ? v : -1;
  });
  MOE_CUDA_TRY(ctx, "device", attribute_query);
  return MOE_OK;
}

int moeI_cuda_raise_smem(moe_ctx *ctx, const char *stage, const void *kernel, std::atomic<int> (&raised)[64],
                         int device) {
  cudaError_t raise_smem_limit = cudaSuccess;
  once_per_device(raised, device, [&] {
    int optin = 0;
    raise_smem_limit = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (raise_smem_limit == cudaSuccess)
      raise_smem_limit = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    return raise_smem_limit == cudaSuccess ? 0 : -1;
  });
  MOE_CUDA_TRY(ctx, stage, raise_smem_limit);
  return MOE_OK;
}

int moeI_cuda_sm_count(moe_ctx *ctx, int device, int *out) {
  static std::atomic<int> cache[64];
  return cached_attribute(ctx, cache, cudaDevAttrMultiProcessorCount, device, out);
}

int moeI_cuda_coop_sms(moe_ctx *ctx, int device, int *out) {
  static std::atomic<int> cache[64];
  int coop = 0;
  *out = 0;
  if (int rc = cached_attribute(ctx, cache, cudaDevAttrCooperativeLaunch, device, &coop)) return rc;
  return coop ? moeI_cuda_sm_count(ctx, device, out) : MOE_OK;
}

// A CUDA version number (1000 major + 10 minor) as "12.8".
static void cuda_version(char *buf, size_t n, int v) { snprintf(buf, n, "%d.%d", v / 1000, v % 1000 / 10); }

int moeI_cuda_device_info(moe_ctx *ctx, int device, char *report, size_t n) {
  static const char *stage = "device_info";
  int count = 0;
  moeI_cuda_device_count(&count);
  if (count == 0)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: cuda:%d is not available (no usable GPU on this machine)", stage,
                       device);
  if (device < 0 || device >= count)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: cuda:%d does not exist (%d GPU%s visible)", stage, device, count,
                       count == 1 ? "" : "s");
  cudaDeviceProp p;
  int clock_khz = 0, driver = 0, runtime = 0;
  MOE_CUDA_TRY(ctx, stage, cudaGetDeviceProperties(&p, device));
  MOE_CUDA_TRY(ctx, stage, cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  MOE_CUDA_TRY(ctx, stage, cudaDriverGetVersion(&driver));
  MOE_CUDA_TRY(ctx, stage, cudaRuntimeGetVersion(&runtime));
  char dv[16], rv[16];
  cuda_version(dv, sizeof dv, driver);
  cuda_version(rv, sizeof rv, runtime);
  snprintf(report, n,
           "kind: cuda\nname: %s\nsm_count: %d\nsm_clock_mhz: %d\nmemory_mib: %lld\ncompute_capability: %d.%d\n"
           "driver: %s\nruntime: %s\n",
           p.name, p.multiProcessorCount, clock_khz / 1000, (long long)(p.totalGlobalMem >> 20), p.major, p.minor, dv,
           rv);
  return moeI_ok(ctx);
}

int moeI_cuda_ctx_stream(moe_ctx *ctx, int device, cudaStream_t *out) {
  if (!ctx) return MOE_ERR_ARG; // the stream lives in the context: there must be one
  MOE_CUDA_TRY(ctx, "stream", cudaSetDevice(device));
  // A stream bound to one GPU's rank cannot run another GPU's work: say so rather than launch
  // on the wrong device's stream.
  if (ctx->stream && !ctx->owns_stream && ctx->stream_device >= 0 && ctx->stream_device != device)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      "stream: the context is bound to a stream of cuda:%d (a world rank's), the tensors are on "
                      "cuda:%d: bind the rank of that GPU first",
                      ctx->stream_device, device);
  if (ctx->stream && ctx->owns_stream && ctx->stream_device != device) {
    // A stream belongs to one device.  Outside a capture the context moves to the device now
    // in use; its old stream is drained first so that nothing issued on it is outrun.
    if (ctx->capturing)
      return moeI_seterr(ctx, MOE_ERR_ARG, "stream: a graph is being captured on cuda:%d, not on cuda:%d",
                        ctx->stream_device, device);
    int old = ctx->stream_device;
    cudaStream_t s = (cudaStream_t)ctx->stream;
    ctx->stream = NULL;
    ctx->owns_stream = 0;
    MOE_CUDA_TRY(ctx, "stream", cudaSetDevice(old));
    cudaError_t err = cudaStreamSynchronize(s);
    (void)cudaStreamDestroy(s);
    MOE_CUDA_TRY(ctx, "stream", err);
    MOE_CUDA_TRY(ctx, "stream", cudaSetDevice(device));
  }
  if (!ctx->stream) {
    cudaStream_t s;
    MOE_CUDA_TRY(ctx, "stream", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ctx->stream = s;
    ctx->owns_stream = 1;
    ctx->stream_device = device;
  }
  *out = (cudaStream_t)ctx->stream;
  return MOE_OK;
}

void moeI_cuda_ctx_release(moe_ctx *ctx) {
  if (!ctx || !ctx->owns_stream || !ctx->stream) {
    if (ctx) ctx->owns_stream = 0;
    return;
  }
  cudaStream_t s = (cudaStream_t)ctx->stream;
  if (cudaSetDevice(ctx->stream_device) == cudaSuccess) {
    if (ctx->capturing) {
      // closed in the middle of a capture: end it, so that the stream can be destroyed
      cudaGraph_t g = NULL;
      if (cudaStreamEndCapture(s, &g) == cudaSuccess && g) (void)cudaGraphDestroy(g);
      capture_ended();
    }
    (void)cudaStreamDestroy(s);
  }
  (void)cudaGetLastError();
  ctx->capturing = 0;
  ctx->stream = NULL;
  ctx->owns_stream = 0;
}

// ---- memory ----

int moeI_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **out) {
  *out = NULL;
  MOE_CUDA_TRY(ctx, "tensor", cudaSetDevice(device));
  // cudaMalloc is one of the calls that a thread-local capture forbids (it would invalidate
  // the graph); relaxed mode lets a tensor be made while a capture is under way.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (ctx && ctx->capturing) MOE_CUDA_TRY(ctx, "tensor", cudaThreadExchangeStreamCaptureMode(&mode));
  void *p = NULL;
  cudaError_t err = cudaMalloc(&p, nbytes);
  if (ctx && ctx->capturing) (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "tensor: cudaMalloc of %zu bytes on cuda:%d failed: %s: %s", nbytes, device,
                      cudaGetErrorName(err), cudaGetErrorString(err));
  }
  MOE_CUDA_TRY(ctx, "tensor", err);
  *out = p;
  return MOE_OK;
}

int moeI_cuda_memory(moe_ctx *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
  MOE_CUDA_TRY(ctx, "device_memory", cudaSetDevice(device));
  MOE_CUDA_TRY(ctx, "device_memory", cudaMemGetInfo(free_bytes, total_bytes));
  return moeI_ok(ctx);
}

// Frees run from destructors (Lua's __gc) at any moment, also in the middle of a graph
// capture, where cudaFree (it synchronises the device) could invalidate the capture.  So while
// any capture is under way, frees are only noted, and done by the first free after the last
// capture has ended.
static std::mutex free_lock;
static int captures;                                 // captures under way, under free_lock
static std::vector<std::pair<int, void *>> deferred; // (device, pointer), under free_lock

static void free_now(int device, void *p) {
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess) cur = -1;
  if (cudaSetDevice(device) == cudaSuccess) (void)cudaFree(p);
  if (cur >= 0 && cur != device) (void)cudaSetDevice(cur);
  (void)cudaGetLastError();
}

static void capture_started(void) {
  std::lock_guard<std::mutex> hold(free_lock);
  captures++;
}

static void capture_ended(void) {
  std::lock_guard<std::mutex> hold(free_lock);
  if (captures > 0) captures--;
}

// Never fails visibly.
void moeI_cuda_free(int device, void *p) {
  std::vector<std::pair<int, void *>> todo;
  {
    std::lock_guard<std::mutex> hold(free_lock);
    if (captures > 0) {
      try {
        if (p) deferred.emplace_back(device, p);
        return;
      } catch (...) {
        // no memory to remember it: free it now after all, below
      }
    } else {
      todo.swap(deferred);
    }
  }
  for (auto &d : todo) free_now(d.first, d.second);
  if (p) free_now(device, p);
}

int moeI_cuda_memcpy(moe_ctx *ctx, moe_device dst_dev, void *dst, moe_device src_dev, const void *src, size_t nbytes) {
  if (!nbytes) return moeI_ok(ctx);
  const int dst_gpu = dst_dev.kind == MOE_CUDA, src_gpu = src_dev.kind == MOE_CUDA;
  if (!ctx) return MOE_ERR_ARG;
  if (ctx->capturing && !(dst_gpu && src_gpu))
    return moeI_seterr(ctx, MOE_ERR_ARG, "copy: not allowed during graph capture (%s)",
                      dst_gpu ? "host to device" : "device to host");
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, dst_gpu ? dst_dev.index : src_dev.index, &s);
  if (rc) return rc;
  const uintptr_t d = (uintptr_t)dst, r = (uintptr_t)src;
  if (dst_gpu && src_gpu && dst_dev.index == src_dev.index && d != r && d < r + nbytes && r < d + nbytes) {
    // overlapping views of one tensor: cudaMemcpy does not promise memmove's result, so go
    // through a temporary (stream-ordered, so a capture holds it as graph memory nodes)
    void *tmp = NULL;
    MOE_CUDA_TRY(ctx, "copy", cudaMallocAsync(&tmp, nbytes, s));
    const cudaError_t e1 = cudaMemcpyAsync(tmp, src, nbytes, cudaMemcpyDeviceToDevice, s);
    const cudaError_t e2 = e1 == cudaSuccess ? cudaMemcpyAsync(dst, tmp, nbytes, cudaMemcpyDeviceToDevice, s) : e1;
    MOE_CUDA_TRY(ctx, "copy", cudaFreeAsync(tmp, s));
    if (e2 != cudaSuccess) {
      (void)cudaGetLastError();
      return moeI_seterr(ctx, MOE_ERR_CUDA, "copy: cudaMemcpyAsync through a temporary failed: %s: %s",
                        cudaGetErrorName(e2), cudaGetErrorString(e2));
    }
  } else if (d != r) {
    // cudaMemcpyDefault: unified addressing tells host from device memory and one GPU from another
    MOE_CUDA_TRY(ctx, "copy", cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
  }
  // Ordered after the stages issued before it on the stream; the host sees the data on return.
  // Inside a capture the device-to-device copy is a node of the graph, nothing to wait for.
  if (!ctx->capturing) MOE_CUDA_TRY(ctx, "copy", cudaStreamSynchronize(s));
  return moeI_ok(ctx);
}

int moeI_cuda_synchronize(moe_ctx *ctx, int device) {
  if (!ctx) return MOE_ERR_ARG;
  if (ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "synchronize: not allowed during graph capture");
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, device, &s);
  if (rc) return rc;
  MOE_CUDA_TRY(ctx, "synchronize", cudaStreamSynchronize(s));
  return moeI_ok(ctx);
}

// ---- fill and randn ----

// Grid-stride loops over n elements; the grid is capped, each thread takes several elements.
static int grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65536) blocks = 65536;
  return blocks < 1 ? 1 : (int)blocks;
}

// The value's bits were made on the host exactly as moe_tensor_fill makes them on the CPU
// (the same double -> float -> bf16 conversions), so the GPU only stores them.
template <typename T>
__global__ void fill_kernel(T *__restrict__ p, int64_t n, T v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = v;
}

int moeI_cuda_fill(moe_ctx *ctx, moe_tensor *t, double value) {
  if (!t->numel) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, t->device.index, &s);
  if (rc) return rc;
  const int threads = 256;
  const int blocks = grid_for(t->numel, threads);
  if (t->dtype == MOE_F32) {
    float v = (float)value;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    fill_kernel<uint32_t><<<blocks, threads, 0, s>>>((uint32_t *)t->data, t->numel, bits);
  } else if (t->dtype == MOE_BF16) {
    fill_kernel<uint16_t><<<blocks, threads, 0, s>>>((uint16_t *)t->data, t->numel, f32_to_bf16((float)value));
  } else if (t->dtype == MOE_E4M3) {
    fill_kernel<uint8_t><<<blocks, threads, 0, s>>>((uint8_t *)t->data, t->numel, moeI_f32_to_e4m3((float)value));
  } else {
    fill_kernel<int32_t><<<blocks, threads, 0, s>>>((int32_t *)t->data, t->numel, (int32_t)value);
  }
  MOE_CUDA_LAUNCHED(ctx, "fill");
  return moeI_ok(ctx);
}

// moe_tensor_randn's loop, element for element: the integer hash, an exact int -> float
// conversion (|units| <= 131070), then two separately rounded multiplies (__fmul_rn is never
// contracted into an FMA), then the same round-to-nearest-even to bf16.
template <int BF16>
__global__ void randn_kernel(void *__restrict__ p, int64_t n, uint64_t seed, float std) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float unit = __fmul_rn(__int2float_rn(moeI_randn_units(seed, (uint64_t)i)), MOE_RANDN_UNIT);
    float v = __fmul_rn(unit, std);
    if (BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
  }
}

int moeI_cuda_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std) {
  if (t->dtype != MOE_F32 && t->dtype != MOE_BF16)
    return moeI_seterr(ctx, MOE_ERR_ARG, "randn: dtype must be f32 or bf16, got %s", moe_dtype_name(t->dtype));
  if (!t->numel) return moeI_ok(ctx);
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, t->device.index, &s);
  if (rc) return rc;
  const int threads = 256;
  const int blocks = grid_for(t->numel, threads);
  if (t->dtype == MOE_BF16) randn_kernel<1><<<blocks, threads, 0, s>>>(t->data, t->numel, seed, std);
  else randn_kernel<0><<<blocks, threads, 0, s>>>(t->data, t->numel, seed, std);
  MOE_CUDA_LAUNCHED(ctx, "randn");
  return moeI_ok(ctx);
}

// ---- graphs ----

struct moe_graph {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  int device;
  moe_world *worlds[MOE_CAPTURE_WORLDS]; // held open while the graph exists (moeI_world_graph_ref)
  int nworlds;
};

int moeI_cuda_graph_begin(moe_ctx *ctx, int device) {
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, device, &s);
  if (rc) return rc;
  // relaxed: the library's own paths never synchronise while ctx->capturing is set (they
  // refuse instead), and relaxed mode lets what they call into -- NCCL's exchange, a lazy
  // cudaFuncSetAttribute, the destruction of an unrelated graph -- go on without invalidating
  // the capture
  MOE_CUDA_TRY(ctx, "graph", cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  ctx->capturing = 1;
  ctx->capture_nworlds = 0;
  capture_started();
  return moeI_ok(ctx);
}

int moeI_cuda_graph_end(moe_ctx *ctx, moe_graph **out) {
  *out = NULL;
  cudaStream_t s = (cudaStream_t)ctx->stream;
  cudaGraph_t g = NULL;
  cudaError_t err = cudaStreamEndCapture(s, &g);
  ctx->capturing = 0; // the capture is over whether or not it produced a graph
  capture_ended();
  // The device of a stream the context does not own (a world's, bound to it) is asked only after
  // the capture: asked during it, the capture on a world's stream came out invalidated.
  int device = ctx->stream_device;
  if (!ctx->owns_stream && cudaStreamGetDevice(s, &device) != cudaSuccess) {
    (void)cudaGetLastError();
    if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  }
  moeI_cuda_free(0, NULL); // the frees held back during the capture
  if (err != cudaSuccess && g) (void)cudaGraphDestroy(g);
  MOE_CUDA_TRY(ctx, "graph", err);
  cudaGraphExec_t exec = NULL;
  err = cudaGraphInstantiate(&exec, g, 0);
  if (err != cudaSuccess) (void)cudaGraphDestroy(g);
  MOE_CUDA_TRY(ctx, "graph", err);
  moe_graph *graph = (moe_graph *)malloc(sizeof *graph);
  if (!graph) {
    (void)cudaGraphExecDestroy(exec);
    (void)cudaGraphDestroy(g);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "graph: out of host memory");
  }
  graph->g = g;
  graph->exec = exec;
  graph->device = device;
  graph->nworlds = ctx->capture_nworlds;
  for (int i = 0; i < graph->nworlds; i++) moeI_world_graph_ref(graph->worlds[i] = ctx->capture_worlds[i]);
  *out = graph;
  return moeI_ok(ctx);
}

int moeI_cuda_graph_replay(moe_ctx *ctx, moe_graph *graph) {
  for (int i = 0; i < graph->nworlds; i++)
    if (!moeI_world_usable(graph->worlds[i]))
      return moeI_seterr(ctx, MOE_ERR_ARG, "graph: it captured an exchange of a world that was aborted (a timeout "
                                          "or a failed rank); capture again in a new world");
  cudaStream_t s;
  int rc = moeI_cuda_ctx_stream(ctx, graph->device, &s);
  if (rc) return rc;
  MOE_CUDA_TRY(ctx, "graph", cudaGraphLaunch(graph->exec, s));
  return moeI_ok(ctx);
}

void moeI_cuda_graph_free(moe_graph *graph) {
  if (!graph) return;
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess) cur = -1;
  if (cudaSetDevice(graph->device) == cudaSuccess) {
    if (graph->exec) (void)cudaGraphExecDestroy(graph->exec);
    if (graph->g) (void)cudaGraphDestroy(graph->g);
  }
  if (cur >= 0 && cur != graph->device) (void)cudaSetDevice(cur);
  (void)cudaGetLastError();
  for (int i = 0; i < graph->nworlds; i++) moeI_world_graph_unref(graph->worlds[i]); // after the graph is gone
  free(graph);
}

// ---- events ----

int moeI_cuda_event_new(moe_ctx *ctx, int device, void **event) {
  *event = NULL;
  MOE_CUDA_TRY(ctx, "event", cudaSetDevice(device));
  cudaEvent_t e;
  MOE_CUDA_TRY(ctx, "event", cudaEventCreate(&e));
  *event = e;
  return MOE_OK;
}

int moeI_cuda_event_record(moe_ctx *ctx, void *event) {
  if (!ctx) return MOE_ERR_ARG;
  // An event recorded inside a capture becomes part of the graph's dependencies, not a time
  // stamp: time replays by recording around them.
  if (ctx->capturing)
    return moeI_seterr(ctx, MOE_ERR_ARG, "event: cannot record during a graph capture (record around the replay)");
  cudaStream_t s = (cudaStream_t)ctx->stream;
  if (!s) {
    int device = 0;
    MOE_CUDA_TRY(ctx, "event", cudaGetDevice(&device));
    int rc = moeI_cuda_ctx_stream(ctx, device, &s);
    if (rc) return rc;
  }
  MOE_CUDA_TRY(ctx, "event", cudaEventRecord((cudaEvent_t)event, s));
  return moeI_ok(ctx);
}

int moeI_cuda_event_elapsed(moe_ctx *ctx, void *start, void *stop, float *ms) {
  if (ctx && ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "event: cannot wait for an event during a graph capture");
  MOE_CUDA_TRY(ctx, "event", cudaEventSynchronize((cudaEvent_t)stop));
  MOE_CUDA_TRY(ctx, "event", cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)stop));
  return moeI_ok(ctx);
}

void moeI_cuda_event_free(void *event) {
  if (event) (void)cudaEventDestroy((cudaEvent_t)event);
  (void)cudaGetLastError();
}

// ---- the context's scratch (internal.h) ----

namespace {
// A retired scratch block: graphs captured before it was replaced may still use it.
struct old_block {
  void *p;
  int device;
  old_block *next;
};
} // namespace

int moeI_cuda_scratch_get(moe_ctx *ctx, int device, void *stream, size_t nbytes, void **out, int *owned) {
  *out = NULL;
  *owned = 0;
  if (nbytes < MOE_SCRATCH_HEADER) nbytes = MOE_SCRATCH_HEADER;
  const cudaStream_t st = (cudaStream_t)stream;
  moe_ctx::moe_scratch *slot = nullptr;
  for (int i = 0; i < MOE_SCRATCH_SLOTS && !slot; i++)
    if (ctx->scratch[i].p && ctx->scratch[i].device == device && ctx->scratch[i].stream == stream)
      slot = &ctx->scratch[i];
  if (slot && slot->bytes >= nbytes) {
    *out = slot->p;
    return MOE_OK;
  }
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  MOE_CUDA_TRY(ctx, "scratch", cudaStreamIsCapturing(st, &cs));
  if (ctx->capturing || cs != cudaStreamCaptureStatusNone) {
    // cudaMalloc is not allowed here; a stream-ordered allocation becomes the graph's own memory
    void *p = NULL;
    const cudaError_t err = cudaMallocAsync(&p, nbytes, st);
    if (err != cudaSuccess)
      return moeI_seterr(ctx, err == cudaErrorMemoryAllocation ? MOE_ERR_NOMEM : MOE_ERR_CUDA,
                        "scratch: cudaMallocAsync of %zu bytes failed: %s: %s", nbytes, cudaGetErrorName(err),
                        cudaGetErrorString(err));
    MOE_CUDA_TRY(ctx, "scratch", cudaMemsetAsync(p, 0, MOE_SCRATCH_HEADER, st));
    *out = p;
    *owned = 1;
    return MOE_OK;
  }
  // A (device, stream) seen for the first time takes a free slot, or the next one in turn.
  // A block is replaced, never freed: work queued on it (on another stream, or in graphs
  // captured earlier) may still run.  Sizes grow geometrically so that replacements stay few.
  size_t size = slot ? slot->bytes * 2 : 0;
  if (!slot) {
    for (int i = 0; i < MOE_SCRATCH_SLOTS && !slot; i++)
      if (!ctx->scratch[i].p) slot = &ctx->scratch[i];
    if (!slot) slot = &ctx->scratch[ctx->scratch_next++ % MOE_SCRATCH_SLOTS];
  }
  if (size < nbytes) size = nbytes;
  if (size < ((size_t)1 << 20)) size = (size_t)1 << 20;
  old_block *ob = NULL;
  if (slot->p) {
    ob = (old_block *)malloc(sizeof *ob);
    if (!ob) return moeI_seterr(ctx, MOE_ERR_NOMEM, "scratch: out of host memory");
  }
  void *p = NULL;
  const cudaError_t err = cudaMalloc(&p, size);
  if (err != cudaSuccess) {
    free(ob);
    (void)cudaGetLastError();
    return moeI_seterr(ctx, err == cudaErrorMemoryAllocation ? MOE_ERR_NOMEM : MOE_ERR_CUDA,
                      "scratch: cudaMalloc of %zu bytes failed: %s: %s", size, cudaGetErrorName(err),
                      cudaGetErrorString(err));
  }
  if (ob) {
    ob->p = slot->p;
    ob->device = slot->device;
    ob->next = (old_block *)ctx->scratch_old;
    ctx->scratch_old = ob;
  }
  slot->p = p;
  slot->bytes = size;
  slot->device = device;
  slot->stream = stream;
  MOE_CUDA_TRY(ctx, "scratch", cudaMemsetAsync(p, 0, MOE_SCRATCH_HEADER, st));
  *out = p;
  return MOE_OK;
}

int moeI_cuda_scratch_done(moe_ctx *ctx, void *stream, void *p, int owned) {
  if (owned) MOE_CUDA_TRY(ctx, "scratch", cudaFreeAsync(p, (cudaStream_t)stream));
  return MOE_OK;
}

void moeI_cuda_scratch_release(moe_ctx *ctx) {
  for (int i = 0; i < MOE_SCRATCH_SLOTS; i++)
    if (ctx->scratch[i].p) moeI_cuda_free(ctx->scratch[i].device, ctx->scratch[i].p);
  memset(ctx->scratch, 0, sizeof ctx->scratch);
  for (old_block *ob = (old_block *)ctx->scratch_old; ob;) {
    old_block *next = ob->next;
    moeI_cuda_free(ob->device, ob->p);
    free(ob);
    ob = next;
  }
  ctx->scratch_old = NULL;
}
