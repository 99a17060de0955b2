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
