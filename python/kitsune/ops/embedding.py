"""embedding: F.embedding with Kitsune's weight gradient (fake and wrapper;
csrc/ops/embedding.cpp)."""
import torch

_lib = torch.ops.kitsune


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::embedding")
def _(weight, indices, padding_idx=-1):
    return torch.ops.aten.embedding.default(weight, indices, padding_idx)


# ---- the Python API ------------------------------------------------------------
def embedding(indices, weight, padding_idx=None):
    """F.embedding(indices, weight, padding_idx) (no max_norm, scale_grad_by_freq or
    sparse). On CUDA the weight gradient is Kitsune's: a radix sort over the
    vocabulary's bits only and a block per run of equal indices, in a fixed order."""
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:   # as F.embedding counts it
        padding_idx += weight.shape[0]
    return _lib.embedding(weight, indices, padding_idx)
