"""References for gradient compression (``fxpar.compress``): torch's DDP with a comm hook on real ranks, and the
sparsification methods' and QAdam's math in one process."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

import fxpar
from fxpar.compress.bytegrad import chunk_size, dequantize_rows, quantize_rows
from fxpar.testing.reference import replica_gradients

__all__ = ["ddp_hook_worker", "nuqsgd_reference", "elias_bits_of_message", "bytegrad_reference", "sparse_reference", "sparse_bucket_math", "qadam_bucket_math", "qadam_reference",
           "mlp_batches", "mlp_program", "mixing_matrix", "decentralized_reference",
           "low_precision_decentralized_reference", "adaptive_variance", "alq_reference", "amq_reference"]


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


def bytegrad_reference(flats: list) -> torch.Tensor:
    """ByteGrad's sum of the ranks' buckets in one process: dp chunks each coded as uint8 against its float32 min and
    max, chunk c decoded and added in rank order, coded again and decoded."""
    dp, n = len(flats), flats[0].shape[0]
    m = chunk_size(n, dp)
    rows = [dequantize_rows(quantize_rows(torch.cat([f, f.new_zeros(m * dp - n)]).view(dp, m)), f.dtype)
            for f in flats]
    out = []
    for c in range(dp):
        chunk = rows[0][c]
        for r in range(1, dp):
            chunk = chunk + rows[r][c]
        out.append(dequantize_rows(quantize_rows(chunk.view(1, m)), chunk.dtype)[0])
    return torch.cat(out)[:n]


def qadam_bucket_math(flats: list, m: torch.Tensor, v: torch.Tensor, t: int, warmup_steps: int, betas: tuple,
                      eps: float) -> tuple:
    """QAdam on one bucket at step ``t`` (1 first), every rank: ``flats`` the ranks' gradients scaled by 1/dp, ``m``
    and ``v`` the moments before. Warm-up (``t <= warmup_steps``): Adam's moments of the summed gradient. After:
    ``v`` kept, each rank's ``lerp(m, dp * flat, 1 - b1)`` averaged in 8 bits. Returns ``(direction, m, v)``, the
    direction ``m / (sqrt(v) / sqrt(1 - b2^t) + eps) / (1 - b1^t)``."""
    b1, b2 = betas
    dp = len(flats)
    if t <= warmup_steps:
        g = flats[0]
        for f in flats[1:]:
            g = g + f
        m = torch.lerp(m, g, 1 - b1)
        v = v * b2 + g * g * (1 - b2)
    else:
        # BAGUA's 8-bit scatter-reduce-gather of each rank's momentum
        m = bytegrad_reference([torch.lerp(m, f * dp, 1 - b1) / dp for f in flats])
    bc1 = torch.tensor(1 - b1 ** t, dtype=torch.float64)
    bc2_sqrt = torch.tensor(math.sqrt(1 - b2 ** t), dtype=torch.float64)
    return m / (v.sqrt() / bc2_sqrt + eps) / bc1, m, v


def qadam_reference(model, batches, loss_fn, lr: float, dp: int, buckets: list, warmup_steps: int,
                    betas: tuple = (0.9, 0.999), eps: float = 1e-8, microbatches: int = 1) -> tuple:
    """QAdam with its learning-rate step ``p <- p - lr d``, in one process: ``dp`` shards (cut into ``microbatches``)
    each make their gradient scaled by 1/(dp * microbatches); ``buckets``: the parameter keys of each of one stage's
    buckets, in bucket order. Returns (losses, state_dict)."""
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    moments: dict = {}
    losses = []
    for t, batch in enumerate(batches, start=1):
        grads, total = _shard_grads(m, named, batch, loss_fn, dp, microbatches)
        update = {}
        for b, keys in enumerate(buckets):
            flats = [torch.cat([grads[r][k].reshape(-1) for k in keys]) for r in range(dp)]
            mom, sq = moments.get(b, (torch.zeros_like(flats[0]), torch.zeros_like(flats[0])))
            d, mom, sq = qadam_bucket_math(flats, mom, sq, t, warmup_steps, betas, eps)
            moments[b] = (mom, sq)
            off = 0
            for key in keys:
                sz = named[key].numel()
                update[key] = d[off:off + sz].view(named[key].shape)
                off += sz
        with torch.no_grad():
            for key, w in named.items():
                w -= lr * update[key]
        losses.append(total)
    return losses, m.state_dict()


def _shard_grads(m, named, batch, loss_fn, dp: int, microbatches: int) -> tuple:
    """Per shard, its gradients scaled by 1/(dp * microbatches), and the global batch's loss."""
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
    return grads, total


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


def mixing_matrix(peers: str, dp: int, k: int) -> torch.Tensor:
    """Decentralized SGD's ``W`` (float64, ``dp x dp``) at averaging step ``k``: row ``r`` holds the weights rank ``r``
    averages the replicas with. ``"all"``: every entry ``1/dp``; ``"ring"``: ``1/3`` on the diagonal and the two ring
    neighbours; ``"shift_one"``: ``1/2`` on the diagonal and bagua's peer of step ``k`` (rank ``r < dp/2`` with
    ``(k + r) mod (dp/2) + dp/2``, the others the rank that picks them)."""
    w = torch.zeros(dp, dp, dtype=torch.float64)
    for r in range(dp):
        if peers == "all":
            w[r] = 1 / dp
        elif peers == "ring":
            for j in (r - 1, r, r + 1):
                w[r, j % dp] = 1 / 3
        else:
            half = dp // 2
            for a in range(half):
                b = (k + a) % half + half
                if r in (a, b):
                    w[r, a] = w[r, b] = 1 / 2
    return w


def decentralized_reference(model, batches, loss_fn, lr: float, dp: int, peers: str = "all",
                            communication_interval: int = 1, order: str = "combine_then_adapt") -> tuple:
    """Decentralized SGD with plain SGD in one process: ``dp`` replicas of ``model``, replica ``r`` training on shard
    ``r`` of each batch. Step ``t``: each replica's gradient at its own weights; on an averaging step (``t %
    communication_interval == 0``) the replicas are mixed by ``W`` (:func:`mixing_matrix` at ``k = t //
    communication_interval``). ``order="combine_then_adapt"`` (Lian et al.'s D-PSGD, BAGUA's order): ``x_r = (W x)_r -
    lr g_r``; ``"adapt_then_combine"`` (Sayed 2014's diffusion order): ``x_r = (W (x - lr g))_r``; a step that does not
    average: ``x_r - lr g_r``. Returns (losses: the mean over replicas of each one's shard loss, replicas: each one's
    state_dict)."""
    replicas = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in replicas]
    losses = []
    for t, batch in enumerate(batches):
        grads, total = replica_gradients(replicas, batch, loss_fn)
        mixing = t % communication_interval == 0
        w = mixing_matrix(peers, dp, t // communication_interval) if mixing else None
        with torch.no_grad():
            for key in named[0]:
                xs = [named[r][key].detach().clone() for r in range(dp)]
                if order == "adapt_then_combine":
                    xs = [xs[r] - lr * grads[r][key] for r in range(dp)]
                for r in range(dp):
                    y = sum(w[r, j] * xs[j] for j in range(dp) if w[r, j] != 0) if mixing else xs[r]
                    named[r][key].copy_(y if order == "adapt_then_combine" else y - lr * grads[r][key])
        losses.append(total)
    return losses, [m.state_dict() for m in replicas]


def low_precision_decentralized_reference(model, batches, loss_fn, lr: float, dp: int, buckets: list,
                                          weight_decay: float = 0.0) -> tuple:
    """BAGUA's low-precision decentralized SGD (Tang et al., NeurIPS 2018, on a ring) with plain SGD in one process.
    ``buckets``: the parameter keys of each bucket, in bucket order. Replica ``r`` holds per bucket its weights ``w_r``
    and its copies ``l_r``, ``h_r`` of its ring neighbours' (``r - 1``, ``r + 1``), all the starting weights at first.
    Step: the gradient at ``w_r``; ``p_r = w_r - lr (g_r + weight_decay w_r)`` (torch's SGD); ``z_r = p_r + l_r/3 + h_r/3 - 5/3 w_r`` as one row of
    min-max uint8 codes ``c_r``; ``l_r += c_{r-1}``, ``h_r += c_{r+1}``, ``w_r = c_r + w_r`` (decoded). Returns
    (losses, replicas: each one's state_dict)."""
    replicas = [copy.deepcopy(model) for _ in range(dp)]
    named = [dict(m.named_parameters()) for m in replicas]

    def flat(r, keys):
        return torch.cat([named[r][k].detach().reshape(-1) for k in keys])

    state = [[{"w": flat(r, keys), "l": flat(r, keys), "h": flat(r, keys)} for keys in buckets] for r in range(dp)]
    losses = []
    for batch in batches:
        gs, total = replica_gradients(replicas, batch, loss_fn)
        codes = []
        for r in range(dp):
            g = gs[r]
            mine = []
            for b, keys in enumerate(buckets):
                st = state[r][b]
                grad = torch.cat([g[k].reshape(-1) for k in keys])
                p = st["w"] - lr * (grad + weight_decay * st["w"] if weight_decay else grad)
                z = p + st["l"] * (1 / 3) + st["h"] * (1 / 3) + st["w"] * (-5 / 3)
                mine.append(dequantize_rows(quantize_rows(z.view(1, -1)), z.dtype).reshape(-1))
            codes.append(mine)
        with torch.no_grad():
            for r in range(dp):
                for b, keys in enumerate(buckets):
                    st = state[r][b]
                    st["l"] = st["l"] + codes[(r - 1) % dp][b]
                    st["h"] = st["h"] + codes[(r + 1) % dp][b]
                    st["w"] = codes[r][b] + st["w"]
                    off = 0
                    for k in keys:
                        size = named[r][k].numel()
                        named[r][k].copy_(st["w"][off:off + size].view(named[r][k].shape))
                        off += size
        losses.append(total)
    return losses, [m.state_dict() for m in replicas]


def elias_bits_of_message(buf: torch.Tensor, numel: int, chunk: int, bits: int, s: int) -> int:
    """The bits NUQSGD's Elias-coded message of one rank takes, counted from the message that rank sends (``buf``:
    the float32 norms of its ``ceil(numel / chunk)`` chunks, then ``numel`` packed ``bits``-bit codes ``s + sign *
    level``): 32 per norm, and per value the Elias omega code of its level index + 1 and a sign bit where the index
    is nonzero (Ramezani-Kebrya et al., NUQSGD, JMLR 2021, §4)."""
    from fxpar.compress.packing import elias_omega_length, unpack_bits
    chunks = -(-numel // chunk)
    idx = (unpack_bits(buf[4 * chunks:], bits, numel).to(torch.int64) - s).abs()
    return int(32 * chunks + elias_omega_length(idx + 1).sum() + (idx > 0).sum())


def nuqsgd_reference(model, batches, loss_fn, lr: float, method, buckets: list) -> tuple:
    """SGD with ``method`` (a :class:`fxpar.compress.NUQSGD`) in one process over ``buckets`` (the program's
    :class:`BucketInfo`, dp ranks each), each rank's draws from its own generator as the runtime makes them:
    ``(losses, state_dict, elias)``, ``elias[(stage, bucket)][rank]``: per step the Elias-coded bits of the message
    that rank sent (:func:`elias_bits_of_message`, from its encoded buffer)."""
    from fxpar.compress.quantize import decode, encode
    from fxpar.testing.compress_ranks import training_reference
    elias: dict = {}
    bits, s = method._bits(), method._s()

    def bucket_math(m, infos, flats, states, draws, variant):
        levels, n = m._levels(states[0]), flats[0].shape[0]
        total = None
        for r, (f, d) in enumerate(zip(flats, draws)):
            buf = encode(f, levels, d[0], m.bucket, bits)
            elias.setdefault((infos[r].stage, infos[r].index), [[] for _ in flats])[r].append(
                elias_bits_of_message(buf, n, m.bucket, bits, s))
            part = decode(buf, levels, n, m.bucket, bits, f.dtype)
            total = part if total is None else total + part
        return total, states
    losses, state = training_reference(model, batches, loss_fn, lr, method, buckets, bucket_math)
    return losses, state, elias


# ---- ALQ and AMQ's adaptation, one value and one candidate at a time ------------------------------------------------
def adaptive_variance(r: list, w: list, levels: list) -> float:
    """``sum_i w_i (l_t+1 - r_i)(r_i - l_t)``, ``l_t <= r_i <= l_t+1`` (Faghri et al. 2020, eq. 3 with the empirical
    distribution of the normalised values ``r`` weighted ``w``), a loop over the values, summed with ``math.fsum``."""
    terms = []
    for ri, wi in zip(r, w):
        t = max(i for i in range(len(levels) - 1) if levels[i] <= ri)
        terms.append(wi * (levels[t + 1] - ri) * (ri - levels[t]))
    return math.fsum(terms)


def alq_reference(r: list, w: list, levels: list, sweeps: int) -> list:
    """ALQ's coordinate descent (Faghri et al. 2020, §3.1) as the paper states it, on Python floats: ``sweeps``
    times, each interior level ``l_j`` in turn moves to the data point strictly between its neighbours (their latest
    values) that gives the least expected variance (:func:`adaptive_variance`, the first such point on a tie),
    when that variance is lower than at ``l_j`` itself."""
    lv = list(levels)
    for _ in range(sweeps):
        for j in range(1, len(lv) - 1):
            best, best_var = None, None
            for x in sorted(ri for ri in r if lv[j - 1] < ri < lv[j + 1]):
                var = adaptive_variance(r, w, lv[:j] + [x] + lv[j + 1:])
                if best_var is None or var < best_var:
                    best, best_var = x, var
            if best is not None and best_var < adaptive_variance(r, w, lv):
                lv[j] = best
    return lv


def amq_reference(r: list, w: list, p: float, s: int, grid: int) -> float:
    """AMQ's update (Faghri et al. 2020, §3.2) on Python floats: of the current multiplier ``p`` and the grid
    ``j / (grid + 1)``, ``j = 1..grid``, the one whose levels ``{0, p^(s-1), ..., p, 1}`` give the least expected
    variance (:func:`adaptive_variance`), the first on a tie."""
    best, best_var = None, None
    for c in [p] + [j / (grid + 1) for j in range(1, grid + 1)]:
        var = adaptive_variance(r, w, [0.0] + [c ** k for k in range(s - 1, -1, -1)])
        if best_var is None or var < best_var:
            best, best_var = c, var
    return best
