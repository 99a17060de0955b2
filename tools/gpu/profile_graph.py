"""The kernels inside one captured training step: Kitsune's (kitsune.compile_step) and
the stock whole-step graph (bench/models.py's stock_graph), for the models named.

    python tools/gpu/profile_graph.py mlp resnet18

Per model and recipe: GPU ms a step (CUDA events over 20 replays) and the host's
(the calls' wall time, not synchronized: when it is the larger, the step waits on the
host), then the
profiler's kernels over 10 replays, as us a step, calls a step and name, the largest
first (PGRAPH_ROWS of them, 18 unless set; PGRAPH_RECIPES names the recipes, default
"stock_graph kitsune"). tools/gpu/gpu_run.sh runs it as part "pgraph" (to $OUT/profile_graph.log).
A model may name its batch size (inception:8). PGRAPH_TIMELINE=1 adds one replay's
timeline: each GPU operation's start (us from the step's first), duration, stream and
name, then the step's span, the time some stream runs a kernel (the union of the
intervals), each stream's busy time, and the idle gaps over 1 us with the operations
either side. PGRAPH_PLANNED=1 profiles bench/models.py's planned setting instead:
Kitsune's allocator installed first (compile_step then plans its graph's memory) and
cudnn.benchmark off; set TORCH_CUDNN_USE_HEURISTIC_MODE_B=1 beside it for mode B.
"""
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
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


def timeline(step, batch):
    """One replay's GPU operations from the profiler's trace: (start us, dur us, stream, name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(*batch)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        ev = json.load(open(f.name))["traceEvents"]
    ops = [(e["ts"], e["dur"], e.get("args", {}).get("stream", e.get("tid")), e["name"]) for e in ev
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops.sort()
    t0 = ops[0][0]
    return [(ts - t0, d, s, n) for ts, d, s, n in ops]


def print_timeline(ops):
    for ts, d, s, n in ops:
        print(f"  T {ts:9.1f} {d:7.1f}  s{s}  {n[:90]}")
    span = max(ts + d for ts, d, _, _ in ops)
    busy, end, gaps, last = 0.0, 0.0, [], None
    for ts, d, s, n in ops:
        if ts > end and last is not None and ts - end > 1.0:
            gaps.append((ts - end, end, last, n))
        if ts + d > end:
            busy += ts + d - max(ts, end)
            end, last = ts + d, n
    per = {}
    for ts, d, s, n in ops:
        per[s] = per.get(s, 0.0) + d
    print(f"  span {span:.1f} us, some stream busy {busy:.1f} us, idle {span - busy:.1f} us in {len(gaps)} gaps > 1 us")
    print("  busy by stream: " + ", ".join(f"s{s} {t:.1f} us" for s, t in sorted(per.items(), key=lambda x: -x[1])))
    for g, at, a, b in sorted(gaps, reverse=True)[:25]:
        print(f"  gap {g:6.1f} us at {at:8.1f}: {a[:50]} -> {b[:50]}")


def warmed(name, recipe):
    """bench/models.py's model `name` under `recipe`, seeded, after 5 steps (captured
    where the recipe captures): (step, model, batches)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, loss_fn, data = models.build_spec(name, gen)
    # as bench/models.py's child and run, so that compile_step plans within the bench's
    # budget (without the eager steps the branchy net at batch 8 planned within 104.9 MiB,
    # not 41.0: bench/results/archive/h100_profile_graph_inception8_fresh_1142736.log)
    models.warm_up(model, loss_fn, data)
    models.fresh_peak()
    step, _ = models.make(recipe, model, loss_fn)
    for i in range(5):
        step(*data[i % len(data)])
    return step, model, data


def main():
    planned = os.environ.get("PGRAPH_PLANNED") == "1"
    if planned:   # before CUDA starts, as bench/models.py --kitsune-allocator
        import kitsune
        kitsune.allocator.install()
    torch.backends.cudnn.benchmark = not planned
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{'planned (Kitsune allocator, cudnn.benchmark off)' if planned else 'cudnn.benchmark on'}, "
          f"TORCH_CUDNN_USE_HEURISTIC_MODE_B={os.environ.get('TORCH_CUDNN_USE_HEURISTIC_MODE_B')}")
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
            mp = (step.stats().get("memory_plan") or {}) if hasattr(step, "stats") else {}
            if mp.get("plan_bytes") is not None:
                budget = "none" if mp.get("budget") is None else f"{mp['budget'] / 2**20:.1f} MiB"
                print(f"  memory plan {mp['plan_bytes'] / 2**20:.1f} MiB, {mp.get('waits')} waits (gap "
                      f"{mp.get('wait_gap')}), budget {budget}")
            for us, c, k in rows[:int(os.environ.get("PGRAPH_ROWS", 18))]:
                print(f"  {us:8.1f} us  {c:5.1f}x  {k[:110]}")
            if os.environ.get("PGRAPH_TIMELINE"):
                print_timeline(timeline(step, data[0]))
            del step, model
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
