"""Runtime: runs per-rank programs with torch.distributed (gloo on CPU, nccl on GPUs)."""
from .executor import Executor, RankPayload
from .launch import LocalCluster, find_free_port
from .settings import RunSettings

__all__ = ["RankPayload", "RunSettings", "Executor", "LocalCluster", "find_free_port"]
