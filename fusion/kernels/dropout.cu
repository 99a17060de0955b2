// fusion/kernels/dropout.cu — dropout fused with what comes before or after it:
//   gelu_dropout:      out = keep ? gelu(x) / (1 - p) : 0
//   bias_dropout_add:  out = residual + (keep ? (x + bias) / (1 - p) : 0), bias per column
// and their backwards (gelu_dropout_backward: grad * keep / (1 - p) * gelu'(x);
// dropout_backward: grad * keep / (1 - p), the gradient of x and, summed over rows,
// of the bias in bias_dropout_add).
//
// The mask is never stored: element i is kept by the rule of kitsune/philox.h (32
// random bits an element for fp32, 16 for fp16/bf16, from Philox blocks under
// (seed, offset)), so the backward regenerates it, and the CPU reference builds the
// same mask from the same header. One thread handles the elements of one Philox
// call (4 fp32 or 8 fp16/bf16: 16 bytes an operand), with one vector load per
// operand when the pointers allow it. With 32 bits for every element, bf16 ran at
// 55-62% of copy bandwidth against 91-94% for fp32 (H100,
// kernels_elementwise_d3e61a6.json): the Philox rounds, not memory, were the limit.
// So the launch carries the seed's round keys (each round's key is a constant-memory
// operand, not two additions), a bias's column is found once per thread, the mask
// multiplies (no divergent branch) and 16-bit results are stored in packed pairs:
// bf16 now runs at 89-95% of copy (kernels_elementwise_bf15c55_run2.json).
#include "gelu.cuh"
#include "kitsune/philox.h"

namespace {

// ---- reference ----
// keep_i = kt_dropout_keep(philox_block(seed, offset, i / E), i % E, bits, threshold)
// (E = 4 for 32 bits, 8 for 16); scale = 1 / (1 - p)

// ---- kernels ----
template <typename T> constexpr int kBits = sizeof(T) == 2 ? 16 : 32;
template <typename T> constexpr int kPer = 128 / kBits<T>;   // elements of one Philox block (128 bits): 16 bytes

template <typename T> __device__ __forceinline__ void load_e(const T *p, int64_t i, bool vec, int64_t n, float *v) {
  constexpr int E = kPer<T>;
  if (vec) {
    T t[E];
    *reinterpret_cast<uint4 *>(t) = *reinterpret_cast<const uint4 *>(p + i);
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = kt::to_f(t[j]);
  } else {
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = i + j < n ? kt::to_f(p[i + j]) : 0.f;
  }
}
template <typename T> __device__ __forceinline__ void store_e(T *p, int64_t i, bool vec, int64_t n, const float *v) {
  constexpr int E = kPer<T>;
  if (vec) {
    kt::store16(p + i, v);
  } else {
#pragma unroll
    for (int j = 0; j < E; j++)
      if (i + j < n) p[i + j] = kt::from_f<T>(v[j]);
  }
}

// The Philox round keys of the seed travel in the launch parameters (constant memory).
// The threshold is kt_dropout_threshold clamped to 32 bits: it differs only for p >= 1
// (2^32 with 32-bit draws), where scale is 0 and so every output is dropped anyway.
struct Rng {
  uint32_t ks[2 * KT_PHILOX_ROUNDS];
  uint64_t offset;
  uint32_t threshold;
  float scale;
};

// f(in[k][j] for k < NI, column value, keep, scale) -> out, for each element of a block.
template <typename T, int NI, typename F>
__global__ void __launch_bounds__(256) rng_kernel(kt::Ptrs<NI, 1> p, int64_t ncols, int64_t n, bool vec_ok, Rng r,
                                                  F f) {
  constexpr int E = kPer<T>;
  const int64_t blocks = (n + E - 1) / E, stride = (int64_t)gridDim.x * blockDim.x;
  const T *col = static_cast<const T *>(p.col);
  T *out = static_cast<T *>(p.out[0]);
  const bool small = n < ((int64_t)1 << 31);   // 32-bit modulo suffices
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < blocks; b += stride) {
    const int64_t i = b * E;
    const bool vec = vec_ok && i + E <= n;
    float in[NI][E], c[E] = {}, o[E];
#pragma unroll
    for (int k = 0; k < NI; k++) load_e<T>(static_cast<const T *>(p.in[k]), i, vec, n, in[k]);
    if (col) {   // the column of element i, found once: a 64-bit modulo costs tens of instructions
      int64_t ci = small ? (int64_t)((uint32_t)i % (uint32_t)ncols) : i % ncols;
      if (vec) {   // ncols is a multiple of E, so the E columns are contiguous
        load_e<T>(col, ci, true, ncols, c);
      } else {
#pragma unroll
        for (int j = 0; j < E; j++) {
          c[j] = i + j < n ? kt::to_f(col[ci]) : 0.f;
          ci = ci + 1 == ncols ? 0 : ci + 1;
        }
      }
    }
    uint32_t w[4];
    kt_philox_block_ks(r.ks, r.offset, (uint64_t)b, w);
#pragma unroll
    for (int j = 0; j < E; j++) {
      float x[NI];
#pragma unroll
      for (int k = 0; k < NI; k++) x[k] = in[k][j];
      o[j] = f(x, c[j], kt_dropout_bits(w, j, kBits<T>) >= r.threshold ? r.scale : 0.f);
    }
    store_e<T>(out, i, vec, n, o);
  }
}

// s is the element's mask value: 1 / (1 - p) kept, 0 dropped. Multiplying by it (not
// branching on keep) is the reference's arithmetic (x * mask * scale: a dropped inf is
// NaN, as in torch) and leaves the warp no divergent branch.
template <typename T> struct GeluDropout {   // (x)
  int approximate;
  __device__ float operator()(const float *x, float, float s) const {
    return kt::gelu_ref<sizeof(T) == 2>(x[0], approximate) * s;
  }
};
template <typename T> struct GeluDropoutBackward {   // (grad, x)
  int approximate;
  __device__ float operator()(const float *x, float, float s) const {
    return x[0] * s * kt::gelu_grad_ref<sizeof(T) == 2>(x[1], approximate);
  }
};
struct BiasDropoutAdd {   // (x, residual), column = bias
  __device__ float operator()(const float *x, float bias, float s) const { return x[1] + (x[0] + bias) * s; }
};
struct DropoutBackward {   // (grad)
  __device__ float operator()(const float *x, float, float s) const { return x[0] * s; }
};

template <typename T, int NI, typename F>
kt_status run(std::initializer_list<const void *> ins, const void *col, int64_t ncols, void *out, int64_t n, Rng r, F f,
              cudaStream_t s) {
  kt::Ptrs<NI, 1> p{};
  constexpr int E = kPer<T>;
  bool vec = ((uintptr_t)out % 16) == 0 && (!col || (ncols % E == 0 && (uintptr_t)col % 16 == 0));
  int k = 0;
  for (const void *q : ins) {
    p.in[k++] = q;
    vec = vec && ((uintptr_t)q % 16) == 0;
  }
  p.out[0] = out;
  p.col = col;
  const int64_t blocks = (n + E - 1) / E;
  const int grid = (int)std::min<int64_t>((blocks + 255) / 256, 132 * 16);
  rng_kernel<T, NI, F><<<grid, 256, 0, s>>>(p, ncols, n, vec, r, f);
  return kt::status_of(cudaGetLastError());
}

template <typename T> Rng rng_of(uint64_t seed, uint64_t offset, double p) {
  Rng r;
  kt_philox_seed_keys(seed, r.ks);
  r.offset = offset;
  r.threshold = (uint32_t)std::min<uint64_t>(kt_dropout_threshold(p, kBits<T>), UINT32_MAX);
  r.scale = p < 1 ? (float)(1.0 / (1.0 - p)) : 0.f;
  return r;
}

bool bad(int64_t n, double p) { return n < 0 || !(p >= 0 && p <= 1); }

}  // namespace

// ---- launchers ----

extern "C" kt_status kt_gelu_dropout(kt_dtype t, const void *x, void *out, int64_t n, double p, uint64_t seed,
                                     uint64_t offset, int approximate, void *stream) {
  if (bad(n, p) || (n && (!x || !out))) return KT_ERR_INVALID;   // an empty tensor's pointer is NULL
  if (!n) return KT_OK;
  KT_DISPATCH(t, (run<T, 1>({x}, nullptr, 1, out, n, rng_of<T>(seed, offset, p), GeluDropout<T>{approximate},
                            (cudaStream_t)stream)))
}

extern "C" kt_status kt_gelu_dropout_backward(kt_dtype t, const void *grad, const void *x, void *grad_x, int64_t n,
                                              double p, uint64_t seed, uint64_t offset, int approximate,
                                              void *stream) {
  if (bad(n, p) || (n && (!grad || !x || !grad_x))) return KT_ERR_INVALID;
  if (!n) return KT_OK;
  KT_DISPATCH(t, (run<T, 2>({grad, x}, nullptr, 1, grad_x, n, rng_of<T>(seed, offset, p),
                            GeluDropoutBackward<T>{approximate}, (cudaStream_t)stream)))
}

extern "C" kt_status kt_bias_dropout_add(kt_dtype t, const void *x, const void *bias, const void *residual, void *out,
                                         int64_t n, int64_t nbias, double p, uint64_t seed, uint64_t offset,
                                         void *stream) {
  if (bad(n, p) || nbias < 0) return KT_ERR_INVALID;
  if (!n) return KT_OK;   // nothing to write (x of no columns has an empty bias: nbias 0)
  if (!x || !bias || !residual || !out || nbias == 0 || (n % nbias)) return KT_ERR_INVALID;
  KT_DISPATCH(t, (run<T, 2>({x, residual}, bias, nbias, out, n, rng_of<T>(seed, offset, p), BiasDropoutAdd{},
                            (cudaStream_t)stream)))
}

extern "C" kt_status kt_dropout_backward(kt_dtype t, const void *grad, void *grad_x, int64_t n, double p, uint64_t seed,
                                         uint64_t offset, void *stream) {
  if (bad(n, p) || (n && (!grad || !grad_x))) return KT_ERR_INVALID;
  if (!n) return KT_OK;
  KT_DISPATCH(t, (run<T, 1>({grad}, nullptr, 1, grad_x, n, rng_of<T>(seed, offset, p), DropoutBackward{},
                            (cudaStream_t)stream)))
}
