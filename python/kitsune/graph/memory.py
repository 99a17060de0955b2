"""kitsune.graph.memory: a captured step's memory laid out by Kitsune's allocator.

The step is captured while the allocator records its allocations, the recorded
lifetimes are planned into one arena within a budget (the eager step's rise), and the
step is captured again laid out by the plan (kitsune/capplan.h). Weight gradients that
join late (kitsune.sched.conv_grads) hold tensors longer: where the plan with them
passes the budget, fewer join late, or none.
"""
import contextlib

import torch

from .. import options
from .capture import _NodeTimer, _describe
from .conv_grads import _fastest_way


class _MemoryPlanning:
    """CompiledStep's planned memory (kitsune.graph.step): its budget from the warm-up
    (_eager_rise, _inputs_bytes), the recordings and plans (_capture, _phase,
    _capture_parts, _pool, _graphs), the late joins' limits (_conv_grads,
    _set_conv_grads, _late_kept); stats()["memory_plan"] from _memory."""

    def _eager_budget(self):
        """Bytes a graph may take beside what the eager step keeps between steps: the
        warm-up's rise (_eager) less the graph's static inputs (which an eager step does
        not copy); None before a warm-up. Before 29cc25d it was the device's peak
        after the warm-up less what was allocated at the capture, which a first
        optimizer update (its state made then, and kept) shrank to about the gradients'
        bytes: in bench/models.py's fresh process ResNet-18's budget was 43.8 MiB (its
        eager step rises 103.4 MiB in graph_memory_resnet18_split_a09cec9.json), its
        plan bought 23 waits, and its step took 1.391 ms against 1.177 unplanned (H100,
        bench/results/archive/models_planned_mode_b_60f753b.json)."""
        if self._eager_rise is None:
            return None
        return max(self._eager_rise - self._inputs_bytes, 0)

    def _held_budget(self, floor=None):
        """_eager_budget raised to `floor` (bytes; None: none): where no layout meets the
        budget, the plan without late joins (_planned_layout)."""
        budget = self._eager_budget()
        return budget if budget is None or floor is None else max(budget, floor)

    def _plan_budget(self, floor=None):
        """The memory plan's budget: _held_budget(floor), or None with KITSUNE_PLAN_WAITS=0."""
        return None if options.get("KITSUNE_PLAN_WAITS") == "0" else self._held_budget(floor)

    def _late_measured(self):
        """Whether the weight gradients join late because the trial measured it fastest
        (not asked for: KITSUNE_CONV_GRADS=late is kept whatever its plan takes)."""
        info = self._conv_grads
        return bool(info and info.get("late") and info.get("how") == "measured")

    def _late_over_budget(self, plan_bytes, kept=(), floor=None):
        """Whether the recorded plan of a step whose weight gradients join late takes more
        than the budget (_eager_budget): "late" holds each convolution's input and
        output gradient past its node (until aa6c5bd to the backward's end: the branchy
        net at batch 64, a plan of 472.4 MiB against 345.4 apart; ResNet-18 at batch
        128, 108.6 against a budget of 100.5, graph_memory_resnet18_split_a09cec9.json;
        since, let go at the node, as long as the plan's order or waits keep their
        bytes from later blocks: _late_lets_go). `kept`: the bytes each late
        join of the recorded capture kept. Then fewer join late: those keeping the most
        are left out until they add up to the excess (_late_limit), and compile_step
        records and plans again (stats()["conv_grads"]["late_limited"] says so); when
        none would be left, it captures the way measured next fastest
        (["late_refused"]). `floor`: where no layout meets the budget, the plan of that
        way's recording (_planned_layout), which the late joins are held to instead."""
        if not self._late_measured():
            return False
        info, budget, target = self._conv_grads, self._eager_budget(), self._held_budget(floor)
        if target is None or plan_bytes <= target:
            return False
        over = (f"the plan with late joins ({plan_bytes / 2**20:.1f} MiB) exceeds the budget ({budget / 2**20:.1f} MiB: "
                f"the eager forward and backward's rise, {self._eager_rise / 2**20:.1f} MiB, less the graph's "
                f"inputs)" + (f" and the plan without them ({floor / 2**20:.1f} MiB)" if target > budget else ""))
        limit = _late_limit(kept, plan_bytes - target)
        if limit is not None:
            self._set_conv_grads("late", limit)
            info.update(late_limit=limit, late_limited=f"{sum(k <= limit for k in kept)} of {len(kept)} late joins "
                                                       f"kept (those holding at most {limit / 2**20:.2f} MiB): {over}")
            return True
        way = self._way_without_late()
        self._set_conv_grads(way)
        for k in ("late_limit", "late_limited"):
            info.pop(k, None)
        info.update(apart=way == "apart", late=False, late_refused=over)
        return True

    def _way_without_late(self):
        """The way measured fastest after "late" (what a refused "late" becomes)."""
        return _fastest_way({k: v for k, v in self._conv_grads["ms"].items() if k != "late"})

    def _late_unmeetable(self, info):
        """Whether no layout of a recorded plan (its info) of a step whose weight
        gradients join late (as measured) can meet the budget: the most bytes live at
        once in the recording (no plan is smaller) pass it."""
        budget = self._eager_budget()
        return self._late_measured() and budget is not None and info["peak_bytes"] > budget

    def _capture_planned(self, args, device):
        """Captures the step into a pool of its own while Kitsune's allocator records the
        allocations, plans their layout from the recorded lifetimes, drops that graph,
        and captures the step again into the step's pool, laid out by the plan
        (kitsune/capplan.h). stats()["memory_plan"] says how it went."""
        from .. import allocator
        dev = device.index if device.index is not None else torch.cuda.current_device()
        # the recording sees when a late join's side stream last reads what it let go
        ctx = getattr(self._captured, "_kitsune_streams", None)
        with _late_lets_go(ctx):
            mplan = self._planned_layout(args, dev, ctx)
            if mplan is None:
                return self._capture(args, self._pool)
            placer = allocator._placer_stats(self._pool, dev)
            if placer and mplan.info["arena_bytes"] > placer["arena_bytes"] and self._graphs:
                # a larger arena: the graphs laid out in the old one would keep it alive
                self._n["evictions"] += len(self._graphs)
                self._graphs.clear()
                self._held_pool()
            allocator._place_capture(self._pool, mplan, dev)
            with self._phase("place", self._capture_parts):
                out = self._capture(args, self._pool)
            placer = allocator._placer_stats(self._pool, dev) or {}
            self._memory = dict(mplan.info, **{k: placer.get(k) for k in ("placed", "refused", "status", "waits")},
                                pool_arena_bytes=placer.get("arena_bytes"), node_times=self._node_times)
            return out

    def _recording(self, args, dev):
        """One capture of the step recorded by Kitsune's allocator, the graph dropped: its
        allocator.CaptureRecording, or None when host memory ran out."""
        from .. import allocator
        with self._phase("record", self._capture_parts):
            first = torch.cuda.graph_pool_handle()
            allocator._record_capture(first, dev)
            timer = self._node_timer()
            graph, loss, _ = self._capture(args, first, timer=timer)
            del loss   # what is still live when planned is left out of the plan
            try:
                rec = allocator._take_recording(first, dev)
                self._node_times = timer.note if timer is not None else None
                if timer is not None and timer.times is not None:
                    rec.set_times(*timer.times)
                return rec
            except RuntimeError as e:   # host memory
                return self._not_planned(e)
            finally:
                del graph   # its pool goes back to the device's pool

    def _node_timer(self):
        """A _NodeTimer for the next recording with KITSUNE_PLAN_WAITS=timed, where its
        plan may buy waits between streams (several streams, a budget) and the replay
        can leave the update out (no loss scaling: its scaler's state is updated
        outside the optimizer's launches); else None. Not the default: by times the
        plan took the branchy net at batch 8 to 0.482 ms a step in one process of three
        (0.434-0.436 in the others and by recorded events), while ResNet-18 gained
        (1.234-1.242 ms against 1.265; H100, models_variants_timed_17f224d.json)."""
        if options.get("KITSUNE_PLAN_WAITS") != "timed" or self.optimizer.enable_amp:
            return None
        if self._stream_info.get("streams", 1) < 2 or self._eager_budget() is None:
            return None
        return _NodeTimer(self.model, self._side)

    def _plan(self, rec, floor=None):
        """rec's plan within _plan_budget(floor); None when host memory ran out."""
        try:
            with self._phase("plan", self._capture_parts):
                return rec.plan(self._plan_budget(floor))
        except RuntimeError as e:   # host memory
            return self._not_planned(e)

    def _not_planned(self, e):
        """None, the step captured as without a plan, stats()["memory_plan"] saying why."""
        self._memory = {"reason": f"not planned: {_describe(e)}"}
        return None

    def _planned_layout(self, args, dev, ctx):
        """The plan the step's capture is laid out by (None: capture it unplanned),
        recorded as many times as its late joins take (_late_over_budget). Where no
        layout can meet the budget (_late_unmeetable: ResNet-18 in bench/models.py's
        process, a live peak of 86.8 MiB against a budget of 86.1; H100,
        models_planned_mode_b_fd66c6b.json), the way without late joins is recorded
        once, and the late joins are held to its plan instead (`floor`): the same
        recording is planned again within it, the waits that bring it there bought, and
        no more joins are cut than that needs. Until then they were cut to the
        unmeetable budget, round after round, to none: "apart" planned 88.6 MiB and
        took 1.277 ms a step, against 1.182 with every join late and the plan left
        over budget (H100, models_variants_aa6c5bd.json). Held to apart's plan
        instead, all 19 joined late with 27 waits in 87.9 MiB: 1.253 ms a step, setup
        1.00 s, when the late way was still recorded a second time to plan it within
        the floor (H100, models_planned_mode_b_371ca73.json); planned again from the one
        late recording, with the packer of 86f463a, its capture phase took 0.094 s
        and its setup 0.93 s (H100, models_planned_mode_b_490cc04.json). Where "late" is
        refused after that, the plan recorded without them is the one laid out."""
        floor = without = rec = None
        while True:
            if rec is None:
                rec = self._recording(args, dev)
                if rec is None:
                    return None
                kept, limit = self._late_kept(), ctx.late_limit if ctx is not None else None
            mplan = self._plan(rec, floor)
            if mplan is None:
                return None
            if floor is None and self._late_unmeetable(mplan.info):
                self._set_conv_grads(self._way_without_late())
                other = self._recording(args, dev)
                without = other and self._plan(other)
                del other
                self._set_conv_grads("late", limit)
                if without is None:
                    return None
                floor = without.info["plan_bytes"]
                self._conv_grads["late_held_to"] = (
                    f"the plan without late joins ({floor / 2**20:.1f} MiB): the recording's live peak "
                    f"({mplan.info['peak_bytes'] / 2**20:.1f} MiB) passes the budget "
                    f"({self._eager_budget() / 2**20:.1f} MiB)")
                if mplan.info["plan_bytes"] > floor:
                    continue   # the late recording planned again, within the floor
            if not self._late_over_budget(mplan.info["plan_bytes"], kept, floor):
                return mplan
            rec = None   # fewer late joins, or none: recorded again
            if without is not None and not self._conv_grads["late"]:   # refused: the way recorded without
                self._conv_grads.pop("late_held_to", None)
                return without


@contextlib.contextmanager
def _late_lets_go(ctx):
    """Late joins let go of the tensors their side streams read
    (kitsune.sched.streams._Streams.late_lets_go) while the block runs: for the captures Kitsune's allocator records and lays out. ctx:
    the captured module's _Streams, or None (no streams). The branchy net at batch 8
    then kept all 13 of its late joins within its budget (41.0 MiB, 26 waits) instead
    of 4: 0.435 ms a step against 0.442 (H100, models_variants_aa6c5bd.json against
    models_variants_af222f7.json)."""
    if ctx is None:
        yield
        return
    ctx.late_lets_go = True
    try:
        yield
    finally:
        ctx.late_lets_go = False


def _late_limit(kept, excess):
    """The most bytes a late join may keep (_Streams.late_limit) so that, of late joins
    keeping `kept` bytes each, the largest are left out until they add up to `excess`
    (all that keep as much as the last one left out go with it: the limit is a size);
    None when none would be left."""
    kept = sorted(kept, reverse=True)
    i, out = 0, 0
    while i < len(kept) and out < excess:
        out += kept[i]
        i += 1
    while 0 < i < len(kept) and kept[i] == kept[i - 1]:
        i += 1
    return kept[i] if i < len(kept) else None
