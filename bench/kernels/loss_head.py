"""The loss head, logits = x @ W^T then cross-entropy, forward + backward:
kitsune.ops.linear_cross_entropy against eager PyTorch and torch.compile.

    python bench/kernels/loss_head.py [--out DIR] [--quick]

Shapes (bf16): GPT-2 small (8192 rows = batch 8 x 1024 tokens, hidden 768, vocab
50257) and a LLaMA-3-8B-sized head (4096 rows, hidden 4096, vocab 128256). For each
variant: median ms of a forward + backward (CUDA events, 10 repeats after 3 warm-up
calls), peak memory allocated during it above what was allocated before
(torch.cuda.max_memory_allocated), and the loss and gradients against eager's
(max |difference| / max |eager|). Writes kernels_loss_head.json.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cuda_ms, write_result  # noqa: E402
import kitsune.ops as ko


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w), t)


def run(fn, x, w, t, reps):
    def step():
        x.grad = w.grad = None
        loss = fn(x, w, t)
        loss.backward()
        return loss
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = cuda_ms(step, reps)
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return ms, peak, loss.detach().float(), x.grad.float(), w.grad.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    reps = 5 if a.quick else 10
    shapes = {"gpt2": (8192, 768, 50257), "llama3_8b": (4096, 4096, 128256)}
    compiled = torch.compile(eager)
    rows = []
    for label, (n, h, v) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        res = {}
        for name, fn in (("eager", eager), ("compile", compiled), ("kitsune", ko.linear_cross_entropy)):
            res[name] = run(fn, x, w, t, reps)
        ref = res["eager"]
        for name, (ms, peak, loss, gx, gw) in res.items():
            row = {"shape": label, "rows": n, "hidden": h, "vocab": v, "variant": name, "ms": ms,
                   "peak_mib": peak / 2**20, "peak_vs_eager": peak / ref[1], "loss": loss.item(),
                   "loss_diff": abs(loss.item() - ref[2].item()),
                   "grad_x_rel": ((gx - ref[3]).abs().max() / ref[3].abs().max()).item(),
                   "grad_w_rel": ((gw - ref[4]).abs().max() / ref[4].abs().max()).item()}
            rows.append(row)
            print(f"{label:9s} {name:8s} {ms:8.2f} ms  peak {row['peak_mib']:8.0f} MiB ({row['peak_vs_eager']:.2f}x eager)"
                  f"  loss {row['loss']:.5f}  grad rel diff x {row['grad_x_rel']:.1e} w {row['grad_w_rel']:.1e}",
                  flush=True)
        del x, w, t, res, ref
        torch.cuda.empty_cache()
    write_result(a.out, "kernels_loss_head", {"reps": reps, "rows": rows})


if __name__ == "__main__":
    main()
