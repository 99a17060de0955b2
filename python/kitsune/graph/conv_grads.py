"""kitsune.graph.conv_grads: which way compile_step runs a streamed model's convolution
gradients (kitsune.sched.conv_grads: together, apart or late), measured by timing the
forward and backward captured each way, or as KITSUNE_CONV_GRADS asks.
"""
import math

import torch

_TRIAL_BLOCK_MS = 3.0   # _time_trial's blocks: about this long (2 to 10 replays)
_CONV_GRAD_WAYS = ("together", "apart", "late")   # _choose_conv_grads' order: the later, the more streams and memory


class _ConvGradTrials:
    """CompiledStep's choice of the convolutions' gradient way (kitsune.graph.step): on
    its captured model's streams (_captured._kitsune_streams), by trial captures
    (_capture, on _side); the choice in _conv_grads."""

    def _choose_conv_grads(self, args):
        """How the captured model's bias-free convolutions run their weight gradient
        (kitsune.sched.conv_grads._ConvGradsApart): "together" with the input gradient,
        "apart" on a side stream joined in the node, or "late", joined at the end of the
        backward (see kitsune.sched.conv_grads_mode). With KITSUNE_CONV_GRADS unset, measured: the
        forward and backward alone are captured each way into a pool of their own,
        replayed twice (the first uploads the graph, the second sizes the blocks), then
        timed as the best of 3 blocks of 2 to 10 replays, each about 3 ms (CUDA events
        on the capture stream; until 5ef92da 3 + 3 x 10 replays, which took 0.19 s of
        ResNet-18's setup for three ways at ff46ff7), and dropped before the next; the model's buffers and the
        CUDA generator are put back after. A way is kept over the one before it in that
        order only when it is at least 1% faster (a near tie keeps fewer streams and
        less memory held); "late" is not tried when no convolution joined late in its
        trial. Under planned memory _capture_planned may still refuse "late"
        (_late_over_budget). Setup took 0.24 s instead of 0.11 for the branchy net at
        batch 8 and 0.33 s instead of 0.13 at batch 64 with two ways (H100,
        models_dd35b59.json against models_cae1b3e.json, in one process after the stock
        recipe, which had already paid the process's first-use costs)."""
        from .. import sched
        n = sched.conv_grad_splits(self._captured)
        if n == 0:
            return
        mode, ctx = sched.conv_grads_mode(), self._captured._kitsune_streams
        if mode != "auto":
            self._set_conv_grads(mode)
            self._conv_grads = {"convs": n, "apart": ctx.grads_apart, "late": ctx.grads_late, "how": mode}
            return
        restore, ms = sched.saved_state(self.model), {}
        try:
            for way in _CONV_GRAD_WAYS:
                self._set_conv_grads(way)
                t = self._time_trial(args)
                if way != "late" or self._late_kept():   # some weight gradient joined late in its trial
                    ms[way] = t
        finally:
            restore()
            self._set_conv_grads("together")
        self._set_conv_grads(_fastest_way(ms))
        self._conv_grads = {"convs": n, "apart": ctx.grads_apart, "late": ctx.grads_late, "how": "measured",
                            "ms": ms}

    def _set_conv_grads(self, way, late_limit=None):
        ctx = self._captured._kitsune_streams
        ctx.grads_apart, ctx.grads_late, ctx.late_limit = way != "together", way == "late", late_limit

    def _late_kept(self):
        """The bytes each late join of the last capture kept to the backward's end."""
        ctx = getattr(self._captured, "_kitsune_streams", None)
        return ctx.late_kept if ctx is not None else []

    def _time_trial(self, args):
        """ms per replay of the forward and backward captured as the model now stands
        (see _choose_conv_grads)."""
        graph = self._capture(args, torch.cuda.graph_pool_handle(), update=False)[0]
        torch.cuda.synchronize(self._side.device)   # the static inputs were copied on the caller's stream
        with torch.cuda.stream(self._side):
            graph.replay()   # the first replay uploads the graph
            n = min(10, max(2, math.ceil(_TRIAL_BLOCK_MS / max(_replay_ms(graph, 1), 1e-3))))
            best = min(_replay_ms(graph, n) for _ in range(3))
        del graph   # its pool goes back to the device's pool
        return best


def _replay_ms(graph, n):
    """ms per replay of n replays of graph on the current stream (CUDA events)."""
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(n):
        graph.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / n


def _fastest_way(ms):
    """Of the ways timed in ms (way -> ms, "together" always), the one kept: each later way
    only when at least 1% faster than the best before it."""
    best = "together"
    for way in _CONV_GRAD_WAYS[1:]:
        if way in ms and ms[way] < 0.99 * ms[best]:
            best = way
    return best
