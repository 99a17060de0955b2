"""Launches the bf16 dropout kernels and bias_gelu at 64 MB of input, a few times
each, for Nsight Compute (tools/gpu/gpu_run.sh, part "ncu"): gelu_dropout,
bias_dropout_add, and bias_gelu (the same GELU without Philox)."""
import torch

import kitsune.ops  # noqa: F401 - registers torch.ops.kitsune

n = 32 << 20   # 64 MB of bf16
x = torch.randn(n // 4096, 4096, device="cuda", dtype=torch.bfloat16)
r, b = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
k = torch.ops.kitsune
for _ in range(3):   # ncu skips the first round
    k.gelu_dropout(x, 0.1, True)
    k.bias_dropout_add(x, b, r, 0.1, True)
    k.bias_gelu(x, b, "none")
torch.cuda.synchronize()
