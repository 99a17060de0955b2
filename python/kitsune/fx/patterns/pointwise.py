"""relu(a + b) -> add_relu, tanh(a * b) -> mul_tanh, gelu(x + bias) and gelu(linear(x))
-> bias_gelu (tanh GELU after a Linear: linear_act(gelu_tanh)), silu(g) * u -> swiglu."""
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _act, _binary, _module, _param
from .batch_norm import _rewrite_batch_norm_add_relu


def _rewrite_pointwise_act(gm, g, node, act, where, report):
    """relu(a + b), tanh(a * b), gelu(x + bias), gelu(linear(x)); relu(batch_norm(x) + r)
    goes to batch_norm_add_relu before relu(a + b) to add_relu."""
    from ... import ops as ko
    kind, inner, approximate = act
    if not (kind in ("relu", "tanh", "gelu") and isinstance(inner, tfx.Node)):
        return False
    op = "mul" if kind == "tanh" else "add"
    bin_ = _binary(inner, op)
    lin = _module(gm, inner) if kind == "gelu" else None
    flin = kind == "gelu" and inner.op == "call_function" and inner.target is F.linear
    if bin_ is None and not isinstance(lin, nn.Linear) and not flin:
        return True
    if len(inner.users) != 1:
        report.left.append((where, f"{kind}: its input {inner.name} is also used elsewhere"))
        return True
    if flin:   # F.linear(x, W, b), e.g. in a torch.compile (Dynamo) graph
        args = list(inner.args) + [None] * 3
        bias = inner.kwargs.get("bias", args[2])
        if bias is None:
            report.left.append((where, "gelu(linear(x)): the Linear has no bias to fuse"))
            return True
        with g.inserting_before(node):
            new = _gelu_linear(g, ko, where, report, inner, inner.args[0],
                               inner.kwargs.get("weight", args[1]), bias, approximate)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        g.erase_node(inner)
        return True
    if isinstance(lin, nn.Linear):
        if lin.bias is None:
            report.left.append((where, "gelu(linear(x)): the Linear has no bias to fuse"))
            return True
        with g.inserting_before(node):
            new = _gelu_linear(g, ko, where, report, inner, inner.args[0],
                               g.get_attr(f"{inner.target}.weight"), g.get_attr(f"{inner.target}.bias"),
                               approximate)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        g.erase_node(inner)
        return True
    a, b, why = bin_
    if why:
        report.left.append((where, f"{kind}: {why}"))
        return True
    if kind == "gelu":
        p = _param(gm, b) if _param(gm, b) is not None else _param(gm, a)
        x = a if _param(gm, b) is not None else b
        if p is None or p.dim() != 1 or p.shape[0] < 2:
            report.left.append((where, "gelu(x + y): y is not a 1-D parameter (no bias to fuse)"))
            return True
        args, target, what = (x, b if x is a else a, approximate), ko.bias_gelu, "gelu(x + bias) -> bias_gelu"
    elif kind == "relu" and _rewrite_batch_norm_add_relu(gm, g, node, inner, a, b, where, report):
        return True
    elif kind == "relu":
        args, target, what = (a, b), ko.add_relu, "relu(a + b) -> add_relu"
    else:
        args, target, what = (a, b), ko.mul_tanh, "tanh(a * b) -> mul_tanh"
    report.fused.append((where, what))
    with g.inserting_before(node):
        new = g.call_function(target, args)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(inner)
    return True


def _gelu_linear(g, ko, where, report, inner, x, w, b, approximate):
    """gelu(linear(x, w, b)) as a node inserted at the graph's cursor: tanh GELU as
    linear_act(x, w, b, "gelu_tanh") (on CUDA in fp16/bf16 one cuBLASLt GEMM with the
    bias and GELU in its epilogue, the backward one pass for GELU's derivative and the
    bias gradient; elsewhere the GEMM and bias_gelu); exact GELU, which no GEMM
    epilogue computes, as the GEMM and bias_gelu."""
    if approximate == "tanh":
        report.fused.append((where, f"gelu(linear) -> linear_act(gelu_tanh) ({inner.name})"))
        return g.call_function(ko.linear_act, (x, w, b, "gelu_tanh"))
    report.fused.append((where, f"gelu(linear) -> bias_gelu ({inner.name})"))
    return g.call_function(ko.bias_gelu, (g.call_function(F.linear, (x, w)), b, approximate))


def _rewrite_swiglu(gm, g, node, where, report):
    """silu(g) * u and u * silu(g) -> swiglu."""
    from ... import ops as ko
    bin_ = _binary(node, "mul")
    if not (bin_ and bin_[2] is None):
        return False
    a, b, _ = bin_
    for s, u in ((a, b), (b, a)):
        sa = _act(gm, s)
        if sa and sa[0] == "silu":
            if len(s.users) != 1:
                report.left.append((where, f"silu(g) * u: silu output {s.name} is also used elsewhere"))
                break
            report.fused.append((where, "silu(g) * u -> swiglu"))
            with g.inserting_before(node):
                new = g.call_function(ko.swiglu, (sa[1], u))
            node.replace_all_uses_with(new)
            g.erase_node(node)
            g.erase_node(s)
            break
    return True
