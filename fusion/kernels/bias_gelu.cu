// fusion/kernels/bias_gelu.cu — out = gelu(x + bias), bias broadcast along the
// last dimension, exact (erf) or tanh approximation (its backward, with the bias
// gradient in the same pass, is kt_bias_gelu_grad_colsum in reduce.cu). Also
// kt_bias_act: out = x + bias, or relu(x + bias) (kitsune.channel_bias on a
// channels-last convolution output, whose channels are its last dimension).
//
// The bias has nbias elements and x is read as a row-major [rows, nbias] view:
// element i adds bias[i % nbias]. The bias stays in L1/L2, so traffic is one read
// of x and one write of out.
//
// For fp16/bf16 storage, erf comes from Abramowitz & Stegun 7.1.26 (|error| <
// 1.5e-7, one fast exp): the libm erff is accurate to fp32 ulps that a 16-bit
// output cannot hold. With erff the bf16 kernel ran at 74% of copy bandwidth, with
// this 90-92% (H100, bench/results/kernels_elementwise_9194f5a.json and _bc035f6).
// fp32 storage keeps erff.
#include "gelu.cuh"

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
  if (!bias || nbias <= 0 || (n % nbias) != 0 || (relu != 0 && relu != 1)) return KT_ERR_INVALID;
  const void *in[1] = {x};
  void *o[1] = {out};
  return kt::launch<BiasAct, 1, 1>(t, in, o, n, bias, nbias, stream, relu);
}

extern "C" kt_status kt_bias_gelu(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                                  int approximate, void *stream) {
  if (!bias || nbias <= 0 || (n % nbias) != 0 || (approximate != 0 && approximate != 1)) return KT_ERR_INVALID;
  const void *in[1] = {x};
  void *o[1] = {out};
  return kt::launch<BiasGelu, 1, 1>(t, in, o, n, bias, nbias, stream, approximate);
}
