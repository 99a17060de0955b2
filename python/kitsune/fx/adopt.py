"""What kitsune.optimize leaves where it rewrote a module: the module itself, its class
swapped for a subclass of its own class and of torch.fx.GraphModule whose forward is the
rewritten graph's code.

Why not a fresh GraphModule (what optimize returned before): GraphModule(root, graph)
copies only what the graph reads, in the order it reads it, and rebuilds the module tree
from plain nn.Modules; the rest of the model then found a `Dropout` without `p` and a
`LayerNorm` without `eps`, parameters in another order (an optimizer state saved against
the original loaded onto the wrong tensors) and no methods of the original class. Swapping
the class in place keeps everything the rest of the model or the user may read, because
nothing else changes: the same object (other references to it stay valid), its __dict__
(plain attributes, hooks, parameters, buffers and children in their order, so
named_parameters(), named_buffers() and state_dict() are the original's), the original
class's methods (isinstance holds, a train() override still runs), and children that
the graph inlines stay registered, unused by the forward but there to be read and saved.
Being a GraphModule too keeps what kitsune.sched and compile_step read of one (graph,
code, the Interpreter over the graph).

The class is made per instance, as GraphModule makes one per instance, since recompile()
sets forward on the class. Tensors the trace found as constants (torch.fx's
`_tensor_constant<i>`) become plain attributes, listed in `_kitsune_constants` and moved
by .to()/.cuda()/.half() with the parameters; they are not buffers, so that
named_buffers() and state_dict() stay the original's."""
import copy
import types

import torch.fx as tfx
import torch.nn as nn

# What GraphModule keeps in an instance's __dict__ (set by adopt; recompile adds _code and the rest).
_GM_STATE = ("_graph", "_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec", "_tracer_cls",
             "_tracer_extras", "meta", "_replace_hooks", "_create_node_hooks", "_erase_node_hooks",
             "_deepcopy_hooks", "shape_env", "_kitsune_constants")
# Names a GraphModule defines that the original class's own must not be hidden by.
_GM_NAMES = ({k for k in vars(tfx.GraphModule) if not (k.startswith("__") and k.endswith("__"))} |
             set(_GM_STATE)) - {"_replicate_for_data_parallel"}


class Rewritten(tfx.GraphModule):
    """The base of every class optimize swaps in (see the module's doc): deepcopy, copy
    and pickling keep the original's whole __dict__ (GraphModule's own rebuild would keep
    only what its graph reads); a pickle holds the original class and state and rewrites
    again when loaded (the original module where that fails)."""
    _kitsune_base = nn.Module   # the original class

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for k in self.__dict__.get("_kitsune_constants", ()):
            self.__dict__[k] = fn(self.__dict__[k])
        return self

    def __deepcopy__(self, memo):
        res = object.__new__(rewritten_class(self._kitsune_base))
        memo[id(self)] = res
        for k, v in self.__dict__.items():
            if k != "_graph":
                res.__dict__[k] = copy.deepcopy(v, memo)
        res.graph = copy.deepcopy(self._graph, memo)
        return res

    def __copy__(self):
        res = object.__new__(rewritten_class(self._kitsune_base))
        res.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_graph"})
        res.graph = copy.deepcopy(self._graph)
        return res

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k not in _GM_STATE and k not in self.__dict__.get("_kitsune_constants", ())}
        return (_restore, (self._kitsune_base, state))

    _replicate_for_data_parallel = nn.Module._replicate_for_data_parallel


def rewritten_class(base):
    """A fresh subclass of Rewritten and `base` (named as `base`, so the model prints as
    before)."""
    ns = {"__module__": __name__, "__qualname__": base.__qualname__, "_kitsune_base": base}
    return types.new_class(base.__name__, (Rewritten, base), {}, lambda d: d.update(ns))


def base_class(module):
    """The class a module had before optimize (a GraphModule's per-instance class: GraphModule)."""
    cls = type(module)
    if issubclass(cls, Rewritten):
        return cls._kitsune_base
    if issubclass(cls, tfx.GraphModule):
        return tfx.GraphModule
    return cls


def clash(module):
    """The name of an attribute of module (or of its class) that the GraphModule base
    would hide, or None."""
    base = base_class(module)
    if issubclass(base, tfx.GraphModule):
        return None
    own = set() if isinstance(module, Rewritten) else set(module.__dict__)
    for name in sorted(_GM_NAMES):
        if name in own or any(name in vars(c) for c in base.__mro__ if c not in (nn.Module, object)):
            return name
    return None


def adopt(module, gm, constants):
    """Makes `module` run gm's graph (traced from module: its targets are module's own
    paths): its class swapped for rewritten_class(its class), the tensors the trace took
    as constants stored on it."""
    module.__class__ = rewritten_class(base_class(module))
    d = module.__dict__
    for k in _GM_STATE:
        d.pop(k, None)
    for k in d.get("_kitsune_constants", ()):
        d.pop(k, None)
    d.update(constants)
    d.update(_kitsune_constants=tuple(constants), _tracer_cls=None, _tracer_extras={}, meta={}, _replace_hooks=[],
             _create_node_hooks=[], _erase_node_hooks=[], _deepcopy_hooks=[], shape_env=None)
    module.graph = gm.graph   # its owner now module; recompile() sets the class's forward
    return module


def _restore(base, state):
    """Unpickles a rewritten module: the original's state under its class, rewritten again
    as optimize would (left as the original where that fails)."""
    module = base.__new__(base)
    module.__dict__.update(state)   # a plain module again: _walk rewrites it afresh
    from .engine import Report, _walk
    try:
        _walk(module, Report(), "", apply=True, children=False)
    except Exception:   # noqa: BLE001 - the original module is a correct answer
        pass
    return module
