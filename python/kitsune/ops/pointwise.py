"""Pointwise ops: add_relu, mul_tanh, bias_gelu, swiglu, channel_bias (fakes and wrappers;
their autograd is in the bridge, csrc/ops/pointwise.cpp)."""
import torch

from ._check import broadcast_shape, check, check_floats, check_grad_shape, contiguous_empty, dense, fail

_lib = torch.ops.kitsune


def _binary_out(op, named):
    """The output of a binary op or its backward (the bridge's binary_layout): the
    operands' layout where they share one shape and one dense layout, else contiguous."""
    check_floats(op, named, kernel=True)
    shape = broadcast_shape(op, named)
    ts = list(named.values())
    t0 = ts[0]
    if dense(t0) and all(t.shape == t0.shape and t.stride() == t0.stride() for t in ts):
        return torch.empty_like(t0)
    return contiguous_empty(t0, shape)


def _approx(op, approximate):
    if approximate not in ("none", "tanh"):
        fail(op, f"approximate must be 'none' or 'tanh', got '{approximate}'")


def _check_bias(op, x, bias, kernel):
    check_floats(op, {"x": x, "bias": bias}, kernel)
    check(op, bias.dim() == 1 and x.dim() >= 1 and bias.shape[0] == x.shape[-1],
          lambda: f"bias must be 1-D with x.size(-1) elements; got bias of shape {list(bias.shape)} for x of shape "
                  f"{list(x.shape)}")


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::add_relu")
def _(a, b):
    return _binary_out("add_relu", {"a": a, "b": b})


@torch.library.register_fake("kitsune::add_relu_backward")
def _(grad, out):
    return _binary_out("add_relu_backward", {"grad": grad, "out": out})


@torch.library.register_fake("kitsune::mul_tanh")
def _(a, b):
    return _binary_out("mul_tanh", {"a": a, "b": b})


@torch.library.register_fake("kitsune::mul_tanh_backward")
def _(grad, a, b):
    out = _binary_out("mul_tanh_backward", {"grad": grad, "a": a, "b": b})
    return out, torch.empty_like(out)


@torch.library.register_fake("kitsune::bias_gelu")
def _(x, bias, approximate="none"):
    _check_bias("bias_gelu", x, bias, kernel=True)
    _approx("bias_gelu", approximate)
    return contiguous_empty(x)


@torch.library.register_fake("kitsune::bias_gelu_backward")
def _(grad, x, bias, approximate="none"):
    _check_bias("bias_gelu_backward", x, bias, kernel=True)
    check_floats("bias_gelu_backward", {"x": x, "grad": grad}, kernel=True)
    check_grad_shape("bias_gelu_backward", grad, x)
    _approx("bias_gelu_backward", approximate)
    return contiguous_empty(x), contiguous_empty(bias)


@torch.library.register_fake("kitsune::swiglu")
def _(gate, up):
    return _binary_out("swiglu", {"gate": gate, "up": up})


@torch.library.register_fake("kitsune::swiglu_backward")
def _(grad, gate, up):
    out = _binary_out("swiglu_backward", {"grad": grad, "gate": gate, "up": up})
    return out, torch.empty_like(out)


@torch.library.register_fake("kitsune::channel_bias")
def _(y, bias, act="none"):
    if act not in ("none", "relu"):
        fail("channel_bias", f"act must be 'none' or 'relu', got '{act}'")
    check_floats("channel_bias", {"y": y, "bias": bias})
    check("channel_bias", y.dim() >= 2 and bias.dim() == 1 and bias.shape[0] == y.shape[1],
          lambda: f"need y (N, C, ...) and bias (C,); got {list(y.shape)} and {list(bias.shape)}")
    return torch.empty_like(y)


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


def channel_bias(y, bias, act="none"):
    """act(y + bias over dim 1), act "none" or "relu": a convolution's bias (and the ReLU
    after it), split from the convolution by kitsune.optimize. Its backward sums the
    bias gradient in two stages (faster than ATen's one reduction over N, H, W at small
    channel counts), in fp32, deterministically."""
    return _lib.channel_bias(y, bias, act)
