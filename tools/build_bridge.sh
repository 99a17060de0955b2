#!/usr/bin/env bash
# Builds build/libkitsune_torch.so (python/kitsune/csrc/bridge.cpp) against the
# installed torch: its headers, its libraries and its C++ ABI. Without torch it
# says so and builds nothing (the C core and its tests do not need torch).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
info=$($py - <<'PY' 2>/dev/null || true
import os, torch
root = os.path.dirname(torch.__file__)
print(root, int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__)
PY
)
if [ -z "$info" ]; then
  echo "bridge: torch is not importable by $py; skipping build/libkitsune_torch.so (make deps installs torch)"
  exit 0
fi
read -r troot abi tver <<<"$info"
out="$build/libkitsune_torch.so"
if [ -f "$out" ] && [ -z "$(find python/kitsune/csrc/bridge.cpp allocator/include scheduler/include fusion/include "$build/libkitsune.so" -newer "$out" 2>/dev/null | head -1)" ]; then
  exit 0   # up to date
fi
cuda_home=$(command -v nvcc >/dev/null && dirname "$(dirname "$(command -v nvcc)")" || echo /usr/local/cuda)
# The bridge runs on the libstdc++ the Python process has loaded (the system one,
# which torch's wheel uses), so it is built by the system g++, not by $CXX: a newer
# toolchain's inline libstdc++ code crashed on the older runtime (GPU machine, where
# CXX=/opt/gcc/bin/g++). KITSUNE_CXX overrides.
cxx=${KITSUNE_CXX:-g++}
echo "bridge: building against torch $tver ($troot) with $($cxx --version | head -1)"
$cxx -std=c++17 -O2 -g -fPIC -shared -fvisibility=hidden -Wall -Wno-unused-parameter \
  -D_GLIBCXX_USE_CXX11_ABI="$abi" -Iallocator/include -Ischeduler/include -Ifusion/include -I"$troot/include" \
  -I"$troot/include/torch/csrc/api/include" -I"$cuda_home/include" \
  python/kitsune/csrc/bridge.cpp -o "$out" \
  -L"$build" -lkitsune -L"$troot/lib" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -Wl,-rpath,'$ORIGIN'
