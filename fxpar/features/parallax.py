"""Parallax (Kim et al., EuroSys'19): ``Strategy(grad_sync="parallax")``.

An embedding gradient whose (row index, row) pairs cost less than all-reducing the whole table (Parallax's
traffic formulas, ``passes.parallax.classify``) travels as those pairs; the rest stays in all-reduce buckets.
The decision, here, once the step is captured: each embedding gradient's route, and how each sparse one's update
is applied (``passes.parallax.update_routes``: into the touched rows under plain SGD, else through a dense
gradient). The mechanism: ``passes/parallax.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fxpar.feature import Feature, PlanSection, Slot, register_feature
from passes.parallax import SparseGradSync, classify, update_routes

from .grad_sync import DP_ALONE, check_dp_alone

__all__ = ["Parallax", "ParallaxSection"]


@dataclass
class ParallaxSection(PlanSection):
    """``routes``: per embedding gradient its traffic on each route and the route chosen (None: not decided yet);
    ``sparse``: the gradients sent as pairs; ``sparse_update``: per sparse gradient how its update is applied
    (``{"route": "rows" | "dense", "why": ...}``; None: not decided yet). A handed-back Plan keeps them."""
    routes: dict | None = None
    sparse: list = field(default_factory=list)
    sparse_update: dict | None = None

    def lines(self) -> list:
        if self.routes is None:
            return ["gradient buckets all-reduced, sparse embedding gradients as (index, row) pairs: routes chosen "
                    "once the step is captured"]
        upd = self.sparse_update or {}
        return [f"all-reduce, sparse embedding gradients as (index, row) pairs: {self.sparse or 'none'}"
                + ("; update " + ", ".join(f"{k}: {upd[k]['route']}" for k in self.sparse if k in upd)
                   if self.sparse and upd else "")]


@register_feature
class Parallax(Feature):
    name = "parallax"
    doc = ("sparse embedding gradients as (row index, row) pairs, the rest all-reduced (Kim et al., EuroSys'19; "
           "passes/parallax.py): an embedding gradient whose pairs cost less than all-reducing the whole table "
           "(Parallax's traffic formulas) is sent as those pairs, the rest in all-reduce buckets")
    section = ParallaxSection
    enabled_by = ("grad_sync",)
    conflicts_with = DP_ALONE

    def enabled(self, strategy) -> bool:
        return strategy.grad_sync == "parallax"

    def validate(self, strategy) -> None:
        check_dp_alone(strategy)

    def plan(self, strategy, plan, cluster):
        return ParallaxSection()          # the routes are chosen once the step is captured

    def bucket_groups(self, section, plan, stage, captured, groups):
        if stage == 0:
            self._routes(section, plan, captured)
        return {k: (None if k in section.sparse else g) for k, g in groups.items()}

    def _routes(self, section, plan, captured) -> None:
        """Which embedding gradients travel as pairs (``classify``'s traffic formulas on the captured step), and
        how each one's update is applied; a handed-back Plan keeps its routes."""
        if section.routes is not None and section.sparse_update is not None:
            return
        if section.routes is None:
            section.routes = classify(captured.gm, plan.dp)
            section.sparse = sorted(k for k, r in section.routes.items() if r["route"] == "sparse")
        # each sparse gradient's update: into the touched rows (plain SGD) or through a dense gradient, and why
        section.sparse_update = update_routes(captured.gm, captured.optimizer, section.sparse, plan.microbatches)
        upd = section.sparse_update
        plan.notes.append("grad_sync: Parallax -- " + ("; ".join(
            f"{k}: {r['route']} (pairs {r['sparse_bytes']:.0f} B vs all-reduce {r['dense_bytes']:.0f} B per rank)"
            + (f", update {upd[k]['route']}: {upd[k]['why']}" if k in upd else "")
            for k, r in section.routes.items()) or "no embedding gradient: everything all-reduced"))

    def make_passes(self, section):
        # the sparse gradients as (row index, row) pairs, before the rest is bucketed
        return [(Slot.GRAD_ROUTE, SparseGradSync())] if section.sparse else []

    def held_less(self, section, program):
        cap = program.captured
        rows = [k for k, r in (section.sparse_update or {}).items() if r.get("route") == "rows"]
        saved = sum(int(cap.param_dtypes[k].itemsize) * _numel(cap.param_shapes[k])
                    for k in rows if k in cap.param_shapes)
        if not rows:
            return {}
        return {"gradients": (saved, f"no dense gradient for {sorted(rows)}: Parallax's row update applies the "
                                     "gathered rows")}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
