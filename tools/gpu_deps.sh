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
echo "gpu-deps: unpacked into .deps/root ($(du -sh .deps | cut -f1)); carry .deps"
