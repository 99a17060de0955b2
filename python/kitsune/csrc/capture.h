// python/kitsune/csrc/capture.h — what the allocator's private pools need from
// capture.cpp: the order of a capture's work, asked of the CUDA graph being captured,
// for capture plans (kitsune/capplan.h), and a capture's recording once taken.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kitsune/capplan.h"

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
// The graph being captured, as the allocator sees it: cudaStreamGetCaptureInfo gives a
// stream's frontier (the nodes its next work depends on) and the graph; its edges say
// what finishes before what. Plain edges count; a programmatic one (a kernel that may
// start before its predecessor ends) only into one of Kitsune's dependent launches,
// which wait for their predecessor before any memory access
// (kt_graph_node_waits_first). Leaving those out cut each stream's ancestry at every
// column sum and LayerNorm backward after d12bc89: the 4-stream Inception net's plan
// grew from 351.7 to 459.9 MiB (graph_memory_dae9a1f.json, graph_memory_b139609.json).
// KITSUNE_CAPTURE_ORDER=0 turns this off (streams are then kept apart, as before 71e76aa).
struct CaptureOrder {
  cudaGraph_t graph = nullptr;   // the capture's, from the first frontier asked
  kt_capture_order ops{};
  int64_t programmatic = 0;      // at the last edges taken: programmatic edges,
  int64_t programmatic_ordered = 0;   // of them counted as ordering
  std::unordered_map<cudaGraphNode_t, bool> waits;   // kt_graph_node_waits_first, asked once a node
};

// The order for the capture about to begin into a pool whose order is *o (made on
// first use, reset for each capture: another graph's nodes), or nullptr when the
// option turns orders off.
const kt_capture_order* capture_order_begin(std::unique_ptr<CaptureOrder>* o);

}  // namespace bridge

