"""Reductions: sum_squared, mean_abs, channel_sum (fakes and wrappers; csrc/ops/reduce.cpp)."""
import torch

from ._check import check, check_float, fail

_lib = torch.ops.kitsune


def _reduced_shape(op, x, dim, keepdim):
    """The output's shape (the bridge's reduce_view): no dims or an empty list reduce all."""
    check_float(op, "x", x, kernel=True)
    nd = max(x.dim(), 1)
    for d in dim or ():
        if not -nd <= d < nd:
            fail(op, f"dim {d} is out of range for a tensor of {x.dim()} dimensions")
    dims = set(range(nd)) if not dim else {d % nd for d in dim}
    return [1 if d in dims else x.shape[d] for d in range(x.dim()) if keepdim or d not in dims]


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::sum_squared")
def _(x, dim=None, keepdim=False):
    return x.new_empty(_reduced_shape("sum_squared", x, dim, keepdim))


@torch.library.register_fake("kitsune::mean_abs")
def _(x, dim=None, keepdim=False):
    return x.new_empty(_reduced_shape("mean_abs", x, dim, keepdim))


@torch.library.register_fake("kitsune::channel_sum")
def _(g):
    check_float("channel_sum", "g", g)
    check("channel_sum", g.dim() >= 2, lambda: f"need (N, C, ...), got {list(g.shape)}")
    return g.new_empty((g.shape[1],), dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)


# ---- the Python API ------------------------------------------------------------
def _dims(dim):
    return None if dim is None else [dim] if isinstance(dim, int) else list(dim)


def sum_squared(x, dim=None, keepdim=False):
    """sum(x * x) over dim (all dims by default), fp32 accumulation."""
    return _lib.sum_squared(x, _dims(dim), keepdim)


def mean_abs(x, dim=None, keepdim=False):
    """mean(|x|) over dim (all dims by default), fp32 accumulation."""
    return _lib.mean_abs(x, _dims(dim), keepdim)
