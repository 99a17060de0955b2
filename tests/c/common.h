/* tests/c/common.h — helpers shared by the Criterion suites.
 * KT_TEST_BACKEND=fake (default) or cuda picks the backend of the conformance and
 * stress suites; with cuda and no device they skip, unless KT_REQUIRE_GPU=1. */
#ifndef KT_TESTS_COMMON_H
#define KT_TESTS_COMMON_H

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>

#include "kitsune/alloc.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

static inline int test_uses_cuda(void) {
  const char *b = getenv("KT_TEST_BACKEND");
  return b && !strcmp(b, "cuda");
}

/* The backend under test; skips the test when CUDA is asked for and absent. */
static kt_backend *test_fake;
static inline const kt_backend *test_backend(size_t fake_capacity) {
  if (test_uses_cuda()) {
    if (kt_cuda_device_count() == 0) {
      const char *req = getenv("KT_REQUIRE_GPU");
      if (req && *req == '1') cr_assert_fail("KT_REQUIRE_GPU=1 but no CUDA device is visible");
      cr_skip_test("no CUDA device: the CUDA backend run is skipped");
    }
    return kt_cuda_backend();
  }
  test_fake = kt_fake_backend_create(fake_capacity);
  cr_assert_not_null(test_fake);
  return test_fake;
}
static inline void test_backend_done(void) {
  if (test_fake) kt_fake_backend_destroy(test_fake);
  test_fake = NULL;
}

/* Streams: fake handles on the fake backend, real streams on CUDA. 0 = default stream. */
static kt_stream_t test_streams[16];
static inline kt_stream_t test_stream(int i) {
  if (i == 0) return NULL;
  if (!test_streams[i]) {
    if (test_uses_cuda()) {
      cudaStream_t s;
      cr_assert_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
      test_streams[i] = s;
    } else {
      test_streams[i] = (kt_stream_t)(uintptr_t)(0x5000 + 0x40 * i);
    }
  }
  return test_streams[i];
}

/* Keep work on a stream "running" until test_release(): events recorded on it
 * after this stay incomplete. Fake: held events; CUDA: a host function that spins. */
static atomic_int test_gate;
static void CUDART_CB test_gate_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&test_gate)) {}
}
static inline void test_hold(kt_stream_t s) {
  if (test_uses_cuda()) {
    atomic_store(&test_gate, 0);
    cr_assert_eq(cudaLaunchHostFunc((cudaStream_t)s, test_gate_fn, NULL), cudaSuccess);
  } else {
    kt_fake_hold_events(test_fake, 1);
  }
}
static inline void test_release(void) {
  if (test_uses_cuda()) {
    atomic_store(&test_gate, 1);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  } else {
    kt_fake_complete_events(test_fake);
    kt_fake_hold_events(test_fake, 0);
  }
}

/* KT_TEST_VMM=1: the suites' pools map granules of address ranges (kt_pool_options.vmm). */
static inline int test_vmm(void) {
  const char *v = getenv("KT_TEST_VMM");
  return v && *v == '1';
}

/* A pool that keeps idle segments cached (release_on_grow = 0): for tests that
 * check which address a stream gets back or when an OOM retry happens. */
static inline kt_pool_t *test_pool_keep(const kt_backend *be) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.release_on_grow = 0;
  o.vmm = test_vmm();
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, be, &p), KT_OK);
  return p;
}

static inline kt_pool_t *test_pool(const kt_backend *be, size_t limit) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.memory_limit = limit;
  o.vmm = test_vmm();
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, be, &p), KT_OK);
  return p;
}

/* A suite whose tests each get a fresh pool (`pool`) over a fresh fake backend (`be`). */
#define FAKE_POOL_SUITE(name, ...)                                                          \
  static kt_backend *be;                                                                    \
  static kt_pool_t *pool;                                                                   \
  static void name##_setup(void) { be = kt_fake_backend_create(0); pool = test_pool(be, 0); } \
  static void name##_teardown(void) { kt_pool_destroy(pool); kt_fake_backend_destroy(be); }  \
  TestSuite(name, .init = name##_setup, .fini = name##_teardown, ##__VA_ARGS__)

/* A suite whose tests each get a fresh pinned pool (`pp`) over the backend under test
 * (`hb`: the host fake, or cudaHostAlloc with KT_TEST_BACKEND=cuda). Needs kitsune/pinned.h. */
#define PINNED_POOL_SUITE(name, ...)                                                          \
  static const kt_backend *hb;                                                              \
  static kt_pinned_pool_t *pp;                                                              \
  static void name##_setup(void) {                                                          \
    hb = test_backend(0);                                                                   \
    cr_assert_eq(kt_pinned_create(hb, &pp), KT_OK);                                         \
  }                                                                                         \
  static void name##_teardown(void) {                                                       \
    if (pp) kt_pinned_destroy(pp);                                                          \
    pp = NULL;                                                                              \
    test_backend_done();                                                                    \
  }                                                                                         \
  TestSuite(name, .init = name##_setup, .fini = name##_teardown, ##__VA_ARGS__)

/* xorshift64*: deterministic per seed */
static inline uint64_t test_rand(uint64_t *s) {
  *s ^= *s >> 12; *s ^= *s << 25; *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

static inline void assert_stats_identities(kt_pool_t *p) {
  kt_stats st;
  cr_assert_eq(kt_get_stats(p, &st), KT_OK);
  const kt_stat *all[] = {&st.allocated_bytes, &st.active_bytes, &st.reserved_bytes, &st.requested_bytes,
                          &st.allocations, &st.segments};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    cr_assert_eq(all[i]->current, all[i]->allocated - all[i]->freed, "stat %zu: %lld != %lld - %lld", i,
                 (long long)all[i]->current, (long long)all[i]->allocated, (long long)all[i]->freed);
  cr_assert_geq(st.active_bytes.current, st.allocated_bytes.current);
  cr_assert_geq(st.reserved_bytes.current, st.active_bytes.current);
  cr_assert_geq(st.allocated_bytes.peak, st.allocated_bytes.current);
  cr_assert_geq(st.reserved_bytes.peak, st.reserved_bytes.current);
  cr_assert_eq(st.num_allocs - st.num_frees, (uint64_t)st.allocations.current);
  uint64_t live = 0;
  for (int c = 0; c < KT_NUM_CLASSES; c++) live += st.class_live[c];
  cr_assert_leq(live, (uint64_t)st.allocations.current);
  cr_assert_eq(kt_pool_validate(p), KT_OK);
}

#endif
