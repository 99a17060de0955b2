"""Kitsune's fused ops: ``torch.ops.kitsune.*`` and their Python side.

The schemas and the CUDA and CPU kernels are registered by the C++ bridge
(python/kitsune/csrc/bridge.cpp): CUDA runs the precompiled kernels of
fusion/kernels on torch's current stream, CPU runs the reference semantics in
ATen. This module adds what the bridge does not:

  fake (meta) kernels  so the ops trace under torch.compile / FakeTensor: they
                       give the output shape, dtype and device without computing
  autograd             each forward op's backward calls the matching
                       ``*_backward`` op, whose CUDA kernel runs on the GPU

Ops (reference semantics):
  add_relu(a, b)               relu(a + b)
  mul_tanh(a, b)               tanh(a * b)
  bias_gelu(x, bias, approximate="none")   gelu(x + bias), bias along the last dim
  swiglu(gate, up)             silu(gate) * up
  rms_norm(x, weight, eps=1e-6)   x * rsqrt(mean(x^2, -1) + eps) * weight
Binary ops broadcast like ``a + b``. dtypes: float32, float16, bfloat16.
"""
import torch

from . import _native

_native.bridge()   # registers the schemas and kernels

_lib = torch.ops.kitsune


def _broadcast_like(a, b):
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype, device=a.device)


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::add_relu")
def _(a, b):
    return _broadcast_like(a, b)


@torch.library.register_fake("kitsune::add_relu_backward")
def _(grad, out):
    return _broadcast_like(grad, out)


@torch.library.register_fake("kitsune::mul_tanh")
def _(a, b):
    return _broadcast_like(a, b)


def _two_grads(grad, a, b):
    shape = torch.broadcast_shapes(grad.shape, a.shape, b.shape)
    return (torch.empty(shape, dtype=a.dtype, device=a.device), torch.empty(shape, dtype=a.dtype, device=a.device))


torch.library.register_fake("kitsune::mul_tanh_backward")(_two_grads)


@torch.library.register_fake("kitsune::bias_gelu")
def _(x, bias, approximate="none"):
    torch._check(bias.dim() == 1 and x.dim() >= 1 and bias.shape[0] == x.shape[-1],
                 lambda: f"kitsune.bias_gelu: bias must be 1-D with x.size(-1) elements; got {tuple(bias.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::bias_gelu_backward")
def _(grad, x, bias, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


@torch.library.register_fake("kitsune::swiglu")
def _(gate, up):
    return _broadcast_like(gate, up)


torch.library.register_fake("kitsune::swiglu_backward")(_two_grads)


@torch.library.register_fake("kitsune::rms_norm")
def _(x, weight, eps=1e-6):
    torch._check(weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"kitsune.rms_norm: weight must be 1-D with x.size(-1) elements; got {tuple(weight.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::rms_norm_backward")
def _(grad, x, weight, eps=1e-6):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


# ---- autograd: backward ops; broadcast gradients are summed to each input's shape ----
def _sum_to(g, like):
    return g if g.shape == like.shape else g.sum_to_size(like.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _add_relu_setup(ctx, inputs, output):
    a, b = inputs
    ctx.shapes = (a.shape, b.shape)
    ctx.save_for_backward(output)


def _add_relu_bwd(ctx, grad):
    (out,) = ctx.saved_tensors
    g = _lib.add_relu_backward(grad, out)
    sa, sb = ctx.shapes
    return (g if g.shape == sa else g.sum_to_size(sa)), (g if g.shape == sb else g.sum_to_size(sb))


def _mul_tanh_bwd(ctx, grad):
    a, b = ctx.saved_tensors
    ga, gb = _lib.mul_tanh_backward(grad, a, b)
    return _sum_to(ga, a), _sum_to(gb, b)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.approximate = approximate
    ctx.save_for_backward(x, bias)


def _bias_gelu_bwd(ctx, grad):
    x, bias = ctx.saved_tensors
    gx, gb = _lib.bias_gelu_backward(grad, x, bias, ctx.approximate)
    return gx, gb, None


def _swiglu_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    gg, gu = _lib.swiglu_backward(grad, gate, up)
    return _sum_to(gg, gate), _sum_to(gu, up)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight)


def _rms_norm_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = _lib.rms_norm_backward(grad, x, weight, ctx.eps)
    return gx, gw, None


torch.library.register_autograd("kitsune::rms_norm", _rms_norm_bwd, setup_context=_rms_norm_setup)
torch.library.register_autograd("kitsune::add_relu", _add_relu_bwd, setup_context=_add_relu_setup)
torch.library.register_autograd("kitsune::mul_tanh", _mul_tanh_bwd, setup_context=_save_inputs)
torch.library.register_autograd("kitsune::bias_gelu", _bias_gelu_bwd, setup_context=_bias_gelu_setup)
torch.library.register_autograd("kitsune::swiglu", _swiglu_bwd, setup_context=_save_inputs)


# ---- the Python API ------------------------------------------------------------
def add_relu(a, b):
    """relu(a + b), fused."""
    return _lib.add_relu(a, b)


def mul_tanh(a, b):
    """tanh(a * b), fused."""
    return _lib.mul_tanh(a, b)


def bias_gelu(x, bias, approximate="none"):
    """gelu(x + bias) with bias along the last dimension; approximate is "none" (erf) or "tanh"."""
    return _lib.bias_gelu(x, bias, approximate)


def swiglu(gate, up):
    """silu(gate) * up, fused."""
    return _lib.swiglu(gate, up)


def rms_norm(x, weight, eps=1e-6):
    """x * rsqrt(mean(x^2, -1) + eps) * weight (RMSNorm over the last dimension), fused."""
    return _lib.rms_norm(x, weight, eps)
