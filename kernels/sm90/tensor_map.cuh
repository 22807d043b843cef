/* SPDX-License-Identifier: MIT */
// tensor_map.cuh -- the host side of the tensor memory accelerator: tensor maps (CUtensorMap),
// encoded through the driver's cuTensorMapEncodeTiled, fetched with
// cudaGetDriverEntryPointByVersion so that nothing links libcuda, and passed to a kernel by value
// as a __grid_constant__ parameter.
#pragma once

#include <cuda.h> // CUtensorMap and the encode function's types only; no libcuda symbol is used

#include "../common.cuh"

namespace {

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// NULL where the driver does not offer it.
encode_tiled_fn encode_tiled() {
  static const encode_tiled_fn fn = []() -> encode_tiled_fn {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = NULL;
    (void)cudaGetLastError();
    return reinterpret_cast<encode_tiled_fn>(p);
  }();
  return fn;
}

// A row-major [rows, k] matrix of bf16 (or of `type`: UINT8 for e4m3, FLOAT32) as a 2D tensor map
// with a {box_k, box_rows} box; rows and columns past the end read as zeros.
bool encode_2d(CUtensorMap *m, const void *base, long long rows, long long k, int box_rows, int box_k,
               CUtensorMapSwizzle swizzle, CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  encode_tiled_fn fn = encode_tiled();
  if (!fn) return false;
  const int esize = type == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : type == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ? 4 : 2;
  const cuuint64_t dim[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  const cuuint64_t stride[1] = {(cuuint64_t)k * (cuuint64_t)esize};
  const cuuint32_t box[2] = {(cuuint32_t)box_k, (cuuint32_t)box_rows};
  const cuuint32_t estride[2] = {1, 1};
  return fn(m, type, 2, const_cast<void *>(base), dim, stride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace
