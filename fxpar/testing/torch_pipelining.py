"""The torch side of benchmarks/bench_pipeline_vs_torch.py: ``torch.distributed.pipelining`` on a
LocalCluster, with the model split by hand into two stages.

``UntiedGPT`` is a GPT whose LM head is *not* tied to the token embedding (torch's pipelining cannot
share a weight between stages). ``pipelining_worker`` runs on every rank of an initialised gloo group:
``lc.run(pipelining_worker, [(model, batches, split, opt, schedule, m, warmup)] * pp)``.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

from .models import GPT, gpt_loss

__all__ = ["UntiedGPT", "split_untied_gpt", "pipelining_worker", "stages_of_rank"]


def UntiedGPT(vocab=2048, d=128, layers=8, heads=4, max_seq=64) -> GPT:
    """``fxpar.testing.GPT`` with an LM head of its own (not tied to the token embedding)."""
    return GPT(vocab=vocab, d=d, layers=layers, heads=heads, max_seq=max_seq, tie_weights=False)


class _First(nn.Module):
    def __init__(self, model: GPT, blocks):
        super().__init__()
        self.wte, self.wpe, self.blocks = model.wte, model.wpe, nn.ModuleList(blocks)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe.weight[:idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return x


class _Middle(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Last(nn.Module):
    def __init__(self, model: GPT, blocks):
        super().__init__()
        self.blocks, self.ln_f, self.head = nn.ModuleList(blocks), model.ln_f, model.head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def split_untied_gpt(model: GPT, cuts: list[int], stage: int) -> nn.Module:
    """Stage ``stage`` of ``model`` cut before blocks ``cuts`` (e.g. [4] for 2 stages of 8 blocks):
    stage 0 holds the embeddings, the last one ln_f + head."""
    bounds = [0, *cuts, len(model.blocks)]
    blocks = list(model.blocks)[bounds[stage]:bounds[stage + 1]]
    if stage == 0:
        return _First(model, blocks)
    if stage == len(cuts):
        return _Last(model, blocks)
    return _Middle(blocks)


_MULTI = {"interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
          "interleaved": "ScheduleInterleaved1F1B"}


def stages_of_rank(schedule: str, rank: int, world: int) -> list[int]:
    """The stages a rank holds: one (stage = rank) for gpipe/1f1b; two for the multi-stage schedules:
    looped (``rank``, ``rank + world``) for the interleaved ones, V-shaped (``rank``, ``2*world-1-rank``)
    for ZBV (torch.distributed.pipelining's placements)."""
    if schedule not in _MULTI:
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


def pipelining_worker(model, batches, cuts, optimizer, schedule: str = "gpipe", microbatches: int = 8,
                      warmup: int = 1, loss_fn=gpt_loss) -> dict:
    """Train with ``torch.distributed.pipelining`` on the default group: one stage per rank for
    ``gpipe``/``1f1b``, two per rank for ``interleaved``, ``interleaved_zb`` (ScheduleInterleavedZeroBubble)
    and ``zbv`` (ScheduleZBVZeroBubble); ``cuts`` must then give ``2 * world`` stages.

    Returns this rank's step times (after ``warmup`` untimed steps) and, on the rank holding the last
    stage, the global-batch loss per step (mean of the microbatch losses, as fxpar reports it).
    """
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    held = stages_of_rank(schedule, rank, world)
    n_stages = len(cuts) + 1
    if n_stages != world * len(held):
        raise ValueError(f"{schedule}: {world} ranks x {len(held)} stages each, but cuts give {n_stages} stages")
    model = copy.deepcopy(model)
    modules = [split_untied_gpt(model, cuts, s) for s in held]
    stages = [pipelining.PipelineStage(m, s, n_stages, device=torch.device("cpu")) for m, s in zip(modules, held)]
    if schedule in _MULTI:
        sched = getattr(pipelining, _MULTI[schedule])(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    ocls, kw = optimizer
    opt = ocls([p for m in modules for p in m.parameters()], **kw)
    first, last = 0 in held, n_stages - 1 in held
    losses, times = [], []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad()
        mb_losses = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": mb_losses, "return_outputs": False} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if last:
            losses.append(sum(float(v.detach()) for v in mb_losses) / len(mb_losses))
    return {"step_times": times, "losses": losses if last else None}
