// python/kitsune/csrc/ops/pointwise.cpp — the pointwise family (fusion/kernels/pointwise.cu,
// kitsune/ops/pointwise.py): add_relu, mul_tanh, bias_gelu, swiglu and their backwards;
// channel_bias, a convolution's bias and ReLU (kt_bias_act).
#include "../common.h"

namespace bridge {
namespace {

// Operands broadcast to one shape, dense. The common case (same shapes, contiguous)
// returns the inputs as they are: no view, no copy on the launch path. So do operands
// that share one dense layout (channels-last activations, say): an elementwise op
// runs over their memory in order, and empty_like gives the output that layout.
std::vector<Tensor> broadcast_dense(std::initializer_list<Tensor> ts) {
  std::vector<Tensor> v(ts);
  bool same = true, one_layout = true;
  for (const auto& t : v) {
    same = same && t.sizes() == v[0].sizes();
    one_layout = one_layout && t.strides() == v[0].strides() && t.is_non_overlapping_and_dense();
  }
  if (same) {
    if (one_layout) return v;
    for (auto& t : v) t = t.contiguous();   // a no-op for contiguous tensors
    return v;
  }
  c10::DimVector shape(v[0].sizes().begin(), v[0].sizes().end());
  for (size_t i = 1; i < v.size(); i++) shape = at::infer_size_dimvector(shape, v[i].sizes());
  for (auto& t : v) t = t.expand(shape).contiguous();
  return v;
}

// The checks of the binary ops and their backwards, on both devices: floating point,
// one dtype and device, shapes that broadcast.
void check_binary(const char* op, std::initializer_list<Arg> args, bool kernel) {
  check_floats(op, args, kernel);
  broadcast_sizes(op, args);
}
// The CPU references' results laid out as broadcast_dense + empty_like lay out the
// kernels': the operands' layout where they share one shape and one dense layout,
// else contiguous (what the fake kernels promise, kitsune/ops/pointwise.py).
Tensor binary_layout(const Tensor& r, std::initializer_list<Tensor> ts) {
  const Tensor& t0 = *ts.begin();
  bool one_layout = t0.is_non_overlapping_and_dense();
  for (const Tensor& t : ts) one_layout = one_layout && t.sizes() == t0.sizes() && t.strides() == t0.strides();
  if (!one_layout) return r.contiguous();
  return r.strides() == t0.strides() ? r : at::empty_like(t0, r.options()).copy_(r);
}

// The launcher shapes every binary op shares.
using BinaryLauncher = kt_status (*)(kt_dtype, const void*, const void*, void*, int64_t, void*);
using BinaryBackwardLauncher = kt_status (*)(kt_dtype, const void*, const void*, const void*, void*, void*, int64_t,
                                             void*);

// out = op(a, b) on the broadcast shape.
Tensor binary_cuda(const Tensor& a, const Tensor& b, const char* op, const char* na, const char* nb,
                   BinaryLauncher launch) {
  check_binary(op, {{na, a}, {nb, b}}, true);
  auto v = broadcast_dense({a, b});
  c10::cuda::CUDAGuard g(a.device());
  Tensor out = at::empty_like(v[0]);
  check_launch(launch(dtype_of(a, op), v[0].data_ptr(), v[1].data_ptr(), out.data_ptr(), out.numel(), stream_of(out)),
               op);
  return out;
}

// (grad_a, grad_b) of a binary op, at the broadcast shape; autograd (BinaryFn) sums
// them to each input's shape.
std::tuple<Tensor, Tensor> binary_backward_cuda(const Tensor& grad, const Tensor& a, const Tensor& b, const char* op,
                                                const char* na, const char* nb, BinaryBackwardLauncher launch) {
  check_binary(op, {{"grad", grad}, {na, a}, {nb, b}}, true);
  auto v = broadcast_dense({grad, a, b});
  c10::cuda::CUDAGuard g(a.device());
  Tensor ga = at::empty_like(v[0]), gb = at::empty_like(v[0]);
  check_launch(launch(dtype_of(a, op), v[0].data_ptr(), v[1].data_ptr(), v[2].data_ptr(), ga.data_ptr(),
                      gb.data_ptr(), ga.numel(), stream_of(ga)),
               op);
  return {ga, gb};
}


Tensor add_relu_cuda(const Tensor& a, const Tensor& b) {
  return binary_cuda(a, b, "add_relu", "a", "b", kt_add_relu);
}
Tensor add_relu_cpu(const Tensor& a, const Tensor& b) {
  check_binary("add_relu", {{"a", a}, {"b", b}}, false);
  return binary_layout(at::relu(a + b), {a, b});
}
// Takes (grad, out): binary_cuda's checks and broadcast fit it as they are.
Tensor add_relu_backward_cuda(const Tensor& grad, const Tensor& out) {
  return binary_cuda(grad, out, "add_relu_backward", "grad", "out", kt_add_relu_backward);
}
Tensor add_relu_backward_cpu(const Tensor& grad, const Tensor& out) {
  check_binary("add_relu_backward", {{"grad", grad}, {"out", out}}, false);
  return binary_layout(at::where(out > 0, grad, at::zeros_like(grad)), {grad, out});
}

Tensor mul_tanh_cuda(const Tensor& a, const Tensor& b) {
  return binary_cuda(a, b, "mul_tanh", "a", "b", kt_mul_tanh);
}
Tensor mul_tanh_cpu(const Tensor& a, const Tensor& b) {
  check_binary("mul_tanh", {{"a", a}, {"b", b}}, false);
  return binary_layout(at::tanh(a * b), {a, b});
}
std::tuple<Tensor, Tensor> mul_tanh_backward_cuda(const Tensor& grad, const Tensor& a, const Tensor& b) {
  return binary_backward_cuda(grad, a, b, "mul_tanh_backward", "a", "b", kt_mul_tanh_backward);
}
std::tuple<Tensor, Tensor> mul_tanh_backward_cpu(const Tensor& grad, const Tensor& a, const Tensor& b) {
  check_binary("mul_tanh_backward", {{"grad", grad}, {"a", a}, {"b", b}}, false);
  Tensor t = at::tanh(a.to(opmath(a)) * b.to(opmath(a)));
  Tensor d = grad.to(opmath(grad)) * (1 - t * t);
  return {binary_layout((d * b).to(a.scalar_type()), {grad, a, b}),
          binary_layout((d * a).to(a.scalar_type()), {grad, a, b})};
}

}  // namespace

int approx_code(c10::string_view approximate, const char* op) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "kitsune.", op, ": approximate must be 'none' or 'tanh', got '",
              approximate, "'");
  return approximate == "tanh" ? 1 : 0;
}
void check_bias(const Tensor& x, const Tensor& bias, const char* op, bool kernel) {
  check_floats(op, {{"x", x}, {"bias", bias}}, kernel);
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "kitsune.", op,
              ": bias must be 1-D with x.size(-1) = ", (x.dim() ? x.size(-1) : 0), " elements; got bias of shape ",
              bias.sizes(), " for x of shape ", x.sizes());
}

namespace {

void check_bias_grad(const Tensor& grad, const Tensor& x, const Tensor& bias, const char* op, bool kernel) {
  check_bias(x, bias, op, kernel);
  check_floats(op, {{"x", x}, {"grad", grad}}, kernel);
  TORCH_CHECK(at::is_expandable_to(grad.sizes(), x.sizes()), "kitsune.", op, ": grad of shape ", grad.sizes(),
              " does not broadcast to x's shape ", x.sizes());
}

Tensor bias_gelu_cuda(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu", true);
  int ap = approx_code(approximate, "bias_gelu");
  Tensor xc = x.contiguous(), bc = bias.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  check_launch(kt_bias_gelu(dtype_of(x, "bias_gelu"), xc.data_ptr(), bc.data_ptr(), out.data_ptr(), out.numel(),
                            bc.numel(), ap, stream_of(out)), "bias_gelu");
  return out;
}
Tensor bias_gelu_cpu(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu", false);
  approx_code(approximate, "bias_gelu");
  return at::gelu(x + bias, approximate).contiguous();   // the kernel's layout
}
std::tuple<Tensor, Tensor> bias_gelu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& bias,
                                                   c10::string_view approximate) {
  check_bias_grad(grad, x, bias, "bias_gelu_backward", true);
  int ap = approx_code(approximate, "bias_gelu_backward");
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous(), bc = bias.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  if (xc.numel() == 0) return {at::empty_like(xc), at::zeros_like(bias)};
  const int64_t n = bias.size(0);
  auto [gx, gb] = gelu_grad_colsum(gc.view({-1, n}), xc.view({-1, n}), bc, ap, bias.scalar_type());
  return {gx.view(x.sizes()), gb};
}
std::tuple<Tensor, Tensor> bias_gelu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& bias,
                                                  c10::string_view approximate) {
  check_bias_grad(grad, x, bias, "bias_gelu_backward", false);
  int ap = approx_code(approximate, "bias_gelu_backward");
  Tensor v = x.to(opmath(x)) + bias.to(opmath(x));
  Tensor d;
  if (ap) {
    const double k0 = 0.7978845608028654, k1 = 0.044715;
    Tensor t = at::tanh(k0 * (v + k1 * v * v * v));
    d = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k0 * (1 + 3 * k1 * v * v);
  } else {
    d = 0.5 * (1 + at::erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * at::exp(-0.5 * v * v);
  }
  Tensor gx = (grad.to(opmath(grad)).expand(x.sizes()) * d).contiguous();
  Tensor gb = as_rows(gx).sum(0);
  return {gx.to(x.scalar_type()), gb.to(bias.scalar_type())};
}

Tensor swiglu_cuda(const Tensor& gate, const Tensor& up) {
  return binary_cuda(gate, up, "swiglu", "gate", "up", kt_swiglu);
}
Tensor swiglu_cpu(const Tensor& gate, const Tensor& up) {
  check_binary("swiglu", {{"gate", gate}, {"up", up}}, false);
  return binary_layout(at::silu(gate) * up, {gate, up});
}
std::tuple<Tensor, Tensor> swiglu_backward_cuda(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  return binary_backward_cuda(grad, gate, up, "swiglu_backward", "gate", "up", kt_swiglu_backward);
}
std::tuple<Tensor, Tensor> swiglu_backward_cpu(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  check_binary("swiglu_backward", {{"grad", grad}, {"gate", gate}, {"up", up}}, false);
  Tensor g = gate.to(opmath(gate)), s = at::sigmoid(g), gr = grad.to(opmath(grad));
  return {binary_layout((gr * up.to(opmath(up)) * s * (1 + g * (1 - s))).to(gate.scalar_type()), {grad, gate, up}),
          binary_layout((gr * g * s).to(up.scalar_type()), {grad, gate, up})};
}

using BinaryBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&);

// add_relu: backward from the output; both gradients are grad where out > 0.
struct AddReluFn : torch::autograd::Function<AddReluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    static auto op = op_handle<BinarySig>("kitsune::add_relu");
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = op.call(a, b);
    }
    ctx->saved_data["sa"] = a.sizes().vec();
    ctx->saved_data["sb"] = b.sizes().vec();
    ctx->save_for_backward({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto bwd = op_handle<BinarySig>("kitsune::add_relu_backward");
    Tensor g = bwd.call(go[0], ctx->get_saved_variables()[0]);
    auto to = [&](const char* k) {
      auto s = ctx->saved_data[k].toIntVector();
      return g.sizes() == c10::IntArrayRef(s) ? g : at::sum_to(g, s);
    };
    return {to("sa"), to("sb")};
  }
};

// mul_tanh (which 0), swiglu (which 1): backward op (grad, a, b) -> both gradients.
struct BinaryFn : torch::autograd::Function<BinaryFn> {
  static const char* name(int64_t which, bool backward) {
    static const char* n[2][2] = {{"kitsune::mul_tanh", "kitsune::mul_tanh_backward"},
                                  {"kitsune::swiglu", "kitsune::swiglu_backward"}};
    return n[which][backward];
  }
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b, int64_t which) {
    static auto ops = std::array{op_handle<BinarySig>(name(0, false)), op_handle<BinarySig>(name(1, false))};
    ctx->saved_data["which"] = which;
    ctx->save_for_backward({a, b});
    at::AutoDispatchBelowADInplaceOrView g;
    return ops[which].call(a, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto ops = std::array{op_handle<BinaryBwdSig>(name(0, true)), op_handle<BinaryBwdSig>(name(1, true))};
    auto s = ctx->get_saved_variables();
    auto [ga, gb] = ops[ctx->saved_data["which"].toInt()].call(go[0], s[0], s[1]);
    return {sum_to_shape(ga, s[0]), sum_to_shape(gb, s[1]), Tensor()};
  }
};

struct BiasGeluFn : torch::autograd::Function<BiasGeluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, std::string approximate) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
    ctx->saved_data["approximate"] = approximate;
    ctx->save_for_backward({x, bias});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, bias, approximate);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                           c10::string_view)>("kitsune::bias_gelu_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gb] = op.call(go[0], s[0], s[1], ctx->saved_data["approximate"].toStringRef());
    return {gx, gb, Tensor()};
  }
};

Tensor add_relu_autograd(const Tensor& a, const Tensor& b) { return AddReluFn::apply(a, b); }
Tensor mul_tanh_autograd(const Tensor& a, const Tensor& b) { return BinaryFn::apply(a, b, 0); }
Tensor swiglu_autograd(const Tensor& a, const Tensor& b) { return BinaryFn::apply(a, b, 1); }
Tensor bias_gelu_autograd(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  return BiasGeluFn::apply(x, bias, std::string(approximate));
}

// ---- channel_bias: act(y + bias over dim 1) ----
// A convolution's bias, split from it by kitsune.optimize (F.conv2d(x, W) then this
// op, with the ReLU that follows when there is one). The bias gradient is
// channel_sum's (ops/reduce.cpp: why it takes two stages), or, after a ReLU with
// channels last in memory, kt_relu_grad_colsum's. The forward: kt_bias_act where the
// channels are last in memory, else ATen's y + bias and relu in place. y and bias
// share a dtype; under autocast the bias is cast to y's (as a convolution does with
// its bias).
void check_channel_bias(const Tensor& y, const Tensor& b, c10::string_view act) {
  TORCH_CHECK(act == "none" || act == "relu", "kitsune.channel_bias: act must be 'none' or 'relu', got '", act, "'");
  check_floats("channel_bias", {{"y", y}, {"bias", b}});
  TORCH_CHECK(y.dim() >= 2 && b.dim() == 1 && b.size(0) == y.size(1),
              "kitsune.channel_bias: need y (N, C, ...) and bias (C,); got ", y.sizes(), " and ", b.sizes());
}

}  // namespace

Tensor channel_bias_fwd(const Tensor& y, const Tensor& b, c10::string_view act) {
  check_channel_bias(y, b, act);
  const int64_t C = b.size(0);
  // channels last in memory (a channels-last convolution's output, or (rows, C)): one
  // kernel, bias[i % C] (ATen's broadcast add ran as its generic, unvectorized kernel
  // there: bench/results/h100_channel_bias_fb40403.log, CUDAFunctor_add)
  // (checked only for real CUDA tensors: a fake one's sizes may be symbolic)
  auto channels_last = [&] {
    return (y.dim() == 4 && y.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
           (y.is_contiguous() && y.numel() == y.size(0) * C);
  };
  if (lt_dtype_ok(y) && y.numel() > 0 && channels_last()) {
    c10::cuda::CUDAGuard g(y.device());
    Tensor out = at::empty_like(y), bc = b.contiguous();
    check_launch(kt_bias_act(dtype_of(y, "channel_bias"), y.data_ptr(), bc.data_ptr(), out.data_ptr(), y.numel(), C,
                             act == "relu", stream_of(out)), "channel_bias");
    return out;
  }
  // in empty_like(y)'s layout, as the kernel's (and the fake kernel's) output
  c10::DimVector shape(y.dim(), 1);
  shape[1] = b.size(0);
  Tensor out = at::empty_like(y);
  at::add_out(out, y, b.view(shape));
  return act == "relu" ? out.clamp_min_(0) : out;
}

namespace {

struct ChannelBiasFn : torch::autograd::Function<ChannelBiasFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& y, const Tensor& b, std::string act) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = channel_bias_fwd(y, b, act);
    }
    ctx->saved_data["relu"] = act == "relu";
    if (act == "relu") ctx->save_for_backward({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    Tensor g = go[0];
    if (ctx->saved_data["relu"].toBool()) {
      const Tensor y = ctx->get_saved_variables()[0];
      // g and y dense with channels last (a channels-last convolution's output and its
      // gradient, or (rows, C)): ReLU's mask and the bias gradient in one pass over
      // their (N H W, C) rows (kt_relu_grad_colsum), where threshold_backward and the
      // column sum read the gradient twice (the Inception net's 6 ReLU'd convolutions)
      const Tensor g2 = dense_channel_rows(g), y2 = dense_channel_rows(y);
      if (g2.defined() && y2.defined() && lt_dtype_ok(g) && g.scalar_type() == y.scalar_type()) {
        auto [gx, sums] = relu_grad_colsum(g2, y2, g.scalar_type());
        return {g.dim() == 2 ? gx : gx.view({g.size(0), g.size(2), g.size(3), g.size(1)}).permute({0, 3, 1, 2}),
                sums, Tensor()};
      }
      g = at::threshold_backward(g, y, 0);
    }
    return {g, channel_sum(g, g.scalar_type()), Tensor()};
  }
};
Tensor channel_bias_autograd(const Tensor& y, const Tensor& b, c10::string_view act) {
  return ChannelBiasFn::apply(y, b, std::string(act));
}

}  // namespace

#define POINTWISE_DEVICE_OPS(X) \
  X(add_relu)                   \
  X(add_relu_backward)          \
  X(mul_tanh)                   \
  X(mul_tanh_backward)          \
  X(bias_gelu)                  \
  X(bias_gelu_backward)         \
  X(swiglu)                     \
  X(swiglu_backward)
KT_DEVICE_IMPLS(POINTWISE_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("channel_bias", &channel_bias_fwd); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("add_relu", &add_relu_autograd);
  m.impl("mul_tanh", &mul_tanh_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("channel_bias", &channel_bias_autograd);
}

}  // namespace bridge
