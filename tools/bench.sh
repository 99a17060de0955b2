#!/usr/bin/env bash
# make bench: the C allocator benchmarks; JSON into bench/results/ (and $OUT when set).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
ngpu=$("$build/bench/alloc_bench" --probe 2>/dev/null || echo 0)
backend=fake; [ "${ngpu:-0}" -gt 0 ] && backend=cuda
out=${BENCH_OUT:-bench/results}
mkdir -p "$out"
export KT_COMMIT=${KT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
"$build/bench/alloc_bench" --backend "$backend" --json "$out/alloc_bench_$backend.json" \
  ${BENCH_TRACE:+--trace "$BENCH_TRACE"}
echo
echo "same pairs with exact peaks (peak_slack 0: one shared atomic per call):"
"$build/bench/alloc_bench" --backend "$backend" --pairs-only --peak-slack 0 --json "$out/alloc_bench_exact_$backend.json"
echo
"$build/bench/probe_costs" 0 1 0 8 | tee "$out/probe_costs_$backend.txt"
shopt -s nullglob
for t in bench/traces/*.csv ${BENCH_TRACE:-}; do
  name=$(basename "$t" .csv)
  "$build/bench/alloc_replay" "$t" --backend "$backend" --repeat 5 --json "$out/alloc_replay_${name}_$backend.json"
done
# host time of the memory planner's packing on captures compile_step recorded (bench/capplan_logs.c)
logs=(bench/traces/capplan/*.csv)
[ ${#logs[@]} -gt 0 ] && "$build/bench/capplan_logs" "${logs[@]}" | tee "$out/capplan_logs.txt"
echo "results: $out/alloc_bench_$backend.json $out/alloc_replay_*_$backend.json $out/capplan_logs.txt"
