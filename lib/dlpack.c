/* SPDX-License-Identifier: MIT */
/* dlpack.c -- tensors in and out through DLPack (moelab.h says the rules): the checks of an
 * import, and the exports, which hold a reference to the memory they describe. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"
#include "moelab_dlpack.h"

/* moelab's dtypes as DLPack writes them, indexed by moe_dtype. */
static const DLDataType dl_dtypes[] = {
  [MOE_F32] = {kDLFloat, 32, 1},
  [MOE_BF16] = {kDLBfloat, 16, 1},
  [MOE_I32] = {kDLInt, 32, 1},
  [MOE_E4M3] = {kDLFloat8_e4m3fn, 8, 1},
};

static const char *device_type_name(int32_t type) {
  switch (type) {
  case kDLCPU: return "kDLCPU";
  case kDLCUDA: return "kDLCUDA";
  case kDLCUDAHost: return "kDLCUDAHost";
  case kDLOpenCL: return "kDLOpenCL";
  case kDLVulkan: return "kDLVulkan";
  case kDLMetal: return "kDLMetal";
  case kDLVPI: return "kDLVPI";
  case kDLROCM: return "kDLROCM";
  case kDLROCMHost: return "kDLROCMHost";
  case kDLExtDev: return "kDLExtDev";
  case kDLCUDAManaged: return "kDLCUDAManaged";
  case kDLOneAPI: return "kDLOneAPI";
  case kDLWebGPU: return "kDLWebGPU";
  case kDLHexagon: return "kDLHexagon";
  default: return "unknown";
  }
}

/* "[2, 3]" of n int64 values into buf. */
static const char *list_str(const int64_t *v, int n, char *buf, size_t size) {
  size_t len = (size_t)snprintf(buf, size, "[");
  for (int i = 0; i < n && len < size; i++)
    len += (size_t)snprintf(buf + len, size - len, "%s%" PRId64, i ? ", " : "", v[i]);
  if (len < size) snprintf(buf + len, size - len, "]");
  return buf;
}

/* Strides that lay out shape as a compact row-major tensor.  A dimension of size 1 is never
 * stepped along, and an empty tensor holds nothing to step to, so their strides do not matter
 * (PyTorch exports arbitrary ones there). */
static int compact(const int64_t *shape, const int64_t *strides, int ndim, int64_t numel) {
  if (!strides || numel == 0) return 1;
  int64_t step = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] != 1 && strides[i] != step) return 0;
    step *= shape[i];
  }
  return 1;
}

static int import(moe_ctx *ctx, const DLTensor *d, void *managed, int versioned, moe_tensor **out) {
  static const char *what = "from_dlpack";
  char a[96], b[96];
  if (d->ndim < 0 || d->ndim > MOE_MAX_DIMS)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: ndim is %d, moelab takes 0 to %d dimensions", what, (int)d->ndim,
                       MOE_MAX_DIMS);
  const DLDataType dt = d->dtype;
  int dtype = -1;
  for (int i = 0; i < (int)(sizeof dl_dtypes / sizeof dl_dtypes[0]); i++)
    if (dt.code == dl_dtypes[i].code && dt.bits == dl_dtypes[i].bits && dt.lanes == dl_dtypes[i].lanes) dtype = i;
  if (dtype < 0)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                       "%s: dtype code %u, bits %u, lanes %u is none of moelab's: f32 (code 2 kDLFloat, bits 32), "
                       "bf16 (code 4 kDLBfloat, bits 16), i32 (code 0 kDLInt, bits 32), e4m3 (code 10 "
                       "kDLFloat8_e4m3fn, bits 8), each of lanes 1",
                       what, (unsigned)dt.code, (unsigned)dt.bits, (unsigned)dt.lanes);
  moe_device device = {MOE_CPU, 0};
  const int32_t type = (int32_t)d->device.device_type;
  if (type == kDLCUDA) {
    device.kind = MOE_CUDA;
    device.index = d->device.device_id;
  } else if (type != kDLCPU && type != kDLCUDAHost) {
    return moeI_seterr(ctx, MOE_ERR_ARG,
                       "%s: device type %d (%s) is not taken: kDLCPU (1), kDLCUDAHost (3) or kDLCUDA (2)%s", what,
                       (int)type, device_type_name(type),
                       type == kDLCUDAManaged ? "; wrap managed memory with moe_tensor_wrap on the device it should "
                                                "run on"
                                              : "");
  }
  int64_t numel;
  int rc = moeI_check_layout(ctx, what, (moe_dtype)dtype, d->ndim, d->shape, &numel);
  if (rc) return rc;
  if (!compact(d->shape, d->strides, d->ndim, numel)) {
    int64_t want[MOE_MAX_DIMS], step = 1;
    for (int i = d->ndim - 1; i >= 0; i--) want[i] = step, step *= d->shape[i];
    char c[96];
    return moeI_seterr(ctx, MOE_ERR_ARG,
                       "%s: strides %s are not the compact row-major ones of shape %s (%s): moelab takes contiguous "
                       "tensors only (make a contiguous copy first)",
                       what, list_str(d->strides, d->ndim, a, sizeof a), list_str(d->shape, d->ndim, b, sizeof b),
                       list_str(want, d->ndim, c, sizeof c));
  }
  if (!d->data && numel > 0)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: data is NULL for %" PRId64 " elements", what, numel);
  char *data = d->data ? (char *)d->data + d->byte_offset : NULL;
  if ((uintptr_t)data % moe_dtype_size((moe_dtype)dtype))
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: data %p + byte_offset %" PRIu64 " is not aligned to its dtype %s (%zu bytes)",
                       what, d->data, d->byte_offset, moe_dtype_name((moe_dtype)dtype),
                       moe_dtype_size((moe_dtype)dtype));
  moe_tensor *t = NULL;
  if ((rc = moeI_tensor_wrap(ctx, what, data, (moe_dtype)dtype, d->ndim, d->shape, device, &t))) return rc;
  /* the last step that can fail: past it, the tensor owns managed */
  t->storage = moeI_storage_adopt(managed, versioned);
  if (!t->storage) {
    moe_tensor_free(t);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory", what);
  }
  *out = t;
  return moeI_ok(ctx);
}

int moe_tensor_from_dlpack(moe_ctx *ctx, struct DLManagedTensor *managed, moe_tensor **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "from_dlpack: out is NULL");
  *out = NULL;
  if (!managed) return moeI_seterr(ctx, MOE_ERR_ARG, "from_dlpack: the managed tensor is NULL");
  return import(ctx, &managed->dl_tensor, managed, 0, out);
}

int moe_tensor_from_dlpack_versioned(moe_ctx *ctx, struct DLManagedTensorVersioned *managed, moe_tensor **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "from_dlpack: out is NULL");
  *out = NULL;
  if (!managed) return moeI_seterr(ctx, MOE_ERR_ARG, "from_dlpack: the managed tensor is NULL");
  /* past the version, another major version's layout may differ: nothing else is read */
  if (managed->version.major != DLPACK_MAJOR_VERSION)
    return moeI_seterr(ctx, MOE_ERR_ARG, "from_dlpack: DLPack version %u.%u, moelab reads major version %d",
                       (unsigned)managed->version.major, (unsigned)managed->version.minor, DLPACK_MAJOR_VERSION);
  if (managed->flags & DLPACK_FLAG_BITMASK_READ_ONLY)
    return moeI_seterr(ctx, MOE_ERR_ARG,
                       "from_dlpack: the tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY), and moelab's tensors "
                       "are written in place; export a writable one or a copy");
  return import(ctx, &managed->dl_tensor, managed, 1, out);
}

/* ---- export ---- */

/* One allocation per export: what the consumer sees, the arrays its DLTensor points to, and the
 * reference that keeps the memory alive. */
typedef struct Export {
  union {
    DLManagedTensor legacy;
    DLManagedTensorVersioned versioned;
  } m;
  int64_t shape[MOE_MAX_DIMS], strides[MOE_MAX_DIMS];
  moe_storage *storage;
} Export;

static void export_release(Export *e) {
  moeI_storage_release(e->storage);
  free(e);
}
static void delete_legacy(DLManagedTensor *self) { export_release(self->manager_ctx); }
static void delete_versioned(DLManagedTensorVersioned *self) { export_release(self->manager_ctx); }

/* A new export of t: its arrays filled in, its reference held; the caller fills in the rest. */
static int export_new(moe_ctx *ctx, moe_tensor *t, Export **out) {
  if (!t) return moeI_seterr(ctx, MOE_ERR_ARG, "to_dlpack: the tensor is NULL");
  Export *e = calloc(1, sizeof *e);
  if (!e) return moeI_seterr(ctx, MOE_ERR_NOMEM, "to_dlpack: out of host memory");
  int64_t step = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    e->shape[i] = t->shape[i];
    e->strides[i] = step;
    step *= t->shape[i];
  }
  e->storage = t->storage;
  moeI_storage_hold(e->storage);
  *out = e;
  return MOE_OK;
}

/* d: the export's DLTensor, over t's memory. */
static void describe(DLTensor *d, Export *e, const moe_tensor *t) {
  d->data = t->numel ? t->data : NULL;
  d->device.device_type = t->device.kind == MOE_CUDA ? kDLCUDA : kDLCPU;
  d->device.device_id = t->device.kind == MOE_CUDA ? t->device.index : 0;
  d->ndim = t->ndim;
  d->dtype = dl_dtypes[t->dtype];
  d->shape = e->shape;
  d->strides = e->strides;
  d->byte_offset = 0;
}

int moe_tensor_to_dlpack(moe_ctx *ctx, moe_tensor *t, struct DLManagedTensor **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "to_dlpack: out is NULL");
  *out = NULL;
  Export *e = NULL;
  int rc = export_new(ctx, t, &e);
  if (rc) return rc;
  describe(&e->m.legacy.dl_tensor, e, t);
  e->m.legacy.manager_ctx = e;
  e->m.legacy.deleter = delete_legacy;
  *out = &e->m.legacy;
  return moeI_ok(ctx);
}

int moe_tensor_to_dlpack_versioned(moe_ctx *ctx, moe_tensor *t, struct DLManagedTensorVersioned **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "to_dlpack: out is NULL");
  *out = NULL;
  Export *e = NULL;
  int rc = export_new(ctx, t, &e);
  if (rc) return rc;
  e->m.versioned.version.major = DLPACK_MAJOR_VERSION;
  e->m.versioned.version.minor = DLPACK_MINOR_VERSION;
  e->m.versioned.flags = 0;
  describe(&e->m.versioned.dl_tensor, e, t);
  e->m.versioned.manager_ctx = e;
  e->m.versioned.deleter = delete_versioned;
  *out = &e->m.versioned;
  return moeI_ok(ctx);
}
