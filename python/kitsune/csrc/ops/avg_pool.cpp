// python/kitsune/csrc/ops/avg_pool.cpp — the avg_pool family (fusion/kernels/avg_pool.cu,
// kitsune/ops/avg_pool.py): global_avg_pool, the mean over H and W.
#include "../common.h"

namespace bridge {
namespace {

// ---- global_avg_pool: x.mean(dim, keepdim) where dim is H and W of an (N, C, H, W) x ----
// On CUDA for a channels-last x (dense in NHWC and not NCHW-contiguous too) in
// fp32/fp16/bf16 with pixels: Kitsune's kernels (fusion/kernels/avg_pool.cu), which need
// no workspace where ATen's strided reduction stages partial sums in a buffer twice the
// input's size. Otherwise (the CPU, NCHW, other ranks or dims, fake tensors) ATen's mean
// with its own autograd: the same values to rounding, and ATen's errors.
// Both paths' checks (mean's own range error would not name the op).
void check_gap(const Tensor& x, c10::IntArrayRef dim) {
  check_float(x, "global_avg_pool", "x");
  const int64_t nd = std::max<int64_t>(x.dim(), 1);
  for (int64_t d : dim)
    TORCH_CHECK(d >= -nd && d < nd, "kitsune.global_avg_pool: dim ", d, " is out of range for a tensor of ", x.dim(),
                " dimensions");
}

bool gap_kernel_ok(const Tensor& x, c10::IntArrayRef dim) {
  if (!lt_dtype_ok(x) || x.dim() != 4 || dim.size() != 2) return false;
  for (int64_t d : dim)
    if (d < -4 || d > 3) return false;   // ATen's range error
  const int64_t a = (dim[0] + 4) % 4, b = (dim[1] + 4) % 4;
  return std::min(a, b) == 2 && std::max(a, b) == 3 && x.size(2) * x.size(3) > 0 &&
         x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
}

Tensor gap_kernel_fwd(const Tensor& x, bool keepdim) {
  c10::cuda::CUDAGuard g(x.device());
  const int64_t n = x.size(0), c = x.size(1);
  Tensor out = keepdim ? at::empty({n, c, 1, 1}, x.options()) : at::empty({n, c}, x.options());
  check_launch(kt_global_avg_pool(dtype_of(x, "global_avg_pool"), x.data_ptr(), out.data_ptr(), n, c,
                                  x.size(2) * x.size(3), stream_of(out)),
               "global_avg_pool");
  return out;
}

Tensor global_avg_pool_fwd(const Tensor& x, c10::IntArrayRef dim, bool keepdim) {
  check_gap(x, dim);
  return gap_kernel_ok(x, dim) ? gap_kernel_fwd(x, keepdim) : at::mean(x, dim, keepdim);
}

struct GlobalAvgPoolFn : torch::autograd::Function<GlobalAvgPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, bool keepdim) {
    at::AutoDispatchBelowADInplaceOrView g;
    ctx->saved_data["shape"] = x.sizes().vec();   // the backward needs x's shape, not x
    return gap_kernel_fwd(x, keepdim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const Tensor g = go[0].contiguous();
    c10::cuda::CUDAGuard guard(g.device());
    Tensor gx = at::empty(shape, g.options().memory_format(at::MemoryFormat::ChannelsLast));
    check_launch(kt_global_avg_pool_backward(dtype_of(g, "global_avg_pool"), g.data_ptr(), gx.data_ptr(), shape[0],
                                             shape[1], shape[2] * shape[3], stream_of(gx)),
                 "global_avg_pool backward");
    return {gx, Tensor()};
  }
};
Tensor global_avg_pool_autograd(const Tensor& x, c10::IntArrayRef dim, bool keepdim) {
  check_gap(x, dim);
  return gap_kernel_ok(x, dim) ? GlobalAvgPoolFn::apply(x, keepdim) : at::mean(x, dim, keepdim);
}

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("global_avg_pool", &global_avg_pool_fwd); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("global_avg_pool", &global_avg_pool_autograd); }

}  // namespace bridge
