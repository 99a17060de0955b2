// fusion/kernels/embedding.cu — the weight gradient of an embedding lookup
// (F.embedding): grad_weight[v] = sum of grad[p] over the positions p whose index is v,
// zero for rows no position names and for padding_idx.
//
// ATen's CUDA backward sorts the int64 indices over all 64 bits (eight radix passes),
// then counts, scans and splits segments: 18 launches and about 86 us of GPT's step
// for 4096 tokens (bench/results/archive/h100_profile_graph_gpt_inception_81772ef.log), where
// the sums themselves read 4 MiB. Here: the indices become int32 keys sorted by cub's
// stable radix sort over only the bits the vocabulary needs (14 for 8192 rows: keys
// 0..rows, rows standing for an index out of range),
// with the positions as values; the gradient is zeroed; then a block per sorted
// position that starts a run of equal keys sums the run's gradient rows in fp32, in
// ascending position order (the sort is stable), and stores the row once. Fixed order:
// the same inputs give the same bits (ATen's backward is deterministic too).
#include <cub/device/device_radix_sort.cuh>

#include "rows.cuh"

namespace {

// keys[i] = indices[i] as int32 (an index outside [0, rows) becomes rows: sorted last,
// never summed; F.embedding's forward has already refused those), pos[i] = i.
__global__ void emb_keys(const int64_t *idx, int32_t *keys, int32_t *pos, int64_t n, int64_t rows) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = idx[i];
    keys[i] = (int32_t)(k >= 0 && k < rows ? k : rows);
    pos[i] = (int32_t)i;
  }
}

// Block i (a sorted position) works only where a run of equal keys starts; blockIdx.y
// tiles the row's columns, V a thread.
template <typename T, int V>
__global__ void emb_runs(const T *grad, const int32_t *keys, const int32_t *pos, T *out, int64_t n, int64_t dim,
                         int64_t rows, int64_t padding) {
  const int64_t i = blockIdx.x;
  const int32_t k = keys[i];
  if ((i > 0 && keys[i - 1] == k) || k >= rows || k == padding) return;
  const int64_t c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * V;
  if (c >= dim) return;
  float acc[V];
#pragma unroll
  for (int l = 0; l < V; l++) acc[l] = 0.f;
  for (int64_t j = i; j < n && keys[j] == k; j++) {
    const kt::Pack<T, V> g = *reinterpret_cast<const kt::Pack<T, V> *>(grad + (int64_t)pos[j] * dim + c);
#pragma unroll
    for (int l = 0; l < V; l++) acc[l] += kt::to_f(g.v[l]);
  }
  kt::Pack<T, V> r;
#pragma unroll
  for (int l = 0; l < V; l++) r.v[l] = kt::from_f<T>(acc[l]);
  *reinterpret_cast<kt::Pack<T, V> *>(out + (int64_t)k * dim + c) = r;
}

int key_bits(int64_t rows) {   // enough for keys 0..rows (rows: out of range)
  int b = 1;
  while (b < 31 && (1ll << b) <= rows) b++;
  return b;
}

// The workspace: keys and positions, in and out (4 int32 arrays of n), then cub's
// temporary storage; each piece 256-byte aligned.
int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

int64_t cub_bytes(int64_t n, int64_t rows) {
  size_t b = 0;
  if (cub::DeviceRadixSort::SortPairs(nullptr, b, (const int32_t *)nullptr, (int32_t *)nullptr,
                                      (const int32_t *)nullptr, (int32_t *)nullptr, (int)n, 0,
                                      key_bits(rows)) != cudaSuccess)
    return -1;
  return (int64_t)b;
}

template <typename T>
kt_status emb_backward(const void *grad, const int64_t *idx, int64_t n, int64_t dim, int64_t rows, int64_t padding,
                       void *out, char *ws, int64_t cub_size, cudaStream_t s) {
  cudaError_t e = cudaMemsetAsync(out, 0, (size_t)(rows * dim) * sizeof(T), s);
  if (e != cudaSuccess || n == 0) return kt::status_of(e);
  const int64_t a = align256(n * 4);
  int32_t *keys = (int32_t *)ws, *pos = (int32_t *)(ws + a), *keys2 = (int32_t *)(ws + 2 * a),
          *pos2 = (int32_t *)(ws + 3 * a);
  const int64_t blocks = (n + 255) / 256;
  emb_keys<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, s>>>(idx, keys, pos, n, rows);
  size_t tb = (size_t)cub_size;
  e = cub::DeviceRadixSort::SortPairs(ws + 4 * a, tb, keys, keys2, pos, pos2, (int)n, 0, key_bits(rows), s);
  if (e != cudaSuccess) return kt::status_of(e);
  constexpr int V = 16 / sizeof(T);
  const bool vec = dim % V == 0 && !((uintptr_t)grad & 15) && !((uintptr_t)out & 15);
  const int per = vec ? V : 1;
  const int64_t cols = (dim + per - 1) / per;
  const int threads = cols >= 128 ? 128 : (int)((cols + 31) / 32 * 32);
  const dim3 grid((unsigned)n, (unsigned)((cols + threads - 1) / threads));
  if (vec)
    emb_runs<T, V><<<grid, threads, 0, s>>>((const T *)grad, keys2, pos2, (T *)out, n, dim, rows, padding);
  else
    emb_runs<T, 1><<<grid, threads, 0, s>>>((const T *)grad, keys2, pos2, (T *)out, n, dim, rows, padding);
  return kt::status_of(cudaGetLastError());
}

}  // namespace

// ---- launchers ----
extern "C" int64_t kt_embedding_backward_workspace(int64_t n, int64_t rows) {
  if (n < 0 || n > 0x7fffffff || rows <= 0 || rows >= 0x7fffffff) return -1;
  if (n == 0) return 0;
  const int64_t c = cub_bytes(n, rows);
  return c < 0 ? -1 : 4 * align256(n * 4) + align256(c);
}

extern "C" kt_status kt_embedding_backward(kt_dtype t, const void *grad, const int64_t *indices, int64_t n,
                                           int64_t dim, int64_t rows, int64_t padding_idx, void *grad_weight,
                                           void *workspace, int64_t workspace_bytes, void *stream) {
  const int64_t need = kt_embedding_backward_workspace(n, rows);
  // dim 0: grad and grad_weight are empty (NULL pointers), nothing to write
  if (need < 0 || dim < 0 || dim > 0x7fffffff || (dim && !grad_weight) || (n > 0 && (!indices || (dim && !grad))) ||
      workspace_bytes < need || (need > 0 && !workspace) || ((uintptr_t)workspace & 255))
    return KT_ERR_INVALID;
  if ((dim + 127) / 128 > 65535) return KT_ERR_INVALID;   // the column tiles of grid.y
  if (dim == 0) return KT_OK;
  const int64_t cub_size = n ? workspace_bytes - 4 * align256(n * 4) : 0;
  KT_DISPATCH(t, emb_backward<T>(grad, indices, n, dim, rows, padding_idx, grad_weight, (char *)workspace, cub_size,
                                 (cudaStream_t)stream))
}
