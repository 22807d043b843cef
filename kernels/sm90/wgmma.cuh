/* SPDX-License-Identifier: MIT */
// wgmma.cuh -- wgmma.mma_async m64nNk16 (bf16 in) and m64nNk32 (e4m3 in), f32 accumulators, for
// N = 8, 16, .. 256, with both operands K-major in shared memory (descriptors), for the experts
// GEMMs (kernels/experts/): bf16 N = 256 for the row tiles and N = the tokens of a CTA rounded up
// to 8 for the weights-as-M tiles; e4m3 the same for the FP8 weights-as-M tiles; and for the
// router's logits (kernels/logits.cu: bf16 N = 64, 96 or 128 experts).
// wgmma_n<N, OFF>(d, ...) and wgmma_e4m3_n<N, OFF>(d, ...) accumulate D[64 x N] into d[OFF .. OFF
// + N / 2) (N / 2 registers a thread); scale_d = 0 overwrites.  An asm statement's operand list
// cannot come from a template, so the lists are spelled out by the preprocessor: MOE_WG_REGS_N is
// the PTX vector "%0, .., %(N/2 - 1)" and MOE_WG_ACCS_N the matching "+f" operands, each built from
// the one for N - 8 and four more; the descriptors and scale_d follow as N/2 .. N/2 + 2.
#pragma once
#include <stdint.h>

#include "ptx.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define MOE_WG_S4(a, b, c, e) "%" #a ", %" #b ", %" #c ", %" #e
#define MOE_WG_A4(i) "+f"(d[OFF + i]), "+f"(d[OFF + i + 1]), "+f"(d[OFF + i + 2]), "+f"(d[OFF + i + 3])
#define MOE_WG_REGS_8 MOE_WG_S4(0, 1, 2, 3)
#define MOE_WG_ACCS_8 MOE_WG_A4(0)
#define MOE_WG_REGS_16 MOE_WG_REGS_8 ", " MOE_WG_S4(4, 5, 6, 7)
#define MOE_WG_ACCS_16 MOE_WG_ACCS_8, MOE_WG_A4(4)
#define MOE_WG_REGS_24 MOE_WG_REGS_16 ", " MOE_WG_S4(8, 9, 10, 11)
#define MOE_WG_ACCS_24 MOE_WG_ACCS_16, MOE_WG_A4(8)
#define MOE_WG_REGS_32 MOE_WG_REGS_24 ", " MOE_WG_S4(12, 13, 14, 15)
#define MOE_WG_ACCS_32 MOE_WG_ACCS_24, MOE_WG_A4(12)
#define MOE_WG_REGS_40 MOE_WG_REGS_32 ", " MOE_WG_S4(16, 17, 18, 19)
#define MOE_WG_ACCS_40 MOE_WG_ACCS_32, MOE_WG_A4(16)
#define MOE_WG_REGS_48 MOE_WG_REGS_40 ", " MOE_WG_S4(20, 21, 22, 23)
#define MOE_WG_ACCS_48 MOE_WG_ACCS_40, MOE_WG_A4(20)
#define MOE_WG_REGS_56 MOE_WG_REGS_48 ", " MOE_WG_S4(24, 25, 26, 27)
#define MOE_WG_ACCS_56 MOE_WG_ACCS_48, MOE_WG_A4(24)
#define MOE_WG_REGS_64 MOE_WG_REGS_56 ", " MOE_WG_S4(28, 29, 30, 31)
#define MOE_WG_ACCS_64 MOE_WG_ACCS_56, MOE_WG_A4(28)
#define MOE_WG_REGS_72 MOE_WG_REGS_64 ", " MOE_WG_S4(32, 33, 34, 35)
#define MOE_WG_ACCS_72 MOE_WG_ACCS_64, MOE_WG_A4(32)
#define MOE_WG_REGS_80 MOE_WG_REGS_72 ", " MOE_WG_S4(36, 37, 38, 39)
#define MOE_WG_ACCS_80 MOE_WG_ACCS_72, MOE_WG_A4(36)
#define MOE_WG_REGS_88 MOE_WG_REGS_80 ", " MOE_WG_S4(40, 41, 42, 43)
#define MOE_WG_ACCS_88 MOE_WG_ACCS_80, MOE_WG_A4(40)
#define MOE_WG_REGS_96 MOE_WG_REGS_88 ", " MOE_WG_S4(44, 45, 46, 47)
#define MOE_WG_ACCS_96 MOE_WG_ACCS_88, MOE_WG_A4(44)
#define MOE_WG_REGS_104 MOE_WG_REGS_96 ", " MOE_WG_S4(48, 49, 50, 51)
#define MOE_WG_ACCS_104 MOE_WG_ACCS_96, MOE_WG_A4(48)
#define MOE_WG_REGS_112 MOE_WG_REGS_104 ", " MOE_WG_S4(52, 53, 54, 55)
#define MOE_WG_ACCS_112 MOE_WG_ACCS_104, MOE_WG_A4(52)
#define MOE_WG_REGS_120 MOE_WG_REGS_112 ", " MOE_WG_S4(56, 57, 58, 59)
#define MOE_WG_ACCS_120 MOE_WG_ACCS_112, MOE_WG_A4(56)
#define MOE_WG_REGS_128 MOE_WG_REGS_120 ", " MOE_WG_S4(60, 61, 62, 63)
#define MOE_WG_ACCS_128 MOE_WG_ACCS_120, MOE_WG_A4(60)
#define MOE_WG_REGS_136 MOE_WG_REGS_128 ", " MOE_WG_S4(64, 65, 66, 67)
#define MOE_WG_ACCS_136 MOE_WG_ACCS_128, MOE_WG_A4(64)
#define MOE_WG_REGS_144 MOE_WG_REGS_136 ", " MOE_WG_S4(68, 69, 70, 71)
#define MOE_WG_ACCS_144 MOE_WG_ACCS_136, MOE_WG_A4(68)
#define MOE_WG_REGS_152 MOE_WG_REGS_144 ", " MOE_WG_S4(72, 73, 74, 75)
#define MOE_WG_ACCS_152 MOE_WG_ACCS_144, MOE_WG_A4(72)
#define MOE_WG_REGS_160 MOE_WG_REGS_152 ", " MOE_WG_S4(76, 77, 78, 79)
#define MOE_WG_ACCS_160 MOE_WG_ACCS_152, MOE_WG_A4(76)
#define MOE_WG_REGS_168 MOE_WG_REGS_160 ", " MOE_WG_S4(80, 81, 82, 83)
#define MOE_WG_ACCS_168 MOE_WG_ACCS_160, MOE_WG_A4(80)
#define MOE_WG_REGS_176 MOE_WG_REGS_168 ", " MOE_WG_S4(84, 85, 86, 87)
#define MOE_WG_ACCS_176 MOE_WG_ACCS_168, MOE_WG_A4(84)
#define MOE_WG_REGS_184 MOE_WG_REGS_176 ", " MOE_WG_S4(88, 89, 90, 91)
#define MOE_WG_ACCS_184 MOE_WG_ACCS_176, MOE_WG_A4(88)
#define MOE_WG_REGS_192 MOE_WG_REGS_184 ", " MOE_WG_S4(92, 93, 94, 95)
#define MOE_WG_ACCS_192 MOE_WG_ACCS_184, MOE_WG_A4(92)
#define MOE_WG_REGS_200 MOE_WG_REGS_192 ", " MOE_WG_S4(96, 97, 98, 99)
#define MOE_WG_ACCS_200 MOE_WG_ACCS_192, MOE_WG_A4(96)
#define MOE_WG_REGS_208 MOE_WG_REGS_200 ", " MOE_WG_S4(100, 101, 102, 103)
#define MOE_WG_ACCS_208 MOE_WG_ACCS_200, MOE_WG_A4(100)
#define MOE_WG_REGS_216 MOE_WG_REGS_208 ", " MOE_WG_S4(104, 105, 106, 107)
#define MOE_WG_ACCS_216 MOE_WG_ACCS_208, MOE_WG_A4(104)
#define MOE_WG_REGS_224 MOE_WG_REGS_216 ", " MOE_WG_S4(108, 109, 110, 111)
#define MOE_WG_ACCS_224 MOE_WG_ACCS_216, MOE_WG_A4(108)
#define MOE_WG_REGS_232 MOE_WG_REGS_224 ", " MOE_WG_S4(112, 113, 114, 115)
#define MOE_WG_ACCS_232 MOE_WG_ACCS_224, MOE_WG_A4(112)
#define MOE_WG_REGS_240 MOE_WG_REGS_232 ", " MOE_WG_S4(116, 117, 118, 119)
#define MOE_WG_ACCS_240 MOE_WG_ACCS_232, MOE_WG_A4(116)
#define MOE_WG_REGS_248 MOE_WG_REGS_240 ", " MOE_WG_S4(120, 121, 122, 123)
#define MOE_WG_ACCS_248 MOE_WG_ACCS_240, MOE_WG_A4(120)
#define MOE_WG_REGS_256 MOE_WG_REGS_248 ", " MOE_WG_S4(124, 125, 126, 127)
#define MOE_WG_ACCS_256 MOE_WG_ACCS_248, MOE_WG_A4(124)

// wgmma_m64n<N>k16 (bf16) and wgmma_m64n<N>k32_e4m3; DA, DB, SD: the operand numbers N/2 .. N/2 + 2.
// SHAPE_TYPES is the instruction's tail after m64nN, IMM its immediates after scale_d: e4m3 takes
// no transpose immediates (both operands K-major is the only layout it has).
#define MOE_WGMMA_ONE(N, NAME, SHAPE_TYPES, IMM, DA, DB, SD)                                           \
  template <int OFF, int ACC>                                                                          \
  __device__ __forceinline__ void NAME(float(&d)[ACC], uint64_t da, uint64_t db, int scale_d) {         \
    static_assert(OFF + N / 2 <= ACC, "accumulators out of range");                                    \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %" #SD ", 0;\n\t"                                \
                 "wgmma.mma_async.sync.aligned.m64n" #N SHAPE_TYPES " {" MOE_WG_REGS_##N "}, %" #DA     \
                 ", %" #DB ", p" IMM ";\n\t}\n"                                                        \
                 : MOE_WG_ACCS_##N                                                                      \
                 : "l"(da), "l"(db), "r"(scale_d)                                                       \
                 : "memory");                                                                           \
  }
#define MOE_WGMMA_DEF(N, DA, DB, SD)                                                                  \
  MOE_WGMMA_ONE(N, wgmma_m64n##N##k16, "k16.f32.bf16.bf16", ", 1, 1, 0, 0", DA, DB, SD)                 \
  MOE_WGMMA_ONE(N, wgmma_m64n##N##k32_e4m3, "k32.f32.e4m3.e4m3", ", 1, 1", DA, DB, SD)

MOE_WGMMA_DEF(8, 4, 5, 6)
MOE_WGMMA_DEF(16, 8, 9, 10)
MOE_WGMMA_DEF(24, 12, 13, 14)
MOE_WGMMA_DEF(32, 16, 17, 18)
MOE_WGMMA_DEF(40, 20, 21, 22)
MOE_WGMMA_DEF(48, 24, 25, 26)
MOE_WGMMA_DEF(56, 28, 29, 30)
MOE_WGMMA_DEF(64, 32, 33, 34)
MOE_WGMMA_DEF(72, 36, 37, 38)
MOE_WGMMA_DEF(80, 40, 41, 42)
MOE_WGMMA_DEF(88, 44, 45, 46)
MOE_WGMMA_DEF(96, 48, 49, 50)
MOE_WGMMA_DEF(104, 52, 53, 54)
MOE_WGMMA_DEF(112, 56, 57, 58)
MOE_WGMMA_DEF(120, 60, 61, 62)
MOE_WGMMA_DEF(128, 64, 65, 66)
MOE_WGMMA_DEF(136, 68, 69, 70)
MOE_WGMMA_DEF(144, 72, 73, 74)
MOE_WGMMA_DEF(152, 76, 77, 78)
MOE_WGMMA_DEF(160, 80, 81, 82)
MOE_WGMMA_DEF(168, 84, 85, 86)
MOE_WGMMA_DEF(176, 88, 89, 90)
MOE_WGMMA_DEF(184, 92, 93, 94)
MOE_WGMMA_DEF(192, 96, 97, 98)
MOE_WGMMA_DEF(200, 100, 101, 102)
MOE_WGMMA_DEF(208, 104, 105, 106)
MOE_WGMMA_DEF(216, 108, 109, 110)
MOE_WGMMA_DEF(224, 112, 113, 114)
MOE_WGMMA_DEF(232, 116, 117, 118)
MOE_WGMMA_DEF(240, 120, 121, 122)
MOE_WGMMA_DEF(248, 124, 125, 126)
MOE_WGMMA_DEF(256, 128, 129, 130)

#define MOE_WG_CASE(n)                                                                                 \
  else if constexpr (N == n) {                                                                         \
    if constexpr (E4M3) wgmma_m64n##n##k32_e4m3<OFF>(d, da, db, scale_d);                              \
    else wgmma_m64n##n##k16<OFF>(d, da, db, scale_d);                                                  \
  }
template <int N, int OFF, bool E4M3, int ACC>
__device__ __forceinline__ void wgmma_any(float (&d)[ACC], uint64_t da, uint64_t db, int scale_d) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "N = 8, 16, .. 256");
  if constexpr (false) {
  }
  MOE_WG_CASE(8) MOE_WG_CASE(16) MOE_WG_CASE(24) MOE_WG_CASE(32) MOE_WG_CASE(40) MOE_WG_CASE(48) MOE_WG_CASE(56)
  MOE_WG_CASE(64) MOE_WG_CASE(72) MOE_WG_CASE(80) MOE_WG_CASE(88) MOE_WG_CASE(96) MOE_WG_CASE(104)
  MOE_WG_CASE(112) MOE_WG_CASE(120) MOE_WG_CASE(128) MOE_WG_CASE(136) MOE_WG_CASE(144) MOE_WG_CASE(152)
  MOE_WG_CASE(160) MOE_WG_CASE(168) MOE_WG_CASE(176) MOE_WG_CASE(184) MOE_WG_CASE(192) MOE_WG_CASE(200)
  MOE_WG_CASE(208) MOE_WG_CASE(216) MOE_WG_CASE(224) MOE_WG_CASE(232) MOE_WG_CASE(240) MOE_WG_CASE(248)
  MOE_WG_CASE(256)
}
#undef MOE_WG_CASE

// D (+)= A[64 x 16] . B[N x 16]^T, bf16
template <int N, int OFF, int ACC>
__device__ __forceinline__ void wgmma_n(float (&d)[ACC], uint64_t da, uint64_t db, int scale_d) {
  wgmma_any<N, OFF, false>(d, da, db, scale_d);
}
// D (+)= A[64 x 32] . B[N x 32]^T, e4m3 (a k32 slice is 32 bytes, as bf16's k16)
template <int N, int OFF, int ACC>
__device__ __forceinline__ void wgmma_e4m3_n(float (&d)[ACC], uint64_t da, uint64_t db, int scale_d) {
  wgmma_any<N, OFF, true>(d, da, db, scale_d);
}

// A ring slot's KS k16 steps (32 bytes apart: the descriptors' + 2), bf16 D[64 x N] (+)= A . B^T
// into d from the descriptors da and db of slot 0 plus off (the slot's, in 16 bytes), the first
// step overwriting where fresh, as one committed group; then the group before it is waited for,
// so that its slot can go back while this one stays in flight.
template <int N, int KS, int ACC>
__device__ __forceinline__ void wgmma_slot_wait_prev(float (&d)[ACC], uint64_t da, uint64_t db, uint64_t off,
                                                     bool fresh) {
  wgmma_fence();
  fence_acc(d);
#pragma unroll
  for (int k = 0; k < KS; k++) wgmma_n<N, 0>(d, da + off + 2 * k, db + off + 2 * k, !fresh || k > 0);
  wgmma_commit();
  wgmma_wait<1>();
  fence_acc(d);
}
#endif
