"""Training loops as people write them, with Kitsune in them: gradient accumulation over
micro-batches (compile_step(micro_batches=k)), evaluation between training steps, and
Hugging Face's Trainer given kitsune.optimize's model and a KitsuneOptimizer with its LR
scheduler. The CPU runs (compile_step falls back to eager steps without CUDA) check the
arithmetic against a hand-written loop; the GPU runs check that the captured step does
the same."""
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
from kitsune import KitsuneOptimizer  # noqa: E402
from support import gpu  # noqa: E402

F = torch.nn.functional


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 5))


def _batches(device, n=6, rows=8):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(rows, 12, generator=g).to(device), torch.randint(0, 5, (rows,), generator=g).to(device))
            for _ in range(n)]


def _accumulated_by_hand(model, opt, batches, k):
    """The loop a user writes: k micro-batches, each loss / k backward, one update."""
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            loss = F.cross_entropy(model(xs), ys)
            (loss / k).backward()
            total = total + loss.detach()
        opt.step()
        losses.append(total / k)
    return torch.stack(losses)


def _check_accumulation(device, tol):
    a = _mlp().to(device)
    b = copy.deepcopy(a)
    batches = _batches(device)
    oa = KitsuneOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    step = kitsune.compile_step(a, F.cross_entropy, oa, micro_batches=4)
    got = torch.stack([step(x, y) for x, y in batches])
    want = _accumulated_by_hand(b, ob, batches, 4)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    return step.stats()


def test_micro_batches_accumulate_as_the_hand_written_loop_on_cpu():
    st = _check_accumulation("cpu", 1e-6)
    assert st["eager_steps"] == 6 and st["reason"] is not None   # no CUDA: eager steps, saying why


def test_micro_batches_refuse_a_batch_they_do_not_divide():
    a = _mlp()
    step = kitsune.compile_step(a, F.cross_entropy, torch.optim.SGD(a.parameters(), lr=0.1), micro_batches=3)
    with pytest.raises(ValueError, match="batch item 0 has 8 rows along dim 0, which micro_batches=3"):
        step(torch.randn(8, 12), torch.randint(0, 5, (8,)))
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
            kitsune.compile_step(a, F.cross_entropy, torch.optim.SGD(a.parameters(), lr=0.1), micro_batches=bad)


@pytest.mark.gpu
@gpu
def test_gpu_micro_batches_captured_accumulate_as_the_hand_written_loop():
    st = _check_accumulation("cuda", 1e-5)
    assert st["reason"] is None and st["replays"] == 5 and st["captures"] == 1, st


class _Net(torch.nn.Module):
    """BatchNorm and dropout: a model whose train and eval forwards differ."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.drop, self.b = (torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32),
                                              torch.nn.Dropout(0.0), torch.nn.Linear(32, 5))

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.bn(self.a(x)))))


@pytest.mark.gpu
@gpu
def test_gpu_evaluation_between_captured_steps_and_a_step_in_eval_mode():
    """model.eval() + no_grad forwards between training steps leave the captured step as
    the eager loop; a step called while the model is in eval mode is a graph of its own
    (BatchNorm's running statistics used and left alone), not the train-mode replay."""
    torch.manual_seed(0)
    a = _Net().cuda()
    b = copy.deepcopy(a)
    batches = _batches("cuda", n=8)
    val = torch.randn(16, 12, device="cuda")
    oa = KitsuneOptimizer(torch.optim.SGD, a.parameters(), lr=0.05, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    step = kitsune.compile_step(a, F.cross_entropy, oa)
    for i, (x, y) in enumerate(batches):
        a.train(i != 6), b.train(i != 6)   # step 6 runs in eval mode, as a forgotten model.train() would
        got = step(x, y)
        ob.zero_grad(set_to_none=True)
        want = F.cross_entropy(b(x), y)
        want.backward()
        ob.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
        if i % 2 == 1:
            a.eval(), b.eval()
            with torch.no_grad():
                torch.testing.assert_close(a(val), b(val), rtol=1e-5, atol=1e-5)
    for p, q in zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers())):
        torch.testing.assert_close(p.float(), q.float(), rtol=1e-5, atol=1e-5)
    st = step.stats()
    assert st["reason"] is None and st["captures"] == 2 and st["graphs"] == 2, st


def test_hugging_face_trainer_with_optimize_and_kitsune_optimizer():
    """transformers.Trainer trains kitsune.optimize's GPT-2 with a KitsuneOptimizer and a
    transformers LR schedule passed as optimizers=(opt, scheduler), on the CPU: every
    step fused, the schedule followed, and the logged losses those of the same Trainer
    run on the original model with torch.optim.AdamW."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    original = T.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(64)]

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    steps = 12

    def train(model, opt):
        sched = T.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps)
        args = T.TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kitsune-trainer"),
                                   max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
                                   save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                   dataloader_num_workers=0, seed=0)
        trainer = T.Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched))
        trainer.train()
        assert sched.last_epoch == steps and opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    reference = copy.deepcopy(original)
    want = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3))
    model = kitsune.optimize(original)
    opt = KitsuneOptimizer(torch.optim.AdamW, model.parameters(), lr=3e-3)
    got = train(model, opt)
    assert len(got) == steps and got == pytest.approx(want, rel=1e-4), (got, want)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    st = opt.get_stats()
    assert st["steps"] == steps and st["fused_steps"] == steps and st["path"] == "fused", st


@pytest.mark.gpu
@gpu
def test_gpu_new_shapes_after_the_graphs_overflow_are_captured_when_they_come_back():
    """Batches of changing size with max_shapes=2 (dynamic padding's changing sequence
    lengths): once a graph was dropped, a signature met for the first time runs one eager
    step (one warning says so), is captured when it comes back, and the training is the
    eager loop's throughout."""
    a = _mlp().cuda()
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(5)
    rows = [8, 16, 24, 32, 32, 8, 40, 48, 40, 40]
    batches = [(torch.randn(r, 12, generator=g).cuda(), torch.randint(0, 5, (r,), generator=g).cuda()) for r in rows]
    oa = KitsuneOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    step = kitsune.compile_step(a, F.cross_entropy, oa, max_shapes=2)
    with pytest.warns(UserWarning, match="more batch signatures than max_shapes=2") as caught:
        got = torch.stack([step(x, y) for x, y in batches])
    assert sum("max_shapes" in str(w.message) for w in caught) == 1
    want = _accumulated_by_hand(b, ob, batches, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    st = step.stats()
    # captured: 8, 16, 24 (8 dropped), 32 on its return, 8 (seen before), 40 on its return;
    # eager once each: 32, 40, 48 (new after the first drop)
    assert st["uncaptured_steps"] == 3 and st["captures"] == 6 and st["replays"] == 1, st


def _hf_gpt2_lm():
    T = pytest.importorskip("transformers")
    cfg = T.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = T.GPT2LMHeadModel(cfg)

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels).loss
    g = torch.Generator().manual_seed(6)
    batches = [(ids, ids) for ids in (torch.randint(0, 64, (2, 16), generator=g) for _ in range(4))]
    return LM(), None, batches


def _tv_resnet18():
    tv = pytest.importorskip("torchvision")
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(4)]
    return tv.models.resnet18(num_classes=10), F.cross_entropy, batches


def _dynamo_step_against_eager(make, device, tol, **kw):
    torch.manual_seed(0)
    model, loss_fn, batches = make()
    model = model.to(device)
    batches = [tuple(t.to(device) for t in b) for b in batches]
    twin = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=1e-3, momentum=0.9)
    want = []
    for b in batches:
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_fn(twin(*b[:-1]), b[-1]) if loss_fn is not None else twin(*b)
        loss.backward()
        ref_opt.step()
        want.append(loss.detach())
    torch._dynamo.reset()
    opt = KitsuneOptimizer(torch.optim.SGD, model.parameters(), lr=1e-3, momentum=0.9)
    step = kitsune.compile_step(model, loss_fn, opt, dynamo=True, **kw)
    got = [step(*b) for b in batches]
    report = kitsune.fx.backend.last_compile_report
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=tol, atol=tol)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    return step.stats(), report


@pytest.mark.parametrize("make", [_hf_gpt2_lm, _tv_resnet18], ids=["hf_gpt2", "tv_resnet18"])
def test_compile_step_dynamo_path_trains_as_eager_on_cpu(make):
    """compile_step(dynamo=True): the forward runs through Kitsune's own Dynamo path (the
    patterns in Dynamo's graphs, AOTAutograd, no Inductor); on the CPU its eager steps
    train as the plain model does."""
    import kitsune.fx  # noqa: F401 - the backend's report
    st, report = _dynamo_step_against_eager(make, "cpu", 1e-4)
    assert st["eager_steps"] == 4 and report is not None and len(report.fused) > 0, (st, str(report))
    with pytest.raises(ValueError, match="dynamo must be True or False"):
        kitsune.compile_step(torch.nn.Linear(2, 2), None, torch.optim.SGD([torch.zeros(1)], lr=1), dynamo=1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", [_hf_gpt2_lm, _tv_resnet18], ids=["hf_gpt2", "tv_resnet18"])
def test_gpu_compile_step_dynamo_path_captures_and_trains_as_eager(make):
    """compile_step(dynamo=True) on the GPU: the Dynamo-compiled forward is captured with
    the backward and the update (every step after the first replays) and trains as eager
    (fp32, cuDNN deterministic, no TF32; NCHW, as the eager twin: the channels-last
    comparison is test_zoo_gpu's)."""
    import kitsune.fx  # noqa: F401
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        st, _ = _dynamo_step_against_eager(make, "cuda", 2e-4, channels_last=False)
    assert st["reason"] is None and st["replays"] == 3, st
