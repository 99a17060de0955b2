"""Model blocks the tests rewrite: the GPT-2 and LLaMA blocks of
bench/kernels/train_models.py (what the end-to-end benchmark trains), written as it
writes them, at small default sizes, and the Inception-style block of bench/sched_demo.py
(the stream scheduler's example). A helper module: the tests import it, not bench/."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def attention(qkv, h):
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = qkv.split(d, dim=2)
    q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class GPT2Block(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gelu, self.h = nn.GELU(approximate="tanh"), h

    def forward(self, x):
        x = x + self.proj(attention(self.qkv(self.ln1(x)), self.h))
        return x + self.out(self.gelu(self.fc(self.ln2(x))))


class LlamaBlock(nn.Module):
    def __init__(self, d=32, h=4, f=64):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w2, self.w3 = (nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False),
                                     nn.Linear(d, f, bias=False))
        self.h = h

    def forward(self, x):
        x = x + self.o(attention(self.qkv(self.n1(x)), self.h))
        hdn = self.n2(x)
        return x + self.w2(F.silu(self.w1(hdn)) * self.w3(hdn))


class Inception(nn.Module):
    """An Inception-style block (four branches joined by a concat): a graph that several
    streams shorten."""

    def __init__(self, c=64):
        super().__init__()
        self.b1 = nn.Conv2d(c, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, c, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)
