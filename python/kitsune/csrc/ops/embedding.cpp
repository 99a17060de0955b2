// python/kitsune/csrc/ops/embedding.cpp — the embedding family
// (fusion/kernels/embedding.cu, kitsune/ops/embedding.py): F.embedding with Kitsune's
// weight gradient.
#include "../common.h"

namespace bridge {
namespace {

// ---- embedding: F.embedding(indices, weight, padding_idx) ----
// The forward is ATen's lookup; the weight gradient, on CUDA for fp32/fp16/bf16, is
// Kitsune's (fusion/kernels/embedding.cu: a radix sort over the vocabulary's bits
// only, then a block per run of equal indices), where ATen's sorts all 64 bits of the
// indices. Elsewhere (the CPU, fake tensors, other dtypes) ATen's dense backward.
// padding_idx -1: none (kitsune.ops.embedding counts a negative one from the end first, as
// F.embedding does).
Tensor embedding_fwd(const Tensor& w, const Tensor& indices, int64_t padding_idx) {
  check_devices("embedding", {{"weight", w}, {"indices", indices}});
  check_float(w, "embedding", "weight");
  TORCH_CHECK(w.dim() == 2, "kitsune.embedding: weight must be (num_embeddings, embedding_dim), got ", w.sym_sizes());
  const c10::SymInt& rows = w.sym_size(0);
  TORCH_CHECK(padding_idx == -1 || (padding_idx >= 0 && rows > padding_idx),
              "kitsune.embedding: padding_idx must be -1 (none) or in [0, ", rows, "), got ", padding_idx);
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
              "kitsune.embedding: indices must be int64 or int32, got ", indices.scalar_type());
  return at::embedding(w, indices, padding_idx);
}
Tensor embedding_backward_impl(const Tensor& grad, const Tensor& indices, const c10::SymInt& sym_rows,
                               int64_t padding_idx) {
  // sizes only on real CUDA tensors (a fake one's may be symbolic)
  const bool real = grad.is_cuda() && !grad.key_set().has(c10::DispatchKey::Python) &&
                    !indices.key_set().has(c10::DispatchKey::Python) &&
                    (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                     grad.scalar_type() == at::kBFloat16);
  const int64_t wsn = real ? kt_embedding_backward_workspace(indices.numel(), sym_rows.expect_int()) : -1;
  if (wsn < 0 || (grad.size(-1) + 127) / 128 > 65535)
    return at::embedding_dense_backward_symint(grad, indices, sym_rows, padding_idx, false);
  const int64_t dim = grad.size(-1), n = indices.numel(), rows = sym_rows.expect_int();
  c10::cuda::CUDAGuard g(grad.device());
  Tensor gc = grad.reshape({n, dim}).contiguous(), ic = indices.reshape({n}).to(at::kLong).contiguous();
  Tensor out = at::empty({rows, dim}, gc.options());
  Tensor ws = at::empty({wsn > 0 ? wsn : 1}, gc.options().dtype(at::kByte));   // the caching allocator: 512-aligned
  check_launch(kt_embedding_backward(dtype_of(gc, "embedding"), gc.data_ptr(), ic.data_ptr<int64_t>(), n, dim, rows,
                                     padding_idx, out.data_ptr(), ws.data_ptr(), wsn, stream_of(out)),
               "embedding backward");
  return out;
}

struct EmbeddingFn : torch::autograd::Function<EmbeddingFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& w, const Tensor& indices, int64_t padding_idx) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = embedding_fwd(w, indices, padding_idx);
    }
    ctx->saved_data["rows"] = w.sym_size(0);
    ctx->saved_data["padding"] = padding_idx;
    ctx->save_for_backward({indices});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto saved = ctx->get_saved_variables();
    return {embedding_backward_impl(go[0], saved[0], ctx->saved_data["rows"].toSymInt(),
                                    ctx->saved_data["padding"].toInt()),
            Tensor(), Tensor()};
  }
};
Tensor embedding_autograd(const Tensor& w, const Tensor& indices, int64_t padding_idx) {
  return EmbeddingFn::apply(w, indices, padding_idx);
}

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("embedding", &embedding_fwd); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("embedding", &embedding_autograd); }

}  // namespace bridge
