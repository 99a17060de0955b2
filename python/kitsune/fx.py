"""kitsune.optimize / kitsune.explain: rewrite a model's FX graph to Kitsune's fused ops.

The eager path, and ``torch.compile(model, backend="kitsune")`` (importing
kitsune.fx registers the backend; see :func:`kitsune_backend`). ``optimize(model)`` traces the model with torch.fx (a submodule
that cannot be traced is left as it is and its children are tried one by one),
rewrites every pattern below whatever its spelling, and returns a module with the
same outputs (within the ops' tolerance). ``explain(model)`` runs the same
matching without changing anything and reports what would be fused and what was
left, with the reason.

Patterns (each intermediate must have no other user, so nothing observable is lost):
  relu(a + b)              -> kitsune.add_relu(a, b)
  tanh(a * b)              -> kitsune.mul_tanh(a, b)
  gelu(linear(x))          -> kitsune.bias_gelu(linear(x, W), bias)   (nn.Linear or F.linear with a bias)
  gelu(x + bias)           -> kitsune.bias_gelu(x, bias)              (bias a 1-D parameter)
  silu(g) * u, u * silu(g) -> kitsune.swiglu(g, u)
  nn.RMSNorm / F.rms_norm  -> kitsune.rms_norm(x, weight, eps)        (with a weight and an eps)
Spellings: modules (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, in-place too), functions
(F.relu, torch.relu, F.gelu, F.silu, torch.tanh, ...), methods (x.relu(), x.tanh(),
x.relu_(), ...), and + / torch.add / x.add(...) / += (an in-place add only when
nothing else reads the operand it overwrites).
"""
import copy
import operator
from dataclasses import dataclass, field

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


@dataclass
class Report:
    """What optimize did (or explain would do): ``fused`` and ``left`` are lists of
    (where, what) pairs; ``untraced`` names submodules torch.fx could not trace."""
    fused: list = field(default_factory=list)
    left: list = field(default_factory=list)
    untraced: list = field(default_factory=list)

    def __str__(self):
        lines = [f"kitsune: {len(self.fused)} fused, {len(self.left)} left"]
        lines += [f"  fused  {w}: {what}" for w, what in self.fused]
        lines += [f"  left   {w}: {why}" for w, why in self.left]
        lines += [f"  not traced {w}: {why}" for w, why in self.untraced]
        return "\n".join(lines)


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


def _param(gm, node):
    """The tensor a get_attr node names, else None."""
    if isinstance(node, tfx.Node) and node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def _rewrite(gm, report, prefix, apply):
    from . import ops as ko   # loads the bridge (the ops' CPU and CUDA kernels)
    g = gm.graph
    for node in list(g.nodes):
        if getattr(node, "_erased", False):   # removed by an earlier rewrite
            continue
        where = f"{prefix}{node.name}"
        act = _act(gm, node)
        # ---- relu(a + b), tanh(a * b), gelu(x + bias), gelu(linear(x)) ----
        if act:
            kind, inner, approximate = act
            if kind in ("relu", "tanh", "gelu") and isinstance(inner, tfx.Node):
                op = "mul" if kind == "tanh" else "add"
                bin_ = _binary(inner, op)
                lin = _module(gm, inner) if kind == "gelu" else None
                flin = kind == "gelu" and inner.op == "call_function" and inner.target is F.linear
                if bin_ is None and not isinstance(lin, nn.Linear) and not flin:
                    continue
                if len(inner.users) != 1:
                    report.left.append((where, f"{kind}: its input {inner.name} is also used elsewhere"))
                    continue
                if flin:   # F.linear(x, W, b), e.g. in a torch.compile (Dynamo) graph
                    args = list(inner.args) + [None] * 3
                    bias = inner.kwargs.get("bias", args[2])
                    if bias is None:
                        report.left.append((where, "gelu(linear(x)): the Linear has no bias to fuse"))
                        continue
                    report.fused.append((where, f"gelu(linear) -> bias_gelu ({inner.name})"))
                    if apply:
                        with g.inserting_before(node):
                            mm = g.call_function(F.linear, (inner.args[0], inner.kwargs.get("weight", args[1])))
                            new = g.call_function(ko.bias_gelu, (mm, bias, approximate))
                        node.replace_all_uses_with(new)
                        g.erase_node(node)
                        g.erase_node(inner)
                    continue
                if isinstance(lin, nn.Linear):
                    if lin.bias is None:
                        report.left.append((where, "gelu(linear(x)): the Linear has no bias to fuse"))
                        continue
                    report.fused.append((where, f"gelu(linear) -> bias_gelu ({inner.name})"))
                    if apply:
                        with g.inserting_before(node):
                            w = g.get_attr(f"{inner.target}.weight")
                            b = g.get_attr(f"{inner.target}.bias")
                            mm = g.call_function(F.linear, (inner.args[0], w))
                            new = g.call_function(ko.bias_gelu, (mm, b, approximate))
                        node.replace_all_uses_with(new)
                        g.erase_node(node)
                        g.erase_node(inner)
                    continue
                a, b, why = bin_
                if why:
                    report.left.append((where, f"{kind}: {why}"))
                    continue
                if kind == "gelu":
                    p = _param(gm, b) if _param(gm, b) is not None else _param(gm, a)
                    x = a if _param(gm, b) is not None else b
                    if p is None or p.dim() != 1 or p.shape[0] < 2:
                        report.left.append((where, "gelu(x + y): y is not a 1-D parameter (no bias to fuse)"))
                        continue
                    args, target, what = (x, b if x is a else a, approximate), ko.bias_gelu, "gelu(x + bias) -> bias_gelu"
                elif kind == "relu":
                    args, target, what = (a, b), ko.add_relu, "relu(a + b) -> add_relu"
                else:
                    args, target, what = (a, b), ko.mul_tanh, "tanh(a * b) -> mul_tanh"
                report.fused.append((where, what))
                if apply:
                    with g.inserting_before(node):
                        new = g.call_function(target, args)
                    node.replace_all_uses_with(new)
                    g.erase_node(node)
                    g.erase_node(inner)
            continue
        # ---- silu(g) * u ----
        bin_ = _binary(node, "mul")
        if bin_ and bin_[2] is None:
            a, b, _ = bin_
            for s, u in ((a, b), (b, a)):
                sa = _act(gm, s)
                if sa and sa[0] == "silu":
                    if len(s.users) != 1:
                        report.left.append((where, f"silu(g) * u: silu output {s.name} is also used elsewhere"))
                        break
                    report.fused.append((where, "silu(g) * u -> swiglu"))
                    if apply:
                        with g.inserting_before(node):
                            new = g.call_function(ko.swiglu, (sa[1], u))
                        node.replace_all_uses_with(new)
                        g.erase_node(node)
                        g.erase_node(s)
                    break
            continue
        # ---- RMSNorm ----
        m = _module(gm, node)
        is_fn = node.op == "call_function" and node.target in (F.rms_norm, torch.rms_norm)
        if isinstance(m, nn.RMSNorm) or is_fn:
            if m is not None:
                shape, weight, eps = tuple(m.normalized_shape), m.weight, m.eps
            else:
                args = list(node.args) + [None] * 4
                shape = node.kwargs.get("normalized_shape", args[1])
                weight = node.kwargs.get("weight", args[2])
                eps = node.kwargs.get("eps", args[3])
                shape = tuple(shape) if isinstance(shape, (list, tuple)) else None
            if shape is None or len(shape) != 1:
                report.left.append((where, "rms_norm over more than the last dimension"))
            elif weight is None:
                report.left.append((where, "rms_norm without a weight"))
            elif eps is None:
                report.left.append((where, "rms_norm with eps=None (it depends on the input's dtype)"))
            else:
                report.fused.append((where, "rms_norm -> kitsune.rms_norm"))
                if apply:
                    with g.inserting_before(node):
                        w = g.get_attr(f"{node.target}.weight") if m is not None else weight
                        new = g.call_function(ko.rms_norm, (node.args[0], w, float(eps)))
                    node.replace_all_uses_with(new)
                    g.erase_node(node)
    if apply:
        g.lint()
        gm.recompile()


def _walk(module, report, prefix, apply):
    """Returns the module to use in place of `module`."""
    try:
        gm = tfx.symbolic_trace(module)
    except Exception as e:   # noqa: BLE001 - any tracing failure means: try the children
        report.untraced.append((prefix.rstrip(".") or type(module).__name__,
                                f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
        for name, child in list(module.named_children()):
            new = _walk(child, report, f"{prefix}{name}.", apply)
            if apply and new is not child:
                setattr(module, name, new)
        return module
    _rewrite(gm, report, prefix, apply)
    return gm if apply else module


def optimize(model, inplace=False, report=None):
    """Returns ``model`` with every matched pattern replaced by Kitsune's fused ops
    (a torch.fx GraphModule, or the model itself with rewritten submodules where
    tracing failed). Parameters are shared with ``model`` unless it is copied
    (``inplace=False``, the default, deep-copies first). Pass a :class:`Report` to
    get what was fused and left."""
    report = report if report is not None else Report()
    m = model if inplace else copy.deepcopy(model)
    return _walk(m, report, "", apply=True)


def explain(model):
    """A :class:`Report` of what :func:`optimize` would fuse and leave, with reasons;
    the model is not changed."""
    report = Report()
    _walk(model, report, "", apply=False)
    return report


# ---- torch.compile(model, backend="kitsune") -------------------------------------
last_compile_report = None   # the Report of the last graph the backend compiled


def kitsune_backend(gm, example_inputs):
    """A torch.compile backend: rewrites the Dynamo graph with the patterns above,
    then hands it to Inductor, which traces the fused ops through their fake
    kernels and autograd (forward and backward) and compiles the rest as usual."""
    global last_compile_report
    from torch._inductor.compile_fx import compile_fx
    report = Report()
    _rewrite(gm, report, "", apply=True)
    last_compile_report = report
    return compile_fx(gm, example_inputs)


def _register_backend():
    from torch._dynamo import list_backends, register_backend
    if "kitsune" not in list_backends(exclude_tags=()):
        register_backend(name="kitsune")(kitsune_backend)


_register_backend()
