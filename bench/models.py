"""Whole training steps of five models, each trained by every recipe from the same
weights on the same batches:

    python bench/models.py [--out DIR] [--models mlp,lenet,resnet18,gpt,inception] [--steps N]

A model may name its batch size: --models inception:8,inception:64 (the rows' model is
then "inception:8").

Models: mlp (784-512-256-10, batch 64), lenet (LeNet-5 on 1x32x32, batch 64),
resnet18 (torchvision, 10 classes, 3x32x32, batch 128), gpt (6 layers, d 512, 8 heads,
seq 256, batch 16, vocab 8192, bf16 parameters; bench/kernels/train_models.py's
GPT-2 block), inception (a stem, two Inception-style blocks of four branches, batch 64,
3x32x32). Optimizer AdamW(lr 1e-3) everywhere.

Recipes:
  eager          torch.optim.AdamW (foreach)
  eager_fused    AdamW(fused=True)
  compile        torch.compile(model) + AdamW(fused=True)
  compile_ro     torch.compile(model, mode="reduce-overhead") + AdamW(fused=True)
  stock_graph    the best stock recipe: torch.compile(model) and AdamW(fused=True,
                 capturable=True) under one manual whole-step torch.cuda.graph (three
                 warm-up steps on a side stream first, as PyTorch's docs do)
  kitsune_eager  kitsune.optimize(model) + KitsuneOptimizer, eager
  kitsune        kitsune.optimize(model) + kitsune.compile_step (one CUDA graph a step;
                 independent branches on up to 4 streams where kitsune.sched's plan gains)
  kitsune_1s     the same on one stream (compile_step(streams=1))
  kitsune_nchw   kitsune with compile_step(channels_last=False): a conv net's input and
                 weights kept NCHW (by default compile_step makes both channels-last)
  kitsune_mc     kitsune with the stream plan's costs measured on the first batch
                 (compile_step(stream_costs="measured")) instead of the roofline's
  kitsune_ob0    kitsune with the optimizer's update after the backward, not inside it
                 (compile_step(optimizer_in_backward=False))

Each recipe runs in a fresh process, which first trains a copy of the model for 3 eager
steps, untimed: the process's first use of the GPU (CUDA context, cuBLAS and cuDNN handles,
cuDNN's benchmarks for the eager layouts, lazily loaded kernels) is then no recipe's setup,
and no recipe's setup is helped by what an earlier recipe imported, compiled or benchmarked
(in one process, a recipe run after torch.compile's finds Inductor's modules imported,
among others: Kitsune's setup on the conv nets measured 0.25-0.42 s there, models_4da69b4.json,
and 2.9-3.0 s in a fresh process after eager steps, models_setup_fresh_process_4da69b4.json
and h100_setup_fresh_resnet18_4da69b4.log, before 5387e9c).
Each recipe runs --steps steps (default 60). Reported: ms/step (the median over blocks
of 10 steps between CUDA events, steps 20 on, no sync inside a block), the host's ms
per step, setup seconds (the first 3 steps' wall time, synchronized, less 3 steady
steps: compile, capture and warm-up), peak memory allocated and reserved (MiB, above
what was allocated and reserved before the recipe, after a gc and emptying the
caches: the model copy, its gradients and optimizer state, activations, graph pools),
and the loss after the last step. Writes models.json and models.md (a table) to --out.
--kitsune-allocator runs every recipe on Kitsune's allocator (compile_step then plans
its graph's memory; compile_ro gets plain CUDA graphs instead of CUDA graph trees).
cuDNN: cudnn.benchmark is on in every process unless --no-cudnn-benchmark
(--cudnn-benchmark-limit N: how many algorithms it times); --cudnn-mode-b sets
TORCH_CUDNN_USE_HEURISTIC_MODE_B=1 for every process (cuDNN's more accurate heuristics
choose what is not timed). models.json records the three.
"""
import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "kernels"))
from benchlib import run_child, write_result  # noqa: E402
import kitsune  # noqa: E402
from sched_demo import Inception  # noqa: E402

RECIPES = ["eager", "eager_fused", "compile", "compile_ro", "stock_graph", "kitsune_eager", "kitsune", "kitsune_1s",
           "kitsune_nchw", "kitsune_mc", "kitsune_ob0"]


# ---- models and their batches ---------------------------------------------------------
class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.f1, self.f2, self.f3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f3(F.relu(self.f2(F.relu(self.f1(x.flatten(1))))))


class InceptionNet(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.a = Inception(c)
        self.mid = nn.Sequential(nn.Conv2d(4 * c, c, 1), nn.ReLU())
        self.b = Inception(c)
        self.fc = nn.Linear(4 * c, 10)

    def forward(self, x):
        x = self.b(self.mid(self.a(self.stem(x))))
        return self.fc(x.mean((2, 3)))


class GPT(nn.Module):
    """train_models.py's GPT-2 block stack, returning logits (the loss is loss_fn's)."""

    def __init__(self, layers=6, d=512, h=8, vocab=8192, seq=256):
        super().__init__()
        from train_models import GPT2Block
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.Sequential(*[GPT2Block(d, h) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.norm(self.blocks(self.emb(idx) + self.pos[: idx.shape[1]])))


def lm_loss(logits, target):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


def build(name, gen, batch=None):
    """(model on cuda, loss_fn, batches): four fixed batches, cycled. batch: the batch size
    instead of the model's default (the image models; e.g. --models inception:16)."""
    def images(b, c, hw, classes=10):
        b = batch or b
        return [(torch.randn(b, c, hw, hw, generator=gen).cuda(), torch.randint(0, classes, (b,), generator=gen).cuda())
                for _ in range(4)]
    if name == "mlp":
        m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
        b = batch or 64
        data = [(torch.randn(b, 784, generator=gen).cuda(), torch.randint(0, 10, (b,), generator=gen).cuda())
                for _ in range(4)]
        return m.cuda(), F.cross_entropy, data
    if name == "lenet":
        return LeNet5().cuda(), F.cross_entropy, images(64, 1, 32)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10).cuda(), F.cross_entropy, images(128, 3, 32)
    if name == "inception":
        return InceptionNet().cuda(), F.cross_entropy, images(64, 3, 32)
    if name == "gpt":
        m = GPT().cuda().to(torch.bfloat16)
        data = []
        for _ in range(4):
            t = torch.randint(0, 8192, (batch or 16, 257), generator=gen).cuda()
            data.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return m, lm_loss, data
    raise ValueError(f"unknown model {name!r}")


# ---- recipes: each returns step(x, y) -> loss ------------------------------------------
def build_spec(spec, gen):
    """build() for a model named as on the command line: "inception:16" is the inception
    net at batch 16."""
    name, _, batch = spec.partition(":")
    return build(name, gen, int(batch) if batch else None)


def eager_step(model, loss_fn, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def stock_graph_step(model, loss_fn):
    cm = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    state = {}

    def step(x, y):
        if "graph" not in state:   # warm up on a side stream, then capture the whole step
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    loss = eager_step(cm, loss_fn, opt)(x, y)
            torch.cuda.current_stream().wait_stream(side)
            sx, sy = x.clone(), y.clone()
            g = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(g):
                sl = loss_fn(cm(sx), sy)
                sl.backward()
                opt.step()
            state.update(graph=g, x=sx, y=sy, loss=sl)
            return loss
        state["x"].copy_(x, non_blocking=True)
        state["y"].copy_(y, non_blocking=True)
        state["graph"].replay()
        return state["loss"].detach().clone()
    return step


def make(recipe, model, loss_fn):
    adamw = dict(lr=1e-3)
    if recipe == "eager":
        return eager_step(model, loss_fn, torch.optim.AdamW(model.parameters(), foreach=True, **adamw)), None
    if recipe == "eager_fused":
        return eager_step(model, loss_fn, torch.optim.AdamW(model.parameters(), fused=True, **adamw)), None
    if recipe in ("compile", "compile_ro"):
        cm = torch.compile(model, mode="reduce-overhead" if recipe == "compile_ro" else None)
        return eager_step(cm, loss_fn, torch.optim.AdamW(model.parameters(), fused=True, **adamw)), None
    if recipe == "stock_graph":
        return stock_graph_step(model, loss_fn), None
    km = kitsune.optimize(model)
    opt = kitsune.KitsuneOptimizer(torch.optim.AdamW, km.parameters(), **adamw)
    if recipe == "kitsune_eager":
        return eager_step(km, loss_fn, opt), opt
    step = kitsune.compile_step(km, loss_fn, opt, streams=1 if recipe == "kitsune_1s" else 4,
                                stream_costs="measured" if recipe == "kitsune_mc" else None,
                                channels_last=False if recipe == "kitsune_nchw" else None,
                                optimizer_in_backward=recipe != "kitsune_ob0")
    return step, step


def fresh_peak():
    """What earlier recipes left (compiled graphs, graph pools) is freed and the device's
    peak starts now: a recipe's peak memory, and compile_step's plan budget (its warm-up's
    rise over the peak since the last reset), are then its own."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run(recipe, base, loss_fn, data, steps):
    fresh_peak()
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    step, extra = make(recipe, model, loss_fn)
    losses, first_s = [], None
    for i in range(3):
        losses.append(step(*data[i % len(data)]))
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    blocks, host = [], []
    i = 3
    while i < steps:
        n = min(10, steps - i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        a.record()
        for _ in range(n):
            losses.append(step(*data[i % len(data)]))
            i += 1
        b.record()
        host.append((time.perf_counter() - h0) * 1e3 / n)
        blocks.append((a, b, n, i))
    torch.cuda.synchronize()
    per = [(a.elapsed_time(b) / n, end) for a, b, n, end in blocks]
    timed = [ms for ms, end in per if end > 20] or [ms for ms, _ in per]
    ms = statistics.median(timed)
    row = {"recipe": recipe, "ms": ms, "host_ms": statistics.median(host[len(host) - len(timed):]),
           "setup_s": max(0.0, first_s - 3 * ms / 1e3), "first_3_steps_s": first_s,
           "peak_alloc_mib": (torch.cuda.max_memory_allocated() - alloc0) / 2**20,
           "peak_reserved_mib": (torch.cuda.max_memory_reserved() - reserved0) / 2**20,
           "left_before_mib": alloc0 / 2**20,
           "final_loss": losses[-1].float().item(), "steps": steps}
    if recipe in ("kitsune", "kitsune_1s", "kitsune_nchw", "kitsune_mc", "kitsune_ob0"):
        st = extra.stats()
        row["compile_step"] = {k: st[k] for k in ("replays", "eager_steps", "captures", "reason", "streams",
                                                  "streams_reason", "channels_last", "channels_last_reason",
                                                  "memory_plan", "optimizer_in_backward", "memsets_replaced",
                                                  "conv_grads", "setup_s", "setup_phases", "capture_parts")}
    del step, extra, model
    if recipe.startswith("compile") or recipe == "stock_graph":
        torch._dynamo.reset()
    return row


def warm_up(base, loss_fn, data):
    """3 untimed eager steps on a copy of the model: what a program's first eager steps pay
    once (CUDA context, cuBLAS and cuDNN handles and benchmarks, lazily loaded kernels),
    so that a recipe's setup counts its own work, not the process's first use of the GPU."""
    step, _ = make("eager", copy.deepcopy(base), loss_fn)
    for i in range(3):
        step(*data[i % len(data)])
    torch.cuda.synchronize()


def child(spec, recipe, steps):
    """One recipe in a fresh process, after the model's eager warm-up; prints its row."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    try:
        base, loss_fn, data = build_spec(spec, gen)
        warm_up(base, loss_fn, data)
        row = dict(model=spec, **run(recipe, base, loss_fn, data, steps))
    except Exception as e:   # noqa: BLE001 - report and go on (e.g. torchvision missing)
        traceback.print_exc()
        row = {"model": spec, "recipe": recipe, "error": f"{type(e).__name__}: {e}"[:400]}
    print("ROW " + json.dumps(row), flush=True)


def in_child(spec, recipe, args):
    """Runs child() in a new interpreter; its output passes through, its row comes back."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, recipe, "--steps", str(args.steps)]
    if args.kitsune_allocator:
        cmd.append("--kitsune-allocator")
    if args.cudnn_benchmark_limit is not None:
        cmd += ["--cudnn-benchmark-limit", str(args.cudnn_benchmark_limit)]
    if args.no_cudnn_benchmark:
        cmd.append("--no-cudnn-benchmark")
    env = dict(os.environ)
    if args.cudnn_mode_b:   # read once per process, at its first convolution: set before the child starts
        env["TORCH_CUDNN_USE_HEURISTIC_MODE_B"] = "1"
    return run_child(cmd, spec, recipe, env)


def describe(row):
    if "error" in row:
        return f"{row['model']:10s} {row['recipe']:14s} FAILED {row['error'][:120]}"
    cs = row.get("compile_step")
    return (f"{row['model']:10s} {row['recipe']:14s} {row['ms']:8.3f} ms/step  host {row['host_ms']:7.3f}  setup "
            f"{row['setup_s']:6.2f} s  peak {row['peak_alloc_mib']:8.1f} / {row['peak_reserved_mib']:8.1f} MiB"
            f"  loss {row['final_loss']:.4f}"
            + (f"  streams {cs['streams']} ({cs['streams_reason']}), {cs['optimizer_in_backward']} updates in the "
               f"backward" if cs else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--models", default="mlp,lenet,resnet18,gpt,inception")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kitsune-allocator", action="store_true",
                    help="install Kitsune's allocator first (every recipe then runs on it, and compile_step plans its "
                         "graph's memory); compile_ro then uses plain CUDA graphs, not CUDA graph trees, which need "
                         "allocator checkpoints Kitsune does not implement")
    ap.add_argument("--cudnn-benchmark-limit", type=int, default=None,
                    help="torch.backends.cudnn.benchmark_limit in every recipe's process (how many cuDNN algorithms "
                         "benchmark mode tries per convolution; PyTorch's default 10)")
    ap.add_argument("--no-cudnn-benchmark", action="store_true",
                    help="leave torch.backends.cudnn.benchmark off (PyTorch's default: cuDNN's heuristics choose each "
                         "convolution's algorithm, nothing is timed)")
    ap.add_argument("--cudnn-mode-b", action="store_true",
                    help="TORCH_CUDNN_USE_HEURISTIC_MODE_B=1 in every recipe's process: cuDNN's slower, more accurate "
                         "heuristics choose the algorithms cudnn.benchmark does not time (with --no-cudnn-benchmark, "
                         "all of them)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "RECIPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/models.py needs a CUDA GPU")
    if args.child:
        if args.kitsune_allocator:
            import kitsune.allocator
            kitsune.allocator.install()
            import torch._inductor.config as inductor_config
            inductor_config.triton.cudagraph_trees = False
        torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
        if args.cudnn_benchmark_limit is not None:
            torch.backends.cudnn.benchmark_limit = args.cudnn_benchmark_limit
        return child(*args.child, args.steps)
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; each recipe in a fresh process "
          f"after 3 eager steps of the model", flush=True)
    rows = []
    for name in args.models.split(","):
        for recipe in args.recipes.split(","):
            row = in_child(name, recipe, args)
            rows.append(row)
            print(describe(row), flush=True)
            write_result(args.out, "models", {"steps": args.steps, "process": "one per recipe, after 3 eager steps",
                                              "cudnn_benchmark": not args.no_cudnn_benchmark,
                                              "cudnn_benchmark_limit": args.cudnn_benchmark_limit,
                                              # cuDNN's heuristics mode B for its algorithm choices (a PyTorch
                                              # environment setting, read once per process; the children inherit it)
                                              "cudnn_heuristic_mode_b": "1" if args.cudnn_mode_b else
                                              os.environ.get("TORCH_CUDNN_USE_HEURISTIC_MODE_B"),
                                              "kitsune_allocator": args.kitsune_allocator, "rows": rows})
    with open(os.path.join(args.out, "models.md"), "w") as f:
        f.write(table(rows))
    print(table(rows))


def table(rows):
    """Markdown: ms/step per model and recipe, Kitsune's ratio to the best stock recipe."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r.get("recipe")): r for r in rows}
    out = ["| model | " + " | ".join(RECIPES) + " | kitsune / best stock |", "|---" * (len(RECIPES) + 2) + "|"]
    for m in models:
        cells = []
        for rc in RECIPES:
            r = by.get((m, rc))
            cells.append("-" if r is None else "failed" if "error" in r else f"{r['ms']:.3f}")
        stock = [by[(m, rc)]["ms"] for rc in ("eager", "eager_fused", "compile", "compile_ro", "stock_graph")
                 if (m, rc) in by and "error" not in by[(m, rc)]]
        k = by.get((m, "kitsune"))
        ratio = f"{k['ms'] / min(stock):.2f}" if stock and k and "error" not in k else "-"
        out.append(f"| {m} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
