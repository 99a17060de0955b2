"""Where ResNet-18's one-liner parts from eager under fused SGD (fp32, deterministic):
max loss difference over 8 steps for variants of the recipe."""
import copy, sys, torch, torchvision as tv, kitsune
F = torch.nn.functional
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 3, 32, 32, generator=g).cuda(), torch.randint(0, 10, (16,), generator=g).cuda()) for _ in range(8)]
for name, kw, ckw, opt_k in [("sgd m.9 wd", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), {}, True),
                             ("sgd m.9 wd nchw-skip", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), dict(channels_last=False), True),
                             ("sgd plain", dict(lr=5e-4), {}, True),
                             ("sgd m.9 wd no in-bwd", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), dict(optimizer_in_backward=False), True),
                             ("sgd m.9 wd 1 stream", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), dict(streams=1), True),
                             ("sgd m.9 no optimize", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), {}, False),
                             ("sgd lr0", dict(lr=0.0, momentum=0.9), {}, True),
                             ("sgd m.9 wd, NHWC twin", dict(lr=5e-4, momentum=0.9, weight_decay=5e-5), {}, "cl")]:
    torch.manual_seed(0)
    m = tv.models.resnet18(num_classes=10).cuda()
    twin = copy.deepcopy(m)
    if opt_k == "cl":   # the eager twin in the layout compile_step picks
        twin = twin.to(memory_format=torch.channels_last)
    ro = torch.optim.SGD(twin.parameters(), fused=True, **kw)
    ref = []
    for x, y in batches:
        xt = x.contiguous(memory_format=torch.channels_last) if opt_k == "cl" else x
        ro.zero_grad(set_to_none=True); l = F.cross_entropy(twin(xt), y); l.backward(); ro.step(); ref.append(l.item())
    fm = kitsune.optimize(m) if opt_k else m
    st = kitsune.compile_step(fm, F.cross_entropy, kitsune.KitsuneOptimizer(torch.optim.SGD, fm.parameters(), fused=True, **kw), **ckw)
    got = [st(x, y).item() for x, y in batches]
    print(f"{name:22s} diffs", " ".join(f"{a - b:+.1e}" for a, b in zip(got, ref)), st.stats()["replays"], flush=True)
