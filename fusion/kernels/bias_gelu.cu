// fusion/kernels/bias_gelu.cu — out = gelu(x + bias), bias broadcast along the
// last dimension, exact (erf) or tanh approximation; and its backward.
//
// The bias has nbias elements and x is read as a row-major [rows, nbias] view:
// element i adds bias[i % nbias]. The bias stays in L1/L2, so traffic is one read
// of x and one write of out. The backward returns grad_x; the bias gradient is
// grad_x summed over rows (done by the caller with a reduction).
//
// For fp16/bf16 storage, erf comes from Abramowitz & Stegun 7.1.26 (|error| <
// 1.5e-7, one fast exp): the libm erff is accurate to fp32 ulps that a 16-bit
// output cannot hold. With erff the bf16 kernel ran at 74% of copy bandwidth, with
// this 90-92% (H100, bench/results/kernels_elementwise_9194f5a.json and _bc035f6).
// fp32 storage keeps erff.
#include "elementwise.cuh"

namespace {

// ---- reference ----
constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kCoeff = 0.044715f;

__device__ inline float erf_as(float x) {   // Abramowitz & Stegun 7.1.26
  float ax = fabsf(x);
  float t = __fdividef(1.f, 1.f + 0.3275911f * ax);
  float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  return copysignf(1.f - poly * __expf(-ax * ax), x);
}

template <bool FAST> __device__ inline float erf_of(float x) { return FAST ? erf_as(x) : erff(x); }

template <bool FAST> __device__ inline float gelu_ref(float v, int approximate) {
  if (approximate) return 0.5f * v * (1.f + tanhf(kSqrt2OverPi * (v + kCoeff * v * v * v)));
  return 0.5f * v * (1.f + erf_of<FAST>(v * kSqrt1_2));
}

template <bool FAST> __device__ inline float gelu_grad_ref(float v, int approximate) {
  if (approximate) {
    float u = kSqrt2OverPi * (v + kCoeff * v * v * v);
    float t = tanhf(u);
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kCoeff * v * v);
  }
  return 0.5f * (1.f + erf_of<FAST>(v * kSqrt1_2)) + v * kInvSqrt2Pi * __expf(-0.5f * v * v);
}

// ---- kernels ----
template <typename T> struct BiasGelu {   // x = (x, bias)
  int approximate;
  __device__ void operator()(const float *x, float *y) const {
    y[0] = gelu_ref<sizeof(T) == 2>(x[0] + x[1], approximate);
  }
};
template <typename T> struct BiasGeluBackward {   // x = (grad, x, bias)
  int approximate;
  __device__ void operator()(const float *x, float *y) const {
    y[0] = x[0] * gelu_grad_ref<sizeof(T) == 2>(x[1] + x[2], approximate);
  }
};

}  // namespace

// ---- launchers ----
extern "C" kt_status kt_bias_gelu(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                                  int approximate, void *stream) {
  if (!bias || nbias <= 0 || (n % nbias) != 0 || (approximate != 0 && approximate != 1)) return KT_ERR_INVALID;
  const void *in[1] = {x};
  void *o[1] = {out};
  return kt::launch<BiasGelu, 1, 1>(t, in, o, n, bias, nbias, stream, approximate);
}

extern "C" kt_status kt_bias_gelu_backward(kt_dtype t, const void *grad, const void *x, const void *bias,
                                           void *grad_x, int64_t n, int64_t nbias, int approximate, void *stream) {
  if (!bias || nbias <= 0 || (n % nbias) != 0 || (approximate != 0 && approximate != 1)) return KT_ERR_INVALID;
  const void *in[2] = {grad, x};
  void *o[1] = {grad_x};
  return kt::launch<BiasGeluBackward, 2, 1>(t, in, o, n, bias, nbias, stream, approximate);
}
