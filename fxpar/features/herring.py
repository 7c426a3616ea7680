"""Herring (Thangakrishnan et al., SC'20): ``Strategy(grad_sync="herring")``.

Each gradient bucket is reduce-scattered within the node, each shard summed across nodes, then all-gathered
within the node (``passes/herring.py``, the mechanism). The decision, here: the node and cross-node groups from
the ClusterSpec's nodes, whether the cross-node steps overlap backward, and the bucket size -- the user's, or
the least predicted step over :data:`HERRING_BUCKET_MB` on the cost model (``cost_models.comm_tuning``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.comm import collective_cost
from cost_models.comm_tuning import BucketTiming, simulate, slowest_for, stage_timings
from fxpar.errors import StrategyError
from fxpar.feature import Feature, PlanSection, Slot, register_feature
from fxpar.planner_comm import plan_buckets
from passes.herring import HierarchicalReduce

from .grad_sync import DP_ALONE, check_dp_alone

__all__ = ["Herring", "HerringSection", "HERRING_BUCKET_MB", "plan_herring_buckets"]

HERRING_BUCKET_MB = (1, 2, 4, 8, 16, 25)      # the bucket sizes plan_herring_buckets simulates
_BUCKET_NEAR = 0.02     # sizes predicted within 2% of the least count as equal: the larger wins (fewer collectives)


@dataclass
class HerringSection(PlanSection):
    """``node``: per node the ranks that reduce-scatter and all-gather together; ``cross``: per local index the
    ranks on different nodes that sum a shard; ``overlap``: each bucket's cross-node sum and gather start during
    backward (False: after it); ``bucket_choice``: ``"tune"`` (chosen once the step is captured) or
    ``{"by": "given" | "cost model", "cap_bytes": ..., "tried": {MiB: predicted step s}}``."""
    node: list = field(default_factory=list)
    cross: list = field(default_factory=list)
    overlap: bool = True
    bucket_choice: object = "tune"

    def lines(self) -> list:
        choice = self.bucket_choice
        size = (f"buckets of {choice['cap_bytes'] / 2**20:.3g} MiB ({choice['by']})" if isinstance(choice, dict)
                else "bucket size tuned on the cost model")
        return [f"gradient buckets summed by Herring (reduce-scatter in node, sum across nodes, all-gather in node): "
                f"nodes {self.node}, across {self.cross}; {size}; cross-node steps "
                + ("overlap backward" if self.overlap else "after backward")]


@register_feature
class Herring(Feature):
    name = "herring"
    doc = ("hierarchical, balanced gradient sums (Thangakrishnan et al., SC'20; passes/herring.py): each bucket "
           "reduce-scattered within each node into equal shards (padded to a multiple of the node's ranks), each "
           "shard summed across nodes, all-gathered within the node. Needs a ClusterSpec with several nodes "
           "(``ClusterSpec.local(4, nodes=2, devices_per_node=2)`` simulates two)")
    section = HerringSection
    enabled_by = ("grad_sync",)
    conflicts_with = DP_ALONE
    passes = ((Slot.BUCKET_SUM, HierarchicalReduce),)

    def enabled(self, strategy) -> bool:
        return strategy.grad_sync == "herring"

    def validate(self, strategy) -> None:
        check_dp_alone(strategy)

    def plan(self, strategy, plan, cluster):
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
        section = HerringSection(node=node, cross=cross, overlap=True,
                                 # the bucket size: the user's, or tuned once the step is captured (plan_buckets)
                                 bucket_choice=("tune" if strategy.bucket_cap_mb is None else
                                                {"by": "given", "cap_bytes": _dp(plan).bucket_cap_bytes}))
        plan.groups.update({"node": node, "cross": cross})
        plan.notes.append(f"grad_sync: Herring -- each bucket reduce-scattered within nodes {node}, each shard summed "
                          f"across nodes {cross} while backward goes on, then all-gathered within the node")
        return section

    def adopt(self, section, strategy, plan, cluster):
        plan.groups.update({"node": section.node, "cross": section.cross})
        return section

    def plan_buckets(self, section, plan, stage, captured, groups, cluster):
        if section.bucket_choice == "tune":
            return plan_herring_buckets(plan, section, captured, groups, cluster)
        if isinstance(section.bucket_choice, dict):      # tuned once: a handed-back Plan keeps the size
            return plan_buckets(captured, section.bucket_choice["cap_bytes"], _dp(plan).first_bucket_cap_bytes, groups)
        return None


def plan_herring_buckets(plan, section: HerringSection, captured, groups: dict, cluster) -> list:
    """Herring's bucket size, chosen on the cost model (``Strategy(bucket_cap_mb=None)``): for each size of
    ``HERRING_BUCKET_MB`` the stage's buckets are simulated as backward makes them (``cost_models.comm_tuning``:
    each bucket's chain -- reduce-scatter in the node, all-reduce of a shard across nodes, all-gather in the node --
    on one lane in bucket order, three collectives' issue each, waited at the optimizer); the least predicted
    step wins, the larger size within 2%. Small buckets let the cross-node step overlap backward, each costs
    three collectives' latency and issue. Records ``section.bucket_choice``; returns the buckets."""
    node, cross = section.node[0], section.cross[0]
    per = len(node)
    # one bucket size for every rank: timed on the device whose compute of the step takes longest (a heterogeneous
    # cluster's slowest, stragglers folded in; the cluster's device where all are alike)
    device, times = slowest_for(captured.gm, cluster.devices_of(sorted(r for ranks in section.node for r in ranks)))
    tm = stage_timings(captured.gm, captured.signature, device, times=times)
    issue = 3 * tm["issue_s"]       # three collectives per bucket: their issue (+ gloo's CPU where it is compute's)

    def chain(nbytes):
        shard = -(-nbytes // per)
        return (collective_cost("reduce_scatter", nbytes, node, cluster).time_s
                + collective_cost("all_reduce", shard, cross, cluster).time_s
                + collective_cost("all_gather", shard, node, cluster).time_s)

    def size(k):
        n = 1
        for s in captured.param_shapes[k]:
            n *= int(s)
        return n * captured.param_dtypes[k].itemsize
    tried, made = {}, {}
    for mb in HERRING_BUCKET_MB:
        buckets = plan_buckets(captured, int(mb * 2**20), _dp(plan).first_bucket_cap_bytes, groups)
        bts = [BucketTiming(max(tm["ready"].get(k, tm["t_bwd"]) for k in b), 0.0, [sum(size(k) for k in b)], i)
               for i, b in enumerate(buckets)]
        total = sum(bt.pieces[0] for bt in bts) or 1
        tried[mb] = simulate(bts, tm["t_fwd"], tm["t_bwd"], chain, total, False, tm["t_opt"], issue,
                             tm["cpu_per_byte"]).step_s
        made[mb] = buckets
    least = min(tried.values())
    best = max(mb for mb, t in tried.items() if t <= least * (1 + _BUCKET_NEAR))
    _dp(plan).bucket_cap_bytes = int(best * 2**20)
    section.bucket_choice = {"by": "cost model", "cap_bytes": int(best * 2**20),
                             "tried": {str(mb): t for mb, t in tried.items()}}
    plan.notes.append(f"grad_sync: Herring buckets of {best} MiB ({len(made[best])} buckets), the least predicted step "
                      "(" + ", ".join(f"{mb} MiB {t * 1e3:.3g} ms" for mb, t in tried.items()) + "); "
                      "Strategy(bucket_cap_mb=...) sets it")
    return made[best]


def _dp(plan):
    """The ``data_parallel`` section, whose buckets Herring sums (on wherever dp > 1: Herring's plan needs it)."""
    return plan.section("data_parallel")
