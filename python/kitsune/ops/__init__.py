"""Kitsune's fused ops: ``torch.ops.kitsune.*`` and their Python side.

The schemas and the CUDA and CPU kernels are registered by the C++ bridge
(python/kitsune/csrc, one file a family in csrc/ops/<family>.cpp): CUDA runs the
precompiled kernels of fusion/kernels on torch's current stream, CPU runs the
reference semantics in ATen. One module a family here, of the same name
(ops/pointwise.py, ops/cross_entropy.py, ...), adds what the bridge does not:

  fake (meta) kernels  so the ops trace under torch.compile / FakeTensor: they
                       give the output shape, dtype and device without computing
  autograd             for the loss and reduction ops (the per-layer ops have
                       theirs in the bridge, in C++); each backward calls the
                       matching ``*_backward`` op, whose CUDA kernel runs on the GPU

Ops (reference semantics):
  add_relu(a, b)               relu(a + b)
  mul_tanh(a, b)               tanh(a * b)
  bias_gelu(x, bias, approximate="none")   gelu(x + bias), bias along the last dim
  swiglu(gate, up)             silu(gate) * up
  rms_norm(x, weight, eps=1e-6)   x * rsqrt(mean(x^2, -1) + eps) * weight
  layer_norm_relu(x, normalized_shape, weight=None, bias=None, eps=1e-5)
                               relu(layer_norm(x, normalized_shape, weight, bias, eps))
  add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5)
                               (x + residual, layer_norm(x + residual)) over the last dim
  cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0)
                               F.cross_entropy (mean), the softmax never stored
  linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100,
                       label_smoothing=0.0, chunk_size=0)
                               F.cross_entropy(F.linear(x, weight, bias), target) in row
                               chunks: the full logits tensor never exists
  sum_squared(x, dim=None, keepdim=False)   sum(x * x)
  mean_abs(x, dim=None, keepdim=False)      mean(|x|)
  attention_score(q, k, scale=None)         (q @ k^T) * scale, scale = 1/sqrt(d) by default
  gelu_dropout(x, p, training=True, approximate="none")   dropout(gelu(x))
  bias_dropout_add(x, bias, residual, p, training=True)   residual + dropout(x + bias)
  linear_act(x, weight, bias, act="relu")   act(F.linear(x, weight, bias)); on CUDA one cuBLASLt GEMM
                                            with a bias + relu / tanh-GELU epilogue; act "none":
                                            F.linear, the bias gradient by Kitsune's column sum
  batch_norm_relu(x, running_mean, running_var, weight, bias, training, momentum, eps)
                               relu(F.batch_norm(...)), running stats updated as F.batch_norm does
  batch_norm_add_relu(x, residual, running_mean, running_var, weight, bias, training, momentum, eps)
                               relu(F.batch_norm(...) + residual): a ResNet block's end
  channel_bias(y, bias, act="none")         act(y + bias over dim 1): a convolution's bias; its
                                            backward sums the bias gradient in two stages
  bias_relu_pool(y, bias, kernel_size)      F.max_pool2d(relu(y + bias over dim 1), kernel_size):
                                            non-overlapping windows; one kernel each way on CUDA
  bias_cat(xs, biases, dim=1)               torch.cat([x + bias over dim -3 for each part], dim):
                                            one kernel each way on CUDA; the backward gives
                                            dense part gradients and the bias sums
  max_pool2d(x, kernel_size, stride, padding, ceil_mode)
                                            F.max_pool2d (dilation 1, no indices): one kernel
                                            each way on CUDA, a byte per output saved
  embedding(indices, weight, padding_idx=None)
                                            F.embedding; on CUDA the weight gradient by a
                                            radix sort over the vocabulary's bits only
  max_pool2d_branches(x, n, kernel_size, stride, padding, ceil_mode)
                                            (max_pool2d(x, ...), x, ..., x) for n other users
                                            of x: their gradients added in the pooling's
                                            backward pass, not one launch each
  pointwise_chain(inputs, program, consts, out_regs, out_dtypes)
                                            a program of pointwise ops run per element in one
                                            launch (ops/chain.py; made by kitsune/fx/chains.py)
  global_avg_pool(x, dim=(-2, -1), keepdim=False)
                                            x.mean(dim, keepdim) over H and W of (N, C, H, W):
                                            on CUDA for channels-last x one kernel each way,
                                            no workspace (ATen's stages 2x the input)
The dropout ops draw (seed, offset) from PyTorch's default generator of the device
(torch.manual_seed repeats a mask) and never store the mask: the backward rebuilds it
with the same Philox code (kitsune/philox.h); ``dropout_mask(rng, n, p, dtype)`` gives it.
Binary ops broadcast like ``a + b``. dtypes: float32, float16, bfloat16, and float64 on
the CPU (gradcheck) and on the ATen paths. Every op refuses an integer, bool or complex
tensor, float64 where a CUDA kernel would read it, and tensors on two devices, with an
error naming the op, the argument and the value: the bridge's checks (csrc/common.h),
which each fake kernel repeats (ops/_check.py) before it promises the real kernel's
shapes, dtypes and strides.

Families (ops/<family>.py): pointwise (add_relu, mul_tanh, bias_gelu, swiglu,
channel_bias), rms_norm, layer_norm (layer_norm_relu, add_layer_norm), cross_entropy
(cross_entropy, linear_cross_entropy), reduce (sum_squared, mean_abs, channel_sum),
dropout (gelu_dropout, bias_dropout_add, dropout_mask), batch_norm, pool (max_pool2d,
max_pool2d_branches, bias_relu_pool), avg_pool (global_avg_pool), cat (bias_cat),
embedding, linear (linear_act, attention_score), optim (the fake kernels of adam_, sgd_
and their capturable forms; kitsune.optim calls them). This package loads the bridge, then
every family (each registers its fake kernels and Python autograd on import), and
exports every op's wrapper as kitsune.ops.<op>.
"""
import torch

from .. import _native

_native.bridge()   # registers the schemas and kernels (before any family registers a fake)

_lib = torch.ops.kitsune

# A family module may share its op's name (cross_entropy, rms_norm, embedding): importing
# the wrapper from it rebinds kitsune.ops.<name> from the submodule to the function.
from .avg_pool import global_avg_pool  # noqa: E402
from .batch_norm import batch_norm_add_relu, batch_norm_relu  # noqa: E402
from .cat import bias_cat  # noqa: E402
from . import chain as _chain  # noqa: E402,F401  (pointwise_chain's fake kernel and Program)
from .cross_entropy import cross_entropy, linear_cross_entropy  # noqa: E402
from .dropout import bias_dropout_add, dropout_mask, gelu_dropout  # noqa: E402
from .embedding import embedding  # noqa: E402
from .layer_norm import add_layer_norm, layer_norm_relu  # noqa: E402
from .linear import attention_score, linear_act, wide_linear  # noqa: E402
from . import optim as _optim  # noqa: E402,F401  (the fused optimizer ops' fake kernels)
from .pointwise import add_relu, bias_gelu, channel_bias, mul_tanh, swiglu  # noqa: E402
from .pool import bias_relu_pool, max_pool2d, max_pool2d_branches  # noqa: E402
from .reduce import mean_abs, sum_squared  # noqa: E402
from .rms_norm import rms_norm  # noqa: E402

__all__ = [
    "add_relu", "mul_tanh", "bias_gelu", "swiglu", "channel_bias", "rms_norm", "layer_norm_relu", "add_layer_norm",
    "cross_entropy", "linear_cross_entropy", "sum_squared", "mean_abs", "gelu_dropout", "bias_dropout_add",
    "dropout_mask", "batch_norm_relu", "batch_norm_add_relu", "max_pool2d", "max_pool2d_branches", "bias_relu_pool",
    "global_avg_pool", "bias_cat", "embedding", "linear_act", "attention_score", "wide_linear",
]
