// fusion/kernels/gelu.cuh — gelu and its derivative in fp32, exact (erf) or tanh
// approximation; FAST (16-bit storage) takes erf from Abramowitz & Stegun 7.1.26
// (|error| < 1.5e-7; see pointwise.cu for why) with flush-to-zero approximate
// reciprocal and exp2. Used by pointwise.cu and dropout.cu.
#pragma once

#include "elementwise.cuh"

namespace kt {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kCoeff = 0.044715f;

// The approximate reciprocal and 2^x that __fdividef and __expf use, flushing
// subnormals: without .ftz each takes extra instructions to scale subnormal operands
// and results, which here cannot matter (1 + 0.33|x| >= 1; exp(-x^2) is subnormal only
// where erf is 1 in fp32 anyway).
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.44269504088896340736f;

__device__ inline float erf_as(float x) {   // Abramowitz & Stegun 7.1.26
  float ax = fabsf(x);
  float t = rcp_ftz(fmaf(0.3275911f, ax, 1.f));
  float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  return copysignf(fmaf(-poly, ex2_ftz(ax * ax * -kLog2e), 1.f), x);
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

}  // namespace kt
