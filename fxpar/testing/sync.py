"""References for the synchronisation methods (``fxpar.sync``): torch's post-local SGD on real ranks, and DiLoCo's,
SlowMo's, SSP's and DABMD's math in one process."""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from fxpar.sync.method import fragment_keys
from fxpar.testing.reference import replica_gradients

__all__ = ["post_local_sgd_worker", "local_sgd_reference", "nesterov_outer", "slowmo_outer", "ssp_reference",
           "streaming_diloco_reference", "dabmd_reference", "e3m0_reference"]


def post_local_sgd_worker(model, batches, loss_fn, optimizer, period: int, warmup_steps: int,
                          microbatches: int = 1, hierarchical: dict | None = None) -> dict:
    """Post-local SGD as torch runs it, on every rank of a LocalCluster (the initialised default group): DDP (the
    model in one bucket) with ``post_localSGD_hook`` (``PostLocalSGDState(start_localSGD_iter=warmup_steps,
    post_local_gradient_allreduce=False)``) and ``PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period,
    warmup_steps))`` (``hierarchical``, ``{period: group size}``: ``HierarchicalModelAverager`` instead, its subgroups
    made by ``dist.new_subgroups`` on every rank). Each rank trains on its shard of each batch, cut into ``microbatches`` (the gradients of all
    but the last accumulated under ``no_sync``, each loss divided by ``microbatches``). Returns the losses (the
    ranks' shard losses averaged, gathered once after training) and this rank's trained state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=1024)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup_steps,
                              post_local_gradient_allreduce=False)
    m.register_comm_hook(state, post_localSGD_hook)
    cls, kw = optimizer
    with warnings.catch_warnings():                   # period=1 warns that DDP alone would do
        warnings.simplefilter("ignore")
        averager = (PeriodicModelAverager(period=period, warmup_steps=warmup_steps) if hierarchical is None else
                    HierarchicalModelAverager(OrderedDict(sorted(hierarchical.items())), warmup_steps=warmup_steps))
    opt = PostLocalSGDOptimizer(cls(m.parameters(), **kw), averager)
    local = []
    for b in batches:
        n = b[0].shape[0] // world
        shard = tuple(t[rank * n:(rank + 1) * n] for t in b)
        parts = list(zip(*(t.chunk(microbatches) for t in shard)))
        opt.zero_grad()
        total = 0.0
        for i, mb in enumerate(parts):
            last = i == len(parts) - 1
            ctx = m.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(m(*mb[:-1]), mb[-1])
                (loss / microbatches).backward()
            total += loss.item() / microbatches
        opt.step()
        local.append(total)
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)
    return {"losses": (t / world).tolist(), "state": {k: v.detach().clone() for k, v in m.module.state_dict().items()}}


def _local_steps(named: list, opts: list, grads: list, synchronous: bool) -> None:
    """One step of every replica: on the mean of the replicas' gradients (``synchronous``: a warm-up step, as the
    gradient all-reduce), else on its own."""
    dp = len(named)
    for r in range(dp):
        for k, p in named[r].items():
            if synchronous:
                g = grads[0][k] / dp
                for j in range(1, dp):
                    g = g + grads[j][k] / dp
                p.grad = g
            else:
                p.grad = grads[r][k]
        opts[r].step()


def local_sgd_reference(model, batches, loss_fn, optimizer, dp: int, period: int, warmup_steps: int = 0,
                        outer=None) -> tuple:
    """Local SGD in one process, the averaging handed to ``outer``: ``dp`` replicas of ``model``, each with its own
    ``optimizer`` (``(class, kwargs)``), replica ``r`` training on shard ``r`` of each batch. Steps ``t <
    warmup_steps`` step every replica with the replicas' mean gradient; after, each its own. After step ``t >=
    warmup_steps`` with ``(t - warmup_steps) % period == 0`` the replicas' parameters are averaged (the mean, in
    rank order), and ``outer(anchor, average) -> parameters`` (None: the average) makes every replica's parameters
    from the parameters of the last averaging (``anchor``, ``{key: tensor}``) and the average; they become the
    next anchor. Returns (losses: the replicas' shard losses averaged, replicas: each one's state_dict)."""
    reps = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in reps]
    cls, kw = optimizer
    opts = [cls(m.parameters(), **kw) for m in reps]
    anchor = {k: v.detach().clone() for k, v in named[0].items()}
    losses = []
    for t, batch in enumerate(batches):
        grads, total = replica_gradients(reps, batch, loss_fn)
        _local_steps(named, opts, grads, synchronous=t < warmup_steps)
        if t < warmup_steps:
            if t == warmup_steps - 1:
                anchor = {k: v.detach().clone() for k, v in named[0].items()}
        elif (t - warmup_steps) % period == 0:
            with torch.no_grad():
                avg = {}
                for k in named[0]:
                    s = named[0][k] / dp
                    for j in range(1, dp):
                        s = s + named[j][k] / dp
                    avg[k] = s
                new = avg if outer is None else outer(anchor, avg)
                for r in range(dp):
                    for k, p in named[r].items():
                        p.copy_(new[k])
                anchor = {k: v.clone() for k, v in new.items()}
        losses.append(total)
    return losses, [m.state_dict() for m in reps]


def e3m0_reference(x: torch.Tensor) -> torch.Tensor:
    """The 4-bit E3M0 value of each entry of ``x`` as float32, by search over the grid: the candidates ``0`` and
    ``±2^-6 s, ..., ±2^0 s`` (``s``: ``max |x|`` in float32), the nearest taken, a tie to the larger magnitude
    (:mod:`fxpar.sync.quantize` says why this grid and rounding)."""
    v = x.detach().to(torch.float32).reshape(-1)
    s = v.abs().max() if v.numel() else torch.zeros((), dtype=torch.float32)
    if not s > 0:
        return torch.zeros(x.shape, dtype=torch.float32)
    grid = [0.0] + [float(s) * 2.0 ** -i for i in range(6, -1, -1)]        # ascending magnitudes
    out = []
    for a in v.abs().tolist():
        best = 0
        for i, g in enumerate(grid):
            if abs(a - g) <= abs(a - grid[best]):                             # a tie moves up the grid
                best = i
        out.append(grid[best])
    mag = torch.tensor(out, dtype=torch.float32)
    return torch.where(v < 0, -mag, mag).reshape(x.shape)


def streaming_diloco_reference(model, batches, loss_fn, optimizer, dp: int, period: int, fragments: int, outer,
                               warmup_steps: int = 0, delay: int = 0, mix: float = 0.0, pattern: str = "sequential",
                               quantize: str | None = None) -> tuple:
    """Streaming DiLoCo in one process (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"):
    ``dp`` replicas of ``model``, each with its own inner ``optimizer`` (``(class, kwargs)``), replica ``r`` on shard
    ``r`` of each batch; the warm-up's steps on the replicas' mean gradient. The parameter tensors (``model``'s
    order) are cut into ``fragments`` fragments: ``pattern="sequential"``, consecutive runs (sizes differing by at
    most one, the first larger); ``"strided"``, the model's blocks (a ``ModuleList`` / ``Sequential`` child, else
    the module holding the tensor), fragment ``p`` the blocks ``p, p + fragments, ...``.
    After step ``t`` (``t >= warmup_steps``) with ``(t - warmup_steps - p * period / fragments) % period == 0``
    fragment ``p``'s replicas are averaged (``avg_p = mean_m x_{m,p}``); after step ``t + delay`` the outer step
    ``anchor_p <- outer(anchor_p, avg_p)`` (``outer``: as :func:`nesterov_outer` makes, called with the fragment's
    keys only) and every replica's fragment becomes ``mix x_{m,p} + (1 - mix) anchor_p``. ``quantize="e3m0"``:
    instead of the average, each replica's pseudo-gradient ``anchor_p - x_{m,p}`` is rounded to E3M0 per tensor
    (:func:`e3m0_reference`), the replicas' values summed in replica order and divided by ``dp`` in float32, and
    that mean, cast back, is the outer step's gradient (``outer(anchor_p, None, delta=mean)``). Returns (losses,
    replicas' state_dicts)."""
    reps = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in reps]
    cls, kw = optimizer
    opts = [cls(m.parameters(), **kw) for m in reps]
    anchor = {k: v.detach().clone() for k, v in named[0].items()}
    frags = _fragments([k for k, _ in model.named_parameters()], fragments, pattern)
    pending, losses = [], []

    def apply(f, got):
        if quantize:
            new = outer({k: anchor[k] for k in frags[f]}, None, delta=got)
        else:
            new = outer({k: anchor[k] for k in frags[f]}, got)
        anchor.update({k: v.clone() for k, v in new.items()})
        return new

    for t, batch in enumerate(batches):
        grads, total = replica_gradients(reps, batch, loss_fn)
        _local_steps(named, opts, grads, synchronous=t < warmup_steps)
        losses.append(total)
        if t < warmup_steps:
            if t == warmup_steps - 1:
                anchor = {k: v.detach().clone() for k, v in named[0].items()}
            continue
        with torch.no_grad():
            for due, f, got in [x for x in pending if x[0] == t]:
                pending.remove((due, f, got))
                new = apply(f, got)
                for r in range(dp):
                    for k in frags[f]:
                        named[r][k].copy_(mix * named[r][k] + (1 - mix) * new[k] if mix else new[k])
            for f, keys in enumerate(frags):
                if (t - warmup_steps - f * (period // fragments)) % period:
                    continue
                if t - warmup_steps < f * (period // fragments):
                    continue
                got = {}
                for k in keys:
                    if quantize:
                        s = e3m0_reference(anchor[k] - named[0][k])
                        for j in range(1, dp):
                            s = s + e3m0_reference(anchor[k] - named[j][k])
                        got[k] = (s / dp).to(anchor[k].dtype)
                        continue
                    s = named[0][k] / dp
                    for j in range(1, dp):
                        s = s + named[j][k] / dp
                    got[k] = s
                pending.append((t + delay, f, got))
            for due, f, got in [x for x in pending if x[0] == t]:   # delay 0: at once
                pending.remove((due, f, got))
                new = apply(f, got)
                for r in range(dp):
                    for k in frags[f]:
                        named[r][k].copy_(new[k])
    return losses, [m.state_dict() for m in reps]


def _fragments(keys: list, fragments: int, pattern: str) -> list:
    """The reference's fragments (the paper's two patterns): sequential runs of tensors (fxpar's cut), or the
    blocks dealt round-robin -- a block a tensor's name up to its first numbered part, else its module's name."""
    if pattern != "strided":
        return fragment_keys(keys, fragments)
    blocks: list = []
    for k in keys:
        parts = k.split(".")
        num = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        name = ".".join(parts[:num + 1] if num is not None else parts[:-1])
        if not blocks or blocks[-1][0] != name:
            blocks.append((name, []))
        blocks[-1][1].append(k)
    return [[k for i, (_, ks) in enumerate(blocks) if i % fragments == f for k in ks] for f in range(fragments)]


def nesterov_outer(lr: float, momentum: float):
    """DiLoCo's outer step with Nesterov momentum (Douillard et al. 2023, Alg. 1, OuterOpt = SGD with Nesterov
    momentum), written out for :func:`local_sgd_reference`'s ``outer``: the pseudo-gradient ``d = anchor - average``
    (``delta`` where given), the buffer ``b = d`` at the first outer step and ``b = momentum b + d`` after, and
    ``anchor - lr (d + momentum b)``. Keeps its buffer between calls."""
    buf: dict = {}

    def step(anchor: dict, average: dict, delta: dict | None = None) -> dict:
        out = {}
        for k in anchor:
            d = anchor[k] - average[k] if delta is None else delta[k]
            buf[k] = d.clone() if k not in buf else momentum * buf[k] + d
            out[k] = anchor[k] - lr * (d + momentum * buf[k])
        return out
    return step


def slowmo_outer(inner_lr: float, slow_lr: float, slow_momentum: float):
    """SlowMo's outer step (Wang et al. ICLR 2020, Alg. 1, lines 8-9) for :func:`local_sgd_reference`'s ``outer``:
    ``u = slow_momentum u + (anchor - average) / inner_lr`` (``u = 0`` at first) and ``anchor - slow_lr inner_lr u``.
    Keeps ``u`` between calls."""
    u: dict = {}

    def step(anchor: dict, average: dict) -> dict:
        out = {}
        for k in anchor:
            u[k] = slow_momentum * u.get(k, torch.zeros_like(anchor[k])) + (anchor[k] - average[k]) / inner_lr
            out[k] = anchor[k] - (slow_lr * inner_lr) * u[k]
        return out
    return step


def ssp_reference(model, batches, loss_fn, optimizer, dp: int, logs: list, shards: list, start: int = 0) -> dict:
    """SSP's read rule in one process, replaying the servers' logs of a run (``RunResult.servers[r]["log"]`` of
    server ``j`` in ``logs[j]``, its keys in ``shards[j]``): server ``j`` starts from ``model``'s parameters of its
    shard and adds each push in its log's order; a ``("read", w, c, fresh)`` gives worker ``w`` the shard as it is
    at that point of the log, its parameters for clock ``c``. Worker ``w``'s clock ``c`` steps its own
    ``optimizer`` (``(class, kwargs)``, its own state) from its read for ``c`` (``model``'s parameters for ``c =
    0``) with the gradient of its shard ``w`` of ``batches[c]``, and pushes ``(after - read) / dp``. A push is
    replayed once its worker has read that clock from every server (the logs of several servers interleave as the
    run did). Returns ``{"losses": per clock the workers' shard losses averaged, "final": the servers' parameters
    after the logs, "reads": {(w, c): {key: tensor}}}``. ``start``: the clock the logs begin at (a resumed run's:
    ``model`` holds the checkpoint's parameters, every worker's read for that clock, and ``batches[c]`` is still
    clock ``c``'s batch); the optimizers start afresh, so a replay of a resumed run needs a stateless one (SGD)."""
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    by_clock = [{} for _ in shards]        # per server: clock -> {key: the sum of its updates so far}
    reps = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in reps]
    cls, kw = optimizer
    opts = [cls(m.parameters(), **kw) for m in reps]
    parts: dict = {}                       # (w, c) -> {server: its shard read}
    reads = {(w, start): dict(init) for w in range(dp)}
    updates: dict = {}
    losses: dict = {}

    def update(w: int, c: int):
        if (w, c) in updates:
            return updates[(w, c)]
        if (w, c) not in reads:
            got = parts.get((w, c), {})
            if len(got) < len(shards):
                return None                  # not read from every server yet
            reads[(w, c)] = {k: v for j in range(len(shards)) for k, v in got[j].items()}
        x = reads[(w, c)]
        *inputs, target = batches[c]
        n = target.shape[0] // dp
        with torch.no_grad():
            for k, p in named[w].items():
                p.copy_(x[k])
        shard = [t[w * n:(w + 1) * n] for t in (*inputs, target)]
        opts[w].zero_grad()
        loss = loss_fn(reps[w](*shard[:-1]), shard[-1])
        loss.backward()
        opts[w].step()
        losses.setdefault(c, {})[w] = loss.item()
        updates[(w, c)] = {k: (p.detach() - x[k]) / dp for k, p in named[w].items()}
        return updates[(w, c)]

    at = [0] * len(logs)
    while any(at[j] < len(logs[j]) for j in range(len(logs))):
        moved = False
        for j, log in enumerate(logs):
            while at[j] < len(log):
                e = log[at[j]]
                if e[0] == "read":
                    parts.setdefault((e[1], e[2]), {})[j] = _window(init, shards[j], by_clock[j], e[2] + e[4])
                else:
                    u = update(e[1], e[2])
                    if u is None:
                        break
                    got = by_clock[j].get(e[2])
                    by_clock[j][e[2]] = {k: u[k] if got is None else got[k] + u[k] for k in shards[j]}
                at[j] += 1
                moved = True
        if not moved:
            raise AssertionError(f"ssp_reference: the logs cannot be replayed (each server waits on a push whose "
                                 f"read it has not seen): positions {at}")
    for (w, c) in list(parts):
        if (w, c) not in reads and len(parts[(w, c)]) == len(shards):
            reads[(w, c)] = {k: v for j in range(len(shards)) for k, v in parts[(w, c)][j].items()}
    final = {k: v for j, keys in enumerate(shards) for k, v in _window(init, keys, by_clock[j], 1 << 62).items()}
    return {"losses": [sum(losses[c].values()) / dp for c in sorted(losses)], "final": final, "reads": reads}


def _window(init: dict, keys, by_clock: dict, upto: int) -> dict:
    """A server's read: its start plus, clock by clock, the updates of clocks ``< upto`` received so far."""
    x = {k: init[k].clone() for k in keys}
    for t in sorted(c for c in by_clock if c < upto):
        x = {k: x[k] + by_clock[t][k] for k in keys}
    return x


def dabmd_reference(model, batches, loss_fn, lr: float, dp: int, microbatches: int, counts, mirror: str = "euclidean",
                    mixing: str = "full", simplex=()) -> tuple:
    """Distributed Any-Batch Mirror Descent in one process (Eshraghi and Liang, ICML 2020), with fixed batches:
    ``dp`` nodes, each a replica of ``model``; in every round node ``i`` cuts its shard ``i`` of the batch into
    ``microbatches`` pieces and takes the first ``counts[i]``, and ``g_i`` is the mean of their gradients (each
    microbatch's loss a mean over its samples). The mirror step from the node's own point ``x_i``: Euclidean
    ``y_i = x_i - lr g_i``; entropic (the parameters in ``simplex``, every one where it is empty) ``y_i = x_i
    exp(-lr g_i) / sum(x_i exp(-lr g_i))``. Then one consensus ``x_i = sum_j P_ij y_j``, ``j`` in rank order, ``P``
    the doubly stochastic matrix of ``mixing``: ``"full"`` ``1/dp``, ``"ring"`` ``1/3`` on ``i - 1, i, i + 1`` mod
    ``dp``. Returns (losses: per round the mean over the nodes of each node's mean loss over the microbatches it
    took, replicas: each node's parameters ``{key: tensor}`` after the last round)."""
    reps = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in reps]
    keys = list(named[0])
    entropic = set() if mirror == "euclidean" else set(simplex or keys)
    if mixing == "full":
        weights = [{j: 1.0 / dp for j in range(dp)} for _ in range(dp)]
    else:
        weights = []
        for i in range(dp):
            row: dict = {}
            for j in (i - 1, i, i + 1):
                row[j % dp] = row.get(j % dp, 0.0) + 1.0 / 3
            weights.append(row)
    losses = []
    for batch in batches:
        *inputs, target = batch
        n = target.shape[0] // dp
        ys, total = [], 0.0
        for i in range(dp):
            shard = [t[i * n:(i + 1) * n] for t in (*inputs, target)]
            parts = list(zip(*(t.chunk(microbatches) for t in shard)))[:counts[i]]
            grads = {k: torch.zeros_like(p) for k, p in named[i].items()}
            node_loss = 0.0
            for mb in parts:
                for p in named[i].values():
                    p.grad = None
                loss = loss_fn(reps[i](*mb[:-1]), mb[-1])
                loss.backward()
                node_loss += loss.item()
                for k, p in named[i].items():
                    grads[k] = grads[k] + p.grad
            total += node_loss / len(parts) / dp
            y = {}
            with torch.no_grad():
                for k, p in named[i].items():
                    g = grads[k] / len(parts)
                    if k in entropic:
                        e = p * torch.exp(-lr * g)
                        y[k] = e / e.sum()
                    else:
                        y[k] = p - lr * g
            ys.append(y)
        with torch.no_grad():
            for i in range(dp):
                for k in keys:
                    x = None
                    for j in sorted(weights[i]):
                        term = weights[i][j] * ys[j][k]
                        x = term if x is None else x + term
                    named[i][k].copy_(x)
        losses.append(total)
    return losses, [{k: p.detach().clone() for k, p in nm.items()} for nm in named]
