"""Shared helpers for the schedule generators: place compute, then derive the SEND/RECV pairs.

A generator decides only the order of compute (F/B, or F/I/W) and, for asynchronous schedules, of
STEP on each rank. ``add_comms`` then puts, for every stage boundary that crosses ranks, a SEND right
after the producing compute and the matching RECV right before the consuming compute (the input
gradient is made by B or by I, and consumed by B or by I). Under the communication semantics of
:mod:`fxpar.schedule.dryrun` (sends never block, receives block) that placement cannot deadlock
as long as the compute order is consistent with the data dependencies, which the simulator checks.
``finish`` adds the REDUCE_GRADs (:func:`fxpar.schedule.reduce_grad.place_reduce_grad`) and STEPs.
"""
from __future__ import annotations

from fxpar.schedule.ir import Action, ActionKind, Schedule
from fxpar.schedule.reduce_grad import place_reduce_grad

__all__ = ["compute", "add_comms", "finish", "greedy_order"]

_K = ActionKind
_DX = (_K.B, _K.I)          # the computes that make a stage's input gradient


def compute(rank: int, kind: str, stage: int, mb: int, version: int | None = None) -> Action:
    return Action(rank, _K(kind), stage, mb, None, version)


def add_comms(lists: dict[int, list[Action]], n_stages: int) -> dict[int, list[Action]]:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B around every compute whose neighbour stage runs elsewhere."""
    fwd = {(a.stage, a.microbatch): r for r, acts in lists.items() for a in acts if a.kind == _K.F}
    bwd = {(a.stage, a.microbatch): r for r, acts in lists.items() for a in acts if a.kind in _DX}
    out: dict[int, list[Action]] = {}
    for r, acts in lists.items():
        seq: list[Action] = []
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.kind == _K.F and s > 0 and fwd.get((s - 1, i), r) != r:
                seq.append(Action(r, _K.RECV_F, s, i, fwd[(s - 1, i)]))
            if a.kind in _DX and s < n_stages - 1 and bwd.get((s + 1, i), r) != r:
                seq.append(Action(r, _K.RECV_B, s, i, bwd[(s + 1, i)]))
            seq.append(a)
            if a.kind == _K.F and s < n_stages - 1 and fwd.get((s + 1, i), r) != r:
                seq.append(Action(r, _K.SEND_F, s, i, fwd[(s + 1, i)]))
            if a.kind in _DX and s > 0 and bwd.get((s - 1, i), r) != r:
                seq.append(Action(r, _K.SEND_B, s, i, bwd[(s - 1, i)]))
        out[r] = seq
    return out


def finish(lists: dict[int, list[Action]], n_stages: int, n_mb: int, stage_to_rank: dict[int, tuple[int, ...]],
           name: str, synchronous: bool = True, **meta) -> Schedule:
    """Add comms; for a synchronous schedule also one ``RG s`` per held stage (after its last backward
    there) and, after all of them, one ``STEP s`` per held stage. Asynchronous generators pass
    ``synchronous=False`` and place their ``RG s`` + ``STEP s@v`` pairs themselves."""
    full = add_comms(lists, n_stages)
    for r in full:
        if synchronous:
            full[r] = place_reduce_grad(full[r], r, stage_to_rank)
            full[r] += [Action(r, _K.STEP, s) for s, rs in sorted(stage_to_rank.items()) if r in rs]
    return Schedule(full, n_stages, n_mb, dict(stage_to_rank), name, {k: str(v) for k, v in meta.items()})


def greedy_order(tasks: dict[int, list[tuple[str, int, int]]], deps, priority, dur=None) -> dict[int, list[tuple]]:
    """List-schedule compute tasks per rank: whenever a rank is free, run its ready task of least priority.

    ``tasks[r]``: the ``(kind, stage, mb)`` tasks rank r must run; ``deps(task)``: the tasks it needs
    (on any rank); ``priority(rank, task)``: a sort key; ``dur(task)``: its length (F=1, B=2 default).
    Returns each rank's tasks in the order they started. Used for Chimera, whose published figures are
    drawn this way (Li & Hoefler SC'21, Fig. 3): each worker runs the earliest ready work.
    """
    dur = dur or (lambda t: 1 if t[0] == "F" else 2)
    rank_of = {t: r for r, ts in tasks.items() for t in ts}
    done_at: dict[tuple, float] = {}
    free_at = {r: 0.0 for r in tasks}
    left = {r: list(ts) for r, ts in tasks.items()}
    order: dict[int, list[tuple]] = {r: [] for r in tasks}
    while any(left.values()):
        best = None
        for r in sorted(tasks):
            ready = [(max([free_at[r]] + [done_at[d] for d in deps(t)]), priority(r, t), t)
                     for t in left[r] if all(d in done_at for d in deps(t))]
            if not ready:
                continue
            # earliest start first; among tasks that could start by then, the best priority
            t0 = min(x[0] for x in ready)
            cand = min((x for x in ready if x[0] <= t0), key=lambda x: x[1])
            if best is None or (cand[0], r) < (best[0], best[3]):
                best = (cand[0], cand[1], cand[2], r)
        if best is None:
            raise RuntimeError(f"greedy_order: no task is ready; tasks left: {left} (a dependency is on no rank: "
                               f"{[d for ts in left.values() for t in ts for d in deps(t) if d not in rank_of]})")
        start, _, t, r = best
        done_at[t] = start + dur(t)
        free_at[r] = done_at[t]
        left[r].remove(t)
        order[r].append(t)
    return order
