/* SPDX-License-Identifier: MIT */
/* core.c -- version, errors, context, tensors. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fp8_math.h"
#include "internal.h"
#include "moelab_dlpack.h"

int moe_libversion_number(void) { return MOE_VERSION_NUMBER; }
const char *moe_libversion(void) { return MOE_VERSION; }

const char *moe_errstr(int code) {
  switch (code) {
  case MOE_OK: return "not an error";
  case MOE_ERR_ARG: return "bad argument";
  case MOE_ERR_NOMEM: return "out of memory";
  case MOE_ERR_CUDA: return "CUDA error";
  case MOE_ERR_UNSUPPORTED: return "not supported in this build or on this device";
  case MOE_ERR_INTERNAL: return "internal error";
  case MOE_ERR_IO: return "cannot read a file, or it is malformed";
  default: return "unknown error code";
  }
}

int moeI_seterr(moe_ctx *ctx, int code, const char *fmt, ...) {
  if (ctx) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->errmsg, sizeof ctx->errmsg, fmt, ap);
    va_end(ap);
  }
  return code;
}

int moeI_ok(moe_ctx *ctx) {
  if (ctx) ctx->errmsg[0] = '\0';
  return MOE_OK;
}

/* The options of moe_ctx_config, indexed by MOEI_CFG_*: name, environment variable, the valid
 * values besides "auto" (a stage's kernel names), and what "auto" is called when read back. */
static const struct config_option {
  const char *name, *env;
  const char *(*kernels)(void);
  const char *dflt;
} config_options[MOEI_CFG_COUNT] = {
  [MOEI_CFG_SCHEDULE_KERNEL] = {"schedule_kernel", "MOE_SCHEDULE_KERNEL", moeI_schedule_kernels, "auto"},
  [MOEI_CFG_EXPERTS_KERNEL] = {"experts_kernel", "MOE_EXPERTS_KERNEL", moeI_experts_kernels, "auto"},
  [MOEI_CFG_EXPERTS_FP8_KERNEL] = {"experts_fp8_kernel", "MOE_EXPERTS_FP8_KERNEL", moeI_experts_fp8_kernels, "auto"},
  [MOEI_CFG_LOGITS] = {"logits", "MOE_LOGITS", moeI_logits_paths, "tensor"},
};

/* Is name one of the ", "-separated names of list? */
static int listed(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    size_t len = strcspn(p, ",");
    if (len == n && strncmp(p, name, n) == 0) return 1;
    p += len;
    while (*p == ',' || *p == ' ') p++;
  }
  return 0;
}

static int config_set(moe_ctx *ctx, int option, const char *value) {
  const struct config_option *o = &config_options[option];
  if (strcmp(value, "auto") == 0 || value[0] == '\0' || strcmp(value, o->dflt) == 0) {
    ctx->config[option][0] = '\0';
    return moeI_ok(ctx);
  }
  const char *kernels = o->kernels();
  if (!kernels[0])
    return moeI_seterr(ctx, MOE_ERR_ARG, "config: %s \"%s\": this build has no GPU kernels (only \"auto\")", o->name,
                       value);
  if (!listed(kernels, value))
    return moeI_seterr(ctx, MOE_ERR_ARG, "config: %s must be auto or one of %s, got \"%s\"", o->name, kernels, value);
  snprintf(ctx->config[option], MOEI_CFG_LEN, "%s", value); /* a listed name fits */
  return moeI_ok(ctx);
}

int moe_ctx_config(moe_ctx *ctx, const char *option, const char *value) {
  if (!ctx) return MOE_ERR_ARG;
  if (!option || !value) return moeI_seterr(ctx, MOE_ERR_ARG, "config: option and value must not be NULL");
  for (int i = 0; i < MOEI_CFG_COUNT; i++)
    if (strcmp(option, config_options[i].name) == 0) return config_set(ctx, i, value);
  char names[128] = "";
  for (int i = 0; i < MOEI_CFG_COUNT; i++)
    snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", config_options[i].name);
  return moeI_seterr(ctx, MOE_ERR_ARG, "config: no option \"%s\" (%s)", option, names);
}

const char *moe_ctx_config_value(const moe_ctx *ctx, const char *option) {
  if (!ctx || !option) return NULL;
  for (int i = 0; i < MOEI_CFG_COUNT; i++)
    if (strcmp(option, config_options[i].name) == 0) return moeI_config(ctx, i);
  return NULL;
}

const char *moeI_config(const moe_ctx *ctx, int option) {
  return ctx->config[option][0] ? ctx->config[option] : config_options[option].dflt;
}

int moeI_check_report(moe_ctx *ctx, const char *stage, const char *report, size_t n) {
  if (!report || n == 0) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: report must hold at least one byte", stage);
  return MOE_OK;
}

int moeI_explain_cpu(moe_ctx *ctx, char *report, size_t n) {
  snprintf(report, n, "cpu\ncpu: runs (the tensors are on the CPU: the reference backend)\n");
  return moeI_ok(ctx);
}

int moe_ctx_open(moe_ctx **out) {
  if (!out) return MOE_ERR_ARG;
  moe_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return MOE_ERR_NOMEM;
  /* The environment feeds the options once, here.  A value the options refuse is kept as given
   * (truncated to fit), so that the stage it forces fails with the list of valid names instead
   * of the context failing to open. */
  for (int i = 0; i < MOEI_CFG_COUNT; i++) {
    const char *v = getenv(config_options[i].env);
    if (v && config_set(ctx, i, v) != MOE_OK) snprintf(ctx->config[i], MOEI_CFG_LEN, "%s", v);
  }
  ctx->errmsg[0] = '\0';
  *out = ctx;
  /* A thread count that cannot be read is refused here, where the message has a context to live
   * in, rather than ignored by every threaded stage later. */
  if (moeI_env_threads() < 0)
    return moeI_seterr(ctx, MOE_ERR_ARG, "MOE_THREADS must be an integer from 1 to %d (the CPU backend's threads), "
                       "got \"%.64s\"; unset it for the online CPUs (at most 64)", MOEI_MAX_THREADS,
                       getenv("MOE_THREADS"));
  return MOE_OK;
}

void moe_ctx_close(moe_ctx *ctx) {
  if (!ctx) return;
  moeI_cuda_scratch_release(ctx);
  if (ctx->owns_stream) moeI_cuda_ctx_release(ctx);
  free(ctx);
}

const char *moe_errmsg(const moe_ctx *ctx) {
  if (!ctx) return moe_errstr(MOE_ERR_NOMEM);
  return ctx->errmsg;
}

int moe_ctx_set_stream(moe_ctx *ctx, void *stream) {
  if (!ctx) return MOE_ERR_ARG;
  if (ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "set_stream: not during a graph capture");
  if (ctx->owns_stream) moeI_cuda_ctx_release(ctx);
  ctx->stream = stream;
  ctx->stream_device = -1; /* not known for a caller's stream; a world's bind sets it */
  return moeI_ok(ctx);
}

void *moe_ctx_stream(const moe_ctx *ctx) { return ctx ? ctx->stream : NULL; }

int moe_device_count(moe_ctx *ctx, int kind, int *count) {
  if (!count) return moeI_seterr(ctx, MOE_ERR_ARG, "device_count: count is NULL");
  if (kind == MOE_CPU) {
    *count = 1;
    return moeI_ok(ctx);
  }
  if (kind != MOE_CUDA) return moeI_seterr(ctx, MOE_ERR_ARG, "device_count: unknown device kind %d", kind);
  if (moeI_cuda_device_count(count) != MOE_OK) *count = 0;
  return moeI_ok(ctx);
}

/* ---- tensors ---- */

size_t moe_dtype_size(moe_dtype dtype) {
  switch (dtype) {
  case MOE_F32: return 4;
  case MOE_BF16: return 2;
  case MOE_I32: return 4;
  case MOE_E4M3: return 1;
  }
  return 0;
}

const char *moe_dtype_name(moe_dtype dtype) {
  switch (dtype) {
  case MOE_F32: return "f32";
  case MOE_BF16: return "bf16";
  case MOE_I32: return "i32";
  case MOE_E4M3: return "e4m3";
  }
  return "?";
}

static int check_device(moe_ctx *ctx, const char *stage, moe_device device) {
  if (device.kind == MOE_CPU) return MOE_OK;
  if (device.kind != MOE_CUDA) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: unknown device kind %d", stage, device.kind);
  int n = 0;
  if (moeI_cuda_device_count(&n) != MOE_OK || n == 0)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "%s: cuda:%d is not available (%s)", stage, device.index,
                      n == 0 ? "no usable GPU in this build or on this machine" : "CUDA error");
  if (device.index < 0 || device.index >= n)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: cuda:%d does not exist (%d GPU%s visible)", stage, device.index, n,
                      n == 1 ? "" : "s");
  return MOE_OK;
}
int moeI_check_device(moe_ctx *ctx, const char *stage, moe_device device) { return check_device(ctx, stage, device); }

int moe_ctx_synchronize(moe_ctx *ctx, moe_device device) {
  int rc = check_device(ctx, "synchronize", device); /* no GPU: UNSUPPORTED, as every other call says */
  if (rc || device.kind == MOE_CPU) return rc ? rc : moeI_ok(ctx);
  return moeI_cuda_synchronize(ctx, device.index);
}

int moeI_check_layout(moe_ctx *ctx, const char *what, moe_dtype dtype, int ndim, const int64_t *shape,
                      int64_t *numel) {
  if (dtype != MOE_F32 && dtype != MOE_BF16 && dtype != MOE_I32 && dtype != MOE_E4M3)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: unknown dtype %d", what, (int)dtype);
  if (ndim < 0 || ndim > MOE_MAX_DIMS)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %d dimensions, expected 0 to %d", what, ndim, MOE_MAX_DIMS);
  if (ndim > 0 && !shape) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: shape is NULL", what);
  /* span: the product of the non-zero dimensions, bounded like a size even where a zero makes the
   * tensor empty, so that no stage's arithmetic on an empty tensor's other dimensions overflows */
  int64_t n = 1, span = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: dimension %d is %lld, expected >= 0", what, i + 1, (long long)shape[i]);
    if (shape[i] > 0 && span > ((int64_t)1 << 40) / shape[i])
      return moeI_seterr(ctx, MOE_ERR_ARG, "%s: more than 2^40 elements (the dimensions other than 0 multiplied)", what);
    if (shape[i] > 0) span *= shape[i];
    n *= shape[i];
  }
  *numel = n;
  return MOE_OK;
}

/* ---- storage: the memory behind tensors, counted, so that views and DLPack exports keep it
 * alive whatever order their holders let go in ---- */

struct moe_storage {
  atomic_int refs;
  moe_device device;
  void *alloc;   /* moelab's allocation, where managed is NULL */
  void *managed; /* a DLPack producer's DLManagedTensor (or ...Versioned), given back by its deleter */
  int versioned;
};

void moeI_storage_hold(moe_storage *s) {
  if (s) atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
}

void moeI_storage_release(moe_storage *s) {
  /* acq_rel: the last holder sees every other holder's writes before the memory goes */
  if (!s || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
  if (s->managed && s->versioned) {
    DLManagedTensorVersioned *m = s->managed;
    if (m->deleter) m->deleter(m);
  } else if (s->managed) {
    DLManagedTensor *m = s->managed;
    if (m->deleter) m->deleter(m);
  } else if (s->device.kind == MOE_CPU) {
    free(s->alloc);
  } else {
    moeI_cuda_free(s->device.index, s->alloc);
  }
  free(s);
}

moe_storage *moeI_storage_adopt(void *managed, int versioned) {
  moe_storage *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  atomic_init(&s->refs, 1);
  s->managed = managed;
  s->versioned = versioned;
  return s;
}

static moe_tensor *tensor_header(moe_dtype dtype, int ndim, const int64_t *shape, int64_t numel, moe_device device) {
  moe_tensor *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->numel = numel;
  t->device = device;
  return t;
}

int moe_tensor_new(moe_ctx *ctx, moe_dtype dtype, int ndim, const int64_t *shape, moe_device device,
                   moe_tensor **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "tensor: out is NULL");
  *out = NULL;
  int64_t numel;
  int rc = moeI_check_layout(ctx, "tensor", dtype, ndim, shape, &numel);
  if (rc) return rc;
  rc = check_device(ctx, "tensor", device);
  if (rc) return rc;
  moe_tensor *t = tensor_header(dtype, ndim, shape, numel, device);
  moe_storage *s = calloc(1, sizeof *s);
  if (!t || !s) {
    free(t), free(s);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "tensor: out of host memory");
  }
  size_t nbytes = (size_t)numel * moe_dtype_size(dtype);
  if (device.kind == MOE_CPU) {
    /* zeroed, and never a NULL data pointer, even for an empty tensor */
    s->alloc = calloc(nbytes ? nbytes : 1, 1);
    if (!s->alloc) {
      free(t), free(s);
      return moeI_seterr(ctx, MOE_ERR_NOMEM, "tensor: out of host memory (%zu bytes)", nbytes);
    }
  } else {
    rc = moeI_cuda_alloc(ctx, device.index, nbytes ? nbytes : 16, &s->alloc);
    if (rc) {
      free(t), free(s);
      return rc;
    }
  }
  atomic_init(&s->refs, 1);
  s->device = device;
  t->data = s->alloc;
  t->storage = s;
  *out = t;
  return moeI_ok(ctx);
}

int moeI_tensor_wrap(moe_ctx *ctx, const char *what, void *data, moe_dtype dtype, int ndim, const int64_t *shape,
                     moe_device device, moe_tensor **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "%s: out is NULL", what);
  *out = NULL;
  int64_t numel;
  int rc = moeI_check_layout(ctx, what, dtype, ndim, shape, &numel);
  if (rc) return rc;
  rc = check_device(ctx, what, device);
  if (rc) return rc;
  size_t align = moe_dtype_size(dtype);
  if (!data && numel > 0)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: data is NULL for %lld elements", what, (long long)numel);
  /* the kernels load elements (and vectors of them) at their natural alignment */
  if ((uintptr_t)data % align)
    return moeI_seterr(ctx, MOE_ERR_ARG, "%s: data %p is not aligned to its dtype %s (%zu bytes)", what, data,
                       moe_dtype_name(dtype), align);
  moe_tensor *t = tensor_header(dtype, ndim, shape, numel, device);
  if (!t) return moeI_seterr(ctx, MOE_ERR_NOMEM, "%s: out of host memory", what);
  t->data = data;
  *out = t;
  return moeI_ok(ctx);
}

int moe_tensor_wrap(moe_ctx *ctx, void *data, moe_dtype dtype, int ndim, const int64_t *shape, moe_device device,
                    moe_tensor **out) {
  return moeI_tensor_wrap(ctx, "wrap", data, dtype, ndim, shape, device, out);
}

int moe_tensor_view(moe_ctx *ctx, moe_tensor *base, int64_t offset, int ndim, const int64_t *shape,
                    moe_tensor **out) {
  if (!out || !base) return moeI_seterr(ctx, MOE_ERR_ARG, "view: NULL argument");
  *out = NULL;
  if (ndim < 0 || ndim > MOE_MAX_DIMS || (ndim > 0 && !shape))
    return moeI_seterr(ctx, MOE_ERR_ARG, "view: %d dimensions, expected 0 to %d", ndim, MOE_MAX_DIMS);
  int64_t numel = 1, span = 1; /* span: as in moe_tensor_new */
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return moeI_seterr(ctx, MOE_ERR_ARG, "view: dimension %d is %lld, expected >= 0", i + 1, (long long)shape[i]);
    /* a product past the base's elements is refused below; stop before it can overflow */
    if (shape[i] > 0 && span > ((int64_t)1 << 40) / shape[i]) {
      char b[160];
      return moeI_seterr(ctx, MOE_ERR_ARG, "view: more than 2^40 elements (the dimensions other than 0 multiplied) "
                        "of %s", moeI_tensor_describe(base, b, sizeof b));
    }
    if (shape[i] > 0) span *= shape[i];
    numel *= shape[i];
  }
  if (offset < 0 || offset > base->numel || numel > base->numel - offset) {
    char b[160];
    if (offset > INT64_MAX - numel) /* the end would not fit an int64 (numel <= 2^40, offset any) */
      return moeI_seterr(ctx, MOE_ERR_ARG, "view: elements from %lld on lie outside %s", (long long)offset,
                        moeI_tensor_describe(base, b, sizeof b));
    return moeI_seterr(ctx, MOE_ERR_ARG, "view: elements [%lld, %lld) lie outside %s", (long long)offset,
                      (long long)(offset + numel), moeI_tensor_describe(base, b, sizeof b));
  }
  moe_tensor *t = calloc(1, sizeof *t);
  if (!t) return moeI_seterr(ctx, MOE_ERR_NOMEM, "view: out of host memory");
  *t = *base;
  t->ndim = ndim;
  for (int i = 0; i < MOE_MAX_DIMS; i++) t->shape[i] = i < ndim ? shape[i] : 0;
  t->numel = numel;
  t->data = (char *)base->data + (size_t)offset * moe_dtype_size(base->dtype);
  moeI_storage_hold(t->storage); /* base may go first */
  *out = t;
  return moeI_ok(ctx);
}

void moe_tensor_free(moe_tensor *t) {
  if (!t) return;
  moeI_storage_release(t->storage);
  free(t);
}

moe_dtype moe_tensor_dtype(const moe_tensor *t) { return t->dtype; }
int moe_tensor_ndim(const moe_tensor *t) { return t->ndim; }
int64_t moe_tensor_dim(const moe_tensor *t, int i) { return (i >= 0 && i < t->ndim) ? t->shape[i] : 1; }
int64_t moe_tensor_numel(const moe_tensor *t) { return t->numel; }
size_t moe_tensor_nbytes(const moe_tensor *t) { return (size_t)t->numel * moe_dtype_size(t->dtype); }
moe_device moe_tensor_device(const moe_tensor *t) { return t->device; }
void *moe_tensor_data(moe_tensor *t) { return t->data; }

uint16_t moe_f32_to_bf16(float x) { return f32_to_bf16(x); }
float moe_bf16_to_f32(uint16_t x) { return bf16_to_f32(x); }
uint8_t moe_f32_to_e4m3(float x) { return moeI_f32_to_e4m3(x); }

const char *moeI_tensor_describe(const moe_tensor *t, char *buf, size_t n) {
  if (!t) {
    snprintf(buf, n, "nothing");
    return buf;
  }
  size_t len = (size_t)snprintf(buf, n, "%s [", moe_dtype_name(t->dtype));
  for (int i = 0; i < t->ndim && len < n; i++)
    len += (size_t)snprintf(buf + len, n - len, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
  if (len < n) {
    if (t->device.kind == MOE_CPU) snprintf(buf + len, n - len, "] on cpu");
    else snprintf(buf + len, n - len, "] on cuda:%d", t->device.index);
  }
  return buf;
}

int moeI_check_tensor(moe_ctx *ctx, const char *stage, const char *what, const moe_tensor *t, moe_dtype dtype,
                     int ndim, const int64_t *shape) {
  char want[160], got[160];
  int ok = t && t->dtype == dtype && (ndim < 0 || t->ndim == ndim);
  for (int i = 0; ok && ndim > 0 && shape && i < ndim; i++)
    if (shape[i] >= 0 && t->shape[i] != shape[i]) ok = 0;
  if (ok) return MOE_OK;
  size_t len = (size_t)snprintf(want, sizeof want, "%s", moe_dtype_name(dtype));
  if (ndim >= 0) {
    len += (size_t)snprintf(want + len, sizeof want - len, " [");
    for (int i = 0; i < ndim && len < sizeof want; i++) {
      if (shape && shape[i] >= 0)
        len += (size_t)snprintf(want + len, sizeof want - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
      else
        len += (size_t)snprintf(want + len, sizeof want - len, "%s_", i ? ", " : "");
    }
    if (len < sizeof want) snprintf(want + len, sizeof want - len, "]");
  }
  return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s must be %s, got %s", stage, what, want,
                    moeI_tensor_describe(t, got, sizeof got));
}

static int on_device(const moe_tensor *t, moe_device dev) {
  return t->device.kind == dev.kind && (dev.kind == MOE_CPU || t->device.index == dev.index);
}

/* "<stage>: <what> must be on <dev>, where <ref> is, got <t>" */
static int device_error(moe_ctx *ctx, const char *stage, const char *what, const char *ref, moe_device dev,
                        const moe_tensor *t) {
  char want[32], got[160];
  if (dev.kind == MOE_CPU) snprintf(want, sizeof want, "cpu");
  else snprintf(want, sizeof want, "cuda:%d", dev.index);
  return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s must be on %s, where %s is, got %s", stage, what, want, ref,
                    moeI_tensor_describe(t, got, sizeof got));
}

int moeI_check_same_device(moe_ctx *ctx, const char *stage, const char *ref, moe_device dev,
                          const moe_tensor *const *ts, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (ts[i] && !on_device(ts[i], dev)) return device_error(ctx, stage, names[i], ref, dev, ts[i]);
  return MOE_OK;
}

int moeI_check_same_device_list(moe_ctx *ctx, const char *stage, const char *ref, moe_device dev,
                               const moe_tensor *const *list, int n, const char *what) {
  char name[96];
  for (int r = 0; r < n; r++)
    if (list[r] && !on_device(list[r], dev)) {
      snprintf(name, sizeof name, "%s of rank %d", what, r);
      return device_error(ctx, stage, name, ref, dev, list[r]);
    }
  return MOE_OK;
}

/* Whether two tensors on one device share any byte. */
static int overlap(const moe_tensor *x, const moe_tensor *y) {
  if (!x || !y || !x->numel || !y->numel) return 0;
  uintptr_t a = (uintptr_t)x->data, b = (uintptr_t)y->data;
  return a < b + moe_tensor_nbytes(y) && b < a + moe_tensor_nbytes(x);
}

int moeI_check_no_overlap(moe_ctx *ctx, const char *stage, const moe_tensor *const *ts, const char *const *names,
                         int nout, int n) {
  for (int i = 0; i < nout; i++)
    for (int j = i + 1; j < n; j++)
      if (overlap(ts[i], ts[j]))
        return moeI_seterr(ctx, MOE_ERR_ARG, "%s: %s and %s share memory; outputs must not overlap other arguments",
                          stage, names[i], names[j]);
  return MOE_OK;
}

int moeI_check_no_overlap_list(moe_ctx *ctx, const char *stage, const moe_tensor *out, const char *out_name,
                              const moe_tensor *const *list, int n, const char *what) {
  for (int r = 0; r < n; r++)
    if (overlap(out, list[r]))
      return moeI_seterr(ctx, MOE_ERR_ARG,
                        "%s: %s and %s of rank %d share memory; outputs must not overlap other arguments",
                        stage, out_name, what, r);
  return MOE_OK;
}

/* ---- data movement ---- */

int moe_tensor_write(moe_ctx *ctx, moe_tensor *t, const void *host, size_t nbytes) {
  if (!t || (!host && nbytes)) return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_write: NULL argument");
  if (nbytes != moe_tensor_nbytes(t))
    return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_write: %zu bytes given, the tensor holds %zu", nbytes, moe_tensor_nbytes(t));
  if (!nbytes) return moeI_ok(ctx);
  if (t->device.kind == MOE_CPU) {
    memcpy(t->data, host, nbytes);
    return moeI_ok(ctx);
  }
  moe_device cpu = {MOE_CPU, 0};
  return moeI_cuda_memcpy(ctx, t->device, t->data, cpu, host, nbytes);
}

int moe_tensor_read(moe_ctx *ctx, const moe_tensor *t, void *host, size_t nbytes) {
  if (!t || (!host && nbytes)) return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_read: NULL argument");
  if (nbytes != moe_tensor_nbytes(t))
    return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_read: %zu bytes asked, the tensor holds %zu", nbytes, moe_tensor_nbytes(t));
  if (!nbytes) return moeI_ok(ctx);
  if (t->device.kind == MOE_CPU) {
    memcpy(host, t->data, nbytes);
    return moeI_ok(ctx);
  }
  moe_device cpu = {MOE_CPU, 0};
  return moeI_cuda_memcpy(ctx, cpu, host, t->device, t->data, nbytes);
}

int moe_tensor_copy(moe_ctx *ctx, moe_tensor *dst, const moe_tensor *src) {
  if (!dst || !src) return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_copy: NULL tensor");
  if (dst->dtype != src->dtype || dst->numel != src->numel) {
    char a[160], b[160];
    return moeI_seterr(ctx, MOE_ERR_ARG, "tensor_copy: cannot copy %s into %s", moeI_tensor_describe(src, a, sizeof a),
                      moeI_tensor_describe(dst, b, sizeof b));
  }
  size_t nbytes = moe_tensor_nbytes(src);
  if (!nbytes || dst == src) return moeI_ok(ctx);
  if (dst->device.kind == MOE_CPU && src->device.kind == MOE_CPU) {
    memmove(dst->data, src->data, nbytes);
    return moeI_ok(ctx);
  }
  return moeI_cuda_memcpy(ctx, dst->device, dst->data, src->device, src->data, nbytes);
}

int moe_tensor_fill(moe_ctx *ctx, moe_tensor *t, double value) {
  if (!t) return moeI_seterr(ctx, MOE_ERR_ARG, "fill: NULL tensor");
  if (t->dtype == MOE_I32 && (value != floor(value) || value < -2147483648.0 || value > 2147483647.0))
    return moeI_seterr(ctx, MOE_ERR_ARG, "fill: %.17g is not an i32 value", value);
  if (t->device.kind != MOE_CPU) return moeI_cuda_fill(ctx, t, value);
  if (t->dtype == MOE_F32) {
    float v = (float)value, *p = t->data;
    for (int64_t i = 0; i < t->numel; i++) p[i] = v;
  } else if (t->dtype == MOE_BF16) {
    uint16_t v = f32_to_bf16((float)value), *p = t->data;
    for (int64_t i = 0; i < t->numel; i++) p[i] = v;
  } else if (t->dtype == MOE_E4M3) {
    memset(t->data, moeI_f32_to_e4m3((float)value), (size_t)t->numel);
  } else {
    int32_t v = (int32_t)value, *p = t->data;
    for (int64_t i = 0; i < t->numel; i++) p[i] = v;
  }
  return moeI_ok(ctx);
}

int moe_tensor_randn(moe_ctx *ctx, moe_tensor *t, uint64_t seed, float std) {
  if (!t) return moeI_seterr(ctx, MOE_ERR_ARG, "randn: NULL tensor");
  if (t->dtype != MOE_F32 && t->dtype != MOE_BF16)
    return moeI_seterr(ctx, MOE_ERR_ARG, "randn: dtype must be f32 or bf16, got %s", moe_dtype_name(t->dtype));
  if (!isfinite(std) || std < 0.0f)
    return moeI_seterr(ctx, MOE_ERR_ARG, "randn: std must be finite and >= 0, got %g", (double)std);
  if (t->device.kind != MOE_CPU) return moeI_cuda_randn(ctx, t, seed, std);
  for (int64_t i = 0; i < t->numel; i++) {
    /* two separately rounded multiplies, as the CUDA fill does them; the build turns off
       floating-point contraction so that no fused multiply-add changes the bits */
    float unit = (float)moeI_randn_units(seed, (uint64_t)i) * MOE_RANDN_UNIT;
    float v = unit * std;
    if (t->dtype == MOE_F32) ((float *)t->data)[i] = v;
    else ((uint16_t *)t->data)[i] = f32_to_bf16(v);
  }
  return moeI_ok(ctx);
}

/* ---- graphs and events ---- */

int moe_graph_begin(moe_ctx *ctx, moe_device device) {
  if (!ctx) return MOE_ERR_ARG;
  if (device.kind != MOE_CUDA)
    return moeI_seterr(ctx, MOE_ERR_UNSUPPORTED, "graph: CUDA graphs need a cuda device, got cpu");
  if (ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "graph: a capture is already under way");
  return moeI_cuda_graph_begin(ctx, device.index);
}

int moe_graph_end(moe_ctx *ctx, moe_graph **out) {
  if (!ctx || !out) return moeI_seterr(ctx, MOE_ERR_ARG, "graph: NULL argument");
  if (!ctx->capturing) return moeI_seterr(ctx, MOE_ERR_ARG, "graph: no capture under way");
  return moeI_cuda_graph_end(ctx, out);
}

int moe_graph_replay(moe_ctx *ctx, moe_graph *graph) {
  if (!ctx || !graph) return moeI_seterr(ctx, MOE_ERR_ARG, "graph: NULL argument");
  return moeI_cuda_graph_replay(ctx, graph);
}

void moe_graph_free(moe_graph *graph) {
  if (graph) moeI_cuda_graph_free(graph);
}

static double host_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

int moe_event_new(moe_ctx *ctx, moe_device device, moe_event **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "event: out is NULL");
  *out = NULL;
  int rc = check_device(ctx, "event", device);
  if (rc) return rc;
  moe_event *e = calloc(1, sizeof *e);
  if (!e) return moeI_seterr(ctx, MOE_ERR_NOMEM, "event: out of host memory");
  e->device = device;
  if (device.kind == MOE_CUDA && (rc = moeI_cuda_event_new(ctx, device.index, &e->event)) != MOE_OK) {
    free(e);
    return rc;
  }
  *out = e;
  return moeI_ok(ctx);
}

int moe_event_record(moe_ctx *ctx, moe_event *e) {
  if (!e) return moeI_seterr(ctx, MOE_ERR_ARG, "event: NULL event");
  if (e->device.kind == MOE_CPU) {
    e->host_ms = host_ms();
    e->recorded = 1;
    return moeI_ok(ctx);
  }
  return moeI_cuda_event_record(ctx, e->event);
}

int moe_event_elapsed(moe_ctx *ctx, const moe_event *start, const moe_event *stop, float *ms) {
  if (!start || !stop || !ms) return moeI_seterr(ctx, MOE_ERR_ARG, "event: NULL argument");
  if (start->device.kind != stop->device.kind || start->device.index != stop->device.index)
    return moeI_seterr(ctx, MOE_ERR_ARG, "event: start and stop are on different devices");
  if (start->device.kind == MOE_CPU) {
    /* as cudaEventElapsedTime refuses an event never recorded, rather than a meaningless time */
    if (!start->recorded || !stop->recorded)
      return moeI_seterr(ctx, MOE_ERR_ARG, "event: %s was never recorded", start->recorded ? "stop" : "start");
    *ms = (float)(stop->host_ms - start->host_ms);
    return moeI_ok(ctx);
  }
  return moeI_cuda_event_elapsed(ctx, start->event, stop->event, ms);
}

void moe_event_free(moe_event *e) {
  if (!e) return;
  if (e->device.kind == MOE_CUDA) moeI_cuda_event_free(e->event);
  free(e);
}
