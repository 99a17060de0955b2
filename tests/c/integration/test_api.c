/* Integration: the public API only, over the host fake backend. */
#include <stdio.h>
#include <unistd.h>

#include "common.h"

FAKE_POOL_SUITE(api);

#define S1 ((kt_stream_t)0x1100)
#define S2 ((kt_stream_t)0x2200)
#define S3 ((kt_stream_t)0x3300)

Test(api, zero_null_and_bad_arguments) {
  void *p = (void *)1;
  cr_assert_eq(kt_alloc(pool, 0, NULL, &p), KT_OK);
  cr_assert_null(p);
  cr_assert_eq(kt_free(pool, NULL, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, (void *)0x1234, 0, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_alloc(NULL, 8, NULL, &p), KT_ERR_INVALID);
  cr_assert_eq(kt_record_stream(pool, (void *)0x1234, S1), KT_ERR_INVALID);
  cr_assert_eq(kt_set_memory_fraction(pool, 0.0), KT_ERR_INVALID);
  cr_assert_eq(kt_set_memory_fraction(pool, 1.5), KT_ERR_INVALID);
  cr_assert_eq(kt_pool_create(NULL, NULL, NULL), KT_ERR_INVALID);
  cr_assert_str_eq(kt_status_str(KT_ERR_OOM), "out of memory");
}

Test(api, double_free_wrong_size_and_interior_pointer_are_rejected) {
  void *p;
  cr_assert_eq(kt_alloc(pool, 3000, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(pool, (char *)p + 512, 0, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_free(pool, p, 9000, NULL), KT_ERR_INVALID, "size of another class");
  cr_assert_eq(kt_free(pool, p, 3000, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, p, 3000, NULL), KT_ERR_INVALID, "double free");
  void *l;
  cr_assert_eq(kt_alloc(pool, 5 * MiB, NULL, &l), KT_OK);
  cr_assert_eq(kt_free(pool, l, 7 * MiB, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_free(pool, (char *)l + 4096, 0, NULL), KT_ERR_INVALID);
  cr_assert_eq(kt_free(pool, l, 5 * MiB, NULL), KT_OK);
  assert_stats_identities(pool);
}

Test(api, alignment_and_no_overlap) {
  void *ptrs[300];
  size_t sizes[300];
  uint64_t seed = 7;
  for (int i = 0; i < 300; i++) {
    sizes[i] = 1 + test_rand(&seed) % (3 * MiB);
    cr_assert_eq(kt_alloc(pool, sizes[i], (kt_stream_t)(uintptr_t)(0x100 * (i % 3)), &ptrs[i]), KT_OK);
    cr_assert_eq((uintptr_t)ptrs[i] % KT_QUANTUM, 0);
    cr_assert(kt_fake_owns(be, ptrs[i], sizes[i]));
  }
  for (int i = 0; i < 300; i++)
    for (int j = i + 1; j < 300; j++) {
      uintptr_t a = (uintptr_t)ptrs[i], b = (uintptr_t)ptrs[j];
      cr_assert(a + sizes[i] <= b || b + sizes[j] <= a, "blocks %d and %d overlap", i, j);
    }
  for (int i = 0; i < 300; i++) cr_assert_eq(kt_free(pool, ptrs[i], sizes[i], NULL), KT_OK);
  assert_stats_identities(pool);
}

Test(api, oom_releases_cache_retries_then_reports) {
  kt_pool_destroy(pool);
  pool = test_pool_keep(be);   /* the OOM retry is what releases the cache here */
  kt_fake_set_capacity(be, 64 * MiB);
  void *a, *b, *c;
  kt_fake_hold_events(be, 1);                              /* S1's work still runs */
  cr_assert_eq(kt_alloc(pool, 40 * MiB, S1, &a), KT_OK);
  cr_assert_eq(kt_free(pool, a, 0, S1), KT_OK);            /* 40 MiB cached, confined to S1 */
  cr_assert_eq(kt_alloc(pool, 30 * MiB, S2, &b), KT_OK);   /* needs the cache released: retry */
  kt_fake_hold_events(be, 0);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_alloc_retries, 1);
  cr_assert_eq(st.num_ooms, 0);
  cr_assert_eq(kt_alloc(pool, 40 * MiB, S2, &c), KT_ERR_OOM);
  const kt_oom_info *o = kt_last_oom();
  cr_assert_eq(o->requested, 40 * MiB);
  cr_assert_eq(o->live, 30 * MiB);
  cr_assert_eq(o->reserved, 30 * MiB);
  cr_assert_eq(o->device_total, 64 * MiB);
  cr_assert_eq(o->hit_limit, 0);
  char msg[512];
  kt_format_oom(o, msg, sizeof msg);
  cr_assert(strstr(msg, "tried to allocate 40.00 MiB"), "%s", msg);
  cr_assert(strstr(msg, "live 30.00 MiB"), "%s", msg);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_ooms, 1);
  cr_assert_eq(kt_free(pool, b, 0, S2), KT_OK);
  cr_assert_eq(kt_alloc(pool, 40 * MiB, S2, &c), KT_OK, "the next allocation after frees succeeds");
  cr_assert_eq(kt_free(pool, c, 0, S2), KT_OK);
  assert_stats_identities(pool);
}

Test(api, memory_limit_and_fraction) {
  cr_assert_eq(kt_set_memory_limit(pool, 10 * MiB), KT_OK);
  cr_assert_eq(kt_get_memory_limit(pool), 10 * MiB);
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 8 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 4 * MiB, NULL, &b), KT_ERR_OOM);
  cr_assert_eq(kt_last_oom()->hit_limit, 1);
  cr_assert_eq(kt_last_oom()->limit, 10 * MiB);
  char msg[512];
  kt_format_oom(kt_last_oom(), msg, sizeof msg);
  cr_assert(strstr(msg, "limit"), "%s", msg);
  kt_fake_counts fc;
  kt_fake_get_counts(be, &fc);
  cr_assert_eq(fc.failed_reserves, 0, "a limit refuses before asking the backend");
  kt_fake_set_capacity(be, 100 * MiB);
  cr_assert_eq(kt_set_memory_fraction(pool, 0.25), KT_OK);
  cr_assert_eq(kt_get_memory_limit(pool), 25 * MiB);
  cr_assert_eq(kt_alloc(pool, 4 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_set_memory_limit(pool, 0), KT_OK);
  cr_assert_eq(kt_free(pool, a, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, b, 0, NULL), KT_OK);
}

Test(api, record_stream_defers_reuse_until_events_complete) {
  void *p, *q;
  cr_assert_eq(kt_alloc(pool, 4096, S1, &p), KT_OK);
  cr_assert_eq(kt_record_stream(pool, p, S2), KT_OK);
  cr_assert_eq(kt_record_stream(pool, p, S2), KT_OK);   /* once per stream */
  cr_assert_eq(kt_record_stream(pool, p, S1), KT_OK);   /* own stream: nothing to do */
  kt_block_info bi;
  cr_assert_eq(kt_block_query(pool, p, &bi), KT_OK);
  cr_assert_eq(bi.num_uses, 1);
  cr_assert_eq(bi.uses[0], S2);
  kt_fake_hold_events(be, 1);
  cr_assert_eq(kt_free(pool, p, 4096, S1), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.current, 0);
  cr_assert_eq(st.active_bytes.current, 4096, "pending bytes stay active");
  for (int i = 0; i < 200; i++) {  /* the slab's other 15 blocks, then new slabs */
    cr_assert_eq(kt_alloc(pool, 4096, S1, &q), KT_OK);
    cr_assert_neq(q, p, "reused while S2 may still use it");
  }
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_gt(st.reserved_bytes.current, 0);
  kt_fake_complete_events(be);
  kt_fake_hold_events(be, 0);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);  /* drains */
  kt_get_stats(pool, &st);
  cr_assert_eq(st.active_bytes.current, st.allocated_bytes.current);
  cr_assert_eq(kt_alloc(pool, 4096, S1, &q), KT_OK);
  cr_assert_eq(q, p, "after the events complete the block returns to its stream");
  cr_assert_eq(st.num_pending_frees, 1);
  assert_stats_identities(pool);
}

Test(api, record_stream_on_large_and_many_streams) {
  void *p, *q;
  cr_assert_eq(kt_alloc(pool, 6 * MiB, S1, &p), KT_OK);
  for (int i = 1; i <= KT_MAX_USES + 2; i++) cr_assert_eq(kt_record_stream(pool, p, (kt_stream_t)(uintptr_t)(0x9000 + i)), KT_OK);
  kt_fake_counts before, after;
  kt_fake_get_counts(be, &before);
  cr_assert_eq(kt_free(pool, p, 0, S1), KT_OK);   /* too many streams: synchronizes instead */
  kt_fake_get_counts(be, &after);
  cr_assert_eq(after.syncs, before.syncs + 1);
  cr_assert_eq(kt_alloc(pool, 6 * MiB, S1, &q), KT_OK);
  cr_assert_eq(q, p);
  cr_assert_eq(kt_record_stream(pool, q, S2), KT_OK);
  kt_fake_hold_events(be, 1);
  cr_assert_eq(kt_free(pool, q, 0, S1), KT_OK);
  cr_assert_eq(kt_free(pool, q, 0, S1), KT_ERR_INVALID, "double free of a pending block");
  void *r;
  cr_assert_eq(kt_alloc(pool, 6 * MiB, S1, &r), KT_OK);
  cr_assert_neq(r, q);
  kt_fake_complete_events(be);
  cr_assert_eq(kt_free(pool, r, 0, S1), KT_OK);
  cr_assert_eq(kt_alloc(pool, 12 * MiB, S1, &r), KT_OK);
  assert_stats_identities(pool);
}

Test(api, empty_cache_returns_everything_idle) {
  void *p[100];
  for (int i = 0; i < 100; i++) cr_assert_eq(kt_alloc(pool, (size_t)(i + 1) * 40000, (kt_stream_t)(uintptr_t)(i % 4), &p[i]), KT_OK);
  for (int i = 0; i < 100; i += 2) cr_assert_eq(kt_free(pool, p[i], 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_gt(st.reserved_bytes.current, 0);
  for (int i = 1; i < 100; i += 2) cr_assert_eq(kt_free(pool, p[i], 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.reserved_bytes.current, 0);
  cr_assert_eq(st.segments.current, 0);
  kt_fake_counts fc;
  kt_fake_get_counts(be, &fc);
  cr_assert_eq(fc.reserved_bytes, 0);
  assert_stats_identities(pool);
}

Test(api, lifetimes_are_tracked) {
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 777, S3, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 2 * MiB + 1, S1, &b), KT_OK);
  kt_block_info ia, ib;
  cr_assert_eq(kt_block_query(pool, a, &ia), KT_OK);
  cr_assert_eq(kt_block_query(pool, b, &ib), KT_OK);
  cr_assert_eq(ia.stream, S3);
  cr_assert_eq(ia.size, 1024);
  cr_assert_eq(ia.requested, 777);
  cr_assert_eq(ia.size_class, 1);
  cr_assert_eq(ib.size_class, -1);
  cr_assert_eq(ib.size, 2 * MiB + 512);
  cr_assert_gt(ia.alloc_ns, 0);
  cr_assert_geq(ib.alloc_ns + 1000, ia.alloc_ns, "allocation times in order (1 us slack for tick calibration)");
  cr_assert_eq(kt_free(pool, a, 0, S3), KT_OK);
  cr_assert_eq(kt_block_query(pool, a, &ia), KT_ERR_INVALID);
  cr_assert_eq(kt_free(pool, b, 0, S1), KT_OK);
}

Test(api, trace_records_one_line_per_event) {
  char path[] = "/tmp/kt_trace_XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  close(fd);
  cr_assert_eq(kt_trace_start(pool, path), KT_OK);
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 100, S1, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 3 * MiB, S2, &b), KT_OK);
  cr_assert_eq(kt_record_stream(pool, b, S1), KT_OK);
  cr_assert_eq(kt_free(pool, a, 100, S1), KT_OK);
  cr_assert_eq(kt_free(pool, b, 3 * MiB, S2), KT_OK);
  cr_assert_eq(kt_trace_stop(pool), KT_OK);
  cr_assert_eq(kt_alloc(pool, 100, S1, &a), KT_OK);   /* not traced */
  FILE *f = fopen(path, "r");
  char line[256];
  const char *want[] = {"alloc", "alloc", "record_stream", "free", "free"};
  cr_assert_not_null(fgets(line, sizeof line, f));
  cr_assert_str_eq(line, "thread,time_ns,action,ptr,size,stream\n");
  int n = 0;
  unsigned long long prev_t = 0;
  while (fgets(line, sizeof line, f)) {
    long tid; unsigned long long t, ptr, stream; size_t size; char action[32];
    cr_assert_eq(sscanf(line, "%ld,%llu,%31[^,],%llx,%zu,%llx", &tid, &t, action, &ptr, &size, &stream), 6, "%s", line);
    cr_assert_lt(n, 5);
    cr_assert_str_eq(action, want[n]);
    cr_assert_geq(t, prev_t);
    prev_t = t;
    if (n == 0) { cr_assert_eq(ptr, (uintptr_t)a); cr_assert_eq(size, 100); cr_assert_eq(stream, (uintptr_t)S1); }
    n++;
  }
  fclose(f);
  unlink(path);
  cr_assert_eq(n, 5);
  cr_assert_eq(kt_trace_start(pool, "/nonexistent-dir/x.csv"), KT_ERR_IO);
}

Test(api, too_many_streams_is_a_clear_error) {
  void *p;
  for (int i = 0; i < KT_MAX_STREAMS; i++)
    cr_assert_eq(kt_alloc(pool, 512, (kt_stream_t)(uintptr_t)(0x10000 + 16 * i), &p), KT_OK);
  cr_assert_eq(kt_alloc(pool, 512, (kt_stream_t)(uintptr_t)0xdead0, &p), KT_ERR_LIMIT);
}

Test(api, backend_failure_is_not_a_crash) {
  /* a small request tries a 20 MiB segment, then 2 MiB, then the same after the retry */
  kt_fake_fail_next_reserves(be, 4);
  void *p;
  cr_assert_eq(kt_alloc(pool, 100, NULL, &p), KT_ERR_OOM);
  cr_assert_eq(kt_alloc(pool, 100, NULL, &p), KT_OK);
  cr_assert_eq(kt_free(pool, p, 100, NULL), KT_OK);
  kt_fake_fail_next_reserves(be, 1);   /* only the first try fails: the retry succeeds */
  cr_assert_eq(kt_alloc(pool, 30 * MiB, NULL, &p), KT_OK);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_ooms, 1);
  cr_assert_eq(st.num_alloc_retries, 2);
  kt_fake_counts fc;
  kt_fake_get_counts(be, &fc);
  cr_assert_eq(fc.failed_reserves, 5);
}

Test(api, reset_accumulated_restarts_cumulative_values_only) {
  void *a, *b;
  cr_assert_eq(kt_alloc(pool, 4096, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(pool, 3 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(pool, a, 0, NULL), KT_OK);
  kt_reset_accumulated_stats(pool);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.allocated, 0);
  cr_assert_eq(st.allocated_bytes.freed, 0);
  cr_assert_eq(st.num_allocs, 0);
  cr_assert_eq(st.allocated_bytes.current, 3 * MiB, "current untouched");
  cr_assert_eq(st.allocated_bytes.peak, 3 * MiB + 4096, "peak untouched");
  cr_assert_eq(kt_alloc(pool, 4096, NULL, &a), KT_OK);
  kt_get_stats(pool, &st);
  cr_assert_eq(st.allocated_bytes.allocated, 4096);
  cr_assert_eq(st.num_allocs, 1);
  cr_assert_eq(st.class_allocs[kt_size_class(4096)], 1);
}

Test(api, absurd_sizes_are_refused_with_a_full_diagnosis) {
  void *a, *p;
  cr_assert_eq(kt_alloc(pool, 5 * MiB, NULL, &a), KT_OK);
  kt_fake_counts before, after;
  kt_fake_get_counts(be, &before);
  cr_assert_eq(kt_alloc(pool, KT_MAX_ALLOC + 1, NULL, &p), KT_ERR_OOM);
  cr_assert_eq(kt_alloc(pool, SIZE_MAX, NULL, &p), KT_ERR_OOM);
  kt_fake_get_counts(be, &after);
  cr_assert_eq(after.reserves + after.failed_reserves, before.reserves + before.failed_reserves, "backend not asked");
  cr_assert_eq(kt_last_oom()->requested, SIZE_MAX);
  cr_assert_eq(kt_last_oom()->live, 5 * MiB);
  kt_stats st;
  kt_get_stats(pool, &st);
  cr_assert_eq(st.num_ooms, 2);
  cr_assert_eq(st.allocated_bytes.current, 5 * MiB);
}
