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
//
// Column sums of a row-major [rows, cols] matrix (a bias gradient: the sum over
// every row of a GEMM's output gradient): colsum: out[j] = sum_i x[i, j].
// Blocks of 32 x 8 threads form a (column tiles x slabs) grid: a thread owns V
// adjacent columns (one 16-byte vector a row where the columns and the row
// stride allow, else one column) and sums every 8th row of its slab, four loads
// in flight; the 8 row phases are then summed through shared memory. With one
// slab the block writes the result, otherwise an fp32 partial per slab that a
// second kernel sums in slab order. The order of every addition is fixed by the
// shape, so the result is deterministic. (One launch, with the last block of each
// tile to arrive at a counter summing its partials, was slower on the H100: GPT's 18
// bias sums took 8.0 us a call against 3.2 plus a 1.6 us second kernel, its 6 GELU
// passes 23.2 against 20.0 + 1.6, its 13 LayerNorm parameter sums 3.9 against
// 1.6 + 1.6, bench/results/archive/h100_profile_graph_gpt_b9e7b82.log against _e10e5ba.log
// and _fe19a6d.log: the fences, the atomic's round trip and a one-block tail over up
// to 128 slabs cost more than the second launch.) kt_relu_grad_colsum is the same pass over
// ReLU's output gradient that also masks it with ReLU's output and stores it: a
// linear_act("relu") backward's bias gradient and the GEMMs' operand in one kernel,
// where it was an elementwise kernel and cuBLASLt's BGRADB epilogue kernel.
// kt_bias_gelu_grad_colsum does the same for GELU (gx = grad * gelu'(x + bias)):
// a GELU-after-GEMM layer's backward, where an elementwise kernel wrote gx and a
// colsum read it back.
#include "gelu.cuh"
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

// ---- column sums ----
constexpr int CS_TX = 32, CS_TY = 8;   // a block: 32 column lanes x 8 row phases

// The pass's transform of the gradient it sums (G_*): G_NONE sums x itself; the
// others store the input gradient gx (row stride ld, as x and m) and sum it:
//   G_RELU:      gx = m > 0 ? x : 0, m ReLU's output (NaN gives 0);
//   G_GELU:      gx = x * gelu'(m + b), exact erf;  G_GELU_TANH: the tanh form;
// b the bias of the column (bias may be NULL: 0). The GELU forms sum the fp32
// products before gx is rounded to T.
enum { G_NONE = 0, G_RELU = 1, G_GELU = 2, G_GELU_TANH = 3 };

template <typename T, int G, int V>
__device__ __forceinline__ void grad_of(T *v, const T *mv, const float *b, float *f) {
  if constexpr (G == G_RELU) {
#pragma unroll
    for (int j = 0; j < V; j++) {
      if (!(kt::to_f(mv[j]) > 0.f)) v[j] = kt::from_f<T>(0.f);
      f[j] = kt::to_f(v[j]);
    }
  } else if constexpr (G == G_GELU || G == G_GELU_TANH) {
#pragma unroll
    for (int j = 0; j < V; j++) {
      f[j] = kt::to_f(v[j]) * kt::gelu_grad_ref<sizeof(T) == 2>(kt::to_f(mv[j]) + b[j], G == G_GELU_TANH);
      v[j] = kt::from_f<T>(f[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; j++) f[j] = kt::to_f(v[j]);
  }
}

template <typename T, typename O, int V, int G = G_NONE>
__global__ void __launch_bounds__(CS_TX *CS_TY)
    colsum_slabs(const T *x, O *out, float *part, int64_t rows, int64_t cols, int64_t ld, int64_t per,
                 const T *m = nullptr, T *gx = nullptr, const T *bias = nullptr) {
  __shared__ float sh[CS_TY][CS_TX * V + 1];
  kt::pdl_trigger();   // the partials kernel may be scheduled now; it waits for this one
  kt::pdl_wait();      // launched as a dependent: x (and m) come from the kernel before
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = ((int64_t)blockIdx.x * CS_TX + tx) * V;
  const int64_t r0 = (int64_t)blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; j++) acc[j] = 0.f;
  if (c0 < cols) {
    float b[V];
#pragma unroll
    for (int j = 0; j < V; j++) b[j] = 0.f;
    if constexpr (G == G_GELU || G == G_GELU_TANH)
      if (bias)
#pragma unroll
        for (int j = 0; j < V; j++) b[j] = kt::to_f(bias[c0 + j]);
    const T *p = x + c0;
    int64_t r = r0 + ty;
    constexpr int U = 4;   // rows in flight per thread
    // row r's V columns: transformed (G), stored to gx, added to the sums
    auto take = [&](int64_t r, T *v, const T *mv) {
      float f[V];
      grad_of<T, G, V>(v, mv, b, f);
      if constexpr (G != G_NONE) kt::store_v<T, (V > 1)>(gx + c0, r * ld, v);
#pragma unroll
      for (int j = 0; j < V; j++) acc[j] += f[j];
    };
    for (; r + (U - 1) * CS_TY < r1; r += U * CS_TY) {
      T v[U][V];
      [[maybe_unused]] T mv[G != G_NONE ? U : 1][V];
#pragma unroll
      for (int u = 0; u < U; u++) kt::load_v<T, (V > 1)>(p, (r + u * CS_TY) * ld, v[u]);
      if constexpr (G != G_NONE)
#pragma unroll
        for (int u = 0; u < U; u++) kt::load_v<T, (V > 1)>(m + c0, (r + u * CS_TY) * ld, mv[u]);
#pragma unroll
      for (int u = 0; u < U; u++) take(r + u * CS_TY, v[u], mv[G != G_NONE ? u : 0]);
    }
    for (; r < r1; r += CS_TY) {
      T v[V];
      [[maybe_unused]] T mv[V];
      kt::load_v<T, (V > 1)>(p, r * ld, v);
      if constexpr (G != G_NONE) kt::load_v<T, (V > 1)>(m + c0, r * ld, mv);
      take(r, v, mv);
    }
  }
#pragma unroll
  for (int j = 0; j < V; j++) sh[ty][tx * V + j] = acc[j];
  __syncthreads();
  // the tile's CS_TX * V columns, one per thread (V <= 8: at most 256 columns)
  const int t = ty * CS_TX + tx;
  const int64_t c = (int64_t)blockIdx.x * CS_TX * V + t;
  if (t >= CS_TX * V || c >= cols) return;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < CS_TY; k++) sum += sh[k][t];
  if (gridDim.y == 1) out[c] = kt::from_f<O>(sum);
  else part[blockIdx.y * cols + c] = sum;
}

// out[c] = the sum of part[s, c] over the slabs, in slab order: 32 columns x 8
// phases a block, each phase a contiguous run of slabs.
template <typename O>
__global__ void __launch_bounds__(CS_TX *CS_TY) colsum_partials(const float *part, O *out, int64_t slabs, int64_t cols) {
  __shared__ float sh[CS_TY][CS_TX + 1];
  kt::pdl_wait();   // the partials are colsum_slabs' (launched as its dependent)
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = (int64_t)blockIdx.x * CS_TX + tx, run = (slabs + CS_TY - 1) / CS_TY;
  const int64_t s0 = ty * run, s1 = s0 + run < slabs ? s0 + run : slabs;
  float acc = 0.f;
  if (c < cols)
    for (int64_t s = s0; s < s1; s++) acc += part[s * cols + c];
  sh[ty][tx] = acc;
  __syncthreads();
  if (ty || c >= cols) return;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < CS_TY; k++) sum += sh[k][tx];
  out[c] = kt::from_f<O>(sum);
}

// Slabs: about a thousand blocks in all (counting tiles of 16-byte vectors: v
// elements a lane), each slab at least 32 rows (4 a phase). Up to 128 rows take one
// slab: four rounds of loads in one block cost less than the second launch (the
// MLP's (64, 10) bias gradient ran as two kernels of 1.3 and 1.2 us in its graph,
// bench/results/archive/h100_profile_graph_9d33764.log).
int64_t colsum_slabs_for(int64_t rows, int64_t cols, int v) {
  if (rows <= 128) return 1;
  const int64_t tiles = (cols + CS_TX * v - 1) / (CS_TX * v);
  int64_t s = (1024 + tiles - 1) / tiles, most = (rows + 31) / 32;
  if (s > most) s = most;
  if (s > 65535) s = 65535;
  return s < 1 ? 1 : s;
}

template <typename T> bool colsum_vec_ok(const void *x, int64_t cols, int64_t ld) {
  constexpr int V = 16 / sizeof(T);
  return cols % V == 0 && ld % V == 0 && ((uintptr_t)x & 15) == 0;
}

template <typename T, typename O, int V, int G = G_NONE>
kt_status colsum_launch(const T *x, O *out, float *ws, int64_t rows, int64_t cols, int64_t ld, cudaStream_t s,
                        const T *m = nullptr, T *gx = nullptr, const T *bias = nullptr) {
  const int64_t slabs = colsum_slabs_for(rows, cols, 16 / sizeof(T)), per = (rows + slabs - 1) / slabs;
  const dim3 block(CS_TX, CS_TY);
  const unsigned tiles = (unsigned)((cols + CS_TX * V - 1) / (CS_TX * V));
  // both as dependent launches (kt::launch_dependent): the pass after a LayerNorm
  // backward, and the partials after the pass, start without a launch's latency
  kt::launch_dependent(colsum_slabs<T, O, V, G>, dim3(tiles, (unsigned)slabs), block, s, x, out, ws, rows, cols, ld,
                       per, m, gx, bias);
  if (slabs > 1)
    kt::launch_dependent(colsum_partials<O>, dim3((unsigned)((cols + CS_TX - 1) / CS_TX)), block, s, (const float *)ws,
                         out, slabs, cols);
  return kt::status_of(cudaGetLastError());
}

// One launch for the pass G: 16-byte vectors where x's columns and rows (and m, gx)
// allow, else one column a lane.
template <typename T, typename O, int G = G_NONE>
kt_status colsum_run(const void *x, void *out, float *ws, int64_t rows, int64_t cols, int64_t ld, cudaStream_t s,
                     const void *m = nullptr, void *gx = nullptr, const void *bias = nullptr) {
  const bool vec = colsum_vec_ok<T>(x, cols, ld) && (((uintptr_t)m | (uintptr_t)gx) & 15) == 0;
  return vec ? colsum_launch<T, O, 16 / sizeof(T), G>((const T *)x, (O *)out, ws, rows, cols, ld, s, (const T *)m,
                                                      (T *)gx, (const T *)bias)
             : colsum_launch<T, O, 1, G>((const T *)x, (O *)out, ws, rows, cols, ld, s, (const T *)m, (T *)gx,
                                         (const T *)bias);
}

// The pass g with its sums stored as O = T or fp32 (out_f32).
template <typename T, int G>
kt_status colsum_out(int out_f32, const void *x, void *out, float *ws, int64_t rows, int64_t cols, int64_t ld,
                     cudaStream_t s, const void *m, void *gx, const void *bias) {
  return out_f32 ? colsum_run<T, float, G>(x, out, ws, rows, cols, ld, s, m, gx, bias)
                 : colsum_run<T, T, G>(x, out, ws, rows, cols, ld, s, m, gx, bias);
}

template <typename T>
kt_status colsum_pass(int g, int out_f32, const void *x, void *out, float *ws, int64_t rows, int64_t cols,
                      int64_t ld, cudaStream_t s, const void *m, void *gx, const void *bias) {
  switch (g) {
    case G_RELU: return colsum_out<T, G_RELU>(out_f32, x, out, ws, rows, cols, ld, s, m, gx, bias);
    case G_GELU: return colsum_out<T, G_GELU>(out_f32, x, out, ws, rows, cols, ld, s, m, gx, bias);
    case G_GELU_TANH: return colsum_out<T, G_GELU_TANH>(out_f32, x, out, ws, rows, cols, ld, s, m, gx, bias);
    default: return colsum_out<T, G_NONE>(out_f32, x, out, ws, rows, cols, ld, s, m, gx, bias);
  }
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
  // no rows: nothing to write (x and out are empty, their pointers NULL); n = 0 stays
  // refused: its rows' results (0, or NaN for the mean) are the caller's to write
  if (rows < 0 || rows > 0x7fffffff || n <= 0 || (rows && (!x || !out)) ||
      (op != KT_REDUCE_SUM_SQUARED && op != KT_REDUCE_MEAN_ABS))
    return KT_ERR_INVALID;
  if (kt_reduce_workspace(rows, n) && !workspace) return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, run_op<T>(op, x, out, workspace, rows, n, s))
}

extern "C" int64_t kt_colsum_workspace(kt_dtype t, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  int64_t s = colsum_slabs_for(rows, cols, t == KT_F32 ? 4 : 8);
  return s > 1 ? s * cols : 0;
}

// kt_colsum(_to), and with m and gx a transformed pass (G_*, kt_relu_grad_colsum,
// kt_bias_gelu_grad_colsum): checks, then the launch. out_t: t, fp32, or (fp32 input)
// fp16 / bf16.
static kt_status colsum_entry(kt_dtype t, kt_dtype out_t, const void *x, void *out, float *workspace, int64_t rows,
                              int64_t cols, int64_t ld, void *stream, int g, const void *m, void *gx,
                              const void *bias) {
  // no rows: x, m and gx are empty (NULL pointers); out still gets its zeros
  if (rows < 0 || cols <= 0 || ld < cols || (rows && !x) || !out) return KT_ERR_INVALID;
  if (t != KT_F32 && t != KT_F16 && t != KT_BF16) return KT_ERR_INVALID;
  if (g != G_NONE && rows && (!m || !gx)) return KT_ERR_INVALID;
  const bool narrow = t == KT_F32 && (out_t == KT_F16 || out_t == KT_BF16);
  if (out_t != t && out_t != KT_F32 && !narrow) return KT_ERR_INVALID;
  if (narrow && g != G_NONE) return KT_ERR_INVALID;
  if (kt_colsum_workspace(t, rows, cols) && !workspace) return KT_ERR_INVALID;
  cudaStream_t s = (cudaStream_t)stream;
  if (rows == 0) {   // the sum over no rows is 0
    cudaError_t e = cudaMemsetAsync(out, 0, (size_t)cols * (out_t == KT_F32 ? 4 : 2), s);
    return kt::status_of(e);
  }
  if (narrow)
    return out_t == KT_F16 ? colsum_run<float, __half>(x, out, workspace, rows, cols, ld, s)
                           : colsum_run<float, __nv_bfloat16>(x, out, workspace, rows, cols, ld, s);
  KT_DISPATCH(t, colsum_pass<T>(g, out_t == KT_F32, x, out, workspace, rows, cols, ld, s, m, gx, bias))
}

extern "C" kt_status kt_colsum(kt_dtype t, int out_f32, const void *x, void *out, float *workspace, int64_t rows,
                               int64_t cols, int64_t ld, void *stream) {
  if (out_f32 != 0 && out_f32 != 1) return KT_ERR_INVALID;
  return colsum_entry(t, out_f32 ? KT_F32 : t, x, out, workspace, rows, cols, ld, stream, G_NONE, nullptr, nullptr,
                      nullptr);
}

extern "C" kt_status kt_colsum_to(kt_dtype t, kt_dtype out_t, const void *x, void *out, float *workspace,
                                  int64_t rows, int64_t cols, int64_t ld, void *stream) {
  return colsum_entry(t, out_t, x, out, workspace, rows, cols, ld, stream, G_NONE, nullptr, nullptr, nullptr);
}

extern "C" kt_status kt_relu_grad_colsum(kt_dtype t, int out_f32, const void *grad, const void *y, void *grad_in,
                                         void *out, float *workspace, int64_t rows, int64_t cols, void *stream) {
  if (out_f32 != 0 && out_f32 != 1) return KT_ERR_INVALID;
  return colsum_entry(t, out_f32 ? KT_F32 : t, grad, out, workspace, rows, cols, cols, stream, G_RELU, y, grad_in,
                      nullptr);
}

extern "C" kt_status kt_bias_gelu_grad_colsum(kt_dtype t, int out_f32, const void *grad, const void *x,
                                              const void *bias, void *grad_in, void *out, float *workspace,
                                              int64_t rows, int64_t cols, int approximate, void *stream) {
  if ((out_f32 != 0 && out_f32 != 1) || (approximate != 0 && approximate != 1)) return KT_ERR_INVALID;
  return colsum_entry(t, out_f32 ? KT_F32 : t, grad, out, workspace, rows, cols, cols, stream,
                      approximate ? G_GELU_TANH : G_GELU, x, grad_in, bias);
}

// Whether a captured graph's node is a kernel kt::launch_dependent launched: all of
// them wait for their predecessor (pdl_wait) before any global memory access. The node
// is asked through this library's own CUDA runtime, the one that registered the
// kernels: a runtime elsewhere (the bridge's, PyTorch's) does not know their entries.
extern "C" int kt_graph_node_waits_first(const void *node) {
  if (!node) return 0;
  auto n = reinterpret_cast<cudaGraphNode_t>(const_cast<void *>(node));
  cudaGraphNodeType type;
  cudaKernelNodeParams p = {};
  if (cudaGraphNodeGetType(n, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel ||
      cudaGraphKernelNodeGetParams(n, &p) != cudaSuccess || !p.func) {
    (void)cudaGetLastError();   // another library's kernel, or not a kernel node
    return 0;
  }
  for (auto &slot : kt::pdl_kernels) {
    const void *k = slot.load(std::memory_order_acquire);
    if (!k) return 0;
    if (k == p.func) return 1;
    cudaFunction_t f = nullptr;
    if (cudaGetFuncBySymbol(&f, k) == cudaSuccess && reinterpret_cast<const void *>(f) == p.func) return 1;
    (void)cudaGetLastError();
  }
  return 0;
}
