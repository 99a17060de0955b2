/* allocator/src/arena.c — best fit with split and coalesce over backend segments.
 *
 * Free extents sit in bins, 8 per power of two (bin_of is the floor of the size
 * class formula, extended to 2^48), with a bitmap of non-empty bins. A search for
 * s scans bin_of(s) for the smallest extent that fits, then the next non-empty
 * bins, whose extents are all larger than s. Each free extent carries a tag: the
 * stream whose work may still touch it (NULL for fresh memory). A search on
 * stream S looks at S's extents and untagged ones (find() says in which order); it
 * never takes another stream's. Neighbours coalesce when their tags agree or one is
 * untagged (the merged extent keeps the tag: confining fresh memory to S is always
 * safe). Where a VMM pool's arena would grow, other streams' free extents become
 * untagged once an event recorded on their stream has completed (reclaim_streams).
 *
 * A VMM pool (kt_pool_options.vmm) grows by reserving address space, not memory: a
 * range of twice the device's memory is one segment whose extents split and
 * coalesce like any other, and a granule (2 MiB) is mapped when an extent that
 * overlaps it is taken. Every granule a taken extent touches is mapped; a free
 * extent's may or may not be. The range has two halves, fenced: large blocks are
 * carved from the lower, slabs from the upper. Slabs stay until kt_empty_cache, so
 * among large blocks they would pin granules in the middle of free space; apart, the
 * churn of issue 45 (bench/churn_trace.py) held 1.21x its live peak instead of 1.30x.
 * Granules go back only on pressure: kt__arena_trim, called by kt_empty_cache, the
 * OOM retry, growth that would pass the memory limit and, with release_on_grow =
 * KT_RELEASE_FOLLOW_PEAK, growth past the highest mapped total so far. Unmapping at
 * that mark kept reserved within 1% of the live peak, but a workload whose live bytes
 * move around never settled: it synchronized and remapped on growth for ever (the churn
 * of issue 45 mapped 3.3 GiB and synchronized 242 times in its first pass of 20,000
 * allocations, 90 times in the second). Without it the mapped set grows until the
 * workload's layout fits, and then allocations make no backend call; the cost is
 * memory (docs/allocator.md, "When memory goes back to the device", has both sides).
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

static bool place_in_range(const kt_extent *e, size_t size, size_t align, uintptr_t *out);

/* A VMM range's slabs come from above its fence, large blocks from below it. */
static inline bool on_its_side(const kt_extent *e, int kind) {
  return !e->seg->fence || (kind == KT_EXT_SLAB) == (e->addr >= e->seg->fence);
}

/* Best fit for size in b. mapped: only extents where size goes without mapping a
 * granule (a VMM range's mapped run holds it; a segment's extent, wherever it fits).
 * Extents of a VMM range include their unmapped parts, so a fit by size alone can
 * pick a small, half-unmapped hole and map it while a mapped run elsewhere sits
 * free. That is the better trade while growth trims (KT_RELEASE_FOLLOW_PEAK: the
 * snug hole keeps fragmentation down, and growth past the high mark unmaps idle
 * granules first: on the H100, shape-varying training held 1.017x its live bytes
 * with the mapped search always first, 1.013x without,
 * bench/results/archive/h100_alloc_shapes_f0e05ef.log against alloc_shapes.json).
 * Otherwise the mapped search goes first: by default nothing trims, so a granule
 * mapped is memory kept, and while releases are held a map is a device allocation
 * inside a CUDA graph capture, whose pool relies on the range
 * kt_pool_prepare_capture made ready. */
static kt_extent *best_fit(kt_bins *b, size_t size, size_t align, int kind, bool mapped, uintptr_t *at) {
  if (!b->count) return NULL;
  for (int i = next_bin(b, kt__bin_of(size)); i >= 0; i = next_bin(b, i + 1)) {
    kt_extent *best = NULL;
    uintptr_t here = 0;
    for (kt_extent *e = b->head[i]; e; e = e->fnext)
      if (fits(e, size, align) && (!best || e->size < best->size || (e->size == best->size && e->addr < best->addr)) &&
          on_its_side(e, kind) && (!mapped || !e->seg->gmap || place_in_range(e, size, align, &here))) {
        best = e;
        if (mapped) *at = e->seg->gmap ? here : align_up(e->addr, align);
      }
    if (best) return best;
  }
  return NULL;
}

/* Extent descriptors are recycled through a short list: a large block on a VMM
 * range splits the range's free tail when taken and merges back when freed, and a
 * malloc+free pair was most of that path (140 against 48 ns an alloc+free of 64 MiB
 * on the host fake). */
#define KT_SPARE_EXTENTS 64

static kt_extent *extent_new(kt_pool_t *p) {   /* holds a cache-line-aligned kt_block */
  kt_extent *e = p->spare_extents;
  if (e) {
    p->spare_extents = e->anext;
    p->nspare_extents--;
  } else if (!(e = aligned_alloc(KT_CACHELINE, sizeof(kt_extent)))) {
    return NULL;
  }
  memset(e, 0, sizeof *e);
  return e;
}

static void extent_free(kt_pool_t *p, kt_extent *e) {
  if (p->nspare_extents >= KT_SPARE_EXTENTS) { free(e); return; }
  e->anext = p->spare_extents;
  p->spare_extents = e;
  p->nspare_extents++;
}

void kt__arena_free_spares(kt_pool_t *p) {
  for (kt_extent *e = p->spare_extents, *n; e; e = n) { n = e->anext; free(e); }
  p->spare_extents = NULL;
  p->nspare_extents = 0;
}

/* Split [e.addr, e.addr+at) off e as a new FREE extent before it, same tag. */
static kt_extent *split_front(kt_pool_t *p, kt_extent *e, size_t at) {
  kt_extent *f = extent_new(p);
  if (!f) return NULL;
  f->addr = e->addr; f->size = at; f->seg = e->seg; f->tag = e->tag; f->seq = e->seq; f->kind = KT_EXT_FREE;
  f->aprev = e->aprev; f->anext = e;
  if (e->aprev) e->aprev->anext = f; else e->seg->first = f;
  e->aprev = f;
  e->addr += at; e->size -= at;
  kt__bins_insert(kt__bins_for(p, f->tag), f);
  return f;
}

/* Split the tail beyond keep bytes off e as a new FREE extent, same tag. */
static kt_extent *split_back(kt_pool_t *p, kt_extent *e, size_t keep) {
  kt_extent *f = extent_new(p);
  if (!f) return NULL;
  f->addr = e->addr + keep; f->size = e->size - keep; f->seg = e->seg; f->tag = e->tag; f->seq = e->seq; f->kind = KT_EXT_FREE;
  f->anext = e->anext; f->aprev = e;
  if (e->anext) e->anext->aprev = f;
  e->anext = f;
  e->size = keep;
  kt__bins_insert(kt__bins_for(p, f->tag), f);
  return f;
}

/* Carve [start, +size) out of free extent e (start aligned, inside e); returns it unbinned. */
static kt_status carve(kt_pool_t *p, kt_extent *e, uintptr_t start, size_t size, kt_extent **out) {
  kt__bins_remove(kt__bins_for(p, e->tag), e);
  size_t front = start - e->addr;
  if (front && !split_front(p, e, front)) goto nomem;
  if (e->size > size && !split_back(p, e, size)) goto nomem;
  *out = e;
  return KT_OK;
nomem:
  kt__bins_insert(kt__bins_for(p, e->tag), e);
  return KT_ERR_HOST_OOM;
}

/* ---- VMM ranges ---------------------------------------------------------------- */
#define KT_GRANULE KT_SEGMENT_ALIGN

/* The first run of granules in state v (1 mapped, 0 not) within [from, end) of s:
 * [*r0, *r1), found with memchr (a range's tail is tens of thousands of unmapped
 * granules). false when there is none. */
static bool next_run(const kt_segment *s, size_t from, size_t end, uint8_t v, size_t *r0, size_t *r1) {
  if (from >= end) return false;
  const uint8_t *m = memchr(s->gmap + from, v, end - from);
  if (!m) return false;
  *r0 = (size_t)(m - s->gmap);
  const uint8_t *z = memchr(m, !v, end - *r0);
  *r1 = z ? (size_t)(z - s->gmap) : end;
  return true;
}

static void link_segment(kt_pool_t *p, kt_segment *s, kt_extent *e) {
  s->first = e;
  s->next = p->segments; if (p->segments) p->segments->prev = s; p->segments = s;
  s->nvtx_heap = kt__nvtx_heap_register(p, s->base, s->size);
  if (s->nvtx_heap && !p->nvtx_regions) {     /* a tool reads NVTX memory: register blocks too */
    p->nvtx_regions = 1;
    atomic_fetch_or(&p->hooks, KT_HOOK_NVTX);
  }
  e->addr = s->base; e->size = s->size; e->seg = s; e->kind = KT_EXT_FREE;
  kt__bins_insert(&p->untagged, e);
  p->nsegments++; p->nsegments_total++;
  if (p->nsegments > p->nsegments_peak) p->nsegments_peak = p->nsegments;
}

/* Address space for a VMM range: twice the device's memory (free space in it is
 * never short of room to coalesce), 64 GiB when the backend cannot say, twice the
 * request if that is more (each half of the range must hold it). Records the
 * device's memory, if known, in p->vmm_device. */
static size_t range_bytes(kt_pool_t *p, size_t size) {
  if (!p->vmm_range) {
    size_t free_b = 0, total = 0;
    if (p->be->mem_info && p->be->mem_info(p->be->ctx, p->device, &free_b, &total) == KT_OK && total)
      p->vmm_device = total;
    else
      total = (size_t)32 << 30;
    p->vmm_range = align_up(2 * total, 2 * KT_GRANULE);
  }
  size_t need = 2 * align_up(size, KT_GRANULE);
  return need > p->vmm_range ? need : p->vmm_range;
}

/* A new VMM range as two free extents, the halves on either side of its fence;
 * *out is the one kind is carved from. KT_ERR_UNAVAILABLE when the backend cannot
 * map, KT_ERR_OOM for a request larger than the device. */
static kt_status grow_range(kt_pool_t *p, size_t size, int kind, kt_extent **out) {
  size_t bytes = range_bytes(p, size);
  if (p->vmm_device && size > p->vmm_device) return KT_ERR_OOM;   /* no range for what cannot be mapped */
  kt_segment *s = calloc(1, sizeof *s);
  kt_extent *e = extent_new(p), *up = extent_new(p);
  uint8_t *gmap = calloc(bytes / KT_GRANULE, 1);
  if (!s || !e || !up || !gmap) {
    free(s); free(gmap);
    if (e) extent_free(p, e);
    if (up) extent_free(p, up);
    return KT_ERR_HOST_OOM;
  }
  void *base = NULL;
  kt_status st = p->be->va_reserve(p->be->ctx, p->device, bytes, &base);
  if (st == KT_OK && (!base || ((uintptr_t)base & (KT_GRANULE - 1)) || ((uintptr_t)base + bytes) >> KT_VA_BITS)) {
    p->be->va_release(p->be->ctx, p->device, base, bytes);   /* a backend bug; never hand it out */
    st = KT_ERR_BACKEND;
  }
  if (st != KT_OK) { free(s); free(gmap); extent_free(p, e); extent_free(p, up); return st; }
  s->base = (uintptr_t)base; s->size = bytes; s->gmap = gmap;
  link_segment(p, s, e);   /* e: the whole range, binned */
  kt__bins_remove(&p->untagged, e);
  s->fence = s->base + bytes / 2;
  e->size = bytes / 2;
  up->addr = s->fence; up->size = bytes / 2; up->seg = s; up->kind = KT_EXT_FREE;
  up->aprev = e; e->anext = up;
  kt__bins_insert(&p->untagged, e);
  kt__bins_insert(&p->untagged, up);
  *out = kind == KT_EXT_SLAB ? up : e;
  return KT_OK;
}

static void count_mapped(kt_pool_t *p, kt_segment *s, size_t first, size_t n, int mapped) {
  memset(s->gmap + first, mapped, n);
  size_t bytes = n * KT_GRANULE;
  if (mapped) {
    s->mapped += bytes;
    p->reserved += (int64_t)bytes; p->reserved_total += (int64_t)bytes;
    if (p->reserved > p->reserved_peak) p->reserved_peak = p->reserved;
    if (p->reserved > p->vmm_high) p->vmm_high = p->reserved;
    p->n_reserves++;
  } else {
    s->mapped -= bytes;
    p->reserved -= (int64_t)bytes; p->released_total += (int64_t)bytes;
    p->n_releases++;
  }
}

/* Granule indices [*g0, *g1) of s lying wholly inside [a, b). */
static bool inner_granules(const kt_segment *s, uintptr_t a, uintptr_t b, size_t *g0, size_t *g1) {
  *g0 = (align_up(a, KT_GRANULE) - s->base) / KT_GRANULE;
  *g1 = ((b & ~(uintptr_t)(KT_GRANULE - 1)) - s->base) / KT_GRANULE;
  return b - a >= KT_GRANULE && *g1 > *g0;
}

/* Visits, from the top of s down, each run of address-adjacent free extents as
 * [a, b); stops when fn returns false. */
static void free_runs_top_down(kt_segment *s, bool (*fn)(kt_pool_t *, kt_segment *, uintptr_t, uintptr_t, void *),
                               kt_pool_t *p, void *arg) {
  kt_extent *last = s->first;
  while (last && last->anext) last = last->anext;
  for (kt_extent *e = last; e;) {
    if (e->kind != KT_EXT_FREE) { e = e->aprev; continue; }
    uintptr_t b = e->addr + e->size;
    while (e->aprev && e->aprev->kind == KT_EXT_FREE) e = e->aprev;
    if (!fn(p, s, e->addr, b, arg)) return;
    e = e->aprev;
  }
}

typedef struct { size_t want, done; int pass; } trim_state;   /* pass 0 looks, 1 unmaps */

static bool trim_run(kt_pool_t *p, kt_segment *s, uintptr_t a, uintptr_t b, void *arg) {
  trim_state *t = arg;
  size_t g0, g1;
  if (!inner_granules(s, a, b, &g0, &g1)) return true;
  for (size_t k = g1; k > g0 && t->done < t->want;) {   /* runs of mapped granules, top down */
    if (!s->gmap[k - 1]) { k--; continue; }
    size_t hi = k;
    while (k > g0 && s->gmap[k - 1] && t->done + (hi - k) * KT_GRANULE < t->want) k--;
    if (t->pass == 1) {
      if (p->be->unmap(p->be->ctx, p->device, (void *)(s->base + k * KT_GRANULE), (hi - k) * KT_GRANULE) != KT_OK)
        return false;   /* a backend failure: what stays mapped stays counted */
      count_mapped(p, s, k, hi - k, 0);
    }
    t->done += (hi - k) * KT_GRANULE;
  }
  return t->done < t->want;
}

size_t kt__arena_trim(kt_pool_t *p, size_t want) {
  trim_state t = {KT_GRANULE, 0, 0};   /* pass 0: is there one idle granule to unmap? */
  for (kt_segment *s = p->segments; s && t.done < t.want; s = s->next)
    if (s->gmap && s->mapped) free_runs_top_down(s, trim_run, p, &t);
  if (!t.done) return 0;
  t.want = want;
  /* freed memory may still be in use by work enqueued before its free */
  kt__nvtx_push(p, "kitsune:unmap_idle");
  kt_status st = p->be->synchronize(p->be->ctx, p->device);
  t.done = 0; t.pass = 1;
  for (kt_segment *s = p->segments; st == KT_OK && s && t.done < t.want; s = s->next)
    if (s->gmap && s->mapped) free_runs_top_down(s, trim_run, p, &t);
  kt__nvtx_pop(p);
  p->n_trims++;
  return t.done;
}

/* Maps every granule that taken extent e touches. Growth past the limit (and, with
 * KT_RELEASE_FOLLOW_PEAK, past the highest mapped total so far) first unmaps idle
 * granules to make room. */
static kt_status back_extent(kt_pool_t *p, kt_extent *e, kt_oom_info *oom) {
  kt_segment *s = e->seg;
  size_t g0 = (e->addr - s->base) / KT_GRANULE;
  size_t g1 = (align_up(e->addr + e->size, KT_GRANULE) - s->base) / KT_GRANULE;
  if (!memchr(s->gmap + g0, 0, g1 - g0)) return KT_OK;   /* the common case: all mapped */
  size_t need = 0;
  for (size_t k = g0; k < g1; k++) need += s->gmap[k] ? 0 : KT_GRANULE;
  if (p->vmm_device && need > p->vmm_device) {   /* more than the device has: no granule-by-granule failure */
    if (oom) oom->rounded = need;
    return KT_ERR_OOM;
  }
  bool held = atomic_load(&p->hold_releases) > 0;   /* no synchronization: grow, or fail at the limit */
  int64_t room = INT64_MAX;   /* mapping more than this first unmaps idle granules */
  if (p->release_on_grow >= KT_RELEASE_FOLLOW_PEAK) room = p->vmm_high - p->reserved;
  if (p->limit && (int64_t)p->limit - p->reserved < room) room = (int64_t)p->limit - p->reserved;
  if ((int64_t)need > room && !held) kt__arena_trim(p, (size_t)((int64_t)need - room));
  if (p->limit && (size_t)p->reserved + need > p->limit) {
    if (oom) { oom->hit_limit = 1; oom->rounded = need; }
    return KT_ERR_OOM;
  }
  kt__nvtx_push(p, "kitsune:map");
  kt_status st = KT_OK;
  for (size_t k = g0, r0, r1; st == KT_OK && next_run(s, k, g1, 0, &r0, &r1); k = r1) {
    st = p->be->map(p->be->ctx, p->device, (void *)(s->base + r0 * KT_GRANULE), (r1 - r0) * KT_GRANULE);
    if (st == KT_OK) count_mapped(p, s, r0, r1 - r0, 1);   /* kept on a later failure: idle, trimmable */
  }
  kt__nvtx_pop(p);
  if (st != KT_OK && oom) oom->rounded = need;
  return st;
}

/* Where in free extent e of a VMM range a block of size goes: at the start of the
 * first run of mapped granules that holds it (returns true), else where it overlaps
 * the longest run, else at e's start (an aligned start always exists: e fits). */
static bool place_in_range(const kt_extent *e, size_t size, size_t align, uintptr_t *out) {
  const kt_segment *s = e->seg;
  uintptr_t lo = e->addr, hi = e->addr + e->size;
  uintptr_t last = (hi - size) & ~(uintptr_t)(align - 1);   /* the highest aligned start */
  size_t g = (lo - s->base) / KT_GRANULE, gend = (hi - 1 - s->base) / KT_GRANULE + 1;
  uintptr_t best = align_up(lo, align);
  size_t best_len = 0;
  for (size_t r0, r1; next_run(s, g, gend, 1, &r0, &r1); g = r1) {
    uintptr_t a = s->base + r0 * KT_GRANULE, b = s->base + r1 * KT_GRANULE;
    if (a < lo) a = lo;
    if (b > hi) b = hi;
    uintptr_t at = align_up(a, align);
    if (at + size <= b) { *out = at; return true; }
    if (b - a > best_len) { best_len = b - a; best = at < last ? at : last; }
  }
  *out = best;
  return false;
}

/* Largest run of mapped granules wholly inside [a, b): what a free extent of a VMM
 * range can give without mapping. */
static size_t mapped_within(const kt_segment *s, uintptr_t a, uintptr_t b) {
  size_t g0, g1, best = 0;
  if (!inner_granules(s, a, b, &g0, &g1)) return 0;
  for (size_t k = g0, r0, r1; next_run(s, k, g1, 1, &r0, &r1); k = r1)
    if ((r1 - r0) * KT_GRANULE > best) best = (r1 - r0) * KT_GRANULE;
  return best;
}

/* Growth: a request under half the pool's shared segment (kt_pool_options, 20 MiB by
 * default) gets one that later requests carve too (one backend call: a cudaMalloc pair
 * takes 68-77 us on the H100 host, bench/results/alloc_bench_cuda.json, serves many); a
 * larger one gets its size rounded to 2 MiB. When the larger segment is refused (limit
 * or device), the rounded size is tried. */

static kt_status grow(kt_pool_t *p, size_t size, kt_extent **out, kt_oom_info *oom) {
  size_t exact = align_up(size, KT_SEGMENT_ALIGN);
  size_t seg = size < p->shared_segment / 2 ? p->shared_segment : exact;
  if (p->limit && (size_t)p->reserved + seg > p->limit) seg = exact;
  if (p->limit && (size_t)p->reserved + seg > p->limit) {
    if (oom) { oom->hit_limit = 1; oom->rounded = seg; }
    return KT_ERR_OOM;
  }
  kt_segment *s = calloc(1, sizeof *s);
  kt_extent *e = extent_new(p);
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
  s->base = (uintptr_t)base; s->size = seg;
  link_segment(p, s, e);
  p->reserved += (int64_t)seg; p->reserved_total += (int64_t)seg;
  if (p->reserved > p->reserved_peak) p->reserved_peak = p->reserved;
  p->n_reserves++;
  *out = e;
  return KT_OK;
}

/* Bytes in segments whose extents are all free (what kt__arena_collect_idle takes). */
static size_t idle_bytes(kt_pool_t *p) {
  size_t n = 0;
  for (kt_segment *s = p->segments; s; s = s->next) {
    if (s->gmap) continue;
    kt_extent *e = s->first;
    while (e && e->kind == KT_EXT_FREE) e = e->anext;
    if (!e) n += s->size;
  }
  return n;
}

static bool mergeable(const kt_extent *a, const kt_extent *b);
static void merge_next(kt_pool_t *p, kt_extent *lo, kt_extent *hi);
static kt_extent *coalesce_and_bin(kt_pool_t *p, kt_extent *e);

/* The better of two fits: the smaller extent, then the lower address; its start in *at. */
static kt_extent *better(kt_extent *a, uintptr_t at_a, kt_extent *b, uintptr_t at_b, uintptr_t *at) {
  if (!b || (a && !(b->size < a->size || (b->size == a->size && b->addr < a->addr)))) { *at = at_a; return a; }
  *at = at_b;
  return b;
}

/* The free extent a request on stream tag goes to, or NULL. In a VMM range, best fit
 * over tag's extents and the untagged ones together: untagged space there is the
 * range's unmapped tail or memory other streams freed (reclaim_streams), and best
 * fit ranks both right. Among segments, tag's extents first: untagged space there is
 * what fresh segments have not handed out yet, and taking freed holes before it keeps
 * segments whole (the churn of issue 45 held 1.60x its live peak this way, 1.83x with
 * one best fit over both). */
static kt_extent *find(kt_pool_t *p, kt_heap *tag, size_t size, size_t align, int kind, bool held, bool *grows,
                         uintptr_t *at) {
  kt_extent *e = NULL;
  uintptr_t a1 = 0, a2 = 0;
  if (p->vmm) {
    if (held || p->release_on_grow < KT_RELEASE_FOLLOW_PEAK) {   /* mapped room first (see best_fit) */
      kt_extent *t = tag ? best_fit(&tag->bins, size, align, kind, true, &a1) : NULL;
      kt_extent *u = best_fit(&p->untagged, size, align, kind, true, &a2);
      e = better(t, a1, u, a2, at);
      if (e) { *grows = false; return e; }   /* a mapped run (or a segment) holds it */
    }
    kt_extent *t = tag ? best_fit(&tag->bins, size, align, kind, false, &a1) : NULL;
    kt_extent *u = best_fit(&p->untagged, size, align, kind, false, &a2);
    e = better(t, 0, u, 0, at);
  } else {
    if (tag) e = best_fit(&tag->bins, size, align, kind, false, &a1);
    if (!e) e = best_fit(&p->untagged, size, align, kind, false, &a1);
  }
  if (!e) { *grows = true; return NULL; }
  *at = align_up(e->addr, align);
  *grows = e->seg->gmap && !place_in_range(e, size, align, at);
  return e;
}

/* Free extents of h freed before its reclaim event was recorded become untagged and
 * coalesce with their neighbours (a tagged neighbour's tag wins: confining memory to
 * a stream is always safe). */
static void untag_heap(kt_pool_t *p, kt_heap *h, uint64_t upto) {
  for (kt_segment *s = p->segments; s && h->bins.count; s = s->next)
    for (kt_extent *e = s->first; e; e = e->anext) {
      if (e->kind != KT_EXT_FREE || e->tag != h || e->seq > upto) continue;
      kt__bins_remove(&h->bins, e);
      e->tag = NULL;
      e = coalesce_and_bin(p, e);
    }
}

/* Nothing fits stream tag and the arena is about to grow: memory other streams freed
 * may serve instead, once their work is done. Each other heap holding free extents
 * gets an event recorded on its stream (no synchronization), queried at once (a stream
 * with no work queued is done) and at later growths: once it has completed, what that
 * heap had freed before the record becomes usable by every stream. Runs only where
 * the arena would otherwise grow, so a pool whose workload fits makes none of these
 * calls, and none while events are deferred (a capture). The requesting stream arms
 * no event for itself: its extents serve it already, and untagging them only changed
 * which ones later searches preferred (a random churn on one stream held 1.13x its
 * live peak so, 1.07x without). VMM pools only: among segments, memory moves between
 * streams as whole idle segments (release_on_grow), and untagging broke segments up
 * (the 8-thread stress test's pool grew from 1.24 GB to 1.7 GB). Returns true when
 * extents were untagged (search again). */
static bool reclaim_streams(kt_pool_t *p, kt_heap *tag) {
  if (atomic_load_explicit(&p->defer_events, memory_order_relaxed)) return false;
  bool any = false;
  for (int pass = 0; pass < 2; pass++)   /* a stream with no work queued completes its event at once */
    for (kt_heap *h = p->heap_list; h; h = h->next) {
      if (h->reclaim_ev) {
        int done = 0;
        if (p->be->event_query(p->be->ctx, p->device, h->reclaim_ev, &done) != KT_OK || !done) continue;
        size_t before = h->bins.count;
        untag_heap(p, h, h->reclaim_seq);
        any |= h->bins.count != before;
        kt__event_give(p, h->reclaim_ev);
        h->reclaim_ev = NULL;
      }
      if (pass || !h->bins.count || h == tag) continue;
      kt_event_t ev = NULL;
      if (kt__event_take(p, &ev) != KT_OK) continue;
      if (p->be->event_record(p->be->ctx, p->device, ev, h->stream) != KT_OK) { kt__event_give(p, ev); continue; }
      h->reclaim_ev = ev;
      h->reclaim_seq = p->put_seq;
    }
  return any;
}

kt_status kt__arena_take(kt_pool_t *p, kt_heap *tag, size_t size, size_t align, int kind,
                         kt_extent **out, kt_oom_info *oom, kt_segment **release) {
  bool held = atomic_load(&p->hold_releases) > 0;
  bool grows;   /* no free extent holds it, or (VMM) it would map granules */
  uintptr_t start = 0;
  kt_extent *e = find(p, tag, size, align, kind, held, &grows, &start);
  if (grows && p->vmm && reclaim_streams(p, tag))   /* extents merged (e may be gone): search again */
    e = find(p, tag, size, align, kind, held, &grows, &start);
  if (!e && release && p->release_on_grow && !held && idle_bytes(p) >= size) {
    /* Nothing fits but whole idle segments add up to the request: they go back
     * before the pool reserves more, released by the caller once arena_lock is
     * dropped (their cudaFree synchronizes). */
    *release = kt__arena_collect_idle(p);
    return KT__RELEASE_FIRST;
  }
  bool fresh = !e;
  if (!e && p->vmm) {   /* on failure a segment is tried, which fills the OOM info if it fails too */
    kt_status st = grow_range(p, size, kind, &e);
    if (st == KT_ERR_UNAVAILABLE) p->vmm = 0;   /* the device cannot map: segments from now on */
    if (st != KT_OK) e = NULL;
  }
  if (!e) {
    kt_status st = grow(p, size, &e, oom);
    if (st != KT_OK) return st;
  }
  if (fresh) start = align_up(e->addr, align);   /* a new range or segment: its start */
  kt_heap *was = e->tag;
  kt_status st = carve(p, e, start, size, out);
  if (st != KT_OK) return st;
  /* marked in use before arena_lock is dropped: never mergeable while unlocked */
  (*out)->tag = tag; (*out)->kind = (uint8_t)kind;
  if ((*out)->seg->gmap && (st = back_extent(p, *out, oom)) != KT_OK) kt__arena_put(p, *out, was);
  return st;
}

/* b follows a in address order. */
static bool mergeable(const kt_extent *a, const kt_extent *b) {
  return a->kind == KT_EXT_FREE && b->kind == KT_EXT_FREE && (a->tag == b->tag || !a->tag || !b->tag) &&
         b->addr != b->seg->fence;
}

/* hi follows lo in address order; neither is in a bin. hi goes. */
static void merge_next(kt_pool_t *p, kt_extent *lo, kt_extent *hi) {
  if (!lo->tag) lo->tag = hi->tag;
  if (hi->seq > lo->seq) lo->seq = hi->seq;
  lo->size += hi->size;
  lo->anext = hi->anext;
  if (hi->anext) hi->anext->aprev = lo;
  extent_free(p, hi);
}

/* e, free and in no bin, merged with the neighbours it may merge with and put in its
 * tag's bin; returns the extent that now holds it. */
static kt_extent *coalesce_and_bin(kt_pool_t *p, kt_extent *e) {
  kt_extent *a = e->aprev, *n = e->anext;
  if (a && mergeable(a, e)) {
    kt__bins_remove(kt__bins_for(p, a->tag), a);
    merge_next(p, a, e);
    e = a;
  }
  if (n && mergeable(e, n)) {
    kt__bins_remove(kt__bins_for(p, n->tag), n);
    merge_next(p, e, n);
  }
  kt__bins_insert(kt__bins_for(p, e->tag), e);
  return e;
}

void kt__arena_put(kt_pool_t *p, kt_extent *e, kt_heap *tag) {
  e->kind = KT_EXT_FREE; e->tag = tag; e->slab = NULL; e->seq = ++p->put_seq;
  coalesce_and_bin(p, e);
}

void kt__arena_untag_all(kt_pool_t *p) {
  for (kt_segment *s = p->segments; s; s = s->next) {
    for (kt_extent *e = s->first; e; e = e->anext)
      if (e->kind == KT_EXT_FREE) {
        kt__bins_remove(kt__bins_for(p, e->tag), e);
        e->tag = NULL;
      }
    for (kt_extent *e = s->first; e; e = e->anext) {   /* coalesce, then bin */
      if (e->kind != KT_EXT_FREE) continue;
      while (e->anext && e->anext->kind == KT_EXT_FREE && e->anext->addr != s->fence) merge_next(p, e, e->anext);
      kt__bins_insert(&p->untagged, e);
    }
  }
}

kt_segment *kt__arena_collect_idle(kt_pool_t *p) {
  kt_segment *idle = NULL, *next;
  for (kt_segment *s = p->segments; s; s = next) {
    next = s->next;
    if (s->gmap) continue;
    /* idle = every extent free, whatever stream each is confined to */
    kt_extent *e = s->first;
    while (e && e->kind == KT_EXT_FREE) e = e->anext;
    if (e) continue;
    for (kt_extent *x = s->first, *xn; x; x = xn) {
      xn = x->anext;
      kt__bins_remove(kt__bins_for(p, x->tag), x);
      extent_free(p, x);
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
  if (s->gmap) {   /* a VMM range (pool teardown): unmap what is mapped, then the range */
    if (s->mapped) p->be->synchronize(p->be->ctx, p->device);
    for (size_t k = 0, r0, r1; next_run(s, k, s->size / KT_GRANULE, 1, &r0, &r1); k = r1)
      p->be->unmap(p->be->ctx, p->device, (void *)(s->base + r0 * KT_GRANULE), (r1 - r0) * KT_GRANULE);
    p->be->va_release(p->be->ctx, p->device, (void *)s->base, s->size);
    free(s->gmap);
  } else {
    p->be->release(p->be->ctx, p->device, (void *)s->base, s->size);
  }
  kt__nvtx_pop(p);
  free(s);
}

/* A VMM range's free extents count only their mapped granules, so every bin may
 * need a look; a plain segment's largest extent is in the highest non-empty bin.
 * Free space above a range's fence serves slabs only and is not counted. */
static size_t largest_in(const kt_bins *b) {
  size_t best = 0;
  for (int i = KT_NUM_BINS - 1; i >= 0; i--) {
    if (!(b->bits[i >> 6] & ((uint64_t)1 << (i & 63)))) continue;
    bool plain = false;
    for (kt_extent *e = b->head[i]; e; e = e->fnext) {
      if (!on_its_side(e, KT_EXT_LARGE)) continue;
      size_t n = e->seg->gmap ? mapped_within(e->seg, e->addr, e->addr + e->size) : e->size;
      plain |= !e->seg->gmap;
      if (n > best) best = n;
    }
    if (plain) return best;   /* lower bins hold smaller extents */
  }
  return best;
}

size_t kt__arena_largest_untagged(kt_pool_t *p) { return largest_in(&p->untagged); }

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
    if (s->gmap) {   /* mapped bytes agree with the granule map */
      size_t n = 0;
      for (size_t k = 0; k < s->size / KT_GRANULE; k++) n += s->gmap[k];
      CHECK(n * KT_GRANULE == s->mapped);
    }
    CHECK(!s->fence || (s->gmap && s->fence == s->base + s->size / 2));
    uintptr_t at = s->base;
    for (kt_extent *e = s->first; e; e = e->anext) {
      CHECK(e->seg == s && e->addr == at && e->size > 0 && e->size % KT_QUANTUM == 0);
      CHECK(!s->fence || e->addr >= s->fence || e->addr + e->size <= s->fence);   /* no extent spans the fence */
      CHECK(e->kind == KT_EXT_FREE || on_its_side(e, e->kind));
      CHECK(!e->anext || e->anext->aprev == e);
      if (s->gmap && e->kind != KT_EXT_FREE)   /* what is handed out is mapped */
        for (uintptr_t g = e->addr & ~(uintptr_t)(KT_GRANULE - 1); g < e->addr + e->size; g += KT_GRANULE)
          CHECK(s->gmap[(g - s->base) / KT_GRANULE]);
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
    reserved += (int64_t)(s->gmap ? s->mapped : s->size); nseg++;
  }
  CHECK(reserved == p->reserved && nseg == p->nsegments);
  kt_status st = bins_validate(p, &p->untagged, NULL, &binned);
  for (kt_heap *h = p->heap_list; h && st == KT_OK; h = h->next) st = bins_validate(p, &h->bins, h, &binned);
  if (st != KT_OK) return st;
  CHECK(binned == nfree);
  return KT_OK;
}

/* ---- memory map (kt_pool_walk) ------------------------------------------------------- */
typedef struct walk {
  kt_walk_fn fn;
  void *ctx;
  kt_walk_segment seg;
  uintptr_t lo, hi;   /* the segment's bounds: pieces are clipped to them */
} walk;

static int walk_piece(walk *w, uintptr_t a, uintptr_t b, size_t requested, kt_stream_t stream, int state) {
  if (a < w->lo) a = w->lo;
  if (b > w->hi) b = w->hi;
  if (a >= b) return 0;
  kt_walk_block blk = {a, b - a, state == KT_WALK_FREE ? 0 : requested, state == KT_WALK_FREE ? NULL : stream, state};
  return w->fn(w->ctx, &w->seg, &blk);
}

static int walk_state(const kt_block *b) {   /* relaxed: a tcache may change it meanwhile */
  switch (__atomic_load_n(&b->state, __ATOMIC_RELAXED)) {
    case KT_BLOCK_LIVE: return KT_WALK_LIVE;
    case KT_BLOCK_PENDING: return KT_WALK_PENDING;
    default: return KT_WALK_FREE;
  }
}

/* e's blocks within the walk's segment, gaps (a slab's tail) as free space. */
static int walk_extent(walk *w, const kt_extent *e) {
  const uintptr_t end = e->addr + e->size;
  if (e->kind == KT_EXT_FREE) return walk_piece(w, e->addr, end, 0, NULL, KT_WALK_FREE);
  if (e->kind == KT_EXT_LARGE)
    return walk_piece(w, e->addr, end, e->blk.requested, e->blk.heap ? e->blk.heap->stream : NULL,
                      walk_state(&e->blk));
  const kt_slab *s = e->slab;
  const size_t cs = kt__geom[s->cls].size;
  uintptr_t at = e->addr;
  int r = 0;
  for (uint32_t i = 0; i < s->nblocks && !r; i++) {
    const kt_block *b = &s->blocks[i];
    if (b->addr > at) r = walk_piece(w, at, b->addr, 0, NULL, KT_WALK_FREE);
    if (!r) r = walk_piece(w, b->addr, b->addr + cs, b->requested, b->heap ? b->heap->stream : NULL, walk_state(b));
    at = b->addr + cs;
  }
  return r ? r : walk_piece(w, at, end, 0, NULL, KT_WALK_FREE);
}

/* The segment [lo, hi) of s: its start, then every extent that overlaps it. */
static int walk_segment(walk *w, const kt_segment *s, uintptr_t lo, uintptr_t hi) {
  w->seg = (kt_walk_segment){lo, hi - lo, s->gmap != NULL};
  w->lo = lo, w->hi = hi;
  int r = w->fn(w->ctx, &w->seg, NULL);
  for (const kt_extent *e = s->first; e && !r; e = e->anext)
    if (e->addr < hi && e->addr + e->size > lo) r = walk_extent(w, e);
  return r;
}

kt_status kt_pool_walk(kt_pool_t *p, kt_walk_fn fn, void *ctx) {
  if (!p || !fn) return KT_ERR_INVALID;
  walk w = {fn, ctx, {0, 0, 0}, 0, 0};
  int r = 0;
  pthread_mutex_lock(&p->heap_lock);
  pthread_mutex_lock(&p->arena_lock);
  for (const kt_segment *s = p->segments; s && !r; s = s->next) {
    if (!s->gmap) {
      r = walk_segment(&w, s, s->base, s->base + s->size);
      continue;
    }
    const size_t n = s->size / KT_GRANULE;   /* a VMM range: each run of mapped granules */
    size_t r0, r1, from = 0;
    while (!r && next_run(s, from, n, 1, &r0, &r1)) {
      r = walk_segment(&w, s, s->base + r0 * KT_GRANULE, s->base + r1 * KT_GRANULE);
      from = r1;
    }
  }
  pthread_mutex_unlock(&p->arena_lock);
  pthread_mutex_unlock(&p->heap_lock);
  return r ? KT_ERR_INVALID : KT_OK;
}
