"""Loss ops: cross_entropy and linear_cross_entropy (the logits never exist): fakes, the
direct linear_cross_entropy op's autograd, and the wrappers (kernels in the bridge,
csrc/ops/cross_entropy.cpp)."""
import torch

from ._check import check, check_devices, check_float, check_floats, contiguous_empty, fail

_lib = torch.ops.kitsune


def _ce_views(op, logits, target, label_smoothing):
    """The bridge's ce_views: logits (N, C) or (C,), target (N,) or () of int64 class indices."""
    check_float(op, "logits", logits, kernel=True)
    check(op, logits.dim() in (1, 2),
          lambda: f"logits must be (N, C) or (C,); got shape {list(logits.shape)} (flatten the leading dims)")
    if target.dtype != torch.int64:
        fail(op, f"target must be int64 class indices; got {target.dtype}")
    check_devices(op, {"logits": logits, "target": target})
    check(op, target.dim() == logits.dim() - 1 and (logits.dim() == 1 or target.shape[0] == logits.shape[0]),
          lambda: f"target of shape {list(target.shape)} does not match logits of shape {list(logits.shape)}")
    _smoothing(op, label_smoothing)
    check(op, logits.shape[-1] > 0, "logits have no classes")


def _smoothing(op, label_smoothing):
    if not 0 <= label_smoothing <= 1:
        fail(op, f"label_smoothing must be in [0, 1], got {label_smoothing}")


def _ce_grad(grad, logits):
    op = "cross_entropy_backward"
    check_float(op, "grad", grad)
    check_devices(op, {"logits": logits, "grad": grad})
    check(op, grad.numel() == 1, lambda: f"grad must have one element (the loss is a mean); got {list(grad.shape)}")


def _lce_views(op, x, weight, target, bias, label_smoothing, chunk_size):
    """The bridge's lce_views: x (..., H), weight (C, H), bias (C,) or None, target (...)."""
    check_floats(op, {"x": x, "weight": weight, "bias": bias}, kernel=True)
    check_devices(op, {"x": x, "target": target})
    if chunk_size < 0:
        fail(op, f"chunk_size must be >= 0 (0 chooses), got {chunk_size}")
    check(op, weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
          lambda: f"weight must be (num_classes, x.size(-1)); got {list(weight.shape)} for x of shape "
                  f"{list(x.shape)}")
    if bias is not None:
        check(op, bias.dim() == 1 and bias.shape[0] == weight.shape[0],
              lambda: f"bias must have {weight.shape[0]} elements (weight.size(0)); got shape {list(bias.shape)}")
    check(op, target.shape == x.shape[:-1],
          lambda: f"target of shape {list(target.shape)} does not match x of shape {list(x.shape)} (one class "
                  f"index per row of x)")
    if target.dtype != torch.int64:
        fail(op, f"target must be int64 class indices; got {target.dtype}")
    _smoothing(op, label_smoothing)


def _ce_loss_dtype(logits, float_loss):
    """The loss's dtype (the bridge's ce_loss_dtype): float32 for 16-bit logits with float_loss."""
    return torch.float32 if float_loss and logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _ce_grad_like(logits):
    """The logits' gradient as the bridge lays it out (ce_views, ce_grad_like): on CUDA,
    2-D logits whose rows are a 16-byte multiple apart (a wide_linear's padded rows) get
    a gradient with rows as far apart; otherwise contiguous."""
    if logits.dim() == 2 and logits.device.type == "cuda" and logits.shape[0] > 1 and logits.stride(1) == 1 and \
            logits.stride(0) > logits.shape[1] and (logits.stride(0) * logits.element_size()) % 16 == 0 and \
            (logits.storage_offset() * logits.element_size()) % 16 == 0:
        return logits.new_empty_strided(tuple(logits.shape), (logits.stride(0), 1))
    return contiguous_empty(logits)


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::cross_entropy")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    _ce_views("cross_entropy", logits, target, label_smoothing)
    return logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss))


@torch.library.register_fake("kitsune::cross_entropy_backward")
def _(grad, logits, target, ignore_index=-100, label_smoothing=0.0):
    _ce_views("cross_entropy_backward", logits, target, label_smoothing)
    _ce_grad(grad, logits)
    return _ce_grad_like(logits)


@torch.library.register_fake("kitsune::cross_entropy_with_grad")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    _ce_views("cross_entropy_with_grad", logits, target, label_smoothing)
    return logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss)), _ce_grad_like(logits)


@torch.library.register_fake("kitsune::cross_entropy_rescale_")
def _(grad, by):
    op = "cross_entropy_rescale_"
    check_devices(op, {"grad": grad, "by": by})
    check_float(op, "grad", grad, kernel=True)
    check_float(op, "by", by)
    check(op, by.numel() == 1, lambda: f"by must have one element; got shape {list(by.shape)}")
    check(op, grad.is_contiguous(), "grad must be contiguous")
    return None


@torch.library.register_fake("kitsune::linear_cross_entropy")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    _lce_views("linear_cross_entropy", x, weight, target, bias, label_smoothing, chunk_size)
    return x.new_empty((), dtype=_ce_loss_dtype(x, float_loss))


@torch.library.register_fake("kitsune::linear_cross_entropy_grads")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    _lce_views("linear_cross_entropy_grads", x, weight, target, bias, label_smoothing, chunk_size)
    return (x.new_empty((), dtype=_ce_loss_dtype(x, float_loss)), contiguous_empty(x), contiguous_empty(weight),
            contiguous_empty(bias) if bias is not None else x.new_empty((0,)))


# ---- autograd ----
# Every op but one has its autograd in C++ (the bridge's Autograd-key kernels: no Python
# on the launch path). The linear_cross_entropy op, called directly, registers its
# backward here; kitsune.ops.linear_cross_entropy below (an autograd.Function) forms
# the gradients in its forward instead.
def _lce_setup(ctx, inputs, output):
    x, weight, target, bias, *ctx.options = inputs
    ctx.save_for_backward(x, weight, target, bias)


def _lce_bwd(ctx, grad):
    x, weight, target, bias = ctx.saved_tensors
    _, gx, gw, gb = _lib.linear_cross_entropy_grads(x, weight, target, bias, *ctx.options)
    return gx * grad, gw * grad, None, (gb * grad if bias is not None else None), None, None, None, None


torch.library.register_autograd("kitsune::linear_cross_entropy", _lce_bwd, setup_context=_lce_setup)


# ---- the Python API ------------------------------------------------------------
def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0):
    """F.cross_entropy(logits, target) (mean over non-ignored rows) for (N, C) or (C,)
    logits and int64 targets, without storing the softmax. The loss has the logits'
    dtype, float32 under autocast (as F.cross_entropy's; 16-bit logits are read as
    they are, in fp32 arithmetic, and their gradient has their dtype). On CUDA an
    out-of-range target gives a NaN loss instead of a device assert."""
    return _lib.cross_entropy(logits, target, ignore_index, label_smoothing)


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are formed chunk by chunk in the forward, while each chunk's
    logits exist; the backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, label_smoothing, chunk_size, float_loss):
        loss, gx, gw, gb = _lib.linear_cross_entropy_grads(x, weight, target, bias, ignore_index, label_smoothing,
                                                           chunk_size, float_loss)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(gx, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: the formed gradients would be constants to autograd
            raise RuntimeError("kitsune.linear_cross_entropy has no double backward: its gradients are formed in "
                               "the forward, so a backward with create_graph=True would treat them as constants. "
                               "For higher-order gradients use F.cross_entropy(F.linear(x, weight, bias), target)")
        gx, gw, gb = ctx.saved_tensors
        return gx * grad, gw * grad, None, (gb * grad if ctx.has_bias else None), None, None, None, None


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0,
                         float_loss=False):
    """F.cross_entropy(F.linear(x, weight, bias), target) computed chunk_size rows at a
    time (0 chooses: each chunk's logits about the size of x), so the full logits
    tensor never exists. x (..., H), weight (C, H), target (...) int64. The loss has the
    logits' dtype, float32 under autocast (as F.cross_entropy's) or with float_loss
    (F.cross_entropy(F.linear(...).float(), target): 16-bit logits upcast first)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    if not needs_grad:   # the op's autocast kernel casts like F.linear
        return _lib.linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, chunk_size,
                                         float_loss)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):   # as F.linear under autocast; the loss in fp32 as F.cross_entropy's
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size,
                                             True)
    return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size,
                                     bool(float_loss))
