#!/usr/bin/env bash
# Builds build/libkitsune_torch.so (python/kitsune/csrc/**/*.cpp) against the
# installed torch: its headers, its libraries and its C++ ABI. Without torch it
# says so and builds nothing (the C core and its tests do not need torch).
#
# Each .cpp compiles to $build/obj/python/kitsune/csrc/<path>.o, in parallel (one job
# a core), again only when it or a header of ours it includes (csrc, kitsune/*.h) is
# newer than its object, or the compile command changed (another torch, compiler or
# ABI: kept in $build/obj/python/kitsune/csrc/flags). The files that include
# common.h (the op families, autocast.cpp) start from a precompiled torch_headers.h:
# parsed, those headers cost each of them about 16 s of CPU; loaded, about 4. The
# headers are precompiled while the files that do not need them compile.
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
src=python/kitsune/csrc
obj="$build/obj/$src"
cuda_home=$(command -v nvcc >/dev/null && dirname "$(dirname "$(command -v nvcc)")" || echo /usr/local/cuda)
# The bridge runs on the libstdc++ the Python process has loaded (the system one,
# which torch's wheel uses), so it is built by the system g++, not by $CXX: a newer
# toolchain's inline libstdc++ code crashed on the older runtime (GPU machine, where
# CXX=/opt/gcc/bin/g++). KITSUNE_CXX overrides.
cxx=${KITSUNE_CXX:-g++}
# torch's headers are system headers (-isystem, as torch.utils.cpp_extension has
# them): a precompiled header loses the diagnostic pragmas they wrap some templates
# in (GCC), which then warn in every file that uses it.
flags=(-std=c++17 -O2 -g -fPIC -fvisibility=hidden -Wall -Wno-unused-parameter -D_GLIBCXX_USE_CXX11_ABI="$abi"
       -Iallocator/include -Ischeduler/include -Ifusion/include -isystem "$troot/include"
       -isystem "$troot/include/torch/csrc/api/include" -I"$cuda_home/include")

mkdir -p "$obj"
stamp="$obj/flags"
want="$cxx $($cxx --version | head -1) torch $tver $troot ${flags[*]}"
all_stale=0
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then all_stale=1; fi
# The newest header a source may include (ours and the C core's).
newest_header=$(find "$src" allocator/include scheduler/include fusion/include -name '*.h' -printf '%T@ %p\n' |
                sort -n | tail -1 | cut -d' ' -f2-)

# The precompiled header: a wrapper in the build tree that includes torch_headers.h,
# compiled beside it; -include of the wrapper uses the .gch (or, were it unusable,
# the wrapper's text: slower, same result; -Winvalid-pch says so).
pch="$obj/pch/torch_headers.h"
mkdir -p "$(dirname "$pch")"
wrapper="#include \"$PWD/$src/torch_headers.h\""
[ "$(cat "$pch" 2>/dev/null)" = "$wrapper" ] || echo "$wrapper" >"$pch"
uses_pch() { grep -q '^#include "\(\.\./\)*common.h"' "$1"; }

# Whether object $2 must be made again from source $1: no object yet, another compile
# command, or a newer file among those it was made from (its .d, which the compiler
# writes: the source and our headers it includes, not torch's; without one, any
# header here or in kitsune/).
stale() {
  local f=$1 o=$2 d="${2%.o}.d" dep
  if [ "$all_stale" = 1 ] || [ ! -f "$o" ] || [ "$f" -nt "$o" ]; then return 0; fi
  if [ ! -f "$d" ]; then [ "$newest_header" -nt "$o" ]; return; fi
  for dep in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$d"); do
    if [ ! -e "$dep" ] || [ "$dep" -nt "$o" ]; then return 0; fi
  done
  return 1
}
pch_stale=0
if [ "$all_stale" = 1 ] || [ ! -f "$pch.gch" ] || [ "$src/torch_headers.h" -nt "$pch.gch" ] || [ "$pch" -nt "$pch.gch" ]; then
  pch_stale=1
fi

light=() heavy=() objs=()
while IFS= read -r f; do
  o="$obj/${f#"$src"/}"
  objs+=("${o%.cpp}.o")
done < <(find "$src" -name '*.cpp' | sort)
while IFS= read -r f; do   # what to compile, largest first (the longest jobs start first)
  o="$obj/${f#"$src"/}"
  o="${o%.cpp}.o"
  if uses_pch "$f"; then   # a file's .d leaves the precompiled header out
    if [ "$pch_stale" = 1 ] || [ "$pch.gch" -nt "$o" ] || stale "$f" "$o"; then heavy+=("$f"); fi
  elif stale "$f" "$o"; then
    light+=("$f")
  fi
done < <(find "$src" -name '*.cpp' -printf '%s %p\n' | sort -rn | cut -d' ' -f2-)
first=("${light[@]}")
if [ ${#heavy[@]} -gt 0 ] && [ "$pch_stale" = 1 ]; then first=(PCH "${light[@]}"); fi

compile() {   # one job: a source file, or PCH for the precompiled header
  local f=$1 o
  eval "$flags_decl"
  if [ "$f" = PCH ]; then
    echo "  PCH   $src/torch_headers.h"
    "$cxx" "${flags[@]}" -x c++-header "$pch" -o "$pch.gch.tmp" || return
    mv "$pch.gch.tmp" "$pch.gch"
    return
  fi
  o="$obj/${f#"$src"/}"
  o="${o%.cpp}.o"
  mkdir -p "$(dirname "$o")"
  echo "  CXX   $f"
  if uses_pch "$f"; then
    "$cxx" "${flags[@]}" -MMD -MF "${o%.o}.d" -Winvalid-pch -include "$pch" -c "$f" -o "$o.tmp" || return
  else
    "$cxx" "${flags[@]}" -MMD -MF "${o%.o}.d" -c "$f" -o "$o.tmp" || return
  fi
  mv "$o.tmp" "$o"
}
flags_decl=$(declare -p flags)
export -f compile uses_pch
export cxx src obj pch flags_decl
jobs=$(nproc 2>/dev/null || echo 2)
run() {   # compiles its arguments, a job a core; fails when any fails
  [ $# -gt 0 ] || return 0
  printf '%s\n' "$@" | xargs -d '\n' -P "$jobs" -I{} bash -c 'compile "$1"' _ {}
}

links="$obj/objects"   # what the library was last linked from
if [ ${#first[@]} -gt 0 ] || [ ${#heavy[@]} -gt 0 ]; then
  echo "bridge: building against torch $tver ($troot) with $($cxx --version | head -1)"
  run "${first[@]}"   # the precompiled header beside the files that need none
  run "${heavy[@]}"
  echo "$want" >"$stamp"
elif [ -f "$out" ] && [ ! "$build/libkitsune.so" -nt "$out" ] && [ -f "$links" ] &&
     [ "$(cat "$links")" = "${objs[*]}" ] && [ -z "$(find "$obj" -name '*.o' -newer "$out" | head -1)" ]; then
  exit 0   # up to date
fi
rm -f "$links"
"$cxx" -std=c++17 -O2 -g -fPIC -shared -fvisibility=hidden -Wall -Wno-unused-parameter \
  -D_GLIBCXX_USE_CXX11_ABI="$abi" -Iallocator/include -Ischeduler/include -Ifusion/include -I"$troot/include" \
  -I"$troot/include/torch/csrc/api/include" -I"$cuda_home/include" \
  "${objs[@]}" -o "$out" \
  -L"$build" -lkitsune -L"$troot/lib" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -Wl,-rpath,'$ORIGIN'
echo "${objs[*]}" >"$links"
