"""torch.compile(model, backend="kitsune"): kitsune_backend rewrites the Dynamo graph with
kitsune.fx's patterns, then hands it to Inductor, or with options={"inductor": False}
runs it through AOTAutograd as ATen ops and fused ops, nothing generated. This module only defines; importing
kitsune.fx registers the backend with Dynamo (_register_backend), unless Dynamo has found
the entry point that names it (kitsune.fx.backend:kitsune_backend) and loads it itself."""
from .engine import Report, _rewrite

last_compile_report = None   # the Report of the last graph the backend compiled


def kitsune_backend(gm, example_inputs, options=None):
    """A torch.compile backend: rewrites the Dynamo graph with kitsune.fx's patterns, then
    compiles it. By default Inductor compiles it: it traces the fused ops through their
    fake kernels and autograd (forward and backward) and generates kernels for the rest.
    ``torch.compile(model, backend="kitsune", options={"inductor": False})``: Kitsune's own
    path, no Inductor and no Triton: every pattern kitsune.optimize knows is rewritten,
    AOTAutograd traces the forward and backward graphs (through the fused ops' autograd),
    and they run as they are, the fused ops and one ATen kernel for every other op, so a
    graph is ready in about the time Dynamo takes to trace it."""
    global last_compile_report
    options = dict(options or {})
    inductor = options.pop("inductor", True)
    if options:
        raise ValueError(f"torch.compile(backend='kitsune'): unknown option(s) {sorted(options)}; the option is "
                         f"'inductor' (True: Inductor compiles the rewritten graph; False: it runs as ATen ops)")
    report = Report()
    if inductor:
        from torch._inductor.compile_fx import compile_fx
        # Inductor sums a bias gradient in its own kernels, and fuses a pooling with its neighbours
        _rewrite(gm, report, "", linear_bias=False, optimize_only=False)
        last_compile_report = report
        return compile_fx(gm, example_inputs)
    _rewrite(gm, report, "", linear_bias=True, optimize_only=True)
    last_compile_report = report
    return _aten_aot(gm, example_inputs)


def settle_hf_loss_functions(model):
    """Hugging Face models whose ``loss_function`` property warns on every call
    (``loss_type`` unknown to transformers, as on GPT-2: it falls back to ForCausalLM's
    loss) break Dynamo's graph at that warning (logger.warning_once), which splits the
    LM head from its loss. Each such module in model gets the function the property
    returns, through the property's own setter, once and eagerly (the warning printed
    once, as it is without Kitsune), so the trace runs through. Returns a function that
    undoes it."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return lambda: None
    from .patterns.loss import hf_loss_modules
    settled = []
    for _, m in hf_loss_modules(model):
        if "_loss_function" not in vars(m) and getattr(m, "loss_type", None) not in LOSS_MAPPING:
            m.loss_function = m.loss_function
            settled.append(m)

    def undo():
        for m in settled:
            vars(m).pop("_loss_function", None)
    return undo


def _aten_aot(gm, example_inputs):
    """AOTAutograd over gm with graphs that run as traced (boxed, no compiler), the
    pointwise ops left between patterns in each grouped into chains (fx/chains.py)
    unless KITSUNE_CHAINS=0."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from .. import options
    from . import chains

    def as_traced(g, _inputs):
        if options.get("KITSUNE_CHAINS"):
            chains.fuse(g)
        return make_boxed_func(g.forward)
    return aot_autograd(fw_compiler=as_traced, bw_compiler=as_traced)(gm, example_inputs)


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
