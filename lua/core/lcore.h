/* SPDX-License-Identifier: MIT */
/*
 * lcore.h -- the private header of the Lua module moelab.core: the types its parts share, the
 * names of its metatables, and the helpers one part offers the others (the lc_ prefix).
 *
 * The parts: module.c (the helpers below and luaopen_moelab_core), tensor.c (tensor handles
 * and their methods), tensorlib.c (the module's tensor functions), stage.c (the stages),
 * event_graph.c (timing, events and CUDA graphs), world.c (moelab.World), exchange.c
 * (moelab.Exchange) and safetensors.c (moelab.SafeTensors).  Each registers its own functions:
 * lc_open_<part>(L, ctxi, mod) creates the part's metatables and sets its functions into the
 * module table at mod, each function holding the context's handle at ctxi as its first upvalue.
 * An opener (re)sets the fields of its metatables even when they exist, so that a reloaded
 * module uses its own context.
 */
#ifndef MOELAB_LCORE_H
#define MOELAB_LCORE_H

#include <stdint.h>

#include "lua.h"
#include "lauxlib.h"

#include "moelab.h"

/* Metatable names, which are the __name of their userdata too. */
#define CONTEXT "moelab.Context"
#define TENSOR "moelab.Tensor"
#define EVENT "moelab.Event"
#define GRAPH "moelab.Graph"
#define WORLD "moelab.World"
#define EXCHANGE "moelab.Exchange"
#define SAFETENSORS "moelab.SafeTensors"

/* A graph replays on raw device pointers, so the memory of every tensor a capture touches must
 * outlive the graph, whatever its handles do.  While a capture is under way the registry holds
 * PINS, a set of owner handles: every owner made during it, and the owner of every tensor a
 * function is handed.  Each is pinned once (pins + 1); graph_end gives the set to the graph,
 * whose release unpins them.  Closing a pinned tensor makes its handle unusable at once; its
 * memory goes when the last graph on it does.  An exchange a captured call used is held in the
 * same set (lc_pin_object): its windows are written and read whatever tensors the call was given. */
#define PINS "moelab.pins"

typedef struct Context {
  moe_ctx *ctx; /* NULL once closed */
} Context;

/* A tensor handle.  `closed` is the Lua side (released by __gc or __close: unusable); `t` is
 * the C side.  An owner closed while views of it live keeps its moe_tensor until the last
 * view goes, so `local b <close> = ...` cannot pull the memory from under a view. */
typedef struct Tensor {
  moe_tensor *t; /* NULL until created, and after it is freed */
  int closed;
  int views; /* live views of this owner */
  int pins;  /* graphs that replay on this owner's memory (see PINS) */
} Tensor;

typedef struct World {
  moe_world *w; /* NULL once closed */
} World;

/* Whether a field of an argument table may be nil. */
enum { REQUIRED = 0, OPTIONAL = 1 };

/* ---- module.c: the context, errors, values of Lua, and registering functions ---- */

moe_ctx *lc_getctx(lua_State *L);
int lc_fail(lua_State *L, moe_ctx *ctx, int rc);
int lc_stage_fail(lua_State *L, moe_ctx *ctx, int rc, const char *fname, const char *stage);
int lc_stage_fail_as(lua_State *L, moe_ctx *ctx, int rc, const char *fname, const char *stage, const char *what);
int lc_arg_error(lua_State *L, const char *fname, int arg, const char *fmt, ...);
void *lc_check_self(lua_State *L, const char *tname, const char *var, const char *method);
const char *lc_type_name(lua_State *L, int idx);
const char *lc_got_value(lua_State *L, int idx);
const char *lc_is_what(lua_State *L, int idx, int value);
moe_device lc_check_device(lua_State *L, int idx);
moe_device lc_opt_device(lua_State *L, int idx);
void lc_push_device(lua_State *L, moe_device d);
moe_dtype lc_check_dtype(lua_State *L, int idx);
void *lc_check_address(lua_State *L, int idx, const char *fname, const char *what);
int lc_check_shape(lua_State *L, int idx, int64_t shape[MOE_MAX_DIMS]);
void lc_add_funcs(lua_State *L, const luaL_Reg *funcs, int ctxi, int mod);
void lc_new_class(lua_State *L, const char *tname, const luaL_Reg *meta, int meta_ctx, const luaL_Reg *methods,
                  int ctxi);

/* ---- tensor.c: tensor handles and the pins of a capture ---- */

void lc_pin_object(lua_State *L, int idx);
void lc_unpin_all(lua_State *L, int idx);
Tensor *lc_new_handle(lua_State *L, int owner);
Tensor *lc_test_tensor(lua_State *L, int idx);
moe_tensor *lc_check_tensor(lua_State *L, int idx);
void lc_args_still_open(lua_State *L, const char *fname, int from);

/* ---- world.c and exchange.c: the arguments of both exchanges, and the Exchange's constructor ---- */

moe_world *lc_check_world(lua_State *L, int idx);
moe_world_dispatch_args *lc_world_dispatch_args(lua_State *L, int n, int direct);
moe_world_combine_args *lc_world_combine_args(lua_State *L, int n, int direct);
int lc_world_exchange(lua_State *L);

/* ---- the parts' openers, which luaopen_moelab_core calls ---- */

void lc_open_tensor(lua_State *L, int ctxi, int mod);
void lc_open_tensorlib(lua_State *L, int ctxi, int mod);
void lc_open_stage(lua_State *L, int ctxi, int mod);
void lc_open_event_graph(lua_State *L, int ctxi, int mod);
void lc_open_world(lua_State *L, int ctxi, int mod);
void lc_open_exchange(lua_State *L, int ctxi, int mod);
void lc_open_safetensors(lua_State *L, int ctxi, int mod);

#endif
