/* Unit: Philox4x32-10 (kitsune/philox.h, shared by the dropout kernels and their CPU
 * reference) against Random123's known-answer vectors, and the dropout threshold. */
#include <math.h>

#include "common.h"
#include "kitsune/philox.h"

Test(philox, known_answers) {
  static const uint32_t in[3][6] = {{0, 0, 0, 0, 0, 0},
                                    {~0u, ~0u, ~0u, ~0u, ~0u, ~0u},
                                    {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0}};
  static const uint32_t want[3][4] = {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
                                      {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
                                      {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}};
  for (int t = 0; t < 3; t++) {
    uint32_t o[4];
    kt_philox4x32_10(in[t][0], in[t][1], in[t][2], in[t][3], in[t][4], in[t][5], o);
    for (int j = 0; j < 4; j++) cr_assert_eq(o[j], want[t][j], "vector %d word %d: %08x", t, j, o[j]);
  }
}

/* The kept fraction over 2^20 elements drawn `bits` at a time is 1 - p within 5
 * standard deviations. */
static void assert_keep_rate(int bits, double p) {
  const uint64_t thr = kt_dropout_threshold(p, bits);
  const int per = kt_dropout_per_block(bits);
  long kept = 0, n = 1 << 20;
  for (long b = 0; b < n / per; b++) {
    uint32_t w[4];
    kt_philox_block(12345, 7, (uint64_t)b, w);
    for (int j = 0; j < per; j++) kept += kt_dropout_keep(w, j, bits, thr);
  }
  double sd = sqrt(n * p * (1 - p));
  cr_assert_lt(fabs(kept - n * (1 - p)), 5 * sd, "%d bits: kept %ld of %ld", bits, kept, n);
}

Test(philox, dropout_threshold_and_rate) {
  cr_assert_eq(kt_dropout_threshold(0.0, 32), 0);
  cr_assert_eq(kt_dropout_threshold(-1.0, 32), 0);
  cr_assert_eq(kt_dropout_threshold(1.0, 32), (uint64_t)1 << 32);
  cr_assert_eq(kt_dropout_threshold(0.5, 32), (uint64_t)1 << 31);
  assert_keep_rate(32, 0.3);
}

Test(philox, dropout_16_bit_elements) {
  cr_assert_eq(kt_dropout_threshold(0.5, 16), 32768);
  cr_assert_eq(kt_dropout_threshold(1.0, 16), 65536);
  cr_assert_eq(kt_dropout_per_block(16), 8);
  cr_assert_eq(kt_dropout_per_block(32), 4);
  /* element j of a block is half j % 2 (low first) of word j / 2 */
  const uint32_t w[4] = {0x0001ffffu, 0x80007fffu, 0, 0xffffffffu};
  const uint64_t thr = kt_dropout_threshold(0.5, 16);
  const int want[8] = {1, 0, 0, 1, 0, 0, 1, 1};
  for (int j = 0; j < 8; j++) cr_assert_eq(kt_dropout_keep(w, j, 16, thr), want[j], "element %d", j);
  /* p = 1 keeps nothing, even an all-ones draw */
  cr_assert_eq(kt_dropout_keep(w, 6, 16, kt_dropout_threshold(1.0, 16)), 0);
  assert_keep_rate(16, 0.3);
}
