"""torch.empty + del, ns per pair, for each allocator in its own process.

    python bench/alloc_torch.py [--out DIR] [--iters N]

Allocators: PyTorch's native caching allocator, backend:cudaMallocAsync,
expandable_segments:True, and Kitsune (kitsune.allocator.install()). Each process
warms up, then times N pairs per size (median of 5 repeats, time.perf_counter_ns).
Prints a table with ratios to native; writes alloc_torch.json and alloc_torch.png.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

SIZES = [4096, 1 << 20, 64 << 20]
CONFIGS = {
    "native": {},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "kitsune": {"KT_BENCH_KITSUNE": "1"},
}


def child(iters):
    import time
    import torch
    if os.environ.get("KT_BENCH_KITSUNE") == "1":
        import kitsune.allocator
        kitsune.allocator.install()
    torch.cuda.init()
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
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a.iters)
    import torch
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for name, extra in CONFIGS.items():
        env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"), **extra)
        print(f"[{name}] running {a.iters} pairs x {len(SIZES)} sizes ...", flush=True)
        r = subprocess.run([sys.executable, __file__, "--child", "--iters", str(a.iters)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{name} failed:\n{r.stderr}")
        results[name] = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    device = torch.cuda.get_device_name(0)
    print(f"\ntorch.empty + del, ns per pair (median of 5 x {a.iters}); {device}, torch {torch.__version__}")
    print(f"{'size':>10}" + "".join(f"{n:>22}" for n in CONFIGS) + f"{'kitsune/native':>16}")
    for s in SIZES:
        print(f"{s:>10}" + "".join(f"{results[n][s]:>22.1f}" for n in CONFIGS)
              + f"{results['kitsune'][s] / results['native'][s]:>16.3f}")
    os.makedirs(a.out, exist_ok=True)
    doc = {"benchmark": "alloc_torch", "device": device, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": os.environ.get("KT_COMMIT", "?"), "iters": a.iters, "ns_per_pair": results}
    with open(os.path.join(a.out, "alloc_torch.json"), "w") as f:
        json.dump(doc, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.2
        for i, name in enumerate(CONFIGS):
            ax.bar([j + i * w for j in range(len(SIZES))], [results[name][s] for s in SIZES], w, label=name)
        ax.set_xticks([j + 1.5 * w for j in range(len(SIZES))], ["4 KiB", "1 MiB", "64 MiB"])
        ax.set_ylabel("ns per torch.empty + del")
        ax.set_title(f"{device}, torch {torch.__version__}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "alloc_torch.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")


if __name__ == "__main__":
    main()
