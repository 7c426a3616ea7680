"""The bucket sums of a rank in flight: when each phase runs and when each collective piece is issued and waited.

A traced bucket sum is compute phases with collectives between them (:mod:`fxpar.compress.phases`). The graph calls
``bucket_sum`` when backward has made a bucket (a *ready* event) and ``bucket_sum_wait`` where the update reads it
(the *need* event: the first such call finishes every sum in flight). :class:`InFlight` decides, the same way on
every rank (from the order of the calls and the sizes, never from timing), what runs at each event:

* **FIFO** (``priority=None``, every collective whole, no credit): at bucket ``b``'s ready event each sum started
  before moves on to its last collectives (waiting the results they need: PowerSGD's P, then Q is issued), then
  ``b``'s first phase runs and its first collectives go. The collectives keep the order of the synchronous sum --
  bucket by bucket, each bucket's in the traced order -- and the first of each bucket leaves in backward, as soon as
  the bucket is made. At the need event the sums finish in bucket order.
* **ByteScheduler** (Peng et al., SOSP'19, on the compressed pieces: ``priority``, ``partition``, ``credit``): each
  collective an all-reduce or all-gather of more than ``partition`` bytes is cut into pieces of whole rows
  (:func:`fxpar.compress.phases.piece_bytes`); pieces queue by their bucket's priority (the first layers first)
  and go while at most ``credit`` bytes are issued and not waited (one piece always may). At a ready event a sum
  whose pieces all left at an earlier event moves on by one phase, and while the queue's first piece does not fit,
  the oldest piece in flight issued at an earlier event is waited ("the next piece goes when one completes", on a
  link that serves pieces in order). At the need event the sums move on a phase at a time, highest priority
  first, round after round, so one bucket's second collectives overlap another's.

The order of collectives is a function of the calls alone, so the ranks (which make the same calls) agree on it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from fxpar.collectives import C10D

from .phases import PhasedSum, piece_bytes

__all__ = ["Running", "InFlight"]


@dataclass
class Running:
    """One bucket's sum under way: ``env`` holds its values by name (inputs, what a phase made, waited results);
    ``next``: the phase to run next; ``result``: the last phase's outputs once it ran."""
    key: tuple
    priority: int
    phased: PhasedSum
    env: dict
    next: int = 0
    result: tuple | None = None
    pieces: dict = field(default_factory=dict)       # collective name -> its pieces

    @property
    def last(self) -> int:
        return len(self.phased.phases) - 1


@dataclass
class _Piece:
    """One collective piece of a sum. It names its sum by key, and does not hold it: a sum holds its pieces, and a
    reference back would make a cycle that keeps the pieces' tensors (a bucket's sends and results) alive until
    Python's cycle collector runs, several steps later on a large model, as heap the next steps fault in afresh."""
    key: tuple
    coll: object
    send: torch.Tensor
    nbytes: int
    seq: int
    out: torch.Tensor | None = None
    issued_at: int = -1
    got: torch.Tensor | None = None


class InFlight:
    """The rank's bucket sums in flight (module docstring). ``issue(collective, tensor)`` issues one functional
    collective on the rank's group and returns its pending result."""

    def __init__(self, issue, priority: dict | None = None, partition: int | None = None, credit: int | None = None):
        self.issue_fn = issue
        self.fifo = priority is None
        self.priority = priority or {}
        self.partition = None if self.fifo else partition
        self.credit = None if self.fifo else credit
        self.running: list = []
        self.queue: list = []        # (priority, seq, piece)
        self.inflight: list = []     # pieces issued and not waited, in issue order
        self.used = 0
        self.event = 0
        self.seq = 0
        self.log: list = []          # this step's ("issue" | "wait", key, collective, piece, bytes), for tests
        self.drained = False

    # ---- events -------------------------------------------------------------------------------------------------
    def ready(self, run: Running) -> None:
        """A bucket is made: the sums before it move on, its first phase runs, its first pieces queue and go."""
        if self.drained:             # a new step
            self.log, self.drained = [], False
        self.event += 1
        for r in self._by_priority():
            if self.fifo:
                while r.next < r.last:
                    self._advance(r)
            elif r.next < r.last and self._left_before(r):
                self._advance(r)
        self.running.append(run)
        self._advance(run)
        if not self.fifo:
            while self.queue and self.inflight and not self._fits(self.queue[0][2]) \
                    and self.inflight[0].issued_at < self.event:
                self._wait(self.inflight[0])
        self._refill()

    def drain(self) -> None:
        """The update needs the sums: every sum in flight runs to its end, a phase at a time, highest priority first."""
        self.event += 1
        while any(r.result is None for r in self.running):
            for r in self._by_priority():
                if r.result is None:
                    self._advance(r)
                    self._refill()
        self.running = []
        self.drained = True

    # ---- mechanics ------------------------------------------------------------------------------------------------
    def _by_priority(self) -> list:
        return sorted(self.running, key=lambda r: r.priority)

    def _left_before(self, r: Running) -> bool:
        """Whether every piece the next phase of ``r`` waits for was issued at an earlier event."""
        names = r.phased.needs[r.next]
        ps = [p for n in names for p in r.pieces.get(n, [])]
        return all(p.issued_at >= 0 and p.issued_at < self.event for p in ps)

    def _advance(self, r: Running) -> None:
        """Run ``r``'s next phase: its collectives' results it reads are waited first (issued first where still
        queued), then what it makes goes into ``r.env`` and its collectives' pieces queue."""
        k = r.next
        for name in r.phased.needs[k]:
            if name in r.env:
                continue
            ps = r.pieces[name]
            for p in ps:
                if p.out is None:
                    self._force(p)
            for p in ps:
                if p.got is None:
                    self._wait(p)
            r.env[name] = _assemble([p.got for p in ps], ps[0].coll)
        phase = r.phased.phases[k]
        outs = phase.gm(*[r.env[n] for n in phase.inputs])
        r.env.update(zip(phase.outputs, outs))
        r.next = k + 1
        if k == r.last:
            r.result = tuple(r.env[n] for n in r.phased.outputs)
            r.env, r.pieces = {}, {}         # every piece was waited: what the sum sent and got is let go
            return
        for c in r.phased.issues[k]:
            send = r.env[c.send].contiguous()
            sizes = piece_bytes(c, self.partition)
            r.pieces[c.name] = ps = []
            at = 0
            for nb in sizes:
                rows = nb // c.row_bytes if len(sizes) > 1 else None
                part = send if rows is None else send[at:at + rows]
                at += rows or 0
                ps.append(_Piece(r.key, c, part, nb, self.seq))
                self.seq += 1
                heapq.heappush(self.queue, (r.priority, ps[-1].seq, ps[-1]))
        if self.fifo:
            self._refill()

    def _fits(self, p: _Piece) -> bool:
        return self.credit is None or not self.inflight or self.used + p.nbytes <= self.credit

    def _refill(self) -> None:
        while self.queue and self._fits(self.queue[0][2]):
            self._issue(heapq.heappop(self.queue)[2])

    def _force(self, p: _Piece) -> None:
        """Issue queued piece ``p`` now, waiting for the oldest in flight while the credit is short."""
        self.queue = [e for e in self.queue if e[2] is not p]
        heapq.heapify(self.queue)
        while not self._fits(p):
            self._wait(self.inflight[0])
        self._issue(p)

    def _issue(self, p: _Piece) -> None:
        p.out = self.issue_fn(p.coll, p.send)
        p.issued_at = self.event
        self.inflight.append(p)
        self.used += p.nbytes
        self.log.append(("issue", p.key, p.coll.name, p.seq, p.nbytes))

    def _wait(self, p: _Piece) -> None:
        p.got = C10D.wait_tensor(p.out)
        self.inflight.remove(p)
        self.used -= p.nbytes
        self.log.append(("wait", p.key, p.coll.name, p.seq, p.nbytes))


def _assemble(parts: list, coll) -> torch.Tensor:
    """A collective's result from its pieces' (one piece: itself). All-reduce: the pieces' rows in order; all-gather:
    per rank, that rank's rows of every piece."""
    if len(parts) == 1:
        return parts[0]
    if coll.kind == "all_gather":
        size = int(coll.args[0])
        per = [p.view(size, p.shape[0] // size, *p.shape[1:]) for p in parts]
        return torch.cat([q[r] for r in range(size) for q in per], 0)
    return torch.cat(parts, 0)
