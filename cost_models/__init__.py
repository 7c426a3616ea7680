"""Cost models of fxpar: compute (FLOPs/bytes per aten op, roofline), comm (α–β per collective
algorithm and link), memory (liveness and closed forms), simulate (per-rank compute/comm lanes),
sequence (a rank's step as a list of graphs and messages),
symbolic (sympy expressions in batch/sequence sizes).

Cost models import neither ``passes`` nor ``fxpar.runtime``. The entry point is::

    est = cost_models.estimate({rank: graph_module, ...}, cluster)
    est = cost_models.estimate({rank: [item, item, ...], ...}, cluster)   # see cost_models.sequence
"""
from .comm import CommCost, collective_cost, comm_info_cost, ring_all_reduce_time
from .compute import FLOP_RULES, GraphCompute, OpCost, graph_compute, node_cost, node_time
from .estimate import Estimate, RankEstimate, estimate
from .memory import (Liveness, korthikanti_activation_bytes, liveness, peak_over_executions, sequence_peak,
                     zero_model_state_bytes)
from .sequence import Item
from .simulate import DeadlockError
from .tracker import PeakMemoryTracker

__all__ = ["estimate", "Estimate", "RankEstimate", "DeadlockError", "Item", "sequence_peak",
           "OpCost", "GraphCompute", "FLOP_RULES", "node_cost", "node_time", "graph_compute",
           "CommCost", "collective_cost", "comm_info_cost", "ring_all_reduce_time",
           "Liveness", "liveness", "peak_over_executions", "zero_model_state_bytes",
           "korthikanti_activation_bytes", "PeakMemoryTracker"]
