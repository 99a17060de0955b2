/* Conformance: the allocator contract, run unchanged over every backend
 * (KT_TEST_BACKEND=fake | cuda). On CUDA the blocks are also written and read back. */
#include "common.h"

static const kt_backend *be;
static kt_pool_t *pool;
static void setup(void) { be = test_backend(0); pool = test_pool(be, 0); }
static void teardown(void) {
  if (pool) kt_pool_destroy(pool);
  pool = NULL;
  test_backend_done();
}
TestSuite(conformance, .init = setup, .fini = teardown, .timeout = 120);

/* On CUDA: fill the block with a byte pattern and verify it (proves the memory is real). */
static void touch(void *p, size_t n, kt_stream_t s, unsigned char v) {
  if (!test_uses_cuda() || !p) return;
  cr_assert_eq(cudaMemsetAsync(p, v, n, (cudaStream_t)s), cudaSuccess);
  unsigned char h[2];
  cr_assert_eq(cudaMemcpyAsync(&h[0], p, 1, cudaMemcpyDeviceToHost, (cudaStream_t)s), cudaSuccess);
  cr_assert_eq(cudaMemcpyAsync(&h[1], (char *)p + n - 1, 1, cudaMemcpyDeviceToHost, (cudaStream_t)s), cudaSuccess);
  cr_assert_eq(cudaStreamSynchronize((cudaStream_t)s), cudaSuccess);
  cr_assert(h[0] == v && h[1] == v);
}

Test(conformance, sizes_from_one_byte_to_large_are_usable) {
  size_t sizes[] = {1, 511, 512, 513, 4095, 4096, 4097, 65536, 100000, KT_LARGE_THRESHOLD - 1,
                    KT_LARGE_THRESHOLD, KT_LARGE_THRESHOLD + 1, 7 * MiB + 3, 64 * MiB};
  void *p[sizeof sizes / sizeof *sizes];
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    cr_assert_eq(kt_alloc(pool, sizes[i], test_stream(1), &p[i]), KT_OK, "size %zu", sizes[i]);
    cr_assert_eq((uintptr_t)p[i] % KT_QUANTUM, 0);
    touch(p[i], sizes[i], test_stream(1), (unsigned char)i);
  }
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
    cr_assert_eq(kt_free(pool, p[i], sizes[i], test_stream(1)), KT_OK);
  assert_stats_identities(pool);
}

Test(conformance, same_stream_reuses_other_stream_does_not) {
  kt_pool_destroy(pool);
  pool = test_pool_keep(be);   /* a released segment may come back at the same address */
  void *a, *b, *c;
  for (size_t size = 1000; size <= 16 * MiB; size *= 4) {
    cr_assert_eq(kt_alloc(pool, size, test_stream(1), &a), KT_OK);
    test_hold(test_stream(1));                  /* stream 1 is "still using" a */
    cr_assert_eq(kt_free(pool, a, size, test_stream(1)), KT_OK);
    cr_assert_eq(kt_alloc(pool, size, test_stream(2), &b), KT_OK);
    cr_assert_neq(a, b, "size %zu: block freed on stream 1 handed to stream 2", size);
    cr_assert_eq(kt_alloc(pool, size, test_stream(1), &c), KT_OK);
    cr_assert_eq(a, c, "size %zu: stream 1 should reuse its block", size);
    test_release();
    touch(c, size, test_stream(1), 0x5a);
    cr_assert_eq(kt_free(pool, b, size, test_stream(2)), KT_OK);
    cr_assert_eq(kt_free(pool, c, size, test_stream(1)), KT_OK);
  }
  assert_stats_identities(pool);
}

/* On a VMM pool, what stream 1 freed serves stream 2 once stream 1's work is done,
 * where the pool would otherwise grow (an event recorded on stream 1 says so; no
 * synchronization). Segment pools move memory between streams as whole idle segments
 * (test_arena.c). */
Test(conformance, other_stream_reuses_once_the_freeing_streams_work_is_done) {
  if (!test_vmm()) cr_skip_test("a VMM pool's behaviour (KT_TEST_VMM=1)");
  kt_pool_destroy(pool);
  pool = test_pool_keep(be);
  void *a, *b, *c;
  size_t size = 12 * MiB;   /* a segment of its own */
  cr_assert_eq(kt_alloc(pool, size, test_stream(1), &a), KT_OK);
  touch(a, size, test_stream(1), 1);
  test_hold(test_stream(1));
  cr_assert_eq(kt_free(pool, a, size, test_stream(1)), KT_OK);
  cr_assert_eq(kt_alloc(pool, size, test_stream(2), &b), KT_OK);
  cr_assert_neq(a, b, "stream 1's work may still use a");
  test_release();
  cr_assert_eq(kt_alloc(pool, size, test_stream(2), &c), KT_OK);
  cr_assert_eq(c, a, "stream 1's work is done: a serves stream 2");
  touch(c, size, test_stream(2), 2);
  cr_assert_eq(kt_free(pool, b, size, test_stream(2)), KT_OK);
  cr_assert_eq(kt_free(pool, c, size, test_stream(2)), KT_OK);
  assert_stats_identities(pool);
}

Test(conformance, recorded_stream_blocks_reuse_until_its_work_completes) {
  for (size_t size = 2048; size <= 8 * MiB; size *= 64) {
    void *p, *q;
    cr_assert_eq(kt_alloc(pool, size, test_stream(1), &p), KT_OK);
    cr_assert_eq(kt_record_stream(pool, p, test_stream(2)), KT_OK);
    test_hold(test_stream(2));                  /* stream 2 is "still using" p */
    cr_assert_eq(kt_free(pool, p, size, test_stream(1)), KT_OK);
    void *got[40];
    for (int i = 0; i < 40; i++) {
      cr_assert_eq(kt_alloc(pool, size, test_stream(1), &got[i]), KT_OK);
      cr_assert_neq(got[i], p, "size %zu: reused while stream 2 still runs", size);
    }
    kt_stats st;
    kt_get_stats(pool, &st);
    cr_assert_eq(st.active_bytes.current - st.allocated_bytes.current,
                 (int64_t)(size <= KT_LARGE_THRESHOLD ? kt_class_size(kt_size_class(size)) : size));
    test_release();
    for (int i = 0; i < 40; i++) cr_assert_eq(kt_free(pool, got[i], size, test_stream(1)), KT_OK);
    cr_assert_eq(kt_empty_cache(pool), KT_OK);    /* drains completed events */
    kt_get_stats(pool, &st);
    cr_assert_eq(st.active_bytes.current, st.allocated_bytes.current);
    cr_assert_eq(kt_alloc(pool, size, test_stream(1), &q), KT_OK);
    touch(q, size, test_stream(1), 1);
    cr_assert_eq(kt_free(pool, q, size, test_stream(1)), KT_OK);
  }
  assert_stats_identities(pool);
}

Test(conformance, oom_is_distinct_and_recoverable) {
  size_t total = 0, freeb = 0;
  cr_assert_eq(be->mem_info(be->ctx, 0, &freeb, &total), KT_OK);
  cr_assert_gt(total, 0);
  cr_assert_eq(kt_set_memory_limit(pool, 64 * MiB), KT_OK);
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 48 * MiB, test_stream(1), &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 32 * MiB, test_stream(1), &b), KT_ERR_OOM);
  cr_assert_eq(kt_last_oom()->requested, 32 * MiB);
  cr_assert_eq(kt_last_oom()->live, 48 * MiB);
  cr_assert_eq(kt_free(pool, a, 0, test_stream(1)), KT_OK);
  cr_assert_eq(kt_alloc(pool, 32 * MiB, test_stream(1), &b), KT_OK);
  touch(b, 32 * MiB, test_stream(1), 3);
  cr_assert_eq(kt_free(pool, b, 0, test_stream(1)), KT_OK);
  /* beyond the device: the backend's own OOM, reported the same way */
  cr_assert_eq(kt_set_memory_limit(pool, 0), KT_OK);
  if (test_uses_cuda()) {
    cr_assert_eq(kt_alloc(pool, total + (1ull << 30), test_stream(1), &b), KT_ERR_OOM);
    cr_assert_eq(kt_last_oom()->hit_limit, 0);
    cr_assert_eq(kt_last_oom()->device_total, total);
  }
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.reserved_bytes.current, 0);
  assert_stats_identities(pool);
}

Test(conformance, churn_keeps_invariants_and_gives_everything_back) {
  uint64_t seed = 1234;
  enum { N = 256 };
  void *live[N] = {0};
  size_t sz[N];
  int st_of[N];
  for (int it = 0; it < 50000; it++) {
    int i = (int)(test_rand(&seed) % N);
    if (live[i]) {
      cr_assert_eq(kt_free(pool, live[i], sz[i], test_stream(st_of[i])), KT_OK);
      live[i] = NULL;
    } else {
      uint64_t r = test_rand(&seed);
      sz[i] = 1 + (r % 16 == 0 ? r % (24 * MiB) : r % (256 * KiB));
      st_of[i] = (int)(test_rand(&seed) % 3);
      cr_assert_eq(kt_alloc(pool, sz[i], test_stream(st_of[i]), &live[i]), KT_OK);
      if (test_rand(&seed) % 64 == 0) cr_assert_eq(kt_record_stream(pool, live[i], test_stream((st_of[i] + 1) % 3)), KT_OK);
    }
    if (it % 5000 == 0) assert_stats_identities(pool);
  }
  for (int i = 0; i < N; i++) if (live[i]) cr_assert_eq(kt_free(pool, live[i], sz[i], test_stream(st_of[i])), KT_OK);
  if (test_uses_cuda()) cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.current, 0);
  cr_assert_eq(st.active_bytes.current, 0);
  cr_assert_eq(st.reserved_bytes.current, 0);
  assert_stats_identities(pool);
}
