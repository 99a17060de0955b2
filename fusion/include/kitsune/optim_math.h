/* kitsune/optim_math.h — one optimizer update per element, the same code in the
 * CUDA multi-tensor kernel (fusion/kernels/optim.cu) and in the CPU path (the bridge),
 * following torch.optim's formulas step for step (C++ only).
 *
 * Adam / AdamW (amsgrad, maximize off):
 *   g += wd * p (Adam) | p *= 1 - lr * wd (AdamW)
 *   m = lerp(m, g, 1 - beta1); v = beta2 * v + (1 - beta2) * g * g
 *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * Scalar coefficients (1 - beta1, 1 - lr * wd, ...) are formed in double and rounded
 * once, as torch.optim's Python floats are.
 * SGD: g += wd * p; buf = first ? g : momentum * buf + (1 - dampening) * g;
 *      g = nesterov ? g + momentum * buf : buf (momentum > 0); p -= lr * g
 *
 * Under a CUDA graph the learning rate and step count cannot be launch constants (a
 * replay would reuse the captured ones), so `dev`, when set, points at them in the
 * update's own memory (device memory for the kernel): dev[0] = lr, dev[1] = step
 * (Adam; the count after this update), as doubles; resolve() turns them into the
 * coefficients above with the host path's formulas.
 *
 * Loss scaling inside a CUDA graph: `skip`, when set, points at a float in device
 * memory (torch.amp's found_inf, written earlier in the same graph); where it is not 0
 * the launch changes nothing, as GradScaler skips optimizer.step() after inf or NaN
 * gradients. The step count is the caller's (kitsune.adam_capturable_ moves it on by
 * 1 - found_inf).
 */
#ifndef KITSUNE_OPTIM_MATH_H
#define KITSUNE_OPTIM_MATH_H

#include <math.h>

#ifdef __CUDACC__
#define KT_OPT_FN __host__ __device__ __forceinline__
#else
#define KT_OPT_FN inline
#endif

namespace kt {

struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay;
  double step_size;         /* lr / (1 - beta1^t) */
  double bias2_sqrt;        /* sqrt(1 - beta2^t) */
  int decoupled;            /* AdamW */
  const double *dev;        /* NULL, or {lr, step} read when the update runs */
  const float *skip;        /* NULL, or a flag read when the update runs: not 0 = no update */
};

struct SgdArgs {
  double lr, momentum, dampening, weight_decay;
  int nesterov, first;      /* first: the momentum buffer starts as the gradient */
  const double *dev;        /* NULL, or {lr} read when the update runs */
  const float *skip;        /* as AdamArgs::skip */
};

KT_OPT_FN AdamArgs adam_coefficients(AdamArgs a, double lr, double step) {
  a.lr = lr;
  a.step_size = lr / (1 - pow(a.beta1, step));
  a.bias2_sqrt = sqrt(1 - pow(a.beta2, step));
  return a;
}
KT_OPT_FN AdamArgs resolve(const AdamArgs &a) { return a.dev ? adam_coefficients(a, a.dev[0], a.dev[1]) : a; }
KT_OPT_FN SgdArgs resolve(const SgdArgs &a) {
  SgdArgs r = a;
  if (a.dev) r.lr = a.dev[0];
  return r;
}

/* ATen's lerp: exact at both ends. */
template <typename F> KT_OPT_FN F lerp(F a, F b, F w) { return w < F(0.5) ? a + w * (b - a) : b - (b - a) * (F(1) - w); }

template <typename F> KT_OPT_FN void adam_elem(F &p, F &m, F &v, F g, const AdamArgs &a) {
  if (a.weight_decay != 0) {
    if (a.decoupled) p = p * F(1.0 - a.lr * a.weight_decay);
    else g = g + F(a.weight_decay) * p;
  }
  m = lerp(m, g, F(1.0 - a.beta1));
  v = v * F(a.beta2) + F(1.0 - a.beta2) * g * g;
  const F denom = sqrt(v) / F(a.bias2_sqrt) + F(a.eps);
  p = p - F(a.step_size) * (m / denom);
}

template <typename F> KT_OPT_FN void sgd_elem(F &p, F &buf, F g, const SgdArgs &a) {
  if (a.weight_decay != 0) g = g + F(a.weight_decay) * p;
  if (a.momentum != 0) {
    buf = a.first ? g : buf * F(a.momentum) + F(1.0 - a.dampening) * g;
    g = a.nesterov ? g + F(a.momentum) * buf : buf;
  }
  p = p - F(a.lr) * g;
}

}  // namespace kt

#include "kitsune/fusion.h"

/* Multi-tensor launchers (fusion/kernels/optim.cu): every list holds ntensors device
 * pointers of one dtype, contiguous, sizes[i] elements each; states have the
 * parameter's dtype; arithmetic is fp32. momentum_buf may be NULL when momentum is 0. */
extern "C" kt_status kt_adam_multi(kt_dtype t, int ntensors, void *const *params, void *const *grads,
                                   void *const *exp_avg, void *const *exp_avg_sq, const int64_t *sizes,
                                   const kt::AdamArgs *a, void *stream);
extern "C" kt_status kt_sgd_multi(kt_dtype t, int ntensors, void *const *params, void *const *grads,
                                  void *const *momentum_buf, const int64_t *sizes, const kt::SgdArgs *a,
                                  void *stream);

#endif
