/* SPDX-License-Identifier: MIT */
/* mlp.h -- the f32 dot products and the SwiGLU MLP shared by the experts stage (experts.c,
 * which defines them) and the dense reference (reference.c).
 *
 * Every dot product here has one fixed summation order, whatever the row blocking: element i
 * goes into partial sum i % 8 (ascending i within each), and the eight partial sums are added
 * as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).  So moeI_mlp_dot and lane r of moeI_mlp_dot4
 * give the same bits, and a row's result never depends on which rows it was grouped with.
 * Eight independent sums are what lets the compiler keep two SIMD registers busy without
 * reassociating anything (the build uses -ffp-contract=off and no -ffast-math). */
#ifndef MOELAB_MLP_H
#define MOELAB_MLP_H

#include "fp8_math.h"
#include "route_math.h"
#include <math.h>
#include <stdint.h>

/* Rows processed together against each weight row: four rows of eight partial sums fill
 * eight of the sixteen SSE registers. */
enum { MLP_ROWS = 4 };

/* dst[i] = the f32 value of bf16 src[i] (exact). */
void moeI_mlp_bf16_to_f32(float *dst, const uint16_t *src, int64_t n);

/* dst[i] = the f32 value of e4m3 src[i] (exact). */
void moeI_mlp_e4m3_to_f32(float *dst, const uint8_t *src, int64_t n);

/* w . x over n elements in the fixed order above. */
float moeI_mlp_dot(const float *w, const float *x, int64_t n);

/* out[r] = w . x[r] for the MLP_ROWS rows x[0..3]; each equals moeI_mlp_dot(w, x[r], n). */
void moeI_mlp_dot4(float out[MLP_ROWS], const float *w, const float *const x[MLP_ROWS], int64_t n);

/* out[r] = w . x[r] for r < nrows (1..MLP_ROWS); a short block runs row by row (same bits). */
void moeI_mlp_dot_rows(float *out, const float *w, const float *const x[MLP_ROWS], int nrows, int64_t n);

/* One block of 128 activations v quantized as MOE_QUANT_TOKEN does: q[i] the exact f32 value of
 * element i's e4m3 byte; returns the block's scale. */
float moeI_mlp_fp8_token_block(float q[MOE_FP8_BLOCK], const float *v);
/* v[0..n) (n a multiple of 128) replaced block by block by its quantized value times the block's
 * scale (an f32 product), as moe_quantize then moe_dequantize would give it. */
void moeI_mlp_fp8_token_qdq(float *v, int64_t n);

/* What happens to the hidden activation between the two products of moeI_mlp_swiglu: kept in f32
 * (the reference), rounded to bf16 (the experts stage, where it is a bf16 tensor between two
 * GEMMs), or quantized per row and 128 columns and dequantized (the FP8 reference; F a multiple
 * of 128). */
enum { MLP_H_F32 = 0, MLP_H_BF16 = 1, MLP_H_FP8 = 2 };

/* The SwiGLU MLP of nrows (1..MLP_ROWS) rows: y[r] [H] = W_down . (silu(W_gate . x[r]) * (W_up . x[r])).
 * w_gate_up is f32 [2F, H] (F gate rows, then F up rows), w_down f32 [H, F]; h_mode is one of
 * MLP_H_*.  h is scratch of MLP_ROWS * F floats.  y[r] must not overlap x[r]'s rows. */
void moeI_mlp_swiglu(float *const y[MLP_ROWS], const float *const x[MLP_ROWS], int nrows, const float *w_gate_up,
                const float *w_down, int64_t H, int64_t F, int h_mode, float *h);

/* silu(g) = g / (1 + e^-g) and sigmoid(z) = 1 / (1 + e^-z), in f32.  Large negative inputs
 * give e^-g = inf, hence -0 and 0 rather than NaN. */
static inline float mlp_silu(float g) { return g / (1.0f + expf(-g)); }
/* the routers' sigmoid (route_math.h), so the gate is the same bits on the CPU and the GPU */
static inline float mlp_sigmoid(float z) { return moeI_rm_sigmoid(z); }

#endif
