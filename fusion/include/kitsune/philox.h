/* kitsune/philox.h — Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random
 * numbers: as easy as 1, 2, 3", SC'11), the same code on the host (C/C++) and in CUDA
 * kernels, so a dropout mask made on the GPU can be rebuilt on the CPU from the
 * (seed, offset) the op returns.
 *
 * Element i of a dropout call with (seed, offset) uses word i % 4 of
 * philox(counter = (i / 4 low, i / 4 high, offset low, offset high),
 * key = seed ^ KT_PHILOX_KEY_SALT) and is
 * kept when that word is >= threshold = floor(p * 2^32) (p = 1: none kept).
 */
#ifndef KITSUNE_PHILOX_H
#define KITSUNE_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define KT_PHILOX_FN __host__ __device__ __forceinline__
#else
#define KT_PHILOX_FN static inline
#endif

/* The round keys of key (k0, k1): ks[2r], ks[2r + 1] for round r. A kernel computes
 * them once on the host and passes them as a launch parameter, so each round reads its
 * key from constant memory instead of adding it in registers. */
#define KT_PHILOX_ROUNDS 10
KT_PHILOX_FN void kt_philox_key_schedule(uint32_t k0, uint32_t k1, uint32_t ks[2 * KT_PHILOX_ROUNDS]) {
  for (int r = 0; r < KT_PHILOX_ROUNDS; r++, k0 += 0x9E3779B9u, k1 += 0xBB67AE85u) ks[2 * r] = k0, ks[2 * r + 1] = k1;
}

KT_PHILOX_FN void kt_philox4x32_10_ks(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                      const uint32_t ks[2 * KT_PHILOX_ROUNDS], uint32_t out[4]) {
#ifdef __CUDACC__
#pragma unroll
#endif
  for (int r = 0; r < KT_PHILOX_ROUNDS; r++) {
    const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ ks[2 * r], n2 = (uint32_t)(p0 >> 32) ^ c3 ^ ks[2 * r + 1];
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

KT_PHILOX_FN void kt_philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                                   uint32_t out[4]) {
  uint32_t ks[2 * KT_PHILOX_ROUNDS];
  kt_philox_key_schedule(k0, k1, ks);
  kt_philox4x32_10_ks(c0, c1, c2, c3, ks, out);
}

/* The four random words for elements 4 * block .. 4 * block + 3. The key is the seed
 * XOR a Kitsune constant: PyTorch's curand-based kernels draw Philox words under the
 * same seed with counters (offset, thread), which could otherwise coincide with ours
 * and correlate a dropout mask with, say, a torch.rand call. */
#define KT_PHILOX_KEY_SALT 0x6B697473756E6531ull   /* "kitsune1" */
KT_PHILOX_FN void kt_philox_seed_keys(uint64_t seed, uint32_t ks[2 * KT_PHILOX_ROUNDS]) {
  const uint64_t key = seed ^ KT_PHILOX_KEY_SALT;
  kt_philox_key_schedule((uint32_t)key, (uint32_t)(key >> 32), ks);
}
KT_PHILOX_FN void kt_philox_block_ks(const uint32_t ks[2 * KT_PHILOX_ROUNDS], uint64_t offset, uint64_t block,
                                     uint32_t out[4]) {
  kt_philox4x32_10_ks((uint32_t)block, (uint32_t)(block >> 32), (uint32_t)offset, (uint32_t)(offset >> 32), ks, out);
}
KT_PHILOX_FN void kt_philox_block(uint64_t seed, uint64_t offset, uint64_t block, uint32_t out[4]) {
  uint32_t ks[2 * KT_PHILOX_ROUNDS];
  kt_philox_seed_keys(seed, ks);
  kt_philox_block_ks(ks, offset, block, out);
}

/* A dropout draws `bits` random bits an element: 32 for fp32/fp64 tensors (element i:
 * word i % 4 of block i / 4), 16 for fp16/bf16 (element i: half i % 2 of word
 * (i % 8) / 2 of block i / 8, low half first), so a 16-bit tensor costs half the
 * Philox work per byte. The element is kept when its bits, as an unsigned number,
 * are >= the threshold floor(p * 2^bits) (2^bits for p >= 1: nothing kept). */
KT_PHILOX_FN uint64_t kt_dropout_threshold(double p, int bits) {
  const double range = bits == 16 ? 65536.0 : 4294967296.0;
  return p <= 0 ? 0 : p >= 1 ? (uint64_t)range : (uint64_t)(p * range);
}
/* Elements per Philox block: 4 (32 bits each) or 8 (16 bits each). */
KT_PHILOX_FN int kt_dropout_per_block(int bits) { return bits == 16 ? 8 : 4; }
/* The random bits of element j (< kt_dropout_per_block(bits)) of a block with words w. */
KT_PHILOX_FN uint32_t kt_dropout_bits(const uint32_t w[4], int j, int bits) {
  return bits == 16 ? (w[j >> 1] >> ((j & 1) * 16)) & 0xffffu : w[j];
}
/* Whether that element is kept. (The CUDA kernels compare kt_dropout_bits with the
 * threshold clamped to 32 bits: it differs only for p >= 1, where their scale is 0.) */
KT_PHILOX_FN int kt_dropout_keep(const uint32_t w[4], int j, int bits, uint64_t threshold) {
  return (uint64_t)kt_dropout_bits(w, j, bits) >= threshold;
}

#endif
