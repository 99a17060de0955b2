/* Unit: a capture recorded, planned, and placed again by the plan (kitsune/capplan.h),
 * on the fake backend. The placement checks are what make any plan safe, so most
 * tests here replay a sequence that differs from the recorded one and check that
 * nothing could share bytes with a block still in use. */
#include <stdio.h>

#include "common.h"
#include "kitsune/capplan.h"

static kt_backend *fb;
static void setup(void) { fb = kt_fake_backend_create(0); }
static void teardown(void) { kt_fake_backend_destroy(fb); }
TestSuite(capplan, .init = setup, .fini = teardown);

#define S1 ((kt_stream_t)(uintptr_t)0x1000)
#define S2 ((kt_stream_t)(uintptr_t)0x2000)
#define P(i) ((void *)(uintptr_t)(0x10000000u + 0x100000u * (unsigned)(i)))   /* recorded addresses */

static kt_caprec *rec_new(void) {
  kt_caprec *r = NULL;
  cr_assert_eq(kt_caprec_create(&r), KT_OK);
  return r;
}
static kt_capplan *plan_of(kt_caprec *r) {
  kt_capplan *p = NULL;
  cr_assert_eq(kt_capplan_create(r, &p), KT_OK);
  return p;
}
static kt_capplan_info info_of(const kt_capplan *p) {
  kt_capplan_info i;
  cr_assert_eq(kt_capplan_get_info(p, &i), KT_OK);
  return i;
}
static kt_placer *placer_on(const kt_backend *be) {
  kt_placer *pl = NULL;
  cr_assert_eq(kt_placer_create(be, 0, &pl), KT_OK);
  return pl;
}
static kt_placer *placer_new(void) { return placer_on(fb); }
/* A placer on the fake backend placing plan by order (both asserted to take). */
static kt_placer *placer_ordered(const kt_capture_order *ord, const kt_capplan *plan) {
  kt_placer *pl = placer_new();
  cr_assert_eq(kt_placer_set_order(pl, ord), KT_OK);
  cr_assert_eq(kt_placer_begin(pl, plan), KT_OK);
  return pl;
}
static int64_t allocated(kt_pool_t *pool) {
  kt_stats st;
  cr_assert_eq(kt_get_stats(pool, &st), KT_OK);
  return st.allocated_bytes.current;
}
static kt_placer_stats pstats(const kt_placer *pl) {
  kt_placer_stats s;
  cr_assert_eq(kt_placer_get_stats(pl, &s), KT_OK);
  return s;
}
static kt_fake_counts counts(void) {
  kt_fake_counts c;
  kt_fake_get_counts(fb, &c);
  return c;
}
static void *place(kt_placer *pl, size_t size, kt_stream_t s) {
  void *p = NULL;
  cr_assert_eq(kt_placer_alloc(pl, size, s, &p), KT_OK, "a placement of %zu bytes was refused", size);
  return p;
}
static void refused(kt_placer *pl, size_t size, kt_stream_t s) {
  void *p = (void *)1;
  cr_assert_eq(kt_placer_alloc(pl, size, s, &p), KT_ERR_UNAVAILABLE, "a placement of %zu bytes was not refused", size);
  cr_assert_eq(p, (void *)1, "a refused placement wrote its output");
}

/* a (4 MiB), b (2 MiB) freed in turn, then c (4 MiB) and d (1 KiB) */
static kt_caprec *chain(void) {
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_alloc(r, P(0), 4 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(1), 2 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(0)), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(2), 4 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(3), 1000, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(2)), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(3)), KT_OK);
  return r;
}

/* chain() recorded, planned, and a placer begun on its plan */
typedef struct placing { kt_caprec *r; kt_capplan *p; kt_placer *pl; } placing;
static placing chain_placing(void) {
  placing f = {chain(), NULL, placer_new()};
  f.p = plan_of(f.r);
  cr_assert_eq(kt_placer_begin(f.pl, f.p), KT_OK);
  return f;
}
static void done(placing f) {
  kt_placer_destroy(f.pl);
  kt_capplan_destroy(f.p);
  kt_caprec_destroy(f.r);
}

Test(capplan, bad_input_is_refused_and_changes_nothing) {
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_create(NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_alloc(NULL, P(0), 512, S1), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_alloc(r, NULL, 512, S1), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_alloc(r, NULL, 0, S1), KT_OK, "a 0-byte allocation is not recorded, not an error");
  cr_assert_eq(kt_caprec_alloc(r, P(0), 512, S1), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(0), 512, S1), KT_ERR_INVALID, "a live address twice");
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_free(r, NULL), KT_ERR_INVALID, "NULL is never a recorded block");
  cr_assert_eq(kt_caprec_use(r, P(1), S2), KT_ERR_INVALID);
  kt_caprec_info ri;
  cr_assert_eq(kt_caprec_get_info(r, &ri), KT_OK);
  cr_assert_eq(ri.blocks, 1);
  cr_assert_eq(ri.live, 1);
  cr_assert_eq(kt_capplan_create(r, NULL), KT_ERR_INVALID);
  kt_capplan *p = plan_of(r);
  cr_assert_eq(info_of(p).blocks, 0, "the live block is left out");
  cr_assert_eq(info_of(p).arena_bytes, 0);
  kt_placer *pl = NULL;
  cr_assert_eq(kt_placer_create(NULL, 0, &pl), KT_ERR_INVALID);
  pl = placer_new();
  cr_assert_eq(kt_placer_begin(pl, NULL), KT_ERR_INVALID);
  refused(pl, 512, S1);   /* not placing */
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  refused(pl, 512, S1);   /* an empty plan places nothing */
  cr_assert_eq(kt_placer_free(pl, P(0)), KT_ERR_INVALID);
  cr_assert_eq(kt_placer_use(pl, P(0), S1), KT_ERR_INVALID);
  cr_assert_eq(counts().reserves, 0, "no arena for an empty plan");
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, a_chain_shares_bytes_and_the_same_capture_is_placed_in_full) {
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  kt_capplan_info in = info_of(p);
  cr_assert_eq(in.blocks, 4);
  cr_assert_eq(in.peak_bytes, 6 * MiB, "a and b, or b and c, live at once");
  cr_assert_eq(in.plan_bytes, 6 * MiB, "c fits where a was");
  cr_assert_eq(in.arena_bytes, 6 * MiB);
  cr_assert_eq(in.group_peak_bytes, in.peak_bytes, "one stream");
  kt_placer *pl = placer_new();
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  cr_assert_eq(counts().reserves, 1, "one arena");
  char *a = place(pl, 4 * MiB, S1), *b = place(pl, 2 * MiB, S1);
  cr_assert(b >= a + 4 * MiB || a >= b + 2 * MiB, "a and b overlap");
  cr_assert_eq(kt_placer_free(pl, a), KT_OK);
  char *c = place(pl, 4 * MiB, S1);
  cr_assert_eq(c, a, "c takes a's bytes");
  cr_assert_eq(kt_placer_free(pl, b), KT_OK);
  char *d = place(pl, 1000, S1);
  cr_assert(d + 1024 <= c || d >= c + 4 * MiB, "d overlaps the live c");
  cr_assert_eq(kt_placer_free(pl, NULL), KT_ERR_INVALID, "NULL (a 0-byte block) is never a placed block");
  cr_assert_eq(kt_placer_use(pl, NULL, S2), KT_ERR_INVALID);
  kt_placer_stats s = pstats(pl);
  cr_assert_eq(s.placed, 4);
  cr_assert_eq(s.refused, 0);
  cr_assert_eq(s.planned, 4);
  cr_assert_eq(s.live_blocks, 2);
  cr_assert_eq(s.live_bytes, 4 * MiB + 1024);
  cr_assert_eq(s.arena_bytes, 6 * MiB);
  cr_assert_eq(kt_placer_free(pl, c), KT_OK);
  cr_assert_eq(kt_placer_free(pl, d), KT_OK);
  cr_assert_eq(kt_placer_free(pl, d), KT_ERR_INVALID, "a double free is refused");
  cr_assert_eq(pstats(pl).live_bytes, 0);
  kt_placer_destroy(pl);
  cr_assert_eq(counts().releases, 1, "destroy releases the arena");
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, a_free_that_comes_later_than_recorded_refuses_the_overlap) {
  placing f = chain_placing();
  void *a = place(f.pl, 4 * MiB, S1);
  void *b = place(f.pl, 2 * MiB, S1);
  refused(f.pl, 4 * MiB, S1);   /* c's planned bytes are a's, and a is still live */
  cr_assert_eq(pstats(f.pl).refused, 1);
  cr_assert_eq(kt_placer_free(f.pl, a), KT_OK);
  cr_assert_eq(kt_placer_free(f.pl, b), KT_OK);
  done(f);
}

Test(capplan, bytes_freed_by_one_stream_are_not_placed_for_another) {
  placing f = chain_placing();
  void *a = place(f.pl, 4 * MiB, S1);
  void *b = place(f.pl, 2 * MiB, S1);
  cr_assert_eq(kt_placer_free(f.pl, a), KT_OK);
  refused(f.pl, 4 * MiB, S2);   /* S2's work is not ordered after a's last use on S1 */
  void *c = place(f.pl, 4 * MiB, S1);
  cr_assert_eq(c, a);
  (void)b;
  done(f);
}

Test(capplan, a_block_used_on_another_stream_keeps_its_bytes_to_the_end) {
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  kt_placer *pl = placer_new();
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  void *a = place(pl, 4 * MiB, S1);
  place(pl, 2 * MiB, S1);
  cr_assert_eq(kt_placer_use(pl, a, S2), KT_OK);
  cr_assert_eq(kt_placer_free(pl, a), KT_OK);
  refused(pl, 4 * MiB, S1);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);

  /* recorded that way, the plan gives it bytes of its own */
  r = rec_new();
  cr_assert_eq(kt_caprec_alloc(r, P(0), 4 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_use(r, P(0), S2), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(0)), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(1), 4 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_OK);
  p = plan_of(r);
  cr_assert_eq(info_of(p).plan_bytes, 8 * MiB);
  cr_assert_eq(info_of(p).peak_bytes, 8 * MiB);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, blocks_share_bytes_within_their_stream_only) {
  kt_caprec *r = rec_new();
  for (int i = 0; i < 3; i++) {   /* each stream reuses its own bytes, never the other's */
    cr_assert_eq(kt_caprec_alloc(r, P(i), 2 * MiB, S1), KT_OK);
    cr_assert_eq(kt_caprec_free(r, P(i)), KT_OK);
    cr_assert_eq(kt_caprec_alloc(r, P(10 + i), 2 * MiB, S2), KT_OK);
    cr_assert_eq(kt_caprec_free(r, P(10 + i)), KT_OK);
  }
  kt_capplan *p = plan_of(r);
  cr_assert_eq(info_of(p).plan_bytes, 4 * MiB);
  cr_assert_eq(info_of(p).peak_bytes, 2 * MiB, "one block live at a time");
  cr_assert_eq(info_of(p).group_peak_bytes, 4 * MiB, "each stream's 2 MiB peak, apart");
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, blocks_freed_after_the_capture_last_to_the_end_and_live_ones_are_left_out) {
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_alloc(r, P(0), 32 * MiB, S1), KT_OK);   /* a workspace PyTorch keeps */
  cr_assert_eq(kt_caprec_alloc(r, P(1), 2 * MiB, S1), KT_OK);    /* the loss: freed after */
  cr_assert_eq(kt_caprec_alloc(r, P(2), 2 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(2)), KT_OK);
  cr_assert_eq(kt_caprec_end(r), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_OK);
  kt_caprec_info ri;
  cr_assert_eq(kt_caprec_get_info(r, &ri), KT_OK);
  cr_assert_eq(ri.freed_after, 1);
  cr_assert_eq(ri.live, 1);
  kt_capplan *p = plan_of(r);
  kt_capplan_info in = info_of(p);
  cr_assert_eq(in.blocks, 2);
  cr_assert_eq(in.plan_bytes, 4 * MiB, "the loss overlaps the temporary; the workspace is not planned");
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, an_allocation_the_plan_did_not_see_is_refused_and_the_rest_still_placed) {
  placing f = chain_placing();
  char *a = place(f.pl, 4 * MiB, S1);
  refused(f.pl, 3 * MiB, S1);   /* no planned block of this size */
  refused(f.pl, 0, S1);         /* a 0-byte request is never placed, and not counted as refused:
                                   the recording leaves such requests out, so the plan foresaw it */
  char *b = place(f.pl, 2 * MiB, S1);
  cr_assert_eq(kt_placer_free(f.pl, a), KT_OK);
  cr_assert_eq(place(f.pl, 4 * MiB, S1), a);
  cr_assert_eq(kt_placer_free(f.pl, b), KT_OK);
  place(f.pl, 1000, S1);
  kt_placer_stats s = pstats(f.pl);
  cr_assert_eq(s.placed, 4);
  cr_assert_eq(s.refused, 1);
  done(f);
}

Test(capplan, a_second_capture_reuses_the_arena_and_a_larger_plan_retires_it) {
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  kt_placer *pl = placer_new();
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  char *a = place(pl, 4 * MiB, S1);   /* left live: a graph's output */
  kt_placer_end(pl);
  refused(pl, 2 * MiB, S1);           /* not placing after the end */
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  cr_assert_eq(counts().reserves, 1, "the arena fits: kept");
  refused(pl, 4 * MiB, S1);           /* would start where the earlier capture's live block does */
  char *b = place(pl, 2 * MiB, S1);
  cr_assert_neq(b, a);
  /* a larger plan: a new arena, the old one retired while a and b live in it */
  kt_caprec *r2 = rec_new();
  cr_assert_eq(kt_caprec_alloc(r2, P(0), 10 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r2, P(0)), KT_OK);
  kt_capplan *p2 = plan_of(r2);
  cr_assert_eq(kt_placer_begin(pl, p2), KT_OK);
  cr_assert_eq(counts().reserves, 2);
  cr_assert_eq(counts().releases, 0, "the old arena has live blocks");
  cr_assert_eq(pstats(pl).arena_bytes, 16 * MiB);
  cr_assert_eq(pstats(pl).arenas, 2);
  char *c = place(pl, 10 * MiB, S1);
  cr_assert(c + 10 * MiB <= a || c >= a + 4 * MiB, "c overlaps a block of the old arena");
  cr_assert_eq(kt_placer_free(pl, a), KT_OK, "an earlier capture's block is still recognised");
  cr_assert_eq(kt_placer_free(pl, b), KT_OK);
  cr_assert_eq(kt_placer_trim(pl), KT_OK);
  cr_assert_eq(counts().releases, 1, "the idle retired arena is released by trim");
  cr_assert_eq(pstats(pl).arena_bytes, 10 * MiB);
  cr_assert_eq(kt_placer_free(pl, c), KT_OK);
  kt_placer_destroy(pl);
  cr_assert_eq(counts().releases, 2);
  kt_capplan_destroy(p2);
  kt_caprec_destroy(r2);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, an_arena_the_backend_refuses_leaves_the_placer_placing_nothing) {
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  kt_placer *pl = placer_new();
  kt_fake_fail_next_reserves(fb, 1);
  cr_assert_eq(kt_placer_begin(pl, p), KT_ERR_OOM);
  refused(pl, 4 * MiB, S1);
  cr_assert_eq(pstats(pl).arena_bytes, 0);
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  place(pl, 4 * MiB, S1);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, the_arena_can_be_a_block_of_a_device_pool) {
  kt_pool_t *parent = NULL;
  cr_assert_eq(kt_pool_create(NULL, fb, &parent), KT_OK);
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  kt_placer *pl = placer_on(sub);
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  cr_assert_eq(allocated(parent), (int64_t)(6 * MiB), "the arena is one parent block");
  void *a = place(pl, 4 * MiB, S1);
  kt_block_info bi;
  cr_assert_eq(kt_block_query(parent, a, &bi), KT_OK, "a placed block lies in the parent's block");
  cr_assert_eq(kt_placer_free(pl, a), KT_OK);
  kt_placer_destroy(pl);
  cr_assert_eq(allocated(parent), 0, "destroy gives the arena back to the parent");
  kt_pool_backend_destroy(sub);
  kt_pool_destroy(parent);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

/* A plan of 2 MiB and a bit: on a device pool the arena is one parent block of the
 * plan's size (rounded to 2 MiB granules it held 4 MiB for the MLP's 2.4 MiB plan,
 * and put the Inception net's static tensors and arena 1.5 KiB over the eager peak at
 * 64 KiB); on a backend that reserves whole segments, 4 MiB. A plan under a page
 * takes a page of the parent (two large blocks never start in one radix page). */
Test(capplan, the_arena_holds_its_plan_exactly_on_a_device_pool) {
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_alloc(r, P(0), 2 * MiB, S1), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(1), 1000, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(0)), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_OK);
  kt_capplan *p = plan_of(r);
  cr_assert_eq(info_of(p).plan_bytes, 2 * MiB + 1024);
  cr_assert_eq(info_of(p).arena_bytes, 2 * MiB + 1024);
  kt_caprec *r1 = rec_new();
  cr_assert_eq(kt_caprec_alloc(r1, P(0), 1000, S1), KT_OK);
  cr_assert_eq(kt_caprec_free(r1, P(0)), KT_OK);
  kt_capplan *p1 = plan_of(r1);
  cr_assert_eq(info_of(p1).arena_bytes, 1024);
  kt_pool_t *parent = NULL;
  cr_assert_eq(kt_pool_create(NULL, fb, &parent), KT_OK);
  void *odd;   /* the parent's next free byte off a page boundary */
  cr_assert_eq(kt_alloc(parent, 1 * MiB + 512, S2, &odd), KT_OK);
  kt_backend *sub = kt_pool_backend_create(parent);
  kt_placer *pl = placer_on(sub);
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  cr_assert_eq(allocated(parent), (int64_t)(1 * MiB + 512 + 2 * MiB + 1024), "the arena, exactly");
  cr_assert_eq(pstats(pl).arena_bytes, 2 * MiB + 1024);
  char *a = place(pl, 2 * MiB, S1), *b = place(pl, 1000, S1);
  cr_assert_eq((uintptr_t)a % (64 * KiB), 0, "the arena starts on a page");
  cr_assert(b >= a + 2 * MiB && b + 1000 <= a + 2 * MiB + 1024, "b lies in the arena, past a");
  void *next;   /* the parent's next large block starts in the arena's last page */
  cr_assert_eq(kt_alloc(parent, 1 * MiB + 512, S2, &next), KT_OK);
  cr_assert_eq(kt_pool_validate(parent), KT_OK);
  cr_assert_eq(kt_placer_free(pl, a), KT_OK);
  cr_assert_eq(kt_placer_free(pl, b), KT_OK);
  kt_placer_destroy(pl);
  cr_assert_eq(allocated(parent), (int64_t)(2 * MiB + 1024), "destroy gives the arena back");
  pl = placer_on(sub);
  cr_assert_eq(kt_placer_begin(pl, p1), KT_OK);
  cr_assert_eq(allocated(parent), (int64_t)(2 * MiB + 1024 + 64 * KiB), "a page for a tiny plan");
  char *c = place(pl, 1000, S1);
  cr_assert_eq(kt_block_query(parent, c, &(kt_block_info){0}), KT_OK, "c lies in a parent block");
  cr_assert_eq(kt_placer_free(pl, c), KT_OK);
  kt_placer_destroy(pl);
  cr_assert_eq(kt_free(parent, odd, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(parent, next, 0, NULL), KT_OK);
  assert_stats_identities(parent);
  cr_assert_eq(allocated(parent), 0);
  kt_pool_backend_destroy(sub);
  kt_pool_destroy(parent);
  pl = placer_new();   /* the fake reserves whole segments */
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  cr_assert_eq(pstats(pl).arena_bytes, 4 * MiB);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p1);
  kt_caprec_destroy(r1);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

/* ---- random training-step-shaped captures, replayed with perturbations ---------- */
static uint64_t rng_state;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

typedef struct op { int kind; int id; size_t size; kt_stream_t s; } op;   /* kind 0 alloc, 1 free, 2 use */
enum { MAXOPS = 1200, MAXIDS = 400 };

/* forward: activations kept + temporaries; backward: gradients, activations freed in
 * reverse; a few blocks on a second stream, some used on another stream */
static int make_trace(op *ops) {
  int n = 0, id = 0, acts[64], na = 0;
  int layers = 4 + (int)(rnd() % 60);
  for (int l = 0; l < layers; l++) {
    size_t sz = (size_t)(1 + rnd() % 64) * 64 * KiB + 512 * (rnd() % 3);
    kt_stream_t s = rnd() % 8 == 0 ? S2 : S1;
    acts[na++] = id;
    ops[n++] = (op){0, id++, sz, s};
    if (rnd() % 4 == 0) ops[n++] = (op){2, id - 1, 0, s == S1 ? S2 : S1};
    int t = id++;
    ops[n++] = (op){0, t, sz / 2 + 512, S1};
    ops[n++] = (op){1, t, 0, NULL};
  }
  int grads[64], ng = 0;
  for (int l = na - 1; l >= 0; l--) {
    int t = id++;
    ops[n++] = (op){0, t, (size_t)(1 + rnd() % 32) * 32 * KiB, S1};
    grads[ng++] = id;
    ops[n++] = (op){0, id++, (size_t)(1 + rnd() % 16) * 16 * KiB, S1};
    ops[n++] = (op){1, acts[l], 0, NULL};
    ops[n++] = (op){1, t, 0, NULL};
  }
  for (int g = 0; g < ng; g++) ops[n++] = (op){1, grads[g], 0, NULL};
  return n;
}

/* replays ops through pl, perturbed: extra allocations, a free delayed past the next
 * allocation; checks that no placement overlaps a block in use */
typedef struct placed { char *p; size_t size; kt_stream_t s; int live, elsewhere, in_arena; } placed;

static void check_place(placed *all, int n, int j) {
  for (int k = 0; k < n; k++) {
    if (k == j || !all[k].in_arena || !all[k].p) continue;
    int overlap = all[k].p < all[j].p + all[j].size && all[j].p < all[k].p + all[k].size;
    if (!overlap) continue;
    cr_assert(!all[k].live, "a placement overlaps a live block");
    cr_assert(!all[k].elsewhere, "a placement overlaps a block used on another stream");
    cr_assert_eq(all[k].s, all[j].s, "a placement overlaps a block of another stream");
  }
}

static void replay(kt_placer *pl, const op *ops, int n, int perturb, int *placed_n, int *allocs) {
  static placed all[MAXIDS + MAXOPS];
  memset(all, 0, sizeof all);
  int extra = MAXIDS, pending_free = -1;
  *placed_n = *allocs = 0;
  char *fallback = (char *)(uintptr_t)0x700000000000ull;
  for (int i = 0; i < n; i++) {
    op o = ops[i];
    if (perturb && o.kind == 1 && pending_free < 0 && rnd() % 6 == 0) {   /* free it after the next op */
      pending_free = o.id;
      continue;
    }
    int ids[2] = {o.id, -1}, nid = 1;
    if (perturb && o.kind == 0 && rnd() % 10 == 0) ids[nid++] = extra++;   /* one the plan did not see */
    for (int q = 0; q < nid; q++) {
      int id = ids[q];
      if (o.kind == 0) {
        size_t sz = q ? (size_t)(1 + rnd() % 64) * 32 * KiB : o.size;
        void *p = NULL;
        kt_status st = kt_placer_alloc(pl, sz, o.s, &p);
        (*allocs)++;
        all[id] = (placed){st == KT_OK ? p : fallback, (sz + 511) / 512 * 512, o.s, 1, 0, st == KT_OK};
        if (st == KT_OK) {
          (*placed_n)++;
          check_place(all, MAXIDS + MAXOPS, id);
        } else {
          cr_assert_eq(st, KT_ERR_UNAVAILABLE);
          fallback += 64 * MiB;
        }
      } else if (o.kind == 1) {
        if (all[id].in_arena) cr_assert_eq(kt_placer_free(pl, all[id].p), KT_OK);
        all[id].live = 0;
      } else {
        if (all[id].in_arena) cr_assert_eq(kt_placer_use(pl, all[id].p, o.s), KT_OK);
        if (o.s != all[id].s) all[id].elsewhere = 1;
      }
    }
    if (pending_free >= 0 && o.kind == 0) {
      if (all[pending_free].in_arena) cr_assert_eq(kt_placer_free(pl, all[pending_free].p), KT_OK);
      all[pending_free].live = 0;
      pending_free = -1;
    }
  }
  if (pending_free >= 0 && all[pending_free].in_arena) cr_assert_eq(kt_placer_free(pl, all[pending_free].p), KT_OK);
  for (int k = MAXIDS; k < extra; k++)
    if (all[k].live && all[k].in_arena) cr_assert_eq(kt_placer_free(pl, all[k].p), KT_OK);
}

Test(capplan, random_captures_replayed_exactly_are_placed_in_full_and_perturbed_never_overlap) {
  static op ops[MAXOPS];
  rng_state = 0x9e3779b97f4a7c15ull;
  double ratio_sum = 0, ratio_max = 0, live_sum = 0;
  int trials = 150, perturbed_placed = 0, perturbed_allocs = 0;
  for (int t = 0; t < trials; t++) {
    int n = make_trace(ops);
    kt_caprec *r = rec_new();
    for (int i = 0; i < n; i++) {
      if (ops[i].kind == 0) cr_assert_eq(kt_caprec_alloc(r, P(ops[i].id), ops[i].size, ops[i].s), KT_OK);
      else if (ops[i].kind == 1) cr_assert_eq(kt_caprec_free(r, P(ops[i].id)), KT_OK);
      else cr_assert_eq(kt_caprec_use(r, P(ops[i].id), ops[i].s), KT_OK);
    }
    kt_capplan *p = plan_of(r);
    kt_capplan_info in = info_of(p);
    cr_assert_geq(in.plan_bytes, in.group_peak_bytes, "a plan below the streams' own peaks cannot keep them apart");
    cr_assert_geq(in.group_peak_bytes, in.peak_bytes);
    double ratio = (double)in.plan_bytes / (double)in.group_peak_bytes;
    ratio_sum += ratio;
    if (ratio > ratio_max) ratio_max = ratio;
    live_sum += (double)in.plan_bytes / (double)in.peak_bytes;
    kt_placer *pl = placer_new();
    int placed_n, allocs;
    cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
    replay(pl, ops, n, 0, &placed_n, &allocs);
    cr_assert_eq(placed_n, allocs, "trial %d: the recorded sequence was not placed in full (%d of %d)", t, placed_n,
                 allocs);
    cr_assert_eq(pstats(pl).live_blocks, 0);
    cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
    replay(pl, ops, n, 1, &placed_n, &allocs);
    perturbed_placed += placed_n;
    perturbed_allocs += allocs;
    cr_assert_eq(pstats(pl).live_blocks, 0);
    kt_placer_destroy(pl);
    kt_capplan_destroy(p);
    kt_caprec_destroy(r);
  }
  cr_log_info("plan / the streams' own peaks: mean %.3f, worst %.3f (plan / live peak: mean %.3f); perturbed "
              "replays placed %d of %d allocations", ratio_sum / trials, ratio_max, live_sum / trials, perturbed_placed,
              perturbed_allocs);
  cr_assert_gt(perturbed_placed, perturbed_allocs / 3, "perturbations derailed most placements");
  cr_assert_lt(perturbed_placed, perturbed_allocs, "the perturbations never made a placement refused");
}

/* ---- streams ordered by the captured graph (kt_capture_order) --------------------- */
/* A fake capture: kernels launched on streams become nodes depending on their stream's
 * frontier; a join (an event recorded on one stream, waited on by another) adds the
 * first's frontier to the second's. Streams other than the origin capture once they
 * join one that does. */
#define S3 ((kt_stream_t)(uintptr_t)0x3000)
enum { FG_STREAMS = 3, FG_FRONT = 16, FG_EDGES = 40000 };
typedef struct fgraph {
  int nodes;
  uint64_t ef[FG_EDGES], et[FG_EDGES];
  int ne;
  uint64_t front[FG_STREAMS][FG_FRONT];
  int nfront[FG_STREAMS], capturing[FG_STREAMS];
  int edge_calls, waits;
} fgraph;

static int sidx(kt_stream_t s) { return s == S1 ? 0 : s == S2 ? 1 : 2; }
static void fg_begin(fgraph *g) {
  memset(g, 0, sizeof *g);
  g->capturing[0] = 1;   /* S1 is the origin */
}
static uint64_t fg_launch(fgraph *g, kt_stream_t s) {
  int k = sidx(s);
  cr_assert(g->capturing[k], "a launch on a stream outside the capture");
  uint64_t v = (uint64_t)++g->nodes;
  for (int i = 0; i < g->nfront[k]; i++) {
    cr_assert_lt(g->ne, FG_EDGES);
    g->ef[g->ne] = g->front[k][i];
    g->et[g->ne++] = v;
  }
  g->front[k][0] = v;
  g->nfront[k] = 1;
  return v;
}
static void fg_join(fgraph *g, kt_stream_t waiter, kt_stream_t from) {
  int w = sidx(waiter), f = sidx(from);
  cr_assert(g->capturing[f]);
  for (int i = 0; i < g->nfront[f]; i++) {
    int dup = 0;
    for (int j = 0; j < g->nfront[w]; j++) dup |= g->front[w][j] == g->front[f][i];
    if (!dup) {
      cr_assert_lt(g->nfront[w], FG_FRONT);
      g->front[w][g->nfront[w]++] = g->front[f][i];
    }
  }
  g->capturing[w] = 1;
}
static kt_status fg_frontier(void *ctx, kt_stream_t s, uint64_t *nodes, size_t cap, size_t *n) {
  fgraph *g = ctx;
  int k = sidx(s);
  if (!g->capturing[k]) return KT_ERR_UNAVAILABLE;
  *n = (size_t)g->nfront[k];
  for (size_t i = 0; i < *n && i < cap; i++) nodes[i] = g->front[k][i];
  return KT_OK;
}
static kt_status fg_edges(void *ctx, uint64_t *from, uint64_t *to, size_t cap, size_t *n) {
  fgraph *g = ctx;
  g->edge_calls++;
  *n = (size_t)g->ne;
  for (size_t i = 0; i < *n && i < cap && from && to; i++) {
    from[i] = g->ef[i];
    to[i] = g->et[i];
  }
  return KT_OK;
}
/* Whether node a is an ancestor of node b: a plain search, the tests' oracle. */
static int fg_before(const fgraph *g, uint64_t a, uint64_t b) {
  static uint64_t stack[FG_EDGES + 1];
  static unsigned char seen[FG_EDGES + 1];
  memset(seen, 0, (size_t)g->nodes + 1);
  int sp = 0;
  stack[sp++] = b;
  while (sp) {
    uint64_t v = stack[--sp];
    for (int e = 0; e < g->ne; e++)
      if (g->et[e] == v && !seen[g->ef[e]]) {
        if (g->ef[e] == a) return 1;
        seen[g->ef[e]] = 1;
        stack[sp++] = g->ef[e];
      }
  }
  return 0;
}

/* The next launch on s also depends on nodes (cudaStreamUpdateCaptureDependencies). */
static kt_status fg_wait(void *ctx, kt_stream_t s, const uint64_t *nodes, size_t n) {
  fgraph *g = ctx;
  int k = sidx(s);
  cr_assert(g->capturing[k], "a wait on a stream outside the capture");
  cr_assert_gt(n, 0);
  for (size_t i = 0; i < n; i++) {
    cr_assert(nodes[i] >= 1 && nodes[i] <= (uint64_t)g->nodes, "not a node of the capture");
    int dup = 0;
    for (int j = 0; j < g->nfront[k]; j++) dup |= g->front[k][j] == nodes[i];
    cr_assert(!dup, "a node the stream follows already");
    cr_assert_lt(g->nfront[k], FG_FRONT);
    g->front[k][g->nfront[k]++] = nodes[i];
  }
  g->waits++;
  return KT_OK;
}

static fgraph G;
static const kt_capture_order ORDER = {&G, fg_frontier, fg_edges, NULL};
static const kt_capture_order WAITING = {&G, fg_frontier, fg_edges, fg_wait};

/* x (4 MiB) on S1 read on S2 (forked), S2's temp t (4 MiB) freed there; joined (or
 * not) back to S1, x freed; then y (4 MiB) and z (4 MiB) on S1. */
static void branch(kt_caprec *r, kt_placer *pl, int join, void **out) {
  void *x = P(0), *t = P(1), *y = P(2), *z = P(3);
  if (pl) x = place(pl, 4 * MiB, S1);
  else cr_assert_eq(kt_caprec_alloc(r, x, 4 * MiB, S1), KT_OK);
  fg_launch(&G, S1);
  fg_join(&G, S2, S1);
  if (pl) cr_assert_eq(kt_placer_use(pl, x, S2), KT_OK);
  else cr_assert_eq(kt_caprec_use(r, x, S2), KT_OK);
  if (pl) t = place(pl, 4 * MiB, S2);
  else cr_assert_eq(kt_caprec_alloc(r, t, 4 * MiB, S2), KT_OK);
  fg_launch(&G, S2);
  if (pl) cr_assert_eq(kt_placer_free(pl, t), KT_OK);
  else cr_assert_eq(kt_caprec_free(r, t), KT_OK);
  if (join) fg_join(&G, S1, S2);
  if (pl) cr_assert_eq(kt_placer_free(pl, x), KT_OK);
  else cr_assert_eq(kt_caprec_free(r, x), KT_OK);
  if (!pl) {
    cr_assert_eq(kt_caprec_alloc(r, y, 4 * MiB, S1), KT_OK);
    fg_launch(&G, S1);
    cr_assert_eq(kt_caprec_alloc(r, z, 4 * MiB, S1), KT_OK);
    fg_launch(&G, S1);
    cr_assert_eq(kt_caprec_free(r, y), KT_OK);
    cr_assert_eq(kt_caprec_free(r, z), KT_OK);
    return;
  }
  out[0] = x;
  out[1] = t;
}

static kt_caprec *record_branch(int join, int order) {
  kt_caprec *r = rec_new();
  fg_begin(&G);
  if (order) cr_assert_eq(kt_caprec_set_order(r, &ORDER), KT_OK);
  branch(r, NULL, join, NULL);
  cr_assert_eq(kt_caprec_end(r), KT_OK);
  return r;
}

static int share_bit(const uint64_t *bits, int32_t n, int32_t i, int32_t j) {
  size_t k = (size_t)i * (size_t)n + (size_t)j;
  return (int)((bits[k / 64] >> (k % 64)) & 1);
}

/* The planned blocks of record_branch, in the order they were allocated: x (S1, used
 * on S2), t (S2), y and z (S1). */
Test(capplan, the_share_matrix_is_the_pairs_the_plan_may_overlap) {
  enum { X, T, Y, Z, N };
  uint64_t bits[1];
  kt_caprec *r = record_branch(1, 1);
  cr_assert_eq(kt_caprec_share_matrix(NULL, N, bits), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_share_matrix(r, N, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_share_matrix(r, N + 1, bits), KT_ERR_INVALID, "n must be the planned blocks");
  cr_assert_eq(kt_caprec_share_matrix(r, N, bits), KT_OK);
  int32_t pairs = 0;
  for (int32_t i = 0; i < N; i++)
    for (int32_t j = 0; j < N; j++) pairs += share_bit(bits, N, i, j);
  cr_assert_eq(pairs, 4, "joined: x -> y, x -> z, t -> y, t -> z, as cross_shares counts");
  cr_assert(share_bit(bits, N, X, Y) && share_bit(bits, N, X, Z) && share_bit(bits, N, T, Y) &&
            share_bit(bits, N, T, Z));
  kt_caprec_destroy(r);
  r = record_branch(0, 1);
  cr_assert_eq(kt_caprec_share_matrix(r, N, bits), KT_OK);
  cr_assert_eq(bits[0], 0, "S2 never joins S1: no pair (y and z live together)");
  kt_caprec_destroy(r);
  r = record_branch(1, 0);
  cr_assert_eq(kt_caprec_share_matrix(r, N, bits), KT_OK);
  cr_assert_eq(bits[0], 0, "without an order x (used on S2) lives to the end; t is S2's");
  kt_caprec_destroy(r);
}

Test(capplan, a_join_lets_blocks_of_another_stream_or_used_on_one_be_reused) {
  cr_assert_eq(kt_caprec_set_order(NULL, &ORDER), KT_ERR_INVALID);
  kt_capture_order half = {&G, fg_frontier, NULL, NULL};
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_set_order(r, &half), KT_ERR_INVALID);
  kt_caprec_destroy(r);

  kt_capplan *apart = plan_of(r = record_branch(1, 0));
  kt_caprec_destroy(r);
  kt_capplan_info in = info_of(apart);
  cr_assert_eq(in.graph_nodes, 0);
  cr_assert_eq(in.plan_bytes, 16 * MiB, "without an order: x (used on S2) lives on, t is S2's, y and z need 8 more");
  kt_capplan *joined = plan_of(r = record_branch(1, 1));
  kt_caprec_destroy(r);
  in = info_of(joined);
  cr_assert_eq(in.graph_nodes, 4);
  cr_assert_eq(in.plan_bytes, 8 * MiB, "joined: y and z take x's and t's bytes");
  cr_assert_eq(in.cross_shares, 4, "x -> y, x -> z, t -> y, t -> z");
  cr_assert_eq(in.peak_bytes, 8 * MiB);
  kt_capplan *unjoined = plan_of(r = record_branch(0, 1));
  kt_caprec_destroy(r);
  in = info_of(unjoined);
  cr_assert_eq(in.plan_bytes, 16 * MiB, "S2 never joins S1: nothing of x or t may be reused on S1");
  cr_assert_eq(in.cross_shares, 0);

  /* placing the joined plan: the same capture is placed in full, over x's and t's bytes */
  kt_placer *pl = placer_new();
  cr_assert_eq(kt_placer_set_order(NULL, &ORDER), KT_ERR_INVALID);
  cr_assert_eq(kt_placer_set_order(pl, &half), KT_ERR_INVALID);
  cr_assert_eq(kt_placer_set_order(pl, &ORDER), KT_OK);
  cr_assert_eq(kt_placer_begin(pl, joined), KT_OK);
  fg_begin(&G);
  void *xt[2];
  branch(NULL, pl, 1, xt);
  char *y = place(pl, 4 * MiB, S1);
  fg_launch(&G, S1);
  char *z = place(pl, 4 * MiB, S1);
  cr_assert(y != z);
  cr_assert(y == xt[0] || y == xt[1]);
  cr_assert(z == xt[0] || z == xt[1]);
  cr_assert_gt(G.edge_calls, 0, "the placer asked the graph");
  cr_assert_eq(kt_placer_free(pl, y), KT_OK);
  cr_assert_eq(kt_placer_free(pl, z), KT_OK);
  cr_assert_eq(pstats(pl).refused, 0);

  /* the second capture forgets the join: y may not take x's or t's bytes */
  cr_assert_eq(kt_placer_begin(pl, joined), KT_OK);
  fg_begin(&G);
  branch(NULL, pl, 0, xt);
  refused(pl, 4 * MiB, S1);
  cr_assert_eq(pstats(pl).refused, 1);
  /* nor without an order at all */
  cr_assert_eq(kt_placer_set_order(pl, NULL), KT_OK);
  cr_assert_eq(kt_placer_begin(pl, joined), KT_OK);
  fg_begin(&G);
  branch(NULL, pl, 1, xt);
  refused(pl, 4 * MiB, S1);
  kt_placer_destroy(pl);
  kt_capplan_destroy(apart);
  kt_capplan_destroy(joined);
  kt_capplan_destroy(unjoined);
}

/* record_branch(0): S2 never joins S1, so nothing of x or t may be reused on S1 by the
 * order (16 MiB). Within a budget of 8 MiB the plan lays y and z over them anyway, and
 * the placer buys that with one wait: S1 then follows S2's last kernel. */
Test(capplan, within_a_budget_a_wait_buys_bytes_the_order_keeps_apart) {
  kt_caprec *r = record_branch(0, 1);
  kt_capplan *p = NULL;
  cr_assert_eq(kt_capplan_create_within(NULL, 0, &p), KT_ERR_INVALID);
  cr_assert_eq(kt_capplan_create_within(r, 16 * MiB, &p), KT_OK);
  kt_capplan_info in = info_of(p);
  cr_assert(in.plan_bytes == 16 * MiB && in.wait_gap == -1 && in.wait_shares == 0, "it fits: no waits");
  kt_capplan_destroy(p);
  cr_assert_eq(kt_capplan_create_within(r, 8 * MiB, &p), KT_OK);
  in = info_of(p);
  cr_assert_eq(in.plan_bytes, 8 * MiB);
  cr_assert_eq(in.unwaited_bytes, 16 * MiB);
  cr_assert_eq(in.budget, 8 * MiB);
  /* events: x 0, t 1, t freed 2, x freed 3, y 4, z 5. Pairs at least 2 apart (t -> y,
   * x -> z, t -> z) fit 8 MiB; at least 3 (t -> z) leave y no room */
  cr_assert_eq(in.wait_gap, 2, "the largest gap that fits");
  cr_assert_eq(in.wait_shares, 3);
  kt_capplan *tight = NULL;
  cr_assert_eq(kt_capplan_create_within(r, 4 * MiB, &tight), KT_OK);
  /* 4 MiB is under the live peak (8 MiB, the least any plan takes): no waits, which
   * would order the streams and still miss it */
  cr_assert_eq(info_of(tight).plan_bytes, 16 * MiB);
  cr_assert(info_of(tight).wait_gap == -1 && info_of(tight).wait_shares == 0, "waits that cannot meet the budget");
  kt_capplan_destroy(tight);
  kt_caprec_destroy(r);

  /* placed: y takes t's bytes after one wait, z x's with none */
  kt_placer *pl = placer_ordered(&WAITING, p);
  fg_begin(&G);
  void *xt[2];
  branch(NULL, pl, 0, xt);
  uint64_t s2_last = G.front[1][0];
  char *y = place(pl, 4 * MiB, S1);
  cr_assert_eq(G.waits, 1);
  uint64_t first = fg_launch(&G, S1);
  cr_assert(fg_before(&G, s2_last, first), "y's kernel follows S2's");
  char *z = place(pl, 4 * MiB, S1);
  fg_launch(&G, S1);
  cr_assert(y == xt[1] && z == xt[0]);
  cr_assert_eq(G.waits, 1, "z needed no wait: S1 follows S2 since y's");
  kt_placer_stats ps = pstats(pl);
  cr_assert(ps.waits == 1 && ps.refused == 0 && ps.placed == 4);
  cr_assert_eq(kt_placer_free(pl, y), KT_OK);
  cr_assert_eq(kt_placer_free(pl, z), KT_OK);

  /* an order that cannot wait: refused as without waits */
  cr_assert_eq(kt_placer_set_order(pl, &ORDER), KT_OK);
  cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
  fg_begin(&G);
  branch(NULL, pl, 0, xt);
  refused(pl, 4 * MiB, S1);
  cr_assert_eq(pstats(pl).waits, 0);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);
}

/* Two blocks a wait could give c (S1) the bytes of, within a budget that fits one:
 * b on S3, freed first, whose kernel ran long, and a on S2, freed later, whose kernel
 * finished early. Events: b 0, b freed 1, a 2, a freed 3, c 4, c freed 5. With the
 * graph's kernels (records or places: pl NULL records into r) in nodes: b's, a's,
 * S1's before c, c's. */
static void two_sides(kt_caprec *r, kt_placer *pl, uint64_t *nodes, void **out) {
  void *b = P(0), *a = P(1), *c = P(2);
  fg_begin(&G);
  fg_join(&G, S2, S1);
  fg_join(&G, S3, S1);
  if (pl) b = place(pl, 4 * MiB, S3);
  else cr_assert_eq(kt_caprec_alloc(r, b, 4 * MiB, S3), KT_OK);
  nodes[0] = fg_launch(&G, S3);
  cr_assert_eq(pl ? kt_placer_free(pl, b) : kt_caprec_free(r, b), KT_OK);
  if (pl) a = place(pl, 4 * MiB, S2);
  else cr_assert_eq(kt_caprec_alloc(r, a, 4 * MiB, S2), KT_OK);
  nodes[1] = fg_launch(&G, S2);
  cr_assert_eq(pl ? kt_placer_free(pl, a) : kt_caprec_free(r, a), KT_OK);
  nodes[2] = fg_launch(&G, S1);
  if (pl) c = place(pl, 4 * MiB, S1);
  else cr_assert_eq(kt_caprec_alloc(r, c, 4 * MiB, S1), KT_OK);
  nodes[3] = fg_launch(&G, S1);
  cr_assert_eq(pl ? kt_placer_free(pl, c) : kt_caprec_free(r, c), KT_OK);
  if (out) {
    out[0] = b;
    out[1] = a;
    out[2] = c;
  }
}

static uint64_t offset_of(const kt_capplan *p, int32_t j) {
  uint64_t off = 0, size = 0;
  cr_assert_eq(kt_capplan_get_block(p, j, &off, &size), KT_OK);
  return off;
}

static kt_capplan *within(const kt_caprec *r, uint64_t budget) {
  kt_capplan *p = NULL;
  cr_assert_eq(kt_capplan_create_within(r, budget, &p), KT_OK);
  return p;
}

Test(capplan, with_node_times_a_wait_is_bought_where_it_has_slack) {
  enum { B, A, C };
  uint64_t nodes[4];
  kt_caprec *r = rec_new();
  cr_assert_eq(kt_caprec_set_order(r, &ORDER), KT_OK);
  two_sides(r, NULL, nodes, NULL);
  cr_assert_eq(kt_caprec_end(r), KT_OK);

  /* by recorded events: the farthest pair, b -> c (3 events), fits 8 MiB alone */
  kt_capplan *p = within(r, 8 * MiB);
  kt_capplan_info in = info_of(p);
  cr_assert(in.unwaited_bytes == 12 * MiB && in.plan_bytes == 8 * MiB, "unwaited %zu, plan %zu", in.unwaited_bytes,
            in.plan_bytes);
  cr_assert(in.wait_gap == 3 && in.wait_shares == 1 && in.wait_timed == 0 && in.wait_by_slack == 0 &&
            in.wait_slack_ns == INT64_MIN && in.wait_delay_ns == 0);
  cr_assert_eq(offset_of(p, C), offset_of(p, B), "c over b, whose kernel runs long");
  kt_capplan_destroy(p);

  /* b's kernel finished at 500 us, a's at 50, S1's before c at 60: only a -> c has slack */
  int64_t ns[4] = {500000, 50000, 60000, 70000};
  cr_assert_eq(kt_caprec_set_times(NULL, nodes, ns, 4), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_set_times(r, NULL, ns, 4), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_set_times(r, nodes, NULL, 4), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_set_times(r, nodes, ns, 4), KT_OK);
  p = within(r, 8 * MiB);
  in = info_of(p);
  cr_assert_eq(in.plan_bytes, 8 * MiB);
  cr_assert(in.wait_timed == 1 && in.wait_by_slack == 1 && in.wait_slack_ns == 10000, "timed %d, slack %lld",
            in.wait_timed, (long long)in.wait_slack_ns);
  cr_assert_eq(in.wait_delay_ns, 0, "a's kernel was done before S1 reached c");
  cr_assert(in.wait_shares == 1 && in.wait_gap == 1, "a -> c alone, 1 event apart");
  cr_assert_eq(offset_of(p, C), offset_of(p, A), "c over a, whose kernel was done before S1 got to c");
  cr_assert_neq(offset_of(p, C), offset_of(p, B));
  kt_capplan *loose = within(r, 12 * MiB);
  cr_assert(info_of(loose).wait_shares == 0 && info_of(loose).wait_gap == -1 && info_of(loose).wait_timed == 0,
            "it fits without: no waits, timed or not");
  kt_capplan_destroy(loose);

  /* placed by it: c takes a's bytes, and S1 waits for a's kernel, not b's */
  kt_placer *pl = placer_ordered(&WAITING, p);
  uint64_t placed_nodes[4];
  void *bac[3];
  two_sides(NULL, pl, placed_nodes, bac);
  cr_assert_eq(bac[2], bac[1]);
  cr_assert_eq(G.waits, 1);
  cr_assert(fg_before(&G, placed_nodes[1], placed_nodes[3]), "c's kernel follows a's");
  cr_assert(!fg_before(&G, placed_nodes[0], placed_nodes[3]), "and not b's");
  cr_assert(pstats(pl).refused == 0 && pstats(pl).waits == 1);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);

  /* b's kernel done early, a's late: the pair by events has the slack; it is kept (a tie in
   * delay and extent keeps the first plan found) */
  int64_t early_b[4] = {10000, 500000, 60000, 70000};
  cr_assert_eq(kt_caprec_set_times(r, nodes, early_b, 4), KT_OK);
  p = within(r, 8 * MiB);
  in = info_of(p);
  cr_assert(in.wait_timed == 1 && in.wait_by_slack == 0 && in.wait_gap == 3 && in.wait_delay_ns == 0,
            "timed %d by slack %d gap %lld delay %lld", in.wait_timed, in.wait_by_slack, (long long)in.wait_gap,
            (long long)in.wait_delay_ns);
  cr_assert_eq(offset_of(p, C), offset_of(p, B));
  kt_capplan_destroy(p);
  cr_assert_eq(kt_caprec_set_times(r, nodes, ns, 4), KT_OK);

  /* a bad call changes nothing; a node the frontiers name without a time: by events */
  uint64_t dup[2] = {nodes[0], nodes[0]}, zero[1] = {0};
  cr_assert_eq(kt_caprec_set_times(r, dup, ns, 2), KT_ERR_INVALID, "a node twice");
  cr_assert_eq(kt_caprec_set_times(r, zero, ns, 1), KT_ERR_INVALID, "node 0");
  p = within(r, 8 * MiB);
  cr_assert(info_of(p).wait_timed == 1 && offset_of(p, C) == offset_of(p, A), "the times set before stand");
  kt_capplan_destroy(p);
  uint64_t three[3] = {nodes[0], nodes[2], nodes[3]};
  int64_t three_ns[3] = {ns[0], ns[2], ns[3]};
  cr_assert_eq(kt_caprec_set_times(r, three, three_ns, 3), KT_OK);
  p = within(r, 8 * MiB);
  cr_assert(info_of(p).wait_timed == 0 && info_of(p).wait_gap == 3, "a's kernel has no time: by recorded events");
  kt_capplan_destroy(p);
  cr_assert_eq(kt_caprec_set_times(r, NULL, NULL, 0), KT_OK);
  p = within(r, 8 * MiB);
  cr_assert(info_of(p).wait_timed == 0 && offset_of(p, C) == offset_of(p, B), "times cleared");
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

/* Random Inception-like captures on three streams: blocks forked to side streams,
 * side-stream temporaries and outputs, joins that a capture may leave out, frees in
 * any order. Each is recorded with an order, planned, and placed twice: as recorded,
 * and with joins dropped and frees delayed. Every placement over a freed block is
 * checked by the oracle: each kernel that touched the old block must be an ancestor
 * of the new block's first kernel. */
enum { OK_ALLOC, OK_USE, OK_FREE, OK_JOIN };
typedef struct oop { int kind, id; size_t size; kt_stream_t s, from; } oop;
enum { OMAX = 4000, OIDS = 1200, OTOUCH = 24 };

static int make_branchy(oop *ops) {
  int n = 0, id = 0, keep[256], nk = 0;
  int blocks = 2 + (int)(rnd() % 10);
  for (int blk = 0; blk < blocks; blk++) {
    int x = id++;
    size_t xs = (size_t)(1 + rnd() % 16) * 64 * KiB;
    ops[n++] = (oop){OK_ALLOC, x, xs, S1, NULL};
    int outs[2];
    for (int b = 0; b < 2; b++) {
      kt_stream_t s = b ? S3 : S2;
      ops[n++] = (oop){OK_JOIN, 0, 0, s, S1};
      ops[n++] = (oop){OK_USE, x, 0, s, NULL};
      int t = id++;
      ops[n++] = (oop){OK_ALLOC, t, (size_t)(1 + rnd() % 16) * 64 * KiB, s, NULL};
      outs[b] = id++;
      ops[n++] = (oop){OK_ALLOC, outs[b], (size_t)(1 + rnd() % 8) * 64 * KiB, s, NULL};
      ops[n++] = (oop){OK_FREE, t, 0, NULL, NULL};
    }
    for (int b = 0; b < 2; b++) {
      ops[n++] = (oop){OK_JOIN, 0, 0, S1, b ? S3 : S2};   /* needed: the output is read on S1 next */
      ops[n++] = (oop){OK_USE, outs[b], 0, S1, NULL};
    }
    int cat = id++;
    ops[n++] = (oop){OK_ALLOC, cat, (size_t)(1 + rnd() % 8) * 128 * KiB, S1, NULL};
    for (int b = 0; b < 2; b++) ops[n++] = (oop){OK_FREE, outs[b], 0, NULL, NULL};
    if (rnd() % 2) ops[n++] = (oop){OK_FREE, x, 0, NULL, NULL};
    else keep[nk++] = x;
    keep[nk++] = cat;
    if (rnd() % 3 == 0) {   /* a side-stream temporary freed with no join after it */
      int u = id++;
      ops[n++] = (oop){OK_ALLOC, u, (size_t)(1 + rnd() % 16) * 64 * KiB, S2, NULL};
      ops[n++] = (oop){OK_FREE, u, 0, NULL, NULL};
    }
  }
  while (nk) {   /* a backward: gradients on S1 and S2, saved blocks freed in reverse */
    int g = id++;
    kt_stream_t s = rnd() % 2 ? S1 : S2;
    if (s == S2) ops[n++] = (oop){OK_JOIN, 0, 0, S2, S1};
    ops[n++] = (oop){OK_ALLOC, g, (size_t)(1 + rnd() % 16) * 64 * KiB, s, NULL};
    ops[n++] = (oop){OK_FREE, keep[--nk], 0, NULL, NULL};
    if (s == S2 && rnd() % 3) ops[n++] = (oop){OK_JOIN, 0, 0, S1, S2};
    ops[n++] = (oop){OK_FREE, g, 0, NULL, NULL};
  }
  for (int s = 1; s < 3; s++) ops[n++] = (oop){OK_JOIN, 0, 0, S1, s == 1 ? S2 : S3};
  cr_assert_lt(n, OMAX);
  cr_assert_lt(id, OIDS);
  return n;
}

typedef struct oblock {
  char *p;
  size_t size;
  kt_stream_t s;
  int live, in_arena, foreign, ntouch;   /* foreign: used on another stream than s */
  uint64_t touch[OTOUCH];   /* kernels that used it */
} oblock;

static void touch(oblock *b, uint64_t node) {
  cr_assert_lt(b->ntouch, OTOUCH);
  b->touch[b->ntouch++] = node;
}

/* Runs ops in the fake graph, through r (recording) or pl (placing, checked). With
 * perturb, a join from a side stream to S1 after a side-stream free is sometimes
 * dropped (when nothing read on S1 needs it) and frees are sometimes delayed. */
static void run_branchy(const oop *ops, int n, kt_caprec *r, kt_placer *pl, int perturb, int *placed, int *allocs,
                        int *over_foreign) {
  static oblock b[OIDS];
  memset(b, 0, sizeof b);
  fg_begin(&G);
  char *fallback = (char *)(uintptr_t)0x700000000000ull;
  int delayed = -1;
  *placed = *allocs = 0;
  for (int i = 0; i < n; i++) {
    oop o = ops[i];
    if (o.kind == OK_JOIN) {
      /* a join to S1 that no read on S1 needs next */
      int needed = i + 1 < n && ops[i + 1].kind == OK_USE;
      if (perturb && o.s == S1 && !needed && rnd() % 3 == 0) continue;
      if (G.capturing[sidx(o.from)]) fg_join(&G, o.s, o.from);
    } else if (o.kind == OK_ALLOC) {
      oblock *x = &b[o.id];
      if (pl) {
        void *p = NULL;
        kt_status st = kt_placer_alloc(pl, o.size, o.s, &p);
        (*allocs)++;
        *x = (oblock){st == KT_OK ? p : fallback, (o.size + 511) / 512 * 512, o.s, 1, st == KT_OK, 0, 0, {0}};
        if (st == KT_OK) (*placed)++;
        else fallback += 64 * MiB;
      } else {
        cr_assert_eq(kt_caprec_alloc(r, P(o.id), o.size, o.s), KT_OK);
        *x = (oblock){(char *)P(o.id), o.size, o.s, 1, 0, 0, 0, {0}};
      }
      uint64_t first = fg_launch(&G, o.s);
      touch(x, first);
      if (pl && x->in_arena)
        for (int k = 0; k < OIDS; k++) {   /* the oracle */
          oblock *y = &b[k];
          if (y == x || !y->in_arena || !(y->p < x->p + x->size && x->p < y->p + y->size)) continue;
          cr_assert(!y->live, "a placement overlaps a live block");
          for (int q = 0; q < y->ntouch; q++)
            cr_assert(fg_before(&G, y->touch[q], first), "a placement overlaps a block whose kernel %llu may "
                      "still run (new block's first kernel %llu)", (unsigned long long)y->touch[q],
                      (unsigned long long)first);
          (*over_foreign) += y->foreign || y->s != o.s;
        }
    } else if (o.kind == OK_USE) {
      oblock *x = &b[o.id];
      if (pl && x->in_arena) cr_assert_eq(kt_placer_use(pl, x->p, o.s), KT_OK);
      if (!pl) cr_assert_eq(kt_caprec_use(r, P(o.id), o.s), KT_OK);
      touch(x, fg_launch(&G, o.s));
      x->foreign |= o.s != x->s;
    } else {
      if (perturb && delayed < 0 && rnd() % 6 == 0) {
        delayed = o.id;
        continue;
      }
      int ids[2] = {o.id, delayed}, m = delayed >= 0 && o.kind == OK_FREE ? 2 : 1;
      if (m == 2) delayed = -1;
      for (int q = 0; q < m; q++) {
        oblock *x = &b[ids[q]];
        if (pl && x->in_arena) cr_assert_eq(kt_placer_free(pl, x->p), KT_OK);
        if (!pl) cr_assert_eq(kt_caprec_free(r, P(ids[q])), KT_OK);
        x->live = 0;
      }
    }
  }
  if (delayed >= 0) {
    if (pl && b[delayed].in_arena) cr_assert_eq(kt_placer_free(pl, b[delayed].p), KT_OK);
    if (!pl) cr_assert_eq(kt_caprec_free(r, P(delayed)), KT_OK);
  }
}

Test(capplan, random_branchy_captures_share_across_streams_only_where_the_graph_orders_it) {
  static oop ops[OMAX];
  rng_state = 0x2545f4914f6cdd1dull;
  int trials = 120, refused_total = 0, placed_total = 0, allocs_total = 0, foreign = 0, waits = 0;
  double gain = 0, worst = 0, within = 0;
  for (int t = 0; t < trials; t++) {
    int n = make_branchy(ops), placed, allocs, over = 0;
    kt_caprec *r = rec_new();
    cr_assert_eq(kt_caprec_set_order(r, &ORDER), KT_OK);
    run_branchy(ops, n, r, NULL, 0, &placed, &allocs, &over);
    cr_assert_eq(kt_caprec_end(r), KT_OK);
    kt_capplan *p = plan_of(r);
    kt_capplan_info in = info_of(p);
    cr_assert_gt(in.graph_nodes, 0);
    cr_assert_geq(in.plan_bytes, in.peak_bytes);
    /* the same recording without an order keeps streams apart */
    kt_caprec *r0 = rec_new();
    run_branchy(ops, n, r0, NULL, 0, &placed, &allocs, &over);
    kt_capplan *p0 = plan_of(r0);
    double g = (double)info_of(p0).plan_bytes / (double)in.plan_bytes;
    cr_assert_geq(g, 1.0, "trial %d: the order made the plan larger (%zu vs %zu)", t, in.plan_bytes,
                  info_of(p0).plan_bytes);
    gain += g;
    if ((double)in.plan_bytes / (double)in.peak_bytes > worst) worst = (double)in.plan_bytes / (double)in.peak_bytes;
    kt_placer *pl = placer_ordered(&ORDER, p);
    run_branchy(ops, n, NULL, pl, 0, &placed, &allocs, &foreign);
    cr_assert_eq(placed, allocs, "trial %d: the recorded capture was not placed in full (%d of %d)", t, placed, allocs);
    cr_assert_eq(kt_placer_begin(pl, p), KT_OK);
    run_branchy(ops, n, NULL, pl, 1, &placed, &allocs, &over);
    refused_total += allocs - placed;
    placed_total += placed;
    allocs_total += allocs;
    /* within a budget of the live peak: waits buy what the order keeps apart, only
     * where they bring the plan down to it; the oracle checks every placement of both
     * runs */
    kt_capplan *pw = NULL;
    cr_assert_eq(kt_capplan_create_within(r, in.peak_bytes, &pw), KT_OK);
    kt_capplan_info iw = info_of(pw);
    cr_assert_leq(iw.plan_bytes, in.plan_bytes);
    cr_assert_geq(iw.plan_bytes, in.peak_bytes);
    cr_assert_eq(iw.unwaited_bytes, in.plan_bytes);
    cr_assert((iw.wait_gap >= 0) == (iw.plan_bytes < in.plan_bytes), "trial %d: waits chosen that gain nothing", t);
    cr_assert(iw.wait_gap < 0 || iw.plan_bytes <= in.peak_bytes, "trial %d: waits that miss the budget", t);
    within += (double)iw.plan_bytes / (double)in.plan_bytes;
    cr_assert_eq(kt_placer_set_order(pl, &WAITING), KT_OK);
    cr_assert_eq(kt_placer_begin(pl, pw), KT_OK);
    run_branchy(ops, n, NULL, pl, 0, &placed, &allocs, &over);
    cr_assert_eq(placed, allocs, "trial %d: the recorded capture was not placed in full with waits (%d of %d)", t,
                 placed, allocs);
    waits += pstats(pl).waits;
    cr_assert(iw.wait_gap >= 0 || pstats(pl).waits == 0, "trial %d: a wait without a plan for it", t);
    cr_assert_eq(kt_placer_begin(pl, pw), KT_OK);
    run_branchy(ops, n, NULL, pl, 1, &placed, &allocs, &over);
    kt_placer_destroy(pl);
    kt_capplan_destroy(pw);
    kt_capplan_destroy(p);
    kt_capplan_destroy(p0);
    kt_caprec_destroy(r);
    kt_caprec_destroy(r0);
  }
  cr_log_info("ordered plan: %.3fx smaller than streams kept apart (mean), worst %.3fx the live peak; %d placements "
              "over blocks of or used on another stream; perturbed: placed %d of %d; within the live peak: %.3fx the "
              "ordered plan (mean), %d waits", gain / trials, worst, foreign, placed_total, allocs_total,
              within / trials, waits);
  cr_assert_lt(within / trials, 0.98, "waits hardly made the plans smaller");
  cr_assert_gt(waits, 0);
  cr_assert_gt(gain / trials, 1.05, "the order hardly changed the plans");
  cr_assert_gt(foreign, 0, "no placement ever reused a block used on another stream");
  cr_assert_gt(refused_total, 0, "the perturbations never made a placement refused");
}

/* The bridge's edge count (asked with no room) includes programmatic edges its fetch
 * leaves out: a snapshot is still taken once per count, and the plan still holds. */
static kt_status fg_edges_counting_more(void *ctx, uint64_t *from, uint64_t *to, size_t cap, size_t *n) {
  kt_status st = fg_edges(ctx, from, to, cap, n);
  if (!from || !to) *n += 3;
  return st;
}

Test(capplan, an_edge_count_above_what_is_fetched_is_taken_once) {
  kt_capture_order more = {&G, fg_frontier, fg_edges_counting_more, NULL};
  kt_caprec *r = rec_new();
  fg_begin(&G);
  cr_assert_eq(kt_caprec_set_order(r, &more), KT_OK);
  branch(r, NULL, 1, NULL);
  cr_assert_eq(kt_caprec_end(r), KT_OK);
  kt_capplan *p = plan_of(r);
  cr_assert_eq(info_of(p).plan_bytes, 8 * MiB);
  kt_placer *pl = placer_ordered(&more, p);
  fg_begin(&G);
  void *xt[2];
  branch(NULL, pl, 1, xt);
  void *y = place(pl, 4 * MiB, S1);   /* checks: counts, fetches */
  cr_assert_eq(G.edge_calls, 2, "one count, one fetch");
  void *z = place(pl, 4 * MiB, S1);   /* the graph did not change: counts only */
  cr_assert_eq(G.edge_calls, 3, "the same count was fetched again");
  cr_assert_eq(kt_placer_free(pl, y), KT_OK);
  cr_assert_eq(kt_placer_free(pl, z), KT_OK);
  kt_placer_destroy(pl);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, recorded_and_planned_blocks_can_be_read_back) {
  kt_caprec *r = chain();
  cr_assert_eq(kt_caprec_alloc(r, P(9), 700, S2), KT_OK);   /* still live when planned */
  cr_assert_eq(kt_caprec_use(r, P(9), S1), KT_OK);
  kt_capplan *p = plan_of(r);
  kt_caprec_block b;
  cr_assert_eq(kt_caprec_get_block(r, 0, &b), KT_OK);
  cr_assert(b.size == 4 * MiB && b.stream == S1 && b.start == 0 && b.end == 2 && !b.after && !b.uses);
  cr_assert_eq(kt_caprec_get_block(r, 3, &b), KT_OK);
  cr_assert_eq(b.size, 1024, "rounded up");
  cr_assert_eq(kt_caprec_get_block(r, 4, &b), KT_OK);
  cr_assert(b.end == -1 && b.uses == 1 && b.stream == S2 && b.unordered, "live, used on S1, no order given");
  cr_assert_eq(kt_caprec_get_block(r, 5, &b), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_get_block(r, -1, &b), KT_ERR_INVALID);
  cr_assert_eq(kt_caprec_get_block(r, 0, NULL), KT_ERR_INVALID);
  uint64_t off[4], size;
  for (int32_t j = 0; j < 4; j++) cr_assert_eq(kt_capplan_get_block(p, j, &off[j], &size), KT_OK);
  cr_assert_eq(kt_capplan_get_block(p, 4, &off[0], &size), KT_ERR_INVALID, "the live block is not planned");
  cr_assert_eq(size, 1024);
  cr_assert_eq(off[2], off[0], "c takes a's bytes");
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

Test(capplan, a_block_freed_after_the_capture_is_never_reused_even_with_an_order) {
  kt_caprec *r = rec_new();
  fg_begin(&G);
  cr_assert_eq(kt_caprec_set_order(r, &ORDER), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(0), 4 * MiB, S1), KT_OK);   /* the loss, say: freed after the capture */
  fg_launch(&G, S1);
  cr_assert_eq(kt_caprec_alloc(r, P(1), 4 * MiB, S1), KT_OK);
  fg_launch(&G, S1);
  cr_assert_eq(kt_caprec_free(r, P(1)), KT_OK);
  cr_assert_eq(kt_caprec_alloc(r, P(2), 4 * MiB, S1), KT_OK);   /* takes P(1)'s bytes, not P(0)'s */
  fg_launch(&G, S1);
  cr_assert_eq(kt_caprec_free(r, P(2)), KT_OK);
  cr_assert_eq(kt_caprec_end(r), KT_OK);
  cr_assert_eq(kt_caprec_free(r, P(0)), KT_OK);
  kt_capplan *p = plan_of(r);
  kt_capplan_info in = info_of(p);
  cr_assert_eq(in.plan_bytes, 8 * MiB);
  cr_assert_gt(in.graph_nodes, 0);
  uint64_t off[3], size;
  for (int32_t j = 0; j < 3; j++) cr_assert_eq(kt_capplan_get_block(p, j, &off[j], &size), KT_OK);
  cr_assert_eq(off[2], off[1]);
  cr_assert_neq(off[2], off[0]);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}

/* kt_capplan_log: the CSV tools/capplan_log.py reads (a header line, the column names,
 * a row a recorded block with its planned offset) and the share file beside it. */
Test(capplan, a_plan_is_logged_as_the_tools_read_it) {
  char dir[] = "/tmp/kt_capplan_log_XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  kt_caprec *r = chain();
  kt_capplan *p = plan_of(r);
  cr_assert_eq(kt_capplan_log(NULL, r, p), KT_ERR_INVALID);
  cr_assert_eq(kt_capplan_log("", r, p), KT_ERR_INVALID);
  cr_assert_eq(kt_capplan_log(dir, NULL, p), KT_ERR_INVALID);
  cr_assert_eq(kt_capplan_log("/nonexistent/kt_dir", r, p), KT_ERR_IO);
  cr_assert_eq(kt_capplan_log(dir, r, p), KT_OK);
  char cmd[256], line[512];
  snprintf(cmd, sizeof cmd, "cat %s/capplan_*.csv", dir);
  FILE *f = popen(cmd, "r");
  cr_assert_not_null(f);
  cr_assert_not_null(fgets(line, sizeof line, f));
  kt_capplan_info pi = info_of(p);
  char head[64];
  snprintf(head, sizeof head, "# plan_bytes %zu peak_bytes ", pi.plan_bytes);
  cr_assert_eq(strncmp(line, head, strlen(head)), 0, "header: %s", line);
  cr_assert_not_null(fgets(line, sizeof line, f));
  cr_assert_str_eq(line, "block,size,stream,start,end,after,uses,unordered,offset\n");
  const unsigned long long sizes[] = {4 * MiB, 2 * MiB, 4 * MiB};
  int rows = 0;
  while (fgets(line, sizeof line, f)) {
    int block, stream;
    unsigned long long size;
    long long offset;
    cr_assert_eq(sscanf(line, "%d,%llu,%d,%*d,%*d,%*d,%*d,%*d,%lld", &block, &size, &stream, &offset), 4, "%s", line);
    cr_assert_eq(block, rows);
    cr_assert_eq(stream, 0, "one stream, the first seen");
    cr_assert_geq(offset, 0, "every block of the chain is planned: %s", line);
    cr_assert_leq((unsigned long long)offset + size, pi.plan_bytes, "block %d lies outside the plan", block);
    if (rows < 3) cr_assert_eq(size, sizes[rows], "%s", line);
    rows++;
  }
  cr_assert_eq(rows, 4);
  pclose(f);
  snprintf(cmd, sizeof cmd, "cat %s/capplan_*_share.txt | wc -l", dir);
  f = popen(cmd, "r");
  cr_assert_not_null(fgets(line, sizeof line, f));
  cr_assert_eq(atoi(line), 4, "a share line a planned block");
  pclose(f);
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  kt_capplan_destroy(p);
  kt_caprec_destroy(r);
}
