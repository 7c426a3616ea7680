"""The planner: Strategy + model + cluster → Plan. It decides; passes carry the decisions out.

Decisions, in order: the schedule and its stage placement; the stage cuts (``passes.split_stages``'s
balanced search over module boundaries, or the user's split points, or an edited Plan's cuts); which
ranks sum which gradients (:func:`grad_groups`: the one place that knows); the gradient buckets of
each stage (:func:`plan_buckets`, DDP-style, once the stage's joint graph shows backward's order).
"""
from __future__ import annotations

import torch

from . import meta as M
from .errors import StrategyError
from .plan import Plan
from .schedule import Schedule, ScheduleError, get_schedule
from .strategy import Strategy

__all__ = ["make_plan", "plan_buckets", "plan_recompute", "check_batch", "grad_groups", "build_schedule", "schedule_name", "ASYNC"]

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
    from .schedule import ensure_reduce_grad
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
    from .schedule import ScheduleDeadlockError, ScheduleValidationError, simulate, validate
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
    dp = plan.dp
    groups: dict = {}
    per_stage = []
    for s, keys in enumerate(plan.stage_params):
        holders = sorted(pr * dp + d for pr in plan.stage_to_rank[s] for d in range(dp))
        chosen = {}
        for k in keys:
            if k in plan.tied:
                ranks = sorted({pr * dp + d for t in plan.tied[k] for pr in plan.stage_to_rank[t] for d in range(dp)})
                first = {min(t for t in plan.tied[k] if pr in plan.stage_to_rank[t]) for pr in plan.stage_to_rank[s]}
                if len(first) > 1:
                    raise StrategyError(f"parameter {k!r} is used by stages {plan.tied[k]}; the placement "
                                        f"{dict(enumerate(plan.stage_to_rank))} puts stage {s} on ranks that reduce it in "
                                        "different stages. Use a placement where every holder of a stage holds the "
                                        "same stages, or untie the parameter.")
                if len(ranks) > 1 and first == {s}:
                    groups[f"tied.{k}"] = [ranks]
                    chosen[k] = f"tied.{k}"
                else:
                    chosen[k] = None
            elif len(holders) == 1:
                chosen[k] = None
            elif len(plan.stage_to_rank[s]) == 1:
                chosen[k] = "dp"
            else:
                groups[f"stage{s}"] = [holders]
                chosen[k] = f"stage{s}"
        per_stage.append(chosen)
    return groups, per_stage


def make_plan(strategy: Strategy, batch, *, model=None, loss_fn=None, cluster=None, base: Plan | None = None,
              optimizer=None, layout=None):
    """Decide the program's structure. Returns ``(plan, schedule, forward_trace or None, stage split or None)``;
    buckets are planned per stage once the stages are captured (:func:`plan_buckets`). ``batch``: the flat
    tuple of tensors; ``layout`` (a ``BatchLayout``) gives it back its structure (keyword inputs) for tracing."""
    dp, pp = strategy.dp, strategy.pp
    plan = Plan(mesh_axes=[["pp", pp], ["dp", dp]])
    plan.schedule = schedule_name(strategy, base)
    plan.microbatches = base.microbatches if base is not None else strategy.microbatches
    plan.global_batch = check_batch(batch, dp, plan.microbatches)
    plan.bucket_cap_bytes = int(strategy.bucket_cap_mb * 2**20)
    plan.first_bucket_cap_bytes = int(strategy.first_bucket_cap_mb * 2**20)
    plan.broadcast_buffers = strategy.broadcast_buffers
    if optimizer is not None:
        plan.optimizer = {"name": optimizer.name, "traced": optimizer.traced, "why_not_traced": optimizer.why_not_traced}
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
        from .capture import trace_forward
        from passes.split_stages import imbalance_warning, split_stages   # fxpar reaches passes only here and in lower
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
    if base is not None:
        plan.buckets = base.buckets
    _record_recompute(plan, strategy, base)
    return plan, sched, trace, split


def _record_recompute(plan: Plan, strategy: Strategy, base: Plan | None) -> None:
    """Recompute policy into the Plan: its name and budget now, each stage's decision in :func:`plan_recompute`
    once the stage is captured. A callable policy cannot go in JSON: the Plan records its name and holds the
    callable for this build only (``_recompute_policy``); the decisions it makes are recorded as data."""
    if base is not None and base.recompute:
        plan.recompute = {k: v for k, v in base.recompute.items()}
        return
    pol = strategy.recompute
    if not callable(pol) and pol == "none":
        return
    budget = None if strategy.memory_budget_gb is None else int(strategy.memory_budget_gb * 1e9)
    name = pol if isinstance(pol, str) else "callable:" + getattr(pol, "__qualname__", type(pol).__name__)
    plan.recompute = {"policy": name, "budget_bytes": budget, "stages": []}
    if callable(pol):
        plan._recompute_policy = pol


def plan_recompute(plan: Plan, stage: int, gm, roles: dict, in_flight: int = 1) -> dict:
    """Decide which forward values stage ``stage``'s backward recomputes (``passes.recompute`` carries it out):
    ``Plan.recompute['stages'][stage] = {"recompute": [node names], "saved": values kept, "saved_bytes": per
    microbatch, "in_flight": microbatches held at once, "recompute_flops": ...}``. ``auto`` asks for the least
    recompute FLOPs (``cost_models.compute``) whose bytes × in_flight fit the budget."""
    from cost_models.compute import node_cost                        # FLOPs of the recomputed nodes
    from passes import recompute as R                                # fxpar reaches passes only here and in lower
    rc = plan.recompute
    stages = rc.setdefault("stages", [])
    if stage < len(stages):                                          # decided already (a Plan handed back)
        return stages[stage]
    flops = lambda n: int(node_cost(n).flops)                        # noqa: E731
    name = rc["policy"]
    if name == "auto":
        try:
            d = R.auto_decide(gm, roles, rc["budget_bytes"], flops, in_flight)
        except ValueError as e:
            raise StrategyError(f"Strategy(recompute='auto'), stage {stage}: {e}") from None
        names = d["recompute"]
    else:
        policy = getattr(plan, "_recompute_policy", None) if name.startswith("callable:") else R.POLICIES.get(name)
        if policy is None:
            raise StrategyError(f"Plan.recompute policy {name!r}: a callable policy is not kept in a Plan's JSON; "
                                "pass it again as Strategy(recompute=your_policy), or keep the Plan's 'stages'")
        names = R.decide(gm, policy)
        d = {}
    copied, saved = R.demands(gm, names)
    entry = {"recompute": names, "saved": len(saved), "saved_bytes": R.saved_bytes(saved, roles),
             "in_flight": in_flight, "recompute_flops": sum(flops(n) for n in copied)}
    if "smallest_bytes" in d:
        entry["smallest_bytes"] = d["smallest_bytes"]
    stages.append(entry)
    plan.notes.append(f"recompute ({name}): stage {stage} keeps {entry['saved']} forward value(s), "
                      f"{entry['saved_bytes']} bytes per microbatch x {in_flight} in flight; backward recomputes "
                      f"{len(copied)} node(s), {entry['recompute_flops']} FLOPs")
    return entry


def plan_buckets(captured, cap_bytes: int, first_cap_bytes: int | None = None, groups: dict | None = None) -> list:
    """DDP-style buckets of one stage: gradients in the order backward produces them, cut at ``cap_bytes``;
    the first bucket at ``min(first_cap_bytes, cap_bytes)`` (DDP: 1 MiB), as DDP's rebuilt buckets. Each
    bucket holds one dtype and one group (``groups``: key -> group name; keys mapped to None are left out)."""
    order = []
    for n in captured.gm.graph.nodes:
        key = M.get(n, M.GRAD_OF)
        if key is not None and key not in order:
            order.append(key)
    for key in captured.param_names:      # gradients never produced in backward (unused params) come last
        if key not in order:
            order.append(key)
    if groups is not None:
        order = [k for k in order if groups.get(k)]
    buckets, cur, size = [], [], 0
    for key in order:
        nbytes = _numel(captured.param_shapes[key]) * _itemsize(captured.param_dtypes[key])
        limit = cap_bytes if buckets or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)
        split = bool(cur) and (captured.param_dtypes[key] != captured.param_dtypes[cur[-1]]   # one dtype, as DDP
                               or (groups is not None and groups[key] != groups[cur[-1]]))
        if cur and (limit == 0 or size + nbytes > limit or split):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
