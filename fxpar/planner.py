"""The planner: Strategy + model + cluster → Plan. It decides; passes carry the decisions out.

Decisions, in order: the schedule and its stage placement; the stage cuts (``passes.split_stages``'s
balanced search over module boundaries, or the user's split points, or an edited Plan's cuts); which
ranks sum which gradients (:func:`grad_groups`: the one place that knows); the gradient buckets of
each stage (:func:`plan_buckets`, DDP-style, once the stage's joint graph shows backward's order).
"""
from __future__ import annotations

import json

import torch

from . import meta as M
from .errors import StrategyError
from .plan import Plan
from .schedule import Schedule, ScheduleError, get_schedule
from .strategy import Strategy

__all__ = ["make_plan", "plan_buckets", "plan_sparse_routes", "plan_recompute", "plan_comm_schedule", "check_batch", "grad_groups", "build_schedule", "schedule_name", "ASYNC"]

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
    buckets are planned per stage once the stages are captured (:func:`plan_buckets`). ``batch``: the flat
    tuple of tensors; ``layout`` (a ``BatchLayout``) gives it back its structure (keyword inputs) for tracing."""
    dp, pp = strategy.dp, strategy.pp
    plan = Plan(mesh_axes=[["pp", pp], ["dp", dp]])
    _record_sharding(plan, strategy, base)
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
    _record_zero(plan, strategy, base, optimizer)
    _record_grad_sync(plan, strategy, base, cluster)
    if plan.zero == 3 and not any(a.kind.value == "FULL" for acts in sched.actions.values() for a in acts):
        from .schedule import add_unshard          # ZeRO-3 with F/B graphs: gather each stage's parameters once a step
        from .zero import zero_keys
        sched = add_unshard(sched, [s for s in range(plan.n_stages) if zero_keys(plan, s)])
    _record_recompute(plan, strategy, base)
    _record_comm_schedule(plan, strategy, base)
    return plan, sched, trace, split


def _record_sharding(plan: Plan, strategy: Strategy, base: Plan | None) -> None:
    """Tensor parallelism into the Plan: the tp mesh axes (Tofu halves the device set: ``tp0``, ``tp1``, ... of
    size 2; the other modes use one ``tp`` axis) and the mode; ``passes.tensor_parallel`` fills in each stage's
    parameter layouts (and Tofu's per-node choice, reused when the Plan is handed back)."""
    if base is not None and base.shardings:
        plan.shardings = json.loads(json.dumps(base.shardings))
    elif strategy.tp > 1:
        mode = "layouts" if isinstance(strategy.sharding, dict) else strategy.sharding
        k = strategy.tp.bit_length() - 1
        axes = ([["tp", 2]] if k == 1 else [[f"tp{i}", 2] for i in range(k)]) if mode == "auto" \
            else [["tp", strategy.tp]]
        plan.shardings = {"mode": mode, "axes": axes, "stages": [],
                          "layouts": {p: list(v) for p, v in strategy.sharding.items()} if mode == "layouts" else {}}
    else:
        return
    plan.mesh_axes += [list(a) for a in plan.shardings["axes"]]


def _record_comm_schedule(plan: Plan, strategy: Strategy, base: Plan | None) -> None:
    """Communication order into the Plan (``passes.comm_schedule`` carries it out): the method, the partition
    and credit asked for (None: tuned per stage in :func:`plan_comm_schedule`), and whether the gradient waits and
    updates move into the next step (cross-iteration overlap: dp > 1, a traced optimizer, a synchronous schedule
    whose ranks hold one stage each; with a pipeline or several microbatches, each stage's STEP moves into the
    next step's first forward of that stage, ``passes.comm_schedule``)."""
    if base is not None and base.comm_schedule:
        plan.comm_schedule = {k: v for k, v in base.comm_schedule.items()}
        return
    if strategy.comm_schedule == "fifo":
        return
    held = [sum(pr in rs for rs in plan.stage_to_rank) for pr in range(plan.pp)]
    why = ("dp=1: no gradient is communicated" if plan.dp == 1 else
           f"schedule {plan.schedule!r} is asynchronous: a stage steps inside the window, there is no next step's first "
           "forward to move it to" if plan.schedule in ASYNC else
           f"schedule {plan.schedule!r} puts {max(held)} stages on one rank: a stage's update would have to wait for "
           "another stage's step on that rank (shared gradients, one step count)" if max(held, default=1) > 1
           else f"the optimizer is not traced ({plan.optimizer.get('why_not_traced')})" if not plan.optimizer.get("traced")
           else "")
    mb = lambda v: None if v is None else int(v * 2**20)      # noqa: E731
    plan.comm_schedule = {"method": strategy.comm_schedule, "partition_bytes": mb(strategy.partition_mb),
                          "credit_bytes": mb(strategy.credit_mb), "grad_order": strategy.grad_order,
                          "cross_iteration": not why,
                          "why_not_cross_iteration": why, "stages": []}
    if strategy.delayed_update:
        if why:
            raise StrategyError(f"{strategy}: delayed_update=True carries each step's update into the next, which "
                                f"is not possible here: {why}")
        plan.comm_schedule["delayed_update"] = True
        plan.notes.append("delayed_update: each step computes with the parameters before the previous step's update, "
                          "which runs after its backward (ZeRO-Offload's DPU; W(t+1) = W(t) - lr grad f(W(t-1)))")
        if plan.zero:       # ZeRO's reduce-scatter buckets are the carried pieces: no ByteScheduler piece plan
            plan.comm_schedule["stages"] = [{"priority": [], "pieces": [], "events": [], "predicted_step_s": None,
                                             "zero": plan.zero} for _ in range(plan.n_stages)]
            plan.notes.append(f"delayed_update with zero={plan.zero}: each bucket's reduce-scattered gradient chunk is "
                              "carried into the next step, whose update runs on chunks after its backward")


def plan_comm_schedule(plan: Plan, stage: int, captured, cluster, fused: bool = True) -> dict:
    """ByteScheduler's decisions for one stage (Peng et al., SOSP'19; ``cost_models.comm_tuning.plan_stage``):
    buckets of at most ``partition`` bytes (a bigger single gradient cut in row pieces), their priority (the
    order the next forward first uses them), the credit, and the issue plan simulated on the cost model, into
    ``Plan.comm_schedule['stages'][stage]``; the stage's buckets become those. Partition and credit left None
    are tuned on that simulation of this cluster; the grid tried and the predicted step times are recorded.
    With cross-iteration overlap on a fused stage (``fused``: one graph per step) the order backward makes the
    gradients is a decision too (``passes.grad_order``): natural, the next forward's need order, or natural for
    the first few then need order, whichever the simulation predicts fastest (``entry['grad_order']``)."""
    from cost_models.comm import collective_cost
    from cost_models.comm_tuning import CreditError, plan_stage, stage_timings
    from cost_models.compute import graph_compute
    cs = plan.comm_schedule
    stages = cs.setdefault("stages", [])
    if stage < len(stages):                       # decided already (a Plan handed back)
        return stages[stage]
    groups = plan.grad_groups[stage]
    names = sorted({g for g in groups.values() if g})
    if not names:
        stages.append({"priority": [], "pieces": [], "events": [], "predicted_step_s": None})
        return stages[-1]
    ranks = plan.group_of(names[0], plan.stage_to_rank[stage][0] * plan.width)
    times = graph_compute(captured.gm, cluster.device).times
    tm0 = stage_timings(captured.gm, captured.signature, cluster.device, times=times)
    why_not = _why_not_grad_order(plan, captured, fused)
    asked = cs.get("grad_order")
    if asked == "priority" and why_not:
        raise StrategyError(f"Strategy(comm_schedule='bytescheduler', grad_order='priority'), stage {stage}: backward's "
                            f"gradient order cannot be changed here: {why_not}. Use grad_order=None or 'natural'.")
    made_by = {}
    try:
        for label, mode, first, backward in _grad_order_candidates(captured, tm0, why_not, asked):
            tm = tm0 if backward is None else stage_timings(captured.gm, captured.signature, cluster.device,
                                                            backward=backward, times=times)
            made = sorted(tm["ready"], key=tm["ready"].__getitem__)
            entry, buckets = plan_stage(
                tm, lambda part: plan_buckets(captured, part, part, groups, made),
                lambda k: captured.param_shapes[k], lambda k: _itemsize(captured.param_dtypes[k]),
                lambda n: collective_cost("all_reduce", n, ranks, cluster).time_s, bool(cs.get("cross_iteration")),
                plan.buckets[stage], cs.get("partition_bytes"), cs.get("credit_bytes"),
                shared=lambda keys: any(str(groups.get(k)).startswith("tied.") for k in keys))
            entry["grad_order"] = {"mode": mode, "first": first, "keys": made if mode != "natural" else []}
            made_by[label] = (entry, buckets)
    except CreditError as e:
        keys = plan_buckets(captured, e.partition, e.partition, groups)[e.bucket]
        tied = str(groups.get(keys[0])).startswith("tied.") and not cs.get("partition_bytes")
        what = (f"gradient {keys[0]!r} (shape {tuple(captured.param_shapes[keys[0]])}) of a parameter tied across "
                "stages, kept whole unless partition_mb is given (every stage must cut it alike)" if tied else
                f"gradient {keys[0]!r} (shape {tuple(captured.param_shapes[keys[0]])}), cut in rows: a row is the "
                "indivisible piece" if len(keys) == 1 else
                f"bucket of {len(keys)} gradients {keys[:3]}... (packed up to the partition)")
        raise StrategyError(f"Strategy(comm_schedule='bytescheduler', credit_mb={cs['credit_bytes'] / 2**20:.4g}), stage "
                            f"{stage}: the credit ({cs['credit_bytes']} bytes) is below the largest piece, {e.piece} "
                            f"bytes: the {what}, at partition {e.partition / 2**20:.4g} MiB. A piece must fit in the "
                            f"credit to be sent at all: raise credit_mb to at least {e.piece / 2**20:.4g}, lower "
                            "partition_mb, or leave credit_mb=None (tuned).") from None
    step = {label: e["predicted_step_s"] for label, (e, _) in made_by.items()}
    fastest = min(step, key=step.__getitem__)
    if "natural" in step and step[fastest] >= step["natural"] * (1 - _REORDER_GAIN):
        fastest = "natural"
    entry, buckets = made_by[fastest]
    entry["grad_order"]["tried"] = step
    if why_not:
        entry["grad_order"]["why_natural"] = why_not
    plan.buckets[stage] = buckets
    stages.append(entry)
    fifo = entry["fifo_predicted_step_s"]
    go = entry["grad_order"]
    plan.notes.append(f"comm_schedule (bytescheduler): stage {stage}: {len(buckets)} bucket(s), {len(entry['pieces'])} "
                      f"piece(s) of at most {entry['partition_bytes'] / 2**20:.3g} MiB, credit "
                      f"{entry['credit_bytes'] / 2**20:.3g} MiB ({entry['tuned']['partition']}/{entry['tuned']['credit']}); "
                      f"predicted step {entry['predicted_step_s'] * 1e3:.3g} ms"
                      + (f" vs FIFO buckets {fifo * 1e3:.3g} ms" if fifo else "")
                      + ("; gradient waits and updates move into the next step" if cs.get("cross_iteration") else
                         f"; no cross-iteration overlap: {cs.get('why_not_cross_iteration')}")
                      + (f"; backward makes the gradients in {go['mode']} order"
                         + (f" after the first {go['first']}" if go["mode"] == "hybrid" else "")
                         + " (predicted " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in go["tried"].items()) + ")"
                         if len(go["tried"]) > 1 else ""))
    return entry


_REORDER_GAIN = 0.02      # reorder backward only when predicted at least 2% faster (it keeps dY tensors longer)


def _why_not_grad_order(plan: Plan, captured, fused: bool) -> str | None:
    """Why backward's gradient order is not a decision for this stage (None: it is)."""
    from .backward_order import why_not_reorder
    if not (plan.comm_schedule or {}).get("cross_iteration"):
        return "no cross-iteration overlap: the optimizer waits for every gradient at once"
    if not fused:
        return ("the stage's gradients are reduced by REDUCE_GRAD after its last backward (a pipeline or several "
                "microbatches): the order backward makes them does not move their collectives")
    if (plan.recompute or {}).get("policy", "none") != "none" or (plan.offload or {}).get("activations"):
        return "recompute / activation offload place their copies by backward's order"
    if plan.shardings or getattr(plan, "zero", 0):
        return "tensor parallelism and ZeRO place their collectives by backward's order"
    return why_not_reorder(captured.gm)


def _grad_order_candidates(captured, tm: dict, why_not: str | None, asked: str | None = None) -> list:
    """``(label, mode, first, backward nodes or None)``: natural; need order; natural for the first j then need
    order (j = a quarter, half and three quarters of the gradients). ``asked``: only that one."""
    out = [] if asked == "priority" else [("natural", "natural", 0, None)]
    if why_not or asked == "natural":
        return out
    from .backward_order import reordered_backward
    natural = sorted(tm["ready"], key=tm["ready"].__getitem__)
    need = sorted(tm["ready"], key=lambda k: (tm["need"].get(k, float("inf")), natural.index(k)))
    n = len(natural)
    for first in sorted({0} if asked else {0, n // 4, n // 2, (3 * n) // 4} - {n}):
        keys = natural[:first] + [k for k in need if k not in natural[:first]]
        mode = "priority" if first == 0 else "hybrid"
        out.append((f"{mode}" + (f"@{first}" if first else ""), mode, first, reordered_backward(captured.gm, keys)))
    return out


def _record_grad_sync(plan: Plan, strategy: Strategy, base: Plan | None, cluster) -> None:
    """Herring's hierarchy into the Plan: per node the ranks that reduce-scatter and all-gather together
    (group ``node``), and per local index the ranks on different nodes that sum a shard (group ``cross``).
    BytePS's servers and shares: :func:`_record_byteps`."""
    k = getattr(cluster, "cpu_servers", 0) if cluster is not None else 0
    if k and (base.grad_sync if base is not None else {"method": strategy.grad_sync}).get("method") != "byteps":
        raise StrategyError(f"{strategy}: the ClusterSpec has cpu_servers={k} CPU summation server(s), which only "
                            "BytePS uses; set Strategy(grad_sync='byteps') or ClusterSpec(cpu_servers=0).")
    if base is None and strategy.grad_sync == "parallax":
        plan.grad_sync = {"method": "parallax"}          # the routes are chosen once the step is captured
        return
    if base is not None:
        plan.grad_sync = dict(base.grad_sync)
        if plan.grad_sync.get("method") == "herring":
            plan.groups.update({"node": plan.grad_sync["node"], "cross": plan.grad_sync["cross"]})
        if plan.grad_sync.get("method") == "byteps" and cluster is not None:
            _record_byteps(plan, strategy, k)              # the servers are the cluster's; the split follows them
    elif strategy.grad_sync == "byteps":
        _record_byteps(plan, strategy, k)
    elif strategy.grad_sync == "herring":
        per = getattr(cluster, "devices_per_node", plan.dp) if cluster is not None else plan.dp
        nodes = plan.dp // per if per and plan.dp % per == 0 else 0
        if nodes < 2 or per < 2:
            raise StrategyError(f"{strategy}: grad_sync='herring' reduces within nodes, then across them; this "
                                f"cluster has {getattr(cluster, 'nodes', 1)} node(s) of {per} device(s) for dp={plan.dp}. "
                                "Use a ClusterSpec with at least 2 nodes of at least 2 devices (e.g. "
                                "ClusterSpec.local(4, nodes=2, devices_per_node=2)), or grad_sync='allreduce'.")
        node = [list(range(n * per, (n + 1) * per)) for n in range(nodes)]
        cross = [list(range(i, plan.dp, per)) for i in range(per)]
        # overlap: each bucket's cross-node sum and gather start during backward (passes/herring.py)
        plan.grad_sync = {"method": "herring", "node": node, "cross": cross, "overlap": True}
        plan.groups.update({"node": node, "cross": cross})
        plan.notes.append(f"grad_sync: Herring -- each bucket reduce-scattered within nodes {node}, each shard summed "
                          f"across nodes {cross} while backward goes on, then all-gathered within the node")


def _record_byteps(plan: Plan, strategy: Strategy, k: int) -> None:
    """BytePS (Jiang et al., OSDI'20) into the Plan: the CPU servers' ranks (after the workers'), one group per
    server (every worker and that server: the pushes and pulls of its partitions), and each server's share of
    every bucket, 2(n-1)/(n²+kn-2k) (``cost_models.byteps``); the workers all-reduce the rest."""
    from cost_models.byteps import gain_over_allreduce, server_share   # the planner reads the cost models
    n = plan.dp
    if n < 2 or getattr(plan, "tp", 1) > 1:
        raise StrategyError(f"{strategy}: grad_sync='byteps' sums each gradient over the dp workers and "
                            + ("dp=1 has nothing to sum; use dp >= 2." if n < 2 else
                               "is built for data parallelism alone; drop tp or use grad_sync='allreduce'."))
    workers = list(range(plan.mesh.size))
    servers = list(range(plan.mesh.size, plan.mesh.size + k))
    groups = {f"server{j}": [workers + [s]] for j, s in enumerate(servers)}
    share = server_share(n, k)
    plan.grad_sync = {"method": "byteps", "workers": n, "servers": servers, "server_share": share, "groups": groups}
    plan.groups.update(groups)
    if not k:
        plan.notes.append("grad_sync: BytePS with no CPU server (ClusterSpec.cpu_servers=0): every bucket is "
                          "all-reduced among the workers, the formula's k=0 limit")
        return
    plan.notes.append(f"grad_sync: BytePS -- each of {k} CPU server(s) (ranks {servers}) sums a 2(n-1)/(n²+kn-2k) = "
                      f"{share:.4g} share of every bucket (workers push it, pull the sum); the workers all-reduce the "
                      f"rest; {gain_over_allreduce(n, k):.3g}x less traffic on the busiest machine than all-reduce"
                      + (f" (k={k} > n={n}: the servers hold everything, the extra ones sit partly idle)" if k > n else ""))


def plan_sparse_routes(plan: Plan, captured) -> None:
    """Parallax: which embedding gradients travel as (row index, row) pairs (``passes.parallax.classify``: its
    traffic formulas on the captured step), into ``Plan.grad_sync``, and how each one's update is applied
    (``Plan.grad_sync["sparse_update"]``, ``passes.parallax.update_routes``); a handed-back Plan keeps its routes."""
    gs = plan.grad_sync
    if gs.get("method") != "parallax" or ("routes" in gs and "sparse_update" in gs):
        return
    from passes.parallax import classify, update_routes              # fxpar reaches passes only here and in lower
    if "routes" not in gs:
        gs["routes"] = classify(captured.gm, plan.dp)
        gs["sparse"] = sorted(k for k, r in gs["routes"].items() if r["route"] == "sparse")
    # each sparse gradient's update: into the touched rows (plain SGD) or through a dense gradient, and why
    gs["sparse_update"] = update_routes(captured.gm, captured.optimizer, gs["sparse"], plan.microbatches)
    upd = gs["sparse_update"]
    plan.notes.append("grad_sync: Parallax -- " + ("; ".join(
        f"{k}: {r['route']} (pairs {r['sparse_bytes']:.0f} B vs all-reduce {r['dense_bytes']:.0f} B per rank)"
        + (f", update {upd[k]['route']}: {upd[k]['why']}" if k in upd else "")
        for k, r in gs["routes"].items()) or "no embedding gradient: everything all-reduced"))


def _record_zero(plan: Plan, strategy: Strategy, base: Plan | None, optimizer) -> None:
    """ZeRO's stage into the Plan (a handed-back Plan keeps its own); refuse what it cannot shard."""
    plan.zero = base.zero if base is not None else strategy.zero
    if base is not None:
        plan.offload = dict(base.offload)
    elif strategy.offload:
        plan.offload = {"what": list(strategy.offload), "to": strategy.offload_to, "dir": strategy.offload_dir}
        where = (f"files under {strategy.offload_dir} (memory-mapped)" if strategy.offload_to == "disk" else
                 "host memory (on a CPU backend, where it already is)")
        how = [("streams each gradient chunk to the host and updates there" if "optimizer" in strategy.offload
                else ""), "reads the files ahead (fxpar::prefetch)" if strategy.offload_to == "disk" else ""]
        how = f"; the zero_offload pass {' and '.join(h for h in how if h)}" if strategy.zero and any(how) else ""
        plan.notes.append(f"offload: {' and '.join(strategy.offload)} of each rank live in {where}{how}")
    if base is None and strategy.offload_activations:
        plan.offload = {**plan.offload, "activations": "cpu"}
        plan.notes.append("offload_activations: saved activations go to host memory after their last forward use "
                          "and come back one backward use ahead")
    if plan.offload and "optimizer" in plan.offload.get("what", ()) and optimizer is not None and not optimizer.traced:
        raise StrategyError(f"{strategy}: offload=('optimizer',) keeps the traced optimizer's state in files; "
                            f"{optimizer.name} is not traced ({optimizer.why_not_traced}). Use SGD, Adam or AdamW, "
                            "or offload only 'params'.")
    if plan.offload.get("what") and plan.schedule in ASYNC:
        raise StrategyError(f"{strategy}: schedule {plan.schedule!r} keeps several weight versions; offload is built "
                            "for synchronous schedules.")
    if not plan.zero:
        return
    if plan.dp == 1:
        raise StrategyError(f"Plan.zero={plan.zero} with dp=1: ZeRO shards over the dp axis; set dp > 1 or zero=0")
    if optimizer is not None and not optimizer.traced:
        raise StrategyError(f"{strategy}: ZeRO runs the optimizer on each rank's chunks inside the step graph, and "
                            f"{optimizer.name} is not traced ({optimizer.why_not_traced}). Use torch.optim.SGD, Adam or "
                            f"AdamW without those options, or zero=0: then {optimizer.name} runs eagerly on every rank "
                            "with whole parameters and state (plain data parallelism).")
    if plan.schedule in ASYNC:
        raise StrategyError(f"{strategy}: schedule {plan.schedule!r} keeps several weight versions per stage; ZeRO "
                            "is built for synchronous schedules (gpipe, 1f1b, interleaved, zb1p, chimera). Use one of "
                            "those, or zero=0.")
    from .zero import describe, zero_keys
    n_keys = sum(len(zero_keys(plan, s)) for s in range(len(plan.stage_params)))
    whole = sum(len(k) for k in plan.stage_params) - n_keys
    plan.notes.append(f"zero={plan.zero}: {describe(plan.zero)}; {n_keys} parameter(s) in dp={plan.dp} chunks"
                      + (f", {whole} kept whole (shared by stages or held by one rank)" if whole else ""))


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


def plan_buckets(captured, cap_bytes: int, first_cap_bytes: int | None = None, groups: dict | None = None,
                 grad_order: list | None = None) -> list:
    """DDP-style buckets of one stage: gradients in the order backward produces them, cut at ``cap_bytes``;
    the first bucket at ``min(first_cap_bytes, cap_bytes)`` (DDP: 1 MiB), as DDP's rebuilt buckets. Each
    bucket holds one dtype and one group (``groups``: key -> group name; keys mapped to None are left out).
    ``grad_order``: the order backward makes them when ``passes.grad_order`` reorders it."""
    order = list(grad_order or [])
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
