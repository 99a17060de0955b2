"""LayerNorm ops: layer_norm_relu, add_layer_norm (fakes and wrappers; autograd in the
bridge, csrc/ops/layer_norm.cpp)."""
import math

import torch

from ._check import check, check_floats, check_grad_shape, contiguous_empty, fail

_lib = torch.ops.kitsune


def _norm_rows(op, x, shape, weight, bias, xname="x"):
    """The bridge's norm_rows: a LayerNorm over x's trailing dims `shape`."""
    check_floats(op, {xname: x, "weight": weight, "bias": bias}, kernel=True)
    shape = list(shape)
    k = len(shape)
    check(op, k >= 1 and x.dim() >= k and list(x.shape[x.dim() - k:]) == shape,
          lambda: f"normalized_shape {shape} must match the trailing dimensions of {xname}, of shape {list(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check(op, list(p.shape) == shape,
                  lambda: f"{name} must have shape {shape} (normalized_shape); got {list(p.shape)}")
    check(op, math.prod(shape) > 0, lambda: f"normalized_shape {shape} has no elements")


def _eps(op, eps):
    if not eps >= 0:
        fail(op, f"eps must be >= 0, got {eps}")


def _add_ln_rows(op, x, residual, weight, bias):
    """The bridge's add_ln_rows: over the last dim; the backward passes the sum and no residual."""
    xname = "x" if residual is not None else "sum"
    check_floats(op, {xname: x, "residual": residual, "weight": weight, "bias": bias}, kernel=True)
    if residual is not None:
        check(op, x.shape == residual.shape,
              lambda: f"x and residual must have one shape; got {list(x.shape)} and {list(residual.shape)}")
    if x.dim() < 1:
        fail(op, f"{xname} must have at least one dimension; got a 0-dim tensor")
    _norm_rows(op, x, x.shape[-1:], weight, bias, xname)


def _check_grads(op, grad, grad_sum, h, hname):
    check_floats(op, {hname: h, "grad": grad, "grad_sum": grad_sum}, kernel=True)
    check_grad_shape(op, grad, h, "grad", hname)
    if grad_sum is not None:
        check_grad_shape(op, grad_sum, h, "grad_sum", hname)


def _param_grads(like, weight, bias):
    """The parameters' gradients: contiguous, of their shape and dtype; (0,) of like's dtype where absent."""
    def g(p):
        return contiguous_empty(p) if p is not None else like.new_empty((0,))
    return g(weight), g(bias)


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::layer_norm_relu")
def _(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    _eps("layer_norm_relu", eps)
    _norm_rows("layer_norm_relu", x, normalized_shape, weight, bias)
    return contiguous_empty(x)


@torch.library.register_fake("kitsune::layer_norm_relu_backward")
def _(grad, x, normalized_shape, weight, bias, eps):
    _norm_rows("layer_norm_relu_backward", x, normalized_shape, weight, bias)
    _check_grads("layer_norm_relu_backward", grad, None, x, "x")
    return (contiguous_empty(x), *_param_grads(x, weight, bias))


@torch.library.register_fake("kitsune::add_layer_norm")
def _(x, residual, weight=None, bias=None, eps=1e-5):
    _eps("add_layer_norm", eps)
    _add_ln_rows("add_layer_norm", x, residual, weight, bias)
    return contiguous_empty(x), contiguous_empty(x)   # the sum contiguous too, whatever x's layout


@torch.library.register_fake("kitsune::add_layer_norm_backward")
def _(grad, grad_sum, sum, weight, bias, eps):
    _add_ln_rows("add_layer_norm_backward", sum, None, weight, bias)
    _check_grads("add_layer_norm_backward", grad, grad_sum, sum, "sum")
    return (contiguous_empty(sum), *_param_grads(sum, weight, bias))


# ---- the Python API ------------------------------------------------------------
def layer_norm_relu(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """relu(F.layer_norm(x, normalized_shape, weight, bias, eps)), fused."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _lib.layer_norm_relu(x, list(normalized_shape), weight, bias, eps)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5):
    """(x + residual, F.layer_norm(x + residual) over the last dim), in one kernel."""
    return _lib.add_layer_norm(x, residual, weight, bias, eps)
