"""compile_step with planned graph memory, run by test_graph.py in a fresh process
(Kitsune's allocator must be installed before CUDA initialises).

    python plan_workloads.py CASE [--no-plan]    # mlp | shapes | lm | branchy

Trains a model with compile_step(plan_memory=True) next to the eager loop from the
same start, checks that they train alike (assert_close: the process fails otherwise),
and prints one JSON line: the step's stats() and the memory it measured.
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
        self.block = ks.Inception(32)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.block(torch.relu(self.stem(x))).mean((2, 3)))


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
    if name == "branchy":
        torch.manual_seed(0)
        torch.backends.cudnn.deterministic = True
        batches = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
                   for _ in range(12)]
        return Branchy(), ce, batches, dict(streams=4), (1e-4, 1e-5)
    raise SystemExit(f"unknown case {name!r}")


def main(name, plan=True):
    model, loss_fn, batches, kw, (rtol, atol) = case(name)
    model = model.cuda()
    batches = [tuple(t.cuda() for t in b) for b in batches]
    twin = copy.deepcopy(model)
    o1 = KitsuneOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.1)
    o2 = KitsuneOptimizer(torch.optim.AdamW, twin.parameters(), lr=1e-3, weight_decay=0.1)
    amp = kw.get("autocast_dtype")
    clip = kw.get("max_grad_norm")
    want = []
    torch.cuda.reset_peak_memory_stats()
    for b in batches:   # the eager loop
        o1.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None, cache_enabled=False):
            loss = loss_fn(model(*b[:-1]), b[-1])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)
        o1.step()
        want.append(loss.detach().float())
    eager_peak = torch.cuda.max_memory_allocated()
    step = kitsune.compile_step(twin, loss_fn, o2, plan_memory=plan, **kw)
    got = torch.stack([step(*b).float() for b in batches])
    torch.testing.assert_close(got, torch.stack(want), rtol=rtol, atol=atol)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    torch.cuda.synchronize()
    st = step.stats()
    print(json.dumps({"stats": {k: v for k, v in st.items() if not isinstance(v, float) or v == v},
                      "eager_peak_allocated": eager_peak, "allocated_after": torch.cuda.memory_allocated()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--no-plan" not in sys.argv[2:])
