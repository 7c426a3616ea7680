"""SSP's and DSSP's parameter servers at run time (:mod:`fxpar.sync.ssp`): ranks beside the workers that hold the
parameters, add the workers' updates as they arrive and answer reads once the staleness bound allows.

A server holds one shard of the parameters (some of the keys, one flat buffer). Every message is point-to-point on
the default group: a worker sends a 4-value header (:data:`PUSH`, :data:`PULL` or :data:`STOP`, its clock, the
clock every worker must have pushed before the read is answered -- ``-1``: the first server chooses, DSSP -- and
1 for the final read after a worker's last clock, else 0), then for a push the update of the server's shard. The server takes headers from any worker in the order they
arrive::

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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar.feature import ExtraRank
from fxpar.host import HostSettings, reuse_freed_memory
from fxpar.runtime.groups import comm_priority, group

from .method import method_from_dict
from .ssp import ClockTable

__all__ = ["SSPServer", "serve", "PUSH", "PULL", "STOP", "TAG_HEAD", "TAG_DATA", "TAG_REPLY", "TAG_SHARD"]

PUSH, PULL, STOP = 1, 2, 3
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
    """The server's loop (module docstring) until every worker's stop. Returns its log, its pushes and reads, and on
    the first server the clock table."""
    _join(p)
    m = method_from_dict(p.method)
    shard = _Shard(p.flat.clone())
    n = len(p.workers)
    who = {r: w for w, r in enumerate(p.workers)}
    table = ClockTable(n)
    pending: list = []          # reads not answered yet: (worker, clock, need, s)
    log: list = []
    stopping = set(p.all_workers) | set(p.workers)
    stopped, head = 0, torch.empty(4, dtype=torch.float64)
    while stopped < len(stopping):
        src = dist.recv(head, src=None, tag=TAG_HEAD)
        kind, clock, need = int(head[0]), int(head[1]), int(head[2])
        w = who.get(src)
        if w is None and kind == STOP and src in stopping:
            stopped += 1
            continue
        if w is None:
            raise RuntimeError(f"SSP parameter server rank {p.rank}: a message from rank {src}, which is not a worker "
                               f"({list(p.workers)}): run the program's ranks only")
        if kind == PUSH:
            update = torch.empty_like(shard.base)
            dist.recv(update, src, tag=TAG_DATA)
            table.pushed(w, clock, time.perf_counter())
            shard.add(clock, update, table.slowest())
            log.append(("push", w, clock))
        elif kind == PULL:
            s = clock - need if need >= 0 else m.staleness_for(table, w, clock)
            if not int(head[3]):              # a clock's read (1: the final read after the last clock)
                table.chosen.append((w, clock, s))
            pending.append((w, clock, clock - s, s))
        elif kind == STOP:
            stopped += 1
        else:
            raise RuntimeError(f"SSP parameter server rank {p.rank}: rank {src} sent message kind {kind}; the workers "
                               "run another program than the servers: rebuild them all from one fxpar.parallelize")
        pending = _answer(p, shard, table, pending, log)
    if pending:
        raise RuntimeError(f"SSP parameter server rank {p.rank}: the workers stopped with reads unanswered "
                           f"{[(w, c) for w, c, _, _ in pending]}")
    out = {"rank": p.rank, "name": f"ssp{p.index}", "server": p.index, "keys": list(p.keys), "log": log,
           "steps": max(table.done, default=0), "pushes": sum(1 for e in log if e[0] == "push"),
           "reads": sum(1 for e in log if e[0] == "read")}
    if p.index == 0:
        out["clock_table"] = table.report()
    return out


class _Shard:
    """A server's parameters: ``base``, the start plus every clock all workers have pushed (added clock by clock),
    and per later clock the sum of the updates pushed so far (in arrival order)."""

    def __init__(self, start: torch.Tensor):
        self.base, self.folded, self.by_clock = start, 0, {}

    def add(self, clock: int, update: torch.Tensor, slowest: int) -> None:
        got = self.by_clock.get(clock)
        self.by_clock[clock] = update if got is None else got + update
        while self.folded < slowest:          # every worker pushed it: no read leaves it out any more
            self.base = self.base + self.by_clock.pop(self.folded)
            self.folded += 1

    def read(self, upto: int) -> torch.Tensor:
        """The start plus every update of clocks ``< upto`` received so far, added clock by clock."""
        x = self.base
        for t in range(self.folded, upto):
            if t in self.by_clock:
                x = x + self.by_clock[t]
        return x


def _answer(p: SSPServer, shard: _Shard, table: ClockTable, pending: list, log: list) -> list:
    """Answer, in the order asked, every read whose bound holds (every worker pushed the clocks before ``need``),
    each with the updates of clocks ``< clock + s`` (Ho et al.'s window); returns the rest."""
    left = []
    fresh = table.slowest()
    for w, clock, need, s in pending:
        if fresh >= need:
            dist.send(torch.tensor([fresh, s, need, 0], dtype=torch.float64), p.workers[w], tag=TAG_REPLY)
            dist.send(shard.read(clock + s), p.workers[w], tag=TAG_SHARD)
            log.append(("read", w, clock, fresh, s))
        else:
            left.append((w, clock, need, s))
    return left
