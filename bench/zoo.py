"""Training steps of the models people train, by the recipes they would pick, each recipe
in a fresh process, the same weights and batches for all:

    python bench/zoo.py [--out DIR] [--models gpt2,llama,bert,vit,resnet50] [--recipes ...] [--steps N]
    python bench/zoo.py --dynamic [--steps N]     # GPT-2 with a new sequence length most steps
    python bench/zoo.py --smoke --out DIR         # tiny models, CPU allowed: that the script runs

Models (random weights from configs, nothing downloaded), bf16 autocast:
  gpt2      Hugging Face GPT-2 small (124M), batch 8 x 1024, AdamW
  llama     a Hugging Face Llama (hidden 768, 12 layers, 12 heads of which 4 key/value,
            intermediate 2048, vocab 32000: ~160M), batch 8 x 1024, AdamW
  bert      Hugging Face BERT-base masked LM, batch 32 x 128 (15% of tokens labelled), AdamW
  vit       torchvision ViT-B/16, batch 64 x 3 x 224 x 224, 1000 classes, AdamW
  resnet50  torchvision ResNet-50, batch 64 x 3 x 224 x 224, SGD(momentum 0.9, weight decay)

Recipes (the optimizer fused=True in each):
  eager        the model as it is
  compile      torch.compile(model), default mode
  stock_graph  torch.compile(model) and the optimizer (capturable=True) under one manual
               whole-step torch.cuda.graph, three warm-up steps on a side stream first
  kitsune      the one-liner: kitsune.optimize(model), KitsuneOptimizer, kitsune.compile_step
  kitsune_dynamo  KitsuneOptimizer and compile_step(dynamo=True): Kitsune's own Dynamo path
               (the patterns in Dynamo's graphs, AOTAutograd, no Inductor), captured whole

Each recipe's process first runs 3 eager steps of a copy of the model, untimed (the
process's first use of the GPU is no recipe's setup). Reported per recipe: ms/step (the
median of blocks of 10 steps between CUDA events, from step 20), setup seconds (the
first 3 steps' wall time less 3 steady steps), peak memory allocated and reserved above
what was there before the recipe, the loss after the last step against eager's, and
compile_step's counts (replays, eager steps, why not captured). The table compares
losses as the mean of the last 10 steps against eager's (one step's loss, on 4 batches
that the models memorise, swings by 1 from step to step). stock_graph's first call runs
its 3 warm-up steps as real updates on the first batch, as PyTorch's whole-network
capture example does, so its losses are 3 steps ahead of the others. Writes zoo.json
and zoo.md to --out (bench/kernels/plot.py draws zoo.png from the JSON).

    python bench/zoo.py --merge A.json B.json ... [--out DIR]

joins runs of the same commit, device and step count made in separate calls (a GPU
call has a time limit) into one zoo.json and zoo.md.

--dynamic: GPT-2 small, batch 8, each step's sequence length drawn from 64..1024 (a
seeded stream, the same for every recipe): eager, compile (it recompiles, then marks
the length dynamic) and kitsune (compile_step keeps max_shapes graphs; see
docs/compile-step.md, dynamic shapes). Reported: ms/step over all steps after the
first 5 (synchronized wall time), captures and eager steps. Writes zoo_dynamic.json/.md.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import run_child, write_result  # noqa: E402
import kitsune  # noqa: E402

MODELS = ["gpt2", "llama", "bert", "vit", "resnet50"]
RECIPES = ["eager", "compile", "stock_graph", "kitsune", "kitsune_dynamo"]


class CausalLM(torch.nn.Module):
    """A Hugging Face model whose step is model(ids, labels) -> loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def build(name, gen, smoke=False):
    """(model, loss_fn or None, batches, (optimizer class, kwargs)) for a zoo model; smoke:
    a tiny configuration of the same architecture."""
    adamw = (torch.optim.AdamW, dict(lr=3e-4, weight_decay=0.01))
    if name in ("gpt2", "llama", "bert"):
        import transformers as T
        if name == "gpt2":
            # smoke: no dropout, so every recipe's losses can be compared with eager's (Kitsune's fused
            # dropout draws its own masks)
            cfg = (T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0) if smoke else T.GPT2Config())
            model, vocab, shape = T.GPT2LMHeadModel(cfg), cfg.vocab_size, (2, 32) if smoke else (8, 1024)
        elif name == "llama":
            kw = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=256, max_position_embeddings=64) if smoke else
                  dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                       intermediate_size=2048, vocab_size=32000, max_position_embeddings=1024))
            cfg = T.LlamaConfig(**kw)
            model, vocab, shape = T.LlamaForCausalLM(cfg), cfg.vocab_size, (2, 32) if smoke else (8, 1024)
        else:
            cfg = (T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0) if smoke else T.BertConfig())
            model, vocab, shape = T.BertForMaskedLM(cfg), cfg.vocab_size, (2, 32) if smoke else (32, 128)
        batches = []
        for _ in range(4):
            ids = torch.randint(0, vocab, shape, generator=gen)
            labels = ids.clone()
            if name == "bert":   # masked LM: 15% of the positions are labelled
                labels[torch.rand(shape, generator=gen) >= 0.15] = -100
            batches.append((ids, labels))
        return CausalLM(model), None, batches, adamw
    import torchvision as tv
    if name == "vit":
        model = (tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                                             mlp_dim=128, num_classes=10) if smoke else tv.models.vit_b_16())
        opt = adamw
    elif name == "resnet50":
        model = tv.models.resnet50(num_classes=10 if smoke else 1000)
        opt = (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=5e-5))
    else:
        raise ValueError(f"unknown model {name!r}; the zoo has {', '.join(MODELS)}")
    n, hw, classes = (2, 32, 10) if smoke else (64, 224, 1000)
    batches = [(torch.randn(n, 3, hw, hw, generator=gen), torch.randint(0, classes, (n,), generator=gen))
               for _ in range(4)]
    return model, F.cross_entropy, batches, opt


def _autocast(device):
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda", cache_enabled=False)


def eager_step(model, loss_fn, opt, device):
    def step(*batch):
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = loss_fn(model(*batch[:-1]), batch[-1]) if loss_fn is not None else model(*batch)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def stock_graph_step(model, loss_fn, opt_spec):
    cm = torch.compile(model)
    cls, kw = opt_spec
    # Adam's step count lives on the device under capture; SGD has nothing to make capturable
    opt = cls(model.parameters(), fused=True, **(dict(capturable=True) if cls is not torch.optim.SGD else {}), **kw)
    state = {}

    def step(*batch):
        if "graph" not in state:   # warm up on a side stream, then capture the whole step
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    loss = eager_step(cm, loss_fn, opt, "cuda")(*batch)
            torch.cuda.current_stream().wait_stream(side)
            static = [b.clone() for b in batch]
            g = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(g):
                with _autocast("cuda"):
                    sl = loss_fn(cm(*static[:-1]), static[-1]) if loss_fn is not None else cm(*static)
                sl.backward()
                opt.step()
            state.update(graph=g, static=static, loss=sl)
            return loss
        for s, b in zip(state["static"], batch):
            s.copy_(b, non_blocking=True)
        state["graph"].replay()
        return state["loss"].detach().clone()
    return step


def make(recipe, model, loss_fn, opt_spec, device):
    """(step, its compile_step or None) for a recipe."""
    cls, kw = opt_spec
    fused = dict(fused=True) if device == "cuda" else {}
    if recipe == "eager":
        return eager_step(model, loss_fn, cls(model.parameters(), **fused, **kw), device), None
    if recipe == "compile":
        return eager_step(torch.compile(model), loss_fn, cls(model.parameters(), **fused, **kw), device), None
    if recipe == "stock_graph":
        return stock_graph_step(model, loss_fn, opt_spec), None
    if recipe in ("kitsune", "kitsune_dynamo"):
        dynamo = recipe == "kitsune_dynamo"
        km = model if dynamo else kitsune.optimize(model)
        opt = kitsune.KitsuneOptimizer(cls, km.parameters(), **kw)
        step = kitsune.compile_step(km, loss_fn, opt, autocast_dtype=torch.bfloat16 if device == "cuda" else None,
                                    dynamo=dynamo)
        return step, step
    raise ValueError(f"unknown recipe {recipe!r}; the recipes are {', '.join(RECIPES)}")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def fresh_peak(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _compile_step_row(step):
    st = step.stats()
    return {k: st.get(k) for k in ("replays", "eager_steps", "captures", "uncaptured_steps", "reason", "streams",
                                   "channels_last", "optimizer_in_backward", "setup_s")}


def time_steps(label, step, data, steps, device):
    """Runs step over data (cycled) steps times: (losses, ms per step, first 3 steps' wall
    seconds); label names the progress lines (None: none). ms: the median over blocks of 10 steps from step 20 on (CUDA events on
    cuda; wall time elsewhere)."""
    cuda = device == "cuda"
    t0 = time.perf_counter()
    losses = [step(*data[i % len(data)]) for i in range(min(3, steps))]
    _sync(device)
    first_s = time.perf_counter() - t0
    blocks, i = [], len(losses)
    while i < steps:
        n = min(10, steps - i)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        h0 = time.perf_counter()
        for _ in range(n):
            losses.append(step(*data[i % len(data)]))
            i += 1
        if cuda:
            b.record()
            blocks.append((a, b, n, i))
        else:
            blocks.append((time.perf_counter() - h0, None, n, i))
        if label is not None and (i % 20 == 0 or i == steps):
            print(f"  {label}: step {i}/{steps}, loss {losses[-1].float().item():.4f}", flush=True)
    _sync(device)
    per = [((a.elapsed_time(b) if cuda else a * 1e3) / n, end) for a, b, n, end in blocks]
    timed = [ms for ms, end in per if end > 20] or [ms for ms, _ in per] or [float("nan")]
    return losses, statistics.median(timed), first_s


def run(recipe, base, loss_fn, data, opt_spec, steps, device):
    """One recipe's timed run on a copy of base; its row."""
    fresh_peak(device)
    cuda = device == "cuda"
    alloc0 = torch.cuda.memory_allocated() if cuda else 0
    reserved0 = torch.cuda.memory_reserved() if cuda else 0
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    step, cs = make(recipe, model, loss_fn, opt_spec, device)
    made_s = time.perf_counter() - t0
    losses, ms, first_s = time_steps(recipe, step, data, steps, device)
    row = {"recipe": recipe, "ms": ms, "setup_s": max(0.0, made_s + first_s - min(3, steps) * ms / 1e3),
           "final_loss": losses[-1].float().item(), "losses": [x.float().item() for x in losses],
           "steps": steps}
    if cuda:
        row.update(peak_alloc_mib=(torch.cuda.max_memory_allocated() - alloc0) / 2**20,
                   peak_reserved_mib=(torch.cuda.max_memory_reserved() - reserved0) / 2**20)
    if cs is not None:
        row["compile_step"] = _compile_step_row(cs)
    return row


def run_dynamic(recipe, base, opt_spec, steps, device, gen):
    """GPT-2 steps with a new sequence length most steps (64..1024)."""
    lengths = torch.randint(64, 1025, (steps,), generator=gen).tolist()
    vocab = base.lm.config.vocab_size
    fresh_peak(device)
    model = copy.deepcopy(base)
    step, cs = make(recipe, model, None, opt_spec, device)
    times, t_all = [], time.perf_counter()
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (8, n), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = step(ids, ids)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if (i + 1) % 20 == 0:
            print(f"  {recipe}: step {i + 1}/{steps}, length {n}, loss {loss.float().item():.4f}", flush=True)
    row = {"recipe": recipe, "ms": 1e3 * sum(times[5:]) / max(1, len(times) - 5),
           "total_s": time.perf_counter() - t_all, "distinct_lengths": len(set(lengths)), "steps": steps}
    if cs is not None:
        row["compile_step"] = _compile_step_row(cs)
    if recipe == "compile":
        from torch._dynamo.utils import counters
        row["dynamo_frames"] = dict(counters["stats"])
    return row


def warm_up(base, loss_fn, data, opt_spec, device):
    step, _ = make("eager", copy.deepcopy(base), loss_fn, opt_spec, device)
    for i in range(3):
        step(*data[i % len(data)])
    _sync(device)


def child(name, recipe, args):
    """One recipe in this process; prints its row."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    try:
        base, loss_fn, data, opt_spec = build(name, gen, smoke=args.smoke)
        base = base.to(device)
        data = [tuple(t.to(device) for t in b) for b in data]
        if args.dynamic:
            row = run_dynamic(recipe, base, opt_spec, args.steps, device, gen)
        else:
            warm_up(base, loss_fn, data, opt_spec, device)
            row = run(recipe, base, loss_fn, data, opt_spec, args.steps, device)
        row = dict(model=name, device=device, **row)
    except Exception as e:   # noqa: BLE001 - report and go on
        traceback.print_exc()
        row = {"model": name, "recipe": recipe, "error": f"{type(e).__name__}: {e}"[:400]}
    print("ROW " + json.dumps(row), flush=True)
    return row


def in_child(name, recipe, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, recipe, "--steps", str(args.steps)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--dynamic"] if args.dynamic else []
    return run_child(cmd, name, recipe)


def describe(row):
    if "error" in row:
        return f"{row['model']:9s} {row['recipe']:12s} FAILED {row['error'][:160]}"
    cs = row.get("compile_step")
    mem = f"  peak {row['peak_alloc_mib']:8.1f} / {row['peak_reserved_mib']:8.1f} MiB" if "peak_alloc_mib" in row else ""
    setup = f"  setup {row['setup_s']:6.2f} s" if "setup_s" in row else ""
    loss = f"  loss {row['final_loss']:.4f}" if "final_loss" in row else ""
    return (f"{row['model']:9s} {row['recipe']:12s} {row['ms']:9.3f} ms/step{setup}{mem}{loss}"
            + (f"  [{cs['replays']} replays, {cs['eager_steps']} eager, {cs['captures']} captures"
               f"{', ' + cs['reason'] if cs['reason'] else ''}]" if cs else ""))


def late_loss(row):
    """The mean loss of a row's last 10 steps."""
    tail = row["losses"][-10:]
    return sum(tail) / len(tail)


def merge(paths, out):
    """One zoo.json (and zoo.md) from runs in separate calls: same commit, device, steps
    and mode; a (model, recipe) in two runs keeps the later run's row."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    keys = ("bench", "commit", "device", "torch", "steps", "dynamic", "smoke", "autocast")
    for d in docs[1:]:
        differ = [k for k in keys if d.get(k) != docs[0].get(k)]
        if differ:
            sys.exit(f"bench/zoo.py --merge: {paths[0]} and another run differ in {', '.join(differ)}")
    rows = {}
    for d in sorted(docs, key=lambda d: d.get("date", "")):
        for r in d["rows"]:
            rows[(r["model"], r.get("recipe"))] = r
    merged = {k: docs[0].get(k) for k in keys}
    merged.update(date=max(d.get("date", "") for d in docs), rows=list(rows.values()),
                  runs=[{"date": d.get("date"), "models": list(dict.fromkeys(r["model"] for r in d["rows"])),
                         "recipes": list(dict.fromkeys(r.get("recipe") for r in d["rows"]))} for d in docs])
    name = merged["bench"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(merged, f, indent=1)
    md = table(merged["rows"], dynamic=bool(merged.get("dynamic")))
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


def table(rows, dynamic=False):
    """Markdown: each model's ms/step by recipe, Kitsune against torch.compile and the best
    stock recipe, setup, peak memory and the final loss against eager's."""
    by = {(r["model"], r.get("recipe")): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows))
    recipes = [rc for rc in RECIPES if any((m, rc) in by for m in models)]
    head = ["model"] + [f"{rc} ms" for rc in recipes] + ["kitsune / compile", "kitsune / best stock"]
    if not dynamic:
        head += ["setup s (compile, kitsune)", "peak MiB (compile, kitsune)",
                 "last-10 loss - eager's (compile, kitsune)"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def ok(m, rc):
        r = by.get((m, rc))
        return r if r is not None and "error" not in r else None

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    for m in models:
        cells = [m] + ["-" if (m, rc) not in by else "failed" if not ok(m, rc) else f"{by[(m, rc)]['ms']:.2f}"
                       for rc in recipes]
        k, c, e = ok(m, "kitsune"), ok(m, "compile"), ok(m, "eager")
        stock = [ok(m, rc)["ms"] for rc in ("eager", "compile", "stock_graph") if ok(m, rc)]
        cells.append(f(k["ms"] / c["ms"] if k and c else None, ".2f"))
        cells.append(f(k["ms"] / min(stock) if k and stock else None, ".2f"))
        if not dynamic:
            cells.append(f"{f(c and c['setup_s'], '.1f')}, {f(k and k['setup_s'], '.1f')}")
            cells.append(f"{f(c and c.get('peak_reserved_mib'), '.0f')}, {f(k and k.get('peak_reserved_mib'), '.0f')}")
            cells.append(f"{f(c and e and late_loss(c) - late_loss(e), '+.3f')}, "
                         f"{f(k and e and late_loss(k) - late_loss(e), '+.3f')}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--models", default=None, help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--recipes", default=None, help=f"comma-separated, of {','.join(RECIPES)}")
    ap.add_argument("--steps", type=int, default=None, help="steps a recipe (default 100; --dynamic 60; --smoke 4)")
    ap.add_argument("--dynamic", action="store_true", help="GPT-2 with a new sequence length most steps")
    ap.add_argument("--smoke", action="store_true", help="tiny models, CPU allowed, in this process")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join runs made in separate calls into --out")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "RECIPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.steps is None:
        args.steps = 4 if args.smoke else 60 if args.dynamic else 100
    if args.child:
        torch.backends.cudnn.benchmark = True
        child(*args.child, args)
        return
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench/zoo.py needs a CUDA GPU (--smoke runs tiny models on the CPU)")
    models = (args.models or ("gpt2" if args.dynamic else ",".join(MODELS))).split(",")
    default_recipes = ("eager,compile,kitsune" if args.dynamic else "eager,kitsune,kitsune_dynamo" if args.smoke
                       else ",".join(RECIPES))
    recipes = (args.recipes or default_recipes).split(",")
    for r in recipes:
        if r not in RECIPES:
            sys.exit(f"bench/zoo.py: unknown recipe {r!r}; the recipes are {', '.join(RECIPES)}")
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"device {where}, torch {torch.__version__}; "
          + ("each recipe in this process" if args.smoke else "each recipe in a fresh process"), flush=True)
    rows, name = [], "zoo_dynamic" if args.dynamic else "zoo"
    for m in models:
        for rc in recipes:
            print(f"== {m} / {rc}", flush=True)
            row = child(m, rc, args) if args.smoke else in_child(m, rc, args)
            rows.append(row)
            print(describe(row), flush=True)
            write_result(args.out, name, {"steps": args.steps, "smoke": args.smoke, "dynamic": args.dynamic,
                                          "autocast": "bfloat16", "rows": rows,
                                          "runs": [{"models": models, "recipes": recipes}]})
    md = table(rows, dynamic=args.dynamic)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
