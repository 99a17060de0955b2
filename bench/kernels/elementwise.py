"""Fused elementwise and normalisation ops: achieved bandwidth against copy, eager and torch.compile.

    python bench/kernels/elementwise.py [--out DIR] [--quick]

For each op and size (bytes of one input tensor: 1 MB to 1 GB, bf16; fp32 at 256 MB)
it times, with CUDA events, the median of 20 repeats with the L2 flushed (a 256 MB
buffer written) before each:
  copy      dst.copy_(src) of the same bytes: the achievable bandwidth, 2 x bytes moved
  kitsune   torch.ops.kitsune.<op>
  eager     the reference expression in PyTorch ops
  compile   torch.compile(reference expression, dynamic=True): Inductor's fused kernel
GB/s counts the bytes an ideal fused kernel moves: every input read once and every
output written once (the bias of bias_gelu and the weight of rms_norm are not counted). Outputs are checked
against the eager result before any timing. Writes kernels_elementwise.json.
"""
import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F

import kitsune.ops as ko

OPS = {   # name: (kitsune, reference, inputs like x, moved bytes as multiples of one input)
    "add_relu": (ko.add_relu, lambda a, b: torch.relu(a + b), 3),
    "mul_tanh": (ko.mul_tanh, lambda a, b: torch.tanh(a * b), 3),
    "bias_gelu": (ko.bias_gelu, lambda x, b: F.gelu(x + b), 2),
    "swiglu": (ko.swiglu, lambda g, u: F.silu(g) * u, 3),
    "rms_norm": (ko.rms_norm, lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), 2),
}


def timed(fn, flush, reps):
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    reps = 7 if a.quick else 20
    mb = [1, 16, 64, 256, 1024] if not a.quick else [1, 64]
    cases = [(torch.bfloat16, s) for s in mb] + [(torch.float32, 256)]
    compiled = {}
    rows = []
    for name, (kfn, ref, moved) in OPS.items():
        for dtype, size_mb in cases:
            n = (size_mb << 20) // torch.tensor([], dtype=dtype).element_size()
            if name in ("bias_gelu", "rms_norm"):   # rows of 1024 (bias_gelu) or 4096 (rms_norm)
                cols = 4096 if name == "rms_norm" else 1024
                x = torch.randn(n // cols, cols, device=dev, dtype=dtype)
                y = torch.randn(cols, device=dev, dtype=dtype)
            else:
                x = torch.randn(n, device=dev, dtype=dtype)
                y = torch.randn(n, device=dev, dtype=dtype)
            key = (name, dtype)
            if key not in compiled:
                compiled[key] = torch.compile(ref, dynamic=True)
            cfn = compiled[key]
            want = ref(x.float(), y.float())
            for label, f in (("kitsune", kfn), ("compile", cfn)):
                got = f(x, y).float()
                tol = 2e-2 if dtype != torch.float32 else 1e-5
                assert torch.allclose(got, want, atol=tol, rtol=tol), f"{label} {name} {dtype} {size_mb} MB wrong"
            nbytes = x.numel() * x.element_size()
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t = {
                "copy": timed(lambda: dst.copy_(src), flush, reps),
                "kitsune": timed(lambda: kfn(x, y), flush, reps),
                "eager": timed(lambda: ref(x, y), flush, reps),
                "compile": timed(lambda: cfn(x, y), flush, reps),
            }
            gbs = {k: (2 if k == "copy" else moved) * nbytes / (v * 1e-3) / 1e9 for k, v in t.items()}
            row = {"op": name, "dtype": str(dtype).replace("torch.", ""), "input_mb": size_mb, "ms": t, "gbs": gbs,
                   "of_copy": gbs["kitsune"] / gbs["copy"], "vs_compile": t["compile"] / t["kitsune"],
                   "vs_eager": t["eager"] / t["kitsune"]}
            rows.append(row)
            print(f"{name:10s} {row['dtype']:8s} {size_mb:5d} MB  kitsune {gbs['kitsune']:7.0f} GB/s "
                  f"({100 * row['of_copy']:5.1f}% of copy {gbs['copy']:6.0f})  compile {gbs['compile']:7.0f}  "
                  f"eager {gbs['eager']:7.0f}  x{row['vs_compile']:.2f} vs compile, x{row['vs_eager']:.2f} vs eager",
                  flush=True)
            del x, y, src, dst, want
    res = {"bench": "kernels_elementwise", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "commit": os.environ.get("KT_COMMIT", "?"), "reps": reps, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "kernels_elementwise.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
