"""SSP's and DSSP's parameter servers at run time (:mod:`fxpar.sync.ssp`): ranks beside the workers that hold the
parameters, add the workers' updates as they arrive and answer reads once the staleness bound allows.

A server holds one shard of the parameters (some of the keys, one flat buffer). Every message is point-to-point on
the default group: a worker sends a 4-value header (:data:`PUSH`, :data:`PULL`, :data:`STOP`, :data:`SAVE` or
:data:`RESTORE`, its clock, the clock every worker must have pushed before the read is answered -- ``-1``: the
first server chooses, DSSP -- and 1 for the final read after a worker's last clock, else 0), then for a push the
update of the server's shard. The server takes headers from any worker in the order they arrive::

    worker ── PUSH c, update ──▶ ┌───────────────────┐
    worker ── PULL c+1, need ──▶ │ server j:         │ ── (fresh, s, need), shard ──▶ worker   once min(clocks) >= need
                                 │ U[c] += update    │
                                 └───────────────────┘

A read for clock ``c`` with bound ``s`` gets the start plus, clock by clock, the updates of clocks ``< c + s``
received so far: every update of the clocks every worker has pushed (``>= c - s`` of them), any of the window
``[c - s, c + s - 1]`` that arrived, none later -- Ho et al.'s read; ``s = 0`` reads exactly the clocks before
``c``. The server logs, in order, each push ``("push", worker, clock)`` and each answered read ``("read", worker,
clock, fresh, s)`` (``fresh``: the clocks every worker had pushed when it answered): with the workers' updates, the
log is the whole of what the workers read (:func:`fxpar.testing.sync.ssp_reference` replays it). The first server also keeps the
clock table (:class:`fxpar.sync.ssp.ClockTable`): what each worker pushed and when, and the bound chosen per read.
A clock's updates are added in worker order, whatever order they arrive in: a read depends on which pushes arrived,
not on their order (``s = 0`` is bitwise reproducible).

Checkpoints: a worker saves after its final read, when the server holds every clock folded into its shard (the
parameters every worker read); its :data:`SAVE` gets back the server's clock and clock table, which the worker keeps
in its part of the checkpoint. After a load, a worker's first message is :data:`RESTORE` (the clock, its shard of
the loaded parameters, the saved state): the first sets the server's shard and table, the others must agree.

Under ``run_local`` the loop runs until every worker's stop (:func:`serve`); under torchrun ``program.runner()`` on
a server rank is an :class:`SSPServerRunner`, whose calls serve what the workers' same calls send.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar.feature import ExtraRank
from fxpar.host import HostSettings, reuse_freed_memory
from fxpar.runner import GroupExit
from fxpar.runtime.groups import comm_priority, group

from .method import method_from_dict
from .ssp import ClockTable

__all__ = ["SSPServer", "SSPServerRunner", "serve", "PUSH", "PULL", "STOP", "SAVE", "RESTORE", "TAG_HEAD", "TAG_DATA",
           "TAG_REPLY", "TAG_SHARD"]

PUSH, PULL, STOP, SAVE, RESTORE = 1, 2, 3, 4, 5
TAG_HEAD, TAG_DATA, TAG_REPLY, TAG_SHARD = 7101, 7102, 7103, 7104


@dataclass
class SSPServer(ExtraRank):
    """What one parameter server needs, picklable: its shard's keys, shapes and starting values, the workers'
    ranks, the method's options and every process group of the program (each rank creates each group)."""
    label = "SSP parameter server"
    rank: int                      # global rank
    index: int                     # j: its shard
    workers: tuple                 # the workers' global ranks, in dp order
    keys: tuple                    # its shard's parameter keys, in order
    flat: torch.Tensor             # their starting values, flattened in that order
    method: dict                   # SyncMethod.to_dict()
    groups: list                   # every process group of the program, (name, ranks)
    host: HostSettings = field(default_factory=HostSettings)
    n_servers: int = 1
    # every worker rank of the program (each sends its stop to every server); ``workers`` are those holding this
    # server's stage (a pipeline's stages have servers of their own). Empty: ``workers``.
    all_workers: tuple = ()

    def origin(self) -> str:
        return f"ClusterSpec(cpu_servers={self.n_servers})"

    def serve(self) -> dict:
        return serve(self)

    def release(self) -> None:
        """A worker's stop to this server after its last step."""
        dist.send(torch.tensor([STOP, 0, 0, 0], dtype=torch.float64), self.rank, tag=TAG_HEAD)


def _join(p: SSPServer) -> None:
    """Create every group of the program, in the workers' order (a process group is made by all ranks)."""
    if p.host.host_memory_reuse:
        reuse_freed_memory()
    for name, ranks in p.groups:
        group(ranks, name)
    if p.host.comm_priority:
        dist.barrier()
        comm_priority(p.rank)


def serve(p: SSPServer) -> dict:
    """The server's loop under ``run_local`` (module docstring) until every worker's stop. Returns its log, its
    pushes and reads, and on the first server the clock table."""
    _join(p)
    srv = _Server(p)
    srv.serve_until(lambda: srv.stopped >= len(srv.stopping))
    if srv.pending:
        raise RuntimeError(f"SSP parameter server rank {p.rank}: the workers stopped with reads unanswered "
                           f"{[(w, c) for w, c, _, _, _ in srv.pending]}")
    return srv.report()


class SSPServerRunner(GroupExit):
    """An SSP / DSSP parameter server's side of a program under torchrun (ranks ``n .. n+k-1``): the surface of
    :class:`fxpar.runner.RankRunner`, so one script runs unchanged on every rank. Each call serves the messages the
    workers' same call sends: ``step`` until every worker's read of its next clock is answered, ``state_dict`` and
    ``load`` until every worker's final read is (a worker reads finally before its state is gathered or replaced),
    ``save`` until every worker's save is answered. A resumed worker's first message restores the server (its
    shard and clock table): the server holds nothing the workers' checkpoint does not."""

    def __init__(self, payload: SSPServer, program):
        self.payload, self.program = payload, program
        _join(payload)                      # every group, in the workers' order
        self.server = _Server(payload)
        self.steps = 0
        self.restores = 0                   # the resumes every worker's first message after a load must complete

    @property
    def rank(self) -> int:
        return self.payload.rank

    def step(self, batch=None) -> float:
        """Serve one clock of every worker (``batch`` is ignored: the workers push their updates); then join the
        workers' loss all-reduce with 0 and return the same global-batch loss they do."""
        self.steps += 1
        srv = self.server
        srv.serve_until(lambda: min(srv.answered) >= self.steps)
        t = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / (self.program.plan.microbatches * self.program.dp)

    def _settled(self) -> bool:
        """No worker's final read and no resume still to come (a worker's first call after a load restores)."""
        return not self.server.final_due() and self.server.restores >= self.restores

    def save(self, path) -> None:
        """Answer every worker's save (the clock table goes into each worker's part of the checkpoint ``path``;
        the server writes nothing)."""
        srv = self.server
        want = [n + 1 for n in srv.saves]
        srv.serve_until(lambda: self._settled() and all(a >= b for a, b in zip(srv.saves, want)))

    def load(self, path) -> None:
        """Answer the workers' final reads before they load ``path``; their next call after it restores this
        server (its shard and clock table, from what they loaded), which the next call here waits for."""
        self.server.serve_until(self._settled)
        self.restores = self.server.restores + 1

    def state_dict(self) -> dict:
        """The whole model's trained state, as the workers' runners return it. Collective: every rank calls it."""
        self.server.serve_until(self._settled)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {})
        return self.program._full_state(parts)

    def report(self) -> dict:
        """What the server reports under ``run_local`` (``RunResult.servers[rank]``): its log and clock table."""
        return self.server.report()


class _Server:
    """One server's state between messages: its shard, its clock table, the reads not answered yet, its log; and
    per worker the clock reads it answered in this process, the clock of its last final read (as the worker's
    :attr:`~fxpar.sync.ssp_worker.SSPState.drained_at`: the worker reads finally only at another clock) and the
    saves it answered."""

    def __init__(self, p: SSPServer):
        self.p, self.m = p, method_from_dict(p.method)
        self.shard = _Shard(p.flat.clone())
        self.n = len(p.workers)
        self.who = {r: w for w, r in enumerate(p.workers)}
        self.table = ClockTable(self.n)
        self.pending: list = []            # reads not answered yet: (worker, clock, need, s, final)
        self.log: list = []
        self.stopping = set(p.all_workers) | set(p.workers)
        self.stopped = 0
        self.answered = [0] * self.n       # clock reads answered, per worker
        self.final_at = [0] * self.n       # the clock of each worker's last final read
        self.saves = [0] * self.n          # saves answered, per worker
        self.saving: list = []             # saves not answered yet: (worker, rank, clock)
        self.start_clock = 0               # the clock the run started at (a resume's)
        self.resumed_from: dict | None = None      # a resume: the clock table it restored (ClockTable.state())
        self.start: torch.Tensor | None = None     # a resume: the shard it started from (the others' must match)
        self.restored_by: set = set()
        self.restores = 0                  # resumes every worker took part in
        self.head = torch.empty(4, dtype=torch.float64)

    def serve_until(self, done) -> None:
        """Take messages (any worker's, in the order they arrive) until ``done()``."""
        while not done():
            self.handle()

    def handle(self) -> None:
        """One message: a push, a read, a stop, a save or a resume."""
        p, head = self.p, self.head
        src = dist.recv(head, src=None, tag=TAG_HEAD)
        kind, clock, need = int(head[0]), int(head[1]), int(head[2])
        w = self.who.get(src)
        if w is None and kind == STOP and src in self.stopping:
            self.stopped += 1
            return
        if w is None:
            raise RuntimeError(f"SSP parameter server rank {p.rank}: a message from rank {src}, which is not a worker "
                               f"({list(p.workers)}): run the program's ranks only")
        if kind == PUSH:
            update = torch.empty_like(self.shard.base)
            dist.recv(update, src, tag=TAG_DATA)
            self.table.pushed(w, clock, time.perf_counter())
            self.shard.add(w, clock, update, self.table.slowest())
            self.log.append(("push", w, clock))
        elif kind == PULL:
            final = bool(int(head[3]))        # 1: the final read after the last clock
            s = clock - need if need >= 0 else self.m.staleness_for(self.table, w, clock)
            if not final:
                self.table.chosen.append((w, clock, s))
            self.pending.append((w, clock, clock - s, s, final))
        elif kind == STOP:
            self.stopped += 1
        elif kind == SAVE:
            self._check_save(w, clock)
            self.saving.append((w, src, clock))
        elif kind == RESTORE:
            self._restore(w, src, clock, need)
        else:
            raise RuntimeError(f"SSP parameter server rank {p.rank}: rank {src} sent message kind {kind}; the workers "
                               "run another program than the servers: rebuild them all from one fxpar.parallelize")
        self.pending = _answer(self)
        self._answer_saves()

    def _check_save(self, w: int, clock: int) -> None:
        """A worker's save comes after its final read: every worker's pushes up to ``clock`` are folded in."""
        if self.shard.by_clock or self.shard.folded != clock:
            raise RuntimeError(f"SSP parameter server rank {self.p.rank}: worker {w} saves at clock {clock}, and the "
                               f"server holds every worker's pushes up to clock {self.shard.folded} and later clocks "
                               f"{sorted(self.shard.by_clock)}: every worker saves after the same number of steps")

    def _answer_saves(self) -> None:
        """Answer the saves once every worker has read finally at their clock (so no read of that clock is still
        to be recorded): each worker gets the same state, the clock every worker pushed and the clock table (the
        shard is the parameters every worker read finally, which the checkpoint holds)."""
        if not self.saving or self.pending:
            return
        clock = self.saving[0][2]
        if any(f != clock for f in self.final_at):
            return
        blob = pickle.dumps({"clock": self.shard.folded, "table": self.table.state()})
        for w, src, c in self.saving:
            self._check_save(w, c)
            dist.send(torch.tensor([len(blob), self.shard.folded, 0, 0], dtype=torch.float64), src, tag=TAG_REPLY)
            dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src, tag=TAG_SHARD)
            self.saves[w] += 1
        self.saving = []

    def _restore(self, w: int, src: int, clock: int, nbytes: int) -> None:
        """A worker's first message after it loaded a checkpoint: the shard and the clock it resumes at, and the
        state this server saved (none: a checkpoint saved without servers, whose clock table starts afresh at that
        clock). The first worker's sets the server's state, once every worker has read finally (nothing in flight);
        the others' must name the same."""
        flat = torch.empty_like(self.shard.base)
        dist.recv(flat, src, tag=TAG_DATA)
        blob = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            dist.recv(blob, src, tag=TAG_DATA)
        saved = pickle.loads(blob.numpy().tobytes()) if nbytes else None
        me = f"SSP parameter server rank {self.p.rank}"
        if self.start is None:
            if self.shard.by_clock or self.pending:
                raise RuntimeError(f"{me}: worker {w} loads a checkpoint while clocks "
                                   f"{sorted(self.shard.by_clock)} are pushed by some workers only: every worker "
                                   "loads after the same number of steps")
            if saved is not None and int(saved["clock"]) != clock:
                raise RuntimeError(f"{me}: worker {w} resumes at clock {clock}, and the checkpoint's server state is "
                                   f"at clock {saved['clock']}: it was saved by another run")
            self.shard = _Shard(flat.clone(), folded=clock)
            self.table = (ClockTable.restored(saved["table"], time.perf_counter()) if saved is not None
                          else ClockTable(self.n, done=[clock] * self.n))
            self.start, self.start_clock = flat, clock
            self.resumed_from = saved["table"] if saved is not None else None
            self.final_at = [clock] * self.n
        elif clock != self.start_clock or not torch.equal(flat, self.start):
            raise RuntimeError(f"{me}: worker {w} resumes at clock {clock} from other parameters than worker(s) "
                               f"{sorted(self.restored_by)} (clock {self.start_clock}): the workers loaded different "
                               "checkpoints; resume every rank from one")
        self.restored_by.add(w)
        if len(self.restored_by) == self.n:   # every worker agreed: the next load starts afresh
            self.start, self.restored_by = None, set()
            self.restores += 1

    def final_due(self) -> bool:
        """Whether a worker's final read is still to come (it last read finally at another clock than it pushed)."""
        return any(f != d for f, d in zip(self.final_at, self.table.done)) or bool(self.pending)

    def report(self) -> dict:
        p, table = self.p, self.table
        out = {"rank": p.rank, "name": f"ssp{p.index}", "server": p.index, "keys": list(p.keys), "log": self.log,
               "steps": max(table.done, default=0), "start_clock": self.start_clock,
               "table_state": table.state(), "resumed_from": self.resumed_from,
               "pushes": sum(1 for e in self.log if e[0] == "push"),
               "reads": sum(1 for e in self.log if e[0] == "read")}
        if p.index == 0:
            out["clock_table"] = table.report()
        return out


class _Shard:
    """A server's parameters: ``base``, the start plus every clock all workers have pushed (added clock by clock),
    and per later clock each worker's update pushed so far (summed in worker order: what a read gets does not
    depend on the order the pushes arrived in)."""

    def __init__(self, start: torch.Tensor, folded: int = 0):
        self.base, self.folded, self.by_clock = start, folded, {}

    def add(self, worker: int, clock: int, update: torch.Tensor, slowest: int) -> None:
        self.by_clock.setdefault(clock, {})[worker] = update
        while self.folded < slowest:          # every worker pushed it: no read leaves it out any more
            self.base = self.base + self._sum(self.by_clock.pop(self.folded))
            self.folded += 1

    @staticmethod
    def _sum(updates: dict) -> torch.Tensor:
        ws = sorted(updates)
        total = updates[ws[0]]
        for w in ws[1:]:
            total = total + updates[w]
        return total

    def read(self, upto: int) -> torch.Tensor:
        """The start plus every update of clocks ``< upto`` received so far, added clock by clock."""
        x = self.base
        for t in range(self.folded, upto):
            if t in self.by_clock:
                x = x + self._sum(self.by_clock[t])
        return x


def _answer(srv: _Server) -> list:
    """Answer, in the order asked, every read whose bound holds (every worker pushed the clocks before ``need``),
    each with the updates of clocks ``< clock + s`` (Ho et al.'s window); returns the rest."""
    left = []
    fresh = srv.table.slowest()
    for w, clock, need, s, final in srv.pending:
        if fresh >= need:
            to = srv.p.workers[w]
            dist.send(torch.tensor([fresh, s, need, 0], dtype=torch.float64), to, tag=TAG_REPLY)
            dist.send(srv.shard.read(clock + s), to, tag=TAG_SHARD)
            srv.log.append(("read", w, clock, fresh, s))
            if final:
                srv.final_at[w] = clock
            else:
                srv.answered[w] += 1
        else:
            left.append((w, clock, need, s, final))
    return left
