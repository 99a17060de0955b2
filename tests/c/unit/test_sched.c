/* Unit: the stream scheduler's planning core (kitsune/sched.h). Schedules are checked
 * for validity (topological issue order, every edge implied by stream order or syncs,
 * no overlap on a stream), syncs for necessity (dropping any one breaks an edge), and
 * makespans against Graham's bound and a brute-force optimum on small DAGs. */
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "kitsune/sched.h"

static kt_dag *dag_of(int n, const double *cost, int ne, const int (*e)[2]) {
  kt_dag *d;
  cr_assert_eq(kt_dag_create(&d), KT_OK);
  for (int i = 0; i < n; i++) cr_assert_eq(kt_dag_add_node(d, cost[i], NULL), KT_OK);
  for (int i = 0; i < ne; i++) cr_assert_eq(kt_dag_add_edge(d, e[i][0], e[i][1]), KT_OK);
  return d;
}

/* A random DAG: edges only from lower to higher ids (so acyclic), costs in [1, 10). */
static kt_dag *random_dag(unsigned *seed, int n, double p, double *cost, int (*edges)[2], int *ne) {
  kt_dag *d;
  cr_assert_eq(kt_dag_create(&d), KT_OK);
  *ne = 0;
  for (int i = 0; i < n; i++) {
    cost[i] = 1 + 9.0 * rand_r(seed) / ((double)RAND_MAX + 1);
    cr_assert_eq(kt_dag_add_node(d, cost[i], NULL), KT_OK);
  }
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++)
      if (rand_r(seed) < p * RAND_MAX) {
        cr_assert_eq(kt_dag_add_edge(d, i, j), KT_OK);
        if (edges) edges[*ne][0] = i, edges[*ne][1] = j;
        (*ne)++;
      }
  return d;
}

/* Longest path (critical path) and total work. */
static void bounds(int n, const double *cost, int ne, const int (*e)[2], double *cp, double *work) {
  double *f = calloc((size_t)n, sizeof *f);
  *cp = *work = 0;
  for (int v = 0; v < n; v++) {   /* ids are topological in these tests */
    double m = 0;
    for (int i = 0; i < ne; i++) if (e[i][1] == v && f[e[i][0]] > m) m = f[e[i][0]];
    f[v] = m + cost[v];
    *cp = f[v] > *cp ? f[v] : *cp;
    *work += cost[v];
  }
  free(f);
}

Test(sched, bad_input_is_refused) {
  kt_dag *d;
  cr_assert_eq(kt_dag_create(&d), KT_OK);
  int32_t a, b;
  cr_assert_eq(kt_dag_add_node(d, -1.0, &a), KT_ERR_INVALID);
  cr_assert_eq(kt_dag_add_node(d, NAN, &a), KT_ERR_INVALID);
  cr_assert_eq(kt_dag_add_node(d, 1.0, &a), KT_OK);
  cr_assert_eq(kt_dag_add_node(d, 2.0, &b), KT_OK);
  cr_assert_eq(b, 1);
  cr_assert_eq(kt_dag_add_edge(d, a, a), KT_ERR_INVALID);
  cr_assert_eq(kt_dag_add_edge(d, a, 2), KT_ERR_INVALID);
  cr_assert_eq(kt_dag_add_edge(d, -1, b), KT_ERR_INVALID);
  kt_schedule s;
  cr_assert_eq(kt_schedule_list(d, 0, &s), KT_ERR_INVALID);
  cr_assert_eq(kt_schedule_list(d, KT_SCHED_MAX_STREAMS + 1, &s), KT_ERR_INVALID);
  cr_assert_eq(kt_dag_add_edge(d, a, b), KT_OK);
  cr_assert_eq(kt_dag_add_edge(d, b, a), KT_OK);   /* a cycle: refused when scheduling */
  cr_assert_eq(kt_schedule_list(d, 2, &s), KT_ERR_INVALID);
  kt_dag_destroy(d);
}

Test(sched, roofline_cost) {
  kt_roofline h100 = {.peak_flops = 989e12, .bandwidth = 3.35e12, .launch = 4e-6};
  /* 1 GFLOP on 1 MB is compute-bound; 1 MFLOP on 1 GB memory-bound */
  cr_assert_float_eq(kt_roofline_cost(&h100, 1e9, 1e6), 4e-6 + 1e9 / 989e12, 1e-15);
  cr_assert_float_eq(kt_roofline_cost(&h100, 1e6, 1e9), 4e-6 + 1e9 / 3.35e12, 1e-15);
}

Test(sched, a_chain_stays_on_one_stream_without_syncs) {
  const double c[] = {1, 2, 3, 4};
  const int e[][2] = {{0, 1}, {1, 2}, {2, 3}, {0, 1}};   /* a duplicate edge is kept once */
  kt_dag *d = dag_of(4, c, 4, e);
  kt_schedule s;
  cr_assert_eq(kt_schedule_list(d, 4, &s), KT_OK);
  cr_assert_float_eq(s.makespan, 10.0, 1e-12);
  cr_assert_eq(s.n_syncs, 0);
  for (int v = 0; v < 4; v++) cr_assert_eq(s.stream[v], s.stream[0]);
  cr_assert_eq(kt_schedule_check(d, &s), KT_OK);
  kt_schedule_free(&s);
  kt_dag_destroy(d);
}

Test(sched, fork_join_uses_every_stream_with_the_fewest_syncs) {
  /* src -> 4 branches of cost 5 -> sink (an Inception block) */
  const double c[] = {1, 5, 5, 5, 5, 1};
  const int e[][2] = {{0, 1}, {0, 2}, {0, 3}, {0, 4}, {1, 5}, {2, 5}, {3, 5}, {4, 5}};
  kt_dag *d = dag_of(6, c, 8, e);
  for (int K = 1; K <= 4; K++) {
    kt_schedule s;
    cr_assert_eq(kt_schedule_list(d, K, &s), KT_OK);
    cr_assert_eq(kt_schedule_check(d, &s), KT_OK);
    double want = 1 + 5 * ((4 + K - 1) / K) + 1;
    cr_assert_float_eq(s.makespan, want, 1e-12, "K=%d makespan %g", K, s.makespan);
    /* one branch continues the source's stream and the sink continues one branch's:
     * the other streams need one wait on the source and the sink one wait on each */
    cr_assert_eq(s.n_syncs, 2 * (K - 1), "K=%d syncs %d", K, s.n_syncs);
    kt_schedule_free(&s);
  }
  kt_dag_destroy(d);
}

Test(sched, random_dags_valid_within_graham_bound_and_syncs_necessary) {
  unsigned seed = 7;
  enum { N = 120 };
  double cost[N];
  static int edges[N * N][2];
  for (int trial = 0; trial < 40; trial++) {
    int ne;
    double p = trial % 2 ? 0.03 : 0.12;
    kt_dag *d = random_dag(&seed, N, p, cost, edges, &ne);
    double cp, work;
    bounds(N, cost, ne, (const int(*)[2])edges, &cp, &work);
    const int Ks[] = {1, 2, 3, 4, 8};
    for (int ki = 0; ki < 5; ki++) {
      int K = Ks[ki];
      kt_schedule s;
      cr_assert_eq(kt_schedule_list(d, K, &s), KT_OK);
      cr_assert_eq(kt_schedule_check(d, &s), KT_OK, "trial %d K %d", trial, K);
      cr_assert_geq(s.makespan, fmax(cp, work / K) - 1e-9);
      cr_assert_leq(s.makespan, work / K + (1.0 - 1.0 / K) * cp + 1e-9, "trial %d K %d: Graham's bound", trial, K);
      if (K == 1) cr_assert_eq(s.n_syncs, 0);
      for (int i = 0; i < s.n_syncs; i++) {   /* each sync is needed */
        kt_sync keep = s.syncs[i];
        s.syncs[i] = s.syncs[s.n_syncs - 1];
        s.n_syncs--;
        cr_assert_neq(kt_schedule_check(d, &s), KT_OK, "trial %d K %d: sync %d->%d is redundant", trial, K,
                      keep.after, keep.before);
        s.n_syncs++;
        s.syncs[s.n_syncs - 1] = s.syncs[i];
        s.syncs[i] = keep;
      }
      kt_schedule_free(&s);
    }
    kt_dag_destroy(d);
  }
}

/* Optimal makespan by search over every topological order and stream assignment
 * (each operation starting as early as its stream and predecessors allow: every
 * schedule is matched or beaten by one of these). */
static void search(int n, int K, const double *cost, const int (*e)[2], int ne, int placed, unsigned mask,
                   double *fin, double *avail, double cur, double *best) {
  if (cur >= *best) return;
  if (placed == n) { *best = cur; return; }
  for (int v = 0; v < n; v++) {
    if (mask >> v & 1) continue;
    double rt = 0;
    int ok = 1;
    for (int i = 0; i < ne && ok; i++)
      if (e[i][1] == v) { if (!(mask >> e[i][0] & 1)) ok = 0; else rt = fmax(rt, fin[e[i][0]]); }
    if (!ok) continue;
    for (int k = 0; k < K; k++) {
      if (k > 0 && avail[k] == 0 && avail[k - 1] == 0) break;   /* empty streams are interchangeable */
      double save = avail[k], st = fmax(save, rt);
      fin[v] = st + cost[v];
      avail[k] = fin[v];
      search(n, K, cost, e, ne, placed + 1, mask | 1u << v, fin, avail, fmax(cur, fin[v]), best);
      avail[k] = save;
    }
  }
}

Test(sched, small_dags_against_the_optimum) {
  unsigned seed = 11;
  double worst = 1, sum = 0;
  int count = 0;
  for (int trial = 0; trial < 60; trial++) {
    int n = 5 + trial % 3, K = 2 + trial % 2, ne;
    double cost[8], fin[8], avail[4] = {0};
    int edges[64][2];
    kt_dag *d = random_dag(&seed, n, 0.3, cost, edges, &ne);
    double opt = INFINITY;
    search(n, K, cost, (const int(*)[2])edges, ne, 0, 0, fin, avail, 0, &opt);
    kt_schedule s;
    cr_assert_eq(kt_schedule_list(d, K, &s), KT_OK);
    cr_assert_eq(kt_schedule_check(d, &s), KT_OK);
    double r = s.makespan / opt;
    cr_assert_geq(r, 1 - 1e-9, "trial %d: below the optimum (%g < %g): the search or the check is wrong", trial,
                  s.makespan, opt);
    cr_assert_leq(r, 2 - 1.0 / K + 1e-9, "trial %d: %g vs optimum %g", trial, s.makespan, opt);
    worst = fmax(worst, r);
    sum += r;
    count++;
    kt_schedule_free(&s);
    kt_dag_destroy(d);
  }
  cr_log_info("list schedule / optimum over %d small DAGs: mean %.4f, worst %.4f", count, sum / count, worst);
  cr_assert_leq(sum / count, 1.10, "mean ratio %.4f", sum / count);
}
