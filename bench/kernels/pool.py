"""Max pooling: kitsune.max_pool2d against ATen's F.max_pool2d, and global average pooling:
kitsune.global_avg_pool against ATen's x.mean((2, 3)); forward alone and forward +
backward, as they run inside a captured training step (benchlib.graph_us: 50 calls in
one CUDA graph, L2 not flushed, microseconds a call), and for the means each forward's
peak memory above its input.

    python3 bench/kernels/pool.py [--out DIR] [--reps N]

Shapes: the Inception net's 3 x 3 stride-1 poolings (channels-last, as compile_step
captures it), ResNet-18's stem pooling at CIFAR size, and an NCHW one; the means of the
Inception net's last map (batch 64 and 8) and ResNet-18's, channels-last. Before timing,
each max pooling's output and input gradient is checked equal to ATen's, each mean's
within fp32 / bf16 rounding of ATen's. Writes kernels_pool.json.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import graph_us, write_result  # noqa: E402

import kitsune.ops as ko  # noqa: E402

# (label, shape, kernel, stride, padding, channels_last, dtype)
SHAPES = [
    ("inception 3x3/1/1", (64, 64, 32, 32), 3, 1, 1, True, torch.float32),
    ("inception 3x3/1/1 bf16", (64, 64, 32, 32), 3, 1, 1, True, torch.bfloat16),
    ("resnet18 stem 3x3/2/1", (128, 64, 16, 16), 3, 2, 1, True, torch.float32),
    ("nchw 2x2/2", (64, 64, 32, 32), 2, 2, 0, False, torch.float32),
    ("nchw 3x3/1/1", (64, 64, 32, 32), 3, 1, 1, False, torch.float32),
]
# (label, shape, dtype): channels-last maps whose mean over H and W ends a conv net
MEANS = [
    ("inception head", (64, 256, 32, 32), torch.float32),
    ("inception head bf16", (64, 256, 32, 32), torch.bfloat16),
    ("inception head, batch 8", (8, 256, 32, 32), torch.float32),
    ("resnet18 head", (128, 512, 4, 4), torch.float32),
]
COPIES = 4   # forward: inputs rotated over 50 calls
BACKWARD_CALLS = 16   # forward + backward: distinct leaves, so no call accumulates into a .grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels/pool.py needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    rows = []
    for label, shape, k, s, p, cl, dtype in SHAPES:
        fmt = torch.channels_last if cl else torch.contiguous_format
        xs = [torch.randn(shape, generator=g).to("cuda", dtype).contiguous(memory_format=fmt).requires_grad_()
              for _ in range(BACKWARD_CALLS)]
        ops = {"aten": lambda x: F.max_pool2d(x, k, s, p), "kitsune": lambda x: ko.max_pool2d(x, k, s, p)}
        with torch.no_grad():
            out_shape = ops["aten"](xs[0]).shape
        gos = [torch.randn(out_shape, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
               for _ in range(BACKWARD_CALLS)]
        want, want_g = forward_backward(ops["aten"], xs[0], gos[0])
        row = {"shape": label, "size": list(shape), "kernel": k, "stride": s, "padding": p, "channels_last": cl,
               "dtype": str(dtype).split(".")[-1]}
        for name, op in ops.items():
            out, gx = forward_backward(op, xs[0], gos[0])
            assert torch.equal(out, want) and torch.equal(gx, want_g), f"{label} {name}: differs from ATen"
            row[f"{name}_fwd_us"] = graph_us(lambda x: op(x.detach()), xs[:COPIES], args.reps)
            row[f"{name}_fwd_bwd_us"] = fwd_bwd_us(op, xs, gos, args.reps)
        rows.append(row)
        print(f"{label:26s} {str(tuple(shape)):18s} fwd aten {row['aten_fwd_us']:7.2f} us kitsune "
              f"{row['kitsune_fwd_us']:7.2f} us | fwd+bwd aten {row['aten_fwd_bwd_us']:7.2f} us kitsune "
              f"{row['kitsune_fwd_bwd_us']:7.2f} us", flush=True)
    means = [bench_mean(label, shape, dtype, g, args.reps) for label, shape, dtype in MEANS]
    write_result(args.out, "kernels_pool", {"forward_inputs": COPIES, "backward_calls": BACKWARD_CALLS,
                                            "reps": args.reps, "rows": rows, "means": means})


def fwd_bwd_us(op, xs, gos, reps):
    """Microseconds of op's forward + backward, .backward into each leaf's .grad as a
    training step does (autograd.grad in a capture would sync the legacy stream)."""
    def clear():
        for x in xs:
            x.grad = None
    return graph_us(lambda xg: op(xg[0]).backward(xg[1]), list(zip(xs, gos)), reps,
                    calls=BACKWARD_CALLS, reset=clear)


def forward_backward(op, x, go):
    """op(x) and its gradient for go, both detached: no output outlives this call holding
    x's AccumulateGrad node, which records the stream it was made on (the default one
    here) and would tie a later capture's backward to that stream."""
    out = op(x)
    (gx,) = torch.autograd.grad(out, x, go)
    return out.detach(), gx


def peak_above(fn):
    """The most allocated while fn runs, above what was allocated before it (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_mean(label, shape, dtype, g, reps):
    xs = [torch.randn(shape, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
          .requires_grad_() for _ in range(BACKWARD_CALLS)]
    ops = {"aten": lambda x: x.mean((2, 3)), "kitsune": lambda x: ko.global_avg_pool(x, (2, 3))}
    gos = [torch.randn(shape[:2], generator=g).to("cuda", dtype) for _ in range(BACKWARD_CALLS)]
    want = ops["aten"](xs[0].detach().double())
    want_g = forward_backward(ops["aten"], xs[0], gos[0])[1]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    row = {"shape": label, "size": list(shape), "dtype": str(dtype).split(".")[-1]}
    for name, op in ops.items():
        out, gx = forward_backward(op, xs[0], gos[0])
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol, msg=f"{label} {name}")
        torch.testing.assert_close(gx, want_g, rtol=0, atol=tol, msg=f"{label} {name} gradient")
        row[f"{name}_fwd_peak_mib"] = peak_above(lambda: op(xs[0].detach()))
        row[f"{name}_fwd_us"] = graph_us(lambda x: op(x.detach()), xs[:COPIES], reps)
        row[f"{name}_fwd_bwd_us"] = fwd_bwd_us(op, xs, gos, reps)
    print(f"mean {label:24s} {str(tuple(shape)):18s} fwd aten {row['aten_fwd_us']:7.2f} us "
          f"({row['aten_fwd_peak_mib']:.2f} MiB) kitsune {row['kitsune_fwd_us']:7.2f} us "
          f"({row['kitsune_fwd_peak_mib']:.2f} MiB) | fwd+bwd aten {row['aten_fwd_bwd_us']:7.2f} us kitsune "
          f"{row['kitsune_fwd_bwd_us']:7.2f} us", flush=True)
    return row


if __name__ == "__main__":
    main()
