"""Shape-varying transformer training: device memory over live memory, step time.

    python bench/alloc_shapes.py [--out DIR] [--steps N]

A GPT-style model (vocab 32k, d 768, 8 layers) trains with bf16 autocast and fused
AdamW; batch in [4, 32] and sequence length in [64, 1024] are drawn at random every
step (the same draws for every allocator). Each allocator (native, cudaMallocAsync,
expandable_segments, Kitsune) runs in its own process. Reported per allocator:
  peak live      torch.cuda.max_memory_allocated()
  peak device    max over steps of device memory in use (torch.cuda.mem_get_info,
                 read after every step, minus what was in use before the model)
  peak reserved  torch.cuda.max_memory_reserved()
  ms/step        median wall time of a step (loss.item() synchronizes), steps 5..N
  release_syncs  device synchronizations the allocator made to give memory back
                 (torch's num_sync_all_streams)
Kitsune runs three ways: the default (VMM: 2 MiB granules of one address range),
segments released before growing (KITSUNE_VMM=0), and segments kept (also
KITSUNE_RELEASE_ON_GROW=0).
Writes alloc_shapes.json.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "native": {},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "kitsune": {"KT_BENCH_KITSUNE": "1"},                                  # VMM: granules of one range
    "kitsune_segments": {"KT_BENCH_KITSUNE": "1", "KITSUNE_VMM": "0"},       # segments, released before growing
    "kitsune_keep_segments": {"KT_BENCH_KITSUNE": "1", "KITSUNE_VMM": "0", "KITSUNE_RELEASE_ON_GROW": "0"},
}


def child(steps):
    import random
    import torch
    if os.environ.get("KT_BENCH_KITSUNE") == "1":
        import kitsune.allocator
        kitsune.allocator.install()
    nn = torch.nn
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    base = total - free0
    vocab, d, layers = 32768, 768, 8

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(1024, d)
            layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.0, batch_first=True, norm_first=True,
                                               activation="gelu")
            self.blocks = nn.TransformerEncoder(layer, layers)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            t = x.shape[1]
            h = self.emb(x) + self.pos(torch.arange(t, device=x.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
            return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    rng = random.Random(1234)
    times, device_peak, losses = [], 0, []
    for step in range(steps):
        b, t = rng.randint(4, 32), rng.randint(64, 1024)
        x = torch.randint(0, vocab, (b, t + 1), device="cuda")
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        free, _ = torch.cuda.mem_get_info()
        device_peak = max(device_peak, total - free - base)
        del x, logits, loss
    print(json.dumps({"peak_live": torch.cuda.max_memory_allocated(), "peak_device": device_peak,
                      "peak_reserved": torch.cuda.max_memory_reserved(),
                      "ms_per_step": 1e3 * statistics.median(times[5:]), "final_loss": losses[-1],
                      "release_syncs": torch.cuda.memory_stats().get("num_sync_all_streams", 0)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a.steps)
    import torch
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = {}
    for name, extra in CONFIGS.items():
        env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"), **extra)
        print(f"[{name}] {a.steps} steps of shape-varying training ...", flush=True)
        r = subprocess.run([sys.executable, __file__, "--child", "--steps", str(a.steps)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
        res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    device = torch.cuda.get_device_name(0)
    print(f"\nshape-varying GPT training, {a.steps} steps; {device}, torch {torch.__version__}")
    print(f"{'allocator':>20} {'peak live GiB':>14} {'peak device GiB':>16} {'device/live':>12} "
          f"{'reserved/live':>14} {'ms/step':>9} {'vs native':>10}")
    for n, r in res.items():
        print(f"{n:>20} {r['peak_live'] / 2**30:>14.2f} {r['peak_device'] / 2**30:>16.2f} "
              f"{r['peak_device'] / r['peak_live']:>12.3f} {r['peak_reserved'] / r['peak_live']:>14.3f} "
              f"{r['ms_per_step']:>9.1f} {r['ms_per_step'] / res['native']['ms_per_step']:>10.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "alloc_shapes.json"), "w") as f:
        json.dump({"benchmark": "alloc_shapes", "device": device, "torch": torch.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": os.environ.get("KT_COMMIT", "?"), "steps": a.steps, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
