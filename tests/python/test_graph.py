"""kitsune.compile_step (whole training step as one CUDA graph) and the capturable
optimizer ops it records (adam_capturable_ / sgd_capturable_: lr and step count read
from a device tensor).

CPU: the capturable ops equal adam_ / sgd_ step for step as the lr changes; bad
calls are refused before anything changes; compile_step without CUDA runs eagerly,
says why, and trains exactly as a hand-written loop. GPU: the captured step trains
as the eager loop does (losses, parameters, optimizer state and step counts), with an
LR scheduler, gradient clipping, several batch shapes, bf16 autocast, SGD momentum;
a step that cannot be captured falls back with the reason."""
import copy
import gc
import json
import os
import subprocess
import sys
import types
import warnings
import weakref

import pytest

from support import env, gpu

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
from kitsune.optim import KitsuneOptimizer  # noqa: E402

_lib = torch.ops.kitsune


def _lists(dtype, device, gen, shapes=((37, 5), (128,), (3, 4, 5), (1,))):
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adam_capturable_equals_adam_as_lr_changes(dtype):
    g = torch.Generator().manual_seed(1)
    p = _lists(dtype, "cpu", g)
    q = [t.clone() for t in p]
    m1, v1 = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    m2, v2 = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    hyper = torch.tensor([0.0, 0.0], dtype=torch.float64)
    for step in range(1, 8):
        lr = 1e-2 / step
        grads = _lists(dtype, "cpu", g)
        hyper[0] = lr
        _lib.adam_(p, grads, m1, v1, lr, 0.9, 0.99, 1e-8, 0.1, True, float(step))
        # the step's update in two calls, the second not counting (count_step=False)
        _lib.adam_capturable_(q[:2], grads[:2], m2[:2], v2[:2], hyper, 0.9, 0.99, 1e-8, 0.1, True)
        _lib.adam_capturable_(q[2:], grads[2:], m2[2:], v2[2:], hyper, 0.9, 0.99, 1e-8, 0.1, True, False)
        assert hyper[1].item() == step   # counted by the op, once
    for a, b in zip(p + m1 + v1, q + m2 + v2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sgd_capturable_equals_sgd():
    g = torch.Generator().manual_seed(2)
    p = _lists(torch.float64, "cpu", g)
    q = [t.clone() for t in p]
    grads = _lists(torch.float64, "cpu", g)
    b1, b2 = [gr.clone() for gr in grads], [gr.clone() for gr in grads]   # buffers after a first step
    for lr in (0.1, 0.05, 0.2):
        _lib.sgd_(p, grads, b1, lr, 0.9, 0.1, 1e-2, False, False)
        _lib.sgd_capturable_(q, grads, b2, torch.tensor([lr], dtype=torch.float64), 0.9, 0.1, 1e-2, False)
    for a, b in zip(p + b1, q + b2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_capturable_ops_refuse_bad_hyper_before_changing_anything():
    p = [torch.ones(4)]
    grads, m, v = [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)]
    for bad, got in [(torch.zeros(2), r"Float \[2\]"), (torch.zeros(3, dtype=torch.float64), r"Double \[3\]")]:
        with pytest.raises(RuntimeError, match=f"hyper must be a contiguous float64 tensor of 2 elements on cpu; got {got}"):
            _lib.adam_capturable_(p, grads, m, v, bad, 0.9, 0.99, 1e-8, 0.0, False)
    hyper = torch.tensor([0.1, 0.0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"betas in \[0, 1\)"):
        _lib.adam_capturable_(p, grads, m, v, hyper, 1.5, 0.99, 1e-8, 0.0, False)
    assert hyper[1].item() == 0 and torch.equal(p[0], torch.ones(4))   # nothing counted, nothing updated
    with pytest.raises(RuntimeError, match="hyper must be a contiguous float64 tensor of 1 elements"):
        _lib.sgd_capturable_(p, grads, [], torch.zeros(2, dtype=torch.float64), 0.0, 0.0, 0.0, False)


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_capturable_ops_skip_the_update_where_found_inf_is_set(found):
    """found_inf (torch.amp's inf check, read when the update runs): 0 updates as the op
    does without it; 1 leaves parameters, states and Adam's step count as they were, as
    GradScaler skips optimizer.step() after inf or NaN gradients."""
    g = torch.Generator().manual_seed(4)
    p0, grads = _lists(torch.float32, "cpu", g), _lists(torch.float32, "cpu", g)
    m0, v0 = [t.abs() for t in _lists(torch.float32, "cpu", g)], [t.abs() for t in _lists(torch.float32, "cpu", g)]
    ref = [[t.clone() for t in ts] for ts in (p0, m0, v0)]
    got = [[t.clone() for t in ts] for ts in (p0, m0, v0)]
    h_ref, h_got = torch.tensor([1e-2, 2.0], dtype=torch.float64), torch.tensor([1e-2, 2.0], dtype=torch.float64)
    _lib.adam_capturable_(*ref[:1], grads, *ref[1:], h_ref, 0.9, 0.99, 1e-8, 0.1, True)
    _lib.adam_capturable_(*got[:1], grads, *got[1:], h_got, 0.9, 0.99, 1e-8, 0.1, True, found_inf=torch.tensor([found]))
    want, count = ((p0, m0, v0), 2.0) if found else (ref, 3.0)
    for a, b in zip(sum(map(list, got), []), sum(map(list, want), [])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert h_got[1].item() == count
    if not found:
        assert not torch.equal(got[0][0], p0[0])   # it did update
    q, bufs = [t.clone() for t in p0], [t.clone() for t in grads]
    q_ref, bufs_ref = [t.clone() for t in p0], [t.clone() for t in grads]
    _lib.sgd_capturable_(q_ref, grads, bufs_ref, torch.tensor([0.1], dtype=torch.float64), 0.9, 0.0, 0.0, False)
    _lib.sgd_capturable_(q, grads, bufs, torch.tensor([0.1], dtype=torch.float64), 0.9, 0.0, 0.0, False,
                         found_inf=torch.tensor([found]))
    for a, b in zip(q + bufs, (p0 + grads) if found else (q_ref + bufs_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_capturable_ops_refuse_a_bad_found_inf_before_changing_anything():
    p, grads, m, v = [torch.ones(4)], [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)]
    hyper = torch.tensor([0.1, 0.0], dtype=torch.float64)
    for bad, got in [(torch.zeros(1, dtype=torch.float64), r"Double \[1\]"), (torch.zeros(2), r"Float \[2\]")]:
        with pytest.raises(RuntimeError, match=f"found_inf must be a one-element float32 tensor on cpu; got {got}"):
            _lib.adam_capturable_(p, grads, m, v, hyper, 0.9, 0.99, 1e-8, 0.0, False, found_inf=bad)
        with pytest.raises(RuntimeError, match="found_inf must be a one-element float32 tensor"):
            _lib.sgd_capturable_(p, grads, [], hyper[:1], 0.0, 0.0, 0.0, False, found_inf=bad)
    assert hyper[1].item() == 0 and torch.equal(p[0], torch.ones(4))   # nothing counted, nothing updated


def test_the_in_backward_update_takes_no_parameter_whose_gradient_is_none():
    """Autograd runs a post-accumulate-grad hook for a None gradient too (a Function that
    returns None for a weight): the in-backward update leaves such a parameter out, as
    capture_step does, instead of handing the fused kernel a missing gradient."""
    from kitsune.optim import _InBackward

    class NoWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, g):
            return g.clone(), None
    a, w = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = KitsuneOptimizer(torch.optim.AdamW, [a, w], lr=0.1)
    ib = _InBackward(opt, [[a, w]], stream=None, buckets=6)   # small: nothing flushes, so no stream is used
    try:
        NoWeightGrad.apply(a * 2, w).sum().backward()
        assert w.grad is None and a.grad is not None
        assert [p is a for p in ib.pending] == [True], ib.pending
    finally:
        ib.close()


def test_loss_scaled_replays_settle_the_host_step_counts_from_the_device():
    """A replay of a loss-scaled plan (capture_amp_step) cannot tell the host whether the
    update was skipped: replayed() counts it as taken, and the next state_dict (or
    state, get_stats, step, capture) puts torch.optim's step counts, the optimizer's
    counters and the device mirror right from the device's step count and its count of
    skipped replays, with no sync when nothing needs settling. Here three replays, one
    of them skipped on the "device" (CPU tensors stand in for it)."""
    from kitsune.optim import _CapturePlan
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = KitsuneOptimizer(torch.optim.AdamW, [a, b], lr=0.1, enable_amp=True)
    opt.scale(a.sum() + b.sum()).backward()
    opt.step()   # eager: makes the state, step counts 1 (no inf)
    opt.prepare_capture("cpu")
    states = [opt.optimizer.state[p] for p in (a, b)]
    plan = _CapturePlan()
    plan.groups, plan.states, plan.group_states, plan.amp = [(0, states[0])], states, {0: states}, True
    assert opt.sync_hyper(plan)   # device row: lr, count 1
    for skipped in (False, True, False):   # what the graph would do on the device
        opt._hyper[0, 1] += 0 if skipped else 1
        opt._amp_skips += 1 if skipped else 0
        opt.replayed(plan)
    assert [float(st["step"]) for st in opt.optimizer.state.values()] == [4.0, 4.0]   # counted as taken, unsettled
    sd = opt.state_dict()
    assert [sd["state"][i]["step"].item() for i in (0, 1)] == [3.0, 3.0]
    st = opt.get_stats()
    assert st["skipped_steps"] == 1 and st["steps"] == 3 and st["fused_steps"] == 3, st
    assert opt._hyper_mirror[0] == (0.1, 3.0) and opt._unsettled == {}
    opt._amp_skips += 5   # nothing replayed since: nothing read
    assert opt.get_stats()["skipped_steps"] == 1


def test_capture_step_refuses_cpu_parameters():
    w = torch.nn.Parameter(torch.ones(3))
    opt = KitsuneOptimizer(torch.optim.AdamW, [w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    with pytest.raises(RuntimeError, match="cannot be captured: the parameters must be on one CUDA device"):
        opt.capture_step()
    amsgrad = KitsuneOptimizer(torch.optim.Adam, [w], lr=0.1, amsgrad=True)
    with pytest.raises(RuntimeError, match="cannot be captured: amsgrad=True is not fused"):
        amsgrad.capture_step()


def test_replays_count_steps_through_one_tensor():
    """After a capture, a replay moves torch.optim's CPU step counts on with one add
    over views of one tensor (kitsune.optim._StepCounts): every counted parameter by
    one, one left out of the plan (no gradient at capture) by none; torch.optim's own
    step, the fused eager step and state_dict still see and move the same counts; a
    later capture that binds anew (a new group's state) leaves the older plan counting
    right through its state dicts. The capture itself needs CUDA; its plan is built
    here as capture_step builds it."""
    from kitsune.optim import _CapturePlan
    ws = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    opt = KitsuneOptimizer(torch.optim.AdamW, ws, lr=0.1)
    for w in ws:
        w.grad = torch.ones(3)
    opt.step()
    st = [opt.state[w] for w in ws]

    def plan_of(states):
        plan = _CapturePlan()
        plan.states, plan.groups = list(states), [(0, states[0])]
        opt._bind_steps(plan)
        return plan

    a = plan_of(st[:2])   # ws[2] had no gradient at this capture
    assert a.counts is not None and all(s["step"]._base is a.counts.base for s in st)
    for _ in range(4):
        opt.replayed(a)
    assert [float(s["step"]) for s in st] == [5.0, 5.0, 1.0]
    opt.step()   # the fused eager step counts through the views
    opt.optimizer.step()   # torch.optim's own
    assert [float(s["step"]) for s in st] == [7.0, 7.0, 3.0]
    assert [float(v["step"]) for v in opt.state_dict()["state"].values()] == [7.0, 7.0, 3.0]
    b = plan_of(st)   # every count already bound: the same tensor
    assert b.counts is a.counts
    opt.replayed(b)
    assert [float(s["step"]) for s in st] == [8.0, 8.0, 4.0]
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones(2)
    opt.step()
    c = plan_of([opt.state[extra]])   # a new state: bound anew, a's tensor is no longer theirs
    assert c.counts is not a.counts and all(s["step"]._base is c.counts.base for s in st)
    opt.replayed(a)
    opt.replayed(c)
    assert [float(s["step"]) for s in st] == [10.0, 10.0, 5.0] and float(opt.state[extra]["step"]) == 2.0


def _mlp(seed, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 5)).to(device, dtype)


def _batches(n, device, sizes=(16,), seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = sizes[i % len(sizes)]
        out.append((torch.randn(b, 20, generator=g).to(device), torch.randint(0, 5, (b,), generator=g).to(device)))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_compile_step_without_cuda_runs_eagerly_and_says_why():
    m1, m2 = _mlp(0), _mlp(0)
    o1 = KitsuneOptimizer(torch.optim.AdamW, m1.parameters(), lr=1e-2)
    o2 = KitsuneOptimizer(torch.optim.AdamW, m2.parameters(), lr=1e-2)
    step = kitsune.compile_step(m1, torch.nn.functional.cross_entropy, o1)
    with pytest.warns(UserWarning, match="running eagerly: CUDA is not available"):
        first = step(*_batches(1, "cpu")[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once
        losses = [first] + [step(x, y) for x, y in _batches(6, "cpu")[1:]]
    want = []
    for x, y in _batches(6, "cpu"):
        o2.zero_grad()
        loss = torch.nn.functional.cross_entropy(m2(x), y)
        loss.backward()
        o2.step()
        want.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=0, atol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    st = step.stats()
    assert st["reason"] == "CUDA is not available" and st["eager_steps"] == 6 and st["replays"] == 0
    assert st["setup_s"] == 0 and st["setup_phases"] == dict.fromkeys(("warm_up", "streams", "conv_grads", "capture"),
                                                                     0.0), st   # nothing was set up
    assert st["capture_parts"] == dict.fromkeys(("record", "plan", "place"), 0.0), st
    # the loss ran in a FusedLoss mode, which leaves CPU calls alone and says so
    assert st["fused_loss"] == 0 and st["fused_loss_left"] == ["cross_entropy on cpu (fused on cuda)"], st


def test_compile_step_bad_arguments():
    m = _mlp(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kitsune.compile_step(lambda x: x, None, opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or KitsuneOptimizer"):
        kitsune.compile_step(m, None, object())
    with pytest.raises(ValueError, match="max_shapes must be an int >= 1, got 0"):
        kitsune.compile_step(m, None, opt, max_shapes=0)
    with pytest.raises(ValueError, match="autocast_dtype must be None"):
        kitsune.compile_step(m, None, opt, autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="max_grad_norm must be None or > 0, got -1"):
        kitsune.compile_step(m, None, opt, max_grad_norm=-1)
    with pytest.raises(ValueError, match="fuse_loss must be True or False, got 1"):
        kitsune.compile_step(m, None, opt, fuse_loss=1)
    with pytest.raises(ValueError, match="optimizer_in_backward must be True or False, got None"):
        kitsune.compile_step(m, None, opt, optimizer_in_backward=None)
    step = kitsune.compile_step(m, torch.nn.functional.cross_entropy, opt)
    with pytest.raises(TypeError, match="takes the model's inputs and then the target; got 1"):
        step(torch.randn(2, 20))
    with pytest.raises(TypeError, match="batch item 2 .list. is neither a tensor nor hashable"):
        kitsune.graph.step._signature((torch.ones(1), 3, [1]))


# ---- GPU ---------------------------------------------------------------------------
def _eager_reference(model, opt, batches, loss_fn, sched=None, clip=None, amp=None):
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None, cache_enabled=False):
            out = model(*batch[:-1])
            with kitsune.fx.FusedLoss():   # the loss as compile_step runs it (fuse_loss=True)
                loss = loss_fn(out, batch[-1])
        scaled = getattr(opt, "enable_amp", False)   # KitsuneOptimizer(enable_amp=True): its GradScaler's loop
        (opt.scale(loss) if scaled else loss).backward()
        if clip is not None:
            if scaled:
                opt.unscale_()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip, foreach=True)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _compiled(model, opt, batches, loss_fn, sched=None, **kw):
    step = kitsune.compile_step(model, loss_fn, opt, **kw)
    losses = []
    for batch in batches:
        losses.append(step(*batch).float())
        if sched is not None:
            sched.step()
    return torch.stack(losses), step


def _twins(model, cls=torch.optim.AdamW, **kw):
    """model and a copy of it, each with its own KitsuneOptimizer(cls, **kw)."""
    other = copy.deepcopy(model)
    return model, KitsuneOptimizer(cls, model.parameters(), **kw), other, KitsuneOptimizer(cls, other.parameters(), **kw)


def _assert_same_training(m1, o1, m2, o2, l1, l2, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(l1, l2, rtol=rtol, atol=atol)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    sd1, sd2 = o1.state_dict()["state"], o2.state_dict()["state"]
    for k in sd1:
        for name, v in sd1[k].items():
            torch.testing.assert_close(v, sd2[k][name], rtol=rtol, atol=atol, msg=f"state {k} {name}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1)),
                                    (torch.optim.Adam, dict(lr=3e-3)),
                                    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True))],
                         ids=["adamw", "adam", "sgd_nesterov"])
def test_gpu_compile_step_trains_as_eager_with_lr_schedule(cls, kw):
    """40 steps, the LR decaying every step: losses, parameters, optimizer state and
    step counts equal the eager loop's; 39 of the 40 steps were replays."""
    m1, o1, m2, o2 = _twins(_mlp(0, "cuda"), cls, **kw)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1.optimizer, lambda i: 0.95 ** i)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2.optimizer, lambda i: 0.95 ** i)
    batches = _batches(40, "cuda")
    ce = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, ce, s1)
    got, step = _compiled(m2, o2, batches, ce, s2)
    _assert_same_training(m1, o1, m2, o2, want, got)
    st = step.stats()
    assert st["replays"] == 39 and st["captures"] == 1 and st["reason"] is None, st
    assert all(p.grad is None for p in m2.parameters())
    # the phases are parts of setup_s: a warm-up and a capture ran; an MLP has no convolution to try
    ph = st["setup_phases"]
    assert ph["warm_up"] > 0 and ph["capture"] > 0 and ph["conv_grads"] < ph["capture"], ph
    assert sum(ph.values()) <= st["setup_s"], (ph, st["setup_s"])
    assert o2.get_stats()["path"].startswith("fused, in a CUDA graph")


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_shapes_clipping_and_eviction():
    """Three batch sizes in turn with max_shapes=2 (so graphs are dropped and captured
    again) and gradient clipping: the same training as eager."""
    m1, o1, m2, o2 = _twins(_mlp(1, "cuda"), lr=1e-2)
    batches = _batches(30, "cuda", sizes=(8, 8, 16, 16, 8, 32))
    ce = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, ce, clip=0.5)
    got, step = _compiled(m2, o2, batches, ce, max_shapes=2, max_grad_norm=0.5)
    _assert_same_training(m1, o1, m2, o2, want, got)
    st = step.stats()
    assert st["graphs"] == 2 and st["evictions"] >= 1 and st["eager_steps"] == st["captures"], st
    assert st["replays"] + st["eager_steps"] == 30


class _TiedDeep(torch.nn.Module):
    """Twelve 512 x 512 layers (3.2M parameters: several of capture_in_backward's
    buckets of 1M elements) between an embedding and a head that share one weight."""
    def __init__(self, vocab=1000, d=512):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU())
                                            for _ in range(12)])
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, idx):
        return self.norm(self.layers(self.emb(idx))) @ self.emb.weight.t()


class _TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(20, 32)
        self.b = torch.nn.Linear(32, 10).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("in_backward", [True, False])
def test_gpu_compile_step_counts_a_mixed_dtype_groups_step_once(in_backward):
    """One AdamW group of fp32 and bf16 parameters (a launch per dtype): the captured
    step moves the group's device step count once, so 20 steps train as eager."""
    torch.manual_seed(4)
    m1, o1, m2, o2 = _twins(_TwoDtypes().cuda(), lr=1e-2)
    batches = _batches(20, "cuda")
    ce = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, ce)
    got, step = _compiled(m2, o2, batches, ce, optimizer_in_backward=in_backward)
    assert step.stats()["replays"] == 19
    _assert_same_training(m1, o1, m2, o2, want, got, rtol=1e-2, atol=1e-3)   # bf16 parameters


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))], ids=["adamw", "sgd"])
def test_gpu_optimizer_update_inside_the_backward_trains_as_eager(cls, kw):
    """compile_step's default: each bucket of parameters is updated during the captured
    backward, once its gradients are final (a tied embedding / head weight's only after
    both uses). 12 steps under an LR schedule equal the eager loop's and the capture
    with the update after the backward (optimizer_in_backward=False) bit for bit."""
    torch.manual_seed(9)
    base = _TiedDeep().cuda()
    m1, o1, m2, o2 = _twins(base, cls, **kw)
    m3 = copy.deepcopy(base)
    o3 = KitsuneOptimizer(cls, m3.parameters(), **kw)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o.optimizer, lambda i: 0.9 ** i) for o in (o1, o2, o3)]
    g = torch.Generator().manual_seed(10)
    batches = []
    for _ in range(12):
        t = torch.randint(0, 1000, (8, 33), generator=g).cuda()
        batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))

    def lm_loss(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))

    want = _eager_reference(m1, o1, batches, lm_loss, scheds[0])
    got, step = _compiled(m2, o2, batches, lm_loss, scheds[1])
    after, step_after = _compiled(m3, o3, batches, lm_loss, scheds[2], optimizer_in_backward=False)
    st = step.stats()
    assert st["reason"] is None and st["replays"] == 11 and st["optimizer_in_backward"] >= 2, st
    assert step_after.stats()["optimizer_in_backward"] == 0
    _assert_same_training(m1, o1, m2, o2, want, got)
    assert torch.equal(got, after)
    for a, b in zip(m2.parameters(), m3.parameters()):
        assert torch.equal(a, b)
    sd2, sd3 = o2.state_dict()["state"], o3.state_dict()["state"]
    for k in sd2:
        for name, v in sd2[k].items():
            assert torch.equal(v, sd3[k][name]), (k, name)


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=96, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.block(self.emb(idx)))


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_bf16_autocast_lm():
    torch.manual_seed(5)
    m1, o1, m2, o2 = _twins(_TinyLM().cuda(), lr=1e-3)
    g = torch.Generator().manual_seed(6)
    batches = []
    for _ in range(20):
        t = torch.randint(0, 96, (4, 33), generator=g).cuda()
        batches.append((t[:, :-1], t[:, 1:]))

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    want = _eager_reference(m1, o1, batches, lm_loss, amp=torch.bfloat16)
    got, step = _compiled(m2, o2, batches, lm_loss, autocast_dtype=torch.bfloat16)
    assert step.stats()["replays"] == 19
    _assert_same_training(m1, o1, m2, o2, want, got, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_fuses_the_loss_functions_cross_entropy():
    """fuse_loss (default): the LM loss's F.cross_entropy runs as kitsune.cross_entropy
    (ignored targets included), and 20 steps train as the eager loop with plain
    F.cross_entropy does, within fp32 rounding; fuse_loss=False leaves it. (The other
    GPU tests' eager loops run the loss in FusedLoss too, to compare the capture
    alone. An attention block would not do here: its key bias has a zero gradient in
    exact arithmetic, and Adam turns two implementations' rounding noise there into
    full-size steps that differ.)"""
    torch.manual_seed(7)
    nn = torch.nn
    lm = nn.Sequential(nn.Embedding(96, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 96)).cuda()
    m1, o1, m2, o2 = _twins(lm, lr=1e-3)
    m3 = copy.deepcopy(m1)
    o3 = KitsuneOptimizer(torch.optim.AdamW, m3.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(8)
    batches = []
    for _ in range(20):
        t = torch.randint(0, 96, (4, 33), generator=g).cuda()
        y = t[:, 1:].clone()
        y[:, :3] = -100   # a prompt: not trained on
        batches.append((t[:, :-1], y))

    def lm_loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1))

    want = []
    for x, y in batches:   # plain F.cross_entropy
        o1.zero_grad(set_to_none=True)
        loss = lm_loss(m1(x), y)
        loss.backward()
        o1.step()
        want.append(loss.detach())
    got, step = _compiled(m2, o2, batches, lm_loss)
    st = step.stats()
    assert st["replays"] == 19 and st["fused_loss"] == 1 and st["fused_loss_left"] == [], st
    _assert_same_training(m1, o1, m2, o2, torch.stack(want), got, rtol=1e-4, atol=1e-5)
    _, plain = _compiled(m3, o3, batches[:2], lm_loss, fuse_loss=False)
    assert plain.stats()["fused_loss"] == 0 and plain.stats()["fused_loss_left"] == []


class _Syncs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(20, 5)

    def forward(self, x):
        if x.abs().max().item() > 1e9:   # a host sync: cannot be captured
            raise AssertionError
        return self.fc(x)


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_falls_back_with_the_reason():
    torch.manual_seed(0)
    m1, o1, m2, o2 = _twins(_Syncs().cuda(), lr=1e-2)
    batches = _batches(5, "cuda")
    ce = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, ce)
    with pytest.warns(UserWarning, match="running eagerly: the step could not be captured"):
        got, step = _compiled(m2, o2, batches, ce)
    _assert_same_training(m1, o1, m2, o2, want, got)
    st = step.stats()
    assert st["replays"] == 0 and st["eager_steps"] == 5 and "could not be captured" in st["reason"], st
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)   # the failed capture left the generator usable
    m3 = _mlp(0, "cuda")
    step2 = kitsune.compile_step(m3, ce, torch.optim.SGD(m3.parameters(), lr=0.1))
    x, y = _batches(1, "cpu")[0]
    before = [p.detach().clone() for p in m3.parameters()]
    with pytest.raises(ValueError, match="batch item 0 is on cpu, the model on cuda:0"):
        step2(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, m3.parameters()))   # nothing stepped
    assert step2.stats()["reason"] is None   # a bad batch is the caller's error, not a reason to stop capturing


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_captures_models_with_fused_dropout():
    """kitsune.optimize's dropout rewrites (gelu_dropout here) run ATen's dropout while a
    graph is captured, so the step is captured, and each replay draws a new mask from
    the generator's graph state (lr 0: the parameters stay, only the masks change)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(256, 5))
    rep = kitsune.fx.Report()
    km = kitsune.optimize(m, report=rep).cuda()
    assert any("gelu_dropout" in what for _, what in rep.fused), rep
    step = kitsune.compile_step(km, torch.nn.functional.cross_entropy,
                                KitsuneOptimizer(torch.optim.AdamW, km.parameters(), lr=0.0))
    x, y = _batches(1, "cuda", sizes=(64,))[0]
    losses = torch.stack([step(x, y) for _ in range(6)])
    st = step.stats()
    assert st["replays"] == 5 and st["reason"] is None, st
    assert torch.isfinite(losses).all() and len(set(losses[1:].tolist())) > 1, losses


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_follows_load_state_dict_and_baked_hyperparameters():
    """A graph bakes in betas and weight decay and holds the optimizer's state tensors:
    changing the former and loading a state_dict (which replaces the latter) make the
    next step capture again, and training stays equal to eager's."""
    m1, o1, m2, o2 = _twins(_mlp(2, "cuda"), lr=1e-2, weight_decay=0.1)
    ce = torch.nn.functional.cross_entropy
    step = kitsune.compile_step(m2, ce, o2)

    def eager(x, y):
        o1.zero_grad(set_to_none=True)
        with kitsune.fx.FusedLoss():
            loss = ce(m1(x), y)
        loss.backward()
        o1.step()
        return loss.detach()

    l1, l2, snaps = [], [], None
    for i, (x, y) in enumerate(_batches(30, "cuda")):
        if i == 5:
            snaps = [copy.deepcopy(v.state_dict()) for v in (o1, m1, o2, m2)]
        if i == 10:
            for o in (o1, o2):
                o.param_groups[0]["weight_decay"], o.param_groups[0]["betas"] = 0.3, (0.8, 0.99)
        if i == 20:
            for v, sd in zip((o1, m1, o2, m2), snaps):
                v.load_state_dict(sd)
        l1.append(eager(x, y))
        l2.append(step(x, y))
    _assert_same_training(m1, o1, m2, o2, torch.stack(l1), torch.stack(l2))
    st = step.stats()
    assert st["recaptures"] == 2 and st["captures"] == 3 and st["replays"] == 27, st


def test_compile_step_with_enable_amp_scales_and_runs_eagerly():
    """With KitsuneOptimizer(enable_amp=True) the step scales the loss, unscales before
    clipping, and runs eagerly (on a GPU the reason is the scaler's host-side inf check;
    here there is no CUDA): the same training as the hand-written GradScaler loop."""
    m1, o1, m2, o2 = _twins(_mlp(4), lr=1e-2, enable_amp=True, amp_options={"init_scale": 256.0})
    step = kitsune.compile_step(m2, torch.nn.functional.cross_entropy, o2, max_grad_norm=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.stack([step(x, y) for x, y in _batches(6, "cpu")])
    want = []
    for x, y in _batches(6, "cpu"):
        o1.zero_grad()
        loss = torch.nn.functional.cross_entropy(m1(x), y)
        o1.scale(loss).backward()
        o1.unscale_()
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.5, foreach=True)
        o1.step()
        want.append(loss.detach())
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert o2.get_stats()["loss_scale"] == o1.get_stats()["loss_scale"] == 256.0   # growth_interval 2000


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls,kw,clip", [(torch.optim.AdamW, {"lr": 1e-3}, None), (torch.optim.AdamW, {"lr": 1e-3}, 1.0),
                                         (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, None)])
def test_gpu_compile_step_fp16_loss_scaling_trains_as_eager_grad_scaler(cls, kw, clip):
    """fp16 autocast with KitsuneOptimizer(enable_amp=True), the whole scaled step in the
    graph. An initial scale of 2**24 overflows fp16 gradients, so the first steps are
    skipped (the warm-up's included: the capture waits for a first update) and the scale
    halves each time; growth_interval=3 doubles it after 3 good steps, into overflow
    again. 24 steps train as the eager loop with GradScaler: losses, parameters,
    optimizer state and step counts (settled from the device), the scale, and the
    skipped steps, which must be some but not all."""
    nn = torch.nn
    torch.manual_seed(9)
    base = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 5)).cuda()
    amp = {"init_scale": 2.0 ** 24, "growth_interval": 3}
    m1, m2 = base, copy.deepcopy(base)
    o1 = KitsuneOptimizer(cls, m1.parameters(), enable_amp=True, amp_options=amp, **kw)
    o2 = KitsuneOptimizer(cls, m2.parameters(), enable_amp=True, amp_options=amp, **kw)
    batches = _batches(24, "cuda", seed=10)
    loss_fn = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, loss_fn, clip=clip, amp=torch.float16)
    got, step = _compiled(m2, o2, batches, loss_fn, autocast_dtype=torch.float16, max_grad_norm=clip)
    st = step.stats()
    assert st["reason"] is None and st["captures"] == 1 and st["replays"] >= 12, st
    s1, s2 = o1.get_stats(), o2.get_stats()
    assert 0 < s1["skipped_steps"] < 24 and s2["skipped_steps"] == s1["skipped_steps"], (s1, s2)
    assert s2["steps"] == s1["steps"] == 24 - s1["skipped_steps"], (s1, s2)
    assert s2["loss_scale"] == s1["loss_scale"], (s1, s2)
    _assert_same_training(m1, o1, m2, o2, want, got, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_a_failed_loss_scaled_capture_leaves_the_scaler_as_eager_steps_need_it(monkeypatch):
    """A capture that fails after the scaler's unscale_ (here: the optimizer step refuses)
    drops the scaler's record of that step, so the eager steps after the fallback check
    their own gradients: they train as the eager loop does."""
    nn = torch.nn
    torch.manual_seed(11)
    base = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5)).cuda()
    m1, m2 = base, copy.deepcopy(base)
    o1 = KitsuneOptimizer(torch.optim.AdamW, m1.parameters(), lr=1e-3, enable_amp=True)
    o2 = KitsuneOptimizer(torch.optim.AdamW, m2.parameters(), lr=1e-3, enable_amp=True)

    def refuse(*a, **k):
        raise RuntimeError("the optimizer step cannot be captured: refused by the test")
    monkeypatch.setattr(o2, "capture_step", refuse)
    batches = _batches(6, "cuda", seed=12)
    want = _eager_reference(m1, o1, batches, torch.nn.functional.cross_entropy, clip=1.0, amp=torch.float16)
    with pytest.warns(UserWarning, match="refused by the test"):
        got, step = _compiled(m2, o2, batches, torch.nn.functional.cross_entropy, autocast_dtype=torch.float16,
                              max_grad_norm=1.0)
    assert step.stats()["eager_steps"] == 6
    _assert_same_training(m1, o1, m2, o2, want, got, rtol=1e-5, atol=1e-6)


class _ConvBN(torch.nn.Module):
    """Conv + BatchNorm + ReLU (kitsune.optimize makes it batch_norm_relu), then a head;
    view_head=True flattens with .view, which channels-last activations refuse."""

    def __init__(self, view_head=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False)   # a bias before BN has no gradient
                                                                         # but rounding, which Adam would amplify
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)
        self.view_head = view_head

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.view(h.shape[0], -1) if self.view_head else h.flatten(1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("view_head", [False, True], ids=["flatten", "view"])
def test_gpu_compile_step_channels_last_trains_as_eager(view_head):
    """A conv net is captured on channels-last input (batch_norm_relu runs NHWC rows):
    losses, parameters and optimizer state follow the eager NCHW loop. A .view head
    refuses channels-last: the warm-up finds it and the step is captured NCHW. The
    convolutions run in fp32, not TF32 (the NCHW and NHWC algorithms round TF32 apart:
    0.0006 in a loss with 8 input channels, H100, bench/results/archive/h100_pytest_graph_cd46713.log)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, 8, 8, generator=gen).cuda(), torch.randint(0, 10, (8,), generator=gen).cuda())
               for _ in range(12)]
    base = kitsune.optimize(_ConvBN(view_head).cuda())
    m1, o1, m2, o2 = _twins(base, torch.optim.AdamW, lr=1e-3)
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        l1 = _eager_reference(m1, o1, batches, torch.nn.functional.cross_entropy)
        l2, step = _compiled(m2, o2, batches, torch.nn.functional.cross_entropy)
    st = step.stats()
    assert st["reason"] is None and st["replays"] == 11, st
    assert st["channels_last"] is (not view_head), st
    if view_head:
        assert "refused channels-last" in st["channels_last_reason"], st
    _assert_same_training(m1, o1, m2, o2, l1, l2, rtol=1e-4, atol=1e-5)
    for a, b in zip(m1.buffers(), m2.buffers()):   # running stats: a refused try left no trace
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the weight follows the activations' layout (put back NCHW when they were refused)
    w = m2.conv.weight
    fmt = torch.contiguous_format if view_head else torch.channels_last
    assert w.is_contiguous(memory_format=fmt) and o2.state[w]["exp_avg"].is_contiguous(memory_format=fmt)
    assert ("1 Conv2d weight(s) made channels-last" in st["channels_last_reason"]) is (not view_head), st


class _TwoConvs(torch.nn.Module):
    """A 3 x 3 convolution, then one 1 x 1 convolution applied twice (one weight)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1), torch.nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(self.b(torch.relu(self.b(self.a(x)))).flatten(1))


def test_relayout_moves_conv_weights_with_their_gradients_and_state():
    """compile_step's channels-last weights: each Conv2d weight (a shared one once) is laid
    out again in place, values unchanged, with its gradient and its optimizer state;
    other parameters and the step count stay as they were; moving back restores NCHW."""
    from kitsune.graph.layout import _conv_weights, _relayout
    torch.manual_seed(3)
    m = _TwoConvs()
    opt = KitsuneOptimizer(torch.optim.AdamW, m.parameters(), lr=1e-2)
    for _ in range(2):   # the second backward leaves gradients beside the first step's state
        m(torch.randn(2, 3, 6, 6)).square().sum().backward()
        if not opt.state:
            opt.step()
    weights = _conv_weights(m)
    assert weights == [m.a.weight, m.b.weight]
    before = [(p, p.detach().clone(), p.grad.clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for p in m.parameters()]
    moved = _relayout(weights, opt, torch.channels_last)
    assert moved == [m.a.weight]   # a 1 x 1 kernel is channels-last contiguous already
    assert _relayout(weights, opt, torch.channels_last) == []
    for p, value, grad, state in before:
        torch.testing.assert_close(p, value, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)
        for k, v in state.items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0)
        nchw = p is not m.a.weight
        assert p.is_contiguous() is nchw and p.grad.is_contiguous() is nchw, p.shape
        assert opt.state[p]["exp_avg"].is_contiguous() is nchw and opt.state[p]["exp_avg_sq"].is_contiguous() is nchw
    assert m.a.weight.is_contiguous(memory_format=torch.channels_last)
    opt.step()   # the fused step runs on the moved tensors
    assert opt.get_stats()["fused_steps"] == 2, opt.get_stats()
    assert _relayout(moved, opt, torch.contiguous_format) == moved and m.a.weight.is_contiguous()


def test_channels_last_is_chosen_where_most_convolutions_have_8_aligned_channels():
    """channels_last=None: channels-last where at least half the Conv2d layers have in and
    out channels (per group) that are multiples of 8; LeNet-5's 1 -> 6 -> 16 stays NCHW."""
    from kitsune.graph.layout import _nhwc_suits
    nn = torch.nn
    lenet = nn.Sequential(nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5))
    resnet_like = nn.Sequential(nn.Conv2d(3, 64, 7), nn.Conv2d(64, 64, 3), nn.Conv2d(64, 128, 3))
    half = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 32, 3))
    grouped = nn.Sequential(nn.Conv2d(48, 48, 3, groups=6), nn.Conv2d(48, 48, 3, groups=3))   # 8 and 16 a group
    odd_groups = nn.Sequential(nn.Conv2d(48, 48, 3, groups=48))   # one channel a group
    assert _nhwc_suits(lenet) == (False, "0 of 2 Conv2d layers have channel counts that are multiples of 8")
    assert _nhwc_suits(resnet_like) == (True, "2 of 3 Conv2d layers have channel counts that are multiples of 8")
    assert _nhwc_suits(half)[0] and _nhwc_suits(grouped)[0] and not _nhwc_suits(odd_groups)[0]
    assert _nhwc_suits(nn.Linear(4, 4)) == (False, "no Conv2d layer")
    for model, forced, want in ((lenet, None, False), (resnet_like, None, True), (lenet, True, True),
                                (resnet_like, False, False)):
        step = kitsune.compile_step(model, torch.nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1), channels_last=forced)
        st = step.stats()
        assert st["channels_last"] is want, st
        assert st["channels_last_reason"] == (_nhwc_suits(model)[1] if forced is None else
                                              "asked" if forced else "off"), st


def test_weights_are_not_moved_under_another_compile_steps_graphs():
    """A compile_step whose graphs hold a model's weights keeps a second compile_step of
    that model from moving them (the graphs would write the old storage); a step with
    no graphs left, or the same step, does not count."""
    from kitsune.graph.layout import _CAPTURED, _graphs_elsewhere
    m = torch.nn.Conv2d(8, 8, 3)
    first, second = (kitsune.compile_step(m, None, torch.optim.SGD(m.parameters(), lr=0.1)) for _ in range(2))
    assert _graphs_elsewhere(second) == 0
    _CAPTURED.setdefault(m, weakref.WeakSet()).add(first)
    first._graphs["signature"] = object()   # what a capture leaves
    assert _graphs_elsewhere(second) == 1 and _graphs_elsewhere(first) == 0
    first._graphs.clear()
    assert _graphs_elsewhere(second) == 0
    first._graphs["signature"] = object()
    del first
    gc.collect()
    assert _graphs_elsewhere(second) == 0   # a dropped compile_step holds nothing


@pytest.mark.gpu
@gpu
def test_gpu_a_second_compile_step_leaves_the_first_ones_weights_alone():
    """A model captured NCHW by one compile_step, then by a channels-last one: the
    second keeps the weights where the first's graph holds them, says so, and both
    steps go on training the same parameters as an eager loop would."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, 8, 8, generator=gen).cuda(), torch.randint(0, 10, (8,), generator=gen).cuda())
               for _ in range(8)]
    base = kitsune.optimize(_ConvBN().cuda())
    m1, o1, m2, o2 = _twins(base, torch.optim.AdamW, lr=1e-3)
    ce = torch.nn.functional.cross_entropy
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        l1 = _eager_reference(m1, o1, batches, ce)
        nchw = kitsune.compile_step(m2, ce, o2, channels_last=False)
        cl = kitsune.compile_step(m2, ce, o2)
        l2 = torch.stack([(nchw if i % 2 == 0 else cl)(*batches[i]) for i in range(8)])
    for st in (nchw.stats(), cl.stats()):
        assert st["reason"] is None and st["captures"] == 1, st
    assert "kept as they are (1 other compile_step(s) hold graphs on them)" in cl.stats()["channels_last_reason"]
    assert m2.conv.weight.is_contiguous()
    _assert_same_training(m1, o1, m2, o2, l1, l2, rtol=1e-4, atol=1e-5)


def test_compile_step_refuses_a_bad_channels_last():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="channels_last must be None"):
        kitsune.compile_step(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1),
                             channels_last="yes")


# ---- planned graph memory (kitsune/capplan.h) ----------------------------------------
def test_compile_step_plan_memory_needs_the_installed_allocator():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="plan_memory must be None .auto., True or False, got 'yes'"):
        kitsune.compile_step(m, torch.nn.functional.mse_loss, opt, plan_memory="yes")
    with pytest.raises(ValueError, match="plan_memory=True lays the graph out in Kitsune's allocator; call "
                                         "kitsune.allocator.install"):
        kitsune.compile_step(m, torch.nn.functional.mse_loss, opt, plan_memory=True)
    assert kitsune.compile_step(m, torch.nn.functional.mse_loss, opt)._plan_memory is False   # auto: not installed
    import kitsune.allocator as ka
    with pytest.raises(RuntimeError, match="call kitsune.allocator.install.. first"):
        ka._record_capture((0, 1))
    with pytest.raises(RuntimeError, match="call kitsune.allocator.install.. first"):
        ka._placer_stats((0, 1))
    for bad in (-1, 1.5, "1"):   # checked before anything else
        with pytest.raises(ValueError, match=f"budget must be None or a number of bytes >= 0, got {bad!r}"):
            ka._take_plan((0, 1), budget=bad)


def test_the_plan_budget_is_off_without_a_warm_up_peak_or_with_kitsune_plan_waits_0(monkeypatch):
    """compile_step's memory plan budget (_plan_budget): None before a warm-up has
    measured the eager step's rise, and with KITSUNE_PLAN_WAITS=0 (the plan then never
    buys reuse with waits)."""
    m = torch.nn.Linear(2, 2)
    step = kitsune.compile_step(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1))
    assert step._eager_rise is None and step._plan_budget() is None
    step._eager_rise = 1 << 30
    assert step._plan_budget() == 1 << 30
    monkeypatch.setenv("KITSUNE_PLAN_WAITS", "0")
    assert step._plan_budget() is None


def test_the_budget_is_the_eager_forward_and_backwards_rise_not_the_first_updates_state(monkeypatch):
    """_eager(rise=True) with the device's counters faked: the rise is the peak after the
    forward and backward less what was allocated when they began (the gradients dropped
    first), whatever the optimizer's update allocates after (a first update's state);
    a process peak above that counts. The budget is the rise less the graph's inputs."""
    MiB = 2 ** 20
    m = torch.nn.Linear(2, 2)
    step = kitsune.compile_step(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1))
    mem = {"now": 0, "peak": 0}

    def alloc(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    zero = step.optimizer.zero_grad
    monkeypatch.setattr(step.optimizer, "zero_grad", lambda set_to_none=True: (zero(set_to_none), alloc(-5 * MiB)))
    monkeypatch.setattr(step, "_forward_backward", lambda batch, model=None: (alloc(100 * MiB), alloc(-60 * MiB)))
    monkeypatch.setattr(step.optimizer, "step", lambda: alloc(90 * MiB))   # a first update's state: kept
    step._side = types.SimpleNamespace(device=torch.device("cpu"))
    alloc(300 * MiB)   # parameters and the last step's gradients (5 MiB)
    step._eager((), rise=True)
    assert step._eager_rise == 100 * MiB, step._eager_rise / MiB
    step._inputs_bytes = 3 * MiB
    assert step._eager_budget() == 97 * MiB
    mem["peak"] = mem["now"] + 500 * MiB   # an earlier, higher peak of the process
    step._eager((), rise=True)
    assert step._eager_rise == 505 * MiB, step._eager_rise / MiB


def _measured_late_step(monkeypatch, apart_ms):
    """A compile_step (of a Linear, never run) whose trial chose "late" (together 1.0 ms,
    apart apart_ms, late 0.9) and the ways it is then set to, in a list."""
    m = torch.nn.Linear(2, 2)
    step = kitsune.compile_step(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1))
    ways = []
    monkeypatch.setattr(step, "_set_conv_grads", lambda *a: ways.append(a))
    step._conv_grads = {"late": True, "apart": True, "how": "measured",
                        "ms": {"together": 1.0, "apart": apart_ms, "late": 0.9}}
    return step, ways


def test_late_joins_are_refused_when_their_plan_passes_the_eager_budget(monkeypatch):
    """_late_over_budget: a measured "late" whose plan fits the budget (the eager
    forward and backward's rise less the graph's inputs) is kept; one that does not is
    refused for the fastest other way when the late joins' kept bytes are not known (or
    would all have to go), and the reason names the amounts. Without a warm-up nothing
    is refused."""
    MiB = 2 ** 20
    step, ways = _measured_late_step(monkeypatch, apart_ms=0.95)
    assert not step._late_over_budget(400 * MiB), "no warm-up: nothing to hold it to"
    step._eager_rise, step._inputs_bytes = 332 * MiB, 2 * MiB
    assert step._eager_budget() == step._plan_budget() == 330 * MiB
    assert not step._late_over_budget(330 * MiB, [MiB]) and step._conv_grads["late"] and not ways
    assert step._late_over_budget(330 * MiB + 512)
    assert ways == [("apart",)] and not step._conv_grads["late"] and step._conv_grads["apart"]
    assert step._conv_grads["late_refused"] == ("the plan with late joins (330.0 MiB) exceeds the budget (330.0 MiB: "
                                                "the eager forward and backward's rise, 332.0 MiB, less the graph's "
                                                "inputs)")


def test_late_joins_over_the_budget_are_cut_to_those_keeping_least(monkeypatch):
    """Over the budget with the late joins' kept bytes known, _late_over_budget keeps
    "late" for fewer: the largest keepers go until they add up to the excess, and
    compile_step is told to record again (True); round after round the limit only
    falls; when none would be left, "late" is refused for the fastest other way and
    the limit's record goes. _late_limit alone: ties go together, nothing left is None."""
    from kitsune.graph.memory import _late_limit
    MiB = 2 ** 20
    assert _late_limit([4, 1, 2, 4, 3], 1) == 3   # the two 4s go together
    assert _late_limit([4, 1, 2, 4, 3], 9) == 2 and _late_limit([4, 1, 2, 4, 3], 11) == 2
    assert _late_limit([4, 1, 2, 4, 3], 12) == 1 and _late_limit([4, 1, 2, 4, 3], 14) is None
    assert _late_limit([], 1) is None
    assert _late_limit([5, 5], 1) is None   # a tie with the one left out: nothing left
    step, ways = _measured_late_step(monkeypatch, apart_ms=1.2)
    step._eager_rise = 330 * MiB   # a budget of 330 MiB
    kept = [8 * MiB, 2 * MiB, 2 * MiB, MiB, MiB // 2]
    assert step._late_over_budget(338 * MiB, kept)   # 8 MiB over: the 8 MiB keeper goes
    assert ways == [("late", 2 * MiB)] and step._conv_grads["late"] and step._conv_grads["late_limit"] == 2 * MiB
    assert step._conv_grads["late_limited"] == (
        "4 of 5 late joins kept (those holding at most 2.00 MiB): the plan with late joins (338.0 MiB) exceeds the "
        "budget (330.0 MiB: the eager forward and backward's rise, 330.0 MiB, less the graph's inputs)")
    assert step._late_over_budget(331 * MiB, kept[1:])   # 1 MiB over: both 2 MiB keepers go
    assert ways[-1] == ("late", MiB) and step._conv_grads["late_limit"] == MiB
    assert not step._late_over_budget(329 * MiB, kept[3:])   # fits: kept as it is
    assert len(ways) == 2 and step._conv_grads["late"]
    assert step._late_over_budget(340 * MiB, kept[3:])   # 10 MiB over, 1.5 MiB kept: refused
    assert ways[-1] == ("together",)   # apart was slower than together
    info = step._conv_grads
    assert not info["late"] and not info["apart"] and "late_limit" not in info and "late_limited" not in info
    assert info["late_refused"].startswith("the plan with late joins (340.0 MiB)")


def _layout_step(monkeypatch, plans):
    """A measured-late step (_measured_late_step, budget 86 MiB) whose recordings are
    faked: a recording of (way, late limit) takes plans[(way, limit)] (plan MiB, or a
    dict floor MiB -> plan MiB; live peak MiB; each late join's kept MiB); returns the
    step, its streams, the (way, limit) of each recording and the (way, limit, floor
    MiB) of each plan."""
    from types import SimpleNamespace
    MiB = 2 ** 20
    step, ways = _measured_late_step(monkeypatch, apart_ms=0.95)
    step._eager_rise = 86 * MiB
    ctx = SimpleNamespace(late_limit=None, late_kept=[], way="late")
    step._captured = SimpleNamespace(_kitsune_streams=ctx)

    def set_way(way, limit=None):
        ctx.way, ctx.late_limit = way, limit
    monkeypatch.setattr(step, "_set_conv_grads", set_way)
    recorded, planned = [], []

    def record(args, dev):
        way = (ctx.way, ctx.late_limit)
        recorded.append(way)
        plan, peak, kept = plans[way]
        ctx.late_kept = [int(k * MiB) for k in kept]
        return SimpleNamespace(way=way, plan=plan, peak=peak)

    def plan_of(rec, floor=None):
        floor = None if floor is None else round(floor / MiB, 1)
        planned.append(rec.way + (floor,))
        mib = rec.plan[floor] if isinstance(rec.plan, dict) else rec.plan
        return SimpleNamespace(info={"plan_bytes": int(mib * MiB), "peak_bytes": int(rec.peak * MiB)})
    monkeypatch.setattr(step, "_recording", record)
    monkeypatch.setattr(step, "_plan", plan_of)
    return step, ctx, recorded, planned


def test_late_joins_over_a_budget_no_layout_meets_are_held_to_the_plan_without_them(monkeypatch):
    """_planned_layout: where the late recording's live peak passes the budget too (no
    layout meets it), the way without late joins is recorded once and its plan becomes
    what the late joins are held to: the late recording is planned again within it
    (waits bought toward it; not captured again), kept when it fits, cut against it (not
    the budget) when not, and when refused, the plan recorded without them is laid
    out, not recorded a third way. Where the budget can be met, nothing of this: cut
    against the budget as before."""
    MiB = 2 ** 20
    kept = [4, 4, 2, 1, 0.5]
    late, apart = ("late", None), ("apart", None)
    # ResNet-like: late 104 MiB, live peak 87 > 86; apart 88.6; within 88.6 late still takes 104
    step, ctx, recorded, planned = _layout_step(monkeypatch, {late: (104, 87, kept), apart: (88.6, 87, [])})
    plan = step._planned_layout((), 0, ctx)
    # 15.4 MiB over the floor, more than every join keeps: refused, and the apart recording's
    # plan is laid out
    assert recorded == [late, apart] and planned == [late + (None,), apart + (None,), late + (88.6,)], planned
    assert plan.info["plan_bytes"] == int(88.6 * MiB)
    info = step._conv_grads
    assert ctx.way == "apart" and not info["late"] and "late_held_to" not in info
    assert info["late_refused"].endswith("and the plan without them (88.6 MiB)"), info

    # within the floor the late recording's plan fits (waits): one late capture, planned twice
    step, ctx, recorded, planned = _layout_step(monkeypatch, {late: ({None: 104, 88.6: 88.5}, 87, kept),
                                                              apart: (88.6, 87, [])})
    plan = step._planned_layout((), 0, ctx)
    assert recorded == [late, apart] and planned == [late + (None,), apart + (None,), late + (88.6,)], planned
    assert plan.info["plan_bytes"] == int(88.5 * MiB) and ctx.way == "late" and ctx.late_limit is None
    assert step._conv_grads["late"] and step._conv_grads["late_held_to"] == (
        "the plan without late joins (88.6 MiB): the recording's live peak (87.0 MiB) passes the budget (86.0 MiB)")

    # over the floor by 3 MiB: the two 4 MiB keepers go (as the late recording kept them, not
    # the apart one), recorded again, and the rest fit
    step, ctx, recorded, planned = _layout_step(monkeypatch, {late: (91.6, 87, kept), apart: (88.6, 87, []),
                                                              ("late", 2 * MiB): (88.0, 87, kept[2:])})
    plan = step._planned_layout((), 0, ctx)
    assert recorded == [late, apart, ("late", 2 * MiB)], recorded
    assert planned == [late + (None,), apart + (None,), late + (88.6,), ("late", 2 * MiB, 88.6)], planned
    assert plan.info["plan_bytes"] == int(88.0 * MiB) and step._conv_grads["late_limit"] == 2 * MiB

    # a budget the live peak meets: cut against the budget, no recording without late joins
    step, ctx, recorded, planned = _layout_step(monkeypatch, {late: (90, 80, kept), ("late", 2 * MiB): (85, 80, kept[2:])})
    plan = step._planned_layout((), 0, ctx)
    assert recorded == [late, ("late", 2 * MiB)] and planned == [late + (None,), ("late", 2 * MiB, None)]
    assert plan.info["plan_bytes"] == 85 * MiB and "late_held_to" not in step._conv_grads


def _blas_rows(b, stream):
    import ctypes
    n = b.kt_bridge_blas_list(stream, None, 0)
    rows = (ctypes.c_int64 * (4 * max(n, 1)))()
    assert b.kt_bridge_blas_list(stream, rows, n) == n
    return {tuple(rows[4 * i:4 * i + 4]) for i in range(n)}


def test_blas_share_aliases_moves_and_never_frees():
    """kt_bridge_blas_share on PyTorch's own workspace maps, with entries the test puts
    there (a deleter that counts frees; fake handles and streams): a workspace on the
    partner only is aliased, one on the capture stream only moves to the partner (same
    address), two owners stay apart; a second call changes nothing; an alias follows
    the partner's workspace when it is replaced and goes when it is dropped; nothing is
    ever freed by sharing, and aliases free nothing when they go."""
    import ctypes
    from kitsune import _native
    b = _native.bridge()
    F, T = 0x7E57_0000_1000, 0x7E57_0000_2000           # partner, capture stream
    h1, h2, h3 = 0x7E57_00A1_0000, 0x7E57_00A2_0000, 0x7E57_00A3_0000
    A = {i: 0x7E57_1000_0000 + i * 0x1000_0000 for i in range(1, 7)}
    frees0 = b.kt_bridge_blas_test_frees()
    put = b.kt_bridge_blas_test_put
    try:
        assert put(0, h1, F, A[1]) == 0 and put(1, h1, F, A[2]) == 0   # partner only: both maps
        assert put(0, h2, T, A[3]) == 0                                 # capture stream only
        assert put(0, h3, F, A[4]) == 0 and put(0, h3, T, A[5]) == 0    # both their own
        assert put(7, h1, F, A[1]) != 0                                  # no such map
        out = (ctypes.c_int64 * 3)()
        assert b.kt_bridge_blas_share(F, T, out) == 0
        assert list(out) == [3, 1, 1]
        assert _blas_rows(b, F) == {(0, h1, A[1], 0), (1, h1, A[2], 0), (0, h2, A[3], 0), (0, h3, A[4], 0)}
        assert _blas_rows(b, T) == {(0, h1, A[1], 1), (1, h1, A[2], 1), (0, h2, A[3], 1), (0, h3, A[5], 0)}
        assert b.kt_bridge_blas_test_frees() == frees0
        assert b.kt_bridge_blas_share(F, T, out) == 0 and list(out) == [3, 0, 1]   # nothing left to do
        assert _blas_rows(b, T) == {(0, h1, A[1], 1), (1, h1, A[2], 1), (0, h2, A[3], 1), (0, h3, A[5], 0)}
        assert put(0, h1, F, A[6]) == 0                  # PyTorch replaced the partner's: the old one freed
        assert put(1, h1, F, 0) == 0                     # and dropped another
        assert b.kt_bridge_blas_test_frees() == frees0 + 2
        assert b.kt_bridge_blas_share(F, T, out) == 0 and list(out) == [2, 0, 1]
        assert _blas_rows(b, T) == {(0, h1, A[6], 1), (0, h2, A[3], 1), (0, h3, A[5], 0)}
        assert b.kt_bridge_blas_test_frees() == frees0 + 2
        stream = type("S", (), {"cuda_stream": F})
        with pytest.raises(ValueError, match="sharing cuBLAS workspaces"):
            kitsune.graph.capture._share_workspaces(stream(), stream())
    finally:
        for kind in (0, 1):
            for h in (h1, h2, h3):
                for s in (F, T):
                    put(kind, h, s, 0)
    assert _blas_rows(b, F) == set() and _blas_rows(b, T) == set()
    # owned entries left at the end: A6, A3 (moved to F), A4, A5; the aliases freed nothing
    assert b.kt_bridge_blas_test_frees() == frees0 + 2 + 4


@pytest.mark.gpu
@gpu
def test_gpu_compile_step_shares_the_partner_streams_cublas_workspaces():
    """The capture stream uses the cuBLAS and cuBLASLt workspaces of its partner (the
    stream the first step ran on): every workspace entry it has is an alias of one of
    the partner's, so a graph holds no second set. Steps called on another stream,
    while the partner runs matmuls of its own, are fenced with it and train as the
    eager loop does."""
    from kitsune import _native
    b = _native.bridge()
    m1, o1, m2, o2 = _twins(_mlp(3, "cuda"), lr=1e-2)
    batches = _batches(30, "cuda")
    ce = torch.nn.functional.cross_entropy
    want = _eager_reference(m1, o1, batches, ce)
    step = kitsune.compile_step(m2, ce, o2)
    losses = [step(*batch).float() for batch in batches[:10]]
    cap, partner = kitsune.graph.capture._CAPTURE_STREAMS[torch.cuda.current_device()]
    assert cap is step._side and partner is step._partner
    rows_cap, rows_partner = _blas_rows(b, cap.cuda_stream), _blas_rows(b, partner.cuda_stream)
    assert rows_cap and all(alias == 1 for *_, alias in rows_cap), rows_cap
    assert {r[:3] for r in rows_cap} <= {r[:3] for r in rows_partner if r[3] == 0}, (rows_cap, rows_partner)
    st = step.stats()["blas_workspaces"]
    assert st["apart"] == 0 and st["shared"] == len(rows_cap), (st, rows_cap)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    x = torch.randn(4096, 4096, device="cuda")
    for batch in batches[10:]:
        y = x @ x   # on the partner, with its workspace
        with torch.cuda.stream(user):
            losses.append(step(*batch).float())
        del y
    torch.cuda.current_stream().wait_stream(user)
    _assert_same_training(m1, o1, m2, o2, want, torch.stack(losses))
    assert step.stats()["replays"] == 29


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["mlp", "shapes", "lm", "branchy", "fused_branchy", "waited_branchy",
                                  "waited_branchy_timed", "late_branchy"])
def test_gpu_compile_step_with_planned_memory_trains_as_eager(case):
    """Kitsune installed, compile_step(plan_memory=True): captured once while recording,
    planned, captured again by the plan. It trains as the eager loop does (checked in
    plan_workloads.py), and the plan was used: on one stream every recorded block is
    placed at its offset; with several batch shapes (max_shapes=2) the arena grows and
    graphs are dropped and captured again; on a streamed branchy net the plan lets
    blocks of different streams share bytes where the captured graph orders their work
    (the bridge read the graph: graph_nodes, cross_shares), and it still trains alike.
    Through kitsune.optimize (fused_branchy, sm_90) its bias gradients are column sums
    launched as dependents: their programmatic edges count as order
    (programmatic_ordered; not counting them cut the streams' ancestry and grew the
    bench's 4-stream Inception net's plan from 351.7 to 459.9 MiB). Planned within a
    budget one byte under its plan without waits (waited_branchy), waits buy reuse the
    order does not allow: a smaller plan, every block placed, the same training (the
    waits add edges, not work); its first recording, kept (allocator.CaptureRecording),
    plans within that budget with waits too, and within its own again as it did. (Within a budget of 0, which no plan meets, it now buys
    none: bench/results/archive/h100_pytest_models_gmem_fd66c6b.log.) With
    weight gradients joining late and a budget one byte under that plan (late_branchy),
    the largest keepers stop joining late, the others still do, and it trains alike.
    With KITSUNE_PLAN_WAITS=timed (waited_branchy_timed) the recording's graph is
    replayed without the update and the plan chosen by its node times: the planned
    twin still trains as the unplanned one (a replay that updated the parameters would
    set them apart)."""
    here = os.path.dirname(os.path.abspath(__file__))
    timed = case.endswith("_timed")
    case = case[:-len("_timed")] if timed else case
    r = subprocess.run([sys.executable, os.path.join(here, "plan_workloads.py"), case], capture_output=True,
                       text=True, env=dict(env(), KITSUNE_PLAN_WAITS="timed" if timed else "1"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    print(case, json.dumps(d))
    st, mp = d["stats"], d["stats"]["memory_plan"]
    assert st["reason"] is None and st["replays"] > 0, st
    assert mp is not None and mp["status"] == 0 and mp["blocks"] > 0, st
    assert mp["peak_bytes"] <= mp["plan_bytes"] <= mp["arena_bytes"], mp
    assert mp["placed"] > 0, mp
    # where the capture phase went: recording captures, their plans, the placed capture
    cp, ph = st["capture_parts"], st["setup_phases"]
    assert cp["record"] > 0 and cp["plan"] > 0 and cp["place"] > 0 and sum(cp.values()) <= ph["capture"], (cp, ph)
    if case in ("mlp", "lm"):   # every planned block at its offset; an allocation the plan did not see may come
        assert mp["placed"] == mp["blocks"] and mp["refused"] <= 2, mp
    if case == "shapes":
        assert st["graphs"] == 2 and st["evictions"] >= 1, st
    if "branchy" in case:
        assert st["streams"] > 1, st
        # the plan's shapes: from the warm-up's run of a GraphModule (kitsune.optimize's), else on fake tensors
        assert st["stream_shapes"] == ("fake tensors" if case == "branchy" else "recorded"), st
        assert mp["graph_nodes"] > 0 and mp["cross_shares"] > 0, mp
    if case == "waited_branchy":   # one byte under the plan without waits: waits bought bytes the order kept apart
        assert mp["budget"] == mp["unwaited_bytes"] - 1 and mp["wait_gap"] >= 0 and mp["wait_shares"] > 0, mp
        assert mp["plan_bytes"] < mp["unwaited_bytes"] and mp["waits"] > 0, mp
        assert mp["placed"] == mp["blocks"] and mp["refused"] == 0, mp
        if timed:   # chosen by the recorded graph's node times, the update left out of its replay
            assert mp["wait_timed"] == 1 and mp["wait_delay_us"] is not None and mp["wait_delay_us"] >= 0, mp
            assert "nodes timed over 3 replays" in mp["node_times"], mp["node_times"]
        else:
            assert mp["wait_timed"] == 0 and mp["node_times"] is None and mp["wait_by_slack"] == 0, mp
        # one recording planned three times (allocator.CaptureRecording): the same blocks and
        # live peak each time; within the lower budget waits, as the recording made again got;
        # within its first budget again, the first plan
        first, (under, same) = d["plans"][0], d["replanned"]
        for p in (under, same):
            assert all(p[k] == first[k] for k in ("blocks", "recorded", "peak_bytes", "unwaited_bytes")), (p, first)
        assert under["budget"] == first["unwaited_bytes"] - 1 and under["wait_gap"] >= 0, under
        assert under["plan_bytes"] < under["unwaited_bytes"] and under["wait_shares"] > 0, under
        assert same == first, (same, first)
    if case == "late_branchy":
        cg, kept = st["conv_grads"], d["first_kept"]
        # unplanned, every split convolution joins late but the stem's (its input needs no gradient)
        assert cg["convs"] == 5 and d["pool_late_joins"] == len(kept) == 4, d
        assert cg["late"] and "late_refused" not in cg and cg["late_limit"] < max(kept), cg
        assert 0 < d["late_joins"] == sum(k <= cg["late_limit"] for k in kept) < len(kept), (d["late_joins"], cg, kept)
    if case == "fused_branchy" and torch.cuda.get_device_capability()[0] >= 9:
        assert mp["programmatic_ordered"] > 0, mp
        # every one is into a kernel of ours here (8 of 8 on the H100 at 2f5a092): one left
        # uncounted means a dependent launch went unnoted (as at 9af0917)
        assert mp["programmatic_ordered"] == mp["programmatic_edges"], mp


def test_graph_node_timing_refuses_bad_input():
    """kt_graph_time_nodes and kt_graph_capture_nodes (C, through ctypes) name a bad
    argument before touching the runtime: no graph, no count to write, skip nodes
    without their array."""
    import ctypes
    from kitsune import _native
    lib, n = _native.native(), ctypes.c_size_t(7)
    assert lib.kt_graph_time_nodes(None, None, 0, None, 0, None, None, None, 0, ctypes.byref(n)) == _native.ERR_INVALID
    assert lib.kt_graph_time_nodes(ctypes.c_void_p(8), None, 0, None, 0, None, None, None, 0, None) == _native.ERR_INVALID
    assert lib.kt_graph_time_nodes(ctypes.c_void_p(8), None, 2, None, 0, None, None, None, 0,
                                   ctypes.byref(n)) == _native.ERR_INVALID
    assert lib.kt_graph_capture_nodes(None, None, 0, None) == _native.ERR_INVALID
    assert n.value == 7, "nothing written"


def test_capture_graph_order_outside_a_capture_answers_unavailable():
    """kt_capture_graph (C, through ctypes): the order a private pool hands to capture
    plans. Outside a capture its frontier is unknown (KT_ERR_UNAVAILABLE, nothing
    written), it has no graph for edges or waits, and it counts no programmatic edges."""
    import ctypes
    from kitsune import _native
    lib = ctypes.CDLL(_native.library_path() or _native.native()._name)
    frontier_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t))
    edges_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t))
    wait_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                              ctypes.c_size_t)

    class Order(ctypes.Structure):
        _fields_ = [("ctx", ctypes.c_void_p), ("frontier", frontier_t), ("edges", edges_t), ("wait", wait_t)]

    lib.kt_capture_graph_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.kt_capture_graph_begin.restype = ctypes.POINTER(Order)
    lib.kt_capture_graph_begin.argtypes = [ctypes.c_void_p]
    lib.kt_capture_graph_destroy.argtypes = [ctypes.c_void_p]
    lib.kt_capture_graph_programmatic.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                                                  ctypes.POINTER(ctypes.c_int64)]
    assert lib.kt_capture_graph_create(None) == _native.ERR_INVALID
    g = ctypes.c_void_p()
    assert lib.kt_capture_graph_create(ctypes.byref(g)) == _native.OK and g.value
    try:
        order = lib.kt_capture_graph_begin(g).contents
        assert order.ctx == g.value
        n = ctypes.c_size_t(7)
        for stream in (None, 2):   # the default streams are never asked
            assert order.frontier(order.ctx, stream, None, 0, ctypes.byref(n)) == _native.ERR_UNAVAILABLE
        assert n.value == 7, "nothing written"
        assert order.edges(order.ctx, None, None, 0, ctypes.byref(n)) == _native.ERR_UNAVAILABLE
        node = (ctypes.c_uint64 * 1)(1)
        assert order.wait(order.ctx, 8, node, 1) == _native.ERR_UNAVAILABLE
        edges, ordered = ctypes.c_int64(-1), ctypes.c_int64(-1)
        lib.kt_capture_graph_programmatic(g, ctypes.byref(edges), ctypes.byref(ordered))
        assert (edges.value, ordered.value) == (0, 0)
        lib.kt_capture_graph_programmatic(None, ctypes.byref(edges), None)
        assert edges.value == 0
    finally:
        lib.kt_capture_graph_destroy(g)


@pytest.mark.gpu
@gpu
def test_gpu_graph_node_times_replay_a_copy_with_the_update_left_out():
    """graph.capture._node_times (kt_graph_time_nodes) on a captured graph of two streams: a
    sleep of about 200 us then an add on the first, a short add on the second, joined,
    then an "update" whose nodes graph.capture._capture_nodes told apart while capturing.
    Every node gets a time; the add after the sleep finished at least 100 us after the
    graph's start and after the other stream's add; the timed replays (one that
    uploads, three counted) ran the rest (their counters moved 4) and left the update
    out (its tensor untouched), and the graph itself is unchanged: replayed after, it
    runs everything once, the update included."""
    import ctypes
    from kitsune import _native
    from kitsune.graph import capture as kg
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    count, short, upd = (torch.zeros(1, device="cuda") for _ in range(3))
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)

    def added(stream, fn):   # the nodes fn captures on stream
        before = kg._capture_nodes(stream)
        fn()
        return kg._capture_nodes(stream) - before

    with torch.cuda.graph(g, stream=side):
        other.wait_stream(side)
        torch.cuda._sleep(400_000)   # cycles: about 200 us at 2 GHz
        after_sleep = added(side, lambda: count.add_(1))
        with torch.cuda.stream(other):
            quick = added(other, lambda: short.add_(1))
        side.wait_stream(other)
        update = added(side, lambda: upd.add_(5))
    assert len(after_sleep) == len(quick) == len(update) == 1, (after_sleep, quick, update)
    n = ctypes.c_size_t(0)
    lib = _native.native()
    assert lib.kt_graph_time_nodes(ctypes.c_void_p(g.raw_cuda_graph()), None, 0, None, 0, None, None, None, 0,
                                   ctypes.byref(n)) == _native.OK
    nodes, ns = kg._node_times(g, sorted(update), side)
    assert len(nodes) == len(set(nodes)) == len(ns) == n.value >= 4, (n.value, len(nodes))
    t = dict(zip(nodes, ns))
    (a,), (b,) = after_sleep, quick
    # from the root's stamp, which may run just after a node that started with it (here the
    # other stream's add: -256 ns on the H100 at 2459f4d)
    assert all(v >= -10_000 for v in ns), ns
    assert t[a] >= 100_000 and t[b] < t[a], (t[a], t[b])
    torch.cuda.synchronize()
    assert count.item() == short.item() == 4 and upd.item() == 0, (count.item(), short.item(), upd.item())
    assert lib.kt_graph_time_nodes(ctypes.c_void_p(g.raw_cuda_graph()), None, 0, None, 0, None, None, None, 0,
                                   ctypes.byref(n)) == _native.OK and n.value == len(nodes), "the graph is unchanged"
    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    assert count.item() == short.item() == 5 and upd.item() == 5, (count.item(), short.item(), upd.item())


@pytest.mark.gpu
@gpu
def test_gpu_memset_nodes_become_kernel_nodes():
    """kt_graph_memsets_to_kernels (C, through ctypes) on a captured graph: a fill
    kernel, then the driver's memsets over what it wrote (1-, 2- and 4-byte elements,
    unaligned, and a pitched 2-D one), then a copy of the buffer: each memset of at most
    max_bytes becomes a kernel node (a second pass finds none), the larger one stays,
    and the replayed graph leaves exactly the bytes the stream order gives (the fill's,
    then the memsets'; every other byte keeps its poison, twice over) and copies them
    after (the edges out kept)."""
    import ctypes
    from kitsune import _native
    f = _native.native().kt_graph_memsets_to_kernels
    cu = ctypes.CDLL("libcuda.so.1")
    u64, sz = ctypes.c_uint64, ctypes.c_size_t
    buf = torch.empty(1 << 18, dtype=torch.uint8, device="cuda")
    base = buf.data_ptr()
    # (offset, element bytes, value, width in elements, height, pitch in bytes)
    sets = [(1, 1, 0x5A, 3, 1, 0), (64, 2, 0xBEEF, 5, 1, 0), (128, 4, 0xDEADBEEF, 7, 1, 0),
            (4096, 4, 0x01020304, 3, 4, 256), (1 << 17, 4, 0x11223344, 1 << 14, 1, 0)]   # the last: 64 KiB, over max_bytes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, stream=side):
        buf[:8192].fill_(7)
        s = ctypes.c_void_p(side.cuda_stream)
        for off, el, v, w, h, pitch in sets:
            if h > 1:
                st = cu.cuMemsetD2D32Async(u64(base + off), sz(pitch), ctypes.c_uint(v), sz(w), sz(h), s)
            else:
                fn = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}[el]
                cv = {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}[el](v)
                st = fn(u64(base + off), cv, sz(w), s)
            assert st == 0, (off, st)
        copy = buf.clone()
    n = ctypes.c_int(-1)
    assert f(g.raw_cuda_graph(), (1 << 16) - 1, ctypes.byref(n)) == _native.OK and n.value == 4, n.value
    assert f(g.raw_cuda_graph(), (1 << 16) - 1, ctypes.byref(n)) == _native.OK and n.value == 0, n.value
    g.instantiate()
    for poison in (0xA5, 0x3C):
        want = torch.full((1 << 18,), poison, dtype=torch.uint8)
        want[:8192] = 7
        for off, el, v, w, h, pitch in sets:
            row = torch.tensor(list(v.to_bytes(el, "little")) * w, dtype=torch.uint8)
            for r in range(h):
                want[off + r * pitch: off + r * pitch + el * w] = row
        buf.fill_(poison)
        copy.fill_(poison ^ 0xFF)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf.cpu(), want), poison
        assert torch.equal(copy.cpu(), want), poison


class _RefusesChannelsLast(torch.nn.Module):
    """A .view() of its convolution's output, which channels-last input makes non-contiguous."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.size(0), -1))


def test_the_warm_up_notes_the_plans_shapes_in_the_layout_it_kept(monkeypatch):
    """_warm_up (on the CPU, the device's counters faked) runs a GraphModule's forward
    through kitsune.sched.shape_recorder: on a model that refuses channels-last input,
    the failed channels-last try leaves nothing of its own, and the NCHW step's shapes
    (contiguous strides) are what the plan gets; a model that is no GraphModule records
    nothing (its plan runs on fake tensors)."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    torch.manual_seed(0)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,)))
    for model in (torch.fx.symbolic_trace(_RefusesChannelsLast()), _RefusesChannelsLast()):
        step = kitsune.compile_step(model, torch.nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1), channels_last=True)
        step._side = types.SimpleNamespace(device=torch.device("cpu"))
        step._warm_up(batch)
        assert not step._cl and "refused channels-last" in step._cl_reason, step._cl_reason
        assert step._n["eager_steps"] == 1 and step._eager_rise == 0
        if not isinstance(model, torch.fx.GraphModule):
            assert not step._shapes_recorded
            continue
        assert step._shapes_recorded
        assert all("type" in n.meta for n in model.graph.nodes if n.op != "output")
        conv = next(n for n in model.graph.nodes if n.target == "conv")
        assert tuple(conv.meta["tensor_meta"].stride) == (8 * 8 * 8, 64, 8, 1), conv.meta["tensor_meta"]
