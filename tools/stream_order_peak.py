"""Whether the order kitsune.sched.streamed emits a model's operations in (the plan's,
interleaving the branches) changes the bytes live at once on the host's timeline, which
is what a capture plan packs: one training step of bench/models.py's Inception net
(kitsune.optimize) on the CPU, forward and backward, in the original order and in the
streamed module's. A dispatch mode counts every op output's storage from its creation
until the last tensor on it dies (views share it; parameters and inputs are left out).

    PYTHONPATH=python KITSUNE_LIBRARY=build/libkitsune.so python3 tools/stream_order_peak.py

CPU kernels and their temporaries are not cuDNN's, so the peaks are not the GPU's; the
comparison between the two orders is the point.
"""
import gc
import os
import sys
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kitsune  # noqa: E402
from kitsune import sched  # noqa: E402
from kitsune.sched import costs  # noqa: E402
from models import InceptionNet  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Storage bytes of op outputs alive at once: live now, and the most so far."""

    def __init__(self):
        super().__init__()
        self.refs = {}   # storage address -> [tensors on it, bytes]
        self.ids = set()
        self.live = self.peak = 0

    def _gone(self, key, i):
        self.ids.discard(i)
        r = self.refs.get(key)
        if r is not None:
            r[0] -= 1
            if not r[0]:
                self.live -= r[1]
                del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or id(t) in self.ids:
                continue
            key = t.untyped_storage().data_ptr()
            if not key:
                continue
            self.ids.add(id(t))
            r = self.refs.get(key)
            if r is None:
                r = self.refs[key] = [0, t.untyped_storage().nbytes()]
                self.live += r[1]
                self.peak = max(self.peak, self.live)
            r[0] += 1
            weakref.finalize(t, self._gone, key, id(t))
        return out


def step_peak(model, x, y):
    for p in model.parameters():
        p.grad = None
    gc.collect()
    mode = LiveBytes()
    with mode:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        del loss
    gc.collect()
    return mode.peak, mode.live


def main():
    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    km = kitsune.optimize(InceptionNet())
    sm, plan = sched.streamed(km, x, streams=4)
    planned = set(plan.order)
    original = [n.name for n in costs._traced(km).graph.nodes if n.name in planned]
    moved = sum(a != b for a, b in zip(original, plan.order))
    print(f"torch {torch.__version__}, CPU; Inception net (bench/models.py), batch 64, "
          f"{plan.streams_used} streams planned; {moved} of {len(original)} operations in another place")
    for name, m in (("original order", km), ("streamed order", sm)):
        peak, left = step_peak(m, x, y)
        print(f"{name:15s} peak {peak / 2**20:7.1f} MiB, left after the step {left / 2**20:5.1f} MiB")


if __name__ == "__main__":
    main()
