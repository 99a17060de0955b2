"""The stream plan of an Inception-style block and of an MLP (make demo; no GPU needed).

    PYTHONPATH=python KITSUNE_LIBRARY=build/libkitsune.so python3 bench/sched_demo.py

Prints kitsune.sched.plan's verdict for each: the block's four branches spread over
four streams with the syncs the concat needs; the MLP, a chain, keeps one stream.
"""
import torch

import kitsune.sched as ks


class Inception(torch.nn.Module):
    """An Inception-style block (four branches joined by a concat): the demo's example of
    a graph that several streams shorten."""

    def __init__(self, c=64):
        nn = torch.nn
        super().__init__()
        self.b1 = nn.Conv2d(c, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, c, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


def demo():
    """Prints the plan of an Inception-style block and of an MLP."""
    nn = torch.nn
    print(ks.plan(Inception(), torch.randn(32, 64, 28, 28), streams=4))
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    print(ks.plan(mlp, torch.randn(64, 784), streams=4))


if __name__ == "__main__":
    demo()
