"""kitsune.linear_act against the same Linear + activation in eager PyTorch and under
torch.compile: forward, and forward + backward, median ms of CUDA events (L2 flushed
before each repeat) on GPT-2-sized MLP layers and the demo MLP's first layer.

    python3 bench/kernels/linear_act.py [--out DIR] [--reps N]

linear_act's relu and gelu_tanh are one cuBLASLt GEMM with the bias and activation in
its epilogue, and the backward's weight GEMM also sums the bias gradient (BGRADB);
gelu (erf) is the GEMM then kitsune.bias_gelu. Outputs and gradients are checked against
eager (fp32 reference) before timing. Writes kernels_linear_act.json.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cuda_ms, write_result  # noqa: E402

import kitsune.ops as ko  # noqa: E402

SHAPES = [(8192, 768, 3072), (8192, 3072, 768), (64, 784, 512)]   # (rows, in, out)
ACTS = {"relu": F.relu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "gelu": F.gelu}


def _eager(act):
    return lambda x, w, b: ACTS[act](F.linear(x, w, b))


def _kitsune(act):
    return lambda x, w, b: ko.linear_act(x, w, b, act)


def _errors(fn, x, w, b, act, go):
    """Max error of out and of each gradient against an fp32 reference, relative to the
    reference's largest magnitude."""
    ts = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    out = fn(*ts)
    got = torch.autograd.grad(out, ts, go)
    t32 = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref = _eager(act)(*t32)
    want = torch.autograd.grad(ref, t32, go.float())
    return [(g_.float() - w_).abs().max().item() / max(1.0, w_.abs().max().item())
            for g_, w_ in zip((out,) + got, (ref,) + want)]


def _check(fn, x, w, b, act, go):
    """fn's errors are at most twice eager's, plus 1e-3 (a ReLU mask or a GELU near its
    kink differs by the rounding of the pre-activation)."""
    mine, eager = _errors(fn, x, w, b, act, go), _errors(_eager(act), x, w, b, act, go)
    for name, e, te in zip(("out", "grad x", "grad w", "grad b"), mine, eager):
        assert e <= 2 * te + 1e-3, f"{act} {name}: error {e:.3g} against eager's {te:.3g}"
    return mine


def _profile(fn, x, w, b, go, label):
    """The GPU kernels of 5 forward + backward calls, by total time."""
    from torch.profiler import ProfilerActivity, profile
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.backward(fn(xs, ws, bs), go)
        torch.cuda.synchronize()
    print(f"-- {label}: kernels of 5 forward + backward calls")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print(f"   {e.device_time_total / 5:9.1f} us/call {e.count // 5:3d}x  {e.key[:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="also list the kernels of the first shape")
    args = ap.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for dtype in (torch.bfloat16,):
        for (m, k, n) in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            for act in ACTS:
                impls = {"eager": _eager(act), "kitsune": _kitsune(act),
                         "torch.compile": torch.compile(_eager(act), dynamic=False)}
                row = {"dtype": str(dtype).split(".")[-1], "rows": m, "in": k, "out": n, "act": act}
                go = torch.randn(m, n, device="cuda", dtype=dtype)
                for name, fn in impls.items():
                    row[f"{name}_errors"] = _check(fn, x, w, b, act, go)
                    if args.profile and (m, k, n) == SHAPES[0] and name != "torch.compile":
                        _profile(fn, x, w, b, go, f"{name} {act} {m}x{k}->{n}")
                    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))

                    def fwd():
                        with torch.no_grad():
                            fn(x, w, b)

                    def fwd_bwd():
                        torch.autograd.backward(fn(xs, ws, bs), go)
                        xs.grad = ws.grad = bs.grad = None

                    for f in (fwd, fwd_bwd):   # warm-up (compilation, cuBLASLt heuristics)
                        f(), f()
                    row[f"{name}_fwd_ms"] = cuda_ms(fwd, args.reps, flush.zero_)
                    row[f"{name}_fwd_bwd_ms"] = cuda_ms(fwd_bwd, args.reps, flush.zero_)
                rows.append(row)
                print(f"{row['dtype']} {m}x{k}->{n} {act:9s} fwd ms: eager {row['eager_fwd_ms']:.4f} "
                      f"kitsune {row['kitsune_fwd_ms']:.4f} compile {row['torch.compile_fwd_ms']:.4f} | fwd+bwd: "
                      f"eager {row['eager_fwd_bwd_ms']:.4f} kitsune {row['kitsune_fwd_bwd_ms']:.4f} "
                      f"compile {row['torch.compile_fwd_bwd_ms']:.4f}", flush=True)
    write_result(args.out, "kernels_linear_act", {"reps": args.reps, "flush": "256 MB zero_ before each repeat",
                                                  "rows": rows})


if __name__ == "__main__":
    main()
