"""Training on several GPUs through torch.distributed: the zoo's GPT-2 and ResNet-50 under
DDP and its Llama-style model under FSDP2, each recipe launched by torchrun in fresh
processes, on N GPUs and on one (the baseline of the scaling efficiency).

    python3 bench/distributed.py [--nproc N] [--models gpt2,resnet50,llama] [--recipes ...]
                                 [--steps 100] [--out DIR] [--smoke]

Recipes (bench/zoo.py's models, batches and optimizers, bf16 autocast):
  ddp_eager     DistributedDataParallel(model), fused AdamW (SGD with momentum: ResNet-50)
  ddp_compile   torch.compile(DistributedDataParallel(model)) (Dynamo splits at the buckets)
  ddp_kitsune   DDP over kitsune.optimize(model), KitsuneOptimizer and compile_step, with
                Kitsune's allocator installed before the process group
  fsdp_eager    fully_shard on each decoder layer and the root, fused AdamW (Llama only)
  fsdp_kitsune  the same over kitsune.optimize(model), KitsuneOptimizer, compile_step and
                Kitsune's allocator
compile_step runs DDP and FSDP2 models eagerly and says why in its stats (their
collectives are not captured yet); the row keeps that reason.

Each rank draws its own 4 batches of the zoo's size (from a seed of its rank; the weights
from one seed on every rank), so N GPUs train on N times the samples of one. Reported per model, recipe and N: ms per
step (bench/zoo.py's timing on rank 0, every rank in step through the collectives),
samples per second per GPU, peak reserved MiB (the largest rank's), the losses (the mean
over ranks a step) and, for N > 1, the scaling efficiency: one GPU's ms over N GPUs'.
The losses of N GPUs follow a larger batch than one GPU's: compare them as a bound, not
bit for bit (tests/python/test_distributed.py checks equality against a single-process
run on the CPU). NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). --smoke: tiny
configurations on the CPU over gloo, a check of the code path and not a timing.
Writes distributed.json and distributed.md.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _value   # set, not defaulted: multicast can take a shared host's GPUs down

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zoo  # noqa: E402
from benchlib import run_child, write_result  # noqa: E402

RECIPES = {"gpt2": ["ddp_eager", "ddp_compile", "ddp_kitsune"],
           "resnet50": ["ddp_eager", "ddp_compile", "ddp_kitsune"],
           "llama": ["fsdp_eager", "fsdp_kitsune"]}


def _wrap(model_name, recipe, model, device, cuda, local):
    """(the model the step calls, the module whose parameters the optimizer takes)."""
    import kitsune
    if recipe.endswith("kitsune"):
        model = kitsune.optimize(model)
    if recipe.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
        return (torch.compile(ddp) if recipe == "ddp_compile" else ddp), ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.lm.model.layers:   # a decoder layer a unit, then the rest at the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def child(model_name, recipe, args):
    """One recipe on this rank (torchrun's environment); rank 0 prints the row."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(local)
        if recipe.endswith("kitsune"):
            import kitsune.allocator
            kitsune.allocator.install()   # before the process group: NCCL's buffers come from it too
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    row = {"model": model_name, "recipe": recipe, "nproc": world}
    try:
        import kitsune
        torch.manual_seed(0)   # the weights: the same on every rank (FSDP2 shards what each rank holds)
        gen = torch.Generator().manual_seed(1000 + rank)   # the batches: each rank its own
        base, loss_fn, data, (cls, kw) = zoo.build(model_name, gen, smoke=args.smoke)
        data = [tuple(t.to(device) for t in b) for b in data]
        zoo.fresh_peak("cuda" if cuda else "cpu")
        t0 = time.perf_counter()
        model, holder = _wrap(model_name, recipe, base.to(device), device, cuda, local)
        fused = dict(fused=True) if cuda else {}
        if recipe.endswith("kitsune"):
            opt = kitsune.KitsuneOptimizer(cls, holder.parameters(), **kw)
            step = kitsune.compile_step(model, loss_fn, opt, autocast_dtype=torch.bfloat16 if cuda else None)
        else:
            step = zoo.eager_step(model, loss_fn, cls(holder.parameters(), **fused, **kw), "cuda" if cuda else "cpu")
        made_s = time.perf_counter() - t0
        losses, ms, first_s = zoo.time_steps(f"{recipe} x{world}" if rank == 0 else None, step, data, args.steps,
                                             "cuda" if cuda else "cpu")
        mean_losses = torch.stack([x.float() for x in losses]).to(device)
        dist.all_reduce(mean_losses)
        mean_losses /= world
        peak = torch.tensor([torch.cuda.max_memory_reserved() / 2**20 if cuda else 0.0], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        samples = data[0][0].shape[0]
        row.update(ms=ms, setup_s=max(0.0, made_s + first_s - min(3, args.steps) * ms / 1e3),
                   samples_per_s_per_gpu=samples / ms * 1e3, losses=mean_losses.tolist(),
                   final_loss=mean_losses[-1].item(), steps=args.steps)
        if cuda:
            row["peak_reserved_mib"] = peak.item()
        if recipe.endswith("kitsune"):
            row["compile_step"] = zoo._compile_step_row(step)
            row["optimizer_path"] = opt.get_stats().get("path")
    except Exception as e:   # noqa: BLE001 - report and go on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("ROW " + json.dumps(row), flush=True)


def launch(model_name, recipe, nproc, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), "--child", model_name, recipe, "--steps", str(args.steps)]
    cmd += ["--smoke"] if args.smoke else []
    row = run_child(cmd, model_name, recipe)
    row.setdefault("nproc", nproc)
    return row


def describe(row):
    head = f"{row['model']:9s} {row['recipe']:13s} x{row.get('nproc', '?')}"
    if "error" in row:
        return f"{head} FAILED {row['error'][:160]}"
    cs = row.get("compile_step") or {}
    mem = f"  peak {row['peak_reserved_mib']:8.1f} MiB" if "peak_reserved_mib" in row else ""
    return (f"{head} {row['ms']:9.3f} ms/step  {row['samples_per_s_per_gpu']:9.1f} samples/s/GPU{mem}  "
            f"loss {row['final_loss']:.4f}" + (f"  [{cs.get('reason')}]" if cs.get("reason") else ""))


def table(rows, nproc):
    by = {(r["model"], r["recipe"], r.get("nproc")): r for r in rows}
    out = [f"| model | recipe | ms/step, 1 GPU | ms/step, {nproc} GPUs | samples/s/GPU, {nproc} GPUs | scaling "
           f"efficiency | peak reserved MiB a rank | last-10 loss, 1 / {nproc} GPUs |", "|---|---|---|---|---|---|---|---|"]

    def ok(r):
        return r is not None and "error" not in r
    for m, rc in dict.fromkeys((r["model"], r["recipe"]) for r in rows):
        one, many = by.get((m, rc, 1)), by.get((m, rc, nproc))
        cells = [m, rc]
        cells.append(f"{one['ms']:.2f}" if ok(one) else "failed" if one else "-")
        cells.append(f"{many['ms']:.2f}" if ok(many) else "failed" if many else "-")
        cells.append(f"{many['samples_per_s_per_gpu']:.1f}" if ok(many) else "-")
        cells.append(f"{one['ms'] / many['ms']:.2f}" if ok(one) and ok(many) and nproc > 1 else "-")
        cells.append(f"{many['peak_reserved_mib']:.0f}" if ok(many) and "peak_reserved_mib" in many else "-")
        tails = [statistics.fmean(r["losses"][-10:]) if ok(r) else None for r in (one, many)]
        cells.append(" / ".join("-" if t is None else f"{t:.3f}" for t in tails))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--nproc", type=int, default=None, help="GPUs (default: all visible; --smoke: 2 CPU ranks)")
    ap.add_argument("--models", default="gpt2,resnet50,llama")
    ap.add_argument("--recipes", default=None, help="comma-separated; default each model's recipes")
    ap.add_argument("--steps", type=int, default=None, help="default 100 (--smoke 4)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "RECIPE"))
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 4 if args.smoke else 100
    if args.child:
        return child(*args.child, args)
    nproc = args.nproc or (2 if args.smoke or not torch.cuda.is_available() else torch.cuda.device_count())
    if nproc < 1:
        sys.exit(f"bench/distributed.py: --nproc must be at least 1, got {nproc}")
    if not args.smoke and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        sys.exit(f"bench/distributed.py: --nproc {nproc}, but {torch.cuda.device_count()} GPU(s) are visible")
    models = args.models.split(",")
    for m in models:
        if m not in RECIPES:
            sys.exit(f"bench/distributed.py: unknown model {m!r}; the models are {', '.join(RECIPES)}")
    wanted = args.recipes.split(",") if args.recipes else None
    known = {rc for rcs in RECIPES.values() for rc in rcs}
    for rc in wanted or ():
        if rc not in known:
            sys.exit(f"bench/distributed.py: unknown recipe {rc!r}; the recipes are {', '.join(sorted(known))}")
    rows = []
    for m in models:
        for rc in RECIPES[m]:
            if wanted and rc not in wanted:
                continue
            for n in dict.fromkeys((1, nproc)):
                print(f"== {m} / {rc} on {n}", flush=True)
                rows.append(launch(m, rc, n, args))
                print(describe(rows[-1]), flush=True)
                write_result(args.out, "distributed", {"nproc": nproc, "steps": args.steps, "smoke": args.smoke,
                                                       "rows": rows})
    md = table(rows, nproc)
    with open(os.path.join(args.out, "distributed.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
