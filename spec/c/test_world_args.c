/* SPDX-License-Identifier: MIT */
/* test_world_args.c -- the argument checks of the world's FP8 dispatch (lib/world.c), which run
 * before anything reaches NCCL, so they are checked here on any machine: a world of two ranks
 * made by hand (this process holds rank 1 on cuda:0) and tensor headers that point into a host
 * array no check reads.  One row per bad argument, with the words its message must hold; the
 * valid arguments pass every check and reach the backend, which refuses them for a reason that is
 * not an argument's (a build without NCCL says so; with NCCL, the world is marked aborted so that
 * no collective is issued on its missing communicators).  Exits non-zero on a failure. */
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "world.h"

enum { W = 2, T = 4, H = 256, NB = H / 128, C = 6, RANK = 1 };

static moe_ctx *ctx;
static _Alignas(16) unsigned char mem[1 << 15]; /* addresses only: never read or written */

/* A header of dtype [d0, d1, d2] (ndim of them) at mem + at, on cuda:dev (dev < 0: the CPU). */
static moe_tensor tensor(moe_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2, size_t at, int dev) {
  moe_tensor t;
  memset(&t, 0, sizeof t);
  const int64_t shape[3] = {d0, d1, d2};
  t.dtype = dt;
  t.ndim = ndim;
  t.numel = 1;
  for (int d = 0; d < ndim; d++) t.shape[d] = shape[d], t.numel *= shape[d];
  t.device.kind = dev < 0 ? MOE_CPU : MOE_CUDA;
  t.device.index = dev < 0 ? 0 : dev;
  t.data = mem + at;
  return t;
}

/* Where the valid arguments live in mem: disjoint, x and x_scale outside the gathered tensors. */
enum { AT_X_ALL = 0, AT_X = 4096, AT_XS_ALL = 8192, AT_XS = 8448, AT_OUT = 12288, AT_OS = 16384, AT_PR = 16640,
       AT_PQ = 16896 };

typedef struct {
  moe_tensor out, out_scale, x_all, x_scale_all, x, x_scale, peer_rank, peer_route;
} Tensors;

static Tensors valid(void) {
  Tensors v = {
    .out = tensor(MOE_E4M3, 2, C, H, 0, AT_OUT, 0),
    .out_scale = tensor(MOE_F32, 2, NB, C, 0, AT_OS, 0),
    .x_all = tensor(MOE_E4M3, 3, W, T, H, AT_X_ALL, 0),
    .x_scale_all = tensor(MOE_F32, 3, W, T, NB, AT_XS_ALL, 0),
    .x = tensor(MOE_E4M3, 2, T, H, 0, AT_X, 0),
    .x_scale = tensor(MOE_F32, 2, T, NB, 0, AT_XS, 0),
    .peer_rank = tensor(MOE_I32, 1, C, 0, 0, AT_PR, 0),
    .peer_route = tensor(MOE_I32, 1, C, 0, 0, AT_PQ, 0),
  };
  return v;
}

static moe_world_dispatch_fp8_args args_of(Tensors *v, int k) {
  moe_world_dispatch_fp8_args a = {&v->out, &v->out_scale, &v->x_all, &v->x_scale_all, &v->x, &v->x_scale,
                                   &v->peer_rank, &v->peer_route, k, 1};
  return a;
}

/* The backend's refusal of arguments that passed every check, not an argument's: a build without
 * NCCL says so; with NCCL, the hand-made world below counts as aborted (the code of that refusal
 * is MOE_ERR_ARG, as for any aborted world, but no argument check words it so). */
static int past_the_checks(int rc) {
  const char *msg = moe_errmsg(ctx);
  return rc != MOE_OK && (strstr(msg, "built without") || strstr(msg, "aborted after"));
}

/* moe_world_dispatch_fp8 with the valid arguments but one, each refused with its words. */
static void fp8_rows(moe_world *w) {
  enum { F_OUT, F_OS, F_XALL, F_XSALL, F_X, F_XS, F_PR, F_PQ, F_NONE };
  const size_t slot = (size_t)T * H, scale_slot = (size_t)T * NB * 4;
  struct row {
    int field;
    moe_tensor t;
    int k;
    const char *frag;
  } rows[] = {
    {F_X, tensor(MOE_BF16, 2, T, H, 0, AT_X, 0), 2, "x must be e4m3 [_, _], got bf16 [4, 256] on cuda:0"},
    {F_X, tensor(MOE_E4M3, 3, 1, T, H, AT_X, 0), 2, "x must be e4m3 [_, _], got e4m3 [1, 4, 256]"},
    {F_X, tensor(MOE_E4M3, 2, T, 200, 0, AT_X, 0), 2, "H (x's last dimension) must be a multiple of 128, got 200"},
    {F_X, tensor(MOE_E4M3, 2, T, 64, 0, AT_X, 0), 2, "must be a multiple of 128, got 64"},
    {F_XS, tensor(MOE_F32, 2, T, 3, 0, AT_XS, 0), 2, "x_scale must be f32 [4, 2], got f32 [4, 3]"},
    {F_XS, tensor(MOE_BF16, 2, T, NB, 0, AT_XS, 0), 2, "x_scale must be f32 [4, 2], got bf16"},
    {F_OUT, tensor(MOE_BF16, 2, C, H, 0, AT_OUT, 0), 2, "out must be e4m3 [_, 256], got bf16 [6, 256]"},
    {F_OUT, tensor(MOE_E4M3, 2, C, 128, 0, AT_OUT, 0), 2, "out must be e4m3 [_, 256], got e4m3 [6, 128]"},
    {F_OS, tensor(MOE_F32, 2, C, NB, 0, AT_OS, 0), 2, "out_scale must be f32 [2, 6], got f32 [6, 2]"},
    {F_PR, tensor(MOE_I32, 1, C + 1, 0, 0, AT_PR, 0), 2, "peer_rank must be i32 [6], got i32 [7]"},
    {F_PQ, tensor(MOE_F32, 1, C, 0, 0, AT_PQ, 0), 2, "peer_route must be i32 [6], got f32 [6]"},
    {F_NONE, tensor(MOE_I32, 1, 1, 0, 0, 0, 0), 0, "k must be >= 1, got 0"},
    {F_NONE, tensor(MOE_I32, 1, 1, 0, 0, 0, 0), -3, "k must be >= 1, got -3"},
    {F_XALL, tensor(MOE_E4M3, 3, 1, T, H, AT_X_ALL, 0), 2, "x_all must be e4m3 [2, 4, 256], got e4m3 [1, 4, 256]"},
    {F_XALL, tensor(MOE_BF16, 3, W, T, H, AT_X_ALL, 0), 2, "x_all must be e4m3 [2, 4, 256], got bf16"},
    {F_XSALL, tensor(MOE_F32, 3, W, T, 1, AT_XS_ALL, 0), 2, "x_scale_all must be f32 [2, 4, 2], got f32 [2, 4, 1]"},
    {F_OUT, tensor(MOE_E4M3, 2, C, H, 0, AT_OUT, -1), 2, "out must be on cuda:0 (its rank's GPU), got e4m3 [6, 256] on cpu"},
    {F_XS, tensor(MOE_F32, 2, T, NB, 0, AT_XS, 1), 2, "x_scale must be on cuda:0 (its rank's GPU), got f32 [4, 2] on cuda:1"},
    {F_XSALL, tensor(MOE_F32, 3, W, T, NB, AT_XS_ALL, 1), 2, "x_scale_all must be on cuda:0"},
    {F_PQ, tensor(MOE_I32, 1, C, 0, 0, AT_PQ, -1), 2, "peer_route must be on cuda:0"},
    {F_OUT, tensor(MOE_E4M3, 2, C, H, 0, AT_X + 512, 0), 2, "out and x share memory"},
    {F_OS, tensor(MOE_F32, 2, NB, C, 0, AT_X_ALL + 16, 0), 2, "out_scale and x_all share memory"},
    {F_XSALL, tensor(MOE_F32, 3, W, T, NB, AT_PR - 8, 0), 2, "x_scale_all and peer_rank share memory"},
    /* the other rank's slot of the gathered tensors is not this rank's to send from */
    {F_X, tensor(MOE_E4M3, 2, T, H, 0, AT_X_ALL, 0), 2, "x_all and x share memory"},
    {F_XS, tensor(MOE_F32, 2, T, NB, 0, AT_XS_ALL, 0), 2, "x_scale_all and x_scale share memory"},
    {F_XS, tensor(MOE_F32, 2, T, NB, 0, AT_XS_ALL + 4, 0), 2, "x_scale_all and x_scale share memory"},
  };
  for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
    Tensors v = valid();
    moe_tensor *fields[] = {&v.out, &v.out_scale, &v.x_all, &v.x_scale_all, &v.x, &v.x_scale, &v.peer_rank,
                            &v.peer_route};
    if (rows[r].field != F_NONE) *fields[rows[r].field] = rows[r].t;
    moe_world_dispatch_fp8_args a = args_of(&v, rows[r].k);
    const int rc = moe_world_dispatch_fp8(ctx, w, &a);
    const char *msg = moe_errmsg(ctx);
    CHECK(rc == MOE_ERR_ARG && strncmp(msg, "world: dispatch_fp8: ", 21) == 0 && strstr(msg, rows[r].frag),
          "row %zu: want \"world: dispatch_fp8: ...%s...\", got %d \"%s\"", r + 1, rows[r].frag, rc, msg);
  }
  const int k = 2;
  { /* NULL tensors and arrays */
    Tensors v = valid();
    moe_world_dispatch_fp8_args a = args_of(&v, k);
    a.x_scale = NULL;
    int rc = moe_world_dispatch_fp8(ctx, w, &a);
    CHECK(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "x_scale must be f32 [4, 2], got nothing"), "NULL x_scale: %s",
          moe_errmsg(ctx));
    rc = moe_world_dispatch_fp8(ctx, w, NULL);
    CHECK(rc == MOE_ERR_ARG && !strcmp(moe_errmsg(ctx), "world: dispatch_fp8: NULL argument"), "NULL args: %s",
          moe_errmsg(ctx));
    rc = moe_world_dispatch_fp8(ctx, NULL, &a);
    CHECK(rc == MOE_ERR_ARG && !strcmp(moe_errmsg(ctx), "world: dispatch_fp8: NULL argument"), "NULL world: %s",
          moe_errmsg(ctx));
  }
  { /* valid: apart, and in place (x and x_scale their rank's own slots of the gathered tensors) */
    for (int in_place = 0; in_place < 4; in_place++) {
      Tensors v = valid();
      if (in_place & 1) v.x.data = (unsigned char *)v.x_all.data + RANK * slot;
      if (in_place & 2) v.x_scale.data = (unsigned char *)v.x_scale_all.data + RANK * scale_slot;
      moe_world_dispatch_fp8_args a = args_of(&v, k);
      const int rc = moe_world_dispatch_fp8(ctx, w, &a);
      CHECK(past_the_checks(rc), "valid arguments (in place: x %d, x_scale %d) refused: %d \"%s\"", in_place & 1,
            in_place >> 1, rc, moe_errmsg(ctx));
    }
  }
}

/* The bf16 dispatch's in-place rule, which the FP8 one shares (own_slot in lib/world.c). */
static void bf16_in_place(moe_world *w) {
  static const size_t slot = (size_t)T * H * 2;
  moe_tensor x_all = tensor(MOE_BF16, 3, W, T, H, AT_X_ALL, 0), out = tensor(MOE_BF16, 2, C, H, 0, AT_OUT, 0);
  moe_tensor pr = tensor(MOE_I32, 1, C, 0, 0, AT_PR, 0), pq = tensor(MOE_I32, 1, C, 0, 0, AT_PQ, 0);
  for (int rank = 0; rank < W; rank++) {
    moe_tensor x = tensor(MOE_BF16, 2, T, H, 0, AT_X_ALL + rank * slot, 0);
    moe_world_dispatch_args a = {&out, &x_all, &x, &pr, &pq, 2, 1, NULL};
    const int rc = moe_world_dispatch(ctx, w, &a);
    if (rank == RANK)
      CHECK(past_the_checks(rc), "bf16: x in its own slot refused: %d \"%s\"", rc, moe_errmsg(ctx));
    else
      CHECK(rc == MOE_ERR_ARG && strstr(moe_errmsg(ctx), "x_all and x share memory"),
            "bf16: x in rank %d's slot: %d \"%s\"", rank, rc, moe_errmsg(ctx));
  }
}

int main(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) return 2;
  int ranks[1] = {RANK}, devices[1] = {0};
  void *comms[1] = {NULL}, *streams[1] = {NULL};
  moe_world w;
  memset(&w, 0, sizeof w);
  w.size = W, w.nlocal = 1, w.ranks = ranks, w.devices = devices, w.comms = comms, w.streams = streams;
  w.aborted = 1; /* a build with NCCL stops at its entry: no communicator to issue on */
  fp8_rows(&w);
  bf16_in_place(&w);
  moe_ctx_close(ctx);
  if (failures) {
    fprintf(stderr, "test_world_args: %d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("test_world_args: %d checks passed\n", checks);
  return 0;
}
