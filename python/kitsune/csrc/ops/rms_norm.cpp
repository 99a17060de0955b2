// python/kitsune/csrc/ops/rms_norm.cpp — the rms_norm family (fusion/kernels/rms_norm.cu,
// kitsune/ops/rms_norm.py): y = x / rms(x) * weight over the last dimension, and its
// backward (the weight gradient through layer_norm.cu's column kernel).
#include "../common.h"

namespace bridge {
namespace {

// Both devices' checks (kernel: the CUDA kernel's dtypes); the backward's also grad,
// which broadcasts to x's shape.
void check_weight(const Tensor& x, const Tensor& w, const char* op, bool kernel, const Tensor& grad = Tensor()) {
  check_floats(op, {{"x", x}, {"weight", w}, {"grad", grad}}, kernel);
  TORCH_CHECK(!grad.defined() || at::is_expandable_to(grad.sizes(), x.sizes()), "kitsune.", op, ": grad of shape ",
              grad.sizes(), " does not broadcast to x's shape ", x.sizes());
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "kitsune.", op,
              ": weight must be 1-D with x.size(-1) = ", (x.dim() ? x.size(-1) : 0), " elements; got weight of shape ",
              w.sizes(), " for x of shape ", x.sizes());
}
Tensor rms_norm_cuda(const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm", true);
  TORCH_CHECK(eps >= 0, "kitsune.rms_norm: eps must be >= 0, got ", eps);
  Tensor xc = x.contiguous(), wc = w.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor y = at::empty_like(xc);
  int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  if (rows == 0 || n == 0) return y;
  check_launch(kt_rms_norm(dtype_of(x, "rms_norm"), xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, n, (float)eps,
                           stream_of(y)), "rms_norm");
  return y;
}
Tensor rms_norm_cpu(const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm", false);
  TORCH_CHECK(eps >= 0, "kitsune.rms_norm: eps must be >= 0, got ", eps);
  Tensor xf = x.to(opmath(x));
  Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps) * w.to(opmath(x));
  return y.to(x.scalar_type()).contiguous();   // the kernel's layout
}
std::tuple<Tensor, Tensor> rms_norm_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm_backward", true, grad);
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous(), wc = w.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor gx = at::empty_like(xc);
  int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  if (rows == 0 || n == 0) return {gx, at::zeros_like(w)};
  Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(kt_rms_norm_backward(dtype_of(x, "rms_norm_backward"), gc.data_ptr(), xc.data_ptr(), wc.data_ptr(),
                                    gx.data_ptr(), rstd.data_ptr<float>(), rows, n, (float)eps, stream_of(gx)),
               "rms_norm_backward");
  // grad_weight = sum over rows of grad * x * r: the LayerNorm column kernel, no mean
  int64_t splits = kt_layer_norm_param_splits(rows, n);
  Tensor part = at::empty({splits, n}, x.options().dtype(at::kFloat));
  check_launch(kt_layer_norm_param_grads(dtype_of(x, "rms_norm_backward"), gc.data_ptr(), xc.data_ptr(),
                                         nullptr, rstd.data_ptr<float>(),
                                         part.data_ptr<float>(), nullptr, splits, rows, n, stream_of(gx)),
               "rms_norm_backward");
  return {gx, colsum(part, at::kFloat).to(w.scalar_type())};
}
std::tuple<Tensor, Tensor> rms_norm_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm_backward", false, grad);
  Tensor xf = x.to(opmath(x)), gf = grad.to(opmath(x)).expand(x.sizes()), wf = w.to(opmath(x));
  int64_t n = x.size(-1);
  Tensor r = at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  Tensor dot = (gf * wf * xf).sum(-1, true);
  Tensor gx = r * wf * gf - xf * r.pow(3) / n * dot;
  Tensor gw = as_rows(gf * xf * r).sum(0);
  return {gx.to(x.scalar_type()).contiguous(), gw.to(w.scalar_type())};
}

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::rms_norm");
    ctx->saved_data["eps"] = eps;
    ctx->save_for_backward({x, w});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, w, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
        "kitsune::rms_norm_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gw] = op.call(go[0], s[0], s[1], ctx->saved_data["eps"].toDouble());
    return {gx, gw, Tensor()};
  }
};

Tensor rms_norm_autograd(const Tensor& x, const Tensor& w, double eps) { return RmsNormFn::apply(x, w, eps); }

}  // namespace

#define RMS_NORM_DEVICE_OPS(X) \
  X(rms_norm)                  \
  X(rms_norm_backward)
KT_DEVICE_IMPLS(RMS_NORM_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }

}  // namespace bridge
