"""Where a model's copy kernels come from: one eager training step of the kitsune recipe
(kitsune.optimize, KitsuneOptimizer's AdamW, channels-last input and Conv2d weights where
compile_step's default would choose them) under the profiler,
every aten::copy_ listed by the chain of operators that called it, with its shapes and
the GPU time of the kernels it launched. (A TorchDispatchMode listing copying ops with
their strides was tried at 68d5f38 and dropped: it sees no copy made inside an ATen
kernel, which is where these are: bench/results/archive/h100_copies_68d5f38.log.)

    python tools/gpu/copy_sources.py inception
    python tools/gpu/copy_sources.py resnet18 --kernels 'Fill|Memset|add<long>'   # other kernels, by operator

A diagnostic (tools/gpu/gpu_run.sh part "copies", models in COPY_MODELS): the captured step
runs the same operators, but its kernels cannot be attributed to them.
"""
import argparse
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import models  # noqa: E402

import kitsune  # noqa: E402
from kitsune.graph.layout import _conv_weights, _nhwc_suits, _relayout  # noqa: E402


def chain(e):
    names = []
    p = e.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return " < ".join(names[:4]) or "(top level)"


def main():
    torch.backends.cudnn.benchmark = True
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["inception"])
    ap.add_argument("--kernels", metavar="REGEX", help="the kernels so named, by the operator that launched them "
                    "(default: every aten::copy_)")
    args = ap.parse_args()
    pattern = args.kernels
    for name in args.models:
        gen = torch.Generator().manual_seed(0)
        model, loss_fn, data = models.build(name, gen)
        km = kitsune.optimize(model)
        opt = kitsune.KitsuneOptimizer(torch.optim.AdamW, km.parameters(), lr=1e-3)
        x, y = data[0]
        if x.dim() == 4 and _nhwc_suits(km)[0]:   # as compile_step lays out a conv net: input and weights
            x = x.contiguous(memory_format=torch.channels_last)
            _relayout(_conv_weights(km), opt, torch.channels_last)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(km(x), y).backward()
            opt.step()
        for _ in range(2):   # warm-up: cuDNN's algorithm search
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        rows = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if pattern is None and e.name == "aten::copy_":
                key = (chain(e), str(e.input_shapes[:2]))
                rows[key][0] += 1
                rows[key][1] += e.device_time_total
            elif pattern is not None and e.device_type == torch.autograd.DeviceType.CPU:
                for k in e.kernels:   # the kernels this operator itself launched
                    if re.search(pattern, k.name):
                        key = (f"{k.name[:40]} in {e.name} < {chain(e)}", str(e.input_shapes[:2]))
                        rows[key][0] += 1
                        rows[key][1] += k.duration
        total = sum(r[1] for r in rows.values())
        what = "aten::copy_ calls" if pattern is None else f"kernels matching {pattern!r}"
        print(f"== {name}: {sum(r[0] for r in rows.values())} {what}, {total:.1f} us of them")
        for (where, shapes), (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:8.1f} us {n:3d}x  {where[:110]}  {shapes[:90]}")


if __name__ == "__main__":
    main()
