"""Pipeline schedules as features: the base every schedule family shares, and the hand-written schedule.

``Strategy(pp=4, schedule="zb1p")`` enables the feature whose ``schedules`` list ``"zb1p"``; ``pp > 1`` without
``schedule=`` takes :data:`DEFAULT_SCHEDULE`; ``pp = 1`` without one runs the core's one-stage program (``single``:
no feature, no section). A family is one module (``fxpar/features/pipeline_*.py``) that declares:

* ``schedules``: name -> generator ``(p, m) -> fxpar.schedule.Schedule`` (the generators live in
  ``fxpar/schedule/``, the IR floor) and ``papers``: name -> one line for ``explain()``;
* its section class (:class:`PipelineSection`; ``asynchronous = True`` where the schedules keep several weight
  versions per stage: ``Plan.asynchronous`` then refuses what needs one version: ZeRO, offload, lr schedulers);
* what differs from the base: :meth:`PipelineSchedule.make_schedule` (how many batches one window covers, what a
  resumed window holds), :meth:`PipelineSchedule.grad_scale` (the gradient scale per update), checks
  (:meth:`~fxpar.Feature.validate`, and after the cut, :meth:`PipelineSchedule.cut_stages`).

The base plans what every pipeline shares: the stage cut (:meth:`PipelineSchedule.cut_stages`: one microbatch's
forward traced, ``passes.split_stages``'s balanced search over module boundaries, or the user's ``split_points``, or
a handed-back Plan's cuts). Every family is enabled by the value of the Strategy's ``schedule`` (its
``enabled_by``, as each gradient-sync method is by ``grad_sync``) and reads ``split_points``; both are core fields of
the Strategy. A user's schedule is a subclass registered from the user's own file::

    @fxpar.register_feature
    class Mine(PipelineSchedule):
        name = "mine"
        schedules = {"mine": my_generator}

    fxpar.Strategy(pp=2, schedule="mine", microbatches=4)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxpar.capture import trace_forward
from fxpar.errors import StrategyError
from fxpar.feature import Feature, PlanSection, register_feature, schedule_features, schedule_names
from fxpar.schedule import (Schedule, ScheduleDeadlockError, ScheduleError, ScheduleValidationError,
                            ensure_reduce_grad, simulate, validate as validate_schedule)
from passes.split_stages import imbalance_warning, split_stages

__all__ = ["PipelineSection", "PipelineSchedule", "HandWrittenSchedule", "DEFAULT_SCHEDULE", "asked_schedule",
           "flops_per_byte"]

DEFAULT_SCHEDULE = "1f1b"     # the schedule of Strategy(pp > 1) without schedule=


def asked_schedule(strategy):
    """The schedule ``strategy`` asks for: its ``schedule`` (a name or a ``Schedule``), :data:`DEFAULT_SCHEDULE` for a
    pipeline without one, None for one stage without one."""
    if strategy.schedule is None and strategy.pp > 1:
        return DEFAULT_SCHEDULE
    return strategy.schedule


@dataclass
class PipelineSection(PlanSection):
    """``schedule``: the schedule's name (``Plan.schedule`` reads it), or a hand-written schedule's text."""
    schedule: str = ""
    picks_schedule = True

    def lines(self) -> list:
        name = self.schedule if "\n" not in self.schedule else f"hand-written ({self.schedule.splitlines()[0]})"
        return [f"{name}, " + ("asynchronous: each stage updates inside the window, the versions in flight stashed"
                               if self.asynchronous else "synchronous: one weight version, flushed every step")]


def flops_per_byte(cluster, speeds=None) -> float:
    """The FLOPs a byte a stage receives weighs as in the cut search (``passes.split_stages.balanced_cuts``): the
    FLOPs done in the time the intra-node link takes to carry it. With per-stage ``speeds`` (FLOP/s, the search
    divides each stage's FLOPs by its speed relative to the fastest), at the fastest stage's speed; without, at the
    speed of the cluster's slowest device (``ClusterSpec.slowest_device``: one cut for every rank, the slowest
    stage sets the pace). 0 where the cluster is not known."""
    if cluster is None:
        return 0.0
    flops = max(speeds) if speeds else cluster.slowest_device().peak_flops
    return flops / cluster.intra_node.bandwidth


class PipelineSchedule(Feature):
    """Base of a pipeline schedule family. Not registered itself: register each family (a subclass)."""
    doc = "a pipeline schedule: stages on pipeline ranks, microbatches in flight"
    # the Strategy's core field ``schedule`` names the family (as ``grad_sync`` names a gradient-sync method); every
    # family reads the core field ``split_points`` in cut_stages
    enabled_by = ("schedule",)
    section = PipelineSection
    schedules: ClassVar[dict] = {}      # name -> generator (p, m) -> fxpar.schedule.Schedule
    papers: ClassVar[dict] = {}         # name -> the schedule and its paper, one line

    # ---- the decision ------------------------------------------------------------------------------
    def enabled(self, strategy) -> bool:
        asked = asked_schedule(strategy)
        return isinstance(asked, str) and asked in self.schedules

    def validate(self, strategy) -> None:
        if strategy.pp == 1:
            raise StrategyError(f"{strategy}: schedule={strategy.schedule!r} needs a pipeline (pp > 1); with pp=1 "
                                "the step runs as one stage (microbatches > 1 accumulate gradients). Drop "
                                "schedule= or set pp.")

    def plan(self, strategy, plan, cluster):
        return self.section(schedule=asked_schedule(strategy))

    def adopt(self, section, strategy, plan, cluster):
        if section.schedule not in self.schedules:
            by = [f.name for f in schedule_features() if section.schedule in getattr(f, "schedules", ())]
            raise StrategyError(f"the Plan's {self.name!r} section names schedule {section.schedule!r}, which feature "
                                f"{self.name!r} does not build (it builds {sorted(self.schedules)})"
                                + (f"; feature {by[0]!r} does: make the Plan with Strategy(pp={strategy.pp}, "
                                   f"schedule={section.schedule!r}) instead" if by else "; fix the section"))
        return section

    def make_schedule(self, section, plan, n_batches: int = 2, resumed: bool = False) -> Schedule:
        """The schedule a program of ``plan`` runs. ``n_batches``: the batches one window covers (a synchronous
        schedule covers one: it flushes every step); ``resumed``: the window continues a checkpointed run."""
        return self.schedules[section.schedule](plan.pp, plan.microbatches)

    def grad_scale(self, section, plan) -> float:
        """The factor each microbatch's gradient gets: one update averages ``plan.microbatches`` of them."""
        return 1.0 / plan.microbatches

    def cut_stages(self, section, strategy, plan, base, model, micro, loss_fn, cluster) -> tuple:
        """Cut the model into ``plan.n_stages`` stages: trace one microbatch's forward (``micro``, the model's inputs
        and target as the model takes them) and split it at the user's ``split_points``, a handed-back Plan's cuts
        (``base``), or the balanced search over module boundaries. Writes the cuts, the candidates, each stage's
        parameters and the tied ones into ``plan``; returns ``(forward trace, stage split)``."""
        trace = trace_forward(model, micro, loss_fn)
        cuts = base.cuts if base is not None and base.cuts else strategy.split_points
        devices = self.stage_devices(section, plan, cluster)
        fpb = flops_per_byte(cluster, devices.speed if devices is not None else None)
        split = split_stages(trace.gm, trace.roles, plan.n_stages, cuts, trace.module_types, fpb, devices)
        plan.cuts, plan.candidates = list(split.cuts), list(split.candidates)
        warn = imbalance_warning(split) if devices is None else ""      # unequal devices: FLOPs unequal on purpose
        if warn:
            plan.notes.append(warn)
        plan.stage_params = [list(st.params) for st in split.stages]
        plan.tied = {k: list(v) for k, v in split.shared_params.items()}
        _check_written_buffers(split, plan, model)
        return trace, split

    def stage_devices(self, section, plan, cluster):
        """The devices the stages run on, for a cut that balances their times and fits their memory
        (``passes.split_stages.StageDevices``), or None: the cut balances FLOPs (the base)."""
        return None

    # ---- its words ---------------------------------------------------------------------------------------
    def explain(self, section, program) -> list:
        paper = self.papers.get(section.schedule)
        return ([paper] if paper else []) + section.lines()


def _check_written_buffers(split, plan, model) -> None:
    """Buffers a stage's forward updates (BatchNorm's running statistics) stay exact when one pipeline rank holds the
    stage and one replica trains it: the rank updates them microbatch by microbatch, in order, as one process with
    gradient accumulation does. A stage held twice (Chimera) would split the updates between its copies, and dp
    replicas of a pipeline are not made to agree on them: refused by name."""
    written = {k: st.index for st in split.stages for k in st.written}
    if not written:
        return
    what = (f"{type(model).__name__} updates buffers in forward ({', '.join(repr(k) for k in list(written)[:4])}"
            f"{', ...' if len(written) > 4 else ''}: BatchNorm running statistics)")
    fix = ("Put those modules in eval mode, use a norm without running statistics (LayerNorm, GroupNorm), or ")
    twice = sorted({s for s in written.values() if len(plan.stage_to_rank[s]) > 1})
    if twice:
        raise StrategyError(f"{what}; schedule {plan.schedule!r} holds stage(s) {twice} on two pipeline ranks, which "
                            f"would each update their own copy. {fix}use a schedule with one copy of each stage "
                            "(gpipe, 1f1b, interleaved, zb1p).")
    if plan.dp > 1:
        raise StrategyError(f"{what}; with dp={plan.dp} each data-parallel replica of the pipeline would keep its own "
                            f"running statistics (buffers are broadcast from dp-rank 0 only without a pipeline). {fix}"
                            "train this model with dp alone or pp alone.")


@dataclass
class HandWrittenSection(PipelineSection):
    """``schedule``: the hand-written schedule's text (``Schedule.parse`` reads it back)."""


@register_feature
class HandWrittenSchedule(PipelineSchedule):
    """``Strategy(schedule=Schedule or its text)``: validated and dry-run when the program is built."""
    name = "hand_written_schedule"
    doc = "a hand-written schedule: a fxpar.schedule.Schedule or its text, validated and dry-run when built"
    section = HandWrittenSection

    def enabled(self, strategy) -> bool:
        return isinstance(strategy.schedule, Schedule)

    def validate(self, strategy) -> None:
        """One stage is allowed: a hand-written step order on one rank."""

    def plan(self, strategy, plan, cluster):
        section = self.section(schedule=str(strategy.schedule))
        self._check(section, strategy, plan)
        return section

    def adopt(self, section, strategy, plan, cluster):
        self._check(section, strategy, plan)
        return section

    def make_schedule(self, section, plan, n_batches: int = 2, resumed: bool = False) -> Schedule:
        return ensure_reduce_grad(Schedule.parse(section.schedule))

    def _check(self, section, strategy, plan) -> None:
        try:
            sched = self.make_schedule(section, plan)
        except ScheduleError as e:
            raise StrategyError(f"{strategy}: {e}") from e
        pp, m = strategy.pp, strategy.microbatches
        if sched.n_ranks != pp or sorted(sched.actions) != list(range(pp)):
            raise StrategyError(f"{strategy}: the schedule lists ranks {sorted(sched.actions)}, but pp={pp} needs "
                                f"ranks 0..{pp - 1}; write one 'rank R:' line per pipeline rank or change pp.")
        if sched.n_microbatches != m:
            raise StrategyError(f"{strategy}: the schedule covers {sched.n_microbatches} microbatches but "
                                f"microbatches={m}; set Strategy(microbatches={sched.n_microbatches}).")
        if any(a.version is not None for acts in sched.actions.values() for a in acts):
            asynchronous = " or ".join(repr(n) for n in schedule_names(asynchronous=True))
            raise StrategyError(f"{strategy}: a hand-written schedule with weight versions (@v, asynchronous) is not "
                                "run yet: the runtime would need it to cover every batch of the run in one window. "
                                f"Use schedule={asynchronous}, or drop the versions for a synchronous schedule.")
        try:
            validate_schedule(sched)
        except ScheduleValidationError as e:
            raise ScheduleValidationError([f"hand-written schedule {sched.name!r}: {q}" for q in e.problems]) from None
        try:
            simulate(sched)
        except ScheduleDeadlockError as e:
            raise ScheduleDeadlockError(f"{strategy}: hand-written {e}", e.stuck) from None

    def explain(self, section, program) -> list:
        return [f"hand-written schedule {section.schedule.splitlines()[0]!r}: validated and dry-run when built"]
