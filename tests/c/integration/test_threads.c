/* Integration: thread caches across threads — exit, cross-thread frees, flush requests. */
#include <pthread.h>

#include "common.h"

static kt_backend *be;
static kt_pool_t *pool;
static void setup(void) { be = kt_fake_backend_create(0); pool = test_pool(be, 0); }
static void teardown(void) { kt_pool_destroy(pool); kt_fake_backend_destroy(be); }
TestSuite(threads, .init = setup, .fini = teardown, .timeout = 60);

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
