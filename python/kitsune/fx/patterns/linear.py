"""GEMMs: relu(linear(x)) -> linear_act(relu), any other Linear with a bias ->
linear_act(none), (q @ k^T) * s -> attention_score; a wide Linear whose width cuBLAS
runs slowly (an LM head's vocabulary) -> wide_linear."""
import operator

import torch
import torch.fx as tfx

from ..match import _attr, _attr_or_node, _fuse_pair, _linear_of, _param, _swap


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
        w = _attr(gm, lin[1][5:]) if isinstance(lin[1], str) else _param(gm, lin[1])
        if isinstance(w, torch.Tensor) and is_wide(w):
            report._wide_weights.add(id(w))
            report.fused.append((f"{prefix}{node.name}", f"linear -> wide_linear ({w.shape[0]} features padded to "
                                                         f"{(w.shape[0] + 63) // 64 * 64} in the GEMMs)"))
            with g.inserting_before(node):
                args = (lin[0], _attr_or_node(g, lin[1]), _attr_or_node(g, lin[2]))
            _swap(g, node, ko.wide_linear, args)
            continue
        report.fused.append((f"{prefix}{node.name}", "linear -> linear_act(none) (the bias gradient by column sum)"))
        with g.inserting_before(node):
            new = g.call_function(ko.linear_act, (lin[0], _attr_or_node(g, lin[1]), _attr_or_node(g, lin[2]),
                                                  "none"))
        node.replace_all_uses_with(new)
        g.erase_node(node)


def is_wide(weight):
    """A Linear weight whose output features (rows) cuBLAS runs slowly: 4096 or more and
    not a multiple of 8 (GPT-2's 50257 classes, BERT's 30522), over a width of input
    features that is one."""
    return weight.dim() == 2 and weight.shape[0] >= 4096 and weight.shape[0] % 8 != 0 and weight.shape[1] % 8 == 0


class WideLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, state_dict and isinstance) whose forward is
    kitsune.ops.wide_linear: the GEMMs over the output features padded to a multiple
    of 64. kitsune.optimize gives it to the wide Linears its patterns left alone."""

    def forward(self, x):
        from ... import ops as ko
        return ko.wide_linear(x, self.weight, self.bias)


def _settle_wide_linears(model, report, apply):
    """Each nn.Linear of model (the class itself) with a wide weight becomes a WideLinear
    (apply; explain only reports it), but those a graph rewrite already gave to
    wide_linear: their modules are no longer called."""
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and is_wide(m.weight) and id(m.weight) not in report._wide_weights:
            report.swapped.append((name or type(m).__name__, f"Linear({m.in_features}, {m.out_features}) -> "
                                   f"WideLinear (the GEMMs over {(m.out_features + 63) // 64 * 64} features)"))
            if apply:
                m.__class__ = WideLinear


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


# ---- Hugging Face's Conv1D (GPT-2's projections): a Linear with its weight stored (in, out) ----
#   size_out = x.size()[:-1] + (nf,)
#   out = torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(size_out)

def _tensor_meta(node):
    """The example tensor Dynamo noted for node, or None (a traced graph notes none)."""
    v = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, tfx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape_is_rows_then(node, x, n):
    """Whether node, a view's shape argument, is x's shape but the last dim, then n:
    x.size()[:-1] + (n,) as traced, or the same numbers as a tuple (Dynamo's); None
    when that cannot be told (x made by an earlier rewrite, with no example noted)."""
    if isinstance(node, (tuple, list)):
        t = _tensor_meta(x)
        if t is None:
            return None if all(isinstance(d, int) for d in node) and node[-1] == n else False
        return tuple(node) == tuple(t.shape[:-1]) + (n,)
    if not (isinstance(node, tfx.Node) and node.op == "call_function" and node.target is operator.add
            and len(node.args) == 2 and tuple(node.args[1]) == (n,)):
        return False
    head = node.args[0]
    if not (isinstance(head, tfx.Node) and head.op == "call_function" and head.target is operator.getitem
            and head.args[1] == slice(None, -1, None)):
        return False
    size = head.args[0]
    return isinstance(size, tfx.Node) and size.op == "call_method" and size.target == "size" and \
        size.args == (x,)


def _rewrite_conv1d(gm, g, node, where, report):
    """addmm(b, x.view(-1, in), W).view(x.shape[:-1] + (out,)), HF's Conv1D, -> F.linear(x,
    W.t(), b), so the Linear patterns take it (linear_act with its epilogue or the bias
    gradient by column sum). W must be a 2-D (in, out) tensor and b its 1-D bias."""
    if not (node.op == "call_method" and node.target == "view" and len(node.args) == 2 and not node.kwargs):
        return False
    mm = node.args[0]
    if not (isinstance(mm, tfx.Node) and mm.op == "call_function" and mm.target is torch.addmm
            and len(mm.args) == 3 and not mm.kwargs and len(mm.users) == 1):
        return False
    b, rows, w = mm.args
    if not (isinstance(rows, tfx.Node) and rows.op == "call_method" and rows.target == "view"
            and len(rows.args) == 3 and rows.args[1] == -1 and len(rows.users) == 1):
        return False
    x = rows.args[0]
    wt = _param(gm, w) if w.op == "get_attr" else _tensor_meta(w)
    bt = _param(gm, b) if isinstance(b, tfx.Node) and b.op == "get_attr" else _tensor_meta(b)
    if not (isinstance(wt, torch.Tensor) and wt.dim() == 2 and isinstance(bt, torch.Tensor) and bt.dim() == 1
            and bt.shape[0] == wt.shape[1]):
        return False
    same = _shape_is_rows_then(node.args[1], x, wt.shape[1])
    if same is False:
        return False
    # a change of spelling, not a fusion: what the Linear patterns then make of it is reported
    with g.inserting_before(node):
        lin = g.call_function(torch.nn.functional.linear, (x, g.call_method("t", (w,)), b))
        # unconfirmed shapes: the view kept (the same elements in the same order either way)
        out = lin if same else g.call_method("view", (lin, node.args[1]))
    node.replace_all_uses_with(out)
    g.erase_node(node)
    g.erase_node(mm)
    g.erase_node(rows)
    return True   # the F.linear meets the activation patterns from its user, and the bias rewrite
