"""Where a schedule reduces each stage's gradients: ``RG s`` (REDUCE_GRAD) placement.

``RG s`` runs stage s's gradient collectives (data-parallel replicas, Chimera's two pipelines,
tied weights) on every rank holding s; in the dry run it is a collective over ``stage_to_rank[s]``.
Two placements:

* :func:`place_reduce_grad` -- what the synchronous generators do: one ``RG s`` on each rank holding
  s, right after that rank's last backward compute of s (its last ``B``, or its last ``W`` when the
  backward is split into I and W), after the send of that compute's input gradient if it has one
  (so the rank upstream is not kept waiting on the collective). A rank that never computes a
  backward of s reduces it at the end of its list. Stages with several holders are reduced in
  increasing stage order on every rank, so replicas meet in the same order; several RGs that fall
  on the same spot also go in increasing stage order::

      rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 RG0 STEP0
      rank 1: RF1.0<0 F1.0 RF1.1<0 F1.1 B1.0 SB1.0>0 B1.1 SB1.1>0 RG1 STEP1     (gpipe(2, 2))

* :func:`ensure_reduce_grad` -- for hand-written schedules without RG: a copy in which every STEP s
  with no ``RG s`` since the previous ``STEP s`` on its rank (for synchronous schedules: the one STEP)
  gets one right before it; RGs for a run of adjacent STEPs go before the run, in increasing stage
  order::

      rank 0: F0.0 B0.0 STEP0            ->   rank 0: F0.0 B0.0 RG0 STEP0
      rank 0: ... B3.1 STEP0 STEP3       ->   rank 0: ... B3.1 RG0 RG3 STEP0 STEP3
"""
from __future__ import annotations

import copy

from fxpar.schedule.ir import SENDS, Action, ActionKind, Schedule

__all__ = ["place_reduce_grad", "ensure_reduce_grad", "add_unshard"]

_K = ActionKind


def _spot_after_last_backward(seq: list[Action], stage: int) -> int | None:
    """Index just after the last B/W of ``stage`` in ``seq`` and the sends right behind it; None if none."""
    last = max((j for j, a in enumerate(seq) if a.stage == stage and a.kind in (_K.B, _K.W)), default=None)
    if last is None:
        return None
    j = last + 1
    while j < len(seq) and seq[j].kind in SENDS and seq[j].stage == stage:
        j += 1
    return j


def place_reduce_grad(seq: list[Action], rank: int, stage_to_rank: dict[int, tuple[int, ...]]) -> list[Action]:
    """``seq`` (one rank's list, comms included, no RG/STEP yet) with one ``RG s`` per held stage s."""
    held = [s for s, rs in sorted(stage_to_rank.items()) if rank in rs]
    spot = {s: _spot_after_last_backward(seq, s) for s in held}
    spot = {s: len(seq) if j is None else j for s, j in spot.items()}
    floor = 0
    for s in held:                                   # replicated stages: increasing order on every rank
        if len(stage_to_rank[s]) > 1:
            spot[s] = floor = max(spot[s], floor)
    out: list[Action] = []
    for j in range(len(seq) + 1):
        out += [Action(rank, _K.REDUCE_GRAD, s) for s in held if spot[s] == j]
        if j < len(seq):
            out.append(seq[j])
    return out


def ensure_reduce_grad(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` where every STEP s of a rank holding s has an ``RG s`` since its previous STEP s.

    Meant for hand-written schedules that leave gradient reduction out; schedules from the generators
    come back unchanged. ``FULL`` already contains its reduction and needs none.
    """
    out = copy.deepcopy(schedule)
    for r, seq in out.actions.items():
        new: list[Action] = []
        reduced: dict[int, bool] = {}               # stage -> RG seen since its last STEP
        j = 0
        while j < len(seq):
            if seq[j].kind != _K.STEP:
                a = seq[j]
                if a.kind == _K.REDUCE_GRAD:
                    reduced[a.stage] = True
                new.append(a)
                j += 1
                continue
            run = []
            while j < len(seq) and seq[j].kind == _K.STEP:
                run.append(seq[j])
                j += 1
            missing = sorted({a.stage for a in run if not reduced.get(a.stage)
                              and r in schedule.stage_to_rank.get(a.stage, ())})
            new += [Action(r, _K.REDUCE_GRAD, s) for s in missing] + run
            for a in run:
                reduced[a.stage] = False
        out.actions[r] = new
    return out



def add_unshard(schedule: Schedule, stages) -> Schedule:
    """A copy of ``schedule`` where each rank gathers the parameters of each of ``stages`` it holds once per step
    (ZeRO-3 under a pipeline): ``UNSHARD s`` right before its first compute of s, ``RESHARD s`` right after its
    last backward of s (and the sends behind it)::

        rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 RG0 STEP0
        rank 0: UNSHARD0 F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 RESHARD0 RG0 STEP0
    """
    out = copy.deepcopy(schedule)
    compute = (_K.F, _K.B, _K.I, _K.W)
    for r, seq in out.actions.items():
        for s in sorted(set(stages)):
            if not any(a.stage == s and a.kind in compute for a in seq):
                continue
            first = min(j for j, a in enumerate(seq) if a.stage == s and a.kind in compute)
            seq.insert(first, Action(r, _K.UNSHARD, s))
            end = _spot_after_last_backward(seq, s)
            seq.insert(end, Action(r, _K.RESHARD, s))
    return out
