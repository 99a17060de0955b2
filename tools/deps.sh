#!/usr/bin/env bash
# make deps: installs what the build and the tests need. Idempotent: a second run
# installs nothing. Debian packages via apt-get (sudo when not root), Python via pip.
set -euo pipefail
cd "$(dirname "$0")/.."
apt_pkgs=()
have_hdr() { [ -f "/usr/include/$1" ] || [ -f ".deps/root/usr/include/$1" ]; }
have_hdr criterion/criterion.h || apt_pkgs+=(libcriterion-dev)
have_hdr jemalloc/jemalloc.h || apt_pkgs+=(libjemalloc-dev)
command -v gcc >/dev/null || apt_pkgs+=(gcc)
command -v make >/dev/null || apt_pkgs+=(make)
# the private jemalloc of the pinned pool is built from Debian's source package (tools/jemalloc.sh)
command -v bzip2 >/dev/null || apt_pkgs+=(bzip2)
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "deps: apt-get install ${apt_pkgs[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi
cuda_home=$(command -v nvcc >/dev/null && dirname "$(dirname "$(command -v nvcc)")" || echo /usr/local/cuda)
if [ ! -f "$cuda_home/include/cuda_runtime_api.h" ] || [ ! -f "$cuda_home/lib64/libcudart_static.a" ] || [ ! -x "$cuda_home/bin/nvcc" ]; then
  echo "deps: the CUDA toolkit (nvcc, headers, libcudart_static) is needed to build; not all found at $cuda_home." >&2
  echo "      install it (e.g. NVIDIA's cuda-toolkit package) and put nvcc on PATH." >&2
  exit 1
fi
bash tools/jemalloc.sh
py=${PYTHON:-python3}
$py -c "import pytest" 2>/dev/null || { echo "deps: pip install pytest"; $py -m pip install -q pytest; }
# torch: the version the GPU machine runs, so the bridge is built and tested against it
torch_version=${KITSUNE_TORCH_VERSION:-2.11.0}
$py -c "import torch, numpy" 2>/dev/null || { echo "deps: pip install torch==$torch_version numpy"; $py -m pip install -q "torch==$torch_version" numpy; }
# torchvision (the version built for that torch, without letting pip change torch):
# the FX tests rewrite ResNet-18/50 as torchvision ships them
$py -c "import torchvision" 2>/dev/null || { echo "deps: pip install torchvision==0.26.0 pillow";
  $py -m pip install -q --no-deps "torchvision==0.26.0" && $py -m pip install -q pillow; }
$py -c "import kitsune, os, sys; sys.exit(0 if os.path.realpath(kitsune.__file__).startswith(os.path.realpath('python')) else 1)" 2>/dev/null \
  || { echo "deps: pip install -e . (the kitsune package)"; $py -m pip install -q --no-deps -e .; }
echo "deps: ok"
