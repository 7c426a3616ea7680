"""fxpar's passes, one per module. Each is ``(GraphModule, PassContext) -> PassResult``."""
from .bucket import BucketGradients
from .data_parallel import DataParallelGradSync, SyncBuffers
from .recompute import Recompute
from .reinplace import ReinplaceOptimizer
from .split_graphs import SplitGraph, SplitGraphs, split_graphs

__all__ = ["DataParallelGradSync", "BucketGradients", "SyncBuffers", "ReinplaceOptimizer", "SplitGraphs",
           "SplitGraph", "split_graphs", "Recompute"]
