// fusion/kernels/batch_norm.cu — BatchNorm over (N, C, S) (S: the spatial elements,
// 1 for (N, C) input) followed by ReLU, training and eval, and its backward:
//   y = relu((x - mean_c) * invstd_c * w_c + b_c)
// Training: mean and biased var per channel from the batch (fp32 sums of x - s_c,
// s_c the channel's first element, so a large mean does not cancel); running stats,
// fp32, updated as running = (1 - momentum) * running + momentum * batch (var
// unbiased). Eval: mean and invstd from the running stats (the caller passes them).
//
// Stats: a (C x splits) grid of blocks, each summing a stripe of the N images of one
// channel into fp32 partials; one thread per channel finishes them. Apply: one pass,
// a block per (image, channel) plane (the channel's constants loaded once; 16-byte
// vectors when the plane size allows), or flat elementwise for planes under 64
// elements. The first version indexed the channel per element with a 64-bit
// division: bf16 ran at 36% of copy bandwidth, eval mode included (H100,
// kernels_elementwise_17dcbd4.json). Backward: the same reduction for sum(g') and
// sum(g' * xhat), with g' = g where y > 0, then one pass like the apply:
//   training: gx = w * invstd * (g' - sum(g') / M - xhat * sum(g' * xhat) / M)
//   eval:     gx = w * invstd * g'
// and the weight/bias gradients are sum(g' * xhat) and sum(g').
#include "rows.cuh"

namespace {

// ---- reference ----
// M = N * S; mean_c = sum x / M; var_c = sum (x - mean)^2 / M; invstd = rsqrt(var + eps)

// ---- kernels ----
// part[c * splits + k] (two sums) over images [n0, n1) of channel c
template <typename T, bool VEC>
__global__ void bn_stats(const T *x, int64_t N, int64_t C, int64_t S, float *part) {
  const int64_t c = blockIdx.x, k = blockIdx.y, splits = gridDim.y;
  const int64_t per = (N + splits - 1) / splits, n0 = k * per, n1 = n0 + per < N ? n0 + per : N;
  const float shift = kt::to_f(x[c * S]);
  float s = 0.f, s2 = 0.f;
  for (int64_t n = n0; n < n1; n++)
    kt::Row<T, VEC>::each(x + (n * C + c) * S, S, [&](int64_t, const T *v) {
#pragma unroll
      for (int j = 0; j < kt::Row<T, VEC>::V; j++) {
        const float d = kt::to_f(v[j]) - shift;
        s += d, s2 += d * d;
      }
    });
  kt::Fv<2> t = kt::block_sum<2>({{s, s2}});
  if (threadIdx.x == 0) part[(c * splits + k) * 2] = t.v[0], part[(c * splits + k) * 2 + 1] = t.v[1];
}

template <typename T>
__global__ void bn_finish(const T *x, const float *part, int64_t splits, int64_t C, int64_t S, int64_t M, float eps,
                          float momentum, float *mean, float *invstd, float *run_mean, float *run_var) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.f, s2 = 0.f;
  for (int64_t k = 0; k < splits; k++) s += part[(c * splits + k) * 2], s2 += part[(c * splits + k) * 2 + 1];
  const float m = s / (float)M, var = fmaxf(s2 / (float)M - m * m, 0.f);
  const float mu = kt::to_f(x[c * S]) + m;
  mean[c] = mu;
  invstd[c] = rsqrtf(var + eps);
  if (run_mean) run_mean[c] = (1.f - momentum) * run_mean[c] + momentum * mu;
  if (run_var) run_var[c] = (1.f - momentum) * run_var[c] + momentum * (M > 1 ? var * (float)M / (float)(M - 1) : var);
}

template <typename T>
__global__ void bn_apply(const T *x, T *y, int64_t n, int64_t C, int64_t S, const float *mean, const float *invstd,
                         const T *w, const T *b, bool relu) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / S) % C;
    float v = (kt::to_f(x[i]) - mean[c]) * invstd[c];
    if (w) v *= kt::to_f(w[c]);
    if (b) v += kt::to_f(b[c]);
    y[i] = kt::from_f<T>(relu ? fmaxf(v, 0.f) : v);
  }
}

// The same, a block per (image, channel) plane of S contiguous elements at a time
// (the channel's constants loaded once, no per-element index division); 16-byte
// vectors when VEC.
template <typename T, bool VEC>
__global__ void bn_apply_planes(const T *x, T *y, int64_t planes, int64_t C, int64_t S, const float *mean,
                                const float *invstd, const T *w, const T *b, bool relu) {
  constexpr int V = kt::Row<T, VEC>::V;
  for (int64_t pl = blockIdx.x; pl < planes; pl += gridDim.x) {
    const int64_t c = pl % C;
    const float mu = mean[c], sc = invstd[c] * (w ? kt::to_f(w[c]) : 1.f), sh = b ? kt::to_f(b[c]) : 0.f;
    T *yp = y + pl * S;
    kt::Row<T, VEC>::each(x + pl * S, S, [&](int64_t i, const T *v) {
      T o[V];
#pragma unroll
      for (int j = 0; j < V; j++) {
        const float r = (kt::to_f(v[j]) - mu) * sc + sh;
        o[j] = kt::from_f<T>(relu ? fmaxf(r, 0.f) : r);
      }
      kt::store_v<T, VEC>(yp, i, o);
    });
  }
}

// part[(c * splits + k) * 2] = sums of g' and g' * xhat over a stripe of images
template <typename T, bool VEC>
__global__ void bn_bwd_stats(const T *g, const T *x, const T *y, int64_t N, int64_t C, int64_t S, const float *mean,
                             const float *invstd, bool relu, float *part) {
  const int64_t c = blockIdx.x, k = blockIdx.y, splits = gridDim.y;
  const int64_t per = (N + splits - 1) / splits, n0 = k * per, n1 = n0 + per < N ? n0 + per : N;
  const float mu = mean[c], is = invstd[c];
  float sg = 0.f, sgx = 0.f;
  constexpr int V = kt::Row<T, VEC>::V;
  for (int64_t n = n0; n < n1; n++) {
    const int64_t off = (n * C + c) * S;
    kt::Row<T, VEC>::each(g + off, S, [&](int64_t i, const T *gv) {
      T xv[V], yv[V];
      kt::load_v<T, VEC>(x + off, i, xv);
      if (relu) kt::load_v<T, VEC>(y + off, i, yv);
#pragma unroll
      for (int j = 0; j < V; j++) {
        const float gj = (relu && !(kt::to_f(yv[j]) > 0.f)) ? 0.f : kt::to_f(gv[j]);
        sg += gj, sgx += gj * (kt::to_f(xv[j]) - mu) * is;
      }
    });
  }
  kt::Fv<2> t = kt::block_sum<2>({{sg, sgx}});
  if (threadIdx.x == 0) part[(c * splits + k) * 2] = t.v[0], part[(c * splits + k) * 2 + 1] = t.v[1];
}

__global__ void bn_sum_parts(const float *part, int64_t splits, int64_t C, float *sum_g, float *sum_gx) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float a = 0.f, b = 0.f;
  for (int64_t k = 0; k < splits; k++) a += part[(c * splits + k) * 2], b += part[(c * splits + k) * 2 + 1];
  sum_g[c] = a, sum_gx[c] = b;
}

template <typename T>
__global__ void bn_bwd_apply(const T *g, const T *x, const T *y, T *gx, int64_t n, int64_t C, int64_t S, int64_t M,
                             const float *mean, const float *invstd, const T *w, const float *sum_g,
                             const float *sum_gx, bool relu, bool training) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / S) % C;
    float gv = (relu && !(kt::to_f(y[i]) > 0.f)) ? 0.f : kt::to_f(g[i]);
    const float scale = (w ? kt::to_f(w[c]) : 1.f) * invstd[c];
    if (training) {
      const float xh = (kt::to_f(x[i]) - mean[c]) * invstd[c];
      gv = gv - sum_g[c] / (float)M - xh * sum_gx[c] / (float)M;
    }
    gx[i] = kt::from_f<T>(scale * gv);
  }
}

template <typename T, bool VEC>
__global__ void bn_bwd_apply_planes(const T *g, const T *x, const T *y, T *gx, int64_t planes, int64_t C, int64_t S,
                                    int64_t M, const float *mean, const float *invstd, const T *w,
                                    const float *sum_g, const float *sum_gx, bool relu, bool training) {
  constexpr int V = kt::Row<T, VEC>::V;
  for (int64_t pl = blockIdx.x; pl < planes; pl += gridDim.x) {
    const int64_t c = pl % C, off = pl * S;
    const float is = invstd[c], mu = mean[c], scale = (w ? kt::to_f(w[c]) : 1.f) * is;
    const float mg = training ? sum_g[c] / (float)M : 0.f, mgx = training ? sum_gx[c] / (float)M : 0.f;
    kt::Row<T, VEC>::each(g + off, S, [&](int64_t i, const T *gv) {
      T xv[V], yv[V], o[V];
      if (training) kt::load_v<T, VEC>(x + off, i, xv);
      if (relu) kt::load_v<T, VEC>(y + off, i, yv);
#pragma unroll
      for (int j = 0; j < V; j++) {
        float gj = (relu && !(kt::to_f(yv[j]) > 0.f)) ? 0.f : kt::to_f(gv[j]);
        if (training) gj = gj - mg - (kt::to_f(xv[j]) - mu) * is * mgx;
        o[j] = kt::from_f<T>(scale * gj);
      }
      kt::store_v<T, VEC>(gx + off, i, o);
    });
  }
}

int64_t splits_for(int64_t N, int64_t C, int64_t S) {   // about 1024 blocks, each >= 4096 elements
  int64_t s = (1024 + C - 1) / C, most = (N * S + 4095) / 4096;
  s = s < most ? s : most;
  s = s < N ? s : N;
  return s < 1 ? 1 : s > 65535 ? 65535 : s;
}
int threads_for(int64_t S) { return S >= 256 ? 256 : S >= 128 ? 128 : 64; }
int grid_for(int64_t n) { int64_t g = (n + 255) / 256; return (int)(g < 132 * 16 ? g : 132 * 16); }

// Planes of at least kPlaneMin elements get the per-plane kernels; smaller ones (a
// (N, C) input has planes of 1) the flat elementwise kernels.
constexpr int64_t kPlaneMin = 64;
unsigned plane_grid(int64_t planes) { return (unsigned)(planes < (1 << 20) ? planes : (1 << 20)); }

template <typename T>
kt_status fwd(const void *x, void *y, const void *w, const void *b, int64_t N, int64_t C, int64_t S, int training,
              float momentum, float eps, float *mean, float *invstd, float *rm, float *rv, float *work, int relu,
              cudaStream_t s) {
  const bool vec = kt::row_vec_ok<T>(S, {x, y});
  if (training) {
    const int64_t sp = splits_for(N, C, S);
    const dim3 grid((unsigned)C, (unsigned)sp);
    if (vec) bn_stats<T, true><<<grid, threads_for(S), 0, s>>>((const T *)x, N, C, S, work);
    else bn_stats<T, false><<<grid, threads_for(S), 0, s>>>((const T *)x, N, C, S, work);
    bn_finish<T><<<(unsigned)((C + 255) / 256), 256, 0, s>>>((const T *)x, work, sp, C, S, N * S, eps, momentum, mean,
                                                              invstd, rm, rv);
  }
  if (S < kPlaneMin)
    bn_apply<T><<<grid_for(N * C * S), 256, 0, s>>>((const T *)x, (T *)y, N * C * S, C, S, mean, invstd, (const T *)w,
                                                     (const T *)b, relu);
  else if (vec)
    bn_apply_planes<T, true><<<plane_grid(N * C), threads_for(S), 0, s>>>((const T *)x, (T *)y, N * C, C, S, mean,
                                                                           invstd, (const T *)w, (const T *)b, relu);
  else
    bn_apply_planes<T, false><<<plane_grid(N * C), threads_for(S), 0, s>>>((const T *)x, (T *)y, N * C, C, S, mean,
                                                                            invstd, (const T *)w, (const T *)b, relu);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd(const void *g, const void *x, const void *y, void *gx, const void *w, int64_t N, int64_t C, int64_t S,
              int training, const float *mean, const float *invstd, float *sum_g, float *sum_gx, float *work, int relu,
              cudaStream_t s) {
  const int64_t sp = splits_for(N, C, S);
  const bool vec = kt::row_vec_ok<T>(S, {g, x, y, gx});
  const dim3 grid((unsigned)C, (unsigned)sp);
  const T *gt = (const T *)g, *xt = (const T *)x, *yt = (const T *)y, *wt = (const T *)w;
  if (vec) bn_bwd_stats<T, true><<<grid, threads_for(S), 0, s>>>(gt, xt, yt, N, C, S, mean, invstd, relu, work);
  else bn_bwd_stats<T, false><<<grid, threads_for(S), 0, s>>>(gt, xt, yt, N, C, S, mean, invstd, relu, work);
  bn_sum_parts<<<(unsigned)((C + 255) / 256), 256, 0, s>>>(work, sp, C, sum_g, sum_gx);
  if (S < kPlaneMin)
    bn_bwd_apply<T><<<grid_for(N * C * S), 256, 0, s>>>(gt, xt, yt, (T *)gx, N * C * S, C, S, N * S, mean, invstd, wt,
                                                         sum_g, sum_gx, relu, training);
  else if (vec)
    bn_bwd_apply_planes<T, true><<<plane_grid(N * C), threads_for(S), 0, s>>>(
        gt, xt, yt, (T *)gx, N * C, C, S, N * S, mean, invstd, wt, sum_g, sum_gx, relu, training);
  else
    bn_bwd_apply_planes<T, false><<<plane_grid(N * C), threads_for(S), 0, s>>>(
        gt, xt, yt, (T *)gx, N * C, C, S, N * S, mean, invstd, wt, sum_g, sum_gx, relu, training);
  return kt::status_of(cudaGetLastError());
}

bool bad(int64_t N, int64_t C, int64_t S) { return N <= 0 || C <= 0 || S <= 0 || C > 0x7fffffff; }

}  // namespace

// ---- launchers ----
extern "C" int64_t kt_batch_norm_workspace(int64_t N, int64_t C, int64_t S) {
  return N > 0 && C > 0 && S > 0 ? 2 * C * splits_for(N, C, S) : 0;
}

extern "C" kt_status kt_batch_norm(kt_dtype t, const void *x, void *y, const void *w, const void *b, int64_t N,
                                   int64_t C, int64_t S, int training, float momentum, float eps, float *mean,
                                   float *invstd, float *running_mean, float *running_var, float *workspace, int relu,
                                   void *stream) {
  if (bad(N, C, S) || !x || !y || !mean || !invstd || (training && !workspace) || !(eps >= 0)) return KT_ERR_INVALID;
  const cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, fwd<T>(x, y, w, b, N, C, S, training, momentum, eps, mean, invstd, running_mean, running_var,
                        workspace, relu, s))
}

extern "C" kt_status kt_batch_norm_backward(kt_dtype t, const void *grad, const void *x, const void *y, void *grad_x,
                                            const void *w, int64_t N, int64_t C, int64_t S, int training,
                                            const float *mean, const float *invstd, float *sum_g, float *sum_gx,
                                            float *workspace, int relu, void *stream) {
  if (bad(N, C, S) || !grad || !x || !grad_x || !mean || !invstd || !sum_g || !sum_gx || !workspace || (relu && !y))
    return KT_ERR_INVALID;
  const cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, bwd<T>(grad, x, y, grad_x, w, N, C, S, training, mean, invstd, sum_g, sum_gx, workspace, relu,
                        s))
}
