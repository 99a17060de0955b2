"""LayerNorm and RMSNorm: relu(layer_norm(x)) -> layer_norm_relu, layer_norm(a + b) ->
add_layer_norm (the sum kept for its other users), nn.RMSNorm / F.rms_norm -> rms_norm."""
import operator

import torch
import torch.fx as tfx
import torch.nn as nn
import torch.nn.functional as F

from ..match import _attr_or_node, _binary, _module


def _layer_norm(gm, node):
    """(x, shape, weight, bias, eps) when node is nn.LayerNorm or F.layer_norm, else
    None. weight and bias are nodes or None (for a module: the names of its
    parameters, prefixed by "attr:")."""
    if not isinstance(node, tfx.Node):
        return None
    m = _module(gm, node)
    if isinstance(m, nn.LayerNorm):
        has = m.elementwise_affine
        return (node.args[0], tuple(m.normalized_shape), f"attr:{node.target}.weight" if has else None,
                f"attr:{node.target}.bias" if has and m.bias is not None else None, m.eps)
    if node.op == "call_function" and node.target is F.layer_norm:
        args = list(node.args) + [None] * 5
        kw = node.kwargs
        shape = kw.get("normalized_shape", args[1])
        eps = kw.get("eps", args[4] if args[4] is not None else 1e-5)
        shape = tuple(shape) if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape) else None
        return args[0], shape, kw.get("weight", args[2]), kw.get("bias", args[3]), eps
    return None


def _add_layer_norm(a, b, weight, bias, eps):
    """add_layer_norm when the operands allow it (one shape after broadcasting, one
    dtype), else the unfused add and layer_norm: (a + b, layer_norm(a + b)). An operand
    that broadcasts to the other's shape (GPT's position table added to every
    sequence's token embeddings) is expanded, which the op copies once: that copy and
    the fused kernels cost less than ATen's add and LayerNorm each way, and autograd
    sums its gradient back to its shape as it would for the add."""
    from ... import ops as ko
    if a.shape != b.shape and a.dim() and b.dim():
        try:
            shape = torch.broadcast_shapes(a.shape, b.shape)
        except RuntimeError:
            shape = None
        if shape == a.shape:
            b = b.expand(shape)
        elif shape == b.shape:
            a = a.expand(shape)
    # under autocast the op's autocast kernel casts mixed dtypes itself
    cast = torch.is_autocast_enabled(a.device.type)
    same = a.shape == b.shape and a.dim() >= 1 and (cast or (a.dtype == b.dtype and all(
        p is None or p.dtype == a.dtype for p in (weight, bias))))
    if same and (a.device.type == "cpu" or a.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return ko.add_layer_norm(a, b, weight, bias, eps)
    h = a + b
    return h, F.layer_norm(h, (h.shape[-1],), weight, bias, eps)


def _rewrite_add_layer_norm(gm, g, node, where, report):
    """layer_norm(a + b) with a + b kept for its other users."""
    ln = _layer_norm(gm, node)
    if ln is None:
        return False
    x, shape, w, b, eps = ln
    bin_ = _binary(x, "add")
    if not bin_:
        return False
    a, c, why = bin_
    if why:
        report.left.append((where, f"layer_norm(a + b): {why}"))
        return True
    if shape is None or len(shape) != 1:
        report.left.append((where, "layer_norm(a + b) over more than the last dimension"))
        return True
    order = {n: i for i, n in enumerate(g.nodes)}
    if any(isinstance(v, tfx.Node) and order[v] > order[x] for v in (w, b)):
        report.left.append((where, "layer_norm(a + b): its weight or bias is computed after the add"))
        return True
    report.fused.append((where, f"layer_norm(a + b) -> add_layer_norm ({x.name}; one shape and dtype checked at run time)"))
    with g.inserting_before(x):
        wn, bn = _attr_or_node(g, w), _attr_or_node(g, b)
        pair = g.call_function(_add_layer_norm, (a, c, wn, bn, float(eps)))
        h = g.call_function(operator.getitem, (pair, 0))
        y = g.call_function(operator.getitem, (pair, 1))
    for new, old in ((y, node), (h, x)):   # Dynamo's example values, for later patterns' shape checks
        if "example_value" in old.meta:   # (the shape is the same; under autocast the dtype may not be)
            new.meta["example_value"] = old.meta["example_value"]
    node.replace_all_uses_with(y)
    g.erase_node(node)
    x.replace_all_uses_with(h)
    g.erase_node(x)
    return True


def _rewrite_relu_layer_norm(gm, g, node, act, where, report):
    """relu(layer_norm(x)) -> layer_norm_relu."""
    from ... import ops as ko
    kind, inner, _ = act
    ln = _layer_norm(gm, inner) if kind == "relu" else None
    if ln is None:
        return False
    x, shape, w, b, eps = ln
    if len(inner.users) != 1:
        report.left.append((where, f"relu(layer_norm): {inner.name} is also used elsewhere"))
    elif shape is None:
        report.left.append((where, "relu(layer_norm): normalized_shape computed in the graph"))
    else:
        report.fused.append((where, f"relu(layer_norm) -> layer_norm_relu ({inner.name})"))
        with g.inserting_before(node):
            new = g.call_function(ko.layer_norm_relu, (x, list(shape), _attr_or_node(g, w),
                                                       _attr_or_node(g, b), float(eps)))
        node.replace_all_uses_with(new)
        g.erase_node(node)
        g.erase_node(inner)
    return True


def _rewrite_rms_norm(gm, g, node, where, report):
    """nn.RMSNorm / F.rms_norm / torch.rms_norm with a weight and an eps -> rms_norm."""
    from ... import ops as ko
    m = _module(gm, node)
    is_fn = node.op == "call_function" and node.target in (F.rms_norm, torch.rms_norm)
    if not (isinstance(m, nn.RMSNorm) or is_fn):
        return False
    if m is not None:
        shape, weight, eps = tuple(m.normalized_shape), m.weight, m.eps
    else:
        args = list(node.args) + [None] * 4
        shape = node.kwargs.get("normalized_shape", args[1])
        weight = node.kwargs.get("weight", args[2])
        eps = node.kwargs.get("eps", args[3])
        shape = tuple(shape) if isinstance(shape, (list, tuple)) else None
    if shape is None or len(shape) != 1:
        report.left.append((where, "rms_norm over more than the last dimension"))
    elif weight is None:
        report.left.append((where, "rms_norm without a weight"))
    elif eps is None:
        report.left.append((where, "rms_norm with eps=None (it depends on the input's dtype)"))
    else:
        report.fused.append((where, "rms_norm -> kitsune.rms_norm"))
        with g.inserting_before(node):
            w = g.get_attr(f"{node.target}.weight") if m is not None else weight
            new = g.call_function(ko.rms_norm, (node.args[0], w, float(eps)))
        node.replace_all_uses_with(new)
        g.erase_node(node)
    return True


# ---- Hugging Face's RMSNorm, written out (LlamaRMSNorm and the models that copy it) ----
#   x32 = x.to(torch.float32)
#   y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
#   out = weight * y.to(x.dtype)          (or y.to(x.dtype) * weight)

def _hf_rms_norm(x, weight, eps, dtype):
    """weight * (x32 * rsqrt(mean(x32^2, -1) + eps)).to(dtype), x32 = x in float32, as HF's
    RMSNorm computes it, through kitsune.rms_norm where the result is x's dtype (dtype and
    the weight's are x's; rounded once instead of twice), else the same ops as written."""
    from ... import ops as ko
    if (isinstance(weight, torch.Tensor) and dtype == x.dtype and weight.dtype == x.dtype and weight.dim() == 1
            and x.dim() >= 1 and weight.shape[0] == x.shape[-1]
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return ko.rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _method_or_fn(node, name, fn=None):
    """Whether node is x.<name>(...) or fn(x, ...)."""
    return isinstance(node, tfx.Node) and ((node.op == "call_method" and node.target == name) or
                                           (fn is not None and node.op == "call_function" and node.target is fn))


def _to_dtype(node):
    """(tensor, dtype) for node = t.to(dtype) (dtype a torch.dtype or a node), else None."""
    if not (_method_or_fn(node, "to") and len(node.args) == 2 and not node.kwargs):
        return None
    return node.args[0], node.args[1]


def _hf_rms_chain(y):
    """(x, eps) when y is x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) with x32 =
    x.to(torch.float32) read by nothing else, every inner node read once; else None."""
    ab = _binary(y, "mul")
    if not ab or ab[0] is None:
        return None
    for x32, r in (ab[:2], ab[1::-1]):
        if not (_method_or_fn(r, "rsqrt", torch.rsqrt) and len(r.args) == 1 and len(r.users) == 1):
            continue
        add = r.args[0]
        if not (isinstance(add, tfx.Node) and add.op == "call_function" and add.target in (operator.add, torch.add)
                and len(add.args) == 2 and not add.kwargs and len(add.users) == 1):
            continue
        mean, eps = add.args if isinstance(add.args[0], tfx.Node) else add.args[::-1]
        if not (isinstance(eps, float) and _method_or_fn(mean, "mean", torch.mean) and len(mean.users) == 1):
            continue
        dims = list(mean.args[1:]) + [mean.kwargs.get("dim")]
        keep = mean.kwargs.get("keepdim", mean.args[2] if len(mean.args) > 2 else False)
        if not (dims[0] in (-1, (-1,), [-1]) and keep is True):
            continue
        p = mean.args[0]
        if not (_method_or_fn(p, "pow", torch.pow) and len(p.args) == 2 and p.args[1] == 2 and p.args[0] is x32
                and len(p.users) == 1):
            continue
        cast = _to_dtype(x32)
        if cast is None or cast[1] is not torch.float32 or len(x32.users) != 2:
            continue
        return cast[0], eps, (y, r, add, mean, p, x32)
    return None


def _rewrite_hf_rms_norm(gm, g, node, where, report):
    """weight * rms(x).to(dtype), Hugging Face's RMSNorm written out -> rms_norm (through
    _hf_rms_norm, which keeps the ops where the dtypes differ)."""
    ab = _binary(node, "mul")
    if not ab or ab[0] is None:
        return False
    for w, t in (ab[:2], ab[1::-1]):
        cast = _to_dtype(t)
        if cast is None or len(t.users) != 1 or not isinstance(cast[0], tfx.Node) or len(cast[0].users) != 1:
            continue
        found = _hf_rms_chain(cast[0])
        if found is None:
            continue
        x, eps, chain = found
        dtype = cast[1]
        # x.dtype read for the cast back: the node is x's getattr, or a dtype Dynamo wrote in
        if isinstance(dtype, tfx.Node) and not (dtype.op == "call_function" and dtype.target is getattr
                                                and dtype.args == (x, "dtype")):
            continue
        report.fused.append((where, "HF RMSNorm (pow, mean, rsqrt, weight) -> kitsune.rms_norm"))
        with g.inserting_before(node):
            new = g.call_function(_hf_rms_norm, (x, w, eps, dtype))
        node.replace_all_uses_with(new)
        g.erase_node(node)
        for n in (t,) + chain:
            g.erase_node(n)
        return True
    return False
