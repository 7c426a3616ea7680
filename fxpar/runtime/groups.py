"""Process groups and per-process settings of a rank: its groups (one per name and ranks, created once per
process), collectives' group tags bound to them, the RNG seed, the communication threads' priority."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.fx

from ..collectives import axis_of_tag
from ..host import raise_comm_threads

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


def seed_rank(seed: int | None, rank: int) -> None:
    """``seed`` (``RunSettings.rng_seed``) set: seed torch's generator with it + rank, so random ops (dropout) are
    reproducible and differ between ranks. None: leave the generator as the process has it."""
    if seed is not None:
        torch.manual_seed(int(seed) + rank)
