"""The options table: one getter, and docs/options.md lists every KITSUNE_* name the code reads."""
import glob
import os
import re

import pytest

from support import REPO

from kitsune import options

NAME = re.compile(r"\bKITSUNE_[A-Z0-9_]*[A-Z0-9]\b")


def _names_in(patterns):
    found = {}
    for pattern in patterns:
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
            with open(path, encoding="utf-8") as f:
                for name in NAME.findall(f.read()):
                    found.setdefault(name, os.path.relpath(path, REPO))
    return found


def _doc():
    with open(os.path.join(REPO, "docs", "options.md"), encoding="utf-8") as f:
        return f.read()


def test_docs_show_the_table_as_the_code_has_it():
    assert options.markdown() in _doc(), "docs/options.md is stale: paste `python -m kitsune options` into it"


def test_every_name_the_code_reads_is_documented():
    code = _names_in(["python/kitsune/**/*.py", "python/kitsune/csrc/**/*.cpp", "python/kitsune/csrc/**/*.h",
                      "allocator/**/*.c", "scheduler/**/*.c", "scheduler/**/*.cu", "fusion/**/*.cu",
                      "Makefile", "tools/*.sh", "tools/*.py", "setup.py"])
    doc = set(NAME.findall(_doc()))
    missing = {n: where for n, where in code.items() if n not in doc}
    assert not missing, f"KITSUNE_* names read by the code but not in docs/options.md: {missing}"


def test_the_bridge_reads_exactly_its_rows():
    bridge = set(_names_in(["python/kitsune/csrc/**/*.cpp", "python/kitsune/csrc/**/*.h"]))
    rows = {o.name for o in options.OPTIONS if o.read_by == "bridge"}
    assert bridge == rows, f"csrc reads {sorted(bridge - rows)} without a row; rows never read: {sorted(rows - bridge)}"


def test_python_reads_only_rows_of_the_table():
    python = set(_names_in(["python/kitsune/**/*.py"]))
    rows = {o.name for o in options.OPTIONS}
    assert python <= rows, f"python/kitsune names {sorted(python - rows)} that are not options"


def test_get_parses_defaults_and_aliases(monkeypatch):
    monkeypatch.delenv("KITSUNE_STREAM_PRIORITY", raising=False)
    assert options.get("KITSUNE_STREAM_PRIORITY") is True
    monkeypatch.setenv("KITSUNE_STREAM_PRIORITY", "0")
    assert options.get("KITSUNE_STREAM_PRIORITY") is False
    monkeypatch.setenv("KITSUNE_STREAM_PRIORITY", "")
    assert options.get("KITSUNE_STREAM_PRIORITY") is True
    monkeypatch.setenv("KITSUNE_PLAN_WAITS", "1")
    assert options.get("KITSUNE_PLAN_WAITS") == "events"
    monkeypatch.setenv("KITSUNE_PLAN_WAITS", "timed")
    assert options.get("KITSUNE_PLAN_WAITS") == "timed"
    monkeypatch.setenv("KITSUNE_VMM", "1")
    assert options.get("KITSUNE_VMM") == 1
    monkeypatch.delenv("KITSUNE_VMM")
    assert options.get("KITSUNE_VMM") is None


@pytest.mark.parametrize("name, value, says", [
    ("KITSUNE_STREAM_PRIORITY", "yes", "KITSUNE_STREAM_PRIORITY must be 0 or 1, got 'yes'"),
    ("KITSUNE_CONV_GRADS", "sideways", "KITSUNE_CONV_GRADS must be one of auto, apart, together, late (or unset), "
                                       "got 'sideways'"),
    ("KITSUNE_VMM", "two", "KITSUNE_VMM must be an integer, got 'two'"),
])
def test_get_names_the_bad_value_and_what_is_accepted(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        options.get(name)
    assert str(e.value) == says


def test_unknown_option_is_refused():
    with pytest.raises(KeyError, match="KITSUNE_NOPE is not a Kitsune option"):
        options.get("KITSUNE_NOPE")
