"""HetPipe: ``Strategy(dp=k, pp=p, schedule="hetpipe", staleness=D)`` on ``ClusterSpec(cpu_servers=...)`` (Park et
al., USENIX ATC 2020).

``k`` virtual workers, each a ``p``-stage pipeline (the ranks of one dp index), train side by side and synchronise
through parameter-server ranks under wave synchronous parallel (WSP) with staleness bound ``D``
(:mod:`fxpar.schedule.hetpipe`). The pieces:

* **the cut**: the stages are cut by device speed and memory (:meth:`HetPipe.stage_devices`): a stage's cost is its
  FLOPs over the FLOP/s of the slowest device that holds it (``ClusterSpec.speed_of``: a heterogeneous cluster's
  device, a straggler's slowdown), and no stage's parameter state may exceed the smallest memory of its devices. All
  virtual workers share the cut, as under the paper's equal-distribution placement (every virtual worker has the same
  mix of devices, stage by stage);
* **the wave**: each virtual worker runs 1F1B over the batch's ``m`` microbatches, flushed, and each stage updates
  once from the summed gradients (:func:`fxpar.schedule.hetpipe.hetpipe`);
* **WSP**: HetPipe sets ``sync=S.SSP(staleness=D)`` (:meth:`HetPipe.settle`): the stage's update of wave ``c``,
  divided by ``k``, is pushed to the stage's own parameter servers, and the parameters of wave ``c + 1`` are read
  once every virtual worker has pushed the waves before ``c + 1 - D`` (:mod:`fxpar.sync.ssp`, one clock per wave).

The servers are the ClusterSpec's ``cpu_servers`` ranks, as for SSP: ``cpu_servers`` a multiple of ``p``, each stage's
parameters sharded over ``cpu_servers / p`` of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fxpar.errors import StrategyError
from fxpar.feature import Option, enabled_features, register_feature
from fxpar.schedule.hetpipe import hetpipe
from fxpar.sync.ssp import SSP
from passes.split_stages import StageDevices, balanced_cuts, cut_candidates

from .pipeline import PipelineSchedule, PipelineSection, flops_per_byte

__all__ = ["HetPipe", "HetPipeSection"]

# features whose layout assumes replicas that step together (ZeRO, tensor parallelism) or that replace the sum of
# the gradient buckets which WSP's pushes replace
_CONFLICTS = ("tensor_parallel", "zero", "zero_offload", "bytescheduler", "herring", "byteps", "parallax")


@dataclass
class HetPipeSection(PipelineSection):
    """``staleness``: WSP's bound D; per stage: the device that bounds it (``stage_devices``: the slowest of those
    holding it), its speed (FLOP/s) and smallest memory (bytes), its forward FLOPs per microbatch; ``flop_cuts``: the
    cut that balances FLOPs alone (what the speed-aware cut is measured against)."""
    staleness: int = 0
    stage_devices: list = field(default_factory=list)
    stage_speed: list = field(default_factory=list)
    stage_memory: list = field(default_factory=list)
    stage_flops: list = field(default_factory=list)
    flop_cuts: list = field(default_factory=list)

    def stage_times(self) -> list:
        """Per stage, one microbatch's forward seconds on its device (FLOPs / FLOP/s)."""
        return [f / v for f, v in zip(self.stage_flops, self.stage_speed)]

    def imbalance(self) -> float:
        """``max / min - 1`` of :meth:`stage_times` (0: the stages take equally long)."""
        t = self.stage_times()
        return max(t) / min(t) - 1 if t and min(t) > 0 else 0.0

    def lines(self) -> list:
        out = [f"virtual workers of {len(self.stage_flops) or '?'} stages, one wave = one flushed 1F1B batch; "
               f"WSP with staleness D={self.staleness} (a virtual worker at most {self.staleness} wave(s) ahead of "
               "the slowest)"]
        for s, (d, f, v) in enumerate(zip(self.stage_devices, self.stage_flops, self.stage_speed)):
            out.append(f"stage {s} on {d}: {f / 1e6:.2f} MFLOP forward per microbatch at {v / 1e9:.3g} GFLOP/s = "
                       f"{f / v * 1e6:.1f} us")
        if self.stage_flops:
            out.append(f"the slowest stage takes {self.imbalance():.0%} longer than the fastest; the FLOP-balanced cut "
                       f"would be {self.flop_cuts}")
        return out


@register_feature
class HetPipe(PipelineSchedule):
    name = "hetpipe"
    doc = ("HetPipe: pipelines (virtual workers) over unequal devices, cut by device speed and memory, synchronised "
           "through parameter servers by wave synchronous parallel")
    schedules = {"hetpipe": hetpipe}
    papers = {"hetpipe": "HetPipe (Park et al., USENIX ATC'20): virtual workers cut by device speed, wave "
                         "synchronous parallel across them through parameter servers"}
    options = {"staleness": Option(0, (
        "HetPipe's staleness bound D (``schedule='hetpipe'``): a virtual worker may start wave c once every virtual "
        "worker has pushed the waves before c - D; 0: synchronous data parallelism over the pipelines"))}
    section = HetPipeSection
    conflicts_with = _CONFLICTS

    def settle(self, strategy) -> None:
        """Check what HetPipe is given, then set the WSP it runs on: ``sync=S.SSP(staleness=D)``."""
        d = strategy.option("staleness")
        me = f"Strategy(schedule='hetpipe', staleness={d!r})"
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise StrategyError(f"{me}: D, the most waves a virtual worker may run ahead of the slowest, must be an "
                                "int >= 0 (0: every wave waits for every virtual worker's previous one)")
        if strategy.dp < 2:
            raise StrategyError(f"{me}, dp={strategy.dp}: HetPipe's virtual workers are the dp replicas of the "
                                "pipeline and it needs two or more (dp >= 2); with one, use schedule='1f1b'")
        if strategy.tp > 1:
            raise StrategyError(f"{me}, tp={strategy.tp}: the parameter servers hold whole parameters and each stage "
                                "pushes its whole update, which tensor parallelism splits; train with tp=1")
        on = {f.name for f in enabled_features(strategy)} & set(_CONFLICTS)
        if on:
            raise StrategyError(f"{me}: feature(s) {sorted(on)} do not compose with HetPipe: its virtual workers step "
                                "at their own waves and sum nothing among themselves (each pushes its update to the "
                                "parameter servers); drop them")
        if strategy.option("grad_sync") != "allreduce":
            raise StrategyError(f"{me}, grad_sync={strategy.option('grad_sync')!r}: HetPipe replaces the gradient "
                                "sum with pushes to its parameter servers; drop grad_sync")
        want = SSP(staleness=d)
        given = strategy.option("sync")
        if given is not None and given != want:
            raise StrategyError(f"{me}, sync={given!r}: HetPipe synchronises its virtual workers by wave synchronous "
                                "parallel itself (sync=S.SSP(staleness=D) at one clock per wave); drop sync=")
        strategy.sync = want

    def plan(self, strategy, plan, cluster):
        return self.section(schedule="hetpipe", staleness=strategy.option("staleness"))

    def stage_devices(self, section, plan, cluster):
        """Per stage the slowest device holding it (the speed the stage's cost divides by) and the smallest memory,
        over the virtual workers: stage ``s``'s ranks are pipeline rank ``s``'s, one per dp index."""
        if cluster is None:
            return None
        speed, memory, names, slowest = [], [], [], []
        for s in range(plan.n_stages):
            ranks = [pr * plan.width + v for pr in plan.stage_to_rank[s] for v in range(plan.width)]
            slow = min(ranks, key=lambda r: (cluster.speed_of(r), r))
            small = min(ranks, key=lambda r: (cluster.device_of(r).memory_bytes, r))
            speed.append(cluster.speed_of(slow))
            memory.append(cluster.device_of(small).memory_bytes)
            names.append(f"{cluster.device_of(small).name} (rank {small})")
            slowest.append(f"{cluster.device_of(slow).name} (rank {slow})")
        section.stage_devices = slowest
        section.stage_speed, section.stage_memory = speed, memory
        return StageDevices(tuple(speed), tuple(memory), tuple(names))

    def cut_stages(self, section, strategy, plan, base, model, micro, loss_fn, cluster) -> tuple:
        trace, split = super().cut_stages(section, strategy, plan, base, model, micro, loss_fn, cluster)
        section.stage_flops = [st.flops for st in split.stages]
        if not section.stage_speed:
            section.stage_speed = [1.0] * len(split.stages)
        cands = cut_candidates(trace.gm, trace.roles, trace.module_types)
        fpb = flops_per_byte(cluster, section.stage_speed)     # as the speed-aware cut weighs a byte
        section.flop_cuts = balanced_cuts(trace.gm, trace.roles, cands, plan.n_stages, fpb)
        return trace, split
