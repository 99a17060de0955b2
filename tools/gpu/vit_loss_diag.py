"""Why compile_step's fused loss moves ViT-B/16's bf16 training away from eager's
(tools/gpu/vit_diag.py, H200: fuse_loss=False follows eager within 0.003, the fused
loss parts by 0.36 within 20 steps). After 5 eager steps (bench/zoo.py's recipe):
(1) on one batch under autocast, kitsune.ops.cross_entropy against F.cross_entropy
in eager autograd: the loss, its dtype, the logits' gradient (fp64 reference) and
the parameters' gradients; (2) one compile_step update from the same state with
fuse_loss True and False against eager's: the parameters that move differently."""
import copy
import torch
import torchvision as tv
import kitsune
from kitsune import ops as ko
F = torch.nn.functional
torch.backends.cudnn.benchmark = True
g = torch.Generator().manual_seed(0)
torch.manual_seed(0)
model = tv.models.vit_b_16().cuda()
batches = [(torch.randn(64, 3, 224, 224, generator=g).cuda(), torch.randint(0, 1000, (64,), generator=g).cuda())
           for _ in range(4)]
KW = dict(lr=3e-4, weight_decay=0.01)
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


def updates(steps=3, **ckw):
    """The parameters' change over `steps` steps on (x, y) from the same state: eager's
    loop (no ckw) or compile_step(**ckw) (its first step runs eagerly, then it replays)."""
    m = copy.deepcopy(model)
    o = torch.optim.AdamW(m.parameters(), fused=True, **KW)
    o.load_state_dict(opt.state_dict())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    step = kitsune.compile_step(m, F.cross_entropy, o, autocast_dtype=torch.bfloat16, **ckw) if ckw else None
    for _ in range(steps):
        if step is not None:
            step(x, y)
            continue
        o.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            F.cross_entropy(m(x), y).backward()
        o.step()
    if step is not None:
        print("   stats", {k: v for k, v in step.stats().items() if k in ("reason", "replays", "eager_steps")})
    return {n: (p.detach() - before[n]).double() for n, p in m.named_parameters()}


for steps in (1, 3):
    ue = updates(steps)
    for ckw in (dict(fuse_loss=False), dict(fuse_loss=True), dict(fuse_loss=True, plan_memory=False)):
        uk = updates(steps, **ckw)
        worst = sorted((((uk[n] - ue[n]).norm() / (ue[n].norm() + 1e-30)).item(), n) for n in ue)[::-1][:5]
        print(f"{steps} compile_step update(s) {ckw}: change vs eager's (rel-norm), worst:",
              ", ".join(f"{n} {v:.2e}" for v, n in worst), flush=True)
