/* SPDX-License-Identifier: MIT */
// select.cuh -- how a stage with several GPU kernels chooses one.  Each such stage keeps one
// table of candidates in its select.cu, in the order they are tried:
//
//   {name, fits, run}   fits(ctx, a, why) says whether the kernel takes the problem: TAKES;
//                       DECLINES (it could, but a later candidate is faster here: skipped by
//                       "auto", run when forced); or CANNOT (limits of the kernel or the
//                       device).  It writes why into `why` for DECLINES and CANNOT.
//
// "auto" runs the first candidate that TAKES; a name forced through the context's option
// (moe_ctx_config) runs that candidate unless it CANNOT, and an unknown name is an error that
// lists the table.  The same walk writes moe_<stage>_explain's report, so the report and the
// choice cannot disagree.
#pragma once

#include <stdio.h>
#include <string.h>

#include "internal.h"

enum Fit { TAKES, DECLINES, CANNOT };

template <class Args> struct Candidate {
  const char *name;
  // MOE_OK and *fit, or an error (a failed device query) that the stage returns as it is
  int (*fits)(moe_ctx *ctx, const Args *a, Fit *fit, char *why, size_t n);
  int (*run)(moe_ctx *ctx, const Args *a);
};

// The table's names, ", "-separated, built once (the valid values of the stage's option); a
// function-local static, so that two threads asking first at once both see it whole.
template <class Args, size_t N> const char *candidate_names(const Candidate<Args> (&table)[N]) {
  struct Names {
    char s[256];
  };
  static const Names names = [&] {
    Names all{};
    for (size_t i = 0; i < N; i++)
      snprintf(all.s + strlen(all.s), sizeof all.s - strlen(all.s), "%s%s", i ? ", " : "", table[i].name);
    return all;
  }();
  return names.s;
}

// Picks the candidate for a: *chosen is its index, or the call's error.  With report non-NULL,
// also writes the explain report ("<kernel>\n" then "<name>: <verdict>\n" per candidate).
template <class Args, size_t N>
int select_candidate(moe_ctx *ctx, const char *stage, int option, const Candidate<Args> (&table)[N], const Args *a,
                     size_t *chosen, char *report, size_t n) {
  const char *forced = moeI_config(ctx, option);
  const bool any = strcmp(forced, "auto") == 0;
  size_t pick = N;
  if (!any) {
    for (size_t i = 0; i < N; i++)
      if (strcmp(table[i].name, forced) == 0) pick = i;
    if (pick == N)
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: kernel \"%s\" is not one of %s (the context's %s_kernel option)", stage,
                         forced, candidate_names(table), stage);
  }
  // Every candidate is asked when a report is wanted; else only until one is picked.  A failure
  // while asking one the call itself would not ask (past the pick, or not the forced one) is
  // reported as its verdict, not as the call's error.
  char lines[N][200];
  size_t runs = N; // the candidate that runs
  for (size_t i = 0; i < N; i++) {
    lines[i][0] = '\0';
    const bool asked_by_run = any ? runs == N : i == pick;
    if (!report && !asked_by_run) continue;
    Fit fit = CANNOT;
    char why[160] = "";
    int rc = table[i].fits(ctx, a, &fit, why, sizeof why);
    if (rc && asked_by_run) return rc;
    if (rc) snprintf(why, sizeof why, "%s", moe_errmsg(ctx)), fit = CANNOT;
    const bool mine = any ? runs == N && fit == TAKES : i == pick;
    if (mine && fit == CANNOT)
      return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: kernel %s (forced by the context's %s_kernel option) cannot take "
                         "this problem: %s", stage, table[i].name, stage, why);
    if (mine) runs = i;
    const char *verdict = mine ? (any ? "runs" : "runs (forced)")
                        : fit == TAKES ? (any ? "takes it, but an earlier kernel runs" : "takes it (not forced)")
                        : fit == DECLINES ? "declines" : "cannot";
    snprintf(lines[i], sizeof lines[i], "%s%s%s", verdict, why[0] ? ": " : "", why);
  }
  pick = runs;
  if (pick == N) { // every candidate cannot: say why each
    char all[N * (sizeof lines[0] + 16)] = "";
    for (size_t i = 0; i < N; i++)
      snprintf(all + strlen(all), sizeof all - strlen(all), "%s%s %s", i ? "; " : "", table[i].name, lines[i]);
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: no kernel takes this problem: %s", stage, all);
  }
  *chosen = pick;
  if (report) {
    int used = snprintf(report, n, "%s\n", table[pick].name);
    for (size_t i = 0; i < N && used >= 0 && (size_t)used < n; i++)
      used += snprintf(report + used, n - used, "%s: %s\n", table[i].name, lines[i]);
  }
  return MOE_OK;
}

// The stage's entry points: run the chosen kernel, or explain the choice.
template <class Args, size_t N>
int select_run(moe_ctx *ctx, const char *stage, int option, const Candidate<Args> (&table)[N], const Args *a) {
  size_t k;
  int rc = select_candidate(ctx, stage, option, table, a, &k, NULL, 0);
  return rc ? rc : table[k].run(ctx, a);
}
template <class Args, size_t N>
int select_explain(moe_ctx *ctx, const char *stage, int option, const Candidate<Args> (&table)[N], const Args *a,
                   char *report, size_t n) {
  size_t k;
  int rc = select_candidate(ctx, stage, option, table, a, &k, report, n);
  return rc ? rc : moeI_ok(ctx);
}
