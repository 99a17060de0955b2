// python/kitsune/csrc/ops/batch_norm.cpp — the batch_norm family
// (fusion/kernels/batch_norm.cu, kitsune/ops/batch_norm.py): batch_norm_relu and
// batch_norm_add_relu (a ResNet block's end) and their backwards.
#include "../common.h"

namespace bridge {
namespace {

// ---- batch_norm_relu (fusion/kernels/batch_norm.cu) ----
// relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
// eps)) over dim 1; returns (out, save_mean, save_invstd) and updates the running
// stats in place in training, as native_batch_norm does.
struct BnShape { int64_t N, C, S; };
BnShape bn_shape(const Tensor& x, std::initializer_list<std::pair<const char*, const OptTensor*>> per_channel,
                 const char* op) {
  TORCH_CHECK(x.dim() >= 2, "kitsune.", op, ": x must be (N, C, ...); got shape ", x.sizes());
  const int64_t N = x.size(0), C = x.size(1);
  for (const auto& [name, t] : per_channel)
    if (*t && (*t)->defined()) {
      TORCH_CHECK((*t)->dim() == 1 && (*t)->size(0) == C && (*t)->device() == x.device(), "kitsune.", op, ": ", name,
                  " must have C = ", C, " elements on ", x.device(), "; got ", (*t)->sizes(), " on ", (*t)->device());
    }
  return {N, C, N && C ? x.numel() / (N * C) : 0};
}
c10::DimVector bn_bcast(const Tensor& x) {   // (1, C, 1, ...)
  c10::DimVector s(x.dim(), 1);
  s[1] = x.size(1);
  return s;
}
std::vector<int64_t> bn_dims(const Tensor& x) {
  std::vector<int64_t> d{0};
  for (int64_t i = 2; i < x.dim(); i++) d.push_back(i);
  return d;
}
// The forward's checks, on both devices (kernel: the CUDA kernel's dtypes for x, weight
// and bias; the running stats are read and written as fp32 there, any floating dtype);
// returns the (N, C, S) view.
BnShape bn_forward_checks(const Tensor& x, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                          const OptTensor& rv, bool training, double eps, const char* op, bool kernel) {
  check_devices(op, {{"x", x}, {"weight", w}, {"bias", b}, {"running_mean", rm}, {"running_var", rv}});
  check_floats(op, {{"x", x}, {"weight", w}, {"bias", b}}, kernel);
  for (const Arg& a : {Arg("running_mean", rm), Arg("running_var", rv)})
    if (a.t) check_float(*a.t, op, a.name);
  auto s = bn_shape(x, {{"weight", &w}, {"bias", &b}, {"running_mean", &rm}, {"running_var", &rv}}, op);
  TORCH_CHECK(!training || s.N * s.S > 1, "kitsune.", op, ": expected more than 1 value per channel when training, got ",
              s.N * s.S);
  TORCH_CHECK(training || (rm && rm->defined() && rv && rv->defined()), "kitsune.", op,
              ": eval mode needs running_mean and running_var");
  TORCH_CHECK(eps >= 0, "kitsune.", op, ": eps must be >= 0, got ", eps);
  return s;
}
// A channels-last (NHWC) batch is run as it lies, as (N * H * W, C, 1) rows: no copy,
// and the output is channels-last too (convolutions then need no transposes).
bool bn_channels_last(const Tensor& x) {
  return x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}
at::MemoryFormat bn_format(const Tensor& x) {   // the outputs' layout (the fake kernels': kitsune/ops/batch_norm.py)
  return bn_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}
BnShape bn_kernel_shape(const Tensor& x, BnShape s) {
  return bn_channels_last(x) ? BnShape{s.N * s.S, s.C, 1} : s;
}
// batch_norm_add_relu: relu(F.batch_norm(x, ...) + residual), residual x's shape and
// dtype (a ResNet block's end); the backward also returns the residual's gradient.
void bn_residual_checks(const Tensor& x, const Tensor& r, const char* op) {
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.device() == x.device(), "kitsune.", op,
              ": residual must have x's shape, dtype and device ", x.sizes(), " ", x.scalar_type(), " ", x.device(),
              "; got ", r.sizes(), " ", r.scalar_type(), " ", r.device());
}
std::tuple<Tensor, Tensor, Tensor> bn_relu_cuda(const Tensor& x, const Tensor* res, const OptTensor& w,
                                                const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                                bool training, double momentum, double eps, const char* op) {
  auto s = bn_kernel_shape(x, bn_forward_checks(x, w, b, rm, rv, training, eps, op, true));
  if (res) bn_residual_checks(x, *res, op);
  kt_dtype dt = dtype_of(x, op);
  c10::cuda::CUDAGuard g(x.device());
  Tensor xc = bn_channels_last(x) ? x : x.contiguous(), out = at::empty_like(xc);
  Tensor rc = res ? res->contiguous(bn_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous)
                  : Tensor();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor wc = w && w->defined() ? w->contiguous() : Tensor(), bc = b && b->defined() ? b->contiguous() : Tensor();
  Tensor mean, invstd, rmf, rvf, ws;
  if (training) {
    mean = at::empty({s.C}, fopt), invstd = at::empty({s.C}, fopt);
    ws = at::empty({kt_batch_norm_workspace(s.N, s.C, s.S)}, fopt);
    if (rm && rm->defined()) rmf = rm->scalar_type() == at::kFloat && rm->is_contiguous() ? *rm : rm->to(at::kFloat).contiguous();
    if (rv && rv->defined()) rvf = rv->scalar_type() == at::kFloat && rv->is_contiguous() ? *rv : rv->to(at::kFloat).contiguous();
  } else {   // a copy: an output may not alias running_mean
    mean = rm->to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    invstd = (rv->to(at::kFloat) + eps).rsqrt().contiguous();
  }
  if (s.N * s.C * s.S > 0)
    check_launch(kt_batch_norm(dt, xc.data_ptr(), rc.defined() ? rc.data_ptr() : nullptr, out.data_ptr(),
                               wc.defined() ? wc.data_ptr() : nullptr,
                               bc.defined() ? bc.data_ptr() : nullptr, s.N, s.C, s.S, training, (float)momentum,
                               (float)eps, mean.data_ptr<float>(), invstd.data_ptr<float>(),
                               rmf.defined() ? rmf.data_ptr<float>() : nullptr,
                               rvf.defined() ? rvf.data_ptr<float>() : nullptr,
                               ws.defined() ? ws.data_ptr<float>() : nullptr, 1, stream_of(out)),
                 op);
  else if (training)   // an empty batch: no kernel runs, the saved statistics are defined zeros
    mean.zero_(), invstd.zero_();
  if (rmf.defined() && !rmf.is_same(*rm)) rm->copy_(rmf);
  if (rvf.defined() && !rvf.is_same(*rv)) rv->copy_(rvf);
  return {out, mean, invstd};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_cuda(const Tensor& x, const OptTensor& w, const OptTensor& b,
                                                        const OptTensor& rm, const OptTensor& rv, bool training,
                                                        double momentum, double eps) {
  return bn_relu_cuda(x, nullptr, w, b, rm, rv, training, momentum, eps, "batch_norm_relu");
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_add_relu_cuda(const Tensor& x, const Tensor& res, const OptTensor& w,
                                                            const OptTensor& b, const OptTensor& rm,
                                                            const OptTensor& rv, bool training, double momentum,
                                                            double eps) {
  return bn_relu_cuda(x, &res, w, b, rm, rv, training, momentum, eps, "batch_norm_add_relu");
}
std::tuple<Tensor, Tensor, Tensor> bn_relu_cpu(const Tensor& x, const Tensor* res, const OptTensor& w,
                                               const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                               bool training, double momentum, double eps, const char* op) {
  auto s = bn_forward_checks(x, w, b, rm, rv, training, eps, op, false);
  if (res) bn_residual_checks(x, *res, op);
  auto om = opmath(x);
  Tensor xf = x.to(om), mean, invstd;
  auto dims = bn_dims(x);
  auto bc = bn_bcast(x);
  if (training) {
    mean = xf.mean(dims);
    Tensor var = (xf - mean.view(bc)).pow(2).mean(dims);
    invstd = (var + eps).rsqrt();
    const double M = (double)(s.N * s.S);
    at::NoGradGuard ng;
    if (rm && rm->defined()) rm->copy_(*rm * (1 - momentum) + mean * momentum);
    if (rv && rv->defined()) rv->copy_(*rv * (1 - momentum) + var * (M / (M - 1)) * momentum);
  } else {
    mean = rm->to(om, /*non_blocking=*/false, /*copy=*/true), invstd = (rv->to(om) + eps).rsqrt();
  }
  Tensor y = (xf - mean.view(bc)) * invstd.view(bc);
  if (w && w->defined()) y = y * w->to(om).view(bc);
  if (b && b->defined()) y = y + b->to(om).view(bc);
  if (res) y = y + res->to(om);
  return {at::relu(y).to(x.scalar_type()).contiguous(bn_format(x)), mean, invstd};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_cpu(const Tensor& x, const OptTensor& w, const OptTensor& b,
                                                       const OptTensor& rm, const OptTensor& rv, bool training,
                                                       double momentum, double eps) {
  return bn_relu_cpu(x, nullptr, w, b, rm, rv, training, momentum, eps, "batch_norm_relu");
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_add_relu_cpu(const Tensor& x, const Tensor& res, const OptTensor& w,
                                                           const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                                           bool training, double momentum, double eps) {
  return bn_relu_cpu(x, &res, w, b, rm, rv, training, momentum, eps, "batch_norm_add_relu");
}
// The backward's checks, on both devices: grad and out as x (the kernel reads them in
// x's dtype), the saved statistics (C,) of any floating dtype (read as fp32).
BnShape bn_backward_checks(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                           const Tensor& mean, const Tensor& invstd, const char* op, bool kernel) {
  check_devices(op, {{"x", x}, {"grad", grad}, {"out", out}, {"weight", w}, {"save_mean", mean},
                     {"save_invstd", invstd}});
  check_floats(op, {{"x", x}, {"grad", grad}, {"out", out}, {"weight", w}}, kernel);
  check_float(mean, op, "save_mean");
  check_float(invstd, op, "save_invstd");
  auto s = bn_shape(x, {{"weight", &w}}, op);
  TORCH_CHECK(grad.sizes() == x.sizes() && out.sizes() == x.sizes(), "kitsune.", op,
              ": grad and out must have x's shape ", x.sizes(), "; got ", grad.sizes(), " and ", out.sizes());
  TORCH_CHECK(mean.dim() == 1 && mean.size(0) == s.C && invstd.dim() == 1 && invstd.size(0) == s.C, "kitsune.", op,
              ": save_mean and save_invstd must have C = ", s.C, " elements; got ", mean.sizes(), " and ",
              invstd.sizes());
  return s;
}
// (gx, gres (undefined unless asked for), gw, gb)
using BnBwd = std::tuple<Tensor, Tensor, Tensor, Tensor>;
BnBwd bn_relu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                            const Tensor& mean, const Tensor& invstd, bool training, bool residual, const char* op) {
  auto s = bn_kernel_shape(x, bn_backward_checks(grad, x, out, w, mean, invstd, op, true));
  c10::cuda::CUDAGuard g(x.device());
  const auto fmt = bn_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  Tensor gc = grad.contiguous(fmt), xc = x.contiguous(fmt), oc = out.contiguous(fmt), gx = at::empty_like(xc);
  Tensor gr = residual ? at::empty_like(xc) : Tensor();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor sum_g = at::empty({s.C}, fopt), sum_gx = at::empty({s.C}, fopt);   // every channel written below
  Tensor ws = at::empty({std::max<int64_t>(1, kt_batch_norm_workspace(s.N, s.C, s.S))}, fopt);
  Tensor wc = w && w->defined() ? w->contiguous() : Tensor();
  Tensor mf = mean.to(at::kFloat).contiguous(), isf = invstd.to(at::kFloat).contiguous();
  if (s.N * s.C * s.S > 0)
    check_launch(kt_batch_norm_backward(dtype_of(x, op), gc.data_ptr(), xc.data_ptr(), oc.data_ptr(), gx.data_ptr(),
                                        gr.defined() ? gr.data_ptr() : nullptr,
                                        wc.defined() ? wc.data_ptr() : nullptr, s.N, s.C, s.S, training,
                                        mf.data_ptr<float>(), isf.data_ptr<float>(), sum_g.data_ptr<float>(),
                                        sum_gx.data_ptr<float>(), ws.data_ptr<float>(), 1, stream_of(gx)),
                 op);
  else   // an empty batch: the weight's and bias's gradients are sums over nothing
    sum_g.zero_(), sum_gx.zero_();
  Tensor gw = w && w->defined() ? sum_gx.to(w->scalar_type()) : at::empty({0}, x.options());
  Tensor gb = sum_g.to(x.scalar_type());
  return {gx, gr, gw, gb};
}
BnBwd bn_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                           const Tensor& mean, const Tensor& invstd, bool training, bool residual, const char* op) {
  auto s = bn_backward_checks(grad, x, out, w, mean, invstd, op, false);
  auto om = opmath(x);
  auto bc = bn_bcast(x);
  auto dims = bn_dims(x);
  Tensor gp = grad.to(om) * (out > 0);
  Tensor m = mean.to(om).view(bc), is = invstd.to(om).view(bc);
  Tensor xh = (x.to(om) - m) * is;
  Tensor sum_g = gp.sum(dims), sum_gx = (gp * xh).sum(dims);
  Tensor scale = w && w->defined() ? w->to(om).view(bc) * is : is;
  const double M = (double)(s.N * s.S);
  Tensor gx = training ? scale * (gp - sum_g.view(bc) / M - xh * sum_gx.view(bc) / M) : scale * gp;
  Tensor gw = w && w->defined() ? sum_gx.to(w->scalar_type()) : at::empty({0}, x.options());
  const auto f = bn_format(x);
  return {gx.to(x.scalar_type()).contiguous(f), residual ? gp.to(x.scalar_type()).contiguous(f) : Tensor(), gw,
          sum_g.to(x.scalar_type())};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward_cuda(const Tensor& grad, const Tensor& x,
                                                                 const Tensor& out, const OptTensor& w,
                                                                 const Tensor& mean, const Tensor& invstd,
                                                                 bool training) {
  auto [gx, gr, gw, gb] =
      bn_relu_backward_cuda(grad, x, out, w, mean, invstd, training, false, "batch_norm_relu_backward");
  return {gx, gw, gb};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out,
                                                                const OptTensor& w, const Tensor& mean,
                                                                const Tensor& invstd, bool training) {
  auto [gx, gr, gw, gb] =
      bn_relu_backward_cpu(grad, x, out, w, mean, invstd, training, false, "batch_norm_relu_backward");
  return {gx, gw, gb};
}
BnBwd batch_norm_add_relu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                                        const Tensor& mean, const Tensor& invstd, bool training) {
  return bn_relu_backward_cuda(grad, x, out, w, mean, invstd, training, true, "batch_norm_add_relu_backward");
}
BnBwd batch_norm_add_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                                       const Tensor& mean, const Tensor& invstd, bool training) {
  return bn_relu_backward_cpu(grad, x, out, w, mean, invstd, training, true, "batch_norm_add_relu_backward");
}

// batch_norm_relu and batch_norm_add_relu (Res): the running stats are mutated in place
// (not differentiable); absent tensors are placeholders, bits: 1 weight, 2 bias,
// 4 running_mean, 8 running_var. With Res, r is the residual, whose gradient is g' (the
// gradient through the ReLU's mask), written by the backward kernel beside gx; without,
// r is a placeholder that gets no gradient.
using BnFwd = std::tuple<Tensor, Tensor, Tensor>;
template <bool Res>
struct BatchNormReluFn : torch::autograd::Function<BatchNormReluFn<Res>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                               const Tensor& b, const Tensor& rm, const Tensor& rv, int64_t present, bool training,
                               double momentum, double eps) {
    Tensor out, mean, invstd;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      const OptTensor wo = opt_if(w, present, 1), bo = opt_if(b, present, 2), rmo = opt_if(rm, present, 4),
                      rvo = opt_if(rv, present, 8);
      if constexpr (Res) {
        static auto op = op_handle<BnFwd(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&, bool, double, double)>(
            "kitsune::batch_norm_add_relu");
        std::tie(out, mean, invstd) = op.call(x, r, wo, bo, rmo, rvo, training, momentum, eps);
      } else {
        static auto op = op_handle<BnFwd(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, bool, double, double)>("kitsune::batch_norm_relu");
        std::tie(out, mean, invstd) = op.call(x, wo, bo, rmo, rvo, training, momentum, eps);
      }
    }
    ctx->saved_data["present"] = present;
    ctx->saved_data["training"] = training;
    ctx->save_for_backward({x, out, w, mean, invstd});
    ctx->mark_non_differentiable({mean, invstd});
    ctx->set_materialize_grads(false);   // else two zero-filled (C,) gradients a call, for mean and invstd
    return {out, mean, invstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    const int64_t p = ctx->saved_data["present"].toInt();
    const bool training = ctx->saved_data["training"].toBool();
    Tensor g = go[0].defined() ? go[0] : at::zeros_like(s[1]);
    Tensor gx, gr, gw, gb;
    if constexpr (Res) {
      static auto op = op_handle<BnBwd(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                       const Tensor&, bool)>("kitsune::batch_norm_add_relu_backward");
      std::tie(gx, gr, gw, gb) = op.call(g, s[0], s[1], opt_if(s[2], p, 1), s[3], s[4], training);
    } else {
      static auto op = op_handle<BnFwd(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                       const Tensor&, bool)>("kitsune::batch_norm_relu_backward");
      std::tie(gx, gw, gb) = op.call(g, s[0], s[1], opt_if(s[2], p, 1), s[3], s[4], training);
    }
    return {gx, gr, grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
template <bool Res>
BnFwd bn_relu_autograd(const Tensor& x, const Tensor& r, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                       const OptTensor& rv, bool training, double momentum, double eps) {
  int64_t present = present_bits(w, b) | (rm && rm->defined() ? 4 : 0) | (rv && rv->defined() ? 8 : 0);
  auto out = BatchNormReluFn<Res>::apply(x, r, placeholder_if_absent(w, x), placeholder_if_absent(b, x),
                                         placeholder_if_absent(rm, x), placeholder_if_absent(rv, x), present,
                                         training, momentum, eps);
  return {out[0], out[1], out[2]};
}
BnFwd batch_norm_relu_autograd(const Tensor& x, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                               const OptTensor& rv, bool training, double momentum, double eps) {
  return bn_relu_autograd<false>(x, placeholder_if_absent(std::nullopt, x), w, b, rm, rv, training, momentum, eps);
}
BnFwd batch_norm_add_relu_autograd(const Tensor& x, const Tensor& r, const OptTensor& w, const OptTensor& b,
                                   const OptTensor& rm, const OptTensor& rv, bool training, double momentum,
                                   double eps) {
  return bn_relu_autograd<true>(x, r, w, b, rm, rv, training, momentum, eps);
}

}  // namespace

#define BATCH_NORM_DEVICE_OPS(X) \
  X(batch_norm_relu)             \
  X(batch_norm_relu_backward)    \
  X(batch_norm_add_relu)         \
  X(batch_norm_add_relu_backward)
KT_DEVICE_IMPLS(BATCH_NORM_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("batch_norm_relu", &batch_norm_relu_autograd);
  m.impl("batch_norm_add_relu", &batch_norm_add_relu_autograd);
}

}  // namespace bridge
