"""Kitsune's fused ops: ``torch.ops.kitsune.*`` and their Python side.

The schemas and the CUDA and CPU kernels are registered by the C++ bridge
(python/kitsune/csrc/bridge.cpp): CUDA runs the precompiled kernels of
fusion/kernels on torch's current stream, CPU runs the reference semantics in
ATen. This module adds what the bridge does not:

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
  global_avg_pool(x, dim=(-2, -1), keepdim=False)
                                            x.mean(dim, keepdim) over H and W of (N, C, H, W):
                                            on CUDA for channels-last x one kernel each way,
                                            no workspace (ATen's stages 2x the input)
The dropout ops draw (seed, offset) from PyTorch's default generator of the device
(torch.manual_seed repeats a mask) and never store the mask: the backward rebuilds it
with the same Philox code (kitsune/philox.h); ``dropout_mask(rng, n, p, dtype)`` gives it.
Binary ops broadcast like ``a + b``. dtypes: float32, float16, bfloat16.
"""
import torch

from . import _native

_native.bridge()   # registers the schemas and kernels

_lib = torch.ops.kitsune


def _broadcast_like(a, b):
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype, device=a.device)


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::add_relu")
def _(a, b):
    return _broadcast_like(a, b)


@torch.library.register_fake("kitsune::add_relu_backward")
def _(grad, out):
    return _broadcast_like(grad, out)


@torch.library.register_fake("kitsune::mul_tanh")
def _(a, b):
    return _broadcast_like(a, b)


def _two_grads(grad, a, b):
    shape = torch.broadcast_shapes(grad.shape, a.shape, b.shape)
    return (torch.empty(shape, dtype=a.dtype, device=a.device), torch.empty(shape, dtype=a.dtype, device=a.device))


torch.library.register_fake("kitsune::mul_tanh_backward")(_two_grads)


@torch.library.register_fake("kitsune::bias_gelu")
def _(x, bias, approximate="none"):
    torch._check(bias.dim() == 1 and x.dim() >= 1 and bias.shape[0] == x.shape[-1],
                 lambda: f"kitsune.bias_gelu: bias must be 1-D with x.size(-1) elements; got {tuple(bias.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::bias_gelu_backward")
def _(grad, x, bias, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


@torch.library.register_fake("kitsune::swiglu")
def _(gate, up):
    return _broadcast_like(gate, up)


torch.library.register_fake("kitsune::swiglu_backward")(_two_grads)


@torch.library.register_fake("kitsune::rms_norm")
def _(x, weight, eps=1e-6):
    torch._check(weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"kitsune.rms_norm: weight must be 1-D with x.size(-1) elements; got {tuple(weight.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::rms_norm_backward")
def _(grad, x, weight, eps=1e-6):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@torch.library.register_fake("kitsune::layer_norm_relu")
def _(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _param_grads(like, weight, bias):
    def g(p):
        return torch.empty_like(p) if p is not None else like.new_empty((0,))
    return g(weight), g(bias)


@torch.library.register_fake("kitsune::layer_norm_relu_backward")
def _(grad, x, normalized_shape, weight, bias, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), *_param_grads(x, weight, bias))


@torch.library.register_fake("kitsune::add_layer_norm")
def _(x, residual, weight=None, bias=None, eps=1e-5):
    torch._check(x.shape == residual.shape, lambda: f"kitsune.add_layer_norm: x and residual must have one shape; "
                                                     f"got {tuple(x.shape)} and {tuple(residual.shape)}")
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("kitsune::add_layer_norm_backward")
def _(grad, grad_sum, sum, weight, bias, eps):
    return (torch.empty_like(sum, memory_format=torch.contiguous_format), *_param_grads(sum, weight, bias))


def _ce_loss_dtype(logits, float_loss):
    """The loss's dtype (the bridge's ce_loss_dtype): float32 for 16-bit logits with float_loss."""
    return torch.float32 if float_loss and logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


@torch.library.register_fake("kitsune::cross_entropy")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    return logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss))


@torch.library.register_fake("kitsune::cross_entropy_backward")
def _(grad, logits, target, ignore_index=-100, label_smoothing=0.0):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::cross_entropy_with_grad")
def _(logits, target, ignore_index=-100, label_smoothing=0.0, float_loss=False):
    return (logits.new_empty((), dtype=_ce_loss_dtype(logits, float_loss)),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


@torch.library.register_fake("kitsune::cross_entropy_rescale_")
def _(grad, by):
    return None


@torch.library.register_fake("kitsune::linear_cross_entropy")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    return x.new_empty((), dtype=_ce_loss_dtype(x, float_loss))


@torch.library.register_fake("kitsune::linear_cross_entropy_grads")
def _(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0, float_loss=False):
    return (x.new_empty((), dtype=_ce_loss_dtype(x, float_loss)),
            torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)))


def _reduced_shape(x, dim, keepdim):
    nd = max(x.dim(), 1)
    dims = set(range(nd)) if not dim else {d % nd for d in dim}
    return [1 if d in dims else x.shape[d] for d in range(x.dim()) if keepdim or d not in dims]


@torch.library.register_fake("kitsune::sum_squared")
def _(x, dim=None, keepdim=False):
    return x.new_empty(_reduced_shape(x, dim, keepdim))


@torch.library.register_fake("kitsune::mean_abs")
def _(x, dim=None, keepdim=False):
    return x.new_empty(_reduced_shape(x, dim, keepdim))


def _rng():
    return torch.empty(2, dtype=torch.long)


@torch.library.register_fake("kitsune::gelu_dropout")
def _(x, p, training=True, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rng()


@torch.library.register_fake("kitsune::gelu_dropout_backward")
def _(grad, x, rng, p, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("kitsune::bias_dropout_add")
def _(x, bias, residual, p, training=True):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rng()


@torch.library.register_fake("kitsune::dropout_backward")
def _(grad, rng, p):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _bn_fake(x):
    """(out, save_mean, save_invstd) of the BatchNorm ops: statistics fp32 (fp64 for fp64)."""
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[1],), dtype=st),
            x.new_empty((x.shape[1],), dtype=st))


def _bn_backward_fake(x, weight, residual):
    """(gx, [g_residual,] gw, gb) of the BatchNorm ops' backward."""
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return (gx,) + ((torch.empty_like(gx),) if residual else ()) + (
        torch.empty_like(weight) if weight is not None else x.new_empty((0,)), x.new_empty((x.shape[1],)))


@torch.library.register_fake("kitsune::batch_norm_relu")
def _(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake(x, weight, residual=False)


@torch.library.register_fake("kitsune::batch_norm_add_relu")
def _(x, residual, weight, bias, running_mean, running_var, training, momentum, eps):
    return _bn_fake(x)


@torch.library.register_fake("kitsune::batch_norm_add_relu_backward")
def _(grad, x, out, weight, save_mean, save_invstd, training):
    return _bn_backward_fake(x, weight, residual=True)


@torch.library.register_fake("kitsune::linear_act")
def _(x, weight, bias, act="relu"):
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))


@torch.library.register_fake("kitsune::channel_bias")
def _(y, bias, act="none"):
    return torch.empty_like(y)


@torch.library.register_fake("kitsune::bias_relu_pool")
def _(y, bias, kernel_size):
    kh, kw = (kernel_size[0], kernel_size[-1])
    return y.new_empty((y.shape[0], y.shape[1], y.shape[2] // kh, y.shape[3] // kw))


@torch.library.register_fake("kitsune::max_pool2d")
def _(x, kernel_size, stride, padding, ceil_mode):
    return torch.ops.aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, [1, 1], ceil_mode)[0]


@torch.library.register_fake("kitsune::embedding")
def _(weight, indices, padding_idx=-1):
    return torch.ops.aten.embedding.default(weight, indices, padding_idx)


@torch.library.register_fake("kitsune::max_pool2d_where")
def _(x, kernel_size, stride, padding, ceil_mode):
    out = torch.ops.aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, [1, 1], ceil_mode)[0]
    return out, torch.empty_like(out, dtype=torch.uint8)


@torch.library.register_fake("kitsune::max_pool2d_backward_add")
def _(grad, where, adds, input_size, kernel_size, stride, padding, ceil_mode):
    ref = grad if grad is not None else adds[0]
    cl = where.is_contiguous(memory_format=torch.channels_last) and not where.is_contiguous()
    return ref.new_empty(input_size).contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@torch.library.register_fake("kitsune::global_avg_pool")
def _(x, dim, keepdim=False):
    return torch.ops.aten.mean.dim(x, dim, keepdim)


@torch.library.register_fake("kitsune::bias_cat")
def _(xs, biases, dim=1):
    return torch.cat(list(xs), dim)


@torch.library.register_fake("kitsune::channel_sum")
def _(g):
    return g.new_empty((g.shape[1],), dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)


# ---- autograd ----
# Every op but one has its autograd in C++ (the bridge's Autograd-key kernels: no Python
# on the launch path). The linear_cross_entropy op, called directly, registers its
# backward here; kitsune.ops.linear_cross_entropy below (an autograd.Function) forms
# the gradients in its forward instead.
def _lce_setup(ctx, inputs, output):
    x, weight, target, bias, *ctx.options = inputs
    ctx.save_for_backward(x, weight, target, bias)


def _lce_bwd(ctx, grad):
    x, weight, target, bias = ctx.saved_tensors
    _, gx, gw, gb = _lib.linear_cross_entropy_grads(x, weight, target, bias, *ctx.options)
    return gx * grad, gw * grad, None, (gb * grad if bias is not None else None), None, None, None, None


torch.library.register_autograd("kitsune::linear_cross_entropy", _lce_bwd, setup_context=_lce_setup)


# ---- the Python API ------------------------------------------------------------
def add_relu(a, b):
    """relu(a + b), fused."""
    return _lib.add_relu(a, b)


def mul_tanh(a, b):
    """tanh(a * b), fused."""
    return _lib.mul_tanh(a, b)


def bias_gelu(x, bias, approximate="none"):
    """gelu(x + bias) with bias along the last dimension; approximate is "none" (erf) or "tanh"."""
    return _lib.bias_gelu(x, bias, approximate)


def swiglu(gate, up):
    """silu(gate) * up, fused."""
    return _lib.swiglu(gate, up)


def rms_norm(x, weight, eps=1e-6):
    """x * rsqrt(mean(x^2, -1) + eps) * weight (RMSNorm over the last dimension), fused."""
    return _lib.rms_norm(x, weight, eps)


def layer_norm_relu(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """relu(F.layer_norm(x, normalized_shape, weight, bias, eps)), fused."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _lib.layer_norm_relu(x, list(normalized_shape), weight, bias, eps)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5):
    """(x + residual, F.layer_norm(x + residual) over the last dim), in one kernel."""
    return _lib.add_layer_norm(x, residual, weight, bias, eps)


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0):
    """F.cross_entropy(logits, target) (mean over non-ignored rows) for (N, C) or (C,)
    logits and int64 targets, without storing the softmax. The loss has the logits'
    dtype, float32 under autocast (as F.cross_entropy's; 16-bit logits are read as
    they are, in fp32 arithmetic, and their gradient has their dtype). On CUDA an
    out-of-range target gives a NaN loss instead of a device assert."""
    return _lib.cross_entropy(logits, target, ignore_index, label_smoothing)


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are formed chunk by chunk in the forward, while each chunk's
    logits exist; the backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, label_smoothing, chunk_size, float_loss):
        loss, gx, gw, gb = _lib.linear_cross_entropy_grads(x, weight, target, bias, ignore_index, label_smoothing,
                                                           chunk_size, float_loss)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(gx, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: the formed gradients would be constants to autograd
            raise RuntimeError("kitsune.linear_cross_entropy has no double backward: its gradients are formed in "
                               "the forward, so a backward with create_graph=True would treat them as constants. "
                               "For higher-order gradients use F.cross_entropy(F.linear(x, weight, bias), target)")
        gx, gw, gb = ctx.saved_tensors
        return gx * grad, gw * grad, None, (gb * grad if ctx.has_bias else None), None, None, None, None


def linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, chunk_size=0):
    """F.cross_entropy(F.linear(x, weight, bias), target) computed chunk_size rows at a
    time (0 chooses: each chunk's logits about the size of x), so the full logits
    tensor never exists. x (..., H), weight (C, H), target (...) int64."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    if not needs_grad:   # the op's autocast kernel casts like F.linear
        return _lib.linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, chunk_size)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):   # as F.linear under autocast; the loss in fp32 as F.cross_entropy's
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size,
                                             True)
    return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, label_smoothing, chunk_size, False)


def _dims(dim):
    return None if dim is None else [dim] if isinstance(dim, int) else list(dim)


def sum_squared(x, dim=None, keepdim=False):
    """sum(x * x) over dim (all dims by default), fp32 accumulation."""
    return _lib.sum_squared(x, _dims(dim), keepdim)


def mean_abs(x, dim=None, keepdim=False):
    """mean(|x|) over dim (all dims by default), fp32 accumulation."""
    return _lib.mean_abs(x, _dims(dim), keepdim)


def attention_score(q, k, scale=None):
    """(q @ k.transpose(-2, -1)) * scale as one batched GEMM (scale as its alpha);
    scale defaults to 1/sqrt(q.size(-1)). No softmax."""
    return _lib.attention_score(q, k, scale)


def gelu_dropout(x, p=0.1, training=True, approximate="none"):
    """F.dropout(F.gelu(x, approximate=approximate), p, training) in one kernel; the
    mask is not stored (the backward regenerates it)."""
    return _lib.gelu_dropout(x, p, training, approximate)[0]


def bias_dropout_add(x, bias, residual, p=0.1, training=True):
    """residual + F.dropout(x + bias, p, training), bias along the last dim, in one kernel."""
    return _lib.bias_dropout_add(x, bias, residual, p, training)[0]


def dropout_mask(rng, n, p, dtype=torch.float32):
    """The keep mask (bool, n elements) of a dropout call from the rng tensor its op
    returned (torch.ops.kitsune.gelu_dropout(...)[1]), built on the CPU; dtype is the
    dropped tensor's (fp16/bf16 masks use 16 random bits an element, others 32)."""
    return _lib.dropout_mask(rng, n, p, dtype)


def batch_norm_relu(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
    eps)) over dim 1, fused; the running stats are updated in place in training."""
    return _lib.batch_norm_relu(x, weight, bias, running_mean, running_var, training, momentum, eps)[0]


def batch_norm_add_relu(x, residual, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                        eps=1e-5):
    """relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
    eps) + residual), residual of x's shape and dtype: a ResNet block's end in one
    pass each way (the normalized values are never stored; the backward writes the
    residual's gradient beside x's)."""
    return _lib.batch_norm_add_relu(x, residual, weight, bias, running_mean, running_var, training, momentum, eps)[0]


def channel_bias(y, bias, act="none"):
    """act(y + bias over dim 1), act "none" or "relu": a convolution's bias (and the ReLU
    after it), split from the convolution by kitsune.optimize. Its backward sums the
    bias gradient in two stages (faster than ATen's one reduction over N, H, W at small
    channel counts), in fp32, deterministically."""
    return _lib.channel_bias(y, bias, act)


def bias_relu_pool(y, bias, kernel_size):
    """F.max_pool2d(relu(y + bias over dim 1), kernel_size) for y (N, C, H, W): a
    convolution's bias, its ReLU and a max pooling over non-overlapping windows (stride =
    kernel_size, no padding, floor mode), as kitsune.optimize takes them together. On
    CUDA (y contiguous) one kernel forward and one (plus the bias gradient's sum over N)
    backward, saving y and the bias only; equal to the unfused ops, winners and ties
    included."""
    k = [kernel_size, kernel_size] if isinstance(kernel_size, int) else list(kernel_size)
    return _lib.bias_relu_pool(y, bias, k)


def bias_cat(xs, biases, dim=1):
    """torch.cat([x + b.view(-1, 1, 1) for x, b in zip(xs, biases)], dim) for Conv2d outputs x
    (N, C_i, H, W) or, unbatched, (C_i, H, W) and biases (C_i,): an Inception block's branch
    convolutions' biases and their concatenation, as kitsune.optimize takes them together.
    On CUDA, for 4-D parts concatenated over their channels (at most 8 parts sharing one
    layout, NCHW or channels-last), one kernel forward, and backward one kernel that writes
    each part's gradient dense (cuDNN copies a channel slice) and sums the bias gradients,
    plus their final column sum; equal to the unfused ops."""
    return _lib.bias_cat(list(xs), list(biases), dim)


def max_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False):
    """F.max_pool2d(x, kernel_size, stride, padding, ceil_mode=ceil_mode) with dilation 1
    and no indices returned, for x (N, C, H, W) or (C, H, W). On CUDA (x NCHW- or
    channels-last-contiguous, windows of at most 256 elements) Kitsune's kernels: the
    backward gathers each input's gradient from the windows it won, using a byte per
    output saved by the forward (ATen saves 8); output and gradient equal ATen's."""
    def ints(v):
        return [v, v] if isinstance(v, int) else list(v)
    return _lib.max_pool2d(x, ints(kernel_size), [] if stride is None else ints(stride), ints(padding),
                           bool(ceil_mode))


def embedding(indices, weight, padding_idx=None):
    """F.embedding(indices, weight, padding_idx) (no max_norm, scale_grad_by_freq or
    sparse). On CUDA the weight gradient is Kitsune's: a radix sort over the
    vocabulary's bits only and a block per run of equal indices, in a fixed order."""
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:   # as F.embedding counts it
        padding_idx += weight.shape[0]
    return _lib.embedding(weight, indices, padding_idx)


class _MaxPoolBranches(torch.autograd.Function):
    """(max_pool2d(x), x_1, ..., x_n), the x_i views of x whose gradients the backward
    adds to the pooling's in the same pass (max_pool2d_backward_add)."""

    @staticmethod
    def forward(ctx, x, n, k, s, p, ceil):
        out, where = _lib.max_pool2d_where(x, k, s, p, ceil)
        ctx.save_for_backward(where)
        ctx.geo = (list(x.shape), k, s, p, ceil)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(where)
        return (out,) + tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, g_out, *g_views):
        where, = ctx.saved_tensors
        adds = [g for g in g_views if g is not None]
        if g_out is None and not adds:
            return (None,) * 6
        return (_lib.max_pool2d_backward_add(g_out, where, adds, *ctx.geo), None, None, None, None, None)


def max_pool2d_branches(x, n, kernel_size, stride=None, padding=0, ceil_mode=False):
    """(F.max_pool2d(x, ...), x_1, ..., x_n): x_i are x for n other users of x (an
    Inception block's branches beside its pooling). Where a gradient is wanted (a 4-D
    floating x, a window of at most 256 elements), the x_i are views of x whose gradients
    the pooling's backward adds in its own pass (on CUDA in the pooling kernel, where it
    takes x; elsewhere through ATen), where autograd would add each in a launch of its
    own; otherwise they are x itself. Values and gradients equal max_pool2d's and x's."""
    def ints(v):
        return [v, v] if isinstance(v, int) else list(v)
    k, p = ints(kernel_size), ints(padding)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else ints(stride)
    if torch.is_grad_enabled() and x.requires_grad and x.dim() == 4 and x.is_floating_point() and k[0] * k[1] <= 256:
        return _MaxPoolBranches.apply(x, n, k, s, p, bool(ceil_mode))
    return (max_pool2d(x, k, s, p, ceil_mode),) + (x,) * n


def global_avg_pool(x, dim=(-2, -1), keepdim=False):
    """x.mean(dim, keepdim): global average pooling when dim names H and W of an (N, C, H,
    W) x ((2, 3) or (-2, -1)). On CUDA, for a channels-last x in fp32/fp16/bf16, Kitsune's
    kernels: a fixed-order fp32 sum a channel, no workspace, and a backward that writes
    the gradient dense in channels-last. ATen's mean elsewhere (the CPU, NCHW, other dims
    or ranks), with ATen's errors."""
    return _lib.global_avg_pool(x, [dim] if isinstance(dim, int) else list(dim), bool(keepdim))


def linear_act(x, weight, bias, act="relu"):
    """act(F.linear(x, weight, bias)), act "relu", "gelu" (erf), "gelu_tanh" or "none". On
    CUDA, relu and (fp16/bf16) gelu_tanh are one cuBLASLt GEMM with the bias and
    activation in its epilogue; gelu is the GEMM, then bias_gelu; none is F.linear's GEMM,
    and its backward sums the bias gradient with Kitsune's column-sum kernel."""
    return _lib.linear_act(x, weight, bias, act)
