"""How much device memory a whole-step CUDA graph holds against the eager step's peak:

    python bench/graph_memory.py [--out DIR] [--models mlp,lenet,resnet18,gpt,inception] [--steps N]

(a model may name its batch size, as in bench/models.py: inception:8)

For each model of bench/models.py (same builders, batches and AdamW), kitsune.optimize
+ KitsuneOptimizer, in a fresh process per configuration:
  native        PyTorch's caching allocator; compile_step's graph in PyTorch's graph pool
  kitsune_pool  kitsune.allocator.install(); compile_step(plan_memory=False): the graph in
                a Kitsune private pool drawing on the device pool
  kitsune_plan  kitsune.allocator.install(); compile_step(plan_memory=True): captured once
                while recording, laid out by kt_memplan, captured again by the plan
  kitsune_plan_1s  the same on one stream (compile_step(streams=1)); only when named in
                --configs: how much of a streamed graph's memory its streams take
  kitsune_plan_ob0  kitsune_plan with the optimizer's update after the backward
                (compile_step(optimizer_in_backward=False)); only when named in --configs
  kitsune_plan_nowait  kitsune_plan without a budget (KITSUNE_PLAN_WAITS=0): the plan keeps
                apart what the capture's order keeps apart, never buying reuse with a
                wait; only when named in --configs

Each process runs 5 eager steps, then measures one more: `static` is what is allocated
before it (parameters, optimizer state, batches, workspaces; gradients dropped),
`eager_peak` the most allocated during it (torch.cuda.max_memory_allocated);
`static_reserved` and `eager_reserved_peak` are the same for memory_reserved (after
an empty_cache: what the allocator holds for those tensors, its fragmentation
included). Then the
same model is trained by compile_step for --steps steps and, after a gc and
torch.cuda.empty_cache() with the graph alive, `graph_reserved` is what the allocator
holds (torch.cuda.memory_reserved: the graph's pool, its capture stream's cuBLAS
workspaces if it has its own -- compile_step's shares the eager stream's --, static
inputs, and everything eager holds) -- the graph's memory as the device sees it.
With Kitsune, `breakdown` (kitsune.allocator.memory_breakdown) says where those
reserved bytes are. Reported: graph_reserved / eager_peak (the issue's "whole-step graph
peak memory <= the eager step's peak allocated", strictly: reserved against
allocated), graph_reserved / eager_reserved_peak (both as the device holds them), the graph's share above static,
with a plan (static + plan_bytes) / eager_peak (own/eager: the bytes the step's tensors
take, the graph's arena at its planned extent, against the eager step's: allocated
against allocated, no allocator cache or granule rounding on either side), the
plan's numbers (arena, the recording's live peak, placed / refused), ms per step (the
median over blocks of 10 between CUDA events) and the last loss. Writes
graph_memory.json and prints a table. KITSUNE_GMEM_TRACE=DIR: with Kitsune, each
process also traces the device pool to DIR/alloc_<model>_<config>.csv, which
`build/bench/alloc_replay TRACE --vmm` replays on the host fake backend (what stays
reserved at the end: the cache empty_cache cannot give back). The replay is
approximate: what a capture does to the pool (kt_pool_prepare_capture, releases held
while capturing) is not in the trace.
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("native", "kitsune_pool", "kitsune_plan")
EXTRA = ("kitsune_plan_1s", "kitsune_plan_ob0", "kitsune_plan_nowait")   # by name only (--configs)
MiB = 2 ** 20


def child(model_name, config, steps):
    import faulthandler
    faulthandler.enable()
    trace_dir = os.environ.get("KITSUNE_GMEM_TRACE")
    tracing = contextlib.ExitStack()
    if config != "native":
        import kitsune.allocator as ka
        ka.install()
    import torch
    if trace_dir and config != "native":   # the device pool's allocations, for bench/alloc_replay off the GPU
        torch.cuda.init()   # the pools exist from here
        tracing.enter_context(ka.trace(os.path.join(trace_dir, f"alloc_{model_name}_{config}.csv")))
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, "kernels"))
    import kitsune
    from models import build_spec, fresh_peak

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    base, loss_fn, data = build_spec(model_name, gen)
    model = kitsune.optimize(base)
    opt = kitsune.KitsuneOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)

    def eager(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(5):
        eager(*data[i % len(data)])
    opt.zero_grad(set_to_none=True)
    fresh_peak()
    static, static_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    eager(*data[5 % len(data)])
    torch.cuda.synchronize()
    eager_peak, eager_reserved_peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    opt.zero_grad(set_to_none=True)

    if config == "kitsune_plan_nowait":
        os.environ["KITSUNE_PLAN_WAITS"] = "0"
    step = kitsune.compile_step(model, loss_fn, opt, plan_memory=config.startswith("kitsune_plan"),
                                streams=1 if config == "kitsune_plan_1s" else 4,
                                optimizer_in_backward=config != "kitsune_plan_ob0")
    losses, blocks, i = [], [], 0
    while i < steps:
        n = min(10, steps - i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            losses.append(step(*data[i % len(data)]))
            i += 1
        b.record()
        blocks.append((a, b, n, i))
    torch.cuda.synchronize()
    ms = statistics.median([a.elapsed_time(b) / n for a, b, n, end in blocks if end > 10] or
                           [a.elapsed_time(b) / n for a, b, n, _ in blocks])
    gc.collect()
    torch.cuda.empty_cache()
    st = step.stats()
    ws = breakdown = None
    if config != "native":
        import kitsune.allocator as ka
        ws = ka.capture_info()["workspaces"]   # cuBLAS + cuBLASLt workspace bytes the last capture might allocate
        breakdown = ka.memory_breakdown()      # where the reserved bytes are (device pool, graph pools, arenas)
        tracing.close()
    out = {"capture_workspaces": ws, "breakdown": breakdown, "blas_workspaces": st["blas_workspaces"],
           "model": model_name, "config": config, "static": static, "eager_peak": eager_peak,
           "static_reserved": static_reserved, "eager_reserved_peak": eager_reserved_peak,
           "graph_reserved": torch.cuda.memory_reserved(), "graph_allocated": torch.cuda.memory_allocated(),
           "ms": ms, "final_loss": losses[-1].float().item(), "steps": steps,
           "compile_step": {k: st[k] for k in ("replays", "captures", "reason", "streams", "setup_s", "memory_plan",
                                                "conv_grads")}}
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--models", default="mlp,lenet,resnet18,gpt,inception")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    for c in a.configs.split(","):
        if c not in CONFIGS + EXTRA:
            ap.error(f"--configs: unknown configuration {c!r} (known: {', '.join(CONFIGS + EXTRA)})")
    if a.child:
        return child(a.child[0], a.child[1], a.steps)
    import torch
    sys.path.insert(0, HERE)
    from benchlib import write_result
    repo = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for m in a.models.split(","):
        for c in a.configs.split(","):
            print(f"[{m} / {c}] ...", flush=True)
            r = subprocess.run([sys.executable, __file__, "--child", m, c, "--steps", str(a.steps)], env=env,
                               capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-4000:])
                rows.append({"model": m, "config": c, "rc": r.returncode,
                             "error": (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]})
                continue
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    table(rows)
    write_result(a.out, "graph_memory", {"steps": a.steps, "rows": rows})


def table(rows):
    print("MiB; graph/eager = graph_reserved / eager_peak")
    print("static: allocated before the eager step; eager+: its peak above static; graph+: graph_reserved above static")
    print("rsv/rsv: graph_reserved / the eager step's peak reserved (both after an empty_cache)")
    print("own/eager: (static + the plan's extent) / eager_peak (planned configs)")
    print(f"{'model':<10}{'config':<17}{'static':>9}{'eager pk':>10}{'eager+':>8}{'graph rsv':>11}{'graph+':>8}"
          f"{'graph/eager':>12}{'rsv/rsv':>8}{'own/eager':>10}{'plan':>8}{'live pk':>9}{'placed':>10}{'waits':>6}{'ms':>8}"
          f"{'loss':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10}{r['config']:<17}  error: {r['error']}")
            continue
        mp = r["compile_step"]["memory_plan"] or {}
        plan = f"{mp['plan_bytes'] / MiB:8.1f}{mp['peak_bytes'] / MiB:9.1f}{mp['placed']:>5}/{mp['blocks']:<4}" \
            f"{mp.get('waits') or 0:6d}" if "plan_bytes" in mp else f"{'':8}{'':9}{'':10}{'':6}"
        own = f"{(r['static'] + mp['plan_bytes']) / r['eager_peak']:10.3f}" if "plan_bytes" in mp else f"{'':10}"
        print(f"{r['model']:<10}{r['config']:<17}{r['static'] / MiB:9.1f}{r['eager_peak'] / MiB:10.1f}"
              f"{(r['eager_peak'] - r['static']) / MiB:8.1f}{r['graph_reserved'] / MiB:11.1f}"
              f"{(r['graph_reserved'] - r['static']) / MiB:8.1f}{r['graph_reserved'] / r['eager_peak']:12.3f}"
              f"{r['graph_reserved'] / r['eager_reserved_peak']:8.3f}{own}{plan}"
              f"{r['ms']:8.3f}{r['final_loss']:9.4f}")
    print("\nReserved but not allocated before the eager step (static cache) and after the run (cache), MiB; "
          "with Kitsune, graph pools' segments (free in them), arenas (free in them); cuBLAS workspaces shared")
    for r in rows:
        if "error" in r:
            continue
        bd, bl = r.get("breakdown"), r.get("blas_workspaces") or {}
        line = (f"{r['model']:<10}{r['config']:<17}static cache {(r['static_reserved'] - r['static']) / MiB:7.1f}   "
                f"cache {(r['graph_reserved'] - r['graph_allocated']) / MiB:7.1f}")
        if not bd:
            print(line + f"   cuBLAS shared/apart {bl.get('shared')}/{bl.get('apart')}")
            continue
        print(line + f"   pools {bd['private_reserved'] / MiB:7.1f} ({(bd['private_reserved'] - bd['private_allocated']) / MiB:.1f})"
              f"   arenas {bd['arena_bytes'] / MiB:7.1f} ({(bd['arena_bytes'] - bd['placed_live']) / MiB:.1f})   "
              f"segments {bd['segments']}   cuBLAS shared/apart {bl.get('shared')}/{bl.get('apart')}")


if __name__ == "__main__":
    main()
