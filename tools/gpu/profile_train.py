"""Top CUDA kernels of one training step of bench/kernels/train_models.py's models
(eager or kitsune.optimize) and of the GPT-2 loss head, via torch.profiler.

    python tools/gpu/profile_train.py [gpt2|llama] [eager|kitsune]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "kernels"))
import kitsune  # noqa: E402
import kitsune.ops as ko  # noqa: E402
import train_models as tm  # noqa: E402


def top(fn, label, n=14):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print(f"== {label}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=70))


def training_step(kind, variant):
    """train_models.py's model (bf16, eager or kitsune.optimize), a batch of 8 x 1024
    tokens and AdamW(fused=True): returns (model, idx, opt, step)."""
    vocab = 50257 if kind == "gpt2" else 32000
    torch.manual_seed(0)
    m = tm.LM(kind, vocab=vocab).cuda().to(torch.bfloat16)
    if variant == "kitsune":
        m = kitsune.optimize(m, inplace=True)
    idx = torch.randint(0, vocab, (8, 1024), device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)

    def step():
        m(idx, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m, idx, opt, step


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "llama"
    variant = sys.argv[2] if len(sys.argv) > 2 else "kitsune"
    top(training_step(kind, variant)[3], f"{kind} {variant} step")
    x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, 50257, (8192,), device="cuda")
    top(lambda: ko.linear_cross_entropy(x, w, t).backward(), "gpt2 head kitsune", 8)


if __name__ == "__main__":
    main()
