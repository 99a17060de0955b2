"""bias_cat: Conv2d outputs' biases and their concatenation (fake and wrapper;
csrc/ops/cat.cpp)."""
import torch

_lib = torch.ops.kitsune


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::bias_cat")
def _(xs, biases, dim=1):
    return torch.cat(list(xs), dim)


# ---- the Python API ------------------------------------------------------------
def bias_cat(xs, biases, dim=1):
    """torch.cat([x + b.view(-1, 1, 1) for x, b in zip(xs, biases)], dim) for Conv2d outputs x
    (N, C_i, H, W) or, unbatched, (C_i, H, W) and biases (C_i,): an Inception block's branch
    convolutions' biases and their concatenation, as kitsune.optimize takes them together.
    On CUDA, for 4-D parts concatenated over their channels (at most 8 parts sharing one
    layout, NCHW or channels-last), one kernel forward, and backward one kernel that writes
    each part's gradient dense (cuDNN copies a channel slice) and sums the bias gradients,
    plus their final column sum; equal to the unfused ops."""
    return _lib.bias_cat(list(xs), list(biases), dim)
