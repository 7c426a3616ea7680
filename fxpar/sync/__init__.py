"""Synchronisation methods: when the data-parallel replicas agree (``Strategy(sync=...)``).

``method.py`` holds the methods' options and math (:class:`LocalSGD`, :class:`DiLoCo`, :class:`SlowMo`);
``feature.py`` the ``sync`` Feature, its Plan section and pass; ``runtime.py`` a rank's state (the step count, the
averaging after the update, the outer step)::

    from fxpar import sync as S
    fxpar.Strategy(dp=4, sync=S.LocalSGD(period=8, warmup_steps=100))
"""
from __future__ import annotations

from .method import DiLoCo, LocalSGD, SlowMo, SyncMethod
from .feature import SyncFeature, SyncSection

__all__ = ["SyncMethod", "LocalSGD", "DiLoCo", "SlowMo", "SyncFeature", "SyncSection"]
