// python/kitsune/csrc/autocast.cpp — the ops' Autocast kernels (AutocastCUDA and
// AutocastCPU), for every family at once: they cast, then call the op again below the
// Autocast key.
#include <ATen/autocast_mode.h>

#include "common.h"

namespace bridge {
namespace {

// ---- autocast: torch.autocast regions ----
// Under autocast a Linear's output is bf16/fp16 while norm weights and biases stay
// fp32, which the kernels (one dtype per call) would refuse. These Autocast-key
// kernels cast, above autograd (so the casts are differentiable):
//   binary ops: both operands to their promoted dtype;
//   ops with parameters: the parameters (and a residual) to the activation's dtype;
//   linear_act: x, weight and bias to the autocast dtype (as F.linear);
//   linear_cross_entropy: x, weight and bias to the autocast dtype (as F.linear
//   would), the loss returned in fp32 (float_loss: the fp32 mean, as
//   F.cross_entropy's is under autocast).
//   cross_entropy: no cast (its kernel reads 16-bit logits in fp32 arithmetic), the
//   loss returned in fp32 (float_loss), as F.cross_entropy's under autocast.
// sum_squared and mean_abs take one floating tensor and need no cast;
// attention_score is composite and its baddbmm is cast by autocast itself.
template <c10::DispatchKey Key> struct Autocast {
  static Tensor cast(const Tensor& t, at::ScalarType dt) { return t.defined() && t.scalar_type() != dt ? t.to(dt) : t; }
  static OptTensor cast(const OptTensor& t, at::ScalarType dt) {
    return t && t->defined() ? OptTensor(cast(*t, dt)) : t;
  }
  template <const char* Name> static Tensor binary(const Tensor& a, const Tensor& b) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<BinarySig>(Name);
    auto dt = at::result_type(a, b);
    return op.call(cast(a, dt), cast(b, dt));
  }
  static Tensor bias_gelu(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
    return op.call(x, cast(bias, x.scalar_type()), approximate);
  }
  static Tensor channel_bias(const Tensor& y, const Tensor& bias, c10::string_view act) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::channel_bias");
    return op.call(y, cast(bias, y.scalar_type()), act);
  }
  static Tensor bias_relu_pool(const Tensor& y, const Tensor& bias, c10::IntArrayRef k) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::IntArrayRef)>("kitsune::bias_relu_pool");
    return op.call(y, cast(bias, y.scalar_type()), k);
  }
  static Tensor bias_cat(at::TensorList xs, at::TensorList bs, int64_t dim) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(at::TensorList, at::TensorList, int64_t)>("kitsune::bias_cat");
    std::vector<Tensor> bc;
    for (size_t i = 0; i < bs.size(); i++) bc.push_back(i < xs.size() ? cast(bs[i], xs[i].scalar_type()) : bs[i]);
    return op.call(xs, bc, dim);
  }
  static Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::rms_norm");
    return op.call(x, cast(w, x.scalar_type()), eps);
  }
  static Tensor layer_norm_relu(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                                double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, c10::IntArrayRef, const OptTensor&, const OptTensor&, double)>(
        "kitsune::layer_norm_relu");
    return op.call(x, shape, cast(w, x.scalar_type()), cast(b, x.scalar_type()), eps);
  }
  static std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const OptTensor& w,
                                                   const OptTensor& b, double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                          const OptTensor&, double)>("kitsune::add_layer_norm");
    auto dt = at::result_type(x, r);
    return op.call(cast(x, dt), cast(r, dt), cast(w, dt), cast(b, dt), eps);
  }
  static Tensor linear_act(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, c10::string_view)>(
        "kitsune::linear_act");
    auto dt = at::autocast::get_autocast_dtype(Key == c10::DispatchKey::AutocastCUDA ? at::kCUDA : at::kCPU);
    return op.call(cast(x, dt), cast(w, dt), cast(b, dt), act);   // as F.linear under autocast
  }
  static Tensor linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                     int64_t ignore, double smoothing, int64_t chunk, bool) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, double,
                                      int64_t, bool)>("kitsune::linear_cross_entropy");
    auto dt = at::autocast::get_autocast_dtype(Key == c10::DispatchKey::AutocastCUDA ? at::kCUDA : at::kCPU);
    return op.call(cast(x, dt), cast(w, dt), target, cast(bias, dt), ignore, smoothing, chunk, true);
  }
  static Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing, bool) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, int64_t, double, bool)>("kitsune::cross_entropy");
    return op.call(logits, target, ignore, smoothing, true);
  }
};
constexpr char kAddRelu[] = "kitsune::add_relu", kMulTanh[] = "kitsune::mul_tanh", kSwiglu[] = "kitsune::swiglu";

}  // namespace

#define KT_AUTOCAST_IMPLS(KEY)                                                          \
  TORCH_LIBRARY_IMPL(kitsune, KEY, m) {                                                  \
    using A = Autocast<c10::DispatchKey::KEY>;                                           \
    m.impl("add_relu", &A::binary<kAddRelu>);                                            \
    m.impl("mul_tanh", &A::binary<kMulTanh>);                                            \
    m.impl("swiglu", &A::binary<kSwiglu>);                                               \
    m.impl("bias_gelu", &A::bias_gelu);                                                  \
    m.impl("channel_bias", &A::channel_bias);                                            \
    m.impl("bias_relu_pool", &A::bias_relu_pool);                                        \
    m.impl("bias_cat", &A::bias_cat);                                                    \
    m.impl("rms_norm", &A::rms_norm);                                                    \
    m.impl("layer_norm_relu", &A::layer_norm_relu);                                      \
    m.impl("add_layer_norm", &A::add_layer_norm);                                        \
    m.impl("linear_cross_entropy", &A::linear_cross_entropy);                            \
    m.impl("cross_entropy", &A::cross_entropy);                                          \
    m.impl("linear_act", &A::linear_act);                                                \
  }
KT_AUTOCAST_IMPLS(AutocastCUDA)
KT_AUTOCAST_IMPLS(AutocastCPU)

}  // namespace bridge
