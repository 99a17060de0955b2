"""LayerNorm ops: layer_norm_relu, add_layer_norm (fakes and wrappers; autograd in the
bridge, csrc/ops/layer_norm.cpp)."""
import torch

_lib = torch.ops.kitsune


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::layer_norm_relu")
def _(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _param_grads(like, weight, bias):
    def g(p):
        return torch.empty_like(p) if p is not None else like.new_empty((0,))
    return g(weight), g(bias)


@torch.library.register_fake("kitsune::layer_norm_relu_backward")
def _(grad, x, normalized_shape, weight, bias, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), *_param_grads(x, weight, bias))


@torch.library.register_fake("kitsune::add_layer_norm")
def _(x, residual, weight=None, bias=None, eps=1e-5):
    torch._check(x.shape == residual.shape, lambda: f"kitsune.add_layer_norm: x and residual must have one shape; "
                                                     f"got {tuple(x.shape)} and {tuple(residual.shape)}")
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("kitsune::add_layer_norm_backward")
def _(grad, grad_sum, sum, weight, bias, eps):
    return (torch.empty_like(sum, memory_format=torch.contiguous_format), *_param_grads(sum, weight, bias))


# ---- the Python API ------------------------------------------------------------
def layer_norm_relu(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """relu(F.layer_norm(x, normalized_shape, weight, bias, eps)), fused."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _lib.layer_norm_relu(x, list(normalized_shape), weight, bias, eps)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5):
    """(x + residual, F.layer_norm(x + residual) over the last dim), in one kernel."""
    return _lib.add_layer_norm(x, residual, weight, bias, eps)
