"""Fused ops (torch.ops.kitsune.*). CPU: schemas, fake kernels, autograd formulas
(gradcheck in float64 against the CPU reference), opcheck, bad inputs. GPU (marked
gpu): every op and backward at fp32/fp16/bf16 against an fp64 reference, error at
most 2x PyTorch's own eager error, on odd, broadcast and non-contiguous shapes,
with the memory the outputs land in poisoned first."""
import math

import pytest

from support import gpu

torch = pytest.importorskip("torch")
ko = pytest.importorskip("kitsune.ops")

import test_bad_input as bad  # noqa: E402  (its table: every op's valid arguments and reference)

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


# The layouts opcheck runs every op in: each floating input as built, as a strided view
# with gaps (not dense), and dense with its last two dims' strides swapped (transposed).
OPCHECK_LAYOUTS = {"as_built": lambda t: t, "strided": lambda t: bad._strided(t) if t.dim() >= 1 else t,
                   "transposed": lambda t: bad._transposed(t) if t.dim() >= 2 else t}


def _real_and_fake(op, args):
    """op's results on copies of args and under FakeTensorMode (the fake kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import _pytree as pytree
    real = op(*pytree.tree_map_only(torch.Tensor, lambda t: bad._copy(t.detach()), args))
    with FakeTensorMode() as mode:
        fake = op(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args))
    return bad._leaves(real), bad._leaves(fake)


@pytest.mark.parametrize("layout", list(OPCHECK_LAYOUTS))
@pytest.mark.parametrize("name", sorted(bad.OPS))
def test_opcheck(name, layout):
    """torch.library.opcheck on every op (but the stream_* ops and pinned_empty) with the
    valid arguments of test_bad_input's table, their floating tensors in each layout and
    requiring grad where the op has autograd. A layout the op does not take (the
    optimizer steps take dense parameters, cross_entropy_rescale_ a contiguous gradient)
    must be refused by name instead. opcheck compares strides on CUDA only
    (check_significant_strides), so the fake kernel's strides are compared with the CPU
    kernel's here too."""
    from torch.utils import _pytree as pytree
    op = getattr(torch.ops.kitsune, name).default
    f = OPCHECK_LAYOUTS[layout]
    args = pytree.tree_map_only(torch.Tensor, lambda t: f(t) if t.is_floating_point() and t.numel() > 1 else t,
                                bad.OPS[name].make())
    try:
        op(*pytree.tree_map_only(torch.Tensor, bad._copy, args))
    except RuntimeError as e:
        assert f"kitsune.{name}:" in str(e), e
        assert layout != "as_built", e
        return
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd"):
        args = pytree.tree_map_only(torch.Tensor, lambda t: t.requires_grad_() if t.is_floating_point() else t, args)
    torch.library.opcheck(op, args)
    real, fake = _real_and_fake(op, args)
    why = bad._same_layout(real, fake)
    assert why is None, why


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


# ---- the other ops: norms, losses, reductions, attention score -------------------
# name -> (kitsune op, reference in torch ops, inputs(shape, dtype, device, gen) ->
# (differentiable tensors, other args)). Each op is called as op(*tensors, *others).
def _t(shape, dtype, device, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(device=device, dtype=dtype)


def _targets(n, classes, device, gen, ignore=True):
    t = torch.randint(0, classes, (n,), generator=gen)
    if ignore and n > 2:
        t[1] = -100
    return t.to(device)


def _norm_inputs(shape, dtype, device, gen):
    n = shape[-1]
    # rows with a mean large against their spread test the statistics
    return [_t(shape, dtype, device, gen, shift=3.0), _t((n,), dtype, device, gen), _t((n,), dtype, device, gen)], []


def _add_ln_inputs(shape, dtype, device, gen):
    n = shape[-1]
    return [_t(shape, dtype, device, gen), _t(shape, dtype, device, gen), _t((n,), dtype, device, gen),
            _t((n,), dtype, device, gen)], []


def _ce_inputs(shape, dtype, device, gen):
    return [_t(shape, dtype, device, gen, scale=3.0)], [_targets(shape[0], shape[1], device, gen)]


def _lce_inputs(shape, dtype, device, gen):
    rows, hidden, classes = shape
    return [_t((rows, hidden), dtype, device, gen), _t((classes, hidden), dtype, device, gen, scale=0.05),
            _t((classes,), dtype, device, gen)], [_targets(rows, classes, device, gen)]


def _one_input(shape, dtype, device, gen):
    return [_t(shape, dtype, device, gen)], []


def _qk_inputs(shape, dtype, device, gen):
    b, lq, lk, d = shape
    return [_t((b, lq, d), dtype, device, gen), _t((b, lk, d), dtype, device, gen)], []


def _ref_add_ln(x, r, w, b):
    h = x + r
    return h, F.layer_norm(h, (h.shape[-1],), w, b)


def _per_channel(b, y):
    return b.view((1, -1) + (1,) * (y.dim() - 2))


def _channel_inputs(shape, dtype, device, gen, channels_last=False):
    y = _t(shape, dtype, device, gen)
    if channels_last:
        y = y.contiguous(memory_format=torch.channels_last)
    return [y, _t((shape[1],), dtype, device, gen)], []


def _cat_inputs(shape, dtype, device, gen, channels_last=False):
    """shape (N, H, W, C_0, C_1, ...): the parts (N, C_i, H, W), then their biases."""
    n, h, w, *cs = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    xs = [_t((n, c, h, w), dtype, device, gen).contiguous(memory_format=fmt) for c in cs]
    return xs + [_t((c,), dtype, device, gen) for c in cs], []


def _bias_cat(*t):
    return ko.bias_cat(t[:len(t) // 2], t[len(t) // 2:])


def _bias_cat_ref(*t):
    k = len(t) // 2
    return torch.cat([x + _per_channel(b, x) for x, b in zip(t[:k], t[k:])], 1)


OPS2 = {
    "layer_norm_relu": (lambda x, w, b: ko.layer_norm_relu(x, x.shape[-1], w, b),
                        lambda x, w, b: F.relu(F.layer_norm(x, (x.shape[-1],), w, b)), _norm_inputs,
                        [(1, 1), (3, 7), (4, 1023), (2, 3, 64), (64, 4096), (5, 12288), (96, 512)]),
    # one of the two affine parameters: its gradient alone from the stripe sums (through
    # add_layer_norm: no ReLU, whose mask is ill-conditioned where xhat * w is ~0, which
    # a weight without a bias puts at ~1e-8 in a 64 x 4096 fp16 draw)
    "add_layer_norm_weight_only": (lambda x, r, w: ko.add_layer_norm(x, r, w, None),
                                   lambda x, r, w: _ref_add_ln(x, r, w, None),
                                   lambda shape, dtype, device, gen: (_add_ln_inputs(shape, dtype, device, gen)[0][:3],
                                                                      []),
                                   [(3, 7), (64, 4096), (100, 512)]),
    "add_layer_norm_bias_only": (lambda x, r, b: ko.add_layer_norm(x, r, None, b),
                                 lambda x, r, b: _ref_add_ln(x, r, None, b),
                                 lambda shape, dtype, device, gen: (_add_ln_inputs(shape, dtype, device, gen)[0][:3],
                                                                    []),
                                 [(3, 7), (64, 4096), (100, 512)]),
    "add_layer_norm": (lambda x, r, w, b: ko.add_layer_norm(x, r, w, b), _ref_add_ln, _add_ln_inputs,
                       [(1, 1), (3, 7), (4, 1023), (2, 3, 64), (64, 768), (5, 12288), (4096, 512), (7, 1024),
                        (5, 40)]),
    "cross_entropy": (lambda x, t: ko.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t), _ce_inputs,
                      [(1, 1), (3, 7), (4, 1023), (64, 50257), (300, 4096)]),
    "cross_entropy_smooth": (lambda x, t: ko.cross_entropy(x, t, label_smoothing=0.1),
                             lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), _ce_inputs,
                             [(3, 7), (64, 50257)]),
    "linear_cross_entropy": (lambda x, w, b, t: ko.linear_cross_entropy(x, w, t, b, chunk_size=64),
                             lambda x, w, b, t: F.cross_entropy(F.linear(x, w, b), t), _lce_inputs,
                             [(3, 8, 7), (300, 64, 1000), (200, 128, 50257)]),
    "sum_squared": (lambda x: ko.sum_squared(x), lambda x: (x * x).sum(), _one_input,
                    [(1,), (3,), (1023,), (4, 1000), ((1 << 22) + 3,)]),
    "sum_squared_dim": (lambda x: ko.sum_squared(x, 0, keepdim=True), lambda x: (x * x).sum(0, keepdim=True),
                        _one_input, [(3, 5), (1023, 9), (2, 3, 64)]),
    "mean_abs": (lambda x: ko.mean_abs(x), lambda x: x.abs().mean(), _one_input,
                 [(1,), (3,), (1023,), (4, 1000), ((1 << 22) + 3,)]),
    "mean_abs_dim": (lambda x: ko.mean_abs(x, -1), lambda x: x.abs().mean(-1), _one_input,
                     [(3, 5), (9, 1023), (2, 3, 64)]),
    "linear_act_relu": (lambda x, w, b: ko.linear_act(x, w, b, "relu"), lambda x, w, b: F.relu(F.linear(x, w, b)),
                        lambda shape, dtype, device, gen: ([_t(shape[:-1], dtype, device, gen),
                                                           _t((shape[-1], shape[-2]), dtype, device, gen, scale=0.1),
                                                           _t((shape[-1],), dtype, device, gen)], []),
                        [(3, 4, 5), (7, 16, 33), (64, 32, 64), (512, 768, 3072)]),
    "linear_act_gelu": (lambda x, w, b: ko.linear_act(x, w, b, "gelu"), lambda x, w, b: F.gelu(F.linear(x, w, b)),
                        lambda shape, dtype, device, gen: ([_t(shape[:-1], dtype, device, gen),
                                                           _t((shape[-1], shape[-2]), dtype, device, gen, scale=0.1),
                                                           _t((shape[-1],), dtype, device, gen)], []),
                        [(3, 4, 5), (7, 16, 33), (512, 768, 3072)]),
    # out_features % 8 == 0 goes through cuBLASLt's GELU_AUX_BIAS epilogue on CUDA, 33 does not
    "linear_act_gelu_tanh": (lambda x, w, b: ko.linear_act(x, w, b, "gelu_tanh"),
                             lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
                             lambda shape, dtype, device, gen: ([_t(shape[:-1], dtype, device, gen),
                                                                _t((shape[-1], shape[-2]), dtype, device, gen,
                                                                   scale=0.1),
                                                                _t((shape[-1],), dtype, device, gen)], []),
                             [(3, 4, 8), (7, 16, 33), (64, 32, 64), (512, 768, 3072)]),
    # the bias gradient by kt_colsum on CUDA: odd widths (one column a lane), one slab, many slabs
    "linear_act_none": (lambda x, w, b: ko.linear_act(x, w, b, "none"), lambda x, w, b: F.linear(x, w, b),
                        lambda shape, dtype, device, gen: ([_t(shape[:-1], dtype, device, gen),
                                                           _t((shape[-1], shape[-2]), dtype, device, gen, scale=0.1),
                                                           _t((shape[-1],), dtype, device, gen)], []),
                        [(3, 4, 5), (7, 16, 33), (64, 32, 64), (4096, 512, 1536), (2, 1000, 64, 10)]),
    "attention_score": (lambda q, k: ko.attention_score(q, k), lambda q, k: (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5,
                        _qk_inputs, [(1, 1, 1, 1), (2, 5, 7, 8), (8, 128, 128, 64)]),
    # (N, C, ...) and a bias of C; LeNet's and the Inception net's conv shapes, 2-D and 3-D
    "channel_bias": (lambda y, b: ko.channel_bias(y, b), lambda y, b: y + _per_channel(b, y), _channel_inputs,
                     [(2, 3, 4, 5), (37, 5), (3, 4, 7), (64, 6, 24, 24), (64, 64, 32, 32), (1, 1, 1, 1)]),
    "channel_bias_relu": (lambda y, b: ko.channel_bias(y, b, "relu"), lambda y, b: F.relu(y + _per_channel(b, y)),
                          _channel_inputs, [(2, 3, 4, 5), (37, 5), (3, 4, 7), (64, 16, 8, 8), (64, 64, 32, 32)]),
    "channel_bias_relu_cl": (lambda y, b: ko.channel_bias(y, b, "relu"), lambda y, b: F.relu(y + _per_channel(b, y)),
                             lambda shape, dtype, device, gen: _channel_inputs(shape, dtype, device, gen, True),
                             [(2, 3, 4, 5), (3, 5, 3, 3), (64, 64, 32, 32), (128, 64, 16, 16)]),
    # LeNet's two blocks; odd sizes leave rows and columns no window covers; a 3 x 2 window
    "bias_relu_pool": (lambda y, b: ko.bias_relu_pool(y, b, 2), lambda y, b: F.max_pool2d(F.relu(y + _per_channel(b, y)), 2),
                       _channel_inputs, [(2, 3, 4, 5), (3, 4, 5, 7), (64, 6, 28, 28), (64, 16, 10, 10)]),
    "bias_relu_pool_3x2": (lambda y, b: ko.bias_relu_pool(y, b, (3, 2)),
                           lambda y, b: F.max_pool2d(F.relu(y + _per_channel(b, y)), (3, 2)),
                           _channel_inputs, [(2, 3, 7, 5), (8, 5, 9, 8)]),
    # (N, H, W, C_0, C_1, ...): the Inception net's blocks; one part; channel counts that are
    # not multiples of 4 (a channel a thread)
    "bias_cat": (_bias_cat, _bias_cat_ref, _cat_inputs, [(2, 3, 4, 2, 3, 1), (2, 5, 3, 4), (64, 32, 32, 64, 64, 64, 64)]),
    "bias_cat_cl": (_bias_cat, _bias_cat_ref, lambda shape, dtype, device, gen: _cat_inputs(shape, dtype, device, gen, True),
                    [(2, 3, 4, 4, 8), (2, 3, 5, 3, 2, 5), (64, 32, 32, 64, 64, 64, 64), (64, 16, 16, 64, 64, 64, 64)]),
    # the Inception net's 3 x 3 / 1 / 1 (NCHW, channels-last) and ResNet's stem 3 x 3 / 2 / 1;
    # a 2 x 3 window at stride (2, 1) with padding (1, 0) in ceil mode; a 1 x 1 window
    "max_pool2d": (lambda x: ko.max_pool2d(x, 3, 1, 1), lambda x: F.max_pool2d(x, 3, 1, 1),
                   lambda shape, dtype, device, gen: ([_t(shape, dtype, device, gen)], []),
                   [(2, 3, 5, 6), (3, 2, 4, 4), (64, 64, 32, 32), (1, 1, 1, 1)]),
    "max_pool2d_cl": (lambda x: ko.max_pool2d(x, 3, 1, 1), lambda x: F.max_pool2d(x, 3, 1, 1),
                      lambda shape, dtype, device, gen: (
                          [_t(shape, dtype, device, gen).contiguous(memory_format=torch.channels_last)], []),
                      [(2, 4, 5, 6), (3, 3, 4, 4), (64, 64, 32, 32), (128, 64, 16, 16)]),
    "max_pool2d_stem": (lambda x: ko.max_pool2d(x, 3, 2, 1), lambda x: F.max_pool2d(x, 3, 2, 1),
                        lambda shape, dtype, device, gen: (
                            [_t(shape, dtype, device, gen).contiguous(memory_format=torch.channels_last)], []),
                        [(2, 4, 7, 8), (2, 5, 6, 6), (128, 64, 16, 16)]),
    "max_pool2d_ceil": (lambda x: ko.max_pool2d(x, (2, 3), (2, 1), (1, 0), ceil_mode=True),
                        lambda x: F.max_pool2d(x, (2, 3), (2, 1), (1, 0), ceil_mode=True),
                        lambda shape, dtype, device, gen: ([_t(shape, dtype, device, gen)], []),
                        [(2, 3, 7, 5), (1, 2, 4, 3), (16, 8, 33, 17)]),
    "max_pool2d_1x1": (lambda x: ko.max_pool2d(x, 1), lambda x: F.max_pool2d(x, 1),
                       lambda shape, dtype, device, gen: ([_t(shape, dtype, device, gen)], []),
                       [(2, 3, 4, 5), (3, 2, 3, 3)]),
    # the mean over H and W: NCHW (ATen's mean on every device) and channels-last (Kitsune's
    # kernels on CUDA): the Inception net's 64 x 256 x 32 x 32 and ResNet-18's 128 x 512 x 4 x 4;
    # channel counts not a multiple of 4 (a channel a lane), more channels than a 32-channel
    # tile, one row of pixels, and more images than a grid's 65535 rows
    "global_avg_pool": (lambda x: ko.global_avg_pool(x, (2, 3)), lambda x: x.mean((2, 3)),
                        lambda shape, dtype, device, gen: ([_t(shape, dtype, device, gen)], []),
                        [(2, 3, 4, 5), (3, 6, 5, 7), (64, 256, 32, 32)]),
    "global_avg_pool_cl": (lambda x: ko.global_avg_pool(x, (-1, -2), keepdim=True),
                           lambda x: x.mean((2, 3), keepdim=True),
                           lambda shape, dtype, device, gen: (
                               [_t(shape, dtype, device, gen).contiguous(memory_format=torch.channels_last)], []),
                           [(2, 6, 5, 7), (3, 40, 4, 4), (2, 33, 3, 3), (1, 8, 1, 9), (64, 256, 32, 32),
                            (128, 512, 4, 4), (70000, 4, 1, 2)]),
}


def _outs(v):
    return v if isinstance(v, tuple) else (v,)



@pytest.mark.parametrize("name", list(OPS2))
def test_cpu_reference_and_gradients_float64_more(name):
    op, ref, inputs, shapes = OPS2[name]
    g = torch.Generator().manual_seed(3)
    for shape in [s for s in shapes if math.prod(s) <= 2048][:3]:   # gradcheck is O(elements^2)
        ts, other = inputs(shape, torch.float64, "cpu", g)
        for got, want in zip(_outs(op(*ts, *other)), _outs(ref(*ts, *other))):
            torch.testing.assert_close(got, want)
        ts = [t.requires_grad_() for t in ts]
        assert torch.autograd.gradcheck(lambda *a: op(*a, *other), ts), (name, shape)


@pytest.mark.parametrize("name", list(OPS2))
def test_opcheck_more(name):
    op, _, inputs, shapes = OPS2[name]
    g = torch.Generator().manual_seed(4)
    ts, other = inputs(shapes[1], torch.float32, "cpu", g)
    ts = [t.requires_grad_() for t in ts]
    opname, args = {
        "layer_norm_relu": ("layer_norm_relu", lambda: (ts[0], [ts[0].shape[-1]], ts[1], ts[2])),
        "add_layer_norm_weight_only": ("add_layer_norm", lambda: (ts[0], ts[1], ts[2], None)),
        "add_layer_norm_bias_only": ("add_layer_norm", lambda: (ts[0], ts[1], None, ts[2])),
        "add_layer_norm": ("add_layer_norm", lambda: tuple(ts)),
        "cross_entropy": ("cross_entropy", lambda: (ts[0], other[0])),
        "cross_entropy_smooth": ("cross_entropy", lambda: (ts[0], other[0], -100, 0.1)),
        "linear_cross_entropy": ("linear_cross_entropy", lambda: (ts[0], ts[1], other[0], ts[2])),
        "sum_squared": ("sum_squared", lambda: (ts[0],)),
        "sum_squared_dim": ("sum_squared", lambda: (ts[0], [0], True)),
        "mean_abs": ("mean_abs", lambda: (ts[0],)),
        "mean_abs_dim": ("mean_abs", lambda: (ts[0], [-1])),
        "attention_score": ("attention_score", lambda: (ts[0], ts[1])),
        "linear_act_relu": ("linear_act", lambda: (ts[0], ts[1], ts[2], "relu")),
        "linear_act_gelu": ("linear_act", lambda: (ts[0], ts[1], ts[2], "gelu")),
        "linear_act_gelu_tanh": ("linear_act", lambda: (ts[0], ts[1], ts[2], "gelu_tanh")),
        "linear_act_none": ("linear_act", lambda: (ts[0], ts[1], ts[2], "none")),
        "channel_bias": ("channel_bias", lambda: (ts[0], ts[1])),
        "channel_bias_relu": ("channel_bias", lambda: (ts[0], ts[1], "relu")),
        "channel_bias_relu_cl": ("channel_bias", lambda: (ts[0], ts[1], "relu")),
        "bias_relu_pool": ("bias_relu_pool", lambda: (ts[0], ts[1], [2, 2])),
        "bias_relu_pool_3x2": ("bias_relu_pool", lambda: (ts[0], ts[1], [3, 2])),
        "bias_cat": ("bias_cat", lambda: (ts[:len(ts) // 2], ts[len(ts) // 2:])),
        "bias_cat_cl": ("bias_cat", lambda: (ts[:len(ts) // 2], ts[len(ts) // 2:])),
        "max_pool2d": ("max_pool2d", lambda: (ts[0], [3, 3], [1, 1], [1, 1], False)),
        "max_pool2d_cl": ("max_pool2d", lambda: (ts[0], [3, 3], [1, 1], [1, 1], False)),
        "max_pool2d_stem": ("max_pool2d", lambda: (ts[0], [3, 3], [2, 2], [1, 1], False)),
        "max_pool2d_ceil": ("max_pool2d", lambda: (ts[0], [2, 3], [2, 1], [1, 0], True)),
        "max_pool2d_1x1": ("max_pool2d", lambda: (ts[0], [1, 1], [], [0, 0], False)),
        "global_avg_pool": ("global_avg_pool", lambda: (ts[0], [2, 3], False)),
        "global_avg_pool_cl": ("global_avg_pool", lambda: (ts[0], [-1, -2], True)),
    }[name]
    torch.library.opcheck(getattr(torch.ops.kitsune, opname).default, args())


def test_more_ops_without_weights_and_edge_cases():
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(ko.layer_norm_relu(x, (3, 8)), F.relu(F.layer_norm(x, (3, 8))))
    h, y = ko.add_layer_norm(x, x)
    torch.testing.assert_close(y, F.layer_norm(2 * x, (8,)))
    assert torch.isnan(ko.cross_entropy(torch.randn(2, 3), torch.tensor([-100, -100])))   # as F.cross_entropy
    assert ko.sum_squared(torch.empty(0)).item() == 0 and torch.isnan(ko.mean_abs(torch.empty(0)))
    torch.testing.assert_close(ko.cross_entropy(x[0, 0], torch.tensor(3)), F.cross_entropy(x[0, 0], torch.tensor(3)))
    xr = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    ko.add_layer_norm(xr, xr.detach())[0].sum().backward()   # only the sum used: y's gradient is None
    torch.testing.assert_close(xr.grad, torch.ones_like(xr))


def _ce_saved_and_grads(logits, target, scales, **kw):
    """The tensors kitsune.cross_entropy's autograd saves, and d(loss * s)/d(logits)
    for each s in scales, the graph kept between them (retain_graph) but the last."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = ko.cross_entropy(logits, target, **kw)
    grads = [torch.autograd.grad(loss * s, logits, retain_graph=i + 1 < len(scales))[0] for i, s in enumerate(scales)]
    return loss, saved, grads


def test_cross_entropy_forms_the_gradient_in_the_forward_and_keeps_no_logits():
    """With logits that need a gradient, the forward forms it and saves it instead of
    the logits (which can then be freed); the backward scales it by the incoming
    gradient: 1 (nothing to do), 2.5 and -3, the graph kept for the next backward
    (a new tensor) but for the last one (in place)."""
    g = torch.Generator().manual_seed(11)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = _t((9, 13), dtype, "cpu", g).requires_grad_()
        t = torch.tensor([0, 12, -100, 5, 7, 1, 3, -100, 2])
        _, saved, grads = _ce_saved_and_grads(x, t, [1.0, 2.5, -3.0], label_smoothing=0.1)
        assert all(s.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for s in saved), \
            "the logits were saved for the backward"
        x64 = x.detach().double().requires_grad_()
        ref, = torch.autograd.grad(F.cross_entropy(x64, t, label_smoothing=0.1), x64)
        for s, got in zip([1.0, 2.5, -3.0], grads):
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got.double(), ref * s, rtol=tol, atol=tol)
        assert (grads[0][t == -100] == 0).all()
    # the logits die with the forward's last reference to them
    import gc
    import weakref
    h, w = torch.randn(6, 5), torch.randn(5, 11, requires_grad=True)
    logits = h @ w
    alive = weakref.ref(logits)
    loss = ko.cross_entropy(logits, torch.arange(6))
    del logits
    gc.collect()
    assert alive() is None, "kitsune.cross_entropy kept the logits alive"
    loss.backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(F.cross_entropy(h @ w, torch.arange(6)), w)[0])
    # without a gradient to form, the loss alone (and the logits kept for a backward
    # only when asked for)
    with torch.no_grad():
        torch.testing.assert_close(ko.cross_entropy(h @ w, torch.arange(6)), F.cross_entropy(h @ w, torch.arange(6)))


def test_cross_entropy_refuses_a_double_backward_instead_of_a_wrong_one():
    """The gradient formed in the forward is a constant to autograd: a backward with
    create_graph=True (a gradient penalty, say) would drop its derivative with respect
    to the logits. cross_entropy and linear_cross_entropy raise, naming F.cross_entropy
    as the way; a plain backward and a retained graph still work."""
    h, w = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    t = torch.arange(6)
    loss = ko.cross_entropy(h @ w, t)
    with pytest.raises(RuntimeError, match="no double backward.*create_graph=True.*F.cross_entropy"):
        torch.autograd.grad(loss, w, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy has no double backward.*create_graph=True"):
        torch.autograd.grad(ko.linear_cross_entropy(h, w.t(), t), w, create_graph=True)
    loss = ko.cross_entropy(h @ w, t)
    g1, = torch.autograd.grad(loss, w, retain_graph=True)
    g2, = torch.autograd.grad(loss, w)
    ref, = torch.autograd.grad(F.cross_entropy(h @ w, t), w)
    torch.testing.assert_close(g1, ref)
    torch.testing.assert_close(g2, ref)


def test_cross_entropy_under_autocast_returns_a_float32_loss():
    """As F.cross_entropy under autocast: a float32 loss for 16-bit logits (the op's
    float_loss, which the Autocast kernel sets); outside autocast the logits' dtype.
    The loss is the fp32 mean, not a 16-bit value widened. linear_cross_entropy too,
    with and without a gradient to form."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 29, generator=g).to(torch.bfloat16)
    t = torch.randint(0, 29, (37,), generator=g)
    ref = F.cross_entropy(x.double(), t)
    assert ko.cross_entropy(x, t).dtype == torch.bfloat16
    for need_grad in (False, True):
        xi = x.clone().requires_grad_(need_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ko.cross_entropy(xi, t)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)   # a bf16 loss would be off by ~4e-3
        if need_grad:
            loss.backward()
            assert xi.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ko.cross_entropy(x.double(), t).dtype == torch.float64   # not a 16-bit type: as given
    for op in (torch.ops.kitsune.cross_entropy.default, torch.ops.kitsune.cross_entropy_with_grad.default):
        torch.library.opcheck(op, (x, t), {"float_loss": True})
    # linear_cross_entropy likewise (it used to widen a bf16-rounded loss)
    h = torch.randn(37, 16, generator=g)
    wt = torch.randn(29, 16, generator=g, requires_grad=True)
    ref = F.cross_entropy(F.linear(h.to(torch.bfloat16).double(), wt.detach().to(torch.bfloat16).double()), t)
    for need_grad in (False, True):
        with torch.set_grad_enabled(need_grad), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ko.linear_cross_entropy(h, wt, t)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)   # widened bf16: off by 1.1e-4
        if need_grad:
            loss.backward()
            assert wt.grad.dtype == torch.float32 and wt.grad.abs().sum() > 0
    hb, wb = h.to(torch.bfloat16), wt.detach().to(torch.bfloat16)
    for op in (torch.ops.kitsune.linear_cross_entropy.default, torch.ops.kitsune.linear_cross_entropy_grads.default):
        torch.library.opcheck(op, (hb, wb, t), {"float_loss": True})


def test_cross_entropy_rescale_scales_in_place():
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    torch.ops.kitsune.cross_entropy_rescale_(g, torch.tensor(1.0))
    assert g.tolist() == [1.0, -2.0, 0.5]
    torch.ops.kitsune.cross_entropy_rescale_(g, torch.tensor(-3.0, dtype=torch.float64))
    assert g.tolist() == [-3.0, 6.0, -1.5]
    with pytest.raises(RuntimeError, match="by must have one element"):
        torch.ops.kitsune.cross_entropy_rescale_(g, torch.ones(2))
    x = torch.randn(5, 7, dtype=torch.float64)
    torch.library.opcheck(torch.ops.kitsune.cross_entropy_with_grad.default, (x, torch.tensor([0, 6, 2, -100, 3])))
    torch.library.opcheck(torch.ops.kitsune.cross_entropy_rescale_.default, (x.clone(), torch.tensor(2.0)))


def test_more_fakes_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 6, 8)
        assert ko.sum_squared(x, (0, 2), keepdim=True).shape == (1, 6, 1)
        assert ko.mean_abs(x, -1).shape == (4, 6) and ko.sum_squared(x).shape == ()
        assert ko.cross_entropy(torch.empty(5, 7), torch.empty(5, dtype=torch.long)).shape == ()
        assert [t.shape for t in ko.add_layer_norm(x, x)] == [(4, 6, 8), (4, 6, 8)]
        assert ko.attention_score(torch.empty(2, 3, 16), torch.empty(2, 5, 16)).shape == (2, 3, 5)


def test_more_bad_inputs_name_the_problem():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"normalized_shape \[7\] must match the trailing dimensions"):
        ko.layer_norm_relu(x, 7)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ko.layer_norm_relu(x, 8, torch.randn(4))
    with pytest.raises(RuntimeError, match="x and residual must have one shape"):
        ko.add_layer_norm(x, torch.randn(8))
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        ko.add_layer_norm(x, x, eps=-1.0)
    with pytest.raises(RuntimeError, match="target must be int64"):
        ko.cross_entropy(x, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="a target is outside"):
        ko.cross_entropy(x, torch.tensor([0, 1, 8, 2]))
    with pytest.raises(RuntimeError, match="label_smoothing must be in"):
        ko.cross_entropy(x, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
    with pytest.raises(RuntimeError, match="logits must be"):
        ko.cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"weight must be \(num_classes"):
        ko.linear_cross_entropy(x, torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="bias must have 10 elements"):
        ko.linear_cross_entropy(x, torch.randn(10, 8), torch.zeros(4, dtype=torch.long), torch.randn(9))
    with pytest.raises(RuntimeError, match="dim 2 is out of range"):
        ko.sum_squared(x, 2)
    with pytest.raises(RuntimeError, match="must share batch dims and d"):
        ko.attention_score(torch.randn(2, 3, 4), torch.randn(2, 3, 5))
    y = torch.randn(2, 3, 4, 4)
    with pytest.raises(RuntimeError, match=r"need y \(N, C, ...\) and bias \(C,\); got \[2, 3, 4, 4\] and \[4\]"):
        ko.channel_bias(y, torch.randn(4))
    with pytest.raises(RuntimeError, match="act must be 'none' or 'relu', got 'gelu'"):
        ko.channel_bias(y, torch.randn(3), "gelu")
    with pytest.raises(RuntimeError, match="y is Float but bias is Double"):
        ko.channel_bias(y, torch.randn(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="need y"):
        ko.channel_bias(torch.randn(3), torch.randn(3))
    with pytest.raises(RuntimeError, match=r"need y \(N, C, H, W\) and bias \(C,\); got \[2, 3, 4\] and \[3\]"):
        ko.bias_relu_pool(torch.randn(2, 3, 4), torch.randn(3), 2)
    with pytest.raises(RuntimeError, match="y is Float but bias is Double"):
        ko.bias_relu_pool(y, torch.randn(3, dtype=torch.float64), 2)
    with pytest.raises(RuntimeError, match="bias_relu_pool: y must be floating point .*; got Long"):
        ko.bias_relu_pool(torch.ones(2, 3, 4, 4, dtype=torch.long), torch.ones(3, dtype=torch.long), 2)
    with pytest.raises(RuntimeError, match=r"kernel_size must be in 1..64, got \[0, 2\]"):
        ko.bias_relu_pool(y, torch.randn(3), (0, 2))
    with pytest.raises(RuntimeError, match="the input's 4 x 4 is smaller than the 5 x 5 window"):
        ko.bias_relu_pool(y, torch.randn(3), 5)
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(RuntimeError, match=r"max_pool2d: need x \(N, C, H, W\) or \(C, H, W\), got \[3, 4\]"):
        ko.max_pool2d(torch.randn(3, 4), 2)
    with pytest.raises(RuntimeError, match="max_pool2d: x must be floating point .*; got Long"):
        ko.max_pool2d(torch.ones(2, 3, 4, 4, dtype=torch.long), 2)
    with pytest.raises(RuntimeError, match=r"kernel_size must be positive, got \[0, 2\]"):
        ko.max_pool2d(x, (0, 2))
    with pytest.raises(RuntimeError, match=r"stride must be positive, got \[1, 0\]"):
        ko.max_pool2d(x, 2, (1, 0))
    with pytest.raises(RuntimeError, match=r"padding must be in 0..kernel_size / 2, got padding \[2, 2\] for kernel_size \[3, 3\]"):
        ko.max_pool2d(x, 3, 1, 2)
    with pytest.raises(RuntimeError, match="the input's 4 x 4 \\(padding \\[0, 0\\]\\) is smaller than the 5 x 5 window"):
        ko.max_pool2d(x, 5)
    with pytest.raises(RuntimeError, match="C, H and W must be non-zero"):
        ko.max_pool2d(torch.randn(2, 0, 4, 4), 2)
    assert ko.max_pool2d(torch.randn(0, 3, 4, 4), 2).shape == (0, 3, 2, 2)   # an empty batch, as F.max_pool2d
    with pytest.raises(RuntimeError, match="global_avg_pool: dim 4 is out of range for a tensor of 4 dimensions"):
        ko.global_avg_pool(torch.randn(2, 3, 4, 4), (2, 4))
    with pytest.raises(RuntimeError, match="global_avg_pool: x must be floating point .*; got Long"):
        ko.global_avg_pool(torch.ones(2, 3, 4, 4, dtype=torch.long))
    assert torch.isnan(ko.global_avg_pool(torch.randn(2, 3, 0, 4))).all()   # no pixels: NaN, as x.mean
    with pytest.raises(RuntimeError, match="need as many biases as parts .at least one., got 2 parts and 1 biases"):
        ko.bias_cat([x, x], [torch.randn(3)])
    with pytest.raises(RuntimeError, match=r"part 1: need x \(N, C, H, W\) or \(C, H, W\), as part 0, and bias "
                                           r"\(C,\); got \[2, 3, 4, 4\] and \[2\]"):
        ko.bias_cat([x, x], [torch.randn(3), torch.randn(2)])
    with pytest.raises(RuntimeError, match=r"part 1: need .*; got \[3, 4, 4\] and \[3\]"):
        ko.bias_cat([x, x[0]], [torch.randn(3), torch.randn(3)])
    with pytest.raises(RuntimeError, match=r"bias_cat: part 1 of shape \[2, 3, 4, 5\] does not match part 0's"):
        ko.bias_cat([x, torch.randn(2, 3, 4, 5)], [torch.randn(3), torch.randn(3)])
    with pytest.raises(RuntimeError, match="part 0 is Float but part 1 is Double"):
        ko.bias_cat([x, x.double()], [torch.randn(3), torch.randn(3, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="a part is Float but its bias is Double"):
        ko.bias_cat([x], [torch.randn(3, dtype=torch.float64)])


def test_global_avg_pool_launchers_check_their_arguments():
    """kt_global_avg_pool and its backward (C, through ctypes) refuse a negative size, a
    missing pointer where there is work, no pixels for a forward with outputs, and an
    unknown dtype, all before any launch (so no GPU is needed); an empty problem is a
    success that touches nothing."""
    import ctypes
    from kitsune import _native
    lib = ctypes.CDLL(_native.library_path())
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fwd, bwd = lib.kt_global_avg_pool, lib.kt_global_avg_pool_backward
    for f in (fwd, bwd):
        f.argtypes, f.restype = [ctypes.c_int, p, p, i64, i64, i64, p], ctypes.c_int
    OK, INVALID = 0, 1
    a, b = p(0x1000), p(0x2000)   # never dereferenced: every case ends before a launch
    for f in (fwd, bwd):
        assert f(0, a, b, -1, 4, 4, None) == INVALID
        assert f(0, a, b, 2, -4, 4, None) == INVALID
        assert f(0, a, b, 2, 4, -1, None) == INVALID
        assert f(0, a, None, 2, 4, 4, None) == INVALID
        assert f(0, None, b, 2, 4, 4, None) == INVALID
        assert f(7, a, b, 2, 4, 4, None) == INVALID   # no such dtype
        assert f(0, None, None, 0, 4, 4, None) == OK and f(0, None, None, 2, 0, 4, None) == OK
    assert fwd(0, a, b, 2, 4, 0, None) == INVALID   # the mean of no pixels is ATen's NaN, not ours
    assert bwd(0, None, None, 2, 4, 0, None) == OK  # nothing to write


def test_gelu_grad_colsum_launcher_checks_its_arguments():
    """kt_bias_gelu_grad_colsum (C, through ctypes: GELU's backward and the bias
    gradient in one pass) refuses an unknown approximation or out_f32 flag, a missing
    gradient, pre-activation, output or input-gradient pointer, a negative row count,
    no columns, an unknown dtype and a missing workspace where the sums take one, all
    before any launch (so no GPU is needed); the bias may be NULL."""
    import ctypes
    from kitsune import _native
    lib = ctypes.CDLL(_native.library_path())
    i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    f = lib.kt_bias_gelu_grad_colsum
    f.argtypes, f.restype = [c_int, c_int, p, p, p, p, p, p, i64, i64, c_int, p], c_int
    ws = lib.kt_colsum_workspace
    ws.argtypes, ws.restype = [c_int, i64, i64], i64
    INVALID = 1
    g, x, b, gx, out = (p(0x1000 * k) for k in range(1, 6))   # never dereferenced
    rows, cols = 4096, 512
    assert ws(2, rows, cols) > 0   # so a NULL workspace is refused below
    for args in [(2, 0, g, x, b, gx, out, None, 8, cols, 2, None),        # approximate 2
                 (2, 2, g, x, b, gx, out, None, 8, cols, 1, None),        # out_f32 2
                 (2, 0, None, x, b, gx, out, None, 8, cols, 1, None),     # no gradient
                 (2, 0, g, None, b, gx, out, None, 8, cols, 1, None),     # no pre-activation
                 (2, 0, g, x, b, None, out, None, 8, cols, 1, None),      # no input gradient
                 (2, 0, g, x, b, gx, None, None, 8, cols, 1, None),       # no sums
                 (2, 0, g, x, None, gx, out, None, -1, cols, 1, None),    # negative rows
                 (2, 0, g, x, None, gx, out, None, 8, 0, 1, None),        # no columns
                 (5, 0, g, x, None, gx, out, None, 8, cols, 1, None),     # no such dtype
                 (2, 0, g, x, None, gx, out, None, rows, cols, 1, None)]:  # the workspace missing
        assert f(*args) == INVALID, args


def test_graph_node_waits_first_without_a_node():
    """kt_graph_node_waits_first (C, through ctypes; what capture plans ask of a
    programmatic edge's target) answers 0 for no node, without touching CUDA. Its real
    answers are checked on the GPU (test_graph.py: programmatic_ordered)."""
    import ctypes
    from kitsune import _native
    f = ctypes.CDLL(_native.library_path()).kt_graph_node_waits_first
    f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_int
    assert f(None) == 0


def test_graph_memsets_to_kernels_without_a_graph():
    """kt_graph_memsets_to_kernels refuses no graph (KT_ERR_INVALID) and says it replaced
    nothing, without touching CUDA; on a real graph it runs on the GPU (test_graph.py)."""
    import ctypes
    from kitsune import _native
    n = ctypes.c_int(-1)
    assert _native.native().kt_graph_memsets_to_kernels(None, 1 << 16, ctypes.byref(n)) == _native.ERR_INVALID
    assert n.value == 0


def test_channel_sum_every_layout_and_empty():
    """The bias gradient's two-stage sum equals a float64 sum over every dim but 1, for
    NCHW, channels-last, 2-D and non-contiguous input, and copies no slice of a
    gradient (fb40403 made a contiguous copy of each, on the H100 8 more copy kernels a
    step in the Inception net); an empty batch gives zeros; fp64 input is summed in fp64."""
    g = torch.Generator().manual_seed(11)
    for shape in [(2, 3, 4, 5), (64, 6, 24, 24), (128, 7, 3, 3), (37, 5), (1024, 3), (3, 4, 7)]:
        x = torch.randn(shape, generator=g)
        want = x.double().sum([d for d in range(x.dim()) if d != 1])
        for v in (x, x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x,
                  x.transpose(0, 1).contiguous().transpose(0, 1)):
            got = torch.ops.kitsune.channel_sum(v)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    cl = torch.randn(4, 10, 5, 5, generator=g).contiguous(memory_format=torch.channels_last)
    for v in (cl[:, 2:6], cl[:, :, 1:4], torch.randn(4, 10, 3, generator=g)[:, 3:7]):   # torch.cat's gradient slices
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = torch.ops.kitsune.channel_sum(v)
        torch.testing.assert_close(got.double(), v.double().sum([d for d in range(v.dim()) if d != 1]),
                                   rtol=1e-5, atol=1e-4)
        copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::contiguous", "aten::clone")]
        assert not copies, f"{tuple(v.shape)} {v.stride()}: the sum copied its input ({copies})"
    assert torch.equal(torch.ops.kitsune.channel_sum(torch.empty(0, 4, 2, 2)), torch.zeros(4))
    x = torch.randn(5, 3, 2, dtype=torch.float64, generator=g)
    got = torch.ops.kitsune.channel_sum(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, x.sum((0, 2)), rtol=0, atol=1e-13)


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products an autograd call runs (C++ kernels' ATen calls included)."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _frozen_linear_act_grads(act, frozen, device, dtype, gen):
    """linear_act's gradients with the inputs in `frozen` not requiring them, against
    F.linear's in float64; returns the mm/addmm count of linear_act's backward."""
    x, w, b = (_t(s, dtype, device, gen, scale=sc) for s, sc in (((6, 5, 24), 1.0), ((16, 24), 0.1), ((16,), 1.0)))
    ts = [t.requires_grad_(i not in frozen) for i, t in enumerate((x, w, b))]
    ref = {"relu": lambda y: F.relu(y), "gelu": F.gelu, "none": lambda y: y,
           "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[act]
    go = torch.randn(6, 5, 16, generator=gen, dtype=torch.float64)
    out = ko.linear_act(*ts, act)
    with _CountMM() as count:
        out.backward(go.to(device, dtype))
    t64 = [t.detach().double().requires_grad_(t.requires_grad) for t in ts]
    ref(F.linear(*t64)).backward(go.to(device))
    theirs = [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]   # torch's own, in dtype
    ref(F.linear(*theirs)).backward(go.to(device, dtype))
    for i, (t, r, th) in enumerate(zip(ts, t64, theirs)):
        what = f"{act} {dtype} frozen {frozen}: input {i}"
        if i in frozen:
            assert t.grad is None, f"{what} does not require a gradient but got one"
        elif dtype == torch.float64:
            torch.testing.assert_close(t.grad, r.grad, rtol=1e-7, atol=1e-9)
        else:
            _check_close(t.grad, r.grad, th.grad, dtype, what, max(1.0, r.grad.abs().max().item()))
    return count.n


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "none"])
def test_linear_act_computes_only_the_gradients_asked_for(act):
    """A first layer's input (the batch) needs no gradient: its backward must not run
    the (M, K) product for it (on the H100 that GEMM was a fifth of the MLP's backward
    GEMMs). Frozen weights and biases likewise; the gradients asked for are exact."""
    g = torch.Generator().manual_seed(21)
    full = _frozen_linear_act_grads(act, (), "cpu", torch.float64, g)
    assert full == 2, f"{act}: expected the weight's and the input's products, counted {full}"
    for frozen in [(0,), (1,), (2,), (0, 2), (1, 2)]:
        n = _frozen_linear_act_grads(act, frozen, "cpu", torch.float64, g)
        assert n == 2 - (0 in frozen) - (1 in frozen), f"{act} frozen {frozen}: {n} products"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_linear_act_frozen_inputs(dtype):
    """The cuBLASLt paths with some inputs frozen: the gradients asked for match float64."""
    g = torch.Generator().manual_seed(22)
    for act in ("relu", "gelu", "gelu_tanh", "none"):
        for frozen in [(), (0,), (1,), (2,), (0, 2), (1, 2)]:
            _frozen_linear_act_grads(act, frozen, "cuda", dtype, g)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_column_sums_exact_on_integers(dtype):
    """kt_colsum through channel_sum: small integers are exact in every dtype and their
    fp32 sums too, so each column must equal the int64 sum exactly (a row missed or
    summed twice fails). Widths of one column a lane and of 16-byte vectors, one slab
    and many, rows ld > C apart (a slice of wider rows), a misaligned start, channels
    last 4-D and its channel slices; the output memory is poisoned first; two calls
    agree bit for bit."""
    g = torch.Generator().manual_seed(12)

    def check(v, what):
        want = v.cpu().long().sum([d for d in range(v.dim()) if d != 1])
        _poison(v.shape[1] * 64, "cuda")
        got = torch.ops.kitsune.channel_sum(v)
        assert got.dtype == torch.float32 and got.shape == want.shape, what
        assert torch.equal(got.cpu().long(), want) and torch.equal(got.cpu(), want.float()), what
        assert torch.equal(torch.ops.kitsune.channel_sum(v), got), f"{what}: not deterministic"

    for rows, cols in [(1, 1), (7, 3), (33, 8), (64, 64), (1000, 33), (4096, 1536), (70000, 5), (300, 2049)]:
        x = torch.randint(-8, 9, (rows, cols + 11), generator=g).to("cuda", dtype)
        check(x[:, :cols].contiguous(), f"{dtype} ({rows}, {cols})")
        check(x[:, :cols], f"{dtype} ({rows}, {cols}) rows {cols + 11} apart")
        check(x[:, 3:3 + cols], f"{dtype} ({rows}, {cols}) misaligned")
    y = torch.randint(-8, 9, (64, 48, 9, 7), generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    for v, what in ((y, "channels last"), (y[:, 8:40], "a channel slice"), (y[:, 3:10], "a misaligned slice"),
                    (y[:1, :, :1, :1], "one row")):
        check(v, f"{dtype} {what} {tuple(v.shape)} {v.stride()}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_column_sums_replayed_in_a_cuda_graph(dtype):
    """kt_colsum inside a CUDA graph, where every replay launches with the same
    arguments and workspace: five replays of sums over many slabs, each on new integer
    inputs copied into the static input, are exact. (Kept from 32b4210's one-launch
    column sum, whose arrival counter lived in the workspace across replays.) Also
    eager calls whose workspaces come out of memory filled with 0xff bytes."""
    g = torch.Generator().manual_seed(31)
    shapes = [(4096, 512), (70000, 5), (300, 2049), (8192, 2048)]
    xs = [torch.randint(-8, 9, s, generator=g).to("cuda", dtype) for s in shapes]
    torch.ops.kitsune.channel_sum(xs[0])   # load the library and its kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [torch.ops.kitsune.channel_sum(x) for x in xs]
    for replay in range(5):
        for x, s in zip(xs, shapes):
            x.copy_(torch.randint(-8, 9, s, generator=g).to("cuda", dtype))
        graph.replay()
        torch.cuda.synchronize()
        for x, out, s in zip(xs, outs, shapes):
            want = x.cpu().long().sum(0)
            assert torch.equal(out.cpu().long(), want), f"{dtype} {s} replay {replay}"
    for x, s in zip(xs, shapes):
        junk = torch.full((x.numel() // 2 + 65536,), -1, dtype=torch.int32, device="cuda")   # 0xffffffff words
        del junk
        want = x.cpu().long().sum(0)
        for call in range(3):
            assert torch.equal(torch.ops.kitsune.channel_sum(x).cpu().long(), want), f"{dtype} {s} eager {call}"


def _window_values(shape, dtype, gen, kind, ties):
    """Pooling inputs on the GPU: "random" normal values; "ties" small integers in
    [ties[0], ties[1]) (many equal values in a window, exact sums); "nan" normal values
    with one element in 50 NaN."""
    if kind == "ties":
        return torch.randint(*ties, shape, generator=gen).to("cuda", dtype)
    x = _t(shape, dtype, "cuda", gen)
    if kind == "nan":
        x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 50),), generator=gen).cuda()] = float("nan")
    return x


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_bias_relu_pool_equals_the_unfused_ops(dtype):
    """The fused kernels against torch's own max_pool2d(relu(y + bias)) in the same dtype:
    the output and the input gradient bit for bit (the same winners), also with many ties
    (small integers) and NaNs (which win, and pass their gradient as torch.relu's
    backward does); the bias gradient within fp32 rounding of the float64 sum of torch's
    input gradient. Outputs land in poisoned memory; a channels-last y takes the ATen path
    and agrees too."""
    g = torch.Generator().manual_seed(23)
    cases = [((64, 6, 28, 28), 2), ((64, 16, 10, 10), 2), ((5, 3, 9, 7), (3, 2)), ((2, 4, 6, 6), 3), ((1, 1, 2, 2), 2)]
    for (shape, k), kind in [(c, kind) for c in cases for kind in ("random", "ties", "nan")]:
        y = _window_values(shape, dtype, g, kind, (-3, 4))
        b = (torch.randint(-1, 2, (shape[1],), generator=g).to("cuda", dtype) if kind == "ties" else
             _t((shape[1],), dtype, "cuda", g))
        for layout in ("nchw", "channels_last"):
            yl = y.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else y
            what = f"{dtype} {shape} k={k} {kind} {layout}"
            ya, ba = yl.clone().requires_grad_(), b.clone().requires_grad_()
            yr, br = yl.clone().requires_grad_(), b.clone().requires_grad_()
            _poison(4 * y.numel(), "cuda")
            out = ko.bias_relu_pool(ya, ba, k)
            ref = F.max_pool2d(F.relu(yr + br.view(1, -1, 1, 1)), k)
            torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True, msg=what)
            go = torch.randn(ref.shape, generator=g).to("cuda", dtype)
            _poison(4 * y.numel(), "cuda")
            gy, gb = torch.autograd.grad(out, (ya, ba), go)
            ry, rb = torch.autograd.grad(ref, (yr, br), go)
            torch.testing.assert_close(gy, ry, rtol=0, atol=0, msg=what)
            want = ry.double().sum((0, 2, 3))
            tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
            torch.testing.assert_close(gb.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()),
                                       msg=what)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_max_pool2d_equals_aten(dtype):
    """kitsune.max_pool2d's kernels against ATen's F.max_pool2d in the same dtype: output and
    input gradient bit for bit (the same winners, the gradient summed in ATen's order), with
    random values, many ties (small integers) and NaNs, NCHW and channels-last, in poisoned
    memory; the output's layout is ATen's, the backward takes a gradient in another layout,
    and the autograd graph saves one byte per output (ATen: an int64 index)."""
    g = torch.Generator().manual_seed(29)
    cases = [((64, 64, 32, 32), 3, 1, 1, False), ((128, 64, 16, 16), 3, 2, 1, False), ((5, 6, 9, 7), (2, 3), (2, 1), (1, 0), True),
             ((3, 8, 6, 6), 2, None, 0, False), ((2, 4, 5, 5), 1, 1, 0, False), ((2, 12, 11, 9), 4, 3, 2, True)]
    for (shape, k, st, pad, ceil), kind in [(c, kind) for c in cases for kind in ("random", "ties", "nan")]:
        x = _window_values(shape, dtype, g, kind, (-2, 3))
        for layout in ("nchw", "channels_last"):
            xl = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
            what = f"{dtype} {shape} k={k} s={st} p={pad} ceil={ceil} {kind} {layout}"
            xa, xr = xl.clone().requires_grad_(), xl.clone().requires_grad_()
            _poison(4 * x.numel(), "cuda")
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = ko.max_pool2d(xa, k, st, pad, ceil)
            ref = F.max_pool2d(xr, k, st, pad, ceil_mode=ceil)
            torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True, msg=what)
            assert out.stride() == ref.stride(), what
            assert [(t.dtype, t.shape) for t in saved] == [(torch.uint8, out.shape)], what
            for go in (torch.randn(ref.shape, generator=g).to("cuda", dtype),
                       torch.randn(ref.shape, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)):
                _poison(4 * x.numel(), "cuda")
                (gx,) = torch.autograd.grad(out, xa, go, retain_graph=True)
                (rx,) = torch.autograd.grad(ref, xr, go, retain_graph=True)
                torch.testing.assert_close(gx, rx, rtol=0, atol=0, msg=what)
                assert gx.stride() == rx.stride(), what


def test_embedding_cpu_matches_f_embedding():
    """kitsune.embedding on the CPU (ATen's lookup and dense backward): values and fp64
    weight gradients of F.embedding, with repeated indices, 2-D and int32 indices,
    padding_idx positive, negative and None; opcheck; bad arguments named."""
    g = torch.Generator().manual_seed(47)
    w = torch.randn(11, 6, dtype=torch.float64, generator=g)
    for idx, pad in [(torch.randint(0, 11, (3, 7), generator=g), None), (torch.tensor([1, 1, 1, 4, 10]), 1),
                     (torch.randint(0, 11, (9,), generator=g, dtype=torch.int32), -2)]:
        wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
        got, want = ko.embedding(idx, wa, pad), F.embedding(idx, wb, pad)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        go = torch.randn(got.shape, dtype=torch.float64, generator=g)
        torch.testing.assert_close(torch.autograd.grad(got, wa, go)[0], torch.autograd.grad(want, wb, go)[0],
                                   rtol=0, atol=0)
    torch.library.opcheck(torch.ops.kitsune.embedding.default, (w.float().requires_grad_(), idx.long(), 3))
    with pytest.raises(RuntimeError, match=r"padding_idx must be -1 \(none\) or in \[0, 11\), got 11"):
        torch.ops.kitsune.embedding(w, idx.long(), 11)
    with pytest.raises(RuntimeError, match="indices must be int64 or int32, got Float"):
        ko.embedding(idx.float(), w)
    with pytest.raises(RuntimeError, match=r"weight must be \(num_embeddings, embedding_dim\), got \[66\]"):
        ko.embedding(idx, w.flatten())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_embedding_weight_gradient(dtype):
    """kitsune.embedding's CUDA backward against the fp64 sum of the gradient rows of
    each index: GPT's 4096 tokens over 8192 rows, every token one index, runs longer than
    a block, padding_idx, a row width that is not a multiple of the 16-byte vector, no
    tokens; poisoned memory (every row written, unnamed ones zero), the same bits twice."""
    g = torch.Generator().manual_seed(53)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    cases = [((16, 256), 8192, 512, None, "random"), ((4096,), 8192, 512, None, "one"),
             ((3, 300), 50, 24, 7, "random"), ((5, 64), 1000, 13, None, "random"), ((0,), 20, 16, None, "random")]
    for shape, rows, dim, pad, kind in cases:
        what = f"{dtype} {shape} rows={rows} dim={dim} pad={pad} {kind}"
        idx = (torch.full(shape, 3) if kind == "one" else torch.randint(0, rows, shape, generator=g)).cuda()
        w = torch.randn(rows, dim, generator=g).to("cuda", dtype).requires_grad_()
        go = torch.randn(*shape, dim, generator=g).to("cuda", dtype)
        grads = []
        for _ in range(2):
            _poison(4 * rows * dim + 4 * go.numel(), "cuda")
            out = ko.embedding(idx, w, pad)
            torch.testing.assert_close(out, F.embedding(idx, w.detach(), pad), rtol=0, atol=0, msg=what)
            grads.append(torch.autograd.grad(out, w, go)[0])
        assert torch.equal(grads[0], grads[1]), what
        want = torch.zeros(rows, dim, dtype=torch.float64, device="cuda").index_add_(
            0, idx.reshape(-1), go.reshape(-1, dim).double())
        if pad is not None:
            want[pad] = 0
        assert not torch.isnan(grads[0]).any(), what
        torch.testing.assert_close(grads[0].double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()),
                                   msg=what)


def _branches_ref(x, n, k, s, p, ceil, ws):
    """max_pool2d(x) and n other users of x (x * w_i), as autograd sums them."""
    return [F.max_pool2d(x, k, s, p, ceil_mode=ceil)] + [x * w for w in ws[:n]]


def _branches_got(x, n, k, s, p, ceil, ws):
    outs = ko.max_pool2d_branches(x, n, k, s, p, ceil)
    return [outs[0]] + [v * w for v, w in zip(outs[1:], ws)]


def test_max_pool2d_branches_cpu_values_gradients_and_fakes():
    """The CPU reference path of max_pool2d_branches (max_pool2d_where's bytes, the
    backward's sum of the pooling's and the views' gradients): values and fp64 gradients
    of the pooling and up to 5 other users (past the kernel's 4 addend slots), NCHW and
    channels-last, a branch without a gradient, the pooled output unused; opcheck of
    both ops; fake shapes and layouts."""
    g = torch.Generator().manual_seed(41)
    for shape, k, s, p, ceil, n, cl in [((2, 3, 5, 6), [3, 3], [1, 1], [1, 1], False, 3, False),
                                         ((2, 4, 6, 5), [2, 3], [2, 1], [1, 0], True, 1, True),
                                         ((1, 2, 4, 4), [3, 3], [2, 2], [1, 1], False, 5, False)]:
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        x = x.contiguous(memory_format=torch.channels_last) if cl else x
        ws = [torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(n)]
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = _branches_got(xa, n, k, s, p, ceil, ws), _branches_ref(xb, n, k, s, p, ceil, ws)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert got[0].is_contiguous(memory_format=torch.channels_last) == cl
        outs = ko.max_pool2d_branches(xa, n, k, s, p, ceil)
        assert all(v._base is xa for v in outs[1:])   # views, not copies
        gos = [torch.randn(t.shape, dtype=torch.float64, generator=g) for t in got]
        ga = torch.autograd.grad(got, xa, gos, retain_graph=True)[0]
        gb = torch.autograd.grad(want, xb, gos)[0]
        torch.testing.assert_close(ga, gb, rtol=1e-14, atol=1e-14)
        # a view without a gradient, and the pooled output unused
        ga = torch.autograd.grad([got[1]], xa, [gos[1]], retain_graph=True)[0]
        torch.testing.assert_close(ga, gos[1] * ws[0])
    # gradcheck on a small case
    x = torch.randn(1, 2, 4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ws = [torch.randn(1, 2, 4, 5, dtype=torch.float64, generator=g) for _ in range(2)]
    assert torch.autograd.gradcheck(lambda t: _branches_got(t, 2, [3, 3], [1, 1], [1, 1], False, ws), (x,))
    # the ops themselves
    x = torch.randn(2, 3, 5, 6, generator=g)
    torch.library.opcheck(torch.ops.kitsune.max_pool2d_where.default, (x, [3, 3], [1, 1], [1, 1], False))
    out, where = torch.ops.kitsune.max_pool2d_where(x, [3, 3], [1, 1], [1, 1], False)
    adds = [torch.randn(2, 3, 5, 6, generator=g) for _ in range(2)]
    torch.library.opcheck(torch.ops.kitsune.max_pool2d_backward_add.default,
                          (torch.randn(out.shape, generator=g), where, adds, [2, 3, 5, 6], [3, 3], [1, 1], [1, 1], False))
    with pytest.raises(RuntimeError, match="every addend must be Float of the input's shape"):
        torch.ops.kitsune.max_pool2d_backward_add(None, where, [adds[0], adds[1][:1]], [2, 3, 5, 6], [3, 3], [1, 1],
                                                  [1, 1], False)
    with pytest.raises(RuntimeError, match="no gradient to sum"):
        torch.ops.kitsune.max_pool2d_backward_add(None, where, [], [2, 3, 5, 6], [3, 3], [1, 1], [1, 1], False)
    with pytest.raises(RuntimeError, match="where must be max_pool2d_where's uint8"):
        torch.ops.kitsune.max_pool2d_backward_add(out, out, [], [2, 3, 5, 6], [3, 3], [1, 1], [1, 1], False)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        xf = torch.empty(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
        outs = ko.max_pool2d_branches(xf, 2, 3, 1, 1)
        assert [tuple(t.shape) for t in outs] == [(2, 8, 6, 6)] * 3
    # without a gradient wanted, the other outputs are x itself
    outs = ko.max_pool2d_branches(x, 2, 3, 1, 1)
    assert outs[1] is x and outs[2] is x


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_max_pool2d_branches_sum_the_gradients_in_one_pass(dtype):
    """max_pool2d_branches on CUDA: the pooled output bit for bit ATen's, and x's gradient
    (the pooling's plus 1 to 6 other users', past the kernel's 4 addend slots) within
    rounding of the float64 sum, written everywhere (poisoned memory), in x's layout;
    the Inception block's 3 x 3 / 1 / 1 and a strided window, NCHW and channels-last,
    with random values, ties and NaNs; a gradient in the other layout; the backward
    one kernel launch where fewer than 5 users."""
    g = torch.Generator().manual_seed(43)
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    cases = [((64, 64, 32, 32), 3, 1, 1, False, 3), ((5, 8, 9, 7), 3, 2, 1, True, 1), ((3, 12, 6, 6), 2, 2, 0, False, 6)]
    for (shape, k, st, pad, ceil, n), kind in [(c, kind) for c in cases for kind in ("random", "ties", "nan")]:
        x = _window_values(shape, dtype, g, kind, (-2, 3))
        for layout in ("nchw", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            xl = x.contiguous(memory_format=fmt)
            what = f"{dtype} {shape} k={k} s={st} p={pad} n={n} {kind} {layout}"
            xa = xl.clone().requires_grad_()
            _poison(8 * x.numel(), "cuda")
            outs = ko.max_pool2d_branches(xa, n, k, st, pad, ceil)
            ref = F.max_pool2d(xl, k, st, pad, ceil_mode=ceil)
            torch.testing.assert_close(outs[0], ref, rtol=0, atol=0, equal_nan=True, msg=what)
            assert all(v._base is xa for v in outs[1:]), what
            go = torch.randn(ref.shape, generator=g).to("cuda", dtype)
            go = go.contiguous(memory_format=torch.contiguous_format if layout == "channels_last" else torch.channels_last)
            gvs = [torch.randn(shape, generator=g).to("cuda", dtype).contiguous(memory_format=fmt) for _ in range(n)]
            _poison(8 * x.numel(), "cuda")
            (gx,) = torch.autograd.grad(outs, xa, [go] + gvs)
            xr = xl.double().requires_grad_()
            (want,) = torch.autograd.grad(F.max_pool2d(xr, k, st, pad, ceil_mode=ceil), xr, go.double())
            want = want + sum(v.double() for v in gvs)
            if kind == "nan":   # ATen's winner among NaNs and ours agree (test_gpu_max_pool2d_equals_aten)
                want = torch.where(torch.isnan(want), torch.zeros_like(want), want)
                gx = torch.where(torch.isnan(gx), torch.zeros_like(gx), gx)
            assert not torch.isnan(gx).any(), what
            torch.testing.assert_close(gx.double(), want, rtol=tol, atol=tol * want.abs().max().item(), msg=what)
            assert gx.is_contiguous(memory_format=fmt), what


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_bias_cat_equals_the_unfused_ops(dtype):
    """bias_cat's kernels against torch.cat([x + b]) in the same dtype: the output bit for
    bit, each part's gradient equal to its channels of the incoming gradient and dense in
    the parts' layout where the kernels ran (cuDNN copies a slice), the bias gradients within fp32 rounding of
    the float64 sums; with a dense gradient, one in the other layout and a broadcast one
    (a mean over H, W after the cat); NCHW, channels-last, channel counts not multiples of
    4, and in poisoned memory. Mixed layouts and 9 parts take ATen's path and agree too."""
    g = torch.Generator().manual_seed(31)
    cases = [((64, 32, 32), (64, 64, 64, 64), "cl"), ((64, 32, 32), (64, 64, 64, 64), "nchw"),
             ((3, 5, 7), (4, 3, 6, 8), "cl"), ((3, 5, 7), (4, 3, 1, 8), "cl"), ((3, 5, 7), (4, 3, 1, 8), "nchw"),
             ((2, 1, 1), (8, 4), "cl"),
             ((2, 3, 3), (2, 2), "mixed"), ((2, 4, 4), (1,) * 9, "cl")]
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for (n, h, w), cs, layout in cases:
        fmts = [torch.channels_last if layout == "cl" or (layout == "mixed" and i % 2) else torch.contiguous_format
                for i in range(len(cs))]
        xs = [_t((n, c, h, w), dtype, "cuda", g).contiguous(memory_format=f) for c, f in zip(cs, fmts)]
        bs = [_t((c,), dtype, "cuda", g) for c in cs]
        what = f"{dtype} {(n, h, w)} {cs} {layout}"
        xa = [x.clone().requires_grad_() for x in xs]
        ba = [b.clone().requires_grad_() for b in bs]
        xr = [x.clone().requires_grad_() for x in xs]
        br = [b.clone().requires_grad_() for b in bs]
        _poison(4 * n * sum(cs) * h * w, "cuda")
        out = ko.bias_cat(xa, ba)
        ref = torch.cat([x + b.view(1, -1, 1, 1) for x, b in zip(xr, br)], 1)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=what)
        assert out.stride() == ref.stride(), what
        # The kernels run when every part is dense in one layout and torch.cat's output is
        # too. A 1-channel part in channels-last is also NCHW-contiguous (.contiguous keeps
        # its NCHW strides), so torch.cat returns NCHW and bias_cat takes ATen's path.
        dense = layout != "mixed" and len(cs) <= 8 and ref.is_contiguous(memory_format=fmts[0])
        assert dense == (layout != "mixed" and len(cs) <= 8 and not (layout == "cl" and 1 in cs and h * w > 1)), what
        gd = torch.randn(ref.shape, generator=g).to("cuda", dtype)
        for go, kind in ((gd, "dense"), (gd.contiguous(memory_format=torch.channels_last), "cl grad"),
                         (torch.randn(n, sum(cs), 1, 1, generator=g).to("cuda", dtype).expand_as(ref), "broadcast")):
            _poison(4 * n * sum(cs) * h * w, "cuda")
            got = torch.autograd.grad(out, xa + ba, go, retain_graph=True)
            want = torch.autograd.grad(ref, xr + br, go, retain_graph=True)
            k = len(cs)
            for i in range(k):
                torch.testing.assert_close(got[i], want[i], rtol=0, atol=0, msg=f"{what} {kind} part {i}")
                if dense:
                    assert got[i].is_contiguous(memory_format=fmts[i]), f"{what} {kind} part {i} {got[i].stride()}"
                w64 = want[i].double().sum((0, 2, 3))
                torch.testing.assert_close(got[k + i].double(), w64, rtol=tol,
                                           atol=tol * max(1.0, w64.abs().max().item()), msg=f"{what} {kind} bias {i}")
                assert got[k + i].dtype == dtype, what


def _check_close(got, want64, theirs, dtype, what, scale=1.0):
    e, te = _err(got, want64), _err(theirs, want64)
    assert not torch.isnan(got).any(), f"{what}: unwritten (NaN) outputs"
    assert got.shape == want64.shape, what
    assert e <= 2 * te + TOL_ABS[dtype] * scale, f"{what}: error {e} vs torch {te}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(OPS2))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_more_match_fp64_reference(name, dtype):
    op, ref, inputs, shapes = OPS2[name]
    g = torch.Generator().manual_seed(5)
    for shape in shapes:
        ts, other = inputs(shape, dtype, "cuda", g)
        _poison(sum(t.numel() for t in ts), "cuda")
        outs = _outs(op(*ts, *other))
        t64 = [t.double() for t in ts]
        r64, theirs = _outs(ref(*t64, *other)), _outs(ref(*ts, *other))
        # a reduction's error grows with its size: scale the absolute floor by the result
        for k, (o, r, th) in enumerate(zip(outs, r64, theirs)):
            assert o.dtype == dtype, f"{name} {dtype} {shape}: dtype {o.dtype}"
            _check_close(o, r, th, dtype, f"{name} {dtype} {shape} out{k}", max(1.0, r.abs().max().item()))
        ts = [t.requires_grad_() for t in ts]
        gos = [torch.randn(r.shape, generator=g, dtype=torch.float64).to("cuda", dtype) for r in r64]
        got = torch.autograd.grad(_outs(op(*ts, *other)), ts, gos)
        t64 = [t.detach().double().requires_grad_() for t in ts]
        want = torch.autograd.grad(_outs(ref(*t64, *other)), t64, [go.double() for go in gos])
        theirs = torch.autograd.grad(_outs(ref(*ts, *other)), ts, gos)
        for k, (a, w, th) in enumerate(zip(got, want, theirs)):
            _check_close(a, w, th, dtype, f"{name} {dtype} {shape} grad{k}", max(1.0, w.abs().max().item()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_global_avg_pool_needs_no_workspace(dtype):
    """On the Inception net's channels-last 64 x 256 x 32 x 32 map, ATen's mean over H and W
    stages partial sums in a buffer twice the input's size (128 MiB in fp32, the whole gap
    between the captured step's live peak and eager's): Kitsune's forward allocates its
    output alone, its backward the gradient alone, dense in channels-last; the values
    equal ATen's to rounding, and two calls give the same bits (a fixed summing order)."""
    g = torch.Generator().manual_seed(23)
    x = _t((64, 256, 32, 32), dtype, "cuda", g).contiguous(memory_format=torch.channels_last)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    out_bytes = 64 * 256 * x.element_size()
    used, out = peak(lambda: ko.global_avg_pool(x, (2, 3)))
    aten_used, want = peak(lambda: x.mean((2, 3)))
    print(f"{dtype}: forward peak above its input: kitsune {used / 2**20:.3f} MiB, ATen {aten_used / 2**20:.3f} MiB")
    assert used <= out_bytes + 512, f"the forward allocated {used} bytes for a {out_bytes}-byte output"
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(out, ko.global_avg_pool(x, (2, 3)))
    xr = x.detach().requires_grad_()
    y = ko.global_avg_pool(xr, (2, 3))
    go = _t(y.shape, dtype, "cuda", g)
    used, (gx,) = peak(lambda: torch.autograd.grad(y, xr, go))
    assert used <= x.numel() * x.element_size() + 2**20, f"the backward allocated {used} bytes"
    assert gx.is_contiguous(memory_format=torch.channels_last), gx.stride()
    torch.testing.assert_close(gx, (go / 1024)[:, :, None, None].expand(x.shape), rtol=0, atol=0)


@pytest.mark.gpu
@gpu
def test_gpu_cross_entropy_under_autocast_matches_f_cross_entropy():
    """On CUDA under bf16 autocast: kitsune.cross_entropy and linear_cross_entropy return
    F.cross_entropy's float32 loss (the fp32 mean, not a widened bf16 value) and bf16
    logits' gradients equal to its own to bf16 rounding (every element compared)."""
    g = torch.Generator().manual_seed(29)
    x = _t((300, 1003), torch.bfloat16, "cuda", g)
    t = torch.randint(0, 1003, (300,), generator=g).cuda()
    t[::7] = -100
    ref = F.cross_entropy(x.double(), t)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = ko.cross_entropy(a, t), F.cross_entropy(b, t)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    got.backward()
    want.backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad).all()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-5)
    h = _t((300, 64), torch.float32, "cuda", g)
    w = _t((1003, 64), torch.float32, "cuda", g).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = ko.linear_cross_entropy(h, w, t)
        want = F.cross_entropy(F.linear(h, w), t)   # both: bf16 logits from cuBLAS, then fp32 arithmetic
    assert loss.dtype == want.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=0, atol=5e-3)   # logits rounded to bf16 by different GEMMs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_cross_entropy_gradient_formed_in_the_forward(dtype):
    """On CUDA: the gradient the forward forms, scaled by 1 (no kernel writes), 0.75
    and -2 (rescaled, the graph kept between them but for the last backward), against
    an fp64 reference, the memory poisoned first; odd vocabularies (unaligned rows) too.
    With an incoming 1 it equals cross_entropy_backward's result bit for bit."""
    g = torch.Generator().manual_seed(12)
    for rows, C in ((64, 8192), (37, 50257), (5, 3)):
        x = _t((rows, C), dtype, "cuda", g, scale=2.0).requires_grad_()
        t = _targets(rows, C, "cuda", g)
        t[1] = -100
        _poison(x.numel(), "cuda")
        loss, saved, grads = _ce_saved_and_grads(x, t, [1.0, 0.75, -2.0], label_smoothing=0.05)
        assert all(s.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for s in saved)
        x64 = x.detach().double().requires_grad_()
        ref, = torch.autograd.grad(F.cross_entropy(x64, t, label_smoothing=0.05), x64)
        xt = x.detach().requires_grad_()
        theirs, = torch.autograd.grad(F.cross_entropy(xt, t, label_smoothing=0.05), xt)
        te = _err(theirs, ref)
        for s, got in zip([1.0, 0.75, -2.0], grads):
            assert not torch.isnan(got).any(), f"{dtype} {rows}x{C} x{s}: unwritten (NaN) gradient"
            e = _err(got, ref * s)
            assert e <= abs(s) * (2 * te + TOL_ABS[dtype] / rows), f"{dtype} {rows}x{C} x{s}: {e} vs torch {te}"
        old = torch.ops.kitsune.cross_entropy_backward(torch.ones((), device="cuda", dtype=dtype), x.detach(), t,
                                                       -100, 0.05)
        assert torch.equal(grads[0], old)
    # the rescale kernel on a row that is not 16-byte aligned, odd lengths
    for n in (1, 7, 8191, (1 << 20) + 5):
        base = _t((n + 1,), dtype, "cuda", g)
        v = base[1:]
        want = (v.double() * -1.5).to(dtype)
        torch.ops.kitsune.cross_entropy_rescale_(v, torch.tensor(-1.5, device="cuda"))
        assert torch.equal(v, want), n
        before = base.clone()
        torch.ops.kitsune.cross_entropy_rescale_(base, torch.tensor(1.0, device="cuda", dtype=dtype))
        assert torch.equal(base, before)


@pytest.mark.gpu
@gpu
def test_gpu_cross_entropy_bad_target_is_nan_not_a_crash():
    x = torch.randn(4, 10, device="cuda")
    assert torch.isnan(ko.cross_entropy(x, torch.tensor([0, 1, 12, 2], device="cuda")))
    assert torch.isfinite(ko.cross_entropy(x, torch.tensor([0, 1, 9, 2], device="cuda")))


@pytest.mark.gpu
@gpu
def test_gpu_linear_cross_entropy_peak_memory_half_of_eager():
    """The loss head of a GPT-2-sized model (vocab 50257): forward + backward peak
    memory above the inputs, Kitsune's chunked op against F.linear + F.cross_entropy."""
    g = torch.Generator().manual_seed(6)
    rows, hidden, vocab = 8192, 768, 50257
    x = _t((rows, hidden), torch.bfloat16, "cuda", g).requires_grad_()
    w = _t((vocab, hidden), torch.bfloat16, "cuda", g, scale=0.02).requires_grad_()
    t = _targets(rows, vocab, "cuda", g)

    def peak(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, loss.detach().float(), x.grad.clone(), w.grad.clone()

    pe, le, gxe, gwe = peak(lambda: F.cross_entropy(F.linear(x, w), t))
    pk, lk, gxk, gwk = peak(lambda: ko.linear_cross_entropy(x, w, t))
    assert pk <= 0.5 * pe, f"peak {pk / 2**20:.0f} MiB vs eager {pe / 2**20:.0f} MiB"
    torch.testing.assert_close(lk, le, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gxk.float(), gxe.float(), rtol=5e-2, atol=1e-4)
    torch.testing.assert_close(gwk.float(), gwe.float(), rtol=5e-2, atol=1e-4)


# ---- dropout ops: gelu_dropout, bias_dropout_add ----------------------------------
# The mask comes from (seed, offset) drawn from torch's generator, returned as `rng`;
# kitsune.ops.dropout_mask(rng, n, p, dtype) rebuilds it on the CPU with the same Philox code
# the CUDA kernel runs, so references use exactly the kernel's mask.
def _dropout_ref(name, args, rng, p, dtype64=torch.float64):
    x = args[0]
    m = ko.dropout_mask(rng, x.numel(), p, x.dtype).view(x.shape).to(x.device, dtype64) / (1 - p)
    if name == "gelu_dropout":
        return F.gelu(args[0].to(dtype64)) * m
    x, b, r = (a.to(dtype64) for a in args)
    return r + (x + b) * m


def _dropout_args(name, shape, dtype, device, gen, unaligned_bias=False):
    x = _t(shape, dtype, device, gen)
    if name == "gelu_dropout":
        return [x]
    b = _t((shape[-1] + unaligned_bias,), dtype, device, gen)[int(unaligned_bias):]   # storage offset 1: no 16-byte vectors
    return [x, b, _t(shape, dtype, device, gen)]


def _dropout_call(name, args, p, training=True):
    op = getattr(torch.ops.kitsune, name)
    return op(*args, p, training)


@pytest.mark.parametrize("name", ["gelu_dropout", "bias_dropout_add"])
def test_dropout_cpu_mask_scale_seed_and_gradients(name):
    g = torch.Generator().manual_seed(8)
    args = [a.requires_grad_() for a in _dropout_args(name, (64, 33), torch.float64, "cpu", g)]
    p = 0.3
    torch.manual_seed(123)
    out, rng = _dropout_call(name, args, p)
    torch.testing.assert_close(out, _dropout_ref(name, args, rng, p))
    torch.manual_seed(123)   # same seed, same mask
    torch.testing.assert_close(_dropout_call(name, args, p)[0], out)
    assert not torch.equal(_dropout_call(name, args, p)[0], out)   # the generator moved on
    # gradients: autograd through the op against autograd through the reference with its mask
    gout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    torch.manual_seed(5)
    out, rng = _dropout_call(name, args, p)
    got = torch.autograd.grad(out, args, gout)
    want = torch.autograd.grad(_dropout_ref(name, args, rng, p), args, gout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_dropout_edge_probabilities_and_eval():
    x = torch.randn(3, 50, dtype=torch.float64)
    b, r = torch.randn(50, dtype=torch.float64), torch.randn(3, 50, dtype=torch.float64)
    torch.testing.assert_close(ko.gelu_dropout(x, 0.0), F.gelu(x))
    torch.testing.assert_close(ko.gelu_dropout(x, 0.7, training=False), F.gelu(x))
    assert torch.count_nonzero(ko.gelu_dropout(x, 1.0)) == 0
    torch.testing.assert_close(ko.bias_dropout_add(x, b, r, 1.0), r)
    torch.testing.assert_close(ko.bias_dropout_add(x, b, r, 0.5, training=False), r + x + b)
    # the kept fraction is 1 - p within 5 standard deviations
    n, p = 1 << 18, 0.25
    _, rng = torch.ops.kitsune.gelu_dropout(torch.zeros(n), p, True)
    kept = ko.dropout_mask(rng, n, p).sum().item()
    assert abs(kept - n * (1 - p)) < 5 * (n * p * (1 - p)) ** 0.5, kept
    with pytest.raises(RuntimeError, match=r"dropout probability p must be in \[0, 1\], got 1.5"):
        ko.gelu_dropout(x, 1.5)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        ko.bias_dropout_add(x, b, r[0], 0.1)
    with pytest.raises(RuntimeError, match="rng must be the int64 CPU tensor"):
        torch.ops.kitsune.dropout_backward(x, torch.zeros(3), 0.1)


def test_dropout_16_bit_mask_on_cpu():
    """A bf16 tensor's mask uses 16 random bits an element (kitsune/philox.h): the CPU
    op's zeros are exactly dropout_mask(..., bf16)'s drops, which differ from the
    32-bit mask of the same rng, and the kept fraction is 1 - p."""
    n, p = 1 << 16, 0.25
    x = torch.rand(n, dtype=torch.bfloat16) + 1   # gelu(x) > 0: a zero is a drop
    out, rng = torch.ops.kitsune.gelu_dropout(x, p, True)
    keep = ko.dropout_mask(rng, n, p, torch.bfloat16)
    assert torch.equal(out != 0, keep)
    assert not torch.equal(keep, ko.dropout_mask(rng, n, p))
    assert abs(keep.sum().item() - n * (1 - p)) < 5 * (n * p * (1 - p)) ** 0.5
    with pytest.raises(RuntimeError, match="dtype must be the dropped tensor's floating dtype"):
        torch.ops.kitsune.dropout_mask(rng, n, p, torch.int16)


def test_dropout_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out, rng = torch.ops.kitsune.gelu_dropout(torch.empty(4, 8, dtype=torch.bfloat16), 0.1, True)
        assert out.shape == (4, 8) and out.dtype == torch.bfloat16 and rng.shape == (2,)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["gelu_dropout", "bias_dropout_add"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_dropout_uses_the_cpu_mask_and_matches_fp64(name, dtype):
    """The CUDA kernel's mask is exactly the one the CPU rebuilds from rng; values and
    gradients within 2x torch's own error of an fp64 reference with that mask."""
    g = torch.Generator().manual_seed(9)
    for shape in [(1,), (3,), (1023,), (4, 1000), (3, 1000), (257, 4097), ((1 << 20) + 3,)]:
        if name == "bias_dropout_add" and len(shape) == 1:
            shape = (1,) + shape
        args = _dropout_args(name, shape, dtype, "cuda", g, unaligned_bias=shape == (3, 1000))
        _poison(sum(a.numel() for a in args), "cuda")
        for p in (0.1, 0.5):
            out, rng = _dropout_call(name, args, p)
            want = _dropout_ref(name, args, rng, p)
            m = ko.dropout_mask(rng, args[0].numel(), p, dtype).view(args[0].shape).cuda()
            torch_ref = _dropout_ref(name, args, rng, p, dtype64=dtype)   # torch ops in the storage dtype
            assert not torch.isnan(out).any(), f"{name} {dtype} {shape}: unwritten outputs"
            if name == "gelu_dropout":
                assert torch.equal(out[~m], torch.zeros_like(out[~m])), f"{name} {dtype} {shape}: mask differs"
            _check_close(out, want, torch_ref, dtype, f"{name} {dtype} {shape} p={p}")
        ts = [a.clone().requires_grad_() for a in args]
        torch.manual_seed(10)
        out, rng = _dropout_call(name, ts, 0.2)
        go = torch.randn(out.shape, generator=g, dtype=torch.float64).to("cuda", dtype)
        got = torch.autograd.grad(out, ts, go)
        t64 = [a.detach().double().requires_grad_() for a in ts]
        want = torch.autograd.grad(_dropout_ref(name, t64, rng, 0.2), t64, go.double())
        tt = [a.detach().clone().requires_grad_() for a in ts]
        theirs = torch.autograd.grad(_dropout_ref(name, tt, rng, 0.2, dtype64=dtype), tt, go)
        for k, (a, w, th) in enumerate(zip(got, want, theirs)):
            _check_close(a, w, th, dtype, f"{name} {dtype} {shape} grad{k}", max(1.0, w.abs().max().item()))


# ---- batch_norm_relu ----------------------------------------------------------------
def _bn_ref(x, w, b, rm, rv, training, momentum=0.1, eps=1e-5, r=None):
    y = F.batch_norm(x, rm, rv, w, b, training, momentum, eps)
    return torch.relu(y if r is None else y + r)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_relu_cpu_matches_and_gradcheck(training):
    g = torch.Generator().manual_seed(11)
    for shape in [(5, 3), (4, 3, 7), (2, 3, 5, 6)]:
        x = _t(shape, torch.float64, "cpu", g, shift=2.0)
        w, b = _t((3,), torch.float64, "cpu", g), _t((3,), torch.float64, "cpu", g)
        rm, rv = _t((3,), torch.float64, "cpu", g), _t((3,), torch.float64, "cpu", g).abs() + 0.5
        rm2, rv2 = rm.clone(), rv.clone()
        out = ko.batch_norm_relu(x, rm, rv, w, b, training, 0.2, 1e-4)
        torch.testing.assert_close(out, _bn_ref(x, w, b, rm2, rv2, training, 0.2, 1e-4))
        torch.testing.assert_close(rm, rm2), torch.testing.assert_close(rv, rv2)   # running stats updated alike
        ts = [t.clone().requires_grad_() for t in (x, w, b)]
        assert torch.autograd.gradcheck(lambda x, w, b: ko.batch_norm_relu(x, rm.clone(), rv.clone(), w, b, training),
                                        ts), (shape, training)
    # no affine parameters, no running stats (training only)
    x = _t((6, 4, 3), torch.float64, "cpu", g)
    torch.testing.assert_close(ko.batch_norm_relu(x, None, None, training=True), _bn_ref(x, None, None, None, None, True))


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_add_relu_cpu_matches_and_gradcheck(training):
    """relu(batch_norm(x) + r): the reference in fp64, running stats updated alike,
    gradcheck over x, r, weight and bias; a residual of another shape or dtype is
    refused by name; opcheck."""
    g = torch.Generator().manual_seed(14)
    for shape in [(5, 3), (2, 3, 5, 6)]:
        x, r = _t(shape, torch.float64, "cpu", g, shift=2.0), _t(shape, torch.float64, "cpu", g)
        w, b = _t((3,), torch.float64, "cpu", g), _t((3,), torch.float64, "cpu", g)
        rm, rv = _t((3,), torch.float64, "cpu", g), _t((3,), torch.float64, "cpu", g).abs() + 0.5
        rm2, rv2 = rm.clone(), rv.clone()
        out = ko.batch_norm_add_relu(x, r, rm, rv, w, b, training, 0.2, 1e-4)
        torch.testing.assert_close(out, _bn_ref(x, w, b, rm2, rv2, training, 0.2, 1e-4, r=r))
        torch.testing.assert_close(rm, rm2), torch.testing.assert_close(rv, rv2)
        ts = [t.clone().requires_grad_() for t in (x, r, w, b)]
        assert torch.autograd.gradcheck(
            lambda x, r, w, b: ko.batch_norm_add_relu(x, r, rm.clone(), rv.clone(), w, b, training), ts), shape
    with pytest.raises(RuntimeError, match=r"batch_norm_add_relu: residual must have x's shape"):
        ko.batch_norm_add_relu(torch.randn(4, 3), torch.randn(4, 4), None, None, training=True)
    with pytest.raises(RuntimeError, match=r"residual must have x's shape, dtype"):
        ko.batch_norm_add_relu(torch.randn(4, 3), torch.randn(4, 3, dtype=torch.float64), None, None, training=True)
    x = _t((4, 3, 5), torch.float32, "cpu", g).requires_grad_()
    torch.library.opcheck(torch.ops.kitsune.batch_norm_add_relu.default,
                          (x, torch.randn(4, 3, 5, requires_grad=True), None, None, torch.zeros(3), torch.ones(3), True,
                           0.1, 1e-5))


@pytest.mark.parametrize("name", ["batch_norm_relu", "batch_norm_add_relu", "gelu_dropout", "bias_dropout_add"])
def test_backward_fills_no_gradient_for_outputs_that_have_none(name):
    """Ops with non-differentiable outputs (batch_norm_relu's mean and invstd, the
    dropouts' rng) do not have autograd fill zero gradients for them: a fill launch
    each (18 a step of ResNet-18 on the H100 before, bench/results/archive/h100_copies_b594a9d.log).
    The backward creates no zero tensor, and its gradients are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode
    g = torch.Generator().manual_seed(13)
    x = _t((8, 6, 4, 4) if name.startswith("batch_norm") else (8, 6), torch.float32, "cpu", g).requires_grad_()
    ops = {"batch_norm_relu": lambda: ko.batch_norm_relu(x, torch.zeros(6), torch.ones(6), training=True),
           "batch_norm_add_relu": lambda: ko.batch_norm_add_relu(x, torch.ones(8, 6, 4, 4), torch.zeros(6),
                                                                 torch.ones(6), training=True),
           "gelu_dropout": lambda: ko.gelu_dropout(x, 0.25),
           "bias_dropout_add": lambda: ko.bias_dropout_add(x, torch.zeros(6), torch.ones(8, 6), 0.25)}

    class Zeros(TorchDispatchMode):
        made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zero_, torch.ops.aten.fill_,
                                       torch.ops.aten.zeros_like, torch.ops.aten.new_zeros):
                self.made.append(str(func))
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    out = ops[name]()
    go = torch.randn(out.shape, generator=g)
    with Zeros():
        (gx,) = torch.autograd.grad(out, x, go)
    assert Zeros.made == [], Zeros.made
    torch.manual_seed(0)
    torch.testing.assert_close(gx, torch.autograd.grad(ops[name](), x, go)[0], rtol=0, atol=0)


def test_batch_norm_relu_opcheck_and_errors():
    g = torch.Generator().manual_seed(12)
    x = _t((4, 3, 5), torch.float32, "cpu", g).requires_grad_()
    w, b = _t((3,), torch.float32, "cpu", g).requires_grad_(), _t((3,), torch.float32, "cpu", g).requires_grad_()
    torch.library.opcheck(torch.ops.kitsune.batch_norm_relu.default,
                          (x, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5))
    with pytest.raises(RuntimeError, match="more than 1 value per channel when training"):
        ko.batch_norm_relu(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(RuntimeError, match="eval mode needs running_mean and running_var"):
        ko.batch_norm_relu(torch.randn(4, 3), None, None, training=False)
    with pytest.raises(RuntimeError, match="weight must have C = 3 elements"):
        ko.batch_norm_relu(torch.randn(4, 3), torch.zeros(3), torch.ones(3), torch.ones(4))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("residual", [False, True], ids=["batch_norm_relu", "batch_norm_add_relu"])
def test_gpu_batch_norm_relu_matches_fp64(dtype, training, residual):
    """batch_norm_relu, and batch_norm_add_relu with a residual of x's layout (its
    gradient checked too), against fp64 and torch's own kernels in the dtype."""
    g = torch.Generator().manual_seed(13)
    # planes of 1 and of 2 vectors (flat apply), of >= 64 not a multiple of the vector, of 1024
    # (16-byte vectors), and 37 images in 21 stripes of 2 (the last ones empty)
    # channels-last batches (cl) run as rows of C: vectors of channels, and C = 5 scalar
    for shape, cl in [((7, 3), 0), ((64, 4, 4, 4), 0), ((4, 5, 1023), 0), ((16, 64, 14, 14), 0), ((2, 3, 1, 1), 0),
                      ((256, 32, 9, 9), 0), ((3, 8, 32, 32), 0), ((37, 8, 48, 48), 0), ((16, 64, 14, 14), 1),
                      ((8, 24, 7, 9), 1), ((4, 5, 3, 3), 1), ((300, 40), 0)]:
        c = shape[1]
        x = _t(shape, dtype, "cuda", g, shift=1.5)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w, b = _t((c,), dtype, "cuda", g), _t((c,), dtype, "cuda", g)
        rm, rv = _t((c,), torch.float32, "cuda", g), _t((c,), torch.float32, "cuda", g).abs() + 0.5
        r64 = (rm.double(), rv.double())
        # torch's own kernel, one dtype throughout; copies (for fp32, .to() would alias rm)
        rt = (rm.to(dtype, copy=True), rv.to(dtype, copy=True))
        res = _t(shape, dtype, "cuda", g).contiguous(memory_format=torch.channels_last if cl else
                                                      torch.contiguous_format) if residual else None

        def op(x, rm, rv, w, b, r):
            return ko.batch_norm_add_relu(x, r, rm, rv, w, b, training) if residual else \
                ko.batch_norm_relu(x, rm, rv, w, b, training)
        _poison(x.numel(), "cuda")
        out = op(x, rm, rv, w, b, res)
        want = _bn_ref(x.double(), w.double(), b.double(), *r64, training, r=res.double() if residual else None)
        theirs = _bn_ref(x, w, b, *rt, training, r=res)
        # the bound scales with the outputs' magnitude, as the gradients' below: with the residual
        # they reach about 5, and an fp32 error of 3.3e-6 at (4, 5, 3, 3) channels-last exceeded
        # the unscaled 2 x torch's + 1e-6 (H100, bench/results/archive/h100_pytest_14f1993.log)
        _check_close(out, want, theirs, dtype, f"{dtype} {shape} cl={cl} training={training}",
                     max(1.0, want.abs().max().item()))
        assert out.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
        if training:
            torch.testing.assert_close(rm.double(), r64[0], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(rv.double(), r64[1], rtol=1e-3, atol=1e-3)
        ts = [t.clone().requires_grad_() for t in (x, w, b) + ((res,) if residual else ())]
        go = torch.randn(shape, generator=g, dtype=torch.float64).to("cuda", dtype)
        got = torch.autograd.grad(op(ts[0], rm.clone(), rv.clone(), ts[1], ts[2], ts[3] if residual else None), ts, go)
        t64 = [t.detach().double().requires_grad_() for t in ts]
        # the reference takes our output's ReLU mask: where a 16-bit output rounds to 0 the masks
        # differ (seen once, fp16 (8, 24, 7, 9), in both layouts alike); the forward check covers the mask
        mask = (out > 0).double()
        y64 = F.batch_norm(t64[0], rm.double(), rv.double(), t64[1], t64[2], training)
        want = torch.autograd.grad(((y64 + t64[3]) if residual else y64) * mask, t64, go.double())
        tt = [t.detach().clone().requires_grad_() for t in ts]
        theirs = torch.autograd.grad(_bn_ref(*tt[:3], rm.to(dtype), rv.to(dtype), training,
                                             r=tt[3] if residual else None), tt, go)
        for k, (a, w_, th) in enumerate(zip(got, want, theirs)):
            _check_close(a, w_, th, dtype, f"{dtype} {shape} training={training} grad{k}",
                         max(1.0, w_.abs().max().item()))


@pytest.mark.gpu
@gpu
def test_gpu_binary_ops_keep_a_shared_channels_last_layout():
    """Operands of one dense layout (channels-last activations) run as they lie and the
    output keeps the layout; mixed layouts are made contiguous. Values as the reference."""
    g = torch.Generator().manual_seed(21)
    a, b = (torch.randn(4, 16, 5, 7, generator=g).cuda().contiguous(memory_format=torch.channels_last)
            for _ in range(2))
    for op, ref in ((ko.add_relu, lambda a, b: torch.relu(a + b)), (ko.mul_tanh, lambda a, b: torch.tanh(a * b)),
                    (ko.swiglu, lambda a, b: F.silu(a) * b)):
        out = op(a, b)
        assert out.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(out, ref(a, b))
        torch.testing.assert_close(op(a, b.contiguous()), ref(a, b))
        ta, tb = a.clone().requires_grad_(), b.clone().requires_grad_()
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        go = torch.randn(a.shape, generator=g).cuda().contiguous(memory_format=torch.channels_last)
        got = torch.autograd.grad(op(ta, tb), (ta, tb), go)
        want = torch.autograd.grad(ref(ra, rb), (ra, rb), go)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
