"""BytePS (Jiang et al., OSDI'20): ``Strategy(grad_sync="byteps")`` with ``ClusterSpec(cpu_servers=k)``.

The ClusterSpec's ``k`` CPU-only ranks (after the ``n`` workers) each sum a ``2(n-1)/(n²+kn-2k)`` share of every
gradient bucket (``cost_models.byteps_traffic``): the workers push it and pull the sum; they all-reduce the rest. The
decision, here: the servers' ranks, their groups and the share. The mechanism: ``passes/byteps.py`` (the workers'
graphs) and ``fxpar/runtime/server.py`` (the servers' loop: ranks beside the workers, :meth:`BytePS.extra_ranks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cost_models.byteps_traffic import gain_over_allreduce, server_share
from fxpar import meta as M
from fxpar.errors import StrategyError
from fxpar.feature import Feature, PlanSection, Slot, register_feature, registered_features
from fxpar.runner import GroupExit
from fxpar.runtime.server import ServerPayload, join_groups, server_payloads, serve_step
from passes.byteps import ServerSum

from .grad_sync import DP_ALONE, check_dp_alone

__all__ = ["BytePS", "BytePSSection", "ServerRunner"]


@dataclass
class BytePSSection(PlanSection):
    """``workers``: n; ``servers``: the CPU servers' global ranks (after the workers'); ``server_share``: each
    server's share of every bucket; ``groups``: per server ``server{j}`` its group, every worker and that server."""
    workers: int = 0
    servers: list = field(default_factory=list)
    server_share: float = 0.0
    groups: dict = field(default_factory=dict)

    def lines(self) -> list:
        if not self.servers:
            return ["gradient buckets all-reduced among the workers (BytePS with no CPU server)"]
        return [f"each of {len(self.servers)} CPU server(s) (ranks {self.servers}) sums a {self.server_share:.4g} share "
                f"of every gradient bucket (the {self.workers} workers push it and pull the sum); the workers "
                "all-reduce the rest"]


@register_feature
class BytePS(Feature):
    name = "byteps"
    doc = ("gradient buckets summed partly by CPU-only servers, partly by all-reduce (Jiang et al., OSDI'20; "
           "passes/byteps.py): the ClusterSpec's ``cpu_servers=k`` CPU-only ranks each sum a 2(n-1)/(n²+kn-2k) "
           "share of every bucket (workers push it and pull the sum), the workers all-reduce the rest; k=0 is "
           "all-reduce")
    section = BytePSSection
    enabled_by = ("grad_sync",)
    conflicts_with = DP_ALONE
    passes = ((Slot.BUCKET_SUM, ServerSum),)

    def enabled(self, strategy) -> bool:
        return strategy.grad_sync == "byteps"

    def validate(self, strategy) -> None:
        check_dp_alone(strategy)

    def uses_server_ranks(self, strategy) -> bool:
        return self.enabled(strategy)

    def check_cluster(self, strategy, cluster) -> None:
        k = getattr(cluster, "cpu_servers", 0) if cluster is not None else 0
        if k and not any(f.uses_server_ranks(strategy) for f in registered_features()):
            raise StrategyError(f"{strategy}: the ClusterSpec has cpu_servers={k} CPU server rank(s), which no feature "
                                "of this Strategy uses (BytePS sums gradients on them, SSP/DSSP keep the parameters "
                                "there); set Strategy(grad_sync='byteps'), Strategy(sync=S.SSP(...)), or "
                                "ClusterSpec(cpu_servers=0).")

    def plan(self, strategy, plan, cluster):
        """The CPU servers' ranks (after the workers'), one group per server (every worker and that server: the
        pushes and pulls of its partitions), and each server's share of every bucket, 2(n-1)/(n²+kn-2k)
        (``cost_models.byteps_traffic``); the workers all-reduce the rest."""
        k = getattr(cluster, "cpu_servers", 0) if cluster is not None else 0
        n = plan.dp
        if n < 2 or getattr(plan, "tp", 1) > 1:
            raise StrategyError(f"{strategy}: grad_sync='byteps' sums each gradient over the dp workers and "
                                + ("dp=1 has nothing to sum; use dp >= 2." if n < 2 else
                                   "is built for data parallelism alone; drop tp or use grad_sync='allreduce'."))
        workers = list(range(plan.mesh.size))
        servers = list(range(plan.mesh.size, plan.mesh.size + k))
        groups = {f"server{j}": [workers + [s]] for j, s in enumerate(servers)}
        share = server_share(n, k)
        plan.groups.update(groups)
        section = BytePSSection(workers=n, servers=servers, server_share=share, groups=groups)
        if not k:
            plan.notes.append("grad_sync: BytePS with no CPU server (ClusterSpec.cpu_servers=0): every bucket is "
                              "all-reduced among the workers, the formula's k=0 limit")
            return section
        plan.notes.append(f"grad_sync: BytePS -- each of {k} CPU server(s) (ranks {servers}) sums a 2(n-1)/(n²+kn-2k) = "
                          f"{share:.4g} share of every bucket (workers push it, pull the sum); the workers all-reduce the "
                          f"rest; {gain_over_allreduce(n, k):.3g}x less traffic on the busiest machine than all-reduce"
                          + (f" (k={k} > n={n}: the servers hold everything, the extra ones sit partly idle)" if k > n else ""))
        return section

    def adopt(self, section, strategy, plan, cluster):
        # the servers are the cluster's; the split follows them
        return self.plan(strategy, plan, cluster) if cluster is not None else section

    def extra_ranks(self, section, program, host):
        return server_payloads(section, program.stages[0].joint.meta.get(M.BYTEPS.name), program.plan.all_groups(),
                               host)

    def extra_runner(self, payload, program):
        return ServerRunner(payload, program)


class ServerRunner(GroupExit):
    """A BytePS CPU summation server's side of a program under torchrun (ranks ``n .. n+k-1``): the surface of
    :class:`fxpar.runner.RankRunner`, so one script runs unchanged on every rank. It holds no parameter and takes no batch."""

    def __init__(self, payload: ServerPayload, program):
        self.payload, self.program = payload, program
        self._pg = join_groups(payload)       # every group, in the workers' order
        self.per_step: list = []              # per step the bytes received and sent (RunResult.servers' fields)

    @property
    def rank(self) -> int:
        return self.payload.rank

    def step(self, batch=None) -> float:
        """Serve one step (``batch`` is ignored: the workers push their gradients); then join the workers' loss
        all-reduce with 0 and return the same global-batch loss they do."""
        stat = serve_step(self.payload, self._pg)
        if stat is None:
            raise RuntimeError(f"BytePS server rank {self.rank} ({self.payload.name}): runner.step() got the workers' "
                               "stop, which only run_local sends: under torchrun every rank calls runner.step(batch) "
                               "once per batch, servers included.")
        self.per_step.append(stat)
        t = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / (self.program.plan.microbatches * self.program.dp)

    def save(self, path) -> None:
        """Nothing to write: a server holds no state (the workers save over their own group)."""

    def load(self, path) -> None:
        """Nothing to read: a server holds no state (the workers load over their own group)."""

    def state_dict(self) -> dict:
        """The whole model's trained state, as the workers' runners return it. Collective: every rank calls it."""
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {})
        return self.program._full_state(parts)
