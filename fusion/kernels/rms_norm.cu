// fusion/kernels/rms_norm.cu — RMSNorm (LLaMA): y = x * rsqrt(mean(x^2) + eps) * w
// over the last dimension, and its backward.
//
// One block per row. For fp32 the forward keeps the row in registers when it fits
// (up to 32 KB: 8 vectors a thread), so x is read once; otherwise it is read twice,
// the second time mostly from L1/L2. The backward needs no saved state: one pass
// forms sum(x^2) and sum(g * w * x) together, the second writes
//   grad_x = r * w * g - x * r^3 / n * sum(g * w * x),   r = rsqrt(mean(x^2) + eps)
// and r per row goes out for the weight's gradient (a reduction over rows).
// Statistics are fp32; rows whose pointers are 16-byte aligned with n a multiple
// of the vector width use 16-byte loads.
#include "rows.cuh"

namespace {

// ---- reference (per row, fp32) ----
// r = 1 / sqrt(sum(x^2) / n + eps); y_i = x_i * r * w_i

// ---- kernels ----
using kt::Row;

template <typename T, bool VEC>
__global__ void rms_norm_fwd(const T *x, const T *w, T *y, int64_t n, float eps) {
  using R = Row<T, VEC>;
  constexpr int V = R::V;
  constexpr int MAXC = 8;   // vectors a thread keeps in registers (rows up to 256 x 8 x 16 B = 32 KB)
  const T *xr = x + blockIdx.x * n;
  T *yr = y + blockIdx.x * n;
  const int64_t nv = n / V;
  // fp32 only: for 16-bit rows the re-reading loop below measured faster (94-98% of
  // copy against 62-65% this way; bf16 rows of 4096 on the H100,
  // bench/results/archive/kernels_elementwise_4a31e2b.json and _d692f4b_run*.json).
  if constexpr (VEC && sizeof(T) == 4) if (nv <= (int64_t)MAXC * blockDim.x) {   // the row is read once
    T v[MAXC][V];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAXC; k++) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nv) {
        *reinterpret_cast<uint4 *>(v[k]) = reinterpret_cast<const uint4 *>(xr)[c];
#pragma unroll
        for (int j = 0; j < V; j++) { float f = kt::to_f(v[k][j]); ss += f * f; }
      }
    }
    const float r = rsqrtf(kt::block_sum<1>({{ss}}).v[0] / (float)n + eps);
#pragma unroll
    for (int k = 0; k < MAXC; k++) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nv) {
        T wv[V], out[V];
        *reinterpret_cast<uint4 *>(wv) = reinterpret_cast<const uint4 *>(w)[c];
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = kt::from_f<T>(kt::to_f(v[k][j]) * r * kt::to_f(wv[j]));
        reinterpret_cast<uint4 *>(yr)[c] = *reinterpret_cast<uint4 *>(out);
      }
    }
    return;
  }
  float ss = 0.f;   // longer rows: read twice (the second read mostly from L1/L2)
  R::each(xr, n, [&](int64_t, const T *v) {
#pragma unroll
    for (int j = 0; j < V; j++) { float f = kt::to_f(v[j]); ss += f * f; }
  });
  const float r = rsqrtf(kt::block_sum<1>({{ss}}).v[0] / (float)n + eps);
  R::each(xr, n, [&](int64_t i, const T *v) {
    T wv[V], out[V];
    if constexpr (VEC) *reinterpret_cast<uint4 *>(wv) = *reinterpret_cast<const uint4 *>(w + i);
    else wv[0] = w[i];
#pragma unroll
    for (int j = 0; j < V; j++) out[j] = kt::from_f<T>(kt::to_f(v[j]) * r * kt::to_f(wv[j]));
    if constexpr (VEC) *reinterpret_cast<uint4 *>(yr + i) = *reinterpret_cast<uint4 *>(out);
    else yr[i] = out[0];
  });
}

template <typename T, bool VEC>
__global__ void rms_norm_bwd(const T *g, const T *x, const T *w, T *gx, float *rstd, int64_t n, float eps) {
  using R = Row<T, VEC>;
  constexpr int V = R::V;
  const int64_t off = blockIdx.x * n;
  const T *xr = x + off, *gr = g + off;
  T *gxr = gx + off;
  auto load = kt::load_v<T, VEC>;
  float ss = 0.f, dot = 0.f;
  R::each(xr, n, [&](int64_t i, const T *v) {
    T gv[V], wv[V];
    load(gr, i, gv);
    load(w, i, wv);
#pragma unroll
    for (int j = 0; j < V; j++) {
      float f = kt::to_f(v[j]);
      ss += f * f;
      dot += kt::to_f(gv[j]) * kt::to_f(wv[j]) * f;
    }
  });
  const kt::Fv<2> s = kt::block_sum<2>({{ss, dot}});
  const float r = rsqrtf(s.v[0] / (float)n + eps);
  const float c = s.v[1] * r * r * r / (float)n;
  if (rstd && threadIdx.x == 0) rstd[blockIdx.x] = r;
  R::each(xr, n, [&](int64_t i, const T *v) {
    T gv[V], wv[V], out[V];
    load(gr, i, gv);
    load(w, i, wv);
#pragma unroll
    for (int j = 0; j < V; j++)
      out[j] = kt::from_f<T>(r * kt::to_f(wv[j]) * kt::to_f(gv[j]) - kt::to_f(v[j]) * c);
    if constexpr (VEC) *reinterpret_cast<uint4 *>(gxr + i) = *reinterpret_cast<uint4 *>(out);
    else gxr[i] = out[0];
  });
}

template <typename T>
kt_status fwd(const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps, cudaStream_t s) {
  bool vec = kt::row_vec_ok<T>(n, {x, w, y});
  int th = kt::row_threads<T>(n, vec);
  if (vec) rms_norm_fwd<T, true><<<(unsigned)rows, th, 0, s>>>((const T *)x, (const T *)w, (T *)y, n, eps);
  else rms_norm_fwd<T, false><<<(unsigned)rows, th, 0, s>>>((const T *)x, (const T *)w, (T *)y, n, eps);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd(const void *g, const void *x, const void *w, void *gx, float *rstd, int64_t rows, int64_t n, float eps,
              cudaStream_t s) {
  bool vec = kt::row_vec_ok<T>(n, {g, x, w, gx});
  int th = kt::row_threads<T>(n, vec);
  if (vec)
    rms_norm_bwd<T, true><<<(unsigned)rows, th, 0, s>>>((const T *)g, (const T *)x, (const T *)w, (T *)gx, rstd, n, eps);
  else
    rms_norm_bwd<T, false><<<(unsigned)rows, th, 0, s>>>((const T *)g, (const T *)x, (const T *)w, (T *)gx, rstd, n,
                                                         eps);
  return kt::status_of(cudaGetLastError());
}

bool bad(int64_t rows, int64_t n, float eps) { return rows < 0 || rows > 0x7fffffff || n <= 0 || !(eps >= 0.f); }

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_rms_norm(kt_dtype t, const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps,
                                 void *stream) {
  if (bad(rows, n, eps) || !w || (rows && (!x || !y))) return KT_ERR_INVALID;   // no rows: x, y empty (NULL)
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, fwd<T>(x, w, y, rows, n, eps, s))
}

extern "C" kt_status kt_rms_norm_backward(kt_dtype t, const void *grad, const void *x, const void *w, void *grad_x,
                                          float *rstd, int64_t rows, int64_t n, float eps, void *stream) {
  if (bad(rows, n, eps) || !w || (rows && (!grad || !x || !grad_x))) return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, bwd<T>(grad, x, w, grad_x, rstd, rows, n, eps, s))
}
