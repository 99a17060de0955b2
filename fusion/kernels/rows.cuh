// fusion/kernels/rows.cuh — helpers for the row kernels (one block per row of n
// contiguous elements): block-wide sums and a loop over a row's 16-byte vectors.
// Used by rms_norm.cu, layer_norm.cu and cross_entropy.cu.
#pragma once

#include <initializer_list>

#include "elementwise.cuh"

namespace kt {

template <int K> struct Fv { float v[K]; };

template <int K> __device__ __forceinline__ Fv<K> warp_sum(Fv<K> a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < K; k++) a.v[k] += __shfl_xor_sync(0xffffffffu, a.v[k], o);
  return a;
}

// Sums K values over the block; every thread gets the result. Safe to call
// repeatedly in one kernel (the first barrier protects the previous call's reads).
template <int K> __device__ Fv<K> block_sum(Fv<K> a) {
  __shared__ Fv<K> part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  a = warp_sum(a);
  __syncthreads();
  if (lane == 0) part[warp] = a;
  __syncthreads();
  if (lane < nwarps) a = part[lane];
  else
#pragma unroll
    for (int k = 0; k < K; k++) a.v[k] = 0.f;
  return warp_sum(a);
}

// V elements of T as one aligned value: a single load or store of V * sizeof(T) bytes
// (the pooling and bias_cat kernels' 4 channels a thread).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Loads V elements at p + i: one 16-byte load when VEC, else one element.
template <typename T, bool VEC> __device__ __forceinline__ void load_v(const T *p, int64_t i, T *v) {
  if constexpr (VEC) *reinterpret_cast<uint4 *>(v) = *reinterpret_cast<const uint4 *>(p + i);
  else v[0] = p[i];
}
template <typename T, bool VEC> __device__ __forceinline__ void store_v(T *p, int64_t i, const T *v) {
  if constexpr (VEC) *reinterpret_cast<uint4 *>(p + i) = *reinterpret_cast<const uint4 *>(v);
  else p[i] = v[0];
}

// Calls f(i, x[V]) for every V-element chunk of a row owned by this thread
// (chunk c goes to thread c % blockDim.x, so consecutive threads read
// consecutive 16-byte vectors).
template <typename T, bool VEC> struct Row {
  static constexpr int V = VEC ? 16 / sizeof(T) : 1;
  template <typename F> __device__ static void each(const T *row, int64_t n, F f) {
    for (int64_t c = threadIdx.x; c < n / V; c += blockDim.x) {
      T v[V];
      load_v<T, VEC>(row, c * V, v);
      f(c * V, v);
    }
  }
};

// 32..256 threads: enough to cover a row's vectors once where possible.
template <typename T> inline int row_threads(int64_t n, bool vec) {
  int64_t chunks = vec ? n / (16 / sizeof(T)) : n;
  int64_t t = ((chunks + 31) / 32) * 32;
  return (int)(t < 32 ? 32 : t > 256 ? 256 : t);
}

// Whether a row kernel may use 16-byte vectors: n a multiple of the vector width
// and every non-NULL pointer 16-byte aligned.
template <typename T> inline bool row_vec_ok(int64_t n, std::initializer_list<const void *> ptrs) {
  if (n % (16 / sizeof(T))) return false;
  for (const void *p : ptrs)
    if ((uintptr_t)p & 15) return false;
  return true;
}

}  // namespace kt
