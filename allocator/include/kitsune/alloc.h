/* kitsune/alloc.h — the Kitsune device-memory pool.
 *
 * A pool hands out device memory from segments it reserves through a backend
 * (kitsune/backend.h). Requests up to KT_LARGE_THRESHOLD are rounded to a size
 * class and served from per-stream free lists; larger requests are placed by
 * best fit in an address-ordered arena with split and coalesce.
 *
 * Stream contract (what a caller may rely on, and must do):
 *  - A block returned by kt_alloc(pool, size, S, ..) may be used on stream S at once.
 *  - kt_free(pool, p, size, S) must name the stream p was *allocated* on (this is
 *    what PyTorch's pluggable-allocator ABI passes). All work that touched p must
 *    be enqueued on S before the call, or declared with kt_record_stream.
 *  - After kt_free the block is reused immediately only by allocations on S (stream
 *    order makes that safe). If kt_record_stream(p, U) was called for other streams
 *    U, an event is recorded on each U at free time and the block is not handed out
 *    again — on any stream — until all those events have completed.
 *  - Memory is never handed from one stream's free list to another stream while work
 *    that used it may still run; idle memory moves between streams by being returned
 *    to the backend, by coming from a fresh segment, or, in a VMM pool where the pool
 *    would otherwise grow, once an event recorded on the stream that freed it has
 *    completed (no synchronization).
 *
 * Errors: every call returns kt_status. KT_ERR_OOM is distinct from invalid
 * arguments; after an OOM, kt_last_oom() describes it on the calling thread.
 * The library never prints and never exits.
 *
 * Thread safety: every function may be called from any thread. alloc/free of a
 * size class already seen by the calling thread on a stream take no lock, make no
 * host allocation and no backend call (each thread keeps a small cache per stream).
 */
#ifndef KITSUNE_ALLOC_H
#define KITSUNE_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "kitsune/backend.h"
#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KT_QUANTUM          512u               /* every size is a multiple of this */
#define KT_LARGE_THRESHOLD  (1u << 20)          /* requests above this use the arena */
#define KT_NUM_CLASSES      72                  /* see sizeclass.c for the derivation */
#define KT_MAX_STREAMS      1024                /* distinct streams per pool */
#define KT_MAX_USES         8                   /* kt_record_stream streams tracked per block */
#define KT_MAX_ALLOC        ((size_t)1 << 40)   /* larger requests are refused (KT_ERR_OOM) at once */


typedef struct kt_pool kt_pool_t;

typedef struct kt_pool_options {
  int device;             /* device ordinal passed to the backend */
  size_t memory_limit;    /* bytes; 0 = no limit beyond the device */
  int track_lifetimes;    /* 1: stamp each allocation with a time (default 1) */
  /* Bytes a thread cache may free before publishing the decrease to the pool's
   * shared counter (default KT_DEFAULT_PEAK_SLACK). Current values are exact
   * either way. Peaks are exact while one thread allocates at a time; with several
   * threads a peak may overstate the true one by at most peak_slack for each other
   * thread cache. 0 makes peaks exact always, at one shared atomic per call. */
  size_t peak_slack;
  /* What the pool gives back on its own before it grows. Whatever the value, cached
   * memory goes back on kt_empty_cache, when the backend refuses growth (the OOM
   * retry) and when growth would pass the memory limit; never on a free.
   *  KT_RELEASE_SEGMENTS (1): before reserving a new segment, idle segments
   *    that together are at least the request go back (a cudaFree, which synchronizes,
   *    made with no pool lock held): on shape-varying training this held 1.13x the
   *    live bytes instead of 1.89x (bench/results/alloc_shapes.json). A VMM pool maps
   *    granules and unmaps none: once it holds what the workload's layout needs,
   *    allocations make no backend call.
   *  KT_RELEASE_FOLLOW_PEAK (2, default): as 1, and a VMM pool unmaps idle granules (after a
   *    device synchronization) before its mapped total passes its highest value so
   *    far, so reserved follows the live peak more closely, at a synchronization and
   *    remaps on growth that recur in a steady state (docs/allocator.md has numbers).
   *  KT_RELEASE_NEVER (0): nothing; segments stay cached. */
  int release_on_grow;
  /* 1: when the backend has virtual-memory entries, the pool reserves address space
   * (twice the device's memory, or twice the request if larger) and maps 2 MiB
   * granules as blocks need them. Free space then coalesces across what would have
   * been separate segments. reserved counts mapped bytes. 0 (default): cudaMalloc-style
   * segments. */
  int vmm;
  /* Bytes of the segment a request under half of it gets, carved by later requests
   * too (one backend call serves many): KT_DEFAULT_SHARED_SEGMENT, 20 MiB, since a
   * cudaMalloc pair costs 68-77 us on the H100. A multiple of 2 MiB; 0 = the default.
   * A pool on kt_pool_backend_create, whose reserve is a cheap block of its parent,
   * does better with 2 MiB: a graph pool keeps every segment for its life. */
  size_t shared_segment;
} kt_pool_options;

enum { KT_RELEASE_NEVER = 0, KT_RELEASE_SEGMENTS = 1, KT_RELEASE_FOLLOW_PEAK = 2 };

#define KT_DEFAULT_SHARED_SEGMENT ((size_t)20 << 20)

#define KT_DEFAULT_PEAK_SLACK ((size_t)2 << 20)

/* Fills defaults: device 0, no limit, lifetimes tracked, 2 MiB peak slack,
 * idle memory released before growing (KT_RELEASE_FOLLOW_PEAK). */
void kt_pool_options_default(kt_pool_options *opt);

/* The backend must outlive the pool. */
kt_status kt_pool_create(const kt_pool_options *opt, const kt_backend *backend, kt_pool_t **out);
/* Releases every segment back to the backend, live blocks included. */
void kt_pool_destroy(kt_pool_t *pool);

/* size 0 returns *out = NULL and KT_OK (PyTorch allocates 0 bytes and never frees). */
kt_status kt_alloc(kt_pool_t *pool, size_t size, kt_stream_t stream, void **out);
/* size may be 0 (unknown); otherwise it must round to the block's size. */
kt_status kt_free(kt_pool_t *pool, void *ptr, size_t size, kt_stream_t stream);
/* As kt_free, for a block no work can touch any more (the caller synchronized the
 * device after its last use): a large block (> KT_LARGE_THRESHOLD) is at once
 * usable by allocations on every stream; a smaller one returns to its stream. */
kt_status kt_free_idle(kt_pool_t *pool, void *ptr, size_t size);
/* Declares that the live block containing ptr (its start) is used on stream. */
kt_status kt_record_stream(kt_pool_t *pool, void *ptr, kt_stream_t stream);

/* Returns cached memory that is truly idle to the backend. Besides this call, the
 * pool gives memory back only when growth would pass its memory limit, when the
 * backend refuses growth (one retry after releasing the cache), and as
 * kt_pool_options.release_on_grow says; never on a free. */
kt_status kt_empty_cache(kt_pool_t *pool);
/* While held (calls nest), growth never gives idle memory back first: no device
 * synchronization and no cudaFree, which a CUDA graph capture would not survive.
 * The pool grows past its high mark instead, and an out-of-memory is reported
 * without the retry that releases cache. kt_empty_cache still releases. The torch
 * bridge holds a device's pool while a private pool is being filled, and holds
 * every private pool for its whole life: a block freed during a capture stays in
 * use by the graph, so an idle segment of a graph's pool is not idle. */
kt_status kt_pool_hold_releases(kt_pool_t *pool, int hold);
/* While deferred (calls nest), as while a CUDA graph is captured, the pool records
 * and queries no event: recording one on a capturing stream would make it part of
 * the graph, and querying one fails the capture. A block freed then with uses on
 * other streams (kt_record_stream) waits, unused, and when the last deferral ends
 * gets its events on those streams, as PyTorch's allocator does after a capture. */
kt_status kt_pool_defer_events(kt_pool_t *pool, int defer);
/* ---- CUDA graph captures ---------------------------------------------------
 * A capture must not allocate device memory (cudaMalloc and cuMemCreate are not
 * captured: a graph depending on them would be invalid), nor synchronize. The
 * torch bridge gives each graph a private pool whose segments are blocks of the
 * device's pool (kt_pool_backend_create), and before the capture begins calls:
 *
 * kt_pool_prepare_capture: synchronizes the device, makes every free range of the
 * pool's arena usable by any stream (no work touches them now), and grows the
 * pool, within its limit, until one free range of at least `bytes` is ready (VMM:
 * mapped). Growth the device or the limit refuses is not an error: *ready (may be
 * NULL) says the largest range ready. KT_ERR_UNAVAILABLE while releases are held
 * (another capture may be under way; nothing is done). */
kt_status kt_pool_prepare_capture(kt_pool_t *pool, size_t bytes, size_t *ready);

/* A backend whose segments are large blocks of parent (allocated on a stream of
 * their own), so a pool on it draws from parent's cache instead of the device.
 * Releasing one synchronizes the device and returns it to parent for any stream
 * (kt_free_idle). Events, synchronization and memory info are parent's backend's.
 * parent must outlive the backend, and the backend every pool on it. */
kt_backend *kt_pool_backend_create(kt_pool_t *parent);
void kt_pool_backend_destroy(kt_backend *backend);

/* 0 removes the limit. A limit below what is reserved now takes effect as memory is freed. */
kt_status kt_set_memory_limit(kt_pool_t *pool, size_t bytes);
/* fraction in (0, 1] of the device's total memory (asks the backend). */
kt_status kt_set_memory_fraction(kt_pool_t *pool, double fraction);
size_t kt_get_memory_limit(const kt_pool_t *pool);

/* ---- stats ---------------------------------------------------------------- */
typedef struct kt_stat {
  int64_t current;
  int64_t peak;       /* since creation or the last kt_reset_peak_stats */
  int64_t allocated;  /* cumulative increase */
  int64_t freed;      /* cumulative decrease */
} kt_stat;

typedef struct kt_stats {
  /* Identities (checked in tests, exact when no call is in flight):
   *   allocated_bytes.current == sum of sizes of live blocks (rounded sizes)
   *   active_bytes.current    == allocated_bytes.current + bytes of freed blocks
   *                              still waiting for other streams' events
   *   reserved_bytes.current  == sum of segment sizes held from the backend
   *                              (VMM: of granules mapped)
   *   reserved >= active, and x.current == x.allocated - x.freed for each stat. */
  kt_stat allocated_bytes;
  kt_stat active_bytes;
  kt_stat reserved_bytes;
  kt_stat requested_bytes;  /* unrounded sizes of live blocks (current/allocated/freed; no peak) */
  kt_stat allocations;      /* live blocks (count) */
  kt_stat segments;         /* live segments (count) */
  uint64_t num_allocs, num_frees;
  uint64_t num_alloc_retries;  /* OOM recovered by releasing cache */
  uint64_t num_ooms;           /* KT_ERR_OOM returned */
  uint64_t num_backend_reserves, num_backend_releases;
  uint64_t num_large_allocs;
  uint64_t num_pending_frees;  /* frees that waited on other streams */
  uint64_t class_allocs[KT_NUM_CLASSES];  /* cumulative allocations per size class */
  uint64_t class_live[KT_NUM_CLASSES];    /* live blocks per size class */
  size_t memory_limit;
  size_t largest_free_block;   /* largest free range in the arena (not slabs); VMM: mapped */
  uint64_t num_release_syncs;  /* device synchronizations to unmap idle granules (VMM) */
  int vmm;                     /* 1: the pool maps granules (kt_pool_options.vmm, backend permitting) */
} kt_stats;

kt_status kt_get_stats(kt_pool_t *pool, kt_stats *out);
/* Peak := current for every stat. */
void kt_reset_peak_stats(kt_pool_t *pool);
/* Cumulative values (x.allocated, x.freed, num_* counts, class_allocs) restart
 * from zero, as torch.cuda.reset_accumulated_memory_stats does; current values
 * and peaks are untouched (so current == allocated - freed no longer holds). */
void kt_reset_accumulated_stats(kt_pool_t *pool);

/* ---- out-of-memory diagnosis ---------------------------------------------- */
typedef struct kt_oom_info {
  size_t requested;       /* the size asked for */
  size_t rounded;         /* what the pool tried to reserve */
  size_t live;            /* allocated bytes */
  size_t cached;          /* reserved - allocated: held by the pool, not in use */
  size_t reserved;
  size_t limit;           /* 0 = none */
  size_t largest_free;    /* largest free block in the arena */
  size_t device_free, device_total;  /* from the backend, 0 when unknown */
  int hit_limit;          /* 1 when the pool's limit refused the reservation */
  int device;
} kt_oom_info;

/* The last OOM on the calling thread (all zero before one). */
const kt_oom_info *kt_last_oom(void);
/* One-line diagnosis into buf; returns what snprintf returns. */
int kt_format_oom(const kt_oom_info *info, char *buf, size_t len);

/* ---- lifetime tracking ---------------------------------------------------- */
typedef struct kt_block_info {
  void *ptr;
  size_t size;           /* rounded size */
  size_t requested;      /* size passed to kt_alloc */
  kt_stream_t stream;    /* allocation stream */
  uint64_t alloc_ns;     /* CLOCK_MONOTONIC ns at allocation; 0 when not tracked */
  int num_uses;          /* other streams recorded with kt_record_stream */
  kt_stream_t uses[KT_MAX_USES];
  int size_class;        /* -1 for large blocks */
} kt_block_info;

/* Info on the live block that starts at ptr. */
kt_status kt_block_query(kt_pool_t *pool, const void *ptr, kt_block_info *out);

/* ---- size classes --------------------------------------------------------- */
/* Class index for a size in [1, KT_LARGE_THRESHOLD]; -1 above. Table lookup. */
int kt_size_class(size_t size);
/* The formula the table is built from (for tests). */
int kt_size_class_formula(size_t size);
size_t kt_class_size(int cls);

/* ---- trace ---------------------------------------------------------------- */
/* CSV, one line per event: thread,time_ns,action,ptr,size,stream
 * action is alloc|free|record_stream|empty_cache|oom. */
kt_status kt_trace_start(kt_pool_t *pool, const char *path);
kt_status kt_trace_stop(kt_pool_t *pool);

/* ---- memory map: what a snapshot shows ------------------------------------- */
/* A segment: device memory the pool holds (a backend segment, or a run of mapped
 * granules of a VMM range), and its blocks in address order, which cover it exactly:
 * a live block (requested bytes, stream it was allocated on), one freed but waiting
 * for other streams' work (pending), or free space (an idle slab block, a slab's
 * tail, a free extent). */
enum { KT_WALK_FREE = 0, KT_WALK_LIVE = 1, KT_WALK_PENDING = 2 };
typedef struct kt_walk_block {
  uintptr_t addr;
  size_t size;          /* bytes it occupies: a class's size, a large block's extent */
  size_t requested;     /* live and pending: what the caller asked for; 0 for free space */
  kt_stream_t stream;   /* live and pending: the allocation stream; free: NULL */
  int state;            /* KT_WALK_* */
} kt_walk_block;
typedef struct kt_walk_segment {
  uintptr_t base;
  size_t size;
  int vmm;              /* 1: mapped granules of a VMM range */
} kt_walk_segment;
/* Calls fn(ctx, segment, NULL) as each segment begins, then fn(ctx, segment, block)
 * for each of its blocks. Holds the pool's locks throughout (fn must not call into
 * the pool); a block that another thread allocates or frees meanwhile is shown in
 * either state. A non-zero return from fn stops the walk: KT_ERR_INVALID is returned. */
typedef int (*kt_walk_fn)(void *ctx, const kt_walk_segment *seg, const kt_walk_block *blk);
kt_status kt_pool_walk(kt_pool_t *pool, kt_walk_fn fn, void *ctx);

/* ---- debugging ------------------------------------------------------------ */
/* O(n) walk of every structure checking invariants; KT_OK or KT_ERR_INVALID.
 * Call it while no other thread is inside the pool (a checkpoint). */
kt_status kt_pool_validate(kt_pool_t *pool);

#ifdef __cplusplus
}
#endif
#endif
