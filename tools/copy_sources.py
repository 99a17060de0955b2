"""Where a model's copy kernels come from: one eager training step of the kitsune recipe
(kitsune.optimize, channels-last input as compile_step captures it) under the profiler,
every aten::copy_ listed by the chain of operators that called it, with its shapes and
the GPU time of the kernels it launched. (A TorchDispatchMode listing copying ops with
their strides was tried at 68d5f38 and dropped: it sees no copy made inside an ATen
kernel, which is where these are: bench/results/h100_copies_68d5f38.log.)

    python tools/copy_sources.py inception

A diagnostic (tools/gpu_run.sh part "copies", models in COPY_MODELS): the captured step
runs the same operators, but its kernels cannot be attributed to them.
"""
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import models  # noqa: E402

import kitsune  # noqa: E402


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
    for name in sys.argv[1:] or ["inception"]:
        gen = torch.Generator().manual_seed(0)
        model, loss_fn, data = models.build(name, gen)
        km = kitsune.optimize(model)
        x, y = data[0]
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        for _ in range(2):   # warm-up: cuDNN's algorithm search
            loss_fn(km(x), y).backward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            loss_fn(km(x), y).backward()
            torch.cuda.synchronize()
        rows = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.name == "aten::copy_":
                key = (chain(e), str(e.input_shapes[:2]))
                rows[key][0] += 1
                rows[key][1] += e.device_time_total
        total = sum(r[1] for r in rows.values())
        print(f"== {name}: {sum(r[0] for r in rows.values())} aten::copy_ calls, {total:.1f} us of their kernels")
        for (where, shapes), (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:8.1f} us {n:3d}x  {where[:110]}  {shapes[:90]}")


if __name__ == "__main__":
    main()
