"""Single-process references that distributed runs must reproduce (shared/DESIGN.md §5)."""
from __future__ import annotations

import copy

import torch

from fxpar.runtime.executor import make_scheduler

__all__ = ["reference_training", "ddp_reference", "ddp_worker", "max_abs_diff"]


def _loss(model, batch, loss_fn):
    if loss_fn is None:
        return model(*batch)
    return loss_fn(model(*batch[:-1]), batch[-1])


def reference_training(model, batches, loss_fn, optimizer, lr_scheduler=None):
    """Train a copy of ``model`` on each global batch in one process. Returns (losses, state_dict)."""
    m = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    sched = make_scheduler(lr_scheduler, opt)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = _loss(m, b, loss_fn)
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def ddp_reference(model, batches, loss_fn, optimizer, dp):
    """DistributedDataParallel's semantics in one process: each of ``dp`` shards runs forward with
    rank 0's buffers (broadcast_buffers=True), its own batch statistics, gradients are averaged,
    and rank 0's updated buffers are kept. This is what BatchNorm under dp means (per-rank statistics)."""
    m = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    losses = []
    for b in batches:
        n = b[0].shape[0] // dp
        base = {k: v.clone() for k, v in m.named_buffers()}
        grads, new_bufs, shard_losses = None, None, []
        for r in range(dp):
            with torch.no_grad():
                for k, v in m.named_buffers():
                    v.copy_(base[k])
            opt.zero_grad()
            loss = _loss(m, tuple(t[r * n:(r + 1) * n] for t in b), loss_fn)
            loss.backward()
            shard_losses.append(loss.item())
            g = [p.grad.clone() for p in m.parameters()]
            grads = g if grads is None else [a + c for a, c in zip(grads, g)]
            if r == 0:
                new_bufs = {k: v.clone() for k, v in m.named_buffers()}
        with torch.no_grad():
            for p, g in zip(m.parameters(), grads):
                p.grad = g / dp
            for k, v in m.named_buffers():
                v.copy_(new_bufs[k])
        opt.step()
        losses.append(sum(shard_losses) / dp)
    return losses, m.state_dict()


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over the keys of two state dicts (which must match)."""
    if set(a) != set(b):
        raise AssertionError(f"state dict keys differ: only in first {sorted(set(a) - set(b))}, "
                             f"only in second {sorted(set(b) - set(a))}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def ddp_worker(model, batches, loss_fn, optimizer, bucket_cap_mb: float = 25.0, warmup: int = 0,
               seed: int | None = None) -> dict:
    """Train with torch's own DistributedDataParallel on the already-initialised default group.

    Run it on every rank of a LocalCluster: ``lc.run(ddp_worker, [(model, batches, loss_fn, opt)] * n)``.
    Returns this rank's losses (the global-batch loss, averaged over ranks), step times, and (rank 0)
    the trained state. The first ``warmup`` batches are trained but not timed. ``seed``: each rank
    calls ``torch.manual_seed(seed + rank)`` first (as fxpar's ``run_local(seed=...)`` does).
    """
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    if seed is not None:
        torch.manual_seed(seed + rank)
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    local, times = [], []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        n = b[0].shape[0] // world
        shard = tuple(t[rank * n:(rank + 1) * n] for t in b)
        opt.zero_grad()
        loss = _loss(m, shard, loss_fn)
        loss.backward()
        opt.step()
        local.append(loss.item())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    # The global-batch losses are gathered once at the end, not per step: a per-step all_reduce
    # outside the timed region would re-align the ranks for free every step, which fxpar's step
    # (timed the same way, with no extra collective) does not get.
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)
    losses = (t / world).tolist()
    return {"losses": losses, "step_times": times, "state": m.module.state_dict() if rank == 0 else None}
