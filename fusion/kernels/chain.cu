// fusion/kernels/chain.cu — pointwise chains: the glue between Kitsune's patterns (a
// residual add, a scale, a cast, a mask, an activation's backward) as one launch of
// one precompiled kernel that interprets a small program, instead of one ATen kernel
// (one read and one write of memory) per op, and without generating code.
//
// How it stays near copy bandwidth although the program is only known at launch:
// - The host lowers the program first (chain_lower): constants become immediate
//   operands, an op that reads the previous op's result takes it from an accumulator
//   held in real registers, and only values read later than that (the inputs, a
//   value used twice) get a slot; slots are reused once their last reader has run.
// - Each thread runs a tile of E = 8 consecutive elements through every op: the
//   switch on the opcode is decided once per op for 8 elements (and never diverges:
//   every thread runs the same program), and slots live in shared memory, one private
//   lane per thread (a register file that can be indexed at run time without spilling
//   to local memory; no thread reads another's lane, so no barrier).
// - Loads and stores of operands laid out like the output are 16-byte vectors; other
//   layouts (broadcast, transposed, channels-last) address through their strides over
//   the dimensions left after merging those every operand walks alike.
// Registers are fp32: intermediates are not rounded to a 16-bit storage type unless
// the program says so (KT_OP_ROUND_*, an explicit cast), as Inductor does; each output
// is rounded once. The caller makes each output's layout dense (kt_chain_run does not
// check that outputs do not overlap).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "elementwise.cuh"

namespace {

constexpr int E = 8;   // elements a thread carries through the program
constexpr uint8_t SRC_ACC = 0xFF, SRC_NONE = 0xFE, SRC_CONST = 0x80;   // else a slot index
constexpr int MAX_SLOTS = KT_CHAIN_MAX_REGS + KT_CHAIN_MAX_IN;

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
__host__ __device__ inline float chain_round_bf16(float a) { return __bfloat162float(__float2bfloat16_rn(a)); }
__host__ __device__ inline float chain_round_f16(float a) { return __half2float(__float2half_rn(a)); }

// How many operands (registers) an op reads: CONST reads none (a is a constant's index).
__host__ __device__ inline int chain_arity(int op) {
  switch (op) {
    case KT_OP_CONST: return 0;
    case KT_OP_ADD: case KT_OP_SUB: case KT_OP_MUL: case KT_OP_DIV: case KT_OP_MAX: case KT_OP_MIN: case KT_OP_POW:
    case KT_OP_GT: case KT_OP_LT: case KT_OP_GE: case KT_OP_LE: case KT_OP_EQ: case KT_OP_NE:
    case KT_OP_GELU_BWD: case KT_OP_GELU_TANH_BWD: return 2;
    case KT_OP_WHERE: return 3;
    default: return 1;
  }
}

// ---- the lowered program: what the kernel runs ----
struct ChainLop {
  uint8_t op, a, b, c;   // operands: SRC_ACC, SRC_CONST | constant, or a slot
  uint8_t dst;   // the slot the result is also kept in, or SRC_NONE (accumulator only)
};

struct ChainProg {
  int32_t n_in, n_out, n_lops, n_slots, ndim;
  bool small;   // fewer than 2^31 elements: coordinates in 32-bit arithmetic
  bool inner_tile;   // the innermost dimension a multiple of E: a tile never crosses its end
  int32_t in_dtype[KT_CHAIN_MAX_IN], out_dtype[KT_CHAIN_MAX_OUT];
  uint8_t in_slot[KT_CHAIN_MAX_IN];   // SRC_NONE: the input is never read
  uint8_t out_src[KT_CHAIN_MAX_OUT];   // SRC_ACC, SRC_CONST | k or a slot
  uint32_t flat, out_flat;   // bit k: operand k is laid out as the output shape, contiguously
  uint32_t vec, out_vec;   // bit k: ... and 16-byte aligned (loads and stores as vectors)
  int64_t shape[KT_CHAIN_MAX_DIM];   // merged dimensions
  int64_t in_stride[KT_CHAIN_MAX_IN][KT_CHAIN_MAX_DIM];
  int64_t out_stride[KT_CHAIN_MAX_OUT][KT_CHAIN_MAX_DIM];
  float consts[KT_CHAIN_MAX_CONST];
  ChainLop lops[KT_CHAIN_MAX_OPS];
  const void *in[KT_CHAIN_MAX_IN];
  void *out[KT_CHAIN_MAX_OUT];
};

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

// Whether element i of p (dtype dt) starts a 16-byte-aligned vector.
__host__ __device__ inline bool chain_aligned(const void *p, int64_t i, int dt) {
  const int64_t size = dt == KT_F32 ? 4 : dt == KT_CHAIN_BOOL ? 1 : 2;
  return ((uintptr_t)p + (uintptr_t)(i * size)) % 16 == 0;
}

// 8 consecutive elements from 16-byte-aligned p + i.
__host__ __device__ inline void chain_load8(float v[E], const void *p, int64_t i, int dt) {
  if (dt == KT_F32) {
    const float4 *q = reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
    const float4 x = q[0], y = q[1];
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
  } else if (dt == KT_CHAIN_BOOL) {
    const uint2 u = *reinterpret_cast<const uint2 *>(static_cast<const uint8_t *>(p) + i);
    for (int e = 0; e < E; e++) v[e] = ((e < 4 ? u.x : u.y) >> (8 * (e & 3)) & 0xFFu) != 0 ? 1.f : 0.f;
  } else {
    const uint4 u = *reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(p) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    for (int e = 0; e < E; e++) {
      const uint16_t h = (uint16_t)(w[e / 2] >> (16 * (e & 1)));
      v[e] = dt == KT_BF16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
    }
  }
}

__host__ __device__ inline void chain_store8(void *p, int64_t i, int dt, const float v[E]) {
  if (dt == KT_F32) {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if (dt == KT_CHAIN_BOOL) {
    uint32_t w[2] = {0, 0};
    for (int e = 0; e < E; e++) w[e / 4] |= (uint32_t)(v[e] != 0.f) << (8 * (e & 3));
    *reinterpret_cast<uint2 *>(static_cast<uint8_t *>(p) + i) = make_uint2(w[0], w[1]);
  } else {
    uint32_t w[4];
    for (int j = 0; j < 4; j++) {
      uint16_t lo, hi;
      if (dt == KT_BF16) {
        lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j]));
        hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j + 1]));
      } else {
        lo = __half_as_ushort(__float2half_rn(v[2 * j]));
        hi = __half_as_ushort(__float2half_rn(v[2 * j + 1]));
      }
      w[j] = (uint32_t)lo | (uint32_t)hi << 16;
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Offsets of elements i0 .. i0+cnt-1 of an operand with strides st over the merged shape.
__host__ __device__ inline void chain_offsets(const ChainProg &p, const int64_t *st, int64_t i0, int cnt, int64_t off[E]) {
  int64_t coord[KT_CHAIN_MAX_DIM];
  int64_t o = 0;
  if (p.small) {   // 32-bit division: a few instructions where a 64-bit one is a long routine
    uint32_t rest = (uint32_t)i0;
#pragma unroll
    for (int d = KT_CHAIN_MAX_DIM - 1; d >= 0; d--) {
      if (d < p.ndim) {
        const uint32_t s = (uint32_t)p.shape[d], q = rest / s;
        coord[d] = rest - q * s;
        rest = q;
        o += coord[d] * st[d];
      }
    }
  } else {
    int64_t rest = i0;
#pragma unroll
    for (int d = KT_CHAIN_MAX_DIM - 1; d >= 0; d--) {
      if (d < p.ndim) {
        coord[d] = rest % p.shape[d];
        rest /= p.shape[d];
        o += coord[d] * st[d];
      }
    }
  }
  if (p.inner_tile) {   // a tile lies within one run of the innermost dimension
    for (int e = 0; e < E; e++) off[e] = o + e * st[p.ndim - 1];
    return;
  }
  for (int e = 0; e < E; e++) {
    off[e] = o;
    if (e + 1 >= cnt) continue;
    // the next element: the innermost coordinate steps, carrying outwards
#pragma unroll
    for (int d = KT_CHAIN_MAX_DIM - 1; d >= 0; d--) {
      if (d >= p.ndim) continue;
      o += st[d];
      if (++coord[d] < p.shape[d]) break;
      o -= coord[d] * st[d];
      coord[d] = 0;
    }
  }
}

// A slot's lane of this thread: E floats as E / 4 float4 planes, thread-interleaved.
__host__ __device__ inline float4 *chain_lane(float4 *slots, int s, int q, int t, int nt) {
  return slots + ((int64_t)(s * (E / 4) + q) * nt + t);
}
__host__ __device__ inline void chain_put(float4 *slots, int s, int t, int nt, const float v[E]) {
  for (int q = 0; q < E / 4; q++) *chain_lane(slots, s, q, t, nt) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
}
__host__ __device__ inline void chain_fetch(const ChainProg &p, float4 *slots, int t, int nt, uint8_t src,
                                            const float acc[E], float v[E]) {
  if (src == SRC_ACC) {
    for (int e = 0; e < E; e++) v[e] = acc[e];
  } else if (src & SRC_CONST) {
    const float k = p.consts[src & 0x7F];
    for (int e = 0; e < E; e++) v[e] = k;
  } else {
    for (int q = 0; q < E / 4; q++) {
      const float4 x = *chain_lane(slots, src, q, t, nt);
      v[4 * q] = x.x, v[4 * q + 1] = x.y, v[4 * q + 2] = x.z, v[4 * q + 3] = x.w;
    }
  }
}

#define KT_EACH(expr)                       \
  for (int e = 0; e < E; e++) acc[e] = (expr); \
  break

// One op over the tile's E elements into acc.
__host__ __device__ inline void chain_apply(const ChainProg &p, float4 *slots, int t, int nt, const ChainLop o,
                                            float acc[E]) {
  float a[E], b[E];
  chain_fetch(p, slots, t, nt, o.a, acc, a);
  if (chain_arity(o.op) >= 2) chain_fetch(p, slots, t, nt, o.b, acc, b);
  switch (o.op) {
    case KT_OP_ADD: KT_EACH(a[e] + b[e]);
    case KT_OP_SUB: KT_EACH(a[e] - b[e]);
    case KT_OP_MUL: KT_EACH(a[e] * b[e]);
    case KT_OP_DIV: KT_EACH(a[e] / b[e]);
    case KT_OP_MAX: KT_EACH(chain_nan_or(a[e], b[e], fmaxf(a[e], b[e])));
    case KT_OP_MIN: KT_EACH(chain_nan_or(a[e], b[e], fminf(a[e], b[e])));
    case KT_OP_POW: KT_EACH(powf(a[e], b[e]));
    case KT_OP_NEG: KT_EACH(-a[e]);
    case KT_OP_EXP: KT_EACH(expf(a[e]));
    case KT_OP_LOG: KT_EACH(logf(a[e]));
    case KT_OP_TANH: KT_EACH(tanhf(a[e]));
    case KT_OP_SIGMOID: KT_EACH(1.f / (1.f + expf(-a[e])));
    case KT_OP_ERF: KT_EACH(erff(a[e]));
    case KT_OP_RSQRT: KT_EACH(1.f / sqrtf(a[e]));
    case KT_OP_SQRT: KT_EACH(sqrtf(a[e]));
    case KT_OP_RELU: KT_EACH(a[e] < 0.f ? 0.f : a[e]);   // NaN stays NaN, as torch.relu
    case KT_OP_GELU: KT_EACH(chain_gelu(a[e]));
    case KT_OP_GELU_TANH: KT_EACH(chain_gelu_tanh(a[e]));
    case KT_OP_SILU: KT_EACH(a[e] / (1.f + expf(-a[e])));
    case KT_OP_ABS: KT_EACH(fabsf(a[e]));
    case KT_OP_RECIP: KT_EACH(1.f / a[e]);
    case KT_OP_LOG1P: KT_EACH(log1pf(a[e]));
    case KT_OP_GT: KT_EACH(a[e] > b[e] ? 1.f : 0.f);
    case KT_OP_LT: KT_EACH(a[e] < b[e] ? 1.f : 0.f);
    case KT_OP_GE: KT_EACH(a[e] >= b[e] ? 1.f : 0.f);
    case KT_OP_LE: KT_EACH(a[e] <= b[e] ? 1.f : 0.f);
    case KT_OP_EQ: KT_EACH(a[e] == b[e] ? 1.f : 0.f);
    case KT_OP_NE: KT_EACH(a[e] != b[e] ? 1.f : 0.f);
    case KT_OP_WHERE: {
      float c[E];
      chain_fetch(p, slots, t, nt, o.c, acc, c);
      KT_EACH(a[e] != 0.f ? b[e] : c[e]);
    }
    case KT_OP_ROUND_BF16: KT_EACH(chain_round_bf16(a[e]));
    case KT_OP_ROUND_F16: KT_EACH(chain_round_f16(a[e]));
    case KT_OP_TO_BOOL: KT_EACH(a[e] != 0.f ? 1.f : 0.f);
    case KT_OP_GELU_BWD: KT_EACH(a[e] * chain_gelu_grad(b[e]));
    case KT_OP_GELU_TANH_BWD: KT_EACH(a[e] * chain_gelu_tanh_grad(b[e]));
    default: KT_EACH(NAN);   // chain_lower refused every other opcode
  }
}
#undef KT_EACH

// One tile: this thread's elements i0 .. i0+cnt-1 (cnt <= E) loaded, run, stored.
__host__ __device__ inline void chain_tile(const ChainProg &p, float4 *slots, int t, int nt, int64_t i0, int cnt) {
  const bool whole = cnt == E;
  int64_t off[E];
  float v[E];
  for (int k = 0; k < p.n_in; k++) {
    if (p.in_slot[k] == SRC_NONE) continue;
    if (whole && (p.vec >> k & 1u)) {
      chain_load8(v, p.in[k], i0, p.in_dtype[k]);
    } else {
      if (p.flat >> k & 1u) {
        for (int e = 0; e < E; e++) off[e] = i0 + e;
      } else {
        chain_offsets(p, p.in_stride[k], i0, cnt, off);
      }
      const int64_t inner = p.ndim > 0 ? p.in_stride[k][p.ndim - 1] : 1;
      if (whole && p.inner_tile && inner == 1 && chain_aligned(p.in[k], off[0], p.in_dtype[k])) {
        chain_load8(v, p.in[k], off[0], p.in_dtype[k]);   // a row of a broadcast operand (a bias)
      } else if (whole && p.inner_tile && inner == 0) {
        const float x = chain_load(p.in[k], off[0], p.in_dtype[k]);   // one value along the row
        for (int e = 0; e < E; e++) v[e] = x;
      } else {
        for (int e = 0; e < E; e++) v[e] = e < cnt ? chain_load(p.in[k], off[e], p.in_dtype[k]) : 0.f;
      }
    }
    chain_put(slots, p.in_slot[k], t, nt, v);
  }
  float acc[E];
  for (int e = 0; e < E; e++) acc[e] = 0.f;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int j = 0; j < p.n_lops; j++) {
    const ChainLop o = p.lops[j];
    chain_apply(p, slots, t, nt, o, acc);
    if (o.dst != SRC_NONE) chain_put(slots, o.dst, t, nt, acc);
  }
  for (int k = 0; k < p.n_out; k++) {
    chain_fetch(p, slots, t, nt, p.out_src[k], acc, v);
    if (whole && (p.out_vec >> k & 1u)) {
      chain_store8(p.out[k], i0, p.out_dtype[k], v);
      continue;
    }
    if (p.out_flat >> k & 1u) {
      for (int e = 0; e < E; e++) off[e] = i0 + e;
    } else {
      chain_offsets(p, p.out_stride[k], i0, cnt, off);
    }
    for (int e = 0; e < E; e++)
      if (e < cnt) chain_store(p.out[k], off[e], p.out_dtype[k], v[e]);
  }
}

__global__ void __launch_bounds__(256) chain_kernel(const __grid_constant__ ChainProg p, int64_t n) {
  extern __shared__ float4 slots[];
  const int nt = blockDim.x;
  const int64_t tile = (int64_t)nt * E;
  for (int64_t base = (int64_t)blockIdx.x * tile; base < n; base += (int64_t)gridDim.x * tile) {
    const int64_t i0 = base + (int64_t)threadIdx.x * E;
    if (i0 < n) chain_tile(p, slots, threadIdx.x, nt, i0, n - i0 < E ? (int)(n - i0) : E);
  }
}

bool chain_dtype_ok(int dt) { return dt == KT_F32 || dt == KT_F16 || dt == KT_BF16 || dt == KT_CHAIN_BOOL; }

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

// The program's values: each input and each op's result is one value; a register names
// the value last written to it.
struct ChainValues {
  int n = 0;
  int8_t konst[KT_CHAIN_MAX_IN + KT_CHAIN_MAX_OPS];   // a constant's index, or -1
  int16_t def[KT_CHAIN_MAX_IN + KT_CHAIN_MAX_OPS];    // the lowered op that makes it (-1: an input)
  int16_t last[KT_CHAIN_MAX_IN + KT_CHAIN_MAX_OPS];   // its last reader (n_lops: an output); -2 none
  bool needs_slot[KT_CHAIN_MAX_IN + KT_CHAIN_MAX_OPS];
  uint8_t slot[KT_CHAIN_MAX_IN + KT_CHAIN_MAX_OPS];
};

// Lowers checked program c: folds constants, forwards each result to the next op through
// the accumulator, and gives slots (reused after the last read) to the values read later.
void chain_lower(const kt_chain *c, ChainProg *p) {
  ChainValues v;
  int reg[KT_CHAIN_MAX_REGS];
  int reads[KT_CHAIN_MAX_OPS][3];   // per lowered op, the values it reads (-1: none)
  uint8_t lop_code[KT_CHAIN_MAX_OPS];
  int lop_value[KT_CHAIN_MAX_OPS];
  for (int k = 0; k < c->n_in; k++) {
    reg[k] = v.n;
    v.konst[v.n] = -1, v.def[v.n] = -1, v.last[v.n] = -2, v.needs_slot[v.n] = false;
    v.n++;
  }
  int n_lops = 0;
  for (int j = 0; j < c->n_ops; j++) {
    const kt_chain_op o = c->ops[j];
    const int id = v.n++;
    v.konst[id] = -1, v.def[id] = -1, v.last[id] = -2, v.needs_slot[id] = false;
    if (o.op == KT_OP_CONST) {
      v.konst[id] = (int8_t)o.a;
    } else {
      const int arity = chain_arity(o.op);
      const uint8_t r[3] = {o.a, o.b, o.c};
      for (int s = 0; s < 3; s++) {
        reads[n_lops][s] = s < arity ? reg[r[s]] : -1;
        if (s < arity) {
          const int u = reads[n_lops][s];
          v.last[u] = (int16_t)n_lops;
          // the accumulator holds exactly the previous lowered op's result
          if (v.konst[u] < 0 && !(v.def[u] >= 0 && v.def[u] == n_lops - 1)) v.needs_slot[u] = true;
        }
      }
      v.def[id] = (int16_t)n_lops;
      lop_code[n_lops] = o.op;
      lop_value[n_lops] = id;
      n_lops++;
    }
    reg[o.dst] = id;
  }
  int out_value[KT_CHAIN_MAX_OUT];
  for (int k = 0; k < c->n_out; k++) {
    const int u = out_value[k] = reg[c->out_reg[k]];
    v.last[u] = (int16_t)n_lops;
    if (v.konst[u] < 0 && !(v.def[u] >= 0 && v.def[u] == n_lops - 1)) v.needs_slot[u] = true;
  }
  // slots: the inputs first, then each result that needs one, a slot freed after its last read
  bool busy[MAX_SLOTS] = {};
  int n_slots = 0;
  auto take = [&](int u) {
    int s = 0;
    while (busy[s]) s++;
    busy[s] = true;
    v.slot[u] = (uint8_t)s;
    if (s + 1 > n_slots) n_slots = s + 1;
  };
  for (int k = 0; k < c->n_in; k++) {
    if (v.needs_slot[k]) take(k);
    p->in_slot[k] = v.needs_slot[k] ? v.slot[k] : SRC_NONE;
  }
  auto src = [&](int u, int at) -> uint8_t {
    if (v.konst[u] >= 0) return (uint8_t)(SRC_CONST | v.konst[u]);
    if (v.def[u] >= 0 && v.def[u] == at - 1) return SRC_ACC;
    return v.slot[u];
  };
  for (int j = 0; j < n_lops; j++) {
    ChainLop &l = p->lops[j];
    uint8_t *ops[3] = {&l.a, &l.b, &l.c};
    l.op = lop_code[j];
    for (int s = 0; s < 3; s++) *ops[s] = reads[j][s] < 0 ? SRC_NONE : src(reads[j][s], j);
    for (int s = 0; s < 3; s++) {   // free what this op reads last (the result may take its slot)
      const int u = reads[j][s];
      if (u >= 0 && v.konst[u] < 0 && v.needs_slot[u] && v.last[u] == j) busy[v.slot[u]] = false;
    }
    const int id = lop_value[j];
    if (v.needs_slot[id]) take(id);
    l.dst = v.needs_slot[id] ? v.slot[id] : SRC_NONE;
  }
  for (int k = 0; k < c->n_out; k++) p->out_src[k] = src(out_value[k], n_lops);
  p->n_lops = n_lops;
  p->n_slots = n_slots;
}

// Merges dimensions every operand walks alike (contiguous over each other) and drops
// those of size 1, so that most chains address one or two dimensions.
void chain_merge_dims(const kt_chain *c, ChainProg *p) {
  int nd = 0;
  for (int d = 0; d < c->ndim; d++) {
    if (c->shape[d] == 1) continue;
    bool merge = nd > 0;
    for (int k = 0; merge && k < c->n_in; k++)
      merge = p->in_stride[k][nd - 1] == c->in_stride[k][d] * c->shape[d];
    for (int k = 0; merge && k < c->n_out; k++)
      merge = p->out_stride[k][nd - 1] == c->out_stride[k][d] * c->shape[d];
    if (merge) {
      p->shape[nd - 1] *= c->shape[d];
      for (int k = 0; k < c->n_in; k++) p->in_stride[k][nd - 1] = c->in_stride[k][d];
      for (int k = 0; k < c->n_out; k++) p->out_stride[k][nd - 1] = c->out_stride[k][d];
    } else {
      p->shape[nd] = c->shape[d];
      for (int k = 0; k < c->n_in; k++) p->in_stride[k][nd] = c->in_stride[k][d];
      for (int k = 0; k < c->n_out; k++) p->out_stride[k][nd] = c->out_stride[k][d];
      nd++;
    }
  }
  p->ndim = nd;
}

bool chain_contiguous(const ChainProg *p, const int64_t *st) {
  int64_t want = 1;
  for (int d = p->ndim - 1; d >= 0; d--) {
    if (st[d] != want) return false;
    want *= p->shape[d];
  }
  return true;
}

// Operand k's layout bits: flat (laid out as the merged shape, contiguously), vec (and
// 16-byte aligned: loads and stores as vectors).
void chain_layout(const ChainProg *p, const int64_t *stride, const void *ptr, int k, uint32_t *flat, uint32_t *vec) {
  const bool f = chain_contiguous(p, stride);
  *flat |= (uint32_t)f << k;
  *vec |= (uint32_t)(f && (uintptr_t)ptr % 16 == 0) << k;
}

// The checks and the lowered program of a run; *n the element count (0: nothing to do).
kt_status chain_setup(const kt_chain *c, const void *const *in, void *const *out, ChainProg *p, int64_t *n) {
  kt_status st = kt_chain_check(c);
  if (st != KT_OK) return st;
  if ((c->n_in > 0 && !in) || !out) return KT_ERR_INVALID;
  int64_t count = 1;
  for (int d = 0; d < c->ndim; d++) count *= c->shape[d];
  *n = count;
  if (count == 0) return KT_OK;
  *p = ChainProg{};
  p->small = count < ((int64_t)1 << 31);
  p->n_in = c->n_in;
  p->n_out = c->n_out;
  chain_merge_dims(c, p);
  p->inner_tile = p->ndim > 0 && p->shape[p->ndim - 1] % E == 0;
  for (int k = 0; k < c->n_in; k++) {
    if (!in[k]) return KT_ERR_INVALID;
    p->in[k] = in[k];
    p->in_dtype[k] = c->in_dtype[k];
    chain_layout(p, p->in_stride[k], in[k], k, &p->flat, &p->vec);
  }
  for (int k = 0; k < c->n_out; k++) {
    if (!out[k]) return KT_ERR_INVALID;
    p->out[k] = out[k];
    p->out_dtype[k] = c->out_dtype[k];
    chain_layout(p, p->out_stride[k], out[k], k, &p->out_flat, &p->out_vec);
  }
  for (int k = 0; k < KT_CHAIN_MAX_CONST; k++) p->consts[k] = c->consts[k];
  chain_lower(c, p);
  return KT_OK;
}

// Threads a block: fewer when the program needs many slots, so a block's lanes fit.
int chain_threads(int n_slots) { return n_slots <= 6 ? 256 : n_slots <= 12 ? 128 : 64; }

}  // namespace

extern "C" kt_status kt_chain_run(const kt_chain *c, const void *const *in, void *const *out, void *stream) {
  ChainProg p;
  int64_t n = 0;
  kt_status st = chain_setup(c, in, out, &p, &n);
  if (st != KT_OK || n == 0) return st;
  const int nt = chain_threads(p.n_slots);
  const size_t smem = (size_t)p.n_slots * nt * E * sizeof(float);   // at most 32 slots x 64 x 32 B = 64 KB
  // the device's SMs and its opt-in to more than 48 KB of dynamic shared memory, each read or
  // raised once a device (kt::per_device), not on every launch
  static std::atomic<int> sm_count[64], big_smem[64];
  const int sms = kt::per_device(sm_count, 132, [](int dev) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess ? v : 0;
  });
  auto opt_in = [](int) {
    return cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024) == cudaSuccess;
  };
  if (smem > 48 * 1024 && kt::per_device(big_smem, 0, opt_in) != 1) {
    // a device past the 64th, or a failure: try once more for the error to report
    cudaError_t e = cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
    if (e != cudaSuccess) return kt::status_of(e);
  }
  const int64_t tile = (int64_t)nt * E;
  int64_t blocks = (n + tile - 1) / tile;
  const int64_t cap = (int64_t)sms * (2048 / nt);   // one wave at full occupancy; the loop strides over the rest
  if (blocks > cap) blocks = cap;
  chain_kernel<<<(unsigned)blocks, nt, smem, (cudaStream_t)stream>>>(p, n);
  return kt::status_of(cudaGetLastError());
}

extern "C" kt_status kt_chain_run_host(const kt_chain *c, const void *const *in, void *const *out) {
  ChainProg p;
  int64_t n = 0;
  kt_status st = chain_setup(c, in, out, &p, &n);
  if (st != KT_OK || n == 0) return st;
  float4 slots[MAX_SLOTS * E / 4];
  for (int64_t i0 = 0; i0 < n; i0 += E) chain_tile(p, slots, 0, 1, i0, n - i0 < E ? (int)(n - i0) : E);
  return KT_OK;
}
