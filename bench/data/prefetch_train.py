"""A training loop where copying matters: DataLoader(pin_memory=True) vs kitsune.prefetch.

    python bench/data/prefetch_train.py [--out DIR] [--steps N] [--batch B] [--width W]

CIFAR-sized float32 images (3x32x32) in large batches (default 2048: 25 MB a batch)
and int64 labels come from a DataLoader with worker processes; a light CNN (two
conv layers of width W and 2W, bf16 autocast, fused AdamW) trains on them. Each
mode runs in its own process:
  resident  the batches are already on the GPU: the step's compute alone
  standard  DataLoader(pin_memory=True) and x.to("cuda", non_blocking=True): the
            documented recipe; the copy is queued on the compute stream
  kitsune   DataLoader(pin_memory=False) wrapped in kitsune.prefetch(depth=2):
            pinned staging from Kitsune's pool, copies on a side stream
Measured: ms/step (wall time over timed steps / steps, median of 3 blocks),
copy_ms (one batch host-to-device from pinned memory, CUDA events, median of 20),
and per mode the copy time hidden = 1 - (step - resident step) / copy_ms.
Unless --width is given, the width is the smallest of 16, 32, 64, 128 whose
resident step is at least the copy time and 1.25x the loader's own time per batch
(DataLoader with pin_memory=True iterated alone): below that the loop waits for the
host side whatever happens to the copy, and step times measure the loader, not the
overlap. Writes prefetch_train.json.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time


def build(width, batch, steps_data):
    import torch
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 8 * 8, 10)).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


class Batches:
    """A map-style dataset of whole batches (the DataLoader runs with batch_size=None),
    cycling through a few prebuilt CPU batches so the workers only ship them."""

    def __init__(self, batch, n):
        import torch
        g = torch.Generator().manual_seed(0)
        self.x = [torch.randn(batch, 3, 32, 32, generator=g) for _ in range(4)]
        self.y = [torch.randint(0, 10, (batch,), generator=g) for _ in range(4)]
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i % 4], self.y[i % 4]


def timed(step, batches, steps, blocks=3):
    """ms/step over `steps` steps, median of `blocks` blocks (after 20 warm-up steps)."""
    import torch
    it = iter(batches)
    for _ in range(20):
        step(*next(it))
    out = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(*next(it))
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0) / steps)
    return statistics.median(out), out


def child(mode, batch, width, steps, workers):
    import torch
    import kitsune
    torch.backends.cudnn.benchmark = True
    n = 20 + 3 * steps
    res = {"mode": mode}
    if mode == "probe":   # copy time, and the resident step for each candidate width
        x = torch.randn(batch, 3, 32, 32).pin_memory()
        times = []
        for _ in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            x.to("cuda", non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        res["copy_ms"] = statistics.median(times[5:])
        res["batch_bytes"] = x.numel() * x.element_size() + batch * 8
        loader = torch.utils.data.DataLoader(Batches(batch, 80), batch_size=None, num_workers=workers,
                                             pin_memory=True, prefetch_factor=4)
        it = iter(loader)
        for _ in range(10):
            next(it)
        t0 = time.perf_counter()
        for _ in range(70):
            next(it)
        res["loader_ms"] = 1e3 * (time.perf_counter() - t0) / 70
        res["resident_ms_by_width"] = {}
        for w in ([width] if width else [16, 32, 64, 128]):
            data = [(torch.randn(batch, 3, 32, 32, device="cuda"),
                     torch.randint(0, 10, (batch,), device="cuda")) for _ in range(4)]
            res["resident_ms_by_width"][w] = timed(build(w, batch, n), (data[i % 4] for i in range(10**9)),
                                                   max(steps // 4, 20), blocks=1)[0]
        print(json.dumps(res))
        return
    step = build(width, batch, n)
    if mode == "resident":
        data = [(torch.randn(batch, 3, 32, 32, device="cuda"), torch.randint(0, 10, (batch,), device="cuda"))
                for _ in range(4)]
        batches = (data[i % 4] for i in range(10**9))
    else:
        loader = torch.utils.data.DataLoader(Batches(batch, n), batch_size=None, num_workers=workers,
                                             pin_memory=mode == "standard", persistent_workers=True,
                                             prefetch_factor=4)
        if mode == "standard":
            batches = ((x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)) for x, y in loader)
        else:
            pf = kitsune.prefetch(loader, depth=2)
            batches = iter(pf)
    res["ms_per_step"], res["blocks"] = timed(step, batches, steps)
    if mode == "kitsune":
        s = kitsune.pinned.stats()
        res["pinned"] = {"mapped_bytes_peak": s["mapped_bytes.peak"], "requested_bytes_peak": s["requested_bytes.peak"],
                         "pins": s["chunks.allocated"], "allocs": s["num_allocs"], "wait_s": pf.stats["wait_s"]}
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--child", choices=["probe", "resident", "standard", "kitsune"])
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.batch, a.width, a.steps, a.workers)
    import torch
    if not torch.cuda.is_available():
        sys.exit("prefetch_train needs a CUDA GPU")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"))
    env.setdefault("KITSUNE_LIBRARY", os.path.join(repo, "build", "libkitsune.so"))

    def run(mode, width):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--batch", str(a.batch),
               "--width", str(width), "--steps", str(a.steps), "--workers", str(a.workers)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"{mode} failed:\n{r.stdout}{r.stderr}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    probe = run("probe", a.width)
    copy = probe["copy_ms"]
    by_w = {int(k): v for k, v in probe["resident_ms_by_width"].items()}
    need = max(copy, 1.25 * probe["loader_ms"])
    width = a.width or next((w for w in sorted(by_w) if by_w[w] >= need), max(by_w))
    print(f"batch {a.batch} ({probe['batch_bytes'] / 1e6:.1f} MB): copy {copy:.3f} ms from pinned memory; "
          f"loader alone {probe['loader_ms']:.3f} ms/batch; resident step by width "
          f"{ {w: round(t, 3) for w, t in by_w.items()} }; width {width}", flush=True)
    res = {"bench": "prefetch_train", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "commit": os.environ.get("KT_COMMIT", "?"), "batch": a.batch, "width": width, "steps": a.steps,
           "workers": a.workers, "copy_ms": copy, "loader_ms": probe["loader_ms"], "batch_bytes": probe["batch_bytes"],
           "resident_ms_by_width": by_w, "modes": {}}
    for mode in ("resident", "standard", "kitsune"):
        r = run(mode, width)
        res["modes"][mode] = r
        line = f"{mode:9s} {r['ms_per_step']:7.3f} ms/step (blocks {', '.join(f'{b:.3f}' for b in r['blocks'])})"
        if mode != "resident":
            exposed = r["ms_per_step"] - res["modes"]["resident"]["ms_per_step"]
            r["copy_hidden"] = 1 - exposed / copy
            line += f"  exposed {exposed:+.3f} ms  copy hidden {100 * r['copy_hidden']:.0f}%"
        print(line, flush=True)
    k = res["modes"]["kitsune"]
    print(f"kitsune pinned pool: peak mapped {k['pinned']['mapped_bytes_peak'] / 1e6:.1f} MB for peak requested "
          f"{k['pinned']['requested_bytes_peak'] / 1e6:.1f} MB; {k['pinned']['pins']} pins for "
          f"{k['pinned']['allocs']} allocations; consumer waited {k['pinned']['wait_s']:.3f} s")
    print(f"kitsune / standard step time: {k['ms_per_step'] / res['modes']['standard']['ms_per_step']:.3f}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "prefetch_train.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
