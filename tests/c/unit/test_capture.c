/* Unit: what a CUDA graph capture needs from the pools, on the fake backend.
 * A private pool on kt_pool_backend_create draws its segments from its parent;
 * kt_pool_prepare_capture makes the parent's free memory usable by any stream and
 * ready in one range, so a capture that fits maps, reserves and synchronizes
 * nothing; kt_free_idle returns memory for every stream at once. */
#include "common.h"
#include "internal.h"

static kt_backend *fb;
static kt_pool_t *parent;

static kt_pool_t *make_parent(int vmm, size_t limit) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = vmm;
  o.memory_limit = limit;
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, fb, &p), KT_OK);
  return p;
}

/* A graph's pool as the bridge makes it: on the parent, releases held for life. */
static kt_pool_t *make_child(kt_backend *sub) {
  kt_pool_t *c = NULL;
  cr_assert_eq(kt_pool_create(NULL, sub, &c), KT_OK);
  cr_assert_eq(kt_pool_hold_releases(c, 1), KT_OK);
  return c;
}

static void setup(void) { fb = kt_fake_backend_create(0); parent = make_parent(1, 0); }
static void teardown(void) {
  if (parent) kt_pool_destroy(parent);
  cr_assert_eq(kt_fake_unsynced_unmaps(fb), 0, "a granule was unmapped with no synchronization since its use");
  kt_fake_backend_destroy(fb);
}
TestSuite(capture, .init = setup, .fini = teardown);

static kt_fake_counts counts(void) {
  kt_fake_counts c;
  kt_fake_get_counts(fb, &c);
  return c;
}
static kt_stats stats(kt_pool_t *p) {
  kt_stats st;
  cr_assert_eq(kt_get_stats(p, &st), KT_OK);
  return st;
}

Test(capture, a_pool_on_the_parent_backend_takes_its_segments_from_the_parent) {
  kt_backend *sub = kt_pool_backend_create(parent);
  cr_assert_not_null(sub);
  kt_pool_t *child = make_child(sub);
  void *a, *s;
  cr_assert_eq(kt_alloc(child, 5 * MiB, test_stream(3), &a), KT_OK);
  cr_assert_eq(kt_alloc(child, 4000, test_stream(3), &s), KT_OK);
  kt_stats c = stats(child), p = stats(parent);
  cr_assert_eq(c.reserved_bytes.current, (int64_t)(20 * MiB), "one shared 20 MiB segment holds both");
  cr_assert_eq(p.allocated_bytes.current, c.reserved_bytes.current, "the child's segment is a parent block");
  cr_assert_eq(p.allocations.current, 1);
  cr_assert_eq(counts().reserves, 0, "the fake saw the parent's granules only");
  cr_assert(kt_fake_owns(fb, a, 5 * MiB) && kt_fake_owns(fb, s, 4000));
  cr_assert_eq(kt_free(child, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(child, s, 0, NULL), KT_OK);
  cr_assert_eq(stats(parent).allocated_bytes.current, (int64_t)(20 * MiB), "held: freed blocks stay the graph's");
  uint64_t syncs = counts().syncs;
  cr_assert_eq(kt_empty_cache(child), KT_OK);
  cr_assert_eq(stats(child).reserved_bytes.current, 0);
  cr_assert_eq(stats(parent).allocated_bytes.current, 0);
  cr_assert_geq(counts().syncs, syncs + 1, "released only after the device synchronized");
  /* it went back for every stream: another stream takes it without growing */
  uint64_t maps = counts().maps;
  void *b;
  cr_assert_eq(kt_alloc(parent, 20 * MiB, test_stream(5), &b), KT_OK);
  cr_assert_eq(counts().maps, maps);
  cr_assert_eq(kt_free(parent, b, 0, NULL), KT_OK);
  assert_stats_identities(parent);
  assert_stats_identities(child);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
}

/* The torch.cuda.graph sequence: warm up on a side stream, empty_cache, prepare,
 * capture. The capture fits in what prepare made ready: no map, no reserve, no
 * synchronization while it runs. */
Test(capture, a_capture_that_fits_the_prepared_range_maps_and_synchronizes_nothing) {
  kt_stream_t side = test_stream(1), cap = test_stream(2);
  uint64_t seed = 7;
  void *live[64];
  size_t sizes[64];
  for (int i = 0; i < 64; i++) {   /* warm-up: a step's worth of mixed blocks */
    sizes[i] = test_rand(&seed) % 2 ? 512 + test_rand(&seed) % (64 * KiB) : 2 * MiB + test_rand(&seed) % (6 * MiB);
    cr_assert_eq(kt_alloc(parent, sizes[i], side, &live[i]), KT_OK);
  }
  for (int i = 0; i < 64; i++) cr_assert_eq(kt_free(parent, live[i], 0, NULL), KT_OK);
  int64_t before = stats(parent).reserved_bytes.current;
  cr_assert_eq(kt_empty_cache(parent), KT_OK);
  size_t emptied = (size_t)(before - stats(parent).reserved_bytes.current);
  cr_assert_gt(emptied, 0);

  size_t ready = 0;
  cr_assert_eq(kt_pool_prepare_capture(parent, emptied + emptied / 4, &ready), KT_OK);
  cr_assert_geq(ready, emptied + emptied / 4);
  cr_assert_eq(kt_pool_validate(parent), KT_OK);

  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_t *child = make_child(sub);
  cr_assert_eq(kt_pool_hold_releases(parent, 1), KT_OK);   /* the bridge holds it while capturing */
  kt_fake_counts c0 = counts();
  for (int i = 0; i < 64; i++) cr_assert_eq(kt_alloc(child, sizes[i], cap, &live[i]), KT_OK);
  kt_fake_counts c1 = counts();
  cr_assert_eq(c1.maps, c0.maps, "the capture mapped %llu granule runs", (unsigned long long)(c1.maps - c0.maps));
  cr_assert_eq(c1.reserves, c0.reserves);
  cr_assert_eq(c1.syncs, c0.syncs, "nothing may synchronize inside a capture");
  for (int i = 0; i < 64; i++) cr_assert(kt_fake_owns(fb, live[i], sizes[i]));
  cr_assert_eq(kt_pool_hold_releases(parent, 0), KT_OK);
  for (int i = 0; i < 64; i++) cr_assert_eq(kt_free(child, live[i], 0, NULL), KT_OK);
  assert_stats_identities(child);
  kt_pool_destroy(child);   /* the graph is gone: its segments go back to the parent */
  kt_pool_backend_destroy(sub);
  cr_assert_eq(stats(parent).allocated_bytes.current, 0);
  assert_stats_identities(parent);
}

/* Free ranges a stream left tagged become everyone's after prepare: the capture's
 * pool reuses them instead of growing the parent. Segments and VMM alike. */
static void untags(int vmm) {
  kt_pool_destroy(parent);
  parent = make_parent(vmm, 0);
  void *a;
  cr_assert_eq(kt_alloc(parent, 40 * MiB, test_stream(1), &a), KT_OK);
  cr_assert_eq(kt_free(parent, a, 0, NULL), KT_OK);   /* free on stream 1 only */
  kt_fake_counts c0 = counts();
  cr_assert_eq(kt_pool_prepare_capture(parent, 0, NULL), KT_OK);
  cr_assert_eq(counts().syncs, c0.syncs + 1, "one synchronization (no pending block to drain)");
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_t *child = make_child(sub);
  void *b;
  cr_assert_eq(kt_alloc(child, 30 * MiB, test_stream(2), &b), KT_OK);
  cr_assert_eq(counts().reserves, c0.reserves);
  cr_assert_eq(counts().maps, c0.maps);
  cr_assert_eq(b, a, "the capture reuses what stream 1 freed");
  cr_assert_eq(kt_free(child, b, 0, NULL), KT_OK);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
  assert_stats_identities(parent);
}
Test(capture, prepare_makes_what_one_stream_freed_usable_by_the_capture_vmm) { untags(1); }
Test(capture, prepare_makes_what_one_stream_freed_usable_by_the_capture_segments) { untags(0); }

Test(capture, prepare_does_nothing_while_releases_are_held) {
  cr_assert_eq(kt_pool_hold_releases(parent, 1), KT_OK);
  uint64_t syncs = counts().syncs;
  size_t ready = 123;
  cr_assert_eq(kt_pool_prepare_capture(parent, 64 * MiB, &ready), KT_ERR_UNAVAILABLE);
  cr_assert_eq(ready, 0);
  cr_assert_eq(counts().syncs, syncs);
  cr_assert_eq(counts().mapped_bytes, 0);
  cr_assert_eq(kt_pool_hold_releases(parent, 0), KT_OK);
  cr_assert_eq(kt_pool_prepare_capture(NULL, 0, NULL), KT_ERR_INVALID);
}

Test(capture, prepare_stops_at_the_limit_without_an_out_of_memory) {
  kt_pool_destroy(parent);
  parent = make_parent(1, 64 * MiB);
  size_t ready = 0;
  cr_assert_eq(kt_pool_prepare_capture(parent, (size_t)1 << 30, &ready), KT_OK);
  cr_assert_eq(ready, 0, "1 GiB does not fit the 64 MiB limit: nothing is mapped for it");
  cr_assert_eq(counts().mapped_bytes, 0);
  cr_assert_eq(stats(parent).num_ooms, 0, "best effort: not an out-of-memory");
  cr_assert_eq(kt_pool_prepare_capture(parent, 48 * MiB, &ready), KT_OK);
  cr_assert_eq(ready, 48 * MiB);
  cr_assert_eq(stats(parent).reserved_bytes.current, (int64_t)(48 * MiB));
  cr_assert_eq(stats(parent).allocated_bytes.current, 0, "ready memory is cache, not live");
  assert_stats_identities(parent);
}

Test(capture, a_child_out_of_memory_leaves_the_parent_whole) {
  kt_pool_destroy(parent);
  parent = make_parent(1, 64 * MiB);
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_t *child = make_child(sub);
  void *a, *b;
  cr_assert_eq(kt_alloc(child, 40 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(child, 40 * MiB, NULL, &b), KT_ERR_OOM);
  const kt_oom_info *o = kt_last_oom();
  cr_assert_eq(o->requested, 40 * MiB);
  cr_assert(o->hit_limit && o->limit == 64 * MiB, "the report is of the parent, whose limit ran out");
  cr_assert_eq(o->reserved, (size_t)stats(parent).reserved_bytes.current);
  cr_assert_eq(o->live, 40 * MiB, "the parent's live bytes: the child's one segment");
  cr_assert_eq(stats(child).num_ooms, 1);
  cr_assert_eq(stats(parent).num_ooms, 0, "one out-of-memory, counted once (by the child)");
  void *e;   /* a later failure of the parent alone reports the parent as itself */
  cr_assert_eq(kt_alloc(parent, 30 * MiB, NULL, &e), KT_ERR_OOM);
  cr_assert_eq(kt_last_oom()->requested, 30 * MiB);
  cr_assert_eq(stats(parent).num_ooms, 1);
  cr_assert_eq(stats(parent).allocated_bytes.current, (int64_t)(40 * MiB), "only the first segment");
  cr_assert_eq(stats(child).reserved_bytes.current, (int64_t)(40 * MiB));
  cr_assert_eq(kt_free(child, a, 0, NULL), KT_OK);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
  cr_assert_eq(stats(parent).allocated_bytes.current, 0);
  assert_stats_identities(parent);
}

Test(capture, free_idle_hands_a_large_block_to_every_stream_at_once) {
  void *a, *b, *c;
  kt_fake_hold_events(fb, 1);   /* stream 1's work still runs: its free memory stays its own */
  cr_assert_eq(kt_alloc(parent, 8 * MiB, test_stream(1), &a), KT_OK);
  cr_assert_eq(kt_free(parent, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(parent, 8 * MiB, test_stream(2), &b), KT_OK);
  cr_assert_neq(b, a, "a plain free keeps the block on stream 1");
  kt_fake_complete_events(fb);
  kt_fake_hold_events(fb, 0);
  cr_assert_eq(kt_free_idle(parent, b, 8 * MiB), KT_OK);
  cr_assert_eq(kt_alloc(parent, 8 * MiB, test_stream(3), &c), KT_OK);
  cr_assert_eq(c, b, "an idle free is for any stream");
  cr_assert_eq(kt_free_idle(parent, c, 4 * MiB), KT_ERR_INVALID, "a size that is not the block's");
  cr_assert_eq(kt_free_idle(parent, (char *)c + 512, 0), KT_ERR_INVALID);
  cr_assert_eq(kt_free_idle(parent, c, 0), KT_OK);
  cr_assert_eq(kt_free_idle(parent, c, 0), KT_ERR_INVALID, "a second free");
  cr_assert_eq(kt_free_idle(parent, NULL, 0), KT_OK);
  cr_assert_eq(kt_free_idle(NULL, c, 0), KT_ERR_INVALID);
  assert_stats_identities(parent);
}

Test(capture, a_backend_needs_a_parent) { cr_assert_null(kt_pool_backend_create(NULL)); }

/* A VMM range's free extents count their unmapped parts too. While releases are
 * held (a capture), and by default, a block goes where a mapped run holds it, not
 * into a smaller, half-unmapped hole that would need maps. With
 * KT_RELEASE_FOLLOW_PEAK, best fit by size wins (growth trims idle granules then). */
static void mapped_run_or_hole(int held, int follow_peak) {
  void *a, *b, *c, *d, *x;
  kt_pool_destroy(parent);
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = 1;
  o.release_on_grow = follow_peak ? KT_RELEASE_FOLLOW_PEAK : KT_RELEASE_SEGMENTS;
  cr_assert_eq(kt_pool_create(&o, fb, &parent), KT_OK);
  cr_assert_eq(kt_alloc(parent, 20 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(parent, 5 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_alloc(parent, 20 * MiB, NULL, &c), KT_OK);
  cr_assert_eq(kt_alloc(parent, 8 * MiB, NULL, &d), KT_OK);
  cr_assert_eq(kt_free(parent, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(parent, d, 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(parent), KT_OK);   /* b's hole keeps one mapped granule, shared with c */
  size_t ready = 0;
  cr_assert_eq(kt_pool_prepare_capture(parent, 8 * MiB, &ready), KT_OK);
  cr_assert_geq(ready, 8 * MiB);
  uint64_t maps = counts().maps;
  if (held) cr_assert_eq(kt_pool_hold_releases(parent, 1), KT_OK);
  cr_assert_eq(kt_alloc(parent, 4 * MiB, NULL, &x), KT_OK);
  if (!follow_peak || held) {
    cr_assert_eq(counts().maps, maps, "the 5 MiB hole fits by size but would map two granules");
    cr_assert_neq(x, b);
    if (held) cr_assert_eq(kt_pool_hold_releases(parent, 0), KT_OK);
  } else {
    cr_assert((char *)x >= (char *)b && (char *)x + 4 * MiB <= (char *)b + 5 * MiB,
              "best fit by size: in the hole (over its mapped end)");
    cr_assert_gt(counts().maps, maps);
  }
  cr_assert_eq(kt_free(parent, x, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(parent, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(parent, c, 0, NULL), KT_OK);
  assert_stats_identities(parent);
}
Test(capture, held_a_block_goes_to_a_mapped_run_before_a_smaller_unmapped_hole) { mapped_run_or_hole(1, 0); }
Test(capture, releasing_segments_a_block_goes_to_a_mapped_run_too) { mapped_run_or_hole(0, 0); }
Test(capture, following_the_peak_a_block_takes_the_snug_hole_and_maps_it) { mapped_run_or_hole(0, 1); }
Test(capture, following_the_peak_held_a_block_goes_to_a_mapped_run) { mapped_run_or_hole(1, 1); }

/* The child's shared-segment reservation fails and its exact one succeeds: the
 * parent's failure is not reported later as someone else's. */
Test(capture, a_parent_failure_the_child_got_past_is_forgotten) {
  kt_pool_destroy(parent);
  parent = make_parent(1, 32 * MiB);
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_t *child = make_child(sub);
  void *s, *t, *m, *e;
  cr_assert_eq(kt_alloc(child, 9 * MiB + 512 * KiB, NULL, &s), KT_OK);   /* one 20 MiB shared segment */
  cr_assert_eq(kt_alloc(child, 9 * MiB + 512 * KiB, NULL, &t), KT_OK);   /* fills it */
  cr_assert_eq(kt_alloc(child, 9 * MiB + 512 * KiB, NULL, &m), KT_OK);   /* a second shared one fails; 10 MiB fits */
  cr_assert_eq(stats(parent).allocated_bytes.current, (int64_t)(30 * MiB));
  cr_assert_eq(kt_alloc(parent, 100 * MiB, NULL, &e), KT_ERR_OOM);
  const kt_oom_info *o = kt_last_oom();
  cr_assert_eq(o->requested, 100 * MiB);
  cr_assert_eq(o->live, 30 * MiB, "the parent as it is now, not the child's earlier failure");
  cr_assert_eq(stats(child).num_ooms, 0);
  cr_assert_eq(stats(parent).num_ooms, 1);
  cr_assert_eq(kt_free(child, s, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(child, t, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(child, m, 0, NULL), KT_OK);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
}

/* A capture must neither record nor query an event: a block freed then with a use on
 * another stream waits, unused, with no event, until the deferral ends; then it gets
 * its event and is reused once that completes. Small and large blocks both. */
static void deferred_cross_stream_free(size_t size) {
  kt_pool_t *p = make_parent(1, 0);
  void *a, *b, *c;
  cr_assert_eq(kt_alloc(p, size, test_stream(1), &a), KT_OK);
  cr_assert_eq(kt_record_stream(p, a, test_stream(2)), KT_OK);
  cr_assert_eq(kt_pool_defer_events(p, 0), KT_ERR_INVALID, "not deferring");
  cr_assert_eq(kt_pool_defer_events(p, 1), KT_OK);
  cr_assert_eq(kt_pool_defer_events(p, 1), KT_OK);   /* nests */
  kt_fake_counts before = counts();
  cr_assert_eq(kt_free(p, a, size, test_stream(1)), KT_OK);
  cr_assert_eq(kt_alloc(p, size, test_stream(1), &b), KT_OK);
  cr_assert_neq(b, a, "a block another stream may still use was handed out");
  cr_assert_eq(kt_empty_cache(p), KT_OK);
  kt_fake_counts during = counts();
  cr_assert_eq(during.event_records, before.event_records, "an event was recorded while deferred");
  cr_assert_eq(during.event_queries, before.event_queries, "an event was queried while deferred");
  cr_assert_eq(during.syncs, before.syncs, "the device was synchronized while deferred");
  kt_stats st = stats(p);
  kt_block_info bi;
  cr_assert_eq(kt_block_query(p, b, &bi), KT_OK);
  cr_assert_eq(st.active_bytes.current - st.allocated_bytes.current, (int64_t)bi.size,
               "the deferred block counts as pending");
  cr_assert_eq(kt_pool_defer_events(p, 0), KT_OK);
  cr_assert_eq(counts().event_records, before.event_records, "still deferred: one level left");
  kt_fake_hold_events(fb, 1);
  cr_assert_eq(kt_pool_defer_events(p, 0), KT_OK);
  cr_assert_eq(counts().event_records, before.event_records + 1, "its event is recorded when the deferral ends");
  cr_assert_eq(kt_alloc(p, size, test_stream(1), &c), KT_OK);
  cr_assert_neq(c, a, "reused before its event completed");
  kt_fake_complete_events(fb);
  kt_fake_hold_events(fb, 0);
  cr_assert_eq(kt_free(p, c, size, test_stream(1)), KT_OK);
  void *d;
  cr_assert_eq(kt_alloc(p, size, test_stream(1), &d), KT_OK);   /* drains: a or c, both free now */
  cr_assert(d == a || d == c);
  cr_assert_eq(kt_free(p, b, size, test_stream(1)), KT_OK);
  cr_assert_eq(kt_free(p, d, size, test_stream(1)), KT_OK);
  cr_assert_eq(kt_empty_cache(p), KT_OK);   /* drains what is still pending */
  cr_assert_eq(stats(p).active_bytes.current, 0, "a block was left pending");
  cr_assert_eq(kt_pool_validate(p), KT_OK);
  kt_pool_destroy(p);
}
Test(capture, a_cross_stream_free_in_a_capture_waits_for_its_end_small) { deferred_cross_stream_free(64 * KiB); }
Test(capture, a_cross_stream_free_in_a_capture_waits_for_its_end_large) { deferred_cross_stream_free(8 * MiB); }

Test(capture, a_pool_destroyed_while_deferring_frees_its_waiting_blocks) {
  kt_pool_t *p = make_parent(0, 0);
  void *a;
  cr_assert_eq(kt_alloc(p, 64 * KiB, test_stream(1), &a), KT_OK);
  cr_assert_eq(kt_record_stream(p, a, test_stream(2)), KT_OK);
  cr_assert_eq(kt_pool_defer_events(p, 1), KT_OK);
  cr_assert_eq(kt_free(p, a, 0, test_stream(1)), KT_OK);
  kt_pool_destroy(p);   /* ASan: nothing leaks */
}

Test(capture, a_child_with_2_mib_shared_segments_holds_2_mib_for_a_small_block) {
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_options o;
  kt_pool_options_default(&o);
  kt_pool_t *bad = NULL;
  o.shared_segment = 3 * MiB;
  cr_assert_eq(kt_pool_create(&o, sub, &bad), KT_ERR_INVALID, "not a multiple of 2 MiB");
  cr_assert_null(bad);
  o.shared_segment = 2 * MiB;
  kt_pool_t *child = NULL;
  cr_assert_eq(kt_pool_create(&o, sub, &child), KT_OK);
  void *a, *b;
  cr_assert_eq(kt_alloc(child, 4000, test_stream(3), &a), KT_OK);
  cr_assert_eq(kt_alloc(child, 300 * KiB, test_stream(3), &b), KT_OK);
  cr_assert_eq(stats(child).reserved_bytes.current, (int64_t)(2 * MiB), "both in one 2 MiB segment");
  cr_assert_eq(stats(parent).allocated_bytes.current, (int64_t)(2 * MiB));
  cr_assert_eq(kt_free(child, a, 0, test_stream(3)), KT_OK);
  cr_assert_eq(kt_free(child, b, 0, test_stream(3)), KT_OK);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
}

/* A child's segment is a block of its parent, and a pool needs its segments 64 KiB
 * aligned (slabs and the address radix are laid out in KT_PAGE units). The parent
 * places large blocks on 512-byte boundaries, so after a block of an odd size the
 * next free byte is not on one: the child's segment must still be. */
Test(capture, a_childs_segment_is_page_aligned_after_an_odd_parent_block) {
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_pool_t *child = make_child(sub);
  void *odd, *a, *b;
  cr_assert_eq(kt_alloc(parent, 3 * MiB + 512, test_stream(1), &odd), KT_OK);   /* large: 512-byte aligned */
  cr_assert_eq(kt_alloc(child, 30 * MiB, test_stream(2), &a), KT_OK, "the child's segment is refused");
  cr_assert_eq(kt_alloc(child, 4000, test_stream(2), &b), KT_OK);
  cr_assert_eq((uintptr_t)a % KT_PAGE, 0);
  cr_assert(kt_fake_owns(fb, a, 30 * MiB) && kt_fake_owns(fb, b, 4000));
  cr_assert_eq(kt_pool_validate(child), KT_OK);
  cr_assert_eq(kt_free(child, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(child, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(parent, odd, 0, NULL), KT_OK);
  assert_stats_identities(parent);
  assert_stats_identities(child);
  kt_pool_destroy(child);
  kt_pool_backend_destroy(sub);
}
