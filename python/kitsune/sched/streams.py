"""kitsune.sched.streams: a plan executed. streamed() rewrites a model's graph with the
stream ops (torch.ops.kitsune.stream_fork, stream_switch, stream_record, stream_join,
whose Python implementations are here) and the calls of kitsune.sched.conv_grads;
_Streams holds one streamed module's streams and events.
"""
import torch
import torch.fx as tfx

from .. import _native, options
from .conv_grads import (_CONTEXTS, _LATE, _conv_grads_apart, _conv_module, _end_late, _reaches,
                         _splits_conv_grads, _take_late, _used_once, conv_grads_mode)
from .costs import _traced
from .planner import _plan


class _Streams:
    """The streams and events of one streamed module: plan stream 0 is whatever stream is
    current when the module is called (the capturing stream in a capture), the others
    come from a per-device set made on first use."""

    def __init__(self, n_streams, n_events, eager):
        self.n_streams, self.n_events, self.eager = n_streams, n_events, eager
        self.per_device = {}
        self.grads = {}   # device index -> _ConvGradsApart's streams, one per plan stream
        self.grads_apart = True   # _ConvGradsApart splits (compile_step may measure and turn it off)
        self.grads_late = conv_grads_mode() == "late"   # ... and joins at the end of the backward where it can
        # for compile_step's memory budget: a weight gradient joins late only when the
        # tensors it reads past its node (kept to the backward's end, or let go with
        # late_lets_go below) take at most late_limit bytes (None: no
        # limit); late_kept, those bytes of each late join since compile_step last emptied
        # it (one capture's)
        self.late_limit = None
        self.late_kept = []
        # a late join lets go of what its side stream reads at the node, record_stream'd
        # there, instead of keeping it to the backward's end: set by compile_step where
        # Kitsune's allocator records or lays out the capture (its plan frees the bytes
        # for blocks ordered after the side stream's read, or waited for); a pool alone
        # holds such a block to the capture's end
        self.late_lets_go = False
        self.main = None
        self.active = False
        self.used = set()

    def __deepcopy__(self, memo):
        """Copies of a streamed module share its streams and events (the ids in their
        code name this context); calls on one thread run one after another."""
        return self

    def prepare(self, device):
        """Makes this device's streams and the events of the plan's syncs (each recorded
        once, so their CUDA events exist before a capture begins)."""
        if device.index in self.per_device:
            return
        with torch.cuda.device(device):
            sides = [torch.cuda.Stream(priority=branch_priority()) for _ in range(self.n_streams - 1)]
            events = [torch.cuda.Event() for _ in range(self.n_events + 1)]
            here = torch.cuda.current_stream()
            for e in events:
                e.record(here)
            self.grads[device.index] = [torch.cuda.Stream() for _ in range(self.n_streams)]   # _ConvGradsApart's
        self.per_device[device.index] = (sides, events)

    def begin(self, device):
        """At the module's entry: whether this call runs on several streams."""
        self.active = device.type == "cuda" and (self.eager or torch.cuda.is_current_stream_capturing())
        if not self.active:
            return
        self.prepare(device)
        self.sides, self.events = self.per_device[device.index]
        self.main = torch.cuda.current_stream(device)
        self.events[-1].record(self.main)   # the fork: side streams start after the inputs
        self.used = set()
        self.current = 0

    def stream(self, k):
        return self.main if k == 0 else self.sides[k - 1]

    def join_late(self, here, side, weight, grad, keep, kept):
        """Defers the join of `side` (where `grad`, the gradient of the leaf `weight`, is
        being computed beside `here`) to the end of the backward: _end_late joins the
        streams and sets weight.grad. `keep` (what
        the side stream reads) stays referenced until then. Entries are per backward
        (torch._C._current_graph_task_id); a backward that failed before its end leaves
        its entries, which the next one drops with their streams joined, unassigned.
        `kept`: the bytes of `keep` this holds beyond the node (late_kept), or, with
        late_lets_go, would hold had they not been let go."""
        task = torch._C._current_graph_task_id()
        if _LATE and _LATE[0][0] != task:   # left by a backward that failed before its end
            _take_late()
        if not _LATE:
            torch.autograd.Variable._execution_engine.queue_callback(_end_late)
        _LATE.append((task, here, side, weight, grad, keep))
        self.late_kept.append(kept)

    def grad_stream(self, here):
        """The stream a convolution's weight gradient runs on beside its input gradient
        on `here` (_ConvGradsApart): one for each of the plan's streams, so that the
        branches' gradients stay as parallel as their forwards (made by prepare, before
        a capture; used by nothing else). None when `here` is none of the plan's streams."""
        if self.main is None or here.device.index not in self.per_device:
            return None
        sides, _ = self.per_device[here.device.index]
        for k, s in enumerate([self.main] + sides):
            if s.cuda_stream == here.cuda_stream:
                return self.grads[here.device.index][k]
        return None


# the stream ops' kernels, in Python: they switch torch's current stream (their schemas,
# in csrc/library.cpp with every other op's, take a context's id: _CONTEXTS)
_LIB = None


def _register_ops():
    global _LIB
    if _LIB is not None:
        return
    _native.bridge()   # defines the schemas
    _LIB = torch.library.Library("kitsune", "IMPL")

    def fork(x, ctx):
        _CONTEXTS[ctx].begin(x.device)

    def switch(cross, ctx, stream, waits):
        c = _CONTEXTS[ctx]
        if not c.active:
            return
        s = c.stream(stream)
        if stream != 0 and stream not in c.used:
            s.wait_event(c.events[-1])
            c.used.add(stream)
        for e in waits:
            s.wait_event(c.events[e])
        for t in cross:   # made on another stream: not reused before this stream's work on it
            t.record_stream(s)
        torch.cuda.set_stream(s)
        c.current = stream

    def record(ctx, event):
        c = _CONTEXTS[ctx]
        if c.active:
            c.events[event].record(c.stream(c.current))

    def join(ctx):
        c = _CONTEXTS[ctx]
        if not c.active:
            return
        for k in sorted(c.used):   # every side stream rejoins the caller's (a capture requires it)
            c.main.wait_stream(c.stream(k))
        torch.cuda.set_stream(c.main)
        c.active = False

    for name, fn in (("stream_fork", fork), ("stream_switch", switch), ("stream_record", record),
                     ("stream_join", join)):
        _LIB.impl(name, fn, "CompositeExplicitAutograd")


def branch_priority():
    """The priority of compile_step's capture stream and of a streamed module's branch
    streams: the device's greatest, so that where their kernels and the weight-gradient
    streams' (_ConvGradsApart's, CUDA's default 0, the least) contend for SMs the block
    scheduler starts theirs first (a captured kernel keeps its stream's priority:
    PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority). 0 with
    KITSUNE_STREAM_PRIORITY=0."""
    if not options.get("KITSUNE_STREAM_PRIORITY"):
        return 0
    return torch.cuda.Stream.priority_range()[1]


def streamed(model, *example_inputs, streams=4, roofline=None, min_gain=1.05, eager=False, costs=None,
             shapes_recorded=False):
    """``(module, plan)``: ``model``'s forward with the plan's streams applied (see the
    kitsune.sched's docstring), or ``model`` itself when the plan keeps one stream. ``eager=True``
    also runs the streams outside a capture (for tests); ``costs`` as for plan;
    ``shapes_recorded``: the last run of shape_recorder(model) took these inputs'
    shapes, layouts and dtypes (no fake run then). Raises what torch.fx raises when the
    model cannot be traced."""
    gm = _traced(model)
    p = _plan(gm, example_inputs, streams, roofline, min_gain, costs, shapes_recorded)
    if p.streams_used <= 1:
        return model, p
    return _apply(gm, p, eager), p


def _apply(gm, p, eager):
    """A new graph: the placeholders and parameters, the fork, then the operations in the
    plan's order (each stream's operations run in that order, which the plan's minimal
    syncs rely on) with their switches and records, then the join and the output."""
    _register_ops()
    ops = torch.ops.kitsune
    old = list(gm.graph.nodes)
    sources = sorted({a for a, _ in p.syncs})
    event_of = {name: i for i, name in enumerate(sources)}
    waits_of = {}
    for a, b in p.syncs:
        waits_of.setdefault(b, []).append(event_of[a])
    stream_of = lambda n: p.stream.get(n.name, 0)   # inputs, parameters, output: the caller's stream
    tensor = lambda n: hasattr(n.meta.get("tensor_meta"), "shape")   # one tensor, not a tuple
    first = next((n for n in old if n.op == "placeholder" and tensor(n)), None)
    if first is None:
        raise ValueError("kitsune.sched.streamed: the model takes no tensor input to fork from")
    ctx = _Streams(p.streams_asked, len(sources), eager)
    cid = id(ctx)
    _CONTEXTS[cid] = ctx
    g, env = tfx.Graph(), {}
    copy = lambda n: env.__setitem__(n, g.node_copy(n, lambda a: env[a]))
    split = conv_grads_mode() != "together"
    for n in old:
        if n.op in ("placeholder", "get_attr"):
            copy(n)
    g.call_function(ops.stream_fork, (env[first], cid))
    by_name = {n.name: n for n in old}
    current = 0
    for name in p.order:
        n = by_name[name]
        s = stream_of(n)
        cross = [env[a] for a in n.all_input_nodes if a.op != "get_attr" and stream_of(a) != s and tensor(a)]
        waits = waits_of.get(name, [])
        if s != current or waits or cross:
            g.call_function(ops.stream_switch, (cross, cid, s, waits))
            current = s
        if split and _splits_conv_grads(n):
            env[n] = g.call_function(_conv_grads_apart, tuple(env[a] if isinstance(a, tfx.Node) else a
                                                              for a in n.args) + (cid, _used_once(gm, old, n.args[1])))
            env[n].meta = dict(n.meta)
        elif split and (c := _conv_module(gm, n)) is not None:
            w = g.get_attr(n.target + ".weight")
            env[n] = g.call_function(_conv_grads_apart, (env[n.args[0]], w, None, c.stride, c.padding, c.dilation,
                                                         c.groups, cid, _reaches(gm, old, c.weight) == 1))
            env[n].meta = dict(n.meta)
        else:
            copy(n)
        if name in event_of:
            g.call_function(ops.stream_record, (cid, event_of[name]))
    out = next(n for n in old if n.op == "output")
    cross = [env[a] for a in out.all_input_nodes if stream_of(a) != 0 and tensor(a)]
    if cross:
        g.call_function(ops.stream_switch, (cross, cid, 0, []))
    g.call_function(ops.stream_join, (cid,))
    copy(out)
    new = tfx.GraphModule(gm, g)
    # the context lives as long as the module and its copies (GraphModule's deepcopy keeps
    # the attributes listed in meta["_user_preserved_attributes"])
    new._kitsune_streams = ctx
    new.meta.setdefault("_user_preserved_attributes", {})["_kitsune_streams"] = ctx
    return new
