/* SPDX-License-Identifier: MIT */
/*
 * moelab.h -- the public C API of moelab, Mixture-of-Experts layer kernels.
 *
 * Plain C: no macros past this preamble are needed to call it.  The declarations between
 * MOE_CDEF_BEGIN and MOE_CDEF_END go to LuaJIT's ffi.cdef once every "MOE_API " (the export
 * marker) is taken out of them (README.md has the two lines of Lua that do it).
 *
 * Conventions (SQLite's): every call that can fail returns an int status (MOE_OK or an error
 * code); the context keeps the message of its last call (moe_errmsg: why it failed, "" after a
 * success); moe_errstr names a code without a context.  Functions that take tensors run where
 * the tensors are: all tensors of one call must live on one device.  Nothing here exits, aborts
 * or longjmps.
 *
 * Data conditions found while computing (NaN logits, invalid expert ids, capacity overflow)
 * are not errors of the C API: the stage records them in its stats tensor (where a captured
 * CUDA graph can leave them) and the caller decides.  The Lua front-end raises on them.
 */
#ifndef MOELAB_H
#define MOELAB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(MOE_BUILDING_SHARED)
#define MOE_API __declspec(dllexport)
#elif defined(__GNUC__)
#define MOE_API __attribute__((visibility("default")))
#else
#define MOE_API
#endif

#define MOE_VERSION_MAJOR 0
#define MOE_VERSION_MINOR 1
#define MOE_VERSION_PATCH 0
#define MOE_VERSION "0.1.0"
#define MOE_VERSION_NUMBER (MOE_VERSION_MAJOR * 10000 + MOE_VERSION_MINOR * 100 + MOE_VERSION_PATCH)
#define MOE_MAX_DIMS 4

/* MOE_CDEF_BEGIN */

enum {
  MOE_OK = 0,
  MOE_ERR_ARG = 1,         /* a bad argument: type, dtype, shape, device or value */
  MOE_ERR_NOMEM = 2,       /* host or device allocation failed */
  MOE_ERR_CUDA = 3,        /* a CUDA runtime or launch failure; the message names it */
  MOE_ERR_UNSUPPORTED = 4, /* no backend for this device in this build */
  MOE_ERR_INTERNAL = 5,
  MOE_ERR_IO = 6           /* a file cannot be opened or read, or its contents are malformed */
};

/* e4m3: OCP FP8 E4M3 (e4m3fn), one byte: bias 7, subnormals, max 448, no infinities, S.1111.111
 * is NaN.  Tensors of it hold the values of a block-scaled FP8 tensor (moe_quantize). */
typedef enum { MOE_F32 = 0, MOE_BF16 = 1, MOE_I32 = 2, MOE_E4M3 = 3 } moe_dtype;
typedef enum { MOE_CPU = 0, MOE_CUDA = 1 } moe_device_kind;
typedef struct moe_device { int kind; int index; } moe_device;

typedef struct moe_ctx moe_ctx;
typedef struct moe_tensor moe_tensor;

MOE_API int moe_libversion_number(void);
MOE_API const char *moe_libversion(void);
MOE_API const char *moe_errstr(int code);

/* A context holds the last error message and, for CUDA, the stream that stages run on.  Where
 * MOE_THREADS is set to anything but an integer from 1 to 256, open fails with MOE_ERR_ARG and,
 * as SQLite's open does, still returns the context in *out, whose moe_errmsg says why: close it
 * with moe_ctx_close.  On any other failure *out is NULL. */
MOE_API int moe_ctx_open(moe_ctx **out);
MOE_API void moe_ctx_close(moe_ctx *ctx);
MOE_API const char *moe_errmsg(const moe_ctx *ctx);
/* Number of usable devices of a kind: 1 for MOE_CPU, the visible GPUs for MOE_CUDA
 * (0 in a build without CUDA or on a machine without a GPU). */
MOE_API int moe_device_count(moe_ctx *ctx, int kind, int *count);
/* What a device is, for a report: "key: value" lines into report (n bytes, truncated to fit).
 *   every device  kind (cpu or cuda), name (the GPU's, or the CPU's model from /proc/cpuinfo)
 *   cpu           threads (the CPU backend's: MOE_THREADS or the online CPUs)
 *   cuda:N        sm_count, sm_clock_mhz (the peak SM clock), memory_mib, compute_capability ("9.0"),
 *                 driver and runtime (the CUDA versions of the driver and of the runtime linked in,
 *                 "12.8"), nccl (the NCCL linked in, "2.27.3", in a build with NCCL)
 * A GPU that is not there fails as a tensor on it would. */
MOE_API int moe_device_info(moe_ctx *ctx, moe_device device, char *report, size_t n);
/* Bytes a device can still hold (*free_bytes) and has in all (*total_bytes).  The host (MOE_CPU):
 * the kernel's MemAvailable (what can be had without swapping), less where the process's
 * cgroup allows less; a GPU: cudaMemGetInfo.  A configuration can be sized against it before
 * anything is allocated. */
MOE_API int moe_device_memory(moe_ctx *ctx, moe_device device, size_t *free_bytes, size_t *total_bytes);
/* The CUDA stream (a cudaStream_t) stages are issued on.  NULL (the default) lets the context
 * make a non-blocking stream of its own on first use, which moe_ctx_stream then returns. */
MOE_API int moe_ctx_set_stream(moe_ctx *ctx, void *stream);
MOE_API void *moe_ctx_stream(const moe_ctx *ctx);
/* Waits for all work issued on the context's stream (a no-op on the CPU). */
MOE_API int moe_ctx_synchronize(moe_ctx *ctx, moe_device device);

/* ---- a context's configuration: named options with text values ----
 *   "schedule_kernel"     the GPU kernel moe_schedule runs: "auto" (the default) or a kernel's name
 *   "experts_kernel"      the GPU kernel moe_experts runs: "auto" or a kernel's name
 *   "experts_fp8_kernel"  the GPU kernel moe_experts_fp8 runs: "auto" or a kernel's name
 *   "logits"              moe_logits' GPU path: "tensor" (the default, which "auto" also names)
 *                         or "exact" (the CPU's sums bit for bit); see moe_logits
 * When a context opens, each option takes the value of its environment variable if that is set
 * (MOE_SCHEDULE_KERNEL, MOE_EXPERTS_KERNEL, MOE_EXPERTS_FP8_KERNEL, MOE_LOGITS); nothing reads the
 * environment after that.  An unknown option or kernel name is MOE_ERR_ARG, and the message lists
 * the valid ones.  A forced kernel that cannot take a problem makes the stage fail with
 * MOE_ERR_UNSUPPORTED and the reason; moe_schedule_explain, moe_experts_explain and
 * moe_experts_fp8_explain tell which kernel a call would run and why. */
MOE_API int moe_ctx_config(moe_ctx *ctx, const char *option, const char *value);
/* The option's value (its default where none was set: "auto", or "tensor" for "logits"), or NULL
 * for an unknown option. */
MOE_API const char *moe_ctx_config_value(const moe_ctx *ctx, const char *option);

/* ---- CUDA graphs: stages issued between begin and end on the context's stream are captured,
 * not run; replay reruns them on whatever the captured tensors hold now.  GPU only. ---- */
typedef struct moe_graph moe_graph;
MOE_API int moe_graph_begin(moe_ctx *ctx, moe_device device);
MOE_API int moe_graph_end(moe_ctx *ctx, moe_graph **out);
MOE_API int moe_graph_replay(moe_ctx *ctx, moe_graph *graph);
MOE_API void moe_graph_free(moe_graph *graph);

/* ---- timing events: device events on a GPU (recorded on the context's stream), a monotonic
 * host clock on the CPU.  elapsed waits for stop. ---- */
typedef struct moe_event moe_event;
MOE_API int moe_event_new(moe_ctx *ctx, moe_device device, moe_event **out);
MOE_API int moe_event_record(moe_ctx *ctx, moe_event *event);
MOE_API int moe_event_elapsed(moe_ctx *ctx, const moe_event *start, const moe_event *stop, float *ms);
MOE_API void moe_event_free(moe_event *event);

/* ---- NVTX ranges, for Nsight Systems and Nsight Compute (--nvtx): every stage pushes a range
 * named after it (route, logits, schedule, dispatch, dispatch_fp8, experts, experts_fp8,
 * sigmoid_gate, combine, reference, allgather, quantize, dequantize) around its work, in the NVTX
 * domain "moelab".  A host names its compositions the same way (the Lua layer: "layer", and each of
 * its stages around the calls that make it up): ranges nest per thread, and pop closes the
 * innermost range this thread's push opened (MOE_ERR_ARG when none is open).  Without a tool
 * attached a range costs next to nothing; a build that did not find the NVTX header
 * (nvtx3/nvToolsExt.h) has none, and push and pop only count. ---- */
MOE_API int moe_range_push(moe_ctx *ctx, const char *name);
MOE_API int moe_range_pop(moe_ctx *ctx);

/* ---- tensors: contiguous, row-major, 0..4 dims ---- */
MOE_API int moe_tensor_new(moe_ctx *ctx, moe_dtype dtype, int ndim, const int64_t *shape,
                           moe_device device, moe_tensor **out);
MOE_API void moe_tensor_free(moe_tensor *t);
/* The accessors: t must be a tensor (NULL is not checked).  dim of an i outside [0, ndim) is 1. */
MOE_API moe_dtype moe_tensor_dtype(const moe_tensor *t);
MOE_API int moe_tensor_ndim(const moe_tensor *t);
MOE_API int64_t moe_tensor_dim(const moe_tensor *t, int i);
MOE_API int64_t moe_tensor_numel(const moe_tensor *t);
MOE_API size_t moe_tensor_nbytes(const moe_tensor *t);
MOE_API moe_device moe_tensor_device(const moe_tensor *t);
/* Host or device address of the first element. */
MOE_API void *moe_tensor_data(moe_tensor *t);
MOE_API size_t moe_dtype_size(moe_dtype dtype);
MOE_API const char *moe_dtype_name(moe_dtype dtype);
/* Host memory in the tensor's own dtype (bf16 as uint16_t bits) <-> the tensor. */
MOE_API int moe_tensor_write(moe_ctx *ctx, moe_tensor *t, const void *host, size_t nbytes);
MOE_API int moe_tensor_read(moe_ctx *ctx, const moe_tensor *t, void *host, size_t nbytes);
/* Same dtype and element count, any devices. */
MOE_API int moe_tensor_copy(moe_ctx *ctx, moe_tensor *dst, const moe_tensor *src);
/* A tensor over the elements [offset, offset + prod(shape)) of base, sharing its memory, which
 * it keeps alive: base may be freed first.  (Memory the caller owns, of moe_tensor_wrap, is the
 * caller's to keep alive for the view too.) */
MOE_API int moe_tensor_view(moe_ctx *ctx, moe_tensor *base, int64_t offset, int ndim, const int64_t *shape,
                            moe_tensor **out);
/* A tensor over memory the caller owns: data (host memory for MOE_CPU, a device pointer of that
 * GPU for MOE_CUDA) holding prod(shape) contiguous row-major elements, aligned to the dtype.
 * moelab never frees data; the caller keeps it alive and unmoved until the tensor is freed and,
 * where a CUDA graph captured a stage that uses the tensor, until that graph is freed too.
 * NULL data is allowed only for an empty tensor. */
MOE_API int moe_tensor_wrap(moe_ctx *ctx, void *data, moe_dtype dtype, int ndim, const int64_t *shape,
                            moe_device device, moe_tensor **out);

/* ---- DLPack: tensors shared with other libraries without a copy (PyTorch, CuPy, JAX, NumPy) ----
 * The structures are DLPack's (https://dmlc.github.io/dlpack/latest/): the official dlpack.h, or
 * moelab_dlpack.h where a program has none.  Both the legacy DLManagedTensor and DLPack 1.x's
 * DLManagedTensorVersioned are read and written.
 *
 * Import: a tensor over the producer's memory, data + byte_offset, which must hold a compact
 * row-major tensor (strides NULL, or the compact ones; a dimension of size 1, or an empty tensor,
 * may have any stride) of 0 to 4 dimensions, of dtype f32 ({kDLFloat, 32, 1}), bf16
 * ({kDLBfloat, 16, 1}), i32 ({kDLInt, 32, 1}) or e4m3 ({kDLFloat8_e4m3fn, 8, 1}), aligned to its
 * dtype, on kDLCPU, kDLCUDAHost (pinned host memory: a cpu tensor) or kDLCUDA (cuda:device_id).
 * kDLCUDAManaged is refused (which device it should run on is the caller's call: moe_tensor_wrap
 * says it).  A versioned tensor must be of major version 1 and writable (no
 * DLPACK_FLAG_BITMASK_READ_ONLY: stages write their outputs in place).  Anything else is
 * MOE_ERR_ARG naming the field, its value and what is taken.
 * Ownership: on success the moelab tensor owns managed and calls its deleter exactly once, when
 * the last moelab tensor or export over its memory is freed (views and exports hold it too).  On
 * any failure moelab has taken nothing: managed is still the caller's, whose deleter the caller
 * calls (DLPack asks that of whoever holds it, a major-version mismatch included).
 * The memory must stay where it is until the deleter runs; moelab orders nothing with the
 * producer's streams: synchronise, or give the context the producer's stream (moe_ctx_set_stream). */
struct DLManagedTensor;
struct DLManagedTensorVersioned;
MOE_API int moe_tensor_from_dlpack(moe_ctx *ctx, struct DLManagedTensor *managed, moe_tensor **out);
MOE_API int moe_tensor_from_dlpack_versioned(moe_ctx *ctx, struct DLManagedTensorVersioned *managed,
                                             moe_tensor **out);
/* Export: a new managed tensor over t's memory (no copy): compact strides always given,
 * byte_offset 0, data NULL for an empty tensor; a versioned one says version 1.0, flags 0.  It
 * keeps the memory alive by itself: t may be freed first, and the memory goes when the last of
 * the tensors over it and the exports of it are released (the consumer calls the deleter once).
 * A tensor over memory the caller owns (moe_tensor_wrap, or a view of one) exports that memory
 * as it is: the caller keeps it alive until the export's deleter has run.  The deleter may run
 * on any thread. */
MOE_API int moe_tensor_to_dlpack(moe_ctx *ctx, moe_tensor *t, struct DLManagedTensor **out);
MOE_API int moe_tensor_to_dlpack_versioned(moe_ctx *ctx, moe_tensor *t, struct DLManagedTensorVersioned **out);

/* Every element set to value, rounded to the dtype (NaN allowed for float dtypes); an i32
 * tensor takes only integers in its range (MOE_ERR_ARG otherwise). */
MOE_API int moe_tensor_fill(moe_ctx *ctx, moe_tensor *t, double value);
/* Pseudo-normal values: the Irwin-Hall sum of four 16-bit uniforms drawn from a hash of
 * (seed, element index), centred and scaled to unit variance, times std (finite, >= 0).  Integer
 * arithmetic and correctly rounded multiplies only, so every device produces the same bits. */
MOE_API int moe_tensor_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std);

/* Data checks: stats i32 [2] = {elements of t (f32, bf16 or e4m3, fewer than 2^31) that are NaN or
 * infinite, the flat index of the first of them or -1}, computed and written where t lives:
 * nothing is read back, so it can be captured.  The front-end raises on routing weights given
 * to it that are not finite. */
MOE_API int moe_nonfinite(moe_ctx *ctx, moe_tensor *stats, const moe_tensor *t);

/* bf16 <-> f32 on the host: round to nearest even, NaN stays NaN. */
MOE_API uint16_t moe_f32_to_bf16(float x);
MOE_API float moe_bf16_to_f32(uint16_t x);
/* OCP FP8 E4M3 (e4m3fn) -> f32, exactly: bias 7, subnormals, max 448, no infinities; S.1111.111
 * is NaN. */
MOE_API float moe_e4m3_to_f32(uint8_t x);

/* ---- FP8: block-scaled e4m3 tensors.  A value is e4m3(q) x scale, the scale f32, one per block:
 *   MOE_QUANT_BLOCK   (weights) x [..., R, K] -> q e4m3 [..., R, K], scale [..., ceil(R/128),
 *                     ceil(K/128)]: blocks of 128 x 128, scale = amax / 448, as the checkpoints'
 *                     weight_scale_inv (0 where amax / 448 is: a block of zeros, NaN aside, or
 *                     of magnitudes up to 448 x 2^-150 = 3.1e-43; its q are then 0, a NaN's 0x7F)
 *   MOE_QUANT_TOKEN   (activations) x [N, K] -> q e4m3 [N, K], scale [N, ceil(K/128)]: blocks of
 *                     1 x 128 along a row, scale = max(amax, 1e-4) / 448
 *   MOE_QUANT_TOKEN_T the same blocks, the scales transposed: [ceil(K/128), N] (what
 *                     moe_experts_fp8 reads, each k block's scales contiguous)
 * amax is the largest |x| of the block, NaN ignored; q = e4m3(x / scale), the division in f32,
 * rounded to nearest even and saturated to +-448; NaN gives 0x7F.  An infinity makes its block's
 * scale infinite, and the block dequantizes to NaN.
 * x is f32 or bf16.  The CPU and the GPU give the same bits.  Dequantize writes
 * e4m3(q) x scale (an f32 product) rounded to its f32 or bf16 output. ---- */
typedef enum { MOE_QUANT_BLOCK = 0, MOE_QUANT_TOKEN = 1, MOE_QUANT_TOKEN_T = 2 } moe_quant_kind;
MOE_API int moe_quantize(moe_ctx *ctx, moe_tensor *q, moe_tensor *scale, const moe_tensor *x, int kind);
MOE_API int moe_dequantize(moe_ctx *ctx, moe_tensor *x, const moe_tensor *q, const moe_tensor *scale, int kind);
/* f32 -> e4m3 as moe_quantize rounds (nearest even, saturating to +-448, NaN to 0x7F). */
MOE_API uint8_t moe_f32_to_e4m3(float x);

/* ---- 1. route: logits f32 [N, E] -> ids i32 [N, K], weights f32 [N, K] ---- */
typedef enum { MOE_SCORE_SOFTMAX = 0, MOE_SCORE_SIGMOID = 1, MOE_SCORE_SQRTSOFTPLUS = 2 } moe_scoring;
typedef struct moe_route_args {
  moe_tensor *ids;           /* out: i32 [N, K]; -1 on a rejected row (below) */
  moe_tensor *weights;       /* out: f32 [N, K]; 0 on a rejected row */
  moe_tensor *stats;         /* out: i32 [2] = {rejected rows, first such row or -1}; may be NULL.
                                A row is rejected when a logit is NaN or the scoring would make a
                                NaN: a NaN key or group score (a NaN bias, or infinite biases of
                                opposite signs), a +inf logit under softmax or sqrtsoftplus, a
                                softmax row whose logits are all -inf */
  const moe_tensor *logits;  /* f32 [N, E] */
  const moe_tensor *bias;    /* f32 [E] selection bias, or NULL (sigmoid and sqrtsoftplus only) */
  int k;
  int scoring;               /* moe_scoring */
  int groups;                /* expert groups (sigmoid only); 1 = none; E % groups == 0 */
  int topk_groups;           /* groups kept, 1..groups */
  float scale;               /* routed scaling factor gamma (sigmoid, sqrtsoftplus); softmax ignores it */
} moe_route_args;
MOE_API int moe_route(moe_ctx *ctx, const moe_route_args *a);

/* ---- 2. schedule: every rank's ids i32 [W, T, K] -> this rank's expert-major rows ---- */
typedef enum { MOE_LAYOUT_ROUNDROBIN = 0, MOE_LAYOUT_PEER_MAJOR = 1 } moe_layout;
enum { MOE_SCHED_THREADS = 1024 }; /* logical threads per source rank in "roundrobin" */
enum {
  MOE_STAT_ROWS_NEEDED = 0, /* padded rows the routes would need without capacity */
  MOE_STAT_ROWS_USED = 1,   /* = expert_offsets[EL] */
  MOE_STAT_DROPPED = 2,     /* local routes that got no row (capacity, expert_capacity) */
  MOE_STAT_INVALID = 3,     /* ids outside [0, E) other than -1, over all ranks */
  MOE_STAT_FIRST_INVALID = 4, /* flat index w*T*K + t*K + k of the first invalid id, or -1 */
  MOE_SCHED_STATS = 5
};
typedef struct moe_schedule_args {
  moe_tensor *peer_rank;         /* out: i32 [C]; -1 on padding and unused rows */
  moe_tensor *peer_route;        /* out: i32 [C]; route index t*K + k in its source rank, or -1 */
  moe_tensor *counts;            /* out: i32 [EL]; routes that got a row */
  moe_tensor *tokens_per_expert; /* out: i32 [EL]; padded sizes */
  moe_tensor *expert_offsets;    /* out: i32 [EL + 1]; exclusive prefix, last = rows used */
  moe_tensor *route_row;         /* out: i32 [W, T*K]; row on this rank or -1 */
  moe_tensor *stats;             /* out: i32 [MOE_SCHED_STATS] */
  const moe_tensor *ids;         /* i32 [W, T, K] */
  int experts;                   /* E, a multiple of W */
  int rank;                      /* 0 <= rank < W */
  int pad;                       /* >= 1 */
  int capacity;                  /* C >= 0 */
  int expert_capacity;           /* < 0: none; else rows kept per expert before padding */
  int layout;                    /* moe_layout */
} moe_schedule_args;
MOE_API int moe_schedule(moe_ctx *ctx, const moe_schedule_args *a);
/* Which kernel moe_schedule would run for a, and why: "<kernel>\n" then one line per candidate in
 * the order they are tried, "<name>: <verdict>", into report (n bytes, truncated to fit).  The
 * arguments are checked as moe_schedule checks them; nothing is launched (the context's stream is
 * made if the context had none).  On the CPU the kernel is "cpu"; where there is nothing to
 * compute, "none". */
MOE_API int moe_schedule_explain(moe_ctx *ctx, const moe_schedule_args *a, char *report, size_t n);

/* ---- 3. dispatch: x bf16 [W, T, H] -> out bf16 [C, H] ---- */
typedef struct moe_dispatch_args {
  moe_tensor *out;               /* out: bf16 [C, H] */
  const moe_tensor *x;           /* bf16 [W, T, H] */
  const moe_tensor *peer_rank;   /* i32 [C] */
  const moe_tensor *peer_route;  /* i32 [C] */
  int k;
  int zero_fill;                 /* nonzero: rows without a route are zeroed, else untouched */
} moe_dispatch_args;
MOE_API int moe_dispatch(moe_ctx *ctx, const moe_dispatch_args *a);

/* ---- 3'. FP8 dispatch: moe_dispatch of e4m3 rows and their scales; the scales go out
 * transposed, as moe_experts_fp8 reads them (a row without a route: zero_fill zeroes its q and
 * its scales, else both are untouched).  H must be a multiple of 128, and k >= 1. ---- */
typedef struct moe_dispatch_fp8_args {
  moe_tensor *out;               /* out: e4m3 [C, H] */
  moe_tensor *out_scale;         /* out: f32 [H/128, C] */
  const moe_tensor *x;           /* e4m3 [W, T, H] */
  const moe_tensor *x_scale;     /* f32 [W, T, H/128] (MOE_QUANT_TOKEN) */
  const moe_tensor *peer_rank;   /* i32 [C] */
  const moe_tensor *peer_route;  /* i32 [C] */
  int k;
  int zero_fill;
} moe_dispatch_fp8_args;
MOE_API int moe_dispatch_fp8(moe_ctx *ctx, const moe_dispatch_fp8_args *a);

/* ---- 4. experts: SwiGLU MLP per expert over its rows ---- */
typedef struct moe_experts_args {
  moe_tensor *out;                   /* out: bf16 [C, H], or x itself; rows >= offsets[EL] untouched */
  const moe_tensor *x;               /* bf16 [C, H] */
  const moe_tensor *offsets;         /* i32 [EL + 1], the schedule's expert_offsets, read where the tensors live */
  const moe_tensor *w_gate_up;       /* bf16 [EL, 2F, H]: F gate rows, then F up rows */
  const moe_tensor *w_down;          /* bf16 [EL, H, F] */
} moe_experts_args;
MOE_API int moe_experts(moe_ctx *ctx, const moe_experts_args *a);
/* Which kernel moe_experts would run for a, and why; as moe_schedule_explain. */
MOE_API int moe_experts_explain(moe_ctx *ctx, const moe_experts_args *a, char *report, size_t n);

/* ---- 4'. FP8 experts: the same SwiGLU MLP on block-scaled e4m3 operands ----
 * For each row and each k block of 128 (K = H for gate_up, F for down) the e4m3 products are
 * summed in f32 and the block's sum is added to the f32 accumulator times x_scale * w_scale (the
 * product of the two scales first).  h = bf16(silu(gate) * up), then quantized per row and 128
 * columns as MOE_QUANT_TOKEN does, is the down projection's input; out is bf16.  H and F must be
 * multiples of 128.  out may overlap no input (it cannot be x: the dtypes differ). */
typedef struct moe_experts_fp8_args {
  moe_tensor *out;                   /* out: bf16 [C, H]; rows >= offsets[EL] untouched */
  const moe_tensor *x;               /* e4m3 [C, H] */
  const moe_tensor *x_scale;         /* f32 [H/128, C] (MOE_QUANT_TOKEN_T) */
  const moe_tensor *offsets;         /* i32 [EL + 1], as moe_experts reads it */
  const moe_tensor *w_gate_up;       /* e4m3 [EL, 2F, H]: F gate rows, then F up rows */
  const moe_tensor *w_gate_up_scale; /* f32 [EL, 2F/128, H/128] (MOE_QUANT_BLOCK) */
  const moe_tensor *w_down;          /* e4m3 [EL, H, F] */
  const moe_tensor *w_down_scale;    /* f32 [EL, H/128, F/128] */
} moe_experts_fp8_args;
MOE_API int moe_experts_fp8(moe_ctx *ctx, const moe_experts_fp8_args *a);
/* Which kernel moe_experts_fp8 would run for a, and why; as moe_schedule_explain. */
MOE_API int moe_experts_fp8_explain(moe_ctx *ctx, const moe_experts_fp8_args *a, char *report, size_t n);

/* ---- router logits: out f32 [N, E] = x bf16 [N, H] . w bf16 [E, H]^T, f32 accumulation ----
 * The CPU sums in f32 in the fixed order of docs/design.md.  On a GPU the context's option
 * "logits" picks the path: "tensor" (the default) runs bf16 tensor-core products with f32
 * accumulation where the device and the problem allow (compute capability 8.0 or later, H a
 * multiple of 8, x and w 16-byte aligned), else the exact path; "exact" gives the CPU's sums bit
 * for bit.  Both fix each output's summation order whatever N and the other rows: a row's logits
 * are the same bits alone or in any batch.  moe_logits_explain says which path a call takes, and
 * why, in moe_experts_explain's format. */
MOE_API int moe_logits(moe_ctx *ctx, moe_tensor *out, const moe_tensor *x, const moe_tensor *w);
MOE_API int moe_logits_explain(moe_ctx *ctx, const moe_tensor *out, const moe_tensor *x, const moe_tensor *w,
                               char *report, size_t n);

/* ---- gate: g f32 [T] = sigmoid(x . w) for the Qwen3.5 shared-expert gate ---- */
MOE_API int moe_sigmoid_gate(moe_ctx *ctx, moe_tensor *g, const moe_tensor *x, const moe_tensor *w);

/* ---- 5. combine: out[t] = sum_k w[t,k] * ys_owner[route_row_owner[rank, t*K+k]] (+ shared) ---- */
typedef struct moe_combine_args {
  moe_tensor *out;                  /* out: bf16 or f32 [T, H] */
  const moe_tensor *weights;        /* f32 [T, K] of the source rank */
  const moe_tensor *ids;            /* i32 [T, K] of the source rank: owner = id / (E / W) */
  const moe_tensor *const *ys;      /* W owners' bf16 [C_o, H] */
  const moe_tensor *const *route_row; /* W owners' i32 [W, T*K] */
  int world;                        /* W */
  int experts;                      /* E */
  int rank;                         /* source rank p */
  const moe_tensor *shared;         /* bf16 [T, H] shared-expert output, or NULL */
  const moe_tensor *shared_gate;    /* f32 [T] multiplier of shared, or NULL (= 1) */
} moe_combine_args;
MOE_API int moe_combine(moe_ctx *ctx, const moe_combine_args *a);

/* ---- the dense reference of a whole layer, CPU only, f32 throughout ----
 * out[n] = sum_k w[n,k] * expert_{id[n,k]}(x[n]) + g[n] * shared(x[n]), where expert e's weights
 * are w_gate_up[e / EL][e % EL], and nothing is rounded to bf16 between the products.  Masked
 * (-1) ids add nothing; any other id outside [0, E) is an error. */
typedef struct moe_reference_args {
  moe_tensor *out;                        /* out: f32 [N, H] */
  const moe_tensor *x;                    /* bf16 [N, H] */
  const moe_tensor *ids;                  /* i32 [N, K] */
  const moe_tensor *weights;              /* f32 [N, K] */
  const moe_tensor *const *w_gate_up;     /* W ranks' bf16 [EL, 2F, H] */
  const moe_tensor *const *w_down;        /* W ranks' bf16 [EL, H, F] */
  int world;
  int experts;
  const moe_tensor *shared_gate_up;       /* bf16 [1, 2Fs, H], or NULL */
  const moe_tensor *shared_down;          /* bf16 [1, H, Fs], or NULL */
  const moe_tensor *shared_gate_w;        /* bf16 [H]: g = sigmoid(x . w), or NULL (g = 1) */
} moe_reference_args;
MOE_API int moe_reference(moe_ctx *ctx, const moe_reference_args *a);
/* The same layer with FP8 experts and shared expert (moe_experts_fp8's weights): each weight is
 * dequantized to f32 (e4m3(q) x scale), each token row x[n] is quantized as MOE_QUANT_TOKEN and
 * dequantized, and so is the hidden activation silu(gate) * up (from f32, not rounded to bf16
 * first); everything else in f32 as moe_reference (the shared gate reads the bf16 x).  H, F and
 * Fs must be multiples of 128.  CPU only. */
typedef struct moe_reference_fp8_args {
  moe_tensor *out;                        /* out: f32 [N, H] */
  const moe_tensor *x;                    /* bf16 [N, H] */
  const moe_tensor *ids;                  /* i32 [N, K] */
  const moe_tensor *weights;              /* f32 [N, K] */
  const moe_tensor *const *w_gate_up;     /* W ranks' e4m3 [EL, 2F, H] */
  const moe_tensor *const *w_gate_up_scale; /* W ranks' f32 [EL, 2F/128, H/128] */
  const moe_tensor *const *w_down;        /* W ranks' e4m3 [EL, H, F] */
  const moe_tensor *const *w_down_scale;  /* W ranks' f32 [EL, H/128, F/128] */
  int world;
  int experts;
  const moe_tensor *shared_gate_up;       /* e4m3 [1, 2Fs, H], or NULL */
  const moe_tensor *shared_gate_up_scale; /* f32 [1, 2Fs/128, H/128] */
  const moe_tensor *shared_down;          /* e4m3 [1, H, Fs], or NULL */
  const moe_tensor *shared_down_scale;    /* f32 [1, H/128, Fs/128] */
  const moe_tensor *shared_gate_w;        /* bf16 [H]: g = sigmoid(x . w), or NULL (g = 1) */
} moe_reference_fp8_args;
MOE_API int moe_reference_fp8(moe_ctx *ctx, const moe_reference_fp8_args *a);

/* ---- safetensors: tensors read from a checkpoint file ----
 * open parses the whole header strictly (its JSON, names in well-formed UTF-8, every tensor's
 * offsets against the file's size and its shape's byte count, the tensors tiling the data with no
 * byte shared or left over; anything but a regular file refused) and keeps the file open; read
 * then reads one tensor's bytes (pread, nothing else of the file) into a tensor on any device,
 * converting as it goes.  A malformed or unreadable file is MOE_ERR_IO, with the file, and the
 * header's byte where its JSON goes wrong; a missing tensor or a destination that does not fit it
 * is MOE_ERR_ARG. */
typedef struct moe_safetensors moe_safetensors;
typedef struct moe_safetensors_info {
  const char *name;    /* valid until the file is closed */
  const char *dtype;   /* as the file names it: "BF16", "F32", "F8_E4M3", "I64", ... */
  int ndim;            /* 0 to 8 */
  int64_t shape[8];
  int64_t offset;      /* the file's byte where its data starts */
  int64_t nbytes;
} moe_safetensors_info;
MOE_API int moe_safetensors_open(moe_ctx *ctx, const char *path, moe_safetensors **out);
MOE_API void moe_safetensors_close(moe_safetensors *f); /* NULL is a no-op */
MOE_API const char *moe_safetensors_path(const moe_safetensors *f);
/* Tensors in the file ("__metadata__" is not one), in name order: i in [0, count). */
MOE_API int moe_safetensors_count(const moe_safetensors *f);
MOE_API int moe_safetensors_find(const moe_safetensors *f, const char *name); /* its i, or -1 */
MOE_API int moe_safetensors_tensor(moe_ctx *ctx, const moe_safetensors *f, int i, moe_safetensors_info *out);
/* Tensor name into dst, bf16 or f32 (e4m3 for an F8_E4M3 tensor read without a scale) of the same
 * shape on any device.  BF16, F16, F32 and F8_E4M3 are read: BF16 into bf16, F32 into f32 and
 * F8_E4M3 into e4m3 (without a scale) bit for bit, the rest converted to f32 and rounded to the
 * destination (to nearest even).  scale (F8_E4M3 of 2 dimensions [R, C] only; NULL: none) is its
 * block scale, f32 [ceil(R/128), ceil(C/128)] on the CPU, as Hugging Face FP8 checkpoints keep it
 * beside each weight ("weight_scale_inv"): element (r, c) is
 * e4m3(q) x scale[r/128][c/128], an f32 product, then rounded to the destination. */
MOE_API int moe_safetensors_read(moe_ctx *ctx, moe_safetensors *f, const char *name, const moe_tensor *scale,
                                 moe_tensor *dst);

/* ---- expert parallelism across GPUs: a world of W ranks on NCCL ----
 * A moe_world is this process's part of a world of W ranks: one rank per GPU, each with an
 * NCCL communicator and a stream of its own (created on the rank's device).  One process may
 * hold all W ranks (moe_world_open_local, ncclCommInitAll) or one rank of a multi-process
 * launch (moe_world_open_rank, ncclCommInitRank with an id made once by moe_world_unique_id
 * and passed to every process), or one rank over the caller's own communicator
 * (moe_world_open_comm).  Functions that act on "each local rank" take arrays with one
 * entry per rank of this process, in the order of moe_world_local_rank.
 *
 * The exchange functions enqueue their work on the world's streams and never wait on the host,
 * so they can be captured in a CUDA graph: bind a context to the rank's stream first
 * (moe_world_bind), so that the stages run around them are ordered with them and a capture on
 * the context captures them too.  Every rank must call the same exchange functions in the same
 * order with the same sizes: moe_world_check_config, run once when a layer is built, verifies
 * that and fails on every rank (never hangs) when the ranks disagree.  NCCL failures return
 * MOE_ERR_CUDA with "world: rank r: ncclX failed: <NCCL's text>".  A build without NCCL (or
 * without CUDA) returns MOE_ERR_UNSUPPORTED from every function that needs it. */
typedef struct moe_world moe_world;
enum { MOE_WORLD_ID_HEX = 256 }; /* hex digits of an ncclUniqueId (128 bytes); buffers need one more */

/* A new NCCL unique id as MOE_WORLD_ID_HEX lower-case hex digits and a NUL (n >= 257). */
MOE_API int moe_world_unique_id(moe_ctx *ctx, char *hex, size_t n);
/* All ndev ranks in this process: rank i on GPU devices[i] (distinct). */
MOE_API int moe_world_open_local(moe_ctx *ctx, int ndev, const int *devices, moe_world **out);
/* Rank `rank` of world_size, on GPU `device`; every rank passes the same id (hex text).
 * Blocks until all world_size ranks have joined (NCCL's bootstrap). */
MOE_API int moe_world_open_rank(moe_ctx *ctx, int rank, int world_size, int device, const char *unique_id_hex,
                                moe_world **out);
/* One rank of a world over a communicator the caller made (an ncclComm_t, blocking, as NCCL's
 * default config makes it), for a program that runs NCCL itself: rank and size are the
 * communicator's (ncclCommUserRank, ncclCommCount), and its GPU (ncclCommCuDevice) must be
 * `device`.  moelab uses the communicator and never finalises, destroys or aborts it: the caller
 * keeps it alive until the world is closed (and the graphs that captured its exchanges are
 * freed), and destroys it after.  Every rank of the communicator opens its world the same way
 * and calls the world's collectives in the same order.  After a timeout or a peer's failure the
 * world is aborted as any other, but the communicator is left as it is: aborting it
 * (ncclCommAbort), which ends the work stuck on it, is the caller's call. */
MOE_API int moe_world_open_comm(moe_ctx *ctx, void *nccl_comm, int device, moe_world **out);
/* Waits for the world's streams, then frees everything; NULL is a no-op.  w may not be used
 * after the call; but where a graph that captured its exchange is still alive, the
 * communicators stay for that graph and are freed with the last such graph (moe_graph_free). */
MOE_API void moe_world_close(moe_world *w);
MOE_API int moe_world_size(const moe_world *w);        /* W */
MOE_API int moe_world_local_count(const moe_world *w); /* ranks held by this process */
MOE_API int moe_world_local_rank(const moe_world *w, int i);   /* global rank of local rank i, or -1 */
MOE_API int moe_world_local_device(const moe_world *w, int i); /* its GPU, or -1 */
MOE_API void *moe_world_stream(const moe_world *w, int i);     /* its cudaStream_t, or NULL */
/* Points ctx at local rank i's stream (moe_ctx_set_stream), after waiting for the work the
 * context had issued on its previous stream; a no-op when it is already there (also inside a
 * capture).  moe_world_unbind puts a context bound to one of w's streams back on its own. */
MOE_API int moe_world_bind(moe_ctx *ctx, moe_world *w, int i);
MOE_API int moe_world_unbind(moe_ctx *ctx, moe_world *w);

/* What every rank must agree on before an exchange.  All fields are compared. */
typedef struct moe_world_config {
  int version;         /* MOE_VERSION_NUMBER of the rank's library */
  int world;           /* W as the rank sees it */
  int tokens;          /* T */
  int k;               /* K */
  int experts;         /* E */
  int hidden;          /* H */
  int capacity;        /* C */
  int pad;
  int layout;          /* moe_layout */
  int expert_capacity; /* < 0: none */
} moe_world_config;
enum { MOE_WORLD_CONFIG_FIELDS = 10 };
/* One all-gather of every rank's config (cfgs: one per local rank), then the comparison below
 * on every rank: MOE_ERR_ARG on all of them, naming the ranks and the field, when they differ.
 * Waits on the host: not during a capture. */
MOE_API int moe_world_check_config(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs);
/* The comparison alone, on configs gathered by any means (all[W]), as seen from rank `rank`. */
MOE_API int moe_world_compare_configs(moe_ctx *ctx, int rank, int world, const moe_world_config *all);

/* out[i] [W, ...] = every rank's in[i] [...] (same dtype and shape on every rank), in rank
 * order: ncclAllGather.  allgather_ids is the routing step: ids i32 [T, K] -> [W, T, K]. */
MOE_API int moe_world_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in);
MOE_API int moe_world_allgather_ids(moe_ctx *ctx, moe_world *w, moe_tensor *const *all_ids,
                                    const moe_tensor *const *ids);

/* Dispatch across ranks: x_all = all-gather of every rank's x [T, H] (W*T*H bf16 arrive on each
 * rank), then the local dispatch of x_all by this rank's schedule, exactly as in a simulated
 * world whose x is x_all. */
typedef struct moe_world_dispatch_args {
  moe_tensor *out;              /* out: bf16 [C, H] */
  moe_tensor *x_all;            /* out: bf16 [W, T, H], every rank's tokens; x may be this
                                   rank's own slot of it (in place), nothing else may overlap it */
  const moe_tensor *x;          /* bf16 [T, H], this rank's tokens */
  const moe_tensor *peer_rank;  /* i32 [C], this rank's schedule */
  const moe_tensor *peer_route; /* i32 [C] */
  int k;
  int zero_fill;
  const moe_tensor *route_row;  /* i32 [W, T*K], this rank's schedule: the direct exchange's
                                   (moe_world_exchange_dispatch) only; the all-gather ignores it */
} moe_world_dispatch_args;
MOE_API int moe_world_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *a);

/* The same all-gather exchange of FP8 tokens: x_all and x_scale_all = all-gathers of every rank's
 * e4m3 rows x [T, H] and their scales x_scale [T, H/128] (moe_quantize's MOE_QUANT_TOKEN;
 * W*T*H bytes and W*T*H/128 f32 arrive on each rank), then moe_dispatch_fp8 of them by this
 * rank's schedule, exactly as in a simulated world whose x and x_scale are x_all and
 * x_scale_all.  H must be a multiple of 128.  The direct exchange below has no FP8 form: its
 * windows hold bf16 rows. */
typedef struct moe_world_dispatch_fp8_args {
  moe_tensor *out;              /* out: e4m3 [C, H] */
  moe_tensor *out_scale;        /* out: f32 [H/128, C], transposed as moe_experts_fp8 reads it */
  moe_tensor *x_all;            /* out: e4m3 [W, T, H]; x may be this rank's own slot of it */
  moe_tensor *x_scale_all;      /* out: f32 [W, T, H/128]; x_scale may be this rank's own slot */
  const moe_tensor *x;          /* e4m3 [T, H], this rank's tokens */
  const moe_tensor *x_scale;    /* f32 [T, H/128] */
  const moe_tensor *peer_rank;  /* i32 [C], this rank's schedule */
  const moe_tensor *peer_route; /* i32 [C] */
  int k;
  int zero_fill;
} moe_world_dispatch_fp8_args;
MOE_API int moe_world_dispatch_fp8(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_fp8_args *a);

/* Combine across ranks.  Each owner o packs, for every source rank p, the rows of its ys that
 * p's routes got (route_row[p, t*K+k]) into send_rows[p] [T*K, H] in (t, k) order (zero where
 * the route has no row on o) and their marks into send_index[p] (t*K+k, or -1); a grouped
 * ncclSend/ncclRecv gives rank p recv_rows[o] and recv_index[o] from every owner o; then p
 * combines them with moe_combine's kernel: the same k-ascending f32 sum, so the same bits as
 * the simulated world.  Per rank W*T*K*H bf16 rows and W*T*K i32 leave and arrive: dense, not
 * sparse (a route has one owner, so (W-1)/W of the rows sent are zeros). */
typedef struct moe_world_combine_args {
  moe_tensor *out;                /* out: bf16 or f32 [T, H] */
  const moe_tensor *weights;      /* f32 [T, K], this rank's */
  const moe_tensor *ids;          /* i32 [T, K], this rank's */
  const moe_tensor *ys;           /* bf16 [C, H], this rank's expert outputs */
  const moe_tensor *route_row;    /* i32 [W, T*K], this rank's schedule */
  moe_tensor *send_rows;          /* scratch: bf16 [W, T*K, H] */
  moe_tensor *recv_rows;          /* scratch: bf16 [W, T*K, H] */
  moe_tensor *send_index;         /* scratch: i32 [W, T*K] */
  moe_tensor *recv_index;         /* scratch: i32 [W, T*K] */
  int experts;                    /* E */
  const moe_tensor *shared;       /* bf16 [T, H] or NULL */
  const moe_tensor *shared_gate;  /* f32 [T] or NULL */
} moe_world_combine_args;
MOE_API int moe_world_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *a);

/* The direct exchange.  Every rank's tokens x [T, H], expert outputs ys [C, H] and route_row
 * [W, T*K] live in NCCL symmetric memory (a window per rank: ncclMemAlloc +
 * ncclCommWindowRegister), which the peers read over NVLink with plain loads.  Dispatch on owner
 * o reads each (source rank, token) that has a route on o once, into the row of its first such
 * route (lowest k), and copies that row locally to the token's other routes on o; combine on
 * source p reads its routes' rows straight from the owners' ys and sums them with moe_combine's
 * kernel.  So only the rows that must move cross NVLink, and the results equal the all-gather
 * exchange's (and the simulated world's) bit for bit.  Each exchange starts and ends with a
 * barrier on the device (flags in the windows, system-scope release and acquire), so nothing
 * waits on the host and a bound context captures it.  It needs every rank reachable by loads
 * (one NVLink domain, in practice one host); elsewhere open fails with MOE_ERR_UNSUPPORTED and
 * the all-gather exchange above is the way.
 * Open and close are collective: every rank calls them, with the same sizes. */
typedef struct moe_world_exchange moe_world_exchange;
MOE_API int moe_world_exchange_open(moe_ctx *ctx, moe_world *w, int64_t tokens, int k, int64_t hidden,
                                    int64_t capacity, moe_world_exchange **out);
/* NULL is a no-op.  A world closed before its exchanges stays open until the last is closed.
 * A graph that captured the exchange's dispatch or combine uses its windows: free the graph
 * first (the Lua front-end keeps the exchange alive for its graphs). */
MOE_API void moe_world_exchange_close(moe_world_exchange *ex);
/* Views of local rank i's window: x bf16 [T, H] and ys bf16 [C, H] (either pointer may be
 * NULL).  A rank that writes its tokens into x and its experts' output into ys saves the
 * exchange a local copy of each; any other x and ys are copied in first.  The views do not own
 * the memory (free them with moe_tensor_free) and die with the exchange. */
MOE_API int moe_world_exchange_views(moe_ctx *ctx, moe_world_exchange *ex, int i, moe_tensor **x, moe_tensor **ys);
/* moe_world_dispatch's arguments per local rank, x_all unused, route_row required. */
MOE_API int moe_world_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *a);
/* moe_world_combine's arguments per local rank; the send and receive scratch are unused. */
MOE_API int moe_world_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *a);

/* MOE_CDEF_END */

#ifdef __cplusplus
}
#endif
#endif /* MOELAB_H */
