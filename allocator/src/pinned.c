/* allocator/src/pinned.c — the pinned host pool: a jemalloc arena over pinned chunks.
 *
 * jemalloc (a private build, see tools/jemalloc.sh) does the placing: size classes,
 * extent reuse, split and coalesce. This file gives it memory through extent hooks
 * and keeps the books jemalloc cannot keep for us:
 *
 *   chunk      one backend host_alloc; a sorted array, looked up by address.
 *   live table ptr -> requested size and recorded streams of every live block
 *              (open addressing, linear probing, backward-shift delete). It makes
 *              free safe against foreign pointers and double frees, which jemalloc
 *              would turn into silent corruption, and gives the requested-bytes
 *              stat. Pinned allocations are per batch, not per kernel, so one
 *              mutex around everything is cheap.
 *   pending    freed blocks whose recorded streams have not finished; polled (event
 *              query) on every alloc and trim, released to jemalloc when done.
 *
 * Hook policy (every extent lies inside one chunk):
 *   alloc   a fresh chunk of exactly the extent's size (never at a given address)
 *   merge   only two extents of the same chunk
 *   split   always
 *           unless release_on_grow and idle pinned bytes come to half of it: then
 *           kt_pinned_alloc trims (gives idle chunks back) and asks again
 *   dalloc  succeeds only for a whole chunk (it is given back); a piece is refused,
 *           so jemalloc keeps it, still pinned, for reuse
 *   destroy (arena destruction) counts bytes per chunk and gives a chunk back once
 *           all of it has come home
 *   commit/decommit/purge: not provided - pinned pages are never decommitted.
 *
 * jemalloc options (kt_je_malloc_conf, read once when it initialises):
 *   retain:false           grow by exactly what a request needs; jemalloc's
 *                          exponential "retained" growth would pin up to 2x
 *   dirty/muzzy_decay_ms:-1 cached extents stay until kt_pinned_trim
 *   (built --disable-cache-oblivious: no extra page per large block)
 *   oversize_threshold:0   large blocks stay in our arena, no eager purge
 *   lg_extent_max_active_fit:0  a cached extent serves only its own size class.
 *                          Carving big idle extents for smaller requests left
 *                          chunks shared by live blocks, never wholly idle: on a
 *                          random mix of batch sizes jemalloc's default (6), with
 *                          chunks kept, pinned 1.658x the requested bytes against
 *                          1.146x this way (bench/results/pinned_footprint.json, H100;
 *                          the price is more pinning calls when sizes keep changing).
 * KT_JE_MALLOC_CONF in the environment overrides these (jemalloc reads it).
 * Metadata never lives in pinned memory (arenas_create_ext, metadata_use_hooks=0).
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jemalloc/jemalloc.h>

#include "kitsune/pinned.h"

const char *kt_je_malloc_conf =
    "retain:false,dirty_decay_ms:-1,muzzy_decay_ms:-1,oversize_threshold:0,lg_extent_max_active_fit:0";

/* jemalloc 5.3.0's arena_config_t (include/jemalloc/internal/arena_types.h), the
 * argument of "experimental.arenas_create_ext"; tools/jemalloc.sh pins the version. */
typedef struct je_arena_config {
  extent_hooks_t *extent_hooks;
  bool metadata_use_hooks;
} je_arena_config;

typedef struct chunk {
  uintptr_t base;   /* the extent jemalloc got: [base, base + size) */
  size_t size;
  size_t home;      /* bytes handed back by jemalloc's destroy hook */
  void *raw;        /* what host_alloc returned (base, unless realigned) */
  size_t raw_size;
} chunk;

typedef struct live_ent {
  size_t size;              /* requested */
  int nuses;
  int dev[KT_PINNED_MAX_USES];
  kt_stream_t stream[KT_PINNED_MAX_USES];
} live_ent;

typedef struct pend {
  void *ptr;
  size_t size;
  int nev;
  int dev[KT_PINNED_MAX_USES];
  kt_event_t ev[KT_PINNED_MAX_USES];
} pend;

struct kt_pinned_pool {
  extent_hooks_t hooks;      /* first: a hook finds its pool from the hooks pointer */
  const kt_backend *b;
  unsigned arena;
  int flags;                 /* MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE */
  pthread_mutex_t mu;        /* guards everything below */
  chunk *chunks;             /* sorted by base */
  size_t nchunks, capchunks;
  uintptr_t *keys;           /* live table; 0 = empty slot */
  live_ent *vals;
  size_t tcap, tcount;       /* tcap a power of two, tcount <= tcap / 2 */
  pend *pending;
  size_t npending, cappending;
  int release_on_grow;
  kt_pinned_stats st;
};

/* Set by kt_pinned_alloc around its mallocx, read by h_alloc on the same thread:
 * while `refuse` is set, a new chunk is refused when the idle pinned bytes come to
 * at least half of it, and `refused` tells kt_pinned_alloc to trim and try again
 * (once); `pin_failed` tells it the backend refused to pin (out of memory, not a
 * host metadata failure). */
static _Thread_local struct { const kt_pinned_pool_t *pool; int refuse, refused, pin_failed; } t_grow;

static kt_pinned_pool_t *pool_of(extent_hooks_t *h) { return (kt_pinned_pool_t *)h; }

static void stat_add(kt_stat *s, int64_t d) {
  s->current += d;
  if (d > 0) s->allocated += d; else s->freed -= d;
  if (s->current > s->peak) s->peak = s->current;
}

/* ---- chunk table (mu held) ------------------------------------------------ */
/* Index of the chunk containing addr, or -1. */
static long chunk_find(const kt_pinned_pool_t *p, uintptr_t addr) {
  size_t lo = 0, hi = p->nchunks;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (p->chunks[mid].base + p->chunks[mid].size <= addr) lo = mid + 1;
    else hi = mid;
  }
  if (lo < p->nchunks && p->chunks[lo].base <= addr) return (long)lo;
  return -1;
}

static int chunk_insert(kt_pinned_pool_t *p, uintptr_t base, size_t size, void *raw, size_t raw_size) {
  if (p->nchunks == p->capchunks) {
    size_t cap = p->capchunks ? 2 * p->capchunks : 64;
    chunk *n = realloc(p->chunks, cap * sizeof *n);
    if (!n) return -1;
    p->chunks = n;
    p->capchunks = cap;
  }
  size_t i = 0;
  while (i < p->nchunks && p->chunks[i].base < base) i++;
  memmove(&p->chunks[i + 1], &p->chunks[i], (p->nchunks - i) * sizeof *p->chunks);
  p->chunks[i] = (chunk){base, size, 0, raw, raw_size};
  p->nchunks++;
  stat_add(&p->st.mapped_bytes, (int64_t)raw_size);
  stat_add(&p->st.chunks, 1);
  return 0;
}

static void chunk_remove(kt_pinned_pool_t *p, size_t i) {
  stat_add(&p->st.mapped_bytes, -(int64_t)p->chunks[i].raw_size);
  stat_add(&p->st.chunks, -1);
  memmove(&p->chunks[i], &p->chunks[i + 1], (p->nchunks - i - 1) * sizeof *p->chunks);
  p->nchunks--;
}

/* ---- extent hooks ---------------------------------------------------------- */
static void *h_alloc(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment, bool *zero,
                     bool *commit, unsigned arena_ind) {
  (void)arena_ind;
  kt_pinned_pool_t *p = pool_of(h);
  if (new_addr) return NULL;   /* growing in place is not something pinning can do */
  if (t_grow.pool == p && t_grow.refuse) {
    pthread_mutex_lock(&p->mu);
    int64_t idle = p->st.mapped_bytes.current - p->st.allocated_bytes.current;
    pthread_mutex_unlock(&p->mu);
    if (idle >= (int64_t)size / 2) {
      t_grow.refused = 1;
      return NULL;
    }
  }
  void *raw = NULL;
  size_t raw_size = size;
  kt_status st = p->b->host_alloc(p->b->ctx, raw_size, &raw);
  if (st == KT_OK && ((uintptr_t)raw & (alignment - 1))) {
    /* cudaHostAlloc may place a block off page boundaries (seen on the H100 box);
     * ask again for enough to align inside. */
    p->b->host_free(p->b->ctx, raw, raw_size);
    raw = NULL;
    raw_size = size + alignment;
    st = p->b->host_alloc(p->b->ctx, raw_size, &raw);
  }
  if (st != KT_OK || !raw) {
    pthread_mutex_lock(&p->mu);
    p->st.num_failed_pins++;
    pthread_mutex_unlock(&p->mu);
    if (t_grow.pool == p) t_grow.pin_failed = 1;
    return NULL;
  }
  void *mem = (void *)(((uintptr_t)raw + alignment - 1) & ~(uintptr_t)(alignment - 1));
  pthread_mutex_lock(&p->mu);
  int bad = chunk_insert(p, (uintptr_t)mem, size, raw, raw_size);
  pthread_mutex_unlock(&p->mu);
  if (bad) {
    p->b->host_free(p->b->ctx, raw, raw_size);
    return NULL;
  }
  if (*zero) memset(mem, 0, size);
  *commit = true;
  return mem;
}

static bool h_dalloc(extent_hooks_t *h, void *addr, size_t size, bool committed, unsigned arena_ind) {
  (void)committed; (void)arena_ind;
  kt_pinned_pool_t *p = pool_of(h);
  pthread_mutex_lock(&p->mu);
  long i = chunk_find(p, (uintptr_t)addr);
  bool whole = i >= 0 && p->chunks[i].base == (uintptr_t)addr && p->chunks[i].size == size &&
               p->chunks[i].home == 0;
  chunk c = whole ? p->chunks[i] : (chunk){0};
  if (whole) chunk_remove(p, (size_t)i);
  pthread_mutex_unlock(&p->mu);
  if (!whole) return true;   /* a piece: jemalloc keeps it (pinned) for reuse */
  p->b->host_free(p->b->ctx, c.raw, c.raw_size);
  return false;
}

static void h_destroy(extent_hooks_t *h, void *addr, size_t size, bool committed, unsigned arena_ind) {
  (void)committed; (void)arena_ind;
  kt_pinned_pool_t *p = pool_of(h);
  pthread_mutex_lock(&p->mu);
  long i = chunk_find(p, (uintptr_t)addr);
  chunk c = {0};
  if (i >= 0) {
    p->chunks[i].home += size;
    if (p->chunks[i].home >= p->chunks[i].size) {
      c = p->chunks[i];
      chunk_remove(p, (size_t)i);
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (c.raw) p->b->host_free(p->b->ctx, c.raw, c.raw_size);
}

static bool h_split(extent_hooks_t *h, void *addr, size_t size, size_t size_a, size_t size_b,
                    bool committed, unsigned arena_ind) {
  (void)h; (void)addr; (void)size; (void)size_a; (void)size_b; (void)committed; (void)arena_ind;
  return false;
}

static bool h_merge(extent_hooks_t *h, void *addr_a, size_t size_a, void *addr_b, size_t size_b,
                    bool committed, unsigned arena_ind) {
  (void)size_a; (void)size_b; (void)committed; (void)arena_ind;
  kt_pinned_pool_t *p = pool_of(h);
  pthread_mutex_lock(&p->mu);
  long a = chunk_find(p, (uintptr_t)addr_a), b = chunk_find(p, (uintptr_t)addr_b);
  pthread_mutex_unlock(&p->mu);
  return a < 0 || a != b;   /* false = merged */
}

/* ---- live table (mu held) -------------------------------------------------- */
static size_t slot_of(uintptr_t key, size_t cap) {
  uint64_t x = (uint64_t)key * 0x9E3779B97F4A7C15ull;
  return (size_t)(x >> 20) & (cap - 1);
}

static int live_grow(kt_pinned_pool_t *p) {
  size_t cap = p->tcap ? 2 * p->tcap : 256;
  uintptr_t *k = calloc(cap, sizeof *k);
  live_ent *v = calloc(cap, sizeof *v);
  if (!k || !v) { free(k); free(v); return -1; }
  for (size_t i = 0; i < p->tcap; i++) {
    if (!p->keys[i]) continue;
    size_t j = slot_of(p->keys[i], cap);
    while (k[j]) j = (j + 1) & (cap - 1);
    k[j] = p->keys[i];
    v[j] = p->vals[i];
  }
  free(p->keys);
  free(p->vals);
  p->keys = k;
  p->vals = v;
  p->tcap = cap;
  return 0;
}

/* Slot holding key, or -1. */
static long live_find(const kt_pinned_pool_t *p, uintptr_t key) {
  if (!p->tcap) return -1;
  for (size_t j = slot_of(key, p->tcap);; j = (j + 1) & (p->tcap - 1)) {
    if (p->keys[j] == key) return (long)j;
    if (!p->keys[j]) return -1;
  }
}

static void live_put(kt_pinned_pool_t *p, uintptr_t key, size_t size) {
  size_t j = slot_of(key, p->tcap);
  while (p->keys[j]) j = (j + 1) & (p->tcap - 1);
  p->keys[j] = key;
  p->vals[j] = (live_ent){.size = size};
  p->tcount++;
}

/* Backward-shift deletion keeps every probe chain unbroken without tombstones. */
static void live_del(kt_pinned_pool_t *p, size_t j) {
  size_t mask = p->tcap - 1;
  p->keys[j] = 0;
  p->tcount--;
  for (size_t i = (j + 1) & mask; p->keys[i]; i = (i + 1) & mask) {
    size_t home = slot_of(p->keys[i], p->tcap);
    /* Move i into the hole j when its home is not cyclically in (j, i]. */
    if (((i - home) & mask) >= ((i - j) & mask)) {
      p->keys[j] = p->keys[i];
      p->vals[j] = p->vals[i];
      p->keys[i] = 0;
      j = i;
    }
  }
}

/* ---- releasing blocks ------------------------------------------------------ */
/* Books a block's return and gives it to jemalloc. */
static void release_block(kt_pinned_pool_t *p, void *ptr, size_t size) {
  size_t usable = kt_je_sallocx(ptr, 0);
  pthread_mutex_lock(&p->mu);
  stat_add(&p->st.requested_bytes, -(int64_t)size);
  stat_add(&p->st.allocated_bytes, -(int64_t)usable);
  stat_add(&p->st.allocations, -1);
  pthread_mutex_unlock(&p->mu);
  kt_je_dallocx(ptr, p->flags);
}

static void drop_events(kt_pinned_pool_t *p, pend *q) {
  for (int i = 0; i < q->nev; i++) p->b->event_destroy(p->b->ctx, q->dev[i], q->ev[i]);
  q->nev = 0;
}

/* Releases pending blocks whose events have all completed. */
static void poll_pending(kt_pinned_pool_t *p) {
  for (;;) {
    pend done = {0};
    int found = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->npending && !found; i++) {
      pend *q = &p->pending[i];
      int all = 1;
      for (int e = 0; e < q->nev && all; e++) {
        int ok = 0;
        /* A failed query counts as done: the event cannot tell us more, and
         * keeping the block forever would leak it. */
        if (p->b->event_query(p->b->ctx, q->dev[e], q->ev[e], &ok) == KT_OK && !ok) all = 0;
      }
      if (all) {
        done = *q;
        p->pending[i] = p->pending[--p->npending];
        p->st.pending_now--;
        found = 1;
      }
    }
    pthread_mutex_unlock(&p->mu);
    if (!found) return;
    drop_events(p, &done);
    release_block(p, done.ptr, done.size);
  }
}

/* ---- public API ------------------------------------------------------------ */
kt_status kt_pinned_create(const kt_backend *backend, kt_pinned_pool_t **out) {
  if (!out) return KT_ERR_INVALID;
  *out = NULL;
  if (!backend) return KT_ERR_INVALID;
  if (!backend->host_alloc || !backend->host_free) return KT_ERR_UNAVAILABLE;
  kt_pinned_pool_t *p = calloc(1, sizeof *p);
  if (!p) return KT_ERR_HOST_OOM;
  p->hooks = (extent_hooks_t){.alloc = h_alloc, .dalloc = h_dalloc, .destroy = h_destroy,
                              .split = h_split, .merge = h_merge};
  p->b = backend;
  pthread_mutex_init(&p->mu, NULL);
  je_arena_config cfg = {.extent_hooks = &p->hooks, .metadata_use_hooks = false};
  size_t len = sizeof p->arena;
  int err = kt_je_mallctl("experimental.arenas_create_ext", &p->arena, &len, &cfg, sizeof cfg);
  if (err) {
    pthread_mutex_destroy(&p->mu);
    free(p);
    return err == ENOMEM || err == EAGAIN ? KT_ERR_HOST_OOM : KT_ERR_BACKEND;
  }
  p->flags = MALLOCX_ARENA(p->arena) | MALLOCX_TCACHE_NONE;
  p->release_on_grow = 1;
  *out = p;
  return KT_OK;
}

void kt_pinned_destroy(kt_pinned_pool_t *p) {
  if (!p) return;
  for (size_t i = 0; i < p->npending; i++) drop_events(p, &p->pending[i]);
  char name[64];
  snprintf(name, sizeof name, "arena.%u.destroy", p->arena);
  kt_je_mallctl(name, NULL, NULL, NULL, 0);
  /* Whatever jemalloc did not hand back (it should have handed back all). */
  for (size_t i = 0; i < p->nchunks; i++) p->b->host_free(p->b->ctx, p->chunks[i].raw, p->chunks[i].raw_size);
  pthread_mutex_destroy(&p->mu);
  free(p->chunks);
  free(p->keys);
  free(p->vals);
  free(p->pending);
  free(p);
}

kt_status kt_pinned_alloc(kt_pinned_pool_t *p, size_t size, void **out) {
  if (!p || !out) return KT_ERR_INVALID;
  *out = NULL;
  if (size == 0) return KT_OK;
  if (size > KT_PINNED_MAX_ALLOC) return KT_ERR_OOM;
  if (p->npending) poll_pending(p);   /* racy read: a miss only delays a reuse */
  t_grow.pool = p;
  t_grow.refuse = p->release_on_grow;
  t_grow.refused = t_grow.pin_failed = 0;
  void *mem = kt_je_mallocx(size, p->flags);
  if (!mem && t_grow.refused) {   /* growing while idle bytes are pinned: give them back first */
    t_grow.refuse = 0;
    kt_pinned_trim(p);
    pthread_mutex_lock(&p->mu);
    p->st.num_release_on_grow++;
    pthread_mutex_unlock(&p->mu);
    mem = kt_je_mallocx(size, p->flags);
  }
  t_grow.pool = NULL;
  /* A refused pin is out of (pinnable) memory; otherwise jemalloc's metadata failed. */
  if (!mem) return t_grow.pin_failed ? KT_ERR_OOM : KT_ERR_HOST_OOM;
  size_t usable = kt_je_sallocx(mem, 0);
  pthread_mutex_lock(&p->mu);
  if (2 * (p->tcount + 1) > p->tcap && live_grow(p)) {   /* no room to remember the block: undo */
    pthread_mutex_unlock(&p->mu);
    kt_je_dallocx(mem, p->flags);
    return KT_ERR_HOST_OOM;
  }
  live_put(p, (uintptr_t)mem, size);
  stat_add(&p->st.requested_bytes, (int64_t)size);
  stat_add(&p->st.allocated_bytes, (int64_t)usable);
  stat_add(&p->st.allocations, 1);
  p->st.num_allocs++;
  pthread_mutex_unlock(&p->mu);
  *out = mem;
  return KT_OK;
}

kt_status kt_pinned_free(kt_pinned_pool_t *p, void *ptr) {
  if (!p) return KT_ERR_INVALID;
  if (!ptr) return KT_OK;
  pthread_mutex_lock(&p->mu);
  long j = live_find(p, (uintptr_t)ptr);
  if (j < 0) {
    pthread_mutex_unlock(&p->mu);
    return KT_ERR_INVALID;
  }
  live_ent e = p->vals[j];
  live_del(p, (size_t)j);
  p->st.num_frees++;
  pthread_mutex_unlock(&p->mu);
  if (e.nuses == 0) {
    release_block(p, ptr, e.size);
    return KT_OK;
  }
  /* Park the block behind an event on every stream that used it. */
  pend q = {.ptr = ptr, .size = e.size};
  kt_status st = KT_OK;
  for (int i = 0; i < e.nuses && st == KT_OK; i++) {
    st = p->b->event_create(p->b->ctx, e.dev[i], &q.ev[q.nev]);
    if (st != KT_OK) break;
    q.dev[q.nev++] = e.dev[i];
    st = p->b->event_record(p->b->ctx, e.dev[i], q.ev[q.nev - 1], e.stream[i]);
  }
  pthread_mutex_lock(&p->mu);
  if (st == KT_OK && p->npending == p->cappending) {
    size_t cap = p->cappending ? 2 * p->cappending : 16;
    pend *n = realloc(p->pending, cap * sizeof *n);
    if (n) { p->pending = n; p->cappending = cap; } else st = KT_ERR_HOST_OOM;
  }
  if (st == KT_OK) {
    p->pending[p->npending++] = q;
    p->st.num_pending_frees++;
    p->st.pending_now++;
  }
  pthread_mutex_unlock(&p->mu);
  if (st != KT_OK) {   /* no event to wait on: wait for the devices instead, then release */
    drop_events(p, &q);
    for (int i = 0; i < e.nuses; i++) p->b->synchronize(p->b->ctx, e.dev[i]);
    release_block(p, ptr, e.size);
  }
  return KT_OK;
}

kt_status kt_pinned_record_stream(kt_pinned_pool_t *p, void *ptr, int device, kt_stream_t stream) {
  if (!p || !ptr) return KT_ERR_INVALID;
  kt_status st = KT_OK;
  pthread_mutex_lock(&p->mu);
  long j = live_find(p, (uintptr_t)ptr);
  if (j < 0) {
    st = KT_ERR_INVALID;
  } else {
    live_ent *e = &p->vals[j];
    int seen = 0;
    for (int i = 0; i < e->nuses; i++) seen |= e->dev[i] == device && e->stream[i] == stream;
    if (!seen && e->nuses == KT_PINNED_MAX_USES) st = KT_ERR_LIMIT;
    else if (!seen) {
      e->dev[e->nuses] = device;
      e->stream[e->nuses++] = stream;
    }
  }
  pthread_mutex_unlock(&p->mu);
  return st;
}

kt_status kt_pinned_block_size(kt_pinned_pool_t *p, const void *ptr, size_t *size) {
  if (!p || !size) return KT_ERR_INVALID;
  pthread_mutex_lock(&p->mu);
  long j = live_find(p, (uintptr_t)ptr);
  if (j >= 0) *size = p->vals[j].size;
  pthread_mutex_unlock(&p->mu);
  return j >= 0 ? KT_OK : KT_ERR_INVALID;
}

void kt_pinned_set_release_on_grow(kt_pinned_pool_t *p, int on) {
  if (p) p->release_on_grow = on != 0;
}

kt_status kt_pinned_trim(kt_pinned_pool_t *p) {
  if (!p) return KT_ERR_INVALID;
  poll_pending(p);
  char name[64];
  snprintf(name, sizeof name, "arena.%u.purge", p->arena);
  return kt_je_mallctl(name, NULL, NULL, NULL, 0) ? KT_ERR_BACKEND : KT_OK;
}

kt_status kt_pinned_get_stats(kt_pinned_pool_t *p, kt_pinned_stats *out) {
  if (!p || !out) return KT_ERR_INVALID;
  pthread_mutex_lock(&p->mu);
  *out = p->st;
  pthread_mutex_unlock(&p->mu);
  return KT_OK;
}

void kt_pinned_reset_peak_stats(kt_pinned_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  kt_stat *s[] = {&p->st.requested_bytes, &p->st.allocated_bytes, &p->st.mapped_bytes,
                  &p->st.allocations, &p->st.chunks};
  for (size_t i = 0; i < sizeof s / sizeof *s; i++) s[i]->peak = s[i]->current;
  pthread_mutex_unlock(&p->mu);
}

/* Adds the block's sizes to the sums; 0 when it does not lie inside one chunk. */
static int block_ok(const kt_pinned_pool_t *p, uintptr_t ptr, size_t size, int64_t *requested, int64_t *usable) {
  size_t u = kt_je_sallocx((void *)ptr, 0);
  *requested += (int64_t)size;
  *usable += (int64_t)u;
  long c = chunk_find(p, ptr);
  return u >= size && c >= 0 && ptr + u <= p->chunks[c].base + p->chunks[c].size;
}

kt_status kt_pinned_validate(kt_pinned_pool_t *p) {
  if (!p) return KT_ERR_INVALID;
  kt_status st = KT_OK;
  pthread_mutex_lock(&p->mu);
  int64_t mapped = 0, requested = 0, usable = 0;
  size_t n = 0;
  for (size_t i = 0; i < p->nchunks; i++) {
    mapped += (int64_t)p->chunks[i].raw_size;
    if (p->chunks[i].base < (uintptr_t)p->chunks[i].raw ||
        p->chunks[i].base + p->chunks[i].size > (uintptr_t)p->chunks[i].raw + p->chunks[i].raw_size)
      st = KT_ERR_INVALID;
    if (i && p->chunks[i - 1].base + p->chunks[i - 1].size > p->chunks[i].base) st = KT_ERR_INVALID;
  }
  for (size_t j = 0; j < p->tcap; j++) {
    if (!p->keys[j]) continue;
    n++;
    if (!block_ok(p, p->keys[j], p->vals[j].size, &requested, &usable)) st = KT_ERR_INVALID;
    if (live_find(p, p->keys[j]) != (long)j) st = KT_ERR_INVALID;   /* reachable by probing */
  }
  for (size_t i = 0; i < p->npending; i++) {
    if (live_find(p, (uintptr_t)p->pending[i].ptr) >= 0) st = KT_ERR_INVALID;   /* both live and pending */
    if (!block_ok(p, (uintptr_t)p->pending[i].ptr, p->pending[i].size, &requested, &usable)) st = KT_ERR_INVALID;
  }
  const kt_pinned_stats *s = &p->st;
  if (n != p->tcount || p->npending != s->pending_now || (int64_t)(n + p->npending) != s->allocations.current || requested != s->requested_bytes.current ||
      usable != s->allocated_bytes.current || mapped != s->mapped_bytes.current ||
      (int64_t)p->nchunks != s->chunks.current || mapped < usable)
    st = KT_ERR_INVALID;
  pthread_mutex_unlock(&p->mu);
  return st;
}
