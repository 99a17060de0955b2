"""Max pooling ops: max_pool2d, max_pool2d_where, max_pool2d_backward_add,
max_pool2d_branches, bias_relu_pool (fakes, the branch point's autograd.Function and
the wrappers; kernels in the bridge, csrc/ops/pool.cpp)."""
import torch

from ._check import check, check_float, check_floats, fail

_lib = torch.ops.kitsune


def _pooled(n, k, s, p, ceil):
    """ATen's pooled size (dilation 1; pooling_output_shape_pad_lr)."""
    out = (n + 2 * p - k + ((s - 1) if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= n + p:
        out -= 1
    return out


def _max_pool_args(op, x, kernel_size, stride, padding, ceil_mode):
    """The bridge's check_max_pool2d: ((kh, kw), (sh, sw), (ph, pw))."""
    check(op, x.dim() in (3, 4), lambda: f"need x (N, C, H, W) or (C, H, W), got {list(x.shape)}")
    check_float(op, "x", x)
    check(op, x.shape[-1] > 0 and x.shape[-2] > 0 and x.shape[-3] > 0,
          lambda: f"x's C, H and W must be non-zero, got {list(x.shape)}")
    k, s, p = list(kernel_size), list(stride), list(padding)
    if len(k) not in (1, 2):
        fail(op, f"kernel_size must be one or two ints, got {k}")
    if len(s) > 2:
        fail(op, f"stride must be empty (= kernel_size), one or two ints, got {s}")
    if len(p) not in (1, 2):
        fail(op, f"padding must be one or two ints, got {p}")
    kh, kw = k[0], k[-1]
    sh, sw = (s[0], s[-1]) if s else (kh, kw)
    ph, pw = p[0], p[-1]
    if kh < 1 or kw < 1:
        fail(op, f"kernel_size must be positive, got {k}")
    if sh < 1 or sw < 1:
        fail(op, f"stride must be positive, got {s}")
    if not (ph >= 0 and pw >= 0 and 2 * ph <= kh and 2 * pw <= kw):
        fail(op, f"padding must be in 0..kernel_size / 2, got padding {p} for kernel_size {k}")
    oh, ow = _pooled(x.shape[-2], kh, sh, ph, ceil_mode), _pooled(x.shape[-1], kw, sw, pw, ceil_mode)
    check(op, oh >= 1 and ow >= 1,
          lambda: f"the input's {x.shape[-2]} x {x.shape[-1]} (padding {p}) is smaller than the {kh} x {kw} window")
    return (kh, kw), (sh, sw), (ph, pw)


def _where_format(where):
    """The result's layout (the bridge's where_format): where's, channels-last where it is
    that and not NCHW-contiguous too."""
    cl = where.is_contiguous(memory_format=torch.channels_last) and not where.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


# ---- fake kernels: what the real ones check, then the outputs' shapes and layouts ----
@torch.library.register_fake("kitsune::bias_relu_pool")
def _(y, bias, kernel_size):
    op = "bias_relu_pool"
    check_floats(op, {"y": y, "bias": bias})
    check(op, y.dim() == 4 and bias.dim() == 1 and bias.shape[0] == y.shape[1],
          lambda: f"need y (N, C, H, W) and bias (C,); got {list(y.shape)} and {list(bias.shape)}")
    k = list(kernel_size)
    if len(k) not in (1, 2):
        fail(op, f"kernel_size must be one or two ints, got {k}")
    kh, kw = k[0], k[-1]
    if not (1 <= kh <= 64 and 1 <= kw <= 64):
        fail(op, f"kernel_size must be in 1..64, got {k}")
    check(op, y.shape[2] >= kh and y.shape[3] >= kw,
          lambda: f"the input's {y.shape[2]} x {y.shape[3]} is smaller than the {kh} x {kw} window")
    # ATen's pooling of channel_bias's output, which has empty_like(y)'s layout (the
    # kernel, on a contiguous y, writes the same contiguous output)
    return torch.ops.aten.max_pool2d_with_indices.default(torch.empty_like(y), [kh, kw], [kh, kw])[0]


@torch.library.register_fake("kitsune::max_pool2d")
def _(x, kernel_size, stride, padding, ceil_mode):
    k, s, p = _max_pool_args("max_pool2d", x, kernel_size, stride, padding, ceil_mode)
    return torch.ops.aten.max_pool2d_with_indices.default(x, k, s, p, [1, 1], ceil_mode)[0]


@torch.library.register_fake("kitsune::max_pool2d_where")
def _(x, kernel_size, stride, padding, ceil_mode):
    op = "max_pool2d_where"
    k, s, p = _max_pool_args(op, x, kernel_size, stride, padding, ceil_mode)
    check(op, x.dim() == 4, lambda: f"need x (N, C, H, W), got {list(x.shape)}")
    if k[0] * k[1] > 256:
        fail(op, f"a window of at most 256 elements, got {k[0]} x {k[1]}")
    out = torch.ops.aten.max_pool2d_with_indices.default(x, k, s, p, [1, 1], ceil_mode)[0]
    return out, torch.empty_like(out, dtype=torch.uint8)


@torch.library.register_fake("kitsune::max_pool2d_backward_add")
def _(grad, where, adds, input_size, kernel_size, stride, padding, ceil_mode):
    op = "max_pool2d_backward_add"
    size = list(input_size)
    if len(size) != 4:
        fail(op, f"input_size must be (N, C, H, W), got {size}")
    check(op, where.dtype == torch.uint8 and where.dim() == 4 and where.shape[0] == size[0] and
          where.shape[1] == size[1],
          lambda: f"where must be max_pool2d_where's uint8 (N, C, oh, ow) for input {size}, got {where.dtype} "
                  f"{list(where.shape)}")
    if grad is None and not adds:
        fail(op, "no gradient to sum")
    if grad is not None:
        check(op, grad.shape == where.shape and grad.device == where.device,
              lambda: f"grad of shape {list(grad.shape)} on {grad.device} does not match the pooled output's "
                      f"{list(where.shape)} on {where.device}")
    ref = grad if grad is not None else adds[0]
    check_float(op, "grad" if grad is not None else "adds[0]", ref)
    for t in adds:
        check(op, list(t.shape) == size and t.dtype == ref.dtype and t.device == where.device,
              lambda: f"every addend must be {ref.dtype} of the input's shape {size} on {where.device}; got "
                      f"{t.dtype} {list(t.shape)} on {t.device}")
    k, s, p = _max_pool_args(op, ref.new_empty(size, device="meta"), kernel_size, stride, padding, ceil_mode)
    oh, ow = (_pooled(size[2 + i], k[i], s[i], p[i], ceil_mode) for i in range(2))
    check(op, where.shape[2] == oh and where.shape[3] == ow,
          lambda: f"where's {list(where.shape)} is not the pooled size ({oh}, {ow}) of input_size {size}")
    return ref.new_empty(size).contiguous(memory_format=_where_format(where))


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
