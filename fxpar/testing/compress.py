"""References for gradient compression (``fxpar.compress``): torch's DDP with a comm hook on real ranks, and the
sparsification methods' math in one process."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import fxpar

__all__ = ["ddp_hook_worker", "sparse_reference", "sparse_bucket_math", "mlp_batches", "mlp_program"]


def ddp_hook_worker(model, batches, loss_fn, optimizer, hook: str, bucket_cap_mb: float = 25.0) -> dict:
    """Train with torch's DistributedDataParallel and its comm hook ``hook`` (a name in
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: ``"fp16_compress_hook"``, ...) on the
    initialised default group. Run on every rank of a LocalCluster. Returns the global-batch losses (gathered once
    after training) and, on rank 0, the trained state."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    fn = getattr(default_hooks, hook)

    def call(state, bucket):      # by another name: DDP refuses bf16_compress_hook by its name off CUDA + NCCL
        return fn(state, bucket)
    m.register_comm_hook(None, call)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    local = []
    for b in batches:
        n = b[0].shape[0] // world
        shard = tuple(t[rank * n:(rank + 1) * n] for t in b)
        opt.zero_grad()
        loss = loss_fn(m(*shard[:-1]), shard[-1])
        loss.backward()
        opt.step()
        local.append(loss.item())
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)
    return {"losses": (t / world).tolist(), "state": m.module.state_dict() if rank == 0 else None}


def sparse_bucket_math(flats: list, residuals: list, idxs: list, scale: float, error_feedback: bool) -> tuple:
    """One bucket, every rank: rank r sends ``p_r[idx_r] * scale`` with ``p_r = flat_r + residual_r``; the sum, rank 0
    first, of every rank's values at their indices, and the new residuals ``p_r - scatter(idx_r, sent_r)`` (zeros
    without error feedback)."""
    total = torch.zeros_like(flats[0])
    new = []
    for flat, res, idx in zip(flats, residuals, idxs):
        p = flat + res if error_feedback else flat
        sent = p[idx] * scale if scale != 1 else p[idx]
        total = total.index_add(0, idx, sent)
        mine = torch.zeros_like(p)
        mine[idx] = sent
        new.append(p - mine if error_feedback else torch.zeros_like(p))
    return total, new


def sparse_reference(model, batches, loss_fn, lr: float, dp: int, buckets: list, kind: str, ratio: float,
                     error_feedback: bool, unbiased: bool = True, seed: int = 0, microbatches: int = 1) -> tuple:
    """TopK (``kind="topk"``) or RandomK (``"randomk"``) with SGD, in one process. ``buckets``: per stage, its
    buckets (the parameter keys of each, in buffer order), summed stage by stage in bucket order; each of ``dp``
    shards (cut into ``microbatches``) makes its gradient scaled by 1/(dp * microbatches). RandomK: one generator
    per stage seeded ``seed`` (a rank holds one stage), each bucket drawing ``dp`` index sets in rank order. Returns
    (losses, state_dict)."""
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    gens = [torch.Generator().manual_seed(seed) for _ in buckets]
    residual: dict = {}
    losses = []
    for batch in batches:
        *inputs, target = batch
        n = target.shape[0] // dp
        grads, total = [], 0.0
        for r in range(dp):
            shard = [t[r * n:(r + 1) * n] for t in (*inputs, target)]
            acc = None
            for mb in zip(*(t.chunk(microbatches) for t in shard)):
                loss = loss_fn(m(*mb[:-1]), mb[-1])
                total += loss.item() / (dp * microbatches)
                g = torch.autograd.grad(loss / (dp * microbatches), list(named.values()))
                g = dict(zip(named, g))
                acc = g if acc is None else {k: acc[k] + g[k] for k in acc}
            grads.append(acc)
        update = {}
        for s, stage in enumerate(buckets):
            for b, keys in enumerate(stage):
                flats = [torch.cat([grads[r][k].reshape(-1) for k in keys]) for r in range(dp)]
                numel = flats[0].numel()
                k = max(1, min(numel, round(ratio * numel)))
                res = residual.setdefault((s, b), [torch.zeros_like(flats[0]) for _ in range(dp)])
                if kind == "topk":
                    idxs = [torch.topk((f + e if error_feedback else f).abs(), k).indices for f, e in zip(flats, res)]
                    scale = 1
                else:
                    idxs = [torch.randperm(numel, generator=gens[s])[:k] for _ in range(dp)]
                    scale = numel / k if unbiased else 1
                total_b, residual[(s, b)] = sparse_bucket_math(flats, res, idxs, scale, error_feedback)
                off = 0
                for key in keys:
                    sz = named[key].numel()
                    update[key] = total_b[off:off + sz].view(named[key].shape)
                    off += sz
        with torch.no_grad():
            for key, w in named.items():
                w -= lr * update[key]
        losses.append(total)
    return losses, m.state_dict()


def mlp_batches(n: int, batch: int = 8) -> list:
    """``n`` float64 (input, target) batches for :class:`fxpar.testing.MLP` (16 in, 8 out), from a fixed generator."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, dtype=torch.float64, generator=g),
             torch.randn(batch, 8, dtype=torch.float64, generator=g)) for _ in range(n)]


def mlp_program(model, batches, lr: float = 0.1, **strategy):
    """``parallelize`` of ``model`` with MSE and SGD(``lr``) on ``dp x pp`` local ranks, ``Strategy(**strategy)``."""
    world = strategy.get("dp", 1) * strategy.get("pp", 1)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], loss_fn=F.mse_loss,
                             optimizer=(torch.optim.SGD, {"lr": lr}), strategy=fxpar.Strategy(**strategy))
