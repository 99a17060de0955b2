#!/usr/bin/env bash
# One device call: facts, clean build, GPU tests, benchmarks, demo. Everything is
# logged to $OUT/run.log; JSON results and the recorded trace also land in $OUT
# (the device tool brings back at most 8 files). Carry .deps (make gpu-deps).
set -uo pipefail
OUT=${OUT:-/tmp/kt_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1
echo "== machine =="; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"; nvcc --version | tail -1; gcc --version | head -1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "commit: ${KT_COMMIT:-?}"
make clean >/dev/null
echo "== build =="; make -j16 all 2>&1 | grep -E "error|warning"; [ -f build/libkitsune.so ] || { echo BUILD FAILED; exit 1; }
echo "== gpu-test =="; make gpu-test 2>&1 | grep -vE "^\[----\] *$|^\[RUN \]|^\[PASS\]"
echo "== python =="; make test-python 2>&1 | tail -2
KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 - <<'PY'
import kitsune.allocator as ka
with ka.Pool(backend="cuda") as p:
    x = p.alloc(123456); p.free(x); print("python Pool on cuda: peak", p.stats()["allocated_bytes.all.peak"], "bytes")
PY
echo "== bench =="; BENCH_OUT="$OUT" BENCH_TRACE="$OUT/random_10k_4mib.csv" make bench
echo "== demo =="; make demo
