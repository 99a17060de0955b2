"""rms_norm: RMSNorm over the last dimension (fakes and wrapper; autograd in the bridge,
csrc/ops/rms_norm.cpp)."""
import torch

from ._check import check, check_floats, check_grad_shape, contiguous_empty, fail

_lib = torch.ops.kitsune


def _check(op, x, weight, eps, grad=None):
    """rms_norm's checks on both devices (the bridge's check_weight)."""
    check_floats(op, {"x": x, "weight": weight, "grad": grad}, kernel=True)
    if grad is not None:
        check_grad_shape(op, grad, x)
    check(op, weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1],
          lambda: f"weight must be 1-D with x.size(-1) elements; got weight of shape {list(weight.shape)} "
                  f"for x of shape {list(x.shape)}")
    if grad is None and not eps >= 0:
        fail(op, f"eps must be >= 0, got {eps}")


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::rms_norm")
def _(x, weight, eps=1e-6):
    _check("rms_norm", x, weight, eps)
    return contiguous_empty(x)


@torch.library.register_fake("kitsune::rms_norm_backward")
def _(grad, x, weight, eps=1e-6):
    _check("rms_norm_backward", x, weight, eps, grad)
    return contiguous_empty(x), contiguous_empty(weight)


# ---- the Python API ------------------------------------------------------------
def rms_norm(x, weight, eps=1e-6):
    """x * rsqrt(mean(x^2, -1) + eps) * weight (RMSNorm over the last dimension), fused."""
    return _lib.rms_norm(x, weight, eps)
