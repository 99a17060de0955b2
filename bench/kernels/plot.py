"""PNG charts of the committed fused-kernel results (no measurement here: every bar
is a number from a bench/results JSON, named in the chart's title with its device,
torch version and commit).

    python bench/kernels/plot.py [--results bench/results]

Writes kernels_bandwidth.png (bf16 % of copy bandwidth per op at 64 MB / 256 MB /
1 GB, the 85% target marked), kernels_loss_head.png (forward + backward time and
peak memory), kernels_train_models.png (ms/step, eager / kitsune.optimize /
torch.compile) and models.png (bench/models.py: ms/step of each model by recipe, log
scale), and zoo.png the same from bench/zoo.py's zoo.json where there is one.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(d, name):
    with open(os.path.join(d, name)) as f:
        return json.load(f)


def source(doc, name):
    return f"{name}: {doc['device']}, torch {doc['torch']}, commit {doc['commit']}"


def bandwidth(d, files, out):
    rows, titles = [], []
    for name in files:
        doc = load(d, name)
        titles.append(source(doc, name))
        rows += [r for r in doc["rows"] if r["dtype"] == "bfloat16" and r["input_mb"] >= 64]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    sizes = [64, 256, 1024]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.27
    for i, mb in enumerate(sizes):
        vals = [next((100 * r["of_copy"] for r in rows if r["op"] == op and r["input_mb"] == mb), 0) for op in ops]
        ax.bar([j + i * w for j in range(len(ops))], vals, w, label=f"{mb} MB" if mb < 1024 else "1 GB")
    ax.axhline(85, color="k", linestyle="--", linewidth=1, label="85% target")
    ax.set_xticks([j + w for j in range(len(ops))], ops, rotation=30, ha="right")
    ax.set_ylabel("% of copy bandwidth (bf16)")
    ax.set_title("\n".join(titles), fontsize=8)
    ax.set_ylim(0, 130)   # room for the legend above the bars
    ax.legend(fontsize=8, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(d, out), dpi=110)


def loss_head(d, name, out):
    doc = load(d, name)
    shapes = list(dict.fromkeys(r["shape"] for r in doc["rows"]))
    variants = ["eager", "compile", "kitsune"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ms", "ms, forward + backward"), (axes[1], "peak_mib", "peak MiB above inputs")):
        for i, v in enumerate(variants):
            vals = [next(r[key] for r in doc["rows"] if r["shape"] == s and r["variant"] == v) for s in shapes]
            ax.bar([j + i * 0.27 for j in range(len(shapes))], vals, 0.27, label=v)
        ax.set_xticks([j + 0.27 for j in range(len(shapes))], shapes)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(source(doc, name), fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(d, out), dpi=110)


def train_models(d, name, out):
    doc = load(d, name)
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    variants = ["eager", "kitsune", "compile"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, v in enumerate(variants):
        vals = [next(r["ms"] for r in doc["rows"] if r["model"] == m and r["variant"] == v) for m in models]
        bars = ax.bar([j + i * 0.27 for j in range(len(models))], vals, 0.27, label=v)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + 0.27 for j in range(len(models))], [f"{m}-style" for m in models])
    ax.set_ylabel(f"ms/step (median, {doc['steps']} steps)")
    ax.set_title(source(doc, name), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(d, out), dpi=110)


def models(d, name, out):
    doc = load(d, name)
    rows = [r for r in doc["rows"] if "error" not in r]
    names = list(dict.fromkeys(r["model"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    w = 0.8 / len(recipes)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for i, rc in enumerate(recipes):
        vals = [next((r["ms"] for r in rows if r["model"] == m and r["recipe"] == rc), 0) for m in names]
        bars = ax.bar([j + i * w for j in range(len(names))], vals, w, label=rc)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names)
    ax.set_ylabel(f"ms/step (median over blocks of 10, {doc['steps']} steps; log scale)")
    ax.set_title(source(doc, name), fontsize=8)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(d, out), dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="bench/results")
    a = ap.parse_args()
    bandwidth(a.results, ["kernels_elementwise.json"], "kernels_bandwidth.png")
    loss_head(a.results, "kernels_loss_head.json", "kernels_loss_head.png")
    train_models(a.results, "kernels_train_models.json", "kernels_train_models.png")
    models(a.results, "models.json", "models.png")
    if os.path.exists(os.path.join(a.results, "zoo.json")):   # bench/zoo.py's current result
        models(a.results, "zoo.json", "zoo.png")
        print("wrote zoo.png in", a.results)
    print("wrote kernels_bandwidth.png, kernels_loss_head.png, kernels_train_models.png, models.png in", a.results)


if __name__ == "__main__":
    main()
