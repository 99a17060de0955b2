"""KitsuneOptimizer's checks (kitsune.optim): which optimizers and options its fused step
covers, why a step falls back (naming the parameter), and gradients conformed to their
parameters' strides."""
import torch

from .ops._check import dense as _dense


def _no_state_yet(sgd, group, state):
    """Whether a parameter's optimizer state lacks what a captured update reads (Adam's
    moments and step count, SGD's momentum buffer where there is momentum): made by a
    first update taken eagerly."""
    if sgd:
        return group["momentum"] != 0 and state.get("momentum_buffer") is None
    return len(state) == 0


def _why_not(opt):
    """None when opt's step can be fused, else the reason."""
    kind = type(opt)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return f"{kind.__name__} has no fused Kitsune step (Adam, AdamW and SGD do)"
    for g in opt.param_groups:
        for flag in ("maximize", "differentiable", "capturable", "amsgrad"):
            if g.get(flag):
                return f"{flag}=True is not fused"
        if isinstance(g["lr"], torch.Tensor):
            return "a tensor learning rate is not fused"
        if kind is torch.optim.SGD and g.get("nesterov") and (g["momentum"] <= 0 or g["dampening"] != 0):
            return "nesterov needs momentum > 0 and dampening 0"
    return None   # the parameters and gradients are checked by the step (optim_fusable, in C++)


def _decoupled(opt, group):
    """Whether a group's weight decay is AdamW's (decoupled)."""
    return isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _conform_grads(params):
    """Gives each parameter whose gradient is dense and of its shape, dtype and device but
    in other strides (a channels-last weight whose convolution's cuDNN kernel returned an
    NCHW gradient: torchvision ResNet-18's last 3 x 3 convolutions on 32 x 32 images, 1 x 1
    activations there) a copy of the gradient in the parameter's own strides, as
    AccumulateGrad would have made it, so the fused step takes it instead of falling back.
    Returns how many it conformed."""
    n = 0
    with torch.no_grad():
        for p in params:
            g = p.grad
            if (g is None or g.is_sparse or p.is_sparse or g.shape != p.shape or g.dtype != p.dtype
                    or g.device != p.device or g.stride() == p.stride() or (g.is_contiguous() and p.is_contiguous())
                    or not _dense(p) or not _dense(g)):
                continue
            p.grad = torch.empty_like(p, memory_format=torch.preserve_format).copy_(g)
            n += 1
    return n


def _local(t):
    """A DTensor's local shard (FSDP2's sharded parameters, their gradients and the optimizer
    state made like them), which the fused kernels update in place; any other tensor (or
    None) as it is. The updates are elementwise, so each rank steps its own shard."""
    if t is not None and type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return t.to_local()
    return t


def _fusable_or_why(params, conform=True):
    """None when the fused step takes every parameter of params with its gradient, else
    why not (naming the parameter). Only where the C++ check refuses (the cold path) are
    dense gradients in other strides than their parameters' conformed (conform=False:
    not here; the in-backward hook did it on the gradient's stream) and the check made
    again, so a step whose gradients are in order pays one C++ call."""
    lib = torch.ops.kitsune

    def fusable():
        return lib.optim_fusable([_local(p) for p in params], [_local(p.grad) for p in params])
    if not params or fusable():
        return None
    if conform and _conform_grads(params) and fusable():
        return None
    return _not_fusable([_local(p) for p in params], [_local(p.grad) for p in params])


def _not_fusable(params, grads):
    """Why optim_fusable refused params/grads: the first offending parameter, named by
    its index, and what is wrong with it (the cold path, after the C++ check said no)."""
    kernel_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for i, (p, g) in enumerate(zip(params, grads)):
        what = None
        if p.is_sparse or g.is_sparse:
            what = "is sparse" if p.is_sparse else "has a sparse gradient"
        elif not _dense(p):
            what = f"is not dense (shape {tuple(p.shape)}, strides {p.stride()})"
        elif p.dtype not in kernel_dtypes and not (p.dtype == torch.float64 and not p.is_cuda):
            what = f"is {p.dtype}; the fused step takes float32, float16 or bfloat16"
        elif g.dtype != p.dtype or g.device != p.device:
            what = f"is {p.dtype} on {p.device} but its gradient is {g.dtype} on {g.device}"
        elif g.shape != p.shape or not ((g.is_contiguous() and p.is_contiguous()) or g.stride() == p.stride()):
            what = (f"(shape {tuple(p.shape)}, strides {p.stride()}) has a gradient laid out otherwise: "
                    f"shape {tuple(g.shape)}, strides {g.stride()}")
        if what is not None:
            return f"parameter {i} of the step {what}"
    return "a parameter the fused step cannot take"
