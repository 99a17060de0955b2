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
  gelu(linear(x))          -> kitsune.bias_gelu(linear(x, W), bias)   (nn.Linear or F.linear with a bias;
                              tanh GELU: kitsune.linear_act(x, W, bias, "gelu_tanh"))
  gelu(x + bias)           -> kitsune.bias_gelu(x, bias)              (bias a 1-D parameter)
  silu(g) * u, u * silu(g) -> kitsune.swiglu(g, u)
  nn.RMSNorm / F.rms_norm  -> kitsune.rms_norm(x, weight, eps)        (with a weight and an eps)
  relu(layer_norm(x))      -> kitsune.layer_norm_relu(x, shape, weight, bias, eps)
  layer_norm(a + b)        -> kitsune.add_layer_norm(a, b, weight, bias, eps), the sum
                              kept for its other users (the residual stream); over the
                              last dim; at run time, operands of different shapes or
                              dtypes take the unfused path
  cross_entropy(linear(x)) -> kitsune.linear_cross_entropy(x, W, target, bias): the
                              logits never exist; also through .view/.reshape(-1, C),
                              with C spelled as logits.size(-1); weight=None and
                              reduction="mean" only
  cross_entropy(logits)    -> kitsune.cross_entropy (2-D logits at run time)
  relu(linear(x))          -> kitsune.linear_act(x, W, b, "relu") (a Linear with a bias)
  linear(x), any other     -> kitsune.linear_act(x, W, b, "none") (a Linear with a bias that no
                              pattern above took; optimize only, not the torch.compile
                              backend, where Inductor fuses the bias gradient's sum itself):
                              F.linear's forward, the bias gradient by Kitsune's column sum
  relu(BatchNorm(x))       -> kitsune.batch_norm_relu (nn.BatchNorm1d/2d/3d; the
                              module's mode, momentum and running stats read at run time)
  relu(BatchNorm(x) + r)   -> kitsune.batch_norm_add_relu (as above; r of x's shape and dtype at
                              run time, else the unfused ops; before relu(a + b) -> add_relu):
                              a ResNet block's end, the normalized values never stored
  BatchNorms' batch counts -> one torch._foreach_add_ of their num_batches_tracked, before
                              the first (two or more nn.BatchNorm1d/2d/3d, each called once,
                              with a momentum; optimize only): one launch where there was one
                              a module
  [relu](Conv2d(x))        -> kitsune.channel_bias(F.conv2d(x, W, None, ...), b, "relu" | "none")
                              (an nn.Conv2d with a bias and zeros padding; the ReLU when it
                              is the convolution's only user): the bias gradient's sum in
                              two stages instead of ATen's one
  max_pool2d(relu(Conv2d(x)))  -> kitsune.bias_relu_pool(F.conv2d(x, W, None, ...), b, k)
                              (the same, when the ReLU's only user is a max pooling over
                              non-overlapping k windows: stride k or None, no padding or
                              dilation, floor mode, no indices; F.max_pool2d,
                              torch.max_pool2d or nn.MaxPool2d)
  cat([channel_bias(y_i, b_i)], d) -> kitsune.bias_cat([y_i], [b_i], d) (each part a Conv2d's
                              bias, as above, used only by the torch.cat: an Inception block's
                              branches; one kernel over the channels of batched parts)
  max_pool2d(x), any other  -> kitsune.max_pool2d(x, k, stride, padding, ceil_mode) (dilation 1,
                              no indices; optimize only, not the torch.compile backend, where
                              Inductor fuses the pooling with its neighbours): a byte per
                              output saved for a gather backward, where ATen saves int64
                              indices
                              Where x has other users (none writing it in place):
                              kitsune.max_pool2d_branches(x, n, ...), whose views of x those
                              users take: their gradients are added in the pooling's backward
                              pass (an Inception block's input: 3 adds a block otherwise)
  nn.Embedding / F.embedding  -> kitsune.embedding(idx, W, padding_idx) (no max_norm,
                              scale_grad_by_freq or sparse; optimize only): on CUDA the weight
                              gradient by a radix sort over the vocabulary's bits and a block
                              per run of equal indices, where ATen sorts all 64 bits
  x.mean((2, 3)), adaptive_avg_pool2d(x, 1)  -> kitsune.global_avg_pool(x, dim, keepdim) (dim (2, 3)
                              or (-2, -1), no dtype; F.adaptive_avg_pool2d, nn.AdaptiveAvgPool2d
                              with output size 1; optimize only): on CUDA for channels-last
                              maps one kernel each way and no workspace, where ATen's strided
                              reduction stages partial sums in a buffer twice the map's size
  (q @ k^T) * s, (q @ k^T) / s   -> kitsune.attention_score(q, k, scale) (s a Python
                              number; k^T as k.transpose(-2, -1) or k.mT; one GEMM
                              with the scale as alpha; unfused for broadcast batches)
  r + dropout(linear(x))   -> kitsune.bias_dropout_add(F.linear(x, W), b, r, p, training)
                              (Linear with a bias; nn.Dropout's p and training read
                              at run time; unfused for other shapes, dtypes or autocast)
  dropout(gelu(x))         -> kitsune.gelu_dropout(x, p, training, approximate) (before
                              gelu(linear(x)) -> bias_gelu: the Linear keeps its bias in
                              the GEMM, and one pass does GELU and dropout)
While a CUDA graph is being captured (kitsune.compile_step), the dropout rewrites run
their unfused ATen form: its random numbers follow the graph's generator state, which
the fused kernels' host-side (seed, offset) cannot.
Spellings: modules (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.LayerNorm, in-place too), functions
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


def _layer_norm(gm, node):
    """(x, shape, weight, bias, eps) when node is nn.LayerNorm or F.layer_norm, else
    None. weight and bias are nodes or None (for a module: the names of its
    parameters, prefixed by "attr:")."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if isinstance(m, nn.LayerNorm):
        has = m.elementwise_affine
        return (node.args[0], tuple(m.normalized_shape), f"attr:{node.target}.weight" if has else None,
                f"attr:{node.target}.bias" if has and m.bias is not None else None, m.eps)
    if node.op == "call_function" and node.target is F.layer_norm:
        args = list(node.args) + [None] * 5
        kw = node.kwargs
        shape = kw.get("normalized_shape", args[1])
        eps = kw.get("eps", args[4] if args[4] is not None else 1e-5)
        shape = tuple(shape) if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape) else None
        return args[0], shape, kw.get("weight", args[2]), kw.get("bias", args[3]), eps
    return None


def _attr_or_node(g, v):
    return g.get_attr(v[5:]) if isinstance(v, str) and v.startswith("attr:") else v


def _add_layer_norm(a, b, weight, bias, eps):
    """add_layer_norm when the operands allow it (one shape after broadcasting, one
    dtype), else the unfused add and layer_norm: (a + b, layer_norm(a + b)). An operand
    that broadcasts to the other's shape (GPT's position table added to every
    sequence's token embeddings) is expanded, which the op copies once: that copy and
    the fused kernels cost less than ATen's add and LayerNorm each way, and autograd
    sums its gradient back to its shape as it would for the add."""
    from .. import ops as ko
    if a.shape != b.shape and a.dim() and b.dim():
        try:
            shape = torch.broadcast_shapes(a.shape, b.shape)
        except RuntimeError:
            shape = None
        if shape == a.shape:
            b = b.expand(shape)
        elif shape == b.shape:
            a = a.expand(shape)
    # under autocast the op's autocast kernel casts mixed dtypes itself
    cast = torch.is_autocast_enabled(a.device.type)
    same = a.shape == b.shape and a.dim() >= 1 and (cast or (a.dtype == b.dtype and all(
        p is None or p.dtype == a.dtype for p in (weight, bias))))
    if same and (a.device.type == "cpu" or a.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return ko.add_layer_norm(a, b, weight, bias, eps)
    h = a + b
    return h, F.layer_norm(h, (h.shape[-1],), weight, bias, eps)


def _view_shape(shape, args):
    """The shape .view(*args) gives a tensor of `shape`, or None where it cannot."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    total = 1
    for d in shape:
        total *= d
    known, free = 1, [i for i, d in enumerate(args) if d == -1]
    for d in args:
        if d != -1:
            known *= d
    if len(free) > 1 or known == 0 or (free and total % known) or (not free and known != total):
        return None
    return tuple(total // known if d == -1 else d for d in args)


def _logits_size(x, weight, *dim):
    """logits.size(*dim) for logits = linear(x, weight), without the logits."""
    shape = torch.Size(tuple(x.shape[:-1]) + (weight.shape[0],))
    return shape[dim[0]] if dim else shape


def _linear_cross_entropy(x, weight, bias, target, view, ignore_index, label_smoothing):
    """F.cross_entropy(linear(x).view(*view), target) through the chunked op when the
    view only flattens the leading dims (view None: no view), else unfused."""
    from .. import ops as ko
    logits_shape = tuple(x.shape[:-1]) + (weight.shape[0],)
    rows = x.numel() // max(x.shape[-1], 1)
    shape = logits_shape if view is None else _view_shape(logits_shape, view)
    ok = (shape is not None and len(shape) == 2 and shape[1] == weight.shape[0] and target.numel() == rows and
          target.dtype == torch.long and (torch.is_autocast_enabled(x.device.type) or (
              x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype))))
    if ok:
        return ko.linear_cross_entropy(x.reshape(rows, x.shape[-1]), weight, target.reshape(rows), bias,
                                       ignore_index, label_smoothing)
    logits = F.linear(x, weight, bias)
    logits = logits if view is None else logits.view(*view)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _ce_fits(logits, target):
    """Whether kitsune.cross_entropy takes these run-time operands."""
    return isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor) and logits.dim() == 2 and \
        target.dtype == torch.long and (logits.device.type == "cpu" or
                                        logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _cross_entropy(logits, target, ignore_index, label_smoothing):
    from .. import ops as ko
    if _ce_fits(logits, target):
        return ko.cross_entropy(logits, target, ignore_index, label_smoothing)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _bound(names, defaults, args, kwargs):
    """{argument: value} of a call with these positional names and defaults, or None when
    it passes more positional arguments than names or a keyword not among them."""
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    a = dict(defaults)
    a.update(zip(names, args))
    a.update(kwargs)
    return a


_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _ce_args(args, kwargs):
    """{argument: value} of a call F.cross_entropy(*args, **kwargs), or None (arguments it
    does not take)."""
    return _bound(_CE_ARGS, {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None,
                             "reduction": "mean", "label_smoothing": 0.0}, args, kwargs)


def _ce_call(node):
    """{argument: value} of an F.cross_entropy node, or None."""
    if not (isinstance(node, tfx.Node) and node.op == "call_function" and node.target is F.cross_entropy):
        return None
    return _ce_args(node.args, node.kwargs)


def _ce_unfusable(ce):
    """Why kitsune.cross_entropy cannot stand for the F.cross_entropy call ce (its
    _ce_args), whatever its operands, or None."""
    if ce["weight"] is not None or ce["reduction"] != "mean" or ce["size_average"] is not None or \
            ce["reduce"] is not None:
        return "cross_entropy with class weights or a reduction other than 'mean'"
    if not isinstance(ce["ignore_index"], int) or not isinstance(ce["label_smoothing"], (int, float)):
        return "cross_entropy with ignore_index or label_smoothing computed in the graph"
    return None


class FusedLoss(torch.overrides.TorchFunctionMode):
    """Inside it, F.cross_entropy runs as kitsune.cross_entropy wherever that op covers
    the call: 2-D logits (float32, float16 or bfloat16) and int64 targets on one of
    ``devices`` (default CUDA only: on the CPU kitsune.cross_entropy is a reference
    implementation, no faster), reduction "mean", no class weights; under autocast too
    (the loss float32 as F.cross_entropy's, bf16 logits read as they are rather than
    copied to float32), but not on float16 logits there: fp16 autocast comes with loss
    scaling, and a gradient formed in float16 before the scale would lose small values
    that F.cross_entropy's float32 gradient keeps. Other calls run as they are.
    compile_step runs its loss function in one (fuse_loss=True), since the loss is
    outside the model that kitsune.optimize rewrites.

    fused counts the calls taken; left lists why the others were not (one entry each)."""

    def __init__(self, devices=("cuda",)):
        super().__init__()
        self.devices = tuple(devices)
        self.fused, self.left = 0, []

    def _unfusable(self, ce):
        why = _ce_unfusable(ce)
        if why is not None:
            return why
        if not _ce_fits(ce["input"], ce["target"]):
            return "cross_entropy on other than 2-D float logits and int64 targets"
        dev = ce["input"].device.type
        if dev not in self.devices:
            return f"cross_entropy on {dev} (fused on {', '.join(self.devices)})"
        if ce["input"].dtype == torch.float16 and torch.is_autocast_enabled(dev):
            return ("cross_entropy on float16 logits under autocast (their gradient, formed in float16 before a "
                    "loss scale multiplies it, would lose the small values the scale is there to keep)")
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            ce = _ce_args(args, kwargs)
            why = self._unfusable(ce) if ce is not None else "cross_entropy with arguments it does not take"
            if why is None:
                from .. import ops as ko
                self.fused += 1
                return ko.cross_entropy(ce["input"], ce["target"], ce["ignore_index"], float(ce["label_smoothing"]))
            self.left.append(why)
        return func(*args, **kwargs)


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


def _is_size_of(node, of):
    return node.op == "call_method" and node.target == "size" and node.args[0] is of


def _rewrite_loss(gm, g, node, where, report):
    """cross_entropy(linear(x)[.view(...)], target) and cross_entropy(logits, target)."""
    ce = _ce_call(node)
    if ce is None:
        return
    why = _ce_unfusable(ce)
    if why is not None:
        report.left.append((where, why))
        return
    from .. import ops as ko   # noqa: F401 - loads the bridge
    inp, view = ce["input"], None
    if isinstance(inp, tfx.Node) and inp.op == "call_method" and inp.target in ("view", "reshape") and \
            len(inp.users) == 1:
        view, logits = tuple(inp.args[1:]), inp.args[0]
    else:
        logits = inp
    lin = _linear_of(gm, logits) if isinstance(logits, tfx.Node) else None
    others = [u for u in logits.users if u is not (inp if view is not None else node)] if lin else []
    if lin and all(_is_size_of(u, logits) for u in others):
        report.fused.append((where, f"cross_entropy(linear) -> linear_cross_entropy ({logits.name})"))
        x, w, b = lin
        with g.inserting_before(logits):
            w, b = _attr_or_node(g, w), _attr_or_node(g, b)
            for u in others:   # logits.size(d) from x and the weight's shapes
                new = g.call_function(_logits_size, (x, w) + tuple(u.args[1:]))
                u.replace_all_uses_with(new)
                g.erase_node(u)
        if view is not None:
            view = tuple(inp.args[1:])   # now with the size calls replaced
        with g.inserting_before(node):
            new = g.call_function(_linear_cross_entropy, (x, w, b, ce["target"], view, ce["ignore_index"],
                                                          float(ce["label_smoothing"])))
        node.replace_all_uses_with(new)
        g.erase_node(node)
        if view is not None:
            g.erase_node(inp)
        g.erase_node(logits)
        return
    if lin:
        report.left.append((where, f"cross_entropy(linear): the logits {logits.name} are also used elsewhere "
                                   "(fused as cross_entropy only)"))
    report.fused.append((where, "cross_entropy -> kitsune.cross_entropy"))
    _swap(g, node, _cross_entropy, (inp, ce["target"], ce["ignore_index"], float(ce["label_smoothing"])))


def _rewrite_add_layer_norm(gm, g, node, where, report):
    """layer_norm(a + b) with a + b kept for its other users."""
    ln = _layer_norm(gm, node)
    if ln is None:
        return False
    x, shape, w, b, eps = ln
    bin_ = _binary(x, "add")
    if not bin_:
        return False
    a, c, why = bin_
    if why:
        report.left.append((where, f"layer_norm(a + b): {why}"))
        return True
    if shape is None or len(shape) != 1:
        report.left.append((where, "layer_norm(a + b) over more than the last dimension"))
        return True
    order = {n: i for i, n in enumerate(g.nodes)}
    if any(isinstance(v, tfx.Node) and order[v] > order[x] for v in (w, b)):
        report.left.append((where, "layer_norm(a + b): its weight or bias is computed after the add"))
        return True
    report.fused.append((where, f"layer_norm(a + b) -> add_layer_norm ({x.name}; one shape and dtype checked at run time)"))
    with g.inserting_before(x):
        wn, bn = _attr_or_node(g, w), _attr_or_node(g, b)
        pair = g.call_function(_add_layer_norm, (a, c, wn, bn, float(eps)))
        h = g.call_function(operator.getitem, (pair, 0))
        y = g.call_function(operator.getitem, (pair, 1))
    node.replace_all_uses_with(y)
    g.erase_node(node)
    x.replace_all_uses_with(h)
    g.erase_node(x)
    return True


def _fused_bn_ok(x, bn):
    """Whether Kitsune's BatchNorm ops take x and bn's parameters (else nn.BatchNorm runs)."""
    params = [t for t in (bn.weight, bn.bias) if t is not None]
    return not (any(t.dtype != x.dtype for t in params) or torch.is_autocast_enabled(x.device.type) or
                (x.device.type == "cuda" and x.dtype not in (torch.float32, torch.float16, torch.bfloat16)))


def _batch_norm_relu(x, bn, count=True):
    """relu(bn(x)) for an nn.BatchNorm module, through batch_norm_relu when the dtypes
    allow it, deciding statistics and momentum exactly as nn.BatchNorm's forward does.
    count=False: the module's num_batches_tracked is counted by _count_batches instead."""
    from .. import ops as ko
    if not _fused_bn_ok(x, bn):
        return F.relu(bn(x) if count else _batch_norm(x, bn))
    return ko.batch_norm_relu(x, *_bn_state(x, bn, count))


def _batch_norm_add_relu(x, residual, bn, count=True):
    """relu(bn(x) + residual), as _batch_norm_relu, through batch_norm_add_relu where the
    residual has x's shape, dtype and device (else the unfused ops)."""
    from .. import ops as ko
    if not (_fused_bn_ok(x, bn) and isinstance(residual, torch.Tensor) and residual.shape == x.shape
            and residual.dtype == x.dtype and residual.device == x.device):
        return F.relu((bn(x) if count else _batch_norm(x, bn)) + residual)
    return ko.batch_norm_add_relu(x, residual, *_bn_state(x, bn, count))


def _bn_state(x, bn, count):
    """(running_mean, running_var, weight, bias, training, momentum, eps) for the fused
    ops, as nn.BatchNorm's forward decides them (counting the batch unless count=False)."""
    bn._check_input_dim(x)
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if count or bn.momentum is None:   # momentum set to None after optimize: counted here
            bn.num_batches_tracked.add_(1)
        momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    keep = not bn.training or bn.track_running_stats
    return (bn.running_mean if keep else None, bn.running_var if keep else None, bn.weight, bn.bias, use_batch,
            momentum, bn.eps)


def _batch_norm(x, bn):
    """nn.BatchNorm's forward without its num_batches_tracked add (_count_batches makes
    it), for a momentum that is not None; a momentum set to None after optimize reads
    the count, and nn.BatchNorm's forward makes it (_count_batches skips that module)."""
    if bn.momentum is None:
        return bn(x)
    return F.batch_norm(x, *_bn_state(x, bn, count=False))


def _count_batches(*bns):
    """The num_batches_tracked adds that nn.BatchNorm's forward makes one by one (one
    launch each on a GPU), as one foreach add, for the modules that count now."""
    counts = [bn.num_batches_tracked for bn in bns if bn.training and bn.track_running_stats
              and bn.num_batches_tracked is not None and bn.momentum is not None]
    if counts:
        torch._foreach_add_(counts, 1)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_SLOT = {_batch_norm_relu: 1, _batch_norm_add_relu: 2}   # the argument that is the module


def _rewrite_batch_counts(gm, g, prefix, report):
    """Every BatchNorm of the graph with a momentum (nn.BatchNorm's own forward, or
    through _batch_norm_relu / _batch_norm_add_relu) counts its batch in one
    _count_batches node before the first of them. A module called more than once, or whose momentum is None (its
    forward reads the count), keeps its own add."""
    calls = {}
    for n in g.nodes:
        if n.op == "call_module" and type(_module(gm, n)) in _BATCH_NORMS:
            calls.setdefault(n.target, []).append(n)
        elif n.op == "call_function" and n.target in _BN_SLOT and n.args[_BN_SLOT[n.target]].op == "get_attr":
            calls.setdefault(n.args[_BN_SLOT[n.target]].target, []).append(n)
    take = {t: ns[0] for t, ns in calls.items() if len(ns) == 1 and gm.get_submodule(t).momentum is not None}
    if len(take) < 2:
        return
    first = next(n for n in g.nodes if n in take.values())
    with g.inserting_before(first):
        counter = g.call_function(_count_batches, tuple(g.get_attr(t) for t in take))
    for t, n in take.items():
        if n.op == "call_module":
            with g.inserting_before(n):
                new = g.call_function(_batch_norm, (n.args[0], g.get_attr(t)))
            n.replace_all_uses_with(new)
            g.erase_node(n)
        else:
            n.args = n.args[:_BN_SLOT[n.target] + 1] + (False,)
    report.fused.append((f"{prefix}{counter.name}", f"BatchNorms' num_batches_tracked adds -> foreach_add "
                                                   f"({len(take)} modules)"))


def _dropout_of(gm, node):
    """(input, p, training source) when node is nn.Dropout (the source: the module, read
    at run time) or F.dropout (p and training as traced), else None."""
    m = _module(gm, node)
    if type(m) is nn.Dropout and not m.inplace:
        return node.args[0], m.p, ("module", node.target)
    if isinstance(node, tfx.Node) and node.op == "call_function" and node.target is F.dropout:
        args = list(node.args) + [None] * 4
        p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
        training = node.kwargs.get("training", args[2] if args[2] is not None else True)
        inplace = node.kwargs.get("inplace", args[3] if args[3] is not None else False)
        live = isinstance(training, tfx.Node) and training.op == "get_attr" and training.target == "training"
        if inplace or not isinstance(p, (int, float)) or not (isinstance(training, bool) or live):
            return None
        return args[0], float(p), ("value", training)
    return None


def _fused_dropout_ok(t):
    """Whether a fused dropout kernel may take t: CPU, or CUDA in a kernel dtype while
    no CUDA graph is being captured (the kernels take (seed, offset) on the host, so a
    replay would repeat the captured mask; ATen's dropout reads the graph's RNG state)."""
    if t.device.type == "cpu":
        return True
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16) and not torch.cuda.is_current_stream_capturing()


def _bias_dropout_add(x, weight, bias, residual, p, training):
    """residual + dropout(F.linear(x, weight, bias)) through bias_dropout_add when the
    operands allow it (one shape and dtype, no autocast), else unfused. `training` is
    a bool or the nn.Dropout module (its p and training are read now)."""
    from .. import ops as ko
    if isinstance(training, nn.Module):
        p, training = training.p, training.training
    y = F.linear(x, weight)
    if (y.shape == residual.shape and y.dtype == residual.dtype == bias.dtype and
            not torch.is_autocast_enabled(y.device.type) and _fused_dropout_ok(y)):
        return ko.bias_dropout_add(y, bias, residual, p, training)
    return residual + F.dropout(y + bias, p, training)


def _gelu_dropout(x, p, training, approximate):
    """F.dropout(F.gelu(x, approximate), p, training) through gelu_dropout (one pass, no
    mask stored) when x allows it, else unfused; `training` as in _bias_dropout_add."""
    from .. import ops as ko
    if isinstance(training, nn.Module):
        p, training = training.p, training.training
    if x.is_floating_point() and _fused_dropout_ok(x):
        return ko.gelu_dropout(x, p, training, approximate)
    return F.dropout(F.gelu(x, approximate=approximate), p, training)


def _rewrite_gelu_dropout(gm, g, node, where, report):
    """dropout(gelu(x)), any spelling of either."""
    drop = _dropout_of(gm, node)
    if drop is None or not isinstance(drop[0], tfx.Node):
        return False
    act = _act(gm, drop[0])
    if act is None or act[0] != "gelu":
        return False
    gelu_node, (_, x, approximate) = drop[0], act
    if len(gelu_node.users) != 1:
        report.left.append((where, f"dropout(gelu): {gelu_node.name} is also used elsewhere"))
        return True
    report.fused.append((where, f"dropout(gelu) -> gelu_dropout ({gelu_node.name})"))
    _, p, source = drop
    with g.inserting_before(node):
        train = g.get_attr(source[1]) if source[0] == "module" else source[1]
        new = g.call_function(_gelu_dropout, (x, p, train, approximate))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.erase_node(gelu_node)
    return True


def _feeds_dropout(gm, node):
    """Whether node's only user is a dropout the gelu_dropout rewrite takes."""
    users = list(node.users)
    return len(users) == 1 and _dropout_of(gm, users[0]) is not None


def _rewrite_bias_dropout_add(gm, g, node, where, report):
    """r + dropout(linear(x)) with a biased Linear."""
    bin_ = _binary(node, "add")
    if not bin_ or bin_[2] is not None:
        return False
    a, b, _ = bin_
    for d, r in ((b, a), (a, b)):
        drop = _dropout_of(gm, d) if isinstance(d, tfx.Node) else None
        if drop is None:
            continue
        lin_node, p, source = drop
        lin = _linear_of(gm, lin_node) if isinstance(lin_node, tfx.Node) else None
        if lin is None:
            return False
        if lin[2] is None:
            report.left.append((where, "r + dropout(linear(x)): the Linear has no bias to fuse"))
            return True
        if len(d.users) != 1 or len(lin_node.users) != 1:
            report.left.append((where, "r + dropout(linear(x)): an intermediate is also used elsewhere"))
            return True
        report.fused.append((where, f"r + dropout(linear) -> bias_dropout_add ({lin_node.name})"))
        x, w, bias = lin
        with g.inserting_before(node):
            w, bias = _attr_or_node(g, w), _attr_or_node(g, bias)
            train = g.get_attr(source[1]) if source[0] == "module" else source[1]
            new = g.call_function(_bias_dropout_add, (x, w, bias, r, p, train))
        node.replace_all_uses_with(new)
        g.erase_node(node)
        g.erase_node(d)
        g.erase_node(lin_node)
        return True
    return False


def _pair(v):
    return (v, v) if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, (tuple, list)) else None


def _max_pool_of(gm, node):
    """(input, kernel, stride, padding, ceil_mode), each size a pair, when node is a 2-D max
    pooling with dilation 1 that returns no indices (F.max_pool2d, torch.max_pool2d or
    nn.MaxPool2d), else None."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if type(m) is torch.nn.MaxPool2d:
        if len(node.args) != 1 or node.kwargs:
            return None
        a = {"input": node.args[0], "kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
             "dilation": m.dilation, "ceil_mode": m.ceil_mode, "return_indices": m.return_indices}
    elif node.op == "call_function" and node.target in (F.max_pool2d, torch.max_pool2d):
        a = _bound(("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
                   {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False},
                   node.args, node.kwargs)
        if a is None or "input" not in a or "kernel_size" not in a:
            return None
    else:
        return None
    k, stride, pad = _pair(a["kernel_size"]), a["stride"], _pair(a["padding"])
    stride = k if stride is None or stride == [] or stride == () else _pair(stride)
    sizes = (k, stride, pad)
    if any(v is None or len(v) != 2 or not all(isinstance(e, int) and not isinstance(e, bool) for e in v)
           for v in sizes):
        return None   # sizes computed in the graph
    if _pair(a["dilation"]) != (1, 1) or not isinstance(a["ceil_mode"], bool) or a["return_indices"] is not False:
        return None
    return a["input"], k, stride, pad, a["ceil_mode"]


_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
              operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
              operator.imatmul)


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


def _swap(g, node, fn, args):
    """Replaces node by fn(*args), a call_function node in its place."""
    with g.inserting_before(node):
        new = g.call_function(fn, args)
    node.replace_all_uses_with(new)
    g.erase_node(node)


def _rewrite_embedding(gm, g, node, where, report):
    """nn.Embedding / F.embedding -> kitsune.embedding (the weight gradient by its sort)."""
    from .. import ops as ko
    emb = _embedding_of(gm, node)
    if emb is None:
        return False
    idx, w, pad = emb
    report.fused.append((where, f"embedding -> kitsune.embedding ({node.name})"))
    with g.inserting_before(node):
        w = _attr_or_node(g, w)
    _swap(g, node, ko.embedding, (idx, w, pad))
    return True


def _mutates(gm, node, x):
    """Whether node may write x in place (a method or function named with a trailing
    underscore, an augmented assignment, inplace=True, a module with inplace set)."""
    first = node.args[0] if node.args else None
    if node.op == "call_method":
        return first is x and node.target.endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (first is x and (name.endswith("_") or node.target in _AUGMENTED)) or node.kwargs.get("inplace") is True
    m = _module(gm, node)
    return m is not None and first is x and getattr(m, "inplace", False) is True


def _rewrite_max_pool(gm, g, node, where, report):
    """A max pooling that no bias_relu_pool took -> kitsune.max_pool2d, or, where its
    input has other users (an Inception block's branches) none of which writes it in
    place, kitsune.max_pool2d_branches: those users take its views of x, so their
    gradients are added in the pooling's backward pass."""
    from .. import ops as ko
    pool = _max_pool_of(gm, node)
    if pool is None:
        return False
    x, k, stride, pad, ceil = pool
    others = [u for u in x.users if u is not node and u.op != "output"] if isinstance(x, tfx.Node) else []
    if others and not any(_mutates(gm, u, x) for u in x.users):
        report.fused.append((where, f"max_pool2d -> kitsune.max_pool2d_branches ({node.name}; the gradients of "
                                    f"{len(others)} other user(s) of {x.name} added in its backward)"))
        at = x
        if x.op == "placeholder":   # after the last placeholder
            at = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(at):
            branches = g.call_function(ko.max_pool2d_branches, (x, len(others), k, stride, pad, ceil))
        with g.inserting_after(branches):
            views = [g.call_function(operator.getitem, (branches, i)) for i in range(len(others) + 1)]
        for u, v in zip(others, views[1:]):
            u.replace_input_with(x, v)
        node.replace_all_uses_with(views[0])
        g.erase_node(node)
        return True
    report.fused.append((where, f"max_pool2d -> kitsune.max_pool2d ({node.name})"))
    _swap(g, node, ko.max_pool2d, (x, k, stride, pad, ceil))
    return True


_HW_DIMS = ({2, 3}, {-2, -1})


def _global_avg_pool_of(gm, node):
    """(input, dim, keepdim) when node takes the mean over the last two dims of an (N, C, H,
    W) map: x.mean(d, keepdim) / torch.mean(x, d, keepdim) with d (2, 3) or (-2, -1) in any
    order and no dtype, or F.adaptive_avg_pool2d(x, 1) / nn.AdaptiveAvgPool2d(1) (output
    size 1 or (1, 1)); else None."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if type(m) is nn.AdaptiveAvgPool2d:
        whole = len(node.args) == 1 and not node.kwargs and _pair(m.output_size) == (1, 1)
        return (node.args[0], [-2, -1], True) if whole else None
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        a = dict(zip(("input", "output_size"), node.args))
        a.update(node.kwargs)
        if set(a) != {"input", "output_size"} or _pair(a["output_size"]) != (1, 1):
            return None
        return a["input"], [-2, -1], True
    if not ((node.op == "call_method" and node.target == "mean") or
            (node.op == "call_function" and node.target is torch.mean)):
        return None
    a = dict(zip(("input", "dim", "keepdim"), node.args))
    a.update(node.kwargs)
    if not set(a) <= {"input", "dim", "keepdim"} or len(node.args) > 3 or "input" not in a:
        return None
    dim, keepdim = a.get("dim"), a.get("keepdim", False)
    if not isinstance(dim, (tuple, list)) or len(dim) != 2 or not all(type(d) is int for d in dim):
        return None
    if set(dim) not in _HW_DIMS or not isinstance(keepdim, bool):
        return None
    return a["input"], list(dim), keepdim


def _rewrite_global_avg_pool(gm, g, node, where, report):
    """The mean over H and W -> kitsune.global_avg_pool (ATen's mean wherever its kernels
    do not apply, so any rank and layout stays correct)."""
    from .. import ops as ko
    pool = _global_avg_pool_of(gm, node)
    if pool is None:
        return False
    x, dim, keepdim = pool
    report.fused.append((where, f"mean over H, W -> kitsune.global_avg_pool ({node.name})"))
    _swap(g, node, ko.global_avg_pool, (x, dim, keepdim))
    return True


# A Conv2d's output is (N, C, H, W), or (C, H, W) for an unbatched input, while
# channel_bias and bias_relu_pool read (N, C, ...): the rewrites call them through these
# helpers. On tensors they branch on the rank (a view costs microseconds of host time a
# call in eager mode); when torch.fx traces an optimized module again, y is a Proxy, whose
# rank is unknown: then a 4-D view, with no branch.
_ONE_BATCH = torch.Size([-1])
_ops = None


def _kitsune_ops():
    global _ops
    if _ops is None:
        from .. import ops
        _ops = ops
    return _ops


def _on_conv_output(op, y, *args):
    """op(y, *args) for an op that reads (N, C, H, W), on a Conv2d output y, batched or not."""
    if isinstance(y, tfx.Proxy):
        out = op(y.view(_ONE_BATCH + y.shape[-3:]), *args)
        return out.view(y.shape[:-3] + out.shape[-3:])
    return op(y, *args) if y.dim() != 3 else op(y.unsqueeze(0), *args).squeeze(0)


def _conv_bias(y, b, act):
    """kitsune.channel_bias over a Conv2d output's channels (dim -3)."""
    return _on_conv_output(_kitsune_ops().channel_bias, y, b, act)


def _conv_bias_relu_pool(y, b, k):
    """kitsune.bias_relu_pool over a Conv2d output's channels (dim -3)."""
    return _on_conv_output(_kitsune_ops().bias_relu_pool, y, b, k)


def _rewrite_conv_bias(gm, g, node, conv, where, report):
    """An nn.Conv2d with a bias (zeros padding), and the ReLU after it when that is its
    only user: F.conv2d without the bias, then kitsune.channel_bias; or
    kitsune.bias_relu_pool when that ReLU's only user is a non-overlapping max pooling."""
    if conv.bias is None:
        return
    if conv.padding_mode != "zeros":
        report.left.append((where, f"conv2d bias: padding_mode={conv.padding_mode!r} (only 'zeros' is split)"))
        return
    if len(node.args) != 1 or node.kwargs:
        return
    users = list(node.users)
    act = _act(gm, users[0]) if len(users) == 1 else None
    relu = users[0] if act is not None and act[0] == "relu" and act[1] is node else None
    pool_node = next(iter(relu.users)) if relu is not None and len(relu.users) == 1 else None
    pool = _max_pool_of(gm, pool_node)
    if pool is None or pool[0] is not relu or pool[2] != pool[1] or pool[3] != (0, 0) or pool[4]:
        pool_node = None   # bias_relu_pool takes non-overlapping windows, no padding, floor mode
    if pool_node is not None:
        what, last, dead = "max_pool2d(relu(conv2d)) bias -> bias_relu_pool", pool_node, (pool_node, relu, node)
    elif relu is not None:
        what, last, dead = "relu(conv2d) bias -> channel_bias", relu, (relu, node)
    else:
        what, last, dead = "conv2d bias -> channel_bias", node, (node,)
    report.fused.append((where, f"{what} ({node.name})"))
    with g.inserting_before(node):
        w, b = g.get_attr(f"{node.target}.weight"), g.get_attr(f"{node.target}.bias")
        y = g.call_function(F.conv2d, (node.args[0], w, None, conv.stride, conv.padding, conv.dilation, conv.groups))
        new = (g.call_function(_conv_bias_relu_pool, (y, b, pool[1])) if pool_node is not None else
               g.call_function(_conv_bias, (y, b, "none" if relu is None else "relu")))
    last.replace_all_uses_with(new)
    for n in dead:
        g.erase_node(n)


def _rewrite_bias_cat(g, node, where, report):
    """torch.cat(dim=d, an int) of Conv2d outputs' biases, _conv_bias(y, b, "none") (an
    Inception block's branches, after _rewrite_conv_bias) -> kitsune.bias_cat([y...], [b...],
    d): one kernel for batched parts concatenated over their channels, the unfused ops for
    any other dim or rank (an unbatched part's dim 1 is its height)."""
    from .. import ops as ko
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat, torch.concatenate):
        return False
    names = ("tensors", "dim")
    a = {"dim": 0}
    a.update(zip(names, node.args))
    a.update({("dim" if k == "axis" else k): v for k, v in node.kwargs.items()})
    parts = a.get("tensors")
    if not isinstance(parts, (list, tuple)) or not parts:
        return False
    if type(a["dim"]) is not int or not all(isinstance(p, tfx.Node) and p.op == "call_function"
                                                and p.target is _conv_bias and len(p.args) == 3 and not p.kwargs
                                                and p.args[2] == "none" for p in parts):
        return False
    if any(set(p.users) != {node} for p in parts):
        report.left.append((where, "cat(conv2d biases): a part is also used elsewhere"))
        return False
    report.fused.append((where, f"cat(conv2d biases) -> bias_cat ({node.name}, {len(parts)} parts)"))
    with g.inserting_before(node):
        new = g.call_function(ko.bias_cat, ([p.args[0] for p in parts], [p.args[1] for p in parts], a["dim"]))
    node.replace_all_uses_with(new)
    g.erase_node(node)
    for p in dict.fromkeys(parts):
        g.erase_node(p)
    return True


def _bn_feeding(gm, add, a, b):
    """(BatchNorm node, the other operand) when an operand of add (a first) is an
    nn.BatchNorm1d/2d/3d call read only by add, else None."""
    for h, r in ((a, b), (b, a)):
        if h.op == "call_module" and type(_module(gm, h)) in _BATCH_NORMS and len(h.users) == 1 and \
                next(iter(h.users)) is add and len(h.args) == 1 and not h.kwargs:
            return h, r
    return None


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


def _attention_score(q, k, scale):
    """(q @ k^T) * scale as one GEMM when q and k share their batch dims, else unfused."""
    from .. import ops as ko
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


def _rewrite_attention_score(g, node, where, report):
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


def _rewrite_linear_bias(gm, g, prefix, report):
    """Every Linear with a bias left after the other patterns -> linear_act(..., "none")."""
    from .. import ops as ko
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        lin = _linear_of(gm, node)
        if lin is None or lin[2] is None:
            continue
        report.fused.append((f"{prefix}{node.name}", "linear -> linear_act(none) (the bias gradient by column sum)"))
        with g.inserting_before(node):
            new = g.call_function(ko.linear_act, (lin[0], _attr_or_node(g, lin[1]), _attr_or_node(g, lin[2]),
                                                  "none"))
        node.replace_all_uses_with(new)
        g.erase_node(node)


def _rewrite(gm, report, prefix, linear_bias=True, optimize_only=True):
    from .. import ops as ko   # loads the bridge (the ops' CPU and CUDA kernels)
    g = gm.graph
    for node in list(g.nodes):
        if getattr(node, "_erased", False):   # removed by an earlier rewrite
            continue
        where = f"{prefix}{node.name}"
        conv = _module(gm, node)
        if type(conv) is nn.Conv2d:
            _rewrite_conv_bias(gm, g, node, conv, where, report)
            continue
        if optimize_only and _rewrite_max_pool(gm, g, node, where, report):
            continue
        if optimize_only and _rewrite_embedding(gm, g, node, where, report):
            continue
        if optimize_only and _rewrite_global_avg_pool(gm, g, node, where, report):
            continue
        if _rewrite_bias_cat(g, node, where, report):
            continue
        act = _act(gm, node)
        # ---- relu(a + b), tanh(a * b), gelu(x + bias), gelu(linear(x)) ----
        if act:
            kind, inner, approximate = act
            if kind == "gelu" and _feeds_dropout(gm, node):
                continue   # dropout(gelu(x)) -> gelu_dropout, at the dropout node
            lin = _linear_of(gm, inner) if kind == "relu" and isinstance(inner, tfx.Node) else None
            if lin is not None and lin[2] is not None:
                _fuse_pair(g, node, inner, where, report, "relu(linear)", "linear_act",
                           lambda: g.call_function(ko.linear_act, (lin[0], _attr_or_node(g, lin[1]),
                                                                   _attr_or_node(g, lin[2]), "relu")))
                continue
            bn = _module(gm, inner) if kind == "relu" and isinstance(inner, tfx.Node) else None
            if type(bn) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
                _fuse_pair(g, node, inner, where, report, "relu(batch_norm)", "batch_norm_relu",
                           lambda: g.call_function(_batch_norm_relu, (inner.args[0], g.get_attr(inner.target))))
                continue
            ln = _layer_norm(gm, inner) if kind == "relu" else None
            if ln is not None:
                x, shape, w, b, eps = ln
                if len(inner.users) != 1:
                    report.left.append((where, f"relu(layer_norm): {inner.name} is also used elsewhere"))
                elif shape is None:
                    report.left.append((where, "relu(layer_norm): normalized_shape computed in the graph"))
                else:
                    report.fused.append((where, f"relu(layer_norm) -> layer_norm_relu ({inner.name})"))
                    with g.inserting_before(node):
                        new = g.call_function(ko.layer_norm_relu, (x, list(shape), _attr_or_node(g, w),
                                                                   _attr_or_node(g, b), float(eps)))
                    node.replace_all_uses_with(new)
                    g.erase_node(node)
                    g.erase_node(inner)
                continue
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
                    with g.inserting_before(node):
                        new = _gelu_linear(g, ko, where, report, inner, inner.args[0],
                                           inner.kwargs.get("weight", args[1]), bias, approximate)
                    node.replace_all_uses_with(new)
                    g.erase_node(node)
                    g.erase_node(inner)
                    continue
                if isinstance(lin, nn.Linear):
                    if lin.bias is None:
                        report.left.append((where, "gelu(linear(x)): the Linear has no bias to fuse"))
                        continue
                    with g.inserting_before(node):
                        new = _gelu_linear(g, ko, where, report, inner, inner.args[0],
                                           g.get_attr(f"{inner.target}.weight"), g.get_attr(f"{inner.target}.bias"),
                                           approximate)
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
                elif kind == "relu" and (fed := _bn_feeding(gm, inner, a, b)) is not None:
                    h, r = fed
                    report.fused.append((where, f"relu(batch_norm(x) + r) -> batch_norm_add_relu ({h.name})"))
                    with g.inserting_before(node):
                        new = g.call_function(_batch_norm_add_relu, (h.args[0], r, g.get_attr(h.target)))
                    node.replace_all_uses_with(new)
                    g.erase_node(node)
                    g.erase_node(inner)
                    g.erase_node(h)
                    continue
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
            continue
        # ---- layer_norm(a + b), r + dropout(linear(x)), cross_entropy(linear(x)) ----
        if _rewrite_add_layer_norm(gm, g, node, where, report):
            continue
        if _rewrite_bias_dropout_add(gm, g, node, where, report):
            continue
        if _rewrite_gelu_dropout(gm, g, node, where, report):
            continue
        if _rewrite_attention_score(g, node, where, report):
            continue
        if _ce_call(node) is not None:
            _rewrite_loss(gm, g, node, where, report)
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
                with g.inserting_before(node):
                    w = g.get_attr(f"{node.target}.weight") if m is not None else weight
                    new = g.call_function(ko.rms_norm, (node.args[0], w, float(eps)))
                node.replace_all_uses_with(new)
                g.erase_node(node)
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


# ---- torch.compile(model, backend="kitsune") -------------------------------------
last_compile_report = None   # the Report of the last graph the backend compiled


def kitsune_backend(gm, example_inputs):
    """A torch.compile backend: rewrites the Dynamo graph with the patterns above,
    then hands it to Inductor, which traces the fused ops through their fake
    kernels and autograd (forward and backward) and compiles the rest as usual."""
    global last_compile_report
    from torch._inductor.compile_fx import compile_fx
    report = Report()
    # Inductor sums a bias gradient in its own kernels, and fuses a pooling with its neighbours
    _rewrite(gm, report, "", linear_bias=False, optimize_only=False)
    last_compile_report = report
    return compile_fx(gm, example_inputs)


def _register_backend():
    # list_backends() first imports every backend module of Dynamo's (Inductor's code cache,
    # networkx, ...): 0.14 s of optimize() and a step on the CPU machine, 1.3-1.5 s of
    # compile_step's setup on the H100 one (which compiles their bytecode each time). The
    # registry's own table answers without them.
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends import registry
    known = getattr(registry, "_COMPILER_FNS", None)
    if "kitsune" not in (known if known is not None else list_backends(exclude_tags=())):
        register_backend(name="kitsune")(kitsune_backend)


_register_backend()
