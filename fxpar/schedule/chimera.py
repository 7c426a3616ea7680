"""Chimera: two synchronous pipelines running in opposite directions over the same ranks.

Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
Pipelines", SC'21 (arXiv:2107.06925). With p ranks (p even) the model has p stages. The *down*
pipeline puts stage s on rank s, the *up* pipeline puts stage s on rank p-1-s, so each rank holds
stage s and stage p-1-s (two replicas of every stage in the system: ``stage_to_rank[s] == (s, p-1-s)``).
The first m/2 microbatches go down, the other m/2 go up. Each worker runs the earliest ready work,
backwards first (the order is found by list scheduling with equal F and B slots, as the paper's
figures and bubble counts assume), so the two pipelines fill each other's bubbles. Each rank reduces
(``RG s``, a collective with the other replica of s) each of its two stages after its last backward
of that stage, the two in increasing stage order on every rank so replicas meet in the same order,
then steps both (``STEP``). Everything is synchronous: one weight version.

The paper gives the bubble ratio (D-2)/(2N+D-2) for D stages and N microbatches, i.e.
(p-2)/(2m+p-2), against (p-1)/(m+p-1) for GPipe and 1F1B. It counts bubbles in slots where F and B
take the same time; with F = B the simulator reproduces the figure exactly for m = p (the basic
schedule) and for m a multiple of p. For other even m the bubble is larger: the paper's own scheme
for m > p (concatenating basic units) is not implemented, the list scheduler fills in. With B = 2F
the bubble exceeds the figure (0.25 instead of 0.2 for p = m = 4). Peak activations per rank lie
between p/2 and p, more balanced than 1F1B's p on rank 0 and 1 on rank p-1.

Example, ``chimera(2, 2)``::

    rank 0: F0.0 SF0.0>1 RF1.1<1 F1.1 B1.1 SB1.1>1 RB0.0<1 B0.0 RG0 RG1 STEP0 STEP1
    rank 1: F0.1 SF0.1>0 RF1.0<0 F1.0 B1.0 SB1.0>0 RB0.1<0 B0.1 RG0 RG1 STEP0 STEP1
"""
from __future__ import annotations

from fxpar.schedule._build import compute, finish, greedy_order
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Schedule

__all__ = ["chimera"]


def chimera(p: int, m: int | None = None) -> Schedule:
    """Chimera over p ranks and m microbatches (default m = p): m/2 down, m/2 up, then RG and STEP."""
    m = p if m is None else m
    if p < 2 or p % 2:
        raise ScheduleError(f"chimera(p={p}) needs an even number of ranks >= 2: each rank pairs stage s of the "
                            f"down pipeline with stage p-1-s of the up pipeline. Use p={max(2, p - 1)} or p={p + 1}.")
    if m < 2 or m % 2:
        raise ScheduleError(f"chimera(p={p}, m={m}) needs an even m >= 2: half the microbatches go down, half up. "
                            f"Use m={max(2, m - 1)} or m={m + 1} (m={p} is the paper's basic schedule).")
    half = m // 2

    def rank_of(stage: int, mb: int) -> int:
        return stage if mb < half else p - 1 - stage

    tasks: dict[int, list] = {r: [] for r in range(p)}
    for mb in range(m):
        for s in range(p):
            tasks[rank_of(s, mb)] += [("F", s, mb), ("B", s, mb)]

    def deps(t):
        kind, s, mb = t
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < p - 1 else [])

    def priority(r, t):
        kind, s, mb = t
        return (0 if kind == "B" else 1, mb % half, mb)

    order = greedy_order(tasks, deps, priority, dur=lambda t: 1)   # the paper's unit slots: F = B
    lists = {r: [compute(r, k, s, mb) for k, s, mb in order[r]] for r in range(p)}
    placement = {s: tuple(sorted({s, p - 1 - s})) for s in range(p)}
    return finish(lists, p, m, placement, "chimera")
