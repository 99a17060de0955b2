"""kitsune.sched: the stream planner, moved here from sched.py (streams.py for now; the
next commit splits it by concern)."""
from .streams import *  # noqa: F401,F403
from .streams import (_conv_grads_apart, _late_ok, _meta_val, _plan, _propagate_shapes,  # noqa: F401
                      _splits_conv_grads, _traced)
