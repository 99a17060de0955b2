// fusion/kernels/layer_norm.cu — LayerNorm over the last dimension, with an
// optional residual added first and an optional ReLU after, and its backward:
//   h = x (+ residual)                       (written out when there is a residual)
//   y = [relu]((h - mean(h)) * rstd * w + b),   rstd = rsqrt(var(h) + eps)
// add_layer_norm and layer_norm_relu are this kernel with one option each.
//
// One block per row, two passes over the row (the second mostly from L1/L2; fp32
// rows without a residual are kept in registers instead when they fit):
// the first forms the statistics, the second writes. The statistics are fp32
// sums of h - s and (h - s)^2 with s the row's first element, so a row whose mean
// is large against its spread does not cancel catastrophically. h is rounded to
// the storage type before the statistics, as PyTorch's eager add + layer_norm do.
//
// The backward keeps no state from the forward: it recomputes mean and rstd from
// h, then (one pass each) the row sums of dy = g * w (masked by y > 0 with ReLU)
// and dy * xhat, and writes
//   grad_h = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) (+ grad of h's output)
// mean and rstd go out per row for the weight and bias gradients, which a column
// kernel reduces over row stripes into fp32 partials (summed by the caller).
//
// Rows that fit in a warp's registers (16-byte vectors, at most 4 a lane: n <= 1024
// in 16-bit types, 512 in fp32) take a warp per row instead, with warp-shuffle sums
// only and every input read once: ln_fwd_warp, and ln_bwd_warp, one kernel in which
// each warp also accumulates its rows' weight and bias terms per column and the block
// sums them into its stripe's partials (one block a stripe of rows; stripes from
// kt_layer_norm_backward_splits). (One block of 64 threads per GPT row, with two
// block-wide sums and a separate column kernel, took 11.8 us a call for 4096 x 512
// bf16 rows on the H100, bench/results/archive/h100_profile_graph_3403d9c.log.)
#include "rows.cuh"

namespace {
using kt::load_v;
using kt::Row;
using kt::store_v;

// ---- reference (per row, fp32) ----
// mean = sum(h) / n; var = sum((h - mean)^2) / n; xhat = (h - mean) * rsqrt(var + eps)
// y = xhat * w + b, then max(y, 0) with ReLU.

// ---- kernels ----
struct Stats { float mean, rstd; };

// Shifted one-pass statistics of a row (d = h - s, s = the row's first element).
__device__ __forceinline__ Stats finish_stats(float s, float sd, float sd2, int64_t n, float eps) {
  const kt::Fv<2> t = kt::block_sum<2>({{sd, sd2}});
  const float m = t.v[0] / (float)n;
  const float var = fmaxf(t.v[1] / (float)n - m * m, 0.f);
  return {s + m, rsqrtf(var + eps)};
}

// y for the V elements of h at column i: (h - mean) * rstd * w + b, relu'd on request.
template <typename T, bool VEC, int V>
__device__ __forceinline__ void store_y(T *yr, int64_t i, const T *h, const T *w, const T *b, Stats st, bool relu) {
  T wv[V], bv[V], out[V];
  if (w) load_v<T, VEC>(w, i, wv);
  if (b) load_v<T, VEC>(b, i, bv);
#pragma unroll
  for (int j = 0; j < V; j++) {
    float o = (kt::to_f(h[j]) - st.mean) * st.rstd;
    if (w) o *= kt::to_f(wv[j]);
    if (b) o += kt::to_f(bv[j]);
    out[j] = kt::from_f<T>(relu ? fmaxf(o, 0.f) : o);
  }
  store_v<T, VEC>(yr, i, out);
}

template <typename T, bool VEC>
__global__ void ln_fwd(const T *x, const T *res, const T *w, const T *b, T *hout, T *y, int64_t n, float eps,
                       bool relu) {
  using R = Row<T, VEC>;
  constexpr int V = R::V;
  const int64_t off = blockIdx.x * n;
  const T *xr = x + off;
  const T *rr = res ? res + off : nullptr;
  T *hr = hout ? hout + off : nullptr;
  const float s = kt::to_f(kt::from_f<T>(kt::to_f(xr[0]) + (rr ? kt::to_f(rr[0]) : 0.f)));
  float sd = 0.f, sd2 = 0.f;
  // fp32 rows without a residual that fit in registers (up to 8 vectors a thread:
  // 32 KB rows) are read once, as in rms_norm.cu.
  constexpr int MAXC = 8;
  if constexpr (VEC && sizeof(T) == 4) if (!rr && n / V <= (int64_t)MAXC * blockDim.x) {
    T v[MAXC][V];
    const int64_t nv = n / V;
#pragma unroll
    for (int k = 0; k < MAXC; k++) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nv) {
        load_v<T, VEC>(xr, c * V, v[k]);
#pragma unroll
        for (int j = 0; j < V; j++) { float d = kt::to_f(v[k][j]) - s; sd += d; sd2 += d * d; }
      }
    }
    const Stats st = finish_stats(s, sd, sd2, n, eps);
    T *yr = y + off;
#pragma unroll
    for (int k = 0; k < MAXC; k++) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nv) store_y<T, VEC, V>(yr, c * V, v[k], w, b, st, relu);
    }
    return;
  }
  R::each(xr, n, [&](int64_t i, const T *v) {
    T h[V];
    if (rr) {
      T rv[V];
      load_v<T, VEC>(rr, i, rv);
#pragma unroll
      for (int j = 0; j < V; j++) h[j] = kt::from_f<T>(kt::to_f(v[j]) + kt::to_f(rv[j]));
      if (hr) store_v<T, VEC>(hr, i, h);
    } else {
#pragma unroll
      for (int j = 0; j < V; j++) h[j] = v[j];
    }
#pragma unroll
    for (int j = 0; j < V; j++) { float d = kt::to_f(h[j]) - s; sd += d; sd2 += d * d; }
  });
  const Stats st = finish_stats(s, sd, sd2, n, eps);
  // Second pass: h from hout when it was written (this thread wrote these chunks), else x (+ res) again.
  T *yr = y + off;
  for (int64_t c = threadIdx.x; c < n / V; c += blockDim.x) {
    const int64_t i = c * V;
    T h[V];
    if (hr) load_v<T, VEC>(hr, i, h);
    else {
      load_v<T, VEC>(xr, i, h);
      if (rr) {
        T rv[V];
        load_v<T, VEC>(rr, i, rv);
#pragma unroll
        for (int j = 0; j < V; j++) h[j] = kt::from_f<T>(kt::to_f(h[j]) + kt::to_f(rv[j]));
      }
    }
    store_y<T, VEC, V>(yr, i, h, w, b, st, relu);
  }
}

// dy = g * w for one chunk, zero where the ReLU output was not positive.
template <typename T, int V>
__device__ __forceinline__ void chunk_dy(const T *h, const T *g, const T *wv, const T *bv, Stats st, bool relu,
                                         float *xh, float *dy) {
#pragma unroll
  for (int j = 0; j < V; j++) {
    xh[j] = (kt::to_f(h[j]) - st.mean) * st.rstd;
    const float wj = wv ? kt::to_f(wv[j]) : 1.f;
    float gj = kt::to_f(g[j]);
    if (relu && !(xh[j] * wj + (bv ? kt::to_f(bv[j]) : 0.f) > 0.f)) gj = 0.f;
    dy[j] = gj * wj;
  }
}

template <typename T, bool VEC>
__global__ void ln_bwd(const T *g, const T *gh_in, const T *h, const T *w, const T *b, T *gh, float *mean_out,
                       float *rstd_out, int64_t n, float eps, bool relu) {
  using R = Row<T, VEC>;
  constexpr int V = R::V;
  const int64_t off = blockIdx.x * n;
  const T *hr = h + off, *gr = g + off;
  const float s = kt::to_f(hr[0]);
  float sd = 0.f, sd2 = 0.f;
  R::each(hr, n, [&](int64_t, const T *v) {
#pragma unroll
    for (int j = 0; j < V; j++) { float d = kt::to_f(v[j]) - s; sd += d; sd2 += d * d; }
  });
  const Stats st = finish_stats(s, sd, sd2, n, eps);
  if (threadIdx.x == 0) { mean_out[blockIdx.x] = st.mean; rstd_out[blockIdx.x] = st.rstd; }
  // Loads g, w, b for the chunk at i and forms xhat and dy.
  auto dy_at = [&](int64_t i, const T *v, float *xh, float *dy) {
    T gv[V], wv[V], bv[V];
    load_v<T, VEC>(gr, i, gv);
    if (w) load_v<T, VEC>(w, i, wv);
    if (b) load_v<T, VEC>(b, i, bv);
    chunk_dy<T, V>(v, gv, w ? wv : nullptr, b ? bv : nullptr, st, relu, xh, dy);
  };
  float sdy = 0.f, sdyx = 0.f;
  R::each(hr, n, [&](int64_t i, const T *v) {
    float xh[V], dy[V];
    dy_at(i, v, xh, dy);
#pragma unroll
    for (int j = 0; j < V; j++) { sdy += dy[j]; sdyx += dy[j] * xh[j]; }
  });
  const kt::Fv<2> t = kt::block_sum<2>({{sdy, sdyx}});
  const float mdy = t.v[0] / (float)n, mdyx = t.v[1] / (float)n;
  const T *ghr_in = gh_in ? gh_in + off : nullptr;
  T *ghr = gh + off;
  R::each(hr, n, [&](int64_t i, const T *v) {
    float xh[V], dy[V];
    T extra[V], out[V];
    dy_at(i, v, xh, dy);
    if (ghr_in) load_v<T, VEC>(ghr_in, i, extra);
#pragma unroll
    for (int j = 0; j < V; j++)
      out[j] = kt::from_f<T>(st.rstd * (dy[j] - mdy - xh[j] * mdyx) + (ghr_in ? kt::to_f(extra[j]) : 0.f));
    store_v<T, VEC>(ghr, i, out);
  });
}

constexpr int LNW_WARPS = 8, LNW_MAXC = 4;   // warps a block; 16-byte chunks a lane at most

// The statistics of a row held by a warp in registers: chunk k of a lane is columns
// (lane + 32 k) V ... (chunks past nv are not read); shifted by the row's first element
// (lane 0's chunk 0), summed by shuffles.
template <typename T, int C, int V>
__device__ __forceinline__ Stats warp_row_stats(const T (&hv)[C][V], int lane, int64_t nv, int64_t n, float eps) {
  const float s = __shfl_sync(0xffffffffu, kt::to_f(hv[0][0]), 0);
  float sd = 0.f, sd2 = 0.f;
#pragma unroll
  for (int k = 0; k < C; k++)
    if (lane + 32 * k < nv)
#pragma unroll
      for (int j = 0; j < V; j++) { float d = kt::to_f(hv[k][j]) - s; sd += d; sd2 += d * d; }
  const kt::Fv<2> t = kt::warp_sum<2>({{sd, sd2}});
  const float m = t.v[0] / (float)n;
  return {s + m, rsqrtf(fmaxf(t.v[1] / (float)n - m * m, 0.f) + eps)};
}

// The forward for rows that fit in a warp's registers (as ln_bwd_warp): a warp per row,
// x (and the residual) read once.
template <typename T, int C>
__global__ void __launch_bounds__(LNW_WARPS * 32)
    ln_fwd_warp(const T *x, const T *res, const T *w, const T *b, T *hout, T *y, int64_t rows, int64_t n, float eps,
                bool relu) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * LNW_WARPS + (threadIdx.x >> 5), nv = n / V, off = r * n;
  if (r >= rows) return;
  T hv[C][V];
#pragma unroll
  for (int k = 0; k < C; k++) {
    const int64_t c = lane + 32 * k;
    if (c < nv) {
      load_v<T, true>(x + off, c * V, hv[k]);
      if (res) {
        T rv[V];
        load_v<T, true>(res + off, c * V, rv);
#pragma unroll
        for (int j = 0; j < V; j++) hv[k][j] = kt::from_f<T>(kt::to_f(hv[k][j]) + kt::to_f(rv[j]));
      }
    }
  }
  const Stats st = warp_row_stats<T, C, V>(hv, lane, nv, n, eps);
#pragma unroll
  for (int k = 0; k < C; k++) {
    const int64_t c = lane + 32 * k;
    if (c < nv) {
      if (hout) store_v<T, true>(hout + off, c * V, hv[k]);
      store_y<T, true, V>(y + off, c * V, hv[k], w, b, st, relu);
    }
  }
}

// A warp per row; block = a stripe of rows (the warps take its rows in turn).
// part_w / part_b (may be NULL) [stripe * ld + col]: the stripe's sums of g' xhat and
// g' (g' = g masked by the ReLU). C = 16-byte chunks a lane (chunk k of a lane covers
// columns (lane + 32 k) V ...). RELU is a template flag so that the ReLU-free kernel
// carries no mask, and no bias at all.
//
// Per element the first pass forms xhat = (h - mean) rstd and dy = g' w, and adds to
// the row's sums of dy and dy xhat and to the lane's column sums of g' xhat and g';
// the second writes
//   grad_h = rstd (dy - xhat mean(dy xhat)) + (grad_h_in - rstd mean(dy)),
// the bracket on the right once per row and element's grad_h_in. Without ReLU and with
// C <= 2 the first pass keeps xhat and dy in registers for the second (2 C V floats a
// lane); otherwise the second pass forms them again, which keeps every kernel within
// 128 registers, 2 blocks an SM (kept, bf16 C = 2 with ReLU took 150; formed again,
// 122; C = 4 would not fit beside the loads: ptxas -v, sm_90,
// bench/results/archive/sass_ln_bwd_warp_48e2aca_e10e5ba_head.txt).
// (The earlier kernel formed every term twice under run-time ReLU, weight and bias
// tests: 127 registers and about 52 instructions an element, issue-bound at 3.6 warps
// a scheduler, bench/results/archive/h100_ncu_ln_bwd_fe19a6d.log. This one: 128 registers,
// 1.14 TB/s, 11.4 cycles a warp between issues, h100_ncu_ln_bwd_e10e5ba.log; GPT's 13
// calls 126.2 us against 133.1, h100_profile_graph_gpt_e10e5ba.log. Issuing the next
// row's loads first (recomputing xhat and dy to make room) was slower, 8.12 against
// 7.66 us a call, and so were 128 or 512 stripes, h100_ln_bwd_variants_e10e5ba.log.)
template <typename T, int C, bool RELU>
__global__ void __launch_bounds__(LNW_WARPS * 32)
    ln_bwd_warp(const T *g, const T *gh_in, const T *h, const T *w, const T *b, T *gh, float *mean_out,
                float *rstd_out, float *part_w, float *part_b, int64_t ld, int64_t rows, int64_t n, float eps) {
  constexpr int V = 16 / sizeof(T);
  constexpr bool KEEP = C <= 2 && !RELU;
  constexpr int CK = KEEP ? C : 1;
  __shared__ float sh[2][LNW_WARPS][32 * V];
  kt::pdl_trigger();   // the parameter sums' column pass may be scheduled now
  kt::pdl_wait();      // launched as a dependent: g comes from the kernel before
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nv = n / V, per = (rows + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = (int64_t)blockIdx.x * per, r1 = r0 + per < rows ? r0 + per : rows;
  const bool params = part_w || part_b;
  T wv[C][V];
  [[maybe_unused]] T bv[RELU ? C : 1][V];
  float aw[C][V], ab[C][V];
#pragma unroll
  for (int k = 0; k < C; k++) {
    const int64_t c = lane + 32 * k;
#pragma unroll
    for (int j = 0; j < V; j++) {
      wv[k][j] = kt::from_f<T>(1.f);
      if constexpr (RELU) bv[k][j] = kt::from_f<T>(0.f);
      aw[k][j] = ab[k][j] = 0.f;
    }
    if (c < nv) {
      if (w) load_v<T, true>(w, c * V, wv[k]);
      if constexpr (RELU)
        if (b) load_v<T, true>(b, c * V, bv[k]);
    }
  }
  // xhat, g' and dy of element j of chunk k
  auto terms = [&](const T (&hv)[C][V], const T (&gv)[C][V], int k, int j, Stats st, float &xh, float &gj,
                   float &dy) {
    xh = (kt::to_f(hv[k][j]) - st.mean) * st.rstd;
    const float wj = kt::to_f(wv[k][j]);
    gj = kt::to_f(gv[k][j]);
    if constexpr (RELU)
      if (!(xh * wj + kt::to_f(bv[k][j]) > 0.f)) gj = 0.f;
    dy = gj * wj;
  };
  for (int64_t r = r0 + warp; r < r1; r += LNW_WARPS) {
    const int64_t off = r * n;
    T hv[C][V], gv[C][V], ev[C][V];   // every load of the row issued at once
#pragma unroll
    for (int k = 0; k < C; k++) {
      const int64_t c = lane + 32 * k;
      if (c < nv) {
        load_v<T, true>(h + off, c * V, hv[k]);
        load_v<T, true>(g + off, c * V, gv[k]);
        if (gh_in) load_v<T, true>(gh_in + off, c * V, ev[k]);
        else
#pragma unroll
          for (int j = 0; j < V; j++) ev[k][j] = kt::from_f<T>(0.f);
      }
    }
    const Stats st = warp_row_stats<T, C, V>(hv, lane, nv, n, eps);
    if (lane == 0) { mean_out[r] = st.mean; rstd_out[r] = st.rstd; }
    float xs[CK][V], ds[CK][V];
    float sdy = 0.f, sdyx = 0.f;
#pragma unroll
    for (int k = 0; k < C; k++)
      if (lane + 32 * k < nv)
#pragma unroll
        for (int j = 0; j < V; j++) {
          float xh, gj, dy;
          terms(hv, gv, k, j, st, xh, gj, dy);
          sdy += dy;
          sdyx = fmaf(dy, xh, sdyx);
          aw[k][j] = fmaf(gj, xh, aw[k][j]);
          ab[k][j] += gj;
          if constexpr (KEEP) { xs[k][j] = xh; ds[k][j] = dy; }
        }
    const kt::Fv<2> t = kt::warp_sum<2>({{sdy, sdyx}});
    const float mdyx = t.v[1] / (float)n, shift = -st.rstd * (t.v[0] / (float)n);
#pragma unroll
    for (int k = 0; k < C; k++) {
      const int64_t c = lane + 32 * k;
      if (c < nv) {
        T out[V];
#pragma unroll
        for (int j = 0; j < V; j++) {
          float xh, dy;
          if constexpr (KEEP) {
            xh = xs[k][j];
            dy = ds[k][j];
          } else {
            float gj;
            terms(hv, gv, k, j, st, xh, gj, dy);
          }
          out[j] = kt::from_f<T>(fmaf(st.rstd, fmaf(-xh, mdyx, dy), kt::to_f(ev[k][j]) + shift));
        }
        store_v<T, true>(gh + off, c * V, out);
      }
    }
  }
  if (!params) return;
  // the block's stripe sums, chunk by chunk: each warp's terms through shared memory,
  // summed over the warps in order
#pragma unroll
  for (int k = 0; k < C; k++) {
#pragma unroll
    for (int j = 0; j < V; j++) { sh[0][warp][lane * V + j] = aw[k][j]; sh[1][warp][lane * V + j] = ab[k][j]; }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * 32 * V; i += blockDim.x) {
      const int which = i / (32 * V), e = i % (32 * V);
      const int64_t col = (int64_t)32 * k * V + e;
      float* dst = which ? part_b : part_w;
      if (dst && col < n) {
        float acc = 0.f;
        for (int q = 0; q < LNW_WARPS; q++) acc += sh[which][q][e];
        dst[blockIdx.x * ld + col] = acc;
      }
    }
    __syncthreads();
  }
}

// Weight and bias gradients: block (32, 8) covers 32 columns; blockIdx.y is a
// stripe of rows. pw/pb[stripe * n + col] = sum over the stripe of g_eff * xhat / g_eff.
template <typename T>
__global__ void ln_param(const T *g, const T *h, const float *mean, const float *rstd, const T *w, const T *b,
                         float *pw, float *pb, int64_t ld, int64_t rows, int64_t n, bool relu) {
  __shared__ float sw[8][33], sb[8][33];
  const int64_t col = (int64_t)blockIdx.x * 32 + threadIdx.x;
  const int64_t per = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = (int64_t)blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  float aw = 0.f, ab = 0.f;
  if (col < n) {
    const float wc = w ? kt::to_f(w[col]) : 1.f, bc = b ? kt::to_f(b[col]) : 0.f;
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const float xh = (kt::to_f(h[r * n + col]) - (mean ? mean[r] : 0.f)) * rstd[r];   // no mean: RMSNorm
      float gv = kt::to_f(g[r * n + col]);
      if (relu && !(xh * wc + bc > 0.f)) gv = 0.f;
      aw += gv * xh;
      ab += gv;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    for (int k = 1; k < 8; k++) { aw += sw[k][threadIdx.x]; ab += sb[k][threadIdx.x]; }
    if (pw) pw[blockIdx.y * ld + col] = aw;
    if (pb) pb[blockIdx.y * ld + col] = ab;
  }
}

// 16-byte chunks a lane for the warp-per-row kernels (1, 2 or 4), 0 when a row does not fit.
template <typename T> int warp_chunks(int64_t n) {
  constexpr int V = 16 / sizeof(T);
  if (n % V) return 0;
  const int64_t c = (n / V + 31) / 32;
  return c <= 1 ? 1 : c <= 2 ? 2 : c <= LNW_MAXC ? 4 : 0;
}

template <typename T, int C>
void launch_fwd_warp(const void *x, const void *res, const void *w, const void *b, void *hout, void *y, int64_t rows,
                     int64_t n, float eps, bool relu, cudaStream_t s) {
  const unsigned blocks = (unsigned)((rows + LNW_WARPS - 1) / LNW_WARPS);
  ln_fwd_warp<T, C><<<blocks, LNW_WARPS * 32, 0, s>>>((const T *)x, (const T *)res, (const T *)w, (const T *)b,
                                                       (T *)hout, (T *)y, rows, n, eps, relu);
}

template <typename T>
kt_status fwd(const void *x, const void *res, const void *w, const void *b, void *hout, void *y, int64_t rows,
              int64_t n, float eps, bool relu, cudaStream_t s) {
  const bool vec = kt::row_vec_ok<T>(n, {x, res, w, b, hout, y});
  if (vec && warp_chunks<T>(n)) {
    const int c = warp_chunks<T>(n);
    auto k = c == 1 ? launch_fwd_warp<T, 1> : c == 2 ? launch_fwd_warp<T, 2> : launch_fwd_warp<T, 4>;
    k(x, res, w, b, hout, y, rows, n, eps, relu, s);
    return kt::status_of(cudaGetLastError());
  }
  const int th = kt::row_threads<T>(n, vec);
  auto k = vec ? ln_fwd<T, true> : ln_fwd<T, false>;
  k<<<(unsigned)rows, th, 0, s>>>((const T *)x, (const T *)res, (const T *)w, (const T *)b, (T *)hout, (T *)y, n, eps,
                                  relu);
  return kt::status_of(cudaGetLastError());
}

template <typename T, int C>
void launch_bwd_warp(const void *g, const void *gh_in, const void *h, const void *w, const void *b, void *gh,
                     float *mean, float *rstd, float *pw, float *pb, int64_t ld, int64_t splits, int64_t rows,
                     int64_t n, float eps, bool relu, cudaStream_t s) {
  auto k = relu ? ln_bwd_warp<T, C, true> : ln_bwd_warp<T, C, false>;
  kt::launch_dependent(k, dim3((unsigned)splits), dim3(LNW_WARPS * 32), s, (const T *)g, (const T *)gh_in,
                       (const T *)h, (const T *)w, (const T *)b, (T *)gh, mean, rstd, pw, pb, ld, rows, n, eps);
}

template <typename T>
kt_status bwd(const void *g, const void *gh_in, const void *h, const void *w, const void *b, void *gh, float *mean,
              float *rstd, float *pw, float *pb, int64_t ld, int64_t splits, int64_t rows, int64_t n, float eps,
              bool relu, cudaStream_t s) {
  const bool vec = kt::row_vec_ok<T>(n, {g, gh_in, h, w, b, gh});
  if (vec && warp_chunks<T>(n)) {
    const int c = warp_chunks<T>(n);
    auto k = c == 1 ? launch_bwd_warp<T, 1> : c == 2 ? launch_bwd_warp<T, 2> : launch_bwd_warp<T, 4>;
    k(g, gh_in, h, w, b, gh, mean, rstd, pw, pb, ld, splits, rows, n, eps, relu, s);
    return kt::status_of(cudaGetLastError());
  }
  const int th = kt::row_threads<T>(n, vec);
  auto k = vec ? ln_bwd<T, true> : ln_bwd<T, false>;
  k<<<(unsigned)rows, th, 0, s>>>((const T *)g, (const T *)gh_in, (const T *)h, (const T *)w, (const T *)b, (T *)gh,
                                  mean, rstd, n, eps, relu);
  if (pw || pb) {
    dim3 grid((unsigned)((n + 31) / 32), (unsigned)splits);
    ln_param<T><<<grid, dim3(32, 8), 0, s>>>((const T *)g, (const T *)h, mean, rstd, (const T *)w, (const T *)b, pw,
                                             pb, ld, rows, n, relu);
  }
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status param_grads(const void *g, const void *h, const float *mean, const float *rstd, float *pw, float *pb,
                      int64_t splits, int64_t rows, int64_t n, cudaStream_t s) {
  ln_param<T><<<dim3((unsigned)((n + 31) / 32), (unsigned)splits), dim3(32, 8), 0, s>>>(
      (const T *)g, (const T *)h, mean, rstd, nullptr, nullptr, pw, pb, n, rows, n, false);
  return kt::status_of(cudaGetLastError());
}

bool bad(int64_t rows, int64_t n, float eps) { return rows < 0 || rows > 0x7fffffff || n <= 0 || !(eps >= 0.f); }

}  // namespace

// ---- launchers ----
extern "C" int64_t kt_layer_norm_param_splits(int64_t rows, int64_t n) {
  // about 512 blocks of 256 threads in all, each stripe at least 32 rows, at most 65535 stripes
  int64_t colblocks = (n + 31) / 32, s = (512 + colblocks - 1) / colblocks, most = (rows + 31) / 32;
  if (s > most) s = most;
  if (s > 65535) s = 65535;
  return s < 1 ? 1 : s;
}

extern "C" int64_t kt_layer_norm_backward_splits(kt_dtype t, int64_t rows, int64_t n) {
  const bool warp = t == KT_F32 ? warp_chunks<float>(n) > 0 : warp_chunks<__half>(n) > 0;
  if (!warp) return kt_layer_norm_param_splits(rows, n);
  // a block of LNW_WARPS warps a stripe, at most 256 stripes: GPT's 4096 x 512 bf16 rows
  // took 12.3 us a call so (two rows a warp in turn, h100_profile_graph_981bd6f.log)
  // and 13.5 us with a row a warp in 512 stripes (h100_profile_graph_9a767ce.log)
  int64_t s = (rows + LNW_WARPS - 1) / LNW_WARPS;
  if (s > 256) s = 256;
  return s < 1 ? 1 : s;
}

extern "C" kt_status kt_layer_norm(kt_dtype t, const void *x, const void *residual, const void *weight,
                                   const void *bias, void *sum_out, void *y, int64_t rows, int64_t n, float eps,
                                   int relu, void *stream) {
  if (bad(rows, n, eps) || (rows && (!x || !y)) || (sum_out && !residual)) return KT_ERR_INVALID;   // no rows: NULLs
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, fwd<T>(x, residual, weight, bias, sum_out, y, rows, n, eps, relu, s))
}

extern "C" kt_status kt_layer_norm_backward(kt_dtype t, const void *grad, const void *grad_h_in, const void *h,
                                            const void *weight, const void *bias, void *grad_h, float *mean,
                                            float *rstd, float *partial_w, float *partial_b, int64_t partial_ld,
                                            int64_t splits, int64_t rows, int64_t n, float eps, int relu,
                                            void *stream) {
  // no rows: the row tensors are empty (NULL pointers) and nothing is written, the
  // partials included (the caller's sums over no rows are zeros)
  if (bad(rows, n, eps) || (rows && (!grad || !h || !grad_h || !mean || !rstd)) || splits < 1 || splits > 65535 ||
      ((partial_w || partial_b) && partial_ld < n))
    return KT_ERR_INVALID;
  if ((partial_w && !weight) || (partial_b && !bias)) return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;
  cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, bwd<T>(grad, grad_h_in, h, weight, bias, grad_h, mean, rstd, partial_w, partial_b, partial_ld,
                        splits, rows, n, eps, relu, s))
}

extern "C" kt_status kt_layer_norm_param_grads(kt_dtype t, const void *grad, const void *h, const float *mean,
                                               const float *rstd, float *partial_w, float *partial_b, int64_t splits,
                                               int64_t rows, int64_t n, void *stream) {
  if (rows < 0 || n <= 0 || (rows && (!grad || !h || !rstd)) || (!partial_w && !partial_b) || splits < 1 ||
      splits > 65535)
    return KT_ERR_INVALID;
  if (rows == 0) return KT_OK;   // as kt_layer_norm_backward: the partials are not written
  KT_DISPATCH(t, param_grads<T>(grad, h, mean, rstd, partial_w, partial_b, splits, rows, n, (cudaStream_t)stream))
}
