/* kitsune/sched.h — the dataflow stream scheduler's planning core (pure C).
 *
 * A DAG of operations with cost estimates (seconds; kt_roofline_cost gives one from
 * FLOPs and bytes, or use measured kernel times) is scheduled onto K streams by
 * critical-path list scheduling: whenever a stream is free and an operation's
 * predecessors have all finished, the free stream starts the ready operation with the
 * longest path to the end of the graph (its bottom level). Graham's bound holds:
 * makespan <= (2 - 1/K) x the optimum (no cost is charged for cross-stream syncs).
 *
 * The result says, for each operation, its stream and its simulated start and finish,
 * gives a global issue order (topological; each stream's operations in that order),
 * and the cross-stream syncs to insert: "record an event after operation `after` on
 * its stream; make the stream of `before` wait on it before `before`". The syncs are
 * a transitive reduction: every DAG edge is implied by stream order and the syncs,
 * and dropping any one sync breaks some edge.
 *
 * Functions return KT_OK or KT_ERR_INVALID (bad id, self-loop, cycle, stream count
 * outside 1..KT_SCHED_MAX_STREAMS) or KT_ERR_OOM; nothing is changed on error.
 */
#ifndef KITSUNE_SCHED_H
#define KITSUNE_SCHED_H

#include <stdint.h>

#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_SCHED_MAX_STREAMS 64

typedef struct kt_dag kt_dag;

kt_status kt_dag_create(kt_dag **out);
void kt_dag_destroy(kt_dag *d);
/* Adds an operation of estimated cost (seconds, >= 0 and finite); its id is the
 * number of operations added before it. */
kt_status kt_dag_add_node(kt_dag *d, double cost, int32_t *id);
/* `from` must finish before `to` starts. Duplicate edges are allowed (kept once). */
kt_status kt_dag_add_edge(kt_dag *d, int32_t from, int32_t to);
int32_t kt_dag_num_nodes(const kt_dag *d);

/* Roofline estimate of one kernel: launch + max(flops / peak_flops, bytes / bandwidth). */
typedef struct kt_roofline {
  double peak_flops;      /* FLOP/s */
  double bandwidth;       /* bytes/s */
  double launch;          /* seconds a kernel costs beyond its work */
} kt_roofline;
double kt_roofline_cost(const kt_roofline *m, double flops, double bytes);

typedef struct kt_sync {
  int32_t after;    /* record an event on stream[after] after this operation */
  int32_t before;   /* stream[before] waits on it before this operation */
} kt_sync;

typedef struct kt_schedule {
  int32_t n_nodes, n_streams;
  int32_t *stream;          /* per operation, 0..n_streams-1 */
  int32_t *order;           /* issue order: a topological order of all operations */
  double *start, *finish;   /* simulated, per operation */
  double makespan;
  int32_t n_syncs;
  kt_sync *syncs;           /* in issue order of `before` */
} kt_schedule;

kt_status kt_schedule_list(const kt_dag *d, int32_t n_streams, kt_schedule *out);
void kt_schedule_free(kt_schedule *s);
/* KT_OK when s is a valid schedule of d: order is a topological permutation, each
 * stream's simulated intervals do not overlap, and every edge u -> v is implied by
 * u and v sharing a stream (u first) or by a chain of syncs. */
kt_status kt_schedule_check(const kt_dag *d, const kt_schedule *s);

#ifdef __cplusplus
}
#endif
#endif
