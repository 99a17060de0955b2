"""One launch of each bench/kernels/chains.py chain (bf16, 64 MB) for Nsight Compute:
    ncu --kernel-name regex:chain_kernel ... python3 tools/gpu/ncu_chain.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "kernels"))
import chains  # noqa: E402

n = (64 << 20) // 2 // 4096
g = torch.Generator(device="cuda").manual_seed(0)
x, y = (torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
for label, fn in chains.CHAINS:
    gm, _, _ = chains._chain_call(fn, (x, y, b))
    gm(x, y, b)
    torch.cuda.synchronize()
    print(label, flush=True)
