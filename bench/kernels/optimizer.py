"""Optimizer step time: kitsune.KitsuneOptimizer's fused step against torch.optim's
AdamW (foreach, and fused=True) and SGD with momentum (foreach), on the parameter
shapes of GPT-2 small (124M parameters, 148 tensors) in fp32 and bf16.

    python bench/kernels/optimizer.py [--out DIR] [--quick]

Median ms per step over 50 steps after 5 warm-up steps (CUDA events; gradients fixed,
so only the step is timed). Parameters after 10 steps are compared with torch's
foreach step (max |difference|). Writes kernels_optimizer.json.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cuda_ms, write_result  # noqa: E402
from kitsune.optim import KitsuneOptimizer  # noqa: E402


def gpt2_shapes(layers=12, d=768, vocab=50257, seq=1024):
    shapes = [(vocab, d), (seq, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def make(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.randn(s, device="cuda", dtype=dtype, generator=g) * 0.02 for s in gpt2_shapes()]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=g) * 1e-3
    return ps


def time_steps(opt, steps, warm=5):
    for _ in range(warm):
        opt.step()
    torch.cuda.synchronize()
    return cuda_ms(opt.step, steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    steps = 10 if a.quick else 50
    variants = {
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
        "adamw_kitsune": lambda ps: KitsuneOptimizer(torch.optim.AdamW, ps, lr=1e-3, weight_decay=0.1),
        "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "sgd_kitsune": lambda ps: KitsuneOptimizer(torch.optim.SGD, ps, lr=1e-2, momentum=0.9),
    }
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        results = {}
        for name, mk in variants.items():
            ps = make(dtype)
            opt = mk(ps)
            for _ in range(10):   # parameters after 10 steps, for the comparison
                opt.step()
            results[name] = [p.detach().float().clone() for p in ps]
            ms = time_steps(opt, steps)
            ref = results[name.split("_")[0] + "_foreach"]
            diff = max((x - y).abs().max().item() for x, y in zip(results[name], ref))
            n = sum(p.numel() for p in ps)
            row = {"dtype": str(dtype).replace("torch.", ""), "variant": name, "ms": ms, "params": n,
                   "tensors": len(ps), "max_diff_vs_foreach_10_steps": diff}
            rows.append(row)
            print(f"{row['dtype']:8s} {name:14s} {ms:7.3f} ms/step  ({n / 1e6:.0f}M params in {len(ps)} tensors)  "
                  f"max |p - foreach| after 10 steps {diff:.2e}", flush=True)
            del ps, opt
            torch.cuda.empty_cache()
    write_result(a.out, "kernels_optimizer", {"steps": steps, "rows": rows})


if __name__ == "__main__":
    main()
