"""kitsune.sched: plans a model's graph onto CUDA streams with the C scheduler
(scheduler/, kitsune/sched.h).

    plan = kitsune.sched.plan(model, example_input, streams=4)
    print(plan)            # per-operation stream, the syncs, estimated gain

The model is traced with torch.fx and its shapes propagated on fake tensors (nothing
is computed), or taken from a real run that ``shape_recorder`` noted them in. Each
operation gets a roofline cost from its FLOPs and bytes (Linear, convolutions and
matmuls count 2 FLOPs a multiply-add; everything else one FLOP an output element;
views, reshapes, getitem and the like are free), or, with
``costs="measured"``, its measured time: ``measure_costs`` runs the forward operation
by operation on the example inputs and times each (CUDA events on a GPU), the model's
buffers and the random generators put back afterwards; ``costs`` may also map node
names to seconds. The C core schedules
the DAG by critical-path list scheduling onto `streams` streams and gives the fewest
cross-stream syncs. ``plan.streams_used`` is 1 when more streams would not shorten
the estimated step by at least 5%: a sequential model keeps one stream.

``streamed(model, example_input, streams=4)`` executes a plan: it returns a copy of the
model's graph with stream ops inserted (``torch.ops.kitsune.stream_fork``,
``stream_switch``, ``stream_record``, ``stream_join``: events between streams where the
plan put a sync, ``record_stream`` on tensors used on another stream than the one that
made them). The streams run while a CUDA graph is being captured (kitsune.compile_step
captures the whole step; autograd runs each backward op on its forward op's stream, so
the backward is spread too; each bias-free convolution, an F.conv2d as kitsune.optimize
leaves a Conv2d with a bias or a bias-free nn.Conv2d with zero padding (torchvision's
ResNets), can also run its weight gradient on a stream beside its input gradient:
_ConvGradsApart in kitsune.sched.conv_grads, see conv_grads_mode). Outside a capture the
module runs on one stream: several streams in eager mode were measured slower on the
H100 (ARCHITECTURE.md, Facts). When the plan gains less than ``min_gain``, the model
comes back unchanged.

The modules, by concern: costs (the roofline, measure_costs, saved_state), planner
(Plan, plan, the shapes: fake tensors or shape_recorder's run), streams (streamed, the
stream ops, branch_priority), conv_grads (a convolution's two gradients apart or late).
"""
from .conv_grads import conv_grad_splits, conv_grads_mode
from .costs import Roofline, measure_costs, saved_state
from .planner import Plan, plan, shape_recorder
from .streams import branch_priority, streamed

__all__ = ["Roofline", "Plan", "plan", "measure_costs", "saved_state", "shape_recorder", "streamed",
           "branch_priority", "conv_grads_mode", "conv_grad_splits"]

