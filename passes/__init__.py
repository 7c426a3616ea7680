"""fxpar's passes, one per module. Each is ``(GraphModule, PassContext) -> PassResult``."""
from .bucket import BucketGradients
from .data_parallel import DataParallelGradSync, SyncBuffers

__all__ = ["DataParallelGradSync", "BucketGradients", "SyncBuffers"]
