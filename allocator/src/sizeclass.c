/* allocator/src/sizeclass.c — size classes and slab geometry.
 *
 * Derivation. Every size is a multiple of the 512-byte quantum.
 *   Up to 4 KiB: one class per quantum: 512, 1024, ..., 4096 (classes 0..7).
 *   Above 4 KiB: 8 classes per power of two. For a request s in (2^k, 2^(k+1)],
 *   k >= 12, the spacing is 2^(k-3) and the class is the next multiple of it:
 *       class(s) = 8 + 8*(k-12) + (((s-1) >> (k-3)) - 8)
 *       size(c)  = 2^k + (j+1) * 2^(k-3)      with c = 8 + 8*(k-12) + j, j in 0..7
 *   up to 2^20 (KT_LARGE_THRESHOLD): 8 + 8*8 = 72 classes.
 *   Worst-case internal waste for s >= 4 KiB is just above a class boundary:
 *       (size(c) - s) / s < 2^(k-3) / 2^k = 12.5 %
 *   and below 4 KiB the waste is under 512 bytes.
 *   The class boundaries are multiples of 512, so a table indexed by (s-1)>>9
 *   (2048 entries) is exact; kt_size_class_formula is the reference it is
 *   checked against for every size in tests/c/unit/test_sizeclass.c.
 *
 * Slabs. A class's slab is the smallest multiple of 64 KiB (the radix page) that
 * holds at least one block and wastes at most 1/16 of itself in its tail. For
 * classes >= 64 KiB, 8 blocks are always an exact multiple of 64 KiB, so the
 * search ends by 8 blocks; classes >= 512 KiB are multiples of 64 KiB, one block.
 */
#include "internal.h"

uint8_t kt__class_table[KT_LARGE_THRESHOLD / KT_QUANTUM];
kt_class_geom kt__geom[KT_NUM_CLASSES];

static int floor_log2(size_t x) { return 63 - __builtin_clzll((unsigned long long)x); }

int kt_size_class_formula(size_t s) {
  if (s == 0) s = 1;
  if (s > KT_LARGE_THRESHOLD) return -1;
  if (s <= 4096) return (int)((s + KT_QUANTUM - 1) / KT_QUANTUM) - 1;
  int k = floor_log2(s - 1);
  return 8 + 8 * (k - 12) + (int)(((s - 1) >> (k - 3)) - 8);
}

size_t kt_class_size(int c) {
  if (c < 0 || c >= KT_NUM_CLASSES) return 0;
  if (c < 8) return (size_t)(c + 1) * KT_QUANTUM;
  int k = 12 + (c - 8) / 8, j = (c - 8) % 8;
  return ((size_t)1 << k) + (size_t)(j + 1) * ((size_t)1 << (k - 3));
}

int kt_size_class(size_t s) {
  if (s == 0) s = 1;
  if (s > KT_LARGE_THRESHOLD) return -1;
  kt__sizeclass_init();
  return kt__class_of(s);
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init_once(void) {
  for (size_t i = 0; i < KT_LARGE_THRESHOLD / KT_QUANTUM; i++)
    kt__class_table[i] = (uint8_t)kt_size_class_formula((i + 1) * KT_QUANTUM);
  for (int c = 0; c < KT_NUM_CLASSES; c++) {
    size_t sz = kt_class_size(c), slab = KT_PAGE;
    while (slab < sz || slab % sz > slab / 16) slab += KT_PAGE;
    kt__geom[c].size = sz;
    kt__geom[c].slab_bytes = slab;
    kt__geom[c].nblocks = (uint32_t)(slab / sz);
    kt__geom[c].magic = (((uint64_t)1 << 40) + sz - 1) / sz;
  }
}

void kt__sizeclass_init(void) { pthread_once(&once, init_once); }
