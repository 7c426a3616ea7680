"""BAGUA's asynchronous model averaging (``S.AsyncAveraging``): the replicas train without waiting for each other,
and their parameters are averaged in the background every ``interval_s`` seconds.

Gan et al., "BAGUA: Scaling up Distributed Learning with System Relaxations", VLDB 2022, and bagua's
``async_model_average`` algorithm. Each worker ``i`` keeps its own model ``x_i``; after the warm-up (``warmup_steps``
synchronous steps, the gradients all-reduced) it steps its own optimizer with its own gradient and never waits for
another worker, while an averaging loop beside it, every ``interval_s`` seconds:

1. agrees with the other workers' loops whether to go on (one small all-reduce: every loop stops once every worker
   has finished its steps, so each worker joins the same number of averagings);
2. takes a snapshot ``s_i`` of ``x_i`` between two updates;
3. all-reduces ``s_i / n`` into ``a = mean_j s_j`` (the long part, in the background, on a process group of its own);
4. between two updates again, corrects the model by what the averaging changed: ``x_i <- x_i + (a - s_i)``.

The updates the worker made while the all-reduce ran are kept (bagua's kernel adds ``a - s_i`` to the weights the
same way). The corrections cancel over the workers, so every averaging keeps the mean of the replicas.

Lock discipline (bagua's: the optimizer step and the averaging's read and write of the weights exclude each other):
the snapshot and the correction happen on the rank's own step loop, after a stage's update and before the next,
and the hand-over between that loop and the averaging thread (the snapshot wanted, the snapshot taken, the average
ready) is under one lock. An update never sees half of an averaging, and an averaging never reads half an update.

Deterministic mode (``every_steps=k``, for tests and exact comparisons): no clock and no thread; the step loop
itself snapshots, all-reduces and corrects after the update of every step ``t >= W`` with ``(t - W) % k == 0`` --
Local SGD's schedule (``x + (a - x)`` is ``a`` to rounding).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from fxpar.errors import StrategyError
from fxpar.runtime.groups import group

from .method import SyncMethod, register_method
from .runtime import SyncState

__all__ = ["AsyncAveraging", "AsyncAveragingState", "ASYNC_GROUP"]

# the process groups the averaging loops talk over (their own: the step loop's collectives are not ordered with them)
ASYNC_GROUP = "sync_async"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@register_method
@dataclass(frozen=True)
class AsyncAveraging(SyncMethod):
    """Asynchronous model averaging: ``interval_s`` (seconds between two averagings, a background loop) or
    ``every_steps`` (deterministic: after every ``k``-th step's update, on the step loop); ``warmup_steps``
    synchronous steps first."""
    name: ClassVar[str] = "async_avg"
    paper: ClassVar[str] = ("Gan et al., BAGUA: Scaling up Distributed Learning with System Relaxations, VLDB 2022 "
                            "(asynchronous model averaging)")
    keeps_anchor: ClassVar[bool] = False
    interval_s: float | None = None
    every_steps: int | None = None

    def __post_init__(self):
        if self.period not in (1, self.every_steps):
            raise StrategyError(f"AsyncAveraging(period={self.period!r}): asynchronous averaging has no period; pass "
                                "interval_s=seconds (a background loop) or every_steps=k (deterministic)")
        if self.every_steps is not None and isinstance(self.every_steps, int) and self.every_steps >= 1:
            object.__setattr__(self, "period", self.every_steps)
        super().__post_init__()

    def check(self) -> None:
        if self.every_steps is None and self.interval_s is None:
            raise StrategyError("AsyncAveraging(): say when the replicas are averaged: interval_s=seconds (every that "
                                "many seconds, in the background) or every_steps=k (after every k-th step, exact)")
        if self.every_steps is not None and self.interval_s is not None:
            raise StrategyError(f"AsyncAveraging(interval_s={self.interval_s!r}, every_steps={self.every_steps!r}): "
                                "pass one of them (interval_s: a clock; every_steps: a step count)")
        if self.interval_s is not None and (not _is_number(self.interval_s) or not self.interval_s > 0):
            raise StrategyError(f"AsyncAveraging(interval_s={self.interval_s!r}): the seconds between two averagings "
                                "must be a number > 0 (bagua's default is 0.5)")
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool)
                                             or self.every_steps < 1):
            raise StrategyError(f"AsyncAveraging(every_steps={self.every_steps!r}): the steps between two averagings "
                                "must be an int >= 1 (1: average after every step)")
        super().check()

    def __repr__(self) -> str:
        return self.summary()

    @property
    def timed(self) -> bool:
        return self.interval_s is not None

    def averages(self, step: int) -> bool:
        return not self.timed and super().averages(step)

    def to_dict(self) -> dict:
        out = {"method": self.name, "warmup_steps": self.warmup_steps}
        out.update({"interval_s": self.interval_s} if self.timed else {"every_steps": self.every_steps})
        return out

    def summary(self) -> str:
        when = f"interval_s={self.interval_s!r}" if self.timed else f"every_steps={self.every_steps!r}"
        return f"AsyncAveraging({when}, warmup_steps={self.warmup_steps!r})"

    def outer_words(self) -> str:
        return "each replica adds the average minus its snapshot, keeping the steps it made meanwhile"

    def note_words(self) -> str:
        """The plan note's account of when the replicas are averaged."""
        warm = (f"the first {self.warmup_steps} step(s) all-reduce the gradients (synchronous data parallelism); "
                "after, " if self.warmup_steps else "")
        when = (f"every {self.interval_s} s a background loop snapshots the replica between two updates, all-reduces "
                "the snapshots' mean on a process group of its own and adds (mean - snapshot) before a later update; "
                "the ranks do not wait for each other" if self.timed else
                f"after steps {self.warmup_steps}, {self.warmup_steps + self.every_steps}, ... the step loop replaces "
                "the replica by the replicas' mean (deterministic mode)")
        return (f"sync: {self.summary()} -- {warm}each dp replica steps its own optimizer with its own gradient; "
                f"{when}. The optimizer state is not averaged; state_dict() and checkpoints hold the replicas' "
                "average, each replica's own weights are in RunResult.features[rank]['sync']['replica'] "
                "(docs/semantics.md, 'Synchronisation methods')")


def _flats(ps: dict) -> list:
    """``[(keys, flat)]`` per floating dtype (sorted by name), the keys sorted: one buffer each."""
    by_dtype: dict = {}
    for k in sorted(ps):
        if isinstance(ps[k], torch.Tensor) and ps[k].is_floating_point():
            by_dtype.setdefault(ps[k].dtype, []).append(k)
    return [(keys, torch.cat([ps[k].detach().reshape(-1) for k in keys])) for keys in
            (by_dtype[d] for d in sorted(by_dtype, key=str))]


class AsyncAveragingState(SyncState):
    """One rank's asynchronous averaging: the warm-up's gradient all-reduce (:class:`SyncState`'s buckets), then the
    averaging loop (timed) or the step loop's averaging (deterministic). Records, per averaging, the step after
    which it was applied and a fingerprint of the correction (its dot product with a fixed random vector, the same
    on every rank: the fingerprints cancel over the ranks when the averaging keeps the replicas' mean)."""

    def setup(self, ex) -> None:
        super().setup(ex)
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.want = False                 # the loop waits for a snapshot
        self.snap = None                  # the snapshot handed to the loop: [(keys, flat)]
        self.ready = None                 # the loop's result: [(keys, mean, snapshot)]
        self.applied: list = []           # per averaging: the step after whose update it was applied
        self.fingerprints: list = []      # per averaging: (correction . w, |correction|)
        self.failed: BaseException | None = None
        self.stage = next(iter(sorted(ex.params)))
        self._w = None

    # ---- the step loop -------------------------------------------------------------------------------------------
    def after_update(self, ex, stage: int) -> None:
        t = self.step
        self.step += 1
        m = self.sync
        if t < m.warmup_steps:
            return
        if not m.timed:
            if m.averages(t):
                snap = _flats(ex.params[stage])
                self._correct(ex, stage, [(keys, self._mean(flat, self.pg), flat) for keys, flat in snap], t)
            return
        if self.thread is None and t >= m.warmup_steps:
            self._start(ex)
        self._serve(ex, t)

    def _mean(self, flat, pg):
        out = flat / self.dp
        if pg is not None:
            dist.all_reduce(out, group=pg)
        return out

    def _correct(self, ex, stage: int, parts: list, t: int) -> None:
        """``x <- x + (mean - snapshot)`` on the replica, between two updates; recorded."""
        ps = dict(ex.params[stage])
        corr = []
        for keys, mean, snap in parts:
            delta = mean - snap
            corr.append(delta)
            off = 0
            for k in keys:
                n = ps[k].numel()
                ps[k] = ps[k] + delta[off:off + n].view(ps[k].shape)
                off += n
        ex.params[stage] = ps
        flat = torch.cat([c.to(torch.float64) for c in corr]) if corr else torch.zeros(0, dtype=torch.float64)
        if self._w is None or self._w.numel() != flat.numel():
            g = torch.Generator().manual_seed(20220)
            self._w = torch.randn(flat.numel(), generator=g, dtype=torch.float64)
        self.fingerprints.append((float(flat @ self._w), float(flat.abs().sum())))
        self.applied.append(t)
        self.averaged.append(t)

    # ---- the averaging loop (timed) ------------------------------------------------------------------------------
    def _start(self, ex) -> None:
        ranks = ex.p.bindings.get(ASYNC_GROUP, ())
        self.apg = group(ranks, ASYNC_GROUP) if len(ranks) > 1 else None
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"fxpar-averaging-{self.rank}", daemon=True)
        self.thread.start()

    def _serve(self, ex, t: int) -> None:
        """Between two updates: apply an average the loop made ready, then hand it a snapshot it waits for."""
        with self.lock:
            if self.failed is not None:
                raise RuntimeError(f"rank {self.rank}: the asynchronous averaging loop failed: {self.failed}") \
                    from self.failed
            if self.ready is not None:
                self._correct(ex, self.stage, self.ready, t)
                self.ready = None
            if self.want:
                self.snap = _flats(ex.params[self.stage])
                self.want = False
                self.lock.notify_all()

    def _loop(self) -> None:
        try:
            wake = threading.Event()
            while True:
                wake.wait(0 if self.stopping else self.sync.interval_s)
                flag = torch.tensor([1.0 if self.stopping else 0.0], dtype=torch.float64)
                if self.apg is not None:
                    dist.all_reduce(flag, group=self.apg)      # bagua's negotiation: go on while any rank trains
                if flag.item() >= self.dp:
                    return
                with self.lock:
                    self.want = True
                    self.lock.wait_for(lambda: self.snap is not None)
                    snap, self.snap = self.snap, None
                parts = [(keys, self._mean(flat, self.apg), flat) for keys, flat in snap]
                with self.lock:
                    self.lock.wait_for(lambda: self.ready is None)
                    self.ready = parts
        except BaseException as e:          # noqa: BLE001 - handed to the step loop, which raises it
            with self.lock:
                self.failed = e
                self.lock.notify_all()

    def drain(self, ex) -> None:
        """Stop the averaging loop once every rank has finished (serving its snapshots until then) and apply the
        last average: each rank joins the same number of averagings."""
        super().drain(ex)
        if self.thread is None:
            return
        with self.lock:
            self.stopping = True
        t = self.step - 1
        while self.thread.is_alive():
            self._serve(ex, t)
            with self.lock:
                self.lock.wait_for(lambda: self.want or self.ready is not None or self.failed is not None,
                                   timeout=0.01)
        self._serve(ex, t)
        self.thread = None

    def report(self):
        return {**super().report(), "averagings": len(self.applied), "applied_steps": list(self.applied),
                "fingerprints": list(self.fingerprints)}

    def save(self) -> dict:
        return {**super().save(), "applied": list(self.applied), "fingerprints": list(self.fingerprints)}

    def load(self, saved: dict) -> None:
        super().load(saved)
        self.applied = list(saved.get("applied", []))
        self.fingerprints = [tuple(x) for x in saved.get("fingerprints", [])]
