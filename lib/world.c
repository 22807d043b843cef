/* SPDX-License-Identifier: MIT */
/* world.c -- moe_world, the host side: arguments, the unique id as hex text, the comparison of
 * the ranks' configurations.  What needs NCCL is in kernels/world.cu; without it (a build with
 * CUDA but no NCCL: MOE_WORLD_STUBS), the stand-ins at the end say so. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_math.h"
#include "world.h"

_Static_assert(sizeof(moe_world_config) == MOE_WORLD_CONFIG_FIELDS * sizeof(int),
               "moe_world_config is compared and gathered as an array of ints");

/* In the order of moe_world_config's fields. */
static const char *const config_fields[MOE_WORLD_CONFIG_FIELDS] = {
  "version", "world", "tokens", "k", "experts", "hidden", "capacity", "pad", "layout", "expert_capacity",
};

static int hexval(int c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static int parse_id(moe_ctx *ctx, const char *hex, unsigned char id[MOE_WORLD_ID_BYTES]) {
  if (!hex) return moeI_seterr(ctx, MOE_ERR_ARG, "world: the unique id is NULL");
  size_t n = strlen(hex);
  if (n != 2 * MOE_WORLD_ID_BYTES)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: the unique id must be %d hex digits (an ncclUniqueId), got %zu characters",
                      2 * MOE_WORLD_ID_BYTES, n);
  for (size_t i = 0; i < n; i += 2) {
    int hi = hexval((unsigned char)hex[i]), lo = hexval((unsigned char)hex[i + 1]);
    if (hi < 0 || lo < 0) {
      size_t at = hi < 0 ? i : i + 1;
      unsigned char c = (unsigned char)hex[at];
      if (c >= 0x20 && c < 0x7f)
        return moeI_seterr(ctx, MOE_ERR_ARG, "world: the unique id has '%c' at position %zu, expected a hex digit", c, at + 1);
      return moeI_seterr(ctx, MOE_ERR_ARG, "world: the unique id has byte 0x%02x at position %zu, expected a hex digit", c,
                        at + 1);
    }
    id[i / 2] = (unsigned char)(hi << 4 | lo);
  }
  return MOE_OK;
}

int moe_world_unique_id(moe_ctx *ctx, char *hex, size_t n) {
  if (!hex || n < 2 * MOE_WORLD_ID_BYTES + 1)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: unique_id needs a buffer of at least %d bytes, got %zu",
                      2 * MOE_WORLD_ID_BYTES + 1, hex ? n : 0);
  unsigned char id[MOE_WORLD_ID_BYTES];
  int rc = moeI_nccl_unique_id(ctx, id);
  if (rc) return rc;
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < MOE_WORLD_ID_BYTES; i++) {
    hex[2 * i] = digits[id[i] >> 4];
    hex[2 * i + 1] = digits[id[i] & 15];
  }
  hex[2 * MOE_WORLD_ID_BYTES] = '\0';
  return moeI_ok(ctx);
}

static moe_world *world_new(int size, int nlocal) {
  moe_world *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->size = size;
  w->nlocal = nlocal;
  w->ranks = calloc((size_t)nlocal, sizeof *w->ranks);
  w->devices = calloc((size_t)nlocal, sizeof *w->devices);
  w->comms = calloc((size_t)nlocal, sizeof *w->comms);
  w->streams = calloc((size_t)nlocal, sizeof *w->streams);
  if (!w->ranks || !w->devices || !w->comms || !w->streams) {
    moe_world_close(w);
    return NULL;
  }
  return w;
}

static void world_destroy(moe_world *w) {
  if (w->comms && w->streams) moeI_nccl_world_release(w);
  free(w->ranks);
  free(w->devices);
  free(w->comms);
  free(w->streams);
  free(w);
}

/* Closed while a graph that captured its exchange is alive, the world stays open for that graph
 * and is released with the last such graph: destroying a communicator a graph still uses
 * blocked in NCCL (the Lua world spec hung at its teardown that way). */
void moe_world_close(moe_world *w) {
  if (!w) return;
  if (w->graphs > 0) {
    w->closed = 1;
    return;
  }
  world_destroy(w);
}

int moeI_world_capture_note(moe_ctx *ctx, moe_world *w) {
  for (int i = 0; i < ctx->capture_nworlds; i++)
    if (ctx->capture_worlds[i] == w) return MOE_OK;
  if (ctx->capture_nworlds == MOE_CAPTURE_WORLDS)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: one graph capture may use at most %d worlds", MOE_CAPTURE_WORLDS);
  ctx->capture_worlds[ctx->capture_nworlds++] = w;
  return MOE_OK;
}

void moeI_world_graph_ref(moe_world *w) { w->graphs++; }

int moeI_world_usable(const moe_world *w) { return !w->aborted; }

void moeI_world_graph_unref(moe_world *w) {
  if (--w->graphs == 0 && w->closed) world_destroy(w);
}

/* The GPU exists on this machine (after moeI_nccl_available: the build message comes first). */
static int check_gpu(moe_ctx *ctx, int device) {
  int n = 0;
  if (moeI_cuda_device_count(&n) != MOE_OK) n = 0;
  if (n == 0) return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "world: no usable GPU on this machine (cuda:%d asked)", device);
  if (device >= n)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: cuda:%d does not exist (%d GPU%s visible)", device, n, n == 1 ? "" : "s");
  return MOE_OK;
}

static int open_world(moe_ctx *ctx, moe_world *w, const unsigned char *id, moe_world **out) {
  int rc = moeI_nccl_world_open(ctx, w, id);
  if (rc) {
    moe_world_close(w);
    return rc;
  }
  *out = w;
  return moeI_ok(ctx);
}

int moe_world_open_local(moe_ctx *ctx, int ndev, const int *devices, moe_world **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "world: out is NULL");
  *out = NULL;
  if (ndev < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "world: a world needs at least one device, got %d", ndev);
  if (!devices) return moeI_seterr(ctx, MOE_ERR_ARG, "world: devices is NULL");
  for (int i = 0; i < ndev; i++) {
    if (devices[i] < 0)
      return moeI_seterr(ctx, MOE_ERR_ARG, "world: devices[%d] is %d, expected a GPU index >= 0", i + 1, devices[i]);
    for (int j = 0; j < i; j++)
      if (devices[j] == devices[i])
        return moeI_seterr(ctx, MOE_ERR_ARG, "world: cuda:%d is listed twice (devices[%d] and devices[%d]); one rank per GPU",
                          devices[i], j + 1, i + 1);
  }
  int rc = moeI_nccl_available(ctx);
  if (rc) return rc;
  for (int i = 0; i < ndev; i++)
    if ((rc = check_gpu(ctx, devices[i]))) return rc;
  moe_world *w = world_new(ndev, ndev);
  if (!w) return moeI_seterr(ctx, MOE_ERR_NOMEM, "world: out of host memory");
  for (int i = 0; i < ndev; i++) {
    w->ranks[i] = i;
    w->devices[i] = devices[i];
  }
  return open_world(ctx, w, NULL, out);
}

int moe_world_open_rank(moe_ctx *ctx, int rank, int world_size, int device, const char *unique_id_hex,
                        moe_world **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "world: out is NULL");
  *out = NULL;
  if (world_size < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "world: the world size must be >= 1, got %d", world_size);
  if (rank < 0 || rank >= world_size)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: rank must be in [0, %d) for a world of %d, got %d", world_size, world_size,
                      rank);
  if (device < 0) return moeI_seterr(ctx, MOE_ERR_ARG, "world: device must be a GPU index >= 0, got %d", device);
  unsigned char id[MOE_WORLD_ID_BYTES];
  int rc = parse_id(ctx, unique_id_hex, id);
  if (rc) return rc;
  if ((rc = moeI_nccl_available(ctx))) return rc;
  if ((rc = check_gpu(ctx, device))) return rc;
  moe_world *w = world_new(world_size, 1);
  if (!w) return moeI_seterr(ctx, MOE_ERR_NOMEM, "world: out of host memory");
  w->ranks[0] = rank;
  w->devices[0] = device;
  return open_world(ctx, w, id, out);
}

int moe_world_open_comm(moe_ctx *ctx, void *nccl_comm, int device, moe_world **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "world: out is NULL");
  *out = NULL;
  if (!nccl_comm) return moeI_seterr(ctx, MOE_ERR_ARG, "world: the communicator is NULL");
  if (device < 0) return moeI_seterr(ctx, MOE_ERR_ARG, "world: device must be a GPU index >= 0, got %d", device);
  int rc = moeI_nccl_available(ctx);
  if (rc || (rc = check_gpu(ctx, device))) return rc;
  int rank = -1, size = 0, comm_device = -1;
  if ((rc = moeI_nccl_comm_info(ctx, nccl_comm, &rank, &size, &comm_device))) return rc;
  /* the streams are made on device: a communicator of another GPU would run its work elsewhere */
  if (comm_device != device)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: the communicator's GPU is cuda:%d, but device is %d", comm_device,
                       device);
  moe_world *w = world_new(size, 1);
  if (!w) return moeI_seterr(ctx, MOE_ERR_NOMEM, "world: out of host memory");
  w->ranks[0] = rank;
  w->devices[0] = device;
  w->comms[0] = nccl_comm;
  w->borrowed = 1;
  return open_world(ctx, w, NULL, out);
}

int moe_world_size(const moe_world *w) { return w ? w->size : 0; }
int moe_world_local_count(const moe_world *w) { return w ? w->nlocal : 0; }
int moe_world_local_rank(const moe_world *w, int i) { return w && i >= 0 && i < w->nlocal ? w->ranks[i] : -1; }
int moe_world_local_device(const moe_world *w, int i) { return w && i >= 0 && i < w->nlocal ? w->devices[i] : -1; }
void *moe_world_stream(const moe_world *w, int i) { return w && i >= 0 && i < w->nlocal ? w->streams[i] : NULL; }

int moe_world_bind(moe_ctx *ctx, moe_world *w, int i) {
  if (!ctx || !w) return moeI_seterr(ctx, MOE_ERR_ARG, "world: bind: NULL argument");
  if (i < 0 || i >= w->nlocal)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: bind: local rank %d is not in [0, %d)", i, w->nlocal);
  return moeI_nccl_bind(ctx, w, i);
}

int moe_world_unbind(moe_ctx *ctx, moe_world *w) {
  if (!ctx || !w) return moeI_seterr(ctx, MOE_ERR_ARG, "world: unbind: NULL argument");
  return moeI_nccl_unbind(ctx, w);
}

/* ---- configurations ---- */

int moe_world_compare_configs(moe_ctx *ctx, int rank, int world, const moe_world_config *all) {
  if (world < 1 || !all) return moeI_seterr(ctx, MOE_ERR_ARG, "world: compare_configs: no configurations");
  if (rank < 0 || rank >= world)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: compare_configs: rank %d is not in [0, %d)", rank, world);
  int first_rank = -1, first_field = -1, ndiff = 0;
  int v0[MOE_WORLD_CONFIG_FIELDS], v[MOE_WORLD_CONFIG_FIELDS];
  memcpy(v0, &all[0], sizeof v0);
  for (int r = 1; r < world; r++) {
    memcpy(v, &all[r], sizeof v);
    int differs = 0;
    for (int f = 0; f < MOE_WORLD_CONFIG_FIELDS; f++) {
      if (v[f] == v0[f]) continue;
      if (first_rank < 0) first_rank = r, first_field = f;
      differs = 1;
    }
    ndiff += differs;
  }
  if (first_rank < 0) return moeI_ok(ctx);
  memcpy(v, &all[first_rank], sizeof v);
  return moeI_seterr(ctx, MOE_ERR_ARG,
                    "world: rank %d: the ranks' configurations differ: %s is %d on rank 0 but %d on rank %d "
                    "(%d of %d ranks differ from rank 0); every rank must build the same layer",
                    rank, config_fields[first_field], v0[first_field], v[first_field], first_rank, ndiff, world);
}

int moe_world_check_config(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs) {
  if (!w || !cfgs) return moeI_seterr(ctx, MOE_ERR_ARG, "world: check_config: NULL argument");
  if (ctx && ctx->capturing)
    return moeI_seterr(ctx, MOE_ERR_ARG, "world: check_config waits on the host: not during a graph capture");
  moe_world_config *all = calloc((size_t)w->nlocal * (size_t)w->size, sizeof *all);
  if (!all) return moeI_seterr(ctx, MOE_ERR_NOMEM, "world: out of host memory");
  int rc = moeI_nccl_gather_configs(ctx, w, cfgs, all);
  /* every local rank judges its own gathered table: all ranks reach the same verdict */
  for (int i = 0; rc == MOE_OK && i < w->nlocal; i++)
    rc = moe_world_compare_configs(ctx, w->ranks[i], w->size, all + (size_t)i * w->size);
  free(all);
  return rc;
}

/* ---- exchange arguments ---- */

static int check_on(moe_ctx *ctx, const char *stage, const char *what, const moe_tensor *t, int device) {
  if (t->device.kind == MOE_CUDA && t->device.index == device) return MOE_OK;
  char got[160];
  return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s must be on cuda:%d (its rank's GPU), got %s", stage, what, device,
                    moeI_tensor_describe(t, got, sizeof got));
}

/* Whether t is this rank's own slot of all ([W, ...]): NCCL's in-place all-gather. */
static int own_slot(const moe_world *w, int i, const moe_tensor *t, const moe_tensor *all) {
  return (const char *)t->data == (const char *)all->data + moe_tensor_nbytes(t) * (size_t)w->ranks[i];
}

static int check_gather(moe_ctx *ctx, const char *stage, const moe_world *w, int i, const moe_tensor *out,
                        const moe_tensor *in) {
  char what[48], got[160], want[160];
  if (!in || !out) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s[%d] is NULL", stage, in ? "out" : "in", i);
  if (in->ndim + 1 > MOE_MAX_DIMS)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: in[%d] has %d dimensions, at most %d", stage, i, in->ndim, MOE_MAX_DIMS - 1);
  int64_t shape[MOE_MAX_DIMS];
  shape[0] = w->size;
  for (int d = 0; d < in->ndim; d++) shape[d + 1] = in->shape[d];
  snprintf(what, sizeof what, "out[%d]", i);
  if (moeI_check_tensor(ctx, stage, what, out, in->dtype, in->ndim + 1, shape)) {
    moe_tensor like = *in;
    like.ndim = in->ndim + 1;
    for (int d = 0; d < like.ndim; d++) like.shape[d] = shape[d];
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out[%d] must be %s (W = %d copies of in[%d]), got %s", stage, i,
                      moeI_tensor_describe(&like, want, sizeof want), w->size, i, moeI_tensor_describe(out, got, sizeof got));
  }
  snprintf(what, sizeof what, "in[%d]", i);
  int rc = check_on(ctx, stage, what, in, w->devices[i]);
  if (!rc) {
    snprintf(what, sizeof what, "out[%d]", i);
    rc = check_on(ctx, stage, what, out, w->devices[i]);
  }
  if (rc) return rc;
  /* NCCL's in-place form (in is this rank's own slot of out) or disjoint buffers; a partial
   * overlap would be overwritten while it is still sent */
  if (own_slot(w, i, in, out)) return MOE_OK;
  const moe_tensor *ts[] = {out, in};
  const char *const names[] = {"out", "in"};
  return moeI_check_no_overlap(ctx, stage, ts, names, 1, 2);
}

int moe_world_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in) {
  static const char *stage = "world: allgather";
  if (!w || !out || !in) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  int rc;
  for (int i = 0; i < w->nlocal; i++)
    if ((rc = check_gather(ctx, stage, w, i, out[i], in[i]))) return rc;
  return MOE_IN_RANGE("allgather", moeI_nccl_allgather(ctx, w, out, in));
}

int moe_world_allgather_ids(moe_ctx *ctx, moe_world *w, moe_tensor *const *all_ids, const moe_tensor *const *ids) {
  static const char *stage = "world: allgather_ids";
  if (!w || !all_ids || !ids) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  char what[32];
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    snprintf(what, sizeof what, "ids[%d]", i);
    if ((rc = moeI_check_tensor(ctx, stage, what, ids[i], MOE_I32, 2, NULL))) return rc;
    if ((rc = check_gather(ctx, stage, w, i, all_ids[i], ids[i]))) return rc;
  }
  return MOE_IN_RANGE("allgather", moeI_nccl_allgather(ctx, w, all_ids, ids));
}

/* The dispatch arguments of local rank i that both exchanges take: x, out, peer_rank, peer_route,
 * k, on the rank's GPU; the direct exchange also route_row. */
static int check_dispatch(moe_ctx *ctx, const char *stage, const moe_world *w, int i, const moe_world_dispatch_args *a,
                          int direct) {
  int rc;
  if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_BF16, 2, NULL))) return rc;
  const int64_t T = a->x->shape[0], H = a->x->shape[1];
  const int64_t out_shape[] = {-1, H};
  if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_BF16, 2, out_shape))) return rc;
  const int64_t row_shape[] = {a->out->shape[0]};
  if ((rc = moeI_check_tensor(ctx, stage, "peer_rank", a->peer_rank, MOE_I32, 1, row_shape))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "peer_route", a->peer_route, MOE_I32, 1, row_shape))) return rc;
  if (a->k < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: k must be >= 1, got %d", stage, a->k);
  if (direct) {
    if (T > INT32_MAX / a->k) /* route_row's rows are T * k routes, indexed by an i32 */
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: T * k = %lld * %d routes per rank exceed the i32 range", stage,
                        (long long)T, a->k);
    const int64_t rr[] = {w->size, T * a->k};
    if ((rc = moeI_check_tensor(ctx, stage, "route_row", a->route_row, MOE_I32, 2, rr))) return rc;
  }
  const moe_tensor *ts[] = {a->out, a->x, a->peer_rank, a->peer_route, direct ? a->route_row : NULL};
  static const char *names[] = {"out", "x", "peer_rank", "peer_route", "route_row"};
  for (int j = 0; j < 5; j++)
    if (ts[j] && (rc = check_on(ctx, stage, names[j], ts[j], w->devices[i]))) return rc;
  return moeI_check_no_overlap(ctx, stage, ts, names, 1, 5);
}

int moe_world_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *args) {
  static const char *stage = "world: dispatch";
  if (!w || !args) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    const moe_world_dispatch_args *a = &args[i];
    if ((rc = check_dispatch(ctx, stage, w, i, a, 0))) return rc;
    const int64_t all_shape[] = {w->size, a->x->shape[0], a->x->shape[1]};
    if ((rc = moeI_check_tensor(ctx, stage, "x_all", a->x_all, MOE_BF16, 3, all_shape))) return rc;
    if ((rc = check_on(ctx, stage, "x_all", a->x_all, w->devices[i]))) return rc;
    /* x_all is an output too: x may be this rank's own slot of it (NCCL's in-place all-gather, as
     * in moe_world_allgather) and nothing else may share its memory */
    const moe_tensor *ts[] = {a->x_all, a->out, a->peer_rank, a->peer_route,
                              own_slot(w, i, a->x, a->x_all) ? NULL : a->x};
    static const char *names[] = {"x_all", "out", "peer_rank", "peer_route", "x"};
    if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 1, 5))) return rc;
  }
  return MOE_IN_RANGE("dispatch", moeI_nccl_dispatch(ctx, w, args));
}

int moe_world_dispatch_fp8(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_fp8_args *args) {
  static const char *stage = "world: dispatch_fp8";
  if (!w || !args) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    const moe_world_dispatch_fp8_args *a = &args[i];
    if ((rc = moeI_check_tensor(ctx, stage, "x", a->x, MOE_E4M3, 2, NULL))) return rc;
    const int64_t T = a->x->shape[0], H = a->x->shape[1], nb = H / MOE_FP8_BLOCK;
    if (H % MOE_FP8_BLOCK)
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the hidden size H (x's last dimension) must be a multiple of %d, got %lld",
                        stage, MOE_FP8_BLOCK, (long long)H);
    const int64_t xs_shape[] = {T, nb}, out_shape[] = {-1, H};
    if ((rc = moeI_check_tensor(ctx, stage, "x_scale", a->x_scale, MOE_F32, 2, xs_shape))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "out", a->out, MOE_E4M3, 2, out_shape))) return rc;
    const int64_t C = a->out->shape[0];
    const int64_t os_shape[] = {nb, C}, row_shape[] = {C};
    const int64_t all_shape[] = {w->size, T, H}, all_scale_shape[] = {w->size, T, nb};
    if ((rc = moeI_check_tensor(ctx, stage, "out_scale", a->out_scale, MOE_F32, 2, os_shape))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "peer_rank", a->peer_rank, MOE_I32, 1, row_shape))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "peer_route", a->peer_route, MOE_I32, 1, row_shape))) return rc;
    if (a->k < 1) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: k must be >= 1, got %d", stage, a->k);
    if ((rc = moeI_check_tensor(ctx, stage, "x_all", a->x_all, MOE_E4M3, 3, all_shape))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "x_scale_all", a->x_scale_all, MOE_F32, 3, all_scale_shape))) return rc;
    /* x and x_scale may be their rank's own slots of the gathered outputs (in place); nothing
     * else may share an output's memory */
    const moe_tensor *ts[] = {a->out, a->out_scale, a->x_all, a->x_scale_all, a->peer_rank, a->peer_route,
                              own_slot(w, i, a->x, a->x_all) ? NULL : a->x,
                              own_slot(w, i, a->x_scale, a->x_scale_all) ? NULL : a->x_scale};
    static const char *names[] = {"out", "out_scale", "x_all", "x_scale_all", "peer_rank", "peer_route", "x",
                                  "x_scale"};
    const moe_tensor *on[] = {a->out, a->out_scale, a->x_all, a->x_scale_all, a->peer_rank, a->peer_route, a->x,
                              a->x_scale};
    for (int j = 0; j < 8; j++)
      if ((rc = check_on(ctx, stage, names[j], on[j], w->devices[i]))) return rc;
    if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 4, 8))) return rc;
  }
  return MOE_IN_RANGE("dispatch_fp8", moeI_nccl_dispatch_fp8(ctx, w, args));
}

/* The combine arguments of local rank i that both exchanges take, on the rank's GPU. */
static int check_combine(moe_ctx *ctx, const char *stage, const moe_world *w, int i, const moe_world_combine_args *a) {
  int rc;
  char got[160];
  if (w->size > MOE_CUDA_COMBINE_MAX_WORLD) /* here, before any rank sends: combine's kernel would refuse it */
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: at most %d ranks on cuda, got %d", stage, MOE_CUDA_COMBINE_MAX_WORLD,
                      w->size);
  if ((rc = moeI_check_tensor(ctx, stage, "weights", a->weights, MOE_F32, 2, NULL))) return rc;
  const int64_t T = a->weights->shape[0], K = a->weights->shape[1];
  const int64_t tk[] = {T, K};
  if ((rc = moeI_check_tensor(ctx, stage, "ids", a->ids, MOE_I32, 2, tk))) return rc;
  if ((rc = moeI_check_tensor(ctx, stage, "ys", a->ys, MOE_BF16, 2, NULL))) return rc;
  const int64_t H = a->ys->shape[1];
  const int64_t rr[] = {w->size, T * K}, th[] = {T, H}, t1[] = {T};
  if ((rc = moeI_check_tensor(ctx, stage, "route_row", a->route_row, MOE_I32, 2, rr))) return rc;
  if (!a->out || (a->out->dtype != MOE_BF16 && a->out->dtype != MOE_F32) || a->out->ndim != 2 ||
      a->out->shape[0] != T || a->out->shape[1] != H)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out must be bf16 or f32 [%lld, %lld], got %s", stage, (long long)T,
                      (long long)H, moeI_tensor_describe(a->out, got, sizeof got));
  if (a->experts < 1 || a->experts % w->size)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: experts must be a positive multiple of the world size %d, got %d", stage,
                      w->size, a->experts);
  if (a->shared && (rc = moeI_check_tensor(ctx, stage, "shared", a->shared, MOE_BF16, 2, th))) return rc;
  if (a->shared_gate) {
    if (!a->shared) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: shared_gate is given without shared", stage);
    if ((rc = moeI_check_tensor(ctx, stage, "shared_gate", a->shared_gate, MOE_F32, 1, t1))) return rc;
  }
  const moe_tensor *ts[] = {a->out, a->weights, a->ids, a->ys, a->route_row, a->shared, a->shared_gate};
  static const char *names[] = {"out", "weights", "ids", "ys", "route_row", "shared", "shared_gate"};
  for (int j = 0; j < 7; j++)
    if (ts[j] && (rc = check_on(ctx, stage, names[j], ts[j], w->devices[i]))) return rc;
  return moeI_check_no_overlap(ctx, stage, ts, names, 1, 7);
}

int moe_world_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *args) {
  static const char *stage = "world: combine";
  if (!w || !args) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    const moe_world_combine_args *a = &args[i];
    if ((rc = check_combine(ctx, stage, w, i, a))) return rc;
    const int64_t TK = a->route_row->shape[1], H = a->ys->shape[1];
    const int64_t rr[] = {w->size, TK}, rows[] = {w->size, TK, H};
    if ((rc = moeI_check_tensor(ctx, stage, "send_rows", a->send_rows, MOE_BF16, 3, rows))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "recv_rows", a->recv_rows, MOE_BF16, 3, rows))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "send_index", a->send_index, MOE_I32, 2, rr))) return rc;
    if ((rc = moeI_check_tensor(ctx, stage, "recv_index", a->recv_index, MOE_I32, 2, rr))) return rc;
    /* the four buffers are written (packed, received) while the stage's inputs are still read */
    const moe_tensor *ts[] = {a->send_rows, a->recv_rows, a->send_index, a->recv_index, a->out, a->weights, a->ids,
                              a->ys, a->route_row, a->shared, a->shared_gate};
    static const char *names[] = {"send_rows", "recv_rows", "send_index", "recv_index", "out", "weights", "ids",
                                  "ys", "route_row", "shared", "shared_gate"};
    for (int j = 0; j < 4; j++)
      if ((rc = check_on(ctx, stage, names[j], ts[j], w->devices[i]))) return rc;
    if ((rc = moeI_check_no_overlap(ctx, stage, ts, names, 4, 11))) return rc;
  }
  return MOE_IN_RANGE("combine", moeI_nccl_combine(ctx, w, args));
}

/* ---- the direct exchange ---- */

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

int moe_world_exchange_open(moe_ctx *ctx, moe_world *w, int64_t tokens, int k, int64_t hidden, int64_t capacity,
                            moe_world_exchange **out) {
  static const char *stage = "world: exchange";
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out is NULL", stage);
  *out = NULL;
  if (!w) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the world is NULL", stage);
  if (ctx && ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: open is not allowed during a graph capture", stage);
  if (tokens < 1 || k < 1 || hidden < 1 || capacity < 0)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                      "%s: tokens, k and hidden must be >= 1 and capacity >= 0, got tokens %lld, k %d, hidden %lld, "
                      "capacity %lld",
                      stage, (long long)tokens, k, (long long)hidden, (long long)capacity);
  const size_t page = 4096, W = (size_t)w->size;
  if ((uint64_t)tokens > ((uint64_t)1 << 40) / (uint64_t)hidden || (uint64_t)capacity > ((uint64_t)1 << 40) / (uint64_t)hidden ||
      (uint64_t)tokens * (uint64_t)k > INT32_MAX)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %lld tokens x %lld hidden (capacity %lld, k %d) is too large", stage,
                      (long long)tokens, (long long)hidden, (long long)capacity, k);
  moe_world_exchange *ex = calloc(1, sizeof *ex);
  if (!ex) return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory", stage);
  ex->w = w;
  ex->tokens = tokens, ex->k = k, ex->hidden = hidden, ex->capacity = capacity;
  ex->x_off = 0;
  ex->ys_off = round_up((size_t)tokens * (size_t)hidden * 2, page);
  ex->rr_off = ex->ys_off + round_up((size_t)capacity * (size_t)hidden * 2, page);
  ex->flags_off = ex->rr_off + round_up(W * (size_t)tokens * (size_t)k * 4, page);
  ex->bytes = ex->flags_off + round_up((W + 1) * 4, page);
  const size_t n = (size_t)w->nlocal;
  ex->base = calloc(n, sizeof *ex->base);
  ex->win = calloc(n, sizeof *ex->win);
  ex->peers = calloc(n, sizeof *ex->peers);
  ex->hpeers = calloc(n * W, sizeof *ex->hpeers);
  ex->x = calloc(n, sizeof *ex->x);
  ex->ys = calloc(n, sizeof *ex->ys);
  if (!ex->base || !ex->win || !ex->peers || !ex->hpeers || !ex->x || !ex->ys) {
    free(ex->base), free(ex->win), free(ex->peers), free(ex->hpeers), free(ex->x), free(ex->ys), free(ex);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory", stage);
  }
  moeI_world_graph_ref(w); /* the communicators must outlive the windows */
  int rc = moeI_nccl_exchange_open(ctx, ex);
  if (rc) {
    moe_world_exchange_close(ex);
    return rc;
  }
  for (size_t i = 0; i < n; i++) {
    moe_tensor *v[2] = {&ex->x[i], &ex->ys[i]};
    const int64_t rows[2] = {tokens, capacity};
    const size_t off[2] = {ex->x_off, ex->ys_off};
    for (int j = 0; j < 2; j++) {
      v[j]->dtype = MOE_BF16;
      v[j]->ndim = 2;
      v[j]->shape[0] = rows[j], v[j]->shape[1] = hidden;
      v[j]->numel = rows[j] * hidden;
      v[j]->device.kind = MOE_CUDA, v[j]->device.index = w->devices[i];
      v[j]->data = (char *)ex->base[i] + off[j];
      v[j]->storage = NULL;
    }
  }
  *out = ex;
  return moeI_ok(ctx);
}

void moe_world_exchange_close(moe_world_exchange *ex) {
  if (!ex) return;
  moeI_nccl_exchange_release(ex);
  free(ex->base), free(ex->win), free(ex->peers), free(ex->hpeers), free(ex->x), free(ex->ys);
  moe_world *w = ex->w;
  free(ex);
  moeI_world_graph_unref(w);
}

int moe_world_exchange_views(moe_ctx *ctx, moe_world_exchange *ex, int i, moe_tensor **x, moe_tensor **ys) {
  static const char *stage = "world: exchange views";
  if (!ex) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: the exchange is NULL", stage);
  if (i < 0 || i >= ex->w->nlocal)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: local rank %d does not exist (this process holds %d)", stage, i,
                      ex->w->nlocal);
  moe_tensor *out[2] = {NULL, NULL};
  const moe_tensor *from[2] = {&ex->x[i], &ex->ys[i]};
  moe_tensor **to[2] = {x, ys};
  for (int j = 0; j < 2; j++) {
    if (!to[j]) continue;
    out[j] = malloc(sizeof *out[j]);
    if (!out[j]) {
      free(out[0]);
      return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory", stage);
    }
    *out[j] = *from[j];
  }
  if (x) *x = out[0];
  if (ys) *ys = out[1];
  return moeI_ok(ctx);
}

/* The exchange's sizes must be the call's: the windows are laid out for them on every rank. */
static int check_sizes(moe_ctx *ctx, const char *stage, const moe_world_exchange *ex, int i, int64_t T, int64_t K,
                       int64_t H, int64_t C) {
  if (T == ex->tokens && K == ex->k && H == ex->hidden && C == ex->capacity) return MOE_OK;
  return moeI_seterr(ctx, MOE_ERR_ARG,
                    "%s: local rank %d: tokens %lld, k %lld, hidden %lld, capacity %lld differ from the exchange's "
                    "(%lld, %lld, %lld, %lld)",
                    stage, i, (long long)T, (long long)K, (long long)H, (long long)C, (long long)ex->tokens,
                    (long long)ex->k, (long long)ex->hidden, (long long)ex->capacity);
}

/* Whether any byte of t lies in local rank i's window, which the other ranks write into. */
static int in_window(const moe_world_exchange *ex, int i, const moe_tensor *t) {
  const uintptr_t a = (uintptr_t)t->data, b = (uintptr_t)ex->base[i];
  const size_t n = moe_tensor_nbytes(t);
  return n && a < b + ex->bytes && b < a + n;
}

int moe_world_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *args) {
  static const char *stage = "world: exchange dispatch";
  if (!ex || !args) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  const moe_world *w = ex->w;
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    const moe_world_dispatch_args *a = &args[i];
    if ((rc = check_dispatch(ctx, stage, w, i, a, 1))) return rc;
    if ((rc = check_sizes(ctx, stage, ex, i, a->x->shape[0], a->k, a->x->shape[1], a->out->shape[0]))) return rc;
    if (in_window(ex, i, a->out))
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out may not lie in the exchange's window (its x, ys, route_row)",
                        stage);
  }
  return MOE_IN_RANGE("dispatch", moeI_nccl_exchange_dispatch(ctx, ex, args));
}

int moe_world_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *args) {
  static const char *stage = "world: exchange combine";
  if (!ex || !args) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: NULL argument", stage);
  const moe_world *w = ex->w;
  int rc;
  for (int i = 0; i < w->nlocal; i++) {
    const moe_world_combine_args *a = &args[i];
    if ((rc = check_combine(ctx, stage, w, i, a))) return rc;
    if ((rc = check_sizes(ctx, stage, ex, i, a->weights->shape[0], a->weights->shape[1], a->ys->shape[1],
                          a->ys->shape[0])))
      return rc;
    if (in_window(ex, i, a->out))
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out may not lie in the exchange's window (its x, ys, route_row)", stage);
  }
  return MOE_IN_RANGE("combine", moeI_nccl_exchange_combine(ctx, ex, args));
}

/* ---- a build without NCCL, or without CUDA at all: MOE_WORLD_STUBS names what is missing ---- */
#ifdef MOE_WORLD_STUBS
#define NO_NCCL(what) \
  moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "world: %s: this moelab was built without %s", what, MOE_WORLD_STUBS)
int moeI_nccl_available(moe_ctx *ctx) { return NO_NCCL("expert parallelism across GPUs"); }
int moeI_nccl_version(char *buf, size_t n) {
  (void)buf, (void)n;
  return MOE_ERR_UNSUPPORTED;
}
int moeI_nccl_unique_id(moe_ctx *ctx, unsigned char id[MOE_WORLD_ID_BYTES]) {
  (void)id;
  return NO_NCCL("unique_id");
}
int moeI_nccl_comm_info(moe_ctx *ctx, void *comm, int *rank, int *size, int *device) {
  (void)comm, (void)rank, (void)size, (void)device;
  return NO_NCCL("open");
}
int moeI_nccl_world_open(moe_ctx *ctx, moe_world *w, const unsigned char *id) {
  (void)w, (void)id;
  return NO_NCCL("open");
}
void moeI_nccl_world_release(moe_world *w) { (void)w; }
int moeI_nccl_bind(moe_ctx *ctx, moe_world *w, int i) {
  (void)w, (void)i;
  return NO_NCCL("bind");
}
int moeI_nccl_unbind(moe_ctx *ctx, moe_world *w) {
  (void)w;
  return moeI_ok(ctx);
}
int moeI_nccl_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in) {
  (void)w, (void)out, (void)in;
  return NO_NCCL("allgather");
}
int moeI_nccl_gather_configs(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs, moe_world_config *all) {
  (void)w, (void)cfgs, (void)all;
  return NO_NCCL("check_config");
}
int moeI_nccl_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *a) {
  (void)w, (void)a;
  return NO_NCCL("dispatch");
}
int moeI_nccl_dispatch_fp8(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_fp8_args *a) {
  (void)w, (void)a;
  return NO_NCCL("dispatch_fp8");
}
int moeI_nccl_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *a) {
  (void)w, (void)a;
  return NO_NCCL("combine");
}
int moeI_nccl_exchange_open(moe_ctx *ctx, moe_world_exchange *ex) {
  (void)ex;
  return NO_NCCL("exchange");
}
void moeI_nccl_exchange_release(moe_world_exchange *ex) { (void)ex; }
int moeI_nccl_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *a) {
  (void)ex, (void)a;
  return NO_NCCL("exchange dispatch");
}
int moeI_nccl_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *a) {
  (void)ex, (void)a;
  return NO_NCCL("exchange combine");
}
#endif
