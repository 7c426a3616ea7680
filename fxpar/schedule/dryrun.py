"""Dry-run a Schedule: timelines, makespan, bubble, activation and weight-version peaks, deadlocks.

    >>> from fxpar.schedule import get_schedule, simulate
    >>> r = simulate(get_schedule("zb1p", 4, 8), F=1, I=1, W=1)      # B = I + W = 2 by default
    >>> r.makespan, simulate(get_schedule("1f1b", 4, 8), F=1, B=2).makespan
    (30.0, 33.0)

Runtime semantics this simulator implements -- and that an executor must implement too:

* Each rank runs its list strictly in order; one action at a time.
* ``F s.i`` needs the input of stage s for microbatch i on this rank: the output of ``F (s-1).i``
  run earlier on this rank, or a completed ``RF s.i<src``. ``B s.i`` and ``I s.i`` need ``F s.i`` done
  on this rank and (unless s is the last stage) the output gradient: ``B (s+1).i`` or ``I (s+1).i``
  earlier on this rank, or a completed ``RB s.i<src``. ``W s.i`` needs ``I s.i`` on this rank. A SEND
  needs the compute that made its tensor: ``SF`` its ``F``, ``SB`` its ``B`` or ``I`` (the input
  gradient exists once I is done; W adds only weight gradients). ``FULL s.i`` needs nothing: it is
  the whole one-stage step.
* Sends are asynchronous (default, ``blocking_sends=False``): a SEND posts the tensor and the rank goes
  on at once (``isend``; the runtime keeps the buffer alive until it waits on the send: right after the RECV
  :func:`fxpar.schedule.sends.send_releases` names, where the receiver is known to have the message, else at the
  end of the schedule). The message arrives ``comm`` later. A RECV blocks until its message has arrived.
  Messages between two ranks are matched in order per channel (src, dst, F or B): the n-th
  ``SF``/``SB`` from src to dst pairs with the n-th ``RF``/``RB`` at dst from src (``validate`` checks
  that the pairs agree). With ``blocking_sends=True`` a SEND instead waits for its RECV (rendezvous),
  which is how one checks a schedule for a runtime with blocking ``send``.
* ``RG s`` (REDUCE_GRAD) is a collective over ``stage_to_rank[s]``: every rank holding s must reach
  its n-th ``RG s``; all leave together ``reduce`` after the last one arrived. It sums the gradients
  each holder accumulated (for Chimera the two halves of the batch); a runtime that averages losses
  over microbatches must scale by the global microbatch count. Data-parallel replicas outside the
  schedule run the same list and meet in the same order.
* ``UNSHARD s`` / ``RESHARD s`` (ZeRO-3, reserved) are local and take no time here.
* ``STEP s`` updates stage s from the gradients accumulated since its previous STEP (then zeroes
  them), applied to the newest version, creating the next version; ``STEP s@v`` must create exactly
  version v. ``FULL s.i`` computes with the newest version and, as its own step, creates the next.
  ``F``/``B``/``I``/``W`` with ``@v`` need version v of their stage to exist on the rank already and
  compute with it; without ``@v`` they use the newest version. The runtime may drop a version once it
  is not the newest and no later compute on that rank names it; the simulator counts versions held
  exactly that way (``peak_versions``), and a microbatch's activations from the start of its F to the
  end of its last backward (W when the backward is split, else B; a FULL holds them while it runs).

Durations: ``F``, ``B``, ``I``, ``W``, ``full``, ``comm``, ``reduce``, ``step`` are each a number or a
``{stage: number}`` mapping. ``B`` is a whole backward. A split backward defaults to halves of it,
``I = W = B/2`` (so F=1, B=2 gives I=W=1, the paper's equal slots; pass ``I``/``W`` to change either);
``full`` defaults to ``F + B``. The bubble fraction is the idle share of compute time:
``1 - sum(compute time) / (ranks * makespan)``, compute being F, B, I, W and FULL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from fxpar.schedule.exceptions import ScheduleValidationError
from fxpar.schedule.ir import Action, ActionKind, Schedule
from fxpar.schedule._diagnose import deadlock_error

__all__ = ["simulate", "SimResult"]

_K = ActionKind
Dur = Union[float, Mapping[int, float]]


@dataclass
class SimResult:
    """What :func:`simulate` measured. Times are in the units of the durations given."""

    timelines: dict[int, list[tuple[float, float, Action]]]   # rank -> (start, end, action), in list order
    makespan: float
    bubble_fraction: float
    busy: dict[int, float]                                     # rank -> compute (F/B/I/W/FULL) time
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


def _needs(a: Action, n_stages: int) -> list[tuple]:
    """The local facts (see ``ready`` in :func:`simulate`) an action waits for."""
    s, i = a.stage, a.microbatch
    if a.kind == _K.F:
        return [("in", s, i)] if s > 0 else []
    if a.kind in (_K.B, _K.I):
        return [("F", s, i)] + ([("grad", s, i)] if s < n_stages - 1 else [])
    if a.kind == _K.W:
        return [("I", s, i)]
    if a.kind == _K.SEND_F:
        return [("F", s, i)]
    if a.kind == _K.SEND_B:
        return [("dx", s, i)]
    return []


def simulate(schedule: Schedule, *, F: Dur = 1.0, B: Dur = 2.0, I: Dur | None = None,  # noqa: E741
             W: Dur | None = None, full: Dur | None = None, comm: Dur = 0.0, reduce: Dur = 0.0,
             step: Dur = 0.0, blocking_sends: bool = False) -> SimResult:
    """Run ``schedule`` on paper; raise :class:`ScheduleDeadlockError` if some ranks can never finish.

    ``I`` and ``W`` default to ``B/2`` each, ``full`` to ``F + B`` (per stage)."""
    acts = schedule.actions
    ranks = sorted(acts)
    n = schedule.n_stages
    durations = {
        _K.F: lambda s: _dur(F, s), _K.B: lambda s: _dur(B, s),
        _K.I: lambda s: _dur(B, s) / 2 if I is None else _dur(I, s),
        _K.W: lambda s: _dur(B, s) / 2 if W is None else _dur(W, s),
        _K.FULL: lambda s: _dur(F, s) + _dur(B, s) if full is None else _dur(full, s),
    }
    ptr = {r: 0 for r in ranks}
    free = {r: 0.0 for r in ranks}
    timelines: dict[int, list] = {r: [] for r in ranks}
    ready: dict[int, dict[tuple, float]] = {r: {} for r in ranks}   # (fact, s, i) -> time it became true
    arrived: dict[tuple, float] = {}                                  # message key -> arrival time
    version: dict[tuple, int] = {}                                    # (rank, stage) -> newest version
    created: dict[tuple, list] = {}                                   # (rank, stage) -> creation times
    uses: dict[tuple, list] = {}                                      # (rank, stage) -> (version, start, end)
    rg_seen: dict[tuple, int] = {}                                    # (rank, stage) -> RGs completed
    rg_wait: dict[tuple, dict] = {}                                   # (stage, n) -> {rank: arrival}
    problems: list[str] = []

    def run(r: int, a: Action, start: float, dur: float) -> None:
        timelines[r].append((start, start + dur, a))
        free[r] = start + dur
        ptr[r] += 1

    def new_version(r: int, s: int) -> None:
        version[(r, s)] = version.setdefault((r, s), 0) + 1
        created.setdefault((r, s), [0.0]).append(free[r])

    def do_compute(r: int, a: Action, t0: float) -> bool:
        s, i = a.stage, a.microbatch
        cur = version.setdefault((r, s), 0)
        v = cur if a.version is None else a.version
        if v > cur:
            problems.append(f"rank {r} step {ptr[r]}: {a.short()} uses version {v} of stage {s}, but only "
                            f"versions up to {cur} exist on rank {r} then (a STEP{s}@{v} must come first)")
        dur = durations[a.kind](s)
        uses.setdefault((r, s), []).append((v, t0, t0 + dur))
        run(r, a, t0, dur)
        done = ready[r]
        done[(a.kind.value, s, i)] = free[r]
        if a.kind == _K.F and s + 1 < n:
            done[("in", s + 1, i)] = free[r]
        if a.kind in (_K.B, _K.I):
            done[("dx", s, i)] = free[r]
            if s > 0:
                done[("grad", s - 1, i)] = free[r]
        if a.kind == _K.FULL:
            new_version(r, s)
        return True

    def do_send(r: int, a: Action, t0: float) -> bool:
        key = _msg_key(a, r)
        if not blocking_sends:
            arrived[key] = t0 + _dur(comm, a.stage)
            run(r, a, t0, 0.0)
            return True
        d = a.peer
        if d not in acts or ptr[d] >= len(acts[d]):
            return False
        b = acts[d][ptr[d]]
        if b.kind not in (_K.RECV_F, _K.RECV_B) or _msg_key(b, d) != key:
            return False
        t = max(t0, free[d])
        run(r, a, t, _dur(comm, a.stage))
        run(d, b, t, _dur(comm, a.stage))
        ready[d][("in" if b.kind == _K.RECV_F else "grad", b.stage, b.microbatch)] = free[d]
        return True

    def do_recv(r: int, a: Action, t0: float) -> bool:
        key = _msg_key(a, r)
        if blocking_sends or key not in arrived:
            return False   # under rendezvous the sender's side completes the pair
        t = max(t0, arrived[key])
        run(r, a, t0, t - t0)
        ready[r][("in" if a.kind == _K.RECV_F else "grad", a.stage, a.microbatch)] = t
        return True

    def do_reduce_grad(r: int, a: Action, t0: float) -> bool:
        s = a.stage
        k = rg_seen.get((r, s), 0)
        wait = rg_wait.setdefault((s, k), {})
        wait.setdefault(r, t0)
        members = schedule.stage_to_rank.get(s, (r,))
        if set(wait) < set(members):
            return False
        end = max(wait.values()) + _dur(reduce, s)
        for q in members:
            rg_seen[(q, s)] = k + 1
            run(q, acts[q][ptr[q]], wait[q], end - wait[q])
        return True

    def do_local(r: int, a: Action, t0: float) -> bool:          # UNSHARD, RESHARD: reserved, no time
        run(r, a, t0, 0.0)
        return True

    def do_step(r: int, a: Action, t0: float) -> bool:
        cur = version.setdefault((r, a.stage), 0)
        if a.version is not None and a.version != cur + 1:
            problems.append(f"rank {r} step {ptr[r]}: {a.short()} should create version {cur + 1} of stage {a.stage}")
        run(r, a, t0, _dur(step, a.stage))
        new_version(r, a.stage)
        return True

    handlers = {**{k: do_compute for k in durations}, _K.SEND_F: do_send, _K.SEND_B: do_send,
                _K.RECV_F: do_recv, _K.RECV_B: do_recv, _K.REDUCE_GRAD: do_reduce_grad,
                _K.UNSHARD: do_local, _K.RESHARD: do_local, _K.STEP: do_step}

    def try_one(r: int) -> bool:
        a = acts[r][ptr[r]]
        deps = _needs(a, n)
        if any(d not in ready[r] for d in deps):
            return False
        return handlers[a.kind](r, a, max([free[r]] + [ready[r][d] for d in deps]))

    progress = True
    while progress:
        progress = False
        for r in ranks:
            while ptr[r] < len(acts[r]) and try_one(r):
                progress = True
    if problems:
        raise ScheduleValidationError(problems)
    if any(ptr[r] < len(acts[r]) for r in ranks):
        raise deadlock_error(schedule, ptr, blocking_sends)
    return _measure(schedule, timelines, created, uses)


def _measure(schedule: Schedule, timelines: dict, created: dict, uses: dict) -> SimResult:
    ranks = sorted(timelines)
    makespan = max([end for tl in timelines.values() for _, end, _ in tl] + [0.0])
    busy = {r: sum(e - b for b, e, a in timelines[r] if a.is_compute) for r in ranks}
    bubble = 1.0 - sum(busy.values()) / (len(ranks) * makespan) if makespan > 0 else 0.0
    has_w = {(a.stage, a.microbatch) for tl in timelines.values() for _, _, a in tl if a.kind == _K.W}
    act_iv: dict[tuple, list] = {}
    for r in ranks:
        starts = {}
        for b, e, a in timelines[r]:
            mb = (a.stage, a.microbatch)
            if a.kind in (_K.F, _K.FULL):
                starts[mb] = b
            last = _K.W if mb in has_w else _K.B
            if a.kind in (last, _K.FULL) and mb in starts:
                act_iv.setdefault((r, a.stage), []).append((starts.pop(mb), e))
        for (st, _), b in starts.items():   # forwards with no backward here hold activations to the end
            act_iv.setdefault((r, st), []).append((b, makespan))
    peak_stage = {st: _peak([iv for (_, s2), ivs in act_iv.items() if s2 == st for iv in ivs])
                  for st in range(schedule.n_stages)}
    peak_rank = {r: _peak([iv for (r2, _), ivs in act_iv.items() if r2 == r for iv in ivs]) for r in ranks}
    peak_ver: dict[int, int] = {}
    for r in ranks:
        for st in schedule.rank_stages(r):
            times = created.get((r, st), [0.0])
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
