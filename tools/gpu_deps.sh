#!/usr/bin/env bash
# make gpu-deps: the GPU machine installs nothing, so download Criterion
# as Debian packages here and unpack them into .deps/root (git-ignored); carry .deps
# with the device call. The Makefile finds headers and libraries there by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(libcriterion3 libcriterion-dev libgit2-1.5 libnanomsg5 libmbedtls14 libmbedx509-1 libmbedcrypto7
      libhttp-parser2.9 libssh2-1)
mkdir -p .deps/debs .deps/root
if ls .deps/debs/libcriterion-dev_*.deb >/dev/null 2>&1; then echo "gpu-deps: already downloaded"; else
  (cd .deps/debs && apt-get download "${pkgs[@]}")
fi
for d in .deps/debs/*.deb; do dpkg -x "$d" .deps/root; done
bash tools/jemalloc.sh   # the pinned pool's private jemalloc, built here (no network there)
# RMM's pool for bench/alloc_churn.py (rmm_pool): wheels for the GPU machine's Python 3.12,
# installed there into /tmp/site by tools/gpu/gpu_run.sh's part "churn" (about 6 MB)
if ls .deps/wheels/rmm_cu13-*.whl >/dev/null 2>&1; then echo "gpu-deps: RMM wheels already downloaded"; else
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .deps/wheels \
    "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" "rapids-logger==0.3.*" \
    || echo "gpu-deps: RMM wheels not downloaded (bench/alloc_churn.py then skips rmm_pool)"
fi
echo "gpu-deps: unpacked into .deps/root ($(du -sh .deps | cut -f1)); carry .deps"
