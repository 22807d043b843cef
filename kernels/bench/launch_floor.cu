// launch_floor.cu -- what a scheduler call costs before it does any work: the period of a kernel in
// a CUDA graph of 200 back-to-back calls (as scenarios/scheduler.lua times schedule), for skeletons
// of the scheduler's structure with nothing else in them.  A bench program, not part of the
// library (PERF.md, "the floor under a call").  Each block has 512 threads, as schedule_kernel.
//
//   empty   griddepcontrol.wait and nothing else
//   nobar   one coalesced load per thread, a block count, one store: no exchange between blocks
//   atomic  the same with one exchange the scheduler's way: 64 REDs per block into totals, the
//           grid barrier of kernels/schedule.cu (one atom.add.release per block, acquiring polls),
//           then every block reads the totals back
//   flags   the exchange by a flag per block (st.release of the call's epoch, every block polls
//           all flags) instead of one counter
//   clusterN  clusters of N blocks: each cluster sums 48 counts of its blocks through distributed
//           shared memory, publishes them tagged with the call's epoch, and every block polls all
//           clusters' words: no grid barrier, no atomics
//
// Launch attributes per row: cooperative (coop) and programmatic dependent launch (pdl).  Prints
// µs per call: the median and the minimum of 9 replays of the graph, after 3.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "grid_barrier.cuh" // the scheduler's own

namespace cg = cooperative_groups;

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      printf("FAIL %s: %s\n", #x, cudaGetErrorString(e_));                                       \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

enum Mode { EMPTY, NOBAR, ATOMIC, FLAGS, CLUSTER };

struct Args {
  const int *in;
  int *out, *tot;
  unsigned *bar, *flag, *epoch;
  unsigned long long *pub;
  int mode;
};

constexpr int kThreads = 512, kCounts = 48;

__global__ void __launch_bounds__(kThreads, 1) skeleton(Args a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (a.mode == EMPTY) return;
  const int tid = threadIdx.x, blk = blockIdx.x;
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
  CHECK(cudaMemset(in, 1, 1 << 22));
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
          CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
          cudaError_t le = cudaSuccess;
          for (int i = 0; i < 200 && le == cudaSuccess; i++) le = cudaLaunchKernelEx(&cfg, skeleton, a);
          cudaGraph_t g;
          const cudaError_t ce = cudaStreamEndCapture(st, &g);
          if (le != cudaSuccess || ce != cudaSuccess) {
            printf("%-10s %6d %4d %3d   launch refused: %s\n", r.name, G, coop, pdl,
                   cudaGetErrorString(le != cudaSuccess ? le : ce));
            (void)cudaGetLastError();
            if (ce == cudaSuccess) cudaGraphDestroy(g);
            continue;
          }
          cudaGraphExec_t ge;
          CHECK(cudaGraphInstantiate(&ge, g, 0));
          std::vector<float> us;
          for (int rep = 0; rep < 12; rep++) {
            CHECK(cudaEventRecord(t0, st));
            CHECK(cudaGraphLaunch(ge, st));
            CHECK(cudaEventRecord(t1, st));
            CHECK(cudaEventSynchronize(t1));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            if (rep >= 3) us.push_back(ms * 1000.f / 200);
          }
          std::sort(us.begin(), us.end());
          printf("%-10s %6d %4d %3d   %.2f (%.2f)\n", r.name, G, coop, pdl, us[us.size() / 2], us[0]);
          CHECK(cudaGraphExecDestroy(ge));
          CHECK(cudaGraphDestroy(g));
        }
  return 0;
}
