"""Where a zoo model's training step spends GPU time, by recipe: bench/zoo.py's model,
batches and recipe, warmed up, then one step under torch.profiler (kernels of graph
replays included); the top kernels and their time by kind (GEMM, attention,
normalisation, pointwise, optimizer, copies, other).

    python tools/gpu/zoo_profile.py MODEL [RECIPE ...]    # e.g. gpt2 kitsune compile
"""
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import zoo  # noqa: E402

KINDS = [("gemm", ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "s16816", "wgmma")),
         ("attention", ("flash", "fmha", "attention", "sdpa")),
         ("norm", ("layer_norm", "layernorm", "rms", "ln_", "batch_norm", "bn_")),
         ("optimizer", ("adam", "sgd", "multi_tensor")),
         ("copy", ("copy", "memcpy", "memset", "cat", "transpose")),
         ("pointwise", ("elementwise", "vectorized", "ew_kernel", "chain_kernel", "triton_poi", "unrolled",
                        "gelu", "dropout", "softmax", "reduce", "triton_red", "triton_per"))]


def kind(name):
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def profile(model_name, recipe):
    cuda = torch.cuda.is_available()   # without one: the tiny models, CPU ops timed (a dry run)
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    base, loss_fn, data, opt_spec = zoo.build(model_name, gen, smoke=not cuda)
    base = base.to(dev)
    data = [tuple(t.to(dev) for t in b) for b in data]
    step, _ = zoo.make(recipe, copy.deepcopy(base), loss_fn, opt_spec, dev)
    for i in range(6):
        step(*data[i % len(data)])
    zoo._sync(dev)
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA] if cuda else [act.CPU]) as p:
        step(*data[0])
        zoo._sync(dev)
    rows = [(e.key, e.device_time_total if cuda else e.self_cpu_time_total, e.count) for e in p.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    total = sum(t for _, t, _ in rows)
    by = collections.Counter()
    for name, t, _ in rows:
        by[kind(name)] += t
    print(f"== {model_name} / {recipe}: {total / 1e3:.2f} ms of kernels in one step")
    print("  by kind: " + ", ".join(f"{k} {t / 1e3:.2f} ms ({100 * t / total:.0f}%)" for k, t in by.most_common()))
    for name, t, n in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"  {t / 1e3:8.3f} ms {n:5d}x  {kind(name):9s} {name[:90]}")


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    for rc in sys.argv[2:] or ["eager", "compile", "kitsune"]:
        profile(name, rc)
