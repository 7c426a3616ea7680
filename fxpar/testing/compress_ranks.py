"""Run a gradient-compression :class:`~fxpar.compress.method.Method` on the ranks of a real process group, without
a program: one bucket, a few steps, the method's ``sum`` called eagerly or as the graph ``make_fx`` traces from it.

On each rank (a ``LocalCluster`` worker), :func:`sum_steps` makes the bucket's data with :func:`rank_data` (seeded
by rank and step, already scaled by ``1 / dp``), the state with a generator seeded ``state_seed`` (the same on
every rank) and the host inputs with a generator seeded ``draw_seed + rank`` (a different stream per rank), and
records, per step, the variant, the data, the host inputs, the sum, the new state and the collectives the rank
handed bytes to (``CommCounter``). A test replays the same math in one process from those records.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.compress.method import BucketInfo, Comm
from fxpar.runtime.measure import CommCounter

__all__ = ["bucket_for", "rank_data", "sum_steps"]


def bucket_for(numel: int, dtype: str, dp: int, rank: int = -1) -> BucketInfo:
    """A one-tensor bucket of ``numel`` values (the parameter ``"w"``)."""
    return BucketInfo(stage=0, index=0, count=1, keys=("w",), shapes=((numel,),), offsets=(0,), numel=numel,
                      dtype=dtype, dp=dp, dp_rank=rank)


def rank_data(rank: int, step: int, numel: int, dtype: str, dp: int) -> torch.Tensor:
    """Rank ``rank``'s bucket at ``step``: seeded normal values, a few exact zeros, scaled by ``1 / dp``."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    x = torch.randn(numel, generator=g, dtype=getattr(torch, dtype)) * (1 + rank)
    x[::11] = 0
    return x / dp


def sum_steps(method, numel: int, dtype: str, steps: int, traced: bool, state_seed: int = 0,
              draw_seed: int = 1000) -> list:
    """On a rank of the default group: ``steps`` calls of ``method.sum`` on one bucket (see the module doc)."""
    import torch.distributed as dist
    rank, dp = dist.get_rank(), dist.get_world_size()
    bucket = bucket_for(numel, dtype, dp, rank)
    comm = Comm(dp, rank, group=dist.group.WORLD.group_name)
    state = method.init_state(bucket, torch.Generator().manual_seed(state_seed))
    gen = torch.Generator().manual_seed(draw_seed + rank)
    graphs, records = {}, []
    for step in range(steps):
        flat = rank_data(rank, step, numel, dtype, dp)
        variant = method.variant(bucket, step, state)
        inputs = method.host_inputs(bucket, step, state, variant, gen)

        run = _sum_fn(method, bucket, comm, variant)

        if traced and variant not in graphs:
            graphs[variant] = make_fx(run, tracing_mode="fake")(flat, state, inputs)
        with CommCounter() as counter:
            summed, state = (graphs[variant] if traced else run)(flat, state, inputs)
        records.append({"variant": variant, "flat": flat, "inputs": inputs, "summed": summed,
                        "state": {k: v.clone() for k, v in state.items()}, "calls": counter.calls})
    return records


def _sum_fn(method, bucket, comm, variant):
    def run(flat, state, inputs):
        return method.sum(flat, state, inputs, bucket, comm, variant)
    return run
