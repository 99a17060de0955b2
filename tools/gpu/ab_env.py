"""A/B of one compile_step setting chosen by an environment variable, interleaved in
one process so that the machine's drift hits both alike:

    python tools/gpu/ab_env.py KITSUNE_GRAPH_MEMSETS=keep --models gpt,resnet18,inception:8 [--recipe kitsune]
    python tools/gpu/ab_env.py KITSUNE_CONV_GRADS=together --b KITSUNE_CONV_GRADS=apart --models inception:8

For each model (bench/models.py's, a batch size after a colon), two steps of the recipe
from the same weights: A captured with the variable set as given, B without it (or
with --b's setting of the same variable). Then
--rounds rounds, each timing 20 steps of A and 20 of B between CUDA events (the order
alternating by round). Prints and writes (--out, ab_env.json) each side's median
ms/step and B / A, and each side's stats()["conv_grads"] where it has one.
"""
import argparse
import copy
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
import models  # noqa: E402
from benchlib import write_result  # noqa: E402


def built(recipe, base, loss_fn, data, env):
    """recipe's step on a copy of base, captured (3 steps) with env applied."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        step, _ = models.make(recipe, copy.deepcopy(base), loss_fn)
        for i in range(3):
            step(*data[i % len(data)])
        torch.cuda.synchronize()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return step


def block_ms(step, data, n=20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(n):
        step(*data[i % len(data)])
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("setting", help="NAME=VALUE, set for side A only")
    ap.add_argument("--models", default="gpt")
    ap.add_argument("--b", default=None, help="NAME=VALUE for side B (default: NAME unset)")
    ap.add_argument("--recipe", default="kitsune")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    name, _, value = a.setting.partition("=")
    b_name, _, b_value = (a.b or f"{name}=").partition("=")
    if b_name != name:
        ap.error(f"--b sets {b_name}, the setting {name}: the two sides differ in one variable")
    b_env = {name: b_value} if a.b else {}
    torch.backends.cudnn.benchmark = True
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; A: {name}={value}, "
          f"B: {a.b or 'unset'}")
    rows = []
    for spec in a.models.split(","):
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        base, loss_fn, data = models.build_spec(spec, gen)
        steps = {"A": built(a.recipe, base, loss_fn, data, {name: value}),
                 "B": built(a.recipe, base, loss_fn, data, b_env)}
        times = {"A": [], "B": []}
        for r in range(a.rounds):
            for side in ("AB" if r % 2 == 0 else "BA"):
                times[side].append(block_ms(steps[side], data))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": spec, "recipe": a.recipe, "A_ms": med["A"], "B_ms": med["B"], "B_over_A": med["B"] / med["A"],
               "A_blocks": times["A"], "B_blocks": times["B"]}
        for side, step in steps.items():
            conv = step.stats().get("conv_grads") if hasattr(step, "stats") else None
            if conv:
                row[f"{side}_conv_grads"] = conv
                print(f"  {side} conv_grads: {conv}")
        rows.append(row)
        print(f"{spec:12s} {a.recipe}: A {med['A']:.4f} ms  B {med['B']:.4f} ms  B/A {row['B_over_A']:.4f}  "
              f"(A {min(times['A']):.4f}-{max(times['A']):.4f}, B {min(times['B']):.4f}-{max(times['B']):.4f})")
        del steps
        torch._dynamo.reset()
    if a.out:
        write_result(a.out, "ab_env", {"setting": a.setting, "b_setting": a.b, "rounds": a.rounds, "rows": rows})


if __name__ == "__main__":
    main()
