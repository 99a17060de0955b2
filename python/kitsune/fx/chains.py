"""Pointwise chains in ATen graphs: the pointwise ops that no pattern took, in the
forward and backward graphs AOTAutograd gives Kitsune's Dynamo path, grouped into
``torch.ops.kitsune.pointwise_chain`` calls, each one launch of a precompiled kernel
(kitsune/ops/chain.py) instead of one ATen kernel per op.

A group is ops of one output shape (static, at most 6 dimensions) whose operands are float32 / float16 / bfloat16 / bool tensors
that broadcast to it, or Python numbers. It grows in graph order: a node joins the
group of an operand when every value the group gives to nodes outside it is read only
after the node (the chain runs where its last member was, so nothing reads a result
before it exists), and the chain keeps within the kernel's limits. What the group's
members computed and nodes outside read becomes an output of the chain, in the
member's dtype; intermediates stay fp32 (no rounding between ops unless the graph
casts), as Inductor keeps them. Each output of a chain has the strides the graph's
trace gave the member (views after it see the layout ATen would have made).

``fuse(gm)`` rewrites gm in place and returns how many chains it made (groups of at
least two ops)."""
import operator

import torch

from ..ops._check import dense
from ..ops.chain import DTYPES, MAX_DIM, MAX_IN, Program

aten = torch.ops.aten
_MAX_MEMBERS = 24


def _unary(name):
    return lambda p, a, node: p.op(name, a[0])


def _binary(name):
    return lambda p, a, node: p.op(name, a[0], a[1])


def _arg(node, i, name, default):
    """An argument given by position or by keyword."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _scaled(name, first, second):
    """first NAME alpha * second (add, sub; rsub: other - alpha * self)."""
    def lower(p, a, node):
        alpha = _arg(node, 2, "alpha", 1)
        y = a[second] if alpha == 1 else p.op("MUL", a[second], p.const(alpha))
        r = p.op(name, a[first], y)
        if y != a[second]:
            p.release(y)
        return r
    return lower


def _pow_scalar(p, a, node):
    e = node.args[1]
    if e == 2:
        return p.op("MUL", a[0], a[0])
    if e == 0.5:
        return p.op("SQRT", a[0])
    if e == -0.5:
        return p.op("RSQRT", a[0])
    if e == 1:
        return p.op("MUL", a[0], p.const(1.0))
    return p.op("POW", a[0], a[1])


def _gelu(p, a, node):
    return p.op("GELU_TANH" if _arg(node, 1, "approximate", "none") == "tanh" else "GELU", a[0])


def _gelu_backward(p, a, node):
    return p.op("GELU_TANH_BWD" if _arg(node, 2, "approximate", "none") == "tanh" else "GELU_BWD", a[0], a[1])


def _threshold_backward(p, a, node):   # grad where self > threshold, else 0
    le = p.op("LE", a[1], a[2])
    r = p.op("WHERE", le, p.const(0.0), a[0])
    p.release(le)
    return r


def _sigmoid_backward(p, a, node):   # grad * y * (1 - y)
    one_minus = p.op("SUB", p.const(1.0), a[1])
    t = p.op("MUL", a[1], one_minus)
    r = p.op("MUL", a[0], t)
    p.release(one_minus), p.release(t)
    return r


def _tanh_backward(p, a, node):   # grad * (1 - y * y)
    sq = p.op("MUL", a[1], a[1])
    d = p.op("SUB", p.const(1.0), sq)
    r = p.op("MUL", a[0], d)
    p.release(sq), p.release(d)
    return r


def _silu_backward(p, a, node):   # grad * s * (1 + x * (1 - s)), s = sigmoid(x)
    s = p.op("SIGMOID", a[1])
    one = p.const(1.0)
    u = p.op("SUB", one, s)
    v = p.op("MUL", a[1], u)
    w = p.op("ADD", one, v)
    t = p.op("MUL", s, w)
    r = p.op("MUL", a[0], t)
    for tmp in (s, u, v, w, t):
        p.release(tmp)
    return r


_ROUND = {torch.bfloat16: "ROUND_BF16", torch.float16: "ROUND_F16", torch.bool: "TO_BOOL"}


def _to_copy(p, a, node):
    name = _ROUND.get(node.kwargs.get("dtype"))
    return p.op(name, a[0]) if name else p.op("MUL", a[0], p.const(1.0))


def _lowerings():
    t = {}
    for packet, name in ((aten.neg, "NEG"), (aten.exp, "EXP"), (aten.log, "LOG"), (aten.tanh, "TANH"),
                         (aten.sigmoid, "SIGMOID"), (aten.erf, "ERF"), (aten.rsqrt, "RSQRT"), (aten.sqrt, "SQRT"),
                         (aten.relu, "RELU"), (aten.silu, "SILU"), (aten.abs, "ABS"), (aten.reciprocal, "RECIP"),
                         (aten.log1p, "LOG1P")):
        t[packet.default] = _unary(name)
    for packet, name in ((aten.mul, "MUL"), (aten.div, "DIV"), (aten.gt, "GT"), (aten.lt, "LT"), (aten.ge, "GE"),
                         (aten.le, "LE"), (aten.eq, "EQ"), (aten.ne, "NE")):
        t[packet.Tensor] = t[packet.Scalar] = _binary(name)
    t[aten.maximum.default] = _binary("MAX")
    t[aten.minimum.default] = _binary("MIN")
    t[aten.pow.Tensor_Tensor] = _binary("POW")
    t[aten.pow.Tensor_Scalar] = _pow_scalar
    t[aten.add.Tensor] = t[aten.add.Scalar] = _scaled("ADD", 0, 1)
    t[aten.sub.Tensor] = t[aten.sub.Scalar] = _scaled("SUB", 0, 1)
    t[aten.rsub.Scalar] = _scaled("SUB", 1, 0)
    t[aten.where.self] = lambda p, a, node: p.op("WHERE", a[0], a[1], a[2])
    t[aten.gelu.default] = _gelu
    t[aten.gelu_backward.default] = _gelu_backward
    t[aten.threshold_backward.default] = _threshold_backward
    t[aten.sigmoid_backward.default] = _sigmoid_backward
    t[aten.tanh_backward.default] = _tanh_backward
    t[aten.silu_backward.default] = _silu_backward
    t[aten._to_copy.default] = _to_copy
    t[aten.clamp_min.default] = _binary("MAX")
    t[aten.clamp_max.default] = _binary("MIN")
    return t


LOWER = _lowerings()
_COMPARE = {aten.gt.Tensor, aten.gt.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
            aten.le.Tensor, aten.le.Scalar, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar}
# keyword arguments a lowering reads; any other keyword makes the node not fusible
_KWARGS = {aten.add.Tensor: {"alpha"}, aten.add.Scalar: {"alpha"}, aten.sub.Tensor: {"alpha"},
           aten.sub.Scalar: {"alpha"}, aten.rsub.Scalar: {"alpha"}, aten.gelu.default: {"approximate"},
           aten.gelu_backward.default: {"approximate"}, aten._to_copy.default: {"dtype", "layout", "device"}}


def _val(n):
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _static(shape):
    return all(type(s) is int for s in shape)


def _fusible(node):
    """The node's output value when it can join a chain, else None."""
    if node.op != "call_function" or node.target not in LOWER:
        return None
    out = _val(node)
    if out is None or out.dtype not in DTYPES or out.device.type == "meta" or not _static(out.shape):
        return None
    if out.dim() > MAX_DIM or (node.target in _COMPARE) != (out.dtype == torch.bool) and \
            node.target is not aten._to_copy.default:
        return None   # a bool result only from a comparison or a cast (not True + True)
    if not dense(out):
        return None
    if set(node.kwargs) - _KWARGS.get(node.target, set()):
        return None
    kw = node.kwargs
    if node.target is aten._to_copy.default:
        if kw.get("dtype") not in DTYPES or kw.get("device") not in (None, out.device) or \
                kw.get("layout") not in (None, torch.strided):
            return None
    gelu = node.target in (aten.gelu.default, aten.gelu_backward.default)
    if gelu and _arg(node, 1 if node.target is aten.gelu.default else 2, "approximate", "none") not in ("none", "tanh"):
        return None
    for a in node.args:
        if gelu and isinstance(a, str):
            continue
        if isinstance(a, torch.fx.Node):
            v = _val(a)
            if v is None or v.dtype not in DTYPES or v.device != out.device or not _static(v.shape) or \
                    v.dim() > out.dim():
                return None
        elif type(a) not in (int, float, bool):
            return None
    if node.target is aten.threshold_backward.default and not isinstance(node.args[2], (int, float)):
        return None
    return out


class _Group:
    def __init__(self, node, out):
        self.members, self.set = [node], {node}
        self.shape, self.device = tuple(out.shape), out.device

    def inputs(self):
        return _inputs_of(self.members)


def _inputs_of(members, extra=None):
    """The nodes members (and extra) read that are none of them, in first-read order."""
    more = [extra] if extra is not None else []
    inside = set(members) | set(more)
    seen = []
    for m in list(members) + more:
        for a in m.args:
            if isinstance(a, torch.fx.Node) and a not in inside and a not in seen:
                seen.append(a)
    return seen


def _can_join(groups, node, order):
    """Whether node and the members of groups can run as one chain at node."""
    members = [m for g in groups for m in g.members]
    if len(members) >= _MAX_MEMBERS or len(_inputs_of(members, node)) > MAX_IN:
        return False
    inside, here = set(members) | {node}, order[node]
    for m in members:   # nothing outside may read a member before the chain runs (at node)
        for u in m.users:
            if u not in inside and order[u] < here:
                return False
    return True


def _groups(graph):
    """The groups, in graph order: a node joins the groups of its operands that it may
    (the latest first), which merge."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    group_of, groups = {}, []
    for node in graph.nodes:
        out = _fusible(node)
        if out is None:
            continue
        cands = []
        for a in node.args:
            g = group_of.get(a) if isinstance(a, torch.fx.Node) else None
            if g is not None and g not in cands and g.shape == tuple(out.shape) and g.device == out.device:
                cands.append(g)
        cands.sort(key=lambda g: -order[g.members[-1]])
        joined = []
        for g in cands:
            if _can_join(joined + [g], node, order):
                joined.append(g)
        if not joined:
            best = _Group(node, out)
            groups.append(best)
        else:
            best = joined[0]
            for g in joined[1:]:   # merged into the first
                best.members += g.members
                best.set |= g.set
                for m in g.members:
                    group_of[m] = best
                groups.remove(g)
            best.members.sort(key=order.get)
            best.members.append(node)
            best.set.add(node)
        group_of[node] = best
    return [g for g in groups if len(g.members) >= 2]


def _program(g):
    """(inputs, outputs, Program) for a group; ValueError when it does not fit the kernel."""
    inputs = g.inputs()
    outputs = [m for m in g.members if any(u not in g.set for u in m.users)]
    p = Program(len(inputs))
    reg = {n: i for i, n in enumerate(inputs)}
    left = {m: sum(1 for u in m.users if u in g.set) for m in g.members}
    for m in g.members:
        regs = [reg[a] if isinstance(a, torch.fx.Node) else p.const(a) if type(a) in (int, float, bool) else None
                for a in m.args]
        reg[m] = LOWER[m.target](p, regs, m)
        for a in dict.fromkeys(a for a in m.args if isinstance(a, torch.fx.Node) and a in g.set):
            left[a] -= 1
            if left[a] == 0 and a not in outputs:
                p.release(reg[a])
    for m in outputs:
        p.output(reg[m], _val(m).dtype)
    if len(outputs) > 4:
        raise ValueError("more outputs than the kernel stores")
    return inputs, outputs, p


def fuse(gm):
    """Rewrites gm's pointwise groups into pointwise_chain calls; returns how many."""
    graph, made = gm.graph, 0
    for g in _groups(graph):
        try:
            inputs, outputs, p = _program(g)
        except ValueError:   # over a limit of the kernel's: left as ATen ops
            continue
        if not outputs:
            continue
        strides = [s for m in outputs for s in _val(m).stride()]
        contiguous = all(_val(m).is_contiguous() for m in outputs)
        with graph.inserting_after(g.members[-1]):
            call = graph.call_function(torch.ops.kitsune.pointwise_chain.default,
                                       (inputs, *p.args(() if contiguous else strides)))
        call.meta["val"] = [_val(m) for m in outputs]
        last = call
        for k, m in enumerate(outputs):
            with graph.inserting_after(last):
                item = graph.call_function(operator.getitem, (call, k))
            item.meta["val"] = _val(m)
            m.replace_all_uses_with(item, delete_user_cb=lambda u: u not in g.set)
            last = item
        for m in reversed(g.members):
            graph.erase_node(m)
        made += 1
    if made:
        graph.lint()
        gm.recompile()
    return made
