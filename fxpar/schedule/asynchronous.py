"""Asynchronous 1F1B schedules without a flush: PipeDream and PipeDream-2BW.

Both keep 1F1B's order (stage s warms up with ``p-s-1`` forwards, then alternates F and B) but never
drain the pipeline to update weights; instead the weights change while microbatches are in flight,
and every F/B says which weight version of its stage it uses (``F0.5@2``). Version v of stage s is
its weights after v STEPs of stage s (0 = initial). A B always uses the version its F used, so the
runtime must keep ("stash") that version until the B has run.

PipeDream (Harlap, Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP'19): an ``RG s`` and a STEP after every B (per-microbatch updates); each F uses the newest
version. Stage s holds at most ``p-s`` versions at once (its in-flight microbatches' stashed versions
plus the newest).

PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML'21): the
m microbatches of batch b accumulate one gradient, computed on every stage with version ``max(b-1, 0)``;
after the last B of batch b, ``RG s`` then ``STEP@(b+1)`` makes W(b+1) = W(b) - lr * grad(W(b-1)) --
the paper's W(t+1) = W(t) - nu * grad f(W(t-1)) with W(-1) = W(0). Two versions at most per stage; the
generator needs m >= p-1 so that version b-1 exists on stage 0 when batch b starts.

Example, ``pipedream(2, 3)``::

    rank 0: F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 RG0 STEP0@1 F0.2@1 SF0.2>1 RB0.1<1 B0.1@0 RG0 STEP0@2 ...

Every ``STEP s@v`` has an ``RG s`` right before it: the reduction of the gradient that step applies.
"""
from __future__ import annotations

from fxpar.schedule._build import finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Action, ActionKind, Schedule
from fxpar.schedule.synchronous import one_f_one_b_lists

__all__ = ["pipedream", "pipedream_2bw", "carried_versions"]


def _reduce_and_step(stage: int, version: int) -> list[Action]:
    """``RG s`` (this stage's gradient collectives, e.g. over dp replicas) then ``STEP s@version``."""
    return [Action(stage, ActionKind.REDUCE_GRAD, stage), Action(stage, ActionKind.STEP, stage, version=version)]


def pipedream(p: int, m: int, resumed: bool = False) -> Schedule:
    """PipeDream's asynchronous 1F1B with weight stashing over m microbatches, one STEP per B.

    F of microbatch i on stage s uses the newest version, which is the number of B's stage s ran
    before it: ``max(0, i - (p-s-1))``. Its B uses the same version; ``RG s STEP s@(k+1)`` follow ``B k``.
    The schedule covers m microbatches from an empty pipeline to an empty pipeline.

    ``resumed=True``: the window continues a run (a resumed checkpoint) as if it had never stopped. Had it
    not, microbatch i of this window would compute on stage s with the stage's weights ``D = p-s-1`` updates
    before the newest: the window starts holding ``D + 1`` versions of stage s, ``0 .. D-1`` the previous
    weights W(t-D) .. W(t-1) the checkpoint carries and ``D`` = W(t), so microbatch i computes with version
    i and ``STEP s@(k+1+D)`` follows ``B k``. Such a window says so in its ``meta`` (``resumed``)."""
    if p < 1 or m < 1:
        raise ScheduleError(f"pipedream: need p >= 1 stages and m >= 1 microbatches, got p={p}, m={m}")

    def version(s: int, i: int) -> int:
        return i if resumed else max(0, i - (p - s - 1))

    def step_after(s: int, k: int) -> list:
        return _reduce_and_step(s, k + 1 + ((p - s - 1) if resumed else 0))

    lists = one_f_one_b_lists(p, m, version, step_after)
    return finish(lists, p, m, {s: (s,) for s in range(p)}, "pipedream", synchronous=False,
                  **({"resumed": 1} if resumed else {}))


def carried_versions(schedule: Schedule) -> dict:
    """Stage -> how many weight versions older than the newest a window of ``schedule`` starts holding: the
    versions below the one its first ``STEP s@v`` follows (``v - 1``). 0 for a window that starts a run; for a
    resumed window, what the checkpoint must carry for each stage (PipeDream's and the delayed pipelines'
    ``p-s-1``, 2BW's 1)."""
    out: dict = {}
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind == ActionKind.STEP and a.version is not None and a.stage not in out:
                out[a.stage] = a.version - 1
    return out


def pipedream_2bw(p: int, m: int, n_batches: int = 2, resumed: bool = False) -> Schedule:
    """PipeDream-2BW: 1F1B over ``n_batches`` batches of m microbatches without a flush between them.

    Microbatch j belongs to batch ``b = j // m`` and uses version ``max(b-1, 0)`` on every stage, for F
    and B alike; ``RG s STEP s@(b+1)`` follow the B of batch b's last microbatch on each stage. The schedule
    has ``n_batches * m`` microbatches (``n_microbatches`` counts them all). Needs m >= p-1: stage 0
    runs batch b's first F after the B of microbatch ``b*m - p``, which must end batch b-2 or later.

    ``resumed=True``: the window continues a run (a resumed checkpoint) instead of starting one: it
    begins holding two versions, 0 = W(t-1) (the stashed previous weights) and 1 = W(t), so batch b
    computes with version b (= W(t+b-1)) and ``STEP@(b+2)`` makes W(t+b+1), exactly as if the run had
    never stopped. Such a window says so in its ``meta`` (``resumed``): the runtime then loads the
    checkpoint's stashed W(t-1).
    """
    if p < 1 or m < 1 or n_batches < 1:
        raise ScheduleError(f"2bw: need p, m, n_batches >= 1, got p={p}, m={m}, n_batches={n_batches}")
    if m < p - 1:
        raise ScheduleError(
            f"2bw(p={p}, m={m}) needs m >= p-1 = {p - 1} microbatches per batch: batch b computes with weight "
            f"version b-1, which stage 0 only has after the last backward of batch b-2, and with 1F1B's p-1 = "
            f"{p - 1} warmup forwards on stage 0 that backward comes before batch b's first forward only if "
            f"m >= p-1. Use m >= {p - 1}, or 'pipedream' for per-microbatch updates.")
    total = m * n_batches

    shift = 1 if resumed else 0

    def version(s: int, j: int) -> int:
        return max(j // m - 1 + shift, 0)

    def step_after(s: int, k: int):
        return _reduce_and_step(s, k // m + 1 + shift) if k % m == m - 1 else None

    lists = one_f_one_b_lists(p, total, version, step_after)
    return finish(lists, p, total, {s: (s,) for s in range(p)}, "2bw", synchronous=False,
                  batch=m, n_batches=n_batches, **({"resumed": 1} if resumed else {}))
