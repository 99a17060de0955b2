/* allocator/src/pool.c — the pool: thread caches, per-stream heaps, slabs, large
 * blocks, cross-stream frees, OOM recovery and stats.
 *
 * Fast path (a size class already seen by this thread on this stream):
 *   alloc: class table lookup, compare the thread's last tcache (pool, stream),
 *          pop its class list, stamp (coarse clock), four single-writer counter
 *          bumps, one atomic add on the packed allocated|pending word.
 *   free:  two-level radix load, slab index by multiply-shift, compare the
 *          block's heap with the thread's tcache, push, counters, one atomic sub.
 * No lock, no malloc, no backend call. The one atomic per call is what keeps
 * peak stats exact under concurrency. Everything else is in KT_NOINLINE slow
 * paths, which run with no heap lock held.
 */
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "internal.h"

const char *kt_status_str(kt_status s) {
  switch (s) {
    case KT_OK: return "ok";
    case KT_ERR_INVALID: return "invalid argument";
    case KT_ERR_OOM: return "out of memory";
    case KT_ERR_BACKEND: return "backend error";
    case KT_ERR_HOST_OOM: return "host out of memory";
    case KT_ERR_LIMIT: return "capacity exceeded";
    case KT_ERR_IO: return "i/o error";
    case KT_ERR_UNAVAILABLE: return "unavailable";
  }
  return "unknown status";
}

#ifdef KT_DEBUG
void kt__assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "kitsune: internal assertion failed: %s (%s:%d)\n", cond, file, line);
  abort();
}
#endif

void kt__spin_lock_slow(kt_spinlock *l) {
  for (unsigned n = 0;; n++) {
    if (!atomic_load_explicit(&l->v, memory_order_relaxed) &&
        !atomic_exchange_explicit(&l->v, 1, memory_order_acquire))
      return;
    if (n < 64) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield();
    }
  }
}

uint64_t kt__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- radix ----------------------------------------------------------------- */
kt_status kt__radix_set(kt_pool_t *p, uintptr_t addr, uintptr_t val) {
  uintptr_t key = addr >> KT_PAGE_SHIFT;
  if (key >> KT_RADIX_BITS) return KT_ERR_BACKEND;
  _Atomic uintptr_t *_Atomic *slot = &p->radix[key >> KT_RADIX_LEAF_BITS];
  _Atomic uintptr_t *leaf = atomic_load_explicit(slot, memory_order_acquire);
  if (!leaf) {
    if (!val) return KT_OK;
    leaf = calloc((size_t)1 << KT_RADIX_LEAF_BITS, sizeof *leaf);
    if (!leaf) return KT_ERR_HOST_OOM;
    _Atomic uintptr_t *expect = NULL;
    if (!atomic_compare_exchange_strong(slot, &expect, leaf)) { free(leaf); leaf = expect; }
  }
  atomic_store_explicit(&leaf[key & ((1u << KT_RADIX_LEAF_BITS) - 1)], val, memory_order_release);
  return KT_OK;
}

kt_status kt__radix_set_range(kt_pool_t *p, uintptr_t addr, size_t bytes, uintptr_t val) {
  for (size_t off = 0; off < bytes; off += KT_PAGE) {
    kt_status st = kt__radix_set(p, addr + off, val);
    if (st != KT_OK) return st;
  }
  return KT_OK;
}

void kt__radix_free(kt_pool_t *p) {
  for (size_t i = 0; i < ((size_t)1 << KT_RADIX_ROOT_BITS); i++) free((void *)p->radix[i]);
}

static __thread kt_tcache *tc_last;   /* the hot one: last (pool, stream) allocated on */
static __thread kt_tcache *tc_list;   /* all of this thread's tcaches */

/* ---- pool ------------------------------------------------------------------ */
void kt_pool_options_default(kt_pool_options *o) {
  memset(o, 0, sizeof *o);
  o->track_lifetimes = 1;
  o->peak_slack = KT_DEFAULT_PEAK_SLACK;
  o->release_on_grow = KT_RELEASE_FOLLOW_PEAK;
  o->shared_segment = KT_DEFAULT_SHARED_SEGMENT;
}

kt_status kt_pool_create(const kt_pool_options *opt, const kt_backend *be, kt_pool_t **out) {
  if (!out || !be || !be->reserve || !be->release || !be->event_create || !be->event_destroy ||
      !be->event_record || !be->event_query || !be->synchronize)
    return KT_ERR_INVALID;
  kt_pool_options def;
  if (!opt) { kt_pool_options_default(&def); opt = &def; }
  if (opt->shared_segment % KT_SEGMENT_ALIGN) return KT_ERR_INVALID;
  kt__sizeclass_init();
  kt_pool_t *p = aligned_alloc(KT_CACHELINE, (sizeof *p + KT_CACHELINE - 1) & ~(size_t)(KT_CACHELINE - 1));
  if (!p) return KT_ERR_HOST_OOM;
  memset(p, 0, sizeof *p);
  p->be = be;
  p->device = opt->device;
  p->track = opt->track_lifetimes;
  p->slack_units = KT_UNITS(opt->peak_slack);
  p->release_on_grow = opt->release_on_grow;
  p->shared_segment = opt->shared_segment ? opt->shared_segment : KT_DEFAULT_SHARED_SEGMENT;
  p->vmm = opt->vmm && be->va_reserve && be->va_release && be->map && be->unmap;
  p->limit = opt->memory_limit;
  pthread_mutex_init(&p->arena_lock, NULL);
  pthread_mutex_init(&p->heap_lock, NULL);
  pthread_mutex_init(&p->pending_lock, NULL);
  pthread_mutex_init(&p->trace_lock, NULL);
  kt__nvtx_init(p);
  *out = p;
  return KT_OK;
}

void kt_pool_destroy(kt_pool_t *p) {
  if (!p) return;
  kt_trace_stop(p);
  pthread_mutex_lock(&kt__registry);   /* tcaches of any thread die with the pool */
  for (kt_tcache *tc = p->tcaches; tc; tc = tc->pnext) atomic_store(&tc->pool, NULL);
  p->tcaches = NULL;
  pthread_mutex_unlock(&kt__registry);
  for (kt_tcache **pp = &tc_list; *pp;) {   /* this thread's are freed now; others' at their exit */
    kt_tcache *tc = *pp;
    if (atomic_load(&tc->pool)) { pp = &tc->tnext; continue; }
    *pp = tc->tnext;
    if (tc_last == tc) tc_last = NULL;
    free(tc);
  }
  for (kt_block *b = p->pending; b; b = b->next) {   /* before the extents holding them go */
    for (int i = 0; i < b->uses->n; i++) p->be->event_destroy(p->be->ctx, p->device, b->uses->ev[i]);
    free(b->uses);
    b->uses = NULL;
  }
  for (kt_block *b = p->deferred; b; b = b->next) {   /* no events recorded for these */
    free(b->uses);
    b->uses = NULL;
  }
  for (kt_segment *s = p->segments, *sn; s; s = sn) {
    sn = s->next;
    for (kt_extent *e = s->first, *en; e; e = en) {
      en = e->anext;
      if (e->kind == KT_EXT_SLAB) {
        for (uint32_t i = 0; i < e->slab->nblocks; i++) free(e->slab->blocks[i].uses);
        free(e->slab);
      }
      if (e->kind == KT_EXT_LARGE) free(e->blk.uses);
      free(e);
    }
    kt__segment_release(p, s);
  }
  kt__arena_free_spares(p);
  for (int c = 0; c < KT_NUM_CLASSES; c++)
    for (kt_slab *s = p->retired[c], *sn; s; s = sn) { sn = s->next; free(s); }
  for (kt_heap *h = p->heap_list; h; h = h->next)
    if (h->reclaim_ev) p->be->event_destroy(p->be->ctx, p->device, h->reclaim_ev);
  for (int i = 0; i < p->nevents; i++) p->be->event_destroy(p->be->ctx, p->device, p->event_cache[i]);
  free(p->event_cache);
  for (kt_uses *u = p->uses_cache, *un; u; u = un) { un = u->next; free(u); }
  for (kt_heap *h = p->heap_list, *hn; h; h = hn) { hn = h->next; free(h); }
  kt__radix_free(p);
  pthread_mutex_destroy(&p->arena_lock);
  pthread_mutex_destroy(&p->heap_lock);
  pthread_mutex_destroy(&p->pending_lock);
  pthread_mutex_destroy(&p->trace_lock);
  free(p);
}

/* ---- stream -> heap -------------------------------------------------------- */
static inline size_t heap_hash(uintptr_t key) {
  return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - 11)) & (KT_HEAP_TABLE - 1);
}

static inline kt_heap *heap_find(kt_pool_t *p, kt_stream_t stream) {
  uintptr_t key = (uintptr_t)stream + 1;
  for (size_t i = heap_hash(key);; i = (i + 1) & (KT_HEAP_TABLE - 1)) {
    uintptr_t k = atomic_load_explicit(&p->heaps[i].key, memory_order_acquire);
    if (kt_likely(k == key)) return atomic_load_explicit(&p->heaps[i].heap, memory_order_relaxed);
    if (!k) return NULL;
  }
}

static KT_NOINLINE kt_status heap_create(kt_pool_t *p, kt_stream_t stream, kt_heap **out) {
  if ((uintptr_t)stream == UINTPTR_MAX) return KT_ERR_INVALID;
  kt_status st = KT_OK;
  pthread_mutex_lock(&p->heap_lock);
  kt_heap *h = heap_find(p, stream);
  if (h) goto done;
  if (p->nheaps >= KT_MAX_STREAMS) { st = KT_ERR_LIMIT; goto done; }
  h = aligned_alloc(KT_CACHELINE, sizeof *h);
  if (!h) { st = KT_ERR_HOST_OOM; goto done; }
  memset(h, 0, sizeof *h);
  h->stream = stream;
  uintptr_t key = (uintptr_t)stream + 1;
  size_t i = heap_hash(key);
  while (atomic_load_explicit(&p->heaps[i].key, memory_order_relaxed)) i = (i + 1) & (KT_HEAP_TABLE - 1);
  atomic_store_explicit(&p->heaps[i].heap, h, memory_order_relaxed);
  atomic_store_explicit(&p->heaps[i].key, key, memory_order_release);
  /* heap_list is read under arena_lock (bins) and heap_lock: publish under both */
  pthread_mutex_lock(&p->arena_lock);
  h->next = p->heap_list; p->heap_list = h;
  pthread_mutex_unlock(&p->arena_lock);
  p->nheaps++;
done:
  pthread_mutex_unlock(&p->heap_lock);
  *out = h;
  return st;
}

static inline kt_status heap_get(kt_pool_t *p, kt_stream_t stream, kt_heap **out) {
  kt_heap *h = heap_find(p, stream);
  if (kt_likely(h != NULL)) { *out = h; return KT_OK; }
  return heap_create(p, stream, out);
}

/* ---- hooks: trace and NVTX regions (off the fast path unless enabled) ------ */
static void *block_nvtx_heap(kt_block *b) {
  if (b->slab) return b->slab->ext->seg->nvtx_heap;
  kt_extent *e = (kt_extent *)((char *)b - offsetof(kt_extent, blk));
  return e->seg->nvtx_heap;
}

static KT_NOINLINE void on_alloc(kt_pool_t *p, kt_block *b) {
  int h = atomic_load_explicit(&p->hooks, memory_order_relaxed);
  void *heap = (h & KT_HOOK_NVTX) ? block_nvtx_heap(b) : NULL;
  if (heap) kt__nvtx_region(p, heap, b->addr, kt__block_size(b), 1);
  if (h & KT_HOOK_TRACE) kt__trace(p, "alloc", b->addr, b->requested, b->heap->stream);
}

static KT_NOINLINE void on_free(kt_pool_t *p, uintptr_t addr, size_t requested, kt_stream_t s) {
  int h = atomic_load_explicit(&p->hooks, memory_order_relaxed);
  if (h & KT_HOOK_NVTX) kt__nvtx_region(p, NULL, addr, 0, 0);
  if (h & KT_HOOK_TRACE) kt__trace(p, "free", addr, requested, s);
}

/* ---- thread caches ---------------------------------------------------------- */
pthread_mutex_t kt__registry = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t tc_key;
static pthread_once_t tc_key_once = PTHREAD_ONCE_INIT;

static void tstats_fold(kt_tstats *dst, const kt_tstats *src) {
  kt__inc(&dst->req_alloc, kt__get(&src->req_alloc)); kt__inc(&dst->req_freed, kt__get(&src->req_freed));
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    kt__inc(&dst->class_alloc[c], kt__get(&src->class_alloc[c]));
    kt__inc(&dst->class_free[c], kt__get(&src->class_free[c]));
  }
}

/* Moves blocks beyond keep from a tcache bin back to its heap. */
static void tbin_flush(kt_tcache *tc, int cls, uint32_t keep) {
  kt_tbin *bin = &tc->bins[cls];
  if (bin->n <= keep) return;
  kt_heap *h = tc->heap;
  kt_spin_lock(&h->lock);
  while (bin->n > keep) {
    kt_block *b = bin->head;
    bin->head = b->next;
    bin->n--;
    b->next = h->free[cls];
    h->free[cls] = b;
    b->slab->nfree++;
  }
  kt_spin_unlock(&h->lock);
}

static void tcache_flush_all(kt_tcache *tc) {
  atomic_store_explicit(&tc->flush_request, 0, memory_order_relaxed);
  uint64_t credit = kt__get(&tc->credit);
  if (credit) {
    atomic_store_explicit(&tc->credit, 0, memory_order_relaxed);
    atomic_fetch_sub_explicit(&atomic_load(&tc->pool)->packed, credit, memory_order_relaxed);
  }
  for (int c = 0; c < KT_NUM_CLASSES; c++) tbin_flush(tc, c, 0);
}

/* Thread exit: return cached blocks, keep the counts, free the tcaches. */
static void tc_thread_exit(void *unused) {
  (void)unused;
  pthread_mutex_lock(&kt__registry);
  for (kt_tcache *tc = tc_list, *next; tc; tc = next) {
    next = tc->tnext;
    kt_pool_t *p = atomic_load(&tc->pool);
    if (p) {
      tcache_flush_all(tc);
      tstats_fold(&p->retired_stats, &tc->st);
      if (tc->pprev) tc->pprev->pnext = tc->pnext; else p->tcaches = tc->pnext;
      if (tc->pnext) tc->pnext->pprev = tc->pprev;
    }
    free(tc);
  }
  tc_list = tc_last = NULL;
  pthread_mutex_unlock(&kt__registry);
}

static void tc_key_make(void) { pthread_key_create(&tc_key, tc_thread_exit); }

/* This thread's tcache for (pool, stream), created on first use. */
static KT_NOINLINE kt_status tcache_get(kt_pool_t *p, kt_stream_t stream, kt_tcache **out) {
  for (kt_tcache **pp = &tc_list; *pp;) {
    kt_tcache *tc = *pp;
    kt_pool_t *tp = atomic_load_explicit(&tc->pool, memory_order_acquire);
    if (!tp) {                       /* its pool was destroyed: reap it */
      *pp = tc->tnext;
      if (tc_last == tc) tc_last = NULL;
      free(tc);
      continue;
    }
    if (tp == p && tc->stream == stream) {
      if (atomic_load_explicit(&tc->flush_request, memory_order_relaxed)) tcache_flush_all(tc);
      *out = tc;
      return KT_OK;
    }
    pp = &tc->tnext;
  }
  kt_heap *h;
  kt_status st = heap_get(p, stream, &h);
  if (st != KT_OK) return st;
  kt_tcache *tc = aligned_alloc(KT_CACHELINE, sizeof *tc);
  if (!tc) return KT_ERR_HOST_OOM;
  memset(tc, 0, sizeof *tc);
  atomic_store(&tc->pool, p);
  tc->heap = h;
  tc->stream = stream;
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    size_t n = KT_TCACHE_BYTES / kt__geom[c].size;
    tc->bins[c].cap = (uint32_t)(n < 1 ? 1 : n > KT_TCACHE_MAX ? KT_TCACHE_MAX : n);
  }
  pthread_once(&tc_key_once, tc_key_make);
  pthread_setspecific(tc_key, (void *)1);   /* arms tc_thread_exit */
  pthread_mutex_lock(&kt__registry);
  tc->pnext = p->tcaches;
  if (p->tcaches) p->tcaches->pprev = tc;
  p->tcaches = tc;
  pthread_mutex_unlock(&kt__registry);
  tc->tnext = tc_list;
  tc_list = tc;
  *out = tc;
  return KT_OK;
}

/* Bytes freed in thread caches but not yet taken off packed (kt__registry held). */
static int64_t credits_locked(kt_pool_t *p) {
  int64_t c = 0;
  for (kt_tcache *tc = p->tcaches; tc; tc = tc->pnext) c += (int64_t)kt__get(&tc->credit) << 9;
  return c;
}

/* Empties this thread's tcaches of p and asks other threads to empty theirs at
 * their next slow path (a tcache is only ever touched by its own thread). */
static void tcaches_release(kt_pool_t *p) {
  for (kt_tcache *tc = tc_list; tc; tc = tc->tnext)
    if (atomic_load(&tc->pool) == p) tcache_flush_all(tc);
  pthread_mutex_lock(&kt__registry);
  for (kt_tcache *tc = p->tcaches; tc; tc = tc->pnext) atomic_store(&tc->flush_request, 1);
  pthread_mutex_unlock(&kt__registry);
  for (kt_tcache *tc = tc_list; tc; tc = tc->tnext)   /* not our own */
    if (atomic_load(&tc->pool) == p) atomic_store(&tc->flush_request, 0);
}

/* ---- OOM info -------------------------------------------------------------- */
static __thread kt_oom_info last_oom;
const kt_oom_info *kt_last_oom(void) { return &last_oom; }

/* A pool on kt_pool_backend_create reserves by allocating from its parent on this
 * thread. The parent's out-of-memory is then the child's: the parent neither counts
 * nor traces it, and leaves its diagnosis here for the child's report, which then
 * describes the memory that ran out (the parent's live, cached, reserved, limit). */
static __thread int nested_depth;
static __thread int nested_oom_set;
static __thread kt_oom_info nested_oom;

static kt_status alloc_large(kt_pool_t *p, size_t size, size_t align, kt_stream_t stream, void **out);

/* A child's segment or a capture's arena: a large block of the parent, KT_PAGE aligned
 * as a pool needs its segments (the parent places other large blocks on KT_QUANTUM
 * boundaries only), at least KT_PAGE long (alloc_large: two large blocks never start
 * in one radix page). */
kt_status kt__alloc_nested(kt_pool_t *parent, size_t size, kt_stream_t stream, void **out) {
  if (!parent || !out || !size || size % KT_QUANTUM) return KT_ERR_INVALID;
  nested_depth++;
  kt_status st = alloc_large(parent, size, KT_PAGE, stream, out);
  nested_depth--;
  return st;
}

static void human(char *buf, size_t len, size_t b) {
  const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b; int i = 0;
  while (v >= 1024 && i < 4) { v /= 1024; i++; }
  snprintf(buf, len, i ? "%.2f %s" : "%.0f %s", v, u[i]);
}

int kt_format_oom(const kt_oom_info *o, char *buf, size_t len) {
  char req[32], live[32], cached[32], res[32], lim[32], big[32], dfree[32], dtot[32];
  human(req, sizeof req, o->requested); human(live, sizeof live, o->live);
  human(cached, sizeof cached, o->cached); human(res, sizeof res, o->reserved);
  human(big, sizeof big, o->largest_free);
  if (o->limit) human(lim, sizeof lim, o->limit); else snprintf(lim, sizeof lim, "none");
  if (o->device_total) { human(dfree, sizeof dfree, o->device_free); human(dtot, sizeof dtot, o->device_total); }
  else { snprintf(dfree, sizeof dfree, "?"); snprintf(dtot, sizeof dtot, "?"); }
  const char *hint = o->hit_limit
      ? "the pool's memory limit refused it: raise the limit or free tensors"
      : (o->largest_free < o->requested && o->cached >= o->requested)
            ? "enough memory is cached but no free block is large enough (fragmentation): "
              "free tensors or call empty_cache between phases"
            : "reduce the batch size or free tensors you no longer need";
  return snprintf(buf, len,
                  "Kitsune: out of memory on device %d: tried to allocate %s (%zu bytes); "
                  "live %s, cached %s, reserved %s, limit %s; largest free block %s; "
                  "device free %s of %s. Hint: %s.",
                  o->device, req, o->requested, live, cached, res, lim, big, dfree, dtot, hint);
}

static void fill_oom(kt_pool_t *p, kt_oom_info *o, size_t requested) {
  /* caller holds arena_lock */
  uint64_t v = atomic_load(&p->packed);
  o->requested = requested;
  o->live = (size_t)(v & 0xffffffffu) << 9;   /* take_extent subtracts thread credits */
  o->reserved = (size_t)p->reserved;
  o->cached = o->reserved > o->live ? o->reserved - o->live : 0;
  o->limit = p->limit;
  o->largest_free = kt__arena_largest_free(p);
  o->device = p->device;
  o->device_free = o->device_total = 0;
  if (p->be->mem_info) p->be->mem_info(p->be->ctx, p->device, &o->device_free, &o->device_total);
}

/* ---- pending (cross-stream) frees ------------------------------------------ */
static kt_status event_get(kt_pool_t *p, kt_event_t *ev) {
  if (p->nevents) { *ev = p->event_cache[--p->nevents]; return KT_OK; }
  return p->be->event_create(p->be->ctx, p->device, ev);
}

static void event_put(kt_pool_t *p, kt_event_t ev) {
  if (p->nevents == p->event_cap) {
    int cap = p->event_cap ? 2 * p->event_cap : 64;
    kt_event_t *n = realloc(p->event_cache, (size_t)cap * sizeof *n);
    if (!n) { p->be->event_destroy(p->be->ctx, p->device, ev); return; }
    p->event_cache = n; p->event_cap = cap;
  }
  p->event_cache[p->nevents++] = ev;
}

kt_status kt__event_take(kt_pool_t *p, kt_event_t *ev) {
  pthread_mutex_lock(&p->pending_lock);
  kt_status st = event_get(p, ev);
  pthread_mutex_unlock(&p->pending_lock);
  return st;
}

void kt__event_give(kt_pool_t *p, kt_event_t ev) {
  pthread_mutex_lock(&p->pending_lock);
  event_put(p, ev);
  pthread_mutex_unlock(&p->pending_lock);
}

static kt_uses *uses_get(kt_pool_t *p) {
  pthread_mutex_lock(&p->pending_lock);
  kt_uses *u = p->uses_cache;
  if (u) p->uses_cache = u->next;
  pthread_mutex_unlock(&p->pending_lock);
  if (!u) u = malloc(sizeof *u);
  if (u) memset(u, 0, sizeof *u);
  return u;
}

static void uses_put_locked(kt_pool_t *p, kt_uses *u) { u->next = p->uses_cache; p->uses_cache = u; }

static void finish_free(kt_pool_t *p, kt_block *b);

/* b is PENDING and off every list. Records an event on each stream that used it.
 * On failure to get events it synchronizes the device instead. account: move its
 * bytes from allocated to pending (0: a deferred block, moved when it was freed). */
static KT_NOINLINE kt_status pending_start(kt_pool_t *p, kt_block *b, int account) {
  kt_uses *u = b->uses;
  int ok = !u->overflow;
  /* moves the bytes from allocated to pending in one add: active stays the same */
  uint64_t units = KT_UNITS(kt__block_size(b)), to_pending = account ? (units << 32) - units : 0;
  pthread_mutex_lock(&p->pending_lock);
  if (account && atomic_load_explicit(&p->defer_events, memory_order_relaxed)) {
    /* a capture is under way: an event recorded now would be part of it, and querying
     * one fails the capture. The block waits, unused, until kt_pool_defer_events(0). */
    atomic_fetch_add_explicit(&p->packed, to_pending, memory_order_relaxed);
    b->next = p->deferred; p->deferred = b;
    p->n_pending_frees++;
    pthread_mutex_unlock(&p->pending_lock);
    return KT_OK;
  }
  int i = 0;
  for (; ok && i < u->n; i++) {
    if (event_get(p, &u->ev[i]) != KT_OK ||
        p->be->event_record(p->be->ctx, p->device, u->ev[i], u->s[i]) != KT_OK) {
      ok = 0;
      if (u->ev[i]) event_put(p, u->ev[i]);
      break;
    }
  }
  if (!ok) {  /* too many streams or no events: wait for everything instead */
    for (int j = 0; j < i; j++) event_put(p, u->ev[j]);
    pthread_mutex_unlock(&p->pending_lock);
    kt_status st = p->be->synchronize(p->be->ctx, p->device);
    if (st != KT_OK) return st;  /* block stays PENDING and off-list: leaked, reported */
    u->n = 0;
    atomic_fetch_add_explicit(&p->packed, to_pending, memory_order_relaxed);
    finish_free(p, b);
    return KT_OK;
  }
  atomic_fetch_add_explicit(&p->packed, to_pending, memory_order_relaxed);
  b->next = p->pending; p->pending = b;
  if (account) p->n_pending_frees++;
  atomic_fetch_add_explicit(&p->npending, 1, memory_order_release);
  pthread_mutex_unlock(&p->pending_lock);
  return KT_OK;
}

static kt_status free_pending(kt_pool_t *p, kt_block *b) { return pending_start(p, b, 1); }

kt_status kt_pool_defer_events(kt_pool_t *p, int defer) {
  if (!p) return KT_ERR_INVALID;
  pthread_mutex_lock(&p->pending_lock);
  if (defer) {
    atomic_fetch_add_explicit(&p->defer_events, 1, memory_order_relaxed);
    pthread_mutex_unlock(&p->pending_lock);
    return KT_OK;
  }
  if (atomic_load_explicit(&p->defer_events, memory_order_relaxed) <= 0) {
    pthread_mutex_unlock(&p->pending_lock);
    return KT_ERR_INVALID;   /* not deferring */
  }
  kt_block *list = NULL;
  if (atomic_fetch_sub_explicit(&p->defer_events, 1, memory_order_relaxed) == 1) {
    list = p->deferred;
    p->deferred = NULL;
  }
  pthread_mutex_unlock(&p->pending_lock);
  kt_status ret = KT_OK;
  while (list) {   /* their streams' work so far is what they wait for */
    kt_block *b = list;
    list = b->next;
    kt_status st = pending_start(p, b, 0);
    if (st != KT_OK) ret = st;
  }
  return ret;
}

/* Returns blocks whose events all completed to their stream. sync: wait first. */
static void drain_pending(kt_pool_t *p, int sync) {
  if (!atomic_load_explicit(&p->npending, memory_order_acquire)) return;
  if (atomic_load_explicit(&p->defer_events, memory_order_relaxed)) return;   /* no event query in a capture */
  if (sync) p->be->synchronize(p->be->ctx, p->device);
  kt_block *done = NULL;
  pthread_mutex_lock(&p->pending_lock);
  for (kt_block **pp = &p->pending; *pp;) {
    kt_block *b = *pp;
    kt_uses *u = b->uses;
    int all = 1;
    for (int i = 0; i < u->n && all; i++) {
      int d = 0;
      if (p->be->event_query(p->be->ctx, p->device, u->ev[i], &d) != KT_OK || !d) all = 0;
    }
    if (!all) { pp = &b->next; continue; }
    *pp = b->next;
    for (int i = 0; i < u->n; i++) event_put(p, u->ev[i]);
    u->n = 0;
    b->next = done; done = b;
    atomic_fetch_sub_explicit(&p->npending, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&p->pending_lock);
  while (done) {
    kt_block *b = done;
    done = b->next;
    finish_free(p, b);
  }
}

/* A PENDING block whose users are done becomes FREE on its own stream. */
static void finish_free(kt_pool_t *p, kt_block *b) {
  kt_uses *u = b->uses;
  b->uses = NULL;
  if (u) { pthread_mutex_lock(&p->pending_lock); uses_put_locked(p, u); pthread_mutex_unlock(&p->pending_lock); }
  size_t size = kt__block_size(b);
  if (b->slab) {
    kt_heap *h = b->heap;
    kt_spin_lock(&h->lock);
    b->state = KT_BLOCK_FREE;
    b->next = h->free[b->cls]; h->free[b->cls] = b;
    b->slab->nfree++;
    kt_spin_unlock(&h->lock);
  } else {
    kt_extent *e = (kt_extent *)((char *)b - offsetof(kt_extent, blk));
    pthread_mutex_lock(&p->arena_lock);
    kt__radix_set(p, e->addr, 0);
    e->blk.state = KT_BLOCK_FREE;
    kt__arena_put(p, e, b->heap);
    pthread_mutex_unlock(&p->arena_lock);
  }
  atomic_fetch_sub_explicit(&p->packed, KT_UNITS(size) << 32, memory_order_relaxed);
}

/* ---- releasing cache ------------------------------------------------------- */
/* Gives fully free slabs back to the arena and idle segments to the backend. */
static void release_cached(kt_pool_t *p, int sync) {
  tcaches_release(p);
  drain_pending(p, sync);
  kt_slab *freed = NULL;
  pthread_mutex_lock(&p->heap_lock);
  for (kt_heap *h = p->heap_list; h; h = h->next) {
    kt_spin_lock(&h->lock);
    int any = 0;
    for (kt_slab **sp = &h->slabs; *sp;) {
      kt_slab *s = *sp;
      if (s->nfree != s->nblocks) { sp = &s->next; continue; }
      *sp = s->next;
      s->nfree = UINT32_MAX;            /* mark: drop its blocks from the lists */
      s->next = freed; freed = s;
      any = 1;
    }
    if (any)
      for (int c = 0; c < KT_NUM_CLASSES; c++)
        for (kt_block **bp = &h->free[c]; *bp;) {
          if ((*bp)->slab->nfree == UINT32_MAX) *bp = (*bp)->next; else bp = &(*bp)->next;
        }
    kt_spin_unlock(&h->lock);
  }
  pthread_mutex_unlock(&p->heap_lock);
  pthread_mutex_lock(&p->arena_lock);
  while (freed) {
    kt_slab *s = freed;
    freed = s->next;
    kt__radix_set_range(p, s->base, s->bytes, 0);
    kt__arena_put(p, s->ext, s->heap);
    s->ext = NULL;
    s->next = p->retired[s->cls]; p->retired[s->cls] = s;
  }
  kt__arena_trim(p, SIZE_MAX);
  kt_segment *idle = kt__arena_collect_idle(p);
  pthread_mutex_unlock(&p->arena_lock);
  while (idle) {
    kt_segment *s = idle;
    idle = s->next;
    kt__segment_release(p, s);
  }
}

kt_status kt_empty_cache(kt_pool_t *p) {
  if (!p) return KT_ERR_INVALID;
  kt__nvtx_push(p, "kitsune:empty_cache");
  release_cached(p, 0);
  kt__nvtx_pop(p);
  if (atomic_load_explicit(&p->hooks, memory_order_relaxed) & KT_HOOK_TRACE) kt__trace(p, "empty_cache", 0, 0, NULL);
  return KT_OK;
}

kt_status kt_pool_hold_releases(kt_pool_t *p, int hold) {
  if (!p) return KT_ERR_INVALID;
  if (hold) atomic_fetch_add(&p->hold_releases, 1);
  else if (atomic_fetch_sub(&p->hold_releases, 1) <= 0) {
    atomic_fetch_add(&p->hold_releases, 1);
    return KT_ERR_INVALID;   /* not held */
  }
  return KT_OK;
}

/* The OOM info's live bytes exclude what thread caches freed but not yet published. */
static void oom_subtract_credits(kt_pool_t *p) {
  pthread_mutex_lock(&kt__registry);
  size_t credit = (size_t)credits_locked(p);
  pthread_mutex_unlock(&kt__registry);
  last_oom.live -= credit < last_oom.live ? credit : last_oom.live;
  last_oom.cached = last_oom.reserved > last_oom.live ? last_oom.reserved - last_oom.live : 0;
}

/* kt__arena_take, called and returning with arena_lock held. Idle segments that
 * release_on_grow gives back before growing are released with the lock dropped (each
 * cudaFree synchronizes the device); then the take runs again, growing if it must. */
static kt_status arena_take_locked(kt_pool_t *p, kt_heap *h, size_t size, size_t align, int kind,
                                   kt_extent **out, kt_oom_info *oom) {
  kt_segment *idle = NULL;
  kt_status st = kt__arena_take(p, h, size, align, kind, out, oom, &idle);
  if (st != KT__RELEASE_FIRST) return st;
  pthread_mutex_unlock(&p->arena_lock);
  while (idle) {
    kt_segment *s = idle;
    idle = s->next;
    kt__segment_release(p, s);
  }
  pthread_mutex_lock(&p->arena_lock);
  return kt__arena_take(p, h, size, align, kind, out, oom, NULL);
}

/* arena_take with one retry after releasing cache (none while releases are held);
 * fills the thread's OOM info. Returns KT_OK with arena_lock held (the caller
 * finishes the extent and unlocks: one lock a large allocation), anything else
 * without. */
static kt_status take_extent(kt_pool_t *p, kt_heap *h, size_t size, size_t align, int kind, size_t requested,
                             kt_extent **out) {
  kt_oom_info oom = {0};
  pthread_mutex_lock(&p->arena_lock);
  kt_status st = arena_take_locked(p, h, size, align, kind, out, &oom);
  if (st == KT_ERR_OOM && !atomic_load(&p->hold_releases)) {
    p->n_retries++;
    pthread_mutex_unlock(&p->arena_lock);
    kt__nvtx_push(p, "kitsune:oom_retry");
    release_cached(p, 1);
    kt__nvtx_pop(p);
    memset(&oom, 0, sizeof oom);
    pthread_mutex_lock(&p->arena_lock);
    st = arena_take_locked(p, h, size, align, kind, out, &oom);
  }
  int nested = nested_depth > 0;
  if (st == KT_ERR_OOM) {
    fill_oom(p, &oom, requested);
    if (!nested && nested_oom_set) {   /* a child's: the parent it reserves from ran out */
      size_t rounded = oom.rounded;
      oom = nested_oom;
      oom.requested = requested;
      if (rounded) oom.rounded = rounded;
      nested_oom_set = 0;
    }
    if (!nested) p->n_ooms++;
    last_oom = oom;
  }
  if (!nested) nested_oom_set = 0;   /* a parent's failure that a retry got past */
  if (st == KT_OK) return st;
  pthread_mutex_unlock(&p->arena_lock);
  if (st == KT_ERR_OOM && last_oom.requested == requested) oom_subtract_credits(p);
  if (st == KT_ERR_OOM && nested) {
    nested_oom = last_oom;
    nested_oom_set = 1;
    return st;
  }
  if (st == KT_ERR_OOM && (atomic_load_explicit(&p->hooks, memory_order_relaxed) & KT_HOOK_TRACE))
    kt__trace(p, "oom", 0, requested, h->stream);
  return st;
}

/* ---- alloc ----------------------------------------------------------------- */
static kt_slab *slab_descriptor(kt_pool_t *p, int cls) {
  /* caller holds arena_lock */
  kt_slab *s = p->retired[cls];
  if (s) { p->retired[cls] = s->next; return s; }
  size_t bytes = sizeof(kt_slab) + kt__geom[cls].nblocks * sizeof(kt_block);
  return aligned_alloc(KT_CACHELINE, (bytes + KT_CACHELINE - 1) & ~(size_t)(KT_CACHELINE - 1));
}

/* A new slab of class cls for heap h; its blocks go on the heap's list. */
static KT_NOINLINE kt_status slab_new(kt_pool_t *p, kt_heap *h, int cls, size_t requested) {
  const kt_class_geom *g = &kt__geom[cls];
  kt_extent *e;
  kt_status st = take_extent(p, h, g->slab_bytes, KT_PAGE, KT_EXT_SLAB, requested, &e);
  if (st != KT_OK) return st;   /* KT_OK: arena_lock held */
  kt_slab *s = slab_descriptor(p, cls);
  if (s) st = kt__radix_set_range(p, e->addr, g->slab_bytes, (uintptr_t)s | 1);
  if (!s || st != KT_OK) {
    if (s) { kt__radix_set_range(p, e->addr, g->slab_bytes, 0); s->next = p->retired[cls]; p->retired[cls] = s; }
    kt__arena_put(p, e, h);
    pthread_mutex_unlock(&p->arena_lock);
    return KT_ERR_HOST_OOM;
  }
  e->slab = s;
  pthread_mutex_unlock(&p->arena_lock);
  s->base = e->addr; s->bytes = g->slab_bytes; s->magic = g->magic; s->ext = e; s->heap = h;
  s->nblocks = g->nblocks; s->cls = cls;
  for (uint32_t i = 0; i < g->nblocks; i++) {
    kt_block *b = &s->blocks[i];
    memset(b, 0, sizeof *b);
    b->addr = s->base + (uintptr_t)i * g->size;
    b->heap = h; b->slab = s; b->cls = (int16_t)cls; b->state = KT_BLOCK_FREE;
  }
  kt_spin_lock(&h->lock);
  s->next = h->slabs; h->slabs = s;
  s->nfree = g->nblocks;
  for (uint32_t i = g->nblocks; i-- > 0;) {   /* lowest addresses first */
    s->blocks[i].next = h->free[cls];
    h->free[cls] = &s->blocks[i];
  }
  kt_spin_unlock(&h->lock);
  return KT_OK;
}

/* Everything after the pop that is not the common case: credit exhausted (the
 * shared counter must go up) or hooks on. Kept out of line so the fast path
 * leaves through tail calls only and needs no saved registers. */
static KT_NOINLINE kt_status alloc_finish_slow(kt_pool_t *p, kt_tcache *tc, kt_block *b, void **out) {
  if (p->track) b->alloc_ns = kt__coarse_ns();
  uint64_t units = KT_UNITS(kt__geom[b->cls].size), credit = kt__get(&tc->credit);
  if (credit >= units) {
    atomic_store_explicit(&tc->credit, credit - units, memory_order_relaxed);
  } else {
    atomic_store_explicit(&tc->credit, 0, memory_order_relaxed);
    kt__count_alloc(p, (units - credit) << 9);
  }
  if (atomic_load_explicit(&p->hooks, memory_order_relaxed)) on_alloc(p, b);
  *out = (void *)b->addr;
  return KT_OK;
}

/* The allocation time stamp: a vDSO call, tail-called so kt_alloc saves nothing. */
static KT_NOINLINE kt_status alloc_stamp(kt_block *b, void **out) {
  b->alloc_ns = kt__coarse_ns();
  *out = (void *)b->addr;
  return KT_OK;
}

KT_INLINE kt_status alloc_finish(kt_pool_t *p, kt_tcache *tc, kt_block *b, int cls, size_t size, void **out) {
  b->state = KT_BLOCK_LIVE;
  b->requested = size;
  kt__inc(&tc->st.class_alloc[cls], 1);
  kt__inc(&tc->st.req_alloc, size);
  uint64_t units = KT_UNITS(kt__geom[b->cls].size), credit = kt__get(&tc->credit);
  if (kt_unlikely(credit < units || atomic_load_explicit(&p->hooks, memory_order_relaxed)))
    return alloc_finish_slow(p, tc, b, out);
  atomic_store_explicit(&tc->credit, credit - units, memory_order_relaxed);   /* no shared write */
  if (p->track) return alloc_stamp(b, out);
  *out = (void *)b->addr;
  return KT_OK;
}

/* The tcache bin is empty: take a batch from the heap, making a slab if needed. */
static KT_NOINLINE kt_status alloc_refill(kt_pool_t *p, kt_tcache *tc, int cls, size_t size, void **out) {
  if (atomic_load_explicit(&tc->flush_request, memory_order_relaxed)) tcache_flush_all(tc);
  if (atomic_load_explicit(&p->npending, memory_order_relaxed)) drain_pending(p, 0);
  kt_heap *h = tc->heap;
  kt_tbin *bin = &tc->bins[cls];
  uint32_t batch = bin->cap > 1 ? bin->cap / 2 : 1;
  for (;;) {   /* ends with blocks, or with slab_new's error: each slab adds blocks */
    kt_spin_lock(&h->lock);          /* splice the first batch blocks, order kept (LIFO reuse) */
    kt_block *first = h->free[cls], *last = NULL;
    uint32_t n = 0;
    for (kt_block *b = first; b && n < batch; b = b->next, n++) { b->slab->nfree--; last = b; }
    if (last) {
      h->free[cls] = last->next;
      last->next = bin->head;
      bin->head = first;
      bin->n += n;
    }
    kt_spin_unlock(&h->lock);
    if (bin->head) break;
    kt_status st = slab_new(p, h, cls, size);
    if (st != KT_OK) return st;
  }
  kt_block *b = bin->head;
  bin->head = b->next;
  bin->n--;
  return alloc_finish(p, tc, b, cls, size, out);
}

/* The thread's last tcache is for another pool or stream. */
static KT_NOINLINE kt_status alloc_switch(kt_pool_t *p, int cls, size_t size, kt_stream_t stream, void **out) {
  kt_tcache *tc;
  kt_status st = tcache_get(p, stream, &tc);
  if (st != KT_OK) return st;
  tc_last = tc;
  kt_tbin *bin = &tc->bins[cls];
  kt_block *b = bin->head;
  if (!b) return alloc_refill(p, tc, cls, size, out);
  bin->head = b->next;
  bin->n--;
  return alloc_finish(p, tc, b, cls, size, out);
}

static KT_NOINLINE kt_status alloc_large(kt_pool_t *p, size_t size, size_t align, kt_stream_t stream,
                                         void **out) {
  if (size > KT_MAX_ALLOC) {   /* beyond any device, and beyond what packed can count: refuse at once */
    pthread_mutex_lock(&p->arena_lock);
    p->n_ooms++;
    fill_oom(p, &last_oom, size);
    pthread_mutex_unlock(&p->arena_lock);
    oom_subtract_credits(p);
    return KT_ERR_OOM;
  }
  kt_heap *h;
  kt_status st = heap_get(p, stream, &h);
  if (st != KT_OK) return st;
  drain_pending(p, 0);
  size_t rounded = (size + KT_QUANTUM - 1) & ~(size_t)(KT_QUANTUM - 1);
  if (rounded < align) rounded = align;   /* a page-aligned block spans its page (kt__alloc_nested) */
  kt_extent *e;
  st = take_extent(p, h, rounded, align, KT_EXT_LARGE, size, &e);
  if (st != KT_OK) return st;   /* KT_OK: arena_lock held */
  st = kt__radix_set(p, e->addr, (uintptr_t)e);
  if (st != KT_OK) {
    kt__arena_put(p, e, h);
    pthread_mutex_unlock(&p->arena_lock);
    return st;
  }
  kt_block *b = &e->blk;
  memset(b, 0, sizeof *b);
  b->addr = e->addr; b->requested = size; b->heap = h; b->cls = -1;
  b->alloc_ns = p->track ? kt__coarse_ns() : 0;
  b->state = KT_BLOCK_LIVE;
  p->large_nalloc++;
  p->large_bytes_alloc += (int64_t)rounded; p->large_req_alloc += (int64_t)size;
  pthread_mutex_unlock(&p->arena_lock);
  kt__count_alloc(p, rounded);
  if (kt_unlikely(atomic_load_explicit(&p->hooks, memory_order_relaxed))) on_alloc(p, b);
  *out = (void *)b->addr;
  return KT_OK;
}

kt_status kt_alloc(kt_pool_t *p, size_t size, kt_stream_t stream, void **out) {
  if (kt_unlikely(size - 1 >= KT_LARGE_THRESHOLD)) {
    if (!p || !out) return KT_ERR_INVALID;
    if (size == 0) { *out = NULL; return KT_OK; }
    return alloc_large(p, size, KT_QUANTUM, stream, out);
  }
  if (kt_unlikely(!p || !out)) return KT_ERR_INVALID;
  int cls = kt__class_of(size);
  kt_tcache *tc = tc_last;
  if (kt_unlikely(!tc || atomic_load_explicit(&tc->pool, memory_order_relaxed) != p || tc->stream != stream))
    return alloc_switch(p, cls, size, stream, out);
  kt_tbin *bin = &tc->bins[cls];
  kt_block *b = bin->head;
  if (kt_unlikely(!b)) return alloc_refill(p, tc, cls, size, out);
  bin->head = b->next;
  bin->n--;
  return alloc_finish(p, tc, b, cls, size, out);
}

/* ---- free ------------------------------------------------------------------ */
KT_INLINE kt_block *slab_block(kt_slab *s, uintptr_t addr) {
  uint64_t off = addr - s->base;
  uint64_t i = (off * s->magic) >> 40;
  kt_block *b = &s->blocks[i];
  return (i < s->nblocks && b->addr == addr) ? b : NULL;
}

/* idle: no work can still touch the block (the caller synchronized), so it goes back
 * untagged, usable by every stream at once. */
static KT_NOINLINE kt_status free_large(kt_pool_t *p, uintptr_t addr, uintptr_t ent, size_t size, int idle) {
  kt_extent *e = (kt_extent *)ent;
  pthread_mutex_lock(&p->arena_lock);
  /* a size must round as the one asked for did (e->size may be more: kt__alloc_nested) */
  if (e->addr != addr || e->kind != KT_EXT_LARGE || e->blk.state != KT_BLOCK_LIVE ||
      (size && ((size + KT_QUANTUM - 1) & ~(size_t)(KT_QUANTUM - 1)) !=
                   ((e->blk.requested + KT_QUANTUM - 1) & ~(size_t)(KT_QUANTUM - 1)))) {
    pthread_mutex_unlock(&p->arena_lock);
    return KT_ERR_INVALID;
  }
  kt_block *b = &e->blk;
  kt_heap *h = b->heap;
  size_t bytes = e->size, req = b->requested;
  p->large_nfree++;
  p->large_bytes_freed += (int64_t)bytes; p->large_req_freed += (int64_t)req;
  if (b->uses) {
    b->state = KT_BLOCK_PENDING;
    pthread_mutex_unlock(&p->arena_lock);
    if (kt_unlikely(atomic_load_explicit(&p->hooks, memory_order_relaxed))) on_free(p, addr, req, h->stream);
    return free_pending(p, b);
  }
  b->state = KT_BLOCK_FREE;
  kt__radix_set(p, addr, 0);
  kt__arena_put(p, e, idle ? NULL : h);
  pthread_mutex_unlock(&p->arena_lock);
  kt__count_free(p, bytes);
  if (kt_unlikely(atomic_load_explicit(&p->hooks, memory_order_relaxed))) on_free(p, addr, req, h->stream);
  return KT_OK;
}

/* The uncommon ends of a free: a block other streams used (events), hooks on,
 * credit past the slack, or the bin past its cap. */
static KT_NOINLINE kt_status free_slow(kt_pool_t *p, kt_tcache *tc, kt_block *b) {
  int cls = b->cls;
  size_t req = b->requested;
  int hooks = atomic_load_explicit(&p->hooks, memory_order_relaxed);
  if (b->state == KT_BLOCK_LIVE) {         /* not yet counted: the pending or hooks case */
    kt__inc(&tc->st.class_free[cls], 1);
    kt__inc(&tc->st.req_freed, req);
    if (b->uses != NULL) {
      b->state = KT_BLOCK_PENDING;
      if (hooks) on_free(p, b->addr, req, b->heap->stream);
      return free_pending(p, b);
    }
    b->state = KT_BLOCK_FREE;
    kt_tbin *bin = &tc->bins[cls];
    b->next = bin->head;
    bin->head = b;
    bin->n++;
    atomic_store_explicit(&tc->credit, kt__get(&tc->credit) + KT_UNITS(kt__geom[cls].size), memory_order_relaxed);
  }
  uint64_t credit = kt__get(&tc->credit);
  if (credit > p->slack_units) {           /* publish: the shared counter comes down */
    atomic_store_explicit(&tc->credit, 0, memory_order_relaxed);
    kt__count_free(p, credit << 9);
  }
  if (tc->bins[cls].n > tc->bins[cls].cap) {
    if (atomic_load_explicit(&tc->flush_request, memory_order_relaxed)) tcache_flush_all(tc);
    else tbin_flush(tc, cls, tc->bins[cls].cap / 2);
  }
  if (hooks) on_free(p, b->addr, req, b->heap->stream);
  return KT_OK;
}

KT_INLINE kt_status free_to(kt_pool_t *p, kt_tcache *tc, kt_block *b) {
  if (kt_unlikely(b->state != KT_BLOCK_LIVE)) return KT_ERR_INVALID;
  if (kt_unlikely(b->uses != NULL || atomic_load_explicit(&p->hooks, memory_order_relaxed)))
    return free_slow(p, tc, b);
  int cls = b->cls;
  kt__inc(&tc->st.class_free[cls], 1);
  kt__inc(&tc->st.req_freed, b->requested);
  b->state = KT_BLOCK_FREE;
  kt_tbin *bin = &tc->bins[cls];
  b->next = bin->head;
  bin->head = b;
  uint32_t n = ++bin->n;
  uint64_t credit = kt__get(&tc->credit) + KT_UNITS(kt__geom[cls].size);
  atomic_store_explicit(&tc->credit, credit, memory_order_relaxed);
  if (kt_unlikely(credit > p->slack_units || n > bin->cap)) return free_slow(p, tc, b);
  return KT_OK;
}

/* The block's stream is not the thread's current one: use the matching tcache. */
static KT_NOINLINE kt_status free_switch(kt_pool_t *p, kt_block *b) {
  kt_tcache *tc;
  kt_status st = tcache_get(p, b->heap->stream, &tc);
  if (st != KT_OK) return st;
  return free_to(p, tc, b);
}

kt_status kt_free(kt_pool_t *p, void *ptr, size_t size, kt_stream_t stream) {
  (void)stream;  /* the block knows its stream; the argument is PyTorch's ABI */
  if (kt_unlikely(!ptr || !p)) return p ? KT_OK : KT_ERR_INVALID;
  uintptr_t addr = (uintptr_t)ptr;
  uintptr_t ent = kt__radix_get(p, addr);
  if (kt_unlikely(!(ent & 1))) return ent ? free_large(p, addr, ent, size, 0) : KT_ERR_INVALID;
  kt_block *b = slab_block((kt_slab *)(ent & ~(uintptr_t)1), addr);
  if (kt_unlikely(!b || (size && (size > KT_LARGE_THRESHOLD || kt__class_of(size) != b->cls))))
    return KT_ERR_INVALID;
  kt_tcache *tc = tc_last;
  if (kt_unlikely(!tc || tc->heap != b->heap || atomic_load_explicit(&tc->pool, memory_order_relaxed) != p))
    return free_switch(p, b);
  return free_to(p, tc, b);
}

kt_status kt_free_idle(kt_pool_t *p, void *ptr, size_t size) {
  if (!p || !ptr) return p ? KT_OK : KT_ERR_INVALID;
  uintptr_t ent = kt__radix_get(p, (uintptr_t)ptr);
  if (ent && !(ent & 1)) return free_large(p, (uintptr_t)ptr, ent, size, 1);
  return kt_free(p, ptr, size, NULL);
}

/* ---- CUDA graph captures --------------------------------------------------------- */
kt_status kt_pool_prepare_capture(kt_pool_t *p, size_t bytes, size_t *ready) {
  if (!p) return KT_ERR_INVALID;
  if (ready) *ready = 0;
  if (atomic_load(&p->hold_releases)) return KT_ERR_UNAVAILABLE;   /* a capture may be under way */
  kt__nvtx_push(p, "kitsune:prepare_capture");
  drain_pending(p, 1);
  pthread_mutex_lock(&p->arena_lock);
  /* under the lock: every extent freed so far was freed after its stream's work was
   * enqueued, so once this returns nothing touches any of them */
  kt_status st = p->be->synchronize(p->be->ctx, p->device);
  if (st == KT_OK) {
    kt__arena_untag_all(p);
    size_t have = kt__arena_largest_untagged(p);
    if (bytes > KT_MAX_ALLOC) bytes = KT_MAX_ALLOC;
    bytes = (bytes + KT_SEGMENT_ALIGN - 1) & ~(KT_SEGMENT_ALIGN - 1);
    kt_extent *e;
    kt_segment *idle = NULL;   /* the device is synchronized: idle segments go back under the lock */
    kt_status t = have < bytes ? kt__arena_take(p, NULL, bytes, KT_QUANTUM, KT_EXT_LARGE, &e, NULL, &idle) : KT_ERR_OOM;
    if (t == KT__RELEASE_FIRST) {
      while (idle) {
        kt_segment *s = idle;
        idle = s->next;
        kt__segment_release(p, s);
      }
      t = kt__arena_take(p, NULL, bytes, KT_QUANTUM, KT_EXT_LARGE, &e, NULL, NULL);
    }
    if (t == KT_OK) {
      kt__arena_put(p, e, NULL);   /* stays mapped (VMM) or reserved, free for any stream */
      have = kt__arena_largest_untagged(p);
    }
    if (ready) *ready = have;   /* growth the limit or the device refuses is not an error */
  }
  pthread_mutex_unlock(&p->arena_lock);
  kt__nvtx_pop(p);
  return st;
}

/* ---- record_stream ----------------------------------------------------------- */
static void add_use(kt_block *b, kt_stream_t s) {
  kt_uses *u = b->uses;
  if (s == b->heap->stream || u->overflow) return;
  for (int i = 0; i < u->n; i++) if (u->s[i] == s) return;
  if (u->n == KT_MAX_USES) { u->overflow = 1; return; }
  u->s[u->n++] = s;
}

kt_status kt_record_stream(kt_pool_t *p, void *ptr, kt_stream_t stream) {
  if (!p || !ptr) return KT_ERR_INVALID;
  uintptr_t addr = (uintptr_t)ptr, ent = kt__radix_get(p, addr);
  if (!ent) return KT_ERR_INVALID;
  kt_uses *spare = uses_get(p);
  if (!spare) return KT_ERR_HOST_OOM;
  kt_status st = KT_OK;
  if (ent & 1) {
    kt_block *b = slab_block((kt_slab *)(ent & ~(uintptr_t)1), addr);
    if (!b) { st = KT_ERR_INVALID; goto out; }
    kt_spin_lock(&b->heap->lock);
    if (b->state != KT_BLOCK_LIVE) st = KT_ERR_INVALID;
    else if (stream != b->heap->stream) {
      if (!b->uses) { b->uses = spare; spare = NULL; }
      add_use(b, stream);
    }
    kt_spin_unlock(&b->heap->lock);
  } else {
    kt_extent *e = (kt_extent *)ent;
    pthread_mutex_lock(&p->arena_lock);
    if (e->addr != addr || e->kind != KT_EXT_LARGE || e->blk.state != KT_BLOCK_LIVE) st = KT_ERR_INVALID;
    else if (stream != e->blk.heap->stream) {
      if (!e->blk.uses) { e->blk.uses = spare; spare = NULL; }
      add_use(&e->blk, stream);
    }
    pthread_mutex_unlock(&p->arena_lock);
  }
out:
  if (spare) { pthread_mutex_lock(&p->pending_lock); uses_put_locked(p, spare); pthread_mutex_unlock(&p->pending_lock); }
  if (st == KT_OK && (atomic_load_explicit(&p->hooks, memory_order_relaxed) & KT_HOOK_TRACE))
    kt__trace(p, "record_stream", addr, 0, stream);
  return st;
}

/* ---- queries ----------------------------------------------------------------- */
kt_status kt_block_query(kt_pool_t *p, const void *ptr, kt_block_info *out) {
  if (!p || !ptr || !out) return KT_ERR_INVALID;
  uintptr_t addr = (uintptr_t)ptr, ent = kt__radix_get(p, addr);
  if (!ent) return KT_ERR_INVALID;
  kt_block copy;
  size_t size_of_large = 0;
  kt_uses uses = {0};
  kt_status st = KT_OK;
  if (ent & 1) {
    kt_block *b = slab_block((kt_slab *)(ent & ~(uintptr_t)1), addr);
    if (!b) return KT_ERR_INVALID;
    kt_spin_lock(&b->heap->lock);
    copy = *b;
    if (b->uses) uses = *b->uses;
    kt_spin_unlock(&b->heap->lock);
  } else {
    kt_extent *e = (kt_extent *)ent;
    pthread_mutex_lock(&p->arena_lock);
    if (e->addr != addr || e->kind != KT_EXT_LARGE) st = KT_ERR_INVALID;
    else { copy = e->blk; size_of_large = e->size; if (e->blk.uses) uses = *e->blk.uses; }
    pthread_mutex_unlock(&p->arena_lock);
    if (st != KT_OK) return st;
  }
  if (copy.state != KT_BLOCK_LIVE) return KT_ERR_INVALID;
  memset(out, 0, sizeof *out);
  out->ptr = (void *)copy.addr;
  out->size = copy.slab ? kt__geom[copy.cls].size : size_of_large;
  out->requested = copy.requested;
  out->stream = copy.heap->stream;
  out->alloc_ns = copy.alloc_ns;
  out->num_uses = uses.n;
  for (int i = 0; i < uses.n; i++) out->uses[i] = uses.s[i];
  out->size_class = copy.cls;
  return KT_OK;
}

/* ---- limits ---------------------------------------------------------------- */
kt_status kt_set_memory_limit(kt_pool_t *p, size_t bytes) {
  if (!p) return KT_ERR_INVALID;
  pthread_mutex_lock(&p->arena_lock);
  p->limit = bytes;
  pthread_mutex_unlock(&p->arena_lock);
  return KT_OK;
}

kt_status kt_set_memory_fraction(kt_pool_t *p, double fraction) {
  if (!p || !(fraction > 0.0 && fraction <= 1.0)) return KT_ERR_INVALID;
  if (!p->be->mem_info) return KT_ERR_UNAVAILABLE;
  size_t fr, total;
  kt_status st = p->be->mem_info(p->be->ctx, p->device, &fr, &total);
  if (st != KT_OK) return st;
  return kt_set_memory_limit(p, (size_t)((double)total * fraction));
}

size_t kt_get_memory_limit(const kt_pool_t *p) { return p ? p->limit : 0; }

static void acc_subtract(kt_stats *o, const kt_stats *b);

/* ---- stats ----------------------------------------------------------------- */
static void stat_set(kt_stat *s, int64_t cur, int64_t peak, int64_t alloc, int64_t freed) {
  s->current = cur; s->peak = peak; s->allocated = alloc; s->freed = freed;
}

kt_status kt_get_stats(kt_pool_t *p, kt_stats *o) {
  if (!p || !o) return KT_ERR_INVALID;
  memset(o, 0, sizeof *o);
  kt_tstats sum;
  memset(&sum, 0, sizeof sum);
  pthread_mutex_lock(&kt__registry);
  tstats_fold(&sum, &p->retired_stats);
  int64_t credit = credits_locked(p);
  for (kt_tcache *tc = p->tcaches; tc; tc = tc->pnext) tstats_fold(&sum, &tc->st);
  pthread_mutex_unlock(&kt__registry);
  uint64_t v = atomic_load(&p->packed);
  int64_t allocated = ((int64_t)(v & 0xffffffffu) << 9) - credit, pending = (int64_t)(v >> 32) << 9;
  pthread_mutex_lock(&p->arena_lock);
  int64_t ba = p->large_bytes_alloc, bf = p->large_bytes_freed;
  int64_t na = (int64_t)p->large_nalloc, nf = (int64_t)p->large_nfree;
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    int64_t a = (int64_t)kt__get(&sum.class_alloc[c]), f = (int64_t)kt__get(&sum.class_free[c]);
    na += a; nf += f;
    ba += a * (int64_t)kt__geom[c].size; bf += f * (int64_t)kt__geom[c].size;
  }
  int64_t ra = (int64_t)kt__get(&sum.req_alloc) + p->large_req_alloc, rf = (int64_t)kt__get(&sum.req_freed) + p->large_req_freed;
  stat_set(&o->allocated_bytes, allocated, atomic_load(&p->peak_allocated), ba, bf);
  stat_set(&o->active_bytes, allocated + pending, atomic_load(&p->peak_active), ba, bf - pending);
  stat_set(&o->reserved_bytes, p->reserved, p->reserved_peak, p->reserved_total, p->released_total);
  stat_set(&o->requested_bytes, ra - rf, 0, ra, rf);
  stat_set(&o->allocations, na - nf, 0, na, nf);
  stat_set(&o->segments, p->nsegments, p->nsegments_peak, p->nsegments_total, p->nsegments_total - p->nsegments);
  o->num_allocs = (uint64_t)na; o->num_frees = (uint64_t)nf;
  o->num_alloc_retries = p->n_retries; o->num_ooms = p->n_ooms;
  o->num_backend_reserves = p->n_reserves; o->num_backend_releases = p->n_releases;
  o->num_large_allocs = p->large_nalloc;
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    o->class_allocs[c] = kt__get(&sum.class_alloc[c]);
    o->class_live[c] = kt__get(&sum.class_alloc[c]) - kt__get(&sum.class_free[c]);
  }
  o->memory_limit = p->limit;
  o->largest_free_block = kt__arena_largest_free(p);
  o->num_release_syncs = p->n_trims;
  o->vmm = p->vmm;
  acc_subtract(o, &p->acc_base);
  pthread_mutex_unlock(&p->arena_lock);
  pthread_mutex_lock(&p->pending_lock);
  o->num_pending_frees = p->n_pending_frees;
  pthread_mutex_unlock(&p->pending_lock);
  return KT_OK;
}

/* Cumulative fields of o minus those of base (the last kt_reset_accumulated_stats). */
static void acc_subtract(kt_stats *o, const kt_stats *b) {
  kt_stat *os[] = {&o->allocated_bytes, &o->active_bytes, &o->reserved_bytes, &o->requested_bytes,
                   &o->allocations, &o->segments};
  const kt_stat *bs[] = {&b->allocated_bytes, &b->active_bytes, &b->reserved_bytes, &b->requested_bytes,
                         &b->allocations, &b->segments};
  for (size_t i = 0; i < sizeof os / sizeof *os; i++) {
    os[i]->allocated -= bs[i]->allocated;
    os[i]->freed -= bs[i]->freed;
  }
  o->num_allocs -= b->num_allocs; o->num_frees -= b->num_frees;
  o->num_alloc_retries -= b->num_alloc_retries; o->num_ooms -= b->num_ooms;
  o->num_backend_reserves -= b->num_backend_reserves; o->num_backend_releases -= b->num_backend_releases;
  o->num_large_allocs -= b->num_large_allocs; o->num_pending_frees -= b->num_pending_frees;
  o->num_release_syncs -= b->num_release_syncs;
  for (int c = 0; c < KT_NUM_CLASSES; c++) o->class_allocs[c] -= b->class_allocs[c];
}

void kt_reset_accumulated_stats(kt_pool_t *p) {
  if (!p) return;
  kt_stats now;
  pthread_mutex_lock(&p->arena_lock);
  memset(&p->acc_base, 0, sizeof p->acc_base);   /* kt_get_stats subtracts it: read raw values */
  pthread_mutex_unlock(&p->arena_lock);
  kt_get_stats(p, &now);
  pthread_mutex_lock(&p->arena_lock);
  p->acc_base = now;
  pthread_mutex_unlock(&p->arena_lock);
}

void kt_reset_peak_stats(kt_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&kt__registry);
  int64_t credit = credits_locked(p);
  pthread_mutex_unlock(&kt__registry);
  uint64_t v = atomic_load(&p->packed);
  int64_t allocated = ((int64_t)(v & 0xffffffffu) << 9) - credit, pending = (int64_t)(v >> 32) << 9;
  atomic_store(&p->peak_allocated, allocated);
  atomic_store(&p->peak_active, allocated + pending);
  pthread_mutex_lock(&p->arena_lock);
  p->reserved_peak = p->reserved;
  p->nsegments_peak = p->nsegments;
  pthread_mutex_unlock(&p->arena_lock);
}

/* ---- validation (O(n)) ------------------------------------------------------- */
#define CHECK(c) do { if (!(c)) { st = KT_ERR_INVALID; goto out; } } while (0)

kt_status kt_pool_validate(kt_pool_t *p) {
  if (!p) return KT_ERR_INVALID;
  kt_status st = KT_OK;
  int64_t live = 0;
  pthread_mutex_lock(&kt__registry);
  pthread_mutex_lock(&p->heap_lock);
  pthread_mutex_lock(&p->arena_lock);
  st = kt__arena_validate(p);
  if (st != KT_OK) goto out;
  for (kt_segment *s = p->segments; s; s = s->next)
    for (kt_extent *e = s->first; e; e = e->anext)
      if (e->kind == KT_EXT_LARGE && e->blk.state == KT_BLOCK_LIVE) live += (int64_t)e->size;
  for (kt_heap *h = p->heap_list; h; h = h->next) {
    kt_spin_lock(&h->lock);
    for (kt_slab *s = h->slabs; s; s = s->next) s->vcount = 0;
    for (int c = 0; c < KT_NUM_CLASSES && st == KT_OK; c++) {     /* heap lists */
      uint64_t n = 0;
      for (kt_block *b = h->free[c]; b && st == KT_OK; b = b->next, n++) {
        if (b->state != KT_BLOCK_FREE || b->cls != c || b->heap != h || n > (1u << 28)) st = KT_ERR_INVALID;
        else b->slab->vcount++;
      }
    }
    for (kt_slab *s = h->slabs; s && st == KT_OK; s = s->next) {
      if (s->vcount != s->nfree) st = KT_ERR_INVALID;
      s->vcount = 0;
    }
    kt_spin_unlock(&h->lock);
    if (st != KT_OK) goto out;
  }
  for (kt_tcache *tc = p->tcaches; tc && st == KT_OK; tc = tc->pnext)   /* tcache bins */
    for (int c = 0; c < KT_NUM_CLASSES && st == KT_OK; c++) {
      uint32_t n = 0;
      for (kt_block *b = tc->bins[c].head; b && st == KT_OK; b = b->next, n++) {
        if (b->state != KT_BLOCK_FREE || b->cls != c || b->heap != tc->heap || n > KT_TCACHE_MAX) st = KT_ERR_INVALID;
        else b->slab->vcount++;
      }
      if (n != tc->bins[c].n) st = KT_ERR_INVALID;
    }
  if (st != KT_OK) goto out;
  for (kt_heap *h = p->heap_list; h; h = h->next)
    for (kt_slab *s = h->slabs; s && st == KT_OK; s = s->next) {
      uint32_t nfree = 0;
      if (!(s->heap == h && s->ext && s->ext->slab == s && s->ext->kind == KT_EXT_SLAB)) st = KT_ERR_INVALID;
      for (uint32_t i = 0; i < s->nblocks && st == KT_OK; i++) {
        kt_block *b = &s->blocks[i];
        if (b->state == KT_BLOCK_FREE) nfree++;
        else if (b->state == KT_BLOCK_LIVE) live += (int64_t)kt__geom[s->cls].size;
        if (b->addr != s->base + i * kt__geom[s->cls].size || b->cls != s->cls) st = KT_ERR_INVALID;
      }
      if (nfree != s->nfree + s->vcount) st = KT_ERR_INVALID;   /* heap list + tcaches */
    }
  if (st != KT_OK) goto out;
  CHECK(live == (int64_t)((atomic_load(&p->packed) & 0xffffffffu) << 9) - credits_locked(p));
out:
  pthread_mutex_unlock(&p->arena_lock);
  pthread_mutex_unlock(&p->heap_lock);
  pthread_mutex_unlock(&kt__registry);
  return st;
}
