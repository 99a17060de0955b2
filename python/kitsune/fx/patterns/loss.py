"""The loss head: cross_entropy(linear(x)) -> linear_cross_entropy (the logits never
exist), cross_entropy(logits) -> kitsune.cross_entropy, and FusedLoss, the mode in which
F.cross_entropy calls run as kitsune.cross_entropy (compile_step's loss)."""
import torch
import torch.fx as tfx
import torch.nn.functional as F

from ..match import _attr_or_node, _bound, _linear_of, _swap


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


def _linear_cross_entropy(x, weight, bias, target, view, ignore_index, label_smoothing, upcast=False):
    """F.cross_entropy(linear(x)[.float()].view(*view), target) through the chunked op when
    the view only flattens the leading dims (view None: no view), else unfused. upcast:
    the logits went through .float() (Hugging Face's loss): the loss float32; taken
    when the logits would be bfloat16 or float32 (float16's gradient would be rounded
    before a loss scale reaches it, so that keeps the written path)."""
    dev = x.device.type
    logits_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if upcast and logits_dtype not in (torch.bfloat16, torch.float32):
        logits = F.linear(x, weight, bias).float()
        logits = logits if view is None else logits.view(*view)
        return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)
    from ... import ops as ko
    logits_shape = tuple(x.shape[:-1]) + (weight.shape[0],)
    rows = x.numel() // max(x.shape[-1], 1)
    shape = logits_shape if view is None else _view_shape(logits_shape, view)
    ok = (shape is not None and len(shape) == 2 and shape[1] == weight.shape[0] and target.numel() == rows and
          target.dtype == torch.long and (torch.is_autocast_enabled(x.device.type) or (
              x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype))))
    if ok:
        return ko.linear_cross_entropy(x.reshape(rows, x.shape[-1]), weight, target.reshape(rows), bias,
                                       ignore_index, label_smoothing, float_loss=upcast)
    logits = F.linear(x, weight, bias)
    logits = logits.float() if upcast else logits
    logits = logits if view is None else logits.view(*view)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _ce_fits(logits, target):
    """Whether kitsune.cross_entropy takes these run-time operands."""
    return isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor) and logits.dim() == 2 and \
        target.dtype == torch.long and (logits.device.type == "cpu" or
                                        logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _cross_entropy(logits, target, ignore_index, label_smoothing):
    from ... import ops as ko
    if _ce_fits(logits, target):
        return ko.cross_entropy(logits, target, ignore_index, label_smoothing)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _cross_entropy_upcast(logits, view, target, ignore_index, label_smoothing):
    """F.cross_entropy(logits.float()[.view(*view)], target): bf16 logits are read as
    they are (fp32 arithmetic, the loss float32, the gradient bf16 as the upcast's
    backward would give it), so the float32 copy and its float32 gradient never exist;
    other dtypes take the written path. float16 keeps it: its gradient would be
    rounded before a loss scale reaches it (FusedLoss says more)."""
    x = logits if view is None else logits.view(*view)
    if logits.dtype == torch.bfloat16 and _ce_fits(x, target):
        return torch.ops.kitsune.cross_entropy(x, target, ignore_index, label_smoothing, True)
    x = logits.float() if view is None else logits.float().view(*view)
    return _cross_entropy(x, target, ignore_index, label_smoothing)


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss (the labels shifted left by one, ignore_index rows
    left out; the mean, or with num_items_in_batch the sum over it), with
    kitsune.cross_entropy reading bf16 logits as they are (fp32 arithmetic, a float32
    loss) where the original makes a float32 copy of them (and then of their gradient).
    float16 logits take the original: their gradient would be rounded before a loss
    scale reaches it. kitsune.optimize sets it as a causal LM's loss_function, through
    transformers' own setter."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    if logits.dtype not in (torch.bfloat16, torch.float32) or not isinstance(ignore_index, int):
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    x = logits.reshape(-1, vocab_size)
    t = shift_labels.reshape(-1).to(x.device)
    loss = torch.ops.kitsune.cross_entropy(x, t, ignore_index, 0.0, True)   # the mean over labelled rows
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    n = (t != ignore_index).sum()
    total = torch.where(n > 0, loss * n, torch.zeros_like(loss))   # the sum; 0 when nothing is labelled
    return total / num_items_in_batch


def hf_loss_modules(model):
    """(name, module) for each module of model whose class has transformers'
    ``loss_function`` property with its setter (PreTrainedModel's)."""
    for name, m in model.named_modules():
        prop = getattr(type(m), "loss_function", None)
        if isinstance(prop, property) and prop.fset is not None:
            yield name, m


def _settle_causal_lm_losses(model, report, apply):
    """Each transformers causal LM in model whose loss_function is ForCausalLMLoss gets
    causal_lm_loss through the property's setter (apply; explain only reports it)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return
    for name, m in hf_loss_modules(model):
        # the models that compute it (transformers' names: ...ForCausalLM, GPT-2's ...LMHeadModel); a base
        # model's property gives the same function but nothing calls it
        if not type(m).__name__.endswith(("ForCausalLM", "LMHeadModel")):
            continue
        if m.loss_function is not ForCausalLMLoss:   # (GPT-2's property warns once here, as on its first step)
            continue
        report.swapped.append((name or type(m).__name__, "loss_function: ForCausalLMLoss -> kitsune causal_lm_loss "
                                                       "(bf16 logits read as they are, the loss float32)"))
        if apply:
            m.loss_function = causal_lm_loss


def _upcast_of(node):
    """x when node is x.float() or x.to(torch.float32), else None."""
    if not (isinstance(node, tfx.Node) and node.op == "call_method"):
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if node.target == "to" and not node.kwargs and len(node.args) == 2 and node.args[1] is torch.float32:
        return node.args[0]
    if node.target == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"} and \
            node.kwargs["dtype"] is torch.float32:
        return node.args[0]
    return None


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
                from ... import ops as ko
                self.fused += 1
                return ko.cross_entropy(ce["input"], ce["target"], ce["ignore_index"], float(ce["label_smoothing"]))
            self.left.append(why)
        return func(*args, **kwargs)


def _is_size_of(node, of):
    return node.op == "call_method" and node.target == "size" and node.args[0] is of


def _replace_loss(g, node, fn, args, dead):
    """node (the cross_entropy call) becomes fn(*args); dead: the nodes it consumed that
    nothing else reads now (the view, the logits, ...), erased in that order (None skipped)."""
    with g.inserting_before(node):
        new = g.call_function(fn, args)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    for d in dead:
        if d is not None:
            g.erase_node(d)


def _rewrite_loss(gm, g, node, where, report):
    """cross_entropy(linear(x)[.view(...)], target) and cross_entropy(logits, target); True
    for every F.cross_entropy node."""
    ce = _ce_call(node)
    if ce is None:
        return False
    why = _ce_unfusable(ce)
    if why is not None:
        report.left.append((where, why))
        return True
    from ... import ops as ko   # noqa: F401 - loads the bridge
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
        _replace_loss(g, node, _linear_cross_entropy, (x, w, b, ce["target"], view, ce["ignore_index"],
                                                       float(ce["label_smoothing"])),
                      (inp if view is not None else None, logits))
        return True
    if lin:
        report.left.append((where, f"cross_entropy(linear): the logits {logits.name} are also used elsewhere "
                                   "(fused as cross_entropy only)"))
    source = _upcast_of(logits)
    up_lin = _linear_of(gm, source) if source is not None and len(logits.users) == 1 else None
    if up_lin and len(source.users) == 1:   # HF's LM head and loss: linear(x).float().view(-1, V)
        report.fused.append((where, f"cross_entropy(linear(x).float()) -> linear_cross_entropy ({source.name}; "
                                    "the logits never exist, the loss float32)"))
        x, w, b = up_lin
        with g.inserting_before(source):
            w, b = _attr_or_node(g, w), _attr_or_node(g, b)
        _replace_loss(g, node, _linear_cross_entropy, (x, w, b, ce["target"], view, ce["ignore_index"],
                                                       float(ce["label_smoothing"]), True),
                      (inp if view is not None else None, logits, source))
        return True
    if source is not None and len(logits.users) == 1:   # HF's loss: logits.float().view(-1, V)
        report.fused.append((where, "cross_entropy(x.float()) -> kitsune.cross_entropy (bf16 read as it is, "
                                    "the loss float32)"))
        _replace_loss(g, node, _cross_entropy_upcast, (source, view, ce["target"], ce["ignore_index"],
                                                       float(ce["label_smoothing"])),
                      (inp if view is not None else None, logits))
        return True
    report.fused.append((where, "cross_entropy -> kitsune.cross_entropy"))
    _swap(g, node, _cross_entropy, (inp, ce["target"], ce["ignore_index"], float(ce["label_smoothing"])))
    return True
