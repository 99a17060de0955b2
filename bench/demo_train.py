"""make demo's training table: the seed workloads trained eager vs Kitsune side by
side (Kitsune = kitsune.optimize(model) + kitsune.KitsuneOptimizer; on a GPU also
Kitsune graph = the same under kitsune.compile_step, one CUDA graph a step).

    python bench/demo_train.py [--device cuda|cpu] [--steps N]

Workloads: MLP 784-512-256-10 (batch 64, SGD momentum) and a 4-layer GPT-2-style LM
(d 256, vocab 8192, batch 8 x 256, AdamW), fp32 on the CPU, bf16 parameters on the
GPU. Both variants start from the same weights and see the same batches. Printed:
median ms/step after 3 warm-up steps (CUDA events on the GPU, host time on the
CPU), the last loss of each, and peak memory on the GPU. With --device cpu the times
are CPU times, useful only to check the script.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels"))
import kitsune  # noqa: E402
import train_models as tm  # noqa: E402


def mlp():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def workloads(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 784, generator=g).to(device, dtype)
    y = torch.randint(0, 10, (64,), generator=g).to(device)
    # (label, model, loss of (model, batch), batch, optimizer, compile_step's loss_fn)
    yield ("MLP 784-512-256-10", mlp, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y),
           lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), F.cross_entropy)
    seq = torch.randint(0, 8192, (8, 257), generator=g).to(device)
    yield ("GPT-2-style LM (4 x 256)", lambda: tm.LM("gpt2", layers=4, d=256, h=4, vocab=8192, seq=256),
           lambda m, b: m(b[0], b[1]), (seq[:, :-1].contiguous(), seq[:, 1:].contiguous()),
           lambda ps: torch.optim.AdamW(ps, lr=3e-4), None)


def eager_step(model, loss_fn, batch, opt):
    def step():
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def run(step, steps, device):
    times, loss = [], None
    for i in range(steps + 3):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        loss = step()
        if device == "cuda":
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times), float(loss.detach())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (times check the script, they are not GPU numbers)"
    print(f"Training eager vs Kitsune on {name}, torch {torch.__version__}, {a.steps} steps each")
    variants = ("eager", "kitsune", "graph") if dev == "cuda" else ("eager", "kitsune")
    head = f"{'workload':28s} {'eager ms':>9s} {'kitsune ms':>10s} {'speedup':>8s}"
    if dev == "cuda":
        head += f" {'graph ms':>9s} {'speedup':>8s}"
    head += f" {'eager loss':>10s} {'kitsune loss':>12s}" + (f" {'graph loss':>10s}" if dev == "cuda" else "")
    print(head + ("  peak MiB eager / kitsune / graph" if dev == "cuda" else ""))
    for label, make, loss_fn, batch, make_opt, step_loss in workloads(dev, dtype):
        torch.manual_seed(1)
        base = make().to(dev, dtype)
        res = {}
        for variant in variants:
            m = copy.deepcopy(base)
            if variant == "eager":
                step = eager_step(m, loss_fn, batch, make_opt(m.parameters()))
            else:
                m = kitsune.optimize(m, inplace=True)
                opt = kitsune.KitsuneOptimizer(make_opt(m.parameters()))
                if variant == "kitsune":
                    step = eager_step(m, loss_fn, batch, opt)
                else:   # the whole step as one CUDA graph
                    graph = kitsune.compile_step(m, step_loss, opt)
                    step = lambda graph=graph: graph(*batch)   # noqa: E731
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ms, loss = run(step, a.steps, dev)
            peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None
            res[variant] = (ms, loss, peak)
        (em, el, ep), (km, kl, kp) = res["eager"], res["kitsune"]
        line = f"{label:28s} {em:9.2f} {km:10.2f} {em / km:7.2f}x"
        if dev == "cuda":
            gm = res["graph"][0]
            line += f" {gm:9.2f} {em / gm:7.2f}x"
        line += f" {el:10.4f} {kl:12.4f}"
        if dev == "cuda":
            line += f" {res['graph'][1]:10.4f}  {ep:.0f} / {kp:.0f} / {res['graph'][2]:.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
