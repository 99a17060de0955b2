/* Unit: size classes, slab geometry, arena bins. */
#include "common.h"
#include "internal.h"

Test(sizeclass, table_matches_formula_for_every_size) {
  for (size_t s = 1; s <= KT_LARGE_THRESHOLD; s++)
    cr_assert_eq(kt_size_class(s), kt_size_class_formula(s), "size %zu", s);
  cr_assert_eq(kt_size_class(KT_LARGE_THRESHOLD + 1), -1);
  cr_assert_eq(kt_size_class_formula(KT_LARGE_THRESHOLD + 1), -1);
}

Test(sizeclass, class_sizes_cover_requests_and_bound_waste) {
  for (size_t s = 1; s <= KT_LARGE_THRESHOLD; s++) {
    int c = kt_size_class(s);
    size_t cs = kt_class_size(c);
    cr_assert_geq(cs, s);
    cr_assert(c == 0 || kt_class_size(c - 1) < s, "size %zu not in its smallest class", s);
    cr_assert_eq(cs % KT_QUANTUM, 0);
    if (s >= 4096) cr_assert_lt((double)(cs - s) / (double)s, 0.125, "size %zu waste", s);
    else cr_assert_lt(cs - s, KT_QUANTUM, "size %zu", s);
  }
  cr_assert_eq(kt_class_size(0), 512);
  cr_assert_eq(kt_class_size(7), 4096);
  cr_assert_eq(kt_class_size(KT_NUM_CLASSES - 1), KT_LARGE_THRESHOLD);
  cr_assert_eq(kt_class_size(KT_NUM_CLASSES), 0);
  cr_assert_eq(kt_class_size(-1), 0);
}

Test(sizeclass, slab_geometry_and_index_division) {
  kt__sizeclass_init();
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    const kt_class_geom *g = &kt__geom[c];
    cr_assert_eq(g->slab_bytes % KT_PAGE, 0);
    cr_assert_geq(g->nblocks, 1);
    cr_assert_eq(g->nblocks, g->slab_bytes / g->size);
    cr_assert_leq(g->slab_bytes % g->size, g->slab_bytes / 16, "class %d tail waste", c);
    for (uint64_t i = 0; i < g->nblocks; i++) {   /* multiply-shift index == division */
      uint64_t off = i * g->size;
      cr_assert_eq((off * g->magic) >> 40, i, "class %d block %llu", c, (unsigned long long)i);
    }
  }
}

Test(bins, floor_classes_are_monotone_and_in_range) {
  int prev = 0;
  for (size_t s = KT_QUANTUM; s <= ((size_t)1 << 30); s += (s < (1u << 22) ? KT_QUANTUM : (s >> 6))) {
    s &= ~(size_t)(KT_QUANTUM - 1);
    int b = kt__bin_of(s);
    cr_assert_geq(b, prev);
    cr_assert_lt(b, KT_NUM_BINS);
    prev = b;
  }
  cr_assert_lt(kt__bin_of(((size_t)1 << 48) - KT_QUANTUM), KT_NUM_BINS);
  /* every extent in a bin above bin_of(s) is larger than s */
  for (size_t s = 4608; s < (64u << 20); s = s * 9 / 8 + KT_QUANTUM) {
    s &= ~(size_t)(KT_QUANTUM - 1);
    size_t t = s + KT_QUANTUM;
    while (kt__bin_of(t) == kt__bin_of(s)) t += KT_QUANTUM;
    cr_assert_gt(t, s);
  }
}
