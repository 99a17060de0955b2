"""The fused optimizer ops' fake kernels: adam_, adam_step_, adam_capturable_, sgd_,
sgd_capturable_ (kernels in the bridge, csrc/ops/optim.cpp; kitsune.optim's
KitsuneOptimizer calls them). They update their lists in place and return nothing, so a
fake kernel only checks what the real one checks: a CPU tensor beside a meta one
reaches it, and under torch.compile it stands for the step. optim_fusable's answers
from sizes, strides, dtypes and devices alone, as its composite kernel's does."""
import torch

from ._check import FLOATS, KERNEL_FLOATS, check_float, dense, fail


def _laid_out_as(t, p):
    """The bridge's laid_out_as: p's shape, and both contiguous or both in one set of
    strides, dense."""
    if t.shape != p.shape:
        return False
    return (t.is_contiguous() and p.is_contiguous()) or (t.stride() == p.stride() and dense(p))


def _check_sizes(op, params, rest):
    for name, lst in rest.items():
        if len(lst) != len(params):
            fail(op, f"{name} has {len(lst)} tensors but params has {len(params)}")


def _check_entry(op, name, i, t, p):
    if not (t.device == p.device and t.dtype == p.dtype and _laid_out_as(t, p)):
        fail(op, f"{name}[{i}] must be a {p.dtype} tensor on {p.device} laid out as params[{i}] ({list(p.shape)}, "
                 f"strides {list(p.stride())}); got {t.dtype} {list(t.shape)}, strides {list(t.stride())} on "
                 f"{t.device}")


def _check_param(op, i, p):
    check_float(op, f"params[{i}]", p, kernel=True)   # the kernels' dtypes on CUDA, float64 too on the CPU


def _check_lists(op, params, rest):
    """The bridge's check_lists: one device and dtype, each parameter dense, list[i] as params[i]."""
    _check_sizes(op, params, rest)
    for i, p in enumerate(params):
        _check_param(op, i, p)
        if not dense(p):
            fail(op, f"params[{i}] is not dense in memory (strides {list(p.stride())})")
        if p.device != params[0].device or p.dtype != params[0].dtype:
            fail(op, f"params[{i}] is {p.dtype} on {p.device} but params[0] is {params[0].dtype} on "
                     f"{params[0].device} (one dtype and device a call)")
        for name, lst in rest.items():
            _check_entry(op, name, i, lst[i], p)


def _adam_args(op, lr, beta1, beta2, eps, step):
    if not step >= 1:
        fail(op, f"step must be >= 1 (the count after this update), got {step}")
    if not (lr >= 0 and eps >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1):
        fail(op, f"need lr >= 0, eps >= 0 and betas in [0, 1); got lr {lr} eps {eps} betas ({beta1}, {beta2})")


def _sgd_args(op, lr, momentum, dampening, nesterov):
    if not (lr >= 0 and momentum >= 0):
        fail(op, f"need lr >= 0 and momentum >= 0; got lr {lr} momentum {momentum}")
    if nesterov and not (momentum > 0 and dampening == 0):
        fail(op, "nesterov needs momentum > 0 and dampening 0")


def _check_hyper(op, hyper, p0, n):
    if not (hyper.dtype == torch.float64 and hyper.dim() == 1 and hyper.numel() == n and hyper.is_contiguous() and
            hyper.device == p0.device):
        fail(op, f"hyper must be a contiguous float64 tensor of {n} elements on {p0.device}; got {hyper.dtype} "
                 f"{list(hyper.shape)} on {hyper.device}")


def _check_found_inf(op, found_inf, p0):
    if found_inf is not None and not (found_inf.dtype == torch.float32 and found_inf.numel() == 1 and
                                      found_inf.device == p0.device):
        fail(op, f"found_inf must be a one-element float32 tensor on {p0.device}; got {found_inf.dtype} "
                 f"{list(found_inf.shape)} on {found_inf.device}")


# ---- fake kernels: what the real ones check (they return nothing) ----
@torch.library.register_fake("kitsune::adam_")
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, decoupled, step):
    _check_lists("adam_", params, {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    _adam_args("adam_", lr, beta1, beta2, eps, step)


@torch.library.register_fake("kitsune::adam_step_")
def _(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2, eps, weight_decay, decoupled):
    op = "adam_step_"
    _check_sizes(op, params, {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                              "state_steps": state_steps})
    _adam_args(op, lr, beta1, beta2, eps, 1.0)
    for i, p in enumerate(params):
        if state_steps[i].numel() != 1:
            fail(op, f"state_steps[{i}] must have one element; got {list(state_steps[i].shape)}")
        check_float(op, f"state_steps[{i}]", state_steps[i])
        if state_steps[i].device.type != "cpu" and state_steps[i].device != p.device:
            fail(op, f"state_steps[{i}] is on {state_steps[i].device}; it must be on the CPU or on params[{i}]'s "
                     f"{p.device}")
        _check_param(op, i, p)
        if not dense(p):
            fail(op, f"params[{i}] is not dense in memory (strides {list(p.stride())})")
        for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
            _check_entry(op, name, i, lst[i], p)


@torch.library.register_fake("kitsune::adam_capturable_")
def _(params, grads, exp_avgs, exp_avg_sqs, hyper, beta1, beta2, eps, weight_decay, decoupled, count_step=True,
      found_inf=None):
    op = "adam_capturable_"
    _check_lists(op, params, {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
    _adam_args(op, 0.0, beta1, beta2, eps, 1.0)
    if params:
        _check_hyper(op, hyper, params[0], 2)
        _check_found_inf(op, found_inf, params[0])


@torch.library.register_fake("kitsune::sgd_")
def _(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first):
    _sgd_args("sgd_", lr, momentum, dampening, nesterov)
    rest = {"grads": grads, "momentum_buffers": momentum_buffers} if momentum != 0 else {"grads": grads}
    _check_lists("sgd_", params, rest)


@torch.library.register_fake("kitsune::sgd_capturable_")
def _(params, grads, momentum_buffers, hyper, momentum, dampening, weight_decay, nesterov, found_inf=None):
    op = "sgd_capturable_"
    _sgd_args(op, 0.0, momentum, dampening, nesterov)
    rest = {"grads": grads, "momentum_buffers": momentum_buffers} if momentum != 0 else {"grads": grads}
    _check_lists(op, params, rest)
    if params:
        _check_hyper(op, hyper, params[0], 1)
        _check_found_inf(op, found_inf, params[0])


@torch.library.register_fake("kitsune::optim_fusable")
def _(params, grads):
    if len(params) != len(grads):
        fail("optim_fusable", f"{len(params)} params but {len(grads)} grads")
    return all(not p.is_sparse and not g.is_sparse and dense(p) and _laid_out_as(g, p) and
               p.dtype in (KERNEL_FLOATS if p.device.type == "cuda" else FLOATS) and g.dtype == p.dtype and
               g.device == p.device for p, g in zip(params, grads))
