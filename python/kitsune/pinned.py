"""Pinned (page-locked) host memory from Kitsune's pool.

``empty(shape, dtype)`` returns a CPU tensor whose memory comes from a jemalloc
arena over pinned chunks (allocator/src/pinned.c): requests get jemalloc's fine
size classes instead of the power-of-two rounding of PyTorch's host allocator, and
the memory goes back to the pool when the tensor dies. ``tensor.is_pinned()`` is
True and ``.to("cuda", non_blocking=True)`` copies asynchronously from it.

Reuse contract: a block is handed out again as soon as its tensor dies, unless
:func:`record_stream` declared a stream that uses it; then it waits until the work
queued on that stream when the tensor died has finished. Call ``record_stream``
after issuing an asynchronous copy from (or into) the tensor if the tensor may die
before the copy completes. :func:`kitsune.prefetch` does this for you.
"""
import ctypes

from . import _native
from ._native import check

_STATS = ("requested_bytes", "allocated_bytes", "mapped_bytes", "allocations", "chunks")
_COUNTERS = ("num_allocs", "num_frees", "num_failed_pins", "num_pending_frees", "pending_now", "num_release_on_grow")


class _Stats(ctypes.Structure):
    _fields_ = [(name, _native.Stat) for name in _STATS] + [(name, ctypes.c_uint64) for name in _COUNTERS]


_declared = False
_host_memory = False


def _bridge():
    global _declared
    b = _native.bridge()
    if not _declared:
        b.kt_bridge_pinned_use_host_memory.restype, b.kt_bridge_pinned_use_host_memory.argtypes = ctypes.c_int, []
        b.kt_bridge_pinned_stats.restype, b.kt_bridge_pinned_stats.argtypes = ctypes.c_int, [ctypes.POINTER(_Stats)]
        b.kt_bridge_pinned_trim.restype, b.kt_bridge_pinned_trim.argtypes = ctypes.c_int, []
        b.kt_bridge_pinned_reset_peak.restype, b.kt_bridge_pinned_reset_peak.argtypes = None, []
        b.kt_bridge_pinned_record_stream.restype = ctypes.c_int
        b.kt_bridge_pinned_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        _declared = True
    return b


def empty(shape, dtype=None):
    """A CPU tensor of ``shape`` and ``dtype`` (default: torch's default dtype) in
    pinned memory from Kitsune's pool; uninitialised, like ``torch.empty``.

    Raises ``torch.OutOfMemoryError`` when the memory cannot be pinned, and
    RuntimeError when no CUDA device is visible."""
    import torch
    _bridge()   # loads the bridge, which registers torch.ops.kitsune.pinned_empty
    if not _host_memory and not torch.cuda.is_available():
        raise RuntimeError("kitsune.pinned: page-locked memory needs a CUDA device, and none is visible "
                           "(torch.cuda.is_available() is False)")
    if not _host_memory and not torch.cuda.is_initialized():
        # Tensor.is_pinned() answers False until torch has initialised CUDA (as
        # pin_memory=True would); so kitsune.allocator.install() must come first.
        torch.cuda.init()
    if isinstance(shape, int):
        shape = (shape,)
    return torch.ops.kitsune.pinned_empty(list(shape), dtype or torch.get_default_dtype())


def record_stream(tensor, stream):
    """Declares that work queued on ``stream`` (a ``torch.cuda.Stream``) uses
    ``tensor``'s pinned block: when the tensor dies, the block is not reused until
    that work has finished. ``tensor`` must come from :func:`empty` (views too)."""
    b = _bridge()
    ptr = tensor.untyped_storage().data_ptr()
    if not ptr:
        return   # an empty tensor has no block
    st = b.kt_bridge_pinned_record_stream(ptr, stream.device.index or 0, stream.cuda_stream)
    if st == _native.ERR_INVALID:
        raise ValueError("kitsune.pinned.record_stream: the tensor's memory is not a live block of "
                         "Kitsune's pinned pool (make it with kitsune.pinned.empty)")
    check(st, "kitsune.pinned.record_stream")


def stats():
    """The pool's numbers as a dict: ``<stat>.{current,peak,allocated,freed}`` for
    requested_bytes (what callers asked for), allocated_bytes (jemalloc's size
    classes), mapped_bytes (pinned from the driver), allocations and chunks, plus
    counters. All zero before the first :func:`empty`."""
    s = _Stats()
    st = _bridge().kt_bridge_pinned_stats(ctypes.byref(s))
    if st not in (_native.OK, _native.ERR_UNAVAILABLE):
        check(st, "kitsune.pinned.stats")
    out = {}
    for name in _STATS:
        v = getattr(s, name)
        for k in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{k}"] = getattr(v, k)
    for name in _COUNTERS:
        out[name] = getattr(s, name)
    return out


def reset_peak_stats():
    """Peak := current for every stat."""
    _bridge().kt_bridge_pinned_reset_peak()


def trim():
    """Gives wholly idle pinned chunks back to the driver."""
    check(_bridge().kt_bridge_pinned_trim(), "kitsune.pinned.trim")


def _use_host_memory():
    """Tests only: back the pool with ordinary memory (the host fake backend), so
    the pool's Python path runs on machines without a GPU. Must precede any use."""
    global _host_memory
    if _bridge().kt_bridge_pinned_use_host_memory() != 0:
        raise RuntimeError("kitsune.pinned: the pool already exists; _use_host_memory() must come first")
    _host_memory = True
