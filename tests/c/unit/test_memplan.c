/* Unit: kt_memplan, offsets for blocks with known lifetimes (kitsune/memplan.h). */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "kitsune/memplan.h"

typedef kt_memplan_block blk;

/* Every two blocks whose lifetimes meet, or of different groups, have disjoint byte
 * ranges; offsets aligned;
 * the arena holds every block and is at least the live peak. */
static void check_plan(const blk *b, int32_t n, uint64_t align, const uint64_t *off, uint64_t total) {
  uint64_t peak = 0;
  cr_assert_eq(kt_memplan_peak(b, n, align, &peak), KT_OK);
  cr_assert_geq(total, peak, "an arena smaller than the live peak cannot be valid");
  for (int32_t i = 0; i < n; i++) {
    uint64_t si = (b[i].size + align - 1) / align * align;
    cr_assert_eq(off[i] % align, 0);
    cr_assert_leq(off[i] + si, total);
    for (int32_t j = i + 1; j < n; j++) {
      uint64_t sj = (b[j].size + align - 1) / align * align;
      int meet = ((b[i].start < b[j].end && b[j].start < b[i].end) || b[i].group != b[j].group) && si && sj;
      int share = off[i] < off[j] + sj && off[j] < off[i] + si;
      cr_assert(!(meet && share), "blocks %d and %d are live together and overlap", i, j);
    }
  }
}

Test(memplan, bad_input_is_refused_and_nothing_written) {
  blk b[2] = {{100, 0, 2, 0}, {100, 3, 3, 0}};
  uint64_t off[2] = {7, 7}, total = 7, peak = 7;
  cr_assert_eq(kt_memplan(b, 2, 512, off, &total), KT_ERR_INVALID, "end == start");
  cr_assert(off[0] == 7 && off[1] == 7 && total == 7);
  b[1].end = 4;
  cr_assert_eq(kt_memplan(b, 2, 3, off, &total), KT_ERR_INVALID, "align not a power of two");
  cr_assert_eq(kt_memplan(b, 2, 0, off, &total), KT_ERR_INVALID);
  cr_assert_eq(kt_memplan(b, -1, 512, off, &total), KT_ERR_INVALID);
  cr_assert_eq(kt_memplan(NULL, 2, 512, off, &total), KT_ERR_INVALID);
  cr_assert_eq(kt_memplan(b, 2, 512, NULL, &total), KT_ERR_INVALID);
  cr_assert_eq(kt_memplan(b, 2, 512, off, NULL), KT_ERR_INVALID);
  b[0].size = UINT64_MAX;
  cr_assert_eq(kt_memplan(b, 2, 512, off, &total), KT_ERR_INVALID, "a size beyond 2^62");
  cr_assert_eq(kt_memplan_peak(b, 2, 512, &peak), KT_ERR_INVALID);
  cr_assert(off[0] == 7 && total == 7 && peak == 7);
  cr_assert_eq(kt_memplan(NULL, 0, 512, NULL, &total), KT_OK);
  cr_assert_eq(total, 0);
}

Test(memplan, blocks_live_at_different_times_share_bytes) {
  blk b[3] = {{1000, 0, 1, 0}, {3000, 1, 2, 0}, {2000, 2, 3, 0}};   /* freed at the event the next is made */
  uint64_t off[3], total;
  cr_assert_eq(kt_memplan(b, 3, 512, off, &total), KT_OK);
  cr_assert(off[0] == 0 && off[1] == 0 && off[2] == 0);
  cr_assert_eq(total, 3072);
  check_plan(b, 3, 512, off, total);
}

Test(memplan, blocks_of_different_groups_never_share_bytes) {
  blk b[3] = {{1000, 0, 1, 0}, {1000, 1, 2, 1}, {1000, 2, 3, 0}};
  uint64_t off[3], total;
  cr_assert_eq(kt_memplan(b, 3, 512, off, &total), KT_OK);
  check_plan(b, 3, 512, off, total);
  cr_assert_eq(total, 2048, "groups 0 and 1 side by side; group 0's two blocks share");
  cr_assert_eq(off[0], off[2]);
  cr_assert_neq(off[0], off[1]);
}

Test(memplan, blocks_live_together_are_stacked_largest_first) {
  blk b[3] = {{1000, 0, 9, 0}, {3000, 1, 9, 0}, {2000, 2, 9, 0}};
  uint64_t off[3], total;
  cr_assert_eq(kt_memplan(b, 3, 512, off, &total), KT_OK);
  cr_assert_eq(off[1], 0);
  cr_assert_eq(off[2], 3072);
  cr_assert_eq(off[0], 3072 + 2048);
  cr_assert_eq(total, 3072 + 2048 + 1024);
  check_plan(b, 3, 512, off, total);
}

/* A freed block's bytes serve a later one in the gap they leave. */
Test(memplan, a_gap_left_by_a_dead_block_is_reused) {
  blk b[4] = {{4096, 0, 10, 0}, {4096, 0, 3, 0}, {4096, 0, 10, 0}, {2048, 5, 8, 0}};
  uint64_t off[4], total;
  cr_assert_eq(kt_memplan(b, 4, 512, off, &total), KT_OK);
  cr_assert_eq(total, 3 * 4096, "the small block fits where block 1 was");
  check_plan(b, 4, 512, off, total);
}

Test(memplan, zero_sized_blocks_take_no_room) {
  blk b[2] = {{0, 0, 5, 0}, {4096, 0, 5, 0}};
  uint64_t off[2], total;
  cr_assert_eq(kt_memplan(b, 2, 512, off, &total), KT_OK);
  cr_assert(off[0] == 0 && off[1] == 0 && total == 4096);
}

/* A training step's shape: forward activations kept until the backward pass frees
 * them in reverse, short-lived temporaries between, gradients made in backward and
 * kept to the end. Valid on every seed, and within 1.25x of the live peak: the worst
 * over these 200 seeds was 1.16 when this was written, the best of the four orders
 * (size alone gave 1.20). With the two conflict orders the mean went from 1.0471 to
 * 1.0270 (worst 1.1605 to 1.1565): the mean is held under 1.035. The live peak is a
 * lower bound the best plan need not reach, so the bounds are regression checks, not
 * properties of the method. */
static uint64_t rnd(uint64_t *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

Test(memplan, training_step_shaped_traces_pack_near_the_live_peak) {
  double worst = 0, sum = 0;
  for (uint64_t seed = 1; seed <= 200; seed++) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull;
    int layers = 4 + (int)(rnd(&s) % 12);
    blk *b = calloc((size_t)layers * 6, sizeof *b);
    int32_t n = 0;
    int64_t t = 0;
    int32_t act0 = 0;
    for (int l = 0; l < layers; l++) {            /* forward */
      b[n++] = (blk){512 * (1 + rnd(&s) % 4096), t, -1, 0};   /* activation: end set below */
      b[n++] = (blk){512 * (1 + rnd(&s) % 8192), t, t + 1, 0};   /* a temporary */
      t++;
    }
    for (int l = layers - 1; l >= 0; l--) {       /* backward: temp, gradient, free activation */
      b[n++] = (blk){512 * (1 + rnd(&s) % 8192), t, t + 1, 0};
      b[n++] = (blk){512 * (1 + rnd(&s) % 2048), t, 1 << 30, 0};
      b[act0 + 2 * l].end = t + 1;
      t++;
    }
    uint64_t *off = malloc(sizeof *off * (size_t)n), total, peak;
    cr_assert_eq(kt_memplan(b, n, 512, off, &total), KT_OK);
    check_plan(b, n, 512, off, total);
    cr_assert_eq(kt_memplan_peak(b, n, 512, &peak), KT_OK);
    double r = (double)total / (double)peak;
    if (r > worst) worst = r;
    sum += r;
    free(off);
    free(b);
  }
  cr_log_info("arena / live peak over 200 traces: mean %.4f, worst %.4f", sum / 200, worst);
  cr_assert_leq(worst, 1.25);
  cr_assert_leq(sum / 200, 1.035);
}

/* Random lifetimes and sizes: the plan is valid whatever greedy by size finds. */
Test(memplan, random_instances_are_always_valid) {
  for (uint64_t seed = 1; seed <= 300; seed++) {
    uint64_t s = seed * 0xD1B54A32D192ED03ull;
    int32_t n = 1 + (int32_t)(rnd(&s) % 60);
    blk *b = calloc((size_t)n, sizeof *b);
    for (int32_t i = 0; i < n; i++) {
      int64_t a = (int64_t)(rnd(&s) % 100);
      b[i] = (blk){rnd(&s) % 100000, a, a + 1 + (int64_t)(rnd(&s) % 30), seed % 3 ? 0 : (int32_t)(rnd(&s) % 3)};
    }
    uint64_t *off = malloc(sizeof *off * (size_t)n), total;
    uint64_t align = (uint64_t)1 << (rnd(&s) % 10);
    cr_assert_eq(kt_memplan(b, n, align, off, &total), KT_OK);
    check_plan(b, n, align, off, total);
    free(off);
    free(b);
  }
}

/* kt_memplan_shared: share(i, j) over random pairs (a matrix); blocks that may not
 * share (lifetimes meet, or share says no) never overlap; with share = "same group",
 * the offsets are kt_memplan's with groups. */
typedef struct { const unsigned char *ok; int32_t n; int calls; const blk *b; } share_ctx;
static int share_of(void *ctx, int32_t i, int32_t j) {
  share_ctx *c = ctx;
  c->calls++;
  cr_assert_leq(c->b[i].end, c->b[j].start, "share asked about blocks %d, %d out of order", i, j);
  return c->ok[(size_t)i * (size_t)c->n + (size_t)j];
}

Test(memplan, shared_plans_keep_apart_what_share_refuses) {
  for (uint64_t seed = 1; seed <= 200; seed++) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull;
    int32_t n = 1 + (int32_t)(rnd(&s) % 50);
    blk *b = calloc((size_t)n, sizeof *b);
    unsigned char *ok = calloc((size_t)n * (size_t)n, 1), *same = calloc((size_t)n * (size_t)n, 1);
    for (int32_t i = 0; i < n; i++) {
      int64_t a = (int64_t)(rnd(&s) % 100);
      b[i] = (blk){1 + rnd(&s) % 100000, a, a + 1 + (int64_t)(rnd(&s) % 30), (int32_t)(rnd(&s) % 3)};
    }
    for (int32_t i = 0; i < n; i++)
      for (int32_t j = 0; j < n; j++) {
        ok[(size_t)i * (size_t)n + (size_t)j] = (unsigned char)(rnd(&s) % 2);
        same[(size_t)i * (size_t)n + (size_t)j] = b[i].group == b[j].group;
      }
    uint64_t *off = malloc(sizeof *off * (size_t)n), *off2 = malloc(sizeof *off2 * (size_t)n), total, total2;
    share_ctx c = {ok, n, 0, b};
    cr_assert_eq(kt_memplan_shared(b, n, 512, share_of, &c, off, &total), KT_OK);
    uint64_t peak;
    cr_assert_eq(kt_memplan_peak(b, n, 512, &peak), KT_OK);
    cr_assert_geq(total, peak);
    for (int32_t i = 0; i < n; i++) {
      cr_assert_leq(off[i] + (b[i].size + 511) / 512 * 512, total);
      for (int32_t j = 0; j < n; j++) {
        if (i == j) continue;
        int meet = b[i].start < b[j].end && b[j].start < b[i].end;
        int apart = meet || (b[i].end <= b[j].start && !ok[(size_t)i * (size_t)n + (size_t)j]);
        uint64_t si = (b[i].size + 511) / 512 * 512, sj = (b[j].size + 511) / 512 * 512;
        cr_assert(!(apart && off[i] < off[j] + sj && off[j] < off[i] + si), "seed %llu: blocks %d and %d overlap",
                  (unsigned long long)seed, i, j);
      }
    }
    c = (share_ctx){same, n, 0, b};
    cr_assert_eq(kt_memplan_shared(b, n, 512, share_of, &c, off, &total), KT_OK);
    cr_assert_eq(kt_memplan(b, n, 512, off2, &total2), KT_OK);
    cr_assert_eq(total, total2);
    for (int32_t i = 0; i < n; i++) cr_assert_eq(off[i], off2[i], "seed %llu: block %d", (unsigned long long)seed, i);
    free(off);
    free(off2);
    free(ok);
    free(same);
    free(b);
  }
}
