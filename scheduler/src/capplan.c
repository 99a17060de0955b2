/* scheduler/src/capplan.c — recording a capture's allocations, planning their
 * layout, and placing a second capture by the plan (kitsune/capplan.h).
 *
 * Everything here runs while a graph is captured, not in the eager hot path, so the
 * structures are plain: a pointer map (open addressing, backward-shift deletion) for
 * live blocks, arrays for the rest, and one linear scan per placement over the
 * blocks already placed in the capture (captures have hundreds to a few thousand
 * allocations).
 */
#include <stdlib.h>
#include <string.h>

#include "kitsune/alloc.h"
#include "kitsune/capplan.h"
#include "kitsune/memplan.h"

/* A plan's arena is reserved from a device pool's backend (kt_pool_backend_create),
 * which hands out multiples of KT_QUANTUM. */
_Static_assert(KT_CAPPLAN_ALIGN % KT_QUANTUM == 0, "a plan's arena is sized in the units a pool backend reserves");

/* ---- pointer -> index map ------------------------------------------------------ */
typedef struct ptrmap {
  uintptr_t *key;   /* 0: empty */
  int32_t *val;
  size_t cap;       /* power of two, or 0 */
  size_t n;
} ptrmap;

static size_t pm_hash(uintptr_t k) {
  uint64_t x = (uint64_t)k;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x;
}

static int32_t pm_get(const ptrmap *m, uintptr_t k) {
  if (!m->cap || !k) return -1;   /* 0 marks an empty slot: never a key */
  for (size_t i = pm_hash(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
    if (m->key[i] == k) return m->val[i];
    if (!m->key[i]) return -1;
  }
}

static void pm_insert(ptrmap *m, uintptr_t k, int32_t v) {   /* room is there; k absent */
  size_t i = pm_hash(k) & (m->cap - 1);
  while (m->key[i]) i = (i + 1) & (m->cap - 1);
  m->key[i] = k;
  m->val[i] = v;
  m->n++;
}

/* Room for one more entry at a load of at most one half. */
static kt_status pm_reserve_one(ptrmap *m) {
  if (2 * (m->n + 1) <= m->cap) return KT_OK;
  size_t cap = m->cap ? 2 * m->cap : 64;
  uintptr_t *key = calloc(cap, sizeof *key);
  int32_t *val = calloc(cap, sizeof *val);
  if (!key || !val) {
    free(key);
    free(val);
    return KT_ERR_HOST_OOM;
  }
  ptrmap grown = {key, val, cap, 0};
  for (size_t i = 0; i < m->cap; i++)
    if (m->key[i]) pm_insert(&grown, m->key[i], m->val[i]);
  free(m->key);
  free(m->val);
  *m = grown;
  return KT_OK;
}

static void pm_delete(ptrmap *m, uintptr_t k) {   /* k present */
  size_t mask = m->cap - 1, i = pm_hash(k) & mask;
  while (m->key[i] != k) i = (i + 1) & mask;
  /* backward shift: pull later entries of the probe run into the hole */
  for (size_t j = (i + 1) & mask; m->key[j]; j = (j + 1) & mask) {
    size_t home = pm_hash(m->key[j]) & mask;
    if (((j - home) & mask) >= ((j - i) & mask)) {   /* home at or before the hole */
      m->key[i] = m->key[j];
      m->val[i] = m->val[j];
      i = j;
    }
  }
  m->key[i] = 0;
  m->n--;
}

static void pm_free(ptrmap *m) {
  free(m->key);
  free(m->val);
  memset(m, 0, sizeof *m);
}

/* Grows *arr (elements of elem bytes, *cap of them) to hold need. */
static kt_status grow(void **arr, int32_t *cap, int32_t need, size_t elem) {
  if (need <= *cap) return KT_OK;
  if (need < 0 || need > INT32_MAX / 2) return KT_ERR_HOST_OOM;
  int32_t c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *p = realloc(*arr, (size_t)c * elem);
  if (!p) return KT_ERR_HOST_OOM;
  *arr = p;
  *cap = c;
  return KT_OK;
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- the captured graph's order -------------------------------------------------- */
/* Node ids noted for blocks: one array, a block holds (first, count) into it. */
typedef struct tokens {
  uint64_t *v;
  int32_t n, cap;
} tokens;

/* Appends the nodes stream's next work depends on. */
static kt_status add_frontier(const kt_capture_order *o, kt_stream_t stream, tokens *t) {
  for (int tries = 0; tries < 2; tries++) {
    kt_status st = grow((void **)&t->v, &t->cap, t->n + 8, sizeof *t->v);
    if (st != KT_OK) return st;
    size_t room = (size_t)(t->cap - t->n), n = 0;
    st = o->frontier(o->ctx, stream, t->v + t->n, room, &n);
    if (st != KT_OK) return st;
    if (n <= room) {
      for (size_t k = 0; k < n; k++)
        if (!t->v[t->n + k]) return KT_ERR_INVALID;
      t->n += (int32_t)n;
      return KT_OK;
    }
    if (n > (size_t)(INT32_MAX / 2 - t->n)) return KT_ERR_HOST_OOM;
    st = grow((void **)&t->v, &t->cap, t->n + (int32_t)n, sizeof *t->v);
    if (st != KT_OK) return st;
  }
  return KT_ERR_UNAVAILABLE;   /* it grew between two calls */
}

/* A snapshot of the graph: each node's predecessors, and marks for "an ancestor of,
 * or one of, the nodes marked last". */
typedef struct capdag {
  ptrmap at;             /* node id -> index */
  int32_t n;
  int32_t *poff, *pred;  /* node k's predecessors: pred[poff[k] .. poff[k + 1]) */
  uint32_t *mark, stamp;
  int32_t *stack;
  size_t edges;          /* the edge count the snapshot was taken at */
  int valid;
} capdag;

static void dag_free(capdag *d) {
  pm_free(&d->at);
  free(d->poff);
  free(d->pred);
  free(d->mark);
  free(d->stack);
  memset(d, 0, sizeof *d);
}

static kt_status dag_index(capdag *d, uint64_t id, int32_t *k) {
  if (!id) return KT_ERR_INVALID;
  *k = pm_get(&d->at, (uintptr_t)id);
  if (*k >= 0) return KT_OK;
  kt_status st = pm_reserve_one(&d->at);
  if (st != KT_OK) return st;
  pm_insert(&d->at, (uintptr_t)id, *k = d->n++);
  return KT_OK;
}

/* Builds d from m edges. */
static kt_status dag_build(capdag *d, const uint64_t *from, const uint64_t *to, size_t m) {
  dag_free(d);
  if (m > (size_t)INT32_MAX / 2) return KT_ERR_HOST_OOM;
  int32_t *ef = malloc((m + 1) * sizeof *ef), *et = malloc((m + 1) * sizeof *et);
  kt_status st = ef && et ? KT_OK : KT_ERR_HOST_OOM;
  for (size_t e = 0; e < m && st == KT_OK; e++) {
    st = dag_index(d, from[e], &ef[e]);
    if (st == KT_OK) st = dag_index(d, to[e], &et[e]);
  }
  if (st == KT_OK) {
    size_t n = (size_t)d->n + 1;
    d->poff = calloc(n + 1, sizeof *d->poff);
    d->pred = malloc((m + 1) * sizeof *d->pred);
    d->mark = calloc(n, sizeof *d->mark);
    d->stack = malloc(n * sizeof *d->stack);
    if (!d->poff || !d->pred || !d->mark || !d->stack) st = KT_ERR_HOST_OOM;
  }
  if (st == KT_OK) {
    for (size_t e = 0; e < m; e++) d->poff[et[e] + 1]++;
    for (int32_t k = 0; k < d->n; k++) d->poff[k + 1] += d->poff[k];
    int32_t *fill = d->stack;   /* as a cursor per node while filling */
    for (int32_t k = 0; k < d->n; k++) fill[k] = d->poff[k];
    for (size_t e = 0; e < m; e++) d->pred[fill[et[e]]++] = ef[e];
    d->valid = 1;
  }
  free(ef);
  free(et);
  if (st != KT_OK) dag_free(d);
  return st;
}

/* Takes the graph's edges when their count (asked with no room: it may include edges
 * the fetch then leaves out) changed since the last snapshot. */
static kt_status dag_snapshot(capdag *d, const kt_capture_order *o) {
  size_t count = 0;
  kt_status st = o->edges(o->ctx, NULL, NULL, 0, &count);
  if (st != KT_OK) return st;
  if (d->valid && count == d->edges) return KT_OK;
  if (count > SIZE_MAX / 16) return KT_ERR_HOST_OOM;
  uint64_t *from = malloc((count + 1) * sizeof *from), *to = malloc((count + 1) * sizeof *to);
  size_t got = 0;
  st = from && to ? o->edges(o->ctx, from, to, count, &got) : KT_ERR_HOST_OOM;
  if (st == KT_OK && got > count) st = KT_ERR_UNAVAILABLE;   /* it grew between the calls */
  if (st == KT_OK) st = dag_build(d, from, to, got);
  if (st == KT_OK) d->edges = count;
  free(from);
  free(to);
  return st;
}

/* Marks the ancestors of nodes (and nodes). */
static void dag_mark(capdag *d, const uint64_t *nodes, int32_t nn) {
  if (!d->valid) return;
  if (++d->stamp == 0) {
    memset(d->mark, 0, (size_t)d->n * sizeof *d->mark);
    d->stamp = 1;
  }
  int32_t sp = 0;
  for (int32_t i = 0; i < nn; i++) {
    int32_t k = pm_get(&d->at, (uintptr_t)nodes[i]);
    if (k >= 0 && d->mark[k] != d->stamp) {
      d->mark[k] = d->stamp;
      d->stack[sp++] = k;
    }
  }
  while (sp) {
    int32_t k = d->stack[--sp];
    for (int32_t e = d->poff[k]; e < d->poff[k + 1]; e++) {
      int32_t q = d->pred[e];
      if (d->mark[q] != d->stamp) {
        d->mark[q] = d->stamp;
        d->stack[sp++] = q;
      }
    }
  }
}

/* Whether every node of before[] is one of marked[] (the last dag_mark's) or an
 * ancestor of one: whatever ran up to before[] is done when marked[]'s dependents start. */
static int dag_covers(const capdag *d, const uint64_t *marked, int32_t nm, const uint64_t *before, int32_t nb) {
  for (int32_t i = 0; i < nb; i++) {
    int found = 0;
    for (int32_t j = 0; j < nm && !found; j++) found = before[i] == marked[j];
    if (found) continue;
    if (!d->valid) return 0;
    int32_t k = pm_get(&d->at, (uintptr_t)before[i]);
    if (k < 0 || d->mark[k] != d->stamp) return 0;
  }
  return 1;
}

/* Copies an order (NULL: none) after checking it. */
static kt_status set_order(kt_capture_order *dst, const kt_capture_order *o) {
  if (o && (!o->frontier || !o->edges)) return KT_ERR_INVALID;
  if (o) *dst = *o;
  else memset(dst, 0, sizeof *dst);
  return KT_OK;
}

/* What a recorded or placed block notes for the order: the streams it was on and its
 * streams' frontiers at its free. Used on another stream: nuse > 1. */
typedef struct noted {
  kt_stream_t use[KT_CAPPLAN_STREAMS];   /* its stream, then the others it was used on */
  uint8_t nuse;
  uint8_t unordered;     /* no order noted for it (none given, a frontier missing, too many streams) */
  int32_t ff, nff;       /* tokens: its streams' frontiers at the free */
} noted;

static void note_use(noted *b, kt_stream_t s) {
  for (uint8_t i = 0; i < b->nuse; i++)
    if (b->use[i] == s) return;
  if (b->nuse == KT_CAPPLAN_STREAMS) b->unordered = 1;
  else b->use[b->nuse++] = s;
}

/* Notes the frontiers of b's streams at its free (none without an order). */
static void note_free(const kt_capture_order *o, noted *b, tokens *t) {
  b->ff = t->n;
  b->nff = 0;
  if (b->unordered || !o->frontier) {
    b->unordered = 1;
    return;
  }
  for (uint8_t i = 0; i < b->nuse; i++)
    if (add_frontier(o, b->use[i], t) != KT_OK) {
      t->n = b->ff;
      b->unordered = 1;
      return;
    }
  b->nff = t->n - b->ff;
}

/* ---- recording ----------------------------------------------------------------- */
#define REC_LIVE INT64_MIN

typedef struct rec_block {
  uint64_t size;
  kt_stream_t stream;
  int64_t start, end;    /* end: REC_LIVE while live */
  uint8_t after;         /* freed after the capture ended */
  noted o;
  int32_t af, naf;       /* tokens: its stream's frontier at the allocation */
} rec_block;

struct kt_caprec {
  rec_block *b;
  int32_t n, cap;
  int64_t t;             /* events so far: allocations and frees during the capture */
  int ended;
  int32_t freed_after;
  ptrmap live;
  kt_capture_order ord;  /* ord.frontier NULL: none */
  tokens tok;
  capdag dag;            /* the graph, taken at the end */
  ptrmap timed;          /* node id -> index into times (kt_caprec_set_times) */
  int64_t *times;        /* when each timed node finished, ns */
};

kt_status kt_caprec_create(kt_caprec **out) {
  if (!out) return KT_ERR_INVALID;
  kt_caprec *r = calloc(1, sizeof *r);
  if (!r) return KT_ERR_HOST_OOM;
  *out = r;
  return KT_OK;
}

void kt_caprec_destroy(kt_caprec *r) {
  if (!r) return;
  pm_free(&r->live);
  pm_free(&r->timed);
  free(r->times);
  dag_free(&r->dag);
  free(r->tok.v);
  free(r->b);
  free(r);
}

kt_status kt_caprec_set_order(kt_caprec *r, const kt_capture_order *o) {
  return r ? set_order(&r->ord, o) : KT_ERR_INVALID;
}

kt_status kt_caprec_alloc(kt_caprec *r, const void *ptr, size_t size, kt_stream_t stream) {
  if (!r || (size && !ptr)) return KT_ERR_INVALID;
  if (!size) return KT_OK;
  uintptr_t k = (uintptr_t)ptr;
  if (pm_get(&r->live, k) >= 0) return KT_ERR_INVALID;
  kt_status st = grow((void **)&r->b, &r->cap, r->n + 1, sizeof *r->b);
  if (st == KT_OK) st = pm_reserve_one(&r->live);
  if (st != KT_OK) return st;
  rec_block *b = &r->b[r->n];
  *b = (rec_block){.size = round_up(size, KT_CAPPLAN_ALIGN), .stream = stream, .start = r->t++, .end = REC_LIVE};
  b->o.use[b->o.nuse++] = stream;
  b->af = r->tok.n;
  b->o.unordered = !r->ord.frontier || r->ended || add_frontier(&r->ord, stream, &r->tok) != KT_OK;
  b->naf = b->o.unordered ? 0 : r->tok.n - b->af;
  if (b->o.unordered) r->tok.n = b->af;
  pm_insert(&r->live, k, r->n++);
  return KT_OK;
}

kt_status kt_caprec_free(kt_caprec *r, const void *ptr) {
  if (!r) return KT_ERR_INVALID;
  int32_t i = pm_get(&r->live, (uintptr_t)ptr);
  if (i < 0) return KT_ERR_INVALID;
  pm_delete(&r->live, (uintptr_t)ptr);
  if (r->ended) {
    r->b[i].after = 1;
    r->b[i].end = r->t;
    r->freed_after++;
  } else {
    r->b[i].end = r->t++;
    note_free(&r->ord, &r->b[i].o, &r->tok);
  }
  return KT_OK;
}

kt_status kt_caprec_use(kt_caprec *r, const void *ptr, kt_stream_t stream) {
  if (!r) return KT_ERR_INVALID;
  int32_t i = pm_get(&r->live, (uintptr_t)ptr);
  if (i < 0) return KT_ERR_INVALID;
  note_use(&r->b[i].o, stream);
  return KT_OK;
}

kt_status kt_caprec_end(kt_caprec *r) {
  if (!r) return KT_ERR_INVALID;
  if (!r->ended && r->ord.edges && dag_snapshot(&r->dag, &r->ord) != KT_OK) dag_free(&r->dag);
  r->ended = 1;
  return KT_OK;
}

kt_status kt_caprec_set_times(kt_caprec *r, const uint64_t *nodes, const int64_t *finish_ns, size_t n) {
  if (!r || (n && (!nodes || !finish_ns)) || n > (size_t)INT32_MAX / 4) return KT_ERR_INVALID;
  ptrmap m = {0};
  int64_t *v = malloc((n + 1) * sizeof *v);
  kt_status st = v ? KT_OK : KT_ERR_HOST_OOM;
  for (size_t k = 0; k < n && st == KT_OK; k++) {
    if (!nodes[k] || pm_get(&m, (uintptr_t)nodes[k]) >= 0) st = KT_ERR_INVALID;   /* 0 or a duplicate */
    if (st == KT_OK) st = pm_reserve_one(&m);
    if (st == KT_OK) {
      v[k] = finish_ns[k];
      pm_insert(&m, (uintptr_t)nodes[k], (int32_t)k);
    }
  }
  if (st != KT_OK) {
    pm_free(&m);
    free(v);
    return st;
  }
  pm_free(&r->timed);
  free(r->times);
  r->timed = m;
  r->times = v;
  return KT_OK;
}

kt_status kt_caprec_get_info(const kt_caprec *r, kt_caprec_info *out) {
  if (!r || !out) return KT_ERR_INVALID;
  out->blocks = r->n;
  out->live = (int32_t)r->live.n;
  out->freed_after = r->freed_after;
  return KT_OK;
}

kt_status kt_caprec_get_block(const kt_caprec *r, int32_t i, kt_caprec_block *out) {
  if (!r || !out || i < 0 || i >= r->n) return KT_ERR_INVALID;
  const rec_block *b = &r->b[i];
  *out = (kt_caprec_block){b->size, b->stream, b->start, b->end == REC_LIVE ? -1 : b->end, b->after,
                           b->o.nuse - 1, b->o.unordered};
  return KT_OK;
}

/* ---- the plan ------------------------------------------------------------------- */
struct kt_capplan {
  int32_t n;
  uint64_t *size, *off;
  kt_capplan_info info;
};

void kt_capplan_destroy(kt_capplan *p) {
  if (!p) return;
  free(p->size);
  free(p->off);
  free(p);
}

/* The kt_memplan group of stream s: its index among the streams seen so far, which
 * it joins when new. Streams are few. */
static int32_t stream_group(kt_stream_t s, kt_stream_t *seen, int32_t *nseen) {
  for (int32_t g = 0; g < *nseen; g++)
    if (seen[g] == s) return g;
  seen[*nseen] = s;
  return (*nseen)++;
}

/* Sum over groups of each group's live peak: blocks of different groups never share an
 * address, so the groups' footprints are disjoint and each holds at least its peak. */
static kt_status sum_group_peaks(const kt_memplan_block *mb, int32_t n, int32_t groups, uint64_t *out) {
  kt_memplan_block *g = malloc(((size_t)n + 1) * sizeof *g);
  if (!g) return KT_ERR_HOST_OOM;
  uint64_t sum = 0;
  kt_status st = KT_OK;
  for (int32_t k = 0; k < groups && st == KT_OK; k++) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
      if (mb[i].group == k) g[m++] = mb[i];
    uint64_t peak = 0;
    st = kt_memplan_peak(g, m, KT_CAPPLAN_ALIGN, &peak);
    sum += peak;
  }
  free(g);
  *out = sum;
  return st;
}

/* Which planned blocks may follow which: bit (i, j) set when block i, whose life ends
 * at or before block j's starts, may share bytes with j. */
typedef struct order_bits {
  uint64_t *bits;
  int32_t n;
} order_bits;

static int order_bit(const order_bits *o, int32_t i, int32_t j) {
  size_t k = (size_t)i * (size_t)o->n + (size_t)j;
  return (int)((o->bits[k / 64] >> (k % 64)) & 1);
}

static int order_share(void *ctx, int32_t i, int32_t j) { return order_bit(ctx, i, j); }

/* What a plan with waits lets share: the order's pairs, and those where the earlier
 * block may be waited for (waitable[i]) and the later one is at least gap after it:
 * in recorded events from i's free to j's allocation, or (by_slack) in ns of slack a
 * wait of j's stream on i's work has in a replay of the recorded graph without it
 * (kt_caprec_set_times): from when the work i's streams had reached at its free
 * finished to when the work j's stream had reached at its allocation finished. */
typedef struct wait_share {
  const order_bits *ob;
  const kt_memplan_block *mb;
  const uint8_t *waitable;
  const int64_t *freed, *ready;   /* per planned block, ns; NULL: no node times */
  int by_slack;
  int64_t gap;
} wait_share;

static int64_t wait_metric(const wait_share *w, int32_t i, int32_t j) {
  return w->by_slack ? w->ready[j] - w->freed[i] : w->mb[j].start - w->mb[i].end;
}

static int waited(const wait_share *w, int32_t i, int32_t j) {
  return w->waitable[i] && w->waitable[j] && wait_metric(w, i, j) >= w->gap;
}

static int share_or_wait(void *ctx, int32_t i, int32_t j) {
  const wait_share *w = ctx;
  return order_bit(w->ob, i, j) || waited(w, i, j);
}

/* Fills o for the planned blocks (src[j]: planned block j's rec_block) from the
 * recorded graph; counts in *cross the pairs only the graph lets share. */
static kt_status order_fill(const kt_caprec *r, const int32_t *src, const kt_memplan_block *mb, int32_t n,
                            order_bits *o, int32_t *cross) {
  size_t words = ((size_t)n * (size_t)n + 63) / 64;
  /* the recording's graph with marks of its own: the recording is not changed */
  capdag dag = r->dag;
  dag.mark = calloc((size_t)dag.n + 1, sizeof *dag.mark);
  dag.stack = malloc(((size_t)dag.n + 1) * sizeof *dag.stack);
  dag.stamp = 0;
  o->bits = calloc(words ? words : 1, sizeof *o->bits);
  if (!o->bits || !dag.mark || !dag.stack) {
    free(dag.mark);
    free(dag.stack);
    return KT_ERR_HOST_OOM;
  }
  o->n = n;
  *cross = 0;
  for (int32_t j = 0; j < n; j++) {
    const rec_block *bj = &r->b[src[j]];
    int marked = 0;
    for (int32_t i = 0; i < n; i++) {
      const rec_block *bi = &r->b[src[i]];
      if (i == j || mb[i].end > mb[j].start) continue;
      int ok = bi->o.nuse == 1 && !bi->after && bi->stream == bj->stream;   /* stream order */
      if (!ok && !bi->after && !bi->o.unordered && !bj->o.unordered) {
        if (!marked) {
          dag_mark(&dag, r->tok.v + bj->af, bj->naf);
          marked = 1;
        }
        ok = dag_covers(&dag, r->tok.v + bj->af, bj->naf, r->tok.v + bi->o.ff, bi->o.nff);
        *cross += ok;
      }
      if (ok) {
        size_t k = (size_t)i * (size_t)n + (size_t)j;
        o->bits[k / 64] |= (uint64_t)1 << (k % 64);
      }
    }
  }
  free(dag.mark);
  free(dag.stack);
  return KT_OK;
}

/* The planned blocks of r (those freed), as kt_memplan blocks, and src[j]: planned
 * block j's rec_block; *groups: the streams seen. */
static void plan_blocks(const kt_caprec *r, int ordered, kt_memplan_block *mb, int32_t *src, kt_stream_t *seen,
                        int32_t *groups) {
  int32_t nseen = 0;
  int64_t end = r->t + 1;
  for (int32_t i = 0, j = 0; i < r->n; i++) {
    const rec_block *b = &r->b[i];
    if (b->end == REC_LIVE) continue;
    int32_t g = stream_group(b->stream, seen, &nseen);
    /* without the graph, bytes are shared only within a stream (stream order covers
     * the reuse), and not after a use on another stream */
    mb[j] = (kt_memplan_block){b->size, b->start, b->after || (b->o.nuse > 1 && !ordered) ? end : b->end, g};
    src[j++] = i;
  }
  *groups = nseen;
}

static int32_t planned_count(const kt_caprec *r) {
  int32_t n = 0;
  for (int32_t i = 0; i < r->n; i++) n += r->b[i].end != REC_LIVE;
  return n;
}

static int plan_ordered(const kt_caprec *r, int32_t n) { return r->dag.valid && n <= KT_CAPPLAN_ORDER_MAX_BLOCKS; }

/* *out: when the latest of nodes (count tokens from first) finished, ns; 0 (the
 * graph's start) for none. 0 returned when a node has no time. */
static int latest(const kt_caprec *r, int32_t first, int32_t count, int64_t *out) {
  int64_t t = 0;
  for (int32_t k = 0; k < count; k++) {
    int32_t x = pm_get(&r->timed, (uintptr_t)r->tok.v[first + k]);
    if (x < 0) return 0;
    if (r->times[x] > t) t = r->times[x];
  }
  *out = t;
  return 1;
}

/* With node times for every node the waitable blocks' frontiers name: w->freed and
 * w->ready. Else they stay NULL. */
static kt_status time_blocks(const kt_caprec *r, const int32_t *src, int32_t n, wait_share *w) {
  if (!r->timed.n) return KT_OK;
  int64_t *freed = malloc(((size_t)n + 1) * sizeof *freed), *ready = malloc(((size_t)n + 1) * sizeof *ready);
  if (!freed || !ready) {
    free(freed);
    free(ready);
    return KT_ERR_HOST_OOM;
  }
  int ok = 1;
  for (int32_t j = 0; j < n && ok; j++) {
    const rec_block *b = &r->b[src[j]];
    freed[j] = ready[j] = 0;
    if (w->waitable[j]) ok = latest(r, b->o.ff, b->o.nff, &freed[j]) && latest(r, b->af, b->naf, &ready[j]);
  }
  if (!ok) {   /* a node without a time (not of the timed graph): none */
    free(freed);
    free(ready);
    return KT_OK;
  }
  w->freed = freed;
  w->ready = ready;
  return KT_OK;
}

/* Whether blocks i and j overlap in a packing. */
static int overlap(const kt_memplan_block *mb, const uint64_t *off, int32_t i, int32_t j) {
  return off[i] < off[j] + round_up(mb[j].size, KT_CAPPLAN_ALIGN) &&
         off[j] < off[i] + round_up(mb[i].size, KT_CAPPLAN_ALIGN);
}

/* A packing's delay in the timed replay, to first order: for each block j laid over
 * an earlier block only a wait orders before it, how long after j's stream reached
 * j's allocation the latest work that used such a block finished (what the placer's
 * wait at j makes it wait; the delay is not carried on to later work). */
static int64_t packing_delay(const wait_share *w, const uint64_t *off, int32_t n) {
  int64_t sum = 0;
  for (int32_t j = 0; j < n; j++) {
    int64_t need = INT64_MIN;
    for (int32_t i = 0; i < n; i++)
      if (i != j && w->mb[i].end <= w->mb[j].start && !order_bit(w->ob, i, j) && overlap(w->mb, off, i, j) &&
          w->freed[i] > need)
        need = w->freed[i];
    if (need > w->ready[j]) sum += need - w->ready[j];
  }
  return sum;
}

/* The plan a search (search_waits) keeps: its share rule, extent, and with node times
 * its packing_delay. */
typedef struct wait_pick {
  int found, by_slack;
  int64_t gap, delay;
  uint64_t total;
} wait_pick;

/* Bisection for the largest threshold (w->gap) on w's metric whose packing fits budget,
 * over [lo, hi) (lo: every waitable pair; hi: none); the packings need not shrink
 * monotonically as the threshold rises, so only packings seen to fit are kept. Without
 * node times the pick is the fitting packing of the largest threshold; with them,
 * every fitting packing probed is a candidate and the pick is the one of least
 * packing_delay (then extent), against *pick's from an earlier search too. Its
 * offsets go to off. */
static kt_status search_waits(wait_share *w, const kt_memplan_block *mb, int32_t n, uint64_t budget, int64_t lo,
                              int64_t hi, uint64_t *trial, uint64_t *off, wait_pick *pick) {
  int first = 1;
  while (first || hi - lo > 1) {
    w->gap = first ? lo : lo + (hi - lo) / 2;
    uint64_t got = 0;
    kt_status st = kt_memplan_shared(mb, n, KT_CAPPLAN_ALIGN, share_or_wait, w, trial, &got);
    if (st != KT_OK) return st;
    int fits = got <= budget;
    if (fits) {
      int64_t delay = w->freed ? packing_delay(w, trial, n) : 0;
      int better = !pick->found || !w->freed || delay < pick->delay || (delay == pick->delay && got < pick->total);
      if (better) {
        *pick = (wait_pick){1, w->by_slack, w->gap, delay, got};
        memcpy(off, trial, (size_t)n * sizeof *off);
      }
    }
    if (first) {
      if (!fits) return KT_OK;   /* not even every waitable pair: no waits this way */
      first = 0;
      continue;
    }
    if (fits) lo = w->gap;
    else hi = w->gap;
  }
  return KT_OK;
}

/* The least and one past the most slack of the pairs a wait would let share. */
static void slack_range(const wait_share *w, int32_t n, int64_t *lo, int64_t *hi) {
  int64_t least = INT64_MAX, most = INT64_MIN;
  for (int32_t i = 0; i < n; i++)
    for (int32_t j = 0; j < n; j++)
      if (i != j && w->mb[i].end <= w->mb[j].start && w->waitable[i] && w->waitable[j] && !order_bit(w->ob, i, j)) {
        int64_t m = w->ready[j] - w->freed[i];
        if (m < least) least = m;
        if (m > most) most = m;
      }
  *lo = least == INT64_MAX ? 0 : least;
  *hi = least == INT64_MAX ? 1 : most + 1;
}

/* The plan with waits (kt_capplan_create_within), when its extent without them,
 * *total, passes budget. Pairs are bought from the far end: those at least a
 * threshold of recorded events apart, the largest threshold whose packing fits
 * (search_waits). With node times, also those with at least a threshold of slack, and
 * the plan kept is the one of least packing_delay among the fitting packings either
 * search probed: a threshold alone on slack bought pairs one event apart on the
 * branchy net at batch 8 (0.467 and 0.481 ms a step against 0.434 by events) and
 * gained on ResNet-18 (1.212 and 1.221 against 1.262; H100, both in
 * bench/results/archive/models_variants_timed_2459f4d.json). The first-order delay is summed
 * over blocks and does not see which stream is critical: chosen by it, the branchy
 * net took 0.482 ms in one process of three (0.434 and 0.436 in the others;
 * models_variants_timed_17f224d.json), so compile_step times a recording only when
 * asked (KITSUNE_PLAN_WAITS=timed). When not even every waitable
 * pair fits, no waits: each orders one stream after another's work, and buying them
 * for bytes that still miss the budget cost ResNet-18's planned step 18% (23 waits
 * for 1.5 MiB of 88.6; 1.391 ms a step against 1.177 without a plan, H100,
 * bench/results/archive/models_planned_mode_b_60f753b.json). off and *total are replaced
 * only by a smaller plan that fits. Out: the fewest recorded events between a waited
 * pair (-1: no waits), their count, whether node times chose the plan (1), its pairs
 * by slack (then the least slack of one, ns; else INT64_MIN) and its packing_delay. */
static kt_status fit_with_waits(const kt_caprec *r, const int32_t *src, const kt_memplan_block *mb, int32_t n,
                                const order_bits *ob, uint64_t budget, uint64_t *off, uint64_t *total,
                                kt_capplan_info *out) {
  out->wait_gap = -1;
  out->wait_slack_ns = INT64_MIN;
  out->wait_delay_ns = 0;
  out->wait_shares = out->wait_timed = out->wait_by_slack = 0;
  uint8_t *waitable = calloc((size_t)n + 1, 1);
  uint64_t *trial = malloc(((size_t)n + 1) * sizeof *trial), *best = malloc(((size_t)n + 1) * sizeof *best);
  kt_status st = waitable && trial && best ? KT_OK : KT_ERR_HOST_OOM;
  for (int32_t j = 0; j < n && st == KT_OK; j++) {
    const rec_block *b = &r->b[src[j]];
    waitable[j] = !b->after && !b->o.unordered;
  }
  wait_share w = {ob, mb, waitable, NULL, NULL, 0, 0};
  wait_pick pick = {0};
  if (st == KT_OK) st = time_blocks(r, src, n, &w);
  if (st == KT_OK) st = search_waits(&w, mb, n, budget, 0, r->t + 1, trial, best, &pick);
  if (st == KT_OK && w.freed) {
    int64_t lo = 0, hi = 1;
    slack_range(&w, n, &lo, &hi);
    w.by_slack = 1;
    st = search_waits(&w, mb, n, budget, lo, hi, trial, best, &pick);
  }
  if (st == KT_OK && pick.found && pick.total < *total) {
    memcpy(off, best, (size_t)n * sizeof *off);
    *total = pick.total;
    w.by_slack = pick.by_slack;
    w.gap = pick.gap;
    out->wait_timed = w.freed != NULL;
    out->wait_by_slack = pick.by_slack;
    out->wait_delay_ns = pick.delay;
    int64_t least = INT64_MAX, slack = INT64_MAX;   /* the fewest events, least slack, of a waited pair */
    for (int32_t i = 0; i < n; i++)
      for (int32_t j = 0; j < n; j++)
        if (i != j && mb[i].end <= mb[j].start && !order_bit(ob, i, j) && waited(&w, i, j)) {
          out->wait_shares++;
          if (mb[j].start - mb[i].end < least) least = mb[j].start - mb[i].end;
          if (pick.by_slack && wait_metric(&w, i, j) < slack) slack = wait_metric(&w, i, j);
        }
    out->wait_gap = out->wait_shares ? least : -1;
    out->wait_slack_ns = pick.by_slack && out->wait_shares ? slack : INT64_MIN;
  }
  free((void *)w.freed);
  free((void *)w.ready);
  free(waitable);
  free(trial);
  free(best);
  return st;
}

kt_status kt_capplan_create(const kt_caprec *r, kt_capplan **out) { return kt_capplan_create_within(r, UINT64_MAX, out); }

kt_status kt_capplan_create_within(const kt_caprec *r, uint64_t budget, kt_capplan **out) {
  if (!r || !out) return KT_ERR_INVALID;
  int32_t n = planned_count(r);
  int ordered = plan_ordered(r, n);
  kt_capplan *p = calloc(1, sizeof *p);
  kt_memplan_block *mb = malloc(((size_t)n + 1) * sizeof *mb);
  kt_stream_t *seen = malloc(((size_t)n + 1) * sizeof *seen);
  int32_t *src = malloc(((size_t)n + 1) * sizeof *src);
  if (p) {
    p->size = malloc(((size_t)n + 1) * sizeof *p->size);
    p->off = malloc(((size_t)n + 1) * sizeof *p->off);
  }
  if (!p || !mb || !seen || !src || !p->size || !p->off) {
    free(mb);
    free(seen);
    free(src);
    kt_capplan_destroy(p);
    return KT_ERR_HOST_OOM;
  }
  int32_t nseen = 0;
  plan_blocks(r, ordered, mb, src, seen, &nseen);
  for (int32_t j = 0; j < n; j++) p->size[j] = mb[j].size;
  free(seen);
  order_bits ob = {NULL, 0};
  int32_t cross = 0;
  uint64_t total = 0, peak = 0, group_peak = 0;
  kt_status st = ordered ? order_fill(r, src, mb, n, &ob, &cross) : KT_OK;
  if (st == KT_OK)
    st = kt_memplan_shared(mb, n, KT_CAPPLAN_ALIGN, ordered ? order_share : NULL, &ob, p->off, &total);
  uint64_t unwaited = total;
  kt_capplan_info waits = {.wait_gap = -1, .wait_slack_ns = INT64_MIN};
  if (st == KT_OK) st = kt_memplan_peak(mb, n, KT_CAPPLAN_ALIGN, &peak);
  /* a live peak past the budget: no plan meets it, so no waits (fit_with_waits) */
  if (st == KT_OK && total > budget && peak <= budget && ordered && n <= KT_CAPPLAN_WAIT_MAX_BLOCKS)
    st = fit_with_waits(r, src, mb, n, &ob, budget, p->off, &total, &waits);
  if (st == KT_OK) st = sum_group_peaks(mb, n, nseen, &group_peak);
  free(ob.bits);
  free(mb);
  free(src);
  if (st != KT_OK) {
    kt_capplan_destroy(p);
    return st;
  }
  p->n = n;
  p->info = waits;   /* the wait_* fields */
  p->info.blocks = n;
  p->info.arena_bytes = p->info.plan_bytes = (size_t)total;
  p->info.peak_bytes = (size_t)peak;
  p->info.group_peak_bytes = (size_t)group_peak;
  p->info.graph_nodes = ordered ? r->dag.n : 0;
  p->info.cross_shares = cross;
  p->info.budget = budget;
  p->info.unwaited_bytes = (size_t)unwaited;
  *out = p;
  return KT_OK;
}

kt_status kt_caprec_share_matrix(const kt_caprec *r, int32_t n, uint64_t *bits) {
  if (!r || !bits || n != planned_count(r)) return KT_ERR_INVALID;
  int ordered = plan_ordered(r, n);
  kt_memplan_block *mb = malloc(((size_t)n + 1) * sizeof *mb);
  kt_stream_t *seen = malloc(((size_t)n + 1) * sizeof *seen);
  int32_t *src = malloc(((size_t)n + 1) * sizeof *src);
  order_bits ob = {NULL, 0};
  kt_status st = mb && seen && src ? KT_OK : KT_ERR_HOST_OOM;
  int32_t groups = 0, cross = 0;
  if (st == KT_OK) plan_blocks(r, ordered, mb, src, seen, &groups);
  if (st == KT_OK && ordered) st = order_fill(r, src, mb, n, &ob, &cross);
  if (st == KT_OK) {
    memset(bits, 0, ((size_t)n * (size_t)n + 63) / 64 * sizeof *bits);
    for (int32_t i = 0; i < n; i++)
      for (int32_t j = 0; j < n; j++) {
        if (i == j || mb[i].end > mb[j].start) continue;
        if (ordered ? order_share(&ob, i, j) : mb[i].group == mb[j].group) {
          size_t k = (size_t)i * (size_t)n + (size_t)j;
          bits[k / 64] |= (uint64_t)1 << (k % 64);
        }
      }
  }
  free(ob.bits);
  free(mb);
  free(seen);
  free(src);
  return st;
}

kt_status kt_capplan_get_block(const kt_capplan *p, int32_t j, uint64_t *offset, uint64_t *size) {
  if (!p || !offset || !size || j < 0 || j >= p->n) return KT_ERR_INVALID;
  *offset = p->off[j];
  *size = p->size[j];
  return KT_OK;
}

kt_status kt_capplan_get_info(const kt_capplan *p, kt_capplan_info *out) {
  if (!p || !out) return KT_ERR_INVALID;
  *out = p->info;
  return KT_OK;
}

/* ---- placing --------------------------------------------------------------------- */
typedef struct pl_arena {
  uintptr_t base;
  size_t bytes;
  int64_t live;            /* blocks of it live, any capture's */
  struct pl_arena *next;   /* retired list */
} pl_arena;

enum { PL_UNPLACED = 0, PL_LIVE = 1, PL_FREED = 2 };

typedef struct pl_block {  /* a planned block of the capture being placed */
  uint64_t off, size;
  kt_stream_t stream;      /* where it was placed */
  uint8_t state;
  noted o;
} pl_block;

typedef struct pl_live {   /* a live block of any capture */
  uint64_t size;
  pl_arena *arena;
  uint32_t epoch;          /* the capture that placed it */
  int32_t idx;             /* its pl_block in that capture; free-list link when unused */
} pl_live;

struct kt_placer {
  const kt_backend *be;
  int device;
  pl_arena *cur, *retired;
  pl_block *blk;           /* the capture being placed (the last begun) */
  int32_t n, cursor;
  int active;
  uint32_t epoch;
  ptrmap map;              /* block address -> lv index */
  pl_live *lv;
  int32_t nlv, caplv, lv_free;
  size_t live_bytes;
  int64_t live_blocks;
  int32_t placed, refused;
  size_t plan_bytes, peak_bytes;
  kt_capture_order ord;    /* ord.frontier NULL: none */
  tokens tok;              /* the capture being placed's */
  tokens front;            /* the frontier a placement is checked at */
  tokens need;             /* the nodes a placement makes its stream wait for */
  capdag dag;              /* the capture's graph as far as the last check */
  int may_wait;            /* the plan has waits and the order can add them */
  int32_t waits;
};

kt_status kt_placer_create(const kt_backend *be, int device, kt_placer **out) {
  if (!be || !be->reserve || !be->release || !out) return KT_ERR_INVALID;
  kt_placer *pl = calloc(1, sizeof *pl);
  if (!pl) return KT_ERR_HOST_OOM;
  pl->be = be;
  pl->device = device;
  pl->lv_free = -1;
  *out = pl;
  return KT_OK;
}

static kt_status arena_release(kt_placer *pl, pl_arena *a) {
  kt_status st = pl->be->release(pl->be->ctx, pl->device, (void *)a->base, a->bytes);
  if (st == KT_OK) free(a);
  return st;
}

void kt_placer_destroy(kt_placer *pl) {
  if (!pl) return;
  pl_arena *a = pl->retired;
  while (a) {
    pl_arena *next = a->next;
    pl->be->release(pl->be->ctx, pl->device, (void *)a->base, a->bytes);
    free(a);
    a = next;
  }
  if (pl->cur) {
    pl->be->release(pl->be->ctx, pl->device, (void *)pl->cur->base, pl->cur->bytes);
    free(pl->cur);
  }
  pm_free(&pl->map);
  dag_free(&pl->dag);
  free(pl->tok.v);
  free(pl->front.v);
  free(pl->need.v);
  free(pl->lv);
  free(pl->blk);
  free(pl);
}

kt_status kt_placer_set_order(kt_placer *pl, const kt_capture_order *o) {
  return pl ? set_order(&pl->ord, o) : KT_ERR_INVALID;
}

kt_status kt_placer_trim(kt_placer *pl) {
  if (!pl) return KT_ERR_INVALID;
  kt_status ret = KT_OK;
  for (pl_arena **pa = &pl->retired; *pa;) {
    pl_arena *a = *pa;
    if (a->live) {
      pa = &a->next;
      continue;
    }
    *pa = a->next;
    kt_status st = arena_release(pl, a);
    if (st != KT_OK) {   /* keep it listed; try again next time */
      a->next = *pa;
      *pa = a;
      pa = &a->next;
      ret = st;
    }
  }
  return ret;
}

kt_status kt_placer_begin(kt_placer *pl, const kt_capplan *plan) {
  if (!pl || !plan) return KT_ERR_INVALID;
  pl->active = 0;
  pl_block *blk = calloc((size_t)plan->n + 1, sizeof *blk);
  if (!blk) return KT_ERR_HOST_OOM;
  size_t q = pl->be->reserve_quantum ? pl->be->reserve_quantum : KT_SEGMENT_ALIGN;
  size_t need = (plan->info.arena_bytes + q - 1) / q * q;   /* what the backend takes */
  if (need && (!pl->cur || pl->cur->bytes < need)) {
    pl_arena *a = calloc(1, sizeof *a);
    void *base = NULL;
    kt_status st = a ? pl->be->reserve(pl->be->ctx, pl->device, need, &base) : KT_ERR_HOST_OOM;
    if (st != KT_OK) {
      free(a);
      free(blk);
      return st;
    }
    a->base = (uintptr_t)base;
    a->bytes = need;
    if (pl->cur) {   /* retire it; trim releases it now if nothing in it is live */
      pl->cur->next = pl->retired;
      pl->retired = pl->cur;
    }
    pl->cur = a;
  }
  kt_placer_trim(pl);   /* best effort: a failed release keeps the arena listed */
  for (int32_t i = 0; i < plan->n; i++) blk[i] = (pl_block){.off = plan->off[i], .size = plan->size[i]};
  free(pl->blk);
  pl->blk = blk;
  pl->n = plan->n;
  pl->cursor = 0;
  pl->epoch++;
  pl->placed = pl->refused = pl->waits = 0;
  pl->may_wait = plan->info.wait_shares > 0 && pl->ord.wait != NULL;
  pl->tok.n = 0;
  dag_free(&pl->dag);   /* another capture's graph */
  pl->plan_bytes = plan->info.plan_bytes;
  pl->peak_bytes = plan->info.peak_bytes;
  pl->active = 1;
  return KT_OK;
}

void kt_placer_end(kt_placer *pl) {
  if (pl) pl->active = 0;
}

/* Marks what stream's next work will follow in the capture's graph: 0 when that
 * cannot be had. */
static int mark_frontier(kt_placer *pl, kt_stream_t stream) {
  pl->front.n = 0;
  if (add_frontier(&pl->ord, stream, &pl->front) != KT_OK) return 0;
  if (dag_snapshot(&pl->dag, &pl->ord) != KT_OK) {
    dag_free(&pl->dag);   /* dag_covers then only knows equal nodes */
  }
  dag_mark(&pl->dag, pl->front.v, pl->front.n);
  return 1;
}

/* Appends to pl->need the nodes of b's frontiers at its free that stream's marked
 * frontier does not follow yet (once each). */
static kt_status need_nodes(kt_placer *pl, const pl_block *b) {
  for (int32_t t = b->o.ff; t < b->o.ff + b->o.nff; t++) {
    uint64_t v = pl->tok.v[t];
    if (dag_covers(&pl->dag, pl->front.v, pl->front.n, &v, 1)) continue;
    int dup = 0;
    for (int32_t q = 0; q < pl->need.n && !dup; q++) dup = pl->need.v[q] == v;
    if (dup) continue;
    kt_status st = grow((void **)&pl->need.v, &pl->need.cap, pl->need.n + 1, sizeof *pl->need.v);
    if (st != KT_OK) return st;
    pl->need.v[pl->need.n++] = v;
  }
  return KT_OK;
}

/* Whether a block of the current capture, placed on stream at [off, off+size),
 * would share bytes with a placed block that could still be in use: one live, or
 * one used on another stream or of another stream whose work the capture's graph
 * does not put before stream's next work. With waits, the freed blocks of that last
 * kind (noted on the order) are made to come first: stream waits for the nodes
 * need_nodes gathers, and the check runs again without waits. */
static int conflicts(kt_placer *pl, uint64_t off, uint64_t size, kt_stream_t stream, int may_wait) {
  int marked = 0;   /* 1: stream's frontier marked; -1: it cannot be had */
  pl->need.n = 0;
  for (int32_t k = 0; k < pl->cursor; k++) {
    const pl_block *b = &pl->blk[k];
    if (b->state == PL_UNPLACED || b->off >= off + size || off >= b->off + b->size) continue;
    if (b->state == PL_LIVE) return 1;
    if (b->o.nuse == 1 && b->stream == stream) continue;   /* stream order */
    if (!pl->ord.frontier || b->o.unordered) return 1;
    if (!marked) marked = mark_frontier(pl, stream) ? 1 : -1;
    if (marked < 0) return 1;
    if (dag_covers(&pl->dag, pl->front.v, pl->front.n, pl->tok.v + b->o.ff, b->o.nff)) continue;
    if (!may_wait || need_nodes(pl, b) != KT_OK) return 1;
  }
  if (!pl->need.n) return 0;
  if (pl->ord.wait(pl->ord.ctx, stream, pl->need.v, (size_t)pl->need.n) != KT_OK) return 1;
  pl->waits++;
  return conflicts(pl, off, size, stream, 0);
}

kt_status kt_placer_alloc(kt_placer *pl, size_t size, kt_stream_t stream, void **out) {
  if (!pl || !out) return KT_ERR_INVALID;
  if (!pl->active || !size) return KT_ERR_UNAVAILABLE;   /* 0 bytes: recordings leave them out too */
  uint64_t rs = round_up(size, KT_CAPPLAN_ALIGN);
  int32_t j = pl->cursor, stop = pl->n - pl->cursor > KT_CAPPLAN_WINDOW ? pl->cursor + KT_CAPPLAN_WINDOW : pl->n;
  while (j < stop && (pl->blk[j].state != PL_UNPLACED || pl->blk[j].size != rs)) j++;
  if (j == stop || !pl->cur || pl->blk[j].off + rs > pl->cur->bytes ||
      pm_get(&pl->map, pl->cur->base + pl->blk[j].off) >= 0 || conflicts(pl, pl->blk[j].off, rs, stream, pl->may_wait)) {
    pl->refused++;
    return KT_ERR_UNAVAILABLE;
  }
  int32_t slot = pl->lv_free;
  kt_status st = slot >= 0 ? KT_OK : grow((void **)&pl->lv, &pl->caplv, pl->nlv + 1, sizeof *pl->lv);
  if (st == KT_OK) st = pm_reserve_one(&pl->map);
  if (st != KT_OK) {
    pl->refused++;
    return st;
  }
  if (slot >= 0) pl->lv_free = pl->lv[slot].idx;
  else slot = pl->nlv++;
  pl_block *b = &pl->blk[j];
  b->state = PL_LIVE;
  b->stream = stream;
  b->o.use[0] = stream;
  b->o.nuse = 1;
  pl->cursor = j + 1;
  pl->lv[slot] = (pl_live){rs, pl->cur, pl->epoch, j};
  uintptr_t p = pl->cur->base + b->off;
  pm_insert(&pl->map, p, slot);
  pl->cur->live++;
  pl->live_bytes += rs;
  pl->live_blocks++;
  pl->placed++;
  *out = (void *)p;
  return KT_OK;
}

kt_status kt_placer_free(kt_placer *pl, const void *ptr) {
  if (!pl) return KT_ERR_INVALID;
  int32_t slot = pm_get(&pl->map, (uintptr_t)ptr);
  if (slot < 0) return KT_ERR_INVALID;
  pm_delete(&pl->map, (uintptr_t)ptr);
  pl_live *l = &pl->lv[slot];
  if (l->epoch == pl->epoch) {
    pl_block *b = &pl->blk[l->idx];
    b->state = PL_FREED;
    if (!pl->active) b->o.unordered = 1;   /* after the capture: nothing to ask */
    note_free(&pl->ord, &b->o, &pl->tok);
  }
  l->arena->live--;
  pl->live_bytes -= l->size;
  pl->live_blocks--;
  l->idx = pl->lv_free;
  pl->lv_free = slot;
  return KT_OK;
}

kt_status kt_placer_use(kt_placer *pl, const void *ptr, kt_stream_t stream) {
  if (!pl) return KT_ERR_INVALID;
  int32_t slot = pm_get(&pl->map, (uintptr_t)ptr);
  if (slot < 0) return KT_ERR_INVALID;
  const pl_live *l = &pl->lv[slot];
  if (l->epoch == pl->epoch) note_use(&pl->blk[l->idx].o, stream);
  return KT_OK;
}

kt_status kt_placer_get_stats(const kt_placer *pl, kt_placer_stats *out) {
  if (!pl || !out) return KT_ERR_INVALID;
  size_t arena = pl->cur ? pl->cur->bytes : 0;
  int32_t arenas = pl->cur != NULL;
  for (const pl_arena *a = pl->retired; a; a = a->next) {
    arena += a->bytes;
    arenas++;
  }
  *out = (kt_placer_stats){arena, arenas, pl->live_bytes, pl->live_blocks, pl->n, pl->placed, pl->refused, pl->plan_bytes,
                           pl->peak_bytes, pl->waits};
  return KT_OK;
}
