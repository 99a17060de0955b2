/* kitsune/graph.h — edits of a captured CUDA graph (scheduler/src/graph_nodes.cu).
 *
 * compile_step captures a whole training step into one CUDA graph; these functions
 * list, time and rewrite that graph's nodes before it is instantiated. Graphs and
 * nodes are passed as void* (cudaGraph_t, cudaGraphNode_t), streams as cudaStream_t,
 * so this header needs no CUDA header.
 */
#ifndef KITSUNE_GRAPH_H
#define KITSUNE_GRAPH_H

#include <stddef.h>
#include <stdint.h>

#include "kitsune/capplan.h"
#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Replaces each memset node of graph (a captured cudaGraph_t, before it is
 * instantiated) that sets at most max_bytes with a kernel node of Kitsune's that
 * writes the same bytes, with the same edges in and out (their data kept). The kernel
 * nodes are made for the current device: call it with the capture's device current,
 * for a graph whose memsets set that device's memory. Inside a
 * graph the kernel after a memset node starts microseconds later than one after a
 * kernel. *replaced (may be NULL): how many. KT_ERR_BACKEND when the CUDA runtime
 * refuses a call; the nodes replaced until then stay replaced, each whole. */
kt_status kt_graph_memsets_to_kernels(void *graph, size_t max_bytes, int *replaced);

/* The nodes of the graph stream is capturing into (cudaGraphNode_t values), the first
 * min(*n, cap) written (nodes may be NULL), *n set to how many there are. KT_ERR_INVALID
 * when stream is not capturing; KT_ERR_BACKEND when the runtime refuses. */
kt_status kt_graph_capture_nodes(void *stream, uint64_t *nodes, size_t cap, size_t *n);

/* When each node of graph (a captured cudaGraph_t) finishes in a replay: a copy of it
 * with a one-thread kernel after every node that writes the GPU's global timer, and
 * one at its root, is instantiated, the nodes in skip (of graph; kernels, copies or
 * memsets) left out of it, and replayed replays + 1 times on stream (the first
 * uploads it). nodes[k] (graph's node) finished finish_ns[k] ns after the root, the
 * median over the counted replays. stamps: device memory of the graph's device for
 * (nodes + 1) 8-byte stamps; NULL: only *n = the node count is set. cap: room in
 * nodes and finish_ns (at least the count). The replays run the graph's work, its
 * writes included (what must not be written twice goes in skip); graph itself is
 * not changed. Call outside any capture, with graph's device current.
 * KT_ERR_UNAVAILABLE: a skip node cannot be left out; KT_ERR_BACKEND: the runtime
 * refused a call. */
kt_status kt_graph_time_nodes(void *graph, const uint64_t *skip, size_t nskip, void *stamps, int replays,
                              void *stream, uint64_t *nodes, int64_t *finish_ns, size_t cap, size_t *n);

/* The order of a capture's work, for capture plans (kitsune/capplan.h): a
 * kt_capture_order whose callbacks ask the CUDA graph being captured (a stream's
 * frontier by cudaStreamGetCaptureInfo, the graph's edges, waits by
 * cudaStreamUpdateCaptureDependencies). Plain edges order work; a programmatic edge only
 * into one of Kitsune's dependent launches (kt_graph_node_waits_first). One object
 * serves one capture at a time: kt_capture_graph_begin resets it for the next capture
 * (its graph is taken from the first frontier asked) and returns the order to hand to
 * kt_caprec_set_order / kt_placer_set_order; it stays valid until the object is
 * destroyed. kt_capture_graph_programmatic: at the last edges taken, the graph's
 * programmatic edges and, of them, those counted as order. Not thread-safe. */
typedef struct kt_capture_graph kt_capture_graph;
kt_status kt_capture_graph_create(kt_capture_graph **out);
void kt_capture_graph_destroy(kt_capture_graph *g);
const kt_capture_order *kt_capture_graph_begin(kt_capture_graph *g);
void kt_capture_graph_programmatic(const kt_capture_graph *g, int64_t *edges, int64_t *ordered);

#ifdef __cplusplus
}
#endif

#endif /* KITSUNE_GRAPH_H */
