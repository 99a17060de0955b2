// fusion/kernels/pool.cu — kitsune.bias_relu_pool: a convolution's bias, the ReLU
// after it and the max pooling after that, in one pass each way:
//   out = max_pool2d(relu(y + bias[c]), (kh, kw))
// over non-overlapping windows (stride = kernel, no padding, floor mode) of an NCHW
// contiguous y. LeNet-style blocks ran these as five ATen kernels forward (the
// broadcast add, relu, the pooling) and backward (the pooling's scatter, relu's mask,
// two reductions for the bias): 59 launches a LeNet-5 step against the stock graph's
// 49, bench/results/archive/h100_profile_graph_9d33764.log.
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
// LeNet's two backward calls, bench/results/archive/h100_profile_graph_496a15f.log.
#include "rows.cuh"

// kitsune.max_pool2d (the second half of this file): F.max_pool2d with dilation 1 and no
// indices returned, NCHW or channels-last. The forward writes the output and a byte per
// output, the winner's offset a * kw + b in its window (ATen saves an int64 flat index, 8
// bytes); the backward is a gather, a thread per input element (or per 4 channels of
// one, channels last) summing the output gradients of the windows it won, in ATen's
// order (window rows, then columns) and in fp32, so the gradient equals ATen's bit for
// bit. The Inception net's 3 x 3 stride-1 poolings in channels-last ran 68 us forward and
// 122 us backward a call in ATen's kernels (bench/results/archive/h100_profile_graph_3403d9c.log).

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

// ---- max_pool2d ----
// Index space: output element o (input element, backward) = ((outer * oh + i) * ow + j) *
// cs + q * V, where NCHW has outer = n * c + c_, cs = 1, V = 1, and channels-last has
// outer = n, cs = c and q the thread's V-channel group.
struct PoolGeo {
  int64_t h, w, oh, ow, cs, groups;   // groups: V-channel groups a pixel (1 for NCHW)
  int kh, kw, sh, sw, ph, pw;
};

using kt::Pack;
template <int V> using Bytes = Pack<uint8_t, V>;

// I: the index type, 32-bit unsigned where every index fits (its divisions cost a
// fraction of 64-bit ones), else int64_t. The Inception step's two backward calls took
// 201.1 us before it and 87.4 after, the forward's 71.8 and 56.9; bias_cat landed in
// between and the step runs on four streams, so that is not a controlled measurement
// (bench/results/archive/h100_profile_graph_inception_a71d291.log, _43fab21.log).
// K > 0: windows of at most K x K (the Inception net's 3 x 3), their loads unrolled and
// issued before the first compare; K = 0: runtime loops. Both compare in the same order.
template <typename T, int V, typename I, int K>
__global__ void max_pool_fwd(const T *x, T *out, uint8_t *where, I total, PoolGeo geo) {
  const I groups = (I)geo.groups, ow = (I)geo.ow, oh = (I)geo.oh, w = (I)geo.w, h = (I)geo.h, cs = (I)geo.cs;
  const int kh = geo.kh, kw = geo.kw;
  for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (I)gridDim.x * blockDim.x) {
    const I q = o % groups, r = o / groups, j = r % ow, r2 = r / ow, i = r2 % oh, outer = r2 / oh;
    // window corner (may lie in the padding: signed) and its rows / columns inside x
    const int64_t h0 = (int64_t)i * geo.sh - geo.ph, w0 = (int64_t)j * geo.sw - geo.pw;
    const int a0 = h0 < 0 ? (int)-h0 : 0, a1 = h0 + kh > (int64_t)h ? (int)(h - h0) : kh;
    const int b0 = w0 < 0 ? (int)-w0 : 0, b1 = w0 + kw > (int64_t)w ? (int)(w - w0) : kw;
    const T *base = x + (outer * h * w) * cs + q * V;
    float best[V];
    uint8_t who[V];
#pragma unroll
    for (int l = 0; l < V; l++) best[l] = -INFINITY, who[l] = (uint8_t)(a0 * kw + b0);
    auto take = [&](const Pack<T, V> &v, int a, int b) {
#pragma unroll
      for (int l = 0; l < V; l++) {
        const float f = kt::to_f(v.v[l]);
        if (f > best[l] || f != f) best[l] = f, who[l] = (uint8_t)(a * kw + b);
      }
    };
    if constexpr (K > 0) {
      Pack<T, V> v[K][K];
#pragma unroll
      for (int a = 0; a < K; a++)
#pragma unroll
        for (int b = 0; b < K; b++)
          if (a >= a0 && a < a1 && b >= b0 && b < b1)
            v[a][b] = *reinterpret_cast<const Pack<T, V> *>(base + ((I)(h0 + a) * w + (I)(w0 + b)) * cs);
#pragma unroll
      for (int a = 0; a < K; a++)
#pragma unroll
        for (int b = 0; b < K; b++)
          if (a >= a0 && a < a1 && b >= b0 && b < b1) take(v[a][b], a, b);
    } else {
      for (int a = a0; a < a1; a++)
        for (int b = b0; b < b1; b++)
          take(*reinterpret_cast<const Pack<T, V> *>(base + ((I)(h0 + a) * w + (I)(w0 + b)) * cs), a, b);
    }
    Pack<T, V> res;
    Bytes<V> wb;
#pragma unroll
    for (int l = 0; l < V; l++) res.v[l] = kt::from_f<T>(best[l]), wb.v[l] = who[l];
    const I at = r * cs + q * V;   // ((outer * oh + i) * ow + j) * cs + q * V
    *reinterpret_cast<Pack<T, V> *>(out + at) = res;
    *reinterpret_cast<Bytes<V> *>(where + at) = wb;
  }
}

// Input element (ih, iw) lies in the windows of outputs [i0, i1) x [j0, j1) (ATen's
// p_start / p_end); it takes the gradient of those whose winner it is.
// One window at a time: its winner byte, then its gradient only where the byte names
// this element. Loading all (up to 9) windows' bytes and gradients unrolled, before any
// compare, took 129.6 us for the Inception step's two calls against this loop's 80.6:
// nine 16-byte gradient loads a thread where one or two are used
// (bench/results/archive/h100_profile_graph_inception_31881b1.log, _5d29be8.log).
// adds: gradients of x from its other users, summed after the windows' (kt_addends).
template <typename T, int V, typename I>
__global__ void max_pool_bwd(const T *g_out, const uint8_t *where, T *g_in, I total, PoolGeo geo, kt_addends adds) {
  const I groups = (I)geo.groups, ow = (I)geo.ow, oh = (I)geo.oh, w = (I)geo.w, h = (I)geo.h, cs = (I)geo.cs;
  const I kh = (I)geo.kh, kw = (I)geo.kw, sh = (I)geo.sh, sw = (I)geo.sw, ph = (I)geo.ph, pw = (I)geo.pw;
  for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (I)gridDim.x * blockDim.x) {
    const I q = e % groups, r = e / groups, iw = r % w, r2 = r / w, ih = r2 % h, outer = r2 / h;
    const I hp = ih + ph, wp = iw + pw;   // in padded coordinates: no negative values
    const I i0 = hp < kh ? 0 : (sh == 1 ? hp - kh + 1 : (hp - kh) / sh + 1),
            i1 = min((sh == 1 ? hp : hp / sh) + 1, oh);
    const I j0 = wp < kw ? 0 : (sw == 1 ? wp - kw + 1 : (wp - kw) / sw + 1),
            j1 = min((sw == 1 ? wp : wp / sw) + 1, ow);
    float acc[V];
#pragma unroll
    for (int l = 0; l < V; l++) acc[l] = 0.f;
    const I plane = outer * oh, mine_at = r * cs + q * V;   // ((outer * h + ih) * w + iw) * cs + q * V
    for (I i = i0; i < (g_out ? i1 : i0); i++)
      for (I j = j0; j < j1; j++) {
        const uint8_t mine = (uint8_t)((hp - i * sh) * kw + (wp - j * sw));
        const I at = ((plane + i) * ow + j) * cs + q * V;
        const Bytes<V> wb = *reinterpret_cast<const Bytes<V> *>(where + at);
        bool any = false;
#pragma unroll
        for (int l = 0; l < V; l++) any |= wb.v[l] == mine;
        if (!any) continue;
        const Pack<T, V> gv = *reinterpret_cast<const Pack<T, V> *>(g_out + at);
#pragma unroll
        for (int l = 0; l < V; l++)
          if (wb.v[l] == mine) acc[l] += kt::to_f(gv.v[l]);
      }
    for (int k = 0; k < adds.n; k++) {
      const Pack<T, V> av = *reinterpret_cast<const Pack<T, V> *>(static_cast<const T *>(adds.p[k]) + mine_at);
#pragma unroll
      for (int l = 0; l < V; l++) acc[l] += kt::to_f(av.v[l]);
    }
    Pack<T, V> res;
#pragma unroll
    for (int l = 0; l < V; l++) res.v[l] = kt::from_f<T>(acc[l]);
    *reinterpret_cast<Pack<T, V> *>(g_in + mine_at) = res;
  }
}

// Every window holds at least one input element, offsets fit a byte, and the padding
// is at most half the window (ATen's rule, which also keeps windows off the padding).
bool max_pool_args_ok(const kt_pool2d *p) {
  if (!p) return false;
  const bool sizes = p->n >= 0 && p->c > 0 && p->h > 0 && p->w > 0 && p->oh > 0 && p->ow > 0;
  const bool win = p->kh > 0 && p->kw > 0 && p->kh * p->kw <= 256 && p->sh > 0 && p->sw > 0 && p->ph >= 0 &&
                   p->pw >= 0 && 2 * p->ph <= p->kh && 2 * p->pw <= p->kw;
  return sizes && win && (p->oh - 1) * p->sh - p->ph < p->h && (p->ow - 1) * p->sw - p->pw < p->w &&
         (p->oh - 1) * p->sh - p->ph + p->kh > 0 && (p->ow - 1) * p->sw - p->pw + p->kw > 0;
}

// The forward's windows of up to 3 x 3 take its unrolled loads (K = 3).
template <typename T, int V, typename I>
void max_pool_launch(bool backward, const void *a, const void *b, void *c, I total, const PoolGeo &g,
                     const kt_addends &adds, cudaStream_t s) {
  const int threads = 256;
  const int64_t blocks = ((int64_t)total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 65535 * 32 ? blocks : 65535 * 32);
  if (backward)
    max_pool_bwd<T, V, I><<<grid, threads, 0, s>>>((const T *)a, (const uint8_t *)b, (T *)c, total, g, adds);
  else if (g.kh <= 3 && g.kw <= 3)
    max_pool_fwd<T, V, I, 3><<<grid, threads, 0, s>>>((const T *)a, (T *)b, (uint8_t *)c, total, g);
  else
    max_pool_fwd<T, V, I, 0><<<grid, threads, 0, s>>>((const T *)a, (T *)b, (uint8_t *)c, total, g);
}

// Four channels a thread where channels are last and come in fours (aligned pointers),
// else one.
template <typename T>
kt_status max_pool_run(bool backward, const void *a, const void *b, void *c, const kt_pool2d *p,
                       const kt_addends &adds, cudaStream_t s) {
  const bool cl = p->channels_last != 0;
  bool aligned = !((uintptr_t)a & 15) && !((uintptr_t)b & 15) && !((uintptr_t)c & 15);
  for (int k = 0; k < adds.n; k++) aligned = aligned && !((uintptr_t)adds.p[k] & 15);
  const bool vec = cl && p->c % 4 == 0 && aligned;
  const int V = vec ? 4 : 1;
  const PoolGeo g{p->h, p->w, p->oh, p->ow, cl ? p->c : 1, cl ? p->c / V : 1,
                  p->kh, p->kw, p->sh, p->sw, p->ph, p->pw};
  const int64_t total = p->n * p->c / V * (backward ? p->h * p->w : p->oh * p->ow);
  if (total == 0) return KT_OK;
  // every element index, and the thread loop's last step past it, below 2^32
  const bool small = p->n * p->c * (p->h * p->w > p->oh * p->ow ? p->h * p->w : p->oh * p->ow) < (1ll << 31);
  if (vec && small) max_pool_launch<T, 4, uint32_t>(backward, a, b, c, (uint32_t)total, g, adds, s);
  else if (vec) max_pool_launch<T, 4, int64_t>(backward, a, b, c, total, g, adds, s);
  else if (small) max_pool_launch<T, 1, uint32_t>(backward, a, b, c, (uint32_t)total, g, adds, s);
  else max_pool_launch<T, 1, int64_t>(backward, a, b, c, total, g, adds, s);
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

extern "C" kt_status kt_max_pool2d(kt_dtype t, const void *x, void *out, uint8_t *where, const kt_pool2d *p,
                                   void *stream) {
  if (!max_pool_args_ok(p) || (p->n > 0 && (!x || !out || !where))) return KT_ERR_INVALID;
  const kt_addends none{};
  KT_DISPATCH(t, max_pool_run<T>(false, x, out, where, p, none, (cudaStream_t)stream))
}

extern "C" kt_status kt_max_pool2d_backward(kt_dtype t, const void *grad_out, const uint8_t *where, void *grad_in,
                                            const kt_pool2d *p, void *stream) {
  if (p && p->n > 0 && !grad_out) return KT_ERR_INVALID;
  const kt_addends none{};
  return kt_max_pool2d_backward_add(t, grad_out, where, &none, grad_in, p, stream);
}

extern "C" kt_status kt_max_pool2d_backward_add(kt_dtype t, const void *grad_out, const uint8_t *where,
                                                const kt_addends *adds, void *grad_in, const kt_pool2d *p,
                                                void *stream) {
  if (!max_pool_args_ok(p) || !adds || adds->n < 0 || adds->n > KT_POOL_ADDENDS) return KT_ERR_INVALID;
  for (int k = 0; k < adds->n; k++)
    if (p->n > 0 && !adds->p[k]) return KT_ERR_INVALID;
  if (p->n > 0 && ((grad_out && !where) || !grad_in)) return KT_ERR_INVALID;
  KT_DISPATCH(t, max_pool_run<T>(true, grad_out, where, grad_in, p, *adds, (cudaStream_t)stream))
}
