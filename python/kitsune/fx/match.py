"""What a node is: the matchers every pattern module shares (activations, binary ops,
parameters, Linear calls, call arguments) and the graph edits they all make."""
import operator

import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F


_ACT_FUNCS = {
    "relu": {torch.relu, F.relu, torch.relu_, F.relu_},
    "tanh": {torch.tanh, F.tanh, torch.tanh_},
    "gelu": {F.gelu},
    "silu": {F.silu},
}
_ACT_METHODS = {"relu": {"relu", "relu_"}, "tanh": {"tanh", "tanh_"}, "gelu": set(), "silu": set()}
_ACT_MODULES = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "silu": nn.SiLU}


def _module(gm, node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _act(gm, node):
    """(kind, input node, gelu approximate) when node applies an activation, else None."""
    if not isinstance(node, tfx.Node) or not node.args:
        return None
    for kind in _ACT_FUNCS:
        if node.op == "call_function" and node.target in _ACT_FUNCS[kind]:
            return kind, node.args[0], node.kwargs.get("approximate", "none")
        if node.op == "call_method" and node.target in _ACT_METHODS[kind]:
            return kind, node.args[0], "none"
        m = _module(gm, node)
        if m is not None and type(m) is _ACT_MODULES[kind]:
            return kind, node.args[0], getattr(m, "approximate", "none")
    return None


def _binary(node, op):
    """(a, b, why-not) for an out-of-place a + b / a * b node, else None."""
    if not isinstance(node, tfx.Node):
        return None
    fn = {"add": (operator.add, torch.add), "mul": (operator.mul, torch.mul)}[op]
    inplace = {"add": operator.iadd, "mul": operator.imul}[op]
    if node.op == "call_function" and node.target in fn:
        mutates = False
    elif node.op == "call_method" and node.target == op:
        mutates = False
    elif (node.op == "call_function" and node.target is inplace) or (node.op == "call_method" and node.target == op + "_"):
        mutates = True
    else:
        return None
    if len(node.args) != 2 or node.kwargs:
        return None, None, f"{op} with extra arguments (alpha=, out=)"
    a, b = node.args
    if not (isinstance(a, tfx.Node) and isinstance(b, tfx.Node)):
        return None, None, f"{op} with a Python number operand"
    # `out += identity` (ResNet) mutates out; harmless when nothing else reads out.
    if mutates and len(a.users) != 1:
        return None, None, f"in-place {op} mutates {a.name}, which is also read elsewhere"
    return a, b, None


def _attr(gm, target):
    """What a dotted get_attr / call_module target names in gm (a module, a tensor, ...),
    or None."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _param(gm, node):
    """The tensor a get_attr node names, else None."""
    if isinstance(node, tfx.Node) and node.op == "get_attr":
        obj = _attr(gm, node.target)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def _attr_or_node(g, v):
    return g.get_attr(v[5:]) if isinstance(v, str) and v.startswith("attr:") else v


def _bound(names, defaults, args, kwargs):
    """{argument: value} of a call with these positional names and defaults, or None when
    it passes more positional arguments than names or a keyword not among them."""
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    a = dict(defaults)
    a.update(zip(names, args))
    a.update(kwargs)
    return a


def _linear_of(gm, node):
    """(x, weight, bias) when node is nn.Linear or F.linear (weight/bias as nodes or
    "attr:" names), else None."""
    m = _module(gm, node)
    if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:   # a subclass's own forward is not F.linear
        x = node.args[0] if node.args else node.kwargs.get("input")
        if x is None:
            return None
        return x, f"attr:{node.target}.weight", (f"attr:{node.target}.bias" if m.bias is not None else None)
    if isinstance(node, tfx.Node) and node.op == "call_function" and node.target is F.linear:
        args = list(node.args) + [None] * 3
        x = node.kwargs.get("input", args[0])
        return (x, node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])) if x is not None else None
    return None


def _pair(v):
    return (v, v) if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, (tuple, list)) else None


def _swap(g, node, fn, args):
    """Replaces node by fn(*args), a call_function node in its place."""
    with g.inserting_before(node):
        new = g.call_function(fn, args)
    node.replace_all_uses_with(new)
    g.erase_node(node)


def _fuse_pair(g, node, inner, where, report, pattern, op, make):
    """Replaces node(inner(...)) by the node make() inserts, when inner has no other user."""
    if len(inner.users) != 1:
        report.left.append((where, f"{pattern}: {inner.name} is also used elsewhere"))
        return
    report.fused.append((where, f"{pattern} -> {op} ({inner.name})"))
    with g.inserting_before(node):
        new = make()
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(inner)
