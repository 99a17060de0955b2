// fusion/kernels/graph_nodes.cu — rewrites of a captured CUDA graph before it is
// instantiated.
//
// kt_graph_memsets_to_kernels: each memset node of at most max_bytes becomes a kernel
// node of ours that writes the same bytes, with the same edges in and out. GPT's
// captured step holds 19 memsets of 4 bytes (value 0), none issued by Kitsune, that
// sit right before cuDNN's attention kernels and cuBLASLt's cooperative GEMMs (judged
// by their neighbours, bench/results/h100_memsets_gpt_5f19cf5.log). On the H100 the
// kernel after such a memset node started 3 to 4 us after the memset ended in the
// forward and about 7 us in the backward, where a kernel after a kernel starts 0.4 us
// after it (h100_timeline_gpt_inception8_18b9e89.log); the fill kernel runs 1.1 us
// (h100_timeline_gpt_memsets_18b9e89.log).
// Steps measured with and without it in one process (tools/ab_env.py,
// ab_memsets_18b9e89.json): GPT 2.281 -> 2.266 ms, ResNet-18 1.354 -> 1.330, MLP
// 0.0939 -> 0.0925, the 4-stream Inception net at batch 8 0.479 -> 0.478. That tree
// also launched the fill early, behind the kernel before it, through a programmatic
// edge; against the plain fill kept here that gained nothing measurable (GPT 2.267 ms
// against 2.263, ResNet-18 1.341 against 1.347; ab_memsets_early_18b9e89.json), so it
// went.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kitsune/fusion.h"

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

}  // namespace

extern "C" kt_status kt_graph_memsets_to_kernels(void *graph, size_t max_bytes, int *replaced) {
  if (replaced) *replaced = 0;
  if (!graph) return KT_ERR_INVALID;
  auto g = static_cast<cudaGraph_t>(graph);
  size_t count = 0;
  if (cudaGraphGetNodes(g, nullptr, &count) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_BACKEND;
  }
  std::vector<cudaGraphNode_t> nodes(count);
  if (count && cudaGraphGetNodes(g, nodes.data(), &count) != cudaSuccess) {
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
