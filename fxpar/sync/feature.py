"""The ``sync`` feature: the Strategy option, its Plan section, its pass, its cost and its words.

``Strategy(dp=N, sync=S.LocalSGD(period=H, warmup_steps=W))`` (or :class:`~fxpar.sync.method.DiLoCo`, streaming
with ``fragments=F``, :class:`~fxpar.sync.method.SlowMo`, :class:`~fxpar.sync.async_avg.AsyncAveraging`).
The pass puts a host call where each dp gradient bucket's all-reduce was
(``fxpar.compress``'s :class:`~fxpar.compress.feature.CompressedSum`, fed by :class:`GradientStep`): it all-reduces
the bucket during the warm-up and hands back the rank's own gradient after. The rank's :class:`SyncState`
(:mod:`fxpar.sync.runtime`) averages the parameters after the optimizer step of each averaging step.

What travels per rank: during the warm-up, each bucket's all-reduce, as plain data parallelism; after, nothing on
the steps between two averagings and one all-reduce of the stage's parameters (``P`` bytes, the same bytes as
the gradient buckets) on each averaging step: ``P`` bytes per ``H`` steps. Under tensor parallelism inside a replica
``P`` is the rank's shards (:func:`piece_shapes`), all-reduced over its dp group; the methods that need more than
elementwise averaging refuse tp (:func:`_check_tensor_parallel`). ``estimate()`` counts the window's mean,
``P // H`` bytes per step, where the buckets' all-reduces were (hierarchical Local SGD: ``P`` times the averagings in
its largest period's window, over that window). :meth:`SyncFeature.window` lists the averaging actions step by
step for ``program.schedule(rank)``.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fxpar.compress.feature import CompressedSum, bucket_infos, dp_bucket_indices
from fxpar.compress.method import BucketInfo, Method
from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, Slot, enabled_features, register_feature

from .async_avg import ASYNC_GROUP, AsyncAveraging, AsyncAveragingState
from .dabmd import DABMD, REPLICA_GROUP, DABMDState
from .method import DiLoCo, SyncMethod, method_from_dict, model_blocks
from .runtime import SyncInfo, SyncState
from .ssp_server import SSPServer, SSPServerRunner
from .ssp_worker import SSPState

__all__ = ["SyncFeature", "SyncSection", "GradientStep", "FEATURE", "sync_state", "shard_keys", "piece_shapes",
           "local_buckets"]

FEATURE = "sync"
ALLREDUCE, LOCAL = "allreduce", "local"
WORKERS_GROUP = "ssp_workers"     # every worker rank, beside the parameter servers (a checkpoint's group)
# features whose gradient or parameter layout assumes replicas that agree every step
TP_FEATURE = "tensor_parallel"
CONFLICTS = ("zero", "zero_offload", "bytescheduler", "herring", "byteps", "parallax")


@dataclass(frozen=True)
class GradientStep(Method):
    """How a sync method sums a gradient bucket (not a ``grad_sync`` value of its own): an all-reduce on the
    warm-up's steps, the rank's own gradient after (the bucket arrives scaled by 1/dp: times dp)."""
    name: ClassVar[str] = "sync_gradient"
    eager: ClassVar[bool] = True
    warmup_steps: int = 0
    period: int = 1

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        return ALLREDUCE if step < self.warmup_steps else LOCAL

    def sum(self, flat, state, inputs, bucket, comm, variant):
        if variant == ALLREDUCE:
            return comm.all_reduce(flat), state
        return flat * bucket.dp, state

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return bucket.numel * bucket.element_size if variant == ALLREDUCE else 0

    def collectives(self, bucket: BucketInfo, variant) -> list:
        return [("all_reduce", self.wire_bytes(bucket, variant))] if variant == ALLREDUCE else []


@dataclass
class SyncSection(PlanSection):
    """``method``: the method's options (``SyncMethod.to_dict()``); ``stages``: per stage, per dp gradient bucket
    ``{"bucket", "keys", "numel", "dtype", "plain_bytes", "window_bytes", "wire_bytes", "collectives", "declared",
    "first_step"}``: ``window_bytes`` the bucket's parameters' bytes one averaging all-reduces (per ``period``
    steps; DiLoCo's quantized pseudo-gradients: the bytes each rank all-gathers, ``plain_bytes`` unquantized),
    ``wire_bytes`` the window's averagings' bytes per step (what the cost models count where the bucket's all-reduce
    was), ``first_step`` the warm-up's all-reduce of the gradient bucket."""
    method: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    servers: list = field(default_factory=list)     # SSP / DSSP: the parameter servers' global ranks
    shards: list = field(default_factory=list)      # SSP / DSSP: per server, the parameter keys it holds
    server_stage: list = field(default_factory=list)  # SSP / DSSP: per server, the pipeline stage of its keys

    def lines(self) -> list:
        m = method_from_dict(self.method)
        rows = [b for st in self.stages for b in st]
        head = m.summary()
        if m.uses_servers:
            return [f"{head}: the parameters live on {len(self.servers)} parameter server(s) (ranks {self.servers}); "
                    "each worker pushes its update and reads the parameters every step"]
        if not rows:
            return [head]
        window = sum(b["window_bytes"] for b in rows)
        plain = sum(b["plain_bytes"] for b in rows)
        if getattr(m, "quantize", None):
            return [f"{head}: {window} bytes per rank per window of {m.period} step(s) (the pseudo-gradients in "
                    f"{m.quantize.upper()}, all-gathered; {plain} unquantized) instead of {plain} per step, no "
                    "gradient all-reduce between averagings"]
        return [f"{head}: {window} bytes per rank per averaging (every {m.period} step(s)) instead of {window} "
                "per step, no gradient all-reduce between averagings"]


def tp_words(plan) -> str:
    """What tensor parallelism inside a replica changes (empty at tp=1)."""
    if plan.tp < 2:
        return ""
    return (f"tensor parallelism inside each replica (tp={plan.tp}): each tp rank averages its own shards over its dp "
            "group (the dp ranks at its tp coordinate), after the same step's update as the replica's other tp ranks; "
            "the bytes are the rank's shards', the outer state is per shard")


def _note(plan, m: SyncMethod) -> None:
    if plan.tp > 1 and not m.uses_servers:
        budget = ("; a replica's tp ranks take the same microbatches every round (each rank's stop flag max-reduced "
                  "over them: the slowest decides)" if m.name == "dabmd" and not m.fixed_microbatches else "")
        plan.notes.append(f"sync: {m.summary()} -- {tp_words(plan)}{budget}")
    if isinstance(m, AsyncAveraging):
        plan.notes.append(m.note_words())
        return
    if hasattr(m, "note"):                 # a method that words its own note (DABMD)
        plan.notes.append(m.note())
        return
    if m.uses_servers:
        plan.notes.append(
            f"sync: {m.summary()} -- the parameters live on the ClusterSpec's cpu_servers ranks; each worker steps its "
            f"own optimizer, pushes the change divided by dp, and {m.outer_words()}; the workers' optimizer states "
            "are their own. state_dict() and checkpoints hold the servers' parameters after every push "
            "(docs/semantics.md, 'Synchronisation methods')")
        return
    warm = (f"the first {m.warmup_steps} step(s) all-reduce the gradients (synchronous data parallelism); after, "
            if m.warmup_steps else "")
    if getattr(m, "hierarchical", ()):
        levels = ", ".join(f"every {p} step(s) within groups of {g}" for p, g in m.hierarchical)
        plan.notes.append(
            f"sync: {m.summary()} -- {warm}each dp replica steps its own optimizer with its own gradient, and from step "
            f"{m.warmup_steps} the replicas are averaged {levels} (the largest period dividing the step wins; torch's "
            "HierarchicalModelAverager); the optimizer state is not averaged. state_dict() and checkpoints hold the "
            "replicas' average (docs/semantics.md, 'Synchronisation methods')")
        return
    plan.notes.append(
        f"sync: {m.summary()} -- {warm}each dp replica steps its own optimizer with its own gradient and the "
        f"replicas' parameters are averaged after steps {m.warmup_steps}, {m.warmup_steps + m.period}, ... "
        f"({m.outer_words()}); the optimizer state is not averaged. The replicas differ between averagings: "
        "state_dict() and checkpoints hold the replicas' average, each replica's own weights are in "
        "RunResult.features[rank]['sync']['replica'] (docs/semantics.md, 'Synchronisation methods')")


def piece_shapes(plan, stage: int, captured) -> dict:
    """``{key: shape}``: the piece of each of stage ``stage``'s parameters one rank holds. Under tensor parallelism
    (the ``tensor_parallel`` section's per-parameter layouts: a mesh axis or None per dim) a split dim is cut evenly
    over its axis (a split divides its dim), so every tp rank holds pieces of one shape; else the whole shapes."""
    shapes = {k: tuple(int(x) for x in sh) for k, sh in captured.param_shapes.items()}
    tp = plan.features.get(TP_FEATURE)
    if tp is None or stage >= len(tp.stages) or "params" not in tp.stages[stage]:
        return shapes
    sizes = {a: int(n) for a, n in tp.axes}
    for k, dims in tp.stages[stage]["params"].items():
        if k in shapes:
            shapes[k] = tuple(n // sizes[a] if a is not None else n for n, a in zip(shapes[k], dims))
    return shapes


def local_buckets(plan, stage: int, captured, dp_rank: int = -1) -> list:
    """:func:`~fxpar.compress.feature.bucket_infos` of the rank's pieces (:func:`piece_shapes`): what a dp
    gradient bucket holds on each rank, and what the averaging all-reduces, under tensor parallelism one shard."""
    shapes = piece_shapes(plan, stage, captured)
    out = []
    for b in bucket_infos(plan, stage, captured, dp_rank):
        sh = tuple(shapes[k] for k in b.keys)
        offsets, off = [], 0
        for x in sh:
            offsets.append(off)
            off += int(torch.Size(x).numel())
        out.append(dataclasses.replace(b, shapes=sh, offsets=tuple(offsets), numel=off))
    return out


def hierarchy_group(size: int) -> str:
    """The name of the process groups of ``size`` consecutive dp replicas (hierarchical Local SGD)."""
    return f"sync_{size}"


def _hierarchy(m: SyncMethod, plan, cluster) -> SyncMethod:
    """Hierarchical Local SGD: its levels resolved for this plan's dp (``"node"``: the replicas on one node), and each
    level's groups of consecutive dp replicas added to the Plan's process groups (every rank creates them)."""
    if not getattr(m, "hierarchical", ()):
        return m
    if isinstance(m.hierarchical[0][0], str) and cluster is None:
        raise StrategyError(f"Strategy(sync={m.summary()}): the 'node' level needs the ClusterSpec's devices_per_node")
    per_node = max(1, cluster.devices_per_node // plan.tp) if cluster is not None else plan.dp
    levels = m.levels(plan.dp, min(per_node, plan.dp))
    for _, size in levels:
        if 1 < size < plan.dp:
            plan.groups[hierarchy_group(size)] = [list(g[i:i + size]) for g in plan.mesh.groups("dp")
                                                  for i in range(0, len(g), size)]
    return dataclasses.replace(m, hierarchical=levels)


def _async_groups(m: SyncMethod, plan) -> None:
    """Timed asynchronous averaging: the averaging loops' process groups (the dp groups, under a name of their own).
    DABMD's budget under tensor parallelism: each replica's tp ranks, who agree on the microbatches they take."""
    if isinstance(m, AsyncAveraging) and m.timed:
        plan.groups[ASYNC_GROUP] = [list(g) for g in plan.mesh.groups("dp")]
    if m.name == "dabmd" and plan.tp > 1 and not m.fixed_microbatches:
        plan.groups[REPLICA_GROUP] = DABMD.replica_groups(plan.dp, plan.tp)


def _check_tensor_parallel(m: SyncMethod, strategy) -> None:
    """The methods that average elementwise over dp compose with tensor parallelism inside a replica: each tp rank
    averages its own shards over its dp group (a replica's tp ranks all average after the same step's update, so
    the copies tp keeps whole stay equal; DABMD's tp ranks agree on each microbatch they take). Refused, with the
    reason, where a method needs more (DABMD's entropic map: its own check_strategy)."""
    me = f"Strategy(sync={m.summary()}, tp={strategy.tp})"
    if m.uses_servers:
        raise StrategyError(f"{me}: each parameter server holds whole parameter tensors, and a worker is one rank that "
                            "pushes the change of its whole replica and reads whole tensors back at its own clock; "
                            "tensor parallelism splits a replica over tp ranks, whose pushes and reads would have to "
                            "be one worker's. Train with tp=1, or use S.LocalSGD / S.DiLoCo / S.SlowMo with tp")
    if isinstance(m, AsyncAveraging) and m.timed:
        raise StrategyError(f"{me}: each rank's background loop snapshots its parameters between two updates at its "
                            "own moment, so the tp ranks of one replica would average after different steps: the "
                            "copies of the parameters tensor parallelism keeps whole on every tp rank (LayerNorm "
                            "weights, the row-parallel Linear's bias) would drift apart. Use "
                            f"S.AsyncAveraging(every_steps=k, warmup_steps={m.warmup_steps}) (every tp rank averages "
                            "after the same step) or tp=1")
    if getattr(m, "quantize", None):
        raise StrategyError(f"{me}: the {m.quantize.upper()} format scales each tensor by its largest magnitude, and "
                            "under tensor parallelism a rank holds a shard of a split tensor, so the scales and codes "
                            "would be the shards', not the whole tensor's; drop quantize (the fragments are "
                            "all-reduced unquantized) or train with tp=1")


def method_of(section: SyncSection) -> SyncMethod:
    return method_from_dict(section.method)


def _one_stage_per_rank(m: SyncMethod, plan) -> None:
    """A worker rank pushes and reads one stage: refuse schedules that put several stages on a rank."""
    held = {}
    for s, ranks in enumerate(plan.stage_to_rank):
        for r in ranks:
            held.setdefault(r, []).append(s)
    several = {r: ss for r, ss in held.items() if len(ss) > 1}
    if several:
        r, ss = next(iter(several.items()))
        raise StrategyError(f"Strategy(sync={m.summary()}) with schedule {plan.schedule!r}: pipeline rank {r} holds "
                            f"stages {ss}, and a worker rank pushes and reads the parameters of one stage; use a "
                            "schedule with one stage per rank (1f1b, gpipe, zb1p)")


def _stage_of_server(section: SyncSection, j: int) -> int:
    return section.server_stage[j] if j < len(section.server_stage) else 0


def sync_state(info: SyncInfo, rank: int):
    """The rank's state: an SSP / DSSP worker (:class:`SSPState`) for a method on parameter servers, a DABMD node
    (:class:`DABMDState`), the asynchronous averaging's (:class:`AsyncAveragingState`), else :class:`SyncState` (the
    averaging)."""
    if isinstance(info.sync, AsyncAveraging):
        return AsyncAveragingState(info, rank)
    if info.sync.name == "dabmd":
        return DABMDState(info, rank)
    return (SSPState if info.sync.uses_servers else SyncState)(info, rank)


def shard_keys(sizes: dict, k: int) -> list:
    """``k`` shards of the parameter keys (``sizes``: key -> elements): largest first to the least-filled shard,
    each shard's keys then in sorted order."""
    shards, fill = [[] for _ in range(k)], [0] * k
    for key in sorted(sizes, key=lambda x: (-sizes[x], x)):
        j = min(range(k), key=lambda i: (fill[i], i))
        shards[j].append(key)
        fill[j] += sizes[key]
    return [sorted(sh) for sh in shards]


class SyncFeature(Feature):
    name = FEATURE
    state_moves_in_sum = True
    doc = ("synchronisation methods: Local SGD (post-local SGD), DiLoCo (streaming too), SlowMo, BAGUA's asynchronous "
           "averaging, stale synchronous parallel (SSP, DSSP) on parameter servers, Distributed Any-Batch Mirror "
           "Descent (fxpar.sync)")
    options = {FEATURE: Option(None, (
        "when the dp replicas agree (``fxpar.sync``): ``S.LocalSGD(period=H, warmup_steps=W)``, "
        "``S.DiLoCo(period=H, outer=(torch.optim.SGD, {...}))``, ``S.SlowMo(period=H, slow_lr=a, slow_momentum=b)``, "
        "``S.DiLoCo(period=H, fragments=F, delay=tau)`` (streaming), ``S.AsyncAveraging(interval_s=s)``, "
        "``S.SSP(staleness=s)``, ``S.DSSP(low=a, high=b)`` (these two with ClusterSpec(cpu_servers=k)), "
        "``S.DABMD(round_time_s=t, mirror='euclidean', mixing='ring')``; "
        "None: every step's gradients are all-reduced"))}
    section = SyncSection
    requires = ("data_parallel",)
    conflicts_with = CONFLICTS
    state = staticmethod(sync_state)

    def method(self, strategy) -> SyncMethod:
        return strategy.option(FEATURE)

    def validate(self, strategy) -> None:
        m = self.method(strategy)
        if not isinstance(m, SyncMethod):
            raise StrategyError(f"Strategy(sync={m!r}): pass a method of fxpar.sync (S.LocalSGD(period=8), "
                                "S.DiLoCo(period=500), S.SlowMo(period=48), S.AsyncAveraging(interval_s=0.5)) or None")
        if strategy.dp < 2:
            raise StrategyError(f"Strategy(sync={m.summary()}) decides when the data-parallel replicas agree: it "
                                f"needs dp >= 2 (dp={strategy.dp}); set dp or drop sync")
        if hasattr(m, "check_strategy"):       # a method's own refusals, with its reasons (DABMD)
            m.check_strategy(strategy)
        g = strategy.option("grad_sync")
        if g != "allreduce":
            raise StrategyError(f"Strategy(sync={m.summary()}, grad_sync={g!r}): the sync method removes the gradient "
                                "all-reduce after its warm-up, and the grad_sync method would change that all-reduce; "
                                "they do not compose: drop one of them")
        if strategy.tp > 1:
            _check_tensor_parallel(m, strategy)
        if m.uses_servers and strategy.option("zero"):
            raise StrategyError(f"Strategy(sync={m.summary()}, zero={strategy.option('zero')!r}): ZeRO shards the "
                                "optimizer state over dp replicas that step together, while SSP's workers step at "
                                "their own clocks from their own reads; drop zero (each worker keeps its optimizer "
                                "state) or drop sync")
        if (strategy.pp > 1 or strategy.schedule is not None) and not m.uses_servers:
            raise StrategyError(f"Strategy(sync={m.summary()}, pp={strategy.pp}): each replica's parameters are "
                                "averaged after its one stage's update, which is built for pp=1; train with pp=1 or "
                                "drop sync (S.SSP and S.DSSP run over pipelines: each pipeline is one worker)")
        if m.uses_servers and any(getattr(f.section, "asynchronous", False) for f in enabled_features(strategy)):
            raise StrategyError(f"Strategy(sync={m.summary()}, schedule={strategy.schedule!r}): a worker's clock is one "
                                "flushed batch of its pipeline, and this schedule updates inside its window; use a "
                                "synchronous schedule (1f1b, gpipe) or drop sync")
        if m.uses_servers and strategy.schedule is not None and not isinstance(strategy.schedule, str):
            raise StrategyError(f"Strategy(sync={m.summary()}): a hand-written schedule does not run under parameter "
                                "servers; name one (schedule='1f1b')")

    def uses_server_ranks(self, strategy) -> bool:
        return self.enabled(strategy) and getattr(self.method(strategy), "uses_servers", False)

    def check_cluster(self, strategy, cluster) -> None:
        if cluster is None or not self.uses_server_ranks(strategy):
            return
        k = getattr(cluster, "cpu_servers", 0)
        if k < 1:
            m = self.method(strategy)
            raise StrategyError(f"Strategy(sync={m.summary()}): the staleness bound is kept by parameter-server ranks, "
                                "and this ClusterSpec has none (cpu_servers=0); pass "
                                f"ClusterSpec.local({cluster.world_size}, cpu_servers={max(1, strategy.pp)}) (or more "
                                "servers, each holding a shard of the parameters), or use S.LocalSGD")
        if k % strategy.pp:
            m = self.method(strategy)
            raise StrategyError(f"{strategy} with ClusterSpec(cpu_servers={k}): each "
                                "pipeline stage's parameters live on servers of their own, the same number per stage; "
                                f"give cpu_servers a multiple of pp (e.g. cpu_servers={strategy.pp})")

    def plan(self, strategy, plan, cluster):
        m = _hierarchy(self.method(strategy), plan, cluster)
        _note(plan, m)
        _async_groups(m, plan)
        section = SyncSection(method=m.to_dict())
        if m.uses_servers:
            _one_stage_per_rank(m, plan)
            k = getattr(cluster, "cpu_servers", 0) if cluster is not None else 0
            section.servers = list(range(plan.mesh.size, plan.mesh.size + k))
            if plan.mesh.size > plan.dp:       # pipelines: checkpoints are written over every worker, no dp group
                plan.groups[WORKERS_GROUP] = [list(range(plan.mesh.size))]
        return section

    def adopt(self, section, strategy, plan, cluster):
        m = _hierarchy(method_of(section), plan, cluster)
        _note(plan, m)
        _async_groups(m, plan)
        if m.uses_servers and cluster is not None:     # the servers are the cluster's
            k = getattr(cluster, "cpu_servers", 0)
            section.servers = list(range(plan.mesh.size, plan.mesh.size + k))
        return section

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        m = method_of(section)
        if isinstance(m, DiLoCo) and m.pattern == "strided":
            blocks = model_blocks(list(captured.param_shapes))
            if m.fragments > len(blocks):
                names = ", ".join(b or "<model>" for b, _ in blocks)
                raise StrategyError(f"Strategy(sync={m.summary()}): fragments={m.fragments} is more fragments than "
                                    f"the model has blocks ({len(blocks)}: {names}); a strided fragment holds whole "
                                    f"blocks: use fragments <= {len(blocks)} or pattern='sequential'")
        elif isinstance(m, DiLoCo) and m.fragments > len(captured.param_shapes):
            raise StrategyError(f"Strategy(sync={m.summary()}): fragments={m.fragments} is more fragments than the "
                                f"model has parameter tensors ({len(captured.param_shapes)}); each fragment holds "
                                f"whole tensors: use fragments <= {len(captured.param_shapes)}")
        g = GradientStep(warmup_steps=m.warmup_steps, period=m.period)
        rows = []
        # averagings per window of `span` steps: hierarchical Local SGD averages on every step some level's period
        # divides (the largest period's window), the others once per period
        levels = getattr(m, "hierarchical", ())
        span = max(p for p, _ in levels) if levels and not isinstance(levels[0][0], str) else m.period
        count = sum(m.group_at(t, levels) is not None for t in range(span)) if span != m.period else 1
        quantized = getattr(m, "quantize", None)
        for (at, _), b in zip(dp_bucket_indices(plan, stage), local_buckets(plan, stage, captured)):
            nbytes = b.numel * b.element_size
            sent = (m.wire_bytes([(int(torch.Size(sh).numel()), b.element_size) for sh in b.shapes])
                    if quantized else nbytes)
            row = {"bucket": at, "keys": list(b.keys), "numel": b.numel, "dtype": b.dtype, "plain_bytes": nbytes,
                   "window_bytes": sent, "wire_bytes": sent * count // span, "collectives": [],
                   "declared": [["all_gather" if quantized else "all_reduce", sent * count // span]]}
            if m.warmup_steps:
                row["first_step"] = {"wire_bytes": g.wire_bytes(b, ALLREDUCE), "collectives": []}
            rows.append(row)
        while len(section.stages) <= stage:
            section.stages.append([])
        section.stages[stage] = rows
        if m.uses_servers:
            self._plan_shards(section, m, captured, plan, stage)

    def _plan_shards(self, section, m: SyncMethod, captured, plan, stage: int) -> None:
        """SSP / DSSP: each server's shard of the stage's parameters (stage ``s`` of ``p`` on servers ``s k/p`` ..
        ``(s + 1) k/p - 1``); the stage's parameters in one dtype."""
        p, k = plan.n_stages, len(section.servers)
        if p > 1 and plan.tied:
            raise StrategyError(f"Strategy(sync={m.summary()}, pp={p}): parameter(s) {sorted(plan.tied)} are used by "
                                "several stages, whose servers would each keep their own copy; untie them or train "
                                "with pp=1")
        per = k // p
        if len(section.shards) != k:
            section.shards = [[] for _ in range(k)]
        section.server_stage = [j // per for j in range(k)]
        dtypes = {str(captured.param_dtypes[k]).replace("torch.", "") for k in captured.param_shapes}
        if len(dtypes) > 1:
            raise StrategyError(f"Strategy(sync={m.summary()}): each parameter server holds its shard as one flat "
                                f"buffer, and the model's parameters have dtypes {sorted(dtypes)}; cast the model to "
                                "one dtype (model.double() or model.float())")
        sizes = {k: int(torch.Size(sh).numel()) for k, sh in captured.param_shapes.items()}
        if per > len(sizes):
            where = f"stage {stage} has" if p > 1 else "the model has"
            raise StrategyError(f"Strategy(sync={m.summary()}): ClusterSpec(cpu_servers={k}) is {per} server(s) per "
                                f"stage, more than {where} parameters ({len(sizes)}); each server holds whole "
                                f"parameters: use at most cpu_servers={len(sizes) * p}")
        section.shards[stage * per:(stage + 1) * per] = shard_keys(sizes, per)

    def make_passes(self, section) -> list:
        return [(Slot.BUCKET_SUM, CompressedSum(FEATURE))]

    def _buckets(self, program, rank: int) -> list:
        dp_ranks = program.plan.group_of("dp", rank)
        me = list(dp_ranks).index(rank)
        return [b for s in program.plan.rank_stages(rank)
                for b in local_buckets(program.plan, s, program.stages[s].captured, me)]

    def rank_info(self, section, program, rank):
        buckets = self._buckets(program, rank)
        if not buckets:
            return None
        m = method_of(section)
        stages = program.plan.rank_stages(rank)
        mine = [j for j in range(len(section.servers)) if _stage_of_server(section, j) in stages]
        return SyncInfo(FEATURE, GradientStep(warmup_steps=m.warmup_steps, period=m.period), tuple(buckets),
                        tuple(program.plan.group_of("dp", rank)), sync=m,
                        servers=tuple(section.servers[j] for j in mine),
                        shards=tuple(tuple(section.shards[j]) for j in mine))

    def extra_ranks(self, section, program, host) -> list:
        """SSP / DSSP: one parameter server per ClusterSpec ``cpu_servers``, each starting from its shard of the
        program's parameters."""
        m = method_of(section)
        if not m.uses_servers:
            return []
        params = program.initial_params()
        plan = program.plan

        def workers(j: int) -> tuple:       # the ranks holding server j's stage, one per worker (dp order)
            return tuple(plan.group_of("dp", plan.stage_to_rank[_stage_of_server(section, j)][0] * plan.width)
                         if plan.stage_to_rank else plan.group_of("dp", 0))
        return [SSPServer(rank=r, index=j, workers=workers(j), keys=tuple(keys),
                          flat=torch.cat([params[k].detach().reshape(-1) for k in keys]), method=m.to_dict(),
                          groups=list(program.plan.all_groups()), host=host, n_servers=len(section.servers),
                          all_workers=tuple(range(plan.mesh.size)))
                for j, (r, keys) in enumerate(zip(section.servers, section.shards))]

    def extra_runner(self, payload, program):
        return SSPServerRunner(payload, program)

    def state_bytes(self, section, program, rank) -> int:
        """DiLoCo and SlowMo keep the parameters of the last averaging and one state tensor per parameter (the
        outer optimizer's momentum, the slow momentum); Local SGD keeps nothing beside the graphs."""
        m = method_of(section)
        if not m.keeps_anchor:
            return 0
        held = sum(b.numel * b.element_size for b in self._buckets(program, rank))
        return 2 * held

    def check_run(self, section, program, n_batches: int, resume_from) -> None:
        m = method_of(section)
        if hasattr(m, "check_program"):        # the parameters and optimizer a method's map needs (DABMD)
            m.check_program(program.initial_params(), program.optimizer)
        if resume_from is None and m.warmup_steps >= n_batches:
            warnings.warn(f"Strategy(sync={m.summary()}): warmup_steps={m.warmup_steps} covers the whole run of "
                          f"{n_batches} step(s), so every step all-reduces the gradients (plain data parallelism); "
                          "lower warmup_steps or train longer", UserWarning, stacklevel=3)

    def window(self, section, program, rank: int) -> list:
        """The averaging actions on the steps they happen, over the warm-up and one window of ``period`` steps:
        ``AVERAGE<stage>`` (the replicas' parameters all-reduced, its bytes), ``OUTER<stage>`` (the outer step:
        DiLoCo's optimizer, SlowMo's slow momentum), ``.<fragment>`` for streaming DiLoCo's fragments (the
        ``OUTER`` ``delay`` steps after its ``AVERAGE``); hierarchical Local SGD names the group size."""
        m = method_of(section)
        if m.uses_servers:
            return []
        stages = program.plan.rank_stages(rank)
        if not stages or not section.stages:
            return []
        levels = tuple(sorted(getattr(m, "hierarchical", ())))      # resolved by plan(): {period: group size}

        pieces = {s: piece_shapes(program.plan, s, program.stages[s].captured) for s in stages}

        def nbytes(s, keys=None):   # the rank's pieces of ``keys`` (under tensor parallelism its shards)
            cap = program.stages[s].captured
            keys = program.stages[s].param_keys if keys is None else keys
            return sum(int(torch.Size(pieces[s][k]).numel()) * cap.param_dtypes[k].itemsize for k in keys)

        def sent(s, keys):          # what one rank sends for ``keys``: quantized, their scales and 4-bit codes
            cap = program.stages[s].captured
            return m.wire_bytes([(int(torch.Size(pieces[s][k]).numel()), cap.param_dtypes[k].itemsize)
                                 for k in keys])

        total = sum(nbytes(s) for s in stages)
        head = f"sync {m.summary()}:"
        lines = []
        if m.warmup_steps:
            lines.append(f"  steps 0..{m.warmup_steps - 1} (warm-up): the step's gradient all-reduce, as plain data "
                         "parallelism")
        if isinstance(m, AsyncAveraging) and m.timed:
            return [f"{head} from step {m.warmup_steps} no step waits for another rank; every {m.interval_s} s "
                    f"AVERAGE{'/'.join(map(str, stages))} ({total} bytes) runs in the background, its snapshot and "
                    "its correction between two updates", *lines]
        period = max(p for p, _ in levels) if levels else m.period
        outer = m.keeps_anchor
        moved: dict = {}                     # step -> bytes its averagings all-reduce
        for t in range(m.warmup_steps, m.warmup_steps + period):
            acts = []
            for s in stages:
                if isinstance(m, DiLoCo) and m.streaming:
                    frags = m.fragment_keys(program.stages[s].param_keys)
                    for f, keys in enumerate(frags):
                        if m.fragment_averages(f, t):
                            words = (f"{sent(s, keys)} bytes all-gathered in {m.quantize.upper()}, {nbytes(s, keys)} "
                                     "unquantized" if m.quantize else f"{nbytes(s, keys)} bytes")
                            acts.append(f"AVERAGE{s}.{f} ({words})")
                            moved[t] = moved.get(t, 0) + sent(s, keys)
                        if m.fragment_averages(f, t - m.delay):
                            acts.append(f"OUTER{s}.{f}")
                elif m.averages(t):
                    group = m.group_at(t, levels) if levels else None
                    within = f" within groups of {group}" if group is not None and group < program.plan.dp else ""
                    acts.append(f"AVERAGE{s} ({nbytes(s)} bytes{within})")
                    moved[t] = moved.get(t, 0) + nbytes(s)
                    if outer:
                        acts.append(f"OUTER{s}")
            lines.append(f"  step {t}: {' '.join(acts) if acts else '-'}")
        window = sum(moved.values())
        counted = sum(row["wire_bytes"] for s in stages if s < len(section.stages) for row in section.stages[s])
        lines.insert(0, f"{head} the actions each step adds after its update, over one window of {period} step(s), "
                        f"then again every {period} steps; {window} bytes per rank per window ({window // period} per "
                        f"step on average, at most {max(moved.values(), default=0)} on one step; estimate() counts "
                        f"{counted} per step)")
        return lines

    def priced_calls(self, section, program, calls: dict, first):
        """A method whose steps differ by rank at run time prices them itself (DABMD: the microbatches each rank's
        speed admits within the round's budget); the others as lowered."""
        m = method_of(section)
        return m.priced_calls(program, calls, first) if hasattr(m, "priced_calls") else None

    def explain(self, section, program) -> list:
        m = method_of(section)
        lines = section.lines() + [f"method: {m.summary()}; {m.paper}"]
        if tp_words(program.plan):
            lines.append(tp_words(program.plan))
        if hasattr(m, "explain_lines"):
            return lines + m.explain_lines()
        if m.uses_servers:
            lines.append(f"every step each worker pushes (its optimizer step's change) / dp to the servers, which "
                         f"add it as it arrives; then {m.outer_words()}; a worker's own pushes are always in what "
                         "it reads")
            for j, (r, keys) in enumerate(zip(section.servers, section.shards)):
                at = f", stage {_stage_of_server(section, j)}" if len(set(section.server_stage)) > 1 else ""
                lines.append(f"parameter server {j} (rank {r}{at}): {len(keys)} parameter(s) ({', '.join(keys[:4])}"
                             f"{', ...' if len(keys) > 4 else ''})")
            return lines
        if isinstance(m, AsyncAveraging) and m.timed:
            lines.append(m.note_words().split(" -- ", 1)[1])
            return lines
        first = m.averaging_steps(m.warmup_steps + 3 * m.period + 1)
        lines.append(f"steps 0..{m.warmup_steps - 1} all-reduce the gradients (warm-up); " if m.warmup_steps else "")
        how = ("their pseudo-gradients all-gathered in 4 bits" if getattr(m, "quantize", None) else
               "the parameters are averaged (one all-reduce)")
        lines[-1] += (f"from step {m.warmup_steps} each replica steps alone; {how} after steps "
                      f"{', '.join(map(str, first))}, ... (t >= {m.warmup_steps} and "
                      f"(t - {m.warmup_steps}) % {m.period} == 0; 0 is the first step); then {m.outer_words()}")
        for s in range(len(section.stages)):
            for row in section.stages[s]:
                if getattr(m, "quantize", None):
                    lines.append(f"stage {s} bucket {row['bucket']}: {row['numel']} values ({row['dtype']}): no "
                                 f"gradient collective after the warm-up; its pseudo-gradients in "
                                 f"{m.quantize.upper()}, {row['window_bytes']} bytes per rank (unquantized "
                                 f"{row['plain_bytes']}), all-gathered once per window ({row['wire_bytes']} bytes per "
                                 f"step over a window of {m.period})")
                    continue
                lines.append(f"stage {s} bucket {row['bucket']}: {row['numel']} values ({row['dtype']}): no gradient "
                             f"collective after the warm-up; its parameters, {row['window_bytes']} bytes, all-reduced "
                             f"once per averaging ({row['wire_bytes']} bytes per step over a window of {m.period})")
        if isinstance(m, DiLoCo) and m.fragments > 1:
            for s, st in enumerate(program.stages):
                if s >= len(section.stages) or not section.stages[s]:
                    continue
                for f, keys in enumerate(m.fragment_keys(st.param_keys)):
                    held = (f"blocks {', '.join(b or '<model>' for b, _ in model_blocks(keys))}"
                            if m.pattern == "strided" else f"tensors {keys[0]} .. {keys[-1]}")
                    lines.append(f"stage {s} fragment {f} ({m.pattern}): {held} ({len(keys)} tensor(s))")
        return lines


register_feature(SyncFeature)
