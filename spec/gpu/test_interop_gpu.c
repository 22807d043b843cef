/* SPDX-License-Identifier: MIT */
/* test_interop_gpu.c -- DLPack and wrapped memory on a GPU, through the public API only: exports of
 * cuda tensors name kDLCUDA and their GPU; round trips keep the device and the memory; a producer's
 * cudaMalloc'd tensors (counting deleters) become cuda tensors over that memory, on which experts
 * gives the bits it gives on moelab's own; pinned host memory (kDLCUDAHost) is a cpu tensor; a GPU
 * that does not exist is refused.  One PASS/FAIL line per check; exits 77 without a GPU. */
#include <string.h>

#include <cuda_runtime.h>

#include "gpu_test.h"
#include "moelab_dlpack.h"

/* A producer's tensor in memory it allocated (cudaMalloc, or cudaMallocHost for pinned memory),
 * freed by its deleter, which counts its calls. */
typedef struct Producer {
  DLManagedTensor m;
  int64_t shape[4];
  int pinned, deleted;
} Producer;

static void producer_delete(DLManagedTensor *self) {
  Producer *p = self->manager_ctx;
  if (p->pinned) cudaFreeHost(self->dl_tensor.data);
  else cudaFree(self->dl_tensor.data);
  p->deleted++;
}

static void produce(Producer *p, DLDataType dt, size_t elem, int ndim, const int64_t *shape, int pinned, int device) {
  memset(p, 0, sizeof *p);
  size_t n = elem;
  for (int i = 0; i < ndim; i++) p->shape[i] = shape[i], n *= (size_t)shape[i];
  void *data = NULL;
  if (pinned ? cudaMallocHost(&data, n) : (cudaSetDevice(device), cudaMalloc(&data, n))) {
    printf("FAIL cannot allocate %zu bytes\n", n);
    exit(1);
  }
  p->pinned = pinned;
  DLTensor d = {data, {pinned ? kDLCUDAHost : kDLCUDA, pinned ? 0 : device}, ndim, dt, p->shape, NULL, 0};
  p->m.dl_tensor = d;
  p->m.manager_ctx = p;
  p->m.deleter = producer_delete;
}

/* The bytes of t, on the host (malloc'd). */
static void *bytes_of(const moe_tensor *t) {
  size_t n = moe_tensor_nbytes(t);
  void *h = malloc(n ? n : 1);
  if (!h) exit(1);
  TRY(moe_tensor_read(ctx, t, h, n));
  return h;
}

static void round_trips(int gpus) {
  for (int g = 0; g < gpus && g < 2; g++) {
    const moe_device d = {MOE_CUDA, g};
    moe_tensor *t = NEW(MOE_BF16, d, 4, 8);
    TRY(moe_tensor_randn(ctx, t, 1, 1.0f));
    void *want = bytes_of(t);
    DLManagedTensorVersioned *v = NULL;
    TRY(moe_tensor_to_dlpack_versioned(ctx, t, &v));
    const DLTensor *dl = &v->dl_tensor;
    check(dl->device.device_type == kDLCUDA && dl->device.device_id == g && dl->data == moe_tensor_data(t),
          "cuda:%d: the export names kDLCUDA, GPU %d and the tensor's memory (got type %d, id %d)", g, g,
          (int)dl->device.device_type, (int)dl->device.device_id);
    moe_tensor *u = NULL;
    TRY(moe_tensor_from_dlpack_versioned(ctx, v, &u));
    moe_tensor_free(t); /* u holds the export, which holds the memory */
    const moe_device ud = moe_tensor_device(u);
    check(ud.kind == MOE_CUDA && ud.index == g && moe_tensor_ndim(u) == 2 && moe_tensor_dim(u, 1) == 8,
          "cuda:%d: the round trip is a cuda:%d tensor of the same shape", g, ud.index);
    void *got = bytes_of(u);
    check(!memcmp(got, want, moe_tensor_nbytes(u)), "cuda:%d: the round trip keeps the values after the original is freed", g);
    free(got), free(want);
    moe_tensor_free(u);
  }
}

/* experts on a producer's cudaMalloc'd x and out, moelab's weights: the bits of moelab's own. */
static void producer_memory(void) {
  enum { C = 96, H = 64, F = 32, EL = 3 };
  moe_tensor *x = NEW(MOE_BF16, GPU, C, H), *gu = NEW(MOE_BF16, GPU, EL, 2 * F, H), *dn = NEW(MOE_BF16, GPU, EL, H, F);
  moe_tensor *off = NEW(MOE_I32, GPU, EL + 1), *y = NEW(MOE_BF16, GPU, C, H);
  TRY(moe_tensor_randn(ctx, x, 2, 1.0f));
  TRY(moe_tensor_randn(ctx, gu, 3, 0.2f));
  TRY(moe_tensor_randn(ctx, dn, 4, 0.2f));
  TRY(moe_tensor_write(ctx, off, (const int32_t[]){0, 40, 40, 90}, 4 * sizeof(int32_t)));
  moe_experts_args a = {.out = y, .x = x, .offsets = off, .w_gate_up = gu, .w_down = dn};
  TRY(moe_experts(ctx, &a));

  Producer px, py;
  const DLDataType bf16 = {kDLBfloat, 16, 1};
  produce(&px, bf16, 2, 2, (const int64_t[]){C, H}, 0, 0);
  produce(&py, bf16, 2, 2, (const int64_t[]){C, H}, 0, 0);
  moe_tensor *x2 = NULL, *y2 = NULL;
  TRY(moe_tensor_from_dlpack(ctx, &px.m, &x2));
  TRY(moe_tensor_from_dlpack(ctx, &py.m, &y2));
  check(moe_tensor_data(x2) == px.m.dl_tensor.data && moe_tensor_device(x2).kind == MOE_CUDA,
        "a producer's kDLCUDA memory is a cuda tensor over that memory");
  TRY(moe_tensor_copy(ctx, x2, x));
  TRY(moe_tensor_fill(ctx, y2, 0.0));
  moe_experts_args b = {.out = y2, .x = x2, .offsets = off, .w_gate_up = gu, .w_down = dn};
  TRY(moe_experts(ctx, &b));
  void *want = bytes_of(y), *got = bytes_of(y2);
  check(!memcmp(got, want, moe_tensor_nbytes(y)), "experts into a producer's memory gives moelab's bits");
  free(got), free(want);
  TRY(moe_ctx_synchronize(ctx, GPU));
  moe_tensor_free(x2), moe_tensor_free(y2);
  check(px.deleted == 1 && py.deleted == 1, "each producer's deleter ran once (%d, %d)", px.deleted, py.deleted);
  moe_tensor *ts[] = {x, gu, dn, off, y};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_free(ts[i]);
}

static void pinned_and_refusals(int gpus) {
  Producer p;
  produce(&p, (DLDataType){kDLFloat, 32, 1}, 4, 1, (const int64_t[]){6}, 1, 0);
  moe_tensor *t = NULL;
  TRY(moe_tensor_from_dlpack(ctx, &p.m, &t));
  check(moe_tensor_device(t).kind == MOE_CPU, "pinned host memory (kDLCUDAHost) is a cpu tensor");
  TRY(moe_tensor_fill(ctx, t, 2.5));
  check(((const float *)p.m.dl_tensor.data)[5] == 2.5f, "written in place");
  moe_tensor_free(t);
  check(p.deleted == 1, "its deleter ran once");

  produce(&p, (DLDataType){kDLFloat, 32, 1}, 4, 1, (const int64_t[]){6}, 0, 0);
  p.m.dl_tensor.device.device_id = gpus;
  int rc = moe_tensor_from_dlpack(ctx, &p.m, &t);
  check(rc == MOE_ERR_ARG && t == NULL && p.deleted == 0 && strstr(moe_errmsg(ctx), "does not exist"),
        "kDLCUDA on a GPU that does not exist is refused, nothing taken: %s", moe_errmsg(ctx));
  p.m.dl_tensor.device.device_id = 0;
  p.m.deleter(&p.m); /* still the caller's: released here */
}

int main(void) {
  open_gpu_ctx();
  int n = 0;
  TRY(moe_device_count(ctx, MOE_CUDA, &n));
  round_trips(n);
  producer_memory();
  pinned_and_refusals(n);
  moe_ctx_close(ctx);
  printf("%s: %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
