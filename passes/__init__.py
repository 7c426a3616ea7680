"""fxpar's passes, one per module. Each is ``(GraphModule, PassContext) -> PassResult``."""
from .bucket import BucketGradients
from .comm_schedule import CommSchedule
from .grad_order import GradOrder
from .data_parallel import DataParallelGradSync, SyncBuffers
from .herring import HierarchicalReduce
from .byteps import ServerSum
from .offload import OffloadActivations
from .parallax import SparseGradSync
from .recompute import Recompute
from .reinplace import ReinplaceOptimizer
from .split_graphs import SplitGraph, SplitGraphs, split_graphs
from .propagate_sharding import ShardingConflict, ShardingResult, propagate_shardings
from .lower_sharding import lower_shardings
from .zero import ZeroShard
from .zero_offload import ZeroOffload

__all__ = ["DataParallelGradSync", "BucketGradients", "SyncBuffers", "ReinplaceOptimizer", "SplitGraphs",
           "SplitGraph", "split_graphs", "Recompute", "propagate_shardings", "ShardingResult", "ShardingConflict",
           "lower_shardings", "ZeroShard", "HierarchicalReduce", "OffloadActivations", "SparseGradSync", "CommSchedule",
           "GradOrder", "ServerSum", "ZeroOffload"]
