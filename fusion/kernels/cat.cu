// fusion/kernels/cat.cu — kitsune.bias_cat: torch.cat over dim 1 of convolution outputs,
// each with its bias added on the way, and the backward that splits the gradient into
// dense per-part gradients while it sums their bias gradients:
//   out[n, off_i + c, h, w] = x_i[n, c, h, w] + bias_i[c]
// An Inception block's four branches ended in four bias kernels and a cat forward, and
// backward in cuDNN's dense copies of the cat gradient's channel slices (two a
// convolution, its data and its weight gradient each make one) plus four bias sums:
// bench/results/archive/h100_copies_981bd6f.log, h100_profile_graph_3403d9c.log.
//
// Layouts: the parts, out and the part gradients share one, NCHW-contiguous or
// channels-last; the backward's incoming gradient may have any strides (the mean over
// H, W that ends a net gives a broadcast one). Channels last, a thread owns V = 4
// consecutive channels of one part (1 where a part's channel count is not a multiple
// of 4) and walks rows (pixels); NCHW, a block owns an (n, channel) plane.
//
// Sums: fp32, in a fixed order; the backward writes per-block partial sums that the
// caller reduces with kt_colsum (channels last: (blocks, C) partials; NCHW: (n, C)).
#include "rows.cuh"

namespace {


// The part, and the channel within it, of channel c of the concatenation.
struct Part {
  int i;
  int64_t c;
};
__device__ __forceinline__ Part part_of(const kt_cat_parts &p, int64_t c) {
  int i = 0;
  while (i + 1 < p.k && c >= p.off[i + 1]) i++;
  return {i, c - p.off[i]};
}

// ---- channels last: threadIdx.x / blockIdx.y pick a V-channel group, threadIdx.y and
// blockIdx.x stripe the rows (n, h, w) ----
template <typename T, int V>
__global__ void bias_cat_fwd_nhwc(kt_cat_parts p, T *out, int64_t rows, int64_t ctot) {
  const int64_t c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * V;
  if (c >= ctot) return;
  const Part q = part_of(p, c);
  const int64_t ci = p.c[q.i];
  const T *x = (const T *)p.data[q.i] + q.c, *bp = (const T *)p.bias[q.i] + q.c;
  float b[V];
#pragma unroll
  for (int l = 0; l < V; l++) b[l] = kt::to_f(bp[l]);
  for (int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (int64_t)gridDim.x * blockDim.y) {
    const kt::Pack<T, V> v = *reinterpret_cast<const kt::Pack<T, V> *>(x + r * ci);
    kt::Pack<T, V> o;
#pragma unroll
    for (int l = 0; l < V; l++) o.v[l] = kt::from_f<T>(kt::to_f(v.v[l]) + b[l]);
    *reinterpret_cast<kt::Pack<T, V> *>(out + r * ctot + c) = o;
  }
}

// g: element (row r = (n, h, w), channel c) at n * gs[0] + c * gs[1] + h * gs[2] + w * gs[3].
// partial: (gridDim.x, ctot) fp32, this block's sums over its rows.
template <typename T, int V>
__global__ void bias_cat_bwd_nhwc(const T *g, kt_cat_parts p, float *partial, int64_t rows, int64_t ctot, int64_t h,
                                  int64_t w, int64_t gs0, int64_t gs1, int64_t gs2, int64_t gs3) {
  extern __shared__ float red[];   // blockDim.y x blockDim.x x V
  const int64_t c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * V;
  float acc[V];
#pragma unroll
  for (int l = 0; l < V; l++) acc[l] = 0.f;
  if (c < ctot) {
    const Part q = part_of(p, c);
    const int64_t ci = p.c[q.i];
    T *gx = (T *)p.data[q.i] + q.c;
    const bool vec = gs1 == 1;
    // dense channels-last rows (the usual gradient): row r at r * ctot, no division
    const bool rows_dense = vec && gs3 == ctot && gs2 == w * ctot && gs0 == h * w * ctot;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (int64_t)gridDim.x * blockDim.y) {
      const T *src;
      if (rows_dense) {
        src = g + r * ctot + c;
      } else {
        const int64_t hw = h * w, n = r / hw, s = r - n * hw, y = s / w;
        src = g + n * gs0 + c * gs1 + y * gs2 + (s - y * w) * gs3;
      }
      kt::Pack<T, V> v;
      if (vec) v = *reinterpret_cast<const kt::Pack<T, V> *>(src);
      else
#pragma unroll
        for (int l = 0; l < V; l++) v.v[l] = src[l * gs1];
#pragma unroll
      for (int l = 0; l < V; l++) acc[l] += kt::to_f(v.v[l]);
      *reinterpret_cast<kt::Pack<T, V> *>(gx + r * ci) = v;
    }
  }
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int l = 0; l < V; l++) red[t * V + l] = acc[l];
  __syncthreads();
  if (threadIdx.y == 0 && c < ctot) {
    for (int yy = 1; yy < (int)blockDim.y; yy++)
#pragma unroll
      for (int l = 0; l < V; l++) acc[l] += red[(yy * blockDim.x + threadIdx.x) * V + l];
#pragma unroll
    for (int l = 0; l < V; l++) partial[blockIdx.x * ctot + c + l] = acc[l];
  }
}

// ---- NCHW: a block per (n, c) plane of h * w elements ----
template <typename T>
__global__ void bias_cat_fwd_nchw(kt_cat_parts p, T *out, int64_t ctot, int64_t hw) {
  const int64_t plane = blockIdx.x, n = plane / ctot, c = plane - n * ctot;
  const Part q = part_of(p, c);
  const T *x = (const T *)p.data[q.i] + (n * p.c[q.i] + q.c) * hw;
  const float b = kt::to_f(((const T *)p.bias[q.i])[q.c]);
  T *o = out + plane * hw;
  for (int64_t s = threadIdx.x; s < hw; s += blockDim.x) o[s] = kt::from_f<T>(kt::to_f(x[s]) + b);
}

// plane_sums: (n, ctot) fp32.
template <typename T>
__global__ void bias_cat_bwd_nchw(const T *g, kt_cat_parts p, float *plane_sums, int64_t ctot, int64_t w, int64_t hw,
                                  int64_t gs0, int64_t gs1, int64_t gs2, int64_t gs3) {
  const int64_t plane = blockIdx.x, n = plane / ctot, c = plane - n * ctot;
  const Part q = part_of(p, c);
  T *gx = (T *)p.data[q.i] + (n * p.c[q.i] + q.c) * hw;
  const T *src = g + n * gs0 + c * gs1;
  const bool dense = gs3 == 1 && gs2 == w;
  float sum = 0.f;
  for (int64_t s = threadIdx.x; s < hw; s += blockDim.x) {
    const T v = dense ? src[s] : src[(s / w) * gs2 + (s % w) * gs3];
    sum += kt::to_f(v);
    gx[s] = v;
  }
  const float total = kt::block_sum<1>(kt::Fv<1>{{sum}}).v[0];
  if (threadIdx.x == 0) plane_sums[plane] = total;
}

bool parts_ok(const kt_cat_parts *p, bool need_bias) {
  if (!p || p->k < 1 || p->k > KT_CAT_MAX || p->n < 0 || p->h < 1 || p->w < 1) return false;
  int64_t off = 0;
  for (int i = 0; i < p->k; i++) {
    if (p->c[i] < 1 || p->off[i] != off || (p->n > 0 && (!p->data[i] || (need_bias && !p->bias[i])))) return false;
    off += p->c[i];
  }
  return p->off[p->k] == off;
}

// Four channels a thread where every part's channel count is a multiple of 4 and every
// pointer is 16-byte aligned (channels last only).
bool vec4_ok(const kt_cat_parts *p, std::initializer_list<const void *> more) {
  if (!p->channels_last) return false;
  for (int i = 0; i < p->k; i++)
    if (p->c[i] % 4 || ((uintptr_t)p->data[i] & 15)) return false;
  for (const void *q : more)
    if ((uintptr_t)q & 15) return false;
  return true;
}

// Channels last: 256 threads; threadIdx.x and blockIdx.y cover the channel groups,
// threadIdx.y and blockIdx.x stripe the rows. The row stripes (the backward's partial
// sums) do not depend on V: about 32 rows a block, at most 1024 blocks.
int64_t row_blocks(int64_t rows) {
  const int64_t b = (rows + 31) / 32;
  return b < 1 ? 1 : b > 1024 ? 1024 : b;
}
struct NhwcGrid {
  dim3 grid, block;
};
NhwcGrid nhwc_grid(int64_t groups, int64_t rows) {
  const unsigned tx = (unsigned)(groups >= 256 ? 256 : (groups + 31) / 32 * 32);
  const unsigned gy = (unsigned)((groups + tx - 1) / tx), ty = 256 / tx;
  return {dim3((unsigned)row_blocks(rows), gy), dim3(tx, ty)};
}

template <typename T> kt_status fwd_run(const kt_cat_parts *p, void *out, cudaStream_t s) {
  const int64_t ctot = p->off[p->k], rows = p->n * p->h * p->w;
  if (rows == 0) return KT_OK;
  if (!p->channels_last) {
    const int64_t hw = p->h * p->w;
    const int threads = hw >= 256 ? 256 : (int)((hw + 31) / 32 * 32);
    bias_cat_fwd_nchw<T><<<(unsigned)(p->n * ctot), threads, 0, s>>>(*p, (T *)out, ctot, hw);
  } else if (vec4_ok(p, {out})) {
    const NhwcGrid gd = nhwc_grid(ctot / 4, rows);
    bias_cat_fwd_nhwc<T, 4><<<gd.grid, gd.block, 0, s>>>(*p, (T *)out, rows, ctot);
  } else {
    const NhwcGrid gd = nhwc_grid(ctot, rows);
    bias_cat_fwd_nhwc<T, 1><<<gd.grid, gd.block, 0, s>>>(*p, (T *)out, rows, ctot);
  }
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd_run(const void *g, const int64_t *gs, const kt_cat_parts *p, float *partial, cudaStream_t s) {
  const int64_t ctot = p->off[p->k], rows = p->n * p->h * p->w;
  if (rows == 0) return KT_OK;
  if (!p->channels_last) {
    const int64_t hw = p->h * p->w;
    const int threads = hw >= 256 ? 256 : (int)((hw + 31) / 32 * 32);
    bias_cat_bwd_nchw<T><<<(unsigned)(p->n * ctot), threads, 0, s>>>((const T *)g, *p, partial, ctot, p->w, hw, gs[0],
                                                                      gs[1], gs[2], gs[3]);
  } else if (vec4_ok(p, {g}) && (gs[1] != 1 || ((gs[0] | gs[2] | gs[3]) % 4 == 0))) {
    const NhwcGrid gd = nhwc_grid(ctot / 4, rows);
    const size_t smem = (size_t)gd.block.x * gd.block.y * 4 * sizeof(float);
    bias_cat_bwd_nhwc<T, 4><<<gd.grid, gd.block, smem, s>>>((const T *)g, *p, partial, rows, ctot, p->h, p->w, gs[0],
                                                            gs[1], gs[2], gs[3]);
  } else {
    const NhwcGrid gd = nhwc_grid(ctot, rows);
    const size_t smem = (size_t)gd.block.x * gd.block.y * sizeof(float);
    bias_cat_bwd_nhwc<T, 1><<<gd.grid, gd.block, smem, s>>>((const T *)g, *p, partial, rows, ctot, p->h, p->w, gs[0],
                                                            gs[1], gs[2], gs[3]);
  }
  return kt::status_of(cudaGetLastError());
}

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_bias_cat(kt_dtype t, const kt_cat_parts *parts, void *out, void *stream) {
  if (!parts_ok(parts, true) || (parts->n > 0 && !out)) return KT_ERR_INVALID;
  KT_DISPATCH(t, fwd_run<T>(parts, out, (cudaStream_t)stream))
}

extern "C" int64_t kt_bias_cat_partials(const kt_cat_parts *parts) {
  if (!parts_ok(parts, false)) return -1;
  if (!parts->channels_last) return parts->n;
  const int64_t rows = parts->n * parts->h * parts->w;
  return rows == 0 ? 0 : row_blocks(rows);
}

extern "C" kt_status kt_bias_cat_backward(kt_dtype t, const void *grad, const int64_t grad_strides[4],
                                          const kt_cat_parts *parts, float *partial, void *stream) {
  if (!parts_ok(parts, false) || (parts->n > 0 && (!grad || !grad_strides || !partial))) return KT_ERR_INVALID;
  KT_DISPATCH(t, bwd_run<T>(grad, grad_strides, parts, partial, (cudaStream_t)stream))
}
