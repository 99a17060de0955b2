#!/usr/bin/env bash
# Builds the private jemalloc that the pinned host pool (allocator/src/pinned.c) uses,
# into .deps/jemalloc (git-ignored; carried to the GPU machine with .deps).
#
# Why not Debian's libjemalloc2: it is built with the initial-exec TLS model
# (FLAGS STATIC_TLS, 2.6 KiB of TLS), so dlopen() of it - or of any library that
# needs it - fails with "cannot allocate memory in static TLS block", which is how
# Python loads libkitsune.so. We build Debian's jemalloc source package (fetched by
# `apt-get source`, which checks it against the signed archive index) with
#   --disable-initial-exec-tls      dlopen-safe
#   --with-jemalloc-prefix=kt_je_   never replaces the process's malloc
#   --with-private-namespace=...    internal symbols cannot clash with another jemalloc
#   --disable-cache-oblivious       no extra page per large block (pinned bytes are dear)
# and link its PIC archive into libkitsune.so, which exports only kt_* symbols.
#
# apt-get runs on a private state directory (.deps/apt) whose source list is the
# system's own archive entries turned into deb-src entries: nothing of the system's
# apt configuration changes, and no archive host is named here.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=5.3.0
sha=2db82d1e7119df3e71b7640219b6dfe84789bc0537983c3b7ac4f7189aecfeaa   # the upstream release tarball
dst=.deps/jemalloc
if [ -f "$dst/lib/libjemalloc_pic.a" ] && [ -f "$dst/include/jemalloc/jemalloc.h" ]; then exit 0; fi
mkdir -p .deps/src "$dst/lib" "$dst/include/jemalloc"
tarball=.deps/src/jemalloc_$ver.orig.tar.bz2
if [ ! -f "$tarball" ]; then
  command -v apt-get >/dev/null || { echo "jemalloc: apt-get is needed to fetch Debian's jemalloc source package" >&2; exit 1; }
  apt=$PWD/.deps/apt
  rm -rf "$apt"; mkdir -p "$apt/sources.list.d" "$apt/lists/partial" "$apt/cache/archives/partial"
  # the system's archive entries, as source entries (deb822 .sources files and one-line .list files)
  shopt -s nullglob
  for f in /etc/apt/sources.list.d/*.sources; do
    sed -E 's/^Types:.*/Types: deb-src/' "$f" > "$apt/sources.list.d/$(basename "$f")"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && sed -nE 's/^deb (.*)/deb-src \1/p' "$f" > "$apt/sources.list.d/$(basename "$f").list"
  done
  opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt/sources.list.d"
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Debug::NoLocking=1" -q)
  echo "jemalloc: fetching Debian's jemalloc $ver source package with apt-get source"
  apt-get "${opts[@]}" update >/dev/null
  [ "$(id -u)" -ne 0 ] || opts+=(-o "APT::Sandbox::User=root")   # the private dirs are not _apt's
  ( cd .deps/src && apt-get "${opts[@]}" source --download-only jemalloc >/dev/null )
  rm -rf "$apt" .deps/src/jemalloc_*.dsc .deps/src/jemalloc_*.debian.tar.*
  [ -f "$tarball" ] || { echo "jemalloc: apt-get source gave no $tarball (is jemalloc $ver in the archive?)" >&2; exit 1; }
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
