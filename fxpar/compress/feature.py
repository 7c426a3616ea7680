"""Gradient compression as a Feature: one generic :class:`CompressFeature`, made and registered per method class
(:func:`register_method`), its Plan section and its pass.

``Strategy(dp=2, grad_sync=C.TopK(ratio=0.01))`` (or ``grad_sync="topk"``: the method's defaults) enables the
feature registered for ``TopK``. It:

* requires ``data_parallel``: it changes how data parallelism's gradient buckets are summed, nothing else;
* conflicts with ``zero`` (its buckets are reduce-scattered into shards, not summed whole), ``herring``,
  ``byteps`` and ``parallax`` (each sums the same buckets another way: hierarchically, through servers, as sparse
  pairs beside an all-reduce), ``bytescheduler`` (it cuts, reorders and credits the buckets' all-reduces, which
  are gone here) and ``tensor_parallel`` (the buckets would hold shards of tp-split weights, which a method's
  per-bucket math and its sizes do not know about);
* plans (:meth:`CompressFeature.plan`, then per stage once captured): the method's options, and per stage each
  bucket's keys, sizes, dtype, the bytes plain all-reduce hands over, the bytes the method hands over
  (``wire_bytes``) and the collectives its traced sum issues -- a :class:`CompressSection`, JSON round-trip; a
  handed-back Plan's section rebuilds the method (its options win over the Strategy's);
* places one pass in ``Slot.BUCKET_SUM`` (:class:`CompressedSum`): each bucket's ``all_reduce_`` and its
  ``wait_tensor`` become one call of :func:`fxpar.compress.runtime.bucket_sum`, whose result the gradients' views
  read where they read the all-reduced bucket;
* keeps per rank a :class:`fxpar.compress.runtime.CompressState` (state, step counters, generator; checkpointed);
* tells the cost models the wire bytes: the call carries ``fxpar_comm`` (its first collective's kind, the method's
  ``wire_bytes``, and where the sum issues several collectives each one's kind and bytes as ``parts``), so
  ``Program.collectives()`` counts it as one blocking collective of those bytes and ``estimate()`` costs each
  collective on its own (its latency terms, its algorithm) and adds them; ``state_bytes`` is the methods' state;
* explains each bucket: what is sent, how, and the bytes before and after.

Why a call and not the traced sum inlined into the joint graph: a method picks its graph per step on the host
(PowerSGD's ``start_iter``, Accordion's switch), makes host inputs each step (RandomK's draws), or runs as Python
(a DDP comm hook); one inlined graph carries one variant and no host step. The call runs the method's traced graph
(one per bucket and variant, its collectives bound to the rank's group), so the compress / collective / decompress
chain is still compiled; it runs where the all-reduce was issued -- in ``REDUCE_GRAD`` under microbatches (once per
step, after accumulation), in backward in the fused one-stage step -- synchronously: every rank calls its buckets'
sums in the same order, so the collectives keep one order across ranks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from cost_models.compute import eager_compute, inner_compute, merge_classes
from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.errors import PassError, StrategyError
from fxpar.feature import Feature, PlanSection, Slot, register_feature, unregister_feature
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import GraphKind

from .method import BucketInfo, Method
from .phases import piece_bytes, split_phases
from .runtime import CompressInfo, CompressState, bucket_sum, bucket_sum_wait, generator_for, kept_sum

__all__ = ["CompressFeature", "CompressSection", "CompressedSum", "register_method", "unregister_method",
           "registered_methods", "method_of", "CONFLICTS", "bucket_infos", "dp_bucket_indices"]

aten = torch.ops.aten

# the features a compression method does not compose with (module docstring: why each)
CONFLICTS = ("zero", "herring", "byteps", "parallax", "tensor_parallel")

_METHODS: dict = {}      # method name -> Method class


@dataclass
class CompressSection(PlanSection):
    """``method``: the method's options (``Method.to_dict()``: ``{"method": name, option: value}``); ``stages``:
    per stage, per bucket summed over dp ``{"bucket", "keys", "numel", "dtype", "plain_bytes", "wire_bytes",
    "collectives"}`` (its index among the ``data_parallel`` section's buckets of the stage; the bytes
    plain all-reduce and the method hand to collectives per rank and step, the method's at its first step; its
    traced sum's collectives ``[kind, bytes]`` in order, empty for an eager method, whose row has ``"declared"``
    instead: its :meth:`Method.collectives`, what the cost models count), filled once captured. ``schedule``: None
    (the sums in flight go FIFO), or ByteScheduler's settings on the compressed pieces (``comm_schedule=
    'bytescheduler'``): ``{"partition_bytes", "credit_bytes", "priority": per stage the buckets, first first}``, and
    then each row's ``"pieces"``: ``[kind, bytes]`` of every piece its collectives are sent in."""
    method: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    schedule: dict | None = None

    def lines(self) -> list:
        buckets = [b for st in self.stages for b in st]
        plain = sum(b["plain_bytes"] for b in buckets)
        wire = sum(b["wire_bytes"] for b in buckets)
        cls = _METHODS.get(self.method.get("method"))
        hidden = ("method",) + (cls.unshown if cls is not None else ())
        opts = ", ".join(f"{k}={v!r}" for k, v in self.method.items() if k not in hidden)
        head = f"gradient buckets compressed by {self.method.get('method')!r} ({opts})"
        if not buckets:
            return [head]
        out = [f"{head}: {len(buckets)} bucket(s), {wire} bytes per rank and step on the wire instead of {plain} "
               f"({wire / max(plain, 1):.3g}x)"]
        if self.schedule:
            sch = self.schedule
            out.append(f"  ByteScheduler on the compressed pieces: priority by layer (the first layers first), pieces "
                       f"of at most {sch['partition_bytes']} bytes, credit {sch['credit_bytes']} bytes")
        return out


def _note(plan, m: Method) -> None:
    plan.notes.append(f"grad_sync: {m.summary()} -- {m.plan_note()}")


def bucket_infos(plan, stage: int, captured, dp_rank: int = -1) -> list:
    """Stage ``stage``'s gradient buckets summed over dp (``plan.section("data_parallel").buckets``, less those of
    gradients summed over another group: a weight tied across pipeline stages), as :class:`BucketInfo`, numbered
    among themselves in issue order."""
    dp_buckets = [keys for _, keys in dp_bucket_indices(plan, stage)]
    out = []
    for i, keys in enumerate(dp_buckets):
        shapes = tuple(tuple(int(s) for s in captured.param_shapes[k]) for k in keys)
        offsets, off = [], 0
        for sh in shapes:
            offsets.append(off)
            off += int(torch.Size(sh).numel())
        dtype = str(captured.param_dtypes[keys[0]]).replace("torch.", "")
        out.append(BucketInfo(stage=stage, index=i, count=len(dp_buckets), keys=tuple(keys), shapes=shapes,
                              offsets=tuple(offsets), numel=off, dtype=dtype, dp=plan.dp, dp_rank=dp_rank))
    return out


def dp_bucket_indices(plan, stage: int) -> list:
    """``[(index among the data_parallel section's buckets of the stage, keys)]`` of the buckets summed over dp."""
    buckets = plan.section("data_parallel").buckets[stage]
    groups = plan.grad_groups[stage] if stage < len(plan.grad_groups) else {}
    return [(i, keys) for i, keys in enumerate(buckets) if all(groups.get(k, "dp") == "dp" for k in keys)]


# the step whose variant a plan shows and the cost models count: long after any method's start (its steady state)
STEADY_STEP = 1 << 30


def _sum_graph(method: Method, b: BucketInfo, variant, host: list | None = None) -> torch.fx.GraphModule:
    """``method``'s sum of ``b`` for ``variant``, traced here as dp rank 0 (kept: :func:`kept_sum`; read only).
    ``host``: a list that receives the compute of the method's host inputs (``cost_models.compute.eager_compute``:
    what a rank runs on the host at each sum's begin, beside the graph)."""
    b0 = dataclasses.replace(b, dp_rank=0)
    gen = generator_for(method)
    state = dict(method.init_state(b0, gen))
    inputs, cost = eager_compute(method.host_inputs, b0, 0, state, variant, gen)
    if host is not None:
        host.append(cost)
    return kept_sum(method, b0, variant, torch.zeros(b.numel, dtype=b.torch_dtype), state, list(inputs),
                    sorted(state))


def _traced_sum(method: Method, b: BucketInfo, variant) -> tuple:
    """``(collectives, compute, classes)``: ``[[kind, bytes], ...]``, the collectives ``method``'s sum of ``b``
    issues, ``[aten ops, flops, bytes]`` of its compute and ``[[op class, flops, bytes], ...]`` of it per op class
    (``cost_models.compute.inner_compute``; with the ops of its host inputs, which the rank makes at the sum's
    begin: ``cost_models.compute.eager_compute``), from its graph traced here (as dp rank 0; an eager method: nothing
    known before it runs)."""
    if method.eager:
        return [], [0, 0, 0], []
    host: list = []
    gm = _sum_graph(method, b, variant, host)
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional" \
                and n.target is not C10D.wait_tensor.default:
            kind = n.target._schema.name.split("::")[-1].rstrip("_")
            kind = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                    "all_to_all_single": "all_to_all"}.get(kind, kind)
            v = n.args[0].meta["val"]
            out.append([kind, int(v.numel() * v.element_size())])
    ops, flops, nbytes, classes = inner_compute(gm)
    h_ops, h_flops, h_bytes, h_classes = host[0]        # the host inputs, made at the sum's begin on the rank
    classes = merge_classes(classes, h_classes)
    return out, [ops + h_ops, flops + h_flops, nbytes + h_bytes], [list(c) for c in classes]


class CompressedSum(Pass):
    """Each data-parallel bucket's all-reduce, replaced by the method's sum.

    Before (one bucket)::

        empty = empty([n]); ... copy_(slot, grad) ...
        all_reduce_ = all_reduce_(empty, 'sum', 'fxpar:dp')              # issued after the bucket's last gradient
        ...
        wait_tensor = wait_tensor(all_reduce_); view = view(slice(wait_tensor, 0, 0, k), [...])

    After::

        empty = empty([n]); ... copy_(slot, grad) ...
        bucket_sum = fxpar.compress.runtime.bucket_sum(empty, 'topk', 0, 0)   # compress, collectives, decompress
        ...
        view = view(slice(bucket_sum, 0, 0, k), [...])
    """
    name = "compressed_sum"
    requires = ("bucket",)

    def __init__(self, feature: str):
        self.feature = feature

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section(self.feature)
        g = gm.graph
        ars = {M.get(n, M.BUCKET): n for n in g.nodes if n.op == "call_function"
               and n.target is C10D.all_reduce_.default and M.get(n, M.BUCKET) is not None
               and M.get(n, M.COMM).axis == "dp"}
        planned = section.stages[ctx.stage] if ctx.stage < len(section.stages) else []
        if sorted(ars) != [row["bucket"] for row in planned]:
            raise PassError(f"{self.name}: stage {ctx.stage} has dp buckets {sorted(ars)}, the Plan section "
                            f"{self.feature!r} planned {[row['bucket'] for row in planned]}: plan again (parallelize "
                            "without plan=)")
        ranks = ctx.plan.group_of("dp", ctx.rank)
        split = tuple(ctx.kinds) != (GraphKind.FULL,)     # several microbatches or a pipeline: REDUCE_GRAD sums
        for b, row in enumerate(planned):
            ar, info = ars[row["bucket"]], row
            buf = ar.args[0]
            val = buf.meta["val"]
            if val.numel() != info["numel"]:
                raise PassError(f"{self.name}: stage {ctx.stage} bucket {b} holds {val.numel()} values, the Plan "
                                f"section {self.feature!r} {info['numel']}: plan again (parallelize without plan=)")
            wait = next(u for u in ar.users if u.target is C10D.wait_tensor.default)
            src = buf
            div = next((u for u in wait.users if u.target is aten.div_.Tensor), None)
            if div is not None:          # a backward without the 1/dp seed: the bucket is divided before it is summed
                with g.inserting_before(ar):
                    src = g.call_function(aten.div.Tensor, (buf, div.args[1]))
                _stamp(src, ar, val)
            overlap = "declared" not in row        # a traced sum (an eager one declares its collectives): overlapped
            with g.inserting_before(ar):
                call = g.call_function(bucket_sum, (src, self.feature, ctx.stage, b),
                                       {"overlapped": True} if overlap else {})
            _stamp(call, ar, val)
            M.set_meta(call, M.BUCKET, row["bucket"])
            # each collective the sum issues is costed on its own (its latency terms, its algorithm)
            parts = row.get("pieces") or info["collectives"] or info.get("declared") \
                or [["all_reduce", info["wire_bytes"]]]
            parts = tuple((str(k), int(n)) for k, n in parts)
            M.set_meta(call, M.COMM, M.CommInfo(parts[0][0], "dp", tuple(ranks), int(info["wire_bytes"]),
                                                parts=parts if len(parts) > 1 else ()))
            ops, flops, nbytes = info.get("compute", (0, 0, 0))
            M.set_meta(call, M.INNER_COMPUTE, (int(ops), int(flops), int(nbytes),
                                               len(row.get("pieces") or info["collectives"]
                                                   or info.get("declared") or ()),
                                               tuple((str(k), int(f), int(n)) for k, f, n in
                                                     info.get("compute_classes", ()))))
            out = div if div is not None else wait
            if overlap:
                # the sum's last collectives are waited and its last phase runs where the all-reduce was waited (in
                # REDUCE_GRAD under microbatches, where the sum is issued: once per step, after accumulation);
                # wait_tensor marks for the cost models where the rank waits for the sum's collectives
                with g.inserting_before(wait):
                    w = g.call_function(C10D.wait_tensor.default, (call,))
                    done = g.call_function(bucket_sum_wait, (w, self.feature, ctx.stage, b))
                for n in (w, done):
                    _stamp(n, ar if split else wait, val)
                out.replace_all_uses_with(done)
            else:
                out.replace_all_uses_with(call)
            for dead in ([div] if div is not None else []) + [wait, ar]:
                g.erase_node(dead)
        g.lint()
        ctx.notes.append(f"{self.name}: {len(ars)} bucket(s) summed by {section.method.get('method')!r} (the method's "
                         "own sum: its collectives and the compute around them) where their all-reduce was")
        return PassResult(gm, bool(ars), {"buckets": len(ars)})


def _stamp(node, like, val) -> None:
    node.meta["val"] = val
    for k in (M.PHASE.name, M.MODULE.name, M.REDUCE_GRAD.name):
        if k in like.meta:
            node.meta[k] = like.meta[k]


class CompressFeature(Feature):
    """The feature of one compression method class (``method_cls``); :func:`register_method` makes one per class."""
    method_cls: type = Method
    section = CompressSection
    requires = ("data_parallel",)
    conflicts_with = CONFLICTS
    enabled_by = ("grad_sync",)
    state = CompressState
    state_moves_in_sum = True

    def enabled(self, strategy) -> bool:
        g = strategy.grad_sync
        # a registered subclass of a registered method (a name of its own) enables its own feature only
        return (isinstance(g, self.method_cls) and g.name == self.name) or (isinstance(g, str) and g == self.name)

    def method(self, strategy) -> Method:
        g = strategy.grad_sync
        return g if isinstance(g, self.method_cls) else self.method_cls()

    def validate(self, strategy) -> None:
        m = self.method(strategy)
        if strategy.dp < 2:
            raise StrategyError(f"Strategy(grad_sync={m!r}) compresses the gradient buckets summed over data-parallel "
                                f"ranks: it needs dp >= 2 (dp={strategy.dp}); set dp or drop grad_sync")
        m.check(strategy.dp)
        if getattr(strategy, "comm_schedule", "fifo") == "bytescheduler":
            _check_schedulable(m, strategy)

    def plan(self, strategy, plan, cluster):
        m = self.method(strategy)
        m.check_plan(plan)
        _note(plan, m)
        section = CompressSection(method=m.to_dict())
        if getattr(strategy, "comm_schedule", "fifo") == "bytescheduler":
            part = int((strategy.partition_mb or DEFAULT_PARTITION_MB) * 2**20)
            credit = int(strategy.credit_mb * 2**20) if strategy.credit_mb else CREDIT_PIECES * part
            section.schedule = {"partition_bytes": part, "credit_bytes": credit, "priority": []}
            plan.notes.append(
                f"comm_schedule (bytescheduler) on {m.name}'s compressed pieces: buckets by layer (the first layers "
                f"first), all-reduces and all-gathers cut in pieces of at most {part} bytes, at most {credit} bytes in "
                f"flight (fxpar/compress/inflight.py); all-to-alls and reduce-scatters sent whole (their pieces "
                "would each split among the ranks again)" + ("" if strategy.partition_mb and strategy.credit_mb else
                                            f"; partition and credit not tuned under compression: "
                                            f"{DEFAULT_PARTITION_MB} MiB and {CREDIT_PIECES} pieces unless given"))
        return section

    def adopt(self, section, strategy, plan, cluster):
        m = method_of(section)             # a handed-back section: its options are the ones that run
        m.check(plan.dp)
        m.check_plan(plan)
        _note(plan, m)
        return section

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        m = method_of(section)
        rows = []
        for (at, _), b in zip(dp_bucket_indices(plan, stage), bucket_infos(plan, stage, captured)):
            state = dict(m.init_state(b, generator_for(m)))
            # the steady state: the variant of a step long after the start (PowerSGD's start_iter, a warm-up ...)
            v = m.variant(b, STEADY_STEP, state)
            collectives, compute, classes = _traced_sum(m, b, v)
            row = {"bucket": at, "keys": list(b.keys), "numel": b.numel, "dtype": b.dtype,
                   "plain_bytes": b.numel * b.element_size, "wire_bytes": int(m.wire_bytes(b, v)),
                   "collectives": collectives, "compute": compute, "compute_classes": classes}
            if m.eager:              # not traced: the collectives the method declares, for the cost models
                row["declared"] = [[str(k), int(n)] for k, n in m.collectives(b, v)]
                counted = m.eager_sum_compute(b, v)
                like = m.priced_like(b, v) if counted is None else None
                if counted is not None:  # its compute: the ops its sum runs, counted
                    row["compute"] = [int(x) for x in counted[:3]]
                    row["compute_classes"] = [[str(k), int(f), int(n)] for k, f, n in counted[3]]
                elif like is not None:   # its compute: that of a traced method doing the same math
                    _, row["compute"], row["compute_classes"] = _traced_sum(like[0], b, like[1])
            if section.schedule:
                part = section.schedule["partition_bytes"]
                row["pieces"] = [[c.kind, n] for c in _phased(m, b, v).collectives for n in piece_bytes(c, part)]
            v0 = m.variant(b, 0, state)
            if v0 != v:              # the first steps sum another way: what they send
                row["first_step"] = {"wire_bytes": int(m.wire_bytes(b, v0)), "collectives": _traced_sum(m, b, v0)[0]}
                if m.eager:
                    row["first_step"]["declared"] = [[str(k), int(n)] for k, n in m.collectives(b, v0)]
            rows.append(row)
        while len(section.stages) <= stage:
            section.stages.append([])
        section.stages[stage] = rows
        if section.schedule is not None:          # the first layers' buckets first: the next forward needs them first
            order = list(captured.param_shapes)
            first = [min(order.index(k) for k in row["keys"]) for row in rows]
            prio = section.schedule["priority"]
            while len(prio) <= stage:
                prio.append([])
            prio[stage] = sorted(range(len(rows)), key=lambda i: (first[i], i))

    def make_passes(self, section) -> list:
        return [(Slot.BUCKET_SUM, CompressedSum(self.name))]

    def _buckets(self, section, program, rank: int) -> list:
        dp_ranks = program.plan.group_of("dp", rank)
        me = list(dp_ranks).index(rank)
        return [b for s in program.plan.rank_stages(rank)
                for b in bucket_infos(program.plan, s, program.stages[s].captured, me)]

    def rank_info(self, section, program, rank):
        buckets = self._buckets(section, program, rank)
        if not buckets:
            return None
        method_of(section).check_optimizer(program.optimizer)
        schedule = None
        if section.schedule:
            sch = section.schedule
            schedule = {"partition_bytes": sch["partition_bytes"], "credit_bytes": sch["credit_bytes"],
                        "priority": {(s, b): (s, at) for s, order in enumerate(sch["priority"])
                                     for at, b in enumerate(order)}}
        return CompressInfo(self.name, method_of(section), tuple(buckets), tuple(program.plan.group_of("dp", rank)),
                            schedule)

    def state_bytes(self, section, program, rank) -> int:
        m = method_of(section)
        gen = generator_for(m)
        return sum(t.numel() * t.element_size() for b in self._buckets(section, program, rank)
                   for t in m.init_state(b, gen).values())

    def explain(self, section, program) -> list:
        m = method_of(section)
        lines = section.lines() + [f"method: {m.summary()}" + (f"; {m.paper}" if m.paper else "")]
        for s in range(len(section.stages)):
            for b, row in zip(bucket_infos(program.plan, s, program.stages[s].captured), section.stages[s]):
                v = m.variant(b, STEADY_STEP, dict(m.init_state(b, generator_for(m))))
                coll = _collectives_words(row)
                lines.append(f"stage {s} bucket {b.index}: {b.numel} values ({b.dtype}), {row['plain_bytes']} bytes "
                             f"all-reduced plainly -> wire_bytes={row['wire_bytes']} ({coll})")
                first = row.get("first_step")
                if first is not None:        # the first steps (before a start_iter, a warm-up) send otherwise
                    coll0 = _collectives_words(first)
                    lines.append(f"  until the method starts: wire_bytes={first['wire_bytes']} ({coll0})")
                lines += [f"  {x}" for x in m.describe(b, v)]
        return lines


def _collectives_words(row: dict) -> str:
    """A plan row's collectives in words: the traced sum's, or those an eager method declares."""
    if row.get("collectives"):
        return ", ".join(f"{k} of {n} bytes" for k, n in row["collectives"])
    if row.get("declared"):
        return "run eagerly, as declared: " + ", ".join(f"{k} of {n} bytes" for k, n in row["declared"])
    return "collectives run eagerly"


DEFAULT_PARTITION_MB = 1      # ByteScheduler's piece under compression, unless partition_mb is given
CREDIT_PIECES = 4             # ... and its credit, in pieces, unless credit_mb is given


def _check_schedulable(m: Method, strategy) -> None:
    """Refuse what ByteScheduler cannot do with compressed bucket sums (``comm_schedule='bytescheduler'``)."""
    head = f"Strategy(grad_sync={m.summary()}, comm_schedule='bytescheduler')"
    if m.eager:
        raise StrategyError(f"{head}: {type(m).__name__}'s sum runs as Python (eager), so its collectives are not "
                            "pieces ByteScheduler can order, cut or credit; use comm_schedule='fifo'")
    if getattr(strategy, "delayed_update", False) or getattr(strategy, "cross_iteration", None):
        raise StrategyError(f"{head}, cross_iteration/delayed_update: a compressed bucket sum finishes in its step "
                            "(its residuals and factors feed the next step's sum), so its waits and update cannot "
                            "move into the next step; drop cross_iteration=True and delayed_update=True")
    if getattr(strategy, "grad_order", None) == "priority":
        raise StrategyError(f"{head}, grad_order='priority': backward's need order serves cross-iteration overlap, "
                            "which compressed sums do not run; drop grad_order")


def _phased(m: Method, b: BucketInfo, variant):
    """``m``'s sum of ``b`` for ``variant`` traced here (as dp rank 0) and cut into phases."""
    return split_phases(_sum_graph(m, b, variant), f"{type(m).__name__}.sum (stage {b.stage}, bucket {b.index})")


def method_of(section: CompressSection) -> Method:
    """The method a section's options describe."""
    name = section.method.get("method")
    cls = _METHODS.get(name)
    if cls is None:
        raise StrategyError(f"Plan section names compression method {name!r}, which no registered method carries "
                            f"out (registered: {sorted(_METHODS)}); import the module that registers it")
    return cls.from_dict(section.method)


def register_method(cls):
    """Register a :class:`Method` subclass (usable as a class decorator): makes and registers its
    :class:`CompressFeature`, named ``cls.name``, enabled by ``Strategy(grad_sync=cls(...))`` or
    ``grad_sync=cls.name`` (the method's defaults)."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register_method({cls!r}): pass a subclass of fxpar.compress.Method")
    if not cls.name or not cls.name.isidentifier():
        raise StrategyError(f"compression method {cls.__name__}: set `name` to an identifier (the grad_sync "
                            f"string and the feature's name); got {cls.name!r}")
    doc = (cls.__doc__ or "").strip().split("\n")[0]
    feat = type(f"Compress_{cls.__name__}", (CompressFeature,),
                {"name": cls.name, "method_cls": cls, "doc": f"{doc} {cls.paper}".strip(),
                 "__module__": cls.__module__, "__qualname__": f"Compress_{cls.__qualname__}",
                 "state": cls.rank_state or CompressState})
    register_feature(feat)
    _METHODS[cls.name] = cls
    return cls


def unregister_method(name: str) -> None:
    """Remove method ``name`` and its feature from the registries (a test's or a notebook's own method)."""
    _METHODS.pop(name, None)
    unregister_feature(name)


def registered_methods() -> dict:
    """Method name -> Method class, every registered compression method."""
    return dict(_METHODS)
