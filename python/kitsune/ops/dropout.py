"""Dropout ops: gelu_dropout, bias_dropout_add, dropout_backward, dropout_mask (fakes and
wrappers; kernels and autograd in the bridge, csrc/ops/dropout.cpp). The mask is never
stored: the backward rebuilds it from (seed, offset) with the same Philox code."""
import torch

from ._check import FLOATS, check, check_float, check_floats, check_grad_shape, contiguous_empty, fail

_lib = torch.ops.kitsune


def _rng():
    return torch.empty(2, dtype=torch.long)   # on the CPU, whatever the device, as the bridge's


def _p(op, p):
    if not 0 <= p <= 1:
        fail(op, f"dropout probability p must be in [0, 1], got {p}")


def _approx(op, approximate):
    if approximate not in ("none", "tanh"):
        fail(op, f"approximate must be 'none' or 'tanh', got '{approximate}'")


def _rng_values(op, rng):
    if rng.device.type != "cpu" or rng.dtype != torch.int64 or rng.numel() != 2:
        fail(op, f"rng must be the int64 CPU tensor of 2 values the forward returned; got {rng.dtype} "
                 f"{list(rng.shape)} on {rng.device}")


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::gelu_dropout")
def _(x, p, training=True, approximate="none"):
    check_float("gelu_dropout", "x", x, kernel=True)
    _approx("gelu_dropout", approximate)
    _p("gelu_dropout", p)
    return contiguous_empty(x), _rng()


@torch.library.register_fake("kitsune::gelu_dropout_backward")
def _(grad, x, rng, p, approximate="none"):
    op = "gelu_dropout_backward"
    _p(op, p)
    check_floats(op, {"x": x, "grad": grad}, kernel=True)
    check_grad_shape(op, grad, x)
    _approx(op, approximate)
    _rng_values(op, rng)
    return contiguous_empty(x)


@torch.library.register_fake("kitsune::bias_dropout_add")
def _(x, bias, residual, p, training=True):
    op = "bias_dropout_add"
    check_floats(op, {"x": x, "bias": bias}, kernel=True)
    check(op, x.dim() >= 1 and bias.dim() == 1 and bias.shape[0] == x.shape[-1],
          lambda: f"bias must be 1-D with x.size(-1) elements; got bias of shape {list(bias.shape)} for x of shape "
                  f"{list(x.shape)}")
    check_floats(op, {"x": x, "residual": residual}, kernel=True)
    check(op, residual.shape == x.shape,
          lambda: f"residual must have x's shape {list(x.shape)}; got {list(residual.shape)}")
    _p(op, p)
    return contiguous_empty(x), _rng()


@torch.library.register_fake("kitsune::dropout_backward")
def _(grad, rng, p):
    _p("dropout_backward", p)
    check_float("dropout_backward", "grad", grad, kernel=True)
    _rng_values("dropout_backward", rng)
    return contiguous_empty(grad)


@torch.library.register_fake("kitsune::dropout_mask")
def _(rng, n, p, dtype=torch.float32):
    _p("dropout_mask", p)
    if n < 0:
        fail("dropout_mask", f"n must be >= 0, got {n}")
    if dtype not in FLOATS:
        fail("dropout_mask", f"dtype must be the dropped tensor's floating dtype, got {dtype}")
    _rng_values("dropout_mask", rng)
    return torch.empty(n, dtype=torch.bool)   # on the CPU, as the bridge's


# ---- the Python API ------------------------------------------------------------
def gelu_dropout(x, p=0.1, training=True, approximate="none"):
    """F.dropout(F.gelu(x, approximate=approximate), p, training) in one kernel; the
    mask is not stored (the backward regenerates it)."""
    return _lib.gelu_dropout(x, p, training, approximate)[0]


def bias_dropout_add(x, bias, residual, p=0.1, training=True):
    """residual + F.dropout(x + bias, p, training), bias along the last dim, in one kernel."""
    return _lib.bias_dropout_add(x, bias, residual, p, training)[0]


def dropout_mask(rng, n, p, dtype=torch.float32):
    """The keep mask (bool, n elements) of a dropout call from the rng tensor its op
    returned (torch.ops.kitsune.gelu_dropout(...)[1]), built on the CPU; dtype is the
    dropped tensor's (fp16/bf16 masks use 16 random bits an element, others 32)."""
    return _lib.dropout_mask(rng, n, p, dtype)
