"""The rewrite engine: trace a module (one that cannot be traced, or whose traced graph may
not stand for its forward, is left as it is and its children are tried: trace.py), rewrite
its graph node by node through the pattern modules' rewrites in the order of the tables
below, then the passes over the whole graph, and where something fused make the module
run that graph (adopt.py); Report says what was fused and left. optimize and explain are
its two entry points."""
import copy
from dataclasses import dataclass, field

from .adopt import Rewritten, adopt, clash
from .match import _act
from .patterns.batch_norm import _keep_functional_batch_norms, _rewrite_batch_counts, _rewrite_relu_batch_norm
from .patterns.conv import _rewrite_bias_cat, _rewrite_conv
from .patterns.dropout import _gelu_left_to_dropout, _rewrite_bias_dropout_add, _rewrite_gelu_dropout
from .patterns.embedding import _rewrite_embedding
from .patterns.linear import (_rewrite_attention_score, _rewrite_conv1d, _rewrite_linear_bias, _rewrite_relu_linear,
                              _settle_wide_linears)
from .patterns.loss import _rewrite_loss, _settle_causal_lm_losses
from .patterns.norms import _rewrite_add_layer_norm, _rewrite_hf_rms_norm, _rewrite_relu_layer_norm, _rewrite_rms_norm
from .patterns.pointwise import _rewrite_pointwise_act, _rewrite_swiglu, _rewrite_tanh_gelu
from .patterns.pool import _rewrite_global_avg_pool, _rewrite_max_pool
from .trace import frozen_optional, hooked_inside, not_called_by, other_mode, trace


@dataclass
class Report:
    """What optimize did (or explain would do): ``fused`` and ``left`` are lists of
    (where, what) pairs; ``untraced`` names the modules not rewritten as a whole, with why
    (torch.fx could not trace them, or their graph may not stand for their forward: see
    trace.py), whose children were tried instead; ``rewritten`` the paths of the modules
    optimize makes run a rewritten graph ("" the model itself). A fusion's ``where`` is
    the path of its module, then the node's name; it runs each time that module is
    called. ``swapped``: (where, what) for what optimize sets on a module without
    rewriting it (a Hugging Face causal LM's loss_function), used when that runs."""
    fused: list = field(default_factory=list)
    left: list = field(default_factory=list)
    untraced: list = field(default_factory=list)
    rewritten: list = field(default_factory=list)
    # explain(..., dynamo=True): Dynamo's graph breaks, (why, where in the user's code)
    breaks: list = field(default_factory=list)
    swapped: list = field(default_factory=list)
    # the weights of wide Linears a graph rewrite gave to wide_linear (their modules are not swapped)
    _wide_weights: set = field(default_factory=set, repr=False, compare=False)

    def __str__(self):
        lines = [f"kitsune: {len(self.fused)} fused, {len(self.left)} left"]
        if self.breaks:
            lines[0] += f", {len(self.breaks)} graph break(s)"
        lines += [f"  fused  {w}: {what}" for w, what in self.fused]
        lines += [f"  swapped {w}: {what}" for w, what in self.swapped]
        lines += [f"  left   {w}: {why}" for w, why in self.left]
        lines += [f"  not rewritten whole {w}: {why}" for w, why in self.untraced]
        lines += [f"  graph break at {w}: {why}" for why, w in self.breaks]
        return "\n".join(lines)


# An activation node (relu, tanh, gelu, silu) with its input: the first of these that takes it wins.
_ACT_REWRITES = (_gelu_left_to_dropout, _rewrite_relu_linear, _rewrite_relu_batch_norm, _rewrite_relu_layer_norm,
                 _rewrite_pointwise_act)


def _rewrite_activation(gm, g, node, where, report):
    """relu(a + b), tanh(a * b), gelu(x + bias), gelu(linear(x)), relu(linear / batch_norm /
    layer_norm): an activation node goes through _ACT_REWRITES; True for every activation
    (no other rewrite takes one)."""
    act = _act(gm, node)
    if not act:
        return False
    for rw in _ACT_REWRITES:
        if rw(gm, g, node, act, where, report):
            break
    return True


# Each node goes through these in order, the first that takes it wins; (rewrite, optimize
# only: not in the torch.compile backend, where Inductor fuses these ops with their
# neighbours itself).
_NODE_REWRITES = (
    (_rewrite_conv1d, True),   # HF's Conv1D as F.linear, before anything reads it
    (_rewrite_conv, False),
    (_rewrite_max_pool, True),
    (_rewrite_embedding, True),
    (_rewrite_global_avg_pool, True),
    (_rewrite_bias_cat, False),
    (_rewrite_activation, False),
    (_rewrite_add_layer_norm, False),
    (_rewrite_bias_dropout_add, False),
    (_rewrite_gelu_dropout, False),
    (_rewrite_attention_score, False),
    (_rewrite_loss, False),
    (_rewrite_hf_rms_norm, True),   # these two before swiglu, which takes every product
    (_rewrite_tanh_gelu, True),
    (_rewrite_swiglu, False),
    (_rewrite_rms_norm, False),
)


def _rewrite(gm, report, prefix, linear_bias=True, optimize_only=True):
    """Rewrites gm's graph in place: each node through _NODE_REWRITES, then every Linear
    bias left (linear_bias) and the BatchNorms' batch counts (optimize_only)."""
    from .. import ops as ko  # noqa: F401 - loads the bridge (the ops' CPU and CUDA kernels)
    g = gm.graph
    if not optimize_only:   # the Inductor backend's graph
        _keep_functional_batch_norms(g)
    for node in list(g.nodes):
        if getattr(node, "_erased", False):   # removed by an earlier rewrite
            continue
        where = f"{prefix}{node.name}"
        for rw, only_optimize in _NODE_REWRITES:
            if (optimize_only or not only_optimize) and rw(gm, g, node, where, report):
                break
    if linear_bias:
        _rewrite_linear_bias(gm, g, prefix, report)
    if optimize_only:
        _rewrite_batch_counts(gm, g, prefix, report)
    g.lint()
    gm.recompile()


def _walk(module, report, prefix, apply, children=True, seen=None):
    """Rewrites module where that is safe (see trace.py): traced, checked, rewritten on the
    traced copy, and where some pattern fused (and apply) `module` is made to run the
    rewritten graph (adopt.py: the same object, its class swapped). A module that does not
    trace or whose graph may not stand for it is left as it is and its children are tried
    (children=True). What explain reports is what optimize does, pattern for pattern.
    A module met twice (shared) is rewritten once."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return module
    seen.add(id(module))
    where = prefix.rstrip(".") or type(module).__name__
    if isinstance(module, Rewritten):   # its graph inlines its children: none is called on its own
        report.untraced.append((where, "rewritten already (by an earlier optimize): left as it is"))
        return module
    gm, constants, why = None, {}, None
    try:
        gm, constants = trace(module)
    except Exception as e:   # noqa: BLE001 - any tracing failure means: try the children
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    if why is None:
        why = _why_not(module, gm)
    if why is not None:
        report.untraced.append((where, why))
        if children:
            for child_name, child in list(module.named_children()):
                if not_called_by(module, child_name, child):
                    report.left.append((f"{prefix}{child_name}", f"not rewritten: {type(module).__name__} never calls "
                                                                 "it (its code only builds, aliases or reads it)"))
                    continue
                _walk(child, report, f"{prefix}{child_name}.", apply, True, seen)
        return module
    fused = len(report.fused)
    _rewrite(gm, report, prefix)
    if len(report.fused) > fused:
        report.rewritten.append(prefix.rstrip("."))
        if apply:
            adopt(module, gm, constants)
    return module


def _why_not(module, gm):
    """Why the traced gm may not stand for module's forward, or None (the checks of trace.py;
    other_mode also makes gm's dropouts follow the module's mode)."""
    hooked = hooked_inside(module)
    if hooked is not None:
        return f"its submodule {hooked} has hooks, which a rewritten forward would skip"
    name = clash(module)
    if name is not None:
        return f"it has its own {name!r}, which the rewritten module's (a GraphModule's) would hide"
    return other_mode(module, gm) or frozen_optional(module, gm)


def optimize(model, inplace=False, report=None):
    """Returns ``model`` with every matched pattern replaced by Kitsune's fused ops: each
    module rewritten (the model itself where it traces, else the submodules that do)
    stays the same object with the same attributes, parameters, buffers and children in
    the same order, its class swapped for a subclass of its own and of
    torch.fx.GraphModule whose forward is the rewritten graph (adopt.py); a module where
    nothing fused is not touched. ``inplace=False`` (the default) deep-copies ``model``
    first. Pass a :class:`Report` to get what was fused and left."""
    report = report if report is not None else Report()
    m = model if inplace else copy.deepcopy(model)
    _settle_causal_lm_losses(m, report, apply=True)
    m = _walk(m, report, "", apply=True)
    _settle_wide_linears(m, report, apply=True)
    return m


def _break_reason(text):
    """Dynamo's reason for a graph break in one line: its heading and its explanation."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    why = lines[0] if lines else "?"
    more = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.startswith("Explanation:")), None)
    return f"{why}: {more}" if more else why


def explain(model, *args, dynamo=False, **kwargs):
    """A :class:`Report` of what :func:`optimize` would fuse and leave, with reasons;
    the model is not changed. ``dynamo=True``: what Kitsune's Dynamo path
    (torch.compile(backend="kitsune", options={"inductor": False})) does on the example
    inputs ``args`` / ``kwargs``: the model runs once under torch._dynamo.explain (its
    buffers and the random generators put back after), each graph Dynamo makes is
    rewritten on a copy (a fusion's ``where`` is "graph<i>.<node>"), and ``breaks`` lists
    each graph break with its reason and where in the user's code."""
    report = Report()
    if not dynamo:
        if args or kwargs:
            raise TypeError("kitsune.explain: example inputs are for dynamo=True; explain(model) traces the "
                            "model's code and runs nothing")
        _settle_causal_lm_losses(model, report, apply=False)
        _walk(model, report, "", apply=False)
        _settle_wide_linears(model, report, apply=False)
        return report
    import torch
    from ..sched import saved_state
    restore = saved_state(model)
    try:
        from .backend import settle_hf_loss_functions
        unsettle = settle_hf_loss_functions(model)
        try:
            out = torch._dynamo.explain(model)(*args, **kwargs)
        finally:
            unsettle()
    finally:
        restore()
        torch._dynamo.reset()
    for i, g in enumerate(out.graphs):
        _rewrite(copy.deepcopy(g), report, f"graph{i}.", linear_bias=True, optimize_only=True)
    for b in out.break_reasons:
        frames = getattr(b, "user_stack", None) or []
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        report.breaks.append((_break_reason(str(b.reason)), where))
    return report
