// python/kitsune/csrc/ops/reduce.cpp — the reduce family (fusion/kernels/reduce.cu,
// kitsune/ops/reduce.py): sum_squared and mean_abs over any dims; the column sums of
// bias gradients (colsum, kt_colsum), fused with ReLU's or GELU's backward
// (relu_grad_colsum, gelu_grad_colsum), and over a convolution's channels
// (channel_sum; the op kitsune.channel_sum) — the ones other families use.
#include "../common.h"

namespace bridge {
namespace {

// ---- sum_squared, mean_abs (fusion/kernels/reduce.cu) ----
// The reduced dims are moved last, so the kernel reduces rows of a [kept, reduced] view.
struct ReduceView { Tensor x; int64_t rows, n; c10::DimVector out_shape; };
ReduceView reduce_view(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, const char* op) {
  const int64_t nd = x.dim();
  std::vector<bool> red(std::max<int64_t>(nd, 1), !dim || dim->empty());
  if (dim)
    for (int64_t d : *dim) {
      TORCH_CHECK(d >= -std::max<int64_t>(nd, 1) && d < std::max<int64_t>(nd, 1), "kitsune.", op, ": dim ", d,
                  " is out of range for a tensor of ", nd, " dimensions");
      red[d < 0 ? d + std::max<int64_t>(nd, 1) : d] = true;
    }
  std::vector<int64_t> perm;
  c10::DimVector out;
  int64_t rows = 1, n = 1;
  for (int64_t d = 0; d < nd; d++)
    if (!red[d]) { perm.push_back(d); out.push_back(x.size(d)); rows *= x.size(d); }
    else if (keepdim) out.push_back(1);
  for (int64_t d = 0; d < nd; d++)
    if (red[d]) { perm.push_back(d); n *= x.size(d); }
  return {nd ? x.permute(perm).contiguous() : x.contiguous(), rows, n, out};
}
Tensor reduce_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, int op, const char* name) {
  check_float(x, name, "x", true);
  auto v = reduce_view(x, dim, keepdim, name);
  kt_dtype dt = dtype_of(x, name);
  c10::cuda::CUDAGuard g(x.device());
  if (v.n == 0)   // sum over nothing is 0; mean over nothing is NaN, as in PyTorch
    return at::full(v.out_shape, op == KT_REDUCE_SUM_SQUARED ? 0.0 : NAN, x.options());
  Tensor out = at::empty({v.rows}, x.options());
  int64_t wsn = kt_reduce_workspace(v.rows, v.n);
  Tensor ws = wsn ? at::empty({wsn}, x.options().dtype(at::kFloat)) : Tensor();
  if (v.rows)
    check_launch(kt_reduce(dt, op, v.x.data_ptr(), out.data_ptr(), wsn ? ws.data_ptr<float>() : nullptr, v.rows, v.n,
                           stream_of(out)),
                 name);
  return out.view(v.out_shape);
}
Tensor reduce_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, int op, const char* name) {
  check_float(x, name, "x");
  auto v = reduce_view(x, dim, keepdim, name);
  Tensor xf = v.x.to(opmath(x)).reshape({v.rows, v.n});
  Tensor r = op == KT_REDUCE_SUM_SQUARED ? xf.pow(2).sum(1) : xf.abs().mean(1);
  return r.view(v.out_shape).to(x.scalar_type());
}
Tensor sum_squared_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cuda(x, dim, keepdim, KT_REDUCE_SUM_SQUARED, "sum_squared");
}
Tensor sum_squared_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cpu(x, dim, keepdim, KT_REDUCE_SUM_SQUARED, "sum_squared");
}
Tensor mean_abs_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cuda(x, dim, keepdim, KT_REDUCE_MEAN_ABS, "mean_abs");
}
Tensor mean_abs_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cpu(x, dim, keepdim, KT_REDUCE_MEAN_ABS, "mean_abs");
}

// sum_squared (which 0) and mean_abs (which 1): d/dx sum x^2 = 2x; d/dx mean |x| = sign(x) / n.
struct ReduceFn : torch::autograd::Function<ReduceFn> {
  using Sig = Tensor(const Tensor&, at::OptionalIntArrayRef, bool);
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::optional<std::vector<int64_t>> dim, bool keepdim,
                        int64_t which) {
    static auto ops = std::array{op_handle<Sig>("kitsune::sum_squared"), op_handle<Sig>("kitsune::mean_abs")};
    ctx->saved_data["which"] = which;
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView g;
    Tensor out = ops[which].call(x, dim ? at::OptionalIntArrayRef(*dim) : at::OptionalIntArrayRef(), keepdim);
    // the gradient's shape before broadcasting: the output with the reduced dims kept
    ctx->saved_data["kept"] = keepdim || x.dim() == 0 ? out.sizes().vec() : kept_shape(x, dim);
    return out;
  }
  static std::vector<int64_t> kept_shape(const Tensor& x, const std::optional<std::vector<int64_t>>& dim) {
    std::vector<int64_t> s = x.sizes().vec();
    if (!dim || dim->empty()) std::fill(s.begin(), s.end(), 1);
    else
      for (int64_t d : *dim) s[d < 0 ? d + x.dim() : d] = 1;
    return s;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const Tensor x = ctx->get_saved_variables()[0];
    auto kept = ctx->saved_data["kept"].toIntVector();
    Tensor g = go[0].reshape(kept);
    Tensor gx;
    if (ctx->saved_data["which"].toInt() == 0) {
      gx = 2 * x * g;
    } else {
      const int64_t n = g.numel() ? x.numel() / g.numel() : 1;
      gx = at::sign(x) * g / (double)std::max<int64_t>(n, 1);
    }
    return {gx, Tensor(), Tensor(), Tensor()};
  }
};

std::optional<std::vector<int64_t>> dims_vec(at::OptionalIntArrayRef dim) {
  return dim ? std::optional<std::vector<int64_t>>(dim->vec()) : std::nullopt;
}
Tensor sum_squared_autograd(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return ReduceFn::apply(x, dims_vec(dim), keepdim, 0);
}
Tensor mean_abs_autograd(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return ReduceFn::apply(x, dims_vec(dim), keepdim, 1);
}

}  // namespace

// ---- column sums: bias gradients ----
// Column sums of a 2-D (rows, cols) tensor with unit column stride (a bias
// gradient), accumulated in fp32 and stored as out_t. fp32, fp16 and bf16 on CUDA:
// kt_colsum (fusion/kernels/reduce.cu, deterministic; ATen's reduce_kernel took 12.2 us
// a call for GPT's bias gradients, bench/results/h100_profile_graph_gpt_e7b0309.log);
// anything else (fp64, the CPU, a fake tensor), ATen's sum.
Tensor colsum(const Tensor& x2, at::ScalarType out_t) {
  const at::ScalarType st = x2.scalar_type(), acc = st == at::kDouble ? at::kDouble : at::kFloat;
  const bool kt_type = st == at::kFloat || st == at::kHalf || st == at::kBFloat16;
  if (x2.is_cuda() && !x2.key_set().has(c10::DispatchKey::Python) && kt_type && x2.dim() == 2 &&
      (out_t == st || out_t == at::kFloat || (st == at::kFloat && (out_t == at::kHalf || out_t == at::kBFloat16))) &&
      x2.size(1) > 0 && (x2.stride(1) == 1 || x2.size(1) == 1) &&
      (x2.size(0) <= 1 || x2.stride(0) >= x2.size(1))) {
    const int64_t rows = x2.size(0), cols = x2.size(1), ld = rows > 1 ? x2.stride(0) : cols;
    const kt_dtype dt = dtype_of(x2, "colsum");
    c10::cuda::CUDAGuard g(x2.device());
    Tensor out = at::empty({cols}, x2.options().dtype(out_t));
    const int64_t wsn = kt_colsum_workspace(dt, rows, cols);
    Tensor ws = wsn ? at::empty({wsn}, x2.options().dtype(at::kFloat)) : Tensor();
    check_launch(kt_colsum_to(dt, dtype_of(out, "colsum"), x2.data_ptr(), out.data_ptr(),
                              wsn ? ws.data_ptr<float>() : nullptr, rows, cols, ld, stream_of(out)),
                 "colsum");
    return out;
  }
  return x2.sum(0, false, acc).to(out_t);
}

namespace {

// An activation's backward on contiguous (rows, cols) g and aux, and the column sums
// of the result in out_t, in one kernel: {gx, sums}. launch(gx, sums, workspace,
// rows, cols) makes the kernel's call.
template <typename Launch>
std::tuple<Tensor, Tensor> act_grad_colsum(const Tensor& g, at::ScalarType out_t, const char* op, Launch launch) {
  const int64_t rows = g.size(0), cols = g.size(1);
  const kt_dtype dt = dtype_of(g, op);
  c10::cuda::CUDAGuard guard(g.device());
  Tensor gx = at::empty_like(g), out = at::empty({cols}, g.options().dtype(out_t));
  const int64_t wsn = kt_colsum_workspace(dt, rows, cols);
  Tensor ws = wsn ? at::empty({wsn}, g.options().dtype(at::kFloat)) : Tensor();
  check_launch(launch(dt, out_t == at::kFloat && g.scalar_type() != at::kFloat, gx, out,
                      wsn ? ws.data_ptr<float>() : nullptr, rows, cols),
               op);
  return {gx, out};
}

}  // namespace

// ReLU's backward (y: ReLU's output) and its column sums (kt_relu_grad_colsum).
std::tuple<Tensor, Tensor> relu_grad_colsum(const Tensor& g, const Tensor& y, at::ScalarType out_t) {
  return act_grad_colsum(g, out_t, "relu_grad_colsum",
                         [&](kt_dtype dt, int f32, Tensor& gx, Tensor& out, float* ws, int64_t rows, int64_t cols) {
                           return kt_relu_grad_colsum(dt, f32, g.data_ptr(), y.data_ptr(), gx.data_ptr(),
                                                      out.data_ptr(), ws, rows, cols, stream_of(gx));
                         });
}

// GELU's backward at x + bias (bias undefined: x holds it already) and its column
// sums (kt_bias_gelu_grad_colsum): where an elementwise kernel wrote gx and kt_colsum
// read it back, one pass.
std::tuple<Tensor, Tensor> gelu_grad_colsum(const Tensor& g, const Tensor& x, const Tensor& bias, int approximate,
                                            at::ScalarType out_t) {
  return act_grad_colsum(g, out_t, "bias_gelu_backward",
                         [&](kt_dtype dt, int f32, Tensor& gx, Tensor& out, float* ws, int64_t rows, int64_t cols) {
                           return kt_bias_gelu_grad_colsum(dt, f32, g.data_ptr(), x.data_ptr(),
                                                           bias.defined() ? bias.data_ptr() : nullptr, gx.data_ptr(),
                                                           out.data_ptr(), ws, rows, cols, approximate, stream_of(gx));
                         });
}

// ---- channel_sum: a convolution's bias gradient (channel_bias's, bias_relu_pool's, bias_cat's) ----
// ATen's convolution_backward sums the bias gradient over (N, H, W) in one reduction
// that left the H100 mostly idle at LeNet's and the Inception net's shapes:
// reduce_kernel, 44.6 us a step for LeNet's two convolutions, 31-59 us a call in the
// Inception net (bench/results/h100_profile_graph_101578e.log). Here the sum takes two
// stages with parallelism in both: each (n, c) plane's sum (N C outputs), then a sum
// over n, on the gradient's own strides (a slice of torch.cat's gradient is not copied:
// fb40403 made NCHW copies of those, bench/results/h100_channel_bias_fb40403.log); a
// 2-D (rows, C) gradient, column sums over S slabs of rows, then over the slabs.
// Sums accumulate in fp32 (fp64 for fp64) in a fixed order (deterministic), and the
// gradient is rounded once to the bias's dtype.
namespace {

// g (N, C, H, W) with channels last in memory: its (N H W, C) rows as a 2-D view
// whose rows are stride(3) elements apart (wider than C for a channel slice of a
// channels-last tensor); undefined for any other layout.
Tensor channel_rows(const Tensor& g) {
  const int64_t N = g.size(0), C = g.size(1), H = g.size(2), W = g.size(3);
  // a dim of size 1 may have any stride: the row step comes from the innermost one that is not
  const int64_t ld = W > 1 ? g.stride(3) : H > 1 ? g.stride(2) : N > 1 ? g.stride(0) : C;
  const bool rows = (C == 1 || g.stride(1) == 1) && ld >= C && (H == 1 || g.stride(2) == W * ld) &&
                    (N == 1 || g.stride(0) == H * W * ld);
  return rows ? g.as_strided({N * H * W, C}, {ld, 1}) : Tensor();
}

}  // namespace

// t as its dense (rows, C) matrix: a 2-D contiguous t, or channel_rows of a 4-D one
// whose rows are C apart (dense in channels-last); undefined otherwise (including fake
// tensors, whose sizes may be symbolic, and empty ones).
Tensor dense_channel_rows(const Tensor& t) {
  if (!t.is_cuda() || t.key_set().has(c10::DispatchKey::Python) || t.numel() == 0) return Tensor();
  const Tensor r = t.dim() == 2 ? t : t.dim() == 4 ? channel_rows(t) : Tensor();
  return r.defined() && r.is_contiguous() ? r : Tensor();
}

Tensor channel_sum(const Tensor& g, at::ScalarType out_t) {
  const int64_t C = g.size(1), N = g.size(0);
  const at::ScalarType acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (g.numel() == 0) return at::zeros({C}, g.options().dtype(out_t));
  // channels last in memory, on real CUDA memory (a fake tensor's sizes may be
  // symbolic): one kt_colsum over the (N H W, C) rows, also where they are a channel
  // slice of wider rows (torch.cat's gradient in NHWC)
  if (g.is_cuda() && !g.key_set().has(c10::DispatchKey::Python)) {
    Tensor rows = g.dim() == 2 ? g : g.dim() == 4 ? channel_rows(g) : Tensor();
    if (rows.defined() && (rows.stride(1) == 1 || C == 1)) return colsum(rows, out_t);
  }
  if (g.dim() > 2) {   // each (n, c)'s sum over the spatial dims (N C outputs), then over n: no copy, any strides
    c10::DimVector spatial;
    for (int64_t d = 2; d < g.dim(); d++) spatial.push_back(d);
    return g.sum(spatial, false, acc).sum(0).to(out_t);
  }
  if (!g.is_contiguous()) return g.sum(0, false, acc).to(out_t);
  int64_t S = 1;   // (N, C): column sums over S slabs of rows, then over the slabs
  for (int64_t s = 256; s > 1; s /= 2)
    if (N % s == 0 && N / s >= s) { S = s; break; }
  return g.view({S, N / S, C}).sum(1, false, acc).sum(0).to(out_t);
}

namespace {

// kitsune.channel_sum (tests and benches): the bias gradient's sum over every dim but 1,
// in fp32 (fp64 for fp64 input).
Tensor channel_sum_op(const Tensor& g) {
  check_float(g, "channel_sum", "g");
  TORCH_CHECK(g.dim() >= 2, "kitsune.channel_sum: need (N, C, ...), got ", g.sizes());
  return channel_sum(g, g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

}  // namespace

#define REDUCE_DEVICE_OPS(X) \
  X(sum_squared)             \
  X(mean_abs)
KT_DEVICE_IMPLS(REDUCE_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("channel_sum", &channel_sum_op); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("sum_squared", &sum_squared_autograd);
  m.impl("mean_abs", &mean_abs_autograd);
}

}  // namespace bridge
