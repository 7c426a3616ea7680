"""The planner: Strategy + model + cluster → Plan. It decides; passes carry the decisions out.

Decisions, in order: the schedule (the pipeline schedule feature the Strategy enables, ``fxpar/features/pipeline*``,
or the one-stage program) and its stage placement; the stage cuts (the schedule feature's ``cut_stages``: the
balanced search over module boundaries, the user's split points, or an edited Plan's cuts); which
ranks sum which gradients (:func:`grad_groups`: the one place that knows). Each enabled feature
(``fxpar.features``) decides its own Plan section at the end (how those gradients are summed and in which
buckets is the ``data_parallel`` feature's, once each stage is captured).
"""
from __future__ import annotations

import copy

from .errors import StrategyError
from .feature import enabled_features, get_feature, registered_features, schedule_features
from .plan import Plan
from .schedule import Schedule, ScheduleError, single
from .strategy import Strategy

__all__ = ["make_plan", "check_batch", "grad_groups", "build_schedule", "schedule_feature", "is_asynchronous",
           "grad_scale"]


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


def schedule_feature(plan: Plan) -> tuple:
    """``(feature, section)`` of the pipeline schedule feature that picked ``plan``'s schedule, or ``(None, None)``:
    the one-stage program."""
    for name, section in plan.features.items():
        if section.picks_schedule:
            return get_feature(name), section
    return None, None


def build_schedule(plan: Plan, n_batches: int = 2, resumed: bool = False) -> Schedule:
    """The plan's schedule as IR, from its pipeline schedule feature (``single``, the one-stage program, where there
    is none). An asynchronous schedule covers ``n_batches`` batches in one window (``resumed``: a window that
    continues a checkpointed run)."""
    feat, section = schedule_feature(plan)
    if feat is None:
        return single(plan.pp, plan.microbatches)
    return feat.make_schedule(section, plan, n_batches=n_batches, resumed=resumed)


def is_asynchronous(strategy: Strategy, base: Plan | None = None) -> bool:
    """Before the Plan is made: whether ``strategy``'s schedule (a handed-in Plan's, if given) keeps several weight
    versions per stage."""
    if base is not None:
        return base.asynchronous
    return any(f.section is not None and f.section.asynchronous for f in enabled_features(strategy))


def grad_scale(plan: Plan) -> float:
    """The factor each microbatch's gradient gets in backward's seed: 1/microbatches (an update averages the
    step's microbatches), unless the schedule feature updates otherwise."""
    feat, section = schedule_feature(plan)
    return 1.0 / plan.microbatches if feat is None else feat.grad_scale(section, plan)


def _pick_schedule(strategy: Strategy, base: Plan | None, plan: Plan, cluster) -> None:
    """The pipeline schedule feature's section (a handed-back Plan's, re-checked), first of the Plan's sections:
    every later decision may ask ``plan.asynchronous``. None enabled: the one-stage program."""
    if base is not None:
        feat, given = schedule_feature(base)
        section = None if feat is None else feat.adopt(copy.deepcopy(given), strategy, plan, cluster)
    else:
        on = [f for f in schedule_features() if f.enabled(strategy)]
        if len(on) > 1:
            raise StrategyError(f"{strategy}: schedule features {[f.name for f in on]} all build schedule "
                                f"{strategy.schedule!r}; unregister one of them (fxpar.unregister_feature)")
        feat = on[0] if on else None
        section = None if feat is None else feat.plan(strategy, plan, cluster)
    if section is not None:
        plan.features[feat.name] = section


def grad_groups(plan: Plan) -> tuple:
    """Which ranks sum which gradients: ``(groups, per-stage {param key: group name or None})``.

    A stage's gradient is summed over every rank holding the stage (its dp replicas, and the other
    pipeline ranks a bidirectional schedule places it on). A parameter several stages use (a tied LM
    head) is summed over every rank holding any of them, in one collective per rank: a rank holding
    two such stages sums them locally (the runtime keeps one accumulator per parameter and rank) and
    reduces the parameter in the first of its stages that uses it; the other stages' steps read that
    result."""
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
    plan = Plan(mesh_axes=[["pp", pp], ["dp", dp]], made_with=strategy.given_settings())
    for f in enabled_features(strategy):       # the features' own mesh axes (a handed-back Plan's stay), fastest last
        plan.mesh_axes += f.mesh_axes(strategy, base.section(f.name) if base is not None else None)
    plan.microbatches = base.microbatches if base is not None else strategy.microbatches
    plan.global_batch = check_batch(batch, dp, plan.microbatches)
    _pick_schedule(strategy, base, plan, cluster)
    if optimizer is not None:
        plan.optimizer = {"name": optimizer.name, "traced": optimizer.traced,
                          "why_not_traced": optimizer.why_not_traced, "elementwise": optimizer.elementwise}
        if optimizer.traced:      # how the traced update runs: one fused kernel, or torch._foreach_* ops
            # every rank's device: the kernel that runs on all of them (a heterogeneous cluster's non-CPU kind wins)
            devices = getattr(cluster, "devices", ()) or (getattr(cluster, "device", None),)
            kind = next((d.kind for d in devices if getattr(d, "kind", "cpu") != "cpu"), "cpu")
            k, why = optimizer.kernel(kind, in_place=not plan.asynchronous)
            plan.optimizer.update({"kernel": k, "why_kernel": why})
            if k == "fused":
                plan.optimizer["hyper"] = optimizer.adam_hyper()
    plan.custom_passes = [p.name for p in strategy.passes]
    try:
        sched = build_schedule(plan)
    except ScheduleError as e:
        raise StrategyError(f"{strategy}: {e}") from e
    plan.stage_to_rank = [list(sched.stage_to_rank[s]) for s in range(sched.n_stages)]
    trace = split = None
    mb = plan.global_batch // (dp * plan.microbatches)
    if sched.n_stages > 1:        # only a pipeline schedule feature makes several stages: it cuts them
        feat, section = schedule_feature(plan)
        micro = tuple(t.narrow(0, 0, mb) for t in batch)
        trace, split = feat.cut_stages(section, strategy, plan, base, model,
                                       layout.unflatten(micro) if layout is not None else micro, loss_fn, cluster)
    else:
        plan.stage_params = [[k for k, v in dict(model.named_parameters()).items() if v.requires_grad]]
    plan.groups, plan.grad_groups = grad_groups(plan)
    for f in registered_features():     # a ClusterSpec a feature cannot run on, or one asking for a feature that is off
        f.check_cluster(strategy, cluster)
    for f in registered_features():     # each enabled feature decides its section; a handed-back Plan's sections stay
        if f.section is not None and f.section.picks_schedule:
            continue                    # the schedule's, decided first
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
