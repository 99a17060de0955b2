#!/usr/bin/env bash
# make deps: what the build, the tests and the demo need. Idempotent: a second run
# installs nothing. It says what it installs before it does:
#   - Debian packages with apt-get (sudo when not root): Criterion, bzip2;
#   - the pinned pool's private jemalloc, built from Debian's source (tools/jemalloc.sh);
#   - a virtual environment (default .venv, made with --system-site-packages so that a
#     torch the system already has is used, not downloaded again) holding pytest, torch,
#     torchvision, transformers, timm and Kitsune itself in editable mode (pip install -e .,
#     whose build step runs make lib bridge). Nothing is pip-installed into the system Python.
# usage: tools/deps.sh [VENV]   (PYTHON: the interpreter the venv is made from)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
apt_pkgs=()
have_hdr() { [ -f "/usr/include/$1" ] || [ -f ".deps/root/usr/include/$1" ]; }
have_hdr criterion/criterion.h || apt_pkgs+=(libcriterion-dev)
command -v gcc >/dev/null || apt_pkgs+=(gcc)
command -v g++ >/dev/null || apt_pkgs+=(g++)
command -v make >/dev/null || apt_pkgs+=(make)
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

base=${PYTHON:-python3}
py=$venv/bin/python
if [ ! -x "$py" ]; then
  echo "deps: $base -m venv --system-site-packages $venv (the tests' Python packages go there)"
  "$base" -m venv --system-site-packages "$venv" || {
    echo "deps: could not make a virtual environment with $base; on Debian or Ubuntu: apt-get install python3-venv" >&2
    exit 1; }
fi
have() { "$py" -c "import $1" 2>/dev/null; }
pip_install() { echo "deps: pip install $* (into $venv)"; "$py" -m pip install -q --disable-pip-version-check "$@"; }
have pytest || pip_install pytest
# torch: the version the GPU machine runs, so the bridge is built and tested against it
torch_version=${KITSUNE_TORCH_VERSION:-2.11.0}
{ have torch && have numpy; } || pip_install "torch==$torch_version" numpy
# torchvision (built for that torch; pip may not change torch): the FX tests rewrite
# torchvision's ResNets
have torchvision || { pip_install --no-deps "torchvision==0.26.0"; have PIL || pip_install pillow; }
# transformers and timm, pinned (tests/python/test_zoo.py builds their models from configs, offline):
# transformers needs no torch of its own; timm requires torch and torchvision, which pip may not
# change, so it goes in with --no-deps and its other needs by name
have transformers || pip_install "transformers==5.17.0"
have timm || { pip_install --no-deps "timm==1.0.31"; pip_install pyyaml "huggingface_hub>=1.5,<2" safetensors; }
# accelerate: Hugging Face's Trainer needs it (tests/python/test_training_loops.py); --no-deps
# for the same reason as timm
have accelerate || { pip_install --no-deps "accelerate==1.12.0"; pip_install psutil pyyaml; }
# Kitsune itself, editable, from this checkout: its torch.compile backend is an entry point
"$py" - "$PWD" <<'PY' 2>/dev/null || {
import importlib.metadata as m, json, os, sys
d = m.distribution("kitsune")
url = json.loads(d.read_text("direct_url.json") or "{}").get("url", "")
sys.exit(0 if os.path.realpath(url.removeprefix("file://")) == os.path.realpath(sys.argv[1]) else 1)
PY
  "$py" -c "import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" 2>/dev/null ||
    pip_install "setuptools>=64" wheel
  echo "deps: pip install -e . (into $venv; its build step runs make lib bridge, a few minutes on a fresh clone)"
  "$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . ; }
echo "deps: ok ($py)"
