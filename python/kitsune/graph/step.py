"""kitsune.graph.step: CompiledStep, a training step captured as CUDA graphs and
replayed (the docstring of kitsune.graph says how), and compile_step.
"""
import collections
import contextlib
import time
import warnings
import weakref

import torch

from ..fx import FusedLoss
from ..optim import KitsuneOptimizer
from .capture import _CAPTURE_LOCK, _Capture, _capture_stream, _describe, _end_generator_capture, _share_workspaces
from .conv_grads import _ConvGradTrials
from .layout import _CAPTURED, _ChannelsLast, _nhwc_suits
from .memory import _MemoryPlanning

__all__ = ["compile_step", "CompiledStep"]


class _Graph:
    __slots__ = ("graph", "static", "slots", "loss", "plan")

    def __init__(self, graph, static, slots, loss, plan):
        self.graph, self.static, self.slots, self.loss, self.plan = graph, static, slots, loss, plan


class CompiledStep(_Capture, _MemoryPlanning, _ConvGradTrials, _ChannelsLast):
    """A training step as a CUDA graph; see kitsune.graph's docstring. Its parts by
    concern: _Capture (kitsune.graph.capture), _MemoryPlanning (memory),
    _ConvGradTrials (conv_grads), _ChannelsLast (layout); the call path, the first
    step and the stream plan are here."""

    def __init__(self, model, loss_fn, optimizer, *, max_shapes=8, autocast_dtype=None, max_grad_norm=None,
                 streams=4, channels_last=None, plan_memory=None, stream_costs=None, fuse_loss=True,
                 optimizer_in_backward=True, micro_batches=1, dynamo=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"compile_step: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"compile_step: loss_fn must be callable or None, got {loss_fn!r}")
        if isinstance(optimizer, torch.optim.Optimizer) and not isinstance(optimizer, KitsuneOptimizer):
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
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"compile_step: micro_batches must be an int >= 1, got {micro_batches!r}")
        self.micro_batches = micro_batches
        if not isinstance(dynamo, bool):
            raise ValueError(f"compile_step: dynamo must be True or False, got {dynamo!r}")
        self.dynamo, self._dynamo_model = dynamo, None
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
                   "memsets_replaced": 0, "uncaptured_steps": 0}
        # the signatures met lately (after a graph was dropped, a new one is captured when it comes back)
        self._seen = collections.OrderedDict()
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
        if self.micro_batches > 1:
            _check_micro_batches(batch, self.micro_batches)
        if self._reason is not None:
            return self._eager(batch)
        if len(self.optimizer.param_groups) != self._groups:   # their device rows were sized for the old groups
            self._graphs.clear()
            self._groups = len(self.optimizer.param_groups)
        # the model's mode keys the graph too: a step after model.eval() (BatchNorm's
        # running statistics, no dropout) is not the train-mode graph's
        key = (_signature(batch), self.model.training)
        g = self._graphs.get(key)
        if g is None:
            if self._n["evictions"] and key not in self._seen:
                return self._seen_once(key, batch)
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
        # cProfile on the H100's host, bench/results/archive/h100_host_68c627f.log)
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
        """The forward, loss and backward of the step (every micro-batch's, gradients
        accumulating, each loss divided by their number), then clipping; returns the
        loss (the micro-batches' mean)."""
        model = self._runner() if model is None else model
        k = self.micro_batches
        if k == 1:
            loss = self._micro_step(batch, model, 1)
        else:
            parts = [b.chunk(k) if isinstance(b, torch.Tensor) and b.dim() > 0 else (b,) * k for b in batch]
            loss = sum(self._micro_step(tuple(p[i] for p in parts), model, k) for i in range(k)) / k
        if self.max_grad_norm is not None and clip:
            if self.optimizer.enable_amp:
                self.optimizer.unscale_()
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=True)
        return loss

    def _runner(self):
        """What runs the forward: the model, or with dynamo=True the model compiled by
        Kitsune's own Dynamo path (torch.compile(backend="kitsune", options={"inductor":
        False}): Dynamo's graphs with the patterns, AOTAutograd's forward and backward run
        as traced), made on first use; graph breaks run eagerly between its graphs."""
        if not self.dynamo:
            return self.model
        if self._dynamo_model is None:
            from ..fx.backend import kitsune_backend, settle_hf_loss_functions
            settle_hf_loss_functions(self.model)   # (kept: the model traces whole from now on)
            self._dynamo_model = torch.compile(self.model, backend=kitsune_backend, options={"inductor": False})
        return self._dynamo_model

    def _micro_step(self, batch, model, k):
        """One forward, loss and backward of (loss / k); returns the loss, detached."""
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
        scaled = loss / k if k > 1 else loss
        (self.optimizer.scale(scaled) if self.optimizer.enable_amp else scaled).backward()
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

    def _seen_once(self, key, batch):
        """A signature met for the first time after the graphs overflowed max_shapes (the
        sequence lengths of dynamically padded batches): an eager step, no capture. It is
        captured if it comes back, so a few recurring shapes end up replayed while a
        stream of new ones costs an eager step each, not an eager step and a capture
        that is dropped before its first replay."""
        self._seen[key] = None
        while len(self._seen) > 64 * self.max_shapes:
            self._seen.popitem(last=False)
        if not self._n["uncaptured_steps"]:
            warnings.warn(f"kitsune.compile_step: more batch signatures than max_shapes={self.max_shapes}; new "
                          f"ones now run eagerly and are captured when they come back. Pad batches to a few "
                          f"shapes (docs/compile-step.md, dynamic shapes) or raise max_shapes to replay every step",
                          stacklevel=3)
        self._n["uncaptured_steps"] += 1
        return self._eager(batch)

    # ---- the first step of a signature ----
    def _first(self, key, batch):
        """The first step of a signature: eager on the capture stream, then the capture
        (one thread at a time: the capture stream is every compile_step's)."""
        with _CAPTURE_LOCK:
            return self._first_locked(key, batch)

    def _first_locked(self, key, batch):
        self._seen[key] = None
        self._seen.move_to_end(key)
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

    @contextlib.contextmanager
    def _phase(self, name, into=None):
        """Adds the host seconds of the block to stats()["setup_phases"][name] (`into`:
        another such dict, stats()["capture_parts"])."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            (self._phases if into is None else into)[name] += time.perf_counter() - t0

    def _shape_recorder(self):
        """kitsune.sched.shape_recorder(model) when the warm-up is to record the shapes of
        the stream plan: before the first capture, with more than one stream asked, and
        without autocast (the plan's shapes are taken on the model as called outside
        it, and so are the recorded ones); else None."""
        if self._captured is not None or self.streams == 1 or self.autocast_dtype is not None:
            return None
        from .. import sched
        return sched.shape_recorder(self.model)

    def _plan_streams(self, batch, device):
        """The model to capture: with kitsune.sched's streams when its plan gains, else the
        model itself (stats() says which and why)."""
        if self.streams == 1 or self.dynamo:
            self._stream_info = {"streams": 1, "streams_reason": "dynamo=True" if self.dynamo else "streams=1",
                                 "stream_shapes": None}
            return self._runner()
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
        why = _distributed_blocker(self.model)
        if why is not None:
            return why
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


def _check_micro_batches(batch, k):
    """Every tensor of the batch with dimensions splits into k equal micro-batches along
    its first (ValueError naming the item and its size otherwise)."""
    for i, b in enumerate(batch):
        if isinstance(b, torch.Tensor) and b.dim() > 0 and b.shape[0] % k:
            raise ValueError(f"compile_step: batch item {i} has {b.shape[0]} rows along dim 0, which "
                             f"micro_batches={k} does not divide")


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


def _distributed_blocker(model):
    """Why a model wrapped or sharded by torch.distributed cannot be captured, or None:
    DDP's gradient all-reduce (the wrapper anywhere in the model, or `replicate`) and
    FSDP's all-gathers and reduce-scatters (FSDP1's wrapper, FSDP2's `fully_shard`,
    DTensor parameters) run from hooks with host-side bookkeeping that a replayed graph
    would skip. The step then runs eagerly: Kitsune's kernels and fused optimizer still
    apply."""
    import torch.distributed as dist
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    try:
        from torch.distributed._composable import replicate
        replicated = replicate.state
    except (ImportError, AttributeError):   # a torch without composable replicate
        def replicated(m):
            return None
    eager = "runs eagerly (Kitsune's kernels and fused optimizer still apply)"
    for m in model.modules():
        if isinstance(m, torch.nn.parallel.DistributedDataParallel) or replicated(m) is not None:
            return ("the model is data-parallel (DistributedDataParallel or replicate): its gradient all-reduce is "
                    f"not captured yet, so the step {eager}")
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
            return ("the model is sharded (FSDP): its all-gathers and reduce-scatters are not captured yet, so the "
                    f"step {eager}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return f"the model is sharded (DTensor parameters): their collectives are not captured yet, so the step {eager}"
    return None


def compile_step(model, loss_fn, optimizer, *, max_shapes=8, autocast_dtype=None, max_grad_norm=None, streams=4,
                 channels_last=None, plan_memory=None, stream_costs=None, fuse_loss=True, optimizer_in_backward=True,
                 micro_batches=1, dynamo=False):
    """A callable ``step(*batch) -> loss`` running the whole training step as a CUDA
    graph; see kitsune.graph."""
    return CompiledStep(model, loss_fn, optimizer, max_shapes=max_shapes, autocast_dtype=autocast_dtype,
                        max_grad_norm=max_grad_norm, streams=streams, channels_last=channels_last,
                        plan_memory=plan_memory, stream_costs=stream_costs, fuse_loss=fuse_loss,
                        optimizer_in_backward=optimizer_in_backward, micro_batches=micro_batches,
                        dynamo=dynamo)
