"""A synchronisation method on a rank: its step counter, the averaging after the update, the outer step, checkpoints.

:class:`SyncState` is a :class:`~fxpar.compress.runtime.CompressState` (it binds the gradient buckets' host calls the
pass placed: an all-reduce on the warm-up's steps, the rank's own gradient after) that also, after each update of
the rank's stage, counts the step and, on an averaging step (:meth:`SyncMethod.averages`), averages the stage's
parameters over dp as torch's ``average_parameters`` does (one flat buffer, divided by dp, then all-reduced), and
hands the average to the method's outer step (:meth:`SyncMethod.outer`; DiLoCo's outer optimizer here).

Streaming DiLoCo (``DiLoCo(fragments=F, delay=tau)``): on a step where fragment ``p`` is due
(:meth:`DiLoCo.fragment_averages`) only its tensors are averaged and stepped by the outer optimizer (the other
leaves have no gradient, so torch's optimizer leaves them and their state alone); with ``delay=tau`` the fragment's
all-reduce is started (``async_op``) and waited for after step ``t + tau``, where the outer step runs and its result
is merged into the replica. A checkpoint taken with a fragment in flight waits for its all-reduce and saves the
sum, so the resumed run merges it at the same step. With ``quantize="e3m0"`` each rank sends its pseudo-gradient
``anchor - x`` in 4 bits instead (:mod:`fxpar.sync.quantize`): the fragment's buffers are all-gathered, and every rank
takes their float32 mean in rank order as the outer optimizer's gradient; a checkpoint saves the gathered buffers.
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
from .quantize import encode, mean_of

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
        out.update(unflatten(flat, keys, tensors))
    return out


def unflatten(flat: torch.Tensor, keys, like: dict) -> dict:
    """``flat`` (the tensors of ``keys`` end to end) back as ``{key: tensor shaped like like[key]}``, copies."""
    out, off = {}, 0
    for k in keys:
        n = like[k].numel()
        out[k] = flat[off:off + n].view(like[k].shape).clone()
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
        self.streaming = isinstance(self.sync, DiLoCo) and self.sync.streaming
        if self.streaming:
            # per stage, fragment f's parameter keys (the stage's parameters in the model's order)
            self.fragments = {s: self.sync.fragment_keys(list(ex.p.stage_params[s])) for s in ex.params}
            # [due step, stage, fragment, {dtype: [work, flat, keys, shapes]}]; quantized: {format: [work, [the
            # ranks' wire buffers], keys, shapes]}
            self.inflight: list = []
            self.fragment_log: list = []       # (step started, fragment, step merged)

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
        if self.streaming:
            self._stream(ex, stage, t)
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

    # ---- streaming DiLoCo ---------------------------------------------------------------------------------------
    def _stream(self, ex, stage: int, t: int) -> None:
        """After step ``t``: merge the fragments due at ``t``, then start the fragments whose averaging is at ``t``."""
        m = self.sync
        ps = dict(ex.params[stage])
        for item in [x for x in self.inflight if x[0] == t and x[1] == stage]:
            self.inflight.remove(item)
            self._merge(ps, stage, item[2], self._finish(item[3]), t)
        for f, keys in enumerate(self.fragments[stage]):
            if not m.fragment_averages(f, t):
                continue
            parts = self._start(ps, keys) if not m.quantize else self._start_quantized(ps, stage, keys)
            if m.delay:
                self.inflight.append([t + m.delay, stage, f, parts])
            else:
                self._merge(ps, stage, f, self._finish(parts), t)
            if not self.averaged or self.averaged[-1] != t:
                self.averaged.append(t)
        ex.params[stage] = ps

    def _start(self, ps: dict, keys: list) -> dict:
        """The all-reduce of fragment ``keys``' replicas, one flat buffer per dtype divided by dp first (as
        :func:`average_over`), started without waiting where a delay is set: ``{dtype: [work, flat, keys]}``."""
        by_dtype: dict = {}
        for k in sorted(keys):
            by_dtype.setdefault(ps[k].dtype, []).append(k)
        out = {}
        for dtype in sorted(by_dtype, key=str):
            ks = by_dtype[dtype]
            flat = torch.cat([ps[k].detach().reshape(-1) for k in ks]) / self.dp
            work = dist.all_reduce(flat, group=self.pg, async_op=bool(self.sync.delay)) if self.pg is not None else None
            out[str(dtype)] = [work, flat, ks, {k: tuple(ps[k].shape) for k in ks}]
        return out

    def _start_quantized(self, ps: dict, stage: int, keys: list) -> dict:
        """The all-gather of this rank's pseudo-gradient ``anchor - x`` over fragment ``keys`` (sorted), in the
        quantized format's wire buffer, started without waiting where a delay is set: ``{format: [work, [buffer per
        dp rank], keys, shapes]}``."""
        ks = sorted(keys)
        anchor = self.anchor[stage]
        buf = encode([anchor[k].detach() - ps[k].detach() for k in ks])
        if self.pg is None:
            work, bufs = None, [buf]
        else:
            bufs = [torch.empty_like(buf) for _ in range(self.dp)]
            work = dist.all_gather(bufs, buf, group=self.pg, async_op=bool(self.sync.delay))
        return {self.sync.quantize: [work, bufs, ks, {k: tuple(ps[k].shape) for k in ks}]}

    @staticmethod
    def _finish(parts: dict) -> tuple:
        """Wait for a fragment's collectives: ``(its average, False)``, or, quantized, ``(the ranks' float32 mean
        pseudo-gradient, True)``; each ``{key: tensor}``."""
        avg, quantized = {}, False
        for entry in parts.values():
            work, flat, ks, shapes = entry
            if work is not None:
                work.wait()
                entry[0] = None
            if isinstance(flat, list):         # the ranks' wire buffers
                quantized = True
                avg.update(zip(ks, mean_of(flat, [shapes[k] for k in ks])))
                continue
            off = 0
            for k in ks:
                n = int(torch.Size(shapes[k]).numel())
                avg[k] = flat[off:off + n].view(shapes[k]).clone()
                off += n
        return avg, quantized

    def _merge(self, ps: dict, stage: int, f: int, finished: tuple, t: int) -> None:
        """Fragment ``f``'s outer step (its leaves only) from its average (``anchor - average`` the gradient) or its
        mean pseudo-gradient (``finished``: :meth:`_finish`'s pair); the replica takes the new anchor, or ``mix`` of
        its own and ``1 - mix`` of the anchor where a delay let it train on meanwhile."""
        anchor, opt, m = self.anchor[stage], self.outer_opt[stage], self.sync
        average, quantized = finished
        with torch.no_grad():
            for k, leaf in anchor.items():
                if k not in average:
                    leaf.grad = None
                elif quantized:
                    leaf.grad = average[k].to(leaf.dtype)
                else:
                    leaf.grad = leaf.detach() - average[k]
        opt.step()
        for k in average:
            new = anchor[k].detach().clone()
            ps[k] = new if not m.mix else m.mix * ps[k] + (1 - m.mix) * new
        self.fragment_log.append((t - m.delay, f, t))

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

    def drain(self, ex) -> None:
        """Streaming DiLoCo: wait for the fragments in flight (their merge stays at its step)."""
        super().drain(ex)
        for item in getattr(self, "inflight", []):
            for entry in item[3].values():
                if entry[0] is not None:
                    entry[0].wait()
                    entry[0] = None

    @staticmethod
    def _saved_parts(parts: dict) -> dict:
        """A finished fragment's collectives as a checkpoint keeps them: the sum (or the ranks' buffers), copies."""
        return {d: [None, [b.clone() for b in e[1]] if isinstance(e[1], list) else e[1].clone(), list(e[2]),
                    dict(e[3])] for d, e in parts.items()}

    def report(self):
        out = {"replica": {k: v.clone() for ps in self.ex.params.values() for k, v in ps.items()},
               "averaged_steps": list(self.averaged), "steps": self.step}
        if self.streaming:
            out["fragments"] = {s: [list(ks) for ks in fr] for s, fr in self.fragments.items()}
            out["fragment_log"] = list(self.fragment_log)
        return out

    def save(self) -> dict:
        out = {**super().save(), "replica": replica_state(self.ex), "step": self.step,
               "averaged": list(self.averaged),
               "anchor": {s: {k: v.detach().clone() for k, v in a.items()} for s, a in self.anchor.items()},
               "outer_state": {s: {k: v.clone() for k, v in st.items()} for s, st in self.outer_state.items()}}
        if self.outer_opt:
            out["outer_opt"] = {s: copy.deepcopy(o.state_dict()) for s, o in self.outer_opt.items()}
        if self.streaming:
            self.drain(self.ex)
            out["inflight"] = [[due, s, f, self._saved_parts(parts)] for due, s, f, parts in self.inflight]
            out["fragment_log"] = list(self.fragment_log)
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
        if self.streaming:
            self.inflight = [[due, s, f, self._saved_parts(parts)] for due, s, f, parts in saved.get("inflight", [])]
            self.fragment_log = [tuple(x) for x in saved.get("fragment_log", [])]
