"""A workload for Nsight Compute on the LayerNorm kernels (tools/gpu/gpu_run.sh part
"ncu_ln"): add_layer_norm forward and backward on GPT's rows (16 x 256 tokens of 512,
bf16), four times. Prints nothing itself."""
import torch

import kitsune.ops as ko

x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
r = torch.randn_like(x, requires_grad=True)
w = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for _ in range(4):
    h, y = ko.add_layer_norm(x, r, w, b)
    torch.autograd.backward((h, y), (torch.randn_like(h), torch.randn_like(y)))
torch.cuda.synchronize()
