// python/kitsune/csrc/capture.h — what the allocator's private pools need from
// capture.cpp: the order of a capture's work, asked of the CUDA graph being captured,
// for capture plans (kitsune/capplan.h), and a capture's recording once taken.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kitsune/capplan.h"
#include "kitsune/graph.h"

// A capture's recording taken from its pool (kitsune.allocator._take_recording): the
// recorded allocations and the captured graph's order, self-contained once the capture
// ended, so one recording can be planned within several budgets (compile_step holds
// late weight-gradient joins to the plan without them that way: one capture fewer).
struct TakenRecording {
  kt_caprec* rec;
  int64_t programmatic, programmatic_ordered;   // the graph's programmatic edges; of them, counted as order
};

namespace bridge {

// ---- the order of a capture's work, for capture plans (kitsune/capplan.h) -------------
// kt_capture_graph (scheduler/src/capture_order.cu) asks the CUDA graph being captured;
// a private pool holds one. KITSUNE_CAPTURE_ORDER=0 turns orders off (streams are then
// kept apart).
struct CaptureGraphFree {
  void operator()(kt_capture_graph* g) const { kt_capture_graph_destroy(g); }
};
using CaptureOrder = std::unique_ptr<kt_capture_graph, CaptureGraphFree>;

// The order for the capture about to begin into a pool whose order is *o (made on
// first use, reset for each capture: another graph's nodes), or nullptr when the
// option turns orders off.
const kt_capture_order* capture_order_begin(CaptureOrder* o);

}  // namespace bridge

