"""BatchNorm ops: batch_norm_relu, batch_norm_add_relu (fakes and wrappers; kernels and
autograd in the bridge, csrc/ops/batch_norm.cpp)."""
import torch

_lib = torch.ops.kitsune


def _bn_fake(x):
    """(out, save_mean, save_invstd) of the BatchNorm ops: statistics fp32 (fp64 for fp64)."""
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[1],), dtype=st),
            x.new_empty((x.shape[1],), dtype=st))


def _bn_backward_fake(x, weight, residual):
    """(gx, [g_residual,] gw, gb) of the BatchNorm ops' backward."""
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (gx,) + ((torch.empty_like(gx),) if residual else ()) + (
        torch.empty_like(weight) if weight is not None else x.new_empty((0,)), x.new_empty((x.shape[1],)))


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::batch_norm_relu")
def _(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake(x, weight, residual=False)


@torch.library.register_fake("kitsune::batch_norm_add_relu")
def _(x, residual, weight, bias, running_mean, running_var, training, momentum, eps):
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_add_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake(x, weight, residual=True)


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
