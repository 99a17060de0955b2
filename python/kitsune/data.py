"""kitsune.data: copy the next batches to the GPU while the current one trains (kitsune.prefetch).

A background thread takes batches from any iterable (a DataLoader, a generator, a
list), stages every CPU tensor in pinned memory from Kitsune's pool (skipping
tensors that are already pinned), and copies it to the device on a dedicated copy
stream. The consumer gets each batch on its current stream:

  - the current stream waits on an event recorded after the batch's copies, so no
    kernel reads a tensor before it has arrived;
  - every device tensor is ``record_stream``-ed on the current stream, so the
    device allocator (PyTorch's or Kitsune's) does not reuse its memory while work
    queued there may still read it;
  - every pinned staging buffer is recorded on the copy stream before it is
    dropped, so the pinned pool does not hand it out (to be overwritten by the
    next batch) before the copy that reads it has finished.

At most ``depth`` batches wait on the device, plus the one being staged.
"""
import queue
import threading
import time

_DONE = object()


class _Failure:
    def __init__(self, exc):
        self.exc = exc


def _map(obj, fn):
    """Applies fn to every tensor in nested tuples / lists / dicts; keeps the rest."""
    import torch
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # namedtuple
        return type(obj)(*(_map(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(x, fn) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items())
    return obj


class Prefetcher:
    """Iterates ``loader`` with batches already on ``device``; see the module doc.

    ``stats`` holds what it measured: batches, bytes copied, and the seconds the
    consumer spent waiting for a batch to be staged (``wait_s``)."""

    def __init__(self, loader, device="cuda", depth=2):
        import torch
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"kitsune.prefetch: depth must be an int >= 1, got {depth!r}")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"kitsune.prefetch copies to a CUDA device; got device={str(device)!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("kitsune.prefetch: no CUDA device is visible (torch.cuda.is_available() is False)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader, self.device, self.depth = loader, device, depth
        self.stats = {"batches": 0, "bytes": 0, "wait_s": 0.0}

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        import torch
        from . import pinned

        copy_stream = torch.cuda.Stream(self.device)
        ready = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        source = iter(self.loader)

        def put(item):
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def to_device(t):
            if t.device.type != "cpu":
                return t
            if t.is_pinned():
                staged = t   # PyTorch's pinned memory: its host allocator tracks the copy itself
            else:
                staged = pinned.empty(t.shape, t.dtype)
                staged.copy_(t)
            out = staged.to(self.device, non_blocking=True)
            if staged is not t:
                pinned.record_stream(staged, copy_stream)   # the block waits for this copy
            self.stats["bytes"] += t.numel() * t.element_size()
            return out

        def produce():
            try:
                torch.cuda.set_device(self.device)
                for batch in source:
                    if stop.is_set():
                        return
                    with torch.cuda.stream(copy_stream):
                        on_device = _map(batch, to_device)
                        done = torch.cuda.Event()
                        done.record(copy_stream)
                    del batch
                    if not put((on_device, done)):
                        return
                put(_DONE)
            except BaseException as e:   # handed to the consumer, raised there
                put(_Failure(e))

        worker = threading.Thread(target=produce, name="kitsune-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = ready.get()
                self.stats["wait_s"] += time.perf_counter() - t0
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                on_device, done = item
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)

                def hand_over(t):
                    if t.device == self.device:
                        t.record_stream(current)
                    return t
                _map(on_device, hand_over)
                self.stats["batches"] += 1
                yield on_device
                del on_device, item
        finally:
            stop.set()
            worker.join()


def prefetch(loader, device="cuda", depth=2):
    """Wraps ``loader`` (any iterable of tensors, or of tuples / lists / dicts of
    tensors) so that each batch arrives already on ``device``, copied from pinned
    memory on a side stream while the previous batches are being used. Non-tensor
    values pass through unchanged. Returns a re-iterable :class:`Prefetcher`."""
    return Prefetcher(loader, device, depth)
