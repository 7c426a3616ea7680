"""Bidirectional pipelines: ``Strategy(pp=p, schedule="chimera")`` (Li & Hoefler, SC'21).

Two pipelines run in opposite directions over the same ranks, each rank holding two stages (one per direction);
the two replicas of a stage sum their gradients and update once per step: synchronous. The generator is in
``fxpar/schedule/chimera.py``.
"""
from __future__ import annotations

from fxpar.feature import register_feature
from fxpar.schedule.chimera import chimera

from .pipeline import PipelineSchedule

__all__ = ["ChimeraSchedules"]


@register_feature
class ChimeraSchedules(PipelineSchedule):
    name = "chimera"
    doc = "bidirectional pipelines: two pipelines in opposite directions over the same ranks (Li & Hoefler, SC'21)"
    schedules = {"chimera": chimera}
    papers = {"chimera": "Chimera (Li & Hoefler, SC'21): a down and an up pipeline over the same ranks, m/2 "
                         "microbatches each; a stage's two replicas sum their gradients; bubble (p-2)/(2m+p-2) "
                         "with equal F and B"}
