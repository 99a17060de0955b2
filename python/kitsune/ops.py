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


def _add_relu_setup(ctx, inputs, output):
    a, b = inputs
    ctx.shapes = (a.shape, b.shape)
    ctx.save_for_backward(output)


def _add_relu_bwd(ctx, grad):
    (out,) = ctx.saved_tensors
    g = _lib.add_relu_backward(grad, out)
    return tuple(g if g.shape == s else g.sum_to_size(s) for s in ctx.shapes)


def _binary(backward):
    """(setup, backward) for an op f(a, b) whose backward op takes (grad, a, b) and
    returns both gradients at the broadcast shape (mul_tanh, swiglu)."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def bwd(ctx, grad):
        a, b = ctx.saved_tensors
        ga, gb = backward(grad, a, b)
        return _sum_to(ga, a), _sum_to(gb, b)
    return bwd, setup


def _with_param(backward):
    """(setup, backward) for an op f(x, p, option) - bias_gelu(x, bias, approximate),
    rms_norm(x, weight, eps) - whose backward op takes (grad, x, p, option) and
    returns (grad_x, grad_p)."""
    def setup(ctx, inputs, output):
        x, p, ctx.option = inputs
        ctx.save_for_backward(x, p)

    def bwd(ctx, grad):
        x, p = ctx.saved_tensors
        gx, gp = backward(grad, x, p, ctx.option)
        return gx, gp, None
    return bwd, setup


for _name, (_bwd, _setup) in {
    "add_relu": (_add_relu_bwd, _add_relu_setup),
    "mul_tanh": _binary(_lib.mul_tanh_backward),
    "swiglu": _binary(_lib.swiglu_backward),
    "bias_gelu": _with_param(_lib.bias_gelu_backward),
    "rms_norm": _with_param(_lib.rms_norm_backward),
}.items():
    torch.library.register_autograd(f"kitsune::{_name}", _bwd, setup_context=_setup)


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
