/* Integration: NVTX annotations reach a tool. The recording injection library
 * (tests/c/nvtx_record.c, built as build/libnvtx_record.so or $KT_NVTX_LIB) is
 * loaded by NVTX itself through NVTX_INJECTION64_PATH, as Nsight tools are. */
#include <stdio.h>
#include <unistd.h>

#include "common.h"

static int count_lines(const char *path, const char *prefix) {
  FILE *f = fopen(path, "r");
  cr_assert_not_null(f, "no NVTX record at %s: the injection library was not loaded", path);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f)) n += !strncmp(line, prefix, strlen(prefix));
  fclose(f);
  return n;
}

Test(nvtx, ranges_heaps_and_regions_are_recorded) {
  const char *lib = getenv("KT_NVTX_LIB");
  char libpath[4096];
  if (!lib) { cr_assert_not_null(realpath("build/libnvtx_record.so", libpath), "build/libnvtx_record.so missing: run make"); lib = libpath; }
  char rec[] = "/tmp/kt_nvtx_XXXXXX";
  int fd = mkstemp(rec);
  close(fd);
  setenv("NVTX_INJECTION64_PATH", lib, 1);
  setenv("KT_NVTX_RECORD", rec, 1);

  kt_backend *be = kt_fake_backend_create(24 * MiB);
  kt_pool_t *pool = test_pool(be, 0);
  void *small, *large, *big;
  cr_assert_eq(kt_alloc(pool, 1000, NULL, &small), KT_OK);
  cr_assert_eq(kt_alloc(pool, 5 * MiB, NULL, &large), KT_OK);
  cr_assert_eq(kt_free(pool, small, 1000, NULL), KT_OK);
  cr_assert_eq(kt_free(pool, large, 0, NULL), KT_OK);
  cr_assert_eq(kt_alloc(pool, 20 * MiB, (kt_stream_t)0x77, &big), KT_OK);  /* needs an OOM retry */
  cr_assert_eq(kt_free(pool, big, 0, (kt_stream_t)0x77), KT_OK);
  cr_assert_eq(kt_empty_cache(pool), KT_OK);
  kt_pool_destroy(pool);
  kt_fake_backend_destroy(be);

  cr_assert_eq(count_lines(rec, "init core"), 1);
  cr_assert_eq(count_lines(rec, "init mem"), 1);
  cr_assert_eq(count_lines(rec, "domain kitsune"), 1);
  cr_assert_geq(count_lines(rec, "push kitsune kitsune:segment_reserve"), 3);
  cr_assert_geq(count_lines(rec, "push kitsune kitsune:segment_release"), 2);
  cr_assert_eq(count_lines(rec, "push kitsune kitsune:empty_cache"), 1);
  cr_assert_eq(count_lines(rec, "push kitsune kitsune:oom_retry"), 1);
  cr_assert_eq(count_lines(rec, "push kitsune"), count_lines(rec, "pop kitsune"), "unbalanced ranges");
  cr_assert_eq(count_lines(rec, "heap_register kitsune"), count_lines(rec, "heap_unregister kitsune"));
  cr_assert_eq(count_lines(rec, "heap_register kitsune"), 2, "two segments were reserved");
  cr_assert_eq(count_lines(rec, "region_register kitsune"), 3);
  cr_assert_eq(count_lines(rec, "region_unregister kitsune"), 3);
  char want[128];
  snprintf(want, sizeof want, "region_register kitsune %p 1024", small);
  cr_assert_eq(count_lines(rec, want), 1, "block region (ptr, rounded size) for the small block");
  snprintf(want, sizeof want, "region_register kitsune %p %zu", large, 5 * MiB);
  cr_assert_eq(count_lines(rec, want), 1);
  unlink(rec);
}
