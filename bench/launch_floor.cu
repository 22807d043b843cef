/* SPDX-License-Identifier: MIT */
// launch_floor.cu -- what a scheduler call costs before it does any work: the period of a kernel in
// a CUDA graph of 200 back-to-back calls (as scenarios/scheduler.lua times schedule), for skeletons
// of the scheduler's structure with nothing else in them.  A bench program, not part of the
// library (docs/perf/schedule.md, "The floor under a call").  Each block has 512 threads, as schedule_kernel.
//
//   empty   griddepcontrol.wait and nothing else
//   nobar   one coalesced load per thread, a block count, one store: no exchange between blocks
//   atomic  the same with one exchange the scheduler's way: 64 REDs per block into totals, the
//           grid barrier of kernels/schedule/ (one atom.add.release per block, acquiring polls),
//           then every block reads the totals back
//   flags   the exchange by a flag per block (st.release of the call's epoch, every block polls
//           all flags) instead of one counter
//   clusterN  clusters of N blocks: each cluster sums 48 counts of its blocks through distributed
//           shared memory, publishes them tagged with the call's epoch, and every block polls all
//           clusters' words: no grid barrier, no atomics
//   redundant  no exchange at all: every block reads all W x 4,096 ids (512 tokens of top-8, 384
//           experts, EP W) and counts its rank's window into c[e][q] in shared memory, as a
//           scheduler that computes the counts in every block would have to (docs/perf/schedule.md)
//
// Launch attributes per row: cooperative (coop) and programmatic dependent launch (pdl).  Prints
// µs per call: the median and the minimum of 9 replays of the graph, after 3.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "grid_barrier.cuh" // the scheduler's own (kernels/schedule/)

namespace cg = cooperative_groups;

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      printf("FAIL %s: %s\n", #x, cudaGetErrorString(e_));                                       \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

enum Mode { EMPTY, NOBAR, ATOMIC, FLAGS, CLUSTER, REDUNDANT };

struct Args {
  const int *in;
  int *out, *tot;
  unsigned *bar, *flag, *epoch;
  unsigned long long *pub;
  int mode;
  int nids, el; // REDUNDANT: ids every block reads, experts in its window
};

constexpr int kThreads = 512, kCounts = 48;

__global__ void __launch_bounds__(kThreads, 1) skeleton(Args a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (a.mode == EMPTY) return;
  const int tid = threadIdx.x, blk = blockIdx.x;
  if (a.mode == REDUNDANT) { // every block counts all ids into c[e][q] of its window, no exchange
    __shared__ int c[2048]; // [16][97], el <= 96
    for (int x = tid; x < 2048; x += kThreads) c[x] = 0;
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;");
    const int4 *in4 = (const int4 *)a.in;
    const int n4 = a.nids / 4, per_q = 4096 / 4; // 4096 ids a source rank
    for (int x0 = tid; x0 < n4; x0 += kThreads * 8) {
      int4 v[8];
#pragma unroll
      for (int u = 0; u < 8; u++) v[u] = x0 + u * kThreads < n4 ? __ldg(in4 + x0 + u * kThreads) : make_int4(-1, -1, -1, -1);
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int q = (x0 + u * kThreads) / per_q;
        const int ids[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int k = 0; k < 4; k++)
          if ((unsigned)ids[k] < (unsigned)a.el) atomicAdd(&c[(q & 15) * 97 + ids[k]], 1);
      }
    }
    __syncthreads();
    if (tid < 32) { // a scan of the window's n_e by one warp
      int sum = 0;
      for (int e = tid; e < a.el; e += 32)
        for (int q = 0; q < 16; q++) sum += c[q * 97 + e];
      for (int o = 1; o < 32; o <<= 1) sum += __shfl_up_sync(0xffffffffu, sum, o);
      c[tid] = sum;
    }
    __syncthreads();
    a.out[blk * kThreads + tid] = c[tid & 31];
    return;
  }
  __shared__ int s[1024]; // up to 16 clusters x kCounts
  __shared__ unsigned epoch_sh;
  if (tid == 0) epoch_sh = *(volatile unsigned *)a.epoch;
  const int v = __ldg(a.in + blk * kThreads + tid);
  const int n = __syncthreads_count(v & 1);
  const unsigned e = epoch_sh + 1; // this call's epoch: every block read the same value
  if (a.mode == NOBAR) {
    a.out[blk * kThreads + tid] = v + n;
    return;
  }
  if (a.mode == ATOMIC) {
    if (tid < 64) atomicAdd(a.tot + tid, n + tid);
    grid_barrier(a.bar);
    asm volatile("griddepcontrol.launch_dependents;");
    s[tid] = __ldcg(a.tot + (tid & 63));
    __syncthreads();
    a.out[blk * kThreads + tid] = s[kThreads - 1 - tid] + v;
    return;
  }
  if (a.mode == FLAGS) {
    if (tid == 0) asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(a.flag + blk), "r"(e) : "memory");
    if (tid < (int)gridDim.x) {
      unsigned f;
      do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(f) : "l"(a.flag + tid) : "memory");
      while (f != e);
    }
    if (tid < kCounts) s[tid] = n + tid; // what the store below reads (flags carry no counts)
    __syncthreads();
  } else { // CLUSTER
    __shared__ int h[kCounts];
    cg::cluster_group cl = cg::this_cluster();
    if (tid < kCounts) h[tid] = n + tid + v;
    cl.sync();
    const int size = (int)cl.num_blocks(), clusters = (int)gridDim.x / size;
    if (cl.block_rank() == 0 && tid < kCounts) {
      int sum = 0;
      for (int b = 0; b < size; b++) sum += cl.map_shared_rank(h, b)[tid];
      const unsigned long long w = ((unsigned long long)e << 32) | (unsigned)sum;
      asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(a.pub + (blk / size) * kCounts + tid), "l"(w) : "memory");
    }
    for (int x = tid; x < clusters * kCounts; x += kThreads) {
      unsigned long long w;
      do asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(w) : "l"(a.pub + x) : "memory");
      while ((unsigned)(w >> 32) != e);
      s[x] = (int)w;
    }
    cl.sync(); // no block leaves while another may read its shared memory
  }
  asm volatile("griddepcontrol.launch_dependents;");
  // every block has passed its epoch read: the next call's epoch can be published
  if (blk == 0 && tid == 0) *(volatile unsigned *)a.epoch = e;
  a.out[blk * kThreads + tid] = s[tid % kCounts] + v;
}

// Times a graph of 200 launches of cfg: the median and the fastest of 9 replays (after 3), µs a
// call.  A launch or capture the driver refuses returns that error, with nothing timed.
static cudaError_t time_calls(const cudaLaunchConfig_t &cfg, const Args &a, cudaEvent_t t0, cudaEvent_t t1, float *med,
                              float *fastest) {
  CHECK(cudaStreamBeginCapture(cfg.stream, cudaStreamCaptureModeGlobal));
  cudaError_t le = cudaSuccess;
  for (int i = 0; i < 200 && le == cudaSuccess; i++) le = cudaLaunchKernelEx(&cfg, skeleton, a);
  cudaGraph_t g;
  const cudaError_t ce = cudaStreamEndCapture(cfg.stream, &g);
  if (le != cudaSuccess || ce != cudaSuccess) {
    (void)cudaGetLastError();
    if (ce == cudaSuccess) cudaGraphDestroy(g);
    return le != cudaSuccess ? le : ce;
  }
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  std::vector<float> us;
  for (int rep = 0; rep < 12; rep++) {
    CHECK(cudaEventRecord(t0, cfg.stream));
    CHECK(cudaGraphLaunch(ge, cfg.stream));
    CHECK(cudaEventRecord(t1, cfg.stream));
    CHECK(cudaEventSynchronize(t1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (rep >= 3) us.push_back(ms * 1000.f / 200);
  }
  std::sort(us.begin(), us.end());
  *med = us[us.size() / 2], *fastest = us[0];
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  return cudaSuccess;
}

int main() {
  int dev = 0, sms = 0;
  if (cudaGetDeviceCount(&dev) != cudaSuccess || dev == 0) {
    printf("SKIP no GPU\n");
    return 77;
  }
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Args a = {};
  int *in, *out, *tot;
  unsigned *bar, *flag, *epoch;
  unsigned long long *pub;
  CHECK(cudaMalloc(&in, 1 << 22));
  CHECK(cudaMalloc(&out, 1 << 22));
  CHECK(cudaMalloc(&tot, 4096));
  CHECK(cudaMalloc(&bar, 64));
  CHECK(cudaMalloc(&flag, 4096));
  CHECK(cudaMalloc(&epoch, 64));
  CHECK(cudaMalloc(&pub, 1 << 16));
  {
    std::vector<int> ids(1 << 20); // random experts in [0, 384): the redundant rows' ids
    unsigned x = 12345;
    for (int &v : ids) x = x * 1664525u + 1013904223u, v = (int)((x >> 8) % 384);
    CHECK(cudaMemcpy(in, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemset(tot, 0, 4096));
  CHECK(cudaMemset(bar, 0, 64));
  CHECK(cudaMemset(flag, 0, 4096));
  CHECK(cudaMemset(epoch, 0, 64));
  CHECK(cudaMemset(pub, 0, 1 << 16));
  a.in = in, a.out = out, a.tot = tot, a.bar = bar, a.flag = flag, a.epoch = epoch, a.pub = pub;
  CHECK(cudaFuncSetAttribute(skeleton, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));

  struct Row {
    const char *name;
    int mode, cluster;
  } rows[] = {{"empty", EMPTY, 0},   {"nobar", NOBAR, 0},       {"atomic", ATOMIC, 0},
              {"flags", FLAGS, 0},   {"cluster8", CLUSTER, 8}, {"cluster16", CLUSTER, 16}};
  printf("skeleton   blocks coop pdl   us/call median (min), graph of 200 calls, %d SMs\n", sms);
  for (const Row &r : rows)
    for (int G : {128, 64})
      for (int coop = 0; coop < 2; coop++)
        for (int pdl = 0; pdl < 2; pdl++) {
          if (coop && (r.mode == EMPTY || r.mode == NOBAR)) continue; // nothing waits on another block
          a.mode = r.mode;
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(G);
          cfg.blockDim = dim3(kThreads);
          cfg.stream = st;
          cudaLaunchAttribute attr[3];
          int na = 0;
          if (coop) attr[na].id = cudaLaunchAttributeCooperative, attr[na++].val.cooperative = 1;
          if (pdl)
            attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization,
            attr[na++].val.programmaticStreamSerializationAllowed = 1;
          if (r.cluster) {
            attr[na].id = cudaLaunchAttributeClusterDimension;
            attr[na].val.clusterDim.x = (unsigned)r.cluster, attr[na].val.clusterDim.y = 1, attr[na].val.clusterDim.z = 1;
            na++;
          }
          cfg.attrs = attr;
          cfg.numAttrs = (unsigned)na;
          float med, fastest;
          const cudaError_t err = time_calls(cfg, a, t0, t1, &med, &fastest);
          if (err != cudaSuccess)
            printf("%-10s %6d %4d %3d   launch refused: %s\n", r.name, G, coop, pdl, cudaGetErrorString(err));
          else
            printf("%-10s %6d %4d %3d   %.2f (%.2f)\n", r.name, G, coop, pdl, med, fastest);
        }
  // REDUNDANT: W source ranks of 4096 ids (512 tokens of top-8), 384 experts: every block reads
  // all W x 4096 ids, with G blocks
  for (int W : {4, 8, 16, 32, 64})
    for (int G : {W, 2 * W, 16, 64}) {
      a.mode = REDUNDANT, a.nids = W * 4096, a.el = 384 / W;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(G);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = st;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      float med, fastest;
      CHECK(time_calls(cfg, a, t0, t1, &med, &fastest));
      printf("redundant EP%-3d %4d blocks, %4d KB a block   %.2f (%.2f)\n", W, G, W * 16, med, fastest);
    }
  return 0;
}
