"""recompute: activation checkpointing -- backward recomputes forward values instead of reading them from the
forward (``Strategy(recompute="full" | "selective" | "auto" | policy, memory_budget_gb=...)``).

The decision is this module's: before capture the policy's name and budget (:meth:`Recompute.plan`); once each
stage is captured, which of its forward nodes backward recomputes (:meth:`Recompute.plan_stage`: the policy's
marks, or for ``auto`` the least recompute FLOPs, ``cost_models.compute``, whose saved bytes times the
microbatches the schedule holds at once fit the budget). The mechanism is ``passes.recompute``: it copies the
chosen forward chains into backward, in the REMAT slot (before data parallelism places its collectives by
backward's node order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from cost_models.compute import node_cost
from passes import recompute as R
from passes.recompute import Recompute as RecomputePass

from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, Slot, register_feature

__all__ = ["Recompute", "RecomputeSection", "POLICIES", "microbatches_in_flight"]

POLICIES = ("none", "full", "selective", "auto")


def microbatches_in_flight(schedule, stage: int) -> int:
    """The most microbatches of ``stage`` whose forward saved values one rank holds at once (F .. its B or W)."""
    most = 0
    for acts in schedule.actions.values():
        held = 0
        for a in acts:
            if a.stage == stage and a.kind.value == "F":
                held += 1
            elif a.stage == stage and a.kind.value in ("B", "W"):
                held -= 1
            most = max(most, held)
    return max(most, 1)


@dataclass
class RecomputeSection(PlanSection):
    """The policy's name (``"callable:<qualname>"`` for the user's own), the ``auto`` budget in bytes, and per
    stage the decision: ``{"recompute": [node names], "saved": values kept, "saved_bytes": per microbatch,
    "in_flight": microbatches held at once, "recompute_flops": ..., "smallest_bytes": (auto only)}``."""
    policy: str = "none"
    budget_bytes: int | None = None
    stages: list = field(default_factory=list)
    # a callable policy, for this build only: not JSON (the section records its name, and its decisions as data)
    callable_policy: ClassVar[Any] = None

    def lines(self) -> list:
        out = [f"policy {self.policy}" + (f", budget {self.budget_bytes} bytes of saved activations per stage"
                                          if self.budget_bytes is not None else "")]
        for s, e in enumerate(self.stages):
            out.append(f"stage {s}: {len(e['recompute'])} forward node(s) marked for recompute "
                       f"({e['recompute_flops']} FLOPs in backward); keeps {e['saved']} value(s), {e['saved_bytes']} "
                       f"bytes per microbatch x {e['in_flight']} in flight")
        return out


@register_feature
class Recompute(Feature):
    name = "recompute"
    doc = "activation checkpointing: backward recomputes forward values (Chen et al. 2016; Korthikanti et al. 2023)"
    options = {
        "recompute": Option("none", (
            "activation checkpointing (passes/recompute.py): ``'none'``, ``'full'`` (each repeated block recomputed "
            "from its input), ``'selective'`` (save matmul outputs, recompute elementwise work and the attention "
            "core; Korthikanti et al.), ``'auto'`` (the least recompute whose saved activations fit "
            "``memory_budget_gb``), or your ``policy(node) -> 'save' | 'recompute'``. Random ops (dropout) are "
            "never recomputed.")),
        "memory_budget_gb": Option(None, (
            "for ``recompute='auto'``: the saved-activation bytes each stage may hold at once (every microbatch in "
            "flight), in GB (1e9 bytes).")),
    }
    section = RecomputeSection

    def validate(self, strategy) -> None:
        rc, budget = strategy.recompute, strategy.memory_budget_gb
        if not callable(rc) and rc not in POLICIES:
            raise StrategyError(f"Strategy(recompute={rc!r}): choose one of {POLICIES}, or pass a "
                                "policy: a callable node -> 'save' | 'recompute'")
        if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
            raise StrategyError(f"Strategy(memory_budget_gb={budget!r}): must be a positive number of GB")
        if budget is not None and rc != "auto":
            raise StrategyError(f"Strategy(memory_budget_gb={budget!r}, recompute={getattr(rc, '__name__', rc)!r}): "
                                "the budget is what recompute='auto' plans to; other policies decide without it. Set "
                                "recompute='auto' or drop memory_budget_gb")
        if rc == "auto" and budget is None:
            raise StrategyError("Strategy(recompute='auto') needs memory_budget_gb=...: the saved-activation bytes a "
                                "stage may hold, in GB; or pick a policy ('full', 'selective')")

    def plan(self, strategy, plan, cluster):
        """The policy's name and budget; each stage's decision once it is captured (:meth:`plan_stage`)."""
        pol = strategy.recompute
        if not callable(pol) and pol == "none":
            return None
        budget = None if strategy.memory_budget_gb is None else int(strategy.memory_budget_gb * 1e9)
        name = pol if isinstance(pol, str) else "callable:" + getattr(pol, "__qualname__", type(pol).__name__)
        section = RecomputeSection(policy=name, budget_bytes=budget)
        if callable(pol):
            section.callable_policy = pol
        return section

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        """Which forward values stage ``stage``'s backward recomputes, into ``section.stages[stage]``."""
        if section.policy == "none" or stage < len(section.stages):      # off, or decided already (handed back)
            return
        gm = captured.gm
        roles = {ph.name: role for ph, (role, _) in zip(gm.graph.find_nodes(op="placeholder"),
                                                        captured.signature.inputs)}
        in_flight = microbatches_in_flight(schedule, stage)
        flops = lambda n: int(node_cost(n).flops)                        # noqa: E731
        name = section.policy
        if name == "auto":
            try:
                d = R.auto_decide(gm, roles, section.budget_bytes, flops, in_flight)
            except ValueError as e:
                raise StrategyError(f"Strategy(recompute='auto'), stage {stage}: {e}") from None
            names = d["recompute"]
        else:
            policy = section.callable_policy if name.startswith("callable:") else R.POLICIES.get(name)
            if policy is None:
                raise StrategyError(f"Plan section 'recompute', policy {name!r}: a callable policy is not kept in a "
                                    "Plan's JSON; pass it again as Strategy(recompute=your_policy), or keep the "
                                    "section's 'stages'")
            names = R.decide(gm, policy)
            d = {}
        copied, saved = R.demands(gm, names)
        entry = {"recompute": names, "saved": len(saved), "saved_bytes": R.saved_bytes(saved, roles),
                 "in_flight": in_flight, "recompute_flops": sum(flops(n) for n in copied)}
        if "smallest_bytes" in d:
            entry["smallest_bytes"] = d["smallest_bytes"]
        section.stages.append(entry)
        plan.notes.append(f"recompute ({name}): stage {stage} keeps {entry['saved']} forward value(s), "
                          f"{entry['saved_bytes']} bytes per microbatch x {in_flight} in flight; backward recomputes "
                          f"{len(copied)} node(s), {entry['recompute_flops']} FLOPs")

    def make_passes(self, section) -> list:
        # before data_parallel / bucket (a later slot): they place collectives by backward's node order, which
        # must hold the copies already
        return [] if section.policy == "none" else [(Slot.REMAT, RecomputePass())]
