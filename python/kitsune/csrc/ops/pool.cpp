// python/kitsune/csrc/ops/pool.cpp — the pool family (fusion/kernels/pool.cu,
// kitsune/ops/pool.py): max_pool2d; max_pool2d_where and max_pool2d_backward_add
// (kitsune.fx's max-pool branch point); bias_relu_pool, a convolution's bias, ReLU
// and max pooling in one kernel.
#include <ATen/native/Pool.h>

#include "../common.h"

namespace bridge {
namespace {

// ---- bias_relu_pool: max_pool2d(relu(y + bias over dim 1), kernel_size) ----
// A convolution's bias, its ReLU and a max pooling over non-overlapping windows
// (stride = kernel, no padding, floor mode), taken together by kitsune.optimize
// (LeNet-style blocks). On CUDA with y NCHW-contiguous in fp32/fp16/bf16: one kernel
// forward, and backward one kernel (the input gradient and its per-plane sums) plus a
// column sum over n (fusion/kernels/pool.cu). Otherwise (the CPU, other layouts, fake
// tensors) channel_bias and ATen's pooling, whose results these equal. The kernel
// path saves y and the bias only: its backward finds each window's winner again
// (torch's unfused ops keep the relu output and int64 indices).
struct PoolGeom {
  int64_t kh, kw;
};
PoolGeom check_bias_relu_pool(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  check_floats("bias_relu_pool", {{"y", y}, {"bias", b}});
  TORCH_CHECK(y.dim() == 4 && b.dim() == 1 && b.size(0) == y.size(1),
              "kitsune.bias_relu_pool: need y (N, C, H, W) and bias (C,); got ", y.sizes(), " and ", b.sizes());
  TORCH_CHECK(k.size() == 1 || k.size() == 2, "kitsune.bias_relu_pool: kernel_size must be one or two ints, got ", k);
  const int64_t kh = k[0], kw = k.size() == 2 ? k[1] : k[0];
  TORCH_CHECK(kh >= 1 && kw >= 1 && kh <= 64 && kw <= 64, "kitsune.bias_relu_pool: kernel_size must be in 1..64, got ",
              k);
  TORCH_CHECK(y.size(2) >= kh && y.size(3) >= kw, "kitsune.bias_relu_pool: the input's ", y.size(2), " x ", y.size(3),
              " is smaller than the ", kh, " x ", kw, " window");
  return {kh, kw};
}

bool pool_kernel_ok(const Tensor& y) { return lt_dtype_ok(y) && y.is_contiguous() && y.numel() > 0; }

// out; z and idx (the relu output and the pooling's indices, for the backward) on the
// unfused path only: channel_bias's kernel where channels are last in memory, then
// ATen's pooling, as these ops ran before they were fused.
struct PoolOut {
  Tensor out, z, idx;
};
PoolOut bias_relu_pool_impl(const Tensor& y, const Tensor& b, PoolGeom p) {
  if (!pool_kernel_ok(y)) {
    Tensor z = channel_bias_fwd(y, b, "relu");
    auto [out, idx] = at::max_pool2d_with_indices(z, {p.kh, p.kw}, {p.kh, p.kw});
    return {out, z, idx};
  }
  c10::cuda::CUDAGuard g(y.device());
  Tensor out = at::empty({y.size(0), y.size(1), y.size(2) / p.kh, y.size(3) / p.kw}, y.options()), bc = b.contiguous();
  check_launch(kt_bias_relu_pool(dtype_of(y, "bias_relu_pool"), y.data_ptr(), bc.data_ptr(), out.data_ptr(), y.size(0),
                                 y.size(1), y.size(2), y.size(3), (int)p.kh, (int)p.kw, stream_of(out)),
               "bias_relu_pool");
  return {out, Tensor(), Tensor()};
}
Tensor bias_relu_pool_fwd(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  return bias_relu_pool_impl(y, b, check_bias_relu_pool(y, b, k)).out;
}

struct BiasReluPoolFn : torch::autograd::Function<BiasReluPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& y, const Tensor& b, std::vector<int64_t> k) {
    const PoolGeom p = check_bias_relu_pool(y, b, k);
    PoolOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = bias_relu_pool_impl(y, b, p);
    }
    ctx->saved_data["k"] = std::vector<int64_t>{p.kh, p.kw};
    ctx->save_for_backward({r.z.defined() ? Tensor() : y, b, r.z, r.idx});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    const Tensor &y = s[0], &b = s[1], &z = s[2];
    auto k = ctx->saved_data["k"].toIntVector();
    Tensor gy, gb;
    if (z.defined()) {   // the unfused path's
      gy = at::threshold_backward(
          at::max_pool2d_with_indices_backward(go[0], z, k, k, {0, 0}, {1, 1}, false, s[3]), z, 0);
      gb = channel_sum(gy, b.scalar_type());
    } else {
      c10::cuda::CUDAGuard guard(y.device());
      const int64_t N = y.size(0), C = y.size(1);
      Tensor gc = go[0].contiguous(), bc = b.contiguous();
      gy = at::empty_like(y);
      Tensor sums = at::empty({N, C}, y.options().dtype(at::kFloat));
      check_launch(kt_bias_relu_pool_backward(dtype_of(y, "bias_relu_pool"), gc.data_ptr(), y.data_ptr(),
                                              bc.data_ptr(), gy.data_ptr(), sums.data_ptr<float>(), N, C, y.size(2),
                                              y.size(3), (int)k[0], (int)k[1], stream_of(gy)),
                   "bias_relu_pool backward");
      gb = colsum(sums, b.scalar_type());
    }
    return {gy, gb, Tensor()};
  }
};
Tensor bias_relu_pool_autograd(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  return BiasReluPoolFn::apply(y, b, k.vec());
}

// ---- max_pool2d: F.max_pool2d(x, kernel_size, stride, padding, ceil_mode=...), dilation 1 ----
// On CUDA with a 4-D x NCHW- or channels-last-contiguous in fp32/fp16/bf16 and windows of
// at most 256 elements: Kitsune's kernels (fusion/kernels/pool.cu), which save a byte per
// output (the winner's place in its window) for a gather backward. Otherwise (the CPU,
// 3-D input, other layouts, fake tensors) ATen's max_pool2d_with_indices and its
// backward. Both give ATen's output, layout and gradient.
struct MaxPoolArgs {
  int64_t kh, kw, sh, sw, ph, pw;
  bool ceil;
};

// ATen's own output size (floor or ceil mode; dilation 1), without its checks: ours
// name the op and the bad value.
int64_t pooled_size(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil) {
  return at::native::pooling_output_shape_pad_lr<int64_t>(in, k, p, p, s, 1, ceil);
}

// (op: the op whose arguments these are, for the errors)
MaxPoolArgs check_max_pool2d(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil,
                             const char* op = "max_pool2d") {
  TORCH_CHECK(x.dim() == 3 || x.dim() == 4, "kitsune.", op, ": need x (N, C, H, W) or (C, H, W), got ", x.sizes());
  check_float(x, op, "x");
  TORCH_CHECK(x.size(-1) > 0 && x.size(-2) > 0 && x.size(-3) > 0,
              "kitsune.", op, ": x's C, H and W must be non-zero, got ", x.sizes());
  TORCH_CHECK(k.size() == 1 || k.size() == 2, "kitsune.", op, ": kernel_size must be one or two ints, got ", k);
  TORCH_CHECK(s.size() <= 2, "kitsune.", op, ": stride must be empty (= kernel_size), one or two ints, got ", s);
  TORCH_CHECK(p.size() == 1 || p.size() == 2, "kitsune.", op, ": padding must be one or two ints, got ", p);
  MaxPoolArgs a{k[0], k.back(), s.empty() ? k[0] : s[0], s.empty() ? k.back() : s.back(), p[0], p.back(), ceil};
  TORCH_CHECK(a.kh >= 1 && a.kw >= 1, "kitsune.", op, ": kernel_size must be positive, got ", k);
  TORCH_CHECK(a.sh >= 1 && a.sw >= 1, "kitsune.", op, ": stride must be positive, got ", s);
  TORCH_CHECK(a.ph >= 0 && a.pw >= 0 && 2 * a.ph <= a.kh && 2 * a.pw <= a.kw,
              "kitsune.", op, ": padding must be in 0..kernel_size / 2, got padding ", p, " for kernel_size ", k);
  const int64_t oh = pooled_size(x.size(-2), a.kh, a.sh, a.ph, ceil),
                ow = pooled_size(x.size(-1), a.kw, a.sw, a.pw, ceil);
  TORCH_CHECK(oh >= 1 && ow >= 1, "kitsune.", op, ": the input's ", x.size(-2), " x ", x.size(-1), " (padding ", p,
              ") is smaller than the ", a.kh, " x ", a.kw, " window");
  return a;
}

// The kernels' memory format for x, or nullopt for ATen's path.
std::optional<at::MemoryFormat> max_pool_format(const Tensor& x, const MaxPoolArgs& a) {
  if (!lt_dtype_ok(x) || x.dim() != 4 || a.kh * a.kw > 256 || a.sh > INT32_MAX || a.sw > INT32_MAX) return std::nullopt;
  const auto f = x.suggest_memory_format();
  if (f == at::MemoryFormat::ChannelsLast ? x.is_contiguous(f) : x.is_contiguous()) return f;
  return std::nullopt;
}

kt_pool2d pool_geometry(const Tensor& x, const MaxPoolArgs& a, at::MemoryFormat f) {
  return kt_pool2d{x.size(0),
                   x.size(1),
                   x.size(2),
                   x.size(3),
                   pooled_size(x.size(2), a.kh, a.sh, a.ph, a.ceil),
                   pooled_size(x.size(3), a.kw, a.sw, a.pw, a.ceil),
                   (int)a.kh,
                   (int)a.kw,
                   (int)a.sh,
                   (int)a.sw,
                   (int)a.ph,
                   (int)a.pw,
                   f == at::MemoryFormat::ChannelsLast};
}

// out, and what the backward needs: where (the kernels' bytes) or idx (ATen's indices).
struct MaxPoolOut {
  Tensor out, where, idx;
  bool channels_last;
};
MaxPoolOut max_pool2d_impl(const Tensor& x, const MaxPoolArgs& a) {
  const auto f = max_pool_format(x, a);
  if (!f) {
    auto [out, idx] = at::max_pool2d_with_indices(x, {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil);
    return {out, Tensor(), idx, false};
  }
  c10::cuda::CUDAGuard g(x.device());
  const kt_pool2d geo = pool_geometry(x, a, *f);
  auto opts = x.options().memory_format(*f);
  Tensor out = at::empty({geo.n, geo.c, geo.oh, geo.ow}, opts),
         where = at::empty({geo.n, geo.c, geo.oh, geo.ow}, opts.dtype(at::kByte));
  check_launch(kt_max_pool2d(dtype_of(x, "max_pool2d"), x.data_ptr(), out.data_ptr(), where.data_ptr<uint8_t>(),
                             &geo, stream_of(out)),
               "max_pool2d");
  return {out, where, Tensor(), geo.channels_last != 0};
}
Tensor max_pool2d_fwd(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil) {
  return max_pool2d_impl(x, check_max_pool2d(x, k, s, p, ceil)).out;
}

struct MaxPoolFn : torch::autograd::Function<MaxPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::vector<int64_t> k, std::vector<int64_t> s,
                        std::vector<int64_t> p, bool ceil) {
    const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil);
    MaxPoolOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = max_pool2d_impl(x, a);
    }
    // The kernels' backward needs x's shape and layout, not x.
    ctx->saved_data["geo"] = std::vector<int64_t>{a.kh, a.kw, a.sh, a.sw, a.ph, a.pw, a.ceil};
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["cl"] = r.channels_last;
    ctx->save_for_backward({r.where.defined() ? Tensor() : x, r.where, r.idx});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto sv = ctx->get_saved_variables();
    auto v = ctx->saved_data["geo"].toIntVector();
    const MaxPoolArgs a{v[0], v[1], v[2], v[3], v[4], v[5], v[6] != 0};
    if (sv[2].defined())   // ATen's path
      return {at::max_pool2d_with_indices_backward(go[0], sv[0], {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1},
                                                   a.ceil, sv[2]),
              Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor& where = sv[1];
    const auto f = ctx->saved_data["cl"].toBool() ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    c10::cuda::CUDAGuard guard(where.device());
    Tensor g = go[0].contiguous(f),
           gx = at::empty(ctx->saved_data["shape"].toIntVector(), go[0].options().memory_format(f));
    const kt_pool2d geo = pool_geometry(gx, a, f);
    check_launch(kt_max_pool2d_backward(dtype_of(g, "max_pool2d"), g.data_ptr(), where.data_ptr<uint8_t>(),
                                        gx.data_ptr(), &geo, stream_of(gx)),
                 "max_pool2d backward");
    return {gx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
Tensor max_pool2d_autograd(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil) {
  return MaxPoolFn::apply(x, k.vec(), s.vec(), p.vec(), ceil);
}

// ---- max_pool2d_where / max_pool2d_backward_add: a pooled tensor's gradients in one pass ----
// The pieces of kitsune.fx's max-pool branch point (an Inception block's input feeds its
// pooling and the other branches' convolutions): the forward's output with the kernels'
// winner bytes, and a backward that adds the other branches' gradients of x while it
// gathers the pooling's, where autograd would add them one launch each (3 adds of the
// block input's gradient a block in the Inception net). CUDA: the kernels where they
// take x (max_pool_format: dtype, layout, window); elsewhere, and on the CPU, a reference
// through ATen's indices, on x's device: the same bytes and sums.
// The corners (rows, columns; in the padding where negative) of the (oh, ow) windows,
// as (oh, 1) and (1, ow) int64 tensors on device d.
std::pair<Tensor, Tensor> window_corners(const MaxPoolArgs& a, int64_t oh, int64_t ow, at::Device d) {
  auto o = at::TensorOptions().dtype(at::kLong).device(d);
  return {at::arange(oh, o).view({oh, 1}) * a.sh - a.ph, at::arange(ow, o).view({1, ow}) * a.sw - a.pw};
}
std::tuple<Tensor, Tensor> max_pool2d_where_cpu(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s,
                                                c10::IntArrayRef p, bool ceil) {
  const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil, "max_pool2d_where");
  TORCH_CHECK(x.dim() == 4, "kitsune.max_pool2d_where: need x (N, C, H, W), got ", x.sizes());
  TORCH_CHECK(a.kh * a.kw <= 256, "kitsune.max_pool2d_where: a window of at most 256 elements, got ", a.kh, " x ",
              a.kw);
  auto [out, idx] = at::max_pool2d_with_indices(x, {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil);
  auto [h0, w0] = window_corners(a, out.size(2), out.size(3), x.device());
  const int64_t w = x.size(3);
  Tensor ih = at::floor_divide(idx, w), iw = idx - ih * w;
  Tensor where = ((ih - h0) * a.kw + (iw - w0)).to(at::kByte).contiguous(out.suggest_memory_format());
  return {out, where};
}
std::tuple<Tensor, Tensor> max_pool2d_where_cuda(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s,
                                                 c10::IntArrayRef p, bool ceil) {
  const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil, "max_pool2d_where");
  if (!max_pool_format(x, a)) return max_pool2d_where_cpu(x, k, s, p, ceil);   // ATen's, on the device
  MaxPoolOut r = max_pool2d_impl(x, a);
  return {r.out, r.where};
}

// grad (or none) and adds: tensors of the input's shape; the result in where's layout.
// Returns the pooling's arguments, checked against the input's size.
MaxPoolArgs check_backward_add(const OptTensor& grad, const Tensor& where, const std::vector<Tensor>& adds,
                               c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                               bool ceil) {
  TORCH_CHECK(size.size() == 4, "kitsune.max_pool2d_backward_add: input_size must be (N, C, H, W), got ", size);
  TORCH_CHECK(where.scalar_type() == at::kByte && where.dim() == 4 && where.size(0) == size[0] &&
                  where.size(1) == size[1],
              "kitsune.max_pool2d_backward_add: where must be max_pool2d_where's uint8 (N, C, oh, ow) for input ",
              size, ", got ", where.scalar_type(), " ", where.sizes());
  TORCH_CHECK(grad.has_value() || !adds.empty(), "kitsune.max_pool2d_backward_add: no gradient to sum");
  if (grad) {
    TORCH_CHECK(grad->sizes() == where.sizes() && grad->device() == where.device(),
                "kitsune.max_pool2d_backward_add: grad of shape ", grad->sizes(), " on ", grad->device(),
                " does not match the pooled output's ", where.sizes(), " on ", where.device());
  }
  const Tensor& ref = grad ? *grad : adds[0];
  check_float(ref, "max_pool2d_backward_add", grad ? "grad" : "adds[0]");
  for (const Tensor& t : adds)
    TORCH_CHECK(t.sizes() == size && t.scalar_type() == ref.scalar_type() && t.device() == where.device(),
                "kitsune.max_pool2d_backward_add: every addend must be ", ref.scalar_type(), " of the input's shape ",
                size, " on ", where.device(), "; got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  const MaxPoolArgs a = check_max_pool2d(at::empty(size, ref.options().device(at::kMeta)), k, s, p, ceil,
                                         "max_pool2d_backward_add");
  const int64_t oh = pooled_size(size[2], a.kh, a.sh, a.ph, ceil), ow = pooled_size(size[3], a.kw, a.sw, a.pw, ceil);
  TORCH_CHECK(where.size(2) == oh && where.size(3) == ow, "kitsune.max_pool2d_backward_add: where's ", where.sizes(),
              " is not the pooled size (", oh, ", ", ow, ") of input_size ", size);
  return a;
}
// The result's layout, where's: channels-last where it is that and not NCHW-contiguous
// too (the fake kernel's rule, kitsune/ops/pool.py).
at::MemoryFormat where_format(const Tensor& where) {
  return where.is_contiguous(at::MemoryFormat::ChannelsLast) && !where.is_contiguous() ? at::MemoryFormat::ChannelsLast
                                                                                       : at::MemoryFormat::Contiguous;
}
Tensor max_pool2d_backward_add_cpu(const OptTensor& grad, const Tensor& where, at::TensorList adds_in,
                                   c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                                   bool ceil) {
  std::vector<Tensor> adds(adds_in.begin(), adds_in.end());
  const MaxPoolArgs a = check_backward_add(grad, where, adds, size, k, s, p, ceil);
  const Tensor& ref = grad ? *grad : adds[0];
  const auto f = where_format(where);
  Tensor acc;
  if (grad) {
    auto [h0, w0] = window_corners(a, where.size(2), where.size(3), where.device());
    Tensor b = where.to(at::kLong), dh = at::floor_divide(b, a.kw), dw = b - dh * a.kw;
    Tensor idx = ((h0 + dh) * size[3] + (w0 + dw)).contiguous(f);
    acc = at::max_pool2d_with_indices_backward(grad->to(opmath(ref)), at::empty(size, ref.options().dtype(opmath(ref))
                                                                                   .memory_format(f)),
                                               {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil, idx);
  }
  for (const Tensor& t : adds) acc = acc.defined() ? acc + t.to(opmath(ref)) : t.to(opmath(ref));
  return acc.to(ref.scalar_type()).contiguous(f);
}
Tensor max_pool2d_backward_add_cuda(const OptTensor& grad, const Tensor& where, at::TensorList adds_in,
                                    c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                                    bool ceil) {
  std::vector<Tensor> adds(adds_in.begin(), adds_in.end());
  const MaxPoolArgs a = check_backward_add(grad, where, adds, size, k, s, p, ceil);
  const Tensor& ref = grad ? *grad : adds[0];
  if (!lt_dtype_ok(ref))   // the dtypes the kernels do not take: ATen's, on the device
    return max_pool2d_backward_add_cpu(grad, where, adds_in, size, k, s, p, ceil);
  const auto f = where_format(where);
  TORCH_CHECK(where.is_contiguous(f), "kitsune.max_pool2d_backward_add: where must be dense (NCHW or channels-last)");
  c10::cuda::CUDAGuard guard(where.device());
  Tensor gx = at::empty(size, ref.options().memory_format(f));
  const kt_pool2d geo = pool_geometry(gx, a, f);
  TORCH_CHECK(geo.oh == where.size(2) && geo.ow == where.size(3), "kitsune.max_pool2d_backward_add: where's ",
              where.sizes(), " is not the pooled size of ", size);
  Tensor g = grad ? grad->contiguous(f) : Tensor();
  // beyond the kernel's addend slots, the rest summed first (one more launch each)
  for (auto& t : adds) t = t.contiguous(f);
  while (adds.size() > KT_POOL_ADDENDS) {
    Tensor last = adds.back();
    adds.pop_back();
    adds.back() = adds.back() + last;
  }
  kt_addends ad{};
  ad.n = (int)adds.size();
  for (int i = 0; i < ad.n; i++) ad.p[i] = adds[i].data_ptr();
  check_launch(kt_max_pool2d_backward_add(dtype_of(gx, "max_pool2d_backward_add"), g.defined() ? g.data_ptr() : nullptr,
                                          where.data_ptr<uint8_t>(), &ad, gx.data_ptr(), &geo, stream_of(gx)),
               "max_pool2d_backward_add");
  return gx;
}

}  // namespace

#define POOL_DEVICE_OPS(X) \
  X(max_pool2d_where)      \
  X(max_pool2d_backward_add)
KT_DEVICE_IMPLS(POOL_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) {
  m.impl("bias_relu_pool", &bias_relu_pool_fwd);
  m.impl("max_pool2d", &max_pool2d_fwd);
}

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("bias_relu_pool", &bias_relu_pool_autograd);
  m.impl("max_pool2d", &max_pool2d_autograd);
}

}  // namespace bridge
