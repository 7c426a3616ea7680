"""Accordion: PowerSGD whose rank each layer switches between two settings, by the layer's learning regime.

Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive Gradient Communication via Critical
Learning Regime Identification", MLSys 2021, Algorithm 1. Every ``interval`` steps, for each layer (here: each
gradient tensor of a bucket) the norm of its gradient accumulated over the interval just ended, ``||D_cur||``, is
compared with that of the interval before, ``||D_old||``:

    |  ||D_old|| - ||D_cur||  |  /  ||D_old||  >=  threshold    =>  critical regime: the ``high`` setting
                                                                   (the larger rank: less compression)
    otherwise                                                   =>  the ``low`` setting (the smaller rank)

Training starts critical (every layer on ``high``) and the first comparison is at step ``2 * interval``, the first
time two whole intervals lie behind. The gradient accumulated is the one the optimizer receives (the summed bucket
after decompression), which every rank holds bit for bit, so every rank takes the same decisions.

Between switches the arithmetic is :mod:`fxpar.compress.powersgd`'s (torch's ``powerSGD_hook``) at each tensor's
current rank: one error-feedback residual per tensor whatever its rank, and warm-start Qs kept while the settings
stay; a step that changes any tensor's setting starts its bucket's Qs afresh from the seed generator, as the first
compressed step does. With every layer always critical (``threshold=0``) it is ``high`` exactly.

The decisions are made on the host (:meth:`Accordion.variant`: a tuple of per-tensor settings, each distinct tuple
traced once) from the bucket's state, which also holds the switch log: the last ``LOG_CAP`` switches as rows
``(step, tensor, setting)`` (1 = high) and their total count, read back by :meth:`Accordion.switch_log`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.compress.powersgd import (PowerSGD, bucket_layout, describe_layout, draw_seed, p_size, power_step, q_size,
                                     random_q, rng_state_tensor, uncompressed_size, warn_if_nothing_compressed)
from fxpar.errors import StrategyError

__all__ = ["Accordion", "LOG_CAP"]

LOG_CAP = 256          # switches kept per bucket (the latest); the count of all of them is kept beside


@register_method
@dataclass(frozen=True)
class Accordion(Method):
    """Accordion (Agarwal et al., MLSys 2021) over PowerSGD: per layer, ``high`` (the larger rank) in critical
    regimes, ``low`` otherwise, decided every ``interval`` steps from the relative change of the layer's accumulated
    gradient norm against ``threshold``. ``low`` and ``high`` differ in their rank only."""
    low: PowerSGD = PowerSGD(rank=1)
    high: PowerSGD = PowerSGD(rank=2)
    threshold: float = 0.5
    interval: int = 10

    name: ClassVar[str] = "accordion"
    paper: ClassVar[str] = ("Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, Accordion: Adaptive Gradient "
                            "Communication via Critical Learning Regime Identification, MLSys 2021 (Algorithm 1)")

    # ---- options ----
    def check(self, dp: int) -> None:
        for which in ("low", "high"):
            m = getattr(self, which)
            if not isinstance(m, PowerSGD):
                raise StrategyError(f"Accordion({which}={m!r}): give a PowerSGD(...) setting (Accordion switches "
                                    "each layer between two PowerSGD ranks)")
            m.check(dp)
        for f in dataclasses.fields(PowerSGD):
            if f.name != "rank" and getattr(self.low, f.name) != getattr(self.high, f.name):
                raise StrategyError(f"Accordion: low and high differ in {f.name} ({getattr(self.low, f.name)!r} vs "
                                    f"{getattr(self.high, f.name)!r}); they may differ in rank only: give both the "
                                    f"same {f.name}")
        if self.low.rank > self.high.rank:
            raise StrategyError(f"Accordion(low=PowerSGD(rank={self.low.rank}), high=PowerSGD(rank="
                                f"{self.high.rank})): high is the setting for critical regimes, the larger rank; "
                                "swap them")
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0):
            raise StrategyError(f"Accordion(threshold={self.threshold!r}): the relative change of a layer's "
                                "gradient norm that marks it critical must be >= 0 (the paper uses 0.5)")
        if not isinstance(self.interval, int) or isinstance(self.interval, bool) or self.interval < 1:
            raise StrategyError(f"Accordion(interval={self.interval!r}): the steps between decisions must be an "
                                "int >= 1")

    def to_dict(self) -> dict:
        return {"method": self.name, "low": self.low.to_dict(), "high": self.high.to_dict(),
                "threshold": self.threshold, "interval": self.interval}

    @classmethod
    def from_dict(cls, data: dict) -> "Accordion":
        data = dict(data)
        for which in ("low", "high"):
            if isinstance(data.get(which), dict):
                data[which] = PowerSGD.from_dict(data[which])
        return super().from_dict(data)

    def summary(self) -> str:
        return (f"Accordion(low={self.low.summary()}, high={self.high.summary()}, threshold={self.threshold}, "
                f"interval={self.interval})")

    # ---- layout per setting ----
    def layout(self, bucket: BucketInfo, settings: tuple) -> tuple:
        ranks = tuple(self.high.rank if s else self.low.rank for s in settings)
        return bucket_layout(bucket, ranks, self.low.min_compression_rate)

    def _q_slots(self, bucket: BucketInfo) -> int:
        """The warm-start Q buffer: room for the Qs of any settings."""
        lo = bucket_layout(bucket, self.low.rank, self.low.min_compression_rate)
        hi = bucket_layout(bucket, self.high.rank, self.low.min_compression_rate)
        return sum(t.cols * max(a.rank, t.rank) for a, t in zip(lo, hi))

    # ---- per bucket, on the host ----
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        dtype, n = bucket.torch_dtype, len(bucket.shapes)
        warn_if_nothing_compressed(bucket, self.layout(bucket, (True,) * n),
                                   f"Accordion(high=PowerSGD(rank={self.high.rank}))")
        st = {"rng": rng_state_tensor(self.low.seed),
              "acc": torch.zeros(bucket.numel, dtype=dtype),
              "prev_norm": torch.full((n,), -1.0, dtype=torch.float64),
              "high": torch.ones(n, dtype=torch.int64),
              "log": torch.zeros(LOG_CAP, 3, dtype=torch.int64),
              "log_count": torch.zeros(1, dtype=torch.int64)}
        if self.low.error_feedback:
            st["residual"] = torch.zeros(bucket.numel, dtype=dtype)
        if self.low.warm_start:
            st["q"] = torch.zeros(self._q_slots(bucket), dtype=dtype)
        return st

    def _decide(self, bucket: BucketInfo, step: int, state: dict) -> tuple:
        """(settings, whether ``step`` ends an interval, the ended interval's norms or None)."""
        current = tuple(bool(x) for x in state["high"].tolist())
        if step == 0 or step % self.interval:
            return current, False, None
        acc = state["acc"]
        norms = torch.stack([v.norm().to(torch.float64) for v in bucket.views(acc)])
        settings = []
        for cur, old, now in zip(current, state["prev_norm"].tolist(), norms.tolist()):
            if old < 0:                       # no interval before this one yet: stay as it is (critical at start)
                settings.append(cur)
            elif old == 0:
                settings.append(now > 0)
            else:                             # Algorithm 1: |old - now| / old >= threshold -> critical
                settings.append(abs(old - now) / old >= self.threshold)
        return tuple(settings), True, norms

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        settings, boundary, _ = self._decide(bucket, step, state)
        # one graph per (settings, boundary) for every compressed step: where its Qs come from (drawn afresh or the
        # last step's) is the host's choice (host_inputs), as in PowerSGD
        return ("allreduce" if step < self.low.start_iter else "compressed"), settings, boundary

    def _fresh_qs(self, step: int, state: dict, settings: tuple) -> bool:
        """Whether the step draws its Qs afresh: without warm start, at the first compressed step, and where a tensor
        changes rank (its Q's shape changes)."""
        current = tuple(bool(x) for x in state["high"].tolist())
        return not self.low.warm_start or step == self.low.start_iter or settings != current

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        phase, settings, boundary = variant
        out = []
        if boundary:
            _, _, norms = self._decide(bucket, step, state)
            log, count = state["log"].clone(), int(state["log_count"][0])
            for i, (was, now) in enumerate(zip(state["high"].tolist(), settings)):
                if bool(was) != now:
                    log[count % LOG_CAP] = torch.tensor([step, i, int(now)])
                    count += 1
            out += [norms, torch.tensor([int(s) for s in settings], dtype=torch.int64), log,
                    torch.tensor([count], dtype=torch.int64)]
        if phase == "compressed":
            lay = self.layout(bucket, settings)
            if self._fresh_qs(step, state, settings):
                seed, rng = draw_seed(state["rng"], bucket.index, bucket.count)
                out += [random_q(lay, seed, bucket.torch_dtype), rng]
            else:
                out += [state["q"][:q_size(lay)], state["rng"]]
        return out

    # ---- traced ----
    def sum(self, flat: torch.Tensor, state: dict, inputs: list, bucket: BucketInfo, comm: Comm, variant) -> tuple:
        phase, settings, boundary = variant
        new = dict(state)
        if boundary:
            new["prev_norm"], new["high"], new["log"], new["log_count"] = inputs[:4]
            inputs = inputs[4:]
        if phase == "allreduce":
            out = comm.all_reduce(flat)
        else:
            # PowerSGD's step at each tensor's current rank (powersgd.py: torch's hook, in its units)
            lay = self.layout(bucket, settings)
            x = flat * comm.size
            if self.low.error_feedback:
                x = x + state["residual"]
            nq = q_size(lay)
            q_in, new["rng"] = inputs
            out, q = power_step(x, q_in, lay, comm, self.low.orthogonalization_epsilon)
            if self.low.error_feedback:
                new["residual"] = x - out
            if self.low.warm_start:
                new["q"] = torch.cat([q, state["q"][nq:]]) if nq < state["q"].shape[0] else q
        # the gradient the optimizer receives, accumulated over the interval (restarted where one ends)
        new["acc"] = out if boundary else state["acc"] + out
        return out, new

    # ---- cost and words ----
    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        phase, settings, _ = variant
        if phase == "allreduce":
            return bucket.numel * bucket.element_size
        lay = self.layout(bucket, settings)
        return (uncompressed_size(lay) + p_size(lay) + q_size(lay)) * bucket.element_size

    def describe(self, bucket: BucketInfo, variant) -> list:
        phase, settings, _ = variant
        head = (f"bucket {bucket.index}: every {self.interval} steps each tensor goes to rank {self.high.rank} "
                f"(critical: its accumulated gradient norm changed by >= {self.threshold:g} relative) or rank "
                f"{self.low.rank}; all start at rank {self.high.rank}; the switches made: "
                "RunResult.features[rank]['accordion']")
        if phase == "allreduce":
            return [head, f"plain all-reduce of {bucket.numel * bucket.element_size} B before step "
                          f"{self.low.start_iter} (start_iter)"]
        return [head] + describe_layout(bucket, self.layout(bucket, settings))

    def report(self, bucket: BucketInfo, state: dict, records=()) -> dict:
        """The run's result (``RunResult.features[rank]["accordion"][(stage, bucket)]``): the switches made
        (``count``) and the latest ones, oldest first (``log``: ``(step, parameter key, "high" | "low")``)."""
        return {"count": int(state["log_count"][0]), "log": self.switch_log(bucket, state)}

    def switch_log(self, bucket: BucketInfo, state: dict) -> list:
        """The bucket's switches, oldest first: ``(step, parameter key, "high" or "low")`` (the latest
        ``LOG_CAP``)."""
        count = int(state["log_count"][0])
        rows = state["log"].tolist()
        order = range(max(0, count - LOG_CAP), count)
        return [(rows[i % LOG_CAP][0], bucket.keys[rows[i % LOG_CAP][1]], "high" if rows[i % LOG_CAP][2] else "low")
                for i in order]
