"""Max pooling ops: max_pool2d, max_pool2d_where, max_pool2d_backward_add,
max_pool2d_branches, bias_relu_pool (fakes, the branch point's autograd.Function and
the wrappers; kernels in the bridge, csrc/ops/pool.cpp)."""
import torch

_lib = torch.ops.kitsune


# ---- fake kernels: shapes only ------------------------------------------------
@torch.library.register_fake("kitsune::bias_relu_pool")
def _(y, bias, kernel_size):
    kh, kw = (kernel_size[0], kernel_size[-1])
    return y.new_empty((y.shape[0], y.shape[1], y.shape[2] // kh, y.shape[3] // kw))


@torch.library.register_fake("kitsune::max_pool2d")
def _(x, kernel_size, stride, padding, ceil_mode):
    return torch.ops.aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, [1, 1], ceil_mode)[0]


@torch.library.register_fake("kitsune::max_pool2d_where")
def _(x, kernel_size, stride, padding, ceil_mode):
    out = torch.ops.aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, [1, 1], ceil_mode)[0]
    return out, torch.empty_like(out, dtype=torch.uint8)


@torch.library.register_fake("kitsune::max_pool2d_backward_add")
def _(grad, where, adds, input_size, kernel_size, stride, padding, ceil_mode):
    ref = grad if grad is not None else adds[0]
    cl = where.is_contiguous(memory_format=torch.channels_last) and not where.is_contiguous()
    return ref.new_empty(input_size).contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


# ---- the Python API ------------------------------------------------------------
def bias_relu_pool(y, bias, kernel_size):
    """F.max_pool2d(relu(y + bias over dim 1), kernel_size) for y (N, C, H, W): a
    convolution's bias, its ReLU and a max pooling over non-overlapping windows (stride =
    kernel_size, no padding, floor mode), as kitsune.optimize takes them together. On
    CUDA (y contiguous) one kernel forward and one (plus the bias gradient's sum over N)
    backward, saving y and the bias only; equal to the unfused ops, winners and ties
    included."""
    k = [kernel_size, kernel_size] if isinstance(kernel_size, int) else list(kernel_size)
    return _lib.bias_relu_pool(y, bias, k)


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
