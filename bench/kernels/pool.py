"""Max pooling: kitsune.max_pool2d against ATen's F.max_pool2d, forward alone and forward +
backward, as they run inside a captured training step (benchlib.graph_us: 50 calls in
one CUDA graph, L2 not flushed, microseconds a call).

    python3 bench/kernels/pool.py [--out DIR] [--reps N]

Shapes: the Inception net's 3 x 3 stride-1 poolings (channels-last, as compile_step
captures it), ResNet-18's stem pooling at CIFAR size, and an NCHW one. Before timing,
each output and input gradient is checked equal to ATen's. Writes kernels_pool.json.
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
        out0 = ops["aten"](xs[0])
        gos = [torch.randn(out0.shape, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
               for _ in range(BACKWARD_CALLS)]
        want = ops["aten"](xs[0])
        (want_g,) = torch.autograd.grad(want, xs[0], gos[0])
        row = {"shape": label, "size": list(shape), "kernel": k, "stride": s, "padding": p, "channels_last": cl,
               "dtype": str(dtype).split(".")[-1]}
        for name, op in ops.items():
            out = op(xs[0])
            (gx,) = torch.autograd.grad(out, xs[0], gos[0])
            assert torch.equal(out, want) and torch.equal(gx, want_g), f"{label} {name}: differs from ATen"
            row[f"{name}_fwd_us"] = graph_us(lambda x: op(x.detach()), xs[:COPIES], args.reps)

            def clear():
                for x in xs:
                    x.grad = None
            # .backward into each leaf's .grad, as a training step does (autograd.grad in a
            # capture would sync the legacy stream)
            row[f"{name}_fwd_bwd_us"] = graph_us(lambda xg: op(xg[0]).backward(xg[1]), list(zip(xs, gos)), args.reps,
                                                 calls=BACKWARD_CALLS, reset=clear)
        rows.append(row)
        print(f"{label:26s} {str(tuple(shape)):18s} fwd aten {row['aten_fwd_us']:7.2f} us kitsune "
              f"{row['kitsune_fwd_us']:7.2f} us | fwd+bwd aten {row['aten_fwd_bwd_us']:7.2f} us kitsune "
              f"{row['kitsune_fwd_bwd_us']:7.2f} us", flush=True)
    write_result(args.out, "kernels_pool", {"forward_inputs": COPIES, "backward_calls": BACKWARD_CALLS,
                                            "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
