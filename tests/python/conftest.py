"""pytest setup for the Python tests.

Run one test with, from the repository root:
    make test-python PYTEST_ARGS="tests/python/test_ops.py::test_add_relu_cpu_reference"
or, once `make test` has made the virtual environment:
    .venv/bin/python -m pytest -q tests/python/test_ops.py -k add_relu
Tests marked ``gpu`` (support.gpu) need a CUDA device: they skip without one, and
KITSUNE_REQUIRE_GPU=1 (set by `make gpu-test`) turns that skip into a run that fails."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support import HAS_GPU  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skips without one; make gpu-test requires it)")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU or os.environ.get("KITSUNE_REQUIRE_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
