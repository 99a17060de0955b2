// fusion/kernels/optim.cu — multi-tensor Adam/AdamW and SGD: one launch updates a
// list of tensors (params, grads and states of one dtype), the per-element update
// being kitsune/optim_math.h, which the CPU path shares.
//
// A launch carries up to kMaxTensors tensors and a table mapping each block to a
// (tensor, chunk of kChunk elements); the launcher fills as many launches as the list
// needs. Arithmetic is fp32 (fp64 math is the CPU path's); each state and parameter is
// rounded once when stored.
#include <algorithm>

#include "elementwise.cuh"
#include "kitsune/optim_math.h"

namespace {

constexpr int kMaxTensors = 24, kMaxBlocks = 240, kChunk = 16384, kThreads = 256;

template <int NP> struct Lists {   // NP pointers per tensor (Adam: p, g, m, v; SGD: p, g, buf)
  void *ptr[NP][kMaxTensors];
  int64_t size[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

template <typename T, int NP, typename Args, typename F>
__global__ void __launch_bounds__(kThreads) multi_tensor(Lists<NP> l, Args a, F f) {
  const int t = l.block_tensor[blockIdx.x];
  const int64_t n = l.size[t], start = (int64_t)l.block_chunk[blockIdx.x] * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  T *p[NP];
#pragma unroll
  for (int k = 0; k < NP; k++) p[k] = static_cast<T *>(l.ptr[k][t]);
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) f(p, i, a);
}

template <typename T> struct AdamStep {
  __device__ void operator()(T *const *p, int64_t i, const kt::AdamArgs &a) const {
    float w = kt::to_f(p[0][i]), m = kt::to_f(p[2][i]), v = kt::to_f(p[3][i]);
    kt::adam_elem<float>(w, m, v, kt::to_f(p[1][i]), a);
    p[0][i] = kt::from_f<T>(w), p[2][i] = kt::from_f<T>(m), p[3][i] = kt::from_f<T>(v);
  }
};
template <typename T> struct SgdStep {
  __device__ void operator()(T *const *p, int64_t i, const kt::SgdArgs &a) const {
    float w = kt::to_f(p[0][i]), b = p[2] ? kt::to_f(p[2][i]) : 0.f;
    kt::sgd_elem<float>(w, b, kt::to_f(p[1][i]), a);
    p[0][i] = kt::from_f<T>(w);
    if (p[2]) p[2][i] = kt::from_f<T>(b);
  }
};

template <typename T, int NP, typename Args, typename F>
kt_status run(int ntensors, void *const *const *lists, const int64_t *sizes, const Args &a, F f, cudaStream_t s) {
  Lists<NP> l;
  int nt = 0, nb = 0;
  auto flush = [&]() {
    if (nb) multi_tensor<T, NP, Args, F><<<nb, kThreads, 0, s>>>(l, a, f);
    nt = nb = 0;
  };
  for (int i = 0; i < ntensors; i++) {
    if (sizes[i] <= 0) continue;
    if (nt == kMaxTensors) flush();
    for (int k = 0; k < NP; k++) l.ptr[k][nt] = lists[k] ? lists[k][i] : nullptr;
    l.size[nt] = sizes[i];
    const int64_t chunks = (sizes[i] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; c++) {
      if (nb == kMaxBlocks) {   // launch; this tensor continues in the next launch from chunk c
        flush();
        for (int k = 0; k < NP; k++) l.ptr[k][0] = lists[k] ? lists[k][i] : nullptr;
        l.size[0] = sizes[i];
      }
      l.block_tensor[nb] = (unsigned char)nt;
      l.block_chunk[nb] = (int32_t)c;
      nb++;
    }
    nt++;
  }
  flush();
  return kt::status_of(cudaGetLastError());
}

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_adam_multi(kt_dtype t, int ntensors, void *const *params, void *const *grads,
                                   void *const *exp_avg, void *const *exp_avg_sq, const int64_t *sizes,
                                   const kt::AdamArgs *a, void *stream) {
  if (ntensors < 0 || (ntensors && (!params || !grads || !exp_avg || !exp_avg_sq || !sizes)) || !a) return KT_ERR_INVALID;
  for (int i = 0; i < ntensors; i++)
    if (sizes[i] > 0 && (int64_t)((sizes[i] + kChunk - 1) / kChunk) > INT32_MAX) return KT_ERR_INVALID;
  void *const *lists[4] = {params, grads, exp_avg, exp_avg_sq};
  cudaStream_t s = (cudaStream_t)stream;
  switch (t) {
    case KT_F32: return run<float, 4>(ntensors, lists, sizes, *a, AdamStep<float>{}, s);
    case KT_F16: return run<__half, 4>(ntensors, lists, sizes, *a, AdamStep<__half>{}, s);
    case KT_BF16: return run<__nv_bfloat16, 4>(ntensors, lists, sizes, *a, AdamStep<__nv_bfloat16>{}, s);
  }
  return KT_ERR_INVALID;
}

extern "C" kt_status kt_sgd_multi(kt_dtype t, int ntensors, void *const *params, void *const *grads,
                                  void *const *momentum_buf, const int64_t *sizes, const kt::SgdArgs *a,
                                  void *stream) {
  if (ntensors < 0 || (ntensors && (!params || !grads || !sizes)) || !a) return KT_ERR_INVALID;
  if (a->momentum != 0 && !momentum_buf) return KT_ERR_INVALID;
  void *const *lists[3] = {params, grads, a->momentum != 0 ? momentum_buf : nullptr};
  cudaStream_t s = (cudaStream_t)stream;
  switch (t) {
    case KT_F32: return run<float, 3>(ntensors, lists, sizes, *a, SgdStep<float>{}, s);
    case KT_F16: return run<__half, 3>(ntensors, lists, sizes, *a, SgdStep<__half>{}, s);
    case KT_BF16: return run<__nv_bfloat16, 3>(ntensors, lists, sizes, *a, SgdStep<__nv_bfloat16>{}, s);
  }
  return KT_ERR_INVALID;
}
