// fusion/kernels/swiglu.cu — out = silu(gate) * up (LLaMA's MLP), and its backward.
//
// silu(g) = g * sigmoid(g); silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
// The backward reads grad, gate and up once and writes both gradients.
#include "elementwise.cuh"

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
