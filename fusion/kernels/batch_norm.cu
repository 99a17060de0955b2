// fusion/kernels/batch_norm.cu — BatchNorm over (N, C, S) (S: the spatial elements,
// 1 for (N, C) input) followed by ReLU, training and eval, and its backward:
//   y = relu((x - mean_c) * invstd_c * w_c + b_c [+ r])
// r: an optional residual of x's shape and layout, added before the ReLU (a ResNet
// block's relu(bn(conv(h)) + identity): the normalized values are never stored, and
// the backward writes the residual's gradient, g' below, in the same pass as gx).
// Training: mean and biased var per channel from the batch (fp32 sums of x - s_c,
// s_c the channel's first element, so a large mean does not cancel); running stats,
// fp32, updated as running = (1 - momentum) * running + momentum * batch (var
// unbiased). Eval: mean and invstd from the running stats (the caller passes them).
//
// Training: each channel's images split into stripes (a (C x splits) grid, about
// 1024 blocks); a stats kernel sums every stripe into fp32 partials (its threads
// take 16-byte vectors straight across plane boundaries, four loads in flight
// each), and a warp per channel finishes them. The apply is elementwise, a 16-byte
// vector a thread with its channel found by a 32-bit division. The first version
// indexed the channel per element with a 64-bit division: bf16 ran at 36% of copy
// bandwidth, eval mode included (H100, kernels_elementwise_17dcbd4.json).
// Backward: the same reduction for sum(g') and sum(g' * xhat), with g' = g where
// y > 0, then one elementwise pass like the apply:
//   training: gx = w * invstd * (g' - sum(g') / M - xhat * sum(g' * xhat) / M)
//   eval:     gx = w * invstd * g'
// and the weight/bias gradients are sum(g' * xhat) and sum(g').
#include "rows.cuh"

namespace {

// ---- reference ----
// M = N * S; mean_c = sum x / M; var_c = sum (x - mean)^2 / M; invstd = rsqrt(var + eps)

// ---- kernels ----
// The statistics kernels split each channel into gridDim.y stripes of images; block
// (c, k) owns images [n0, n1) of channel c.
struct Stripe {
  int64_t c, n0, n1;
};
__device__ __forceinline__ Stripe stripe_of(int64_t N) {
  const int64_t per = (N + gridDim.y - 1) / gridDim.y, n0 = blockIdx.y * per;
  return {blockIdx.x, n0, n0 + per < N ? n0 + per : N};
}

// Visits every V-element vector of a stripe: the planes of S = vs * V contiguous
// elements starting at element base, CS elements apart. load(off, buf) reads the
// vector at element offset off into a B; use(buf) consumes it. The block's threads
// take consecutive vectors straight across plane boundaries (a thread per vector,
// however small the plane), and each issues U loads before it uses any. A block per
// plane with a vector per thread left most threads idle on small planes (a 4x4 plane
// is 2 bf16 vectors) and one load in flight on large ones: the statistics pass of
// batch_norm_relu ran at about 79% of copy at 64 MB (H100,
// kernels_elementwise_bf15c55_run2.json).
template <int V, int U, typename B, typename L, typename F>
__device__ __forceinline__ void stripe_each(int64_t base, int64_t count, int64_t vs, int64_t CS, L load, F use) {
  const int64_t bd = blockDim.x, step = U * bd, sn = step / vs, si = step % vs;
  int64_t off[U], i[U];
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int64_t k = threadIdx.x + u * bd;
    i[u] = k % vs, off[u] = base + (k / vs) * CS + i[u] * V;
  }
  int64_t k = threadIdx.x;
  for (; k + (U - 1) * bd < count; k += step) {
    B buf[U];
#pragma unroll
    for (int u = 0; u < U; u++) load(off[u], buf[u]);
#pragma unroll
    for (int u = 0; u < U; u++) {
      use(buf[u]);
      i[u] += si, off[u] += sn * CS + si * V;
      if (i[u] >= vs) i[u] -= vs, off[u] += CS - vs * V;
    }
  }
#pragma unroll
  for (int u = 0; u < U - 1; u++)
    if (k + u * bd < count) {
      B buf;
      load(off[u], buf);
      use(buf);
    }
}
constexpr int kUnroll = 4;

// The sums of channel c's splits partial pairs, summed by one warp in a fixed order
// (every block that asks gets bit-identical sums); every lane gets them.
__device__ __forceinline__ kt::Fv<2> channel_sums(const float *part, int64_t c, int64_t splits) {
  float a = 0.f, b = 0.f;
  for (int64_t k = threadIdx.x & 31; k < splits; k += 32) a += part[(c * splits + k) * 2], b += part[(c * splits + k) * 2 + 1];
  return kt::warp_sum<2>({{a, b}});
}

// part[(c * splits + k) * 2] (two sums of x - x[c, first]) over stripe k of channel c
template <typename T, bool VEC>
__global__ void bn_stats(const T *x, int64_t N, int64_t C, int64_t S, float *part) {
  constexpr int V = kt::Row<T, VEC>::V;
  const Stripe st = stripe_of(N);
  const float shift = kt::to_f(x[st.c * S]);
  float s = 0.f, s2 = 0.f;
  struct B { T v[V]; };
  stripe_each<V, kUnroll, B>(
      (st.n0 * C + st.c) * S, (st.n1 - st.n0) * (S / V), S / V, C * S,
      [&](int64_t off, B &b) { kt::load_v<T, VEC>(x, off, b.v); },
      [&](const B &b) {
#pragma unroll
        for (int j = 0; j < V; j++) {
          const float d = kt::to_f(b.v[j]) - shift;
          s += d, s2 += d * d;
        }
      });
  kt::Fv<2> t = kt::block_sum<2>({{s, s2}});
  if (threadIdx.x == 0) part[(st.c * gridDim.y + blockIdx.y) * 2] = t.v[0], part[(st.c * gridDim.y + blockIdx.y) * 2 + 1] = t.v[1];
}

// A warp per channel: mean and invstd (and the running stats) from the partials, in
// double. var = sum(d^2) / M - mean(d)^2 cancels leading bits when the shift (the
// channel's first element) is far from the mean: in fp32 that cost about two bits,
// an fp32 output error of 2.2e-6 against PyTorch's 5.0e-7 (channels-last (8, 24, 7, 9),
// H100, 0697ff5; 3.4e-6 -> 1.3e-6 in a host emulation of these kernels' rounding).
template <typename T>
__global__ void bn_finish(const T *x, const float *part, int64_t splits, int64_t C, int64_t S, int64_t M, float eps,
                          float momentum, float *mean, float *invstd, float *run_mean, float *run_var) {
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;   // one per warp: uniform exit
  if (c >= C) return;
  double s = 0.0, s2 = 0.0;
  for (int64_t k = threadIdx.x & 31; k < splits; k += 32) s += part[(c * splits + k) * 2], s2 += part[(c * splits + k) * 2 + 1];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o), s2 += __shfl_xor_sync(0xffffffffu, s2, o);
  if ((threadIdx.x & 31) != 0) return;
  const double m = s / (double)M, var = fmax(s2 / (double)M - m * m, 0.0);
  const float mu = (float)((double)kt::to_f(x[c * S]) + m);
  mean[c] = mu;
  invstd[c] = (float)(1.0 / sqrt(var + (double)eps));
  if (run_mean) run_mean[c] = (1.f - momentum) * run_mean[c] + momentum * mu;
  if (run_var) run_var[c] = (1.f - momentum) * run_var[c] + momentum * (float)(M > 1 ? var * (double)M / (double)(M - 1) : var);
}

// The channel of element-vector v (vs vectors a plane): a 32-bit division when the
// tensor allows (a 64-bit one costs about as much as the rest of the thread's work).
__device__ __forceinline__ int64_t channel_of(int64_t v, int64_t nvec, int64_t vs, int64_t C) {
  if (nvec < ((int64_t)1 << 32)) return (uint32_t)v / (uint32_t)vs % (uint32_t)C;
  return v / vs % C;
}

// The apply as an elementwise kernel: a V-element vector a thread (V = 1 when the
// planes or pointers do not allow 16-byte vectors), the channel's constants read
// through the cache. (A block per plane ran eval mode at 88% of copy at 64 MB,
// 48c508c; stripes of one channel's planes with four loads in flight a thread at 82%,
// and runs of consecutive planes with a constants table at 79%, both 76 registers a
// thread; H100, 707707a and 9743aae.)
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) bn_apply(const T *x, const T *res, T *y, int64_t nvec, int64_t vs, int64_t C,
                                                const float *mean, const float *invstd, const T *w, const T *b,
                                                bool relu) {
  constexpr int V = kt::Row<T, VEC>::V;
  const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t c = channel_of(v, nvec, vs, C);
  T in[V], rv[V], o[V];
  kt::load_v<T, VEC>(x, v * V, in);
  if (res) kt::load_v<T, VEC>(res, v * V, rv);
  const float mu = mean[c], sc = invstd[c] * (w ? kt::to_f(w[c]) : 1.f), sh = b ? kt::to_f(b[c]) : 0.f;
#pragma unroll
  for (int q = 0; q < V; q++) {
    const float r = (kt::to_f(in[q]) - mu) * sc + sh + (res ? kt::to_f(rv[q]) : 0.f);
    o[q] = kt::from_f<T>(relu ? fmaxf(r, 0.f) : r);
  }
  kt::store_v<T, VEC>(y, v * V, o);
}

// part[(c * splits + k) * 2] = sums of g' and g' * xhat over stripe k of channel c
template <typename T, bool VEC>
__global__ void bn_bwd_stats(const T *g, const T *x, const T *y, int64_t N, int64_t C, int64_t S, const float *mean,
                             const float *invstd, bool relu, float *part) {
  constexpr int V = kt::Row<T, VEC>::V;
  const Stripe st = stripe_of(N);
  const float mu = mean[st.c], is = invstd[st.c];
  float sg = 0.f, sgx = 0.f;
  struct B { T g[V], x[V], y[V]; };
  stripe_each<V, kUnroll, B>(
      (st.n0 * C + st.c) * S, (st.n1 - st.n0) * (S / V), S / V, C * S,
      [&](int64_t off, B &b) {
        kt::load_v<T, VEC>(g, off, b.g);
        kt::load_v<T, VEC>(x, off, b.x);
        if (relu) kt::load_v<T, VEC>(y, off, b.y);
      },
      [&](const B &b) {
#pragma unroll
        for (int j = 0; j < V; j++) {
          const float gj = (relu && !(kt::to_f(b.y[j]) > 0.f)) ? 0.f : kt::to_f(b.g[j]);
          sg += gj, sgx += gj * (kt::to_f(b.x[j]) - mu) * is;
        }
      });
  kt::Fv<2> t = kt::block_sum<2>({{sg, sgx}});
  if (threadIdx.x == 0)
    part[(st.c * gridDim.y + blockIdx.y) * 2] = t.v[0], part[(st.c * gridDim.y + blockIdx.y) * 2 + 1] = t.v[1];
}

// A warp per channel: sum_g and sum_gx from the partials
__global__ void bn_sum_parts(const float *part, int64_t splits, int64_t C, float *sum_g, float *sum_gx) {
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (c >= C) return;
  const kt::Fv<2> t = channel_sums(part, c, splits);
  if ((threadIdx.x & 31) == 0) sum_g[c] = t.v[0], sum_gx[c] = t.v[1];
}

// The backward apply, elementwise as bn_apply
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) bn_bwd_apply(const T *g, const T *x, const T *y, T *gx, T *gres, int64_t nvec,
                                                    int64_t vs, int64_t C, int64_t M, const float *mean,
                                                    const float *invstd, const T *w, const float *sum_g,
                                                    const float *sum_gx, bool relu, bool training) {
  constexpr int V = kt::Row<T, VEC>::V;
  const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t c = channel_of(v, nvec, vs, C);
  T gv[V], xv[V], yv[V], o[V], go[V];
  kt::load_v<T, VEC>(g, v * V, gv);
  if (training) kt::load_v<T, VEC>(x, v * V, xv);
  if (relu) kt::load_v<T, VEC>(y, v * V, yv);
  const float is = invstd[c], mu = mean[c], scale = (w ? kt::to_f(w[c]) : 1.f) * is;
  const float mg = training ? sum_g[c] / (float)M : 0.f, mgx = training ? sum_gx[c] / (float)M : 0.f;
#pragma unroll
  for (int q = 0; q < V; q++) {
    float gq = (relu && !(kt::to_f(yv[q]) > 0.f)) ? 0.f : kt::to_f(gv[q]);
    go[q] = kt::from_f<T>(gq);
    if (training) gq = gq - mg - (kt::to_f(xv[q]) - mu) * is * mgx;
    o[q] = kt::from_f<T>(scale * gq);
  }
  kt::store_v<T, VEC>(gx, v * V, o);
  if (gres) kt::store_v<T, VEC>(gres, v * V, go);   // the residual's gradient: g'
}

// ---- rows: S == 1, x a (R, C) matrix ----
// A channels-last (NHWC) image batch is (N * H * W, C) rows, and so is a (N, C) input.
// A channel's values are then C apart: the stripe kernels above would read one
// element per 32-byte sector. These read rows: a block covers 32 channels (one per
// lane, consecutive addresses) and a stripe of rows, kRowsY warps deep, four rows in
// flight a thread.
constexpr int kRowsY = 8;

// Sums a rows block's two per-thread sums over its kRowsY warps and writes channel c's
// partial pair for this stripe.
__device__ __forceinline__ void rows_block_partial(float a, float b, int64_t c, int64_t C, float *part) {
  __shared__ float sh[kRowsY][32][2];
  sh[threadIdx.y][threadIdx.x][0] = a, sh[threadIdx.y][threadIdx.x][1] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int y = 1; y < kRowsY; y++) a += sh[y][threadIdx.x][0], b += sh[y][threadIdx.x][1];
    part[(c * gridDim.y + blockIdx.y) * 2] = a, part[(c * gridDim.y + blockIdx.y) * 2 + 1] = b;
  }
}

// part[(c * splits + k) * 2]: sums of x - x[c] (row 0) over stripe k's rows
template <typename T>
__global__ void __launch_bounds__(256) bn_stats_rows(const T *x, int64_t R, int64_t C, float *part) {
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, splits = gridDim.y;
  const int64_t per = (R + splits - 1) / splits, r0 = blockIdx.y * per, r1 = r0 + per < R ? r0 + per : R;
  float s = 0.f, s2 = 0.f;
  if (c < C) {
    const float shift = kt::to_f(x[c]);
    auto add = [&](float v) {
      const float d = v - shift;
      s += d, s2 += d * d;
    };
    int64_t r = r0 + threadIdx.y;
    for (; r + 3 * kRowsY < r1; r += 4 * kRowsY) {   // four loads, then their sums
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; u++) v[u] = kt::to_f(x[(r + u * kRowsY) * C + c]);
#pragma unroll
      for (int u = 0; u < 4; u++) add(v[u]);
    }
    for (; r < r1; r += kRowsY) add(kt::to_f(x[r * C + c]));
  }
  rows_block_partial(s, s2, c, C, part);
}

// part[(c * splits + k) * 2]: sums of g' and g' * xhat over stripe k's rows
template <typename T>
__global__ void __launch_bounds__(256) bn_bwd_stats_rows(const T *g, const T *x, const T *y, int64_t R, int64_t C,
                                                         const float *mean, const float *invstd, bool relu,
                                                         float *part) {
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, splits = gridDim.y;
  const int64_t per = (R + splits - 1) / splits, r0 = blockIdx.y * per, r1 = r0 + per < R ? r0 + per : R;
  float sg = 0.f, sgx = 0.f;
  if (c < C) {
    const float mu = mean[c], is = invstd[c];
    struct GXY { float g, x, y; };
    auto load = [&](int64_t i) { return GXY{kt::to_f(g[i]), kt::to_f(x[i]), relu ? kt::to_f(y[i]) : 1.f}; };
    auto add = [&](GXY v) {   // g' = g where y > 0 (y = 1 without the ReLU)
      const float gi = v.y > 0.f ? v.g : 0.f;
      sg += gi, sgx += gi * (v.x - mu) * is;
    };
    int64_t r = r0 + threadIdx.y;
    for (; r + 3 * kRowsY < r1; r += 4 * kRowsY) {   // four loads, then their sums
      GXY v[4];
#pragma unroll
      for (int u = 0; u < 4; u++) v[u] = load((r + u * kRowsY) * C + c);
#pragma unroll
      for (int u = 0; u < 4; u++) add(v[u]);
    }
    for (; r < r1; r += kRowsY) add(load(r * C + c));
  }
  rows_block_partial(sg, sgx, c, C, part);
}

// The apply over rows with 16-byte vectors (C a multiple of the vector: a vector is
// V consecutive channels of one row)
template <typename T>
__global__ void __launch_bounds__(256) bn_apply_rows(const T *x, const T *res, T *y, int64_t nvec, int64_t C,
                                                     const float *mean, const float *invstd, const T *w, const T *b,
                                                     bool relu) {
  constexpr int V = 16 / sizeof(T);
  const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t c0 = channel_of(v * V, nvec * V, 1, C);
  T in[V], rv[V], o[V];
  kt::load_v<T, true>(x, v * V, in);
  if (res) kt::load_v<T, true>(res, v * V, rv);
#pragma unroll
  for (int q = 0; q < V; q++) {
    const int64_t c = c0 + q;   // bn_apply's arithmetic, so both layouts round alike
    const float sc = invstd[c] * (w ? kt::to_f(w[c]) : 1.f), sh = b ? kt::to_f(b[c]) : 0.f;
    const float r = (kt::to_f(in[q]) - mean[c]) * sc + sh + (res ? kt::to_f(rv[q]) : 0.f);
    o[q] = kt::from_f<T>(relu ? fmaxf(r, 0.f) : r);
  }
  kt::store_v<T, true>(y, v * V, o);
}

template <typename T>
__global__ void __launch_bounds__(256) bn_bwd_apply_rows(const T *g, const T *x, const T *y, T *gx, T *gres,
                                                         int64_t nvec, int64_t C, int64_t M, const float *mean,
                                                         const float *invstd, const T *w, const float *sum_g,
                                                         const float *sum_gx, bool relu, bool training) {
  constexpr int V = 16 / sizeof(T);
  const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= nvec) return;
  const int64_t c0 = channel_of(v * V, nvec * V, 1, C);
  T gv[V], xv[V], yv[V], o[V], go[V];
  kt::load_v<T, true>(g, v * V, gv);
  if (training) kt::load_v<T, true>(x, v * V, xv);
  if (relu) kt::load_v<T, true>(y, v * V, yv);
#pragma unroll
  for (int q = 0; q < V; q++) {
    const int64_t c = c0 + q;   // bn_bwd_apply's arithmetic
    const float is = invstd[c], scale = (w ? kt::to_f(w[c]) : 1.f) * is;
    float gq = (relu && !(kt::to_f(yv[q]) > 0.f)) ? 0.f : kt::to_f(gv[q]);
    go[q] = kt::from_f<T>(gq);
    if (training) gq = gq - sum_g[c] / (float)M - (kt::to_f(xv[q]) - mean[c]) * is * (sum_gx[c] / (float)M);
    o[q] = kt::from_f<T>(scale * gq);
  }
  kt::store_v<T, true>(gx, v * V, o);
  if (gres) kt::store_v<T, true>(gres, v * V, go);
}

// Row stripes: about 1024 blocks of 32 channels, each at least 64 rows
int64_t row_splits_for(int64_t R, int64_t C) {
  const int64_t chunks = (C + 31) / 32;
  int64_t s = (1024 + chunks - 1) / chunks, most = (R + 63) / 64;
  s = s < most ? s : most;
  return s < 1 ? 1 : s > 65535 ? 65535 : s;
}

int64_t splits_for(int64_t N, int64_t C, int64_t S) {   // about 1024 blocks, each >= 4096 elements
  int64_t s = (1024 + C - 1) / C, most = (N * S + 4095) / 4096;
  s = s < most ? s : most;
  s = s < N ? s : N;
  return s < 1 ? 1 : s > 65535 ? 65535 : s;
}
// Threads for a stripe kernel: enough for kUnroll vectors each, 64..256.
int stripe_threads(int64_t N, int64_t S, int64_t splits, int V) {
  const int64_t per_thread = (N + splits - 1) / splits * (S / V) / kUnroll;
  const int64_t t = (per_thread + 31) / 32 * 32;
  return (int)(t < 64 ? 64 : t > 256 ? 256 : t);
}
unsigned warp_grid(int64_t C) { return (unsigned)((C * 32 + 255) / 256); }   // a warp per channel, 256 threads
unsigned vec_grid(int64_t nvec) { return (unsigned)((nvec + 255) / 256); }   // a vector a thread, 256 threads

template <typename T>
kt_status fwd(const void *x, const void *res, void *y, const void *w, const void *b, int64_t N, int64_t C, int64_t S,
              int training, float momentum, float eps, float *mean, float *invstd, float *rm, float *rv, float *work,
              int relu, cudaStream_t s) {
  const bool vec = kt::row_vec_ok<T>(S, {x, y, res ? res : x});
  const int V = vec ? 16 / sizeof(T) : 1;
  const T *xt = (const T *)x, *wt = (const T *)w, *bt = (const T *)b, *rt = (const T *)res;
  if (training) {
    const int64_t sp = S == 1 ? row_splits_for(N, C) : splits_for(N, C, S);
    if (S == 1) {
      bn_stats_rows<T><<<dim3((unsigned)((C + 31) / 32), (unsigned)sp), dim3(32, kRowsY), 0, s>>>(xt, N, C, work);
    } else {
      auto stats = vec ? bn_stats<T, true> : bn_stats<T, false>;
      stats<<<dim3((unsigned)C, (unsigned)sp), stripe_threads(N, S, sp, V), 0, s>>>(xt, N, C, S, work);
    }
    bn_finish<T><<<warp_grid(C), 256, 0, s>>>(xt, work, sp, C, S, N * S, eps, momentum, mean, invstd, rm, rv);
  }
  if (S == 1 && kt::row_vec_ok<T>(C, {x, y, res ? res : x})) {   // rows of C: vectors of consecutive channels
    const int64_t nvec = N * C / (16 / sizeof(T));
    bn_apply_rows<T><<<vec_grid(nvec), 256, 0, s>>>(xt, rt, (T *)y, nvec, C, mean, invstd, wt, bt, relu);
    return kt::status_of(cudaGetLastError());
  }
  const int64_t nvec = N * C * S / V;
  auto apply = vec ? bn_apply<T, true> : bn_apply<T, false>;
  apply<<<vec_grid(nvec), 256, 0, s>>>(xt, rt, (T *)y, nvec, S / V, C, mean, invstd, wt, bt, relu);
  return kt::status_of(cudaGetLastError());
}

template <typename T>
kt_status bwd(const void *g, const void *x, const void *y, void *gx, void *gres, const void *w, int64_t N, int64_t C,
              int64_t S, int training, const float *mean, const float *invstd, float *sum_g, float *sum_gx, float *work,
              int relu, cudaStream_t s) {
  const int64_t sp = S == 1 ? row_splits_for(N, C) : splits_for(N, C, S);
  const bool vec = kt::row_vec_ok<T>(S, {g, x, y, gx, gres ? gres : gx});
  const int V = vec ? 16 / sizeof(T) : 1;
  const T *gt = (const T *)g, *xt = (const T *)x, *yt = (const T *)y, *wt = (const T *)w;
  if (S == 1) {
    bn_bwd_stats_rows<T><<<dim3((unsigned)((C + 31) / 32), (unsigned)sp), dim3(32, kRowsY), 0, s>>>(
        gt, xt, yt, N, C, mean, invstd, relu, work);
  } else {
    auto stats = vec ? bn_bwd_stats<T, true> : bn_bwd_stats<T, false>;
    stats<<<dim3((unsigned)C, (unsigned)sp), stripe_threads(N, S, sp, V), 0, s>>>(gt, xt, yt, N, C, S, mean, invstd,
                                                                                   relu, work);
  }
  bn_sum_parts<<<warp_grid(C), 256, 0, s>>>(work, sp, C, sum_g, sum_gx);
  if (S == 1 && kt::row_vec_ok<T>(C, {g, x, y, gx, gres ? gres : gx})) {
    const int64_t nvec = N * C / (16 / sizeof(T));
    bn_bwd_apply_rows<T><<<vec_grid(nvec), 256, 0, s>>>(gt, xt, yt, (T *)gx, (T *)gres, nvec, C, N * S, mean, invstd,
                                                         wt, sum_g, sum_gx, relu, training);
    return kt::status_of(cudaGetLastError());
  }
  const int64_t nvec = N * C * S / V;
  auto apply = vec ? bn_bwd_apply<T, true> : bn_bwd_apply<T, false>;
  apply<<<vec_grid(nvec), 256, 0, s>>>(gt, xt, yt, (T *)gx, (T *)gres, nvec, S / V, C, N * S, mean, invstd, wt, sum_g,
                                       sum_gx, relu, training);
  return kt::status_of(cudaGetLastError());
}

bool bad(int64_t N, int64_t C, int64_t S) { return N <= 0 || C <= 0 || S <= 0 || C > 0x7fffffff; }

}  // namespace

// ---- launchers ----
extern "C" int64_t kt_batch_norm_workspace(int64_t N, int64_t C, int64_t S) {
  return N > 0 && C > 0 && S > 0 ? 2 * C * (S == 1 ? row_splits_for(N, C) : splits_for(N, C, S)) : 0;
}

extern "C" kt_status kt_batch_norm(kt_dtype t, const void *x, const void *residual, void *y, const void *w,
                                   const void *b, int64_t N, int64_t C, int64_t S, int training, float momentum,
                                   float eps, float *mean, float *invstd, float *running_mean, float *running_var,
                                   float *workspace, int relu, void *stream) {
  if (bad(N, C, S) || !x || !y || !mean || !invstd || (training && !workspace) || !(eps >= 0)) return KT_ERR_INVALID;
  const cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, fwd<T>(x, residual, y, w, b, N, C, S, training, momentum, eps, mean, invstd, running_mean,
                        running_var, workspace, relu, s))
}

extern "C" kt_status kt_batch_norm_backward(kt_dtype t, const void *grad, const void *x, const void *y, void *grad_x,
                                            void *grad_residual, const void *w, int64_t N, int64_t C, int64_t S,
                                            int training, const float *mean, const float *invstd, float *sum_g,
                                            float *sum_gx, float *workspace, int relu, void *stream) {
  if (bad(N, C, S) || !grad || !x || !grad_x || !mean || !invstd || !sum_g || !sum_gx || !workspace || (relu && !y))
    return KT_ERR_INVALID;
  const cudaStream_t s = (cudaStream_t)stream;
  KT_DISPATCH(t, bwd<T>(grad, x, y, grad_x, grad_residual, w, N, C, S, training, mean, invstd, sum_g, sum_gx,
                        workspace, relu, s))
}
