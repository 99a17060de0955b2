"""Helpers the Python tests share (conftest.py holds the GPU marker's logic).

Tests that must start CUDA their own way (install() comes before CUDA initialises)
run their body in a fresh interpreter with :func:`run`, which sees the source tree's
package and the built library, wherever pytest itself imported kitsune from."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    HAS_GPU = torch.cuda.is_available()
except ImportError:
    HAS_GPU = False

# The one GPU marker: a test marked gpu skips without a CUDA device, unless
# KITSUNE_REQUIRE_GPU=1 (make gpu-test), where it runs and fails (conftest.py).
gpu = pytest.mark.gpu


def env():
    """The environment of a child interpreter: the source tree's package and library."""
    e = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    e.setdefault("KITSUNE_LIBRARY", os.path.join(REPO, "build", "libkitsune.so"))
    return e


def run(code, timeout=600, **extra_env):
    """Runs ``code`` (dedented) in a fresh interpreter; its stdout, or an assertion error
    with its output when it exits non-zero."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=dict(env(), **extra_env), timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout
