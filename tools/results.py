#!/usr/bin/env python3
"""Writes bench/results/LATEST.md: the headline tables of the current benchmark results.

    python3 tools/results.py [--results DIR]           write DIR/LATEST.md
    python3 tools/results.py [--results DIR] --check   exit 1 if DIR/LATEST.md is not what
                                                      this script would write now

The current results are the JSON files at the top of bench/results/ (one per benchmark,
named by the benchmark: models.json, alloc_torch.json, ...); older runs are in
bench/results/archive/ and are not read. Each table names the device, torch version,
commit and date its JSON records, and the command that writes that JSON. A JSON this
script has no table for still gets a section naming it. docs/benchmarks.md says how
every number is measured. Standard library only.
"""
import argparse
import datetime
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "bench", "results")
OUT_NAME = "LATEST.md"
GPU_ENV = "`PYTHONPATH=python KITSUNE_LIBRARY=build/libkitsune.so`"


# ---- formatting -----------------------------------------------------------------------
def num(v, digits=3):
    """v to `digits` significant digits, trailing zeros kept (2.9958 -> '3.00'); whole
    numbers from 10**digits on, an exponent below 1e-3; '-' for None."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 10 ** digits:
        return f"{v:.0f}"
    if a < 1e-3:
        return f"{v:.2e}"
    places = max(0, digits - 1 - math.floor(math.log10(a)))
    text = f"{v:.{places}f}"
    if len(text.lstrip("-").replace(".", "").lstrip("0")) > digits and places > 0:   # 9.996 -> 10.00: one less
        text = f"{v:.{places - 1}f}"
    return text


def fixed(v, places=2):
    return "-" if v is None else f"{v:.{places}f}"


def ratio(a, b):
    """a / b as '0.83'; '-' when either is missing."""
    if a is None or b is None or not b:
        return "-"
    return f"{a / b:.2f}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def when(doc):
    """The JSON's date as 'YYYY-MM-DD HH:MM UTC'; None when it records none."""
    d = doc.get("date")
    if not d:
        return None
    try:
        t = datetime.datetime.fromisoformat(str(d).replace("Z", "+00:00"))
    except ValueError:
        return str(d)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def source(doc, name, torch_used=True):
    """One line: the device, torch version, commit and date the JSON records."""
    device = doc.get("device") or "device not recorded"
    if "torch" in doc:
        torch = f"torch {doc['torch']}"
    else:
        torch = "torch not used (a C program)" if not torch_used else "torch version not recorded"
    commit = doc.get("commit")
    commit = f"commit {commit}" if commit and commit != "?" else "commit not recorded"
    date = when(doc) or "date not recorded"
    return f"`{name}`: {device}; {torch}; {commit}; {date}."


def rows_of(doc, key="rows"):
    return [r for r in doc.get(key) or [] if isinstance(r, dict)]


# ---- training steps: bench/models.py ---------------------------------------------------
MODELS_DEFAULT = ["mlp", "lenet", "resnet18", "gpt", "inception"]
MODELS_RECIPES = ["eager", "eager_fused", "compile", "compile_ro", "stock_graph", "kitsune_eager", "kitsune",
                  "kitsune_1s", "kitsune_nchw", "kitsune_mc", "kitsune_ob0"]
# the three recipes of the headline comparison, and how the table names them
EAGER, STOCK, KITSUNE = "eager", "stock_graph", "kitsune"


def models_command(doc):
    rows = rows_of(doc)
    cmd = ["python3 bench/models.py"]
    models = list(dict.fromkeys(r.get("model") for r in rows))
    recipes = list(dict.fromkeys(r.get("recipe") for r in rows))
    if models and models != MODELS_DEFAULT:
        cmd.append("--models " + ",".join(str(m) for m in models))
    if recipes and recipes != MODELS_RECIPES:
        cmd.append("--recipes " + ",".join(str(r) for r in recipes))
    if doc.get("steps") not in (None, 60):
        cmd.append(f"--steps {doc['steps']}")
    if doc.get("cudnn_benchmark") is False:
        cmd.append("--no-cudnn-benchmark")
    if doc.get("cudnn_benchmark_limit") is not None:
        cmd.append(f"--cudnn-benchmark-limit {doc['cudnn_benchmark_limit']}")
    if doc.get("cudnn_heuristic_mode_b") == "1":
        cmd.append("--cudnn-mode-b")
    if doc.get("kitsune_allocator"):
        cmd.append("--kitsune-allocator")
    return " ".join(cmd)


def render_models(doc):
    rows = rows_of(doc)
    by = {(r.get("model"), r.get("recipe")): r for r in rows}
    models = list(dict.fromkeys(r.get("model") for r in rows))

    def cell(m, rc, key):
        r = by.get((m, rc))
        if r is None:
            return None, "-"
        if "error" in r:
            return None, "failed"
        v = r.get(key)
        return v, num(v)

    out = []
    if doc.get("process"):
        out.append(f"Each recipe ran in a fresh process ({doc['process']}); ms per step is the median over "
                   "blocks of 10 steps from step 20 on; setup is the first 3 steps' wall time less 3 steady steps "
                   "(compilation, capture and warm-up).")
    else:
        out.append("All recipes of a model ran one after another in one process (this file predates one process "
                   "per recipe), so setup seconds are not each recipe's own: each model's first recipe (eager) also paid "
                   "what a program's first steps pay once (cuBLAS and cuDNN handles, cuDNN's benchmarks, lazily "
                   "loaded kernels), and later recipes reused what earlier ones had compiled or loaded. ms per step "
                   "is the median over blocks of 10 steps from step 20 on.")
    out.append("")
    out.append("- **eager**: the model as written, `torch.optim.AdamW` (foreach).")
    out.append("- **torch.compile + CUDA graph**: `torch.compile(model)` and `AdamW(fused=True, capturable=True)`, "
               "the whole step (forward, backward, optimizer) captured by hand in one `torch.cuda.graph` after "
               "3 warm-up steps; replayed each step (`stock_graph` in the JSON).")
    out.append("- **Kitsune**: `kitsune.optimize(model)`, `KitsuneOptimizer(AdamW)` and `kitsune.compile_step` "
               "(one CUDA graph a step, independent branches on up to 4 streams).")
    out.append("")
    out.append("Kitsune / x: Kitsune's ms per step over x's (below 1: Kitsune's step is faster).")
    out.append("")
    header = ["model", "eager ms", "torch.compile + graph ms", "Kitsune ms", "Kitsune / eager",
              "Kitsune / torch.compile", "eager setup s", "torch.compile setup s", "Kitsune setup s"]
    body = []
    for m in models:
        e, es = cell(m, EAGER, "ms")
        s, ss = cell(m, STOCK, "ms")
        k, ks = cell(m, KITSUNE, "ms")
        body.append([m, es, ss, ks, ratio(k, e), ratio(k, s), cell(m, EAGER, "setup_s")[1],
                     cell(m, STOCK, "setup_s")[1], cell(m, KITSUNE, "setup_s")[1]])
    out += table(header, body)
    others = [rc for rc in dict.fromkeys(r.get("recipe") for r in rows) if rc not in (EAGER, STOCK, KITSUNE)]
    if others:
        out.append("")
        out.append("The JSON also holds the recipes "
                   + ", ".join(f"`{o}`" for o in others) + " (bench/models.py's docstring defines each).")
    return out


# ---- allocation churn: bench/alloc_churn.py ----------------------------------------------
def render_alloc_churn(doc):
    out = ["Each allocator in its own process replays the workload twice with torch.empty and del; the second "
           "pass is timed. held: device memory the process holds after the passes above what it held before "
           "(cudaMemGetInfo); live peak: the largest sum of live requested bytes.", ""]
    body = []
    for r in rows_of(doc):
        if "us_per_alloc" not in r:
            body.append([r.get("workload"), r.get("allocator"), "failed" if "error" in r else "skipped",
                         r.get("error") or r.get("skipped") or "", "", "", ""])
            continue
        body.append([r["workload"], r["allocator"], num(r["us_per_alloc"]), num(r["first_pass_us_per_alloc"]),
                     num(r["held_mib"]), num(r["live_peak_mib"]), num(r["held_over_live"], 3)])
    return out + table(["workload", "allocator", "us / alloc", "first pass", "held MiB", "live peak MiB",
                        "held / live"], body)


# ---- pointwise chains: bench/kernels/chains.py ---------------------------------------------
def render_chains(doc):
    out = ["kitsune.pointwise_chain (one launch of the precompiled interpreter) against eager ATen (a kernel an "
           "op) and Inductor's generated kernel for the same chain; median of the calls between CUDA events, L2 "
           "flushed before each; GB/s counts each input and output once.", ""]
    body = [[r["chain"], r["dtype"], r["mb"], num(r["eager_ms"]), num(r["inductor_ms"]), num(r["kitsune_ms"]),
             num(r["kitsune_gbs"]), f"{r['kitsune_pct_copy']:.0f}%", ratio(r["kitsune_ms"], r["inductor_ms"])]
            for r in rows_of(doc)]
    return out + table(["chain", "dtype", "MB", "eager ms", "Inductor ms", "Kitsune ms", "Kitsune GB/s",
                        "of copy", "Kitsune / Inductor"], body)


# ---- the model zoo: bench/zoo.py ----------------------------------------------------------
ZOO_RECIPES = ["eager", "compile", "stock_graph", "kitsune", "kitsune_dynamo"]
ZOO_NAMES = {"gpt2": "HF GPT-2 124M, batch 8 x 1024", "llama": "HF Llama-style ~160M (GQA), batch 8 x 1024",
             "bert": "HF BERT-base MLM, batch 32 x 128", "vit": "torchvision ViT-B/16, batch 64",
             "resnet50": "torchvision ResNet-50, batch 64, SGD"}


def zoo_command(doc):
    runs = doc.get("runs")
    if runs:   # the models and recipes of each run (several: joined by bench/zoo.py --merge)
        parts = [f"`python3 bench/zoo.py --models {','.join(r['models'])} --recipes {','.join(r['recipes'])}`"
                 for r in runs]
        return parts[0] if len(parts) == 1 else " and ".join(parts) + ", joined by `python3 bench/zoo.py --merge`"
    return "`python3 bench/zoo.py" + (" --dynamic" if doc.get("dynamic") else "") + "`"


def late_loss(r):
    tail = (r.get("losses") or [])[-10:]
    return sum(tail) / len(tail) if tail else None


def _zoo_by(doc):
    by = {(r.get("model"), r.get("recipe")): r for r in rows_of(doc)}

    def get(m, rc, key="ms"):
        r = by.get((m, rc))
        if r is None or "error" in r:
            return None
        return late_loss(r) if key == "late_loss" else r.get(key)
    return by, get


def render_zoo(doc):
    by, get = _zoo_by(doc)
    models = list(dict.fromkeys(r.get("model") for r in rows_of(doc)))
    recipes = [rc for rc in ZOO_RECIPES if any((m, rc) in by for m in models)]
    out = [f"Random weights from configs, bf16 autocast, {doc.get('steps')} steps a recipe, each in a fresh process; "
           "ms per step is the median over blocks of 10 steps from step 20 on; setup is the first 3 steps' wall "
           "time less 3 steady steps. Recipes (bench/zoo.py's docstring): eager, `compile` (torch.compile default), "
           "`stock_graph` (torch.compile and the optimizer under one manual whole-step CUDA graph), `kitsune` "
           "(`optimize` + `KitsuneOptimizer` + `compile_step`), `kitsune_dynamo` (`compile_step(dynamo=True)`). "
           "Losses: the mean of the last 10 steps less eager's.", ""]
    body = []
    for m in models:
        cells = [ZOO_NAMES.get(m, m)]
        for rc in recipes:
            r = by.get((m, rc))
            cells.append("-" if r is None else "failed" if "error" in r else
                         f"{num(r.get('ms'))} ({num(r.get('setup_s'), 2)} s)")
        k = get(m, "kitsune")
        stock = [v for v in (get(m, rc) for rc in ("eager", "compile", "stock_graph")) if v is not None]
        cells += [ratio(k, get(m, "compile")), ratio(k, min(stock) if stock else None)]
        cells.append(f"{num(get(m, 'compile', 'peak_reserved_mib'))}, {num(get(m, 'kitsune', 'peak_reserved_mib'))}")
        e = get(m, "eager", "late_loss")
        d = [None if e is None or get(m, rc, "late_loss") is None else get(m, rc, "late_loss") - e
             for rc in ("compile", "kitsune")]
        cells.append(", ".join("-" if v is None else f"{v:+.3f}" for v in d))
        cs = (by.get((m, "kitsune")) or {}).get("compile_step") or {}
        cells.append("-" if not cs else f"{cs.get('replays')} / {cs.get('eager_steps')}"
                     + (f" ({cs['reason']})" if cs.get("reason") else ""))
        body.append(cells)
    out += table(["model"] + [f"{rc} ms (setup)" for rc in recipes]
                 + ["Kitsune / compile", "Kitsune / best stock", "peak reserved MiB (compile, Kitsune)",
                    "loss - eager's (compile, Kitsune)", "Kitsune replays / eager steps"], body)
    failed = [(m, rc, by[(m, rc)]["error"]) for m in models for rc in recipes if "error" in by.get((m, rc), {})]
    for m, rc, err in failed:
        out += ["", f"{m} / {rc} failed: {err}"]
    return out


# ---- end-to-end language models: bench/kernels/train_models.py ---------------------------
def render_train_models(doc):
    rows = rows_of(doc)
    by = {(r.get("model"), r.get("variant"), r.get("round", 1)): r for r in rows}
    models = list(dict.fromkeys(r.get("model") for r in rows))

    def v(m, var, key, rnd=1):
        r = by.get((m, var, rnd))
        return None if r is None else r.get(key)

    out = [f"bf16, AdamW(fused=True), batch 8 x 1024 tokens, {doc.get('steps', '?')} steps in one process; ms per "
           "step is the median from step 10 on. **torch.compile** is `torch.compile(model)` (no CUDA graph); "
           "**Kitsune** is `kitsune.optimize(model)` run eagerly (no CUDA graph). Setup: torch.compile's first "
           "step less eager's; Kitsune's `optimize()` call. Round 2 runs eager and Kitsune again after "
           "torch.compile: the spread between rounds is the machine's.", ""]
    header = ["model", "eager ms", "torch.compile ms", "Kitsune ms", "Kitsune / eager", "Kitsune / torch.compile",
              "torch.compile setup s", "Kitsune setup s", "eager ms, round 2", "Kitsune ms, round 2"]
    body = []
    for m in models:
        e, c, k = v(m, "eager", "ms"), v(m, "compile", "ms"), v(m, "kitsune", "ms")
        body.append([m, num(e), num(c), num(k), ratio(k, e), ratio(k, c), num(v(m, "compile", "setup_s")),
                     num(v(m, "kitsune", "setup_s")), num(v(m, "eager", "ms", 2)), num(v(m, "kitsune", "ms", 2))])
    return out + table(header, body)


# ---- allocator ------------------------------------------------------------------------
SIZE_NAMES = {512: "512 B", 4096: "4 KiB", 65536: "64 KiB", 1 << 20: "1 MiB", 8 << 20: "8 MiB", 64 << 20: "64 MiB"}


def size_name(b):
    b = int(b)
    return SIZE_NAMES.get(b, f"{b} B")


ALLOCATORS = {"native": "PyTorch native (caching allocator)", "cudaMallocAsync": "cudaMallocAsync backend",
              "expandable_segments": "expandable segments", "kitsune": "Kitsune",
              "kitsune_segments": "Kitsune, segments (no VMM)",
              "kitsune_keep_segments": "Kitsune, segments kept"}


def render_alloc_torch(doc):
    med = doc.get("ns_per_pair_median") or {}
    paired = doc.get("kitsune_over_native_paired") or {}
    kinds = {"python": "Python: `torch.empty` + `del`", "aten": "C++: `at::empty` + release",
             "cpp": "C++: allocate + free through torch's allocator interface"}
    configs = ["native", "cudaMallocAsync", "expandable_segments", "kitsune"]
    out = [f"ns per allocation + free, median over {doc.get('rounds', '?')} rounds of fresh processes "
           f"({doc.get('iters', '?')} pairs per size, median of 5 repeats in each); Kitsune / native is the "
           "median over rounds of the ratio within a round (below 1: Kitsune is cheaper).", ""]
    header = ["path", "size"] + [ALLOCATORS[c] + " ns" for c in configs] + ["Kitsune / native"]
    body = []
    for kind, label in kinds.items():
        per = med.get(kind) or {}
        sizes = sorted({int(s) for c in per.values() for s in c})
        for s in sizes:
            body.append([label, size_name(s)] + [num((per.get(c) or {}).get(str(s))) for c in configs]
                        + [fixed((paired.get(kind) or {}).get(str(s)))])
    return out + table(header, body)


def render_alloc_shapes(doc):
    res = doc.get("results") or {}
    native = res.get("native") or {}
    out = [f"GPT-style model (d 768, 8 layers, vocab 32k) trained {doc.get('steps', '?')} steps with batch and "
           "sequence length drawn at random every step, each allocator in its own process. Fragmentation is "
           "peak device memory in use over peak live tensor bytes (1.00 is none).", ""]
    header = ["allocator", "peak live GiB", "peak device GiB", "device / live", "reserved / live", "ms per step",
              "ms / native's", "syncs to release memory"]
    body = []
    gib = 2 ** 30
    for name, r in res.items():
        live, dev, rsv = r.get("peak_live"), r.get("peak_device"), r.get("peak_reserved")
        body.append([ALLOCATORS.get(name, name), fixed(live / gib if live else None),
                     fixed(dev / gib if dev else None), ratio(dev, live), ratio(rsv, live),
                     num(r.get("ms_per_step")), ratio(r.get("ms_per_step"), native.get("ms_per_step")),
                     r.get("release_syncs", "-")])
    return out + table(header, body)


def pairs_table(doc, baselines=True):
    pairs = rows_of(doc, "pairs")
    cols = [(1, "own"), (2, "own"), (2, "shared"), (4, "own"), (4, "shared")]
    names = {(1, "own"): "1 thread", (2, "own"): "2 threads, own streams", (2, "shared"): "2 threads, one stream",
             (4, "own"): "4 threads, own streams", (4, "shared"): "4 threads, one stream"}
    by = {(p.get("size"), p.get("threads"), p.get("streams")): p.get("ns_per_pair") for p in pairs}
    base = {b.get("size"): b for b in rows_of(doc, "cuda_baselines")} if baselines else {}
    header = ["size"] + [f"Kitsune, {names[c]}" for c in cols]
    if base:
        header += ["cudaMalloc + cudaFree", "cudaMallocAsync + cudaFreeAsync"]
    body = []
    for s in dict.fromkeys(p.get("size") for p in pairs):
        row = [size_name(s)] + [num(by.get((s, t, st))) for t, st in cols]
        if base:
            b = base.get(s) or {}
            row += [num(b.get("cudaMalloc_ns")), num(b.get("cudaMallocAsync_ns"))]
        body.append(row)
    return table(header, body)


def render_alloc_bench(doc):
    out = [f"ns per `kt_alloc` + `kt_free` pair as one thread sees it, median of 5 runs (backend "
           f"{doc.get('backend', '?')}, CPU {doc.get('cpu', '?')}, peak slack {doc.get('peak_slack', '?')} B); "
           "the CUDA columns are the driver's own allocators, one thread. PyTorch's native allocator is measured "
           "from torch, in `alloc_torch.json`.", ""]
    out += pairs_table(doc)
    rnd = rows_of(doc, "random_allocations")
    if rnd:
        rl = [r["reserved_over_live"] for r in rnd if "reserved_over_live" in r]
        ns = [r["ns_per_op"] for r in rnd if "ns_per_op" in r]
        out += ["", f"RMM's random_allocations recipe ({len(rnd)} runs, N 1,000 to 100,000 allocations up to "
                f"1-64 MiB): peak reserved / peak live {min(rl):.3f} to {max(rl):.3f}, {num(min(ns))} to "
                f"{num(max(ns))} ns per operation."]
    return out


def render_alloc_bench_exact(doc):
    return ["The same pairs with exact peak statistics (peak slack 0: one shared atomic per call), ns per pair.",
            ""] + pairs_table(doc, baselines=False)


def render_alloc_replay(doc):
    out = [f"A recorded allocation trace (`{doc.get('trace', '?')}`) replayed through Kitsune's pool on one "
           f"thread, backend {doc.get('backend', '?')}; time is the best of the repeats.", ""]
    header = ["events", "ns per operation", "peak reserved MiB", "peak live MiB", "reserved / live"]
    mib = 2 ** 20
    body = [[doc.get("events", "-"), num(doc.get("ns_per_op")),
             fixed(doc["peak_reserved"] / mib if doc.get("peak_reserved") else None, 1),
             fixed(doc["peak_live"] / mib if doc.get("peak_live") else None, 1), fixed(doc.get("reserved_over_live"), 3)]]
    return out + table(header, body)


def render_memplan(doc):
    labels = {"plan": "planned offsets (`kt_memplan`)", "pool_vmm": "Kitsune pool, VMM",
              "pool_segments": "Kitsune pool, segments", "pool_vmm_held": "Kitsune pool, VMM, releases held",
              "pool_segments_held": "Kitsune pool, segments, releases held"}
    out = [f"{doc.get('traces', '?')} synthetic training-step lifetimes on the host fake backend (bytes only, "
           "no time): memory each layout needs over the live peak (1.00 is none wasted). Releases held: as "
           "during a CUDA graph capture, nothing is given back.", ""]
    body = [[labels.get(k, k), fixed(v.get("mean"), 3), fixed(v.get("worst"), 3)]
            for k, v in doc.items() if isinstance(v, dict) and "mean" in v]
    return out + table(["layout", "mean x live peak", "worst x live peak"], body)


# ---- whole-step graph memory and loss curves ------------------------------------------
GMEM_CONFIGS = {"native": "PyTorch allocator, PyTorch's graph pool", "kitsune_pool": "Kitsune pool",
                "kitsune_plan": "Kitsune pool, planned layout", "kitsune_plan_1s": "planned layout, one stream",
                "kitsune_plan_ob0": "planned layout, optimizer after the backward",
                "kitsune_plan_nowait": "planned layout, no waits"}


def render_graph_memory(doc):
    out = ["Memory a whole-step CUDA graph (`kitsune.compile_step`) holds against the eager step's peak, each "
           "configuration in its own process. graph / eager is the allocator's reserved bytes with the graph "
           "alive (after an empty_cache) over the eager step's peak allocated bytes; static is what is allocated "
           f"before a step (parameters, optimizer state, batches). ms per step: median over blocks of 10 of "
           f"{doc.get('steps', '?')} steps.", ""]
    mib = 2 ** 20
    header = ["model", "configuration", "static MiB", "eager peak MiB", "graph reserved MiB", "graph / eager",
              "ms per step"]
    body = []
    for r in rows_of(doc):
        if "error" in r:
            body.append([r.get("model"), GMEM_CONFIGS.get(r.get("config"), r.get("config")), "failed", "", "", "", ""])
            continue
        body.append([r.get("model"), GMEM_CONFIGS.get(r.get("config"), r.get("config")),
                     fixed(r["static"] / mib, 1), fixed(r["eager_peak"] / mib, 1), fixed(r["graph_reserved"] / mib, 1),
                     ratio(r["graph_reserved"], r["eager_peak"]), num(r.get("ms"))])
    return out + table(header, body)


def render_loss_match(doc):
    tf32 = doc.get("tf32") or {}
    out = [f"Each model trained {doc.get('steps', '?')} steps from the same weights on the same batches by eager "
           "PyTorch (AdamW foreach: the reference), eager with fused AdamW (the yardstick) and Kitsune "
           "(`compile_step`). A model passes when Kitsune's largest |loss - eager loss| is at most "
           f"max({doc.get('factor', 3)} x the fused run's, floor). TF32: convolutions "
           f"{'on' if tf32.get('cudnn') else 'off'}, matmuls {'on' if tf32.get('matmul') else 'off'}.", ""]
    header = ["model", "dtype", "result", "Kitsune max deviation", "fused AdamW max deviation", "bound"]
    body = [[r.get("model"), r.get("dtype"), "pass" if r.get("passed") else "FAIL", num(r.get("kitsune_max_dev")),
             num(r.get("eager_fused_max_dev")), num(r.get("bound"))] for r in rows_of(doc)]
    return out + table(header, body)


# ---- fused kernels --------------------------------------------------------------------
def render_elementwise(doc):
    rows = rows_of(doc)
    bf16 = sorted({r["input_mb"] for r in rows if r.get("dtype") == "bfloat16"})
    at = 256 if 256 in bf16 else (bf16[-1] if bf16 else None)
    out = [f"Achieved bandwidth, GB/s, counting the bytes an ideal fused kernel moves (each input read once, each "
           f"output written once); copy is `dst.copy_(src)` of the same bytes. bf16 at {at} MB per input, CUDA "
           f"events, median of {doc.get('reps', '?')} repeats with the L2 flushed before each. The last column "
           "is Kitsune's share of copy bandwidth at every bf16 size.", ""]
    header = ["op", "copy GB/s", "Kitsune GB/s", "Kitsune % of copy", "torch.compile GB/s", "eager GB/s",
              "% of copy at " + " / ".join(f"{s} MB" for s in bf16)]
    body = []
    for op in dict.fromkeys(r.get("op") for r in rows):
        r = next((x for x in rows if x.get("op") == op and x.get("dtype") == "bfloat16" and x.get("input_mb") == at),
                 None)
        g = (r or {}).get("gbs") or {}
        shares = []
        for s in bf16:
            x = next((x for x in rows if x.get("op") == op and x.get("dtype") == "bfloat16" and x.get("input_mb") == s),
                     None)
            shares.append(f"{100 * x['of_copy']:.0f}" if x and "of_copy" in x else "-")
        body.append([op, num(g.get("copy"), 4), num(g.get("kitsune"), 4),
                     f"{100 * r['of_copy']:.0f}%" if r and "of_copy" in r else "-",
                     num(g.get("compile"), 4), num(g.get("eager"), 4), " / ".join(shares)])
    out += table(header, body)
    if doc.get("failed"):
        out += ["", "Failed: " + "; ".join(doc["failed"])]
    return out


def render_loss_head(doc):
    rows = rows_of(doc)
    by = {(r.get("shape"), r.get("variant")): r for r in rows}
    out = ["The LM head, `cross_entropy(x @ W.T, targets)`, forward + backward in bf16: median ms of "
           f"{doc.get('reps', '?')} repeats (CUDA events) and the peak memory allocated during one call above its "
           "inputs. Kitsune: `kitsune.ops.linear_cross_entropy`.", ""]
    header = ["shape", "rows x hidden x vocab", "eager ms", "torch.compile ms", "Kitsune ms", "Kitsune / eager",
              "eager peak MiB", "torch.compile peak MiB", "Kitsune peak MiB"]
    body = []
    for s in dict.fromkeys(r.get("shape") for r in rows):
        e, c, k = (by.get((s, v)) or {} for v in ("eager", "compile", "kitsune"))
        dims = f"{e.get('rows', '?')} x {e.get('hidden', '?')} x {e.get('vocab', '?')}"
        body.append([s, dims, num(e.get("ms")), num(c.get("ms")), num(k.get("ms")), ratio(k.get("ms"), e.get("ms")),
                     num(e.get("peak_mib"), 4), num(c.get("peak_mib"), 4), num(k.get("peak_mib"), 4)])
    return out + table(header, body)


def render_optimizer(doc):
    rows = rows_of(doc)
    by = {(r.get("dtype"), r.get("variant")): r.get("ms") for r in rows}
    first = rows[0] if rows else {}
    out = [f"One optimizer step over GPT-2 small's parameters ({first.get('params', 0) / 1e6:.0f}M in "
           f"{first.get('tensors', '?')} tensors), ms, median over {doc.get('steps', '?')} steps (CUDA events).", ""]
    header = ["dtype", "AdamW foreach", "AdamW fused", "Kitsune AdamW", "Kitsune / fused", "SGD foreach",
              "Kitsune SGD", "Kitsune / foreach"]
    body = []
    for d in dict.fromkeys(r.get("dtype") for r in rows):
        g = lambda v: by.get((d, v))  # noqa: E731
        body.append([d, num(g("adamw_foreach")), num(g("adamw_fused")), num(g("adamw_kitsune")),
                     ratio(g("adamw_kitsune"), g("adamw_fused")), num(g("sgd_foreach")), num(g("sgd_kitsune")),
                     ratio(g("sgd_kitsune"), g("sgd_foreach"))])
    return out + table(header, body)


def render_linear_act(doc):
    out = ["`kitsune.linear_act` (one cuBLASLt GEMM with bias and activation in its epilogue) against the same "
           f"Linear + activation, bf16, ms, median of {doc.get('reps', '?')} repeats with the L2 flushed.", ""]
    header = ["rows x in -> out", "activation", "eager fwd", "torch.compile fwd", "Kitsune fwd", "eager fwd+bwd",
              "torch.compile fwd+bwd", "Kitsune fwd+bwd"]
    body = [[f"{r.get('rows')} x {r.get('in')} -> {r.get('out')}", r.get("act"), num(r.get("eager_fwd_ms")),
             num(r.get("torch.compile_fwd_ms")), num(r.get("kitsune_fwd_ms")), num(r.get("eager_fwd_bwd_ms")),
             num(r.get("torch.compile_fwd_bwd_ms")), num(r.get("kitsune_fwd_bwd_ms"))] for r in rows_of(doc)]
    return out + table(header, body)


def render_colsum(doc):
    out = [f"Bias-gradient column sums, microseconds a call: {doc.get('calls_per_graph', '?')} calls captured "
           "in one CUDA graph, the replay timed (launch cost included, L2 not flushed).", ""]
    header = ["shape", "rows x cols", "dtype", "ATen us", "Kitsune us", "Kitsune / ATen"]
    body = [[r.get("shape"), f"{r.get('rows')} x {r.get('cols')}", r.get("dtype"), num(r.get("aten_us")),
             num(r.get("kitsune_us")), ratio(r.get("kitsune_us"), r.get("aten_us"))] for r in rows_of(doc)]
    return out + table(header, body)


def render_pool(doc):
    out = ["Max pooling and global average pooling (the mean over H and W), microseconds a call inside a "
           "captured CUDA graph, forward alone and forward + backward.", ""]
    header = ["op", "shape", "dtype", "ATen fwd us", "Kitsune fwd us", "ATen fwd+bwd us", "Kitsune fwd+bwd us"]
    body = []
    for r in rows_of(doc):
        op = f"max_pool2d {r.get('kernel')}x{r.get('kernel')}/{r.get('stride')}/{r.get('padding')}"
        body.append([op, f"{r.get('shape')} {tuple(r.get('size') or ())}", r.get("dtype"), num(r.get("aten_fwd_us")),
                     num(r.get("kitsune_fwd_us")), num(r.get("aten_fwd_bwd_us")), num(r.get("kitsune_fwd_bwd_us"))])
    for r in rows_of(doc, "means"):
        body.append(["mean over H, W", f"{r.get('shape')} {tuple(r.get('size') or ())}", r.get("dtype"),
                     num(r.get("aten_fwd_us")), num(r.get("kitsune_fwd_us")), num(r.get("aten_fwd_bwd_us")),
                     num(r.get("kitsune_fwd_bwd_us"))])
    return out + table(header, body)


# ---- data path ------------------------------------------------------------------------
def render_pinned(doc):
    labels = {"torch": "PyTorch (`pin_memory=True`)", "kitsune": "Kitsune pinned pool",
              "kitsune_keep_cache": "Kitsune pinned pool, cache kept"}
    mib = 2 ** 20
    out = [f"Pinned host memory for a prefetch queue of depth 4 fed {doc.get('steps', '?')} batches of random "
           "size, each allocator in its own process.", ""]
    header = ["allocator", "peak pinned MiB", "peak requested MiB", "pinned / requested", "ms per batch to allocate",
              "pinning calls per batch"]
    body = [[labels.get(k, k), fixed(r["peak_pinned"] / mib, 1), fixed(r["peak_requested"] / mib, 1),
             fixed(r.get("ratio"), 3), num(r.get("alloc_ms_per_batch")), num(r.get("pins_per_batch"))]
            for k, r in (doc.get("results") or {}).items()]
    return out + table(header, body)


def render_prefetch(doc):
    labels = {"resident": "batches already on the GPU (compute alone)",
              "standard": "DataLoader(pin_memory=True) + `.to(non_blocking=True)`",
              "kitsune": "`kitsune.prefetch(loader, depth=2)`"}
    out = [f"A small CNN (width {doc.get('width', '?')}) trained on CIFAR-sized batches of {doc.get('batch', '?')} "
           f"from a DataLoader with {doc.get('workers', '?')} workers, {doc.get('steps', '?')} timed steps. One "
           f"batch's copy takes {num(doc.get('copy_ms'))} ms; copy hidden is 1 - (step - resident step) / copy.", ""]
    header = ["mode", "ms per step", "copy hidden"]
    body = [[labels.get(k, k), num(r.get("ms_per_step"), 4),
             f"{100 * r['copy_hidden']:.0f}%" if "copy_hidden" in r else "-"]
            for k, r in (doc.get("modes") or {}).items()]
    return out + table(header, body)


# ---- the commands that write each JSON -------------------------------------------------
def flags(doc, *spec):
    """' --flag value' for each (key, default, flag) whose value in doc is not the default
    (a value of True: the bare flag)."""
    out = ""
    for key, default, flag in spec:
        v = doc.get(key)
        if v is None or v == default or v is False:
            continue
        out += f" {flag}" if v is True else f" {flag} {v}"
    return out


def listed(doc, key, default, flag):
    """' --flag a,b,c' when the rows' values of key, in order, are not the default list."""
    vals = [str(v) for v in dict.fromkeys(r.get(key) for r in rows_of(doc))]
    return f" {flag} {','.join(vals)}" if vals and vals != default else ""


def cmd_train_models(d):
    quick = " --quick" if d.get("steps") == 30 else flags(d, ("steps", 100, "--steps"))
    return f"`python3 bench/kernels/train_models.py{quick}` (part of `make bench-kernels`)"


def cmd_alloc_torch(d):
    return "`python3 bench/alloc_torch.py" + flags(d, ("iters", 20000, "--iters"), ("rounds", 7, "--rounds"),
                                                   ("pinned_cpu", 2, "--cpu")) + "`"


def cmd_graph_memory(d):
    return ("`python3 bench/graph_memory.py" + listed(d, "model", MODELS_DEFAULT, "--models")
            + listed(d, "config", ["native", "kitsune_pool", "kitsune_plan"], "--configs")
            + flags(d, ("steps", 40, "--steps")) + "`")


def cmd_loss_match(strict):
    def cmd(d):
        return ("`python3 bench/loss_match.py" + (" --strict" if strict else "")
                + listed(d, "model", MODELS_DEFAULT, "--models") + flags(d, ("steps", 100, "--steps")) + "`")
    return cmd


def cmd_prefetch(d):
    width = f" --width {d.get('width')}" if len(d.get("resident_ms_by_width") or {}) == 1 else ""
    return ("`python3 bench/data/prefetch_train.py" + flags(d, ("batch", 2048, "--batch"), ("steps", 150, "--steps"),
                                                           ("workers", 6, "--workers")) + width
            + "` (part of `make bench-data`)")


def script(path, *spec, make=None):
    def cmd(d):
        return f"`python3 {path}" + flags(d, *spec) + "`" + (f" (part of `make {make}`)" if make else "")
    return cmd


def literal(text):
    return lambda d: text


# (file, title, does the program use torch, command, table), in the order LATEST.md gives them
SECTIONS = [
    ("zoo.json", "The model zoo: models people train, by the recipes they would pick", True, zoo_command, render_zoo),
    ("zoo_lm_head.json", "The model zoo again: GPT-2 and BERT with the LM head's GEMMs padded (wide_linear)", True,
     zoo_command, render_zoo),
    ("alloc_churn.json", "Allocation churn from Python, per allocator", True,
     script("bench/alloc_churn.py"), render_alloc_churn),
    ("models.json", "Training steps: eager, torch.compile and Kitsune", True,
     lambda d: f"`{models_command(d)}`", render_models),
    ("kernels_train_models.json", "GPT-2 and LLaMA-style training: Kitsune's kernels without a CUDA graph", True,
     cmd_train_models, render_train_models),
    ("alloc_torch.json", "Allocation cost under PyTorch, against PyTorch's allocators", True, cmd_alloc_torch,
     render_alloc_torch),
    ("alloc_shapes.json", "Fragmentation: shape-varying training per allocator", True,
     script("bench/alloc_shapes.py", ("steps", 60, "--steps")), render_alloc_shapes),
    ("alloc_bench_cuda.json", "Allocator fast path in C: alloc + free pairs", False,
     literal("`make bench` (`build/bench/alloc_bench --backend cuda --json ...`)"), render_alloc_bench),
    ("alloc_bench_exact_cuda.json", "Allocator fast path in C, exact peak statistics", False,
     literal("`make bench` (`build/bench/alloc_bench --backend cuda --pairs-only --peak-slack 0 --json ...`)"),
     render_alloc_bench_exact),
    ("alloc_replay_random_10k_4mib_cuda.json", "A recorded allocation trace replayed", False,
     literal("`make bench` (`build/bench/alloc_replay bench/traces/random_10k_4mib.csv --backend cuda --repeat 5 "
             "--json ...`)"), render_alloc_replay),
    ("graph_memory.json", "Whole-step CUDA graph memory against the eager step", True, cmd_graph_memory,
     render_graph_memory),
    ("memplan_traces.json", "Planned memory layout against the pool, on synthetic lifetimes", False,
     lambda d: f"`build/bench/memplan_traces {d.get('traces', 200)}` (built by `make all`)", render_memplan),
    ("kernels_elementwise.json", "Fused elementwise and normalisation kernels: GB/s against copy", True,
     lambda d: "`python3 bench/kernels/elementwise.py" + (" --quick" if d.get("reps") == 7 else "")
               + flags(d, ("flush", "write", "--flush")) + "` (part of `make bench-kernels`)", render_elementwise),
    ("kernels_chains.json", "Pointwise chains: one precompiled kernel against Inductor's", True,
     lambda d: "`python3 bench/kernels/chains.py" + (" --quick" if all(r["mb"] == 64 for r in rows_of(d)) else "")
               + "`", render_chains),
    ("kernels_loss_head.json", "LM head with cross-entropy", True,
     lambda d: "`python3 bench/kernels/loss_head.py" + (" --quick" if d.get("reps") == 5 else "")
               + "` (part of `make bench-kernels`)", render_loss_head),
    ("kernels_optimizer.json", "Optimizer step", True,
     lambda d: "`python3 bench/kernels/optimizer.py" + (" --quick" if d.get("steps") == 10 else "")
               + "` (part of `make bench-kernels`)", render_optimizer),
    ("kernels_linear_act.json", "Linear + activation", True,
     script("bench/kernels/linear_act.py", ("reps", 50, "--reps")), render_linear_act),
    ("kernels_colsum.json", "Bias-gradient column sums", True,
     script("bench/kernels/colsum.py", ("reps", 20, "--reps")), render_colsum),
    ("kernels_pool.json", "Pooling", True, script("bench/kernels/pool.py", ("reps", 20, "--reps")), render_pool),
    ("loss_match.json", "Loss curves: Kitsune against eager", True, cmd_loss_match(False), render_loss_match),
    ("loss_match_strict.json", "Loss curves without TF32", True, cmd_loss_match(True), render_loss_match),
    ("pinned_footprint.json", "Pinned host memory footprint", True,
     script("bench/data/pinned_footprint.py", ("steps", 2000, "--steps"), ("host_memory", False, "--host-memory"),
            make="bench-data"), render_pinned),
    ("prefetch_train.json", "Prefetching batches to the GPU", True, cmd_prefetch, render_prefetch),
]


def anchor(title):
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


def build(results):
    names = sorted(f for f in os.listdir(results) if f.endswith(".json") and os.path.isfile(os.path.join(results, f)))
    known = [s for s in SECTIONS if s[0] in names]
    unknown = [f for f in names if f not in {s[0] for s in SECTIONS}]
    out = ["# Latest benchmark results", "",
           "Generated by `python3 tools/results.py` from the JSON files beside this one (the current result of each "
           "benchmark); do not edit by hand. How each number is measured: [docs/benchmarks.md]"
           "(../../docs/benchmarks.md). Earlier runs: [archive/](archive/). The Python benchmarks run from the "
           f"repository root after `make all`, with {GPU_ENV} (the make targets set both).", ""]
    for name, title, _, _, _ in known:
        out.append(f"- [{title}](#{anchor(title)})")
    for name in unknown:
        out.append(f"- [{name}](#{anchor(name)})")
    for name, title, torch_used, command, render in known:
        path = os.path.join(results, name)
        with open(path) as f:
            doc = json.load(f)
        try:
            body = render(doc)
            cmd = command(doc)
        except Exception as e:  # noqa: BLE001 - name the file whose schema this script no longer reads
            raise SystemExit(f"tools/results.py: cannot build the table of {name}: {type(e).__name__}: {e}")
        out += ["", f"## {title}", "", source(doc, name, torch_used) + "  ", f"Command: {cmd}", ""] + body
        png = os.path.splitext(name)[0] + ".png"
        if os.path.exists(os.path.join(results, png)):
            out += ["", f"Chart: [{png}]({png})"]
    for name in unknown:
        with open(os.path.join(results, name)) as f:
            doc = json.load(f)
        out += ["", f"## {name}", "", source(doc, name) + "  ",
                "tools/results.py has no table for this file yet; read the JSON."]
    return "\n".join(out) + "\n"


# ---- the README's headline table -------------------------------------------------------
README = os.path.join(os.path.dirname(HERE), "README.md")
README_BEGIN = "<!-- headline: generated by tools/results.py from bench/results/zoo.json -->"
README_END = "<!-- headline end -->"


def readme_block(results):
    """The README's headline: the zoo's training steps, eager / torch.compile / the best
    stock recipe / Kitsune, from zoo.json."""
    with open(os.path.join(results, "zoo.json")) as f:
        doc = json.load(f)
    by, get = _zoo_by(doc)
    models = list(dict.fromkeys(r.get("model") for r in rows_of(doc)))

    def cell(m, rc):
        r = by.get((m, rc))
        return "-" if r is None else "failed" if "error" in r else f"{num(r.get('ms'))} ({num(r.get('setup_s'), 2)} s)"

    out = [README_BEGIN, "",
           f"Training step time in ms (lower is better) on {doc.get('device', 'an unnamed device')}, "
           f"torch {doc.get('torch', '?')}, {when(doc)}; random weights, bf16 autocast, each recipe in a fresh "
           "process; setup in seconds (compilation, capture, warm-up) in brackets. Command: "
           f"{zoo_command(doc)}.", ""]
    body = []
    for m in models:
        k = get(m, "kitsune")
        body.append([ZOO_NAMES.get(m, m), cell(m, "eager"), cell(m, "compile"), cell(m, "stock_graph"),
                     cell(m, "kitsune"), ratio(k, get(m, "compile"))])
    out += table(["model", "eager", "torch.compile", "torch.compile + CUDA graph", "Kitsune",
                  "Kitsune / torch.compile"], body)
    out += ["", "eager: the model as written, fused AdamW (SGD with momentum for ResNet-50); torch.compile: "
            "`torch.compile(model)`, default mode; torch.compile + CUDA graph: the whole step (forward, backward, "
            "optimizer) captured by hand in one `torch.cuda.graph`; Kitsune: `kitsune.optimize`, "
            "`KitsuneOptimizer` and `kitsune.compile_step`. Peak memory, losses and more recipes: "
            "[bench/results/LATEST.md](bench/results/LATEST.md).", "", README_END]
    return "\n".join(out)


def with_readme_block(text, block):
    """README text with its headline block replaced; ValueError without the markers."""
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise ValueError(f"README.md has no {README_BEGIN!r} ... {README_END!r} block")
    return text[:i] + block + text[j + len(README_END):]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=RESULTS, help="the folder of current result JSONs (default bench/results)")
    ap.add_argument("--check", action="store_true", help="exit 1 if LATEST.md is stale, write nothing")
    ap.add_argument("--readme", default=README, help="the README whose headline block is regenerated")
    a = ap.parse_args()
    path = os.path.join(a.results, OUT_NAME)
    with open(a.readme) as f:
        readme = f.read()
    wanted = {path: build(a.results), a.readme: with_readme_block(readme, readme_block(a.results))}
    for p, text in wanted.items():
        try:
            with open(p) as f:
                old = f.read()
        except FileNotFoundError:
            old = None
        if old == text:
            continue
        if a.check:
            sys.exit(f"{p} is {'missing' if old is None else 'stale'}: run python3 tools/results.py (make results)")
        with open(p, "w") as f:
            f.write(text)
        print("wrote", p)


if __name__ == "__main__":
    main()
