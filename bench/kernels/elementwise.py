"""Fused elementwise and normalisation ops: achieved bandwidth against copy, eager and torch.compile.

    python bench/kernels/elementwise.py [--out DIR] [--quick] [--ops a,b]

For each op and size (bytes of one input tensor: 1 MB to 1 GB, bf16; fp32 at 256 MB)
it times, with CUDA events, the median of 20 repeats with the L2 flushed (a 256 MB
buffer written; --flush clean also reads another 256 MB, so no dirty line is left for
the timed call to write back) before each:
  copy      dst.copy_(src) of the same bytes: the achievable bandwidth, 2 x bytes moved
  kitsune   torch.ops.kitsune.<op>
  eager     the reference expression in PyTorch ops
  compile   torch.compile(reference expression, dynamic=True): Inductor's fused kernel
GB/s counts the bytes an ideal fused kernel moves: every input read once and every
output written once (per-column weights and biases, per-row targets and reduction
results are not counted). Row ops use rows of 1024 (bias_gelu), 4096 (rms_norm,
layer_norm_relu), 768 (add_layer_norm: GPT-2's width) and 50257 (cross_entropy:
GPT-2's vocabulary); batch_norm_relu takes (N, 64, 56, 56) images; the dropout ops
use p = 0.1 and are checked rather than compared (their masks are random). Outputs are checked against the eager result before any
timing. Writes kernels_elementwise.json.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cuda_ms, write_result  # noqa: E402
import kitsune.ops as ko

def _two(n, dtype):   # two full-size operands
    return torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)


def _rows(cols, params):   # x of rows of `cols`, and `params` per-column vectors
    def make(n, dtype):
        x = torch.randn(n // cols, cols, device="cuda", dtype=dtype)
        return (x,) + tuple(torch.randn(cols, device="cuda", dtype=dtype) for _ in range(params))
    return make


def _add_rows(n, dtype):   # x, residual (rows of 768), weight, bias
    x, r = (torch.randn(n // 768, 768, device="cuda", dtype=dtype) for _ in range(2))
    return x, r, torch.randn(768, device="cuda", dtype=dtype), torch.randn(768, device="cuda", dtype=dtype)


def _one(n, dtype):
    return (torch.randn(n, device="cuda", dtype=dtype),)


def _logits(n, dtype):
    x = torch.randn(n // 50257, 50257, device="cuda", dtype=dtype) * 3
    return x, torch.randint(0, 50257, (x.shape[0],), device="cuda")


def _images(n, dtype):   # x (N, 64, 56, 56): ResNet's first stage; running stats, weight, bias (fp32 stats)
    x = torch.randn(max(n // (64 * 56 * 56), 1), 64, 56, 56, device="cuda", dtype=dtype)
    c = lambda: torch.randn(64, device="cuda")
    return x, c(), c().abs() + 0.5, c().to(dtype), c().to(dtype)


def _bias_res(n, dtype):   # x, bias (rows of 1024), residual
    x, r = (torch.randn(n // 1024, 1024, device="cuda", dtype=dtype) for _ in range(2))
    return x, torch.randn(1024, device="cuda", dtype=dtype), r


P = 0.1   # the dropout ops' probability


def _dropout_check(expect, tol=2e-2):
    """Dropout outputs are random (Kitsune's and torch's masks differ), so they are
    checked, not compared: every element is 0 or expect(args) / (1 - P) (within the
    dtype's rounding), and the dropped fraction is P within 0.5% (n >= 1M elements)."""
    def check(got, args):
        want = expect(*(v.float() for v in args)) / (1 - P)
        got = got.float()
        dropped = got == 0
        ok = torch.isclose(got, want, rtol=tol, atol=tol) | dropped
        frac = dropped.float().mean().item()
        return bool(ok.all()) and abs(frac - P) < 5e-3
    return check


def _sum(t):   # compare a tuple of outputs as one
    return torch.cat([v.float().reshape(-1) for v in t]) if isinstance(t, tuple) else t.float()


OPS = {   # name: (kitsune, reference, inputs(n elements, dtype), moved bytes as multiples of one input)
    "add_relu": (ko.add_relu, lambda a, b: torch.relu(a + b), _two, 3),
    "mul_tanh": (ko.mul_tanh, lambda a, b: torch.tanh(a * b), _two, 3),
    "bias_gelu": (ko.bias_gelu, lambda x, b: F.gelu(x + b), _rows(1024, 1), 2),
    "swiglu": (ko.swiglu, lambda g, u: F.silu(g) * u, _two, 3),
    "rms_norm": (ko.rms_norm, lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), _rows(4096, 1), 2),
    "layer_norm_relu": (lambda x, w, b: ko.layer_norm_relu(x, x.shape[-1], w, b),
                        lambda x, w, b: F.relu(F.layer_norm(x, (x.shape[-1],), w, b)), _rows(4096, 2), 2),
    "add_layer_norm": (ko.add_layer_norm,
                       lambda x, r, w, b: (x + r, F.layer_norm(x + r, (x.shape[-1],), w, b)), _add_rows, 4),
    "sum_squared": (ko.sum_squared, lambda x: (x * x).sum(), _one, 1),
    "mean_abs": (ko.mean_abs, lambda x: x.abs().mean(), _one, 1),
    "cross_entropy": (ko.cross_entropy, F.cross_entropy, _logits, 1),
    # training: the statistics need a pass over x before the normalisation can start,
    # so an ideal kernel reads x twice (3 x the input's bytes); eval is one pass
    "batch_norm_relu": (lambda x, rm, rv, w, b: ko.batch_norm_relu(x, rm, rv, w, b, True),
                        lambda x, rm, rv, w, b: F.relu(F.batch_norm(x, rm, rv, w, b, True)), _images, 3),
    "batch_norm_relu_eval": (lambda x, rm, rv, w, b: ko.batch_norm_relu(x, rm, rv, w, b, False),
                             lambda x, rm, rv, w, b: F.relu(F.batch_norm(x, rm, rv, w, b, False)), _images, 2),
    "gelu_dropout": (lambda x: ko.gelu_dropout(x, P), lambda x: F.dropout(F.gelu(x), P), _one, 2),
    "bias_dropout_add": (lambda x, b, r: ko.bias_dropout_add(x, b, r, P),
                         lambda x, b, r: r + F.dropout(x + b, P), _bias_res, 3),
}


def _bias_dropout_add_check(got, args):
    x, b, r = args
    # out - residual carries the rounding of out (|residual| up to ~5): a wider tolerance
    return _dropout_check(lambda x, b: x + b, 4e-2)(got.float() - r.float(), (x, b))


# ops whose outputs are random: a check instead of the comparison with eager
CHECKS = {"gelu_dropout": _dropout_check(F.gelu), "bias_dropout_add": _bias_dropout_add_check}


def flusher(kind):
    """What runs, untimed, before each timed call: "write" zeroes a 256 MB buffer (the
    L2 then holds dirty lines, whose write-back the timed call pays for); "clean" then
    also reads another 256 MB buffer, so the L2 holds clean lines only."""
    dirty = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if kind == "write":
        return dirty.zero_
    clean = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    out = torch.empty((), device="cuda")

    def both():
        dirty.zero_()
        torch.sum(clean, 0, out=out)
    return both


def measure(name, dtype, size_mb, compiled, flush, reps):
    """One op at one size: checked, then timed; returns the result row."""
    kfn, ref, make, moved = OPS[name]
    n = (size_mb << 20) // torch.tensor([], dtype=dtype).element_size()
    args = make(n, dtype)
    x = args[0]
    key = (name, dtype)
    if key not in compiled:
        compiled[key] = torch.compile(ref, dynamic=True)
    cfn = compiled[key]
    if name in CHECKS:
        for label, f in (("kitsune", kfn), ("compile", cfn)):
            assert CHECKS[name](f(*args), args), f"{label} {name} {dtype} {size_mb} MB wrong"
    else:
        # fp32 copies (running stats cloned: the reference must not update the originals)
        fargs = [v.float() if v.is_floating_point() else v for v in args]
        fargs = [v.clone() if v is a else v for v, a in zip(fargs, args)]
        want = _sum(ref(*fargs))
        for label, f in (("kitsune", kfn), ("compile", cfn)):
            got = _sum(f(*args))
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            assert torch.allclose(got, want, atol=tol, rtol=tol), f"{label} {name} {dtype} {size_mb} MB wrong"
    nbytes = x.numel() * x.element_size()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = {
        "copy": cuda_ms(lambda: dst.copy_(src), reps, flush),
        "kitsune": cuda_ms(lambda: kfn(*args), reps, flush),
        "eager": cuda_ms(lambda: ref(*args), reps, flush),
        "compile": cuda_ms(lambda: cfn(*args), reps, flush),
    }
    gbs = {k: (2 if k == "copy" else moved) * nbytes / (v * 1e-3) / 1e9 for k, v in t.items()}
    return {"op": name, "dtype": str(dtype).replace("torch.", ""), "input_mb": size_mb, "ms": t, "gbs": gbs,
            "of_copy": gbs["kitsune"] / gbs["copy"], "vs_compile": t["compile"] / t["kitsune"],
            "vs_eager": t["eager"] / t["kitsune"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default="", help="comma-separated subset of: " + ",".join(OPS))
    ap.add_argument("--flush", choices=["write", "clean"], default="write",
                    help="how the L2 is flushed before each timed call (see flusher)")
    ap.add_argument("--sizes", default="", help="comma-separated bf16 sizes in MB (default 1,16,64,256,1024)")
    a = ap.parse_args()
    flush = flusher(a.flush)
    reps = 7 if a.quick else 20
    mb = [int(v) for v in a.sizes.split(",")] if a.sizes else [1, 16, 64, 256, 1024] if not a.quick else [1, 64]
    cases = [(torch.bfloat16, s) for s in mb] + [(torch.float32, 256)]
    compiled, rows, failed = {}, [], []
    names = a.ops.split(",") if a.ops else list(OPS)   # in the order given
    unknown = [n for n in names if n not in OPS]
    if unknown:
        sys.exit(f"elementwise.py: unknown op(s) {unknown}; known: {', '.join(OPS)}")
    for name in names:
        for dtype, size_mb in cases:
            try:
                row = measure(name, dtype, size_mb, compiled, flush, reps)
            except (AssertionError, RuntimeError) as e:   # reported, and the other ops still measured
                failed.append(f"{name} {dtype} {size_mb} MB: {e}")
                print("FAILED", failed[-1], flush=True)
                continue
            rows.append(row)
            gbs = row["gbs"]
            print(f"{name:15s} {row['dtype']:8s} {size_mb:5d} MB  kitsune {gbs['kitsune']:7.0f} GB/s "
                  f"({100 * row['of_copy']:5.1f}% of copy {gbs['copy']:6.0f})  compile {gbs['compile']:7.0f}  "
                  f"eager {gbs['eager']:7.0f}  x{row['vs_compile']:.2f} vs compile, x{row['vs_eager']:.2f} vs eager",
                  flush=True)
        # after every op, so a run cut short keeps what it measured
        write_result(a.out, "kernels_elementwise", {"reps": reps, "flush": a.flush, "rows": rows, "failed": failed})
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
