"""Builds Kitsune's native libraries with make and ships them inside the package.

``pip install .`` (or ``python -m build --wheel``) runs ``make lib bridge`` into
build/pip/: libkitsune.so (the C core and the CUDA kernels) and libkitsune_torch.so (the
PyTorch bridge, compiled against the torch that pip put in the build environment), and
copies both into the package as kitsune/lib/, where kitsune._native looks first. The
wheel is tagged for the platform. ``pip install -e .`` builds them in build/, where the
package finds them from the source tree.

Why setuptools with a build step rather than scikit-build-core or meson-python: the
native build is a Makefile (C, CUDA through nvcc, C++ against torch's headers) that CI
and the GPU machine run as it is; a second build description of the same libraries
would drift from it. The build needs what `make` needs: gcc, g++, make, the CUDA toolkit
(nvcc) and apt-get for the pinned pool's jemalloc source (tools/jemalloc.sh).
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
LIBS = ("libkitsune.so", "libkitsune_torch.so")


def _make(build_dir):
    """make lib bridge into build_dir with this interpreter's torch; the built libraries."""
    cmd = ["make", f"-j{os.cpu_count() or 2}", f"BUILD={build_dir}", f"PYTHON={sys.executable}", "lib", "bridge"]
    print("kitsune: " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)
    paths = [os.path.join(ROOT, build_dir, lib) for lib in LIBS]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"kitsune: the build made no {', '.join(missing)}; the bridge needs torch importable "
                           f"by {sys.executable} (see the make output above)")
    return paths


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            _make("build")   # the source tree's package finds build/ (kitsune._native)
            return
        dst = os.path.join(self.build_lib, "kitsune", "lib")
        os.makedirs(dst, exist_ok=True)
        for path in _make(os.path.join("build", "pip")):
            out = shutil.copy2(path, dst)
            # debug info is most of the bridge's size (each op file repeats torch's); a
            # debugger can use the build tree's copy
            if shutil.which("strip"):
                subprocess.check_call(["strip", "--strip-debug", out])


class BinaryDistribution(Distribution):
    """The package carries native libraries: a platform wheel, not a pure-Python one."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution)
