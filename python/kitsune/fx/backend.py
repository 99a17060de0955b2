"""torch.compile(model, backend="kitsune"): kitsune_backend rewrites the Dynamo graph with
kitsune.fx's patterns, then hands it to Inductor. This module only defines; importing
kitsune.fx registers the backend with Dynamo (_register_backend), unless Dynamo has found
the entry point that names it (kitsune.fx.backend:kitsune_backend) and loads it itself."""
from .engine import Report, _rewrite

last_compile_report = None   # the Report of the last graph the backend compiled


def kitsune_backend(gm, example_inputs):
    """A torch.compile backend: rewrites the Dynamo graph with kitsune.fx's patterns,
    then hands it to Inductor, which traces the fused ops through their fake
    kernels and autograd (forward and backward) and compiles the rest as usual."""
    global last_compile_report
    from torch._inductor.compile_fx import compile_fx
    report = Report()
    # Inductor sums a bias gradient in its own kernels, and fuses a pooling with its neighbours
    _rewrite(gm, report, "", linear_bias=False, optimize_only=False)
    last_compile_report = report
    return compile_fx(gm, example_inputs)


def _register_backend():
    # list_backends() first imports every backend module of Dynamo's (Inductor's code cache,
    # networkx, ...): 0.14 s of optimize() and a step on the CPU machine, 1.3-1.5 s of
    # compile_step's setup on the H100 one (which compiles their bytecode each time). The
    # registry's own table answers without them.
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends import registry
    # Where Dynamo has found an entry point named "kitsune", Dynamo loads and registers it: a
    # registration here would make that load, when this import is part of it, fail on the
    # duplicate name.
    if getattr(registry, "_BACKENDS", {}).get("kitsune") is not None:
        return
    known = getattr(registry, "_COMPILER_FNS", None)
    if "kitsune" not in (known if known is not None else list_backends(exclude_tags=())):
        register_backend(name="kitsune")(kitsune_backend)
