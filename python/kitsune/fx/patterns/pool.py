"""Pooling: max_pool2d(x) -> kitsune.max_pool2d, or max_pool2d_branches where x has other
users; the mean over H and W -> global_avg_pool."""
import operator

import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _bound, _module, _pair, _swap


def _max_pool_of(gm, node):
    """(input, kernel, stride, padding, ceil_mode), each size a pair, when node is a 2-D max
    pooling with dilation 1 that returns no indices (F.max_pool2d, torch.max_pool2d or
    nn.MaxPool2d), else None."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if type(m) is torch.nn.MaxPool2d:
        if len(node.args) != 1 or node.kwargs:
            return None
        a = {"input": node.args[0], "kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
             "dilation": m.dilation, "ceil_mode": m.ceil_mode, "return_indices": m.return_indices}
    elif node.op == "call_function" and node.target in (F.max_pool2d, torch.max_pool2d):
        a = _bound(("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
                   {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False},
                   node.args, node.kwargs)
        if a is None or "input" not in a or "kernel_size" not in a:
            return None
    else:
        return None
    k, stride, pad = _pair(a["kernel_size"]), a["stride"], _pair(a["padding"])
    stride = k if stride is None or stride == [] or stride == () else _pair(stride)
    sizes = (k, stride, pad)
    if any(v is None or len(v) != 2 or not all(isinstance(e, int) and not isinstance(e, bool) for e in v)
           for v in sizes):
        return None   # sizes computed in the graph
    if _pair(a["dilation"]) != (1, 1) or not isinstance(a["ceil_mode"], bool) or a["return_indices"] is not False:
        return None
    return a["input"], k, stride, pad, a["ceil_mode"]


_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
              operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
              operator.imatmul)


def _mutates(gm, node, x):
    """Whether node may write x in place (a method or function named with a trailing
    underscore, an augmented assignment, inplace=True, a module with inplace set)."""
    first = node.args[0] if node.args else None
    if node.op == "call_method":
        return first is x and node.target.endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (first is x and (name.endswith("_") or node.target in _AUGMENTED)) or node.kwargs.get("inplace") is True
    m = _module(gm, node)
    return m is not None and first is x and getattr(m, "inplace", False) is True


def _rewrite_max_pool(gm, g, node, where, report):
    """A max pooling that no bias_relu_pool took -> kitsune.max_pool2d, or, where its
    input has other users (an Inception block's branches) none of which writes it in
    place, kitsune.max_pool2d_branches: those users take its views of x, so their
    gradients are added in the pooling's backward pass."""
    from ... import ops as ko
    pool = _max_pool_of(gm, node)
    if pool is None:
        return False
    x, k, stride, pad, ceil = pool
    others = [u for u in x.users if u is not node and u.op != "output"] if isinstance(x, tfx.Node) else []
    if others and not any(_mutates(gm, u, x) for u in x.users):
        report.fused.append((where, f"max_pool2d -> kitsune.max_pool2d_branches ({node.name}; the gradients of "
                                    f"{len(others)} other user(s) of {x.name} added in its backward)"))
        at = x
        if x.op == "placeholder":   # after the last placeholder
            at = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(at):
            branches = g.call_function(ko.max_pool2d_branches, (x, len(others), k, stride, pad, ceil))
        with g.inserting_after(branches):
            views = [g.call_function(operator.getitem, (branches, i)) for i in range(len(others) + 1)]
        for u, v in zip(others, views[1:]):
            u.replace_input_with(x, v)
        node.replace_all_uses_with(views[0])
        g.erase_node(node)
        return True
    report.fused.append((where, f"max_pool2d -> kitsune.max_pool2d ({node.name})"))
    _swap(g, node, ko.max_pool2d, (x, k, stride, pad, ceil))
    return True


_HW_DIMS = ({2, 3}, {-2, -1})


def _global_avg_pool_of(gm, node):
    """(input, dim, keepdim) when node takes the mean over the last two dims of an (N, C, H,
    W) map: x.mean(d, keepdim) / torch.mean(x, d, keepdim) with d (2, 3) or (-2, -1) in any
    order and no dtype, or F.adaptive_avg_pool2d(x, 1) / nn.AdaptiveAvgPool2d(1) (output
    size 1 or (1, 1)); else None."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if type(m) is nn.AdaptiveAvgPool2d:
        whole = len(node.args) == 1 and not node.kwargs and _pair(m.output_size) == (1, 1)
        return (node.args[0], [-2, -1], True) if whole else None
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        a = dict(zip(("input", "output_size"), node.args))
        a.update(node.kwargs)
        if set(a) != {"input", "output_size"} or _pair(a["output_size"]) != (1, 1):
            return None
        return a["input"], [-2, -1], True
    if not ((node.op == "call_method" and node.target == "mean") or
            (node.op == "call_function" and node.target is torch.mean)):
        return None
    a = dict(zip(("input", "dim", "keepdim"), node.args))
    a.update(node.kwargs)
    if not set(a) <= {"input", "dim", "keepdim"} or len(node.args) > 3 or "input" not in a:
        return None
    dim, keepdim = a.get("dim"), a.get("keepdim", False)
    if not isinstance(dim, (tuple, list)) or len(dim) != 2 or not all(type(d) is int for d in dim):
        return None
    if set(dim) not in _HW_DIMS or not isinstance(keepdim, bool):
        return None
    return a["input"], list(dim), keepdim


def _rewrite_global_avg_pool(gm, g, node, where, report):
    """The mean over H and W -> kitsune.global_avg_pool (ATen's mean wherever its kernels
    do not apply, so any rank and layout stays correct)."""
    from ... import ops as ko
    pool = _global_avg_pool_of(gm, node)
    if pool is None:
        return False
    x, dim, keepdim = pool
    report.fused.append((where, f"mean over H, W -> kitsune.global_avg_pool ({node.name})"))
    _swap(g, node, ko.global_avg_pool, (x, dim, keepdim))
    return True
