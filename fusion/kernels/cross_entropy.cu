// fusion/kernels/cross_entropy.cu — softmax cross-entropy per row, without the
// softmax ever being stored, and its gradient:
//   lse = log(sum_j exp(x_j));  q = (1 - eps) * onehot(t) + eps / C
//   loss = lse - (1 - eps) * x_t - eps / C * sum_j x_j       (= -sum_j q_j log softmax_j)
//   grad_j = scale * (softmax_j - q_j)
// A row whose target is ignore_index has loss 0 and gradient 0; a target outside
// [0, C) gives NaN (loss and gradient), which the caller can detect without a sync.
//
// One block per row. The first pass keeps a running max and a sum of exponentials
// rescaled to it (online softmax), plus sum_j x_j for label smoothing; a second
// pass, only when the gradient is asked for, writes it - in place over the logits
// if grad == logits (the chunked linear + cross-entropy uses that). Rows need not
// be aligned (vocabularies such as 50257 are odd): each row is read as a scalar
// head up to a 16-byte boundary, 16-byte vectors, and a scalar tail.
#include <math.h>

#include "rows.cuh"

namespace {

// ---- reference (per row, fp64) ----
// m = max_j x_j; lse = m + log(sum_j exp(x_j - m)); loss and grad as above.

// ---- kernels ----
// Calls f(i, x_i) for every element of a row this thread owns and, when out is not
// NULL, stores the value f returns at out[i]. out must have the same alignment as
// in modulo 16 bytes (or be NULL).
template <typename T, typename F> __device__ __forceinline__ void map_row(const T *in, T *out, int64_t n, F f) {
  constexpr int V = 16 / sizeof(T);
  int64_t head = (int64_t)(((16 - ((uintptr_t)in & 15)) & 15) / sizeof(T));
  if (head > n) head = n;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    float y = f(i, kt::to_f(in[i]));
    if (out) out[i] = kt::from_f<T>(y);
  }
  const int64_t nv = (n - head) / V;
  const uint4 *vin = reinterpret_cast<const uint4 *>(in + head);
  uint4 *vout = out ? reinterpret_cast<uint4 *>(out + head) : nullptr;
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    T v[V];
    *reinterpret_cast<uint4 *>(v) = vin[c];
#pragma unroll
    for (int j = 0; j < V; j++) {
      float y = f(head + c * V + j, kt::to_f(v[j]));
      v[j] = kt::from_f<T>(y);
    }
    if (vout) vout[c] = *reinterpret_cast<uint4 *>(v);
  }
  for (int64_t i = head + nv * V + threadIdx.x; i < n; i += blockDim.x) {
    float y = f(i, kt::to_f(in[i]));
    if (out) out[i] = kt::from_f<T>(y);
  }
}

// Calls f(v, k) with k <= V consecutive elements of a row (as fp32) at a time,
// covering every element this thread owns: single elements for the unaligned head
// and the tail, 16-byte vectors for the rest, two vectors loaded before use.
template <typename T, typename F> __device__ __forceinline__ void map_vecs(const T *in, int64_t n, F f) {
  constexpr int V = 16 / sizeof(T);
  int64_t head = (int64_t)(((16 - ((uintptr_t)in & 15)) & 15) / sizeof(T));
  if (head > n) head = n;
  float one[V];
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) { one[0] = kt::to_f(in[i]); f(one, 1); }
  const int64_t nv = (n - head) / V;
  const uint4 *vin = reinterpret_cast<const uint4 *>(in + head);
  int64_t c = threadIdx.x;
  for (; c + blockDim.x < nv; c += 2 * blockDim.x) {
    T a[V], b[V];
    *reinterpret_cast<uint4 *>(a) = vin[c];
    *reinterpret_cast<uint4 *>(b) = vin[c + blockDim.x];
    float fa[V], fb[V];
#pragma unroll
    for (int j = 0; j < V; j++) { fa[j] = kt::to_f(a[j]); fb[j] = kt::to_f(b[j]); }
    f(fa, V);
    f(fb, V);
  }
  if (c < nv) {
    T a[V];
    *reinterpret_cast<uint4 *>(a) = vin[c];
    float fa[V];
#pragma unroll
    for (int j = 0; j < V; j++) fa[j] = kt::to_f(a[j]);
    f(fa, V);
  }
  for (int64_t i = head + nv * V + threadIdx.x; i < n; i += blockDim.x) { one[0] = kt::to_f(in[i]); f(one, 1); }
}

// Block-wide (max, rescaled sum of exponentials, sum) from each thread's partials.
__device__ kt::Fv<3> block_lse(float m, float e, float sx) {
  __shared__ float mx[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  float M = m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  __syncthreads();
  if (lane == 0) mx[warp] = M;
  __syncthreads();
  M = lane < nwarps ? mx[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  const float scaled = m == -INFINITY ? 0.f : e * __expf(m - M);
  kt::Fv<2> s = kt::block_sum<2>({{scaled, sx}});
  return {{M, s.v[0], s.v[1]}};
}

template <typename T>
__global__ void ce_kernel(const T *logits, const int64_t *target, float *loss, T *grad, const float *scale, int64_t C,
                          int64_t ld, int64_t ignore, float smoothing) {
  const int64_t row = blockIdx.x;
  const T *x = logits + row * ld;
  const int64_t t = target[row];
  const bool ignored = t == ignore, valid = t >= 0 && t < C;
  // read x_t before any thread may overwrite the row (in-place gradient)
  const float xt = (!ignored && valid) ? kt::to_f(x[t]) : 0.f;
  float m = -INFINITY, e = 0.f, sx = 0.f;
  // Online softmax a vector at a time: one rescale per vector whose max is new, not
  // one branch per element. -inf logits (masked classes) add nothing.
  map_vecs<T>(x, C, [&](const float *v, int k) {
    float vm = v[0];
    for (int j = 1; j < k; j++) vm = fmaxf(vm, v[j]);
    if (vm > m) { e *= __expf(m - vm); m = vm; }   // exp(-inf) = 0 for the first vector
    if (m == -INFINITY) return;
    for (int j = 0; j < k; j++) { e += __expf(v[j] - m); sx += v[j]; }
  });
  const kt::Fv<3> r = block_lse(m, e, sx);
  const float lse = r.v[0] + __logf(r.v[1]);
  const float on = 1.f - smoothing, off = smoothing / (float)C;
  if (loss && threadIdx.x == 0)
    loss[row] = ignored ? 0.f : !valid ? NAN : lse - on * xt - off * r.v[2];
  if (!grad) return;
  T *g = grad + row * ld;
  if (ignored) {   // zero gradient
    map_row<T>(x, g, C, [](int64_t, float) { return 0.f; });
    return;
  }
  const float sc = !valid ? NAN : scale ? *scale : 1.f;
  map_row<T>(x, g, C, [&](int64_t i, float v) { return sc * (__expf(v - lse) - (i == t ? on : 0.f) - off); });
}

// One block: c = the number of targets that are not ignore_index, then
//   MEAN:  *out = sum(loss[0..rows)) / c, stored as T (0 / 0 = NaN when all are ignored)
//   SCALE: *scale = *grad / c (grad of type T; NULL means 1), the gradient kernel's scale
// A fixed order of additions: the same inputs give the same bits.
template <typename T, bool MEAN>
__global__ void ce_finish(const float *loss, const int64_t *target, int64_t rows, int64_t ignore, const T *grad,
                          T *out, float *scale) {
  float s = 0.f, c = 0.f;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    if (MEAN) s += loss[i];
    c += target[i] != ignore ? 1.f : 0.f;
  }
  const kt::Fv<2> r = kt::block_sum<2>({{s, c}});
  if (threadIdx.x) return;
  if (MEAN) *out = kt::from_f<T>(r.v[0] / r.v[1]);
  else *scale = (grad ? kt::to_f(*grad) : 1.f) / r.v[1];
}

// MEAN or SCALE by the output asked for (out), not by loss: with no rows loss is NULL
// and the mean still has to be written (NaN).
template <typename T>
kt_status finish(const float *loss, const int64_t *target, int64_t rows, int64_t ignore, const void *grad, void *out,
                 float *scale, cudaStream_t s) {
  if (out) ce_finish<T, true><<<1, 1024, 0, s>>>(loss, target, rows, ignore, nullptr, (T *)out, nullptr);
  else ce_finish<T, false><<<1, 1024, 0, s>>>(nullptr, target, rows, ignore, (const T *)grad, nullptr, scale);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status launch(const void *logits, const int64_t *target, float *loss, void *grad, const float *scale, int64_t rows,
                 int64_t C, int64_t ld, int64_t ignore, float smoothing, cudaStream_t s) {
  const int th = kt::row_threads<T>(C, true);   // <= 256: eight blocks an SM, few rows left for a second wave
  ce_kernel<T><<<(unsigned)rows, th, 0, s>>>((const T *)logits, target, loss, (T *)grad, scale, C, ld, ignore,
                                             smoothing);
  return kt::status_of(cudaGetLastError());
}

// g *= *by, unless *by is 1: then no element is read or written. The backward of a
// loss whose gradient the forward formed (for an incoming gradient of 1, which is
// what backward() passes) only rescales, and its incoming gradient exists only on
// the device. Grid-stride over 16-byte vectors when g is aligned, else elements.
template <typename T> __global__ void ce_rescale(T *g, int64_t n, const float *by) {
  const float s = *by;
  if (s == 1.f) return;
  constexpr int V = 16 / sizeof(T);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t nv = ((uintptr_t)g & 15) ? 0 : n / V;
  uint4 *gv = reinterpret_cast<uint4 *>(g);
  for (int64_t c = tid; c < nv; c += stride) {
    T v[V];
    float f[V];
    *reinterpret_cast<uint4 *>(v) = gv[c];
#pragma unroll
    for (int j = 0; j < V; j++) f[j] = kt::to_f(v[j]) * s;
    kt::store16(g + c * V, f);
  }
  for (int64_t i = nv * V + tid; i < n; i += stride) g[i] = kt::from_f<T>(kt::to_f(g[i]) * s);
}

template <typename T> kt_status rescale(void *g, int64_t n, const float *by, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  int64_t blocks = (n / V + 255) / 256;   // at most 1024, grid-striding; not tuned (at 1 it does nothing)
  blocks = blocks < 1 ? 1 : blocks > 1024 ? 1024 : blocks;
  ce_rescale<T><<<(unsigned)blocks, 256, 0, s>>>((T *)g, n, by);
  return kt::status_of(cudaGetLastError());
}

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_cross_entropy(kt_dtype t, const void *logits, const int64_t *target, float *loss, void *grad,
                                      const float *grad_scale, int64_t rows, int64_t C, int64_t ld,
                                      int64_t ignore_index, float label_smoothing, void *stream) {
  // no rows: nothing to read or write (the tensors are empty, their pointers NULL)
  if (rows < 0 || rows > 0x7fffffff || C <= 0 || ld < C || (rows && (!logits || !target || (!loss && !grad))))
    return KT_ERR_INVALID;
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f)) return KT_ERR_INVALID;
  if (grad && ((uintptr_t)grad & 15) != ((uintptr_t)logits & 15)) return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, launch<T>(logits, target, loss, grad, grad_scale, rows, C, ld, ignore_index, label_smoothing, s))
}

extern "C" kt_status kt_cross_entropy_mean(kt_dtype t, const float *loss, const int64_t *target, int64_t rows,
                                           int64_t ignore_index, void *out, void *stream) {
  if (rows < 0 || (rows && (!loss || !target)) || !out) return KT_ERR_INVALID;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, finish<T>(loss, target, rows, ignore_index, nullptr, out, nullptr, s))
}

extern "C" kt_status kt_cross_entropy_scale(kt_dtype t, const void *grad, const int64_t *target, int64_t rows,
                                            int64_t ignore_index, float *scale, void *stream) {
  if (rows < 0 || (rows && !target) || !scale) return KT_ERR_INVALID;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, finish<T>(nullptr, target, rows, ignore_index, grad, nullptr, scale, s))
}

extern "C" kt_status kt_cross_entropy_rescale(kt_dtype t, void *grad, int64_t n, const float *by, void *stream) {
  if (n < 0 || (n && !grad) || !by) return KT_ERR_INVALID;
  if (n == 0) return KT_OK;
  KT_DISPATCH(t, rescale<T>(grad, n, by, (cudaStream_t)stream))
}
