"""ZeRO's shard layout (Rajbhandari et al., SC'20): which part of each parameter a dp rank owns.

Every parameter ZeRO manages is flattened, padded with zeros to a multiple of the dp size N and cut
into N equal chunks: dp rank i owns elements ``[i*c, (i+1)*c)`` with ``c = ceil(numel / N)``, as
DeepSpeed's flat partitions and FSDP's flat parameters do (one chunk per parameter here, so the
optimizer, which is elementwise, runs on chunks unchanged). The same layout is used by

* the ``zero`` pass (``passes/zero.py``), which reduce-scatters gradient buckets into chunks and
  runs the optimizer on them, and for stage 3 all-gathers the chunks back before use;
* the runtime, which keeps optimizer state (stages 1-3), gradient accumulators (2-3) and parameters
  (3) as chunks, and rebuilds whole tensors for ``state_dict()`` and checkpoints.

A parameter is managed when its gradient is summed over the dp axis alone (``Plan.grad_groups``
names it ``"dp"``): parameters that several pipeline stages share, or that only one rank holds,
stay whole.
"""
from __future__ import annotations

import math

import torch

__all__ = ["chunk_numel", "chunk", "unchunk", "zero_keys", "STAGES", "describe"]

STAGES = (0, 1, 2, 3)


def chunk_numel(numel: int, n: int) -> int:
    """Elements of one dp rank's chunk of a parameter of ``numel`` elements over ``n`` ranks."""
    return max(1, math.ceil(int(numel) / n))


def chunk(full: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """Rank ``i``'s chunk of ``full`` (a view where no padding falls into it, else a padded copy)."""
    flat = full.reshape(-1)
    c = chunk_numel(flat.numel(), n)
    lo, hi = i * c, (i + 1) * c
    if hi <= flat.numel():
        return flat[lo:hi]
    out = flat.new_zeros(c)
    if lo < flat.numel():
        out[:flat.numel() - lo] = flat[lo:]
    return out


def unchunk(chunks: list, shape) -> torch.Tensor:
    """The whole tensor from every rank's chunk, in rank order."""
    numel = math.prod(shape)
    return torch.cat([c.reshape(-1) for c in chunks])[:numel].reshape(shape).clone()


def zero_keys(plan, stage: int) -> list:
    """The parameters of ``stage`` ZeRO shards: those whose gradient the plan sums over the dp axis."""
    if plan.section("zero") is None or plan.dp == 1 or not plan.grad_groups:
        return []
    return [k for k, g in plan.grad_groups[stage].items() if g == "dp"]


def describe(stage: int) -> str:
    return {0: "off", 1: "optimizer state sharded over dp",
            2: "optimizer state and gradients sharded over dp (gradients reduce-scattered)",
            3: "optimizer state, gradients and parameters sharded over dp (parameters all-gathered before use)"}[stage]
