"""kitsune.KitsuneOptimizer: a drop-in torch.optim optimizer whose step is Kitsune's
fused multi-tensor kernel.

    opt = kitsune.KitsuneOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    opt = kitsune.KitsuneOptimizer(existing_optimizer)      # wraps an instance

It is a torch.optim.Optimizer and keeps the torch.optim optimizer it was given or
built, so ``param_groups``, ``state``, ``state_dict`` / ``load_state_dict``,
``zero_grad``, step hooks, LR schedulers and ``torch.optim.swa_utils`` work as with
torch.optim, and a checkpoint moves freely between the two. ``step`` runs
``torch.ops.kitsune.adam_step_`` (which counts the steps and calls ``adam_``) / ``sgd_``
(one kernel launch per device, dtype and step count, or per 128 tensors, on CUDA; the
same per-element code on the CPU) for torch.optim.Adam, AdamW and
SGD, and the wrapped optimizer's own step for anything else (another optimizer,
amsgrad, maximize, capturable, differentiable, a tensor lr, sparse or non-dense
tensors, a gradient with gaps). Dense parameters in other layouts (a channels-last
convolution weight) are fused; a dense gradient in other strides than its parameter's
is first copied into the parameter's strides, as AccumulateGrad makes it. ``get_stats()`` says which path ran and why, with measured
times.
"""
import time
from collections import OrderedDict

import torch

from . import ops as _ops  # noqa: F401 - loads the bridge (torch.ops.kitsune.adam_ / sgd_)
from ._optim_checks import _conform_grads, _decoupled, _fusable_or_why, _local, _no_state_yet, _why_not

_lib = torch.ops.kitsune
_AMP_UNSCALED = torch.amp.grad_scaler.OptState.UNSCALED   # GradScaler: unscale_ done since update()
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


# The hyperparameters a captured step bakes in as launch constants (lr and the step
# count are read from the device instead).
_BAKED = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "decoupled_weight_decay")


def _baked(group):
    return tuple(map(group.get, _BAKED))


class _CapturePlan:
    """What a captured step updates: groups, [(group index, the state dict of one of
    the group's parameters (None for SGD))]; states, the state dicts whose CPU step
    count a replay moves on; counts and mask, the _StepCounts they were views of at
    capture and which of its elements they are; baked, each group's baked
    hyperparameters at capture."""

    def __init__(self):
        self.groups, self.states, self.baked = [], [], {}
        self.counts = self.mask = None
        self.group_states = {}   # group index -> its Adam states here (a loss-scaled plan's counts settle by group)
        self.amp = False   # the update is conditional on the loss scaler's inf check (capture_amp_step)


class _StepCounts:
    """torch.optim's per-parameter CPU step tensors, rebound as views of one 1-D
    tensor, so that a replay counts every parameter's step with one add. The foreach
    add over them it replaces took 32 us of host time a replay for the MLP's 6
    tensors on the H100's host under cProfile, the most of any item
    (tools/gpu/host_replay.py, bench/results/archive/h100_host_68c627f.log). The values and tensor type stay torch.optim's
    (0-dim, float32 or float64, CPU); their in-place updates (torch.optim's own
    step, kitsune.adam_step_) write through the views."""

    def __init__(self, states):
        self.base = torch.stack([st["step"] for st in states])   # a copy of the counts
        for i, st in enumerate(states):
            st["step"] = self.base[i]

    @staticmethod
    def bindable(states):
        steps = [st["step"] for st in states]
        return bool(steps) and all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"
                                   and t.dtype == steps[0].dtype and not t.requires_grad for t in steps)

    def holds(self, states):
        return all(getattr(st["step"], "_base", None) is self.base for st in states)

    def mask(self, states):
        """1 at the elements the states' step tensors view (their offsets in base), else 0."""
        m = torch.zeros_like(self.base)
        m[[st["step"].storage_offset() for st in states]] = 1
        return m


class _InBackward:
    """KitsuneOptimizer.capture_in_backward's hooks and buckets (see there)."""

    kitsune_in_backward = True   # kitsune.sched.conv_grads._late_ok: its hook lets a gradient come after the backward

    def __init__(self, owner, want, stream, buckets):
        self.owner, self.stream = owner, stream
        self.group_of = {p: gi for gi, ps in enumerate(want) for p in ps}
        total = sum(p.numel() for ps in want for p in ps)
        self.quota = max(total // max(buckets, 1), 1 << 20)   # elements a bucket; a small model's all wait for finish
        self.pending, self.pending_n, self.done, self.left, self.launches = [], 0, [], [], 0
        # raw stream -> an event recorded there at the pending bucket's last gradient on it:
        # autograd runs a parameter's AccumulateGrad (and this hook) on the stream of its
        # forward use, so a streamed model's bucket has gradients ready on several streams
        self.ready_on = {}
        self.counted = set()   # groups whose device step count this capture moved on
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.group_of]

    def _ready(self, p):
        if p.grad is None:   # autograd runs the hook for a None gradient too; a late one is finish's
            return
        _conform_grads([p])   # before the event below, on the stream that made the gradient
        if p.is_cuda:
            here = torch.cuda.current_stream(p.device)
            self.ready_on[here.cuda_stream] = here.record_event()
        self.pending.append(p)
        self.pending_n += p.numel()
        if self.pending_n >= self.quota:
            self._flush()

    def _live(self, ps):
        live = [[] for _ in self.owner.optimizer.param_groups]
        for p in ps:
            live[self.group_of[p]].append(p)
        return live

    def _flush(self):
        """The pending bucket, updated on the step's stream once each of its gradients is
        ready (on whichever stream autograd made it: waiting only for the stream of the
        hook that filled the bucket raced a streamed model's other branches, H100:
        bench/results/archive/h100_late_debug2_4d32aeb.log)."""
        ps, self.pending, self.pending_n = self.pending, [], 0
        ready, self.ready_on = self.ready_on, {}
        live = self._live(ps)
        try:
            self.owner._capture_plan(live, bind=False)
        except RuntimeError:
            self.left += ps   # for finish's plan, which refuses them as capture_step would
            return
        for ev in ready.values():
            self.stream.wait_event(ev)
        with torch.cuda.stream(self.stream):
            self.owner._capture_launch(live, self.counted)
        self.launches += 1
        self.done += ps

    def finish(self):
        """After the backward: the hooks removed, what is left updated on the current
        stream after it waits for ``stream``; the capture plan of every parameter
        updated (RuntimeError as capture_step's where it would refuse)."""
        self.close()
        seen = set(self.done + self.pending + self.left)
        late = [p for p in self.group_of if p.grad is not None and p not in seen]   # set after their hook ran
        rest = self.pending + self.left + late
        plan = self.owner._capture_plan(self._live(self.done + rest))
        if self.launches:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        if rest:
            self.owner._capture_launch(self._live(rest), self.counted)
        return plan

    def close(self):
        """Removes the hooks (finish does; a capture that fails calls it)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _AmpView:
    """What torch.amp.GradScaler steps for a KitsuneOptimizer: GradScaler reads only
    param_groups and calls step, here the fused update. It keys its per-optimizer state
    by this object, so there is one per KitsuneOptimizer."""

    def __init__(self, owner):
        self._owner = owner

    @property
    def param_groups(self):
        return self._owner.param_groups

    def step(self):
        self._owner._update()


class KitsuneOptimizer(torch.optim.Optimizer):
    """See the module docstring. ``enable_fusion=False`` always runs the wrapped
    optimizer's step; ``profile=True`` times each step with CUDA events (a sync a
    step) instead of host time. ``num_streams`` is accepted for the seed API; the
    fused step is one launch per group and uses the current stream.
    ``enable_amp=True``: dynamic loss scaling for fp16 training, by a
    ``torch.amp.GradScaler`` the optimizer owns (``amp_options`` are its arguments)::

        opt.scale(loss).backward()
        opt.unscale_()          # optional: before gradient clipping
        opt.step()              # unscales, skips the update on inf/NaN gradients, updates the scale

    As with GradScaler, ``step`` reads the inf check on the host (one sync a step), a
    skipped step changes no parameter, state or step count, and the parameters stay
    fp32 (fp16 compute comes from ``torch.autocast``; GradScaler refuses fp16
    gradients). ``opt.scaler`` is the GradScaler (its ``state_dict`` holds the scale).
    Under kitsune.compile_step the whole scaled step is one CUDA graph with no sync
    (capture_amp_step): the skip is decided on the device."""

    def __init__(self, optimizer, params=None, *, enable_amp=False, enable_fusion=True, num_streams=4,
                 profile=False, amp_options=None, **options):
        if isinstance(optimizer, KitsuneOptimizer):
            raise TypeError("KitsuneOptimizer: the optimizer is already a KitsuneOptimizer; use it as it is")
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None or options:
                raise TypeError("KitsuneOptimizer: pass either an optimizer instance, or an optimizer class with "
                                "params and its options")
            self.optimizer = optimizer
        elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if params is None:
                raise TypeError(f"KitsuneOptimizer({optimizer.__name__}, params, ...): params is required")
            self.optimizer = optimizer(params, **options)
        else:
            raise TypeError(f"KitsuneOptimizer: expected a torch.optim.Optimizer or its class, got {optimizer!r}")
        if amp_options is not None and not enable_amp:
            raise ValueError("KitsuneOptimizer: amp_options needs enable_amp=True")
        if not isinstance(num_streams, int) or num_streams < 1:
            raise ValueError(f"KitsuneOptimizer: num_streams must be an int >= 1, got {num_streams!r}")
        self.enable_fusion, self.profile, self.num_streams = enable_fusion, profile, num_streams
        self._steps = self._fused = 0
        self._times = []
        self._path = "no step yet"
        self._hyper, self._hyper_mirror = None, {}   # see capture_step
        self._counts = None   # _StepCounts of the Adam state's step tensors, made by capture_step
        # None, or a callable told True before and False after each captured update's launches
        # (compile_step's recording capture: which of the graph's nodes are the update)
        self._launch_mark = None
        self.enable_amp, self._amp_options, self.scaler = bool(enable_amp), dict(amp_options or {}), None
        self._amp_view, self._skipped = _AmpView(self), 0
        # captured loss-scaled steps (capture_amp_step): the device's count of skipped
        # replays, how many of them the host has seen, and the plans replayed since (_settle)
        self._amp_skips, self._amp_skips_seen, self._unsettled = None, 0, {}
        # torch.optim.Optimizer's hook registries, as its __init__ makes them. That __init__
        # is not called: it would copy the parameter groups, and these must stay the wrapped
        # optimizer's own (param_groups, state and defaults are properties).
        for hooks in _OPTIMIZER_HOOKS:
            setattr(self, hooks, OrderedDict())

    # ---- torch.optim's interface, from the wrapped optimizer ----
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        self._settle()
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self._settle()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._settle()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group):
        self.optimizer.add_param_group(group)

    def __repr__(self):
        return f"KitsuneOptimizer({self.optimizer!r})"

    # torch.optim.Optimizer pickles only defaults, state and param_groups: a KitsuneOptimizer
    # keeps its whole self (the wrapped optimizer holds those three) but, as torch.optim,
    # not its hooks or an LR scheduler's wrapper of its step
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in _OPTIMIZER_HOOKS and k != "step"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for hooks in _OPTIMIZER_HOOKS:
            setattr(self, hooks, OrderedDict())

    # ---- loss scaling (enable_amp=True) ----
    def _need_amp(self, what):
        if not self.enable_amp:
            raise RuntimeError(f"KitsuneOptimizer.{what}: needs enable_amp=True")
        if self.scaler is None:
            devices = {p.device.type for g in self.param_groups for p in g["params"]}
            self.scaler = torch.amp.GradScaler(devices.pop() if len(devices) == 1 else "cuda", **self._amp_options)
        return self.scaler

    def scale(self, loss):
        """loss times the current loss scale (enable_amp=True): call backward on this."""
        return self._need_amp("scale").scale(loss)

    def unscale_(self):
        """Divides the gradients by the loss scale now (for clipping before step)."""
        self._need_amp("unscale_").unscale_(self._amp_view)

    # ---- the step ----
    @torch.optim.Optimizer.profile_hook_step   # step pre/post hooks, as torch.optim runs them
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        timed = self.profile and any(p.is_cuda for g in self.param_groups for p in g["params"])
        if timed:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        self._settle()
        if self.enable_amp:
            scaler, stepped = self._need_amp("step"), self._steps
            scaler.step(self._amp_view)   # unscales if not yet, checks for inf/NaN, then calls _update()
            scaler.update()
            if self._steps == stepped:
                self._skipped += 1
                self._path = "skipped (inf or NaN gradients; the loss scale is lowered)"
        else:
            self._update()
        if timed:
            b.record()
            b.synchronize()
            self._times.append(a.elapsed_time(b))
        else:
            self._times.append((time.perf_counter() - t0) * 1e3)
        return loss

    def _why_not_fused(self):
        return "enable_fusion=False" if not self.enable_fusion else _why_not(self.optimizer)

    def _update(self):
        """One update: fused where it can be, else the wrapped optimizer's step."""
        why = self._why_not_fused()
        if why is None:
            with torch.no_grad():
                why = self._sgd_step() if isinstance(self.optimizer, torch.optim.SGD) else self._adam_step()
        if why is None:
            self._fused += 1
            self._path = "fused"
            # what calling the wrapped optimizer's step tells an LR scheduler attached to
            # it (torch.optim.lr_scheduler wraps step to set this); step hooks registered on
            # the wrapped optimizer do not run on the fused path
            self.optimizer._opt_called = True
        else:
            self.optimizer.step()
            self._path = f"torch.optim ({why})"
        self._steps += 1

    def _adam_step(self):
        """Returns the reason when the step cannot be fused (nothing stepped), else None."""
        opt = self.optimizer
        work = []
        for g in opt.param_groups:
            live = [p for p in g["params"] if p.grad is not None]
            if not live:
                continue
            states = [opt.state[p] for p in live]
            for p, st in zip(live, states):
                if len(st) == 0:   # as torch.optim.Adam initialises it (non-capturable)
                    st["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            work.append((g, live, states))
        why = _fusable_or_why([p for w in work for p in w[1]])
        if why is not None:
            return why
        for g, live, states in work:
            grads = [p.grad for p in live]   # after _fusable_or_why, which may conform them
            beta1, beta2 = g["betas"]
            decoupled = _decoupled(opt, g)
            # the steps are counted and the tensors bucketed by (device, dtype, step) in C++
            _lib.adam_step_([_local(p) for p in live], [_local(x) for x in grads],
                            [_local(st["exp_avg"]) for st in states], [_local(st["exp_avg_sq"]) for st in states],
                            [st["step"] for st in states], float(g["lr"]), float(beta1), float(beta2),
                            float(g["eps"]), float(g["weight_decay"]), decoupled)
        return None

    def _sgd_step(self):
        """Returns the reason when the step cannot be fused (nothing stepped), else None."""
        opt = self.optimizer
        live = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        why = _fusable_or_why(live)
        if why is not None:
            return why
        for g in opt.param_groups:
            momentum = float(g["momentum"])
            buckets = {}
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = opt.state[p]
                buf = st.get("momentum_buffer") if momentum != 0 else None
                first = momentum != 0 and buf is None
                if first:   # torch.optim.SGD starts the buffer as a copy of the gradient
                    buf = st["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
                key = (p.device, p.dtype, first)
                lists = buckets.setdefault(key, ([], [], []))
                lists[0].append(_local(p)), lists[1].append(_local(p.grad))
                if momentum != 0:
                    lists[2].append(_local(buf))
            for (_, _, first), (ps, gs, bs) in buckets.items():
                _lib.sgd_(ps, gs, bs, float(g["lr"]), momentum, float(g["dampening"]), float(g["weight_decay"]),
                          bool(g["nesterov"]), first)
        return None

    # ---- under a CUDA graph (kitsune.compile_step) ----
    # A captured step cannot take the learning rate and step count as launch constants,
    # so it reads them from _hyper (float64 on the device, one row {lr, step} a group),
    # which sync_hyper() brings up to date before each replay; the CPU step counts that
    # torch.optim's state_dict shows are counted forward after each replay.
    def prepare_capture(self, device):
        """Before a capture, outside it: makes the device rows capture_step reads (once;
        every graph captured from this optimizer shares them)."""
        self._settle()
        n = len(self.optimizer.param_groups)
        if self._hyper is None or self._hyper.device != torch.device(device) or self._hyper.shape[0] != n:
            self._hyper = torch.zeros(n, 2, dtype=torch.float64, device=device)
            self._hyper_mirror = {}
        if self.enable_amp and (self._amp_skips is None or self._amp_skips.device != torch.device(device)):
            self._amp_skips, self._amp_skips_seen = torch.zeros(1, dtype=torch.float64, device=device), 0

    def capture_step(self, found_inf=None):
        """Runs the step as torch.ops.kitsune.adam_capturable_ / sgd_capturable_, to be
        recorded into a CUDA graph (after prepare_capture), and returns the plan that
        sync_hyper() (before every replay, the first included) and replayed() take;
        raises RuntimeError with the reason when the step cannot be captured.
        found_inf: a device flag (torch.amp's inf check) that, where not 0 when the
        update runs, leaves parameters, state and step counts as they are."""
        live = [[p for p in g["params"] if p.grad is not None] for g in self.optimizer.param_groups]
        plan = self._capture_plan(live)
        self._capture_launch(live, set(), found_inf)
        return plan

    def capture_amp_step(self):
        """capture_step under loss scaling (enable_amp=True), for a CUDA graph, with no host
        sync: the GradScaler's unscale_ (unless called already, for clipping), the update
        conditional on its inf check on the device, and the scaler's update() of the
        scale, all recorded (GradScaler's own calls and arithmetic). A replay then does
        what step() does eagerly, but a replay cannot tell the host whether it skipped:
        the host's step counts (torch.optim's "step" state) are moved on at each replay
        and put right from the device at the next state, state_dict, load_state_dict,
        get_stats, eager step or capture (_settle, one sync)."""
        scaler = self._need_amp("capture_amp_step")
        if not scaler.is_enabled():   # GradScaler(enabled=False): no scaling, no check
            return self.capture_step()
        if self._amp_skips is None:
            raise RuntimeError("the optimizer step cannot be captured: prepare_capture(device) was not called")
        view = self._amp_view
        # GradScaler keeps its inf checks per optimizer (here the view) until update(); a
        # private structure, read where GradScaler.step would read it on the host
        state = scaler._per_optimizer_states[id(view)]
        if state["stage"] is not _AMP_UNSCALED:
            scaler.unscale_(view)
        found = list(state["found_inf_per_device"].values())
        if len(found) != 1:
            raise RuntimeError(f"the optimizer step cannot be captured: loss scaling needs the gradients on one "
                               f"device, found inf checks on {len(found)}")
        plan = self.capture_step(found_inf=found[0])
        plan.amp = True
        self._amp_skips.add_(found[0])
        scaler.update()
        return plan

    def _first_update_pending(self):
        """Whether a parameter with a gradient has none of the optimizer state a capture
        needs yet (Adam's moments, SGD's momentum buffer): the loss scaler skipped its
        first update."""
        opt = self.optimizer
        sgd = isinstance(opt, torch.optim.SGD)
        return any(p.grad is not None and _no_state_yet(sgd, g, opt.state.get(p, {}))
                   for g in opt.param_groups for p in g["params"])

    def _amp_forget(self):
        """After a capture that failed: the scaler's per-optimizer record (inf checks the
        graph never computed) is dropped, so the next step checks afresh."""
        if self.scaler is not None:
            self.scaler._per_optimizer_states.pop(id(self._amp_view), None)

    def _settle(self):
        """The host's step counts after replays of loss-scaled plans (capture_amp_step),
        each counted as a step by replayed(): the device's count of skipped replays says
        how many were not (one sync), and each Adam group's device step count is the
        true one. Nothing to do (no sync) when no such plan was replayed since."""
        if not self._unsettled:
            return
        plans, self._unsettled = list(self._unsettled.values()), {}
        total = int(self._amp_skips.item())
        d, self._amp_skips_seen = total - self._amp_skips_seen, total
        if d == 0:
            return
        self._skipped += d
        self._steps -= d
        self._fused -= d
        self._path = "fused, in a CUDA graph (kitsune.compile_step); skipped replays (inf or NaN gradients)"
        counts = self._hyper[:, 1].tolist()   # each group's true step count
        for plan in plans:
            for gi, states in plan.group_states.items():
                true = counts[gi]
                for st in states:
                    st["step"].fill_(true)
                if gi in self._hyper_mirror:
                    self._hyper_mirror[gi] = (self._hyper_mirror[gi][0], true)

    def _capture_plan(self, live, bind=True):
        """The capture plan for live (per group, the parameters with gradients the step
        updates), after every refusal (RuntimeError with the reason); bind=False: a
        check only, the step counts left as they are."""
        opt = self.optimizer

        def refuse(why):
            raise RuntimeError(f"the optimizer step cannot be captured: {why}")

        why = self._why_not_fused()
        if why is not None:
            refuse(why)
        flat = [p for ps in live for p in ps]
        # conformed here on the stream the update runs on; an in-backward bucket's by its hook
        why = _fusable_or_why(flat, conform=bind)
        if why is not None:
            refuse(why)
        if any(p.device.type != "cuda" or p.device != flat[0].device for p in flat):
            refuse("the parameters must be on one CUDA device")
        sgd = isinstance(opt, torch.optim.SGD)
        plan = _CapturePlan()
        for gi, (g, ps) in enumerate(zip(opt.param_groups, live)):
            if not ps:
                continue
            states = [opt.state[p] for p in ps]
            if any(_no_state_yet(sgd, g, st) for st in states):
                refuse("SGD's momentum buffers are made by a first eager step" if sgd else
                       "Adam's state is made by a first eager step")
            if not sgd:
                counts = sorted({float(st["step"]) for st in states})
                if len(counts) > 1:
                    refuse(f"a group's parameters are at different step counts {counts}")
                plan.states += states
                plan.group_states[gi] = states
            plan.groups.append((gi, None if sgd else states[0]))
            plan.baked[gi] = _baked(g)
        if not flat:
            return plan
        if self._hyper is None or self._hyper.device != flat[0].device or self._hyper.shape[0] != len(opt.param_groups):
            refuse("prepare_capture(device) was not called with the parameters' device and groups")
        if bind:
            self._bind_steps(plan)   # after every refusal: a refused capture leaves the state as it was
        return plan

    def _capture_launch(self, live, counted, found_inf=None):
        """The fused update of live (per group, parameters with gradients), one launch
        per group and dtype, on the current stream, reading lr and step count from the
        device rows (no sync_hyper here: its writes would be captured too, and every
        replay would put back the lr and step count of the capture). An Adam group's
        device step count moves on in its first launch of the capture: counted holds
        the groups already counted (this call adds to it), whose launches must come
        after that one on the GPU. found_inf: as capture_step's."""
        opt = self.optimizer
        sgd = isinstance(opt, torch.optim.SGD)
        mark = self._launch_mark
        if mark is not None:
            mark(True)
        with torch.no_grad():
            for gi, ps in enumerate(live):
                g = opt.param_groups[gi]
                by_dtype = {}
                for p in ps:
                    by_dtype.setdefault(p.dtype, []).append(p)
                for group in by_dtype.values():
                    states = [opt.state[p] for p in group]
                    grads = [p.grad for p in group]
                    if sgd:
                        bufs = [st["momentum_buffer"] for st in states] if g["momentum"] != 0 else []
                        _lib.sgd_capturable_(group, grads, bufs, self._hyper[gi, :1], float(g["momentum"]),
                                             float(g["dampening"]), float(g["weight_decay"]), bool(g["nesterov"]),
                                             found_inf=found_inf)
                    else:
                        beta1, beta2 = g["betas"]
                        _lib.adam_capturable_(group, grads, [st["exp_avg"] for st in states],
                                              [st["exp_avg_sq"] for st in states], self._hyper[gi], float(beta1),
                                              float(beta2), float(g["eps"]), float(g["weight_decay"]),
                                              _decoupled(opt, g), gi not in counted, found_inf=found_inf)
                        counted.add(gi)
        if mark is not None:
            mark(False)

    def capture_in_backward(self, stream, buckets=6):
        """For a capture whose backward comes next: updates each parameter during the
        backward, once its gradient is final (a post-accumulate-grad hook), a bucket
        of them at a time on ``stream`` (which waits there for each of the bucket's
        gradients, on the stream autograd made it on), so the update overlaps the
        rest of the backward. Returns an _InBackward whose
        finish(), after the backward, updates what is left on the current stream,
        joins ``stream`` to it and returns the plan capture_step would have; raises
        RuntimeError as capture_step does when the step cannot be captured (an
        optimizer or options the fused kernel does not cover: before any hook is set;
        a parameter it cannot update: from finish, the parameter left to it). Every
        parameter reads the same device lr and step count, so the arithmetic is
        capture_step's. Not for gradient clipping or loss scaling, which need every
        gradient before any update."""
        why = self._why_not_fused()
        if why is not None:
            raise RuntimeError(f"the optimizer step cannot be captured: {why}")
        want = [[p for p in g["params"] if p.requires_grad] for g in self.optimizer.param_groups]
        return _InBackward(self, want, stream, buckets)

    def _bind_steps(self, plan):
        """Makes the plan's step counts views of one tensor (_StepCounts), every Adam
        state's of this optimizer with them, so that later captures find them bound."""
        if not plan.states:
            return
        opt = self.optimizer
        every = [opt.state[p] for g in opt.param_groups for p in g["params"]
                 if p in opt.state and "step" in opt.state[p]]
        if self._counts is None or not self._counts.holds(every):
            if not _StepCounts.bindable(every):
                return   # replayed() counts them one by one
            self._counts = _StepCounts(every)   # plans made before count through their state dicts
        plan.counts, plan.mask = self._counts, self._counts.mask(plan.states)

    def sync_hyper(self, plan):
        """Before a replay: writes a group's lr, and (Adam) its step count before this
        step, to the device where they changed since the last write (an LR scheduler,
        an eager step in between). Returns False, writing nothing, when a hyperparameter
        the graph bakes in (betas, eps, weight decay, momentum, ...) has changed since
        the capture: the caller captures again."""
        groups = self.optimizer.param_groups
        if any(_baked(groups[gi]) != baked for gi, baked in plan.baked.items()):
            return False
        for gi, st in plan.groups:
            lr = groups[gi]["lr"]
            if isinstance(lr, torch.Tensor) or lr < 0:
                raise ValueError(f"KitsuneOptimizer: a captured step needs a float lr >= 0; group {gi} has {lr!r}")
            now = (float(lr), 0.0 if st is None else float(st["step"]))
            was = self._hyper_mirror.get(gi, (None, None))
            for k in (0, 1):   # one fill a changed value: an LR schedule changes only the lr
                if was[k] != now[k]:
                    self._hyper[gi, k].fill_(now[k])
            self._hyper_mirror[gi] = now
        return True

    def replayed(self, plan):
        """After a replay: torch.optim's CPU step counts, and their device mirror, move
        one step on."""
        if plan.counts is not None and plan.counts is self._counts:
            plan.counts.base.add_(plan.mask)
        elif plan.states:   # not bindable, or bound anew by a later capture
            torch._foreach_add_([st["step"] for st in plan.states], 1.0)
        for gi, st in plan.groups:
            if st is not None and gi in self._hyper_mirror:
                lr, n = self._hyper_mirror[gi]
                self._hyper_mirror[gi] = (lr, n + 1)
        self._steps += 1
        self._fused += 1
        self._path = "fused, in a CUDA graph (kitsune.compile_step)"
        self.optimizer._opt_called = True
        if plan.amp:   # whether it skipped, the device knows (_settle)
            self._unsettled[id(plan)] = plan

    def get_stats(self):
        """Measured numbers: updates run and fused, the last step's path (with the
        reason when not fused), step times in ms (CUDA events with profile=True, else
        host time), the optimizer state's tensors and bytes, and with enable_amp the
        steps skipped for inf/NaN gradients and the current loss scale."""
        self._settle()
        tensors = [t for st in self.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        stats = {"steps": self._steps, "fused_steps": self._fused, "path": self._path,
                 "timing": "cuda events" if self.profile else "host",
                 "last_step_ms": self._times[-1] if self._times else None,
                 "mean_step_ms": sum(self._times) / len(self._times) if self._times else None,
                 "state_tensors": len(tensors), "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
        if self.enable_amp:
            stats["skipped_steps"] = self._skipped
            stats["loss_scale"] = self.scaler.get_scale() if self.scaler is not None else None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["cuda_memory_allocated"] = torch.cuda.memory_allocated()
        return stats
