// fusion/kernels/elementwise.cuh — the one elementwise kernel every pointwise
// fusion instantiates, and its launcher.
//
// A fusion is a functor that maps NI fp32 inputs to NO fp32 outputs for one
// element. An optional per-column operand (a bias: `col` has ncols elements and
// element i of a row-major [rows, ncols] view uses col[i % ncols]) arrives as one
// more input, x[NI]. The kernel is a grid-stride loop over 16-byte vectors (8
// bf16/fp16 or 4 fp32 elements per load and store; the column operand is loaded
// as a vector too) when every pointer is 16-byte aligned and ncols is a multiple
// of the vector width, then a scalar loop over the rest, so any size and any
// alignment work. Arithmetic is fp32; each output is rounded once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "kitsune/fusion.h"

// Runs CALL with T bound to the storage type of kt_dtype t and returns its status;
// KT_ERR_INVALID for an unknown dtype. For the launchers' dtype switch.
#define KT_DISPATCH(t, CALL)                                  \
  switch (t) {                                                \
    case KT_F32: { using T = float; return CALL; }            \
    case KT_F16: { using T = __half; return CALL; }           \
    case KT_BF16: { using T = __nv_bfloat16; return CALL; }   \
  }                                                           \
  return KT_ERR_INVALID;

namespace kt {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Stores V = 16 / sizeof(T) fp32 values as one 16-byte vector at dst (16-byte
// aligned), each rounded once; 16-bit types convert two at a time (one packing
// conversion instruction a pair).
template <typename T> __device__ __forceinline__ void store16(T *dst, const float *v) {
  constexpr int V = 16 / sizeof(T);
  uint4 u;
  uint32_t *w = reinterpret_cast<uint32_t *>(&u);
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < V; j++) w[j] = __float_as_uint(v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V / 2; j++) {
      if constexpr (std::is_same_v<T, __half>) {
        __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        w[j] = *reinterpret_cast<uint32_t *>(&h);
      } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
        w[j] = *reinterpret_cast<uint32_t *>(&h);
      }
    }
  }
  *reinterpret_cast<uint4 *>(dst) = u;
}

template <int NI, int NO> struct Ptrs {
  const void *in[NI];
  void *out[NO];
  const void *col;   // per-column operand or NULL
};

template <typename T, int NI, int NO, typename F>
__global__ void __launch_bounds__(256) ew_kernel(Ptrs<NI, NO> p, int64_t n, int64_t ncols, bool vec, F f) {
  constexpr int V = 16 / sizeof(T);
  constexpr int NX = NI + 1;   // room for the column operand
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t nvec = vec ? n / V : 0;
  const bool small = n < ((int64_t)1 << 31);   // 32-bit modulo is much cheaper on the GPU
  for (int64_t v = tid; v < nvec; v += stride) {
    T in[NX][V];
    float out[NO][V];
#pragma unroll
    for (int k = 0; k < NI; k++) *reinterpret_cast<uint4 *>(in[k]) = reinterpret_cast<const uint4 *>(p.in[k])[v];
    if (p.col) {   // ncols is a multiple of V, so the V columns are contiguous
      int64_t c = small ? (int64_t)((uint32_t)(v * V) % (uint32_t)ncols) : (v * V) % ncols;
      *reinterpret_cast<uint4 *>(in[NI]) = *reinterpret_cast<const uint4 *>(static_cast<const T *>(p.col) + c);
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
      float x[NX], y[NO];
#pragma unroll
      for (int k = 0; k < NI; k++) x[k] = to_f(in[k][j]);
      x[NI] = p.col ? to_f(in[NI][j]) : 0.f;
      f(x, y);
#pragma unroll
      for (int o = 0; o < NO; o++) out[o][j] = y[o];
    }
#pragma unroll
    for (int o = 0; o < NO; o++) store16(static_cast<T *>(p.out[o]) + v * V, out[o]);
  }
  for (int64_t i = nvec * V + tid; i < n; i += stride) {
    float x[NX], y[NO];
#pragma unroll
    for (int k = 0; k < NI; k++) x[k] = to_f(static_cast<const T *>(p.in[k])[i]);
    x[NI] = p.col ? to_f(static_cast<const T *>(p.col)[i % ncols]) : 0.f;
    f(x, y);
#pragma unroll
    for (int o = 0; o < NO; o++) static_cast<T *>(p.out[o])[i] = from_f<T>(y[o]);
  }
}

inline kt_status status_of(cudaError_t e) {
  if (e == cudaSuccess) return KT_OK;
  cudaGetLastError();
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return KT_ERR_UNAVAILABLE;
  return KT_ERR_BACKEND;
}

// Programmatic dependent launch (sm_90): a kernel launched by launch_dependent may be
// scheduled while the kernel before it in the stream still runs, once every block of
// that one has called pdl_trigger (or exited); it must call pdl_wait before it reads
// anything the earlier kernel writes (pdl_wait returns when that kernel has finished
// and its memory is visible). What it saves is the second kernel's launch latency
// between two dependent kernels of ours. Both are no-ops below sm_90, and
// launch_dependent launches plainly on devices without it.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// f(dev) for the current device, asked once a device and kept in cache (f must return
// a value > 0; 0 marks "not asked yet"); `otherwise` when there is no device, its
// number is 64 or more, or f returns 0.
template <typename F> int per_device(std::atomic<int> (&cache)[64], int otherwise, F f) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return otherwise;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (!v) {
    v = f(dev);
    if (v <= 0) return otherwise;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether the current device has programmatic dependent launch (compute capability
// 9.0 or newer).
inline bool pdl_device() {
  static std::atomic<int> cache[64];   // 1 no, 2 yes
  return per_device(cache, 1, [](int dev) {
           int major = 0;
           return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9
                      ? 2
                      : 1;
         }) == 2;
}

// The kernels launch_dependent has launched, by their host entry, for
// kt_graph_node_waits_first: each calls pdl_wait before its first global memory access.
// Noted at every dependent launch: a scan of the few slots filled (tens of ns against
// a launch's microseconds). A static of launch_dependent's instance would not do: the
// kernel is an argument, and kernels of one signature share an instance (9af0917
// noted only the first of them; Inception's plan counted 9 of 23 programmatic edges
// and grew to 412.1 MiB, h100_review_static_9af0917.log). A handful of template
// instances; one past the 64 slots goes unnoted, which only costs a capture plan some
// sharing.
inline std::atomic<const void *> pdl_kernels[64];

inline void note_pdl_kernel(const void *k) {
  for (auto &slot : pdl_kernels) {
    const void *v = slot.load(std::memory_order_acquire);
    if (v == k) return;
    if (!v) {
      const void *none = nullptr;
      if (slot.compare_exchange_strong(none, k, std::memory_order_acq_rel) || none == k) return;
    }
  }
}

template <typename... P, typename... A>
void launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t s, A... args) {
  if (!pdl_device()) {
    kernel<<<grid, block, 0, s>>>(args...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  note_pdl_kernel(reinterpret_cast<const void *>(kernel));
  cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
}

// Fixes the block size (256), checks preconditions, launches on `stream`, checks
// the launch. F<T> is the functor for storage type T; col/ncols the optional
// per-column operand (NULL/0 for none).
template <template <typename> class F, int NI, int NO, typename... A>
kt_status launch(kt_dtype t, const void *const (&in)[NI], void *const (&out)[NO], int64_t n, const void *col,
                 int64_t ncols, void *stream, A... args) {
  if (n < 0 || ncols < 0 || (col && (ncols == 0 || n % ncols))) return KT_ERR_INVALID;
  if (n == 0) return KT_OK;
  Ptrs<NI, NO> p;
  p.col = col;
  uintptr_t bits = 0;
  for (int k = 0; k < NI; k++) {
    if (!in[k]) return KT_ERR_INVALID;
    p.in[k] = in[k];
    bits |= (uintptr_t)in[k];
  }
  for (int o = 0; o < NO; o++) {
    if (!out[o]) return KT_ERR_INVALID;
    p.out[o] = out[o];
    bits |= (uintptr_t)out[o];
  }
  bits |= (uintptr_t)col;
  auto go = [&](auto tag) -> kt_status {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const bool vec = (bits & 15) == 0 && (!col || ncols % V == 0);
    int64_t work = vec ? n / V + n % V : n;
    int64_t blocks = (work + 255) / 256;
    if (blocks > (int64_t)1 << 30) blocks = (int64_t)1 << 30;
    ew_kernel<T, NI, NO><<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(p, n, ncols, vec, F<T>{args...});
    return status_of(cudaGetLastError());
  };
  switch (t) {
    case KT_F32: return go(float{});
    case KT_F16: return go(__half{});
    case KT_BF16: return go(__nv_bfloat16{});
  }
  return KT_ERR_INVALID;
}

}  // namespace kt
