"""Runtime: runs per-rank programs with torch.distributed (gloo on CPU, nccl on GPUs)."""
from .executor import Executor, RankPayload
from .launch import LocalCluster, find_free_port

__all__ = ["RankPayload", "Executor", "LocalCluster", "find_free_port"]
