"""Dry-run a Schedule: timelines, makespan, bubble, activation and weight-version peaks, deadlocks.

Runtime semantics this simulator implements -- and that an executor must implement too:

* Each rank runs its list strictly in order; one action at a time.
* ``F s.i`` needs the input of stage s for microbatch i on this rank: the output of ``F (s-1).i``
  run earlier on this rank, or a completed ``RF s.i<src``. ``B s.i`` needs ``F s.i`` done on this
  rank and (unless s is the last stage) the output gradient: ``B (s+1).i`` earlier on this rank or a
  completed ``RB s.i<src``. ``W s.i`` needs ``B s.i``. A SEND needs the compute that made its tensor.
* Sends are asynchronous (default, ``blocking_sends=False``): a SEND posts the tensor and the rank goes
  on at once (``isend``; the runtime keeps the buffer alive and waits on every outstanding send before
  the schedule ends). The message arrives ``comm`` later. A RECV blocks until its message has arrived.
  Messages between two ranks are matched in order per channel (src, dst, F or B): the n-th
  ``SF``/``SB`` from src to dst pairs with the n-th ``RF``/``RB`` at dst from src (``validate`` checks
  that the pairs agree). With ``blocking_sends=True`` a SEND instead waits for its RECV (rendezvous),
  which is how one checks a schedule for a runtime with blocking ``send``.
* ``SYNC s`` is a collective over ``stage_to_rank[s]``: every replica of s must reach its n-th
  ``SYNC s``; all leave together ``sync`` after the last one arrived.
* ``SYNC`` sums the gradients each replica accumulated (for Chimera the two halves of the batch); a
  runtime that averages losses over microbatches must scale by the global microbatch count.
* ``STEP s`` updates stage s from the gradients accumulated since its previous STEP (then zeroes
  them), applied to the newest version, creating the next version; ``STEP s@v`` must create exactly
  version v. ``F``/``B``/``W`` with ``@v`` need version v of their stage to exist on the rank already
  and compute with it; without ``@v`` they use the newest version. The runtime may drop a version
  once it is not the newest and no later F/B/W on that rank names it; the simulator counts versions
  held exactly that way (``peak_versions``), and activations from the start of F to the end of B (W).

Durations: ``F``, ``B``, ``W``, ``comm``, ``sync``, ``step`` are each a number or a ``{stage: number}``
mapping. The bubble fraction is the idle share of compute time: ``1 - sum(F/B/W time) / (ranks * makespan)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from fxpar.schedule.errors import ScheduleDeadlockError, ScheduleValidationError
from fxpar.schedule.ir import Action, ActionKind, Schedule

__all__ = ["simulate", "SimResult"]

_K = ActionKind
Dur = Union[float, Mapping[int, float]]


@dataclass
class SimResult:
    """What :func:`simulate` measured. Times are in the units of the durations given."""

    timelines: dict[int, list[tuple[float, float, Action]]]   # rank -> (start, end, action), in list order
    makespan: float
    bubble_fraction: float
    busy: dict[int, float]                                     # rank -> F/B/W time
    peak_activations: dict[int, int]                           # stage -> most microbatches in flight (all replicas)
    peak_activations_per_rank: dict[int, int]                  # rank -> most microbatches in flight (all its stages)
    peak_versions: dict[int, int]                              # stage -> most weight versions held (max over replicas)

    def compute_grid(self, unit: float = 1.0) -> str:
        """One row per rank, one column per ``unit`` of time; each cell the compute action running then."""
        n = int(round(self.makespan / unit))
        rows = []
        for r, tl in sorted(self.timelines.items()):
            cells = ["."] * n
            for start, end, a in tl:
                if a.is_compute:
                    for t in range(int(round(start / unit)), int(round(end / unit))):
                        cells[t] = a.short()
            w = max(len(c) for c in cells) if cells else 1
            rows.append(f"rank{r}: " + " ".join(c.ljust(w) for c in cells).rstrip())
        return "\n".join(rows)


def _dur(d: Dur, stage: int) -> float:
    return float(d[stage]) if isinstance(d, Mapping) else float(d)


def _msg_key(a: Action, rank: int) -> tuple:
    """(channel, consumer stage, mb, src, dst) for a SEND or RECV on ``rank``."""
    if a.kind == _K.SEND_F:
        return ("F", a.stage + 1, a.microbatch, rank, a.peer)
    if a.kind == _K.SEND_B:
        return ("B", a.stage - 1, a.microbatch, rank, a.peer)
    ch = "F" if a.kind == _K.RECV_F else "B"
    return (ch, a.stage, a.microbatch, a.peer, rank)


def simulate(schedule: Schedule, *, F: Dur = 1.0, B: Dur = 2.0, W: Dur = 1.0, comm: Dur = 0.0,
             sync: Dur = 0.0, step: Dur = 0.0, blocking_sends: bool = False) -> SimResult:
    """Run ``schedule`` on paper; raise :class:`ScheduleDeadlockError` if some ranks can never finish."""
    acts = schedule.actions
    ranks = sorted(acts)
    ptr = {r: 0 for r in ranks}
    free = {r: 0.0 for r in ranks}
    timelines: dict[int, list] = {r: [] for r in ranks}
    ready: dict[int, dict[tuple, float]] = {r: {} for r in ranks}   # ("in"|"grad"|"F"|"B", s, i) -> time
    arrived: dict[tuple, float] = {}                                  # message key -> arrival time
    version: dict[tuple, int] = {}                                    # (rank, stage) -> newest version
    created: dict[tuple, list] = {}                                   # (rank, stage) -> creation times
    uses: dict[tuple, list] = {}                                      # (rank, stage) -> (version, start, end)
    sync_seen: dict[tuple, int] = {}                                  # (rank, stage) -> SYNCs completed
    sync_wait: dict[tuple, dict] = {}                                 # (stage, n) -> {rank: arrival}
    has_w = {(a.stage, a.microbatch) for r in ranks for a in acts[r] if a.kind == _K.W}
    problems: list[str] = []

    def run(r: int, a: Action, start: float, dur: float) -> None:
        timelines[r].append((start, start + dur, a))
        free[r] = start + dur
        ptr[r] += 1

    def needs(r: int, a: Action) -> list[tuple]:
        s, i, n = a.stage, a.microbatch, schedule.n_stages
        if a.kind == _K.F:
            return [("in", s, i)] if s > 0 else []
        if a.kind == _K.B:
            return [("F", s, i)] + ([("grad", s, i)] if s < n - 1 else [])
        if a.kind == _K.W:
            return [("B", s, i)]
        if a.kind == _K.SEND_F:
            return [("F", s, i)]
        if a.kind == _K.SEND_B:
            return [("B", s, i)]
        return []

    def try_one(r: int) -> bool:
        a = acts[r][ptr[r]]
        s, i = a.stage, a.microbatch
        deps = needs(r, a)
        if any(d not in ready[r] for d in deps):
            return False
        t0 = max([free[r]] + [ready[r][d] for d in deps])
        key_vs = (r, s)
        if a.kind in (_K.F, _K.B, _K.W):
            cur = version.setdefault(key_vs, 0)
            v = cur if a.version is None else a.version
            if v > cur:
                problems.append(f"rank {r} step {ptr[r]}: {a.short()} uses version {v} of stage {s}, but only "
                                f"versions up to {cur} exist on rank {r} then (a STEP{s}@{v} must come first)")
            dur = _dur({_K.F: F, _K.B: B, _K.W: W}[a.kind], s)
            uses.setdefault(key_vs, []).append((v, t0, t0 + dur))
            run(r, a, t0, dur)
            ready[r][(a.kind.value, s, i)] = free[r]
            if a.kind == _K.F and s + 1 < schedule.n_stages:
                ready[r][("in", s + 1, i)] = free[r]
            if a.kind == _K.B and s > 0:
                ready[r][("grad", s - 1, i)] = free[r]
            return True
        if a.kind in (_K.SEND_F, _K.SEND_B):
            key = _msg_key(a, r)
            if not blocking_sends:
                arrived[key] = t0 + _dur(comm, s)
                run(r, a, t0, 0.0)
                return True
            d = a.peer
            if d not in acts or ptr[d] >= len(acts[d]):
                return False
            b = acts[d][ptr[d]]
            if b.kind not in (_K.RECV_F, _K.RECV_B) or _msg_key(b, d) != key:
                return False
            t = max(t0, free[d])
            run(r, a, t, _dur(comm, s))
            run(d, b, t, _dur(comm, s))
            ready[d][("in" if b.kind == _K.RECV_F else "grad", b.stage, b.microbatch)] = free[d]
            return True
        if a.kind in (_K.RECV_F, _K.RECV_B):
            key = _msg_key(a, r)
            if blocking_sends or key not in arrived:
                return False   # under rendezvous the sender's side completes the pair
            t = max(t0, arrived[key])
            run(r, a, t0, t - t0)
            ready[r][("in" if a.kind == _K.RECV_F else "grad", s, i)] = t
            return True
        if a.kind == _K.SYNC:
            n = sync_seen.get((r, s), 0)
            wait = sync_wait.setdefault((s, n), {})
            wait.setdefault(r, t0)
            members = schedule.stage_to_rank.get(s, (r,))
            if set(wait) < set(members):
                return False
            end = max(wait.values()) + _dur(sync, s)
            for q in members:
                sync_seen[(q, s)] = n + 1
                run(q, acts[q][ptr[q]], wait[q], end - wait[q])
            return True
        if a.kind == _K.STEP:
            cur = version.setdefault(key_vs, 0)
            if a.version is not None and a.version != cur + 1:
                problems.append(f"rank {r} step {ptr[r]}: {a.short()} should create version {cur + 1} of stage {s}")
            version[key_vs] = cur + 1
            run(r, a, t0, _dur(step, s))
            created.setdefault(key_vs, [0.0]).append(free[r])
            return True
        raise AssertionError(a)

    progress = True
    while progress:
        progress = False
        for r in ranks:
            while ptr[r] < len(acts[r]) and try_one(r):
                progress = True
    if problems:
        raise ScheduleValidationError(problems)
    if any(ptr[r] < len(acts[r]) for r in ranks):
        from fxpar.schedule._diagnose import deadlock_error
        raise deadlock_error(schedule, ptr, blocking_sends)

    makespan = max([end for tl in timelines.values() for _, end, _ in tl] + [0.0])
    busy = {r: sum(e - b for b, e, a in timelines[r] if a.is_compute) for r in ranks}
    bubble = 1.0 - sum(busy.values()) / (len(ranks) * makespan) if makespan > 0 else 0.0
    act_iv: dict[tuple, list] = {}
    for r in ranks:
        starts = {}
        for b, e, a in timelines[r]:
            if a.kind == _K.F:
                starts[(a.stage, a.microbatch)] = b
            last = _K.W if (a.stage, a.microbatch) in has_w else _K.B
            if a.kind == last and (a.stage, a.microbatch) in starts:
                act_iv.setdefault((r, a.stage), []).append((starts.pop((a.stage, a.microbatch)), e))
        for (st, _), b in starts.items():   # forwards with no backward here hold activations to the end
            act_iv.setdefault((r, st), []).append((b, makespan))
    peak_stage: dict[int, int] = {}
    for st in range(schedule.n_stages):
        peak_stage[st] = _peak([iv for (r, s2), ivs in act_iv.items() if s2 == st for iv in ivs])
    peak_rank = {r: _peak([iv for (r2, _), ivs in act_iv.items() if r2 == r for iv in ivs]) for r in ranks}
    peak_ver: dict[int, int] = {}
    for (r, st), times in [((r, st), created.get((r, st), [0.0])) for r in ranks for st in schedule.rank_stages(r)]:
        ivs = []
        for v, c in enumerate(times):
            nxt = times[v + 1] if v + 1 < len(times) else makespan
            last_use = max([e for v2, _, e in uses.get((r, st), []) if v2 == v] + [nxt])
            ivs.append((c, max(last_use, c)))
        ivs[-1] = (ivs[-1][0], max(ivs[-1][1], makespan) + 1.0)   # the newest version outlives the schedule
        peak_ver[st] = max(peak_ver.get(st, 0), _peak(ivs))
    return SimResult(timelines, makespan, bubble, busy, peak_stage, peak_rank, peak_ver)


def _peak(intervals: list[tuple[float, float]]) -> int:
    """Most intervals [start, end) open at once; an end at t closes before a start at t opens."""
    events = sorted([(b, 1) for b, e in intervals if e > b] + [(e, -1) for b, e in intervals if e > b])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
