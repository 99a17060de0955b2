// fusion/kernels/pointwise.cu — the pointwise family: elementwise ops of one or
// two tensors (and a bias along the last dimension) and their backwards, each one
// instantiation of kt::ew_kernel (elementwise.cuh). A section an op, each in llm.c's
// order (reference, kernels, launchers):
//
// add_relu: out = relu(a + b). Eager PyTorch writes a + b to memory and reads it
// back for relu; fused, each element is read once per input and written once (3
// bytes of traffic per output byte instead of 5). The sum is formed in fp32, so
// bf16/fp16 outputs are rounded once (eager rounds the sum, then relu). The backward
// is PyTorch's threshold_backward: the gradient passes where out > 0.
//
// mul_tanh: out = tanh(a * b). The backward recomputes tanh(a*b) in fp32 from a and
// b instead of reading the stored (rounded) output: same traffic as reading out,
// better gradients in bf16.
//
// bias_gelu: out = gelu(x + bias), bias broadcast along the last dimension, exact
// (erf) or tanh approximation (its backward, with the bias gradient in the same
// pass, is kt_bias_gelu_grad_colsum in reduce.cu). Also kt_bias_act: out = x + bias,
// or relu(x + bias) (kitsune.channel_bias on a channels-last convolution output,
// whose channels are its last dimension). The bias has nbias elements and x is read
// as a row-major [rows, nbias] view: element i adds bias[i % nbias]. The bias stays
// in L1/L2, so traffic is one read of x and one write of out. For fp16/bf16 storage,
// erf comes from Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, one fast exp): the
// libm erff is accurate to fp32 ulps that a 16-bit output cannot hold. With erff the
// bf16 kernel ran at 74% of copy bandwidth, with this 90-92% (H100,
// bench/results/archive/kernels_elementwise_9194f5a.json and _bc035f6). fp32 storage keeps
// erff.
//
// swiglu: out = silu(gate) * up (LLaMA's MLP). silu(g) = g * sigmoid(g);
// silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g). The backward reads grad, gate
// and up once and writes both gradients.
#include "elementwise.cuh"
#include "gelu.cuh"

// ======== add_relu ===========================================================

namespace {

// ---- reference (what the kernel computes, per element, in fp32) ----
__host__ __device__ inline float add_relu_ref(float a, float b) { return fmaxf(a + b, 0.f); }

// ---- kernels (functors for kt::ew_kernel) ----
template <typename T> struct AddRelu {
  __device__ void operator()(const float *x, float *y) const { y[0] = add_relu_ref(x[0], x[1]); }
};
template <typename T> struct AddReluBackward {   // x = (grad, out)
  __device__ void operator()(const float *x, float *y) const { y[0] = x[1] > 0.f ? x[0] : 0.f; }
};

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_add_relu(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream) {
  const void *in[2] = {a, b};
  void *o[1] = {out};
  return kt::launch<AddRelu, 2, 1>(t, in, o, n, nullptr, 0, stream);
}

extern "C" kt_status kt_add_relu_backward(kt_dtype t, const void *grad, const void *out, void *grad_in, int64_t n,
                                          void *stream) {
  const void *in[2] = {grad, out};
  void *o[1] = {grad_in};
  return kt::launch<AddReluBackward, 2, 1>(t, in, o, n, nullptr, 0, stream);
}

// ======== mul_tanh ===========================================================

namespace {

// ---- reference ----
__host__ __device__ inline float mul_tanh_ref(float a, float b) { return tanhf(a * b); }

// ---- kernels ----
template <typename T> struct MulTanh {
  __device__ void operator()(const float *x, float *y) const { y[0] = mul_tanh_ref(x[0], x[1]); }
};
template <typename T> struct MulTanhBackward {   // x = (grad, a, b) -> (grad_a, grad_b)
  __device__ void operator()(const float *x, float *y) const {
    float t = mul_tanh_ref(x[1], x[2]);
    float d = x[0] * (1.f - t * t);
    y[0] = d * x[2];
    y[1] = d * x[1];
  }
};

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_mul_tanh(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream) {
  const void *in[2] = {a, b};
  void *o[1] = {out};
  return kt::launch<MulTanh, 2, 1>(t, in, o, n, nullptr, 0, stream);
}

extern "C" kt_status kt_mul_tanh_backward(kt_dtype t, const void *grad, const void *a, const void *b, void *grad_a,
                                          void *grad_b, int64_t n, void *stream) {
  const void *in[3] = {grad, a, b};
  void *o[2] = {grad_a, grad_b};
  return kt::launch<MulTanhBackward, 3, 2>(t, in, o, n, nullptr, 0, stream);
}

// ======== bias_gelu, bias_act ================================================

namespace {

// ---- reference ----
// gelu(v) and gelu'(v) in fusion/kernels/gelu.cuh (shared with dropout.cu)
using kt::gelu_ref;
using kt::gelu_grad_ref;

// ---- kernels ----
template <typename T> struct BiasGelu {   // x = (x, bias)
  int approximate;
  __device__ void operator()(const float *x, float *y) const {
    y[0] = gelu_ref<sizeof(T) == 2>(x[0] + x[1], approximate);
  }
};
template <typename T> struct BiasAct {   // x = (x, bias): x + bias, then relu when asked
  int relu;
  __device__ void operator()(const float *x, float *y) const {
    const float v = x[0] + x[1];
    y[0] = relu && !(v > 0.f) && v == v ? 0.f : v;   // relu keeps NaN, as torch.relu does
  }
};

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_bias_act(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                                 int relu, void *stream) {
  if (n < 0 || nbias < 0 || (relu != 0 && relu != 1)) return KT_ERR_INVALID;
  if (!n) return KT_OK;   // nothing to write (x of no columns has an empty bias: NULL, nbias 0)
  if (!bias || nbias == 0 || (n % nbias) != 0) return KT_ERR_INVALID;
  const void *in[1] = {x};
  void *o[1] = {out};
  return kt::launch<BiasAct, 1, 1>(t, in, o, n, bias, nbias, stream, relu);
}

extern "C" kt_status kt_bias_gelu(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                                  int approximate, void *stream) {
  if (n < 0 || nbias < 0 || (approximate != 0 && approximate != 1)) return KT_ERR_INVALID;
  if (!n) return KT_OK;   // as kt_bias_act
  if (!bias || nbias == 0 || (n % nbias) != 0) return KT_ERR_INVALID;
  const void *in[1] = {x};
  void *o[1] = {out};
  return kt::launch<BiasGelu, 1, 1>(t, in, o, n, bias, nbias, stream, approximate);
}

// ======== swiglu =============================================================

namespace {

// ---- reference ----
__host__ __device__ inline float sigmoid_ref(float g) { return 1.f / (1.f + expf(-g)); }
__host__ __device__ inline float swiglu_ref(float g, float u) { return g * sigmoid_ref(g) * u; }

// ---- kernels ----
template <typename T> struct Swiglu {
  __device__ void operator()(const float *x, float *y) const { y[0] = swiglu_ref(x[0], x[1]); }
};
template <typename T> struct SwigluBackward {   // x = (grad, gate, up) -> (grad_gate, grad_up)
  __device__ void operator()(const float *x, float *y) const {
    float g = x[1], s = sigmoid_ref(g);
    y[0] = x[0] * x[2] * s * (1.f + g * (1.f - s));
    y[1] = x[0] * g * s;
  }
};

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_swiglu(kt_dtype t, const void *gate, const void *up, void *out, int64_t n, void *stream) {
  const void *in[2] = {gate, up};
  void *o[1] = {out};
  return kt::launch<Swiglu, 2, 1>(t, in, o, n, nullptr, 0, stream);
}

extern "C" kt_status kt_swiglu_backward(kt_dtype t, const void *grad, const void *gate, const void *up,
                                        void *grad_gate, void *grad_up, int64_t n, void *stream) {
  const void *in[3] = {grad, gate, up};
  void *o[2] = {grad_gate, grad_up};
  return kt::launch<SwigluBackward, 3, 2>(t, in, o, n, nullptr, 0, stream);
}
