"""kitsune.KitsuneOptimizer against torch.optim: the fused Adam / AdamW / SGD step
(CPU: the same per-element code the CUDA kernel runs) gives torch.optim's parameters
and states; the torch.optim interface and state_dict interchange; unsupported options
fall back with the reason; GPU tests compare the CUDA kernel the same way."""
import copy

import pytest

from support import gpu

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
from kitsune.optim import KitsuneOptimizer  # noqa: E402

CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.5, dampening=0.3)),
]


def _params(dtype, device, gen, shapes=((37, 5), (128,), (3, 4, 5), (1,))):
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]


def _run(cls, kw, dtype, device, steps=12, skip_grad=1):
    g = torch.Generator().manual_seed(0)
    a = _params(dtype, device, g)
    b = [t.clone() for t in a]
    ka, tb = KitsuneOptimizer(cls, a, **kw), cls(b, **kw)
    for s in range(steps):
        for i, (x, y) in enumerate(zip(a, b)):
            if i == skip_grad and s % 3 == 1:   # a parameter without a gradient this step
                x.grad = y.grad = None
                continue
            gr = torch.randn(x.shape, generator=g, dtype=torch.float64).to(device, dtype)
            x.grad, y.grad = gr.clone(), gr.clone()
        ka.step()
        tb.step()
    return a, b, ka, tb


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_step_matches_torch_optim_on_cpu(cls, kw, dtype):
    a, b, ka, tb = _run(cls, kw, dtype, "cpu")
    assert ka.get_stats()["path"] == "fused" and ka.get_stats()["fused_steps"] == 12
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    for x, y in zip(a, b):   # states too
        for k, v in tb.state[y].items():
            torch.testing.assert_close(ka.state[x][k], v, msg=k)


def test_interface_and_state_dict_interchange():
    g = torch.Generator().manual_seed(1)
    a = _params(torch.float32, "cpu", g)
    inner = torch.optim.AdamW(a, lr=1e-2)
    k = KitsuneOptimizer(inner)   # wrapping an instance
    assert k.param_groups is inner.param_groups and k.defaults["lr"] == 1e-2
    for p in a:
        p.grad = torch.ones_like(p)
    k.step()
    sd = copy.deepcopy(k.state_dict())   # as through torch.save: load_state_dict may keep the tensors it gets
    b = [p.detach().clone() for p in a]
    t = torch.optim.AdamW(b, lr=1e-2)
    t.load_state_dict(sd)   # a Kitsune checkpoint loads into torch.optim ...
    k2 = KitsuneOptimizer(torch.optim.AdamW, [p.detach().clone() for p in a], lr=1e-2)
    k2.load_state_dict(copy.deepcopy(t.state_dict()))   # ... and back
    for opt, ps in ((k, a), (t, b), (k2, k2.param_groups[0]["params"])):
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    for x, y, z in zip(a, b, k2.param_groups[0]["params"]):
        torch.testing.assert_close(x, y)
        torch.testing.assert_close(x, z)
    k.zero_grad()
    assert all(p.grad is None for p in a)
    sched = torch.optim.lr_scheduler.StepLR(k.optimizer, step_size=1, gamma=0.5)
    for p in a:
        p.grad = torch.ones_like(p)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "lr_scheduler.step() before optimizer.step()" warning
        k.step()
        sched.step()
    assert k.param_groups[0]["lr"] == 5e-3 and k.get_stats()["path"] == "fused"


def test_is_a_torch_optimizer_for_schedulers_hooks_and_copies():
    """KitsuneOptimizer is a torch.optim.Optimizer: LR schedulers (StepLR, LambdaLR as HF's
    get_scheduler makes, SWALR) take it, step hooks run, and copies keep it whole."""
    import pickle
    import warnings
    g = torch.Generator().manual_seed(2)
    a = _params(torch.float32, "cpu", g)
    k = KitsuneOptimizer(torch.optim.AdamW, a, lr=1e-2)
    assert isinstance(k, torch.optim.Optimizer)
    with pytest.raises(TypeError, match="already a KitsuneOptimizer"):
        KitsuneOptimizer(k)
    seen = []
    pre = k.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", opt is k)))
    k.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", opt is k)))
    step_lr = torch.optim.lr_scheduler.StepLR(k, step_size=1, gamma=0.5)
    b = [p.detach().clone() for p in a]
    t = torch.optim.AdamW(b, lr=1e-2)
    t_lr = torch.optim.lr_scheduler.StepLR(t, step_size=1, gamma=0.5)
    for _ in range(3):
        for x, y in zip(a, b):
            gr = torch.randn(x.shape, generator=g)
            x.grad, y.grad = gr.clone(), gr.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no "lr_scheduler.step() before optimizer.step()"
            k.step()
            step_lr.step()
        t.step()
        t_lr.step()
    assert k.param_groups[0]["lr"] == t.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    assert seen == [("pre", True), ("post", True)] * 3 and k.get_stats()["path"] == "fused"
    pre.remove()
    lam = torch.optim.lr_scheduler.LambdaLR(k, lambda s: 1.0 / (s + 1))   # as HF's get_scheduler makes one
    k.step()
    lam.step()
    assert k.param_groups[0]["lr"] == pytest.approx(1e-2 / 2)   # from the groups' initial_lr
    swa = torch.optim.swa_utils.SWALR(k, swa_lr=1e-3, anneal_epochs=2)
    swa.step()
    assert k.param_groups[0]["lr"] != pytest.approx(1e-2 / 2)
    for clone in (copy.deepcopy(k), pickle.loads(pickle.dumps(k))):
        assert isinstance(clone, KitsuneOptimizer) and clone.enable_fusion and clone.param_groups[0]["lr"] == \
            k.param_groups[0]["lr"]
        clone.step()   # the clone's own parameters (copies), fused as the original's
        assert clone.get_stats()["path"] == "fused"


def test_unsupported_options_fall_back_with_the_reason():
    a, b, ka, _ = _run(torch.optim.Adam, dict(lr=1e-2, amsgrad=True), torch.float32, "cpu", steps=3)
    assert ka.get_stats()["path"] == "torch.optim (amsgrad=True is not fused)" and ka.get_stats()["fused_steps"] == 0
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    a, b, ka, _ = _run(torch.optim.RMSprop, dict(lr=1e-2), torch.float32, "cpu", steps=3)
    assert "RMSprop has no fused Kitsune step" in ka.get_stats()["path"]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_non_dense_gradient_falls_back_whole(cls):
    """A gradient with gaps (a strided slice) in the second group: the step falls back to
    torch.optim for both groups (the first is not fused ahead of the check), naming it.
    A transposed gradient (dense, other strides) is copied into its parameter's strides,
    as AccumulateGrad would, and fused."""
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g)]
    b = [t.clone() for t in a]
    kw = dict(lr=0.1, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.1)
    ka = KitsuneOptimizer(cls, [{"params": [a[0]]}, {"params": [a[1]], "lr": 0.05}], **kw)
    tb = cls([{"params": [b[0]]}, {"params": [b[1]], "lr": 0.05}], **kw)
    for step in range(4):
        for i, (x, y) in enumerate(zip(a, b)):
            gr = torch.randn(x.shape[::-1], generator=g).t()   # transposed: dense, not contiguous
            if step == 1 and i == 1:   # gaps between elements
                gr = torch.randn(x.shape[0], 2 * x.shape[1], generator=g)[:, ::2]
            x.grad = gr if step in (1, 2) else gr.contiguous()
            y.grad = gr.clone()
        ka.step()
        tb.step()
        want = "fused"
        if step == 1:
            want = ("torch.optim (parameter 1 of the step (shape (4, 8), strides (8, 1)) has a gradient laid out "
                    "otherwise: shape (4, 8), strides (16, 2))")
        assert ka.get_stats()["path"] == want, step
        if step == 2:   # the transposed gradients, conformed
            assert [x.grad.stride() for x in a] == [x.stride() for x in a]
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    if cls is torch.optim.AdamW:   # the step counts, kept by the fused path and torch.optim alike
        assert [float(ka.state[p]["step"]) for p in a] == [4.0, 4.0]


@pytest.mark.parametrize("device,dtype,tol", [("cpu", torch.float64, 1e-12),
                                              pytest.param("cuda", torch.float32, 1e-5, marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True))])
def test_channels_last_weights_are_fused(cls, kw, device, dtype, tol):
    """Convolution weights in channels-last memory (model.to(memory_format=
    torch.channels_last)) with gradients and states in the same strides take the fused
    step and equal torch.optim; a gradient in another layout than its weight
    is copied into the weight's strides and fused; fused states keep the weights' layout."""
    g = torch.Generator().manual_seed(8)
    conv = lambda: torch.randn(16, 8, 3, 3, generator=g, dtype=dtype).to(device)  # noqa: E731
    a = [conv().contiguous(memory_format=torch.channels_last), torch.randn(5, 7, generator=g, dtype=dtype).to(device)]
    b = [t.clone(memory_format=torch.preserve_format) for t in a]
    ka, tb = KitsuneOptimizer(cls, a, **kw), cls(b, **kw)
    for step in range(4):
        for x, y in zip(a, b):
            gr = torch.randn(x.shape, generator=g, dtype=dtype).to(device)
            x.grad = gr if step == 2 and x.dim() == 4 else gr.contiguous(memory_format=torch.preserve_format).clone(
                memory_format=torch.channels_last if x.dim() == 4 else torch.contiguous_format)
            y.grad = gr.clone()
        ka.step()
        tb.step()
        # step 2's NCHW gradient of the channels-last weight is copied into the weight's
        # strides (as AccumulateGrad would) and fused
        assert ka.get_stats()["path"] == "fused", step
        assert a[0].grad.stride() == a[0].stride()
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert a[0].is_contiguous(memory_format=torch.channels_last)
    for st in ka.state[a[0]].values():
        if torch.is_tensor(st) and st.dim() == 4:
            assert st.stride() == a[0].stride()


def test_adam_step_op_counts_and_buckets_steps():
    """kitsune.adam_step_ adds 1 to each step state and updates tensors whose counts
    differ with their own bias corrections (one adam_ call per count)."""
    g = torch.Generator().manual_seed(4)
    ps = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3)]
    gs = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3)]
    ms, vs = [torch.zeros(5, dtype=torch.float64) for _ in ps], [torch.zeros(5, dtype=torch.float64) for _ in ps]
    steps = [torch.tensor(0.0), torch.tensor(4.0), torch.tensor(0.0, dtype=torch.float64)]
    want = [p.clone() for p in ps]
    wm, wv = [m.clone() for m in ms], [v.clone() for v in vs]
    for i, s in enumerate([1.0, 5.0, 1.0]):
        torch.ops.kitsune.adam_([want[i]], [gs[i]], [wm[i]], [wv[i]], 1e-2, 0.9, 0.999, 1e-8, 0.1, True, s)
    torch.ops.kitsune.adam_step_(ps, gs, ms, vs, steps, 1e-2, 0.9, 0.999, 1e-8, 0.1, True)
    assert [float(s) for s in steps] == [1.0, 5.0, 1.0] and steps[2].dtype == torch.float64
    for x, y in zip(ps + ms + vs, want + wm + wv):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="state_steps has 2 tensors but params has 3"):
        torch.ops.kitsune.adam_step_(ps, gs, ms, vs, steps[:2], 1e-2, 0.9, 0.999, 1e-8, 0.1, True)
    with pytest.raises(RuntimeError, match=r"state_steps\[1\] must have one element"):
        torch.ops.kitsune.adam_step_(ps, gs, ms, vs, [steps[0], torch.zeros(2), steps[2]], 1e-2, 0.9, 0.999, 1e-8,
                                     0.1, True)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[2\] must be a Double tensor on cpu laid out as params\[2\] "
                                           r"\(\[5\], strides \[1\]\); got Float \[5\]"):
        torch.ops.kitsune.adam_step_(ps, gs, ms[:2] + [ms[2].float()], vs, steps, 1e-2, 0.9, 0.999, 1e-8, 0.1, True)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be .* laid out as params\[0\] \(\[5\], strides \[1\]\); "
                                           r"got Double \[5\], strides \[2\]"):
        torch.ops.kitsune.adam_step_(ps, [torch.zeros(10, dtype=torch.float64)[::2]] + gs[1:], ms, vs, steps, 1e-2,
                                     0.9, 0.999, 1e-8, 0.1, True)
    with pytest.raises(RuntimeError, match="betas in"):
        torch.ops.kitsune.adam_step_(ps, gs, ms, vs, steps, 1e-2, 1.5, 0.999, 1e-8, 0.1, True)
    assert [float(s) for s in steps] == [1.0, 5.0, 1.0]   # a bad call changes nothing


def test_closure_stats_and_bad_arguments():
    w = torch.randn(4, requires_grad=True)
    k = kitsune.KitsuneOptimizer(torch.optim.SGD, [w], lr=0.1, momentum=0.9)

    def closure():
        k.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss
    loss = k.step(closure)
    assert loss is not None and loss.item() > 0
    st = k.get_stats()
    assert st["steps"] == 1 and st["state_tensors"] == 1 and st["state_bytes"] == 16 and st["last_step_ms"] >= 0
    with pytest.raises(ValueError, match="amp_options needs enable_amp=True"):
        KitsuneOptimizer(torch.optim.AdamW, [w], amp_options={"init_scale": 8.0})
    with pytest.raises(RuntimeError, match="KitsuneOptimizer.scale: needs enable_amp=True"):
        KitsuneOptimizer(torch.optim.AdamW, [w]).scale(torch.ones(()))
    with pytest.raises(TypeError, match="params is required"):
        KitsuneOptimizer(torch.optim.AdamW)
    with pytest.raises(TypeError, match="either an optimizer instance"):
        KitsuneOptimizer(torch.optim.AdamW([w]), [w])
    with pytest.raises(RuntimeError, match="exp_avgs has 0 tensors but params has 1"):
        torch.ops.kitsune.adam_([w.detach()], [w.detach()], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls,kw", CASES, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_gpu_fused_step_matches_torch_optim(cls, kw):
    """fp32 against torch.optim; bf16 (Kitsune computes in fp32 and rounds once, torch
    rounds every op) within bf16 resolution after 4 steps."""
    a, b, ka, _ = _run(cls, kw, torch.float32, "cuda")
    assert ka.get_stats()["path"] == "fused"
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    a, b, _, _ = _run(cls, kw, torch.bfloat16, "cuda", steps=4)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls,kw", [CASES[0], CASES[5]], ids=["AdamW", "SGD-momentum"])
@pytest.mark.parametrize("big", [3 * 65536 + 13, 40_000_003])
def test_gpu_many_large_and_unaligned_tensors(cls, kw, big):
    """The kernel's launch packing: a tensor of many chunks (the chunk is sized from
    the call's total elements: 2048 with the smaller big tensor, 65536 with the larger),
    more tensors than one launch carries (64), and a parameter whose storage starts
    2 elements in (not 16-byte aligned: the one-element path), all against torch.optim."""
    g = torch.Generator().manual_seed(1)
    sizes = [big] + [int(s) for s in torch.randint(1, 3000, (70,), generator=g)]
    a = [torch.randn(s, generator=g).cuda() for s in sizes]
    a.append(torch.randn(1002, generator=g).cuda()[2:])   # fp32 view at 8 bytes past the allocation
    assert a[-1].data_ptr() % 16 != 0
    b = [t.clone() for t in a]
    ka, tb = KitsuneOptimizer(cls, a, **kw), cls(b, **kw)
    for _ in range(3):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g).cuda()
            y.grad = x.grad.clone()
        ka.step()
        tb.step()
    assert ka.get_stats()["path"] == "fused"
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _amp_run(kitsune, steps=8, inf_at=3, clip=None):
    """A small model trained with loss scaling, by KitsuneOptimizer(enable_amp=True) or
    by torch.optim + torch.amp.GradScaler; at step inf_at one gradient is made inf."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opts = dict(init_scale=1024.0, growth_interval=2)
    if kitsune:
        opt = KitsuneOptimizer(torch.optim.AdamW, m.parameters(), lr=1e-2, enable_amp=True, amp_options=opts)
        scale, unscale, step = opt.scale, opt.unscale_, opt.step
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", **opts)
        scale, unscale = scaler.scale, lambda: scaler.unscale_(opt)

        def step():
            scaler.step(opt)
            scaler.update()
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        scale(torch.nn.functional.cross_entropy(m(x), y)).backward()
        if i == inf_at:
            m[0].weight.grad[0, 0] = float("inf")
        if clip is not None:
            unscale()
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        step()
    return m, opt


@pytest.mark.parametrize("clip", [None, 0.5])
def test_enable_amp_matches_torch_grad_scaler(clip):
    """enable_amp is torch.amp.GradScaler around the fused step: the same parameters,
    state and loss scale as torch.optim under GradScaler, the inf step skipped (no
    parameter, state or step count moved), with or without unscale_ + clipping."""
    mk, ok = _amp_run(True, clip=clip)
    mt, ot = _amp_run(False, clip=clip)
    for a, b in zip(mk.parameters(), mt.parameters()):
        torch.testing.assert_close(a, b)
    for a, b in zip(mk.parameters(), mt.parameters()):
        for k, v in ot.state[b].items():
            torch.testing.assert_close(ok.state[a][k], v, msg=k)
    st = ok.get_stats()
    assert st["skipped_steps"] == 1 and st["steps"] == 7 and st["fused_steps"] == 7, st
    assert ok.state[next(mk.parameters())]["step"].item() == 7
    # 1024, halved by the inf step, doubled every 2 clean steps: 1024 2048 2048 1024 1024 2048 2048 4096
    assert st["loss_scale"] == 4096.0
