/* allocator/src/arena.c — best fit with split and coalesce over backend segments.
 *
 * Free extents sit in bins, 8 per power of two (bin_of is the floor of the size
 * class formula, extended to 2^48), with a bitmap of non-empty bins. A search for
 * s scans bin_of(s) for the smallest extent that fits, then the next non-empty
 * bins, whose extents are all larger than s. Each free extent carries a tag: the
 * stream whose work may still touch it (NULL for fresh memory). A search on
 * stream S looks at S's extents, then untagged ones; it never takes another
 * stream's. Neighbours coalesce when their tags agree or one is untagged (the
 * merged extent keeps the tag: confining fresh memory to S is always safe).
 * Everything here runs under pool->arena_lock.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int floor_log2(size_t x) { return 63 - __builtin_clzll((unsigned long long)x); }

int kt__bin_of(size_t size) {
  if (size <= 4096) return size < KT_QUANTUM ? 0 : (int)(size / KT_QUANTUM) - 1;
  int k = floor_log2(size);
  return 8 + 8 * (k - 12) + (int)((size >> (k - 3)) - 8);
}

kt_bins *kt__bins_for(kt_pool_t *p, kt_heap *tag) { return tag ? &tag->bins : &p->untagged; }

void kt__bins_insert(kt_bins *b, kt_extent *e) {
  int i = kt__bin_of(e->size);
  e->bin = (uint16_t)i;
  e->fprev = NULL;
  e->fnext = b->head[i];
  if (e->fnext) e->fnext->fprev = e;
  b->head[i] = e;
  b->bits[i >> 6] |= (uint64_t)1 << (i & 63);
  b->count++;
}

void kt__bins_remove(kt_bins *b, kt_extent *e) {
  int i = e->bin;
  if (e->fprev) e->fprev->fnext = e->fnext; else b->head[i] = e->fnext;
  if (e->fnext) e->fnext->fprev = e->fprev;
  if (!b->head[i]) b->bits[i >> 6] &= ~((uint64_t)1 << (i & 63));
  e->fprev = e->fnext = NULL;
  b->count--;
}

static int next_bin(const kt_bins *b, int from) {
  for (int w = from >> 6; w < KT_BIN_WORDS; w++) {
    uint64_t m = b->bits[w];
    if (w == from >> 6) m &= ~(uint64_t)0 << (from & 63);
    if (m) return (w << 6) + __builtin_ctzll(m);
  }
  return -1;
}

static inline uintptr_t align_up(uintptr_t x, size_t a) { return (x + a - 1) & ~(uintptr_t)(a - 1); }

static bool fits(const kt_extent *e, size_t size, size_t align) {
  uintptr_t start = align_up(e->addr, align);
  return start + size <= e->addr + e->size;
}

static kt_extent *best_fit(kt_bins *b, size_t size, size_t align) {
  if (!b->count) return NULL;
  for (int i = next_bin(b, kt__bin_of(size)); i >= 0; i = next_bin(b, i + 1)) {
    kt_extent *best = NULL;
    for (kt_extent *e = b->head[i]; e; e = e->fnext)
      if (fits(e, size, align) && (!best || e->size < best->size || (e->size == best->size && e->addr < best->addr)))
        best = e;
    if (best) return best;
  }
  return NULL;
}

static kt_extent *extent_new(void) {   /* holds a cache-line-aligned kt_block */
  kt_extent *e = aligned_alloc(KT_CACHELINE, sizeof(kt_extent));
  if (e) memset(e, 0, sizeof *e);
  return e;
}

/* Split [e.addr, e.addr+at) off e as a new FREE extent before it, same tag. */
static kt_extent *split_front(kt_pool_t *p, kt_extent *e, size_t at) {
  kt_extent *f = extent_new();
  if (!f) return NULL;
  f->addr = e->addr; f->size = at; f->seg = e->seg; f->tag = e->tag; f->kind = KT_EXT_FREE;
  f->aprev = e->aprev; f->anext = e;
  if (e->aprev) e->aprev->anext = f; else e->seg->first = f;
  e->aprev = f;
  e->addr += at; e->size -= at;
  kt__bins_insert(kt__bins_for(p, f->tag), f);
  return f;
}

/* Split the tail beyond keep bytes off e as a new FREE extent, same tag. */
static kt_extent *split_back(kt_pool_t *p, kt_extent *e, size_t keep) {
  kt_extent *f = extent_new();
  if (!f) return NULL;
  f->addr = e->addr + keep; f->size = e->size - keep; f->seg = e->seg; f->tag = e->tag; f->kind = KT_EXT_FREE;
  f->anext = e->anext; f->aprev = e;
  if (e->anext) e->anext->aprev = f;
  e->anext = f;
  e->size = keep;
  kt__bins_insert(kt__bins_for(p, f->tag), f);
  return f;
}

/* Carve [aligned start, +size) out of free extent e; returns it unbinned. */
static kt_status carve(kt_pool_t *p, kt_extent *e, size_t size, size_t align, kt_extent **out) {
  kt__bins_remove(kt__bins_for(p, e->tag), e);
  size_t front = align_up(e->addr, align) - e->addr;
  if (front && !split_front(p, e, front)) goto nomem;
  if (e->size > size && !split_back(p, e, size)) goto nomem;
  *out = e;
  return KT_OK;
nomem:
  kt__bins_insert(kt__bins_for(p, e->tag), e);
  return KT_ERR_HOST_OOM;
}

/* Growth: a request under KT_SHARED_SEGMENT/2 gets a KT_SHARED_SEGMENT segment that
 * later requests carve too (one backend call: a cudaMalloc pair takes 68-77 us on the H100
 * host, bench/results/alloc_bench_cuda.json, serves many); a larger one gets its size rounded to 2 MiB. When the larger
 * segment is refused (limit or device), the rounded size is tried. */
#define KT_SHARED_SEGMENT ((size_t)20 << 20)

static kt_status grow(kt_pool_t *p, size_t size, kt_extent **out, kt_oom_info *oom) {
  size_t exact = align_up(size, KT_SEGMENT_ALIGN);
  size_t seg = size < KT_SHARED_SEGMENT / 2 ? KT_SHARED_SEGMENT : exact;
  if (p->limit && (size_t)p->reserved + seg > p->limit) seg = exact;
  if (p->limit && (size_t)p->reserved + seg > p->limit) {
    if (oom) { oom->hit_limit = 1; oom->rounded = seg; }
    return KT_ERR_OOM;
  }
  kt_segment *s = calloc(1, sizeof *s);
  kt_extent *e = extent_new();
  if (!s || !e) { free(s); free(e); return KT_ERR_HOST_OOM; }
  void *base = NULL;
  kt__nvtx_push(p, "kitsune:segment_reserve");
  kt_status st = p->be->reserve(p->be->ctx, p->device, seg, &base);
  if (st == KT_ERR_OOM && seg > exact) {
    seg = exact;
    st = p->be->reserve(p->be->ctx, p->device, seg, &base);
  }
  kt__nvtx_pop(p);
  if (st != KT_OK || !base) {
    free(s); free(e);
    if (oom) oom->rounded = seg;
    return st == KT_OK ? KT_ERR_BACKEND : st;
  }
  if (((uintptr_t)base & (KT_PAGE - 1)) || ((uintptr_t)base + seg) >> KT_VA_BITS) {
    p->be->release(p->be->ctx, p->device, base, seg);   /* a backend bug; never hand it out */
    free(s); free(e);
    return KT_ERR_BACKEND;
  }
  s->base = (uintptr_t)base; s->size = seg; s->first = e;
  s->next = p->segments; if (p->segments) p->segments->prev = s; p->segments = s;
  s->nvtx_heap = kt__nvtx_heap_register(p, s->base, seg);
  if (s->nvtx_heap && !p->nvtx_regions) {     /* a tool reads NVTX memory: register blocks too */
    p->nvtx_regions = 1;
    atomic_fetch_or(&p->hooks, KT_HOOK_NVTX);
  }
  e->addr = s->base; e->size = seg; e->seg = s; e->kind = KT_EXT_FREE;
  kt__bins_insert(&p->untagged, e);
  p->reserved += (int64_t)seg; p->reserved_total += (int64_t)seg;
  if (p->reserved > p->reserved_peak) p->reserved_peak = p->reserved;
  p->nsegments++; p->nsegments_total++;
  if (p->nsegments > p->nsegments_peak) p->nsegments_peak = p->nsegments;
  p->n_reserves++;
  *out = e;
  return KT_OK;
}

/* Bytes in segments whose extents are all free (what kt__arena_collect_idle takes). */
static size_t idle_bytes(kt_pool_t *p) {
  size_t n = 0;
  for (kt_segment *s = p->segments; s; s = s->next) {
    kt_extent *e = s->first;
    while (e && e->kind == KT_EXT_FREE) e = e->anext;
    if (!e) n += s->size;
  }
  return n;
}

kt_status kt__arena_take(kt_pool_t *p, kt_heap *tag, size_t size, size_t align, int kind,
                         kt_extent **out, kt_oom_info *oom) {
  kt_extent *e = tag ? best_fit(&tag->bins, size, align) : NULL;
  if (!e) e = best_fit(&p->untagged, size, align);
  if (!e && p->release_on_grow && idle_bytes(p) >= size) {
    /* Nothing fits but whole idle segments add up to the request: give them back
     * before reserving more (their cudaFree synchronizes). */
    kt_segment *idle = kt__arena_collect_idle(p);
    while (idle) {
      kt_segment *sg = idle;
      idle = sg->next;
      kt__segment_release(p, sg);
    }
  }
  if (!e) {
    kt_status st = grow(p, size, &e, oom);
    if (st != KT_OK) return st;
  }
  kt_status st = carve(p, e, size, align, out);
  /* marked in use before arena_lock is dropped: never mergeable while unlocked */
  if (st == KT_OK) { (*out)->tag = tag; (*out)->kind = (uint8_t)kind; }
  return st;
}

static bool mergeable(const kt_extent *a, const kt_extent *b) {
  return a->kind == KT_EXT_FREE && b->kind == KT_EXT_FREE && (a->tag == b->tag || !a->tag || !b->tag);
}

/* hi follows lo in address order; neither is in a bin. hi goes. */
static void merge_next(kt_extent *lo, kt_extent *hi) {
  if (!lo->tag) lo->tag = hi->tag;
  lo->size += hi->size;
  lo->anext = hi->anext;
  if (hi->anext) hi->anext->aprev = lo;
  free(hi);
}

void kt__arena_put(kt_pool_t *p, kt_extent *e, kt_heap *tag) {
  e->kind = KT_EXT_FREE; e->tag = tag; e->slab = NULL;
  kt_extent *a = e->aprev, *n = e->anext;
  if (a && mergeable(a, e)) {
    kt__bins_remove(kt__bins_for(p, a->tag), a);
    merge_next(a, e);
    e = a;
  }
  if (n && mergeable(e, n)) {
    kt__bins_remove(kt__bins_for(p, n->tag), n);
    merge_next(e, n);
  }
  kt__bins_insert(kt__bins_for(p, e->tag), e);
}

kt_segment *kt__arena_collect_idle(kt_pool_t *p) {
  kt_segment *idle = NULL, *next;
  for (kt_segment *s = p->segments; s; s = next) {
    next = s->next;
    /* idle = every extent free, whatever stream each is confined to */
    kt_extent *e = s->first;
    while (e && e->kind == KT_EXT_FREE) e = e->anext;
    if (e) continue;
    for (kt_extent *x = s->first, *xn; x; x = xn) {
      xn = x->anext;
      kt__bins_remove(kt__bins_for(p, x->tag), x);
      free(x);
    }
    s->first = NULL;
    if (s->prev) s->prev->next = s->next; else p->segments = s->next;
    if (s->next) s->next->prev = s->prev;
    p->reserved -= (int64_t)s->size; p->released_total += (int64_t)s->size;
    p->nsegments--;
    p->n_releases++;
    s->prev = NULL; s->next = idle; idle = s;
  }
  return idle;
}

void kt__segment_release(kt_pool_t *p, kt_segment *s) {
  kt__nvtx_heap_unregister(p, s->nvtx_heap);
  kt__nvtx_push(p, "kitsune:segment_release");
  p->be->release(p->be->ctx, p->device, (void *)s->base, s->size);
  kt__nvtx_pop(p);
  free(s);
}

static size_t largest_in(const kt_bins *b) {
  size_t best = 0;
  for (int i = KT_NUM_BINS - 1; i >= 0; i--) {
    if (!(b->bits[i >> 6] & ((uint64_t)1 << (i & 63)))) continue;
    for (kt_extent *e = b->head[i]; e; e = e->fnext) if (e->size > best) best = e->size;
    return best;
  }
  return 0;
}

size_t kt__arena_largest_free(kt_pool_t *p) {
  size_t best = largest_in(&p->untagged);
  for (kt_heap *h = p->heap_list; h; h = h->next) {
    size_t x = largest_in(&h->bins);
    if (x > best) best = x;
  }
  return best;
}

#define CHECK(c) do { if (!(c)) return KT_ERR_INVALID; } while (0)

static kt_status bins_validate(kt_pool_t *p, kt_bins *b, kt_heap *tag, size_t *count) {
  size_t n = 0;
  for (int i = 0; i < KT_NUM_BINS; i++) {
    bool bit = (b->bits[i >> 6] >> (i & 63)) & 1;
    CHECK(bit == (b->head[i] != NULL));
    for (kt_extent *e = b->head[i]; e; e = e->fnext) {
      CHECK(e->kind == KT_EXT_FREE && e->tag == tag && e->bin == i && kt__bin_of(e->size) == i);
      CHECK(!e->fnext || e->fnext->fprev == e);
      n++;
    }
  }
  (void)p;
  CHECK(n == b->count);
  *count += n;
  return KT_OK;
}

kt_status kt__arena_validate(kt_pool_t *p) {
  int64_t reserved = 0, nseg = 0;
  size_t nfree = 0, binned = 0;
  for (kt_segment *s = p->segments; s; s = s->next) {
    CHECK(!(s->base & (KT_PAGE - 1)) && s->size % KT_SEGMENT_ALIGN == 0);
    CHECK(!s->next || s->next->prev == s);
    uintptr_t at = s->base;
    for (kt_extent *e = s->first; e; e = e->anext) {
      CHECK(e->seg == s && e->addr == at && e->size > 0 && e->size % KT_QUANTUM == 0);
      CHECK(!e->anext || e->anext->aprev == e);
      if (e->kind == KT_EXT_FREE) {
        nfree++;
        CHECK(!e->anext || !mergeable(e, e->anext));
      } else if (e->kind == KT_EXT_SLAB) {
        CHECK(e->slab && e->slab->ext == e && e->slab->base == e->addr && !(e->addr & (KT_PAGE - 1)));
        CHECK(kt__radix_get(p, e->addr) == ((uintptr_t)e->slab | 1));
      } else {
        CHECK(e->kind == KT_EXT_LARGE && e->size > KT_LARGE_THRESHOLD);
        CHECK(e->blk.addr == e->addr && kt__block_size(&e->blk) == e->size);
        if (e->blk.state == KT_BLOCK_LIVE || e->blk.state == KT_BLOCK_PENDING)
          CHECK(kt__radix_get(p, e->addr) == (uintptr_t)e);
      }
      at += e->size;
    }
    CHECK(at == s->base + s->size);
    reserved += (int64_t)s->size; nseg++;
  }
  CHECK(reserved == p->reserved && nseg == p->nsegments);
  kt_status st = bins_validate(p, &p->untagged, NULL, &binned);
  for (kt_heap *h = p->heap_list; h && st == KT_OK; h = h->next) st = bins_validate(p, &h->bins, h, &binned);
  if (st != KT_OK) return st;
  CHECK(binned == nfree);
  return KT_OK;
}
