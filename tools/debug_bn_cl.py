"""batch_norm_relu on a channels-last batch against the same batch NCHW: the largest
differences of the output and each gradient, per dtype and shape (a GPU check)."""
import torch

import kitsune.ops as ko

for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for shape in [(8, 24, 7, 9), (16, 64, 14, 14), (8, 16, 8, 8)]:
        g = torch.Generator().manual_seed(13)
        c = shape[1]
        x = (torch.randn(shape, generator=g) + 1.5).cuda().to(dtype)
        w, b = torch.randn(c, generator=g).cuda().to(dtype), torch.randn(c, generator=g).cuda().to(dtype)
        go = torch.randn(shape, generator=g).cuda().to(dtype)
        res = []
        for cl in (False, True):
            xi = (x.contiguous(memory_format=torch.channels_last) if cl else x.clone()).requires_grad_()
            wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
            rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
            out = ko.batch_norm_relu(xi, rm, rv, wi, bi, True)
            grads = torch.autograd.grad(out, (xi, wi, bi), go)
            res.append([out.float(), rm, rv] + [t.float() for t in grads])
        names = ["out", "running_mean", "running_var", "grad_x", "grad_w", "grad_b"]
        diffs = {n: (a - b_).abs().max().item() for n, a, b_ in zip(names, res[0], res[1])}
        print(dtype, shape, " ".join(f"{k} {v:.3g}" for k, v in diffs.items()), flush=True)
