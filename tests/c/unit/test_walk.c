/* Unit: kt_pool_walk, the memory map a snapshot is made from. Each segment is covered
 * exactly by its blocks in address order; every live allocation appears once, with its
 * requested size and stream; the sums agree with kt_get_stats (live rounded bytes =
 * allocated, live + pending = active, segments = reserved); a block freed while
 * another stream's work is pending shows as pending; a VMM pool shows its runs of
 * mapped granules; a callback that returns non-zero stops the walk. */
#include "common.h"

FAKE_POOL_SUITE(walk);

enum { MAXB = 4096, NALLOC = 300 };

typedef struct seen {
  kt_walk_segment seg[256];
  int nseg;
  kt_walk_block blk[MAXB];
  int nblk;
  uintptr_t next;   /* where the current segment's next block must begin */
  size_t live, pending, requested, reserved;
  int stop_after;   /* > 0: return 1 at that call */
  int calls;
} seen;

static int record(void *ctx, const kt_walk_segment *s, const kt_walk_block *b) {
  seen *w = ctx;
  if (w->stop_after && ++w->calls == w->stop_after) return 1;
  if (!b) {
    cr_assert(w->nseg == 0 || w->next == w->seg[w->nseg - 1].base + w->seg[w->nseg - 1].size,
              "the previous segment's blocks end at its end");
    cr_assert_lt(w->nseg, 256);
    cr_assert_gt(s->size, 0);
    w->seg[w->nseg++] = *s;
    w->next = s->base;
    w->reserved += s->size;
    return 0;
  }
  cr_assert_eq(b->addr, w->next, "blocks are contiguous: %#lx after %#lx", (unsigned long)b->addr,
               (unsigned long)w->next);
  cr_assert_gt(b->size, 0);
  cr_assert_leq(b->addr + b->size, s->base + s->size, "a block stays inside its segment");
  w->next = b->addr + b->size;
  if (b->state == KT_WALK_LIVE) w->live += b->size, w->requested += b->requested;
  if (b->state == KT_WALK_PENDING) w->pending += b->size;
  if (b->state == KT_WALK_FREE) cr_assert(b->requested == 0 && b->stream == NULL);
  else cr_assert_leq(b->requested, b->size);
  cr_assert_lt(w->nblk, MAXB);
  w->blk[w->nblk++] = *b;
  return 0;
}

static const kt_walk_block *find(const seen *w, void *p) {
  for (int i = 0; i < w->nblk; i++)
    if (w->blk[i].addr == (uintptr_t)p) return &w->blk[i];
  return NULL;
}

static void check_against_stats(kt_pool_t *p, const seen *w) {
  kt_stats st;
  cr_assert_eq(kt_get_stats(p, &st), KT_OK);
  cr_assert_eq(w->live, (size_t)st.allocated_bytes.current, "live %zu, allocated %lld", w->live,
               (long long)st.allocated_bytes.current);
  cr_assert_eq(w->live + w->pending, (size_t)st.active_bytes.current);
  cr_assert_eq(w->requested, (size_t)st.requested_bytes.current);
  cr_assert_eq(w->reserved, (size_t)st.reserved_bytes.current);
}

static void mixed(kt_pool_t *p) {
  static void *ptr[NALLOC];
  static size_t size[NALLOC];
  static kt_stream_t stream[NALLOC];
  static seen w;
  uint64_t seed = 7;
  for (int i = 0; i < NALLOC; i++) {   /* 1 B to 8 MiB, log-uniform, two streams */
    size[i] = (size_t)1 << (test_rand(&seed) % 24);
    size[i] += test_rand(&seed) % size[i];
    stream[i] = (i & 1) ? (kt_stream_t)(uintptr_t)0x5040 : NULL;
    cr_assert_eq(kt_alloc(p, size[i], stream[i], &ptr[i]), KT_OK);
  }
  for (int i = 0; i < NALLOC; i += 3) cr_assert_eq(kt_free(p, ptr[i], size[i], stream[i]), KT_OK);
  memset(&w, 0, sizeof w);
  cr_assert_eq(kt_pool_walk(p, record, &w), KT_OK);
  cr_assert_gt(w.nseg, 0);
  cr_assert_eq(w.next, w.seg[w.nseg - 1].base + w.seg[w.nseg - 1].size);
  for (int i = 0; i < NALLOC; i++) {
    const kt_walk_block *b = find(&w, ptr[i]);
    cr_assert_not_null(b, "allocation %d is in the map", i);
    if (i % 3 == 0) {
      cr_assert_eq(b->state, KT_WALK_FREE, "freed allocation %d", i);
    } else {
      cr_assert_eq(b->state, KT_WALK_LIVE);
      cr_assert_eq(b->requested, size[i]);
      cr_assert_eq(b->stream, stream[i]);
    }
  }
  check_against_stats(p, &w);
  for (int i = 1; i < NALLOC; i++)
    if (i % 3) cr_assert_eq(kt_free(p, ptr[i], size[i], stream[i]), KT_OK);
}

Test(walk, covers_every_segment_and_names_every_live_block) { mixed(pool); }

Test(walk, a_vmm_pool_shows_its_mapped_runs) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = 1;
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, be, &p), KT_OK);
  mixed(p);
  kt_stats st;
  cr_assert_eq(kt_get_stats(p, &st), KT_OK);
  static seen w;
  memset(&w, 0, sizeof w);
  cr_assert_eq(kt_pool_walk(p, record, &w), KT_OK);
  for (int i = 0; i < w.nseg; i++) cr_assert_eq(w.seg[i].vmm, st.vmm);
  check_against_stats(p, &w);
  kt_pool_destroy(p);
}

Test(walk, a_block_freed_with_other_streams_pending_shows_pending) {
  void *q;
  kt_stream_t other = (kt_stream_t)(uintptr_t)0x7070;
  cr_assert_eq(kt_alloc(pool, 3 << 20, NULL, &q), KT_OK);
  cr_assert_eq(kt_record_stream(pool, q, other), KT_OK);
  kt_fake_hold_events(be, 1);   /* the other stream's work stays pending */
  cr_assert_eq(kt_free(pool, q, 3 << 20, NULL), KT_OK);
  static seen w;
  memset(&w, 0, sizeof w);
  cr_assert_eq(kt_pool_walk(pool, record, &w), KT_OK);
  const kt_walk_block *b = find(&w, q);
  cr_assert_not_null(b);
  cr_assert_eq(b->state, KT_WALK_PENDING);
  cr_assert_eq(b->requested, (size_t)3 << 20);
  check_against_stats(pool, &w);
  kt_fake_complete_events(be);
  kt_fake_hold_events(be, 0);
}

Test(walk, a_callback_that_says_stop_stops_it) {
  void *q;
  cr_assert_eq(kt_alloc(pool, 1000, NULL, &q), KT_OK);
  static seen w;
  memset(&w, 0, sizeof w);
  w.stop_after = 2;
  cr_assert_eq(kt_pool_walk(pool, record, &w), KT_ERR_INVALID);
  cr_assert_eq(w.calls, 2);
  cr_assert_eq(kt_pool_walk(NULL, record, &w), KT_ERR_INVALID);
  cr_assert_eq(kt_pool_walk(pool, NULL, &w), KT_ERR_INVALID);
  cr_assert_eq(kt_free(pool, q, 1000, NULL), KT_OK);
}
