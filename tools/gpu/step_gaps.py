"""Where a training step's GPU waits: one step of bench/kernels/train_models.py's
models (eager or kitsune.optimize) profiled with CPU and CUDA activities; the trace's
idle gaps between GPU operations are split into
  host-late   the next kernel was launched after the previous one had finished
              (the GPU waited on Python / dispatcher / launch time), and
  other       the next kernel was already queued (a dependency or a sync),
and the largest host-late gaps are listed with the CPU ops around the late launch.
Synchronising runtime calls (cudaStreamSynchronize, cudaDeviceSynchronize,
cudaMemcpy, cudaEventSynchronize) are totalled.

    python tools/gpu/step_gaps.py [gpt2|llama] [eager|kitsune] [--top N]
"""
import argparse
import bisect
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_train import training_step  # noqa: E402

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize", "cudaMemcpyAsync")


def host_times(m, idx, opt, reps=10):
    """Host milliseconds of forward, backward and optimizer step (median of reps), each
    phase called with the GPU idle and its queue empty (a sync before it), so the host
    never waits: what the host itself spends, without the profiler's overhead."""
    import statistics
    import time
    t = {"forward": [], "backward": [], "step": []}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = m(idx, idx)
        t["forward"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        t["backward"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t["step"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in t.items()}


def trace_step(kind, variant):
    m, idx, opt, step = training_step(kind, variant)
    for _ in range(5):
        step()
    h = host_times(m, idx, opt)
    print("host ms (no profiler, GPU idle before each phase): " + ", ".join(f"{k} {v:.2f}" for k, v in h.items()) +
          f"; total {sum(h.values()):.2f}")
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as p:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def analyse(events, top):
    ev = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    rt = {e["args"]["correlation"]: e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
          and "correlation" in e.get("args", {})}
    ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [o["ts"] for o in ops]
    busy = sum(e["dur"] for e in gpu)
    first_cpu = min(starts) if starts else gpu[0]["ts"]
    wall = gpu[-1]["ts"] + gpu[-1]["dur"] - first_cpu
    late, other = [], 0.0
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for prev, nxt in zip(gpu, gpu[1:]):
        gap = nxt["ts"] - end
        if gap > 1.0:
            launch = rt.get(nxt["args"].get("correlation"))
            if launch is not None and launch["ts"] > end:
                late.append((gap, prev, nxt, launch))
            else:
                other += gap
        end = max(end, nxt["ts"] + nxt["dur"])
    sync = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"].startswith(SYNCS):
            sync[e["name"]] = sync.get(e["name"], 0.0) + e["dur"]
    print(f"step: {wall / 1e3:.2f} ms from the first CPU op to the last GPU op; GPU busy {busy / 1e3:.2f} ms "
          f"({len(gpu)} GPU ops); idle {(wall - busy) / 1e3:.2f} ms: host-late gaps "
          f"{sum(g[0] for g in late) / 1e3:.2f} ms ({len(late)}), other gaps {other / 1e3:.2f} ms")
    print("synchronising runtime calls (us): " + (", ".join(f"{k} {v:.0f}" for k, v in sync.items()) or "none"))
    by_op = {}
    for gap, _, nxt, launch in late:   # the innermost CPU op around each late launch, summed
        i = bisect.bisect_right(starts, launch["ts"]) - 1
        name = "?"
        while i >= 0:
            o = ops[i]
            if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]:
                name = o["name"]
                break
            i -= 1
        by_op[name] = by_op.get(name, 0.0) + gap
    print("host-late gap time by the CPU op that launched the waiting kernel (us):")
    for name, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t:9.1f}  {name[:100]}")
    print(f"the {top} largest host-late gaps:")
    for gap, prev, nxt, launch in sorted(late, key=lambda g: -g[0])[:top]:
        lo, hi = launch["ts"] - gap, launch["ts"]
        during = [o for o in ops if o["ts"] < hi and o["ts"] + o["dur"] > lo]
        names = sorted({o["name"][:60] for o in during})[:6]
        print(f"  {gap:8.1f} us  after {prev['name'][:50]!r}  before {nxt['name'][:50]!r}")
        print(f"             CPU ops in the gap: {', '.join(names)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", nargs="?", default="llama", choices=["gpt2", "llama"])
    ap.add_argument("variant", nargs="?", default="kitsune", choices=["eager", "kitsune"])
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    print(f"== {a.kind} {a.variant}: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    analyse(trace_step(a.kind, a.variant), a.top)


if __name__ == "__main__":
    main()
