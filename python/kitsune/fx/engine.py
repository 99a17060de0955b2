"""The rewrite engine: trace a module (a submodule that cannot be traced is left as it is
and its children are tried), rewrite its graph node by node through the pattern modules'
rewrites in the order of the tables below, then the passes over the whole graph; Report
says what was fused and left. optimize and explain are its two entry points."""
import copy
from dataclasses import dataclass, field

import torch.fx as tfx
import torch.nn.functional as F

from .match import _act
from .patterns.batch_norm import _rewrite_batch_counts, _rewrite_relu_batch_norm
from .patterns.conv import _rewrite_bias_cat, _rewrite_conv
from .patterns.dropout import _gelu_left_to_dropout, _rewrite_bias_dropout_add, _rewrite_gelu_dropout
from .patterns.embedding import _rewrite_embedding
from .patterns.linear import _rewrite_attention_score, _rewrite_linear_bias, _rewrite_relu_linear
from .patterns.loss import _rewrite_loss
from .patterns.norms import _rewrite_add_layer_norm, _rewrite_relu_layer_norm, _rewrite_rms_norm
from .patterns.pointwise import _rewrite_pointwise_act, _rewrite_swiglu
from .patterns.pool import _rewrite_global_avg_pool, _rewrite_max_pool


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
    (_rewrite_swiglu, False),
    (_rewrite_rms_norm, False),
)


def _rewrite(gm, report, prefix, linear_bias=True, optimize_only=True):
    """Rewrites gm's graph in place: each node through _NODE_REWRITES, then every Linear
    bias left (linear_bias) and the BatchNorms' batch counts (optimize_only)."""
    from .. import ops as ko  # noqa: F401 - loads the bridge (the ops' CPU and CUDA kernels)
    g = gm.graph
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


_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)


def _training_arg(node):
    if "training" in node.kwargs:
        return node.kwargs["training"]
    return node.args[2] if len(node.args) > 2 else True


def _dropouts(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DROPOUTS]


def _live_training_flags(module, gm):
    """torch.fx bakes `F.dropout(x, p, self.training)` into a constant (and fills in
    defaults, so `F.dropout(x, p)` reads the same). The module is traced again in the
    other mode: a dropout whose training argument changes with the mode follows
    self.training and becomes a run-time read of the GraphModule's `training`, so
    .train()/.eval() keep working after optimize; one that does not is a constant and
    stays. (If the second trace fails or differs in shape, nothing is changed. Dynamo
    graphs are guarded on the mode and are not touched.)"""
    import warnings
    nodes = _dropouts(gm)
    if not nodes:
        return
    modes = {m: m.training for m in module.modules()}
    try:
        module.train(not module.training)
        other = _dropouts(tfx.symbolic_trace(module))
    except Exception:   # noqa: BLE001 - the second trace is best effort
        return
    finally:
        for m, t in modes.items():
            m.training = t
    if len(other) != len(nodes):
        return
    g = gm.graph
    with warnings.catch_warnings():   # get_attr of a plain attribute: fine, the code reads self.training
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        for node, twin in zip(nodes, other):
            if _training_arg(node) == _training_arg(twin):
                continue   # the same in both modes: a constant
            with g.inserting_before(node):
                flag = g.get_attr("training")
            if "training" in node.kwargs or len(node.args) <= 2:
                node.kwargs = {**node.kwargs, "training": flag}
            else:
                node.args = node.args[:2] + (flag,) + node.args[3:]


def _walk(module, report, prefix, apply):
    """Returns the module to use in place of `module` (`module` itself when not
    apply). The rewrite always runs, on the traced copy: what explain reports is what
    optimize does, pattern for pattern."""
    try:
        gm = tfx.symbolic_trace(module)
        if apply:
            _live_training_flags(module, gm)
    except Exception as e:   # noqa: BLE001 - any tracing failure means: try the children
        report.untraced.append((prefix.rstrip(".") or type(module).__name__,
                                f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
        for name, child in list(module.named_children()):
            new = _walk(child, report, f"{prefix}{name}.", apply)
            if apply and new is not child:
                setattr(module, name, new)
        return module
    _rewrite(gm, report, prefix)
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
