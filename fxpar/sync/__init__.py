"""Synchronisation methods: when the data-parallel replicas agree (``Strategy(sync=...)``).

``method.py`` holds the methods' options and math (:class:`LocalSGD`, :class:`DiLoCo`, :class:`SlowMo`);
``feature.py`` the ``sync`` Feature, its Plan section and pass; ``runtime.py`` a rank's state (the step count, the
averaging after the update, the outer step). Stale synchronous parallel on parameter servers: ``ssp.py`` (:class:`SSP`,
:class:`DSSP`, the staleness rule), ``ssp_server.py`` (the servers' loop), ``ssp_worker.py`` (a worker's push and
read); ``async_avg.py`` BAGUA's asynchronous model averaging (:class:`AsyncAveraging`); ``dabmd.py`` Distributed
Any-Batch Mirror Descent (:class:`DABMD`, a node's round)::

    from fxpar import sync as S
    fxpar.Strategy(dp=4, sync=S.LocalSGD(period=8, warmup_steps=100))
    fxpar.parallelize(model, fxpar.ClusterSpec.local(4, cpu_servers=1), ..., strategy=fxpar.Strategy(dp=4, sync=S.SSP(staleness=3)))
"""
from __future__ import annotations

from .method import DiLoCo, LocalSGD, SlowMo, SyncMethod
from .ssp import DSSP, SSP
from .async_avg import AsyncAveraging
from .dabmd import DABMD
from .feature import SyncFeature, SyncSection

__all__ = ["SyncMethod", "LocalSGD", "DiLoCo", "SlowMo", "SSP", "DSSP", "AsyncAveraging", "DABMD", "SyncFeature",
           "SyncSection"]
