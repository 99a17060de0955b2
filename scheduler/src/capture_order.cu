// scheduler/src/capture_order.cu — the order of a capture's work, asked of the CUDA
// graph being captured, for capture plans (kitsune/capplan.h's kt_capture_order).
//
// cudaStreamGetCaptureInfo gives a stream's frontier (the nodes its next work depends
// on) and the graph; the graph's edges say what finishes before what. Plain edges
// count; a programmatic one (a kernel that may start before its predecessor ends) only
// into one of Kitsune's dependent launches, which wait for their predecessor before
// any memory access (kt_graph_node_waits_first). Leaving those out cut each stream's
// ancestry at every column sum and LayerNorm backward: the 4-stream Inception net's
// plan grew from 351.7 to 459.9 MiB (bench/results/archive/graph_memory_dae9a1f.json,
// graph_memory_b139609.json). A wait (kt_capplan_create_within's) adds an earlier
// block's last nodes to a stream's capture dependencies.
#include <cuda_runtime_api.h>

#include <new>
#include <unordered_map>
#include <vector>

#include "kitsune/fusion.h"   // kt_graph_node_waits_first
#include "kitsune/graph.h"

struct kt_capture_graph {
  cudaGraph_t graph = nullptr;   // the capture's, from the first frontier asked
  kt_capture_order ops{};
  int64_t programmatic = 0;          // at the last edges taken: programmatic edges,
  int64_t programmatic_ordered = 0;  // of them counted as ordering
  std::unordered_map<cudaGraphNode_t, bool> waits;   // kt_graph_node_waits_first, asked once a node
};

namespace {

bool plain_edges(const cudaGraphEdgeData *e, size_t n) {
  for (size_t i = 0; e && i < n; i++)
    if (e[i].type != cudaGraphDependencyTypeDefault) return false;
  return true;
}

kt_status frontier(void *ctx, kt_stream_t stream, uint64_t *nodes, size_t cap, size_t *n) {
  auto *c = static_cast<kt_capture_graph *>(ctx);
  auto s = static_cast<cudaStream_t>(stream);
  // the legacy and per-thread default streams: asking about them during a capture
  // could invalidate it, and a capture never runs on them
  if (reinterpret_cast<uintptr_t>(s) <= 2) return KT_ERR_UNAVAILABLE;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t g = nullptr;
  const cudaGraphNode_t *deps = nullptr;
  const cudaGraphEdgeData *data = nullptr;
  size_t nd = 0;
  if (cudaStreamGetCaptureInfo(s, &status, nullptr, &g, &deps, &data, &nd) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  if (status != cudaStreamCaptureStatusActive || !g || !plain_edges(data, nd)) return KT_ERR_UNAVAILABLE;
  if (!c->graph) c->graph = g;
  else if (c->graph != g) return KT_ERR_UNAVAILABLE;   // a stream of another capture
  *n = nd;
  for (size_t i = 0; i < nd && i < cap; i++) nodes[i] = reinterpret_cast<uint64_t>(deps[i]);
  return KT_OK;
}

kt_status edges(void *ctx, uint64_t *from, uint64_t *to, size_t cap, size_t *n) {
  auto *c = static_cast<kt_capture_graph *>(ctx);
  if (!c->graph) return KT_ERR_UNAVAILABLE;
  size_t m = 0;
  if (cudaGraphGetEdges(c->graph, nullptr, nullptr, nullptr, &m) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  if (!from || !to || m > cap) {   // the count only (programmatic edges not yet left out)
    *n = m;
    return KT_OK;
  }
  std::vector<cudaGraphNode_t> f(m), t(m);
  std::vector<cudaGraphEdgeData> e(m);
  if (m && cudaGraphGetEdges(c->graph, f.data(), t.data(), e.data(), &m) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  size_t k = 0;
  c->programmatic = c->programmatic_ordered = 0;
  for (size_t i = 0; i < m && i < cap; i++) {
    if (e[i].type != cudaGraphDependencyTypeDefault) {
      c->programmatic++;
      if (e[i].type != cudaGraphDependencyTypeProgrammatic) continue;
      auto w = c->waits.find(t[i]);
      if (w == c->waits.end()) w = c->waits.emplace(t[i], kt_graph_node_waits_first(t[i]) != 0).first;
      if (!w->second) continue;
      c->programmatic_ordered++;
    }
    from[k] = reinterpret_cast<uint64_t>(f[i]);
    to[k++] = reinterpret_cast<uint64_t>(t[i]);
  }
  *n = k;
  return KT_OK;
}

kt_status wait(void *ctx, kt_stream_t stream, const uint64_t *nodes, size_t n) {
  auto *c = static_cast<kt_capture_graph *>(ctx);
  auto s = static_cast<cudaStream_t>(stream);
  if (!c->graph || reinterpret_cast<uintptr_t>(s) <= 2 || !n) return KT_ERR_UNAVAILABLE;
  std::vector<cudaGraphNode_t> deps(n);
  for (size_t i = 0; i < n; i++) deps[i] = reinterpret_cast<cudaGraphNode_t>(nodes[i]);
  if (cudaStreamUpdateCaptureDependencies(s, deps.data(), nullptr, n, cudaStreamAddCaptureDependencies) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  return KT_OK;
}

}  // namespace

extern "C" kt_status kt_capture_graph_create(kt_capture_graph **out) {
  if (!out) return KT_ERR_INVALID;
  auto *c = new (std::nothrow) kt_capture_graph();
  if (!c) return KT_ERR_HOST_OOM;
  c->ops = kt_capture_order{c, frontier, edges, wait};
  *out = c;
  return KT_OK;
}

extern "C" void kt_capture_graph_destroy(kt_capture_graph *c) { delete c; }

extern "C" const kt_capture_order *kt_capture_graph_begin(kt_capture_graph *c) {
  if (!c) return nullptr;
  c->graph = nullptr;   // this capture's is taken from its first frontier
  c->programmatic = c->programmatic_ordered = 0;
  c->waits.clear();     // another graph's nodes
  return &c->ops;
}

extern "C" void kt_capture_graph_programmatic(const kt_capture_graph *c, int64_t *edges, int64_t *ordered) {
  if (edges) *edges = c ? c->programmatic : 0;
  if (ordered) *ordered = c ? c->programmatic_ordered : 0;
}
