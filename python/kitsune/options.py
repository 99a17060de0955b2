"""Kitsune's run-time options: one table, read from ``KITSUNE_*`` environment variables.

Every option Kitsune reads is a row of :data:`OPTIONS`; Python code reads one through
:func:`get`, which parses and checks it on each call (tests and users may change the
environment between steps). The C++ bridge reads its rows through its own one getter
(python/kitsune/csrc/options.h), which lists the same names; a test checks that the two
agree and that docs/options.md shows this table (``python -m kitsune options`` prints it).
"""
import os
from dataclasses import dataclass

__all__ = ["Option", "OPTIONS", "get", "markdown"]


@dataclass(frozen=True)
class Option:
    name: str          # the environment variable
    kind: str          # "bool" (0/1), "int", "str", "path" or "choice"
    default: object    # what an unset or empty variable means (None: not set)
    meaning: str
    read_by: str = "python"   # "python", "bridge" (C++, when the allocator is installed), "loader"
    choices: tuple = ()       # for kind "choice": the accepted values, the default first
    aliases: tuple = ()       # (value, means) pairs accepted for compatibility


OPTIONS = (
    Option("KITSUNE_LIBRARY", "path", None,
           "path of libkitsune.so; unset: the copy inside the installed package, then build/ of a "
           "source checkout", read_by="loader"),
    Option("KITSUNE_BRIDGE", "path", None,
           "path of the PyTorch bridge (libkitsune_torch.so); unset: beside libkitsune.so", read_by="loader"),
    Option("KITSUNE_RELEASE_ON_GROW", "int", 2,
           "what a pool of the installed allocator gives back before it grows: 2 idle segments, and a VMM "
           "pool unmaps idle granules to follow its peak (one device sync then); 1 idle segments only, a VMM "
           "pool unmaps nothing (no backend call once warm, more memory held); 0 nothing", read_by="bridge"),
    Option("KITSUNE_VMM", "int", None,
           "1: the device's pool grows by mapping 2 MiB granules of one address range; 0: by segments; "
           "unset: VMM when the process sees one GPU", read_by="bridge"),
    Option("KITSUNE_PINNED_RELEASE_ON_GROW", "bool", 1,
           "before pinning a new chunk while idle pinned bytes come to half of it, unpin idle chunks "
           "(kitsune.pinned)", read_by="bridge"),
    Option("KITSUNE_CAPTURE_ORDER", "bool", 1,
           "0: capture plans share bytes only within a stream instead of wherever the captured graph "
           "orders the work", read_by="bridge"),
    Option("KITSUNE_CAPPLAN_LOG", "path", None,
           "a directory: each capture plan compile_step makes is also written there as "
           "capplan_<pid>_<n>.csv (tools/capplan_log.py reads it)", read_by="bridge"),
    Option("KITSUNE_SEGV_BACKTRACE", "bool", 0,
           "1: kitsune.allocator.install() sets a SIGSEGV handler that prints the native stack to stderr "
           "(tools/resolve_bt.py resolves it)", read_by="bridge"),
    Option("KITSUNE_CHAINS", "bool", 1,
           "Kitsune's Dynamo path groups the pointwise ATen ops between its patterns into "
           "kitsune.pointwise_chain calls, one launch each; 0: each runs as its own ATen kernel"),
    Option("KITSUNE_STREAM_PRIORITY", "bool", 1,
           "compile_step's capture stream and the branch streams run at the device's greatest priority; "
           "0: CUDA's default"),
    Option("KITSUNE_CONV_GRADS", "choice", "auto",
           "how a streamed model's bias-free convolutions run their two gradients in a capture: auto "
           "(compile_step times each way), apart, together, late", choices=("auto", "apart", "together", "late")),
    Option("KITSUNE_PLAN_WAITS", "choice", "events",
           "compile_step's memory plan: events (within the eager step's budget, waits chosen by recorded "
           "events), timed (waits chosen by node times measured in a replay), 0 (no budget, no waits)",
           choices=("events", "timed", "0"), aliases=(("1", "events"),)),
    Option("KITSUNE_GRAPH_MEMSETS", "choice", "kernels",
           "kernels: small memset nodes of a captured step become kernel nodes; keep: they stay memsets",
           choices=("kernels", "keep")),
    Option("KITSUNE_REQUIRE_GPU", "bool", 0,
           "1: the GPU tests fail instead of skipping when no CUDA device is visible (make gpu-test)"),
)

_BY_NAME = {o.name: o for o in OPTIONS}


def _parse(o, raw):
    if o.kind == "bool":
        if raw not in ("0", "1"):
            raise ValueError(f"{o.name} must be 0 or 1, got {raw!r}")
        return raw == "1"
    if o.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{o.name} must be an integer, got {raw!r}") from None
    if o.kind == "choice":
        raw = dict(o.aliases).get(raw, raw)
        if raw not in o.choices:
            raise ValueError(f"{o.name} must be one of {', '.join(o.choices)} (or unset), got {raw!r}")
    return raw


def get(name):
    """The value of option ``name`` now: parsed from the environment, or its default when
    unset or empty. ValueError names the variable, the value and what it accepts."""
    o = _BY_NAME.get(name)
    if o is None:
        raise KeyError(f"{name} is not a Kitsune option (kitsune.options.OPTIONS lists them)")
    raw = os.environ.get(name, "")
    if raw == "":
        return bool(o.default) if o.kind == "bool" else o.default
    return _parse(o, raw)


def markdown():
    """The table as docs/options.md shows it."""
    rows = ["| variable | type | default | read by | meaning |", "| --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        kind = o.kind if o.kind != "choice" else " \\| ".join(o.choices)
        default = "unset" if o.default is None else str(o.default)
        rows.append(f"| `{o.name}` | {kind} | {default} | {o.read_by} | {o.meaning} |")
    return "\n".join(rows) + "\n"
