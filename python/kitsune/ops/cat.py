"""bias_cat: Conv2d outputs' biases and their concatenation (fake and wrapper;
csrc/ops/cat.cpp)."""
import torch

from ._check import check, check_float, check_floats, fail

_lib = torch.ops.kitsune


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::bias_cat")
def _(xs, biases, dim=1):
    op = "bias_cat"
    if not xs or len(xs) != len(biases):
        fail(op, f"need as many biases as parts (at least one), got {len(xs)} parts and {len(biases)} biases")
    for i, (x, b) in enumerate(zip(xs, biases)):
        check(op, x.dim() in (3, 4) and x.dim() == xs[0].dim() and b.dim() == 1 and b.shape[0] == x.shape[-3],
              lambda: f"part {i}: need x (N, C, H, W) or (C, H, W), as part 0, and bias (C,); got {list(x.shape)} "
                      f"and {list(b.shape)}")
        check_float(op, f"part {i}", x)
        check_floats(op, {"a part": x, "its bias": b})
        check_floats(op, {"part 0": xs[0], f"part {i}": x})
    nd = xs[0].dim()
    if not -nd <= dim < nd:
        fail(op, f"dim {dim} is out of range for parts of {nd} dimensions")
    d = dim % nd
    for i, x in enumerate(xs[1:], 1):
        check(op, all(j == d or x.shape[j] == xs[0].shape[j] for j in range(nd)),
              lambda: f"part {i} of shape {list(x.shape)} does not match part 0's {list(xs[0].shape)} but in dim {dim}")
    # ATen's cat of the parts plus their biases, each in empty_like(part)'s layout (the
    # kernels, on parts of one dense layout, write the same layout)
    return torch.cat([torch.empty_like(x) for x in xs], dim)


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
