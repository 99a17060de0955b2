// python/kitsune/csrc/ops/cross_entropy.cpp — the cross_entropy family
// (fusion/kernels/cross_entropy.cu, kitsune/ops/cross_entropy.py): cross_entropy, its
// backward, the loss with its gradient in one pass (cross_entropy_with_grad,
// cross_entropy_rescale_), and linear_cross_entropy (the LM head's GEMM and the loss a
// chunk of rows at a time).
#include <torch/csrc/autograd/graph_task.h>   // get_current_graph_task_keep_graph

#include "../common.h"

namespace bridge {
namespace {

// ---- cross_entropy and linear_cross_entropy (fusion/kernels/cross_entropy.cu) ----
// logits (N, C) or (C,), target (N,) or () of int64 class indices; both devices' checks
// (kernel: the CUDA kernel's dtypes).
std::pair<Tensor, Tensor> ce_views(const Tensor& logits, const Tensor& target, double smoothing, const char* op,
                                   bool kernel) {
  check_float(logits, op, "logits", kernel);
  TORCH_CHECK(logits.dim() == 1 || logits.dim() == 2, "kitsune.", op,
              ": logits must be (N, C) or (C,); got shape ", logits.sizes(), " (flatten the leading dims)");
  TORCH_CHECK(target.scalar_type() == at::kLong, "kitsune.", op, ": target must be int64 class indices; got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), "kitsune.", op, ": logits are on ", logits.device(),
              " but target is on ", target.device());
  TORCH_CHECK(target.dim() == logits.dim() - 1 && (logits.dim() == 1 || target.size(0) == logits.size(0)), "kitsune.",
              op, ": target of shape ", target.sizes(), " does not match logits of shape ", logits.sizes());
  TORCH_CHECK(smoothing >= 0 && smoothing <= 1, "kitsune.", op, ": label_smoothing must be in [0, 1], got ",
              smoothing);
  TORCH_CHECK(logits.size(-1) > 0, "kitsune.", op, ": logits have no classes");
  // The kernel takes rows a stride apart (a wide Linear's padded logits, kitsune.ops.wide_linear):
  // kept as they are when that stride is 16-byte aligned, as the vector loads need.
  Tensor l = logits.reshape({-1, logits.size(-1)});
  const bool rows_apart = kernel && l.stride(1) == 1 && l.stride(0) > l.size(1) &&
                          l.stride(0) * (int64_t)l.element_size() % 16 == 0;
  if (!rows_apart) l = l.contiguous();
  if ((uintptr_t)l.data_ptr() & 15) l = l.clone();   // the gradient's alignment must match
  return {l, target.reshape({-1}).contiguous()};
}
// The logits' gradient for the kernel: rows as far apart as the logits' (it takes one stride).
Tensor ce_grad_like(const Tensor& l) {
  if (l.stride(0) == l.size(1) || l.size(0) <= 1) return at::empty_like(l, at::MemoryFormat::Contiguous);
  return at::empty({l.size(0), l.stride(0)}, l.options()).narrow(1, 0, l.size(1));
}
// grad / (number of targets that are not ignore_index), fp32 on the device, one kernel
// and no host sync; an undefined grad means 1.
Tensor ce_scale(const Tensor& target, int64_t ignore, const Tensor& grad, const char* op) {
  Tensor sc = at::empty({1}, target.options().dtype(at::kFloat));
  Tensor g = grad.defined() ? (grad.scalar_type() == at::kDouble ? grad.to(at::kFloat) : grad).contiguous() : grad;
  check_launch(kt_cross_entropy_scale(g.defined() ? dtype_of(g, op) : KT_F32, g.defined() ? g.data_ptr() : nullptr,
                                      target.data_ptr<int64_t>(), target.numel(), ignore, sc.data_ptr<float>(),
                                      stream_of(sc)),
               op);
  return sc;
}
// The loss's dtype: the logits', or float32 for float16/bfloat16 logits with float_loss
// (under autocast, as F.cross_entropy's; the per-row losses are fp32 either way).
at::ScalarType ce_loss_dtype(const Tensor& l, bool float_loss) {
  auto dt = l.scalar_type();
  return float_loss && (dt == at::kHalf || dt == at::kBFloat16) ? at::kFloat : dt;
}
// The mean of the per-row losses over the rows not ignored, as a 0-d tensor of dtype.
Tensor ce_mean(const Tensor& losses, const Tensor& target, int64_t ignore, at::ScalarType dtype, const char* op) {
  Tensor out = at::empty({}, losses.options().dtype(dtype));
  check_launch(kt_cross_entropy_mean(dtype_of(out, op), losses.data_ptr<float>(), target.data_ptr<int64_t>(),
                                     target.numel(), ignore, out.data_ptr(), stream_of(out)),
               op);
  return out;
}

// cross_entropy_backward's grad: the loss's gradient, one element of any floating dtype
// (ce_scale reads it as fp32) on the logits' device.
void check_ce_grad(const Tensor& grad, const Tensor& logits) {
  check_float(grad, "cross_entropy_backward", "grad");
  check_devices("cross_entropy_backward", {{"logits", logits}, {"grad", grad}});
  TORCH_CHECK(grad.numel() == 1, "kitsune.cross_entropy_backward: grad must have one element (the loss is a mean); got ",
              grad.sizes());
}
// The mean loss and, with_grad, in the same pass over the logits, its gradient for an
// incoming gradient of 1 (what backward() passes; undefined without with_grad).
std::tuple<Tensor, Tensor> ce_forward_cuda(const Tensor& logits, const Tensor& target, int64_t ignore,
                                           double smoothing, bool with_grad, bool float_loss, const char* op) {
  auto [l, t] = ce_views(logits, target, smoothing, op, true);
  c10::cuda::CUDAGuard g(l.device());
  Tensor scale = with_grad ? ce_scale(t, ignore, Tensor(), op) : Tensor();
  Tensor losses = at::empty({l.size(0)}, l.options().dtype(at::kFloat));
  Tensor gl = with_grad ? ce_grad_like(l) : Tensor();
  check_launch(kt_cross_entropy(dtype_of(l, op), l.data_ptr(), t.data_ptr<int64_t>(), losses.data_ptr<float>(),
                                with_grad ? gl.data_ptr() : nullptr, with_grad ? scale.data_ptr<float>() : nullptr,
                                l.size(0), l.size(1), l.stride(0), ignore, (float)smoothing, stream_of(l)),
               op);
  return {ce_mean(losses, t, ignore, ce_loss_dtype(l, float_loss), op), with_grad ? gl.view(logits.sizes()) : Tensor()};
}
Tensor cross_entropy_cuda(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                          bool float_loss) {
  return std::get<0>(ce_forward_cuda(logits, target, ignore, smoothing, false, float_loss, "cross_entropy"));
}
// The CPU references' check of the targets (the CUDA kernels give a NaN loss instead).
void check_targets(const Tensor& t, int64_t classes, int64_t ignore, const char* op) {
  Tensor bad = (t != ignore) & ((t < 0) | (t >= classes));
  TORCH_CHECK(!bad.any().item<bool>(), "kitsune.", op, ": a target is outside [0, ", classes,
              ") and is not ignore_index ", ignore);
}
Tensor ce_reference(const Tensor& l, const Tensor& t, int64_t ignore, double smoothing) {   // per row, opmath
  Tensor lf = l.to(opmath(l));
  Tensor lsm = at::log_softmax(lf, 1);
  Tensor keep = t != ignore, tc = at::where(keep, t, at::zeros_like(t));
  Tensor nll = -lsm.gather(1, tc.unsqueeze(1)).squeeze(1);
  Tensor loss = (1 - smoothing) * nll - smoothing * lsm.mean(1);
  return at::where(keep, loss, at::zeros_like(loss));
}
Tensor cross_entropy_cpu(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                         bool float_loss) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy", false);
  check_targets(t, l.size(1), ignore, "cross_entropy");
  return (ce_reference(l, t, ignore, smoothing).sum() / (t != ignore).sum()).to(ce_loss_dtype(l, float_loss));
}
Tensor cross_entropy_backward_cuda(const Tensor& grad, const Tensor& logits, const Tensor& target, int64_t ignore,
                                   double smoothing) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_backward", true);
  check_ce_grad(grad, logits);
  c10::cuda::CUDAGuard g(l.device());
  Tensor scale = ce_scale(t, ignore, grad, "cross_entropy_backward");
  Tensor gl = ce_grad_like(l);
  check_launch(kt_cross_entropy(dtype_of(l, "cross_entropy_backward"), l.data_ptr(), t.data_ptr<int64_t>(), nullptr,
                                gl.data_ptr(), scale.data_ptr<float>(), l.size(0), l.size(1), l.stride(0), ignore,
                                (float)smoothing, stream_of(l)),
               "cross_entropy_backward");
  return gl.view(logits.sizes());
}
// cross_entropy's autograd forward takes this when the logits need a gradient, so its
// backward only rescales (cross_entropy_rescale_) and the logits need not outlive the
// forward: one kernel's two passes over the logits where the loss and the backward
// kernels made one and two.
std::tuple<Tensor, Tensor> cross_entropy_with_grad_cuda(const Tensor& logits, const Tensor& target, int64_t ignore,
                                                        double smoothing, bool float_loss) {
  return ce_forward_cuda(logits, target, ignore, smoothing, true, float_loss, "cross_entropy_with_grad");
}
// grad *= by, unless by is 1 (a one-element tensor on grad's device, read there: no
// host sync), in place.
void check_rescale(const Tensor& grad, const Tensor& by, bool kernel) {
  const char* op = "cross_entropy_rescale_";
  check_devices(op, {{"grad", grad}, {"by", by}});
  check_float(grad, op, "grad", kernel);
  check_float(by, op, "by");   // read as fp32
  TORCH_CHECK(by.numel() == 1, "kitsune.cross_entropy_rescale_: by must have one element; got shape ", by.sizes());
  TORCH_CHECK(grad.is_contiguous(), "kitsune.cross_entropy_rescale_: grad must be contiguous");
}
void cross_entropy_rescale__cuda(const Tensor& grad, const Tensor& by) {
  check_rescale(grad, by, true);
  c10::cuda::CUDAGuard g(grad.device());
  Tensor b = by.reshape({1}).to(at::kFloat);
  check_launch(kt_cross_entropy_rescale(dtype_of(grad, "cross_entropy_rescale_"), grad.data_ptr(), grad.numel(),
                                        b.data_ptr<float>(), stream_of(grad)),
               "cross_entropy_rescale_");
}
void cross_entropy_rescale__cpu(const Tensor& grad, const Tensor& by) {
  check_rescale(grad, by, false);
  Tensor(grad).mul_(by.reshape({}));   // times 1 leaves every value as it is
}
// (softmax - q) / count per row, zero on ignored rows, in opmath.
Tensor ce_grad_reference(const Tensor& l, const Tensor& t, int64_t ignore, double smoothing) {
  Tensor lf = l.to(opmath(l));
  Tensor keep = t != ignore, tc = at::where(keep, t, at::zeros_like(t));
  Tensor q = at::one_hot(tc, l.size(1)).to(lf.scalar_type()) * (1 - smoothing) + smoothing / l.size(1);
  return (at::softmax(lf, 1) - q) * keep.unsqueeze(1) / keep.sum();
}
Tensor cross_entropy_backward_cpu(const Tensor& grad, const Tensor& logits, const Tensor& target, int64_t ignore,
                                  double smoothing) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_backward", false);
  check_ce_grad(grad, logits);
  check_targets(t, l.size(1), ignore, "cross_entropy_backward");
  return (ce_grad_reference(l, t, ignore, smoothing) * grad.to(opmath(l))).to(l.scalar_type()).view(logits.sizes());
}
std::tuple<Tensor, Tensor> cross_entropy_with_grad_cpu(const Tensor& logits, const Tensor& target, int64_t ignore,
                                                       double smoothing, bool float_loss) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_with_grad", false);
  check_targets(t, l.size(1), ignore, "cross_entropy_with_grad");
  Tensor loss = (ce_reference(l, t, ignore, smoothing).sum() / (t != ignore).sum()).to(ce_loss_dtype(l, float_loss));
  return {loss, ce_grad_reference(l, t, ignore, smoothing).to(l.scalar_type()).view(logits.sizes())};
}

// linear_cross_entropy: x (..., H), weight (V, H), bias (V,) or None, target (...).
std::tuple<Tensor, Tensor> lce_views(const Tensor& x, const Tensor& w, const Tensor& target, const Tensor* bias,
                                     double smoothing, int64_t chunk, const char* op, bool kernel) {
  check_floats(op, {{"x", x}, {"weight", w}, {"bias", bias ? *bias : Tensor()}}, kernel);
  check_devices(op, {{"x", x}, {"target", target}});
  TORCH_CHECK(chunk >= 0, "kitsune.", op, ": chunk_size must be >= 0 (0 chooses), got ", chunk);
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), "kitsune.", op,
              ": weight must be (num_classes, x.size(-1) = ", x.dim() ? x.size(-1) : 0, "); got ", w.sizes(),
              " for x of shape ", x.sizes());
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "kitsune.", op, ": bias must have ", w.size(0),
                " elements (weight.size(0)); got shape ", bias->sizes());
  }
  TORCH_CHECK(target.sizes() == x.sizes().slice(0, x.dim() - 1), "kitsune.", op, ": target of shape ",
              target.sizes(), " does not match x of shape ", x.sizes(), " (one class index per row of x)");
  TORCH_CHECK(target.scalar_type() == at::kLong, "kitsune.", op, ": target must be int64 class indices; got ",
              target.scalar_type());
  TORCH_CHECK(smoothing >= 0 && smoothing <= 1, "kitsune.", op, ": label_smoothing must be in [0, 1], got ",
              smoothing);
  return {as_rows(x).contiguous(), target.reshape({-1}).contiguous()};
}
// Rows per chunk: an eighth of the rows, at least 1024 (GEMMs with fewer rows run
// well below peak, and every chunk re-reads and re-writes the grad_weight
// accumulator), a multiple of 64.
int64_t lce_chunk(int64_t rows, int64_t chunk) {
  if (chunk > 0) return chunk;
  int64_t c = std::max<int64_t>(1024, (rows + 7) / 8);
  return ((c + 63) / 64) * 64;
}
// Loss (and, with grads, d loss / d x, weight, bias) one chunk of rows at a time:
// the chunk's logits come from cuBLAS, the kernel turns them into losses and, in
// place, into the chunk's logit gradients (already divided by the count), which two
// more GEMMs turn into grad_x and the grad_weight sum.
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_cuda(const Tensor& x, const Tensor& w, const Tensor& target,
                                                    const OptTensor& bias_, int64_t ignore, double smoothing,
                                                    int64_t chunk, bool grads, bool float_loss, const char* op) {
  const Tensor* bias = opt(bias_);
  auto [x2, t] = lce_views(x, w, target, bias, smoothing, chunk, op, true);
  kt_dtype dt = dtype_of(x, op);
  c10::cuda::CUDAGuard g(x.device());
  const int64_t rows = x2.size(0), H = x2.size(1), V = w.size(0);
  Tensor wc = w.contiguous();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor losses = at::empty({rows}, fopt), inv = ce_scale(t, ignore, Tensor(), op);
  Tensor gx, gw, gb;
  if (grads) {
    gx = at::empty_like(x2);
    gw = rows ? at::empty({V, H}, w.options()) : at::zeros({V, H}, w.options());   // the first chunk writes it
    gb = bias ? at::zeros({V}, fopt) : Tensor();
  }
  // An odd number of classes (GPT-2's 50257) as a GEMM dimension keeps cuBLAS on slow
  // sm75-era kernels: the loss head measured 18.0 ms against torch.compile's 4.6 ms
  // (bench/results/kernels_loss_head_437c519.json), and 15.0 ms with only the logits'
  // row stride padded (kernels_loss_head_3828d42.json). So the classes are padded to a
  // multiple of 64 with zero weight rows (a copy of the weight per call): the padded
  // logits are 0, the kernel reads only the first V of each row and leaves the rest 0,
  // and zero gradient columns add nothing to grad_x; grad_weight's padded rows are dropped.
  const int64_t c = lce_chunk(rows, chunk), ld = (V + 63) / 64 * 64;
  if (ld != V && rows) {
    Tensor wp = at::zeros({ld, H}, wc.options());
    wp.narrow(0, 0, V).copy_(wc);
    wc = wp;
  }
  Tensor bp = bias && ld != V ? at::cat({*bias, at::zeros({ld - V}, bias->options())}) : bias ? *bias : Tensor();
  if (grads && ld != V) gw = rows ? at::empty({ld, H}, w.options()) : gw;
  Tensor buf = rows ? at::empty({std::min(c, rows), ld}, x.options()) : Tensor();
  for (int64_t r0 = 0; r0 < rows; r0 += c) {
    const int64_t n = std::min(c, rows - r0);
    Tensor xc = x2.narrow(0, r0, n);
    Tensor full = buf.narrow(0, 0, n);   // n x ld, contiguous
    if (bias) at::addmm_out(full, bp, xc, wc.t());
    else at::mm_out(full, xc, wc.t());
    Tensor logits = full;   // the GEMMs below see all ld columns (padding: zero gradients)
    check_launch(kt_cross_entropy(dt, logits.data_ptr(), t.data_ptr<int64_t>() + r0, losses.data_ptr<float>() + r0,
                                  grads ? logits.data_ptr() : nullptr, inv.data_ptr<float>(), n, V, ld, ignore,
                                  (float)smoothing, stream_of(logits)),
                 op);
    if (!grads) continue;
    Tensor gxc = gx.narrow(0, r0, n);
    at::mm_out(gxc, logits, wc);
    // grad_weight accumulates in the weight's dtype through the GEMM's beta = 1: each
    // chunk's product is summed in fp32 and added with one rounding (at most 8 by
    // default). An fp32 accumulator would cost twice the weight's memory (2 GiB for a
    // LLaMA-3-sized head: more than the logits it saves).
    if (r0 == 0) at::mm_out(gw, logits.t(), xc);
    else gw.addmm_(logits.t(), xc);
    if (bias) gb.add_(logits.narrow(1, 0, V).sum(0, false, at::kFloat));
  }
  if (grads && ld != V && rows) gw = gw.narrow(0, 0, V);   // the first V rows: contiguous
  Tensor loss = ce_mean(losses, t, ignore, ce_loss_dtype(x, float_loss), op);
  if (!grads) return {loss, Tensor(), Tensor(), Tensor()};
  return {loss, gx.view(x.sizes()), gw,
          bias ? gb.to(bias->scalar_type()) : at::empty({0}, x.options())};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_cpu(const Tensor& x, const Tensor& w, const Tensor& target,
                                                   const OptTensor& bias_, int64_t ignore, double smoothing,
                                                   int64_t chunk, bool grads, bool float_loss, const char* op) {
  const Tensor* bias = opt(bias_);
  auto [x2, t] = lce_views(x, w, target, bias, smoothing, chunk, op, false);
  check_targets(t, w.size(0), ignore, op);
  auto om = opmath(x);
  Tensor xf = x2.to(om), wf = w.to(om);
  Tensor logits = at::mm(xf, wf.t());
  if (bias) logits = logits + bias->to(om);
  Tensor loss =
      (ce_reference(logits, t, ignore, smoothing).sum() / (t != ignore).sum()).to(ce_loss_dtype(x, float_loss));
  if (!grads) return {loss, Tensor(), Tensor(), Tensor()};
  Tensor gl = ce_grad_reference(logits, t, ignore, smoothing);
  return {loss, at::mm(gl, wf).view(x.sizes()).to(x.scalar_type()), at::mm(gl.t(), xf).to(w.scalar_type()),
          bias ? gl.sum(0).to(bias->scalar_type()) : at::empty({0}, x.options())};
}
Tensor linear_cross_entropy_cuda(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                 int64_t ignore, double smoothing, int64_t chunk, bool float_loss) {
  return std::get<0>(
      lce_cuda(x, w, target, bias, ignore, smoothing, chunk, false, float_loss, "linear_cross_entropy"));
}
Tensor linear_cross_entropy_cpu(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                int64_t ignore, double smoothing, int64_t chunk, bool float_loss) {
  return std::get<0>(lce_cpu(x, w, target, bias, ignore, smoothing, chunk, false, float_loss, "linear_cross_entropy"));
}
std::tuple<Tensor, Tensor, Tensor, Tensor> linear_cross_entropy_grads_cuda(const Tensor& x, const Tensor& w,
                                                                           const Tensor& target, const OptTensor& bias,
                                                                           int64_t ignore, double smoothing,
                                                                           int64_t chunk, bool float_loss) {
  return lce_cuda(x, w, target, bias, ignore, smoothing, chunk, true, float_loss, "linear_cross_entropy_grads");
}
std::tuple<Tensor, Tensor, Tensor, Tensor> linear_cross_entropy_grads_cpu(const Tensor& x, const Tensor& w,
                                                                          const Tensor& target, const OptTensor& bias,
                                                                          int64_t ignore, double smoothing,
                                                                          int64_t chunk, bool float_loss) {
  return lce_cpu(x, w, target, bias, ignore, smoothing, chunk, true, float_loss, "linear_cross_entropy_grads");
}

// cross_entropy. When the logits need a gradient, the forward forms it
// (cross_entropy_with_grad: the gradient for an incoming 1) and keeps it instead of
// the logits; the backward scales it by the incoming gradient in place
// (cross_entropy_rescale_, which writes nothing when that is 1), or, when the graph is
// kept for another backward, into a new tensor. Without a gradient to form (no grad
// mode, or logits that need none) the forward computes the loss alone and keeps the
// logits, and a backward goes through cross_entropy_backward.
struct CrossEntropyFn : torch::autograd::Function<CrossEntropyFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, int64_t ignore,
                        double smoothing, bool float_loss, bool form_grad) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, int64_t, double, bool)>("kitsune::cross_entropy");
    static auto with_grad = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, double, bool)>(
        "kitsune::cross_entropy_with_grad");
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["smoothing"] = smoothing;
    at::AutoDispatchBelowADInplaceOrView g;
    if (form_grad) {
      auto [loss, grad] = with_grad.call(logits, target, ignore, smoothing, float_loss);
      ctx->save_for_backward({grad});   // one saved tensor: the backward knows the gradient was formed
      return loss;
    }
    ctx->save_for_backward({logits, target});
    return op.call(logits, target, ignore, smoothing, float_loss);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, double)>(
        "kitsune::cross_entropy_backward");
    static auto rescale = op_handle<void(const Tensor&, const Tensor&)>("kitsune::cross_entropy_rescale_");
    auto s = ctx->get_saved_variables();
    // A backward that builds a graph (create_graph=True: grad mode is on here) would
    // differentiate a gradient formed in the forward as a constant: its second
    // derivative with respect to the logits would come out silently missing.
    TORCH_CHECK(s.size() == 2 || !at::GradMode::is_enabled(),
                "kitsune.cross_entropy has no double backward: its gradient is formed in the forward, so a backward "
                "with create_graph=True would treat it as a constant. For higher-order gradients use "
                "F.cross_entropy (compile_step(..., fuse_loss=False); outside kitsune.optimize's model)");
    Tensor grad;
    if (s.size() == 2) {   // logits and target: the loss alone was formed
      grad = op.call(go[0], s[0], s[1], ctx->saved_data["ignore"].toInt(), ctx->saved_data["smoothing"].toDouble());
    } else if (torch::autograd::get_current_graph_task_keep_graph()) {
      grad = s[0] * go[0];   // the saved gradient serves the next backward too
    } else {
      grad = s[0];   // released after this backward: ours to scale
      Tensor span = grad;
      if (!grad.is_contiguous()) {   // rows apart (ce_grad_like): the span over them is this buffer's too
        const int64_t c = grad.size(-1), rows = grad.numel() / c, ld = grad.stride(-2);
        span = grad.as_strided({(rows - 1) * ld + c}, {1});
      }
      rescale.call(span, go[0]);
    }
    return {grad, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor cross_entropy_autograd(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                              bool float_loss) {
  return CrossEntropyFn::apply(logits, target, ignore, smoothing, float_loss,
                               at::GradMode::is_enabled() && logits.requires_grad());
}

}  // namespace

#define CROSS_ENTROPY_DEVICE_OPS(X) \
  X(cross_entropy)                  \
  X(cross_entropy_backward)         \
  X(cross_entropy_with_grad)        \
  X(cross_entropy_rescale_)         \
  X(linear_cross_entropy)           \
  X(linear_cross_entropy_grads)
KT_DEVICE_IMPLS(CROSS_ENTROPY_DEVICE_OPS)

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("cross_entropy", &cross_entropy_autograd); }

}  // namespace bridge
