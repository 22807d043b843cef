/* SPDX-License-Identifier: MIT */
/* world.h -- the private side of moe_world: its layout, and the entry points of the NCCL
 * backend (kernels/world.cu).  lib/world.c checks arguments and calls them; a build without
 * NCCL gets stand-ins that return MOE_ERR_UNSUPPORTED (lib/world.c under MOE_WORLD_STUBS, or
 * lib/nocuda.c in a build without CUDA). */
#ifndef MOELAB_WORLD_H
#define MOELAB_WORLD_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MOE_WORLD_ID_BYTES = 128 }; /* sizeof(ncclUniqueId), checked where nccl.h is seen */

struct moe_world {
  int size;     /* W */
  int nlocal;   /* ranks held by this process */
  int *ranks;   /* [nlocal] global ranks */
  int *devices; /* [nlocal] their GPUs */
  void **comms;   /* [nlocal] ncclComm_t; NULL until made */
  int borrowed;   /* comms[0] is the caller's (moe_world_open_comm): never finalised, destroyed or
                     aborted here */
  void **streams; /* [nlocal] cudaStream_t on devices[i]; NULL until made */
  int failed;     /* an NCCL call failed: close aborts instead of finalising (no waiting on peers) */
  int graphs;     /* live graphs that captured an exchange of this world, and open direct
                     exchanges (moeI_world_graph_ref): each keeps the communicators alive */
  int closed;     /* moe_world_close was called while graphs > 0: released with the last one */
  int aborted;    /* a wait timed out or NCCL reported a peer's failure: communicators aborted */
  double timeout_s;         /* bound on every wait for the world's streams (MOE_WORLD_TIMEOUT) */
  volatile int *abort_flag; /* mapped host memory: set on abort, read by the exchange's barriers */
};

/* The direct exchange's windows, one per local rank, all laid out alike. */
struct moe_world_exchange {
  moe_world *w;
  int64_t tokens, k, hidden, capacity;
  size_t x_off, ys_off, rr_off, flags_off, bytes; /* x [T, H], ys [C, H], route_row [W, T*K], flags */
  void **base;   /* [nlocal] the window's memory (ncclMemAlloc) */
  void **win;    /* [nlocal] ncclWindow_t */
  void **peers;  /* [nlocal] device array [W] of every rank's window base, as local rank i sees it */
  void **hpeers; /* [nlocal * W] the same on the host */
  moe_tensor *x, *ys; /* [nlocal] views of the windows */
};

/* MOE_OK when this build can open a world, else MOE_ERR_UNSUPPORTED with the reason. */
int moeI_nccl_available(moe_ctx *ctx);
/* The version of the NCCL linked in ("2.27.3") into buf; MOE_ERR_UNSUPPORTED without NCCL. */
int moeI_nccl_version(char *buf, size_t n);
/* Fills id with a new ncclUniqueId. */
int moeI_nccl_unique_id(moe_ctx *ctx, unsigned char id[MOE_WORLD_ID_BYTES]);
/* A caller's communicator: its rank, size and GPU. */
int moeI_nccl_comm_info(moe_ctx *ctx, void *comm, int *rank, int *size, int *device);
/* Makes w's streams and communicators for its nlocal ranks: none where w borrows the caller's
 * communicator, else ncclCommInitAll when id is NULL (then nlocal == size), else
 * ncclCommInitRank of the one local rank.  On failure what was made is left in w for
 * moeI_nccl_world_release. */
int moeI_nccl_world_open(moe_ctx *ctx, moe_world *w, const unsigned char *id);
/* Waits for the streams, destroys communicators and streams; never fails visibly. */
void moeI_nccl_world_release(moe_world *w);
int moeI_nccl_bind(moe_ctx *ctx, moe_world *w, int i);
int moeI_nccl_unbind(moe_ctx *ctx, moe_world *w);
/* Arguments already checked by lib/world.c. */
int moeI_nccl_allgather(moe_ctx *ctx, moe_world *w, moe_tensor *const *out, const moe_tensor *const *in);
/* all: nlocal * W configs, local rank i's gathered table at all + i * W. */
int moeI_nccl_gather_configs(moe_ctx *ctx, moe_world *w, const moe_world_config *cfgs, moe_world_config *all);
int moeI_nccl_dispatch(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_args *a);
int moeI_nccl_dispatch_fp8(moe_ctx *ctx, moe_world *w, const moe_world_dispatch_fp8_args *a);
int moeI_nccl_combine(moe_ctx *ctx, moe_world *w, const moe_world_combine_args *a);
/* Allocates and registers ex's windows (layout already set in ex); on failure what was made
 * is left in ex for moeI_nccl_exchange_release. */
int moeI_nccl_exchange_open(moe_ctx *ctx, moe_world_exchange *ex);
void moeI_nccl_exchange_release(moe_world_exchange *ex);
int moeI_nccl_exchange_dispatch(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_dispatch_args *a);
int moeI_nccl_exchange_combine(moe_ctx *ctx, moe_world_exchange *ex, const moe_world_combine_args *a);

#ifdef __cplusplus
}
#endif
#endif
