"""Run a gradient-compression :class:`~fxpar.compress.method.Method` on the ranks of a real process group, without
a program: one bucket, a few steps, the method's ``sum`` called eagerly or as the graph ``make_fx`` traces from it.

On each rank (a ``LocalCluster`` worker), :func:`sum_steps` makes the bucket's data with :func:`rank_data` (seeded
by rank and step, already scaled by ``1 / dp``), the state with a generator seeded ``state_seed`` (the same on
every rank) and the host inputs with a generator seeded ``draw_seed + rank`` (a different stream per rank), and
records, per step, the variant, the data, the host inputs, the sum, the new state and the collectives the rank
handed bytes to (``CommCounter``). A test replays the same math in one process from those records.

:func:`training_reference` trains a model in one process with a method's bucket math standing in for each
bucket's all-reduce, calling the method's host side (``init_state``, ``variant``, ``host_inputs``) per rank as
the rank runtime does, with the runtime's generator per rank.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.compress.method import BucketInfo, Comm
from fxpar.compress.runtime import EagerComm, generator_for
from fxpar.runtime.measure import CommCounter

__all__ = ["bucket_for", "rank_data", "sum_steps", "mix_once", "training_reference"]


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


def mix_once(method, numel: int, k: int) -> tuple:
    """On a rank of the default group: one averaging of decentralized SGD (``method`` at averaging step ``k``: its
    sum's variant ``"mix"``, or in the adapt-then-combine order :meth:`Decentralized.combine`, which the rank runs
    after the update) on weights that differ per rank (:func:`rank_data` at step 0, unscaled). Returns the rank's
    weights before and after."""
    import torch.distributed as dist
    rank, dp = dist.get_rank(), dist.get_world_size()
    bucket = bucket_for(numel, "float64", dp, rank)
    comm = EagerComm(dp, rank, dist.group.WORLD)          # as the runtime runs this eager method
    mine = rank_data(rank, 0, numel, "float64", 1)
    if method.order == "adapt_then_combine":
        return mine, method.combine(mine, k, comm)
    _, state = method.sum(torch.zeros_like(mine), {}, [mine, torch.tensor(k)], bucket, comm, "mix")
    return mine, mine + state["delta"]


def _sum_fn(method, bucket, comm, variant):
    def run(flat, state, inputs):
        return method.sum(flat, state, inputs, bucket, comm, variant)
    return run


def training_reference(model, batches, loss_fn, lr: float, method, buckets: list, bucket_math,
                       microbatches: int = 1) -> tuple:
    """SGD on ``model`` in one process, data parallel over ``buckets[0].dp`` shards, each bucket summed by
    ``bucket_math(method, infos, flats, states, inputs, variant) -> (total, new_states)`` (``infos``, ``flats``,
    ``states``, ``inputs``: per rank, in rank order). ``buckets``: the program's :class:`BucketInfo` of every stage
    (``bucket_infos`` of each), summed stage by stage in index order; a rank holds one stage, so each (stage, dp
    rank) draws from its own generator, seeded as the runtime seeds a rank's. Each shard (cut into
    ``microbatches``) makes its gradient scaled by ``1 / (dp * microbatches)``. Returns (losses, state_dict)."""
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    dp = buckets[0].dp
    gens = {(b.stage, r): generator_for(method) for b in buckets for r in range(dp)}
    infos = {(b.stage, b.index): [dataclasses.replace(b, dp_rank=r) for r in range(dp)] for b in buckets}
    states = {i: [dict(method.init_state(infos[i][r], gens[i[0], r])) for r in range(dp)] for i in infos}
    losses = []
    for step, batch in enumerate(batches):
        *inputs, target = batch
        n = target.shape[0] // dp
        grads, total = [], 0.0
        for r in range(dp):
            shard = [t[r * n:(r + 1) * n] for t in (*inputs, target)]
            acc = None
            for mb in zip(*(t.chunk(microbatches) for t in shard)):
                loss = loss_fn(m(*mb[:-1]), mb[-1])
                total += loss.item() / (dp * microbatches)
                g = dict(zip(named, torch.autograd.grad(loss / (dp * microbatches), list(named.values()))))
                acc = g if acc is None else {k: acc[k] + g[k] for k in acc}
            grads.append(acc)
        update = {}
        for b in sorted(buckets, key=lambda b: (b.stage, b.index)):
            at = (b.stage, b.index)
            flats = [torch.cat([grads[r][k].reshape(-1) for k in b.keys]) for r in range(dp)]
            variant = method.variant(infos[at][0], step, states[at][0])
            draws = [list(method.host_inputs(infos[at][r], step, states[at][r], variant, gens[b.stage, r]))
                     for r in range(dp)]
            summed, states[at] = bucket_math(method, infos[at], flats, states[at], draws, variant)
            for key, view in zip(b.keys, b.views(summed)):
                update[key] = view
        with torch.no_grad():
            for key, w in named.items():
                w -= lr * update[key]
        losses.append(total)
    return losses, m.state_dict()
