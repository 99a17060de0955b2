"""kitsune.sched: plans a model's graph onto CUDA streams with the C scheduler
(scheduler/, kitsune/sched.h).

    plan = kitsune.sched.plan(model, example_input, streams=4)
    print(plan)            # per-operation stream, the syncs, estimated gain

The model is traced with torch.fx and its shapes propagated on fake tensors (nothing
is computed), or taken from a real run that ``shape_recorder`` noted them in. Each
operation gets a roofline cost from its FLOPs and bytes (Linear, convolutions and
matmuls count 2 FLOPs a multiply-add; everything else one FLOP an output element;
views, reshapes, getitem and the like are free), or, with
``costs="measured"``, its measured time: ``measure_costs`` runs the forward operation
by operation on the example inputs and times each (CUDA events on a GPU), the model's
buffers and the random generators put back afterwards; ``costs`` may also map node
names to seconds. The C core schedules
the DAG by critical-path list scheduling onto `streams` streams and gives the fewest
cross-stream syncs. ``plan.streams_used`` is 1 when more streams would not shorten
the estimated step by at least 5%: a sequential model keeps one stream.

``streamed(model, example_input, streams=4)`` executes a plan: it returns a copy of the
model's graph with stream ops inserted (``torch.ops.kitsune.stream_fork``,
``stream_switch``, ``stream_record``, ``stream_join``: events between streams where the
plan put a sync, ``record_stream`` on tensors used on another stream than the one that
made them). The streams run while a CUDA graph is being captured (kitsune.compile_step
captures the whole step; autograd runs each backward op on its forward op's stream, so
the backward is spread too; each bias-free convolution, an F.conv2d as kitsune.optimize
leaves a Conv2d with a bias or a bias-free nn.Conv2d with zero padding (torchvision's
ResNets), can also run its weight gradient on a stream beside its input gradient:
_ConvGradsApart, see conv_grads_mode). Outside a capture the module runs on one stream:
several streams in eager mode were measured slower on the H100 (ARCHITECTURE.md, Facts). When
the plan gains less than ``min_gain``, the model comes back unchanged.
"""
import ctypes
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as tfx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .._native import OK, Schedule, check, native
from ..fx import _attr


@dataclass
class Roofline:
    """Peak rates the cost estimates use; the defaults are an H100 SXM's datasheet
    numbers (dense bf16/fp16 tensor cores, TF32 for fp32, HBM3) and a typical launch."""
    flops: dict = field(default_factory=lambda: {torch.bfloat16: 989e12, torch.float16: 989e12,
                                                 torch.float32: 495e12, torch.float64: 67e12})
    bandwidth: float = 3.35e12
    launch: float = 4e-6


_FREE_METHODS = {"view", "reshape", "transpose", "permute", "size", "contiguous", "unsqueeze", "squeeze",
                 "flatten", "expand", "t", "dim", "chunk", "split"}
_FREE_FUNCTIONS = {torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
                   torch.chunk, torch.split, getattr}


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _meta_val(n):
    tm = n.meta.get("tensor_meta")
    if tm is None:
        return []
    if hasattr(tm, "shape"):   # one TensorMetadata (itself a NamedTuple)
        return [tm]
    if isinstance(tm, (list, tuple)):
        return [t for t in tm if hasattr(t, "shape")]
    return []


def _numel(tm):
    k = 1
    for d in tm.shape:
        k *= int(d)
    return k


def _bytes(tm):
    return _numel(tm) * torch.empty((), dtype=tm.dtype).element_size()


def _is_free(gm, n):
    import operator
    if n.op == "call_method":
        return n.target in _FREE_METHODS
    if n.op == "call_function":
        return n.target in _FREE_FUNCTIONS or n.target is operator.getitem
    return False


def _flops(gm, n, out):
    """Multiply-adds x 2 for Linear / conv / matmul (and kitsune.linear_act), else one per
    output element."""
    import torch.nn as nn
    import torch.nn.functional as F
    import operator
    elems = sum(_numel(t) for t in out)
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        if isinstance(m, nn.Linear):
            return 2 * elems * m.in_features
        if isinstance(m, nn.modules.conv._ConvNd):
            k = 1
            for d in m.kernel_size:
                k *= d
            return 2 * elems * (m.in_channels // m.groups) * k
    if n.op == "call_function" and n.target in (F.conv1d, F.conv2d, F.conv3d) and len(n.args) > 1:
        w = _meta_val(n.args[1]) if isinstance(n.args[1], tfx.Node) else []   # (out, in / groups, *kernel)
        if w:
            return 2 * elems * (_numel(w[0]) // int(w[0].shape[0]))
    ko = sys.modules.get("kitsune.ops")   # loaded whenever a graph holds its ops
    gemms = (torch.matmul, torch.bmm, torch.mm, operator.matmul, F.linear) + ((ko.linear_act,) if ko else ())
    if n.op == "call_function" and n.target in gemms:
        a = _meta_val(n.args[0]) if isinstance(n.args[0], tfx.Node) else []
        if a:
            return 2 * elems * int(a[0].shape[-1])
    return elems


@dataclass
class Plan:
    """A schedule of a model's operations on streams. ``stream`` maps node names to
    streams (only when ``streams_used`` > 1), ``syncs`` lists (after, before) node
    names, the estimates are in seconds; ``shapes``: where the shapes came from, "fake
    tensors" or "recorded" (shape_recorder's run)."""
    streams_asked: int
    streams_used: int
    makespan: float
    makespan_one_stream: float
    stream: dict
    syncs: list
    order: list
    reason: str
    shapes: str = "fake tensors"

    @property
    def gain(self):
        return self.makespan_one_stream / self.makespan if self.makespan else 1.0

    def __str__(self):
        lines = [f"kitsune.sched: {len(self.order)} operations, {self.streams_used} of {self.streams_asked} streams, "
                 f"estimated {self.makespan * 1e6:.1f} us vs {self.makespan_one_stream * 1e6:.1f} us on one stream "
                 f"({self.gain:.2f}x); {len(self.syncs)} syncs" + (f" - {self.reason}" if self.reason else "")]
        if self.streams_used > 1:
            for name in self.order:
                lines.append(f"  stream {self.stream[name]}  {name}")
            for a, b in self.syncs:
                lines.append(f"  sync   {b} waits for {a}")
        return "\n".join(lines)


def _schedule(lib, costs, edges, k):
    dag = ctypes.c_void_p()
    check(lib.kt_dag_create(ctypes.byref(dag)), "kt_dag_create")
    try:
        for c in costs:
            check(lib.kt_dag_add_node(dag, c, None), "kt_dag_add_node")
        for a, b in edges:
            check(lib.kt_dag_add_edge(dag, a, b), "kt_dag_add_edge")
        s = Schedule()
        check(lib.kt_schedule_list(dag, k, ctypes.byref(s)), "kt_schedule_list")
        try:
            assert lib.kt_schedule_check(dag, ctypes.byref(s)) == OK, "kitsune.sched: the C core gave an invalid schedule"
            n = s.n_nodes
            return (s.makespan, [s.stream[i] for i in range(n)], [s.order[i] for i in range(n)],
                    [(s.syncs[i].after, s.syncs[i].before) for i in range(s.n_syncs)])
        finally:
            lib.kt_schedule_free(ctypes.byref(s))
    finally:
        lib.kt_dag_destroy(dag)


def plan(model, *example_inputs, streams=4, roofline=None, min_gain=1.05, costs=None):
    """Plans ``model``'s forward graph on ``streams`` CUDA streams (1..64); see the
    module docstring. ``example_inputs`` give the shapes (they may live on any
    device; only their shapes and dtypes are used, except with ``costs="measured"``,
    which runs the model on them). ``costs``: None (the roofline), "measured", or a
    dict of node name -> seconds covering every operation."""
    return _plan(_traced(model), example_inputs, streams, roofline, min_gain, costs)


class _Timer(tfx.Interpreter):
    """Runs a graph node by node, timing each operation that is not free: CUDA events
    around it when its inputs or outputs are on a GPU, else the host clock (synchronous
    CPU ops). ``times[name]`` collects one duration a run, in seconds."""

    def __init__(self, gm, timed):
        super().__init__(gm)
        self.timed, self.times, self._events = timed, {name: [] for name in timed}, []

    def run_node(self, n):
        if n.name not in self.timed:
            return super().run_node(n)
        import time
        cuda = any(t.is_cuda for a in n.all_input_nodes for t in _tensors(self.env.get(a)))
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = super().run_node(n)
            b.record()
            self._events.append((n.name, a, b))
            return out
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.times[n.name].append(time.perf_counter() - t0)
        return out

    def collect(self):
        if self._events:
            torch.cuda.synchronize()
        for name, a, b in self._events:
            self.times[name].append(a.elapsed_time(b) / 1e3)
        self._events = []


def measure_costs(model, *example_inputs, reps=5):
    """{node name: seconds} for each operation of ``model``'s traced forward: the graph
    run once to warm up and then ``reps`` times operation by operation on
    ``example_inputs`` (real tensors, on the device to measure), each operation's median
    kept; free operations (views, getitem, ...) cost 0. Runs without autograd; the
    model's buffers (BatchNorm's running statistics) and the CPU and CUDA random
    generators are put back as they were, so measuring changes no later result."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"kitsune.sched.measure_costs: reps must be a positive int, got {reps!r}")
    gm = _traced(model)
    ops = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    timed = {n.name for n in ops if not _is_free(gm, n)}
    restore = saved_state(gm)
    timer = _Timer(gm, timed)
    try:
        with torch.no_grad():
            for i in range(reps + 1):
                timer.run(*example_inputs)
                timer.collect()
                if i == 0:   # the warm-up run: first calls pay for allocation and autotuning
                    timer.times = {name: [] for name in timed}
    finally:
        restore()
    import statistics
    return {n.name: statistics.median(timer.times[n.name]) if n.name in timed else 0.0 for n in ops}


def branch_priority():
    """The priority of compile_step's capture stream and of a streamed module's branch
    streams: the device's greatest, so that where their kernels and the weight-gradient
    streams' (_ConvGradsApart's, CUDA's default 0, the least) contend for SMs the block
    scheduler starts theirs first (a captured kernel keeps its stream's priority:
    PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority). 0 with
    KITSUNE_STREAM_PRIORITY=0."""
    if os.environ.get("KITSUNE_STREAM_PRIORITY", "1") == "0":
        return 0
    return torch.cuda.Stream.priority_range()[1]


def saved_state(module):
    """What running ``module`` changes besides its parameters, saved now: its buffers
    (BatchNorm's running statistics) and the CPU and CUDA random generators. Returns a
    function that puts them back (measure_costs; compile_step's warm-up and trials)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)

    def restore():
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
    return restore


def _traced(model):
    return model if isinstance(model, tfx.GraphModule) else tfx.symbolic_trace(model)


def _fake_view(module, mode, memo):
    """A shallow copy of ``module``'s tree whose parameters and buffers are fake tensors
    (``mode``'s, converted once each): what runs on it writes no real tensor (an in-place
    update, BatchNorm's num_batches_tracked += 1 say, lands on its fake) and rebinds no
    attribute of the real modules (mutable attribute objects are shared, not copied).
    The code and the graph are shared, nothing is recompiled: ShapeProp's deep copy to
    fake tensors (a GraphModule's __deepcopy__ recompiles it) was 0.19 of the 0.43 s
    that _plan took on ResNet-18 under cProfile on the CPU machine; unprofiled first
    calls showed no clear gain there (docs/issue5.md)."""
    if id(module) in memo:
        return memo[id(module)]
    view = object.__new__(type(module))
    memo[id(module)] = view
    view.__dict__.update(module.__dict__)
    fake = lambda t: None if t is None else mode.from_tensor(t)
    view.__dict__["_parameters"] = {k: fake(v) for k, v in module._parameters.items()}
    view.__dict__["_buffers"] = {k: fake(v) for k, v in module._buffers.items()}
    view.__dict__["_modules"] = {k: None if m is None else _fake_view(m, mode, memo) for k, m in module._modules.items()}
    return view


class _FakeShapes(tfx.Interpreter):
    """Records each node's output ``tensor_meta`` (torch.fx's TensorMetadata, as ShapeProp
    records it) by running ``gm``'s graph on a fake view of ``gm`` under ``mode``."""

    def __init__(self, gm, mode):
        super().__init__(_fake_view(gm, mode, {}), garbage_collect_values=True, graph=gm.graph)
        self.mode = mode

    def run_node(self, n):
        with self.mode:
            out = super().run_node(n)
        _note_meta(n, out)
        return out


def _note_meta(n, out):
    """n.meta's "tensor_meta" (as ShapeProp records it) and "type" for n's output `out`."""
    if _tensors(out):
        n.meta["tensor_meta"] = tfx.node.map_aggregate(
            out, lambda v: _extract_tensor_metadata(v) if isinstance(v, torch.Tensor) else v)
    n.meta["type"] = type(out)


def _propagate_shapes(gm, example_inputs):
    """Each node's ``tensor_meta`` for ``example_inputs``, computed on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _FakeShapes(gm, mode).run(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs])


class _RecordShapes(tfx.Interpreter):
    """Runs ``gm``'s graph for real, noting each node's output as _FakeShapes does."""

    def run_node(self, n):
        out = super().run_node(n)
        _note_meta(n, out)
        return out


def _module_hooks(m):
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def shape_recorder(model):
    """A callable that runs ``model``'s forward as calling it does, node by node through
    its graph (torch.fx's Interpreter, values dropped after their last use), and notes
    each node's tensor_meta on the way: then ``streamed(model, *the same inputs,
    shapes_recorded=True)`` plans from those shapes instead of running the graph again on
    fake tensors. kitsune.compile_step records its warm-up step so. None when ``model``
    is no GraphModule whose call is its graph's plain code: another type, custom codegen
    (inputs and outputs rearranged), or hooks of its own or global module hooks (which
    calling it runs and the Interpreter does not)."""
    mm = torch.nn.modules.module
    if (not isinstance(model, tfx.GraphModule) or type(model.graph._codegen) is not tfx.graph.CodeGen
            or _module_hooks(model) or mm._global_forward_hooks or mm._global_forward_pre_hooks
            or mm._global_backward_hooks or mm._global_backward_pre_hooks):
        return None

    def run(*inputs):
        for n in model.graph.nodes:   # what a run that fails part way leaves is never read
            n.meta.pop("tensor_meta", None)
            n.meta.pop("type", None)
        return _RecordShapes(model, garbage_collect_values=True).run(*inputs)
    return run


def _roofline_cost(gm, n, rl):
    """launch + max(FLOPs / peak, bytes / bandwidth) from n's propagated shapes; 0 for free
    operations and those without a tensor output."""
    out = _meta_val(n)
    if _is_free(gm, n) or not out:
        return 0.0
    ko = sys.modules.get("kitsune.ops")
    if ko and n.op == "call_function" and n.target is ko.max_pool2d_branches:
        out = out[:1]   # the rest are views of the input: nothing written
    ins = [t for a in n.all_input_nodes for t in _meta_val(a)]
    nbytes = sum(_bytes(t) for t in out + ins)
    peak = rl.flops.get(out[0].dtype, rl.flops[torch.float32])
    return rl.launch + max(_flops(gm, n, out) / peak, nbytes / rl.bandwidth)


def _plan(gm, example_inputs, streams, roofline, min_gain, costs=None, shapes_recorded=False):
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 64:
        raise ValueError(f"kitsune.sched.plan: streams must be an int in 1..64, got {streams!r}")
    if not (costs is None or costs == "measured" or isinstance(costs, dict)):
        raise ValueError(f"kitsune.sched.plan: costs must be None (the roofline), 'measured' or a dict of node name "
                         f"-> seconds, got {costs!r}")
    given = measure_costs(gm, *example_inputs) if costs == "measured" else costs
    rl = roofline or Roofline()
    # shapes on fake tensors, whatever the costs: the roofline reads them, and so does
    # streamed's rewrite (which nodes are tensors, to fork from and to hand across streams);
    # or as shape_recorder noted them, when every node has them
    recorded = shapes_recorded and all("type" in n.meta for n in gm.graph.nodes if n.op != "output")
    if not recorded:
        _propagate_shapes(gm, example_inputs)
    shapes = "recorded" if recorded else "fake tensors"
    ops = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    index = {n: i for i, n in enumerate(ops)}
    if given is not None:
        missing = [n.name for n in ops if n.name not in given]
        if missing:
            raise ValueError(f"kitsune.sched.plan: costs has no entry for {missing[:5]} "
                             f"({len(missing)} of {len(ops)} operations)")
        bad = {k: v for k, v in given.items() if not isinstance(v, (int, float)) or not v >= 0}
        if bad:
            raise ValueError(f"kitsune.sched.plan: costs must be seconds >= 0, got {dict(list(bad.items())[:5])}")
    costs = [float(given[n.name]) for n in ops] if given is not None else [_roofline_cost(gm, n, rl) for n in ops]
    edges = [(index[a], index[n]) for n in ops for a in n.all_input_nodes if a in index]
    lib = native()
    one, _, order1, _ = _schedule(lib, costs, edges, 1)
    names = [n.name for n in ops]
    if streams == 1:
        return Plan(1, 1, one, one, {}, [], [names[i] for i in order1], "one stream asked", shapes)
    mk, stream, order, syncs = _schedule(lib, costs, edges, streams)
    if not mk or one / mk < min_gain:
        return Plan(streams, 1, one, one, {}, [], [names[i] for i in order1],
                    f"more streams gain {one / mk:.2f}x < {min_gain}x: one stream", shapes)
    used = len(set(stream))
    return Plan(streams, used, mk, one, {names[i]: stream[i] for i in range(len(ops))},
                [(names[a], names[b]) for a, b in syncs], [names[i] for i in order], "", shapes)


# ---- executing a plan ----------------------------------------------------------------
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


# id -> _Streams, for the ops below (their schemas take ints); a context lives as long
# as a module holding it
_CONTEXTS = weakref.WeakValueDictionary()
_LIB = None


def _register_ops():
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("kitsune", "FRAGMENT")
    _LIB.define("stream_fork(Tensor x, int ctx) -> ()")
    _LIB.define("stream_switch(Tensor[] cross, int ctx, int stream, int[] waits) -> ()")
    _LIB.define("stream_record(int ctx, int event) -> ()")
    _LIB.define("stream_join(int ctx) -> ()")

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


class _ConvGradsApart(torch.autograd.Function):
    """F.conv2d (no bias) whose backward, inside a capture of a streamed module, runs the
    weight gradient on a stream of its own beside the input gradient on the node's
    stream, then joins: the node takes about max(dgrad, wgrad) instead of their sum (the
    branchy net's 3x3 and 5x5 convolutions at batch 8: input gradients 18 to 30 us,
    weight gradients 32 to 46 us, one after the other on one stream; H100,
    bench/results/h100_timeline_gpt_inception8_18b9e89.log). Where the plan's streams
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


_CONV_GRADS_MODES = ("auto", "apart", "together", "late")
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
    one step at a time (graph._CAPTURE_LOCK); two threads capturing backwards of
    streamed modules by other code at once are not supported (the second would drop
    the first's pending gradients as a failed backward's)."""
    mode = os.environ.get("KITSUNE_CONV_GRADS", "auto") or "auto"
    if mode not in _CONV_GRADS_MODES:
        raise ValueError(f"KITSUNE_CONV_GRADS must be one of {', '.join(_CONV_GRADS_MODES)} (or unset), got {mode!r}")
    return mode


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




def streamed(model, *example_inputs, streams=4, roofline=None, min_gain=1.05, eager=False, costs=None,
             shapes_recorded=False):
    """``(module, plan)``: ``model``'s forward with the plan's streams applied (see the
    module docstring), or ``model`` itself when the plan keeps one stream. ``eager=True``
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


class Inception(torch.nn.Module):
    """An Inception-style block (four branches joined by a concat): the demo's and the
    tests' example of a graph that several streams shorten."""

    def __init__(self, c=64):
        nn = torch.nn
        super().__init__()
        self.b1 = nn.Conv2d(c, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, c, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


def demo():
    """Prints the plan of an Inception-style block and of an MLP (used by make demo)."""
    nn = torch.nn
    print(plan(Inception(), torch.randn(32, 64, 28, 28), streams=4))
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    print(plan(mlp, torch.randn(64, 784), streams=4))


if __name__ == "__main__":
    demo()
