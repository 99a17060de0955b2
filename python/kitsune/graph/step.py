"""kitsune.compile_step: a whole training step (forward, loss, backward, gradient
clipping, optimizer step) captured as one CUDA graph and replayed.

    step = kitsune.compile_step(model, loss_fn, optimizer)
    for x, y in loader:
        loss = step(x, y)     # zero_grad; loss_fn(model(x), y).backward(); optimizer.step()

A step is ``loss_fn(model(*batch[:-1]), batch[-1])``, or ``model(*batch)`` when
``loss_fn`` is None (the model returns the loss). The first call for each batch
signature (the shapes, dtypes and devices of its tensors, and its other values) runs
the step eagerly on a side stream (a real step: it also creates the optimizer's
state and warms up cuBLAS and cuDNN), then captures it there. That stream is
Kitsune's own, one per device for every compile_step, and uses the cuBLAS and cuBLASLt
workspaces of the stream the first step ran on (its partner), so a graph holds no
second set (65 MiB on an H100); a replay called on another stream is fenced with the
partner. Captures from several threads take turns; later calls copy the batch
into the graph's static inputs and replay it. Graphs are kept for up to
``max_shapes`` signatures, least recently used dropped first, and share one memory
pool: no two replay at once, and nothing a graph leaves in the pool outlives its
replay but the loss, which is copied out.

The optimizer step is Kitsune's fused kernel (the optimizer is wrapped in a
KitsuneOptimizer when it is not one already), reading its learning rate and step
count from device memory, so LR schedulers keep working and torch.optim's state
(step counts included) stays what an eager run would have; ``state_dict`` works
between steps. With ``optimizer_in_backward=True`` (the default) the update runs
inside the captured backward, a bucket of parameters at a time on a stream of its
own as soon as their gradients are final (KitsuneOptimizer.capture_in_backward;
not with ``max_grad_norm`` or loss scaling); ``stats()["optimizer_in_backward"]``
counts those launches. The arithmetic is the same either way.

Before a captured graph is instantiated, its memset nodes of up to 64 KiB (in GPT's
step, 4-byte zero fills next to cuDNN's attention kernels and cuBLASLt's cooperative
GEMMs, none of Kitsune's) become kernel nodes that write the same bytes: inside a graph
the kernel after a memset node started 3 to 7 us after it, where a kernel after a
kernel starts 0.4 us after it (H100). ``stats()["memsets_replaced"]`` counts them;
``KITSUNE_GRAPH_MEMSETS=keep`` leaves them.

When a step cannot be captured (no CUDA device, an optimizer the fused kernel does
not cover, an op that syncs with the host or refuses capture, a batch on another
device), it runs eagerly from then on: ``stats()["reason"]`` says why, and a warning
says so once. bf16 autocast: ``autocast_dtype=torch.bfloat16``. fp16 with dynamic loss
scaling: ``autocast_dtype=torch.float16`` with ``KitsuneOptimizer(..., enable_amp=True)``
(its torch.amp.GradScaler). The graph holds the whole scaled step with no host sync
(KitsuneOptimizer.capture_amp_step): the loss times the scale, the backward, the
scaler's unscale_ and inf check, clipping if asked, the update skipped on the device
where the check found inf or NaN (parameters, state and step counts untouched), and the
scaler's update of the scale; the scale lives on the device, as GradScaler keeps it.
torch.optim's host step counts are put right from the device when next read
(``state_dict`` and the like; one sync); ``get_stats()["skipped_steps"]`` counts the
skipped replays the same way.

Streams: the first capture plans the model's forward graph with kitsune.sched
(``streams`` at most, default 4) and, where the plan gains, captures it with
independent branches on separate streams (their backward follows them). A model
torch.fx cannot trace, or whose plan gains under 5%, is captured on one stream;
``stats()["streams"]`` and ``["streams_reason"]`` say which. ``streams=1`` turns it off.
The plan's shapes are noted during the warm-up step when the model is a GraphModule
without hooks of its own and no autocast is asked (its forward then runs through
torch.fx's Interpreter once: kitsune.sched.shape_recorder), else taken on fake tensors
(``stats()["stream_shapes"]``: "recorded" or "fake tensors").
The capture stream and the branch streams have the device's greatest priority, the
weight-gradient streams below (CUDA's default, the least), and a graph's kernels keep
their stream's (PyTorch instantiates with cudaGraphInstantiateFlagUseNodePriority):
where kernels contend for SMs the block scheduler starts the branches' and the main
chain's first. The branchy net at batch 8 took 0.425-0.427 ms a step with them
against 0.434-0.435 without, one stream 0.564-0.567 either way (H100,
bench/results/models_variants_priority_62ba436.json). KITSUNE_STREAM_PRIORITY=0 turns
them off (kitsune.sched.branch_priority).
The plan's costs are the roofline's (``stream_costs=None``) or, with
``stream_costs="measured"``, each operation's time measured on the first batch
(``kitsune.sched.measure_costs``: the forward run operation by operation, a few times,
without autograd; buffers and random generators put back).
In a streamed model each bias-free convolution (kitsune.optimize splits a Conv2d's
bias off; a bias-free nn.Conv2d with zero padding, as in torchvision's ResNets, counts
too) can run its weight gradient on a stream beside its input gradient. On the
H100 that made the branchy net's step at batch 64 2% slower (the plan's streams
already fill the GPU); at batch 8 the step ran 8% faster in one run and the forward
and backward 4% slower in another. So the first capture decides by measurement: it
captures the forward and backward alone each way, times their replays, puts the
buffers and the CUDA generator back, and keeps a split only when it is at least 1%
faster. ``stats()["conv_grads"]`` gives the times and the choice;
``KITSUNE_CONV_GRADS=apart``, ``=late`` or ``=together`` decides without measuring.
ResNet-18 (CIFAR-sized, batch 128: its last layers' maps are 2x2 and 1x1) took 1.29
ms a forward and backward together, 1.15 apart and 1.05 with the weight gradients
joined late; its step (cuDNN's heuristics mode B) 1.17 ms against 1.41 before its
bias-free Conv2d modules were split (bench/results/models_heuristic_mode_b_b4c5928.json,
models_heuristic_mode_b_893c0f7.json).

Layout: a model at least half of whose Conv2d layers have channel counts (in and out,
per group) that are multiples of 8 is captured on channels-last copies of its 4-D
floating inputs (``channels_last=None``, the default; True or False force it): cuDNN
runs NHWC kernels on H100s, and on NCHW input it transposes around each convolution.
(Convolutions of few channels, LeNet-5's, run faster NCHW.)
Its Conv2d weights are made channels-last too, in place (the same Parameters and
values, with their gradients and optimizer state, as ``model.to(memory_format=
torch.channels_last)`` would): else cuDNN copies each weight to NHWC in the forward
and its gradient back in the backward, every step. The warm-up step tries it first; a
model that refuses it (a ``.view`` needing NCHW strides, say) gets its weights back in
NCHW and is captured NCHW, and ``stats()["channels_last_reason"]`` says so. While
another compile_step of the same model holds captured graphs (on the weights'
storage), the weights are left as they are, and the reason says so.

cuDNN picks the channels-last convolutions' algorithms at the warm-up step, the first to
run them: with ``torch.backends.cudnn.benchmark`` on, by timing candidates (on the H100,
ResNet-18's warm-up took 1.20 s with it, 0.16 s without); with it off, by cuDNN's
heuristics, whose picks made the branchy net at batch 8 0.529 ms a step against 0.419
benchmarked. ``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1`` (PyTorch reads it at the process's
first convolution) made it 0.423 ms with a setup of 0.55 s (bench/results/
models_cudnn_limit_*_d3ed817.json, models_heuristic_mode_b_893c0f7.json).
``stats()["setup_phases"]`` says where a setup's time went.

Memory (``plan_memory``, default: when Kitsune's allocator is installed): the step is
captured once while the allocator records every allocation, the recorded lifetimes are
packed into one arena (kitsune/capplan.h), and the step is captured again with its
blocks at the planned offsets; the first graph is dropped. Each placement is checked
against the blocks still in use, so a capture that differs from the recording is still
correct (what the plan did not foresee comes from the pool). ``stats()["memory_plan"]``
gives the plan (``plan_bytes`` against the recording's live ``peak_bytes``) and how many
allocations were ``placed`` or ``refused``. The graphs of one compile_step share the arena.
The plan's budget is the eager step's peak (the most allocated after the warm-up) less
what is allocated outside the graph: a plan over it (streams running branches side by
side keep their blocks apart) lets blocks the capture's order keeps apart share bytes
as well, each reuse bought with a wait of the later block's stream on the earlier
block's work, the waits between blocks farthest apart first (``memory_plan``'s
``budget``, ``unwaited_bytes``, ``wait_gap`` and ``waits``). ``KITSUNE_PLAN_WAITS=0``
plans without a budget. ``KITSUNE_PLAN_WAITS=timed`` (opt-in) replays the recording's
graph once it is captured, the optimizer's update left out, and of the packings that
fit, bought by recorded events or by each pair's slack in that replay, keeps the one
whose waits delay it least to first order (``wait_timed``, ``wait_by_slack``,
``wait_delay_us``, ``node_times``; kt_caprec_set_times).

Loss (``fuse_loss=True``, the default): the loss function runs in a
kitsune.fx.FusedLoss mode, so its F.cross_entropy calls run as kitsune.cross_entropy
where that op covers them (2-D logits, int64 targets, mean, no class weights; under
autocast not on float16 logits, and with a float32 loss): the log-softmax is never stored, and the forward writes the logits'
gradient in the same pass as the loss (the backward only scales it).
``stats()["fused_loss"]`` counts them and ``["fused_loss_left"]`` says why any were
not.

After a step, parameters' ``.grad`` are None: the graph's gradients live in its pool.
The graphs hold the parameters and optimizer state they captured: the optimizer's
``load_state_dict`` (which replaces its state tensors) and a change to a
hyperparameter baked into the graph (betas, eps, weight decay, momentum, dampening,
nesterov) make the next step capture again; ``model.load_state_dict`` copies into the
same parameters and needs nothing. Assigning new Parameter objects to the model
after the first step is not followed: make a new compile_step.
"""
import collections
import contextlib
import ctypes
import math
import os
import threading
import time
import warnings
import weakref

import torch

from ..fx import FusedLoss
from ..optim import KitsuneOptimizer

__all__ = ["compile_step", "CompiledStep"]


class _Graph:
    __slots__ = ("graph", "static", "slots", "loss", "plan")

    def __init__(self, graph, static, slots, loss, plan):
        self.graph, self.static, self.slots, self.loss, self.plan = graph, static, slots, loss, plan


class CompiledStep:
    """A training step as a CUDA graph; see the module docstring."""

    def __init__(self, model, loss_fn, optimizer, *, max_shapes=8, autocast_dtype=None, max_grad_norm=None,
                 streams=4, channels_last=None, plan_memory=None, stream_costs=None, fuse_loss=True,
                 optimizer_in_backward=True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"compile_step: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"compile_step: loss_fn must be callable or None, got {loss_fn!r}")
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = KitsuneOptimizer(optimizer)
        if not isinstance(optimizer, KitsuneOptimizer):
            raise TypeError(f"compile_step: optimizer must be a torch.optim.Optimizer or KitsuneOptimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"compile_step: max_shapes must be an int >= 1, got {max_shapes!r}")
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"compile_step: autocast_dtype must be None, torch.bfloat16 or torch.float16, got "
                             f"{autocast_dtype!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"compile_step: max_grad_norm must be None or > 0, got {max_grad_norm!r}")
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 64:
            raise ValueError(f"compile_step: streams must be an int in 1..64, got {streams!r}")
        if stream_costs not in (None, "measured"):
            raise ValueError(f"compile_step: stream_costs must be None (the roofline) or 'measured', got "
                             f"{stream_costs!r}")
        self.stream_costs = stream_costs
        if not isinstance(fuse_loss, bool):
            raise ValueError(f"compile_step: fuse_loss must be True or False, got {fuse_loss!r}")
        self._fuse_loss = fuse_loss
        if not isinstance(optimizer_in_backward, bool):
            raise ValueError(f"compile_step: optimizer_in_backward must be True or False, got "
                             f"{optimizer_in_backward!r}")
        self.optimizer_in_backward = optimizer_in_backward
        self._opt_stream = None   # the stream the update runs on during the backward (capture_in_backward)
        self._ib_launches = 0   # the last capture's optimizer launches during the backward
        self._loss_info = {"fused_loss": 0, "fused_loss_left": []}   # the last step's FusedLoss counts
        if channels_last not in (None, True, False):
            raise ValueError(f"compile_step: channels_last must be None (auto), True or False, got {channels_last!r}")
        if plan_memory not in (None, True, False):
            raise ValueError(f"compile_step: plan_memory must be None (auto), True or False, got {plan_memory!r}")
        from .. import allocator
        if plan_memory and not allocator.installed():
            raise ValueError("compile_step: plan_memory=True lays the graph out in Kitsune's allocator; call "
                             "kitsune.allocator.install() first thing in the process, or pass plan_memory=None")
        self._plan_memory = allocator.installed() if plan_memory is None else plan_memory
        self._memory = None   # how the last capture's memory was laid out (stats()["memory_plan"])
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.max_shapes, self.autocast_dtype, self.max_grad_norm = max_shapes, autocast_dtype, max_grad_norm
        self._graphs = collections.OrderedDict()
        self._pool = self._side = self._partner = None
        self._blas = None   # kt_bridge_blas_share's counts after the last first step
        self._groups = len(optimizer.param_groups)
        self._reason = None
        self._n = {"replays": 0, "eager_steps": 0, "captures": 0, "evictions": 0, "recaptures": 0,
                   "memsets_replaced": 0}
        self._setup_s = 0.0
        # setup_s by phase (host seconds; _phase): the eager warm-up step, the stream plan,
        # the convolution-gradient trials, the captures (recording, planning, the graph)
        self._phases = dict.fromkeys(("warm_up", "streams", "conv_grads", "capture"), 0.0)
        # of "capture", with planned memory: the recording captures (each with taking its
        # recording), their plans, the capture laid out by the plan
        self._capture_parts = dict.fromkeys(("record", "plan", "place"), 0.0)
        self.streams = streams
        # channels-last 4-D inputs: None = when at least half the 2-D convolutions suit cuDNN's NHWC kernels
        if channels_last is None:
            self._cl, self._cl_reason = _nhwc_suits(model)
        else:
            self._cl, self._cl_reason = channels_last, "asked" if channels_last else "off"
        self._captured = None   # the model as captured: with its plan's streams (kitsune.sched.streamed)
        self._conv_grads = None   # how its convolutions' gradients run (_choose_conv_grads)
        # the plans' budget (_eager_budget): how far the last warm-up's forward and backward
        # took the allocated bytes above their start (_eager), and the static inputs' bytes
        self._eager_rise, self._inputs_bytes = None, 0
        self._node_times = None   # how the last recording's nodes were timed (_NodeTimer.note)
        self._stream_info = {"streams": 1, "streams_reason": "not planned yet", "stream_shapes": None}
        self._shapes_recorded = False   # the last warm-up noted the stream plan's shapes (_warm_up)
        # load_state_dict replaces the optimizer's state tensors, which the graphs hold
        ref = weakref.ref(self)
        optimizer.optimizer.register_load_state_dict_post_hook(lambda opt: ref() and ref()._invalidate())

    # ---- one step ----
    def __call__(self, *batch):
        if self.loss_fn is not None and len(batch) < 2:
            raise TypeError(f"compile_step: a step takes the model's inputs and then the target; got {len(batch)} "
                            f"argument(s)")
        if self._reason is not None:
            return self._eager(batch)
        if len(self.optimizer.param_groups) != self._groups:   # their device rows were sized for the old groups
            self._graphs.clear()
            self._groups = len(self.optimizer.param_groups)
        key = _signature(batch)
        g = self._graphs.get(key)
        if g is None:
            return self._first(key, batch)
        if not self.optimizer.sync_hyper(g.plan):   # betas, weight decay, ... changed: capture again
            del self._graphs[key]
            self._n["recaptures"] += 1
            return self._first(key, batch)
        self._graphs.move_to_end(key)
        for s, i in zip(g.static, g.slots):
            s.copy_(batch[i], non_blocking=True)
        # the graph's cuBLAS kernels use the partner stream's workspaces: a replay
        # launched on another stream is ordered with it both ways (the raw handle
        # compared: torch.cuda.current_stream() took 20 us of host time a call under
        # cProfile on the H100's host, bench/results/h100_host_68c627f.log)
        partner = self._partner
        fence = torch._C._cuda_getCurrentRawStream(partner.device_index) != partner.cuda_stream
        if fence:
            here = torch.cuda.current_stream(partner.device)
            here.wait_stream(partner)
        g.graph.replay()
        if fence:
            partner.wait_stream(here)
        self.optimizer.replayed(g.plan)
        self._n["replays"] += 1
        return g.loss.clone()

    def _forward_backward(self, batch, model=None, clip=True):
        model = self.model if model is None else model
        inputs, target = (batch[:-1], batch[-1]) if self.loss_fn is not None else (batch, None)
        amp = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)   # no cache across a capture
               if self.autocast_dtype is not None else contextlib.nullcontext())
        with amp:
            out = model(*inputs)
            if self.loss_fn is None:
                loss = out
            else:
                with FusedLoss() if self._fuse_loss else contextlib.nullcontext() as mode:
                    loss = self.loss_fn(out, target)
                if mode is not None:
                    self._loss_info = {"fused_loss": mode.fused, "fused_loss_left": mode.left}
            del out   # what the backward needs of it, autograd keeps: the rest goes now, as in an eager loop
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"compile_step: the loss must be a one-element tensor, got "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        amp = self.optimizer.enable_amp
        (self.optimizer.scale(loss) if amp else loss).backward()
        if self.max_grad_norm is not None and clip:
            if amp:
                self.optimizer.unscale_()
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=True)
        return loss.detach()

    def _eager(self, batch, model=None, rise=False):
        """One eager step (`model`: what runs the forward, the model by default). rise:
        notes in _eager_rise how far its forward and backward took the device's allocated
        bytes above what was allocated when they began (the gradients dropped): the
        device's peak since its last reset less that start, so an earlier, higher peak
        of the process counts. The optimizer's update is left out: its state, made
        lazily by a first update, stays allocated and is no part of a step's rise."""
        self.optimizer.zero_grad(set_to_none=True)
        dev = self._side.device if rise else None
        start = torch.cuda.memory_allocated(dev) if rise else 0
        loss = self._forward_backward(batch, model)
        if rise:
            self._eager_rise = max(torch.cuda.max_memory_allocated(dev) - start, 0)
        self.optimizer.step()
        self._n["eager_steps"] += 1
        return loss

    # ---- capture ----
    def _first(self, key, batch):
        """The first step of a signature: eager on the capture stream, then the capture
        (one thread at a time: the capture stream is every compile_step's)."""
        with _CAPTURE_LOCK:
            return self._first_locked(key, batch)

    def _first_locked(self, key, batch):
        why = self._capture_blocker(batch)
        if why is not None:
            self._fall_back(why)
            return self._eager(batch)
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        here = torch.cuda.current_stream(device)
        if self._side is None:
            self._side, self._partner = _capture_stream(device, here)
        side, partner = self._side, self._partner
        _share_workspaces(partner, side)
        side.wait_stream(here)
        if partner != here:
            side.wait_stream(partner)
        with torch.cuda.stream(side), self._phase("warm_up"):
            loss = self._warm_up(batch)
        here.wait_stream(side)
        if partner != here:
            partner.wait_stream(side)
        # workspaces the warm-up made on the capture stream (the autograd thread's
        # handle, say) move to the partner; the capture then makes none
        self._blas = _share_workspaces(partner, side)
        if self.optimizer.enable_amp and self.optimizer._first_update_pending():
            # the loss scaler skipped the warm-up's update (inf or NaN gradients), so the optimizer
            # state a capture reads is not there yet: eager again, until an update is taken
            self._setup_s += time.perf_counter() - t0
            return loss
        slots = [i for i, b in enumerate(batch) if isinstance(b, torch.Tensor)]
        laid = self._layout(batch)
        static = [laid[i].detach().clone() for i in slots]   # outside the pool: the graph's inputs
        self._inputs_bytes = sum(s.nbytes for s in static)
        args = list(batch)
        for s, i in zip(static, slots):
            args[i] = s
        planned = self._captured is None
        if planned:
            with self._phase("streams"):
                self._captured = self._plan_streams(args, device)
        self.optimizer.prepare_capture(device)
        self._held_pool()
        try:
            if planned:
                with self._phase("conv_grads"):
                    self._choose_conv_grads(args)
            with self._phase("capture"):
                if self._plan_memory:
                    graph, static_loss, plan = self._capture_planned(args, device)
                else:
                    graph, static_loss, plan = self._capture(args, self._pool)
        except Exception as e:   # noqa: BLE001 - any failure inside the capture means: run eagerly
            torch.cuda.set_stream(here)   # a streamed forward may have failed on a side stream
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer._amp_forget()
            torch.cuda.synchronize()
            _end_generator_capture(device)
            self._fall_back(f"the step could not be captured: {_describe(e)}")
            return loss
        self._graphs[key] = _Graph(graph, static, slots, static_loss, plan)
        _CAPTURED.setdefault(self.model, weakref.WeakSet()).add(self)
        if len(self._graphs) > self.max_shapes:
            self._graphs.popitem(last=False)
            self._n["evictions"] += 1
        self._n["captures"] += 1
        self._setup_s += time.perf_counter() - t0
        return loss

    def _held_pool(self):
        """The pool the next capture goes to: the graphs' while one holds it, else a new
        one. A pool whose last graph is gone takes no capture until its cache is emptied
        (PyTorch's beginAllocateToPool asserts its use count, in the CUDA host allocator
        too), and _capturing skips torch.cuda.graph's empty_cache under Kitsune's
        allocator: reusing the handle failed the capture of a batch shape after an arena
        grew (H100, bench/results/h100_graph_gmem_08d37d5.log)."""
        if self._pool is None or not self._graphs:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @contextlib.contextmanager
    def _phase(self, name, into=None):
        """Adds the host seconds of the block to stats()["setup_phases"][name] (`into`:
        another such dict, stats()["capture_parts"])."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            (self._phases if into is None else into)[name] += time.perf_counter() - t0

    def _capture(self, args, pool, update=True, timer=None):
        """One capture of the step into ``pool``, on the side stream the warm-up ran on
        (its cuBLAS workspaces exist, so none is allocated in the pool). Returns the
        graph, its loss and the optimizer's capture plan; the gradients are dropped
        after it (they stay in the pool, the graph's). ``update=False``: the forward
        and backward alone, no optimizer (plan None; _choose_conv_grads' trials).
        ``timer``: a _NodeTimer, told which nodes are the update while capturing and
        called with the graph once captured (_recording)."""
        self.optimizer.zero_grad(set_to_none=True)
        ctx = getattr(self._captured, "_kitsune_streams", None)
        if ctx is not None:
            ctx.late_kept = []   # this capture's late joins (_late_kept)
        graph = torch.cuda.CUDAGraph(keep_graph=True)   # instantiated below, after _memsets_to_kernels
        ib = plan = None
        self.optimizer._launch_mark = timer.mark if timer is not None else None
        try:
            with self._capturing(graph, pool):
                ib = self._in_backward() if update else None
                static_loss = self._forward_backward(tuple(args), self._captured, clip=update)
                if update:
                    plan = ib.finish() if ib is not None else (
                        self.optimizer.capture_amp_step() if self.optimizer.enable_amp else self.optimizer.capture_step())
                    self._ib_launches = ib.launches if ib is not None else 0
        except BaseException:
            if ib is not None:
                ib.close()
            # A capture that failed to end leaves the allocator routing the pool's
            # allocations through a filter that refers to the dead graph
            # (CUDAGraph::capture_end throws before endAllocateToPool): end it here.
            try:
                torch._C._cuda_endAllocateToPool(self._side.device.index, pool)
            except Exception:   # noqa: BLE001 - it had ended: the capture's own error is the one to raise
                pass
            raise
        finally:
            self.optimizer._launch_mark = None
        if timer is not None:   # before the memsets become kernels: the recording names the nodes captured
            timer(graph)
        with torch.cuda.device(self._side.device):   # the kernel nodes are made for the current device
            self._n["memsets_replaced"] = _memsets_to_kernels(graph)
            graph.instantiate()
        self.optimizer.zero_grad(set_to_none=True)
        return graph, static_loss, plan

    def _choose_conv_grads(self, args):
        """How the captured model's bias-free convolutions run their weight gradient
        (kitsune.sched._ConvGradsApart): "together" with the input gradient, "apart" on
        a side stream joined in the node, or "late", joined at the end of the backward
        (see kitsune.sched.conv_grads_mode). With KITSUNE_CONV_GRADS unset, measured: the
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

    def _eager_budget(self):
        """Bytes a graph may take beside what the eager step keeps between steps: the
        warm-up's rise (_eager) less the graph's static inputs (which an eager step does
        not copy); None before a warm-up. Before 29cc25d it was the device's peak
        after the warm-up less what was allocated at the capture, which a first
        optimizer update (its state made then, and kept) shrank to about the gradients'
        bytes: in bench/models.py's fresh process ResNet-18's budget was 43.8 MiB (its
        eager step rises 103.4 MiB in graph_memory_resnet18_split_a09cec9.json), its
        plan bought 23 waits, and its step took 1.391 ms against 1.177 unplanned (H100,
        bench/results/models_planned_mode_b_60f753b.json)."""
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
        return None if os.environ.get("KITSUNE_PLAN_WAITS", "1") == "0" else self._held_budget(floor)

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

    def _in_backward(self):
        """The optimizer's update, inside the capture, overlapping the backward
        (KitsuneOptimizer.capture_in_backward on a stream of this step's), or None:
        off, or gradient clipping or loss scaling, which need every gradient first."""
        if not self.optimizer_in_backward or self.max_grad_norm is not None or self.optimizer.enable_amp:
            return None
        if self._opt_stream is None:
            self._opt_stream = torch.cuda.Stream(self._side.device)
        return self.optimizer.capture_in_backward(self._opt_stream)

    @contextlib.contextmanager
    def _capturing(self, graph, pool):
        """torch.cuda.graph(graph, pool=pool, stream=side), less its gc.collect() and
        empty_cache() when Kitsune's allocator is installed: it makes a capture's memory
        ready itself (beginAllocateToPool), and emptying its cache cost 0.19 s a capture
        on the H100, twice a planned step (bench/results/h100_plan_debug_779a772_805068d.txt)."""
        from .. import allocator
        if not allocator.installed():
            with torch.cuda.graph(graph, pool=pool, stream=self._side, capture_error_mode="thread_local"):
                yield
            return
        torch.cuda.synchronize()
        with torch.cuda.stream(self._side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()

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
        if os.environ.get("KITSUNE_PLAN_WAITS") != "timed" or self.optimizer.enable_amp:
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

    def _warm_up(self, batch):
        """The first step of a signature, eager. With channels-last on it tries that layout
        first, its Conv2d weights made channels-last; a model that refuses it (a .view()
        needing NCHW strides, say) gets its buffers, the CUDA rng and the weights' layout
        put back, and the step runs NCHW from then on. With a stream plan still to make,
        the forward runs through kitsune.sched.shape_recorder where it can: the shapes the
        plan needs are noted on the way (_plan_streams then skips its run on fake tensors)."""
        run = self._shape_recorder()
        self._shapes_recorded = run is not None   # a step that raises is warmed up again next call
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

    def _shape_recorder(self):
        """kitsune.sched.shape_recorder(model) when the warm-up is to record the shapes of
        the stream plan: before the first capture, with more than one stream asked, and
        without autocast (the plan's shapes are taken on the model as called outside
        it, and so are the recorded ones); else None."""
        if self._captured is not None or self.streams == 1 or self.autocast_dtype is not None:
            return None
        from .. import sched
        return sched.shape_recorder(self.model)

    def _layout(self, batch):
        """The batch as the graph takes it: 4-D floating tensors channels-last when that
        is on (cuDNN's convolutions then need no NCHW <-> NHWC transposes)."""
        if not self._cl:
            return batch
        return tuple(b.contiguous(memory_format=torch.channels_last)
                     if isinstance(b, torch.Tensor) and b.dim() == 4 and b.is_floating_point() else b for b in batch)

    def _plan_streams(self, batch, device):
        """The model to capture: with kitsune.sched's streams when its plan gains, else the
        model itself (stats() says which and why)."""
        if self.streams == 1:
            self._stream_info = {"streams": 1, "streams_reason": "streams=1", "stream_shapes": None}
            return self.model
        from .. import sched
        inputs = batch[:-1] if self.loss_fn is not None else batch
        try:
            # measured costs: the forward's operations timed as the step runs them (under its autocast)
            amp = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)
                   if self.autocast_dtype is not None and self.stream_costs else contextlib.nullcontext())
            with amp:
                module, plan = sched.streamed(self.model, *inputs, streams=self.streams, costs=self.stream_costs,
                                              shapes_recorded=self._shapes_recorded)
        except Exception as e:   # noqa: BLE001 - an untraceable model keeps one stream
            self._stream_info = {"streams": 1, "streams_reason": f"not planned: {_describe(e)}",
                                 "stream_shapes": None}
            return self.model
        source = "measured" if self.stream_costs else "roofline"
        self._stream_info = {"streams": plan.streams_used, "streams_reason": (
            f"{plan.reason} ({source} costs)" if plan.reason else
            f"plan: {plan.gain:.2f}x estimated from {source} costs, {len(plan.syncs)} syncs"),
            "stream_shapes": plan.shapes}
        if module is not self.model:
            module._kitsune_streams.prepare(device)
        return module

    def _invalidate(self):
        """Drops every graph (each is captured again at its signature's next call)."""
        self._n["recaptures"] += len(self._graphs)
        self._graphs.clear()

    def _capture_blocker(self, batch):
        if not torch.cuda.is_available():
            return "CUDA is not available"
        devices = {p.device for p in self.model.parameters()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return f"the model's parameters must be on one CUDA device, found {sorted(map(str, devices))}"
        device = next(iter(devices))
        for i, b in enumerate(batch):
            if isinstance(b, torch.Tensor) and b.device != device:
                raise ValueError(f"compile_step: batch item {i} is on {b.device}, the model on {device} (move batches "
                                 f"to the device first: kitsune.prefetch does it on a side stream)")
        return None

    def _fall_back(self, why):
        self._reason = why
        self._graphs.clear()
        warnings.warn(f"kitsune.compile_step: running eagerly: {why}", stacklevel=3)

    def stats(self):
        """Counts (replays, eager_steps, captures, evictions, recaptures: graphs dropped
        because the optimizer's state was loaded or a baked hyperparameter changed),
        graphs kept, seconds
        spent in first steps and captures (setup_s) and, of them, in each phase
        (setup_phases: the eager warm-up step with cuDNN's first use of its layouts, the
        stream plan, the convolution-gradient trials, the captures) and, of the captures with
        planned memory (capture_parts), the recording captures with taking each recording
        (record), planning them (plan) and the capture laid out by the plan (place), and why
        the step runs eagerly
        (reason, None while it is captured), and the streams the captured forward runs on
        with the planner's verdict (streams, streams_reason) and where its shapes came
        from (stream_shapes), and whether 4-D inputs are
        captured channels-last (channels_last, channels_last_reason), and how many of the
        loss function's F.cross_entropy calls ran as kitsune.cross_entropy in the last
        step traced (fused_loss) with why any others did not (fused_loss_left), and
        how many optimizer launches the last capture made during the backward
        (optimizer_in_backward), and how many memset nodes of the last capture became
        kernel nodes (memsets_replaced), and whether the convolutions' two gradients
        run apart (conv_grads: None when the model has no such convolution; else their
        count, the choice, how it was made and, when measured, the forward and backward's
        time each way)."""
        return dict(self._n, graphs=len(self._graphs), setup_s=self._setup_s,
                    setup_phases=dict(self._phases), capture_parts=dict(self._capture_parts),
                    reason=self._reason, **self._stream_info,
                    channels_last=self._cl, channels_last_reason=self._cl_reason,
                    memory_plan=dict(self._memory) if self._memory else None,
                    blas_workspaces=dict(self._blas) if self._blas else None,
                    fused_loss=self._loss_info["fused_loss"], fused_loss_left=list(self._loss_info["fused_loss_left"]),
                    optimizer_in_backward=self._ib_launches,
                    conv_grads=dict(self._conv_grads) if self._conv_grads else None)


# compile_step's capture streams: device index -> (the stream, its partner: the
# stream whose cuBLAS and cuBLASLt workspaces it uses). PyTorch keys those
# workspaces by (handle, stream) and keeps them for the process, 65 MiB a stream on
# an H100; a graph bakes in its capture stream's. Sharing the partner's (the stream
# the first step ran on, the default stream as a rule) keeps a whole-step graph from
# holding a second set. The stream is Kitsune's own (PyTorch's pool hands its streams
# round-robin to any caller, who would then use the partner's workspaces unordered),
# one per device for every compile_step, never destroyed.
_CAPTURE_STREAMS = {}   # read and filled under _CAPTURE_LOCK (_capture_stream is called from _first)
_CAPTURE_LOCK = threading.RLock()   # a first step and its capture, one thread at a time
# model -> the compile_steps that captured graphs of it: a graph holds the parameters'
# storage, so another compile_step of the same model must not move the weights
_CAPTURED = weakref.WeakKeyDictionary()


_TRIAL_BLOCK_MS = 3.0   # _time_trial's blocks: about this long (2 to 10 replays)
_CONV_GRAD_WAYS = ("together", "apart", "late")   # _choose_conv_grads' order: the later, the more streams and memory


class _NodeTimer:
    """Times a recording capture's graph for its plan's waits (kt_caprec_set_times: a
    wait is bought where it had slack in a replay). While capturing, mark (the
    optimizer's _launch_mark) notes which nodes are the update; called with the
    captured graph, it replays a copy of it without them (kt_graph_time_nodes), so
    parameters and optimizer state are not updated, and puts the model's buffers and
    the random generators back after. times: (nodes, finish ns) or None; note: what
    stats()["memory_plan"]["node_times"] says."""

    def __init__(self, model, stream):
        self.model, self.stream = model, stream
        self.update, self._before, self.times, self.note = set(), None, None, None

    def mark(self, begin):
        nodes = _capture_nodes(torch.cuda.current_stream())
        if nodes is None or (not begin and self._before is None):
            self.note = "not timed: the update's nodes could not be told apart"
        elif begin:
            self._before = nodes
        else:
            self.update |= nodes - self._before
            self._before = None

    def __call__(self, graph):
        if self.note is not None:
            return
        from ..sched import saved_state
        restore = saved_state(self.model)
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(self.stream):
                self.times = _node_times(graph, sorted(self.update), self.stream)
            self.note = (f"{len(self.times[0])} nodes timed over {_TIMED_REPLAYS} replays, {len(self.update)} of the "
                         f"update left out, {time.perf_counter() - t0:.3f} s")
        except RuntimeError as e:
            self.note = f"not timed: {_describe(e)}"
        finally:
            restore()


# Replays of a recording's graph its node times are the median of (_NodeTimer)
_TIMED_REPLAYS = 3


def _capture_nodes(stream):
    """The nodes of the graph stream is capturing into (ints), or None."""
    from .. import _native
    lib = _native.native()
    n = ctypes.c_size_t(0)
    if lib.kt_graph_capture_nodes(ctypes.c_void_p(stream.cuda_stream), None, 0, ctypes.byref(n)) != 0:
        return None
    room = n.value
    out = (ctypes.c_uint64 * max(room, 1))()
    if lib.kt_graph_capture_nodes(ctypes.c_void_p(stream.cuda_stream), out, room, ctypes.byref(n)) != 0 or \
            n.value != room:
        return None
    return set(out[:room])


def _node_times(graph, skip, stream):
    """(nodes, ns): when each node of a captured graph (not instantiated through it)
    finished in replays of a copy of it on stream, skip's nodes left out
    (kt_graph_time_nodes); RuntimeError when the runtime refuses."""
    from .. import _native
    lib = _native.native()
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    _native.check(lib.kt_graph_time_nodes(raw, None, 0, None, 0, None, None, None, 0, ctypes.byref(n)),
                  "counting a captured graph's nodes")
    count = n.value
    stamps = torch.empty(count + 1, dtype=torch.int64, device=stream.device)
    nodes, ns = (ctypes.c_uint64 * max(count, 1))(), (ctypes.c_int64 * max(count, 1))()
    left = (ctypes.c_uint64 * max(len(skip), 1))(*skip)
    with torch.cuda.device(stream.device):
        _native.check(lib.kt_graph_time_nodes(raw, left, len(skip), ctypes.c_void_p(stamps.data_ptr()), _TIMED_REPLAYS,
                                              ctypes.c_void_p(stream.cuda_stream), nodes, ns, count, ctypes.byref(n)),
                      "timing a captured graph's nodes")
    return list(nodes[:count]), list(ns[:count])


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


@contextlib.contextmanager
def _late_lets_go(ctx):
    """Late joins let go of the tensors their side streams read (sched._Streams.late_lets_go)
    while the block runs: for the captures Kitsune's allocator records and lays out. ctx:
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


def _graphs_elsewhere(step):
    """How many other compile_steps of step's model hold captured graphs."""
    return sum(1 for other in _CAPTURED.get(step.model, ()) if other is not step and other._graphs)


def _capture_stream(device, here):
    from .. import _native
    idx = device.index if device.index is not None else torch.cuda.current_device()
    got = _CAPTURE_STREAMS.get(idx)
    if got is None:
        ptr = ctypes.c_uint64()
        b = _native.bridge()
        from ..sched import branch_priority
        _native.check(b.kt_bridge_stream_create(idx, branch_priority(), ctypes.byref(ptr)),
                      f"creating a capture stream on cuda:{idx}")
        got = _CAPTURE_STREAMS[idx] = (torch.cuda.ExternalStream(ptr.value, device=torch.device("cuda", idx)), here)
    return got


def _share_workspaces(partner, side):
    """kt_bridge_blas_share(partner, side): ``shared`` (map, handle) pairs whose side
    workspace is now the partner's, how many of those ``moved`` from side, and how many
    stay ``apart`` (both streams had their own before they were paired)."""
    from .. import _native
    b = _native.bridge()
    out = (ctypes.c_int64 * 3)()
    _native.check(b.kt_bridge_blas_share(partner.cuda_stream, side.cuda_stream, out), "sharing cuBLAS workspaces")
    return dict(zip(("shared", "moved", "apart"), out))


def _nhwc_suits(model):
    """(channels-last, why) for channels_last=None: when at least half the model's Conv2d
    layers have channel counts (in and out, per group) that are multiples of 8, the
    vector width of cuDNN's NHWC kernels. LeNet-5 (1 -> 6 -> 16 channels) ran 0.225 ms
    a step channels-last against 0.206 NCHW; ResNet-18 1.456 against 1.853 (H100,
    bench/results/models_cd1ab81.json)."""
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


def _describe(e):
    """An exception as its type and first line."""
    first = (str(e).strip().splitlines() or [""])[0]
    return type(e).__name__ + (f": {first}" if first else "")


# Memset nodes up to this size become kernel nodes (kt_graph_memsets_to_kernels): GPT's
# are 4 bytes each; the 8 MiB zero fill of its embedding gradient stays a memset.
_MEMSET_KERNEL_MAX_BYTES = 1 << 16


def _memsets_to_kernels(graph):
    """Replaces the small memset nodes of a captured, not yet instantiated graph with
    kernel nodes of Kitsune's (kitsune/fusion.h: kt_graph_memsets_to_kernels): inside
    a graph the kernel after a memset node started 3 to 7 us after it, after a kernel
    0.4 us (H100, bench/results/h100_timeline_gpt_inception8_18b9e89.log). Returns how
    many; KITSUNE_GRAPH_MEMSETS=keep leaves them."""
    if os.environ.get("KITSUNE_GRAPH_MEMSETS") == "keep":
        return 0
    from .. import _native
    n = ctypes.c_int(0)
    _native.check(_native.native().kt_graph_memsets_to_kernels(graph.raw_cuda_graph(), _MEMSET_KERNEL_MAX_BYTES,
                                                                 ctypes.byref(n)), "kt_graph_memsets_to_kernels")
    return n.value


def _end_generator_capture(device):
    """A capture that failed leaves the CUDA generators it registered in capture mode
    (PyTorch ends it only after a successful end of capture), and every later random
    op then fails with "Offset increment outside graph capture encountered
    unexpectedly". A capture that succeeds ends it; this one records a single fill."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.empty(1, device=device).zero_()
    del g


def _signature(batch):
    key = []
    for i, b in enumerate(batch):
        if isinstance(b, torch.Tensor):
            key.append(("tensor", b.shape, b.dtype, b.device, b.requires_grad))
        else:
            try:
                hash(b)
            except TypeError:
                raise TypeError(f"compile_step: batch item {i} ({type(b).__name__}) is neither a tensor nor "
                                f"hashable, so it cannot key a captured step") from None
            key.append(("value", type(b), b))
    return tuple(key)


def compile_step(model, loss_fn, optimizer, *, max_shapes=8, autocast_dtype=None, max_grad_norm=None, streams=4,
                 channels_last=None, plan_memory=None, stream_costs=None, fuse_loss=True, optimizer_in_backward=True):
    """A callable ``step(*batch) -> loss`` running the whole training step as a CUDA
    graph; see kitsune.graph."""
    return CompiledStep(model, loss_fn, optimizer, max_shapes=max_shapes, autocast_dtype=autocast_dtype,
                        max_grad_norm=max_grad_norm, streams=streams, channels_last=channels_last,
                        plan_memory=plan_memory, stream_costs=stream_costs, fuse_loss=fuse_loss,
                        optimizer_in_backward=optimizer_in_backward)
