/* Hot path: after warm-up, alloc/free of size classes already seen make no host
 * allocation, no backend call and take no process-wide lock.
 *  - host allocations: this binary interposes malloc & co. for the whole process
 *    (libkitsune is linked in) and counts calls made by the measuring thread;
 *  - backend calls: the fake backend counts every call;
 *  - locks: another thread holds every pool-wide mutex while the loop runs; a
 *    loop that needed one would block and the test would time out. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
#include <errno.h>

#include "common.h"
#include "internal.h"

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static __thread int counting;
static __thread long host_calls;

void *malloc(size_t n) { host_calls += counting; return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { host_calls += counting; return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { host_calls += counting; return __libc_realloc(p, n); }
void free(void *p) { host_calls += counting; __libc_free(p); }
void *aligned_alloc(size_t a, size_t n) { host_calls += counting; return __libc_memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
  host_calls += counting;
  *out = __libc_memalign(a, n);
  return *out ? 0 : 12;
}

static size_t sizes[] = {1, 512, 700, 4096, 5000, 65536, 100000, 300000, 1 << 20};
#define NS (sizeof sizes / sizeof *sizes)
#define S1 ((kt_stream_t)0x100)
#define S2 ((kt_stream_t)0x200)

static void warm(kt_pool_t *pool) {
  void *p[NS][4];
  for (int s = 0; s < 2; s++) {
    for (size_t i = 0; i < NS; i++)
      for (int k = 0; k < 4; k++) cr_assert_eq(kt_alloc(pool, sizes[i], s ? S2 : S1, &p[i][k]), KT_OK);
    for (size_t i = 0; i < NS; i++)
      for (int k = 0; k < 4; k++) cr_assert_eq(kt_free(pool, p[i][k], sizes[i], s ? S2 : S1), KT_OK);
  }
}

static long hot_loop(kt_pool_t *pool, int iters) {
  long bad = 0;
  void *p[NS][4];
  counting = 1;
  for (int it = 0; it < iters; it++) {
    kt_stream_t s = (it & 1) ? S2 : S1;
    for (size_t i = 0; i < NS; i++)
      for (int k = 0; k < 4; k++) bad += kt_alloc(pool, sizes[i], s, &p[i][k]) != KT_OK;
    for (size_t i = 0; i < NS; i++)
      for (int k = 3; k >= 0; k--) bad += kt_free(pool, p[i][k], sizes[i], s) != KT_OK;
  }
  counting = 0;
  return bad;
}

Test(hotpath, no_host_allocation_and_no_backend_call_after_warmup) {
  kt_backend *be = kt_fake_backend_create(0);
  kt_pool_t *pool = test_pool(be, 0);
  warm(pool);
  kt_fake_counts before, after;
  kt_fake_get_counts(be, &before);
  host_calls = 0;
  long bad = hot_loop(pool, 100000);
  kt_fake_get_counts(be, &after);
  cr_assert_eq(bad, 0);
  cr_assert_eq(host_calls, 0, "%ld host allocator calls on the hot path", host_calls);
  cr_assert_eq(after.reserves + after.releases + after.event_creates + after.event_records + after.event_queries + after.syncs,
               before.reserves + before.releases + before.event_creates + before.event_records + before.event_queries + before.syncs,
               "backend called on the hot path");
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_geq(st.num_allocs, 100000ull * NS * 4);
  /* the counters do see allocations: a cold class on a new stream allocates */
  counting = 1;
  void *x;
  cr_assert_eq(kt_alloc(pool, 3000, (kt_stream_t)0x300, &x), KT_OK);
  counting = 0;
  cr_assert_gt(host_calls, 0, "malloc interposition is not counting");
  kt_pool_destroy(pool);
  kt_fake_backend_destroy(be);
}

static kt_pool_t *locked_pool;
static atomic_int hot_done;
static void *hold_locks(void *arg) {
  (void)arg;
  pthread_mutex_lock(&kt__registry);
  pthread_mutex_lock(&locked_pool->heap_lock);
  pthread_mutex_lock(&locked_pool->arena_lock);
  pthread_mutex_lock(&locked_pool->pending_lock);
  pthread_mutex_lock(&locked_pool->trace_lock);
  while (!atomic_load(&hot_done)) usleep(1000);
  pthread_mutex_unlock(&locked_pool->trace_lock);
  pthread_mutex_unlock(&locked_pool->pending_lock);
  pthread_mutex_unlock(&locked_pool->arena_lock);
  pthread_mutex_unlock(&locked_pool->heap_lock);
  pthread_mutex_unlock(&kt__registry);
  return NULL;
}

Test(hotpath, no_process_wide_lock_after_warmup, .timeout = 30) {
  kt_backend *be = kt_fake_backend_create(0);
  locked_pool = test_pool(be, 0);
  warm(locked_pool);
  pthread_t t;
  pthread_create(&t, NULL, hold_locks, NULL);
  usleep(20000);   /* let it take the locks */
  cr_assert_eq(pthread_mutex_trylock(&locked_pool->arena_lock), EBUSY);
  cr_assert_eq(pthread_mutex_trylock(&kt__registry), EBUSY);
  cr_assert_eq(hot_loop(locked_pool, 20000), 0);   /* would block here if it took one */
  atomic_store(&hot_done, 1);
  pthread_join(t, NULL);
  kt_pool_destroy(locked_pool);
  kt_fake_backend_destroy(be);
}
