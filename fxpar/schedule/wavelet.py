"""Wavelet's tick-tock waves: two waves of training on the same ranks, the second (tock) half a cycle late.

Wang, Wang, Jiang, Li & Stoica, "Wavelet: Efficient DNN Training with Tick-Tock Scheduling", MLSys'21. A rank's
memory climbs through a forward (activations saved for the backward) and falls through the backward; Wavelet
launches a second wave of training tasks (tock) on the same devices half a forward-backward cycle after the first
(tick), so that one wave's forward, whose memory grows, runs while the other's backward frees it: one wave's peak
falls in the other's valley.

The model is in ``v`` stages. One wave's forward-backward cycle of a microbatch is ``2v`` slots,
``F0 .. F(v-1) B(v-1) .. B0``, one stage per slot; the tock wave runs the same cycle ``v`` slots (half a cycle)
later. Of the step's ``m`` microbatches the first ``m/2`` are the tick wave's, the others the tock wave's, one
cycle after another in each wave. In a slot where a rank has work of both waves the tick action runs first.

* ``p = 1`` (data parallelism): every stage is a chunk of the whole model on the one pipeline rank (no message
  between them: the executor hands a chunk's output to the next in place); ``v >= 2``.
* ``p > 1`` (model parallelism): ``v = p`` stages; the tick wave puts stage ``s`` on rank ``s``, the tock wave on
  rank ``p-1-s``: the tock wave's forward runs from the last rank to the first, along the tick wave's backward. On
  rank ``r`` the tock wave's forward of stage ``p-1-r`` falls in the slot of the tick wave's backward of stage
  ``r`` (and the tock's backward in the slot of the tick's next forward): each rank holds the two waves'
  activations in turn. Each rank holds stages ``r`` and ``p-1-r``, the two copies of a stage (one per wave).
  This is fxpar's reading; a reader's notes of the paper (``ruipeterpan/paper_notes``) give it N-1 tock waves on
  N GPUs, each GPU's partition switched round-robin, which agrees with this one at ``p = 2`` only
  (docs/strategies/pipelines.md, "Checked against the papers").

Both waves add their gradients into the one accumulator per parameter and rank; each stage reduces them over its
holders and ``dp`` (``RG``) after its last backward on the rank and updates once (``STEP``): an update sums the two
waves' gradients, so the step is synchronous training on the global batch.

Example, ``wavelet(1, 2)`` (one microbatch per wave, two chunks)::

    rank 0: F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 RG1 B0.1 RG0 STEP0 STEP1

After ``F1.0`` the tick wave holds both chunks' saved activations (its peak); its ``B1.0`` frees one before the
tock wave's ``F0.1`` saves one: the two waves together never hold more than one wave's peak.

``wavelet(2, 2)`` (two ranks, the tock wave reversed: its stage 0 on rank 1, its stage 1 on rank 0)::

    rank 0: F0.0 SF0.0>1 RB0.0<1 B0.0 RF1.1<1 F1.1 B1.1 SB1.1>1 RG0 RG1 STEP0 STEP1
    rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0 F0.1 SF0.1>0 RB0.1<0 B0.1 RG0 RG1 STEP0 STEP1

Rank 1 runs the tick wave's ``B1.0`` and then, in the same slot, the tock wave's ``F0.1``; a stage's two copies reduce
together (``RG``) once the rank's compute is done, both stages in increasing order on both ranks.
"""
from __future__ import annotations

from fxpar.schedule._build import add_comms, compute, finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Action, ActionKind, Schedule

__all__ = ["wavelet", "wave_slots", "wave_rank", "WAVES"]

WAVES = 2          # tick and tock


def wave_slots(v: int, k: int, wave: int) -> list:
    """One wave's compute in slot order: ``[(slot, kind, stage, microbatch)]`` for its ``k`` microbatches over ``v``
    stages; wave 0 (tick) takes microbatches ``0 .. k-1`` from slot 0, wave 1 (tock) ``k .. 2k-1`` from slot ``v``."""
    out = []
    for j in range(k):
        mb, t0 = wave * k + j, j * 2 * v + wave * v
        out += [(t0 + c, "F", c, mb) for c in range(v)]
        out += [(t0 + v + c, "B", v - 1 - c, mb) for c in range(v)]
    return out


def wave_rank(p: int, stage: int, wave: int) -> int:
    """The pipeline rank that runs ``stage`` of ``wave`` (0 tick, 1 tock): the tick wave's stage ``s`` on rank
    ``s``, the tock wave's on rank ``p-1-s``; everything on rank 0 when ``p = 1``."""
    if p == 1:
        return 0
    return stage if wave == 0 else p - 1 - stage


def wavelet(p: int, m: int, v: int | None = None) -> Schedule:
    """Tick-tock waves over ``p`` pipeline ranks: ``m`` microbatches (``m/2`` per wave), the model in ``v`` stages
    (``p = 1``: ``v`` chunks on the one rank, default 2; ``p > 1``: ``v = p``, one stage per rank per wave)."""
    if p < 1:
        raise ScheduleError(f"wavelet(p={p}) needs p >= 1 pipeline ranks.")
    v = (2 if p == 1 else p) if v is None else v
    if p > 1 and v != p:
        raise ScheduleError(f"wavelet(p={p}, v={v}): over p > 1 ranks the model is in p stages, one per rank in "
                            f"each wave (the tock wave's in reverse order); use v={p} or leave v out.")
    if m < WAVES or m % WAVES:
        raise ScheduleError(f"wavelet(p={p}, m={m}) needs an even m >= 2: half the microbatches are the tick wave's, "
                            f"half the tock wave's. Use m={max(2, m - m % 2)} or m={m + m % 2 or m + 2}.")
    if v < 2:
        raise ScheduleError(f"wavelet(v={v}) needs the model in v >= 2 chunks: with one chunk the tock wave's forward "
                            "cannot start while the tick wave's backward runs.")
    k = m // WAVES
    slots = sorted(wave_slots(v, k, 0) + wave_slots(v, k, 1), key=lambda x: (x[0], x[3]))
    lists: dict = {r: [] for r in range(p)}
    for _, kind, c, mb in slots:
        r = wave_rank(p, c, mb // k)
        lists[r].append(compute(r, kind, c, mb))
    placement = {c: tuple(sorted({wave_rank(p, c, 0), wave_rank(p, c, 1)})) for c in range(v)}
    if p == 1:
        return finish(lists, v, m, placement, "wavelet", v=v)
    # a stage's two copies reduce together once both waves' backwards of it are done on both holders: every rank
    # reduces after its last compute, its two stages in increasing order (the pair of ranks holding them agree)
    full = add_comms(lists, v)
    for r, seq in full.items():
        held = [c for c, rs in sorted(placement.items()) if r in rs]
        seq += [Action(r, ActionKind.REDUCE_GRAD, c) for c in held] + [Action(r, ActionKind.STEP, c) for c in held]
    return Schedule(full, v, m, placement, "wavelet", {"v": str(v)})
