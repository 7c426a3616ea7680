"""offload_activations: what backward reads from forward goes to host memory after its last forward use and
comes back one backward use ahead (``Strategy(offload_activations=True)``; as torch's ``save_on_cpu`` and
ZeRO-Offload do for activations).

The decision is where the copies go (host memory); the mechanism is ``passes.offload``, in the REMAT slot
after recompute (it offloads what backward still reads once recompute has placed its copies).
"""
from __future__ import annotations

from dataclasses import dataclass

from passes.offload import OffloadActivations as OffloadPass

from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, Slot, register_feature

__all__ = ["OffloadActivations", "OffloadActivationsSection"]


@dataclass
class OffloadActivationsSection(PlanSection):
    """Where saved activations live between their last forward use and their backward use (a torch device)."""
    to: str = "cpu"

    def lines(self) -> list:
        return [f"saved activations go to {self.to} after their last forward use and come back one backward use ahead"]


@register_feature
class OffloadActivations(Feature):
    name = "offload_activations"
    doc = "activation offload: saved activations kept in host memory between forward and backward"
    options = {"offload_activations": Option(False, (
        "saved activations go to host memory after their last forward use and come back one backward use ahead "
        "(passes/offload.py). On a CPU backend they are in host memory already: pure cost."))}
    section = OffloadActivationsSection
    passes = ((Slot.REMAT, OffloadPass),)

    def validate(self, strategy) -> None:
        if not isinstance(strategy.offload_activations, bool):
            raise StrategyError(f"Strategy(offload_activations={strategy.offload_activations!r}): True (saved "
                                "activations go to host memory) or False (the default)")

    def plan(self, strategy, plan, cluster):
        plan.notes.append("offload_activations: saved activations go to host memory after their last forward use "
                          "and come back one backward use ahead")
        return OffloadActivationsSection(to="cpu")
