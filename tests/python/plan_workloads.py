"""compile_step with planned graph memory, run by test_graph.py in a fresh process
(Kitsune's allocator must be installed before CUDA initialises).

    python plan_workloads.py CASE    # mlp | shapes | lm | branchy | fused_branchy | waited_branchy | late_branchy

Trains one model three ways from the same start: the eager loop, compile_step with
plan_memory=False and with plan_memory=True. Checks (assert_close: the process fails
otherwise) that the planned graph trains as the unplanned one does (1e-6) and that the
unplanned one trains as the eager loop (the case's tolerance; for the branchy conv net
on streams, the losses), then prints one JSON line: both steps' stats().
waited_branchy is fused_branchy recorded twice: the second time planned within a budget
one byte under the first plan without waits (waits are bought only where they bring a
plan within its budget; the eager step's rise would leave this small net's plan alone);
the first recording is planned within that budget and its own again too (the JSON
line's "plans" and "replanned").
late_branchy: bias-free Conv2d branches of four widths whose weight gradients are told to
join late (as if measured fastest), planned within a budget one byte under the plan
with every join late: fewer join late (compile_step._late_over_budget); the JSON line
also has the bytes each late join kept in that first plan and the late joins of the
graph kept.
"""
import copy
import faulthandler
import json
import sys

faulthandler.enable()

import kitsune.allocator as ka

ka.install()

import torch  # noqa: E402  (after install: the allocator is chosen before CUDA initialises)
import torch.nn as nn  # noqa: E402

import kitsune  # noqa: E402
import kitsune.sched as ks  # noqa: E402
from kitsune import KitsuneOptimizer  # noqa: E402
from models import Inception  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab=96, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.block(self.emb(idx)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.block = Inception(32)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.block(torch.relu(self.stem(x))).mean((2, 3)))


class Widths(nn.Module):
    """A stem and four branches of bias-free Conv2d modules of four widths (the tensors
    their late weight gradients keep differ in size), concatenated."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1, bias=False)
        self.branches = nn.ModuleList(nn.Conv2d(32, w, k, padding=k // 2, bias=False)
                                      for w, k in ((16, 1), (32, 3), (48, 3), (64, 5)))
        self.fc = nn.Linear(160, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.fc(torch.cat([torch.relu(b(x)) for b in self.branches], 1).mean((2, 3)))


def lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def case(name):
    """model, loss_fn, batches, compile_step kwargs, tolerances"""
    g = torch.Generator().manual_seed(3)
    ce = nn.functional.cross_entropy
    if name in ("mlp", "shapes"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 5))
        sizes = (64,) if name == "mlp" else (8, 8, 64, 64, 8, 256)
        batches = [(torch.randn(b, 20, generator=g), torch.randint(0, 5, (b,), generator=g))
                   for b in (sizes[i % len(sizes)] for i in range(30))]
        kw = dict(max_shapes=2, max_grad_norm=0.5) if name == "shapes" else {}
        return model, ce, batches, kw, (1e-5, 1e-6)
    if name == "lm":
        torch.manual_seed(5)
        batches = []
        for _ in range(20):
            t = torch.randint(0, 96, (8, 65), generator=g)
            batches.append((t[:, :-1], t[:, 1:]))
        return TinyLM(), lm_loss, batches, dict(autocast_dtype=torch.bfloat16), (1e-4, 1e-5)
    if name in ("branchy", "fused_branchy", "waited_branchy", "late_branchy"):
        torch.manual_seed(0)
        torch.backends.cudnn.deterministic = True
        batches = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
                   for _ in range(12)]
        # fused_branchy: through kitsune.optimize, so its bias gradients are Kitsune's column
        # sums (dependent launches on sm_90), in the eager loop too
        model = Branchy() if name == "branchy" else kitsune.optimize(Widths() if name == "late_branchy" else Branchy())
        return model, ce, batches, dict(streams=4), (1e-3, 1e-4)
    raise SystemExit(f"unknown case {name!r}")


def budget_under_unwaited(step, replanned):
    """The step's first recording is planned as usual and noted, then dropped: the step
    records again (as it does when it cuts late joins) within a budget one byte under
    that plan without waits. The first recording is also planned twice more (noted in
    `replanned`): within that budget and within its first budget again, as
    _planned_layout plans a recording it keeps."""
    seen, plan_of = [], ka.CaptureRecording.plan

    def noted(rec, budget=None):
        plan = plan_of(rec, budget)
        seen.append(plan.info)
        if len(seen) == 1:
            replanned.extend(plan_of(rec, b).info for b in (plan.info["unwaited_bytes"] - 1, budget))
        return plan
    ka.CaptureRecording.plan = noted
    over = step._late_over_budget

    def again(plan_bytes, kept=(), floor=None):
        if len(seen) == 1:
            step._plan_budget = lambda floor=None: seen[0]["unwaited_bytes"] - 1
            return True
        return over(plan_bytes, kept, floor)
    step._late_over_budget = again
    return seen


def force_late(steps, first):
    """Both steps' weight gradients join late as if "late" had been measured fastest (the
    trial's choice depends on timings); the planned one's budget becomes, once its first
    plan is seen (noted in `first`: plan bytes, each late join's kept bytes), one byte
    under that plan."""
    for s in steps:
        def forced(args, s=s):
            s._set_conv_grads("late")
            s._conv_grads = {"convs": ks.conv_grad_splits(s._captured), "apart": True, "late": True,
                             "how": "measured", "ms": {"together": 1.0, "apart": 0.99, "late": 0.9}}
        s._choose_conv_grads = forced
    planned = steps[1]
    over = planned._late_over_budget

    def first_over(plan_bytes, kept=(), floor=None):
        if not first:
            first.append((plan_bytes, list(kept)))
            planned._eager_budget = lambda: plan_bytes - 1
        return over(plan_bytes, kept, floor)
    planned._late_over_budget = first_over


def train(step_fn, batches):
    return torch.stack([step_fn(*b).float() for b in batches])


def main(name):
    model, loss_fn, batches, kw, (rtol, atol) = case(name)
    model = model.cuda()
    batches = [tuple(t.cuda() for t in b) for b in batches]
    twins = [copy.deepcopy(model) for _ in range(2)]
    opts = [KitsuneOptimizer(torch.optim.AdamW, m.parameters(), lr=1e-3, weight_decay=0.1) for m in [model] + twins]
    amp, clip = kw.get("autocast_dtype"), kw.get("max_grad_norm")

    def eager(*b):
        opts[0].zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None, cache_enabled=False):
            out = model(*b[:-1])
            with kitsune.fx.FusedLoss():   # the loss compile_step runs (fuse_loss=True)
                loss = loss_fn(out, b[-1])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)
        opts[0].step()
        return loss.detach()

    torch.cuda.reset_peak_memory_stats()
    want = train(eager, batches)
    eager_peak = torch.cuda.max_memory_allocated()
    steps = [kitsune.compile_step(m, loss_fn, o, plan_memory=plan, **kw)
             for m, o, plan in zip(twins, opts[1:], (False, True))]
    seen, replanned = [], []
    if name == "waited_branchy":
        seen = budget_under_unwaited(steps[1], replanned)
    first = []
    if name == "late_branchy":
        force_late(steps, first)
    pool, planned = (train(s, batches) for s in steps)
    # the plan changes where blocks are, not what is computed
    torch.testing.assert_close(planned, pool, rtol=1e-6, atol=1e-7)
    for a, b in zip(twins[0].parameters(), twins[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # and both train as the eager loop does (conv nets on streams and channels-last: losses)
    torch.testing.assert_close(pool, want, rtol=rtol, atol=atol)
    if "branchy" not in name:
        for a, b in zip(model.parameters(), twins[0].parameters()):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    torch.cuda.synchronize()
    exact = bool(torch.equal(planned, pool)) and all(torch.equal(a, b) for a, b in
                                                     zip(twins[0].parameters(), twins[1].parameters()))
    out = {"stats": steps[1].stats(), "pool_stats": steps[0].stats(), "plan_equals_pool_exactly": exact,
           "eager_peak_allocated": eager_peak}
    if name == "waited_branchy":
        out.update(plans=seen, replanned=replanned)
    if name == "late_branchy":
        out.update(first_kept=first[0][1] if first else None, late_joins=len(steps[1]._late_kept()),
                   pool_late_joins=len(steps[0]._late_kept()))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
