"""kitsune.sched.plan on CPU: a branchy block spreads over streams with the syncs its
join needs, a sequential model keeps one stream, the issue order is topological,
and bad arguments are refused with the limit named. (The C core has its own tests in
tests/c/unit/test_sched.c: validity, necessity of each sync, optimality bounds.)"""
import pytest

torch = pytest.importorskip("torch")
import kitsune.sched as ks  # noqa: E402

nn = torch.nn


def Inception():
    return ks.Inception(32)


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
