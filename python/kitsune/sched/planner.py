"""kitsune.sched.planner: a model's forward graph planned onto CUDA streams.

The graph is traced with torch.fx and its shapes propagated on fake tensors (nothing
is computed), or taken from a real run that shape_recorder noted them in; each
operation gets its cost (kitsune.sched.costs) and the C core (scheduler/,
kitsune/sched.h) schedules the DAG by critical-path list scheduling, with the fewest
cross-stream syncs.
"""
import ctypes
from dataclasses import dataclass

import torch
import torch.fx as tfx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .._native import OK, Schedule, check, native
from .costs import Roofline, _roofline_cost, _tensors, _traced, measure_costs


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
    docstring of kitsune.sched. ``example_inputs`` give the shapes (they may live on any
    device; only their shapes and dtypes are used, except with ``costs="measured"``,
    which runs the model on them). ``costs``: None (the roofline), "measured", or a
    dict of node name -> seconds covering every operation."""
    return _plan(_traced(model), example_inputs, streams, roofline, min_gain, costs)


def _fake_view(module, mode, memo):
    """A shallow copy of ``module``'s tree whose parameters and buffers are fake tensors
    (``mode``'s, converted once each): what runs on it writes no real tensor (an in-place
    update, BatchNorm's num_batches_tracked += 1 say, lands on its fake) and rebinds no
    attribute of the real modules (mutable attribute objects are shared, not copied).
    The code and the graph are shared, nothing is recompiled: ShapeProp's deep copy to
    fake tensors (a GraphModule's __deepcopy__ recompiles it) was 0.19 of the 0.43 s
    that _plan took on ResNet-18 under cProfile on the CPU machine; unprofiled first
    calls showed no clear gain there."""
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
