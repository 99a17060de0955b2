/* Conformance of the pinned host pool (kitsune/pinned.h), over the host fake backend
 * (ordinary memory) or, with KT_TEST_BACKEND=cuda, over cudaHostAlloc. Every block is
 * filled with a pattern and read back before it is freed, so overlapping blocks or
 * memory that is not really there would show. On CUDA, blocks are also checked to be
 * page-locked and copied to the device and back asynchronously. */
#include "common.h"
#include "kitsune/pinned.h"

PINNED_POOL_SUITE(pinned, .timeout = 120);

static void fill(void *p, size_t n, unsigned char v) { memset(p, v, n); }
static void check(const void *p, size_t n, unsigned char v) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != v) cr_assert_fail("byte %zu of a %zu-byte block is %u, expected %u", i, n, c[i], v);
}

static kt_pinned_stats stats(void) {
  kt_pinned_stats s;
  cr_assert_eq(kt_pinned_get_stats(pp, &s), KT_OK);
  return s;
}

static void assert_identities(void) {
  kt_pinned_stats s = stats();
  const kt_stat *all[] = {&s.requested_bytes, &s.allocated_bytes, &s.mapped_bytes, &s.allocations, &s.chunks};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) {
    cr_assert_eq(all[i]->current, all[i]->allocated - all[i]->freed, "stat %zu", i);
    cr_assert_geq(all[i]->peak, all[i]->current, "stat %zu", i);
  }
  cr_assert_geq(s.allocated_bytes.current, s.requested_bytes.current);
  cr_assert_geq(s.mapped_bytes.current, s.allocated_bytes.current);
  cr_assert_eq(s.num_allocs - s.num_frees + s.pending_now, (uint64_t)s.allocations.current);
  cr_assert_eq(kt_pinned_validate(pp), KT_OK);
}

Test(pinned, sizes_are_usable_aligned_and_counted) {
  size_t sizes[] = {1, 15, 16, 4095, 4096, 4097, 65536, 100003, 1 * MiB + 1, 7 * MiB + 3, 48 * MiB};
  enum { N = sizeof sizes / sizeof *sizes };
  void *p[N];
  size_t req = 0;
  for (size_t i = 0; i < N; i++) {
    cr_assert_eq(kt_pinned_alloc(pp, sizes[i], &p[i]), KT_OK, "size %zu", sizes[i]);
    cr_assert_not_null(p[i]);
    cr_assert_eq((uintptr_t)p[i] % 16, 0);
    if (sizes[i] >= 4096) cr_assert_eq((uintptr_t)p[i] % 4096, 0, "size %zu at %p", sizes[i], p[i]);
    size_t got;
    cr_assert_eq(kt_pinned_block_size(pp, p[i], &got), KT_OK);
    cr_assert_eq(got, sizes[i]);
    fill(p[i], sizes[i], (unsigned char)(i + 1));
    req += sizes[i];
  }
  kt_pinned_stats s = stats();
  cr_assert_eq(s.requested_bytes.current, (int64_t)req);
  cr_assert_eq(s.allocations.current, N);
  assert_identities();
  for (size_t i = 0; i < N; i++) check(p[i], sizes[i], (unsigned char)(i + 1));
  for (size_t i = 0; i < N; i++) cr_assert_eq(kt_pinned_free(pp, p[i]), KT_OK);
  s = stats();
  cr_assert_eq(s.requested_bytes.current, 0);
  cr_assert_eq(s.allocated_bytes.current, 0);
  cr_assert_eq(s.requested_bytes.peak, (int64_t)req);
  assert_identities();
}

Test(pinned, zero_bytes_and_null) {
  void *p = (void *)1;
  cr_assert_eq(kt_pinned_alloc(pp, 0, &p), KT_OK);
  cr_assert_null(p);
  cr_assert_eq(kt_pinned_free(pp, NULL), KT_OK);
  cr_assert_eq(stats().num_allocs, 0);
}

Test(pinned, a_freed_block_is_reused_without_pinning_again) {
  void *a, *b;
  cr_assert_eq(kt_pinned_alloc(pp, 24 * MiB, &a), KT_OK);
  kt_pinned_stats s1 = stats();
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  cr_assert_eq(kt_pinned_alloc(pp, 24 * MiB, &b), KT_OK);
  kt_pinned_stats s2 = stats();
  cr_assert_eq(a, b);
  cr_assert_eq(s2.mapped_bytes.current, s1.mapped_bytes.current);
  cr_assert_eq(s2.chunks.allocated, s1.chunks.allocated, "a second pin for a cached size");
  /* Another size class: the idle 24 MiB chunk is given back before pinning anew. */
  cr_assert_eq(kt_pinned_free(pp, b), KT_OK);
  cr_assert_eq(kt_pinned_alloc(pp, 10 * MiB, &a), KT_OK);
  kt_pinned_stats s3 = stats();
  cr_assert_eq(s3.num_release_on_grow, 1);
  cr_assert_eq(s3.mapped_bytes.current, s3.allocated_bytes.current, "the idle chunk stayed pinned");
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  /* With release_on_grow off, idle chunks stay cached. */
  kt_pinned_set_release_on_grow(pp, 0);
  cr_assert_eq(kt_pinned_alloc(pp, 24 * MiB, &a), KT_OK);
  kt_pinned_stats s4 = stats();
  cr_assert_eq(s4.num_release_on_grow, 1);
  cr_assert_eq(s4.mapped_bytes.current, s3.mapped_bytes.current + s1.mapped_bytes.current);
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  assert_identities();
}

Test(pinned, bad_pointers_are_refused_and_change_nothing) {
  void *a;
  cr_assert_eq(kt_pinned_alloc(pp, 5000, &a), KT_OK);
  kt_pinned_stats before = stats();
  int local;
  cr_assert_eq(kt_pinned_free(pp, &local), KT_ERR_INVALID, "a stack address");
  cr_assert_eq(kt_pinned_free(pp, (char *)a + 16), KT_ERR_INVALID, "inside a block");
  size_t n;
  cr_assert_eq(kt_pinned_block_size(pp, (char *)a + 16, &n), KT_ERR_INVALID);
  kt_pinned_stats after = stats();
  cr_assert_eq(memcmp(&before, &after, sizeof before), 0);
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  cr_assert_eq(kt_pinned_free(pp, a), KT_ERR_INVALID, "a double free");
  cr_assert_eq(stats().num_frees, 1);
  cr_assert_eq(kt_pinned_alloc(NULL, 10, &a), KT_ERR_INVALID);
  cr_assert_eq(kt_pinned_alloc(pp, 10, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_pinned_free(NULL, a), KT_ERR_INVALID);
  assert_identities();
}

Test(pinned, oversized_request_is_out_of_memory_before_pinning) {
  void *a = (void *)1;
  cr_assert_eq(kt_pinned_alloc(pp, KT_PINNED_MAX_ALLOC + 1, &a), KT_ERR_OOM);
  cr_assert_null(a);
  cr_assert_eq(stats().chunks.allocated, 0);
}

Test(pinned, a_refused_pin_is_out_of_memory_and_the_pool_recovers) {
  if (test_uses_cuda()) cr_skip_test("failure injection is a fake-backend feature");
  kt_fake_fail_next_host_allocs(test_fake, 1);
  void *a = (void *)1;
  cr_assert_eq(kt_pinned_alloc(pp, 3 * MiB, &a), KT_ERR_OOM);
  cr_assert_null(a);
  kt_pinned_stats s = stats();
  cr_assert_eq(s.num_failed_pins, 1);
  cr_assert_eq(s.allocations.current, 0);
  cr_assert_eq(kt_pinned_alloc(pp, 3 * MiB, &a), KT_OK);
  fill(a, 3 * MiB, 7);
  check(a, 3 * MiB, 7);
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  assert_identities();
}

Test(pinned, chunks_off_page_boundaries_are_realigned) {
  if (test_uses_cuda()) cr_skip_test("misaligned chunks are a fake-backend feature");
  kt_fake_misalign_host(test_fake, 1);
  void *p[4];
  size_t n[4] = {100, 5000, 640 * KiB, 3 * MiB + 17};
  for (int i = 0; i < 4; i++) {
    cr_assert_eq(kt_pinned_alloc(pp, n[i], &p[i]), KT_OK, "size %zu", n[i]);
    if (n[i] >= 4096) cr_assert_eq((uintptr_t)p[i] % 4096, 0, "size %zu at %p", n[i], p[i]);
    fill(p[i], n[i], (unsigned char)(i + 1));
  }
  for (int i = 0; i < 4; i++) check(p[i], n[i], (unsigned char)(i + 1));
  assert_identities();
  for (int i = 0; i < 4; i++) cr_assert_eq(kt_pinned_free(pp, p[i]), KT_OK);
  kt_pinned_destroy(pp);
  pp = NULL;
  kt_fake_counts c;
  kt_fake_get_counts(test_fake, &c);
  cr_assert_eq(c.host_bytes, 0);
  cr_assert_eq(c.host_allocs, c.host_frees);
}

Test(pinned, trim_returns_idle_chunks_and_destroy_returns_all) {
  void *p[6];
  for (int i = 0; i < 6; i++) {
    cr_assert_eq(kt_pinned_alloc(pp, (size_t)(i + 1) * 3 * MiB, &p[i]), KT_OK);
    fill(p[i], (size_t)(i + 1) * 3 * MiB, (unsigned char)(i + 1));
  }
  for (int i = 0; i < 6; i += 2) cr_assert_eq(kt_pinned_free(pp, p[i]), KT_OK);
  kt_pinned_stats s1 = stats();
  cr_assert_eq(kt_pinned_trim(pp), KT_OK);
  kt_pinned_stats s2 = stats();
  cr_assert_lt(s2.mapped_bytes.current, s1.mapped_bytes.current, "trim gave nothing back");
  cr_assert_geq(s2.mapped_bytes.current, s2.allocated_bytes.current);
  for (int i = 1; i < 6; i += 2) check(p[i], (size_t)(i + 1) * 3 * MiB, (unsigned char)(i + 1));  /* live blocks untouched */
  assert_identities();
  if (!test_uses_cuda()) {
    kt_fake_counts c;
    kt_fake_get_counts(test_fake, &c);
    cr_assert_eq(c.host_bytes, (size_t)s2.mapped_bytes.current);
    kt_pinned_destroy(pp);   /* with three blocks still live */
    pp = NULL;
    kt_fake_get_counts(test_fake, &c);
    cr_assert_eq(c.host_bytes, 0, "destroy left %zu bytes pinned", c.host_bytes);
    cr_assert_eq(c.host_allocs, c.host_frees);
  }
}

Test(pinned, random_churn_keeps_blocks_disjoint_and_books_exact) {
  enum { SLOTS = 64 };
  void *p[SLOTS] = {0};
  size_t n[SLOTS] = {0};
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (int op = 0; op < 4000; op++) {
    int i = (int)(test_rand(&seed) % SLOTS);
    if (p[i]) {
      check(p[i], n[i] < 64 ? n[i] : 64, (unsigned char)i);
      check((char *)p[i] + n[i] - 1, 1, (unsigned char)i);
      cr_assert_eq(kt_pinned_free(pp, p[i]), KT_OK);
      p[i] = NULL;
    } else {
      /* log-uniform sizes from 16 B to 16 MiB */
      n[i] = (size_t)16 << (test_rand(&seed) % 21);
      n[i] += test_rand(&seed) % n[i];
      cr_assert_eq(kt_pinned_alloc(pp, n[i], &p[i]), KT_OK, "size %zu", n[i]);
      fill(p[i], n[i], (unsigned char)i);
    }
    if (op % 500 == 0) assert_identities();
  }
  for (int i = 0; i < SLOTS; i++)
    if (p[i]) {
      check(p[i], n[i], (unsigned char)i);
      cr_assert_eq(kt_pinned_free(pp, p[i]), KT_OK);
    }
  assert_identities();
  cr_assert_eq(stats().allocations.current, 0);
}

Test(pinned, a_block_used_on_a_stream_waits_for_it_before_reuse) {
  size_t n = 6 * MiB;
  void *a, *b, *c;
  kt_stream_t s = test_stream(1);
  cr_assert_eq(kt_pinned_alloc(pp, n, &a), KT_OK);
  fill(a, n, 0x11);
  cr_assert_eq(kt_pinned_record_stream(pp, a, 0, s), KT_OK);
  cr_assert_eq(kt_pinned_record_stream(pp, a, 0, s), KT_OK, "the same stream twice is one use");
  test_hold(s);   /* work on s now "runs" until test_release */
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  kt_pinned_stats st = stats();
  cr_assert_eq(st.pending_now, 1);
  cr_assert_eq(st.num_pending_frees, 1);
  cr_assert_eq(st.allocations.current, 1, "a waiting block still counts");
  assert_identities();
  cr_assert_eq(kt_pinned_alloc(pp, n, &b), KT_OK);
  cr_assert_neq(a, b, "a block was handed out while a stream that used it still ran");
  check(a, n, 0x11);   /* nobody wrote over it */
  test_release();
  cr_assert_eq(kt_pinned_alloc(pp, n, &c), KT_OK);
  cr_assert_eq(c, a, "the block should come back once the stream finished");
  cr_assert_eq(stats().pending_now, 0);
  cr_assert_eq(kt_pinned_free(pp, b), KT_OK);
  cr_assert_eq(kt_pinned_free(pp, c), KT_OK);
  assert_identities();
}

Test(pinned, record_stream_limits_and_bad_pointers) {
  void *a;
  cr_assert_eq(kt_pinned_alloc(pp, 100, &a), KT_OK);
  for (int i = 1; i <= KT_PINNED_MAX_USES; i++) cr_assert_eq(kt_pinned_record_stream(pp, a, 0, test_stream(i)), KT_OK);
  cr_assert_eq(kt_pinned_record_stream(pp, a, 0, test_stream(KT_PINNED_MAX_USES + 1)), KT_ERR_LIMIT);
  int local;
  cr_assert_eq(kt_pinned_record_stream(pp, &local, 0, test_stream(1)), KT_ERR_INVALID);
  cr_assert_eq(kt_pinned_free(pp, a), KT_OK);
  cr_assert_eq(kt_pinned_trim(pp), KT_OK);   /* polls: the fake's events complete at once */
  kt_pinned_stats st = stats();
  cr_assert_eq(st.pending_now, 0);
  cr_assert_eq(st.allocations.current, 0);
  if (!test_uses_cuda()) {
    kt_fake_counts c;
    kt_fake_get_counts(test_fake, &c);
    cr_assert_eq(c.live_events, 0, "events of released blocks are destroyed");
  }
  assert_identities();
}

/* Only on CUDA: the memory is page-locked, and an async copy round trip through the
 * device returns the bytes. */
Test(pinned, cuda_blocks_are_page_locked_and_copy_asynchronously) {
  if (!test_uses_cuda()) cr_skip_test("needs the CUDA backend");
  size_t n = 9 * MiB + 123;
  void *h, *back, *d;
  cr_assert_eq(kt_pinned_alloc(pp, n, &h), KT_OK);
  cr_assert_eq(kt_pinned_alloc(pp, n, &back), KT_OK);
  struct cudaPointerAttributes attr;
  cr_assert_eq(cudaPointerGetAttributes(&attr, (char *)h + n / 2), cudaSuccess);
  cr_assert_eq(attr.type, cudaMemoryTypeHost, "block is not page-locked host memory");
  for (size_t i = 0; i < n; i++) ((unsigned char *)h)[i] = (unsigned char)(i * 131 + 7);
  memset(back, 0, n);
  cudaStream_t s = (cudaStream_t)test_stream(1);
  cr_assert_eq(cudaMalloc(&d, n), cudaSuccess);
  cr_assert_eq(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s), cudaSuccess);
  cr_assert_eq(cudaMemcpyAsync(back, d, n, cudaMemcpyDeviceToHost, s), cudaSuccess);
  cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
  cr_assert_eq(memcmp(h, back, n), 0);
  cudaFree(d);
  cr_assert_eq(kt_pinned_free(pp, h), KT_OK);
  cr_assert_eq(kt_pinned_free(pp, back), KT_OK);
}
