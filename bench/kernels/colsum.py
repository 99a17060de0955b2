"""Bias-gradient column sums: Kitsune's kt_colsum against ATen's sum, as they run inside
a captured training step. Each sum is captured 50 times in one CUDA graph (rotating over
4 inputs; L2 is not flushed, as a step's sums read gradients that a kernel has just
written) and the replay is timed with CUDA events, so the figure is microseconds a call
with the graph's launch cost included.

    python3 bench/kernels/colsum.py [--out DIR] [--reps N]

Shapes: the bench GPT's bias gradients (rows = 16 x 256 tokens: qkv 1536, proj / out
512, fc 2048, bf16), the Inception net's and LeNet's channels-last convolution bias
gradients ((N H W, C), fp32), and the demo MLP's (64 rows). Before timing, each result is
checked against an fp64 sum. Writes kernels_colsum.json.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import graph_us, write_result  # noqa: E402

import kitsune.ops  # noqa: E402,F401 - loads the bridge (torch.ops.kitsune.*)

# (label, rows, cols, dtype, the sum ATen runs there)
SHAPES = [
    ("gpt qkv", 4096, 1536, torch.bfloat16, "bias"),
    ("gpt proj/out", 4096, 512, torch.bfloat16, "bias"),
    ("gpt fc", 4096, 2048, torch.bfloat16, "bias"),
    ("inception 64x64x32x32", 65536, 64, torch.float32, "conv"),
    ("inception 64x64x16x16", 16384, 64, torch.float32, "conv"),
    ("lenet 64x6x28x28", 50176, 6, torch.float32, "conv"),
    ("mlp 64x512", 64, 512, torch.float32, "bias"),
]
CALLS, COPIES = 50, 4


def _aten(x, kind):
    # bias: F.linear's backward (AddmmBackward's sum over rows, in the gradient's dtype);
    # conv: convolution_backward's bias gradient of a channels-last (N, C, H, W) tensor
    return x.sum(0) if kind == "bias" else x.sum((0, 2, 3))


def _kitsune(x):
    return torch.ops.kitsune.channel_sum(x)   # kt_colsum over (N H W, C) rows; fp32 out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for label, rows, cols, dtype, kind in SHAPES:
        def make():
            x = torch.randn(rows, cols, generator=g).to("cuda", dtype)
            if kind == "conv":   # (N, C, H, W) channels last with N H W = rows
                hw = {65536: (64, 32, 32), 16384: (64, 16, 16), 50176: (64, 28, 28)}[rows]
                x = x.view(hw[0], hw[1], hw[2], cols).permute(0, 3, 1, 2)
            return x
        xs = [make() for _ in range(COPIES)]
        fns = {"aten": lambda x: _aten(x, kind), "kitsune": _kitsune}
        want = _aten(xs[0].double(), kind)
        row = {"shape": label, "rows": rows, "cols": cols, "dtype": str(dtype).split(".")[-1]}
        for name, fn in fns.items():
            got = fn(xs[0]).double()
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1)).item()
            assert err < (1e-2 if dtype != torch.float32 else 1e-5), f"{label} {name}: error {err}"
            row[f"{name}_err"] = err
            row[f"{name}_us"] = graph_us(fn, xs, args.reps, CALLS)
        row["kitsune_over_aten"] = row["kitsune_us"] / row["aten_us"]
        rows_out.append(row)
        print(f"{label:24s} {rows:6d} x {cols:5d} {row['dtype']:8s} aten {row['aten_us']:7.2f} us  "
              f"kitsune {row['kitsune_us']:7.2f} us  ({row['kitsune_over_aten']:.2f}x)", flush=True)
    path = write_result(args.out, "kernels_colsum", {"calls_per_graph": CALLS, "inputs": COPIES, "reps": args.reps,
                                                     "rows": rows_out})
    print("wrote", path)


if __name__ == "__main__":
    main()
