"""GEMMs: relu(linear(x)) -> linear_act(relu), any other Linear with a bias ->
linear_act(none), (q @ k^T) * s -> attention_score."""
import operator

import torch
import torch.fx as tfx

from ..match import _attr_or_node, _fuse_pair, _linear_of


def _rewrite_relu_linear(gm, g, node, act, where, report):
    """relu(linear(x)) with a bias -> linear_act(x, W, b, "relu")."""
    from ... import ops as ko
    kind, inner, _ = act
    lin = _linear_of(gm, inner) if kind == "relu" and isinstance(inner, tfx.Node) else None
    if lin is None or lin[2] is None:
        return False
    _fuse_pair(g, node, inner, where, report, "relu(linear)", "linear_act",
               lambda: g.call_function(ko.linear_act, (lin[0], _attr_or_node(g, lin[1]),
                                                       _attr_or_node(g, lin[2]), "relu")))
    return True


def _rewrite_linear_bias(gm, g, prefix, report):
    """Every Linear with a bias left after the other patterns -> linear_act(..., "none")."""
    from ... import ops as ko
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        lin = _linear_of(gm, node)
        if lin is None or lin[2] is None:
            continue
        report.fused.append((f"{prefix}{node.name}", "linear -> linear_act(none) (the bias gradient by column sum)"))
        with g.inserting_before(node):
            new = g.call_function(ko.linear_act, (lin[0], _attr_or_node(g, lin[1]), _attr_or_node(g, lin[2]),
                                                  "none"))
        node.replace_all_uses_with(new)
        g.erase_node(node)


def _attention_score(q, k, scale):
    """(q @ k^T) * scale as one GEMM when q and k share their batch dims, else unfused."""
    from ... import ops as ko
    if q.dim() >= 2 and q.shape[:-2] == k.shape[:-2] and q.shape[-1] == k.shape[-1] and q.dtype == k.dtype:
        return ko.attention_score(q, k, scale)
    return (q @ k.transpose(-2, -1)) * scale


def _transposed_last_two(node):
    """k when node is k.transpose(-2, -1) / k.transpose(-1, -2) / k.mT, else None."""
    if not isinstance(node, tfx.Node):
        return None
    if node.op == "call_method" and node.target == "transpose" and len(node.args) == 3 and \
            set(node.args[1:]) in ({-2, -1},):
        return node.args[0]
    if node.op == "call_function" and node.target is torch.transpose and len(node.args) == 3 and \
            set(node.args[1:]) == {-2, -1}:
        return node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    return None


def _rewrite_attention_score(gm, g, node, where, report):
    """(q @ k^T) * s and (q @ k^T) / s, s a Python number."""
    mul = node.op == "call_function" and node.target in (operator.mul, torch.mul)
    div = node.op == "call_function" and node.target in (operator.truediv, torch.div)
    if not (mul or div) or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    if mul and isinstance(a, (int, float)) and not isinstance(a, bool):
        a, b = b, a
    if not (isinstance(a, tfx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool)) or (div and b == 0):
        return False
    if not (a.op == "call_function" and a.target in (operator.matmul, torch.matmul)) or len(a.args) != 2:
        return False
    k = _transposed_last_two(a.args[1])
    if k is None:
        return False
    if len(a.users) != 1 or len(a.args[1].users) != 1:
        report.left.append((where, "q @ k^T * scale: an intermediate is also used elsewhere"))
        return True
    scale = float(b) if mul else 1.0 / float(b)
    report.fused.append((where, f"(q @ k^T) * scale -> attention_score ({a.name})"))
    kt_node = a.args[1]
    with g.inserting_before(node):
        new = g.call_function(_attention_score, (a.args[0], k, scale))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(a)
    g.erase_node(kt_node)
    return True
