"""Data parallelism (PyTorch DDP, Li et al., VLDB'20) as one Feature: gradients summed across the ranks that hold a
stage, in DDP-style buckets, and buffers kept in step with dp-rank 0.

One module for the gradient sum, its buckets and the buffers: they are one strategy with one decision (which
gradients are summed where, in which buckets) and DDP's three knobs, and no one of them runs without the others.

* options ``bucket_cap_mb`` (None: DDP's 25 MB, unless a gradient-sync method tunes it), ``first_bucket_cap_mb``
  (DDP's 1 MiB first bucket) and ``broadcast_buffers`` (DDP's flag);
* its Plan section :class:`DataParallelSection`: the caps, ``broadcast_buffers`` and each stage's buckets
  (``plan.section("data_parallel").buckets[stage]``: ``[[param key, ...], ...]`` in issue order; edit them and hand
  the Plan back);
* its planning: :meth:`DataParallel.plan` is on wherever a gradient is summed across ranks (dp > 1, parameters
  tied across pipeline stages, Chimera's second pipeline: ``Plan.grad_groups``) and leaves the section off
  elsewhere; :meth:`DataParallel.plan_stage` cuts each stage's buckets once its joint graph shows backward's
  order (:func:`fxpar.planner_comm.plan_buckets`), after the other features' ``bucket_groups`` (gradients they
  send another way) and ``plan_buckets`` (buckets they cut themselves), keeping a handed-back Plan's buckets where
  they still cover the stage's summed gradients;
* its passes ``passes.data_parallel.DataParallelGradSync`` (``GRAD_SYNC``), ``passes.bucket.BucketGradients``
  (``BUCKET``) and ``passes.data_parallel.SyncBuffers`` (``BUFFERS``);
* its lines in ``print(plan)`` and ``explain()``: the buckets, the groups each stage sums over, the buffers.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, Slot, get_feature, register_feature
from fxpar.planner_comm import plan_buckets
from passes.bucket import BucketGradients
from passes.data_parallel import DataParallelGradSync, SyncBuffers

__all__ = ["DataParallel", "DataParallelSection", "DDP_BUCKET_MB", "gradients_summed"]

DDP_BUCKET_MB = 25.0     # DDP's default bucket_cap_mb, fxpar's when Strategy(bucket_cap_mb=None) and nothing tunes it


def gradients_summed(plan) -> bool:
    """Whether any gradient of ``plan`` is summed across ranks: dp > 1, or a group in ``plan.grad_groups``."""
    return plan.dp > 1 or any(g for gg in plan.grad_groups for g in gg.values())


@dataclass
class DataParallelSection(PlanSection):
    """The decision: the bucket caps in bytes (the first bucket at ``min(first, cap)``), whether buffers follow
    dp-rank 0, and per stage the gradient buckets in issue order (filled once the stages are captured)."""
    bucket_cap_bytes: int = int(DDP_BUCKET_MB * 2**20)
    first_bucket_cap_bytes: int = 2**20
    broadcast_buffers: bool = True
    buckets: list = field(default_factory=list)

    def _caps(self) -> str:
        first = min(self.first_bucket_cap_bytes, self.bucket_cap_bytes)
        return f"cap {self.bucket_cap_bytes / 2**20:.3g} MiB, the first {first / 2**20:.3g} MiB"

    def lines(self) -> list:
        n_b = sum(len(b) for b in self.buckets)
        return [f"gradient sync: {n_b} bucket(s) over {len(self.buckets)} stage(s) ({self._caps()}); buffers "
                + ("from dp-rank 0 after each step" if self.broadcast_buffers else "per-rank")]

    def plan_lines(self, plan) -> list:
        out = []
        n_b = sum(len(b) for b in self.buckets)
        if n_b:
            order = next((sec.bucket_order for sec in plan.features.values() if sec.bucket_order),
                         "issued in backward order")
            out.append(f"gradient sync: sum over each gradient's group in {n_b} bucket(s) ({self._caps()}), {order}; "
                       "the mean's 1/dp is folded into backward's seed")
            for s, gg in enumerate(plan.grad_groups):
                names = sorted({g for g in gg.values() if g})
                if names:
                    out.append(f"stage {s}: groups {', '.join(f'{n} {plan.groups.get(n) or n}' for n in names)}")
        if plan.dp > 1:
            out.append("buffers: " + ("dp-rank 0's broadcast after each step (DDP broadcast_buffers)"
                                      if self.broadcast_buffers else "per-rank (not synchronised)"))
        return out


@register_feature
class DataParallel(Feature):
    name = "data_parallel"
    doc = "gradients summed across replicas in DDP-style buckets, buffers from dp-rank 0 (Li et al., VLDB'20)"
    options = {
        "bucket_cap_mb": Option(None, "gradient bucket size for data parallelism, in MiB. None (default): DDP's 25, "
                                      "unless an enabled feature picks the size (its Plan section records the "
                                      "choice); 0: one collective per gradient"),
        "first_bucket_cap_mb": Option(1.0, "cap of the first bucket backward fills, in MiB (DDP's "
                                           "``_DEFAULT_FIRST_BUCKET_BYTES``: 1 MiB), so the first all_reduce starts "
                                           "early and overlaps the rest of backward. Never above ``bucket_cap_mb``"),
        "broadcast_buffers": Option(True, "like DDP's flag: after each step every dp rank takes dp-rank 0's buffers "
                                          "(BatchNorm running statistics)"),
    }
    section = DataParallelSection
    passes = ((Slot.GRAD_SYNC, DataParallelGradSync),   # each gradient summed over the ranks the planner named
              (Slot.BUCKET, BucketGradients),           # those collectives fused into buckets, issued as backward fills them
              (Slot.BUFFERS, SyncBuffers))              # buffers (BatchNorm statistics) follow dp-rank 0

    def enabled(self, strategy) -> bool:
        # a gradient may be summed across ranks: over dp, or (pp > 1) over the stages sharing a tied parameter and
        # Chimera's two pipelines; plan() leaves the section off where none is
        return strategy.dp > 1 or strategy.pp > 1 or super().enabled(strategy)

    def validate(self, strategy) -> None:
        cap, first = strategy.bucket_cap_mb, strategy.first_bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0):
            raise StrategyError(f"Strategy(bucket_cap_mb={cap!r}): must be a number >= 0 (0: one collective per "
                                "gradient) or None (DDP's 25 MiB)")
        if isinstance(first, bool) or not isinstance(first, (int, float)) or first < 0:
            raise StrategyError(f"Strategy(first_bucket_cap_mb={first!r}): must be a number of MiB >= 0 (DDP's is 1.0; "
                                "0: the first gradient alone)")
        if not isinstance(strategy.broadcast_buffers, bool):
            raise StrategyError(f"Strategy(broadcast_buffers={strategy.broadcast_buffers!r}): True (dp-rank 0's buffers "
                                "are broadcast after each step, DDP's default) or False (each rank keeps its own)")

    def plan(self, strategy, plan, cluster):
        if not gradients_summed(plan):
            given = [f"{k}={strategy.option(k)!r}" for k, o in self.options.items() if strategy.option(k) != o.default]
            if given:
                warnings.warn(f"Strategy({', '.join(given)}): no gradient or buffer is shared across ranks in this "
                              f"program (dp={plan.dp}, pp={plan.pp}), so these data-parallel settings do nothing; "
                              "drop them, or set dp > 1", UserWarning, stacklevel=2)
            return None
        cap = strategy.option("bucket_cap_mb")
        return DataParallelSection(bucket_cap_bytes=int((DDP_BUCKET_MB if cap is None else cap) * 2**20),
                                   first_bucket_cap_bytes=int(strategy.option("first_bucket_cap_mb") * 2**20),
                                   broadcast_buffers=bool(strategy.option("broadcast_buffers")))

    def adopt(self, section, strategy, plan, cluster):
        """A handed-back section keeps its caps and buckets (the buckets are checked against each stage once it is
        captured, :meth:`plan_stage`); none where the new Plan sums no gradient."""
        return section if gradients_summed(plan) else None

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        """Stage ``stage``'s buckets: a handed-back Plan's where they cover the gradients summed across ranks, else
        another feature's (``Feature.plan_buckets``), else DDP's at the section's caps."""
        if stage == 0 and len(section.buckets) != plan.n_stages:
            section.buckets = [[] for _ in range(plan.n_stages)]      # none given (or for other stages): plan all
        given = section.buckets[stage]
        known = {k for keys in plan.stage_params for k in keys}
        for i, b in enumerate(given):
            bad = [k for k in b if k not in known]
            if bad:
                raise StrategyError(f"the Plan's data_parallel section: buckets[{stage}][{i}] names {bad}, which is no "
                                    f"trainable parameter of the model (they look like {sorted(known)[:6]}); fix the "
                                    "name, or set buckets to [] to have them planned again")
        feats = [(get_feature(name), sec) for name, sec in plan.features.items()]
        groups = dict(plan.grad_groups[stage])
        for f, sec in feats:
            groups = f.bucket_groups(sec, plan, stage, captured, groups)
        want = {k for k, g in groups.items() if g}
        if sorted(k for b in given for k in b) == sorted(want):
            section.buckets[stage] = [list(b) for b in given]
            return
        if given:
            plan.notes.append(f"stage {stage}: the given buckets do not cover its synchronised gradients "
                              f"{sorted(want)}; planned again")
        own = next((b for f, sec in feats if want
                    and (b := f.plan_buckets(sec, plan, stage, captured, groups, cluster)) is not None), None)
        section.buckets[stage] = (own if own is not None else
                                  plan_buckets(captured, section.bucket_cap_bytes, section.first_bucket_cap_bytes, groups)
                                  if want else [])
