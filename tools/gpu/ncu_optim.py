"""A workload for Nsight Compute on the fused AdamW step (tools/gpu/gpu_run.sh part
"ncu_optim"): KitsuneOptimizer(AdamW) over the parameters of bench/models.py's GPT
(bf16, 27.4M elements in 77 tensors, one launch a step), four steps. Prints nothing
itself."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import kitsune  # noqa: E402
from models import build  # noqa: E402

model, _, _ = build("gpt", torch.Generator().manual_seed(0))
for p in model.parameters():
    p.grad = torch.randn_like(p) * 1e-3
opt = kitsune.KitsuneOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
for _ in range(4):
    opt.step()
torch.cuda.synchronize()
