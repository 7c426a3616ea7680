"""The update written into the parameters' own storage, as torch.optim does: a Feature on by default.

Capture traces the optimizer functionally (fresh parameter and moment tensors every step); where the optimizer is
traced into the step (``Plan.optimizer["traced"]``) and the schedule is synchronous (``Plan.asynchronous`` is off: no
weight stashing keeps old versions alive), the pass ``passes.reinplace.ReinplaceOptimizer`` (``Slot.OPTIMIZER``) makes
the update write into the parameter and optimizer-state buffers the runtime holds, and runs Adam/AdamW as one fused
kernel where ``Plan.optimizer["kernel"]`` says ``"fused"``. A feature whose own mechanism updates in place (a
carry of the update into the next step) takes its place through ``Feature.replaces``.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpar.feature import Feature, PlanSection, Slot, register_feature
from passes.reinplace import ReinplaceOptimizer

__all__ = ["InplaceUpdate", "InplaceUpdateSection"]


@dataclass
class InplaceUpdateSection(PlanSection):
    """On: the traced update runs in place (no field: the optimizer's kernel is ``Plan.optimizer``'s)."""

    def lines(self) -> list:
        return ["the traced update writes into the parameters' and optimizer state's own storage, as torch.optim does"]


@register_feature
class InplaceUpdate(Feature):
    name = "inplace_update"
    doc = "the optimizer's update written into the parameters' own storage, as torch.optim does"
    section = InplaceUpdateSection
    passes = ((Slot.OPTIMIZER, ReinplaceOptimizer),)

    def enabled(self, strategy) -> bool:
        return True           # decided by plan(): the optimizer and the schedule are the Plan's

    def plan(self, strategy, plan, cluster):
        return InplaceUpdateSection() if _applies(plan) else None

    def adopt(self, section, strategy, plan, cluster):
        return section if _applies(plan) else None


def _applies(plan) -> bool:
    """A traced optimizer under a synchronous schedule (weight stashing keeps the old tensors alive)."""
    return bool((plan.optimizer or {}).get("traced")) and not plan.asynchronous
