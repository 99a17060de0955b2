"""LayerNorm's warp backward, variants side by side (an experiment: KT_LNBWD=keep|pf picks
the kernel, KT_LNBWD_SPLITS caps the stripes; each setting in its own process, since the
library reads them once). GPT's rows (4096 x 512 bf16, add_layer_norm with a residual
gradient), forward and backward 200 times in CUDA graphs; prints the profiler's us a call of each
kernel of the backward.

    python tools/ln_bwd_variants.py          # runs every setting as a child process
"""
import os
import subprocess
import sys
from collections import defaultdict

SETTINGS = [("keep", "256"), ("pf", "256"), ("keep", "512"), ("pf", "128"), ("keep", "128")]


def child():
    import torch
    import kitsune.ops as ko
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gh, gy = torch.randn_like(x), torch.randn_like(x)

    def bwd():   # forward and backward: autograd runs the backward on the forward's stream
        h, y = ko.add_layer_norm(x, r, w, b)
        return torch.autograd.grad((h, y), (x, w, b), (gh, gy))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            bwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            bwd()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            calls[e.name] += 1
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        g.replay()
    z.record()
    torch.cuda.synchronize()
    tag = f"KT_LNBWD={os.environ.get('KT_LNBWD')} KT_LNBWD_SPLITS={os.environ.get('KT_LNBWD_SPLITS')}"
    print(f"== {tag}: {a.elapsed_time(z) * 1000 / (50 * 20):.2f} us a forward + backward (graph of 20, events)")
    for k in sorted(total, key=lambda k: -total[k]):
        print(f"   {total[k] / calls[k]:7.2f} us a call  {calls[k] / 200:4.1f}x  {k[:110]}")


if __name__ == "__main__":
    if os.environ.get("KT_LNBWD"):
        child()
    else:
        import torch
        print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
        for var, splits in SETTINGS:
            env = dict(os.environ, KT_LNBWD=var, KT_LNBWD_SPLITS=splits)
            subprocess.run([sys.executable, __file__], env=env, check=False)
