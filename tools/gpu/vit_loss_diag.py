"""Whether kitsune.cross_entropy itself moves ViT-B/16's bf16 training away from eager's
(tools/gpu/vit_diag.py, H200: compile_step with fuse_loss=False follows eager within
0.003, the fused loss parts by 0.36 within 20 steps). After 5 eager steps of
bench/zoo.py's recipe, on one batch under autocast, kitsune.ops.cross_entropy against
F.cross_entropy in eager autograd: the loss and its dtype, the logits' gradient against
a float64 reference, and the parameters' gradients. (On the H200 both logit gradients
were 1.9e-5 from the reference at most, archive/h200_pytest_vitloss_zoo_ca18fba.log.)"""
import copy

import torch
from kitsune import ops as ko
from vit_diag import KW, base, batches   # the same model, batches and optimizer settings
F = torch.nn.functional
model = copy.deepcopy(base)
opt = torch.optim.AdamW(model.parameters(), fused=True, **KW)
for i in range(5):
    x, y = batches[i % 4]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        F.cross_entropy(model(x), y).backward()
    opt.step()
x, y = batches[1]


def grads(loss_fn):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
        logits.retain_grad()
        loss = loss_fn(logits, y)
    loss.backward()
    return loss.detach(), logits.detach(), logits.grad.detach(), {n: p.grad.detach().clone() for n, p in
                                                                  model.named_parameters()}


la, logits, ga, pa = grads(F.cross_entropy)
lb, _, gb, pb = grads(ko.cross_entropy)
ref_l = logits.double().requires_grad_()
F.cross_entropy(ref_l, y).backward()
print(f"logits {logits.dtype} {list(logits.shape)} stride {logits.stride()} |max| {logits.abs().max():.3f}")
print(f"loss F {la.item():.6f} ({la.dtype})  kitsune {lb.item():.6f} ({lb.dtype})")
for name, gr in (("F.cross_entropy", ga), ("kitsune", gb)):
    d = (gr.double() - ref_l.grad).abs()
    print(f"logit grad {name:16s} {gr.dtype} max |err| {d.max():.3e} (|ref| max {ref_l.grad.abs().max():.3e}) "
          f"rel-norm {d.norm() / ref_l.grad.norm():.3e}")
worst = sorted(((((pb[n].double() - pa[n].double()).norm() / (pa[n].double().norm() + 1e-30)).item(), n)
                for n in pa), reverse=True)[:8]
print("param grads, kitsune vs F (rel-norm), worst:", ", ".join(f"{n} {v:.2e}" for v, n in worst))
