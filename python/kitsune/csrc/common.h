// python/kitsune/csrc/common.h — what the op files share: the torch headers, the
// checks and conversions every op makes at the boundary, and the few functions one
// family lends another.
//
// Each op family is one file, ops/<family>.cpp, as fusion/kernels/<family>.cu and
// kitsune/ops/<family>.py are: its CUDA wrapper (types only: checks, then the kt_*
// launcher on torch's current stream), its CPU reference in ATen, its C++ autograd
// Function, and its TORCH_LIBRARY_IMPL registrations. Schemas are in library.cpp (one
// place), Autocast kernels in autocast.cpp, fake kernels in kitsune/ops/<family>.py.
// Inputs broadcast like PyTorch's binary ops and are made contiguous (a broadcast or
// strided operand is copied first). What else the op files hold composes ATen ops (the
// CPU references; the paths for other layouts, dtypes and fake tensors; the GEMMs of
// linear and linear_cross_entropy) or works on PyTorch's objects (generators, the
// dispatcher, autograd): C++ because PyTorch's API is.
#pragma once

#include "torch_headers.h"   // precompiled by tools/build_bridge.sh

#include "kitsune/fusion.h"

namespace bridge {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- checks and conversions -----------------------------------------------------------
inline kt_dtype dtype_of(const Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return KT_F32;
    case at::kHalf: return KT_F16;
    case at::kBFloat16: return KT_BF16;
    default:
      TORCH_CHECK(false, "kitsune.", op, ": dtype ", t.scalar_type(),
                  " is not supported (float32, float16 and bfloat16 are)");
  }
}

inline const Tensor* opt(const OptTensor& t) { return t && t->defined() ? &*t : nullptr; }

// t (..., n) as (rows, n): reshape({-1, n}) cannot tell the rows when n is 0.
inline Tensor as_rows(const Tensor& t) {
  return t.reshape({c10::multiply_integers(t.sizes().slice(0, t.dim() - 1)), t.size(-1)});
}

// What every op refuses, in one place (the fake kernels say the same:
// kitsune/ops/_check.py), each error naming the op, the argument and the value:
//   a tensor that is not floating point: the CPU references computed in fp32 and cast
//     back, so an integer tensor came back truncated, and the kernels read it as floats;
//   float64 where a Kitsune CUDA kernel would read it (kernel = true, for a CUDA tensor):
//     the kernels take fp32, fp16 and bf16; the CPU references and the ATen paths also
//     take fp64, which gradcheck uses;
//   tensors on more than one device: the CUDA kernels would read a CPU pointer, and a
//     CPU tensor beside a meta one reaches the fake kernel, which made an empty result.
// An argument: its name and the tensor; an undefined one (an optional not given) is
// skipped.
struct Arg {
  const char* name;
  const Tensor* t;
  Arg(const char* n, const Tensor& x) : name(n), t(x.defined() ? &x : nullptr) {}
  Arg(const char* n, const OptTensor& x) : name(n), t(opt(x)) {}
};
inline bool float_ok(at::ScalarType s, bool kernel) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || (s == at::kDouble && !kernel);
}
inline void check_float(const Tensor& t, const char* op, const char* name, bool kernel = false) {
  kernel = kernel && t.is_cuda();
  TORCH_CHECK(float_ok(t.scalar_type(), kernel), "kitsune.", op, ": ", name, " must be ",
              kernel ? "float32, float16 or bfloat16 (the CUDA kernel's dtypes)"
                     : "floating point (float32, float16, bfloat16 or float64)",
              "; got ", t.scalar_type());
}
// Every argument given on the first one's device.
inline void check_devices(const char* op, std::initializer_list<Arg> args) {
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    if (!a.t) continue;
    if (!first) first = &a;
    TORCH_CHECK(a.t->device() == first->t->device(), "kitsune.", op, ": ", first->name, " is on ", first->t->device(),
                " but ", a.name, " is on ", a.t->device());
  }
}
// One device, floating point, and one dtype: an op's activations and parameters (its
// Autocast kernel casts the parameters to the activation's dtype first).
inline void check_floats(const char* op, std::initializer_list<Arg> args, bool kernel = false) {
  check_devices(op, args);
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    if (!a.t) continue;
    check_float(*a.t, op, a.name, kernel);
    if (!first) first = &a;
    TORCH_CHECK(a.t->scalar_type() == first->t->scalar_type(), "kitsune.", op, ": ", first->name, " is ",
                first->t->scalar_type(), " but ", a.name, " is ", a.t->scalar_type(), " (cast one of them)");
  }
}

// The shape the arguments broadcast to (as a + b does), or an error naming them.
inline c10::DimVector broadcast_sizes(const char* op, std::initializer_list<Arg> args) {
  c10::DimVector shape;
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    if (!a.t) continue;
    const auto s = a.t->sizes();
    if (!first) {
      first = &a, shape.assign(s.begin(), s.end());
      continue;
    }
    const size_t n = std::max(shape.size(), s.size()), ps = n - shape.size(), ss = n - s.size();
    c10::DimVector out(n);
    for (size_t i = 0; i < n; i++) {
      const int64_t x = i < ps ? 1 : shape[i - ps], y = i < ss ? 1 : s[i - ss];
      TORCH_CHECK(x == y || x == 1 || y == 1, "kitsune.", op, ": ", a.name, " of shape ", s,
                  " does not broadcast with ", first->name, "'s shape ", c10::IntArrayRef(shape));
      out[i] = x == 1 ? y : x;
    }
    shape = out;
  }
  return shape;
}

inline void check_same(const Tensor& a, const Tensor& b, const char* op, const char* na, const char* nb) {
  TORCH_CHECK(a.device() == b.device(), "kitsune.", op, ": ", na, " is on ", a.device(), " but ", nb, " is on ",
              b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "kitsune.", op, ": ", na, " is ", a.scalar_type(), " but ", nb,
              " is ", b.scalar_type(), " (cast one of them)");
}

inline void check_launch(kt_status st, const char* op) {
  TORCH_CHECK(st == KT_OK, "kitsune.", op, ": the CUDA kernel launch failed: ", kt_status_str(st));
}

inline void* stream_of(const Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// The CPU references compute in fp32, or fp64 for fp64 inputs (which gradcheck uses).
inline at::ScalarType opmath(const Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Kitsune's kernels and cuBLASLt take real CUDA memory in fp32, fp16 or bf16: a tensor
// subclass (a FakeTensor under ShapeProp or torch.compile's tracing, which reaches
// this code through the C++ autograd kernels) composes ATen ops instead, which
// dispatch to it.
inline bool lt_dtype_ok(const Tensor& x) {
  return x.is_cuda() && !x.key_set().has(c10::DispatchKey::Python) &&
         (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
}

// A registered op, called through the dispatcher.
template <typename Sig> c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
using BinarySig = Tensor(const Tensor&, const Tensor&);

// ---- autograd in C++ for the ops a model calls once per layer --------------------------
// torch.library.register_autograd runs the forward through Python (about 70 us of
// host time a call, measured on CPU against 20 us for F.rms_norm). A LLaMA-style step
// had 15.9 ms of kernels in a 24 ms step (bench/results/h100_profile_llama_kitsune_
// ed26073.log): the GPU waited, most likely on that host time. The families' Functions
// call the forward op below autograd and the *_backward op from backward, on the
// Autograd key. (The linear_cross_entropy op keeps its autograd in Python:
// kitsune.ops' linear_cross_entropy, an autograd.Function, forms the gradients in its
// forward.) Their glue:
inline Tensor sum_to_shape(const Tensor& g, const Tensor& like) {
  return g.sizes() == like.sizes() ? g : at::sum_to(g, like.sizes());
}
// An absent weight or bias cannot be an undefined input of a custom Function: it is
// passed as a 0-element placeholder, with bit 0 (weight) / bit 1 (bias) of `present`
// saying which are real.
inline Tensor placeholder_if_absent(const OptTensor& t, const Tensor& like) {
  return t && t->defined() ? *t : at::empty({0}, like.options());
}
inline int64_t present_bits(const OptTensor& w, const OptTensor& b) {
  return (w && w->defined() ? 1 : 0) | (b && b->defined() ? 2 : 0);
}
inline OptTensor opt_if(const Tensor& t, int64_t present, int bit) {
  return present & bit ? OptTensor(t) : OptTensor();
}
inline Tensor grad_if(const Tensor& g, int64_t present, int bit) { return present & bit ? g : Tensor(); }

// ---- lent by one family to others -----------------------------------------------------
// ops/reduce.cpp: column sums (kt_colsum) and the activation backwards fused with them.
Tensor colsum(const Tensor& x2, at::ScalarType out_t);
std::tuple<Tensor, Tensor> relu_grad_colsum(const Tensor& g, const Tensor& y, at::ScalarType out_t);
std::tuple<Tensor, Tensor> gelu_grad_colsum(const Tensor& g, const Tensor& x, const Tensor& bias, int approximate,
                                            at::ScalarType out_t);
Tensor dense_channel_rows(const Tensor& t);
Tensor channel_sum(const Tensor& g, at::ScalarType out_t);
// ops/pointwise.cpp
int approx_code(c10::string_view approximate, const char* op);
// x (..., n) and bias (n,): floating, one dtype and device (kernel: the CUDA kernel's dtypes)
void check_bias(const Tensor& x, const Tensor& bias, const char* op, bool kernel);
Tensor channel_bias_fwd(const Tensor& y, const Tensor& b, c10::string_view act);

}  // namespace bridge

// A family's ops with a CUDA kernel (NAME_cuda) and a CPU reference (NAME_cpu), from
// one list so the two registrations cannot drift apart: KT_DEVICE_IMPLS(LIST) in
// namespace bridge, where LIST(X) is X(op) X(op_backward) ...
#define KT_IMPL_CUDA(name) m.impl(#name, &name##_cuda);
#define KT_IMPL_CPU(name) m.impl(#name, &name##_cpu);
#define KT_DEVICE_IMPLS(LIST)                               \
  TORCH_LIBRARY_IMPL(kitsune, CUDA, m) { LIST(KT_IMPL_CUDA) } \
  TORCH_LIBRARY_IMPL(kitsune, CPU, m) { LIST(KT_IMPL_CPU) }
