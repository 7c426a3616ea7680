"""ByteScheduler (Peng et al., SOSP'19) and ZeRO-Offload's one-step delayed update (Ren et al., ATC'21, §4.2).

ByteScheduler orders the gradient communication: buckets of at most ``partition_mb`` (a bigger single gradient cut
in row pieces), issued by priority (the order the next forward first uses their parameters) with at most
``credit_mb`` in flight, and -- where the program allows it -- each bucket's wait and update moved into the next
step, just before that bucket's first forward use (cross-iteration overlap). Under that overlap backward's own
gradient order is a decision too (``grad_order``). The delayed update (``delayed_update=True``) rides on the same
carry: step t's update applies step t-1's gradients, W(t+1) = W(t) - lr grad f(W(t-1)).

Everything the strategy is lives here or in its own modules:

* options: ``comm_schedule``, ``partition_mb``, ``credit_mb``, ``grad_order``, ``cross_iteration``,
  ``delayed_update`` (which implies ``comm_schedule="bytescheduler"``), validated in :meth:`ByteScheduler.validate`;
* the Plan section :class:`ByteSchedulerSection` (per stage: priority, pieces, issue events, backward's order and
  the predicted step times);
* planning: :meth:`ByteScheduler.plan` (whether the carry is possible) and :meth:`ByteScheduler.plan_stage`
  (partition, credit, priority, backward's order and whether to carry at all, simulated on
  ``cost_models.comm_tuning``);
* passes: ``passes.grad_order`` (GRAD_ORDER slot), ``passes.comm_schedule`` (COMM_ORDER slot), and after the split
  the carry's graphs (``passes.comm_schedule.carry_variants``: ``FIRST``/``DRAIN`` beside a fused ``FULL``;
  ``passes.carry_step.carry_forward``: ``F_UPDATE`` with split graphs);
* per-rank state :class:`Carry`: what a step hands the next (pieces not yet waited, LR and step count), run by its
  own ``FULL``/``STEP``/``F`` handlers on the stages it carries, and drained before results and checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cost_models.comm import collective_cost
from cost_models.comm_tuning import CreditError, plan_stage, slowest_for, stage_timings
from fxpar import meta as M
from fxpar.roles import GraphKind, Role
from fxpar.backward_order import reordered_backward, why_not_reorder
from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, RankState, Slot, register_feature
from fxpar.lower import graph_kinds
from fxpar.planner_comm import plan_buckets
from fxpar.schedule import ActionKind
from passes.fuse_optimizer import fused_chain_times
from passes.carry_step import carry_forward
from passes.comm_schedule import DRAIN, FIRST, F_UPDATE, CommSchedule, carry_variants
from passes.grad_order import GradOrder
from passes.split_graphs import SplitGraph

__all__ = ["ByteScheduler", "ByteSchedulerSection", "Carry", "plan_comm_schedule"]

_METHODS = ("fifo", "bytescheduler")
_REORDER_GAIN = 0.02      # reorder backward only when predicted at least 2% faster (it keeps dY tensors longer)
_CROSS_GAIN = 0.02        # carry waits and updates into the next step only when predicted at least 2% faster


@dataclass
class ByteSchedulerSection(PlanSection):
    """ByteScheduler's decisions. ``partition_bytes`` / ``credit_bytes``: as asked (None: tuned per stage);
    ``cross_iteration``: whether each step's waits and updates move into the next step (``why_not_cross_iteration``
    says why not; ``cross_iteration_asked``: the Strategy's setting); ``delayed_update``: ZeRO-Offload's DPU on the
    carry; ``synced``: whether any gradient is communicated (dp > 1 or parameters tied across stages); ``stages``:
    per stage its plan (``priority``, ``pieces``, ``events``, ``grad_order``, ``predicted_step_s`` ...)."""
    method: str = "bytescheduler"
    partition_bytes: int | None = None
    credit_bytes: int | None = None
    grad_order: str | None = None
    cross_iteration: bool = False
    cross_iteration_asked: bool | None = None
    why_not_cross_iteration: str = ""
    delayed_update: bool = False
    synced: bool = True
    bucket_sums: str = ""
    stages: list = field(default_factory=list)

    bucket_order = "ByteScheduler's order (priority, pieces, credit; see bytescheduler)"

    def lines(self) -> list:
        if self.bucket_sums:
            return [f"ByteScheduler on the compressed pieces of grad_sync={self.bucket_sums!r}: priority, pieces and "
                    "credit in that method's section"]
        mib = lambda v: "tuned per stage" if v is None else f"{v / 2**20:.3g} MiB"      # noqa: E731
        out = [f"ByteScheduler: partition {mib(self.partition_bytes)}, credit {mib(self.credit_bytes)}; "
               + ("each bucket's wait and update move into the next step, before its first forward use"
                  if self.cross_iteration else f"no cross-iteration overlap ({self.why_not_cross_iteration})")]
        if self.delayed_update:
            out.append("delayed update (ZeRO-Offload's DPU): each step's update applies the previous step's gradients")
        for s, e in enumerate(self.stages):
            if e.get("pieces"):
                go = e.get("grad_order") or {}
                out.append(f"  stage {s}: {len(e['pieces'])} piece(s), predicted step "
                           f"{e['predicted_step_s'] * 1e3:.3g} ms; backward order {go.get('mode', 'natural')}")
        return out


def _bucket_sums(strategy) -> str:
    """The gradient-compression method whose bucket sums take ByteScheduler's priority, pieces and credit (its
    name), or ''. Every other ``grad_sync`` method refuses ByteScheduler (``conflicts_with``), so a ``grad_sync``
    other than plain all-reduce that reaches here is a compression method."""
    g = getattr(strategy, "grad_sync", "allreduce")
    return "" if g in (None, "allreduce") else str(getattr(g, "name", g))


def _cross_iteration_why_not(strategy, plan, asynchronous: bool) -> str:
    held = [sum(pr in rs for rs in plan.stage_to_rank) for pr in range(plan.pp)]
    return ("Strategy(cross_iteration=False)" if strategy.cross_iteration is False else
            "dp=1: no gradient is communicated" if plan.dp == 1 else
            f"schedule {plan.schedule!r} is asynchronous: a stage steps inside the window, there is no next step's first "
            "forward to move it to" if asynchronous else
            f"schedule {plan.schedule!r} puts {max(held)} stages on one rank: a stage's update would have to wait for "
            "another stage's step on that rank (shared gradients, one step count)" if max(held, default=1) > 1
            else f"the optimizer is not traced ({plan.optimizer.get('why_not_traced')})" if not plan.optimizer.get("traced")
            else "")


def plan_comm_schedule(section: ByteSchedulerSection, plan, stage: int, captured, cluster, fused: bool = True) -> dict:
    """ByteScheduler's decisions for one stage (``cost_models.comm_tuning.plan_stage``): buckets of at most
    ``partition`` bytes (a bigger single gradient cut in row pieces), their priority (the order the next forward
    first uses them), the credit, and the issue plan simulated on the cost model, into ``section.stages[stage]``;
    the stage's buckets become those. Partition and credit left None are tuned on that simulation of this cluster;
    the grid tried and the predicted step times are recorded. With cross-iteration overlap on a fused stage
    (``fused``: one graph per step) the order backward makes the gradients is a decision too
    (``passes.grad_order``): natural, the next forward's need order, or natural for the first few then need order,
    whichever the simulation predicts fastest (``entry['grad_order']``)."""
    stages = section.stages
    if stage < len(stages):                       # decided already (a Plan handed back)
        return stages[stage]
    groups = plan.grad_groups[stage]
    names = sorted({g for g in groups.values() if g})
    if not names:
        stages.append({"priority": [], "pieces": [], "events": [], "predicted_step_s": None})
        return stages[-1]
    ranks = plan.group_of(names[0], plan.stage_to_rank[stage][0] * plan.width)
    # one plan for every rank of the stage: timed on the device whose compute of the step takes longest (a
    # heterogeneous cluster's slowest, stragglers folded in; the cluster's device where all are alike)
    device, times = slowest_for(captured.gm, cluster.devices_of(plan.stage_ranks(stage)))
    if (plan.optimizer or {}).get("kernel") == "fused":     # the update will run as one fused kernel per chain
        times = fused_chain_times(captured.gm, times, device, plan.optimizer)
    tm0 = stage_timings(captured.gm, captured.signature, device, times=times)
    why_not = _why_not_grad_order(section, plan, captured, fused)
    asked = section.grad_order
    if asked == "priority" and why_not:
        raise StrategyError(f"Strategy(comm_schedule='bytescheduler', grad_order='priority'), stage {stage}: backward's "
                            f"gradient order cannot be changed here: {why_not}. Use grad_order=None or 'natural'.")

    def tuned(tm, made, cross):          # ByteScheduler's tuning of this stage with backward making ``made`` in order
        return plan_stage(
            tm, lambda part: plan_buckets(captured, part, part, groups, made),
            lambda k: captured.param_shapes[k], lambda k: _itemsize(captured.param_dtypes[k]),
            lambda n: collective_cost("all_reduce", n, ranks, cluster).time_s, cross,
            plan.section("data_parallel").buckets[stage], section.partition_bytes, section.credit_bytes,
            shared=lambda keys: any(str(groups.get(k)).startswith("tied.") for k in keys), early=fused and cross)

    made_by = {}
    try:
        for label, mode, first, backward in _grad_order_candidates(captured, tm0, why_not, asked):
            tm = tm0 if backward is None else stage_timings(captured.gm, captured.signature, device, backward=backward,
                                                            times=times)
            made = sorted(tm["ready"], key=tm["ready"].__getitem__)
            entry, buckets = tuned(tm, made, bool(section.cross_iteration))
            entry["grad_order"] = {"mode": mode, "first": first, "keys": made if mode != "natural" else []}
            made_by[label] = (entry, buckets)
    except CreditError as e:
        keys = plan_buckets(captured, e.partition, e.partition, groups)[e.bucket]
        tied = str(groups.get(keys[0])).startswith("tied.") and not section.partition_bytes
        what = (f"gradient {keys[0]!r} (shape {tuple(captured.param_shapes[keys[0]])}) of a parameter tied across "
                "stages, kept whole unless partition_mb is given (every stage must cut it alike)" if tied else
                f"gradient {keys[0]!r} (shape {tuple(captured.param_shapes[keys[0]])}), cut in rows: a row is the "
                "indivisible piece" if len(keys) == 1 else
                f"bucket of {len(keys)} gradients {keys[:3]}... (packed up to the partition)")
        raise StrategyError(f"Strategy(comm_schedule='bytescheduler', credit_mb={section.credit_bytes / 2**20:.4g}), "
                            f"stage {stage}: the credit ({section.credit_bytes} bytes) is below the largest piece, "
                            f"{e.piece} bytes: the {what}, at partition {e.partition / 2**20:.4g} MiB. A piece must "
                            f"fit in the credit to be sent at all: raise credit_mb to at least {e.piece / 2**20:.4g}, "
                            "lower partition_mb, or leave credit_mb=None (tuned).") from None
    step = {label: e["predicted_step_s"] for label, (e, _) in made_by.items()}
    fastest = min(step, key=step.__getitem__)
    if "natural" in step and step[fastest] >= step["natural"] * (1 - _REORDER_GAIN):
        fastest = "natural"
    entry, buckets = made_by[fastest]
    entry["grad_order"]["tried"] = step
    if fused and section.cross_iteration and section.cross_iteration_asked is None \
            and not section.delayed_update and asked != "priority":
        within, within_buckets = tuned(tm0, sorted(tm0["ready"], key=tm0["ready"].__getitem__), False)   # every wait in its step
        if within["predicted_step_s"] <= entry["predicted_step_s"] * (1 + _CROSS_GAIN):
            section.cross_iteration = False
            section.why_not_cross_iteration = (
                f"the cost model predicts the step within {_CROSS_GAIN:.0%} as fast without it on this cluster "
                f"({within['predicted_step_s'] * 1e3:.3g} ms waiting every piece in its step vs "
                f"{entry['predicted_step_s'] * 1e3:.3g} ms carrying them into the next): cross-iteration overlap is "
                "not worth its cost here (Strategy(cross_iteration=True) forces it)")
            within["grad_order"] = {"mode": "natural", "first": 0, "keys": [], "tried": {"natural": within["predicted_step_s"]},
                                    "why_natural": "no cross-iteration overlap: the optimizer waits for every gradient at once"}
            within["cross_iteration_predicted_step_s"] = entry["predicted_step_s"]
            entry, buckets = within, within_buckets
            why_not = None
    if why_not:
        entry["grad_order"]["why_natural"] = why_not
    plan.section("data_parallel").buckets[stage] = buckets      # the stage's buckets become ByteScheduler's
    stages.append(entry)
    fifo = entry["fifo_predicted_step_s"]
    go = entry["grad_order"]
    plan.notes.append(f"comm_schedule (bytescheduler): stage {stage}: {len(buckets)} bucket(s), {len(entry['pieces'])} "
                      f"piece(s) of at most {entry['partition_bytes'] / 2**20:.3g} MiB, credit "
                      f"{entry['credit_bytes'] / 2**20:.3g} MiB ({entry['tuned']['partition']}/{entry['tuned']['credit']}); "
                      f"predicted step {entry['predicted_step_s'] * 1e3:.3g} ms"
                      + (f" vs FIFO buckets {fifo * 1e3:.3g} ms" if fifo else "")
                      + ("; gradient waits and updates move into the next step" if section.cross_iteration else
                         f"; no cross-iteration overlap: {section.why_not_cross_iteration}")
                      + (f"; backward makes the gradients in {go['mode']} order"
                         + (f" after the first {go['first']}" if go["mode"] == "hybrid" else "")
                         + " (predicted " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in go["tried"].items()) + ")"
                         if len(go["tried"]) > 1 else ""))
    return entry


def _why_not_grad_order(section: ByteSchedulerSection, plan, captured, fused: bool) -> str | None:
    """Why backward's gradient order is not a decision for this stage (None: it is)."""
    if not section.cross_iteration:
        return "no cross-iteration overlap: the optimizer waits for every gradient at once"
    if not fused:
        return ("the stage's gradients are reduced by REDUCE_GRAD after its last backward (a pipeline or several "
                "microbatches): the order backward makes them does not move their collectives")
    if plan.section("recompute") is not None or plan.section("offload_activations") is not None:
        return "recompute / activation offload place their copies by backward's order"
    if plan.tp > 1 or plan.section("zero") is not None:
        return "tensor parallelism and ZeRO place their collectives by backward's order"
    return why_not_reorder(captured.gm)


def _grad_order_candidates(captured, tm: dict, why_not: str | None, asked: str | None = None) -> list:
    """``(label, mode, first, backward nodes or None)``: natural; need order; natural for the first j then need
    order (j = a quarter, half and three quarters of the gradients). ``asked``: only that one."""
    out = [] if asked == "priority" else [("natural", "natural", 0, None)]
    if why_not or asked == "natural":
        return out
    natural = sorted(tm["ready"], key=tm["ready"].__getitem__)
    need = sorted(tm["ready"], key=lambda k: (tm["need"].get(k, float("inf")), natural.index(k)))
    n = len(natural)
    for first in sorted({0} if asked else {0, n // 4, n // 2, (3 * n) // 4} - {n}):
        keys = natural[:first] + [k for k in need if k not in natural[:first]]
        mode = "priority" if first == 0 else "hybrid"
        out.append((f"{mode}" + (f"@{first}" if first else ""), mode, first, reordered_backward(captured.gm, keys)))
    return out


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- the carry at run time ----------------------------------------------------------------------------------
class Carry(RankState):
    """What a step hands the next on this rank, per carried stage (``info``: stage -> ``GraphKind.FULL`` or
    ``GraphKind.STEP``, the graph whose update it carries).

    ``FULL`` (one stage, one microbatch): the stage's graphs are ``FIRST`` (the first step: nothing carried, no
    update), ``FULL`` (the steady step: ``(Role.CARRY, piece)`` inputs and outputs, with the previous step's LR and
    count) and ``DRAIN`` (only the carried waits and update); ``FIRST``, ``DRAIN`` and ``F_UPDATE`` are the carry's
    own graph kinds (``passes.comm_schedule``). ``STEP`` (split graphs: a pipeline, or several
    microbatches): the ``STEP`` action keeps its inputs (the pieces ``REDUCE_GRAD`` issued, the summed gradients, LR
    and count), the stage's first ``F`` of the next step runs ``F_UPDATE`` (the update, bucket by bucket, inside that
    forward), and :meth:`drain` runs the kept ``STEP``. Stages it does not carry run the executor's own handlers."""

    def __init__(self, info, rank):
        super().__init__(info, rank)
        self.carry: dict = {}            # stage -> {"pieces" | Role.GRAD/Role.PENDING, Role.LR, Role.STEP}

    def handlers(self, ex) -> dict:
        base = dict(ex.handlers)

        def full(a, w, idx):
            return self._full(ex, a, w) if self.info.get(a.stage) == GraphKind.FULL else base[ActionKind.FULL](a, w, idx)

        def step(a, w, idx):
            if self.info.get(a.stage) == GraphKind.STEP:
                return self._defer_step(ex, a, w)
            return base[ActionKind.STEP](a, w, idx)

        def forward(a, w, idx):
            s, i = a.stage, a.microbatch
            if self.info.get(s) != GraphKind.STEP or s not in self.carry:
                return base[ActionKind.F](a, w, idx)
            acts = {k: v.contiguous() for k, v in w.fwd.pop((s, i), {}).items()}   # as traced (and as received)
            sg, args, res = self._forward_update(ex, s, w, w.micro[i], acts)     # the last step's STEP, in this F
            ex._forward_outputs(a, w, sg, args, res, ex.params[s])
        return {ActionKind.FULL: full, ActionKind.STEP: step, ActionKind.F: forward}

    def _scalars(self, ex, s) -> dict:
        return {Role.LR: torch.tensor(float(ex.torch_opt.param_groups[0]["lr"]), dtype=torch.float64),
                Role.STEP: torch.tensor(float(ex.step_count[s]), dtype=torch.float64)}

    def _full(self, ex, a, w):
        """``FULL`` with ``("carry", piece)`` inputs and outputs: waits for and applies the previous step's update
        (with that step's LR and count) before each parameter's first forward use, then trains this step and
        hands its pieces on. The first step (nothing carried) runs ``FIRST``; :meth:`drain` runs ``DRAIN``."""
        s, i = a.stage, a.microbatch
        carry = self.carry.pop(s, None)
        sg = ex.p.graphs[s][GraphKind.FULL if carry else FIRST]
        ex.step_count[s] += 1
        now = self._scalars(ex, s)
        ex._note_state_bytes(w, s)
        res = sg.gm(*self._args(ex, sg, s, carry, w.micro[i]))
        pieces = {}
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.LOSS:
                w.loss_sums[i // w.per_batch] += float(v)
            elif role == Role.CARRY:
                pieces[key] = v
            else:
                ex.take_output(s, role, key, v)
        self.carry[s] = {"pieces": pieces, **now}
        ex._settle(s)

    def _args(self, ex, sg, s, carry, mb, acts=None) -> list:
        args = []
        for role, key in sg.inputs:
            if role == Role.OPT_STATE:
                args.append(ex.state[s][key])
            elif role in (Role.LR, Role.STEP):
                args.append(carry[role])
            elif role == Role.CARRY:
                args.append(carry["pieces"][key])
            elif role in (Role.GRAD, Role.PENDING):
                args.append(carry[role][key])
            else:
                args.append(ex._input(role, key, s, ex.params[s], mb, acts or {}))
        return args

    def _defer_step(self, ex, a, w) -> None:
        """STEP with ``F_UPDATE``: keep what the update reads -- the collectives REDUCE_GRAD started (not waited), the
        summed gradients, this step's LR and count -- for the stage's first forward of the next step (``F_UPDATE``)
        or :meth:`drain` (which runs ``STEP`` itself)."""
        s = a.stage
        ex.step_count[s] += 1
        pend = w.pending.pop(s, {})
        kept = {**self._scalars(ex, s), Role.GRAD: {}, Role.PENDING: pend}
        for role, key in ex.p.graphs[s][GraphKind.STEP].inputs:
            if role == Role.GRAD:
                kept[Role.GRAD][key] = ex._step_grad(w, s, key)
            elif role == Role.PENDING and key not in pend:
                raise RuntimeError(f"rank {ex.rank}: STEP{s} waits on a gradient collective ({key}) that no RG{s} "
                                   f"started in this step: put RG{s} after the stage's last backward and before STEP{s} "
                                   "in the schedule (fxpar.schedule.ensure_reduce_grad adds it).")
        self.carry[s] = kept

    def _forward_update(self, ex, s, w, mb, acts):
        """The stage's first F of a step after a deferred STEP: ``F_UPDATE`` waits for the previous step's pieces and
        applies its update bucket by bucket, each just before the first forward op on those parameters, and runs
        the forward on the new parameters. Returns ``(graph, arguments, results)``."""
        carry = self.carry.pop(s)
        sg = ex.p.graphs[s][F_UPDATE]
        ex._note_state_bytes(w, s)
        args = self._args(ex, sg, s, carry, mb, acts)
        res = sg.gm(*args)
        _take_update(ex, s, sg, res)
        return sg, args, res

    def drain(self, ex) -> None:
        """Collective (every rank of the stage): wait for the pieces carried out of the last step and apply its
        update (``DRAIN``, or the kept ``STEP``), so parameters and optimizer state are those of single-process
        training. The next step starts afresh (``FIRST``)."""
        for s, carry in sorted(self.carry.items()):
            if Role.PENDING in carry:        # split graphs: the deferred STEP itself
                sg = ex.p.graphs[s][GraphKind.STEP]
                _take_update(ex, s, sg, sg.gm(*self._args(ex, sg, s, carry, None)))
                continue
            sg = ex.p.graphs[s][DRAIN]
            res = sg.gm(*self._args(ex, sg, s, carry, None))
            for (role, key), v in zip(sg.outputs, res):
                ex.take_output(s, role, key, v)
            ex._settle(s)
        self.carry = {}


def _take_update(ex, s, sg, res) -> None:
    new = dict(ex.params[s])           # a new dict: a window may still hold the old one
    for (role, key), v in zip(sg.outputs, res):
        if role == Role.NEW_PARAM:
            new[key] = v
        elif role == Role.NEW_OPT_STATE:
            ex.state[s][key] = v
    ex.params[s] = new
    ex._settle(s)


# ---- the feature ---------------------------------------------------------------------------------------------
@register_feature
class ByteScheduler(Feature):
    name = "bytescheduler"
    doc = ("gradient communication by priority, in pieces under a credit, waits and updates carried into the next "
           "step (Peng et al., SOSP'19); ZeRO-Offload's one-step delayed update on the carry (Ren et al., ATC'21)")
    options = {
        "comm_schedule": Option("fifo", (
            "the order gradient communication goes in: ``'fifo'`` (DDP-style buckets as backward makes them) or "
            "``'bytescheduler'`` (Peng et al., SOSP'19: pieces of at most ``partition_mb``, the layer the next "
            "forward needs first goes first, at most ``credit_mb`` in flight, and -- dp > 1, a traced optimizer, a "
            "synchronous schedule with one stage per rank, pipelines and microbatches included -- each bucket's "
            "wait and update move into the next step, before its first use there).")),
        "partition_mb": Option(None, "ByteScheduler's piece size, in MiB; None: chosen by the cost model's "
                                     "simulation of the cluster (recorded in the Plan's ``bytescheduler`` section)."),
        "credit_mb": Option(None, "ByteScheduler's bytes in flight, in MiB; None: chosen by the cost model's "
                                  "simulation of the cluster (recorded in the Plan's ``bytescheduler`` section)."),
        "grad_order": Option(None, (
            "under ByteScheduler's cross-iteration overlap, the order backward makes the gradients "
            "(``passes/grad_order.py``): ``'natural'`` (as traced), ``'priority'`` (the next forward's need order: "
            "the input gradients first, then each layer's weight gradients, first layers first), or None: the cost "
            "model simulates natural, priority and mixes of the two and keeps the fastest (natural unless 2% "
            "faster).")),
        "cross_iteration": Option(None, (
            "under ByteScheduler, whether each step's gradient waits and updates move into the next step: True "
            "wherever the program allows it (dp > 1, a traced optimizer, a synchronous schedule with one stage per "
            "rank), False never (the issue plan then orders the pieces within the step), None: as True, except that "
            "on a fused step (one stage, one microbatch) the cost model decides -- without it where the simulation "
            "predicts the step within 2% as fast that way (on full CPU cores an overlapped transfer costs the "
            "compute more CPU than a waited one, so a fast link's gradients are better waited; the Plan says so).")),
        "delayed_update": Option(False, (
            "ZeRO-Offload's one-step delayed parameter update (Ren et al., ATC'21, §4.2): step t's update is "
            "computed from step t-1's gradients while step t's forward and backward run on the parameters before "
            "it, W(t+1) = W(t) - lr·grad f(W(t-1)) (PipeDream-2BW's rule), so the optimizer overlaps the next step "
            "entirely. Not synchronous SGD: it changes the math (no warm-up steps here). Rides on ByteScheduler's "
            "carry (``comm_schedule='bytescheduler'`` is implied): dp > 1, one stage, one microbatch, traced "
            "optimizer. With ``zero=1|2|3`` the carry is each bucket's reduce-scattered gradient chunk, and the "
            "delayed update runs on chunks (ZeRO-Offload's layout: ``offload=('optimizer',)``).")),
    }
    section = ByteSchedulerSection
    state = Carry

    def settle(self, strategy):
        if not isinstance(strategy.delayed_update, bool):
            raise StrategyError(f"Strategy(delayed_update={strategy.delayed_update!r}): True (each step's update is "
                                "carried into the next) or False (the default)")
        if strategy.delayed_update:
            if strategy.dp == 1 or strategy.pp > 1 or strategy.microbatches > 1:
                raise StrategyError(f"Strategy(delayed_update=True) with dp={strategy.dp}, pp={strategy.pp}, microbatches="
                                    f"{strategy.microbatches}: the delayed update is built for data parallelism (dp > 1, "
                                    "with or without ZeRO), one stage, one microbatch")
            strategy.comm_schedule = "bytescheduler"     # the update crosses the step boundary on ByteScheduler's carry

    def validate(self, s):
        if s.comm_schedule not in _METHODS:
            raise StrategyError(f"Strategy(comm_schedule={s.comm_schedule!r}): choose one of {_METHODS} ('fifo': "
                                "DDP-style buckets in backward order; 'bytescheduler': priority, partitions, credit and "
                                "cross-iteration overlap, passes/comm_schedule.py)")
        for name in ("partition_mb", "credit_mb"):
            v = getattr(s, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise StrategyError(f"Strategy({name}={v!r}): a positive number of MiB, or None (tuned by the cost model)")
            if s.comm_schedule != "bytescheduler":
                raise StrategyError(f"Strategy({name}={v!r}) is a ByteScheduler setting: add comm_schedule='bytescheduler' "
                                    "or drop it")
        if s.grad_order is not None:
            if s.grad_order not in ("natural", "priority"):
                raise StrategyError(f"Strategy(grad_order={s.grad_order!r}): choose 'natural', 'priority', or None "
                                    "(the cost model chooses)")
            if s.comm_schedule != "bytescheduler":
                raise StrategyError(f"Strategy(grad_order={s.grad_order!r}) is a ByteScheduler setting (the order "
                                    "backward makes the gradients it sends): add comm_schedule='bytescheduler' or drop it")
        if s.cross_iteration is not None:
            if not isinstance(s.cross_iteration, bool):
                raise StrategyError(f"Strategy(cross_iteration={s.cross_iteration!r}): True, False, or None (the cost "
                                    "model decides)")
            if s.comm_schedule != "bytescheduler":
                raise StrategyError(f"Strategy(cross_iteration={s.cross_iteration!r}) is a ByteScheduler setting (each "
                                    "step's gradient waits and updates moved into the next step): add "
                                    "comm_schedule='bytescheduler' or drop it")
            if not s.cross_iteration and s.delayed_update:
                raise StrategyError("Strategy(delayed_update=True, cross_iteration=False): the delayed update carries each "
                                    "step's update into the next step, which is cross-iteration: drop cross_iteration")
            if not s.cross_iteration and s.grad_order == "priority":
                raise StrategyError("Strategy(grad_order='priority', cross_iteration=False): backward's need order serves "
                                    "the next step's forward, which only cross-iteration overlap waits on: drop one of them")
        if s.comm_schedule == "bytescheduler" and getattr(s, "zero", 0):
            if not getattr(s, "delayed_update", False):
                raise StrategyError(f"Strategy(comm_schedule='bytescheduler', zero={s.zero}): ByteScheduler's priority, "
                                    "partitions and credit order all-reduce buckets and are not yet composed with ZeRO's "
                                    "reduce-scatter; use ZeRO with comm_schedule='fifo' (delayed_update=True does compose "
                                    "with ZeRO: it carries each bucket's reduce-scattered gradient chunk)")
            if s.partition_mb is not None or s.credit_mb is not None:
                raise StrategyError(f"Strategy(zero={s.zero}, delayed_update=True, partition_mb={s.partition_mb}, "
                                    f"credit_mb={s.credit_mb}): partitions and credit are ByteScheduler's, for "
                                    "all-reduce pieces; under ZeRO the carried pieces are its reduce-scatter buckets "
                                    "(bucket_cap_mb): drop partition_mb and credit_mb")

    def plan(self, strategy, plan, cluster):
        """The method, the partition and credit asked for (None: tuned per stage in :meth:`plan_stage`), and whether
        the gradient waits and updates move into the next step (cross-iteration overlap: dp > 1, a traced
        optimizer, a synchronous schedule whose ranks hold one stage each; with a pipeline or several microbatches,
        each stage's STEP moves into the next step's first forward of that stage)."""
        sums = _bucket_sums(strategy)
        why = (f"grad_sync={sums!r}: each compressed bucket sum finishes in its step" if sums else
               _cross_iteration_why_not(strategy, plan, asynchronous=plan.asynchronous))
        mb = lambda v: None if v is None else int(v * 2**20)      # noqa: E731
        section = ByteSchedulerSection(
            method=strategy.comm_schedule, partition_bytes=mb(strategy.partition_mb),
            credit_bytes=mb(strategy.credit_mb), grad_order=strategy.grad_order, cross_iteration=not why,
            cross_iteration_asked=strategy.cross_iteration, why_not_cross_iteration=why,
            synced=plan.dp > 1 or any(g for gg in plan.grad_groups for g in gg.values()), bucket_sums=sums)
        if strategy.delayed_update:
            if why:
                raise StrategyError(f"{strategy}: delayed_update=True carries each step's update into the next, which "
                                    f"is not possible here: {why}")
            section.delayed_update = True
            plan.notes.append("delayed_update: each step computes with the parameters before the previous step's "
                              "update, which runs after its backward (ZeRO-Offload's DPU; W(t+1) = W(t) - lr grad f(W(t-1)))")
            zero = plan.section("zero")
            if zero is not None:       # ZeRO's reduce-scatter buckets are the carried pieces: no piece plan
                section.stages = [{"priority": [], "pieces": [], "events": [], "predicted_step_s": None,
                                   "zero": zero.stage} for _ in range(plan.n_stages)]
                plan.notes.append(f"delayed_update with zero={zero.stage}: each bucket's reduce-scattered gradient chunk "
                                  "is carried into the next step, whose update runs on chunks after its backward")
        return section

    def plan_stage(self, section, plan, stage, captured, cluster, schedule):
        if section.bucket_sums:        # the compression method's sums order, cut and credit their own pieces
            section.stages.append({"priority": [], "pieces": [], "events": [], "predicted_step_s": None})
            return
        plan_comm_schedule(section, plan, stage, captured, cluster,
                           fused=graph_kinds(schedule, stage) == (GraphKind.FULL,))

    def make_passes(self, section):
        if not section.synced or section.bucket_sums:
            return []
        # GRAD_ORDER: backward makes the gradients in the planned order, which every later pass then follows;
        # COMM_ORDER (after bucket): pieces of its buckets issued by priority under a credit; with cross-iteration
        # the waits and updates move into the next step's forward
        return [(Slot.GRAD_ORDER, GradOrder()), (Slot.COMM_ORDER, CommSchedule(cross_iteration=section.cross_iteration))]

    def replaces(self, section):
        # under cross-iteration overlap the graphs are cut by data flow after the split (FIRST, DRAIN, F_UPDATE),
        # which an in-place update would hide: the carry makes the update in place itself
        return ("reinplace_optimizer",) if section.cross_iteration else ()

    def after_split(self, section, parts, joint, ctx):
        sig = joint.meta[M.SIGNATURE.name]
        if set(parts) == {GraphKind.FULL} and joint.meta.get(M.CARRY.name):      # the first step, and the drain
            return {k: SplitGraph(k, *v) for k, v in carry_variants(joint, sig).items()}
        need = joint.meta.get(M.CARRY_STEP.name)
        if need:                       # STEP runs in the next step's first F
            parts = dict(parts)
            parts.update(carry_forward(parts[GraphKind.F], parts[GraphKind.STEP], need,
                                       joint.meta.get(M.OPTIMIZER.name)))
        return parts

    def rank_info(self, section, program, rank):
        carried = {}
        for s in program.plan.rank_stages(rank):
            kinds = program.stages[s].graphs
            if DRAIN in kinds:
                carried[s] = GraphKind.FULL
            elif F_UPDATE in kinds:
                carried[s] = GraphKind.STEP
        return carried or None
