"""Kitsune's memory pool from Python.

``install()`` makes Kitsune PyTorch's CUDA allocator (one call, before CUDA
initialises); ``torch.cuda.memory_stats()`` and friends then report Kitsune's
numbers and out-of-memory raises ``torch.OutOfMemoryError`` with a diagnosis.
``Pool`` drives the C pool directly, over the CUDA backend or the host fake backend
(which hands out addresses it never touches, so the pool logic runs anywhere).
"""
import contextlib
import ctypes

from . import _native
from ._native import check, native

_STATS = ("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes", "allocations", "segments")
_COUNTERS = ("num_allocs", "num_frees", "num_alloc_retries", "num_ooms", "num_backend_reserves",
             "num_backend_releases", "num_large_allocs", "num_pending_frees")


def install():
    """Makes Kitsune PyTorch's CUDA allocator, for every device, for the process.

    Call it first, before anything initialises CUDA (a CUDA tensor,
    ``torch.cuda.current_device()``, ``torch.cuda.init()``); ``torch.cuda.is_available()``
    is fine. Calling it again is a no-op. Raises RuntimeError with the reason and the
    fix when it cannot install (no GPU, CUDA already initialised, bridge not built)."""
    import torch
    if installed():
        return
    if not torch.cuda.is_available():
        raise RuntimeError("kitsune.allocator.install(): no CUDA device is visible "
                           "(torch.cuda.is_available() is False); Kitsune's allocator needs an NVIDIA GPU")
    if torch.cuda.is_initialized():
        raise RuntimeError("kitsune.allocator.install() must run before CUDA initialises, and CUDA is "
                           "already initialised in this process. Call it first thing: before any CUDA "
                           "tensor, torch.cuda.current_device(), torch.cuda.init() or a model's .cuda()")
    b = _native.bridge()
    err = ctypes.create_string_buffer(1024)
    if b.kt_bridge_install(err, len(err)) != 0:
        raise RuntimeError(f"kitsune.allocator.install() failed: {err.value.decode()}")


def installed():
    """True when Kitsune is PyTorch's CUDA allocator in this process."""
    b = _native._bridge
    return bool(b is not None and b.kt_bridge_installed())


@contextlib.contextmanager
def trace(path, device=0):
    """Records every allocation event of the installed allocator on ``device`` as CSV
    (thread,time_ns,action,ptr,size,stream) while the block runs. Replay the file with
    ``build/bench/alloc_replay PATH`` to measure it against the allocator offline."""
    if not installed():
        raise RuntimeError("kitsune.allocator.trace() records the installed allocator: call "
                           "kitsune.allocator.install() first (or use Pool.trace for a Pool)")
    b = _native.bridge()
    check(b.kt_bridge_trace(device, str(path).encode()), f"trace({str(path)!r}, device={device})")
    try:
        yield path
    finally:
        check(b.kt_bridge_trace(device, None), "trace stop")


def capture_info(device=0):
    """What Kitsune prepared for the last CUDA graph capture (or MemPool use) on
    ``device``, in bytes: ``emptied`` (what the last releasing ``empty_cache`` gave
    back, the warm-up's working memory when torch.cuda.graph emptied the cache),
    ``workspaces`` (the cuBLAS and cuBLASLt workspace bytes the most provided stream
    holds, less what the capture stream holds already: what the capture may
    allocate for them), ``asked`` (the
    range made ready: emptied x 1.25 + 20 MiB + workspaces), ``ready`` (the largest
    free range ready when the capture began) and ``status`` (0, or the kt_status of a
    preparation that could not run). All zero before the first capture."""
    return _device_values("capture_info", ("emptied", "workspaces", "asked", "ready", "status"), device)


def _device_values(what, keys, device):
    """kt_bridge_<what>(device, int64[len(keys)]) of the installed allocator, by name."""
    if not installed():
        raise RuntimeError(f"kitsune.allocator.{what}() describes the installed allocator: call "
                           "kitsune.allocator.install() first")
    fn = getattr(_native.bridge(), f"kt_bridge_{what}")
    out = (ctypes.c_int64 * len(keys))()
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    check(fn(device, out), f"{what}(device={device})")
    return dict(zip(keys, list(out)))


class CapturePlan:
    """A captured step's memory layout (kitsune/capplan.h), made by
    :meth:`CaptureRecording.plan` (or :func:`_take_plan`) from a recorded capture;
    :func:`_place_capture` lays the next
    capture into a pool out by it. ``info``: planned ``blocks``, ``arena_bytes``,
    ``plan_bytes`` (the layout's extent), ``peak_bytes`` (the most bytes live at once
    in the recording: no layout is smaller), ``stream_peak_bytes`` (the sum of each
    stream's own live peak: no layout that keeps streams apart is smaller),
    ``recorded`` allocations, of them ``left_live`` (still live when planned, left
    out: a workspace PyTorch keeps) and ``freed_after`` (freed after the capture,
    planned to its end), ``graph_nodes`` (the captured graph's nodes the plan ordered
    blocks by; 0: streams were kept apart), ``cross_shares`` (pairs of blocks of
    different streams, or used on another, the graph's order let share bytes),
    ``programmatic_edges`` (edges of the graph into kernels that may start before their
    predecessor ends), ``programmatic_ordered`` (of them, those into Kitsune's
    dependent launches, which wait before touching memory: counted as order), and for a
    ``budget`` (as given to the plan; None: none): ``unwaited_bytes`` (the plan's
    extent without waits), ``wait_gap`` (-1: no waits; else the fewest recorded
    allocations and frees between blocks that share bytes by a wait), ``wait_shares``
    (the pairs only waits let share), ``wait_timed`` (the recorded graph's node times,
    :meth:`CaptureRecording.set_times`, chose the plan: of the packings tried, pairs
    bought by recorded events or by their slack in a replay, the one whose waits delay
    that replay least, to first order: ``wait_delay_us``), ``wait_by_slack`` (its pairs
    are those with at least a threshold of slack; ``wait_slack_us``, the least of
    them; else None)."""

    def __init__(self, handle, info):
        self._handle, self.info = handle, info

    def __del__(self):
        if self._handle and _native._bridge is not None:
            _native._bridge.kt_bridge_plan_free(self._handle)
            self._handle = None

    def __repr__(self):
        i = self.info
        return (f"CapturePlan({i['blocks']} blocks, {i['plan_bytes'] / 2**20:.1f} MiB for a live peak of "
                f"{i['peak_bytes'] / 2**20:.1f} MiB)")


_plan_api_ready = False


def _pool_args(pool, device):
    global _plan_api_ready
    if not installed():
        raise RuntimeError("capture plans lay out the installed allocator's graph pools: call "
                           "kitsune.allocator.install() first")
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(v, int) and v >= 0 for v in pool)):
        raise ValueError(f"pool must be a torch.cuda.graph_pool_handle() (a pair of ints), got {pool!r}")
    b = _native.bridge()
    if not _plan_api_ready:
        ids = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
        i64p = ctypes.POINTER(ctypes.c_int64)
        b.kt_bridge_pool_record.argtypes = ids
        b.kt_bridge_pool_place.argtypes = ids + [ctypes.c_void_p]
        b.kt_bridge_pool_take_recording.argtypes = ids + [ctypes.POINTER(ctypes.c_void_p)]
        b.kt_bridge_recording_plan.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), i64p]
        b.kt_bridge_recording_set_times.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]
        b.kt_bridge_recording_free.argtypes = [ctypes.c_void_p]
        b.kt_bridge_recording_free.restype = None
        b.kt_bridge_pool_placer_stats.argtypes = ids + [i64p]
        b.kt_bridge_plan_free.argtypes = [ctypes.c_void_p]
        b.kt_bridge_plan_free.restype = None
        _plan_api_ready = True
    return b, int(device), pool[0], pool[1]


def _record_capture(pool, device=0):
    """The next capture into ``pool`` records its allocations (for :func:`_take_recording`)."""
    b, d, i0, i1 = _pool_args(pool, device)
    check(b.kt_bridge_pool_record(d, i0, i1), f"recording the next capture into pool {pool}")


class CaptureRecording:
    """A capture's recorded allocations and graph order, taken from its pool by
    :func:`_take_recording`: :meth:`plan` lays them out within any budget, as often as
    asked, with no capture more (compile_step plans one recording within the budget and
    then within a floor: _planned_layout)."""

    def __init__(self, handle):
        self._handle = handle

    def __del__(self):
        if self._handle and _native._bridge is not None:
            _native._bridge.kt_bridge_recording_free(self._handle)
            self._handle = None

    def plan(self, budget=None):
        """The recording's :class:`CapturePlan`. ``budget`` (bytes, None: none): when the
        plan passes it, blocks of streams the capture's order keeps apart may share bytes
        too, each such reuse bought with a wait of the later block's stream on the
        earlier block's work (kt_capplan_create_within)."""
        _check_budget(budget)
        b = _native.bridge()
        h = ctypes.c_void_p()
        out = (ctypes.c_int64 * 19)()
        check(b.kt_bridge_recording_plan(self._handle, -1 if budget is None else budget, ctypes.byref(h), out),
              "planning a recorded capture")
        keys = ("blocks", "arena_bytes", "plan_bytes", "peak_bytes", "recorded", "left_live", "freed_after",
                "stream_peak_bytes", "graph_nodes", "cross_shares", "programmatic_edges", "programmatic_ordered",
                "wait_gap", "wait_shares", "unwaited_bytes", "wait_timed", "wait_by_slack", "wait_slack_ns",
                "wait_delay_ns")
        info = dict(zip(keys, list(out)))
        slack, delay = info.pop("wait_slack_ns"), info.pop("wait_delay_ns")
        info["wait_slack_us"] = slack / 1e3 if info["wait_by_slack"] and info["wait_shares"] else None
        info["wait_delay_us"] = delay / 1e3 if info["wait_timed"] else None
        info["budget"] = budget
        return CapturePlan(h.value, info)


    def set_times(self, nodes, finish_ns):
        """When each node of the recorded graph finished in a replay of it (``nodes``: the
        graph's cudaGraphNode_t values as ints, each once; ``finish_ns``: ns from the
        replay's start, as many): :meth:`plan` then buys its waits by their slack there
        (kt_caprec_set_times). Empty: none again."""
        nodes, finish_ns = list(nodes), list(finish_ns)
        if len(nodes) != len(finish_ns):
            raise ValueError(f"set_times: {len(nodes)} nodes but {len(finish_ns)} times")
        n = len(nodes)
        check(_native.bridge().kt_bridge_recording_set_times(self._handle, (ctypes.c_uint64 * n)(*nodes),
                                                             (ctypes.c_int64 * n)(*finish_ns), n),
              "setting a recording's node times")


def _check_budget(budget):
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget must be None or a number of bytes >= 0, got {budget!r}")


def _take_recording(pool, device=0):
    """The :class:`CaptureRecording` of the capture recorded into ``pool``; the recording
    there ends. Free the graph's outputs first: what is still live is left out of its
    plans."""
    b, d, i0, i1 = _pool_args(pool, device)
    h = ctypes.c_void_p()
    check(b.kt_bridge_pool_take_recording(d, i0, i1, ctypes.byref(h)), f"taking pool {pool}'s recorded capture")
    return CaptureRecording(h.value)


def _take_plan(pool, device=0, budget=None):
    """The :class:`CapturePlan` of the capture recorded into ``pool`` within ``budget``
    (:meth:`CaptureRecording.plan`); the recording ends."""
    _check_budget(budget)
    return _take_recording(pool, device).plan(budget)


def _place_capture(pool, plan, device=0):
    """The next capture into ``pool`` takes its blocks at ``plan``'s offsets, in an arena
    the pool keeps for its graphs (they must replay one at a time, and whatever one leaves
    in the pool must be read before another replays: compile_step's contract). Keep
    ``plan`` alive until the capture has begun."""
    if not isinstance(plan, CapturePlan) or not plan._handle:
        raise TypeError(f"plan must be a CapturePlan from kitsune.allocator._take_plan, got {plan!r}")
    b, d, i0, i1 = _pool_args(pool, device)
    check(b.kt_bridge_pool_place(d, i0, i1, plan._handle), f"placing the next capture into pool {pool}")


def memory_breakdown(device=0):
    """Where the installed allocator's reserved bytes on ``device`` are: the device
    pool's ``reserved``, ``allocated`` (a private pool's segments and a placer's arenas
    are blocks of it) and ``segments``; the private pools (CUDA graphs' and MemPools')
    ``private_pools``, ``private_reserved`` (their segments) and ``private_allocated``
    (blocks live in them); ``arena_bytes`` (placed captures' arenas) and
    ``placed_live`` (placed blocks live in them). Reserved but unallocated device-pool
    bytes are the cache ``torch.cuda.empty_cache()`` could not give back."""
    return _device_values("memory_breakdown", ("reserved", "allocated", "segments", "private_pools",
                                               "private_reserved", "private_allocated", "arena_bytes", "placed_live"),
                          device)


def _placer_stats(pool, device=0):
    """How ``pool``'s last placed capture went: ``arena_bytes`` (its arenas), ``arenas``,
    ``live_bytes`` / ``live_blocks`` (placed blocks live now), ``planned``, ``placed`` (at
    their planned offsets), ``refused`` (served by the pool instead: the plan did not
    foresee them, or they would have shared bytes with a block still in use),
    ``plan_bytes``, ``peak_bytes``, ``status`` (0, or the kt_status of an arena that
    could not be had) and ``waits`` (placements that made their stream wait: plans with
    a budget). None when the pool has no placer."""
    b, d, i0, i1 = _pool_args(pool, device)
    out = (ctypes.c_int64 * 11)()
    if b.kt_bridge_pool_placer_stats(d, i0, i1, out) != 0:
        return None
    keys = ("arena_bytes", "arenas", "live_bytes", "live_blocks", "planned", "placed", "refused", "plan_bytes",
            "peak_bytes", "status", "waits")
    return dict(zip(keys, list(out)))


_use_pools = {}   # device -> torch.cuda.MemPool whose segments come from Kitsune


def _stats_dict(lib, st):
    """kt_stats as a flat dict with PyTorch's key names (``allocated_bytes.all.current`` ...)."""
    out = {}
    for name in _STATS:
        s = getattr(st, name)
        key = "allocation" if name == "allocations" else "segment" if name == "segments" else name
        for field in ("current", "peak", "allocated", "freed"):
            out[f"{key}.all.{field}"] = getattr(s, field)
    for name in _COUNTERS:
        out[name] = getattr(st, name)
    out["num_device_alloc"] = st.num_backend_reserves
    out["num_device_free"] = st.num_backend_releases
    out["memory_limit"] = st.memory_limit
    out["largest_free_block"] = st.largest_free_block
    out["num_sync_all_streams"] = st.num_release_syncs
    out["vmm"] = bool(st.vmm)
    out["size_classes"] = {lib.kt_class_size(c): (st.class_allocs[c], st.class_live[c])
                           for c in range(_native.NUM_CLASSES) if st.class_allocs[c]}
    return out


def mempool(device=None):
    """The ``torch.cuda.MemPool`` that :func:`use` routes to on ``device`` (default:
    the current device), created once. With Kitsune installed it is a plain MemPool
    (Kitsune serves it as a private pool). Otherwise PyTorch's caching allocator keeps
    placing blocks, and every segment it reserves for the pool comes from a Kitsune
    pool (see :func:`use_stats`)."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("kitsune.allocator.use(): no CUDA device is visible (torch.cuda.is_available() is False)")
    if device is None:
        device = torch.cuda.current_device()
    elif not isinstance(device, int):
        device = torch.device(device).index or 0
    if device not in _use_pools:
        if installed():
            _use_pools[device] = torch.cuda.MemPool()
        else:
            b = _native.bridge()
            alloc = torch.cuda.memory.CUDAPluggableAllocator(b._name, "kt_bridge_seg_alloc", "kt_bridge_seg_free")
            _use_pools[device] = (torch.cuda.MemPool(alloc.allocator()), alloc)
    pool = _use_pools[device]
    return pool[0] if isinstance(pool, tuple) else pool


@contextlib.contextmanager
def use(device=None):
    """Routes this thread's CUDA allocations inside the block to Kitsune, without
    a global :func:`install` (for code that cannot swap PyTorch's allocator)::

        with kitsune.allocator.use():
            y = model(x)

    The memory comes from :func:`mempool`; tensors made inside may outlive the
    block. Like ``torch.cuda.use_mem_pool``, only the calling thread is routed
    (autograd's backward threads are not)."""
    import torch
    pool = mempool(device)
    with torch.cuda.use_mem_pool(pool, device):
        yield pool


def use_stats(device=0):
    """Stats of the Kitsune pool that serves :func:`use`'s segments on ``device``
    (same keys as ``Pool.stats``); all zero before the first segment."""
    b = _native.bridge()
    b.kt_bridge_seg_stats.restype, b.kt_bridge_seg_stats.argtypes = ctypes.c_int, [ctypes.c_int,
                                                                                     ctypes.POINTER(_native.Stats)]
    st = _native.Stats()
    rc = b.kt_bridge_seg_stats(device, ctypes.byref(st))
    if rc not in (_native.OK, _native.ERR_UNAVAILABLE):
        check(rc, "use_stats")
    return _stats_dict(native(), st)


class Pool:
    """A Kitsune pool. backend: "cuda" or "fake". Streams are cudaStream_t values (ints).
    vmm=True maps 2 MiB granules of one address range instead of reserving segments
    (kt_pool_options.vmm; segments where the device cannot map)."""

    def __init__(self, backend="cuda", device=0, memory_limit=0, vmm=False):
        self._pool, self._fake = ctypes.c_void_p(), None   # close() is safe from here on
        lib = native()
        self._lib = lib
        if backend == "fake":
            self._fake = lib.kt_fake_backend_create(0)
            be = self._fake
        elif backend == "cuda":
            if lib.kt_cuda_device_count() <= device:
                raise _native.KitsuneError(
                    f"Pool(backend='cuda', device={device}): {lib.kt_cuda_device_count()} CUDA device(s) visible; "
                    "use backend='fake' on a machine without a GPU")
            be = lib.kt_cuda_backend()
        else:
            raise ValueError(f"Pool(backend={backend!r}): expected 'cuda' or 'fake'")
        if memory_limit < 0:
            raise ValueError(f"Pool(memory_limit={memory_limit}): must be >= 0 bytes (0 = no limit)")
        opt = _native.PoolOptions()
        lib.kt_pool_options_default(ctypes.byref(opt))
        opt.device, opt.memory_limit, opt.vmm = device, memory_limit, int(bool(vmm))
        check(lib.kt_pool_create(ctypes.byref(opt), be, ctypes.byref(self._pool)), "kt_pool_create")

    def close(self):
        if self._pool:
            self._lib.kt_pool_destroy(self._pool)
            self._pool = ctypes.c_void_p()
        if self._fake:
            self._lib.kt_fake_backend_destroy(self._fake)
            self._fake = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def alloc(self, size, stream=0):
        if size < 0:
            raise ValueError(f"alloc(size={size}): size must be >= 0")
        out = ctypes.c_void_p()
        check(self._lib.kt_alloc(self._pool, size, stream, ctypes.byref(out)), f"alloc(size={size})")
        return out.value or 0

    def free(self, ptr, size=0, stream=0):
        check(self._lib.kt_free(self._pool, ptr, size, stream), f"free(ptr={ptr:#x}, size={size})")

    def record_stream(self, ptr, stream):
        check(self._lib.kt_record_stream(self._pool, ptr, stream), f"record_stream(ptr={ptr:#x})")

    def empty_cache(self):
        check(self._lib.kt_empty_cache(self._pool), "empty_cache")

    def set_memory_limit(self, nbytes):
        if nbytes < 0:
            raise ValueError(f"set_memory_limit({nbytes}): must be >= 0 bytes (0 = no limit)")
        check(self._lib.kt_set_memory_limit(self._pool, nbytes), "set_memory_limit")

    def set_memory_fraction(self, fraction):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"set_memory_fraction({fraction}): must be in (0, 1]")
        check(self._lib.kt_set_memory_fraction(self._pool, fraction), "set_memory_fraction")

    def reset_peak_stats(self):
        self._lib.kt_reset_peak_stats(self._pool)

    def validate(self):
        check(self._lib.kt_pool_validate(self._pool), "validate")

    def stats(self):
        """A flat dict with PyTorch's key names (``allocated_bytes.all.current`` ...)."""
        st = _native.Stats()
        check(self._lib.kt_get_stats(self._pool, ctypes.byref(st)), "stats")
        return _stats_dict(self._lib, st)

    @contextlib.contextmanager
    def trace(self, path):
        """Records every allocation event as CSV (replay with bench/alloc_replay)."""
        check(self._lib.kt_trace_start(self._pool, str(path).encode()), f"trace({path!r})")
        try:
            yield path
        finally:
            check(self._lib.kt_trace_stop(self._pool), "trace stop")

