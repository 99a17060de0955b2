"""Where a torch allocation's time goes: C++ timings through the bridge, no Python loop.

    python bench/alloc_torch_breakdown.py      (spawns one process per allocator)

Prints, per size: ns per allocate()+delete through torch's allocator interface
(native vs Kitsune) and ns per kt_alloc+kt_free pair on Kitsune's pool inside a
torch process."""
import ctypes
import json
import os
import subprocess
import sys

SIZES = [4096, 1 << 20, 64 << 20]


def child(kitsune):
    import torch
    import kitsune._native as n
    if kitsune:
        import kitsune.allocator
        kitsune.allocator.install()
    torch.cuda.init()
    b = n.bridge()
    b.kt_bridge_time_torch_allocate.restype = ctypes.c_double
    b.kt_bridge_time_torch_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int]
    b.kt_bridge_time_kt_pair.restype = ctypes.c_double
    b.kt_bridge_time_kt_pair.argtypes = [ctypes.c_size_t, ctypes.c_int]
    out = {"torch_allocate": {s: b.kt_bridge_time_torch_allocate(s, 200000) for s in SIZES}}
    if kitsune:
        out["kt_pair"] = {s: b.kt_bridge_time_kt_pair(s, 200000) for s in SIZES}
    print(json.dumps(out))


def main():
    if len(sys.argv) > 1:
        return child(sys.argv[1] == "kitsune")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(repo, "python"))
    res = {}
    for name in ("native", "kitsune"):
        r = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr)
        res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{'size':>10} {'native allocate+free':>22} {'kitsune allocate+free':>22} {'kt_alloc+kt_free':>18}  (ns)")
    for s in map(str, SIZES):
        print(f"{s:>10} {res['native']['torch_allocate'][s]:>22.1f} {res['kitsune']['torch_allocate'][s]:>22.1f} "
              f"{res['kitsune']['kt_pair'][s]:>18.1f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
