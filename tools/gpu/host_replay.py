"""Host time of one replayed training step, Kitsune's compile_step against the stock
whole-step graph (bench/models.py's recipes), and where Kitsune's goes:

    python tools/gpu/host_replay.py mlp lenet

Per model and recipe: the wall time of 400 calls (us a call; the GPU runs behind, so
for a small model this is what bounds the step), then cProfile over 400 more calls,
the 14 entries with the most time of their own. cProfile's per-call cost inflates
Python functions, not the C calls inside them: read the list as an order, the first
line as the measurement. tools/gpu/gpu_run.sh runs it as part "host" (to $OUT/host.log).
"""
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_graph import warmed  # noqa: E402


def main():
    torch.backends.cudnn.benchmark = True
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name in sys.argv[1:] or ["mlp"]:
        for recipe in ("stock_graph", "kitsune"):
            step, model, data = warmed(name, recipe)
            torch.cuda.synchronize()
            n = 400
            t0 = time.perf_counter()
            for i in range(n):
                step(*data[i % len(data)])
            host = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for i in range(n):
                step(*data[i % len(data)])
            prof.disable()
            torch.cuda.synchronize()
            print(f"== {name} {recipe}: host {host:.1f} us a call")
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:14]
            for (file, line, fn), (_, calls, tt, ct, _) in rows:
                where = f"{os.path.basename(file)}:{line}" if line else file
                print(f"  {tt / n * 1e6:7.2f} us own {ct / n * 1e6:7.2f} us cum  {calls / n:5.1f}x  {fn} ({where})")
            del step, model
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
