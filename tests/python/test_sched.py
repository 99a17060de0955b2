"""kitsune.sched.plan on CPU: a branchy block spreads over streams with the syncs its
join needs, a sequential model keeps one stream, the issue order is topological,
and bad arguments are refused with the limit named. (The C core has its own tests in
tests/c/unit/test_sched.c: validity, necessity of each sync, optimality bounds.)"""
import copy

import pytest

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
import kitsune.sched as ks  # noqa: E402
from kitsune.sched import conv_grads as kcg, costs as kco, planner as kpl  # noqa: E402
from models import Inception as InceptionBlock  # noqa: E402

nn = torch.nn


def Inception():
    return InceptionBlock(32)


def _topological(model, plan):
    gm = torch.fx.symbolic_trace(model)
    seen = set()
    ops = {n.name: n for n in gm.graph.nodes}
    for name in plan.order:
        for a in ops[name].all_input_nodes:
            assert a.op in ("placeholder", "get_attr") or a.name in seen, f"{name} before its input {a.name}"
        seen.add(name)
    return ops


def test_branches_spread_over_streams_and_the_join_waits_for_each():
    m = Inception()
    plan = ks.plan(m, torch.randn(16, 32, 28, 28), streams=4)
    assert plan.streams_used == 4 and plan.gain > 1.3, plan
    _topological(m, plan)
    s = plan.stream
    assert s["b2_0"] == s["b2_1"] == s["b2_2"] and s["b3_0"] == s["b3_1"] == s["b3_2"], plan   # a branch stays put
    assert len({s["b1"], s["b2_0"], s["b3_0"], s["b4_0"]}) == 4, plan
    waited = {a for a, b in plan.syncs if b == "cat"}
    assert len(waited) == 3 and len(plan.syncs) == 3, plan   # the join continues one branch's stream


def test_two_streams_and_one_stream():
    m = Inception()
    two = ks.plan(m, torch.randn(16, 32, 28, 28), streams=2)
    assert two.streams_used == 2 and 1 < two.gain <= 2.0 + 1e-9, two
    one = ks.plan(m, torch.randn(16, 32, 28, 28), streams=1)
    assert one.streams_used == 1 and not one.syncs and one.makespan == one.makespan_one_stream


def test_a_sequential_model_keeps_one_stream():
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    plan = ks.plan(mlp, torch.randn(64, 784), streams=4)
    assert plan.streams_used == 1 and not plan.syncs and "one stream" in plan.reason, plan
    _topological(mlp, plan)
    assert str(plan).startswith("kitsune.sched: 5 operations, 1 of 4 streams")


def test_bad_stream_counts_are_refused():
    for bad in (0, 65, 2.5):
        with pytest.raises(ValueError, match=r"streams must be an int in 1\.\.64"):
            ks.plan(nn.Linear(2, 2), torch.randn(1, 2), streams=bad)


# ---- kitsune.sched.streamed: the plan executed -----------------------------------------------
def _stream_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "kitsune.stream_" in str(n.target)]


def test_streamed_inserts_fork_switches_records_and_join_and_runs_the_same():
    torch.manual_seed(0)
    m = Inception()
    x = torch.randn(4, 32, 8, 8, requires_grad=True)
    sm, plan = ks.streamed(m, x, streams=4)
    assert plan.streams_used == 4 and sm is not m
    names = [str(n.target).split(".")[-1] for n in _stream_ops(sm)]
    assert names[0] == "stream_fork" and names[-1] == "stream_join", names
    assert names.count("stream_record") == len({a for a, _ in plan.syncs}), names
    # each op runs after its switch: the op order is the plan's, each stream's in plan order
    order = [n.name for n in sm.graph.nodes if n.name in plan.stream]
    assert order == plan.order
    # every sync's event is waited before the op that needs it
    waited = {}
    current = None
    for n in sm.graph.nodes:
        if n in _stream_ops(sm) and str(n.target).endswith("stream_switch"):
            current = n.args[2]
            for e in n.args[3]:
                waited.setdefault(e, []).append(n)
        elif n.name in plan.stream:
            assert plan.stream[n.name] == (current or 0), f"{n.name} runs on {current}, planned {plan.stream[n.name]}"
    assert sum(len(v) for v in waited.values()) == len(plan.syncs)
    # on the CPU the stream ops do nothing: same outputs and gradients as the model
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = m(x), sm(x2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    y1.square().sum().backward()
    y2.square().sum().backward()
    # x's gradient sums the four branches' in the new op order: equal up to rounding
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_a_copy_of_a_streamed_module_outlives_the_original():
    import gc
    m = Inception()
    x = torch.randn(2, 32, 8, 8)
    sm, _ = ks.streamed(m, x, streams=4)
    twin = copy.deepcopy(sm)
    want = m(x)
    del sm
    gc.collect()
    torch.testing.assert_close(twin(x), want, rtol=0, atol=0)


def test_streamed_keeps_a_sequential_model_and_refuses_bad_counts():
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sm, plan = ks.streamed(mlp, torch.randn(2, 8), streams=4)
    assert sm is mlp and plan.streams_used == 1
    with pytest.raises(ValueError, match=r"streams must be an int in 1\.\.64"):
        ks.streamed(mlp, torch.randn(2, 8), streams=0)


class _Measured(nn.Module):
    """A heavy and a light branch, a BatchNorm (running statistics) and a dropout (the
    random generator): what measuring must leave as it found it."""
    def __init__(self):
        super().__init__()
        self.big, self.bn, self.drop = nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Dropout(0.5)

    def forward(self, x):
        heavy = self.drop(self.bn(self.big(x @ x.t() @ x)))
        light = x[:4].view(-1) + 1
        return heavy.sum() + light.sum()


def test_measured_costs_time_each_operation_and_change_nothing():
    """measure_costs: a positive time for each operation that computes, 0 for views,
    transposes and getitem, the matrix products above the small add; BatchNorm's running
    statistics and the random generator are as before it ran."""
    torch.manual_seed(5)
    m = _Measured().train()
    x = torch.randn(512, 512)
    stats = (m.bn.running_mean.clone(), m.bn.running_var.clone(), m.bn.num_batches_tracked.clone())
    state = torch.get_rng_state()
    c = ks.measure_costs(m, x, reps=3)
    assert torch.equal(torch.get_rng_state(), state)
    for before, after in zip(stats, (m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked)):
        assert torch.equal(before, after)
    free = {"t", "getitem", "view"}
    assert all(c[k] == 0 for k in c if k in free), c
    assert all(c[k] > 0 for k in c if k not in free), c
    assert c["matmul"] > 5 * c["add"] and c["matmul_1"] > 5 * c["add"], c   # 2 x 512^3 FLOPs against 2048 adds
    with pytest.raises(ValueError, match="reps must be a positive int, got 0"):
        ks.measure_costs(m, x, reps=0)


class _Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.bn2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        self.drop, self.head = nn.Dropout(0.5), nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.relu(self.bn2(y) + y).to(memory_format=torch.channels_last)
        return self.head(self.drop(y.mean((2, 3)))), y[:, :4].half()


@pytest.mark.parametrize("optimized", [False, True])
def test_shapes_are_propagated_on_fake_tensors_and_change_nothing_real(optimized):
    """The plan's shapes come from a run on fake tensors over a view of the model: each
    node's shape, dtype and strides are what a real run gives (a channels-last map and a
    half cast among them), and nothing real changes: BatchNorm's running statistics and
    batch counts (nn's BatchNorm forward; or kitsune.optimize's fused ops and its one
    foreach add over the modules, which the graph reaches through get_attr), the random
    generator."""
    from torch.fx.passes.shape_prop import ShapeProp
    torch.manual_seed(6)
    m = _Stateful().train()
    m = kitsune.optimize(m) if optimized else m
    x = torch.randn(4, 3, 16, 16)
    gm = kco._traced(m)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    kpl._propagate_shapes(gm, (x,))
    assert torch.get_rng_state().equal(rng)
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in state.items()), [k for k in state if not state[k].equal(after[k])]
    real = copy.deepcopy(gm)
    ShapeProp(real).propagate(x)   # on real tensors, on a copy
    want = {n.name: n.meta.get("tensor_meta") for n in real.graph.nodes}
    got = {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}
    assert got == want and sum(v is not None for v in got.values()) >= 8, (got, want)
    strides = {tuple(t.stride) for n in gm.graph.nodes for t in kco._meta_val(n)}
    assert (8 * 16 * 16, 1, 8 * 16, 8) in strides   # channels-last, as recorded


def test_a_recorded_run_gives_the_plan_the_shapes_the_fake_run_gives():
    """shape_recorder runs a GraphModule's graph for real as calling it does (the same
    outputs, gradients, BatchNorm statistics and random draws, from the same start) and
    notes on each node the tensor_meta that the fake run gives (a channels-last map and a
    half cast among them); streamed(..., shapes_recorded=True) then plans the same
    without a fake run (plan.shapes says which). A node the recording did not reach
    sends the plan back to the fake run; no recorder for a model that is no GraphModule,
    or whose call runs hooks the graph's run would not."""
    torch.manual_seed(6)
    gm = kitsune.optimize(_Stateful().train())
    twin = copy.deepcopy(gm)
    x = torch.randn(4, 3, 16, 16)
    run = ks.shape_recorder(gm)
    torch.manual_seed(1)
    outs = run(x)
    torch.manual_seed(1)
    want = twin(x)
    for a, b in zip(outs, want):
        assert torch.equal(a, b)
    sum(o.float().sum() for o in outs).backward()
    sum(o.float().sum() for o in want).backward()
    for (name, a), b in zip(gm.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(gm.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name
    recorded = {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}
    kpl._propagate_shapes(twin, (x,))
    fake = {n.name: n.meta.get("tensor_meta") for n in twin.graph.nodes}
    assert recorded == fake and sum(v is not None for v in recorded.values()) >= 8, (recorded, fake)
    assert (8 * 16 * 16, 1, 8 * 16, 8) in {tuple(t.stride) for n in gm.graph.nodes for t in kco._meta_val(n)}

    block = kco._traced(InceptionBlock(8))
    xb = torch.randn(2, 8, 8, 8)
    ks.shape_recorder(block)(xb)
    rec = kpl._plan(block, (xb,), 4, None, 1.05, shapes_recorded=True)
    fresh = ks.plan(copy.deepcopy(block), xb, streams=4)
    assert rec.shapes == "recorded" and fresh.shapes == "fake tensors"
    assert (rec.stream, rec.syncs, rec.order) == (fresh.stream, fresh.syncs, fresh.order) and rec.streams_used > 1
    module, p = ks.streamed(block, xb, streams=4, shapes_recorded=True)
    assert p.shapes == "recorded" and module is not block
    del next(n for n in block.graph.nodes if n.op == "call_module").meta["type"]
    assert kpl._plan(block, (xb,), 4, None, 1.05, shapes_recorded=True).shapes == "fake tensors"

    assert ks.shape_recorder(InceptionBlock(8)) is None   # no GraphModule
    h = block.register_forward_hook(lambda *a: None)
    assert ks.shape_recorder(block) is None
    h.remove()
    assert ks.shape_recorder(block) is not None
    h = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert ks.shape_recorder(block) is None
    finally:
        h.remove()


def test_plans_take_measured_or_given_costs():
    """costs="measured" plans on measured times; a dict of node name -> seconds is used as
    given: on an Inception block with one branch ten times the rest, one stream takes the
    sum and four the critical path through that branch; a missing node or a negative
    time is refused with its name."""
    torch.manual_seed(6)
    block, x = InceptionBlock(8), torch.randn(2, 8, 8, 8)
    p = ks.plan(block, x, streams=4, costs="measured")
    assert p.streams_used > 1 and p.makespan_one_stream > p.makespan > 0, p
    names = [n for n in p.order]
    given = {n: 1e-3 for n in names}
    given["b3_2"] = 10e-3
    p = ks.plan(block, x, streams=4, costs=given)
    assert p.makespan_one_stream == pytest.approx(19e-3) and p.makespan == pytest.approx(13e-3), p   # b3_0, b3_1, b3_2, cat
    del given["b1"]
    with pytest.raises(ValueError, match=r"costs has no entry for \['b1'\]"):
        ks.plan(block, x, streams=4, costs=given)
    given["b1"] = -1.0
    with pytest.raises(ValueError, match=r"costs must be seconds >= 0, got \{'b1': -1.0\}"):
        ks.plan(block, x, streams=4, costs=given)
    with pytest.raises(ValueError, match="costs must be None .the roofline., 'measured' or a dict"):
        ks.plan(block, x, streams=4, costs="profiled")


def test_streamed_applies_plans_on_measured_or_given_costs():
    """streamed's rewrite needs the graph's shapes whatever the costs: on measured times
    and on given ones it inserts the stream ops and computes what the block computes."""
    torch.manual_seed(7)
    block, x = InceptionBlock(8), torch.randn(2, 8, 8, 8)
    given = {n: 1e-3 for n in ks.plan(block, x, streams=4).order}
    for costs in ("measured", given):
        sm, p = ks.streamed(block, x, streams=4, costs=costs)
        assert p.streams_used > 1 and sm is not block, (costs, p)
        names = [str(n.target).split(".")[-1] for n in _stream_ops(sm)]
        assert names[0] == "stream_fork" and names[-1] == "stream_join", names
        torch.testing.assert_close(sm(x), block(x), rtol=0, atol=0)


def test_branch_streams_take_the_greatest_priority_unless_turned_off(monkeypatch):
    """sched.branch_priority: the priority of compile_step's capture stream and of a
    streamed module's branch streams (the weight-gradient streams keep CUDA's default,
    the least): the device's greatest (torch.cuda.Stream.priority_range's second value,
    faked here: no GPU needed), or 0 with KITSUNE_STREAM_PRIORITY=0."""
    monkeypatch.setattr(torch.cuda.Stream, "priority_range", staticmethod(lambda: (0, -5)))
    monkeypatch.delenv("KITSUNE_STREAM_PRIORITY", raising=False)
    assert ks.branch_priority() == -5
    monkeypatch.setenv("KITSUNE_STREAM_PRIORITY", "1")
    assert ks.branch_priority() == -5
    monkeypatch.setenv("KITSUNE_STREAM_PRIORITY", "0")
    assert ks.branch_priority() == 0


def test_compile_step_refuses_unknown_stream_costs():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="compile_step: stream_costs must be None .the roofline. or 'measured', got 'x'"):
        kitsune.compile_step(m, nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1), stream_costs="x")


def test_compile_step_refuses_bad_stream_counts():
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for bad in (0, 65, True):
        with pytest.raises(ValueError, match=r"compile_step: streams must be an int in 1\.\.64"):
            kitsune.compile_step(m, nn.functional.mse_loss, opt, streams=bad)


def test_streamed_splits_each_bias_free_conv2d_s_gradients_and_computes_the_same():
    """In a streamed graph each F.conv2d without a bias and with int-pair stride, padding
    and dilation (kitsune.optimize's split of a Conv2d) becomes _conv_grads_apart:
    inside a capture its input and weight gradients run on two streams (on the GPU the
    compile_step tests train with it); on the CPU the outputs and every gradient are the
    model's, with and without bf16 autocast. A conv with a bias, padding="same" or other
    arguments stays as it is."""
    torch.manual_seed(0)
    m = kitsune.optimize(Inception())
    x = torch.randn(4, 32, 8, 8)
    sm, plan = ks.streamed(m, x, streams=4)
    assert plan.streams_used == 4
    convs = [n for n in m.graph.nodes if n.target is nn.functional.conv2d]
    apart = [n for n in sm.graph.nodes if n.target is kcg._conv_grads_apart]
    assert len(convs) == 6 and len(apart) == len(convs), (len(convs), len(apart))
    assert not [n for n in sm.graph.nodes if n.target is nn.functional.conv2d]

    def run(mod, amp):
        for p in m.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = mod(xi)
        y.float().square().sum().backward()
        return [y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()]
    for amp in (False, True):   # under autocast the convolutions compute in bf16, the gradients come back fp32
        for a, b in zip(run(m, amp), run(sm, amp)):   # x's gradient sums the branches in the plan's order
            assert a.dtype == b.dtype, (amp, a.dtype, b.dtype)
            torch.testing.assert_close(a, b, rtol=1e-5 if not amp else 1e-2, atol=1e-5 if not amp else 1e-2)

    def convs_of(x, w, b):
        F = nn.functional
        return (F.conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1), F.conv2d(x, w, b, (1, 1), (1, 1), (1, 1), 1),
                F.conv2d(x, w, None, (1, 1), "same", (1, 1), 1), F.conv2d(x, w, None, 1, 1, 1, 1), F.conv2d(x, w))
    gm = torch.fx.symbolic_trace(convs_of)
    assert [kcg._splits_conv_grads(n) for n in gm.graph.nodes if n.op == "call_function"
            and n.target is nn.functional.conv2d] == [True, False, False, False, False]


class _ModuleConvs(nn.Module):
    """Two branches of bias-free Conv2d modules (as torchvision's ResNets have, which
    kitsune.optimize leaves as modules), one called twice, beside convolutions that
    stay as they are: with a bias, padding="same", reflect padding."""
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b = nn.Conv2d(8, 8, 3, stride=(1, 1), padding=(2, 2), dilation=2, bias=False)
        self.twice = nn.Conv2d(8, 8, 1, bias=False)
        self.c = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.biased = nn.Conv2d(8, 8, 3, padding=1)
        self.same = nn.Conv2d(8, 8, 3, padding="same", bias=False)
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect", bias=False)

    def forward(self, x):
        left = self.twice(self.twice(self.a(x)))
        right = self.c(self.b(x))
        return torch.cat([left, right, self.biased(x), self.same(x), self.reflect(x)], 1)


def test_streamed_splits_bias_free_conv2d_modules_too_and_computes_the_same():
    """A bias-free nn.Conv2d with zero padding given as ints, called as a module, becomes
    _conv_grads_apart on its weight like an F.conv2d (its weight flagged used once only
    when the module is called once); one with a bias, padding="same" or reflect
    padding stays a module call. On the CPU the outputs and every gradient are the
    model's."""
    torch.manual_seed(1)
    m = _ModuleConvs()
    x = torch.randn(2, 8, 8, 8)
    sm, plan = ks.streamed(m, x, streams=4, min_gain=1.0)
    assert plan.streams_used > 1, plan
    apart = {n.args[1].target: n for n in sm.graph.nodes if n.target is kcg._conv_grads_apart}
    assert set(apart) == {"a.weight", "b.weight", "twice.weight", "c.weight"}, sorted(apart)
    assert sum(1 for n in sm.graph.nodes if n.target is kcg._conv_grads_apart) == 5   # twice: two calls
    assert {k: n.args[-1] for k, n in apart.items()} == {"a.weight": True, "b.weight": True, "twice.weight": False,
                                                         "c.weight": True}
    assert apart["b.weight"].args[3:7] == ((1, 1), (2, 2), (2, 2), 1) and apart["c.weight"].args[6] == 2
    assert {n.target for n in sm.graph.nodes if n.op == "call_module"} == {"biased", "same", "reflect"}
    assert ks.conv_grad_splits(sm) == 5

    def run(mod):
        for p in m.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        y = mod(xi)
        y.square().sum().backward()
        return [y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()]
    for a, b in zip(run(m), run(sm)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_conv_gradient_way_kept_must_beat_the_best_before_it_by_one_percent():
    """compile_step's choice among the timed ways (and the fallback when planned memory
    refuses late): a later way, with more streams and memory held, only for a 1% gain."""
    from kitsune.graph.conv_grads import _fastest_way
    assert _fastest_way({"together": 1.0}) == "together"
    assert _fastest_way({"together": 1.0, "apart": 0.995, "late": 0.993}) == "together"
    assert _fastest_way({"together": 1.0, "apart": 0.98, "late": 0.975}) == "apart"
    assert _fastest_way({"together": 1.0, "apart": 0.98, "late": 0.96}) == "late"
    assert _fastest_way({"together": 1.0, "late": 0.9}) == "late"   # late timed, apart not
    assert _fastest_way({"together": 1.0, "apart": 1.2, "late": 0.985}) == "late"


def test_conv_grads_mode_is_read_from_the_environment_and_together_splits_nothing(monkeypatch):
    """KITSUNE_CONV_GRADS: unset or "" is auto, a bad value names itself and the
    choices, and "together" leaves the convolutions as F.conv2d (no node to split)."""
    m = kitsune.optimize(Inception())
    x = torch.randn(4, 32, 8, 8)
    monkeypatch.delenv("KITSUNE_CONV_GRADS", raising=False)
    assert ks.conv_grads_mode() == "auto"
    sm, _ = ks.streamed(m, x, streams=4)
    assert ks.conv_grad_splits(sm) == 6 and sm._kitsune_streams.grads_apart
    assert ks.conv_grad_splits(m) == 0   # not a streamed module
    monkeypatch.setenv("KITSUNE_CONV_GRADS", "sideways")
    with pytest.raises(ValueError, match="KITSUNE_CONV_GRADS must be one of auto, apart, together.*'sideways'"):
        ks.conv_grads_mode()
    monkeypatch.setenv("KITSUNE_CONV_GRADS", "together")
    sm, plan = ks.streamed(m, x, streams=4)
    assert plan.streams_used == 4 and ks.conv_grad_splits(sm) == 0
    assert len([n for n in sm.graph.nodes if n.target is nn.functional.conv2d]) == 6


def test_each_split_conv_knows_whether_its_weight_is_used_once():
    """_conv_grads_apart's last argument (for KITSUNE_CONV_GRADS=late: a weight gradient
    may join after the backward only when nothing else accumulates into it): True for
    the Inception block's weights, False for a weight two convolutions share."""
    m = kitsune.optimize(Inception())
    sm, _ = ks.streamed(m, torch.randn(4, 32, 8, 8), streams=4)
    flags = [n.args[-1] for n in sm.graph.nodes if n.target is kcg._conv_grads_apart]
    assert flags == [True] * 6, flags

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8, 3, 3))
            self.v = nn.Parameter(torch.randn(8, 8, 3, 3))

        def forward(self, x):
            F = nn.functional
            a = F.conv2d(x, self.w, None, (1, 1), (1, 1), (1, 1), 1)
            b = F.conv2d(x, self.w, None, (1, 1), (1, 1), (1, 1), 1)
            c = F.conv2d(x, self.v, None, (1, 1), (1, 1), (1, 1), 1)
            return torch.cat([a, b, c], 1)
    sm, plan = ks.streamed(Shared(), torch.randn(2, 8, 8, 8), streams=3, min_gain=1.0)
    flags = {n.args[1].target: n.args[-1] for n in sm.graph.nodes if n.target is kcg._conv_grads_apart}
    assert flags == {"w": False, "v": True}, (flags, plan)

    class Tied(nn.Module):   # one weight under two names, and two Conv2d modules sharing one
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8, 3, 3))
            self.alias, self.v = self.w, nn.Parameter(torch.randn(8, 8, 3, 3))
            self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.c2.weight = self.c1.weight

        def forward(self, x):
            F = nn.functional
            a = F.conv2d(x, self.w, None, (1, 1), (1, 1), (1, 1), 1)
            b = F.conv2d(x, self.alias, None, (1, 1), (1, 1), (1, 1), 1)
            c = F.conv2d(x, self.v, None, (1, 1), (1, 1), (1, 1), 1)
            return torch.cat([a, b, c, self.c1(x), self.c2(x)], 1)
    sm, plan = ks.streamed(Tied(), torch.randn(2, 8, 8, 8), streams=4, min_gain=1.0)
    flags = sorted((n.args[1].target, n.args[-1]) for n in sm.graph.nodes if n.target is kcg._conv_grads_apart)
    assert len(flags) == 5 and [f for _, f in flags].count(True) == 1 and ("v", True) in flags, (flags, plan)


def test_a_late_weight_gradient_is_only_for_weights_without_hooks_that_would_see_it():
    """KITSUNE_CONV_GRADS=late hands autograd no weight gradient and sets .grad after the
    backward, so not for a weight with a tensor hook or a post-accumulate-grad hook of
    the user's (autograd runs those on the missing gradient); KitsuneOptimizer's
    in-backward hook takes such a parameter at its finish instead (a hook that sees no
    gradient leaves it there)."""
    w = nn.Parameter(torch.randn(3))
    assert kcg._late_ok(w)

    class InBackward:
        kitsune_in_backward = True

        def ready(self, p):
            pass
    h = w.register_post_accumulate_grad_hook(InBackward().ready)
    assert kcg._late_ok(w)
    u = w.register_post_accumulate_grad_hook(lambda p: None)
    assert not kcg._late_ok(w)
    u.remove(), h.remove()
    assert kcg._late_ok(w)
    w.register_hook(lambda g: g)
    assert not kcg._late_ok(w)


# ---- on the GPU -----------------------------------------------------------------------------
from support import gpu  # noqa: E402


@pytest.mark.gpu
@gpu
def test_gpu_streamed_eager_and_captured_match_the_model():
    """Four streams for real (eager=True runs them outside a capture too): forward and
    backward match the model's; then forward + backward captured in one CUDA graph with
    the streams, replayed on new inputs, match as well."""
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    m = Inception().cuda()
    ref_m = copy.deepcopy(m)   # the reference: its own parameters and gradients
    x = torch.randn(8, 32, 16, 16, device="cuda")
    sm, plan = ks.streamed(m, x, streams=4, eager=True)
    assert plan.streams_used == 4

    def fwd_bwd(mod, params, inp):
        for p in params:
            p.grad = None
        xi = inp.detach().clone().requires_grad_()
        y = mod(xi)
        y.square().mean().backward()
        return [y.detach(), xi.grad] + [p.grad.clone() for p in params]

    def check(got, want):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    check(fwd_bwd(sm, list(m.parameters()), x), fwd_bwd(ref_m, list(ref_m.parameters()), x))
    # captured: one graph of forward + backward on the streams
    cm, _ = ks.streamed(m, x, streams=4)   # streams only inside the capture
    static_x = x.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm-up, as PyTorch's docs do
        cm(static_x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(s)
    for p in m.parameters():
        p.grad = None
    static_x.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = cm(static_x)
        static_y.square().mean().backward()
    static = [static_y, static_x.grad] + [p.grad for p in m.parameters()]
    for _ in range(3):
        x_new = torch.randn_like(x)
        static_x.data.copy_(x_new)
        g.replay()
        torch.cuda.synchronize()
        check([t.clone() for t in static], fwd_bwd(ref_m, list(ref_m.parameters()), x_new))


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_spreads_a_branchy_net_and_trains_as_on_one_stream():
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 32, 3, padding=1)
            self.block = Inception()
            self.fc = nn.Linear(128, 10)

        def forward(self, x):
            return self.fc(self.block(torch.relu(self.stem(x))).mean((2, 3)))

    base = Net().cuda()
    batches = [(torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda"))
               for _ in range(4)]
    losses = {}
    for streams, optimized, costs in ((4, False, None), (1, False, None), (4, True, None), (4, True, "measured")):
        # optimized: the branches' biases and cat in kitsune.bias_cat, the pooling of the block input in
        # kitsune.max_pool2d_branches (the other branches take its views);
        # measured: the plan on each operation's time on the first batch (which changes no buffer or generator)
        m = kitsune.optimize(copy.deepcopy(base)) if optimized else copy.deepcopy(base)
        step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3),
                                    streams=streams, stream_costs=costs)
        losses[streams, optimized, costs] = torch.stack([step(*batches[i % 4]) for i in range(20)]).cpu()
        st = step.stats()
        assert st["reason"] is None and st["replays"] == 19, st
        assert costs or (st["streams"] > 1) == (streams > 1), st   # measured times decide for themselves
        assert streams == 1 or f"{costs or 'roofline'} costs" in st["streams_reason"], st
    assert {n.target for n in m.graph.nodes} >= {kitsune.ops.bias_cat, kitsune.ops.max_pool2d_branches}
    torch.testing.assert_close(losses[4, False, None], losses[1, False, None], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses[4, True, None], losses[1, False, None], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses[4, True, "measured"], losses[1, False, None], rtol=1e-4, atol=1e-5)


class _BranchyBN(nn.Module):
    """A stem, an Inception block, BatchNorm and dropout: buffers and the CUDA generator
    that a step changes."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.block = Inception()
        self.bn = nn.BatchNorm2d(128)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.block(torch.relu(self.stem(x))))).mean((2, 3))))


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_measures_the_conv_gradient_split_and_puts_the_model_back(monkeypatch):
    """With KITSUNE_CONV_GRADS unset the first capture times the forward and backward with
    the convolutions' gradients together and apart (replaying each 33 times) and keeps
    the faster; the BatchNorm statistics and the generator are put back after, so the
    losses (dropout included) and the statistics equal those of steps told "together"
    or "apart", which measure nothing."""
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    base = _BranchyBN().cuda()
    batches = [(torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda"))
               for _ in range(3)]
    runs = {}
    for mode in ("together", "apart", "late", ""):
        monkeypatch.setenv("KITSUNE_CONV_GRADS", mode)
        m = kitsune.optimize(copy.deepcopy(base))
        step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3))
        torch.manual_seed(1)   # the dropout masks: the same generator state at each first step
        losses = torch.stack([step(*batches[i % 3]) for i in range(6)]).cpu()
        st = step.stats()
        assert st["reason"] is None and st["replays"] == 5 and st["streams"] > 1, st
        assert st["stream_shapes"] == "recorded", st   # a GraphModule: its warm-up gave the plan its shapes
        runs[mode] = (losses, [b.detach().clone() for b in m.buffers()], st["conv_grads"])
    for mode in ("apart", "late", ""):
        torch.testing.assert_close(runs[mode][0], runs["together"][0], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"KITSUNE_CONV_GRADS={mode!r}: losses {runs[mode][0].tolist()} "
                                                 f"against {runs['together'][0].tolist()}: {m}")
        for a, b in zip(runs[mode][1], runs["together"][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,   # num_batches_tracked: exactly 6
                                       msg=lambda m: f"KITSUNE_CONV_GRADS={mode!r}: a buffer: {m}")
    assert runs["together"][2] is None   # no convolution to split
    assert runs["apart"][2] == {"convs": 7, "apart": True, "late": False, "how": "apart"}, runs["apart"][2]
    assert runs["late"][2] == {"convs": 7, "apart": True, "late": True, "how": "late"}, runs["late"][2]
    auto = runs[""][2]
    ms = auto["ms"]
    assert auto["convs"] == 7 and auto["how"] == "measured" and sorted(ms) == ["apart", "late", "together"], auto
    assert all(t > 0 for t in ms.values()), auto
    best = "together"   # each way kept over the one before only when 1% faster
    for way in ("apart", "late"):
        if ms[way] < 0.99 * ms[best]:
            best = way
    assert (auto["apart"], auto["late"]) == (best != "together", best == "late"), auto
    # a second batch shape is captured with the choice made: no trial again, and trials are no captures
    step(torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda"))
    st = step.stats()
    assert st["reason"] is None and st["captures"] == 2 and st["graphs"] == 2 and st["conv_grads"] == auto, st


@pytest.mark.gpu
@gpu
def test_gpu_conv_gradients_apart_under_bf16_autocast(monkeypatch):
    """Under compile_step's bf16 autocast a split convolution computes both gradients in
    bf16 from bf16 copies, as autocast's own conv does, and hands fp32 gradients to the
    fp32 weights: the step captures, and trains as with the gradients together."""
    torch.manual_seed(0)
    base = _BranchyBN().cuda()
    batches = [(torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda"))
               for _ in range(3)]
    losses = {}
    for mode in ("together", "apart", "late"):   # late: the weights autocast casts are no leaves, so joined in the node
        monkeypatch.setenv("KITSUNE_CONV_GRADS", mode)
        m = kitsune.optimize(copy.deepcopy(base))
        step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3),
                                    autocast_dtype=torch.bfloat16)
        torch.manual_seed(1)
        losses[mode] = torch.stack([step(*batches[i % 3]) for i in range(6)]).float().cpu()
        st = step.stats()
        assert st["reason"] is None and st["replays"] == 5 and st["streams"] > 1, st
        assert (st["conv_grads"] or {}).get("apart", False) == (mode != "together"), st["conv_grads"]
        assert all(p.dtype == torch.float32 for p in m.parameters())
    for mode in ("apart", "late"):   # bf16 sums in other orders
        torch.testing.assert_close(losses[mode], losses["together"], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("conv_grads", ["together", "apart", "late"])
def test_gpu_in_backward_update_of_a_streamed_net_equals_the_update_after_the_backward(monkeypatch, conv_grads):
    """A 256-channel Inception block on several streams and a 2.6M-parameter head: the
    in-backward update flushes buckets during the backward whose gradients autograd
    made on different streams (each parameter's on the stream of its forward use). The
    update waits for each of them, so 6 steps train bit for bit as with the update
    after the backward; with late weight gradients too, which its finish updates.
    (Waiting only for the stream of the hook that filled the bucket trained far apart
    from the second replay on the H100: h100_late_debug2_4d32aeb.log.)"""
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    monkeypatch.setenv("KITSUNE_CONV_GRADS", conv_grads)
    base = nn.Sequential(nn.Conv2d(8, 256, 1), InceptionBlock(256), nn.Flatten(), nn.LazyLinear(10)).cuda()
    base(torch.randn(1, 8, 16, 16, device="cuda"))
    batches = [(torch.randn(4, 8, 16, 16, device="cuda"), torch.randint(0, 10, (4,), device="cuda"))
               for _ in range(3)]
    losses, models = {}, {}
    for ib in (True, False):
        m = kitsune.optimize(copy.deepcopy(base))
        step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3),
                                    optimizer_in_backward=ib)
        losses[ib] = torch.stack([step(*batches[i % 3]) for i in range(6)]).cpu()
        models[ib] = m
        st = step.stats()
        assert st["reason"] is None and st["replays"] == 5 and st["streams"] > 1, st
        assert (st["optimizer_in_backward"] >= 1) == ib, st   # buckets flushed during the backward
        # late: the convolution weights' gradients come after the backward, to the update's finish
        assert (st["conv_grads"] or {}).get("late", False) == (conv_grads == "late"), st["conv_grads"]
    assert torch.equal(losses[True], losses[False]), (losses[True], losses[False])
    for (name, a), b in zip(models[True].named_parameters(), models[False].parameters()):
        assert torch.equal(a, b), name


class _BiasFreeBranches(nn.Module):
    """Four branches of bias-free Conv2d modules with BatchNorm (as torchvision's ResNets
    build them; kitsune.optimize leaves such convolutions as modules), two of the
    branches' convolutions sharing one weight."""
    def __init__(self, c=32):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.b1, self.b2 = nn.Conv2d(c, c, 1, bias=False), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b3, self.b4 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.Conv2d(c, c, 5, padding=2, bias=False)
        self.b3.weight = self.b2.weight
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for _ in range(4))
        self.head = nn.Linear(4 * c, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        ys = [torch.relu(bn(conv(x))) for conv, bn in zip((self.b1, self.b2, self.b3, self.b4), self.bns)]
        return self.head(torch.cat(ys, 1).mean((2, 3)))


@pytest.mark.gpu
@gpu
def test_gpu_bias_free_conv2d_modules_train_alike_with_their_weight_gradients_late(monkeypatch):
    """compile_step on a branchy net of bias-free Conv2d modules: with
    KITSUNE_CONV_GRADS=late each becomes _conv_grads_apart, the weight gradients used once join
    after the backward, the two convolutions sharing a weight hand theirs to autograd
    (a late join of each would keep one of the two), and 6 SGD-with-momentum steps
    train as with the gradients together (SGD: a gradient lost or counted twice shows
    in the update, where AdamW's normalisation would hide a factor)."""
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    base = _BiasFreeBranches().cuda()
    batches = [(torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda"))
               for _ in range(3)]
    runs = {}
    for way in ("together", "late"):
        monkeypatch.setenv("KITSUNE_CONV_GRADS", way)
        m = kitsune.optimize(copy.deepcopy(base))
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        step = kitsune.compile_step(m, nn.functional.cross_entropy, opt)
        losses = torch.stack([step(*batches[i % 3]) for i in range(6)]).cpu()
        st = step.stats()
        assert st["reason"] is None and st["replays"] == 5 and st["streams"] > 1, st
        if way == "late":
            assert st["conv_grads"]["convs"] == 5 and st["conv_grads"]["late"], st["conv_grads"]
        else:   # "together" splits nothing (conv_grads_mode)
            assert st["conv_grads"] is None, st["conv_grads"]
        runs[way] = (losses, [p.detach().clone() for p in m.parameters()])
    torch.testing.assert_close(runs["late"][0], runs["together"][0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(runs["late"][1][0], base.stem.weight)   # trained
    for a, b in zip(runs["late"][1], runs["together"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
