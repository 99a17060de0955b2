"""Where a model's copy kernels come from: one eager training step of the kitsune recipe
(kitsune.optimize, channels-last input as compile_step captures it) under the profiler,
every aten::copy_ listed by the chain of operators that called it, with its shapes and
the GPU time of the kernels it launched; then the same step under a dispatch mode that
lists each copying op (clone, _to_copy, copy_) of a tensor of 2^16 elements or more with
its source's strides and the autograd node running it (backward copies).

    python tools/copy_sources.py inception

A diagnostic (tools/gpu_run.sh part "copies", models in COPY_MODELS): the captured step
runs the same operators, but its kernels cannot be attributed to them.
"""
import os
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class CopyLog(TorchDispatchMode):
    OPS = ("aten::clone", "aten::_to_copy", "aten::copy_")

    def __init__(self):
        super().__init__()
        self.rows = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.OPS:
            src = args[1] if name == "aten::copy_" else args[0]
            if isinstance(src, torch.Tensor) and src.numel() >= 1 << 16:
                node = torch._C._current_autograd_node()
                fmt = kwargs.get("memory_format")
                self.rows[(name, tuple(src.shape), src.stride(), str(fmt) if fmt is not None else "",
                           type(node).__name__ if node is not None else "forward")] += 1
        return func(*args, **kwargs)


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
        log = CopyLog()
        with log:
            loss_fn(km(x), y).backward()
        torch.cuda.synchronize()
        print(f"-- {name}: copying ops of >= 2^16 elements (op, shape, source strides, memory_format, autograd node)")
        for (op, shape, stride, fmt, node), n in sorted(log.rows.items(), key=lambda kv: -kv[1]):
            print(f"  {n:3d}x  {op:15s} {str(shape):20s} strides {str(stride):24s} {fmt:28s} {node}")


if __name__ == "__main__":
    main()
