// python/kitsune/csrc/ops/optim.cpp — the optim family (fusion/kernels/optim.cu; used by
// kitsune.optim's KitsuneOptimizer): fused Adam/AdamW and SGD steps over lists of
// tensors (adam_, sgd_), their capturable forms (adam_capturable_, sgd_capturable_),
// a torch.optim Adam step with its step counts (adam_step_), and optim_fusable. The
// per-element math is kitsune/optim_math.h's, shared by the kernels and the CPU
// references here.
#include "../common.h"
#include "kitsune/optim_math.h"

namespace bridge {
namespace {

// ---- fused optimizer steps: adam_, sgd_ (fusion/kernels/optim.cu) ----
// In place over lists of parameters, gradients and states, all of one device and
// dtype (kitsune.optim groups them), each dense in memory: a parameter contiguous, or
// dense in another layout (a channels-last convolution weight) with its gradient and
// states in the same strides, so that element i in memory is the same element of
// all of them. CUDA: the multi-tensor kernel; CPU:
// the same per-element code (kitsune/optim_math.h), in double for fp64.
// A parameter the flat kernels can take: contiguous, or dense in another layout.
bool dense(const Tensor& p) { return p.is_non_overlapping_and_dense(); }
// t lies in memory as p does: p's shape, and both contiguous or both in one set of
// strides, dense. (Another shape of p's size was taken once: a (3, 4) gradient then
// updated a (4, 3) parameter element by element in memory, where torch.optim refuses.)
bool laid_out_as(const Tensor& t, const Tensor& p) {
  if (t.sizes() != p.sizes()) return false;
  return (t.is_contiguous() && p.is_contiguous()) || (t.strides() == p.strides() && dense(p));
}
// list[i] of an optimizer's lists must match params[i]: device, dtype, size, layout.
void check_entry(const char* op, const char* name, size_t i, const Tensor& t, const Tensor& p) {
  TORCH_CHECK(t.device() == p.device() && t.scalar_type() == p.scalar_type() && laid_out_as(t, p), "kitsune.", op, ": ",
              name, "[", i, "] must be a ", p.scalar_type(), " tensor on ", p.device(), " laid out as params[", i,
              "] (", p.sizes(), ", strides ", p.strides(), "); got ", t.scalar_type(), " ", t.sizes(), ", strides ",
              t.strides(), " on ", t.device());
}
void check_sizes(const char* op, at::TensorList params, std::initializer_list<std::pair<const char*, at::TensorList>> rest) {
  for (const auto& [name, list] : rest)
    TORCH_CHECK(list.size() == params.size(), "kitsune.", op, ": ", name, " has ", list.size(), " tensors but params has ",
                params.size());
}
// A parameter's dtype: the kernels' on CUDA, and float64 too on the CPU.
void check_param(const char* op, size_t i, const Tensor& p) {
  check_float(p, op, ("params[" + std::to_string(i) + "]").c_str(), p.is_cuda());
}
void check_lists(const char* op, at::TensorList params, std::initializer_list<std::pair<const char*, at::TensorList>> rest) {
  check_sizes(op, params, rest);
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor& p = params[i];
    check_param(op, i, p);
    TORCH_CHECK(dense(p), "kitsune.", op, ": params[", i, "] is not dense in memory (strides ", p.strides(), ")");
    TORCH_CHECK(p.device() == params[0].device() && p.scalar_type() == params[0].scalar_type(), "kitsune.", op,
                ": params[", i, "] is ", p.scalar_type(), " on ", p.device(), " but params[0] is ",
                params[0].scalar_type(), " on ", params[0].device(), " (one dtype and device a call)");
    for (const auto& [name, list] : rest) check_entry(op, name, i, list[i], p);
  }
}
kt::AdamArgs adam_args(double lr, double beta1, double beta2, double eps, double wd, bool decoupled, double step,
                       const char* op) {
  TORCH_CHECK(step >= 1, "kitsune.", op, ": step must be >= 1 (the count after this update), got ", step);
  TORCH_CHECK(lr >= 0 && eps >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "kitsune.", op,
              ": need lr >= 0, eps >= 0 and betas in [0, 1); got lr ", lr, " eps ", eps, " betas (", beta1, ", ", beta2,
              ")");
  kt::AdamArgs a{lr, beta1, beta2, eps, wd, 0, 0, decoupled ? 1 : 0, nullptr, nullptr};
  return kt::adam_coefficients(a, lr, step);
}
template <typename S, typename F> void adam_cpu_one(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                                                    const kt::AdamArgs& a) {
  S *pp = p.data_ptr<S>(), *mp = m.data_ptr<S>(), *vp = v.data_ptr<S>();
  const S* gp = g.data_ptr<S>();
  for (int64_t i = 0; i < p.numel(); i++) {
    F w = static_cast<F>(pp[i]), mm = static_cast<F>(mp[i]), vv = static_cast<F>(vp[i]);
    kt::adam_elem<F>(w, mm, vv, static_cast<F>(gp[i]), a);
    pp[i] = static_cast<S>(w), mp[i] = static_cast<S>(mm), vp[i] = static_cast<S>(vv);
  }
}
template <typename S, typename F> void sgd_cpu_one(const Tensor& p, const Tensor& g, const Tensor* buf,
                                                   const kt::SgdArgs& a) {
  S* pp = p.data_ptr<S>();
  S* bp = buf ? buf->data_ptr<S>() : nullptr;
  const S* gp = g.data_ptr<S>();
  for (int64_t i = 0; i < p.numel(); i++) {
    F w = static_cast<F>(pp[i]), b = bp ? static_cast<F>(bp[i]) : F(0);
    kt::sgd_elem<F>(w, b, static_cast<F>(gp[i]), a);
    pp[i] = static_cast<S>(w);
    if (bp) bp[i] = static_cast<S>(b);
  }
}
#define KT_OPT_CPU_DISPATCH(dt, FN, ...)                                                  \
  switch (dt) {                                                                           \
    case at::kDouble: FN<double, double>(__VA_ARGS__); break;                             \
    case at::kFloat: FN<float, float>(__VA_ARGS__); break;                                \
    case at::kHalf: FN<c10::Half, float>(__VA_ARGS__); break;                             \
    case at::kBFloat16: FN<c10::BFloat16, float>(__VA_ARGS__); break;                     \
    default: TORCH_CHECK(false, "kitsune: dtype ", dt, " is not supported by the fused optimizer"); \
  }

// The CUDA launches of adam_ / sgd_ and their capturable forms (lists checked).
void launch_adam(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, const kt::AdamArgs& a) {
  std::vector<void*> pp, gp, mp, vp;
  std::vector<int64_t> n;
  for (size_t i = 0; i < params.size(); i++) {
    pp.push_back(params[i].data_ptr()), gp.push_back(grads[i].data_ptr()), mp.push_back(m[i].data_ptr());
    vp.push_back(v[i].data_ptr()), n.push_back(params[i].numel());
  }
  c10::cuda::CUDAGuard g(params[0].device());
  check_launch(kt_adam_multi(dtype_of(params[0], "adam_"), (int)pp.size(), pp.data(), gp.data(), mp.data(), vp.data(),
                             n.data(), &a, stream_of(params[0])),
               "adam_");
}
void launch_sgd(at::TensorList params, at::TensorList grads, at::TensorList bufs, const kt::SgdArgs& a) {
  std::vector<void*> pp, gp, bp;
  std::vector<int64_t> n;
  for (size_t i = 0; i < params.size(); i++) {
    pp.push_back(params[i].data_ptr()), gp.push_back(grads[i].data_ptr()), n.push_back(params[i].numel());
    bp.push_back(a.momentum != 0 ? bufs[i].data_ptr() : nullptr);
  }
  c10::cuda::CUDAGuard g(params[0].device());
  check_launch(kt_sgd_multi(dtype_of(params[0], "sgd_"), (int)pp.size(), pp.data(), gp.data(), bp.data(), n.data(), &a,
                            stream_of(params[0])),
               "sgd_");
}
void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, double lr, double beta1,
              double beta2, double eps, double wd, bool decoupled, double step) {
  check_lists("adam_", params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  auto a = adam_args(lr, beta1, beta2, eps, wd, decoupled, step, "adam_");
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), adam_cpu_one, params[i], grads[i], m[i], v[i], a);
}
void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, double lr, double beta1,
               double beta2, double eps, double wd, bool decoupled, double step) {
  check_lists("adam_", params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  auto a = adam_args(lr, beta1, beta2, eps, wd, decoupled, step, "adam_");
  if (!params.empty()) launch_adam(params, grads, m, v, a);
}
// Whether every parameter is dense, of a dtype the step takes (fp64 on the CPU only),
// and its gradient of its dtype and device and laid out as it is (what adam_ / sgd_
// take); KitsuneOptimizer asks before it changes anything, else it falls back to
// torch.optim.
bool optim_fusable(at::TensorList params, at::TensorList grads) {
  TORCH_CHECK(params.size() == grads.size(), "kitsune.optim_fusable: ", params.size(), " params but ", grads.size(),
              " grads");
  for (size_t i = 0; i < params.size(); i++)
    if (params[i].is_sparse() || grads[i].is_sparse() || !dense(params[i]) || !laid_out_as(grads[i], params[i]) ||
        !float_ok(params[i].scalar_type(), params[i].is_cuda()) || grads[i].scalar_type() != params[i].scalar_type() ||
        grads[i].device() != params[i].device())
      return false;
  return true;
}
// Adds 1 to a torch.optim "step" state (a one-element tensor) and returns the new
// count: in place through the pointer for a CPU float or double (torch.optim's
// default), else with add_ and a read (a device scalar: one sync).
double bump_step(const Tensor& s) {
  if (s.is_cpu() && s.scalar_type() == at::kFloat) return *s.data_ptr<float>() += 1.f;
  if (s.is_cpu() && s.scalar_type() == at::kDouble) return *s.data_ptr<double>() += 1.0;
  s.add_(1);
  return s.item<double>();
}
// One torch.optim Adam / AdamW step over a parameter group: each state_steps entry is
// incremented (as torch.optim's foreach path does), then one adam_ call per (device,
// dtype, step count), in first-seen order. The Python loop this replaces (a float()
// of every step tensor, a foreach add over CPU scalars, the bucketing) took about
// 0.6 ms of host time for GPT-2's 148 tensors.
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
               at::TensorList steps, double lr, double beta1, double beta2, double eps, double wd, bool decoupled) {
  // everything adam_ checks (but one dtype a call: the buckets make that so), checked
  // before any step count is changed
  const char* op = "adam_step_";
  check_sizes(op, params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}, {"state_steps", steps}});
  adam_args(lr, beta1, beta2, eps, wd, decoupled, 1.0, op);
  for (size_t i = 0; i < params.size(); i++) {
    TORCH_CHECK(steps[i].numel() == 1, "kitsune.adam_step_: state_steps[", i, "] must have one element; got ",
                steps[i].sizes());
    check_float(steps[i], op, ("state_steps[" + std::to_string(i) + "]").c_str());
    TORCH_CHECK(steps[i].device().is_cpu() || steps[i].device() == params[i].device(), "kitsune.adam_step_: state_steps[",
                i, "] is on ", steps[i].device(), "; it must be on the CPU or on params[", i, "]'s ", params[i].device());
    check_param(op, i, params[i]);
    TORCH_CHECK(dense(params[i]), "kitsune.adam_step_: params[", i, "] is not dense in memory (strides ",
                params[i].strides(), ")");
    check_entry(op, "grads", i, grads[i], params[i]);
    check_entry(op, "exp_avgs", i, m[i], params[i]);
    check_entry(op, "exp_avg_sqs", i, v[i], params[i]);
  }
  static auto adam = op_handle<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double, double,
                                    double, double, double, bool, double)>("kitsune::adam_");
  struct Bucket {
    c10::Device dev;
    at::ScalarType dt;
    double step;
    std::vector<Tensor> p, g, m, v;
  };
  std::vector<Bucket> buckets;
  for (size_t i = 0; i < params.size(); i++) {
    const double step = bump_step(steps[i]);
    const Tensor& p = params[i];
    auto b = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) {
      return b.dev == p.device() && b.dt == p.scalar_type() && b.step == step;
    });
    if (b == buckets.end()) b = buckets.insert(buckets.end(), Bucket{p.device(), p.scalar_type(), step, {}, {}, {}, {}});
    b->p.push_back(p), b->g.push_back(grads[i]), b->m.push_back(m[i]), b->v.push_back(v[i]);
  }
  for (const Bucket& b : buckets) adam.call(b.p, b.g, b.m, b.v, lr, beta1, beta2, eps, wd, decoupled, b.step);
}
kt::SgdArgs sgd_args(double lr, double momentum, double dampening, double wd, bool nesterov, bool first,
                     const char* op) {
  TORCH_CHECK(lr >= 0 && momentum >= 0, "kitsune.", op, ": need lr >= 0 and momentum >= 0; got lr ", lr, " momentum ",
              momentum);
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), "kitsune.", op,
              ": nesterov needs momentum > 0 and dampening 0");
  return {lr, momentum, dampening, wd, nesterov ? 1 : 0, first ? 1 : 0, nullptr, nullptr};
}
void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, double lr, double momentum,
             double dampening, double wd, bool nesterov, bool first) {
  auto a = sgd_args(lr, momentum, dampening, wd, nesterov, first, "sgd_");
  if (momentum != 0) check_lists("sgd_", params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists("sgd_", params, {{"grads", grads}});
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor* b = momentum != 0 ? &bufs[i] : nullptr;
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), sgd_cpu_one, params[i], grads[i], b, a);
  }
}
void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, double lr, double momentum,
              double dampening, double wd, bool nesterov, bool first) {
  auto a = sgd_args(lr, momentum, dampening, wd, nesterov, first, "sgd_");
  if (momentum != 0) check_lists("sgd_", params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists("sgd_", params, {{"grads", grads}});
  if (!params.empty()) launch_sgd(params, grads, bufs, a);
}

// adam_capturable_ / sgd_capturable_: the same updates with the learning rate and
// (Adam) step count in `hyper`, a float64 tensor on the parameters' device ({lr, step}
// for Adam, {lr} for SGD), read when the update runs, so a CUDA graph that captured the
// call follows an LR scheduler and counts its steps on replay. Adam adds 1 to hyper[1]
// first (on the stream, captured with the rest) unless count_step is false: a step
// that updates a group's parameters in several calls (several dtypes, or buckets
// during the backward) counts in the first only, and the others must be ordered after
// it. SGD's momentum buffers must exist. found_inf (optional; torch.amp's inf check, a
// one-element float32 tensor on the parameters' device, 0 or 1) makes the update
// conditional, read when it runs: where it is not 0 nothing changes, and Adam's step
// count moves on by 1 - found_inf, as GradScaler skips the whole optimizer step.
const float* skip_flag(const std::optional<Tensor>& found_inf, const Tensor& p0, const char* op) {
  if (!found_inf.has_value() || !found_inf->defined()) return nullptr;
  const Tensor& f = *found_inf;
  TORCH_CHECK(f.scalar_type() == at::kFloat && f.numel() == 1 && f.device() == p0.device(), "kitsune.", op,
              ": found_inf must be a one-element float32 tensor on ", p0.device(), "; got ", f.scalar_type(), " ",
              f.sizes(), " on ", f.device());
  return f.data_ptr<float>();
}
bool skipped_now(const float* skip) { return skip && *skip != 0.f; }   // the CPU path: read at once
void check_hyper(const Tensor& hyper, const Tensor& p0, int64_t n, const char* op) {
  TORCH_CHECK(hyper.scalar_type() == at::kDouble && hyper.dim() == 1 && hyper.numel() == n && hyper.is_contiguous() &&
                  hyper.device() == p0.device(),
              "kitsune.", op, ": hyper must be a contiguous float64 tensor of ", n, " elements on ", p0.device(),
              "; got ", hyper.scalar_type(), " ", hyper.sizes(), " on ", hyper.device());
}
kt::AdamArgs adam_capturable_args(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
                                  Tensor& hyper, double beta1, double beta2, double eps, double wd, bool decoupled,
                                  bool count_step, const std::optional<Tensor>& found_inf) {
  const char* op = "adam_capturable_";
  check_lists(op, params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  kt::AdamArgs a = adam_args(0.0, beta1, beta2, eps, wd, decoupled, 1.0, op);
  if (params.empty()) return a;
  check_hyper(hyper, params[0], 2, op);
  a.skip = skip_flag(found_inf, params[0], op);
  if (count_step) {
    Tensor count = hyper.narrow(0, 1, 1);
    if (a.skip) count.sub_(*found_inf).add_(1);   // exact: found_inf is 0 or 1, the count an integer
    else count.add_(1);
  }
  a.dev = hyper.data_ptr<double>();
  return a;
}
void adam_capturable_cpu(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, Tensor hyper,
                         double beta1, double beta2, double eps, double wd, bool decoupled, bool count_step,
                         const std::optional<Tensor>& found_inf) {
  const kt::AdamArgs a = kt::resolve(
      adam_capturable_args(params, grads, m, v, hyper, beta1, beta2, eps, wd, decoupled, count_step, found_inf));
  if (skipped_now(a.skip)) return;
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), adam_cpu_one, params[i], grads[i], m[i], v[i], a);
}
void adam_capturable_cuda(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
                          Tensor hyper, double beta1, double beta2, double eps, double wd, bool decoupled,
                          bool count_step, const std::optional<Tensor>& found_inf) {
  const kt::AdamArgs a =
      adam_capturable_args(params, grads, m, v, hyper, beta1, beta2, eps, wd, decoupled, count_step, found_inf);
  if (params.empty()) return;
  launch_adam(params, grads, m, v, a);
}
kt::SgdArgs sgd_capturable_args(at::TensorList params, at::TensorList grads, at::TensorList bufs, const Tensor& hyper,
                                double momentum, double dampening, double wd, bool nesterov,
                                const std::optional<Tensor>& found_inf) {
  const char* op = "sgd_capturable_";
  kt::SgdArgs a = sgd_args(0.0, momentum, dampening, wd, nesterov, false, op);
  if (momentum != 0) check_lists(op, params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists(op, params, {{"grads", grads}});
  if (!params.empty()) {
    check_hyper(hyper, params[0], 1, op);
    a.dev = hyper.data_ptr<double>();
    a.skip = skip_flag(found_inf, params[0], op);
  }
  return a;
}
void sgd_capturable_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, Tensor hyper,
                        double momentum, double dampening, double wd, bool nesterov,
                        const std::optional<Tensor>& found_inf) {
  const kt::SgdArgs a =
      kt::resolve(sgd_capturable_args(params, grads, bufs, hyper, momentum, dampening, wd, nesterov, found_inf));
  if (skipped_now(a.skip)) return;
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), sgd_cpu_one, params[i], grads[i], momentum != 0 ? &bufs[i] : nullptr, a);
}
void sgd_capturable_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, Tensor hyper,
                         double momentum, double dampening, double wd, bool nesterov,
                         const std::optional<Tensor>& found_inf) {
  const kt::SgdArgs a = sgd_capturable_args(params, grads, bufs, hyper, momentum, dampening, wd, nesterov, found_inf);
  if (!params.empty()) launch_sgd(params, grads, bufs, a);
}

// adam_ / sgd_ with every list empty have no tensor to dispatch on: the dispatcher takes
// their CompositeExplicitAutograd kernels, which check the arguments and update nothing
// (a tensor on a device other than the CPU and CUDA reaches them too, and is refused).
void no_backend(const char* op, at::TensorList params) {
  TORCH_CHECK(params.empty(), "kitsune.", op, ": params[0] is on ", params[0].device(),
              "; the fused step runs on the CPU and CUDA");
}
void adam_no_backend(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, double lr,
                     double beta1, double beta2, double eps, double wd, bool decoupled, double step) {
  check_sizes("adam_", params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  adam_args(lr, beta1, beta2, eps, wd, decoupled, step, "adam_");
  no_backend("adam_", params);
}
void sgd_no_backend(at::TensorList params, at::TensorList grads, at::TensorList bufs, double lr, double momentum,
                    double dampening, double wd, bool nesterov, bool first) {
  sgd_args(lr, momentum, dampening, wd, nesterov, first, "sgd_");
  check_sizes("sgd_", params, {{"grads", grads}});
  no_backend("sgd_", params);
}

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CUDA, m) {
  m.impl("adam_", &adam_cuda);
  m.impl("sgd_", &sgd_cuda);
  m.impl("adam_capturable_", &adam_capturable_cuda);
  m.impl("sgd_capturable_", &sgd_capturable_cuda);
}

TORCH_LIBRARY_IMPL(kitsune, CPU, m) {
  m.impl("adam_", &adam_cpu);
  m.impl("sgd_", &sgd_cpu);
  m.impl("adam_capturable_", &adam_capturable_cpu);
  m.impl("sgd_capturable_", &sgd_capturable_cpu);
}

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) {
  m.impl("adam_", &adam_no_backend);
  m.impl("sgd_", &sgd_no_backend);
  m.impl("adam_step_", &adam_step);
  m.impl("optim_fusable", &optim_fusable);
}

}  // namespace bridge
