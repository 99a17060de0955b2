"""Where compile_step's setup goes: cProfile over make('kitsune') and its first 3 steps.

usage: python3 tools/gpu/setup_profile.py MODEL [eager|stock|none]   (the warm-up recipe run first, same process)
cudnn.benchmark on unless KT_CUDNN_BENCHMARK=0 (TORCH_CUDNN_USE_HEURISTIC_MODE_B=1 for mode B).
Prints the setup seconds and the top functions by cumulative and own time.
"""
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import models as M  # noqa: E402

name, warm = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "none")
torch.backends.cudnn.benchmark = os.environ.get("KT_CUDNN_BENCHMARK", "1") != "0"
gen = torch.Generator().manual_seed(0)
torch.manual_seed(0)
base, loss_fn, data = M.build_spec(name, gen)
if warm != "none":
    row = M.run({"eager": "eager", "stock": "stock_graph"}[warm], base, loss_fn, data, 10)
    print(f"warm-up {warm}: setup {row['setup_s']:.2f} s")
model = M.copy.deepcopy(base)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
step, extra = M.make("kitsune", model, loss_fn)
for i in range(3):
    step(*data[i % len(data)])
torch.cuda.synchronize()
prof.disable()
print(f"{name} kitsune after {warm}: first 3 steps {time.perf_counter() - t0:.2f} s, "
      f"streams {extra.stats()['streams']}, conv_grads {extra.stats().get('conv_grads')}, "
      f"phases {extra.stats().get('setup_phases')}, cudnn.benchmark {torch.backends.cudnn.benchmark}")
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(70)
st.sort_stats("tottime").print_stats(25)
