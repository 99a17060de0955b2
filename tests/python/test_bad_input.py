"""Bad input never gives a wrong answer: every torch.ops.kitsune op (but the stream_* ops
and pinned_empty) x {wrong dtype, mixed device, wrong shape, non-contiguous, empty,
0-dim}, enumerated from one table below (op -> argument builder -> the ATen composition
the op stands for).

A case passes when the op either
  raises a RuntimeError, ValueError or TypeError whose message names it ("kitsune.<op>:"),
  or returns what the ATen reference returns on the same input: the same shapes and
  dtypes, and values equal in float64 (the reference runs on float64 copies; fp32
  rounding allowed), an in-place op's updated tensors included.
A wrong dtype (int64, int32, bool or complex64 where a floating tensor goes) and a mixed
device (one tensor on meta beside CPU ones, which dispatches to the fake kernel) must
raise; so must any input the ATen reference itself refuses. float64 may run (the CPU
references take it) or be refused by name. Every case without a meta tensor runs again
under FakeTensorMode, as torch.compile traces, on fake tensors of the same device and on
fake CUDA ones (no GPU needed): the fake kernel must raise where the real kernel raised,
and otherwise promise its shapes, dtypes, devices and strides (the significant ones: dims
longer than 1); a fake CUDA kernel may refuse by name only what a CUDA kernel would
(float64 where a Kitsune kernel reads it).

Derived from each op's valid arguments: the wrong dtypes (each tensor in turn, and every
floating one at once), the mixed devices (each tensor in turn on meta), the
non-contiguous layouts (each floating tensor in turn, and all at once, as a strided view
with gaps and, from 2-D, as a dense transposed one). Written per op: the wrong shapes,
the empty inputs and the 0-dim ones. The CPU run takes about ten seconds; on a GPU
(marked gpu) the same cases run on CUDA tensors against the CUDA kernels."""
import math
from dataclasses import dataclass, field
from typing import Callable

import pytest

from support import gpu

torch = pytest.importorskip("torch")
ko = pytest.importorskip("kitsune.ops")

from torch.utils import _pytree as pytree  # noqa: E402

F = torch.nn.functional
K = torch.ops.kitsune
GEN = torch.Generator().manual_seed(0)
BAD_DTYPES = (torch.int64, torch.int32, torch.bool, torch.complex64)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
EXCEPTIONS = (RuntimeError, ValueError, TypeError)
RTOL, ATOL = 1e-4, 2e-5   # fp32 results against the float64 reference


def r(*shape, scale=1.0):
    return torch.randn(shape, generator=GEN) * scale


def pos(*shape):
    return torch.rand(shape, generator=GEN) + 0.5


def tgt(n, classes, ignore=True):
    t = torch.randint(0, classes, (n,), generator=GEN)
    if ignore and n > 2:
        t[1] = -100
    return t


def RNG():
    return torch.tensor([0x2545F4914F6CDD1D, 4], dtype=torch.long)   # (seed, offset), as the dropout ops return


@dataclass
class Op:
    """make() -> the op's valid arguments (float32); ref(*args) -> what the op returns
    (and the tensors it updates in place, listed in mutates: argument positions) as
    ATen computes it; ref(out, *args) where with_out (the dropout ops: their mask comes
    from the rng the op returned). shapes / empty / zero_dim: builders of arguments with
    wrong shapes, no elements and 0-dim tensors. host: argument positions that stay on
    the CPU in the meta run (rng: the CPU tensor the dropout ops take on every device).
    answers: a predicate (optim_fusable), which answers for bad dtypes and devices
    instead of raising. fixed: argument positions whose dtype is the op's contract
    (found_inf: float32), left out of the every-floating-tensor conversions."""
    make: Callable
    ref: Callable
    shapes: list = field(default_factory=list)
    empty: list = field(default_factory=list)
    zero_dim: list = field(default_factory=list)
    mutates: tuple = ()
    host: tuple = ()
    with_out: bool = False
    answers: bool = False
    fixed: tuple = ()
    takes_bool: bool = False   # bool tensors are valid operands (pointwise_chain: 0 and 1)
    float64: bool = True       # False: float64 is refused on every device (pointwise_chain computes in fp32)


# ---- references: ATen compositions -----------------------------------------------------
def _vjp(f, inputs, grad):
    """The gradients of f(*inputs) against grad, with autograd; None inputs stay None."""
    xs = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    y = f(*xs)
    live = [x for x in xs if x is not None]
    gs = iter(torch.autograd.grad(y, live, grad.expand(y.shape), allow_unused=True))
    return [None if x is None else (lambda g, x: g if g is not None else torch.zeros_like(x))(next(gs), x)
            for x in xs]


def _broadcast(*ts):
    shape = torch.broadcast_shapes(*(t.shape for t in ts))
    return [t.expand(shape) for t in ts]


def _binary_backward(f):
    def ref(grad, a, b):
        grad, a, b = _broadcast(grad, a, b)
        return tuple(_vjp(f, [a, b], grad))
    return ref


def _or_empty(g, like):
    return g if g is not None else like.new_empty((0,))


def _per_channel(b, y):
    return b.view([1, -1] + [1] * (y.dim() - 2))


def _mask(rng, like, p, training=True):
    if not training or p == 0:
        return torch.ones_like(like)
    return ko.dropout_mask(rng, like.numel(), p, like.dtype).view(like.shape).to(like.dtype) / (1 - p)


def _ln_backward(grad, grad_sum, h, shape, w, b, eps, relu):
    def f(h, w, b):
        y = F.layer_norm(h, shape, w, b, eps)
        return F.relu(y) if relu else y
    gh, gw, gb = _vjp(f, [h, w, b], grad)
    if grad_sum is not None:
        gh = gh + grad_sum.expand(h.shape)
    return gh, _or_empty(gw, h), _or_empty(gb, h)


def _lce(x, w, target, bias, ignore, smoothing):
    return F.cross_entropy(F.linear(x, w, bias).reshape(-1, w.shape[0]), target.reshape(-1), ignore_index=ignore,
                           label_smoothing=smoothing)


def _adam(params, grads, ms, vs, lr, b1, b2, eps, wd, decoupled, steps):
    ps, ms2, vs2 = [], [], []
    for p, g, m, v, step in zip(params, grads, ms, vs, steps):
        if wd:
            p, g = (p * (1 - lr * wd), g) if decoupled else (p, g + wd * p)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** step) * m / (v.sqrt() / math.sqrt(1 - b2 ** step) + eps)
        ps.append(p), ms2.append(m), vs2.append(v)
    return ps, ms2, vs2


def _sgd(params, grads, bufs, lr, momentum, dampening, wd, nesterov, first):
    ps, bs = [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        if wd:
            g = g + wd * p
        if momentum:
            b = g if first else momentum * bufs[i] + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
            bs.append(b)
        ps.append(p - lr * g)
    return ps, bs


def _dense(t):
    return torch._prims_common.is_non_overlapping_and_dense_or_false(t)


def _fusable(params, grads):
    if len(params) != len(grads):
        raise RuntimeError("the reference refuses lists of two lengths")
    def laid_out(g, p):   # torch.optim takes a gradient of its parameter's shape only
        return g.shape == p.shape and ((g.is_contiguous() and p.is_contiguous()) or
                                       (g.stride() == p.stride() and _dense(p)))
    def dtype_ok(p):   # the step's dtypes: the kernels' on CUDA, float64 too on the CPU
        return p.dtype in (FLOATS[:3] if p.device.type == "cuda" else FLOATS)
    return all(_dense(p) and laid_out(g, p) and dtype_ok(p) and g.dtype == p.dtype and g.device == p.device
               for p, g in zip(params, grads))


def _bn(x, residual, w, b, rm, rv, training, momentum, eps):
    rm2 = rm.clone() if rm is not None else None
    rv2 = rv.clone() if rv is not None else None
    y = F.batch_norm(x, rm2, rv2, w, b, training, momentum, eps)
    out = F.relu(y + residual if residual is not None else y)
    dims = [0] + list(range(2, x.dim()))
    if training:
        mean, invstd = x.mean(dims), torch.rsqrt(x.var(dims, unbiased=False) + eps)
    else:
        mean, invstd = rm.to(x.dtype), torch.rsqrt(rv.to(x.dtype) + eps)
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (out, mean.to(st), invstd.to(st)) + tuple(t for t in (rm2, rv2) if t is not None)


def _bn_backward(grad, x, out, w, mean, invstd, training, residual):
    gp = grad * (out > 0)
    dims = [0] + list(range(2, x.dim()))
    if training:
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(gp, x, w, None, None, mean, invstd, True, 1e-5,
                                                               [True, w is not None, True])
    else:
        bc = [1, -1] + [1] * (x.dim() - 2)
        scale = invstd.view(bc) * (w.view(bc) if w is not None else 1)
        gx = gp * scale
        gw = (gp * (x - mean.view(bc)) * invstd.view(bc)).sum(dims) if w is not None else None
        gb = gp.sum(dims)
    return (gx,) + ((gp,) if residual else ()) + (_or_empty(gw, x), gb)


def _pool_where(x, k, s, p, ceil):
    """max_pool2d_where's reference: the output and each window's winner as its place in
    the window (row * kw + column, counted from the window's corner in the padding)."""
    s = s or k
    out, idx = F.max_pool2d(x, k, s, p, ceil_mode=ceil, return_indices=True)
    oh, ow = out.shape[-2:]
    h0 = (torch.arange(oh) * s[0] - p[0]).view(oh, 1)
    w0 = (torch.arange(ow) * s[1] - p[1]).view(1, ow)
    ih, iw = idx // x.shape[-1], idx % x.shape[-1]
    return out, ((ih - h0) * k[1] + (iw - w0)).to(torch.uint8)


def _pool_backward_add(grad, where, adds, size, k, s, p, ceil):
    s = s or k
    n, c, oh, ow = where.shape
    wl = where.long()
    rows = (torch.arange(oh) * s[0] - p[0]).view(oh, 1) + wl // k[1]
    cols = (torch.arange(ow) * s[1] - p[1]).view(1, ow) + wl % k[1]
    ref = grad if grad is not None else adds[0]
    gx = torch.zeros(n, c, size[2] * size[3], dtype=ref.dtype)
    if grad is not None:
        gx.scatter_add_(2, (rows * size[3] + cols).reshape(n, c, oh * ow), grad.reshape(n, c, oh * ow))
    gx = gx.view(size)
    for a in adds:
        gx = gx + a
    return gx


def _backward_args(x, w, b, residual=None, training=True):
    """The BatchNorm backward ops' arguments, formed by ATen: (grad, x, out, w, mean, invstd, training)."""
    dims = [0] + list(range(2, x.dim()))
    mean, invstd = x.mean(dims), torch.rsqrt(x.var(dims, unbiased=False) + 1e-5)
    y = F.batch_norm(x, None, None, w, b, True)
    return (r(*x.shape), x, F.relu(y + residual if residual is not None else y), w, mean, invstd, training)


def _max_pool_args(x, k=(3, 3), s=(2, 2), p=(1, 1), ceil=False):
    out, where = _pool_where(x, list(k), list(s), list(p), ceil)
    return (r(*out.shape), where, [r(*x.shape), r(*x.shape)], list(x.shape), list(k), list(s), list(p), ceil)


def _lists(shapes, scale=1.0, positive=False):
    return [pos(*s) * scale if positive else r(*s, scale=scale) for s in shapes]


def _adam_args(shapes=((4, 3), (5,))):
    return (_lists(shapes), _lists(shapes), _lists(shapes, 0.1), _lists(shapes, 0.01, positive=True))


# ---- the table ------------------------------------------------------------------------
ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
LN = (1e-5,)

# (program, consts, out_regs, out_dtypes) of silu(r0 + r1) * 0.5 stored as bfloat16
_CHAIN_ARGS = ([1, 2, 0, 1, 0, 19, 3, 2, 0, 0, 0, 4, 0, 0, 0, 3, 5, 3, 4, 0], [0.5], [5], [torch.bfloat16])

OPS = {
    "add_relu": Op(lambda: (r(4, 8), r(4, 8)), lambda a, b: F.relu(a + b),
                   shapes=[lambda: (r(4, 8), r(5, 8)), lambda: (r(4, 8), r(3))],
                   empty=[lambda: (r(0, 8), r(0, 8)), lambda: (r(0, 8), r(8))],
                   zero_dim=[lambda: (r(), r()), lambda: (r(4, 8), r())]),
    "add_relu_backward": Op(lambda: (r(4, 8), r(4, 8)),
                            lambda g, o: torch.where(o > 0, g, torch.zeros((), dtype=g.dtype)),
                            shapes=[lambda: (r(4, 8), r(5, 8))], empty=[lambda: (r(0, 8), r(0, 8))],
                            zero_dim=[lambda: (r(), r())]),
    "mul_tanh": Op(lambda: (r(4, 8), r(1, 8)), lambda a, b: torch.tanh(a * b),
                   shapes=[lambda: (r(4, 8), r(4, 7))], empty=[lambda: (r(0, 8), r(8))],
                   zero_dim=[lambda: (r(), r(3))]),
    "mul_tanh_backward": Op(lambda: (r(4, 8), r(4, 8), r(8)), _binary_backward(lambda a, b: torch.tanh(a * b)),
                            shapes=[lambda: (r(4, 8), r(4, 8), r(7))], empty=[lambda: (r(0, 8), r(0, 8), r(8))],
                            zero_dim=[lambda: (r(), r(), r())]),
    "swiglu": Op(lambda: (r(4, 8), r(4, 8)), lambda g, u: F.silu(g) * u,
                 shapes=[lambda: (r(4, 8), r(8, 4))], empty=[lambda: (r(4, 0), r(4, 0))],
                 zero_dim=[lambda: (r(), r())]),
    "swiglu_backward": Op(lambda: (r(4, 8), r(4, 8), r(4, 8)), _binary_backward(lambda g, u: F.silu(g) * u),
                          shapes=[lambda: (r(3, 8), r(4, 8), r(4, 8))], empty=[lambda: (r(0, 8), r(0, 8), r(0, 8))],
                          zero_dim=[lambda: (r(), r(), r())]),
    # silu(a + b) * 0.5 in fp32, as bfloat16: bool inputs are valid (0 / 1), integers are not
    "pointwise_chain": Op(lambda: ([r(4, 8), r(8)], *_CHAIN_ARGS),
                          lambda xs, *a: [(F.silu(xs[0].float() + xs[1].float()) * 0.5).to(torch.bfloat16)],
                          shapes=[lambda: ([r(4, 8), r(7)], *_CHAIN_ARGS)],
                          empty=[lambda: ([r(0, 8), r(8)], *_CHAIN_ARGS)],
                          zero_dim=[lambda: ([r(), r(3)], *_CHAIN_ARGS)], takes_bool=True, float64=False),
    "bias_gelu": Op(lambda: (r(4, 8), r(8), "tanh"), lambda x, b, a: F.gelu(x + b, approximate=a),
                    shapes=[lambda: (r(4, 8), r(7), "none"), lambda: (r(4, 8), r(4, 8), "none")],
                    empty=[lambda: (r(0, 8), r(8), "none"), lambda: (r(4, 0), r(0), "none")],
                    zero_dim=[lambda: (r(), r(1), "none"), lambda: (r(4, 8), r(), "none")]),
    "bias_gelu_backward": Op(lambda: (r(4, 8), r(4, 8), r(8), "none"),
                             lambda g, x, b, a: tuple(_vjp(lambda x, b: F.gelu(x + b, approximate=a), [x, b], g)),
                             shapes=[lambda: (r(4, 8), r(4, 8), r(7), "none"), lambda: (r(5, 8), r(4, 8), r(8), "none")],
                             empty=[lambda: (r(0, 8), r(0, 8), r(8), "none")],
                             zero_dim=[lambda: (r(), r(), r(), "none"), lambda: (r(), r(4, 8), r(8), "none")]),
    "channel_bias": Op(lambda: (r(2, 3, 4, 5), r(3), "relu"), lambda y, b, a: ACT[a](y + _per_channel(b, y)),
                       shapes=[lambda: (r(2, 3, 4, 5), r(4), "relu"), lambda: (r(3), r(3), "none")],
                       empty=[lambda: (r(0, 3, 4, 5), r(3), "relu"), lambda: (r(2, 0, 4), r(0), "none")],
                       zero_dim=[lambda: (r(), r(), "none")]),
    "rms_norm": Op(lambda: (r(4, 8), r(8), 1e-6), lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
                   shapes=[lambda: (r(4, 8), r(7), 1e-6), lambda: (r(4, 8), r(4, 8), 1e-6)],
                   empty=[lambda: (r(0, 8), r(8), 1e-6), lambda: (r(4, 0), r(0), 1e-6)],
                   zero_dim=[lambda: (r(), r(1), 1e-6)]),
    "rms_norm_backward": Op(lambda: (r(4, 8), r(4, 8), r(8), 1e-6),
                            lambda g, x, w, eps: tuple(_vjp(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps),
                                                            [x, w], g)),
                            shapes=[lambda: (r(4, 8), r(4, 8), r(7), 1e-6), lambda: (r(4, 9), r(4, 8), r(8), 1e-6)],
                            empty=[lambda: (r(0, 8), r(0, 8), r(8), 1e-6)],
                            zero_dim=[lambda: (r(), r(), r(1), 1e-6), lambda: (r(), r(4, 8), r(8), 1e-6)]),
    "layer_norm_relu": Op(lambda: (r(4, 8), [8], r(8), r(8), 1e-5),
                          lambda x, s, w, b, eps: F.relu(F.layer_norm(x, s, w, b, eps)),
                          shapes=[lambda: (r(4, 8), [7], None, None, 1e-5), lambda: (r(4, 8), [8], r(7), None, 1e-5),
                                  lambda: (r(4, 8), [4, 8], r(4, 8), None, 1e-5)],
                          empty=[lambda: (r(0, 8), [8], r(8), r(8), 1e-5), lambda: (r(4, 0), [0], None, None, 1e-5)],
                          zero_dim=[lambda: (r(), [1], None, None, 1e-5), lambda: (r(4, 8), [8], r(), None, 1e-5)]),
    "layer_norm_relu_backward": Op(lambda: (r(4, 8), r(4, 8), [8], r(8), None, 1e-5),
                                   lambda g, x, s, w, b, eps: _ln_backward(g, None, x, s, w, b, eps, True),
                                   shapes=[lambda: (r(4, 8), r(4, 8), [8], r(9), None, 1e-5),
                                           lambda: (r(3, 8), r(4, 8), [8], None, r(8), 1e-5)],
                                   empty=[lambda: (r(0, 8), r(0, 8), [8], r(8), r(8), 1e-5)],
                                   zero_dim=[lambda: (r(), r(), [1], None, None, 1e-5)]),
    "add_layer_norm": Op(lambda: (r(4, 8), r(4, 8), r(8), r(8), 1e-5),
                         lambda x, res, w, b, eps: (x + res, F.layer_norm(x + res, (x.shape[-1],), w, b, eps)),
                         shapes=[lambda: (r(4, 8), r(8), None, None, 1e-5), lambda: (r(4, 8), r(4, 8), r(4), None, 1e-5)],
                         empty=[lambda: (r(0, 8), r(0, 8), r(8), r(8), 1e-5)],
                         zero_dim=[lambda: (r(), r(), None, None, 1e-5)]),
    "add_layer_norm_backward": Op(lambda: (r(4, 8), r(4, 8), r(4, 8), r(8), r(8), 1e-5),
                                  lambda g, gs, h, w, b, eps: _ln_backward(g, gs, h, [h.shape[-1]], w, b, eps, False),
                                  shapes=[lambda: (r(4, 8), r(5, 8), r(4, 8), None, None, 1e-5),
                                          lambda: (r(4, 8), None, r(4, 8), r(4, 8), None, 1e-5)],
                                  empty=[lambda: (r(0, 8), None, r(0, 8), r(8), r(8), 1e-5)],
                                  zero_dim=[lambda: (r(), None, r(), None, None, 1e-5)]),
    "cross_entropy": Op(lambda: (r(5, 7), tgt(5, 7), -100, 0.1, False),
                        lambda x, t, i, s, fl: F.cross_entropy(x, t, ignore_index=i, label_smoothing=s),
                        shapes=[lambda: (r(5, 7), tgt(4, 7), -100, 0.0, False),
                                lambda: (r(2, 5, 7), tgt(2, 7).view(2, 1).expand(2, 5), -100, 0.0, False),
                                lambda: (r(7), torch.tensor(3), -100, 0.0, False)],   # (C,) logits: valid
                        empty=[lambda: (r(0, 7), tgt(0, 7), -100, 0.0, False), lambda: (r(5, 0), tgt(5, 1), -100, 0.0, False)],
                        zero_dim=[lambda: (r(), torch.tensor(0), -100, 0.0, False)]),
    "cross_entropy_backward": Op(lambda: (r(), r(5, 7), tgt(5, 7), -100, 0.1),
                                 lambda g, x, t, i, s: _vjp(lambda x: F.cross_entropy(x, t, ignore_index=i,
                                                                                     label_smoothing=s),
                                                            [x], g.reshape(()))[0],
                                 shapes=[lambda: (r(2), r(5, 7), tgt(5, 7), -100, 0.0),
                                         lambda: (r(), r(5, 7), tgt(6, 7), -100, 0.0)],
                                 empty=[lambda: (r(), r(0, 7), tgt(0, 7), -100, 0.0)],
                                 zero_dim=[lambda: (r(), r(), torch.tensor(0), -100, 0.0)]),
    "cross_entropy_with_grad": Op(lambda: (r(5, 7), tgt(5, 7), -100, 0.1, False),
                                  lambda x, t, i, s, fl: (F.cross_entropy(x, t, ignore_index=i, label_smoothing=s),
                                                          _vjp(lambda x: F.cross_entropy(x, t, ignore_index=i,
                                                                                         label_smoothing=s),
                                                               [x], torch.ones((), dtype=x.dtype))[0]),
                                  shapes=[lambda: (r(5, 7), tgt(3, 7), -100, 0.0, False)],
                                  empty=[lambda: (r(0, 7), tgt(0, 7), -100, 0.0, False)],
                                  zero_dim=[lambda: (r(), torch.tensor(0), -100, 0.0, False)]),
    "cross_entropy_rescale_": Op(lambda: (r(5, 7), torch.tensor(2.5)), lambda g, by: (g * by,), mutates=(0,),
                                 shapes=[lambda: (r(5, 7), r(2))], empty=[lambda: (r(0, 7), torch.tensor(2.5))],
                                 zero_dim=[lambda: (r(), torch.tensor(2.5))]),
    "linear_cross_entropy": Op(lambda: (r(6, 4), r(5, 4), tgt(6, 5), r(5), -100, 0.1, 0, False),
                               lambda x, w, t, b, i, s, c, fl: _lce(x, w, t, b, i, s),
                               shapes=[lambda: (r(6, 4), r(5, 3), tgt(6, 5), None, -100, 0.0, 0, False),
                                       lambda: (r(6, 4), r(5, 4), tgt(5, 5), None, -100, 0.0, 0, False),
                                       lambda: (r(6, 4), r(5, 4), tgt(6, 5), r(4), -100, 0.0, 0, False),
                                       lambda: (r(4), r(5, 4), torch.tensor(2), None, -100, 0.0, 0, False)],
                               empty=[lambda: (r(0, 4), r(5, 4), tgt(0, 5), None, -100, 0.0, 0, False)],
                               zero_dim=[lambda: (r(), r(5, 4), torch.tensor(2), None, -100, 0.0, 0, False)]),
    "linear_cross_entropy_grads": Op(lambda: (r(2, 3, 4), r(5, 4), tgt(6, 5).view(2, 3), r(5), -100, 0.0, 0, False),
                                     lambda x, w, t, b, i, s, c, fl: (
                                         _lce(x, w, t, b, i, s),
                                         *(lambda g: (g[0], g[1], _or_empty(g[2], x)))(
                                             _vjp(lambda x, w, b: _lce(x, w, t, b, i, s), [x, w, b],
                                                  torch.ones((), dtype=x.dtype)))),
                                     shapes=[lambda: (r(6, 4), r(5, 4, 1), tgt(6, 5), None, -100, 0.0, 0, False)],
                                     empty=[lambda: (r(0, 4), r(5, 4), tgt(0, 5), r(5), -100, 0.0, 0, False)],
                                     zero_dim=[lambda: (r(4), r(5, 4), torch.tensor(1), None, -100, 0.0, 0, False)]),
    "sum_squared": Op(lambda: (r(4, 8), [1], True),
                      lambda x, d, k: (x * x).sum(d if d else list(range(x.dim())), keepdim=k),
                      shapes=[lambda: (r(4, 8), [2], False), lambda: (r(4, 8), [-3], False)],
                      empty=[lambda: (r(0, 8), None, False), lambda: (r(4, 0), [1], False)],
                      zero_dim=[lambda: (r(), None, False), lambda: (r(), [0], True)]),
    "mean_abs": Op(lambda: (r(4, 8), None, False),
                   lambda x, d, k: x.abs().mean(d if d else list(range(x.dim())), keepdim=k),
                   shapes=[lambda: (r(4, 8), [5], False)],
                   empty=[lambda: (r(0, 8), None, False), lambda: (r(4, 0), [0], True)],
                   zero_dim=[lambda: (r(), None, False)]),
    "channel_sum": Op(lambda: (r(2, 3, 4, 5),), lambda g: g.sum([d for d in range(g.dim()) if d != 1]),
                      shapes=[lambda: (r(3),)], empty=[lambda: (r(0, 3, 4, 5),), lambda: (r(2, 0),)],
                      zero_dim=[lambda: (r(),)]),
    "attention_score": Op(lambda: (r(2, 3, 4), r(2, 5, 4), None),
                          lambda q, k, s: (q @ k.transpose(-2, -1)) * (s if s is not None else q.shape[-1] ** -0.5),
                          shapes=[lambda: (r(2, 3, 4), r(2, 5, 3), None), lambda: (r(3, 4), r(2, 5, 4), None)],
                          empty=[lambda: (r(0, 3, 4), r(0, 5, 4), None), lambda: (r(2, 0, 4), r(2, 5, 4), 0.5)],
                          zero_dim=[lambda: (r(), r(), None)]),
    "linear_act": Op(lambda: (r(3, 4), r(5, 4), r(5), "gelu"), lambda x, w, b, a: ACT[a](F.linear(x, w, b)),
                     shapes=[lambda: (r(3, 4), r(5, 3), r(5), "relu"), lambda: (r(3, 4), r(5, 4), r(4), "none")],
                     empty=[lambda: (r(0, 4), r(5, 4), r(5), "relu"), lambda: (r(3, 0), r(5, 0), r(5), "gelu_tanh")],
                     zero_dim=[lambda: (r(), r(5, 4), r(5), "relu")]),
    "gelu_dropout": Op(lambda: (r(4, 8), 0.3, True, "none"),
                       lambda out, x, p, tr, a: (F.gelu(x, approximate=a) * _mask(out[1], x, p, tr), out[1]),
                       with_out=True, empty=[lambda: (r(0, 8), 0.3, True, "none")],
                       zero_dim=[lambda: (r(), 0.3, True, "tanh")]),
    "gelu_dropout_backward": Op(lambda: (r(4, 8), r(4, 8), RNG(), 0.3, "none"),
                                lambda g, x, rng, p, a: _vjp(lambda x: F.gelu(x, approximate=a), [x],
                                                             g.expand(x.shape) * _mask(rng, x, p))[0],
                                host=(2,), shapes=[lambda: (r(4, 9), r(4, 8), RNG(), 0.3, "none"),
                                                   lambda: (r(4, 8), r(4, 8), torch.zeros(3, dtype=torch.long), 0.3, "none")],
                                empty=[lambda: (r(0, 8), r(0, 8), RNG(), 0.3, "none")],
                                zero_dim=[lambda: (r(), r(), RNG(), 0.3, "none")]),
    "bias_dropout_add": Op(lambda: (r(4, 8), r(8), r(4, 8), 0.3, True),
                           lambda out, x, b, res, p, tr: (res + (x + b) * _mask(out[1], x, p, tr), out[1]),
                           with_out=True, shapes=[lambda: (r(4, 8), r(7), r(4, 8), 0.3, True),
                                                  lambda: (r(4, 8), r(8), r(8), 0.3, True)],
                           empty=[lambda: (r(0, 8), r(8), r(0, 8), 0.3, True)],
                           zero_dim=[lambda: (r(), r(), r(), 0.3, True)]),
    "dropout_backward": Op(lambda: (r(4, 8), RNG(), 0.3), lambda g, rng, p: g * _mask(rng, g, p), host=(1,),
                           shapes=[lambda: (r(4, 8), torch.zeros(2, 2, dtype=torch.long), 0.3)],
                           empty=[lambda: (r(0, 8), RNG(), 0.3)], zero_dim=[lambda: (r(), RNG(), 0.3)]),
    # dropout_mask has no ATen composition: it is Philox's mask itself; the reference is the
    # mask of a contiguous copy of rng
    "dropout_mask": Op(lambda: (RNG(), 37, 0.3, torch.float32),
                       lambda rng, n, p, dt: K.dropout_mask(rng.clone(), n, p, dt), host=(0,),
                       shapes=[lambda: (torch.zeros(3, dtype=torch.long), 37, 0.3, torch.float32)],
                       empty=[lambda: (RNG(), 0, 0.3, torch.float32)],
                       zero_dim=[lambda: (torch.tensor(3), 37, 0.3, torch.float32)]),
    "adam_": Op(lambda: (*_adam_args(), 1e-2, 0.9, 0.99, 1e-8, 0.1, True, 3.0),
                lambda p, g, m, v, lr, b1, b2, eps, wd, dec, step: _adam(p, g, m, v, lr, b1, b2, eps, wd, dec,
                                                                          [step] * len(p)),
                mutates=(0, 2, 3),
                shapes=[lambda: ([r(4, 3)], [r(3, 4)], [r(4, 3)], [pos(4, 3)], 1e-2, 0.9, 0.99, 1e-8, 0.0, False, 1.0),
                        lambda: ([r(4, 3)], [r(4, 3), r(2)], [r(4, 3)], [pos(4, 3)], 1e-2, 0.9, 0.99, 1e-8, 0.0,
                                 False, 1.0)],
                empty=[lambda: ([r(0)], [r(0)], [r(0)], [r(0)], 1e-2, 0.9, 0.99, 1e-8, 0.1, False, 2.0),
                       lambda: ([], [], [], [], 1e-2, 0.9, 0.99, 1e-8, 0.1, False, 2.0)],
                zero_dim=[lambda: ([r()], [r()], [r()], [pos()], 1e-2, 0.9, 0.99, 1e-8, 0.1, False, 2.0)]),
    "adam_step_": Op(lambda: (*_adam_args(), [torch.tensor(2.0), torch.tensor(6.0)], 1e-2, 0.9, 0.99, 1e-8, 0.1,
                              False),
                     lambda p, g, m, v, st, lr, b1, b2, eps, wd, dec: (
                         *_adam(p, g, m, v, lr, b1, b2, eps, wd, dec, [float(s) + 1 for s in st]),
                         [s + 1 for s in st]),
                     mutates=(0, 2, 3, 4),
                     shapes=[lambda: ([r(4, 3)], [r(3, 4)], [r(4, 3)], [pos(4, 3)], [torch.tensor(1.0)], 1e-2, 0.9,
                                      0.99, 1e-8, 0.0, False),
                             lambda: ([r(4, 3)], [r(4, 3)], [r(4, 3)], [pos(4, 3)], [torch.ones(2)], 1e-2, 0.9, 0.99,
                                      1e-8, 0.0, False)],
                     empty=[lambda: ([r(0)], [r(0)], [r(0)], [r(0)], [torch.tensor(0.0)], 1e-2, 0.9, 0.99, 1e-8,
                                     0.0, False)],
                     zero_dim=[lambda: ([r()], [r()], [r()], [pos()], [torch.tensor(0.0)], 1e-2, 0.9, 0.99, 1e-8,
                                        0.0, False)]),
    "adam_capturable_": Op(lambda: (*_adam_args(), torch.tensor([1e-2, 2.0], dtype=torch.float64), 0.9, 0.99, 1e-8,
                                    0.1, True, True, torch.zeros(1)),
                           lambda p, g, m, v, h, b1, b2, eps, wd, dec, count, fi: (
                               *_adam(p, g, m, v, float(h[0]), b1, b2, eps, wd, dec,
                                      [float(h[1]) + count] * len(p)),
                               h + torch.tensor([0.0, float(count)], dtype=h.dtype)),
                           mutates=(0, 2, 3, 4), fixed=(11,),
                           shapes=[lambda: ([r(4, 3)], [r(4, 3)], [r(4, 3)], [pos(4, 3)],
                                            torch.tensor([1e-2], dtype=torch.float64), 0.9, 0.99, 1e-8, 0.0, False,
                                            True, None),
                                   lambda: ([r(4, 3)], [r(4, 3)], [r(4, 3)], [pos(4, 3)],
                                            torch.tensor([1e-2, 0.0], dtype=torch.float64), 0.9, 0.99, 1e-8, 0.0,
                                            False, True, torch.zeros(2))],
                           empty=[lambda: ([r(0)], [r(0)], [r(0)], [r(0)], torch.tensor([1e-2, 0.0], dtype=torch.float64),
                                           0.9, 0.99, 1e-8, 0.0, False, True, None)],
                           zero_dim=[lambda: ([r()], [r()], [r()], [pos()], torch.tensor([1e-2, 0.0], dtype=torch.float64),
                                              0.9, 0.99, 1e-8, 0.0, False, True, torch.tensor(0.0))]),
    "sgd_": Op(lambda: (_lists([(4, 3), (5,)]), _lists([(4, 3), (5,)]), _lists([(4, 3), (5,)]), 0.1, 0.9, 0.1, 1e-2,
                        False, False),
               lambda p, g, b, lr, mo, da, wd, ne, fi: _sgd(p, g, b, lr, mo, da, wd, ne, fi), mutates=(0, 2),
               shapes=[lambda: ([r(4, 3)], [r(4, 3)], [r(5)], 0.1, 0.9, 0.0, 0.0, False, False)],
               empty=[lambda: ([r(0, 3)], [r(0, 3)], [r(0, 3)], 0.1, 0.9, 0.0, 0.0, True, True)],
               zero_dim=[lambda: ([r()], [r()], [r()], 0.1, 0.9, 0.0, 0.0, False, False)]),
    "sgd_capturable_": Op(lambda: (_lists([(4, 3), (5,)]), _lists([(4, 3), (5,)]), _lists([(4, 3), (5,)]),
                                   torch.tensor([0.1], dtype=torch.float64), 0.9, 0.1, 1e-2, False, torch.zeros(1)),
                          lambda p, g, b, h, mo, da, wd, ne, fi: _sgd(p, g, b, float(h[0]), mo, da, wd, ne, False),
                          mutates=(0, 2), fixed=(8,),
                          shapes=[lambda: ([r(4, 3)], [r(4, 3)], [r(4, 3)], torch.tensor([0.1, 0.2], dtype=torch.float64),
                                           0.9, 0.0, 0.0, False, None)],
                          empty=[lambda: ([r(0)], [r(0)], [r(0)], torch.tensor([0.1], dtype=torch.float64), 0.9, 0.0,
                                          0.0, False, None)],
                          zero_dim=[lambda: ([r()], [r()], [r()], torch.tensor([0.1], dtype=torch.float64), 0.9, 0.0,
                                             0.0, False, None)]),
    "optim_fusable": Op(lambda: (_lists([(4, 3), (5,)]), _lists([(4, 3), (5,)])), _fusable, answers=True,
                        shapes=[lambda: ([r(4, 3)], [r(3, 4)]), lambda: ([r(4, 3)], [r(4, 3), r(2)])],
                        empty=[lambda: ([r(0)], [r(0)]), lambda: ([], [])], zero_dim=[lambda: ([r()], [r()])]),
    "batch_norm_relu": Op(lambda: (r(4, 3, 2, 2), r(3), r(3), r(3, scale=0.1), pos(3), True, 0.1, 1e-5),
                          lambda x, w, b, rm, rv, tr, mo, eps: _bn(x, None, w, b, rm, rv, tr, mo, eps),
                          mutates=(3, 4),
                          shapes=[lambda: (r(4, 3, 2, 2), r(4), None, None, None, True, 0.1, 1e-5),
                                  lambda: (r(4), None, None, r(4), pos(4), False, 0.1, 1e-5)],
                          empty=[lambda: (r(0, 3, 2, 2), r(3), r(3), r(3), pos(3), False, 0.1, 1e-5),
                                 lambda: (r(0, 3, 2, 2), None, None, None, None, True, 0.1, 1e-5)],
                          zero_dim=[lambda: (r(), None, None, r(), pos(), False, 0.1, 1e-5)]),
    "batch_norm_add_relu": Op(lambda: (r(4, 3, 5), r(4, 3, 5), r(3), r(3), r(3, scale=0.1), pos(3), False, 0.1, 1e-5),
                              lambda x, res, w, b, rm, rv, tr, mo, eps: _bn(x, res, w, b, rm, rv, tr, mo, eps),
                              mutates=(4, 5),
                              shapes=[lambda: (r(4, 3, 5), r(4, 3, 4), None, None, None, None, True, 0.1, 1e-5)],
                              empty=[lambda: (r(0, 3, 5), r(0, 3, 5), None, None, r(3), pos(3), False, 0.1, 1e-5)],
                              zero_dim=[lambda: (r(), r(), None, None, None, None, True, 0.1, 1e-5)]),
    "batch_norm_relu_backward": Op(lambda: _backward_args(r(4, 3, 2, 2), r(3), r(3)),
                                   lambda g, x, o, w, m, i, tr: _bn_backward(g, x, o, w, m, i, tr, False),
                                   shapes=[lambda: (r(4, 3, 2, 2), r(4, 3, 2, 2), r(4, 3, 2, 2), r(3), r(4), pos(3),
                                                    True),
                                           lambda: (r(4, 3, 2), r(4, 3, 2, 2), r(4, 3, 2, 2), None, r(3), pos(3),
                                                    False)],
                                   empty=[lambda: (r(0, 3, 2), r(0, 3, 2), r(0, 3, 2), None, r(3), pos(3), False)],
                                   zero_dim=[lambda: (r(), r(), r(), None, r(), r(), False)]),
    "batch_norm_add_relu_backward": Op(lambda: _backward_args(r(4, 3, 2, 2), None, r(3), r(4, 3, 2, 2), False),
                                       lambda g, x, o, w, m, i, tr: _bn_backward(g, x, o, w, m, i, tr, True),
                                       shapes=[lambda: (r(4, 3, 2, 2), r(4, 3, 2, 2), r(4, 3, 2, 2), r(2), r(3),
                                                        pos(3), True)],
                                       empty=[lambda: (r(0, 3), r(0, 3), r(0, 3), r(3), r(3), pos(3), False)],
                                       zero_dim=[lambda: (r(), r(), r(), None, r(), r(), True)]),
    "bias_relu_pool": Op(lambda: (r(2, 3, 4, 6), r(3), [2, 2]),
                         lambda y, b, k: F.max_pool2d(F.relu(y + _per_channel(b, y)), k),
                         shapes=[lambda: (r(2, 3, 4, 6), r(4), [2, 2]), lambda: (r(2, 3, 4), r(3), [2, 2]),
                                 lambda: (r(2, 3, 1, 6), r(3), [2, 2])],
                         empty=[lambda: (r(0, 3, 4, 6), r(3), [2, 2])], zero_dim=[lambda: (r(), r(), [2, 2])]),
    "max_pool2d": Op(lambda: (r(2, 3, 5, 6), [3, 3], [2, 2], [1, 1], False),
                     lambda x, k, s, p, c: F.max_pool2d(x, k, s or k, p, ceil_mode=c),
                     shapes=[lambda: (r(3, 6), [2, 2], [], [0, 0], False),
                             lambda: (r(2, 3, 2, 2), [5, 5], [], [0, 0], False)],
                     empty=[lambda: (r(0, 3, 5, 6), [2, 2], [], [0, 0], True),
                            lambda: (r(2, 0, 5, 6), [2, 2], [], [0, 0], False)],
                     zero_dim=[lambda: (r(), [1, 1], [], [0, 0], False)]),
    "max_pool2d_where": Op(lambda: (r(2, 3, 5, 6), [3, 3], [2, 2], [1, 1], True), _pool_where,
                           shapes=[lambda: (r(3, 5, 6), [2, 2], [], [0, 0], False),
                                   lambda: (r(2, 3, 5, 6), [17, 17], [1, 1], [8, 8], False)],
                           empty=[lambda: (r(0, 3, 5, 6), [2, 2], [2, 2], [0, 0], False)],
                           zero_dim=[lambda: (r(), [1, 1], [], [0, 0], False)]),
    "max_pool2d_backward_add": Op(lambda: _max_pool_args(r(2, 3, 5, 6)), _pool_backward_add,
                                  shapes=[lambda: _max_pool_args(r(2, 3, 5, 6))[:3] + ([2, 3, 5, 7], [3, 3], [2, 2],
                                                                                      [1, 1], False),
                                          lambda: (r(2, 3, 3, 3),) + _max_pool_args(r(2, 3, 5, 6))[1:]],
                                  empty=[lambda: _max_pool_args(r(0, 3, 5, 6))],
                                  zero_dim=[lambda: (r(),) + _max_pool_args(r(2, 3, 5, 6))[1:]]),
    "embedding": Op(lambda: (r(10, 4), torch.tensor([[1, 2], [3, 9]]), 2),
                    lambda w, i, p: F.embedding(i, w, p if p >= 0 else None),
                    shapes=[lambda: (r(10), torch.tensor([1, 2]), -1), lambda: (r(10, 4), torch.tensor([1]), 12)],
                    empty=[lambda: (r(10, 4), torch.tensor([], dtype=torch.long), -1),
                           lambda: (r(0, 4), torch.tensor([], dtype=torch.long), -1)],
                    zero_dim=[lambda: (r(10, 4), torch.tensor(3), -1), lambda: (r(), torch.tensor(0), -1)]),
    "global_avg_pool": Op(lambda: (r(2, 3, 4, 5), [2, 3], False), lambda x, d, k: x.mean(d, keepdim=k),
                          shapes=[lambda: (r(2, 3, 4, 5), [2, 4], False), lambda: (r(3, 4), [-2, -1], True)],
                          empty=[lambda: (r(0, 3, 4, 5), [2, 3], False), lambda: (r(2, 3, 0, 5), [-1, -2], True)],
                          zero_dim=[lambda: (r(), [0], False)]),
    "bias_cat": Op(lambda: ([r(2, 3, 4, 4), r(2, 5, 4, 4)], [r(3), r(5)], 1),
                   lambda xs, bs, d: torch.cat([x + b.view(-1, 1, 1) for x, b in zip(xs, bs)], d),
                   shapes=[lambda: ([r(2, 3, 4, 4), r(2, 5, 4, 5)], [r(3), r(5)], 1),
                           lambda: ([r(2, 3, 4, 4)], [r(4)], 1), lambda: ([r(2, 3, 4, 4)], [r(3), r(3)], 1)],
                   empty=[lambda: ([r(0, 3, 4, 4), r(0, 5, 4, 4)], [r(3), r(5)], 1)],
                   zero_dim=[lambda: ([r()], [r()], 1)]),
}
# _pointwise_chain_interpreted: a test-only CPU op (the chain kernel's code on the CPU) that
# shares pointwise_chain's checks, which the table enumerates
NOT_ENUMERATED = {"pinned_empty", "stream_fork", "stream_switch", "stream_record", "stream_join",
                  "_pointwise_chain_interpreted"}


# ---- the cases --------------------------------------------------------------------------
def _convert(t, dtype):
    """t's values as dtype: integers rounded from 3 t, bools t > 0, complex with t's real part."""
    if dtype.is_floating_point:
        return t.to(dtype)
    if dtype == torch.bool:
        return t > 0 if t.is_floating_point() else t != 0
    if dtype.is_complex:
        return t.to(dtype)
    return (t * 3).round().to(dtype) if t.is_floating_point() else t.to(dtype)


def _strided(t):
    """t's values in a view with a gap after every element of its last dim (not dense)."""
    big = torch.empty(tuple(t.shape) + (2,), dtype=t.dtype)
    big[..., 0] = t
    return big[..., 0]


def _transposed(t):
    """t's values, dense, its last two dims' strides swapped."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@dataclass
class Case:
    category: str
    label: str
    build: Callable
    must_raise: bool = False
    cpu_must_answer: bool = False   # float64: the CPU references take it


def _variant(op, fn):
    """A builder of op's valid arguments with fn(leaves) applied to their pytree leaves."""
    def build():
        leaves, tree = pytree.tree_flatten(op.make())
        return pytree.tree_unflatten(fn(list(leaves)), tree)
    return build


def _set(i, f):
    def fn(leaves):
        leaves[i] = f(leaves[i])
        return leaves
    return fn


def _set_all(idx, f):
    def fn(leaves):
        for i in idx:
            leaves[i] = f(leaves[i])
        return leaves
    return fn


def cases(name):
    op = OPS[name]
    args = op.make()
    leaves = pytree.tree_leaves(args)
    position = [i for i, a in enumerate(args) for _ in pytree.tree_leaves(a)]   # each leaf's argument
    slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    floats = [i for i in slots if leaves[i].is_floating_point()]
    every = [i for i in floats if position[i] not in op.fixed]   # the every-floating-tensor conversions
    out = []
    for dt in BAD_DTYPES:
        for i in slots:
            if leaves[i].dtype != dt:
                out.append(Case("dtype", f"tensor {i} as {dt}", _variant(op, _set(i, lambda t, dt=dt: _convert(t, dt))),
                                must_raise=leaves[i].is_floating_point() and not op.answers
                                and not (dt == torch.bool and op.takes_bool)))
        if len(every) > 1:
            out.append(Case("dtype", f"every floating tensor as {dt}",
                            _variant(op, _set_all(every, lambda t, dt=dt: _convert(t, dt))),
                            must_raise=not op.answers and not (dt == torch.bool and op.takes_bool)))
    if every:   # float64: the CPU references take it (gradcheck); on CUDA, a kernel refuses it by name
        out.append(Case("dtype", "every floating tensor as torch.float64",
                        _variant(op, _set_all(every, lambda t: t.to(torch.float64))), cpu_must_answer=op.float64,
                        must_raise=not op.float64))
    # one tensor on meta beside CPU ones (but not every device tensor on meta beside the
    # host ones: the rng of the dropout ops is a CPU tensor on every device)
    host = {i for i in slots if position[i] in op.host}
    if len(slots) > 1:
        for i in slots:
            if i not in host and len(slots) - len(host) == 1:
                continue
            out.append(Case("device", f"tensor {i} on meta", _variant(op, _set(i, lambda t: t.to("meta"))),
                            must_raise=not op.answers))
    for kind, f, ok in (("strided", _strided, lambda t: t.dim() >= 1), ("transposed", _transposed, lambda t: t.dim() >= 2)):
        idx = [i for i in floats if ok(leaves[i]) and leaves[i].numel() > 1]
        for i in idx:
            out.append(Case("noncontiguous", f"tensor {i} {kind}", _variant(op, _set(i, f))))
        if len(idx) > 1:
            out.append(Case("noncontiguous", f"every tensor {kind}", _variant(op, _set_all(idx, f))))
    for category, builders in (("shape", op.shapes), ("empty", op.empty), ("0-dim", op.zero_dim)):
        out += [Case(category, f"#{j}", b) for j, b in enumerate(builders)]
    return out


# ---- running one ------------------------------------------------------------------------
def _map(args, f):
    return pytree.tree_map_only(torch.Tensor, f, args)


def _has_meta(args):
    return any(t.device.type == "meta" for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


def _on(args, device, host, mode=None):
    """args with their tensors on device in their own strides, but the host ones (the
    dropout ops' rng, a CPU tensor on every device) and a mixed-device case's meta one;
    under mode (a FakeTensorMode), every tensor fake."""
    def move(t):
        if t.device.type == "meta":
            return t
        if mode is not None:
            with mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return _copy(t, device=device)
    def keep(t):
        return mode.from_tensor(t) if mode is not None else t
    return tuple(_map(a, keep) if i in host else _map(a, move) for i, a in enumerate(args))


def _copy(t, dtype=None, device=None):
    """A copy of t in t's own strides (clone() makes a strided view contiguous: the
    references of layout-sensitive ops, optim_fusable's, must see the layout as given)."""
    dtype, device = dtype or t.dtype, device or t.device
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):   # an expanded tensor: no such copy
        return t.to(device=device, dtype=dtype, copy=True)
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device).copy_(t)


def _upcast(args):
    return _map(args, lambda t: _copy(t, torch.float64) if t.is_floating_point() else _copy(t))


def _attempt(f, *args):
    try:
        return True, f(*args)
    except Exception as e:   # noqa: BLE001  (judged by the caller)
        return False, e


def _leaves(v):
    return [] if v is None else pytree.tree_leaves(v)


def _mutated(op, args):
    return [t for i in op.mutates for t in pytree.tree_leaves(args[i])]


def _named_error(name, e):
    """None when e is an error that names the op, else what is wrong with it."""
    if not isinstance(e, EXCEPTIONS):
        return f"raised {type(e).__name__} (not RuntimeError, ValueError or TypeError): {e}"
    if f"kitsune.{name}:" not in str(e):
        return f"raised an error that does not name kitsune.{name}: {str(e).splitlines()[0][:200]}"
    return None


def _compare(got, want, want64):
    """None when got (the op's result leaves) is want's (shapes, dtypes) with want64's values."""
    if len(got) != len(want):
        return f"{len(got)} results, the reference has {len(want)}"
    for k, (g, w, w64) in enumerate(zip(got, want, want64)):
        if not isinstance(w, torch.Tensor):
            if g != w:
                return f"result {k}: {g!r}, the reference gives {w!r}"
            continue
        if not isinstance(g, torch.Tensor):
            return f"result {k}: {type(g).__name__}, the reference gives a tensor"
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"result {k}: {g.dtype} {list(g.shape)}, the reference gives {w.dtype} {list(w.shape)}"
        g = g.detach().cpu()
        try:
            if g.is_floating_point():
                torch.testing.assert_close(g.double(), w64.double(), rtol=RTOL, atol=ATOL, equal_nan=True)
            elif not torch.equal(g, w64.to(g.dtype)):
                return f"result {k}: {g} but the reference gives {w64}"
        except AssertionError as e:
            return f"result {k}: values differ from the float64 reference: {str(e).splitlines()[-3:]}"
    return None


def _same_layout(real, fake, devices=True):
    """None when the fake kernel's results promise the real kernel's: shapes, dtypes,
    significant strides (dims longer than 1) and, where both ran on one device, devices."""
    if len(real) != len(fake):
        return f"the fake kernel gives {len(fake)} results, the real kernel {len(real)}"
    for k, (c, m) in enumerate(zip(real, fake)):
        if not isinstance(c, torch.Tensor):
            continue
        if not isinstance(m, torch.Tensor) or m.shape != c.shape or m.dtype != c.dtype or (devices and
                                                                                           m.device != c.device):
            return (f"result {k}: fake {getattr(m, 'dtype', m)} {list(getattr(m, 'shape', []))} on "
                    f"{getattr(m, 'device', '?')}, real {c.dtype} {list(c.shape)} on {c.device}")
        same, dim = torch._prims_common.check_significant_strides(c, m, only_cuda=False)
        if not same:
            return f"result {k}: fake strides {m.stride()}, real {c.stride()} (dim {dim}) for shape {list(c.shape)}"
    return None


def _fake_run(name, args, device, ok, got, real_device):
    """The fake kernel (FakeTensorMode, as torch.compile traces) on the case's arguments,
    as fake tensors on device, against the real run (ok, got) on the arguments' own device:
    it refuses what the real kernel refused, else it promises the real result. A fake CUDA
    kernel may also refuse, by name, a dtype the CPU takes and a CUDA kernel does not
    (float64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    fargs = _on(args, device, OPS[name].host, mode)
    with mode:   # as under torch.compile (the C++ autograd kernels make tensors of their own)
        fok, fgot = _attempt(getattr(K, name), *fargs)
    what = f"the fake kernel on {device}"
    if not ok:
        assert not fok, f"the real kernel raised ({str(got).splitlines()[0][:160]}) but {what} answered"
        why = _named_error(name, fgot)
        assert why is None, f"{what} {why}"
    elif not fok:
        why = _named_error(name, fgot)
        assert why is None, f"{what} {why}"
        assert "the CUDA kernel's dtypes" in str(fgot), f"the real kernel answered but {what} raised: {fgot}"
    else:
        why = _same_layout(_leaves(got), _leaves(fgot), devices=device == real_device)
        assert why is None, f"{what}: {why}"


def _fake_cuda():
    """Whether fake CUDA tensors can be made here (a torch built without CUDA cannot)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        with FakeTensorMode():
            torch.empty(1, device="cuda")
        return True
    except (RuntimeError, AssertionError):
        return False


FAKE_CUDA = _fake_cuda()


def run_case(name, case, device="cpu"):
    """'raised' or 'matched' when the case passes, else raises AssertionError saying why.
    device: where the tensors go (but the rng of the dropout ops); the references run on
    the CPU."""
    op = OPS[name]
    args = case.build()
    if device != "cpu":
        args = _on(args, device, op.host)
    plain = not _has_meta(args)
    # an in-place op's arguments before it changes them, for the reference: on the CPU
    # (the predicate optim_fusable's on their device: it reads devices)
    before = _map(args, lambda t: _copy(t, device="cpu" if t.device.type == device and not op.answers else None))
    ok, got = _attempt(getattr(K, name), *args)
    if not ok:
        why = _named_error(name, got)
        assert why is None, why
        assert not (case.cpu_must_answer and device == "cpu"), f"refused what the CPU reference takes: {got}"
        verdict = "raised"
    else:
        got_leaves = _leaves(got) + _mutated(op, args)
        assert not case.must_raise, f"answered bad input instead of raising: {got_leaves}"
        ref = (lambda *a: op.ref(_map(got, lambda t: t.cpu()), *a)) if op.with_out else op.ref
        # the reference on the arguments as given (shapes, dtypes), then on float64 copies (values)
        wok, want = _attempt(ref, *_map(before, _copy))
        assert wok, f"answered where the ATen reference raises ({type(want).__name__}: {want})"
        wok, want64 = _attempt(ref, *_upcast(before))
        assert wok, f"the float64 reference raised {type(want64).__name__}: {want64}"
        why = _compare(got_leaves, _leaves(want), _leaves(want64))
        assert why is None, why
        verdict = "matched"
    if plain:
        _fake_run(name, args, device, ok, got, device)
        if device == "cpu" and FAKE_CUDA:   # fake CUDA tensors need no GPU: the fake kernels' CUDA rules
            _fake_run(name, args, "cuda", ok, got, device)
    return verdict


RESULTS = {}


def _run_all(name, device):
    failures, counts = [], {}
    for case in cases(name):
        try:
            verdict = run_case(name, case, device)
        except AssertionError as e:
            failures.append(f"{case.category} ({case.label}): {e}")
            verdict = "wrong"
        counts.setdefault(case.category, {}).setdefault(verdict, 0)
        counts[case.category][verdict] += 1
    assert not failures, f"kitsune.{name} on {device}: {len(failures)} wrong:\n" + "\n".join(failures)
    return counts


@pytest.mark.parametrize("name", sorted(OPS))
def test_bad_input_raises_or_matches_aten(name):
    """Every case of the op on the CPU raises by name or matches its ATen reference; the
    fake kernel agrees with the CPU kernel on each, on CPU and on (fake) CUDA tensors.
    All the op's failures are listed at once."""
    RESULTS[name] = _run_all(name, "cpu")


@gpu
@pytest.mark.parametrize("name", sorted(OPS))
def test_gpu_bad_input_raises_or_matches_aten(name):
    """The same cases on CUDA tensors: the CUDA kernels refuse by name (float64 too, where
    a Kitsune kernel would read it) or match the ATen reference, and their fake kernels
    agree with them."""
    _run_all(name, "cuda")


def test_every_op_is_enumerated():
    ops = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kitsune::")}
    assert ops - NOT_ENUMERATED == set(OPS), (sorted(ops - NOT_ENUMERATED - set(OPS)), sorted(set(OPS) - ops))


def test_summary():
    """Prints the enumeration's size (pytest -s), per category: cases raised by name /
    matched ATen / wrong."""
    if not RESULTS:
        pytest.skip("no op ran")
    total = {}
    for counts in RESULTS.values():
        for cat, v in counts.items():
            for verdict, n in v.items():
                total.setdefault(cat, {}).setdefault(verdict, 0)
                total[cat][verdict] += n
    n = sum(sum(v.values()) for v in total.values())
    lines = [f"{len(RESULTS)} ops, {n} cases"] + [
        f"  {cat:14s} " + ", ".join(f"{verdict} {k}" for verdict, k in sorted(v.items())) for cat, v in total.items()]
    print("\n".join(lines))
    assert all("wrong" not in v for v in total.values())
