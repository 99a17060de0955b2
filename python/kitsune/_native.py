"""The one place that loads libkitsune.so and declares its C signatures."""
import ctypes
import os
import threading

from . import options

_lock = threading.Lock()
_lib = None

# kt_status codes (allocator/include/kitsune/status.h)
OK, ERR_INVALID, ERR_OOM, ERR_BACKEND, ERR_HOST_OOM, ERR_LIMIT, ERR_IO, ERR_UNAVAILABLE = range(8)


class KitsuneError(RuntimeError):
    """A Kitsune C call failed; ``status`` holds the kt_status code."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class KitsuneNotBuiltError(KitsuneError, ImportError):
    """libkitsune.so could not be found or loaded."""


class KitsuneOutOfMemoryError(KitsuneError, MemoryError):
    """The pool could not satisfy an allocation; the message holds the diagnosis."""


def _candidates():
    env = options.get("KITSUNE_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(here, "lib", "libkitsune.so"),
            os.path.normpath(os.path.join(here, "..", "..", "build", "libkitsune.so"))]


class OomInfo(ctypes.Structure):
    _fields_ = [("requested", ctypes.c_size_t), ("rounded", ctypes.c_size_t), ("live", ctypes.c_size_t),
                ("cached", ctypes.c_size_t), ("reserved", ctypes.c_size_t), ("limit", ctypes.c_size_t),
                ("largest_free", ctypes.c_size_t), ("device_free", ctypes.c_size_t),
                ("device_total", ctypes.c_size_t), ("hit_limit", ctypes.c_int), ("device", ctypes.c_int)]


class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("allocated", ctypes.c_int64), ("freed", ctypes.c_int64)]


NUM_CLASSES = 72


class Stats(ctypes.Structure):
    _fields_ = [("allocated_bytes", Stat), ("active_bytes", Stat), ("reserved_bytes", Stat),
                ("requested_bytes", Stat), ("allocations", Stat), ("segments", Stat),
                ("num_allocs", ctypes.c_uint64), ("num_frees", ctypes.c_uint64),
                ("num_alloc_retries", ctypes.c_uint64), ("num_ooms", ctypes.c_uint64),
                ("num_backend_reserves", ctypes.c_uint64), ("num_backend_releases", ctypes.c_uint64),
                ("num_large_allocs", ctypes.c_uint64), ("num_pending_frees", ctypes.c_uint64),
                ("class_allocs", ctypes.c_uint64 * NUM_CLASSES), ("class_live", ctypes.c_uint64 * NUM_CLASSES),
                ("memory_limit", ctypes.c_size_t), ("largest_free_block", ctypes.c_size_t),
                ("num_release_syncs", ctypes.c_uint64), ("vmm", ctypes.c_int)]


class PoolOptions(ctypes.Structure):
    _fields_ = [("device", ctypes.c_int), ("memory_limit", ctypes.c_size_t), ("track_lifetimes", ctypes.c_int),
                ("peak_slack", ctypes.c_size_t), ("release_on_grow", ctypes.c_int), ("vmm", ctypes.c_int),
                ("shared_segment", ctypes.c_size_t)]


class Sync(ctypes.Structure):
    _fields_ = [("after", ctypes.c_int32), ("before", ctypes.c_int32)]


class Schedule(ctypes.Structure):   # kt_schedule (scheduler/include/kitsune/sched.h)
    _fields_ = [("n_nodes", ctypes.c_int32), ("n_streams", ctypes.c_int32),
                ("stream", ctypes.POINTER(ctypes.c_int32)), ("order", ctypes.POINTER(ctypes.c_int32)),
                ("start", ctypes.POINTER(ctypes.c_double)), ("finish", ctypes.POINTER(ctypes.c_double)),
                ("makespan", ctypes.c_double), ("n_syncs", ctypes.c_int32), ("syncs", ctypes.POINTER(Sync))]


def _declare(lib):
    P, S, I, VP = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    sig = {
        "kt_status_str": (ctypes.c_char_p, [I]),
        "kt_pool_options_default": (None, [ctypes.POINTER(PoolOptions)]),
        "kt_pool_create": (I, [ctypes.POINTER(PoolOptions), P, ctypes.POINTER(P)]),
        "kt_pool_destroy": (None, [P]),
        "kt_alloc": (I, [P, S, VP, ctypes.POINTER(VP)]),
        "kt_free": (I, [P, VP, S, VP]),
        "kt_record_stream": (I, [P, VP, VP]),
        "kt_empty_cache": (I, [P]),
        "kt_set_memory_limit": (I, [P, S]),
        "kt_set_memory_fraction": (I, [P, ctypes.c_double]),
        "kt_get_memory_limit": (S, [P]),
        "kt_get_stats": (I, [P, ctypes.POINTER(Stats)]),
        "kt_reset_peak_stats": (None, [P]),
        "kt_last_oom": (ctypes.POINTER(OomInfo), []),
        "kt_format_oom": (I, [ctypes.POINTER(OomInfo), ctypes.c_char_p, S]),
        "kt_trace_start": (I, [P, ctypes.c_char_p]),
        "kt_trace_stop": (I, [P]),
        "kt_pool_validate": (I, [P]),
        "kt_fake_backend_create": (P, [S]),
        "kt_fake_backend_destroy": (None, [P]),
        "kt_cuda_backend": (P, []),
        "kt_cuda_device_count": (I, []),
        "kt_size_class": (I, [S]),
        "kt_class_size": (S, [I]),
        "kt_dag_create": (I, [ctypes.POINTER(P)]),
        "kt_dag_destroy": (None, [P]),
        "kt_dag_add_node": (I, [P, ctypes.c_double, ctypes.POINTER(ctypes.c_int32)]),
        "kt_dag_add_edge": (I, [P, ctypes.c_int32, ctypes.c_int32]),
        "kt_schedule_list": (I, [P, ctypes.c_int32, ctypes.POINTER(Schedule)]),
        "kt_schedule_free": (None, [ctypes.POINTER(Schedule)]),
        "kt_schedule_check": (I, [P, ctypes.POINTER(Schedule)]),
        "kt_graph_memsets_to_kernels": (I, [P, S, ctypes.POINTER(I)]),
        "kt_graph_capture_nodes": (I, [P, ctypes.POINTER(ctypes.c_uint64), S, ctypes.POINTER(S)]),
        "kt_graph_time_nodes": (I, [P, ctypes.POINTER(ctypes.c_uint64), S, P, I, P, ctypes.POINTER(ctypes.c_uint64),
                                    ctypes.POINTER(ctypes.c_int64), S, ctypes.POINTER(S)]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def native():
    """Returns the loaded libkitsune (ctypes.CDLL), loading it once.

    Raises KitsuneNotBuiltError naming every path tried and the fix."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if not os.path.exists(path):
                tried.append(f"{path} (missing)")
                continue
            try:
                _lib = _declare(ctypes.CDLL(path))
                return _lib
            except (OSError, AttributeError) as e:
                tried.append(f"{path} ({e})")
        raise KitsuneNotBuiltError(
            "libkitsune.so is not built or could not be loaded. Tried: " + "; ".join(tried)
            + ". Fix: install the package with `pip install .` from a Kitsune checkout (it builds and ships the "
            "library), or run `make` in the checkout (it builds build/libkitsune.so), or set KITSUNE_LIBRARY "
            "to the library's path.")


_bridge = None


def bridge():
    """Returns the loaded C++ bridge (build/libkitsune_torch.so), loading it once.

    It links against torch's libraries, so torch is imported first."""
    global _bridge
    if _bridge is not None:
        return _bridge
    import torch  # noqa: F401  (loads libc10/libtorch_cuda the bridge resolves against)
    lib = native()
    with _lock:
        if _bridge is not None:
            return _bridge
        env = options.get("KITSUNE_BRIDGE")
        path = env or os.path.join(os.path.dirname(library_path()), "libkitsune_torch.so")
        if not os.path.exists(path):
            raise KitsuneNotBuiltError(
                f"the Kitsune-PyTorch bridge is not built: {path} is missing. Fix: run `make bridge` "
                "(or `make`) in the Kitsune repository with torch installed, or set KITSUNE_BRIDGE.")
        try:
            b = ctypes.CDLL(path)
        except OSError as e:
            raise KitsuneNotBuiltError(f"the Kitsune-PyTorch bridge at {path} could not be loaded ({e}); "
                                       "rebuild it against the installed torch with `make bridge`") from e
        b.kt_bridge_install.restype, b.kt_bridge_install.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]
        b.kt_bridge_installed.restype, b.kt_bridge_installed.argtypes = ctypes.c_int, []
        b.kt_bridge_trace.restype, b.kt_bridge_trace.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]
        u64, i64, i64p = ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
        b.kt_bridge_blas_share.restype, b.kt_bridge_blas_share.argtypes = ctypes.c_int, [u64, u64, i64p]
        b.kt_bridge_blas_list.restype, b.kt_bridge_blas_list.argtypes = i64, [u64, i64p, i64]
        b.kt_bridge_blas_test_put.restype = ctypes.c_int
        b.kt_bridge_blas_test_put.argtypes = [ctypes.c_int, u64, u64, u64]
        b.kt_bridge_blas_test_frees.restype, b.kt_bridge_blas_test_frees.argtypes = i64, []
        b.kt_bridge_stream_create.restype = ctypes.c_int
        b.kt_bridge_stream_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(u64)]
        del lib
        _bridge = b
        return b


def library_path():
    """The path native() loaded, or None before a successful load."""
    return getattr(_lib, "_name", None)


def check(status, what):
    """Turns a kt_status into the matching Python exception."""
    if status == OK:
        return
    lib = native()
    text = lib.kt_status_str(status).decode()
    if status == ERR_OOM:
        info = lib.kt_last_oom()
        buf = ctypes.create_string_buffer(1024)
        lib.kt_format_oom(info, buf, len(buf))
        raise KitsuneOutOfMemoryError(buf.value.decode(), status)
    if status == ERR_INVALID:
        raise ValueError(f"{what}: {text}")
    raise KitsuneError(f"{what}: {text}", status)
