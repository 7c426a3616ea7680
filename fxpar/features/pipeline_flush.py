"""The synchronous pipeline schedules with a flush: ``Strategy(pp=p, schedule="gpipe" | "1f1b" | "interleaved")``.

Every stage computes the whole batch's gradient with one weight version and updates once per step, after its last
backward: the same math as single-process training on the global batch. The generators are in
``fxpar/schedule/synchronous.py``; 1F1B is the default of a pipeline without ``schedule=``.
"""
from __future__ import annotations

from fxpar.feature import register_feature
from fxpar.schedule.synchronous import gpipe, interleaved, one_f_one_b

from .pipeline import PipelineSchedule

__all__ = ["FlushSchedules"]


@register_feature
class FlushSchedules(PipelineSchedule):
    name = "pipeline_flush"
    doc = "synchronous pipelines flushed every step: GPipe, 1F1B, interleaved 1F1B"
    schedules = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}
    papers = {
        "gpipe": "GPipe (Huang et al., NeurIPS'19): every forward, then every backward; bubble (p-1)/(m+p-1)",
        "1f1b": "1F1B (PipeDream-Flush, Narayanan et al., ICML'21): one forward, one backward; bubble (p-1)/(m+p-1), "
                "at most p microbatches in flight",
        "interleaved": "interleaved 1F1B (Narayanan et al., SC'21): v=2 stages per rank; bubble (p-1)/(v*m+p-1)",
    }
