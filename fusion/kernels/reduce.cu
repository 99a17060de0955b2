// fusion/kernels/reduce.cu — sum of squares and mean of absolute values over the
// last dimension of a [rows, n] view (a full reduction is rows = 1):
//   sum_squared: out[r] = sum_i x[r, i]^2      mean_abs: out[r] = sum_i |x[r, i]| / n
// in fp32, rounded once to the storage type.
//
// Blocks form a (rows x splits) grid; each sums a contiguous slice of a row with
// 16-byte loads, four in flight per thread (scalar head and tail, so a slice
// may start anywhere). With one
// split per row the block writes the result; otherwise it writes an fp32 partial
// and a second kernel sums a row's partials. Splits are chosen so that the grid
// has about a thousand blocks, each of at least 8192 elements.
#include "rows.cuh"

namespace {

// ---- reference ----
// sum_squared(x) = sum(x * x); mean_abs(x) = sum(|x|) / n

// ---- kernels ----
template <int OP> __device__ __forceinline__ float term(float v) { return OP == 0 ? v * v : fabsf(v); }

template <typename T, int OP>
__global__ void reduce_slices(const T *x, T *out, float *part, int64_t n, int64_t per, float scale) {
  constexpr int V = 16 / sizeof(T);
  const int64_t row = blockIdx.x, split = blockIdx.y;
  const int64_t start = split * per, end = start + per < n ? start + per : n;
  const T *p = x + row * n + start;
  const int64_t len = end > start ? end - start : 0;
  int64_t head = (int64_t)(((16 - ((uintptr_t)p & 15)) & 15) / sizeof(T));
  if (head > len) head = len;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) acc += term<OP>(kt::to_f(p[i]));
  const int64_t nv = (len - head) / V;
  const uint4 *vp = reinterpret_cast<const uint4 *>(p + head);
  constexpr int U = 4;   // vectors in flight per thread
  int64_t c = threadIdx.x;
  for (; c + (U - 1) * (int64_t)blockDim.x < nv; c += U * (int64_t)blockDim.x) {
    T v[U][V];
#pragma unroll
    for (int u = 0; u < U; u++) *reinterpret_cast<uint4 *>(v[u]) = vp[c + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int j = 0; j < V; j++) acc += term<OP>(kt::to_f(v[u][j]));
  }
  for (; c < nv; c += blockDim.x) {
    T v[V];
    *reinterpret_cast<uint4 *>(v) = vp[c];
#pragma unroll
    for (int j = 0; j < V; j++) acc += term<OP>(kt::to_f(v[j]));
  }
  for (int64_t i = head + nv * V + threadIdx.x; i < len; i += blockDim.x) acc += term<OP>(kt::to_f(p[i]));
  acc = kt::block_sum<1>({{acc}}).v[0];
  if (threadIdx.x) return;
  if (gridDim.y == 1) out[row] = kt::from_f<T>(acc * scale);
  else part[row * gridDim.y + split] = acc;
}

template <typename T> __global__ void reduce_partials(const float *part, T *out, int64_t splits, float scale) {
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < splits; i += blockDim.x) acc += part[blockIdx.x * splits + i];
  acc = kt::block_sum<1>({{acc}}).v[0];
  if (threadIdx.x == 0) out[blockIdx.x] = kt::from_f<T>(acc * scale);
}

int64_t splits_for(int64_t rows, int64_t n) {
  int64_t s = (1024 + rows - 1) / rows, most = (n + 8191) / 8192;
  if (s > most) s = most;
  if (s > 1024) s = 1024;
  return s < 1 ? 1 : s;
}

template <typename T, int OP>
kt_status run(const void *x, void *out, float *ws, int64_t rows, int64_t n, cudaStream_t s) {
  const int64_t splits = splits_for(rows, n), per = (n + splits - 1) / splits;
  const float scale = OP == 1 ? 1.f / (float)n : 1.f;
  const int th = kt::row_threads<T>(per, true);
  reduce_slices<T, OP><<<dim3((unsigned)rows, (unsigned)splits), th, 0, s>>>((const T *)x, (T *)out, ws, n, per, scale);
  if (splits > 1) reduce_partials<T><<<(unsigned)rows, 256, 0, s>>>(ws, (T *)out, splits, scale);
  return kt::status_of(cudaGetLastError());
}

template <typename T> kt_status run_op(int op, const void *x, void *out, float *ws, int64_t rows, int64_t n,
                                       cudaStream_t s) {
  return op == 0 ? run<T, 0>(x, out, ws, rows, n, s) : run<T, 1>(x, out, ws, rows, n, s);
}

}  // namespace

// ---- launchers ----
extern "C" int64_t kt_reduce_workspace(int64_t rows, int64_t n) {
  if (rows <= 0 || n <= 0) return 0;
  int64_t s = splits_for(rows, n);
  return s > 1 ? rows * s : 0;
}

extern "C" kt_status kt_reduce(kt_dtype t, int op, const void *x, void *out, float *workspace, int64_t rows,
                               int64_t n, void *stream) {
  if (rows < 0 || rows > 0x7fffffff || n <= 0 || !x || !out || (op != KT_REDUCE_SUM_SQUARED && op != KT_REDUCE_MEAN_ABS))
    return KT_ERR_INVALID;
  if (kt_reduce_workspace(rows, n) && !workspace) return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, run_op<T>(op, x, out, workspace, rows, n, s))
}
