/* kitsune/capplan.h — a CUDA graph's memory laid out from its recorded lifetimes.
 *
 * A graph captured into an ordinary pool keeps every segment its capture touched,
 * laid out by the order blocks happened to be freed in. compile_step captures a
 * step twice instead:
 *   1. into a private pool while a kt_caprec records each allocation (size, stream),
 *      free and cross-stream use;
 *   2. kt_capplan_create packs the recorded lifetimes into one arena (kt_memplan);
 *   3. the step is captured again, and a kt_placer serves its allocations at the
 *      planned offsets of an arena it reserves from a backend (the device pool's:
 *      kt_pool_backend_create); the first graph is dropped.
 *
 * The plan is a guess about the second capture; safety never rests on it. Each
 * placement is checked against the blocks already placed in the same capture: it
 * is refused (KT_ERR_UNAVAILABLE: the caller allocates from its pool instead) when
 * it would overlap a block that is live, or one that another stream used
 * (kt_placer_use) or that was allocated on another stream, unless the capture's
 * order (below) puts that block's work before this one's.
 *
 * Contract of a placer (what compile_step guarantees): the graphs captured through
 * one placer replay one at a time, and whatever an earlier capture left live in the
 * arena (a graph's output) is read before another of its graphs replays. So a new
 * capture may lay blocks over an earlier capture's live ones; those are still
 * tracked, so their frees are recognised, and a placement never starts at one's
 * address.
 *
 * Streams. Without a kt_capture_order, bytes are shared only within one stream, and a
 * block used on another stream (Tensor.record_stream) is never reused. Given one (the
 * bridge's asks the CUDA graph being captured), a recording and a placer also note,
 * for each block, the graph nodes its streams' next work would depend on when it is
 * allocated and when it is freed. A block may then share bytes with a later one on
 * any stream when every node its streams had reached at its free is an ancestor of
 * (or one of) the nodes the later block's stream had reached at its allocation:
 * whatever used the block is then finished before anything that can use the later
 * one starts (the edges a stream's join by an event leaves in the graph). The
 * placer checks this again in the second capture's own graph; a question the
 * callbacks cannot answer counts as "no".
 *
 * Recorded blocks still live when the plan is made (a cuBLAS workspace the capture
 * created and PyTorch keeps) are left out: the second capture will not allocate them
 * again. Blocks freed after the capture ended live to the plan's end.
 *
 * Errors: KT_ERR_INVALID (NULL, unknown or duplicate pointer), KT_ERR_HOST_OOM, and
 * what the backend returns for the arena. On error nothing changes. None of these
 * functions lock: the caller serialises calls on one object.
 */
#ifndef KITSUNE_CAPPLAN_H
#define KITSUNE_CAPPLAN_H

#include <stddef.h>
#include <stdint.h>

#include "kitsune/backend.h"
#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sizes are rounded up to this; offsets are multiples of it. */
#define KT_CAPPLAN_ALIGN 512u
/* A placement takes the first unplaced planned block of its size among the next
 * this many, so one allocation the plan did not see does not derail the rest. */
#define KT_CAPPLAN_WINDOW 64

/* Streams one block is noted on (where it was allocated and used); a block used on
 * more is treated as unordered. */
#define KT_CAPPLAN_STREAMS 8
/* More planned blocks than this: the plan keeps streams apart (its order matrix
 * would take n^2 / 8 bytes). */
#define KT_CAPPLAN_ORDER_MAX_BLOCKS 16384
/* More planned blocks than this: kt_capplan_create_within plans without waits (each
 * threshold it tries packs the blocks again, O(n^2)). */
#define KT_CAPPLAN_WAIT_MAX_BLOCKS 4096

/* ---- the order of a capture's work (optional) ------------------------------------- */
/* Node ids are the captured graph's nodes, nonzero. Both callbacks write the first
 * min(*n, cap) items and set *n to how many there are (call again with room when
 * *n > cap); anything but KT_OK means "cannot say". Called with the caller's locks
 * held; they must not call back into the allocator. */
typedef struct kt_capture_order {
  void *ctx;
  /* the nodes the next operation captured on stream will depend on */
  kt_status (*frontier)(void *ctx, kt_stream_t stream, uint64_t *nodes, size_t cap, size_t *n);
  /* the captured graph's edges so far that order completion (from[k] -> to[k]) */
  kt_status (*edges)(void *ctx, uint64_t *from, uint64_t *to, size_t cap, size_t *n);
  /* optional (NULL: none): makes the next operation captured on stream depend on
   * nodes too (n >= 1 nodes of this capture). A placer by a plan made within a budget
   * (kt_capplan_create_within) calls it to order a block's work after the work of an
   * earlier block whose bytes it takes. */
  kt_status (*wait)(void *ctx, kt_stream_t stream, const uint64_t *nodes, size_t n);
} kt_capture_order;

/* ---- recording --------------------------------------------------------------- */
typedef struct kt_caprec kt_caprec;

kt_status kt_caprec_create(kt_caprec **out);
void kt_caprec_destroy(kt_caprec *rec);
/* size 0 is ignored. */
kt_status kt_caprec_alloc(kt_caprec *rec, const void *ptr, size_t size, kt_stream_t stream);
kt_status kt_caprec_free(kt_caprec *rec, const void *ptr);
/* ptr (a live block's start) is used on stream too (Tensor.record_stream). */
kt_status kt_caprec_use(kt_caprec *rec, const void *ptr, kt_stream_t stream);
/* The capture ended: later frees count as lasting to the plan's end. With an order,
 * the captured graph's edges are taken now (its nodes stay valid until then). */
kt_status kt_caprec_end(kt_caprec *rec);
/* Notes the order of the capture's work from now on (ord is copied; NULL: none). */
kt_status kt_caprec_set_order(kt_caprec *rec, const kt_capture_order *ord);

/* When each node of the recorded graph finished in a replay of it (ns from the
 * replay's start; nodes as the order's callbacks named them, nonzero and each once):
 * kt_capplan_create_within then buys its waits by them (below). n 0: none again.
 * Replaces what an earlier call set; on error nothing changes. */
kt_status kt_caprec_set_times(kt_caprec *rec, const uint64_t *nodes, const int64_t *finish_ns, size_t n);

typedef struct kt_caprec_info {
  int32_t blocks;        /* allocations recorded */
  int32_t live;          /* of them, still live */
  int32_t freed_after;   /* freed after kt_caprec_end */
} kt_caprec_info;
kt_status kt_caprec_get_info(const kt_caprec *rec, kt_caprec_info *out);

/* Recorded block i (0 <= i < blocks), for logs and analysis. */
typedef struct kt_caprec_block {
  uint64_t size;         /* rounded up to KT_CAPPLAN_ALIGN */
  kt_stream_t stream;    /* where it was allocated */
  int64_t start, end;    /* recorded events; end -1 while live */
  int32_t after;         /* freed after the capture ended */
  int32_t uses;          /* streams it was used on besides its own */
  int32_t unordered;     /* no order noted for it */
} kt_caprec_block;
kt_status kt_caprec_get_block(const kt_caprec *rec, int32_t i, kt_caprec_block *out);

/* ---- the plan ------------------------------------------------------------------ */
typedef struct kt_capplan kt_capplan;

/* Lifetimes from rec: a block freed during the capture lives over [alloc, free) in
 * the order of recorded events; one freed after it to the end. Without an order (or
 * its graph), blocks share bytes only with blocks of their own stream (a kt_memplan
 * group per stream) and a block used on another stream lives to the end; with one,
 * blocks share bytes as the order allows (above). Live blocks are left out. rec may
 * be destroyed afterwards. */
kt_status kt_capplan_create(const kt_caprec *rec, kt_capplan **out);
/* kt_capplan_create, and when its plan's extent passes budget bytes, a block whose
 * work the order does not put after an earlier block's may take that block's bytes
 * all the same, at the price of a wait: the placer makes the later block's stream
 * wait for the work that used the earlier one (kt_capture_order.wait). Waits cost
 * overlap between streams, so they are bought from the far end: pairs whose gap (the
 * recorded events from the earlier block's free to the later one's allocation) is at
 * least a threshold, the largest threshold whose plan fits the budget (found by
 * bisection). With node times (kt_caprec_set_times) for every node the waitable
 * blocks' frontiers name, pairs are also bought by their slack in that replay (when
 * the work the later block's stream had reached at its allocation finished, less
 * when the work that used the earlier block had, ns; a wait with slack cost that
 * replay nothing), the largest slack threshold that fits, and of the fitting
 * packings either bisection tried the plan kept is the one whose waits delay the
 * replay least, to first order (wait_delay_ns). When not even every such pair fits,
 * no waits: they would order the streams and still miss the budget. Only with an order (the recording's graph) and up to
 * KT_CAPPLAN_WAIT_MAX_BLOCKS planned blocks; blocks freed after the capture or noted
 * on no order are never waited for. kt_capplan_info says what was chosen. */
kt_status kt_capplan_create_within(const kt_caprec *rec, uint64_t budget, kt_capplan **out);
void kt_capplan_destroy(kt_capplan *plan);

typedef struct kt_capplan_info {
  int32_t blocks;        /* planned blocks */
  size_t arena_bytes;    /* what a placer on a pool's backend reserves for it: the plan's
                          * extent, plan_bytes (a backend with a coarser reserve_quantum
                          * takes more: kt_placer_stats.arena_bytes) */
  size_t plan_bytes;     /* the plan's extent (kt_memplan's total) */
  size_t peak_bytes;     /* most bytes live at once: no plan is smaller */
  /* the sum over streams of each stream's own live peak: no plan that keeps streams
   * apart is smaller (equal to peak_bytes on one stream) */
  size_t group_peak_bytes;
  int32_t graph_nodes;   /* nodes of the recorded graph the plan ordered blocks by; 0: none */
  int32_t cross_shares;  /* pairs of blocks of different streams (or used on another) the
                          * order let share bytes */
  /* kt_capplan_create_within: the fewest recorded events between a pair of blocks
   * only a wait lets share bytes (the threshold, when chosen by events; -1: no waits,
   * the plan fit without, could not have them, or would miss the budget with every
   * one), and how many such pairs there are */
  int64_t wait_gap;
  int32_t wait_shares;
  uint64_t budget;       /* as given (UINT64_MAX: kt_capplan_create) */
  size_t unwaited_bytes; /* the plan's extent without waits */
  int32_t wait_timed;    /* 1: node times chose the plan among those tried */
  int32_t wait_by_slack; /* 1: its pairs are those with at least a threshold of slack; 0:
                          * those at least a threshold of recorded events apart */
  int64_t wait_slack_ns; /* by slack: the least slack of a waited pair (INT64_MIN: not) */
  int64_t wait_delay_ns; /* with node times, its waits' first-order delay of the replay */
} kt_capplan_info;
kt_status kt_capplan_get_info(const kt_capplan *plan, kt_capplan_info *out);
/* Planned block j (the recorded blocks freed when planned, in recorded order): its
 * offset in the arena and its size. */
kt_status kt_capplan_get_block(const kt_capplan *plan, int32_t j, uint64_t *offset, uint64_t *size);
/* For analysis (the bridge's KITSUNE_CAPPLAN_LOG): the pairs of planned blocks
 * kt_capplan_create let share bytes, from the recording it was made from. bits holds
 * n * n bits, row-major: bit i * n + j is set when block i's life ends at or before
 * block j's start and the recorded order (without one: the stream) lets j reuse i's
 * bytes. n must be the planned blocks (kt_capplan_info.blocks). */
kt_status kt_caprec_share_matrix(const kt_caprec *rec, int32_t n, uint64_t *bits);
/* Writes plan, made from rec, to dir/capplan_<pid>_<n>.csv (a row a recorded block:
 * size, stream, recorded events, flags, planned offset or -1) and the pairs
 * kt_caprec_share_matrix gives to dir/capplan_<pid>_<n>_share.txt, n counting this
 * process's calls (scheduler/src/capplan_log.c has the format; tools/capplan_log.py
 * reads it). Best effort: KT_ERR_IO when the CSV cannot be written (the share file is
 * skipped silently), KT_ERR_INVALID for a NULL or empty dir. Thread-safe. */
kt_status kt_capplan_log(const char *dir, const kt_caprec *rec, const kt_capplan *plan);

/* ---- placing ------------------------------------------------------------------- */
typedef struct kt_placer kt_placer;

/* Arenas come from be (reserve / release) on device; be must outlive the placer. */
kt_status kt_placer_create(const kt_backend *be, int device, kt_placer **out);
/* Releases every arena: the caller makes sure no block of them is in use. */
void kt_placer_destroy(kt_placer *pl);

/* Starts placing one capture by plan (copied; it may be destroyed afterwards). The
 * arena is kept when large enough; otherwise a larger one is reserved, and the old
 * one is released at once when no block of it is live, else retired until its last
 * block is freed (then kt_placer_trim releases it). Call outside a capture: a
 * reserve may map memory, a release synchronizes. On error the placer is as before
 * and places nothing until the next begin. */
kt_status kt_placer_begin(kt_placer *pl, const kt_capplan *plan);
/* Notes the order of the capture being placed (ord copied; NULL: none): blocks then
 * share bytes across streams as the order allows. Call before kt_placer_begin. */
kt_status kt_placer_set_order(kt_placer *pl, const kt_capture_order *ord);
/* Ends placing (later allocations are refused); frees are still recognised. */
void kt_placer_end(kt_placer *pl);
/* KT_OK with *out in the arena, or KT_ERR_UNAVAILABLE (not placing, no planned
 * block of this size ahead, or the checks above refuse it). size 0: UNAVAILABLE.
 * By a plan with waits (kt_capplan_info.wait_gap >= 0), an overlap with freed blocks
 * that the order does not put first, all of them noted on it, is bought with one
 * call of the order's wait (the stream then waits for the nodes their streams had
 * reached at their frees that it does not follow yet) and checked again. */
kt_status kt_placer_alloc(kt_placer *pl, size_t size, kt_stream_t stream, void **out);
/* KT_ERR_INVALID when ptr is not a live block of this placer. */
kt_status kt_placer_free(kt_placer *pl, const void *ptr);
kt_status kt_placer_use(kt_placer *pl, const void *ptr, kt_stream_t stream);
/* Releases retired arenas with no live block (synchronizes when it does). */
kt_status kt_placer_trim(kt_placer *pl);

typedef struct kt_placer_stats {
  size_t arena_bytes;      /* all arenas held, retired ones included */
  int32_t arenas;          /* how many (each is one block of the backend) */
  size_t live_bytes;       /* blocks live in them (rounded sizes) */
  int64_t live_blocks;
  /* the last capture begun: */
  int32_t planned;         /* blocks in its plan */
  int32_t placed;          /* allocations served at their planned offset */
  int32_t refused;         /* allocations refused while placing (served by the pool); 0-byte
                            * requests are not placed and not counted */
  size_t plan_bytes;       /* its plan's extent */
  size_t peak_bytes;       /* its recording's live peak */
  int32_t waits;           /* placements that made their stream wait (plans with waits) */
} kt_placer_stats;
kt_status kt_placer_get_stats(const kt_placer *pl, kt_placer_stats *out);

#ifdef __cplusplus
}
#endif
#endif
