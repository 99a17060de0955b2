"""kitsune.graph: compile_step, moved here from graph.py (step.py for now; the next
commit splits it by concern)."""
from .step import *  # noqa: F401,F403
from .step import (_CAPTURE_STREAMS, _CAPTURED, _capture_nodes, _conv_weights, _fastest_way,  # noqa: F401
                   _graphs_elsewhere, _late_limit, _nhwc_suits, _node_times, _relayout, _share_workspaces,
                   _signature)
