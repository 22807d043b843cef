/* SPDX-License-Identifier: MIT */
/*
 * moelab_dlpack.h -- the DLPack 1.0 structures that moe_tensor_from_dlpack and
 * moe_tensor_to_dlpack (moelab.h) exchange, for a program that has no dlpack.h of its own.
 *
 * Written from the DLPack specification (https://dmlc.github.io/dlpack/latest/): the same type
 * names, field order, widths and enumeration values, so the layout is the one every DLPack
 * producer and consumer uses.  Both the legacy DLManagedTensor and the versioned
 * DLManagedTensorVersioned of DLPack 1.x are here; moelab reads and writes both.
 *
 * It coexists with the official dlpack.h in either include order because it uses that header's
 * own guard, DLPACK_DLPACK_H_: included after dlpack.h it defines nothing; included before, it
 * stands in for it (then only the DLPack 1.0 names below exist: include the official header
 * first where a program needs names added after 1.0, such as the FP8 type codes).
 */
#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

/* Windows builds of a DLPack library mark their exports with it; moelab exports none. */
#if defined(_WIN32) && defined(DLPACK_EXPORTS)
#define DLPACK_DLL __declspec(dllexport)
#elif defined(_WIN32)
#define DLPACK_DLL __declspec(dllimport)
#else
#define DLPACK_DLL
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version a DLManagedTensorVersioned was made for: a consumer must not read past the
 * version of a tensor whose major version it does not know (its layout may differ). */
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

/* Where the memory lives.  The values are the specification's; gaps are unassigned.  C++ gets
 * the fixed 32-bit underlying type the specification gives the enumeration. */
#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
  kDLCPU = 1,          /* host memory */
  kDLCUDA = 2,         /* CUDA device memory */
  kDLCUDAHost = 3,     /* host memory pinned by cudaMallocHost */
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13, /* cudaMallocManaged memory */
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id; /* the GPU's index; 0 for host, pinned and managed memory */
} DLDevice;

typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,
  kDLFloat8_e3m4 = 7U,
  kDLFloat8_e4m3 = 8U,
  kDLFloat8_e4m3b11fnuz = 9U,
  kDLFloat8_e4m3fn = 10U,
  kDLFloat8_e4m3fnuz = 11U,
  kDLFloat8_e5m2 = 12U,
  kDLFloat8_e5m2fnuz = 13U
} DLDataTypeCode;

/* One element: code (a DLDataTypeCode, stored in a byte), its width in bits, and lanes > 1 for
 * a vector of that many.  f32 is {kDLFloat, 32, 1}, bf16 {kDLBfloat, 16, 1}, i32 {kDLInt, 32, 1}. */
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

/* A tensor that manages nothing.  Element i of a compact row-major tensor is at
 * (char *)data + byte_offset + i * element size.  strides (in elements, not bytes) may be NULL
 * for a compact row-major tensor; shape and strides hold ndim entries. */
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;

/* The legacy exchange structure: the consumer that takes it calls deleter(self) once when it
 * is done with it (deleter may be NULL: nothing to release). */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* flags of a DLManagedTensorVersioned */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL) /* the consumer must not write the data */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL) /* the producer made a copy the consumer alone uses */

/* The exchange structure of DLPack 1.x: version first, so that a consumer can tell whether it
 * knows the rest of the layout; the same ownership rule as DLManagedTensor. */
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}
#endif
#endif /* DLPACK_DLPACK_H_ */
