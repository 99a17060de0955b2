"""kitsune.optimize and torch.compile(backend="kitsune") on the models people train, on CPU:
Hugging Face transformers (GPT-2, a Llama with grouped-query attention, BERT, T5, BART),
torchvision (ResNet-18, MobileNetV3, ViT, ConvNeXt), timm (EfficientNet, DeiT) and
nn.TransformerEncoderLayer, each at a tiny configuration with random weights (no
download: HF_HUB_OFFLINE=1) and dropout 0, so eager and optimized runs draw nothing.

For each, in train and in eval mode, optimize must give the outputs and every
parameter's gradient of eager within fp32 tolerances (BatchNorm's running statistics
too), keep the names and order of parameters and buffers, load the original's
state_dict and give it back, keep every attribute of every submodule it still exposes
by name, and report exactly what it does: explain(model) says what optimize said, and
each kitsune op listed runs once per call of the module it is listed under (its calls
counted in one forward), no other. torch.compile(model, backend="kitsune") in eval mode
gives eager's outputs. An architecture whose library is missing is skipped."""
import collections
import copy
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
import kitsune.fx  # noqa: E402,F401 - registers the "kitsune" torch.compile backend
from torch.overrides import TorchFunctionMode  # noqa: E402

nn = torch.nn

VOCAB = 96


def _hf(name):
    return pytest.importorskip("transformers", reason=f"{name} needs Hugging Face transformers")


def _tokens(seed, shape=(2, 12)):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _image(seed, shape=(2, 3, 32, 32)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _lm_outputs(out):
    return [out.logits, out.loss]


def _gpt2():
    T = _hf("GPT-2")
    cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    ids = _tokens(0)
    return T.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, _lm_outputs


def _llama():
    T = _hf("Llama")
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)   # GQA: 4 query heads share 2 key/value heads
    ids = _tokens(1)
    return T.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, _lm_outputs


def _bert():
    T = _hf("BERT")
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, pad_token_id=0)
    ids = _tokens(2)
    labels = torch.where(torch.arange(ids.numel()).view(ids.shape) % 3 == 0, ids, -100)   # a masked LM's labels
    return T.BertForMaskedLM(cfg), {"input_ids": ids, "labels": labels}, _lm_outputs


def _t5():
    T = _hf("T5")
    cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T.T5ForConditionalGeneration(cfg), {"input_ids": _tokens(3), "labels": _tokens(4, (2, 7))}, _lm_outputs


def _bart():
    T = _hf("BART")
    cfg = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return T.BartForConditionalGeneration(cfg), {"input_ids": _tokens(5), "labels": _tokens(6, (2, 7))}, _lm_outputs


def _vision(make, shape=(4, 3, 64, 64)):
    """A vision model on images of `shape`: a CNN's 64 x 64 leave its last BatchNorms 2 x 2
    positions of 4 images (at 32 x 32 a train-mode BatchNorm over a 1 x 1 map of 2 images
    makes fp32 rounding differences large: an ill-conditioned test, not a wrong answer)."""
    return make(), {"x": _image(7, shape)}, lambda out: [out]


def _tv(name):
    return pytest.importorskip("torchvision.models", reason=f"{name} needs torchvision")


def _resnet18():
    return _vision(lambda: _tv("ResNet-18").resnet18(num_classes=10))


def _mobilenet_v3():
    return _vision(lambda: _tv("MobileNetV3").mobilenet_v3_small(num_classes=10, dropout=0.0))


def _tv_vit():
    tvm = _tv("ViT")
    return _vision(lambda: tvm.VisionTransformer(image_size=48, patch_size=16, num_layers=2, num_heads=4, hidden_dim=32,
                                                 mlp_dim=64, num_classes=10), (2, 3, 48, 48))   # ViT-B/16, tiny


def _convnext():
    _tv("ConvNeXt")
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    blocks = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 2)]
    return _vision(lambda: ConvNeXt(blocks, num_classes=10))


def _timm(name, shape=(4, 3, 64, 64), **kw):
    timm = pytest.importorskip("timm", reason=f"{name} needs timm")
    return _vision(lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw), shape)


def _efficientnet():
    return _timm("efficientnet_b0")


def _deit():
    return _timm("deit_tiny_patch16_224", (2, 3, 48, 48), img_size=48, depth=2)


def _encoder_layer():
    m = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return m, {"src": _image(8, (2, 10, 32))}, lambda out: [out]


ZOO = {
    "hf_gpt2": _gpt2, "hf_llama_gqa": _llama, "hf_bert_mlm": _bert, "hf_t5": _t5, "hf_bart": _bart,
    "tv_resnet18": _resnet18, "tv_mobilenet_v3": _mobilenet_v3, "tv_vit": _tv_vit, "tv_convnext": _convnext,
    "timm_efficientnet_b0": _efficientnet, "timm_deit_tiny": _deit, "nn_transformer_encoder_layer": _encoder_layer,
}


def _build(arch, training):
    torch.manual_seed(0)
    model, inputs, outputs = ZOO[arch]()
    return model.train(training), inputs, outputs


# ---- what ran: kitsune op calls, attributed to the rewritten module they ran in ----
# The op each fusion of a Report runs (its "what" is "<pattern> -> <op> (...)"); None: no kitsune op.
_FUSION_OPS = {"foreach_add": None, "gelu": None}
# What a call of the op is seen as, where not torch.ops.kitsune.<op> (its Python side picks a variant).
_CALLED_AS = {"cross_entropy_with_grad": "cross_entropy", "linear_cross_entropy_with_grad": "linear_cross_entropy"}


def _fusion_op(what):
    op = what.split(" -> ")[1].split(" ")[0]
    op = op.removeprefix("kitsune.").split("(")[0]
    return _FUSION_OPS.get(op, op)


class _KitsuneOps(TorchFunctionMode):
    """Counts the calls of torch.ops.kitsune ops inside it (a call from Python, whatever the
    op's kernels then dispatch: the CPU kernels run ATen ops below any dispatch mode),
    each under the innermost module of `modules` (path by module) being called at the
    time; calls counts how often each of those modules was called."""

    def __init__(self, modules):
        super().__init__()
        self.modules, self.stack = modules, []
        self.ops, self.calls = collections.Counter(), collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and str(func).startswith("kitsune."):
            name = str(func).split(".")[1]
            where = next((self.modules[m] for m in reversed(self.stack)), None)
            self.ops[where, _CALLED_AS.get(name, name)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        mm = torch.nn.modules.module

        def pre(m, _args):
            if m in self.modules:
                self.stack.append(m)
                self.calls[self.modules[m]] += 1

        def post(m, _args, _out):
            if m in self.modules:
                self.stack.pop()
        self.hooks = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


def _expected_ops(report, calls, labelled=False):
    """{(module path, op): count} that report promises for one forward in which each
    rewritten module was called calls[path] times; labelled: the forward computed a
    Hugging Face loss, whose swapped loss_function runs kitsune.cross_entropy once,
    outside any rewritten module."""
    want = collections.Counter()
    for _, what in report.swapped:
        if labelled and "causal_lm_loss" in what:
            want[None, "cross_entropy"] += 1
    for where, what in report.fused:
        path = max((p for p in report.rewritten if p == "" or where.startswith(p + ".")), key=len)
        op = _fusion_op(what)
        if op is not None:
            want[path, op] += calls[path]
    return want


def _forward(model, inputs, outputs):
    torch.manual_seed(1)
    return outputs(model(**inputs))


def _loss(outs):
    return sum(o.float().square().mean() for o in outs)


def _same_attrs(orig, new, where):
    """Every entry of vars(orig) is in vars(new), equal (tensors: same values; dicts of
    parameters, buffers and children: same keys in the same order; modules: same class)."""
    ours = vars(new)
    for k, v in vars(orig).items():
        assert k in ours, f"{where}: attribute {k!r} lost"
        w = ours[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(w, torch.Tensor) and w.shape == v.shape and torch.equal(w, v), f"{where}.{k}"
        elif isinstance(v, dict):
            assert list(w) == list(v), f"{where}.{k}: {list(w)} != {list(v)}"
        elif isinstance(v, nn.Module) or callable(v):
            assert type(w) is type(v), f"{where}.{k}"
        else:
            try:
                same = bool(w == v)
            except Exception:   # noqa: BLE001 - not comparable: compare types
                same = type(w) is type(v)
            assert same, f"{where}.{k}: {w!r} != {v!r}"


def _close(a, b, what, rtol=1e-4, atol=2e-5):
    """fp32 tolerances, atol relative to b's largest magnitude (above 1)."""
    scale = max(1.0, b.detach().abs().max().item()) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("arch", sorted(ZOO))
def test_optimize(arch, mode):
    model, inputs, outputs = _build(arch, mode == "train")
    eager = copy.deepcopy(model)
    before = {name: (type(m), set(vars(m))) for name, m in model.named_modules()}
    report = kitsune.fx.Report()
    t0 = time.perf_counter()
    opt = kitsune.optimize(model, report=report)
    took = time.perf_counter() - t0
    explained = kitsune.explain(model)
    assert {name: (type(m), set(vars(m))) for name, m in model.named_modules()} == before, \
        "optimize (which copies) or explain changed the model"
    state = eager.state_dict()
    for k, v in model.state_dict().items():   # tracing runs forward's Python: no buffer may change
        assert torch.equal(v, state[k]), f"optimize or explain changed {k}"
    assert str(explained) == str(report) and explained.rewritten == report.rewritten, (str(explained), str(report))
    print(f"{arch} {mode}: optimize {took:.2f} s, {len(report.fused)} fused in {len(report.rewritten)} modules "
          f"{report.rewritten}, {len(report.untraced)} not rewritten whole")

    # names and order of parameters and buffers, the state dict both ways
    assert [n for n, _ in opt.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in opt.named_buffers()] == [n for n, _ in eager.named_buffers()]
    assert list(opt.state_dict()) == list(eager.state_dict())
    copy.deepcopy(opt).load_state_dict(eager.state_dict())
    copy.deepcopy(eager).load_state_dict(opt.state_dict())
    # every submodule still reachable by name keeps its class (or a subclass) and attributes
    exposed = dict(opt.named_modules())
    for name, sub in eager.named_modules():
        if name in exposed:
            assert isinstance(exposed[name], type(sub)), name
            _same_attrs(sub, exposed[name], name or arch)

    # outputs and gradients; what ran against what the report lists
    rewritten = {opt.get_submodule(p): p for p in report.rewritten}
    with _KitsuneOps(rewritten) as seen:
        got = _forward(opt, inputs, outputs)
    want = _forward(eager, inputs, outputs)
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"output {i}")
    assert seen.ops == _expected_ops(report, seen.calls, labelled="labels" in inputs), (dict(seen.ops), str(report))
    assert set(seen.calls) == set(report.rewritten), "a rewritten module never ran"
    _loss(got).backward()
    _loss(want).backward()
    grads = dict(eager.named_parameters())
    for name, p in opt.named_parameters():
        q = grads[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            _close(p.grad, q.grad, f"gradient of {name}", rtol=1e-3, atol=1e-4)   # sums over the batch
    bufs = dict(eager.named_buffers())
    for name, b in opt.named_buffers():
        _close(b.float(), bufs[name].float(), f"buffer {name}")


@pytest.mark.parametrize("arch", sorted(ZOO))
def test_optimize_follows_train_and_eval(arch):
    """Optimized in train mode, then switched to eval (and back): outputs follow eager's."""
    model, inputs, outputs = _build(arch, True)
    opt = kitsune.optimize(model)
    for training in (False, True):
        model.train(training), opt.train(training)
        with torch.no_grad():
            for i, (a, b) in enumerate(zip(_forward(opt, inputs, outputs), _forward(model, inputs, outputs))):
                _close(a, b, f"{'train' if training else 'eval'} output {i}")


@pytest.mark.parametrize("arch", sorted(ZOO))
def test_compile_backend(arch):
    """torch.compile(model, backend="kitsune") in eval mode: eager's outputs (torchvision's
    ViT adds a strided view: add_layer_norm's fake kernel must promise the real kernel's
    layout, or Inductor's assert_size_stride fires)."""
    model, inputs, outputs = _build(arch, False)
    t0 = time.perf_counter()
    with torch.no_grad():
        got = _forward(torch.compile(model, backend="kitsune"), inputs, outputs)
        took = time.perf_counter() - t0
        want = _forward(model, inputs, outputs)
    print(f"{arch}: torch.compile(backend='kitsune') {took:.1f} s")
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"output {i}")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("arch", sorted(ZOO))
def test_dynamo_path(arch, mode):
    """Kitsune's own Dynamo path, torch.compile(model, backend="kitsune",
    options={"inductor": False}): Dynamo's graphs rewritten with every pattern, forward
    and backward by AOTAutograd, run as fused and ATen ops, no Inductor. Outputs,
    gradients and buffers are eager's, the parameters' names and order the model's own
    (it is the model itself that is compiled)."""
    model, inputs, outputs = _build(arch, mode == "train")
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    got = _forward(torch.compile(model, backend="kitsune", options={"inductor": False}), inputs, outputs)
    took = time.perf_counter() - t0
    report = kitsune.fx.backend.last_compile_report
    want = _forward(eager, inputs, outputs)
    print(f"{arch} {mode}: Dynamo path {took:.1f} s, last graph: {len(report.fused)} fused")
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"output {i}")
    _loss(got).backward()
    _loss(want).backward()
    grads = dict(eager.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(grads)
    for name, p in model.named_parameters():
        q = grads[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            _close(p.grad, q.grad, f"gradient of {name}", rtol=1e-3, atol=1e-4)
    bufs = dict(eager.named_buffers())
    for name, b in model.named_buffers():
        _close(b.float(), bufs[name].float(), f"buffer {name}")


def test_dynamo_path_fuses_batch_norms_and_refuses_unknown_options():
    """Dynamo spells nn.BatchNorm as F.batch_norm: relu(batch_norm) and
    relu(batch_norm + r) are fused there too; an unknown backend option is refused."""
    model, inputs, outputs = _build("tv_resnet18", True)
    torch._dynamo.reset()
    _forward(torch.compile(model, backend="kitsune", options={"inductor": False}), inputs, outputs)
    fused = [what for _, what in kitsune.fx.backend.last_compile_report.fused]
    assert sum("-> batch_norm_relu" in w for w in fused) == 9, fused
    assert sum("-> batch_norm_add_relu" in w for w in fused) == 8, fused
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option"):
        torch.compile(model, backend="kitsune", options={"fast": True})(**inputs)


def test_explain_dynamo_lists_graph_breaks_and_fusions():
    """explain(model, *inputs, dynamo=True) says what the Dynamo path fuses in each graph
    and where Dynamo broke the graph and why; the model's buffers are as before."""
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.bn = nn.Linear(8, 8), nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            print("a graph break")   # noqa: T201 - Dynamo breaks the graph here
            return torch.relu(self.bn(self.b(h)))

    m = Breaks().train()
    before = copy.deepcopy(m.state_dict())
    report = kitsune.explain(m, torch.randn(4, 8), dynamo=True)
    assert len(report.breaks) == 1 and "print" in report.breaks[0][0] and "test_zoo.py" in report.breaks[0][1], \
        report.breaks
    whats = [w for _, w in report.fused]
    assert any("linear_act" in w for w in whats) and any("batch_norm_relu" in w for w in whats), str(report)
    assert "1 graph break" in str(report)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(TypeError, match="example inputs are for dynamo=True"):
        kitsune.explain(m, torch.randn(4, 8))
