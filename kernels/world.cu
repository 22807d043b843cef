/* SPDX-License-Identifier: MIT */
// world.cu -- moe_world on NCCL: communicators and streams, the all-gathers, and the dispatch
// and combine exchanges: the all-gather one (NCCL collectives only) and the direct one (peers'
// symmetric windows read with loads over NVLink).  Built only when NCCL is found (lib/world.c has the stand-ins
// otherwise).
//
// Everything here is enqueued on the world's streams (one per local rank) and nothing waits
// on the host, except where a context that is not bound to the world must be kept in order
// (eager use only; see enter/leave) and at open, close and check_config.  So an exchange
// issued on a bound context's stream inside a capture becomes part of the graph.
//
// With several ranks in one thread, NCCL needs the calls of all of them inside one
// ncclGroupStart/ncclGroupEnd (otherwise the first rank's call would wait for peers that the
// thread has not reached yet); kernels are launched outside the group, before or after it,
// so that they keep their place in the stream order.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vector>

#include <nccl.h>
#include <nccl_device.h> // ncclGetPeerPointer, ncclDevCommCreate: the symmetric windows of the direct exchange

#include "common.cuh"
#include "world.h"

static_assert(sizeof(ncclUniqueId) == MOE_WORLD_ID_BYTES, "ncclUniqueId is 128 bytes");

namespace {

inline ncclComm_t comm_of(const moe_world *w, int i) { return (ncclComm_t)w->comms[i]; }
inline cudaStream_t stream_of(const moe_world *w, int i) { return (cudaStream_t)w->streams[i]; }

// "world: rank r: ncclAllGather failed: <NCCL's text> (<its last error>)"; marks the world failed.
int nccl_fail(moe_ctx *ctx, moe_world *w, int i, const char *op, ncclResult_t r) {
  if (w) w->failed = 1;
  const char *last = (w && i >= 0 && w->comms[i]) ? ncclGetLastError(comm_of(w, i)) : ncclGetLastError(nullptr);
  char who[48];
  if (w && i >= 0) snprintf(who, sizeof who, "rank %d", w->ranks[i]);
  else if (w) snprintf(who, sizeof who, "ranks 0..%d", w->size - 1);
  else snprintf(who, sizeof who, "this process");
  return moeI_seterr(ctx, MOE_ERR_CUDA, "world: %s: %s failed: %s%s%s%s", who, op, ncclGetErrorString(r),
                    last && *last ? " (" : "", last && *last ? last : "", last && *last ? ")" : "");
}

#define NCCL_TRY(ctx, w, i, op, call)                                                                                 \
  do {                                                                                                                 \
    ncclResult_t r_ = (call);                                                                                          \
    if (r_ != ncclSuccess) return nccl_fail((ctx), (w), (i), (op), r_);                                                \
  } while (0)

// A group of NCCL calls: the first failure is kept, ncclGroupEnd is always called.
struct Group {
  moe_ctx *ctx;
  moe_world *w;
  ncclResult_t r = ncclSuccess;
  int at = -1;
  const char *op = nullptr;
  Group(moe_ctx *c, moe_world *ww) : ctx(c), w(ww) { r = ncclGroupStart(); op = r ? "ncclGroupStart" : nullptr; }
  void call(int i, const char *name, ncclResult_t res) {
    if (r == ncclSuccess && res != ncclSuccess) r = res, at = i, op = name;
  }
  bool ok() const { return r == ncclSuccess; }
  int end() {
    ncclResult_t e = (op && !strcmp(op, "ncclGroupStart")) ? r : ncclGroupEnd();
    if (r != ncclSuccess) return nccl_fail(ctx, w, at, op, r);
    if (e != ncclSuccess) return nccl_fail(ctx, w, w->nlocal == 1 ? 0 : -1, "ncclGroupEnd", e);
    return MOE_OK;
  }
};

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Ends the world's communication for good: the exchange's barriers see the flag and return, and
// NCCL's kernels end with their communicators' abort.  Every later call says so.
void abort_world(moe_world *w) {
  if (w->abort_flag) *w->abort_flag = 1;
  w->aborted = w->failed = 1;
  for (int i = 0; i < w->nlocal; i++) {
    // a caller's communicator is left to the caller, who may abort it (its stuck work with it)
    if (w->comms[i] && !w->borrowed) (void)ncclCommAbort(comm_of(w, i));
    w->comms[i] = nullptr;
  }
}

// Waits for local rank i's stream, for MOE_WORLD_TIMEOUT seconds at most, watching NCCL's
// asynchronous errors (a peer that died) meanwhile.  Either ends the world (abort_world) and
// raises with the rank and the step, instead of waiting forever.
int wait_rank(moe_ctx *ctx, moe_world *w, int i, const char *stage) {
  const char *step = strncmp(stage, "world: ", 7) ? stage : stage + 7;
  MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
  const double t0 = now_s();
  for (unsigned turn = 0;; turn++) {
    const cudaError_t e = cudaStreamQuery(stream_of(w, i));
    if (e == cudaSuccess) return MOE_OK;
    if (e != cudaErrorNotReady) MOE_CUDA_TRY(ctx, stage, e);
    ncclResult_t async = ncclSuccess;
    if (w->comms[i] && ncclCommGetAsyncError(comm_of(w, i), &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      const int rc = nccl_fail(ctx, w, i, step, async);
      abort_world(w);
      return rc;
    }
    if (now_s() - t0 > w->timeout_s) {
      abort_world(w);
      return moeI_seterr(ctx, MOE_ERR_CUDA,
                        "world: rank %d: %s did not finish within %g s (MOE_WORLD_TIMEOUT): a rank is gone or "
                        "stuck; the world is aborted",
                        w->ranks[i], step, w->timeout_s);
    }
    if (turn > 2000) { // the first ~2 ms poll without a pause: most waits end there
      timespec nap = {0, 50 * 1000};
      nanosleep(&nap, nullptr);
    }
  }
}

// Work of a context that is not bound to the world (its stream is none of the world's) is
// kept in order with the exchange by waiting on the host: before, for what the context issued;
// after, for the exchange.  A capture cannot wait, so it must be bound.
int enter(moe_ctx *ctx, moe_world *w, const char *stage, bool *unbound) {
  *unbound = false;
  if (w->aborted)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the world was aborted after a timeout or a failed rank; close it", stage);
  if (!ctx || !ctx->stream) {
    *unbound = true;
    return MOE_OK;
  }
  // A capture records one stream: the other local ranks' work would run at once, outside it.
  if (ctx->capturing && w->nlocal > 1)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                      "%s: a graph can capture the exchange of a world with one rank in this process, this one has %d",
                      stage, w->nlocal);
  for (int i = 0; i < w->nlocal; i++)
    if (ctx->stream == w->streams[i]) return ctx->capturing ? moeI_world_capture_note(ctx, w) : MOE_OK;
  if (ctx->capturing)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the capturing context is not bound to the world (moe_world_bind first)", stage);
  *unbound = true;
  MOE_CUDA_TRY(ctx, stage, cudaStreamSynchronize((cudaStream_t)ctx->stream));
  return MOE_OK;
}

int leave(moe_ctx *ctx, moe_world *w, const char *stage, bool unbound) {
  if (!unbound) return moeI_ok(ctx);
  for (int i = 0; i < w->nlocal; i++) {
    int rc = wait_rank(ctx, w, i, stage);
    if (rc) return rc;
  }
  return moeI_ok(ctx);
}

// A context of the library's own for launching a stage on the world's stream i: the stage
// launchers take their stream from a context.  Its message is copied to ctx on failure.
struct StreamCtx {
  moe_ctx c;
  StreamCtx(const moe_world *w, int i) {
    memset(&c, 0, sizeof c);
    c.stream = w->streams[i];
    c.stream_device = w->devices[i];
  }
  int pass(moe_ctx *ctx, int rc) const {
    if (rc && ctx) moeI_seterr(ctx, rc, "%s", c.errmsg);
    return rc;
  }
};

// moe_combine's kernel on local rank i's stream, over the owners' ys and route_row as given
// (W of each), for source rank `rank` of them.
int combine_on(moe_ctx *ctx, const moe_world *w, int i, const moe_world_combine_args &a, const moe_tensor *const *ys,
               const moe_tensor *const *route_row, int rank) {
  moe_combine_args c;
  memset(&c, 0, sizeof c);
  c.out = a.out;
  c.weights = a.weights;
  c.ids = a.ids;
  c.ys = ys;
  c.route_row = route_row;
  c.world = w->size;
  c.experts = a.experts;
  c.rank = rank;
  c.shared = a.shared;
  c.shared_gate = a.shared_gate;
  StreamCtx sc(w, i);
  return sc.pass(ctx, moeI_combine_cuda(&sc.c, &c));
}

// ---- combine: the owner's pack ----

// Row f = p * TK + q of the send buffer: ys[route_row[p, q]] when that is a row of ys, zeros
// otherwise; its index: q or -1.
template <typename V>
__global__ void pack_kernel(V *__restrict__ send, int32_t *__restrict__ index, const V *__restrict__ ys,
                            const int32_t *__restrict__ route_row, int64_t rows, int64_t C, int64_t TK, int64_t pieces) {
  for (int64_t f = blockIdx.x; f < rows; f += gridDim.x) {
    const int64_t row = route_row[f];
    const bool has = row >= 0 && row < C;
    if (threadIdx.x == 0) index[f] = has ? (int32_t)(f % TK) : -1;
    V *out = send + f * pieces;
    if (has) {
      const V *in = ys + row * pieces;
      for (int64_t c = threadIdx.x; c < pieces; c += blockDim.x) out[c] = __ldg(in + c);
    } else {
      for (int64_t c = threadIdx.x; c < pieces; c += blockDim.x) out[c] = V{};
    }
  }
}

template <typename V>
void launch_pack(cudaStream_t s, const moe_world_combine_args *a, int64_t W, int64_t TK, int64_t H) {
  const int64_t pieces = H * 2 / (int64_t)sizeof(V), rows = W * TK;
  int64_t blocks = rows < (1 << 20) ? rows : (1 << 20);
  const int threads = pieces >= 256 ? 256 : pieces >= 64 ? 128 : 32;
  pack_kernel<V><<<(unsigned)(blocks ? blocks : 1), threads, 0, s>>>(
      (V *)a->send_rows->data, (int32_t *)a->send_index->data, (const V *)a->ys->data,
      (const int32_t *)a->route_row->data, rows, a->ys->shape[0], TK, pieces);
}

} // namespace

// ---- open, close, bind ----

int moeI_nccl_available(moe_ctx *ctx) { return moeI_ok(ctx); }

int moeI_nccl_version(char *buf, size_t n) {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return MOE_ERR_CUDA;
  snprintf(buf, n, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100); // NCCL_VERSION(X, Y, Z) since 2.9
  return MOE_OK;
}

int moeI_nccl_unique_id(moe_ctx *ctx, unsigned char id[MOE_WORLD_ID_BYTES]) {
  ncclUniqueId u;
  NCCL_TRY(ctx, nullptr, -1, "ncclGetUniqueId", ncclGetUniqueId(&u));
  memcpy(id, u.internal, MOE_WORLD_ID_BYTES);
  return MOE_OK;
}

int moeI_nccl_comm_info(moe_ctx *ctx, void *comm, int *rank, int *size, int *device) {
  const ncclComm_t c = (ncclComm_t)comm;
  NCCL_TRY(ctx, nullptr, -1, "ncclCommUserRank", ncclCommUserRank(c, rank));
  NCCL_TRY(ctx, nullptr, -1, "ncclCommCount", ncclCommCount(c, size));
  NCCL_TRY(ctx, nullptr, -1, "ncclCommCuDevice", ncclCommCuDevice(c, device));
  return MOE_OK;
}

int moeI_nccl_world_open(moe_ctx *ctx, moe_world *w, const unsigned char *id) {
  // A bound that cannot be read is refused, not replaced: a rank waiting 600 s where 60 were
  // asked for looks like a hang.
  const char *t = getenv("MOE_WORLD_TIMEOUT");
  char *end = nullptr;
  const double timeout = t && *t ? strtod(t, &end) : 600;
  if (t && *t && (!end || *end || !(timeout > 0 && timeout < 1e18)))
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: MOE_WORLD_TIMEOUT must be a finite number of seconds > 0, got \"%.64s\"",
                       t);
  w->timeout_s = timeout;
  void *flag = nullptr;
  MOE_CUDA_TRY(ctx, "world", cudaSetDevice(w->devices[0]));
  MOE_CUDA_TRY(ctx, "world", cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  w->abort_flag = (volatile int *)flag;
  *w->abort_flag = 0;
  for (int i = 0; i < w->nlocal; i++) {
    MOE_CUDA_TRY(ctx, "world", cudaSetDevice(w->devices[i]));
    cudaStream_t s;
    MOE_CUDA_TRY(ctx, "world", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    w->streams[i] = s;
  }
  if (w->borrowed) return moeI_ok(ctx); // the caller made the communicator, with its own settings
  // NVLink SHARP (multicast) stays off: it reserves memory and changes algorithms under us, and
  // the machines this was written for lend GPUs without it.  Set before the first init reads it.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (!id) {
    std::vector<ncclComm_t> comms((size_t)w->nlocal, nullptr);
    NCCL_TRY(ctx, w, -1, "ncclCommInitAll", ncclCommInitAll(comms.data(), w->nlocal, w->devices));
    for (int i = 0; i < w->nlocal; i++) w->comms[i] = comms[i];
  } else {
    ncclUniqueId u;
    memcpy(u.internal, id, MOE_WORLD_ID_BYTES);
    MOE_CUDA_TRY(ctx, "world", cudaSetDevice(w->devices[0]));
    ncclComm_t c = nullptr;
    NCCL_TRY(ctx, w, 0, "ncclCommInitRank", ncclCommInitRank(&c, w->size, u, w->ranks[0]));
    w->comms[0] = c;
  }
  return moeI_ok(ctx);
}

void moeI_nccl_world_release(moe_world *w) {
  for (int i = 0; i < w->nlocal; i++) {
    if (!w->streams[i]) continue;
    if (cudaSetDevice(w->devices[i]) == cudaSuccess) {
      // bounded: a stream stuck on a gone peer aborts the world rather than hang the close
      if (!w->failed) (void)wait_rank(nullptr, w, i, "world: close");
      (void)cudaStreamDestroy(stream_of(w, i));
    }
    w->streams[i] = nullptr;
  }
  // After a failure a peer may be gone: abort, which does not wait for anyone.  Otherwise
  // finalise (all local ranks in one group, as for any call of several ranks) and destroy.  A
  // caller's communicator stays as it is, the caller's to use on or to destroy.
  if (w->borrowed) w->comms[0] = nullptr;
  if (!w->failed) {
    if (ncclGroupStart() == ncclSuccess) {
      for (int i = 0; i < w->nlocal; i++)
        if (w->comms[i]) (void)ncclCommFinalize(comm_of(w, i));
      (void)ncclGroupEnd();
    }
  }
  for (int i = 0; i < w->nlocal; i++) {
    if (!w->comms[i]) continue;
    if (w->failed) (void)ncclCommAbort(comm_of(w, i));
    else (void)ncclCommDestroy(comm_of(w, i));
    w->comms[i] = nullptr;
  }
  if (w->abort_flag) (void)cudaFreeHost((void *)w->abort_flag);
  w->abort_flag = nullptr;
  (void)cudaGetLastError();
}

int moeI_nccl_bind(moe_ctx *ctx, moe_world *w, int i) {
  if (ctx->stream == w->streams[i]) return moeI_ok(ctx);
  if (ctx->capturing)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: bind: not during a graph capture (bind before capturing)");
  // From another of this world's ranks: no wait.  The ranks' stages are independent (each on
  // its own GPU and stream) and the exchanges order them, so a process that holds several
  // ranks can issue each one's stages in turn without stalling the host.
  bool sibling = false;
  for (int j = 0; j < w->nlocal; j++) sibling = sibling || ctx->stream == w->streams[j];
  if (ctx->stream && !sibling) MOE_CUDA_TRY(ctx, "world: bind", cudaStreamSynchronize((cudaStream_t)ctx->stream));
  int rc = moe_ctx_set_stream(ctx, w->streams[i]);
  if (!rc) ctx->stream_device = w->devices[i];
  return rc;
}

int moeI_nccl_unbind(moe_ctx *ctx, moe_world *w) {
  for (int i = 0; i < w->nlocal; i++) {
    if (!ctx->stream || ctx->stream != w->streams[i]) continue;
    if (ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "world: unbind: not during a graph capture");
    const int rc = w->aborted ? MOE_OK : wait_rank(ctx, w, i, "world: unbind");
    const int rs = moe_ctx_set_stream(ctx, nullptr); // unbound even after a failed wait
    return rc ? rc : rs;
  }
  return moeI_ok(ctx);
}

// ---- collectives ----

// Local rank i's tensor in gathered into out, as bytes whatever their dtype.
static void gather_bytes(Group &g, moe_world *w, int i, const moe_tensor *in, moe_tensor *out) {
  g.call(i, "ncclAllGather",
         ncclAllGather(in->data, out->data, moe_tensor_nbytes(in), ncclUint8, comm_of(w, i), stream_of(w, i)));
}

static void issue_allgather(Group &g, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in) {
  for (int i = 0; i < w->nlocal && g.ok(); i++) gather_bytes(g, w, i, in[i], out[i]);
}

int moeI_nccl_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in) {
  static const char *stage = "world: allgather";
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  Group g(ctx, w);
  issue_allgather(g, w, out, in);
  if ((rc = g.end())) return rc;
  return leave(ctx, w, stage, unbound);
}

int moeI_nccl_gather_configs(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs, moe_world_config *all) {
  static const char *stage = "world: check_config";
  if (w->aborted)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the world was aborted after a timeout or a failed rank; close it", stage);
  const size_t one = sizeof(moe_world_config), W = (size_t)w->size;
  std::vector<void *> dev((size_t)w->nlocal, nullptr);
  int rc = MOE_OK;
  // the same bytes from every rank, whatever its layer: this collective itself cannot mismatch
  for (int i = 0; i < w->nlocal && !rc; i++) {
    rc = moeI_cuda_alloc(ctx, w->devices[i], one * (W + 1), &dev[i]);
    if (!rc && cudaMemcpyAsync(dev[i], &cfgs[i], one, cudaMemcpyHostToDevice, stream_of(w, i)) != cudaSuccess) {
      (void)cudaGetLastError();
      rc = moeI_seterr(ctx, MOE_ERR_CUDA, "%s: copying rank %d's configuration to cuda:%d failed", stage, w->ranks[i],
                      w->devices[i]);
    }
  }
  if (!rc) {
    Group g(ctx, w);
    for (int i = 0; i < w->nlocal && g.ok(); i++)
      g.call(i, "ncclAllGather",
             ncclAllGather(dev[i], (char *)dev[i] + one, one, ncclUint8, comm_of(w, i), stream_of(w, i)));
    rc = g.end();
  }
  for (int i = 0; i < w->nlocal && !rc; i++) {
    cudaError_t e = cudaSetDevice(w->devices[i]);
    if (e == cudaSuccess) e = cudaMemcpyAsync(all + (size_t)i * W, (char *)dev[i] + one, one * W, cudaMemcpyDeviceToHost,
                                              stream_of(w, i));
    if (e == cudaSuccess && (rc = wait_rank(ctx, w, i, stage))) break;
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      rc = moeI_seterr(ctx, MOE_ERR_CUDA, "%s: rank %d: reading the gathered configurations failed: %s: %s", stage,
                      w->ranks[i], cudaGetErrorName(e), cudaGetErrorString(e));
    }
  }
  for (int i = 0; i < w->nlocal; i++) {
    if (!dev[i]) continue;
    if (rc && cudaSetDevice(w->devices[i]) == cudaSuccess) (void)cudaStreamSynchronize(stream_of(w, i));
    moeI_cuda_free(w->devices[i], dev[i]);
  }
  return rc;
}

// ---- dispatch: all-gather x, then the local dispatch of the gathered tokens ----

int moeI_nccl_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *a) {
  static const char *stage = "world: dispatch";
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  {
    Group g(ctx, w);
    for (int i = 0; i < w->nlocal && g.ok(); i++) gather_bytes(g, w, i, a[i].x, a[i].x_all);
    if ((rc = g.end())) return rc;
  }
  for (int i = 0; i < w->nlocal; i++) {
    moe_dispatch_args d;
    memset(&d, 0, sizeof d);
    d.out = a[i].out;
    d.x = a[i].x_all;
    d.peer_rank = a[i].peer_rank;
    d.peer_route = a[i].peer_route;
    d.k = a[i].k;
    d.zero_fill = a[i].zero_fill;
    StreamCtx sc(w, i);
    if ((rc = sc.pass(ctx, moeI_dispatch_cuda(&sc.c, &d)))) return rc;
  }
  return leave(ctx, w, stage, unbound);
}

// The FP8 tokens: the e4m3 rows and their scales gathered in one group, then moe_dispatch_fp8's
// kernel over them on each rank's stream.
int moeI_nccl_dispatch_fp8(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_fp8_args *a) {
  static const char *stage = "world: dispatch_fp8";
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  {
    Group g(ctx, w);
    for (int i = 0; i < w->nlocal && g.ok(); i++) {
      gather_bytes(g, w, i, a[i].x, a[i].x_all);
      if (g.ok()) gather_bytes(g, w, i, a[i].x_scale, a[i].x_scale_all);
    }
    if ((rc = g.end())) return rc;
  }
  for (int i = 0; i < w->nlocal; i++) {
    moe_dispatch_fp8_args d;
    memset(&d, 0, sizeof d);
    d.out = a[i].out;
    d.out_scale = a[i].out_scale;
    d.x = a[i].x_all;
    d.x_scale = a[i].x_scale_all;
    d.peer_rank = a[i].peer_rank;
    d.peer_route = a[i].peer_route;
    d.k = a[i].k;
    d.zero_fill = a[i].zero_fill;
    StreamCtx sc(w, i);
    if ((rc = sc.pass(ctx, moeI_dispatch_fp8_cuda(&sc.c, &d)))) return rc;
  }
  return leave(ctx, w, stage, unbound);
}

// ---- combine: pack per source rank, all-to-all, combine the owners' rows ----

int moeI_nccl_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *a) {
  static const char *stage = "world: combine";
  const int64_t W = w->size;
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  for (int i = 0; i < w->nlocal; i++) {
    const int64_t TK = a[i].route_row->shape[1], H = a[i].ys->shape[1];
    if (!TK || !H) continue;
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    const uintptr_t ps = (uintptr_t)a[i].send_rows->data, py = (uintptr_t)a[i].ys->data;
    if (H % 8 == 0 && ps % 16 == 0 && py % 16 == 0) launch_pack<uint4>(stream_of(w, i), &a[i], W, TK, H);
    else if (H % 2 == 0 && ps % 4 == 0 && py % 4 == 0) launch_pack<uint32_t>(stream_of(w, i), &a[i], W, TK, H);
    else launch_pack<uint16_t>(stream_of(w, i), &a[i], W, TK, H);
    MOE_CUDA_LAUNCHED(ctx, stage);
  }
  {
    Group g(ctx, w);
    for (int i = 0; i < w->nlocal && g.ok(); i++) {
      const size_t TK = (size_t)a[i].route_row->shape[1], H = (size_t)a[i].ys->shape[1];
      const size_t rows = TK * H * 2, idx = TK * 4;
      char *sr = (char *)a[i].send_rows->data, *rr = (char *)a[i].recv_rows->data;
      char *si = (char *)a[i].send_index->data, *ri = (char *)a[i].recv_index->data;
      ncclComm_t c = comm_of(w, i);
      cudaStream_t s = stream_of(w, i);
      for (int p = 0; p < w->size && g.ok(); p++) {
        g.call(i, "ncclSend", ncclSend(sr + p * rows, rows, ncclUint8, p, c, s));
        g.call(i, "ncclRecv", ncclRecv(rr + p * rows, rows, ncclUint8, p, c, s));
        g.call(i, "ncclSend", ncclSend(si + p * idx, idx, ncclUint8, p, c, s));
        g.call(i, "ncclRecv", ncclRecv(ri + p * idx, idx, ncclUint8, p, c, s));
      }
    }
    if ((rc = g.end())) return rc;
  }
  // Owner o's rows for this rank arrive as recv_rows[o] [T*K, H], row t*K+k where the route
  // got a row on o, and recv_index[o] marks them.  Seen as owner o's ys and, at "rank 0", its
  // route_row, they are exactly what moe_combine reads: the same kernel gives the same bits.
  std::vector<moe_tensor> views((size_t)(2 * W));
  std::vector<const moe_tensor *> ys((size_t)W), rr((size_t)W);
  for (int i = 0; i < w->nlocal; i++) {
    const int64_t TK = a[i].route_row->shape[1], H = a[i].ys->shape[1];
    for (int64_t o = 0; o < W; o++) {
      moe_tensor &y = views[(size_t)(2 * o)], &r = views[(size_t)(2 * o + 1)];
      y = *a[i].recv_rows;
      y.ndim = 2, y.shape[0] = TK, y.shape[1] = H, y.shape[2] = 0, y.numel = TK * H, y.storage = nullptr;
      y.data = (uint16_t *)a[i].recv_rows->data + o * TK * H;
      r = *a[i].recv_index;
      r.ndim = 2, r.shape[0] = 1, r.shape[1] = TK, r.numel = TK, r.storage = nullptr;
      r.data = (int32_t *)a[i].recv_index->data + o * TK;
      ys[(size_t)o] = &y;
      rr[(size_t)o] = &r;
    }
    // the received index is one row per owner: this rank's, at "rank 0"
    if ((rc = combine_on(ctx, w, i, a[i], ys.data(), rr.data(), 0))) return rc;
  }
  return leave(ctx, w, stage, unbound);
}

// ---- the direct exchange: symmetric windows read by the peers ----

namespace {

constexpr int XTHREADS = 256;
constexpr int XUNROLL = 4;  // pieces in flight per thread
constexpr int XMAX_RB = 64; // rows per block at most

inline cudaStream_t xstream(const moe_world_exchange *ex, int i) { return stream_of(ex->w, i); }

// Fills out[p] with rank p's window base as this rank addresses it.
__global__ void peer_bases_kernel(ncclWindow_t win, int W, void **out) {
  for (int p = threadIdx.x; p < W; p += blockDim.x) out[p] = ncclGetPeerPointer(win, 0, p);
}

// Every rank waits for every other.  flags[p] (this rank's window) counts the arrivals of rank
// p; flags[W] counts this rank's own barriers.  All ranks run the same barriers in the same
// order, so the n-th one is passed when every flags[p] has reached n.  The fence before the
// arrival makes this rank's earlier writes (the kernels before this one on its stream) visible
// to the peers that see the arrival; the acquire makes theirs visible to the kernels after.
__global__ void barrier_kernel(char *const *peers, size_t flags_off, int me, int W, const volatile int *abort) {
  uint32_t *mine = (uint32_t *)(peers[me] + flags_off);
  __shared__ uint32_t want;
  if (threadIdx.x == 0) want = mine[W] + 1;
  __syncthreads();
  const uint32_t n = want;
  for (int p = threadIdx.x; p < W; p += blockDim.x) {
    uint32_t *theirs = (uint32_t *)(peers[p] + flags_off) + me;
    __threadfence_system();
    asm volatile("red.release.sys.global.add.u32 [%0], 1;" ::"l"(theirs) : "memory");
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x) {
    uint32_t v;
    // a world aborted on the host (a peer gone) releases the wait; its flag lives in host
    // memory, so it is read once in a while, not on every turn
    for (unsigned spin = 1;; spin++) {
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine + p) : "memory");
      if ((int32_t)(v - n) >= 0 || (spin % 4096 == 0 && *abort)) break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) mine[W] = n;
}

int barrier(moe_ctx *ctx, moe_world_exchange *ex, int i, const char *stage) {
  const int W = ex->w->size;
  barrier_kernel<<<1, W < 32 ? 32 : W > 1024 ? 1024 : W, 0, xstream(ex, i)>>>(
      (char *const *)ex->peers[i], ex->flags_off, ex->w->ranks[i], W, ex->w->abort_flag);
  MOE_CUDA_LAUNCHED(ctx, stage);
  return MOE_OK;
}

struct PullArgs {
  char *const *peers; // [W] window bases
  size_t x_off;
  const int32_t *peer_rank, *peer_route, *route_row; // this rank's schedule
  int64_t C, W, T, K;
  uint32_t pieces; // H in pieces
  int rb;
  int zero_fill;
};

// Dispatch of the direct exchange: row r of xs holds route q = t*K + k of source rank p (by
// peer_rank and peer_route).  Each (p, t) crosses NVLink once: the row of the token's first route
// on this rank (no k' < k with a row in route_row[p]) reads token t from rank p's window and
// writes it to its own row and to the rows of the token's later routes on this rank; those rows
// skip themselves.  Every check is on the rows' own peer data, so schedule data that is not a
// schedule's still gives what moeI_dispatch_cpu gives (a row is written by itself or by a first that
// reads the same token).  With more than kExtra + 1 routes per token (K > 16) every row reads its
// own token.
constexpr int kExtra = 15;

template <typename V, bool kDedup>
__global__ void __launch_bounds__(XTHREADS) pull_kernel(V *__restrict__ xs, PullArgs a) {
  __shared__ const V *src[XMAX_RB];
  __shared__ int keep[XMAX_RB], nextra[XMAX_RB];
  __shared__ int32_t extra[XMAX_RB][kDedup ? kExtra : 1];
  const int64_t r0 = (int64_t)blockIdx.x * a.rb;
  const int nr = (int)(a.C - r0 < a.rb ? a.C - r0 : a.rb);
  const int64_t TK = a.T * a.K;
  for (int j = threadIdx.x; j < nr; j += XTHREADS) {
    const int64_t r = r0 + j, p = a.peer_rank[r], q = a.peer_route[r];
    const V *from = nullptr;
    int put = 0, ne = 0;
    if (p >= 0 && p < a.W && q >= 0 && q < TK) {
      const int64_t t = q / a.K, k = q - t * a.K;
      bool first = true;
      if (kDedup) {
        const int32_t *rr = a.route_row + p * TK + t * a.K;
        int64_t kf = -1;
        for (int64_t k2 = 0; k2 < k && kf < 0; k2++)
          if (rr[k2] >= 0 && rr[k2] < a.C) kf = k2;
        if (kf >= 0) {
          const int64_t f = rr[kf];
          first = !(rr[k] == r && a.peer_rank[f] == p && a.peer_route[f] == t * a.K + kf);
        } else {
          for (int64_t k2 = k + 1; k2 < a.K; k2++) {
            const int64_t d = rr[k2];
            if (d >= 0 && d < a.C && d != r && a.peer_rank[d] == p && a.peer_route[d] == t * a.K + k2)
              extra[j][ne++] = (int32_t)d;
          }
        }
      }
      if (first) from = (const V *)(a.peers[p] + a.x_off) + t * a.pieces, put = 1;
    } else {
      put = a.zero_fill; // all-zero bits are bf16 +0
    }
    src[j] = from;
    keep[j] = put;
    nextra[j] = ne;
  }
  __syncthreads();

  const uint32_t total = (uint32_t)nr * a.pieces;
  V *__restrict__ out = xs + r0 * a.pieces;
  for (uint32_t base = threadIdx.x; base < total; base += XTHREADS * XUNROLL) {
    V v[XUNROLL];
    uint32_t at[XUNROLL];
    bool put[XUNROLL];
#pragma unroll
    for (int u = 0; u < XUNROLL; u++) {
      const uint32_t f = base + u * XTHREADS;
      put[u] = false;
      at[u] = f;
      v[u] = V{};
      if (f < total) {
        const uint32_t j = f / a.pieces, c = f - j * a.pieces;
        if (src[j]) v[u] = src[j][c];
        put[u] = keep[j];
      }
    }
#pragma unroll
    for (int u = 0; u < XUNROLL; u++) {
      if (!put[u]) continue;
      out[at[u]] = v[u];
      if (kDedup) {
        const uint32_t j = at[u] / a.pieces, c = at[u] - j * a.pieces;
        for (int e = 0; e < nextra[j]; e++) xs[(int64_t)extra[j][e] * a.pieces + c] = v[u];
      }
    }
  }
}

template <typename V>
int launch_pull(moe_ctx *ctx, cudaStream_t s, V *xs, PullArgs a, int64_t H, const char *stage) {
  a.pieces = (uint32_t)(H * 2 / (int64_t)sizeof(V)); // H > 0, and H * XMAX_RB < 2^31 (moeI_nccl_exchange_open)
  int64_t rb = (4 * XTHREADS * XUNROLL + a.pieces - 1) / a.pieces;
  a.rb = (int)(rb < 1 ? 1 : rb > XMAX_RB ? XMAX_RB : rb);
  const int64_t blocks = (a.C + a.rb - 1) / a.rb;
  if (a.K <= kExtra + 1) pull_kernel<V, true><<<(unsigned)blocks, XTHREADS, 0, s>>>(xs, a);
  else pull_kernel<V, false><<<(unsigned)blocks, XTHREADS, 0, s>>>(xs, a);
  MOE_CUDA_LAUNCHED(ctx, stage);
  return MOE_OK;
}

// Copies src into local rank i's window at off unless it is already there.
int to_window(moe_ctx *ctx, moe_world_exchange *ex, int i, size_t off, const moe_tensor *src, const char *stage) {
  char *at = (char *)ex->base[i] + off;
  const size_t n = moe_tensor_nbytes(src);
  if (src->data == at || !n) return MOE_OK;
  MOE_CUDA_TRY(ctx, stage, cudaMemcpyAsync(at, src->data, n, cudaMemcpyDeviceToDevice, xstream(ex, i)));
  return MOE_OK;
}

} // namespace

int moeI_nccl_exchange_open(moe_ctx *ctx, moe_world_exchange *ex) {
  static const char *stage = "world: exchange";
  moe_world *w = ex->w;
  const int W = w->size, n = w->nlocal;
  if (w->aborted)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the world was aborted after a timeout or a failed rank; close it", stage);
  if (W > 1024) return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: at most 1024 ranks, got %d", stage, W);
  if (ex->hidden * XMAX_RB >= ((int64_t)1 << 31)) // launch_pull's 32-bit indices, refused before any traffic
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: rows of %lld elements are too long for cuda", stage,
                      (long long)ex->hidden);
  if (W == 1) {
    // NCCL has no symmetric memory for a communicator of one rank, nor any need: the one
    // rank reads its own memory.
    int rc = moeI_cuda_alloc(ctx, w->devices[0], ex->bytes, &ex->base[0]);
    if (!rc) rc = moeI_cuda_alloc(ctx, w->devices[0], sizeof(void *), &ex->peers[0]);
    if (rc) return rc;
    ex->hpeers[0] = ex->base[0];
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[0]));
    MOE_CUDA_TRY(ctx, stage, cudaMemset((char *)ex->base[0] + ex->flags_off, 0, ex->bytes - ex->flags_off));
    MOE_CUDA_TRY(ctx, stage, cudaMemcpy(ex->peers[0], &ex->base[0], sizeof(void *), cudaMemcpyHostToDevice));
    return moeI_ok(ctx);
  }
  // Every rank must be reachable by loads (NCCL's LSA team is the whole world).
  {
    std::vector<ncclDevComm> dc((size_t)n);
    ncclDevCommRequirements req;
    memset(&req, 0, sizeof req);
    Group g(ctx, w);
    for (int i = 0; i < n && g.ok(); i++) g.call(i, "ncclDevCommCreate", ncclDevCommCreate(comm_of(w, i), &req, &dc[i]));
    int rc = g.end();
    if (rc) return rc;
    int lsa = W;
    for (int i = 0; i < n; i++) lsa = dc[i].lsaSize < lsa ? dc[i].lsaSize : lsa;
    Group d(ctx, w);
    for (int i = 0; i < n && d.ok(); i++) d.call(i, "ncclDevCommDestroy", ncclDevCommDestroy(comm_of(w, i), &dc[i]));
    if ((rc = d.end())) return rc;
    if (lsa != W)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED,
                        "%s: only %d of the %d ranks can reach each other's memory (one NVLink domain is needed); "
                        "use the all-gather exchange (moe_world_dispatch, moe_world_combine)",
                        stage, lsa, W);
  }
  for (int i = 0; i < n; i++) {
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    NCCL_TRY(ctx, w, i, "ncclMemAlloc", ncclMemAlloc(&ex->base[i], ex->bytes));
    // zeroed flags before any peer can see the window: registration below is collective
    MOE_CUDA_TRY(ctx, stage, cudaMemset((char *)ex->base[i] + ex->flags_off, 0, ex->bytes - ex->flags_off));
    MOE_CUDA_TRY(ctx, stage, cudaDeviceSynchronize());
  }
  {
    Group g(ctx, w);
    // the handle is written at ncclGroupEnd: it must point at memory that lives until then
    for (int i = 0; i < n && g.ok(); i++)
      g.call(i, "ncclCommWindowRegister",
             ncclCommWindowRegister(comm_of(w, i), ex->base[i], ex->bytes, (ncclWindow_t *)&ex->win[i],
                                    NCCL_WIN_COLL_SYMMETRIC));
    int rc = g.end();
    if (rc) return rc;
  }
  for (int i = 0; i < n; i++) {
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    int rc = moeI_cuda_alloc(ctx, w->devices[i], (size_t)W * sizeof(void *), &ex->peers[i]);
    if (rc) return rc;
    peer_bases_kernel<<<1, 256, 0, xstream(ex, i)>>>((ncclWindow_t)ex->win[i], W, (void **)ex->peers[i]);
    MOE_CUDA_LAUNCHED(ctx, stage);
    MOE_CUDA_TRY(ctx, stage, cudaMemcpyAsync(ex->hpeers + (size_t)i * W, ex->peers[i], (size_t)W * sizeof(void *),
                                             cudaMemcpyDeviceToHost, xstream(ex, i)));
    MOE_CUDA_TRY(ctx, stage, cudaStreamSynchronize(xstream(ex, i)));
  }
  return moeI_ok(ctx);
}

void moeI_nccl_exchange_release(moe_world_exchange *ex) {
  moe_world *w = ex->w;
  for (int i = 0; i < w->nlocal; i++)
    if (ex->base[i] && !w->failed) (void)wait_rank(nullptr, w, i, "world: exchange close");
  if (!w->failed && ncclGroupStart() == ncclSuccess) {
    for (int i = 0; i < w->nlocal; i++)
      if (ex->win[i]) (void)ncclCommWindowDeregister(comm_of(w, i), (ncclWindow_t)ex->win[i]);
    (void)ncclGroupEnd();
  }
  for (int i = 0; i < w->nlocal; i++) {
    if (cudaSetDevice(w->devices[i]) != cudaSuccess) continue;
    if (ex->base[i] && w->size == 1) moeI_cuda_free(w->devices[i], ex->base[i]);
    else if (ex->base[i]) (void)ncclMemFree(ex->base[i]);
    if (ex->peers[i]) moeI_cuda_free(w->devices[i], ex->peers[i]);
    ex->win[i] = ex->base[i] = ex->peers[i] = nullptr;
  }
  (void)cudaGetLastError();
}

int moeI_nccl_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *a) {
  static const char *stage = "world: exchange dispatch";
  moe_world *w = ex->w;
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  for (int i = 0; i < w->nlocal; i++) {
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    if ((rc = to_window(ctx, ex, i, ex->x_off, a[i].x, stage))) return rc;
    if ((rc = barrier(ctx, ex, i, stage))) return rc; // every rank's tokens are in its window
  }
  for (int i = 0; i < w->nlocal; i++) {
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    PullArgs p;
    memset(&p, 0, sizeof p);
    p.peers = (char *const *)ex->peers[i];
    p.x_off = ex->x_off;
    p.peer_rank = (const int32_t *)a[i].peer_rank->data;
    p.peer_route = (const int32_t *)a[i].peer_route->data;
    p.route_row = (const int32_t *)a[i].route_row->data;
    p.C = a[i].out->shape[0], p.W = w->size, p.T = ex->tokens, p.K = ex->k;
    p.zero_fill = a[i].zero_fill != 0;
    const int64_t H = ex->hidden;
    if (p.C && H) {
      // the windows' regions start on 4096-byte boundaries: only out decides the piece
      const uintptr_t pxs = (uintptr_t)a[i].out->data;
      if (H % 8 == 0 && pxs % 16 == 0)
        rc = launch_pull<uint4>(ctx, xstream(ex, i), (uint4 *)a[i].out->data, p, H, stage);
      else if (H % 2 == 0 && pxs % 4 == 0)
        rc = launch_pull<uint32_t>(ctx, xstream(ex, i), (uint32_t *)a[i].out->data, p, H, stage);
      else rc = launch_pull<uint16_t>(ctx, xstream(ex, i), (uint16_t *)a[i].out->data, p, H, stage);
      if (rc) return rc;
    }
    if ((rc = barrier(ctx, ex, i, stage))) return rc; // no rank rewrites its window while a peer reads it
  }
  return leave(ctx, w, stage, unbound);
}

int moeI_nccl_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *a) {
  static const char *stage = "world: exchange combine";
  moe_world *w = ex->w;
  const int W = w->size;
  bool unbound;
  int rc = enter(ctx, w, stage, &unbound);
  if (rc) return rc;
  for (int i = 0; i < w->nlocal; i++) {
    MOE_CUDA_TRY(ctx, stage, cudaSetDevice(w->devices[i]));
    if ((rc = to_window(ctx, ex, i, ex->ys_off, a[i].ys, stage))) return rc;
    if ((rc = to_window(ctx, ex, i, ex->rr_off, a[i].route_row, stage))) return rc;
    if ((rc = barrier(ctx, ex, i, stage))) return rc; // every owner's ys and route_row are in its window
  }
  // Owner o's ys and route_row, read in place through its window: moe_combine's own arguments
  // for a world of W ranks, so the same kernel gives the same bits.
  std::vector<moe_tensor> views((size_t)(2 * W));
  std::vector<const moe_tensor *> ys((size_t)W), rr((size_t)W);
  for (int i = 0; i < w->nlocal; i++) {
    for (int o = 0; o < W; o++) {
      char *base = (char *)ex->hpeers[(size_t)i * W + o];
      moe_tensor &y = views[(size_t)(2 * o)], &r = views[(size_t)(2 * o + 1)];
      y = ex->ys[i];
      y.data = base + ex->ys_off;
      r = *a[i].route_row;
      r.storage = nullptr;
      r.data = base + ex->rr_off;
      ys[(size_t)o] = &y;
      rr[(size_t)o] = &r;
    }
    if ((rc = combine_on(ctx, w, i, a[i], ys.data(), rr.data(), w->ranks[i]))) return rc;
    if ((rc = barrier(ctx, ex, i, stage))) return rc; // no owner rewrites its window while a peer reads it
  }
  return leave(ctx, w, stage, unbound);
}
