"""kitsune.ops.wide_linear and the WideLinear swap: a Linear whose output width cuBLAS
runs slowly (an LM head's odd vocabulary) computes its GEMMs over the width padded to a
multiple of 64 and returns a view into the padded result. The padded autograd Function
is checked on the CPU against F.linear in float64 (values, the output's row stride,
every gradient); optimize's swap on a tiny GPT-2 keeps parameters, ties and outputs; on
the GPU, the bf16 autocast path and kitsune.cross_entropy over the padded logits
against an fp64 reference."""
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402
from kitsune.fx.patterns.linear import WideLinear, is_wide  # noqa: E402
from kitsune.ops.linear import _WideLinear  # noqa: E402
from support import gpu  # noqa: E402

F = torch.nn.functional


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [77, 128, 4099])
def test_padded_function_matches_linear_in_float64(n, bias):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, 24, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(n, 24, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(n, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    out = _WideLinear.apply(x, w, b, torch.float64)
    ld = (n + 63) // 64 * 64
    assert out.shape == (3, 5, n) and out.stride() == (5 * ld, ld, 1)
    want = F.linear(x, w, b)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    up = torch.randn(3, 5, n, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], up)
    ref = torch.autograd.grad(want, [t for t in (x, w, b) if t is not None], up)
    for a, r in zip(got, ref):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert out.view(-1, n).shape == (15, n)   # the idiom a loss uses works on the padded rows


def test_padded_output_takes_in_place_ops_and_refuses_double_backward():
    """In-place ops on the output (a temperature, a mask) work as on F.linear's, with the
    same gradients; a double backward raises rather than come out wrong."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4099, 16, dtype=torch.float64, generator=g, requires_grad=True)
    out, want = _WideLinear.apply(x, w, None, torch.float64), F.linear(x, w)
    for y in (out, want):
        y.div_(2.0)
        y[..., 4000:] = -1.0
    torch.testing.assert_close(out, want)
    up = torch.randn(2, 3, 4099, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(out, (x, w), up), torch.autograd.grad(want, (x, w), up)):
        torch.testing.assert_close(a, b)
    y = _WideLinear.apply(x, w, None, torch.float64)
    gw, = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gw.sum(), x)


def test_is_wide_takes_wide_odd_widths_only():
    assert is_wide(torch.empty(50257, 768)) and is_wide(torch.empty(30522, 768))
    assert not is_wide(torch.empty(32000, 768))   # a multiple of 8: cuBLAS is fine
    assert not is_wide(torch.empty(1000, 768))    # a classifier: small
    assert not is_wide(torch.empty(50257, 770))   # the other width is odd too: nothing to gain
    assert not is_wide(torch.empty(50257))


def test_wide_linear_off_cuda_is_f_linear():
    x, w = torch.randn(4, 16), torch.randn(4099, 16)
    assert torch.equal(kitsune.ops.wide_linear(x, w), F.linear(x, w))
    with pytest.raises(RuntimeError):   # F.linear's own error for mismatched widths
        kitsune.ops.wide_linear(torch.randn(4, 8), w)


def test_optimize_swaps_a_gpt2_head_and_keeps_its_tie_and_outputs():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=4099, n_positions=32, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    model = T.GPT2LMHeadModel(cfg)
    report = kitsune.explain(model)
    assert ("lm_head", "Linear(32, 4099) -> WideLinear (the GEMMs over 4160 features)") in report.swapped
    assert type(model.lm_head) is torch.nn.Linear   # explain changes nothing
    fast = kitsune.optimize(model)
    assert type(fast.lm_head) is WideLinear and isinstance(fast.lm_head, torch.nn.Linear)
    assert fast.lm_head.weight is fast.transformer.wte.weight
    assert list(fast.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 4099, (2, 16))
    torch.testing.assert_close(fast(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)
    again = copy.deepcopy(fast)
    assert type(again.lm_head) is WideLinear


def test_a_traced_wide_linear_with_bias_becomes_wide_linear():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.decoder = torch.nn.Linear(16, 4100)

        def forward(self, x):
            return self.decoder(torch.relu(self.proj(x)))
    torch.manual_seed(0)
    model = Head()
    report = kitsune.explain(model)
    assert any(w.endswith("decoder") and "wide_linear" in what for w, what in report.fused), report
    assert report.swapped == []   # the graph calls wide_linear: the module itself is no longer called
    fast = kitsune.optimize(model)
    x = torch.randn(3, 16)
    torch.testing.assert_close(fast(x), model(x))


@gpu
@pytest.mark.parametrize("bias", [True, False])
def test_wide_linear_and_cross_entropy_under_bf16_autocast_on_cuda(bias):
    """The padded GEMMs under autocast and kitsune.cross_entropy reading the padded rows
    as they are: loss and gradients against F.linear + F.cross_entropy in float64."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 50257, 256
    x = torch.randn(4, 64, k, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).requires_grad_()
    b = (torch.randn(n, device="cuda", generator=g) * 0.05).requires_grad_() if bias else None
    t = torch.randint(0, n, (4, 64), device="cuda", generator=g)
    t[0, :5] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = kitsune.ops.wide_linear(x, w, b)
        assert logits.dtype == torch.bfloat16 and logits.stride(-2) == 50304
        loss = kitsune.ops.cross_entropy(logits.view(-1, n), t.view(-1))
    assert loss.dtype == torch.float32
    params = [p for p in (x, w, b) if p is not None]
    got = torch.autograd.grad(loss, params)
    ref_in = [p.detach().double().requires_grad_() for p in params]
    ref_loss = F.cross_entropy(F.linear(ref_in[0], ref_in[1], ref_in[2] if bias else None).view(-1, n), t.view(-1))
    ref = torch.autograd.grad(ref_loss, ref_in)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-2)
    for a, r in zip(got, ref):
        assert a.dtype == torch.float32 and a.isfinite().all()
        err = (a.double() - r).norm() / r.norm()
        assert err < 2e-2, err


def _grad_strides(make):
    """(with_grad's, backward's) gradient strides for the logits make() gives."""
    logits = make()
    t = torch.zeros(logits.shape[0], dtype=torch.long, device="cuda")
    _, g = torch.ops.kitsune.cross_entropy_with_grad(logits, t, -100, 0.0, True)
    g2 = torch.ops.kitsune.cross_entropy_backward(torch.ones((), device="cuda"), logits, t, -100, 0.0)
    return g.stride(), g2.stride()


_LAYOUTS = {"padded rows": lambda: torch.zeros(8, 64, device="cuda", dtype=torch.bfloat16)[:, :50],
            "contiguous": lambda: torch.zeros(8, 50, device="cuda", dtype=torch.bfloat16),
            "rows 51 apart": lambda: torch.zeros(8, 51, device="cuda", dtype=torch.bfloat16)[:, :50],
            "one row": lambda: torch.zeros(1, 64, device="cuda", dtype=torch.bfloat16)[:, :50]}
_WANT = {"padded rows": (64, 1), "contiguous": (50, 1), "rows 51 apart": (50, 1), "one row": (50, 1)}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_cross_entropy_fakes_lay_the_gradient_out_as_the_kernel(layout):
    """The fake kernels promise the layout the CUDA bridge gives (rows as far apart as the
    logits' when that is a 16-byte multiple): a traced backward rescales what it gets."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        got = _grad_strides(_LAYOUTS[layout])
    assert got == (_WANT[layout], _WANT[layout])


@gpu
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_cross_entropy_gradient_layout_on_cuda_matches_its_fake(layout):
    assert _grad_strides(_LAYOUTS[layout]) == (_WANT[layout], _WANT[layout])
