"""Scripts the GPU tests run in fresh processes (install() must precede CUDA init).

python torch_workloads.py WORKLOAD [--kitsune]  prints one JSON line."""
import json
import os
import sys


def setup(use_kitsune):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    if use_kitsune:
        import kitsune.allocator
        kitsune.allocator.install()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    return torch


def train(torch, model, batches, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = batches(step)
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mlp(torch, steps):
    nn = torch.nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

        def loss(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    g = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randn(64, 784, device="cuda", generator=g), torch.randint(0, 10, (64,), device="cuda", generator=g))
            for _ in range(8)]
    return train(torch, MLP().cuda(), lambda s: data[s % 8], steps)


def gpt(torch, steps):
    nn = torch.nn
    vocab, seq, d = 1000, 64, 128

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, 2)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

        def loss(self, x, y):
            h = self.blocks(self.emb(x) + self.pos, mask=self.mask, is_causal=True)
            return nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())

    g = torch.Generator(device="cuda").manual_seed(2)
    data = [torch.randint(0, vocab, (16, seq + 1), device="cuda", generator=g) for _ in range(8)]
    return train(torch, GPT().cuda(), lambda s: (data[s % 8][:, :-1], data[s % 8][:, 1:]), steps)


def main():
    workload, use_kitsune = sys.argv[1], "--kitsune" in sys.argv
    torch = setup(use_kitsune)
    steps = int(os.environ.get("KT_STEPS", "200"))
    losses = {"mlp": mlp, "gpt": gpt}[workload](torch, steps)
    import kitsune.allocator as ka
    print(json.dumps({"losses": losses, "kitsune": ka.installed(),
                      "max_allocated": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    main()
