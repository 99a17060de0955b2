"""kitsune.optimize / kitsune.explain: rewrite a model's FX graph to Kitsune's fused ops.

The eager path, and ``torch.compile(model, backend="kitsune")`` (importing
kitsune.fx registers the backend; see :func:`kitsune_backend`). ``optimize(model)`` traces the
model with torch.fx, rewrites every pattern below whatever its spelling, and makes each
module it rewrote run the rewritten graph with the same outputs (within the ops'
tolerance). It never breaks a model: a module that does not trace, or whose traced graph
would freeze what its forward decides at run time (a branch on self.training, on an
optional argument being None, an in-place change of a buffer, a hooked submodule), is
left as it is and its children are tried one by one; a module where nothing fused is not
touched; a rewritten one stays the same object with its attributes, methods, parameters
and buffers in their order (its class swapped for a subclass of its own and of
GraphModule). ``explain(model)`` runs the same matching without changing anything and
reports what would be fused and what was left, with the reason.

Patterns (each intermediate must have no other user, so nothing observable is lost):
  relu(a + b)              -> kitsune.add_relu(a, b)
  tanh(a * b)              -> kitsune.mul_tanh(a, b)
  gelu(linear(x))          -> kitsune.bias_gelu(linear(x, W), bias)   (nn.Linear or F.linear with a bias;
                              tanh GELU: kitsune.linear_act(x, W, bias, "gelu_tanh"))
  gelu(x + bias)           -> kitsune.bias_gelu(x, bias)              (bias a 1-D parameter)
  silu(g) * u, u * silu(g) -> kitsune.swiglu(g, u)
  nn.RMSNorm / F.rms_norm  -> kitsune.rms_norm(x, weight, eps)        (with a weight and an eps)
  relu(layer_norm(x))      -> kitsune.layer_norm_relu(x, shape, weight, bias, eps)
  layer_norm(a + b)        -> kitsune.add_layer_norm(a, b, weight, bias, eps), the sum
                              kept for its other users (the residual stream); over the
                              last dim; at run time, operands of different shapes or
                              dtypes take the unfused path
  cross_entropy(linear(x)) -> kitsune.linear_cross_entropy(x, W, target, bias): the
                              logits never exist; also through .view/.reshape(-1, C),
                              with C spelled as logits.size(-1); weight=None and
                              reduction="mean" only
  cross_entropy(logits)    -> kitsune.cross_entropy (2-D logits at run time)
  relu(linear(x))          -> kitsune.linear_act(x, W, b, "relu") (a Linear with a bias)
  linear(x), any other     -> kitsune.linear_act(x, W, b, "none") (a Linear with a bias that no
                              pattern above took; optimize only, not the torch.compile
                              backend, where Inductor fuses the bias gradient's sum itself):
                              F.linear's forward, the bias gradient by Kitsune's column sum
  relu(BatchNorm(x))       -> kitsune.batch_norm_relu (nn.BatchNorm1d/2d/3d; the
                              module's mode, momentum and running stats read at run time)
  relu(BatchNorm(x) + r)   -> kitsune.batch_norm_add_relu (as above; r of x's shape and dtype at
                              run time, else the unfused ops; before relu(a + b) -> add_relu):
                              a ResNet block's end, the normalized values never stored
  BatchNorms' batch counts -> one torch._foreach_add_ of their num_batches_tracked, before
                              the first (two or more nn.BatchNorm1d/2d/3d, each called once,
                              with a momentum; optimize only): one launch where there was one
                              a module
  [relu](Conv2d(x))        -> kitsune.channel_bias(F.conv2d(x, W, None, ...), b, "relu" | "none")
                              (an nn.Conv2d with a bias and zeros padding; the ReLU when it
                              is the convolution's only user): the bias gradient's sum in
                              two stages instead of ATen's one
  max_pool2d(relu(Conv2d(x)))  -> kitsune.bias_relu_pool(F.conv2d(x, W, None, ...), b, k)
                              (the same, when the ReLU's only user is a max pooling over
                              non-overlapping k windows: stride k or None, no padding or
                              dilation, floor mode, no indices; F.max_pool2d,
                              torch.max_pool2d or nn.MaxPool2d)
  cat([channel_bias(y_i, b_i)], d) -> kitsune.bias_cat([y_i], [b_i], d) (each part a Conv2d's
                              bias, as above, used only by the torch.cat: an Inception block's
                              branches; one kernel over the channels of batched parts)
  max_pool2d(x), any other  -> kitsune.max_pool2d(x, k, stride, padding, ceil_mode) (dilation 1,
                              no indices; optimize only, not the torch.compile backend, where
                              Inductor fuses the pooling with its neighbours): a byte per
                              output saved for a gather backward, where ATen saves int64
                              indices
                              Where x has other users (none writing it in place):
                              kitsune.max_pool2d_branches(x, n, ...), whose views of x those
                              users take: their gradients are added in the pooling's backward
                              pass (an Inception block's input: 3 adds a block otherwise)
  nn.Embedding / F.embedding  -> kitsune.embedding(idx, W, padding_idx) (no max_norm,
                              scale_grad_by_freq or sparse; optimize only): on CUDA the weight
                              gradient by a radix sort over the vocabulary's bits and a block
                              per run of equal indices, where ATen sorts all 64 bits
  x.mean((2, 3)), adaptive_avg_pool2d(x, 1)  -> kitsune.global_avg_pool(x, dim, keepdim) (dim (2, 3)
                              or (-2, -1), no dtype; F.adaptive_avg_pool2d, nn.AdaptiveAvgPool2d
                              with output size 1; optimize only): on CUDA for channels-last
                              maps one kernel each way and no workspace, where ATen's strided
                              reduction stages partial sums in a buffer twice the map's size
  (q @ k^T) * s, (q @ k^T) / s   -> kitsune.attention_score(q, k, scale) (s a Python
                              number; k^T as k.transpose(-2, -1) or k.mT; one GEMM
                              with the scale as alpha; unfused for broadcast batches)
  r + dropout(linear(x))   -> kitsune.bias_dropout_add(F.linear(x, W), b, r, p, training)
                              (Linear with a bias; nn.Dropout's p and training read
                              at run time; unfused for other shapes, dtypes or autocast)
  dropout(gelu(x))         -> kitsune.gelu_dropout(x, p, training, approximate) (before
                              gelu(linear(x)) -> bias_gelu: the Linear keeps its bias in
                              the GEMM, and one pass does GELU and dropout)
While a CUDA graph is being captured (kitsune.compile_step), the dropout rewrites run
their unfused ATen form: its random numbers follow the graph's generator state, which
the fused kernels' host-side (seed, offset) cannot.
Spellings: modules (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.LayerNorm, in-place too), functions
(F.relu, torch.relu, F.gelu, F.silu, torch.tanh, ...), methods (x.relu(), x.tanh(),
x.relu_(), ...), and + / torch.add / x.add(...) / += (an in-place add only when
nothing else reads the operand it overwrites).

Layout: engine.py walks the model (module by module where a module is not rewritten as a
whole), tries each node against the rewrites of patterns/<family>.py in the order of its
tables and returns the Report; trace.py traces and decides whether a graph may stand for
its module; adopt.py makes a rewritten module run its graph; match.py holds the matchers
every pattern shares; backend.py the torch.compile backend.
"""
from .backend import _register_backend, kitsune_backend
from .engine import Report, explain, optimize
from .match import _attr  # noqa: F401 - kitsune.sched reads get_attr targets with it
from .patterns.loss import FusedLoss

__all__ = ["optimize", "explain", "Report", "FusedLoss", "kitsune_backend"]


def __getattr__(name):
    if name == "last_compile_report":   # the Report of the last graph the backend compiled
        from . import backend
        return backend.last_compile_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register_backend()
