// python/kitsune/csrc/ops/linear.cpp — the linear family (kitsune/ops/linear.py):
// linear_act, a Linear with its bias and activation in one cuBLASLt GEMM's epilogue,
// and attention_score, (q @ k^T) * scale as one batched GEMM. No .cu file of its own:
// the GEMMs are cuBLASLt's (its backward's fused passes are reduce.cu's and
// pointwise.cu's). The cuBLASLt calls stay in C++ here, not in fusion/: libkitsune.so
// links the CUDA runtime statically and does not link cuBLAS, and the handle and
// workspace must be PyTorch's (one cuBLASLt in the process).
#include <cublasLt.h>

#include "../common.h"

namespace bridge {
namespace {

// ---- attention_score: (q @ k^T) * scale as one cuBLAS batched GEMM, scale in alpha ----
// CompositeImplicitAutograd: autograd and fake shapes come from baddbmm's.
Tensor attention_score(const Tensor& q, const Tensor& k, std::optional<double> scale) {
  check_same(q, k, "attention_score", "q", "k");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && q.sizes().slice(0, q.dim() - 2) == k.sizes().slice(0, k.dim() - 2)
                  && q.size(-1) == k.size(-1),
              "kitsune.attention_score: q (..., Lq, d) and k (..., Lk, d) must share batch dims and d; got ",
              q.sizes(), " and ", k.sizes());
  check_float(q, "attention_score", "q");
  const int64_t d = q.size(-1), lq = q.size(-2), lk = k.size(-2);
  const double s = scale ? *scale : 1.0 / std::sqrt((double)std::max<int64_t>(d, 1));
  const int64_t batch = c10::multiply_integers(q.sizes().slice(0, q.dim() - 2));   // not -1: lq or d may be 0
  Tensor qb = q.reshape({batch, lq, d}), kb = k.reshape({batch, lk, d});
  Tensor out = at::baddbmm(at::empty({qb.size(0), lq, lk}, q.options()), qb, kb.transpose(1, 2), /*beta=*/0, s);
  c10::DimVector shape(q.sizes().begin(), q.sizes().end() - 1);
  shape.push_back(lk);
  return out.view(shape);
}

// ---- linear_act: act(x @ W^T + b) ----
// On CUDA, one cuBLASLt GEMM with the bias and activation in its epilogue, on
// PyTorch's cuBLASLt handle and workspace (so one cuBLASLt in the process):
//   relu:      epilogue RELU_BIAS; the backward masks with the output;
//   gelu_tanh: fp16 and bf16, epilogue GELU_AUX_BIAS, which also stores the
//              pre-activation x @ W^T + b for the backward (its leading dimension
//              must be a multiple of 8: out_features % 8 == 0); fp32 as gelu;
//   gelu:      the GEMM, then kitsune.bias_gelu. cuBLASLt's GELU epilogue is the
//              tanh form, and ATen's _addmm_activation(use_gelu) is exact erf on the
//              CPU but that epilogue on CUDA, so neither gives erf GELU in one GEMM;
//   none:      F.linear's addmm; the backward sums the bias gradient with kt_colsum
//              (colsum, ops/reduce.cpp) where ATen's linear backward runs its reduce_kernel.
// The relu backward masks the gradient and sums the bias gradient in one kernel
// (kt_relu_grad_colsum), then plain GEMMs; gelu_tanh through cuBLASLt likewise
// (kt_bias_gelu_grad_colsum at the saved pre-activation). cuBLASLt's BGRADB epilogue,
// which gelu_tanh used before, ran as a kernel of its own after the weight GEMM
// (25 us against ATen's 33 us sum at 8192 x 3072 bf16; H100, 9743aae).
// Where cuBLASLt offers no algorithm (odd shapes or alignment), and on the CPU, the
// op composes ATen ops instead. x (..., in), weight (out, in), bias (out,).
void check_linear_act(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  TORCH_CHECK(act == "relu" || act == "gelu" || act == "gelu_tanh" || act == "none",
              "kitsune.linear_act: act must be 'relu', 'gelu', 'gelu_tanh' or 'none', got '", act, "'");
  // gelu and gelu_tanh go through kitsune.bias_gelu's kernel on CUDA (below), which takes
  // the kernel's dtypes: refused here by this op's name; relu and none take float64 (ATen)
  check_floats("linear_act", {{"x", x}, {"weight", w}, {"bias", b}}, act == "gelu" || act == "gelu_tanh");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && w.size(1) == x.size(-1) && b.dim() == 1 && b.size(0) == w.size(0),
              "kitsune.linear_act: need x (..., in), weight (out, in), bias (out,); got ", x.sizes(), ", ", w.sizes(),
              ", ", b.sizes());
}

// A column-major cuBLASLt GEMM D (m, n) = op(A) op(B), with an epilogue. RAII over
// the descriptors; run() returns false (and launches nothing) when the heuristic
// has no algorithm.
struct LtGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  LtGemm(at::ScalarType st, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldd,
         cublasLtEpilogue_t epi) {
    const cudaDataType_t dt = st == at::kHalf ? CUDA_R_16F : st == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t ct = st == at::kFloat && at::globalContext().allowTF32CuBLAS()
                                       ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    lt_check(cublasLtMatmulDescCreate(&desc, ct, CUDA_R_32F));
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    attr(CUBLASLT_MATMUL_DESC_TRANSA, opa);
    attr(CUBLASLT_MATMUL_DESC_TRANSB, opb);
    attr(CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
    lt_check(cublasLtMatrixLayoutCreate(&a, dt, ta ? k : m, ta ? m : k, lda));
    lt_check(cublasLtMatrixLayoutCreate(&b, dt, tb ? n : k, tb ? k : n, ldb));
    lt_check(cublasLtMatrixLayoutCreate(&d, dt, m, n, ldd));
  }
  ~LtGemm() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  static void lt_check(cublasStatus_t st) {
    TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "kitsune.linear_act: cuBLASLt call failed with status ", (int)st);
  }
  template <typename V> void attr(cublasLtMatmulDescAttributes_t at, const V& v) {
    lt_check(cublasLtMatmulDescSetAttribute(desc, at, &v, sizeof(v)));
  }
  bool run(const void* A, const void* B, void* D) {
    cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
    size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
    void* ws = at::cuda::getCUDABlasLtWorkspace();
    cublasLtMatmulPreference_t pref;
    lt_check(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                             sizeof(ws_size));
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, d, d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) return false;
    const float one = 1.f, zero = 0.f;
    lt_check(cublasLtMatmul(h, desc, &one, A, a, B, b, &zero, D, d, D, d, &res.algo, ws, ws_size,
                            at::cuda::getCurrentCUDAStream().stream()));
    return true;
  }
};

// out (M, N) = act(x2 (M, K) @ w (N, K)^T + b) in one cuBLASLt GEMM (D^T = W . x2^T in
// column-major terms); pre, when defined, receives x2 @ w^T + b. False: no algorithm.
bool lt_linear_act(const Tensor& x2, const Tensor& w, const Tensor& b, const Tensor& out, const Tensor& pre,
                   cublasLtEpilogue_t epi) {
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  c10::cuda::CUDAGuard g(x2.device());
  LtGemm gemm(x2.scalar_type(), true, false, N, M, K, K, K, N, epi);
  gemm.attr(CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  if (pre.defined()) {
    gemm.attr(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
    gemm.attr(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, N);
  }
  return gemm.run(w.data_ptr(), x2.data_ptr(), out.data_ptr());
}

// The forward's results: out, and what the backward differentiates the activation
// at: for relu nothing (it masks with out), for none nothing; for gelu_tanh through cuBLASLt the
// pre-activation x @ W^T + b (pre_has_bias); otherwise the GEMM output before the
// bias (bias_gelu_backward adds it).
struct LinearActOut {
  Tensor out, saved;
  bool pre_has_bias;
};
LinearActOut linear_act_impl(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  check_linear_act(x, w, b, act);
  Tensor x2 = as_rows(x).contiguous();
  c10::DimVector shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  const int64_t N = w.size(0);
  if (act == "none") return {at::addmm(b, x2, w.t()).view(shape), Tensor(), false};
  // gelu_tanh in fp32 composes: the epilogue's GELU is off by up to 4e-6 where
  // PyTorch's fp32 GELU is off by 2e-8 (H100, test_ops at 707707a); in 16-bit
  // formats that is far below the output's rounding.
  const bool lt_gelu = act == "gelu_tanh" && N % 8 == 0 && x.scalar_type() != at::kFloat;
  if (lt_dtype_ok(x) && x2.numel() > 0 && (act == "relu" || lt_gelu)) {
    Tensor wc = w.contiguous(), bc = b.contiguous(), out = at::empty({x2.size(0), N}, x2.options());
    Tensor pre = act == "relu" ? Tensor() : at::empty_like(out);
    if (lt_linear_act(x2, wc, bc, out, pre, act == "relu" ? CUBLASLT_EPILOGUE_RELU_BIAS
                                                          : CUBLASLT_EPILOGUE_GELU_AUX_BIAS))
      return {out.view(shape), pre, act != "relu"};
  }
  if (act == "relu") return {at::relu(at::addmm(b, x2, w.t())).view(shape), Tensor(), false};
  static auto bias_gelu = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
  Tensor mm = at::mm(x2, w.t());
  return {bias_gelu.call(mm, b, act == "gelu" ? "none" : "tanh").view(shape), mm, false};
}
Tensor linear_act_fwd(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  return linear_act_impl(x, w, b, act).out;
}

struct LinearActFn : torch::autograd::Function<LinearActFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& b, std::string act) {
    LinearActOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = linear_act_impl(x, w, b, act);
    }
    ctx->saved_data["act"] = act;
    ctx->saved_data["pre_has_bias"] = r.pre_has_bias;
    ctx->save_for_backward({x, w, b, act == "relu" ? r.out : r.saved});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto relu_bwd = op_handle<BinarySig>("kitsune::add_relu_backward");
    static auto gelu_bwd = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                c10::string_view)>("kitsune::bias_gelu_backward");
    auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &w = s[1], &b = s[2];
    const std::string act = ctx->saved_data["act"].toStringRef();
    // only the gradients autograd asks for: the first layer's input (a batch) needs
    // none, and its (M, K) GEMM was a fifth of the MLP's backward GEMM work
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
    Tensor x2 = as_rows(x).contiguous(), g2 = as_rows(go[0]).contiguous(), gpre, gw, gb;
    if (act == "gelu_tanh" && ctx->saved_data["pre_has_bias"].toBool()) {
      // GELU's backward at the epilogue's pre-activation and the bias gradient in one
      // pass (kt_bias_gelu_grad_colsum with no bias to add), then plain GEMMs: it was
      // ATen's gelu_backward and cuBLASLt's BGRADB, a kernel of its own after the GEMM
      std::tie(gpre, gb) = gelu_grad_colsum(g2, as_rows(s[3]).contiguous(), Tensor(), 1, b.scalar_type());
    } else if (act == "gelu" || act == "gelu_tanh") {
      std::tie(gpre, gb) = gelu_bwd.call(g2, s[3], b, act == "gelu" ? "none" : "tanh");
    } else if (act == "none") {
      gpre = g2;
      if (need_b) gb = colsum(g2, b.scalar_type());
    } else if (act == "relu" && lt_dtype_ok(x) && x2.numel() > 0) {
      // ReLU's mask and the bias gradient in one kernel, then a plain weight GEMM: the
      // elementwise kernel and cuBLASLt's BGRADB epilogue kernel were two launches
      // (MLP: 2.7 + 3.0 us a step for its two layers, h100_profile_graph_9d33764.log)
      Tensor sums;
      std::tie(gpre, sums) = relu_grad_colsum(g2, as_rows(s[3]).contiguous(), b.scalar_type());
      if (need_b) gb = sums;
    } else {   // relu where the fused pass does not run (the CPU, fake tensors, no rows)
      gpre = relu_bwd.call(g2, as_rows(s[3])).contiguous();
      if (need_b) gb = colsum(gpre, b.scalar_type());
    }
    if (need_w && !gw.defined()) gw = at::mm(gpre.t(), x2);
    return {need_x ? at::mm(gpre, w).view(x.sizes()) : Tensor(), need_w ? gw : Tensor(), need_b ? gb : Tensor(),
            Tensor()};
  }
};
Tensor linear_act_autograd(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  return LinearActFn::apply(x, w, b, std::string(act));
}

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CompositeExplicitAutograd, m) { m.impl("linear_act", &linear_act_fwd); }

TORCH_LIBRARY_IMPL(kitsune, CompositeImplicitAutograd, m) { m.impl("attention_score", &attention_score); }

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) { m.impl("linear_act", &linear_act_autograd); }

}  // namespace bridge
