"""What the gradient-sync methods (``Strategy(grad_sync=...)``: Herring, BytePS, Parallax) share: each carries out
one value of the core ``grad_sync`` option and is built for data parallelism alone, with FIFO buckets."""
from __future__ import annotations

from fxpar.errors import StrategyError

__all__ = ["check_dp_alone"]


def check_dp_alone(strategy) -> None:
    """Refuse ZeRO, a pipeline or a communication schedule beside ``strategy.grad_sync``'s method."""
    g = strategy.grad_sync
    if strategy.zero or strategy.pp > 1 or strategy.comm_schedule != "fifo":
        raise StrategyError(f"Strategy(grad_sync={g!r}) with zero={strategy.zero}, pp={strategy.pp}, "
                            f"comm_schedule={strategy.comm_schedule!r}: {g} is built for data parallelism "
                            "alone with FIFO buckets; drop the others or use grad_sync='allreduce'")
