/* allocator/src/internal.h — the pool's data structures. Not installed.
 *
 * Memory layout
 *   segment   a range reserved from the backend (multiple of 2 MiB, 2 MiB aligned).
 *   extent    a sub-range of one segment, in address order: FREE, SLAB or LARGE.
 *   slab      a 64 KiB-aligned extent cut into equal blocks of one size class.
 *   block     what kt_alloc returns: a slab slot, or a whole LARGE extent.
 *   heap      per-stream state: one free list per size class + the slabs it owns
 *             + the arena's free extents tagged with this stream.
 *   tcache    per-thread, per-(pool, stream) cache in front of a heap: one short
 *             list per class, touched only by its thread, so the size-class fast
 *             path takes no lock. A block moves between a tcache and its heap in
 *             batches; it never leaves its stream.
 *
 * Invariants (kt_pool_validate checks them, at a quiescent point):
 *   reserved == sum(segment sizes) == sum(extent sizes over all segments)
 *   a FREE extent is in exactly one bin set: its tag's heap, or the untagged set
 *   no two address-adjacent FREE extents of one segment share a tag (coalesced),
 *     except on either side of a VMM range's fence
 *   no extent spans a VMM range's fence; SLAB extents lie above it, LARGE below
 *   blocks of a slab in state FREE == slab.nfree (on the heap's list)
 *                                     + those in tcache bins of the slab's stream
 *   packed.allocated_units*512 == sum of live block sizes
 *   packed.pending_units*512   == sum of sizes of blocks waiting for events
 *
 * Locks, outermost first: kt__registry (global mutex: tcache lists) -> heap_lock
 * (mutex, creating heaps; stats and cache release walk the heap list under it) ->
 * arena_lock (mutex) -> heap.lock (spin). pending_lock and trace_lock are leaves.
 * The size-class fast path takes no lock; a tcache refill or flush takes one
 * heap.lock. No path takes arena_lock or heap_lock while holding a heap.lock.
 */
#ifndef KT_INTERNAL_H
#define KT_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <time.h>

#include "kitsune/alloc.h"

#define kt_likely(x)   __builtin_expect(!!(x), 1)
#define kt_unlikely(x) __builtin_expect(!!(x), 0)
#define KT_NOINLINE __attribute__((noinline))
#define KT_INLINE static inline __attribute__((always_inline))
#define KT_CACHELINE 64

/* Debug asserts: compiled in with -DKT_DEBUG (make test builds them in). */
#ifdef KT_DEBUG
#include <stdlib.h>
#define kt_assert(c) do { if (kt_unlikely(!(c))) kt__assert_fail(#c, __FILE__, __LINE__); } while (0)
void kt__assert_fail(const char *cond, const char *file, int line) __attribute__((noreturn));
#else
#define kt_assert(c) ((void)0)
#endif

#define KT_PAGE_SHIFT 16
#define KT_PAGE ((size_t)1 << KT_PAGE_SHIFT)         /* slab alignment, radix granule */
#define KT_VA_BITS 48                                 /* addresses must be below 2^48 */
#define KT_RADIX_BITS (KT_VA_BITS - KT_PAGE_SHIFT)   /* 32 */
#define KT_RADIX_LEAF_BITS 16
#define KT_RADIX_ROOT_BITS (KT_RADIX_BITS - KT_RADIX_LEAF_BITS)
#define KT_NUM_BINS 304                               /* arena bins: see bin_of() */
#define KT_BIN_WORDS ((KT_NUM_BINS + 63) / 64)
#define KT_HEAP_TABLE 2048                            /* 2x KT_MAX_STREAMS, power of two */

/* ---- spinlock: critical sections here are a few loads and stores ---------- */
typedef struct { atomic_int v; } kt_spinlock;
void kt__spin_lock_slow(kt_spinlock *l);
static inline void kt_spin_lock(kt_spinlock *l) {
  if (kt_likely(!atomic_exchange_explicit(&l->v, 1, memory_order_acquire))) return;
  kt__spin_lock_slow(l);
}
static inline void kt_spin_unlock(kt_spinlock *l) {
  atomic_store_explicit(&l->v, 0, memory_order_release);
}

typedef struct kt_heap kt_heap;
typedef struct kt_slab kt_slab;
typedef struct kt_extent kt_extent;
typedef struct kt_segment kt_segment;

enum { KT_BLOCK_FREE = 0, KT_BLOCK_LIVE = 1, KT_BLOCK_PENDING = 2 };

/* Other streams that used a block (kt_record_stream); allocated on first use. */
typedef struct kt_uses {
  struct kt_uses *next;           /* pool's recycle list */
  int n;                          /* streams in s[] */
  int overflow;                   /* more than KT_MAX_USES: free synchronizes */
  kt_stream_t s[KT_MAX_USES];
  kt_event_t ev[KT_MAX_USES];     /* recorded at free time */
} kt_uses;

/* One cache line per block: blocks of one slab that sit in different threads'
 * caches never share a line (an 80-byte descriptor did, and two threads on one
 * stream slowed 4x). The rounded size is the class's, or the large extent's. */
typedef struct kt_block {
  struct kt_block *next;   /* heap free list, or pending list */
  uintptr_t addr;
  size_t requested;
  uint64_t alloc_ns;       /* kt__coarse_ns() at allocation, 0 when not tracked */
  kt_heap *heap;           /* allocation stream */
  kt_slab *slab;           /* NULL for large blocks */
  kt_uses *uses;
  int16_t cls;             /* -1 for large */
  uint8_t state;
} __attribute__((aligned(KT_CACHELINE))) kt_block;

_Static_assert(sizeof(kt_block) == KT_CACHELINE, "a block descriptor is one cache line");

struct kt_slab {
  uintptr_t base;
  size_t bytes;
  uint64_t magic;          /* ceil(2^40 / class size): index = off*magic >> 40 */
  kt_extent *ext;
  kt_heap *heap;
  kt_slab *next;           /* heap's slab list, or the pool's retired list */
  uint32_t nblocks, nfree; /* nfree: blocks on the heap's list, under heap.lock */
  uint32_t vcount;         /* scratch for kt_pool_validate */
  int cls;
  kt_block blocks[];
};

/* Arena bins: a bitmap of non-empty bins + list heads. */
typedef struct kt_bins {
  uint64_t bits[KT_BIN_WORDS];
  kt_extent *head[KT_NUM_BINS];
  size_t count;
} kt_bins;

enum { KT_EXT_FREE = 0, KT_EXT_SLAB = 1, KT_EXT_LARGE = 2 };

struct kt_extent {
  uintptr_t addr;
  size_t size;
  kt_extent *aprev, *anext;   /* address order within the segment */
  kt_extent *fprev, *fnext;   /* bin list while FREE */
  kt_segment *seg;
  kt_heap *tag;               /* FREE: stream it is confined to (NULL: any) */
  uint64_t seq;               /* FREE: pool's put_seq when it (or its newest part) was freed */
  kt_slab *slab;              /* SLAB */
  kt_block blk;               /* LARGE: the block */
  uint16_t bin;
  uint8_t kind;
};

struct kt_segment {
  uintptr_t base;
  size_t size;               /* bytes of memory, or of address space for a VMM range */
  uint8_t *gmap;             /* VMM range: a byte a granule, 1 = mapped; NULL: backend segment */
  size_t mapped;             /* VMM range: bytes mapped */
  uintptr_t fence;           /* VMM range: its middle; slabs above, large blocks below, and
                              * no free extent spans it (0: a backend segment) */
  kt_extent *first;
  kt_segment *prev, *next;
  void *nvtx_heap;
};

/* Counters with one writer (a tcache's thread, or a heap under its lock), read
 * by kt_get_stats from any thread: relaxed atomics, so increments are plain
 * load-add-store (no lock prefix) and reads are never torn. */
typedef _Atomic uint64_t kt_counter;
static inline void kt__inc(kt_counter *c, uint64_t v) {
  atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + v, memory_order_relaxed);
}
static inline uint64_t kt__get(const kt_counter *c) { return atomic_load_explicit(c, memory_order_relaxed); }

/* Counts and rounded bytes are derived at read time from the per-class counts
 * (count x class size), so a call bumps two counters, not four. */
typedef struct kt_tstats {
  kt_counter req_alloc, req_freed;         /* requested bytes, cumulative */
  kt_counter class_alloc[KT_NUM_CLASSES];
  kt_counter class_free[KT_NUM_CLASSES];
} kt_tstats;

struct kt_heap {
  kt_spinlock lock;
  kt_stream_t stream;
  kt_block *free[KT_NUM_CLASSES];
  kt_slab *slabs;
  kt_bins bins;            /* under the pool's arena_lock */
  /* Reclaim (arena_lock): an event recorded on this stream when the arena had to grow;
   * once it completes, the free extents tagged with this heap whose seq is at most
   * reclaim_seq become untagged (their stream's work finished). NULL: none armed. */
  kt_event_t reclaim_ev;
  uint64_t reclaim_seq;
  kt_heap *next;           /* pool's list of heaps */
} __attribute__((aligned(KT_CACHELINE)));

/* Per-class cap on blocks a tcache keeps: 256 KiB worth, 1 to 32 blocks. */
#define KT_TCACHE_BYTES ((size_t)256 << 10)
#define KT_TCACHE_MAX 32

typedef struct kt_tbin { kt_block *head; uint32_t n, cap; } kt_tbin;

typedef struct kt_tcache {
  kt_pool_t *_Atomic pool;     /* NULL once the pool is destroyed */
  kt_heap *heap;
  kt_stream_t stream;
  /* Freed units not yet taken off packed.allocated (single writer; stats read it):
   *   true allocated bytes == packed.allocated*512 - sum over tcaches of credit*512
   * An allocation spends credit before it touches packed, a free adds to it and
   * publishes once it passes pool->slack_units. */
  kt_counter credit;
  _Atomic int flush_request;   /* set by other threads' empty_cache / OOM */
  kt_tbin bins[KT_NUM_CLASSES];
  kt_tstats st;
  struct kt_tcache *pnext, *pprev;  /* pool's list (kt__registry) */
  struct kt_tcache *tnext;          /* owning thread's list */
} __attribute__((aligned(KT_CACHELINE))) kt_tcache;

typedef struct kt_heap_slot {
  _Atomic uintptr_t key;   /* stream + 1; 0 = empty */
  kt_heap *_Atomic heap;
} kt_heap_slot;

/* Slab geometry per class, computed once. */
typedef struct kt_class_geom {
  size_t size, slab_bytes;
  uint32_t nblocks;
  uint64_t magic;
} kt_class_geom;

struct kt_pool {
  /* -- read-mostly, hot -- */
  const kt_backend *be;
  int device;
  int track;                           /* lifetimes */
  uint64_t slack_units;                /* peak_slack / 512 */
  int release_on_grow;                 /* options: release idle segments before growing */
  size_t shared_segment;               /* options: the segment small requests share */
  int vmm;                             /* growth maps granules of address ranges (kt_pool_options.vmm) */
  _Atomic int hold_releases;           /* kt_pool_hold_releases: growth releases nothing */
  _Atomic int hooks;                   /* trace on | nvtx regions on */
  _Atomic uintptr_t *_Atomic radix[1u << KT_RADIX_ROOT_BITS];
  kt_heap_slot heaps[KT_HEAP_TABLE];

  /* -- the one hot global: allocated units (low 32) | pending units (high 32) -- */
  _Alignas(KT_CACHELINE) _Atomic uint64_t packed;
  _Atomic int64_t peak_allocated, peak_active;   /* bytes */

  /* -- slow paths -- */
  _Alignas(KT_CACHELINE) pthread_mutex_t arena_lock;
  kt_segment *segments;
  kt_bins untagged;
  size_t limit;
  int64_t reserved, reserved_peak, reserved_total, released_total;
  int64_t nsegments, nsegments_peak, nsegments_total;
  uint64_t n_reserves, n_releases, n_retries, n_ooms;   /* VMM: map and unmap calls */
  size_t vmm_range;                    /* address space a VMM range reserves (0: not yet known) */
  size_t vmm_device;                   /* the device's memory (0: unknown): larger requests fail at once */
  int64_t vmm_high;                    /* most bytes ever mapped (KT_RELEASE_FOLLOW_PEAK: growth past it unmaps idle granules first) */
  uint64_t n_trims;                    /* synchronizations to unmap idle granules */
  uint64_t put_seq;                    /* extents freed into the arena so far (kt_extent.seq) */
  kt_extent *spare_extents;            /* recycled descriptors, linked by anext */
  int nspare_extents;
  int64_t large_req_alloc, large_req_freed, large_bytes_alloc, large_bytes_freed;
  uint64_t large_nalloc, large_nfree;
  kt_slab *retired[KT_NUM_CLASSES];    /* slab descriptors kept for reuse */
  kt_stats acc_base;                   /* cumulative values at the last reset (arena_lock) */

  pthread_mutex_t heap_lock;           /* creating heaps */
  kt_heap *heap_list;
  int nheaps;

  kt_tcache *tcaches;                  /* live tcaches of all threads (kt__registry) */
  kt_tstats retired_stats;             /* stats of tcaches whose thread exited (kt__registry) */

  pthread_mutex_t pending_lock;
  kt_block *pending;
  kt_block *deferred;                  /* freed while events were deferred (a capture): no events yet */
  _Atomic int defer_events;            /* kt_pool_defer_events depth; changes under pending_lock */
  _Atomic int npending;
  uint64_t n_pending_frees;
  kt_event_t *event_cache;             /* recycled events */
  int nevents, event_cap;
  kt_uses *uses_cache;

  pthread_mutex_t trace_lock;
  FILE *trace;

  void *nvtx_domain;
  int nvtx_regions;
};

/* kt__registry guards every pool's tcache list (tcaches outlive or die with pools). */
extern pthread_mutex_t kt__registry;

/* ---- size classes ---------------------------------------------------------- */
extern uint8_t kt__class_table[KT_LARGE_THRESHOLD / KT_QUANTUM];
extern kt_class_geom kt__geom[KT_NUM_CLASSES];
void kt__sizeclass_init(void);
static inline int kt__class_of(size_t size) {  /* 1 <= size <= KT_LARGE_THRESHOLD */
  return kt__class_table[(size - 1) >> 9];
}

static inline size_t kt__block_size(const kt_block *b) {
  if (b->slab) return kt__geom[b->cls].size;
  return ((const kt_extent *)((const char *)b - offsetof(kt_extent, blk)))->size;
}

/* ---- radix: page -> (slab* | 1) or (large extent starting in the page) ------ */
static inline uintptr_t kt__radix_get(kt_pool_t *p, uintptr_t addr) {
  uintptr_t key = addr >> KT_PAGE_SHIFT;
  if (kt_unlikely(key >> KT_RADIX_BITS)) return 0;
  _Atomic uintptr_t *leaf = atomic_load_explicit(&p->radix[key >> KT_RADIX_LEAF_BITS], memory_order_acquire);
  if (kt_unlikely(!leaf)) return 0;
  return atomic_load_explicit(&leaf[key & ((1u << KT_RADIX_LEAF_BITS) - 1)], memory_order_acquire);
}
kt_status kt__radix_set_range(kt_pool_t *p, uintptr_t addr, size_t bytes, uintptr_t val);
kt_status kt__radix_set(kt_pool_t *p, uintptr_t addr, uintptr_t val);
void kt__radix_free(kt_pool_t *p);

/* ---- time: allocation stamps at clock-tick resolution ----------------------
 * CLOCK_MONOTONIC_COARSE reads the kernel's last tick from the vDSO: 6.5-7.4 ns on the
 * H100 host where rdtsc costs 19 ns and CLOCK_MONOTONIC 33 ns
 * (bench/results/probe_costs_cuda*.txt), at 1-4 ms resolution, which is what
 * lifetime reports need. */
static inline uint64_t kt__coarse_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
uint64_t kt__now_ns(void);

/* ---- packed allocated/pending counter -------------------------------------- */
#define KT_UNITS(bytes) ((uint64_t)(bytes) >> 9)
static inline void kt__peak_max(_Atomic int64_t *peak, int64_t v) {
  int64_t cur = atomic_load_explicit(peak, memory_order_relaxed);
  while (kt_unlikely(v > cur) &&
         !atomic_compare_exchange_weak_explicit(peak, &cur, v, memory_order_relaxed, memory_order_relaxed)) {}
}
/* One atomic add; peaks compared against the value this add produced. */
static inline void kt__count_alloc(kt_pool_t *p, size_t bytes) {
  uint64_t v = atomic_fetch_add_explicit(&p->packed, KT_UNITS(bytes), memory_order_relaxed) + KT_UNITS(bytes);
  int64_t alloc = (int64_t)(v & 0xffffffffu) << 9, pend = (int64_t)(v >> 32) << 9;
  kt__peak_max(&p->peak_allocated, alloc);
  kt__peak_max(&p->peak_active, alloc + pend);
}
static inline void kt__count_free(kt_pool_t *p, size_t bytes) {
  atomic_fetch_sub_explicit(&p->packed, KT_UNITS(bytes), memory_order_relaxed);
}

/* ---- arena (arena.c), caller holds arena_lock ----------------------------- */
int kt__bin_of(size_t size);
void kt__bins_insert(kt_bins *b, kt_extent *e);
void kt__bins_remove(kt_bins *b, kt_extent *e);
kt_bins *kt__bins_for(kt_pool_t *p, kt_heap *tag);
/* Best fit for size at align among tag's free extents and untagged ones (find() in
 * arena.c says how); where that would grow a VMM pool, first untags what other streams
 * freed before an event that has completed (reclaim_streams), then grows (may call
 * the backend). The extent comes back
 * marked kind (SLAB or LARGE), so it is never coalesced once the lock is dropped.
 * release: where release_on_grow would give idle segments back before growing, they
 * are unlinked into *release and KT__RELEASE_FIRST returned: the caller releases them
 * with kt__segment_release (arena_lock dropped: cudaFree synchronizes) and takes
 * again. NULL: no release before growing. */
#define KT__RELEASE_FIRST ((kt_status)100)
kt_status kt__arena_take(kt_pool_t *p, kt_heap *tag, size_t size, size_t align, int kind,
                         kt_extent **out, kt_oom_info *oom, kt_segment **release);
/* Returns an extent to the free bins with tag, coalescing. */
void kt__arena_put(kt_pool_t *p, kt_extent *e, kt_heap *tag);
/* Every free extent becomes untagged (usable by any stream) and coalesces with its
 * free neighbours. Only after a device synchronization made under arena_lock: the
 * work of every stream that freed one has then finished. */
void kt__arena_untag_all(kt_pool_t *p);
/* Unlinks segments whose extents are all free; caller releases them unlocked.
 * VMM ranges stay; their idle granules go back through kt__arena_trim. */
kt_segment *kt__arena_collect_idle(kt_pool_t *p);
/* Unmaps granules of VMM ranges that lie wholly in free space, from the top of each
 * range down, until at least want bytes went back (SIZE_MAX: all). Synchronizes the
 * device first when there is anything to unmap. Returns the bytes unmapped. */
size_t kt__arena_trim(kt_pool_t *p, size_t want);
/* Events from the pool's cache (pool.c; take pending_lock, a leaf). */
kt_status kt__event_take(kt_pool_t *p, kt_event_t *ev);
void kt__event_give(kt_pool_t *p, kt_event_t ev);
/* Frees the recycled extent descriptors (pool teardown). */
void kt__arena_free_spares(kt_pool_t *p);
void kt__segment_release(kt_pool_t *p, kt_segment *s);
size_t kt__arena_largest_free(kt_pool_t *p);
/* Largest free range any stream may take now (VMM: its mapped granules). */
size_t kt__arena_largest_untagged(kt_pool_t *p);
kt_status kt__arena_validate(kt_pool_t *p);

/* A child pool's segment or a capture's arena (subpool.c): a large block of the
 * parent, KT_PAGE aligned and at least KT_PAGE long; size a nonzero multiple of
 * KT_QUANTUM (else KT_ERR_INVALID). An out-of-memory is reported by the child, with
 * the parent's diagnosis (pool.c). */
kt_status kt__alloc_nested(kt_pool_t *parent, size_t size, kt_stream_t stream, void **out);

/* ---- nvtx.c ---------------------------------------------------------------- */
void kt__nvtx_init(kt_pool_t *p);
void kt__nvtx_push(kt_pool_t *p, const char *name);
void kt__nvtx_pop(kt_pool_t *p);
void *kt__nvtx_heap_register(kt_pool_t *p, uintptr_t base, size_t size);
void kt__nvtx_heap_unregister(kt_pool_t *p, void *heap);
void kt__nvtx_region(kt_pool_t *p, void *heap, uintptr_t addr, size_t size, int alive);

/* ---- trace.c --------------------------------------------------------------- */
enum { KT_HOOK_TRACE = 1, KT_HOOK_NVTX = 2 };
void kt__trace(kt_pool_t *p, const char *action, uintptr_t ptr, size_t size, kt_stream_t s);

#endif
