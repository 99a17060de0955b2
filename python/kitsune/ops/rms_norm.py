"""rms_norm: RMSNorm over the last dimension (fakes and wrapper; autograd in the bridge,
csrc/ops/rms_norm.cpp)."""
import torch

_lib = torch.ops.kitsune


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::rms_norm")
def _(x, weight, eps=1e-6):
    torch._check(weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"kitsune.rms_norm: weight must be 1-D with x.size(-1) elements; got {tuple(weight.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::rms_norm_backward")
def _(grad, x, weight, eps=1e-6):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


# ---- the Python API ------------------------------------------------------------
def rms_norm(x, weight, eps=1e-6):
    """x * rsqrt(mean(x^2, -1) + eps) * weight (RMSNorm over the last dimension), fused."""
    return _lib.rms_norm(x, weight, eps)
