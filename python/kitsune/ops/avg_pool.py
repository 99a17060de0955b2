"""global_avg_pool: the mean over H and W (fake and wrapper; csrc/ops/avg_pool.cpp)."""
import torch

from ._check import check_float, fail

_lib = torch.ops.kitsune


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::global_avg_pool")
def _(x, dim, keepdim=False):
    check_dims("global_avg_pool", x, dim)
    return torch.ops.aten.mean.dim(x, dim, keepdim)


def check_dims(op, x, dim):
    """The bridge's checks: x floating, each dim in range (ATen's mean would raise an
    IndexError that does not name the op)."""
    check_float(op, "x", x)
    nd = max(x.dim(), 1)
    for d in dim:
        if not -nd <= d < nd:
            fail(op, f"dim {d} is out of range for a tensor of {x.dim()} dimensions")


# ---- the Python API ------------------------------------------------------------
def global_avg_pool(x, dim=(-2, -1), keepdim=False):
    """x.mean(dim, keepdim): global average pooling when dim names H and W of an (N, C, H,
    W) x ((2, 3) or (-2, -1)). On CUDA, for a channels-last x in fp32/fp16/bf16, Kitsune's
    kernels: a fixed-order fp32 sum a channel, no workspace, and a backward that writes
    the gradient dense in channels-last. ATen's mean elsewhere (the CPU, NCHW, other dims
    or ranks), with ATen's errors."""
    return _lib.global_avg_pool(x, [dim] if isinstance(dim, int) else list(dim), bool(keepdim))
