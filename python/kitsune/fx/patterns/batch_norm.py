"""BatchNorm: relu(BatchNorm(x)) -> batch_norm_relu, relu(BatchNorm(x) + r) ->
batch_norm_add_relu (through run-time helpers that read the module's mode, momentum and
running stats), and the BatchNorms' num_batches_tracked adds as one foreach add."""
import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _fuse_pair, _module


def _fused_bn_ok(x, bn):
    """Whether Kitsune's BatchNorm ops take x and bn's parameters (else nn.BatchNorm runs)."""
    return _params_ok(x, [t for t in (bn.weight, bn.bias) if t is not None])


def _batch_norm_relu(x, bn, count=True):
    """relu(bn(x)) for an nn.BatchNorm module, through batch_norm_relu when the dtypes
    allow it, deciding statistics and momentum exactly as nn.BatchNorm's forward does.
    count=False: the module's num_batches_tracked is counted by _count_batches instead."""
    from ... import ops as ko
    if not _fused_bn_ok(x, bn):
        return F.relu(bn(x) if count else _batch_norm(x, bn))
    return ko.batch_norm_relu(x, *_bn_state(x, bn, count))


def _batch_norm_add_relu(x, residual, bn, count=True):
    """relu(bn(x) + residual), as _batch_norm_relu, through batch_norm_add_relu where the
    residual has x's shape, dtype and device (else the unfused ops)."""
    from ... import ops as ko
    if not (_fused_bn_ok(x, bn) and isinstance(residual, torch.Tensor) and residual.shape == x.shape
            and residual.dtype == x.dtype and residual.device == x.device):
        return F.relu((bn(x) if count else _batch_norm(x, bn)) + residual)
    return ko.batch_norm_add_relu(x, residual, *_bn_state(x, bn, count))


def _params_ok(x, params):
    """Whether Kitsune's BatchNorm ops take x with these weight and bias tensors."""
    return not (any(t.dtype != x.dtype for t in params) or torch.is_autocast_enabled(x.device.type) or
                (x.device.type == "cuda" and x.dtype not in (torch.float32, torch.float16, torch.bfloat16)))


def _f_batch_norm_relu(x, running_mean, running_var, weight, bias, training, momentum, eps):
    """relu(F.batch_norm(...)) as a Dynamo graph spells nn.BatchNorm (its mode, momentum
    and count already decided), through batch_norm_relu where the dtypes allow it."""
    from ... import ops as ko
    args = (running_mean, running_var, weight, bias, training, momentum, eps)
    if not _params_ok(x, [t for t in (weight, bias) if t is not None]):
        return F.relu(F.batch_norm(x, *args))
    return ko.batch_norm_relu(x, *args)


def _f_batch_norm_add_relu(x, residual, running_mean, running_var, weight, bias, training, momentum, eps):
    """relu(F.batch_norm(...) + residual), as _f_batch_norm_relu, through
    batch_norm_add_relu where the residual has x's shape, dtype and device."""
    from ... import ops as ko
    args = (running_mean, running_var, weight, bias, training, momentum, eps)
    if not (_params_ok(x, [t for t in (weight, bias) if t is not None]) and isinstance(residual, torch.Tensor)
            and residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device):
        return F.relu(F.batch_norm(x, *args) + residual)
    return ko.batch_norm_add_relu(x, residual, *args)


def _f_batch_norm(node):
    """Whether node is F.batch_norm with its eight arguments given in order, no keyword
    (the form a Dynamo graph gives nn.BatchNorm)."""
    return (node.op == "call_function" and node.target is F.batch_norm and len(node.args) == 8
            and not node.kwargs and not node.meta.get(_KEEP))


# Set by the Inductor backend on F.batch_norm nodes: Inductor fuses BatchNorm with its
# neighbours itself, and its reinplacing of a fused op that mutates the running statistics
# failed an assertion (torchvision ResNet-18 and MobileNetV3 under torch.compile, CPU).
_KEEP = "kitsune_keep_batch_norm"


def _keep_functional_batch_norms(g):
    for n in g.nodes:
        if n.op == "call_function" and n.target is F.batch_norm:
            n.meta[_KEEP] = True


def _bn_state(x, bn, count):
    """(running_mean, running_var, weight, bias, training, momentum, eps) for the fused
    ops, as nn.BatchNorm's forward decides them (counting the batch unless count=False)."""
    bn._check_input_dim(x)
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if count or bn.momentum is None:   # momentum set to None after optimize: counted here
            bn.num_batches_tracked.add_(1)
        momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    keep = not bn.training or bn.track_running_stats
    return (bn.running_mean if keep else None, bn.running_var if keep else None, bn.weight, bn.bias, use_batch,
            momentum, bn.eps)


def _batch_norm(x, bn):
    """nn.BatchNorm's forward without its num_batches_tracked add (_count_batches makes
    it), for a momentum that is not None; a momentum set to None after optimize reads
    the count, and nn.BatchNorm's forward makes it (_count_batches skips that module)."""
    if bn.momentum is None:
        return bn(x)
    return F.batch_norm(x, *_bn_state(x, bn, count=False))


def _count_batches(*bns):
    """The num_batches_tracked adds that nn.BatchNorm's forward makes one by one (one
    launch each on a GPU), as one foreach add, for the modules that count now."""
    counts = [bn.num_batches_tracked for bn in bns if bn.training and bn.track_running_stats
              and bn.num_batches_tracked is not None and bn.momentum is not None]
    if counts:
        torch._foreach_add_(counts, 1)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_SLOT = {_batch_norm_relu: 1, _batch_norm_add_relu: 2}   # the argument that is the module


def _rewrite_batch_counts(gm, g, prefix, report):
    """Every BatchNorm of the graph with a momentum (nn.BatchNorm's own forward, or
    through _batch_norm_relu / _batch_norm_add_relu) counts its batch in one
    _count_batches node before the first of them. A module called more than once, or whose momentum is None (its
    forward reads the count), keeps its own add."""
    calls = {}
    for n in g.nodes:
        if n.op == "call_module" and type(_module(gm, n)) in _BATCH_NORMS:
            calls.setdefault(n.target, []).append(n)
        elif n.op == "call_function" and n.target in _BN_SLOT and n.args[_BN_SLOT[n.target]].op == "get_attr":
            calls.setdefault(n.args[_BN_SLOT[n.target]].target, []).append(n)
    take = {t: ns[0] for t, ns in calls.items() if len(ns) == 1 and gm.get_submodule(t).momentum is not None}
    if len(take) < 2:
        return
    first = next(n for n in g.nodes if n in take.values())
    with g.inserting_before(first):
        counter = g.call_function(_count_batches, tuple(g.get_attr(t) for t in take))
    for t, n in take.items():
        if n.op == "call_module":
            with g.inserting_before(n):
                new = g.call_function(_batch_norm, (n.args[0], g.get_attr(t)))
            n.replace_all_uses_with(new)
            g.erase_node(n)
        else:
            n.args = n.args[:_BN_SLOT[n.target] + 1] + (False,)
    report.fused.append((f"{prefix}{counter.name}", f"BatchNorms' num_batches_tracked adds -> foreach_add "
                                                   f"({len(take)} modules)"))


def _bn_feeding(gm, add, a, b):
    """(BatchNorm node, the other operand) when an operand of add (a first) is an
    nn.BatchNorm1d/2d/3d call read only by add, else None."""
    for h, r in ((a, b), (b, a)):
        if not isinstance(h, tfx.Node) or len(h.users) != 1 or next(iter(h.users)) is not add:
            continue
        if (h.op == "call_module" and type(_module(gm, h)) in _BATCH_NORMS and len(h.args) == 1 and not h.kwargs) \
                or _f_batch_norm(h):
            return h, r
    return None


def _rewrite_relu_batch_norm(gm, g, node, act, where, report):
    """relu(nn.BatchNorm1d/2d/3d(x)) -> batch_norm_relu (through _batch_norm_relu), and
    relu(F.batch_norm(...)), a Dynamo graph's BatchNorm (through _f_batch_norm_relu)."""
    kind, inner, _ = act
    if kind == "relu" and isinstance(inner, tfx.Node) and _f_batch_norm(inner):   # a Dynamo graph's
        _fuse_pair(g, node, inner, where, report, "relu(batch_norm)", "batch_norm_relu",
                   lambda: g.call_function(_f_batch_norm_relu, inner.args))
        return True
    bn = _module(gm, inner) if kind == "relu" and isinstance(inner, tfx.Node) else None
    if type(bn) not in _BATCH_NORMS:
        return False
    _fuse_pair(g, node, inner, where, report, "relu(batch_norm)", "batch_norm_relu",
               lambda: g.call_function(_batch_norm_relu, (inner.args[0], g.get_attr(inner.target))))
    return True


def _rewrite_batch_norm_add_relu(gm, g, node, inner, a, b, where, report):
    """relu(batch_norm(x) + r) -> batch_norm_add_relu (through _batch_norm_add_relu), node
    the relu and inner the sum a + b; False when no operand is a BatchNorm read only by it."""
    fed = _bn_feeding(gm, inner, a, b)
    if fed is None:
        return False
    h, r = fed
    report.fused.append((where, f"relu(batch_norm(x) + r) -> batch_norm_add_relu ({h.name})"))
    with g.inserting_before(node):
        new = (g.call_function(_f_batch_norm_add_relu, (h.args[0], r) + tuple(h.args[1:])) if _f_batch_norm(h) else
               g.call_function(_batch_norm_add_relu, (h.args[0], r, g.get_attr(h.target))))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(inner)
    g.erase_node(h)
    return True
