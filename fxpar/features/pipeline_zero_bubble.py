"""Zero-bubble pipelines: ``Strategy(pp=p, schedule="zb1p")`` (ZB-H1, Qi et al., ICLR'24).

Backward is split into the input gradient (``I``) and the weight gradient (``W``); the ``W`` fill the bubbles 1F1B
leaves. Synchronous: one update per step after every ``W``. The generator is in ``fxpar/schedule/zero_bubble.py``.
"""
from __future__ import annotations

from fxpar.feature import register_feature
from fxpar.schedule.zero_bubble import zb1p

from .pipeline import PipelineSchedule

__all__ = ["ZeroBubbleSchedules"]


@register_feature
class ZeroBubbleSchedules(PipelineSchedule):
    name = "zero_bubble"
    doc = "zero-bubble pipelines: backward split into input and weight gradients (Qi et al., ICLR'24)"
    schedules = {"zb1p": zb1p}
    papers = {"zb1p": "ZB-H1 (Qi et al., ICLR'24): backward split into I (input gradient) and W (weight gradient), "
                      "each W moved into a wait 1F1B leaves idle"}
