"""torch.empty + del, ns per pair, for each allocator in its own process.

    python bench/alloc_torch.py [--out DIR] [--iters N] [--rounds R]    # defaults 10000, 5

Allocators: PyTorch's native caching allocator, backend:cudaMallocAsync,
expandable_segments:True, and Kitsune (kitsune.allocator.install()). Each process
pins its timing thread to one CPU once CUDA is up (--cpu), warms up, then times N pairs per size (median of 5 repeats, time.perf_counter_ns),
from Python (what a user sees) and, through the bridge, from C++: at::empty + release
(the same op without the interpreter) and allocate() + free through torch's
allocator interface. The allocators run in turn,
R rounds, each in a fresh process; the table gives the median over rounds and the
spread (max-min). Writes alloc_torch.json and alloc_torch.png.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

SIZES = [512, 4096, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]   # 512 B to 256 MiB
KINDS = {"python": "torch.empty + del from Python",
         "aten": "at::empty + release from C++ (the op torch.empty runs, no interpreter)",
         "cpp": "allocate() + free through torch's allocator interface, from C++"}
CONFIGS = {
    "native": {},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "kitsune": {"KT_BENCH_KITSUNE": "1"},
}


def child(iters, cpu):
    import time
    import torch
    if os.environ.get("KT_BENCH_KITSUNE") == "1":
        import kitsune.allocator
        kitsune.allocator.install()
    torch.cuda.init()
    torch.empty(1, device="cuda")   # the CUDA context and its helper threads exist from here
    if cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})   # this thread only: the driver's threads stay unpinned
    out = {}
    for n in SIZES:
        for _ in range(1000):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            del t
        runs = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
                del t
            runs.append((time.perf_counter_ns() - t0) / iters)
        out[n] = statistics.median(runs)
    torch.cuda.synchronize()
    import ctypes
    import kitsune._native as kn
    b = kn.bridge()
    b.kt_bridge_time_torch_allocate.restype = ctypes.c_double
    b.kt_bridge_time_torch_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int]
    cpp = {n: b.kt_bridge_time_torch_allocate(n, iters) for n in SIZES}
    b.kt_bridge_time_aten_empty.restype = ctypes.c_double
    b.kt_bridge_time_aten_empty.argtypes = [ctypes.c_size_t, ctypes.c_int]
    aten = {n: statistics.median(b.kt_bridge_time_aten_empty(n, iters) for _ in range(5)) for n in SIZES}
    print(json.dumps({"python": out, "aten": aten, "cpp": cpp}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=2,
                    help="CPU each child's timing thread is pinned to once CUDA is up (-1: none). Pinning the "
                         "whole process (taskset, before c09e134) put CUDA's helper threads on that CPU too")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a.iters, a.cpu)
    import torch
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {name: [] for name in CONFIGS}
    for rnd in range(a.rounds):
        for name, extra in CONFIGS.items():
            env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"), **extra)
            print(f"[round {rnd + 1}/{a.rounds}] {name}: {a.iters} pairs x {len(SIZES)} sizes", flush=True)
            r = subprocess.run([sys.executable, __file__, "--child", "--iters", str(a.iters), "--cpu", str(a.cpu)], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{name} failed:\n{r.stderr}")
            d = json.loads(r.stdout.strip().splitlines()[-1])
            runs[name].append({k: {int(s): v for s, v in d[k].items()} for k in KINDS})

    def med(name, kind, s):
        return statistics.median(x[kind][s] for x in runs[name])

    def spread(name, kind, s):
        v = [x[kind][s] for x in runs[name]]
        return max(v) - min(v)

    results = {kind: {n: {s: med(n, kind, s) for s in SIZES} for n in CONFIGS} for kind in KINDS}
    # Kitsune over native, round by round (each pair ran minutes apart at most), then the median
    paired = {kind: {s: statistics.median(k[kind][s] / n_[kind][s] for k, n_ in zip(runs["kitsune"], runs["native"]))
                     for s in SIZES} for kind in KINDS}
    device = torch.cuda.get_device_name(0)
    for kind, title in KINDS.items():
        print(f"\n{title}: ns per pair, median over {a.rounds} rounds (spread); {device}, torch {torch.__version__}")
        print(f"{'size':>10}" + "".join(f"{n:>26}" for n in CONFIGS) + f"{'kitsune/native':>16}")
        for s in SIZES:
            print(f"{s:>10}" + "".join(f"{results[kind][n][s]:>17.1f} ({spread(n, kind, s):>6.1f})" for n in CONFIGS)
                  + f"{paired[kind][s]:>16.3f}")
    print("(kitsune/native: median over rounds of the ratio within a round)")
    os.makedirs(a.out, exist_ok=True)
    doc = {"benchmark": "alloc_torch", "device": device, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": os.environ.get("KT_COMMIT", "?"), "iters": a.iters, "rounds": a.rounds,
           "pinned_cpu": a.cpu, "pinning": "timing thread only (os.sched_setaffinity after CUDA init)", "ns_per_pair_median": results, "kitsune_over_native_paired": paired,
           "runs": runs}
    with open(os.path.join(a.out, "alloc_torch.json"), "w") as f:
        json.dump(doc, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.2
        for i, name in enumerate(CONFIGS):
            ax.bar([j + i * w for j in range(len(SIZES))], [results["python"][name][s] for s in SIZES], w, label=name)
        ax.set_xticks([j + 1.5 * w for j in range(len(SIZES))], ["4 KiB", "1 MiB", "64 MiB"])
        ax.set_ylabel("ns per torch.empty + del (Python)")
        ax.set_title(f"{device}, torch {torch.__version__}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "alloc_torch.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")


if __name__ == "__main__":
    main()
