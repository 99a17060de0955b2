"""BatchNorm ops: batch_norm_relu, batch_norm_add_relu (fakes and wrappers; kernels and
autograd in the bridge, csrc/ops/batch_norm.cpp)."""
import torch

from ._check import check, check_devices, check_float, check_floats, contiguous_empty, fail

_lib = torch.ops.kitsune


def _format(x):
    """The outputs' layout (the bridge's bn_format): channels-last where a 4-D x is that and
    not NCHW-contiguous too, else contiguous."""
    cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if cl else torch.contiguous_format


def _like(x):
    return torch.empty_like(x, memory_format=_format(x))


def _shape(op, x, named):
    """The bridge's bn_shape: x (N, C, ...) and per-channel tensors of C elements on x's device."""
    check(op, x.dim() >= 2, lambda: f"x must be (N, C, ...); got shape {list(x.shape)}")
    C = x.shape[1]
    for name, t in named.items():
        if t is not None:
            check(op, t.dim() == 1 and t.shape[0] == C and t.device == x.device,
                  lambda: f"{name} must have C = {C} elements on {x.device}; got {list(t.shape)} on {t.device}")


def _forward_checks(op, x, residual, weight, bias, running_mean, running_var, training, eps):
    check_devices(op, {"x": x, "weight": weight, "bias": bias, "running_mean": running_mean,
                       "running_var": running_var})
    check_floats(op, {"x": x, "weight": weight, "bias": bias}, kernel=True)
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None:
            check_float(op, name, t)
    stats = {"running_mean": running_mean, "running_var": running_var}
    _shape(op, x, {"weight": weight, "bias": bias, **stats})
    per_channel = x.numel() // x.shape[1] if x.shape[0] != 0 and x.shape[1] != 0 else 0
    check(op, not training or per_channel > 1,
          lambda: f"expected more than 1 value per channel when training, got {per_channel}")
    if not training and (running_mean is None or running_var is None):
        fail(op, "eval mode needs running_mean and running_var")
    if not eps >= 0:
        fail(op, f"eps must be >= 0, got {eps}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            fail(op, f"residual must have x's shape, dtype and device {list(x.shape)} {x.dtype} {x.device}; got "
                     f"{list(residual.shape)} {residual.dtype} {residual.device}")


def _bn_fake(x):
    """(out, save_mean, save_invstd) of the BatchNorm ops: statistics fp32 (fp64 for fp64)."""
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _like(x), x.new_empty((x.shape[1],), dtype=st), x.new_empty((x.shape[1],), dtype=st)


def _bn_backward_fake(op, grad, x, out, weight, save_mean, save_invstd, residual):
    """(gx, [g_residual,] gw, gb) of the BatchNorm ops' backward (the bridge's bn_backward_checks)."""
    check_devices(op, {"x": x, "grad": grad, "out": out, "weight": weight, "save_mean": save_mean,
                       "save_invstd": save_invstd})
    check_floats(op, {"x": x, "grad": grad, "out": out, "weight": weight}, kernel=True)
    check_float(op, "save_mean", save_mean)
    check_float(op, "save_invstd", save_invstd)
    _shape(op, x, {"weight": weight})
    check(op, grad.shape == x.shape and out.shape == x.shape,
          lambda: f"grad and out must have x's shape {list(x.shape)}; got {list(grad.shape)} and {list(out.shape)}")
    C = x.shape[1]
    check(op, save_mean.dim() == 1 and save_mean.shape[0] == C and save_invstd.dim() == 1 and
          save_invstd.shape[0] == C,
          lambda: f"save_mean and save_invstd must have C = {C} elements; got {list(save_mean.shape)} and "
                  f"{list(save_invstd.shape)}")
    gx = _like(x)
    return (gx,) + ((_like(x),) if residual else ()) + (
        contiguous_empty(weight) if weight is not None else x.new_empty((0,)), x.new_empty((C,)))


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::batch_norm_relu")
def _(x, weight, bias, running_mean, running_var, training, momentum, eps):
    _forward_checks("batch_norm_relu", x, None, weight, bias, running_mean, running_var, training, eps)
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake("batch_norm_relu_backward", grad, x, out, weight, save_mean, save_invstd, False)


@torch.library.register_fake("kitsune::batch_norm_add_relu")
def _(x, residual, weight, bias, running_mean, running_var, training, momentum, eps):
    _forward_checks("batch_norm_add_relu", x, residual, weight, bias, running_mean, running_var, training, eps)
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_add_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake("batch_norm_add_relu_backward", grad, x, out, weight, save_mean, save_invstd, True)


# ---- the Python API ------------------------------------------------------------
def batch_norm_relu(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
    eps)) over dim 1, fused; the running stats are updated in place in training."""
    return _lib.batch_norm_relu(x, weight, bias, running_mean, running_var, training, momentum, eps)[0]


def batch_norm_add_relu(x, residual, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                        eps=1e-5):
    """relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
    eps) + residual), residual of x's shape and dtype: a ResNet block's end in one
    pass each way (the normalized values are never stored; the backward writes the
    residual's gradient beside x's)."""
    return _lib.batch_norm_add_relu(x, residual, weight, bias, running_mean, running_var, training, momentum, eps)[0]
