/* Unit: arena split/coalesce, free lists, slab bookkeeping, radix, stats identities. */
#include "common.h"
#include "internal.h"

FAKE_POOL_SUITE(arena);

static size_t free_extents(kt_pool_t *p) {
  size_t n = p->untagged.count;
  for (kt_heap *h = p->heap_list; h; h = h->next) n += h->bins.count;
  return n;
}

Test(arena, split_then_coalesce_back_to_one_extent) {
  void *a, *b, *c;
  size_t sz = 11 * MiB;   /* >= 10 MiB: each request grows its own 12 MiB segment */
  cr_assert_eq(kt_alloc(pool, sz, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, sz, NULL, &b), KT_OK);
  cr_assert_eq(kt_alloc(pool, sz, NULL, &c), KT_OK);
  cr_assert_eq(pool->nsegments, 3);
  cr_assert_eq(free_extents(pool), 3, "the 1 MiB tails stay free");
  cr_assert_eq(kt_free(pool, b, sz, NULL), KT_OK);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  /* b's extent merged with its own segment's tail: one free extent there */
  kt_segment *sb = NULL;
  for (kt_segment *s = pool->segments; s; s = s->next) if (s->base == (uintptr_t)b) sb = s;
  cr_assert_not_null(sb);
  cr_assert_eq(sb->first->kind, KT_EXT_FREE);
  cr_assert_eq(sb->first->size, 12 * MiB);
  cr_assert_null(sb->first->anext);
  cr_assert_eq(kt_free(pool, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, c, 0, NULL), KT_OK);
  cr_assert_eq(free_extents(pool), 3);   /* one per segment, fully coalesced */
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
}

Test(arena, small_requests_share_a_segment) {
  void *p[4];
  for (int i = 0; i < 4; i++) cr_assert_eq(kt_alloc(pool, 3 * MiB, NULL, &p[i]), KT_OK);
  cr_assert_eq(pool->nsegments, 1, "requests under 10 MiB carve one 20 MiB segment");
  cr_assert_eq(pool->reserved, (int64_t)(20 * MiB));
  kt_fake_counts fc;
  kt_fake_get_counts(be, &fc);
  cr_assert_eq(fc.reserves, 1);
  for (int i = 0; i < 4; i++) cr_assert_eq(kt_free(pool, p[i], 0, NULL), KT_OK);
  kt_fake_set_capacity(be, 20 * MiB + 4 * MiB);   /* 20 MiB more would not fit: falls back to 4 MiB */
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 19 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 3 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(pool->reserved, (int64_t)(24 * MiB));
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
}

Test(arena, best_fit_prefers_the_smallest_hole) {
  void *blk[6];
  /* one segment of 32 MiB carved into 6 pieces, then holes of 5, 3 and 4 MiB */
  void *big;
  cr_assert_eq(kt_alloc(pool, 32 * MiB, NULL, &big), KT_OK);
  cr_assert_eq(kt_free(pool, big, 0, NULL), KT_OK);
  size_t sizes[6] = {5 * MiB, 2 * MiB, 3 * MiB, 2 * MiB, 4 * MiB, 2 * MiB};
  for (int i = 0; i < 6; i++) cr_assert_eq(kt_alloc(pool, sizes[i], NULL, &blk[i]), KT_OK);
  for (int i = 1; i < 6; i++) cr_assert_eq((uintptr_t)blk[i], (uintptr_t)blk[i - 1] + sizes[i - 1]);
  cr_assert_eq(kt_free(pool, blk[0], 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, blk[2], 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, blk[4], 0, NULL), KT_OK);
  void *x;
  cr_assert_eq(kt_alloc(pool, 3 * MiB - 4096, NULL, &x), KT_OK);
  cr_assert_eq(x, blk[2], "best fit should take the 3 MiB hole");
  void *y;
  cr_assert_eq(kt_alloc(pool, 4 * MiB, NULL, &y), KT_OK);
  cr_assert_eq(y, blk[4]);
  cr_assert_eq(pool->nsegments, 1);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
}

Test(arena, streams_never_share_free_extents) {
  kt_pool_t *q = test_pool_keep(be);   /* released segments may come back anywhere: keep them */
  void *a, *b;
  kt_stream_t s1 = (kt_stream_t)0x100, s2 = (kt_stream_t)0x200;
  kt_fake_hold_events(be, 1);   /* s1's work is still running */
  cr_assert_eq(kt_alloc(q, 8 * MiB, s1, &a), KT_OK);
  cr_assert_eq(kt_free(q, a, 0, s1), KT_OK);
  cr_assert_eq(kt_alloc(q, 8 * MiB, s2, &b), KT_OK);
  cr_assert_neq(a, b, "a block freed on s1 went to s2");
  void *c;
  cr_assert_eq(kt_alloc(q, 8 * MiB, s1, &c), KT_OK);
  cr_assert_eq(a, c, "s1 should reuse its own freed block");
  kt_fake_complete_events(be);
  kt_fake_hold_events(be, 0);
  kt_pool_destroy(q);
}

/* Among segments, memory another stream freed comes back only as a whole idle
 * segment, released before growing (release_on_grow): no event makes it another
 * stream's in place (VMM pools do that: test_vmm.c). */
Test(arena, segments_move_memory_between_streams_as_whole_idle_segments) {
  kt_stream_t s1 = (kt_stream_t)0x100, s2 = (kt_stream_t)0x200;
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(pool, 12 * MiB, s1, &a), KT_OK);   /* its own 12 MiB segment */
  cr_assert_eq(kt_alloc(pool, 12 * MiB, s1, &b), KT_OK);
  cr_assert_eq(kt_free(pool, a, 0, s1), KT_OK);
  kt_fake_counts f0, f1;
  kt_fake_get_counts(be, &f0);
  cr_assert_eq(kt_alloc(pool, 12 * MiB, s2, &c), KT_OK);
  kt_fake_get_counts(be, &f1);
  cr_assert_eq(f1.event_records, f0.event_records, "no event");
  cr_assert_eq(f1.releases, f0.releases + 1, "a's idle segment went back");
  cr_assert_eq(f1.reserves, f0.reserves + 1, "and s2 got a fresh one");
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  cr_assert_eq(kt_free(pool, b, 0, s1), KT_OK);
  cr_assert_eq(kt_free(pool, c, 0, s2), KT_OK);
}

Test(arena, free_list_is_lifo_and_slab_counts_match) {
  void *p[4];
  for (int i = 0; i < 4; i++) cr_assert_eq(kt_alloc(pool, 1000, NULL, &p[i]), KT_OK);
  for (int i = 1; i < 4; i++) cr_assert_eq((uintptr_t)p[i], (uintptr_t)p[i - 1] + 1024, "slab order");
  kt_slab *s = (kt_slab *)(kt__radix_get(pool, (uintptr_t)p[0]) & ~(uintptr_t)1);
  cr_assert_eq(s->nblocks, 64);
  /* the thread cache took one batch (half its 32-block cap for 1 KiB) from the heap */
  cr_assert_eq(s->nfree, 64 - 16);
  cr_assert_eq(kt_free(pool, p[1], 1000, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, p[3], 1000, NULL), KT_OK);
  cr_assert_eq(s->nfree, 64 - 16, "frees stay in the thread cache");
  void *q;
  cr_assert_eq(kt_alloc(pool, 1024, NULL, &q), KT_OK);
  cr_assert_eq(q, p[3], "last freed is first reused");
  cr_assert_eq(kt_alloc(pool, 2000, NULL, &q), KT_OK);
  cr_assert_neq(kt__radix_get(pool, (uintptr_t)q), (uintptr_t)s | 1, "another class gets another slab");
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  /* overflow: freeing more than the cap sends half back to the heap */
  void *many[40];
  for (int i = 0; i < 40; i++) cr_assert_eq(kt_alloc(pool, 1024, NULL, &many[i]), KT_OK);
  for (int i = 0; i < 40; i++) cr_assert_eq(kt_free(pool, many[i], 0, NULL), KT_OK);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
}

Test(arena, radix_maps_slab_pages_and_large_starts_only) {
  void *small, *large;
  cr_assert_eq(kt_alloc(pool, 100 * KiB, NULL, &small), KT_OK);
  cr_assert_eq(kt_alloc(pool, 5 * MiB + 512, NULL, &large), KT_OK);
  uintptr_t e = kt__radix_get(pool, (uintptr_t)small);
  cr_assert(e & 1);
  kt_slab *s = (kt_slab *)(e & ~(uintptr_t)1);
  for (size_t off = 0; off < s->bytes; off += KT_PAGE) cr_assert_eq(kt__radix_get(pool, s->base + off), e);
  kt_extent *x = (kt_extent *)kt__radix_get(pool, (uintptr_t)large);
  cr_assert_eq(x->addr, (uintptr_t)large);
  cr_assert_eq(x->size, 5 * MiB + 512);
  cr_assert_eq(kt_free(pool, large, 0, NULL), KT_OK);
  cr_assert_eq(kt__radix_get(pool, (uintptr_t)large), 0);
  cr_assert_eq(kt_free(pool, large, 0, NULL), KT_ERR_INVALID, "double free of a large block");
  cr_assert_eq(kt_free(pool, small, 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  cr_assert_eq(kt__radix_get(pool, (uintptr_t)small), 0, "released slab pages unmapped");
  cr_assert_eq(pool->reserved, 0);
}

Test(arena, stats_identities_over_random_operations) {
  uint64_t seed = 42;
  void *live[512] = {0};
  size_t sz[512] = {0};
  int64_t expect = 0;
  for (int it = 0; it < 20000; it++) {
    int i = (int)(test_rand(&seed) % 512);
    kt_stream_t s = (kt_stream_t)(uintptr_t)(0x100 * (1 + test_rand(&seed) % 3));
    if (live[i]) {
      cr_assert_eq(kt_free(pool, live[i], sz[i], s), KT_OK);
      expect -= (int64_t)(sz[i] <= KT_LARGE_THRESHOLD ? kt_class_size(kt_size_class(sz[i])) : (sz[i] + 511) / 512 * 512);
      live[i] = NULL;
    } else {
      uint64_t r = test_rand(&seed);
      sz[i] = 1 + (r % 8 == 0 ? r % (6 * MiB) : r % (64 * KiB));
      cr_assert_eq(kt_alloc(pool, sz[i], s, &live[i]), KT_OK);
      expect += (int64_t)(sz[i] <= KT_LARGE_THRESHOLD ? kt_class_size(kt_size_class(sz[i])) : (sz[i] + 511) / 512 * 512);
    }
    if (it % 2000 == 0) {
      kt_stats st;
      kt_get_stats(pool, &st);
      cr_assert_eq(st.allocated_bytes.current, expect);
      assert_stats_identities(pool);
    }
  }
  kt_stats st;
  kt_get_stats(pool, &st);
  int64_t peak = st.allocated_bytes.peak;
  kt_reset_peak_stats(pool);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.peak, st.allocated_bytes.current);
  cr_assert_geq(peak, st.allocated_bytes.current);
  for (int i = 0; i < 512; i++) if (live[i]) cr_assert_eq(kt_free(pool, live[i], 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.current, 0);
  cr_assert_eq(st.reserved_bytes.current, 0);
  kt_fake_counts fc;
  kt_fake_get_counts(be, &fc);
  cr_assert_eq(fc.reserved_bytes, 0);
  cr_assert_eq(fc.reserves, fc.releases);
  assert_stats_identities(pool);
}

Test(arena, release_on_grow_gives_idle_segments_back_first) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  cr_assert_eq(o.release_on_grow, KT_RELEASE_FOLLOW_PEAK, "on by default (segments: as KT_RELEASE_SEGMENTS)");
  kt_pool_t *q;
  cr_assert_eq(kt_pool_create(&o, be, &q), KT_OK);
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(q, 12 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(q, 12 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(q, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(q, b, 0, NULL), KT_OK);     /* two idle 12 MiB segments */
  cr_assert_eq(kt_alloc(q, 20 * MiB, NULL, &c), KT_OK);   /* fits neither: they go first */
  kt_stats st;
  kt_get_stats(q, &st);
  cr_assert_eq(st.reserved_bytes.current, 20 * MiB);
  cr_assert_eq(st.num_backend_releases, 2);
  cr_assert_eq(kt_pool_validate(q), KT_OK);
  kt_pool_destroy(q);
  /* release_on_grow = 0: the idle segments stay cached */
  o.release_on_grow = 0;
  cr_assert_eq(kt_pool_create(&o, be, &q), KT_OK);
  cr_assert_eq(kt_alloc(q, 12 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(q, 12 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(q, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(q, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(q, 20 * MiB, NULL, &c), KT_OK);
  kt_get_stats(q, &st);
  cr_assert_eq(st.reserved_bytes.current, 44 * MiB);
  kt_pool_destroy(q);
}

Test(arena, held_releases_keep_idle_segments_and_skip_the_oom_retry) {
  /* a CUDA graph's private pool: a segment whose blocks were freed during the capture
   * is still used by the graph, so it must not be released */
  void *a, *b, *c;
  cr_assert_eq(kt_pool_hold_releases(pool, 1), KT_OK);
  cr_assert_eq(kt_alloc(pool, 12 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 12 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(pool, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, b, 0, NULL), KT_OK);     /* two idle 12 MiB segments */
  cr_assert_eq(kt_alloc(pool, 20 * MiB, NULL, &c), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.reserved_bytes.current, 44 * MiB, "nothing released while held");
  cr_assert_eq(st.num_backend_releases, 0);
  kt_fake_set_capacity(be, 44 * MiB);
  void *d;
  cr_assert_eq(kt_alloc(pool, 13 * MiB, NULL, &d), KT_ERR_OOM);   /* fits neither idle segment */
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_alloc_retries, 0, "no retry: it would release the idle segments");
  cr_assert_eq(st.num_ooms, 1);
  cr_assert_eq(st.num_backend_releases, 0);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  cr_assert_eq(kt_pool_hold_releases(pool, 0), KT_OK);
  cr_assert_eq(kt_alloc(pool, 13 * MiB, NULL, &d), KT_OK, "no longer held: the idle segments go first");
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_backend_releases, 2);
  cr_assert_eq(st.reserved_bytes.current, 34 * MiB);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
}
