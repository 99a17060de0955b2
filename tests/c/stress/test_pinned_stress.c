/* Stress of the pinned host pool: threads allocate, fill, check and free blocks of
 * random sizes; half the frees happen on another thread (a shared handoff ring), and
 * a quarter of the blocks are recorded on a stream first (the pending path).
 * Any overlap between live blocks shows as a clobbered pattern. At the end the
 * pool's validator checks the chunk table, the live table and the stats. */
#include <pthread.h>
#include <stdio.h>

#include "common.h"
#include "kitsune/pinned.h"

enum { THREADS = 8, SLOTS = 32, RING = 256 };

typedef struct blk { void *p; size_t n; unsigned char v; } blk;

static pthread_mutex_t ring_mu = PTHREAD_MUTEX_INITIALIZER;
static blk ring[RING];
static int ring_n;
static atomic_int failures;
static long ops_per_thread;

PINNED_POOL_SUITE(pinned_stress, .timeout = 300);

static int intact(const blk *b) {
  const unsigned char *c = b->p;
  size_t step = b->n > 4096 ? b->n / 64 : 1;
  for (size_t i = 0; i < b->n; i += step) if (c[i] != b->v) return 0;
  return c[b->n - 1] == b->v;
}

static void release(blk *b) {
  if (!intact(b)) { fprintf(stderr, "pinned block %p (%zu B) clobbered\n", b->p, b->n); atomic_fetch_add(&failures, 1); }
  /* a quarter of the blocks were "used" on a stream: they go through the pending list */
  if (b->v % 4 == 1 && kt_pinned_record_stream(pp, b->p, 0, test_stream(1 + b->v % 3)) != KT_OK)
    atomic_fetch_add(&failures, 1);
  if (kt_pinned_free(pp, b->p) != KT_OK) atomic_fetch_add(&failures, 1);
  b->p = NULL;
}

static void *worker(void *arg) {
  uint64_t seed = 0x1234567ull + 977 * (uint64_t)(uintptr_t)arg;
  blk mine[SLOTS] = {{0}};
  for (long op = 0; op < ops_per_thread; op++) {
    blk *b = &mine[test_rand(&seed) % SLOTS];
    if (b->p) {
      if (test_rand(&seed) & 1) {   /* hand it to whichever thread comes next */
        pthread_mutex_lock(&ring_mu);
        blk give = *b, take = {0};
        if (ring_n == RING) take = ring[--ring_n];
        ring[ring_n++] = give;
        pthread_mutex_unlock(&ring_mu);
        b->p = NULL;
        if (take.p) release(&take);
      } else {
        release(b);
      }
      continue;
    }
    b->n = ((size_t)16 << (test_rand(&seed) % 18)) + test_rand(&seed) % 4096;
    b->v = (unsigned char)(test_rand(&seed) | 1);
    if (kt_pinned_alloc(pp, b->n, &b->p) != KT_OK) { atomic_fetch_add(&failures, 1); b->p = NULL; continue; }
    memset(b->p, b->v, b->n);
  }
  for (int i = 0; i < SLOTS; i++) if (mine[i].p) release(&mine[i]);
  return NULL;
}

Test(pinned_stress, threads_with_cross_thread_frees) {
  const char *e = getenv("KT_STRESS_OPS");
  long total = e ? atol(e) : 400000;
  ops_per_thread = total / THREADS;
  for (int i = 1; i <= 3; i++) test_stream(i);   /* created here, not raced for by workers */
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < ring_n; i++) release(&ring[i]);
  ring_n = 0;
  cr_assert_eq(atomic_load(&failures), 0);
  kt_pinned_stats s;
  cr_assert_eq(kt_pinned_get_stats(pp, &s), KT_OK);
  cr_assert_eq(kt_pinned_trim(pp), KT_OK);   /* releases whatever still waits */
  cr_assert_eq(kt_pinned_get_stats(pp, &s), KT_OK);
  cr_assert_gt(s.num_pending_frees, 0);
  cr_assert_eq(s.pending_now, 0);
  cr_assert_eq(s.allocations.current, 0);
  cr_assert_eq(s.requested_bytes.current, 0);
  cr_assert_eq(s.num_allocs, s.num_frees);
  cr_assert_gt(s.num_allocs, (uint64_t)total / 4);
  cr_assert_eq(kt_pinned_validate(pp), KT_OK);
}
