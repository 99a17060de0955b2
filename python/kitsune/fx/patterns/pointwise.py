"""relu(a + b) -> add_relu, tanh(a * b) -> mul_tanh, gelu(x + bias) and gelu(linear(x))
-> bias_gelu (tanh GELU after a Linear: linear_act(gelu_tanh)), silu(g) * u -> swiglu."""
import math
import operator

import torch
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


# ---- the tanh approximation of GELU, written out (GPT-2's NewGELUActivation and its copies) ----
#   0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))

def _scaled(node):
    """(constant, other) for node = c * other or other * c with c a Python number, else None."""
    if not (isinstance(node, tfx.Node) and node.op == "call_function" and node.target in (operator.mul, torch.mul)
            and len(node.args) == 2 and not node.kwargs):
        return None
    a, b = node.args
    if isinstance(a, (int, float)) and isinstance(b, tfx.Node):
        return float(a), b
    if isinstance(b, (int, float)) and isinstance(a, tfx.Node):
        return float(b), a
    return None


def _plus(node, const=None):
    """(a, b) for node = a + b (const: one operand that Python number, returned as b)."""
    if not (isinstance(node, tfx.Node) and node.op == "call_function" and node.target in (operator.add, torch.add)
            and len(node.args) == 2 and not node.kwargs):
        return None
    a, b = node.args
    if const is None:
        return (a, b) if isinstance(a, tfx.Node) and isinstance(b, tfx.Node) else None
    if isinstance(a, (int, float)) and a == const:
        return b, a
    if isinstance(b, (int, float)) and b == const:
        return a, b
    return None


def _tanh_gelu_of(node):
    """(x, the chain's nodes) when node computes 0.5 * x * (1 + tanh(sqrt(2/pi) * (x +
    0.044715 * x^3))) in GPT-2's order of operations, every inner node read once."""
    ab = _binary(node, "mul")
    if not ab or ab[0] is None:
        return None
    for half, rest in (ab[:2], ab[1::-1]):
        h = _scaled(half)
        one = _plus(rest, 1.0)
        if not (h and abs(h[0] - 0.5) < 1e-12 and one):
            continue
        x, t = h[1], one[0]
        if not (isinstance(t, tfx.Node) and t.op == "call_function" and t.target in (torch.tanh, F.tanh)
                and len(t.args) == 1):
            continue
        k = _scaled(t.args[0])
        if not (k and abs(k[0] - math.sqrt(2.0 / math.pi)) < 1e-6):
            continue
        inner = _plus(k[1])
        if not inner:
            continue
        cube = next((_scaled(v) for v, other in (inner, inner[::-1]) if other is x), None)
        if not (cube and abs(cube[0] - 0.044715) < 1e-9):
            continue
        p = cube[1]
        if not (isinstance(p, tfx.Node) and ((p.op == "call_function" and p.target is torch.pow) or
                                              (p.op == "call_method" and p.target == "pow"))
                and len(p.args) == 2 and p.args[0] is x and p.args[1] in (3, 3.0)):
            continue
        chain = (half, rest, t, t.args[0], k[1], next(v for v in inner if v is not x), p)
        if any(len(n.users) != 1 for n in chain):
            continue
        return x, chain
    return None


def _rewrite_tanh_gelu(gm, g, node, where, report):
    """The tanh-GELU written out -> F.gelu(x, approximate="tanh") (one kernel instead of
    eight), then offered to the activation patterns (bias_gelu, linear_act)."""
    found = _tanh_gelu_of(node)
    if found is None:
        return False
    x, chain = found
    report.fused.append((where, "tanh-GELU written out (pow, tanh, 5 products and sums) -> gelu (one ATen op)"))
    with g.inserting_before(node):
        new = g.call_function(F.gelu, (x,), {"approximate": "tanh"})
    node.replace_all_uses_with(new)
    g.erase_node(node)
    prefix = where[:len(where) - len(node.name)]
    gone = {prefix + n.name for n in chain}
    report.left[:] = [(w, why) for w, why in report.left if w not in gone]   # the tanh's "left", say
    for n in chain:
        g.erase_node(n)
    from ..engine import _rewrite_activation   # the GELU's own patterns, with what feeds it
    _rewrite_activation(gm, g, new, where, report)
    return True
