"""kitsune.sched.costs: what each operation of a model's graph costs, for the planner.

A roofline estimate from an operation's FLOPs and bytes (Linear, convolutions and
matmuls count 2 FLOPs a multiply-add; everything else one FLOP an output element;
views, reshapes, getitem and the like are free), or its measured time
(measure_costs: the forward run operation by operation). saved_state puts back what
running a model changes besides its parameters (measure_costs; compile_step's
warm-up and trials).
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.fx as tfx


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
