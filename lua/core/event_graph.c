/* SPDX-License-Identifier: MIT */
/*
 * event_graph.c -- timing (core.now, core.sleep), NVTX ranges (core.range_push, core.range_pop),
 * events (moelab.Event) and CUDA graphs (moelab.Graph): a graph holds the pins of its capture
 * (PINS) and undoes them when it goes.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime for core.now */
#include <errno.h>
#include <string.h>
#include <time.h>

#include "lcore.h"

/* An event or a graph: the C object alone (NULL until created and once freed). */
typedef struct Handle {
  void *p;
} Handle;

static int l_now(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
  return 1;
}

/* core.sleep(seconds): the thread sleeps (a rank waiting for the id file rank 0 writes) */
static int l_sleep(lua_State *L) {
  lua_Number sec = luaL_checknumber(L, 1);
  luaL_argcheck(L, sec == sec && sec <= 1e9, 1, "seconds must be a number up to 1e9"); /* fits a time_t */
  if (sec > 0) {
    struct timespec ts;
    ts.tv_sec = (time_t)sec;
    ts.tv_nsec = (long)((sec - (lua_Number)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  return 0;
}

/* core.range_push(name), core.range_pop(): a range of the host's own around calls (moelab.h) */
static int l_range_push(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  int rc = moe_range_push(ctx, luaL_checkstring(L, 1));
  return rc ? lc_fail(L, ctx, rc) : 0;
}

static int l_range_pop(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  int rc = moe_range_pop(ctx);
  return rc ? lc_fail(L, ctx, rc) : 0;
}

static Handle *new_object(lua_State *L, const char *tname) {
  Handle *h = (Handle *)lua_newuserdatauv(L, sizeof *h, 1);
  h->p = NULL;
  luaL_setmetatable(L, tname);
  return h;
}

/* The open object at idx; at 1, the self of `method` (lc_check_self names a call with '.'). */
static void *check_object(lua_State *L, int idx, const char *tname, const char *method) {
  Handle *h = (Handle *)(idx == 1 ? lc_check_self(L, tname, strcmp(tname, EVENT) == 0 ? "event" : "graph", method)
                                  : luaL_checkudata(L, idx, tname));
  if (!h->p) luaL_argerror(L, idx, lua_pushfstring(L, "%s is closed", tname));
  return h->p;
}

static int l_event_new(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_device dev = lc_check_device(L, 1);
  Handle *h = new_object(L, EVENT);
  moe_event *e = NULL;
  int rc = moe_event_new(ctx, dev, &e);
  h->p = e;
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

static int e_release(lua_State *L) {
  Handle *h = (Handle *)luaL_testudata(L, 1, EVENT);
  if (h && h->p) {
    moe_event_free((moe_event *)h->p);
    h->p = NULL;
  }
  return 0;
}

static int e_tostring(lua_State *L) {
  Handle *h = (Handle *)luaL_checkudata(L, 1, EVENT);
  lua_pushstring(L, h->p ? "moelab.Event" : "moelab.Event(closed)");
  return 1;
}

static int e_record(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_event *e = (moe_event *)check_object(L, 1, EVENT, "record");
  int rc = moe_event_record(ctx, e);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

/* stop:elapsed_since(start) -> milliseconds; waits for stop */
static int e_elapsed_since(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_event *stop = (moe_event *)check_object(L, 1, EVENT, "elapsed_since");
  moe_event *start = (moe_event *)check_object(L, 2, EVENT, NULL);
  float ms = 0;
  int rc = moe_event_elapsed(ctx, start, stop, &ms);
  if (rc) return lc_fail(L, ctx, rc);
  lua_pushnumber(L, (lua_Number)ms);
  return 1;
}

static int l_graph_begin(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_device dev = lc_check_device(L, 1);
  int rc = moe_graph_begin(ctx, dev);
  if (rc) return lc_fail(L, ctx, rc);
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, PINS);
  return 0;
}

/* graph_end([keep]) -> Graph; keep (any value, say a table of the captured tensors) is held
 * by the graph as long as it lives, and so are the capture's pins (PINS), undone with it. */
static int l_graph_end(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  lua_settop(L, 1);
  /* what can fail for want of memory first, so that the pins never sit in a table nobody undoes */
  Handle *h = new_object(L, GRAPH);
  lua_createtable(L, 2, 0); /* {keep, the pinned owners} */
  lua_pushvalue(L, 1);
  lua_rawseti(L, 3, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, PINS);
  lua_rawseti(L, 3, 2);
  lua_setiuservalue(L, 2, 1);
  lua_pushnil(L);
  lua_setfield(L, LUA_REGISTRYINDEX, PINS);
  moe_graph *g = NULL;
  int rc = moe_graph_end(ctx, &g);
  h->p = g;
  if (rc) return lc_fail(L, ctx, rc);
  return 1;
}

/* __gc and __close: the graph first, then its pins (once: the set is dropped after). */
static int g_release(lua_State *L) {
  Handle *h = (Handle *)luaL_testudata(L, 1, GRAPH);
  if (!h) return 0;
  if (h->p) {
    moe_graph_free((moe_graph *)h->p);
    h->p = NULL;
  }
  if (lua_getiuservalue(L, 1, 1) == LUA_TTABLE) {
    if (lua_rawgeti(L, -1, 2) == LUA_TTABLE) lc_unpin_all(L, -1);
    lua_pop(L, 1);
    lua_pushnil(L);
    lua_rawseti(L, -2, 2);
  }
  lua_pop(L, 1);
  return 0;
}

static int g_tostring(lua_State *L) {
  Handle *h = (Handle *)luaL_checkudata(L, 1, GRAPH);
  lua_pushstring(L, h->p ? "moelab.Graph" : "moelab.Graph(closed)");
  return 1;
}

static int g_replay(lua_State *L) {
  moe_ctx *ctx = lc_getctx(L);
  moe_graph *g = (moe_graph *)check_object(L, 1, GRAPH, "replay");
  int rc = moe_graph_replay(ctx, g);
  if (rc) return lc_fail(L, ctx, rc);
  lua_settop(L, 1);
  return 1;
}

static const luaL_Reg event_meta[] = {
  {"__gc", e_release},
  {"__close", e_release},
  {"__tostring", e_tostring},
  {NULL, NULL}
};

static const luaL_Reg event_methods[] = {
  {"record", e_record},
  {"elapsed_since", e_elapsed_since},
  {NULL, NULL}
};

static const luaL_Reg graph_meta[] = {
  {"__gc", g_release},
  {"__close", g_release},
  {"__tostring", g_tostring},
  {NULL, NULL}
};

static const luaL_Reg graph_methods[] = {
  {"replay", g_replay},
  {NULL, NULL}
};

static const luaL_Reg event_graph_funcs[] = {
  {"now", l_now},
  {"sleep", l_sleep},
  {"range_push", l_range_push},
  {"range_pop", l_range_pop},
  {"event_new", l_event_new},
  {"graph_begin", l_graph_begin},
  {"graph_end", l_graph_end},
  {NULL, NULL}
};

void lc_open_event_graph(lua_State *L, int ctxi, int mod) {
  lc_new_class(L, EVENT, event_meta, 0, event_methods, ctxi);
  lc_new_class(L, GRAPH, graph_meta, 0, graph_methods, ctxi);
  lc_add_funcs(L, event_graph_funcs, ctxi, mod);
}
