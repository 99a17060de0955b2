// fusion/kernels/pool.cu — kitsune.bias_relu_pool: a convolution's bias, the ReLU
// after it and the max pooling after that, in one pass each way:
//   out = max_pool2d(relu(y + bias[c]), (kh, kw))
// over non-overlapping windows (stride = kernel, no padding, floor mode) of an NCHW
// contiguous y. LeNet-style blocks ran these as five ATen kernels forward (the
// broadcast add, relu, the pooling) and backward (the pooling's scatter, relu's mask,
// two reductions for the bias): 59 launches a LeNet-5 step against the stock graph's
// 49, bench/results/h100_profile_graph_9d33764.log.
//
// Values compared are relu(y + bias) rounded to the storage type, as the unfused ops
// compare them: the larger wins, a tie goes to the first in row-major window order,
// and a NaN wins over anything before it (max_pool2d's rule), so the output and the
// chosen element are those of PyTorch's unfused ops, bit for bit.
//
// The backward needs only y and the bias (no indices saved): a block per (n, c)
// plane, a thread per window, finds the window's winner again and writes the output
// gradient there when the window's value is not <= 0 (relu's threshold_backward
// rule), 0 elsewhere, including rows and columns no window covers. The block also
// sums what it wrote (fp32, a fixed order): plane sums that the caller reduces over n
// for the bias gradient. 2 x 2 windows are compiled as such (their four loads in
// flight at once); a thread per element and runtime window loops took 10.3 us for
// LeNet's two backward calls, bench/results/h100_profile_graph_496a15f.log.
#include "rows.cuh"

namespace {

// ---- reference ----
// out[n, c, i, j] = max over the window of relu(y[n, c, i*kh + a, j*kw + b] + bias[c])

template <typename T> __device__ __forceinline__ float act(T y, float b) {
  const float v = kt::to_f(kt::from_f<T>(kt::to_f(y) + b));
  return v <= 0.f ? 0.f : v;   // NaN stays NaN, as torch.relu keeps it
}

// The window's value and its winner's offset (a * w + b) from the window's corner.
// KH, KW > 0 fix the window at compile time (2 x 2, LeNet's), so that its loads are
// all in flight before the first compare; 0 reads kh, kw.
template <int KH, int KW, typename T>
__device__ __forceinline__ float window_max(const T *p, int64_t w, int kh, int kw, float b, int *at) {
  if constexpr (KH > 0) {
    T v[KH * KW];
#pragma unroll
    for (int a = 0; a < KH; a++)
#pragma unroll
      for (int c = 0; c < KW; c++) v[a * KW + c] = p[a * w + c];
    float best = act(v[0], b);
    int who = 0;
#pragma unroll
    for (int q = 1; q < KH * KW; q++) {
      const float x = act(v[q], b);
      if (x > best || x != x) best = x, who = (int)((q / KW) * w + q % KW);
    }
    *at = who;
    return best;
  } else {
    float best = act(p[0], b);
    int who = 0;
    for (int a = 0; a < kh; a++)
      for (int c = 0; c < kw; c++) {
        const float x = act(p[a * w + c], b);
        if (x > best || x != x) best = x, who = (int)(a * w + c);
      }
    *at = who;
    return best;
  }
}

// ---- kernels ----
template <int KH, int KW, typename T>
__global__ void bias_relu_pool_fwd(const T *y, const T *bias, T *out, int64_t total, int64_t c, int64_t h, int64_t w,
                                   int64_t oh, int64_t ow, int kh, int kw) {
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = o % ow, i = (o / ow) % oh, plane = o / (ow * oh);
    int at;
    const float v =
        window_max<KH, KW>(y + (plane * h + i * kh) * w + j * kw, w, kh, kw, kt::to_f(bias[plane % c]), &at);
    out[o] = kt::from_f<T>(v);
  }
}

// A block per (n, c) plane, a thread per window: it writes its window's kh * kw
// gradients (the output gradient at the winner, or nothing where the window's value
// is <= 0); then the rows and columns no window covers get zeros.
template <int KH, int KW, typename T>
__global__ void bias_relu_pool_bwd(const T *g, const T *y, const T *bias, T *gy, float *plane_sums, int64_t c,
                                   int64_t h, int64_t w, int64_t oh, int64_t ow, int kh, int kw) {
  const int64_t plane = blockIdx.x;
  const T *yp = y + plane * h * w, *gp = g + plane * oh * ow;
  T *out = gy + plane * h * w;
  const float b = kt::to_f(bias[plane % c]);
  const int khh = KH > 0 ? KH : kh, kww = KW > 0 ? KW : kw;
  float sum = 0.f;
  for (int64_t q = threadIdx.x; q < oh * ow; q += blockDim.x) {
    const int64_t corner = (q / ow) * khh * w + (q % ow) * kww;
    int at;
    const float m = window_max<KH, KW>(yp + corner, w, kh, kw, b, &at);
    const float v = m <= 0.f ? 0.f : kt::to_f(gp[q]);
    const T tv = kt::from_f<T>(v), zero = kt::from_f<T>(0.f);
    for (int a = 0; a < khh; a++)
      for (int e = 0; e < kww; e++) out[corner + a * w + e] = a * w + e == at ? tv : zero;
    sum += v;
  }
  const int64_t ch = oh * khh, cw = ow * kww;   // the covered rows and columns
  for (int64_t t = threadIdx.x; t < (h - ch) * w; t += blockDim.x) out[ch * w + t] = kt::from_f<T>(0.f);
  if (cw < w)
    for (int64_t t = threadIdx.x; t < ch * (w - cw); t += blockDim.x)
      out[(t / (w - cw)) * w + cw + t % (w - cw)] = kt::from_f<T>(0.f);
  const float total = kt::block_sum<1>(kt::Fv<1>{{sum}}).v[0];
  if (threadIdx.x == 0) plane_sums[plane] = total;
}

bool pool_args_ok(int64_t n, int64_t c, int64_t h, int64_t w, int kh, int kw) {
  return n >= 0 && c > 0 && kh > 0 && kw > 0 && h >= kh && w >= kw && n * c <= 0x7fffffff;
}

template <typename T>
kt_status fwd_run(const void *y, const void *bias, void *out, int64_t n, int64_t c, int64_t h, int64_t w, int kh,
                  int kw, cudaStream_t s) {
  const int64_t oh = h / kh, ow = w / kw, total = n * c * oh * ow;
  if (total == 0) return KT_OK;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 65535 * 16 ? blocks : 65535 * 16);
  if (kh == 2 && kw == 2)
    bias_relu_pool_fwd<2, 2, T><<<grid, threads, 0, s>>>((const T *)y, (const T *)bias, (T *)out, total, c, h, w, oh,
                                                         ow, kh, kw);
  else
    bias_relu_pool_fwd<0, 0, T><<<grid, threads, 0, s>>>((const T *)y, (const T *)bias, (T *)out, total, c, h, w, oh,
                                                         ow, kh, kw);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd_run(const void *g, const void *y, const void *bias, void *gy, float *sums, int64_t n, int64_t c,
                  int64_t h, int64_t w, int kh, int kw, cudaStream_t s) {
  if (n == 0) return KT_OK;
  const int64_t oh = h / kh, ow = w / kw, windows = oh * ow;
  const int threads = windows >= 256 ? 256 : (int)((windows + 31) / 32 * 32);
  const unsigned grid = (unsigned)(n * c);
  if (kh == 2 && kw == 2)
    bias_relu_pool_bwd<2, 2, T><<<grid, threads, 0, s>>>((const T *)g, (const T *)y, (const T *)bias, (T *)gy, sums, c,
                                                         h, w, oh, ow, kh, kw);
  else
    bias_relu_pool_bwd<0, 0, T><<<grid, threads, 0, s>>>((const T *)g, (const T *)y, (const T *)bias, (T *)gy, sums, c,
                                                         h, w, oh, ow, kh, kw);
  return kt::status_of(cudaGetLastError());
}

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_bias_relu_pool(kt_dtype t, const void *y, const void *bias, void *out, int64_t n, int64_t c,
                                       int64_t h, int64_t w, int kh, int kw, void *stream) {
  if (!pool_args_ok(n, c, h, w, kh, kw) || (n > 0 && (!y || !bias || !out))) return KT_ERR_INVALID;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, fwd_run<T>(y, bias, out, n, c, h, w, kh, kw, s))
}

extern "C" kt_status kt_bias_relu_pool_backward(kt_dtype t, const void *grad_out, const void *y, const void *bias,
                                                void *gy, float *plane_sums, int64_t n, int64_t c, int64_t h,
                                                int64_t w, int kh, int kw, void *stream) {
  if (!pool_args_ok(n, c, h, w, kh, kw) || (n > 0 && (!grad_out || !y || !bias || !gy || !plane_sums)))
    return KT_ERR_INVALID;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, bwd_run<T>(grad_out, y, bias, gy, plane_sums, n, c, h, w, kh, kw, s))
}
