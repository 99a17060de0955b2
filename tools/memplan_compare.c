/* tools/memplan_compare.c — kt_memplan_shared against the one of an earlier commit
 * (built by tools/memplan_compare.sh with its symbols renamed ref_*): the same offsets
 * and arena on random instances (groups, zero sizes, share functions of every
 * density), and the host time of each. For changes to the packer meant to change
 * nothing but its speed. Exit status 1 when any instance differs.
 *   memplan_compare [instances]      (default 3000) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kitsune/memplan.h"

kt_status ref_kt_memplan_shared(const kt_memplan_block *b, int32_t n, uint64_t align, kt_memplan_share_fn share,
                                void *ctx, uint64_t *offsets, uint64_t *total);

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

typedef struct { int32_t n; unsigned char *m; } matrix;
static int share(void *ctx, int32_t i, int32_t j) {
  const matrix *x = ctx;
  return x->m[(size_t)i * (size_t)x->n + (size_t)j];
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  int instances = argc > 1 ? atoi(argv[1]) : 3000, differ = 0, failed = 0;
  double t_ref = 0, t_now = 0;
  for (int t = 0; t < instances; t++) {
    int32_t n = (int32_t)(rnd() % (t % 30 == 29 ? 400 : 120));   /* one in 30 large */
    kt_memplan_block *b = malloc(sizeof *b * ((size_t)n + 1));
    matrix x = {n, malloc((size_t)n * (size_t)n + 1)};
    uint64_t *o1 = malloc(sizeof *o1 * ((size_t)n + 1)), *o2 = malloc(sizeof *o2 * ((size_t)n + 1)), a1 = 0, a2 = 0;
    if (!b || !x.m || !o1 || !o2) {
      fprintf(stderr, "memplan_compare: out of host memory\n");
      return 2;
    }
    int64_t span = 2 * (int64_t)n + 2;
    for (int32_t i = 0; i < n; i++) {
      int64_t start = (int64_t)(rnd() % (uint64_t)span);
      int64_t len = 1 + (int64_t)(rnd() % (rnd() % 4 ? 20 : (uint64_t)span));
      uint64_t size = rnd() % 10 == 0 ? 0 : (1 + rnd() % 4096) * (rnd() % 3 ? 512 : 100000);
      b[i] = (kt_memplan_block){size, start, start + len, (int32_t)(rnd() % 3)};
    }
    int density = (int)(rnd() % 101);
    for (size_t k = 0; k < (size_t)n * (size_t)n; k++) x.m[k] = (int)(rnd() % 100) < density;
    kt_memplan_share_fn fn = t % 3 ? share : NULL;   /* a third by groups */
    double t0 = now_s();
    kt_status s1 = ref_kt_memplan_shared(b, n, 512, fn, &x, o1, &a1);
    double t1 = now_s();
    kt_status s2 = kt_memplan_shared(b, n, 512, fn, &x, o2, &a2);
    t_now += now_s() - t1;
    t_ref += t1 - t0;
    failed |= s1 != KT_OK || s2 != KT_OK;
    differ += s1 != s2 || a1 != a2 || (s1 == KT_OK && n && memcmp(o1, o2, sizeof *o1 * (size_t)n));
    free(b);
    free(x.m);
    free(o1);
    free(o2);
  }
  printf("%d instances: %d differ%s; host seconds, reference %.3f, now %.3f (%.1fx)\n", instances, differ,
         failed ? " (some failed)" : "", t_ref, t_now, t_now > 0 ? t_ref / t_now : 0.0);
  return differ || failed;
}
