"""Pinned host memory footprint: Kitsune's pinned pool vs PyTorch's host allocator.

    python bench/data/pinned_footprint.py [--out DIR] [--steps N]

The workload is the allocation pattern of a prefetch queue (depth 4) fed by batches
of random size: every step allocates one batch - images of a random batch size and
a random kind (ImageNet-like uint8 3x224x224 or CIFAR-like float32 3x32x32, batch
size uniform in [16, 512]) plus int64 labels - and frees the batch from four steps
before. The same draws for both allocators, each in its own process:
  torch    torch.empty(..., pin_memory=True), what DataLoader(pin_memory=True) pins
           through (Tensor.pin_memory allocates from the same caching host allocator)
  kitsune  kitsune.pinned.empty(...) (default: idle chunks released before growing)
  kitsune_keep_cache  the same with cached chunks kept and big idle extents carved
           for smaller requests (KITSUNE_PINNED_RELEASE_ON_GROW=0,
           KT_JE_MALLOC_CONF=lg_extent_max_active_fit:6): PyTorch's policy of never
           giving pinned memory back, on jemalloc's placement
Reported: peak pinned bytes held (torch: host_memory_stats allocated_bytes, sampled
after every allocation; kitsune: mapped_bytes peak), peak requested bytes (the sum
of live tensors' nbytes, tracked here), their ratio, the allocation time per batch
and the pinning calls (cudaHostAlloc) per batch.
With --host-memory, Kitsune's pool runs over ordinary memory (no GPU needed; the
placement logic is the same) and torch is skipped.
Writes pinned_footprint.json.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time


CONFIGS = {
    "torch": {},
    "kitsune": {},
    "kitsune_keep_cache": {"KITSUNE_PINNED_RELEASE_ON_GROW": "0", "KT_JE_MALLOC_CONF": "lg_extent_max_active_fit:6"},
}


def child(allocator, steps, host_memory):
    import random
    import torch
    rng = random.Random(1234)
    if not host_memory:
        torch.cuda.init()   # host_memory_stats() is empty until torch's CUDA is initialised
    kp = None
    if allocator.startswith("kitsune"):
        import kitsune
        kp = kitsune.pinned
        if host_memory:
            kp._use_host_memory()

    def held():
        if kp:
            return kp.stats()["mapped_bytes.current"]
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    def empty(shape, dtype):
        if kp:
            return kp.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    queue, live, peak_live, peak_held, alloc_s = [], 0, 0, 0, 0.0
    for _ in range(steps):
        b = rng.randint(16, 512)
        shape, dtype = ((b, 3, 224, 224), torch.uint8) if rng.random() < 0.5 else ((b, 3, 32, 32), torch.float32)
        t0 = time.perf_counter()
        batch = (empty(shape, dtype), empty((b,), torch.int64))
        alloc_s += time.perf_counter() - t0
        queue.append(batch)
        live += sum(t.numel() * t.element_size() for t in batch)
        peak_live = max(peak_live, live)
        peak_held = max(peak_held, held())
        if len(queue) > 4:
            old = queue.pop(0)
            live -= sum(t.numel() * t.element_size() for t in old)
            del old
    if kp:
        s = kp.stats()
        peak_held = max(peak_held, s["mapped_bytes.peak"])
        pins = s["chunks.allocated"]
    else:
        pins = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    print(json.dumps({"peak_requested": peak_live, "peak_pinned": peak_held, "ratio": peak_held / peak_live,
                      "alloc_ms_per_batch": 1e3 * alloc_s / steps, "pins_per_batch": pins / steps}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--host-memory", action="store_true")
    ap.add_argument("--child", choices=list(CONFIGS))
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.steps, a.host_memory)
    import torch
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"))
    env.setdefault("KITSUNE_LIBRARY", os.path.join(repo, "build", "libkitsune.so"))
    res = {"bench": "pinned_footprint", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "torch": torch.__version__, "commit": os.environ.get("KT_COMMIT", "?"), "steps": a.steps,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (host memory)",
           "host_memory": a.host_memory, "results": {}}
    for name, extra in CONFIGS.items():
        if a.host_memory and name == "torch":
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(a.steps)]
        if a.host_memory:
            cmd.append("--host-memory")
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **extra))
        if r.returncode != 0:
            sys.exit(f"{name} failed:\n{r.stdout}{r.stderr}")
        res["results"][name] = json.loads(r.stdout.strip().splitlines()[-1])
        x = res["results"][name]
        print(f"{name:18s} peak pinned {x['peak_pinned'] / 2**20:8.1f} MiB  peak requested "
              f"{x['peak_requested'] / 2**20:8.1f} MiB  ratio {x['ratio']:.3f}  "
              f"alloc {x['alloc_ms_per_batch']:.3f} ms/batch  pins {x['pins_per_batch']:.2f}/batch", flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "pinned_footprint" + ("_host" if a.host_memory else "") + ".json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
