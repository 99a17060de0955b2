"""Where the one-liner parts from eager: each fp32 recipe against an fp64 eager reference
(NCHW), 8 steps, on ResNet-18 under fused SGD (default) or a small torchvision ViT under
fused AdamW (argument "vit"); "--lr X" sets the learning rate (default 5e-4, ViT 1e-3). Per step, the loss difference from fp64; at the
end, the parameters' distance from fp64's over the size of fp64's update
(|p - p64| / |p64 - p0|, all parameters together). A recipe whose error is of the size
of eager fp32's is rounding amplified by training; a wrong gradient or update is far
above it."""
import copy, sys, torch, torchvision as tv, kitsune
F = torch.nn.functional
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: a dry run of this script
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
VIT = "vit" in sys.argv[1:]
OPT = torch.optim.AdamW if VIT else torch.optim.SGD
KW = dict(lr=1e-3, weight_decay=0.01) if VIT else dict(lr=5e-4, momentum=0.9, weight_decay=5e-5)
if "--lr" in sys.argv:
    KW["lr"] = float(sys.argv[sys.argv.index("--lr") + 1])
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 3, 32, 32, generator=g).to(DEV), torch.randint(0, 10, (16,), generator=g).to(DEV))
           for _ in range(8)]
torch.manual_seed(0)
base = (tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                                   num_classes=10) if VIT else tv.models.resnet18(num_classes=10)).to(DEV)
p0 = [p.detach().double().clone() for p in base.parameters()]


def eager(dtype, cl, fused):
    m = copy.deepcopy(base).to(dtype)
    if cl:
        m = m.to(memory_format=torch.channels_last)
    opt = OPT(m.parameters(), fused=fused, **KW)
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
    st = kitsune.compile_step(fm, F.cross_entropy, kitsune.KitsuneOptimizer(OPT, fm.parameters(),
                                                                             fused=True, **KW), **ckw)
    losses = [st(x, y).item() for x, y in batches]
    assert DEV == "cpu" or st.stats()["reason"] is None, st.stats()
    if VIT:   # Adam's step counts: each parameter's should be 8
        opt = st.optimizer
        steps = sorted({float(s["step"]) for s in opt.state.values() if "step" in s})
        hyper = getattr(opt, "_hyper", None)
        print("  adam step counts (state, device)", steps, None if hyper is None else hyper[:, 1].tolist())
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
if VIT and DEV == "cuda":   # bf16 autocast, as bench/zoo.py runs ViT-B/16: the one-liner against eager
    m = copy.deepcopy(base)
    opt = OPT(m.parameters(), fused=True, **KW)
    ref16 = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        ref16.append(loss.item())
    fm = kitsune.optimize(copy.deepcopy(base))
    st = kitsune.compile_step(fm, F.cross_entropy, kitsune.KitsuneOptimizer(OPT, fm.parameters(), fused=True, **KW),
                              autocast_dtype=torch.bfloat16)
    got = [st(x, y).item() for x, y in batches]
    print("bf16 one-liner - bf16 eager", " ".join(f"{a - b:+.1e}" for a, b in zip(got, ref16)),
          "| eager bf16 - fp64", " ".join(f"{a - b:+.1e}" for a, b in zip(ref16, ref)))
