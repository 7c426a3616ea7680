"""Strategy: what the user asks for. The planner turns it into a Plan (what will be done)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .errors import StrategyError

if TYPE_CHECKING:
    from .schedule import Schedule

__all__ = ["Strategy"]

_RECOMPUTE = ("none", "full", "selective", "auto")
_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream", "2bw", "chimera", "single")


@dataclass
class Strategy:
    """How to parallelise a training step.

    dp, tp, pp: sizes of the data-, tensor- and pipeline-parallel mesh axes; their product must
        equal the ClusterSpec's world size.
    bucket_cap_mb: gradient bucket size for data parallelism (DDP's default: 25 MB). 0 means one
        collective per gradient.
    first_bucket_cap_mb: cap of the first bucket backward fills (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``:
        1 MiB), so the first all_reduce starts early and overlaps the rest of backward. Never above
        ``bucket_cap_mb``.
    broadcast_buffers: like DDP's flag: after each step every dp rank takes dp-rank 0's buffers
        (BatchNorm running statistics).
    passes: your own passes (fxpar.Pass), appended after fxpar's, in order; a pass whose ``before``
        names one of fxpar's (e.g. ``before=("data_parallel",)``) is placed just ahead of it.
    schedule: (pp > 1) a schedule name (``"gpipe"``, ``"1f1b"``, ...), or a hand-written schedule: a
        ``fxpar.schedule.Schedule`` or its text (``str(schedule)``'s grid or ``schedule.format_lists()``),
        read with ``Schedule.parse``. A hand-written one is validated and dry-run when the program is built:
        one that would deadlock raises ``fxpar.schedule.ScheduleDeadlockError`` naming the step and ranks.
    loss_average: how the dp shards' and microbatches' losses make the step's loss (docs/semantics.md):
        ``"global"`` -- single-process training on the global batch: a mean over counted elements (cross-entropy
        with ``ignore_index``) divides the sum of every shard by the global count; ``"per_shard"`` -- the mean of
        each shard's loss, as torch DDP; ``"auto"`` (default) -- ``"global"`` where fxpar sees the loss
        (``torch.nn.functional.cross_entropy``/``nll_loss``, ``nn.CrossEntropyLoss``/``nn.NLLLoss``), else
        ``"per_shard"``.
    recompute: activation checkpointing (passes/recompute.py): ``"none"`` (default), ``"full"`` (each repeated
        block recomputed from its input), ``"selective"`` (save matmul outputs, recompute elementwise work and the
        attention core; Korthikanti et al.), ``"auto"`` (the least recompute whose saved activations fit
        ``memory_budget_gb``), or your ``policy(node) -> "save" | "recompute"``. Random ops (dropout) are never
        recomputed.
    memory_budget_gb: for ``recompute="auto"``: the saved-activation bytes each stage may hold at once (every
        microbatch in flight), in GB (1e9 bytes).
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: "str | Schedule | None" = None
    microbatches: int = 1
    split_points: list | None = None
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    broadcast_buffers: bool = True
    passes: list = field(default_factory=list)
    loss_average: str = "auto"
    recompute: "str | Callable" = "none"
    memory_budget_gb: float | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise StrategyError(f"Strategy({name}={v!r}): {name} must be a positive int")
        from .losses import LOSS_AVERAGES
        if self.loss_average not in LOSS_AVERAGES:
            raise StrategyError(f"Strategy(loss_average={self.loss_average!r}): choose one of {LOSS_AVERAGES} "
                                "('global': single-process semantics, 'per_shard': each shard's mean averaged, as DDP)")
        if not callable(self.recompute) and self.recompute not in _RECOMPUTE:
            raise StrategyError(f"Strategy(recompute={self.recompute!r}): choose one of {_RECOMPUTE}, or pass a "
                                "policy: a callable node -> 'save' | 'recompute'")
        if self.memory_budget_gb is not None and not (isinstance(self.memory_budget_gb, (int, float))
                                                      and self.memory_budget_gb > 0):
            raise StrategyError(f"Strategy(memory_budget_gb={self.memory_budget_gb!r}): must be a positive number of GB")
        if self.recompute == "auto" and self.memory_budget_gb is None:
            raise StrategyError("Strategy(recompute='auto') needs memory_budget_gb=...: the saved-activation bytes a "
                                "stage may hold, in GB; or pick a policy ('full', 'selective')")
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb < 0:
            raise StrategyError(f"Strategy(bucket_cap_mb={self.bucket_cap_mb}): must be >= 0 (0: one collective per gradient)")
        if self.first_bucket_cap_mb < 0:
            raise StrategyError(f"Strategy(first_bucket_cap_mb={self.first_bucket_cap_mb}): must be >= 0")
        if isinstance(self.schedule, str) and self.schedule.lstrip().startswith("#"):
            from .schedule import Schedule, ScheduleParseError
            try:
                self.schedule = Schedule.parse(self.schedule)
            except ScheduleParseError as e:
                raise StrategyError(f"Strategy(schedule=<text>): {e}") from None
        if self.schedule is not None and not self._custom_schedule and self.schedule not in _SCHEDULES:
            raise StrategyError(f"Strategy(schedule={self.schedule!r}): choose one of {_SCHEDULES}, or pass a "
                                "fxpar.schedule.Schedule or its text (starting with its '# schedule ...' header)")

    @property
    def _custom_schedule(self) -> bool:
        from .schedule import Schedule
        return isinstance(self.schedule, Schedule)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def coerce(cls, strategy, world_size: int) -> "Strategy":
        """Accept a Strategy, "auto" / None (data parallel over every rank), or a list of passes."""
        if strategy is None or strategy == "auto":
            return cls(dp=world_size)
        if isinstance(strategy, (list, tuple)):
            return cls(dp=world_size, passes=list(strategy))
        if not isinstance(strategy, cls):
            raise StrategyError(f"strategy={strategy!r}: pass fxpar.Strategy(...), 'auto', or a list of passes")
        return strategy

    def __str__(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.pp > 1:
            sched = self.schedule or "1f1b"
            if self._custom_schedule:
                sched = f"<hand-written {sched.name!r}: {sched.n_ranks} ranks, {sched.n_stages} stages>"
            parts += [f"schedule={sched}", f"microbatches={self.microbatches}"]
        return "Strategy(" + ", ".join(parts) + ")"
