"""Where ResNet-18's one-liner parts from eager under fused SGD: each fp32 recipe against
an fp64 eager reference (NCHW), 8 steps. Per step, the loss difference from fp64; at the
end, the parameters' distance from fp64's over the size of fp64's update
(|p - p64| / |p64 - p0|, all parameters together). A recipe whose error is of the size
of eager fp32's is rounding amplified by training; a wrong gradient or update is far
above it."""
import copy, torch, torchvision as tv, kitsune
F = torch.nn.functional
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: a dry run of this script
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
KW = dict(lr=5e-4, momentum=0.9, weight_decay=5e-5)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 3, 32, 32, generator=g).to(DEV), torch.randint(0, 10, (16,), generator=g).to(DEV))
           for _ in range(8)]
torch.manual_seed(0)
base = tv.models.resnet18(num_classes=10).to(DEV)
p0 = [p.detach().double().clone() for p in base.parameters()]


def eager(dtype, cl, fused):
    m = copy.deepcopy(base).to(dtype)
    if cl:
        m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), fused=fused, **KW)
    losses = []
    for x, y in batches:
        x = x.to(dtype)
        x = x.contiguous(memory_format=torch.channels_last) if cl else x
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m


def one_liner(optimize, **ckw):
    m = copy.deepcopy(base)
    fm = kitsune.optimize(m) if optimize else m
    st = kitsune.compile_step(fm, F.cross_entropy, kitsune.KitsuneOptimizer(torch.optim.SGD, fm.parameters(),
                                                                             fused=True, **KW), **ckw)
    losses = [st(x, y).item() for x, y in batches]
    assert DEV == "cpu" or st.stats()["reason"] is None, st.stats()
    return losses, fm


ref, m64 = eager(torch.float64, False, False)
p64 = [p.detach().clone() for p in m64.parameters()]
upd = sum(((a - b) ** 2).sum() for a, b in zip(p64, p0)).sqrt().item()
print(f"fp64 eager NCHW losses {' '.join(f'{v:.5f}' for v in ref)}; update norm {upd:.3e}")
for name, run in [("eager fp32 NCHW", lambda: eager(torch.float32, False, True)),
                  ("eager fp32 NHWC", lambda: eager(torch.float32, True, True)),
                  ("one-liner (NHWC)", lambda: one_liner(True)),
                  ("one-liner channels_last=False", lambda: one_liner(True, channels_last=False)),
                  ("compile_step, no optimize", lambda: one_liner(False)),
                  ("one-liner, update after bwd", lambda: one_liner(True, optimizer_in_backward=False))]:
    losses, m = run()
    err = sum(((p.detach().double() - q) ** 2).sum() for p, q in zip(m.parameters(), p64)).sqrt().item()
    worst = max(((p.detach().double() - q).norm() / (q - r).norm().clamp_min(1e-30)).item()
                for p, q, r in zip(m.parameters(), p64, p0))
    print(f"{name:30s} loss - fp64's {' '.join(f'{a - b:+.1e}' for a, b in zip(losses, ref))}; "
          f"params |p-p64|/|upd| {err / upd:.2e} (worst tensor {worst:.2e})", flush=True)
