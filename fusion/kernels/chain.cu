// fusion/kernels/chain.cu — pointwise chains: the glue between Kitsune's patterns (a
// residual add, a scale, a cast, a mask, an activation's backward) as one launch of
// one precompiled kernel that interprets a small program per element, instead of one
// ATen kernel (one read and one write of memory) per op, and without generating code.
//
// The program (kitsune/fusion.h, kt_chain) travels in the kernel's parameters (about
// 1 KB, constant memory): every thread of a launch runs the same instructions, so the
// switch on the opcode never diverges within a warp and the cost over a hand-written
// kernel is the dispatch, a few integer instructions an op, hidden behind memory on
// chains of memory-bound ops. Registers are fp32: intermediates are not rounded to a
// 16-bit storage type unless the program says so (KT_OP_ROUND_*, for an explicit cast),
// as Inductor does; each output is rounded once.
//
// Addressing: an input or output whose strides are the shape's contiguous strides is
// read or written at the element's own index; any other (broadcast, transposed,
// sliced, channels-last) through its strides from the element's coordinates, computed
// once per element when some operand needs them. The caller makes each output's
// layout dense (kt_chain_run does not check that outputs do not overlap).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "elementwise.cuh"

namespace {

// ---- reference semantics, one op on fp32 values (host and device) ----
__host__ __device__ inline float chain_gelu(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__host__ __device__ inline float chain_gelu_tanh(float x) {
  const float k = 0.79788456080286536f;   // sqrt(2 / pi)
  return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}
__host__ __device__ inline float chain_gelu_grad(float x) {   // d/dx of x * Phi(x)
  const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  const float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
  return cdf + x * pdf;
}
__host__ __device__ inline float chain_gelu_tanh_grad(float x) {
  const float k = 0.79788456080286536f, c = 0.044715f;
  const float inner = k * (x + c * x * x * x);
  const float t = tanhf(inner);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * k * (1.f + 3.f * c * x * x);
}
__host__ __device__ inline float chain_nan_or(float a, float b, float v) { return (a != a || b != b) ? NAN : v; }

__host__ __device__ inline float chain_op(int op, float a, float b, float c, float k) {
  switch (op) {
    case KT_OP_CONST: return k;
    case KT_OP_ADD: return a + b;
    case KT_OP_SUB: return a - b;
    case KT_OP_MUL: return a * b;
    case KT_OP_DIV: return a / b;
    case KT_OP_MAX: return chain_nan_or(a, b, fmaxf(a, b));
    case KT_OP_MIN: return chain_nan_or(a, b, fminf(a, b));
    case KT_OP_POW: return powf(a, b);
    case KT_OP_NEG: return -a;
    case KT_OP_EXP: return expf(a);
    case KT_OP_LOG: return logf(a);
    case KT_OP_TANH: return tanhf(a);
    case KT_OP_SIGMOID: return 1.f / (1.f + expf(-a));
    case KT_OP_ERF: return erff(a);
    case KT_OP_RSQRT: return 1.f / sqrtf(a);
    case KT_OP_SQRT: return sqrtf(a);
    case KT_OP_RELU: return a < 0.f ? 0.f : a;   // NaN stays NaN, as torch.relu
    case KT_OP_GELU: return chain_gelu(a);
    case KT_OP_GELU_TANH: return chain_gelu_tanh(a);
    case KT_OP_SILU: return a / (1.f + expf(-a));
    case KT_OP_ABS: return fabsf(a);
    case KT_OP_RECIP: return 1.f / a;
    case KT_OP_LOG1P: return log1pf(a);
    case KT_OP_GT: return a > b ? 1.f : 0.f;
    case KT_OP_LT: return a < b ? 1.f : 0.f;
    case KT_OP_GE: return a >= b ? 1.f : 0.f;
    case KT_OP_LE: return a <= b ? 1.f : 0.f;
    case KT_OP_EQ: return a == b ? 1.f : 0.f;
    case KT_OP_NE: return a != b ? 1.f : 0.f;
    case KT_OP_WHERE: return a != 0.f ? b : c;
    case KT_OP_ROUND_BF16: return __bfloat162float(__float2bfloat16_rn(a));
    case KT_OP_ROUND_F16: return __half2float(__float2half_rn(a));
    case KT_OP_TO_BOOL: return a != 0.f ? 1.f : 0.f;
    case KT_OP_GELU_BWD: return a * chain_gelu_grad(b);
    case KT_OP_GELU_TANH_BWD: return a * chain_gelu_tanh_grad(b);
  }
  return NAN;   // kt_chain_check refused every other opcode
}

__host__ __device__ inline float chain_load(const void *p, int64_t i, int dt) {
  switch (dt) {
    case KT_F32: return static_cast<const float *>(p)[i];
    case KT_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case KT_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const uint8_t *>(p)[i] != 0 ? 1.f : 0.f;
  }
}

__host__ __device__ inline void chain_store(void *p, int64_t i, int dt, float v) {
  switch (dt) {
    case KT_F32: static_cast<float *>(p)[i] = v; break;
    case KT_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
    case KT_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<uint8_t *>(p)[i] = v != 0.f; break;
  }
}

struct ChainPtrs {
  const void *in[KT_CHAIN_MAX_IN];
  void *out[KT_CHAIN_MAX_OUT];
  uint32_t flat;   // bit k: input k is read at the element's own index
  uint32_t out_flat;   // bit k: output k is written there
};

// One element: its inputs loaded, the program run, its outputs stored. The kernel runs it
// for each element; kt_chain_run_host, the same code on the CPU, for tests.
__host__ __device__ inline void chain_element(const kt_chain &c, const ChainPtrs &p, int64_t i, bool all_flat) {
  float r[KT_CHAIN_MAX_REGS];
  int64_t coord[KT_CHAIN_MAX_DIM];
  if (all_flat) {
    for (int k = 0; k < c.n_in; k++) r[k] = chain_load(p.in[k], i, c.in_dtype[k]);
  } else {
    int64_t rest = i;
    for (int d = c.ndim - 1; d >= 0; d--) {
      coord[d] = rest % c.shape[d];
      rest /= c.shape[d];
    }
    for (int k = 0; k < c.n_in; k++) {
      int64_t off = i;
      if (!(p.flat >> k & 1u)) {
        off = 0;
        for (int d = 0; d < c.ndim; d++) off += coord[d] * c.in_stride[k][d];
      }
      r[k] = chain_load(p.in[k], off, c.in_dtype[k]);
    }
  }
#pragma unroll 1
  for (int j = 0; j < c.n_ops; j++) {
    const kt_chain_op o = c.ops[j];
    const bool is_const = o.op == KT_OP_CONST;
    r[o.dst] = chain_op(o.op, is_const ? 0.f : r[o.a], r[o.b], r[o.c], is_const ? c.consts[o.a] : 0.f);
  }
  for (int k = 0; k < c.n_out; k++) {
    int64_t off = i;
    if (!all_flat && !(p.out_flat >> k & 1u)) {
      off = 0;
      for (int d = 0; d < c.ndim; d++) off += coord[d] * c.out_stride[k][d];
    }
    chain_store(p.out[k], off, c.out_dtype[k], r[c.out_reg[k]]);
  }
}

__global__ void __launch_bounds__(256) chain_kernel(const __grid_constant__ kt_chain c, ChainPtrs p, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const bool all_flat = p.flat == (1u << c.n_in) - 1u && p.out_flat == (1u << c.n_out) - 1u;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) chain_element(c, p, i, all_flat);
}

bool chain_dtype_ok(int dt) { return dt == KT_F32 || dt == KT_F16 || dt == KT_BF16 || dt == KT_CHAIN_BOOL; }

// How many operands (registers) an op reads: CONST reads none (a is a constant's index).
int chain_arity(int op) {
  switch (op) {
    case KT_OP_CONST: return 0;
    case KT_OP_ADD: case KT_OP_SUB: case KT_OP_MUL: case KT_OP_DIV: case KT_OP_MAX: case KT_OP_MIN: case KT_OP_POW:
    case KT_OP_GT: case KT_OP_LT: case KT_OP_GE: case KT_OP_LE: case KT_OP_EQ: case KT_OP_NE:
    case KT_OP_GELU_BWD: case KT_OP_GELU_TANH_BWD: return 2;
    case KT_OP_WHERE: return 3;
    default: return 1;
  }
}

}  // namespace

extern "C" kt_status kt_chain_check(const kt_chain *c) {
  if (!c || c->n_in < 0 || c->n_in > KT_CHAIN_MAX_IN || c->n_out < 1 || c->n_out > KT_CHAIN_MAX_OUT || c->n_ops < 0 ||
      c->n_ops > KT_CHAIN_MAX_OPS || c->ndim < 0 || c->ndim > KT_CHAIN_MAX_DIM)
    return KT_ERR_INVALID;
  int64_t n = 1;
  for (int d = 0; d < c->ndim; d++) {
    if (c->shape[d] < 0) return KT_ERR_INVALID;
    if (c->shape[d] > 0 && n > INT64_MAX / c->shape[d]) return KT_ERR_INVALID;
    n *= c->shape[d];
  }
  uint32_t written = c->n_in >= 32 ? ~0u : (1u << c->n_in) - 1u;
  for (int k = 0; k < c->n_in; k++)
    if (!chain_dtype_ok(c->in_dtype[k])) return KT_ERR_INVALID;
  for (int j = 0; j < c->n_ops; j++) {
    const kt_chain_op o = c->ops[j];
    if (o.op >= KT_OP_COUNT || o.dst >= KT_CHAIN_MAX_REGS) return KT_ERR_INVALID;
    const int arity = chain_arity(o.op);
    if (arity == 0 && o.a >= KT_CHAIN_MAX_CONST) return KT_ERR_INVALID;
    const uint8_t reads[3] = {o.a, o.b, o.c};
    for (int r = 0; r < arity; r++)
      if (reads[r] >= KT_CHAIN_MAX_REGS || !(written >> reads[r] & 1u)) return KT_ERR_INVALID;
    written |= 1u << o.dst;
  }
  for (int k = 0; k < c->n_out; k++)
    if (!chain_dtype_ok(c->out_dtype[k]) || c->out_reg[k] < 0 || c->out_reg[k] >= KT_CHAIN_MAX_REGS ||
        !(written >> c->out_reg[k] & 1u))
      return KT_ERR_INVALID;
  return KT_OK;
}

namespace {

// The checks and the pointers of a run; *n the element count (0: nothing to do).
kt_status chain_setup(const kt_chain *c, const void *const *in, void *const *out, ChainPtrs *p, int64_t *n) {
  kt_status st = kt_chain_check(c);
  if (st != KT_OK) return st;
  if ((c->n_in > 0 && !in) || !out) return KT_ERR_INVALID;
  int64_t count = 1, contiguous[KT_CHAIN_MAX_DIM];
  for (int d = c->ndim - 1; d >= 0; d--) {
    contiguous[d] = count;
    count *= c->shape[d];
  }
  *n = count;
  if (count == 0) return KT_OK;
  *p = ChainPtrs{};
  for (int k = 0; k < c->n_in; k++) {
    if (!in[k]) return KT_ERR_INVALID;
    p->in[k] = in[k];
    bool flat = true;
    for (int d = 0; d < c->ndim; d++) flat = flat && (c->shape[d] == 1 || c->in_stride[k][d] == contiguous[d]);
    p->flat |= (uint32_t)flat << k;
  }
  for (int k = 0; k < c->n_out; k++) {
    if (!out[k]) return KT_ERR_INVALID;
    p->out[k] = out[k];
    bool flat = true;
    for (int d = 0; d < c->ndim; d++) flat = flat && (c->shape[d] == 1 || c->out_stride[k][d] == contiguous[d]);
    p->out_flat |= (uint32_t)flat << k;
  }
  return KT_OK;
}

}  // namespace

extern "C" kt_status kt_chain_run(const kt_chain *c, const void *const *in, void *const *out, void *stream) {
  ChainPtrs p;
  int64_t n = 0;
  kt_status st = chain_setup(c, in, out, &p, &n);
  if (st != KT_OK || n == 0) return st;
  int64_t blocks = (n + 255) / 256;
  const int64_t cap = (int64_t)132 * 16;   // a few waves on the largest GPUs; the loop strides over the rest
  if (blocks > cap) blocks = cap;
  chain_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(*c, p, n);
  return kt::status_of(cudaGetLastError());
}

extern "C" kt_status kt_chain_run_host(const kt_chain *c, const void *const *in, void *const *out) {
  ChainPtrs p;
  int64_t n = 0;
  kt_status st = chain_setup(c, in, out, &p, &n);
  if (st != KT_OK || n == 0) return st;
  const bool all_flat = p.flat == (1u << c->n_in) - 1u && p.out_flat == (1u << c->n_out) - 1u;
  for (int64_t i = 0; i < n; i++) chain_element(*c, p, i, all_flat);
  return KT_OK;
}
