// python/kitsune/csrc/ops/chain.cpp — pointwise_chain (fusion/kernels/chain.cu,
// kitsune/ops/chain.py, the FX pass kitsune/fx/chains.py): a straight-line program
// over fp32 registers run per element of the inputs' broadcast shape. The CUDA path
// fills a kt_chain and launches one kernel; the CPU reference runs the same program
// an instruction at a time with ATen ops on whole fp32 tensors (the two are written
// apart, so the GPU test that compares them checks both). No autograd: the op is
// made by the FX pass inside forward and backward graphs that AOTAutograd has
// already split.
#include "../common.h"

namespace bridge {
namespace {

constexpr const char* kOp = "pointwise_chain";

int chain_dtype(at::ScalarType s, const char* what, int64_t k) {
  switch (s) {
    case at::kFloat: return KT_F32;
    case at::kHalf: return KT_F16;
    case at::kBFloat16: return KT_BF16;
    case at::kBool: return KT_CHAIN_BOOL;
    default:
      TORCH_CHECK(false, "kitsune.", kOp, ": ", what, "[", k, "] is ", s,
                  "; a chain takes float32, float16, bfloat16 and bool");
  }
}

// The program's description checked and copied into a kt_chain (everything but the
// inputs' strides); the shape is the inputs' broadcast shape.
kt_chain describe(at::TensorList inputs, at::IntArrayRef program, at::ArrayRef<double> consts,
                  at::IntArrayRef out_regs, at::ArrayRef<at::ScalarType> out_dtypes, at::IntArrayRef out_strides,
                  c10::DimVector* shape) {
  kt_chain c = {};
  TORCH_CHECK(inputs.size() <= KT_CHAIN_MAX_IN, "kitsune.", kOp, ": ", inputs.size(), " inputs; at most ",
              KT_CHAIN_MAX_IN);
  TORCH_CHECK(program.size() % 5 == 0, "kitsune.", kOp, ": program has ", program.size(),
              " entries; it must be 5 a instruction (op, dst, a, b, c)");
  TORCH_CHECK(program.size() / 5 <= KT_CHAIN_MAX_OPS, "kitsune.", kOp, ": ", program.size() / 5,
              " instructions; at most ", KT_CHAIN_MAX_OPS);
  TORCH_CHECK(consts.size() <= KT_CHAIN_MAX_CONST, "kitsune.", kOp, ": ", consts.size(), " constants; at most ",
              KT_CHAIN_MAX_CONST);
  TORCH_CHECK(!out_regs.empty() && out_regs.size() <= KT_CHAIN_MAX_OUT, "kitsune.", kOp, ": ", out_regs.size(),
              " outputs; 1 to ", KT_CHAIN_MAX_OUT);
  TORCH_CHECK(out_dtypes.size() == out_regs.size(), "kitsune.", kOp, ": ", out_regs.size(), " out_regs but ",
              out_dtypes.size(), " out_dtypes");
  c.n_in = (int32_t)inputs.size(), c.n_out = (int32_t)out_regs.size(), c.n_ops = (int32_t)(program.size() / 5);
  for (size_t k = 0; k < inputs.size(); k++) {
    c.in_dtype[k] = chain_dtype(inputs[k].scalar_type(), "inputs", (int64_t)k);
    TORCH_CHECK(inputs[k].device() == inputs[0].device(), "kitsune.", kOp, ": inputs[0] is on ", inputs[0].device(),
                " but inputs[", k, "] is on ", inputs[k].device());
  }
  for (size_t k = 0; k < out_regs.size(); k++) {
    c.out_dtype[k] = chain_dtype(out_dtypes[k], "out_dtypes", (int64_t)k);
    TORCH_CHECK(out_regs[k] >= 0 && out_regs[k] < KT_CHAIN_MAX_REGS, "kitsune.", kOp, ": out_regs[", k, "] is ",
                out_regs[k], "; registers are 0 to ", KT_CHAIN_MAX_REGS - 1);
    c.out_reg[k] = (int32_t)out_regs[k];
  }
  for (size_t j = 0; j < program.size(); j++)
    TORCH_CHECK(program[j] >= 0 && program[j] < 256, "kitsune.", kOp, ": program[", j, "] is ", program[j],
                "; each entry is 0 to 255");
  for (int j = 0; j < c.n_ops; j++)
    c.ops[j] = {(uint8_t)program[5 * j], (uint8_t)program[5 * j + 1], (uint8_t)program[5 * j + 2],
                (uint8_t)program[5 * j + 3], (uint8_t)program[5 * j + 4]};
  for (int j = 0; j < c.n_ops; j++)
    TORCH_CHECK(c.ops[j].op != KT_OP_CONST || c.ops[j].a < consts.size(), "kitsune.", kOp, ": instruction ", j,
                " reads constant ", (int)c.ops[j].a, " of ", consts.size());
  for (size_t k = 0; k < consts.size(); k++) c.consts[k] = (float)consts[k];
  std::vector<std::string> names;
  for (size_t k = 0; k < inputs.size(); k++) names.push_back("inputs[" + std::to_string(k) + "]");
  c10::DimVector s;
  for (size_t k = 0; k < inputs.size(); k++) {   // the broadcast shape, an error naming the input that does not fit
    auto ks = inputs[k].sizes();
    const size_t n = std::max(s.size(), ks.size()), ps = n - s.size(), ss = n - ks.size();
    c10::DimVector out(n);
    for (size_t i = 0; i < n; i++) {
      const int64_t x = i < ps ? 1 : s[i - ps], y = i < ss ? 1 : ks[i - ss];
      TORCH_CHECK(x == y || x == 1 || y == 1, "kitsune.", kOp, ": ", names[k], " of shape ", ks,
                  " does not broadcast with the other inputs' shape ", c10::IntArrayRef(s));
      out[i] = x == 1 ? y : x;
    }
    s = out;
  }
  TORCH_CHECK(s.size() <= KT_CHAIN_MAX_DIM, "kitsune.", kOp, ": the inputs broadcast to ", s.size(),
              " dimensions; at most ", KT_CHAIN_MAX_DIM);
  c.ndim = (int32_t)s.size();
  for (size_t d = 0; d < s.size(); d++) c.shape[d] = s[d];
  TORCH_CHECK(out_strides.empty() || out_strides.size() == out_regs.size() * s.size(), "kitsune.", kOp,
              ": out_strides has ", out_strides.size(), " entries; it must be empty (contiguous outputs) or give ",
              s.size(), " strides for each of the ", out_regs.size(), " outputs");
  for (size_t k = 0; k < out_regs.size(); k++) {
    int64_t n = 1;
    for (int d = c.ndim - 1; d >= 0; d--) {
      c.out_stride[k][d] = out_strides.empty() ? n : out_strides[k * s.size() + d];
      n *= s[d];
    }
  }
  TORCH_CHECK(kt_chain_check(&c) == KT_OK, "kitsune.", kOp, ": the program is not valid: an opcode >= ", KT_OP_COUNT,
              ", a register >= ", KT_CHAIN_MAX_REGS, " or read before it is written (inputs are registers 0 to ",
              c.n_in - 1, "), or a constant index >= ", KT_CHAIN_MAX_CONST);
  *shape = s;
  return c;
}

// Output k, empty, in the layout c gives it (strides checked dense: the kernel writes
// each element once).
Tensor new_output(const kt_chain& c, int k, const c10::DimVector& shape, const at::TensorOptions& o) {
  Tensor t = at::empty_strided(c10::IntArrayRef(shape), c10::IntArrayRef(c.out_stride[k], c.ndim), o);
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "kitsune.", kOp, ": out_strides for output ", k, " (",
              t.strides(), ") are not a dense layout of shape ", t.sizes());
  return t;
}

// What a run of the kernel's code takes: the inputs' strides over the shape (into c),
// their pointers, and the new outputs with theirs, on `options`' device.
struct Bound {
  std::vector<const void*> in;
  std::vector<Tensor> outs;
  std::vector<void*> out;
};
Bound bind(kt_chain& c, at::TensorList inputs, const c10::DimVector& shape, at::ArrayRef<at::ScalarType> out_dtypes,
           const at::TensorOptions& options) {
  Bound b;
  for (size_t k = 0; k < inputs.size(); k++) {
    Tensor e = inputs[k].expand(c10::IntArrayRef(shape));   // a view: broadcast dimensions get stride 0
    for (int d = 0; d < c.ndim; d++) c.in_stride[k][d] = shape[d] == 1 ? 0 : e.stride(d);
    b.in.push_back(inputs[k].data_ptr());   // expand keeps the storage offset: the same first element
  }
  for (size_t k = 0; k < out_dtypes.size(); k++) {
    b.outs.push_back(new_output(c, (int)k, shape, options.dtype(out_dtypes[k])));
    b.out.push_back(b.outs.back().data_ptr());
  }
  return b;
}

std::vector<Tensor> chain_cuda(at::TensorList inputs, at::IntArrayRef program, at::ArrayRef<double> consts,
                               at::IntArrayRef out_regs, at::ArrayRef<at::ScalarType> out_dtypes,
                               at::IntArrayRef out_strides) {
  c10::DimVector shape;
  kt_chain c = describe(inputs, program, consts, out_regs, out_dtypes, out_strides, &shape);
  TORCH_CHECK(!inputs.empty(), "kitsune.", kOp, ": the CUDA kernel needs an input to name the device");
  TORCH_CHECK(inputs[0].is_cuda(), "kitsune.", kOp, ": inputs[0] is on ", inputs[0].device());
  c10::cuda::CUDAGuard g(inputs[0].device());
  Bound b = bind(c, inputs, shape, out_dtypes, inputs[0].options());
  check_launch(kt_chain_run(&c, b.in.data(), b.out.data(), stream_of(b.outs[0])), kOp);
  return b.outs;
}

// One instruction over whole fp32 tensors, as the kernel computes it per element.
Tensor chain_op_cpu(int op, const Tensor& a, const Tensor& b, const Tensor& c, double k) {
  switch (op) {
    case KT_OP_CONST: return at::scalar_tensor(k, at::kFloat);
    case KT_OP_ADD: return a + b;
    case KT_OP_SUB: return a - b;
    case KT_OP_MUL: return a * b;
    case KT_OP_DIV: return a / b;
    case KT_OP_MAX: return at::maximum(a, b);
    case KT_OP_MIN: return at::minimum(a, b);
    case KT_OP_POW: return at::pow(a, b);
    case KT_OP_NEG: return -a;
    case KT_OP_EXP: return at::exp(a);
    case KT_OP_LOG: return at::log(a);
    case KT_OP_TANH: return at::tanh(a);
    case KT_OP_SIGMOID: return at::sigmoid(a);
    case KT_OP_ERF: return at::erf(a);
    case KT_OP_RSQRT: return at::rsqrt(a);
    case KT_OP_SQRT: return at::sqrt(a);
    case KT_OP_RELU: return at::relu(a);
    case KT_OP_GELU: return at::gelu(a);
    case KT_OP_GELU_TANH: return at::gelu(a, "tanh");
    case KT_OP_SILU: return at::silu(a);
    case KT_OP_ABS: return at::abs(a);
    case KT_OP_RECIP: return at::reciprocal(a);
    case KT_OP_LOG1P: return at::log1p(a);
    case KT_OP_GT: return (a > b).to(at::kFloat);
    case KT_OP_LT: return (a < b).to(at::kFloat);
    case KT_OP_GE: return (a >= b).to(at::kFloat);
    case KT_OP_LE: return (a <= b).to(at::kFloat);
    case KT_OP_EQ: return (a == b).to(at::kFloat);
    case KT_OP_NE: return (a != b).to(at::kFloat);
    case KT_OP_WHERE: return at::where(a != 0, b, c);
    case KT_OP_ROUND_BF16: return a.to(at::kBFloat16).to(at::kFloat);
    case KT_OP_ROUND_F16: return a.to(at::kHalf).to(at::kFloat);
    case KT_OP_TO_BOOL: return (a != 0).to(at::kFloat);
    case KT_OP_GELU_BWD: return at::gelu_backward(a, b);
    case KT_OP_GELU_TANH_BWD: return at::gelu_backward(a, b, "tanh");
  }
  TORCH_CHECK(false, "kitsune.", kOp, ": opcode ", op, " unknown");   // describe refused it already
}

std::vector<Tensor> chain_cpu(at::TensorList inputs, at::IntArrayRef program, at::ArrayRef<double> consts,
                              at::IntArrayRef out_regs, at::ArrayRef<at::ScalarType> out_dtypes,
                              at::IntArrayRef out_strides) {
  c10::DimVector shape;
  kt_chain c = describe(inputs, program, consts, out_regs, out_dtypes, out_strides, &shape);
  const at::Device dev = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  std::vector<Tensor> r(KT_CHAIN_MAX_REGS);
  // every register at the full shape, dense (ATen's CPU gelu_backward refuses a broadcast operand)
  for (int k = 0; k < c.n_in; k++) r[k] = inputs[k].to(at::kFloat).expand(c10::IntArrayRef(shape)).contiguous();
  for (int j = 0; j < c.n_ops; j++) {
    const kt_chain_op& o = c.ops[j];
    const bool is_const = o.op == KT_OP_CONST;
    Tensor none;
    auto reg = [&](uint8_t i) { return r[i].defined() ? r[i] : none; };
    r[o.dst] = chain_op_cpu(o.op, is_const ? none : reg(o.a), reg(o.b), reg(o.c), is_const ? c.consts[o.a] : 0.0)
                   .to(dev);
  }
  std::vector<Tensor> outs;
  for (int k = 0; k < c.n_out; k++) {
    // a fresh tensor each, never an input's storage (an output may be an input register)
    Tensor v = r[c.out_reg[k]].expand(c10::IntArrayRef(shape));
    Tensor o = new_output(c, k, shape, v.options().dtype(out_dtypes[k]));
    outs.push_back(out_dtypes[k] == at::kBool ? o.copy_(v != 0) : o.copy_(v));
  }
  return outs;
}

// _pointwise_chain_interpreted: the CUDA kernel's per-element code run on the CPU
// (kt_chain_run_host), for tests: it and chain_cpu are written apart, so comparing them
// checks the kernel's addressing, loads, stores and arithmetic without a GPU.
std::vector<Tensor> chain_interpreted(at::TensorList inputs, at::IntArrayRef program, at::ArrayRef<double> consts,
                                      at::IntArrayRef out_regs, at::ArrayRef<at::ScalarType> out_dtypes,
                                      at::IntArrayRef out_strides) {
  c10::DimVector shape;
  kt_chain c = describe(inputs, program, consts, out_regs, out_dtypes, out_strides, &shape);
  Bound b = bind(c, inputs, shape, out_dtypes, at::TensorOptions());
  TORCH_CHECK(kt_chain_run_host(&c, b.in.data(), b.out.data()) == KT_OK, "kitsune._pointwise_chain_interpreted failed");
  return b.outs;
}

}  // namespace

TORCH_LIBRARY_IMPL(kitsune, CPU, m) {
  m.impl("pointwise_chain", &chain_cpu);
  m.impl("_pointwise_chain_interpreted", &chain_interpreted);
}
TORCH_LIBRARY_IMPL(kitsune, CUDA, m) { m.impl("pointwise_chain", &chain_cuda); }

}  // namespace bridge
