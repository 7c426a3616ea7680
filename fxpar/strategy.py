"""Strategy: what the user asks for. The planner turns it into a Plan (what will be done)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Callable

from . import feature as _feature_registry
from .errors import StrategyError
from .losses import LOSS_AVERAGES
from .schedule import Schedule, ScheduleParseError

__all__ = ["Strategy"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream", "2bw", "chimera", "single")


@dataclass
class Strategy:
    """How to parallelise a training step.

    dp, tp, pp: sizes of the data-, tensor- and pipeline-parallel mesh axes; their product must
        equal the ClusterSpec's world size.
    sharding: with ``tp > 1``, how each operator's tensors are split over the tp ranks (docs/strategies/tensor-parallel.md):
        ``"auto"`` (default: Tofu's search, Wang et al. EuroSys'19, picks every operator's split by the cost
        model; tp a power of two), ``"megatron"`` (column-parallel then row-parallel Linear pairs found in the
        graph, attention split by heads; Shoeybi et al. 2019), ``"annotations"`` (only the model's
        ``fxpar.shard`` annotations, GShard-style, and propagation), or a dict of Mesh-TensorFlow layouts
        ``{"blocks.*.mlp.fc1.weight": ("tp", None), ...}`` (glob over parameter keys -> a mesh axis or None per
        dim). Annotations in the model count in every mode but ``"auto"``.
    bucket_cap_mb: gradient bucket size for data parallelism. None (default): DDP's 25 MB, except under
        ``grad_sync="herring"``, where the planner picks it from the cost model's simulation of the step
        (Herring's cross-node step overlaps backward bucket by bucket, so the size matters there;
        ``Plan.section("herring").bucket_choice`` records every size tried). 0 means one collective per gradient.
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
    zero: ZeRO (Rajbhandari et al., SC'20; passes/zero.py), over the dp axis: ``0`` off (default); ``1`` optimizer
        state sharded (gradients reduce-scattered once per step, updated chunks all-gathered); ``2`` gradients
        too (reduce-scattered in backward, as each bucket fills); ``3`` parameters too (all-gathered before their
        forward use and again before their backward use). Needs dp > 1 and a traced optimizer (SGD, Adam, AdamW).
    offload_activations: saved activations go to host memory after their last forward use and come back one
        backward use ahead (passes/offload.py). On a CPU backend they are in host memory already: pure cost.
    delayed_update: ZeRO-Offload's one-step delayed parameter update (Ren et al., ATC'21, §4.2): step t's update
        is computed from step t-1's gradients while step t's forward and backward run on the parameters before it,
        W(t+1) = W(t) - lr·grad f(W(t-1)) (PipeDream-2BW's rule), so the optimizer overlaps the next step entirely.
        Not synchronous SGD: it changes the math (no warm-up steps here). Rides on ByteScheduler's carry
        (``comm_schedule="bytescheduler"`` is implied): dp > 1, one stage, one microbatch, traced optimizer. With
        ``zero=1|2|3`` the carry is each bucket's reduce-scattered gradient chunk, and the delayed update runs on
        chunks (ZeRO-Offload's layout: ``offload=("optimizer",)``).
    grad_sync: how each gradient bucket is summed over dp: ``"allreduce"`` (default, one all-reduce per bucket) or
        ``"herring"`` (Thangakrishnan et al., SC'20; passes/herring.py): reduce-scatter within each node into equal
        shards (the bucket padded to a multiple of the node's ranks), sum each shard across nodes, all-gather
        within the node. Needs a ClusterSpec with several nodes (``ClusterSpec.local(4, nodes=2,
        devices_per_node=2)`` simulates two); ``"parallax"`` (Kim et al., EuroSys'19; passes/parallax.py): an
        embedding gradient whose (row index, row) pairs cost less than all-reducing the whole table (Parallax's
        traffic formulas) is sent as those pairs, the rest in all-reduce buckets; ``"byteps"`` (Jiang et al.,
        OSDI'20; passes/byteps.py): the ClusterSpec's ``cpu_servers=k`` CPU-only ranks each sum a
        2(n-1)/(n²+kn-2k) share of every bucket (workers push it and pull the sum), the workers all-reduce the
        rest; k=0 is all-reduce.
    offload, offload_to, offload_dir: ZeRO-Infinity (Rajbhandari et al., SC'21): what of each rank's model state
        lives off the compute device: ``("params", "optimizer")`` or either; ``offload_to="disk"`` keeps it in
        files under ``offload_dir`` (memory-mapped: read into memory as each layer uses it, written back by the
        update), ``"cpu"`` in host memory (where it already is on a CPU backend). With ``zero=3`` the parameters
        on disk are this rank's chunks.
    memory_budget_gb: for ``recompute="auto"``: the saved-activation bytes each stage may hold at once (every
        microbatch in flight), in GB (1e9 bytes).
    comm_schedule: the order gradient communication goes in: ``"fifo"`` (default: DDP-style buckets as backward
        makes them) or ``"bytescheduler"`` (Peng et al., SOSP'19: pieces of at most ``partition_mb``, the layer the
        next forward needs first goes first, at most ``credit_mb`` in flight, and -- dp > 1, a traced optimizer, a
        synchronous schedule with one stage per rank, pipelines and microbatches included -- each bucket's wait and
        update move into the next step, before its first use there).
    partition_mb, credit_mb: ByteScheduler's piece size and bytes in flight, in MiB; None: chosen by the cost
        model's simulation of the cluster (recorded in the Plan's ``bytescheduler`` section).
    grad_order: under ByteScheduler's cross-iteration overlap, the order backward makes the gradients
        (``passes/grad_order.py``): ``"natural"`` (as traced), ``"priority"`` (the next forward's need order: the
        input gradients first, then each layer's weight gradients, first layers first), or None: the cost model
        simulates natural, priority and mixes of the two and keeps the fastest (natural unless 2% faster).
    cross_iteration: under ByteScheduler, whether each step's gradient waits and updates move into the next step:
        True wherever the program allows it (dp > 1, a traced optimizer, a synchronous schedule with one stage per
        rank), False never (the issue plan then orders the pieces within the step), None (default): as True, except
        that on a fused step (one stage, one microbatch) the cost model decides -- without it where the simulation
        predicts the step within 2% as fast that way (on full CPU cores an overlapped transfer costs the compute
        more CPU than a waited one, so a fast link's gradients are better waited; the Plan says so).
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: "str | Schedule | None" = None
    microbatches: int = 1
    split_points: list | None = None
    bucket_cap_mb: float | None = None
    first_bucket_cap_mb: float = 1.0
    broadcast_buffers: bool = True
    passes: list = field(default_factory=list)
    loss_average: str = "auto"
    recompute: "str | Callable" = "none"
    memory_budget_gb: float | None = None
    zero: int = 0
    offload: tuple = ()
    offload_to: str = "cpu"
    offload_dir: str | None = None
    grad_sync: str = "allreduce"
    delayed_update: bool = False
    offload_activations: bool = False
    comm_schedule: str = "fifo"
    partition_mb: float | None = None
    credit_mb: float | None = None
    sharding: "str | dict" = "auto"
    grad_order: str | None = None
    cross_iteration: bool | None = None
    options: dict = field(default_factory=dict)    # options of registered features (fxpar.Feature), by name

    def __post_init__(self):
        _feature_registry.settle_strategy(self)     # options other options imply, before any check
        for name in ("dp", "tp", "pp", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise StrategyError(f"Strategy({name}={v!r}): {name} must be a positive int")
        if self.loss_average not in LOSS_AVERAGES:
            raise StrategyError(f"Strategy(loss_average={self.loss_average!r}): choose one of {LOSS_AVERAGES} "
                                "('global': single-process semantics, 'per_shard': each shard's mean averaged, as DDP)")
        if self.bucket_cap_mb is not None and (not isinstance(self.bucket_cap_mb, (int, float))
                                               or self.bucket_cap_mb < 0):
            raise StrategyError(f"Strategy(bucket_cap_mb={self.bucket_cap_mb}): must be >= 0 (0: one collective per gradient)")
        if self.first_bucket_cap_mb < 0:
            raise StrategyError(f"Strategy(first_bucket_cap_mb={self.first_bucket_cap_mb}): must be >= 0")
        if isinstance(self.schedule, str) and self.schedule.lstrip().startswith("#"):
            try:
                self.schedule = Schedule.parse(self.schedule)
            except ScheduleParseError as e:
                raise StrategyError(f"Strategy(schedule=<text>): {e}") from None
        if self.schedule is not None and not self._custom_schedule and self.schedule not in _SCHEDULES:
            raise StrategyError(f"Strategy(schedule={self.schedule!r}): choose one of {_SCHEDULES}, or pass a "
                                "fxpar.schedule.Schedule or its text (starting with its '# schedule ...' header)")
        self._check_options()
        on = _feature_registry.check_strategy(self)      # each enabled feature's options, requires and conflicts
        self._check_shared(on)

    def _check_shared(self, on: list) -> None:
        """A field several features share (``grad_sync``: one method each), off its default: an enabled feature
        must carry its value out."""
        sharing = {}
        for f in _feature_registry.registered_features():
            for name in f.enabled_by:
                sharing.setdefault(name, []).append(f.name)
        for name, names in sharing.items():
            v, default = getattr(self, name), _DEFAULTS[name]
            if v != default and not any(name in f.enabled_by for f in on):
                raise StrategyError(f"Strategy({name}={v!r}): choose {default!r} (the default) or a method a "
                                    f"registered feature carries out: {', '.join(repr(n) for n in names)}")

    def _check_options(self) -> None:
        """Every key of ``options`` is an option a registered feature owns."""
        owned = _feature_registry.option_defaults()
        for k in self.options:
            if k not in owned:
                near = difflib.get_close_matches(k, list(owned) + [f.name for f in fields(self)], n=1)
                raise StrategyError(f"Strategy({k}=...): no registered feature owns option {k!r}"
                                    + (f" (did you mean {near[0]!r}?)" if near else "")
                                    + "; register the Feature that declares it (fxpar.register_feature) before making "
                                    f"the Strategy. Feature options: {sorted(owned) or 'none'}")

    def option(self, name: str):
        """The value of option ``name``: a Strategy field, or a registered feature's option (its default if unset)."""
        if name in _FIELDS:
            return getattr(self, name)
        if name in self.options:
            return self.options[name]
        owned = _feature_registry.option_defaults()
        if name not in owned:
            raise AttributeError(f"Strategy has no option {name!r}")
        return owned[name]

    def __getattr__(self, name: str):       # a registered feature's option reads like a field: strategy.my_option
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        try:
            return self.option(name)
        except AttributeError:
            raise AttributeError(f"'Strategy' object has no attribute {name!r}") from None


    @property
    def _custom_schedule(self) -> bool:
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
        if self.tp > 1:
            parts.append(f"sharding={self.sharding!r}" if isinstance(self.sharding, str) else "sharding=<layouts>")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.comm_schedule != "fifo":
            parts.append(f"comm_schedule={self.comm_schedule!r}")
        if self.cross_iteration is not None:
            parts.append(f"cross_iteration={self.cross_iteration}")
        if self.pp > 1:
            sched = self.schedule or "1f1b"
            if self._custom_schedule:
                sched = f"<hand-written {sched.name!r}: {sched.n_ranks} ranks, {sched.n_stages} stages>"
            parts += [f"schedule={sched}", f"microbatches={self.microbatches}"]
        return "Strategy(" + ", ".join(parts) + ")"


_FIELDS = {f.name for f in fields(Strategy)}
_DEFAULTS = {f.name: f.default for f in fields(Strategy)}
_feature_registry._CORE_OPTIONS.update(_FIELDS - {"options"})
_dataclass_init = Strategy.__init__


def _init(self, *args, **kwargs):
    """``Strategy(dp=2, my_option=...)``: keywords that are not Strategy fields are registered features' options."""
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIELDS}
    if extra:
        kwargs["options"] = {**kwargs.get("options", {}), **extra}
    _dataclass_init(self, *args, **kwargs)


_init.__doc__ = Strategy.__doc__
Strategy.__init__ = _init
