"""The planner's communication decisions: gradient buckets, ByteScheduler's schedule and backward order,
and the gradient-sync methods (Herring's hierarchy, BytePS's servers, Parallax's sparse routes).

:func:`plan_buckets` (DDP-style buckets of a stage, once its joint graph shows backward's order),
:func:`plan_comm_schedule` (ByteScheduler: partition, credit, priority and backward's gradient order, simulated
on ``cost_models.comm_tuning``) and :func:`plan_sparse_routes` (Parallax) run once a stage is captured; the
``_record_*`` functions run inside :func:`fxpar.planner.make_plan`. Passes carry the decisions out.
"""
from __future__ import annotations

import torch

from . import meta as M
from .errors import StrategyError
from .plan import Plan
from .strategy import Strategy

__all__ = ["plan_buckets", "plan_comm_schedule", "plan_herring_buckets", "plan_sparse_routes"]

def _record_comm_schedule(plan: Plan, strategy: Strategy, base: Plan | None, asynchronous: bool) -> None:
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
    why = ("Strategy(cross_iteration=False)" if strategy.cross_iteration is False else
           "dp=1: no gradient is communicated" if plan.dp == 1 else
           f"schedule {plan.schedule!r} is asynchronous: a stage steps inside the window, there is no next step's first "
           "forward to move it to" if asynchronous else
           f"schedule {plan.schedule!r} puts {max(held)} stages on one rank: a stage's update would have to wait for "
           "another stage's step on that rank (shared gradients, one step count)" if max(held, default=1) > 1
           else f"the optimizer is not traced ({plan.optimizer.get('why_not_traced')})" if not plan.optimizer.get("traced")
           else "")
    mb = lambda v: None if v is None else int(v * 2**20)      # noqa: E731
    plan.comm_schedule = {"method": strategy.comm_schedule, "partition_bytes": mb(strategy.partition_mb),
                          "credit_bytes": mb(strategy.credit_mb), "grad_order": strategy.grad_order,
                          "cross_iteration": not why, "cross_iteration_asked": strategy.cross_iteration,
                          "why_not_cross_iteration": why, "stages": []}
    if strategy.delayed_update:
        if why:
            raise StrategyError(f"{strategy}: delayed_update=True carries each step's update into the next, which "
                                f"is not possible here: {why}")
        plan.comm_schedule["delayed_update"] = True
        plan.notes.append("delayed_update: each step computes with the parameters before the previous step's update, "
                          "which runs after its backward (ZeRO-Offload's DPU; W(t+1) = W(t) - lr grad f(W(t-1)))")
        zero = plan.section("zero")
        if zero is not None:       # ZeRO's reduce-scatter buckets are the carried pieces: no ByteScheduler piece plan
            plan.comm_schedule["stages"] = [{"priority": [], "pieces": [], "events": [], "predicted_step_s": None,
                                             "zero": zero.stage} for _ in range(plan.n_stages)]
            plan.notes.append(f"delayed_update with zero={zero.stage}: each bucket's reduce-scattered gradient chunk is "
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
    if (plan.optimizer or {}).get("kernel") == "fused":     # the update will run as one fused kernel per chain
        from passes.fuse_optimizer import fused_chain_times     # fxpar reaches passes only here and in lower
        times = fused_chain_times(captured.gm, times, cluster.device, plan.optimizer)
    tm0 = stage_timings(captured.gm, captured.signature, cluster.device, times=times)
    why_not = _why_not_grad_order(plan, captured, fused)
    asked = cs.get("grad_order")
    if asked == "priority" and why_not:
        raise StrategyError(f"Strategy(comm_schedule='bytescheduler', grad_order='priority'), stage {stage}: backward's "
                            f"gradient order cannot be changed here: {why_not}. Use grad_order=None or 'natural'.")
    def tuned(tm, made, cross):          # ByteScheduler's tuning of this stage with backward making ``made`` in order
        return plan_stage(
            tm, lambda part: plan_buckets(captured, part, part, groups, made),
            lambda k: captured.param_shapes[k], lambda k: _itemsize(captured.param_dtypes[k]),
            lambda n: collective_cost("all_reduce", n, ranks, cluster).time_s, cross,
            plan.buckets[stage], cs.get("partition_bytes"), cs.get("credit_bytes"),
            shared=lambda keys: any(str(groups.get(k)).startswith("tied.") for k in keys), early=fused and cross)

    made_by = {}
    try:
        for label, mode, first, backward in _grad_order_candidates(captured, tm0, why_not, asked):
            tm = tm0 if backward is None else stage_timings(captured.gm, captured.signature, cluster.device,
                                                            backward=backward, times=times)
            made = sorted(tm["ready"], key=tm["ready"].__getitem__)
            entry, buckets = tuned(tm, made, bool(cs.get("cross_iteration")))
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
    if fused and cs.get("cross_iteration") and cs.get("cross_iteration_asked") is None \
            and not cs.get("delayed_update") and asked != "priority":
        within, within_buckets = tuned(tm0, sorted(tm0["ready"], key=tm0["ready"].__getitem__), False)   # every wait in its step
        if within["predicted_step_s"] <= entry["predicted_step_s"] * (1 + _CROSS_GAIN):
            cs["cross_iteration"] = False
            cs["why_not_cross_iteration"] = (
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
_CROSS_GAIN = 0.02        # carry waits and updates into the next step only when predicted at least 2% faster


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
    if plan.shardings or plan.section("zero") is not None:
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
        plan.grad_sync = {"method": "herring", "node": node, "cross": cross, "overlap": True,
                          # the bucket size: the user's, or tuned once the step is captured (plan_herring_buckets)
                          "bucket_choice": ("tune" if strategy.bucket_cap_mb is None else
                                            {"by": "given", "cap_bytes": plan.bucket_cap_bytes})}
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


HERRING_BUCKET_MB = (1, 2, 4, 8, 16, 25)      # the bucket sizes plan_herring_buckets simulates
_BUCKET_NEAR = 0.02     # sizes predicted within 2% of the least count as equal: the larger wins (fewer collectives)


def plan_herring_buckets(plan: Plan, captured, groups: dict, cluster) -> list:
    """Herring's bucket size, chosen on the cost model (``Strategy(bucket_cap_mb=None)``): for each size of
    ``HERRING_BUCKET_MB`` the stage's buckets are simulated as backward makes them (``cost_models.comm_tuning``:
    each bucket's chain -- reduce-scatter in the node, all-reduce of a shard across nodes, all-gather in the node --
    on one lane in bucket order, three collectives' issue each, waited at the optimizer); the least predicted
    step wins, the larger size within 2%. Small buckets let the cross-node step overlap backward, each costs
    three collectives' latency and issue. Records ``Plan.grad_sync["bucket_choice"]``; returns the buckets."""
    from cost_models.comm import collective_cost
    from cost_models.comm_tuning import BucketTiming, simulate, stage_timings
    gs = plan.grad_sync
    node, cross = gs["node"][0], gs["cross"][0]
    per = len(node)
    tm = stage_timings(captured.gm, captured.signature, cluster.device)
    issue = 3 * tm["issue_s"]       # three collectives per bucket: their issue (+ gloo's CPU where it is compute's)

    def chain(nbytes):
        shard = -(-nbytes // per)
        return (collective_cost("reduce_scatter", nbytes, node, cluster).time_s
                + collective_cost("all_reduce", shard, cross, cluster).time_s
                + collective_cost("all_gather", shard, node, cluster).time_s)

    def size(k):
        return _numel(captured.param_shapes[k]) * _itemsize(captured.param_dtypes[k])
    tried, made = {}, {}
    for mb in HERRING_BUCKET_MB:
        buckets = plan_buckets(captured, int(mb * 2**20), plan.first_bucket_cap_bytes, groups)
        bts = [BucketTiming(max(tm["ready"].get(k, tm["t_bwd"]) for k in b), 0.0, [sum(size(k) for k in b)], i)
               for i, b in enumerate(buckets)]
        total = sum(bt.pieces[0] for bt in bts) or 1
        tried[mb] = simulate(bts, tm["t_fwd"], tm["t_bwd"], chain, total, False, tm["t_opt"], issue,
                             tm["cpu_per_byte"]).step_s
        made[mb] = buckets
    least = min(tried.values())
    best = max(mb for mb, t in tried.items() if t <= least * (1 + _BUCKET_NEAR))
    plan.bucket_cap_bytes = int(best * 2**20)
    gs["bucket_choice"] = {"by": "cost model", "cap_bytes": plan.bucket_cap_bytes, "tried": {str(mb): t for mb, t in tried.items()}}
    plan.notes.append(f"grad_sync: Herring buckets of {best} MiB ({len(made[best])} buckets), the least predicted step "
                      "(" + ", ".join(f"{mb} MiB {t * 1e3:.3g} ms" for mb, t in tried.items()) + "); "
                      "Strategy(bucket_cap_mb=...) sets it")
    return made[best]


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
