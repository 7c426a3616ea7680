"""Runtime: runs per-rank programs with torch.distributed (gloo on CPU, nccl on GPUs)."""
from .executor import RankPayload, StepExecutor
from .launch import LocalCluster, find_free_port

__all__ = ["RankPayload", "StepExecutor", "LocalCluster", "find_free_port"]
