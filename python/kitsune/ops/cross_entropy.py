"""Loss ops: cross_entropy and linear_cross_entropy (the logits never exist): fakes, the
direct linear_cross_entropy op's autograd, and the wrappers (kernels in the bridge,
csrc/ops/cross_entropy.cpp)."""
import torch

_lib = torch.ops.kitsune


def _ce_loss_dtype(logits, float_loss):
    """The loss's dtype (the bridge's ce_loss_dtype): float32 for 16-bit logits with float_loss."""
    return torch.float32 if float_loss and logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::cross_entropy")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    return logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss))


@torch.library.register_fake("kitsune::cross_entropy_backward")
def _(grad, logits, target, ignore_index=-100, label_smoothing=0.0):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::cross_entropy_with_grad")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    return (logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss)),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


@torch.library.register_fake("kitsune::cross_entropy_rescale_")
def _(grad, by):
    return None


@torch.library.register_fake("kitsune::linear_cross_entropy")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    return x.new_empty((), dtype=_ce_loss_dtype(x, float_loss))


@torch.library.register_fake("kitsune::linear_cross_entropy_grads")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    return (x.new_empty((), dtype=_ce_loss_dtype(x, float_loss)),
            torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)))


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


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0):
    """F.cross_entropy(F.linear(x, weight, bias), target) computed chunk_size rows at a
    time (0 chooses: each chunk's logits about the size of x), so the full logits
    tensor never exists. x (..., H), weight (C, H), target (...) int64."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    if not needs_grad:   # the op's autocast kernel casts like F.linear
        return _lib.linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, chunk_size)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):   # as F.linear under autocast; the loss in fp32 as F.cross_entropy's
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size,
                                             True)
    return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size, False)
