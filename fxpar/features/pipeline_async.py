"""Asynchronous pipelines: ``Strategy(pp=p, schedule="pipedream" | "2bw")``.

Neither flushes: weights change while microbatches are in flight, and each forward's weight version is stashed
until its backward (``F0.5@2``). PipeDream (Harlap, Narayanan et al., SOSP'19) updates after every microbatch's
backward; PipeDream-2BW (Narayanan et al., ICML'21) after each batch of m microbatches, computing batch b with
version b-1: W(t+1) = W(t) - lr * grad f(W(t-1)). A run covers all its batches in one window
(:meth:`AsyncSchedules.make_schedule`). A checkpoint carries the versions the next window's first forwards read
(2BW: W(t-1); PipeDream: stage s's last ``p-s-1``), and a resumed window starts holding them beside W(t), so
``run_local(b1, save_to=d)`` then ``run_local(b2, resume_from=d)`` is ``run_local(b1 + b2)`` bitwise. The
generators are in ``fxpar/schedule/asynchronous.py``; ``fxpar.testing.async_reference`` holds the papers' math.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpar.errors import StrategyError
from fxpar.feature import register_feature
from fxpar.schedule.asynchronous import pipedream, pipedream_2bw

from .pipeline import PipelineSchedule, PipelineSection

__all__ = ["AsyncSchedules", "AsyncSection"]



def refuse_tied_weights(schedule: str, plan) -> None:
    """An asynchronous schedule steps each stage at its own time: a parameter shared by stages would get a version
    per stage (docs/semantics.md §1)."""
    if plan.tied:
        raise StrategyError(f"schedule {schedule!r} steps each stage at its own time, so a parameter shared by "
                            f"stages ({sorted(plan.tied)}: {plan.tied}) would get different versions in different "
                            "stages. Untie it, or use a synchronous schedule.")

@dataclass
class AsyncSection(PipelineSection):
    """``schedule``: ``"pipedream"`` or ``"2bw"``; several weight versions per stage."""
    asynchronous = True


@register_feature
class AsyncSchedules(PipelineSchedule):
    name = "pipedream"
    doc = "asynchronous pipelines with weight stashing: PipeDream (SOSP'19), PipeDream-2BW (ICML'21)"
    section = AsyncSection
    schedules = {"pipedream": pipedream, "2bw": pipedream_2bw}
    papers = {
        "pipedream": "PipeDream (Harlap, Narayanan et al., SOSP'19): 1F1B without a flush, an update after every "
                     "microbatch's backward, each forward's version stashed for its backward",
        "2bw": "PipeDream-2BW (Narayanan et al., ICML'21): 1F1B without a flush, an update per batch of m "
               "microbatches computed with the version before: W(t+1) = W(t) - lr * grad f(W(t-1))",
    }

    def make_schedule(self, section, plan, n_batches: int = 2, resumed: bool = False):
        """One window covers ``n_batches`` batches (a run covers all of its own). PipeDream: one update per
        microbatch, so the window is ``m * n_batches`` microbatches; 2BW: ``n_batches`` batches of m, and a
        ``resumed`` window starts from the previous versions the checkpoint carries (PipeDream: ``p-s-1`` per stage,
        2BW: one), so that a run resumed from a checkpoint is the run that never stopped."""
        p, m = plan.pp, plan.microbatches
        if section.schedule == "pipedream":
            return pipedream(p, m * n_batches, resumed=resumed)
        return pipedream_2bw(p, m, n_batches=n_batches, resumed=resumed)

    def grad_scale(self, section, plan) -> float:
        """PipeDream updates after every microbatch: its gradient is not averaged over the batch's microbatches."""
        return 1.0 if section.schedule == "pipedream" else 1.0 / plan.microbatches

    def cut_stages(self, section, strategy, plan, base, model, micro, loss_fn, cluster) -> tuple:
        trace, split = super().cut_stages(section, strategy, plan, base, model, micro, loss_fn, cluster)
        refuse_tied_weights(section.schedule, plan)
        return trace, split
