// scheduler/src/graph_nodes.cu — rewrites of a captured CUDA graph before it is
// instantiated.
//
// kt_graph_memsets_to_kernels: each memset node of at most max_bytes becomes a kernel
// node of ours that writes the same bytes, with the same edges in and out. GPT's
// captured step holds 19 memsets of 4 bytes (value 0), none issued by Kitsune, that
// sit right before cuDNN's attention kernels and cuBLASLt's cooperative GEMMs (judged
// by their neighbours, bench/results/archive/h100_memsets_gpt_5f19cf5.log). On the H100 the
// kernel after such a memset node started 3 to 4 us after the memset ended in the
// forward and about 7 us in the backward, where a kernel after a kernel starts 0.4 us
// after it (h100_timeline_gpt_inception8_18b9e89.log); the fill kernel runs 1.1 us
// (h100_timeline_gpt_memsets_18b9e89.log).
// Steps measured with and without it in one process (tools/gpu/ab_env.py,
// ab_memsets_18b9e89.json): GPT 2.281 -> 2.266 ms, ResNet-18 1.354 -> 1.330, MLP
// 0.0939 -> 0.0925, the 4-stream Inception net at batch 8 0.479 -> 0.478. That tree
// also launched the fill early, behind the kernel before it, through a programmatic
// edge; against the plain fill kept here that gained nothing measurable (GPT 2.267 ms
// against 2.263, ResNet-18 1.341 against 1.347; ab_memsets_early_18b9e89.json), so it
// went.
//
// kt_graph_capture_nodes / kt_graph_time_nodes: when each node of a captured graph
// finishes in a replay of it (for capture plans' waits, kitsune/capplan.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kitsune/graph.h"

namespace {

struct FillArgs {
  char *dst;
  size_t pitch, width, height;   // width and height in elements, pitch in bytes
  unsigned value, elem;          // elem: 1, 2 or 4 bytes
};

__global__ void fill_kernel(FillArgs a) {
  const size_t n = a.width * a.height;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    char *p = a.dst + (i / a.width) * a.pitch + (i % a.width) * a.elem;
    if (a.elem == 4) *reinterpret_cast<unsigned *>(p) = a.value;
    else if (a.elem == 2) *reinterpret_cast<unsigned short *>(p) = (unsigned short)a.value;
    else *reinterpret_cast<unsigned char *>(p) = (unsigned char)a.value;
  }
}

// The node's edges in (in = true) or out, with their data.
bool edges(cudaGraphNode_t n, bool in, std::vector<cudaGraphNode_t> &nodes, std::vector<cudaGraphEdgeData> &data) {
  size_t count = 0;
  cudaError_t e = in ? cudaGraphNodeGetDependencies(n, nullptr, nullptr, &count)
                     : cudaGraphNodeGetDependentNodes(n, nullptr, nullptr, &count);
  if (e != cudaSuccess) return false;
  nodes.resize(count);
  data.resize(count);
  if (count == 0) return true;
  e = in ? cudaGraphNodeGetDependencies(n, nodes.data(), data.data(), &count)
         : cudaGraphNodeGetDependentNodes(n, nodes.data(), data.data(), &count);
  return e == cudaSuccess && count == nodes.size();
}

// Replaces memset node m by a fill kernel node; false (the graph unchanged) on failure.
bool replace(cudaGraph_t g, cudaGraphNode_t m, const cudaMemsetParams &p) {
  std::vector<cudaGraphNode_t> in, out;
  std::vector<cudaGraphEdgeData> in_data, out_data;
  if (!edges(m, true, in, in_data) || !edges(m, false, out, out_data)) return false;
  FillArgs a = {static_cast<char *>(p.dst), p.pitch, p.width, p.height ? p.height : 1, p.value, p.elementSize};
  const size_t n = a.width * a.height;
  const unsigned threads = n < 256 ? 32 : 256;
  const size_t blocks = (n + threads - 1) / threads;
  void *args[] = {&a};
  cudaKernelNodeParams kp = {};
  kp.func = reinterpret_cast<void *>(fill_kernel);
  kp.gridDim = dim3(static_cast<unsigned>(blocks < 1024 ? blocks : 1024));
  kp.blockDim = dim3(threads);
  kp.kernelParams = args;
  cudaGraphNode_t k = nullptr;
  if (cudaGraphAddKernelNode(&k, g, nullptr, 0, &kp) != cudaSuccess) return false;
  std::vector<cudaGraphNode_t> self_in(in.size(), k), self_out(out.size(), k);
  if ((!in.empty() && cudaGraphAddDependencies(g, in.data(), self_in.data(), in_data.data(), in.size()) != cudaSuccess) ||
      (!out.empty() && cudaGraphAddDependencies(g, self_out.data(), out.data(), out_data.data(), out.size()) != cudaSuccess)) {
    cudaGraphDestroyNode(k);   // takes its edges with it
    return false;
  }
  return cudaGraphDestroyNode(m) == cudaSuccess;
}

// One thread writes the GPU's global timer (ns) to *at.
__global__ void stamp_kernel(unsigned long long *at) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *at = t;
}

// All nodes of g.
bool all_nodes(cudaGraph_t g, std::vector<cudaGraphNode_t> &out) {
  size_t count = 0;
  if (cudaGraphGetNodes(g, nullptr, &count) != cudaSuccess) return false;
  out.resize(count);
  return count == 0 || (cudaGraphGetNodes(g, out.data(), &count) == cudaSuccess && count == out.size());
}

// A stamp kernel node writing to at, after dep (none: a root).
bool add_stamp(cudaGraph_t g, cudaGraphNode_t dep, unsigned long long *at) {
  void *args[] = {&at};
  cudaKernelNodeParams kp = {};
  kp.func = reinterpret_cast<void *>(stamp_kernel);
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(1);
  kp.kernelParams = args;
  cudaGraphNode_t k = nullptr;
  return cudaGraphAddKernelNode(&k, g, dep ? &dep : nullptr, dep ? 1 : 0, &kp) == cudaSuccess;
}

// Replays of exec on stream (the first uploads it and is not counted); per node, the
// median over the counted ones of its stamp less the root's (stamps[count]).
kt_status time_replays(cudaGraphExec_t exec, cudaStream_t stream, const unsigned long long *stamps, size_t count,
                       int replays, int64_t *finish_ns) {
  std::vector<unsigned long long> host(count + 1);
  std::vector<std::vector<int64_t>> seen(count);
  for (int r = 0; r <= replays; r++) {
    if (cudaGraphLaunch(exec, stream) != cudaSuccess || cudaStreamSynchronize(stream) != cudaSuccess ||
        cudaMemcpy(host.data(), stamps, (count + 1) * sizeof host[0], cudaMemcpyDeviceToHost) != cudaSuccess)
      return KT_ERR_BACKEND;
    for (size_t k = 0; r > 0 && k < count; k++)
      seen[k].push_back(static_cast<int64_t>(host[k]) - static_cast<int64_t>(host[count]));
  }
  for (size_t k = 0; k < count; k++) {
    std::vector<int64_t> &v = seen[k];
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    finish_ns[k] = v[v.size() / 2];
  }
  return KT_OK;
}

}  // namespace

extern "C" kt_status kt_graph_capture_nodes(void *stream, uint64_t *nodes, size_t cap, size_t *n) {
  if (!n) return KT_ERR_INVALID;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t g = nullptr;
  if (cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, nullptr, &g, nullptr, nullptr, nullptr) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_BACKEND;
  }
  if (status != cudaStreamCaptureStatusActive || !g) return KT_ERR_INVALID;
  std::vector<cudaGraphNode_t> all;
  if (!all_nodes(g, all)) {
    (void)cudaGetLastError();
    return KT_ERR_BACKEND;
  }
  *n = all.size();
  for (size_t i = 0; i < all.size() && i < cap && nodes; i++) nodes[i] = reinterpret_cast<uint64_t>(all[i]);
  return KT_OK;
}

extern "C" kt_status kt_graph_time_nodes(void *graph, const uint64_t *skip, size_t nskip, void *stamps, int replays,
                                         void *stream, uint64_t *nodes, int64_t *finish_ns, size_t cap, size_t *n) {
  if (!graph || !n || (nskip && !skip)) return KT_ERR_INVALID;
  auto g = static_cast<cudaGraph_t>(graph);
  std::vector<cudaGraphNode_t> all;
  if (!all_nodes(g, all)) {
    (void)cudaGetLastError();
    return KT_ERR_BACKEND;
  }
  *n = all.size();
  if (!stamps) return KT_OK;   // the count alone
  if (replays < 1 || cap < all.size() || !nodes || !finish_ns) return KT_ERR_INVALID;
  const size_t count = all.size();
  auto *at = static_cast<unsigned long long *>(stamps);
  cudaGraph_t clone = nullptr;
  cudaGraphExec_t exec = nullptr;
  kt_status st = cudaGraphClone(&clone, g) == cudaSuccess ? KT_OK : KT_ERR_BACKEND;
  for (size_t k = 0; k < count && st == KT_OK; k++) {
    cudaGraphNode_t mirror = nullptr;
    if (cudaGraphNodeFindInClone(&mirror, all[k], clone) != cudaSuccess || !add_stamp(clone, mirror, at + k))
      st = KT_ERR_BACKEND;
  }
  if (st == KT_OK && !add_stamp(clone, nullptr, at + count)) st = KT_ERR_BACKEND;
  if (st == KT_OK && cudaGraphInstantiate(&exec, clone, 0) != cudaSuccess) st = KT_ERR_BACKEND;
  for (size_t i = 0; i < nskip && st == KT_OK; i++) {
    cudaGraphNode_t orig = reinterpret_cast<cudaGraphNode_t>(skip[i]), c = nullptr;
    // a node that cannot be left out (not a kernel, copy or memset) leaves the graph untimed
    if (cudaGraphNodeFindInClone(&c, orig, clone) != cudaSuccess || cudaGraphNodeSetEnabled(exec, c, 0) != cudaSuccess)
      st = KT_ERR_UNAVAILABLE;
  }
  if (st == KT_OK && cudaGraphUpload(exec, static_cast<cudaStream_t>(stream)) != cudaSuccess) st = KT_ERR_BACKEND;
  if (st == KT_OK) st = time_replays(exec, static_cast<cudaStream_t>(stream), at, count, replays, finish_ns);
  if (st == KT_OK)
    for (size_t k = 0; k < count; k++) nodes[k] = reinterpret_cast<uint64_t>(all[k]);
  if (exec) cudaGraphExecDestroy(exec);
  if (clone) cudaGraphDestroy(clone);
  (void)cudaGetLastError();
  return st;
}

extern "C" kt_status kt_graph_memsets_to_kernels(void *graph, size_t max_bytes, int *replaced) {
  if (replaced) *replaced = 0;
  if (!graph) return KT_ERR_INVALID;
  auto g = static_cast<cudaGraph_t>(graph);
  std::vector<cudaGraphNode_t> nodes;
  if (!all_nodes(g, nodes)) {
    (void)cudaGetLastError();
    return KT_ERR_BACKEND;
  }
  int done = 0;
  for (cudaGraphNode_t n : nodes) {
    cudaGraphNodeType type;
    cudaMemsetParams p = {};
    if (cudaGraphNodeGetType(n, &type) != cudaSuccess || type != cudaGraphNodeTypeMemset) continue;
    if (cudaGraphMemsetNodeGetParams(n, &p) != cudaSuccess) continue;
    const size_t rows = p.height ? p.height : 1;
    if ((p.elementSize != 1 && p.elementSize != 2 && p.elementSize != 4) || p.width * p.elementSize * rows > max_bytes)
      continue;
    if (!replace(g, n, p)) {
      (void)cudaGetLastError();
      if (replaced) *replaced = done;
      return KT_ERR_BACKEND;
    }
    ++done;
  }
  (void)cudaGetLastError();
  if (replaced) *replaced = done;
  return KT_OK;
}
