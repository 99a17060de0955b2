#!/usr/bin/env bash
# make demo: on a GPU, the allocator benchmark on the CUDA backend and training eager
# vs Kitsune (kitsune.optimize, KitsuneOptimizer, compile_step); without one,
# say so and replay a recorded allocation trace on the host fake backend.
set -uo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
export KT_COMMIT=${KT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
ngpu=$("$build/bench/alloc_bench" --probe 2>/dev/null || echo 0)
echo "Kitsune demo — allocator, training eager vs Kitsune (GPU), fused-op rewrites, stream plans"
if [ "${ngpu:-0}" -gt 0 ]; then
  echo "GPU found ($ngpu device(s)): allocator benchmark on the CUDA backend"
  echo
  KT_COMMIT=${KT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} "$build/bench/alloc_bench" --backend cuda --quick
  echo
  PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" KITSUNE_LIBRARY="${KITSUNE_LIBRARY:-$PWD/$build/libkitsune.so}" \
    "${PYTHON:-python3}" bench/demo_train.py --device cuda
else
  echo "No CUDA device is visible on this machine, so nothing runs on a GPU here."
  echo "Replaying a recorded allocation trace on the host fake backend instead"
  echo "(the same pool logic; addresses are handed out but never touched):"
  echo
  shopt -s nullglob
  traces=(bench/traces/*.csv)
  [ ${#traces[@]} -gt 0 ] || { echo "no trace in bench/traces/"; exit 1; }
  for t in "${traces[@]}"; do "$build/bench/alloc_replay" "$t" --repeat 3; done
  echo
  echo "Host-backend microbenchmark (CPU timings, not GPU numbers):"
  "$build/bench/alloc_bench" --backend fake --quick
fi
echo
echo "CPU parts (no GPU needed): what kitsune.optimize fuses in a small GPT-2-style LM,"
echo "and the stream plan of an Inception-style block and of an MLP:"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" KITSUNE_LIBRARY="${KITSUNE_LIBRARY:-$PWD/$build/libkitsune.so}"
py=${PYTHON:-python3}
"$py" - <<'PY'
import sys
sys.path.insert(0, "bench/kernels")
import kitsune, train_models as tm
print(kitsune.explain(tm.LM("gpt2", layers=2, d=64, h=4, vocab=1000, seq=64)))
PY
"$py" bench/sched_demo.py
