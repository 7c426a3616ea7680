"""Single-process references that distributed runs must reproduce (shared/DESIGN.md §5)."""
from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.local_ops import RANK_STREAM_OFFSET
from fxpar.mesh import Mesh
from fxpar.runtime.executor import make_scheduler

__all__ = ["reference_training", "tp_streams_reference", "ddp_reference", "ddp_worker", "max_abs_diff",
           "replica_gradients"]


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


class _TpStreams(TorchDispatchMode):
    """Draws each dropout mask of an eager forward as the tp ranks of one replica draw it: a whole one from torch's
    generator (the stream the tp group shares), a split one as the pieces each tp rank draws from its own stream,
    put together."""

    def __init__(self, drawn: list, mesh: Mesh, gens: list):
        super().__init__()
        self.drawn, self.mesh, self.gens, self.i = drawn, mesh, gens, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.p):
            if torch.Tag.nondeterministic_seeded in func.tags and func is not torch.ops.aten.empty_like.default \
                    and kwargs.get("dropout_p", args[3] if "attention" in str(func) and len(args) > 3 else 0.0) != 0.0:
                raise NotImplementedError(f"tp_streams_reference draws dropout masks (bernoulli) only, not {func}")
            return func(*args, **kwargs)
        x, p = args[0], (args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        if self.i >= len(self.drawn):
            raise AssertionError(f"the forward draws more masks than the graph's {len(self.drawn)} random ops")
        d = self.drawn[self.i]
        self.i += 1
        if tuple(x.shape) != tuple(d["shape"]):
            raise AssertionError(f"random op {self.i - 1} of the forward has shape {tuple(x.shape)}, the graph's "
                                 f"{d['node']} {tuple(d['shape'])}: the model draws in another order than its graph")
        if d["stream"] == "shared":
            return func(*args, **kwargs)
        whole = torch.empty_like(x)
        for c, gen in enumerate(self.gens):
            coords, piece = self.mesh.coords(c), whole
            for dim, axis in enumerate(d["dims"]):
                if axis is not None:
                    piece = piece.chunk(self.mesh.axis_size(axis), dim)[coords[axis]]
            piece.copy_(torch.bernoulli(torch.empty_like(piece), p, generator=gen))
        if func is torch.ops.aten.bernoulli_.float:
            return x.copy_(whole)
        return whole


def tp_streams_reference(model, batches, loss_fn, optimizer, drawn: list, axes, seed: int = 0, dp: int = 1):
    """One process training ``model`` as ``Strategy(dp=dp, tp=n)`` draws its dropout masks (one stage, one
    microbatch; docs/semantics.md, "Random numbers under tensor parallelism"). ``drawn``: the random ops of the
    stage in graph order (the Plan's ``tensor_parallel`` section, ``stages[0]["random"]``), ``axes``: the tp mesh
    axes (``[[name, size], ...]``).

    Each global batch is cut on dim 0 into ``dp`` replicas' rows. Replica ``d`` is the tp group of ranks
    ``d*n .. d*n + n-1``: a mask on a whole tensor is drawn from a generator seeded ``seed + d*n`` (the stream its
    tp ranks share); a mask on a split tensor is the concatenation of the pieces tp rank ``c`` draws from a
    generator seeded ``RANK_STREAM_OFFSET + seed + d*n + c``, each cut where the Plan's layout cuts it. Every
    stream continues from step to step. The step's loss and gradient are the mean over the replicas (each
    replica's rows count the same), the buffers those of replica 0 (``broadcast_buffers``). Returns (losses,
    state_dict), as :func:`reference_training`."""
    mesh = Mesh(tuple((a, int(n)) for a, n in axes))
    width = mesh.size
    gens = [[torch.Generator().manual_seed(RANK_STREAM_OFFSET + seed + d * width + c) for c in range(width)]
            for d in range(dp)]
    m = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    losses = []
    with torch.random.fork_rng(devices=[]):
        shared = []
        for d in range(dp):
            torch.manual_seed(seed + d * width)
            shared.append(torch.get_rng_state())
        for b in batches:
            rows = b[0].shape[0] // dp
            base = {k: v.clone() for k, v in m.named_buffers()}
            opt.zero_grad()
            step_losses, kept = [], None
            for d in range(dp):
                with torch.no_grad():
                    for k, v in m.named_buffers():
                        v.copy_(base[k])
                torch.set_rng_state(shared[d])
                mode = _TpStreams(drawn, mesh, gens[d])
                with mode:
                    loss = _loss(m, tuple(t[d * rows:(d + 1) * rows] for t in b), loss_fn)
                if mode.i != len(drawn):
                    raise AssertionError(f"the forward drew {mode.i} mask(s), the graph {len(drawn)}")
                shared[d] = torch.get_rng_state()
                (loss / dp if dp > 1 else loss).backward()
                step_losses.append(loss.item())
                if d == 0:
                    kept = {k: v.clone() for k, v in m.named_buffers()}
            with torch.no_grad():
                for k, v in m.named_buffers():
                    v.copy_(kept[k])
            opt.step()
            losses.append(sum(step_losses) / dp)
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
               seed: int | None = None, compile_model: bool = False) -> dict:
    """Train with torch's own DistributedDataParallel on the already-initialised default group.

    Run it on every rank of a LocalCluster: ``lc.run(ddp_worker, [(model, batches, loss_fn, opt)] * n)``.
    Returns this rank's losses (the global-batch loss, averaged over ranks), step times, and (rank 0)
    the trained state. The first ``warmup`` batches are trained but not timed. ``seed``: each rank
    calls ``torch.manual_seed(seed + rank)`` first (as fxpar's ``run_local(seed=...)`` does). ``compile_model``:
    the DDP model goes through ``torch.compile`` (inductor; DDP's graph breaks at its buckets), compiled in the
    first, untimed, steps.
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
    if compile_model:
        m = torch.compile(m)
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


def replica_gradients(replicas: list, batch, loss_fn) -> tuple:
    """Replica ``r`` of ``replicas`` (dp of them) on shard ``r`` of ``batch`` (``(inputs..., target)``, split on dim 0):
    ``(grads, loss)``, ``grads[r]`` its ``{name: gradient}`` at its own weights, ``loss`` the mean of the shard
    losses. The step of the one-process references of methods whose replicas differ."""
    *inputs, target = batch
    dp = len(replicas)
    n = target.shape[0] // dp
    grads, total = [], 0.0
    for r, m in enumerate(replicas):
        shard = [x[r * n:(r + 1) * n] for x in (*inputs, target)]
        loss = loss_fn(m(*shard[:-1]), shard[-1])
        total += loss.item() / dp
        named = dict(m.named_parameters())
        grads.append(dict(zip(named, torch.autograd.grad(loss, list(named.values())))))
    return grads, total
