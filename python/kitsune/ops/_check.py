"""The checks every fake kernel makes: the bridge's own (csrc/common.h: check_float,
check_devices, check_floats, broadcast_sizes), in the same words. A fake kernel refuses
what the real kernel refuses, so a traced graph never promises a result the op would
not give, and a CPU tensor beside a meta one (which dispatches here) is refused
instead of answered with an empty tensor.

Arguments are given as ``{"name": tensor}`` dicts in the op's order; a None value (an
optional tensor not given) is skipped. kernel=True: the argument goes to a Kitsune CUDA
kernel when it is on CUDA, which takes float32, float16 and bfloat16; the CPU references
and the ATen paths also take float64 (gradcheck uses it)."""
import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_FLOATS = FLOATS[:3]


def _given(named):
    return [(n, t) for n, t in named.items() if t is not None]


def fail(op, msg):
    raise RuntimeError(f"kitsune.{op}: {msg}")


def check(op, cond, msg):
    """torch._check with the op's name: cond may be symbolic (a guard, not a failure)."""
    torch._check(cond, lambda: f"kitsune.{op}: {msg() if callable(msg) else msg}")


def check_float(op, name, t, kernel=False):
    if kernel and t.device.type == "cuda":
        if t.dtype not in KERNEL_FLOATS:
            fail(op, f"{name} must be float32, float16 or bfloat16 (the CUDA kernel's dtypes); got {t.dtype}")
    elif t.dtype not in FLOATS:
        fail(op, f"{name} must be floating point (float32, float16, bfloat16 or float64); got {t.dtype}")


def check_devices(op, named):
    given = _given(named)
    for name, t in given[1:]:
        if t.device != given[0][1].device:
            fail(op, f"{given[0][0]} is on {given[0][1].device} but {name} is on {t.device}")


def check_floats(op, named, kernel=False):
    """One device, floating point, one dtype (csrc/common.h's check_floats)."""
    check_devices(op, named)
    given = _given(named)
    for name, t in given:
        check_float(op, name, t, kernel)
        if t.dtype != given[0][1].dtype:
            fail(op, f"{given[0][0]} is {given[0][1].dtype} but {name} is {t.dtype} (cast one of them)")


def broadcast_shape(op, named):
    """The shape the arguments broadcast to, or an error naming them."""
    given = _given(named)
    shape = tuple(given[0][1].shape)
    for name, t in given[1:]:
        try:
            shape = tuple(torch.broadcast_shapes(shape, t.shape))
        except RuntimeError:
            fail(op, f"{name} of shape {list(t.shape)} does not broadcast with {given[0][0]}'s shape {list(shape)}")
    return shape


def expandable(shape, to):
    """Whether a tensor of shape broadcasts to `to` (expand would take it)."""
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == d for s, d in zip(reversed(tuple(shape)), reversed(tuple(to))))


def check_grad_shape(op, grad, x, gname="grad", xname="x"):
    check(op, expandable(grad.shape, x.shape),
          lambda: f"{gname} of shape {list(grad.shape)} does not broadcast to {xname}'s shape {list(x.shape)}")


def dense(t):
    """t occupies its memory without gaps or overlaps (at::Tensor::is_non_overlapping_and_dense)."""
    return torch._prims_common.is_non_overlapping_and_dense_or_false(t)


def contiguous_empty(t, shape=None, dtype=None):
    """A new contiguous tensor on t's device (t's shape and dtype by default)."""
    return t.new_empty(tuple(t.shape) if shape is None else tuple(shape), dtype=t.dtype if dtype is None else dtype)
