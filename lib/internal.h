/* SPDX-License-Identifier: MIT */
/* internal.h -- declarations shared by the library's C files and the CUDA launchers. */
#ifndef MOELAB_INTERNAL_H
#define MOELAB_INTERNAL_H

#include "moelab.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The memory behind tensors (lib/core.c): moelab's own allocation or a DLPack producer's
 * tensor, released with the last of the tensors and DLPack exports that hold it. */
typedef struct moe_storage moe_storage;

struct moe_tensor {
  moe_dtype dtype;
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  int64_t numel;
  moe_device device;
  void *data;
  moe_storage *storage; /* one reference held; NULL where the tensor owns nothing: the caller's
                           memory (moe_tensor_wrap), a world's windows, the library's own copies
                           of a header on the stack */
};

enum { MOE_CAPTURE_WORLDS = 4 }; /* worlds one capture may use */
enum { MOE_SCRATCH_SLOTS = 8 };  /* (device, stream) pairs whose scratch a context keeps at once */

/* The options of moe_ctx_config (lib/core.c holds their names and variables). */
enum { MOEI_CFG_SCHEDULE_KERNEL, MOEI_CFG_EXPERTS_KERNEL, MOEI_CFG_EXPERTS_FP8_KERNEL, MOEI_CFG_LOGITS, MOEI_CFG_COUNT };
enum { MOEI_CFG_LEN = 32 }; /* the longest value, NUL included */

struct moe_ctx {
  char config[MOEI_CFG_COUNT][MOEI_CFG_LEN]; /* "" means "auto" */
  void *stream;      /* cudaStream_t the stages run on; NULL until set or first needed */
  int owns_stream;   /* created by the library (moeI_cuda_ctx_stream), destroyed at close */
  int stream_device; /* the device of the stream: owned, or bound to a world's rank; -1 unknown */
  int capturing;     /* inside moe_graph_begin/end: nothing may synchronise */
  /* the worlds whose exchange the capture under way recorded (moeI_world_capture_note): the graph
   * keeps them open, as NCCL needs its communicators for as long as the graph exists */
  moe_world *capture_worlds[MOE_CAPTURE_WORLDS];
  int capture_nworlds;
  char errmsg[1024];
  /* The scheduler's kernels record their phases' times (moeI_schedule_set_trace): a measuring aid
   * for its GPU test, off unless that test turns it on. */
  int schedule_trace;
  /* Device scratch of the CUDA stages (moeI_cuda_scratch_get, kernels/runtime.cu): one block per
   * (device, stream) in use -- a context that serves several ranks' streams in turn keeps one
   * for each -- and the blocks they replaced, kept until close because graphs captured earlier
   * still use them. */
  struct moe_scratch {
    void *p;
    size_t bytes;
    int device;
    void *stream;
  } scratch[MOE_SCRATCH_SLOTS];
  int scratch_next;  /* the slot a new (device, stream) takes when every slot is in use */
  void *scratch_old; /* retired blocks, a list private to kernels/runtime.cu */
};

struct moe_event {
  moe_device device;
  void *event;       /* cudaEvent_t on a GPU */
  double host_ms;    /* monotonic clock on the CPU */
  int recorded;      /* on the CPU: host_ms holds a reading (a GPU event knows it itself) */
};

/* CPU threads (lib/parallel.c).  moeI_parallel_for runs fn(arg, begin, end) on contiguous pieces of
 * [0, n), each at least `grain` long, on up to moeI_cpu_threads() threads (the caller's
 * included), and returns when all are done.  Each index is handled by one call alone, so a
 * result that depends only on its own index is the same bits whatever the thread count.
 * moeI_cpu_threads: MOE_THREADS when set (1..MOEI_MAX_THREADS), else the online CPUs (at most
 * 64).  moeI_env_threads: MOE_THREADS itself, 0 when unset or empty, -1 when it is not an
 * integer in that range (moe_ctx_open refuses it). */
enum { MOEI_MAX_THREADS = 256 };
int moeI_env_threads(void);
int moeI_cpu_threads(void);
void moeI_parallel_for(int64_t n, int64_t grain, void (*fn)(void *arg, int64_t begin, int64_t end), void *arg);

/* Records a message in ctx (when ctx is not NULL) and returns code. printf-style. */
int moeI_seterr(moe_ctx *ctx, int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Clears the message and returns MOE_OK. */
int moeI_ok(moe_ctx *ctx);
/* An option's value: "auto" where none was set. */
const char *moeI_config(const moe_ctx *ctx, int option);
/* A stage's GPU kernels in the order its selector tries them, ", "-separated ("" in a build
 * without CUDA): the valid values of its kernel option besides "auto". */
const char *moeI_schedule_kernels(void);
const char *moeI_experts_kernels(void);
const char *moeI_experts_fp8_kernels(void);
/* The GPU paths of moe_logits, the values of its option: "tensor, exact" in every build. */
const char *moeI_logits_paths(void);
/* Does moe_logits take the tensor-core path for x and w on a GPU of compute capability cc_major
 * (tensor cores with bf16 from 8), under ctx's option?  1 or 0; with report (n > 0), the choice in
 * moe_logits_explain's format. */
int moeI_logits_tensor(const moe_ctx *ctx, const moe_tensor *x, const moe_tensor *w, int cc_major, char *report,
                       size_t n);
/* The expert tile of the tensor path's Hopper kernel (kernels/logits.cu) for E experts: of 64, 96
 * and 128, the one that leaves the fewest columns past E, on a tie the one nearest E / 4 (four
 * tiles across: 384 -> 96, 256 -> 64, 512 -> 128).  A function of E alone, so that a row's bits do
 * not depend on the number of rows. */
int moeI_logits_wgmma_tile(int64_t E);
int moeI_logits_explain_cuda(moe_ctx *ctx, const moe_tensor *x, const moe_tensor *w, char *report, size_t n);
/* The report of moe_<stage>_explain (moelab.h) for tensors on the CPU, and on a GPU (the
 * stage's selector, arguments already checked). */
int moeI_explain_cpu(moe_ctx *ctx, char *report, size_t n);
/* MOE_ERR_ARG unless report holds at least one byte (every call that writes a report) */
int moeI_check_report(moe_ctx *ctx, const char *stage, const char *report, size_t n);
int moeI_schedule_explain_cuda(moe_ctx *ctx, const moe_schedule_args *a, char *report, size_t n);
int moeI_experts_explain_cuda(moe_ctx *ctx, const moe_experts_args *a, char *report, size_t n);

/* The checks moe_tensor_new makes of a dtype and shape, in messages that start with what; the
 * element count in *numel. */
int moeI_check_layout(moe_ctx *ctx, const char *what, moe_dtype dtype, int ndim, const int64_t *shape, int64_t *numel);
/* moe_tensor_wrap with its messages starting with what. */
int moeI_tensor_wrap(moe_ctx *ctx, const char *what, void *data, moe_dtype dtype, int ndim, const int64_t *shape,
                     moe_device device, moe_tensor **out);
/* Storage references: hold and release may be called from any thread (a DLPack consumer's
 * deleter runs where the consumer lets go).  moeI_storage_adopt makes a storage of a DLPack
 * producer's managed tensor (a DLManagedTensor, or a DLManagedTensorVersioned where versioned is
 * set), whose deleter the last release calls; NULL when out of host memory. */
void moeI_storage_hold(moe_storage *s);
void moeI_storage_release(moe_storage *s);
moe_storage *moeI_storage_adopt(void *managed, int versioned);
/* MOE_OK where device can be used in this build and on this machine, else MOE_ERR_UNSUPPORTED
 * or MOE_ERR_ARG with "<stage>: cuda:N ..." (lib/core.c). */
int moeI_check_device(moe_ctx *ctx, const char *stage, moe_device device);

/* NVTX ranges (lib/nvtx.c).  moeI_range_pop closes the innermost range and returns rc, so that a
 * stage reads return MOE_IN_RANGE("route", backend(...)): the comma puts the push before the
 * call, and the pop runs after it, the call being its argument. */
void moeI_range_push(const char *name);
int moeI_range_pop(int rc);
#define MOE_IN_RANGE(name, call) (moeI_range_push(name), moeI_range_pop(call))

/* "f32 [2, 3] on cuda:0" into buf; returns buf. */
const char *moeI_tensor_describe(const moe_tensor *t, char *buf, size_t n);

/* Argument checks: each returns MOE_OK or records "<stage>: <what> must be ..., got ..." and
 * returns MOE_ERR_ARG.  ndim < 0 skips the rank check; a shape entry < 0 matches any size. */
int moeI_check_tensor(moe_ctx *ctx, const char *stage, const char *what, const moe_tensor *t,
                     moe_dtype dtype, int ndim, const int64_t *shape);
/* Every non-NULL tensor in ts (named by names) lives on dev, the device of the tensor named ref;
 * the error names the tensor that does not, where it is and where it should be. */
int moeI_check_same_device(moe_ctx *ctx, const char *stage, const char *ref, moe_device dev,
                          const moe_tensor *const *ts, const char *const *names, int n);
/* As moeI_check_same_device for an array of one tensor per rank, named "<what> of rank r". */
int moeI_check_same_device_list(moe_ctx *ctx, const char *stage, const char *ref, moe_device dev,
                               const moe_tensor *const *list, int n, const char *what);
/* The most ranks combine's CUDA kernel takes (their pointers travel in its parameters); the
 * world checks it before any traffic. */
#define MOE_CUDA_COMBINE_MAX_WORLD 128

/* The first nout tensors of ts are the stage's outputs: none may share a byte with any other
 * tensor of ts (NULL ones skipped): it would be overwritten while still read.  names[i] names ts[i]. */
int moeI_check_no_overlap(moe_ctx *ctx, const char *stage, const moe_tensor *const *ts, const char *const *names,
                         int nout, int n);
/* The same for the output out against each tensor of a per-rank array list [n], named "what[r]". */
int moeI_check_no_overlap_list(moe_ctx *ctx, const char *stage, const moe_tensor *out, const char *out_name,
                              const moe_tensor *const *list, int n, const char *what);

static inline int moeI_on_cpu(const moe_tensor *t) { return t->device.kind == MOE_CPU; }

/* Dispatch's bound on a row's peer_route, T * k routes a source rank (k >= 1): peer_route is
 * i32, so where T * k passes 2^31 (or int64: T may be up to 2^40 on an empty x) every
 * non-negative value is below it and 2^31 serves. */
static inline int64_t moeI_dispatch_routes(int64_t T, int k) {
  return T > (int64_t)INT32_MAX / k ? (int64_t)INT32_MAX + 1 : T * k;
}

/* The helpers below are compiled for the GPU too when a .cu file includes this header, so
 * that the kernels compute the same bits as the CPU from the same source. */
#if defined(__CUDACC__)
#define MOE_HOSTDEV __host__ __device__
#else
#define MOE_HOSTDEV
#endif

/* bf16 helpers usable from C and CUDA code. */
static inline MOE_HOSTDEV float bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}
static inline MOE_HOSTDEV uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40);
  v.u += 0x7fffu + ((v.u >> 16) & 1u);
  return (uint16_t)(v.u >> 16);
}

/* The blocks of moe_quantize and moe_dequantize (lib/quantize.c): the tensor as [B, R, K], blocks
 * of br (128, or 1 for the token kinds) x 128 elements, nbr x nbk of them per b; block (b, i, j)'s
 * scale at b * nbr * nbk + i * srow + j * scol (TOKEN_T: srow 1, scol nbr, B 1).  token: the
 * activations' scale rule, else the weights'. */
typedef struct moeI_qlayout {
  int64_t B, R, K, br, nbr, nbk, srow, scol;
  int token;
} moeI_qlayout;
static inline MOE_HOSTDEV int64_t moeI_qlayout_scale_at(const moeI_qlayout *l, int64_t b, int64_t i, int64_t j) {
  return b * l->nbr * l->nbk + i * l->srow + j * l->scol;
}

/* The randn hash: element i of seed s -> four 16-bit uniforms summed.  Shared by the CPU fill
 * and the CUDA fill so that both give the same bits. */
static inline MOE_HOSTDEV uint64_t moeI_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static inline MOE_HOSTDEV int32_t moeI_randn_units(uint64_t seed, uint64_t i) {
  uint64_t r = moeI_mix64(moeI_mix64(seed + 0x9e3779b97f4a7c15ull) ^ (i * 0xd1b54a32d192ed03ull));
  int32_t s = (int32_t)(r & 0xffff) + (int32_t)((r >> 16) & 0xffff) + (int32_t)((r >> 32) & 0xffff) +
              (int32_t)(r >> 48);
  return s - 131070; /* centred: 4 * 65535 / 2 */
}
/* sqrt(3) / 65536 as the nearest float: sd of the sum of four 16-bit uniforms is 65536/sqrt(3). */
#define MOE_RANDN_UNIT 2.64289974e-05f

/* ---- CPU twins of the stages (lib/<stage>.c); arguments already checked ---- */
int moeI_route_cpu(moe_ctx *ctx, const moe_route_args *a);
int moeI_schedule_cpu(moe_ctx *ctx, const moe_schedule_args *a);
int moeI_dispatch_cpu(moe_ctx *ctx, const moe_dispatch_args *a);
int moeI_experts_cpu(moe_ctx *ctx, const moe_experts_args *a);
/* Offsets are data (written on the device by the schedule), so the experts stages trust none of
 * them.  Expert e owns the rows [m_e, m_{e+1}), where m is the running maximum of the offsets
 * clamped to [0, C]: for a valid schedule (non-decreasing offsets within [0, C]) that is exactly
 * [offsets[e], offsets[e+1]); otherwise a decreasing step is an empty expert and nothing
 * outside [0, C) is read or written, and each row is still written at most once. */
static inline int64_t moeI_clamp_offset(int32_t v, int64_t C) { return v < 0 ? 0 : v > C ? C : v; }
/* m_{e+1}, given lo = m_e */
static inline int64_t moeI_expert_end(const int32_t *offsets, int64_t e, int64_t C, int64_t lo) {
  const int64_t hi = moeI_clamp_offset(offsets[e + 1], C);
  return hi < lo ? lo : hi;
}
int moeI_experts_fp8_cpu(moe_ctx *ctx, const moe_experts_fp8_args *a);
int moeI_logits_cpu(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w);
int moeI_sigmoid_gate_cpu(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w);
int moeI_combine_cpu(moe_ctx *ctx, const moe_combine_args *a);

/* ---- CUDA launchers (kernels/<stage>.cu), same arguments, stream from ctx.  In a build without
 * CUDA, lib/nocuda.c defines them to return MOE_ERR_UNSUPPORTED. ---- */
int moeI_cuda_device_count(int *count);
/* The cuda:N lines of moe_device_info's report (moelab.h), from "kind: cuda" on. */
int moeI_cuda_device_info(moe_ctx *ctx, int device, char *report, size_t n);
void moeI_cuda_ctx_release(moe_ctx *ctx); /* destroys an owned stream */
int moeI_cuda_graph_begin(moe_ctx *ctx, int device);
int moeI_cuda_graph_end(moe_ctx *ctx, moe_graph **out);
int moeI_cuda_graph_replay(moe_ctx *ctx, moe_graph *graph);
void moeI_cuda_graph_free(moe_graph *graph);
/* A world's exchange issued during a capture: recorded in ctx (an error past
 * MOE_CAPTURE_WORLDS worlds).  A graph made from the capture holds each recorded world
 * (moeI_world_graph_ref) until it is freed (moeI_world_graph_unref): closing a world whose communicator
 * a live graph uses would block in NCCL, so moe_world_close leaves that to the last graph. */
int moeI_world_capture_note(moe_ctx *ctx, moe_world *w);
void moeI_world_graph_ref(moe_world *w);
void moeI_world_graph_unref(moe_world *w);
/* 0 once the world was aborted (a timeout or a peer's failure): its graphs must not replay. */
int moeI_world_usable(const moe_world *w);
int moeI_cuda_event_new(moe_ctx *ctx, int device, void **event);
int moeI_cuda_event_record(moe_ctx *ctx, void *event);
int moeI_cuda_event_elapsed(moe_ctx *ctx, void *start, void *stop, float *ms);
void moeI_cuda_event_free(void *event);
int moeI_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **out);
void moeI_cuda_free(int device, void *p);
int moeI_cuda_memcpy(moe_ctx *ctx, moe_device dst_dev, void *dst, moe_device src_dev, const void *src,
                size_t nbytes);
int moeI_cuda_synchronize(moe_ctx *ctx, int device);
int moeI_cuda_fill(moe_ctx *ctx, moe_tensor *t, double value);
int moeI_cuda_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std);
int moeI_cuda_memory(moe_ctx *ctx, int device, size_t *free_bytes, size_t *total_bytes);
int moeI_nonfinite_cuda(moe_ctx *ctx, moe_tensor *stats, const moe_tensor *t);
int moeI_route_cuda(moe_ctx *ctx, const moe_route_args *a);
int moeI_schedule_cuda(moe_ctx *ctx, const moe_schedule_args *a); /* kernels/schedule/select.cu */
int moeI_dispatch_cuda(moe_ctx *ctx, const moe_dispatch_args *a);
int moeI_experts_cuda(moe_ctx *ctx, const moe_experts_args *a);
/* a checked by moe_experts_fp8 (dtypes, shapes, devices, H and F multiples of 128) */
int moeI_experts_fp8_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a);
int moeI_experts_fp8_explain_cuda(moe_ctx *ctx, const moe_experts_fp8_args *a, char *report, size_t n);
int moeI_quantize_cuda(moe_ctx *ctx, moe_tensor *q, moe_tensor *scale, const moe_tensor *x, const moeI_qlayout *l);
int moeI_dequantize_cuda(moe_ctx *ctx, moe_tensor *x, const moe_tensor *q, const moe_tensor *scale,
                         const moeI_qlayout *l);
int moeI_dispatch_fp8_cuda(moe_ctx *ctx, const moe_dispatch_fp8_args *a);
int moeI_logits_cuda(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w);
int moeI_sigmoid_gate_cuda(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w);
int moeI_combine_cuda(moe_ctx *ctx, const moe_combine_args *a);

/* Device scratch owned by the context, for stages that need memory beyond their outputs
 * (kernels/runtime.cu).  moeI_cuda_scratch_get hands out at least nbytes on device, valid in the
 * order of stream (a cudaStream_t).  Its first MOE_SCRATCH_HEADER bytes are zero when first handed
 * out and belong to the scheduler (kernels/schedule/schedule.cuh: a self-resetting grid barrier,
 * and two buffers of totals that each call leaves as the next call needs them); other stages use
 * what follows.  Outside a graph capture it is the context's block, reused by later calls on the
 * same stream (*owned = 0); inside a capture, or where that block cannot serve, it is a
 * stream-ordered allocation of this call alone (*owned = 1), given back by moeI_cuda_scratch_done
 * after its last use has been issued.  So a captured graph stays valid as long as the context that
 * captured it is open.
 * The header's size lives here, not with the scheduler, because it is a contract between every
 * user of the block: the allocator zeroes it in a new block, and any stage that takes scratch
 * must start past it, or it would overwrite the barrier and totals that the scheduler's next call
 * expects to find as its last call left them. */
enum { MOE_SCRATCH_HEADER = 256 + 2 * 4096 * 4 }; /* barrier, then 2 x 4,096 ints of totals */
int moeI_cuda_scratch_get(moe_ctx *ctx, int device, void *stream, size_t nbytes, void **out, int *owned);
int moeI_cuda_scratch_done(moe_ctx *ctx, void *stream, void *p, int owned);
void moeI_cuda_scratch_release(moe_ctx *ctx); /* at close: frees every block */

/* The scheduler's phase trace (kernels/schedule/), for bench/schedule_trace.c: with on set, every
 * later schedule call on ctx records per block the clock at its phase points; the _trace readers
 * copy the last such call's rows of the bitmap or grid kernel (each row: the phase points' clocks,
 * then %globaltimer at entry and end) into out and return the rows copied, or -1. */
void moeI_schedule_set_trace(moe_ctx *ctx, int on);
int moeI_schedule_bitmap_trace(long long *out, int max_blocks);
int moeI_schedule_grid_trace(long long *out, int max_blocks);

#ifdef __cplusplus
}
#endif
#endif
