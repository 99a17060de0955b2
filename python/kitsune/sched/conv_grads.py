"""kitsune.sched.conv_grads: a streamed module's bias-free convolutions, whose two
gradients may run apart inside a capture (_ConvGradsApart), and the weight gradients
that join at the end of the backward instead of in their node (KITSUNE_CONV_GRADS=late:
_LATE, _end_late). Which convolutions qualify is decided here too (_splits_conv_grads,
_conv_module); kitsune.sched.streams puts the calls into a streamed graph.
"""
import weakref

import torch
import torch.fx as tfx

from .. import options
from ..fx import _attr

# id -> _Streams (kitsune.sched.streams), for the stream ops and _ConvGradsApart (their
# arguments take ints); a context lives as long as a module holding it
_CONTEXTS = weakref.WeakValueDictionary()


class _ConvGradsApart(torch.autograd.Function):
    """F.conv2d (no bias) whose backward, inside a capture of a streamed module, runs the
    weight gradient on a stream of its own beside the input gradient on the node's
    stream, then joins: the node takes about max(dgrad, wgrad) instead of their sum (the
    branchy net's 3x3 and 5x5 convolutions at batch 8: input gradients 18 to 30 us,
    weight gradients 32 to 46 us, one after the other on one stream; H100,
    bench/results/archive/h100_timeline_gpt_inception8_18b9e89.log). Where the plan's streams
    already fill the GPU the two slow each other down (the branchy net's step at batch
    64: 1.947 ms apart, 1.907 together; ab_conv_grads_6d3534f.json), so the split is
    switched per module (_Streams.grads_apart), and compile_step measures which way
    its step runs faster (graph.CompiledStep._choose_conv_grads). The two read the same
    inputs and write separate outputs. Every gradient handed to autograd is joined
    into the node's stream, so autograd's stream bookkeeping (gradients ready on the
    node's stream) holds; with KITSUNE_CONV_GRADS=late a weight gradient autograd need
    not see (see backward) joins at the end of the backward instead. Memory: gy
    and x are freed after the join, into their own stream's blocks (a late join keeps
    them to the backward's end; with _Streams.late_lets_go, set by compile_step for the
    captures Kitsune's allocator records and lays out, it record_streams them on the
    side stream and lets go at the node, and the plan gives their bytes to blocks the
    graph orders after the side stream's read, or that wait for it); the weight gradient,
    allocated on the side stream, is held as the parameter's gradient for the rest of
    the capture; the cuDNN workspace the side stream takes is used by its own kernel
    only, and the side stream's next work comes after a wait on the node's stream.
    Elsewhere (no capture, CPU) ATen's backward as usual."""

    @staticmethod
    def forward(ctx, x, w, stride, padding, dilation, groups, cid, once=False):
        # the weight itself (a leaf: no cycle through the graph) to see, in the backward,
        # whether its gradient exists yet
        ctx.dtypes, ctx.once, ctx.weight = (x.dtype, w.dtype), once, w if w.is_leaf else None
        kind = x.device.type
        if torch.is_autocast_enabled(kind):   # cast as autocast casts F.conv2d's inputs: the backward then
            dt = torch.get_autocast_dtype(kind)   # computes in that dtype as autocast's conv backward does
            x, w = (t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (x, w))
        ctx.save_for_backward(x, w)
        ctx.conf, ctx.cid = (stride, padding, dilation, groups), cid
        return torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = lambda mask: torch.ops.aten.convolution_backward(gy, x, w, None, stride, padding, dilation, False,
                                                                 [0] * len(stride), groups, mask)
        c = _CONTEXTS.get(ctx.cid)
        here = torch.cuda.current_stream(gy.device) if gy.is_cuda else None
        side = c.grad_stream(here) if (need_x and need_w and c is not None and c.grads_apart and here is not None
                                       and torch.cuda.is_current_stream_capturing()) else None
        back = lambda g, dt: g.to(dt) if g is not None and g.dtype != dt else g   # autocast: the inputs' dtypes
        if side is None:
            gx, gw, _ = grads([need_x, need_w, False])
            return back(gx, ctx.dtypes[0]), back(gw, ctx.dtypes[1]), None, None, None, None, None, None
        side.wait_stream(here)
        with torch.cuda.stream(side):
            gw = back(grads([False, True, False])[1], ctx.dtypes[1])
        gx = back(grads([True, False, False])[0], ctx.dtypes[0])
        # late: the weight's gradient (its only use in the graph, no gradient to add it to, no
        # tensor hook) is not handed to autograd, whose AccumulateGrad would take it as
        # ready on this stream (and copy it there when it cannot steal it): _end_late
        # sets it once the side stream is joined, so the branch goes on without it
        wt = ctx.weight
        # what a late join holds to the backward's end that a join here lets go: the input
        # and the output gradient (the weight is a parameter, its gradient kept either way)
        kept = x.nbytes + gy.nbytes
        if (c.grads_late and ctx.once and wt is not None and wt.grad is None and _late_ok(wt)
                and (c.late_limit is None or kept <= c.late_limit)):
            if c.late_lets_go:
                for t in (x, gy):
                    t.record_stream(side)
            c.join_late(here, side, wt, gw, (w,) if c.late_lets_go else (x, w, gy), kept)
            gw = None
        else:
            here.wait_stream(side)
        return gx, gw, None, None, None, None, None, None


# Weight gradients whose join waits for the end of the backward: (graph task, node
# stream, side stream, weight, gradient, tensors kept), all of one backward. Filled by
# _ConvGradsApart.backward through _Streams.join_late, emptied by _end_late.
_LATE = []


def _join_late_streams(entries):
    """Each entry's side stream joined into its node's stream, and that into the current
    stream of its device: later work, and the allocator's frees of the kept tensors
    (on the streams they were made on), come after the side stream's last use."""
    cur = {}
    for _, here, side, *_ in entries:
        here.wait_stream(side)
        c = cur.setdefault(here.device.index, torch.cuda.current_stream(here.device))
        if c.cuda_stream != here.cuda_stream:
            c.wait_stream(here)


def _take_late():
    """The pending entries, taken from _LATE with their streams joined (a failed
    backward's are then dropped: their gradients never assigned)."""
    entries = _LATE[:]
    _LATE.clear()
    _join_late_streams(entries)
    return entries


def _late_ok(weight):
    """Whether a weight's gradient may be set after the backward: no tensor hook (autograd
    would run it on the gradient), and no post-accumulate-grad hook but
    KitsuneOptimizer's in-backward one (autograd runs those when the node's gradient
    arrives, here None; the in-backward update leaves such a parameter to its finish)."""
    if weight._backward_hooks:
        return False
    hooks = (weight._post_accumulate_grad_hooks or {}).values()
    return all(getattr(getattr(h, "__self__", None), "kitsune_in_backward", False) for h in hooks)


def _end_late():
    """The backward's final callback (on the streams backward() was called on, which the
    engine has joined with the leaf streams): the late weight gradients are joined, then
    each becomes its weight's .grad. The entries go after."""
    for _, _, _, weight, grad, _ in _take_late():
        if weight.grad is None:
            weight.grad = grad
        else:   # not expected (no other use of the weight), but never lost
            weight.grad.add_(grad)


def conv_grads_mode():
    """``KITSUNE_CONV_GRADS``: how a streamed module's bias-free convolutions run their two
    gradients inside a capture. "auto" (unset): kitsune.compile_step times its step's
    forward and backward each way below and keeps the fastest (stats()["conv_grads"]; a
    streamed module captured by other code splits them); "apart": split, joined in the
    node; "together": ATen's backward, both on the node's stream (the module then has
    no _conv_grads_apart node); "late": split, and the gradient of a weight used once in
    the graph, which has no gradient yet, joins at the end of the backward (_end_late),
    which keeps the convolution's input and output gradient until then. The pending
    joins are one process-wide list, of one backward at a time: compile_step captures
    one step at a time (kitsune.graph.capture._CAPTURE_LOCK); two threads capturing
    backwards of streamed modules by other code at once are not supported (the second
    would drop the first's pending gradients as a failed backward's). Read through
    kitsune.options: a value not among these raises ValueError naming the variable."""
    return options.get("KITSUNE_CONV_GRADS")


def conv_grad_splits(module):
    """How many of ``module``'s convolutions can run their gradients apart
    (_conv_grads_apart nodes of a streamed module; 0 for any other module)."""
    graph = getattr(module, "graph", None) if hasattr(module, "_kitsune_streams") else None
    return 0 if graph is None else sum(1 for n in graph.nodes if n.target is _conv_grads_apart)


def _conv_grads_apart(x, w, bias, stride, padding, dilation, groups, cid, once=False):
    """The call a streamed graph makes for F.conv2d(x, w, None, ...) (see _ConvGradsApart);
    once: w is used by this call only in the graph."""
    return _ConvGradsApart.apply(x, w, stride, padding, dilation, groups, cid, once)


def _used_once(gm, nodes, w):
    """Whether the weight node w of an F.conv2d has one user in the graph and, when it is
    a parameter (get_attr), the graph reaches that parameter nowhere else."""
    if not isinstance(w, tfx.Node) or len(w.users) != 1:
        return False
    return w.op != "get_attr" or _reaches(gm, nodes, _attr(gm, w.target)) == 1


def _reaches(gm, nodes, t):
    """How many times the graph reaches tensor t: a get_attr of t or of a module that
    holds it, a call of a module that holds it (by identity: tied weights count under
    each of their names)."""
    k = 0
    for o in nodes:
        if o.op in ("get_attr", "call_module"):
            a = _attr(gm, o.target)
            k += a is t or (isinstance(a, torch.nn.Module) and any(q is t for q in a.parameters()))
    return k


def _int_pairs(*vs):
    return all(isinstance(v, tuple) and len(v) == 2 and all(isinstance(i, int) for i in v) for v in vs)


def _splits_conv_grads(n):
    """An F.conv2d node without a bias whose stride, padding and dilation are int pairs
    (not padding="same"), as kitsune.optimize leaves a Conv2d with its bias split off."""
    if n.op != "call_function" or n.target is not torch.nn.functional.conv2d or len(n.args) != 7:
        return False
    bias, stride, padding, dilation = n.args[2:6]
    return bias is None and _int_pairs(stride, padding, dilation) and isinstance(n.args[6], int) and not n.kwargs


def _conv_module(gm, n):
    """The nn.Conv2d a call_module node calls with one input, when it is one
    _conv_grads_apart can stand for: no bias, zero padding given as ints (a bias-free
    Conv2d, as torchvision's ResNets have, which kitsune.optimize leaves as it is)."""
    if n.op != "call_module" or len(n.args) != 1 or n.kwargs:
        return None
    m = gm.get_submodule(n.target)
    ok = (type(m) is torch.nn.Conv2d and m.bias is None and m.padding_mode == "zeros"
          and _int_pairs(m.stride, m.padding, m.dilation) and isinstance(m.groups, int))
    return m if ok else None
