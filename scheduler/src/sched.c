/* scheduler/src/sched.c — critical-path list scheduling of a DAG onto K streams, and
 * the fewest cross-stream syncs that keep every edge (kitsune/sched.h).
 *
 * Scheduling is Graham's list scheduling with bottom-level priorities, simulated in
 * time: at the earliest moment T at which a stream is free and some operation has all
 * predecessors finished, the ready operation with the largest bottom level starts at T
 * on a free stream - the stream of its latest-finishing predecessor when that stream
 * is free and that predecessor was its last operation (no sync needed), else the
 * lowest-numbered free stream.
 *
 * Syncs come from vector clocks over the issue order: clock[v][t] is the last
 * position on stream t known to be complete when v completes. For v on stream s,
 * each predecessor u on another stream t needs clock_before(v)[t] >= pos(u); unmet
 * needs are covered greedily by waiting on the node at the needed position whose
 * clock covers the most of them, and a final pass drops any chosen sync the others
 * already imply.
 */
#include "kitsune/sched.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct kt_dag {
  int32_t n, cap;
  double *cost;
  int64_t ne, ecap;
  int32_t (*edges)[2];
};

kt_status kt_dag_create(kt_dag **out) {
  if (!out) return KT_ERR_INVALID;
  kt_dag *d = calloc(1, sizeof *d);
  if (!d) return KT_ERR_OOM;
  *out = d;
  return KT_OK;
}

void kt_dag_destroy(kt_dag *d) {
  if (!d) return;
  free(d->cost);
  free(d->edges);
  free(d);
}

kt_status kt_dag_add_node(kt_dag *d, double cost, int32_t *id) {
  if (!d || !(cost >= 0) || !isfinite(cost) || d->n == INT32_MAX) return KT_ERR_INVALID;
  if (d->n == d->cap) {
    int32_t cap = d->cap ? (d->cap > INT32_MAX / 2 ? INT32_MAX : d->cap * 2) : 16;
    double *c = realloc(d->cost, (size_t)cap * sizeof *c);
    if (!c) return KT_ERR_OOM;
    d->cost = c;
    d->cap = cap;
  }
  d->cost[d->n] = cost;
  if (id) *id = d->n;
  d->n++;
  return KT_OK;
}

kt_status kt_dag_add_edge(kt_dag *d, int32_t from, int32_t to) {
  if (!d || from < 0 || to < 0 || from >= d->n || to >= d->n || from == to) return KT_ERR_INVALID;
  if (d->ne == d->ecap) {
    int64_t cap = d->ecap ? d->ecap * 2 : 32;
    void *e = realloc(d->edges, (size_t)cap * sizeof *d->edges);
    if (!e) return KT_ERR_OOM;
    d->edges = e;
    d->ecap = cap;
  }
  d->edges[d->ne][0] = from;
  d->edges[d->ne][1] = to;
  d->ne++;
  return KT_OK;
}

int32_t kt_dag_num_nodes(const kt_dag *d) { return d ? d->n : 0; }

double kt_roofline_cost(const kt_roofline *m, double flops, double bytes) {
  if (!m) return 0;
  double c = m->peak_flops > 0 ? flops / m->peak_flops : 0, b = m->bandwidth > 0 ? bytes / m->bandwidth : 0;
  return m->launch + (c > b ? c : b);
}

/* ---- compressed adjacency, duplicates removed ---- */
typedef struct {
  int32_t n;
  int32_t *succ_off, *succ, *pred_off, *pred;
} graph;

static int cmp_edge(const void *a, const void *b) {
  const int32_t *x = a, *y = b;
  return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : x[1] != y[1] ? (x[1] < y[1] ? -1 : 1) : 0;
}

static void graph_free(graph *g) {
  free(g->succ_off);
  free(g->succ);
  free(g->pred_off);
  free(g->pred);
}

static kt_status graph_build(const kt_dag *d, graph *g) {
  memset(g, 0, sizeof *g);
  g->n = d->n;
  int32_t(*e)[2] = malloc((size_t)(d->ne ? d->ne : 1) * sizeof *e);
  g->succ_off = calloc((size_t)d->n + 1, sizeof(int32_t));
  g->pred_off = calloc((size_t)d->n + 1, sizeof(int32_t));
  if (!e || !g->succ_off || !g->pred_off) goto oom;
  if (d->ne) memcpy(e, d->edges, (size_t)d->ne * sizeof *e);
  qsort(e, (size_t)d->ne, sizeof *e, cmp_edge);
  int64_t m = 0;
  for (int64_t i = 0; i < d->ne; i++)
    if (!m || cmp_edge(e[m - 1], e[i])) memcpy(e[m++], e[i], sizeof *e);
  g->succ = malloc((size_t)(m ? m : 1) * sizeof(int32_t));
  g->pred = malloc((size_t)(m ? m : 1) * sizeof(int32_t));
  if (!g->succ || !g->pred) goto oom;
  for (int64_t i = 0; i < m; i++) g->succ_off[e[i][0] + 1]++, g->pred_off[e[i][1] + 1]++;
  for (int32_t v = 0; v < d->n; v++) g->succ_off[v + 1] += g->succ_off[v], g->pred_off[v + 1] += g->pred_off[v];
  int32_t *fill = calloc((size_t)d->n + 1, sizeof(int32_t));
  if (!fill) goto oom;
  for (int64_t i = 0; i < m; i++) g->succ[g->succ_off[e[i][0]] + fill[e[i][0]]++] = e[i][1];
  memset(fill, 0, ((size_t)d->n + 1) * sizeof(int32_t));
  for (int64_t i = 0; i < m; i++) g->pred[g->pred_off[e[i][1]] + fill[e[i][1]]++] = e[i][0];
  free(fill);
  free(e);
  return KT_OK;
oom:
  free(e);
  graph_free(g);
  return KT_ERR_OOM;
}

/* Kahn's algorithm; KT_ERR_INVALID on a cycle. */
static kt_status topo_order(const graph *g, int32_t *order) {
  int32_t *indeg = malloc(((size_t)g->n + 1) * sizeof(int32_t));
  if (!indeg) return KT_ERR_OOM;
  int32_t head = 0, tail = 0;
  for (int32_t v = 0; v < g->n; v++)
    if (!(indeg[v] = g->pred_off[v + 1] - g->pred_off[v])) order[tail++] = v;
  while (head < tail) {
    int32_t u = order[head++];
    for (int32_t i = g->succ_off[u]; i < g->succ_off[u + 1]; i++)
      if (!--indeg[g->succ[i]]) order[tail++] = g->succ[i];
  }
  free(indeg);
  return tail == g->n ? KT_OK : KT_ERR_INVALID;
}

void kt_schedule_free(kt_schedule *s) {
  if (!s) return;
  free(s->stream);
  free(s->order);
  free(s->start);
  free(s->finish);
  free(s->syncs);
  memset(s, 0, sizeof *s);
}

/* Appends a sync; grows the array. */
static kt_status push_sync(kt_schedule *s, int32_t *cap, int32_t after, int32_t before) {
  if (s->n_syncs == *cap) {
    int32_t c = *cap ? *cap * 2 : 16;
    kt_sync *p = realloc(s->syncs, (size_t)c * sizeof *p);
    if (!p) return KT_ERR_OOM;
    s->syncs = p;
    *cap = c;
  }
  s->syncs[s->n_syncs++] = (kt_sync){after, before};
  return KT_OK;
}

/* The syncs for schedule s (stream and order set) by vector clocks; fills pos too. */
static kt_status plan_syncs(const graph *g, kt_schedule *s) {
  const int32_t n = g->n, K = s->n_streams;
  int32_t *pos = malloc((size_t)(n ? n : 1) * sizeof *pos), *count = calloc((size_t)K, sizeof *count);
  int32_t *at = malloc((size_t)(n ? n : 1) * sizeof *at), *at_off = calloc((size_t)K + 1, sizeof *at_off);
  int32_t *clock = malloc((size_t)(n ? n : 1) * (size_t)K * sizeof *clock);
  int32_t *last = malloc((size_t)K * sizeof *last), *need = malloc((size_t)K * sizeof *need);
  int32_t *cur = malloc((size_t)K * sizeof *cur), *chosen = malloc((size_t)K * sizeof *chosen);
  int32_t cap = 0;
  kt_status st = KT_ERR_OOM;
  if (!pos || !count || !at || !at_off || !clock || !last || !need || !cur || !chosen) goto out;
  for (int32_t i = 0; i < n; i++) at_off[s->stream[s->order[i]] + 1]++;
  for (int32_t k = 0; k < K; k++) at_off[k + 1] += at_off[k];
  for (int32_t i = 0; i < n; i++) {   /* positions are 1-based; at[at_off[k] + p - 1] is stream k's p-th node */
    int32_t v = s->order[i], k = s->stream[v];
    pos[v] = ++count[k];
    at[at_off[k] + pos[v] - 1] = v;
  }
  for (int32_t k = 0; k < K; k++) last[k] = -1;
  for (int32_t i = 0; i < n; i++) {
    const int32_t v = s->order[i], sv = s->stream[v];
    int32_t *cv = clock + (size_t)v * K;
    if (last[sv] >= 0) memcpy(cur, clock + (size_t)last[sv] * K, (size_t)K * sizeof *cur);
    else memset(cur, 0, (size_t)K * sizeof *cur);
    memset(need, 0, (size_t)K * sizeof *need);
    for (int32_t j = g->pred_off[v]; j < g->pred_off[v + 1]; j++) {
      int32_t u = g->pred[j], t = s->stream[u];
      if (t != sv && pos[u] > need[t]) need[t] = pos[u];
    }
    int32_t nchosen = 0;
    for (;;) {   /* greedy: the wait that covers the most unmet needs */
      int32_t best = -1, best_cover = 0;
      for (int32_t t = 0; t < K; t++) {
        if (need[t] <= cur[t]) continue;
        int32_t w = at[at_off[t] + need[t] - 1], cover = 0;
        const int32_t *cw = clock + (size_t)w * K;
        for (int32_t r = 0; r < K; r++) cover += need[r] > cur[r] && cw[r] >= need[r];
        if (cover > best_cover) best = w, best_cover = cover;
      }
      if (best < 0) break;
      chosen[nchosen++] = best;
      const int32_t *cw = clock + (size_t)best * K;
      for (int32_t r = 0; r < K; r++) if (cw[r] > cur[r]) cur[r] = cw[r];
    }
    for (int32_t a = 0; a < nchosen; a++) {   /* drop a wait the others already imply */
      int32_t *tmp = cv;   /* scratch: v's clock row is written below */
      if (last[sv] >= 0) memcpy(tmp, clock + (size_t)last[sv] * K, (size_t)K * sizeof *tmp);
      else memset(tmp, 0, (size_t)K * sizeof *tmp);
      for (int32_t b = 0; b < nchosen; b++) {
        if (b == a || chosen[b] < 0) continue;
        const int32_t *cw = clock + (size_t)chosen[b] * K;
        for (int32_t r = 0; r < K; r++) if (cw[r] > tmp[r]) tmp[r] = cw[r];
      }
      int ok = 1;
      for (int32_t r = 0; r < K; r++) ok &= need[r] <= tmp[r];
      if (ok) chosen[a] = -1;
    }
    /* v knows what its stream knew and what the kept waits tell it (not the dropped ones) */
    if (last[sv] >= 0) memcpy(cur, clock + (size_t)last[sv] * K, (size_t)K * sizeof *cur);
    else memset(cur, 0, (size_t)K * sizeof *cur);
    for (int32_t a = 0; a < nchosen; a++) {
      if (chosen[a] < 0) continue;
      if ((st = push_sync(s, &cap, chosen[a], v)) != KT_OK) goto out;
      const int32_t *cw = clock + (size_t)chosen[a] * K;
      for (int32_t r = 0; r < K; r++) if (cw[r] > cur[r]) cur[r] = cw[r];
    }
    memcpy(cv, cur, (size_t)K * sizeof *cv);
    cv[sv] = pos[v];
    last[sv] = v;
  }
  st = KT_OK;
out:
  free(pos), free(count), free(at), free(at_off), free(clock), free(last), free(need), free(cur), free(chosen);
  return st;
}

kt_status kt_schedule_list(const kt_dag *d, int32_t K, kt_schedule *out) {
  if (!d || !out || K < 1 || K > KT_SCHED_MAX_STREAMS) return KT_ERR_INVALID;
  const int32_t n = d->n;
  graph g;
  kt_status st = graph_build(d, &g);
  if (st != KT_OK) return st;
  kt_schedule s = {.n_nodes = n, .n_streams = K};
  size_t nn = (size_t)(n ? n : 1);
  s.stream = malloc(nn * sizeof *s.stream);
  s.order = malloc(nn * sizeof *s.order);
  s.start = malloc(nn * sizeof *s.start);
  s.finish = malloc(nn * sizeof *s.finish);
  double *blevel = malloc(nn * sizeof *blevel), *rt = calloc(nn, sizeof *rt), avail[KT_SCHED_MAX_STREAMS] = {0};
  int32_t *topo = malloc(nn * sizeof *topo), *left = malloc(nn * sizeof *left), *ready = malloc(nn * sizeof *ready);
  int32_t last[KT_SCHED_MAX_STREAMS];
  st = KT_ERR_OOM;
  if (!s.stream || !s.order || !s.start || !s.finish || !blevel || !rt || !topo || !left || !ready) goto fail;
  if ((st = topo_order(&g, topo)) != KT_OK) goto fail;
  for (int32_t i = n - 1; i >= 0; i--) {   /* bottom levels */
    int32_t v = topo[i];
    double m = 0;
    for (int32_t j = g.succ_off[v]; j < g.succ_off[v + 1]; j++) m = blevel[g.succ[j]] > m ? blevel[g.succ[j]] : m;
    blevel[v] = d->cost[v] + m;
  }
  int32_t nready = 0;
  for (int32_t v = 0; v < n; v++)
    if (!(left[v] = g.pred_off[v + 1] - g.pred_off[v])) ready[nready++] = v;
  for (int32_t k = 0; k < K; k++) last[k] = -1;
  for (int32_t i = 0; i < n; i++) {
    double free_at = avail[0], rmin = INFINITY;
    for (int32_t k = 1; k < K; k++) free_at = avail[k] < free_at ? avail[k] : free_at;
    for (int32_t j = 0; j < nready; j++) rmin = rt[ready[j]] < rmin ? rt[ready[j]] : rmin;
    const double T = free_at > rmin ? free_at : rmin;
    int32_t pick = -1;
    for (int32_t j = 0; j < nready; j++) {
      int32_t v = ready[j];
      if (rt[v] > T) continue;
      if (pick < 0 || blevel[v] > blevel[ready[pick]] || (blevel[v] == blevel[ready[pick]] && v < ready[pick])) pick = j;
    }
    const int32_t v = ready[pick];
    ready[pick] = ready[--nready];
    int32_t k = -1;
    double best = -1;
    for (int32_t j = g.pred_off[v]; j < g.pred_off[v + 1]; j++) {   /* continue a predecessor's stream */
      int32_t u = g.pred[j], ku = s.stream[u];
      if (last[ku] == u && avail[ku] <= T && s.finish[u] > best) k = ku, best = s.finish[u];
    }
    for (int32_t q = 0; k < 0 && q < K; q++)
      if (avail[q] <= T) k = q;
    s.stream[v] = k;
    s.start[v] = T;
    s.finish[v] = T + d->cost[v];
    avail[k] = s.finish[v];
    last[k] = v;
    s.order[i] = v;
    if (s.finish[v] > s.makespan) s.makespan = s.finish[v];
    for (int32_t j = g.succ_off[v]; j < g.succ_off[v + 1]; j++) {
      int32_t w = g.succ[j];
      if (s.finish[v] > rt[w]) rt[w] = s.finish[v];
      if (!--left[w]) ready[nready++] = w;
    }
  }
  if ((st = plan_syncs(&g, &s)) != KT_OK) goto fail;
  free(blevel), free(rt), free(topo), free(left), free(ready);
  graph_free(&g);
  *out = s;
  return KT_OK;
fail:
  free(blevel), free(rt), free(topo), free(left), free(ready);
  graph_free(&g);
  kt_schedule_free(&s);
  return st;
}

kt_status kt_schedule_check(const kt_dag *d, const kt_schedule *s) {
  if (!d || !s || s->n_nodes != d->n || s->n_streams < 1 || s->n_streams > KT_SCHED_MAX_STREAMS) return KT_ERR_INVALID;
  const int32_t n = d->n, K = s->n_streams;
  graph g;
  kt_status st = graph_build(d, &g);
  if (st != KT_OK) return st;
  size_t nn = (size_t)(n ? n : 1);
  int32_t *index = malloc(nn * sizeof *index), *pos = malloc(nn * sizeof *pos);
  int32_t *clock = calloc(nn * (size_t)K, sizeof *clock), *sync_off = calloc(nn + 1, sizeof *sync_off);
  int32_t *sync_from = malloc((size_t)(s->n_syncs ? s->n_syncs : 1) * sizeof *sync_from), *fill = calloc(nn, sizeof *fill);
  int32_t count[KT_SCHED_MAX_STREAMS] = {0}, last[KT_SCHED_MAX_STREAMS];
  double prev_finish[KT_SCHED_MAX_STREAMS];
  st = KT_ERR_OOM;
  if (!index || !pos || !clock || !sync_off || !sync_from || !fill) goto out;
  st = KT_ERR_INVALID;
  for (int32_t v = 0; v < n; v++) index[v] = -1;
  for (int32_t i = 0; i < n; i++) {   /* order is a permutation; streams in range */
    int32_t v = s->order[i];
    if (v < 0 || v >= n || index[v] >= 0 || s->stream[v] < 0 || s->stream[v] >= K) goto out;
    index[v] = i;
  }
  for (int32_t i = 0; i < s->n_syncs; i++) {
    kt_sync y = s->syncs[i];
    if (y.after < 0 || y.after >= n || y.before < 0 || y.before >= n || index[y.after] >= index[y.before]) goto out;
    sync_off[y.before + 1]++;
  }
  for (int32_t v = 0; v < n; v++) sync_off[v + 1] += sync_off[v];
  for (int32_t i = 0; i < s->n_syncs; i++) sync_from[sync_off[s->syncs[i].before] + fill[s->syncs[i].before]++] = s->syncs[i].after;
  for (int32_t k = 0; k < K; k++) last[k] = -1, prev_finish[k] = -INFINITY;
  for (int32_t i = 0; i < n; i++) {
    const int32_t v = s->order[i], sv = s->stream[v];
    int32_t *cv = clock + (size_t)v * K;
    if (last[sv] >= 0) memcpy(cv, clock + (size_t)last[sv] * K, (size_t)K * sizeof *cv);
    for (int32_t j = sync_off[v]; j < sync_off[v + 1]; j++) {
      const int32_t *cw = clock + (size_t)sync_from[j] * K;
      for (int32_t r = 0; r < K; r++) if (cw[r] > cv[r]) cv[r] = cw[r];
    }
    pos[v] = ++count[sv];
    for (int32_t j = g.pred_off[v]; j < g.pred_off[v + 1]; j++) {   /* every edge is implied */
      int32_t u = g.pred[j];
      if (index[u] >= index[v]) goto out;
      if (s->stream[u] == sv ? pos[u] >= pos[v] : cv[s->stream[u]] < pos[u]) goto out;
      if (s->start[v] < s->finish[u] - 1e-12 * (1 + fabs(s->finish[u]))) goto out;
    }
    if (s->start[v] < prev_finish[sv] - 1e-12 * (1 + fabs(prev_finish[sv]))) goto out;   /* no overlap on a stream */
    prev_finish[sv] = s->finish[v];
    cv[sv] = pos[v];
    last[sv] = v;
  }
  st = KT_OK;
out:
  free(index), free(pos), free(clock), free(sync_off), free(sync_from), free(fill);
  graph_free(&g);
  return st;
}
