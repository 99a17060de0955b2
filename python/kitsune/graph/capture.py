"""kitsune.graph.capture: capturing a step as a CUDA graph.

Kitsune's capture stream (one per device, sharing its partner's cuBLAS workspaces), the
capture itself (_Capture: CompiledStep's pool, capture and in-backward update), the
rewrite of small memset nodes into kernel nodes before instantiation, the generators a
failed capture leaves in capture mode, and the node times of a recording's graph
(_NodeTimer, for KITSUNE_PLAN_WAITS=timed).
"""
import contextlib
import ctypes
import threading
import time

import torch

from .. import options

# compile_step's capture streams: device index -> (the stream, its partner: the
# stream whose cuBLAS and cuBLASLt workspaces it uses). PyTorch keys those
# workspaces by (handle, stream) and keeps them for the process, 65 MiB a stream on
# an H100; a graph bakes in its capture stream's. Sharing the partner's (the stream
# the first step ran on, the default stream as a rule) keeps a whole-step graph from
# holding a second set. The stream is Kitsune's own (PyTorch's pool hands its streams
# round-robin to any caller, who would then use the partner's workspaces unordered),
# one per device for every compile_step, never destroyed.
_CAPTURE_STREAMS = {}   # read and filled under _CAPTURE_LOCK (_capture_stream is called from _first)
_CAPTURE_LOCK = threading.RLock()   # a first step and its capture, one thread at a time


class _Capture:
    """CompiledStep's captures (kitsune.graph.step): into its pool (_pool, _graphs), on
    the capture stream (_side), of its forward and backward (_forward_backward,
    _captured) and the optimizer's update (optimizer, optimizer_in_backward,
    _opt_stream, max_grad_norm); counts in _n and _ib_launches."""

    def _held_pool(self):
        """The pool the next capture goes to: the graphs' while one holds it, else a new
        one. A pool whose last graph is gone takes no capture until its cache is emptied
        (PyTorch's beginAllocateToPool asserts its use count, in the CUDA host allocator
        too), and _capturing skips torch.cuda.graph's empty_cache under Kitsune's
        allocator: reusing the handle failed the capture of a batch shape after an arena
        grew (H100, bench/results/archive/h100_graph_gmem_08d37d5.log)."""
        if self._pool is None or not self._graphs:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capture(self, args, pool, update=True, timer=None):
        """One capture of the step into ``pool``, on the side stream the warm-up ran on
        (its cuBLAS workspaces exist, so none is allocated in the pool). Returns the
        graph, its loss and the optimizer's capture plan; the gradients are dropped
        after it (they stay in the pool, the graph's). ``update=False``: the forward
        and backward alone, no optimizer (plan None; _choose_conv_grads' trials).
        ``timer``: a _NodeTimer, told which nodes are the update while capturing and
        called with the graph once captured (_recording)."""
        self.optimizer.zero_grad(set_to_none=True)
        ctx = getattr(self._captured, "_kitsune_streams", None)
        if ctx is not None:
            ctx.late_kept = []   # this capture's late joins (_late_kept)
        graph = torch.cuda.CUDAGraph(keep_graph=True)   # instantiated below, after _memsets_to_kernels
        ib = plan = None
        self.optimizer._launch_mark = timer.mark if timer is not None else None
        try:
            with self._capturing(graph, pool):
                ib = self._in_backward() if update else None
                static_loss = self._forward_backward(tuple(args), self._captured, clip=update)
                if update:
                    plan = ib.finish() if ib is not None else (
                        self.optimizer.capture_amp_step() if self.optimizer.enable_amp else self.optimizer.capture_step())
                    self._ib_launches = ib.launches if ib is not None else 0
        except BaseException:
            if ib is not None:
                ib.close()
            # A capture that failed to end leaves the allocator routing the pool's
            # allocations through a filter that refers to the dead graph
            # (CUDAGraph::capture_end throws before endAllocateToPool): end it here.
            try:
                torch._C._cuda_endAllocateToPool(self._side.device.index, pool)
            except Exception:   # noqa: BLE001 - it had ended: the capture's own error is the one to raise
                pass
            raise
        finally:
            self.optimizer._launch_mark = None
        if timer is not None:   # before the memsets become kernels: the recording names the nodes captured
            timer(graph)
        with torch.cuda.device(self._side.device):   # the kernel nodes are made for the current device
            self._n["memsets_replaced"] = _memsets_to_kernels(graph)
            graph.instantiate()
        self.optimizer.zero_grad(set_to_none=True)
        return graph, static_loss, plan

    def _in_backward(self):
        """The optimizer's update, inside the capture, overlapping the backward
        (KitsuneOptimizer.capture_in_backward on a stream of this step's), or None:
        off, or gradient clipping, loss scaling or micro-batches, which need every
        gradient first."""
        if (not self.optimizer_in_backward or self.max_grad_norm is not None or self.optimizer.enable_amp
                or self.micro_batches > 1):   # a gradient is final after the last micro-batch only
            return None
        if self._opt_stream is None:
            self._opt_stream = torch.cuda.Stream(self._side.device)
        return self.optimizer.capture_in_backward(self._opt_stream)

    @contextlib.contextmanager
    def _capturing(self, graph, pool):
        """torch.cuda.graph(graph, pool=pool, stream=side), less its gc.collect() and
        empty_cache() when Kitsune's allocator is installed: it makes a capture's memory
        ready itself (beginAllocateToPool), and emptying its cache cost 0.19 s a capture
        on the H100, twice a planned step (bench/results/archive/h100_plan_debug_779a772_805068d.txt)."""
        from .. import allocator
        if not allocator.installed():
            with torch.cuda.graph(graph, pool=pool, stream=self._side, capture_error_mode="thread_local"):
                yield
            return
        torch.cuda.synchronize()
        with torch.cuda.stream(self._side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()


def _capture_stream(device, here):
    from .. import _native
    idx = device.index if device.index is not None else torch.cuda.current_device()
    got = _CAPTURE_STREAMS.get(idx)
    if got is None:
        ptr = ctypes.c_uint64()
        b = _native.bridge()
        from ..sched import branch_priority
        _native.check(b.kt_bridge_stream_create(idx, branch_priority(), ctypes.byref(ptr)),
                      f"creating a capture stream on cuda:{idx}")
        got = _CAPTURE_STREAMS[idx] = (torch.cuda.ExternalStream(ptr.value, device=torch.device("cuda", idx)), here)
    return got


def _share_workspaces(partner, side):
    """kt_bridge_blas_share(partner, side): ``shared`` (map, handle) pairs whose side
    workspace is now the partner's, how many of those ``moved`` from side, and how many
    stay ``apart`` (both streams had their own before they were paired)."""
    from .. import _native
    b = _native.bridge()
    out = (ctypes.c_int64 * 3)()
    _native.check(b.kt_bridge_blas_share(partner.cuda_stream, side.cuda_stream, out), "sharing cuBLAS workspaces")
    return dict(zip(("shared", "moved", "apart"), out))


# Memset nodes up to this size become kernel nodes (kt_graph_memsets_to_kernels): GPT's
# are 4 bytes each; the 8 MiB zero fill of its embedding gradient stays a memset.
_MEMSET_KERNEL_MAX_BYTES = 1 << 16


def _memsets_to_kernels(graph):
    """Replaces the small memset nodes of a captured, not yet instantiated graph with
    kernel nodes of Kitsune's (kitsune/fusion.h: kt_graph_memsets_to_kernels): inside
    a graph the kernel after a memset node started 3 to 7 us after it, after a kernel
    0.4 us (H100, bench/results/archive/h100_timeline_gpt_inception8_18b9e89.log). Returns how
    many; KITSUNE_GRAPH_MEMSETS=keep leaves them."""
    if options.get("KITSUNE_GRAPH_MEMSETS") == "keep":
        return 0
    from .. import _native
    n = ctypes.c_int(0)
    _native.check(_native.native().kt_graph_memsets_to_kernels(graph.raw_cuda_graph(), _MEMSET_KERNEL_MAX_BYTES,
                                                                 ctypes.byref(n)), "kt_graph_memsets_to_kernels")
    return n.value


def _end_generator_capture(device):
    """A capture that failed leaves the CUDA generators it registered in capture mode
    (PyTorch ends it only after a successful end of capture), and every later random
    op then fails with "Offset increment outside graph capture encountered
    unexpectedly". A capture that succeeds ends it; this one records a single fill."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.empty(1, device=device).zero_()
    del g


class _NodeTimer:
    """Times a recording capture's graph for its plan's waits (kt_caprec_set_times: a
    wait is bought where it had slack in a replay). While capturing, mark (the
    optimizer's _launch_mark) notes which nodes are the update; called with the
    captured graph, it replays a copy of it without them (kt_graph_time_nodes), so
    parameters and optimizer state are not updated, and puts the model's buffers and
    the random generators back after. times: (nodes, finish ns) or None; note: what
    stats()["memory_plan"]["node_times"] says."""

    def __init__(self, model, stream):
        self.model, self.stream = model, stream
        self.update, self._before, self.times, self.note = set(), None, None, None

    def mark(self, begin):
        nodes = _capture_nodes(torch.cuda.current_stream())
        if nodes is None or (not begin and self._before is None):
            self.note = "not timed: the update's nodes could not be told apart"
        elif begin:
            self._before = nodes
        else:
            self.update |= nodes - self._before
            self._before = None

    def __call__(self, graph):
        if self.note is not None:
            return
        from ..sched import saved_state
        restore = saved_state(self.model)
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(self.stream):
                self.times = _node_times(graph, sorted(self.update), self.stream)
            self.note = (f"{len(self.times[0])} nodes timed over {_TIMED_REPLAYS} replays, {len(self.update)} of the "
                         f"update left out, {time.perf_counter() - t0:.3f} s")
        except RuntimeError as e:
            self.note = f"not timed: {_describe(e)}"
        finally:
            restore()


# Replays of a recording's graph its node times are the median of (_NodeTimer)
_TIMED_REPLAYS = 3


def _capture_nodes(stream):
    """The nodes of the graph stream is capturing into (ints), or None."""
    from .. import _native
    lib = _native.native()
    n = ctypes.c_size_t(0)
    if lib.kt_graph_capture_nodes(ctypes.c_void_p(stream.cuda_stream), None, 0, ctypes.byref(n)) != 0:
        return None
    room = n.value
    out = (ctypes.c_uint64 * max(room, 1))()
    if lib.kt_graph_capture_nodes(ctypes.c_void_p(stream.cuda_stream), out, room, ctypes.byref(n)) != 0 or \
            n.value != room:
        return None
    return set(out[:room])


def _node_times(graph, skip, stream):
    """(nodes, ns): when each node of a captured graph (not instantiated through it)
    finished in replays of a copy of it on stream, skip's nodes left out
    (kt_graph_time_nodes); RuntimeError when the runtime refuses."""
    from .. import _native
    lib = _native.native()
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    _native.check(lib.kt_graph_time_nodes(raw, None, 0, None, 0, None, None, None, 0, ctypes.byref(n)),
                  "counting a captured graph's nodes")
    count = n.value
    stamps = torch.empty(count + 1, dtype=torch.int64, device=stream.device)
    nodes, ns = (ctypes.c_uint64 * max(count, 1))(), (ctypes.c_int64 * max(count, 1))()
    left = (ctypes.c_uint64 * max(len(skip), 1))(*skip)
    with torch.cuda.device(stream.device):
        _native.check(lib.kt_graph_time_nodes(raw, left, len(skip), ctypes.c_void_p(stamps.data_ptr()), _TIMED_REPLAYS,
                                              ctypes.c_void_p(stream.cuda_stream), nodes, ns, count, ctypes.byref(n)),
                      "timing a captured graph's nodes")
    return list(nodes[:count]), list(ns[:count])


def _describe(e):
    """An exception as its type and first line."""
    first = (str(e).strip().splitlines() or [""])[0]
    return type(e).__name__ + (f": {first}" if first else "")
