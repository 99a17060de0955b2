// fusion/kernels/add_relu.cu — out = relu(a + b), and its backward.
//
// Eager PyTorch writes a + b to memory and reads it back for relu; fused, each
// element is read once per input and written once (3 bytes of traffic per output
// byte instead of 5). The sum is formed in fp32, so bf16/fp16 outputs are rounded
// once (eager rounds the sum, then relu). The backward is PyTorch's
// threshold_backward: the gradient passes where out > 0.
#include "elementwise.cuh"

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
