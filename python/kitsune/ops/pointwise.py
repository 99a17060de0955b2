"""Pointwise ops: add_relu, mul_tanh, bias_gelu, swiglu, channel_bias (fakes and wrappers;
their autograd is in the bridge, csrc/ops/pointwise.cpp)."""
import torch

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


@torch.library.register_fake("kitsune::channel_bias")
def _(y, bias, act="none"):
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
