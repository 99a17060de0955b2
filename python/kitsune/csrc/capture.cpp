// python/kitsune/csrc/capture.cpp — the capture-graph side of capture plans
// (kitsune/capplan.h; compile_step's planned graph memory): the order of a capture's
// work, asked of the CUDA graph being captured (capture.h), the plans made from taken
// recordings (and their log, kt_capplan_log), and the streams compile_step captures on.
// The recording and placing themselves are the private pools' (private_pools.cpp).
// The order callbacks are logic that needs only the CUDA runtime, no PyTorch: they
// could live in scheduler/ beside kt_graph_node_waits_first (a kt_capture_order over
// the graph a stream is capturing); they stayed here when bridge.cpp was split.
#include "capture.h"

#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <exception>
#include <vector>

#include "kitsune/fusion.h"   // kt_graph_node_waits_first
#include "options.h"

namespace bridge {
namespace {

bool plain_edges(const cudaGraphEdgeData* e, size_t n) {
  for (size_t i = 0; e && i < n; i++)
    if (e[i].type != cudaGraphDependencyTypeDefault) return false;
  return true;
}

kt_status capture_frontier(void* ctx, kt_stream_t stream, uint64_t* nodes, size_t cap, size_t* n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
  auto s = static_cast<cudaStream_t>(stream);
  // the legacy and per-thread default streams: asking about them during a capture
  // could invalidate it, and a capture never runs on them
  if (reinterpret_cast<uintptr_t>(s) <= 2) return KT_ERR_UNAVAILABLE;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t g = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* data = nullptr;
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

kt_status capture_edges(void* ctx, uint64_t* from, uint64_t* to, size_t cap, size_t* n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
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

// A plan within a budget (kt_capplan_create_within) orders a block's work after an
// earlier block's by adding that block's last nodes to the stream's dependencies.
kt_status capture_wait(void* ctx, kt_stream_t stream, const uint64_t* nodes, size_t n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
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

// KITSUNE_CAPPLAN_LOG=DIR (read once): each plan compile_step takes also goes to DIR,
// as kt_capplan_log writes it (a CSV a plan, and the pairs it let share bytes), for
// analysis off the GPU (tools/capplan_log.py, tools/capplan_pack.py). Best effort: a
// file that cannot be written is skipped.
void log_plan(const kt_caprec* rec, const kt_capplan* plan) {
  static const char* dir = option(Opt::kCapplanLog);
  if (dir) (void)kt_capplan_log(dir, rec, plan);
}

}  // namespace

const kt_capture_order* capture_order_begin(std::unique_ptr<CaptureOrder>* o) {
  static const bool ordered = option_int(Opt::kCaptureOrder, 1) != 0;
  if (!ordered) return nullptr;
  if (!*o) {
    *o = std::make_unique<CaptureOrder>();
    (*o)->ops = kt_capture_order{o->get(), capture_frontier, capture_edges, capture_wait};
  }
  (*o)->graph = nullptr;   // this capture's is taken from its first frontier
  (*o)->programmatic = (*o)->programmatic_ordered = 0;
  (*o)->waits.clear();     // another graph's nodes
  return &(*o)->ops;
}

}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

extern "C" {

// The plan of a taken recording within budget bytes (< 0: none; kt_capplan_create_within).
// info[19]: planned blocks, arena bytes, plan bytes, live peak, recorded blocks, of them
// still live (left out), freed after the capture, the sum of the streams' live peaks,
// the recorded graph's nodes (0: streams kept apart), pairs shared across streams, the
// graph's programmatic edges and, of them, those counted as ordering, the wait gap (-1:
// none), the pairs only waits let share, the plan's bytes without waits, whether node
// times chose the plan, whether its pairs are by slack (then the least slack of one,
// ns), its waits' first-order delay (ns).
__attribute__((visibility("default"))) int kt_bridge_recording_plan(const TakenRecording* t, int64_t budget,
                                                                    kt_capplan** out, int64_t* info) {
  if (!t || !out || !info) return KT_ERR_INVALID;
  kt_caprec_info ri;
  kt_caprec_get_info(t->rec, &ri);
  kt_status st = kt_capplan_create_within(t->rec, budget < 0 ? UINT64_MAX : static_cast<uint64_t>(budget), out);
  if (st != KT_OK) return st;
  log_plan(t->rec, *out);
  kt_capplan_info ci;
  kt_capplan_get_info(*out, &ci);
  int64_t v[19] = {ci.blocks, static_cast<int64_t>(ci.arena_bytes), static_cast<int64_t>(ci.plan_bytes),
                   static_cast<int64_t>(ci.peak_bytes), ri.blocks, ri.live, ri.freed_after,
                   static_cast<int64_t>(ci.group_peak_bytes), ci.graph_nodes, ci.cross_shares,
                   t->programmatic, t->programmatic_ordered, ci.wait_gap, ci.wait_shares,
                   static_cast<int64_t>(ci.unwaited_bytes), ci.wait_timed, ci.wait_by_slack, ci.wait_slack_ns,
                   ci.wait_delay_ns};
  std::memcpy(info, v, sizeof v);
  return KT_OK;
}
// When the recorded graph's nodes finished in a replay (kt_caprec_set_times).
__attribute__((visibility("default"))) int kt_bridge_recording_set_times(TakenRecording* t, const uint64_t* nodes,
                                                                         const int64_t* finish_ns, size_t n) {
  return t ? kt_caprec_set_times(t->rec, nodes, finish_ns, n) : KT_ERR_INVALID;
}
__attribute__((visibility("default"))) void kt_bridge_recording_free(TakenRecording* t) {
  if (!t) return;
  kt_caprec_destroy(t->rec);
  delete t;
}
__attribute__((visibility("default"))) void kt_bridge_plan_free(kt_capplan* plan) { kt_capplan_destroy(plan); }

// A new non-blocking stream on device, for compile_step's captures: one no other
// code is handed (PyTorch's pool streams are shared round-robin), never destroyed.
__attribute__((visibility("default"))) int kt_bridge_stream_create(int device, int priority, uint64_t* out) {
  if (!out || device < 0) return KT_ERR_INVALID;
  try {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority) != cudaSuccess) {
      (void)cudaGetLastError();
      return KT_ERR_BACKEND;
    }
    *out = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s));
    return KT_OK;
  } catch (const std::exception&) {   // no such device
    return KT_ERR_UNAVAILABLE;
  }
}

}  // extern "C"
