// fusion/kernels/avg_pool.cu — kitsune.global_avg_pool: the mean over the pixels of a
// channels-last (N, C, H, W) tensor, x.mean((2, 3)), and its backward.
//
// Why: ATen reduces a channels-last x over H and W with its strided reduction, which on
// the Inception net's 64 x 256 x 32 x 32 fp32 map splits each output's 1024 pixels
// across blocks and stages partial sums in a global buffer sized outputs x splits x
// block width: 128 MiB, twice the input, allocated and freed inside the step. In the
// captured step that buffer was the whole difference between the graph's live peak
// and the eager step's (376.1 against 313.0 MiB; bench/results/archive/gmem_capplan_d966c27.txt).
//
// Forward: a block per (image, 32-channel tile), 256 threads: 32 / V lanes across the
// tile's channels (V = 4 channels a lane where C is a multiple of 4 and x is aligned),
// the rest of the block across pixels. Each thread sums its pixels in fp32 in order,
// then the block adds its rows in a fixed tree: the result does not depend on timing.
// A warp reads 128 contiguous bytes of each of 32 / (32 / V) pixel rows. No workspace.
//
// Backward: grad_in[n, h, w, c] = grad[n, c] / (H * W), rounded once, written densely in
// NHWC (V channels a thread), which is the layout the convolution before it wants; ATen
// divides an expanded (stride 0) gradient into whatever layout its iterator picks.
#include "rows.cuh"

namespace {

using kt::Pack;

constexpr int kTile = 32;       // channels a block
constexpr int kThreads = 256;

template <typename T, int V>
__global__ void gap_fwd(const T *x, T *out, int64_t n, int64_t c, int64_t hw, float scale) {
  constexpr int lanes = kTile / V, rows = kThreads / lanes;
  __shared__ float part[rows][kTile];
  const int tx = threadIdx.x % lanes, ty = threadIdx.x / lanes;
  const int64_t c0 = (int64_t)blockIdx.x * kTile + (int64_t)tx * V;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    float acc[V];
#pragma unroll
    for (int l = 0; l < V; l++) acc[l] = 0.f;
    if (c0 < c) {   // V > 1 only when c % V == 0: a lane's V channels are all in range
      const T *p = x + i * hw * c + c0;
      for (int64_t q = ty; q < hw; q += rows) {
        const Pack<T, V> v = *reinterpret_cast<const Pack<T, V> *>(p + q * c);
#pragma unroll
        for (int l = 0; l < V; l++) acc[l] += kt::to_f(v.v[l]);
      }
    }
#pragma unroll
    for (int l = 0; l < V; l++) part[ty][tx * V + l] = acc[l];
    __syncthreads();
    for (int s = rows / 2; s > 0; s >>= 1) {   // a fixed tree over the rows
      if (ty < s)
#pragma unroll
        for (int l = 0; l < V; l++) part[ty][tx * V + l] += part[ty + s][tx * V + l];
      __syncthreads();
    }
    if (ty == 0 && c0 < c) {
      Pack<T, V> r;
#pragma unroll
      for (int l = 0; l < V; l++) r.v[l] = kt::from_f<T>(part[0][tx * V + l] * scale);
      *reinterpret_cast<Pack<T, V> *>(out + i * c + c0) = r;
    }
    __syncthreads();   // part is reused by the next image
  }
}

template <typename T, int V>
__global__ void gap_bwd(const T *g, T *g_in, int64_t total, int64_t c, int64_t hw, float scale) {
  const int64_t groups = c / V;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t q = e % groups, i = e / groups / hw;   // e = (i * hw + pixel) * groups + q
    const T *gp = g + i * c + q * V;
    Pack<T, V> r;
#pragma unroll
    for (int l = 0; l < V; l++) r.v[l] = kt::from_f<T>(kt::to_f(gp[l]) * scale);
    *reinterpret_cast<Pack<T, V> *>(g_in + e * V) = r;
  }
}

template <typename T> bool vec_ok(int64_t c, std::initializer_list<const void *> ptrs) {
  if (c % 4) return false;
  for (const void *p : ptrs)
    if ((uintptr_t)p % (4 * sizeof(T))) return false;
  return true;
}

// Multiplying by 1 / hw, as ATen's mean does (its MeanOps factor).
template <typename T> kt_status fwd_run(const void *x, void *out, int64_t n, int64_t c, int64_t hw, cudaStream_t s) {
  const dim3 grid((unsigned)((c + kTile - 1) / kTile), (unsigned)(n < 65535 ? n : 65535));
  const float scale = 1.f / (float)hw;
  if (vec_ok<T>(c, {x, out}))
    gap_fwd<T, 4><<<grid, kThreads, 0, s>>>((const T *)x, (T *)out, n, c, hw, scale);
  else
    gap_fwd<T, 1><<<grid, kThreads, 0, s>>>((const T *)x, (T *)out, n, c, hw, scale);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd_run(const void *g, void *g_in, int64_t n, int64_t c, int64_t hw, cudaStream_t s) {
  const bool vec = vec_ok<T>(c, {g, g_in});
  const int64_t total = n * hw * c / (vec ? 4 : 1);
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = (unsigned)(blocks < 65535 * 32 ? blocks : 65535 * 32);
  const float scale = 1.f / (float)hw;
  if (vec) gap_bwd<T, 4><<<grid, kThreads, 0, s>>>((const T *)g, (T *)g_in, total, c, hw, scale);
  else gap_bwd<T, 1><<<grid, kThreads, 0, s>>>((const T *)g, (T *)g_in, total, c, hw, scale);
  return kt::status_of(cudaGetLastError());
}

bool gap_args_ok(int64_t n, int64_t c, int64_t hw) { return n >= 0 && c >= 0 && hw >= 0; }

}  // namespace

extern "C" kt_status kt_global_avg_pool(kt_dtype t, const void *x, void *out, int64_t n, int64_t c, int64_t hw,
                                        void *stream) {
  if (!gap_args_ok(n, c, hw) || (n * c > 0 && (!out || (hw > 0 && !x)))) return KT_ERR_INVALID;
  if (n * c == 0) return KT_OK;
  if (hw == 0) return KT_ERR_INVALID;   // the mean of no pixels is NaN: the caller's (ATen's) case
  KT_DISPATCH(t, fwd_run<T>(x, out, n, c, hw, (cudaStream_t)stream))
}

extern "C" kt_status kt_global_avg_pool_backward(kt_dtype t, const void *grad, void *grad_in, int64_t n, int64_t c,
                                                 int64_t hw, void *stream) {
  if (!gap_args_ok(n, c, hw) || (n * c * hw > 0 && (!grad || !grad_in))) return KT_ERR_INVALID;
  if (n * c * hw == 0) return KT_OK;
  KT_DISPATCH(t, bwd_run<T>(grad, grad_in, n, c, hw, (cudaStream_t)stream))
}
