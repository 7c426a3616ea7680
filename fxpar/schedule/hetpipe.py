"""HetPipe's virtual worker and its wave (Park et al., "HetPipe: Enabling Large DNN Training on (Whimpy)
Heterogeneous GPU Clusters through Integration of Pipelined Model Parallelism and Data Parallelism", USENIX ATC 2020):
the schedule one virtual worker runs per wave, the wave synchronous parallel (WSP) rule, and the per-stage times of a
pipeline on unequal devices for the dry run.

A *virtual worker* is one pipeline (``pp`` ranks, possibly of different devices); ``dp`` of them train side by side.
A *wave* is the microbatches a virtual worker runs between two synchronisations (the paper's ``s_local + 1``
minibatches processed without each other's updates); here a wave is one batch of ``m`` microbatches under 1F1B,
flushed, with one update from their summed gradients: the wave's aggregated update.

WSP (the paper's Section 5): each virtual worker keeps a local clock, the waves it has finished; the parameter
servers' global clock is the smallest local clock. At the end of wave ``c`` a virtual worker pushes the wave's
update, and it may start wave ``c + 1`` once ``c + 1 - D <= c_global``: every virtual worker has pushed every wave
before ``c + 1 - D``, so no virtual worker runs more than ``D`` waves ahead of the slowest (:func:`may_start`).
``D = 0`` waits for every virtual worker's previous wave: synchronous data parallelism over the pipelines.
"""
from __future__ import annotations

from fxpar.schedule.ir import Schedule
from fxpar.schedule.synchronous import one_f_one_b

__all__ = ["hetpipe", "may_start", "waves_behind", "stage_times"]


def hetpipe(p: int, m: int) -> Schedule:
    """One virtual worker's wave: 1F1B over ``p`` stages and ``m`` microbatches, flushed, one STEP per stage (the
    wave's aggregated update, which the stage then pushes to its parameter servers)."""
    sched = one_f_one_b(p, m)
    sched.name = "hetpipe"
    return sched


def may_start(done: list, wave: int, staleness: int) -> bool:
    """WSP: whether a virtual worker may start wave ``wave`` when virtual worker ``v`` has pushed ``done[v]`` waves
    (waves ``0 .. done[v] - 1``): every one has pushed the waves before ``wave - staleness``."""
    return min(done) >= wave - staleness


def waves_behind(done: list, wave: int) -> int:
    """How many waves the slowest virtual worker is behind one starting ``wave`` (0: none)."""
    return max(0, wave - min(done))


def stage_times(flops: list, speeds: list, backward: float = 2.0) -> tuple:
    """Per stage the seconds of one microbatch's forward and backward on its device (``flops[s]`` forward FLOPs,
    ``speeds[s]`` FLOP/s; a backward ``backward`` times the forward): ``({s: F}, {s: B})``, what
    :func:`fxpar.schedule.simulate` takes per stage."""
    fwd = {s: f / v for s, (f, v) in enumerate(zip(flops, speeds))}
    return fwd, {s: backward * t for s, t in fwd.items()}
