"""The planner's communication decisions: gradient buckets and the gradient-sync methods (Herring's hierarchy,
BytePS's servers, Parallax's sparse routes).

:func:`plan_buckets` (DDP-style buckets of a stage, once its joint graph shows backward's order) and
:func:`plan_sparse_routes` (Parallax) run once a stage is captured; the ``_record_*`` functions run inside
:func:`fxpar.planner.make_plan`. Passes carry the decisions out.
"""
from __future__ import annotations

import torch

from . import meta as M
from .errors import StrategyError
from .plan import Plan
from .strategy import Strategy

__all__ = ["plan_buckets", "plan_herring_buckets", "plan_sparse_routes"]


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
