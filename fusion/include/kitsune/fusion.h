/* kitsune/fusion.h — C launchers of Kitsune's fused CUDA kernels.
 *
 * Each launcher checks its own preconditions, launches on the stream it is given
 * (a cudaStream_t; NULL is the legacy default stream) and returns a kt_status:
 * KT_ERR_INVALID for a bad argument (NULL pointer, negative size, unknown dtype),
 * KT_ERR_UNAVAILABLE without a CUDA device, KT_ERR_BACKEND when the launch fails.
 * Tensors are dense and contiguous; n counts elements. Arithmetic is done in fp32
 * whatever the storage type, and every output element is rounded once.
 * The kernels are compiled for sm_80 and sm_90 with PTX for newer GPUs
 * (fusion/kernels/, one concept per .cu file).
 */
#ifndef KITSUNE_FUSION_H
#define KITSUNE_FUSION_H

#include <stdint.h>

#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kt_dtype { KT_F32 = 0, KT_F16 = 1, KT_BF16 = 2 } kt_dtype;

/* out = relu(a + b) */
kt_status kt_add_relu(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream);
/* grad_in = grad where out > 0, else 0 (the gradient for both a and b) */
kt_status kt_add_relu_backward(kt_dtype t, const void *grad, const void *out, void *grad_in, int64_t n,
                               void *stream);

/* out = tanh(a * b) */
kt_status kt_mul_tanh(kt_dtype t, const void *a, const void *b, void *out, int64_t n, void *stream);
/* d = grad * (1 - tanh(a*b)^2), tanh recomputed in fp32; grad_a = d * b; grad_b = d * a */
kt_status kt_mul_tanh_backward(kt_dtype t, const void *grad, const void *a, const void *b, void *grad_a,
                               void *grad_b, int64_t n, void *stream);

/* out[i] = gelu(x[i] + bias[i % nbias]); approximate 0 = exact (erf), 1 = tanh */
kt_status kt_bias_gelu(kt_dtype t, const void *x, const void *bias, void *out, int64_t n, int64_t nbias,
                       int approximate, void *stream);
/* grad_x[i] = grad[i] * gelu'(x[i] + bias[i % nbias]) (grad of bias = grad_x summed over rows) */
kt_status kt_bias_gelu_backward(kt_dtype t, const void *grad, const void *x, const void *bias, void *grad_x,
                                int64_t n, int64_t nbias, int approximate, void *stream);

/* out = silu(gate) * up */
kt_status kt_swiglu(kt_dtype t, const void *gate, const void *up, void *out, int64_t n, void *stream);
/* grad_gate = grad * up * silu'(gate); grad_up = grad * silu(gate) */
kt_status kt_swiglu_backward(kt_dtype t, const void *grad, const void *gate, const void *up, void *grad_gate,
                             void *grad_up, int64_t n, void *stream);

/* Row-wise, over `rows` rows of n contiguous elements:
 * y = x * rsqrt(mean(x^2) + eps) * weight (weight has n elements). */
kt_status kt_rms_norm(kt_dtype t, const void *x, const void *weight, void *y, int64_t rows, int64_t n, float eps,
                      void *stream);
/* grad_x = r * weight * grad - x * r^3 / n * sum(grad * weight * x), r = rsqrt(mean(x^2) + eps),
 * recomputed per row; rstd (rows fp32 values, may be NULL) receives r for the weight's gradient
 * sum over rows of grad * x * r. */
kt_status kt_rms_norm_backward(kt_dtype t, const void *grad, const void *x, const void *weight, void *grad_x,
                               float *rstd, int64_t rows, int64_t n, float eps, void *stream);

#ifdef __cplusplus
}
#endif
#endif
