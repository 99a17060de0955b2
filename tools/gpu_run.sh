#!/usr/bin/env bash
# One device call: facts, clean build, GPU tests, benchmarks, demo. Logs and JSON go
# to $OUT (the device tool brings them back). Run with .deps carried (make gpu-deps).
set -uo pipefail
OUT=${OUT:-/tmp/kt_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  echo "== machine =="; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; command -v nvcc gcc; nvcc --version | tail -2; gcc --version | head -1
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
} 2>&1 | tee "$OUT/machine.txt"
make clean >/dev/null
echo "== build =="; make -j16 all 2>&1 | grep -E "error|warning" ; [ -f build/libkitsune.so ] || { echo BUILD FAILED; exit 1; }
echo "== gpu-test =="; make gpu-test 2>&1 | tee "$OUT/gpu_test.log" | grep -E "^==|Synthesis|C suites|SKIP|FAIL|Assert|Unexpected|rror"
echo "== python =="; make test-python 2>&1 | tail -3 | tee "$OUT/pytest.log"
KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 - <<'PY' 2>&1 | tee -a "$OUT/pytest.log"
import kitsune.allocator as ka
with ka.Pool(backend="cuda") as p:
    x = p.alloc(123456); p.free(x); print("python Pool on cuda:", p.stats()["allocated_bytes.all.peak"], "bytes peak")
PY
echo "== bench =="; BENCH_OUT="$OUT" BENCH_TRACE="$OUT/random_10k_4mib.csv" make bench 2>&1 | tee "$OUT/bench.log"
echo "== demo =="; make demo 2>&1 | tail -8
