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
bench/results/archive/models_variants_priority_62ba436.json). KITSUNE_STREAM_PRIORITY=0 turns
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
bias-free Conv2d modules were split (bench/results/archive/models_heuristic_mode_b_b4c5928.json,
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

The modules, by concern: step (CompiledStep: the call path, the first step of a
signature, the stream plan; compile_step), capture (the capture stream and its cuBLAS
workspaces, the capture itself, memset nodes, node times), memory (budgets, memory
plans, late joins held to them), conv_grads (the trials of the convolutions' gradient
ways), layout (channels-last). CompiledStep takes its methods from one class in each.
"""
from .step import CompiledStep, compile_step

__all__ = ["compile_step", "CompiledStep"]
