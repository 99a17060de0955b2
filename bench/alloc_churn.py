"""Allocation churn under PyTorch, each allocator in its own process: issue 45's ring and
RMM's random_allocations recipe, replayed from Python with torch.empty and del.

    python3 bench/alloc_churn.py [--out DIR] [--workloads churn,random] [--allocators ...]

Workloads (the same events for every allocator):
  churn   bench/churn_trace.py's ring: 64 live blocks, 20,000 allocations of sizes
          log-uniform from 1 B to 64 MiB, each allocated before the block it replaces
          is freed
  random  bench/traces/random_10k_4mib.csv: 10,000 allocations up to 4 MiB, freed in
          a random order (RMM's random_allocations benchmark, recorded)
Allocators: native (PyTorch's caching allocator), expandable_segments,
cudaMallocAsync, rmm_pool (RMM's pool resource through rmm.allocators.torch, when rmm
imports; skipped with a message otherwise), kitsune (KITSUNE_RELEASE_ON_GROW=2, the
default) and kitsune_segments (=1: idle segments only, no unmapping once warm).

Each process replays the workload twice; the second pass is timed (time.perf_counter_ns
over the whole pass, frees included) and reported as microseconds per allocation. Memory:
the live peak (the largest sum of live requested bytes), the device memory the process
holds after the second pass above what it held before the first (cudaMemGetInfo; a
caching pool keeps its peak), and their ratio. Writes alloc_churn.json.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

WORKLOADS = ["churn", "random"]
ALLOCATORS = {
    "native": {},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "rmm_pool": {"KT_BENCH_RMM": "1"},
    "kitsune": {"KT_BENCH_KITSUNE": "1", "KITSUNE_RELEASE_ON_GROW": "2"},
    "kitsune_segments": {"KT_BENCH_KITSUNE": "1", "KITSUNE_RELEASE_ON_GROW": "1"},
}


def events(workload):
    """[(action, id, size)]: 'alloc' / 'free' of block ids."""
    if workload == "churn":
        from churn_trace import churn
        return list(churn())
    ids, out = {}, []   # a live pointer's block id (ids count up: a pointer freed and reused is a new block)
    with open(os.path.join(HERE, "traces", "random_10k_4mib.csv")) as f:
        for n, row in enumerate(csv.DictReader(f)):
            if row["action"] == "alloc":
                ids[row["ptr"]] = n
                out.append(("alloc", n, int(row["size"])))
            elif row["action"] == "free":
                out.append(("free", ids.pop(row["ptr"]), int(row["size"])))
    return out


def live_peak(evs):
    live = peak = 0
    for action, _, size in evs:
        live += size if action == "alloc" else -size
        peak = max(peak, live)
    return peak


def child(workload):
    import torch
    if os.environ.get("KT_BENCH_KITSUNE") == "1":
        import kitsune.allocator
        kitsune.allocator.install()
    if os.environ.get("KT_BENCH_RMM") == "1":
        try:
            import rmm
            from rmm.allocators.torch import rmm_torch_allocator
        except ImportError as e:
            print(json.dumps({"skipped": f"rmm does not import here ({e})"}))
            return
        rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 28)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    torch.cuda.init()
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    evs = events(workload)
    allocs = sum(1 for e in evs if e[0] == "alloc")
    times = []
    for _ in range(2):
        blocks = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for action, i, size in evs:
            if action == "alloc":
                blocks[i] = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
            else:
                del blocks[i]
        torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t0)
    free1, _ = torch.cuda.mem_get_info()
    peak = live_peak(evs)
    held = free0 - free1
    print(json.dumps({"us_per_alloc": times[1] / allocs / 1e3, "first_pass_us_per_alloc": times[0] / allocs / 1e3,
                      "allocs": allocs, "live_peak_mib": peak / 2**20, "held_mib": held / 2**20,
                      "held_over_live": held / peak if peak else None}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    import torch
    from benchlib import write_result
    if not torch.cuda.is_available():
        sys.exit("bench/alloc_churn.py needs a CUDA GPU")
    repo = os.path.dirname(HERE)
    rows = []
    for w in a.workloads.split(","):
        for name in a.allocators.split(","):
            path = os.pathsep.join(p for p in (os.path.join(repo, "python"), os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, PYTHONPATH=path, **ALLOCATORS[name])
            r = subprocess.run([sys.executable, __file__, "--child", w], env=env, capture_output=True, text=True,
                               timeout=900)
            if r.returncode != 0:
                row = {"workload": w, "allocator": name, "error": r.stderr.strip().splitlines()[-1][:300]}
            else:
                row = dict(workload=w, allocator=name, **json.loads(r.stdout.strip().splitlines()[-1]))
            rows.append(row)
            if "us_per_alloc" in row:
                print(f"{w:7s} {name:20s} {row['us_per_alloc']:8.2f} us/alloc (first pass "
                      f"{row['first_pass_us_per_alloc']:.2f})  held {row['held_mib']:8.0f} MiB  live peak "
                      f"{row['live_peak_mib']:8.0f} MiB  held/live {row['held_over_live']:.3f}", flush=True)
            else:
                print(f"{w:7s} {name:20s} {row.get('skipped') or 'FAILED ' + row.get('error', '')}", flush=True)
    write_result(a.out, "alloc_churn", {"rows": rows})


if __name__ == "__main__":
    main()
