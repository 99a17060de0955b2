// fusion/kernels/optim.cu — multi-tensor Adam/AdamW and SGD: one launch updates a
// list of tensors (params, grads and states of one dtype), the per-element update
// being kitsune/optim_math.h, which the CPU path shares.
//
// A launch carries up to kMaxTensors tensors (GPT-2 small's 148 take two), each cut
// into chunks; a grid of as many blocks as the device holds at once strides over all
// the launch's chunks (so one launch covers a 38M-element embedding and the small
// vectors beside it). The chunk is the call's total elements over kTargetChunks, as a
// power of two in [kMinChunk, kMaxChunk]: a small model's step (LeNet-5's 62K
// parameters) is then spread over ~30 blocks, not ~10 blocks each walking up to 65536
// elements (67 us against torch's fused AdamW's 39 us on the H100 with fixed
// 65536-element chunks; h100_profile_graph_03b49dd.log), and a large one's chunks are
// several a block, so the blocks finish together. (At 64 tensors and 1024 chunks a
// call, the bench GPT's 77 tensors took two launches of up to 2048 blocks, 167.2 us on
// the H100, h100_profile_graph_gpt_inception_81772ef.log; one launch since a97406b,
// 154.4 us, h100_profile_graph_gpt_fe19a6d.log.)
// Within a chunk each thread updates 16/sizeof(T) consecutive elements at a time with
// 16-byte loads and stores (every list's pointer 16-byte aligned; otherwise, and for
// a chunk's tail, one element at a time). Arithmetic is fp32 (fp64 math is the CPU
// path's); each state and parameter is rounded once when stored.
#include <algorithm>
#include <atomic>

#include "elementwise.cuh"
#include "kitsune/optim_math.h"

namespace {

constexpr int kMaxTensors = 128, kThreads = 256;
constexpr int64_t kMinChunk = 2048, kMaxChunk = 65536, kTargetChunks = 4096;

template <int NP> struct Lists {   // NP pointers per tensor (Adam: p, g, m, v; SGD: p, g, buf); 6 KB for Adam
  void *ptr[NP][kMaxTensors];
  int64_t size[kMaxTensors];
  int64_t chunk_end[kMaxTensors];   // chunks of tensors 0..t, cumulative
  int64_t chunk;                    // elements a chunk: a power of two, so a multiple of every vector width
};
// Over 4 KB of kernel parameters takes CUDA 12.1 and a Volta or newer GPU (sm_80 and
// sm_90 here); the limit there is 32764 bytes.
static_assert(sizeof(Lists<4>) <= 32764, "kernel parameters");

// Blocks of kernel k that the device holds at once (its SMs times the blocks an SM
// holds), read once per device and kernel; the grid strides over chunks with that many
// blocks, so every block starts at once and the chunks even out the tail.
template <typename K> int resident_blocks(K kernel) {
  static std::atomic<int> cache[64];
  return kt::per_device(cache, 1024, [&](int dev) {
    int sms = 0, per = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, kThreads, 0) != cudaSuccess)
      return 0;
    return sms * per;
  });
}

int64_t chunk_for(int64_t total) {
  int64_t c = kMinChunk;
  while (c < kMaxChunk && c * kTargetChunks < total) c *= 2;
  return c;
}

// The update of E elements: element j of list k is converted to fp32 when the update
// reaches it and stored back in place (so the registers hold the loaded vectors, not
// E fp32 copies of them: 84 registers a thread at 8 bf16 elements took the H100 to 2
// blocks an SM, 25% occupancy, and the step to 2.44 TB/s, ncu at 06fa077,
// h100_ncu_optim_06fa077.log); list 1 (the gradient) is read only, an absent list
// (NULL) is neither read nor written.
template <typename T, int NP, int E, typename Args, typename F>
__device__ __forceinline__ void update(T *const *p, int64_t i, const Args &a, F f, bool vec) {
  T t[NP][E];
#pragma unroll
  for (int k = 0; k < NP; k++) {
    if (!p[k]) {
#pragma unroll
      for (int j = 0; j < E; j++) t[k][j] = kt::from_f<T>(0.f);
    } else if (vec) {
      *reinterpret_cast<uint4 *>(t[k]) = *reinterpret_cast<const uint4 *>(p[k] + i);
    } else {
      t[k][0] = p[k][i];
    }
  }
#pragma unroll
  for (int j = 0; j < E; j++) {
    float v[NP];
#pragma unroll
    for (int k = 0; k < NP; k++) v[k] = kt::to_f(t[k][j]);
    f(v, a, p[NP - 1] != nullptr);
#pragma unroll
    for (int k = 0; k < NP; k++)
      if (k != 1) t[k][j] = kt::from_f<T>(v[k]);
  }
#pragma unroll
  for (int k = 0; k < NP; k++) {
    if (k == 1 || !p[k]) continue;
    if (vec) *reinterpret_cast<uint4 *>(p[k] + i) = *reinterpret_cast<const uint4 *>(t[k]);
    else p[k][i] = t[k][0];
  }
}

template <typename T, int NP, typename Args, typename F>
__global__ void __launch_bounds__(kThreads) multi_tensor(Lists<NP> l, int64_t chunks, Args args, F f) {
  constexpr int E = 16 / sizeof(T);
  if (args.skip && *args.skip != 0.f) return;   // inf or NaN gradients under loss scaling: no update
  const Args a = kt::resolve(args);   // lr and step from device memory under a CUDA graph
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int t = 0;
    while (c >= l.chunk_end[t]) t++;
    const int64_t start = (c - (t ? l.chunk_end[t - 1] : 0)) * l.chunk, n = l.size[t];
    const int64_t end = start + l.chunk < n ? start + l.chunk : n;
    T *p[NP];
    bool aligned = true;
#pragma unroll
    for (int k = 0; k < NP; k++) {
      p[k] = static_cast<T *>(l.ptr[k][t]);
      aligned = aligned && ((uintptr_t)p[k] & 15) == 0;
    }
    int64_t i = start;
    if (aligned) {   // start is a multiple of the chunk, so of E: every vector is aligned
      const int64_t nv = (end - start) / E;
      for (int64_t q = threadIdx.x; q < nv; q += kThreads) update<T, NP, E>(p, start + q * E, a, f, true);
      i = start + nv * E;
    }
    for (i += threadIdx.x; i < end; i += kThreads) update<T, NP, 1>(p, i, a, f, false);
  }
}

struct AdamStep {   // lists p, g, m, v
  __device__ void operator()(float (&v)[4], const kt::AdamArgs &a, bool) const {
    kt::adam_elem<float>(v[0], v[2], v[3], v[1], a);
  }
};
struct SgdStep {   // lists p, g, buf (NULL without momentum)
  __device__ void operator()(float (&v)[3], const kt::SgdArgs &a, bool buf) const {
    float b = buf ? v[2] : 0.f;
    kt::sgd_elem<float>(v[0], b, v[1], a);
    if (buf) v[2] = b;
  }
};

template <typename T, int NP, typename Args, typename F>
kt_status run(int ntensors, void *const *const *lists, const int64_t *sizes, const Args &a, F f, cudaStream_t s) {
  Lists<NP> l;
  int64_t total = 0;
  for (int i = 0; i < ntensors; i++) total += sizes[i] > 0 ? sizes[i] : 0;
  l.chunk = chunk_for(total);
  int nt = 0;
  int64_t chunks = 0;
  auto flush = [&]() {
    if (nt) {
      const int grid = (int)std::min<int64_t>(chunks, resident_blocks(multi_tensor<T, NP, Args, F>));
      multi_tensor<T, NP, Args, F><<<grid, kThreads, 0, s>>>(l, chunks, a, f);
    }
    nt = 0, chunks = 0;
  };
  for (int i = 0; i < ntensors; i++) {
    if (sizes[i] <= 0) continue;
    for (int k = 0; k < NP; k++) l.ptr[k][nt] = lists[k] ? lists[k][i] : nullptr;
    l.size[nt] = sizes[i];
    chunks += (sizes[i] + l.chunk - 1) / l.chunk;
    l.chunk_end[nt++] = chunks;
    if (nt == kMaxTensors) flush();
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
  void *const *lists[4] = {params, grads, exp_avg, exp_avg_sq};
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, (run<T, 4>(ntensors, lists, sizes, *a, AdamStep{}, s)))
}

extern "C" kt_status kt_sgd_multi(kt_dtype t, int ntensors, void *const *params, void *const *grads,
                                  void *const *momentum_buf, const int64_t *sizes, const kt::SgdArgs *a,
                                  void *stream) {
  if (ntensors < 0 || (ntensors && (!params || !grads || !sizes)) || !a) return KT_ERR_INVALID;
  if (a->momentum != 0 && !momentum_buf) return KT_ERR_INVALID;
  void *const *lists[3] = {params, grads, a->momentum != 0 ? momentum_buf : nullptr};
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, (run<T, 3>(ntensors, lists, sizes, *a, SgdStep{}, s)))
}
