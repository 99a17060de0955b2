#!/usr/bin/env bash
# make bench: the C allocator benchmarks; JSON into bench/results/ (and $OUT when set).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
ngpu=$("$build/bench/alloc_bench" --probe 2>/dev/null || echo 0)
backend=fake; [ "${ngpu:-0}" -gt 0 ] && backend=cuda
out=${BENCH_OUT:-bench/results}
mkdir -p "$out"
export KT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
"$build/bench/alloc_bench" --backend "$backend" --json "$out/alloc_bench_$backend.json" \
  ${BENCH_TRACE:+--trace "$BENCH_TRACE"}
shopt -s nullglob
for t in bench/traces/*.csv ${BENCH_TRACE:-}; do
  name=$(basename "$t" .csv)
  "$build/bench/alloc_replay" "$t" --backend "$backend" --repeat 5 --json "$out/alloc_replay_${name}_$backend.json"
done
echo "results: $out/alloc_bench_$backend.json $out/alloc_replay_*_$backend.json"
