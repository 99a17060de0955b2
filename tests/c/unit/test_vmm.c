/* Unit: VMM pools (kt_pool_options.vmm) on the fake backend: granules mapped on
 * demand, slabs and large blocks on either side of the range's fence, free space
 * coalescing across growth, idle granules unmapped (after a synchronization) only on
 * pressure (limit, refused map, empty_cache) or, with KT_RELEASE_FOLLOW_PEAK, before
 * the mapped total passes its high mark, streams, teardown, and the fallback to
 * segments without VMM entries. */
#include "common.h"
#include "internal.h"

static kt_backend *vbe;
static kt_pool_t *vp;

static kt_pool_t *vmm_pool(kt_backend *b, size_t limit, int release_on_grow) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = 1;
  o.memory_limit = limit;
  o.release_on_grow = release_on_grow;
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, b, &p), KT_OK);
  return p;
}

static void setup(void) { vbe = kt_fake_backend_create(0); vp = vmm_pool(vbe, 0, 1); }
static void teardown(void) {
  if (vp) kt_pool_destroy(vp);
  cr_assert_eq(kt_fake_unsynced_unmaps(vbe), 0, "a granule was unmapped with no synchronization since its use");
  kt_fake_backend_destroy(vbe);
}
TestSuite(vmm, .init = setup, .fini = teardown);

static kt_fake_counts counts(void) {
  kt_fake_counts c;
  kt_fake_get_counts(vbe, &c);
  return c;
}

/* The pool's reserved bytes are the fake's mapped bytes; the pool validates. */
static void check(kt_pool_t *p) {
  cr_assert_eq(kt_pool_validate(p), KT_OK);
  cr_assert_eq((size_t)p->reserved, counts().mapped_bytes);
  assert_stats_identities(p);
}

Test(vmm, granules_are_mapped_as_blocks_need_them) {
  void *a;
  cr_assert_eq(kt_alloc(vp, 11 * MiB, NULL, &a), KT_OK);
  kt_fake_counts c = counts();
  cr_assert_eq(c.va_reserves, 1);
  cr_assert_eq(c.reserves, 0, "no segment: address space and granules only");
  cr_assert_eq(c.va_bytes, 2 * ((size_t)80 << 30), "twice the (fake) device's memory");
  cr_assert_eq(c.mapped_bytes, 12 * MiB, "11 MiB touches six 2 MiB granules");
  cr_assert(kt_fake_owns(vbe, a, 11 * MiB));
  cr_assert_eq(vp->nsegments, 1);
  uintptr_t fence = vp->segments->fence;
  cr_assert_eq(fence, vp->segments->base + vp->segments->size / 2);
  cr_assert_lt((uintptr_t)a, fence, "large blocks below the fence");
  void *s;   /* a small block: its slab comes from above the fence, in a granule of its own */
  cr_assert_eq(kt_alloc(vp, 1000, NULL, &s), KT_OK);
  cr_assert(kt_fake_owns(vbe, s, 1000));
  cr_assert_eq((uintptr_t)s, fence);
  cr_assert_eq(counts().mapped_bytes, 14 * MiB);
  check(vp);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(vp, s, 0, NULL), KT_OK);
  check(vp);
}

Test(vmm, free_space_coalesces_across_what_were_separate_growths) {
  void *b[3], *big;
  for (int i = 0; i < 3; i++) cr_assert_eq(kt_alloc(vp, 11 * MiB, NULL, &b[i]), KT_OK);
  cr_assert_eq(counts().mapped_bytes, 34 * MiB);
  for (int i = 0; i < 3; i++) cr_assert_eq(kt_free(vp, b[i], 0, NULL), KT_OK);
  uint64_t maps = counts().maps;
  /* segments would hold three 12 MiB pieces and need a fourth segment here */
  cr_assert_eq(kt_alloc(vp, 33 * MiB, NULL, &big), KT_OK);
  cr_assert_eq(big, b[0]);
  cr_assert_eq(counts().maps, maps, "the freed granules serve it without mapping");
  cr_assert_eq(vp->reserved, (int64_t)(34 * MiB));
  check(vp);
}

/* By default growth maps more and unmaps nothing: no synchronization, and the
 * mapped granules stay for the next allocations. */
Test(vmm, growth_maps_more_and_unmaps_nothing_by_default) {
  void *a, *b, *c, *d;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);          /* a 20 MiB hole, mapped */
  kt_fake_counts k0 = counts();
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &c), KT_OK);  /* fits no hole: lands above b */
  kt_fake_counts k1 = counts();
  cr_assert_eq(k1.syncs, k0.syncs, "no synchronization");
  cr_assert_eq(k1.unmaps, k0.unmaps, "nothing unmapped");
  cr_assert_eq(vp->reserved, (int64_t)(70 * MiB));
  cr_assert(kt_fake_owns(vbe, a, 20 * MiB), "a's granules stay mapped");
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &d), KT_OK);  /* and serve the next 20 MiB */
  cr_assert_eq(d, a);
  kt_fake_counts k2 = counts();
  cr_assert(k2.maps == k1.maps && k2.syncs == k1.syncs && k2.unmaps == k1.unmaps);
  check(vp);
  cr_assert_eq(kt_free(vp, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(vp, c, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(vp, d, 0, NULL), KT_OK);
  cr_assert_eq(counts().unmaps, k0.unmaps, "frees unmap nothing");
  cr_assert_eq(kt_empty_cache(vp), KT_OK);
  cr_assert_eq(counts().mapped_bytes, 0);
  check(vp);
}

Test(vmm, following_the_peak_growth_past_the_high_mark_unmaps_idle_granules_first) {
  kt_pool_destroy(vp);
  vp = vmm_pool(vbe, 0, KT_RELEASE_FOLLOW_PEAK);
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);          /* a 20 MiB hole, mapped */
  uint64_t syncs = counts().syncs;
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &c), KT_OK);  /* fits no hole: lands above b */
  kt_fake_counts k = counts();
  cr_assert_eq(k.syncs, syncs + 1, "one synchronization before unmapping");
  cr_assert(!kt_fake_owns(vbe, a, 20 * MiB), "a's granules went back");
  cr_assert(kt_fake_owns(vbe, b, 20 * MiB) && kt_fake_owns(vbe, c, 30 * MiB));
  cr_assert_eq(vp->reserved, (int64_t)(50 * MiB), "b + c, not 70 MiB");
  kt_stats st;
  kt_get_stats(vp, &st);
  cr_assert_eq(st.reserved_bytes.peak, 50 * MiB);
  check(vp);
  /* under the high mark nothing is unmapped: a 20 MiB block maps the hole again */
  cr_assert_eq(kt_free(vp, b, 0, NULL), KT_OK);
  syncs = counts().syncs;
  cr_assert_eq(kt_alloc(vp, 10 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(counts().syncs, syncs);
  check(vp);
}

Test(vmm, keep_mode_never_unmaps_until_empty_cache) {
  kt_pool_destroy(vp);
  vp = vmm_pool(vbe, 0, 0);
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &c), KT_OK);
  cr_assert_eq(vp->reserved, (int64_t)(70 * MiB));
  cr_assert_eq(counts().unmaps, 0);
  cr_assert_eq(kt_free(vp, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(vp, c, 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(vp), KT_OK);
  cr_assert_eq(vp->reserved, 0);
  kt_fake_counts k = counts();
  cr_assert_eq(k.mapped_bytes, 0);
  cr_assert_eq(k.va_reserves - k.va_releases, 1, "the address range stays for later growth");
  check(vp);
}

Test(vmm, the_limit_counts_mapped_bytes_and_idle_granules_make_room) {
  kt_pool_destroy(vp);
  vp = vmm_pool(vbe, 50 * MiB, 1);
  void *a, *b, *c, *d;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &c), KT_OK);   /* 20 + 30 = the limit */
  cr_assert_eq(kt_alloc(vp, 4 * MiB, NULL, &d), KT_ERR_OOM);
  const kt_oom_info *oi = kt_last_oom();
  cr_assert_eq(oi->hit_limit, 1);
  cr_assert_eq(oi->limit, 50 * MiB);
  cr_assert_eq(oi->reserved, 50 * MiB);
  check(vp);
  cr_assert_eq(kt_free(vp, c, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(vp, 4 * MiB, NULL, &d), KT_OK);
  check(vp);
}

Test(vmm, a_refused_map_is_retried_once_then_reported_and_nothing_leaks) {
  void *a, *b;
  cr_assert_eq(kt_alloc(vp, 8 * MiB, NULL, &a), KT_OK);
  kt_fake_fail_next_reserves(vbe, 1);
  cr_assert_eq(kt_alloc(vp, 16 * MiB, NULL, &b), KT_OK, "the retry after releasing cache maps it");
  check(vp);
  cr_assert_eq(kt_free(vp, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(vp), KT_OK);
  int64_t before = vp->reserved;
  kt_fake_fail_next_reserves(vbe, 2);
  cr_assert_eq(kt_alloc(vp, 16 * MiB, NULL, &b), KT_ERR_OOM);
  cr_assert_eq(kt_last_oom()->hit_limit, 0);
  cr_assert_eq(vp->reserved, before);
  check(vp);
  cr_assert_eq(kt_alloc(vp, 16 * MiB, NULL, &b), KT_OK, "works again once the device has room");
  cr_assert(kt_fake_owns(vbe, b, 16 * MiB));
  check(vp);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
}

Test(vmm, following_the_peak_another_streams_idle_granules_go_back_before_growing) {
  kt_pool_destroy(vp);
  vp = vmm_pool(vbe, 0, KT_RELEASE_FOLLOW_PEAK);
  kt_stream_t s = (kt_stream_t)(uintptr_t)0x5040, t = (kt_stream_t)(uintptr_t)0x5080;
  void *a, *b;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, s, &a), KT_OK);
  kt_fake_hold_events(vbe, 1);                   /* s's work still runs */
  cr_assert_eq(kt_free(vp, a, 0, s), KT_OK);     /* free on s: confined to s */
  cr_assert_eq(kt_alloc(vp, 20 * MiB, t, &b), KT_OK);
  cr_assert_neq(a, b, "t never takes address space s's work may still touch");
  cr_assert_eq(vp->reserved, (int64_t)(20 * MiB), "but the memory behind it went back and came again");
  cr_assert(!kt_fake_owns(vbe, a, 20 * MiB));
  check(vp);
  kt_fake_hold_events(vbe, 0);
  cr_assert_eq(kt_free(vp, b, 0, t), KT_OK);
}

/* By default another stream's free memory is not unmapped: an event recorded on that
 * stream where the pool would map more lets it serve once the event completes. */
Test(vmm, another_streams_granules_serve_once_its_event_completes) {
  kt_stream_t s = (kt_stream_t)(uintptr_t)0x5040, t = (kt_stream_t)(uintptr_t)0x5080;
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, s, &a), KT_OK);
  kt_fake_hold_events(vbe, 1);                   /* s's work still runs */
  cr_assert_eq(kt_free(vp, a, 0, s), KT_OK);
  kt_fake_counts k0 = counts();
  cr_assert_eq(kt_alloc(vp, 20 * MiB, t, &b), KT_OK);
  kt_fake_counts k1 = counts();
  cr_assert_neq(a, b, "t never takes address space s's work may still touch");
  cr_assert(kt_fake_owns(vbe, a, 20 * MiB), "nor unmaps it");
  cr_assert_eq(k1.syncs, k0.syncs);
  cr_assert_eq(k1.unmaps, k0.unmaps);
  cr_assert_eq(k1.event_records, k0.event_records + 1, "an event on s instead");
  cr_assert_eq(vp->reserved, (int64_t)(40 * MiB));
  check(vp);
  kt_fake_complete_events(vbe);                  /* s's work is done */
  kt_fake_hold_events(vbe, 0);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, t, &c), KT_OK);
  cr_assert_eq(c, a, "s's freed granules serve t");
  kt_fake_counts k2 = counts();
  cr_assert_eq(k2.maps, k1.maps, "nothing mapped");
  cr_assert_eq(k2.syncs, k1.syncs);
  check(vp);
  cr_assert_eq(kt_free(vp, b, 0, t), KT_OK);
  cr_assert_eq(kt_free(vp, c, 0, t), KT_OK);
}

Test(vmm, largest_free_block_counts_mapped_granules_only) {
  void *a, *b;
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 2 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
  pthread_mutex_lock(&vp->arena_lock);
  size_t largest = kt__arena_largest_free(vp);
  pthread_mutex_unlock(&vp->arena_lock);
  cr_assert_eq(largest, 30 * MiB, "not the 160 GiB of address space above b");
  cr_assert_eq(kt_free(vp, b, 0, NULL), KT_OK);
}

Test(vmm, teardown_unmaps_live_blocks_and_releases_the_range) {
  void *a;
  cr_assert_eq(kt_alloc(vp, 40 * MiB, NULL, &a), KT_OK);
  kt_pool_destroy(vp);
  vp = NULL;
  kt_fake_counts k = counts();
  cr_assert_eq(k.mapped_bytes, 0);
  cr_assert_eq(k.va_bytes, 0);
  cr_assert_eq(k.va_reserves, k.va_releases);
}

Test(vmm, a_backend_without_vmm_entries_gets_segments) {
  kt_backend *nb = kt_fake_backend_create_novmm(0);
  kt_pool_t *q = vmm_pool(nb, 0, 1);
  void *a;
  cr_assert_eq(kt_alloc(q, 11 * MiB, NULL, &a), KT_OK);
  kt_fake_counts k;
  kt_fake_get_counts(nb, &k);
  cr_assert_eq(k.reserves, 1);
  cr_assert_eq(k.va_reserves, 0);
  cr_assert_eq(q->reserved, (int64_t)(12 * MiB));
  cr_assert_eq(kt_free(q, a, 0, NULL), KT_OK);
  kt_pool_destroy(q);
  kt_fake_backend_destroy(nb);
}

/* Random sizes on two streams, frees in random order: every live block is mapped,
 * the pool agrees with the backend, and the mapped peak stays near the live peak. */
Test(vmm, random_churn_keeps_blocks_mapped_and_the_peak_near_live) {
  enum { N = 64 };
  void *ptr[N] = {0};
  size_t sz[N] = {0};
  uint64_t seed = 42;
  int64_t live = 0, live_peak = 0;
  for (int it = 0; it < 4000; it++) {
    int i = (int)(test_rand(&seed) % N);
    kt_stream_t s = (test_rand(&seed) & 1) ? NULL : (kt_stream_t)(uintptr_t)0x5040;
    if (ptr[i]) {
      cr_assert_eq(kt_free(vp, ptr[i], 0, NULL), KT_OK);
      live -= (int64_t)sz[i];
      ptr[i] = NULL;
      continue;
    }
    sz[i] = (size_t)(1 + test_rand(&seed) % 48) * MiB + (test_rand(&seed) % 4096) * KT_QUANTUM;
    cr_assert_eq(kt_alloc(vp, sz[i], s, &ptr[i]), KT_OK);
    cr_assert(kt_fake_owns(vbe, ptr[i], sz[i]));
    live += (int64_t)sz[i];
    if (live > live_peak) live_peak = live;
    if (it % 500 == 0) check(vp);
  }
  check(vp);
  kt_stats st;
  kt_get_stats(vp, &st);
  /* each granule a block shares with free space, and each run of free extents, may
   * keep part of a granule: a few MiB a block */
  cr_assert_leq(st.reserved_bytes.peak, live_peak + (int64_t)(N * 4 * MiB),
                "peak mapped %lld against peak live %lld", (long long)st.reserved_bytes.peak, (long long)live_peak);
  for (int i = 0; i < N; i++) if (ptr[i]) cr_assert_eq(kt_free(vp, ptr[i], 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(vp), KT_OK);
  cr_assert_eq(counts().mapped_bytes, 0);
  check(vp);
}

Test(vmm, held_releases_grow_past_the_mark_without_synchronizing) {
  kt_pool_destroy(vp);
  vp = vmm_pool(vbe, 0, KT_RELEASE_FOLLOW_PEAK);
  void *a, *b, *c;
  cr_assert_eq(kt_pool_hold_releases(vp, 0), KT_ERR_INVALID, "not held");
  cr_assert_eq(kt_pool_hold_releases(vp, 1), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(vp, 20 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(vp, a, 0, NULL), KT_OK);
  uint64_t syncs = counts().syncs;
  cr_assert_eq(kt_alloc(vp, 30 * MiB, NULL, &c), KT_OK);
  cr_assert_eq(counts().syncs, syncs, "a capture elsewhere would not survive a synchronization");
  cr_assert_eq(vp->reserved, (int64_t)(70 * MiB));
  check(vp);
  cr_assert_eq(kt_pool_hold_releases(vp, 0), KT_OK);
  cr_assert_eq(kt_free(vp, c, 0, NULL), KT_OK);   /* 70 MiB mapped, b live: 50 idle */
  void *d;
  cr_assert_eq(kt_alloc(vp, 60 * MiB, NULL, &d), KT_OK);   /* fits no mapped run: needs the mark's room */
  cr_assert_eq(counts().syncs, syncs + 1);
  cr_assert_leq(vp->reserved, (int64_t)(82 * MiB), "b + d and at most a granule of each hole's edges");
  check(vp);
}

Test(vmm, blocks_waiting_for_other_streams_stay_mapped_through_an_unmap) {
  kt_stream_t s = (kt_stream_t)(uintptr_t)0x5040, t = (kt_stream_t)(uintptr_t)0x5080;
  void *a, *b;
  cr_assert_eq(kt_alloc(vp, 20 * MiB, s, &a), KT_OK);
  cr_assert_eq(kt_record_stream(vp, a, t), KT_OK);
  kt_fake_hold_events(vbe, 1);
  cr_assert_eq(kt_free(vp, a, 0, s), KT_OK);          /* pending: t's work may still use it */
  cr_assert_eq(kt_alloc(vp, 30 * MiB, s, &b), KT_OK);
  cr_assert(kt_fake_owns(vbe, a, 20 * MiB), "a pending block is never unmapped");
  cr_assert(kt_fake_owns(vbe, b, 30 * MiB));
  check(vp);
  kt_fake_complete_events(vbe);
  kt_fake_hold_events(vbe, 0);
  cr_assert_eq(kt_free(vp, b, 0, s), KT_OK);
  cr_assert_eq(kt_empty_cache(vp), KT_OK);
  cr_assert_eq(counts().mapped_bytes, 0, "once its event completed, a went back with the rest");
  check(vp);
}
