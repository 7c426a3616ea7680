"""BytePS's CPU summation servers at run time (Jiang et al., OSDI'20): ranks that only sum.

A program with ``Plan.section("byteps").servers`` runs on ``n + k`` ranks: the ``n`` workers run the executor as
any program does; each of the ``k`` servers runs :func:`serve_sums`, a loop that holds no parameter and takes
no batch. Step after step it

1. waits for the step's *go* (one element from every worker; a *stop*, zeros, ends the loop),
2. for each partition, in the order the workers' graphs issue them (``passes.byteps`` records it): receives
   the ``n`` pushes (``all_to_all_single`` over its group, every worker and this server), sums them, and
   sends the sum back to every worker when they pull it.

Under ``run_local`` the loop runs until the workers send the stop after their last step
(:meth:`ServerPayload.release`); under torchrun ``program.runner()`` on a server rank is a
:class:`fxpar.features.byteps.ServerRunner`, whose
``step(batch)`` serves one step (:func:`serve_step`, the loop's body), so no stop is sent: every rank calls
``step`` as often. A server holds no state: checkpoints are the workers' alone, written over their ``dp`` group
(:mod:`fxpar.runtime.state`), the same files as without servers. The server counts what it receives and sends
per step (``RunResult.servers``), the measured side of ``cost_models.byteps_traffic.bytes_per_server``::

    worker 0 ── push P ──▶ ┌────────────┐ ── sum P ──▶ worker 0
    worker 1 ── push P ──▶ │ server j:  │ ── sum P ──▶ worker 1
                           │ Σ of n     │
                           └────────────┘
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..feature import ExtraRank
from ..host import HostSettings, reuse_freed_memory
from .groups import comm_priority, group

__all__ = ["ServerPayload", "server_payloads", "stop_messages", "join_groups", "serve_step", "serve_sums"]


@dataclass
class ServerPayload(ExtraRank):
    """What one server rank needs, picklable."""
    label = "BytePS CPU server"
    rank: int                      # global rank
    name: str                      # its group's name (``server{j}``)
    ranks: tuple                   # its group: the workers, then this server
    ops: list                      # one step, in issue order: ("go" | "push" | "pull", elements, dtype name)
    groups: list                   # every process group of the program, (name, ranks): every rank creates them
    host: HostSettings = field(default_factory=HostSettings)   # the ClusterSpec's settings for this process
    n_servers: int = 1             # how many the ClusterSpec asked for

    def origin(self) -> str:
        return f"ClusterSpec(cpu_servers={self.n_servers})"

    def serve(self) -> dict:
        return serve_sums(self)

    def release(self) -> None:
        """A worker's stop to this server after its last step (``stop_messages``)."""
        for name, ranks, dt in stop_messages([self]):
            n = len(ranks) - 1
            dist.all_to_all_single(torch.empty(0, dtype=getattr(torch, dt)), torch.zeros(1, dtype=getattr(torch, dt)),
                                   [0] * (n + 1), [0] * n + [1], group=group(tuple(ranks), name))


def server_payloads(section, byteps: dict | None, groups: list, host: HostSettings | None = None) -> list:
    """One :class:`ServerPayload` per CPU server of the Plan's ``byteps`` section (``fxpar.features.byteps``);
    ``byteps`` is the record ``passes.byteps`` left on the lowered graph (``gm.meta["fxpar_byteps"]``); ``groups``:
    every process group of the program (``Plan.all_groups()``); ``host``: the ClusterSpec's settings every server
    applies to itself (``comm_priority``, ``host_memory_reuse``)."""
    servers = list(section.servers)
    ops = (byteps or {}).get("ops", {})
    out = []
    for j, s in enumerate(servers):
        name = f"server{j}"
        ranks = tuple(section.groups[name][0])
        out.append(ServerPayload(rank=s, name=name, ranks=ranks, ops=[tuple(o) for o in ops.get(s, ())],
                                 groups=list(groups), host=host or HostSettings(), n_servers=len(servers)))
    return out


def stop_messages(payloads: list) -> list:
    """What each worker sends every server after its last step: ``(group name, ranks, dtype name)``."""
    return [(p.name, p.ranks, p.ops[0][2] if p.ops else "float64") for p in payloads]


def _a2a(pg, n: int, send: torch.Tensor, to_workers: int, from_workers: int, dtype) -> torch.Tensor:
    """One ``all_to_all_single`` over a server's group of ``n`` workers + the server (last), seen from the server:
    ``to_workers`` elements to each worker (``send``), ``from_workers`` from each; returns what arrived."""
    out = torch.empty(n * from_workers, dtype=dtype)
    dist.all_to_all_single(out, send, [from_workers] * n + [0], [to_workers] * n + [0], group=pg)
    return out


def join_groups(p: ServerPayload):
    """Create every group of the program, in the workers' order (a process group is made by all ranks); returns
    this server's group."""
    if p.host.host_memory_reuse:     # ClusterSpec.host_memory_reuse, as the workers' Executor does
        reuse_freed_memory()
    for name, ranks in p.groups:
        group(ranks, name)
    pg = group(p.ranks, p.name)
    if p.host.comm_priority:      # ClusterSpec.comm_priority, as the workers' Executor does
        dist.barrier()                    # every group's threads up (and named) before they are raised
        comm_priority(p.rank)
    return pg


def serve_step(p: ServerPayload, pg) -> dict | None:
    """One step of the server (see the module docstring): the go, then every partition's push and pull.
    Returns the step's bytes received and sent and its counts; None when the workers sent the stop instead."""
    n = len(p.ranks) - 1
    go_dtype = getattr(torch, p.ops[0][2]) if p.ops else torch.float64
    flags = _a2a(pg, n, torch.empty(0, dtype=go_dtype), 0, 1, go_dtype)
    if not bool((flags != 0).any()):
        return None
    if not bool((flags == 1).all()):
        raise RuntimeError(f"BytePS server rank {p.rank} ({p.name}): the workers {list(p.ranks[:-1])} sent "
                           f"{flags.tolist()} to open a step; all must send 1 (go) or all 0 (stop). The workers "
                           "run different programs: rebuild them all from one fxpar.parallelize.")
    stat = {"recv_bytes": n * flags.element_size(), "sent_bytes": 0, "pushes": 0, "pulls": 0}
    sums = []
    for what, numel, dt in p.ops[1:]:
        dtype = getattr(torch, dt)
        size = torch.empty((), dtype=dtype).element_size()
        if what == "push":
            got = _a2a(pg, n, torch.empty(0, dtype=dtype), 0, numel, dtype)
            sums.append(got.view(n, numel).sum(0))
            stat["recv_bytes"] += n * numel * size
            stat["pushes"] += 1
        elif what == "pull":
            _a2a(pg, n, sums.pop(0).repeat(n), numel, 0, dtype)
            stat["sent_bytes"] += n * numel * size
            stat["pulls"] += 1
        else:
            raise RuntimeError(f"BytePS server rank {p.rank}: unknown step {what!r} in its program {p.ops[:4]}...")
    return stat


def serve_sums(p: ServerPayload) -> dict:
    """The server's loop under ``run_local``: :func:`serve_step` until the workers' stop. Returns per step the
    bytes received and sent, and counts."""
    pg = join_groups(p)
    per_step = []
    while (stat := serve_step(p, pg)) is not None:
        per_step.append(stat)
    return {"rank": p.rank, "name": p.name, "steps": len(per_step), "per_step": per_step}
