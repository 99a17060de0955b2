"""kitsune.optimize / kitsune.explain on CPU: every spelling of every pattern is
rewritten, outputs stay equal, and what is left comes with a reason. (The rewritten
graph runs the ops' CPU reference kernels here; the GPU kernels are checked
against the same references in test_ops.py.)"""
import copy
import math
import sys

import pytest

from support import gpu

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
import kitsune.ops as ko  # noqa: E402
from models import GPT2Block, LlamaBlock  # noqa: E402

nn, F = torch.nn, torch.nn.functional



def _kinds(report):
    """The fused op of each entry of a Report, in order ("relu(a + b) -> add_relu" -> "add_relu")."""
    return [what.split(" -> ")[1].split(" ")[0] for _, what in report.fused]


class Spellings(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.relu, self.relu_ip, self.tanh = nn.ReLU(), nn.ReLU(inplace=True), nn.Tanh()
        self.gelu, self.silu = nn.GELU(approximate="tanh"), nn.SiLU()
        self.bias = nn.Parameter(torch.randn(d))
        self.norm = nn.RMSNorm(d, eps=1e-6)

    def forward(self, x, y):
        a = self.relu(x + y)             # module
        b = F.relu(torch.add(x, y))      # function, torch.add
        c = (x + y).relu()               # method
        d = torch.relu_(x.add(y))        # in-place function on a fresh sum
        e = self.relu_ip(x + y)          # in-place module
        t1, t2 = self.tanh(x * y), torch.tanh(torch.mul(x, y))
        g1 = self.gelu(self.l1(x))       # Linear + GELU
        g2 = F.gelu(x + self.bias)       # bias add + gelu
        s1 = F.silu(self.l2(x)) * self.l3(y)
        s2 = y * self.silu(x)
        n = self.norm(x)
        return a + b + c + d + e + t1 + t2 + g1 + g2 + s1 + s2 + n


def test_every_spelling_is_fused_and_outputs_match():
    torch.manual_seed(0)
    m = Spellings().eval()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    report = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=report)
    torch.testing.assert_close(opt(x, y), m(x, y), rtol=1e-5, atol=1e-5)
    kinds = _kinds(report)
    assert kinds.count("add_relu") == 5, report
    assert kinds.count("mul_tanh") == 2, report
    assert kinds.count("bias_gelu") == 1, report            # g2; g1's tanh GELU after a Linear:
    assert kinds.count("linear_act(gelu_tanh)") == 1, report  # one GEMM with the GELU epilogue
    assert kinds.count("swiglu") == 2, report
    assert kinds.count("kitsune.rms_norm") == 1, report
    code = opt.code
    for gone in ("torch.relu", "torch.tanh", "F.silu", "rms_norm(x, (16,)"):
        assert gone not in code, code
    # explain reports the same and changes nothing
    assert str(kitsune.explain(m)).splitlines()[0] == str(report).splitlines()[0]
    assert isinstance(m, Spellings)


class Left(nn.Module):
    def __init__(self):
        super().__init__()
        self.nb = nn.Linear(8, 8, bias=False)
        self.norm = nn.RMSNorm(8)   # eps=None

    def forward(self, x, y):
        s = x + y
        a = torch.relu(s) + s            # the sum is read twice
        b = torch.relu(x + 1.0)          # a number operand
        c = F.gelu(self.nb(x))           # no bias
        d = torch.relu(torch.add(x, y, alpha=2))
        x2 = x * 1
        x2 += y                          # in-place add whose operand is read again below
        e = torch.relu(x2) + x2
        return a + b + c + d + e + self.norm(x)


def test_what_is_left_says_why():
    m = Left()
    rep = kitsune.explain(m)
    text = str(rep)
    for why in ("also used elsewhere", "Python number operand", "no bias to fuse", "extra arguments",
                "eps=None"):
        assert why in text, text
    assert not rep.fused, text
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(kitsune.optimize(m)(x, y), m(x, y))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x):
        if x.sum() > 0:                  # data-dependent control flow: torch.fx cannot trace it
            return self.inner(x)
        return -self.inner(x)


def test_untraceable_modules_fall_back_to_their_children():
    m = Untraceable()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert rep.untraced and rep.untraced[0][0] == "Untraceable", rep
    assert len(rep.fused) == 1 and "bias_gelu" in rep.fused[0][1], rep
    x = torch.randn(2, 8)
    torch.testing.assert_close(opt(x), m(x))
    torch.testing.assert_close(opt(-x), m(-x))


class _Mlp(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d, bias=False)
        self.width = 4 * d   # a plain attribute

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class _Gpt2Like(nn.Module):
    """As Hugging Face's GPT-2 block: untraceable (it reads its children's attributes and
    branches on the data), with children the rest of the model reads: a Dropout's p, a
    LayerNorm's eps, a rewritable MLP's plain attribute and methods."""

    def __init__(self, d=8):
        super().__init__()
        self.ln = nn.LayerNorm(d, eps=1e-6)
        self.attn_dropout = nn.Dropout(0.0)
        self.mlp = _Mlp(d)
        self.head = nn.Linear(d, d, bias=False)
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x):
        assert self.ln.eps == 1e-6 and self.mlp.width == 4 * x.shape[-1]
        p = self.attn_dropout.p if self.training else 0.0
        h = F.dropout(self.ln(x), p, self.training) * self.scale
        if h.sum() > 1e9:   # data-dependent: torch.fx cannot trace it
            h = -h
        return self.head(h + self.mlp(h))


def test_a_rewritten_child_keeps_the_models_attributes_order_and_class():
    """Only the child that fuses is rewritten (the MLP; the Dropout and LayerNorm the parent
    reads are untouched), and it stays the same object with its class (a subclass),
    attributes and parameters; named_parameters, named_buffers and state_dict keep the
    original's names and order; deepcopy and torch.save/load keep it all, rewritten."""
    import io
    torch.manual_seed(3)
    m = _Gpt2Like()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert rep.rewritten == ["mlp"] and _kinds(rep) == ["bias_gelu"], rep
    assert type(opt) is _Gpt2Like and type(opt.ln) is nn.LayerNorm and type(opt.attn_dropout) is nn.Dropout
    assert isinstance(opt.mlp, _Mlp) and isinstance(opt.mlp, torch.fx.GraphModule) and "bias_gelu" in opt.mlp.code
    assert {k: v for k, v in vars(opt.mlp).items() if k in vars(m.mlp)}.keys() == vars(m.mlp).keys()
    assert opt.mlp.width == 32 and list(opt.mlp._modules) == ["fc", "proj"]
    for a, b in ((opt, m), (copy.deepcopy(opt), m)):
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
        assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
        assert list(a.state_dict()) == list(b.state_dict())
    x = torch.randn(3, 8)
    for train in (True, False):
        m.train(train), opt.train(train)
        _same_outputs_and_grads(opt, m, x)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back.mlp, torch.fx.GraphModule) and "bias_gelu" in back.mlp.code
    torch.testing.assert_close(back(x), m(x))
    for c in (copy.deepcopy(opt.mlp), copy.copy(opt.mlp)):
        assert type(c) is not type(opt.mlp) and c.width == 32   # a class of its own, as GraphModule's
        torch.testing.assert_close(c(x), m.mlp(x))


class _Optional(nn.Module):
    """Optional arguments: `bias` decides a branch on `is None` (a trace with it given
    would freeze that branch), `scale` is only read."""

    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.default = nn.Parameter(torch.randn(d))

    def forward(self, x, bias=None):
        if bias is None:
            bias = self.default
        return F.gelu(self.fc(x) + bias)


class _ReadsOptional(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, scale=None):
        return F.relu(self.fc(x) + 1.0) * scale


class _TakesOptional(nn.Module):
    def __init__(self):
        super().__init__()
        self.opt, self.reads = _Optional(), _ReadsOptional()

    def forward(self, x):
        if x.sum() > 1e9:   # untraceable: its children are tried
            return x
        return self.opt(x) + self.opt(x, -x) + self.reads(x, 2.0)


def test_an_optional_argument_is_never_frozen():
    """A module whose graph differs when an optional argument is None is not rewritten (its
    children are: the Linear alone), and explain says why; one that only reads the
    argument is rewritten. Calls with and without the argument equal eager."""
    torch.manual_seed(4)
    m = _TakesOptional()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert ("opt", "the graph differs when bias is None") in rep.untraced, rep
    assert rep.rewritten == ["opt.fc", "reads"], rep
    assert str(kitsune.explain(m)) == str(rep)
    x = torch.randn(3, 8)
    torch.testing.assert_close(opt(x), m(x))
    torch.testing.assert_close(opt.opt(x), m.opt(x))
    torch.testing.assert_close(opt.opt(x, x), m.opt(x, x))


def _twice_when(x, training):
    return x * 2 if training else x


torch.fx.wrap("_twice_when")


class _Modes(nn.Module):
    """Mode-dependent: a Python branch on self.training (frozen by a trace: not rewritten),
    and a wrapped function given self.training (a run-time read of the mode)."""

    def __init__(self, d=8):
        super().__init__()
        self.branchy, self.fc = _Branchy(d), nn.Linear(d, d)

    def forward(self, x):
        return _twice_when(F.relu(self.fc(x)), self.training) + self.branchy(x)


class _Branchy(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = F.relu(self.fc(x))
        return h * 3 if self.training else h


def test_a_mode_branch_is_never_frozen():
    torch.manual_seed(5)
    m = _Modes()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)   # in train mode
    why = "its forward branches on self.training (the graphs of train and eval mode differ)"
    assert rep.untraced == [("_Modes", why), ("branchy", why)], rep
    assert rep.rewritten == ["branchy.fc", "fc"], rep   # each Linear taken alone
    x = torch.randn(3, 8)
    for train in (True, False, True):
        m.train(train), opt.train(train)
        torch.testing.assert_close(opt(x), m(x))
    flat = nn.Sequential()
    flat.fc, flat.relu = m.fc, nn.ReLU()
    gm = kitsune.optimize(_OnlyWrapped(flat))
    assert "getattr(self, 'training')" in gm.code or "self.training" in gm.code, gm.code
    for train in (True, False):
        gm.train(train)
        torch.testing.assert_close(gm(x), _twice_when(F.relu(m.fc(x)), train))


class _OnlyWrapped(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return _twice_when(self.body(x), self.training)


def test_mha_out_proj_is_not_listed():
    """nn.MultiheadAttention reads out_proj's weight and bias and never calls it: explain
    and optimize leave it (it would never run), with why; nn.TransformerEncoderLayer
    (batch_first) keeps its fast path's attributes in eval mode."""
    torch.manual_seed(6)
    m = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    rep = kitsune.explain(m)
    assert not any("out_proj" in w for w, _ in rep.fused), rep
    assert ("self_attn.out_proj", "not rewritten: MultiheadAttention never calls it (its code only builds, aliases "
                                  "or reads it)") in rep.left, rep
    assert rep.rewritten == ["linear1", "linear2"], rep
    opt = kitsune.optimize(m)
    x = torch.randn(2, 5, 16)
    for train in (True, False):
        m.train(train), opt.train(train)
        torch.testing.assert_close(opt(x), m(x))
        with torch.no_grad():
            torch.testing.assert_close(opt(x), m(x))


class _Counts(nn.Module):
    """Changes a buffer in place in its forward, outside any torch.fx proxy."""

    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return F.relu(self.fc(x))


class _Caches(nn.Module):
    """Fills a cache on its first call (timm's LeViT keeps attention biases so)."""

    def __init__(self, d=8):
        super().__init__()
        self.fc, self.cache = nn.Linear(d, d), {}

    def forward(self, x):
        if "b" not in self.cache:
            self.cache["b"] = self.fc.bias.detach() * 2
        return F.relu(self.fc(x) + self.cache["b"])


class _BatchNormRelu(nn.BatchNorm1d):   # as timm's BatchNormAct: a BatchNorm subclass from elsewhere
    def forward(self, x):
        return F.relu(super().forward(x))


def _hit(mod, args, out):
    mod.hits += 1


class _Hooked(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.counts, self.hooked, self.norm = _Counts(d), nn.Sequential(nn.Linear(d, d), nn.ReLU()), _BatchNormRelu(d)
        self.hooked[0].hits = 0
        self.hooked[0].register_forward_hook(_hit)

    def forward(self, x):
        return self.norm(self.counts(x) + self.hooked(x))


def test_state_changes_hooks_and_batch_norm_subclasses_are_kept():
    """A forward that changes a buffer or a cache in place (torch.fx would run it once, at
    trace time) is not rewritten, and tracing leaves both as they were; a hook on a submodule the
    rewrite would inline keeps it from being rewritten (the hooked Linear alone is: its
    own hook runs); a BatchNorm subclass stays a module call, its statistics its own."""
    torch.manual_seed(7)
    m = _Hooked()
    rep = kitsune.explain(m)
    assert int(m.counts.calls) == 0 and m.norm.num_batches_tracked == 0
    opt = kitsune.optimize(m)
    why = dict(rep.untraced)
    assert "changes counts.calls in place" in why["_Hooked"] and "changes calls in place" in why["counts"], rep
    assert why["hooked"] == "its submodule 0 has hooks, which a rewritten forward would skip", rep
    assert rep.rewritten == ["counts.fc", "hooked.0"], rep
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), m(x))
    assert int(opt.counts.calls) == int(m.counts.calls) == 1 and opt.hooked[0].hits == m.hooked[0].hits == 1
    assert opt.norm.num_batches_tracked == m.norm.num_batches_tracked == 1
    torch.testing.assert_close(opt.norm.running_mean, m.norm.running_mean)
    cached = _Caches()
    rep = kitsune.explain(cached)
    assert "changes cache in place" in dict(rep.untraced)["_Caches"] and cached.cache == {}, rep   # no proxy kept
    torch.testing.assert_close(kitsune.optimize(cached)(x), cached(x))
    free = nn.Sequential(nn.Linear(8, 8), _BatchNormRelu(8))
    rep = kitsune.fx.Report()
    gm = kitsune.optimize(free, report=rep)
    assert rep.rewritten == [""] and "norm" not in str(rep), rep   # the subclass: a call, not inlined
    for train in (True, False):
        free.train(train), gm.train(train)
        torch.testing.assert_close(gm(x), free(x))


class BasicBlock(nn.Module):   # torchvision's ResNet BasicBlock, as written there
    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class GPT2LM(nn.Module):
    """Two GPT-2 blocks, a final LayerNorm and a loss head (next-token loss on the input)."""
    def __init__(self, d=32, vocab=257):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(16, d) * 0.02)
        self.blocks = nn.Sequential(GPT2Block(d), GPT2Block(d))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.blocks(self.emb(idx) + self.pos[: idx.shape[1]])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def _mlp():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


@pytest.mark.parametrize("make,shape,want", [
    (GPT2Block, (2, 5, 32), {"linear_act(gelu_tanh)": 1, "add_layer_norm": 1, "linear_act(none)": 3}),
    (LlamaBlock, (2, 5, 32), {"kitsune.rms_norm": 2, "swiglu": 1}),
    (BasicBlock, (2, 8, 6, 6), {"batch_norm_relu": 1, "batch_norm_add_relu": 1}),
])
def test_model_blocks(make, shape, want):
    torch.manual_seed(1)
    m = make().eval()
    x = torch.randn(shape)
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = _kinds(rep)
    for k, n in want.items():
        assert kinds.count(k) == n, rep
    torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-5)
    # training: gradients flow through the fused ops' autograd
    m.train(), opt.train()
    for p in m.parameters():
        p.grad = None
    xo = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    opt(xo).square().sum().backward()
    m(xr).square().sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-4, atol=1e-4)


class OwnForward(nn.Linear):   # a Linear subclass whose forward is not F.linear
    def forward(self, x):
        return super().forward(x) * 2


OwnForward.__module__ = "torch.nn.modules.linear"   # so torch.fx keeps it a leaf module, as it keeps torch.nn's


class Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.nob, self.own = nn.Linear(6, 5), nn.Linear(5, 5, bias=False), OwnForward(5, 4)
        self.w, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.nob(self.a(input=x))   # keyword input
        return (F.linear(F.relu(self.own(h)), self.w, self.b), F.linear(h, self.w[:, :1].expand(3, 5)),
                F.linear(input=h, weight=self.w[:, :1].expand(3, 5), bias=self.b))


def test_plain_linears_become_linear_act_none():
    """A Linear with a bias that no other pattern takes (module or F.linear) becomes
    linear_act(..., "none"); a Linear without a bias, F.linear without one, and a subclass
    with its own forward stay (relu(subclass) is not fused either). Outputs and every
    gradient equal the original's in fp64; explain reports exactly what optimize did;
    the torch.compile backend leaves plain Linears to Inductor."""
    import kitsune.fx as kfx
    torch.manual_seed(13)
    m = Linears().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert sorted(where for where, _ in rep.fused) == ["a", "linear", "linear_2"], rep
    assert set(_kinds(rep)) == {"linear_act(none)"} and str(kitsune.explain(m)) == str(rep)
    assert "self.own(" in opt.code and opt.code.count("linear_act(") == 3, opt.code
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    outs, refs = opt(x), m(x)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r)
    got = torch.autograd.grad(sum(o.square().sum() for o in outs), [x] + list(opt.parameters()))
    want = torch.autograd.grad(sum(r.square().sum() for r in refs), [x] + list(m.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.compile(_mlp(), backend="kitsune")(torch.randn(4, 784))
    assert "linear_act(none)" not in _kinds(kfx.last_compile_report), kfx.last_compile_report


class NormsAndLosses(nn.Module):
    def __init__(self, d=16, v=11):
        super().__init__()
        self.ln, self.ln2, self.relu = nn.LayerNorm(d), nn.LayerNorm(d, elementwise_affine=False), nn.ReLU()
        self.w, self.b = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))
        self.head, self.head2 = nn.Linear(d, v), nn.Linear(d, v, bias=False)

    def forward(self, x, r, t):
        a = self.relu(self.ln(x))                                   # relu(nn.LayerNorm)
        b = F.relu(F.layer_norm(x, (x.shape[-1],), self.w, self.b))  # shape from the graph: left
        c = F.layer_norm(x, (16,), self.w, self.b, 1e-6).relu()     # function + method
        h = x + r
        y = self.ln2(h)                                             # add_layer_norm, h reused below
        z = F.layer_norm(x + self.b, (16,), self.w, self.b)         # broadcast add: the bias expanded
        logits = self.head(a + b + c + y + z + h)
        l1 = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=3)
        l2 = F.cross_entropy(F.linear(h.reshape(-1, 16), self.head2.weight), t.reshape(-1), label_smoothing=0.1)
        lg = self.head2(y)
        l3 = F.cross_entropy(lg.view(-1, 11), t.view(-1))          # logits also returned: cross_entropy
        return l1 + l2 + l3, lg


def test_norm_and_loss_patterns_fuse_and_match():
    torch.manual_seed(4)
    m = NormsAndLosses()
    x, r = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    t = torch.randint(0, 11, (2, 5))
    m = m.double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = sorted(_kinds(rep))
    assert kinds == ["add_layer_norm", "add_layer_norm", "kitsune.cross_entropy", "layer_norm_relu",
                     "layer_norm_relu", "linear_cross_entropy", "linear_cross_entropy"], rep
    text = str(rep)
    assert "normalized_shape computed in the graph" in text and "also used elsewhere" in text, text
    got, want = opt(x, r, t), m(x, r, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    xs = [v.clone().requires_grad_() for v in (x, r)]
    ys = [v.clone().requires_grad_() for v in (x, r)]
    ga = torch.autograd.grad(opt(*xs, t)[0], xs + list(opt.parameters()))
    gb = torch.autograd.grad(m(*ys, t)[0], ys + list(m.parameters()))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


def test_add_layer_norm_expands_a_broadcast_operand(monkeypatch):
    """layer_norm(a + b) where one operand broadcasts to the other's shape (GPT's
    position table over a batch of sequences, either order) runs as add_layer_norm on
    the expanded operand; values and every gradient equal the unfused ops', the
    broadcast operand's summed back to its shape. Shapes that only broadcast together
    (neither is the result's) stay unfused."""
    from kitsune.fx.patterns.norms import _add_layer_norm
    import kitsune.ops as ko
    calls = []
    real = ko.add_layer_norm
    monkeypatch.setattr(ko, "add_layer_norm", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    w, bias = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    for sa, sb, fused in [((3, 5, 8), (5, 8), True), ((5, 8), (3, 5, 8), True), ((3, 1, 8), (5, 8), False)]:
        a = torch.randn(sa, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(sb, generator=g, dtype=torch.float64, requires_grad=True)
        wp, bp = w.clone().requires_grad_(), bias.clone().requires_grad_()
        calls.clear()
        h, y = _add_layer_norm(a, b, wp, bp, 1e-5)
        assert len(calls) == int(fused), (sa, sb, calls)
        h0 = a + b
        y0 = F.layer_norm(h0, (8,), wp, bp, 1e-5)
        torch.testing.assert_close(h, h0)
        torch.testing.assert_close(y, y0)
        got = torch.autograd.grad((y * y0.detach()).sum() + h.sum(), (a, b, wp, bp))
        want = torch.autograd.grad((y0 * y0.detach()).sum() + h0.sum(), (a, b, wp, bp))
        for x1, x2 in zip(got, want):
            assert x1.shape == x2.shape
            torch.testing.assert_close(x1, x2)


@pytest.mark.parametrize("make", [GPT2LM, LlamaBlock, NormsAndLosses, _mlp])
def test_under_autocast_fp32_parameters_meet_bf16_activations(make):
    """torch.autocast: Linear outputs are bf16 while norm weights stay fp32; the fused
    ops' autocast kernels cast the parameters, and forward and gradients match eager
    autocast within bf16 tolerance."""
    torch.manual_seed(5)
    m = make()
    if make is GPT2LM:
        args = (torch.randint(0, 257, (2, 16)),)
    elif make is LlamaBlock:
        args = (torch.randn(2, 5, 32),)
    elif make is _mlp:
        args = (torch.randn(8, 784),)
    else:
        args = (torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randint(0, 11, (2, 5)))
    opt = kitsune.optimize(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = opt(*args), m(*args)
        got, want = (got[0] if isinstance(got, tuple) else got), (want[0] if isinstance(want, tuple) else want)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
        names = [n for n, _ in m.named_parameters()]
        assert [n for n, _ in opt.named_parameters()] == names   # names and order kept
        po, pm = dict(opt.named_parameters()), dict(m.named_parameters())
        ga = torch.autograd.grad(got.float().sum(), [po[n] for n in names], allow_unused=True)
        gb = torch.autograd.grad(want.float().sum(), [pm[n] for n in names], allow_unused=True)
    for name, a, b in zip(names, ga, gb):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * max(1.0, b.abs().max().item()), msg=name)


@pytest.mark.parametrize("arch,fusions", [("resnet18", {"batch_norm_add_relu": 8, "batch_norm_relu": 9,
                                                       "linear_act(none)": 1, "kitsune.max_pool2d": 1,
                                                       "kitsune.global_avg_pool": 1, "foreach_add": 1}),
                                          ("resnet50", {"batch_norm_add_relu": 16, "batch_norm_relu": 33,
                                                        "linear_act(none)": 1,
                                                        "kitsune.max_pool2d": 1, "kitsune.global_avg_pool": 1,
                                                        "foreach_add": 1})])
def test_torchvision_resnets_as_shipped(arch, fusions):
    """torchvision's ResNet-18/50 (random weights): each `relu(bn(conv(x)))` becomes
    batch_norm_relu, each block's `out = bn(...); out += identity; relu(out)` batch_norm_add_relu, the stem's
    max pooling kitsune.max_pool2d, the head's AdaptiveAvgPool2d((1, 1))
    kitsune.global_avg_pool and the BatchNorms' batch counts one foreach add; in train
    mode outputs, running stats and input gradients equal the original's, in eval mode
    outputs."""
    tvm = pytest.importorskip("torchvision.models")
    from collections import Counter
    torch.manual_seed(6)
    m = getattr(tvm, arch)()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = Counter(_kinds(rep))
    assert kinds == fusions and not rep.left and not rep.untraced, rep
    m, opt = m.double(), opt.double()   # fp64: differences are the kernels', not fp32 rounding over 50 layers
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yr = opt(xo), m(xr)   # train mode: batch statistics, running stats updated
    torch.testing.assert_close(yo, yr)
    bufs = dict(m.named_buffers())
    for name, t in opt.named_buffers():
        torch.testing.assert_close(t, bufs[name], msg=name)
    yo.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad)
    m.eval(), opt.eval()
    torch.testing.assert_close(opt(x), m(x))


class _Norms(nn.Module):
    """BatchNorms that count in one add (a under a ReLU, b), one called twice (d) and
    one without a momentum (c), which keep their own."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.d = nn.BatchNorm2d(4), nn.BatchNorm2d(4, momentum=0.3), nn.BatchNorm2d(4)
        self.c = nn.BatchNorm2d(4, momentum=None)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.b(h) + self.d(h)
        return self.c(self.d(h))


def test_batch_norms_count_their_batches_in_one_add():
    """Two BatchNorms count in one _count_batches node; in train mode outputs, gradients
    and every buffer (running stats, num_batches_tracked) follow the original's step by
    step, in eval mode nothing counts, and a momentum set to None afterwards counts
    where nn.BatchNorm would."""
    torch.manual_seed(11)
    m = _Norms()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["batch_norm_relu", "foreach_add"] and "(2 modules)" in rep.fused[1][1], rep
    counters = [n for n in opt.graph.nodes if n.target is kitsune.fx.patterns.batch_norm._count_batches]
    assert len(counters) == 1 and [a.target for a in counters[0].args] == ["a", "b"]
    assert sorted(n.target for n in opt.graph.nodes if n.op == "call_module") == ["c", "d", "d"]

    def same(train, momentum_b=0.3):
        m.train(train), opt.train(train)
        m.b.momentum = opt.b.momentum = momentum_b
        x = torch.randn(3, 4, 5, 5)
        xo, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, ym = opt(xo), m(xm)
        torch.testing.assert_close(yo, ym, rtol=1e-5, atol=1e-6)
        yo.square().sum().backward()
        ym.square().sum().backward()
        torch.testing.assert_close(xo.grad, xm.grad, rtol=1e-4, atol=1e-5)
        bufs = dict(m.named_buffers())
        for name, t in opt.named_buffers():
            torch.testing.assert_close(t, bufs[name], rtol=1e-5, atol=1e-6, msg=name)
    for _ in range(3):
        same(True)
    assert [int(opt.get_submodule(k).num_batches_tracked) for k in "abcd"] == [3, 3, 3, 6]
    same(False)
    assert int(opt.a.num_batches_tracked) == 3
    same(True, momentum_b=None)   # b now reads its count: its forward makes the add, the node skips it
    assert [int(opt.get_submodule(k).num_batches_tracked) for k in "abcd"] == [4, 4, 4, 8]


class _ResidualEnd(nn.Module):
    """relu(bn(conv(x)) += r), fused; then relu(bn2(h) + r) where bn2's output is also
    read elsewhere, which stays add_relu."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x, r):
        out = self.bn(self.conv(x))
        out += r
        h = torch.relu(out)
        y = self.bn2(h)
        return torch.relu(y + r) + y


def test_batch_norm_plus_residual_under_relu_becomes_batch_norm_add_relu():
    """relu(bn(x) + r) -> batch_norm_add_relu when bn's output has no other reader; in
    train mode outputs, gradients (x, r, parameters) and buffers equal the original's,
    with r of x's shape (the fused op) and broadcast over (C, 1, 1) (the unfused ops)."""
    torch.manual_seed(15)
    m = _ResidualEnd()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["batch_norm_add_relu", "add_relu", "foreach_add"], rep
    for rshape in [(2, 4, 6, 6), (4, 1, 1)]:
        x, r = torch.randn(2, 4, 6, 6), torch.randn(rshape)
        xo, ro, xm, rm = (t.clone().requires_grad_() for t in (x, r, x, r))
        yo, ym = opt(xo, ro), m(xm, rm)
        torch.testing.assert_close(yo, ym, rtol=1e-5, atol=1e-5)
        go = torch.randn(yo.shape)
        names = [n for n, _ in m.named_parameters()]
        po, pm = dict(opt.named_parameters()), dict(m.named_parameters())
        got = torch.autograd.grad(yo, [xo, ro] + [po[n] for n in names], go)
        want = torch.autograd.grad(ym, [xm, rm] + [pm[n] for n in names], go)
        for k, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{rshape} gradient {k}")
        bufs = dict(m.named_buffers())
        for name, t in opt.named_buffers():
            torch.testing.assert_close(t, bufs[name], rtol=1e-5, atol=1e-6, msg=name)


def test_mlp_relu_linear_becomes_linear_act():
    torch.manual_seed(9)
    m = _mlp()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = _kinds(rep)
    assert kinds == ["linear_act", "linear_act", "linear_act(none)"], rep   # the last Linear has no ReLU
    x = torch.randn(64, 784)
    torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-5)
    opt(x).square().sum().backward()
    m(x).square().sum().backward()
    for name, p in opt.named_parameters():
        torch.testing.assert_close(p.grad, dict(m.named_parameters())[name].grad, rtol=1e-4, atol=1e-5, msg=name)


class ConvBiases(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.c1 = nn.Conv2d(3, c, 3, padding=1)                        # + nn.ReLU: relu fused
        self.c2 = nn.Conv2d(c, c, 1)                                   # no activation
        self.c3 = nn.Conv2d(c, c, 3, padding="same", groups=2)         # + F.relu, its output also read: relu kept
        self.c4 = nn.Conv2d(c, c, 3, padding=1, bias=False)            # no bias: as written
        self.c5 = nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect")  # left, with the reason
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        a = self.relu(self.c1(x))
        b = self.c2(a)
        y = self.c3(b)
        c = F.relu(y) + y
        return self.c5(self.c4(c)).relu()


def _same_outputs_and_grads(opt, m, x):
    """opt(x) equals m(x), and so do the gradients of a loss on it, input's and parameters'."""
    torch.testing.assert_close(opt(x), m(x))
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    go = torch.autograd.grad(opt(xo).square().sum(), [xo] + list(opt.parameters()))
    gr = torch.autograd.grad(m(xr).square().sum(), [xr] + list(m.parameters()))
    for a, b in zip(go, gr):
        torch.testing.assert_close(a, b)


def test_conv_bias_splits_into_channel_bias_and_takes_the_relu():
    torch.manual_seed(12)
    m = ConvBiases().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["channel_bias", "channel_bias", "channel_bias"], rep
    assert [w.split(" bias")[0] for _, w in rep.fused] == ["relu(conv2d)", "conv2d", "conv2d"], rep
    assert "padding_mode='reflect' (only 'zeros' is split)" in str(rep), rep
    _same_outputs_and_grads(opt, m, torch.randn(2, 3, 9, 7, dtype=torch.float64))
    assert opt.state_dict().keys() == m.state_dict().keys()   # checkpoints load either way


class PoolBlocks(nn.Module):
    """LeNet's conv -> relu -> 2x2 max pool in each spelling, and poolings that bias_relu_pool
    leaves (they become channel_bias, then kitsune.max_pool2d)."""
    def __init__(self):
        super().__init__()
        self.c = nn.ModuleList(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1) for i in range(7))
        self.pool, self.pool_pad = nn.MaxPool2d(2), nn.MaxPool2d(2, padding=1)

    def forward(self, x):
        c = self.c
        x = F.max_pool2d(F.relu(c[0](x)), 2)                                 # taken
        x = self.pool(torch.relu(c[1](x)))                                   # taken (module)
        x = torch.max_pool2d(c[2](x).relu(), kernel_size=(2, 1), stride=(2, 1))   # taken, 2 x 1
        x = F.max_pool2d(F.relu(c[3](x)), 2, stride=1)                       # overlapping: channel_bias
        x = self.pool_pad(F.relu(c[4](x)))                                   # padding: channel_bias
        x = F.max_pool2d(F.relu(c[5](x)), 2, ceil_mode=True)                 # ceil mode: channel_bias
        return F.max_pool2d(F.relu(c[6](x)), 1)                              # a 1 x 1 window: taken


def test_conv_relu_max_pool_becomes_bias_relu_pool():
    torch.manual_seed(13)
    m = PoolBlocks().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["bias_relu_pool"] * 3 + ["channel_bias", "kitsune.max_pool2d"] * 3 + ["bias_relu_pool"], rep
    _same_outputs_and_grads(opt, m, torch.randn(2, 3, 32, 20, dtype=torch.float64))
    assert str(kitsune.explain(m)) == str(rep)


class Pools(nn.Module):
    """Max poolings in each spelling, and the ones kitsune.max_pool2d leaves."""
    def __init__(self):
        super().__init__()
        self.inc, self.down = nn.MaxPool2d(3, 1, 1), nn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True)
        self.dilated, self.indexed = nn.MaxPool2d(2, dilation=2), nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        x = self.down(self.inc(x))                                            # taken, both
        x = F.max_pool2d(x, (2, 3), 1, padding=(1, 1)) + torch.max_pool2d(x, (2, 3), 1, (1, 1))   # taken, both
        x = F.max_pool2d(x, kernel_size=3, stride=2, ceil_mode=True)          # taken
        x = x[..., 1:-1, 1:-1] + F.max_pool2d(x, 3, 1, 1, 2)                  # dilation 2: left
        x = self.dilated(x)                                                   # left
        y, idx = self.indexed(x)                                              # indices: left
        return F.max_pool2d(y, x.size(-1) // 5) + idx.sum()                   # size computed: left


def _backend_fuses_nothing(module):
    """The torch.compile backend's rewrite alone (Inductor's compile stubbed out) fuses
    nothing in module: what it leaves to Inductor."""
    import torch._inductor.compile_fx as cfx
    orig, cfx.compile_fx = cfx.compile_fx, lambda gm, inputs: gm.forward
    try:
        kitsune.fx.kitsune_backend(torch.fx.symbolic_trace(module), [])
    finally:
        cfx.compile_fx = orig
    assert not kitsune.fx.last_compile_report.fused, kitsune.fx.last_compile_report


def test_max_poolings_become_kitsune_max_pool2d():
    """Each 2-D max pooling with dilation 1 and no indices becomes kitsune.max_pool2d (or
    max_pool2d_branches where its input has other users) with its own geometry, outputs
    and gradients equal; the torch.compile backend leaves them to Inductor."""
    torch.manual_seed(14)
    m = Pools().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    # the first of two poolings of one x is its branch point; the second takes a view
    assert _kinds(rep) == ["kitsune.max_pool2d"] * 2 + ["kitsune.max_pool2d_branches"] + ["kitsune.max_pool2d"] * 2, rep
    _same_outputs_and_grads(opt, m, torch.randn(2, 3, 29, 30, dtype=torch.float64))
    _backend_fuses_nothing(Pools())


class _Shared(nn.Module):
    """x feeding a pooling and other users: one of which writes it in place (left), and
    one returned as is."""
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = x * 2
        a = F.max_pool2d(y, 3, 1, 1) + self.c(y)   # branch point
        z = x + 1
        z.mul_(2)   # z written in place: plain max_pool2d below
        b = F.max_pool2d(z, 3, 1, 1) + z * 3
        return a + b, y


def test_an_inception_blocks_pooling_becomes_its_branch_point():
    """kitsune.optimize on an Inception block: the pooling of the block input becomes
    max_pool2d_branches, the three convolutions take its views, and outputs and gradients
    equal the model's (fp64); an input written in place by another user keeps the plain
    pooling, and a use as a model output keeps x itself."""
    from models import Inception
    torch.manual_seed(16)
    m = Inception(8).double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert "kitsune.max_pool2d_branches" in _kinds(rep), rep
    assert any("the gradients of 3 other user(s) of x" in what for _, what in rep.fused), rep
    _same_outputs_and_grads(opt, m, torch.randn(2, 8, 9, 9, dtype=torch.float64))
    m = _Shared().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert [k for k in _kinds(rep) if "max_pool" in k] == ["kitsune.max_pool2d_branches", "kitsune.max_pool2d"], rep
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (a1, y1), (a2, y2) = opt(xa), m(xb)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(y1, y2)
    assert y1._base is None   # the returned y is y itself, not a view of the branch point
    g1 = torch.autograd.grad((a1.sum() + (y1 * y1).sum()), xa)[0]
    g2 = torch.autograd.grad((a2.sum() + (y2 * y2).sum()), xb)[0]
    torch.testing.assert_close(g1, g2)


class Means(nn.Module):
    """Means over H and W in each spelling, and the means global_avg_pool leaves."""
    def __init__(self):
        super().__init__()
        self.gap, self.gap2, self.two = nn.AdaptiveAvgPool2d(1), nn.AdaptiveAvgPool2d((1, 1)), nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        a = x.mean((2, 3)) + torch.mean(x, dim=[-1, -2])                       # taken, both
        b = self.gap(x).flatten(1) * self.gap2(x)[:, :, 0, 0]                  # taken, both
        c = F.adaptive_avg_pool2d(x, (1, 1)).squeeze(-1).squeeze(-1) + x.mean((3, 2), keepdim=True)[..., 0, 0]   # both
        d = x.mean((1, 2)).sum(-1, keepdim=True) + x.mean(3).mean(-1) + x.mean((2, 3), dtype=torch.float64)   # left
        return a + b + c + d + self.two(x).sum((2, 3)) + F.adaptive_avg_pool2d(x, (1, 2)).sum(-1).squeeze(-1)  # left


def test_means_over_h_and_w_become_global_avg_pool():
    """Each mean over the last two dims of a 4-D map (x.mean, torch.mean, adaptive average
    pooling to 1 x 1) becomes kitsune.global_avg_pool with its own dims and keepdim; other
    dims, a dtype or a larger output are left; outputs and gradients equal. A 3-D input
    (an unbatched map) takes ATen's mean through the op; the torch.compile backend leaves
    the means to Inductor."""
    torch.manual_seed(15)
    m = Means().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["kitsune.global_avg_pool"] * 6, rep
    _same_outputs_and_grads(opt, m, torch.randn(2, 3, 5, 6, dtype=torch.float64))
    x3 = torch.randn(3, 5, 6, dtype=torch.float64)
    gm = kitsune.optimize(nn.AdaptiveAvgPool2d(1))
    torch.testing.assert_close(gm(x3), F.adaptive_avg_pool2d(x3, 1))
    _backend_fuses_nothing(Means())


class Branches(nn.Module):
    """An Inception block, then a concatenation one of whose parts is used elsewhere."""
    def __init__(self):
        super().__init__()
        from models import Inception
        self.block, self.p, self.q = Inception(8), nn.Conv2d(32, 4, 1), nn.Conv2d(32, 4, 3, padding=1)

    def forward(self, x):
        y = self.block(x)
        p = self.p(y)
        return torch.cat((p, self.q(y)), dim=1) + p.sum()


def test_inception_branch_biases_and_cat_become_bias_cat():
    torch.manual_seed(15)
    m = Branches().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep).count("bias_cat") == 1, rep
    assert "cat(conv2d biases): a part is also used elsewhere" in str(rep), rep
    assert sum(n.target is kitsune.ops.bias_cat for n in opt.graph.nodes) == 1
    _same_outputs_and_grads(opt, m, torch.randn(2, 8, 9, 7, dtype=torch.float64))


class Unbatchable(nn.Module):
    """Conv2d layers take (C, H, W) input too: conv -> relu, conv -> relu -> 2x2 pool, and a
    cat of conv biases over dim 1 (the height, unbatched) and over dim 0."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.p, self.q = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.a(x))                       # channel_bias: 8 channels, an 8 x 8 image
        x = F.max_pool2d(F.relu(self.b(x)), 2)      # bias_relu_pool
        y = torch.cat([self.p(x), self.q(x)], 1)    # bias_cat over dim 1
        return y + torch.cat([self.p(x), self.q(x)], dim=0).sum()   # and over dim 0


def test_conv_rewrites_keep_unbatched_inputs():
    """An unbatched (C, H, W) input through the conv-bias rewrites gives the original's
    outputs and gradients (an 8 x 8 image with 8 channels once had the bias added over its
    height), batched input too; the optimized module traces again with torch.fx."""
    torch.manual_seed(16)
    m = Unbatchable().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep).count("bias_cat") == 2 and "bias_relu_pool" in _kinds(rep), rep
    for shape in ((3, 8, 8), (2, 3, 8, 8)):
        _same_outputs_and_grads(opt, m, torch.randn(shape, dtype=torch.float64))
        retraced = torch.fx.symbolic_trace(opt)
        x = torch.randn(shape, dtype=torch.float64)
        torch.testing.assert_close(retraced(x), m(x))


class HandAttention(nn.Module):
    """Attention written out by hand, as before scaled_dot_product_attention."""
    def __init__(self, d=32, h=4):
        super().__init__()
        self.qkv, self.h, self.scale, self.root = nn.Linear(d, 3 * d), h, 1.0 / (d // h) ** 0.5, (d // h) ** 0.5

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        s1 = (q @ k.transpose(-2, -1)) * self.scale                 # * a number
        s2 = torch.matmul(q, k.transpose(-1, -2)) / self.root       # / a number
        s4 = (q @ k.transpose(-2, -1)) / (d // self.h) ** 0.5       # scale from x.shape: a graph value, left
        s3 = 0.5 * (q @ k.mT)                                       # number first, .mT
        att = torch.softmax(s1 + s2 + s3 + s4, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, d)


def test_hand_written_attention_scores_fuse():
    torch.manual_seed(10)
    m = HandAttention().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = _kinds(rep)
    assert kinds == ["attention_score"] * 3 + ["linear_act(none)"], rep   # + the qkv Linear
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(opt(x), m(x))
    ga, = torch.autograd.grad(opt(x).sum(), x)
    gb, = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(ga, gb)


class ResidualDropout(nn.Module):
    def __init__(self, d=64, p=0.25):
        super().__init__()
        self.proj, self.fc, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(p)

    def forward(self, x, y):
        x = x + self.drop(self.proj(y))                         # nn.Dropout: read at run time
        return F.dropout(self.fc(x), 0.5, self.training) + x     # F.dropout(self.training): made live


def test_residual_dropout_fuses_and_follows_train_and_eval():
    torch.manual_seed(7)
    m = ResidualDropout()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)   # traced in train mode
    kinds = _kinds(rep)
    assert kinds == ["bias_dropout_add", "bias_dropout_add"], rep
    x, y = torch.randn(256, 64, dtype=torch.float64), torch.randn(256, 64, dtype=torch.float64)
    m, opt = m.double(), opt.double()
    m.eval(), opt.eval()
    torch.testing.assert_close(opt(x, y), m(x, y))   # eval: no dropout, equal
    opt.train()
    h = opt.proj(y)   # the first block alone: dropped positions leave exactly the residual
    torch.manual_seed(8)
    out = kitsune.fx.patterns.dropout._bias_dropout_add(y, opt.proj.weight, opt.proj.bias, x, 0.25, opt.drop)
    dropped = (out == x)
    frac = dropped.double().mean().item()
    assert abs(frac - 0.25) < 5 * (0.25 * 0.75 / dropped.numel()) ** 0.5, frac
    torch.testing.assert_close(out[~dropped], (x + h / 0.75)[~dropped])
    a, b = opt(x, y), opt(x, y)
    assert not torch.equal(a, b)   # train mode draws new masks
    a.sum().backward()
    assert opt.proj.weight.grad is not None and opt.fc.bias.grad is not None


class MlpDropout(nn.Module):
    """GPT-2's MLP with dropout, spelled two ways: nn.GELU + nn.Dropout, and F.gelu(tanh)
    + F.dropout(self.training)."""

    def __init__(self, d=32, p=0.2):
        super().__init__()
        self.fc, self.act, self.drop = nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.drop(self.act(self.fc(x)))
        return F.dropout(F.gelu(self.fc2(h), approximate="tanh"), 0.3, self.training)


def test_gelu_dropout_fuses_both_spellings_before_bias_gelu():
    torch.manual_seed(3)
    m = MlpDropout().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    kinds = _kinds(rep)
    # not bias_gelu: the bias stays in the GEMM (fc and fc2 become linear_act(none))
    assert kinds == ["gelu_dropout", "gelu_dropout", "linear_act(none)", "linear_act(none)"], rep
    x = torch.randn(64, 32, dtype=torch.float64)
    m.eval(), opt.eval()
    torch.testing.assert_close(opt(x), m(x))   # eval: no dropout
    opt.train()
    torch.manual_seed(4)
    got = opt(x)
    torch.manual_seed(4)   # the same draws, through the ops the rewrite calls
    h = kitsune.ops.gelu_dropout(opt.fc(x), 0.2, True, "none")
    want = kitsune.ops.gelu_dropout(opt.fc2(h), 0.3, True, "tanh")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    frac = (got == 0).double().mean().item()
    assert 0.2 < frac < 0.4, frac
    opt.drop.p = 0.0   # nn.Dropout's p is read at run time (the traced 0.5 is not used)
    h = kitsune.fx.patterns.dropout._gelu_dropout(opt.fc(x), 0.5, opt.drop, "none")
    torch.testing.assert_close(h, F.gelu(opt.fc(x)))
    got.sum().backward()
    assert opt.fc.weight.grad is not None and opt.fc2.bias.grad is not None


def test_gelu_with_other_users_is_left():
    class Two(nn.Module):
        def forward(self, x):
            g = F.gelu(x)
            return F.dropout(g, 0.1, self.training) + g

    rep = kitsune.fx.Report()
    kitsune.optimize(Two(), report=rep)
    assert any("dropout(gelu)" in why and "also used elsewhere" in why for _, why in rep.left), rep


def test_optimize_registers_the_backend_without_importing_dynamos_backends():
    """optimize() imports kitsune.fx, which registers the "kitsune" torch.compile backend.
    Asking Dynamo's list_backends() whether it is there first imports every backend module
    (Inductor's code cache, networkx: about 390 modules, 1.3-1.5 s of compile_step's setup
    on the H100 machine); the registration must not, and the backend must still resolve."""
    import subprocess
    code = (
        "import sys, torch, torch._dynamo, kitsune\n"
        "kitsune.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))\n"
        "pulled = [m for m in ('networkx', 'torch._inductor.codecache') if m in sys.modules]\n"
        "assert not pulled, pulled\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "import kitsune.fx\n"
        "assert lookup_backend('kitsune') is kitsune.fx.kitsune_backend\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_backend_entry_point_loads_where_dynamo_found_it_first():
    """The "kitsune" torch_dynamo_backends entry point names kitsune.fx.backend:kitsune_backend.
    Where Dynamo found it before kitsune.fx was imported, resolving the name loads it,
    importing kitsune.fx on the way: that import must leave the registration to Dynamo (a
    name registered twice fails Dynamo's duplicate-name assert), and the backend resolves
    to kitsune.fx.kitsune_backend."""
    import subprocess
    code = (
        "import sys\n"
        "from importlib.metadata import EntryPoint\n"
        "from torch._dynamo.backends import registry\n"
        "registry._BACKENDS['kitsune'] = EntryPoint('kitsune', 'kitsune.fx.backend:kitsune_backend', "
        "'torch_dynamo_backends')\n"
        "assert 'kitsune.fx' not in sys.modules\n"
        "fn = registry.lookup_backend('kitsune')\n"
        "import kitsune.fx\n"
        "assert fn is kitsune.fx.kitsune_backend\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_torch_compile_backend_rewrites_and_matches():
    """torch.compile(model, backend="kitsune"): the Dynamo graph is rewritten (modules
    arrive there as F.linear / F.gelu / torch.relu calls) and Inductor compiles the
    rest; forward and backward match eager."""
    import kitsune.fx as kfx
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.norm = m, nn.RMSNorm(16, eps=1e-6)

        def forward(self, x):
            return torch.relu(self.body(self.norm(x)) + x)

    model = Res()
    x = torch.randn(8, 16, requires_grad=True)
    comp = torch.compile(model, backend="kitsune")
    out = comp(x)
    ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    kinds = sorted(_kinds(kfx.last_compile_report))
    assert kinds == ["add_relu", "bias_gelu", "kitsune.rms_norm"], kfx.last_compile_report
    g1, = torch.autograd.grad(out.sum(), x)
    g2, = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_on_the_gpu_eager_and_compiled(dtype):
    """The rewritten GPT-2 and LLaMA blocks on the GPU (the fused CUDA kernels), eager
    and through torch.compile(backend="kitsune"), against the original blocks."""
    import kitsune.fx as kfx
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for make in (GPT2Block, LlamaBlock, GPT2LM):
        torch.manual_seed(3)
        m = make().cuda().to(dtype)
        x = torch.randn(4, 16, 32, device="cuda", dtype=dtype)
        if make is GPT2LM:
            x = torch.randint(0, 257, (4, 16), device="cuda")
        ref = m(x).float()
        torch.testing.assert_close(kitsune.optimize(m)(x).float(), ref, rtol=tol, atol=tol)
        out = torch.compile(m, backend="kitsune")(x).float()
        assert kfx.last_compile_report.fused, kfx.last_compile_report
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("make", ["mlp", "attention", "norms_losses"])
def test_compile_backend_traces_the_newer_ops(make):
    """torch.compile(backend="kitsune") through the C++ autograd kernels (linear_act),
    the runtime helpers (attention_score, add_layer_norm, linear_cross_entropy's
    autograd.Function) and their fakes: outputs and input gradients equal eager's."""
    import kitsune.fx as kfx
    torch.manual_seed(11)
    if make == "mlp":
        m, args, want = _mlp(), (torch.randn(8, 784),), {"linear_act"}
    elif make == "attention":
        m, args, want = HandAttention(), (torch.randn(2, 7, 32),), {"attention_score"}
    else:
        m = NormsAndLosses()
        args = (torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randint(0, 11, (2, 5)))
        want = {"add_layer_norm", "layer_norm_relu", "linear_cross_entropy"}
    first = lambda v: v[0] if isinstance(v, tuple) else v   # noqa: E731
    xa = args[0].clone().requires_grad_()
    xb = args[0].clone().requires_grad_()
    out = first(torch.compile(m, backend="kitsune")(xa, *args[1:]))
    kinds = set(_kinds(kfx.last_compile_report))
    assert want <= kinds, kfx.last_compile_report
    ref = first(m(xb, *args[1:]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ga, = torch.autograd.grad(out.sum(), xa)
    gb, = torch.autograd.grad(ref.sum(), xb)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


def test_functional_dropout_default_stays_as_written():
    """F.dropout(x, p) without a training argument drops in eval too (its default is
    True); optimize must keep that, not tie it to the module's mode."""
    class Always(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5) + F.dropout(x, 0.5, self.training)

    m = Always()
    opt = kitsune.optimize(m)   # traced in train mode
    m.eval(), opt.eval()
    x = torch.ones(4096)
    torch.manual_seed(0)
    a = opt(x)
    torch.manual_seed(0)
    b = m(x)
    torch.testing.assert_close(a, b)        # same draws: the first dropout still drops, the second does not
    assert (a == 1).float().mean() > 0.4    # about half the elements dropped by the first


class _OpsSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched inside it (names like "kitsune::cross_entropy")."""
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_fused_loss_runs_cross_entropy_as_kitsunes_where_it_covers_the_call():
    """FusedLoss (compile_step's loss mode): F.cross_entropy calls the op covers run as
    kitsune.cross_entropy, with the loss and logits' gradient of F.cross_entropy in
    fp64 (ignored rows, label smoothing, a view of 3-D logits), and under bf16 autocast
    (a float32 loss, as F.cross_entropy's there); the others run as given, each with
    its reason, and CPU calls are left unless asked for."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 7, 11, dtype=torch.float64, generator=g)
    target = torch.randint(0, 11, (3, 7), generator=g)
    target[0, :3] = 5   # ignored below
    w = torch.rand(11, dtype=torch.float64, generator=g)
    probs = torch.rand(7, 11, dtype=torch.float64, generator=g).softmax(1)

    def loss_fn(out, t):
        return F.cross_entropy(out.view(-1, out.size(-1)), t.view(-1), ignore_index=5, label_smoothing=0.1)

    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with kitsune.fx.FusedLoss(devices=("cpu",)) as mode, _OpsSeen() as seen:
        got = loss_fn(a, target)
    # logits that need a gradient: the loss and that gradient in one op
    assert mode.fused == 1 and mode.left == [] and "kitsune::cross_entropy_with_grad" in seen.names, seen.names
    assert not any(n.startswith("aten::nll_loss") or n.startswith("aten::_log_softmax") for n in seen.names)
    want = loss_fn(b, target)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)

    x2, t2 = logits[0], target[0]
    with kitsune.fx.FusedLoss(devices=("cpu",)) as mode:
        left = [F.cross_entropy(x2, t2, weight=w), F.cross_entropy(x2, t2, reduction="sum"),
                F.cross_entropy(logits.transpose(1, 2), target),            # (N, C, d) logits
                F.cross_entropy(x2, probs)]   # probabilities as targets
    assert mode.fused == 0 and len(mode.left) == 4, mode.left
    assert "class weights or a reduction other than 'mean'" in mode.left[0] == mode.left[1]
    assert mode.left[2] == mode.left[3] == "cross_entropy on other than 2-D float logits and int64 targets"
    torch.testing.assert_close(torch.stack(left), torch.stack([
        F.cross_entropy(x2, t2, weight=w), F.cross_entropy(x2, t2, reduction="sum"),
        F.cross_entropy(logits.transpose(1, 2), target), F.cross_entropy(x2, probs)]),
        rtol=0, atol=0)
    with kitsune.fx.FusedLoss() as mode:   # CUDA only by default
        F.cross_entropy(x2, t2)
    assert mode.fused == 0 and mode.left == ["cross_entropy on cpu (fused on cuda)"]
    # under autocast: fused too, the loss float32 as F.cross_entropy's, the bf16 logits' gradient bf16
    xb = logits[0].to(torch.bfloat16)
    a, b = xb.clone().requires_grad_(), xb.clone().requires_grad_()
    with kitsune.fx.FusedLoss(devices=("cpu",)) as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.cross_entropy(a, t2, label_smoothing=0.1)
    assert mode.fused == 1 and mode.left == [], mode.left
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(b, t2, label_smoothing=0.1)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)   # both fp32 arithmetic on the same bf16 values
    got.backward()
    want.backward()
    assert a.grad.dtype == b.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-3)   # each rounded once to bf16
    with kitsune.fx.FusedLoss(devices=("cpu",)) as mode, torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(logits[0].half(), t2)   # fp16: left to F.cross_entropy's fp32 gradient
    assert mode.fused == 0 and "float16 logits under autocast" in mode.left[0], mode.left


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pad = nn.Embedding(13, 8), nn.Embedding(13, 8, padding_idx=0)
        self.normed, self.freq = nn.Embedding(13, 8, max_norm=1.0), nn.Embedding(13, 8, scale_grad_by_freq=True)
        self.w = nn.Parameter(torch.randn(13, 8))

    def forward(self, i):
        a = self.tok(i) + self.pad(i) + F.embedding(i, self.w, padding_idx=-1)   # taken, all three
        return a + self.normed(i).detach() + self.freq(i)                          # left: max_norm, by frequency


def test_embeddings_become_kitsune_embedding():
    """nn.Embedding and F.embedding become kitsune.embedding (padding_idx kept, a negative
    one counted from the end); max_norm and scale_grad_by_freq are left; outputs and
    gradients equal."""
    torch.manual_seed(17)
    m = _Embeddings().double()
    rep = kitsune.fx.Report()
    opt = kitsune.optimize(m, report=rep)
    assert _kinds(rep) == ["kitsune.embedding"] * 3, rep
    i = torch.randint(0, 13, (4, 6))
    torch.testing.assert_close(opt(i), m(i))
    pa, pb = dict(opt.named_parameters()), dict(m.named_parameters())
    assert pa.keys() == pb.keys()
    names = sorted(pa)
    ga = torch.autograd.grad(opt(i).square().sum(), [pa[k] for k in names], allow_unused=True)
    gb = torch.autograd.grad(m(i).square().sum(), [pb[k] for k in names], allow_unused=True)
    assert {k for k, a in zip(names, ga) if a is None} == {k for k, b in zip(names, gb) if b is None} == {
        "normed.weight"}
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


def test_hf_rms_norm_written_out_becomes_rms_norm():
    """Hugging Face's RMSNorm (pow, mean, rsqrt, the fp32 upcast and the cast back, times
    the weight; either operand order) runs as kitsune.rms_norm: outputs and gradients of
    the original in float32; in bfloat16 within a rounding; with a float32 weight on
    bfloat16 input (a float32 result) the written-out ops run, dtype and values exact."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class WeightLast(torch.nn.Module):   # the same, written the other way round, with torch.pow
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.randn(16)), 1e-5

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(torch.pow(h, 2).mean(-1, keepdim=True) + self.eps)
            return h.to(x.dtype) * self.weight

    assert transformers is not None
    torch.manual_seed(0)
    for make in (lambda: LlamaRMSNorm(16, eps=1e-6), WeightLast):
        m = make()
        with torch.no_grad():
            m.weight.normal_()
        report = kitsune.fx.Report()
        fast = kitsune.optimize(m, report=report)
        assert [w for _, w in report.fused] == ["HF RMSNorm (pow, mean, rsqrt, weight) -> kitsune.rms_norm"], str(report)
        x = torch.randn(3, 5, 16, requires_grad=True)
        a, b = fast(x), m(x)
        torch.testing.assert_close(a, b)
        ga = torch.autograd.grad(a.square().sum(), [x, fast.weight])
        gb = torch.autograd.grad(b.square().sum(), [x, m.weight])
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)
        xb = x.detach().bfloat16()
        fb, mb = copy.deepcopy(fast).bfloat16(), copy.deepcopy(m).bfloat16()
        torch.testing.assert_close(fb(xb).float(), mb(xb).float(), rtol=1.6e-2, atol=1.6e-2)
        out = fast(xb)   # float32 weight, bfloat16 input: HF's result is float32
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, m(xb), rtol=0, atol=0)


def test_tanh_gelu_written_out_becomes_one_gelu():
    """GPT-2's tanh-GELU written out (0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
    x^3)))) becomes F.gelu(approximate="tanh"), and after a Linear linear_act(gelu_tanh);
    the tanh it contains is not reported as left; values and gradients are the original's.
    A chain whose inner value is read elsewhere is left alone."""
    transformers = pytest.importorskip("transformers")
    from transformers.activations import NewGELUActivation

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = torch.nn.Linear(8, 16), NewGELUActivation()

        def forward(self, x):
            return self.act(self.fc(x))

    class Shared(torch.nn.Module):   # tanh's input also returned: not the pattern
        def forward(self, x):
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
            return 0.5 * x * (1.0 + torch.tanh(inner)), inner

    assert transformers is not None
    torch.manual_seed(0)
    for m, want in ((NewGELUActivation(), ["gelu (one ATen op)"]),
                    (MLP(), ["gelu (one ATen op)", "linear_act(gelu_tanh) (fc)"])):
        report = kitsune.fx.Report()
        fast = kitsune.optimize(m, report=report)
        assert [w.split(" -> ")[1] for _, w in report.fused] == want and not report.left, str(report)
        x = torch.randn(4, 8, requires_grad=True)
        a, b = fast(x), m(x)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(torch.autograd.grad(a.sum(), x)[0], torch.autograd.grad(b.sum(), x)[0])
    report = kitsune.explain(Shared())
    assert not any("tanh-GELU" in w for _, w in report.fused), str(report)


def test_hf_conv1d_becomes_a_linear_for_the_linear_patterns():
    """GPT-2's MLP (Conv1D, tanh-GELU written out, Conv1D, dropout): each Conv1D (addmm over
    rows with an (in, out) weight) is taken as F.linear(x, W.t(), b), so c_fc + GELU
    becomes linear_act(gelu_tanh) and c_proj linear_act(none); outputs and gradients (of
    the (in, out) weights too) are the original's, and the state dict keeps its names."""
    T = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=16, resid_pdrop=0.0)
    m = GPT2MLP(64, cfg).train()
    report = kitsune.fx.Report()
    fast = kitsune.optimize(m, report=report)
    got = sorted(w.split(" -> ")[1] for _, w in report.fused)
    assert got == ["gelu (one ATen op)", "linear_act(gelu_tanh) (linear)", "linear_act(none) (the bias gradient by "
                   "column sum)"], str(report)
    assert list(fast.state_dict()) == list(m.state_dict())
    x = torch.randn(2, 5, 16, requires_grad=True)
    a, b = fast(x), m(x)
    torch.testing.assert_close(a, b)
    ga = torch.autograd.grad(a.square().sum(), [x] + list(fast.parameters()))
    gb = torch.autograd.grad(b.square().sum(), [x] + list(m.parameters()))
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)


def _loss_and_grads_match(got, want, ours, theirs, rtol, atol, grad_tol):
    """got / want: the losses of ours / theirs (modules with the same parameters): float32,
    close, and after backward every gradient close (grad_tol relative to its largest)."""
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    got.backward()
    want.backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=grad_tol, atol=grad_tol * q.grad.abs().max().item(), msg=name)


class _UpcastLoss(torch.nn.Module):
    """Hugging Face's causal-LM loss shape: logits.float().view(-1, V) into cross_entropy
    (the logits scaled after the head, so that the head's linear stays apart)."""

    def __init__(self, vocab=40, scaled=True):
        super().__init__()
        self.emb, self.head, self.vocab = torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab), vocab
        self.scaled = scaled

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        logits = logits * 2.0 if self.scaled else logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, self.vocab), labels.view(-1),
                                                 ignore_index=-100)


@pytest.mark.parametrize("head", ["scaled", "direct"])
@pytest.mark.parametrize("path", ["optimize", "dynamo"])
@pytest.mark.parametrize("amp", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_cross_entropy_of_upcast_logits_reads_bf16_as_it_is(path, amp, head):
    """cross_entropy(x.float().view(...)) -> kitsune.cross_entropy(x, float_loss=True) on
    bf16 x, and with the head's linear right before the upcast linear_cross_entropy
    (float_loss): the loss float32 and eager's, gradients as eager's to bf16 rounding;
    on fp32 logits the same ops compute in fp32."""
    import copy
    torch.manual_seed(0)
    model = _UpcastLoss(scaled=head == "scaled")
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 40, (4, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    report = kitsune.explain(model, ids, labels, dynamo=True) if path == "dynamo" else kitsune.explain(model)
    wanted = "x.float()" if head == "scaled" else "linear(x).float()"
    assert any(wanted in what for _, what in report.fused), report
    torch._dynamo.reset()
    fast = (torch.compile(model, backend="kitsune", options={"inductor": False}) if path == "dynamo"
            else kitsune.optimize(model, inplace=True))
    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        got, want = fast(ids, labels), twin(ids, labels)
    # bf16 and the fused head: its logits are not rounded to bf16 before the loss, eager's are
    _loss_and_grads_match(got, want, model, twin, 1e-3 if amp is not None else 1e-5, 1e-5,
                          2e-2 if amp is not None else 1e-5)


@pytest.mark.parametrize("amp", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_hf_gpt2_head_and_loss_trace_whole_and_fuse(amp):
    """GPT-2's loss_function warns once per call (its loss_type is unknown to
    transformers): Kitsune's Dynamo path settles it first, so Dynamo does not break
    there, and the LM head and HF's upcast loss become one linear_cross_entropy (the
    logits never exist); the loss float32 and eager's, gradients as eager's; explain
    leaves the model as it was."""
    import copy
    T = pytest.importorskip("transformers")
    from kitsune.fx.backend import settle_hf_loss_functions

    class LM(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels).loss
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    model = LM(T.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 64, (2, 16))
    report = kitsune.explain(model, ids, ids, dynamo=True)
    assert report.breaks == [] and "_loss_function" not in vars(model.lm)
    assert any("linear_cross_entropy" in what for _, what in report.fused), report
    twin = copy.deepcopy(model)
    settle_hf_loss_functions(model)
    torch._dynamo.reset()
    fast = torch.compile(model, backend="kitsune", options={"inductor": False})
    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        got, want = fast(ids, ids), twin(ids, ids)
    _loss_and_grads_match(got, want, model, twin, 1e-4, 1e-4, 3e-2 if amp is not None else 1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_optimize_gives_hf_causal_lms_kitsunes_loss(family):
    """optimize sets a causal LM's loss_function (transformers' setter) to
    causal_lm_loss: the same loss (mean over labelled tokens, or the sum over
    num_items_in_batch), float32 under bf16 autocast, gradients as eager's; explain says
    so and changes nothing; a base model (no loss) is left alone."""
    import copy
    T = pytest.importorskip("transformers")
    from kitsune.fx.patterns.loss import causal_lm_loss
    torch.manual_seed(0)
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                                 max_position_embeddings=32))
    report = kitsune.explain(model)
    assert [w for w, what in report.swapped if what.startswith("loss_function")] == [type(model).__name__]
    assert "_loss_function" not in vars(model)
    fast = kitsune.optimize(model)
    assert vars(fast)["_loss_function"] is causal_lm_loss
    assert "_loss_function" not in vars(fast.base_model)
    ids = torch.randint(0, 64, (3, 16))
    labels = ids.clone()
    labels[0, :6] = -100
    labels[1] = -100   # a row with nothing labelled
    for amp in (None, torch.bfloat16):
        for items in (None, torch.tensor(17)):
            fast.zero_grad()
            model.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                got = fast(input_ids=ids, labels=labels, num_items_in_batch=items).loss
                want = model(input_ids=ids, labels=labels, num_items_in_batch=items).loss
            _loss_and_grads_match(got, want, fast, model, 1e-5, 1e-5, 2e-2 if amp is not None else 1e-5)
    nothing = torch.full_like(labels, -100)   # the sum over nothing is 0 (the mean NaN, as PyTorch's)
    assert causal_lm_loss(torch.randn(3, 16, 64), nothing, 64, num_items_in_batch=5).item() == 0.0
    assert causal_lm_loss(torch.randn(3, 16, 64), nothing, 64).isnan()
