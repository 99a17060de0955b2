"""Pointwise chains: kitsune.pointwise_chain (one launch of the precompiled interpreter
kernel) against eager ATen (one kernel an op) and Inductor's generated kernel for the
same chain (torch.compile, default mode), and against a copy of the same bytes.

    python3 bench/kernels/chains.py [--out DIR] [--reps N] [--quick]

Chains of 4, 8 and 12 ops of the kinds the glue between patterns has (scale, residual
add, activation, cast, mask, an activation's backward), over bf16 and fp32 tensors of
64 MB and 256 MB (one or two inputs of the output's size, a bias row broadcast).
The chain program is made by kitsune/fx/chains.py from the function's ATen graph, so
the bench runs what the Dynamo path runs. Times: median of N calls between CUDA
events, L2 flushed before each; GB/s counts each input and output once. Each result is
checked against an fp64 evaluation first. Writes kernels_chains.json.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cuda_ms, write_result  # noqa: E402

import kitsune  # noqa: E402,F401 - the bridge and the backend
from kitsune.fx import chains  # noqa: E402

F = torch.nn.functional


def chain4(x, y, b):
    return F.gelu(x * 0.5 + b) + y


def chain8(x, y, b):
    h = x * 1.702 + b
    h = torch.sigmoid(h) * h
    return (h + y).to(torch.float32).clamp_min(0.0) * 0.125


def chain12(x, y, b):
    h = x + b
    t = torch.tanh(h * 0.7978845608 * (1.0 + 0.044715 * h * h))
    g = 0.5 * h * (1.0 + t)
    return torch.where(y > 0, g * y, g * -0.5) + x


CHAINS = [("4 ops: gelu(x*s+b)+y", chain4), ("8 ops: silu-ish, add, cast, relu, scale", chain8),
          ("12 ops: tanh-gelu by hand, mask, residual", chain12)]


def _chain_call(fn, args):
    """fn's ATen graph with its pointwise ops as kitsune chains (what the Dynamo path runs)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn, tracing_mode="fake")(*args)
    n = chains.fuse(gm)
    launches = sum(1 for node in gm.graph.nodes if node.target is torch.ops.kitsune.pointwise_chain.default)
    return gm, n, launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="64 MB only")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for mb in (64,) if args.quick else (64, 256):
        for dtype in (torch.bfloat16, torch.float32):
            cols = 4096
            n = (mb << 20) // torch.tensor([], dtype=dtype).element_size() // cols
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(n, cols, device="cuda", dtype=dtype, generator=g)
            y = torch.randn(n, cols, device="cuda", dtype=dtype, generator=g)
            b = torch.randn(cols, device="cuda", dtype=dtype, generator=g)
            copy_ms = cuda_ms(lambda: x.clone(), args.reps, flush.zero_)
            copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
            for label, fn in CHAINS:
                gm, made, launches = _chain_call(fn, (x, y, b))
                ref = fn(x.double(), y.double(), b.double())
                out = gm(x, y, b)
                got = out[0] if isinstance(out, (list, tuple)) else out
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
                torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
                compiled = torch.compile(fn)
                compiled(x, y, b)
                bytes_moved = 2 * x.numel() * x.element_size() + b.numel() * b.element_size() + \
                    got.numel() * got.element_size()
                row = {"chain": label, "dtype": str(dtype).replace("torch.", ""), "mb": mb, "chains": made,
                       "launches": launches, "copy_gbs": copy_gbs}
                for name, f in (("eager", lambda: fn(x, y, b)), ("inductor", lambda: compiled(x, y, b)),
                                ("kitsune", lambda: gm(x, y, b))):
                    ms = cuda_ms(f, args.reps, flush.zero_)
                    row[f"{name}_ms"] = ms
                    row[f"{name}_gbs"] = bytes_moved / ms / 1e6
                row["kitsune_pct_copy"] = 100 * row["kitsune_gbs"] / copy_gbs
                rows.append(row)
                print(f"{label:45s} {row['dtype']:8s} {mb:4d} MB  eager {row['eager_ms']:7.3f}  inductor "
                      f"{row['inductor_ms']:7.3f}  kitsune {row['kitsune_ms']:7.3f} ms "
                      f"({row['kitsune_pct_copy']:.0f}% of copy; {launches} launch)", flush=True)
    write_result(args.out, "kernels_chains", {"reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
