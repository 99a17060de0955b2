#!/usr/bin/env bash
# Builds the private jemalloc that the pinned host pool (allocator/src/pinned.c) uses,
# into .deps/jemalloc (git-ignored; carried to the GPU machine with .deps).
#
# Why not Debian's libjemalloc2: it is built with the initial-exec TLS model
# (FLAGS STATIC_TLS, 2.6 KiB of TLS), so dlopen() of it - or of any library that
# needs it - fails with "cannot allocate memory in static TLS block", which is how
# Python loads libkitsune.so. We build the same upstream release (the Debian orig
# tarball, checked against the .dsc's SHA-256) with
#   --disable-initial-exec-tls      dlopen-safe
#   --with-jemalloc-prefix=kt_je_   never replaces the process's malloc
#   --with-private-namespace=...    internal symbols cannot clash with another jemalloc
#   --disable-cache-oblivious       no extra page per large block (pinned bytes are dear)
# and link its PIC archive into libkitsune.so, which exports only kt_* symbols.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=5.3.0
sha=2db82d1e7119df3e71b7640219b6dfe84789bc0537983c3b7ac4f7189aecfeaa
dst=.deps/jemalloc
if [ -f "$dst/lib/libjemalloc_pic.a" ] && [ -f "$dst/include/jemalloc/jemalloc.h" ]; then exit 0; fi
mkdir -p .deps/src "$dst/lib" "$dst/include/jemalloc"
tarball=.deps/src/jemalloc_$ver.orig.tar.bz2
if [ ! -f "$tarball" ]; then
  echo "jemalloc: downloading jemalloc $ver (Debian orig tarball)"
  curl -sSfL --retry 3 -o "$tarball.part" "http://deb.debian.org/debian/pool/main/j/jemalloc/jemalloc_$ver.orig.tar.bz2"
  mv "$tarball.part" "$tarball"
fi
echo "$sha  $tarball" | sha256sum -c --quiet - || { echo "jemalloc: checksum mismatch for $tarball" >&2; rm -f "$tarball"; exit 1; }
work=.deps/src/jemalloc-$ver
rm -rf "$work"; tar -xjf "$tarball" -C .deps/src
echo "jemalloc: configuring and building (about a minute)"
( cd "$work" &&
  ./configure --with-jemalloc-prefix=kt_je_ --with-private-namespace=kt_je_int_ \
    --disable-initial-exec-tls --disable-cache-oblivious --disable-cxx --disable-shared --disable-doc --disable-stats \
    --with-version=$ver-0-g0000000000000000000000000000000000000000 >configure.log 2>&1 &&
  make -j"$(nproc)" lib/libjemalloc_pic.a >make.log 2>&1 ) ||
  { echo "jemalloc: build failed; see $work/configure.log and $work/make.log" >&2; exit 1; }
cp "$work/lib/libjemalloc_pic.a" "$dst/lib/"
strip --strip-debug "$dst/lib/libjemalloc_pic.a"   # 39 MB -> ~1 MB; it travels to the GPU machine
cp "$work/include/jemalloc/jemalloc.h" "$dst/include/jemalloc/"
rm -rf "$work"
echo "jemalloc: built $dst/lib/libjemalloc_pic.a"
