"""GEMM ops: linear_act (a GEMM with a bias + activation epilogue) and attention_score
(fake and wrappers; csrc/ops/linear.cpp)."""
import torch

from ._check import check, check_floats, fail

_lib = torch.ops.kitsune


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::linear_act")
def _(x, weight, bias, act="relu"):
    op = "linear_act"
    if act not in ("relu", "gelu", "gelu_tanh", "none"):
        fail(op, f"act must be 'relu', 'gelu', 'gelu_tanh' or 'none', got '{act}'")
    check_floats(op, {"x": x, "weight": weight, "bias": bias}, kernel=act in ("gelu", "gelu_tanh"))
    check(op, x.dim() >= 1 and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and bias.dim() == 1 and
          bias.shape[0] == weight.shape[0],
          lambda: f"need x (..., in), weight (out, in), bias (out,); got {list(x.shape)}, {list(weight.shape)}, "
                  f"{list(bias.shape)}")
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))


# ---- the Python API ------------------------------------------------------------
def attention_score(q, k, scale=None):
    """(q @ k.transpose(-2, -1)) * scale as one batched GEMM (scale as its alpha);
    scale defaults to 1/sqrt(q.size(-1)). No softmax."""
    return _lib.attention_score(q, k, scale)


def linear_act(x, weight, bias, act="relu"):
    """act(F.linear(x, weight, bias)), act "relu", "gelu" (erf), "gelu_tanh" or "none". On
    CUDA, relu and (fp16/bf16) gelu_tanh are one cuBLASLt GEMM with the bias and
    activation in its epilogue; gelu is the GEMM, then bias_gelu; none is F.linear's GEMM,
    and its backward sums the bias gradient with Kitsune's column-sum kernel."""
    return _lib.linear_act(x, weight, bias, act)


# ---- wide_linear: a linear layer whose output width cuBLAS runs slowly ----
def _padded(n):
    return (n + 63) // 64 * 64


class _WideLinear(torch.autograd.Function):
    """F.linear with the output features padded to a multiple of 64 inside the GEMMs:
    an odd width (GPT-2's 50257 classes, BERT's 30522) keeps cuBLAS on slow sm75-era
    kernels, in the backward's two GEMMs too. The output shares the padded result's
    storage (rows the padded width apart), so nothing is copied in the forward; it is
    not an autograd view of it, so in-place ops on it work as on F.linear's."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        n, k = weight.shape
        x2 = x.reshape(-1, k).to(dtype)
        wp = weight.new_zeros((_padded(n), k), dtype=dtype)
        wp[:n].copy_(weight)
        out = x2.new_empty((x2.shape[0], wp.shape[0]))
        if bias is None:
            torch.mm(x2, wp.t(), out=out)
        else:
            bp = bias.new_zeros((wp.shape[0],), dtype=dtype)
            bp[:n].copy_(bias)
            torch.addmm(bp, x2, wp.t(), out=out)
        ctx.save_for_backward(x2, wp)
        ctx.n, ctx.x_shape, ctx.has_bias = n, x.shape, bias is not None
        shape = (*x.shape[:-1], n)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):   # the padded result's rows, in x's leading shape
            strides[d] = (wp.shape[0] if d == len(shape) - 2 else strides[d + 1] * shape[d + 1])
        return out.new_empty(0).set_(out.untyped_storage(), 0, shape, strides)

    @staticmethod
    @torch.autograd.function.once_differentiable   # a double backward raises instead of coming out wrong
    def backward(ctx, grad):
        x2, wp = ctx.saved_tensors
        n = ctx.n
        gp = grad.new_empty((x2.shape[0], wp.shape[0]), dtype=wp.dtype)
        gp[:, n:].zero_()
        gp[:, :n].copy_(grad.reshape(-1, n))
        gx = (gp @ wp).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        gw = (gp.t() @ x2)[:n] if ctx.needs_input_grad[1] else None
        gb = gp[:, :n].sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def wide_linear(x, weight, bias=None):
    """F.linear(x, weight, bias) for a weight whose number of rows (output features) is
    not a multiple of 8, on CUDA: the GEMMs run over the rows padded to a multiple of 64
    with zeros (a padded copy of the weight per call), and the output lies in the padded
    result, its rows the padded width apart, so ``out.view(-1, n)`` works but
    ``out.view(-1)`` does not (``reshape`` does). No double backward (it raises). Under autocast the GEMMs run in the
    autocast dtype, as F.linear's. Elsewhere (the CPU, or traced by torch.compile, where
    Inductor pads on its own) it is F.linear."""
    if isinstance(x, torch.fx.Proxy) or not x.is_cuda or torch.compiler.is_compiling() or weight.dim() != 2 or \
            x.shape[-1] != weight.shape[1]:
        return torch.nn.functional.linear(x, weight, bias)
    if torch.is_autocast_enabled("cuda"):
        if torch.float64 in (x.dtype, weight.dtype):
            return torch.nn.functional.linear(x, weight, bias)   # autocast leaves float64 alone
        dtype = torch.get_autocast_dtype("cuda")
    else:
        if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
            return torch.nn.functional.linear(x, weight, bias)   # its error
        dtype = x.dtype
    with torch.autocast("cuda", enabled=False):
        return _WideLinear.apply(x, weight, bias, dtype)
