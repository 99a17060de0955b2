"""The kernels inside one captured training step: Kitsune's (kitsune.compile_step) and
the stock whole-step graph (bench/models.py's stock_graph), for the models named.

    python tools/profile_graph.py mlp resnet18

Per model and recipe: GPU ms a step (CUDA events over 20 replays) and the host's
(the calls' wall time, not synchronized: when it is the larger, the step waits on the
host), then the
profiler's kernels over 10 replays, as us a step, calls a step and name, the largest
first (PGRAPH_ROWS of them, 18 unless set; PGRAPH_RECIPES names the recipes, default
"stock_graph kitsune"). tools/gpu_run.sh runs it as part "pgraph" (to $OUT/profile_graph.log).
"""
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import models  # noqa: E402


def kernels(step, batch, n=10):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step(*batch)
        torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time / n
            calls[e.name] += 1
    return sorted(((t, calls[k] / n, k) for k, t in total.items()), reverse=True)


def warmed(name, recipe):
    """bench/models.py's model `name` under `recipe`, seeded, after 5 steps (captured
    where the recipe captures): (step, model, batches)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, loss_fn, data = models.build(name, gen)
    step, _ = models.make(recipe, model, loss_fn)
    for i in range(5):
        step(*data[i % len(data)])
    return step, model, data


def main():
    torch.backends.cudnn.benchmark = True
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name in sys.argv[1:] or ["mlp"]:
        for recipe in os.environ.get("PGRAPH_RECIPES", "stock_graph kitsune").split():
            step, model, data = warmed(name, recipe)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            h0 = time.perf_counter()
            for i in range(20):
                step(*data[i % len(data)])
            host = (time.perf_counter() - h0) / 20 * 1e3
            b.record()
            torch.cuda.synchronize()
            rows = kernels(step, data[0])
            print(f"== {name} {recipe}: {a.elapsed_time(b) / 20:.3f} ms a step (host {host:.3f} ms a step); kernels "
                  f"{sum(r[0] for r in rows):.1f} us, {sum(r[1] for r in rows):.0f} launches a step")
            for us, c, k in rows[:int(os.environ.get("PGRAPH_ROWS", 18))]:
                print(f"  {us:8.1f} us  {c:5.1f}x  {k[:110]}")
            del step, model
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
