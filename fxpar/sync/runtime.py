"""A synchronisation method on a rank: its step counter, the averaging after the update, the outer step, checkpoints.

:class:`SyncState` is a :class:`~fxpar.compress.runtime.CompressState` (it binds the gradient buckets' host calls the
pass placed: an all-reduce on the warm-up's steps, the rank's own gradient after) that also, after each update of
the rank's stage, counts the step and, on an averaging step (:meth:`SyncMethod.averages`), averages the stage's
parameters over dp as torch's ``average_parameters`` does (one flat buffer, divided by dp, then all-reduced), and
hands the average to the method's outer step (:meth:`SyncMethod.outer`; DiLoCo's outer optimizer here).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpar.compress.runtime import CompressInfo, CompressState
from fxpar.runtime.groups import group
from fxpar.runtime.state import load_replica_state, replica_state

from .method import DiLoCo, SyncMethod

__all__ = ["SyncInfo", "SyncState", "average_over"]


@dataclass(frozen=True)
class SyncInfo(CompressInfo):
    """:class:`CompressInfo` and the sync method (picklable); for a method on parameter servers (SSP) the servers'
    global ranks and, per server, the parameter keys of its shard."""
    sync: SyncMethod | None = None
    servers: tuple = ()
    shards: tuple = ()


def average_over(tensors: dict, pg, dp: int, divide_first: bool = True) -> dict:
    """``{key: tensor}``'s floating tensors averaged over the dp group ``pg`` in one all-reduce per dtype (keys in
    sorted order); ``divide_first``: each divided by ``dp`` before the sum, as torch's ``average_parameters``, else
    after it."""
    out = dict(tensors)
    if pg is None:
        return out
    by_dtype: dict = {}
    for k in sorted(tensors):
        if isinstance(tensors[k], torch.Tensor) and tensors[k].is_floating_point():
            by_dtype.setdefault(tensors[k].dtype, []).append(k)
    for dtype in sorted(by_dtype, key=str):
        keys = by_dtype[dtype]
        flat = torch.cat([tensors[k].detach().reshape(-1) for k in keys])
        if divide_first:
            flat /= dp
        dist.all_reduce(flat, group=pg)
        if not divide_first:
            flat /= dp
        off = 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[off:off + n].view(tensors[k].shape).clone()
            off += n
    return out


class SyncState(CompressState):
    """One rank's synchronisation state: the gradient buckets' step counters (:class:`CompressState`), the step
    count, the parameters of the last averaging and the method's outer state (DiLoCo's outer optimizer, SlowMo's
    slow momentum); whole tensors (``state_dict()``, the checkpoint's model keys) are the replicas' average."""
    collective = True

    def setup(self, ex) -> None:
        super().setup(ex)
        self.ex = ex
        self.sync: SyncMethod = self.info.sync
        self.dp = len(self.info.dp_ranks)
        self.step = 0
        self.averaged: list = []               # the steps after which this rank averaged
        self._start_outer()

    def _start_outer(self) -> None:
        """The anchor (the parameters at the last averaging) and the outer state, from the rank's parameters."""
        self.anchor = {s: ({k: v.detach().clone() for k, v in ps.items()} if self.sync.keeps_anchor else {})
                       for s, ps in self.ex.params.items()}
        self.outer_state = {s: self.sync.init_outer(a) for s, a in self.anchor.items()}
        self.outer_opt = {}
        if isinstance(self.sync, DiLoCo):      # leaves the outer optimizer steps, one per parameter
            for s, a in self.anchor.items():
                leaves = {k: v.clone().requires_grad_(True) for k, v in sorted(a.items())}
                self.anchor[s] = leaves
                self.outer_opt[s] = self.sync.make_outer(list(leaves.values()))

    def after_update(self, ex, stage: int) -> None:
        t = self.step
        self.step += 1
        m = self.sync
        if t < m.warmup_steps:
            if t == m.warmup_steps - 1:        # the replicas agree until here: the anchor of the first window
                self._set_anchor(stage, ex.params[stage])
            return
        if not m.averages(t):
            return
        ps = dict(ex.params[stage])
        pg, n = self.pg, self.dp
        size = m.group_at(t) if getattr(m, "hierarchical", ()) else self.dp
        if size < self.dp:               # hierarchical: within this rank's group of `size` consecutive replicas
            name = f"sync_{size}"
            pg, n = (group(ex.p.bindings[name], name) if size > 1 else None), size
        average = average_over(ps, pg, n)
        new = self._outer(stage, average)
        ps.update(new)
        ex.params[stage] = ps
        self._set_anchor(stage, ps)
        self.averaged.append(t)

    def _outer(self, stage: int, average: dict) -> dict:
        anchor = self.anchor[stage]
        if not self.sync.keeps_anchor:
            return average
        if stage in self.outer_opt:            # DiLoCo: the outer optimizer steps the anchor by anchor - average
            opt = self.outer_opt[stage]
            with torch.no_grad():
                for k, leaf in anchor.items():
                    leaf.grad = leaf.detach() - average[k]
            opt.step()
            return {k: leaf.detach().clone() for k, leaf in anchor.items()}
        keys = sorted(anchor)
        lr = float(self.ex.torch_opt.param_groups[0]["lr"])
        new, self.outer_state[stage] = self.sync.outer({k: anchor[k] for k in keys}, {k: average[k] for k in keys},
                                                        self.outer_state[stage], lr)
        return new

    def _set_anchor(self, stage: int, params: dict) -> None:
        if not self.sync.keeps_anchor:
            return
        a = self.anchor[stage]
        with torch.no_grad():
            for k in a:
                if stage in self.outer_opt:
                    a[k].copy_(params[k])
                else:
                    a[k] = params[k].detach().clone()

    # ---- what the user and the checkpoints see -----------------------------------------------------------------
    def whole(self, ex, params: dict, state: dict) -> tuple:
        return ({s: average_over(ps, self.pg, self.dp, False) for s, ps in sorted(params.items())},
                {s: average_over(st, self.pg, self.dp, False) for s, st in sorted(state.items())})

    def report(self):
        return {"replica": {k: v.clone() for ps in self.ex.params.values() for k, v in ps.items()},
                "averaged_steps": list(self.averaged), "steps": self.step}

    def save(self) -> dict:
        out = {**super().save(), "replica": replica_state(self.ex), "step": self.step,
               "averaged": list(self.averaged),
               "anchor": {s: {k: v.detach().clone() for k, v in a.items()} for s, a in self.anchor.items()},
               "outer_state": {s: {k: v.clone() for k, v in st.items()} for s, st in self.outer_state.items()}}
        if self.outer_opt:
            out["outer_opt"] = {s: copy.deepcopy(o.state_dict()) for s, o in self.outer_opt.items()}
        return out

    def load(self, saved: dict) -> None:
        super().load(saved)
        load_replica_state(self.ex, saved.get("replica"), f"Strategy(sync={self.sync.summary()})")
        self.step = int(saved["step"])
        self.averaged = list(saved["averaged"])
        with torch.no_grad():
            for s, a in self.anchor.items():
                for k in a:
                    if s in self.outer_opt:
                        a[k].copy_(saved["anchor"][s][k])
                    else:
                        a[k] = saved["anchor"][s][k].clone()
        self.outer_state = {s: {k: v.clone() for k, v in st.items()} for s, st in saved["outer_state"].items()}
        for s, o in self.outer_opt.items():
            o.load_state_dict(copy.deepcopy(saved["outer_opt"][s]))
