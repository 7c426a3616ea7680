"""The planner: Strategy + model + cluster → Plan. It decides; passes carry the decisions out.

Decisions, in order: the schedule and its stage placement; the stage cuts (``passes.split_stages``'s
balanced search over module boundaries, or the user's split points, or an edited Plan's cuts); which
ranks sum which gradients (:func:`grad_groups`: the one place that knows). Each enabled feature
(``fxpar.features``) decides its own Plan section at the end (how those gradients are summed and in which
buckets is the ``data_parallel`` feature's, once each stage is captured).
"""
from __future__ import annotations

import copy

from .errors import StrategyError
from .feature import enabled_features, get_feature, registered_features
from .plan import Plan
from .schedule import Schedule, ScheduleError, get_schedule
from .schedule import ScheduleDeadlockError, ScheduleValidationError, ensure_reduce_grad, simulate, validate
from .capture import trace_forward
from passes.split_stages import imbalance_warning, split_stages
from .strategy import Strategy

__all__ = ["make_plan", "check_batch", "grad_groups", "build_schedule", "schedule_name", "ASYNC"]

ASYNC = ("pipedream", "2bw")


def check_batch(batch, dp: int, microbatches: int = 1, batch_dim: int = 0, names=None) -> int:
    """Return the global batch size; raise naming the tensor if dp x microbatches does not divide it.
    ``names``: how to call each tensor (default ``example_inputs[i]``)."""
    sizes = set()
    k = dp * microbatches
    for i, t in enumerate(batch):
        name = names[i] if names is not None and i < len(names) else f"example_inputs[{i}]"
        if t.dim() <= batch_dim:
            raise StrategyError(f"{name} has shape {tuple(t.shape)}: no batch dim {batch_dim} to split over dp={dp}; "
                                "give every tensor of the batch the batch on dim 0 (e.g. t.unsqueeze(0), or "
                                "t.expand(batch, ...) for a value shared by every row)")
        b = t.shape[batch_dim]
        if b % k:
            what = f"dp={dp}" if microbatches == 1 else f"dp={dp} x microbatches={microbatches} = {k}"
            raise StrategyError(
                f"{name} has batch {b} (shape {tuple(t.shape)}), which {what} does not divide: "
                f"use a global batch that is a multiple of {k} (e.g. {max(k, b - b % k)} or {b - b % k + k}), "
                "or change dp / microbatches.")
        sizes.add(b)
    if len(sizes) > 1:
        named = [(names[i] if names is not None and i < len(names) else f"example_inputs[{i}]", tuple(t.shape))
                 for i, t in enumerate(batch)]
        raise StrategyError(f"example_inputs have different batch sizes {sorted(sizes)} on dim {batch_dim} "
                            f"({', '.join(f'{n}: {sh}' for n, sh in named)}); every tensor of a batch must carry "
                            "the batch on the same dim: give them all the same number of rows on dim 0")
    return sizes.pop()


def build_schedule(plan: Plan, n_batches: int = 2, resumed: bool = False) -> Schedule:
    """The plan's schedule as IR. Asynchronous schedules cover ``n_batches`` batches in one window
    (``resumed``: a window that continues a checkpointed run, for 2BW's stashed version)."""
    if "\n" in plan.schedule:
        return ensure_reduce_grad(Schedule.parse(plan.schedule))
    name, p, m = plan.schedule, plan.pp, plan.microbatches
    if name == "pipedream":
        return get_schedule(name, p, m * n_batches)      # one update per microbatch, never flushed
    if name == "2bw":
        return get_schedule(name, p, m, n_batches=n_batches, resumed=resumed)
    return get_schedule(name, p, m)


def schedule_name(strategy: Strategy, base: Plan | None = None) -> str:
    """The schedule a program of ``strategy`` runs (a handed-in Plan's, if given): a name or a schedule's text."""
    return base.schedule if base is not None else _schedule_name(strategy)


def _schedule_name(strategy: Strategy) -> str:
    if strategy._custom_schedule:
        return str(strategy.schedule)
    if strategy.pp == 1:
        if strategy.schedule not in (None, "single"):
            raise StrategyError(f"{strategy}: schedule={strategy.schedule!r} needs a pipeline (pp > 1); with pp=1 "
                                "the step runs as one stage (microbatches > 1 accumulate gradients). Drop "
                                "schedule= or set pp.")
        return "single"
    return strategy.schedule or "1f1b"


def _check_custom(sched: Schedule, strategy: Strategy) -> None:
    pp, m = strategy.pp, strategy.microbatches
    if sched.n_ranks != pp or sorted(sched.actions) != list(range(pp)):
        raise StrategyError(f"{strategy}: the schedule lists ranks {sorted(sched.actions)}, but pp={pp} needs "
                            f"ranks 0..{pp - 1}; write one 'rank R:' line per pipeline rank or change pp.")
    if sched.n_microbatches != m:
        raise StrategyError(f"{strategy}: the schedule covers {sched.n_microbatches} microbatches but "
                            f"microbatches={m}; set Strategy(microbatches={sched.n_microbatches}).")
    if any(a.version is not None for acts in sched.actions.values() for a in acts):
        raise StrategyError(f"{strategy}: a hand-written schedule with weight versions (@v, asynchronous) is not "
                            "run yet: the runtime would need it to cover every batch of the run in one window. "
                            "Use schedule='pipedream' or '2bw', or drop the versions for a synchronous schedule.")
    try:
        validate(sched)
    except ScheduleValidationError as e:
        raise ScheduleValidationError([f"hand-written schedule {sched.name!r}: {q}" for q in e.problems]) from None
    try:
        simulate(sched)
    except ScheduleDeadlockError as e:
        raise ScheduleDeadlockError(f"{strategy}: hand-written {e}", e.stuck) from None


def grad_groups(plan: Plan) -> tuple:
    """Which ranks sum which gradients: ``(groups, per-stage {param key: group name or None})``.

    A stage's gradient is summed over every rank holding the stage (its dp replicas, and Chimera's
    second pipeline). A parameter several stages use (a tied LM head) is summed over every rank
    holding any of them, in one collective per rank: a rank holding two such stages sums them
    locally (the runtime keeps one accumulator per parameter and rank) and reduces the parameter in
    the first of its stages that uses it; the other stages' steps read that result."""
    dp, tp, width = plan.dp, plan.tp, plan.width
    groups: dict = {}
    per_stage = []

    def ranks_of(prs, t: int = 0) -> list:      # the holders of pipeline ranks ``prs`` at tp index t (a gradient
        return sorted({pr * width + d * tp + t for pr in prs for d in range(dp)})   # is summed at one tp index)
    for s, keys in enumerate(plan.stage_params):
        holders = ranks_of(plan.stage_to_rank[s])
        chosen = {}
        for k in keys:
            if k in plan.tied:
                ranks = ranks_of({pr for t in plan.tied[k] for pr in plan.stage_to_rank[t]})
                first = {min(t for t in plan.tied[k] if pr in plan.stage_to_rank[t]) for pr in plan.stage_to_rank[s]}
                if len(first) > 1:
                    raise StrategyError(f"parameter {k!r} is used by stages {plan.tied[k]}; the placement "
                                        f"{dict(enumerate(plan.stage_to_rank))} puts stage {s} on ranks that reduce it in "
                                        "different stages. Use a placement where every holder of a stage holds the "
                                        "same stages, or untie the parameter.")
                if len(ranks) > 1 and first == {s}:
                    groups[f"tied.{k}"] = [ranks_of({pr for t in plan.tied[k] for pr in plan.stage_to_rank[t]}, i)
                                           for i in range(tp)]
                    chosen[k] = f"tied.{k}"
                else:
                    chosen[k] = None
            elif len(holders) == 1:
                chosen[k] = None
            elif len(plan.stage_to_rank[s]) == 1:
                chosen[k] = "dp"
            else:
                groups[f"stage{s}"] = [ranks_of(plan.stage_to_rank[s], i) for i in range(tp)]
                chosen[k] = f"stage{s}"
        per_stage.append(chosen)
    return groups, per_stage


def make_plan(strategy: Strategy, batch, *, model=None, loss_fn=None, cluster=None, base: Plan | None = None,
              optimizer=None, layout=None):
    """Decide the program's structure. Returns ``(plan, schedule, forward_trace or None, stage split or None)``;
    the features' per-stage decisions (the gradient buckets ...) follow once the stages are captured
    (``Feature.plan_stage``). ``batch``: the flat tuple of tensors; ``layout`` (a ``BatchLayout``) gives it back its
    structure (keyword inputs) for tracing."""
    dp, pp = strategy.dp, strategy.pp
    plan = Plan(mesh_axes=[["pp", pp], ["dp", dp]])
    for f in enabled_features(strategy):       # the features' own mesh axes (a handed-back Plan's stay), fastest last
        plan.mesh_axes += f.mesh_axes(strategy, base.section(f.name) if base is not None else None)
    plan.schedule = schedule_name(strategy, base)
    plan.microbatches = base.microbatches if base is not None else strategy.microbatches
    plan.global_batch = check_batch(batch, dp, plan.microbatches)
    if optimizer is not None:
        plan.optimizer = {"name": optimizer.name, "traced": optimizer.traced, "why_not_traced": optimizer.why_not_traced}
        if optimizer.traced:      # how the traced update runs: one fused kernel, or torch._foreach_* ops
            kind = getattr(getattr(cluster, "device", None), "kind", "cpu")
            k, why = optimizer.kernel(kind, in_place=plan.schedule not in ASYNC)
            plan.optimizer.update({"kernel": k, "why_kernel": why})
            if k == "fused":
                plan.optimizer["hyper"] = optimizer.adam_hyper()
    plan.custom_passes = [p.name for p in strategy.passes]
    try:
        sched = build_schedule(plan)
    except ScheduleError as e:
        raise StrategyError(f"{strategy}: {e}") from e
    if "\n" in plan.schedule:
        _check_custom(sched, strategy)
    plan.stage_to_rank = [list(sched.stage_to_rank[s]) for s in range(sched.n_stages)]
    trace = split = None
    mb = plan.global_batch // (dp * plan.microbatches)
    if sched.n_stages > 1:
        micro = tuple(t.narrow(0, 0, mb) for t in batch)
        trace = trace_forward(model, layout.unflatten(micro) if layout is not None else micro, loss_fn)
        fpb = cluster.device.peak_flops / cluster.intra_node.bandwidth if cluster is not None else 0.0
        cuts = base.cuts if base is not None and base.cuts else strategy.split_points
        split = split_stages(trace.gm, trace.roles, sched.n_stages, cuts, trace.module_types, fpb)
        plan.cuts, plan.candidates = list(split.cuts), list(split.candidates)
        warn = imbalance_warning(split)
        if warn:
            plan.notes.append(warn)
        plan.stage_params = [list(st.params) for st in split.stages]
        plan.tied = {k: list(v) for k, v in split.shared_params.items()}
        if plan.schedule in ASYNC and plan.tied:
            raise StrategyError(f"schedule {plan.schedule!r} steps each stage at its own time, so a parameter shared by "
                                f"stages ({sorted(plan.tied)}: {plan.tied}) would get different versions in different "
                                "stages. Untie it, or use a synchronous schedule.")
    else:
        plan.stage_params = [[k for k, v in dict(model.named_parameters()).items() if v.requires_grad]]
    plan.groups, plan.grad_groups = grad_groups(plan)
    for f in registered_features():     # a ClusterSpec a feature cannot run on, or one asking for a feature that is off
        f.check_cluster(strategy, cluster)
    for f in registered_features():     # each enabled feature decides its section; a handed-back Plan's sections stay
        given = base.section(f.name) if base is not None else None
        if given is None and not f.enabled(strategy):
            continue
        section = (f.adopt(copy.deepcopy(given), strategy, plan, cluster) if given is not None
                   else f.plan(strategy, plan, cluster))
        if section is not None:
            plan.features[f.name] = section
    for name, section in plan.features.items():    # the actions the features add to the schedule
        sched = get_feature(name).plan_schedule(section, plan, sched)
    return plan, sched, trace, split
