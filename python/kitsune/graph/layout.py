"""kitsune.graph.layout: channels-last capture of conv nets.

Whether a model suits cuDNN's NHWC kernels (_nhwc_suits), its Conv2d weights made
channels-last in place with their gradients and optimizer state (_relayout), and the
warm-up step that tries that layout first (_ChannelsLast._warm_up).
"""
import weakref

import torch

from .capture import _describe

# model -> the compile_steps that captured graphs of it: a graph holds the parameters'
# storage, so another compile_step of the same model must not move the weights
_CAPTURED = weakref.WeakKeyDictionary()


class _ChannelsLast:
    """CompiledStep's warm-up and input layout (kitsune.graph.step): channels-last when
    _cl is on (_cl_reason says why or why not), the step run eagerly (_eager) with the
    stream plan's shapes recorded where it can (_shape_recorder)."""

    def _warm_up(self, batch):
        """The first step of a signature, eager. With channels-last on it tries that layout
        first, its Conv2d weights made channels-last; a model that refuses it (a .view()
        needing NCHW strides, say) gets its buffers, the CUDA rng and the weights' layout
        put back, and the step runs NCHW from then on. With a stream plan still to make,
        the forward runs through kitsune.sched.shape_recorder where it can: the shapes the
        plan needs are noted on the way (_plan_streams then skips its run on fake tensors)."""
        run = self._shape_recorder() if not self.dynamo else self._runner()   # Dynamo compiles here
        self._shapes_recorded = run is not None and not self.dynamo   # a step that raises is warmed up again next call
        if self._cl:
            from ..sched import saved_state
            restore = saved_state(self.model)
            held = _graphs_elsewhere(self)
            moved = [] if held else _relayout(_conv_weights(self.model), self.optimizer, torch.channels_last)
            if moved:
                self._cl_reason += f"; {len(moved)} Conv2d weight(s) made channels-last"
            elif held:
                self._cl_reason += f"; Conv2d weights kept as they are ({held} other compile_step(s) hold graphs " \
                                   f"on them)"
            try:
                return self._eager(self._layout(batch), run, rise=True)
            except Exception as e:   # noqa: BLE001 - whatever the model raises on that layout
                restore()
                _relayout(moved, self.optimizer, torch.contiguous_format)
                self._cl, self._cl_reason = False, f"the model refused channels-last input: {_describe(e)}"
        return self._eager(batch, run, rise=True)

    def _layout(self, batch):
        """The batch as the graph takes it: 4-D floating tensors channels-last when that
        is on (cuDNN's convolutions then need no NCHW <-> NHWC transposes)."""
        if not self._cl:
            return batch
        return tuple(b.contiguous(memory_format=torch.channels_last)
                     if isinstance(b, torch.Tensor) and b.dim() == 4 and b.is_floating_point() else b for b in batch)


def _graphs_elsewhere(step):
    """How many other compile_steps of step's model hold captured graphs."""
    return sum(1 for other in _CAPTURED.get(step.model, ()) if other is not step and other._graphs)


def _nhwc_suits(model):
    """(channels-last, why) for channels_last=None: when at least half the model's Conv2d
    layers have channel counts (in and out, per group) that are multiples of 8, the
    vector width of cuDNN's NHWC kernels. LeNet-5 (1 -> 6 -> 16 channels) ran 0.225 ms
    a step channels-last against 0.206 NCHW; ResNet-18 1.456 against 1.853 (H100,
    bench/results/archive/models_cd1ab81.json)."""
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    if not convs:
        return False, "no Conv2d layer"
    aligned = sum(m.in_channels // m.groups % 8 == 0 and m.out_channels // m.groups % 8 == 0 for m in convs)
    why = f"{aligned} of {len(convs)} Conv2d layers have channel counts that are multiples of 8"
    return 2 * aligned >= len(convs), why


def _conv_weights(model):
    """The model's Conv2d weights (4-D Parameters), each once."""
    return list({id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)
                 and isinstance(m.weight, torch.nn.Parameter) and m.weight.dim() == 4}.values())


def _relayout(weights, optimizer, fmt):
    """Lays each weight out in memory format fmt, in place (the same Parameter, the same
    values, as model.to(memory_format=...) does), with its gradient and the optimizer's
    state tensors of its shape; returns those that moved. On channels-last activations
    cuDNN otherwise copies each NCHW weight to NHWC in the forward and its gradient back
    in the backward, every step."""
    state, moved = optimizer.optimizer.state, []
    with torch.no_grad():
        for w in weights:
            if w.is_contiguous(memory_format=fmt):
                continue
            w.data = w.data.contiguous(memory_format=fmt)
            if w.grad is not None:
                w.grad = w.grad.contiguous(memory_format=fmt)
            st = state.get(w, {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == w.shape:
                    st[k] = v.contiguous(memory_format=fmt)
            moved.append(w)
    return moved
