// fusion/kernels/mul_tanh.cu — out = tanh(a * b), and its backward.
//
// The backward recomputes tanh(a*b) in fp32 from a and b instead of reading the
// stored (rounded) output: same traffic as reading out, better gradients in bf16.
#include "elementwise.cuh"

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
