"""An SSP / DSSP worker (:mod:`fxpar.sync.ssp`): after each update of its stage, push the update to the parameter
servers and read the parameters of its next clock from them.

:class:`SSPState` is a :class:`~fxpar.sync.runtime.SyncState` (its gradient buckets' host calls hand back the rank's
own gradient: no collective) whose :meth:`after_update` replaces the averaging: the update of clock ``c`` is
``(x_after - x_read) / n`` (the change the rank's optimizer step made, divided by the ``n`` workers), sent shard by
shard to the servers (:mod:`fxpar.sync.ssp_server`); then the read of clock ``c + 1`` asks the first server (which
names the bound, DSSP's choice or SSP's ``s``), then the others with that bound, and the rank's parameters become
the shards it got back. :meth:`drain` reads once more with the bound 0 (every worker's every clock), so results,
``state_dict()`` and checkpoints hold the servers' final parameters on every worker. :meth:`save` keeps, beside the
rank's own state, each of its servers' clock table (asked of the server); after a load the rank's first message to
each server restores it (:mod:`fxpar.sync.ssp_server`).
"""
from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist

from .runtime import SyncState
from .ssp_server import PULL, PUSH, RESTORE, SAVE, TAG_DATA, TAG_HEAD, TAG_REPLY, TAG_SHARD

__all__ = ["SSPState"]


class SSPState(SyncState):
    """One SSP worker: the parameters it read (its update's base), its clock, and per read the clock, how fresh
    the read was (clocks every worker had pushed), the bound, and the seconds it waited."""
    collective = False            # after drain() every worker holds the servers' parameters: no averaging

    def setup(self, ex) -> None:
        super().setup(ex)
        self.servers = tuple(self.info.servers)
        self.shards = [tuple(keys) for keys in self.info.shards]
        self.n = self.dp
        self.stage = next(iter(ex.params))
        self.base = {k: v.detach().clone() for k, v in ex.params[self.stage].items()}
        self.reads: list = []         # (clock, fresh, s, seconds waited)
        self.final = None             # the last final read: (clock, fresh, s, seconds waited)
        self.drained_at = 0           # the clock of the last final read (clock 0: the servers' start, as read)
        self.restore: list | None = None    # after a load: per server what to restore it from (sent first)

    def after_update(self, ex, stage: int) -> None:
        self._restore_servers(ex)
        c = self.step
        self.step += 1
        new = ex.params[stage]
        for server, keys in zip(self.servers, self.shards):
            update = torch.cat([((new[k] - self.base[k]) / self.n).reshape(-1) for k in keys])
            dist.send(torch.tensor([PUSH, c, -1, 0], dtype=torch.float64), server, tag=TAG_HEAD)
            dist.send(update, server, tag=TAG_DATA)
        need = -1 if self.sync.dynamic() else c + 1 - self.sync.bounds()[0]
        self._read(ex, stage, c + 1, need)

    def _read(self, ex, stage: int, clock: int, need: int, final: bool = False) -> None:
        """The parameters of ``clock``: the first server's shard (it answers with the bound), then the others'."""
        t0 = time.perf_counter()
        got, fresh, s = {}, None, None
        for j, (server, keys) in enumerate(zip(self.servers, self.shards)):
            dist.send(torch.tensor([PULL, clock, need, int(final)], dtype=torch.float64), server, tag=TAG_HEAD)
            head = torch.empty(4, dtype=torch.float64)
            dist.recv(head, server, tag=TAG_REPLY)
            shard = torch.empty(sum(self.base[k].numel() for k in keys), dtype=self.base[keys[0]].dtype)
            dist.recv(shard, server, tag=TAG_SHARD)
            if j == 0:
                s, need = int(head[1]), int(head[2])
            fresh = int(head[0]) if fresh is None else min(fresh, int(head[0]))
            off = 0
            for k in keys:
                n = self.base[k].numel()
                got[k] = shard[off:off + n].view(self.base[k].shape).clone()
                off += n
        read = (clock, fresh, s, time.perf_counter() - t0)
        if final:
            self.final = read
        else:
            self.reads.append(read)
        ps = dict(ex.params[stage])
        ps.update(got)
        ex.params[stage] = ps
        self.base = {k: v.clone() for k, v in got.items()}

    def drain(self, ex) -> None:
        """Read every worker's every clock (bound 0 at this worker's clock): the servers' final parameters."""
        self._restore_servers(ex)
        if self.drained_at == self.step:
            return
        self.drained_at = self.step
        self._read(ex, self.stage, self.step, self.step, final=True)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self) -> dict:
        """After the final read (the executor drains first): the rank's own state (:class:`SyncState`: its
        parameters, which are the servers', its optimizer state, its clock), its reads, and each of its servers'
        state (the clock every worker pushed and the clock table), asked of the server."""
        self.drain(self.ex)
        out = {**super().save(), "reads": [list(r) for r in self.reads], "servers": []}
        for server in self.servers:
            dist.send(torch.tensor([SAVE, self.step, 0, 0], dtype=torch.float64), server, tag=TAG_HEAD)
            head = torch.empty(4, dtype=torch.float64)
            dist.recv(head, server, tag=TAG_REPLY)
            blob = torch.empty(int(head[0]), dtype=torch.uint8)
            dist.recv(blob, server, tag=TAG_SHARD)
            out["servers"].append(pickle.loads(blob.numpy().tobytes()))
        out["shards"] = [list(keys) for keys in self.shards]
        return out

    def after_load(self, ex) -> None:
        """The checkpoint's parameters are loaded: the servers start from them at this rank's clock (a checkpoint
        saved without servers: clock 0, a fresh clock table) unless :meth:`load` finds their saved state."""
        super().after_load(ex)
        self.restore = [None] * len(self.servers)
        self._loaded(ex)

    def load(self, saved: dict) -> None:
        super().load(saved)
        got = [list(keys) for keys in saved.get("shards", [])]
        if got != [list(keys) for keys in self.shards]:
            raise RuntimeError(f"rank {self.rank}: the checkpoint's parameter servers held the shards {got}, and this "
                               f"program's servers {[list(k) for k in self.shards]}: it was saved with another "
                               f"ClusterSpec(cpu_servers=...) or another split of the model; resume with the cluster "
                               "that saved it")
        self.reads = [tuple(r) for r in saved["reads"]]
        self.restore = list(saved["servers"])
        self._loaded(self.ex)

    def _loaded(self, ex) -> None:
        self.base = {k: v.detach().clone() for k, v in ex.params[self.stage].items()}
        self.drained_at = self.step

    def _restore_servers(self, ex) -> None:
        """After a load, before any other message to the servers: each server's shard of the loaded parameters,
        this rank's clock and the server's saved state (each worker sends them; the server checks they agree)."""
        if self.restore is None:
            return
        ps = self.base                # the loaded parameters (the first update's base)
        for server, keys, state in zip(self.servers, self.shards, self.restore):
            blob = pickle.dumps(state) if state is not None else b""
            dist.send(torch.tensor([RESTORE, self.step, len(blob), 0], dtype=torch.float64), server, tag=TAG_HEAD)
            dist.send(torch.cat([ps[k].detach().reshape(-1) for k in keys]), server, tag=TAG_DATA)
            if blob:
                dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), server, tag=TAG_DATA)
        self.restore = None

    def whole(self, ex, params: dict, state: dict) -> tuple:
        return params, state

    def report(self):
        leads = [c - f for c, f, _, _ in self.reads]
        return {"replica": {k: v.clone() for ps in self.ex.params.values() for k, v in ps.items()},
                "steps": self.step, "reads": [list(r) for r in self.reads],
                "final_read": list(self.final) if self.final is not None else None, "max_lead": max(leads, default=0),
                "waited_s": sum(r[3] for r in self.reads) + (self.final[3] if self.final is not None else 0.0)}
