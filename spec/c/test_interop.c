/* SPDX-License-Identifier: MIT */
/* test_interop.c -- what other libraries hand moelab, on the CPU through the public API:
 * DLPack imports of every dtype and layout DLPack allows, every refusal (after which the tensor is
 * still the caller's), the producer's deleter called exactly once whatever order the holders let
 * go in, exports and round trips without a copy, a stage on imported tensors; and the checks of
 * moe_world_open_comm that need no GPU.  Exits non-zero when a check fails. */
#include <string.h>

#include "check.h"
#include "moelab.h"
#include "moelab_dlpack.h"

static moe_ctx *ctx;

#define OK(call) CHECK((call) == MOE_OK, "%s", moe_errmsg(ctx))

/* The call fails with code and a message that starts with "<what>: " and contains frag. */
static void check_error(int rc, int code, const char *what, const char *frag, const char *name, int line) {
  const char *msg = moe_errmsg(ctx);
  const size_t n = strlen(what);
  checks++;
  if (rc != code || strncmp(msg, what, n) != 0 || msg[n] != ':' || !strstr(msg, frag)) {
    failures++;
    fprintf(stderr, "%s:%d: %s: want %d and \"%s: ...%s...\", got %d and \"%s\"\n", __FILE__, line, name, code, what,
            frag, rc, msg);
  }
}

/* ---- a producer: one tensor over a buffer of its own, as DLManagedTensor and as
 * DLManagedTensorVersioned, counting each one's deleter calls ---- */

typedef struct Producer {
  DLManagedTensor legacy;
  DLManagedTensorVersioned versioned;
  int64_t shape[8], strides[8];
  union {
    float f[64];
    int32_t i[64];
    uint16_t h[128];
  } buf;
  int deleted, deleted_versioned;
} Producer;

static void count_legacy(DLManagedTensor *self) { ((Producer *)self->manager_ctx)->deleted++; }
static void count_versioned(DLManagedTensorVersioned *self) { ((Producer *)self->manager_ctx)->deleted_versioned++; }

static const DLDataType F32 = {kDLFloat, 32, 1}, BF16 = {kDLBfloat, 16, 1}, I32 = {kDLInt, 32, 1};

/* A producer of a tensor of dtype dt on device type dev, shape[ndim] (NULL shape where
 * null_shape), strides (NULL where not given), its buffer holding 0.5, 1.5, ... (f32), 1, 2, ...
 * (i32) or the bf16 bits 1, 2, ... */
static void produce(Producer *p, DLDataType dt, int32_t dev, int ndim, const int64_t *shape, const int64_t *strides,
                    uint64_t byte_offset) {
  memset(p, 0, sizeof *p);
  for (int i = 0; i < 64; i++) {
    if (dt.code == kDLFloat && dt.bits == 32) p->buf.f[i] = (float)i + 0.5f;
    else p->buf.i[i] = i + 1;
  }
  for (int i = 0; i < ndim && i < 8; i++) {
    if (shape) p->shape[i] = shape[i];
    if (strides) p->strides[i] = strides[i];
  }
  DLTensor d = {p->buf.f, {(DLDeviceType)dev, 0}, ndim, dt, shape ? p->shape : NULL, strides ? p->strides : NULL,
                byte_offset};
  p->legacy.dl_tensor = p->versioned.dl_tensor = d;
  p->legacy.manager_ctx = p->versioned.manager_ctx = p;
  p->legacy.deleter = count_legacy;
  p->versioned.deleter = count_versioned;
  p->versioned.version.major = 1;
}

/* Imports p's legacy (versioned = 0) or versioned tensor. */
static int import(Producer *p, int versioned, moe_tensor **out) {
  return versioned ? moe_tensor_from_dlpack_versioned(ctx, &p->versioned, out) : moe_tensor_from_dlpack(ctx, &p->legacy, out);
}
static int deleted(const Producer *p, int versioned) { return versioned ? p->deleted_versioned : p->deleted; }

#define LIST(...) ((const int64_t[]){__VA_ARGS__})

/* ---- imports that are taken ---- */

static void test_import(void) {
  const struct {
    const char *name;
    DLDataType dt;
    int32_t dev;
    int ndim;
    const int64_t *shape, *strides;
    uint64_t byte_offset;
    moe_dtype want;
    int64_t first; /* element of the buffer (of the dtype's size) where the tensor starts */
    int empty_data;
  } rows[] = {
    {"f32 [2, 3], strides NULL", F32, kDLCPU, 2, LIST(2, 3), NULL, 0, MOE_F32, 0, 0},
    {"f32 [2, 3], compact strides", F32, kDLCPU, 2, LIST(2, 3), LIST(3, 1), 0, MOE_F32, 0, 0},
    {"bf16 [5]", BF16, kDLCPU, 1, LIST(5), LIST(1), 0, MOE_BF16, 0, 0},
    {"i32 [2, 1, 3], any stride on the size-1 dimension", I32, kDLCPU, 3, LIST(2, 1, 3), LIST(3, 99, 1), 0, MOE_I32, 0, 0},
    {"f32 [1, 2, 1, 3], four dimensions", F32, kDLCPU, 4, LIST(1, 2, 1, 3), LIST(6, 3, 3, 1), 0, MOE_F32, 0, 0},
    {"f32, 0 dimensions, shape NULL", F32, kDLCPU, 0, NULL, NULL, 0, MOE_F32, 0, 0},
    {"f32 [0, 5], empty, any strides, data NULL", F32, kDLCPU, 2, LIST(0, 5), LIST(7, 7), 0, MOE_F32, 0, 1},
    {"f32 [3] from byte_offset 8", F32, kDLCPU, 1, LIST(3), NULL, 8, MOE_F32, 2, 0},
    {"bf16 [2] from byte_offset 6 (an odd element)", BF16, kDLCPU, 1, LIST(2), NULL, 6, MOE_BF16, 3, 0},
    {"f32 [4] in pinned host memory (kDLCUDAHost): a cpu tensor", F32, kDLCUDAHost, 1, LIST(4), NULL, 0, MOE_F32, 0, 0},
  };
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
    for (int versioned = 0; versioned < 2; versioned++) {
      Producer p;
      produce(&p, rows[r].dt, rows[r].dev, rows[r].ndim, rows[r].shape, rows[r].strides, rows[r].byte_offset);
      if (rows[r].empty_data) p.legacy.dl_tensor.data = p.versioned.dl_tensor.data = NULL;
      const char *how = versioned ? "versioned" : "legacy";
      moe_tensor *t = NULL;
      const int rc = import(&p, versioned, &t);
      CHECK(rc == MOE_OK && t, "%s (%s): %s", rows[r].name, how, moe_errmsg(ctx));
      if (!t) continue;
      int64_t numel = 1;
      for (int i = 0; i < rows[r].ndim; i++) {
        CHECK(moe_tensor_dim(t, i) == rows[r].shape[i], "%s (%s): dim %d = %lld", rows[r].name, how, i,
              (long long)moe_tensor_dim(t, i));
        numel *= rows[r].shape[i];
      }
      CHECK(moe_tensor_ndim(t) == rows[r].ndim && moe_tensor_dtype(t) == rows[r].want && moe_tensor_numel(t) == numel,
            "%s (%s): ndim %d, dtype %s, numel %lld", rows[r].name, how, moe_tensor_ndim(t),
            moe_dtype_name(moe_tensor_dtype(t)), (long long)moe_tensor_numel(t));
      CHECK(moe_tensor_device(t).kind == MOE_CPU, "%s (%s): on the cpu", rows[r].name, how);
      const size_t es = moe_dtype_size(rows[r].want);
      void *want_data = rows[r].empty_data ? NULL : (char *)p.buf.f + rows[r].first * (int64_t)es;
      CHECK(moe_tensor_data(t) == want_data, "%s (%s): data %p, want %p (no copy, byte_offset honoured)", rows[r].name,
            how, moe_tensor_data(t), want_data);
      if (numel > 0) { /* moelab writes the producer's memory in place */
        OK(moe_tensor_fill(ctx, t, 3));
        const int32_t three = rows[r].want == MOE_I32 ? 3 : 0;
        const float f3 = 3.0f;
        const uint16_t b3 = moe_f32_to_bf16(3.0f);
        for (int64_t i = 0; i < numel; i++) {
          const char *at = (const char *)want_data + i * (int64_t)es;
          const int same = rows[r].want == MOE_F32 ? !memcmp(at, &f3, 4) : rows[r].want == MOE_BF16 ? !memcmp(at, &b3, 2)
                                                                                                  : !memcmp(at, &three, 4);
          CHECK(same, "%s (%s): element %lld not written in place", rows[r].name, how, (long long)i);
        }
        /* the byte before the tensor is the producer's, untouched */
        if (rows[r].first > 0) CHECK(p.buf.h[rows[r].first * (int64_t)es / 2 - 1] != 0, "%s: wrote before data", rows[r].name);
      }
      CHECK(deleted(&p, versioned) == 0, "%s (%s): the deleter ran while the tensor lives", rows[r].name, how);
      moe_tensor_free(t);
      CHECK(deleted(&p, versioned) == 1 && deleted(&p, !versioned) == 0, "%s (%s): deleter calls %d (other %d), want 1",
            rows[r].name, how, deleted(&p, versioned), deleted(&p, !versioned));
    }

  /* a versioned tensor of another minor version, or copied by its producer, is taken */
  Producer p;
  produce(&p, F32, kDLCPU, 1, LIST(4), NULL, 0);
  p.versioned.version.minor = 7;
  p.versioned.flags = DLPACK_FLAG_BITMASK_IS_COPIED;
  moe_tensor *t = NULL;
  OK(moe_tensor_from_dlpack_versioned(ctx, &p.versioned, &t));
  moe_tensor_free(t);
  CHECK(p.deleted_versioned == 1, "version 1.7, copied: deleter calls %d", p.deleted_versioned);
  /* a NULL deleter: nothing to call */
  produce(&p, F32, kDLCPU, 1, LIST(4), NULL, 0);
  p.legacy.deleter = NULL;
  OK(moe_tensor_from_dlpack(ctx, &p.legacy, &t));
  moe_tensor_free(t);
}

/* ---- imports that are refused: each with its message, nothing taken ---- */

static void test_refusals(void) {
  int gpus = 0;
  OK(moe_device_count(ctx, MOE_CUDA, &gpus));
  static const int64_t huge = (int64_t)1 << 21;
  const struct {
    const char *name;
    DLDataType dt;
    int32_t dev, dev_id;
    int ndim;
    const int64_t *shape, *strides;
    uint64_t byte_offset;
    int null_data;
    int code;
    const char *frag;
  } rows[] = {
    {"f64", {kDLFloat, 64, 1}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "dtype code 2, bits 64, lanes 1 is none of moelab's"},
    {"f16", {kDLFloat, 16, 1}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "dtype code 2, bits 16, lanes 1"},
    {"u32", {kDLUInt, 32, 1}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "dtype code 1, bits 32, lanes 1"},
    {"i64", {kDLInt, 64, 1}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "dtype code 0, bits 64, lanes 1"},
    {"bool", {kDLBool, 8, 1}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "dtype code 6, bits 8"},
    {"bf16 of 2 lanes", {kDLBfloat, 16, 2}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "code 4, bits 16, lanes 2"},
    {"f32 of 0 lanes", {kDLFloat, 32, 0}, kDLCPU, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "lanes 0 is none"},
    {"ROCm memory", F32, kDLROCM, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "device type 10 (kDLROCM) is not taken: kDLCPU (1)"},
    {"CUDA managed memory", F32, kDLCUDAManaged, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG,
     "device type 13 (kDLCUDAManaged) is not taken: kDLCPU (1), kDLCUDAHost (3) or kDLCUDA (2); wrap managed memory"},
    {"OpenCL", F32, kDLOpenCL, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "device type 4 (kDLOpenCL)"},
    {"an unknown device type", F32, 99, 0, 1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "device type 99 (unknown)"},
    {"a GPU that does not exist", F32, kDLCUDA, 1000, 1, LIST(4), NULL, 0, 0, gpus ? MOE_ERR_ARG : MOE_ERR_UNSUPPORTED,
     gpus ? "cuda:1000 does not exist" : "cuda:1000 is not available"},
    {"5 dimensions", F32, kDLCPU, 0, 5, LIST(1, 1, 1, 1, 4), NULL, 0, 0, MOE_ERR_ARG, "ndim is 5, moelab takes 0 to 4 dimensions"},
    {"ndim -1", F32, kDLCPU, 0, -1, LIST(4), NULL, 0, 0, MOE_ERR_ARG, "ndim is -1"},
    {"shape NULL", F32, kDLCPU, 0, 2, NULL, NULL, 0, 0, MOE_ERR_ARG, "shape is NULL"},
    {"a negative dimension", F32, kDLCPU, 0, 2, LIST(2, -3), NULL, 0, 0, MOE_ERR_ARG, "dimension 2 is -3, expected >= 0"},
    {"more than 2^40 elements", F32, kDLCPU, 0, 2, LIST(huge, huge), NULL, 0, 0, MOE_ERR_ARG, "more than 2^40 elements"},
    {"transposed", F32, kDLCPU, 0, 2, LIST(3, 2), LIST(1, 3), 0, 0, MOE_ERR_ARG,
     "strides [1, 3] are not the compact row-major ones of shape [3, 2] ([2, 1]): moelab takes contiguous tensors"},
    {"broadcast (stride 0)", F32, kDLCPU, 0, 2, LIST(2, 3), LIST(0, 1), 0, 0, MOE_ERR_ARG, "strides [0, 1] are not"},
    {"every other element", F32, kDLCPU, 0, 2, LIST(2, 3), LIST(6, 2), 0, 0, MOE_ERR_ARG, "strides [6, 2] are not"},
    {"rows apart", F32, kDLCPU, 0, 2, LIST(2, 3), LIST(4, 1), 0, 0, MOE_ERR_ARG, "strides [4, 1] are not"},
    {"data NULL", F32, kDLCPU, 0, 2, LIST(2, 3), NULL, 0, 1, MOE_ERR_ARG, "data is NULL for 6 elements"},
    {"a byte_offset off the dtype's alignment", F32, kDLCPU, 0, 1, LIST(4), NULL, 2, 0, MOE_ERR_ARG,
     "+ byte_offset 2 is not aligned to its dtype f32 (4 bytes)"},
  };
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
    for (int versioned = 0; versioned < 2; versioned++) {
      Producer p;
      produce(&p, rows[r].dt, rows[r].dev, rows[r].ndim, rows[r].shape, rows[r].strides, rows[r].byte_offset);
      p.legacy.dl_tensor.device.device_id = p.versioned.dl_tensor.device.device_id = rows[r].dev_id;
      if (rows[r].null_data) p.legacy.dl_tensor.data = p.versioned.dl_tensor.data = NULL;
      moe_tensor *t = (moe_tensor *)&p; /* must come back NULL */
      char name[160];
      snprintf(name, sizeof name, "%s (%s)", rows[r].name, versioned ? "versioned" : "legacy");
      check_error(import(&p, versioned, &t), rows[r].code, "from_dlpack", rows[r].frag, name, __LINE__);
      CHECK(t == NULL, "%s: a refused import gives NULL", name);
      CHECK(p.deleted == 0 && p.deleted_versioned == 0, "%s: a refused import called the deleter", name);
    }

  /* what only the versioned structure says */
  Producer p;
  moe_tensor *t = NULL;
  const struct {
    const char *name;
    uint32_t major, minor;
    uint64_t flags;
    const char *frag;
  } vrows[] = {
    {"major version 2", 2, 0, 0, "DLPack version 2.0, moelab reads major version 1"},
    {"major version 0", 0, 8, 0, "DLPack version 0.8, moelab reads major version 1"},
    {"read-only", 1, 0, DLPACK_FLAG_BITMASK_READ_ONLY, "the tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY)"},
    {"read-only and copied", 1, 0, DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_COPIED, "is read-only"},
  };
  for (size_t r = 0; r < sizeof vrows / sizeof vrows[0]; r++) {
    produce(&p, F32, kDLCPU, 1, LIST(4), NULL, 0);
    p.versioned.version.major = vrows[r].major, p.versioned.version.minor = vrows[r].minor;
    p.versioned.flags = vrows[r].flags;
    check_error(moe_tensor_from_dlpack_versioned(ctx, &p.versioned, &t), MOE_ERR_ARG, "from_dlpack", vrows[r].frag,
                vrows[r].name, __LINE__);
    CHECK(t == NULL && p.deleted_versioned == 0, "%s: nothing taken", vrows[r].name);
  }
  check_error(moe_tensor_from_dlpack(ctx, NULL, &t), MOE_ERR_ARG, "from_dlpack", "the managed tensor is NULL", "NULL",
              __LINE__);
  check_error(moe_tensor_from_dlpack_versioned(ctx, NULL, &t), MOE_ERR_ARG, "from_dlpack", "the managed tensor is NULL",
              "NULL versioned", __LINE__);
  produce(&p, F32, kDLCPU, 1, LIST(4), NULL, 0);
  check_error(moe_tensor_from_dlpack(ctx, &p.legacy, NULL), MOE_ERR_ARG, "from_dlpack", "out is NULL", "NULL out",
              __LINE__);
  check_error(moe_tensor_from_dlpack_versioned(ctx, &p.versioned, NULL), MOE_ERR_ARG, "from_dlpack", "out is NULL",
              "NULL out versioned", __LINE__);
  CHECK(p.deleted == 0 && p.deleted_versioned == 0, "NULL out: nothing taken");
}

/* ---- exports ---- */

/* The export's fields describe t: its memory, dtype, shape, compact strides, device. */
static void check_export(const char *name, const DLTensor *d, moe_tensor *t) {
  const moe_dtype dt = moe_tensor_dtype(t);
  const DLDataType want = dt == MOE_F32 ? F32 : dt == MOE_BF16 ? BF16 : I32;
  CHECK(d->data == (moe_tensor_numel(t) ? moe_tensor_data(t) : NULL), "%s: data %p, tensor's %p", name, d->data,
        moe_tensor_data(t));
  CHECK(d->byte_offset == 0, "%s: byte_offset %llu", name, (unsigned long long)d->byte_offset);
  CHECK(d->device.device_type == kDLCPU && d->device.device_id == 0, "%s: device %d:%d", name,
        (int)d->device.device_type, (int)d->device.device_id);
  CHECK(d->dtype.code == want.code && d->dtype.bits == want.bits && d->dtype.lanes == want.lanes,
        "%s: dtype %u/%u/%u", name, d->dtype.code, d->dtype.bits, d->dtype.lanes);
  CHECK(d->ndim == moe_tensor_ndim(t) && d->strides && (d->ndim == 0 || d->shape), "%s: ndim %d, shape and strides given",
        name, (int)d->ndim);
  int64_t step = 1;
  for (int i = moe_tensor_ndim(t) - 1; i >= 0 && d->shape && d->strides; i--) {
    CHECK(d->shape[i] == moe_tensor_dim(t, i) && d->strides[i] == step, "%s: shape[%d] %lld, strides[%d] %lld", name, i,
          (long long)d->shape[i], i, (long long)d->strides[i]);
    step *= moe_tensor_dim(t, i);
  }
}

static void test_export(void) {
  const moe_device cpu = {MOE_CPU, 0};
  const moe_dtype dtypes[] = {MOE_F32, MOE_BF16, MOE_I32};
  const struct {
    int ndim;
    int64_t shape[4];
  } shapes[] = {{2, {2, 3}}, {0, {0}}, {4, {2, 1, 3, 2}}, {2, {0, 4}}, {1, {7}}};
  for (int k = 0; k < 3; k++)
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
      moe_tensor *t = NULL;
      OK(moe_tensor_new(ctx, dtypes[k], shapes[s].ndim, shapes[s].shape, cpu, &t));
      char name[64];
      snprintf(name, sizeof name, "export of %s, %d dimensions", moe_dtype_name(dtypes[k]), shapes[s].ndim);
      DLManagedTensor *m = NULL;
      DLManagedTensorVersioned *v = NULL;
      OK(moe_tensor_to_dlpack(ctx, t, &m));
      OK(moe_tensor_to_dlpack_versioned(ctx, t, &v));
      if (m) check_export(name, &m->dl_tensor, t);
      if (v) {
        check_export(name, &v->dl_tensor, t);
        CHECK(v->version.major == 1 && v->version.minor == 0 && v->flags == 0, "%s: version %u.%u, flags %llu", name,
              v->version.major, v->version.minor, (unsigned long long)v->flags);
      }
      CHECK(m && m->deleter && v && v->deleter, "%s: deleters given", name);
      moe_tensor_free(t);
      if (m) m->deleter(m);
      if (v) v->deleter(v);
    }

  /* the export keeps the memory alive after the tensor is freed: its values are still there */
  const float vals[6] = {1, -2, 3.5f, 4, 5, 6};
  moe_tensor *t = NULL;
  OK(moe_tensor_new(ctx, MOE_F32, 2, LIST(2, 3), cpu, &t));
  OK(moe_tensor_write(ctx, t, vals, sizeof vals));
  DLManagedTensor *m = NULL;
  OK(moe_tensor_to_dlpack(ctx, t, &m));
  moe_tensor_free(t);
  CHECK(m && !memcmp(m->dl_tensor.data, vals, sizeof vals), "an export outlives its tensor with the values");
  if (m) m->deleter(m);

  /* a wrapped tensor exports the caller's memory, which the deleter leaves alone */
  float own[6] = {9, 8, 7, 6, 5, 4};
  OK(moe_tensor_wrap(ctx, own, MOE_F32, 1, LIST(6), cpu, &t));
  OK(moe_tensor_to_dlpack(ctx, t, &m));
  moe_tensor_free(t);
  CHECK(m && m->dl_tensor.data == (void *)own, "a wrapped tensor's export points at the caller's memory");
  if (m) m->deleter(m);
  CHECK(own[0] == 9 && own[5] == 4, "the caller's memory is untouched");

  check_error(moe_tensor_to_dlpack(ctx, NULL, &m), MOE_ERR_ARG, "to_dlpack", "the tensor is NULL", "NULL tensor",
              __LINE__);
  CHECK(m == NULL, "a refused export gives NULL");
  OK(moe_tensor_new(ctx, MOE_F32, 1, LIST(2), cpu, &t));
  check_error(moe_tensor_to_dlpack(ctx, t, NULL), MOE_ERR_ARG, "to_dlpack", "out is NULL", "NULL out", __LINE__);
  check_error(moe_tensor_to_dlpack_versioned(ctx, t, NULL), MOE_ERR_ARG, "to_dlpack", "out is NULL", "NULL out", __LINE__);
  moe_tensor_free(t);
}

/* ---- the producer's deleter, exactly once, in every order of letting go ---- */

static void test_lifetimes(void) {
  for (int versioned = 0; versioned < 2; versioned++) {
    const char *how = versioned ? "versioned" : "legacy";
    Producer p;
    /* imported, exported, re-imported: one memory throughout, the producer's */
    for (int order = 0; order < 4; order++) {
      produce(&p, F32, kDLCPU, 2, LIST(2, 3), NULL, 0);
      moe_tensor *t = NULL, *u = NULL, *v = NULL;
      OK(import(&p, versioned, &t));
      if (!t) continue;
      DLManagedTensor *m = NULL;
      DLManagedTensorVersioned *mv = NULL;
      if (versioned) OK(moe_tensor_to_dlpack_versioned(ctx, t, &mv));
      else OK(moe_tensor_to_dlpack(ctx, t, &m));
      OK(versioned ? moe_tensor_from_dlpack_versioned(ctx, mv, &u) : moe_tensor_from_dlpack(ctx, m, &u));
      OK(moe_tensor_view(ctx, t, 2, 1, LIST(3), &v));
      if (!u || !v) continue;
      CHECK(moe_tensor_data(u) == (void *)p.buf.f && moe_tensor_dtype(u) == MOE_F32 && moe_tensor_ndim(u) == 2 &&
                moe_tensor_dim(u, 0) == 2 && moe_tensor_dim(u, 1) == 3 && moe_tensor_device(u).kind == MOE_CPU,
            "%s: the round trip is the same tensor over the same memory", how);
      CHECK(moe_tensor_data(v) == (void *)(p.buf.f + 2), "%s: the view starts at element 2", how);
      /* three holders (t, the view v, the round trip u that holds the export): let go in turn */
      moe_tensor *hold[3] = {t, u, v};
      static const int orders[4][3] = {{0, 1, 2}, {1, 0, 2}, {2, 1, 0}, {0, 2, 1}};
      for (int i = 0; i < 3; i++) {
        CHECK(deleted(&p, versioned) == 0, "%s, order %d: the deleter ran with %d holders left", how, order, 3 - i);
        moe_tensor_free(hold[orders[order][i]]);
      }
      CHECK(deleted(&p, versioned) == 1 && deleted(&p, !versioned) == 0, "%s, order %d: deleter calls %d, want 1", how,
            order, deleted(&p, versioned));
    }
    /* an export the consumer releases before the tensor, and after it */
    for (int first = 0; first < 2; first++) {
      produce(&p, F32, kDLCPU, 1, LIST(4), NULL, 0);
      moe_tensor *t = NULL;
      OK(import(&p, versioned, &t));
      DLManagedTensor *m = NULL;
      OK(moe_tensor_to_dlpack(ctx, t, &m));
      if (!t || !m) continue;
      if (first) m->deleter(m);
      else moe_tensor_free(t);
      CHECK(deleted(&p, versioned) == 0, "%s: one holder left, the deleter ran", how);
      if (first) moe_tensor_free(t);
      else m->deleter(m);
      CHECK(deleted(&p, versioned) == 1, "%s: the last holder gone (export %s), deleter calls %d", how,
            first ? "first" : "last", deleted(&p, versioned));
    }
  }
}

/* ---- a stage on imported tensors: the same bits as on moelab's own ---- */

static void test_stage(void) {
  enum { C = 5, H = 4, F = 3, EL = 2 };
  const moe_device cpu = {MOE_CPU, 0};
  moe_tensor *x = NULL, *gu = NULL, *dn = NULL, *off = NULL, *y = NULL;
  OK(moe_tensor_new(ctx, MOE_BF16, 2, LIST(C, H), cpu, &x));
  OK(moe_tensor_new(ctx, MOE_BF16, 3, LIST(EL, 2 * F, H), cpu, &gu));
  OK(moe_tensor_new(ctx, MOE_BF16, 3, LIST(EL, H, F), cpu, &dn));
  OK(moe_tensor_new(ctx, MOE_I32, 1, LIST(EL + 1), cpu, &off));
  OK(moe_tensor_new(ctx, MOE_BF16, 2, LIST(C, H), cpu, &y));
  OK(moe_tensor_randn(ctx, x, 1, 1.0f));
  OK(moe_tensor_randn(ctx, gu, 2, 0.5f));
  OK(moe_tensor_randn(ctx, dn, 3, 0.5f));
  OK(moe_tensor_write(ctx, off, (const int32_t[]){0, 2, C}, 3 * sizeof(int32_t)));
  moe_experts_args a = {.out = y, .x = x, .offsets = off, .w_gate_up = gu, .w_down = dn};
  OK(moe_experts(ctx, &a));

  /* the same inputs, each passed out through DLPack and back in, and an output in a producer's
   * buffer */
  moe_tensor *in[4] = {x, gu, dn, off}, *back[4] = {NULL};
  for (int i = 0; i < 4; i++) {
    DLManagedTensorVersioned *v = NULL;
    OK(moe_tensor_to_dlpack_versioned(ctx, in[i], &v));
    if (v) OK(moe_tensor_from_dlpack_versioned(ctx, v, &back[i]));
  }
  Producer p;
  produce(&p, BF16, kDLCPU, 2, LIST(C, H), NULL, 0);
  moe_tensor *y2 = NULL;
  OK(moe_tensor_from_dlpack(ctx, &p.legacy, &y2));
  if (back[0] && back[1] && back[2] && back[3] && y2) {
    moe_experts_args b = {.out = y2, .x = back[0], .offsets = back[3], .w_gate_up = back[1], .w_down = back[2]};
    OK(moe_experts(ctx, &b));
    CHECK(!memcmp(p.buf.h, moe_tensor_data(y), C * H * sizeof(uint16_t)),
          "experts over imported tensors wrote the producer's buffer with the same bits");
  }
  for (int i = 0; i < 4; i++) moe_tensor_free(back[i]), moe_tensor_free(in[i]);
  moe_tensor_free(y2), moe_tensor_free(y);
  CHECK(p.deleted == 1, "the output's producer was released once: %d", p.deleted);
}

/* ---- a caller's NCCL communicator: the checks that come before any NCCL call ---- */

static void test_world_comm(void) {
  moe_world *w = (moe_world *)&w; /* must come back NULL */
  int gpus = 0;
  OK(moe_device_count(ctx, MOE_CUDA, &gpus));
  check_error(moe_world_open_comm(ctx, NULL, 0, &w), MOE_ERR_ARG, "world", "the communicator is NULL", "NULL comm",
              __LINE__);
  CHECK(w == NULL, "a refused world is NULL");
  int not_a_comm = 0;
  check_error(moe_world_open_comm(ctx, &not_a_comm, -1, &w), MOE_ERR_ARG, "world", "device must be a GPU index >= 0, got -1",
              "device -1", __LINE__);
  check_error(moe_world_open_comm(ctx, &not_a_comm, 0, NULL), MOE_ERR_ARG, "world", "out is NULL", "NULL out", __LINE__);
  /* without a GPU no NCCL call is made (a GPU would hand not_a_comm to NCCL: the GPU test has it) */
  if (gpus == 0) {
    const int rc = moe_world_open_comm(ctx, &not_a_comm, 0, &w);
    const char *msg = moe_errmsg(ctx);
    CHECK(rc == MOE_ERR_UNSUPPORTED && w == NULL &&
              (strstr(msg, "built without") || strstr(msg, "no usable GPU")),
          "without a GPU: %d, %s", rc, msg);
  }
}

int main(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) return 2;
  test_import();
  test_refusals();
  test_export();
  test_lifetimes();
  test_stage();
  test_world_comm();
  moe_ctx_close(ctx);
  if (failures) {
    fprintf(stderr, "test_interop: %d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("test_interop: %d checks passed\n", checks);
  return 0;
}
