"""Asynchronous 1F1B without weight stashing: Pipelined Backpropagation and PipeMare.

Both keep 1F1B's order (stage s warms up with ``p-s-1`` forwards, then alternates F and B) and never flush:
each stage updates after every microbatch's backward (``RG s STEP s@(k+1)`` after ``B s.k``), and every
F and every B computes with the stage's newest weights -- there is one weight version per stage. The
forward of microbatch i on stage s runs with version ``max(0, i - D_s)`` and its backward with version i,
so stage s's gradient is ``D_s = p - s - 1`` updates late (:func:`stage_delay`): the last stage's is not late
at all, the first stage's is late by ``p - 1``.

* Pipelined Backpropagation (Petrowski et al. 1993; Kosson et al., "Pipelined Backpropagation at Scale:
  Training Large Models without Batches", MLSys'21): the delay corrected by spike compensation and linear
  weight prediction, which read ``D_s``.
* PipeMare (Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN Training", MLSys'21): a learning-rate
  warm-up per stage scaled by ``D_s`` and a backward on weights extrapolated back by ``D_s``.

The runtime holds no stash: a forward keeps no weights for its backward (``fxpar.features.pipeline_delayed``
moves the weights a backward reads into its inputs), so a stage holds one version at a time
(``simulate(...).peak_versions == {s: 1}``), against PipeDream's ``p - s``.

Example, ``pipelined_bp(2, 3)``::

    rank 0: F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 RG0 STEP0@1 F0.2@1 SF0.2>1 RB0.1<1 B0.1@1 RG0 STEP0@2 ...

In a long window every rank alternates one F and one B with no idle time between its first B and its last F:
:func:`steady_state_bubble` of the dry run is 0; the only idle time is the run's one fill and one drain.
"""
from __future__ import annotations

from fxpar.schedule._build import finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Action, ActionKind, Schedule
from fxpar.schedule.synchronous import one_f_one_b_lists

__all__ = ["pipelined_bp", "pipemare", "stage_delay", "steady_state_bubble"]

_K = ActionKind


def stage_delay(p: int, s: int) -> int:
    """``D_s``: the updates stage s makes between a microbatch's forward and its backward, in steady state."""
    return p - s - 1


def _no_stash(name: str, p: int, m: int, resumed: bool = False) -> Schedule:
    if p < 1 or m < 1:
        raise ScheduleError(f"{name}: need p >= 1 stages and m >= 1 microbatches, got p={p}, m={m}")

    def carried(s: int) -> int:          # a resumed window starts holding D_s older versions beside the newest
        return stage_delay(p, s) if resumed else 0

    def version(s: int, i: int, backward: bool = False) -> int:
        if backward:
            return i + carried(s)
        return i if resumed else max(0, i - stage_delay(p, s))

    def step_after(s: int, k: int) -> list:
        return [Action(s, _K.REDUCE_GRAD, s), Action(s, _K.STEP, s, version=k + 1 + carried(s))]

    lists = one_f_one_b_lists(p, m, version, step_after)
    for acts in lists.values():           # a backward computes with the newest version: the one after k updates
        for j, a in enumerate(acts):
            if a.kind == _K.B:
                acts[j] = Action(a.rank, a.kind, a.stage, a.microbatch, a.peer, version(a.stage, a.microbatch, True))
    return finish(lists, p, m, {s: (s,) for s in range(p)}, name, synchronous=False,
                  **({"resumed": 1} if resumed else {}))


def pipelined_bp(p: int, m: int, resumed: bool = False) -> Schedule:
    """Pipelined Backpropagation over m microbatches: 1F1B without a flush, an update after every backward,
    every F and B on the stage's newest weights (no stash).

    ``resumed=True``: the window continues a run as if it had never stopped. Had it not, the first ``D_s``
    forwards of stage s would have run before the last ``D_s`` updates of the run before: the window starts
    holding those ``D_s`` older versions (``0 .. D_s-1``, from the checkpoint) beside the newest (``D_s``); the
    forward of microbatch i computes with version i, its backward with ``i + D_s`` (the newest when it runs)."""
    return _no_stash("pipelined_bp", p, m, resumed)


def pipemare(p: int, m: int, resumed: bool = False) -> Schedule:
    """PipeMare over m microbatches: the order and versions of :func:`pipelined_bp` (the two differ in how the
    runtime corrects the delay, not in what runs when); ``resumed`` as there."""
    return _no_stash("pipemare", p, m, resumed)


def steady_state_bubble(sim) -> float:
    """The idle fraction of the dry run ``sim`` (:func:`fxpar.schedule.simulate`) between each rank's first
    backward start and its last forward end (the window's one fill and one drain left out), the most over ranks."""
    worst = 0.0
    for tl in sim.timelines.values():
        comp = [(t0, t1, a) for t0, t1, a in tl if a.is_compute]
        first_b = min((t0 for t0, _, a in comp if a.kind == _K.B), default=None)
        last_f = max((t1 for _, t1, a in comp if a.kind == _K.F), default=None)
        if first_b is None or last_f is None or last_f <= first_b:
            continue
        busy = sum(min(t1, last_f) - max(t0, first_b) for t0, t1, _ in comp if t1 > first_b and t0 < last_f)
        worst = max(worst, 1.0 - busy / (last_f - first_b))
    return worst
