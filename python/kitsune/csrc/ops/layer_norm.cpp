// python/kitsune/csrc/ops/layer_norm.cpp — the LayerNorm family (fusion/kernels/layer_norm.cu,
// kitsune/ops/layer_norm.py): layer_norm_relu, add_layer_norm and their backwards.
#include "../common.h"

namespace bridge {
namespace {

// rows x n view for a LayerNorm over the trailing dims `shape`; checks x (named xn),
// weight and bias on both devices (kernel: the CUDA kernel's dtypes).
std::pair<int64_t, int64_t> norm_rows(const Tensor& x, c10::IntArrayRef shape, const Tensor* w, const Tensor* b,
                                      const char* op, bool kernel, const char* xn = "x") {
  check_floats(op, {{xn, x}, {"weight", w ? *w : Tensor()}, {"bias", b ? *b : Tensor()}}, kernel);
  const int64_t k = (int64_t)shape.size();
  TORCH_CHECK(k >= 1 && x.dim() >= k && x.sizes().slice(x.dim() - k) == shape, "kitsune.", op,
              ": normalized_shape ", shape, " must match the trailing dimensions of ", xn, ", of shape ", x.sizes());
  for (const Tensor* p : {w, b})
    if (p) {
      TORCH_CHECK(p->sizes() == shape, "kitsune.", op, ": ", p == w ? "weight" : "bias", " must have shape ",
                  shape, " (normalized_shape); got ", p->sizes());
    }
  int64_t n = c10::multiply_integers(shape);
  TORCH_CHECK(n > 0, "kitsune.", op, ": normalized_shape ", shape, " has no elements");
  return {x.numel() / n, n};
}
void check_eps(double eps, const char* op) { TORCH_CHECK(eps >= 0, "kitsune.", op, ": eps must be >= 0, got ", eps); }
// A backward's incoming gradients (grad_sum: add_layer_norm's, for the sum; may be
// null) against the normalized tensor h, named hn.
void check_grads(const Tensor& grad, const Tensor* grad_sum, const Tensor& h, const char* op, bool kernel,
                 const char* hn) {
  check_floats(op, {{hn, h}, {"grad", grad}, {"grad_sum", grad_sum ? *grad_sum : Tensor()}}, kernel);
  for (const Tensor* g : {&grad, grad_sum})
    if (g)
      TORCH_CHECK(at::is_expandable_to(g->sizes(), h.sizes()), "kitsune.", op, ": ", g == &grad ? "grad" : "grad_sum",
                  " of shape ", g->sizes(), " does not broadcast to ", hn, "'s shape ", h.sizes());
}

// y = [relu](layer_norm(x [+ residual])); h_out receives x + residual when given.
Tensor ln_forward_cuda(const Tensor& x, const Tensor* res, const Tensor* w, const Tensor* b, Tensor* h_out,
                       int64_t rows, int64_t n, double eps, bool relu, const char* op) {
  Tensor xc = x.contiguous(), rc = res ? res->contiguous() : Tensor(), wc = w ? w->contiguous() : Tensor(),
         bc = b ? b->contiguous() : Tensor();
  c10::cuda::CUDAGuard g(x.device());
  Tensor y = at::empty_like(xc);
  if (h_out) *h_out = at::empty_like(xc);
  if (rows == 0) return y;
  check_launch(kt_layer_norm(dtype_of(x, op), xc.data_ptr(), res ? rc.data_ptr() : nullptr,
                             w ? wc.data_ptr() : nullptr, b ? bc.data_ptr() : nullptr,
                             h_out ? h_out->data_ptr() : nullptr, y.data_ptr(), rows, n, (float)eps, relu,
                             stream_of(y)),
               op);
  return y;
}

// (grad_h, grad_weight, grad_bias); an absent weight or bias gets an empty gradient.
std::tuple<Tensor, Tensor, Tensor> ln_backward_cuda(const Tensor& grad, const Tensor* grad_h_in, const Tensor& h,
                                                    const Tensor* w, const Tensor* b, int64_t rows, int64_t n,
                                                    double eps, bool relu, const char* op) {
  Tensor gc = grad.expand(h.sizes()).contiguous(), hc = h.contiguous();
  Tensor gic = grad_h_in ? grad_h_in->expand(h.sizes()).contiguous() : Tensor();
  Tensor wc = w ? w->contiguous() : Tensor(), bc = b ? b->contiguous() : Tensor();
  c10::cuda::CUDAGuard g(h.device());
  Tensor gh = at::empty_like(hc);
  auto fopt = h.options().dtype(at::kFloat);
  const kt_dtype dt = dtype_of(h, op);
  int64_t splits = kt_layer_norm_backward_splits(dt, rows, n);
  Tensor mean = at::empty({rows}, fopt), rstd = at::empty({rows}, fopt);
  // the weight's and the bias's stripe sums side by side in each row, (splits, 2n), so
  // one column sum finishes both (two reduce kernels a LayerNorm were 24 of GPT's
  // step, bench/results/h100_profile_graph_101578e.log)
  Tensor parts = w || b ? at::empty({splits, 2 * n}, fopt) : Tensor();
  float* pw = w ? parts.data_ptr<float>() : nullptr;
  float* pb = b ? parts.data_ptr<float>() + n : nullptr;
  if (rows > 0)
    check_launch(kt_layer_norm_backward(dt, gc.data_ptr(), grad_h_in ? gic.data_ptr() : nullptr, hc.data_ptr(),
                                        w ? wc.data_ptr() : nullptr, b ? bc.data_ptr() : nullptr, gh.data_ptr(),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), pw, pb, 2 * n, splits, rows, n,
                                        (float)eps, relu, stream_of(gh)),
                 op);
  else if (parts.defined())   // no rows: the parameters' gradients are sums over nothing
    parts.zero_();
  // the written columns: both halves, or the one wanted
  // in the parameters' dtype straight from the fp32 partials where they share one (two
  // cast kernels a LayerNorm were 24 launches, 30 us of GPT's step at 81772ef,
  // bench/results/h100_profile_graph_gpt_81772ef.log)
  const at::ScalarType pt = w && b && w->scalar_type() != b->scalar_type() ? at::kFloat
                            : w ? w->scalar_type() : b ? b->scalar_type() : at::kFloat;
  Tensor sums = !parts.defined() ? Tensor()
                : rows == 0      ? at::zeros({2 * n}, fopt.dtype(pt))
                : w && b         ? colsum(parts, pt)
                                 : colsum(parts.narrow(1, w ? 0 : n, n), pt);
  auto param = [&](const Tensor* p, int64_t first) {
    if (!p) return at::empty({0}, h.options());
    return sums.narrow(0, w && b ? first : 0, n).view(p->sizes()).to(p->scalar_type());
  };
  return {gh, param(w, 0), param(b, n)};
}

// CPU reference, fp32 (fp64 for fp64): the same formulas as the kernels.
Tensor ln_forward_cpu(const Tensor& h, const Tensor* w, const Tensor* b, int64_t n, double eps, bool relu) {
  Tensor hf = h.to(opmath(h)).reshape({-1, n});
  Tensor mean = hf.mean(1, true), var = (hf - mean).pow(2).mean(1, true);
  Tensor y = (hf - mean) * at::rsqrt(var + eps);
  if (w) y = y * w->to(opmath(h)).reshape({n});
  if (b) y = y + b->to(opmath(h)).reshape({n});
  if (relu) y = at::relu(y);
  return y.view(h.sizes()).to(h.scalar_type()).contiguous();   // the kernel's layout, whatever h's
}
std::tuple<Tensor, Tensor, Tensor> ln_backward_cpu(const Tensor& grad, const Tensor* grad_h_in, const Tensor& h,
                                                   const Tensor* w, const Tensor* b, int64_t n, double eps,
                                                   bool relu) {
  auto om = opmath(h);
  Tensor hf = h.to(om).reshape({-1, n}), gf = grad.to(om).expand(h.sizes()).reshape({-1, n});
  Tensor mean = hf.mean(1, true), rstd = at::rsqrt((hf - mean).pow(2).mean(1, true) + eps);
  Tensor xh = (hf - mean) * rstd;
  Tensor wf = w ? w->to(om).reshape({n}) : at::ones({n}, hf.options());
  if (relu) gf = gf * ((xh * wf + (b ? b->to(om).reshape({n}) : at::zeros({n}, hf.options()))) > 0);
  Tensor dy = gf * wf;
  Tensor gh = rstd * (dy - dy.mean(1, true) - xh * (dy * xh).mean(1, true));
  if (grad_h_in) gh = gh + grad_h_in->to(om).expand(h.sizes()).reshape({-1, n});
  auto param = [&](const Tensor* p, const Tensor& v) {
    return p ? v.sum(0).view(p->sizes()).to(p->scalar_type()) : at::empty({0}, h.options());
  };
  return {gh.view(h.sizes()).to(h.scalar_type()).contiguous(), param(w, gf * xh), param(b, gf)};
}

Tensor layer_norm_relu_cuda(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                            double eps) {
  check_eps(eps, "layer_norm_relu");
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu", true);
  return ln_forward_cuda(x, nullptr, opt(w), opt(b), nullptr, rows, n, eps, true, "layer_norm_relu");
}
Tensor layer_norm_relu_cpu(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                           double eps) {
  check_eps(eps, "layer_norm_relu");
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu", false);
  return ln_forward_cpu(x, opt(w), opt(b), n, eps, true);
}
std::tuple<Tensor, Tensor, Tensor> layer_norm_relu_backward_cuda(const Tensor& grad, const Tensor& x,
                                                                 c10::IntArrayRef shape, const OptTensor& w,
                                                                 const OptTensor& b, double eps) {
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu_backward", true);
  check_grads(grad, nullptr, x, "layer_norm_relu_backward", true, "x");
  return ln_backward_cuda(grad, nullptr, x, opt(w), opt(b), rows, n, eps, true, "layer_norm_relu_backward");
}
std::tuple<Tensor, Tensor, Tensor> layer_norm_relu_backward_cpu(const Tensor& grad, const Tensor& x,
                                                                c10::IntArrayRef shape, const OptTensor& w,
                                                                const OptTensor& b, double eps) {
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu_backward", false);
  check_grads(grad, nullptr, x, "layer_norm_relu_backward", false, "x");
  return ln_backward_cpu(grad, nullptr, x, opt(w), opt(b), n, eps, true);
}

// add_layer_norm normalizes over the last dimension; x and residual have one shape.
// The backward passes the sum for x and no residual.
std::pair<int64_t, int64_t> add_ln_rows(const Tensor& x, const Tensor* res, const OptTensor& w, const OptTensor& b,
                                        const char* op, bool kernel) {
  const char* xn = res ? "x" : "sum";
  check_floats(op, {{xn, x}, {"residual", res ? *res : Tensor()}, {"weight", w}, {"bias", b}}, kernel);
  TORCH_CHECK(!res || x.sizes() == res->sizes(), "kitsune.", op, ": x and residual must have one shape; got ",
              x.sizes(), " and ", res->sizes());
  TORCH_CHECK(x.dim() >= 1, "kitsune.", op, ": ", xn, " must have at least one dimension; got a 0-dim tensor");
  return norm_rows(x, x.sizes().slice(x.dim() - 1), opt(w), opt(b), op, kernel, xn);
}
std::tuple<Tensor, Tensor> add_layer_norm_cuda(const Tensor& x, const Tensor& res, const OptTensor& w,
                                               const OptTensor& b, double eps) {
  check_eps(eps, "add_layer_norm");
  auto [rows, n] = add_ln_rows(x, &res, w, b, "add_layer_norm", true);
  Tensor h;
  Tensor y = ln_forward_cuda(x, &res, opt(w), opt(b), &h, rows, n, eps, false, "add_layer_norm");
  return {h, y};
}
std::tuple<Tensor, Tensor> add_layer_norm_cpu(const Tensor& x, const Tensor& res, const OptTensor& w,
                                              const OptTensor& b, double eps) {
  check_eps(eps, "add_layer_norm");
  auto [rows, n] = add_ln_rows(x, &res, w, b, "add_layer_norm", false);
  Tensor h = (x + res).contiguous();   // the kernel's layout, not x's (Inductor checks it against the fake's)
  return {h, ln_forward_cpu(h, opt(w), opt(b), n, eps, false)};
}
// Takes the sum h = x + residual (the forward's first output); grad_sum is the
// gradient reaching that output (None when it was not used).
std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward_cuda(const Tensor& grad, const OptTensor& grad_sum,
                                                                const Tensor& h, const OptTensor& w,
                                                                const OptTensor& b, double eps) {
  auto [rows, n] = add_ln_rows(h, nullptr, w, b, "add_layer_norm_backward", true);
  check_grads(grad, opt(grad_sum), h, "add_layer_norm_backward", true, "sum");
  return ln_backward_cuda(grad, opt(grad_sum), h, opt(w), opt(b), rows, n, eps, false, "add_layer_norm_backward");
}
std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward_cpu(const Tensor& grad, const OptTensor& grad_sum,
                                                               const Tensor& h, const OptTensor& w,
                                                               const OptTensor& b, double eps) {
  auto [rows, n] = add_ln_rows(h, nullptr, w, b, "add_layer_norm_backward", false);
  check_grads(grad, opt(grad_sum), h, "add_layer_norm_backward", false, "sum");
  return ln_backward_cpu(grad, opt(grad_sum), h, opt(w), opt(b), n, eps, false);
}

using LnBwdTuple = std::tuple<Tensor, Tensor, Tensor>;

struct LayerNormReluFn : torch::autograd::Function<LayerNormReluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::vector<int64_t> shape, const Tensor& w,
                        const Tensor& b, int64_t present, double eps) {
    static auto op = op_handle<Tensor(const Tensor&, c10::IntArrayRef, const OptTensor&, const OptTensor&, double)>(
        "kitsune::layer_norm_relu");
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["present"] = present;
    ctx->save_for_backward({x, w, b});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, shape, opt_if(w, present, 1), opt_if(b, present, 2), eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<LnBwdTuple(const Tensor&, const Tensor&, c10::IntArrayRef, const OptTensor&,
                                          const OptTensor&, double)>("kitsune::layer_norm_relu_backward");
    auto s = ctx->get_saved_variables();
    auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t p = ctx->saved_data["present"].toInt();
    auto [gx, gw, gb] = op.call(go[0], s[0], shape, opt_if(s[1], p, 1), opt_if(s[2], p, 2),
                                ctx->saved_data["eps"].toDouble());
    return {gx, Tensor(), grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor()};
  }
};

// add_layer_norm: (h, y) = (x + residual, layer_norm(h)); h is saved (it is an output).
struct AddLayerNormFn : torch::autograd::Function<AddLayerNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                               const Tensor& b, int64_t present, double eps) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                          const OptTensor&, double)>("kitsune::add_layer_norm");
    Tensor h, y;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(h, y) = op.call(x, r, opt_if(w, present, 1), opt_if(b, present, 2), eps);
    }
    ctx->set_materialize_grads(false);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["present"] = present;
    ctx->save_for_backward({h, w, b});
    return {h, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<LnBwdTuple(const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                          const OptTensor&, double)>("kitsune::add_layer_norm_backward");
    auto s = ctx->get_saved_variables();
    const Tensor& h = s[0];
    if (!go[1].defined() && !go[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    Tensor gy = go[1].defined() ? go[1] : at::zeros_like(h);
    const int64_t p = ctx->saved_data["present"].toInt();
    OptTensor gs = go[0].defined() ? OptTensor(go[0]) : OptTensor();
    auto [gh, gw, gb] = op.call(gy, gs, h, opt_if(s[1], p, 1), opt_if(s[2], p, 2), ctx->saved_data["eps"].toDouble());
    return {gh, gh, grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor()};
  }
};

Tensor layer_norm_relu_autograd(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                                double eps) {
  return LayerNormReluFn::apply(x, shape.vec(), placeholder_if_absent(w, x), placeholder_if_absent(b, x),
                                present_bits(w, b), eps);
}
std::tuple<Tensor, Tensor> add_layer_norm_autograd(const Tensor& x, const Tensor& r, const OptTensor& w,
                                                   const OptTensor& b, double eps) {
  auto out = AddLayerNormFn::apply(x, r, placeholder_if_absent(w, x), placeholder_if_absent(b, x), present_bits(w, b),
                                   eps);
  return {out[0], out[1]};
}

}  // namespace

#define LAYER_NORM_DEVICE_OPS(X) \
  X(layer_norm_relu)             \
  X(layer_norm_relu_backward)    \
  X(add_layer_norm)              \
  X(add_layer_norm_backward)
KT_DEVICE_IMPLS(LAYER_NORM_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("layer_norm_relu", &layer_norm_relu_autograd);
  m.impl("add_layer_norm", &add_layer_norm_autograd);
}

}  // namespace bridge
