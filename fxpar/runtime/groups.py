"""Process groups and per-process settings of a rank: its groups (one per name and ranks, created once per
process), collectives' group tags bound to them, the RNG seed, the communication threads' priority."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.fx

from ..collectives import axis_of_tag
from ..host import raise_comm_threads
from ..local_ops import RANK_STREAM_OFFSET, seed_rank_stream

__all__ = ["group", "bind_groups", "seed_rank", "comm_priority"]

_GROUPS: dict = {}   # (group name, ranks) -> ProcessGroup, per process (reused across programs)


def group(ranks: tuple, name: str = "dp"):
    """The process group of group ``name`` over ``ranks``, created once per process. Each name has groups of
    its own (see ``Plan.all_groups``); data parallelism over every rank uses the world group."""
    ranks = tuple(ranks)
    key = (name, ranks)
    if key not in _GROUPS:
        if name == "dp" and ranks == tuple(range(dist.get_world_size())):
            _GROUPS[key] = dist.group.WORLD
        else:
            _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def comm_priority(rank: int) -> None:
    """``ClusterSpec.comm_priority``: this process's gloo threads, its groups' included, under SCHED_FIFO
    (:func:`fxpar.host.raise_comm_threads`); a warning, once, where the OS refuses."""
    if raise_comm_threads() is None and not _REFUSED:
        _REFUSED.append(rank)
        warnings.warn(f"rank {rank}: ClusterSpec(comm_priority=True), but this process may not put gloo's "
                      "communication threads under SCHED_FIFO (it needs root or CAP_SYS_NICE, on Linux); they run at "
                      "normal priority, so small collectives may cost more than the cost model (calibrated with "
                      "comm_priority=True) assumed. Run as a user who may, or use comm_priority=False.", stacklevel=2)


_REFUSED: list = []


def bind_groups(gm: torch.fx.GraphModule, names: dict) -> torch.fx.GraphModule:
    """Point each collective's group tag (``"fxpar:dp"``) at this rank's process group ``names[tag]``."""
    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        args = list(n.args)
        for i, a in enumerate(args):
            axis = axis_of_tag(a)
            if axis is not None:
                if axis not in names:
                    raise RuntimeError(f"node {n.name} of graph {gm.__class__.__name__} names group '{axis}', which this "
                                       f"rank is not in (its groups: {sorted(names)}): the graphs and the Plan's groups do "
                                       "not belong together -- rebuild the program with fxpar.parallelize (a pass that "
                                       "inserts collectives must name a mesh axis or a group of Plan.groups)")
                args[i] = names[axis]
                changed = True
        n.args = tuple(args)
    if changed:
        gm.recompile()
    return gm


def seed_rank(seed: int | None, rank: int, tp_index: int = 0) -> None:
    """``seed`` (``RunSettings.rng_seed``) set: seed this rank's two random streams (docs/semantics.md, "Random
    numbers under tensor parallelism"), so random ops (dropout) are reproducible:

    * torch's default generator with ``seed + rank - tp_index`` (the first rank of its tp group): the stream of
      random ops on whole tensors, the same on every tp rank of a replica, different between dp ranks and
      pipeline ranks (without tensor parallelism, ``seed + rank``);
    * its rank stream (``fxpar.local_ops.seed_rank_stream``) with ``RANK_STREAM_OFFSET + seed + rank``: dropout on
      a tensor split over tp draws this rank's piece from it.

    None: leave the default generator as the process has it (the rank stream then starts from its seed)."""
    if seed is not None:
        torch.manual_seed(int(seed) + rank - tp_index)
        seed_rank_stream(RANK_STREAM_OFFSET + int(seed) + rank)
    else:
        seed_rank_stream(RANK_STREAM_OFFSET + torch.initial_seed() + rank)
