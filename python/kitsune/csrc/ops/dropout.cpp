// python/kitsune/csrc/ops/dropout.cpp — the dropout family (fusion/kernels/dropout.cu,
// kitsune/ops/dropout.py): gelu_dropout, bias_dropout_add, their backwards
// (dropout_backward), and dropout_mask, the mask rebuilt on the CPU for checks.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/gelu_backward.h>

#include <mutex>

#include "../common.h"
#include "kitsune/philox.h"

namespace bridge {
namespace {

// ---- gelu_dropout, bias_dropout_add (fusion/kernels/dropout.cu) ----
// Each call draws (seed, offset) from PyTorch's default generator of the tensor's
// device (torch.manual_seed makes it repeatable) and returns them as an int64 CPU
// tensor `rng`; the mask is never stored. The backward ops and dropout_mask rebuild
// it from rng with the same Philox code (kitsune/philox.h) on either device.
std::pair<uint64_t, uint64_t> dropout_seed(const Tensor& like, const char* op) {
  if (like.is_cuda()) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    at::PhiloxCudaState st = gen->philox_cuda_state(4);
    TORCH_CHECK(!st.captured_, "kitsune.", op, ": dropout inside a CUDA graph capture is not supported yet");
    return {st.seed_.val, st.offset_.val};
  }
  auto gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return {gen->random64(), 0};
}
Tensor rng_tensor(std::pair<uint64_t, uint64_t> s) {
  Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  t.data_ptr<int64_t>()[0] = (int64_t)s.first;
  t.data_ptr<int64_t>()[1] = (int64_t)s.second;
  return t;
}
std::pair<uint64_t, uint64_t> rng_values(const Tensor& rng, const char* op) {
  TORCH_CHECK(rng.device().is_cpu() && rng.scalar_type() == at::kLong && rng.numel() == 2, "kitsune.", op,
              ": rng must be the int64 CPU tensor of 2 values the forward returned; got ", rng.scalar_type(), " ",
              rng.sizes(), " on ", rng.device());
  Tensor r = rng.contiguous();
  return {(uint64_t)r.data_ptr<int64_t>()[0], (uint64_t)r.data_ptr<int64_t>()[1]};
}
void check_p(double p, const char* op) {
  TORCH_CHECK(p >= 0 && p <= 1, "kitsune.", op, ": dropout probability p must be in [0, 1], got ", p);
}
// A forward's dropout: the effective p (0 outside training) and, when something is
// dropped, a fresh (seed, offset) from the device's generator ({0, 0} otherwise).
struct DropoutDraw { double p; std::pair<uint64_t, uint64_t> seed; };
DropoutDraw dropout_draw(const Tensor& x, double p, bool training, const char* op) {
  check_p(p, op);
  const double pe = training ? p : 0.0;
  return {pe, pe > 0 ? dropout_seed(x, op) : std::pair<uint64_t, uint64_t>{0, 0}};
}
double keep_scale(double p) { return p < 1 ? 1.0 / (1.0 - p) : 0.0; }

// The keep mask (bool, n elements) on the CPU: the reference and the check of the
// GPU's. bits: random bits an element (kitsune/philox.h, dropout_bits).
Tensor keep_mask(std::pair<uint64_t, uint64_t> s, int64_t n, double p, int bits) {
  Tensor m = at::empty({n}, at::TensorOptions().dtype(at::kBool));
  bool* d = m.data_ptr<bool>();
  const uint64_t thr = kt_dropout_threshold(p, bits);
  const int per = kt_dropout_per_block(bits);
  uint32_t ks[2 * KT_PHILOX_ROUNDS];
  kt_philox_seed_keys(s.first, ks);
  for (int64_t b = 0; b * per < n; b++) {
    uint32_t w[4];
    kt_philox_block_ks(ks, s.second, (uint64_t)b, w);
    for (int j = 0; j < per && b * per + j < n; j++) d[b * per + j] = kt_dropout_keep(w, j, bits, thr);
  }
  return m;
}
// The rule (dropout.cu's kBits): 16 bits for 2-byte elements, else 32.
int dropout_bits(at::ScalarType dt) { return c10::elementSize(dt) == 2 ? 16 : 32; }
Tensor dropout_mask(const Tensor& rng, int64_t n, double p, at::ScalarType dtype) {
  check_p(p, "dropout_mask");
  TORCH_CHECK(n >= 0, "kitsune.dropout_mask: n must be >= 0, got ", n);
  TORCH_CHECK(float_ok(dtype, false), "kitsune.dropout_mask: dtype must be the dropped tensor's floating dtype, got ",
              dtype);
  return keep_mask(rng_values(rng, "dropout_mask"), n, p, dropout_bits(dtype));
}
// mask * scale in the opmath dtype, shaped like x (x's dtype picks the mask's bits)
Tensor scaled_mask(std::pair<uint64_t, uint64_t> s, const Tensor& x, double p) {
  return keep_mask(s, x.numel(), p, dropout_bits(x.scalar_type())).view(x.sizes()).to(opmath(x)) * keep_scale(p);
}

// A backward's grad against the forward's x: one device and floating dtype, a shape
// that broadcasts to x's.
void check_grad(const Tensor& grad, const Tensor& x, const char* op, bool kernel) {
  check_floats(op, {{"x", x}, {"grad", grad}}, kernel);
  TORCH_CHECK(at::is_expandable_to(grad.sizes(), x.sizes()), "kitsune.", op, ": grad of shape ", grad.sizes(),
              " does not broadcast to x's shape ", x.sizes());
}

std::tuple<Tensor, Tensor> gelu_dropout_cuda(const Tensor& x, double p, bool training, c10::string_view approximate) {
  check_float(x, "gelu_dropout", "x", true);
  int ap = approx_code(approximate, "gelu_dropout");
  auto [pe, s] = dropout_draw(x, p, training, "gelu_dropout");
  Tensor xc = x.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  check_launch(kt_gelu_dropout(dtype_of(x, "gelu_dropout"), xc.data_ptr(), out.data_ptr(), xc.numel(), pe, s.first,
                               s.second, ap, stream_of(out)),
               "gelu_dropout");
  return {out, rng_tensor(s)};
}
std::tuple<Tensor, Tensor> gelu_dropout_cpu(const Tensor& x, double p, bool training, c10::string_view approximate) {
  check_float(x, "gelu_dropout", "x");
  approx_code(approximate, "gelu_dropout");
  auto [pe, s] = dropout_draw(x, p, training, "gelu_dropout");
  Tensor out = at::gelu(x.to(opmath(x)), approximate) * scaled_mask(s, x, pe);
  return {out.to(x.scalar_type()).contiguous(), rng_tensor(s)};   // the kernel's layout
}
Tensor gelu_dropout_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& rng, double p,
                                  c10::string_view approximate) {
  check_p(p, "gelu_dropout_backward");
  check_grad(grad, x, "gelu_dropout_backward", true);
  int ap = approx_code(approximate, "gelu_dropout_backward");
  auto s = rng_values(rng, "gelu_dropout_backward");
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor gx = at::empty_like(xc);
  check_launch(kt_gelu_dropout_backward(dtype_of(x, "gelu_dropout_backward"), gc.data_ptr(), xc.data_ptr(),
                                        gx.data_ptr(), xc.numel(), p, s.first, s.second, ap, stream_of(gx)),
               "gelu_dropout_backward");
  return gx;
}
Tensor gelu_dropout_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& rng, double p,
                                 c10::string_view approximate) {
  check_p(p, "gelu_dropout_backward");
  check_grad(grad, x, "gelu_dropout_backward", false);
  approx_code(approximate, "gelu_dropout_backward");
  auto s = rng_values(rng, "gelu_dropout_backward");
  Tensor g = grad.to(opmath(x)).expand(x.sizes()) * scaled_mask(s, x, p);
  return at::gelu_backward(g, x.to(opmath(x)), approximate).to(x.scalar_type()).contiguous();
}

void check_bias_residual(const Tensor& x, const Tensor& bias, const Tensor& residual, const char* op, bool kernel) {
  check_bias(x, bias, op, kernel);
  check_floats(op, {{"x", x}, {"residual", residual}}, kernel);
  TORCH_CHECK(residual.sizes() == x.sizes(), "kitsune.", op, ": residual must have x's shape ", x.sizes(), "; got ",
              residual.sizes());
}
std::tuple<Tensor, Tensor> bias_dropout_add_cuda(const Tensor& x, const Tensor& bias, const Tensor& residual, double p,
                                                 bool training) {
  check_bias_residual(x, bias, residual, "bias_dropout_add", true);
  auto [pe, s] = dropout_draw(x, p, training, "bias_dropout_add");
  Tensor xc = x.contiguous(), bc = bias.contiguous(), rc = residual.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  check_launch(kt_bias_dropout_add(dtype_of(x, "bias_dropout_add"), xc.data_ptr(), bc.data_ptr(), rc.data_ptr(),
                                   out.data_ptr(), xc.numel(), bc.numel(), pe, s.first, s.second, stream_of(out)),
               "bias_dropout_add");
  return {out, rng_tensor(s)};
}
std::tuple<Tensor, Tensor> bias_dropout_add_cpu(const Tensor& x, const Tensor& bias, const Tensor& residual, double p,
                                                bool training) {
  check_bias_residual(x, bias, residual, "bias_dropout_add", false);
  auto [pe, s] = dropout_draw(x, p, training, "bias_dropout_add");
  auto om = opmath(x);
  Tensor out = residual.to(om) + (x.to(om) + bias.to(om)) * scaled_mask(s, x, pe);
  return {out.to(x.scalar_type()).contiguous(), rng_tensor(s)};   // the kernel's layout
}
Tensor dropout_backward_cuda(const Tensor& grad, const Tensor& rng, double p) {
  check_p(p, "dropout_backward");
  check_float(grad, "dropout_backward", "grad", true);
  auto s = rng_values(rng, "dropout_backward");
  Tensor gc = grad.contiguous();
  c10::cuda::CUDAGuard g(grad.device());
  Tensor gx = at::empty_like(gc);
  check_launch(kt_dropout_backward(dtype_of(grad, "dropout_backward"), gc.data_ptr(), gx.data_ptr(), gc.numel(), p,
                                   s.first, s.second, stream_of(gx)),
               "dropout_backward");
  return gx;
}
Tensor dropout_backward_cpu(const Tensor& grad, const Tensor& rng, double p) {
  check_p(p, "dropout_backward");
  check_float(grad, "dropout_backward", "grad");
  auto s = rng_values(rng, "dropout_backward");
  return (grad.to(opmath(grad)) * scaled_mask(s, grad, p)).to(grad.scalar_type()).contiguous();
}

// gelu_dropout: (out, rng); the mask is rebuilt from rng in the backward.
struct GeluDropoutFn : torch::autograd::Function<GeluDropoutFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, double p, bool training, std::string approx) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, double, bool, c10::string_view)>(
        "kitsune::gelu_dropout");
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(out, rng) = op.call(x, p, training, approx);
    }
    ctx->saved_data["p"] = training ? p : 0.0;
    ctx->saved_data["approximate"] = approx;
    ctx->save_for_backward({x, rng});
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);   // else a zero-filled gradient for rng
    return {out, rng};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view)>(
        "kitsune::gelu_dropout_backward");
    auto s = ctx->get_saved_variables();
    Tensor g = go[0].defined() ? go[0] : at::zeros_like(s[0]);
    return {op.call(g, s[0], s[1], ctx->saved_data["p"].toDouble(), ctx->saved_data["approximate"].toStringRef()),
            Tensor(), Tensor(), Tensor()};
  }
};

// bias_dropout_add: out = residual + dropout(x + bias); (out, rng).
struct BiasDropoutAddFn : torch::autograd::Function<BiasDropoutAddFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const Tensor& residual,
                               double p, bool training) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, bool)>(
        "kitsune::bias_dropout_add");
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(out, rng) = op.call(x, bias, residual, p, training);
    }
    ctx->saved_data["p"] = training ? p : 0.0;
    ctx->saved_data["bias_dtype"] = (int64_t)bias.scalar_type();
    ctx->save_for_backward({rng});
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);   // else a zero-filled gradient for rng
    return {out, rng};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::dropout_backward");
    if (!go[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    Tensor gx = op.call(go[0], ctx->get_saved_variables()[0], ctx->saved_data["p"].toDouble());
    auto bdt = (at::ScalarType)ctx->saved_data["bias_dtype"].toInt();
    Tensor gb = as_rows(gx)
                    .sum(0, false, at::promote_types(gx.scalar_type(), at::kFloat))
                    .to(bdt);
    return {gx, gb, go[0], Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> gelu_dropout_autograd(const Tensor& x, double p, bool training,
                                                 c10::string_view approximate) {
  auto out = GeluDropoutFn::apply(x, p, training, std::string(approximate));
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> bias_dropout_add_autograd(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                                     double p, bool training) {
  auto out = BiasDropoutAddFn::apply(x, bias, residual, p, training);
  return {out[0], out[1]};
}

}  // namespace

#define DROPOUT_DEVICE_OPS(X) \
  X(gelu_dropout)             \
  X(gelu_dropout_backward)    \
  X(bias_dropout_add)         \
  X(dropout_backward)
KT_DEVICE_IMPLS(DROPOUT_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, CPU, m) {
  m.impl("dropout_mask", &dropout_mask);   // CPU only: rebuilds a dropout mask for checking
}

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("gelu_dropout", &gelu_dropout_autograd);
  m.impl("bias_dropout_add", &bias_dropout_add_autograd);
}

}  // namespace bridge
