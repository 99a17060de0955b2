// python/kitsune/csrc/capture.cpp — the capture-graph side of capture plans
// (kitsune/capplan.h; compile_step's planned graph memory): the order of a capture's
// work, asked of the CUDA graph being captured (capture.h), the plans made from taken
// recordings (and their log, kt_capplan_log), and the streams compile_step captures on.
// The recording and placing themselves are the private pools' (private_pools.cpp).
// The order callbacks themselves are C (scheduler/src/capture_order.cu).
#include "capture.h"

#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <exception>
#include <vector>

#include "options.h"

namespace bridge {
namespace {

// KITSUNE_CAPPLAN_LOG=DIR (read once): each plan compile_step takes also goes to DIR,
// as kt_capplan_log writes it (a CSV a plan, and the pairs it let share bytes), for
// analysis off the GPU (tools/capplan_log.py, tools/capplan_pack.py). Best effort: a
// file that cannot be written is skipped.
void log_plan(const kt_caprec* rec, const kt_capplan* plan) {
  static const char* dir = option(Opt::kCapplanLog);
  if (dir) (void)kt_capplan_log(dir, rec, plan);
}

}  // namespace

const kt_capture_order* capture_order_begin(CaptureOrder* o) {
  static const bool ordered = option_int(Opt::kCaptureOrder, 1) != 0;
  if (!ordered) return nullptr;
  if (!*o) {
    kt_capture_graph* g = nullptr;
    if (kt_capture_graph_create(&g) != KT_OK) return nullptr;   // no order: streams kept apart
    o->reset(g);
  }
  return kt_capture_graph_begin(o->get());
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
