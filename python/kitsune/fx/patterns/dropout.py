"""Dropout: dropout(gelu(x)) -> gelu_dropout, r + dropout(linear(x)) -> bias_dropout_add
(through run-time helpers that read nn.Dropout's p and training, and fall back to the
unfused ops where the kernels do not apply, a CUDA graph capture included)."""
import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _act, _attr_or_node, _binary, _linear_of, _module


def _dropout_of(gm, node):
    """(input, p, training source) when node is nn.Dropout (the source: the module, read
    at run time) or F.dropout (p and training as traced), else None."""
    m = _module(gm, node)
    if type(m) is nn.Dropout and not m.inplace:
        return node.args[0], m.p, ("module", node.target)
    if isinstance(node, tfx.Node) and node.op == "call_function" and node.target is F.dropout:
        args = list(node.args) + [None] * 4
        p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
        training = node.kwargs.get("training", args[2] if args[2] is not None else True)
        inplace = node.kwargs.get("inplace", args[3] if args[3] is not None else False)
        live = isinstance(training, tfx.Node) and training.op == "get_attr" and training.target == "training"
        if inplace or not isinstance(p, (int, float)) or not (isinstance(training, bool) or live):
            return None
        return args[0], float(p), ("value", training)
    return None


def _fused_dropout_ok(t):
    """Whether a fused dropout kernel may take t: CPU, or CUDA in a kernel dtype while
    no CUDA graph is being captured (the kernels take (seed, offset) on the host, so a
    replay would repeat the captured mask; ATen's dropout reads the graph's RNG state)."""
    if t.device.type == "cpu":
        return True
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16) and not torch.cuda.is_current_stream_capturing()


def _bias_dropout_add(x, weight, bias, residual, p, training):
    """residual + dropout(F.linear(x, weight, bias)) through bias_dropout_add when the
    operands allow it (one shape and dtype, no autocast), else unfused. `training` is
    a bool or the nn.Dropout module (its p and training are read now)."""
    from ... import ops as ko
    if isinstance(training, nn.Module):
        p, training = training.p, training.training
    y = F.linear(x, weight)
    if (y.shape == residual.shape and y.dtype == residual.dtype == bias.dtype and
            not torch.is_autocast_enabled(y.device.type) and _fused_dropout_ok(y)):
        return ko.bias_dropout_add(y, bias, residual, p, training)
    return residual + F.dropout(y + bias, p, training)


def _gelu_dropout(x, p, training, approximate):
    """F.dropout(F.gelu(x, approximate), p, training) through gelu_dropout (one pass, no
    mask stored) when x allows it, else unfused; `training` as in _bias_dropout_add."""
    from ... import ops as ko
    if isinstance(training, nn.Module):
        p, training = training.p, training.training
    if x.is_floating_point() and _fused_dropout_ok(x):
        return ko.gelu_dropout(x, p, training, approximate)
    return F.dropout(F.gelu(x, approximate=approximate), p, training)


def _rewrite_gelu_dropout(gm, g, node, where, report):
    """dropout(gelu(x)), any spelling of either."""
    drop = _dropout_of(gm, node)
    if drop is None or not isinstance(drop[0], tfx.Node):
        return False
    act = _act(gm, drop[0])
    if act is None or act[0] != "gelu":
        return False
    gelu_node, (_, x, approximate) = drop[0], act
    if len(gelu_node.users) != 1:
        report.left.append((where, f"dropout(gelu): {gelu_node.name} is also used elsewhere"))
        return True
    report.fused.append((where, f"dropout(gelu) -> gelu_dropout ({gelu_node.name})"))
    _, p, source = drop
    with g.inserting_before(node):
        train = g.get_attr(source[1]) if source[0] == "module" else source[1]
        new = g.call_function(_gelu_dropout, (x, p, train, approximate))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(gelu_node)
    return True


def _feeds_dropout(gm, node):
    """Whether node's only user is a dropout the gelu_dropout rewrite takes."""
    users = list(node.users)
    return len(users) == 1 and _dropout_of(gm, users[0]) is not None


def _gelu_left_to_dropout(gm, g, node, act, where, report):
    """A gelu whose only user is a dropout: left as it is here."""
    return act[0] == "gelu" and _feeds_dropout(gm, node)   # dropout(gelu(x)) -> gelu_dropout, at the dropout node


def _rewrite_bias_dropout_add(gm, g, node, where, report):
    """r + dropout(linear(x)) with a biased Linear."""
    bin_ = _binary(node, "add")
    if not bin_ or bin_[2] is not None:
        return False
    a, b, _ = bin_
    for d, r in ((b, a), (a, b)):
        drop = _dropout_of(gm, d) if isinstance(d, tfx.Node) else None
        if drop is None:
            continue
        lin_node, p, source = drop
        lin = _linear_of(gm, lin_node) if isinstance(lin_node, tfx.Node) else None
        if lin is None:
            return False
        if lin[2] is None:
            report.left.append((where, "r + dropout(linear(x)): the Linear has no bias to fuse"))
            return True
        if len(d.users) != 1 or len(lin_node.users) != 1:
            report.left.append((where, "r + dropout(linear(x)): an intermediate is also used elsewhere"))
            return True
        report.fused.append((where, f"r + dropout(linear) -> bias_dropout_add ({lin_node.name})"))
        x, w, bias = lin
        with g.inserting_before(node):
            w, bias = _attr_or_node(g, w), _attr_or_node(g, bias)
            train = g.get_attr(source[1]) if source[0] == "module" else source[1]
            new = g.call_function(_bias_dropout_add, (x, w, bias, r, p, train))
        node.replace_all_uses_with(new)
        g.erase_node(node)
        g.erase_node(d)
        g.erase_node(lin_node)
        return True
    return False
