/* scheduler/src/memplan.c — first-fit offsets for blocks with known lifetimes, best
 * of six orders. O(n^2) an order at worst: each block scans the placed blocks, kept
 * sorted by offset, up to the first gap that holds it. */
#include <stdlib.h>

#include "kitsune/memplan.h"

#define KT_MEMPLAN_MAX_BYTES ((uint64_t)1 << 62)   /* every sum of aligned sizes stays below this */

static uint64_t up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static int valid(const kt_memplan_block *b, int32_t n, uint64_t align) {
  if ((n && !b) || n < 0 || !align || (align & (align - 1)) || align > KT_MEMPLAN_MAX_BYTES) return 0;
  uint64_t sum = 0;
  for (int32_t i = 0; i < n; i++) {
    if (b[i].start >= b[i].end || b[i].size > KT_MEMPLAN_MAX_BYTES) return 0;
    sum += up(b[i].size, align);
    if (sum > KT_MEMPLAN_MAX_BYTES) return 0;
  }
  return 1;
}

/* Orders tried; the smallest arena wins (ties: the earlier order). BY_CONFLICT and
 * BY_SIZE_CONFLICT weigh a block by the bytes of the blocks it must stay apart from
 * (its conflicts): with a share order they found arenas 1.8% (Inception net, 4 streams:
 * 345.4 against 351.7 MiB) and 1.1% (ResNet-18) smaller than the first four on H100
 * captures (tools/capplan_pack.py over bench/results/archive/capplan_2f5a092/). */
enum { BY_SIZE, BY_AREA, BY_LENGTH, BY_START, BY_CONFLICT, BY_SIZE_CONFLICT, KT_MEMPLAN_ORDERS };

typedef struct { double k0; uint64_t k1; int64_t start; int32_t i; } key;

static int by_key(const void *a, const void *b) {   /* k0 desc, k1 desc, start asc, index */
  const key *x = a, *y = b;
  if (x->k0 != y->k0) return x->k0 < y->k0 ? 1 : -1;
  if (x->k1 != y->k1) return x->k1 < y->k1 ? 1 : -1;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return (x->i > y->i) - (x->i < y->i);
}

/* conflict: the bytes of the blocks b must stay apart from (apart() below). */
static key key_of(const kt_memplan_block *b, int32_t i, int order, double conflict) {
  double len = (double)(b->end - b->start), size = (double)b->size;
  switch (order) {
    case BY_AREA: return (key){size * len, b->size, b->start, i};
    case BY_LENGTH: return (key){len, b->size, b->start, i};
    case BY_START: return (key){-(double)b->start, b->size, b->start, i};
    case BY_CONFLICT: return (key){conflict, b->size, b->start, i};
    case BY_SIZE_CONFLICT: return (key){size * conflict, b->size, b->start, i};
    default: return (key){size, 0, b->start, i};
  }
}

/* A placed block's bytes [off, end), i its index. */
typedef struct { uint64_t off, end; int32_t i; } span;

/* Whether blocks i and j may not share bytes: their lifetimes meet, or (with share) the
 * earlier may not be followed by the later, or (without) they are of different groups. */
static int apart(const kt_memplan_block *b, int32_t i, int32_t j, kt_memplan_share_fn share, void *ctx) {
  if (b[j].start < b[i].end && b[i].start < b[j].end) return 1;
  if (!share) return b[j].group != b[i].group;
  return b[i].end <= b[j].start ? !share(ctx, i, j) : !share(ctx, j, i);
}

/* First fit in the given order: each block at the lowest aligned offset where it
 * overlaps no placed block it must stay apart from. The placed blocks are kept in
 * `placed` sorted by offset (an insert each), so a block is one pass over them that
 * stops at the first gap that holds it: O(n^2) an order at worst. Until 2026-11-27
 * each block gathered the placed blocks it stays apart from and sorted them, and
 * planning ResNet-18's 269 recorded blocks within a budget took 0.184 s of its
 * capture phase (three plans, one a bisection over the wait gap; H100,
 * bench/results/archive/models_planned_mode_b_2774d17.json).
 * Returns the arena's bytes. */
static uint64_t first_fit(const kt_memplan_block *b, int32_t n, uint64_t align, kt_memplan_share_fn share,
                          void *ctx, const key *order, span *placed, uint64_t *off) {
  uint64_t arena = 0;
  int32_t m = 0;   /* placed blocks with bytes */
  for (int32_t k = 0; k < n; k++) {
    int32_t i = order[k].i;
    uint64_t size = up(b[i].size, align), at = 0;
    if (!size) {   /* takes no room */
      off[i] = 0;
      continue;
    }
    int32_t q = 0;
    for (; q < m; q++) {   /* by offset: a span at or past at + size leaves the gap below it to i */
      if (at + size <= placed[q].off) break;
      if (placed[q].end > at && apart(b, i, placed[q].i, share, ctx)) at = placed[q].end;
    }
    off[i] = at;   /* at + size <= the sum of all sizes: no overflow (valid) */
    /* insert by offset: after the spans that start at or below at (those the scan passed
     * start below at + size; any starting past at lie at or past q) */
    int32_t pos = q;
    while (pos > 0 && placed[pos - 1].off > at) pos--;
    for (int32_t r = m; r > pos; r--) placed[r] = placed[r - 1];
    placed[pos] = (span){at, at + size, i};
    m++;
    if (at + size > arena) arena = at + size;
  }
  return arena;
}

kt_status kt_memplan(const kt_memplan_block *b, int32_t n, uint64_t align, uint64_t *offsets, uint64_t *total) {
  return kt_memplan_shared(b, n, align, NULL, NULL, offsets, total);
}

kt_status kt_memplan_shared(const kt_memplan_block *b, int32_t n, uint64_t align, kt_memplan_share_fn share, void *ctx,
                            uint64_t *offsets, uint64_t *total) {
  if (!valid(b, n, align) || (n && !offsets) || !total) return KT_ERR_INVALID;
  size_t cap = (size_t)(n ? n : 1);
  key *order = malloc(sizeof *order * cap);
  span *placed = malloc(sizeof *placed * cap);
  uint64_t *off = malloc(sizeof *off * cap), *best = malloc(sizeof *best * cap);
  double *conflict = calloc(cap, sizeof *conflict);
  if (!order || !placed || !off || !best || !conflict) {
    free(order); free(placed); free(off); free(best); free(conflict);
    return KT_ERR_HOST_OOM;
  }
  for (int32_t i = 0; i < n; i++)
    for (int32_t j = i + 1; j < n; j++)
      if (apart(b, i, j, share, ctx)) {
        conflict[i] += (double)up(b[j].size, align);
        conflict[j] += (double)up(b[i].size, align);
      }
  uint64_t arena = UINT64_MAX;
  for (int o = 0; o < KT_MEMPLAN_ORDERS; o++) {
    for (int32_t i = 0; i < n; i++) order[i] = key_of(&b[i], i, o, conflict[i]);
    qsort(order, (size_t)n, sizeof *order, by_key);
    uint64_t a = first_fit(b, n, align, share, ctx, order, placed, off);
    if (a < arena) {
      arena = a;
      for (int32_t i = 0; i < n; i++) best[i] = off[i];
    }
  }
  for (int32_t i = 0; i < n; i++) offsets[i] = best[i];
  *total = arena;   /* first_fit gives 0 for no blocks */
  free(order); free(placed); free(off); free(best); free(conflict);
  return KT_OK;
}

typedef struct { int64_t t; int64_t delta; } change;

static int by_time(const void *a, const void *b) {
  const change *x = a, *y = b;
  if (x->t != y->t) return x->t < y->t ? -1 : 1;
  return (x->delta > y->delta) - (x->delta < y->delta);   /* frees before allocations at one event */
}

kt_status kt_memplan_peak(const kt_memplan_block *b, int32_t n, uint64_t align, uint64_t *peak) {
  if (!valid(b, n, align) || !peak) return KT_ERR_INVALID;
  change *c = malloc(sizeof *c * (size_t)(2 * n + 1));
  if (!c) return KT_ERR_HOST_OOM;
  for (int32_t i = 0; i < n; i++) {
    int64_t s = (int64_t)up(b[i].size, align);
    c[2 * i] = (change){b[i].start, s};
    c[2 * i + 1] = (change){b[i].end, -s};
  }
  qsort(c, (size_t)(2 * n), sizeof *c, by_time);
  int64_t live = 0, most = 0;
  for (int32_t i = 0; i < 2 * n; i++) {
    live += c[i].delta;
    if (live > most) most = live;
  }
  free(c);
  *peak = (uint64_t)most;
  return KT_OK;
}
