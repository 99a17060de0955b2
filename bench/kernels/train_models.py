"""End to end: a GPT-2-style and a LLaMA-style language model trained with
kitsune.optimize(model) against eager PyTorch and torch.compile.

    python bench/kernels/train_models.py [--out DIR] [--steps N] [--quick]

Models (bf16 parameters, AdamW(fused=True), batch 8 x 1024 tokens, no dropout):
  gpt2   GPT-2 small: 12 layers, d 768, 12 heads, LayerNorm, GELU(tanh) MLP 3072,
         learned positions, vocab 50257, loss head F.cross_entropy(logits.view(-1, V))
  llama  12 layers, d 768, 12 heads, RMSNorm, SwiGLU 2048, no biases, vocab 32000
         (no rotary embeddings: they do not change what is fused)
Each variant starts from the same weights and trains N steps (default 100) on the
same 8 fixed sequences (so the loss falls); eager and kitsune train a second time
after torch.compile (round 2: the spread between rounds is the machine's). Reported:
median ms/step over steps 10..N (CUDA events), the host's median time per step,
peak memory allocated, setup time (optimize() for Kitsune; the
first step's extra time for torch.compile), the loss curve's largest difference
from eager's, and what Kitsune fused. Writes kernels_train_models.json.
"""
import argparse
import copy
import os
import sys
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import write_result  # noqa: E402
import kitsune


def attention(qkv, h):
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = qkv.split(d, dim=2)
    q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class GPT2Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gelu, self.h = nn.GELU(approximate="tanh"), h

    def forward(self, x):
        x = x + self.proj(attention(self.qkv(self.ln1(x)), self.h))
        return x + self.out(self.gelu(self.fc(self.ln2(x))))


class LlamaBlock(nn.Module):
    def __init__(self, d, h, f):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w2, self.w3 = (nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False),
                                     nn.Linear(d, f, bias=False))
        self.h = h

    def forward(self, x):
        x = x + self.o(attention(self.qkv(self.n1(x)), self.h))
        hdn = self.n2(x)
        return x + self.w2(F.silu(self.w1(hdn)) * self.w3(hdn))


class LM(nn.Module):
    def __init__(self, kind, layers=12, d=768, h=12, vocab=50257, seq=1024):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02) if kind == "gpt2" else None
        self.blocks = nn.Sequential(*[GPT2Block(d, h) if kind == "gpt2" else LlamaBlock(d, h, 2048)
                                      for _ in range(layers)])
        self.norm = nn.LayerNorm(d) if kind == "gpt2" else nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.pos is not None:
            x = x + self.pos[: idx.shape[1]]
        logits = self.head(self.norm(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train(model, data, steps):
    idx, tgt = data
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    losses, times, host = [], [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first = None
    for i in range(steps):
        h0 = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        b.record()
        losses.append(loss.detach())
        if i == 0:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
        times.append((a, b))
        host.append((time.perf_counter() - h0) * 1e3)
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in times]
    # host_ms: the host's time per iteration (no sync in the loop): about ms when the
    # step is host-bound, less when the host runs ahead of the GPU
    return {"ms": statistics.median(ms[10:]), "host_ms": statistics.median(host[10:]), "first_step_s": first,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "losses": [v.float().item() for v in losses]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    steps = 30 if a.quick else a.steps
    rows = []
    for kind, vocab in (("gpt2", 50257), ("llama", 32000)):
        torch.manual_seed(0)
        base = LM(kind, vocab=vocab).cuda().to(torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(1)
        seqs = torch.randint(0, vocab, (8, 1025), device="cuda", generator=g)
        data = (seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())
        res, again = {}, {}
        # eager and kitsune run a second time after compile: the spread between rounds
        # shows how much of a difference is the machine's
        for variant in ("eager", "kitsune", "compile", "eager 2", "kitsune 2"):
            second = variant.endswith(" 2")
            variant = variant.split()[0]
            model = copy.deepcopy(base)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fused = None
            if variant == "kitsune":
                rep = kitsune.fx.Report()
                model = kitsune.optimize(model, inplace=True, report=rep)
                fused = sorted({w.split(" -> ")[1].split(" ")[0] for _, w in rep.fused})
                fused = {k: sum(1 for _, w in rep.fused if w.split(" -> ")[1].split(" ")[0] == k) for k in fused}
            elif variant == "compile":
                model = torch.compile(model)
            setup = time.perf_counter() - t0
            r = train(model, data, steps)
            r["setup_s"] = setup + (r["first_step_s"] - res["eager"]["first_step_s"] if variant == "compile" else 0)
            r["fused"] = fused
            (again if second else res)[variant] = r
            del model
            torch.cuda.empty_cache()
        for rnd, rs in ((1, res), (2, again)):
            for variant, r in rs.items():
                diff = max(abs(x - y) for x, y in zip(r["losses"], res["eager"]["losses"]))
                row = {"model": kind, "variant": variant, "round": rnd, "ms": r["ms"], "host_ms": r["host_ms"],
                       "speedup_vs_eager": rs["eager"]["ms"] / r["ms"], "peak_mib": r["peak_mib"],
                       "setup_s": r["setup_s"], "loss_first": r["losses"][0], "loss_last": r["losses"][-1],
                       "max_loss_diff_vs_eager": diff, "fused": r["fused"], "losses": r["losses"]}
                rows.append(row)
                print(f"{kind:6s} {variant:8s} r{rnd} {r['ms']:8.2f} ms/step ({row['speedup_vs_eager']:.3f}x eager, "
                      f"host {r['host_ms']:6.2f} ms)  peak {r['peak_mib']:7.0f} MiB  setup {r['setup_s']:6.2f} s  "
                      f"loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}  max |loss - eager| {diff:.4f}" +
                      (f"  fused {r['fused']}" if r["fused"] else ""), flush=True)
        del base
    write_result(a.out, "kernels_train_models", {"steps": steps, "rows": rows})


if __name__ == "__main__":
    main()
