"""HetPipe's wave synchronous parallel (Park et al., USENIX ATC 2020, Section 5) in one process, for the tests.

A run's parameter servers log, in order, each push ``("push", w, c)`` (virtual worker ``w``'s update of wave ``c``)
and each answered read ``("read", w, c, fresh, s)`` (the parameters ``w`` starts wave ``c`` from; ``fresh``: the waves
every virtual worker had pushed). :func:`wsp_violations` checks that recorded wave sequence against WSP's rule:
a read for wave ``c`` is answered only once every virtual worker has pushed the waves before ``c - D``.
:func:`wsp_reference` replays it: each virtual worker trains the whole model on its share of each batch (the
pipeline's stages and microbatches compute the same mean gradient), steps its own optimizer from what it read, and
pushes ``(after - read) / k``; each read holds the servers' start plus every pushed update of the waves before
``c + D`` (:func:`fxpar.testing.sync.ssp_reference`, one clock per wave).
"""
from __future__ import annotations

from .sync import ssp_reference

__all__ = ["wsp_violations", "wsp_reference"]


def wsp_violations(log: list, workers: int, staleness: int) -> list:
    """The reads of one server's ``log`` that break WSP's rule for bound ``staleness``: ``(w, c, pushed)`` where, at
    that point of the log, the virtual workers had pushed only ``pushed`` waves each (the least of them) and
    ``pushed < c - staleness``. Also the reads whose recorded ``fresh`` differs from that count."""
    done = [0] * workers
    bad = []
    for e in log:
        if e[0] == "push":
            done[e[1]] = max(done[e[1]], e[2] + 1)
        elif e[0] == "read":
            w, c, fresh = e[1], e[2], e[3]
            if min(done) < c - staleness or fresh != min(done):
                bad.append((w, c, min(done)))
    return bad


def wsp_reference(model, batches, loss_fn, optimizer, workers: int, logs: list, shards: list, staleness: int) -> dict:
    """WSP replayed from the servers' ``logs`` (server ``j``'s keys in ``shards[j]``): every read checked against
    the rule (an ``AssertionError`` naming the first that breaks it), then each virtual worker's waves in one
    process. Returns ``{"losses": per wave the virtual workers' losses averaged, "final": the servers' parameters,
    "reads": {(w, c): {key: tensor}}}``."""
    for j, log in enumerate(logs):
        bad = wsp_violations(log, workers, staleness)
        if bad:
            w, c, pushed = bad[0]
            raise AssertionError(f"server {j}: virtual worker {w} read wave {c} when every virtual worker had pushed "
                                 f"only {pushed} wave(s); WSP with D={staleness} needs {c - staleness}")
    return ssp_reference(model, batches, loss_fn, optimizer, workers, logs, shards)
