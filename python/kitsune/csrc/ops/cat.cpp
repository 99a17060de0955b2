// python/kitsune/csrc/ops/cat.cpp — the cat family (fusion/kernels/cat.cu,
// kitsune/ops/cat.py): bias_cat, the biases of an Inception block's branches and their
// concatenation in one kernel.
#include "../common.h"

namespace bridge {
namespace {

// ---- bias_cat: torch.cat([x_i + bias_i over dim -3], dim) ----
// The branches of an Inception block: their convolutions' biases and the concatenation
// in one kernel; the backward splits the gradient into dense per-part gradients (what
// cuDNN takes; a channel slice it copies, twice) and sums the bias gradients on the way
// (fusion/kernels/cat.cu). Parts are Conv2d outputs, (N, C, H, W) or, from an unbatched
// input, (C, H, W): the bias is over dim -3 and dim is torch.cat's. On CUDA for 4-D
// parts concatenated over their channels (dim 1 or -3), at most KT_CAT_MAX of them in
// fp32/fp16/bf16 sharing one layout (NCHW- or channels-last-contiguous); otherwise (the
// CPU, 3-D parts, another dim, mixed layouts, fake tensors) the bias adds and ATen's cat,
// whose results these equal.
void check_bias_cat(at::TensorList xs, at::TensorList bs, int64_t dim) {
  TORCH_CHECK(!xs.empty() && xs.size() == bs.size(), "kitsune.bias_cat: need as many biases as parts (at least one), got ",
              xs.size(), " parts and ", bs.size(), " biases");
  for (size_t i = 0; i < xs.size(); i++) {
    const Tensor &x = xs[i], &b = bs[i];
    TORCH_CHECK((x.dim() == 3 || x.dim() == 4) && x.dim() == xs[0].dim() && b.dim() == 1 && b.size(0) == x.size(-3),
                "kitsune.bias_cat: part ", i, ": need x (N, C, H, W) or (C, H, W), as part 0, and bias (C,); got ",
                x.sizes(), " and ", b.sizes());
    check_float(x, "bias_cat", ("part " + std::to_string(i)).c_str());
    check_same(x, b, "bias_cat", "a part", "its bias");
    check_same(xs[0], x, "bias_cat", "part 0", ("part " + std::to_string(i)).c_str());
  }
  const int64_t nd = xs[0].dim();
  TORCH_CHECK(dim >= -nd && dim < nd, "kitsune.bias_cat: dim ", dim, " is out of range for parts of ", nd,
              " dimensions");
  const int64_t d = dim < 0 ? dim + nd : dim;
  for (size_t i = 1; i < xs.size(); i++)
    for (int64_t j = 0; j < nd; j++)
      TORCH_CHECK(j == d || xs[i].size(j) == xs[0].size(j), "kitsune.bias_cat: part ", i, " of shape ", xs[i].sizes(),
                  " does not match part 0's ", xs[0].sizes(), " but in dim ", dim);
}

// Whether dim (torch.cat's, wrapped) is the parts' channel dim -3.
bool channel_cat(at::TensorList xs, int64_t dim) { return xs[0].dim() == 4 && (dim == 1 || dim == -3); }

// The kernels' layout for the parts, or nullopt for ATen's path (also for a part with no
// elements: the kernels take C, H and W of at least 1, and an empty part has nothing to add).
std::optional<at::MemoryFormat> bias_cat_format(at::TensorList xs, int64_t dim) {
  if (xs.size() > KT_CAT_MAX || !channel_cat(xs, dim)) return std::nullopt;
  const auto f = xs[0].suggest_memory_format();
  for (const Tensor& x : xs)
    if (!lt_dtype_ok(x) || x.numel() == 0 || x.suggest_memory_format() != f || !x.is_contiguous(f) ||
        x.size(0) != xs[0].size(0) || x.size(2) != xs[0].size(2) || x.size(3) != xs[0].size(3))
      return std::nullopt;
  return f;
}

kt_cat_parts cat_parts(at::TensorList parts, bool channels_last) {
  kt_cat_parts p{};
  p.k = (int)parts.size();
  for (int i = 0; i < p.k; i++) {
    p.data[i] = parts[i].data_ptr();
    p.c[i] = parts[i].size(1);
    p.off[i + 1] = p.off[i] + p.c[i];
  }
  p.n = parts[0].size(0), p.h = parts[0].size(2), p.w = parts[0].size(3);
  p.channels_last = channels_last;
  return p;
}

// out, and the layout the kernels ran in (nullopt: ATen's path), for the backward.
struct BiasCatOut {
  Tensor out;
  std::optional<at::MemoryFormat> format;
};
BiasCatOut bias_cat_impl(at::TensorList xs, at::TensorList bs, int64_t dim) {
  const auto f = bias_cat_format(xs, dim);
  if (!f) {
    std::vector<Tensor> ys;
    for (size_t i = 0; i < xs.size(); i++)
      ys.push_back(xs[i].dim() == 4 ? channel_bias_fwd(xs[i], bs[i], "none") : at::add(xs[i], bs[i].view({-1, 1, 1})));
    return {at::cat(ys, dim), f};
  }
  c10::cuda::CUDAGuard g(xs[0].device());
  std::vector<Tensor> bc;
  for (const Tensor& b : bs) bc.push_back(b.contiguous());
  kt_cat_parts p = cat_parts(xs, *f == at::MemoryFormat::ChannelsLast);
  for (int i = 0; i < p.k; i++) p.bias[i] = bc[i].data_ptr();
  Tensor out = at::empty({p.n, p.off[p.k], p.h, p.w}, xs[0].options().memory_format(*f));
  check_launch(kt_bias_cat(dtype_of(out, "bias_cat"), &p, out.data_ptr(), stream_of(out)), "bias_cat");
  return {out, f};
}
Tensor bias_cat_fwd(at::TensorList xs, at::TensorList bs, int64_t dim) {
  check_bias_cat(xs, bs, dim);
  return bias_cat_impl(xs, bs, dim).out;
}

struct BiasCatFn : torch::autograd::Function<BiasCatFn> {
  static Tensor forward(AutogradContext* ctx, at::TensorList xs, at::TensorList bs, int64_t dim) {
    check_bias_cat(xs, bs, dim);
    BiasCatOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = bias_cat_impl(xs, bs, dim);
    }
    const int64_t d = at::maybe_wrap_dim(dim, r.out.dim());
    std::vector<int64_t> sizes;
    for (const Tensor& x : xs) sizes.push_back(x.size(d));
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["dim"] = d;
    ctx->saved_data["kernel"] = r.format.has_value();
    ctx->saved_data["cl"] = r.format == at::MemoryFormat::ChannelsLast;
    ctx->saved_data["bias_dtype"] = bs[0].scalar_type();
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t d = ctx->saved_data["dim"].toInt();
    const auto bt = ctx->saved_data["bias_dtype"].toScalarType();
    const size_t k = sizes.size();
    const Tensor& g = go[0];
    variable_list grads(2 * k + 1);
    if (!ctx->saved_data["kernel"].toBool()) {   // ATen's path: cat's narrow views, sums over all but dim -3
      const at::ScalarType acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      int64_t off = 0;
      for (size_t i = 0; i < k; off += sizes[i], i++) {
        grads[i] = g.narrow(d, off, sizes[i]);
        grads[k + i] = g.dim() == 4 ? channel_sum(grads[i], bt) : grads[i].sum({1, 2}, false, acc).to(bt);
      }
      return grads;
    }
    const bool cl = ctx->saved_data["cl"].toBool();
    const auto f = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    c10::cuda::CUDAGuard guard(g.device());
    for (size_t i = 0; i < k; i++)
      grads[i] = at::empty({g.size(0), sizes[i], g.size(2), g.size(3)}, g.options().memory_format(f));
    kt_cat_parts p = cat_parts(at::TensorList(grads.data(), k), cl);
    const int64_t ctot = p.off[p.k], rows = kt_bias_cat_partials(&p);
    TORCH_CHECK(rows >= 0, "kitsune.bias_cat backward: invalid parts");
    Tensor partial = at::empty({rows, ctot}, g.options().dtype(at::kFloat));
    const int64_t gs[4] = {g.stride(0), g.stride(1), g.stride(2), g.stride(3)};
    check_launch(kt_bias_cat_backward(dtype_of(g, "bias_cat"), g.data_ptr(), gs, &p, partial.data_ptr<float>(),
                                      stream_of(g)),
                 "bias_cat backward");
    Tensor sums = rows ? colsum(partial, at::kFloat) : at::zeros({ctot}, g.options().dtype(at::kFloat));
    for (size_t i = 0; i < k; i++) grads[k + i] = sums.narrow(0, p.off[i], sizes[i]).to(bt);
    return grads;
  }
};
Tensor bias_cat_autograd(at::TensorList xs, at::TensorList bs, int64_t dim) { return BiasCatFn::apply(xs, bs, dim); }

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("bias_cat", &bias_cat_fwd); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("bias_cat", &bias_cat_autograd); }

}  // namespace bridge
