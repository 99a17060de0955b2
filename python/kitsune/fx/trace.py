"""Tracing a module for the rewrite, and what makes a traced graph unsafe to stand for the
module's forward. torch.fx runs forward's Python once, on proxies for the inputs and
parameters, so whatever that code decided on the way is frozen into the graph:

- `self.training`: traced again in the other mode; a graph that differs in more than
  arguments that are the mode itself (F.dropout's `training`, which become run-time
  reads of the module's mode) would be right in one mode only, and is refused.
- an optional argument (default None): the trace takes it as given, so `if x is None:`
  takes the "given" branch forever, and a call without it then fails or computes the
  other thing. Traced again with that argument None: where the two graphs differ other
  than by the None itself, the rewrite is refused.
- state: a buffer changed in place, a cache filled, an attribute set happen once, at
  trace time, and never in the graph; trace() puts them back and refuses the graph.
  BatchNorms (subclasses too) stay module calls, so their running statistics are theirs.
- hooks on a submodule the graph inlines or fuses away never run from the graph.
- a child its parent never calls (not_called_by) would be rewritten for nothing.

A refused module is left as it is and its children are tried one by one (engine._walk).
torch.fx also stores tensors the forward makes as attributes `_tensor_constant<i>` of
the module: trace() takes them off and hands them to the caller."""
import inspect
import re

import torch
import torch.fx as tfx
import torch.nn as nn

_ASSERT_IS_NONE = getattr(tfx._symbolic_trace, "_assert_is_none", None)


class _Tracer(tfx.Tracer):
    """torch.fx's tracer, with every BatchNorm or InstanceNorm (nn.modules.batchnorm._NormBase),
    subclasses from other libraries too (timm's BatchNormAct2d), kept a module call as
    torch.nn's own are: their forward updates running statistics in place and picks
    batch or running statistics by self.training, which a trace would run once and
    freeze. Called as modules they decide for themselves at run time."""

    def is_leaf_module(self, m, module_qualified_name):
        return isinstance(m, nn.modules.batchnorm._NormBase) or super().is_leaf_module(m, module_qualified_name)


class MutatesWhileTracing(Exception):
    """The forward changed a buffer or parameter in place while torch.fx traced it."""


_CONSTANT = re.compile(r"_tensor_constant\d+|_torchbind_obj\d+")


def _snapshot(module):
    """What a forward may change of the modules' Python state: each module's __dict__ (its
    values by identity) and the items of the dicts, lists and sets in it."""
    snap = []
    for path, m in module.named_modules(remove_duplicate=True):
        d = m.__dict__
        items = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else set(v))
                 for k, v in d.items() if isinstance(v, (dict, list, set))}
        snap.append((path, m, dict(d), items))
    return snap


def _same(v, old):
    if isinstance(v, dict):
        return list(v) == list(old) and all(dict.__getitem__(v, k) is x for k, x in old.items())
    if isinstance(v, list):
        return len(v) == len(old) and all(a is b for a, b in zip(v, old))
    return v == old


def _put_back(snap, skip_root):
    """Puts back what changed since _snapshot; the attribute paths that had changed."""
    changed = []
    for path, m, old, items in snap:
        d = m.__dict__
        for k in list(d):
            if k not in old and not (m is skip_root and _CONSTANT.fullmatch(k)):
                changed.append(f"{path}.{k}".lstrip("."))
                del d[k]
        for k, v in old.items():
            if d.get(k, v) is not v or k not in d:
                changed.append(f"{path}.{k}".lstrip("."))
                d[k] = v
            if k in items and not _same(v, items[k]):
                changed.append(f"{path}.{k}".lstrip("."))
                if isinstance(v, list):
                    v[:] = items[k]
                else:
                    v.clear()
                    v.update(items[k])
    return changed


def trace(module, concrete_args=None):
    """(GraphModule, constants): module traced with torch.fx, the GraphModule a scratch
    one over module's attributes (rewrites look targets up in it), constants the tensors
    the trace stored on module as attributes, removed from module again.

    torch.fx runs forward's Python for real, on proxies for the inputs and parameters
    only: `self.num_batches_tracked.add_(1)` (timm's BatchNormAct2d) happens once at
    trace time and never in the graph, and a cache the forward fills (timm's LeViT keeps
    attention biases in a dict) would keep proxies. So every buffer and every module's
    Python state is put back as it was, and a forward that changed any raises
    MutatesWhileTracing: its graph would not make that change."""
    snap = _snapshot(module)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    versions = {n: t._version for n, t in (*params.items(), *buffers.items())}
    saved = {n: t.detach().clone() for n, t in buffers.items()}
    try:
        graph = _Tracer().trace(module, concrete_args)
        gm = tfx.GraphModule(module, graph, type(module).__name__)
    finally:
        constants = {k: v for k, v in module.__dict__.items() if _CONSTANT.fullmatch(k) and k not in snap[0][2]}
        changed = _put_back(snap, module)
        changed += [n for n, t in (*params.items(), *buffers.items()) if t._version != versions[n]]
        with torch.no_grad():
            for n in changed:
                if n in saved:
                    buffers[n].copy_(saved[n])
    if changed:
        raise MutatesWhileTracing(f"its forward changes {changed[0]} in place while torch.fx traces it, which the "
                                  "graph would not")
    return gm, constants


def _with_mode(module, training):
    """Sets .training on module and every submodule (not through train(), which a class
    may override with side effects); returns the flags to put back."""
    modes = {m: m.training for m in module.modules()}
    for m in modes:
        m.training = training
    return modes


def _canon(graph, none_at=None):
    """The structure of graph, names left out, to compare two traces: (entries, nodes), an
    entry per node (op, target, args, kwargs), other nodes and placeholders by position,
    the placeholder at index none_at read as the value None, tensor constants as one kind."""
    index, out, nodes, ph = {}, [], [], 0

    def arg(v):
        if isinstance(v, tfx.Node):
            return index[v]
        if isinstance(v, (list, tuple)):
            return (type(v).__name__,) + tuple(arg(a) for a in v)
        if isinstance(v, dict):
            return ("dict",) + tuple((k, arg(a)) for k, a in v.items())
        if isinstance(v, (bool, int, float, str, type(None))):
            return (type(v).__name__, v)
        return (type(v).__name__, repr(v))

    for n in graph.nodes:
        if n.op == "placeholder":
            index[n] = ("NoneType", None) if ph == none_at else ("input", ph)   # as the literal None reads
            ph += 1
            continue
        if n.op == "call_function" and n.target is _ASSERT_IS_NONE:
            continue
        if n.op == "get_attr" and re.fullmatch(r"_tensor_constant\d+", n.target):
            index[n] = ("constant",)
            continue
        target = n.target if isinstance(n.target, str) else (getattr(n.target, "__module__", None),
                                                             getattr(n.target, "__qualname__", repr(n.target)))
        index[n] = ("node", len(out))
        out.append((n.op, target, arg(n.args), arg(n.kwargs)))
        nodes.append(n)
    return out, nodes


def _mode_flags(mine, theirs, training):
    """The top-level positions (indices of args, keys of kwargs; mine and theirs as _canon
    gives them) where mine holds the bool `training` and theirs `not training`, when those
    are their only differences; else None."""
    if len(mine) != len(theirs) or mine[0] != theirs[0]:
        return None
    flags = []
    for i, (x, y) in enumerate(zip(mine[1:], theirs[1:])):
        key = i
        if mine[0] == "dict":
            if x[0] != y[0]:
                return None
            key, x, y = x[0], x[1], y[1]
        if x == y:
            continue
        if x != ("bool", training) or y != ("bool", not training):
            return None
        flags.append(key)
    return flags


def other_mode(module, gm):
    """Traces module in the other mode (train <-> eval): None where gm holds in both, once
    each argument that is the mode's bool in each trace (F.dropout(x, p, self.training),
    torchvision's stochastic_depth(..., self.training), F.batch_norm(..., self.training, ...))
    reads the module's `training` at run time, which this makes it do (.train()/.eval()
    keep working after optimize; F.dropout(x, p), True in both modes, stays a constant);
    else why not. The run-time read is the rewritten module's own flag, which train() and
    eval() set with its submodules'."""
    modes = _with_mode(module, not module.training)
    try:
        other, _ = trace(module)
    except Exception as e:   # noqa: BLE001 - any failure: the graph holds in one mode only
        return f"traces in {'train' if module.training else 'eval'} mode only ({type(e).__name__}: " \
               f"{_first_line(e)})"
    finally:
        for m, t in modes.items():
            m.training = t
    (mine, nodes), (theirs, _) = _canon(gm.graph), _canon(other.graph)
    why = "its forward branches on self.training (the graphs of train and eval mode differ)"
    if len(mine) != len(theirs):
        return why
    patches = []
    for a, b, node in zip(mine, theirs, nodes):
        if a == b:
            continue
        flags = (_mode_flags(a[2], b[2], module.training), _mode_flags(a[3], b[3], module.training))
        if a[:2] != b[:2] or None in flags:
            return why
        patches.append((node, *flags))
    import warnings
    g = gm.graph
    with warnings.catch_warnings():   # get_attr of a plain attribute: fine, the code reads self.training
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        for node, args, kwargs in patches:
            with g.inserting_before(node):
                flag = g.get_attr("training")
            node.args = tuple(flag if i in args else v for i, v in enumerate(node.args))
            node.kwargs = {k: flag if k in kwargs else v for k, v in node.kwargs.items()}
    return None


def frozen_optional(module, gm):
    """The name of an optional argument (default None) of module's forward on which the
    trace specialised, with what shows it, or None. Each is traced again as None; the
    graph traced with it given must be that graph with the argument read as None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, p in enumerate(params):
        if p.default is not None or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        if i >= len(placeholders) or not placeholders[i].users:
            continue   # never read: nothing to specialise on
        try:
            g_none, _ = trace(module, {p.name: None})
        except Exception as e:   # noqa: BLE001
            return f"{p.name}=None does not trace ({type(e).__name__}: {_first_line(e)})"
        if _canon(g_none.graph, none_at=i)[0] != _canon(gm.graph, none_at=i)[0]:
            return f"the graph differs when {p.name} is None"
    return None


def hooked_inside(module):
    """The path of a submodule of module (not module itself) with hooks, or None: a rewritten
    forward inlines or fuses submodules and would skip them."""
    for name, m in module.named_modules():
        if name and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                     or getattr(m, "_forward_hooks_with_kwargs", None)):
            return name
    return None


def _first_line(e):
    return (str(e).splitlines() or [""])[0][:120]


_SOURCES = {}


def _class_source(cls):
    """The source of cls and of its bases below nn.Module (None where any cannot be read)."""
    if cls not in _SOURCES:
        try:
            _SOURCES[cls] = "\n".join(inspect.getsource(c) for c in cls.__mro__
                                      if c not in (nn.Module, object) and issubclass(c, nn.Module))
        except (OSError, TypeError):
            _SOURCES[cls] = None
    return _SOURCES[cls]


def not_called_by(parent, name, child):
    """Whether parent's class never calls its child `name`, read from its source as text:
    every mention of `self.<name>` builds or assigns it (`self.name = ...`), hands it back
    (`return self.name`, `x = self.name`: an alias, walked where it is called), or reads a
    parameter or buffer of it (nn.MultiheadAttention's `self.out_proj.weight`), and none
    calls it, indexes it or passes it on. A forward rewritten there would not run (or
    runs elsewhere, where its alias is walked). False wherever it cannot tell: no
    source, no mention (a child may be called through a loop or getattr)."""
    src = _class_source(type(parent))
    if src is None or not name.isidentifier():
        return False
    tensors = {n for n, _ in child.named_parameters(recurse=False)} | {n for n, _ in child.named_buffers(recurse=False)}
    seen = False
    for m in re.finditer(rf"self\.{re.escape(name)}\b", src):
        seen = True
        line_start = src.rfind("\n", 0, m.start()) + 1
        before, after = src[line_start:m.start()], src[m.end():]
        attr = re.match(r"\.(\w+)", after)
        if attr:
            if attr.group(1) in tensors and not re.match(r"\s*=(?!=)", after[attr.end():]):
                continue   # reads a tensor of it
            return False   # a method or another attribute: may be its forward's
        nxt = after.lstrip(" ")[:1]
        if nxt in ("(", "["):
            return False   # called or indexed
        if re.match(r"\s*(=(?!=)|:[^=\n]*=)", after):
            continue   # self.name = ... (or an annotated assignment): built or replaced
        if re.fullmatch(r"\s*return\s+", before) or re.search(r"[^=!<>]=\s*$", before):
            continue   # handed back or aliased as a whole
        return False
    return seen
