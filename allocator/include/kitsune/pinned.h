/* kitsune/pinned.h — a pool of page-locked (pinned) host memory.
 *
 * Host-to-device copies overlap with compute only from pinned memory, and pinning
 * is slow (a cudaHostAlloc of tens of MB costs milliseconds), so pinned buffers
 * must be cached. PyTorch's host caching allocator rounds every request up to a
 * power of two, so what it pins grows well past what is used. This pool places
 * requests with jemalloc instead: a dedicated jemalloc arena whose extent hooks
 * obtain pinned chunks from the backend (cudaHostAlloc on the CUDA backend,
 * ordinary memory on the host fake), so requests get jemalloc's size classes
 * (four per doubling) and its extent reuse, split and coalesce.
 *
 * Contract (the same as the device pool's record_stream):
 *  - kt_pinned_record_stream(pool, p, device, S) declares that work enqueued on
 *    stream S of device (a copy from or to p) may still use the block. At
 *    kt_pinned_free an event is recorded on each such stream and the block is not
 *    handed out again until all of them have completed.
 *  - A block freed with no recorded stream is reused at once: the caller must know
 *    that no copy still reads or writes it.
 *  - Chunks are never merged across two backend allocations, so every extent
 *    jemalloc hands out lies inside one pinned chunk.
 *  - Chunks go back to the backend when they are wholly idle and
 *    kt_pinned_trim is called, and all of them at kt_pinned_destroy.
 *
 * Every function may be called from any thread. Errors are kt_status values: a
 * refused pin is KT_ERR_OOM, a pointer the pool did not hand out (or already took
 * back) is KT_ERR_INVALID, a backend without host memory is KT_ERR_UNAVAILABLE.
 */
#ifndef KITSUNE_PINNED_H
#define KITSUNE_PINNED_H

#include <stddef.h>
#include <stdint.h>

#include "kitsune/alloc.h"
#include "kitsune/backend.h"
#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_pinned_pool kt_pinned_pool_t;

#define KT_PINNED_MAX_USES 4   /* streams recorded per block; more -> KT_ERR_LIMIT */

/* Requests above this are refused with KT_ERR_OOM before anything is pinned. */
#define KT_PINNED_MAX_ALLOC ((size_t)1 << 40)

typedef struct kt_pinned_stats {
  /* Identities (exact when no call is in flight):
   *   requested_bytes.current == sum of sizes passed to kt_pinned_alloc, live blocks
   *   allocated_bytes.current == sum of jemalloc usable sizes of live blocks (>= requested)
   *   mapped_bytes.current    == sum of pinned chunks held from the backend
   *   mapped >= allocated >= requested, and x.current == x.allocated - x.freed.
   * A freed block waiting for its recorded streams counts until it is released. */
  kt_stat requested_bytes;
  kt_stat allocated_bytes;
  kt_stat mapped_bytes;
  kt_stat allocations;          /* live blocks */
  kt_stat chunks;               /* live backend allocations */
  uint64_t num_allocs, num_frees;
  uint64_t num_failed_pins;     /* backend host_alloc refusals */
  uint64_t num_pending_frees;   /* frees that waited for recorded streams */
  uint64_t pending_now;         /* freed blocks still waiting */
  uint64_t num_release_on_grow; /* trims done before growing (see release_on_grow) */
} kt_pinned_stats;

/* The backend must have host_alloc/host_free (KT_ERR_UNAVAILABLE otherwise) and
 * must outlive the pool. */
kt_status kt_pinned_create(const kt_backend *backend, kt_pinned_pool_t **out);
/* Gives every chunk back to the backend, live blocks included. */
void kt_pinned_destroy(kt_pinned_pool_t *pool);

/* size 0 returns *out = NULL and KT_OK. Blocks are aligned to at least 16 bytes,
 * and blocks of 4 KiB or more to 4 KiB. */
kt_status kt_pinned_alloc(kt_pinned_pool_t *pool, size_t size, void **out);
/* ptr must be a live block of this pool (NULL is accepted and ignored). */
kt_status kt_pinned_free(kt_pinned_pool_t *pool, void *ptr);
/* Declares that work on stream (of device) uses the live block at ptr; see the
 * contract above. Recording the same stream twice is one use. */
kt_status kt_pinned_record_stream(kt_pinned_pool_t *pool, void *ptr, int device, kt_stream_t stream);
/* The size passed to kt_pinned_alloc for the live block at ptr. */
kt_status kt_pinned_block_size(kt_pinned_pool_t *pool, const void *ptr, size_t *size);
/* Gives wholly idle chunks back to the backend. */
kt_status kt_pinned_trim(kt_pinned_pool_t *pool);
/* 1 (default): when a request needs a new chunk while idle pinned bytes come to at
 * least half of it, idle
 * chunks are given back first (a trim), so that what is pinned follows what is
 * used rather than the worst mix of sizes seen. With steady batch shapes nothing
 * changes (a freed block serves the next batch); when sizes keep changing, each
 * new size costs a cudaFreeHost and a cudaHostAlloc (bench/data/pinned_footprint.py
 * measures both modes). 0: cached chunks stay until kt_pinned_trim, as PyTorch's
 * host allocator keeps them. */
void kt_pinned_set_release_on_grow(kt_pinned_pool_t *pool, int on);

kt_status kt_pinned_get_stats(kt_pinned_pool_t *pool, kt_pinned_stats *out);
/* Peak := current for every stat. */
void kt_pinned_reset_peak_stats(kt_pinned_pool_t *pool);

/* O(n) check of the invariants above; KT_OK or KT_ERR_INVALID. */
kt_status kt_pinned_validate(kt_pinned_pool_t *pool);

#ifdef __cplusplus
}
#endif
#endif
