"""embedding: F.embedding with Kitsune's weight gradient (fake and wrapper;
csrc/ops/embedding.cpp)."""
import torch

from ._check import check, check_devices, check_float, fail

_lib = torch.ops.kitsune


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::embedding")
def _(weight, indices, padding_idx=-1):
    op = "embedding"
    check_devices(op, {"weight": weight, "indices": indices})
    check_float(op, "weight", weight)
    check(op, weight.dim() == 2, lambda: f"weight must be (num_embeddings, embedding_dim), got {list(weight.shape)}")
    check(op, padding_idx == -1 or 0 <= padding_idx < weight.shape[0],
          lambda: f"padding_idx must be -1 (none) or in [0, {weight.shape[0]}), got {padding_idx}")
    if indices.dtype not in (torch.int64, torch.int32):
        fail(op, f"indices must be int64 or int32, got {indices.dtype}")
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
