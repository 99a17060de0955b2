/* Integration: thread caches across threads — exit, cross-thread frees, flush requests. */
#include <pthread.h>
#include <unistd.h>

#include "common.h"

FAKE_POOL_SUITE(threads, .timeout = 60);

static void *churn_and_exit(void *arg) {
  void *p[100];
  for (int i = 0; i < 100; i++) cr_assert_eq(kt_alloc(pool, 512 + 100 * (size_t)i, (kt_stream_t)arg, &p[i]), KT_OK);
  for (int i = 0; i < 90; i++) cr_assert_eq(kt_free(pool, p[i], 0, (kt_stream_t)arg), KT_OK);
  void **rest = malloc(10 * sizeof *rest);
  memcpy(rest, &p[90], 10 * sizeof *rest);
  return rest;   /* 10 blocks outlive the thread */
}

Test(threads, exit_returns_cached_blocks_and_keeps_counts) {
  pthread_t t;
  void **rest;
  pthread_create(&t, NULL, churn_and_exit, (void *)0x100);
  pthread_join(t, (void **)&rest);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_allocs, 100, "counts of an exited thread are kept");
  cr_assert_eq(st.num_frees, 90);
  cr_assert_eq(st.allocations.current, 10);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  for (int i = 0; i < 10; i++) cr_assert_eq(kt_free(pool, rest[i], 0, NULL), KT_OK, "freed by another thread");
  free(rest);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.reserved_bytes.current, 0, "the exited thread's cache went back to the heap");
  assert_stats_identities(pool);
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int phase;
static void *cache_and_wait(void *arg) {
  (void)arg;
  void *p;
  cr_assert_eq(kt_alloc(pool, 3000, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(pool, p, 0, NULL), KT_OK);      /* now cached in this thread */
  pthread_mutex_lock(&mu);
  phase = 1; pthread_cond_broadcast(&cv);
  while (phase < 2) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  cr_assert_eq(kt_alloc(pool, 9000, NULL, &p), KT_OK); /* a slow path: honours the flush request */
  cr_assert_eq(kt_free(pool, p, 0, NULL), KT_OK);
  pthread_mutex_lock(&mu);
  phase = 3; pthread_cond_broadcast(&cv);
  while (phase < 4) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  return NULL;
}

Test(threads, empty_cache_asks_other_threads_to_flush) {
  pthread_t t;
  phase = 0;
  pthread_create(&t, NULL, cache_and_wait, NULL);
  pthread_mutex_lock(&mu);
  while (phase < 1) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_gt(st.reserved_bytes.current, 0, "another thread's cache cannot be taken from under it");
  pthread_mutex_lock(&mu);
  phase = 2; pthread_cond_broadcast(&cv);
  while (phase < 3) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  /* the 3000-byte class was flushed at the thread's slow path; 9000 is cached again */
  cr_assert_eq(st.class_live[kt_size_class(3000)], 0);
  cr_assert_eq(kt_pool_validate(pool), KT_OK);
  pthread_mutex_lock(&mu);
  phase = 4; pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  pthread_join(t, NULL);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.reserved_bytes.current, 0);
}

Test(threads, pool_destroyed_while_a_thread_keeps_its_cache) {
  kt_pool_t *other = test_pool(be, 0);
  void *p;
  cr_assert_eq(kt_alloc(other, 700, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(other, p, 0, NULL), KT_OK);
  kt_pool_destroy(other);                 /* this thread's tcache for it is now dead */
  kt_pool_t *again = test_pool(be, 0);    /* may reuse the same address */
  cr_assert_eq(kt_alloc(again, 700, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(again, p, 0, NULL), KT_OK);
  cr_assert_eq(kt_pool_validate(again), KT_OK);
  kt_pool_destroy(again);
}

/* ---- peak semantics (kt_pool_options.peak_slack) ---- */
static kt_pool_t *slack_pool(size_t slack) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.peak_slack = slack;
  kt_pool_t *q;
  cr_assert_eq(kt_pool_create(&o, be, &q), KT_OK);
  return q;
}

Test(threads, single_thread_peak_is_exact_at_any_slack) {
  size_t slacks[] = {0, KT_DEFAULT_PEAK_SLACK, (size_t)64 << 20};
  for (int k = 0; k < 3; k++) {
    kt_pool_t *q = slack_pool(slacks[k]);
    uint64_t seed = 99;
    void *live[64] = {0};
    size_t sz[64];
    int64_t cur = 0, peak = 0;
    for (int it = 0; it < 20000; it++) {
      int i = (int)(test_rand(&seed) % 64);
      if (live[i]) { kt_free(q, live[i], 0, NULL); cur -= (int64_t)kt_class_size(kt_size_class(sz[i])); live[i] = NULL; }
      else {
        sz[i] = 1 + test_rand(&seed) % (256 * KiB);
        cr_assert_eq(kt_alloc(q, sz[i], NULL, &live[i]), KT_OK);
        cur += (int64_t)kt_class_size(kt_size_class(sz[i]));
        if (cur > peak) peak = cur;
      }
    }
    kt_stats st;
    kt_get_stats(q, &st);
    cr_assert_eq(st.allocated_bytes.current, cur, "slack %zu", slacks[k]);
    cr_assert_eq(st.allocated_bytes.peak, peak, "slack %zu: peak %lld, true %lld", slacks[k],
                 (long long)st.allocated_bytes.peak, (long long)peak);
    cr_assert_eq(kt_pool_validate(q), KT_OK);
    kt_pool_destroy(q);
  }
}

static kt_pool_t *alt_pool;
static void *alloc_free_1mib(void *arg) {
  (void)arg;
  void *p;
  cr_assert_eq(kt_alloc(alt_pool, 1 << 20, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(alt_pool, p, 0, NULL), KT_OK);   /* this thread keeps 1 MiB of credit */
  return NULL;
}

Test(threads, peak_across_threads_is_exact_with_zero_slack_and_bounded_otherwise) {
  size_t slacks[] = {0, KT_DEFAULT_PEAK_SLACK};
  for (int k = 0; k < 2; k++) {
    alt_pool = slack_pool(slacks[k]);
    pthread_t t;
    pthread_create(&t, NULL, alloc_free_1mib, NULL);
    pthread_join(t, NULL);   /* it exited: its credit was published at exit */
    void *p;
    cr_assert_eq(kt_alloc(alt_pool, 1 << 20, NULL, &p), KT_OK);   /* true peak: 1 MiB */
    kt_stats st;
    kt_get_stats(alt_pool, &st);
    cr_assert_eq(st.allocated_bytes.current, 1 << 20);
    cr_assert_eq(st.allocated_bytes.peak, 1 << 20, "slack %zu: exited threads publish their credit", slacks[k]);
    cr_assert_eq(kt_free(alt_pool, p, 0, NULL), KT_OK);
    kt_pool_destroy(alt_pool);
  }
  /* credit held by a live thread: the peak may overstate by at most the slack */
  for (int k = 0; k < 2; k++) {
    kt_pool_t *q = slack_pool(slacks[k]);
    void *a, *b;
    cr_assert_eq(kt_alloc(q, 1 << 20, (kt_stream_t)0x1, &a), KT_OK);
    cr_assert_eq(kt_free(q, a, 0, (kt_stream_t)0x1), KT_OK);  /* credit in the stream-1 cache */
    cr_assert_eq(kt_alloc(q, 1 << 20, (kt_stream_t)0x2, &b), KT_OK);  /* another cache grows */
    kt_stats st;
    kt_get_stats(q, &st);
    cr_assert_eq(st.allocated_bytes.current, 1 << 20, "current is exact");
    cr_assert_leq(st.allocated_bytes.peak, (int64_t)(1 << 20) + (int64_t)slacks[k]);
    if (slacks[k] == 0) cr_assert_eq(st.allocated_bytes.peak, 1 << 20);
    cr_assert_eq(kt_free(q, b, 0, (kt_stream_t)0x2), KT_OK);
    kt_pool_destroy(q);
  }
}
