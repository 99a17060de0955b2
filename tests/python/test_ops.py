"""Fused ops (torch.ops.kitsune.*). CPU: schemas, fake kernels, autograd formulas
(gradcheck in float64 against the CPU reference), opcheck, bad inputs. GPU (marked
gpu): every op and backward at fp32/fp16/bf16 against an fp64 reference, error at
most 2x PyTorch's own eager error, on odd, broadcast and non-contiguous shapes,
with the memory the outputs land in poisoned first."""
import pytest

from test_torch_allocator import gpu

torch = pytest.importorskip("torch")
ko = pytest.importorskip("kitsune.ops")

F = torch.nn.functional

# name -> (kitsune op, reference in torch ops, input makers)
OPS = {
    "add_relu": (lambda a, b: ko.add_relu(a, b), lambda a, b: torch.relu(a + b)),
    "mul_tanh": (lambda a, b: ko.mul_tanh(a, b), lambda a, b: torch.tanh(a * b)),
    "bias_gelu": (lambda x, b: ko.bias_gelu(x, b), lambda x, b: F.gelu(x + b)),
    "bias_gelu_tanh": (lambda x, b: ko.bias_gelu(x, b, "tanh"), lambda x, b: F.gelu(x + b, approximate="tanh")),
    "swiglu": (lambda g, u: ko.swiglu(g, u), lambda g, u: F.silu(g) * u),
    "rms_norm": (lambda x, w: ko.rms_norm(x, w), lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
}
# (shape of first, shape of second); bias ops take the last dim as the second
SHAPES = [((1,), (1,)), ((3,), (3,)), ((1023,), (1023,)), ((4, 1000), (1000,)), ((257, 4097), (257, 4097)),
          ((2, 3, 64), (64,))]


def _inputs(name, sa, sb, dtype, device, gen):
    if name.startswith(("bias_gelu", "rms_norm")):   # a per-column operand
        sb = (sa[-1],)
    a = torch.randn(sa, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    b = torch.randn(sb, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return a, b


@pytest.mark.parametrize("name", list(OPS))
def test_cpu_reference_and_gradients_float64(name):
    op, ref = OPS[name]
    g = torch.Generator().manual_seed(0)
    for sa, sb in SHAPES[:4]:
        a, b = _inputs(name, sa, sb, torch.float64, "cpu", g)
        torch.testing.assert_close(op(a, b), ref(a, b))
        a.requires_grad_(), b.requires_grad_()
        assert torch.autograd.gradcheck(op, (a, b)), (name, sa, sb)


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name):
    op, _ = OPS[name]
    g = torch.Generator().manual_seed(1)
    a, b = _inputs(name, (4, 8), (4, 8), torch.float32, "cpu", g)
    a.requires_grad_(), b.requires_grad_()
    opname = {"bias_gelu_tanh": "bias_gelu"}.get(name, name)
    args = (a, b, "tanh") if name == "bias_gelu_tanh" else (a, b)
    torch.library.opcheck(getattr(torch.ops.kitsune, opname).default, args)


def test_fake_tensors_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(4, 1, 8), torch.empty(3, 8)
        assert ko.add_relu(a, b).shape == (4, 3, 8)
        assert ko.swiglu(a, b).shape == (4, 3, 8)
        assert ko.bias_gelu(torch.empty(5, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)).dtype \
            == torch.bfloat16


def test_bad_inputs_name_the_problem():
    a = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="a is Float but b is Half"):
        ko.add_relu(a, a.half())
    with pytest.raises(RuntimeError, match="bias must be 1-D with x.size"):
        ko.bias_gelu(a, torch.randn(7))
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh'"):
        ko.bias_gelu(a, torch.randn(8), "fast")
    with pytest.raises(RuntimeError):
        ko.swiglu(a, torch.randn(5))   # shapes that do not broadcast
    with pytest.raises(RuntimeError, match="weight must be 1-D with x.size"):
        ko.rms_norm(a, torch.randn(4))
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        ko.rms_norm(a, torch.randn(8), -1.0)


# ---- GPU ---------------------------------------------------------------------
TOL_ABS = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _err(x, ref):
    return (x.double() - ref).abs().max().item() if x.numel() else 0.0


def _poison(n, device):
    """Fills the caching allocator's free memory with NaN, so an output element the
    kernel forgets to write shows up."""
    p = torch.full((n * 4 + 4096,), float("nan"), device=device)
    del p


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_matches_fp64_reference(name, dtype):
    op, ref = OPS[name]
    g = torch.Generator().manual_seed(2)
    for sa, sb in SHAPES + [(((1 << 20) + 3,), ((1 << 20) + 3,))]:
        a, b = _inputs(name, sa, sb, dtype, "cuda", g)
        if len(sa) == 2 and sa == sb:   # non-contiguous operands
            a, b = a.t().contiguous().t(), b.t().contiguous().t()
        _poison(a.numel(), "cuda")
        out = op(a, b)
        r64 = ref(a.double(), b.double())
        err, torch_err = _err(out, r64), _err(ref(a, b), r64)
        assert not torch.isnan(out).any(), f"{name} {dtype} {sa}: unwritten (NaN) outputs"
        assert out.shape == r64.shape and out.dtype == dtype
        assert err <= 2 * torch_err + TOL_ABS[dtype], f"{name} {dtype} {sa}: error {err} vs torch {torch_err}"
        # gradients
        a.requires_grad_(), b.requires_grad_()
        go = torch.randn(r64.shape, generator=g, dtype=torch.float64).to("cuda", dtype)
        ga, gb = torch.autograd.grad(op(a, b), (a, b), go)
        a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
        ra, rb = torch.autograd.grad(ref(a64, b64), (a64, b64), go.double())
        ta, tb = torch.autograd.grad(ref(a, b), (a, b), go)
        for got, want, theirs, which in ((ga, ra, ta, "a"), (gb, rb, tb, "b")):
            e, te = _err(got, want), _err(theirs, want)
            # a per-column gradient is a sum over rows: its error grows with its size
            scale = max(1.0, want.abs().max().item()) if which == "b" and name.startswith(("bias", "rms")) else 1.0
            assert e <= 2 * te + TOL_ABS[dtype] * scale, f"{name} {dtype} {sa} grad {which}: {e} vs torch {te}"
