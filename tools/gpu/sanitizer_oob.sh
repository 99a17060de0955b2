#!/usr/bin/env bash
# compute-sanitizer must report a write planted just past a Kitsune block (NVTX
# sub-allocation regions) and nothing for the in-bounds control. Part of gpu-test.
set -uo pipefail
build=${1:-build}
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "sanitizer: compute-sanitizer not found: FAILED"; exit 1; }
bad=$("$cs" --tool memcheck --nvtx yes "$build/tests/oob_write" 2>&1)
good=$("$cs" --tool memcheck --nvtx yes "$build/tests/oob_write" --in-bounds 2>&1)
echo "$bad" | grep -E "Invalid __global__ write|ERROR SUMMARY" | head -3
echo "$good" | grep -E "ERROR SUMMARY" | head -1
if echo "$bad" | grep -q "Invalid __global__ write" && echo "$good" | grep -q "ERROR SUMMARY: 0 errors"; then
  echo "sanitizer: planted out-of-bounds write reported, control clean: 1 passed, 0 failed"
else
  echo "$bad" | tail -20
  echo "sanitizer: 0 passed, 1 failed"
  exit 1
fi
