/* kitsune/backend.h — where a pool's memory, events and streams come from.
 *
 * A backend is a table of functions over an opaque context. The pool calls them
 * only on slow paths (new segment, segment release, cross-stream frees, OOM).
 * Two implementations ship: the CUDA backend (cudaMalloc segments, CUDA events)
 * and a host fake that hands out addresses it never touches and whose events
 * complete when a test says so. Wrappers that add one behaviour (counting,
 * fault injection) can be stacked by forwarding to an inner backend.
 */
#ifndef KITSUNE_BACKEND_H
#define KITSUNE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef void *kt_stream_t;   /* a cudaStream_t on the CUDA backend; NULL is valid */
typedef void *kt_event_t;

/* Segments are reserved in multiples of this many bytes, aligned to at least 64 KiB
 * (cudaMalloc gives 2 MiB alignment for such sizes). */
#define KT_SEGMENT_ALIGN ((size_t)2 << 20)

typedef struct kt_backend {
  const char *name;
  void *ctx;
  /* size is a multiple of KT_SEGMENT_ALIGN (of reserve_quantum when that is set); *out
   * must be 64 KiB aligned and below 2^48.
   * Returns KT_OK, KT_ERR_OOM when the device has no room, or KT_ERR_BACKEND. */
  kt_status (*reserve)(void *ctx, int device, size_t size, void **out);
  /* Must be safe while work enqueued before the call still uses the memory
   * (cudaFree synchronizes the device; a VMM backend must synchronize itself). */
  kt_status (*release)(void *ctx, int device, void *ptr, size_t size);
  kt_status (*event_create)(void *ctx, int device, kt_event_t *out);
  kt_status (*event_destroy)(void *ctx, int device, kt_event_t ev);
  kt_status (*event_record)(void *ctx, int device, kt_event_t ev, kt_stream_t stream);
  /* *done = 1 when all work captured by the event has completed. */
  kt_status (*event_query)(void *ctx, int device, kt_event_t ev, int *done);
  /* Waits for all work on the device. */
  kt_status (*synchronize)(void *ctx, int device);
  /* Device memory; may be NULL (then fractions and OOM device numbers are unavailable). */
  kt_status (*mem_info)(void *ctx, int device, size_t *free_bytes, size_t *total_bytes);
  /* Page-locked host memory for the pinned pool (kitsune/pinned.h); may be NULL.
   * host_alloc returns memory any device may copy from asynchronously
   * (cudaHostAlloc, portable), or KT_ERR_OOM when pinning fails. No alignment is
   * promised beyond 16 bytes: cudaHostAlloc places some sizes off page boundaries
   * (seen on the H100 machine), so the pool aligns what it needs itself.
   * host_free gets exactly what host_alloc returned. */
  kt_status (*host_alloc)(void *ctx, size_t size, void **out);
  kt_status (*host_free)(void *ctx, void *ptr, size_t size);
  /* Virtual memory; all four or none (NULL: the pool uses segments only). A VMM pool
   * reserves address space once and backs granules of KT_SEGMENT_ALIGN bytes with
   * device memory as blocks need them, so its free space coalesces across what
   * would be separate segments and idle granules can go back one by one.
   * va_reserve: size a multiple of KT_SEGMENT_ALIGN; *out aligned to it and below
   *   2^48; no memory behind it. KT_ERR_UNAVAILABLE when the device cannot map at
   *   that granularity (the pool then falls back to segments).
   * va_release: gets exactly what va_reserve gave; every granule unmapped.
   * map: [ptr, ptr+size) granule-aligned inside one reserved range, none of it
   *   mapped; backs it with device memory the device may read and write. KT_ERR_OOM
   *   when the device (or the fake's capacity) has no room; on any failure nothing
   *   of the range stays mapped. Each granule can later be unmapped on its own.
   * unmap: every granule of the range mapped; the caller has synchronized the
   *   device, so no work still touches it. Gives the memory back. */
  kt_status (*va_reserve)(void *ctx, int device, size_t size, void **out);
  kt_status (*va_release)(void *ctx, int device, void *ptr, size_t size);
  kt_status (*map)(void *ctx, int device, void *ptr, size_t size);
  kt_status (*unmap)(void *ctx, int device, void *ptr, size_t size);
  /* 0: reserve takes multiples of KT_SEGMENT_ALIGN. Else the finer multiple it takes,
   * a power of two dividing KT_SEGMENT_ALIGN: a pool's backend
   * (kt_pool_backend_create) takes multiples of KT_QUANTUM (512 bytes), being blocks of
   * its parent, so a capture's arena (kitsune/capplan.h) holds its plan exactly, not
   * rounded up to 2 MiB. Pools still reserve whole KT_SEGMENT_ALIGN multiples. */
  size_t reserve_quantum;
} kt_backend;

/* ---- host fake backend ---------------------------------------------------- */
/* Device addresses start at 2^36 and are never dereferenced. capacity 0 = unlimited.
 * Host memory (host_alloc) is real, ordinary memory from the C library. */
kt_backend *kt_fake_backend_create(size_t capacity);
void kt_fake_backend_destroy(kt_backend *b);

typedef struct kt_fake_counts {
  uint64_t reserves, releases, failed_reserves;   /* failed_reserves counts refused maps too */
  uint64_t va_reserves, va_releases, maps, unmaps;
  size_t va_bytes;           /* address space reserved now (no memory behind it) */
  size_t mapped_bytes;       /* device memory mapped into it now (also in reserved_bytes) */
  uint64_t event_creates, event_destroys, event_records, event_queries, syncs;
  size_t reserved_bytes;     /* device memory held now: segments + mapped granules */
  uint64_t live_events;
  uint64_t host_allocs, host_frees, failed_host_allocs;
  size_t host_bytes;         /* host memory held now */
} kt_fake_counts;

void kt_fake_get_counts(const kt_backend *b, kt_fake_counts *out);
void kt_fake_set_capacity(kt_backend *b, size_t capacity);
/* The next n reserves fail with KT_ERR_OOM whatever the capacity. */
void kt_fake_fail_next_reserves(kt_backend *b, int n);
/* The next n host_allocs fail with KT_ERR_OOM (as a refused pin would). */
void kt_fake_fail_next_host_allocs(kt_backend *b, int n);
/* While on, host_alloc returns addresses 256 bytes past a page boundary (as
 * cudaHostAlloc does for some sizes). */
void kt_fake_misalign_host(kt_backend *b, int on);
/* While held, recorded events stay incomplete until kt_fake_complete_events. */
void kt_fake_hold_events(kt_backend *b, int hold);
void kt_fake_complete_events(kt_backend *b);
/* 1 when [ptr, ptr+size) lies inside one live segment, or inside one reserved
 * address range with every granule it touches mapped. */
int kt_fake_owns(const kt_backend *b, const void *ptr, size_t size);
/* Off: the fake has no VMM entries (as a backend without them). On by default. */
kt_backend *kt_fake_backend_create_novmm(size_t capacity);
/* Unmaps since the last synchronize of a granule that a recorded, uncompleted
 * event could still cover: the pool must synchronize before unmapping. */
uint64_t kt_fake_unsynced_unmaps(const kt_backend *b);

/* ---- CUDA backend --------------------------------------------------------- */
/* The process-wide CUDA backend (statically linked runtime). Never NULL. */
const kt_backend *kt_cuda_backend(void);
/* Number of CUDA devices, 0 when there is no driver or no device. */
int kt_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif
