"""nn.Embedding / F.embedding -> kitsune.embedding."""
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _attr_or_node, _bound, _module, _swap


def _embedding_of(gm, node):
    """(indices, weight, padding_idx) when node is nn.Embedding or F.embedding without
    max_norm, scale_grad_by_freq or sparse (weight a node, or an "attr:" name), else None."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if type(m) is nn.Embedding:
        if len(node.args) != 1 or node.kwargs or m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            return None
        return node.args[0], f"attr:{node.target}.weight", m.padding_idx
    if node.op == "call_function" and node.target is F.embedding:
        a = _bound(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
                   {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False},
                   node.args, node.kwargs)
        if a is None or "input" not in a or "weight" not in a or a["max_norm"] is not None or \
                a["scale_grad_by_freq"] is not False or a["sparse"] is not False or \
                not (a["padding_idx"] is None or isinstance(a["padding_idx"], int)):
            return None
        return a["input"], a["weight"], a["padding_idx"]
    return None


def _rewrite_embedding(gm, g, node, where, report):
    """nn.Embedding / F.embedding -> kitsune.embedding (the weight gradient by its sort)."""
    from ... import ops as ko
    emb = _embedding_of(gm, node)
    if emb is None:
        return False
    idx, w, pad = emb
    report.fused.append((where, f"embedding -> kitsune.embedding ({node.name})"))
    with g.inserting_before(node):
        w = _attr_or_node(g, w)
    _swap(g, node, ko.embedding, (idx, w, pad))
    return True
