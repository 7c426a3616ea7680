"""The planner's communication decisions: gradient buckets.

:func:`plan_buckets` (DDP-style buckets of a stage, once its joint graph shows backward's order) runs once a stage
is captured. A feature that plans its own communication (pieces and their priority, a tuned bucket size, gradients
sent another way than in buckets) does it in its own module, ``fxpar/features/``, through the Feature hooks.
"""
from __future__ import annotations

import torch

from . import meta as M

__all__ = ["plan_buckets"]


def plan_buckets(captured, cap_bytes: int, first_cap_bytes: int | None = None, groups: dict | None = None,
                 order: list | None = None) -> list:
    """DDP-style buckets of one stage: gradients in the order backward produces them, cut at ``cap_bytes``;
    the first bucket at ``min(first_cap_bytes, cap_bytes)`` (DDP: 1 MiB), as DDP's rebuilt buckets. Each
    bucket holds one dtype and one group (``groups``: key -> group name; keys mapped to None are left out).
    ``order``: the order backward makes them in, where a feature's pass reorders backward (else as traced)."""
    order = list(order or [])
    for n in captured.gm.graph.nodes:
        key = M.get(n, M.GRAD_OF)
        if key is not None and key not in order:
            order.append(key)
    for key in captured.param_names:      # gradients never produced in backward (unused params) come last
        if key not in order:
            order.append(key)
    if groups is not None:
        order = [k for k in order if groups.get(k)]
    buckets, cur, size = [], [], 0
    for key in order:
        nbytes = _numel(captured.param_shapes[key]) * _itemsize(captured.param_dtypes[key])
        limit = cap_bytes if buckets or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)
        split = bool(cur) and (captured.param_dtypes[key] != captured.param_dtypes[cur[-1]]   # one dtype, as DDP
                               or (groups is not None and groups[key] != groups[cur[-1]]))
        if cur and (limit == 0 or size + nbytes > limit or split):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
