"""A Conv2d's bias: [relu](Conv2d(x)) -> channel_bias, max_pool2d(relu(Conv2d(x))) ->
bias_relu_pool, cat of Conv2d biases -> bias_cat."""
import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _act, _module
from .pool import _max_pool_of


# A Conv2d's output is (N, C, H, W), or (C, H, W) for an unbatched input, while
# channel_bias and bias_relu_pool read (N, C, ...): the rewrites call them through these
# helpers. On tensors they branch on the rank (a view costs microseconds of host time a
# call in eager mode); when torch.fx traces an optimized module again, y is a Proxy, whose
# rank is unknown: then a 4-D view, with no branch.
_ONE_BATCH = torch.Size([-1])
_ops = None


def _kitsune_ops():
    global _ops
    if _ops is None:
        from ... import ops
        _ops = ops
    return _ops


def _on_conv_output(op, y, *args):
    """op(y, *args) for an op that reads (N, C, H, W), on a Conv2d output y, batched or not."""
    if isinstance(y, tfx.Proxy):
        out = op(y.view(_ONE_BATCH + y.shape[-3:]), *args)
        return out.view(y.shape[:-3] + out.shape[-3:])
    return op(y, *args) if y.dim() != 3 else op(y.unsqueeze(0), *args).squeeze(0)


def _conv_bias(y, b, act):
    """kitsune.channel_bias over a Conv2d output's channels (dim -3)."""
    return _on_conv_output(_kitsune_ops().channel_bias, y, b, act)


def _conv_bias_relu_pool(y, b, k):
    """kitsune.bias_relu_pool over a Conv2d output's channels (dim -3)."""
    return _on_conv_output(_kitsune_ops().bias_relu_pool, y, b, k)


def _rewrite_conv(gm, g, node, where, report):
    """An nn.Conv2d node: its bias split off where _rewrite_conv_bias can; True either way."""
    conv = _module(gm, node)
    if type(conv) is not nn.Conv2d:
        return False
    _rewrite_conv_bias(gm, g, node, conv, where, report)
    return True


def _rewrite_conv_bias(gm, g, node, conv, where, report):
    """An nn.Conv2d with a bias (zeros padding), and the ReLU after it when that is its
    only user: F.conv2d without the bias, then kitsune.channel_bias; or
    kitsune.bias_relu_pool when that ReLU's only user is a non-overlapping max pooling."""
    if conv.bias is None:
        return
    if conv.padding_mode != "zeros":
        report.left.append((where, f"conv2d bias: padding_mode={conv.padding_mode!r} (only 'zeros' is split)"))
        return
    if len(node.args) != 1 or node.kwargs:
        return
    users = list(node.users)
    act = _act(gm, users[0]) if len(users) == 1 else None
    relu = users[0] if act is not None and act[0] == "relu" and act[1] is node else None
    pool_node = next(iter(relu.users)) if relu is not None and len(relu.users) == 1 else None
    pool = _max_pool_of(gm, pool_node)
    if pool is None or pool[0] is not relu or pool[2] != pool[1] or pool[3] != (0, 0) or pool[4]:
        pool_node = None   # bias_relu_pool takes non-overlapping windows, no padding, floor mode
    if pool_node is not None:
        what, last, dead = "max_pool2d(relu(conv2d)) bias -> bias_relu_pool", pool_node, (pool_node, relu, node)
    elif relu is not None:
        what, last, dead = "relu(conv2d) bias -> channel_bias", relu, (relu, node)
    else:
        what, last, dead = "conv2d bias -> channel_bias", node, (node,)
    report.fused.append((where, f"{what} ({node.name})"))
    with g.inserting_before(node):
        w, b = g.get_attr(f"{node.target}.weight"), g.get_attr(f"{node.target}.bias")
        y = g.call_function(F.conv2d, (node.args[0], w, None, conv.stride, conv.padding, conv.dilation, conv.groups))
        new = (g.call_function(_conv_bias_relu_pool, (y, b, pool[1])) if pool_node is not None else
               g.call_function(_conv_bias, (y, b, "none" if relu is None else "relu")))
    last.replace_all_uses_with(new)
    for n in dead:
        g.erase_node(n)


def _rewrite_bias_cat(gm, g, node, where, report):
    """torch.cat(dim=d, an int) of Conv2d outputs' biases, _conv_bias(y, b, "none") (an
    Inception block's branches, after _rewrite_conv_bias) -> kitsune.bias_cat([y...], [b...],
    d): one kernel for batched parts concatenated over their channels, the unfused ops for
    any other dim or rank (an unbatched part's dim 1 is its height)."""
    from ... import ops as ko
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat, torch.concatenate):
        return False
    names = ("tensors", "dim")
    a = {"dim": 0}
    a.update(zip(names, node.args))
    a.update({("dim" if k == "axis" else k): v for k, v in node.kwargs.items()})
    parts = a.get("tensors")
    if not isinstance(parts, (list, tuple)) or not parts:
        return False
    if type(a["dim"]) is not int or not all(isinstance(p, tfx.Node) and p.op == "call_function"
                                                and p.target is _conv_bias and len(p.args) == 3 and not p.kwargs
                                                and p.args[2] == "none" for p in parts):
        return False
    if any(set(p.users) != {node} for p in parts):
        report.left.append((where, "cat(conv2d biases): a part is also used elsewhere"))
        return False
    report.fused.append((where, f"cat(conv2d biases) -> bias_cat ({node.name}, {len(parts)} parts)"))
    with g.inserting_before(node):
        new = g.call_function(ko.bias_cat, ([p.args[0] for p in parts], [p.args[1] for p in parts], a["dim"]))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    for p in dict.fromkeys(parts):
        g.erase_node(p)
    return True
