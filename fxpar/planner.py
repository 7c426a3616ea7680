"""The planner: Strategy + captured graph + cluster → Plan. Decides; passes carry out."""
from __future__ import annotations

import torch

from . import meta as M
from .capture import CapturedStep
from .errors import StrategyError
from .plan import Plan
from .strategy import Strategy

__all__ = ["make_plan", "plan_buckets", "check_batch"]


def check_batch(batch, dp: int, batch_dim: int = 0) -> int:
    """Return the global batch size; raise naming the tensor if dp does not divide it."""
    sizes = set()
    for i, t in enumerate(batch):
        if t.dim() <= batch_dim:
            raise StrategyError(f"example_inputs[{i}] has shape {tuple(t.shape)}: no batch dim {batch_dim} to split over dp={dp}")
        b = t.shape[batch_dim]
        if b % dp:
            raise StrategyError(
                f"example_inputs[{i}] has batch {b} (shape {tuple(t.shape)}), which dp={dp} does not divide: "
                f"use a global batch that is a multiple of {dp} (e.g. {b - b % dp or dp}) or change dp.")
        sizes.add(b)
    if len(sizes) > 1:
        raise StrategyError(f"example_inputs have different batch sizes {sorted(sizes)} on dim {batch_dim}; "
                            "every tensor of a batch must carry the batch on the same dim")
    return sizes.pop()


def plan_buckets(cap: CapturedStep, cap_bytes: int, first_cap_bytes: int | None = None) -> list:
    """DDP-style buckets: gradients in the order backward produces them, cut at ``cap_bytes``;
    the first bucket at ``min(first_cap_bytes, cap_bytes)`` (DDP: 1 MiB), as DDP's rebuilt buckets."""
    order = []
    for n in cap.gm.graph.nodes:
        key = M.get(n, M.GRAD_OF)
        if key is not None:
            order.append(key)
    for key in cap.param_names:           # gradients never produced in backward (unused params) come last
        if key not in order:
            order.append(key)
    buckets, cur, size = [], [], 0
    for key in order:
        nbytes = _numel(cap.param_shapes[key]) * _itemsize(cap.param_dtypes[key])
        limit = cap_bytes if buckets or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)
        new_dtype = bool(cur) and cap.param_dtypes[key] != cap.param_dtypes[cur[-1]]   # one dtype per bucket, as DDP
        if cur and (limit == 0 or size + nbytes > limit or new_dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def make_plan(strategy: Strategy, cap: CapturedStep, global_batch: int) -> Plan:
    axes = [["dp", strategy.dp]]
    cap_bytes = int(strategy.bucket_cap_mb * 2**20)
    first_cap = int(strategy.first_bucket_cap_mb * 2**20)
    return Plan(
        mesh_axes=axes, global_batch=global_batch, bucket_cap_bytes=cap_bytes, first_bucket_cap_bytes=first_cap,
        buckets=plan_buckets(cap, cap_bytes, first_cap) if strategy.dp > 1 else [],
        broadcast_buffers=strategy.broadcast_buffers,
        optimizer={"name": cap.optimizer.name, "traced": cap.optimizer.traced,
                   "why_not_traced": cap.optimizer.why_not_traced},
        custom_passes=[p.name for p in strategy.passes],
        schedule=strategy.schedule, microbatches=strategy.microbatches)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
