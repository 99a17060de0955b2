/* Stress: threads x random sizes x random streams, with cross-thread frees and
 * record_stream. At each checkpoint every thread stops at a barrier and one checks:
 * no two live blocks overlap, allocated bytes == sum of live sizes, the pool's
 * O(n) validator passes, stats identities hold.
 * KT_STRESS_OPS (default 10^6 in total) and KT_STRESS_THREADS (default 8). */
#include <pthread.h>
#include <stdio.h>

#include "common.h"

enum { SLOTS = 384, MAILBOX = 4096 };

typedef struct live { void *p; size_t size; int stream; } live;
typedef struct worker { int id; uint64_t seed; live slot[SLOTS]; long ops; } worker;

static const kt_backend *be;
static kt_pool_t *pool;
static int nthreads;
static long ops_per_thread, checkpoint_every;
static pthread_barrier_t barrier;
static worker *workers;
static pthread_mutex_t mbox_mu = PTHREAD_MUTEX_INITIALIZER;
static live mbox[MAILBOX];
static int mbox_n;
static atomic_int failures;

#define FAILIF(c, ...) do { if (c) { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); atomic_fetch_add(&failures, 1); } } while (0)

static size_t rounded(size_t s) {
  return s <= KT_LARGE_THRESHOLD ? kt_class_size(kt_size_class(s)) : (s + KT_QUANTUM - 1) / KT_QUANTUM * KT_QUANTUM;
}

static int cmp_live(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const live *)a)->p, y = (uintptr_t)((const live *)b)->p;
  return x < y ? -1 : x > y;
}

static void checkpoint(void) {
  size_t cap = (size_t)nthreads * SLOTS + MAILBOX, n = 0;
  live *all = malloc(cap * sizeof *all);
  for (int t = 0; t < nthreads; t++)
    for (int i = 0; i < SLOTS; i++) if (workers[t].slot[i].p) all[n++] = workers[t].slot[i];
  for (int i = 0; i < mbox_n; i++) all[n++] = mbox[i];
  qsort(all, n, sizeof *all, cmp_live);
  int64_t sum = 0;
  for (size_t i = 0; i < n; i++) {
    sum += (int64_t)rounded(all[i].size);
    if (i) FAILIF((uintptr_t)all[i - 1].p + rounded(all[i - 1].size) > (uintptr_t)all[i].p,
                  "live blocks overlap: %p+%zu and %p", all[i - 1].p, rounded(all[i - 1].size), all[i].p);
  }
  kt_stats st;
  kt_get_stats(pool, &st);
  FAILIF(st.allocated_bytes.current != sum, "allocated %lld != live sum %lld", (long long)st.allocated_bytes.current, (long long)sum);
  FAILIF(st.allocations.current != (int64_t)n, "allocations %lld != %zu", (long long)st.allocations.current, n);
  FAILIF(st.reserved_bytes.current < st.active_bytes.current, "reserved < active");
  FAILIF(st.allocated_bytes.peak < sum, "peak below current");
  FAILIF(kt_pool_validate(pool) != KT_OK, "kt_pool_validate failed");
  free(all);
}

static void *run(void *arg) {
  worker *w = arg;
  for (long op = 0; op < ops_per_thread; op++) {
    uint64_t r = test_rand(&w->seed);
    int i = (int)(r % SLOTS);
    live *l = &w->slot[i];
    if (l->p) {
      if (r % 97 == 0) {                                  /* hand it to another thread */
        pthread_mutex_lock(&mbox_mu);
        if (mbox_n < MAILBOX) { mbox[mbox_n++] = *l; l->p = NULL; }
        pthread_mutex_unlock(&mbox_mu);
        if (!l->p) continue;
      }
      if (r % 89 == 0) FAILIF(kt_record_stream(pool, l->p, test_stream((l->stream + 1) % 4)) != KT_OK, "record_stream");
      FAILIF(kt_free(pool, l->p, l->size, test_stream(l->stream)) != KT_OK, "free %p", l->p);
      l->p = NULL;
    } else {
      uint64_t q = test_rand(&w->seed);
      l->size = 1 + (q % 32 == 0 ? q % (8 * MiB) : q % 4 == 0 ? q % (512 * KiB) : q % (8 * KiB));
      l->stream = (int)(test_rand(&w->seed) % 4);
      kt_status s = kt_alloc(pool, l->size, test_stream(l->stream), &l->p);
      FAILIF(s != KT_OK || !l->p, "alloc %zu: %s", l->size, kt_status_str(s));
    }
    if (op % 31 == 0) {                                   /* free something another thread made */
      live m = {0};
      pthread_mutex_lock(&mbox_mu);
      if (mbox_n) m = mbox[--mbox_n];
      pthread_mutex_unlock(&mbox_mu);
      if (m.p) FAILIF(kt_free(pool, m.p, m.size, test_stream(m.stream)) != KT_OK, "cross-thread free");
    }
    if ((op + 1) % checkpoint_every == 0) {
      pthread_barrier_wait(&barrier);
      if (w->id == 0) checkpoint();
      pthread_barrier_wait(&barrier);
    }
  }
  return NULL;
}

Test(stress, threads_random_sizes_random_streams, .timeout = 600) {
  be = test_backend(0);
  pool = test_pool(be, 0);
  for (int i = 0; i < 4; i++) test_stream(i);   /* create streams before the threads */
  const char *e = getenv("KT_STRESS_THREADS");
  nthreads = e ? atoi(e) : 8;
  e = getenv("KT_STRESS_OPS");
  long total = e ? atol(e) : 1000000;
  ops_per_thread = total / nthreads;
  checkpoint_every = ops_per_thread / 10 > 0 ? ops_per_thread / 10 : 1;
  ops_per_thread = checkpoint_every * 10;
  workers = calloc((size_t)nthreads, sizeof *workers);
  pthread_barrier_init(&barrier, NULL, (unsigned)nthreads);
  pthread_t th[64];
  for (int t = 0; t < nthreads; t++) {
    workers[t].id = t;
    workers[t].seed = 0x9e3779b97f4a7c15ull * (uint64_t)(t + 1);
    pthread_create(&th[t], NULL, run, &workers[t]);
  }
  for (int t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
  cr_assert_eq(atomic_load(&failures), 0, "%d invariant failures (see stderr)", atomic_load(&failures));
  for (int t = 0; t < nthreads; t++)
    for (int i = 0; i < SLOTS; i++)
      if (workers[t].slot[i].p) cr_assert_eq(kt_free(pool, workers[t].slot[i].p, 0, NULL), KT_OK);
  for (int i = 0; i < mbox_n; i++) cr_assert_eq(kt_free(pool, mbox[i].p, 0, NULL), KT_OK);
  if (test_uses_cuda()) cudaDeviceSynchronize();
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.current, 0);
  cr_assert_eq(st.reserved_bytes.current, 0);
  cr_assert_eq(st.num_allocs, st.num_frees);
  cr_assert_geq(st.num_allocs, (uint64_t)(ops_per_thread * nthreads / 3), "too few allocations ran");
  cr_log_info("stress: %d threads, %ld ops, %llu allocs, %llu pending frees, peak reserved %lld / peak allocated %lld",
              nthreads, ops_per_thread * nthreads, (unsigned long long)st.num_allocs,
              (unsigned long long)st.num_pending_frees, (long long)st.reserved_bytes.peak, (long long)st.allocated_bytes.peak);
  kt_pool_destroy(pool);
  test_backend_done();
  free(workers);
}
