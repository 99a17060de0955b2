"""Kitsune: a faster, leaner PyTorch on NVIDIA GPUs with no change to the model.

``import kitsune`` works anywhere, with or without a GPU or a build. Where torch and
the built libraries are there, it loads them, so ``torch.ops.kitsune.*`` resolve at
once (no CUDA context is made: kitsune.allocator.install() may still come first);
without a build, the first use fails with a message that says what was searched and
how to fix it (see :func:`kitsune.native`). ``torch.compile(model, backend="kitsune")``
finds its backend through the package's entry point, without importing Dynamo here.
"""
from ._native import KitsuneError, KitsuneNotBuiltError, KitsuneOutOfMemoryError, native

__version__ = "0.1.0"
__all__ = ["native", "KitsuneError", "KitsuneNotBuiltError", "KitsuneOutOfMemoryError", "allocator", "pinned",
           "prefetch", "optimize", "explain", "ops", "sched", "KitsuneOptimizer", "compile_step", "__version__"]


def prefetch(loader, device="cuda", depth=2):
    """Wraps ``loader`` so each batch arrives on ``device``, staged in pinned memory
    and copied on a side stream while earlier batches train. See kitsune.data."""
    from .data import prefetch as _prefetch
    return _prefetch(loader, device, depth)


def optimize(model, inplace=False, report=None):
    """``model`` with matched patterns replaced by Kitsune's fused ops (see kitsune.fx)."""
    from .fx import optimize as _optimize
    return _optimize(model, inplace, report)


def explain(model, *args, dynamo=False, **kwargs):
    """What :func:`optimize` would fuse and leave in ``model``, with reasons; with
    ``dynamo=True`` and example inputs, what Kitsune's Dynamo path does, graph breaks
    included (kitsune.fx)."""
    from .fx import explain as _explain
    return _explain(model, *args, dynamo=dynamo, **kwargs)


def KitsuneOptimizer(optimizer, params=None, **kwargs):
    """A torch.optim optimizer whose step is Kitsune's fused kernel (kitsune.optim)."""
    from .optim import KitsuneOptimizer as _K
    return _K(optimizer, params, **kwargs)


def compile_step(model, loss_fn, optimizer, **kwargs):
    """``step(*batch) -> loss``: forward, backward and optimizer step as one CUDA graph
    (kitsune.graph)."""
    from .graph import compile_step as _compile_step
    return _compile_step(model, loss_fn, optimizer, **kwargs)


def __getattr__(name):
    if name in ("allocator", "pinned", "data", "ops", "fx", "sched", "optim", "graph", "options"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'kitsune' has no attribute {name!r}")


def _load_ops():
    """Registers torch.ops.kitsune (the bridge's schemas and kernels, kitsune.ops' fake
    kernels and autograd) when torch and the build are there; silent otherwise."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    try:
        from . import ops  # noqa: F401
    except KitsuneNotBuiltError:
        pass   # the first use raises it again, with what was searched and the fix


_load_ops()
