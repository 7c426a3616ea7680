"""What the gradient-sync methods share: the ``grad_sync`` option, one value per method (the method's feature
name; the feature lists ``grad_sync`` in its ``enabled_by``), the features they do not compose with, and the
refusal of a pipeline beside them: each is built for data parallelism alone."""
from __future__ import annotations

from fxpar.errors import StrategyError
from fxpar.feature import Option, register_shared_option

__all__ = ["GRAD_SYNC", "DP_ALONE", "check_dp_alone"]

GRAD_SYNC = register_shared_option("grad_sync", Option("allreduce", (
    "how each gradient bucket is summed over dp: ``'allreduce'`` (one all-reduce per bucket), a gradient-sync "
    "method named by the feature that carries it out (``'herring'``, ``'byteps'``, ``'parallax'``; each lists "
    "``grad_sync`` in its ``enabled_by``), or a compression method: an instance of one of ``fxpar.compress``'s "
    "methods (``C.PowerSGD(rank=2)``, ``C.TopK(ratio=0.01)``, ...) or its name for its defaults (``'powersgd'``)")), __name__)

# the features a gradient-sync method does not compose with: it rewrites plain FIFO all-reduce buckets
DP_ALONE = ("tensor_parallel", "zero", "bytescheduler")


def check_dp_alone(strategy) -> None:
    """Refuse a pipeline beside ``strategy.grad_sync``'s method."""
    g = strategy.grad_sync
    if strategy.pp > 1:
        raise StrategyError(f"Strategy(grad_sync={g!r}) with pp={strategy.pp}: {g} is built for data parallelism "
                            "alone with FIFO buckets; drop pp or use grad_sync='allreduce'")
