"""Dropout ops: gelu_dropout, bias_dropout_add, dropout_backward, dropout_mask (fakes and
wrappers; kernels and autograd in the bridge, csrc/ops/dropout.cpp). The mask is never
stored: the backward rebuilds it from (seed, offset) with the same Philox code."""
import torch

_lib = torch.ops.kitsune


def _rng():
    return torch.empty(2, dtype=torch.long)


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::gelu_dropout")
def _(x, p, training=True, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rng()


@torch.library.register_fake("kitsune::gelu_dropout_backward")
def _(grad, x, rng, p, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::bias_dropout_add")
def _(x, bias, residual, p, training=True):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rng()


@torch.library.register_fake("kitsune::dropout_backward")
def _(grad, rng, p):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


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
